//! `gpu_report --add`: where the time of a same-shape add of two [8192, 8192] bf16 tensors goes,
//! on one GPU (a world of one rank), against the HBM roofline of `--local` (3 x 128 MiB over a
//! device copy's bandwidth measured in the same run). Each line is one way of timing or placing
//! the add: per-call CUDA events (as `--local` times it), one event pair around 100 calls queued
//! back to back (no event between kernels), the host's time to queue a call, the operands placed
//! apart by spacer allocations, the outputs kept alive (distinct buffers), the operands made
//! through a cast; then the cast f32 -> bf16 and a device copy of one operand. Twice, to show
//! the spread. `benches/gpu/torch_peer.py --add` times torch's add the same ways.

use dist_tensor::device::cuda::{self, Timer};
use dist_tensor::{Rank, Result, Tensor};
use half::bf16;
use std::time::Instant;

use crate::Settings;
use crate::local::{run_hot, time_hot};
use crate::stats::median;

/// Median of 50 per-call event timings after 50 ms and 5 warm-up calls (as `--local` times,
/// with more samples).
fn per_call<R>(rank: &Rank<'_>, op: impl FnMut() -> Result<R>) -> Result<f64> {
    time_hot(rank, &Settings { warmup: 5, iters: 50, ..Settings::default() }, op)
}

/// Medians over 5 batches of 100 calls: GPU milliseconds a call (one event pair around the
/// batch) and host milliseconds to queue a call.
fn batched<R>(rank: &Rank<'_>, mut op: impl FnMut() -> Result<R>) -> Result<(f64, f64)> {
    run_hot(rank, &mut op)?;
    let (mut gpu, mut host) = (Vec::new(), Vec::new());
    for _ in 0..5 {
        cuda::synchronize(rank)?;
        let mut t = Timer::new(rank)?;
        let wall = Instant::now();
        t.start(rank)?;
        for _ in 0..100 {
            op()?;
        }
        t.stop(rank)?;
        host.push(wall.elapsed().as_secs_f64() * 1e3 / 100.0);
        cuda::synchronize(rank)?;
        gpu.push(f64::from(t.elapsed_ms()?) / 100.0);
    }
    Ok((median(gpu), median(host)))
}

fn lines(rank: &Rank<'_>) -> Result<Vec<String>> {
    let copied = cuda::random::<f32>(rank, &[1 << 28], 9)?;
    let copy = per_call(rank, || cuda::device_copy(rank, &copied))?;
    let gbs = 2.0 * (1u64 << 30) as f64 / (copy * 1e-3) / 1e9;
    // Three [8192, 8192] bf16 tensors moved: two read, one written.
    let roof = 3.0 * 8192.0 * 8192.0 * 2.0 / (gbs * 1e9) * 1e3;
    let of = |ms: f64, bytes_per_element: f64| ms / (roof * bytes_per_element / 6.0);
    let mut out = vec![format!("copy {gbs:.0} GB/s; add roofline {roof:.4} ms")];
    let a = cuda::random::<bf16>(rank, &[8192, 8192], 1)?;
    let b = cuda::random::<bf16>(rank, &[8192, 8192], 2)?;
    let single = cuda::random::<f32>(rank, &[8192, 8192], 6)?;
    let pc = per_call(rank, || Ok(&a + &b))?;
    let (per_batch, host) = batched(rank, || Ok(&a + &b))?;
    out.push(format!(
        "add: per call {pc:.4} ms ({:.4} of roofline), batched {per_batch:.4} ({:.4}), host \
         {host:.4} ms to queue a call",
        of(pc, 6.0),
        of(per_batch, 6.0)
    ));
    let pc = per_call(rank, || Ok(&a * &b))?;
    out.push(format!("mul: per call {pc:.4} ms ({:.4})", of(pc, 6.0)));
    let mut kept: Vec<Tensor<bf16>> = Vec::new();
    let pc = per_call(rank, || {
        kept.push(&a + &b);
        if kept.len() > 40 {
            kept.remove(0);
        }
        Ok(())
    })?;
    drop(kept);
    out.push(format!(
        "add, outputs kept alive (40 distinct): per call {pc:.4} ms ({:.4})",
        of(pc, 6.0)
    ));
    for spacer_mib in [2usize, 6, 64] {
        let x = cuda::random::<bf16>(rank, &[8192, 8192], 11)?;
        let spacer = cuda::random::<bf16>(rank, &[spacer_mib << 19], 12)?;
        let y = cuda::random::<bf16>(rank, &[8192, 8192], 13)?;
        let pc = per_call(rank, || Ok(&x + &y))?;
        out.push(format!(
            "add, operands {spacer_mib} MiB apart: per call {pc:.4} ms ({:.4})",
            of(pc, 6.0)
        ));
        drop(spacer);
    }
    let (x, y) =
        (single.cast::<bf16>(), cuda::random::<f32>(rank, &[8192, 8192], 15)?.cast::<bf16>());
    let pc = per_call(rank, || Ok(&x + &y))?;
    out.push(format!("add, operands made by a cast: per call {pc:.4} ms ({:.4})", of(pc, 6.0)));
    let pc = per_call(rank, || Ok(single.cast::<bf16>()))?;
    out.push(format!("cast f32 -> bf16: per call {pc:.4} ms ({:.4})", of(pc, 6.0)));
    let pc = per_call(rank, || cuda::device_copy(rank, &a))?;
    out.push(format!("device copy of one operand: per call {pc:.4} ms ({:.4})", of(pc, 4.0)));
    Ok(out)
}

/// Prints the lines, twice.
pub fn report() -> Result<()> {
    let Some(world) = crate::one_gpu("--add") else {
        return Ok(());
    };
    let info = world.run(cuda::gpu_info)?.remove(0);
    for round in 1..=2 {
        println!("# gpu_report --add: {}, round {round}", info.name);
        for line in world.run(lines)?.remove(0) {
            println!("{line}");
        }
    }
    Ok(())
}
