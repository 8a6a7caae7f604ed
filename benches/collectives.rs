//! Bus bandwidth of each collective beside memcpy of the same bytes, in one run.
//!
//! Bus bandwidth follows the usual convention (as NCCL's tests report it): the bytes each rank
//! must move over its links for the algorithm to be done, so that numbers of different
//! collectives and world sizes compare. For `S` bytes of input per rank and `n` ranks:
//! all_gather moves `S (n - 1)`, reduce_scatter and all_to_all `S (n - 1) / n`, all_reduce twice
//! that, broadcast `S`. memcpy copies `S` bytes once, on one thread, into a buffer it reuses; the
//! collectives write into outputs allocated once, too (their `_into` forms). A collective's time
//! runs from a barrier to a barrier: it is the slowest rank's.

mod common;

use std::hint::black_box;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use dist_tensor::collectives::{self, ReduceOp};
use dist_tensor::tensor::array_split;
use dist_tensor::{Rank, Result, World};

/// A collective writing into a preallocated output.
type Collective = fn(&Rank<'_>, &[f32], &mut [f32]) -> Result<()>;
/// Output length for (input length, world size, rank).
type OutLen = fn(usize, usize, usize) -> usize;
/// Bus bytes for (input bytes per rank, world size).
type BusBytes = fn(f64, f64) -> f64;

const OPS: [(&str, Collective, OutLen, BusBytes); 5] = [
    (
        "all_gather",
        |r, x, o| collectives::all_gather_into(r, x, o),
        |l, n, _| l * n,
        |s, n| s * (n - 1.0),
    ),
    (
        "reduce_scatter",
        |r, x, o| collectives::reduce_scatter_into(r, x, ReduceOp::Sum, o),
        |l, n, r| array_split(l, n)[r],
        |s, n| s * (n - 1.0) / n,
    ),
    (
        "all_reduce",
        |r, x, o| collectives::all_reduce_into(r, x, o),
        |l, _, _| l,
        |s, n| 2.0 * s * (n - 1.0) / n,
    ),
    (
        "all_to_all",
        |r, x, o| collectives::all_to_all_into(r, x, o),
        |l, _, _| l,
        |s, n| s * (n - 1.0) / n,
    ),
    ("broadcast", |r, x, o| collectives::broadcast_into(r, x, 0, o), |l, _, _| l, |s, _| s),
];

fn collectives_vs_memcpy(c: &mut Criterion) {
    for bytes in [64usize << 10, 16 << 20] {
        let len = bytes / size_of::<f32>();
        let label = if bytes >= 1 << 20 {
            format!("{}MiB", bytes >> 20)
        } else {
            format!("{}KiB", bytes >> 10)
        };
        let mut group = c.benchmark_group(format!("collectives/{label}"));
        group.throughput(Throughput::Bytes(bytes as u64));
        let src: Vec<f32> = (0..len).map(|i| i as f32).collect();
        let mut dst = vec![0.0f32; len];
        group.bench_function("memcpy", |b| b.iter(|| dst.copy_from_slice(black_box(&src))));
        for world_size in [2usize, 4] {
            let world = World::threads(world_size).unwrap();
            for (name, op, out_len, bus_bytes) in OPS {
                let bus = bus_bytes(bytes as f64, world_size as f64) as u64;
                group.throughput(Throughput::Bytes(bus));
                group.bench_function(BenchmarkId::new(name, format!("world{world_size}")), |b| {
                    b.iter_custom(|iters| {
                        world
                            .run(|rank| {
                                let x: Vec<f32> =
                                    (0..len).map(|i| (i + rank.rank()) as f32).collect();
                                let mut out = vec![0.0f32; out_len(len, world_size, rank.rank())];
                                // Warmed once (workspaces sized, pages touched), then timed
                                // between two barriers.
                                common::timed(rank, iters, || op(rank, black_box(&x), &mut out))
                            })
                            .unwrap()[0]
                    })
                });
            }
        }
        group.finish();
    }
}

fn config() -> Criterion {
    Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1))
}

criterion_group! { name = benches; config = config(); targets = collectives_vs_memcpy }
criterion_main!(benches);
