//! all_gather_matmul: fused, unfused (all_gather then matmul), and the `gemm` crate on the same
//! total work with every core. Throughput in FLOP (`Elements` counts floating-point operations).

mod common;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use dist_tensor::{DistTensor, Placement, Tensor, World};

fn ag_gemm(c: &mut Criterion) {
    let cases = [(2, (1024, 1024, 1024)), (2, (16, 4096, 4096)), (4, (1024, 1024, 1024))];
    for (world_size, (m, k, n)) in cases {
        let world = World::threads(world_size).unwrap();
        let x = Tensor::<f32>::random(&[m, k], 1);
        let w = Tensor::<f32>::random(&[k, n], 2);
        let id = format!("world{world_size}/M{m}_K{k}_N{n}");
        let mut group = c.benchmark_group("ag_gemm");
        group.throughput(Throughput::Elements((2 * m * k * n) as u64));
        for fused in [true, false] {
            let name = if fused { "fused" } else { "unfused" };
            group.bench_function(BenchmarkId::new(name, &id), |b| {
                b.iter_custom(|iters| {
                    common::on_ranks(&world, |rank| {
                        let x = DistTensor::from_global(rank, &x, Placement::Shard(0))?;
                        let w =
                            DistTensor::from_global(rank, &w, Placement::Shard(1))?.into_local();
                        common::timed(rank, iters, || {
                            let h = if fused {
                                x.all_gather_matmul(&w)?
                            } else {
                                x.all_gather_matmul_unfused(&w)?
                            };
                            drop(h);
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

criterion_group! { name = benches; config = common::config(); targets = ag_gemm }
criterion_main!(benches);
