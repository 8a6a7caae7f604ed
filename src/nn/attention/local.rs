//! Attention over the heads a rank holds, forward and backward, on `[B, S, h, D]` views of any
//! strides (heads sliced out of a packed `[B, S, 3, h, D]` tensor read in place).
//!
//! Each head is computed in the accumulator type: its `[S, D]` q, k and v widened once, the
//! scores `q k^T * scale` (k read transposed in place), a softmax by rows, `p v`, rounded once.
//! The forward pass keeps each row's log-sum-exp; the backward pass recomputes the
//! probabilities from it (as FlashAttention does) instead of keeping `[S, S]` per head.

use ndarray::{Array2, Array3, ArrayView2, ArrayView4, ArrayViewMut2, ArrayViewMut4, Axis, s};
use num_traits::Float;

use crate::Result;
use crate::tensor::{Element, matmul};

/// Whether position `j` is masked out for query `i`.
fn masked(causal: bool, i: usize, j: usize) -> bool {
    causal && j > i
}

fn widen<T: Element>(v: ArrayView2<'_, T>) -> Array2<T::Acc> {
    v.mapv(|x| x.to_acc())
}

fn store<T: Element>(mut out: ArrayViewMut2<'_, T>, acc: &Array2<T::Acc>) {
    out.zip_mut_with(acc, |o, &a| *o = T::from_acc(a));
}

/// `q k^T * scale` of one head, the masked entries `-inf`.
fn scores<A: Element<Acc = A> + Float>(
    q: &Array2<A>,
    k: &Array2<A>,
    scale: A,
    causal: bool,
) -> Result<Array2<A>> {
    let mut s = matmul(q.view(), k.t(), 1)?;
    for ((i, j), v) in s.indexed_iter_mut() {
        *v = if masked(causal, i, j) { A::neg_infinity() } else { *v * scale };
    }
    Ok(s)
}

/// Softmax attention of every head: `out[b, :, j, :] = softmax(q k^T * scale) v` for the heads
/// of `q`, `k`, `v` (`[B, S, h, D]`), written into `out` (the same shape). Returns each row's
/// log-sum-exp of the scores, `[B, h, S]`.
pub(crate) fn forward<T: Element>(
    q: ArrayView4<'_, T>,
    k: ArrayView4<'_, T>,
    v: ArrayView4<'_, T>,
    causal: bool,
    scale: f64,
    mut out: ArrayViewMut4<'_, T>,
) -> Result<Array3<T::Acc>> {
    let (b, s_len, heads, _) = q.dim();
    let scale = <T::Acc as Element>::from_f64(scale);
    let mut lse = Array3::from_elem((b, heads, s_len), <T::Acc as Element>::zero());
    for bi in 0..b {
        for h in 0..heads {
            let head = s![bi, .., h, ..];
            let (qh, kh, vh) = (widen(q.slice(head)), widen(k.slice(head)), widen(v.slice(head)));
            let mut p = scores(&qh, &kh, scale, causal)?;
            for (mut row, l) in p.axis_iter_mut(Axis(0)).zip(lse.slice_mut(s![bi, h, ..])) {
                let max = row.iter().copied().fold(<T::Acc as Float>::neg_infinity(), Float::max);
                row.mapv_inplace(|x| (x - max).exp());
                let sum = row.sum();
                row.mapv_inplace(|x| x / sum);
                *l = max + sum.ln();
            }
            store(out.slice_mut(head), &matmul(p.view(), vh.view(), 1)?);
        }
    }
    Ok(lse)
}

/// The gradients of [`forward`] with respect to `q`, `k` and `v`, given the gradient `dout`
/// of its output and the log-sum-exp it returned, written into `dq`, `dk`, `dv`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward<T: Element>(
    q: ArrayView4<'_, T>,
    k: ArrayView4<'_, T>,
    v: ArrayView4<'_, T>,
    lse: &Array3<T::Acc>,
    dout: ArrayView4<'_, T>,
    causal: bool,
    scale: f64,
    (mut dq, mut dk, mut dv): (ArrayViewMut4<'_, T>, ArrayViewMut4<'_, T>, ArrayViewMut4<'_, T>),
) -> Result<()> {
    let (b, _, heads, _) = q.dim();
    let scale = <T::Acc as Element>::from_f64(scale);
    for bi in 0..b {
        for h in 0..heads {
            let head = s![bi, .., h, ..];
            let (qh, kh, vh) = (widen(q.slice(head)), widen(k.slice(head)), widen(v.slice(head)));
            let doh = widen(dout.slice(head));
            // The probabilities again, from the scores and each row's log-sum-exp.
            let mut p = scores(&qh, &kh, scale, causal)?;
            for (mut row, &l) in p.axis_iter_mut(Axis(0)).zip(lse.slice(s![bi, h, ..])) {
                row.mapv_inplace(|x| (x - l).exp());
            }
            store(dv.slice_mut(head), &matmul(p.t(), doh.view(), 1)?);
            // dS = P * (dP - rowsum(P * dP)), with dP = dO v^T; then the scale.
            let mut ds = matmul(doh.view(), vh.t(), 1)?;
            for (mut d, pr) in ds.axis_iter_mut(Axis(0)).zip(p.axis_iter(Axis(0))) {
                let dot =
                    d.iter().zip(pr).fold(<T::Acc as Element>::zero(), |a, (&x, &y)| a + x * y);
                d.zip_mut_with(&pr, |x, &y| *x = y * (*x - dot) * scale);
            }
            store(dq.slice_mut(head), &matmul(ds.view(), kh.view(), 1)?);
            store(dk.slice_mut(head), &matmul(ds.t(), qh.view(), 1)?);
        }
    }
    Ok(())
}
