//! [`World`]: a set of ranks that share a symmetric heap, run as threads of this process (or
//! processes of a job). Made in `launch` (with the settings of `builder`), run in `run`; what the
//! ranks share lives in `shared`.

mod builder;
mod launch;
mod run;
mod shared;

use std::sync::Arc;
use std::time::Duration;

pub use builder::{
    DEFAULT_HEAP_BYTES, DEFAULT_WAIT_TIMEOUT, HEAP_BYTES_ENV, WAIT_TIMEOUT_ENV, WorldBuilder,
};
pub(crate) use builder::{DeviceSetup, Settings, env_number};
pub(crate) use run::panic_message;
pub use shared::Workspace;
pub(crate) use shared::{WorldKind, WorldShared};

use super::control::RankState;
use super::heap::lock;
use crate::shmem::topology::Topology;

/// A world of ranks, each a thread of this process, sharing a symmetric heap.
///
/// # Examples
/// ```
/// use dist_tensor::World;
///
/// let ranks = World::threads(3)?.run(|rank| Ok((rank.rank(), rank.num_ranks())))?;
/// assert_eq!(ranks, vec![(0, 3), (1, 3), (2, 3)]);
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub struct World {
    shared: Arc<WorldShared>,
    /// The rank this process is, for a world of processes; `None` when every rank is a thread
    /// of this process.
    here: Option<usize>,
}

impl World {
    /// The ranks whose results [`World::run`] returns in this process: every rank for a world of
    /// threads, this process's own for a world of processes.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::World;
    /// assert_eq!(World::threads(3)?.ranks_here(), 0..3);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn ranks_here(&self) -> std::ops::Range<usize> {
        match self.here {
            Some(me) => me..me + 1,
            None => 0..self.num_ranks(),
        }
    }

    /// Number of ranks.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::World;
    /// assert_eq!(World::threads(3)?.num_ranks(), 3);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn num_ranks(&self) -> usize {
        self.shared.num_ranks()
    }

    /// The topology of each rank's device.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{device::Topology, World};
    /// assert_eq!(World::threads(2)?.topology(), &Topology::host_default(2));
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn topology(&self) -> &Topology {
        &self.shared.topology
    }

    /// How long waits give a peer.
    ///
    /// # Examples
    /// ```
    /// use std::time::Duration;
    /// use dist_tensor::World;
    /// let world = World::builder(1).wait_timeout(Duration::from_secs(3)).build()?;
    /// assert_eq!(world.wait_timeout(), Duration::from_secs(3));
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn wait_timeout(&self) -> Duration {
        self.shared.wait_timeout
    }

    /// Capacity of each rank's heap segment for allocations, in bytes.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::World;
    /// let world = World::builder(2).heap_capacity(1 << 20).build()?;
    /// let free = world.run(|rank| Ok(rank.heap_free_bytes()))?;
    /// assert_eq!(free, vec![world.heap_capacity(); 2]); // all of it free in a new world
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn heap_capacity(&self) -> usize {
        self.shared.heap.capacity() - self.shared.heap.reserved()
    }

    /// Bytes of symmetric memory each rank's workspaces hold (collectives and fused ops keep
    /// their buffers between calls, and the blocks they lend to output tensors; see
    /// [`Rank::release_workspaces`](crate::shmem::Rank::release_workspaces)).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::World;
    /// let world = World::threads(2)?;
    /// assert_eq!(world.workspace_bytes(), vec![0, 0]);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn workspace_bytes(&self) -> Vec<usize> {
        self.shared
            .local
            .iter()
            .map(|l| {
                let workspaces: usize =
                    lock(&l.workspaces).values().flatten().map(|ws| ws.symmetric_bytes()).sum();
                workspaces + lock(&l.output_blocks).bytes()
            })
            .collect()
    }
}

impl Drop for World {
    fn drop(&mut self) {
        // A process that drops its world is done with it: peers that still wait for it (in this
        // run or a later one) learn so at once instead of when its process ends.
        if let Some(me) = self.here
            && self.shared.control.state(me) != RankState::Failed
        {
            self.shared.control.set_state(me, RankState::Left);
        }
        // Ranks on other nodes learn it through the proxy, which then ends MPI.
        self.shared.transport.shutdown(&self.shared.control);
    }
}

impl std::fmt::Debug for World {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("World")
            .field("num_ranks", &self.num_ranks())
            .field("topology", self.topology())
            .field("heap_capacity", &self.heap_capacity())
            .field("wait_timeout", &self.wait_timeout())
            .finish()
    }
}
