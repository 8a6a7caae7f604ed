//! Sequence-parallel (Ulysses) attention with its backward pass: the core
//! ([`UlyssesAttention`]) and the layer with its projections ([`UlyssesSelfAttention`]).

mod device;
mod local;
mod self_attention;
mod ulysses;

pub use self_attention::{SelfAttentionSaved, UlyssesSelfAttention};
pub use ulysses::{AttentionSaved, UlyssesAttention};

use ndarray::{ArrayView4, ArrayViewMut4, Ix4};

use crate::dist::DistTensor;
use crate::tensor::{Element, Tensor};
use crate::{Error, Result};

/// Puts a tensor `[B, s, ...]` that came back from an `all_to_all` (its sequence cut as
/// `numpy.array_split` cuts) onto the sequence split `sizes` of the tensor it answers, when
/// they differ: one more exchange, only for an input that was not cut evenly.
fn resplit<'r, T: Element>(t: DistTensor<'r, T>, sizes: &[usize]) -> Result<DistTensor<'r, T>> {
    if t.shard_sizes() == sizes { Ok(t) } else { t.redistribute_split(1, sizes.to_vec()) }
}

/// Checks that `t` is `[B, s_r, ...]` of `ndim` dimensions sharded on the sequence.
fn check_sequence<T: Element>(
    op: &'static str,
    what: &str,
    t: &DistTensor<'_, T>,
    ndim: usize,
) -> Result<()> {
    if t.global_dims().len() != ndim || t.placement() != crate::Placement::Shard(1) {
        return Err(Error::UnsupportedPlacement {
            op,
            placement: format!("{} of {what} {:?}", t.placement(), t.global_dims()),
            expected: format!("a {ndim}-D tensor sharded on the sequence, dimension 1 (Shard(1))"),
        });
    }
    Ok(())
}

/// A 4-D tensor as a 4-D view.
fn view4<T: Element>(t: &Tensor<T>) -> ArrayView4<'_, T> {
    t.view().into_dimensionality::<Ix4>().expect("a 4-D tensor")
}

/// A 4-D tensor as a mutable 4-D view.
fn view4_mut<T: Element>(t: &mut Tensor<T>) -> ArrayViewMut4<'_, T> {
    t.view_mut().into_dimensionality::<Ix4>().expect("a 4-D tensor")
}
