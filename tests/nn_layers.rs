//! The nn layers' forward and backward passes against one-rank references in f64 and against
//! central finite differences.
//!
//! - `ColumnParallelLinear`, `RowParallelLinear` and `ParallelMlp`: output, input gradient and
//!   every parameter gradient (the shards gathered back into whole weights) against the same
//!   layer written with ndarray and its own activations and derivatives in f64
//!   (`tests/common/reference.rs`: no library math), at worlds 1 to 4, fused and
//!   unfused, in f64, f32 and bf16; shapes with rows not divisible by the world, fewer rows than
//!   ranks (ranks with none), odd widths, `[B, S, E]` sharded on the sequence.
//! - `UlyssesAttention` and `UlyssesSelfAttention`: output against attention written with plain
//!   loops (`tests/common/reference.rs`), and gradients against central finite differences of
//!   that reference or of the distributed forward pass in f64; heads not divisible by the world (and fewer heads than
//!   ranks), causal and not.
//!
//! # Tolerance
//! f64 results are compared with `1e-10` of the largest reference value. f32 and bf16 results
//! are compared relative to the largest reference value with `1e-5` and `3e-2` (every op rounds
//! its result to the element type once: f32's unit roundoff is 6e-8, bf16's 2e-3, through a
//! handful of products and sums of tens of terms). Every reference has values of order 1, so a
//! wrong shard, a dropped rank's contribution or a transposed weight is off by far more. Finite
//! differences use a step of `1e-5` in f64: their own error is about `1e-9` here, so they are
//! compared with `1e-6` of the largest gradient.

mod common;

use common::f64s;
use common::reference::{self, rel_err};
use dist_tensor::nn::{
    Activation, ColumnParallelLinear, Module, ParallelMlp, Param, RowParallelLinear,
    UlyssesAttention, UlyssesSelfAttention,
};
use dist_tensor::{DistTensor, Element, Placement, Rank, Result, Split, Tensor, World};
use half::bf16;
use ndarray::ArrayD;

/// The bound on [`rel_err`] for results in `T` (see the module docs).
fn layer_tolerance<T: Element>() -> f64 {
    match T::DTYPE {
        dist_tensor::DType::F64 => 1e-10,
        dist_tensor::DType::F32 => 1e-5,
        _ => 3e-2,
    }
}

fn assert_close(what: &str, got: &Tensor<f64>, want: &ArrayD<f64>, tol: f64) {
    let err = rel_err(&f64s(got), want);
    assert!(err <= tol, "{what}: relative error {err:.2e} above {tol:.0e}");
}

/// Whole tensors from each rank's part, sharded on `dim` (or the same on every rank).
fn gather<T: Element>(
    rank: &Rank<'_>,
    part: &Tensor<T>,
    placement: Placement,
) -> Result<Tensor<f64>> {
    Ok(DistTensor::from_local(rank, part.clone(), placement)?.to_global()?.cast())
}

/// What a layer's `backward_hooked` told its hook: each parameter's index and gradient.
type Told<T> = Vec<(usize, Tensor<T>)>;

/// A recording hook for `backward_hooked`.
fn recorder<T: Element>(told: &mut Told<T>) -> impl FnMut(usize, &Tensor<T>) -> Result<()> + '_ {
    |index, grad| {
        told.push((index, grad.clone()));
        Ok(())
    }
}

/// Checks what a hook was told against the parameters after the pass: every parameter once, in
/// `order`, each gradient the bits the parameter holds.
fn check_told<T: Element>(what: &str, told: &Told<T>, params: &[&Param<T>], order: &[usize]) {
    let indices: Vec<usize> = told.iter().map(|(i, _)| *i).collect();
    assert_eq!(indices, order, "{what}: the parameters told, in order");
    for (i, grad) in told {
        assert!(params[*i].grad().as_ref() == Some(grad), "{what}: parameter {i} told other bits");
    }
}

struct LinearCase {
    /// The input's global shape (`[..., in]`) and the dimension it is sharded on.
    x_shape: Vec<usize>,
    dim: usize,
    out: usize,
}

/// With `hooked`, the backward pass is `backward_hooked` (the bias told first, then the weight:
/// both before the input gradient), checked as [`check_told`] says; the results against the
/// reference all the same (and bit for bit against the plain pass, in [`linear_layers`]).
fn column_case<T: Element>(
    world: usize,
    case: &LinearCase,
    fused: bool,
    hooked: bool,
) -> Result<Vec<[Tensor<f64>; 4]>> {
    let k = *case.x_shape.last().unwrap();
    let x = Tensor::<f64>::random(&case.x_shape, 1);
    let (w, b) = (Tensor::<f64>::random(&[k, case.out], 2), Tensor::<f64>::random(&[case.out], 3));
    let mut dy_shape = case.x_shape.clone();
    *dy_shape.last_mut().unwrap() = case.out;
    let dy = Tensor::<f64>::random(&dy_shape, 4);
    let (xt, wt, bt, dyt) = (x.cast::<T>(), w.cast::<T>(), b.cast::<T>(), dy.cast::<T>());
    let last = dy_shape.len() - 1;
    let outs = World::threads(world)?.run(|rank| {
        let mut fc =
            ColumnParallelLinear::from_global(rank, &wt, Some(&bt), Split::Even)?.fused(fused);
        let xs = DistTensor::from_global(rank, &xt, Placement::Shard(case.dim))?;
        let (y, saved) = fc.forward(&xs)?;
        let dys = DistTensor::from_global(rank, &dyt, Placement::Shard(last))?;
        let mut told = Vec::new();
        let dx = if hooked {
            fc.backward_hooked(saved, &dys, &mut recorder(&mut told))?
        } else {
            fc.backward(saved, &dys)?
        };
        if hooked {
            check_told(&format!("column world {world}"), &told, &fc.parameters(), &[1, 0]);
        }
        assert_eq!(dx.shard_sizes(), xs.shard_sizes(), "the input gradient is split as the input");
        let [dw, db] = [0, 1].map(|i| fc.parameters()[i].grad().unwrap().clone());
        Ok([
            y.to_global()?.cast(),
            dx.to_global()?.cast(),
            gather(rank, &dw, Placement::Shard(1))?,
            gather(rank, &db, Placement::Shard(0))?,
        ])
    })?;
    let want = reference::linear(&f64s(&xt), &f64s(&wt), &f64s(&bt), &f64s(&dyt));
    for (r, got) in outs.iter().enumerate() {
        for (i, name) in
            ["output", "input gradient", "weight gradient", "bias gradient"].iter().enumerate()
        {
            let what = format!(
                "{} column world {world} {:?} fused {fused} hooked {hooked} rank {r}: {name}",
                T::DTYPE,
                case.x_shape
            );
            assert_close(&what, &got[i], &want[i], layer_tolerance::<T>());
        }
    }
    Ok(outs)
}

/// As [`column_case`]; the weight is told first, the replicated bias once summed over the ranks.
fn row_case<T: Element>(
    world: usize,
    case: &LinearCase,
    fused: bool,
    hooked: bool,
) -> Result<Vec<[Tensor<f64>; 4]>> {
    // The layer's input [..., in] has every row and this rank's columns; its output is
    // sharded on `case.dim` (as a block's input would be).
    let k = *case.x_shape.last().unwrap();
    let h = Tensor::<f64>::random(&case.x_shape, 5);
    let (w, b) = (Tensor::<f64>::random(&[k, case.out], 6), Tensor::<f64>::random(&[case.out], 7));
    let mut dy_shape = case.x_shape.clone();
    *dy_shape.last_mut().unwrap() = case.out;
    let dy = Tensor::<f64>::random(&dy_shape, 8);
    let (ht, wt, bt, dyt) = (h.cast::<T>(), w.cast::<T>(), b.cast::<T>(), dy.cast::<T>());
    let last = dy_shape.len() - 1;
    let outs = World::threads(world)?.run(|rank| {
        let mut fc =
            RowParallelLinear::from_global(rank, &wt, Some(&bt), Split::Even)?.fused(fused);
        let hs = DistTensor::from_global(rank, &ht, Placement::Shard(last))?;
        let (y, saved) = fc.forward(&hs)?;
        // The output comes back split on the first dimension (numpy.array_split): dy alike.
        let dys = DistTensor::from_global(rank, &dyt, y.placement())?;
        assert_eq!(dys.shard_sizes(), y.shard_sizes());
        let mut told = Vec::new();
        let dh = if hooked {
            fc.backward_hooked(saved, &dys, &mut recorder(&mut told))?
        } else {
            fc.backward(saved, &dys)?
        };
        if hooked {
            check_told(&format!("row world {world}"), &told, &fc.parameters(), &[0, 1]);
        }
        let [dw, db] = [0, 1].map(|i| fc.parameters()[i].grad().unwrap().clone());
        Ok([
            y.to_global()?.cast(),
            dh.to_global()?.cast(),
            gather(rank, &dw, Placement::Shard(0))?,
            db.cast(), // replicated: every rank's own, each must be right
        ])
    })?;
    let want = reference::linear(&f64s(&ht), &f64s(&wt), &f64s(&bt), &f64s(&dyt));
    for (r, got) in outs.iter().enumerate() {
        for (i, name) in
            ["output", "input gradient", "weight gradient", "bias gradient"].iter().enumerate()
        {
            let what = format!(
                "{} row world {world} {:?} fused {fused} hooked {hooked} rank {r}: {name}",
                T::DTYPE,
                case.x_shape
            );
            assert_close(&what, &got[i], &want[i], layer_tolerance::<T>());
        }
    }
    // The replicated bias gradient is bitwise the same on every rank.
    assert!(outs.iter().all(|o| o[3] == outs[0][3]));
    Ok(outs)
}

fn cases() -> Vec<LinearCase> {
    vec![
        LinearCase { x_shape: vec![7, 5], dim: 0, out: 9 },
        LinearCase { x_shape: vec![3, 4], dim: 0, out: 2 }, // fewer rows and columns than ranks
        LinearCase { x_shape: vec![1, 1], dim: 0, out: 1 },
        LinearCase { x_shape: vec![2, 5, 6], dim: 1, out: 7 }, // [B, S, E], the sequence sharded
        LinearCase { x_shape: vec![3, 2, 4], dim: 0, out: 5 },
    ]
}

fn linear_layers<T: Element>() -> Result<()> {
    for world in 1..=4 {
        for case in &cases() {
            for fused in [true, false] {
                // Hooked or not, the same bits.
                let column = column_case::<T>(world, case, fused, false)?;
                assert!(column == column_case::<T>(world, case, fused, true)?, "column, hooked");
                let row = row_case::<T>(world, case, fused, false)?;
                assert!(row == row_case::<T>(world, case, fused, true)?, "row, hooked");
            }
        }
    }
    Ok(())
}

#[test]
fn linear_layers_f64() -> Result<()> {
    linear_layers::<f64>()
}

#[test]
fn linear_layers_f32() -> Result<()> {
    linear_layers::<f32>()
}

#[test]
fn linear_layers_bf16() -> Result<()> {
    linear_layers::<bf16>()
}

/// With `hooked`, the backward pass is `backward_hooked`: W2 told first, then b1 and W1 (before
/// the input gradient), b2 once summed over the ranks; checked as [`check_told`] says.
fn mlp_case<T: Element>(
    world: usize,
    x_shape: &[usize],
    dim: usize,
    ffn: usize,
    act: Activation,
    hooked: bool,
) -> Result<Vec<[Tensor<f64>; 6]>> {
    let e = *x_shape.last().unwrap();
    let x = Tensor::<f64>::random(x_shape, 11);
    let dy = Tensor::<f64>::random(x_shape, 12);
    let (xt, dyt) = (x.cast::<T>(), dy.cast::<T>());
    let outs = World::threads(world)?.run(|rank| {
        let mut mlp = ParallelMlp::<T>::new(rank, e, ffn, act, 13)?;
        let xs = DistTensor::from_global(rank, &xt, Placement::Shard(dim))?;
        let (y, saved) = mlp.forward(&xs)?;
        assert_eq!(y.shard_sizes(), xs.shard_sizes(), "the block's output lines up with its input");
        let dys = DistTensor::from_global(rank, &dyt, Placement::Shard(dim))?;
        let mut told = Vec::new();
        let dx = if hooked {
            mlp.backward_hooked(saved, &dys, &mut recorder(&mut told))?
        } else {
            mlp.backward(saved, &dys)?
        };
        let p = mlp.parameters();
        if hooked {
            check_told(&format!("mlp world {world}"), &told, &p, &[2, 1, 0, 3]);
        }
        let g = |i: usize| p[i].grad().unwrap().clone();
        // The whole weights (every rank initialised them alike) for the reference.
        let whole = [
            gather(rank, p[0].value(), Placement::Shard(1))?,
            gather(rank, p[1].value(), Placement::Shard(0))?,
            gather(rank, p[2].value(), Placement::Shard(0))?,
            p[3].value().cast(),
        ];
        Ok((
            [
                y.to_global()?.cast(),
                dx.to_global()?.cast(),
                gather(rank, &g(0), Placement::Shard(1))?,
                gather(rank, &g(1), Placement::Shard(0))?,
                gather(rank, &g(2), Placement::Shard(0))?,
                g(3).cast(),
            ],
            whole,
        ))
    })?;
    let want = reference::mlp(&f64s(&xt), &outs[0].1.each_ref().map(f64s), act, &f64s(&dyt));
    let names =
        ["output", "input gradient", "W1 gradient", "b1 gradient", "W2 gradient", "b2 gradient"];
    for (r, (got, _)) in outs.iter().enumerate() {
        for (i, name) in names.iter().enumerate() {
            let what = format!(
                "{} mlp {act:?} world {world} {x_shape:?} hooked {hooked} rank {r}: {name}",
                T::DTYPE
            );
            assert_close(&what, &got[i], &want[i], layer_tolerance::<T>());
        }
    }
    Ok(outs.into_iter().map(|(got, _)| got).collect())
}

/// [`mlp_case`] plain and hooked: the same bits.
fn mlp_both<T: Element>(
    world: usize,
    x_shape: &[usize],
    dim: usize,
    ffn: usize,
    act: Activation,
) -> Result<()> {
    let plain = mlp_case::<T>(world, x_shape, dim, ffn, act, false)?;
    let hooked = mlp_case::<T>(world, x_shape, dim, ffn, act, true)?;
    assert!(plain == hooked, "{} mlp world {world} {x_shape:?}: hooked differs", T::DTYPE);
    Ok(())
}

#[test]
fn mlp_against_one_rank_f64_reference() -> Result<()> {
    for world in 1..=4 {
        mlp_both::<f64>(world, &[7, 6], 0, 11, Activation::Gelu)?;
        mlp_both::<f32>(world, &[2, 5, 6], 1, 10, Activation::GeluTanh)?;
        mlp_both::<bf16>(world, &[9, 8], 0, 13, Activation::Silu)?;
        mlp_both::<f32>(world, &[3, 4], 0, 5, Activation::Relu)?;
    }
    Ok(())
}

/// `sum(f(params) * r)` and its gradient checked by central differences, for every entry of
/// every whole weight of the MLP, at worlds 1 to 4, f64.
#[test]
fn mlp_gradients_match_finite_differences() -> Result<()> {
    let (m, e, ffn) = (5, 3, 7);
    let x = Tensor::<f64>::random(&[m, e], 21);
    let r = Tensor::<f64>::random(&[m, e], 22); // dL/dy for L = sum(y * r)
    let whole = [
        Tensor::<f64>::random(&[e, ffn], 23),
        Tensor::<f64>::random(&[ffn], 24),
        Tensor::<f64>::random(&[ffn, e], 25),
        Tensor::<f64>::random(&[e], 26),
    ];
    for world in 1..=4 {
        World::threads(world)?.run(|rank| {
            let build = |w: &[Tensor<f64>; 4]| -> Result<ParallelMlp<f64>> {
                let fc1 = ColumnParallelLinear::from_global(rank, &w[0], Some(&w[1]), Split::Even)?;
                let fc2 = RowParallelLinear::from_global(rank, &w[2], Some(&w[3]), Split::Even)?;
                Ok(ParallelMlp::from_layers(fc1, Activation::Gelu, fc2))
            };
            let xs = DistTensor::from_global(rank, &x, Placement::Shard(0))?;
            let rs = DistTensor::from_global(rank, &r, Placement::Shard(0))?;
            let loss = |w: &[Tensor<f64>; 4], x: &DistTensor<'_, f64>| -> Result<f64> {
                let y = build(w)?.infer(x)?.to_global()?;
                Ok((&y * &r).sum())
            };
            let mut mlp = build(&whole)?;
            let (_, saved) = mlp.forward(&xs)?;
            let dx = mlp.backward(saved, &rs)?.to_global()?;
            let p = mlp.parameters();
            let grads = [
                gather(rank, &p[0].grad().unwrap(), Placement::Shard(1))?,
                gather(rank, &p[1].grad().unwrap(), Placement::Shard(0))?,
                gather(rank, &p[2].grad().unwrap(), Placement::Shard(0))?,
                p[3].grad().unwrap().clone(),
            ];
            let h = 1e-5;
            for (i, grad) in grads.iter().enumerate() {
                for j in 0..whole[i].len() {
                    let shifted = |by: f64| {
                        let mut w = whole.clone();
                        w[i].as_mut_slice()[j] += by;
                        loss(&w, &xs)
                    };
                    let numeric = (shifted(h)? - shifted(-h)?) / (2.0 * h);
                    let analytic = grad.as_slice()[j];
                    assert!(
                        (numeric - analytic).abs() < 1e-6,
                        "world {world}, parameter {i}, entry {j}: {analytic} against {numeric}"
                    );
                }
            }
            for j in 0..x.len() {
                let shifted = |by: f64| {
                    let mut x = x.clone();
                    x.as_mut_slice()[j] += by;
                    loss(&whole, &DistTensor::from_global(rank, &x, Placement::Shard(0))?)
                };
                let numeric = (shifted(h)? - shifted(-h)?) / (2.0 * h);
                assert!(
                    (numeric - dx.as_slice()[j]).abs() < 1e-6,
                    "world {world}, input entry {j}"
                );
            }
            Ok(())
        })?;
    }
    Ok(())
}

fn ulysses_case<T: Element>(world: usize, shape: [usize; 4], causal: bool) -> Result<()> {
    let [q, k, v] = [31, 32, 33].map(|seed| Tensor::<f64>::random(&shape, seed));
    let dout = Tensor::<f64>::random(&shape, 34);
    let [qt, kt, vt, dt] = [&q, &k, &v, &dout].map(|t| t.cast::<T>());
    let attention = UlyssesAttention::new(causal);
    let outs = World::threads(world)?.run(|rank| {
        let [qs, ks, vs, ds] =
            [&qt, &kt, &vt, &dt].map(|t| DistTensor::from_global(rank, t, Placement::Shard(1)));
        let (qs, ks, vs, ds) = (qs?, ks?, vs?, ds?);
        let (out, saved) = attention.forward(&qs, &ks, &vs)?;
        assert_eq!(out.shard_sizes(), qs.shard_sizes());
        let (dq, dk, dv) = attention.backward(saved, &ds)?;
        Ok([out, dq, dk, dv].map(|t| t.to_global().map(|t| t.cast::<f64>())))
    })?;
    let want = reference::attention(&f64s(&qt), &f64s(&kt), &f64s(&vt), causal);
    for (r, got) in outs.into_iter().enumerate() {
        let [out, dq, dk, dv] = got;
        assert_close(
            &format!("{} ulysses world {world} {shape:?} rank {r}", T::DTYPE),
            &out?,
            &want,
            layer_tolerance::<T>(),
        );
        if T::DTYPE == dist_tensor::DType::F64 {
            // The gradients, by central differences of the one-rank reference.
            let l = |q: &Tensor<f64>, k: &Tensor<f64>, v: &Tensor<f64>| {
                (reference::attention(&f64s(q), &f64s(k), &f64s(v), causal) * f64s(&dout)).sum()
            };
            let h = 1e-5;
            let (dq, dk, dv) = (dq?, dk?, dv?);
            for (which, grad) in [(0, &dq), (1, &dk), (2, &dv)] {
                for j in 0..q.len() {
                    let shifted = |by: f64| {
                        let mut qkv = [q.clone(), k.clone(), v.clone()];
                        qkv[which].as_mut_slice()[j] += by;
                        l(&qkv[0], &qkv[1], &qkv[2])
                    };
                    let numeric = (shifted(h) - shifted(-h)) / (2.0 * h);
                    let analytic = grad.as_slice()[j];
                    assert!(
                        (numeric - analytic).abs() < 1e-7,
                        "world {world} {shape:?} causal {causal}: gradient {which}, entry {j}: {analytic} against {numeric}"
                    );
                }
            }
        } else {
            // Other types against the f64 run's gradients.
            let f64_grads = World::threads(1)?.run(|rank| {
                let [qs, ks, vs, ds] = [&q, &k, &v, &dout].map(|t| {
                    DistTensor::from_global(rank, &t.cast::<T>().cast::<f64>(), Placement::Shard(1))
                });
                let (_, saved) = attention.forward(&qs?, &ks?, &vs?)?;
                let (dq, dk, dv) = attention.backward(saved, &ds?)?;
                Ok([dq.to_global()?, dk.to_global()?, dv.to_global()?])
            })?;
            for (got, want) in [dq?, dk?, dv?].iter().zip(&f64_grads[0]) {
                assert_close(
                    &format!("{} ulysses gradient world {world}", T::DTYPE),
                    got,
                    &f64s(want),
                    layer_tolerance::<T>(),
                );
            }
        }
    }
    Ok(())
}

#[test]
fn ulysses_attention_against_one_rank_and_finite_differences() -> Result<()> {
    for world in 1..=4 {
        for causal in [true, false] {
            ulysses_case::<f64>(world, [2, 5, 3, 2], causal)?; // 3 heads: one rank gets none at 4
            ulysses_case::<f32>(world, [1, 7, 5, 4], causal)?;
            ulysses_case::<bf16>(world, [2, 6, 4, 3], causal)?;
        }
    }
    Ok(())
}

#[test]
fn ulysses_self_attention_gradients_match_finite_differences() -> Result<()> {
    let (b, s, e, heads) = (1, 5, 6, 3);
    let x = Tensor::<f64>::random(&[b, s, e], 41);
    let r = Tensor::<f64>::random(&[b, s, e], 42);
    let (wqkv, wo) =
        (Tensor::<f64>::random(&[e, 3 * e], 43) * 0.5, Tensor::<f64>::random(&[e, e], 44));
    // The gradients at world 1 by central differences; every world's against them.
    let h = 1e-5;
    let numeric = World::threads(1)?.run(|rank| {
        let loss = |wqkv: &Tensor<f64>, wo: &Tensor<f64>, x: &Tensor<f64>| -> Result<f64> {
            let attn = UlyssesSelfAttention::from_weights(wqkv.clone(), wo.clone(), heads, true)?;
            let y = attn.forward(&DistTensor::from_global(rank, x, Placement::Shard(1))?)?.0;
            Ok((&y.to_global()? * &r).sum())
        };
        let mut grads = [
            Tensor::<f64>::zeros(wqkv.shape()),
            Tensor::zeros(wo.shape()),
            Tensor::zeros(x.shape()),
        ];
        for (i, grad) in grads.iter_mut().enumerate() {
            for j in 0..grad.len() {
                let shifted = |by: f64| {
                    let mut all = [wqkv.clone(), wo.clone(), x.clone()];
                    all[i].as_mut_slice()[j] += by;
                    loss(&all[0], &all[1], &all[2])
                };
                grad.as_mut_slice()[j] = (shifted(h)? - shifted(-h)?) / (2.0 * h);
            }
        }
        Ok(grads)
    })?;
    for world in 1..=4 {
        let outs = World::threads(world)?.run(|rank| {
            let mut attn =
                UlyssesSelfAttention::from_weights(wqkv.clone(), wo.clone(), heads, true)?;
            let xs = DistTensor::from_global(rank, &x, Placement::Shard(1))?;
            let (_, saved) = attn.forward(&xs)?;
            let dx =
                attn.backward(saved, &DistTensor::from_global(rank, &r, Placement::Shard(1))?)?;
            Ok([
                attn.wqkv().grad().unwrap().clone(),
                attn.wo().grad().unwrap().clone(),
                dx.to_global()?,
            ])
        })?;
        for (rank, got) in outs.iter().enumerate() {
            for (i, name) in ["W_qkv", "W_o", "x"].iter().enumerate() {
                let err = got[i]
                    .as_slice()
                    .iter()
                    .zip(numeric[0][i].as_slice())
                    .fold(0.0f64, |m, (a, b)| m.max((a - b).abs()));
                assert!(err < 1e-6, "world {world} rank {rank}: gradient of {name} off by {err}");
            }
        }
        // Replicated weights: their gradients are the same bits on every rank.
        assert!(outs.iter().all(|o| o[0] == outs[0][0] && o[1] == outs[0][1]));
    }
    Ok(())
}

#[test]
fn a_gradient_of_the_wrong_rows_is_a_typed_error_on_every_rank() -> Result<()> {
    let x = Tensor::<f32>::random(&[6, 4], 1);
    let w = Tensor::<f32>::random(&[4, 4], 2);
    let err = World::threads(2)?
        .run(|rank| {
            let mut fc = ColumnParallelLinear::from_global(rank, &w, None, Split::Even)?;
            let (_, saved) =
                fc.forward(&DistTensor::from_global(rank, &x, Placement::Shard(0))?)?;
            let wrong = Tensor::<f32>::random(&[5, 4], 3); // 5 rows, the input had 6
            fc.backward(saved, &DistTensor::from_global(rank, &wrong, Placement::Shard(1))?)
                .map(drop)
        })
        .unwrap_err();
    assert!(matches!(err.rank_error(), dist_tensor::Error::InvalidShape { .. }), "{err}");
    Ok(())
}

/// ParallelMlp's fused bias and activation against its layers one by one, bit for bit, on
/// threads: shapes whose hidden width splits into whole 16-byte vectors and ones that do not.
#[test]
fn mlp_bias_and_activation_in_one_op_match_the_layers_one_by_one() -> Result<()> {
    let mut fails = Vec::new();
    for n in [1, 2, 3] {
        let world = World::threads(n)?;
        let what = format!("{n} threads");
        for shape in [(9, 16, 64), (7, 8, 20), (1, 3, 5)] {
            fails.extend(common::mlp_fused::fused_matches_layers::<f32>(&world, &what, shape)?);
            fails.extend(common::mlp_fused::fused_matches_layers::<bf16>(&world, &what, shape)?);
            fails.extend(common::mlp_fused::fused_matches_layers::<f64>(&world, &what, shape)?);
        }
    }
    assert!(fails.is_empty(), "{}", fails.join("\n"));
    Ok(())
}

/// A hook that fails ends the layer's backward pass with its error (on every rank, each hook
/// failing alike); the replicated bias keeps the gradient it had before the pass, as after any
/// failed pass.
#[test]
fn a_hook_that_fails_ends_the_backward_pass_with_its_error() -> Result<()> {
    let h = Tensor::<f64>::random(&[5, 6], 1);
    let (w, b) = (Tensor::<f64>::random(&[6, 3], 2), Tensor::<f64>::random(&[3], 3));
    let out = World::threads(2)?.run(|rank| {
        let mut fc = RowParallelLinear::from_global(rank, &w, Some(&b), Split::Even)?;
        let hs = DistTensor::from_global(rank, &h, Placement::Shard(1))?;
        let (y, saved) = fc.forward(&hs)?;
        let mut calls = 0;
        let failed = fc.backward_hooked(saved, &y, &mut |index: usize, _: &Tensor<f64>| {
            calls += 1;
            Err(dist_tensor::Error::user(format!("hook refused parameter {index}")))
        });
        let message = failed.map(drop).unwrap_err().to_string();
        Ok((message, calls, fc.bias().unwrap().grad().is_none()))
    })?;
    for (r, (message, calls, bias_untouched)) in out.into_iter().enumerate() {
        assert!(message.contains("hook refused parameter 0"), "rank {r}: {message}");
        assert_eq!(calls, 1, "rank {r}: the pass went on after the hook failed");
        assert!(bias_untouched, "rank {r}: the bias got a gradient from a failed pass");
    }
    Ok(())
}
