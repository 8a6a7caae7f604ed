//! The Ascend C kernels RUN, on the CPU, through `World::ascend` over the executing stand-in CANN
//! (`tests/cann_stand_in/`, built with `-DSTANDIN_EXECUTE`): the backend compiles each kernel
//! source with `aclrtc` (here the host C++ compiler against `ascendc_cpu/`, a CPU implementation
//! of the Ascend C subset the kernels use), loads it on every device and launches it, and the
//! stand-in runs it on one thread per core with the device's core counts, its copies and vector
//! ops queued per pipe until the kernel synchronises, its bounds and communication rules checked.
//! Every result is checked against an f64 host reference (and, where the host kernel sums in the
//! same order, against the host kernel's bits).
//!
//! What this proves: the kernels' logic, indexing, masks, pipe synchronisation, signal counts and
//! the host code around them. What it does not: CANN's compiler, the NPU's timing, the cube
//! unit's exact rounding, hardware memory ordering. Nothing here has run on an NPU.
//!
//! One stand-in per test binary, shared by the tests, which run one at a time.
#![cfg(target_os = "linux")]

mod cann_stand_in;

use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use cann_stand_in::CannStandIn;
use dist_tensor::collectives::ReduceOp;
use dist_tensor::device::ascend::{Ascend, AscendWorldBuilder, PathTaken, last_path};
use dist_tensor::ndarray::{Array2, ArrayD, Axis, Slice, concatenate};
use dist_tensor::{Element, Error, Result, Tensor, World, collectives, fused};
use half::{bf16, f16};

static SERIAL: Mutex<()> = Mutex::new(());
static STAND_IN: OnceLock<CannStandIn> = OnceLock::new();

/// The shared executing stand-in, reset, with 8 devices of `ai` AI cores and `sub` vector
/// sub-cores each; held while a test runs. `None`, saying why, where there is no C++ compiler
/// to compile the kernels with.
fn stand_in(ai: i64, sub: i64) -> Option<(MutexGuard<'static, ()>, &'static CannStandIn)> {
    if let Some(reason) = cann_stand_in::no_cxx_compiler() {
        eprintln!("SKIPPED: {reason}");
        return None;
    }
    let guard = SERIAL.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let cann =
        STAND_IN.get_or_init(|| CannStandIn::build_executing(&cann_stand_in::scratch_dir("run")));
    cann.acl.reset();
    cann.acl.set_device_count(8);
    cann.acl.set_cores(ai, ai * sub);
    cann.shmem_process_global(false);
    Some((guard, cann))
}

/// The topologies the worlds of each size run on (AI cores, vector sub-cores each): 20 and 24
/// AI cores, one and two sub-cores, so that a kernel with a core count of its own shows.
fn topology_for(ranks: usize) -> (i64, i64) {
    match ranks {
        1 => (24, 1),
        2 => (20, 2),
        3 => (24, 2),
        4 => (20, 1),
        _ => (20, 2),
    }
}

/// A world of `ranks` NPUs of the stand-in, on the topology [`topology_for`] gives it.
fn npu_world(cann: &CannStandIn, ranks: usize) -> Result<World> {
    let (ai, sub) = topology_for(ranks);
    cann.acl.set_cores(ai, ai * sub);
    world(cann, ranks, Duration::from_secs(20))
}

fn world(cann: &CannStandIn, ranks: usize, timeout: Duration) -> Result<World> {
    let devices: Vec<u32> = (0..ranks as u32).collect();
    // SAFETY: the stand-in exports the AscendCL symbols with the headers' C signatures.
    let runtime = unsafe { Ascend::open_path(&cann.acl.path) }?;
    AscendWorldBuilder::new(&devices)
        .runtime(runtime)
        .heap_bytes(16 << 20)
        .wait_timeout(timeout)
        .build()
}

/// Seeded values of every magnitude sign, exact in every element type (multiples of 1/64 below
/// 4), so that copies and sums can be compared bit for bit.
fn values<T: Element>(len: usize, seed: u64) -> Vec<T> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15).wrapping_add(1);
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            T::from_f64(((s % 512) as f64 - 256.0) / 64.0)
        })
        .collect()
}

fn bits<T: Element>(v: &[T]) -> Vec<f64> {
    v.iter().map(|x| x.to_f64()).collect()
}

/// The relative precision of `T` (one unit in the last place at 1).
fn eps<T: Element>() -> f64 {
    match std::mem::size_of::<T>() {
        4 => f32::EPSILON as f64,
        _ if std::any::type_name::<T>().contains("bf16") => 1.0 / 128.0,
        _ => 1.0 / 1024.0,
    }
}

/// `got` against the f64 reference `want` (with `scale`, the sum of the magnitudes each entry
/// adds up): within one rounding to `T` plus f32 accumulation over `terms` terms.
fn assert_close<T: Element>(got: &[T], want: &[f64], scale: &[f64], terms: usize, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, ((g, w), s)) in got.iter().zip(want).zip(scale).enumerate() {
        let tol = eps::<T>() * w.abs() + (terms as f64 + 2.0) * f32::EPSILON as f64 * s + 1e-30;
        assert!(
            (g.to_f64() - w).abs() <= tol,
            "{what}: element {i}: {} against {w} (tol {tol})",
            g.to_f64()
        );
    }
}

fn type_name<T>() -> &'static str {
    std::any::type_name::<T>().rsplit("::").next().unwrap_or("?")
}

/// Every case of one kernel in every element type.
macro_rules! every_type {
    ($f:ident, $($arg:expr),*) => {{
        $f::<f32>($($arg),*)?;
        $f::<f16>($($arg),*)?;
        $f::<bf16>($($arg),*)?;
    }};
}

mod ascend {
    use super::*;

    fn all_gather_case<T: Element>(world: &World, rows: usize, cols: &[usize]) -> Result<()> {
        let n = world.num_ranks();
        let inputs: Vec<Vec<T>> =
            (0..n).map(|r| values::<T>(rows * cols[r], 100 + r as u64)).collect();
        let total: usize = cols.iter().sum();
        let mut expected = vec![0.0f64; rows * total];
        let mut at = 0;
        for (r, c) in cols.iter().enumerate() {
            for i in 0..rows {
                for j in 0..*c {
                    expected[i * total + at + j] = inputs[r][i * c + j].to_f64();
                }
            }
            at += c;
        }
        for call in 0..2 {
            let outs = world.run(|rank| {
                let out = collectives::all_gather_cols(rank, &inputs[rank.rank()], rows)?;
                assert_eq!(last_path(rank), Some(PathTaken::Kernel("all_gather")));
                Ok(out)
            })?;
            for (r, out) in outs.iter().enumerate() {
                assert_eq!(
                    bits(out),
                    expected,
                    "all_gather {} world {n} rows {rows} cols {cols:?} rank {r} call {call}",
                    type_name::<T>()
                );
            }
        }
        Ok(())
    }

    #[test]
    fn ascend_all_gather_runs_on_the_cpu_stand_in() -> Result<()> {
        let Some((_serial, cann)) = stand_in(20, 2) else { return Ok(()) };
        for n in [1, 2, 3, 4, 8] {
            let world = npu_world(cann, n)?;
            // Ragged widths, an empty shard, one row; and one block wider than a UB tile.
            let cols: Vec<usize> = (0..n).map(|r| [5, 0, 7, 1, 3, 13, 2, 9][r]).collect();
            every_type!(all_gather_case, &world, 3, &cols);
            every_type!(all_gather_case, &world, 1, &cols);
        }
        let world = npu_world(cann, 3)?;
        all_gather_case::<f32>(&world, 2, &[17_000, 3, 40])?;
        all_gather_case::<f16>(&world, 5, &[3, 7_001, 11])?;
        Ok(())
    }

    fn broadcast_case<T: Element>(world: &World, len: usize, root: usize) -> Result<()> {
        let n = world.num_ranks();
        let data = values::<T>(len, 7 + root as u64);
        for call in 0..2 {
            let outs = world.run(|rank| {
                let mine = if rank.rank() == root { data.clone() } else { vec![T::zero(); len] };
                let out = collectives::broadcast(rank, &mine, root)?;
                assert_eq!(last_path(rank), Some(PathTaken::Kernel("broadcast")));
                Ok(out)
            })?;
            for (r, out) in outs.iter().enumerate() {
                assert_eq!(
                    bits(out),
                    bits(&data),
                    "broadcast {} world {n} len {len} root {root} rank {r} call {call}",
                    type_name::<T>()
                );
            }
        }
        Ok(())
    }

    #[test]
    fn ascend_broadcast_runs_on_the_cpu_stand_in() -> Result<()> {
        let Some((_serial, cann)) = stand_in(20, 2) else { return Ok(()) };
        for n in [1, 2, 3, 4, 8] {
            let world = npu_world(cann, n)?;
            every_type!(broadcast_case, &world, 1, n - 1);
            every_type!(broadcast_case, &world, 37, n / 2);
        }
        let world = npu_world(cann, 2)?;
        broadcast_case::<f32>(&world, 40_003, 1)?;
        broadcast_case::<bf16>(&world, 70_001, 0)?;
        Ok(())
    }

    fn all_to_all_v_case<T: Element>(world: &World, seed: usize) -> Result<()> {
        let n = world.num_ranks();
        // send[p][q]: ragged, with zeros, one large piece.
        let send: Vec<Vec<usize>> = (0..n)
            .map(|p| {
                (0..n)
                    .map(|q| {
                        if (p + q + seed).is_multiple_of(4) {
                            0
                        } else {
                            (p * 7 + q * 3 + seed) % 11 + (p == 0 && q + 1 == n) as usize * 20_000
                        }
                    })
                    .collect()
            })
            .collect();
        let inputs: Vec<Vec<T>> =
            (0..n).map(|p| values::<T>(send[p].iter().sum(), 50 + p as u64)).collect();
        let outs = world.run(|rank| {
            let out = collectives::all_to_all_v(rank, &inputs[rank.rank()], &send[rank.rank()])?;
            assert_eq!(last_path(rank), Some(PathTaken::Kernel("all_to_all_v")));
            Ok(out)
        })?;
        for (q, out) in outs.iter().enumerate() {
            let mut want = Vec::new();
            for p in 0..n {
                let start: usize = send[p][..q].iter().sum();
                want.extend(bits(&inputs[p][start..start + send[p][q]]));
            }
            assert_eq!(
                bits(out),
                want,
                "all_to_all_v {} world {n} rank {q} counts {send:?}",
                type_name::<T>()
            );
        }
        Ok(())
    }

    #[test]
    fn ascend_all_to_all_v_runs_on_the_cpu_stand_in() -> Result<()> {
        let Some((_serial, cann)) = stand_in(20, 2) else { return Ok(()) };
        for n in [1, 2, 3, 4, 8] {
            let world = npu_world(cann, n)?;
            every_type!(all_to_all_v_case, &world, 1);
            all_to_all_v_case::<f32>(&world, 2)?;
        }
        Ok(())
    }

    fn reduce_scatter_case<T: Element>(
        world: &World,
        rows: usize,
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()> {
        let n = world.num_ranks();
        let total: usize = counts.iter().sum();
        let inputs: Vec<Vec<T>> =
            (0..n).map(|r| values::<T>(rows * total, 300 + r as u64)).collect();
        let outs = world.run(|rank| {
            let out =
                collectives::reduce_scatter_cols(rank, &inputs[rank.rank()], rows, counts, op)?;
            assert_eq!(last_path(rank), Some(PathTaken::Kernel("reduce_scatter")));
            Ok(out)
        })?;
        // The host kernel adds in the same order (rank order, in f32, rounded once): its bits
        // for the sum. (The mean differs in the last place: the host divides by the ranks, the
        // kernel multiplies by their reciprocal, as vector units do.)
        let host = World::threads(n)?.run(|rank| {
            collectives::reduce_scatter_cols(rank, &inputs[rank.rank()], rows, counts, op)
        })?;
        let mut at = 0;
        for (r, out) in outs.iter().enumerate() {
            let c = counts[r];
            let mut want = vec![0.0; rows * c];
            let mut scale = vec![0.0; rows * c];
            for i in 0..rows {
                for j in 0..c {
                    for input in &inputs {
                        let v = input[i * total + at + j].to_f64();
                        want[i * c + j] += v;
                        scale[i * c + j] += v.abs();
                    }
                    if op == ReduceOp::Mean {
                        want[i * c + j] /= n as f64;
                    }
                }
            }
            let what = format!(
                "reduce_scatter {} {op:?} world {n} rows {rows} counts {counts:?} rank {r}",
                type_name::<T>()
            );
            assert_close(out, &want, &scale, n, &what);
            if op == ReduceOp::Sum {
                assert_eq!(bits(out), bits(&host[r]), "{what}: not the host kernel's bits");
            }
            at += c;
        }
        Ok(())
    }

    #[test]
    fn ascend_reduce_scatter_runs_on_the_cpu_stand_in() -> Result<()> {
        let Some((_serial, cann)) = stand_in(20, 2) else { return Ok(()) };
        for n in [1, 2, 3, 4, 8] {
            let world = npu_world(cann, n)?;
            let counts: Vec<usize> = (0..n).map(|r| [3, 0, 9, 1, 5, 2, 7, 4][r]).collect();
            every_type!(reduce_scatter_case, &world, 3, &counts, ReduceOp::Sum);
            every_type!(reduce_scatter_case, &world, 1, &counts, ReduceOp::Mean);
        }
        let world = npu_world(cann, 3)?;
        reduce_scatter_case::<f32>(&world, 2, &[9_000, 5, 31], ReduceOp::Sum)?;
        reduce_scatter_case::<bf16>(&world, 40, &[700, 3, 1], ReduceOp::Mean)?;
        Ok(())
    }

    fn all_gather_matmul_case<T: Element>(
        world: &World,
        m: &[usize],
        k: usize,
        n_cols: &[usize],
    ) -> Result<()> {
        let n = world.num_ranks();
        let xs: Vec<Vec<T>> = (0..n).map(|r| values::<T>(m[r] * k, 500 + r as u64)).collect();
        let ws: Vec<Vec<T>> = (0..n).map(|r| values::<T>(k * n_cols[r], 600 + r as u64)).collect();
        let outs = world.run(|rank| {
            let r = rank.rank();
            let x = Array2::from_shape_vec((m[r], k), xs[r].clone()).expect("x");
            let w = Array2::from_shape_vec((k, n_cols[r]), ws[r].clone()).expect("w");
            let out = fused::all_gather_matmul(rank, x.view(), &[w.view()])?;
            assert_eq!(last_path(rank), Some(PathTaken::Kernel("all_gather_matmul")));
            assert_eq!(out.row_counts, m);
            Ok(out.outputs.into_iter().next().expect("one product"))
        })?;
        let gathered: Vec<&T> = xs.iter().flatten().collect();
        let rows: usize = m.iter().sum();
        for (r, out) in outs.iter().enumerate() {
            let nc = n_cols[r];
            assert_eq!(out.dim(), (rows, nc));
            let mut want = vec![0.0; rows * nc];
            let mut scale = vec![0.0; rows * nc];
            for i in 0..rows {
                for j in 0..nc {
                    for kk in 0..k {
                        let p = gathered[i * k + kk].to_f64() * ws[r][kk * nc + j].to_f64();
                        want[i * nc + j] += p;
                        scale[i * nc + j] += p.abs();
                    }
                }
            }
            let got: Vec<T> = out.iter().copied().collect();
            let what = format!(
                "all_gather_matmul {} world {n} m {m:?} k {k} n {n_cols:?} rank {r}",
                type_name::<T>()
            );
            assert_close(&got, &want, &scale, k, &what);
        }
        Ok(())
    }

    #[test]
    fn ascend_all_gather_matmul_runs_on_the_cpu_stand_in() -> Result<()> {
        let Some((_serial, cann)) = stand_in(20, 2) else { return Ok(()) };
        for n in [1, 2, 3, 4, 8] {
            let world = npu_world(cann, n)?;
            // Ragged rows (an empty shard, fewer rows than ranks overall at 8), K and N odd.
            let m: Vec<usize> = (0..n).map(|r| [5, 0, 3, 1, 2, 0, 1, 4][r]).collect();
            let cols: Vec<usize> = (0..n).map(|r| [7, 3, 1, 5, 2, 9, 4, 6][r]).collect();
            every_type!(all_gather_matmul_case, &world, &m, 19, &cols);
        }
        // Fewer rows than ranks, most shards empty.
        {
            let world = npu_world(cann, 8)?;
            all_gather_matmul_case::<f32>(
                &world,
                &[1, 0, 0, 2, 0, 0, 0, 1],
                5,
                &[3, 1, 2, 4, 1, 2, 3, 1],
            )?;
        } // dropped: one world per device at a time
        // More than one output tile in each direction (128 x 256 tiles), K past a base block.
        let world = npu_world(cann, 2)?;
        all_gather_matmul_case::<f16>(&world, &[131, 2], 70, &[259, 5])?;
        all_gather_matmul_case::<f32>(&world, &[1, 129], 33, &[3, 257])?;
        Ok(())
    }

    fn matmul_reduce_scatter_case<T: Element>(
        world: &World,
        m: usize,
        k: &[usize],
        nc: usize,
    ) -> Result<()> {
        let n = world.num_ranks();
        let xs: Vec<Vec<T>> = (0..n).map(|r| values::<T>(m * k[r], 700 + r as u64)).collect();
        let ws: Vec<Vec<T>> = (0..n).map(|r| values::<T>(k[r] * nc, 800 + r as u64)).collect();
        let outs = world.run(|rank| {
            let r = rank.rank();
            let x = Array2::from_shape_vec((m, k[r]), xs[r].clone()).expect("x");
            let w = Array2::from_shape_vec((k[r], nc), ws[r].clone()).expect("w");
            let out = fused::matmul_reduce_scatter(rank, x.view(), w.view())?;
            assert_eq!(last_path(rank), Some(PathTaken::Kernel("matmul_reduce_scatter")));
            Ok(out)
        })?;
        let mut row = 0;
        for (r, out) in outs.iter().enumerate() {
            let mine = out.nrows();
            assert_eq!(out.ncols(), nc);
            let mut want = vec![0.0; mine * nc];
            let mut scale = vec![0.0; mine * nc];
            for i in 0..mine {
                for j in 0..nc {
                    for s in 0..n {
                        for kk in 0..k[s] {
                            let p =
                                xs[s][(row + i) * k[s] + kk].to_f64() * ws[s][kk * nc + j].to_f64();
                            want[i * nc + j] += p;
                            scale[i * nc + j] += p.abs();
                        }
                    }
                }
            }
            let got: Vec<T> = out.iter().copied().collect();
            let what = format!(
                "matmul_reduce_scatter {} world {n} m {m} k {k:?} n {nc} rank {r}",
                type_name::<T>()
            );
            assert_close(&got, &want, &scale, k.iter().sum::<usize>() + n, &what);
            row += mine;
        }
        assert_eq!(row, m);
        Ok(())
    }

    #[test]
    fn ascend_matmul_reduce_scatter_runs_on_the_cpu_stand_in() -> Result<()> {
        let Some((_serial, cann)) = stand_in(20, 2) else { return Ok(()) };
        for n in [1, 2, 3, 4, 8] {
            let world = npu_world(cann, n)?;
            let k: Vec<usize> = (0..n).map(|r| [7, 1, 13, 4, 9, 2, 5, 3][r]).collect();
            // Rows not a multiple of the ranks, and (at 8) fewer rows than ranks.
            every_type!(matmul_reduce_scatter_case, &world, 11, &k, 5);
            matmul_reduce_scatter_case::<f32>(&world, 3, &k, 2)?;
        }
        let world = npu_world(cann, 2)?;
        matmul_reduce_scatter_case::<bf16>(&world, 261, &[40, 31], 300)?;
        Ok(())
    }

    fn all_to_all_case<T: Element>(
        world: &World,
        shape: &[usize],
        scatter: usize,
        gather: usize,
    ) -> Result<()> {
        let n = world.num_ranks();
        // Rank r's shard: its own (ragged) size along the gather dimension.
        let shards: Vec<Tensor<T>> = (0..n)
            .map(|r| {
                let mut s = shape.to_vec();
                s[gather] += r % 3;
                Tensor::from_shape_vec(&s, values::<T>(s.iter().product(), 900 + r as u64))
            })
            .collect::<Result<_>>()?;
        let outs = world.run(|rank| {
            let out = fused::all_to_all(rank, &shards[rank.rank()], scatter, gather)?;
            assert_eq!(last_path(rank), Some(PathTaken::Kernel("all_to_all")));
            Ok(out)
        })?;
        let views: Vec<_> = shards.iter().map(|t| t.view()).collect();
        let full: ArrayD<T> = concatenate(Axis(gather), &views).expect("the full tensor");
        let mut at = 0;
        for (r, out) in outs.iter().enumerate() {
            let c = out.scatter_counts[r];
            let want = full.slice_axis(Axis(scatter), Slice::from(at..at + c));
            assert_eq!(out.output.shape(), want.shape(), "all_to_all shape rank {r}");
            let want: Vec<T> = want.iter().copied().collect();
            assert_eq!(
                bits(out.output.as_slice()),
                bits(&want),
                "all_to_all {} world {n} shape {shape:?} scatter {scatter} gather {gather} rank {r}",
                type_name::<T>()
            );
            at += c;
        }
        assert_eq!(at, full.shape()[scatter]);
        Ok(())
    }

    #[test]
    fn ascend_all_to_all_runs_on_the_cpu_stand_in() -> Result<()> {
        let Some((_serial, cann)) = stand_in(20, 2) else { return Ok(()) };
        for n in [1, 2, 3, 4, 8] {
            let world = npu_world(cann, n)?;
            // [B, S, H, D] with S and H not divisible by the ranks; scatter H, gather S; and the
            // other way round; and scatter ahead of gather.
            every_type!(all_to_all_case, &world, &[2, 3, 5, 4], 2, 1);
            all_to_all_case::<f32>(&world, &[1, 7, 3, 2], 1, 2)?;
            all_to_all_case::<f16>(&world, &[3, 2, 1], 0, 1)?;
        }
        let world = npu_world(cann, 3)?;
        all_to_all_case::<bf16>(&world, &[1, 4, 7, 1500], 2, 1)?;
        Ok(())
    }

    #[test]
    fn ascend_flash_decode_runs_on_the_cpu_stand_in() -> Result<()> {
        let Some((_serial, cann)) = stand_in(20, 2) else { return Ok(()) };
        // Grouped-query heads (6 on 2 kv heads), d != dv; a chunk is 64 keys at these widths.
        let gqa = DecodeShape { batch: 2, heads: 6, kv_heads: 2, d: 7, dv: 5 };
        for n in [1, 2, 3, 4, 8] {
            let world = npu_world(cann, n)?;
            // Ranks with 0 and 1 keys, primes, 131 keys (three chunks) on rank 0...
            let uneven: Vec<usize> = (0..n).map(|r| [131, 0, 1, 7, 2, 13, 0, 5][r]).collect();
            // ...fewer keys in all than ranks (none at all in a world of one)...
            let few: Vec<usize> = (0..n).map(|r| [0, 1, 0, 2, 0, 1, 0, 0][r]).collect();
            let few = if n == 3 { vec![1, 0, 1] } else { few };
            assert!(few.iter().sum::<usize>() < n);
            every_type!(flash_decode_case, &world, gqa, &uneven);
            every_type!(flash_decode_case, &world, gqa, &few);
            // ...and 67 keys (two chunks) on rank 1, one query head per kv head, d > dv.
            let mha = DecodeShape { batch: 1, heads: 4, kv_heads: 4, d: 9, dv: 16 };
            let keys: Vec<usize> = (0..n).map(|r| [2, 67, 0, 11, 1, 0, 29, 17][r]).collect();
            flash_decode_case::<f32>(&world, mha, &keys)?;
        }
        // Wide rows: the chunk the unified buffer takes is under 64 keys (41 here), so that
        // rank 0's 80 keys are two chunks and rank 2's 41 one.
        let world = npu_world(cann, 3)?;
        let wide = DecodeShape { batch: 1, heads: 2, kv_heads: 1, d: 256, dv: 200 };
        flash_decode_case::<f16>(&world, wide, &[80, 0, 41])?;
        flash_decode_case::<bf16>(&world, wide, &[43, 1, 0])?;
        Ok(())
    }
}

/// The shapes of a flash-decode case: `q` `[batch, heads, d]`, rank `r`'s keys
/// `[batch, keys[r], kv_heads, d]` and values `[batch, keys[r], kv_heads, dv]`.
#[derive(Debug, Clone, Copy)]
struct DecodeShape {
    batch: usize,
    heads: usize,
    kv_heads: usize,
    d: usize,
    dv: usize,
}

/// flash_decode's inputs, seeded (values a quarter of [`values`]', still exact in every type):
/// `q`, then every rank's keys and values.
type DecodeInputs<T> = (Tensor<T>, Vec<Tensor<T>>, Vec<Tensor<T>>);

fn decode_inputs<T: Element>(s: DecodeShape, keys: &[usize]) -> Result<DecodeInputs<T>> {
    let quarter = |len: usize, seed: u64| -> Vec<T> {
        values::<T>(len, seed).into_iter().map(|x| T::from_f64(x.to_f64() / 4.0)).collect()
    };
    let q =
        Tensor::from_shape_vec(&[s.batch, s.heads, s.d], quarter(s.batch * s.heads * s.d, 500))?;
    let mut ks = Vec::new();
    let mut vs = Vec::new();
    for (r, &n) in keys.iter().enumerate() {
        let (kl, vl) = (s.batch * n * s.kv_heads * s.d, s.batch * n * s.kv_heads * s.dv);
        ks.push(Tensor::from_shape_vec(
            &[s.batch, n, s.kv_heads, s.d],
            quarter(kl, 510 + r as u64),
        )?);
        vs.push(Tensor::from_shape_vec(
            &[s.batch, n, s.kv_heads, s.dv],
            quarter(vl, 530 + r as u64),
        )?);
    }
    Ok((q, ks, vs))
}

/// Attention over every rank's keys in f64, from the same inputs: `[batch, heads, dv]` and the
/// log-sum-exp `[batch, heads]` (zeros and minus infinity where no rank has keys).
fn decode_reference<T: Element>(
    s: DecodeShape,
    keys: &[usize],
    (q, ks, vs): &DecodeInputs<T>,
    scale: f64,
) -> (Vec<f64>, Vec<f64>) {
    let (q, group) = (bits(q.as_slice()), s.heads / s.kv_heads);
    let (ks, vs): (Vec<Vec<f64>>, Vec<Vec<f64>>) = (
        ks.iter().map(|k| bits(k.as_slice())).collect(),
        vs.iter().map(|v| bits(v.as_slice())).collect(),
    );
    let mut out = vec![0.0; s.batch * s.heads * s.dv];
    let mut lse = vec![f64::NEG_INFINITY; s.batch * s.heads];
    for b in 0..s.batch {
        for h in 0..s.heads {
            let row = b * s.heads + h;
            let query = &q[row * s.d..][..s.d];
            let (mut scores, mut values) = (Vec::new(), Vec::new());
            for (r, &n) in keys.iter().enumerate() {
                for j in 0..n {
                    let at = (b * n + j) * s.kv_heads + h / group;
                    let key = &ks[r][at * s.d..][..s.d];
                    scores.push(scale * query.iter().zip(key).map(|(a, k)| a * k).sum::<f64>());
                    values.push(&vs[r][at * s.dv..][..s.dv]);
                }
            }
            if scores.is_empty() {
                continue;
            }
            let top = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let weights: Vec<f64> = scores.iter().map(|x| (x - top).exp()).collect();
            let sum: f64 = weights.iter().sum();
            for (w, value) in weights.iter().zip(values) {
                for (o, x) in out[row * s.dv..][..s.dv].iter_mut().zip(value) {
                    *o += w / sum * x;
                }
            }
            lse[row] = top + sum.ln();
        }
    }
    (out, lse)
}

/// The bits of every value, as f64 (so that -0 and 0 differ).
fn exact_bits<T: Element>(v: &[T]) -> Vec<u64> {
    v.iter().map(|x| x.to_f64().to_bits()).collect()
}

/// fused::flash_decode of `T` on `world` (twice: the signal counts carry over between calls):
/// every rank took the kernel and got the same bits, within a rounding to `T` (plus f32
/// accumulation) of the f64 reference.
fn flash_decode_case<T: Element>(world: &World, s: DecodeShape, keys: &[usize]) -> Result<()> {
    let n = world.num_ranks();
    assert_eq!(keys.len(), n);
    let inputs = decode_inputs::<T>(s, keys)?;
    let scale = 1.0 / (s.d as f64).sqrt();
    let (want, want_lse) = decode_reference(s, keys, &inputs, scale);
    let (q, ks, vs) = &inputs;
    // Each output adds up to every key's weighted value row (at most the largest |v|), after a
    // score of d products.
    let terms = keys.iter().sum::<usize>() + s.d;
    let vmax = vs.iter().flat_map(|v| bits(v.as_slice())).fold(0.0f64, |m, x| m.max(x.abs()));
    for call in 0..2 {
        let outs = world.run(|rank| {
            let r = rank.rank();
            let out = fused::flash_decode(rank, q, &ks[r], &vs[r], scale)?;
            assert_eq!(last_path(rank), Some(PathTaken::Kernel("flash_decode")));
            Ok(out)
        })?;
        let what =
            format!("flash_decode {} world {n} {s:?} keys {keys:?} call {call}", type_name::<T>());
        for (r, out) in outs.iter().enumerate() {
            assert_eq!(out.output.shape(), &[s.batch, s.heads, s.dv], "{what}");
            assert_eq!(out.lse.shape(), &[s.batch, s.heads], "{what}");
            let (mine, first) = (out.output.as_slice(), outs[0].output.as_slice());
            assert_eq!(
                exact_bits(mine),
                exact_bits(first),
                "{what}: rank {r}'s output is not rank 0's"
            );
            let (mine, first) = (out.lse.as_slice(), outs[0].lse.as_slice());
            assert_eq!(
                exact_bits(mine),
                exact_bits(first),
                "{what}: rank {r}'s lse is not rank 0's"
            );
        }
        let out = &outs[0];
        assert_close(out.output.as_slice(), &want, &vec![vmax; want.len()], terms, &what);
        for (i, (got, want)) in out.lse.as_slice().iter().zip(&want_lse).enumerate() {
            let got = got.to_f64();
            if want.is_infinite() {
                assert_eq!(got, *want, "{what}: lse {i} (no keys anywhere)");
            } else {
                let tol = (terms as f64 + 2.0) * f32::EPSILON as f64 * (1.0 + want.abs());
                assert!((got - want).abs() <= tol, "{what}: lse {i}: {got} against {want}");
            }
        }
    }
    Ok(())
}

/// The wait timeout of worlds whose kernels are meant to fail (their peers then time out).
const SHORT: Duration = Duration::from_secs(2);

/// The mutations of one negative control, undone when dropped (also when the test fails).
struct Mutated<'a>(&'a CannStandIn);

impl<'a> Mutated<'a> {
    fn new(cann: &'a CannStandIn, kernel: &str, edits: &[(&str, &str)]) -> Mutated<'a> {
        cann.clear_mutations();
        for (from, to) in edits {
            cann.mutate(kernel, from, to);
        }
        Mutated(cann)
    }
}

impl Drop for Mutated<'_> {
    fn drop(&mut self) {
        self.0.clear_mutations();
        self.0.acl.set_launch_stagger(0);
    }
}

/// The failing rank's error of a run that must fail, as text (its message and its fields).
fn failure_text<R: std::fmt::Debug>(run: Result<R>, what: &str) -> String {
    match run {
        Ok(r) => panic!("{what}: the run passed ({r:?})"),
        Err(e) => {
            let inner = e.rank_error();
            format!("{inner} {inner:?}")
        }
    }
}

/// Each rank's first peer reached by the core of block index 0 in the last launches of
/// `kernel`, from the stand-in's log.
fn first_remote(cann: &CannStandIn, kernel: &str, ranks: usize) -> Vec<i64> {
    let log = cann.acl.log();
    (0..ranks)
        .map(|dev| {
            let prefix = format!("standin_first_remote(dev={dev},{kernel},pe=");
            let line = log.iter().rev().find(|l| l.starts_with(&prefix)).expect("a launch");
            line[prefix.len()..].trim_end_matches(')').parse().expect("a PE")
        })
        .collect()
}

/// all_gather of f32 on `world`; whether every rank got the right bits.
fn all_gather_right(world: &World, rows: usize, cols: &[usize], seed: u64) -> Result<bool> {
    let n = world.num_ranks();
    let inputs: Vec<Vec<f32>> =
        (0..n).map(|r| values::<f32>(rows * cols[r], seed + r as u64)).collect();
    let outs = world.run(|rank| collectives::all_gather_cols(rank, &inputs[rank.rank()], rows))?;
    let total: usize = cols.iter().sum();
    let mut at = 0;
    let mut right = true;
    for (r, c) in cols.iter().enumerate() {
        for out in &outs {
            for i in 0..rows {
                right &= out[i * total + at..i * total + at + c] == inputs[r][i * c..(i + 1) * c];
            }
        }
        at += c;
    }
    Ok(right)
}

/// reduce_scatter (sum) of `T` on `world`; whether every rank got the f64 reference's value.
fn reduce_scatter_right<T: Element>(world: &World, rows: usize, counts: &[usize]) -> Result<bool> {
    let n = world.num_ranks();
    let total: usize = counts.iter().sum();
    let inputs: Vec<Vec<T>> = (0..n).map(|r| values::<T>(rows * total, 40 + r as u64)).collect();
    let outs = world.run(|rank| {
        collectives::reduce_scatter_cols(rank, &inputs[rank.rank()], rows, counts, ReduceOp::Sum)
    })?;
    let mut at = 0;
    let mut right = true;
    for (r, out) in outs.iter().enumerate() {
        let c = counts[r];
        for i in 0..rows {
            for j in 0..c {
                let want: f64 = inputs.iter().map(|x| x[i * total + at + j].to_f64()).sum();
                right &= (out[i * c + j].to_f64() - want).abs() <= eps::<T>() * want.abs();
            }
        }
        at += c;
    }
    Ok(right)
}

/// broadcast of f32 from rank 0; whether every rank got the root's bits.
fn broadcast_right(world: &World, len: usize) -> Result<bool> {
    let data = values::<f32>(len, 77);
    let outs = world.run(|rank| {
        let mine = if rank.rank() == 0 { data.clone() } else { Vec::new() };
        collectives::broadcast(rank, &mine, 0)
    })?;
    Ok(outs.iter().all(|o| *o == data))
}

/// flash_decode of f32 (6 query heads on 2 kv heads) on `world`, rank `r` holding `keys[r]`
/// keys; whether every rank got the f64 reference's output and log-sum-exp.
fn flash_decode_right(world: &World, keys: &[usize]) -> Result<bool> {
    let s = DecodeShape { batch: 2, heads: 6, kv_heads: 2, d: 7, dv: 5 };
    let inputs = decode_inputs::<f32>(s, keys)?;
    let (want, want_lse) = decode_reference(s, keys, &inputs, 0.5);
    let (q, ks, vs) = &inputs;
    let outs = world.run(|rank| {
        let r = rank.rank();
        fused::flash_decode(rank, q, &ks[r], &vs[r], 0.5)
    })?;
    let near = |got: &[f32], want: &[f64]| {
        got.iter().zip(want).all(|(&g, &w)| g as f64 == w || (g as f64 - w).abs() <= 1e-4)
    };
    Ok(outs.iter().all(|o| near(o.output.as_slice(), &want) && near(o.lse.as_slice(), &want_lse)))
}

/// all_gather_matmul of f16; the run's outcome.
fn all_gather_matmul_run(world: &World) -> Result<Vec<Array2<f16>>> {
    let n = world.num_ranks();
    world.run(|rank| {
        let r = rank.rank();
        let x =
            Array2::from_shape_vec((3 + r, 9), values::<f16>((3 + r) * 9, r as u64)).expect("x");
        let w = Array2::from_shape_vec((9, 7), values::<f16>(63, 10 + r as u64)).expect("w");
        let out = fused::all_gather_matmul(rank, x.view(), &[w.view()])?;
        assert_eq!(out.row_counts.len(), n);
        Ok(out.outputs.into_iter().next().expect("a product"))
    })
}

/// matmul_reduce_scatter of f32; the run's outcome.
fn matmul_reduce_scatter_run(world: &World) -> Result<Vec<Array2<f32>>> {
    world.run(|rank| {
        let r = rank.rank();
        let x =
            Array2::from_shape_vec((5, 4 + r), values::<f32>(5 * (4 + r), r as u64)).expect("x");
        let w = Array2::from_shape_vec((4 + r, 3), values::<f32>(3 * (4 + r), 9 + r as u64))
            .expect("w");
        fused::matmul_reduce_scatter(rank, x.view(), w.view())
    })
}

/// Negative controls: mutated copies of the kernels, compiled and run through the crate's real
/// path, each of which must fail (a wrong result or a rule failure naming where), next to the
/// same case unmutated, which must pass.
mod ascend_negative {
    use super::*;

    #[test]
    fn ascend_padding_instead_of_a_mask_fails() -> Result<()> {
        let Some((_serial, cann)) = stand_in(20, 2) else { return Ok(()) };
        all_gather_matmul_run(&world(cann, 2, SHORT)?)?;
        let _m = Mutated::new(
            cann,
            "all_gather_matmul",
            &[(
                "const int64_t cols = valid_len(col, block_n, n);",
                "const int64_t cols = block_n;",
            )],
        );
        let text = failure_text(all_gather_matmul_run(&world(cann, 2, SHORT)?), "padded GEMM tile");
        assert!(text.contains("kernel all_gather_matmul, AI core"), "{text}");
        assert!(text.contains("Matmul B read") || text.contains("Matmul C write"), "{text}");
        drop(_m);
        // A collective copying whole chunks at its ragged end: past the device allocation.
        assert!(broadcast_right(&world(cann, 2, SHORT)?, 40_003)?);
        let _m = Mutated::new(
            cann,
            "broadcast",
            &[(
                "copy_2d(out + c.col, c.cols, from + c.col, c.cols, 1, c.cols, ub);",
                "copy_2d(out + c.col, col_step, from + c.col, col_step, 1, col_step, ub);",
            )],
        );
        let text =
            failure_text(broadcast_right(&world(cann, 2, SHORT)?, 40_003), "padded broadcast");
        assert!(text.contains("kernel broadcast, vector core"), "{text}");
        assert!(text.contains("outside every device allocation"), "{text}");
        Ok(())
    }

    #[test]
    fn ascend_no_rank_rotation_is_seen() -> Result<()> {
        let Some((_serial, cann)) = stand_in(20, 2) else { return Ok(()) };
        assert!(all_gather_right(&world(cann, 3, SHORT)?, 2, &[3, 4, 5], 1)?);
        assert_eq!(
            first_remote(cann, "all_gather", 3),
            [1, 2, 0],
            "rotated: rank r first reaches r + 1"
        );
        all_gather_matmul_run(&world(cann, 3, SHORT)?)?;
        assert_eq!(first_remote(cann, "all_gather_matmul", 3), [1, 2, 0]);
        {
            let _m = Mutated::new(
                cann,
                "all_gather",
                &[(
                    "notify_add(ready, me, (me + i) % world, 1);",
                    "notify_add(ready, me, i - 1 < me ? i - 1 : i, 1);",
                )],
            );
            // The result is still right: only the order shows.
            assert!(all_gather_right(&world(cann, 3, SHORT)?, 2, &[3, 4, 5], 1)?);
            assert_eq!(first_remote(cann, "all_gather", 3), [1, 0, 0]);
        }
        let _m = Mutated::new(
            cann,
            "all_gather_matmul",
            &[(
                "const int64_t peer = (me + 1 + task / chunks) % world;",
                "const int64_t peer = task / chunks < me ? task / chunks : task / chunks + 1;",
            )],
        );
        all_gather_matmul_run(&world(cann, 3, SHORT)?)?;
        assert_eq!(first_remote(cann, "all_gather_matmul", 3), [1, 0, 0]);
        Ok(())
    }

    #[test]
    fn ascend_communication_outside_sub_vec_0_fails() -> Result<()> {
        let Some((_serial, cann)) = stand_in(20, 2) else { return Ok(()) };
        {
            let _m = Mutated::new(
                cann,
                "all_gather_matmul",
                &[(
                    "if (world > 1 && push != 0 && sub == 0) {",
                    "if (world > 1 && push != 0 && sub == 1) {",
                )],
            );
            let text =
                failure_text(all_gather_matmul_run(&world(cann, 2, SHORT)?), "put from sub-core 1");
            assert!(text.contains("vector sub-core 1: a SHMEM put"), "{text}");
            assert!(text.contains("communication belongs to vector sub-core 0"), "{text}");
        }
        matmul_reduce_scatter_run(&world(cann, 2, SHORT)?)?;
        let _m =
            Mutated::new(cann, "matmul_reduce_scatter", &[("if (sub != 0) {", "if (sub != 1) {")]);
        let text = failure_text(
            matmul_reduce_scatter_run(&world(cann, 2, SHORT)?),
            "signal from sub-core 1",
        );
        assert!(text.contains("kernel matmul_reduce_scatter, AI core"), "{text}");
        assert!(text.contains("vector sub-core 1: a SHMEM signal to PE"), "{text}");
        Ok(())
    }

    #[test]
    fn ascend_a_hard_coded_core_count_fails() -> Result<()> {
        // 20 AI cores x 2: 40 vector cores, where the mutated kernel assumes a 910B's 48.
        let Some((_serial, cann)) = stand_in(20, 2) else { return Ok(()) };
        let len = 41 * 16384 + 5;
        assert!(broadcast_right(&world(cann, 2, SHORT)?, len)?);
        let _m = Mutated::new(cann, "broadcast", &[("ncore = num_programs()", "ncore = 48")]);
        assert!(
            !broadcast_right(&world(cann, 2, SHORT)?, len)?,
            "48 programs assumed, 40 ran: chunks left out"
        );
        Ok(())
    }

    #[test]
    fn ascend_a_removed_wait_flag_or_pipe_barrier_fails() -> Result<()> {
        let Some((_serial, cann)) = stand_in(24, 2) else { return Ok(()) };
        assert!(all_gather_right(&world(cann, 2, SHORT)?, 3, &[5, 9], 3)?);
        assert!(reduce_scatter_right::<f16>(&world(cann, 2, SHORT)?, 3, &[4, 7])?);
        {
            // The store of a tile before its load has landed in the unified buffer.
            let _m = Mutated::new(
                cann,
                "all_gather",
                &[("AscendC::WaitFlag<AscendC::HardEvent::MTE2_MTE3>(EVENT_ID0);", "")],
            );
            assert!(
                !all_gather_right(&world(cann, 2, SHORT)?, 3, &[5, 9], 3)?,
                "no MTE2 -> MTE3 wait"
            );
        }
        {
            // The next tile's load over a tile not yet stored.
            let _m = Mutated::new(
                cann,
                "all_gather",
                &[("AscendC::WaitFlag<AscendC::HardEvent::MTE3_MTE2>(EVENT_ID0);", "")],
            );
            assert!(
                !all_gather_right(&world(cann, 2, SHORT)?, 300, &[3000, 9], 3)?,
                "no MTE3 -> MTE2 wait"
            );
        }
        {
            // The sum read before the loads it adds.
            let _m = Mutated::new(
                cann,
                "reduce_scatter",
                &[("AscendC::WaitFlag<AscendC::HardEvent::MTE2_V>(EVENT_ID0);", "")],
            );
            assert!(
                !reduce_scatter_right::<f16>(&world(cann, 2, SHORT)?, 3, &[4, 7])?,
                "no MTE2 -> V wait"
            );
        }
        {
            // A widened row added before the Cast that writes it.
            let _m = Mutated::new(
                cann,
                "reduce_scatter",
                &[(
                    "static_cast<int32_t>(cols));\n            AscendC::PipeBarrier<PIPE_V>();\n            AscendC::Add(",
                    "static_cast<int32_t>(cols));\n            AscendC::Add(",
                )],
            );
            assert!(
                !reduce_scatter_right::<f16>(&world(cann, 2, SHORT)?, 3, &[4, 7])?,
                "no PipeBarrier<PIPE_V>"
            );
        }
        Ok(())
    }

    #[test]
    fn ascend_a_missing_wait_before_reading_symmetric_memory_fails() -> Result<()> {
        let Some((_serial, cann)) = stand_in(20, 1) else { return Ok(()) };
        // Rank 1's kernels start 800 ms after rank 0's: rank 0's waits must wait (and a rank 0
        // without them reads rank 1's staging before rank 1 has started).
        cann.acl.set_launch_stagger(800);
        assert!(all_gather_right(&world(cann, 2, Duration::from_secs(5))?, 2, &[6, 5], 11)?);
        let _m = Mutated::new(
            cann,
            "all_gather",
            &[(
                "const Token token = wait_ge(ready, src, static_cast<int32_t>(ready_at), st, program_id_vec(), 0);",
                "const Token token{ready_at >= 0};",
            )],
        );
        cann.acl.set_launch_stagger(800);
        assert!(
            !all_gather_right(&world(cann, 2, Duration::from_secs(5))?, 2, &[6, 5], 12)?,
            "read before the peer published"
        );
        Ok(())
    }

    #[test]
    fn ascend_flash_decode_reading_a_scalar_early_or_dropping_a_source_fails() -> Result<()> {
        let Some((_serial, cann)) = stand_in(20, 2) else { return Ok(()) };
        let keys = [9, 70, 3];
        assert!(flash_decode_right(&world(cann, 3, SHORT)?, &keys)?);
        {
            // The scalar unit reads a head's sum of weights (and the weights) before the vector
            // unit has written them: no V_S flag between them.
            let _m = Mutated::new(
                cann,
                "flash_decode",
                &[(
                    "        AscendC::SetFlag<AscendC::HardEvent::V_S>(EVENT_ID0);\n        AscendC::WaitFlag<AscendC::HardEvent::V_S>(EVENT_ID0);\n        const float sum",
                    "        const float sum",
                )],
            );
            assert!(!flash_decode_right(&world(cann, 3, SHORT)?, &keys)?, "no V_S flag");
        }
        // Rank 0's records left out of the combine.
        let _m = Mutated::new(
            cann,
            "flash_decode",
            &[(
                "for (int64_t src = 0; src < s.world; ++src) {",
                "for (int64_t src = 1; src < s.world; ++src) {",
            )],
        );
        assert!(!flash_decode_right(&world(cann, 3, SHORT)?, &keys)?, "a source dropped");
        Ok(())
    }

    #[test]
    fn ascend_a_matmul_client_without_end_fails() -> Result<()> {
        let Some((_serial, cann)) = stand_in(20, 2) else { return Ok(()) };
        let _m = Mutated::new(
            cann,
            "all_gather_matmul",
            &[("        mm.End();\n        return;", "        return;")],
        );
        let text = failure_text(all_gather_matmul_run(&world(cann, 2, SHORT)?), "no Matmul::End");
        assert!(text.contains("vector sub-core 0: a Matmul was registered"), "{text}");
        Ok(())
    }
}

/// The stand-in's other rules, each a typed error naming where.
mod ascend_rules {
    use super::*;

    #[test]
    fn ascend_a_wait_that_never_completes_times_out_with_its_status_record() -> Result<()> {
        let Some((_serial, cann)) = stand_in(20, 2) else { return Ok(()) };
        let _m = Mutated::new(
            cann,
            "all_gather",
            &[(
                "wait_ge(ready, src, static_cast<int32_t>(ready_at), st,",
                "wait_ge(ready, src, static_cast<int32_t>(ready_at + 1), st,",
            )],
        );
        let run = all_gather_right(&world(cann, 2, Duration::from_millis(500))?, 2, &[3, 4], 5);
        match run.map_err(|e| e.rank_error().clone()) {
            Err(Error::WaitTimeout { signal, awaited, seen, .. }) => {
                // Rank r waits on its peer's `ready`, one more than the peer's programs give.
                assert!(signal <= 1, "signal {signal}");
                assert_eq!(awaited, format!(">= {}", seen + 1), "awaited {awaited}, seen {seen}");
                assert_eq!(seen, 40, "every one of the peer's 40 programs published once");
            }
            other => panic!("expected a wait timeout, got {other:?}"),
        }
        Ok(())
    }

    #[test]
    fn ascend_the_unified_buffer_capacity_is_enforced() -> Result<()> {
        let Some((_serial, cann)) = stand_in(20, 2) else { return Ok(()) };
        cann.acl.set_ub_bytes(128 * 1024);
        let text = failure_text(
            reduce_scatter_right::<f32>(&world(cann, 2, SHORT)?, 2, &[3, 3]),
            "UB overflow",
        );
        cann.acl.set_ub_bytes(192 * 1024);
        assert!(text.contains("kernel reduce_scatter, vector core"), "{text}");
        assert!(
            text.contains("TPipe::InitBuffer of 163840 bytes past the unified buffer"),
            "{text}"
        );
        Ok(())
    }

    #[test]
    fn ascend_a_unified_buffer_access_past_its_buffer_fails() -> Result<()> {
        let Some((_serial, cann)) = stand_in(20, 2) else { return Ok(()) };
        let _m = Mutated::new(
            cann,
            "reduce_scatter",
            &[(
                "pipe.InitBuffer(ub_buf, UB_REDUCE_BYTES);",
                "pipe.InitBuffer(ub_buf, UB_REDUCE_BYTES / 4);",
            )],
        );
        let text = failure_text(
            reduce_scatter_right::<f32>(&world(cann, 2, SHORT)?, 2, &[3, 3]),
            "UB slot",
        );
        assert!(text.contains("kernel reduce_scatter, vector core"), "{text}");
        assert!(text.contains("past its 40960 bytes of unified buffer"), "{text}");
        Ok(())
    }

    #[test]
    fn ascend_a_compile_error_comes_back_with_the_host_compilers_log() -> Result<()> {
        let Some((_serial, cann)) = stand_in(20, 2) else { return Ok(()) };
        let _m = Mutated::new(
            cann,
            "broadcast",
            &[("using namespace dt;", "using namespace dt;\nint broken = undeclared_name;")],
        );
        match broadcast_right(&world(cann, 2, SHORT)?, 9).map_err(|e| e.rank_error().clone()) {
            Err(Error::KernelCompile { kernel, log, .. }) => {
                assert_eq!(kernel, "broadcast");
                assert!(log.contains("undeclared_name") && log.contains("error"), "{log}");
            }
            other => panic!("expected a compile error, got {other:?}"),
        }
        Ok(())
    }
}
