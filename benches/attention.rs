//! Fused attention (`scaled_dot_product_attention`: tiles, a running max and sum, no S x S
//! tensor) against the naive form a user writes from the local ops (scores by `matmul`, an
//! `[S, S]` additive mask, `softmax`, `matmul`), at B = 1, H = 8, D = 64, f32, S = 1024 to 4096,
//! causal and not. Both take `[B, S, H, D]` (as a projection gives it) and permute it to
//! `[B, H, S, D]` first. Time (median of 3 after one warm-up) and peak memory: the most bytes
//! live at once during the call, over what was live before it, counted by a global allocator
//! that wraps the system's (the tensor buffer cache is emptied first, so every buffer is
//! allocated inside the call). Both forms on every thread of the rayon pool, then both on one.
//!
//! `cargo bench --bench attention` prints the table; `-- --quick` runs S = 1024 only.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use dist_tensor::Tensor;
use dist_tensor::tensor::{release_pool, scaled_dot_product_attention};

struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call forwards to the system allocator with the same arguments; the counters are
// plain atomics.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let now = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
        PEAK.fetch_max(now, Ordering::Relaxed);
        // SAFETY: the caller's layout is passed on unchanged.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: `ptr` came from `alloc` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

const H: usize = 8;
const D: usize = 64;

fn naive(
    q: &Tensor<f32>,
    k: &Tensor<f32>,
    v: &Tensor<f32>,
    causal: bool,
    threads: usize,
) -> Tensor<f32> {
    let (q, k, v) = (
        q.permute(&[0, 2, 1, 3]).unwrap(),
        k.permute(&[0, 2, 1, 3]).unwrap(),
        v.permute(&[0, 2, 1, 3]).unwrap(),
    );
    let s = q.shape()[2];
    let mut scores =
        q.matmul_threads(&k.transpose(2, 3).unwrap(), threads).unwrap() * (1.0 / (D as f32).sqrt());
    if causal {
        let mask: Vec<f32> =
            (0..s * s).map(|i| if i % s > i / s { f32::NEG_INFINITY } else { 0.0 }).collect();
        scores += &Tensor::from_shape_vec(&[s, s], mask).unwrap();
    }
    scores.softmax(3).unwrap().matmul_threads(&v, threads).unwrap()
}

fn fused(q: &Tensor<f32>, k: &Tensor<f32>, v: &Tensor<f32>, causal: bool) -> Tensor<f32> {
    let (q, k, v) = (
        q.permute(&[0, 2, 1, 3]).unwrap(),
        k.permute(&[0, 2, 1, 3]).unwrap(),
        v.permute(&[0, 2, 1, 3]).unwrap(),
    );
    scaled_dot_product_attention(&q, &k, &v, causal).unwrap()
}

/// Median seconds of 3 runs after a warm-up, and the peak bytes of one run.
fn measure(f: &(dyn Fn() -> Tensor<f32> + Sync)) -> (f64, usize) {
    drop(f());
    let mut times: Vec<f64> = (0..3)
        .map(|_| {
            let t = Instant::now();
            drop(f());
            t.elapsed().as_secs_f64()
        })
        .collect();
    times.sort_by(f64::total_cmp);
    release_pool();
    let before = LIVE.load(Ordering::Relaxed);
    PEAK.store(before, Ordering::Relaxed);
    let out = f();
    let peak = PEAK.load(Ordering::Relaxed) - before;
    drop(out);
    (times[1], peak)
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let lengths: &[usize] = if quick { &[1024] } else { &[1024, 2048, 4096] };
    let all = rayon::current_num_threads();
    println!(
        "attention, B=1 H={H} D={D} f32; naive = permute + matmul + [S,S] mask + softmax + matmul"
    );
    println!(
        "{:>8} {:>6} {:>7} | {:>10} {:>10} {:>6} | {:>11} {:>11} {:>6}",
        "threads",
        "causal",
        "S",
        "naive ms",
        "fused ms",
        "ratio",
        "naive MiB",
        "fused MiB",
        "ratio"
    );
    let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
    for (threads, pool) in [(all, None), (1, Some(&one))] {
        for causal in [true, false] {
            for &s in lengths {
                let x: Vec<Tensor<f32>> =
                    (0..3).map(|i| Tensor::random(&[1, s, H, D], i)).collect();
                let run = |f: &(dyn Fn() -> Tensor<f32> + Sync)| match pool {
                    Some(p) => p.install(|| measure(f)),
                    None => measure(f),
                };
                let (tn, mn) = run(&|| naive(&x[0], &x[1], &x[2], causal, threads));
                let (tf, mf) = run(&|| fused(&x[0], &x[1], &x[2], causal));
                let mib = |b: usize| b as f64 / (1 << 20) as f64;
                println!(
                    "{threads:>8} {causal:>6} {s:>7} | {:>10.1} {:>10.1} {:>6.2} | {:>11.1} {:>11.1} {:>6.3}",
                    tn * 1e3,
                    tf * 1e3,
                    tf / tn,
                    mib(mn),
                    mib(mf),
                    mf as f64 / mn as f64
                );
            }
        }
    }
}
