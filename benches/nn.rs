//! Training: one step of a tensor-parallel MLP (forward, loss, backward, Adam) with the fused ops
//! against the same step with the unfused baselines, and the `gemm` crate on the step's six
//! products with every core (the ceiling); and the fused ops as the backward pass calls them
//! (the weight read transposed, the gathered input kept) beside the plain ops. Throughput in
//! FLOP (`Elements` counts floating-point operations of the products). The `autograd` group: the
//! layers' `forward` / `backward` pairs (`layer`: the pass recorded on autograd, run backward,
//! the replicated parameters' gradients summed over the ranks) against their `forward_var` and
//! a `backward()` through autograd (`forward_var`): what the pair's API costs. (Until 2026-12-01
//! `layer` was a hand-written backward pass; none was faster, and they were deleted.)

mod common;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use dist_tensor::autograd::DVar;
use dist_tensor::nn::{
    Activation, Adam, ColumnParallelLinear, Module, ParallelMlp, RowParallelLinear,
    UlyssesAttention, UlyssesSelfAttention, mse_loss,
};
use dist_tensor::{DistTensor, MatmulOptions, Placement, Tensor, World};

fn train_step(c: &mut Criterion) {
    let cases = [(2, (1024, 512, 2048)), (4, (1024, 512, 2048))];
    for (world_size, (m, e, f)) in cases {
        let world = World::threads(world_size).unwrap();
        let x = Tensor::<f32>::random(&[m, e], 1);
        let target = Tensor::<f32>::random(&[m, e], 2);
        let id = format!("world{world_size}/M{m}_E{e}_F{f}");
        let mut group = c.benchmark_group("train_step");
        // Forward, and the input and weight gradients: six products of 2 M E F each.
        group.throughput(Throughput::Elements((6 * 2 * m * e * f) as u64));
        for fused in [true, false] {
            let name = if fused { "fused" } else { "unfused" };
            group.bench_function(BenchmarkId::new(name, &id), |b| {
                b.iter_custom(|iters| {
                    common::on_ranks(&world, |rank| {
                        let mut mlp =
                            ParallelMlp::<f32>::new(rank, e, f, Activation::Gelu, 3)?.fused(fused);
                        let mut adam = Adam::new(1e-3);
                        let xs = DistTensor::from_global(rank, &x, Placement::Shard(0))?;
                        let ts = DistTensor::from_global(rank, &target, Placement::Shard(0))?;
                        common::timed(rank, iters, || {
                            let (y, saved) = mlp.forward(&xs)?;
                            let (_, dy) = mse_loss(&y, &ts)?;
                            mlp.zero_grad();
                            mlp.backward(saved, &dy)?;
                            adam.step(mlp.parameters_mut())
                        })
                    })
                })
            });
        }
        group.bench_function(BenchmarkId::new("gemm", &id), |b| {
            b.iter_custom(|iters| common::gemm_f32(m, e, f, 6 * iters))
        });
        group.finish();
    }
}

fn backward_ops(c: &mut Criterion) {
    let (world_size, (m, k, n)) = (2, (1024, 1024, 1024));
    let world = World::threads(world_size).unwrap();
    let x = Tensor::<f32>::random(&[m, k], 1);
    let w = Tensor::<f32>::random(&[k, n], 2);
    let id = format!("world{world_size}/M{m}_K{k}_N{n}");
    let mut group = c.benchmark_group("backward_ops");
    group.throughput(Throughput::Elements((2 * m * k * n) as u64));
    for variant in ["ag_plain", "ag_transposed", "ag_keep_input", "rs_plain", "rs_transposed"] {
        group.bench_function(BenchmarkId::new(variant, &id), |b| {
            b.iter_custom(|iters| {
                common::on_ranks(&world, |rank| {
                    let rows = DistTensor::from_global(rank, &x, Placement::Shard(0))?;
                    let cols = DistTensor::from_global(rank, &x, Placement::Shard(1))?;
                    // The weight shard as the forward pass holds it, and the same numbers
                    // stored transposed (as the backward pass reads a forward weight).
                    let ag_w = DistTensor::from_global(rank, &w, Placement::Shard(1))?.into_local();
                    let rs_w = DistTensor::from_global(rank, &w, Placement::Shard(0))?.into_local();
                    let (ag_wt, rs_wt) = (ag_w.transpose(0, 1)?, rs_w.transpose(0, 1)?);
                    let t = MatmulOptions::new().transpose_weights(true);
                    common::timed(rank, iters, || {
                        match variant {
                            "ag_plain" => drop(rows.all_gather_matmul(&ag_w)?),
                            "ag_transposed" => drop(rows.all_gather_matmul_with(&[&ag_wt], &t)?),
                            "ag_keep_input" => drop(
                                rows.all_gather_matmul_keep_input(&[&ag_w], &MatmulOptions::new())?,
                            ),
                            "rs_plain" => drop(cols.matmul_reduce_scatter(&rs_w)?),
                            _ => drop(cols.matmul_reduce_scatter_with(&rs_wt, &t)?),
                        }
                        Ok(())
                    })
                })
            })
        });
    }
    group.finish();
}

/// Forward and backward of each layer at world 2, its `forward` / `backward` pair against its
/// `forward_var` and `backward()` (the output itself as its gradient).
fn autograd(c: &mut Criterion) {
    let world = World::threads(2).unwrap();
    let mut group = c.benchmark_group("autograd");
    let (m, e, f) = (512, 256, 1024);
    let x = Tensor::<f32>::random(&[m, e], 1);
    for form in ["layer", "forward_var"] {
        group.bench_function(BenchmarkId::new(form, format!("mlp/world2/M{m}_E{e}_F{f}")), |b| {
            b.iter_custom(|iters| {
                common::on_ranks(&world, |rank| {
                    let mut mlp = ParallelMlp::<f32>::new(rank, e, f, Activation::Gelu, 3)?;
                    let xs = DistTensor::from_global(rank, &x, Placement::Shard(0))?;
                    common::timed(rank, iters, || {
                        if form == "layer" {
                            let (y, saved) = mlp.forward(&xs)?;
                            mlp.backward(saved, &y).map(drop)
                        } else {
                            let xv = DVar::param(xs.clone());
                            let y = mlp.forward_var(&xv)?;
                            y.local().backward_with(y.value().local().clone())
                        }
                    })
                })
            })
        });
    }
    let (s, heads) = (512, 4);
    let xa = Tensor::<f32>::random(&[1, s, e], 2);
    for form in ["layer", "forward_var"] {
        let id = format!("ulysses/world2/S{s}_E{e}_H{heads}");
        group.bench_function(BenchmarkId::new(form, id), |b| {
            b.iter_custom(|iters| {
                common::on_ranks(&world, |rank| {
                    let mut attn = UlyssesSelfAttention::<f32>::new(e, heads, true, 3)?;
                    let xs = DistTensor::from_global(rank, &xa, Placement::Shard(1))?;
                    common::timed(rank, iters, || {
                        if form == "layer" {
                            let (y, saved) = attn.forward(&xs)?;
                            attn.backward(saved, &y).map(drop)
                        } else {
                            let xv = DVar::param(xs.clone());
                            let y = attn.forward_var(&xv)?;
                            y.local().backward_with(y.value().local().clone())
                        }
                    })
                })
            })
        });
    }
    let xc = Tensor::<f32>::random(&[m, e], 3);
    for form in ["layer", "forward_var"] {
        let id = format!("column/world2/M{m}_E{e}_F{f}");
        group.bench_function(BenchmarkId::new(form, id), |b| {
            b.iter_custom(|iters| {
                common::on_ranks(&world, |rank| {
                    let mut fc = ColumnParallelLinear::<f32>::new(rank, e, f, true, 3)?;
                    let xs = DistTensor::from_global(rank, &xc, Placement::Shard(0))?;
                    common::timed(rank, iters, || {
                        if form == "layer" {
                            let (y, saved) = fc.forward(&xs)?;
                            fc.backward(saved, &y).map(drop)
                        } else {
                            let y = fc.forward_var(&DVar::param(xs.clone()))?;
                            y.local().backward_with(y.value().local().clone())
                        }
                    })
                })
            })
        });
    }
    let hr = Tensor::<f32>::random(&[m, f], 4);
    for form in ["layer", "forward_var"] {
        let id = format!("row/world2/M{m}_F{f}_E{e}");
        group.bench_function(BenchmarkId::new(form, id), |b| {
            b.iter_custom(|iters| {
                common::on_ranks(&world, |rank| {
                    let mut fc = RowParallelLinear::<f32>::new(rank, f, e, true, 3)?;
                    let hs = DistTensor::from_global(rank, &hr, Placement::Shard(1))?;
                    common::timed(rank, iters, || {
                        if form == "layer" {
                            let (y, saved) = fc.forward(&hs)?;
                            fc.backward(saved, &y).map(drop)
                        } else {
                            let y = fc.forward_var(&DVar::param(hs.clone()))?;
                            y.local().backward_with(y.value().local().clone())
                        }
                    })
                })
            })
        });
    }
    let d = e / heads;
    let qa = Tensor::<f32>::random(&[1, s, heads, d], 5);
    for form in ["layer", "forward_var"] {
        let id = format!("ulysses_core/world2/S{s}_H{heads}_D{d}");
        group.bench_function(BenchmarkId::new(form, id), |b| {
            b.iter_custom(|iters| {
                common::on_ranks(&world, |rank| {
                    let attn = UlyssesAttention::new(true);
                    let qs = DistTensor::from_global(rank, &qa, Placement::Shard(1))?;
                    common::timed(rank, iters, || {
                        if form == "layer" {
                            let (o, saved) = attn.forward(&qs, &qs, &qs)?;
                            attn.backward(saved, &o).map(drop)
                        } else {
                            let [q, k, v] = [0; 3].map(|_| DVar::param(qs.clone()));
                            let [qh, kh, vh] = [&q, &k, &v].map(|t| t.all_to_all(2, 1));
                            let (kh, vh) = (kh?, vh?);

                            let o = qh?.map(|q| {
                                heads_first(q)?
                                    .scaled_dot_product_attention(
                                        &heads_first(kh.local())?,
                                        &heads_first(vh.local())?,
                                        true,
                                    )?
                                    .permute(&[0, 2, 1, 3])
                            })?;
                            let o = o.all_to_all(1, 2)?;
                            o.local().backward_with(o.value().local().clone())
                        }
                    })
                })
            })
        });
    }
    group.finish();
}

/// `[B, S, h, D]` as `[B, h, S, D]`, what the fused attention takes.
fn heads_first<'r>(
    t: &dist_tensor::autograd::Var<'r, f32>,
) -> dist_tensor::Result<dist_tensor::autograd::Var<'r, f32>> {
    t.permute(&[0, 2, 1, 3])
}

criterion_group! { name = benches; config = common::config(); targets = train_step, backward_ops, autograd }
criterion_main!(benches);
