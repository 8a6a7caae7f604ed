//! Training: a tiny two-layer model (`ParallelMlp`: column-parallel, GELU, row-parallel) on
//! seeded synthetic data gives the same loss curve at worlds 1, 2 and 4 as the same model
//! trained on one rank in f64 with ndarray, its own GELU and derivative
//! (`tests/common/reference.rs`) and its own Adam and SGD: no library math in the reference.
//!
//! # Tolerance
//! Relative to the first loss: f64 within `1e-12` (the distributed run adds in another order);
//! f32 within `5e-5` (unit roundoff 6e-8, amplified by a dozen optimizer steps: Adam divides
//! each gradient by its own size, so small gradients' rounding errors grow); bf16 within `1e-2`
//! (bf16 rounds every activation to 8 bits, unit roundoff 2e-3; the optimizer keeps f32 master
//! weights). Seen on the development machine (`--nocapture` prints them): 5e-16, 2e-6 and
//! 2e-3. The loss must also fall by a third over the steps, so a model that does not train
//! fails whatever the curves.

mod common;

use common::{f64s, reference};
use dist_tensor::nn::{
    Activation, Adam, ColumnParallelLinear, Module, ParallelMlp, RowParallelLinear, Sgd, mse_loss,
};
use dist_tensor::{DistTensor, Element, Placement, Result, Split, Tensor, World};
use half::bf16;
use ndarray::{Array2, Axis, Ix2};

const ROWS: usize = 19; // not divisible by 2 or 4
const HIDDEN: usize = 6;
const FFN: usize = 14;
const STEPS: usize = 12;

struct Data {
    x: Tensor<f64>,
    target: Tensor<f64>,
    /// W1, b1, W2, b2.
    weights: [Tensor<f64>; 4],
}

fn data() -> Data {
    let x = Tensor::<f64>::random(&[ROWS, HIDDEN], 1);
    let mix = Tensor::<f64>::random(&[HIDDEN, HIDDEN], 2);
    let target = x.matmul(&mix).unwrap().map(|v| v.tanh());
    let weights = common::mlp_weights(HIDDEN, FFN);
    Data { x, target, weights }
}

#[derive(Clone, Copy, Debug)]
enum Optimizer {
    Adam,
    SgdMomentum,
}

const LR_ADAM: f64 = 2e-2;
const LR_SGD: f64 = 0.2;
const MOMENTUM: f64 = 0.9;

/// The loss before each step, on one rank in f64 with ndarray and the reference's GELU.
fn reference_curve(d: &Data, opt: Optimizer) -> Vec<f64> {
    let act = Activation::Gelu;
    let matrix = |t: &Tensor<f64>| f64s(t).into_dimensionality::<Ix2>().unwrap();
    let x = matrix(&d.x);
    let target = matrix(&d.target);
    // W1 and W2 as matrices, b1 and b2 as matrices of one row (broadcast over the rows).
    let mut w: Vec<Array2<f64>> = d
        .weights
        .iter()
        .map(|t| {
            let cols = *t.shape().last().unwrap();
            f64s(t).into_shape_with_order((t.len() / cols, cols)).unwrap()
        })
        .collect();
    let mut m: Vec<Vec<f64>> = w.iter().map(|t| vec![0.0; t.len()]).collect();
    let mut v = m.clone();
    let mut curve = Vec::new();
    let n = (ROWS * HIDDEN) as f64;
    for step in 1..=STEPS {
        let h = x.dot(&w[0]) + &w[1];
        let a = h.mapv(|v| reference::activation(act, v));
        let y = a.dot(&w[2]) + &w[3];
        let diff = &y - &target;
        curve.push(diff.iter().map(|e| e * e).sum::<f64>() / n);
        let dy = diff * (2.0 / n);
        let da = dy.dot(&w[2].t());
        let dh = da * h.mapv(|v| reference::activation_derivative(act, v));
        let grads = [
            x.t().dot(&dh),
            dh.sum_axis(Axis(0)).insert_axis(Axis(0)),
            a.t().dot(&dy),
            dy.sum_axis(Axis(0)).insert_axis(Axis(0)),
        ];
        for i in 0..4 {
            let p = w[i].as_slice_mut().expect("standard layout");
            for (j, &g) in grads[i].iter().enumerate() {
                match opt {
                    Optimizer::Adam => {
                        m[i][j] = 0.9 * m[i][j] + 0.1 * g;
                        v[i][j] = 0.999 * v[i][j] + 0.001 * g * g;
                        let mhat = m[i][j] / (1.0 - 0.9f64.powi(step as i32));
                        let vhat = v[i][j] / (1.0 - 0.999f64.powi(step as i32));
                        p[j] -= LR_ADAM * mhat / (vhat.sqrt() + 1e-8);
                    }
                    Optimizer::SgdMomentum => {
                        m[i][j] = MOMENTUM * m[i][j] + g;
                        p[j] -= LR_SGD * m[i][j];
                    }
                }
            }
        }
    }
    curve
}

/// The loss before each step of the distributed model on `world` ranks in `T`, as every rank
/// saw it (they must agree bitwise).
fn distributed_curve<T: Element>(
    d: &Data,
    world: usize,
    opt: Optimizer,
    fused: bool,
) -> Result<Vec<f64>> {
    let [w1, b1, w2, b2] = d.weights.each_ref().map(|t| t.cast::<T>());
    let (x, target) = (d.x.cast::<T>(), d.target.cast::<T>());
    let curves = World::threads(world)?.run(|rank| {
        let fc1 = ColumnParallelLinear::from_global(rank, &w1, Some(&b1), Split::Even)?;
        let fc2 = RowParallelLinear::from_global(rank, &w2, Some(&b2), Split::Even)?;
        let mut mlp = ParallelMlp::from_layers(fc1, Activation::Gelu, fc2).fused(fused);
        let xs = DistTensor::from_global(rank, &x, Placement::Shard(0))?;
        let ts = DistTensor::from_global(rank, &target, Placement::Shard(0))?;
        let (mut adam, mut sgd) =
            (Adam::<T>::new(LR_ADAM), Sgd::<T>::new(LR_SGD).momentum(MOMENTUM));
        let mut curve = Vec::new();
        for _ in 0..STEPS {
            let (y, saved) = mlp.forward(&xs)?;
            let (loss, dy) = mse_loss(&y, &ts)?;
            curve.push(loss);
            mlp.zero_grad();
            mlp.backward(saved, &dy)?;
            match opt {
                Optimizer::Adam => adam.step(mlp.parameters_mut())?,
                Optimizer::SgdMomentum => sgd.step(mlp.parameters_mut())?,
            }
        }
        Ok(curve)
    })?;
    assert!(curves.iter().all(|c| c == &curves[0]), "ranks saw different losses: {curves:?}");
    Ok(curves[0].clone())
}

fn check_curves<T: Element>(tolerance: f64) -> Result<()> {
    let d = data();
    for opt in [Optimizer::Adam, Optimizer::SgdMomentum] {
        let want = reference_curve(&d, opt);
        assert!(
            want[STEPS - 1] < want[0] * 2.0 / 3.0,
            "{opt:?}: the reference does not train: {want:?}"
        );
        let mut worst = 0.0f64;
        for world in [1, 2, 4] {
            for fused in [true, false] {
                let got = distributed_curve::<T>(&d, world, opt, fused)?;
                worst =
                    got.iter().zip(&want).fold(worst, |m, (g, w)| m.max((g - w).abs() / want[0]));
                for (step, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (g - w).abs() <= tolerance * want[0],
                        "{} {opt:?} world {world} fused {fused}, step {step}: loss {g}, one rank {w}\n got {got:?}\nwant {want:?}",
                        T::DTYPE
                    );
                }
            }
        }
        // Seen with --nocapture: how close the curves came.
        eprintln!(
            "{} {opt:?}: loss {:.4} -> {:.4}, largest difference {worst:.1e} of the first loss",
            T::DTYPE,
            want[0],
            want[STEPS - 1]
        );
    }
    Ok(())
}

#[test]
fn loss_curves_match_one_rank_f64() -> Result<()> {
    check_curves::<f64>(1e-12)
}

#[test]
fn loss_curves_match_one_rank_f32() -> Result<()> {
    check_curves::<f32>(5e-5)
}

#[test]
fn loss_curves_match_one_rank_bf16() -> Result<()> {
    check_curves::<bf16>(1e-2)
}
