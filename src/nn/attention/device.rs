//! Attention over the heads a rank holds, forward and backward, on a GPU: the same math as
//! `local.rs` (each head in the accumulator type, rounded once), written with `Tensor`'s GPU
//! ops: batched products over `[B, h]`, a softmax by rows, the causal mask broadcast. The
//! forward pass keeps the probabilities `[B, h, S, S]` (in the accumulator type) for the
//! backward pass, where the host recomputes them from each row's log-sum-exp.

use crate::Result;
use crate::device::cuda;
use crate::tensor::{Element, Tensor};

/// What the backward pass reads, in the accumulator type `A`, heads first: `[B, h, S, D]` for
/// q, k, v and `[B, h, S, S]` for the probabilities.
#[derive(Debug, Clone)]
pub(crate) struct DeviceSaved<A: Element> {
    q: Tensor<A>,
    k: Tensor<A>,
    v: Tensor<A>,
    p: Tensor<A>,
}

/// `[B, S, h, D]` to `[B, h, S, D]` (and back: the permutation is its own inverse).
fn heads_first<A: Element>(t: &Tensor<A>) -> Result<Tensor<A>> {
    t.permute(&[0, 2, 1, 3])
}

/// The last two axes swapped.
fn swap_last<A: Element>(t: &Tensor<A>) -> Result<Tensor<A>> {
    t.permute(&[0, 1, 3, 2])
}

/// 0 where token `i` may attend to token `j` (`j <= i`), `-inf` above the diagonal, on the GPU
/// where `like` lives.
fn causal_mask<A: Element>(like: &Tensor<A>, s: usize) -> Result<Tensor<A>> {
    let mask: Vec<A> = (0..s * s)
        .map(|at| A::from_f64(if at % s <= at / s { 0.0 } else { f64::NEG_INFINITY }))
        .collect();
    let d = like.device_storage().expect("called for GPU tensors only");
    Ok(Tensor::from_device_storage(cuda::upload_like(d, &mask, &[s, s])?))
}

/// The output `[B, S, h, D]` of attention over q, k, v (each `[B, S, h, D]` on one GPU), and
/// what the backward pass needs.
pub(crate) fn forward<T: Element>(
    q: &Tensor<T>,
    k: &Tensor<T>,
    v: &Tensor<T>,
    causal: bool,
    scale: f64,
) -> Result<(Tensor<T>, DeviceSaved<T::Acc>)> {
    let wide = |t: &Tensor<T>| heads_first(&t.cast::<T::Acc>());
    let (q, k, v) = (wide(q)?, wide(k)?, wide(v)?);
    let mut s = q.matmul(&swap_last(&k)?)? * <T::Acc as Element>::from_f64(scale);
    if causal {
        s = &s + &causal_mask(&s, q.shape()[2])?;
    }
    let p = s.softmax(3)?;
    let out = heads_first(&p.matmul(&v)?)?.cast::<T>();
    Ok((out, DeviceSaved { q, k, v, p }))
}

/// The gradients of q, k and v (each `[B, S, h, D]`) for the output gradient `dout`.
pub(crate) fn backward<T: Element>(
    saved: &DeviceSaved<T::Acc>,
    dout: &Tensor<T>,
    scale: f64,
) -> Result<[Tensor<T>; 3]> {
    let DeviceSaved { q, k, v, p } = saved;
    let d = heads_first(&dout.cast::<T::Acc>())?;
    let dv = swap_last(p)?.matmul(&d)?;
    // dS = P * (dP - rowsum(P * dP)) * scale, with dP = dO v^T.
    let dp = d.matmul(&swap_last(v)?)?;
    let dot = (&dp * p).sum_axis(3)?.insert_axis(3)?;
    let ds = &(p * &(dp - &dot)) * <T::Acc as Element>::from_f64(scale);
    let dq = ds.matmul(k)?;
    let dk = swap_last(&ds)?.matmul(q)?;
    let back = |t: Tensor<T::Acc>| Ok::<_, crate::Error>(heads_first(&t)?.cast::<T>());
    Ok([back(dq)?, back(dk)?, back(dv)?])
}
