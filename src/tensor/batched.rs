//! Batched matrix products, `[..., M, K] @ [..., K, N]`: the batch dimensions broadcast as numpy's
//! `matmul` broadcasts them, and each matrix of the batch is one call of the 2-D product, reading
//! both operands in place.

use ndarray::{ArrayViewD, Axis, Dimension, Ix2, IxDyn};

use super::map::broadcast_shape;
use super::{Element, Tensor, matmul_into};
use crate::{Error, Result};

const OP: &str = "Tensor::matmul";

/// The 2-D matrix at batch index `index` of `t` broadcast to `batch`.
fn matrix<'a, T>(t: &ArrayViewD<'a, T>, index: &[usize]) -> ndarray::ArrayView2<'a, T> {
    let mut view = t.clone();
    for &i in index {
        view = view.index_axis_move(Axis(0), i);
    }
    view.into_dimensionality::<Ix2>().expect("two axes are left")
}

/// `a @ b` for tensors of at least two dimensions, on `threads` threads per matrix.
pub(crate) fn matmul_nd<T: Element>(
    a: &Tensor<T>,
    b: &Tensor<T>,
    threads: usize,
) -> Result<Tensor<T>> {
    let (sa, sb) = (a.shape(), b.shape());
    let batch = check_shapes(sa, sb)?;
    let (m, k) = (sa[sa.len() - 2], sa[sa.len() - 1]);
    let n = sb[sb.len() - 1];
    let stretch = |last: [usize; 2]| {
        let mut full = batch.clone();
        full.extend(last);
        full
    };
    let (va, vb) = (a.view(), b.view());
    let va = va.broadcast(IxDyn(&stretch([m, k]))).expect("batch broadcasts");
    let vb = vb.broadcast(IxDyn(&stretch([k, n]))).expect("batch broadcasts");
    let count: usize = batch.iter().product();
    let out_shape = stretch([m, n]);
    // Overwritten entirely by the products (accumulate = false).
    let mut out = Tensor::<T>::scratch(OP, &out_shape)?;
    let mut flat = out.view_mut().into_shape_with_order(IxDyn(&[count, m, n])).expect("contiguous");
    for (i, index) in ndarray::indices(IxDyn(&batch)).into_iter().enumerate() {
        let c = flat.index_axis_mut(Axis(0), i).into_dimensionality::<Ix2>().expect("2-D");
        matmul_into(c, matrix(&va, index.slice()), matrix(&vb, index.slice()), false, threads)?;
    }
    Ok(out)
}

/// The broadcast batch dimensions of `[..., m, k] @ [..., k, n]`, or the error for shapes that
/// do not fit (shared by the host and the GPU products).
pub(crate) fn check_shapes(sa: &[usize], sb: &[usize]) -> Result<Vec<usize>> {
    if sa.len() < 2 || sb.len() < 2 {
        return Err(Error::InvalidShape {
            op: OP,
            reason: format!("operands must have at least 2 dimensions, got {sa:?} and {sb:?}"),
        });
    }
    let (k, kb) = (sa[sa.len() - 1], sb[sb.len() - 2]);
    if k != kb {
        return Err(Error::InnerDimMismatch {
            op: OP,
            rank: 0,
            left: sa.to_vec(),
            right: sb.to_vec(),
            left_global: None,
        });
    }
    let (ba, bb) = (&sa[..sa.len() - 2], &sb[..sb.len() - 2]);
    let batch = broadcast_shape(ba, bb).ok_or_else(|| Error::InvalidShape {
        op: OP,
        reason: format!(
            "batch dimensions {ba:?} and {bb:?} (of {sa:?} and {sb:?}) do not broadcast"
        ),
    })?;
    Ok(batch)
}
