//! Symmetric memory on the host: signal round-trip latency, and remote-store bandwidth through
//! `symm_at` beside memcpy of the same bytes, in the same run.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use dist_tensor::World;
use dist_tensor::device::tile;
use dist_tensor::shmem::{GlobalPtr, NotifySem, Scope, SignalOp, WaitCmp, WaitSem, symm_at};

/// Rank 0 sets rank 1's signal, rank 1 answers by setting rank 0's: one iteration is one round
/// trip, timed on rank 0.
fn signal_round_trip(c: &mut Criterion) {
    let world = World::threads(2).unwrap();
    let mut group = c.benchmark_group("signal");
    group.bench_function("round_trip", |b| {
        b.iter_custom(|iters| {
            let times = world
                .run(|rank| {
                    let sigs = rank.alloc_signals(1)?;
                    let (me, peer) = (rank.rank(), 1 - rank.rank());
                    let start = Instant::now();
                    for i in 1..=iters {
                        if me == 0 {
                            rank.notify(
                                &sigs,
                                0,
                                peer,
                                SignalOp::Set(i),
                                Scope::Peer,
                                NotifySem::Release,
                            )?;
                            let _ = rank.wait(&sigs, 0, WaitCmp::Eq(i), WaitSem::Acquire)?;
                        } else {
                            let _ = rank.wait(&sigs, 0, WaitCmp::Eq(i), WaitSem::Acquire)?;
                            rank.notify(
                                &sigs,
                                0,
                                peer,
                                SignalOp::Set(i),
                                Scope::Peer,
                                NotifySem::Release,
                            )?;
                        }
                    }
                    let elapsed = start.elapsed();
                    let _ = rank.barrier_all()?;
                    Ok(elapsed)
                })
                .unwrap();
            times[0]
        })
    });
    group.finish();
}

/// Rank 0 stores `bytes` into rank 1's buffer through `symm_at`; memcpy copies the same bytes
/// between two local buffers on one thread.
fn remote_store_vs_memcpy(c: &mut Criterion) {
    let world = World::threads(2).unwrap();
    let mut group = c.benchmark_group("remote_store");
    for bytes in [64 << 10, 4 << 20, 16 << 20] {
        let len = bytes / size_of::<f32>();
        let src: Vec<f32> = (0..len).map(|i| i as f32).collect();
        let label = format!("{}KiB", bytes >> 10);
        group.throughput(Throughput::Bytes(bytes as u64));
        group.bench_with_input(BenchmarkId::new("symm_at", &label), &len, |b, &len| {
            b.iter_custom(|iters| {
                world
                    .run(|rank| {
                        let dst = rank.alloc::<f32>(len)?;
                        let mut elapsed = Duration::ZERO;
                        if rank.rank() == 0 {
                            let remote = symm_at(&dst, 1);
                            let start = Instant::now();
                            for _ in 0..iters {
                                let from = GlobalPtr::from_slice(black_box(&src));
                                // SAFETY: rank 1 does not touch its buffer until the barrier.
                                unsafe { tile::copy_2d(remote, len, from, len, (1, len)) };
                            }
                            elapsed = start.elapsed();
                        }
                        let _ = rank.barrier_all()?;
                        Ok(elapsed)
                    })
                    .unwrap()[0]
            })
        });
        group.bench_with_input(BenchmarkId::new("memcpy", &label), &len, |b, &len| {
            let mut dst = vec![0.0f32; len];
            b.iter(|| dst.copy_from_slice(black_box(&src)));
        });
    }
    group.finish();
}

/// One all_gather of one float per rank at growing world sizes: the cost of a collective call's
/// exchange, which is linear in the world size (each rank writes its message once and reads one
/// small message per peer). Timed on rank 0, over calls after the first.
fn exchange_by_world_size(c: &mut Criterion) {
    let mut group = c.benchmark_group("world_size");
    group.sample_size(10);
    for n in [10, 100, 1000] {
        let world = World::builder(n).heap_capacity(1 << 20).build().unwrap();
        group.bench_with_input(BenchmarkId::new("all_gather_1_float", n), &n, |b, _| {
            b.iter_custom(|iters| {
                world
                    .run(|rank| {
                        let _ = dist_tensor::collectives::all_gather(rank, &[1.0f32])?;
                        let start = Instant::now();
                        for _ in 0..iters {
                            black_box(dist_tensor::collectives::all_gather(rank, &[1.0f32])?);
                        }
                        Ok(start.elapsed())
                    })
                    .unwrap()[0]
            })
        });
        // The exchange alone: a barrier is an exchange of no words.
        group.bench_with_input(BenchmarkId::new("barrier_all", n), &n, |b, _| {
            b.iter_custom(|iters| {
                world
                    .run(|rank| {
                        let start = Instant::now();
                        for _ in 0..iters {
                            let _ = black_box(rank.barrier_all()?);
                        }
                        Ok(start.elapsed())
                    })
                    .unwrap()[0]
            })
        });
    }
    group.finish();
}

fn config() -> Criterion {
    Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
}

criterion_group! { name = benches; config = config(); targets = signal_round_trip, remote_store_vs_memcpy, exchange_by_world_size }
criterion_main!(benches);
