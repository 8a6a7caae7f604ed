//! Reverse-mode automatic differentiation over [`Tensor`](crate::Tensor).
//!
//! Mark parameters with [`Var::param`], run the forward pass with the ops of [`Var`] (the same
//! names as [`Tensor`](crate::Tensor)'s: operators with broadcasting and with scalars on either
//! side, `matmul`, `reshape`, `permute`, `transpose`, `insert_axis`, `cast`, `sum`, `mean`,
//! activations, `softmax`, `rms_norm`, `layer_norm`; indexing with `narrow`, `index_select`,
//! `gather`, `masked_fill`, [`Var::select_where`], `topk` (and `argmax`, indices only);
//! [`Var::cat`], [`Var::stack`], `cumsum`), call [`Var::backward`] on the loss and read each
//! parameter's [`Var::grad`].
//!
//! Only values computed from a tracked one are tracked: an op records its backward function
//! (and keeps what it needs, shared, not copied) only when one of its inputs is tracked, so a
//! forward pass on [`Var::constant`]s is the [`Tensor`](crate::Tensor) forward pass and keeps
//! nothing.
//!
//! [`gradcheck`] compares the recorded backward pass of any function with central finite
//! differences in f64.
//!
//! # Examples
//! ```
//! use dist_tensor::autograd::Var;
//! use dist_tensor::Tensor;
//! let x = Var::constant(Tensor::<f32>::random(&[8, 4], 1));
//! let w = Var::param(Tensor::<f32>::random(&[4, 4], 2));
//! let g = Var::param(Tensor::<f32>::random(&[4], 3));
//! let loss = x.matmul(&w)?.rms_norm(Some(&g), 1e-6)?.silu().mean();
//! loss.backward()?;
//! assert_eq!(w.grad().unwrap().shape(), &[4, 4]);
//! assert_eq!(g.grad().unwrap().shape(), &[4]);
//! # Ok::<(), dist_tensor::Error>(())
//! ```

mod dist;
mod gradcheck;
pub(crate) mod graph;
mod loss;
mod ops;
mod var;

pub use dist::DVar;
pub use gradcheck::{GradcheckOptions, GradcheckReport, gradcheck};
pub use loss::vocab_parallel_cross_entropy;
pub use var::Var;
