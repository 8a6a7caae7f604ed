//! Which rank of which job this process is, from the environment its launcher set.
//!
//! Launchers are read in a fixed order (the first that names a rank wins, and any other that
//! also names one must agree with it): our own `DIST_TENSOR_*`, OpenMPI's `OMPI_COMM_WORLD_*`,
//! MPICH/Hydra's `PMI_*`, Slurm's `SLURM_*`, torchrun's `RANK` / `WORLD_SIZE`. The job id, which
//! names the rendezvous of the job's processes, comes from `DIST_TENSOR_JOB_ID`, `PMIX_NAMESPACE`,
//! `SLURM_JOB_ID` (with `SLURM_STEP_ID`), `TORCHELASTIC_RUN_ID` or `MASTER_ADDR:MASTER_PORT`,
//! and failing those from the parent process (the launcher's daemon, the same for every rank of
//! a job on one host).
//!
//! A job id from predictable values alone could be taken first by another local user: where the
//! launcher offers something such a user cannot know, it is part of the id (mpirun's random
//! transport key, as a digest, beside the PMIx namespace; `World::spawn_local`'s ids are random).
//! Whatever the id, the rendezvous only ever joins processes of the same user (the kernel's
//! `SO_PEERCRED`, checked at both ends), and every rank sends its `launch_identity` (the
//! executable and the launcher's per-launch variables), so that two launches that share an
//! explicit `DIST_TENSOR_JOB_ID` are refused, not mixed, when they differ in either. Two launches
//! of one executable and world size, with one id and no launcher identity, cannot be told apart:
//! give each its own id.

use crate::{Error, Result};

/// Environment variable naming this process's rank (set by `World::spawn_local`).
pub const RANK_ENV: &str = "DIST_TENSOR_RANK";
/// Environment variable naming the number of ranks of the job.
pub const WORLD_SIZE_ENV: &str = "DIST_TENSOR_WORLD_SIZE";
/// Environment variable naming this process's rank among those of its host.
pub const LOCAL_RANK_ENV: &str = "DIST_TENSOR_LOCAL_RANK";
/// Environment variable naming the number of ranks on this host.
pub const LOCAL_WORLD_SIZE_ENV: &str = "DIST_TENSOR_LOCAL_WORLD_SIZE";
/// Environment variable naming the job (every rank of a job must see the same value).
pub const JOB_ID_ENV: &str = "DIST_TENSOR_JOB_ID";
/// Environment variable that [`World::spawn_local`](crate::World::spawn_local) sets to a random
/// value per launch: part of the launch identity every rank checks at join, so that two launches
/// that share a `DIST_TENSOR_JOB_ID` never mix their ranks.
pub const LAUNCH_ID_ENV: &str = "DIST_TENSOR_LAUNCH_ID";
/// The most ranks a world may have: a world size above it is an error, not an allocation that
/// overflows.
pub const MAX_WORLD_SIZE: usize = 1 << 20;
/// Variables that identify one launch of a job, where its launcher sets them: ranks of one
/// launch see the same values, ranks of two launches (almost always) not.
const LAUNCH_VARS: [&str; 9] = [
    LAUNCH_ID_ENV,
    "SLURM_JOB_ID",
    "SLURM_STEP_ID",
    "PMIX_NAMESPACE",
    "OMPI_MCA_orte_precondition_transports",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "MASTER_ADDR",
    "MASTER_PORT",
];
/// OpenMPI's mpirun puts a random key of its own in every rank's environment (for its PSM
/// transports): what a squatter of another user cannot know in advance, unlike the namespace.
const OMPI_KEY: &str = "OMPI_MCA_orte_precondition_transports";
/// Environment variable bounding how long the ranks wait for each other to join, in ms.
pub const JOIN_TIMEOUT_ENV: &str = "DIST_TENSOR_JOIN_TIMEOUT_MS";

/// Environment variable (feature `mpi`): ranks per node, to make several nodes of one host. With
/// `1`, every process is its own node and every byte between ranks goes through MPI (with
/// `--mca btl self,tcp`, over TCP). Unset: one node per host, from MPI's shared-memory split.
pub const RANKS_PER_NODE_ENV: &str = "DIST_TENSOR_RANKS_PER_NODE";
/// Environment variable (feature `mpi`, for tests): a delay the proxy adds to every put to another
/// node, in microseconds.
pub const THROTTLE_DELAY_ENV: &str = "DIST_TENSOR_MPI_DELAY_US";
/// Environment variable (feature `mpi`, for tests): the most bytes per second the proxy sends
/// puts to other nodes at.
pub const THROTTLE_BANDWIDTH_ENV: &str = "DIST_TENSOR_MPI_BANDWIDTH";

/// Environment variable: `0` (or `off`) keeps the default scheduling slice for the threads that
/// relay communication (the MPI proxy, the data-parallel reducer), which otherwise ask Linux for a
/// short one so that they run as soon as they wake (see `shmem::latency`).
pub const SHORT_SLICE_ENV: &str = "DIST_TENSOR_SHORT_SLICE";

/// Every launcher's variables that say which job and rank a process is: a spawned rank gets
/// only ours.
pub(crate) const LAUNCHER_VARS: [&str; 26] = [
    LAUNCH_ID_ENV,
    RANK_ENV,
    WORLD_SIZE_ENV,
    LOCAL_RANK_ENV,
    LOCAL_WORLD_SIZE_ENV,
    JOB_ID_ENV,
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "PMI_RANK",
    "PMI_SIZE",
    "MPI_LOCALRANKID",
    "MPI_LOCALNRANKS",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "SLURM_JOB_ID",
    "SLURM_STEP_ID",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "PMIX_NAMESPACE",
    "TORCHELASTIC_RUN_ID",
    "MASTER_PORT",
];

/// One launcher's variables: rank, world size, local rank, local world size.
struct Family {
    launcher: &'static str,
    rank: &'static str,
    size: &'static str,
    local_rank: Option<&'static str>,
    local_size: Option<&'static str>,
}

const FAMILIES: [Family; 5] = [
    Family {
        launcher: "dist-tensor",
        rank: RANK_ENV,
        size: WORLD_SIZE_ENV,
        local_rank: Some(LOCAL_RANK_ENV),
        local_size: Some(LOCAL_WORLD_SIZE_ENV),
    },
    Family {
        launcher: "OpenMPI",
        rank: "OMPI_COMM_WORLD_RANK",
        size: "OMPI_COMM_WORLD_SIZE",
        local_rank: Some("OMPI_COMM_WORLD_LOCAL_RANK"),
        local_size: Some("OMPI_COMM_WORLD_LOCAL_SIZE"),
    },
    Family {
        launcher: "MPICH/Hydra",
        rank: "PMI_RANK",
        size: "PMI_SIZE",
        local_rank: Some("MPI_LOCALRANKID"),
        local_size: Some("MPI_LOCALNRANKS"),
    },
    Family {
        launcher: "Slurm",
        rank: "SLURM_PROCID",
        size: "SLURM_NTASKS",
        local_rank: Some("SLURM_LOCALID"),
        // Slurm writes tasks per node as "4(x2)": the local rank alone tells a second host.
        local_size: None,
    },
    Family {
        launcher: "torchrun",
        rank: "RANK",
        size: "WORLD_SIZE",
        local_rank: Some("LOCAL_RANK"),
        local_size: Some("LOCAL_WORLD_SIZE"),
    },
];

/// What the environment says about this process's place in a job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct JobEnv {
    pub(crate) rank: usize,
    pub(crate) world_size: usize,
    pub(crate) local_rank: usize,
    pub(crate) local_world_size: usize,
    pub(crate) job_id: String,
    /// The launcher whose variables were used.
    pub(crate) launcher: &'static str,
}

fn bad(reason: String) -> Error {
    Error::Environment { op: "World::from_env", reason }
}

/// A value for a message: quoted, and cut short when long (a hostile environment must not make
/// a message of megabytes).
fn shown(text: &str) -> String {
    const MOST: usize = 64;
    if text.len() <= MOST {
        return format!("{text:?}");
    }
    let mut end = MOST;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{:?}... ({} bytes)", &text[..end], text.len())
}

/// A whole number from `name`, `None` if unset; an error naming it if set but not a number.
fn number(get: &dyn Fn(&str) -> Option<String>, name: &str) -> Result<Option<usize>> {
    match get(name) {
        None => Ok(None),
        Some(text) => text
            .trim()
            .parse()
            .map(Some)
            .map_err(|_| bad(format!("{name}={} is not a whole number", shown(&text)))),
    }
}

/// Whether the environment names a rank of a job (any launcher's rank variable is set).
pub(crate) fn launched(get: &dyn Fn(&str) -> Option<String>) -> bool {
    FAMILIES.iter().any(|f| get(f.rank).is_some())
}

impl JobEnv {
    /// Reads the environment through `get` (the process's own, or a test's map), for a job of
    /// one host: a job whose ranks span several hosts is an error here (see
    /// [`JobEnv::read_spanning`]).
    pub(crate) fn read(get: &dyn Fn(&str) -> Option<String>) -> Result<JobEnv> {
        let env = Self::read_spanning(get)?;
        if env.local_world_size != env.world_size || env.local_rank != env.rank {
            return Err(bad(format!(
                "the job spans several hosts ({} of {} ranks on this one, local rank {} of rank \
                 {}): ranks that are processes share memory on one host only; several hosts \
                 need the mpi feature and an MPI launcher",
                env.local_world_size, env.world_size, env.local_rank, env.rank
            )));
        }
        Ok(env)
    }

    /// Whether the job was started by an MPI launcher (OpenMPI's mpirun or MPICH's Hydra), whose
    /// communicator then says who is who.
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))] // used by the MPI world only
    pub(crate) fn by_mpi(&self) -> bool {
        matches!(self.launcher, "OpenMPI" | "MPICH/Hydra")
    }

    /// Reads the environment through `get`, for a job that may span several hosts.
    pub(crate) fn read_spanning(get: &dyn Fn(&str) -> Option<String>) -> Result<JobEnv> {
        let mut found: Vec<(&Family, usize, usize)> = Vec::new();
        for family in &FAMILIES {
            let rank = number(get, family.rank)?;
            let size = number(get, family.size)?;
            match (rank, size) {
                (None, None) => {}
                (Some(rank), Some(size)) => found.push((family, rank, size)),
                (Some(_), None) => {
                    return Err(bad(format!(
                        "{} is set but {} is not: the world size is missing",
                        family.rank, family.size
                    )));
                }
                // A size alone (Slurm sets SLURM_NTASKS for the whole allocation) says nothing.
                (None, Some(_)) => {}
            }
        }
        let Some(&(family, rank, world_size)) = found.first() else {
            let looked: Vec<String> =
                FAMILIES.iter().map(|f| format!("{} ({})", f.rank, f.launcher)).collect();
            return Err(bad(format!(
                "no rank in the environment; looked for {}. Start the processes with mpirun, \
                 torchrun, srun, or World::spawn_local",
                looked.join(", ")
            )));
        };
        for &(other, r, s) in &found[1..] {
            if (r, s) != (rank, world_size) {
                return Err(bad(format!(
                    "conflicting ranks: {}={rank} and {}={world_size} ({}), but {}={r} and {}={s} \
                     ({})",
                    family.rank,
                    family.size,
                    family.launcher,
                    other.rank,
                    other.size,
                    other.launcher
                )));
            }
        }
        if world_size == 0 {
            return Err(bad(format!("{}=0: a world needs at least one rank", family.size)));
        }
        if world_size > MAX_WORLD_SIZE {
            return Err(bad(format!(
                "{}={world_size}: more ranks than the {MAX_WORLD_SIZE} a world may have",
                family.size
            )));
        }
        if rank >= world_size {
            return Err(bad(format!(
                "{}={rank} is not below {}={world_size}",
                family.rank, family.size
            )));
        }
        let local_rank = match family.local_rank {
            Some(name) => number(get, name)?.unwrap_or(rank),
            None => rank,
        };
        let local_world_size = match family.local_size {
            Some(name) => number(get, name)?.unwrap_or(world_size),
            None => world_size,
        };
        let job_id = Self::job_id(get)?;
        Ok(JobEnv {
            rank,
            world_size,
            local_rank,
            local_world_size,
            job_id,
            launcher: family.launcher,
        })
    }

    fn job_id(get: &dyn Fn(&str) -> Option<String>) -> Result<String> {
        if let Some(id) = get(JOB_ID_ENV) {
            return Ok(format!("own:{id}"));
        }
        if let Some(ns) = get("PMIX_NAMESPACE") {
            // The namespace follows from mpirun's pid: with mpirun's random key (only a digest,
            // as the name is public) another user cannot take the name before the job does.
            return Ok(match get(OMPI_KEY) {
                Some(key) => format!("pmix:{ns}:{:016x}", digest_text(&key)),
                None => format!("pmix:{ns}"),
            });
        }
        if let Some(job) = get("SLURM_JOB_ID") {
            let step = get("SLURM_STEP_ID").unwrap_or_default();
            return Ok(format!("slurm:{job}.{step}"));
        }
        if let Some(run) = get("TORCHELASTIC_RUN_ID") {
            // torchrun's default run id is "none": every such job of the host would share it.
            let at = match (get("MASTER_ADDR"), get("MASTER_PORT")) {
                (Some(addr), Some(port)) if run == "none" => format!(":{addr}:{port}"),
                _ => String::new(),
            };
            let restart = get("TORCHELASTIC_RESTART_COUNT").unwrap_or_default();
            return Ok(format!("torch:{run}{at}.{restart}"));
        }
        if let (Some(addr), Some(port)) = (get("MASTER_ADDR"), get("MASTER_PORT")) {
            return Ok(format!("torch:{addr}:{port}"));
        }
        // Every rank of a job on one host has the same parent: the launcher or its daemon.
        let parent = rustix::process::getppid().map_or(0, |p| p.as_raw_nonzero().get());
        if parent <= 1 {
            return Err(bad(format!(
                "no job id: set {JOB_ID_ENV} to the same value in every rank of the job"
            )));
        }
        Ok(format!("ppid:{parent}"))
    }
}

/// FNV-1a of a text.
fn digest_text(text: &str) -> u64 {
    super::exchange::digest(text.bytes().map(u64::from))
}

/// What identifies this process's launch: its executable (device and inode) and the launcher's
/// per-launch variables ([`LAUNCH_ID_ENV`], Slurm's job and step, PMIx's namespace, mpirun's key,
/// torchrun's run id, restart count and master address), as a digest. Every rank sends it at join
/// and rank 0 refuses a rank whose identity differs: a rank of another launch that uses the same
/// job id.
pub(crate) fn launch_identity(get: &dyn Fn(&str) -> Option<String>) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let exe = std::fs::metadata("/proc/self/exe").map_or((0, 0), |m| (m.dev(), m.ino()));
    let mut words = vec![exe.0, exe.1];
    for var in LAUNCH_VARS {
        let value = get(var);
        words.push(u64::from(value.is_some()));
        words.push(value.as_deref().map_or(0, digest_text));
    }
    super::exchange::digest(words)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn read(vars: &[(&str, &str)]) -> Result<JobEnv> {
        let map: HashMap<String, String> =
            vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        JobEnv::read(&|name| map.get(name).cloned())
    }

    #[test]
    fn each_launcher_is_read() {
        let job = [("DIST_TENSOR_JOB_ID", "j")];
        for (rank, size) in [
            ("DIST_TENSOR_RANK", "DIST_TENSOR_WORLD_SIZE"),
            ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
            ("PMI_RANK", "PMI_SIZE"),
            ("SLURM_PROCID", "SLURM_NTASKS"),
            ("RANK", "WORLD_SIZE"),
        ] {
            let env = read(&[(rank, "2"), (size, "4"), job[0]]).unwrap();
            assert_eq!((env.rank, env.world_size, env.local_rank), (2, 4, 2), "{rank}");
        }
        let torch =
            read(&[("RANK", "1"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h"), ("MASTER_PORT", "9")]);
        assert_eq!(torch.unwrap().job_id, "torch:h:9");
    }

    #[test]
    fn predictable_ids_take_what_a_squatter_cannot_know() {
        let ompi = [("OMPI_COMM_WORLD_RANK", "0"), ("OMPI_COMM_WORLD_SIZE", "2")];
        let ns = ("PMIX_NAMESPACE", "prterun-h-100@1");
        let plain = read(&[ompi[0], ompi[1], ns]).unwrap().job_id;
        assert_eq!(plain, "pmix:prterun-h-100@1");
        let a = read(&[ompi[0], ompi[1], ns, (OMPI_KEY, "0123-4567")]).unwrap().job_id;
        let b = read(&[ompi[0], ompi[1], ns, (OMPI_KEY, "0123-4568")]).unwrap().job_id;
        assert!(a.starts_with("pmix:prterun-h-100@1:") && a != b, "{a} {b}");
        assert!(!a.contains("0123"), "the key itself is not in the public name: {a}");
        let torch = |run: &str, restart: &str| {
            read(&[
                ("RANK", "0"),
                ("WORLD_SIZE", "2"),
                ("MASTER_ADDR", "h"),
                ("MASTER_PORT", "9"),
                ("TORCHELASTIC_RUN_ID", run),
                ("TORCHELASTIC_RESTART_COUNT", restart),
            ])
            .unwrap()
            .job_id
        };
        assert_eq!(torch("none", "0"), "torch:none:h:9.0");
        assert_eq!(torch("r1", "2"), "torch:r1.2");
    }

    #[test]
    fn launch_identities_differ_between_launches_and_agree_within_one() {
        let id = |vars: &[(&str, &str)]| {
            let map: HashMap<String, String> =
                vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
            launch_identity(&|name| map.get(name).cloned())
        };
        let a = id(&[(LAUNCH_ID_ENV, "a"), (RANK_ENV, "0")]);
        assert_eq!(a, id(&[(LAUNCH_ID_ENV, "a"), (RANK_ENV, "3")]), "the rank is not in it");
        assert_ne!(a, id(&[(LAUNCH_ID_ENV, "b")]));
        assert_ne!(id(&[("SLURM_STEP_ID", "1")]), id(&[("SLURM_STEP_ID", "2")]));
        assert_ne!(id(&[("MASTER_PORT", "")]), id(&[]), "set and empty differ from unset");
    }

    #[test]
    fn hostile_world_sizes_are_errors_not_allocations() {
        for size in [(1u64 << 62).to_string(), "10000000".to_string(), u64::MAX.to_string()] {
            let err = read(&[("RANK", "0"), ("WORLD_SIZE", &size)]).unwrap_err().to_string();
            assert!(err.contains("more ranks than"), "{err}");
            assert!(err.len() < 200, "{err}");
        }
        let err = read(&[("RANK", "0"), ("WORLD_SIZE", "99999999999999999999999")]).unwrap_err();
        assert!(err.to_string().contains("is not a whole number"), "{err}");
    }

    #[test]
    fn bad_environments_say_what_is_wrong() {
        let err = |vars: &[(&str, &str)]| read(vars).unwrap_err().to_string();
        assert!(err(&[]).contains("no rank in the environment"));
        assert!(err(&[("PMI_RANK", "0")]).contains("PMI_SIZE is not"));
        assert!(
            err(&[("RANK", "x"), ("WORLD_SIZE", "2")]).contains("RANK=\"x\" is not a whole number")
        );
        assert!(err(&[("RANK", "0"), ("WORLD_SIZE", "0")]).contains("WORLD_SIZE=0"));
        assert!(
            err(&[("RANK", "2"), ("WORLD_SIZE", "2")]).contains("RANK=2 is not below WORLD_SIZE=2")
        );
        let conflict = err(&[
            ("DIST_TENSOR_RANK", "0"),
            ("DIST_TENSOR_WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
        ]);
        assert!(conflict.contains("conflicting ranks"), "{conflict}");
        let hosts = err(&[("RANK", "0"), ("WORLD_SIZE", "4"), ("LOCAL_WORLD_SIZE", "2")]);
        assert!(hosts.contains("several hosts"), "{hosts}");
    }
}

/// Which launcher wins when several have set their variables (a Slurm allocation running
/// mpirun sets Slurm's and OpenMPI's; torchrun under srun sets Slurm's and torchrun's): the
/// first of ours, OpenMPI, MPICH/Hydra, Slurm, torchrun. The local rank and size, and whether
/// MPI's communicator is used, come from the winner, so each case gives each launcher other
/// local values.
#[cfg(test)]
mod launcher_precedence {
    use super::*;
    use std::collections::HashMap;

    fn read(vars: &[(&str, &str)]) -> Result<JobEnv> {
        let mut map: HashMap<String, String> =
            vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        map.insert(JOB_ID_ENV.to_string(), "j".to_string());
        JobEnv::read_spanning(&|name| map.get(name).cloned())
    }

    /// Rank 2 of 4 as each launcher says it, with a local rank and size of its own.
    const OURS: [(&str, &str); 4] = [
        (RANK_ENV, "2"),
        (WORLD_SIZE_ENV, "4"),
        (LOCAL_RANK_ENV, "2"),
        (LOCAL_WORLD_SIZE_ENV, "4"),
    ];
    const OPENMPI: [(&str, &str); 4] = [
        ("OMPI_COMM_WORLD_RANK", "2"),
        ("OMPI_COMM_WORLD_SIZE", "4"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
    ];
    const MPICH: [(&str, &str); 4] =
        [("PMI_RANK", "2"), ("PMI_SIZE", "4"), ("MPI_LOCALRANKID", "1"), ("MPI_LOCALNRANKS", "3")];
    const SLURM: [(&str, &str); 3] =
        [("SLURM_PROCID", "2"), ("SLURM_NTASKS", "4"), ("SLURM_LOCALID", "1")];
    const TORCHRUN: [(&str, &str); 4] =
        [("RANK", "2"), ("WORLD_SIZE", "4"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "1")];

    /// (launcher, local rank, local world size, by MPI) that `vars` gives.
    fn winner(vars: &[&[(&'static str, &'static str)]]) -> (&'static str, usize, usize, bool) {
        let all: Vec<(&str, &str)> = vars.iter().flat_map(|v| v.iter().copied()).collect();
        let env = read(&all).unwrap();
        assert_eq!((env.rank, env.world_size), (2, 4));
        (env.launcher, env.local_rank, env.local_world_size, env.by_mpi())
    }

    #[test]
    fn openmpi_wins_over_slurm_when_both_are_set() {
        assert_eq!(winner(&[&SLURM, &OPENMPI]), ("OpenMPI", 0, 2, true));
        assert_eq!(winner(&[&OPENMPI, &SLURM]), ("OpenMPI", 0, 2, true));
    }

    #[test]
    fn each_pair_of_launchers_takes_the_earlier_one() {
        assert_eq!(winner(&[&SLURM, &MPICH]), ("MPICH/Hydra", 1, 3, true));
        assert_eq!(winner(&[&TORCHRUN, &SLURM]), ("Slurm", 1, 4, false));
        assert_eq!(winner(&[&MPICH, &OPENMPI]), ("OpenMPI", 0, 2, true));
        assert_eq!(winner(&[&TORCHRUN, &OPENMPI]), ("OpenMPI", 0, 2, true));
        assert_eq!(winner(&[&TORCHRUN, &OURS]), ("dist-tensor", 2, 4, false));
        // Alone, each gives its own local values.
        assert_eq!(winner(&[&SLURM]), ("Slurm", 1, 4, false));
        assert_eq!(winner(&[&TORCHRUN]), ("torchrun", 0, 1, false));
    }

    #[test]
    fn three_launchers_at_once_take_the_earliest() {
        assert_eq!(winner(&[&SLURM, &OPENMPI, &OURS]), ("dist-tensor", 2, 4, false));
        assert_eq!(winner(&[&TORCHRUN, &SLURM, &OPENMPI]), ("OpenMPI", 0, 2, true));
        assert_eq!(winner(&[&TORCHRUN, &SLURM, &MPICH]), ("MPICH/Hydra", 1, 3, true));
        assert_eq!(winner(&[&TORCHRUN, &SLURM, &MPICH, &OPENMPI, &OURS]).0, "dist-tensor");
    }
}
