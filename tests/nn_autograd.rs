//! The nn layers on autograd against one-rank f64 references: each layer's `backward` (its
//! recorded forward pass run backward, twice: gradients accumulate, the replicated parameters'
//! summed over the ranks once per pass) and its `forward_var` with a `backward()` and
//! `sync_grads` give the output, input gradient and every parameter's gradient of the same
//! model written with plain one-rank `Var` ops in f64 (naive attention: scores, mask, softmax),
//! at worlds 1 to 4 with uneven row and head splits; the layers are `Module`s named as their
//! checkpoints; a model mixing them with the `nn::gpt` layers (`RmsNorm`, `LayerNorm`)
//! trains with one `Adam::step` and gives the same curve at every world; `LayerNorm` against
//! finite differences and one rank.
//!
//! # Tolerance
//! In f64 the same sums in nearly the same order: `1e-12` of the largest value. In f32 against
//! the f64 reference `2e-5` (a handful of roundings of 6e-8 through sums of tens of terms and a
//! softmax). A missing sum over the ranks, a transposed weight or one rank's part dropped is off
//! by order 1; a replicated gradient summed over the ranks with what earlier passes accumulated
//! is off by `world - 1` times it.

mod common;

use common::assert_none;
use dist_tensor::autograd::{DVar, GradcheckOptions, GradcheckReport, Var, gradcheck};
use dist_tensor::nn::gpt::{LayerNorm, RmsNorm};
use dist_tensor::nn::{
    Activation, Adam, ColumnParallelLinear, Module, ParallelMlp, RowParallelLinear,
    UlyssesSelfAttention, mse_loss_var, sync_grads,
};
use dist_tensor::{DistTensor, Element, Placement, Rank, Result, Split, Tensor, World};

fn tolerance<T: Element>() -> f64 {
    if T::DTYPE == dist_tensor::DType::F64 { 1e-12 } else { 2e-5 }
}

/// `None` when `got` is within `tol` of the largest `|want|` everywhere, else what is off.
fn off<T: Element>(what: &str, got: &Tensor<T>, want: &Tensor<f64>, tol: f64) -> Option<String> {
    if got.shape() != want.shape() {
        return Some(format!("{what}: shape {:?}, want {:?}", got.shape(), want.shape()));
    }
    let scale = want.as_slice().iter().fold(1e-30f64, |m, w| m.abs().max(w.abs()));
    let err = got
        .as_slice()
        .iter()
        .zip(want.as_slice())
        .fold(0.0f64, |m, (g, w)| m.max((g.to_f64() - w).abs()));
    (err > tol * scale).then(|| format!("{what}: max error {err:.2e} of {scale:.2e}"))
}

/// What a one-rank f64 model gives for input `x`, output gradient `dy` and whole parameters.
struct Reference {
    y: Tensor<f64>,
    dx: Tensor<f64>,
    grads: Vec<Tensor<f64>>,
}

/// `model(x, params)` written with one-rank `Var` ops in f64, differentiated with `dy`.
fn reference(
    x: &Tensor<f64>,
    dy: &Tensor<f64>,
    params: &[Tensor<f64>],
    model: impl Fn(&Var<'static, f64>, &[Var<'static, f64>]) -> Result<Var<'static, f64>>,
) -> Result<Reference> {
    let xv = Var::param(x.clone());
    let ps: Vec<Var<'static, f64>> = params.iter().map(|p| Var::param(p.clone())).collect();
    let y = model(&xv, &ps)?;
    y.backward_with(dy.clone())?;
    let grad = |v: &Var<'static, f64>| v.grad().unwrap_or_else(|| Tensor::zeros(v.shape()));
    Ok(Reference { y: y.into_value(), dx: grad(&xv), grads: ps.iter().map(grad).collect() })
}

/// This rank's gradient of each parameter made whole: a shard gathered on its dimension, a
/// replicated one as it is (complete on every rank). Collective.
fn whole_grads<T: Element, L: Module<T>>(rank: &Rank<'_>, layer: &L) -> Result<Vec<Tensor<T>>> {
    layer
        .parameters()
        .into_iter()
        .map(|p| {
            let g = p.grad().unwrap_or_else(|| Tensor::zeros(p.value().shape()));
            match p.placement() {
                Placement::Shard(_) => DistTensor::from_local(rank, g, p.placement())?.to_global(),
                _ => Ok(g),
            }
        })
        .collect()
}

/// One layer, built by `make` from the reference's parameters, on `x` (sharded as given) with
/// output gradient `dy` (laid out as the output) in both ways to differentiate it: output,
/// input gradient and every parameter's gradient against `want`, on every rank.
#[allow(clippy::too_many_arguments)]
fn against_reference<T: Element, L>(
    world: usize,
    what: &str,
    x: &Tensor<f64>,
    x_placement: Placement,
    dy: &Tensor<f64>,
    want: &Reference,
    make: impl Fn(&Rank<'_>) -> Result<L> + Sync,
) -> Result<Vec<String>>
where
    L: Module<T> + Layer<T>,
{
    let (xt, dyt) = (x.cast::<T>(), dy.cast::<T>());
    let tol = tolerance::<T>();
    let fails = World::threads(world)?.run(|rank| {
        let mut fails = Vec::new();
        let r = rank.rank();
        let xs = DistTensor::from_global(rank, &xt, x_placement)?;
        // `forward` / `backward`, twice: the gradients add up to twice the reference.
        let mut a = make(rank)?;
        for pass in 1..=2 {
            let (y, saved) = a.fwd(&xs)?;
            let dys = DistTensor::from_global(rank, &dyt, y.placement())?;
            let dx = a.bwd(saved, &dys)?;
            let tag = format!("{what} rank {r} backward pass {pass}");
            fails.extend(off(&format!("{tag}: output"), &y.to_global()?, &want.y, tol));
            fails.extend(off(&format!("{tag}: input gradient"), &dx.to_global()?, &want.dx, tol));
        }
        for ((name, _), (got, w)) in
            a.named_parameters().into_iter().zip(whole_grads(rank, &a)?.iter().zip(&want.grads))
        {
            let twice = w * 2.0;
            let tag = format!("{what} rank {r} backward, {name} gradient of two passes");
            fails.extend(off(&tag, got, &twice, tol));
        }
        // `forward_var`, one `backward()` and `sync_grads`.
        let b = make(rank)?;
        let xv = DVar::param(xs.clone());
        let yb = b.fwd_var(&xv)?;
        let dys = DistTensor::from_global(rank, &dyt, yb.placement())?;
        assert_eq!(dys.shard_sizes(), yb.value().shard_sizes(), "{what}: dy laid out as y");
        yb.local().backward_with(dys.into_local())?;
        sync_grads(&b, rank)?;
        let tag = format!("{what} rank {r} forward_var");
        fails.extend(off(&format!("{tag}: output"), &yb.value().to_global()?, &want.y, tol));
        let dx = xs.map_local(|_| xv.grad().expect("x is tracked"))?.to_global()?;
        fails.extend(off(&format!("{tag}: input gradient"), &dx, &want.dx, tol));
        for ((name, _), (got, w)) in
            b.named_parameters().into_iter().zip(whole_grads(rank, &b)?.iter().zip(&want.grads))
        {
            fails.extend(off(&format!("{tag}: {name} gradient"), got, w, tol));
        }
        Ok(fails)
    })?;
    Ok(fails.concat())
}

/// A layer's `forward` / `backward` pair and its `forward_var`, the same for every layer.
trait Layer<T: Element> {
    type Saved<'r>;
    fn fwd<'r>(&self, x: &DistTensor<'r, T>) -> Result<(DistTensor<'r, T>, Self::Saved<'r>)>;
    fn bwd<'r>(
        &mut self,
        saved: Self::Saved<'r>,
        dy: &DistTensor<'r, T>,
    ) -> Result<DistTensor<'r, T>>;
    fn fwd_var<'r>(&self, x: &DVar<'r, T>) -> Result<DVar<'r, T>>;
}

macro_rules! layer {
    ($layer:ident, $saved:ident) => {
        impl<T: Element> Layer<T> for $layer<T> {
            type Saved<'r> = dist_tensor::nn::$saved<'r, T>;
            fn fwd<'r>(
                &self,
                x: &DistTensor<'r, T>,
            ) -> Result<(DistTensor<'r, T>, Self::Saved<'r>)> {
                self.forward(x)
            }
            fn bwd<'r>(
                &mut self,
                saved: Self::Saved<'r>,
                dy: &DistTensor<'r, T>,
            ) -> Result<DistTensor<'r, T>> {
                self.backward(saved, dy)
            }
            fn fwd_var<'r>(&self, x: &DVar<'r, T>) -> Result<DVar<'r, T>> {
                self.forward_var(x)
            }
        }
    };
}

layer!(ColumnParallelLinear, ColumnParallelSaved);
layer!(RowParallelLinear, RowParallelSaved);
layer!(ParallelMlp, MlpSaved);
layer!(UlyssesSelfAttention, SelfAttentionSaved);

/// `x: [..., k] @ w: [k, n]` on one rank, as rows.
fn rows_matmul(x: &Var<'static, f64>, w: &Var<'static, f64>) -> Result<Var<'static, f64>> {
    let (k, lead) = x.shape().split_last().expect("at least 1-D");
    let mut shape = lead.to_vec();
    shape.push(w.shape()[1]);
    x.reshape(&[lead.iter().product(), *k])?.matmul(w)?.reshape(&shape)
}

/// Attention of `q`, `k`, `v`: `[B, S, H, D]` each, the naive way: scores, a mask of -1e30
/// above the diagonal when causal, softmax, product.
fn naive_attention(
    q: &Var<'static, f64>,
    k: &Var<'static, f64>,
    v: &Var<'static, f64>,
    causal: bool,
) -> Result<Var<'static, f64>> {
    let (s, d) = (q.shape()[1], q.shape()[3]);
    let [q, k, v] = [q, k, v].map(|t| t.permute(&[0, 2, 1, 3]));
    let mask: Vec<f64> =
        (0..s * s).map(|ij| if causal && ij % s > ij / s { -1e30 } else { 0.0 }).collect();
    let mask = Var::constant(Tensor::from_shape_vec(&[s, s], mask)?);
    let scores = &q?.matmul(&k?.transpose(2, 3)?)?.scale(1.0 / (d as f64).sqrt()) + &mask;
    scores.softmax(3)?.matmul(&v?)?.permute(&[0, 2, 1, 3])
}

/// Self-attention of `x: [B, S, E]` with `wqkv: [E, 3E]`, `wo: [E, E]` and `heads` heads.
fn naive_self_attention(
    x: &Var<'static, f64>,
    wqkv: &Var<'static, f64>,
    wo: &Var<'static, f64>,
    heads: usize,
    causal: bool,
) -> Result<Var<'static, f64>> {
    let [b, s, e] = [x.shape()[0], x.shape()[1], x.shape()[2]];
    let qkv = rows_matmul(x, wqkv)?.reshape(&[b, s, 3, heads, e / heads])?;
    let part = |i: usize| qkv.narrow(2, i, 1)?.reshape(&[b, s, heads, e / heads]);
    let o = naive_attention(&part(0)?, &part(1)?, &part(2)?, causal)?;
    rows_matmul(&o.reshape(&[b, s, e])?, wo)
}

fn layers_case<T: Element>(world: usize) -> Result<Vec<String>> {
    let mut fails = Vec::new();
    let tag = |l: &str| format!("{} {l} world {world}", T::DTYPE);
    // Parameters rounded to T once, so that the reference and the layer start alike.
    let param = |shape: &[usize], seed: u64| Tensor::<f64>::random(shape, seed).cast::<T>();
    let wide = |t: &Tensor<T>| t.cast::<f64>();
    let linear = |x: &Var<'static, f64>, p: &[Var<'static, f64>]| -> Result<Var<'static, f64>> {
        Ok(&rows_matmul(x, &p[0])? + &p[1])
    };
    // Column-parallel: 7 rows over the ranks, 6 columns of the weight.
    let (x, dy) = (Tensor::<f64>::random(&[7, 5], 1), Tensor::<f64>::random(&[7, 6], 4));
    let (w, b) = (param(&[5, 6], 2), param(&[6], 3));
    let want = reference(&x, &dy, &[wide(&w), wide(&b)], linear)?;
    fails.extend(against_reference::<T, _>(
        world,
        &tag("column"),
        &x,
        Placement::Shard(0),
        &dy,
        &want,
        |rank| ColumnParallelLinear::from_global(rank, &w, Some(&b), Split::Even),
    )?);
    // Row-parallel: its input sharded on its last dimension, the output on rows.
    let (h, dy) = (Tensor::<f64>::random(&[7, 6], 5), Tensor::<f64>::random(&[7, 5], 8));
    let (w, b) = (param(&[6, 5], 6), param(&[5], 7));
    let want = reference(&h, &dy, &[wide(&w), wide(&b)], linear)?;
    fails.extend(against_reference::<T, _>(
        world,
        &tag("row"),
        &h,
        Placement::Shard(1),
        &dy,
        &want,
        |rank| RowParallelLinear::from_global(rank, &w, Some(&b), Split::Even),
    )?);
    // The MLP block on [B, S, E] with the sequence sharded, 10 inner features.
    let (x, dy) = (Tensor::<f64>::random(&[2, 5, 4], 9), Tensor::<f64>::random(&[2, 5, 4], 10));
    let ws = [param(&[4, 10], 11), param(&[10], 12), param(&[10, 4], 13), param(&[4], 14)];
    let mlp = |x: &Var<'static, f64>, p: &[Var<'static, f64>]| -> Result<Var<'static, f64>> {
        let h = (&rows_matmul(x, &p[0])? + &p[1]).gelu_tanh();
        Ok(&rows_matmul(&h, &p[2])? + &p[3])
    };
    let want = reference(&x, &dy, &ws.each_ref().map(wide), mlp)?;
    fails.extend(against_reference::<T, _>(
        world,
        &tag("mlp"),
        &x,
        Placement::Shard(1),
        &dy,
        &want,
        |rank| {
            let fc1 = ColumnParallelLinear::from_global(rank, &ws[0], Some(&ws[1]), Split::Even)?;
            let fc2 = RowParallelLinear::from_global(rank, &ws[2], Some(&ws[3]), Split::Even)?;
            Ok(ParallelMlp::from_layers(fc1, Activation::GeluTanh, fc2))
        },
    )?);
    // Ulysses self-attention: 4 heads (uneven over 3 ranks), and 2 (fewer than 3 or 4 ranks).
    let (x, dy) = (Tensor::<f64>::random(&[2, 7, 8], 12), Tensor::<f64>::random(&[2, 7, 8], 13));
    let (wqkv, wo) = (param(&[8, 24], 14), param(&[8, 8], 15));
    for (heads, causal) in [(4, true), (2, false)] {
        let attention = |x: &Var<'static, f64>, p: &[Var<'static, f64>]| {
            naive_self_attention(x, &p[0], &p[1], heads, causal)
        };
        let want = reference(&x, &dy, &[wide(&wqkv), wide(&wo)], attention)?;
        fails.extend(against_reference::<T, _>(
            world,
            &tag(&format!("ulysses {heads} heads causal {causal}")),
            &x,
            Placement::Shard(1),
            &dy,
            &want,
            |_| UlyssesSelfAttention::from_weights(wqkv.clone(), wo.clone(), heads, causal),
        )?);
    }
    Ok(fails)
}

#[test]
fn layers_match_one_rank_f64_models_both_ways() -> Result<()> {
    let mut fails = Vec::new();
    for world in 1..=4 {
        fails.extend(layers_case::<f64>(world)?);
    }
    fails.extend(layers_case::<f32>(3)?);
    assert_none(fails);
    Ok(())
}

/// The sequence cut otherwise than `all_to_all` cuts it (an empty shard among them): the
/// output and the gradients of `q`, `k` and `v` come back cut as `q` was, and match the naive
/// attention on one rank.
#[test]
fn ulysses_attention_keeps_an_uneven_sequence_split() -> Result<()> {
    let shape = [2, 7, 3, 2]; // [B, S, H, D]
    let [q, k, v, dout] = [1, 2, 3, 4].map(|seed| Tensor::<f64>::random(&shape, seed));
    let mut fails = Vec::new();
    for causal in [true, false] {
        let want = {
            let [qv, kv, vv] = [&q, &k, &v].map(|t| Var::param(t.clone()));
            let out = naive_attention(&qv, &kv, &vv, causal)?;
            out.backward_with(dout.clone())?;
            let grads = [&qv, &kv, &vv].map(|t| t.grad().expect("reached"));
            (out.into_value(), grads)
        };
        for sizes in [vec![6, 1], vec![5, 0, 2], vec![1, 3, 0, 3]] {
            let world = sizes.len();
            let got = World::threads(world)?.run(|rank| {
                let cut =
                    |t: &Tensor<f64>| DistTensor::from_global_split(rank, t, 1, sizes.clone());
                let attention = dist_tensor::nn::UlyssesAttention::new(causal);
                let (out, saved) = attention.forward(&cut(&q)?, &cut(&k)?, &cut(&v)?)?;
                let (dq, dk, dv) = attention.backward(saved, &cut(&dout)?)?;
                let mut fails = Vec::new();
                for (what, t) in [("out", &out), ("dq", &dq), ("dk", &dk), ("dv", &dv)] {
                    if t.shard_sizes() != sizes.as_slice() {
                        fails.push(format!("{what} cut {:?}, q {sizes:?}", t.shard_sizes()));
                    }
                }
                let whole = [&out, &dq, &dk, &dv].map(|t| t.to_global());
                Ok((fails, whole))
            })?;
            for (r, (cut_fails, [out, dq, dk, dv])) in got.into_iter().enumerate() {
                let tag = format!("causal {causal} split {sizes:?} rank {r}");
                fails.extend(cut_fails.into_iter().map(|f| format!("{tag}: {f}")));
                fails.extend(off(&format!("{tag}: out"), &out?, &want.0, 1e-12));
                for (what, got, w) in
                    [("dq", dq, &want.1[0]), ("dk", dk, &want.1[1]), ("dv", dv, &want.1[2])]
                {
                    fails.extend(off(&format!("{tag}: {what}"), &got?, w, 1e-12));
                }
            }
        }
    }
    assert_none(fails);
    Ok(())
}

#[test]
fn module_names_and_placements() -> Result<()> {
    World::threads(2)?.run(|rank| {
        let mlp = ParallelMlp::<f32>::new(rank, 4, 6, Activation::Gelu, 1)?;
        let attn = UlyssesSelfAttention::<f32>::new(4, 2, true, 2)?;
        let row = RowParallelLinear::<f32>::new(rank, 6, 4, false, 3)?;
        fn names<M: Module<f32>>(m: &M) -> Vec<(String, Placement)> {
            let mut out = Vec::new();
            m.visit("m", &mut |n, p| out.push((n.to_string(), p.placement())));
            out
        }
        let (s0, s1, rep) = (Placement::Shard(0), Placement::Shard(1), Placement::Replicate);
        let want = |v: &[(&str, Placement)]| -> Vec<(String, Placement)> {
            v.iter().map(|(n, p)| (n.to_string(), *p)).collect()
        };
        assert_eq!(
            names(&mlp),
            want(&[
                ("m.fc1.weight", s1),
                ("m.fc1.bias", s0),
                ("m.fc2.weight", s0),
                ("m.fc2.bias", rep)
            ])
        );
        assert_eq!(names(&attn), want(&[("m.wqkv", rep), ("m.wo", rep)]));
        assert_eq!(names(&row), want(&[("m.weight", s0)]));
        Ok(())
    })?;
    Ok(())
}

/// A model of both kinds of layer: `LayerNorm` and `RmsNorm` (nn::gpt), a `ParallelMlp` and a
/// `ColumnParallelLinear` + `RowParallelLinear` pair; its `Module` from its fields.
struct Mixed {
    ln: LayerNorm<f64>,
    mlp: ParallelMlp<f64>,
    norm: RmsNorm<f64>,
    up: ColumnParallelLinear<f64>,
    down: RowParallelLinear<f64>,
}

dist_tensor::impl_module!(Mixed: f64 { ln, mlp, norm, up, down });

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
        let mut opt = Adam::new(2e-2);
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
            opt.step(model.parameters_mut())?;
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
            // LayerNorm::forward is this map of `Var::layer_norm` with its parameters.
            let x = DVar::from_var(rank, &v[0], Placement::Shard(0))?;
            Ok(x.map(|x| x.layer_norm(Some(&v[1]), Some(&v[2]), 1e-5))?.local().clone())
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
