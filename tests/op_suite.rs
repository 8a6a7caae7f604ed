//! One op suite, written once and run in every kind of world, as candle's `test_device!` runs
//! one test per device: threads, processes of one host, MPI fake nodes (every process its own
//! node, every byte between ranks over TCP; only in builds with feature `mpi`), CUDA (worlds of
//! 1, 2 and 3 ranks, one GPU each where there are enough, else sharing them round-robin, as on a
//! machine with one GPU; in builds with feature `cuda`, skipped saying why elsewhere) and an Ascend world on the stand-in CANN. The cases cover every level: the
//! collectives and the fused ops on slices, views and tensors, and `DistTensor`'s fused ops and
//! redistributions. Each compares every rank's result with a plain f64 reference on seeded
//! random inputs (uneven shards, a rank with no rows). The Ascend world runs on the executing
//! stand-in (as `tests/ascend_run.rs` does): the real Ascend C kernels compiled for the CPU,
//! cached by source across both test binaries, so its values are checked too, except where an
//! unfused baseline multiplies through `aclnnMatmul`, which the stand-in records without
//! computing. (What only a CUDA world has, its paths and faults, is in `tests/cuda.rs`.)
//!
//! The capability table test asserts that every (op, backend, dtype) cell either runs and
//! matches f64 or returns the typed error the table promises, so the table cannot drift from the
//! code (the CUDA column where a GPU is; it says it was skipped otherwise).
#![cfg(target_os = "linux")]

mod cann_stand_in;

use std::time::Duration;

use dist_tensor::collectives::{self, ReduceOp};
use dist_tensor::device::Device;
use dist_tensor::device::ascend::{Ascend, AscendWorldBuilder};
use dist_tensor::device::capability::{self, Feature, Op};
use dist_tensor::tensor::DType;
use dist_tensor::{
    DistTensor, Element, Error, Placement, Rank, Result, Split, Tensor, World, fused,
};
use half::{bf16, f16};

// ---- helpers (kept in this file; tests/common is being built by another change) ------------

/// The seed of a rank's input: `salt`, the rank, and the element count, mixed.
fn seed(rank: usize, salt: u64) -> u64 {
    salt * 1000 + rank as u64
}

/// A seeded `[rows, cols]` tensor.
fn random<T: Element>(rows: usize, cols: usize, seed: u64) -> Tensor<T> {
    Tensor::random(&[rows, cols], seed)
}

/// How far a result of `T` may be from f64: its precision, times the length of the sums.
fn tolerance<T: Element>(terms: usize) -> f64 {
    let eps = match T::DTYPE {
        DType::F64 => 1e-12,
        DType::F32 => 1e-5,
        DType::F16 => 2e-3,
        DType::BF16 => 1.6e-2,
    };
    eps * (terms.max(1) as f64).sqrt() * 4.0
}

fn f64s<T: Element>(values: &[T]) -> Vec<f64> {
    values.iter().map(|v| v.to_f64()).collect()
}

/// Panics unless `got` is `want` within the tolerance for sums of `terms` terms.
fn close<T: Element>(what: &str, got: &[T], want: &[f64], terms: usize) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let scale = want.iter().fold(1.0f64, |m, w| m.max(w.abs()));
    let worst = f64s(got).iter().zip(want).fold(0.0f64, |m, (g, w)| m.max((g - w).abs()));
    assert!(worst <= tolerance::<T>(terms) * scale, "{what} ({}): off by {worst}", T::DTYPE);
}

/// Rows rank `r` of `n` holds: uneven, the last rank none when there are several.
fn rows_of(r: usize, n: usize) -> usize {
    if n > 1 && r == n - 1 { 0 } else { 2 * r + 3 }
}

/// Whether the unfused baselines that multiply through the vendor library compute here: on the
/// stand-in CANN `aclnnMatmul` is recorded, not computed (the fused kernels and the collectives
/// are Ascend C kernels, which the executing stand-in runs), so their values are not checked.
fn vendor_matmul_computes(rank: &Rank<'_>) -> bool {
    !matches!(rank.device(), Device::Ascend(_))
}

/// `a @ b` in f64, row-major.
fn matmul_f64(a: &[f64], b: &[f64], m: usize, k: usize, n: usize) -> Vec<f64> {
    let mut out = vec![0.0; m * n];
    for i in 0..m {
        for p in 0..k {
            let x = a[i * k + p];
            for j in 0..n {
                out[i * n + j] += x * b[p * n + j];
            }
        }
    }
    out
}

// ---- the cases: each op once, for any world ---------------------------------------------------

/// all_gather_matmul, fused and unfused: uneven row shards, two weights.
fn all_gather_matmul<T: Element>(rank: &Rank<'_>, check: bool) -> Result<()> {
    let (me, n) = (rank.rank(), rank.num_ranks());
    let (k, cols) = (7, [5, 2]);
    let x = random::<T>(rows_of(me, n), k, seed(me, 1));
    let ws: Vec<Tensor<T>> = cols.iter().map(|&c| random(k, c, 20 + c as u64)).collect();
    let views: Vec<_> = ws.iter().map(|w| w.view2("w")).collect::<Result<_>>()?;
    for fused in [true, false] {
        let x = x.view2("x")?;
        let out = if fused {
            fused::all_gather_matmul(rank, x, &views)?
        } else {
            fused::all_gather_matmul_unfused(rank, x, &views)?
        };
        let m: usize = (0..n).map(|r| rows_of(r, n)).sum();
        assert_eq!(out.row_counts, (0..n).map(|r| rows_of(r, n)).collect::<Vec<_>>());
        assert_eq!(out.device, rank.device());
        let all: Vec<f64> = (0..n)
            .flat_map(|r| f64s(random::<T>(rows_of(r, n), k, seed(r, 1)).as_slice()))
            .collect();
        for (i, (w, &c)) in ws.iter().zip(&cols).enumerate() {
            assert_eq!(out.outputs[i].dim(), (m, c));
            if check && (fused || vendor_matmul_computes(rank)) {
                let want = matmul_f64(&all, &f64s(w.as_slice()), m, k, c);
                let got: Vec<T> = out.outputs[i].iter().copied().collect();
                close(&format!("all_gather_matmul fused={fused} weight {i}"), &got, &want, k);
            }
        }
    }
    Ok(())
}

/// matmul_reduce_scatter, fused and unfused: every rank's `[M, k_r]` times its `[k_r, N]`.
fn matmul_reduce_scatter<T: Element>(rank: &Rank<'_>, check: bool) -> Result<()> {
    let (me, n) = (rank.rank(), rank.num_ranks());
    let (m, cols) = (5, 3);
    let k_of = |r: usize| r + 2;
    let x = random::<T>(m, k_of(me), seed(me, 2));
    let w = random::<T>(k_of(me), cols, seed(me, 3));
    for fused in [true, false] {
        let (x, w) = (x.view2("x")?, w.view2("w")?);
        let out = if fused {
            fused::matmul_reduce_scatter(rank, x, w)?
        } else {
            fused::matmul_reduce_scatter_unfused(rank, x, w)?
        };
        let mine = dist_tensor::tensor::array_split(m, n);
        assert_eq!(out.dim(), (mine[me], cols));
        if check && (fused || vendor_matmul_computes(rank)) {
            let mut sum = vec![0.0; m * cols];
            for r in 0..n {
                let xr = f64s(random::<T>(m, k_of(r), seed(r, 2)).as_slice());
                let wr = f64s(random::<T>(k_of(r), cols, seed(r, 3)).as_slice());
                for (s, p) in sum.iter_mut().zip(matmul_f64(&xr, &wr, m, k_of(r), cols)) {
                    *s += p;
                }
            }
            let start: usize = mine[..me].iter().sum();
            let want = &sum[start * cols..(start + mine[me]) * cols];
            let got: Vec<T> = out.iter().copied().collect();
            close(&format!("matmul_reduce_scatter fused={fused}"), &got, want, n * (n + 1));
        }
    }
    Ok(())
}

/// all_to_all, fused and unfused: `[S_r, H]` sequence shards to every row of `H / n` heads.
fn all_to_all<T: Element>(rank: &Rank<'_>, check: bool) -> Result<()> {
    let (me, n) = (rank.rank(), rank.num_ranks());
    let heads = 2 * n + 1;
    let x = random::<T>(rows_of(me, n), heads, seed(me, 4));
    for fused in [true, false] {
        let out = if fused {
            fused::all_to_all(rank, &x, 1, 0)?
        } else {
            fused::all_to_all_unfused(rank, &x, 1, 0)?
        };
        // Where the world keeps its tensors (a CUDA world: this rank's GPU): read on the host.
        let output = out.output.to_host()?;
        let mine = dist_tensor::tensor::array_split(heads, n);
        let s: usize = (0..n).map(|r| rows_of(r, n)).sum();
        assert_eq!(output.shape(), &[s, mine[me]]);
        if check {
            let start: usize = mine[..me].iter().sum();
            let want: Vec<f64> = (0..n)
                .flat_map(|r| {
                    let xr = random::<T>(rows_of(r, n), heads, seed(r, 4));
                    (0..rows_of(r, n))
                        .flat_map(|i| (start..start + mine[me]).map(move |h| (i, h)))
                        .map(|(i, h)| xr.as_slice()[i * heads + h].to_f64())
                        .collect::<Vec<_>>()
                })
                .collect();
            close(&format!("all_to_all fused={fused}"), output.as_slice(), &want, 1);
        }
    }
    Ok(())
}

/// A seeded `[1, len]` input of rank `r`.
fn flat<T: Element>(r: usize, len: usize, salt: u64) -> Tensor<T> {
    random::<T>(1, len, seed(r, salt))
}

/// all_gather of uneven lengths (the last rank none).
fn all_gather_case<T: Element>(rank: &Rank<'_>, check: bool) -> Result<()> {
    let (me, n) = (rank.rank(), rank.num_ranks());
    let mine = flat::<T>(me, rows_of(me, n), 5);
    let gathered = collectives::all_gather(rank, mine.as_slice())?;
    let want: Vec<f64> =
        (0..n).flat_map(|r| f64s(flat::<T>(r, rows_of(r, n), 5).as_slice())).collect();
    assert_eq!(gathered.len(), want.len());
    if check {
        close("all_gather", &gathered, &want, 1);
    }
    Ok(())
}

/// The sum over ranks of every rank's input of `len` (salt 6), in f64.
fn sum_of<T: Element>(n: usize, len: usize) -> Vec<f64> {
    (0..len).map(|i| (0..n).map(|r| flat::<T>(r, len, 6).as_slice()[i].to_f64()).sum()).collect()
}

/// reduce_scatter, sum and mean, of a length that does not divide by the world.
fn reduce_scatter_case<T: Element>(rank: &Rank<'_>, check: bool) -> Result<()> {
    let (me, n) = (rank.rank(), rank.num_ranks());
    let len = 2 * n + 3;
    let input = flat::<T>(me, len, 6);
    let sum = sum_of::<T>(n, len);
    let piece = dist_tensor::tensor::array_split(len, n);
    let start: usize = piece[..me].iter().sum();
    for op in [ReduceOp::Sum, ReduceOp::Mean] {
        let got = collectives::reduce_scatter(rank, input.as_slice(), op)?;
        assert_eq!(got.len(), piece[me]);
        let scale = if op == ReduceOp::Mean { 1.0 / n as f64 } else { 1.0 };
        let want: Vec<f64> = sum[start..start + piece[me]].iter().map(|s| s * scale).collect();
        if check {
            close(&format!("reduce_scatter {op:?}"), &got, &want, n);
        }
    }
    Ok(())
}

/// all_reduce of a length that does not divide by the world.
fn all_reduce_case<T: Element>(rank: &Rank<'_>, check: bool) -> Result<()> {
    let (me, n) = (rank.rank(), rank.num_ranks());
    let len = 2 * n + 3;
    let all = collectives::all_reduce(rank, flat::<T>(me, len, 6).as_slice())?;
    assert_eq!(all.len(), len);
    if check {
        close("all_reduce", &all, &sum_of::<T>(n, len), n);
    }
    Ok(())
}

/// all_to_all_v: rank r sends rank d `(r + d) % 3` elements (some none).
fn all_to_all_v_case<T: Element>(rank: &Rank<'_>, check: bool) -> Result<()> {
    let (me, n) = (rank.rank(), rank.num_ranks());
    let to = |r: usize, d: usize| (r + d) % 3;
    let send_counts: Vec<usize> = (0..n).map(|d| to(me, d)).collect();
    let send = flat::<T>(me, send_counts.iter().sum(), 7);
    let got = collectives::all_to_all_v(rank, send.as_slice(), &send_counts)?;
    let want: Vec<f64> = (0..n)
        .flat_map(|r| {
            let theirs = f64s(flat::<T>(r, (0..n).map(|d| to(r, d)).sum(), 7).as_slice());
            let at: usize = (0..me).map(|d| to(r, d)).sum();
            theirs[at..at + to(r, me)].to_vec()
        })
        .collect();
    assert_eq!(got.len(), want.len());
    if check {
        close("all_to_all_v", &got, &want, 1);
    }
    Ok(())
}

/// broadcast from the last rank.
fn broadcast_case<T: Element>(rank: &Rank<'_>, check: bool) -> Result<()> {
    let (me, n) = (rank.rank(), rank.num_ranks());
    let (root, len) = (n - 1, 2 * n + 3);
    let got = collectives::broadcast(rank, flat::<T>(me, len, 8).as_slice(), root)?;
    assert_eq!(got.len(), len);
    if check {
        close("broadcast", &got, &f64s(flat::<T>(root, len, 8).as_slice()), 1);
    }
    Ok(())
}

/// DistTensor::redistribute_split from partial sums to the even split (a reduce_scatter), or,
/// with `uneven`, from that to an uneven split (the table's `UnevenSplit` feature).
fn redistribute_split_case<T: Element>(rank: &Rank<'_>, check: bool, uneven: bool) -> Result<()> {
    let n = rank.num_ranks();
    let len = 2 * n + 3;
    let partial = DistTensor::from_local(rank, flat::<T>(rank.rank(), len, 6), Placement::Partial)?;
    let mut got = partial.redistribute_split(1, Split::Even)?;
    if uneven {
        let sizes: Vec<usize> = (0..n).map(|r| if r == 0 { len - (n - 1) } else { 1 }).collect();
        got = got.redistribute_split(1, sizes)?;
    }
    let global = got.to_global()?;
    if check {
        close_tensor(
            "redistribute_split",
            &global,
            &Tensor::from_shape_vec(&[1, len], sum_of::<T>(n, len))?,
            n,
        );
    }
    Ok(())
}

/// The collectives: all_gather, reduce_scatter (sum, mean), all_reduce, all_to_all_v (where the
/// world has it), broadcast, and the re-split of a DistTensor.
fn collectives_case<T: Element>(rank: &Rank<'_>, check: bool) -> Result<()> {
    all_gather_case::<T>(rank, check)?;
    reduce_scatter_case::<T>(rank, check)?;
    all_reduce_case::<T>(rank, check)?;
    // A GPU world has no all_to_all_v kernel: the table says so, and the capability test checks
    // that it is refused as the table says.
    if capability::refusal(Op::AllToAllV, rank.device(), T::DTYPE, &[]).is_none() {
        all_to_all_v_case::<T>(rank, check)?;
    }
    broadcast_case::<T>(rank, check)?;
    redistribute_split_case::<T>(rank, check, !matches!(rank.device(), Device::Cuda(_)))
}

/// Tensors passed straight to the lower levels (the collectives, the fused ops on matrices):
/// the same results as the slices and views they hold, which the cases above check against f64.
fn tensor_inputs<T: Element>(rank: &Rank<'_>, check: bool) -> Result<()> {
    let (me, n) = (rank.rank(), rank.num_ranks());
    let mine = random::<T>(rows_of(me, n), 3, seed(me, 9));
    let from_tensor = collectives::all_gather(rank, &mine)?;
    let from_slice = collectives::all_gather(rank, mine.as_slice())?;
    assert_eq!(from_tensor.len(), 3 * (0..n).map(|r| rows_of(r, n)).sum::<usize>());
    let same = random::<T>(2, 3, seed(me, 13));
    let sum = collectives::all_reduce(rank, &same)?;
    assert_eq!(sum.len(), same.len());
    let (k, cols) = (4, 3);
    let x = random::<T>(rows_of(me, n), k, seed(me, 10));
    let w = random::<T>(k, cols, seed(me, 11));
    let ag_tensor = fused::all_gather_matmul(rank, &x, &[&w])?;
    let ag_view = fused::all_gather_matmul(rank, x.view2("x")?, &[w.view2("w")?])?;
    assert_eq!(ag_tensor.outputs[0].dim(), ag_view.outputs[0].dim());
    let xm = random::<T>(5, k, seed(me, 12));
    let rs_tensor = fused::matmul_reduce_scatter(rank, &xm, &w)?;
    let rs_view = fused::matmul_reduce_scatter(rank, xm.view2("x")?, w.view2("w")?)?;
    assert_eq!(rs_tensor.dim(), rs_view.dim());
    if check {
        // One path per world, whatever the input's type: the same bits.
        assert_eq!(from_tensor, from_slice, "all_gather of a tensor");
        assert_eq!(ag_tensor, ag_view, "all_gather_matmul of tensors");
        assert_eq!(rs_tensor, rs_view, "matmul_reduce_scatter of tensors");
        let want: Vec<f64> = (0..same.len())
            .map(|i| (0..n).map(|r| random::<T>(2, 3, seed(r, 13)).as_slice()[i].to_f64()).sum())
            .collect();
        close("all_reduce of a tensor", &sum, &want, n);
    }
    Ok(())
}

/// `got` (a tensor anywhere) is `want` within the tolerance for sums of `terms` terms.
fn close_tensor<T: Element>(what: &str, got: &Tensor<T>, want: &Tensor<f64>, terms: usize) {
    assert_eq!(got.shape(), want.shape(), "{what}: shape");
    close(what, got.to_host().expect("to_host").as_slice(), want.as_slice(), terms);
}

/// The level above: [`DistTensor`]'s fused ops and redistributions, on the tensors where the
/// world keeps them (each rank's GPU in a CUDA world). Shapes are odd, shards uneven or empty.
fn dist_ops<T: Element>(rank: &Rank<'_>, check: bool) -> Result<()> {
    let (me, n) = (rank.rank(), rank.num_ranks());
    let total_rows: usize = (0..n).map(|r| rows_of(r, n)).sum();
    let f64_of = |t: &Tensor<T>| t.cast::<f64>();

    // all_gather_matmul: rows sharded unevenly (a rank with none), weights sharded on columns.
    let k = 9;
    let x = Tensor::<T>::random(&[total_rows, k], 61);
    let start: usize = (0..me).map(|r| rows_of(r, n)).sum();
    let rows = ndarray::Slice::from(start..start + rows_of(me, n));
    let local = Tensor::from_array(x.view().slice_axis(ndarray::Axis(0), rows).to_owned());
    let xd = DistTensor::from_local(rank, local, Placement::Shard(0))?;
    // Where the world keeps its tensors: each rank's GPU in a CUDA world, the host otherwise
    // (an Ascend world's kernels take host memory).
    if !matches!(rank.device(), Device::Ascend(_)) {
        assert_eq!(xd.local().device(), rank.device());
    }
    let ws: Vec<Tensor<T>> =
        [1, 4, 7].iter().map(|&c| Tensor::random(&[k, c], 62 + c as u64)).collect();
    let shards: Vec<DistTensor<'_, T>> = ws
        .iter()
        .map(|w| DistTensor::from_global(rank, w, Placement::Shard(1)))
        .collect::<Result<_>>()?;
    let locals: Vec<&Tensor<T>> = shards.iter().map(|s| s.local()).collect();
    let fused = xd.all_gather_matmul_many(&locals)?;
    let unfused = xd.all_gather_matmul_unfused(locals[2])?;
    let unfused_checked = vendor_matmul_computes(rank).then_some((2, &unfused));
    for (i, h) in fused.iter().enumerate().chain(unfused_checked) {
        let got = h.to_global()?;
        if check {
            let want = f64_of(&x).matmul(&f64_of(&ws[i]))?;
            close_tensor(&format!("DistTensor::all_gather_matmul weight {i}"), &got, &want, k);
        }
    }

    // matmul_reduce_scatter: the inner dimension sharded unevenly.
    // An empty inner shard (the last rank's) in every world kind.
    let ks: Vec<usize> = (0..n).map(|r| rows_of(r, n)).collect();
    let (m, cols) = (7, 5);
    let h = Tensor::<T>::random(&[m, ks.iter().sum()], 63);
    let w = Tensor::<T>::random(&[ks.iter().sum(), cols], 64);
    let at: usize = ks[..me].iter().sum();
    let part = ndarray::Slice::from(at..at + ks[me]);
    let hl = Tensor::from_array(h.view().slice_axis(ndarray::Axis(1), part).to_owned());
    let wl = Tensor::from_array(w.view().slice_axis(ndarray::Axis(0), part).to_owned());
    let hd = DistTensor::from_local(rank, hl, Placement::Shard(1))?;
    let wl = wl.to_rank(rank)?;
    for (fused, y) in
        [(true, hd.matmul_reduce_scatter(&wl)?), (false, hd.matmul_reduce_scatter_unfused(&wl)?)]
    {
        assert_eq!(y.placement(), Placement::Shard(0));
        let got = y.to_global()?;
        if check && (fused || vendor_matmul_computes(rank)) {
            let want = f64_of(&h).matmul(&f64_of(&w))?;
            close_tensor(
                &format!("DistTensor::matmul_reduce_scatter fused={fused}"),
                &got,
                &want,
                n * 4,
            );
        }
    }

    // all_to_all of a [B, S, H, D] tensor whose S and H do not divide by the world, both ways.
    let seq = Tensor::<T>::random(&[1, 7, 3, 4], 65);
    for (scatter, gather) in [(2, 1), (1, 2), (0, 3), (3, 1)] {
        let from = DistTensor::from_global(rank, &seq, Placement::Shard(gather))?;
        let heads = from.all_to_all(scatter, gather)?;
        assert_eq!(heads.placement(), Placement::Shard(scatter));
        let unfused = from.all_to_all_unfused(scatter, gather)?;
        let back = heads.all_to_all(gather, scatter)?;
        if check {
            let want = DistTensor::from_global(rank, &seq, Placement::Shard(scatter))?;
            let want = want.local().to_host()?;
            let what = format!("DistTensor::all_to_all({scatter}, {gather})");
            assert_eq!(heads.local().to_host()?, want, "{what}");
            assert_eq!(unfused.local().to_host()?, want, "{what} unfused");
            assert_eq!(back.local().to_host()?, from.local().to_host()?, "{what} and back");
        }
    }

    // The collectives under the placements: all_gather, all_reduce, reduce_scatter, re-splits.
    let shape = [2, 7, 3];
    let whole = Tensor::<T>::random(&shape, 66);
    let want = f64_of(&whole);
    let mut got = Vec::new();
    for d in 0..shape.len() {
        let s = DistTensor::from_global(rank, &whole, Placement::Shard(d))?;
        got.push((format!("Shard({d}) gathered"), s.to_global()?));
        got.push((
            format!("Shard({d}) replicated"),
            s.redistribute(Placement::Replicate)?.local().clone(),
        ));
        let p = s.redistribute(Placement::Partial)?;
        got.push((format!("Shard({d}) as partial sums, all_reduce"), p.to_global()?));
        for j in 0..shape.len() {
            let rs = p.redistribute(Placement::Shard(j))?.to_global()?;
            got.push((format!("Partial to Shard({j}), reduce_scatter"), rs));
            let r = DistTensor::from_global(rank, &whole, Placement::Replicate)?;
            got.push((
                format!("Replicate to Shard({j})"),
                r.redistribute(Placement::Shard(j))?.to_global()?,
            ));
            if j != d {
                got.push((
                    format!("Shard({d}) to Shard({j})"),
                    s.redistribute(Placement::Shard(j))?.to_global()?,
                ));
            }
        }
    }
    let sum = DistTensor::from_local(rank, whole.clone(), Placement::Partial)?.to_global()?;
    if check {
        for (what, t) in &got {
            close_tensor(what, t, &want, n);
        }
        let n_times = Tensor::from_array(want.to_array().mapv(|v| v * n as f64));
        close_tensor("Partial of the same tensor on every rank", &sum, &n_times, n);
    }
    Ok(())
}

/// Every case in one dtype.
fn every_op<T: Element>(rank: &Rank<'_>, check: bool) -> Result<()> {
    all_gather_matmul::<T>(rank, check)?;
    matmul_reduce_scatter::<T>(rank, check)?;
    all_to_all::<T>(rank, check)?;
    if capability::refusal(Op::FlashDecode, rank.device(), T::DTYPE, &[]).is_none() {
        flash_decode_case::<T>(rank, check)?;
    }
    if capability::refusal(Op::MoeDispatch, rank.device(), T::DTYPE, &[]).is_none() {
        moe_case::<T>(rank, check)?;
    }
    collectives_case::<T>(rank, check)?;
    tensor_inputs::<T>(rank, check)?;
    dist_ops::<T>(rank, check)
}

/// Keys rank `r` of `n` holds for flash_decode: uneven, a rank with none, more than two chunks of
/// the host kernel (256 keys each; the GPU's are 128, the NPU's at most 64) on rank 0 of a world
/// of 2 or more.
fn keys_of(r: usize, n: usize) -> usize {
    match r {
        0 if n > 1 => 515,
        _ if n > 1 && r == n - 1 => 0,
        _ => 2 * r + 3,
    }
}

/// The sequence-parallel flash-decode, fused and unfused, against attention in f64 over every
/// rank's keys: grouped-query heads (6 query heads on 3 kv heads), d != dv, uneven key shards.
fn flash_decode_case<T: Element>(rank: &Rank<'_>, check: bool) -> Result<()> {
    let (me, n) = (rank.rank(), rank.num_ranks());
    let (batch, heads, kv_heads, d, dv) = (2, 6, 3, 5, 4);
    let scale = 1.0 / (d as f64).sqrt();
    let q = Tensor::<T>::random(&[batch, heads, d], 31);
    let kv = |r: usize| {
        let k = Tensor::<T>::random(&[batch, keys_of(r, n), kv_heads, d], seed(r, 32));
        let v = Tensor::<T>::random(&[batch, keys_of(r, n), kv_heads, dv], seed(r, 33));
        (k, v)
    };
    let (k, v) = kv(me);
    // softmax(q k^T * scale) v over the keys of every rank, in f64.
    let mut want = vec![0.0; batch * heads * dv];
    let all: Vec<(Tensor<T>, Tensor<T>)> = (0..n).map(kv).collect();
    for b in 0..batch {
        for h in 0..heads {
            let kvh = h / (heads / kv_heads);
            let qh = &q.as_slice()[(b * heads + h) * d..][..d];
            let mut scores = Vec::new();
            let mut rows = Vec::new();
            for (r, (k, v)) in all.iter().enumerate() {
                for j in 0..keys_of(r, n) {
                    let at = (b * keys_of(r, n) + j) * kv_heads + kvh;
                    let key = &k.as_slice()[at * d..][..d];
                    let dot: f64 = qh.iter().zip(key).map(|(a, b)| a.to_f64() * b.to_f64()).sum();
                    scores.push(dot * scale);
                    rows.push(&v.as_slice()[at * dv..][..dv]);
                }
            }
            let top = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let weights: Vec<f64> = scores.iter().map(|s| (s - top).exp()).collect();
            let sum: f64 = weights.iter().sum();
            for (w, row) in weights.iter().zip(rows) {
                for (o, x) in want[(b * heads + h) * dv..][..dv].iter_mut().zip(row) {
                    *o += w / sum * x.to_f64();
                }
            }
        }
    }
    for fused in [true, false] {
        let out = if fused {
            fused::flash_decode(rank, &q, &k, &v, scale)?
        } else {
            fused::flash_decode_unfused(rank, &q, &k, &v, scale)?
        };
        let output = out.output.to_host()?;
        assert_eq!(output.shape(), &[batch, heads, dv]);
        if check {
            let what = format!("flash_decode (fused {fused}) on rank {me} of {n}");
            close(&what, output.as_slice(), &want, d + 2);
        }
    }
    Ok(())
}

/// Expert-parallel dispatch and combine, fused and unfused, against f64: 5 experts over the
/// ranks (some hold none in a world of more than 5), top-2, uneven token counts (the last rank
/// none), the experts doubling their rows.
fn moe_case<T: Element>(rank: &Rank<'_>, check: bool) -> Result<()> {
    use dist_tensor::tensor::{DROPPED, Router, route};
    let (me, n) = (rank.rank(), rank.num_ranks());
    let (experts, hidden) = (5, 4);
    let x = random::<T>(rows_of(me, n), hidden, seed(me, 41));
    let logits = random::<T>(rows_of(me, n), experts, seed(me, 42));
    let routed = route(&logits, &Router::softmax_top_k(2))?;
    let mut want = vec![0.0; rows_of(me, n) * hidden];
    for slot in (0..routed.expert.len()).filter(|&s| routed.expert[s] != DROPPED) {
        let (t, w) = (slot / 2, routed.weight.as_slice()[slot].to_f64());
        for j in 0..hidden {
            want[t * hidden + j] += w * 2.0 * x.as_slice()[t * hidden + j].to_f64();
        }
    }
    let mut outs = Vec::new();
    for fused in [true, false] {
        let got = if fused {
            fused::moe_dispatch(rank, &x, &routed)?
        } else {
            fused::moe_dispatch_unfused(rank, &x, &routed)?
        };
        let y = &got.rows * T::from_f64(2.0);
        let out = if fused {
            fused::moe_combine(rank, &y, &got, &routed.weight)?
        } else {
            fused::moe_combine_unfused(rank, &y, &got, &routed.weight)?
        };
        if check {
            close(&format!("moe (fused {fused}) on rank {me} of {n}"), out.as_slice(), &want, 3);
        }
        outs.push((got, out));
    }
    assert_eq!(outs[0], outs[1], "moe: fused and unfused differ on rank {me}");
    // The whole MLP in one kernel against its baseline: this rank's experts of width 3.
    let local = dist_tensor::tensor::array_split(experts, n)[me];
    let gate_up = Tensor::<T>::random(&[local, hidden, 6], seed(me, 43));
    let down = Tensor::<T>::random(&[local, 3, hidden], seed(me, 44));
    let one = fused::moe_experts(rank, &x, &routed, &gate_up, &down)?;
    let base = fused::moe_experts_unfused(rank, &x, &routed, &gate_up, &down)?;
    if check {
        let what = format!("moe_experts on rank {me} of {n}");
        close(&what, one.as_slice(), &f64s(base.as_slice()), 3 * hidden);
    }
    Ok(())
}

/// Every case in every dtype the world's backend has.
fn suite(rank: &Rank<'_>, check: bool) -> Result<()> {
    let device = rank.device();
    let has = |dtype| capability::dtype_problem(Op::AllGatherMatmul, device, dtype).is_none();
    every_op::<f32>(rank, check)?;
    if has(DType::F64) {
        every_op::<f64>(rank, check)?;
    }
    every_op::<f16>(rank, check)?;
    every_op::<bf16>(rank, check)
}

// ---- the worlds -------------------------------------------------------------------------------

/// One test per kind of world for `$case` (a `fn(&Rank, bool) -> Result<()>`), as candle's
/// `test_device!`.
macro_rules! test_worlds {
    ($case:ident, $threads:ident, $processes:ident, $mpi:ident, $cuda:ident, $ascend:ident) => {
        #[test]
        fn $threads() {
            for n in [1, 2, 3] {
                World::threads(n).unwrap().run(|rank| $case(rank, true)).unwrap();
            }
        }

        #[test]
        fn $processes() {
            processes(stringify!($processes), 3, |rank| $case(rank, true));
        }

        #[cfg(feature = "mpi")]
        #[test]
        fn $mpi() {
            mpi_fake_nodes(stringify!($mpi), 3, |rank| $case(rank, true));
        }

        #[test]
        fn $cuda() {
            // Worlds of one rank per GPU, as many GPUs as there are (at most 2); skipped,
            // saying why, without a GPU or a build with feature `cuda`. (Ranks sharing a GPU:
            // `suite_cuda_ranks_sharing_one_gpu`.)
            for world in cuda_worlds(stringify!($cuda), false) {
                world.run(|rank| $case(rank, true)).unwrap();
            }
        }

        #[test]
        fn $ascend() {
            // The executing stand-in runs the Ascend C kernels on the CPU: values are checked.
            if let Some(reason) = cann_stand_in::no_cxx_compiler() {
                return println!("SKIPPED: {reason}");
            }
            for n in [1, 2, 3] {
                let (_serial, world) = ascend_stand_in(n);
                world.run(|rank| $case(rank, true)).unwrap();
            }
        }
    };
}

test_worlds!(
    suite,
    suite_threads,
    suite_processes,
    suite_mpi_fake_nodes,
    suite_cuda,
    suite_ascend_stand_in
);

/// The suite in CUDA worlds of 2 and 3 ranks sharing GPU 0 (every path unchanged on one GPU).
/// These ranks share the GPU's one context, which is how lazy kernel loading deadlocked them
/// (see `driver::init`): this test hung on every H200 run until kernels were loaded eagerly.
#[test]
fn suite_cuda_ranks_sharing_one_gpu() {
    for world in cuda_worlds("suite_cuda_ranks_sharing_one_gpu", true) {
        world.run(|rank| suite(rank, true)).unwrap();
    }
}

/// CUDA worlds: without `sharing`, of 1 and (with two GPUs or more) 2 GPUs, one rank each; with
/// it, of 2 and 3 ranks all on GPU 0. None, after printing why, on a machine without a GPU or
/// in a build without feature `cuda`. Each world is made when the one before it is gone, so
/// that only one holds GPU memory.
fn cuda_worlds(test: &str, sharing: bool) -> impl Iterator<Item = World> + '_ {
    let sizes = match dist_tensor::device::cuda::device_count() {
        Ok(0) => {
            println!("SKIPPED {test}: no GPU on this machine");
            vec![]
        }
        Ok(_) if sharing => vec![2, 3],
        Ok(count) => (1..=count.min(2)).collect(),
        Err(e) => {
            println!("SKIPPED {test}: {e}");
            vec![]
        }
    };
    sizes.into_iter().map(move |n| {
        let devices: Vec<usize> = (0..n).map(|r| if sharing { 0 } else { r }).collect();
        World::builder(n)
            .cuda(&devices)
            .wait_timeout(Duration::from_secs(30))
            .build()
            .unwrap_or_else(|e| panic!("{test}: World::cuda({devices:?}): {e}"))
    })
}

/// In a child of the job: joins it and runs `body` as its rank, printing `OK` or the error. In
/// the test: starts `n` ranks of this test as processes and checks that each printed `OK`.
fn processes(name: &str, n: usize, body: impl Fn(&Rank<'_>) -> Result<()> + Sync) {
    if World::launched() {
        match World::from_env().and_then(|world| world.run(&body)) {
            Ok(_) => println!("SUITE OK"),
            Err(e) => println!("SUITE ERROR {e}"),
        }
        return;
    }
    let exits = World::local_job(n)
        .args([name, "--exact", "--nocapture", "--test-threads=1", "-q"])
        .timeout(Duration::from_secs(240))
        .run()
        .unwrap();
    for exit in &exits {
        let out = exit.stdout_text();
        assert!(
            exit.success() && out.lines().any(|l| l == "SUITE OK"),
            "rank {}: {}\n{out}\n{}",
            exit.rank,
            exit.describe(),
            exit.stderr_text()
        );
    }
}

/// As [`processes`], under mpirun with every process its own node (TCP between them).
#[cfg(feature = "mpi")]
fn mpi_fake_nodes(name: &str, n: usize, body: impl Fn(&Rank<'_>) -> Result<()> + Sync) {
    use dist_tensor::shmem::job_env::RANKS_PER_NODE_ENV;
    if std::env::var("OMPI_COMM_WORLD_RANK").is_ok() {
        match World::from_env().and_then(|world| world.run(&body)) {
            Ok(_) => println!("SUITE OK"),
            Err(e) => println!("SUITE ERROR {e}"),
        }
        return;
    }
    // Each rank's stdout in its own file (mpirun's `--output-filename`): on the shared stdout
    // the ranks' lines can interleave mid-line ("SUITE OK" glued to another rank's ".").
    let files = std::env::temp_dir().join(format!("dt-suite-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&files);
    let out = std::process::Command::new("mpirun")
        .args(["--allow-run-as-root", "--oversubscribe", "-np", &n.to_string()])
        .arg("--output-filename")
        .arg(&files)
        .args(["--mca", "btl", "self,tcp", "-x", &format!("{RANKS_PER_NODE_ENV}=1")])
        .arg(std::env::current_exe().unwrap())
        .args([name, "--exact", "--nocapture", "--test-threads=1", "-q"])
        .output()
        .expect("mpirun (the mpi feature's tests need OpenMPI's mpirun)");
    let ranks: Vec<String> = (0..n)
        .map(|r| {
            std::fs::read_to_string(files.join(format!("1/rank.{r}/stdout"))).unwrap_or_default()
        })
        .collect();
    let _ = std::fs::remove_dir_all(&files);
    let not_ok: Vec<usize> =
        (0..n).filter(|&r| !ranks[r].lines().any(|l| l == "SUITE OK")).collect();
    assert!(
        out.status.success() && not_ok.is_empty(),
        "ranks {not_ok:?} of {n} not ok ({}):\n{}\n{}",
        out.status,
        ranks.join("\n"),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// An Ascend world of `n` NPUs on the stand-in CANN (one per test binary, built once), and the
/// lock that keeps its tests one at a time (the stand-in is process-wide state).
fn ascend_stand_in(n: u32) -> (std::sync::MutexGuard<'static, ()>, World) {
    let guard = ascend_serial();
    (guard, ascend_world(n))
}

/// The lock that keeps the stand-in's users one at a time.
fn ascend_serial() -> std::sync::MutexGuard<'static, ()> {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    SERIAL.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// An Ascend world of `n` NPUs on the stand-in CANN (the caller holds [`ascend_serial`]).
fn ascend_world(n: u32) -> World {
    static STAND_IN: std::sync::OnceLock<cann_stand_in::CannStandIn> = std::sync::OnceLock::new();
    // The executing stand-in: it compiles each kernel for the CPU once (cached by source and
    // options across test binaries, with tests/ascend_run.rs) and runs it.
    let cann = STAND_IN.get_or_init(|| {
        cann_stand_in::CannStandIn::build_executing(&cann_stand_in::scratch_dir("op_suite"))
    });
    cann.acl.reset();
    cann.acl.set_device_count(8);
    // Few cores (4 AI cores of 2 vector sub-cores): the kernels run one thread per core.
    cann.acl.set_cores(4, 8);
    cann.shmem_process_global(false);
    // SAFETY: the stand-in exports the AscendCL symbols with the headers' C signatures.
    let runtime = unsafe { Ascend::open_path(&cann.acl.path) }.unwrap();
    let devices: Vec<u32> = (0..n).collect();
    AscendWorldBuilder::new(&devices)
        .runtime(runtime)
        .heap_bytes(16 << 20)
        .wait_timeout(Duration::from_secs(10))
        .build()
        .unwrap()
}

// ---- the capability table against the code ---------------------------------------------------

/// Runs `op` (a name of the table) once in `T`; `Ok` when it ran (values checked where `check`).
fn run_cell<T: Element>(rank: &Rank<'_>, op: Op, check: bool) -> Result<()> {
    match op {
        Op::AllGatherMatmul => all_gather_matmul::<T>(rank, check),
        Op::MatmulReduceScatter => matmul_reduce_scatter::<T>(rank, check),
        Op::AllToAll => all_to_all::<T>(rank, check),
        Op::FlashDecode => flash_decode_case::<T>(rank, check),
        Op::MoeDispatch | Op::MoeCombine => moe_case::<T>(rank, check),
        Op::AllGather => all_gather_case::<T>(rank, check),
        Op::ReduceScatter => reduce_scatter_case::<T>(rank, check),
        Op::AllReduce => all_reduce_case::<T>(rank, check),
        Op::AllToAllV => all_to_all_v_case::<T>(rank, check),
        Op::Broadcast => broadcast_case::<T>(rank, check),
        Op::RedistributeSplit => redistribute_split_case::<T>(rank, check, false),
        other => panic!("the capability table names {other}, which has no case here"),
    }
}

/// One cell, in a world of its own (a refusal fails its world, and a failed world stays failed):
/// it runs and matches f64 where the table says it runs; where the table refuses it, every rank
/// fails with the table's reason as [`Error::InvalidArgument`] (the element type travels in the
/// agreement exchange, so that every rank fails together).
fn cell<T: Element>(world: World, backend: Device, op: Op, check: bool) {
    let promised = capability::refusal(op, backend, T::DTYPE, &[]);
    // moe_combine takes a dispatch's plan: where the dispatch is refused, the combine is never
    // reached, and the dispatch's refusal is the one a caller sees.
    let promised = match op {
        Op::MoeCombine => capability::refusal(Op::MoeDispatch, backend, T::DTYPE, &[]).or(promised),
        _ => promised,
    };
    let outcome = world.run(|rank| run_cell::<T>(rank, op, check));
    match (promised, outcome) {
        (None, Ok(_)) => {}
        (None, Err(e)) => panic!("{op} {backend} {}: the table says it runs; {e}", T::DTYPE),
        (Some(why), Ok(_)) => {
            panic!("{op} {backend} {}: the table refuses it ({why}), but it ran", T::DTYPE)
        }
        (Some(why), Err(e)) => {
            let e = e.rank_error().clone();
            match &e {
                Error::InvalidArgument { reason, .. } => {
                    assert!(reason.contains(&why), "{op} {backend} {}: {e} is not {why}", T::DTYPE)
                }
                other => panic!("{op} {backend} {}: {other}, not the table's {why}", T::DTYPE),
            }
        }
    }
}

/// Every (op, dtype) cell of `backend`'s column, the ops as the table lists them.
/// `split_world` makes the world of the uneven re-split's cell, which needs two ranks or more
/// (in a world of one rank every split is the even one).
fn column(
    world: &dyn Fn() -> World,
    split_world: &dyn Fn() -> World,
    backend: Device,
    check: bool,
) {
    for op in Op::ALL {
        cell::<f32>(world(), backend, op, check);
        cell::<f64>(world(), backend, op, check);
        cell::<f16>(world(), backend, op, check);
        cell::<bf16>(world(), backend, op, check);
    }
    feature_column(split_world, backend, check);
}

/// One (op, feature) cell's call in f32, with the feature asked for and its values checked
/// against f64: an N-D input (a leading dimension of 1), a weight read transposed (stored
/// `[N, K]`, passed as its transposed view), the gathered input kept.
fn run_feature_cell(rank: &Rank<'_>, op: Op, feature: Feature, check: bool) -> Result<()> {
    let (me, n) = (rank.rank(), rank.num_ranks());
    let (k, c) = (7, 5);
    match op {
        Op::AllGatherMatmul => {
            let x = random::<f32>(rows_of(me, n), k, seed(me, 1));
            let w = random::<f32>(k, c, 21);
            let w_t = w.transpose(0, 1)?;
            let (wv, wtv) = (w.view2("w")?, w_t.view2("w_t")?);
            let out = match feature {
                Feature::NdInput => {
                    let x3 = x.reshape(&[1, rows_of(me, n), k])?;
                    fused::all_gather_matmul(rank, &x3, &[wv])?
                }
                Feature::TransposedWeight => {
                    fused::all_gather_matmul(rank, x.view2("x")?, &[wtv.t()])?
                }
                Feature::KeptInput => {
                    fused::all_gather_matmul_keep_input(rank, x.view2("x")?, &[wv])?
                }
                other => panic!("{op} cannot be asked for {other:?}"),
            };
            let all: Vec<f64> = (0..n)
                .flat_map(|r| f64s(random::<f32>(rows_of(r, n), k, seed(r, 1)).as_slice()))
                .collect();
            let m = all.len() / k;
            if feature == Feature::KeptInput {
                let kept = out.gathered.as_ref().expect("the gathered input, asked for");
                close("kept input", &kept.iter().copied().collect::<Vec<_>>(), &all, 1);
            }
            if check {
                let want = matmul_f64(&all, &f64s(w.as_slice()), m, k, c);
                let got: Vec<f32> = out.outputs[0].iter().copied().collect();
                close(&format!("{op} with {feature:?}"), &got, &want, k);
            }
        }
        Op::MatmulReduceScatter => {
            let m = 5;
            let k_of = |r: usize| r + 2;
            let x = random::<f32>(m, k_of(me), seed(me, 2));
            let w = random::<f32>(k_of(me), c, seed(me, 3));
            let w_t = w.transpose(0, 1)?;
            let out = match feature {
                Feature::NdInput => {
                    let x3 = x.reshape(&[1, m, k_of(me)])?;
                    fused::matmul_reduce_scatter(rank, &x3, w.view2("w")?)?
                }
                Feature::TransposedWeight => {
                    fused::matmul_reduce_scatter(rank, x.view2("x")?, w_t.view2("w_t")?.t())?
                }
                other => panic!("{op} cannot be asked for {other:?}"),
            };
            if check {
                let mut sum = vec![0.0; m * c];
                for r in 0..n {
                    let xr = f64s(random::<f32>(m, k_of(r), seed(r, 2)).as_slice());
                    let wr = f64s(random::<f32>(k_of(r), c, seed(r, 3)).as_slice());
                    for (s, p) in sum.iter_mut().zip(matmul_f64(&xr, &wr, m, k_of(r), c)) {
                        *s += p;
                    }
                }
                let mine = dist_tensor::tensor::array_split(m, n);
                let start: usize = mine[..me].iter().sum();
                let got: Vec<f32> = out.iter().copied().collect();
                close(
                    &format!("{op} with {feature:?}"),
                    &got,
                    &sum[start * c..(start + mine[me]) * c],
                    n * (n + 1),
                );
            }
        }
        Op::RedistributeSplit => redistribute_split_case::<f32>(rank, check, true)?,
        other => panic!("{other} takes no feature"),
    }
    Ok(())
}

/// Every (op, feature) cell of `backend`'s column, in a world of two ranks or more (`world`):
/// it runs and matches f64 where the table has the feature, and is refused before any exchange,
/// as [`Error::DeviceUnavailable`] with the table's reason, where it has not.
fn feature_column(world: &dyn Fn() -> World, backend: Device, check: bool) {
    for op in Op::ALL {
        for &feature in op.features() {
            let promised = capability::refusal(op, backend, DType::F32, &[feature]);
            let outcome = world().run(|rank| run_feature_cell(rank, op, feature, check));
            match (promised, outcome) {
                (None, outcome) => {
                    outcome.unwrap_or_else(|e| panic!("{op} {backend} {feature:?}: {e}"));
                }
                (Some(why), Ok(_)) => {
                    panic!("{op} {backend} {feature:?}: refused ({why}), but ran")
                }
                (Some(why), Err(e)) => {
                    let e = e.rank_error().clone();
                    assert!(
                        matches!(&e, Error::DeviceUnavailable { reason, .. } if *reason == why),
                        "{op} {backend} {feature:?}: {e} is not the table's {why}"
                    );
                }
            }
        }
    }
}

#[test]
fn every_cell_of_the_capability_table_runs_or_gives_its_typed_error() {
    let threads = || World::threads(3).unwrap();
    column(&threads, &threads, Device::Host, true);
    match cann_stand_in::no_cxx_compiler() {
        // The stand-in's kernels compile with the host C++ compiler.
        Some(reason) => println!("SKIPPED the Ascend column: {reason}"),
        None => {
            let _serial = ascend_serial();
            column(&|| ascend_world(2), &|| ascend_world(2), Device::Ascend(0), true);
        }
    }
    match World::cuda(&[0]) {
        // The uneven re-split's cell on two ranks sharing GPU 0 (or on two GPUs).
        Ok(_) => column(
            &|| World::cuda(&[0]).unwrap(),
            &|| World::cuda(&[0, 1 % dist_tensor::device::cuda::device_count().unwrap()]).unwrap(),
            Device::Cuda(0),
            true,
        ),
        Err(e) => println!("SKIPPED the CUDA column: {e}"),
    }
    // A feature the table refuses is refused before any exchange, typed.
    let (_serial, world) = ascend_stand_in(2);
    let err = world
        .run(|rank| {
            let x = random::<f32>(2, 3, 1);
            fused::all_gather_matmul_keep_input(rank, x.view2("x")?, &[x.view2("w")?.t()])
        })
        .unwrap_err()
        .rank_error()
        .clone();
    assert!(matches!(err, Error::DeviceUnavailable { op: "all_gather_matmul", .. }), "{err}");
    assert!(err.to_string().contains("keep_input"), "{err}");
}
