//! The host schedules of the fused products, each forced through the call's options
//! (`MatmulOptions::all_gather_matmul_path`, `matmul_reduce_scatter_path`) and the one the machine
//! picks, against f64 references (`common::reference::product`) within the bound of
//! `tests/fused_ops.rs`: worlds 1 to 8, every element type, shapes with fewer rows than ranks,
//! primes, and shards long enough for the per-shard tiles. Each case checks that the rank reports
//! the path that ran (`fused::last_schedule`), the same on every rank, with a reason. (The bound
//! catches one missing term: `tests/fused_ops.rs` checks that for these shapes' kind.)

use dist_tensor::fused::{AgPath, PathTaken, RsPath, last_schedule};
use dist_tensor::{DistTensor, Element, Error, MatmulOptions, Placement, Tensor, World};
use half::{bf16, f16};
use ndarray::Array2;

mod common;

use common::reference::product;
use common::{assert_none, checks, f64s2, tolerance};

const WORLDS: [usize; 5] = [1, 2, 3, 5, 8];

/// (M, K, N): fewer rows than ranks, primes, and shards of 256 rows or more at worlds 2 and 3.
const SHAPES: [(usize, usize, usize); 3] = [(3, 7, 5), (61, 13, 29), (787, 19, 11)];

/// The product `y` entry by entry within `tol` times the scale of its f64 reference
/// `(want, scale)`.
fn check<T: Element>(
    what: &str,
    y: &Tensor<T>,
    (want, scale): &(Array2<f64>, Array2<f64>),
    tol: f64,
) -> Option<String> {
    let flat = |a: &Array2<f64>| a.iter().copied().collect::<Vec<_>>();
    checks::off(what, &flat(&f64s2(y)), &flat(want), &flat(scale), tol)
}

fn all_gather_matmul_case<T: Element>(
    n: usize,
    (m, k, nc): (usize, usize, usize),
    path: Option<AgPath>,
) -> Option<String> {
    let x = Tensor::<T>::random(&[m, k], 3);
    let w = Tensor::<T>::random(&[k, nc], 4);
    let want = product(f64s2(&x).view(), f64s2(&w).view());
    let what = format!("all_gather_matmul {} world {n} {m}x{k}x{nc} path {path:?}", T::DTYPE);
    let outs = World::threads(n).unwrap().run(|rank| {
        let xd = DistTensor::from_global(rank, &x, Placement::Shard(0))?;
        let wd = DistTensor::from_global(rank, &w, Placement::Shard(1))?;
        let opts = match path {
            Some(p) => MatmulOptions::new().all_gather_matmul_path(p),
            None => MatmulOptions::new(),
        };
        let y = xd.all_gather_matmul_with(&[wd.local()], &opts)?.remove(0);
        let taken = last_schedule(rank)?.expect("a fused product records its schedule");
        Ok((y.to_global()?, taken))
    });
    let outs = match outs {
        Ok(outs) => outs,
        Err(e) => return Some(format!("{what}: {e}")),
    };
    let mut fails = Vec::new();
    for (r, (y, taken)) in outs.iter().enumerate() {
        let PathTaken::AllGatherMatmul(ran) = taken.path else {
            fails.push(format!("{what}: rank {r} reports {taken}"));
            continue;
        };
        match path {
            Some(p) if p != ran => fails.push(format!("{what}: rank {r} ran {ran}")),
            None if n == 1 && ran != AgPath::Local => {
                fails.push(format!("{what}: one rank ran {ran}"))
            }
            None if n > 1 && ran == AgPath::Local => {
                fails.push(format!("{what}: rank {r} ran local"))
            }
            _ => {}
        }
        if taken.path != outs[0].1.path {
            fails.push(format!("{what}: ranks took different paths"));
        }
        if taken.why.is_empty() {
            fails.push(format!("{what}: no reason given"));
        }
        fails.extend(check(&format!("{what} rank {r}"), y, &want, tolerance::<T>(k)));
    }
    (!fails.is_empty()).then(|| fails.join("\n"))
}

fn matmul_reduce_scatter_case<T: Element>(
    n: usize,
    (m, k, nc): (usize, usize, usize),
    path: Option<RsPath>,
) -> Option<String> {
    let h = Tensor::<T>::random(&[m, k], 5);
    let w = Tensor::<T>::random(&[k, nc], 6);
    let want = product(f64s2(&h).view(), f64s2(&w).view());
    let what = format!("matmul_reduce_scatter {} world {n} {m}x{k}x{nc} path {path:?}", T::DTYPE);
    let outs = World::threads(n).unwrap().run(|rank| {
        let hd = DistTensor::from_global(rank, &h, Placement::Shard(1))?;
        let wd = DistTensor::from_global(rank, &w, Placement::Shard(0))?;
        let opts = match path {
            Some(p) => MatmulOptions::new().matmul_reduce_scatter_path(p),
            None => MatmulOptions::new(),
        };
        let y = hd.matmul_reduce_scatter_with(wd.local(), &opts)?;
        let taken = last_schedule(rank)?.expect("a fused product records its schedule");
        Ok((y.to_global()?, taken))
    });
    let outs = match outs {
        Ok(outs) => outs,
        Err(e) => return Some(format!("{what}: {e}")),
    };
    let mut fails = Vec::new();
    // Each rank's partial is a k_r-term sum, then n partials are added.
    let tol = tolerance::<T>(k + n);
    for (r, (y, taken)) in outs.iter().enumerate() {
        match (&taken.path, path) {
            (PathTaken::MatmulReduceScatter(ran), Some(p)) if *ran != p => {
                fails.push(format!("{what}: rank {r} ran {ran}"))
            }
            (PathTaken::MatmulReduceScatter(RsPath::Local), None) if n > 1 => {
                fails.push(format!("{what}: rank {r} ran local"))
            }
            (PathTaken::MatmulReduceScatter(_), _) => {}
            (other, _) => fails.push(format!("{what}: rank {r} reports {other:?}")),
        }
        fails.extend(check(&format!("{what} rank {r}"), y, &want, tol));
    }
    (!fails.is_empty()).then(|| fails.join("\n"))
}

fn ag_paths(n: usize) -> Vec<Option<AgPath>> {
    let forced = if n == 1 {
        vec![AgPath::Local, AgPath::Gather, AgPath::Overlap]
    } else {
        vec![AgPath::Gather, AgPath::Overlap]
    };
    std::iter::once(None).chain(forced.into_iter().map(Some)).collect()
}

fn rs_paths(n: usize) -> Vec<Option<RsPath>> {
    let forced = if n == 1 {
        vec![RsPath::Local, RsPath::Single, RsPath::Chunked]
    } else {
        vec![RsPath::Single, RsPath::Chunked]
    };
    std::iter::once(None).chain(forced.into_iter().map(Some)).collect()
}

fn every_schedule<T: Element>() {
    let mut fails = Vec::new();
    for n in WORLDS {
        for shape in SHAPES {
            for path in ag_paths(n) {
                fails.extend(all_gather_matmul_case::<T>(n, shape, path));
            }
            for path in rs_paths(n) {
                fails.extend(matmul_reduce_scatter_case::<T>(n, shape, path));
            }
        }
    }
    assert_none(fails);
}

#[test]
fn every_schedule_f32() {
    every_schedule::<f32>();
}

#[test]
fn every_schedule_f64() {
    every_schedule::<f64>();
}

#[test]
fn every_schedule_bf16() {
    every_schedule::<bf16>();
}

#[test]
fn every_schedule_f16() {
    every_schedule::<f16>();
}

/// `Local` runs one rank only: asked for in a world of several, every rank fails with a typed
/// error naming the path, instead of computing a part of the product; the world stays usable.
#[test]
fn local_on_several_ranks_is_an_error() {
    let x = Tensor::<f32>::random(&[6, 4], 1);
    let w = Tensor::<f32>::random(&[4, 6], 2);
    let errs = World::threads(2)
        .unwrap()
        .run(|rank| {
            let xd = DistTensor::from_global(rank, &x, Placement::Shard(0))?;
            let wd = DistTensor::from_global(rank, &w, Placement::Shard(1))?;
            let ag = MatmulOptions::new().all_gather_matmul_path(AgPath::Local);
            let a = xd.all_gather_matmul_with(&[wd.local()], &ag).map(drop).unwrap_err();
            let hd = DistTensor::from_global(rank, &x, Placement::Shard(1))?;
            let wr = DistTensor::from_global(rank, &w, Placement::Shard(0))?;
            let rs = MatmulOptions::new().matmul_reduce_scatter_path(RsPath::Local);
            let b = hd.matmul_reduce_scatter_with(wr.local(), &rs).map(drop).unwrap_err();
            // The world still runs the product.
            xd.all_gather_matmul_with(&[wd.local()], &MatmulOptions::new())?;
            Ok((a, b))
        })
        .unwrap();
    for (a, b) in errs {
        for e in [a, b] {
            assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
            assert!(e.to_string().contains("local path"), "{e}");
        }
    }
}

/// Both `all_gather_matmul` paths with a transposed weight (`transpose_weights`: `w` is `[N, K]`)
/// and the gathered input kept: the product against `x @ w^T` in f64, the kept input equal to `x`
/// bit for bit.
fn transposed_kept_case<T: Element>(
    n: usize,
    (m, k, nc): (usize, usize, usize),
    path: AgPath,
) -> Option<String> {
    let x = Tensor::<T>::random(&[m, k], 7);
    let w = Tensor::<T>::random(&[nc, k], 8); // [N, K]
    let want = product(f64s2(&x).view(), f64s2(&w).t());
    let what =
        format!("all_gather_matmul w^T, kept input, {} world {n} {m}x{k}x{nc} {path}", T::DTYPE);
    let outs = World::threads(n).unwrap().run(|rank| {
        let xd = DistTensor::from_global(rank, &x, Placement::Shard(0))?;
        let wd = DistTensor::from_global(rank, &w, Placement::Shard(0))?; // rows of w: columns of the product
        let opts = MatmulOptions::new().transpose_weights(true).all_gather_matmul_path(path);
        let (ys, input) = xd.all_gather_matmul_keep_input(&[wd.local()], &opts)?;
        let ran = last_schedule(rank)?.map(|s| s.path);
        Ok((ys[0].to_global()?, input.into_local(), ran))
    });
    let outs = match outs {
        Ok(outs) => outs,
        Err(e) => return Some(format!("{what}: {e}")),
    };
    let mut fails = Vec::new();
    for (r, (y, input, ran)) in outs.iter().enumerate() {
        if *ran != Some(PathTaken::AllGatherMatmul(path)) {
            fails.push(format!("{what}: rank {r} ran {ran:?}"));
        }
        if *input != x {
            fails.push(format!("{what}: rank {r}'s kept input differs from x"));
        }
        fails.extend(check(&format!("{what} rank {r}"), y, &want, tolerance::<T>(k)));
    }
    (!fails.is_empty()).then(|| fails.join("\n"))
}

/// `matmul_reduce_scatter` with a transposed weight (`transpose_weights`: each rank's `w` is
/// `[N, k_r]`) on every path against `h @ w^T` in f64. By default the host runs it as one GEMM
/// (`Single`) where the product has more rows than one tile (512), the chunked tiles where not.
fn transposed_reduce_scatter_case<T: Element>(
    n: usize,
    (m, k, nc): (usize, usize, usize),
    path: Option<RsPath>,
) -> Option<String> {
    let h = Tensor::<T>::random(&[m, k], 9);
    let w = Tensor::<T>::random(&[nc, k], 10); // [N, K]
    let want = product(f64s2(&h).view(), f64s2(&w).t());
    let what = format!("matmul_reduce_scatter w^T {} world {n} {m}x{k}x{nc} {path:?}", T::DTYPE);
    let outs = World::threads(n).unwrap().run(|rank| {
        let hd = DistTensor::from_global(rank, &h, Placement::Shard(1))?;
        let wd = DistTensor::from_global(rank, &w, Placement::Shard(1))?; // columns of w: its k_r
        let opts = MatmulOptions::new().transpose_weights(true);
        let opts = match path {
            Some(p) => opts.matmul_reduce_scatter_path(p),
            None => opts,
        };
        let y = hd.matmul_reduce_scatter_with(wd.local(), &opts)?;
        let ran = last_schedule(rank)?.map(|s| s.path);
        Ok((y.to_global()?, ran))
    });
    let outs = match outs {
        Ok(outs) => outs,
        Err(e) => return Some(format!("{what}: {e}")),
    };
    let expected = path.unwrap_or(if m > 512 { RsPath::Single } else { RsPath::Chunked });
    let mut fails = Vec::new();
    for (r, (y, ran)) in outs.iter().enumerate() {
        if *ran != Some(PathTaken::MatmulReduceScatter(expected)) {
            fails.push(format!("{what}: rank {r} ran {ran:?}, not {expected}"));
        }
        let tol = tolerance::<T>(k + n);
        fails.extend(check(&format!("{what} rank {r}"), y, &want, tol));
    }
    (!fails.is_empty()).then(|| fails.join("\n"))
}

/// Both products with transposed weights, on every path, at worlds 2 and 3, one tile of rows
/// or more.
#[test]
fn transposed_weights_on_every_path() {
    let mut fails = Vec::new();
    for n in [2, 3] {
        for shape in [(5, 9, 7), (787, 19, 11)] {
            for path in [AgPath::Gather, AgPath::Overlap] {
                fails.extend(transposed_kept_case::<f32>(n, shape, path));
                fails.extend(transposed_kept_case::<bf16>(n, shape, path));
            }
            for path in [None, Some(RsPath::Single), Some(RsPath::Chunked)] {
                fails.extend(transposed_reduce_scatter_case::<f32>(n, shape, path));
                fails.extend(transposed_reduce_scatter_case::<bf16>(n, shape, path));
            }
        }
    }
    assert_none(fails);
}
