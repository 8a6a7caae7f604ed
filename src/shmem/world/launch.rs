//! The ways a [`World`] is made: threads of this process, NPUs, or this process as one rank of a
//! job (from the environment, or spawned here).

use std::sync::Arc;
use std::time::Duration;

use super::{Settings, World, WorldShared, env_number};
use crate::Error;
use crate::Result;
use crate::device::Topology;
use crate::shmem::control::{Control, RankState};

impl World {
    /// A world of `num_ranks` ranks with default settings.
    ///
    /// # Errors
    /// As [`WorldBuilder::build`](super::WorldBuilder::build).
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
    /// Heap capacity and wait timeout come from the environment ([`HEAP_BYTES_ENV`](crate::shmem::HEAP_BYTES_ENV),
    /// [`WAIT_TIMEOUT_ENV`](crate::shmem::WAIT_TIMEOUT_ENV)) and must be the same on every rank (each rank checks rank 0's
    /// against its own); how long the ranks wait for each other to join from
    /// [`JOIN_TIMEOUT_ENV`](crate::shmem::job_env::JOIN_TIMEOUT_ENV) (default 60 s).
    ///
    /// With the `mpi` feature, a job started by an MPI launcher (OpenMPI's mpirun, MPICH's
    /// Hydra) may span many hosts: a proxy thread initialises MPI, whose communicator says who is
    /// who; the ranks of each node meet as above (one node per host, from MPI's shared-memory
    /// split, or [`RANKS_PER_NODE_ENV`](crate::shmem::job_env::RANKS_PER_NODE_ENV) ranks per
    /// node), and ranks of different nodes reach each other through the proxy (see
    /// [`Rank::put_signal`](crate::shmem::Rank::put_signal), [`Rank::is_local`](crate::shmem::Rank::is_local)). Every rank must have the same heap capacity
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
        World::from_env_on(crate::shmem::device_process::cuda_from_env()?)
    }

    /// [`World::from_env`], on GPUs when `cuda` (see [`DEVICE_ENV`](crate::shmem::DEVICE_ENV)).
    fn from_env_on(cuda: bool) -> Result<World> {
        let get = |name: &str| std::env::var(name).ok();
        let env = crate::shmem::job_env::JobEnv::read_spanning(&get)?;
        if let Some(world) = crate::shmem::transport::join_by_mpi(&env) {
            return world;
        }
        let env = crate::shmem::job_env::JobEnv::read(&get)?;
        let join_timeout = match env_number(crate::shmem::job_env::JOIN_TIMEOUT_ENV)? {
            Some(ms) => Duration::from_millis(ms.max(1)),
            None => Duration::from_secs(60),
        };
        let settings = Settings::resolve(None, None)?.for_ranks(env.world_size, false)?;
        let members = crate::shmem::process::Members::all(env.world_size);
        let joined = crate::shmem::process::join(&env, &members, settings, join_timeout)?;
        let me = env.rank;
        let pid = rustix::process::getpid().as_raw_nonzero().get() as u32;
        joined.control.pid(me).store(pid, std::sync::atomic::Ordering::Release);
        // In the job from now on: a peer that waits for this rank before it enters `run` must
        // not take it for gone.
        joined.control.set_state(me, RankState::Running);
        let topology = Topology::host_default(env.world_size);
        let mut shared = WorldShared::new(joined.heap, joined.control, topology, &joined.settings);
        shared.kind = super::WorldKind::Processes { job_id: env.job_id.clone(), join_timeout };
        let peers = joined.peers;
        shared.on_tick = Some(Box::new(move |control: &Control| peers.check(control)));
        if cuda {
            crate::shmem::device_process::attach_cuda(&mut shared, &env, join_timeout)?;
        }
        let shared = Arc::new(shared);
        crate::shmem::device_process::watch_device(&shared);
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
    pub fn spawn_local(num_ranks: usize) -> Result<Vec<crate::shmem::RankExit>> {
        crate::shmem::LocalJob::new(num_ranks).run()
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
    pub fn local_job(num_ranks: usize) -> crate::shmem::LocalJob {
        crate::shmem::LocalJob::new(num_ranks)
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
    /// on GPUs, one per process (see [`DEVICE_ENV`](crate::shmem::DEVICE_ENV)), and is taken out too.
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
        let cuda = crate::shmem::device_process::cuda_from_args(args);
        if cuda && (processes.is_some() || World::launched()) {
            crate::shmem::device_process::take_device_arg(args);
        }
        if World::launched() {
            let cuda = cuda || crate::shmem::device_process::cuda_from_env()?;
            return World::from_env_on(cuda).map(Some);
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
        crate::shmem::job_env::launched(&|name| std::env::var(name).ok())
    }
}
