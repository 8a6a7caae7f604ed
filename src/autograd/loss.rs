//! [`vocab_parallel_cross_entropy`]: the mean cross-entropy of logits whose vocabulary is
//! split over the ranks, without gathering the logits (Megatron-LM's scheme): each rank reduces
//! its own columns, and only per-row figures cross ranks: the row maxima (gathered, then the
//! largest taken: a maximum is not a sum), the sums of exponentials and the target logits
//! (all-reduced).

use super::DVar;
use super::var::record;
use crate::collectives::{all_gather, all_reduce};
use crate::{DistTensor, Element, Error, Placement, Result, Tensor};

const OP: &str = "vocab_parallel_cross_entropy";

/// The mean over rows of `-log softmax(logits)[target]`, for `logits` `[N, V]` sharded on the
/// vocabulary (`Shard(1)`, any split, a rank may hold none) and `targets` the `N` token ids
/// (global ids, the same on every rank; `None` for a row the loss ignores, which gets no
/// gradient, and the mean is over the others). The result is a replicated scalar (shape `[]`). Rows
/// are reduced with their maximum subtracted, so logits of any size give a finite loss.
///
/// The backward pass gives each rank the gradient of its columns, `(softmax - onehot) / N`,
/// from the same per-row figures: nothing is gathered.
///
/// # Errors
/// [`Error::UnsupportedPlacement`] unless `logits` is 2-D and `Shard(1)`;
/// [`Error::InvalidArgument`] when `targets` does not have one id per row or an id is not below
/// `V`; as the collectives.
///
/// # Examples
/// ```
/// use dist_tensor::autograd::{DVar, vocab_parallel_cross_entropy};
/// use dist_tensor::{DistTensor, Placement, Tensor, World};
/// let logits = Tensor::<f64>::random(&[3, 10], 1);
/// let losses = World::threads(2)?.run(|rank| {
///     let l = DVar::param(DistTensor::from_global(rank, &logits, Placement::Shard(1))?);
///     let loss = vocab_parallel_cross_entropy(&l, &[Some(0), Some(9), None])?;
///     loss.backward()?;
///     Ok(loss.local().value().as_slice()[0])
/// })?;
/// assert_eq!(losses[0], losses[1]);
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn vocab_parallel_cross_entropy<'r, T: Element>(
    logits: &DVar<'r, T>,
    targets: &[Option<usize>],
) -> Result<DVar<'r, T>> {
    let value = logits.value();
    let rank = value.rank();
    let me = rank.rank();
    let global = value.global_shape();
    if value.placement() != Placement::Shard(1) || global.len() != 2 {
        return Err(Error::UnsupportedPlacement {
            op: OP,
            placement: format!("{:?} of a tensor of shape {global:?}", value.placement()),
            expected: "logits [N, V] sharded on the vocabulary, Shard(1)".to_string(),
        });
    }
    let (n, vocab) = (global[0], global[1]);
    if targets.len() != n || targets.iter().flatten().any(|&t| t >= vocab) {
        return Err(Error::InvalidArgument {
            op: OP,
            rank: me,
            reason: format!(
                "{} targets for {n} rows, each must be below the vocabulary size {vocab}",
                targets.len()
            ),
        });
    }
    let start: usize = value.shard_sizes()[..me].iter().sum();
    let local = value.local();
    let cols = local.shape()[1];
    let rows: Vec<&[T]> =
        if cols == 0 { vec![&[]; n] } else { local.as_slice().chunks_exact(cols).collect() };
    // Row maxima: this rank's, then the largest over the ranks (-inf where a rank has no column).
    let mine: Vec<f64> =
        rows.iter().map(|r| r.iter().fold(f64::NEG_INFINITY, |m, v| m.max(v.to_f64()))).collect();
    let every = all_gather(rank, &mine)?;
    let max: Vec<f64> = (0..n)
        .map(|i| every.chunks_exact(n.max(1)).fold(f64::NEG_INFINITY, |m, r| m.max(r[i])))
        .collect();
    // Sums of exponentials and target logits: partial per rank, all-reduced.
    let mut partial = vec![0.0f64; 2 * n];
    for (i, r) in rows.iter().enumerate() {
        partial[i] = r.iter().map(|v| (v.to_f64() - max[i]).exp()).sum();
        if let Some(t) = targets[i]
            && (start..start + cols).contains(&t)
        {
            partial[n + i] = r[t - start].to_f64();
        }
    }
    let total = all_reduce(rank, &partial)?;
    let (sums, target_logits) = total.split_at(n);
    let counted = targets.iter().flatten().count().max(1) as f64;
    let loss = (0..n)
        .filter(|&i| targets[i].is_some())
        .map(|i| sums[i].ln() + max[i] - target_logits[i])
        .sum::<f64>()
        / counted;
    let out = Tensor::from_shape_vec(&[], vec![T::from_f64(loss)])?;
    let like = value.clone();
    let (targets, max, sums) = (targets.to_vec(), max, sums.to_vec());
    let local_var = record(out.clone(), &[logits.local()], move |g, _| {
        // The loss is replicated: its gradient is held as partial sums; the whole of it here.
        let g = all_reduce(like.rank(), &[g.as_slice()[0].to_f64()])?[0] / counted;
        let mut dl = Tensor::<T>::try_zeros(like.local().shape())?;
        if cols > 0 {
            let out_rows = dl.as_mut_slice().chunks_exact_mut(cols);
            let rows = out_rows.zip(like.local().as_slice().chunks_exact(cols));
            for (i, (o, r)) in rows.enumerate().filter(|(i, _)| targets[*i].is_some()) {
                for (j, (o, v)) in o.iter_mut().zip(r).enumerate() {
                    let p = (v.to_f64() - max[i]).exp() / sums[i];
                    let hot = if Some(start + j) == targets[i] { 1.0 } else { 0.0 };
                    *o = T::from_f64(g * (p - hot));
                }
            }
        }
        Ok(vec![Some(dl)])
    });
    let value = DistTensor::from_local(rank, out, Placement::Replicate)?;
    Ok(DVar::from_parts(value, local_var))
}
