//! Training on a GPU: the activations' backward kernels, Sgd and Adam stepping parameters that
//! live on the GPU (f32 master weights for the half types), `mse_loss`, and a tensor-parallel
//! MLP trained in CUDA worlds of 1, 2 and 3 ranks sharing one GPU, each against f64 references
//! computed here (tests/common), never by the library.
//!
//! Without a GPU (or a build without `--features cuda`) each test prints that it was skipped and
//! why, and passes: `cargo test --release --features cuda --test cuda_nn -- --nocapture`.

use dist_tensor::nn::{
    Activation, Adam, ColumnParallelLinear, Module, ParallelMlp, Param, RowParallelLinear, Sgd,
    mse_loss,
};
use dist_tensor::tensor::DType;
use dist_tensor::{Device, DistTensor, Element, Placement, Split, Tensor, World};
use std::cmp::Ordering;

use half::{bf16, f16};
use ndarray::{Array2, ArrayD};

mod common;

use common::checks::{off, widen};
use common::gpu::{cuda_world_on, gpu_here};
use common::{assert_none, reference, within};

const GPU: Device = Device::Cuda(0);
const ACTS: [Activation; 4] =
    [Activation::Gelu, Activation::GeluTanh, Activation::Silu, Activation::Relu];

/// `dy * f'(x)` on the GPU for every activation, against f64 on the same (rounded) inputs:
/// one rounding of the result (the kernel computes in f64), so within a unit roundoff of `T`.
fn activation_grads<T: Element>(fails: &mut Vec<String>) -> dist_tensor::Result<()> {
    for shape in [&[37, 19][..], &[1], &[0, 3], &[2, 3, 5]] {
        let x = Tensor::<T>::random(shape, 3) * T::from_f64(4.0);
        let dy = Tensor::<T>::random(shape, 4);
        let (xd, dyd) = (x.to_device(GPU)?, dy.to_device(GPU)?);
        for act in ACTS {
            let got = act.backward(&xd, &dyd)?;
            assert_eq!(got.device(), GPU, "the gradient stays on the GPU");
            let got = widen(got.to_host()?.as_slice());
            let (xs, ds) = (widen(x.as_slice()), widen(dy.as_slice()));
            let want: Vec<f64> = xs
                .iter()
                .zip(&ds)
                .map(|(&x, &d)| d * reference::activation_derivative(act, x))
                .collect();
            // Relative, above 1e-4 (below it f16's subnormals have a fixed spacing). In f64 the
            // GPU's erf, exp and tanh and the reference's erf (a series) are each off by up to
            // about 1e-14 (measured on the H200: 2e-14), so f64 is held to 1e-12; a wrong
            // derivative is off by far more.
            let scale: Vec<f64> = want.iter().map(|w| w.abs().max(1e-4)).collect();
            let tol = if T::DTYPE == DType::F64 { 1e-12 } else { T::EPSILON };
            let what = format!("{act:?} backward {} {shape:?}", T::DTYPE);
            fails.extend(off(&what, &got, &want, &scale, tol));
        }
    }
    // One on the host and one on the GPU: a typed error, not a panic.
    let x = Tensor::<T>::random(&[4], 1);
    let err = Activation::Gelu.backward(&x, &x.to_device(GPU)?).unwrap_err();
    assert!(matches!(err, dist_tensor::Error::InvalidArgument { .. }), "{err}");
    Ok(())
}

#[test]
fn activation_backward_runs_on_the_gpu() {
    if !gpu_here("activation_backward_runs_on_the_gpu") {
        return;
    }
    let mut fails = Vec::new();
    activation_grads::<f32>(&mut fails).unwrap();
    activation_grads::<f64>(&mut fails).unwrap();
    activation_grads::<f16>(&mut fails).unwrap();
    activation_grads::<bf16>(&mut fails).unwrap();
    assert_none(fails);
}

/// The f64 reference of `steps` optimizer steps from `p0` with gradients `grads` (one per step):
/// SGD with momentum and weight decay (`adam` false) or AdamW, each in plain loops. The values
/// start from `p0` rounded to `T` (what the parameter holds).
fn reference_steps(adam: bool, p0: &[f64], grads: &[Vec<f64>], hyper: [f64; 3]) -> Vec<f64> {
    let [lr, momentum_or_beta1, decay] = hyper;
    let (b1, b2, eps) = (momentum_or_beta1, 0.999, 1e-8);
    let mut p = p0.to_vec();
    let (mut s0, mut s1) = (vec![0.0; p.len()], vec![0.0; p.len()]);
    for (t, g) in grads.iter().enumerate() {
        let t = t as i32 + 1;
        for i in 0..p.len() {
            if adam {
                s0[i] = b1 * s0[i] + (1.0 - b1) * g[i];
                s1[i] = b2 * s1[i] + (1.0 - b2) * g[i] * g[i];
                let (mhat, vhat) = (s0[i] / (1.0 - b1.powi(t)), s1[i] / (1.0 - b2.powi(t)));
                p[i] = p[i] * (1.0 - lr * decay) - lr * mhat / (vhat.sqrt() + eps);
            } else {
                let d = g[i] + decay * p[i];
                let d = if momentum_or_beta1 == 0.0 {
                    d
                } else {
                    s0[i] = momentum_or_beta1 * s0[i] + d;
                    s0[i]
                };
                p[i] -= lr * d;
            }
        }
    }
    p
}

/// Sgd (with and without momentum) and Adam on a parameter on the GPU, four steps, against
/// the f64 loops: the updates in the accumulator type, the parameter rounded to `T` once per
/// step (from f32 master weights for the half types), so within a few roundings of `T` and a
/// few of the accumulator per step.
fn optimizer_steps<T: Element>(fails: &mut Vec<String>) -> dist_tensor::Result<()> {
    let shape = [33, 7];
    let p0 = Tensor::<T>::random(&shape, 5);
    let grads: Vec<Tensor<T>> = (0..4).map(|s| Tensor::<T>::random(&shape, 10 + s)).collect();
    let g64: Vec<Vec<f64>> = grads.iter().map(|g| widen(g.as_slice())).collect();
    for (name, adam, hyper) in [
        ("sgd", false, [0.1, 0.0, 0.0]),
        ("sgd momentum decay", false, [0.05, 0.9, 0.01]),
        ("adamw", true, [0.01, 0.9, 0.1]),
    ] {
        let mut param = Param::new(p0.to_device(GPU)?);
        let (mut sgd, mut adamw) = (
            Sgd::<T>::new(hyper[0]).momentum(hyper[1]).weight_decay(hyper[2]),
            Adam::<T>::new(hyper[0]).betas(hyper[1], 0.999).weight_decay(hyper[2]),
        );
        for g in &grads {
            param.zero_grad();
            param.accumulate_grad(g.to_device(GPU)?)?;
            if adam {
                adamw.step(vec![&mut param])?;
            } else {
                sgd.step(vec![&mut param])?;
            }
            assert_eq!(param.value().device(), GPU, "the parameter stays on the GPU");
        }
        let got = widen(param.value().to_host()?.as_slice());
        let want = reference_steps(adam, &widen(p0.as_slice()), &g64, hyper);
        let scale: Vec<f64> = want.iter().map(|w| w.abs().max(1.0)).collect();
        // Per step: one rounding into T (from the master) and a few in the accumulator.
        let acc = <T::Acc as Element>::EPSILON;
        let tol = 4.0 * (T::EPSILON + 8.0 * acc);
        fails.extend(off(&format!("{name} {}", T::DTYPE), &got, &want, &scale, tol));
    }
    Ok(())
}

#[test]
fn optimizers_step_parameters_on_the_gpu() {
    if !gpu_here("optimizers_step_parameters_on_the_gpu") {
        return;
    }
    let mut fails = Vec::new();
    optimizer_steps::<f32>(&mut fails).unwrap();
    optimizer_steps::<f64>(&mut fails).unwrap();
    optimizer_steps::<f16>(&mut fails).unwrap();
    optimizer_steps::<bf16>(&mut fails).unwrap();
    assert_none(fails);
}

/// The same MLP trained on one rank in f64 with Adam: the loss before each step.
fn one_rank_curve(
    x: &ArrayD<f64>,
    target: &ArrayD<f64>,
    weights: &[ArrayD<f64>; 4],
    steps: usize,
    lr: f64,
) -> Vec<f64> {
    let mut w = weights.clone();
    let mut moments: Vec<(ArrayD<f64>, ArrayD<f64>)> =
        w.iter().map(|t| (t.mapv(|_| 0.0), t.mapv(|_| 0.0))).collect();
    let n = target.len() as f64;
    let mut curve = Vec::new();
    for step in 1..=steps as i32 {
        // The output first (with a zero gradient), then the gradients of the loss.
        let zero = target.mapv(|_| 0.0);
        let y = reference::mlp(x, &w, Activation::Gelu, &zero)[0].clone();
        let diff = &y - target;
        curve.push(diff.mapv(|d| d * d).sum() / n);
        let dy = diff.mapv(|d| 2.0 * d / n);
        let all = reference::mlp(x, &w, Activation::Gelu, &dy);
        for (i, (p, (m, v))) in w.iter_mut().zip(&mut moments).enumerate() {
            let g = &all[2 + i];
            *m = &*m * 0.9 + g * 0.1;
            *v = &*v * 0.999 + &(g * g) * 0.001;
            let (c1, c2) = (1.0 - 0.9f64.powi(step), 1.0 - 0.999f64.powi(step));
            *p = &*p - &(m.mapv(|m| m / c1) * lr / &v.mapv(|v| (v / c2).sqrt() + 1e-8));
        }
    }
    curve
}

/// The tensor-parallel MLP (`ParallelMlp` of `ColumnParallelLinear` and `RowParallelLinear`)
/// trained with `mse_loss` and Adam in a CUDA world of `n` ranks on GPU 0, every parameter,
/// gradient and optimizer state on the GPU: its loss curve against the one-rank f64 curve.
fn trains_like_one_rank<T: Element>(n: usize, tol: f64, fails: &mut Vec<String>) {
    let test = format!("mlp_trains_on_the_gpu {n} ranks {}", T::DTYPE);
    let Some(world) = cuda_world_on(&test, &vec![0; n]) else { return };
    let (tokens, hidden, ffn, steps, lr) = (23, 12, 40, 8, 1e-2);
    let x = Tensor::<f64>::random(&[tokens, hidden], 1);
    let mix = Tensor::<f64>::random(&[hidden, hidden], 2) * (2.0 / (hidden as f64).sqrt());
    let target = Tensor::from_array(x.matmul(&mix).unwrap().view().mapv(f64::tanh));
    let weights = common::mlp_weights(hidden, ffn);
    // The reference starts from the values the ranks hold (rounded to T).
    let rounded = |t: &Tensor<f64>| t.cast::<T>().cast::<f64>().view().to_owned();
    let want = one_rank_curve(
        &rounded(&x),
        &rounded(&target),
        &weights.each_ref().map(rounded),
        steps,
        lr,
    );
    let [w1, b1, w2, b2] = weights.each_ref().map(|t| t.cast::<T>());
    let (xt, tt) = (x.cast::<T>(), target.cast::<T>());
    let curves = world
        .run(|rank| {
            let fc1 = ColumnParallelLinear::from_global(rank, &w1, Some(&b1), Split::Even)?;
            let fc2 = RowParallelLinear::from_global(rank, &w2, Some(&b2), Split::Even)?;
            let mut mlp = ParallelMlp::from_layers(fc1, Activation::Gelu, fc2);
            let mut adam = Adam::<T>::new(lr);
            let xs = DistTensor::from_global(rank, &xt, Placement::Shard(0))?;
            let ts = DistTensor::from_global(rank, &tt, Placement::Shard(0))?;
            let mut curve = Vec::new();
            for _ in 0..steps {
                let (y, saved) = mlp.forward(&xs)?;
                let (loss, dy) = mse_loss(&y, &ts)?;
                assert_eq!(dy.local().device(), GPU, "the loss gradient on the GPU");
                mlp.zero_grad();
                mlp.backward(saved, &dy)?;
                for p in mlp.parameters() {
                    assert_eq!(p.grad().expect("a gradient").device(), GPU);
                }
                adam.step(mlp.parameters_mut())?;
                curve.push(loss);
            }
            for p in mlp.parameters() {
                assert_eq!(p.value().device(), GPU, "the parameters stay on the GPU");
            }
            Ok(curve)
        })
        .unwrap();
    let first = want[0];
    for (r, got) in curves.iter().enumerate() {
        let worst = got.iter().zip(&want).fold(0.0f64, |m, (g, w)| m.max((g - w).abs())) / first;
        if !within(worst, tol) || got[steps - 1].partial_cmp(&got[0]) != Some(Ordering::Less) {
            fails.push(format!(
                "{test}: rank {r}'s curve {got:?} is {worst:.1e} of the first loss from {want:?}"
            ));
        }
    }
}

#[test]
fn mlp_trains_on_the_gpu_like_one_rank_in_f64() {
    if !gpu_here("mlp_trains_on_the_gpu_like_one_rank_in_f64") {
        return;
    }
    let mut fails = Vec::new();
    for n in 1..=3 {
        trains_like_one_rank::<f32>(n, 1e-4, &mut fails);
        trains_like_one_rank::<bf16>(n, 3e-2, &mut fails);
    }
    assert_none(fails);
}

/// `mse_loss` of a prediction on the GPU (2 ranks sharing it, rows split unevenly): the loss
/// every rank agrees on and its gradient, against f64 on the same rounded values. [4099, 9]
/// gives each rank more than one 16 Ki chunk of the one-pass kernel, and a tail past its vectors.
fn mse_loss_on_the_gpu<T: Element>(world: &World, shape: [usize; 2], fails: &mut Vec<String>) {
    let len = (shape[0] * shape[1]) as f64;
    let (p, t) = (Tensor::<T>::random(&shape, 1), Tensor::<T>::random(&shape, 2));
    let p64 = Array2::from_shape_vec((shape[0], shape[1]), widen(p.as_slice())).unwrap();
    let t64 = Array2::from_shape_vec((shape[0], shape[1]), widen(t.as_slice())).unwrap();
    let diff = &p64 - &t64;
    let want_loss = diff.mapv(|d| d * d).sum() / len;
    let want_grad: Vec<f64> = diff.mapv(|d| 2.0 * d / len).iter().copied().collect();
    let outs = world
        .run(|rank| {
            let ps = DistTensor::from_global(rank, &p, Placement::Shard(0))?;
            let ts = DistTensor::from_global(rank, &t, Placement::Shard(0))?;
            let (loss, grad) = mse_loss(&ps, &ts)?;
            assert_eq!(grad.local().device(), GPU);
            Ok((loss, grad.to_global()?.to_host()?))
        })
        .unwrap();
    for (loss, grad) in outs {
        // The squares and their sums in f64: a few roundings of the sum's terms.
        if !within((loss - want_loss).abs(), 1e-12 * want_loss) {
            fails.push(format!("loss {shape:?} {}: {loss}, want {want_loss}", T::DTYPE));
        }
        // One rounding of (p - t) * scale in the accumulator type, one to T, relative to the
        // value or, below f16's smallest normal number, to it (f16's subnormals have a fixed
        // spacing: a gradient of 3.5e-6 is 1.7% of a step there).
        let floor = if T::DTYPE == DType::F16 { 6.103515625e-5 } else { 1e-30 };
        let scale: Vec<f64> = want_grad.iter().map(|w| w.abs().max(floor)).collect();
        let got = widen(grad.as_slice());
        let tol = T::EPSILON.max(4.0 * <T::Acc as Element>::EPSILON);
        let what = format!("mse_loss gradient {shape:?} {}", T::DTYPE);
        fails.extend(off(&what, &got, &want_grad, &scale, tol));
    }
}

#[test]
fn mse_loss_runs_on_the_gpu() {
    let Some(world) = cuda_world_on("mse_loss_runs_on_the_gpu", &[0, 0]) else { return };
    let mut fails = Vec::new();
    for shape in [[9, 5], [4099, 9]] {
        mse_loss_on_the_gpu::<bf16>(&world, shape, &mut fails);
        mse_loss_on_the_gpu::<f16>(&world, shape, &mut fails);
        mse_loss_on_the_gpu::<f32>(&world, shape, &mut fails);
        mse_loss_on_the_gpu::<f64>(&world, shape, &mut fails);
    }
    assert_none(fails);
}

/// `UlyssesAttention` with its inputs on GPUs (3 ranks sharing one): the sequence of 7 and 5
/// heads split unevenly, causal. The output against the f64 reference attention, the input
/// gradients against central finite differences of it (of `sum(out * dout)`), in f64.
#[test]
fn ulysses_attention_runs_on_the_gpu() {
    use dist_tensor::nn::UlyssesAttention;
    let Some(world) = cuda_world_on("ulysses_attention_runs_on_the_gpu", &[0, 0, 0]) else {
        return;
    };
    let shape = [2, 7, 5, 4];
    let [q, k, v, dout] = [1, 2, 3, 4].map(|s| Tensor::<f64>::random(&shape, s));
    let outs = world
        .run(|rank| {
            let [qs, ks, vs, ds] = [&q, &k, &v, &dout]
                .map(|t| DistTensor::from_global(rank, t, Placement::Shard(1)).unwrap());
            let layer = UlyssesAttention::new(true);
            let (out, saved) = layer.forward(&qs, &ks, &vs)?;
            assert_eq!(out.local().device(), GPU);
            assert_eq!(out.shard_sizes(), qs.shard_sizes(), "the output keeps q's rows");
            let (dq, dk, dv) = layer.backward(saved, &ds)?;
            let global = |t: DistTensor<'_, f64>| t.to_global()?.to_host();
            Ok([global(out)?, global(dq)?, global(dk)?, global(dv)?])
        })
        .unwrap();
    let f = |t: &Tensor<f64>| t.view().to_owned();
    let (q0, k0, v0, d0) = (f(&q), f(&k), f(&v), f(&dout));
    let loss = |q: &ArrayD<f64>, k: &ArrayD<f64>, v: &ArrayD<f64>| {
        (reference::attention(q, k, v, true) * &d0).sum()
    };
    let want_out = reference::attention(&q0, &k0, &v0, true);
    let h = 1e-5;
    let numeric = |which: usize| -> Vec<f64> {
        (0..q0.len())
            .map(|i| {
                let mut ins = [q0.clone(), k0.clone(), v0.clone()];
                ins[which].as_slice_mut().unwrap()[i] += h;
                let up = loss(&ins[0], &ins[1], &ins[2]);
                ins[which].as_slice_mut().unwrap()[i] -= 2.0 * h;
                let down = loss(&ins[0], &ins[1], &ins[2]);
                (up - down) / (2.0 * h)
            })
            .collect()
    };
    let wants = [numeric(0), numeric(1), numeric(2)];
    let mut fails = Vec::new();
    for (r, [out, dq, dk, dv]) in outs.iter().enumerate() {
        let want: Vec<f64> = want_out.iter().copied().collect();
        let ones = vec![1.0; want.len()];
        fails.extend(off(&format!("rank {r} output"), out.as_slice(), &want, &ones, 1e-12));
        for (name, got, want) in
            [("dq", dq, &wants[0]), ("dk", dk, &wants[1]), ("dv", dv, &wants[2])]
        {
            fails.extend(off(&format!("rank {r} {name}"), got.as_slice(), want, &ones, 1e-7));
        }
    }
    assert_none(fails);
}

/// `redistribute_split` to uneven splits in a CUDA world of 3 ranks on one GPU: from an uneven
/// `Shard`, from `Replicate` and from `Partial`, in bf16 and f64, against the global tensor (the
/// partial sums against f64 sums of the rounded parts).
#[test]
fn uneven_redistribute_split_on_the_gpu() {
    let Some(world) = cuda_world_on("uneven_redistribute_split_on_the_gpu", &[0, 0, 0]) else {
        return;
    };
    let global = Tensor::<f64>::random(&[3, 11, 2], 7);
    let parts: Vec<Tensor<bf16>> =
        (0..3).map(|r| Tensor::<bf16>::random(&[3, 11, 2], 20 + r)).collect();
    let mut sum = ndarray::ArrayD::<f64>::zeros(ndarray::IxDyn(&[3, 11, 2]));
    for p in &parts {
        sum = sum + p.view().mapv(|v| v.to_f64());
    }
    let outs = world
        .run(|rank| {
            let x = DistTensor::from_global_split(rank, &global, 1, vec![6, 1, 4])?;
            let a = x.redistribute_split(1, vec![2, 7, 2])?;
            assert_eq!((a.shard_sizes(), a.local().device()), (&[2, 7, 2][..], GPU));
            let rep = DistTensor::from_global(rank, &global, Placement::Replicate)?;
            let b = rep.redistribute_split(1, Split::Sizes(vec![0, 10, 1]))?;
            let partial =
                DistTensor::from_local(rank, parts[rank.rank()].clone(), Placement::Partial)?;
            let c = partial.redistribute_split(1, vec![5, 5, 1])?;
            assert_eq!(c.local().device(), GPU);
            Ok([
                a.to_global()?.to_host()?,
                b.to_global()?.to_host()?,
                c.to_global()?.to_host()?.cast(),
            ])
        })
        .unwrap();
    let mut fails = Vec::new();
    let want: Vec<f64> = global.as_slice().to_vec();
    let sums: Vec<f64> = sum.iter().copied().collect();
    let ones = vec![1.0; want.len()];
    for (r, [a, b, c]) in outs.iter().enumerate() {
        fails.extend(off(&format!("rank {r} from Shard"), a.as_slice(), &want, &ones, 0.0));
        fails.extend(off(&format!("rank {r} from Replicate"), b.as_slice(), &want, &ones, 0.0));
        let tol = 4.0 * <bf16 as Element>::EPSILON; // sums rounded to bf16
        let scale: Vec<f64> = sums.iter().map(|s| s.abs().max(1.0)).collect();
        fails.extend(off(&format!("rank {r} from Partial"), c.as_slice(), &sums, &scale, tol));
    }
    assert_none(fails);
}

/// The f64 gradient of `L = k * sum(c * norm(x))` with respect to `x`, the weight and the bias,
/// over the last axis of length `n` (`centered`: layer norm; else RMS norm), in plain loops.
fn norm_grads(x: &[f64], w: &[f64], c: &[f64], n: usize, k: f64, centered: bool) -> [Vec<f64>; 3] {
    const EPS: f64 = 1e-5;
    let (mut dx, mut dw, mut db) = (vec![0.0; x.len()], vec![0.0; n], vec![0.0; n]);
    for (row, (xr, cr)) in x.chunks(n).zip(c.chunks(n)).enumerate() {
        let mean = if centered { xr.iter().sum::<f64>() / n as f64 } else { 0.0 };
        let var = xr.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n as f64;
        let r = 1.0 / (var + EPS).sqrt();
        let xh: Vec<f64> = xr.iter().map(|v| (v - mean) * r).collect();
        let gh: Vec<f64> = (0..n).map(|i| k * cr[i] * w[i]).collect();
        let mean_gh = if centered { gh.iter().sum::<f64>() / n as f64 } else { 0.0 };
        let mean_ghxh = (0..n).map(|i| gh[i] * xh[i]).sum::<f64>() / n as f64;
        for i in 0..n {
            dx[row * n + i] = r * (gh[i] - mean_gh - xh[i] * mean_ghxh);
            dw[i] += k * cr[i] * xh[i];
            db[i] += k * cr[i];
        }
    }
    [dx, dw, db]
}

/// `L = k * sum(c * norm(x))` in f64, for central differences.
fn norm_loss(x: &[f64], w: &[f64], b: &[f64], c: &[f64], n: usize, k: f64, centered: bool) -> f64 {
    let mut loss = 0.0;
    for (xr, cr) in x.chunks(n).zip(c.chunks(n)) {
        let mean = if centered { xr.iter().sum::<f64>() / n as f64 } else { 0.0 };
        let var = xr.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n as f64;
        let r = 1.0 / (var + 1e-5).sqrt();
        for i in 0..n {
            let bias = if centered { b[i] } else { 0.0 };
            loss += k * cr[i] * ((xr[i] - mean) * r * w[i] + bias);
        }
    }
    loss
}

/// Autograd's sum, mean, sum_axis, mean_axis, rms_norm and layer_norm differentiated with the
/// values on the GPU: every gradient stays on the GPU and matches the f64 gradient of the same
/// rounded inputs (and, in f64, central differences of the f64 loss).
fn reductions_and_norms<T: Element>(fails: &mut Vec<String>) -> dist_tensor::Result<()> {
    use dist_tensor::autograd::Var;
    for shape in [&[5, 7][..], &[1, 1], &[2, 3, 13]] {
        let n = *shape.last().unwrap();
        let len: usize = shape.iter().product();
        let x = Tensor::<T>::random(shape, 21) * T::from_f64(3.0);
        let c = Tensor::<T>::random(shape, 22);
        let (w, b) = (Tensor::<T>::random(&[n], 23), Tensor::<T>::random(&[n], 24));
        let (xs, cs, ws, bs) =
            (widen(x.as_slice()), widen(c.as_slice()), widen(w.as_slice()), widen(b.as_slice()));
        let tag = format!("{} {shape:?}", T::DTYPE);
        // One rounding of each gradient, and of the output gradient it is computed from (a mean
        // rounds `c / len` to T), against the largest entry: far below a wrong formula's error.
        let tol = if T::DTYPE == DType::F64 { 1e-12 } else { 16.0 * T::EPSILON };
        let check = |fails: &mut Vec<String>, what: &str, got: &Var<'_, T>, want: &[f64]| {
            let Some(g) = got.grad() else {
                fails.push(format!("{what} {tag}: no gradient"));
                return;
            };
            if g.device() != GPU {
                fails.push(format!("{what} {tag}: the gradient is on {}", g.device()));
            }
            let g = widen(g.to_host().unwrap().as_slice());
            let scale = want.iter().fold(1e-3f64, |m, v| m.max(v.abs()));
            fails.extend(off(&format!("{what} {tag}"), &g, want, &vec![scale; want.len()], tol));
        };
        let on_gpu = |t: &Tensor<T>| Var::param(t.to_device(GPU).unwrap());
        let rounded = |v: f64| T::from_f64(v).to_f64();

        // Whole sums and means: d/dx is 1, or 1/len rounded to T, everywhere.
        let xv = on_gpu(&x);
        xv.sum().backward()?;
        check(fails, "sum", &xv, &vec![1.0; len]);
        let xv = on_gpu(&x);
        let loss = xv.mean();
        assert_eq!(loss.value().device(), GPU, "the loss stays on the GPU");
        loss.backward()?;
        check(fails, "mean", &xv, &vec![rounded(1.0 / len as f64); len]);
        // Along an axis, then whole: sum_axis(0) then mean spreads 1 / (len / shape[0]).
        let xv = on_gpu(&x);
        xv.sum_axis(0)?.mean().backward()?;
        check(fails, "sum_axis.mean", &xv, &vec![rounded(shape[0] as f64 / len as f64); len]);
        let xv = on_gpu(&x);
        xv.mean_axis(shape.len() - 1)?.sum().backward()?;
        check(fails, "mean_axis.sum", &xv, &vec![rounded(1.0 / n as f64); len]);

        // The norms, weighted by a constant `c`; the mean form scales the gradient by 1/len.
        for centered in [false, true] {
            let (xv, wv, bv, cv) =
                (on_gpu(&x), on_gpu(&w), on_gpu(&b), Var::constant(c.to_device(GPU)?));
            let y = if centered {
                xv.layer_norm(Some(&wv), Some(&bv), 1e-5)?
            } else {
                xv.rms_norm(Some(&wv), 1e-5)?
            };
            let weighted = &y * &cv;
            let k = if centered { rounded(1.0 / len as f64) } else { 1.0 };
            let loss = if centered { weighted.mean() } else { weighted.sum() };
            loss.backward()?;
            let [dx, dw, db] = norm_grads(&xs, &ws, &cs, n, k, centered);
            let what = if centered { "layer_norm" } else { "rms_norm" };
            check(fails, &format!("{what} dx"), &xv, &dx);
            check(fails, &format!("{what} dw"), &wv, &dw);
            if centered {
                check(fails, &format!("{what} db"), &bv, &db);
            }
            if T::DTYPE == DType::F64 {
                // The reference against central differences of the loss itself.
                let h = 1e-6;
                for i in 0..len {
                    let (mut up, mut down) = (xs.clone(), xs.clone());
                    up[i] += h;
                    down[i] -= h;
                    let numeric = (norm_loss(&up, &ws, &bs, &cs, n, k, centered)
                        - norm_loss(&down, &ws, &bs, &cs, n, k, centered))
                        / (2.0 * h);
                    if !within((numeric - dx[i]).abs(), 1e-6 * dx[i].abs().max(1.0)) {
                        fails.push(format!(
                            "{what} {tag}: entry {i} {} vs numeric {numeric}",
                            dx[i]
                        ));
                    }
                }
            }
        }
    }
    Ok(())
}

#[test]
fn autograd_reductions_and_norms_backward_on_the_gpu() {
    if !gpu_here("autograd_reductions_and_norms_backward_on_the_gpu") {
        return;
    }
    let mut fails = Vec::new();
    reductions_and_norms::<f32>(&mut fails).unwrap();
    reductions_and_norms::<f64>(&mut fails).unwrap();
    reductions_and_norms::<f16>(&mut fails).unwrap();
    reductions_and_norms::<bf16>(&mut fails).unwrap();
    assert_none(fails);
}

/// rms_norm and layer_norm differentiated on the GPU (the norm backward kernels) for rows of 1,
/// 67 and 8200 elements (more than a block's threads, and past the forward's row cache), with
/// and without weight and bias, and with the weight or bias held constant (then no gradient is
/// asked for it): `dx`, `dw` and `db` stay on the GPU and match the f64 gradients of the same
/// rounded inputs within one rounding of `T` (as `reductions_and_norms`).
fn norm_backward_kernels<T: Element>(fails: &mut Vec<String>) -> dist_tensor::Result<()> {
    use dist_tensor::autograd::Var;
    let tol = if T::DTYPE == DType::F64 { 1e-12 } else { 16.0 * T::EPSILON };
    for shape in [&[3, 1][..], &[1, 67], &[2, 3, 67], &[130, 67], &[3, 8200]] {
        let n = *shape.last().unwrap();
        let x = Tensor::<T>::random(shape, 31) * T::from_f64(3.0) + T::from_f64(0.5);
        let c = Tensor::<T>::random(shape, 32);
        let (w, b) = (Tensor::<T>::random(&[n], 33), Tensor::<T>::random(&[n], 34));
        let (xs, cs) = (widen(x.as_slice()), widen(c.as_slice()));
        let on_gpu = |t: &Tensor<T>| Var::param(t.to_device(GPU).unwrap());
        // (weight, bias): 0 left out, 1 a parameter, 2 a constant.
        for (centered, kw, kb) in [
            (false, 0, 0),
            (false, 1, 0),
            (false, 2, 0),
            (true, 0, 0),
            (true, 1, 1),
            (true, 1, 2),
            (true, 2, 1),
            (true, 0, 1),
        ] {
            let tag = format!("{} {shape:?} centered {centered} weight {kw} bias {kb}", T::DTYPE);
            let param = |kind: u8, t: &Tensor<T>| match kind {
                0 => None,
                1 => Some(on_gpu(t)),
                _ => Some(Var::constant(t.to_device(GPU).unwrap())),
            };
            let (xv, wv, bv) = (on_gpu(&x), param(kw, &w), param(kb, &b));
            let y = if centered {
                xv.layer_norm(wv.as_ref(), bv.as_ref(), 1e-5)?
            } else {
                xv.rms_norm(wv.as_ref(), 1e-5)?
            };
            (&y * &Var::constant(c.to_device(GPU)?)).sum().backward()?;
            let ws = if kw == 0 { vec![1.0; n] } else { widen(w.as_slice()) };
            let [dx, dw, db] = norm_grads(&xs, &ws, &cs, n, 1.0, centered);
            let mut check = |what: &str, got: Option<&Var<'_, T>>, want: &[f64]| {
                let Some(g) = got.and_then(|v| v.grad()) else {
                    fails.push(format!("{what} {tag}: no gradient"));
                    return;
                };
                if g.device() != GPU {
                    fails.push(format!("{what} {tag}: the gradient is on {}", g.device()));
                }
                let g = widen(g.to_host().unwrap().as_slice());
                let scale = want.iter().fold(1e-3f64, |m, v| m.max(v.abs()));
                fails.extend(off(
                    &format!("{what} {tag}"),
                    &g,
                    want,
                    &vec![scale; want.len()],
                    tol,
                ));
            };
            check("dx", Some(&xv), &dx);
            if kw == 1 {
                check("dw", wv.as_ref(), &dw);
            }
            if kb == 1 {
                check("db", bv.as_ref(), &db);
            }
            for (kind, v, what) in [(kw, &wv, "weight"), (kb, &bv, "bias")] {
                if kind == 2 && v.as_ref().is_some_and(|v| v.grad().is_some()) {
                    fails.push(format!("{tag}: the constant {what} got a gradient"));
                }
            }
        }
    }
    Ok(())
}

#[test]
fn norm_backward_kernels_on_the_gpu() {
    if !gpu_here("norm_backward_kernels_on_the_gpu") {
        return;
    }
    let mut fails = Vec::new();
    norm_backward_kernels::<f32>(&mut fails).unwrap();
    norm_backward_kernels::<f64>(&mut fails).unwrap();
    norm_backward_kernels::<f16>(&mut fails).unwrap();
    norm_backward_kernels::<bf16>(&mut fails).unwrap();
    assert_none(fails);
}

/// ParallelMlp's fused bias and activation (one kernel each way) against its layers one by one
/// (the add kernel, then the activation's), bit for bit, in CUDA worlds of 1 to 3 ranks sharing
/// GPU 0: widths whose shards are whole 16-byte vectors (the fused kernels) and ones that are
/// not (the two passes), every dtype and activation.
#[test]
fn mlp_bias_and_activation_on_the_gpu_match_the_layers_one_by_one() {
    let test = "mlp_bias_and_activation_on_the_gpu_match_the_layers_one_by_one";
    if !gpu_here(test) {
        return;
    }
    let mut fails = Vec::new();
    for n in 1..=3 {
        let Some(world) = cuda_world_on(test, &vec![0; n]) else { return };
        let what = format!("{n} ranks sharing cuda:0");
        for shape in [(9, 16, 96), (7, 8, 20), (33, 24, 48 * n)] {
            let run = |fails: &mut Vec<String>, r: dist_tensor::Result<Vec<String>>| {
                fails.extend(r.unwrap_or_else(|e| vec![format!("{what} {shape:?}: {e}")]));
            };
            run(&mut fails, common::mlp_fused::fused_matches_layers::<f32>(&world, &what, shape));
            run(&mut fails, common::mlp_fused::fused_matches_layers::<bf16>(&world, &what, shape));
            run(&mut fails, common::mlp_fused::fused_matches_layers::<f16>(&world, &what, shape));
            run(&mut fails, common::mlp_fused::fused_matches_layers::<f64>(&world, &what, shape));
        }
    }
    assert_none(fails);
}
