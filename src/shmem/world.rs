//! [`World`]: a set of ranks that share a symmetric heap, run as threads of this process.

use std::any::TypeId;
use std::collections::HashMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::control::{Control, RankState};
use super::device_world::DeviceWorld;
use super::exchange::{CallCounter, reserved_bytes};
use super::heap::{Heap, lock, segment_bytes};
use super::mapping::Mapping;
use super::rank::Rank;
use super::sync::{Watch, deadline_after};
use super::transport::Transport;
use crate::device::Topology;
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
    /// Blocks of the heap lent to output tensors (see `lent`).
    pub(crate) output_blocks: Mutex<super::lent::OutputBlocks>,
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
    /// Where the ranks' kernels run: the host simulation, GPUs or NPUs. Set when the world is
    /// made; every op's dispatch reads it (see `device_world`).
    pub(crate) device: DeviceWorld,
    run_lock: Mutex<()>,
    /// Which ranks are on this node (reached by pointer), and the way to the others.
    pub(crate) transport: Transport,
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
        self.device.failed(rank, &reason);
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
    /// The rank this process is, for a world of processes; `None` when every rank is a thread
    /// of this process.
    here: Option<usize>,
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
    device: DeviceWorld,
    cuda: Option<Vec<usize>>,
}

pub(crate) fn env_number(name: &'static str) -> Result<Option<u64>> {
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
    /// Runs the world on NVIDIA GPUs: rank `r` on CUDA device `devices[r]` (feature `cuda`; see
    /// [`World::cuda`]). The number of devices must be the number of ranks.
    ///
    /// # Examples
    /// ```
    /// use std::time::Duration;
    /// use dist_tensor::World;
    /// // Without GPUs (or without the `cuda` feature) building fails with a typed error.
    /// match World::builder(1).cuda(&[0]).wait_timeout(Duration::from_secs(5)).build() {
    ///     Ok(world) => assert_eq!(world.num_ranks(), 1),
    ///     Err(e) => println!("no GPU world: {e}"),
    /// }
    /// ```
    pub fn cuda(mut self, devices: &[usize]) -> Self {
        self.cuda = Some(devices.to_vec());
        self
    }

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
    pub(crate) fn device_world(mut self, device: DeviceWorld) -> Self {
        self.device = device;
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
        if let Some(devices) = &self.cuda
            && devices.len() != n
        {
            return Err(Error::InvalidArgument {
                op: "World::build",
                rank: 0,
                reason: format!("{n} ranks on {} GPUs: one rank per GPU", devices.len()),
            });
        }
        if n == 0 {
            return Err(Error::InvalidArgument {
                op: "World::build",
                rank: 0,
                reason: "a world needs at least one rank".into(),
            });
        }
        if n > super::job_env::MAX_WORLD_SIZE {
            return Err(Error::InvalidArgument {
                op: "World::build",
                rank: 0,
                reason: format!(
                    "{n} ranks: more than the {} a world may have",
                    super::job_env::MAX_WORLD_SIZE
                ),
            });
        }
        let settings =
            Settings::resolve(self.heap_capacity, self.wait_timeout)?.for_ranks(n, false)?;
        let heap = Heap::anonymous(n, settings.capacity, settings.reserved)?;
        let control =
            Mapping::anonymous(Control::bytes(n)).map_err(|e| Error::InvalidArgument {
                op: "World::build",
                rank: 0,
                reason: format!("cannot map the control block: {e}"),
            })?;
        let topology = self.topology.unwrap_or_else(|| Topology::host_default(n));
        let mut shared = WorldShared::new(heap, Control::create(control, n), topology, &settings);
        shared.device = match &self.cuda {
            Some(devices) => {
                DeviceWorld::Cuda(crate::device::cuda::open_world(devices, settings.wait_timeout)?)
            }
            None => self.device,
        };
        Ok(World { shared: Arc::new(shared), here: None })
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

    /// With the runtime's reserved part for `num_ranks` ranks (on several nodes: `inboxes`), and
    /// the capacity rounded.
    pub(crate) fn for_ranks(mut self, num_ranks: usize, inboxes: bool) -> Result<Settings> {
        let reserved = reserved_bytes(num_ranks, inboxes);
        let (capacity, reserved) = segment_bytes(self.capacity, reserved)?;
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
            device: DeviceWorld::Host,
            run_lock: Mutex::new(()),
            transport: Transport::local(n),
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

    /// This process as one rank of a job whose ranks are the processes of this host, started by
    /// mpirun, torchrun, Slurm or [`World::spawn_local`]: the rank, world size and job come from
    /// the environment (see [`job_env`](crate::shmem::job_env)). The ranks meet, exchange their
    /// heap segments (memfds passed over an abstract Unix socket) and map each other's; then
    /// [`World::run`] runs the closure once, for this rank, and every op runs as between threads.
    ///
    /// Heap capacity and wait timeout come from the environment ([`HEAP_BYTES_ENV`],
    /// [`WAIT_TIMEOUT_ENV`]) and must be the same on every rank (each rank checks rank 0's
    /// against its own); how long the ranks wait for each other to join from
    /// [`JOIN_TIMEOUT_ENV`](crate::shmem::job_env::JOIN_TIMEOUT_ENV) (default 60 s).
    ///
    /// With the `mpi` feature, a job started by an MPI launcher (OpenMPI's mpirun, MPICH's
    /// Hydra) may span many hosts: a proxy thread initialises MPI, whose communicator says who is
    /// who; the ranks of each node meet as above (one node per host, from MPI's shared-memory
    /// split, or [`RANKS_PER_NODE_ENV`](crate::shmem::job_env::RANKS_PER_NODE_ENV) ranks per
    /// node), and ranks of different nodes reach each other through the proxy (see
    /// [`Rank::put_signal`], [`Rank::is_local`]). Every rank must have the same heap capacity
    /// and wait timeout. MPI starts once per process: one such world per process, and MPI ends
    /// when it is dropped (`MPI_Finalize`, once every rank of the other nodes said goodbye).
    /// When a process dies, plain mpirun ends the whole job at once (naming the rank); with
    /// OpenMPI's `--enable-recovery` the others go on long enough to end with an error naming it.
    ///
    /// # Errors
    /// [`Error::Environment`] naming what is missing or inconsistent (no rank, a rank not below
    /// the world size, two launchers that disagree, a job over several hosts without the `mpi`
    /// feature, ranks of one node on different hosts, settings that differ between ranks, MPI
    /// started twice), or a peer that never joins within the join timeout;
    /// [`Error::ForeignPeer`] when the process at the other end of the rendezvous runs as another
    /// user or belongs to another launch with the same job id; [`Error::BadPeerMessage`] naming
    /// a field rank 0 (or a joining rank of this launch) sent that is not acceptable; [`Error::System`]
    /// when the operating system refuses a step of the rendezvous; [`Error::Mpi`] when MPI fails.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::World;
    /// // Not started as a rank: the error says what it looked for.
    /// if !World::launched() {
    ///     let err = World::from_env().unwrap_err().to_string();
    ///     assert!(err.contains("no rank in the environment"), "{err}");
    /// }
    /// ```
    pub fn from_env() -> Result<World> {
        World::from_env_on(super::device_process::cuda_from_env()?)
    }

    /// [`World::from_env`], on GPUs when `cuda` (see [`DEVICE_ENV`](super::DEVICE_ENV)).
    fn from_env_on(cuda: bool) -> Result<World> {
        let get = |name: &str| std::env::var(name).ok();
        let env = super::job_env::JobEnv::read_spanning(&get)?;
        if let Some(world) = super::transport::join_by_mpi(&env) {
            return world;
        }
        let env = super::job_env::JobEnv::read(&get)?;
        let join_timeout = match env_number(super::job_env::JOIN_TIMEOUT_ENV)? {
            Some(ms) => Duration::from_millis(ms.max(1)),
            None => Duration::from_secs(60),
        };
        let settings = Settings::resolve(None, None)?.for_ranks(env.world_size, false)?;
        let members = super::process::Members::all(env.world_size);
        let joined = super::process::join(&env, &members, settings, join_timeout)?;
        let me = env.rank;
        let pid = rustix::process::getpid().as_raw_nonzero().get() as u32;
        joined.control.pid(me).store(pid, std::sync::atomic::Ordering::Release);
        // In the job from now on: a peer that waits for this rank before it enters `run` must
        // not take it for gone.
        joined.control.set_state(me, RankState::Running);
        let topology = Topology::host_default(env.world_size);
        let mut shared = WorldShared::new(joined.heap, joined.control, topology, &joined.settings);
        let peers = joined.peers;
        shared.on_tick = Some(Box::new(move |control: &Control| peers.check(control)));
        if cuda {
            super::device_process::attach_cuda(&mut shared, &env, join_timeout)?;
        }
        let shared = Arc::new(shared);
        super::device_process::watch_device(&shared);
        Ok(World { shared, here: Some(me) })
    }

    /// A world of processes whose `shared` state this process made, as rank `me`.
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))] // used by the MPI world only
    pub(crate) fn from_process(shared: WorldShared, me: usize) -> World {
        World { shared: Arc::new(shared), here: Some(me) }
    }

    /// Re-executes this program as the `num_ranks` ranks of a job on this host and waits for
    /// them: each child finds its rank in the environment ([`World::from_env`]). Returns how each
    /// ended and what it printed. See [`World::local_job`] for arguments, variables, a timeout.
    ///
    /// # Errors
    /// As [`LocalJob::run`](crate::shmem::LocalJob::run).
    ///
    /// # Examples
    /// ```no_run
    /// use dist_tensor::World;
    /// if World::launched() {
    ///     let world = World::from_env()?;
    ///     world.run(|rank| rank.barrier_all().map(drop))?;
    /// } else {
    ///     assert!(World::spawn_local(4)?.iter().all(|exit| exit.success()));
    /// }
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn spawn_local(num_ranks: usize) -> Result<Vec<super::RankExit>> {
        super::LocalJob::new(num_ranks).run()
    }

    /// A job of `num_ranks` ranks of this program on this host, to set up before
    /// [`LocalJob::run`](crate::shmem::LocalJob::run).
    ///
    /// # Examples
    /// ```
    /// use std::time::Duration;
    /// use dist_tensor::World;
    /// let job = World::local_job(2).args(["--rank-mode"]).timeout(Duration::from_secs(30));
    /// assert!(format!("{job:?}").contains("ranks: 2"));
    /// ```
    pub fn local_job(num_ranks: usize) -> super::LocalJob {
        super::LocalJob::new(num_ranks)
    }

    /// Where a program's ranks live, from its arguments and environment (what the examples use):
    ///
    /// - started as a rank of a job (mpirun, torchrun, Slurm, or a parent's `--processes`, see
    ///   [`World::launched`]): this process's rank, [`World::from_env`];
    /// - `--processes N` among `args`: starts `N` ranks of this program with
    ///   [`World::spawn_local`], waits for them, prints what they printed (rank 0 last, as it
    ///   prints the summary) and returns `None`;
    /// - otherwise [`World::threads`]`(threads)`.
    ///
    /// `--device cuda` among `args` with `--processes N` (or in a launched rank) makes the world
    /// on GPUs, one per process (see [`DEVICE_ENV`](super::DEVICE_ENV)), and is taken out too.
    ///
    /// `--processes N` is taken out of `args` in every case, so the program parses the rest.
    ///
    /// # Errors
    /// As [`World::from_env`] or [`World::threads`]; for `--processes`, a value that is not a
    /// number, or [`Error::RankFailed`] naming the first rank whose process failed (with what it
    /// wrote to its standard error).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::World;
    /// let mut args = vec!["--size".to_string(), "8".to_string()];
    /// if let Some(world) = World::from_args(&mut args, 2)? {
    ///     let ones = world.run(|rank| Ok(rank.num_ranks()))?;
    ///     if !World::launched() {
    ///         assert_eq!(ones, vec![2, 2]);
    ///     }
    /// }
    /// assert_eq!(args, ["--size", "8"]);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn from_args(args: &mut Vec<String>, threads: usize) -> Result<Option<World>> {
        let mut processes = None;
        if let Some(at) = args.iter().position(|a| a == "--processes") {
            let value = args.get(at + 1).cloned().unwrap_or_default();
            let n: usize = value.parse().map_err(|_| Error::InvalidArgument {
                op: "World::from_args",
                rank: 0,
                reason: format!("--processes {value:?}: not a whole number"),
            })?;
            args.drain(at..(at + 2).min(args.len()));
            processes = Some(n);
        }
        // `--device cuda` with processes: the world is made on GPUs, and the argument taken out
        // (the children see it among this process's own arguments).
        let cuda = super::device_process::cuda_from_args(args);
        if cuda && (processes.is_some() || World::launched()) {
            super::device_process::take_device_arg(args);
        }
        if World::launched() {
            return World::from_env_on(cuda || super::device_process::cuda_from_env()?).map(Some);
        }
        let Some(n) = processes else {
            return World::threads(threads).map(Some);
        };
        let exits = World::spawn_local(n)?;
        for exit in exits.iter().skip(1).chain(exits.first()) {
            print!("{}", exit.stdout_text());
            eprint!("{}", exit.stderr_text());
        }
        let failed: Vec<usize> = exits.iter().filter(|e| !e.success()).map(|e| e.rank).collect();
        // The cause is the rank that was killed (by a signal, or for its time), not the first of
        // the ranks that then failed because it was gone.
        let killed =
            exits.iter().find(|e| !e.success() && (e.timed_out || e.status.code().is_none()));
        match killed.map(|e| e.rank).or(failed.first().copied()) {
            None => Ok(None),
            Some(rank) => Err(Error::RankFailed {
                rank,
                reason: format!("its process {}", exits[rank].describe()),
                source: None,
                failed_ranks: failed,
            }),
        }
    }

    /// Whether this process was started as a rank of a job: whether the environment names a rank
    /// (see [`World::from_env`]).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::World;
    /// // A doc-test is not started by mpirun (unless it is).
    /// assert_eq!(World::launched(), std::env::var("DIST_TENSOR_RANK").is_ok()
    ///     || std::env::var("OMPI_COMM_WORLD_RANK").is_ok()
    ///     || std::env::var("PMI_RANK").is_ok()
    ///     || std::env::var("SLURM_PROCID").is_ok()
    ///     || std::env::var("RANK").is_ok());
    /// ```
    pub fn launched() -> bool {
        super::job_env::launched(&|name| std::env::var(name).ok())
    }

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
            device: DeviceWorld::Host,
            cuda: None,
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
    /// [`Rank::release_workspaces`]).
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

    /// Runs `f` once per rank, each on its own thread, and returns the results in rank order.
    /// For a world of processes ([`World::from_env`]) it runs `f` once, for this process's rank,
    /// and returns that one result (see [`World::ranks_here`]).
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
        // A failure already recorded is of an earlier run, unless (a world of processes) the
        // rank that failed had entered more runs than this one: then it is of the run this
        // rank is entering.
        let earlier = self.here.is_none_or(|me| {
            let control = &shared.control;
            control.first_failure().is_none_or(|(failed, _)| {
                control.runs(failed).load(std::sync::atomic::Ordering::Acquire)
                    <= control.runs(me).load(std::sync::atomic::Ordering::Acquire)
            })
        });
        if let Some(err) = shared.world_error(earlier) {
            if let (false, Some(me)) = (earlier, self.here) {
                // This rank has now had its part of that run: a later run's failure record is
                // then of an earlier one.
                shared.control.runs(me).fetch_add(1, std::sync::atomic::Ordering::AcqRel);
            }
            return Err(err);
        }
        if let Some(me) = self.here {
            // A world of processes: this process is one rank.
            shared.control.enter_run(me);
            return match run_rank(shared, me, &f) {
                Some(value) => Ok(vec![value]),
                None => Err(shared.world_error(false).expect("the rank failed")),
            };
        }
        let n = shared.num_ranks();
        for r in 0..n {
            shared.control.enter_run(r);
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
    // On a device world, a rank's part ends once its device work is done.
    let body = || {
        let value = f(&rank)?;
        shared.device.finish_rank(r).map(|()| value)
    };
    let outcome = catch_unwind(AssertUnwindSafe(body));
    let err = match outcome {
        Ok(Ok(value)) => {
            shared.control.set_state(r, RankState::Returned);
            return Some(value);
        }
        Ok(Err(err)) => err,
        // A typed panic (`symm_at` on a peer of another node) stays typed.
        Err(panic) => match panic.downcast::<Error>() {
            Ok(err) => *err,
            Err(panic) => Error::Panicked { rank: r, message: panic_message(&*panic) },
        },
    };
    shared.fail_with(r, &err);
    shared.control.set_state(r, RankState::Failed);
    None
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
