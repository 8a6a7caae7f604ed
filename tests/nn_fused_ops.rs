//! The fused ops as a backward pass uses them: weights read transposed in place
//! (`MatmulOptions::transpose_weights`) and the gathered input handed back
//! (`all_gather_matmul_keep_input`), fused and unfused, against references computed in f64 from
//! the same inputs (already rounded to the element type).
//!
//! Worlds of 1 to 4 ranks (and 8 for one shape); every element type; M not divisible by the world
//! and smaller than it (ranks without rows), N and K smaller than the world, primes; shards of 256
//! rows or more (the shard-by-shard path of the fused kernels); `[B, S, K]` sharded on `S` (the
//! gathered input put back in global order); a weight view that is neither row- nor column-major
//! (copied once). Every entry is checked.
//!
//! # Tolerance
//! As in `tests/fused_ops.rs`: an entry that sums `t` products in the accumulator type may be off
//! by `(t + 1) EPSILON_acc * scale` with `scale = sum_p |a_p| |b_p|`, plus one rounding to the
//! element type (`EPSILON_T / 2`) for half types. Each case checks that its bound would catch a
//! kernel that loses one term of the largest size (a dropped row of the transposed weight). The
//! kept input must be bitwise the input.

use dist_tensor::fused::{all_gather_matmul, all_gather_matmul_keep_input};
use dist_tensor::{DistTensor, Element, MatmulOptions, Placement, Result, Tensor, World};
use half::{bf16, f16};
use ndarray::{Array2, s};

mod common;

use common::{f64s2, tolerance};

/// Checks `got` (flattened to rows) against `want` within `tol * scale`, entry by entry; also
/// that the bound would catch the loss of the largest single term.
fn check(
    what: &str,
    got: &Array2<f64>,
    want: &Array2<f64>,
    scale: &Array2<f64>,
    largest: f64,
    tol: f64,
) {
    assert_eq!(got.dim(), want.dim(), "{what}: shape");
    for ((i, g), (w, sc)) in got.indexed_iter().zip(want.iter().zip(scale)) {
        assert!(
            (g - w).abs() <= tol * sc,
            "{what}: entry {i:?} is {g}, want {w} (bound {})",
            tol * sc
        );
    }
    let worst_scale = scale.iter().fold(0.0f64, |m, &v| m.max(v));
    assert!(
        largest > tol * worst_scale || largest == 0.0,
        "{what}: the bound {tol} is too loose to catch a lost term"
    );
}

/// `a @ b` and `|a| @ |b|` in f64.
fn product(a: &Array2<f64>, b: &Array2<f64>) -> (Array2<f64>, Array2<f64>) {
    (a.dot(b), a.mapv(f64::abs).dot(&b.mapv(f64::abs)))
}

/// The largest `|a_ip b_pj|` of a product.
fn largest_term(a: &Array2<f64>, b: &Array2<f64>) -> f64 {
    let ma = a.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    let mb = b.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    ma * mb
}

/// `all_gather(x) @ w_i^T` for weights stored `[n_i, K]`, split by rows (each rank's `[n_r, K]`
/// read transposed), with the input kept; and the same with the weights as they are.
fn all_gather_matmul_case<T: Element>(
    world: usize,
    m: usize,
    k: usize,
    ns: &[usize],
    unfused: bool,
) -> Result<()> {
    let x = Tensor::<T>::random(&[m, k], 1 + m as u64);
    let ws: Vec<Tensor<T>> =
        ns.iter().enumerate().map(|(i, &n)| Tensor::random(&[n, k], 10 + i as u64)).collect();
    let outs = World::threads(world)?.run(|rank| {
        let xs = DistTensor::from_global(rank, &x, Placement::Shard(0))?;
        let shards: Vec<Tensor<T>> = ws
            .iter()
            .map(|w| Ok(DistTensor::from_global(rank, w, Placement::Shard(0))?.into_local()))
            .collect::<Result<_>>()?;
        let refs: Vec<&Tensor<T>> = shards.iter().collect();
        let opts = MatmulOptions::new().transpose_weights(true).unfused(unfused);
        let (products, input) = xs.all_gather_matmul_keep_input(&refs, &opts)?;
        let plain = xs.all_gather_matmul_with(&refs, &opts)?;
        let mut globals = Vec::new();
        for (p, q) in products.iter().zip(&plain) {
            assert_eq!(p.placement(), Placement::Shard(1));
            // Keeping the input changes nothing in the products.
            assert_eq!(
                p.local(),
                q.local(),
                "rank {}: products with and without the input kept",
                rank.rank()
            );
            globals.push(p.to_global()?);
        }
        Ok((globals, input.into_local()))
    })?;
    let x64 = f64s2(&x);
    for (r, (products, input)) in outs.iter().enumerate() {
        assert_eq!(input, &x, "rank {r}: the kept input is the input");
        for (i, (got, w)) in products.iter().zip(&ws).enumerate() {
            let wt = f64s2(w).reversed_axes();
            let (want, scale) = product(&x64, &wt);
            let what = format!(
                "{} all_gather_matmul^T world {world} {m}x{k} weight {i} rank {r}",
                T::DTYPE
            );
            check(&what, &f64s2(got), &want, &scale, largest_term(&x64, &wt), tolerance::<T>(k));
        }
    }
    Ok(())
}

/// `sum over ranks of h_r @ w_r^T` for a weight stored `[N, K]`, split by columns.
fn matmul_reduce_scatter_case<T: Element>(
    world: usize,
    m: usize,
    k: usize,
    n: usize,
    unfused: bool,
) -> Result<()> {
    let h = Tensor::<T>::random(&[m, k], 2 + k as u64);
    let w = Tensor::<T>::random(&[n, k], 3 + n as u64);
    let outs = World::threads(world)?.run(|rank| {
        let hs = DistTensor::from_global(rank, &h, Placement::Shard(1))?;
        let ws = DistTensor::from_global(rank, &w, Placement::Shard(1))?; // [N, k_r]
        let opts = MatmulOptions::new().transpose_weights(true).unfused(unfused);
        let y = hs.matmul_reduce_scatter_with(ws.local(), &opts)?;
        assert_eq!(y.placement(), Placement::Shard(0));
        y.to_global()
    })?;
    let (h64, wt) = (f64s2(&h), f64s2(&w).reversed_axes());
    let (want, scale) = product(&h64, &wt);
    for (r, got) in outs.iter().enumerate() {
        let what =
            format!("{} matmul_reduce_scatter^T world {world} {m}x{k}x{n} rank {r}", T::DTYPE);
        // The unfused baseline rounds each rank's partial product to T before the sum.
        let tol = tolerance::<T>(k + world) * if unfused { 2.0 } else { 1.0 };
        check(&what, &f64s2(got), &want, &scale, largest_term(&h64, &wt), tol);
    }
    Ok(())
}

const SHAPES: [(usize, usize, usize); 6] =
    [(1, 1, 1), (13, 7, 5), (3, 17, 11), (2, 3, 2), (29, 31, 23), (64, 48, 40)];

fn every_shape<T: Element>() -> Result<()> {
    for world in 1..=4 {
        for &(m, k, n) in &SHAPES {
            for unfused in [false, true] {
                all_gather_matmul_case::<T>(world, m, k, &[n, 3], unfused)?;
                matmul_reduce_scatter_case::<T>(world, m, k, n, unfused)?;
            }
        }
    }
    all_gather_matmul_case::<T>(8, 13, 7, &[5], false)?;
    matmul_reduce_scatter_case::<T>(8, 13, 11, 5, false)
}

common::test_dtypes!(
    every_shape -> Result<()>,
    transposed_weights_and_kept_input_f32,
    transposed_weights_and_kept_input_f64,
    transposed_weights_and_kept_input_f16,
    transposed_weights_and_kept_input_bf16,
);

#[test]
fn shard_by_shard_path_with_transposed_weights() -> Result<()> {
    // 300 rows per rank at world 2: tiles per shard, the own rows read from the input; 4100
    // columns: more than one column block of tiles (each starting further along the weight).
    // More rows than one tile: the fused kernels copy the transposed weight into row-major order
    // first (blocks of 32 x 16: 19, 33 and 35 rows and 4100, 17 and 18 columns leave partial
    // blocks); 513 is one row past the last product that reads it in place.
    for unfused in [false, true] {
        all_gather_matmul_case::<f32>(2, 600, 19, &[37, 4100], unfused)?;
        all_gather_matmul_case::<bf16>(3, 800, 9, &[21], unfused)?;
        all_gather_matmul_case::<f64>(3, 513, 33, &[17, 40], unfused)?;
        matmul_reduce_scatter_case::<f32>(2, 600, 19, 4100, unfused)?;
        matmul_reduce_scatter_case::<bf16>(3, 800, 9, 21, unfused)?;
        matmul_reduce_scatter_case::<f16>(3, 513, 35, 18, unfused)?;
    }
    Ok(())
}

#[test]
fn kept_input_of_a_sequence_sharded_batch_is_in_global_order() -> Result<()> {
    // [B, S, K] sharded on S: the gather delivers rows rank by rank, the kept input is [B, S, K].
    let x = Tensor::<bf16>::random(&[3, 11, 5], 4);
    let w = Tensor::<bf16>::random(&[5, 6], 5);
    for world in 1..=4 {
        let outs = World::threads(world)?.run(|rank| {
            let xs = DistTensor::from_global(rank, &x, Placement::Shard(1))?;
            let w = DistTensor::from_global(rank, &w, Placement::Shard(1))?;
            let (h, input) =
                xs.all_gather_matmul_keep_input(&[w.local()], &MatmulOptions::new())?;
            assert_eq!(h[0].local(), xs.all_gather_matmul(w.local())?.local());
            Ok(input.into_local())
        })?;
        assert!(outs.iter().all(|t| t == &x), "world {world}");
    }
    Ok(())
}

#[test]
fn a_weight_view_of_any_strides_is_read_correctly() -> Result<()> {
    // Every other column of a wider matrix: neither row- nor column-major, copied once.
    let x = Tensor::<f64>::random(&[9, 6], 6);
    let wide = Tensor::<f64>::random(&[6, 10], 7);
    let outs = World::threads(3)?.run(|rank| {
        let xs = DistTensor::from_global(rank, &x, Placement::Shard(0))?;
        let wide = wide.view2("w")?;
        // Every other column; and the rows reversed (a negative stride).
        let (strided, reversed) = (wide.slice(s![.., ..;2]), wide.slice(s![..;-1, 1..;2]));
        let got = all_gather_matmul(rank, xs.local().view2("x")?, &[strided, reversed])?;
        let kept = all_gather_matmul_keep_input(rank, xs.local().view2("x")?, &[strided])?;
        assert_eq!(kept.outputs[0], got.outputs[0]);
        Ok(got.outputs)
    })?;
    let wide = f64s2(&wide);
    let wants =
        [f64s2(&x).dot(&wide.slice(s![.., ..;2])), f64s2(&x).dot(&wide.slice(s![..;-1, 1..;2]))];
    for outs in &outs {
        for (out, want) in outs.iter().zip(&wants) {
            assert!((out - want).iter().all(|d| d.abs() < 1e-12));
        }
    }
    Ok(())
}

#[test]
fn an_output_split_on_all_gather_matmul_fails_every_rank() -> Result<()> {
    let x = Tensor::<f32>::random(&[4, 3], 1);
    let w = Tensor::<f32>::random(&[3, 2], 2);
    let err = World::threads(2)?
        .run(|rank| {
            let xs = DistTensor::from_global(rank, &x, Placement::Shard(0))?;
            // Only rank 1 passes the option: both fail, neither hangs.
            let opts = if rank.rank() == 1 {
                MatmulOptions::new().output_split(0, vec![2, 2])
            } else {
                MatmulOptions::new()
            };
            xs.all_gather_matmul_with(&[&w], &opts).map(drop)
        })
        .unwrap_err();
    assert!(err.to_string().contains("output split"), "{err}");
    Ok(())
}
