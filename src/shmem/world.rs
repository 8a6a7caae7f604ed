//! [`World`]: a set of ranks that share a symmetric heap, run as threads of this process.

use std::any::TypeId;
use std::collections::HashMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::heap::{Heap, lock};
use super::rank::Rank;
use super::signal::SIGNAL_STRIDE;
use super::sync::{Failure, Parker};
use crate::device::{Backend, Topology};
use crate::{Error, Result};

/// Default capacity of each rank's heap segment. Address space only: untouched pages cost nothing.
pub const DEFAULT_HEAP_BYTES: usize = 1 << 30;
/// Default time a wait gives a peer before it reports a timeout.
pub const DEFAULT_WAIT_TIMEOUT: Duration = Duration::from_secs(60);
/// Environment variable that overrides the heap capacity per rank, in bytes.
pub const HEAP_BYTES_ENV: &str = "DIST_TENSOR_HEAP_BYTES";
/// Environment variable that overrides the wait timeout, in milliseconds.
pub const WAIT_TIMEOUT_ENV: &str = "DIST_TENSOR_WAIT_TIMEOUT_MS";

/// State shared by every rank of a world.
pub(crate) struct WorldShared {
    pub(crate) heap: Arc<Heap>,
    pub(crate) topology: Topology,
    pub(crate) wait_timeout: Duration,
    pub(crate) parkers: Vec<Parker>,
    pub(crate) failure: Failure,
    /// Per rank: how many barriers it has entered (the epoch its barrier signals carry).
    pub(crate) barrier_epochs: Vec<AtomicU64>,
    /// Per rank: workspaces kept from one call (and one run) to the next, by type.
    pub(crate) workspaces: Vec<Mutex<Workspaces>>,
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
        self.parkers.len()
    }

    /// The error a rank reports when it stops because another failed.
    pub(crate) fn peer_failed(&self, rank: usize) -> Error {
        let failed_rank = self.failure.first().map_or(rank, |(r, _)| r);
        Error::PeerFailed { rank, failed_rank }
    }

    /// Records a failure of `rank` and wakes every waiter of every rank so that they give up.
    pub(crate) fn fail(&self, rank: usize, reason: String) {
        self.failure.set(rank, reason);
        for parker in &self.parkers {
            parker.wake();
        }
    }

    /// Records `err` as `rank`'s failure, unless it only reports that another rank failed first.
    pub(crate) fn fail_with(&self, rank: usize, err: &Error) {
        if !matches!(err, Error::PeerFailed { .. }) || !self.failure.is_set() {
            self.fail(rank, err.to_string());
        }
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
        let heap_capacity = match self.heap_capacity {
            Some(bytes) => bytes,
            None => env_number(HEAP_BYTES_ENV)?.map_or(DEFAULT_HEAP_BYTES, |b| b as usize),
        };
        let wait_timeout = match self.wait_timeout {
            Some(t) => t,
            None => {
                env_number(WAIT_TIMEOUT_ENV)?.map_or(DEFAULT_WAIT_TIMEOUT, Duration::from_millis)
            }
        };
        // The runtime keeps one barrier signal per rank at the start of every segment.
        let heap = Heap::new(n, heap_capacity, n * SIGNAL_STRIDE)?;
        Ok(World {
            shared: Arc::new(WorldShared {
                heap: Arc::new(heap),
                topology: self.topology.unwrap_or_else(|| Topology::host_default(n)),
                wait_timeout,
                parkers: (0..n).map(|_| Parker::default()).collect(),
                failure: Failure::default(),
                barrier_epochs: (0..n).map(|_| AtomicU64::new(0)).collect(),
                workspaces: (0..n).map(|_| Mutex::new(HashMap::new())).collect(),
                backend: self.backend,
                run_lock: Mutex::new(()),
            }),
        })
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
            .workspaces
            .iter()
            .map(|w| lock(w).values().flatten().map(|ws| ws.symmetric_bytes()).sum())
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
    /// [`Error::PeerFailed`] at once, and `run` returns [`Error::RankFailed`] naming the rank that
    /// failed first and why. A failed world stays failed: later runs return the same error.
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
        if let Some((rank, reason)) = self.shared.failure.first() {
            return Err(Error::RankFailed {
                rank,
                reason: format!("(in an earlier run) {reason}"),
            });
        }
        let shared = &*self.shared;
        let f = &f;
        let outcomes: Vec<Option<R>> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..shared.num_ranks())
                .map(|r| {
                    std::thread::Builder::new()
                        .name(format!("rank-{r}"))
                        .spawn_scoped(scope, move || {
                            let rank = Rank::new(shared, r);
                            match catch_unwind(AssertUnwindSafe(|| f(&rank))) {
                                Ok(Ok(value)) => Some(value),
                                Ok(Err(err)) => {
                                    shared.fail_with(r, &err);
                                    None
                                }
                                Err(panic) => {
                                    shared.fail(r, format!("panicked: {}", panic_message(&*panic)));
                                    None
                                }
                            }
                        })
                        .expect("spawning a rank thread")
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap_or(None)).collect()
        });
        if let Some((rank, reason)) = self.shared.failure.first() {
            return Err(Error::RankFailed { rank, reason });
        }
        Ok(outcomes
            .into_iter()
            .map(|o| o.expect("no failure recorded, so every rank returned"))
            .collect())
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
