//! Attention on a GPU, forward and backward, for [`Var::scaled_dot_product_attention`]
//! (super::Var): the host kernel's math (in the accumulator type, rounded once), written with
//! `Tensor`'s GPU ops: batched products over the leading dimensions, a softmax by rows, the
//! causal mask broadcast. Not yet a fused kernel: the forward pass keeps the probabilities
//! `[..., Sq, Sk]` (in the accumulator type) for the backward pass, where the host kernel
//! recomputes them from each row's log-sum-exp; memory is quadratic in the sequence here.

use crate::Result;
use crate::tensor::{Element, Tensor};

/// What the backward pass reads, in the accumulator type `A`: q, k, v and the probabilities.
#[derive(Debug, Clone)]
pub(crate) struct DeviceSaved<A: Element> {
    q: Tensor<A>,
    k: Tensor<A>,
    v: Tensor<A>,
    p: Tensor<A>,
}

/// The last two axes swapped.
fn swap_last<A: Element>(t: &Tensor<A>) -> Result<Tensor<A>> {
    let n = t.ndim();
    let mut axes: Vec<usize> = (0..n).collect();
    axes.swap(n - 2, n - 1);
    t.permute(&axes)
}

/// 0 where query `i` may attend to key `j` (`j <= i`, the lower-left triangle as the host
/// kernel), `-inf` elsewhere, `[sq, sk]` on the GPU where `like` lives.
fn causal_mask<A: Element>(like: &Tensor<A>, sq: usize, sk: usize) -> Result<Tensor<A>> {
    let mask: Vec<A> = (0..sq * sk)
        .map(|at| A::from_f64(if at % sk <= at / sk { 0.0 } else { f64::NEG_INFINITY }))
        .collect();
    Tensor::from_shape_vec(&[sq, sk], mask)?.into_place_of(like)
}

/// `softmax(q k^T * scale) v` for q `[..., Sq, D]`, k `[..., Sk, D]`, v `[..., Sk, Dv]` on one
/// GPU, and what the backward pass needs.
pub(crate) fn forward<T: Element>(
    q: &Tensor<T>,
    k: &Tensor<T>,
    v: &Tensor<T>,
    causal: bool,
    scale: f64,
) -> Result<(Tensor<T>, DeviceSaved<T::Acc>)> {
    let (q, k, v) = (q.cast::<T::Acc>(), k.cast::<T::Acc>(), v.cast::<T::Acc>());
    let mut s = q.matmul(&swap_last(&k)?)? * <T::Acc as Element>::from_f64(scale);
    let n = s.ndim();
    if causal {
        s = &s + &causal_mask(&s, s.shape()[n - 2], s.shape()[n - 1])?;
    }
    let p = s.softmax(n - 1)?;
    let out = p.matmul(&v)?.cast::<T>();
    Ok((out, DeviceSaved { q, k, v, p }))
}

/// The gradients of q, k and v for the output gradient `dout` (`[..., Sq, Dv]`).
pub(crate) fn backward<T: Element>(
    saved: &DeviceSaved<T::Acc>,
    dout: &Tensor<T>,
    scale: f64,
) -> Result<[Tensor<T>; 3]> {
    let DeviceSaved { q, k, v, p } = saved;
    let d = dout.cast::<T::Acc>();
    let dv = swap_last(p)?.matmul(&d)?;
    // dS = P * (dP - rowsum(P * dP)) * scale, with dP = dO v^T.
    let dp = d.matmul(&swap_last(v)?)?;
    let last = p.ndim() - 1;
    let dot = (&dp * p).sum_axis(last)?.insert_axis(last)?;
    let ds = &(p * &(dp - &dot)) * <T::Acc as Element>::from_f64(scale);
    let dq = ds.matmul(k)?;
    let dk = swap_last(&ds)?.matmul(q)?;
    Ok([dq.cast::<T>(), dk.cast::<T>(), dv.cast::<T>()])
}
