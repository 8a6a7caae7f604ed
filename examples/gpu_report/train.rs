//! `gpu_report --train`: one training step of example 08's MLP scaled up (tokens M = 8192,
//! hidden E = 4096, ffn F = 16384, bf16: `y = gelu(x @ W1 + b1) @ W2 + b2`, `mse_loss`, the
//! backward pass, Adam) on one GPU (a world of one rank), median milliseconds of CUDA-event
//! timings after warm-up, and the TFLOP/s of its six products. `benches/gpu/torch_peer.py
//! --train` times the same step in PyTorch eager. Our step reads the loss back to the host
//! (`mse_loss` returns it), and our Adam keeps f32 master weights for bf16 parameters.

use dist_tensor::device::cuda;
use dist_tensor::nn::{
    Activation, Adam, ColumnParallelLinear, Module, ParallelMlp, RowParallelLinear, mse_loss,
};
use dist_tensor::{DistTensor, Placement, Rank, Result, Split, Tensor};
use half::bf16;
use std::time::Instant;

use crate::{Settings, time};

const M: usize = 8192;
const E: usize = 4096;
const F: usize = 16384;

/// A host tensor of `shape`, uniform in [-scale, scale), bf16.
fn random(shape: &[usize], seed: u64, scale: f64) -> Tensor<bf16> {
    (Tensor::<f32>::random(shape, seed).cast::<f64>() * scale).cast::<bf16>()
}

/// Prints the step's time on GPU 0.
pub fn report(s: &Settings) -> Result<()> {
    let Some(world) = crate::one_gpu("--train") else {
        return Ok(());
    };
    let (w1, b1) = (random(&[E, F], 1, 1.0 / (E as f64).sqrt()), random(&[F], 2, 0.1));
    let (w2, b2) = (random(&[F, E], 3, 1.0 / (F as f64).sqrt()), random(&[E], 4, 0.1));
    let (x, target) = (random(&[M, E], 5, 1.0), random(&[M, E], 6, 1.0));
    let info = world.run(cuda::gpu_info)?.remove(0);
    let ms = world
        .run(|rank| {
            let fc1 = ColumnParallelLinear::from_global(rank, &w1, Some(&b1), Split::Even)?;
            let fc2 = RowParallelLinear::from_global(rank, &w2, Some(&b2), Split::Even)?;
            let mut mlp = ParallelMlp::from_layers(fc1, Activation::Gelu, fc2);
            let mut adam = Adam::<bf16>::new(1e-4);
            let xs = DistTensor::from_global(rank, &x, Placement::Shard(0))?;
            let ts = DistTensor::from_global(rank, &target, Placement::Shard(0))?;
            let step = time(rank, s, || {
                let (y, saved) = mlp.forward(&xs)?;
                let (_loss, dy) = mse_loss(&y, &ts)?;
                mlp.zero_grad();
                mlp.backward(saved, &dy)?;
                adam.step(mlp.parameters_mut())
            })?;
            // Where the step's time goes: each part alone, on the same inputs.
            let forward = time(rank, s, || mlp.forward(&xs))?;
            let (y, _) = mlp.forward(&xs)?;
            let loss = time(rank, s, || mse_loss(&y, &ts))?;
            let (_, dy) = mse_loss(&y, &ts)?;
            let backward = time(rank, s, || {
                let (_, saved) = mlp.forward(&xs)?;
                mlp.zero_grad();
                mlp.backward(saved, &dy)
            })? - forward;
            let adam_ms = time(rank, s, || adam.step(mlp.parameters_mut()))?;
            // The step with one part left out, to find time the parts alone do not show: without
            // the loss (the gradient `dy` given, so nothing waits for the loss on the host), and
            // without Adam.
            let no_loss = time(rank, s, || {
                let (_, saved) = mlp.forward(&xs)?;
                mlp.zero_grad();
                mlp.backward(saved, &dy)?;
                adam.step(mlp.parameters_mut())
            })?;
            let no_adam = time(rank, s, || {
                let (y, saved) = mlp.forward(&xs)?;
                let (_loss, dy) = mse_loss(&y, &ts)?;
                mlp.zero_grad();
                mlp.backward(saved, &dy)
            })?;
            // The host's time to queue each part from an idle GPU: near the GPU's time where the
            // host waits for the GPU inside (a read-back), far below it where it only queues.
            let host = [
                host_ms(rank, s, || mlp.forward(&xs))?,
                host_ms(rank, s, || mse_loss(&y, &ts))?,
                host_ms(rank, s, || {
                    let (_, saved) = mlp.forward(&xs)?;
                    mlp.zero_grad();
                    mlp.backward(saved, &dy)
                })?,
                host_ms(rank, s, || adam.step(mlp.parameters_mut()))?,
            ];
            // The forward pass's pieces alone, in the step's order (the same ops on the same
            // values), against which the whole forward is compared: what is left is not in them.
            let (w1v, b1v) = (mlp.fc1().weight().value(), mlp.fc1().bias().expect("bias").value());
            let (w2v, b2v) = (mlp.fc2().weight().value(), mlp.fc2().bias().expect("bias").value());
            let p1 = xs.local().matmul(w1v)?;
            let a1 = &p1 + b1v;
            let g1 = a1.gelu();
            let p2 = g1.matmul(w2v)?;
            let pieces = [
                time(rank, s, || xs.local().matmul(w1v))?,
                time(rank, s, || Ok(&p1 + b1v))?,
                time(rank, s, || Ok(a1.gelu()))?,
                time(rank, s, || g1.matmul(w2v))?,
                time(rank, s, || Ok(&p2 + b2v))?,
                time(rank, s, || a1.gelu_backward(&g1))?,
                time(rank, s, || p1.sum_axis(0))?,
            ];
            Ok(([step, forward, loss, backward, adam_ms, no_loss, no_adam], host, pieces))
        })?
        .remove(0);
    let ([ms, forward, loss, backward, adam_ms, no_loss, no_adam], host, pieces) = ms;
    let flops = 6.0 * 2.0 * (M * E * F) as f64;
    println!(
        "# gpu_report --train: {}, one rank, M={M} E={E} F={F} bf16, Adam (f32 master weights): \
         {ms:.2} ms a step (median of {} after {} warm-up), {:.0} TFLOP/s of its products \
         (algorithms: {}={})",
        info.name,
        s.iters,
        s.warmup,
        flops / (ms * 1e-3) / 1e12,
        cuda::GEMM_ALGO_ENV,
        std::env::var(cuda::GEMM_ALGO_ENV).unwrap_or_else(|_| "unset, cublas".into())
    );
    println!(
        "#   alone: forward {forward:.2} ms, mse_loss {loss:.2} ms, backward {backward:.2} ms \
         (forward + backward less forward), Adam {adam_ms:.2} ms"
    );
    println!(
        "#   the step without mse_loss (dy given) {no_loss:.2} ms, without Adam {no_adam:.2} ms"
    );
    println!(
        "#   host time to queue each from an idle GPU: forward {:.2} ms, mse_loss {:.2} ms, \
         forward + backward {:.2} ms, Adam {:.2} ms",
        host[0], host[1], host[2], host[3]
    );
    let [p1, bias1, gelu, p2, bias2, gelu_grad, bias_grad] = pieces;
    println!(
        "#   forward's pieces alone: x @ W1 {p1:.3} ms, + b1 {bias1:.3}, gelu {gelu:.3}, h @ W2 \
         {p2:.3}, + b2 {bias2:.3} (sum {:.2} ms, forward {forward:.2}); gelu_backward {gelu_grad:.3} \
         ms, bias gradient (sum over rows of [M, F]) {bias_grad:.3} ms",
        p1 + bias1 + gelu + p2 + bias2
    );
    Ok(())
}

/// The median wall time of `op` on the host, the GPU synchronized before each run (not after).
fn host_ms<R>(rank: &Rank<'_>, s: &Settings, mut op: impl FnMut() -> Result<R>) -> Result<f64> {
    let mut ms = Vec::with_capacity(s.iters);
    for _ in 0..s.iters {
        cuda::synchronize(rank)?;
        let start = Instant::now();
        op()?;
        ms.push(start.elapsed().as_secs_f64() * 1e3);
    }
    cuda::synchronize(rank)?;
    Ok(crate::stats::median(ms))
}

/// A product's name, `(m, n, k)`, and whether `a` and `b` are read transposed.
type Product = (&'static str, (usize, usize, usize), (bool, bool));

/// The step's six products, row-major `[m, k] x [k, n]`, and which operand is read transposed:
/// the forward's two, then the backward's (each layer's weight gradient, `a` transposed, and its
/// input gradient, `b` transposed), as `gpu_report --train` runs them.
const PRODUCTS: [Product; 6] = [
    ("x @ W1", (M, F, E), (false, false)),
    ("h @ W2", (M, E, F), (false, false)),
    ("h^T @ dy (dW2)", (F, E, M), (true, false)),
    ("dy @ W2^T (dh)", (M, F, E), (false, true)),
    ("x^T @ dh (dW1)", (E, F, M), (true, false)),
    ("dh @ W1^T (dx)", (M, E, F), (false, true)),
];

/// Prints, for each of the step's products, every cuBLASLt candidate (up to 32) timed under
/// sustained load ([`cuda::gemm_candidates`]), and the one the library's plan chose.
pub fn candidates() -> Result<()> {
    let Some(world) = crate::one_gpu("--gemm") else {
        return Ok(());
    };
    let info = world.run(cuda::gpu_info)?.remove(0);
    println!(
        "# gpu_report --gemm: {}, bf16, cuBLASLt's candidates for the training step's products, \
         each the fastest of 3 passes of 20 after 30 warm-up runs of every candidate",
        info.name
    );
    for (name, (m, n, k), transposed) in PRODUCTS {
        let found =
            world.run(|rank| cuda::gemm_candidates::<bf16>(rank, (m, n, k), transposed, 32))?;
        let flops = 2.0 * (m * n * k) as f64;
        println!("## {name}: m={m} n={n} k={k}");
        for c in &found[0] {
            println!(
                "{:>2} {} {:.4} ms {:.0} TFLOP/s{}",
                c.heuristic_rank,
                c.config,
                c.ms,
                flops / (c.ms * 1e-3) / 1e12,
                if c.chosen { "  <- chosen" } else { "" }
            );
        }
    }
    Ok(())
}
