//! The ways a [`World`] is made: threads of this process, NPUs, or this process as one rank of a
//! job (from the environment, or spawned here).

use std::sync::Arc;
use std::time::Duration;

use super::{Settings, World, WorldShared, env_number};
use crate::Error;
use crate::Result;
use crate::shmem::control::{Control, RankState};
use crate::shmem::device_runtime::OpenProcessDevice;
use crate::shmem::topology::Topology;

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

    /// `World::from_env` (defined with the device backends, which choose `device`): this
    /// process as a rank of a launched job, its device side opened by `device` after the host
    /// rendezvous.
    pub(crate) fn from_env_on(device: Option<OpenProcessDevice>) -> Result<World> {
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
        if let Some(open) = device {
            crate::shmem::device_process::attach_device(&mut shared, &env, join_timeout, open)?;
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

    /// `World::from_args` (defined with the device backends): `--ranks N` (the number of
    /// ranks, `threads` when absent) and `--processes N` are parsed and taken out here; `device` then sees the rest of the arguments and whether the ranks are
    /// processes (launched, or about to be spawned), takes out its own, and says how a launched
    /// rank's device side opens.
    pub(crate) fn from_args_on(
        args: &mut Vec<String>,
        threads: usize,
        device: impl FnOnce(&mut Vec<String>, bool) -> Result<Option<OpenProcessDevice>>,
    ) -> Result<Option<World>> {
        let processes = take_count(args, "--processes")?;
        let threads = take_count(args, "--ranks")?.unwrap_or(threads);
        let device = device(args, processes.is_some() || World::launched())?;
        if World::launched() {
            return World::from_env_on(device).map(Some);
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

/// The number after `flag` in `args`, both taken out; `None` without the flag.
fn take_count(args: &mut Vec<String>, flag: &str) -> Result<Option<usize>> {
    let Some(at) = args.iter().position(|a| a == flag) else { return Ok(None) };
    let value = args.get(at + 1).cloned().unwrap_or_default();
    let n: usize = value.parse().map_err(|_| Error::InvalidArgument {
        op: "World::from_args",
        rank: 0,
        reason: format!("{flag} {value:?}: not a whole number"),
    })?;
    args.drain(at..(at + 2).min(args.len()));
    Ok(Some(n))
}
