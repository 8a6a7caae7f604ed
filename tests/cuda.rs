//! What only a CUDA world has, against an f64 host reference in every dtype: tensors moving to
//! and from GPUs, the local product on a GPU, the fused ops' GPU paths (forced through the call's
//! options, and chosen by size at their thresholds: bitwise reproducible), the 16-byte accesses
//! of all_to_all, `cuda::broadcast`; and faults (a rank that errors or panics, a wait that times
//! out) ending every rank's kernels with an error. The ops themselves, at every level, run in
//! `tests/op_suite.rs`, whose CUDA world kind is the same suite every other world runs.
//!
//! On a machine without GPUs (or a build without `--features cuda`) every test prints that it
//! was skipped and why, and passes: `cargo test --features cuda --test cuda -- --nocapture`
//! shows the reasons.

use std::time::{Duration, Instant};

use dist_tensor::device::cuda;
use dist_tensor::fused::{AgPath, RsPath};
use dist_tensor::{
    Device, DistTensor, Element, Error, MatmulOptions, Placement, Rank, Tensor, World,
};
use half::{bf16, f16};

mod common;

/// A world of `n` GPUs, or `None` after printing why there is none.
fn gpus(test: &str, n: usize) -> Option<World> {
    gpus_with(test, n, Duration::from_secs(30))
}

fn gpus_with(test: &str, n: usize, timeout: Duration) -> Option<World> {
    let devices: Vec<usize> = (0..n).collect();
    match World::builder(n).cuda(&devices).wait_timeout(timeout).build() {
        Ok(w) => Some(w),
        Err(e @ (Error::LibraryNotFound { .. } | Error::DeviceUnavailable { .. })) => {
            println!("SKIPPED {test} (world of {n} GPU(s)): {e}");
            None
        }
        Err(e) => panic!("{test}: World::cuda failed unexpectedly: {e}"),
    }
}

/// ‖got − want‖ / ‖want‖ (0 when both are empty); NaN never passes.
fn rel_err<T: Element>(got: &Tensor<T>, want: &Tensor<f64>) -> f64 {
    assert_eq!(got.shape(), want.shape(), "shapes differ");
    let got = got.to_host().expect("to_host");
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (g, w) in got.as_slice().iter().zip(want.as_slice()) {
        let d = g.to_f64() - w;
        num += d * d;
        den += w * w;
    }
    if den == 0.0 { num.sqrt() } else { (num / den).sqrt() }
}

fn tol<T: Element>() -> f64 {
    match T::DTYPE {
        dist_tensor::DType::F64 => 1e-12,
        dist_tensor::DType::F32 => 1e-5,
        dist_tensor::DType::F16 => 4e-3,
        dist_tensor::DType::BF16 => 2e-2,
    }
}

fn f64_of<T: Element>(t: &Tensor<T>) -> Tensor<f64> {
    t.cast::<f64>()
}

fn check<T: Element>(what: &str, got: &Tensor<T>, want: &Tensor<f64>) {
    let err = rel_err(got, want);
    assert!(err <= tol::<T>(), "{what} ({}): relative error {err:e} > {:e}", T::DTYPE, tol::<T>());
}

#[test]
fn without_gpus_or_cuda_the_world_is_a_typed_error() {
    // Never a panic: either GPUs, or an error naming what is missing.
    match World::cuda(&[0]) {
        Ok(world) => {
            let devices = world.run(|rank| Ok(rank.device())).unwrap();
            assert_eq!(devices, vec![Device::Cuda(0)]);
            let n = cuda::device_count().unwrap();
            let err = World::cuda(&[n + 3]).expect_err("no such device");
            assert!(matches!(err, Error::DeviceUnavailable { .. }), "{err}");
            assert!(err.to_string().contains("CUDA device"), "{err}");
        }
        Err(e) => {
            println!("SKIPPED GPU checks: {e}");
            assert!(
                matches!(e, Error::LibraryNotFound { .. } | Error::DeviceUnavailable { .. }),
                "{e}"
            );
        }
    }
    assert!(World::builder(2).cuda(&[0]).build().is_err(), "two ranks on one GPU list");
}

fn round_trip<T: Element>() {
    let Some(world) = gpus("round_trip", 1) else { return };
    for shape in [vec![0], vec![1], vec![3, 5], vec![2, 7, 3]] {
        let t = Tensor::<T>::random(&shape, 7);
        let back = world.run(|rank| t.to_rank(rank)?.to_host()).unwrap();
        assert_eq!(back[0], t, "{shape:?} {}", T::DTYPE);
        let moved = t.to_device(Device::Cuda(0)).unwrap();
        assert_eq!(moved.device(), Device::Cuda(0));
        assert_eq!(moved.shape(), &shape[..]);
        assert_eq!(moved.to_host().unwrap(), t);
    }
}

#[test]
fn tensors_move_to_and_from_the_gpu_in_every_dtype() {
    common::in_every_dtype!(round_trip());
}

#[test]
fn local_matmul_on_the_gpu_matches_f64() {
    let Some(_world) = gpus("local_matmul", 1) else { return };
    for (m, k, n) in [(1, 1, 1), (3, 5, 7), (64, 33, 17), (4, 0, 3)] {
        let a = Tensor::<bf16>::random(&[m, k], 1);
        let b = Tensor::<bf16>::random(&[k, n], 2);
        let want = f64_of(&a).matmul(&f64_of(&b)).unwrap();
        let got = a
            .to_device(Device::Cuda(0))
            .unwrap()
            .matmul(&b.to_device(Device::Cuda(0)).unwrap())
            .unwrap();
        assert_eq!(got.device(), Device::Cuda(0));
        check("Tensor::matmul on cuda:0", &got, &want);
    }
}

fn all_gather_matmul_case<T: Element>(
    world: &World,
    rows: &[usize],
    k: usize,
    widths: &[usize],
    fused: bool,
) {
    all_gather_matmul_case_with::<T>(world, rows, k, widths, fused, None)
}

/// The fused op on `path`, asked for through the call's options.
fn all_gather_matmul_case_on<T: Element>(
    world: &World,
    rows: &[usize],
    k: usize,
    widths: &[usize],
    path: Option<AgPath>,
) {
    all_gather_matmul_case_with::<T>(world, rows, k, widths, true, path)
}

fn all_gather_matmul_case_with<T: Element>(
    world: &World,
    rows: &[usize],
    k: usize,
    widths: &[usize],
    fused: bool,
    path: Option<AgPath>,
) {
    let m: usize = rows.iter().sum();
    let x = Tensor::<T>::random(&[m, k], 11);
    let ws: Vec<Tensor<T>> =
        widths.iter().enumerate().map(|(i, &nj)| Tensor::random(&[k, nj], 20 + i as u64)).collect();
    let outs = world
        .run(|rank| {
            let r = rank.rank();
            let start: usize = rows[..r].iter().sum();
            let local = Tensor::from_array(
                x.view().slice_axis(ndarray::Axis(0), (start..start + rows[r]).into()).to_owned(),
            );
            let xd = DistTensor::from_local(rank, local, Placement::Shard(0))?;
            assert_eq!(xd.local().device(), rank.device());
            // Each rank its column shard of every weight.
            let shards: Vec<DistTensor<'_, T>> = ws
                .iter()
                .map(|w| DistTensor::from_global(rank, w, Placement::Shard(1)))
                .collect::<Result<_, _>>()?;
            let locals: Vec<&Tensor<T>> = shards.iter().map(|s| s.local()).collect();
            let hs = if let Some(path) = path {
                xd.all_gather_matmul_with(
                    &locals,
                    &MatmulOptions::new().all_gather_matmul_path(path),
                )?
            } else if fused {
                xd.all_gather_matmul_many(&locals)?
            } else {
                locals
                    .iter()
                    .map(|w| xd.all_gather_matmul_unfused(w))
                    .collect::<Result<Vec<_>, Error>>()?
            };
            hs.iter().map(|h| h.to_global()?.to_host()).collect::<Result<Vec<_>, _>>()
        })
        .unwrap();
    let xf = f64_of(&x);
    for (rank_outs, _) in outs.iter().zip(0..) {
        for (got, w) in rank_outs.iter().zip(&ws) {
            let want = xf.matmul(&f64_of(w)).unwrap();
            check(&format!("all_gather_matmul rows {rows:?} k {k} fused {fused}"), got, &want);
        }
    }
}

/// The overlap path (at least 1024 rows on a rank), chosen by size.
fn all_gather_matmul_overlap<T: Element>(n: usize) {
    let Some(world) = gpus("all_gather_matmul", n) else { return };
    let big: Vec<usize> = (0..n).map(|r| 1024 + 3 * r + 1).collect();
    assert_eq!(
        cuda::all_gather_matmul_path(&big),
        if n == 1 { AgPath::Local } else { AgPath::Overlap }
    );
    all_gather_matmul_case::<T>(&world, &big, 40, &[24, 8], true);
    all_gather_matmul_case::<T>(&world, &big, 40, &[24], true); // a second call reuses the buffers
    all_gather_matmul_case::<T>(&world, &big, 17, &[5], false);
}

#[test]
fn all_gather_matmul_on_its_overlap_path_matches_f64_worlds_1_and_2() {
    for n in [1, 2] {
        all_gather_matmul_overlap::<f32>(n);
        all_gather_matmul_overlap::<bf16>(n);
        all_gather_matmul_overlap::<f16>(n);
        all_gather_matmul_overlap::<f64>(n);
    }
}

fn matmul_reduce_scatter_case<T: Element>(
    world: &World,
    m: usize,
    ks: &[usize],
    big_n: usize,
    fused: bool,
) -> Vec<Tensor<T>> {
    matmul_reduce_scatter_case_with::<T>(world, m, ks, big_n, fused, None)
}

/// The fused op on `path`, asked for through the call's options.
fn matmul_reduce_scatter_case_on<T: Element>(
    world: &World,
    m: usize,
    ks: &[usize],
    big_n: usize,
    path: Option<RsPath>,
) -> Vec<Tensor<T>> {
    matmul_reduce_scatter_case_with::<T>(world, m, ks, big_n, true, path)
}

fn matmul_reduce_scatter_case_with<T: Element>(
    world: &World,
    m: usize,
    ks: &[usize],
    big_n: usize,
    fused: bool,
    path: Option<RsPath>,
) -> Vec<Tensor<T>> {
    let k: usize = ks.iter().sum();
    let h = Tensor::<T>::random(&[m, k], 31);
    let w = Tensor::<T>::random(&[k, big_n], 32);
    let outs = world
        .run(|rank| {
            let r = rank.rank();
            let start: usize = ks[..r].iter().sum();
            let hl = Tensor::from_array(
                h.view().slice_axis(ndarray::Axis(1), (start..start + ks[r]).into()).to_owned(),
            );
            let wl = Tensor::from_array(
                w.view().slice_axis(ndarray::Axis(0), (start..start + ks[r]).into()).to_owned(),
            );
            let hd = DistTensor::from_local(rank, hl, Placement::Shard(1))?;
            let wl = wl.to_rank(rank)?;
            let y = if let Some(path) = path {
                hd.matmul_reduce_scatter_with(
                    &wl,
                    &MatmulOptions::new().matmul_reduce_scatter_path(path),
                )?
            } else if fused {
                hd.matmul_reduce_scatter(&wl)?
            } else {
                hd.matmul_reduce_scatter_unfused(&wl)?
            };
            assert_eq!(y.placement(), Placement::Shard(0));
            y.to_global()?.to_host()
        })
        .unwrap();
    let want = f64_of(&h).matmul(&f64_of(&w)).unwrap();
    for got in &outs {
        check(
            &format!("matmul_reduce_scatter m {m} ks {ks:?} n {big_n} fused {fused}"),
            got,
            &want,
        );
    }
    outs
}

/// The chunked path (at least 1024 rows per rank), chosen by size, twice: the same bits
/// (rank-order sums).
fn matmul_reduce_scatter_chunked<T: Element>(n: usize) {
    let Some(world) = gpus("matmul_reduce_scatter", n) else { return };
    let m = 1024 * n + 3;
    let ks: Vec<usize> = (0..n).map(|r| 16 + 5 * r).collect();
    let first = matmul_reduce_scatter_case::<T>(&world, m, &ks, 40, true);
    let second = matmul_reduce_scatter_case::<T>(&world, m, &ks, 40, true);
    assert_eq!(first, second, "matmul_reduce_scatter is not bitwise reproducible");
    matmul_reduce_scatter_case::<T>(&world, m, &ks, 13, false);
}

#[test]
fn matmul_reduce_scatter_on_its_chunked_path_matches_f64_worlds_1_and_2() {
    for n in [1, 2] {
        matmul_reduce_scatter_chunked::<f32>(n);
        matmul_reduce_scatter_chunked::<bf16>(n);
        matmul_reduce_scatter_chunked::<f16>(n);
        matmul_reduce_scatter_chunked::<f64>(n);
    }
}

#[test]
fn every_path_of_the_fused_ops_matches_f64_on_two_gpus() {
    let Some(world) = gpus("forced paths", 2) else { return };
    // Few rows, uneven, empty, and the overlap path's sizes (at least 1024 rows on a rank).
    let ag_rows: [&[usize]; 4] = [&[3, 4], &[0, 5], &[1029, 1024], &[7, 1030]];
    for path in [AgPath::Gather, AgPath::Overlap] {
        // Twice: the second call reuses the buffers (the gather path's other half).
        for _ in 0..2 {
            for rows in ag_rows {
                all_gather_matmul_case_on::<bf16>(&world, rows, 40, &[24, 8], Some(path));
                all_gather_matmul_case_on::<f32>(&world, rows, 17, &[5], Some(path));
            }
        }
    }
    // matmul_reduce_scatter: each path twice (the same bits).
    for (m, ks) in [(7, [4, 7]), (1, [0, 6]), (2 * 1024 + 3, [16, 21])] {
        for path in [RsPath::Single, RsPath::Chunked] {
            let first = matmul_reduce_scatter_case_on::<bf16>(&world, m, &ks, 40, Some(path));
            let second = matmul_reduce_scatter_case_on::<bf16>(&world, m, &ks, 40, Some(path));
            assert_eq!(first, second, "{path}: not bitwise reproducible (m {m})");
            matmul_reduce_scatter_case_on::<f32>(&world, m, &ks, 13, Some(path));
        }
    }
}

fn all_to_all_case<T: Element>(world: &World, shape: &[usize], scatter: usize, gather: usize) {
    let x = Tensor::<T>::random(shape, 41);
    let outs = world
        .run(|rank| {
            let seq = DistTensor::from_global(rank, &x, Placement::Shard(gather))?;
            let heads = seq.all_to_all(scatter, gather)?;
            assert_eq!(heads.placement(), Placement::Shard(scatter));
            let unfused = seq.all_to_all_unfused(scatter, gather)?;
            let back = heads.all_to_all(gather, scatter)?;
            let want_local =
                DistTensor::from_global(rank, &x, Placement::Shard(scatter))?.local().to_host()?;
            Ok((
                heads.local().to_host()?,
                unfused.local().to_host()?,
                want_local,
                back.local().to_host()?,
                seq.local().to_host()?,
            ))
        })
        .unwrap();
    for (heads, unfused, want, back, seq) in outs {
        assert_eq!(heads, want, "all_to_all({scatter}, {gather}) of {shape:?} {}", T::DTYPE);
        assert_eq!(unfused, want, "all_to_all_unfused({scatter}, {gather}) of {shape:?}");
        assert_eq!(back, seq, "all_to_all back of {shape:?}");
    }
}

#[test]
fn all_to_all_with_16_byte_accesses_matches_the_host_worlds_1_and_2() {
    for n in [1, 2] {
        let Some(world) = gpus("all_to_all", n) else { return };
        all_to_all_case::<f32>(&world, &[2, 64, 8, 128], 2, 1);
        all_to_all_case::<bf16>(&world, &[2, 64, 8, 128], 2, 1);
        all_to_all_case::<f16>(&world, &[2, 64, 8, 128], 1, 2);
        all_to_all_case::<f64>(&world, &[2, 64, 8, 128], 2, 1);
    }
}

fn cuda_broadcast<T: Element>(n: usize) {
    let Some(world) = gpus("cuda::broadcast", n) else { return };
    for shape in [vec![5], vec![2, 7, 3], vec![1, 1]] {
        let x = Tensor::<T>::random(&shape, 51);
        let root = n - 1;
        let got = world
            .run(|rank| {
                let mine = if rank.rank() == root { x.clone() } else { Tensor::zeros(&shape) };
                cuda::broadcast(rank, &mine, root)?.to_host()
            })
            .unwrap();
        for got in &got {
            check(&format!("cuda::broadcast of {shape:?}"), got, &f64_of(&x));
        }
    }
}

#[test]
fn cuda_broadcast_gives_every_rank_the_roots_tensor_worlds_1_and_2() {
    for n in [1, 2] {
        cuda_broadcast::<f32>(n);
        cuda_broadcast::<bf16>(n);
        cuda_broadcast::<f16>(n);
        cuda_broadcast::<f64>(n);
    }
}

#[test]
fn a_rank_that_errors_ends_the_other_ranks_kernels() {
    let Some(world) = gpus("fault: error", 2) else { return };
    let x = Tensor::<f32>::random(&[1, 64, 8, 128], 3);
    let start = Instant::now();
    let err = world
        .run(|rank| {
            let seq = DistTensor::from_global(rank, &x, Placement::Shard(1))?;
            if rank.rank() == 1 {
                return Err(Error::InvalidArgument {
                    op: "test",
                    rank: 1,
                    reason: "planted".into(),
                });
            }
            // Rank 0 never meets rank 1 here: it must fail, not hang.
            seq.all_to_all(2, 1)?.local().to_host()
        })
        .unwrap_err();
    assert!(matches!(err, Error::RankFailed { rank: 1, .. }), "{err}");
    assert!(start.elapsed() < Duration::from_secs(20), "took {:?}", start.elapsed());
    // The world stays failed.
    assert!(world.run(|_| Ok(())).is_err());
}

#[test]
fn a_rank_that_panics_ends_the_other_ranks_kernels() {
    let Some(world) = gpus("fault: panic", 2) else { return };
    let w = Tensor::<bf16>::random(&[32, 16], 3);
    let start = Instant::now();
    let err = world
        .run(|rank| {
            let x = DistTensor::from_local(
                rank,
                Tensor::<bf16>::random(&[8, 32], 4),
                Placement::Shard(0),
            )?;
            if rank.rank() == 0 {
                panic!("planted panic");
            }
            x.all_gather_matmul(&w.to_rank(rank)?)?.local().to_host()
        })
        .unwrap_err();
    assert!(matches!(err, Error::RankFailed { rank: 0, .. }), "{err}");
    assert!(err.to_string().contains("planted panic"), "{err}");
    assert!(start.elapsed() < Duration::from_secs(20), "took {:?}", start.elapsed());
}

/// Queues `products` f32 products of 4096 x 4096 matrices on `rank`'s GPU (a few ms each).
fn busy(rank: &Rank<'_>, products: usize) -> dist_tensor::Result<()> {
    let a = cuda::random::<f32>(rank, &[4096, 4096], 1)?;
    let mut c = a.clone();
    for _ in 0..products {
        c = c.matmul(&a)?;
    }
    Ok(())
}

#[test]
fn a_device_wait_that_times_out_names_rank_program_signal_and_values() {
    let Some(world) = gpus_with("fault: timeout", 2, Duration::from_millis(100)) else { return };
    let x = Tensor::<f32>::random(&[1, 16, 4, 32], 3);
    let seen = std::sync::Mutex::new(vec![String::new(); 2]);
    let result = world.run(|rank| {
        let seq = DistTensor::from_global(rank, &x, Placement::Shard(1))?;
        // Compile the kernels and make the plans first, so that both ranks reach the op at once.
        busy(rank, 1)?;
        let _ = seq.all_to_all(2, 1)?;
        cuda::synchronize(rank)?;
        cuda::barrier(rank)?;
        if rank.rank() == 1 {
            // Rank 1's kernel starts long (hundreds of ms) after rank 0's wait gives up.
            busy(rank, 150)?;
        }
        let out = seq.all_to_all(2, 1).and_then(|t| t.local().to_host());
        if let Err(e) = &out {
            seen.lock().unwrap()[rank.rank()] = e.to_string();
        }
        out
    });
    assert!(result.is_err(), "the world must fail");
    let seen = seen.into_inner().unwrap();
    let text = &seen[0];
    assert!(text.contains("rank 0, program"), "{text}");
    assert!(text.contains("wait on signal 1 timed out"), "{text}");
    assert!(text.contains("awaited >= 2") && text.contains("saw 1"), "{text}");
    assert!(seen[1].contains("rank 0 failed first"), "rank 1 said: {}", seen[1]);
}
