//! The user-side methods of `DistTensor`: local-only updates (`map_local`, `zip_local`,
//! `local_mut`, `cast`, `reshape`, `permute`), splits (`Split`, `from_global_split`,
//! `redistribute_split`, `matmul_reduce_scatter_split`) and the matmul ops on `[..., K]` inputs,
//! against the same operations on the global tensor.
//!
//! Worlds of 1 to 8 ranks; sequence lengths that are prime and smaller than some worlds (ranks
//! with no rows), heads that do not divide by the world, empty shards in explicit splits.
//!
//! Data movement (splits, reshapes, permutes, casts) must be bitwise exact. Products are checked
//! against f64 references with the bound of `tests/fused_ops.rs`: `|got - want| <= tol * scale`
//! with `scale = sum_p |a_p| |b_p|` and `tol = u_T (half types) + (t + 1) eps_acc`, `t` the number
//! of terms summed (`K`, plus the world size for a reduce-scatter).

use std::time::Duration;

use dist_tensor::{DistTensor, Element, Error, Placement, Rank, Result, Split, Tensor, World};
use half::bf16;
use ndarray::{ArrayD, IxDyn};

mod common;

use common::{assert_none, bits_equal, dyadic, f64s, slice, tolerance_rounded as tolerance};

// ---- helpers --------------------------------------------------------------------------------

fn run<R: Send>(n: usize, f: impl Fn(&Rank<'_>) -> Result<R> + Sync) -> Vec<R> {
    World::threads(n).expect("a world").run(f).expect("the run succeeds")
}

/// Rank `r`'s piece of `t` along `dim` for the split `sizes`.
fn piece<T: Element>(t: &Tensor<T>, dim: usize, sizes: &[usize], r: usize) -> Tensor<T> {
    slice(t, dim, common::ranges(sizes)[r].clone())
}

/// A split that is not the even one: reversed, with rank 1 (when there is one) empty.
fn uneven(len: usize, n: usize) -> Vec<usize> {
    let mut sizes = common::array_split(len, n);
    sizes.reverse();
    if n > 1 {
        sizes[0] += sizes[1];
        sizes[1] = 0;
    }
    sizes
}

/// The sizes a split must give, worked out here (not by `Split::sizes`, which is under test).
fn expected_sizes(split: &Split, len: usize, n: usize) -> Vec<usize> {
    match split {
        Split::Even => common::array_split(len, n),
        Split::Units(unit) => common::array_split(len / unit, n).iter().map(|u| u * unit).collect(),
        Split::Sizes(sizes) => sizes.clone(),
    }
}

/// `[..., K] @ [K, N]` in f64 and its scale `|x| @ |w|`.
fn product(x: &ArrayD<f64>, w: &ArrayD<f64>) -> (ArrayD<f64>, ArrayD<f64>) {
    let k = *x.shape().last().unwrap();
    let rows = x.len() / k.max(1);
    let x2 = x.view().into_shape_with_order((rows, k)).unwrap();
    let w2 = w.view().into_dimensionality::<ndarray::Ix2>().unwrap();
    let mut shape = x.shape().to_vec();
    *shape.last_mut().unwrap() = w2.ncols();
    let want = x2.dot(&w2).into_shape_with_order(IxDyn(&shape)).unwrap();
    let scale =
        x2.mapv(f64::abs).dot(&w2.mapv(f64::abs)).into_shape_with_order(IxDyn(&shape)).unwrap();
    (want, scale)
}

/// What is wrong with `got` against `want` within `tol * scale`, if anything.
fn check_close<T: Element>(
    what: &str,
    got: &Tensor<T>,
    want: &ArrayD<f64>,
    scale: &ArrayD<f64>,
    tol: f64,
) -> Option<String> {
    if got.shape() != want.shape() {
        return Some(format!("{what}: shape {:?}, want {:?}", got.shape(), want.shape()));
    }
    let g = f64s(got);
    let bad = g.iter().zip(want).zip(scale).position(|((g, w), s)| {
        let within = (g - w).abs() <= tol * s.max(1e-300); // false for NaN
        !within
    });
    bad.map(|i| {
        format!(
            "{what} ({}): element {i} of {:?}: got {}, want {}",
            T::DTYPE,
            got.shape(),
            g.iter().nth(i).unwrap(),
            want.iter().nth(i).unwrap()
        )
    })
}

// ---- local-only updates ---------------------------------------------------------------------

/// Local updates exchange nothing: one rank alone calls them all while its peers call nothing.
/// Any exchange (or collective allocation) would wait for the peers and time out.
#[test]
fn local_updates_exchange_nothing() {
    let world =
        World::builder(3).wait_timeout(Duration::from_millis(300)).build().expect("a world");
    let global = Tensor::<f32>::random(&[5, 3 * 4], 1);
    let out = world
        .run(|rank| {
            let x = DistTensor::from_global_split(rank, &global, 1, Split::Units(4))?;
            if rank.rank() != 0 {
                return Ok(0);
            }
            let y = x.map_local(|t| t.gelu())?;
            let y = y.try_map_local(|t| t.softmax(1))?;
            let z = y.zip_local(&x, |a, b| a + b)?;
            let mut z = z.reshape(&[5, 3, 4])?.permute(&[1, 0, 2])?.cast::<bf16>()?;
            z.local_mut().fill(bf16::ONE);
            let z = z.redistribute_split(0, z.shard_sizes())?; // the split it has: nothing to do
            let r = DistTensor::from_global(rank, &global, Placement::Replicate)?;
            let r = r.redistribute_split(1, Split::Units(4))?; // a local slice
            Ok(z.local().len() + r.local().len())
        })
        .expect("no local update communicates");
    assert_eq!(out[0], 5 * 4 + 5 * 4); // one head of 4 columns, twice
}

fn check_map_and_zip<T: Element>(n: usize) -> Vec<String> {
    let global = dyadic::<T>(&[7, 5], 1);
    let other = dyadic::<T>(&[7, 5], 2);
    let w = Tensor::<T>::random(&[5, 3], 3);
    let placements =
        [Placement::Shard(0), Placement::Shard(1), Placement::Replicate, Placement::Partial];
    let outs = run(n, |rank| {
        let mut fails = Vec::new();
        for p in placements {
            let x = DistTensor::from_global(rank, &global, p)?;
            let y = DistTensor::from_global(rank, &other, p)?;
            // Linear and exact in every type: doubling, and adding dyadic values.
            let doubled = x.map_local(|t| t * T::from_f64(2.0))?.to_global()?;
            if !bits_equal(&doubled, &(&global * T::from_f64(2.0))) {
                fails.push(format!("{} map_local(* 2) of {p} on {n} ranks", T::DTYPE));
            }
            let sum = x.zip_local(&y, |a, b| a + b)?.to_global()?;
            if !bits_equal(&sum, &(&global + &other)) {
                fails.push(format!("{} zip_local(+) of {p} on {n} ranks", T::DTYPE));
            }
            let cast = x.cast::<f64>()?;
            if cast.placement() != p || !bits_equal(&cast.to_global()?, &global.cast::<f64>()) {
                fails.push(format!("{} cast of {p} on {n} ranks", T::DTYPE));
            }
            let mut m = x.clone();
            m.local_mut().mapv_inplace(|v| T::from_f64(v.to_f64() * 4.0));
            if !bits_equal(&m.to_global()?, &(&global * T::from_f64(4.0))) {
                fails.push(format!("{} local_mut of {p} on {n} ranks", T::DTYPE));
            }
            if x.local() != &DistTensor::from_global(rank, &global, p)?.into_local() {
                fails.push(format!("{} local_mut wrote through to a clone, {p}", T::DTYPE));
            }
        }
        // A local product with a replicated weight changes a dimension that is not sharded.
        let rows = DistTensor::from_global(rank, &global, Placement::Shard(0))?;
        let y = rows.try_map_local(|t| t.matmul(&w))?;
        if y.global_shape() != vec![7, 3] || y.placement() != Placement::Shard(0) {
            fails.push(format!("map_local product: {:?} {}", y.global_shape(), y.placement()));
        }
        let (want, scale) = product(&f64s(&global), &f64s(&w));
        fails.extend(check_close(
            "map_local product",
            &y.to_global()?,
            &want,
            &scale,
            tolerance::<T>(5, 1.0),
        ));
        // Changing the sharded dimension is refused, on this rank, naming it.
        match rows.map_local(|t| t.sum_axis(1).unwrap()) {
            Err(Error::InvalidShape { op: "DistTensor::map_local", reason })
                if reason.contains(&format!("rank {}", rank.rank())) => {}
            other => fails.push(format!("map_local dropping a dimension: {other:?}")),
        }
        let cols = DistTensor::from_global(rank, &global, Placement::Shard(1))?;
        if cols.map_local(|t| t.transpose(0, 1).unwrap()).is_ok() {
            fails.push("map_local changing the sharded dimension's size was accepted".to_string());
        }
        // Tensors laid out differently do not zip.
        let rows2 = DistTensor::from_global_split(rank, &other, 0, uneven(7, rank.num_ranks()))?;
        let differ = rows.shard_sizes() != rows2.shard_sizes();
        match rows.zip_local(&rows2, |a, b| a + b) {
            Err(Error::InvalidArgument { op: "DistTensor::zip_local", .. }) if differ => {}
            Ok(_) if !differ => {}
            other => fails.push(format!("zip_local of different splits: {other:?}")),
        }
        Ok(fails)
    });
    outs.into_iter().flatten().collect()
}

#[test]
fn local_updates_match_the_same_op_on_the_global_tensor() {
    let mut fails = Vec::new();
    for n in 1..=8 {
        fails.extend(check_map_and_zip::<f32>(n));
        fails.extend(check_map_and_zip::<bf16>(n));
    }
    assert_none(fails);
}

// ---- reshape and permute --------------------------------------------------------------------

/// Reshapes of `[B = 2, S = 7, H * D = 3 * 4]` under several placements: (placement, split of
/// the sharded dimension or `None` for the even one, new shape, valid for every world).
fn reshape_cases(n: usize) -> Vec<(Placement, Option<Split>, Vec<usize>, bool)> {
    let s = Placement::Shard;
    vec![
        (s(2), Some(Split::Units(4)), vec![2, 7, 3, 4], true), // heads split whole
        (s(2), Some(Split::Units(4)), vec![14, 12], true),     // rows merged, columns stay
        (s(2), Some(Split::Units(4)), vec![168], n == 1),      // columns of rows interleave
        (s(1), None, vec![2, 7, 3, 4], true),                  // the sequence stays
        (s(1), None, vec![14, 12], n == 1),                    // B > 1 interleaves the sequence
        (s(1), None, vec![2, 84], true),                       // S merged with what follows
        (s(0), None, vec![14, 12], true),                      // B merged with S
        (s(0), None, vec![168], true),
        (s(0), None, vec![2, 1, 7, 12], true),
        (Placement::Replicate, None, vec![4, 42], true),
        (Placement::Partial, None, vec![12, 14], true),
    ]
}

fn check_reshape_and_permute<T: Element>(n: usize) -> Vec<String> {
    let global = Tensor::<T>::random(&[2, 7, 12], 4);
    let outs = run(n, |rank| {
        let mut fails = Vec::new();
        for (p, split, shape, valid) in reshape_cases(n) {
            let x = match (p, &split) {
                (Placement::Shard(d), Some(split)) => {
                    DistTensor::from_global_split(rank, &global, d, split.clone())?
                }
                _ => DistTensor::from_global(rank, &global, p)?,
            };
            // Torn heads: only when the even split is not in whole heads does it refuse.
            let case = format!("{} {p} {split:?} -> {shape:?} on {n} ranks", T::DTYPE);
            match x.reshape(&shape) {
                Ok(y) => {
                    let want = global.reshape(&shape)?;
                    if !bits_equal(&y.to_global()?, &want) {
                        fails.push(format!("{case}: wrong global tensor"));
                    }
                    if let Placement::Shard(nd) = y.placement()
                        && !bits_equal(y.local(), &piece(&want, nd, y.shard_sizes(), rank.rank()))
                    {
                        fails.push(format!("{case}: wrong local part"));
                    }
                    if !valid && n > 1 && x.shard_sizes().iter().filter(|&&s| s > 0).count() > 1 {
                        fails.push(format!("{case}: accepted, but it interleaves the ranks"));
                    }
                }
                Err(Error::InvalidShape { op: "DistTensor::reshape", .. }) if !valid => {}
                Err(e) => fails.push(format!("{case}: {e}")),
            }
            // Permutes move the sharded dimension with the data.
            let axes = [2, 0, 1];
            let y = x.permute(&axes)?;
            let want = global.permute(&axes)?;
            let expected = match p {
                Placement::Shard(d) => Placement::Shard(axes.iter().position(|&a| a == d).unwrap()),
                other => other,
            };
            if y.placement() != expected || !bits_equal(&y.to_global()?, &want) {
                fails.push(format!("{case}: permute {axes:?} gave {}", y.placement()));
            }
        }
        // Sizes that differ are refused; so are bad axes.
        let x = DistTensor::from_global(rank, &global, Placement::Shard(1))?;
        if !matches!(x.reshape(&[2, 7, 11]), Err(Error::InvalidShape { .. })) {
            fails.push("a reshape of another size was accepted".to_string());
        }
        if !matches!(x.permute(&[0, 0, 1]), Err(Error::InvalidShape { .. })) {
            fails.push("a permute that repeats an axis was accepted".to_string());
        }
        // Columns cut in the middle of a head cannot become heads (12 columns of 3 heads on 5
        // ranks even: 3, 3, 2, 2, 2).
        let torn = DistTensor::from_global(rank, &global, Placement::Shard(2))?;
        let whole_heads = torn.shard_sizes().iter().all(|s| s % 4 == 0);
        if torn.reshape(&[2, 7, 3, 4]).is_ok() != whole_heads {
            fails.push(format!(
                "heads {:?} on {n} ranks: reshape into heads disagrees",
                torn.shard_sizes()
            ));
        }
        Ok(fails)
    });
    outs.into_iter().flatten().collect()
}

#[test]
fn reshape_and_permute_carry_the_sharding() {
    let mut fails = Vec::new();
    for n in 1..=8 {
        fails.extend(check_reshape_and_permute::<f32>(n));
    }
    fails.extend(check_reshape_and_permute::<bf16>(3));
    assert_none(fails);
}

// ---- splits ---------------------------------------------------------------------------------

fn check_splits<T: Element>(n: usize) -> Vec<String> {
    // 5 rows (fewer than some worlds), 3 heads of 4 columns (heads do not divide most worlds).
    let global = dyadic::<T>(&[5, 12], 7);
    let outs = run(n, |rank| {
        let (me, mut fails) = (rank.rank(), Vec::new());
        let targets = [
            (0, Split::Even),
            (0, Split::Sizes(uneven(5, n))),
            (1, Split::Units(4)),
            (1, Split::Sizes(uneven(12, n))),
        ];
        let sources =
            [Placement::Shard(0), Placement::Shard(1), Placement::Replicate, Placement::Partial];
        for (dim, split) in &targets {
            let sizes = expected_sizes(split, global.shape()[*dim], n);
            let want = piece(&global, *dim, &sizes, me);
            let x = DistTensor::from_global_split(rank, &global, *dim, split.clone())?;
            if x.placement() != Placement::Shard(*dim)
                || x.shard_sizes() != sizes
                || !bits_equal(x.local(), &want)
            {
                fails
                    .push(format!("{} from_global_split({dim}, {split:?}) on {n} ranks", T::DTYPE));
            }
            if !bits_equal(&x.to_global()?, &global) {
                fails.push(format!(
                    "{} from_global_split({dim}, {split:?}) round trip on {n} ranks",
                    T::DTYPE
                ));
            }
            // From every placement, and from the other splits of the same dimension.
            let mut froms: Vec<(String, DistTensor<'_, T>)> = Vec::new();
            for p in sources {
                froms.push((p.to_string(), DistTensor::from_global(rank, &global, p)?));
            }
            for (d2, s2) in &targets {
                let from = DistTensor::from_global_split(rank, &global, *d2, s2.clone())?;
                froms.push((format!("Shard({d2}) {s2:?}"), from));
            }
            for (from, x) in froms {
                let y = x.redistribute_split(*dim, split.clone())?;
                if y.placement() != Placement::Shard(*dim)
                    || y.shard_sizes() != sizes
                    || !bits_equal(y.local(), &want)
                {
                    fails.push(format!(
                        "{} redistribute_split({dim}, {split:?}) from {from} on {n} ranks: local {:?}, want {:?}",
                        T::DTYPE,
                        y.local().shape(),
                        want.shape()
                    ));
                }
            }
        }
        // Splits that do not fit are errors naming the op.
        for bad in [
            Split::Units(5),
            Split::Units(0),
            Split::Sizes(vec![13; n]),
            Split::Sizes(vec![1; n + 1]),
        ] {
            match DistTensor::from_global_split(rank, &global, 1, bad.clone()) {
                Err(Error::InvalidArgument { op: "DistTensor::from_global_split", .. }) => {}
                other => fails.push(format!("from_global_split with {bad:?}: {other:?}")),
            }
        }
        if !matches!(
            DistTensor::from_global_split(rank, &global, 2, Split::Even),
            Err(Error::DimOutOfRange { .. })
        ) {
            fails.push("from_global_split on dimension 2 of a 2-D tensor".to_string());
        }
        let x = DistTensor::from_global(rank, &global, Placement::Shard(0))?;
        if !matches!(x.redistribute_split(2, Split::Even), Err(Error::DimOutOfRange { .. })) {
            fails.push("redistribute_split on dimension 2 of a 2-D tensor".to_string());
        }
        Ok(fails)
    });
    outs.into_iter().flatten().collect()
}

#[test]
fn splits_in_units_and_sizes_from_every_placement() {
    let mut fails = Vec::new();
    for n in 1..=8 {
        fails.extend(check_splits::<f32>(n));
    }
    fails.extend(check_splits::<bf16>(3));
    fails.extend(check_splits::<f64>(5));
    assert_none(fails);
}

/// `Split::sizes` against tables written by hand (numpy.array_split of the length, or of the
/// units): none of these expectations is computed.
#[test]
fn split_sizes_match_hand_written_tables() {
    let table: &[(Split, usize, usize, &[usize])] = &[
        (Split::Even, 5, 4, &[2, 1, 1, 1]),
        (Split::Even, 2, 4, &[1, 1, 0, 0]),
        (Split::Even, 0, 3, &[0, 0, 0]),
        (Split::Even, 7, 1, &[7]),
        (Split::Even, 64, 3, &[22, 21, 21]),
        (Split::Even, 13, 8, &[2, 2, 2, 2, 2, 1, 1, 1]),
        (Split::Even, 12, 5, &[3, 3, 2, 2, 2]),
        // 5 heads of one column on 4 ranks.
        (Split::Units(1), 5, 4, &[2, 1, 1, 1]),
        // 5 heads of 4 columns on 4 ranks.
        (Split::Units(4), 20, 4, &[8, 4, 4, 4]),
        // 6 units of 2 on 4 ranks.
        (Split::Units(2), 12, 4, &[4, 4, 2, 2]),
        (Split::Units(8), 64, 3, &[24, 24, 16]),
        (Split::Units(3), 9, 4, &[3, 3, 3, 0]),
        (Split::Units(4), 12, 5, &[4, 4, 4, 0, 0]),
        (Split::Units(5), 35, 3, &[15, 10, 10]),
        (Split::Units(4), 0, 2, &[0, 0]),
        (Split::Sizes(vec![10, 6]), 16, 2, &[10, 6]),
        (Split::Sizes(vec![0, 5, 0]), 5, 3, &[0, 5, 0]),
        (Split::Sizes(vec![3]), 3, 1, &[3]),
    ];
    for (split, len, world, want) in table {
        assert_eq!(split.sizes(*len, *world).unwrap(), *want, "{split:?}.sizes({len}, {world})");
    }
}

/// `Split::Units` cuts the units as numpy.array_split does (the first ranks one more), not as
/// `torch.chunk` (ceil-sized pieces, the last ones short or empty): the two agree on most
/// small cases, not on these.
#[test]
fn split_units_cut_as_array_split_not_as_chunk() {
    // (unit, len, world), then array_split's and torch.chunk's cut.
    type Case = ((usize, usize, usize), &'static [usize], &'static [usize]);
    let table: &[Case] = &[
        ((4, 20, 4), &[8, 4, 4, 4], &[8, 8, 4, 0]),
        ((2, 12, 4), &[4, 4, 2, 2], &[4, 4, 4, 0]),
        ((1, 5, 4), &[2, 1, 1, 1], &[2, 2, 1, 0]),
        ((3, 30, 4), &[9, 9, 6, 6], &[9, 9, 9, 3]),
    ];
    for &((unit, len, world), want, chunk) in table {
        let got = Split::Units(unit).sizes(len, world).unwrap();
        assert_eq!(got, want, "Units({unit}).sizes({len}, {world})");
        assert_ne!(got, chunk, "Units({unit}).sizes({len}, {world}) cut as torch.chunk");
    }
    // And a tensor split so puts those columns on those ranks: 5 heads of 4 columns on 4 ranks.
    let global = dyadic::<f32>(&[3, 20], 9);
    let locals = run(4, |rank| {
        let x = DistTensor::from_global_split(rank, &global, 1, Split::Units(4))?;
        Ok((x.shard_sizes().to_vec(), x.local().clone()))
    });
    for (r, (sizes, local)) in locals.iter().enumerate() {
        assert_eq!(sizes, &[8, 4, 4, 4]);
        let cols = [0..8, 8..12, 12..16, 16..20][r].clone();
        assert!(bits_equal(local, &slice(&global, 1, cols)), "rank {r}'s columns");
    }
}

// ---- matmul ops on [..., K] -----------------------------------------------------------------

/// `x` of `shape` sharded on `dim` (evenly, or as `uneven`), through all_gather_matmul with a
/// column-sharded weight, GELU, and matmul_reduce_scatter with the row-sharded second weight:
/// against f64 at each step, with the output split as the input's.
fn check_nd_block<T: Element>(
    n: usize,
    shape: &[usize],
    dim: usize,
    uneven_split: bool,
    fused: bool,
) -> Vec<String> {
    let (k, f, out) = (*shape.last().unwrap(), 6, 5);
    let x = Tensor::<T>::random(shape, 11);
    let w1 = Tensor::<T>::random(&[k, f], 12);
    let w2 = Tensor::<T>::random(&[f, out], 13);
    let case = format!(
        "{} {shape:?} Shard({dim}) {} {} on {n} ranks",
        T::DTYPE,
        if uneven_split { "uneven" } else { "even" },
        if fused { "fused" } else { "unfused" }
    );
    // References: h = x @ w1 (rounded to T, as the op returns it), g = gelu(h), y = g @ w2.
    let (h_want, h_scale) = product(&f64s(&x), &f64s(&w1));
    let outs = run(n, |rank| {
        let mut fails = Vec::new();
        let sizes =
            if uneven_split { uneven(shape[dim], n) } else { common::array_split(shape[dim], n) };
        let xs = DistTensor::from_global_split(rank, &x, dim, sizes.clone())?;
        let w1s = DistTensor::from_global(rank, &w1, Placement::Shard(1))?;
        let w2s = DistTensor::from_global(rank, &w2, Placement::Shard(0))?;
        let h = if fused {
            xs.all_gather_matmul(w1s.local())?
        } else {
            xs.all_gather_matmul_unfused(w1s.local())?
        };
        let last = shape.len() - 1;
        if h.placement() != Placement::Shard(last) {
            fails.push(format!("{case}: all_gather_matmul gave {}", h.placement()));
        }
        let h_global = h.to_global()?;
        fails.extend(check_close(
            &format!("{case}: x @ w1"),
            &h_global,
            &h_want,
            &h_scale,
            tolerance::<T>(k, 1.0),
        ));
        let g = h.map_local(|t| t.gelu())?;
        let y = if fused {
            g.matmul_reduce_scatter(w2s.local())?
        } else {
            g.matmul_reduce_scatter_unfused(w2s.local())?
        };
        // The output comes back split as x was (the default), so the residual lines up.
        if y.placement() != Placement::Shard(dim) || y.shard_sizes() != sizes.as_slice() {
            fails.push(format!(
                "{case}: matmul_reduce_scatter gave {} {:?}, want Shard({dim}) {sizes:?}",
                y.placement(),
                y.shard_sizes()
            ));
            return Ok(fails);
        }
        // Reference from the gathered g as the ranks hold it (rounded to T).
        let g_global = g.to_global()?;
        let (y_want, y_scale) = product(&f64s(&g_global), &f64s(&w2));
        let roundings = if fused { 1.0 } else { 2.0 };
        let y_global = y.to_global()?;
        fails.extend(check_close(
            &format!("{case}: g @ w2"),
            &y_global,
            &y_want,
            &y_scale,
            tolerance::<T>(f + n, roundings),
        ));
        // The local part is this rank's piece of the whole.
        let mine = piece(&y_global, dim, &sizes, rank.rank());
        if !bits_equal(y.local(), &mine) {
            fails.push(format!("{case}: local part is not this rank's piece"));
        }
        let residual = y.zip_local(
            &xs.map_local(|t| t.matmul(&Tensor::<T>::random(&[k, out], 14)).unwrap())?,
            |a, b| a + b,
        );
        if residual.is_err() {
            fails.push(format!("{case}: the residual does not line up: {:?}", residual.err()));
        }
        // An explicit output split, on another leading dimension where there is one.
        let other_dim = if dim == 0 && shape.len() > 2 { 1 } else { 0 };
        let explicit = uneven(shape[other_dim], n);
        let z = g.matmul_reduce_scatter_split(w2s.local(), other_dim, explicit.clone())?;
        if z.placement() != Placement::Shard(other_dim) || z.shard_sizes() != explicit.as_slice() {
            fails.push(format!(
                "{case}: explicit split gave {} {:?}",
                z.placement(),
                z.shard_sizes()
            ));
        } else {
            fails.extend(check_close(
                &format!("{case}: explicit split"),
                &z.to_global()?,
                &y_want,
                &y_scale,
                tolerance::<T>(f + n, 1.0),
            ));
        }
        Ok(fails)
    });
    outs.into_iter().flatten().collect()
}

#[test]
fn matmul_ops_take_leading_dimensions_and_give_back_the_input_split() {
    let mut fails = Vec::new();
    for n in [1, 2, 3, 4, 5, 8] {
        for (shape, dim) in [
            (&[7, 6][..], 0),
            (&[2, 7, 6], 1),
            (&[2, 7, 6], 0),
            (&[3, 5, 2, 6], 1),
            (&[1, 13, 6], 1),
        ] {
            for uneven_split in [false, true] {
                fails.extend(check_nd_block::<f32>(n, shape, dim, uneven_split, true));
            }
        }
    }
    for n in [3, 4] {
        fails.extend(check_nd_block::<bf16>(n, &[2, 7, 6], 1, true, true));
        fails.extend(check_nd_block::<f64>(n, &[3, 5, 2, 6], 1, false, false));
        fails.extend(check_nd_block::<f32>(n, &[2, 7, 6], 1, true, false));
    }
    assert_none(fails);
}

#[test]
fn a_partial_tensor_of_leading_dimensions_reduce_scatters() {
    let (x, w) = (Tensor::<f64>::random(&[2, 5, 4], 1), Tensor::<f64>::random(&[4, 3], 2));
    let (want, scale) = product(&f64s(&x), &f64s(&w));
    for n in [1, 3, 4] {
        let outs = run(n, |rank| {
            let p = DistTensor::from_global(rank, &x, Placement::Partial)?;
            let y = p.matmul_reduce_scatter(&w)?; // no remembered split: dimension 0, evenly
            assert_eq!(y.placement(), Placement::Shard(0));
            assert_eq!(y.shard_sizes(), common::array_split(2, n).as_slice());
            y.to_global()
        });
        assert_none(
            check_close(
                "Partial [2, 5, 4] @ [4, 3]",
                &outs[0],
                &want,
                &scale,
                tolerance::<f64>(4 + n, 0.0),
            )
            .into_iter()
            .collect(),
        );
    }
}

#[test]
fn output_splits_that_do_not_fit_are_errors_on_every_rank() {
    let (h, w) = (Tensor::<f32>::random(&[2, 7, 6], 1), Tensor::<f32>::random(&[6, 3], 2));
    let outs = run(3, |rank| {
        let hs = DistTensor::from_global(rank, &h, Placement::Shard(2))?;
        let ws = DistTensor::from_global(rank, &w, Placement::Shard(0))?;
        let mut fails = Vec::new();
        if !matches!(
            hs.matmul_reduce_scatter_split(ws.local(), 2, Split::Even),
            Err(Error::DimOutOfRange { .. })
        ) {
            fails.push("an output split on the last dimension was accepted".to_string());
        }
        if !matches!(
            hs.matmul_reduce_scatter_split(ws.local(), 1, vec![7, 1, 0]),
            Err(Error::InvalidArgument { .. })
        ) {
            fails.push("an output split adding up to 8 of 7 was accepted".to_string());
        }
        // Ranks that pass different splits (each adding up) fail together, naming the op.
        let mine = [vec![7, 0, 0], vec![0, 7, 0], vec![0, 0, 7]][rank.rank()].clone();
        match hs.matmul_reduce_scatter_split(ws.local(), 1, mine) {
            Err(
                Error::InvalidArgument { op: "matmul_reduce_scatter", .. }
                | Error::RanksDisagree { op: "matmul_reduce_scatter", .. },
            ) => {}
            other => fails.push(format!("ranks with different splits: {other:?}")),
        }
        Ok(fails)
    });
    assert_none(outs.into_iter().flatten().collect());
}

#[test]
fn replicated_parts_share_the_global_tensor_until_written() {
    let global = Tensor::<f32>::random(&[64, 64], 1);
    let outs = run(4, |rank| {
        let mut x = DistTensor::from_global(rank, &global, Placement::Replicate)?;
        let shared = x.local().as_slice().as_ptr() == global.as_slice().as_ptr();
        x.local_mut()[[0, 0]] = 5.0; // copies this rank's part first
        Ok((shared, x.local().as_slice().as_ptr() != global.as_slice().as_ptr()))
    });
    assert!(outs.iter().all(|&(shared, copied)| shared && copied), "{outs:?}");
    assert_ne!(global.as_slice()[0], 5.0);
}
