//! Sequence-parallel (Ulysses) attention with its backward pass: the core
//! ([`UlyssesAttention`]) and the layer with its projections ([`UlyssesSelfAttention`]).

mod self_attention;
mod ulysses;

pub use self_attention::{SelfAttentionSaved, UlyssesSelfAttention};
pub use ulysses::{AttentionSaved, UlyssesAttention};

use crate::Error;
use crate::Result;
use crate::dist_tensor::DistTensor;
use crate::tensor::Element;

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
