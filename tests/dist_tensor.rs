//! `DistTensor` construction, `to_global`, `redistribute` and their errors, against slices of the
//! global tensor.
//!
//! Worlds of 1 to 8 ranks; shapes with a dimension smaller than the world (empty shards), primes,
//! sizes that do not divide, a 1-D tensor, and tensors with a zero dimension.
//!
//! # Exactness
//! Every placement change but a reduction only moves data, so it must be bitwise exact. Partial
//! tensors are built from dyadic values (multiples of 1/4 in [-4, 4]): any sum of up to 8 of them,
//! in any order, is exact in every element type (|sum| <= 32 in steps of 1/4 needs 8 significant
//! bits; bf16 has 8), so reductions are checked bitwise too. One test checks reductions of random
//! values against f64 within `(u_T + n eps_acc) * sum |x_r|` (u_T only for the half types).

use std::ops::Range;
use std::time::{Duration, Instant};

use dist_tensor::{DistTensor, Element, Error, Placement, Rank, Result, Tensor, World};
use half::{bf16, f16};

mod common;

use common::{array_split, dyadic, pieces, slice};

// ---- helpers --------------------------------------------------------------------------------

/// An uneven split that is not `array_split`: reversed (the last ranks get more), and rank 1
/// (when there is one) gives everything to rank 0, so it is empty.
fn uneven_pieces(len: usize, n: usize) -> Vec<Range<usize>> {
    let mut counts = array_split(len, n);
    counts.reverse();
    if n > 1 {
        counts[0] += counts[1];
        counts[1] = 0;
    }
    let offsets = common::offsets(&counts);
    offsets.windows(2).map(|w| w[0]..w[1]).collect()
}

/// The exact sum of dyadic parts (as f64, then to `T`: exact, see the module docs).
fn exact_sum<T: Element>(parts: &[Tensor<T>]) -> Tensor<T> {
    let mut acc = parts[0].view().mapv(|v| v.to_f64());
    for p in &parts[1..] {
        acc = acc + p.view().mapv(|v| v.to_f64());
    }
    Tensor::from_array(acc.mapv(T::from_f64))
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

/// Checks `d` against `global` under placement `want`, without communicating: placement,
/// global shape and the local piece (for `Shard(dim)` the piece `split` gives this rank,
/// `array_split` when `None`; for `Replicate` all of it; for `Partial` only its shape).
fn check_local<T: Element>(
    d: &DistTensor<'_, T>,
    rank: &Rank<'_>,
    global: &Tensor<T>,
    want: Placement,
    split: Option<&[Range<usize>]>,
    what: &str,
) -> Vec<String> {
    let (r, n) = (rank.rank(), rank.num_ranks());
    let mut fails = Vec::new();
    if d.placement() != want {
        fails.push(format!("{what}: placement {}, want {want}", d.placement()));
    }
    if d.global_shape() != global.shape() {
        fails.push(format!(
            "{what}: global_shape {:?}, want {:?}",
            d.global_shape(),
            global.shape()
        ));
    }
    let local_want = match want {
        Placement::Shard(dim) => {
            let range = match split {
                Some(s) => s[r].clone(),
                None => pieces(global.shape()[dim], n)[r].clone(),
            };
            Some(slice(global, dim, range))
        }
        Placement::Replicate => Some(global.clone()),
        _ => None,
    };
    match local_want {
        Some(local_want) => {
            if let Some(e) = diff(d.local(), &local_want) {
                fails.push(format!("{what}: local: {e}"));
            }
        }
        None if d.local().shape() != global.shape() => fails.push(format!(
            "{what}: a Partial local has shape {:?}, want the global {:?}",
            d.local().shape(),
            global.shape()
        )),
        None => {}
    }
    fails
}

/// [`check_local`], then `to_global` against `global`. Collective: every rank must call it.
fn check<T: Element>(
    d: &DistTensor<'_, T>,
    rank: &Rank<'_>,
    global: &Tensor<T>,
    want: Placement,
    split: Option<&[Range<usize>]>,
    what: &str,
) -> Result<Vec<String>> {
    let what = format!("{what}, {}, world {}, rank {}", T::DTYPE, rank.num_ranks(), rank.rank());
    let mut fails = check_local(d, rank, global, want, split, &what);
    let g = d.to_global()?;
    if let Some(e) = diff(&g, global) {
        fails.push(format!("{what}: to_global: {e}"));
    }
    Ok(fails)
}

/// Every placement of an `ndim`-dimensional tensor.
fn placements(ndim: usize) -> Vec<Placement> {
    let mut p: Vec<Placement> = (0..ndim).map(Placement::Shard).collect();
    p.push(Placement::Replicate);
    p.push(Placement::Partial);
    p
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

/// The global shapes the round-trip tests use: odd sizes, a dimension smaller than any world of
/// 3 or more ranks, dimensions of 1, and a 1-D tensor of a prime length.
const SHAPES: [&[usize]; 5] = [&[13], &[7, 5, 3], &[2, 9, 4], &[1, 1, 1], &[3, 17]];

// ---- from_global and to_global -----------------------------------------------------------------

fn check_round_trip<T: Element>(n: usize) {
    let world = World::threads(n).unwrap();
    let globals: Vec<Tensor<T>> =
        SHAPES.iter().enumerate().map(|(i, s)| Tensor::random(s, 100 + i as u64)).collect();
    let fails = world
        .run(|rank| {
            let r = rank.rank();
            let mut fails = Vec::new();
            for global in &globals {
                for p in placements(global.ndim()) {
                    let what = format!("from_global {:?} {p}", global.shape());
                    let d = DistTensor::from_global(rank, global, p)?;
                    fails.extend(check(&d, rank, global, p, None, &what)?);
                    // Partial from a global: rank 0 holds it, the others zeros.
                    if p == Placement::Partial {
                        let want =
                            if r == 0 { global.clone() } else { Tensor::zeros(global.shape()) };
                        if let Some(e) = diff(d.local(), &want) {
                            fails.push(format!("{what}, world {n}, rank {r}: local: {e}"));
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
fn from_global_and_to_global_round_trip_every_placement_f32() {
    for n in [1, 2, 3, 4, 5, 8] {
        check_round_trip::<f32>(n);
    }
}

#[test]
fn from_global_and_to_global_round_trip_every_placement_other_dtypes() {
    check_round_trip::<f64>(3);
    check_round_trip::<f16>(4);
    check_round_trip::<bf16>(3);
    check_round_trip::<bf16>(8);
}

// ---- from_local --------------------------------------------------------------------------------

fn check_from_local<T: Element>(n: usize) {
    let world = World::threads(n).unwrap();
    let global = Tensor::<T>::random(&[5, 11, 3], 7);
    let parts: Vec<Tensor<T>> = (0..n).map(|r| dyadic(&[4, 6], 20 + r as u64)).collect();
    let sum = exact_sum(&parts);
    let fails = world
        .run(|rank| {
            let r = rank.rank();
            let mut fails = Vec::new();
            for dim in 0..3 {
                for (kind, split) in [
                    ("array_split", pieces(global.shape()[dim], n)),
                    ("uneven", uneven_pieces(global.shape()[dim], n)),
                ] {
                    let p = Placement::Shard(dim);
                    let local = slice(&global, dim, split[r].clone());
                    let d = DistTensor::from_local(rank, local, p)?;
                    let what = format!("from_local {kind} {p}");
                    fails.extend(check(&d, rank, &global, p, Some(&split), &what)?);
                }
            }
            let d = DistTensor::from_local(rank, global.clone(), Placement::Replicate)?;
            fails.extend(check(&d, rank, &global, Placement::Replicate, None, "from_local")?);
            let d = DistTensor::from_local(rank, parts[r].clone(), Placement::Partial)?;
            fails.extend(check(&d, rank, &sum, Placement::Partial, None, "from_local")?);
            if let Some(e) = diff(d.local(), &parts[r]) {
                fails.push(format!("from_local Partial, world {n}, rank {r}: local: {e}"));
            }
            Ok(fails)
        })
        .unwrap_or_else(|e| panic!("world {n}, {}: {e}", T::DTYPE));
    assert_no_failures(fails);
}

#[test]
fn from_local_takes_uneven_and_empty_shards() {
    for n in [1, 2, 3, 4, 5, 8] {
        check_from_local::<f32>(n);
    }
    check_from_local::<bf16>(3);
    check_from_local::<f16>(6);
    check_from_local::<f64>(2);
}

// ---- redistribute ------------------------------------------------------------------------------

/// Every source placement (Shard(d) split as array_split and unevenly, Replicate, Partial made of
/// dyadic parts) redistributed to every placement.
fn check_redistribute<T: Element>(n: usize) {
    let world = World::threads(n).unwrap();
    let shapes: [&[usize]; 4] = [&[11], &[7, 5, 3], &[2, 9, 4], &[3, 1, 6]];
    let cases: Vec<(Vec<Tensor<T>>, Tensor<T>)> = shapes
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let parts: Vec<Tensor<T>> =
                (0..n).map(|r| dyadic(s, 1000 * i as u64 + r as u64)).collect();
            let global = exact_sum(&parts);
            (parts, global)
        })
        .collect();
    let fails = world
        .run(|rank| {
            let r = rank.rank();
            let mut fails = Vec::new();
            for (parts, global) in &cases {
                let ndim = global.ndim();
                // (name, source, its placement, how a Shard source is split)
                let mut sources = Vec::new();
                for dim in 0..ndim {
                    let p = Placement::Shard(dim);
                    sources.push(("from_global", DistTensor::from_global(rank, global, p)?, None));
                    let split = uneven_pieces(global.shape()[dim], n);
                    let local = slice(global, dim, split[r].clone());
                    sources.push(("uneven from_local", DistTensor::from_local(rank, local, p)?, Some(split)));
                }
                sources.push((
                    "from_local",
                    DistTensor::from_local(rank, global.clone(), Placement::Replicate)?,
                    None,
                ));
                sources.push((
                    "from_local",
                    DistTensor::from_local(rank, parts[r].clone(), Placement::Partial)?,
                    None,
                ));
                for (name, x, split) in &sources {
                    let from = x.placement();
                    let what = format!("{name} {:?} {from}", global.shape());
                    fails.extend(check(x, rank, global, from, split.as_deref(), &what)?);
                    for to in placements(ndim) {
                        let y = x.redistribute(to)?;
                        let what = format!("{what} -> redistribute({to})");
                        if to == from && split.is_some() {
                            // An uneven Shard source kept as it is may keep its own split, or
                            // be split again as array_split.
                            let what = format!("{what}, {}, world {n}, rank {r}", T::DTYPE);
                            let own = check_local(&y, rank, global, to, split.as_deref(), &what);
                            let even = check_local(&y, rank, global, to, None, &what);
                            if !own.is_empty() && !even.is_empty() {
                                fails.extend(own);
                                fails.extend(even);
                            }
                            fails.extend(check(&y, rank, global, to, split.as_deref(), &what)?
                                .into_iter()
                                .filter(|f| f.contains("to_global")));
                        } else {
                            fails.extend(check(&y, rank, global, to, None, &what)?);
                        }
                        if from == Placement::Replicate && to == Placement::Partial {
                            let want =
                                if r == 0 { global.clone() } else { Tensor::zeros(global.shape()) };
                            if let Some(e) = diff(y.local(), &want) {
                                fails.push(format!(
                                    "{what}, {}, world {n}, rank {r}: rank 0 keeps, others zero: {e}",
                                    T::DTYPE
                                ));
                            }
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
fn redistribute_between_every_pair_of_placements_f32() {
    for n in [1, 2, 3, 4, 5, 8] {
        check_redistribute::<f32>(n);
    }
}

#[test]
fn redistribute_between_every_pair_of_placements_other_dtypes() {
    check_redistribute::<bf16>(3);
    check_redistribute::<bf16>(8);
    check_redistribute::<f16>(4);
    check_redistribute::<f64>(2);
}

/// Partial tensors of random values: the sum is rounded, so compare with the exact f64 sum
/// within `(u_T + n eps_acc) * sum_r |x_r|`, and every rank must hold the same bits after
/// `redistribute(Replicate)`.
fn check_partial_random<T: Element>(n: usize) {
    let world = World::threads(n).unwrap();
    let shape = [37, 3, 19];
    let parts: Vec<Tensor<T>> = (0..n).map(|r| Tensor::random(&shape, 500 + r as u64)).collect();
    let exact = parts
        .iter()
        .fold(ndarray::ArrayD::<f64>::zeros(&shape[..]), |a, p| a + p.view().mapv(|v| v.to_f64()));
    let abs = parts.iter().fold(ndarray::ArrayD::<f64>::zeros(&shape[..]), |a, p| {
        a + p.view().mapv(|v| v.to_f64().abs())
    });
    let acc_eps = <T::Acc as Element>::EPSILON;
    let final_rounding =
        if T::DTYPE == <T::Acc as Element>::DTYPE { 0.0 } else { T::EPSILON / 2.0 };
    let tol = final_rounding + n as f64 * acc_eps;
    let close = |got: &Tensor<T>, offset: (usize, usize), what: &str| -> Option<String> {
        // `offset`: (dim, start) of this piece in the global tensor.
        let (dim, start) = offset;
        let mut worst: Option<(f64, Vec<usize>, f64, f64)> = None;
        let mut bad = 0;
        for (flat, v) in got.as_slice().iter().enumerate() {
            let mut index = unravel(flat, got.shape());
            index[dim] += start;
            let (want, bound) = (exact[&index[..]], tol * abs[&index[..]]);
            let err = (v.to_f64() - want).abs();
            if err > bound {
                bad += 1;
                if worst.as_ref().is_none_or(|w| err / bound > w.0) {
                    worst = Some((err / bound, index, v.to_f64(), want));
                }
            }
        }
        worst.map(|(ratio, index, got, want)| {
            format!(
                "{what}: {bad} elements outside the bound; worst at {index:?}: got {got}, \
                 exact {want}, {ratio:.1} x the bound"
            )
        })
    };
    let outs = world
        .run(|rank| {
            let r = rank.rank();
            let mut fails = Vec::new();
            let x = DistTensor::from_local(rank, parts[r].clone(), Placement::Partial)?;
            let what = |op: &str| format!("{op}, {}, world {n}, rank {r}", T::DTYPE);
            let g = x.to_global()?;
            if g.shape() != shape {
                fails.push(format!("{}: shape {:?}", what("to_global"), g.shape()));
            } else {
                fails.extend(close(&g, (0, 0), &what("to_global")));
            }
            let rep = x.redistribute(Placement::Replicate)?;
            if rep.local().shape() != shape {
                fails.push(format!("{}: shape {:?}", what("Replicate"), rep.local().shape()));
            } else {
                fails.extend(close(rep.local(), (0, 0), &what("Replicate")));
            }
            for dim in 0..3 {
                let s = x.redistribute(Placement::Shard(dim))?;
                let range = pieces(shape[dim], n)[r].clone();
                let mut want_shape = shape.to_vec();
                want_shape[dim] = range.len();
                let what = what(&format!("redistribute(Shard({dim}))"));
                if s.local().shape() != want_shape {
                    fails.push(format!(
                        "{what}: shape {:?}, want {want_shape:?}",
                        s.local().shape()
                    ));
                } else {
                    fails.extend(close(s.local(), (dim, range.start), &what));
                }
            }
            Ok((fails, rep.local().clone()))
        })
        .unwrap_or_else(|e| panic!("world {n}, {}: {e}", T::DTYPE));
    let first = outs[0].1.clone();
    let mut fails: Vec<Vec<String>> = Vec::new();
    for (r, (f, rep)) in outs.into_iter().enumerate() {
        fails.push(f);
        if let Some(e) = diff(&rep, &first) {
            fails.push(vec![format!(
                "Partial -> Replicate, {}, world {n}: rank {r} differs from rank 0: {e}",
                T::DTYPE
            )]);
        }
    }
    assert_no_failures(fails);
}

#[test]
fn partial_reductions_of_random_values_are_within_tolerance() {
    for n in [2, 3, 4, 8] {
        check_partial_random::<f32>(n);
        check_partial_random::<bf16>(n);
    }
    check_partial_random::<f16>(5);
    check_partial_random::<f64>(3);
}

#[test]
fn tensors_with_a_zero_dimension_round_trip_and_redistribute() {
    for n in [1, 2, 3] {
        let world = World::threads(n).unwrap();
        let fails = world
            .run(|rank| {
                let mut fails = Vec::new();
                for shape in [[0usize, 3], [4, 0]] {
                    let global = Tensor::<f32>::zeros(&shape);
                    for from in placements(2) {
                        let x = DistTensor::from_global(rank, &global, from)?;
                        let what = format!("from_global {shape:?} {from}");
                        fails.extend(check(&x, rank, &global, from, None, &what)?);
                        for to in placements(2) {
                            let y = x.redistribute(to)?;
                            let what = format!("{what} -> redistribute({to})");
                            fails.extend(check(&y, rank, &global, to, None, &what)?);
                        }
                    }
                }
                Ok(fails)
            })
            .unwrap_or_else(|e| panic!("world {n}: {e}"));
        assert_no_failures(fails);
    }
}

#[test]
fn global_shape_and_placement() {
    let out = World::threads(3)
        .unwrap()
        .run(|rank| {
            // Rank r holds r + 1 rows: 1 + 2 + 3 = 6.
            let local = Tensor::<f32>::random(&[rank.rank() + 1, 4, 2], 3);
            let d = DistTensor::from_local(rank, local, Placement::Shard(0))?;
            let c = d.redistribute(Placement::Shard(2))?;
            Ok((d.global_shape(), d.placement(), c.global_shape(), c.local().shape().to_vec()))
        })
        .unwrap();
    for (r, (shape, p, shape_c, local_c)) in out.into_iter().enumerate() {
        assert_eq!(shape, vec![6, 4, 2]);
        assert_eq!(p, Placement::Shard(0));
        assert_eq!(shape_c, vec![6, 4, 2]);
        assert_eq!(local_c, vec![6, 4, [1, 1, 0][r]], "rank {r}");
    }
    let shown: Vec<String> = [Placement::Shard(1), Placement::Replicate, Placement::Partial]
        .iter()
        .map(|p| p.to_string())
        .collect();
    assert!(shown[0].contains('1'), "{shown:?}");
    assert!(shown[0] != shown[1] && shown[1] != shown[2] && shown[0] != shown[2], "{shown:?}");
    assert_ne!(Placement::Shard(1).to_string(), Placement::Shard(2).to_string());
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

/// `Ok` when `got` is an error accepted by `ok`, else why not.
fn expect_err<V>(got: Result<V>, what: &str, ok: impl Fn(&Error) -> bool) -> Vec<String> {
    match got {
        Err(e) if ok(&e) => vec![],
        Err(e) => vec![format!("{what}: wrong error {e:?}")],
        Ok(_) => vec![format!("{what}: succeeded, want an error")],
    }
}

/// Whether `e` is `RanksDisagree` from `from_local` and names `rank` as one of the two.
fn disagree_naming(e: &Error, rank: usize) -> bool {
    matches!(e, Error::RanksDisagree { op, rank_a, rank_b, value_a, value_b }
        if op.contains("from_local") && (*rank_a == rank || *rank_b == rank)
            && rank_a != rank_b && value_a != value_b)
}

#[test]
fn from_local_shapes_that_disagree_are_an_error_naming_the_ranks_on_every_rank() {
    let n = 3;
    let out = run_quick(n, |rank| {
        let r = rank.rank();
        let mut fails = Vec::new();
        let what = |case: &str| format!("{case}, rank {r}");
        // Shard(0): the other dims must agree; rank 2 has 6 columns, the others 5.
        let local = Tensor::<f32>::random(&[r + 1, if r == 2 { 6 } else { 5 }], 1);
        let got = DistTensor::from_local(rank, local, Placement::Shard(0));
        fails.extend(expect_err(got, &what("Shard(0), rank 2 has 6 columns"), |e| {
            disagree_naming(e, 2)
        }));
        // Shard(1): rank 1 has a different number of dimensions.
        let shape: &[usize] = if r == 1 { &[4, 2, 1] } else { &[4, 2] };
        let got =
            DistTensor::from_local(rank, Tensor::<f32>::random(shape, 2), Placement::Shard(1));
        fails.extend(expect_err(got, &what("Shard(1), rank 1 is 3-D"), |e| disagree_naming(e, 1)));
        // Replicate: all shapes equal, rank 1 has one more row.
        let got = DistTensor::from_local(
            rank,
            Tensor::<f32>::random(&[3 + usize::from(r == 1), 4], 3),
            Placement::Replicate,
        );
        fails.extend(expect_err(got, &what("Replicate, rank 1 has 4 rows"), |e| {
            disagree_naming(e, 1)
        }));
        // Partial: rank 0 differs in the last dim.
        let got = DistTensor::from_local(
            rank,
            Tensor::<f32>::random(&[2, if r == 0 { 7 } else { 8 }], 4),
            Placement::Partial,
        );
        fails.extend(expect_err(got, &what("Partial, rank 0 has 7 columns"), |e| {
            disagree_naming(e, 0)
        }));
        // The world still works after the rejected calls.
        let global = Tensor::<f32>::random(&[5, 3], 9);
        let d = DistTensor::from_global(rank, &global, Placement::Shard(0))?;
        fails.extend(check(&d, rank, &global, Placement::Shard(0), None, "after the errors")?);
        Ok(fails)
    });
    assert_no_failures(out);
}

#[test]
fn from_local_error_message_names_the_ranks_and_shapes() {
    let out = run_quick(4, |rank| {
        let r = rank.rank();
        let local = Tensor::<f32>::random(&[2, if r == 3 { 9 } else { 5 }], 1);
        Ok(DistTensor::from_local(rank, local, Placement::Shard(0)).map(|_| ()).unwrap_err())
    });
    for (r, e) in out.iter().enumerate() {
        let text = e.to_string();
        assert!(text.contains("rank 3"), "rank {r}: {text}");
        assert!(text.contains('9') && text.contains('5'), "rank {r}: {text}");
        assert_eq!(text, out[0].to_string(), "every rank reports the same disagreement");
    }
}

#[test]
fn a_shard_dim_out_of_range_is_an_error_on_every_rank() {
    let out = run_quick(3, |rank| {
        let r = rank.rank();
        let mut fails = Vec::new();
        let t = Tensor::<f32>::random(&[4, 5], 1);
        let out_of_range = |dim: usize, ndim: usize| move |e: &Error| matches!(e, Error::DimOutOfRange { dim: d, ndim: k, .. } if *d == dim && *k == ndim);
        // from_local: each rank passes its own placement, so the error names a rank
        // (InvalidArgument, as documented; DimOutOfRange has no rank field).
        let got = DistTensor::from_local(rank, t.clone(), Placement::Shard(2));
        fails.extend(expect_err(
            got,
            &format!("from_local Shard(2) of 2-D, rank {r}"),
            |e| matches!(e, Error::InvalidArgument { op, .. } if op.contains("from_local")),
        ));
        // Only rank 2 is out of range: every rank gets an error blaming it.
        let p = if r == 2 { Placement::Shard(5) } else { Placement::Shard(0) };
        let got = DistTensor::from_local(rank, t.clone(), p);
        fails.extend(expect_err(
            got,
            &format!("from_local, only rank 2 passes Shard(5), rank {r}"),
            |e| matches!(e, Error::InvalidArgument { rank: 2, .. }) || disagree_naming(e, 2),
        ));
        let got = DistTensor::from_global(rank, &t, Placement::Shard(5));
        fails.extend(expect_err(got, "from_global Shard(5) of 2-D", out_of_range(5, 2)));
        let d = DistTensor::from_global(rank, &t, Placement::Shard(0))?;
        let got = d.redistribute(Placement::Shard(3));
        fails.extend(expect_err(got, "redistribute to Shard(3) of 2-D", out_of_range(3, 2)));
        // And the tensor still works.
        fails.extend(check(&d, rank, &t, Placement::Shard(0), None, "after the errors")?);
        Ok(fails)
    });
    assert_no_failures(out);
}

#[test]
fn from_local_placements_that_disagree_are_an_error_on_every_rank() {
    let out = run_quick(3, |rank| {
        let r = rank.rank();
        let mut fails = Vec::new();
        let t = Tensor::<f32>::random(&[4, 5], 1);
        let p = if r == 1 { Placement::Replicate } else { Placement::Shard(0) };
        let got = DistTensor::from_local(rank, t.clone(), p);
        fails.extend(expect_err(
            got,
            &format!("from_local, rank 1 Replicate, others Shard(0), rank {r}"),
            |e| disagree_naming(e, 1),
        ));
        let p = if r == 0 { Placement::Shard(1) } else { Placement::Shard(0) };
        let got = DistTensor::from_local(rank, t.clone(), p);
        fails.extend(expect_err(
            got,
            &format!("from_local, rank 0 Shard(1), others Shard(0), rank {r}"),
            |e| disagree_naming(e, 0),
        ));
        let d = DistTensor::from_local(rank, t.clone(), Placement::Replicate)?;
        fails.extend(check(&d, rank, &t, Placement::Replicate, None, "after the errors")?);
        Ok(fails)
    });
    assert_no_failures(out);
}

/// A weight that does not fit its rank's rows: the error names the rank, its local shape and the
/// input's global shape (issue 30: users read shape errors against the shapes they wrote).
#[test]
fn product_shape_errors_name_the_global_shape_beside_the_local_one() {
    for (op, w_rows) in [("all_gather_matmul", [5, 4, 5]), ("matmul_reduce_scatter", [2, 3, 1])] {
        let err = World::threads(3)
            .unwrap()
            .run(|rank| {
                let r = rank.rank();
                if op == "all_gather_matmul" {
                    // x: global [7, 5] by rows; rank 1's weight has 4 rows, not 5.
                    let x = DistTensor::from_global(
                        rank,
                        &Tensor::<f32>::random(&[7, 5], 1),
                        Placement::Shard(0),
                    )?;
                    x.all_gather_matmul(&Tensor::random(&[w_rows[r], 2], 2))?;
                } else {
                    // x: global [4, 6] by columns (2 each); rank 1's weight has 3 rows, not 2.
                    let x = DistTensor::from_global(
                        rank,
                        &Tensor::<f32>::random(&[4, 6], 1),
                        Placement::Shard(1),
                    )?;
                    let w_rows = if r == 1 { 3 } else { 2 };
                    x.matmul_reduce_scatter(&Tensor::random(&[w_rows, 3], 2))?;
                }
                Ok(())
            })
            .expect_err("a weight that does not fit fails the run");
        // The local left operand's inner dimension: K for the gather, rank 1's k_r for the sum.
        let (want_inner, want_global): (usize, &[usize]) =
            if op == "all_gather_matmul" { (5, &[7, 5]) } else { (2, &[4, 6]) };
        match err.rank_error() {
            Error::InnerDimMismatch { op: o, rank: 1, left, left_global: Some(global), .. } => {
                assert!(o.contains(op), "{op}: {err}");
                assert_eq!(global.as_slice(), want_global, "{op}: {err}");
                assert_eq!(left.last(), Some(&want_inner), "{op}: {err}");
                let text = err.rank_error().to_string();
                assert!(text.contains(&format!("global {want_global:?}")), "{op}: {text}");
            }
            other => panic!(
                "{op}: want InnerDimMismatch naming rank 1 and the global shape, got {other}"
            ),
        }
    }
}
