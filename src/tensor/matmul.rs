//! Local 2-D matrix products through the `gemm` crate.
//!
//! Operands are ndarray views with any strides: a transposed or sliced view goes to the GEMM
//! kernel in place, without a copy (f32, f64). Half types are widened to f32 around the f32 kernel
//! and rounded once at the end, so they accumulate in f32 like the NPU's cube unit.

use std::any::TypeId;

use ndarray::{Array2, ArrayView2, ArrayViewMut2};

use super::Element;
use crate::{Error, Result};

fn check_inner<T>(op: &'static str, a: &ArrayView2<T>, b: &ArrayView2<T>) -> Result<()> {
    if a.ncols() != b.nrows() {
        return Err(Error::InnerDimMismatch {
            op,
            rank: 0,
            left: a.shape().to_vec(),
            right: b.shape().to_vec(),
            left_global: None,
        });
    }
    Ok(())
}

/// `a (m x k) * b (k x n)`, on `threads` threads (1: on the calling thread only).
///
/// # Errors
/// [`Error::InnerDimMismatch`] when `a`'s columns and `b`'s rows differ.
///
/// # Examples
/// ```
/// use dist_tensor::tensor::matmul;
/// use ndarray::array;
///
/// let a = array![[1.0f32, 2.0], [3.0, 4.0]];
/// let b = array![[1.0f32], [1.0]];
/// assert_eq!(matmul(a.view(), b.view(), 1)?, array![[3.0f32], [7.0]]);
/// // A transposed view is read in place.
/// assert_eq!(matmul(a.t(), b.view(), 1)?, array![[4.0f32], [6.0]]);
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn matmul<T: Element>(a: ArrayView2<T>, b: ArrayView2<T>, threads: usize) -> Result<Array2<T>> {
    check_inner("matmul", &a, &b)?;
    // Overwritten entirely (accumulate = false): a cached buffer needs no zeroing.
    let len = a.nrows().saturating_mul(b.ncols());
    let data = super::pool::take("matmul", len)?;
    let mut c = Array2::from_shape_vec((a.nrows(), b.ncols()), data).expect("m x n");
    matmul_into(c.view_mut(), a, b, false, threads)?;
    Ok(c)
}

/// `c = a * b`, or `c += a * b` when `accumulate` is true, on `threads` threads.
///
/// For f16 and bf16 the old `c`, the products and the sum are all taken in f32 and rounded once.
///
/// # Errors
/// [`Error::InnerDimMismatch`] when `a`'s columns and `b`'s rows differ, [`Error::InvalidShape`]
/// when `c` is not `a.nrows() x b.ncols()`.
///
/// # Examples
/// ```
/// use dist_tensor::tensor::matmul_into;
/// use ndarray::array;
///
/// let a = array![[1.0f64, 2.0]];
/// let b = array![[3.0f64], [4.0]];
/// let mut c = array![[100.0f64]];
/// matmul_into(c.view_mut(), a.view(), b.view(), true, 1)?;
/// assert_eq!(c, array![[111.0]]);
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn matmul_into<T: Element>(
    mut c: ArrayViewMut2<T>,
    a: ArrayView2<T>,
    b: ArrayView2<T>,
    accumulate: bool,
    threads: usize,
) -> Result<()> {
    check_inner("matmul_into", &a, &b)?;
    if c.dim() != (a.nrows(), b.ncols()) {
        return Err(Error::InvalidShape {
            op: "matmul_into",
            reason: format!(
                "output is {:?}, the product of {:?} and {:?} is [{}, {}]",
                c.shape(),
                a.shape(),
                b.shape(),
                a.nrows(),
                b.ncols()
            ),
        });
    }
    let (m, k, n) = (a.nrows(), a.ncols(), b.ncols());
    let a_raw = (a.as_ptr(), a.strides()[0], a.strides()[1]);
    let b_raw = (b.as_ptr(), b.strides()[0], b.strides()[1]);
    if TypeId::of::<T>() == TypeId::of::<T::Acc>() {
        let c_raw = (c.as_mut_ptr() as *mut T::Acc, c.strides()[0], c.strides()[1]);
        // SAFETY: T is its own accumulator, so the cast is the identity; the views are valid for
        // their shapes and strides, and `c` is borrowed mutably, so it overlaps neither operand.
        unsafe { T::gemm_acc(m, n, k, c_raw, accumulate, a_raw, b_raw, threads) };
    } else {
        let mut acc: Array2<T::Acc> = if accumulate {
            c.mapv(|x| x.to_acc())
        } else {
            Array2::from_elem((m, n), <T::Acc as Element>::zero())
        };
        // `mapv` keeps `c`'s memory order, which may be column-major or reversed: pass the strides.
        let acc_raw = (acc.as_mut_ptr(), acc.strides()[0], acc.strides()[1]);
        // SAFETY: `acc` is a fresh m x n array, its strides as ndarray reports them; the operand
        // views are valid.
        unsafe { T::gemm_acc(m, n, k, acc_raw, accumulate, a_raw, b_raw, threads) };
        c.zip_mut_with(&acc, |ci, &ai| *ci = T::from_acc(ai));
    }
    Ok(())
}
