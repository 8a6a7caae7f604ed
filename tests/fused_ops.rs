//! The fused ops of `DistTensor` (`all_gather_matmul`, `all_gather_matmul_many`,
//! `matmul_reduce_scatter`, `all_to_all`) and their unfused baselines, against references
//! computed in f64 from the same inputs (already rounded to the element type).
//!
//! Worlds of 1, 2, 3, 4 and 8 ranks; every element type; shapes with M not divisible by the world,
//! M smaller than the world (ranks with no rows), N or K smaller than the world (ranks with no
//! columns), odd and prime K and N; shards of 256 rows or more (the shard-by-shard path of the fused
//! products); one large f32 case at world 2. Every entry of every result is checked.
//!
//! # Tolerance
//! Inputs are exact in f64, so the reference is the exact product up to f64 rounding. An output
//! entry is a sum of `t` products `a_p b_p` evaluated in the accumulator type (unit roundoff
//! `u_acc = EPSILON_acc / 2`) as some summation tree; whatever the tree, the error is at most
//! `gamma_d * scale` with `d` its depth (`d <= t`), `gamma_d = d u_acc / (1 - d u_acc)` and
//! `scale = sum_p |a_p| |b_p|` (Higham, *Accuracy and Stability of Numerical Algorithms*, 3.1).
//! f16 and bf16 then round once to the element type, adding at most `u_T * scale`. The tests allow
//!
//! ```text
//! |got - want| <= tol * scale,  tol = u_T (half types only) + (t + 1) EPSILON_acc
//! ```
//!
//! with `t = K` for `all_gather_matmul` and `t = K + n` for `matmul_reduce_scatter` (each rank's
//! partial product is a `k_r`-term sum, then `n` partials are added). That is about twice the
//! worst case, and orders of magnitude above typical errors, yet a kernel that drops a block of 32
//! k-terms (or all of a short K), or one rank's whole contribution, is off by about
//! `sqrt(32) / 3` times the size of one term, many times the bound: every case checks that its
//! bound would catch that (`Reference::catches`). For the fused ops of a half type the bound has
//! one `u_T`: the promise is to accumulate in f32 and round once. The unfused
//! `matmul_reduce_scatter` rounds each rank's partial product to the element type before the
//! reduce_scatter (documented on it), so for a half type it gets one more `u_T`; the test
//! `unfused_matmul_reduce_scatter_of_half_types_rounds_twice` pins a case where that shows.
//!
//! Data movement (`all_to_all`, the round trip, the unfused `all_to_all`) must be bitwise exact.

use std::ops::Range;
use std::time::{Duration, Instant};

use dist_tensor::{DistTensor, Element, Error, Placement, Rank, Result, Tensor, World};
use half::{bf16, f16};
use ndarray::{Array2, Axis, Ix2, concatenate, s};

mod common;

use common::{array_split, pieces, slice, tolerance};

const WORLDS: [usize; 5] = [1, 2, 3, 4, 8];

// ---- helpers --------------------------------------------------------------------------------

fn to_f64_2<T: Element>(t: &Tensor<T>) -> Array2<f64> {
    t.view().mapv(|v| v.to_f64()).into_dimensionality::<Ix2>().expect("a 2-D tensor")
}

fn unravel(mut flat: usize, shape: &[usize]) -> Vec<usize> {
    let mut index = vec![0; shape.len()];
    for (i, &d) in shape.iter().enumerate().rev() {
        index[i] = flat % d.max(1);
        flat /= d.max(1);
    }
    index
}

/// `None` when `got` and `want` have the same shape and bits; otherwise what differs.
fn diff<T: Element>(got: &Tensor<T>, want: &Tensor<T>) -> Option<String> {
    if got.shape() != want.shape() {
        return Some(format!("shape {:?}, want {:?}", got.shape(), want.shape()));
    }
    let bad: Vec<usize> = (0..got.len())
        .filter(|&i| got.as_slice()[i].to_f64().to_bits() != want.as_slice()[i].to_f64().to_bits())
        .collect();
    let &first = bad.first()?;
    Some(format!(
        "{} of {} elements differ; first at {:?}: got {}, want {}",
        bad.len(),
        got.len(),
        unravel(first, got.shape()),
        got.as_slice()[first],
        want.as_slice()[first]
    ))
}

/// The block of k-terms a buggy kernel is assumed to drop: 32 around the middle, or all of a
/// short K.
fn dropped_block(k: usize) -> Range<usize> {
    (k / 2).saturating_sub(16)..(k / 2 + 16).min(k)
}

/// An f64 reference for `x @ w`: each entry, its scale `sum |x||w|`, the tolerance, and what
/// losing the k-terms `lost` would cost.
struct Reference {
    want: Array2<f64>,
    scale: Array2<f64>,
    tol: f64,
    lost: Array2<f64>,
}

impl Reference {
    fn new(x: &Array2<f64>, w: &Array2<f64>, terms_tol: f64, lost: Range<usize>) -> Self {
        let want = x.dot(w);
        let scale = x.abs().dot(&w.abs());
        let lost = x.slice(s![.., lost.clone()]).dot(&w.slice(s![lost, ..]));
        Reference { want, scale, tol: terms_tol, lost }
    }

    /// Whether the bound catches a kernel that loses `self.lost` (the test of the test).
    fn catches(&self) -> bool {
        self.lost.iter().zip(&self.scale).any(|(l, s)| l.abs() > self.tol * s)
    }

    /// Compares `got` with the block `rows x cols` of the reference.
    fn check<T: Element>(
        &self,
        got: &Tensor<T>,
        rows: Range<usize>,
        cols: Range<usize>,
        what: &str,
    ) -> Option<String> {
        self.check_tol(self.tol, got, rows, cols, what)
    }

    /// As [`Reference::check`] with another tolerance.
    fn check_tol<T: Element>(
        &self,
        tol: f64,
        got: &Tensor<T>,
        rows: Range<usize>,
        cols: Range<usize>,
        what: &str,
    ) -> Option<String> {
        if got.shape() != [rows.len(), cols.len()] {
            return Some(format!(
                "{what}: shape {:?}, want [{}, {}]",
                got.shape(),
                rows.len(),
                cols.len()
            ));
        }
        let mut bad = 0;
        let mut worst: Option<(f64, usize, usize, f64)> = None;
        for (flat, v) in got.as_slice().iter().enumerate() {
            let (i, j) = (rows.start + flat / cols.len(), cols.start + flat % cols.len());
            let err = (v.to_f64() - self.want[[i, j]]).abs();
            let bound = tol * self.scale[[i, j]];
            if err.is_nan() || err > bound {
                bad += 1;
                let ratio = if bound > 0.0 { err / bound } else { f64::INFINITY };
                if worst.is_none_or(|w| ratio > w.0) {
                    worst = Some((ratio, i, j, v.to_f64()));
                }
            }
        }
        worst.map(|(ratio, i, j, got)| {
            format!(
                "{what}: {bad} of {} entries outside the bound; worst at global ({i}, {j}): got \
                 {got}, want {} (scale {}, bound {:e}, {ratio:.3e} x the bound)",
                rows.len() * cols.len(),
                self.want[[i, j]],
                self.scale[[i, j]],
                tol * self.scale[[i, j]],
            )
        })
    }
}

#[track_caller]
fn assert_no_failures(fails: Vec<Vec<String>>) {
    let fails: Vec<String> = fails.into_iter().flatten().collect();
    assert!(
        fails.is_empty(),
        "{} failures; the first ones:\n{}",
        fails.len(),
        fails.iter().take(25).cloned().collect::<Vec<_>>().join("\n")
    );
}

/// `M` smaller than the world (at least 1).
fn fewer_than(n: usize) -> usize {
    n.saturating_sub(1).max(1)
}

/// Rows per rank from which the fused ops cut their tiles shard by shard (`MIN_SHARD_ROWS` in
/// `src/fused/plan.rs`): below it on any rank, tiles run over all the gathered rows instead.
const SHARD_BY_SHARD_ROWS: usize = 256;

/// `(M, K, N)` for world `n`: all ones; M smaller than the world and N or K smaller than 8; M
/// not divisible by the world; primes spanning several tiles and k-blocks; and shards of 256 and
/// 257 rows, which take the shard-by-shard path of both fused products (the others take the path
/// over all rows), with K = 300 so that all_gather_matmul pushes each shard in two chunks.
fn shapes(n: usize) -> Vec<(usize, usize, usize)> {
    vec![
        (1, 1, 1),
        (fewer_than(n), 3, 7),
        (2 * n + 1, 17, 11),
        (61, 127, 67),
        (67, 263, 131),
        (SHARD_BY_SHARD_ROWS * n + 1, 300, 67),
    ]
}

// ---- all_gather_matmul --------------------------------------------------------------------------

/// Failures of world `n`, described.
fn check_all_gather_matmul<T: Element>(n: usize) -> Vec<String> {
    let world = World::threads(n).unwrap();
    let cases: Vec<_> = shapes(n)
        .into_iter()
        .enumerate()
        .map(|(c, (m, k, nn))| {
            let x = Tensor::<T>::random(&[m, k], 10 * c as u64);
            let w = Tensor::<T>::random(&[k, nn], 10 * c as u64 + 1);
            let reference =
                Reference::new(&to_f64_2(&x), &to_f64_2(&w), tolerance::<T>(k), dropped_block(k));
            assert!(reference.catches(), "{} [{m}, {k}, {nn}]: the bound is too loose", T::DTYPE);
            (x, w, reference)
        })
        .collect();
    let fails = world
        .run(|rank| {
            let r = rank.rank();
            let mut fails = Vec::new();
            for (x, w, reference) in &cases {
                let (m, k, nn) = (x.shape()[0], x.shape()[1], w.shape()[1]);
                let cols = pieces(nn, n)[r].clone();
                let xd = DistTensor::from_local(
                    rank,
                    slice(x, 0, pieces(m, n)[r].clone()),
                    Placement::Shard(0),
                )?;
                let w_r = slice(w, 1, cols.clone());
                for (variant, y) in [
                    ("all_gather_matmul", xd.all_gather_matmul(&w_r)?),
                    ("all_gather_matmul_unfused", xd.all_gather_matmul_unfused(&w_r)?),
                ] {
                    let what = format!(
                        "{variant}, {}, world {n}, rank {r}, [M, K, N] = [{m}, {k}, {nn}]",
                        T::DTYPE
                    );
                    if y.placement() != Placement::Shard(1) {
                        fails.push(format!("{what}: placement {}", y.placement()));
                    }
                    if y.global_shape() != [m, nn] {
                        fails.push(format!("{what}: global_shape {:?}", y.global_shape()));
                    }
                    fails.extend(reference.check(y.local(), 0..m, cols.clone(), &what));
                    let g = y.to_global()?;
                    fails.extend(reference.check(&g, 0..m, 0..nn, &format!("{what}, to_global")));
                }
            }
            Ok(fails)
        })
        .unwrap_or_else(|e| panic!("world {n}, {}: {e}", T::DTYPE));
    fails.into_iter().flatten().collect()
}

#[test]
fn all_gather_matmul_equals_the_reference_f32() {
    assert_no_failures(WORLDS.iter().map(|&n| check_all_gather_matmul::<f32>(n)).collect());
}

#[test]
fn all_gather_matmul_equals_the_reference_f64() {
    assert_no_failures(WORLDS.iter().map(|&n| check_all_gather_matmul::<f64>(n)).collect());
}

#[test]
fn all_gather_matmul_equals_the_reference_f16() {
    assert_no_failures(WORLDS.iter().map(|&n| check_all_gather_matmul::<f16>(n)).collect());
}

#[test]
fn all_gather_matmul_equals_the_reference_bf16() {
    assert_no_failures(WORLDS.iter().map(|&n| check_all_gather_matmul::<bf16>(n)).collect());
}

/// Shard by shard with shards that are not array_split: one rank has no rows (which keeps the
/// shard-by-shard path: empty shards do not count), the others 256 rows or more, ragged; two
/// weights, one narrower than the world.
fn check_all_gather_matmul_uneven_long_shards<T: Element>(n: usize) {
    let world = World::threads(n).unwrap();
    let counts: Vec<usize> = (0..n)
        .map(|r| if r == 1 { 0 } else { SHARD_BY_SHARD_ROWS + [44, 0, 1, 7, 130][r % 5] })
        .collect();
    let offsets = common::offsets(&counts);
    let (m, k, widths) = (offsets[n], 301, [37, 3]);
    let x = Tensor::<T>::random(&[m, k], 41);
    let ws: Vec<Tensor<T>> =
        widths.iter().enumerate().map(|(i, &nn)| Tensor::random(&[k, nn], 42 + i as u64)).collect();
    let refs: Vec<Reference> = ws
        .iter()
        .map(|w| Reference::new(&to_f64_2(&x), &to_f64_2(w), tolerance::<T>(k), dropped_block(k)))
        .collect();
    let fails = world
        .run(|rank| {
            let r = rank.rank();
            let xd = DistTensor::from_local(
                rank,
                slice(&x, 0, offsets[r]..offsets[r + 1]),
                Placement::Shard(0),
            )?;
            let cols: Vec<Range<usize>> =
                widths.iter().map(|&nn| pieces(nn, n)[r].clone()).collect();
            let w_r: Vec<Tensor<T>> =
                ws.iter().zip(&cols).map(|(w, c)| slice(w, 1, c.clone())).collect();
            let mut fails = Vec::new();
            let many = xd.all_gather_matmul_many(&w_r.iter().collect::<Vec<_>>())?;
            for (i, y) in many.iter().enumerate() {
                let what = format!(
                    "all_gather_matmul_many, {}, world {n}, rank {r}, rows per rank {counts:?}, \
                     K = {k}, weight {i} of width {}",
                    T::DTYPE,
                    widths[i]
                );
                fails.extend(refs[i].check(y.local(), 0..m, cols[i].clone(), &what));
            }
            let y = xd.all_gather_matmul_unfused(&w_r[0])?;
            let what = format!("all_gather_matmul_unfused, {}, world {n}, rank {r}", T::DTYPE);
            fails.extend(refs[0].check(y.local(), 0..m, cols[0].clone(), &what));
            Ok(fails)
        })
        .unwrap_or_else(|e| panic!("world {n}, {}: {e}", T::DTYPE));
    assert_no_failures(fails);
}

#[test]
fn all_gather_matmul_shard_by_shard_with_an_empty_shard() {
    for n in [3, 4] {
        check_all_gather_matmul_uneven_long_shards::<f32>(n);
        check_all_gather_matmul_uneven_long_shards::<f16>(n);
        check_all_gather_matmul_uneven_long_shards::<bf16>(n);
    }
    check_all_gather_matmul_uneven_long_shards::<f64>(3);
}

/// Fused QKV: one gather, three products of different widths (the narrow one smaller than a
/// world of 8), each equal to its own reference and to a separate `all_gather_matmul`.
fn check_all_gather_matmul_many<T: Element>(n: usize) {
    let world = World::threads(n).unwrap();
    let widths = [23, 5, 11];
    let cases: Vec<_> = [(2 * n + 1, 37), (fewer_than(n), 13), (61, 130)]
        .into_iter()
        .enumerate()
        .map(|(c, (m, k))| {
            let x = Tensor::<T>::random(&[m, k], 100 + 10 * c as u64);
            let ws: Vec<Tensor<T>> = widths
                .iter()
                .enumerate()
                .map(|(i, &nn)| Tensor::random(&[k, nn], 101 + 10 * c as u64 + i as u64))
                .collect();
            let refs: Vec<Reference> = ws
                .iter()
                .map(|w| {
                    let re = Reference::new(
                        &to_f64_2(&x),
                        &to_f64_2(w),
                        tolerance::<T>(k),
                        dropped_block(k),
                    );
                    assert!(re.catches());
                    re
                })
                .collect();
            (x, ws, refs)
        })
        .collect();
    let fails = world
        .run(|rank| {
            let r = rank.rank();
            let mut fails = Vec::new();
            for (x, ws, refs) in &cases {
                let (m, k) = (x.shape()[0], x.shape()[1]);
                let xd = DistTensor::from_local(
                    rank,
                    slice(x, 0, pieces(m, n)[r].clone()),
                    Placement::Shard(0),
                )?;
                let cols: Vec<Range<usize>> =
                    widths.iter().map(|&nn| pieces(nn, n)[r].clone()).collect();
                let w_r: Vec<Tensor<T>> =
                    ws.iter().zip(&cols).map(|(w, c)| slice(w, 1, c.clone())).collect();
                let w_refs: Vec<&Tensor<T>> = w_r.iter().collect();
                let many = xd.all_gather_matmul_many(&w_refs)?;
                let what = format!(
                    "all_gather_matmul_many, {}, world {n}, rank {r}, [M, K] = [{m}, {k}]",
                    T::DTYPE
                );
                if many.len() != 3 {
                    fails.push(format!("{what}: {} results for 3 weights", many.len()));
                    continue;
                }
                for (i, y) in many.iter().enumerate() {
                    let what = format!("{what}, weight {i} of width {}", widths[i]);
                    if y.placement() != Placement::Shard(1) {
                        fails.push(format!("{what}: placement {}", y.placement()));
                    }
                    if y.global_shape() != [m, widths[i]] {
                        fails.push(format!("{what}: global_shape {:?}", y.global_shape()));
                    }
                    fails.extend(refs[i].check(y.local(), 0..m, cols[i].clone(), &what));
                    let g = y.to_global()?;
                    fails.extend(refs[i].check(
                        &g,
                        0..m,
                        0..widths[i],
                        &format!("{what}, to_global"),
                    ));
                    let single = xd.all_gather_matmul(&w_r[i])?;
                    fails.extend(refs[i].check(
                        single.local(),
                        0..m,
                        cols[i].clone(),
                        &format!("{what}, the separate all_gather_matmul"),
                    ));
                }
            }
            Ok(fails)
        })
        .unwrap_or_else(|e| panic!("world {n}, {}: {e}", T::DTYPE));
    assert_no_failures(fails);
}

#[test]
fn all_gather_matmul_many_equals_separate_products() {
    for n in WORLDS {
        check_all_gather_matmul_many::<f32>(n);
        check_all_gather_matmul_many::<bf16>(n);
    }
    check_all_gather_matmul_many::<f16>(3);
    check_all_gather_matmul_many::<f64>(4);
}

// ---- matmul_reduce_scatter ---------------------------------------------------------------------

/// Both inputs `matmul_reduce_scatter` takes: Shard(1) `[M, k_r]` with `w [k_r, N]` (the
/// column and row pieces of one global product), and Partial `[M, K]` with each rank's own
/// `w_r [K, N]` (the sum of `n` products).
/// Failures of world `n`, described.
fn check_matmul_reduce_scatter<T: Element>(n: usize) -> Vec<String> {
    let world = World::threads(n).unwrap();
    let cases: Vec<_> = shapes(n)
        .into_iter()
        .enumerate()
        .map(|(c, (m, k, nn))| {
            let seed = 1000 + 100 * c as u64;
            let x = Tensor::<T>::random(&[m, k], seed);
            let w = Tensor::<T>::random(&[k, nn], seed + 1);
            let tol = tolerance::<T>(k + n);
            let sharded = Reference::new(&to_f64_2(&x), &to_f64_2(&w), tol, dropped_block(k));
            // Partial: rank r holds x_r and w_r; the sum is [x_0 .. x_n-1] @ [w_0; ..; w_n-1].
            let xs: Vec<Tensor<T>> =
                (0..n).map(|r| Tensor::random(&[m, k], seed + 10 + r as u64)).collect();
            let ws: Vec<Tensor<T>> =
                (0..n).map(|r| Tensor::random(&[k, nn], seed + 50 + r as u64)).collect();
            let xf: Vec<Array2<f64>> = xs.iter().map(to_f64_2).collect();
            let wf: Vec<Array2<f64>> = ws.iter().map(to_f64_2).collect();
            let xcat =
                concatenate(Axis(1), &xf.iter().map(|a| a.view()).collect::<Vec<_>>()).unwrap();
            let wcat =
                concatenate(Axis(0), &wf.iter().map(|a| a.view()).collect::<Vec<_>>()).unwrap();
            // What a bug would lose: the last rank's whole contribution (a k-block for one rank).
            let lost = if n > 1 { (n - 1) * k..n * k } else { dropped_block(k) };
            let partial = Reference::new(&xcat, &wcat, tol, lost);
            assert!(sharded.catches() && partial.catches(), "{} [{m}, {k}, {nn}]", T::DTYPE);
            (x, w, sharded, xs, ws, partial)
        })
        .collect();
    let fails = world
        .run(|rank| {
            let r = rank.rank();
            let mut fails = Vec::new();
            for (x, w, sharded, xs, ws, partial) in &cases {
                let (m, k, nn) = (x.shape()[0], x.shape()[1], w.shape()[1]);
                let ks = pieces(k, n)[r].clone();
                let rows = pieces(m, n)[r].clone();
                let x1 = DistTensor::from_local(rank, slice(x, 1, ks.clone()), Placement::Shard(1))?;
                let w1 = slice(w, 0, ks);
                let xp = DistTensor::from_local(rank, xs[r].clone(), Placement::Partial)?;
                let runs = [
                    ("Shard(1)", "matmul_reduce_scatter", x1.matmul_reduce_scatter(&w1)?, sharded),
                    ("Shard(1)", "matmul_reduce_scatter_unfused", x1.matmul_reduce_scatter_unfused(&w1)?, sharded),
                    ("Partial", "matmul_reduce_scatter", xp.matmul_reduce_scatter(&ws[r])?, partial),
                    ("Partial", "matmul_reduce_scatter_unfused", xp.matmul_reduce_scatter_unfused(&ws[r])?, partial),
                ];
                for (input, variant, y, reference) in runs {
                    let what = format!(
                        "{variant} of {input}, {}, world {n}, rank {r}, [M, K, N] = [{m}, {k}, {nn}]",
                        T::DTYPE
                    );
                    // The unfused baseline rounds each rank's partial product to T before the
                    // reduce_scatter (as documented): for a half type one more u_T * scale.
                    let tol = if variant.ends_with("unfused") {
                        reference.tol + unfused_extra::<T>()
                    } else {
                        reference.tol
                    };
                    if y.placement() != Placement::Shard(0) {
                        fails.push(format!("{what}: placement {}", y.placement()));
                    }
                    if y.global_shape() != [m, nn] {
                        fails.push(format!("{what}: global_shape {:?}", y.global_shape()));
                    }
                    fails.extend(reference.check_tol(tol, y.local(), rows.clone(), 0..nn, &what));
                    let g = y.to_global()?;
                    fails.extend(reference.check_tol(tol, &g, 0..m, 0..nn, &format!("{what}, to_global")));
                }
            }
            Ok(fails)
        })
        .unwrap_or_else(|e| panic!("world {n}, {}: {e}", T::DTYPE));
    fails.into_iter().flatten().collect()
}

#[test]
fn matmul_reduce_scatter_equals_the_reference_f32() {
    assert_no_failures(WORLDS.iter().map(|&n| check_matmul_reduce_scatter::<f32>(n)).collect());
}

#[test]
fn matmul_reduce_scatter_equals_the_reference_f64() {
    assert_no_failures(WORLDS.iter().map(|&n| check_matmul_reduce_scatter::<f64>(n)).collect());
}

#[test]
fn matmul_reduce_scatter_equals_the_reference_f16() {
    assert_no_failures(WORLDS.iter().map(|&n| check_matmul_reduce_scatter::<f16>(n)).collect());
}

#[test]
fn matmul_reduce_scatter_equals_the_reference_bf16() {
    assert_no_failures(WORLDS.iter().map(|&n| check_matmul_reduce_scatter::<bf16>(n)).collect());
}

/// What the unfused `matmul_reduce_scatter` may add: it rounds each rank's partial product to
/// `T` before reducing, so a half type rounds twice (`u_T * scale` more); f32 and f64 do not.
fn unfused_extra<T: Element>() -> f64 {
    if T::DTYPE == <T::Acc as Element>::DTYPE { 0.0 } else { T::EPSILON / 2.0 }
}

/// The strict bound (one rounding to T) still holds for the unfused baseline of a half type in
/// most cases; this documents a case where it does not: f16, world 4, [M, K, N] = [3, 3, 7], entry
/// (2, 5) is the sum of 3 products, one per rank (k_r = 1, 1, 1, 0): exact 1.34446, correctly
/// rounded 1.344727, but rounding each product to f16 first gives 1.34375.
#[test]
fn unfused_matmul_reduce_scatter_of_half_types_rounds_twice() {
    let n = 4;
    let (m, k, nn) = (3, 3, 7);
    let x = Tensor::<f16>::random(&[m, k], 1100);
    let w = Tensor::<f16>::random(&[k, nn], 1101);
    let exact: f64 =
        (0..k).map(|p| x.as_slice()[2 * k + p].to_f64() * w.as_slice()[p * nn + 5].to_f64()).sum();
    let out = World::threads(n)
        .unwrap()
        .run(|rank| {
            let ks = pieces(k, n)[rank.rank()].clone();
            let xd = DistTensor::from_local(rank, slice(&x, 1, ks.clone()), Placement::Shard(1))?;
            let w_r = slice(&w, 0, ks);
            let fused = xd.matmul_reduce_scatter(&w_r)?.to_global()?;
            let unfused = xd.matmul_reduce_scatter_unfused(&w_r)?.to_global()?;
            Ok((fused.as_slice()[2 * nn + 5], unfused.as_slice()[2 * nn + 5]))
        })
        .unwrap();
    let (fused, unfused) = out[0];
    assert_eq!(fused, f16::from_f64(exact), "the fused op rounds once");
    assert_eq!(f16::from_f64(exact).to_f64(), 1.3447265625);
    assert!(
        unfused == fused || unfused.to_f64() == 1.34375,
        "unfused gives {unfused}: neither correctly rounded nor the double rounding seen before"
    );
}

/// The documented order of `matmul_reduce_scatter`'s sum, to the bit: with `k_r = 1` each rank's
/// partial product `p_r = x_r w_r` is one product, rounded once to the accumulator type whatever
/// the kernel does (a half-type product is even exact in f32), so the promised result is known:
/// `(((p_0 + p_1) + p_2) + ...)` added in the accumulator type in rank order, then rounded once to
/// `T`. Float addition does not associate, so any other order (each rank starting from its own
/// partial, say) changes the bits of many entries from world 3 on (at world 2, `p_0 + p_1` and
/// `p_1 + p_0` are the same). The unfused baseline rounds each `p_r` to `T` first (documented),
/// then the reduce_scatter adds in rank order too: that is checked to the bit as well.
fn check_rank_order<T: Element>(world: &World) -> Vec<String> {
    let n = world.num_ranks();
    // Short shards (tiles over all rows) and shards of 256 rows or more (tiles per owner).
    let shapes = [(1, 1), (fewer_than(n), 5), (2 * n + 1, 13), (SHARD_BY_SHARD_ROWS * n + 3, 67)];
    let cases: Vec<_> = shapes
        .iter()
        .enumerate()
        .map(|(c, &(m, nn))| {
            let seed = 7000 + 100 * c as u64;
            let xs: Vec<Tensor<T>> =
                (0..n).map(|r| Tensor::random(&[m, 1], seed + r as u64)).collect();
            let ws: Vec<Tensor<T>> =
                (0..n).map(|r| Tensor::random(&[1, nn], seed + 50 + r as u64)).collect();
            let mut fused = Vec::with_capacity(m * nn);
            let mut unfused = Vec::with_capacity(m * nn);
            for i in 0..m {
                for j in 0..nn {
                    let partial =
                        |r: usize| xs[r].as_slice()[i].to_acc() * ws[r].as_slice()[j].to_acc();
                    let mut sum = partial(0);
                    let mut sum_rounded = T::from_acc(partial(0)).to_acc();
                    for r in 1..n {
                        sum += partial(r);
                        sum_rounded += T::from_acc(partial(r)).to_acc();
                    }
                    fused.push(T::from_acc(sum));
                    unfused.push(T::from_acc(sum_rounded));
                }
            }
            let fused = Tensor::from_shape_vec(&[m, nn], fused).unwrap();
            let unfused = Tensor::from_shape_vec(&[m, nn], unfused).unwrap();
            let columns: Vec<_> = xs.iter().map(|x| x.view()).collect();
            let x_all = Tensor::from_array(concatenate(Axis(1), &columns).unwrap());
            (xs, x_all, ws, fused, unfused)
        })
        .collect();
    world
        .run(|rank| {
            let r = rank.rank();
            let mut fails = Vec::new();
            for (xs, x_all, ws, want_fused, want_unfused) in &cases {
                let (m, nn) = (xs[0].shape()[0], ws[0].shape()[1]);
                let rows = pieces(m, n)[r].clone();
                // Partial [M, 1] by [1, N] on every rank; and the same sum as a Shard(1) [M, n]
                // (one column per rank) by its row of the stacked weights.
                let xp = DistTensor::from_local(rank, xs[r].clone(), Placement::Partial)?;
                let x1 = DistTensor::from_global(rank, x_all, Placement::Shard(1))?;
                let w1 = &ws[r];
                let runs = [
                    (
                        "Partial",
                        "matmul_reduce_scatter",
                        xp.matmul_reduce_scatter(&ws[r])?,
                        want_fused,
                    ),
                    (
                        "Partial",
                        "matmul_reduce_scatter_unfused",
                        xp.matmul_reduce_scatter_unfused(&ws[r])?,
                        want_unfused,
                    ),
                    (
                        "Shard(1)",
                        "matmul_reduce_scatter",
                        x1.matmul_reduce_scatter(w1)?,
                        want_fused,
                    ),
                    (
                        "Shard(1)",
                        "matmul_reduce_scatter_unfused",
                        x1.matmul_reduce_scatter_unfused(w1)?,
                        want_unfused,
                    ),
                ];
                for (input, variant, y, want) in runs {
                    let what = format!(
                        "{variant} of {input}, {}, world {n}, rank {r}, [M, N] = [{m}, {nn}], \
                         one product per rank, against the sum in rank order",
                        T::DTYPE
                    );
                    let want_rows = slice(want, 0, rows.clone());
                    fails.extend(diff(y.local(), &want_rows).map(|e| format!("{what}: {e}")));
                }
            }
            Ok(fails)
        })
        .unwrap_or_else(|e| panic!("world {n}, {}: {e}", T::DTYPE))
        .into_iter()
        .flatten()
        .collect()
}

#[test]
fn matmul_reduce_scatter_adds_the_partials_in_rank_order() {
    let mut fails = Vec::new();
    for n in [2, 3, 4, 5, 8] {
        let world = World::threads(n).unwrap();
        fails.push(check_rank_order::<f32>(&world));
        fails.push(check_rank_order::<f64>(&world));
        fails.push(check_rank_order::<bf16>(&world));
        fails.push(check_rank_order::<f16>(&world));
    }
    // Many computing programs (tiles of a few rows, several per owner).
    let world = World::builder(4).topology(dist_tensor::device::Topology::ascend_910b()).build();
    fails.push(check_rank_order::<f32>(&world.unwrap()));
    assert_no_failures(fails);
}

fn bits(t: &Tensor<f32>) -> Vec<u32> {
    t.as_slice().iter().map(|v| v.to_bits()).collect()
}

#[test]
fn matmul_reduce_scatter_is_bitwise_the_same_over_50_calls() {
    for n in [3, 4] {
        let world = World::threads(n).unwrap();
        // Shard(1): several k-blocks per rank; Partial: every rank's full K.
        let (m, k, nn) = (257, 1031, 193);
        let x = Tensor::<f32>::random(&[m, k], 1);
        let w = Tensor::<f32>::random(&[k, nn], 2);
        let xs: Vec<Tensor<f32>> =
            (0..n).map(|r| Tensor::random(&[m, 131], 10 + r as u64)).collect();
        let ws: Vec<Tensor<f32>> =
            (0..n).map(|r| Tensor::random(&[131, nn], 20 + r as u64)).collect();
        let run = || {
            world
                .run(|rank| {
                    let r = rank.rank();
                    let ks = pieces(k, n)[r].clone();
                    let x1 = DistTensor::from_local(
                        rank,
                        slice(&x, 1, ks.clone()),
                        Placement::Shard(1),
                    )?;
                    let w1 = slice(&w, 0, ks);
                    let xp = DistTensor::from_local(rank, xs[r].clone(), Placement::Partial)?;
                    let first = (
                        bits(x1.matmul_reduce_scatter(&w1)?.local()),
                        bits(xp.matmul_reduce_scatter(&ws[r])?.local()),
                    );
                    let mut fails = Vec::new();
                    for call in 1..50 {
                        if bits(x1.matmul_reduce_scatter(&w1)?.local()) != first.0 {
                            fails.push(format!(
                                "world {n}, rank {r}: Shard(1) input differs at call {call}"
                            ));
                        }
                        if bits(xp.matmul_reduce_scatter(&ws[r])?.local()) != first.1 {
                            fails.push(format!(
                                "world {n}, rank {r}: Partial input differs at call {call}"
                            ));
                        }
                    }
                    Ok((fails, first))
                })
                .unwrap_or_else(|e| panic!("world {n}: {e}"))
        };
        let once = run();
        let again = run();
        for (r, ((fails, first), (_, second))) in once.into_iter().zip(again).enumerate() {
            assert!(fails.is_empty(), "{fails:?}");
            assert_eq!(first.0.len(), pieces(m, n)[r].len() * nn);
            assert!(first == second, "world {n}, rank {r}: a second World::run gives other bits");
        }
    }
}

// ---- large case, every entry checked --------------------------------------------------------

/// The large case: `[M, K] x [K, N]` with M = 2 x 4091, so that each of 2 ranks has 512-row tiles
/// and a ragged last one, and the reference of every entry, computed once in f64 (by ndarray, not
/// by the crate) and shared by both large tests: the all_gather_matmul of x's rows times w's
/// columns and the matmul_reduce_scatter of x's columns times w's rows are the same product.
struct Large {
    x: Tensor<f32>,
    w: Tensor<f32>,
    reference: Reference,
}

fn large() -> &'static Large {
    static LARGE: std::sync::OnceLock<Large> = std::sync::OnceLock::new();
    LARGE.get_or_init(|| {
        let (m, k, nn) = (4091 * 2, 1024, 5120);
        let x = Tensor::<f32>::random(&[m, k], 77);
        let w = Tensor::<f32>::random(&[k, nn], 78);
        let (xf, wf) = (to_f64_2(&x), to_f64_2(&w));
        let (want, scale) = (xf.dot(&wf), xf.abs().dot(&wf.abs()));
        // Each test passes its own tolerance to `check_tol`.
        let reference = Reference { want, scale, tol: f64::NAN, lost: Array2::zeros((0, 0)) };
        Large { x, w, reference }
    })
}

#[test]
fn all_gather_matmul_large_f32_world_2() {
    let n = 2;
    let Large { x, w, reference } = large();
    let (m, k, nn) = (x.shape()[0], x.shape()[1], w.shape()[1]);
    let fails = World::threads(n)
        .unwrap()
        .run(|rank| {
            let r = rank.rank();
            let rows = pieces(m, n)[r].clone();
            let cols = pieces(nn, n)[r].clone();
            let xd = DistTensor::from_local(rank, slice(x, 0, rows), Placement::Shard(0))?;
            let w_r = slice(w, 1, cols.clone());
            let mut fails = Vec::new();
            for fused in [true, false] {
                let y = if fused {
                    xd.all_gather_matmul(&w_r)?
                } else {
                    xd.all_gather_matmul_unfused(&w_r)?
                };
                let variant = if fused { "all_gather_matmul" } else { "all_gather_matmul_unfused" };
                let what = format!("{variant} [{m}, {k}, {nn}], rank {r}");
                let tol = tolerance::<f32>(k);
                fails.extend(reference.check_tol(tol, y.local(), 0..m, cols.clone(), &what));
                if y.placement() != Placement::Shard(1) {
                    fails.push(format!("{what}: placement {}", y.placement()));
                }
            }
            Ok(fails)
        })
        .unwrap();
    assert_no_failures(fails);
}

#[test]
fn matmul_reduce_scatter_large_f32_world_2() {
    let n = 2;
    let Large { x, w, reference } = large();
    let (m, k, nn) = (x.shape()[0], x.shape()[1], w.shape()[1]);
    let fails = World::threads(n)
        .unwrap()
        .run(|rank| {
            let r = rank.rank();
            let ks = pieces(k, n)[r].clone();
            let xd = DistTensor::from_local(rank, slice(x, 1, ks.clone()), Placement::Shard(1))?;
            let w_r = slice(w, 0, ks);
            let rows = pieces(m, n)[r].clone();
            let mut fails = Vec::new();
            for fused in [true, false] {
                let y = if fused {
                    xd.matmul_reduce_scatter(&w_r)?
                } else {
                    xd.matmul_reduce_scatter_unfused(&w_r)?
                };
                let variant =
                    if fused { "matmul_reduce_scatter" } else { "matmul_reduce_scatter_unfused" };
                let what = format!("{variant} [{m}, {k}, {nn}], rank {r}");
                let tol = tolerance::<f32>(k + n);
                fails.extend(reference.check_tol(tol, y.local(), rows.clone(), 0..nn, &what));
                if y.placement() != Placement::Shard(0) {
                    fails.push(format!("{what}: placement {}", y.placement()));
                }
            }
            Ok(fails)
        })
        .unwrap();
    assert_no_failures(fails);
}

// ---- all_to_all ----------------------------------------------------------------------------------

const D: usize = 128;

/// Ulysses on `[B, S, H, D]`: Shard(1) -all_to_all(2, 1)-> Shard(2) -all_to_all(1, 2)-> Shard(1),
/// fused and unfused; every result bitwise.
fn check_ulysses<T: Element>(
    world: &World,
    (b, s_len, h): (usize, usize, usize),
    seed: u64,
) -> Vec<String> {
    let n = world.num_ranks();
    let global = Tensor::<T>::random(&[b, s_len, h, D], seed);
    let fails = world
        .run(|rank| {
            let r = rank.rank();
            let what = format!(
                "Ulysses, {}, world {n}, rank {r}, [B, S, H, D] = [{b}, {s_len}, {h}, {D}]",
                T::DTYPE
            );
            let mut fails = Vec::new();
            let local = slice(&global, 1, pieces(s_len, n)[r].clone());
            let x = DistTensor::from_local(rank, local.clone(), Placement::Shard(1))?;
            let fwd = x.all_to_all(2, 1)?;
            let back = fwd.all_to_all(1, 2)?;
            let fwd_u = x.all_to_all_unfused(2, 1)?;
            let back_u = fwd_u.all_to_all_unfused(1, 2)?;
            let heads = slice(&global, 2, pieces(h, n)[r].clone());
            for (name, y, placement) in [
                ("all_to_all(2, 1)", &fwd, Placement::Shard(2)),
                ("all_to_all(1, 2) back", &back, Placement::Shard(1)),
                ("all_to_all_unfused(2, 1)", &fwd_u, Placement::Shard(2)),
                ("all_to_all_unfused(1, 2) back", &back_u, Placement::Shard(1)),
            ] {
                if y.placement() != placement {
                    fails.push(format!(
                        "{what}: {name}: placement {}, want {placement}",
                        y.placement()
                    ));
                }
                if y.global_shape() != [b, s_len, h, D] {
                    fails.push(format!("{what}: {name}: global_shape {:?}", y.global_shape()));
                }
            }
            let checks = [
                ("all_to_all(2, 1) vs the heads slice of the global", fwd.local(), &heads),
                ("round trip vs the input", back.local(), &local),
                ("all_to_all_unfused(2, 1) vs fused", fwd_u.local(), fwd.local()),
                ("unfused round trip vs the input", back_u.local(), &local),
            ];
            for (name, got, want) in checks {
                if let Some(e) = diff(got, want) {
                    fails.push(format!("{what}: {name}: {e}"));
                }
            }
            Ok(fails)
        })
        .unwrap_or_else(|e| panic!("world {n}, [{b}, {s_len}, {h}, {D}], {}: {e}", T::DTYPE));
    fails.into_iter().flatten().collect()
}

#[test]
fn ulysses_all_to_all_round_trip_is_bitwise_the_identity_f32() {
    let mut fails = Vec::new();
    for n in [1, 2, 3, 4] {
        let world = World::threads(n).unwrap();
        for s_len in [fewer_than(n), 2047, 2048] {
            for h in [1, 3, 8, 12] {
                let b = if s_len < 64 { 2 } else { 1 };
                fails.push(check_ulysses::<f32>(&world, (b, s_len, h), (s_len * 100 + h) as u64));
            }
        }
    }
    // World 8: more ranks than heads, and fewer sequence rows than ranks.
    let world = World::threads(8).unwrap();
    fails.push(check_ulysses::<f32>(&world, (1, 2047, 3), 1));
    fails.push(check_ulysses::<f32>(&world, (2, 7, 12), 2));
    // Outputs of more than 8 MiB a rank: the copies stream past the cache, row by row (pieces of
    // 5 and 4 heads, 3 of 3; a prime number of rows).
    for (n, b) in [(2, 1), (3, 2)] {
        let world = World::threads(n).unwrap();
        fails.push(check_ulysses::<f32>(&world, (b, 4099, 9), 9 + n as u64));
    }
    assert_no_failures(fails);
}

#[test]
fn ulysses_all_to_all_round_trip_other_dtypes() {
    let mut fails = Vec::new();
    let world = World::threads(3).unwrap();
    fails.push(check_ulysses::<bf16>(&world, (1, 2047, 12), 5));
    fails.push(check_ulysses::<f16>(&world, (2, 2, 8), 6));
    fails.push(check_ulysses::<f64>(&world, (1, 2048, 1), 7));
    let world = World::threads(4).unwrap();
    fails.push(check_ulysses::<bf16>(&world, (2, 3, 3), 8));
    assert_no_failures(fails);
}

/// all_to_all between every pair of dims of 3-D tensors, from array_split and uneven shards.
fn check_all_to_all_3d<T: Element>(n: usize) {
    let world = World::threads(n).unwrap();
    let globals: Vec<Tensor<T>> = [[7, 5, 11], [2, 13, 3], [3, 1, 4]]
        .iter()
        .enumerate()
        .map(|(i, s)| Tensor::random(s, 300 + i as u64))
        .collect();
    let fails = world
        .run(|rank| {
            let r = rank.rank();
            let mut fails = Vec::new();
            for global in &globals {
                for gather in 0..3 {
                    let len = global.shape()[gather];
                    // Uneven: reversed array_split, and rank 1 gives its share to rank 0.
                    let mut counts = array_split(len, n);
                    counts.reverse();
                    if n > 1 {
                        counts[0] += counts[1];
                        counts[1] = 0;
                    }
                    let offsets = common::offsets(&counts);
                    let uneven = offsets[r]..offsets[r + 1];
                    for (kind, range) in [("array_split", pieces(len, n)[r].clone()), ("uneven", uneven)] {
                        let x = DistTensor::from_local(rank, slice(global, gather, range), Placement::Shard(gather))?;
                        for scatter in (0..3).filter(|&d| d != gather) {
                            let what = format!(
                                "all_to_all({scatter}, {gather}) of {:?} from {kind} shards, {}, world {n}, rank {r}",
                                global.shape(),
                                T::DTYPE
                            );
                            let y = x.all_to_all(scatter, gather)?;
                            let yu = x.all_to_all_unfused(scatter, gather)?;
                            for (name, d) in [("fused", &y), ("unfused", &yu)] {
                                if d.placement() != Placement::Shard(scatter) {
                                    fails.push(format!("{what}, {name}: placement {}", d.placement()));
                                }
                                if d.global_shape() != global.shape() {
                                    fails.push(format!("{what}, {name}: global_shape {:?}", d.global_shape()));
                                }
                            }
                            let want = slice(global, scatter, pieces(global.shape()[scatter], n)[r].clone());
                            fails.extend(diff(y.local(), &want).map(|e| format!("{what}: local: {e}")));
                            fails.extend(diff(yu.local(), y.local()).map(|e| format!("{what}: unfused vs fused: {e}")));
                            let g = y.to_global()?;
                            fails.extend(diff(&g, global).map(|e| format!("{what}: to_global: {e}")));
                        }
                    }
                }
            }
            Ok(fails)
        })
        .unwrap_or_else(|e| panic!("world {n}, {}: {e}", T::DTYPE));
    assert_no_failures(fails);
}

#[test]
fn all_to_all_between_any_two_dims_of_3d_tensors() {
    for n in [1, 2, 3, 4, 5, 8] {
        check_all_to_all_3d::<f32>(n);
    }
    check_all_to_all_3d::<bf16>(3);
    check_all_to_all_3d::<f64>(4);
}

// ---- many calls, new data each time ---------------------------------------------------------

/// The fused products keep their symmetric buffers and signal counts from call to call; a call
/// that read a peer's data before it landed would see the previous call's. With the same inputs
/// every call that goes unseen, so here every call has new inputs: 12 calls of each product on
/// one world, rank 1 with no rows (it reads peers' rows first, as soon as they are announced),
/// shards of several push chunks (K = 1024), short shards and shards of 256 rows or more.
#[test]
fn fused_products_over_many_calls_with_new_data_each_time() {
    const CALLS: u64 = 12;
    let n = 3;
    let (k, nn) = (1024, 48);
    let world = World::threads(n).unwrap();
    let mut fails = Vec::new();
    for counts in [[300, 0, 599], [3, 0, 5]] {
        let offsets = common::offsets(&counts);
        let m = offsets[n];
        let cases: Vec<_> = (0..CALLS)
            .map(|call| {
                let x = Tensor::<f32>::random(&[m, k], 5000 + call);
                let w = Tensor::<f32>::random(&[k, nn], 6000 + call);
                let tol = tolerance::<f32>(k + n);
                let reference = Reference::new(&to_f64_2(&x), &to_f64_2(&w), tol, 0..0);
                (x, w, reference)
            })
            .collect();
        let out = world
            .run(|rank| {
                let r = rank.rank();
                let mut fails = Vec::new();
                for (call, (x, w, reference)) in cases.iter().enumerate() {
                    let what = |op: &str| {
                        format!("{op}, call {call} of {CALLS}, rows per rank {counts:?}, rank {r}")
                    };
                    let rows = offsets[r]..offsets[r + 1];
                    let xd = DistTensor::from_local(rank, slice(x, 0, rows), Placement::Shard(0))?;
                    let cols = pieces(nn, n)[r].clone();
                    let y = xd.all_gather_matmul(&slice(w, 1, cols.clone()))?;
                    fails.extend(reference.check(
                        y.local(),
                        0..m,
                        cols,
                        &what("all_gather_matmul"),
                    ));
                    let ks = pieces(k, n)[r].clone();
                    let x1 =
                        DistTensor::from_local(rank, slice(x, 1, ks.clone()), Placement::Shard(1))?;
                    let y = x1.matmul_reduce_scatter(&slice(w, 0, ks))?;
                    let rows = pieces(m, n)[r].clone();
                    fails.extend(reference.check(
                        y.local(),
                        rows,
                        0..nn,
                        &what("matmul_reduce_scatter"),
                    ));
                }
                Ok(fails)
            })
            .unwrap_or_else(|e| panic!("rows per rank {counts:?}: {e}"));
        fails.extend(out);
    }
    assert_no_failures(fails);
}

// ---- a tensor-parallel MLP -------------------------------------------------------------------

/// x Shard(0) -> all_gather_matmul(w1 columns) -> matmul_reduce_scatter(w2 rows) on 4 ranks,
/// fused and unfused, against `x @ w1 @ w2` in f64. The hidden `h` carries the first product's
/// error `tol1 * |x||w1|` into the second, so the bound is `(tol1 + tol2) * |x||w1||w2|`.
fn check_mlp<T: Element>((m, k, hidden, nn): (usize, usize, usize, usize)) {
    let n = 4;
    let x = Tensor::<T>::random(&[m, k], 1);
    let w1 = Tensor::<T>::random(&[k, hidden], 2);
    let w2 = Tensor::<T>::random(&[hidden, nn], 3);
    let (xf, w1f, w2f) = (to_f64_2(&x), to_f64_2(&w1), to_f64_2(&w2));
    let tol = tolerance::<T>(k) + tolerance::<T>(hidden + n);
    let h_ref = Reference::new(&xf, &w1f, tolerance::<T>(k), dropped_block(k));
    let want = xf.dot(&w1f).dot(&w2f);
    let scale = xf.abs().dot(&w1f.abs()).dot(&w2f.abs());
    let reference = Reference { want, scale, tol, lost: Array2::zeros((0, 0)) };
    let fails = World::threads(n)
        .unwrap()
        .run(|rank| {
            let r = rank.rank();
            let mut fails = Vec::new();
            let rows = pieces(m, n)[r].clone();
            let hs = pieces(hidden, n)[r].clone();
            let xd = DistTensor::from_local(rank, slice(&x, 0, rows.clone()), Placement::Shard(0))?;
            let w1_r = slice(&w1, 1, hs.clone());
            let w2_r = slice(&w2, 0, hs.clone());
            for fused in [true, false] {
                let what = format!(
                    "MLP ({}), {}, rank {r}, [M, K, hidden, N] = [{m}, {k}, {hidden}, {nn}]",
                    if fused { "fused" } else { "unfused" },
                    T::DTYPE
                );
                let h = if fused {
                    xd.all_gather_matmul(&w1_r)?
                } else {
                    xd.all_gather_matmul_unfused(&w1_r)?
                };
                fails.extend(h_ref.check(h.local(), 0..m, hs.clone(), &format!("{what}, h")));
                let y = if fused {
                    h.matmul_reduce_scatter(&w2_r)?
                } else {
                    h.matmul_reduce_scatter_unfused(&w2_r)?
                };
                if y.placement() != Placement::Shard(0) {
                    fails.push(format!("{what}: placement {}", y.placement()));
                }
                fails.extend(reference.check(
                    y.local(),
                    rows.clone(),
                    0..nn,
                    &format!("{what}, y"),
                ));
                let g = y.to_global()?;
                fails.extend(reference.check(&g, 0..m, 0..nn, &format!("{what}, to_global")));
            }
            Ok(fails)
        })
        .unwrap_or_else(|e| panic!("MLP {}: {e}", T::DTYPE));
    assert_no_failures(fails);
}

#[test]
fn tensor_parallel_mlp_on_four_ranks() {
    for shape in [(37, 29, 53, 31), (130, 96, 257, 64), (3, 8, 5, 2)] {
        check_mlp::<f32>(shape);
        check_mlp::<bf16>(shape);
    }
    check_mlp::<f16>((37, 29, 53, 31));
    check_mlp::<f64>((37, 29, 53, 31));
}

// ---- errors ------------------------------------------------------------------------------------

/// Runs `f` on a world of `n` ranks whose waits time out after 10 s, and asserts it finished well
/// before that: an error that only some ranks saw must not leave the others waiting.
fn run_quick<R: Send>(n: usize, f: impl Fn(&Rank<'_>) -> Result<R> + Sync) -> Vec<R> {
    let world = World::builder(n).wait_timeout(Duration::from_secs(10)).build().unwrap();
    let start = Instant::now();
    let out = world.run(f).unwrap_or_else(|e| panic!("world {n}: {e}"));
    let took = start.elapsed();
    assert!(took < Duration::from_secs(5), "world {n} took {took:?}: a rank waited for a timeout");
    out
}

/// No failure when `got` is an error accepted by `ok`, else why not.
fn expect_err<V>(got: Result<V>, what: &str, ok: impl Fn(&Error) -> bool) -> Vec<String> {
    match got {
        Err(e) if ok(&e) => vec![],
        Err(e) => vec![format!("{what}: wrong error {e:?}")],
        Ok(_) => vec![format!("{what}: succeeded, want an error")],
    }
}

fn inner_mismatch(op: &'static str) -> impl Fn(&Error) -> bool {
    move |e| matches!(e, Error::InnerDimMismatch { op: o, .. } if o.contains(op))
}

fn unsupported(op: &'static str) -> impl Fn(&Error) -> bool {
    move |e| matches!(e, Error::UnsupportedPlacement { op: o, .. } if o.contains(op))
}

/// An error that blames `rank`: its inner dimensions, or a disagreement that involves it.
fn blames(rank: usize) -> impl Fn(&Error) -> bool {
    move |e| match e {
        Error::InnerDimMismatch { rank: r, .. } | Error::InvalidArgument { rank: r, .. } => {
            *r == rank
        }
        Error::RanksDisagree { rank_a, rank_b, .. } => *rank_a == rank || *rank_b == rank,
        _ => false,
    }
}

/// After the rejected calls the world must still work: one correct all_gather_matmul.
fn still_works(rank: &Rank<'_>) -> Result<Vec<String>> {
    let n = rank.num_ranks();
    let r = rank.rank();
    let x = Tensor::<f32>::random(&[9, 6], 1);
    let w = Tensor::<f32>::random(&[6, 5], 2);
    let reference = Reference::new(&to_f64_2(&x), &to_f64_2(&w), tolerance::<f32>(6), 0..0);
    let xd =
        DistTensor::from_local(rank, slice(&x, 0, pieces(9, n)[r].clone()), Placement::Shard(0))?;
    let cols = pieces(5, n)[r].clone();
    let y = xd.all_gather_matmul(&slice(&w, 1, cols.clone()))?;
    Ok(reference
        .check(y.local(), 0..9, cols, "a correct call after the errors")
        .into_iter()
        .collect())
}

#[test]
fn inner_dimensions_that_disagree_are_an_error_on_every_rank() {
    let n = 3;
    let out = run_quick(n, |rank| {
        let r = rank.rank();
        let mut fails = Vec::new();
        let (m, k, nn) = (7, 5, 6);
        let x = Tensor::<f32>::random(&[m, k], 1);
        let xd = DistTensor::from_local(
            rank,
            slice(&x, 0, pieces(m, n)[r].clone()),
            Placement::Shard(0),
        )?;
        let n_r = pieces(nn, n)[r].len();
        let bad = Tensor::<f32>::random(&[k + 1, n_r], 2);
        let good = Tensor::<f32>::random(&[k, n_r], 3);
        let what = |op: &str| format!("{op}, rank {r}");
        fails.extend(expect_err(
            xd.all_gather_matmul(&bad),
            &what("all_gather_matmul, w has K + 1 rows"),
            inner_mismatch("all_gather_matmul"),
        ));
        fails.extend(expect_err(
            xd.all_gather_matmul_unfused(&bad),
            &what("all_gather_matmul_unfused, w has K + 1 rows"),
            inner_mismatch("all_gather_matmul"),
        ));
        fails.extend(expect_err(
            xd.all_gather_matmul_many(&[&good, &bad]),
            &what("all_gather_matmul_many, the 2nd w has K + 1 rows"),
            inner_mismatch("all_gather_matmul"),
        ));
        let ks = pieces(k, n)[r].clone();
        let x1 = DistTensor::from_local(rank, slice(&x, 1, ks.clone()), Placement::Shard(1))?;
        let bad = Tensor::<f32>::random(&[ks.len() + 2, nn], 4);
        fails.extend(expect_err(
            x1.matmul_reduce_scatter(&bad),
            &what("matmul_reduce_scatter of Shard(1), w has k_r + 2 rows"),
            inner_mismatch("matmul_reduce_scatter"),
        ));
        fails.extend(expect_err(
            x1.matmul_reduce_scatter_unfused(&bad),
            &what("matmul_reduce_scatter_unfused of Shard(1), w has k_r + 2 rows"),
            inner_mismatch("matmul_reduce_scatter"),
        ));
        let xp = DistTensor::from_local(rank, x.clone(), Placement::Partial)?;
        let bad = Tensor::<f32>::random(&[k - 1, nn], 5);
        fails.extend(expect_err(
            xp.matmul_reduce_scatter(&bad),
            &what("matmul_reduce_scatter of Partial, w has K - 1 rows"),
            inner_mismatch("matmul_reduce_scatter"),
        ));
        fails.extend(still_works(rank)?);
        Ok(fails)
    });
    assert_no_failures(out);
}

#[test]
fn a_placement_the_op_does_not_take_is_an_error_on_every_rank() {
    let n = 3;
    let out = run_quick(n, |rank| {
        let r = rank.rank();
        let mut fails = Vec::new();
        let x = Tensor::<f32>::random(&[6, 4], 1);
        let w = Tensor::<f32>::random(&[4, 3], 2);
        let what = |op: &str, p: Placement| format!("{op} of {p}, rank {r}");
        for p in [Placement::Replicate, Placement::Partial, Placement::Shard(1)] {
            let xd = DistTensor::from_global(rank, &x, p)?;
            fails.extend(expect_err(
                xd.all_gather_matmul(&w),
                &what("all_gather_matmul", p),
                unsupported("all_gather_matmul"),
            ));
            fails.extend(expect_err(
                xd.all_gather_matmul_unfused(&w),
                &what("all_gather_matmul_unfused", p),
                unsupported("all_gather_matmul"),
            ));
            fails.extend(expect_err(
                xd.all_gather_matmul_many(&[&w]),
                &what("all_gather_matmul_many", p),
                unsupported("all_gather_matmul"),
            ));
        }
        for p in [Placement::Replicate, Placement::Shard(0)] {
            let xd = DistTensor::from_global(rank, &x, p)?;
            fails.extend(expect_err(
                xd.matmul_reduce_scatter(&w),
                &what("matmul_reduce_scatter", p),
                unsupported("matmul_reduce_scatter"),
            ));
            fails.extend(expect_err(
                xd.matmul_reduce_scatter_unfused(&w),
                &what("matmul_reduce_scatter_unfused", p),
                unsupported("matmul_reduce_scatter"),
            ));
        }
        let q = Tensor::<f32>::random(&[2, 5, 3, 4], 3);
        for p in
            [Placement::Shard(0), Placement::Shard(2), Placement::Replicate, Placement::Partial]
        {
            let qd = DistTensor::from_global(rank, &q, p)?;
            fails.extend(expect_err(
                qd.all_to_all(2, 1),
                &what("all_to_all(2, 1)", p),
                unsupported("all_to_all"),
            ));
            fails.extend(expect_err(
                qd.all_to_all_unfused(2, 1),
                &what("all_to_all_unfused(2, 1)", p),
                unsupported("all_to_all"),
            ));
        }
        fails.extend(still_works(rank)?);
        Ok(fails)
    });
    assert_no_failures(out);
}

#[test]
fn all_to_all_dims_out_of_range_are_an_error_on_every_rank() {
    let out = run_quick(3, |rank| {
        let r = rank.rank();
        let mut fails = Vec::new();
        let q = Tensor::<f32>::random(&[2, 5, 3, 4], 3);
        let qd = DistTensor::from_global(rank, &q, Placement::Shard(1))?;
        for scatter in [4, 9] {
            let out_of_range = move |e: &Error| matches!(e, Error::DimOutOfRange { dim, ndim: 4, .. } if *dim == scatter);
            fails.extend(expect_err(
                qd.all_to_all(scatter, 1),
                &format!("all_to_all({scatter}, 1) of 4-D, rank {r}"),
                out_of_range,
            ));
            fails.extend(expect_err(
                qd.all_to_all_unfused(scatter, 1),
                &format!("all_to_all_unfused({scatter}, 1) of 4-D, rank {r}"),
                out_of_range,
            ));
        }
        fails.extend(still_works(rank)?);
        Ok(fails)
    });
    assert_no_failures(out);
}

/// x must be sharded on a dimension before its last for all_gather_matmul, and have 2 or more
/// dimensions for matmul_reduce_scatter (documented: UnsupportedPlacement); a weight that is not
/// 2-D is rejected on every rank.
#[test]
fn operands_that_are_not_matrices_are_an_error_on_every_rank() {
    let out = run_quick(2, |rank| {
        let r = rank.rank();
        let mut fails = Vec::new();
        let x3 = DistTensor::from_global(
            rank,
            &Tensor::<f32>::random(&[4, 3, 2], 1),
            Placement::Shard(2),
        )?;
        let w = Tensor::<f32>::random(&[2, 3], 2);
        fails.extend(expect_err(
            x3.all_gather_matmul(&w),
            &format!("all_gather_matmul of x sharded on its last dimension, rank {r}"),
            unsupported("all_gather_matmul"),
        ));
        let xp =
            DistTensor::from_global(rank, &Tensor::<f32>::random(&[4], 1), Placement::Partial)?;
        fails.extend(expect_err(
            xp.matmul_reduce_scatter(&w),
            &format!("matmul_reduce_scatter of a 1-D x, rank {r}"),
            unsupported("matmul_reduce_scatter"),
        ));
        let x =
            DistTensor::from_global(rank, &Tensor::<f32>::random(&[4, 3], 1), Placement::Shard(0))?;
        let w1 = Tensor::<f32>::random(&[3], 2);
        fails.extend(expect_err(
            x.all_gather_matmul(&w1),
            &format!("all_gather_matmul by a 1-D w, rank {r}"),
            |e| matches!(e, Error::InvalidArgument { rank: 0, .. }),
        ));
        // Only rank 1's weight is 1-D.
        let w =
            if r == 1 { Tensor::<f32>::random(&[3], 2) } else { Tensor::<f32>::random(&[3, 2], 2) };
        fails.extend(expect_err(
            x.all_gather_matmul(&w),
            &format!("all_gather_matmul, rank 1's w is 1-D, rank {r}"),
            |e| blames(1)(e) || matches!(e, Error::InvalidShape { .. }),
        ));
        fails.extend(still_works(rank)?);
        Ok(fails)
    });
    assert_no_failures(out);
}

/// The error for a weight that is not 2-D should say its real shape: `right: [3]`, not the
/// `[0, 0]` placeholder the op substitutes so that every rank rejects it.
#[test]
fn a_weight_that_is_not_2d_is_reported_with_its_real_shape() {
    // Rank 1 alone passes a 1-D weight: every rank fails, naming rank 1; rank 1 says why.
    let out = run_quick(2, |rank| {
        let x =
            DistTensor::from_global(rank, &Tensor::<f32>::random(&[4, 3], 1), Placement::Shard(0))?;
        let w = if rank.rank() == 1 { Tensor::random(&[3], 2) } else { Tensor::random(&[3, 5], 2) };
        Ok(x.all_gather_matmul(&w).map(|_| ()).unwrap_err())
    });
    for (r, e) in out.iter().enumerate() {
        match e {
            Error::InvalidArgument { rank: 1, reason, .. } => {
                assert!(r != 1 || reason.contains("weight 0 has shape [3]"), "{e:?}")
            }
            other => panic!("rank {r}: {other:?}"),
        }
    }
}

#[test]
fn all_to_all_with_the_same_dims_is_an_error_on_every_rank() {
    let out = run_quick(3, |rank| {
        let q = Tensor::<f32>::random(&[2, 5, 3, 4], 3);
        let qd = DistTensor::from_global(rank, &q, Placement::Shard(1))?;
        let what = format!("all_to_all(1, 1), rank {}", rank.rank());
        let mut fails =
            expect_err(qd.all_to_all(1, 1), &what, |e| matches!(e, Error::InvalidArgument { .. }));
        fails.extend(still_works(rank)?);
        Ok(fails)
    });
    assert_no_failures(out);
}

/// One rank passes a weight of the wrong shape: every rank must get an error blaming it, at once
/// (not a wait timeout), and the world must still work afterwards.
#[test]
fn weights_of_the_wrong_shape_on_one_rank_fail_every_rank_without_a_hang() {
    let n = 4;
    let out = run_quick(n, |rank| {
        let r = rank.rank();
        let mut fails = Vec::new();
        let (m, k, nn) = (11, 7, 9);
        let x = Tensor::<f32>::random(&[m, k], 1);
        let what = |case: &str| format!("{case}, error seen on rank {r}");
        let xd = DistTensor::from_local(
            rank,
            slice(&x, 0, pieces(m, n)[r].clone()),
            Placement::Shard(0),
        )?;
        let n_r = pieces(nn, n)[r].len();
        let w = Tensor::<f32>::random(&[k + usize::from(r == 1), n_r], 2);
        fails.extend(expect_err(
            xd.all_gather_matmul(&w),
            &what("all_gather_matmul, rank 1's w has K + 1 rows"),
            blames(1),
        ));
        fails.extend(expect_err(
            xd.all_gather_matmul_unfused(&w),
            &what("all_gather_matmul_unfused, rank 1's w has K + 1 rows"),
            blames(1),
        ));
        let good = Tensor::<f32>::random(&[k, n_r], 3);
        let bad = Tensor::<f32>::random(&[k + usize::from(r == 2), 2], 4);
        fails.extend(expect_err(
            xd.all_gather_matmul_many(&[&good, &bad]),
            &what("all_gather_matmul_many, rank 2's 2nd w has K + 1 rows"),
            blames(2),
        ));

        let ks = pieces(k, n)[r].clone();
        let x1 = DistTensor::from_local(rank, slice(&x, 1, ks.clone()), Placement::Shard(1))?;
        let w = Tensor::<f32>::random(&[ks.len(), nn + usize::from(r == 2)], 5);
        fails.extend(expect_err(
            x1.matmul_reduce_scatter(&w),
            &what("matmul_reduce_scatter, rank 2's w has N + 1 columns"),
            blames(2),
        ));
        let w = Tensor::<f32>::random(&[ks.len() + usize::from(r == 3), nn], 6);
        fails.extend(expect_err(
            x1.matmul_reduce_scatter(&w),
            &what("matmul_reduce_scatter, rank 3's w has k_r + 1 rows"),
            blames(3),
        ));
        fails.extend(expect_err(
            x1.matmul_reduce_scatter_unfused(&w),
            &what("matmul_reduce_scatter_unfused, rank 3's w has k_r + 1 rows"),
            blames(3),
        ));
        let xp = DistTensor::from_local(rank, x.clone(), Placement::Partial)?;
        let w = Tensor::<f32>::random(&[k + usize::from(r == 0), nn], 7);
        fails.extend(expect_err(
            xp.matmul_reduce_scatter(&w),
            &what("matmul_reduce_scatter of Partial, rank 0's w has K + 1 rows"),
            blames(0),
        ));

        // all_to_all with dims that disagree across ranks.
        let q = Tensor::<f32>::random(&[2, 5, 3, 4], 8);
        let qd = DistTensor::from_global(rank, &q, Placement::Shard(1))?;
        let scatter = if r == 1 { 3 } else { 2 };
        fails.extend(expect_err(
            qd.all_to_all(scatter, 1),
            &what("all_to_all, rank 1 scatters dim 3, the others dim 2"),
            blames(1),
        ));
        fails.extend(still_works(rank)?);
        Ok(fails)
    });
    assert_no_failures(out);
}

/// Regression: ranks used to count the tiles of their own rows with a plan of their rows alone,
/// which cut ragged shards differently from the real plan when several programs compute: a rank
/// then waited for tiles that never came. Many compute lanes (a 910B-like topology), ragged rows.
#[test]
fn matmul_reduce_scatter_tile_counts_agree_with_many_compute_lanes() {
    use dist_tensor::device::Topology;
    // World 2, M = 5: shards of 3 and 2 rows; with 2 computing programs the plan cuts 2-row
    // tiles, so the 2-row shard is one tile, where a plan of that shard alone made two.
    for (ranks, topology) in [
        (2, Topology::new(2, 2).unwrap()),
        (3, Topology::new(2, 2).unwrap()),
        (3, Topology::ascend_910b()),
    ] {
        let world = World::builder(ranks)
            .topology(topology.clone())
            .wait_timeout(std::time::Duration::from_secs(20))
            .build()
            .unwrap();
        for (m, k, n) in [(5, 3, 4), (515, 6, 7), (1031, 5, 3)] {
            let h = Tensor::<f64>::random(&[m, k], 1);
            let w = Tensor::<f64>::random(&[k, n], 2);
            let want = h.matmul(&w).unwrap();
            let got = world
                .run(|rank| {
                    let hs = DistTensor::from_global(rank, &h, Placement::Shard(1))?;
                    let ws = DistTensor::from_global(rank, &w, Placement::Shard(0))?;
                    hs.matmul_reduce_scatter(ws.local())?.to_global()
                })
                .unwrap_or_else(|e| panic!("{topology:?}, M={m}: {e}"));
            for (g, r) in got[0].as_slice().iter().zip(want.as_slice()) {
                assert!((g - r).abs() < 1e-12, "{topology:?}, M={m}");
            }
        }
    }
}

/// Regression: a product with no columns (N = 0) used to panic in the reduction's tile load.
#[test]
fn matmul_reduce_scatter_with_no_columns_gives_empty_rows() {
    let outs = World::threads(2)
        .unwrap()
        .run(|rank| {
            let h = DistTensor::from_global(
                rank,
                &Tensor::<f32>::random(&[5, 4], 1),
                Placement::Shard(1),
            )?;
            let w = Tensor::<f32>::zeros(&[2, 0]);
            let fused = h.matmul_reduce_scatter(&w)?;
            let unfused = h.matmul_reduce_scatter_unfused(&w)?;
            Ok((
                fused.local().shape().to_vec(),
                unfused.local().shape().to_vec(),
                fused.global_shape(),
            ))
        })
        .unwrap();
    assert_eq!(outs[0], (vec![3, 0], vec![3, 0], vec![5, 0]));
    assert_eq!(outs[1].0, vec![2, 0]);
}
