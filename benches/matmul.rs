//! Local matrix products: `Tensor::matmul_threads` beside the `gemm` crate called directly.
//!
//! Groups are `matmul/<dtype>/<n>` over square `n x n` products; within a group, `tensor/t<T>` is
//! the wrapper and `gemm/t<T>` the direct call on the same operands, each on `T` threads (1, and
//! every core `std::thread::available_parallelism` reports). The ratio of the two at n = 1024 is
//! the wrapper's cost; the target is at most 5%.
//!
//! The direct call writes into an output allocated once, outside the timed loop, while the wrapper
//! allocates its output on every call: that allocation is part of what the wrapper costs.
//!
//! `gemm` has no bf16 kernel, so for bf16 the direct comparison is what the wrapper does
//! internally, spelled out by hand: widen both operands to f32, call `gemm::gemm` for f32, and
//! round the product back to bf16, all inside the timed loop (`gemm/t<T>`). `gemm_prewidened/t<T>`
//! times the f32 kernel alone on operands widened beforehand: the floor that no bf16 path through
//! the f32 kernel can beat.

use std::hint::black_box;
use std::time::Duration;

use criterion::{
    BenchmarkId, Criterion, SamplingMode, Throughput, criterion_group, criterion_main,
};
use dist_tensor::{Element, Tensor};
use gemm::Parallelism;
use half::bf16;

const SIZES: [usize; 2] = [512, 1024];

fn thread_counts() -> Vec<usize> {
    let all = std::thread::available_parallelism().map_or(1, |n| n.get());
    if all > 1 { vec![1, all] } else { vec![1] }
}

fn parallelism(threads: usize) -> Parallelism {
    if threads <= 1 { Parallelism::None } else { Parallelism::Rayon(threads) }
}

/// `dst = lhs * rhs` for contiguous row-major f32 `n x n` matrices, straight through `gemm`.
fn gemm_f32(dst: &mut [f32], lhs: &[f32], rhs: &[f32], n: usize, threads: usize) {
    assert!(dst.len() == n * n && lhs.len() == n * n && rhs.len() == n * n);
    let n_i = n as isize;
    // SAFETY: all three are n x n row-major slices (row stride n, column stride 1), checked above;
    // `dst` is borrowed mutably so it overlaps neither operand. read_dst is false, so dst's old
    // contents are ignored: dst := 1 * lhs * rhs.
    unsafe {
        gemm::gemm(
            n,
            n,
            n,
            dst.as_mut_ptr(),
            1,
            n_i,
            false,
            lhs.as_ptr(),
            1,
            n_i,
            rhs.as_ptr(),
            1,
            n_i,
            0.0f32,
            1.0f32,
            false,
            false,
            false,
            parallelism(threads),
        )
    }
}

fn configure(
    c: &mut Criterion,
    name: String,
    n: usize,
) -> criterion::BenchmarkGroup<'_, criterion::measurement::WallTime> {
    let mut group = c.benchmark_group(name);
    group
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1))
        .sampling_mode(SamplingMode::Flat)
        // `Elements` counts floating-point operations here (a multiply and an add per term of
        // each of the n * n dot products of length n), so criterion's "elem/s" reads as FLOP/s.
        .throughput(Throughput::Elements(2 * (n as u64).pow(3)));
    group
}

fn bench_f32(c: &mut Criterion) {
    for n in SIZES {
        let a = Tensor::<f32>::random(&[n, n], 1);
        let b = Tensor::<f32>::random(&[n, n], 2);
        let mut dst = vec![0.0f32; n * n];
        let mut group = configure(c, format!("matmul/f32/{n}"), n);
        for threads in thread_counts() {
            group.bench_function(BenchmarkId::new("tensor", format!("t{threads}")), |bench| {
                bench.iter(|| black_box(a.matmul_threads(black_box(&b), threads).unwrap()))
            });
            group.bench_function(BenchmarkId::new("gemm", format!("t{threads}")), |bench| {
                bench.iter(|| {
                    gemm_f32(
                        &mut dst,
                        black_box(a.as_slice()),
                        black_box(b.as_slice()),
                        n,
                        threads,
                    );
                    black_box(&dst);
                })
            });
        }
        group.finish();
    }
}

fn bench_bf16(c: &mut Criterion) {
    for n in SIZES {
        let a = Tensor::<bf16>::random(&[n, n], 1);
        let b = Tensor::<bf16>::random(&[n, n], 2);
        let widen = |x: &[bf16]| x.iter().map(|v| v.to_acc()).collect::<Vec<f32>>();
        let (a32, b32) = (widen(a.as_slice()), widen(b.as_slice()));
        let mut dst32 = vec![0.0f32; n * n];
        let mut dst = vec![bf16::ZERO; n * n];
        let (mut wa, mut wb) = (Vec::with_capacity(n * n), Vec::with_capacity(n * n));
        let mut group = configure(c, format!("matmul/bf16/{n}"), n);
        for threads in thread_counts() {
            group.bench_function(BenchmarkId::new("tensor", format!("t{threads}")), |bench| {
                bench.iter(|| black_box(a.matmul_threads(black_box(&b), threads).unwrap()))
            });
            // The wrapper's own work by hand: widen to f32, the f32 kernel, round back once.
            group.bench_function(BenchmarkId::new("gemm", format!("t{threads}")), |bench| {
                bench.iter(|| {
                    wa.clear();
                    wa.extend(black_box(a.as_slice()).iter().map(|v| v.to_f32()));
                    wb.clear();
                    wb.extend(black_box(b.as_slice()).iter().map(|v| v.to_f32()));
                    gemm_f32(&mut dst32, &wa, &wb, n, threads);
                    for (d, &s) in dst.iter_mut().zip(&dst32) {
                        *d = bf16::from_f32(s);
                    }
                    black_box(&dst);
                })
            });
            group.bench_function(
                BenchmarkId::new("gemm_prewidened", format!("t{threads}")),
                |bench| {
                    bench.iter(|| {
                        gemm_f32(&mut dst32, black_box(&a32), black_box(&b32), n, threads);
                        black_box(&dst32);
                    })
                },
            );
        }
        group.finish();
    }
}

criterion_group!(benches, bench_f32, bench_bf16);
criterion_main!(benches);
