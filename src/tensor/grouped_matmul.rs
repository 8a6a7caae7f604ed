//! The grouped product of a mixture of experts: consecutive groups of rows, each times its own
//! weight, with no padding of a group to a common size ([`grouped_matmul`]).

use ndarray::{Array2, s};

use super::{Element, Tensor, matmul_into, split_offsets};
use crate::{Error, Result};

const OP: &str = "grouped_matmul";

/// `out[rows of group g] = x[rows of group g] * weights[g]`: `x` `[rows, k]` holds the groups'
/// rows one after another (`group_rows[g]` of them, which may be 0), each weight is `[k, n]`;
/// `[rows, n]`, each group's product on `threads` threads as [`matmul_into`] (f16 and bf16
/// accumulate in f32 and round once). Host tensors.
///
/// # Errors
/// [`Error::InvalidShape`] when the group sizes do not add up to the rows, there is not one
/// weight per group, or the weights' shapes differ from `[k, n]` of the first;
/// [`Error::DeviceUnavailable`] for a tensor on a device.
///
/// # Examples
/// ```
/// use dist_tensor::tensor::{grouped_matmul, Tensor};
/// let x = Tensor::from_shape_vec(&[3, 2], vec![1.0f64, 2.0, 3.0, 4.0, 5.0, 6.0])?;
/// let double = Tensor::from_shape_vec(&[2, 1], vec![2.0, 0.0])?;
/// let sum = Tensor::from_shape_vec(&[2, 1], vec![1.0, 1.0])?;
/// // Row 0 doubles its first column; rows 1 and 2 sum theirs.
/// let y = grouped_matmul(&x, &[1, 2], &[&double, &sum], 1)?;
/// assert_eq!(y.as_slice(), &[2.0, 7.0, 11.0]);
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn grouped_matmul<T: Element>(
    x: &Tensor<T>,
    group_rows: &[usize],
    weights: &[&Tensor<T>],
    threads: usize,
) -> Result<Tensor<T>> {
    let bad = |reason: String| Error::InvalidShape { op: OP, reason };
    let x = x.view2(OP)?;
    let views = weights.iter().map(|w| w.view2(OP)).collect::<Result<Vec<_>>>()?;
    let at = split_offsets(group_rows);
    if at[group_rows.len()] != x.nrows() || views.len() != group_rows.len() {
        return Err(bad(format!(
            "{} groups of {group_rows:?} rows and {} weights for {} rows",
            group_rows.len(),
            views.len(),
            x.nrows()
        )));
    }
    let n = views.first().map_or(0, |w| w.ncols());
    if let Some(w) = views.iter().find(|w| w.dim() != (x.ncols(), n)) {
        let (k, rows) = (x.ncols(), w.nrows());
        return Err(bad(format!("a weight of [{rows}, {}] where [{k}, {n}] is needed", w.ncols())));
    }
    let data = super::pool::take(OP, x.nrows() * n)?;
    let mut out = Array2::from_shape_vec((x.nrows(), n), data).expect("rows x n");
    for (g, w) in views.iter().enumerate() {
        let rows = s![at[g]..at[g + 1], ..];
        matmul_into(out.slice_mut(rows), x.slice(rows), *w, false, threads)?;
    }
    Ok(Tensor::from_array(out.into_dyn()))
}
