//! Where a world's ranks run their kernels: the host simulation, or a device backend. A world
//! holds one ([`World::ascend`](crate::World::ascend) makes an Ascend one); ops ask their rank
//! once, at their entry, and hand the work to the backend's launcher.

use std::sync::Arc;

use super::ascend::world::AscendWorld;

/// A world's device backend.
#[derive(Clone)]
pub(crate) enum Backend {
    /// The host simulation of an NPU (every `World::threads` world).
    Host,
    /// Ascend NPUs, one per rank.
    Ascend(Arc<AscendWorld>),
}

impl std::fmt::Debug for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Backend::Host => write!(f, "Host"),
            Backend::Ascend(world) => write!(f, "Ascend({} NPUs)", world.ranks.len()),
        }
    }
}
