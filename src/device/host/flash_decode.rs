//! flash_decode's tile kernel on the host (the op, its agreement and its unfused baseline:
//! [`crate::fused::flash_decode`]).
//!
//! One launch, two phases, no host barrier between them. A task of the first phase is one
//! `(batch, kv head, chunk of this rank's keys)`: the scores of the kv head's group of query
//! heads against the chunk, their softmax and the weighted sum of the chunk's values, normalised,
//! with the log-sum-exp of the scores: one *record* `[o (Dv), lse]` per query head. The task
//! writes its records straight into every rank's symmetric receive buffer (peers rotated, its own
//! rank too), at the place the agreed key counts give them; each program then adds the number of
//! tasks it finished to each rank's signal for this source (a put carries its own signal to a
//! peer on another node). A task of the second phase is one `(batch, head)`: once every source's
//! count is complete, it combines the records of every rank's chunks (log-sum-exp weights, in
//! rank order, so that every rank computes the same bits) into the output row.
//!
//! A receive buffer is rewritten only in the next call, after its agreement exchange, which every
//! rank enters only once it has read its buffer in this one.

use crate::Result;
use crate::device::host::all_to_all::copying_programs;
use crate::device::{LaunchMode, launch, tile};
use crate::shmem::{
    GlobalPtr, GlobalPtrMut, NotifySem, Rank, Scope, SignalBuf, SignalOp, SymmBuf, Token, WaitCmp,
    WaitSem, Workspace, consume_token, symm_at,
};
use num_traits::Float;

use crate::tensor::{Element, Tensor, exp_row};

const OP: &str = "flash_decode";
/// Keys per task: a chunk's records are `Dv + 1` values per query head, against `D + Dv` read
/// per key, so the records are a small part of what a task moves (1/512 per key and head).
pub(crate) const KEY_CHUNK: usize = 512;
/// Most query heads per kv head (the agreement refuses more).
pub(crate) const MAX_GROUP: usize = 64;

/// The agreed shapes of one call: `q` `[batch, heads, d]` on every rank, rank `r`'s keys
/// `[batch, keys[r], kv_heads, d]` and values `[batch, keys[r], kv_heads, dv]`.
#[derive(Debug, Clone)]
pub(crate) struct DecodeLayout {
    pub(crate) batch: usize,
    pub(crate) heads: usize,
    pub(crate) kv_heads: usize,
    pub(crate) d: usize,
    pub(crate) dv: usize,
    pub(crate) keys: Vec<usize>,
    pub(crate) scale: f64,
}

impl DecodeLayout {
    /// Query heads per kv head.
    pub(crate) fn group(&self) -> usize {
        self.heads / self.kv_heads.max(1)
    }

    /// Chunks of rank `r`'s keys.
    pub(crate) fn chunks(&self, r: usize) -> usize {
        self.keys[r].div_ceil(KEY_CHUNK)
    }

    /// Values of one record: the output row and its log-sum-exp.
    pub(crate) fn record(&self) -> usize {
        self.dv + 1
    }

    /// First-phase tasks of rank `r`: one per (batch, kv head, chunk).
    pub(crate) fn tasks(&self, r: usize) -> usize {
        self.batch * self.kv_heads * self.chunks(r)
    }

    /// Where rank `r`'s records start in every receive buffer, and (last) the buffer's length.
    pub(crate) fn source_offsets(&self) -> Vec<usize> {
        let mut offsets = vec![0];
        for r in 0..self.keys.len() {
            let last = *offsets.last().expect("starts with 0");
            offsets.push(last + self.batch * self.chunks(r) * self.heads * self.record());
        }
        offsets
    }
}

struct FlashDecodeWorkspace<A: Element> {
    recv: Option<SymmBuf<A>>,
    arrived: SignalBuf,
    expected: Vec<u64>,
}

impl<A: Element> Workspace for FlashDecodeWorkspace<A> {
    fn symmetric_bytes(&self) -> usize {
        self.arrived.len() * 64 + self.recv.as_ref().map_or(0, |r| r.len() * size_of::<A>())
    }
}

impl<A: Element> FlashDecodeWorkspace<A> {
    fn new(rank: &Rank<'_>) -> Result<Self> {
        let n = rank.num_ranks();
        Ok(FlashDecodeWorkspace {
            recv: None,
            arrived: rank.alloc_signals_for("flash_decode arrived", n)?,
            expected: vec![0; n],
        })
    }
}

/// The kernel: this rank's `[batch, heads, dv]` output and `[batch, heads]` log-sum-exp, the
/// same on every rank.
pub(crate) fn flash_decode<T: Element>(
    rank: &Rank<'_>,
    layout: &DecodeLayout,
    q: &Tensor<T>,
    k: &Tensor<T>,
    v: &Tensor<T>,
) -> Result<(Tensor<T>, Tensor<T::Acc>)> {
    rank.with_workspace(FlashDecodeWorkspace::<T::Acc>::new, |ws| run(rank, ws, layout, q, k, v))
}

fn run<T: Element>(
    rank: &Rank<'_>,
    ws: &mut FlashDecodeWorkspace<T::Acc>,
    l: &DecodeLayout,
    q: &Tensor<T>,
    k: &Tensor<T>,
    v: &Tensor<T>,
) -> Result<(Tensor<T>, Tensor<T::Acc>)> {
    let (me, n) = (rank.rank(), rank.num_ranks());
    let offsets = l.source_offsets();
    rank.reserve_for("flash_decode receive", &mut ws.recv, offsets[n].max(1))?;
    for src in 0..n {
        ws.expected[src] += l.tasks(src) as u64;
    }
    let mut out = Tensor::<T>::scratch(OP, &[l.batch, l.heads, l.dv])?;
    let mut lse = Tensor::<T::Acc>::scratch(OP, &[l.batch, l.heads])?;
    let (q_ptr, k_ptr) = (GlobalPtr::from_slice(q.as_slice()), GlobalPtr::from_slice(k.as_slice()));
    let v_ptr = GlobalPtr::from_slice(v.as_slice());
    let (out_ptr, lse_ptr) = (
        GlobalPtrMut::from_slice(out.as_mut_slice()),
        GlobalPtrMut::from_slice(lse.as_mut_slice()),
    );
    let (recv, arrived, expected) =
        (ws.recv.as_ref().expect("reserved"), &ws.arrived, &ws.expected);
    let inputs = Inputs { q: q_ptr, k: k_ptr, v: v_ptr, v_acc: as_acc(v.as_slice()) };
    // SAFETY: a task writes its records into each rank's receive buffer at the place of its own
    // (source, batch, chunk, heads), which no other task of any rank writes, and announces them
    // after writing; records are read only after every source's count is complete. A receive
    // buffer is rewritten only after the next call's exchange. Output rows have one writer each.
    unsafe {
        launch(rank, LaunchMode::VectorOnly, copying_programs(rank), |p| {
            let mut scratch = Scratch::<T>::new(l);
            let mut done = 0u64;
            for t in p.tasks(l.tasks(me)) {
                partial(l, &inputs, t, me, &mut scratch);
                for dst in (0..n).map(|i| (me + i) % n) {
                    let at = offsets[me] + scratch.record_at;
                    let records = &scratch.records[..];
                    if p.is_local(dst) {
                        tile::store_1d(symm_at(recv, dst) + at, records, records.len());
                    } else {
                        // Through the proxy: the put carries its own signal.
                        let signal = (arrived, me);
                        let from = GlobalPtr::from_slice(records);
                        p.put_signal(recv.ptr() + at, dst, from, records.len(), signal, add(1))?;
                    }
                }
                done += 1;
            }
            if done > 0 {
                for dst in (0..n).map(|i| (me + i) % n).filter(|&dst| p.is_local(dst)) {
                    p.notify(arrived, me, dst, add(done), Scope::Peer, NotifySem::Release)?;
                }
            }
            let mut tokens: Vec<Option<Token>> = vec![None; n];
            for task in p.tasks(l.batch * l.heads) {
                for src in (0..n).filter(|&s| l.tasks(s) > 0) {
                    if tokens[src].is_none() {
                        let want = WaitCmp::Ge(expected[src]);
                        tokens[src] =
                            Some(p.wait_from(arrived, src, src, want, WaitSem::Acquire)?);
                    }
                }
                combine(l, &offsets, recv, &tokens, task, &mut scratch, out_ptr, lse_ptr);
            }
            Ok(())
        })?;
    }
    Ok((out, lse))
}

fn add(count: u64) -> SignalOp {
    SignalOp::Add(count)
}

/// What the first phase reads: `q`, `k`, `v` as they are, and `v` in the accumulator type when
/// it is its own (f32, f64; half types are widened a chunk at a time).
struct Inputs<'a, T: Element> {
    q: GlobalPtr<'a, T>,
    k: GlobalPtr<'a, T>,
    v: GlobalPtr<'a, T>,
    v_acc: Option<&'a [T::Acc]>,
}

/// A program's own memory: one chunk's scores and values (widened), a task's records, and a
/// combine task's rows.
struct Scratch<T: Element> {
    scores: Vec<T::Acc>,
    values: Vec<T::Acc>,
    /// One row of values as they are, before widening.
    row: Vec<T>,
    records: Vec<T::Acc>,
    /// Where the last task's records go in a source's part of the receive buffer.
    record_at: usize,
    /// A record read back, the output row a combine task accumulates, and that row rounded.
    record: Vec<T::Acc>,
    combined: Vec<T::Acc>,
    out_row: Vec<T>,
}

impl<T: Element> Scratch<T> {
    fn new(l: &DecodeLayout) -> Self {
        let zero = <T::Acc as Element>::zero();
        Scratch {
            scores: vec![zero; l.group() * KEY_CHUNK],
            values: Vec::new(),
            row: vec![T::zero(); l.dv],
            records: vec![zero; l.group() * l.record()],
            record_at: 0,
            record: vec![zero; l.record()],
            combined: vec![zero; l.dv],
            out_row: vec![T::zero(); l.dv],
        }
    }
}

/// Task `t` of the first phase on rank `me`: the records of one (batch, kv head, chunk) into
/// `s.records`, and where they go into `s.record_at`.
///
/// # Safety
/// The inputs are not written while the kernel runs.
unsafe fn partial<T: Element>(
    l: &DecodeLayout,
    x: &Inputs<'_, T>,
    t: usize,
    me: usize,
    s: &mut Scratch<T>,
) {
    let (chunks, g, rec) = (l.chunks(me), l.group(), l.record());
    let (b, kvh, c) = (t / (l.kv_heads * chunks), t / chunks % l.kv_heads, t % chunks);
    let (key0, keys) = (c * KEY_CHUNK, tile::valid_len(c * KEY_CHUNK, KEY_CHUNK, l.keys[me]));
    let (k_row, v_row) = (l.kv_heads * l.d, l.kv_heads * l.dv);
    let q_at = (b * l.heads + kvh * g) * l.d;
    let k_at = (b * l.keys[me] + key0) * k_row + kvh * l.d;
    let v_at = (b * l.keys[me] + key0) * v_row + kvh * l.dv;
    let scores = GlobalPtrMut::from_slice(&mut s.scores[..g * keys]);
    // SAFETY: the blocks are inside their tensors (the agreed shapes); scratch is this program's.
    unsafe {
        // scores[g, keys] = q[g, d] k[keys, d]^T, the keys read in place (row stride k_row).
        let (q, k) = (x.q + q_at, x.k + k_at);
        tile::dot_store_strided(scores, keys, q, [l.d, 1], k, [1, k_row], (g, l.d, keys), false);
    }
    let scale = <T::Acc as Element>::from_f64(l.scale);
    let mut stats = [(scale, scale); MAX_GROUP];
    for (row, stat) in s.scores[..g * keys].chunks_exact_mut(keys).zip(&mut stats) {
        let max = row.iter().fold(<T::Acc as Float>::neg_infinity(), |m, &x| m.max(x * scale));
        *stat = (max, exp_row(row, scale, max));
    }
    let (values, v_stride) = match x.v_acc {
        Some(v) => (GlobalPtr::from_slice(&v[v_at..]), v_row),
        None => {
            s.values.resize(keys * l.dv, <T::Acc as Element>::zero());
            for (j, widened) in s.values.chunks_exact_mut(l.dv).enumerate() {
                // SAFETY: the row is inside v (the agreed shapes).
                unsafe { tile::load_1d(x.v + (v_at + j * v_row), &mut s.row, l.dv, T::zero()) };
                for (w, &x) in widened.iter_mut().zip(&s.row) {
                    *w = x.to_acc();
                }
            }
            (GlobalPtr::from_slice(&s.values[..keys * l.dv]), l.dv)
        }
    };
    let records = GlobalPtrMut::from_slice(&mut s.records[..g * rec]);
    // SAFETY: as above.
    unsafe {
        // records[g, :dv] = p[g, keys] v[keys, dv].
        let probs = GlobalPtr::from_slice(&s.scores[..g * keys]);
        let shape = (g, keys, l.dv);
        tile::dot_store_strided(
            records,
            rec,
            probs,
            [keys, 1],
            values,
            [v_stride, 1],
            shape,
            false,
        );
    }
    for (record, &(max, sum)) in s.records.chunks_exact_mut(rec).zip(&stats) {
        let inv = sum.recip();
        record[..l.dv].iter_mut().for_each(|o| *o = *o * inv);
        record[l.dv] = max + sum.ln();
    }
    s.record_at = ((b * chunks + c) * l.heads + kvh * g) * rec;
}

/// Task `task` of the second phase: `(batch, head)`'s output row from every source's records,
/// weighted by their log-sum-exp, in rank order.
///
/// # Safety
/// Every source with tasks has a token in `tokens` (its records are complete).
#[allow(clippy::too_many_arguments)]
unsafe fn combine<T: Element>(
    l: &DecodeLayout,
    offsets: &[usize],
    recv: &SymmBuf<T::Acc>,
    tokens: &[Option<Token>],
    task: usize,
    s: &mut Scratch<T>,
    out: GlobalPtrMut<'_, T>,
    lse: GlobalPtrMut<'_, T::Acc>,
) {
    let (b, h, rec) = (task / l.heads, task % l.heads, l.record());
    let neg_inf = <T::Acc as Float>::neg_infinity();
    let zero = <T::Acc as Element>::zero();
    s.combined.fill(zero);
    let (mut max, mut sum) = (neg_inf, zero);
    for (src, token) in tokens.iter().enumerate() {
        let Some(token) = *token else { continue };
        let from = GlobalPtr::from(consume_token(recv.ptr(), token));
        for c in 0..l.chunks(src) {
            let at = offsets[src] + ((b * l.chunks(src) + c) * l.heads + h) * rec;
            // SAFETY: the record is complete (the token) and inside the buffer.
            unsafe { tile::load_1d(from + at, &mut s.record, rec, zero) };
            let part = s.record[l.dv];
            // Online: rescale what is summed so far when the maximum grows. `part` is finite
            // (a chunk has at least one key), so `top` is, and `max - top` is -inf at most.
            let top = max.max(part);
            let (old, new) = ((max - top).exp(), (part - top).exp());
            sum = sum * old + new;
            for (a, &o) in s.combined.iter_mut().zip(&s.record[..l.dv]) {
                *a = *a * old + o * new;
            }
            max = top;
        }
    }
    let inv = if sum > zero { sum.recip() } else { zero };
    for (o, &a) in s.out_row.iter_mut().zip(&s.combined) {
        *o = T::from_acc(a * inv);
    }
    // SAFETY: row (b, h) of the output and of the log-sum-exp is this task's alone.
    unsafe {
        tile::store_1d(out + task * l.dv, &s.out_row, l.dv);
        tile::store_1d(lse + task, &[max + sum.ln()], 1);
    }
}

/// `data` in its accumulator type when it is its own (f32, f64), else `None` (half types are
/// widened a chunk at a time).
fn as_acc<T: Element>(data: &[T]) -> Option<&[T::Acc]> {
    (T::DTYPE == <T::Acc as Element>::DTYPE).then(|| {
        // SAFETY: `T` and `T::Acc` are one type (one dtype), so the slice is itself.
        unsafe { std::slice::from_raw_parts(data.as_ptr().cast(), data.len()) }
    })
}
