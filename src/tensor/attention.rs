//! [`scaled_dot_product_attention`]: `softmax(q k^T / sqrt(d)) v`, fused, in tiles: no
//! `S x S` score or mask tensor is ever formed, and the memory it takes is linear in the sequence
//! length (FlashAttention's scheme: each block of queries walks the blocks of keys with a running
//! row maximum and a running sum of exponentials, rescaling what it has accumulated when the
//! maximum grows).
//!
//! The backward pass ([`scaled_dot_product_attention_backward`]) recomputes the probabilities
//! of each tile from the log-sum-exp the forward pass returns, instead of keeping them: one pass
//! over blocks of keys gives `dk` and `dv`, one over blocks of queries `dq`, so no two tasks write
//! the same rows.
//!
//! Everything is computed in the accumulator type (f32 for f16 and bf16) and rounded once; the
//! tile products go through the same GEMM as [`Tensor::matmul`], one task per block of queries
//! (or keys) and head, in parallel.

use ndarray::{ArrayView2, ArrayViewMut2};
use num_traits::Float;
use rayon::prelude::*;

use super::{Element, Tensor, matmul_into};
use crate::{Error, Result};

const OP: &str = "scaled_dot_product_attention";
/// Rows of queries per task.
const BLOCK_Q: usize = 128;
/// Keys per tile.
const BLOCK_K: usize = 256;

/// The shapes of one call: `batch` matrices (the product of the leading dimensions), `sq`
/// queries, `sk` keys, `d` features of q and k, `dv` of v.
#[derive(Clone, Copy)]
struct Dims {
    batch: usize,
    sq: usize,
    sk: usize,
    d: usize,
    dv: usize,
}

fn dims<T: Element>(q: &Tensor<T>, k: &Tensor<T>, v: &Tensor<T>) -> Result<Dims> {
    let bad = |reason: String| Err(Error::InvalidShape { op: OP, reason });
    if let Some(t) = [q, k, v].into_iter().find(|t| !t.is_on_host()) {
        return Err(Error::DeviceUnavailable {
            op: OP,
            device: t.device().to_string(),
            reason: "the fused attention kernel runs on the host; on a GPU, \
                     autograd's Var::scaled_dot_product_attention runs it with the GPU's \
                     products and softmax (or call Tensor::to_host() first)"
                .into(),
        });
    }
    let (qs, ks, vs) = (q.shape(), k.shape(), v.shape());
    if qs.len() < 2 || ks.len() != qs.len() || vs.len() != qs.len() {
        return bad(format!(
            "q, k and v must have the same number of dimensions, at least 2 ([..., S, D]); got \
             {qs:?}, {ks:?}, {vs:?}"
        ));
    }
    let n = qs.len();
    if qs[..n - 2] != ks[..n - 2] || qs[..n - 2] != vs[..n - 2] {
        return bad(format!(
            "the leading (batch and head) dimensions of q {qs:?}, k {ks:?} and v {vs:?} differ"
        ));
    }
    if qs[n - 1] == 0 || vs[n - 1] == 0 {
        return bad(format!("q, k and v need at least one feature; got q {qs:?}, v {vs:?}"));
    }
    if qs[n - 1] != ks[n - 1] || ks[n - 2] != vs[n - 2] {
        return bad(format!(
            "q and k need the same feature size and k and v the same length; got q {qs:?}, k \
             {ks:?}, v {vs:?}"
        ));
    }
    Ok(Dims {
        batch: qs[..n - 2].iter().product(),
        sq: qs[n - 2],
        sk: ks[n - 2],
        d: qs[n - 1],
        dv: vs[n - 1],
    })
}

/// Keys `[start, end)` a query block `[q0, q1)` sees: all, or (causal) those `j <= i` for some
/// query `i` of the block.
fn key_end(causal: bool, q1: usize, sk: usize) -> usize {
    if causal { q1.min(sk) } else { sk }
}

fn view<A>(s: &[A], rows: usize, cols: usize) -> ArrayView2<'_, A> {
    ArrayView2::from_shape((rows, cols), s).expect("a tile's slice holds its rows")
}

fn view_mut<A>(s: &mut [A], rows: usize, cols: usize) -> ArrayViewMut2<'_, A> {
    ArrayViewMut2::from_shape((rows, cols), s).expect("a tile's slice holds its rows")
}

/// The raw scores `q k^T` of one tile into `s` (`rows x cols`): queries from `q0`, keys from
/// `k0`. Scale and mask are applied by the caller, in the same pass as the exponentials.
fn scores<A: Element<Acc = A>>(
    s: &mut [A],
    q: &[A],
    k: &[A],
    (q0, rows): (usize, usize),
    (k0, cols): (usize, usize),
    d: usize,
) -> Result<()> {
    let kt = view(&k[k0 * d..(k0 + cols) * d], cols, d);
    let qt = view(&q[q0 * d..(q0 + rows) * d], rows, d);
    matmul_into(view_mut(s, rows, cols), qt, kt.t(), false, 1)
}

/// How many keys of a tile from `k0` of `cols` keys query `i` sees: a prefix of the row (the
/// causal mask is a prefix, so no mask is ever stored).
fn visible(causal: bool, i: usize, k0: usize, cols: usize) -> usize {
    if causal { (i + 1).saturating_sub(k0).min(cols) } else { cols }
}

/// `x = exp(x * scale - shift)` over a row, returning the row's sum. For f32 (the accumulator
/// of f32, f16 and bf16) through [`exp_f32`], which the compiler vectorizes (the library `expf`
/// is a call per element and was a sixth of the fused op's time).
pub(crate) fn exp_row<A: Element<Acc = A> + Float>(row: &mut [A], scale: A, shift: A) -> A {
    if std::any::TypeId::of::<A>() == std::any::TypeId::of::<f32>() {
        let (scale, shift) = (scale.to_f64() as f32, shift.to_f64() as f32);
        // SAFETY: A is f32 (checked above): same size, alignment and validity.
        let row =
            unsafe { std::slice::from_raw_parts_mut(row.as_mut_ptr() as *mut f32, row.len()) };
        for x in row.iter_mut() {
            *x = exp_f32(*x * scale - shift);
        }
        let mut lanes = [0.0f32; 8];
        let mut chunks = row.chunks_exact(8);
        for c in &mut chunks {
            for (l, &x) in lanes.iter_mut().zip(c) {
                *l += x;
            }
        }
        let tail: f32 = chunks.remainder().iter().sum();
        return A::from_f64((lanes.iter().sum::<f32>() + tail) as f64);
    }
    let mut sum = <A as Element>::zero();
    for x in row.iter_mut() {
        *x = (*x * scale - shift).exp();
        sum = sum + *x;
    }
    sum
}

/// `e^x` in f32 within 2 ulp (Cephes' `expf`: `x = n ln 2 + r`, a degree-6 polynomial in `r`,
/// times `2^n` built in the exponent bits); 0 below -87.3 (where `e^x` is subnormal) and for
/// minus infinity, infinity above 88.7. Branch-free, so a loop of it vectorizes.
#[inline(always)]
fn exp_f32(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let xc = x.clamp(-87.3, 88.7);
    // Round to nearest by adding and subtracting 1.5 * 2^23 (`round` is a library call on the
    // baseline x86-64 target, which would stop the loop from vectorizing).
    const ROUND: f32 = 12_582_912.0;
    let n = (xc * LOG2E + ROUND) - ROUND;
    let r = xc - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let y = p * r * r + r + 1.0;
    let scaled = y * f32::from_bits(((n as i32 + 127) as u32) << 23);
    if x < -87.3 {
        0.0
    } else if x > 88.7 {
        f32::INFINITY
    } else {
        scaled
    }
}

/// `softmax(q k^T * scale) v` and the log-sum-exp of each query's scores, for `q` of
/// `[..., Sq, D]`, `k` of `[..., Sk, D]` and `v` of `[..., Sk, Dv]` (the same leading
/// dimensions): `[..., Sq, Dv]` and `[..., Sq]`. Causal: query `i` sees keys `j <= i` (the
/// lower-left triangle, as PyTorch's `is_causal`). With no keys the output is zeros and the
/// log-sum-exp minus infinity.
///
/// # Errors
/// [`Error::InvalidShape`] when the shapes disagree; [`Error::OutOfMemory`] when an output cannot
/// be allocated.
pub fn scaled_dot_product_attention_lse<T: Element>(
    q: &Tensor<T>,
    k: &Tensor<T>,
    v: &Tensor<T>,
    causal: bool,
    scale: f64,
) -> Result<(Tensor<T>, Tensor<T::Acc>)> {
    let Dims { batch, sq, sk, d, dv } = dims(q, k, v)?;
    let n = q.ndim();
    let mut out_shape = q.shape().to_vec();
    out_shape[n - 1] = dv;
    let mut out = Tensor::<T>::try_zeros(&out_shape)?;
    let mut lse = Tensor::<T::Acc>::try_zeros(&q.shape()[..n - 1])?;
    if batch * sq == 0 {
        return Ok((out, lse));
    }
    let (qa, ka, va) = (q.cast::<T::Acc>(), k.cast::<T::Acc>(), v.cast::<T::Acc>());
    let scale = T::Acc::from_f64(scale);
    let tasks =
        out.as_mut_slice().par_chunks_mut(sq * dv).zip(lse.as_mut_slice().par_chunks_mut(sq));
    tasks.enumerate().try_for_each(|(b, (out, lse))| {
        let q = &qa.as_slice()[b * sq * d..(b + 1) * sq * d];
        let k = &ka.as_slice()[b * sk * d..(b + 1) * sk * d];
        let v = &va.as_slice()[b * sk * dv..(b + 1) * sk * dv];
        let blocks = out.par_chunks_mut(BLOCK_Q * dv).zip(lse.par_chunks_mut(BLOCK_Q));
        blocks.enumerate().try_for_each(|(qb, (out, lse))| {
            forward_block(
                q,
                k,
                v,
                out,
                lse,
                qb * BLOCK_Q,
                Dims { batch, sq, sk, d, dv },
                scale,
                causal,
            )
        })
    })?;
    Ok((out, lse))
}

/// One block of queries from `q0`: walks the key tiles with the running maximum `m`, sum `l`
/// and unnormalized output `acc`.
#[allow(clippy::too_many_arguments)]
fn forward_block<T: Element>(
    q: &[T::Acc],
    k: &[T::Acc],
    v: &[T::Acc],
    out: &mut [T],
    lse: &mut [T::Acc],
    q0: usize,
    Dims { sk, d, dv, .. }: Dims,
    scale: T::Acc,
    causal: bool,
) -> Result<()> {
    let rows = lse.len();
    let zero = <T::Acc as Element>::zero();
    let mut m = vec![T::Acc::neg_infinity(); rows];
    let mut l = vec![zero; rows];
    let mut acc = vec![zero; rows * dv];
    let mut s = vec![zero; rows * BLOCK_K];
    let end = key_end(causal, q0 + rows, sk);
    for k0 in (0..end).step_by(BLOCK_K) {
        let cols = BLOCK_K.min(end - k0);
        let s = &mut s[..rows * cols];
        scores(s, q, k, (q0, rows), (k0, cols), d)?;
        let one = T::Acc::from_f64(1.0);
        for (r, row) in s.chunks_exact_mut(cols).enumerate() {
            let (seen, hidden) = row.split_at_mut(visible(causal, q0 + r, k0, cols));
            hidden.fill(zero);
            if seen.is_empty() {
                continue;
            }
            // scale > 0: the largest scaled score is the largest raw score, scaled.
            let top = seen.iter().copied().fold(T::Acc::neg_infinity(), Float::max) * scale;
            let max = top.max(m[r]);
            let alpha = if max == m[r] { one } else { (m[r] - max).exp() };
            let sum = exp_row(seen, scale, max);
            l[r] = l[r] * alpha + sum;
            m[r] = max;
            if alpha != one {
                acc[r * dv..(r + 1) * dv].iter_mut().for_each(|a| *a = *a * alpha);
            }
        }
        let vt = view(&v[k0 * dv..(k0 + cols) * dv], cols, dv);
        matmul_into(view_mut(&mut acc, rows, dv), view(s, rows, cols), vt, true, 1)?;
    }
    for r in 0..rows {
        let inv = if l[r] > zero { l[r].recip() } else { zero };
        for (o, &a) in out[r * dv..(r + 1) * dv].iter_mut().zip(&acc[r * dv..(r + 1) * dv]) {
            *o = T::from_acc(a * inv);
        }
        lse[r] = m[r] + l[r].ln();
    }
    Ok(())
}

/// Fused attention, `softmax(q k^T / sqrt(D)) v` over the last two axes of `q` `[..., Sq, D]`,
/// `k` `[..., Sk, D]` and `v` `[..., Sk, Dv]` (the leading dimensions, batch and heads, the
/// same for all three), causal or not (query `i` sees keys `j <= i`). No `S x S` tensor is
/// formed: memory is linear in the sequence length.
///
/// # Errors
/// [`Error::InvalidShape`] when the shapes disagree; [`Error::OutOfMemory`].
///
/// # Examples
/// ```
/// use dist_tensor::Tensor;
/// use dist_tensor::tensor::scaled_dot_product_attention;
/// let (q, k, v) = (Tensor::<f64>::random(&[2, 5, 4], 1), Tensor::random(&[2, 5, 4], 2), Tensor::random(&[2, 5, 3], 3));
/// let o = scaled_dot_product_attention(&q, &k, &v, true)?;
/// // The first query sees only the first key: its output is that key's value.
/// assert!((o.as_slice()[0] - v.as_slice()[0]).abs() < 1e-12);
/// // The naive form: scores, softmax, product (here without a mask).
/// let s = q.matmul(&k.transpose(1, 2)?)? * 0.5; // 1 / sqrt(4)
/// let want = s.softmax(2)?.matmul(&v)?;
/// let got = scaled_dot_product_attention(&q, &k, &v, false)?;
/// assert!(got.as_slice().iter().zip(want.as_slice()).all(|(a, b)| (a - b).abs() < 1e-12));
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn scaled_dot_product_attention<T: Element>(
    q: &Tensor<T>,
    k: &Tensor<T>,
    v: &Tensor<T>,
    causal: bool,
) -> Result<Tensor<T>> {
    let d = q.shape().last().copied().unwrap_or(1);
    Ok(scaled_dot_product_attention_lse(q, k, v, causal, 1.0 / (d as f64).sqrt())?.0)
}

/// The gradients of [`scaled_dot_product_attention_lse`] with respect to `q`, `k` and `v`, given
/// the output `o`, its log-sum-exp `lse` and the output's gradient `dout`. The probabilities are
/// recomputed tile by tile from `lse`.
///
/// # Errors
/// [`Error::InvalidShape`] when the shapes disagree; [`Error::OutOfMemory`].
#[allow(clippy::too_many_arguments)]
pub fn scaled_dot_product_attention_backward<T: Element>(
    q: &Tensor<T>,
    k: &Tensor<T>,
    v: &Tensor<T>,
    o: &Tensor<T>,
    lse: &Tensor<T::Acc>,
    dout: &Tensor<T>,
    causal: bool,
    scale: f64,
) -> Result<(Tensor<T>, Tensor<T>, Tensor<T>)> {
    let dm @ Dims { batch, sq, sk, d, dv } = dims(q, k, v)?;
    if o.shape() != dout.shape() || dout.len() != batch * sq * dv || lse.len() != batch * sq {
        return Err(Error::InvalidShape {
            op: "scaled_dot_product_attention_backward",
            reason: format!(
                "o {:?}, dout {:?} and lse {:?} do not fit q {:?} and v {:?}",
                o.shape(),
                dout.shape(),
                lse.shape(),
                q.shape(),
                v.shape()
            ),
        });
    }
    let mut dq = Tensor::<T>::try_zeros(q.shape())?;
    let mut dk = Tensor::<T>::try_zeros(k.shape())?;
    let mut dv_t = Tensor::<T>::try_zeros(v.shape())?;
    if batch * sq * sk == 0 {
        return Ok((dq, dk, dv_t));
    }
    let (qa, ka, va) = (q.cast::<T::Acc>(), k.cast::<T::Acc>(), v.cast::<T::Acc>());
    let doa = dout.cast::<T::Acc>();
    // D_i = sum_d dout[i, d] o[i, d]: the softmax backward's row term.
    let rowdot: Vec<T::Acc> = dout
        .as_slice()
        .chunks_exact(dv)
        .zip(o.as_slice().chunks_exact(dv))
        .map(|(g, o)| {
            g.iter()
                .zip(o)
                .fold(<T::Acc as Element>::zero(), |s, (g, o)| s + g.to_acc() * o.to_acc())
        })
        .collect();
    let scale = T::Acc::from_f64(scale);
    let per = |b: usize| Head {
        q: &qa.as_slice()[b * sq * d..(b + 1) * sq * d],
        k: &ka.as_slice()[b * sk * d..(b + 1) * sk * d],
        v: &va.as_slice()[b * sk * dv..(b + 1) * sk * dv],
        dout: &doa.as_slice()[b * sq * dv..(b + 1) * sq * dv],
        lse: &lse.as_slice()[b * sq..(b + 1) * sq],
        rowdot: &rowdot[b * sq..(b + 1) * sq],
        dims: dm,
        scale,
        causal,
    };
    // dk and dv: one task per block of keys.
    let kv =
        dk.as_mut_slice().par_chunks_mut(sk * d).zip(dv_t.as_mut_slice().par_chunks_mut(sk * dv));
    kv.enumerate().try_for_each(|(b, (dk, dvs))| {
        let head = per(b);
        let blocks = dk.par_chunks_mut(BLOCK_K * d).zip(dvs.par_chunks_mut(BLOCK_K * dv));
        blocks
            .enumerate()
            .try_for_each(|(kb, (dk, dvs))| head.key_block::<T>(kb * BLOCK_K, dk, dvs))
    })?;
    // dq: one task per block of queries.
    dq.as_mut_slice().par_chunks_mut(sq * d).enumerate().try_for_each(|(b, dq)| {
        let head = per(b);
        dq.par_chunks_mut(BLOCK_Q * d)
            .enumerate()
            .try_for_each(|(qb, dq)| head.query_block::<T>(qb * BLOCK_Q, dq))
    })?;
    Ok((dq, dk, dv_t))
}

/// One matrix of the batch, widened, for the backward tasks.
struct Head<'s, A> {
    q: &'s [A],
    k: &'s [A],
    v: &'s [A],
    dout: &'s [A],
    lse: &'s [A],
    rowdot: &'s [A],
    dims: Dims,
    scale: A,
    causal: bool,
}

impl<A: Element<Acc = A> + Float + Send + Sync> Head<'_, A> {
    /// `ds = p (dp - D) scale` of one tile, into `s` (which holds `p` on the way).
    fn tile_grads(
        &self,
        s: &mut [A],
        dp: &mut [A],
        (q0, rows): (usize, usize),
        (k0, cols): (usize, usize),
    ) -> Result<()> {
        let Dims { d, dv, .. } = self.dims;
        scores(s, self.q, self.k, (q0, rows), (k0, cols), d)?;
        for (r, row) in s.chunks_exact_mut(cols).enumerate() {
            let lse = self.lse[q0 + r];
            let (seen, hidden) = row.split_at_mut(visible(self.causal, q0 + r, k0, cols));
            hidden.fill(<A as Element>::zero());
            exp_row(seen, self.scale, lse);
        }
        let vt = view(&self.v[k0 * dv..(k0 + cols) * dv], cols, dv);
        let g = view(&self.dout[q0 * dv..(q0 + rows) * dv], rows, dv);
        matmul_into(view_mut(dp, rows, cols), g, vt.t(), false, 1)?;
        for r in 0..rows {
            let dd = self.rowdot[q0 + r];
            let p = &s[r * cols..(r + 1) * cols];
            for (x, &p) in dp[r * cols..(r + 1) * cols].iter_mut().zip(p) {
                *x = p * (*x - dd) * self.scale;
            }
        }
        Ok(())
    }

    fn key_block<T: Element<Acc = A>>(&self, k0: usize, dk: &mut [T], dvs: &mut [T]) -> Result<()> {
        let Dims { sq, d, dv, .. } = self.dims;
        let cols = dk.len() / d;
        let zero = <A as Element>::zero();
        let (mut dka, mut dva) = (vec![zero; cols * d], vec![zero; cols * dv]);
        let (mut s, mut dp) = (vec![zero; BLOCK_Q * cols], vec![zero; BLOCK_Q * cols]);
        // Causal: only queries i >= k0 see a key of this block.
        let first = if self.causal { k0 / BLOCK_Q * BLOCK_Q } else { 0 };
        for q0 in (first..sq).step_by(BLOCK_Q) {
            let rows = BLOCK_Q.min(sq - q0);
            let (s, dp) = (&mut s[..rows * cols], &mut dp[..rows * cols]);
            self.tile_grads(s, dp, (q0, rows), (k0, cols))?;
            let g = view(&self.dout[q0 * dv..(q0 + rows) * dv], rows, dv);
            matmul_into(view_mut(&mut dva, cols, dv), view(s, rows, cols).t(), g, true, 1)?;
            let qt = view(&self.q[q0 * d..(q0 + rows) * d], rows, d);
            matmul_into(view_mut(&mut dka, cols, d), view(dp, rows, cols).t(), qt, true, 1)?;
        }
        dk.iter_mut().zip(&dka).for_each(|(o, &a)| *o = T::from_acc(a));
        dvs.iter_mut().zip(&dva).for_each(|(o, &a)| *o = T::from_acc(a));
        Ok(())
    }

    fn query_block<T: Element<Acc = A>>(&self, q0: usize, dq: &mut [T]) -> Result<()> {
        let Dims { sk, d, .. } = self.dims;
        let rows = dq.len() / d;
        let zero = <A as Element>::zero();
        let mut dqa = vec![zero; rows * d];
        let (mut s, mut dp) = (vec![zero; rows * BLOCK_K], vec![zero; rows * BLOCK_K]);
        let end = key_end(self.causal, q0 + rows, sk);
        for k0 in (0..end).step_by(BLOCK_K) {
            let cols = BLOCK_K.min(end - k0);
            let (s, dp) = (&mut s[..rows * cols], &mut dp[..rows * cols]);
            self.tile_grads(s, dp, (q0, rows), (k0, cols))?;
            let kt = view(&self.k[k0 * d..(k0 + cols) * d], cols, d);
            matmul_into(view_mut(&mut dqa, rows, d), view(dp, rows, cols), kt, true, 1)?;
        }
        dq.iter_mut().zip(&dqa).for_each(|(o, &a)| *o = T::from_acc(a));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::exp_f32;

    #[test]
    fn exp_f32_is_within_two_ulp_of_exp() {
        let mut worst = 0.0f64;
        for i in 0..=200_000 {
            let x = -87.0 + 175.0 * i as f32 / 200_000.0;
            let want = (x as f64).exp();
            let ulp = (want as f32).abs() * f32::EPSILON;
            worst = worst.max(((exp_f32(x) as f64) - want).abs() / ulp as f64);
        }
        assert!(worst <= 2.0, "{worst} ulp");
        assert_eq!(exp_f32(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_f32(-100.0), 0.0);
        assert_eq!(exp_f32(0.0), 1.0);
        assert_eq!(exp_f32(100.0), f32::INFINITY);
    }
}
