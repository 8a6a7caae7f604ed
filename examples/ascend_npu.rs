//! On Ascend NPUs: the fused ops and the collectives run as the crate's Ascend C tile kernels,
//! each result checked against the same op in f64 on the host, for every NPU element type; then
//! the unfused baselines (HCCL + aclnnMatmul) and, where their limits allow, the vendor's MC2
//! operators, checked the same way. Every row says which path ran.
//!
//! Needs a machine with Atlas A2/A3 NPUs, CANN 8.3 or later (`source set_env.sh` of the toolkit,
//! so that `$ASCEND_HOME_PATH` is set) and, for the tile kernels, Ascend SHMEM (its `set_env.sh`,
//! so that `$SHMEM_HOME_PATH` is set). Without CANN it says so and exits 0; a result out of
//! tolerance exits 1.
//!
//! Run: `cargo run --release --example ascend_npu -- [--devices 0,1] [--rows 1000] [--k 512]
//! [--n 768]`
//!
//! THIS EXAMPLE HAS NOT RUN ON AN NPU: it was written where no NPU or CANN was available (see
//! `dist_tensor::device::ascend` for what has been verified where).

use dist_tensor::device::ascend::{PathTaken, last_path, vendor};
use dist_tensor::{
    DistTensor, Element, Error, Placement, Rank, Result, Tensor, World, collectives,
};
use half::{bf16, f16};

struct Args {
    devices: Vec<u32>,
    rows: usize,
    k: usize,
    n: usize,
}

fn parse_args() -> std::result::Result<Args, String> {
    let mut args = Args { devices: vec![0, 1], rows: 1000, k: 512, n: 768 };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let number = || value.parse::<usize>().map_err(|_| format!("{flag} {value}: not a number"));
        match flag.as_str() {
            "--devices" => {
                args.devices = value
                    .split(',')
                    .map(|d| {
                        d.trim()
                            .parse()
                            .map_err(|_| format!("--devices {value}: not a list of ids"))
                    })
                    .collect::<std::result::Result<_, _>>()?
            }
            "--rows" => args.rows = number()?,
            "--k" => args.k = number()?,
            "--n" => args.n = number()?,
            other => return Err(format!("unknown flag {other}; flags: --devices --rows --k --n")),
        }
    }
    Ok(args)
}

/// The largest error relative to the largest magnitude of the reference.
fn rel_err<T: Element>(got: &[T], want: &[f64]) -> f64 {
    let scale = want.iter().fold(0.0f64, |m, v| m.max(v.abs())).max(f64::MIN_POSITIVE);
    got.iter().zip(want).fold(0.0f64, |m, (g, w)| m.max((g.to_f64() - w).abs())) / scale
}

/// The tolerance of an element type: a few of its epsilons, times the products' depth.
fn tolerance<T: Element>(depth: usize) -> f64 {
    4.0 * T::EPSILON * (depth as f64).sqrt().max(1.0)
}

struct Row {
    op: &'static str,
    dtype: String,
    path: String,
    err: f64,
    tol: f64,
}

/// Every op on `world` for element type `T`, each checked against its f64 reference.
fn check<T: Element>(world: &World, a: &Args, rows: &mut Vec<Row>) -> Result<()> {
    let n_ranks = world.num_ranks();
    let x = Tensor::<T>::random(&[a.rows, a.k], 1);
    let w1 = Tensor::<T>::random(&[a.k, a.n], 2);
    let w2 = Tensor::<T>::random(&[a.n, a.k], 3);
    let (x64, w1_64, w2_64) = (x.cast::<f64>(), w1.cast::<f64>(), w2.cast::<f64>());
    let h_want = x64.matmul(&w1_64)?;
    let y_want = h_want.cast::<T>().cast::<f64>().matmul(&w2_64)?;
    let seq = Tensor::<T>::random(&[2, 4 * n_ranks + 1, 3 * n_ranks + 1, 16], 4);

    let outcome = world.run(|rank| {
        let path = |rank: &Rank<'_>| {
            last_path(rank).map_or("host".to_string(), |p: PathTaken| p.to_string())
        };
        let mut found = Vec::new();
        let xs = DistTensor::from_global(rank, &x, Placement::Shard(0))?;
        let w1s = DistTensor::from_global(rank, &w1, Placement::Shard(1))?;
        let w2s = DistTensor::from_global(rank, &w2, Placement::Shard(0))?;
        let h = xs.all_gather_matmul(w1s.local())?;
        found.push(("all_gather_matmul", path(rank), h.to_global()?));
        let y = h.matmul_reduce_scatter(w2s.local())?;
        found.push(("matmul_reduce_scatter", path(rank), y.to_global()?));
        let q = DistTensor::from_global(rank, &seq, Placement::Shard(1))?;
        let heads = q.all_to_all(2, 1)?;
        found.push(("all_to_all (Ulysses)", path(rank), heads.to_global()?));
        let summed = collectives::all_reduce(rank, x.as_slice())?;
        found.push(("all_reduce", path(rank), Tensor::from_shape_vec(&[a.rows, a.k], summed)?));
        Ok(found)
    })?;
    let mut sum_want = x64.clone();
    for v in sum_want.as_mut_slice() {
        *v *= n_ranks as f64;
    }
    let wants = [h_want.clone(), y_want.clone(), seq.cast::<f64>(), sum_want];
    let depths = [a.k, a.k + a.n, 1, n_ranks];
    for (i, want) in wants.iter().enumerate() {
        let (op, path, got) = &outcome[0][i];
        let err = rel_err(got.as_slice(), want.as_slice());
        rows.push(Row {
            op,
            dtype: T::DTYPE.to_string(),
            path: path.clone(),
            err,
            tol: tolerance::<T>(depths[i]),
        });
    }
    Ok(())
}

/// The unfused baselines and the vendor operators (f16 here), each checked like the kernels.
fn check_baselines(world: &World, a: &Args, rows: &mut Vec<Row>) -> Result<()> {
    let n_ranks = world.num_ranks();
    let m_r = a.rows.div_ceil(n_ranks);
    let x = Tensor::<f16>::random(&[m_r * n_ranks, a.k], 5);
    let w = Tensor::<f16>::random(&[a.k, a.n], 6);
    let want = x.cast::<f64>().matmul(&w.cast::<f64>())?;
    let results = world.run(|rank| {
        let mine = Tensor::from_shape_vec(
            &[m_r, a.k],
            x.as_slice()[rank.rank() * m_r * a.k..(rank.rank() + 1) * m_r * a.k].to_vec(),
        )?;
        let mut found = Vec::new();
        let unfused = dist_tensor::fused::all_gather_matmul_unfused(
            rank,
            mine.view2("x")?,
            &[w.view2("w")?],
        )?;
        found.push(("all_gather_matmul (unfused)", last_path(rank), unfused.outputs[0].clone()));
        match vendor::all_gather_matmul(rank, mine.view2("x")?, w.view2("w")?) {
            Ok(out) => found.push(("all_gather_matmul (vendor MC2)", last_path(rank), out)),
            Err(e) => eprintln!("rank {}: vendor all_gather_matmul not run: {e}", rank.rank()),
        }
        Ok(found)
    })?;
    for (op, path, got) in &results[0] {
        let err = rel_err(got.as_slice().expect("standard layout"), want.as_slice());
        let path = path.map_or("host".to_string(), |p| p.to_string());
        rows.push(Row { op, dtype: "f16".into(), path, err, tol: tolerance::<f16>(a.k) });
    }
    Ok(())
}

fn main() -> std::process::ExitCode {
    let args = match parse_args() {
        Ok(args) => args,
        Err(e) => {
            eprintln!("{e}");
            return std::process::ExitCode::from(2);
        }
    };
    let world = match World::ascend(&args.devices) {
        Ok(world) => world,
        Err(e @ Error::LibraryNotFound { .. }) => {
            println!("no CANN on this machine, nothing to run on: {e}");
            return std::process::ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("World::ascend({:?}): {e}", args.devices);
            return std::process::ExitCode::FAILURE;
        }
    };
    let mut rows = Vec::new();
    let run = check::<f32>(&world, &args, &mut rows)
        .and_then(|()| check::<f16>(&world, &args, &mut rows))
        .and_then(|()| check::<bf16>(&world, &args, &mut rows))
        .and_then(|()| check_baselines(&world, &args, &mut rows));
    println!("{:<32} {:<6} {:<52} {:>10} {:>10}", "op", "type", "path", "rel. err", "tolerance");
    let mut ok = true;
    for row in &rows {
        let pass = row.err <= row.tol;
        ok &= pass;
        println!(
            "{:<32} {:<6} {:<52} {:>10.2e} {:>10.2e}{}",
            row.op,
            row.dtype,
            row.path,
            row.err,
            row.tol,
            if pass { "" } else { "  FAILED" }
        );
    }
    if let Err(e) = run {
        eprintln!("{e}");
        return std::process::ExitCode::FAILURE;
    }
    if ok { std::process::ExitCode::SUCCESS } else { std::process::ExitCode::FAILURE }
}
