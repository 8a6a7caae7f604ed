//! [`mse_loss`]: the mean squared error of a distributed prediction, and its gradient.

use crate::autograd::{DVar, Var};
use crate::collectives;
use crate::dist_tensor::{DistTensor, Placement};
use crate::tensor::Element;
use crate::{Error, Result};

/// The mean squared error `mean((pred - target)^2)` over the whole global tensor, and its
/// gradient with respect to `pred` (`2 (pred - target) / len`, laid out as `pred`). `pred` and
/// `target` must be laid out alike (the same placement, shape and split).
///
/// A sharded prediction's squared errors are summed locally in f64 and added over the ranks in
/// rank order ([`collectives::all_reduce`]): every rank gets the same loss, bit for bit.
/// Collective for a sharded tensor; local for a replicated one.
///
/// # Errors
/// [`Error::InvalidArgument`] when the two are laid out differently;
/// [`Error::UnsupportedPlacement`] for a `Partial` tensor; and as every collective.
///
/// # Examples
/// ```
/// use dist_tensor::nn::mse_loss;
/// use dist_tensor::{DistTensor, Placement, Tensor, World};
/// let pred = Tensor::<f64>::from_shape_vec(&[3, 1], vec![1.0, 2.0, 3.0])?;
/// let target = Tensor::<f64>::from_shape_vec(&[3, 1], vec![1.0, 0.0, 0.0])?;
/// let outs = World::threads(2)?.run(|rank| {
///     let p = DistTensor::from_global(rank, &pred, Placement::Shard(0))?;
///     let t = DistTensor::from_global(rank, &target, Placement::Shard(0))?;
///     let (loss, grad) = mse_loss(&p, &t)?;
///     Ok((loss, grad.to_global()?))
/// })?;
/// assert_eq!(outs[0].0, 13.0 / 3.0); // (0 + 4 + 9) / 3
/// assert_eq!(outs[1].0, outs[0].0);
/// assert_eq!(outs[0].1.as_slice(), &[0.0, 4.0 / 3.0, 2.0]);
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn mse_loss<'r, T: Element>(
    pred: &DistTensor<'r, T>,
    target: &DistTensor<'r, T>,
) -> Result<(f64, DistTensor<'r, T>)> {
    const OP: &str = "mse_loss";
    if pred.placement() == Placement::Partial {
        return Err(Error::UnsupportedPlacement {
            op: OP,
            placement: Placement::Partial.to_string(),
            expected: "a sharded or replicated prediction (reduce a Partial one first)".to_string(),
        });
    }
    let len: usize = pred.global_dims().iter().product();
    let mut local = 0.0;
    let grad = pred.try_zip_local(target, |p, t| {
        let (grad, sum) = p.mse_parts(t, 2.0 / len as f64)?;
        local = sum;
        Ok(grad)
    })?;
    let total = match pred.placement() {
        Placement::Shard(_) => collectives::all_reduce(pred.rank(), &[local])?[0],
        _ => local,
    };
    Ok((total / len as f64, grad))
}

/// [`mse_loss`] on autograd: the mean squared error of `pred` (sharded or replicated) against
/// `target` (laid out alike), a replicated scalar whose `backward()` reaches `pred`. Collective.
///
/// # Errors
/// As [`mse_loss`].
///
/// # Examples
/// ```
/// use dist_tensor::autograd::DVar;
/// use dist_tensor::nn::{mse_loss, mse_loss_var};
/// use dist_tensor::{DistTensor, Placement, Tensor, World};
/// let (p, t) = (Tensor::<f64>::random(&[7, 3], 1), Tensor::<f64>::random(&[7, 3], 2));
/// World::threads(3)?.run(|rank| {
///     let ps = DistTensor::from_global(rank, &p, Placement::Shard(0))?;
///     let ts = DistTensor::from_global(rank, &t, Placement::Shard(0))?;
///     let pv = DVar::param(ps.clone());
///     let loss = mse_loss_var(&pv, &ts)?;
///     loss.backward()?;
///     let (want, dp) = mse_loss(&ps, &ts)?;
///     assert!((loss.value().local().as_slice()[0] - want).abs() < 1e-12);
///     let err = (&pv.grad().unwrap() - dp.local()).as_slice().iter().fold(0.0f64, |m, d| m.max(d.abs()));
///     assert!(err < 1e-15);
///     Ok(())
/// })?;
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn mse_loss_var<'r, T: Element>(
    pred: &DVar<'r, T>,
    target: &DistTensor<'r, T>,
) -> Result<DVar<'r, T>> {
    const OP: &str = "mse_loss_var";
    let placement = pred.placement();
    if placement == Placement::Partial || target.placement() != placement {
        return Err(Error::UnsupportedPlacement {
            op: OP,
            placement: format!("{placement} against a target {}", target.placement()),
            expected: "a sharded or replicated prediction, the target laid out alike".to_string(),
        });
    }
    let len: usize = pred.value().global_dims().iter().product();
    let diff = pred.local() - &Var::constant(target.local().clone());
    let part = (&diff * &diff).sum().scale(1.0 / len as f64);
    let rank = pred.value().rank();
    match placement {
        // Each rank's part of the sum: one all-reduce.
        Placement::Shard(_) => {
            DVar::from_var(rank, &part, Placement::Partial)?.redistribute(Placement::Replicate)
        }
        _ => DVar::from_var(rank, &part, Placement::Replicate),
    }
}
