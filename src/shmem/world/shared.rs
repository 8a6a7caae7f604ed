//! What every rank of a world shares (the heap, the control block, the transport) and what each
//! keeps to itself; how a failure is recorded and reported.

use std::any::TypeId;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::Settings;
use crate::Error;
use crate::shmem::control::{Control, RankState};
use crate::shmem::device_runtime::DeviceRuntime;
use crate::shmem::exchange::CallCounter;
use crate::shmem::heap::{Heap, lock};
use crate::shmem::sync::{Watch, deadline_after};
use crate::shmem::topology::Topology;
use crate::shmem::transport::Transport;

/// What a rank keeps in its own process: nothing here is read by a peer.
#[derive(Default)]
pub(crate) struct RankLocal {
    /// The number of the rank's last collective call; locked while a call is in progress.
    pub(crate) calls: Mutex<CallCounter>,
    /// Workspaces kept from one call (and one run) to the next, by type.
    pub(crate) workspaces: Mutex<Workspaces>,
    /// Blocks of the heap lent to output tensors (see `lent`).
    pub(crate) output_blocks: Mutex<crate::shmem::lent::OutputBlocks>,
    /// The rank's own error, typed, once it failed.
    error: Mutex<Option<Arc<Error>>>,
}

/// State shared by every rank of a world.
pub(crate) struct WorldShared {
    pub(crate) heap: Arc<Heap>,
    /// What the ranks see of each other: failure, states, waiters (see `control`).
    pub(crate) control: Control,
    pub(crate) topology: Topology,
    pub(crate) wait_timeout: Duration,
    /// Per rank, what stays in the rank's own process.
    pub(crate) local: Vec<RankLocal>,
    /// Looks at the world while a wait is blocked (a process world looks for dead peers).
    pub(crate) on_tick: Option<Box<OnTick>>,
    /// Where the ranks' kernels run: `None` for the host simulation, else the device backend's
    /// world (GPUs, NPUs). Set when the world is made; every op's dispatch reads it (through
    /// `device::DeviceWorld`).
    pub(crate) device: Option<Arc<dyn DeviceRuntime>>,
    pub(super) run_lock: Mutex<()>,
    /// Which ranks are on this node (reached by pointer), and the way to the others.
    pub(crate) transport: Transport,
    /// How a group of this world's ranks is made (see `shmem::group`).
    pub(crate) kind: WorldKind,
    /// For a world of threads: the groups being made, until every member took its handle.
    pub(crate) forming: Mutex<crate::shmem::group::Forming>,
    /// For a group: the world it was split from, and which of its ranks are the members.
    pub(crate) parent: Option<crate::shmem::group::ParentLink>,
    /// Which group this is, in the calls its ranks post to their world (0: the world itself;
    /// see `crossed`).
    pub(crate) group_id: u64,
    /// For a world: the world's ranks of each group split from it that this process saw made,
    /// by group id, to name a group in an error.
    pub(crate) groups: Mutex<HashMap<u64, Vec<usize>>>,
}

/// Where a world's ranks live, which says how a group of them is made.
#[derive(Debug, Clone)]
pub(crate) enum WorldKind {
    /// Every rank a thread of this process: a group's segments are mapped here.
    Threads,
    /// Processes of one host (or of one MPI node), met under `job_id`: a group's processes meet
    /// under a job id derived from it and pass each other their segments.
    Processes { job_id: String, join_timeout: Duration },
}

/// What a blocked waiter calls on every tick (a process world looks for dead peers).
pub(crate) type OnTick = dyn Fn(&Control) + Send + Sync;

/// One rank's workspaces by type; `None` while the workspace is in use.
pub(crate) type Workspaces = HashMap<TypeId, Option<Box<dyn Workspace>>>;

/// State a rank keeps between calls: the symmetric buffers and signals of a collective or a
/// fused op, sized lazily and reused, so that a second call needs no allocation and no reset.
pub trait Workspace: std::any::Any + Send {
    /// Bytes of symmetric memory this workspace holds on its rank.
    fn symmetric_bytes(&self) -> usize;
}

impl WorldShared {
    pub(crate) fn num_ranks(&self) -> usize {
        self.heap.num_ranks()
    }

    /// What a wait looks at besides its condition.
    pub(crate) fn watch(&self) -> Watch<'_> {
        Watch {
            control: &self.control,
            deadline: deadline_after(self.wait_timeout),
            on_tick: self.on_tick.as_deref(),
            blocked: self.transport.blocked(),
        }
    }

    /// The error a rank reports when it stops because another failed: it says what that one said.
    pub(crate) fn peer_failed(&self, rank: usize) -> Error {
        let (failed_rank, reason) =
            self.control.first_failure().unwrap_or((rank, "(no failure recorded)".into()));
        Error::PeerFailed { rank, failed_rank, reason }
    }

    /// Records `err` as `rank`'s failure, unless it only reports that another rank failed first,
    /// and makes every rank's waits give up.
    pub(crate) fn fail_with(&self, rank: usize, err: &Error) {
        if matches!(err, Error::PeerFailed { .. }) && self.control.failed() {
            return;
        }
        let mut own = lock(&self.local[rank].error);
        if own.is_none() {
            *own = Some(Arc::new(err.clone()));
        }
        drop(own);
        let reason = err.to_string();
        self.control.fail(rank, &reason);
        if let Some(device) = &self.device {
            device.failed(rank, &reason);
        }
        // A group's failure is its world's: the ranks outside the group stop too.
        if let Some(parent) = &self.parent {
            parent.fail_with(rank, err);
        }
    }

    /// The rank's own error, typed, if it failed of its own in this process.
    fn own_error(&self, rank: usize) -> Option<Arc<Error>> {
        lock(&self.local[rank].error).clone()
    }

    /// The error a failed world reports: the first failure, typed where this process holds it,
    /// and every rank that failed of its own.
    pub(crate) fn world_error(&self, earlier: bool) -> Option<Error> {
        let (rank, reason) = self.control.first_failure()?;
        let failed_ranks = (0..self.num_ranks())
            .filter(|&r| {
                r == rank
                    || self.own_error(r).is_some_and(|e| !matches!(*e, Error::PeerFailed { .. }))
                    || matches!(self.control.state(r), RankState::Died)
            })
            .collect();
        let reason = if earlier { format!("(in an earlier run) {reason}") } else { reason };
        Some(Error::RankFailed { rank, reason, source: self.own_error(rank), failed_ranks })
    }
}

impl WorldShared {
    pub(crate) fn new(
        heap: Heap,
        control: Control,
        topology: Topology,
        settings: &Settings,
    ) -> WorldShared {
        let n = heap.num_ranks();
        WorldShared {
            heap: Arc::new(heap),
            control,
            topology,
            wait_timeout: settings.wait_timeout,
            local: (0..n).map(|_| RankLocal::default()).collect(),
            on_tick: None,
            device: None,
            run_lock: Mutex::new(()),
            transport: Transport::local(n),
            kind: WorldKind::Threads,
            forming: Mutex::default(),
            parent: None,
            group_id: 0,
            groups: Mutex::default(),
        }
    }
}
