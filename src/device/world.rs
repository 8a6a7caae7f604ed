//! Where a world's ranks run their kernels, as every op's dispatch sees it ([`DeviceWorld`]), and
//! the constructors that put a world on a device backend: [`World::from_env`] and
//! [`World::from_args`] (which read `--device cuda` and [`DEVICE_ENV`]), [`WorldBuilder::cuda`].
//! The runtime (`shmem`) holds a world's device as a `DeviceRuntime` trait object and names no
//! backend; this module is where that object becomes one of the backends again.

use std::sync::Arc;

use super::ascend::world::AscendWorld;
use super::cuda::{self, CudaWorld};
use crate::shmem::WorldBuilder;
use crate::shmem::{DeviceRuntime, DeviceSetup, OpenProcessDevice};
use crate::{Error, Rank, Result, World};

/// Where a world's ranks run their kernels: what each public collective and fused op matches on
/// once, at its entry, so that every rank of a world takes the same branch whatever device a
/// given tensor happens to live on.
#[derive(Clone, Copy)]
pub(crate) enum DeviceWorld<'w> {
    /// The host simulation of an NPU: every world of threads, processes or MPI ranks.
    Host,
    /// NVIDIA GPUs, one per rank ([`World::cuda`]).
    Cuda(&'w CudaWorld),
    /// Ascend NPUs, one per rank ([`World::ascend`]).
    Ascend(&'w AscendWorld),
}

impl<'w> Rank<'w> {
    /// Where this rank's world runs its kernels.
    pub(crate) fn device_world(&self) -> DeviceWorld<'w> {
        let Some(device) = self.device_runtime() else { return DeviceWorld::Host };
        let any = device.as_any();
        if let Some(gpus) = any.downcast_ref::<CudaWorld>() {
            DeviceWorld::Cuda(gpus)
        } else if let Some(npus) = any.downcast_ref::<AscendWorld>() {
            DeviceWorld::Ascend(npus)
        } else {
            unreachable!("a device world is made by one of this crate's backends")
        }
    }
}

/// Environment variable that puts the ranks of a launched world (`World::from_env`, torchrun,
/// mpirun, Slurm, `World::spawn_local`) on a device: `cuda` (one GPU per process, by local rank:
/// `local_rank % device count` of the visible devices) or `host` (the default). `--device cuda`
/// among a program's arguments does the same for [`World::from_args`].
pub const DEVICE_ENV: &str = "DIST_TENSOR_DEVICE";

/// Whether the environment asks for GPUs ([`DEVICE_ENV`]).
fn cuda_from_env() -> Result<bool> {
    parse_device(std::env::var(DEVICE_ENV).ok().as_deref())
}

fn parse_device(value: Option<&str>) -> Result<bool> {
    match value {
        None => Ok(false),
        Some(v) if v.eq_ignore_ascii_case("cuda") => Ok(true),
        Some(v) if v.is_empty() || v.eq_ignore_ascii_case("host") => Ok(false),
        Some(v) => Err(Error::Environment {
            op: "World::from_env",
            reason: format!("{DEVICE_ENV}={v:?}: the devices are `cuda` and `host`"),
        }),
    }
}

/// Whether a program's arguments hold `--device cuda`.
fn cuda_from_args(args: &[String]) -> bool {
    args.windows(2).any(|w| w[0] == "--device" && w[1].eq_ignore_ascii_case("cuda"))
}

/// Takes `--device cuda` out of `args`.
fn take_device_arg(args: &mut Vec<String>) {
    if let Some(at) =
        args.windows(2).position(|w| w[0] == "--device" && w[1].eq_ignore_ascii_case("cuda"))
    {
        args.drain(at..at + 2);
    }
}

/// The GPU backend's part of a world of processes.
fn open_cuda_process(job: &crate::shmem::ProcessJob<'_>) -> Result<Arc<dyn DeviceRuntime>> {
    Ok(cuda::open_process_world(job)?)
}

impl World {
    /// This process as one rank of a job whose ranks are the processes of this host, started by
    /// mpirun, torchrun, Slurm or [`World::spawn_local`]: the rank, world size and job come from
    /// the environment (see [`job_env`](crate::shmem::job_env)). The ranks meet, exchange their
    /// heap segments (memfds passed over an abstract Unix socket) and map each other's; then
    /// [`World::run`] runs the closure once, for this rank, and every op runs as between threads.
    /// With [`DEVICE_ENV`]`=cuda` each process's rank runs on a GPU.
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
    /// started twice, a [`DEVICE_ENV`] that names no device), or a peer that never joins within
    /// the join timeout; [`Error::ForeignPeer`] when the process at the other end of the
    /// rendezvous runs as another user or belongs to another launch with the same job id;
    /// [`Error::BadPeerMessage`] naming a field rank 0 (or a joining rank of this launch) sent
    /// that is not acceptable; [`Error::System`] when the operating system refuses a step of the
    /// rendezvous; [`Error::Mpi`] when MPI fails.
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
        let device: Option<OpenProcessDevice> = cuda_from_env()?.then_some(open_cuda_process);
        World::from_env_on(device)
    }

    /// Where a program's ranks live, from its arguments and environment (what the examples use):
    ///
    /// - started as a rank of a job (mpirun, torchrun, Slurm, or a parent's `--processes`, see
    ///   [`World::launched`]): this process's rank, [`World::from_env`];
    /// - `--processes N` among `args`: starts `N` ranks of this program with
    ///   [`World::spawn_local`], waits for them, prints what they printed (rank 0 last, as it
    ///   prints the summary) and returns `None`;
    /// - otherwise [`World::threads`]: `--ranks N` among `args` threads, or `threads`.
    ///
    /// `--device cuda` among `args` with `--processes N` (or in a launched rank) makes the world
    /// on GPUs, one per process (see [`DEVICE_ENV`]), and is taken out too.
    ///
    /// `--processes N` and `--ranks N` are taken out of `args` in every case, so the program
    /// parses the rest.
    ///
    /// # Errors
    /// As [`World::from_env`] or [`World::threads`]; for `--processes`, a value that is not a
    /// number, or [`Error::RankFailed`] naming the first rank whose process failed (with what it
    /// wrote to its standard error).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::World;
    /// let mut args: Vec<String> = ["--ranks", "3", "--size", "8"].map(String::from).to_vec();
    /// if let Some(world) = World::from_args(&mut args, 2)? {
    ///     let ones = world.run(|rank| Ok(rank.num_ranks()))?;
    ///     if !World::launched() {
    ///         assert_eq!(ones, vec![3, 3, 3]);
    ///     }
    /// }
    /// assert_eq!(args, ["--size", "8"]);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn from_args(args: &mut Vec<String>, threads: usize) -> Result<Option<World>> {
        World::from_args_on(args, threads, |args, in_processes| {
            // `--device cuda` with processes: the world is made on GPUs, and the argument taken
            // out (the children see it among this process's own arguments).
            let cuda = cuda_from_args(args);
            if cuda && in_processes {
                take_device_arg(args);
            }
            if !World::launched() {
                return Ok(None);
            }
            Ok((cuda || cuda_from_env()?).then_some(open_cuda_process as OpenProcessDevice))
        })
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
    /// assert!(World::builder(2).cuda(&[0]).build().is_err());
    /// ```
    pub fn cuda(self, devices: &[usize]) -> Self {
        let devices = devices.to_vec();
        let open = move |n: usize, wait_timeout| -> Result<Arc<dyn DeviceRuntime>> {
            if devices.len() != n {
                return Err(Error::InvalidArgument {
                    op: "World::build",
                    rank: 0,
                    reason: format!("{n} ranks on {} GPUs: one rank per GPU", devices.len()),
                });
            }
            Ok(cuda::open_world(&devices, wait_timeout)?)
        };
        self.device_setup(DeviceSetup::Open { backend: "cuda", open: Arc::new(open) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_device_comes_from_the_environment_or_the_arguments() {
        assert!(!parse_device(None).unwrap());
        assert!(!parse_device(Some("")).unwrap());
        assert!(!parse_device(Some("host")).unwrap());
        assert!(parse_device(Some("CUDA")).unwrap());
        let err = parse_device(Some("tpu")).unwrap_err().to_string();
        assert!(err.contains("DIST_TENSOR_DEVICE") && err.contains("tpu"), "{err}");
        let mut args: Vec<String> =
            ["--size", "8", "--device", "cuda", "--reps", "2"].map(String::from).to_vec();
        assert!(cuda_from_args(&args));
        take_device_arg(&mut args);
        assert_eq!(args, ["--size", "8", "--reps", "2"]);
        assert!(!cuda_from_args(&args));
        // `cuda` as another flag's value is not the device.
        assert!(!cuda_from_args(&["--name".into(), "cuda".into()]));
    }
}
