//! The public ops of the lower levels (`fused::*` on views, `collectives::*`) in a `World::cuda`
//! world run on the GPUs, never the host simulation: each op chooses its backend once, from the
//! world. Checked against an f64 host reference on seeded random inputs with uneven row shards.
//!
//! Without a GPU (or a build without `--features cuda`) each test prints that it was skipped and
//! why, and passes: `cargo test --release --features cuda --test cuda_dispatch -- --nocapture`.

mod common;

use common::gpu::cuda_world;
use dist_tensor::{Device, Tensor, collectives, fused};

fn worst(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    got.iter().zip(want).map(|(&g, &w)| (g as f64 - w).abs()).fold(0.0, f64::max)
}

#[test]
fn the_public_fused_all_gather_matmul_runs_on_the_gpus_of_a_cuda_world() {
    let Some(world) = cuda_world("fused::all_gather_matmul", 2) else { return };
    let n = world.num_ranks();
    let (k, cols) = (13, 5);
    // Uneven row shards: rank r has 2 * r + 3 rows.
    let rows: Vec<usize> = (0..n).map(|r| 2 * r + 3).collect();
    let xs: Vec<Tensor<f32>> =
        rows.iter().enumerate().map(|(r, &m)| Tensor::random(&[m, k], 10 + r as u64)).collect();
    let w = Tensor::<f32>::random(&[k, cols], 99);
    let outs = world
        .run(|rank| {
            assert!(matches!(rank.device(), dist_tensor::Device::Cuda(_)));
            let x = xs[rank.rank()].view2("x")?;
            let out = fused::all_gather_matmul(rank, x, &[w.view2("w")?])?;
            // Computed on this rank's GPU, not the host simulation.
            assert_eq!(out.device, rank.device());
            assert!(matches!(out.device, Device::Cuda(_)), "{:?}", out.device);
            assert_eq!(out.row_counts, rows);
            Ok(out.outputs[0].iter().copied().collect::<Vec<f32>>())
        })
        .unwrap();
    let all: Vec<f64> = xs.iter().flat_map(|x| x.as_slice().iter().map(|&v| v as f64)).collect();
    let m: usize = rows.iter().sum();
    let mut want = vec![0.0f64; m * cols];
    for i in 0..m {
        for j in 0..cols {
            want[i * cols + j] =
                (0..k).map(|p| all[i * k + p] * w.as_slice()[p * cols + j] as f64).sum();
        }
    }
    for got in &outs {
        assert!(worst(got, &want) < 1e-4, "{}", worst(got, &want));
    }
}

#[test]
fn the_public_collectives_run_on_the_gpus_of_a_cuda_world() {
    let Some(world) = cuda_world("collectives", 2) else { return };
    let n = world.num_ranks();
    let parts: Vec<Tensor<f32>> = (0..n).map(|r| Tensor::random(&[3, 7], 40 + r as u64)).collect();
    let want: Vec<f64> =
        (0..21).map(|i| parts.iter().map(|p| p.as_slice()[i] as f64).sum::<f64>()).collect();
    let outs = world
        .run(|rank| {
            let mine = &parts[rank.rank()];
            // A tensor in, a tensor out on this rank's GPU.
            let sum = collectives::all_reduce_tensor(rank, mine)?;
            assert_eq!(sum.device(), rank.device());
            assert!(matches!(sum.device(), Device::Cuda(_)), "{:?}", sum.device());
            // The slice collective: on the GPU too (moved there and back), same sum.
            let flat = collectives::all_reduce(rank, mine.as_slice())?;
            Ok((sum.to_host()?.as_slice().to_vec(), flat))
        })
        .unwrap();
    for (tensor, flat) in &outs {
        assert!(worst(tensor, &want) < 1e-5);
        assert!(worst(flat, &want) < 1e-5);
    }
}

#[test]
fn device_tensors_reach_the_public_collectives_and_fused_ops_of_a_cuda_world() {
    let Some(world) = cuda_world("device tensors into collectives and fused ops", 2) else {
        return;
    };
    let n = world.num_ranks();
    let (k, cols) = (11, 4);
    let rows: Vec<usize> = (0..n).map(|r| 3 * r + 2).collect();
    let xs: Vec<Tensor<f32>> =
        rows.iter().enumerate().map(|(r, &m)| Tensor::random(&[m, k], 70 + r as u64)).collect();
    let w = Tensor::<f32>::random(&[k, cols], 77);
    let parts: Vec<Tensor<f32>> = (0..n).map(|r| Tensor::random(&[2, 5], 80 + r as u64)).collect();
    let outs = world
        .run(|rank| {
            // Moved to this rank's GPU by the caller: the ops read them there.
            let x = xs[rank.rank()].to_rank(rank)?;
            let w = w.to_rank(rank)?;
            let part = parts[rank.rank()].to_rank(rank)?;
            assert!(matches!(x.device(), Device::Cuda(_)), "{:?}", x.device());
            let out = fused::all_gather_matmul(rank, &x, &[&w])?;
            assert!(matches!(out.device, Device::Cuda(_)), "{:?}", out.device);
            let sum = collectives::all_reduce(rank, &part)?;
            let gathered = collectives::all_gather(rank, &x)?;
            Ok((out.outputs[0].iter().copied().collect::<Vec<f32>>(), sum, gathered))
        })
        .unwrap();
    let all: Vec<f64> = xs.iter().flat_map(|x| x.as_slice().iter().map(|&v| v as f64)).collect();
    let m: usize = rows.iter().sum();
    let mut product = vec![0.0f64; m * cols];
    for i in 0..m {
        for j in 0..cols {
            product[i * cols + j] =
                (0..k).map(|p| all[i * k + p] * w.as_slice()[p * cols + j] as f64).sum();
        }
    }
    let sum: Vec<f64> =
        (0..10).map(|i| parts.iter().map(|p| p.as_slice()[i] as f64).sum::<f64>()).collect();
    for (got_product, got_sum, got_gathered) in &outs {
        assert!(worst(got_product, &product) < 1e-4, "{}", worst(got_product, &product));
        assert!(worst(got_sum, &sum) < 1e-5, "{}", worst(got_sum, &sum));
        assert!(worst(got_gathered, &all) == 0.0, "all_gather copies exactly");
    }
}
