//! `--device cuda [--ranks N]` for the examples that run on GPUs: a world of N ranks as threads,
//! each on a GPU (`World::cuda`), the ranks dealt round-robin over the GPUs present, so that N
//! ranks share one GPU where only one is (for correctness; timings of such a world mean nothing).
//! With `--processes N` (or under a launcher) `World::from_args` takes `--device cuda` itself.

#![allow(dead_code)] // each includer uses part of it

use dist_tensor::{Error, World};

/// Takes `--device cuda` (and `--ranks N`, default `default_ranks`) out of `args` and makes
/// that GPU world; `None` when the arguments ask for no GPU, or for processes (left to
/// `World::from_args`).
pub fn cuda_world_from_args(
    args: &mut Vec<String>,
    default_ranks: usize,
) -> Result<Option<World>, Error> {
    let Some(at) = args.iter().position(|a| a == "--device") else { return Ok(None) };
    if args.get(at + 1).map(String::as_str) != Some("cuda")
        || args.iter().any(|a| a == "--processes")
        || World::launched()
    {
        return Ok(None);
    }
    args.drain(at..at + 2);
    let ranks = match args.iter().position(|a| a == "--ranks") {
        Some(at) => {
            let value = args.get(at + 1).cloned().unwrap_or_default();
            args.drain(at..(at + 2).min(args.len()));
            value.parse().map_err(|_| Error::InvalidArgument {
                op: "--ranks",
                rank: 0,
                reason: format!("{value:?}: not a whole number"),
            })?
        }
        None => default_ranks,
    };
    let gpus = dist_tensor::device::cuda::device_count()?;
    if gpus == 0 {
        return Err(Error::DeviceUnavailable {
            op: "--device cuda",
            device: "cuda".into(),
            reason: "no GPU on this machine".into(),
        });
    }
    let devices: Vec<usize> = (0..ranks).map(|r| r % gpus).collect();
    World::cuda(&devices).map(Some)
}

/// Where an example's ranks live, from its arguments: a GPU world for `--device cuda` (see
/// [`cuda_world_from_args`]), else `--ranks N` threads (default `default_ranks`) or what
/// `World::from_args` makes of `--processes N` and a launcher. `None`: this process spawned the
/// ranks and they have finished (nothing left to do here).
pub fn world_from_args(
    args: &mut Vec<String>,
    default_ranks: usize,
) -> Result<Option<World>, Error> {
    if let Some(world) = cuda_world_from_args(args, default_ranks)? {
        return Ok(Some(world));
    }
    let mut threads = default_ranks;
    if let Some(at) = args.iter().position(|a| a == "--ranks") {
        let value = args.get(at + 1).cloned().unwrap_or_default();
        threads = value.parse().unwrap_or_else(|_| {
            eprintln!("--ranks {value:?}: not a number");
            std::process::exit(2);
        });
        args.drain(at..(at + 2).min(args.len()));
    }
    World::from_args(args, threads)
}
