//! The nn layers on autograd: each layer's `forward_var` and a `backward()` through it give the
//! same output, input gradient and parameter gradients as its hand-written `forward` /
//! `backward` (kept because they keep and exchange less), at worlds 1 to 4 with uneven row and
//! head splits; the layers are `Module`s named as their checkpoints; a model mixing them with
//! the `autograd::gpt` layers (`RmsNorm`, `LayerNorm`) trains with one `AdamW::step` and gives
//! the same curve at every world; `LayerNorm` against finite differences and one rank.
//!
//! # Tolerance
//! In f64 both forms compute the same sums in nearly the same order: `1e-12` of the largest
//! value. In f32 `1e-5` (a handful of roundings of 6e-8 through sums of tens of terms). A missing
//! `sync_grads`, a transposed weight or one rank's part dropped is off by order 1.

mod common;

use common::assert_none;
use dist_tensor::autograd::gpt::{LayerNorm, RmsNorm};
use dist_tensor::autograd::{
    AdamW, DVar, GradcheckOptions, GradcheckReport, Module, Sharing, Var, gradcheck, join,
    sync_grads,
};
use dist_tensor::nn::{
    Activation, ColumnParallelLinear, NamedState, ParallelMlp, Parameters, RowParallelLinear,
    UlyssesSelfAttention, mse_loss_var,
};
use dist_tensor::{DistTensor, Element, Placement, Rank, Result, Split, Tensor, World};

fn tolerance<T: Element>() -> f64 {
    if T::DTYPE == dist_tensor::DType::F64 { 1e-12 } else { 1e-5 }
}

/// `None` when `got` is within `tol` of the largest `|want|` everywhere, else what is off.
fn off<T: Element>(what: &str, got: &Tensor<T>, want: &Tensor<T>, tol: f64) -> Option<String> {
    if got.shape() != want.shape() {
        return Some(format!("{what}: shape {:?}, want {:?}", got.shape(), want.shape()));
    }
    let scale = want.as_slice().iter().fold(1e-30f64, |m, w| m.max(w.to_f64().abs()));
    let err = got
        .as_slice()
        .iter()
        .zip(want.as_slice())
        .fold(0.0f64, |m, (g, w)| m.max((g.to_f64() - w.to_f64()).abs()));
    (err > tol * scale).then(|| format!("{what}: max error {err:.2e} of {scale:.2e}"))
}

/// One layer's two forms on `x` (sharded as given) with output gradient `dy` (laid out as the
/// output): output, input gradient and every parameter's gradient, compared on every rank.
/// (A case's inputs and its three ways to build and run the layer: one argument each.)
#[allow(clippy::too_many_arguments)]
fn both_forms<T: Element, L>(
    world: usize,
    what: &str,
    x: &Tensor<f64>,
    x_placement: Placement,
    dy: &Tensor<f64>,
    make: impl Fn(&Rank<'_>) -> Result<L> + Sync,
    hand: impl for<'r> Fn(
        &mut L,
        &DistTensor<'r, T>,
        &Tensor<T>,
    ) -> Result<(DistTensor<'r, T>, DistTensor<'r, T>)>
    + Sync,
    auto: impl for<'r> Fn(&L, &DVar<'r, T>) -> Result<DVar<'r, T>> + Sync,
) -> Result<Vec<String>>
where
    L: Parameters<T> + for<'a> Module<'a, T>,
{
    let (xt, dyt) = (x.cast::<T>(), dy.cast::<T>());
    let fails = World::threads(world)?.run(|rank| {
        let mut fails = Vec::new();
        let mut a = make(rank)?;
        let b = make(rank)?;
        let xs = DistTensor::from_global(rank, &xt, x_placement)?;
        // The hand-written pair.
        let (ya, dxa) = hand(&mut a, &xs, &dyt)?;
        // Autograd, seeded with this rank's part of the same output gradient.
        let xv = DVar::param(xs.clone());
        let yb = auto(&b, &xv)?;
        let dys = DistTensor::from_global(rank, &dyt, yb.placement())?;
        assert_eq!(dys.shard_sizes(), yb.value().shard_sizes(), "{what}: dy laid out as y");
        yb.local().backward_with(dys.into_local())?;
        sync_grads(&b, rank)?;
        let tol = tolerance::<T>();
        let r = rank.rank();
        fails.extend(off(&format!("{what} rank {r}: output"), yb.value().local(), ya.local(), tol));
        let dxb = xv.grad().expect("x is tracked");
        fails.extend(off(&format!("{what} rank {r}: input gradient"), &dxb, dxa.local(), tol));
        for ((name, v), p) in b.named_parameters().into_iter().zip(Parameters::parameters(&a)) {
            let (got, want) = (v.grad().expect("reached"), p.grad().expect("reached"));
            fails.extend(off(&format!("{what} rank {r}: {name} gradient"), &got, &want, tol));
        }
        Ok(fails)
    })?;
    Ok(fails.concat())
}

fn layers_case<T: Element>(world: usize) -> Result<Vec<String>> {
    let mut fails = Vec::new();
    let tag = |l: &str| format!("{} {l} world {world}", T::DTYPE);
    // Column-parallel: 7 rows over the ranks, 6 columns of the weight.
    let (x, w, b) = (
        Tensor::<f64>::random(&[7, 5], 1),
        Tensor::<f64>::random(&[5, 6], 2).cast::<T>(),
        Tensor::<f64>::random(&[6], 3).cast::<T>(),
    );
    fails.extend(both_forms::<T, _>(
        world,
        &tag("column"),
        &x,
        Placement::Shard(0),
        &Tensor::<f64>::random(&[7, 6], 4),
        |rank| ColumnParallelLinear::from_global(rank, &w, Some(&b), Split::Even),
        |l, x, dy| {
            let (y, saved) = l.forward(x)?;
            let dy = DistTensor::from_global(x.rank(), dy, y.placement())?;
            Ok((y, l.backward(saved, &dy)?))
        },
        |l, x| l.forward_var(x),
    )?);
    // Row-parallel: its input sharded on its last dimension, the output on rows.
    let (h, w, b) = (
        Tensor::<f64>::random(&[7, 6], 5),
        Tensor::<f64>::random(&[6, 5], 6).cast::<T>(),
        Tensor::<f64>::random(&[5], 7).cast::<T>(),
    );
    fails.extend(both_forms::<T, _>(
        world,
        &tag("row"),
        &h,
        Placement::Shard(1),
        &Tensor::<f64>::random(&[7, 5], 8),
        |rank| RowParallelLinear::from_global(rank, &w, Some(&b), Split::Even),
        |l, h, dy| {
            let (y, saved) = l.forward(h)?;
            let dy = DistTensor::from_global(h.rank(), dy, y.placement())?;
            Ok((y, l.backward(saved, &dy)?))
        },
        |l, h| l.forward_var(h),
    )?);
    // The MLP block on [B, S, E] with the sequence sharded.
    fails.extend(both_forms::<T, _>(
        world,
        &tag("mlp"),
        &Tensor::<f64>::random(&[2, 5, 4], 9),
        Placement::Shard(1),
        &Tensor::<f64>::random(&[2, 5, 4], 10),
        |rank| ParallelMlp::<T>::new(rank, 4, 10, Activation::GeluTanh, 11),
        |l, x, dy| {
            let (y, saved) = l.forward(x)?;
            let dy = DistTensor::from_global(x.rank(), dy, y.placement())?;
            Ok((y, l.backward(saved, &dy)?))
        },
        |l, x| l.forward_var(x),
    )?);
    // Ulysses self-attention: 4 heads (uneven over 3 ranks), and 2 (fewer than 3 or 4 ranks).
    for (heads, causal) in [(4, true), (2, false)] {
        fails.extend(both_forms::<T, _>(
            world,
            &tag(&format!("ulysses {heads} heads causal {causal}")),
            &Tensor::<f64>::random(&[2, 7, 8], 12),
            Placement::Shard(1),
            &Tensor::<f64>::random(&[2, 7, 8], 13),
            |_| UlyssesSelfAttention::<T>::new(8, heads, causal, 14),
            |l, x, dy| {
                let (y, saved) = l.forward(x)?;
                let dy = DistTensor::from_global(x.rank(), dy, y.placement())?;
                Ok((y, l.backward(saved, &dy)?))
            },
            |l, x| l.forward_var(x),
        )?);
    }
    Ok(fails)
}

#[test]
fn hand_written_backward_equals_autograd() -> Result<()> {
    let mut fails = Vec::new();
    for world in 1..=4 {
        fails.extend(layers_case::<f64>(world)?);
    }
    fails.extend(layers_case::<f32>(3)?);
    assert_none(fails);
    Ok(())
}

#[test]
fn module_names_are_checkpoint_names() -> Result<()> {
    World::threads(2)?.run(|rank| {
        let mlp = ParallelMlp::<f32>::new(rank, 4, 6, Activation::Gelu, 1)?;
        let attn = UlyssesSelfAttention::<f32>::new(4, 2, true, 2)?;
        let row = RowParallelLinear::<f32>::new(rank, 6, 4, false, 3)?;
        fn names<'a, M: Module<'a, f32>>(m: &M) -> Vec<(String, Sharing)> {
            let mut out = Vec::new();
            m.visit("m", &mut |n, _, s| out.push((n.to_string(), s)));
            out
        }
        let want = |l: &dyn NamedState<f32>| -> Vec<(String, Sharing)> {
            l.param_names()
                .into_iter()
                .map(|(n, p)| {
                    let s = if p == Placement::Replicate {
                        Sharing::Replicated
                    } else {
                        Sharing::Sharded
                    };
                    (join("m", &n), s)
                })
                .collect()
        };
        assert_eq!(names(&mlp), want(&mlp));
        assert_eq!(names(&attn), want(&attn));
        assert_eq!(names(&row), want(&row));
        assert_eq!(names(&mlp)[3], ("m.fc2.bias".to_string(), Sharing::Replicated));
        Ok(())
    })?;
    Ok(())
}

/// A model of both kinds of layer: `LayerNorm` and `RmsNorm` (autograd::gpt), an nn
/// `ParallelMlp` and an nn `ColumnParallelLinear` + `RowParallelLinear` pair.
struct Mixed<'r> {
    ln: LayerNorm<'r, f64>,
    mlp: ParallelMlp<f64>,
    norm: RmsNorm<'r, f64>,
    up: ColumnParallelLinear<f64>,
    down: RowParallelLinear<f64>,
}

impl<'r> Module<'r, f64> for Mixed<'r> {
    fn visit(&self, p: &str, f: &mut dyn FnMut(&str, &Var<'r, f64>, Sharing)) {
        self.ln.visit(&join(p, "ln"), f);
        self.mlp.visit(&join(p, "mlp"), f);
        self.norm.visit(&join(p, "norm"), f);
        self.up.visit(&join(p, "up"), f);
        self.down.visit(&join(p, "down"), f);
    }

    fn visit_mut(&mut self, p: &str, f: &mut dyn FnMut(&str, &mut Var<'r, f64>, Sharing)) {
        self.ln.visit_mut(&join(p, "ln"), f);
        self.mlp.visit_mut(&join(p, "mlp"), f);
        self.norm.visit_mut(&join(p, "norm"), f);
        self.up.visit_mut(&join(p, "up"), f);
        self.down.visit_mut(&join(p, "down"), f);
    }
}

fn mixed_curve(world: usize, x: &Tensor<f64>, target: &Tensor<f64>) -> Result<Vec<f64>> {
    let curves = World::threads(world)?.run(|rank| {
        let mut model = Mixed {
            ln: LayerNorm::new(6),
            mlp: ParallelMlp::new(rank, 6, 12, Activation::Silu, 1)?,
            norm: RmsNorm::new(6),
            up: ColumnParallelLinear::new(rank, 6, 10, true, 3)?,
            down: RowParallelLinear::new(rank, 10, 6, true, 5)?,
        };
        let names: Vec<String> = model.named_parameters().into_iter().map(|(n, _)| n).collect();
        assert_eq!(names[..3], ["ln.weight", "ln.bias", "mlp.fc1.weight"]);
        assert_eq!(names.last().unwrap(), "down.bias");
        let mut opt = AdamW::new(2e-2);
        let xs = DVar::constant(DistTensor::from_global(rank, x, Placement::Shard(0))?);
        let ts = DistTensor::from_global(rank, target, Placement::Shard(0))?;
        let mut losses = Vec::new();
        for _ in 0..12 {
            model.zero_grad();
            let h = model.mlp.forward_var(&model.ln.forward(&xs)?)?;
            let h = h.zip(&xs, |h, x| Ok(h + x))?;
            let y = model.down.forward_var(&model.up.forward_var(&model.norm.forward(&h)?)?)?;
            let loss = mse_loss_var(&y, &ts)?;
            loss.backward()?;
            sync_grads(&model, rank)?;
            opt.step(&mut model)?;
            losses.push(loss.value().local().as_slice()[0]);
        }
        Ok(losses)
    })?;
    for c in &curves[1..] {
        assert_eq!(c, &curves[0], "every rank sees the same loss");
    }
    Ok(curves[0].clone())
}

#[test]
fn a_model_mixing_nn_and_gpt_layers_steps_in_one_call() -> Result<()> {
    let x = Tensor::<f64>::random(&[9, 6], 21);
    let target = x.map(|v| (2.0 * v).sin());
    let one = mixed_curve(1, &x, &target)?;
    assert!(one[11] < one[0] * 0.5, "the loss falls: {one:?}");
    for world in [2, 3, 4] {
        let got = mixed_curve(world, &x, &target)?;
        for (step, (g, w)) in got.iter().zip(&one).enumerate() {
            assert!((g - w).abs() <= 1e-10 * w.abs(), "world {world} step {step}: {g} vs {w}");
        }
    }
    Ok(())
}

#[test]
fn layer_norm_gradients_match_finite_differences() -> Result<()> {
    let inputs = [
        Tensor::<f64>::random(&[5, 7], 31),
        Tensor::<f64>::random(&[7], 32),
        Tensor::<f64>::random(&[7], 33),
    ];
    fn check<'r>(rank: &'r Rank<'r>, inputs: &[Tensor<f64>]) -> Result<GradcheckReport> {
        let f = |v: &[Var<'r, f64>]| -> Result<Var<'r, f64>> {
            let norm = LayerNorm { weight: v[1].clone(), bias: v[2].clone(), eps: 1e-5 };
            let x = DVar::from_var(rank, &v[0], Placement::Shard(0))?;
            Ok(norm.forward(&x)?.local().clone())
        };
        gradcheck(f, inputs, GradcheckOptions::default())
    }
    let reports = World::threads(1)?.run(|rank| check(rank, &inputs))?;
    assert_eq!(reports[0].elements, 5 * 7 + 7 + 7);
    assert!(reports[0].max_abs_error < 1e-7, "{:?}", reports[0]);
    Ok(())
}

/// `LayerNorm` on rows sharded over `world` ranks, loss `sum(y * c)`: the input's gradient
/// gathered, the weight's and bias's summed over ranks.
fn layer_norm_grads(world: usize, x: &Tensor<f64>, c: &Tensor<f64>) -> Result<[Tensor<f64>; 3]> {
    let out = World::threads(world)?.run(|rank| {
        let mut norm = LayerNorm::<f64>::new(x.shape()[1]);
        // Not the initial ones and zeros: a swapped weight and bias would show.
        norm.weight.set_value(Tensor::random(&[x.shape()[1]], 41))?;
        norm.bias.set_value(Tensor::random(&[x.shape()[1]], 42))?;
        let xv = DVar::param(DistTensor::from_global(rank, x, Placement::Shard(0))?);
        let cs = DistTensor::from_global(rank, c, Placement::Shard(0))?;
        let y = norm.forward(&xv)?;
        (y.local() * &Var::constant(cs.into_local())).sum().backward()?;
        sync_grads(&norm, rank)?;
        let dx = DistTensor::from_local(rank, xv.grad().unwrap(), Placement::Shard(0))?;
        Ok([dx.to_global()?, norm.weight.grad().unwrap(), norm.bias.grad().unwrap()])
    })?;
    Ok(out[0].clone())
}

#[test]
fn layer_norm_sharded_rows_match_one_rank() -> Result<()> {
    // 3 rows: fewer than 4 ranks, one rank has none.
    for rows in [3, 11] {
        let (x, c) = (Tensor::<f64>::random(&[rows, 5], 43), Tensor::<f64>::random(&[rows, 5], 44));
        let want = layer_norm_grads(1, &x, &c)?;
        let mut fails = Vec::new();
        for world in [2, 3, 4] {
            let got = layer_norm_grads(world, &x, &c)?;
            for (i, name) in ["input", "weight", "bias"].iter().enumerate() {
                let what = format!("rows {rows} world {world}: {name} gradient");
                fails.extend(off(&what, &got[i], &want[i], 1e-12));
            }
        }
        assert_none(fails);
    }
    Ok(())
}
