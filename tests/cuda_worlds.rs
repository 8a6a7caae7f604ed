//! CUDA worlds whose ranks share one GPU (`World::cuda(&[0, 0, 0])`): the fused ops, their
//! unfused baselines, the collectives and the DistTensor layer run unchanged at worlds 1, 2 and 3
//! on one GPU, checked against f64 references built from every rank's inputs (tests/common),
//! with uneven row shards, both paths of each fused op (few rows and many), f32 and bf16.
//!
//! Without a GPU (or a build without `--features cuda`) each test prints that it was skipped and
//! why, and passes: `cargo test --release --features cuda --test cuda_worlds -- --nocapture`.

use dist_tensor::collectives;
use dist_tensor::device::cuda;
use dist_tensor::{Device, DistTensor, Placement, Rank, Tensor, fused};
use half::bf16;

mod common;

use common::checks::{Checks, summed, widen};
use common::{assert_none, seeded};

/// Every op of the battery on one rank; the failures its references found.
fn battery(rank: &Rank<'_>) -> dist_tensor::Result<Vec<String>> {
    let (me, n) = (rank.rank(), rank.num_ranks());
    assert_eq!(rank.device(), Device::Cuda(0));
    let mut check = Checks::default();
    let sum_tol = |eps: f64| (n as f64 + 1.0) * eps;
    // Collectives (through the public API; on the GPU in a CUDA world).
    let got = collectives::all_reduce(rank, &seeded::<f32>(me, 37, 2))?;
    check.close("all_reduce", &got, summed::<f32>(n, 37, 2, None), sum_tol(f32::EPSILON.into()));
    let got = collectives::all_gather(rank, &seeded::<bf16>(me, 9, 7))?;
    let want = (0..n).flat_map(|r| widen(&seeded::<bf16>(r, 9, 7))).collect();
    check.exact("all_gather bf16", &got, want);
    let got = collectives::broadcast(rank, &seeded::<f64>(me, 11, 5), n - 1)?;
    check.exact("broadcast", &got, seeded(n - 1, 11, 5));
    // Fused ops and their baselines: few rows (the gather / single paths) and many rows (the
    // overlapped / chunked paths, whose kernels wait on each other's signals).
    for base in [13, 1030] {
        let rows = move |r: usize| base + r;
        let x = Tensor::from_shape_vec(&[rows(me), 64], seeded::<f32>(me, rows(me) * 64, 9))?;
        let w = Tensor::from_shape_vec(&[64, 24], seeded::<f32>(me, 64 * 24, 10))?;
        let ag = fused::all_gather_matmul(rank, x.view2("x")?, &[w.view2("w")?])?;
        let got = ag.outputs[0].as_slice().expect("standard");
        check.gathered_product::<f32>(&format!("all_gather_matmul {base}"), got, (me, n), rows);
        let ag = fused::all_gather_matmul_unfused(rank, x.view2("x")?, &[w.view2("w")?])?;
        let got = ag.outputs[0].as_slice().expect("standard");
        check.gathered_product::<f32>(&format!("ag unfused {base}"), got, (me, n), rows);
        let (xb, wb) = (x.cast::<bf16>(), w.cast::<bf16>());
        let ag = fused::all_gather_matmul(rank, xb.view2("x")?, &[wb.view2("w")?])?;
        let got = ag.outputs[0].as_slice().expect("standard");
        check.gathered_product::<bf16>(&format!("ag bf16 {base}"), got, (me, n), rows);
    }
    for m in [50, 1025 * n + 1] {
        let h = Tensor::from_shape_vec(&[m, 16], seeded::<f32>(me, m * 16, 11))?;
        let w2 = Tensor::from_shape_vec(&[16, 20], seeded::<f32>(me, 16 * 20, 12))?;
        let rs = fused::matmul_reduce_scatter(rank, h.view2("h")?, w2.view2("w")?)?;
        let got = rs.as_slice().expect("standard");
        check.reduce_scattered_product(
            &format!("matmul_reduce_scatter {m}"),
            got,
            (me, n),
            (m, 16, 20),
        );
        let rs = fused::matmul_reduce_scatter_unfused(rank, h.view2("h")?, w2.view2("w")?)?;
        let got = rs.as_slice().expect("standard");
        check.reduce_scattered_product(&format!("rs unfused {m}"), got, (me, n), (m, 16, 20));
    }
    // Ulysses all_to_all: [B, s_r, H, D] -> [B, S, h_r, D]; S and H not divisible.
    let s_r = 3 + me % 2;
    let q = Tensor::from_shape_vec(&[2, s_r, 7, 8], seeded::<f32>(me, 2 * s_r * 7 * 8, 13))?;
    let shape = |r: usize| [2, 3 + r % 2, 7, 8];
    // The outputs stay on the rank's GPU.
    let heads = fused::all_to_all(rank, &q, 2, 1)?.output.to_host()?;
    check.heads_all_to_all("all_to_all", heads.as_slice(), (me, n), shape, 13);
    let got = fused::all_to_all_unfused(rank, &q, 2, 1)?.output.to_host()?;
    check.heads_all_to_all("all_to_all_unfused", got.as_slice(), (me, n), shape, 13);
    // The DistTensor layer: an MLP block end to end, its parts on the GPU.
    let (_, device) = check.run_mlp_block("mlp block", rank)?;
    assert_eq!(device, Device::Cuda(0));
    dist_options(rank, &mut check)?;
    Ok(check.fails)
}

/// `[rows, cols]` of `t`'s values in f64.
fn matrix(t: &Tensor<f32>, rows: usize) -> ndarray::Array2<f64> {
    let v = widen(t.as_slice());
    ndarray::Array2::from_shape_vec((rows, v.len() / rows), v).unwrap()
}

/// The DistTensor options on the GPU: N-D `[B, S, K]` inputs, weights read transposed, the
/// gathered input kept; against `reference::product` of the global tensors.
fn dist_options(rank: &Rank<'_>, check: &mut Checks) -> dist_tensor::Result<()> {
    let n = rank.num_ranks();
    let (b, s, k, f) = (5, 3, 16, 24);
    let x = Tensor::<f32>::random(&[b, s, k], 21);
    let w = Tensor::<f32>::random(&[k, f], 22);
    let wt = w.transpose(0, 1)?;
    let xs = DistTensor::from_global(rank, &x, Placement::Shard(0))?;
    let ws = DistTensor::from_global(rank, &w, Placement::Shard(1))?;
    let wts = DistTensor::from_global(rank, &wt, Placement::Shard(0))?;
    let (want, scale) = common::reference::product(matrix(&x, b * s).view(), matrix(&w, k).view());
    let flat = |a: &ndarray::Array2<f64>| a.iter().copied().collect::<Vec<f64>>();
    // The reference of the gathered product, values and scale, flat.
    let gathered = [flat(&want), flat(&scale)];
    let tol = common::tolerance::<f32>(k);
    let h = xs.all_gather_matmul(ws.local())?.to_global()?.to_host()?;
    check.close("N-D all_gather_matmul", h.as_slice(), gathered.clone(), tol);
    let opts = dist_tensor::MatmulOptions::new().transpose_weights(true);
    let (hs, kept) = xs.all_gather_matmul_keep_input(&[wts.local()], &opts)?;
    let h = hs[0].to_global()?.to_host()?;
    check.close("transposed all_gather_matmul", h.as_slice(), gathered.clone(), tol);
    let kept = kept.to_global()?.to_host()?;
    check.exact("kept input", kept.as_slice(), widen(x.as_slice()));
    // The unfused baseline reads the transposed weight in place too.
    let unfused = opts.clone().unfused(true);
    let h = xs.all_gather_matmul_with(&[wts.local()], &unfused)?.remove(0);
    let h = h.to_global()?.to_host()?;
    check.close("transposed all_gather_matmul, unfused", h.as_slice(), gathered.clone(), tol);
    // Back down: [B, S, F] column-sharded times [F, K] row-sharded, reduced and row-scattered.
    let w2 = Tensor::<f32>::random(&[f, k], 23);
    let w2t = w2.transpose(0, 1)?;
    let hs = DistTensor::from_global(
        rank,
        &Tensor::from_shape_vec(&[b, s, f], want.iter().map(|&v| v as f32).collect())?,
        Placement::Shard(2),
    )?;
    let h32 = hs.to_global()?.to_host()?;
    let (want2, scale2) =
        common::reference::product(matrix(&h32, b * s).view(), matrix(&w2, f).view());
    let reduced = [flat(&want2), flat(&scale2)];
    let tol2 = common::tolerance::<f32>(f + n);
    let w2s = DistTensor::from_global(rank, &w2, Placement::Shard(0))?;
    let y = hs.matmul_reduce_scatter(w2s.local())?.to_global()?.to_host()?;
    check.close("N-D matmul_reduce_scatter", y.as_slice(), reduced.clone(), tol2);
    let w2ts = DistTensor::from_global(rank, &w2t, Placement::Shard(1))?;
    let y = hs.matmul_reduce_scatter_with(w2ts.local(), &opts)?.to_global()?.to_host()?;
    check.close("transposed matmul_reduce_scatter", y.as_slice(), reduced.clone(), tol2);
    let y = hs.matmul_reduce_scatter_with(w2ts.local(), &opts.unfused(true))?;
    check.close(
        "transposed matmul_reduce_scatter, unfused",
        y.to_global()?.to_host()?.as_slice(),
        reduced,
        tol2,
    );
    Ok(())
}

#[test]
fn fused_ops_collectives_and_dist_tensors_run_with_ranks_sharing_one_gpu_at_worlds_1_to_3() {
    for n in 1..=3 {
        let Some(world) =
            common::gpu::cuda_world_on(&format!("world of {n} on one GPU"), &vec![0; n])
        else {
            return;
        };
        let fails = world.run(battery).unwrap_or_else(|e| panic!("world {n}: {e}"));
        assert_none(fails.into_iter().flatten().map(|f| format!("world {n}: {f}")).collect());
    }
}

#[test]
fn a_world_sharing_a_gpu_refuses_to_time_its_ops() {
    let Some(world) = common::gpu::cuda_world_on("timer in a shared world", &[0, 0]) else {
        return;
    };
    let errs = world.run(|rank| Ok(cuda::Timer::new(rank).err().map(|e| e.to_string()))).unwrap();
    for e in errs {
        let e = e.expect("Timer::new must refuse a world whose ranks share a GPU");
        assert!(e.contains("share cuda:0"), "{e}");
    }
    // One rank on the GPU may time.
    let Some(world) = common::gpu::cuda_world_on("timer in a world of one", &[0]) else { return };
    world.run(|rank| cuda::Timer::new(rank).map(drop)).unwrap();
}
