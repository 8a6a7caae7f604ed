//! The Ulysses all_to_all: fused, unfused (permute, all_to_all, permute), and memcpy of the same
//! bytes split over every core. Throughput in bytes of the whole tensor.

mod common;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use dist_tensor::{DistTensor, Placement, Tensor, World};

fn all_to_all(c: &mut Criterion) {
    for (world_size, (b, s, h, d)) in [(2, (1, 2048, 16, 128)), (4, (1, 4096, 32, 128))] {
        let world = World::threads(world_size).unwrap();
        let q = Tensor::<f32>::random(&[b, s, h, d], 1);
        let bytes = b * s * h * d * size_of::<f32>();
        let id = format!("world{world_size}/B{b}_S{s}_H{h}_D{d}");
        let mut group = c.benchmark_group("all_to_all");
        group.throughput(Throughput::Bytes(bytes as u64));
        for fused in [true, false] {
            let name = if fused { "fused" } else { "unfused" };
            group.bench_function(BenchmarkId::new(name, &id), |bench| {
                bench.iter_custom(|iters| {
                    common::on_ranks(&world, |rank| {
                        let q = DistTensor::from_global(rank, &q, Placement::Shard(1))?;
                        common::timed(rank, iters, || {
                            let heads = if fused {
                                q.all_to_all(2, 1)?
                            } else {
                                q.all_to_all_unfused(2, 1)?
                            };
                            drop(heads);
                            Ok(())
                        })
                    })
                })
            });
        }
        group.bench_function(BenchmarkId::new("memcpy", &id), |bench| {
            bench.iter_custom(|iters| common::memcpy(bytes, iters))
        });
        group.finish();
    }
}

criterion_group! { name = benches; config = common::config(); targets = all_to_all }
criterion_main!(benches);
