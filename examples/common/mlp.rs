//! The MLP of example 08 that `perf_report --mesh` and the MPI tests of data parallelism train
//! (the tests on a batch of [`TOKENS`], the report on a larger one, the weights the same): its
//! input, target and weights (`f32`, seeded), and a dp rank's share of the tokens. One module,
//! included by `perf_report` (its mesh rows) and `tests/mpi.rs` (`#[path]`), so both train the
//! same model.

#![allow(dead_code)] // each includer uses part of it

use dist_tensor::{Result, Tensor};

/// Tokens of the global batch (of the tests; `perf_report --mesh` takes more), width of the
/// model, width of its hidden layer.
pub const TOKENS: usize = 256;
pub const HIDDEN: usize = 256;
pub const FFN: usize = 1024;

/// The batch and the weights of both layers, the same on every rank.
pub struct MlpData {
    pub x: Tensor<f32>,
    pub target: Tensor<f32>,
    pub w1: Tensor<f32>,
    pub b1: Tensor<f32>,
    pub w2: Tensor<f32>,
    pub b2: Tensor<f32>,
}

impl MlpData {
    /// Seeded random values, scaled so that the activations stay near unit size; a batch of
    /// [`TOKENS`].
    pub fn seeded() -> MlpData {
        MlpData::with_tokens(TOKENS)
    }

    /// [`MlpData::seeded`] with a batch of `tokens` (the weights the same at any batch).
    pub fn with_tokens(tokens: usize) -> MlpData {
        MlpData {
            x: Tensor::random(&[tokens, HIDDEN], 1),
            target: Tensor::random(&[tokens, HIDDEN], 2),
            w1: Tensor::random(&[HIDDEN, FFN], 3) * 0.06,
            b1: Tensor::random(&[FFN], 4) * 0.1,
            w2: Tensor::random(&[FFN, HIDDEN], 5) * 0.03,
            b2: Tensor::random(&[HIDDEN], 6) * 0.1,
        }
    }
}

/// The rows of `t` (`tokens x HIDDEN`) of dp rank `at` among `dp` equal shares.
pub fn share(t: &Tensor<f32>, dp: usize, at: usize) -> Result<Tensor<f32>> {
    let rows = t.shape()[0] / dp;
    let from = at * rows * HIDDEN;
    Tensor::from_shape_vec(&[rows, HIDDEN], t.as_slice()[from..from + rows * HIDDEN].to_vec())
}
