//! matmul_reduce_scatter: fused, unfused (matmul then reduce_scatter), and the `gemm` crate on
//! the same total work with every core. Throughput in FLOP (`Elements` counts floating-point
//! operations).

mod common;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use dist_tensor::{DistTensor, Placement, Tensor, World};

fn gemm_rs(c: &mut Criterion) {
    for (world_size, (m, k, n)) in [(2, (1024, 1024, 1024)), (4, (1024, 1024, 1024))] {
        let world = World::threads(world_size).unwrap();
        let h = Tensor::<f32>::random(&[m, k], 1);
        let w = Tensor::<f32>::random(&[k, n], 2);
        let id = format!("world{world_size}/M{m}_K{k}_N{n}");
        let mut group = c.benchmark_group("gemm_rs");
        group.throughput(Throughput::Elements((2 * m * k * n) as u64));
        for fused in [true, false] {
            let name = if fused { "fused" } else { "unfused" };
            group.bench_function(BenchmarkId::new(name, &id), |b| {
                b.iter_custom(|iters| {
                    common::on_ranks(&world, |rank| {
                        let h = DistTensor::from_global(rank, &h, Placement::Shard(1))?;
                        let w =
                            DistTensor::from_global(rank, &w, Placement::Shard(0))?.into_local();
                        common::timed(rank, iters, || {
                            let y = if fused {
                                h.matmul_reduce_scatter(&w)?
                            } else {
                                h.matmul_reduce_scatter_unfused(&w)?
                            };
                            drop(y);
                            Ok(())
                        })
                    })
                })
            });
        }
        group.bench_function(BenchmarkId::new("gemm", &id), |b| {
            b.iter_custom(|iters| common::gemm_f32(m, k, n, iters))
        });
        group.finish();
    }
}

criterion_group! { name = benches; config = common::config(); targets = gemm_rs }
criterion_main!(benches);
