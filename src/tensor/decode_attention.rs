//! [`decode_attention_lse`]: attention of one query per sequence to a KV cache, FlashDecoding's
//! way: the keys are cut into chunks, each (sequence, chunk) is a task giving a *record* per
//! query head (its normalised output over the chunk and the chunk's log-sum-exp),
//! and the records are combined with log-sum-exp weights. A decode has one query row per head,
//! so a task is not a product of tiles but a stream over the chunk's keys: each key (and value)
//! row is read once, widened once, and used by every query head of its kv head
//! (grouped-query attention).
//!
//! The sequence-parallel [`flash_decode`](crate::fused::flash_decode) is the same split across
//! ranks: its kernel runs these tasks on each rank's keys and combines every rank's records.

use num_traits::Float;
use rayon::prelude::*;

use super::{Accumulator, Element, Tensor, exp_row};
use crate::{Error, Result};

const OP: &str = "decode_attention_lse";
/// Keys per task: a chunk's records are `dv + 1` values per query head, against `d + dv` read
/// per key, so the records are a small part of what a task moves.
pub(crate) const KEY_CHUNK: usize = 256;
/// Most query heads per kv head.
pub(crate) const MAX_GROUP: usize = 64;
/// Tasks a decode's keys are cut into at least (per sequence, spread over the batch), when there
/// are chunks enough: each task is a *span* of whole chunks, merged into one record per head
/// before anything reads them, so that the combine reads a few records per sequence and head,
/// not one per chunk (at 16384 keys, 64 records of `dv + 1` values per head were 3 to 5% of a
/// bf16 decode's bytes, read again by every rank of the sequence-parallel op).
const MIN_TASKS: usize = 16;

/// How `keys` keys of each of `batch` sequences are cut into spans of whole chunks: the number
/// of spans per sequence and the keys of each span (the last takes what is left); `(0, 0)`
/// without keys. Depends on nothing but its arguments, so that every rank cuts a rank's keys alike.
pub(crate) fn spans(keys: usize, batch: usize) -> (usize, usize) {
    let chunks = keys.div_ceil(KEY_CHUNK);
    if chunks == 0 {
        return (0, 0);
    }
    let wanted = MIN_TASKS.div_ceil(batch.max(1)).clamp(1, chunks);
    let per = chunks.div_ceil(wanted) * KEY_CHUNK;
    (keys.div_ceil(per), per)
}

/// The shapes of a decode: `heads` query heads on `kv_heads` kv heads, widths `d` and `dv`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Heads {
    pub(crate) heads: usize,
    pub(crate) kv_heads: usize,
    pub(crate) d: usize,
    pub(crate) dv: usize,
}

impl Heads {
    /// Query heads per kv head.
    pub(crate) fn group(&self) -> usize {
        self.heads / self.kv_heads.max(1)
    }

    /// Values of one record: an output row and its log-sum-exp.
    pub(crate) fn record(&self) -> usize {
        self.dv + 1
    }
}

/// What is wrong with the shapes of a decode (`q` `[batch, heads, d]`, `k` and `v`
/// `[batch, keys, kv_heads, d or dv]`), if anything.
pub(crate) fn decode_shape_problem(q: &[usize], k: &[usize], v: &[usize]) -> Option<String> {
    let shapes = format!("q {q:?}, k {k:?}, v {v:?}");
    if q.len() != 3 || k.len() != 4 || v.len() != 4 {
        return Some(format!(
            "{shapes}: q is [batch, heads, d], k and v [batch, keys, kv_heads, d or dv]"
        ));
    }
    let (heads, kv_heads) = (q[1], k[2]);
    let problem = if k[0] != q[0] || v[0] != q[0] {
        "the batch sizes differ"
    } else if k[1] != v[1] || v[2] != kv_heads {
        "k and v hold different keys or kv heads"
    } else if k[3] != q[2] {
        "q and k have different widths d"
    } else if kv_heads == 0 || heads % kv_heads != 0 {
        "heads is not a multiple of kv_heads"
    } else if heads / kv_heads > MAX_GROUP {
        "more than 64 query heads per kv head"
    } else {
        return None;
    };
    Some(format!("{shapes}: {problem}"))
}

/// A task's own memory: its query rows, widened and scaled; one key or value row (every kv
/// head) widened; the scores of a chunk.
pub(crate) struct DecodeScratch<A: Element> {
    queries: Vec<A>,
    row: Vec<A>,
    scores: Vec<A>,
}

impl<A: Element> DecodeScratch<A> {
    pub(crate) fn new(h: &Heads) -> Self {
        DecodeScratch {
            queries: vec![<A as Element>::zero(); h.heads * h.d],
            row: vec![<A as Element>::zero(); 2 * h.kv_heads * h.d.max(h.dv)],
            scores: vec![<A as Element>::zero(); h.heads * KEY_CHUNK],
        }
    }
}

/// The records of one task into `records` (one per query head, `dv + 1` values each): the
/// query rows `q` (`[heads, d]`) against `keys` keys (at most [`KEY_CHUNK`]), key `j` of every
/// kv head at `k[j * k_stride..][..kv_heads * d]` and its values at
/// `v[j * v_stride..][..kv_heads * dv]`. A task takes every head of its keys, so that it reads
/// them front to back (one kv head's keys alone are runs of `d` values a row apart: a page
/// apart at `kv_heads * d = 1024` f32, which the prefetcher does not follow).
///
/// Compiled twice: for the baseline x86-64 (SSE2) and, chosen at run time where the CPU has
/// them, with AVX2 and FMA, whose 8-lane vectors the loops over `d` fill.
#[allow(clippy::too_many_arguments)]
pub(crate) fn decode_records<T: Element>(
    h: &Heads,
    q: &[T],
    k: (&[T], usize),
    v: (&[T], usize),
    keys: usize,
    scale: f64,
    s: &mut DecodeScratch<T::Acc>,
    records: &mut [T::Acc],
) {
    #[cfg(target_arch = "x86_64")]
    if avx2() {
        // SAFETY: the CPU has AVX2 and FMA (checked).
        return unsafe { decode_records_avx2(h, q, k, v, keys, scale, s, records) };
    }
    decode_records_body(h, q, k, v, keys, scale, s, records)
}

/// The records of one span of `keys` keys (any number): [`decode_records`] on each chunk of
/// [`KEY_CHUNK`] keys, each chunk's records merged into `records` (log-sum-exp weights, chunks in
/// order) through `chunk_records` (as long as `records`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn decode_span_records<T: Element>(
    h: &Heads,
    q: &[T],
    (k, k_stride): (&[T], usize),
    (v, v_stride): (&[T], usize),
    keys: usize,
    scale: f64,
    s: &mut DecodeScratch<T::Acc>,
    (records, chunk_records): (&mut [T::Acc], &mut [T::Acc]),
) {
    let rec = h.record();
    for (i, key0) in (0..keys).step_by(KEY_CHUNK).enumerate() {
        let n = KEY_CHUNK.min(keys - key0);
        let (k, v) = ((&k[key0 * k_stride..], k_stride), (&v[key0 * v_stride..], v_stride));
        let into = if i == 0 { &mut *records } else { &mut *chunk_records };
        decode_records(h, q, k, v, n, scale, s, into);
        if i > 0 {
            for (total, part) in records.chunks_exact_mut(rec).zip(chunk_records.chunks_exact(rec))
            {
                merge(total, part);
            }
        }
    }
}

/// `total = total (+) part` for two normalised records (outputs, then log-sum-exp) of the same
/// query: the log-sum-exp-weighted mean of the outputs, and the log-sum-exp of both. Both are
/// records of at least one key, so their log-sum-exps are finite.
fn merge<A: Accumulator>(total: &mut [A], part: &[A]) {
    let dv = total.len() - 1;
    let (a, b) = (total[dv], part[dv]);
    let top = a.max(b);
    let (wa, wb) = ((a - top).exp(), (b - top).exp());
    let inv = (wa + wb).recip();
    for (t, &p) in total[..dv].iter_mut().zip(&part[..dv]) {
        *t = (*t * wa + p * wb) * inv;
    }
    total[dv] = top + (wa + wb).ln();
}

/// Whether this CPU has AVX2 and FMA (checked once).
#[cfg(target_arch = "x86_64")]
fn avx2() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    })
}

/// [`decode_records_body`] compiled with AVX2 and FMA.
///
/// # Safety
/// The CPU has AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn decode_records_avx2<T: Element>(
    h: &Heads,
    q: &[T],
    k: (&[T], usize),
    v: (&[T], usize),
    keys: usize,
    scale: f64,
    s: &mut DecodeScratch<T::Acc>,
    records: &mut [T::Acc],
) {
    decode_records_body(h, q, k, v, keys, scale, s, records)
}

/// [`decode_records`]' body, inlined into each of its two compilations.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn decode_records_body<T: Element>(
    h: &Heads,
    q: &[T],
    (k, k_stride): (&[T], usize),
    (v, v_stride): (&[T], usize),
    keys: usize,
    scale: f64,
    s: &mut DecodeScratch<T::Acc>,
    records: &mut [T::Acc],
) {
    let (g, d, dv, rec) = (h.group(), h.d, h.dv, h.record());
    debug_assert!(keys > 0 && keys <= KEY_CHUNK);
    let scale = T::Acc::from_f64(scale);
    // Scores come out scaled: the queries are.
    for (w, &x) in s.queries.iter_mut().zip(&q[..h.heads * d]) {
        *w = x.to_acc() * scale;
    }
    let scores = &mut s.scores[..h.heads * keys];
    for j in 0..keys {
        prefetch(k, (j + AHEAD) * k_stride, h.kv_heads * d);
        let row = widen(&k[j * k_stride..][..h.kv_heads * d], &mut s.row[..h.kv_heads * d]);
        for (head, query) in s.queries.chunks_exact(d).enumerate() {
            scores[head * keys + j] = dot(query, &row[head / g * d..][..d]);
        }
    }
    let one = <T::Acc as Element>::from_f64(1.0);
    let mut sums = vec![one; h.heads];
    let rows = scores.chunks_exact_mut(keys).zip(records.chunks_exact_mut(rec));
    for ((row, record), sum) in rows.zip(&mut sums) {
        let max = row.iter().fold(T::Acc::neg_infinity(), |m, &x| m.max(x));
        *sum = exp_row(row, one, max);
        record[dv] = max + sum.ln();
        record[..dv].fill(<T::Acc as Element>::zero());
    }
    // Two value rows at a time: each record is read and written once per pair (the records'
    // loads and stores, not the arithmetic, bound this loop).
    let width = h.kv_heads * dv;
    let (rows, second) = s.row.split_at_mut(width.max(1));
    for j in (0..keys).step_by(2) {
        prefetch(v, (j + AHEAD) * v_stride, 2 * width);
        let a = widen(&v[j * v_stride..][..width], &mut rows[..width]);
        let (b, pair) = match j + 1 < keys {
            true => (widen(&v[(j + 1) * v_stride..][..width], &mut second[..width]), true),
            false => (a, false),
        };
        for (head, record) in records.chunks_exact_mut(rec).enumerate() {
            let pa = scores[head * keys + j];
            let pb = if pair { scores[head * keys + j + 1] } else { <T::Acc as Element>::zero() };
            let (xa, xb) = (&a[head / g * dv..][..dv], &b[head / g * dv..][..dv]);
            for ((o, &x), &y) in record[..dv].iter_mut().zip(xa).zip(xb) {
                *o += pa * x + pb * y;
            }
        }
    }
    for (record, sum) in records.chunks_exact_mut(rec).zip(sums) {
        let inv = sum.recip();
        record[..dv].iter_mut().for_each(|o| *o = *o * inv);
    }
}

/// Rows ahead of the one in use that [`prefetch`] asks for.
const AHEAD: usize = 4;

/// Asks the cache for `x[from..from + len]` (what is inside `x`), a line at a time. A row of
/// every kv head is a page or more (`kv_heads * d = 1024` f32), and the hardware prefetcher
/// does not cross pages: without this each row starts with a miss (half the single-core
/// bandwidth on a Zen 3, f32, 8192 keys).
#[inline(always)]
fn prefetch<T>(x: &[T], from: usize, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        let end = (from + len).min(x.len());
        let line = (64 / size_of::<T>().max(1)).max(1);
        let mut at = from;
        while at < end {
            // SAFETY: a prefetch of an address inside `x` (it only reads, and never faults).
            unsafe { _mm_prefetch::<_MM_HINT_T0>(x.as_ptr().add(at).cast()) };
            at += line;
        }
    }
}

/// `x` in the accumulator type: itself where it is its own (f32, f64), else widened into `row`.
#[inline(always)]
fn widen<'a, T: Element>(x: &'a [T], row: &'a mut [T::Acc]) -> &'a [T::Acc] {
    if T::DTYPE == <T::Acc as Element>::DTYPE {
        // SAFETY: `T` and `T::Acc` are one type (one dtype), so the slice is itself.
        unsafe { std::slice::from_raw_parts(x.as_ptr().cast(), x.len()) }
    } else {
        for (w, &v) in row.iter_mut().zip(x) {
            *w = v.to_acc();
        }
        row
    }
}

/// `a . b` in four vectors of eight lanes: four independent chains of sums, so that the adds
/// do not wait on each other (one chain is bound by the add's latency: half the speed at
/// `d = 128` on a Zen 3), then the lanes summed as a tree.
#[inline(always)]
fn dot<A: Accumulator>(a: &[A], b: &[A]) -> A {
    #[cfg(target_arch = "x86_64")]
    if A::DTYPE == crate::DType::F32 && avx2() {
        // SAFETY: `A` is f32 (its dtype); the CPU has AVX2 and FMA (checked).
        let (a, b) = unsafe {
            (
                std::slice::from_raw_parts(a.as_ptr().cast::<f32>(), a.len()),
                std::slice::from_raw_parts(b.as_ptr().cast::<f32>(), b.len()),
            )
        };
        // SAFETY: as above.
        return A::from_f64(unsafe { dot_f32_avx2(a, b) } as f64);
    }
    let zero = <A as Element>::zero();
    let mut lanes = [zero; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            lanes[i] += x[i] * y[i];
        }
    }
    let mut sum = zero;
    for (x, y) in ra.iter().zip(rb) {
        sum += *x * *y;
    }
    lanes.iter().fold(sum, |s, &l| s + l)
}

/// `a . b` in f32 with four 8-lane accumulators (four independent chains of fused
/// multiply-adds: one chain waits on the add's latency), summed as a tree.
///
/// # Safety
/// The CPU has AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_f32_avx2(a: &[f32], b: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let n = a.len().min(b.len());
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    // SAFETY: every load is of 8 floats below `n`, inside both slices.
    unsafe {
        while i + 32 <= n {
            for (v, acc) in acc.iter_mut().enumerate() {
                let at = i + 8 * v;
                *acc =
                    _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(at)), _mm256_loadu_ps(pb.add(at)), *acc);
            }
            i += 32;
        }
        while i + 8 <= n {
            acc[0] =
                _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), acc[0]);
            i += 8;
        }
    }
    let sum = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    let half = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
    let pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
    let one = _mm_add_ss(pair, _mm_shuffle_ps(pair, pair, 1));
    let mut total = _mm_cvtss_f32(one);
    for j in i..n {
        total += a[j] * b[j];
    }
    total
}

/// Records combined with log-sum-exp weights, one at a time (online: what is summed is rescaled
/// when the maximum grows).
pub(crate) struct Combine<'a, A: Element> {
    max: A,
    sum: A,
    acc: &'a mut [A],
}

impl<'a, A: Accumulator> Combine<'a, A> {
    /// Starts with nothing, accumulating into `acc` (`dv` values, overwritten).
    pub(crate) fn new(acc: &'a mut [A]) -> Self {
        acc.fill(<A as Element>::zero());
        Combine { max: A::neg_infinity(), sum: <A as Element>::zero(), acc }
    }

    /// Adds one record (`dv` outputs, then their log-sum-exp).
    pub(crate) fn add(&mut self, record: &[A]) {
        let dv = self.acc.len();
        let part = record[dv];
        if part == A::neg_infinity() {
            return;
        }
        // `part` is finite, so `top` is, and `max - top` is minus infinity at most.
        let top = self.max.max(part);
        let (old, new) = ((self.max - top).exp(), (part - top).exp());
        self.sum = self.sum * old + new;
        for (a, &o) in self.acc.iter_mut().zip(&record[..dv]) {
            *a = *a * old + o * new;
        }
        self.max = top;
    }

    /// The combined output row into `out`, and its log-sum-exp (zeros and minus infinity with
    /// no records).
    pub(crate) fn finish<T: Element<Acc = A>>(self, out: &mut [T]) -> A {
        let inv = if self.sum > <A as Element>::zero() {
            self.sum.recip()
        } else {
            <A as Element>::zero()
        };
        for (o, &a) in out.iter_mut().zip(self.acc.iter()) {
            *o = T::from_acc(a * inv);
        }
        self.max + self.sum.ln()
    }
}

/// Attention of one query per sequence to its cached keys: `softmax(q k^T * scale) v` for `q`
/// of `[batch, heads, d]`, keys `k` of `[batch, keys, kv_heads, d]` and values `v` of
/// `[batch, keys, kv_heads, dv]` (a KV cache's layout); query head `h` attends with kv head
/// `h / (heads / kv_heads)`. Returns `[batch, heads, dv]` and the log-sum-exp `[batch, heads]`
/// of each query's scaled scores (zeros and minus infinity with no keys). No mask: a decoding
/// query sees every cached key. Computed in the accumulator type, rounded once.
///
/// # Errors
/// [`Error::InvalidShape`] when the shapes disagree (or more than 64 query heads share a kv
/// head); [`Error::OutOfMemory`].
///
/// # Examples
/// ```
/// use dist_tensor::Tensor;
/// use dist_tensor::tensor::{decode_attention_lse, scaled_dot_product_attention_lse};
/// let (q, k, v) = (Tensor::<f64>::random(&[1, 2, 4], 1), Tensor::random(&[1, 9, 1, 4], 2), Tensor::random(&[1, 9, 1, 3], 3));
/// let (o, lse) = decode_attention_lse(&q, &k, &v, 0.5)?;
/// // Both heads use the one kv head: the same as attention with 2 query rows.
/// let (want, want_lse) = scaled_dot_product_attention_lse(
///     &q.reshape(&[2, 4])?, &k.reshape(&[9, 4])?, &v.reshape(&[9, 3])?, false, 0.5)?;
/// assert!(o.as_slice().iter().zip(want.as_slice()).all(|(a, b)| (a - b).abs() < 1e-12));
/// assert!((lse.as_slice()[1] - want_lse.as_slice()[1]).abs() < 1e-12);
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn decode_attention_lse<T: Element>(
    q: &Tensor<T>,
    k: &Tensor<T>,
    v: &Tensor<T>,
    scale: f64,
) -> Result<(Tensor<T>, Tensor<T::Acc>)> {
    if let Some(reason) = decode_shape_problem(q.shape(), k.shape(), v.shape()) {
        return Err(Error::InvalidShape { op: OP, reason });
    }
    let (batch, keys) = (q.shape()[0], k.shape()[1]);
    let h =
        Heads { heads: q.shape()[1], kv_heads: k.shape()[2], d: q.shape()[2], dv: v.shape()[3] };
    let rec = h.record();
    let (spans, per) = spans(keys, batch);
    let mut out = Tensor::<T>::try_zeros(&[batch, h.heads, h.dv])?;
    let mut lse = Tensor::<T::Acc>::try_zeros(&[batch, h.heads])?;
    // Records of task (b, span), every head's, in that order.
    let mut records = vec![<T::Acc as Element>::zero(); batch * spans * h.heads * rec];
    let (qs, ks, vs) = (q.as_slice(), k.as_slice(), v.as_slice());
    let (k_row, v_row) = (h.kv_heads * h.d, h.kv_heads * h.dv);
    records.par_chunks_mut((h.heads * rec).max(1)).enumerate().for_each_init(
        || (DecodeScratch::new(&h), vec![<T::Acc as Element>::zero(); h.heads * rec]),
        |(scratch, chunk), (t, records)| {
            let (b, key0) = (t / spans, t % spans * per);
            let q_rows = &qs[b * h.heads * h.d..][..h.heads * h.d];
            let n = per.min(keys - key0);
            let k = (&ks[(b * keys + key0) * k_row..], k_row);
            let v = (&vs[(b * keys + key0) * v_row..], v_row);
            decode_span_records(&h, q_rows, k, v, n, scale, scratch, (records, chunk));
        },
    );
    let rows =
        out.as_mut_slice().par_chunks_mut(h.dv.max(1)).zip(lse.as_mut_slice().par_iter_mut());
    rows.enumerate().for_each_init(
        || vec![<T::Acc as Element>::zero(); h.dv],
        |acc, (row, (out, lse))| {
            let (b, head) = (row / h.heads, row % h.heads);
            let mut combine = Combine::new(acc);
            for c in 0..spans {
                combine.add(&records[((b * spans + c) * h.heads + head) * rec..][..rec]);
            }
            *lse = combine.finish(out);
        },
    );
    Ok((out, lse))
}
