//! `gpu_report --local`: each local op of a GPU tensor on one GPU (a world of one rank), bf16
//! unless named, against the HBM roofline: the op's bytes read + written over the bandwidth of
//! a device copy measured in the same run (`cuda::device_copy` of 1 GiB: 2 GiB moved). Medians
//! of CUDA-event timings of calls queued back to back, after 50 ms of warm-up.
//! `benches/gpu/torch_peer.py --local` times the same ops in PyTorch on the same shapes, warmed
//! and timed the same way, for the side-by-side table.

use dist_tensor::device::cuda::{self, Timer};
use dist_tensor::{Rank, Result};
use half::bf16;
use std::time::Instant;

use crate::Settings;

/// One row: what was timed, its milliseconds, and the bytes it must move (0: a product, whose
/// ceiling is the GEMM, not memory).
struct LocalRow {
    op: &'static str,
    shape: &'static str,
    ms: f64,
    bytes: f64,
    flops: f64,
}

/// Milliseconds (wall time) each op runs for before it is timed.
const HOT_MS: u128 = 50;

/// Median milliseconds of `op` timed as `torch_peer.py --local` times torch's ops: run for
/// [`HOT_MS`] first (so that no row depends on how idle the GPU was before it), then CUDA events
/// around each of `s.iters` calls queued back to back, with no barrier between them (the two-GPU
/// rows put one before each call). In two runs on H200s (2026-12-02, a barrier before each
/// call in the first) every row read the same to the microsecond but silu (0.070 against 0.069
/// ms); this way is the peer's.
pub(crate) fn time_hot<R>(
    rank: &Rank<'_>,
    s: &Settings,
    mut op: impl FnMut() -> Result<R>,
) -> Result<f64> {
    run_hot(rank, &mut op)?;
    for _ in 0..s.warmup {
        op()?;
    }
    let mut timers = (0..s.iters).map(|_| Timer::new(rank)).collect::<Result<Vec<_>>>()?;
    for t in &mut timers {
        t.start(rank)?;
        op()?;
        t.stop(rank)?;
    }
    cuda::synchronize(rank)?;
    let ms: Vec<f64> =
        timers.iter().map(|t| t.elapsed_ms().map(f64::from)).collect::<Result<_>>()?;
    Ok(crate::stats::median(ms))
}

/// Runs `op` for [`HOT_MS`], then waits for the GPU.
pub(crate) fn run_hot<R>(rank: &Rank<'_>, op: &mut impl FnMut() -> Result<R>) -> Result<()> {
    let start = Instant::now();
    while start.elapsed().as_millis() < HOT_MS {
        for _ in 0..10 {
            op()?;
        }
        cuda::synchronize(rank)?;
    }
    Ok(())
}

fn rows(rank: &Rank<'_>, s: &Settings) -> Result<(f64, Vec<LocalRow>)> {
    const E: f64 = 2.0; // bytes of a bf16
    let square = cuda::random::<bf16>(rank, &[8192, 8192], 1)?;
    let other = cuda::random::<bf16>(rank, &[8192, 8192], 2)?;
    let wider = &square * bf16::from_f32(4.0);
    let wide = cuda::random::<bf16>(rank, &[16384, 8192], 3)?;
    let weight = cuda::random::<bf16>(rank, &[8192], 4)?;
    let bias = cuda::random::<bf16>(rank, &[8192], 5)?;
    let single = cuda::random::<f32>(rank, &[8192, 8192], 6)?;
    let a = cuda::random::<bf16>(rank, &[32, 2048, 128], 7)?;
    let b = cuda::random::<bf16>(rank, &[32, 128, 2048], 8)?;
    let copied = cuda::random::<f32>(rank, &[1 << 28], 9)?;
    let n = (8192 * 8192) as f64;
    let wide_n = (16384 * 8192) as f64;
    // The roofline: a device copy's bandwidth, bytes read + written.
    let copy_ms = time_hot(rank, s, || cuda::device_copy(rank, &copied))?;
    let copy_gbs = 2.0 * (1u64 << 30) as f64 / (copy_ms * 1e-3) / 1e9;
    let row = |op, shape, ms, bytes| LocalRow { op, shape, ms, bytes, flops: 0.0 };
    let mut out = vec![
        row("add", "[8192, 8192]", time_hot(rank, s, || Ok(&square + &other))?, 3.0 * n * E),
        row("mul", "[8192, 8192]", time_hot(rank, s, || Ok(&square * &other))?, 3.0 * n * E),
        row("gelu", "[8192, 8192]", time_hot(rank, s, || Ok(square.gelu()))?, 2.0 * n * E),
        row(
            "gelu of [-4, 4)",
            "[8192, 8192]",
            time_hot(rank, s, || Ok(wider.gelu()))?,
            2.0 * n * E,
        ),
        row(
            "gelu_tanh",
            "[8192, 8192]",
            time_hot(rank, s, || Ok(square.gelu_tanh()))?,
            2.0 * n * E,
        ),
        row("silu", "[8192, 8192]", time_hot(rank, s, || Ok(square.silu()))?, 2.0 * n * E),
        row(
            "cast f32 -> bf16",
            "[8192, 8192]",
            time_hot(rank, s, || Ok(single.cast::<bf16>()))?,
            n * 6.0,
        ),
        row(
            "softmax (last dim)",
            "[16384, 8192]",
            time_hot(rank, s, || wide.softmax(1))?,
            2.0 * wide_n * E,
        ),
        row(
            "rms_norm (last dim)",
            "[16384, 8192]",
            time_hot(rank, s, || wide.rms_norm(Some(&weight), 1e-5))?,
            2.0 * wide_n * E,
        ),
        row(
            "layer_norm (last dim)",
            "[16384, 8192]",
            time_hot(rank, s, || wide.layer_norm(Some(&weight), Some(&bias), 1e-5))?,
            2.0 * wide_n * E,
        ),
        row(
            "transpose (last two)",
            "[8192, 8192]",
            time_hot(rank, s, || square.transpose(0, 1))?,
            2.0 * n * E,
        ),
    ];
    let bmm = time_hot(rank, s, || a.matmul(&b))?;
    out.push(LocalRow {
        op: "bmm",
        shape: "[32, 2048, 128] x [32, 128, 2048]",
        ms: bmm,
        bytes: 0.0,
        flops: 2.0 * 32.0 * 2048.0 * 2048.0 * 128.0,
    });
    // Keep the inputs alive until every timing is done.
    drop((square, other, wider, wide, weight, bias, single, a, b, copied));
    Ok((copy_gbs, out))
}

/// Prints the local-op table of GPU 0.
pub fn report(s: &Settings) -> Result<()> {
    let Some(world) = crate::one_gpu("--local") else {
        return Ok(());
    };
    let info = world.run(cuda::gpu_info)?.remove(0);
    let (copy_gbs, rows) = world.run(|rank| rows(rank, s))?.remove(0);
    println!(
        "# gpu_report --local: {} ({} SMs), one rank, ms (median of {} after 50 ms and {} \
         warm-up); roofline: a device copy at {copy_gbs:.0} GB/s (read + write)",
        info.name, info.multiprocessors, s.iters, s.warmup
    );
    println!();
    println!("| op | shape | ms | roofline ms | of roofline | TFLOP/s |");
    println!("| --- | --- | --- | --- | --- | --- |");
    for r in &rows {
        if r.bytes > 0.0 {
            let roof = r.bytes / (copy_gbs * 1e9) * 1e3;
            println!("| {} | {} | {:.4} | {roof:.4} | {:.3} | |", r.op, r.shape, r.ms, r.ms / roof);
        } else {
            let tflops = r.flops / (r.ms * 1e-3) / 1e12;
            println!("| {} | {} | {:.4} | | | {tflops:.0} |", r.op, r.shape, r.ms);
        }
    }
    Ok(())
}
