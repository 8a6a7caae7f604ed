//! [`World`]: a set of ranks that share a symmetric heap, run as threads of this process.

use std::any::TypeId;
use std::collections::HashMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::control::{Control, RankState};
use super::exchange::{CallCounter, reserved_bytes};
use super::heap::{Heap, lock, segment_bytes};
use super::mapping::Mapping;
use super::rank::Rank;
use super::sync::{Watch, deadline_after};
use crate::device::{Backend, Topology};
use crate::{Error, Result};

/// Default capacity of each rank's heap segment. Address space only: untouched pages cost nothing.
pub const DEFAULT_HEAP_BYTES: usize = 1 << 30;
/// Default time a wait gives a peer before it reports a timeout.
pub const DEFAULT_WAIT_TIMEOUT: Duration = Duration::from_secs(60);
/// Environment variable that overrides the heap capacity per rank, in bytes.
pub const HEAP_BYTES_ENV: &str = "DIST_TENSOR_HEAP_BYTES";
/// Environment variable that overrides the wait timeout, in milliseconds (at least 1).
pub const WAIT_TIMEOUT_ENV: &str = "DIST_TENSOR_WAIT_TIMEOUT_MS";

/// What a rank keeps in its own process: nothing here is read by a peer.
#[derive(Default)]
pub(crate) struct RankLocal {
    /// The number of the rank's last collective call; locked while a call is in progress.
    pub(crate) calls: Mutex<CallCounter>,
    /// Workspaces kept from one call (and one run) to the next, by type.
    pub(crate) workspaces: Mutex<Workspaces>,
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
    pub(crate) on_tick: Option<Box<dyn Fn() + Send + Sync>>,
    /// Where the ranks' kernels run: the host simulation, or a device backend.
    pub(crate) backend: Backend,
    run_lock: Mutex<()>,
}

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

    /// What a wait of `rank` looks at besides its condition.
    pub(crate) fn watch(&self, rank: usize) -> Watch<'_> {
        Watch {
            control: &self.control,
            rank,
            deadline: deadline_after(self.wait_timeout),
            on_tick: self.on_tick.as_deref(),
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
        self.control.fail(rank, &err.to_string());
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
}

/// Settings of a [`World`] before it is made.
///
/// # Examples
/// ```
/// use std::time::Duration;
/// use dist_tensor::{device::Topology, World};
///
/// let world = World::builder(2)
///     .heap_capacity(64 << 20)
///     .topology(Topology::ascend_910b())
///     .wait_timeout(Duration::from_secs(5))
///     .build()?;
/// assert_eq!(world.topology().aicore_num(), 24);
/// # Ok::<(), dist_tensor::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct WorldBuilder {
    num_ranks: usize,
    heap_capacity: Option<usize>,
    topology: Option<Topology>,
    wait_timeout: Option<Duration>,
    backend: Backend,
}

fn env_number(name: &'static str) -> Result<Option<u64>> {
    match std::env::var(name) {
        Ok(text) => text.trim().parse().map(Some).map_err(|_| Error::InvalidArgument {
            op: "World::build",
            rank: 0,
            reason: format!("{name}={text:?} is not a whole number"),
        }),
        Err(_) => Ok(None),
    }
}

impl WorldBuilder {
    /// Capacity of each rank's heap segment in bytes (default [`DEFAULT_HEAP_BYTES`], or the
    /// environment variable [`HEAP_BYTES_ENV`]).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::World;
    /// let world = World::builder(2).heap_capacity(1 << 20).build()?;
    /// assert!(world.heap_capacity() <= 1 << 20); // less what the runtime keeps for barriers
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn heap_capacity(mut self, bytes: usize) -> Self {
        self.heap_capacity = Some(bytes);
        self
    }

    /// The topology each rank's simulated device has (default [`Topology::host_default`]).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{device::Topology, World};
    /// let world = World::builder(2).topology(Topology::new(4, 2)?).build()?;
    /// assert_eq!(world.topology().aivector_core_num(), 8);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn topology(mut self, topology: Topology) -> Self {
        self.topology = Some(topology);
        self
    }

    /// How long a wait gives a peer (default [`DEFAULT_WAIT_TIMEOUT`], or the environment variable
    /// [`WAIT_TIMEOUT_ENV`] in milliseconds). Code wins over the environment.
    ///
    /// # Examples
    /// ```
    /// use std::time::Duration;
    /// use dist_tensor::World;
    /// let world = World::builder(2).wait_timeout(Duration::from_millis(500)).build()?;
    /// let seen = world.run(|rank| Ok(rank.wait_timeout()))?;
    /// assert_eq!(seen, vec![Duration::from_millis(500); 2]);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn wait_timeout(mut self, timeout: Duration) -> Self {
        self.wait_timeout = Some(timeout);
        self
    }

    /// Runs the ranks' kernels on a device backend instead of the host simulation (used by the
    /// device worlds' constructors, such as [`World::ascend`]).
    pub(crate) fn backend(mut self, backend: Backend) -> Self {
        self.backend = backend;
        self
    }

    /// Makes the world: maps the heap segments.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a world of zero ranks, an environment override that is not
    /// a number, or a heap that cannot be mapped.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::World;
    /// assert!(World::builder(0).build().is_err());
    /// assert_eq!(World::builder(3).build()?.num_ranks(), 3);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn build(self) -> Result<World> {
        let n = self.num_ranks;
        if n == 0 {
            return Err(Error::InvalidArgument {
                op: "World::build",
                rank: 0,
                reason: "a world needs at least one rank".into(),
            });
        }
        let settings = Settings::resolve(self.heap_capacity, self.wait_timeout)?.for_ranks(n)?;
        let heap = Heap::anonymous(n, settings.capacity, settings.reserved)?;
        let control =
            Mapping::anonymous(Control::bytes(n)).map_err(|e| Error::InvalidArgument {
                op: "World::build",
                rank: 0,
                reason: format!("cannot map the control block: {e}"),
            })?;
        let topology = self.topology.unwrap_or_else(|| Topology::host_default(n));
        let mut shared = WorldShared::new(heap, Control::create(control, n), topology, &settings);
        shared.backend = self.backend;
        Ok(World { shared: Arc::new(shared) })
    }
}

/// A world's settings, from the builder or else the environment, checked.
pub(crate) struct Settings {
    pub(crate) capacity: usize,
    pub(crate) reserved: usize,
    pub(crate) wait_timeout: Duration,
}

impl Settings {
    pub(crate) fn resolve(
        heap_capacity: Option<usize>,
        wait_timeout: Option<Duration>,
    ) -> Result<Settings> {
        crate::tensor::pool::check_env()?;
        let capacity = match heap_capacity {
            Some(bytes) => bytes,
            None => env_number(HEAP_BYTES_ENV)?.map_or(DEFAULT_HEAP_BYTES, |b| b as usize),
        };
        let wait_timeout = match wait_timeout {
            Some(t) => t,
            None => match env_number(WAIT_TIMEOUT_ENV)? {
                Some(0) => {
                    return Err(Error::InvalidArgument {
                        op: "World::build",
                        rank: 0,
                        reason: format!(
                            "{WAIT_TIMEOUT_ENV}=0: a wait timeout of 0 ms fails healthy runs; \
                             give at least 1"
                        ),
                    });
                }
                Some(ms) => Duration::from_millis(ms),
                None => DEFAULT_WAIT_TIMEOUT,
            },
        };
        if wait_timeout.is_zero() {
            return Err(Error::InvalidArgument {
                op: "World::build",
                rank: 0,
                reason: "a wait timeout of zero fails healthy runs".into(),
            });
        }
        Ok(Settings { capacity, reserved: 0, wait_timeout })
    }

    /// With the runtime's reserved part for `num_ranks` ranks, and the capacity rounded.
    fn for_ranks(mut self, num_ranks: usize) -> Result<Settings> {
        let (capacity, reserved) = segment_bytes(self.capacity, reserved_bytes(num_ranks))?;
        self.capacity = capacity;
        self.reserved = reserved;
        Ok(self)
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
            backend: Backend::Host,
            run_lock: Mutex::new(()),
        }
    }
}

impl World {
    /// A world of `num_ranks` ranks with default settings.
    ///
    /// # Errors
    /// As [`WorldBuilder::build`].
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::World;
    /// let world = World::threads(2)?;
    /// assert_eq!(world.run(|rank| Ok(rank.rank() * 10))?, vec![0, 10]);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn threads(num_ranks: usize) -> Result<World> {
        Self::builder(num_ranks).build()
    }

    /// A world of one rank per Ascend NPU in `devices` (indices among the visible devices),
    /// each rank a thread of this process running the tile kernels on its NPU: compiled from
    /// Ascend C with `aclrtc` at first use, on Ascend SHMEM's symmetric heap. Built by
    /// [`AscendWorldBuilder`](crate::device::ascend::AscendWorldBuilder) with its defaults; see
    /// there for the settings and [`device::ascend`](crate::device::ascend) for what has run
    /// where.
    ///
    /// # Errors
    /// As [`AscendWorldBuilder::build`](crate::device::ascend::AscendWorldBuilder::build): on a
    /// machine without CANN, [`Error::LibraryNotFound`] naming every library path tried.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{Error, World};
    /// match World::ascend(&[0, 1]) {
    ///     Ok(world) => assert_eq!(world.num_ranks(), 2),
    ///     Err(Error::LibraryNotFound { tried, .. }) => {
    ///         assert!(tried.iter().any(|t| t.contains("libascendcl.so")))
    ///     }
    ///     Err(e) => return Err(e),
    /// }
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn ascend(devices: &[u32]) -> Result<World> {
        crate::device::ascend::AscendWorldBuilder::new(devices).build()
    }

    /// Settings for a world of `num_ranks` ranks.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::World;
    /// let world = World::builder(4).build()?;
    /// assert_eq!(world.num_ranks(), 4);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn builder(num_ranks: usize) -> WorldBuilder {
        WorldBuilder {
            num_ranks,
            heap_capacity: None,
            topology: None,
            wait_timeout: None,
            backend: Backend::Host,
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
    /// their buffers between calls; see [`Rank::release_workspaces`]).
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
            .map(|l| lock(&l.workspaces).values().flatten().map(|ws| ws.symmetric_bytes()).sum())
            .collect()
    }

    /// Runs `f` once per rank, each on its own thread, and returns the results in rank order.
    ///
    /// `f` may borrow from the caller. Runs of one world cannot overlap (a second `run` while one
    /// is going, or from inside `f`, is an error); buffers a rank keeps
    /// (such as workspaces cached by the collectives) stay valid from one run to the next.
    ///
    /// # Errors
    /// If any rank returns an error or panics, the world fails: every rank's waits return
    /// [`Error::PeerFailed`] at once (saying what the failed rank said), and `run` returns
    /// [`Error::RankFailed`] naming the rank that failed first, with its error typed as `source`
    /// (see [`Error::rank_error`], [`Error::downcast_ref`]) and every rank that failed of its own.
    /// A rank that returns from `f` while a peer still waits for it (in a collective, a barrier,
    /// or a wait only it could satisfy) ends that wait at once with [`Error::PeerGone`]. A
    /// failed world stays failed: later runs return the same error.
    ///
    /// `?` works on the user's own errors inside `f`: the standard ones convert through `From`
    /// into [`Error::User`], any other through [`Error::user`]:
    /// ```
    /// use dist_tensor::{Error, World};
    ///
    /// let err = World::threads(2)?
    ///     .run(|rank| {
    ///         let config = std::fs::read_to_string(format!("/no/config-{}.toml", rank.rank()))?;
    ///         Ok(config.len())
    ///     })
    ///     .unwrap_err();
    /// let io: &std::io::Error = err.downcast_ref().expect("the io::Error, typed");
    /// assert_eq!(io.kind(), std::io::ErrorKind::NotFound);
    /// assert!(matches!(&err, Error::RankFailed { failed_ranks, .. } if failed_ranks == &[0, 1]));
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{Error, World};
    ///
    /// let err = World::threads(4)?
    ///     .run(|rank| {
    ///         if rank.rank() == 2 {
    ///             return Err(Error::InvalidArgument { op: "demo", rank: 2, reason: "bad".into() });
    ///         }
    ///         let _ = rank.barrier_all()?; // would wait forever for rank 2; returns PeerFailed instead
    ///         Ok(())
    ///     })
    ///     .unwrap_err();
    /// assert!(matches!(err, Error::RankFailed { rank: 2, .. }), "{err}");
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn run<R, F>(&self, f: F) -> Result<Vec<R>>
    where
        R: Send,
        F: Fn(&Rank<'_>) -> Result<R> + Sync,
    {
        // Runs of one world must not overlap (their ranks would share signals and workspaces); a
        // `run` inside a rank's closure would wait for itself for ever.
        let _serialized = match self.shared.run_lock.try_lock() {
            Ok(guard) => guard,
            Err(std::sync::TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => {
                return Err(Error::InvalidArgument {
                    op: "World::run",
                    rank: 0,
                    reason:
                        "this world is already running (runs of one world cannot overlap or nest)"
                            .into(),
                });
            }
        };
        let shared = &*self.shared;
        if let Some(err) = shared.world_error(true) {
            return Err(err);
        }
        let n = shared.num_ranks();
        for r in 0..n {
            shared.control.set_state(r, RankState::Running);
        }
        let f = &f;
        let outcomes: Vec<Option<R>> = std::thread::scope(|scope| {
            let mut handles = Vec::with_capacity(n);
            for r in 0..n {
                let spawned = std::thread::Builder::new()
                    .name(format!("rank-{r}"))
                    .spawn_scoped(scope, move || run_rank(shared, r, f));
                match spawned {
                    Ok(handle) => handles.push(handle),
                    Err(err) => {
                        // The ranks already started stop at once: the world has failed.
                        let err = Error::System {
                            op: "World::run",
                            rank: r,
                            what: "cannot start the rank's thread".into(),
                            source: Arc::new(err),
                        };
                        shared.fail_with(r, &err);
                        for rest in r..n {
                            shared.control.set_state(rest, RankState::Failed);
                        }
                        break;
                    }
                }
            }
            let mut outcomes: Vec<Option<R>> =
                handles.into_iter().map(|h| h.join().unwrap_or(None)).collect();
            outcomes.resize_with(n, || None);
            outcomes
        });
        if let Some(err) = shared.world_error(false) {
            return Err(err);
        }
        Ok(outcomes
            .into_iter()
            .map(|o| o.expect("no failure recorded, so every rank returned"))
            .collect())
    }
}

/// One rank's part of a run: the closure, then its state for the peers to see.
pub(crate) fn run_rank<R, F>(shared: &WorldShared, r: usize, f: &F) -> Option<R>
where
    F: Fn(&Rank<'_>) -> Result<R>,
{
    let rank = Rank::new(shared, r);
    let outcome = catch_unwind(AssertUnwindSafe(|| f(&rank)));
    let err = match outcome {
        Ok(Ok(value)) => {
            shared.control.set_state(r, RankState::Returned);
            return Some(value);
        }
        Ok(Err(err)) => err,
        Err(panic) => Error::Panicked { rank: r, message: panic_message(&*panic) },
    };
    shared.fail_with(r, &err);
    shared.control.set_state(r, RankState::Failed);
    None
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

/// The text of a panic payload.
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "(a panic without a message)".to_string()
    }
}
