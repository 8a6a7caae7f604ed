//! Meshes and groups: every collective and fused op over every group of a mesh against f64
//! references built from the members' inputs (every group of a dimension at once), in worlds of
//! threads and of processes; calls that meet the wrong group fail cleanly; data-parallel
//! training on a 2 x 2 mesh equals one rank trained on the whole batch.

use std::time::{Duration, Instant};

use dist_tensor::collectives;
use dist_tensor::mesh::zero::Zero1;
use dist_tensor::mesh::{DeviceMesh, data_parallel};
use dist_tensor::nn::{
    Activation, Adam, ColumnParallelLinear, GradHook, Module, RowParallelLinear, mse_loss,
};
use dist_tensor::shmem::try_symm_at;
use dist_tensor::{DistTensor, Element, Error, Placement, Rank, Split, Tensor, World};
use half::bf16;

mod common;

use common::checks::off;
use common::crossed::{check_crossed, crossed_in_job, crossed_outcome};
use common::mesh_ops::mesh_ops;
use common::reference::{self, rel_err};
use common::{f64s, slice, tolerance};

const MESHES: [(usize, usize); 6] = [(1, 4), (2, 2), (4, 1), (2, 3), (3, 2), (2, 4)];

#[test]
fn every_op_over_every_group_of_every_mesh_on_threads() {
    for (dp, tp) in MESHES {
        let fails = World::threads(dp * tp).unwrap().run(|rank| mesh_ops(rank, dp, tp)).unwrap();
        let fails: Vec<String> = fails.into_iter().flatten().collect();
        assert!(fails.is_empty(), "mesh {dp}x{tp}: {fails:#?}");
    }
}

#[test]
fn a_mesh_lays_out_coordinates_and_groups() {
    let out = World::threads(6)
        .unwrap()
        .run(|rank| {
            let mesh = DeviceMesh::new(rank, &[("dp", 2), ("tp", 3)])?;
            let tp = mesh.group("tp")?.members().to_vec();
            let dp = mesh.group("dp")?.members().to_vec();
            Ok((mesh.coords().to_vec(), dp, tp, mesh.layout_warning().map(str::to_string)))
        })
        .unwrap();
    assert_eq!(out[4], (vec![1, 1], vec![1, 4], vec![3, 4, 5], None));
    assert_eq!(out[2], (vec![0, 2], vec![2, 5], vec![0, 1, 2], None));
    // Sizes whose product is not the world, a name twice: every rank refuses.
    let err = World::threads(4)
        .unwrap()
        .run(|rank| DeviceMesh::new(rank, &[("dp", 3), ("tp", 2)]).map(drop))
        .unwrap_err();
    assert!(err.to_string().contains("must be the world"), "{err}");
    let err = World::threads(4)
        .unwrap()
        .run(|rank| DeviceMesh::new(rank, &[("a", 2), ("a", 2)]).map(drop))
        .unwrap_err();
    assert!(err.to_string().contains("distinct"), "{err}");
}

#[test]
fn calls_on_the_wrong_group_fail_cleanly() {
    let world = World::builder(4).wait_timeout(Duration::from_secs(20)).build().unwrap();
    // Two members of one group in different ops: OpMismatch on both, as in a world.
    let err = world
        .run(|rank| {
            let mesh = DeviceMesh::new(rank, &[("dp", 2), ("tp", 2)])?;
            let tp = mesh.rank_of("tp")?;
            if mesh.coord("tp")? == 0 {
                collectives::all_reduce(&tp, &[1.0f32]).map(drop)
            } else {
                collectives::all_gather(&tp, &[1.0f32]).map(drop)
            }
        })
        .unwrap_err();
    assert!(matches!(err.rank_error(), Error::OpMismatch { .. }), "{err}");

    // Rank 0 calls on its tp group while every other rank calls on its dp group: rank 0's
    // partner in tp never comes; every rank ends with an error well before the wait timeout.
    let world = World::builder(4).wait_timeout(Duration::from_secs(20)).build().unwrap();
    let start = Instant::now();
    let err = world
        .run(|rank| {
            let mesh = DeviceMesh::new(rank, &[("dp", 2), ("tp", 2)])?;
            let dim = if rank.rank() == 0 { "tp" } else { "dp" };
            collectives::all_reduce(&mesh.rank_of(dim)?, &[1.0f64]).map(drop)
        })
        .unwrap_err();
    assert!(start.elapsed() < Duration::from_secs(10), "{:?}: {err}", start.elapsed());
    assert!(matches!(err, Error::RankFailed { rank: 0, .. }), "{err}");
    // Rank 1 returned with its last call on its dp group: rank 0 hears of both calls.
    assert!(matches!(err.rank_error(), Error::OpMismatch { rank_b: 1, .. }), "{err}");
    assert!(err.to_string().contains("its last call before it returned"), "{err}");

    // A group's buffer has segments for its members only.
    World::threads(4)
        .unwrap()
        .run(|rank| {
            let mesh = DeviceMesh::new(rank, &[("dp", 2), ("tp", 2)])?;
            let tp = mesh.rank_of("tp")?;
            let buf = tp.alloc::<f32>(8)?;
            assert!(try_symm_at(&buf, 1).is_ok());
            let err = try_symm_at(&buf, 2).unwrap_err();
            assert!(err.to_string().contains("outside a world of 2 ranks"), "{err}");
            Ok(())
        })
        .unwrap();
}

#[test]
fn crossed_calls_on_different_groups_fail_every_rank_with_op_mismatch() {
    for slow in [false, true] {
        let world = World::builder(4).wait_timeout(Duration::from_secs(20)).build().unwrap();
        let outcomes = std::sync::Mutex::new(vec![String::new(); 4]);
        let result = world.run(|rank| {
            let out = crossed_outcome(rank, slow);
            let failed = out.contains("error");
            outcomes.lock().unwrap()[rank.rank()] = out.clone();
            if failed {
                Err(Error::InvalidArgument { op: "test", rank: 0, reason: out })
            } else {
                Ok(())
            }
        });
        assert_eq!(result.is_ok(), slow, "{result:?}");
        check_crossed(&outcomes.into_inner().unwrap(), slow);
    }
}

#[test]
fn crossed_calls_on_different_groups_fail_every_process_with_op_mismatch() {
    const NAME: &str = "crossed_calls_on_different_groups_fail_every_process_with_op_mismatch";
    let slow = std::env::var("CROSSED_SLOW").is_ok();
    if common::jobs::in_rank(|world| crossed_in_job(&world, slow)) {
        return;
    }
    for slow in [false, true] {
        let env: &[(&str, &str)] = if slow { &[("CROSSED_SLOW", "1")] } else { &[] };
        let env = [env, &[("DIST_TENSOR_WAIT_TIMEOUT_MS", "20000")]].concat();
        let exits = common::jobs::run_job(NAME, 4, &env);
        let outcomes: Vec<String> = exits.iter().map(common::jobs::result).collect();
        check_crossed(&outcomes, slow);
    }
}

/// The MLP of example 08 on a `dp x tp` mesh, trained by plain gradient descent: tokens split
/// over dp, then sharded over tp; gradients averaged over dp in buckets during the backward pass
/// (`overlap`) or after it. Returns the loss before each step (every rank's).
fn train_on_mesh(
    world: &World,
    dp: usize,
    tp: usize,
    steps: usize,
    averaging: Averaging,
) -> Vec<Vec<f64>> {
    train_with(world, dp, tp, steps, averaging, Optimizer::Sgd)
}

/// How [`train_with`] averages the gradients over dp.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Averaging {
    /// After the backward pass (`all_reduce_mean`).
    After,
    /// During it, each layer's gradients handed in after the layer's `backward` (`ready_all`).
    ByLayer,
    /// During it, each parameter's gradient handed in as it completes (`backward_hooked`).
    Hooked,
}

/// How [`train_with`] steps the parameters with the averaged gradients.
#[derive(Clone, Copy, PartialEq)]
enum Optimizer {
    Sgd,
    /// Every rank steps every parameter.
    Adam,
    /// Adam's state sharded over dp (ZeRO stage 1).
    Zero1,
}

/// [`train_on_mesh`] with `optimizer`.
fn train_with(
    world: &World,
    dp: usize,
    tp: usize,
    steps: usize,
    averaging: Averaging,
    optimizer: Optimizer,
) -> Vec<Vec<f64>> {
    let (tokens, hidden, ffn) = (12, 6, 10);
    let x = Tensor::<f64>::random(&[tokens, hidden], 1);
    let target = Tensor::<f64>::random(&[tokens, hidden], 2).map(f64::tanh);
    let w1 = Tensor::<f64>::random(&[hidden, ffn], 3) * 0.4;
    let b1 = Tensor::<f64>::random(&[ffn], 4) * 0.1;
    let w2 = Tensor::<f64>::random(&[ffn, hidden], 5) * 0.3;
    let b2 = Tensor::<f64>::random(&[hidden], 6) * 0.1;
    let lr = 0.5;
    // Buckets of 64 bytes: several per step, some sent before the backward pass ends.
    let bucket = 64;
    world
        .run(|rank| {
            let mesh = DeviceMesh::new(rank, &[("dp", dp), ("tp", tp)])?;
            let (tpr, dpr) = (mesh.rank_of("tp")?, mesh.averager("dp")?);
            let mut fc1 = ColumnParallelLinear::from_global(&tpr, &w1, Some(&b1), Split::Even)?;
            let mut fc2 = RowParallelLinear::from_global(&tpr, &w2, Some(&b2), Split::Even)?;
            // This replica's share of the batch, then sharded over its tp group.
            let per = tokens / dp;
            let share = mesh.coord("dp")? * per..(mesh.coord("dp")? + 1) * per;
            let xs =
                DistTensor::from_global(&tpr, &slice(&x, 0, share.clone()), Placement::Shard(0))?;
            let ts = DistTensor::from_global(&tpr, &slice(&target, 0, share), Placement::Shard(0))?;
            let mut curve = Vec::new();
            let mut adam = Adam::<f64>::new(0.05);
            let mut zero = Zero1::new(Adam::<f64>::new(0.05), mesh.averager("dp")?);
            for _ in 0..steps {
                let (h, s1) = fc1.forward(&xs)?;
                let a = h.map_local(|t| Activation::Gelu.forward(t))?;
                let (y, s2) = fc2.forward(&a)?;
                let (loss, dy) = mse_loss(&y, &ts)?;
                curve.push(dpr.mean(&[loss])?[0]);
                fc1.zero_grad();
                fc2.zero_grad();
                let pre = h.into_local();
                // Layer by layer: fc2's gradients are ready (and go) before fc1's are computed;
                // hooked, each parameter's as soon as it is (fc1's weight before dx).
                let hooked = averaging == Averaging::Hooked;
                let backward = |buckets: &mut data_parallel::GradBuckets<f64>| {
                    let da = if hooked {
                        fc2.backward_hooked(s2, &dy, buckets)?
                    } else {
                        let da = fc2.backward(s2, &dy)?;
                        buckets.ready_all(&fc2)?;
                        da
                    };
                    let dh = da.try_map_local(|g| Activation::Gelu.backward(&pre, g))?;
                    if hooked {
                        fc1.backward_hooked(s1, &dh, buckets).map(drop)
                    } else {
                        fc1.backward(s1, &dh)?;
                        buckets.ready_all(&fc1)
                    }
                };
                let grads = if averaging == Averaging::After {
                    let mut local = data_parallel::GradBuckets::collect();
                    backward(&mut local)?;
                    data_parallel::all_reduce_mean(&dpr, bucket, &local.into_grads())?
                } else {
                    data_parallel::overlapped(&dpr, bucket, backward)?.1
                };
                let mut params = fc2.parameters_mut();
                params.extend(fc1.parameters_mut());
                match optimizer {
                    Optimizer::Sgd => {
                        for (p, g) in params.into_iter().zip(&grads) {
                            let stepped = p.value() - &(g * lr);
                            *p.value_mut() = stepped;
                        }
                    }
                    Optimizer::Adam => {
                        for (p, g) in params.iter_mut().zip(grads) {
                            p.zero_grad();
                            p.accumulate_grad(g)?;
                        }
                        adam.step(params)?;
                    }
                    Optimizer::Zero1 => zero.step_with_grads(params, &grads)?,
                }
            }
            Ok(curve)
        })
        .unwrap()
}

#[test]
fn training_on_a_2x2_mesh_equals_one_rank_on_the_whole_batch() {
    let steps = 6;
    let one = train_on_mesh(&World::threads(1).unwrap(), 1, 1, steps, Averaging::After);
    let mut curves = Vec::new();
    for averaging in [Averaging::ByLayer, Averaging::Hooked, Averaging::After] {
        let mesh = train_on_mesh(&World::threads(4).unwrap(), 2, 2, steps, averaging);
        for curve in &mesh {
            let diff = curve.iter().zip(&one[0]).fold(0.0f64, |m, (a, b)| m.max((a - b).abs()));
            assert!(diff < 1e-12 * one[0][0], "{averaging:?}: {curve:?} vs {:?}", one[0]);
        }
        assert!(one[0][steps - 1] < one[0][0] * 0.9, "it learns: {:?}", one[0]);
        curves.push(mesh);
    }
    // Overlapped or not, handed in by layer or by parameter: the same sums, the same bits.
    assert_eq!(curves[0], curves[2]);
    assert_eq!(curves[1], curves[2]);
}

/// A 2 x 2 mesh on four processes of this host (this test binary re-executed as the ranks of a
/// job): every op over both groups, and both groups at once.
/// A layer's bias joins the bucket its weight fills, so that nothing waits to be sent once the
/// last layer's backward is done (the first layer's bias went alone after the pass, its
/// all-reduce's latency not hidden); the averaged gradients still come back in the parameters'
/// order, the same bits as averaged after the pass.
#[test]
fn buckets_send_each_layers_bias_with_its_weight_and_keep_the_parameters_order() {
    let (w1, b1) = (Tensor::<f64>::random(&[6, 8], 1), Tensor::<f64>::random(&[8], 2));
    let (w2, b2) = (Tensor::<f64>::random(&[8, 6], 3), Tensor::<f64>::random(&[6], 4));
    let x = Tensor::<f64>::random(&[4, 6], 5);
    let out = World::threads(4)
        .unwrap()
        .run(|rank| {
            let mesh = DeviceMesh::new(rank, &[("dp", 2), ("tp", 2)])?;
            let (tpr, dpr) = (mesh.rank_of("tp")?, mesh.averager("dp")?);
            let mut fc1 = ColumnParallelLinear::from_global(&tpr, &w1, Some(&b1), Split::Even)?;
            let mut fc2 = RowParallelLinear::from_global(&tpr, &w2, Some(&b2), Split::Even)?;
            // Each replica its own rows, so that the average differs from every replica's.
            let rows = slice(&x, 0, mesh.coord("dp")? * 2..mesh.coord("dp")? * 2 + 2);
            let xs = DistTensor::from_global(&tpr, &rows, Placement::Shard(0))?;
            let (h, s1) = fc1.forward(&xs)?;
            let (y, s2) = fc2.forward(&h)?;
            let dh = fc2.backward(s2, &y)?;
            fc1.backward(s1, &dh)?;
            // Buckets the size of a weight (either layer's: 6 x 4 or 4 x 6 on this rank).
            let bucket = 24 * size_of::<f64>();
            let mut unsent = Vec::new();
            let ((), grads) = data_parallel::overlapped(&dpr, bucket, |buckets| {
                buckets.ready_all(&fc2)?;
                unsent.push(buckets.unsent());
                buckets.ready_all(&fc1)?;
                unsent.push(buckets.unsent());
                Ok(())
            })?;
            let mut local = data_parallel::GradBuckets::collect();
            local.ready_all(&fc2)?;
            local.ready_all(&fc1)?;
            let after = data_parallel::all_reduce_mean(&dpr, bucket, &local.into_grads())?;
            let mut params = fc2.parameters();
            params.extend(fc1.parameters());
            let shapes_match =
                params.iter().zip(&grads).all(|(p, g)| p.value().shape() == g.shape());
            let same = grads.iter().zip(&after).all(|(a, b)| a.as_slice() == b.as_slice());
            let own = params.iter().zip(&grads).any(|(p, g)| p.grad().unwrap() != *g);
            Ok((unsent, shapes_match && grads.len() == 4, same, own))
        })
        .unwrap();
    for (r, (unsent, shapes, same, averaged)) in out.into_iter().enumerate() {
        assert_eq!(unsent, vec![0, 0], "rank {r}: elements left in the bucket after each layer");
        assert!(shapes, "rank {r}: the gradients are not in the parameters' order");
        assert!(same, "rank {r}: overlapped and after the pass differ");
        assert!(averaged, "rank {r}: the gradients are this replica's own, not averaged");
    }
}

/// The layers' `backward_hooked` hand each gradient to the buckets (their `GradHook`) as it
/// completes, here each into a bucket of its own sent at once: the averages come back in each
/// layer's parameters' order, the same bits as handed in layer by layer and as averaged after
/// the pass, and equal the mean of the two replicas' f64 reference gradients (odd widths: the
/// hidden layer of 7 split 4 + 3 over tp).
#[test]
fn hooked_layers_hand_each_gradient_to_the_buckets_as_it_completes() {
    let (tokens, hidden, ffn) = (6, 5, 7);
    let (x, dy) =
        (Tensor::<f64>::random(&[tokens, hidden], 1), Tensor::random(&[tokens, hidden], 2));
    let (w1, b1) = (Tensor::<f64>::random(&[hidden, ffn], 3), Tensor::<f64>::random(&[ffn], 4));
    let (w2, b2) = (Tensor::<f64>::random(&[ffn, hidden], 5), Tensor::<f64>::random(&[hidden], 6));
    let per = tokens / 2;
    let out = World::threads(4)
        .unwrap()
        .run(|rank| {
            let mesh = DeviceMesh::new(rank, &[("dp", 2), ("tp", 2)])?;
            let (tpr, dpr) = (mesh.rank_of("tp")?, mesh.averager("dp")?);
            let mut fc1 = ColumnParallelLinear::from_global(&tpr, &w1, Some(&b1), Split::Even)?;
            let mut fc2 = RowParallelLinear::from_global(&tpr, &w2, Some(&b2), Split::Even)?;
            let share = mesh.coord("dp")? * per..(mesh.coord("dp")? + 1) * per;
            let xs =
                DistTensor::from_global(&tpr, &slice(&x, 0, share.clone()), Placement::Shard(0))?;
            let dys = DistTensor::from_global(&tpr, &slice(&dy, 0, share), Placement::Shard(0))?;
            let mut runs = Vec::new();
            for (hooked, overlap) in [(true, true), (false, true), (true, false)] {
                fc1.zero_grad();
                fc2.zero_grad();
                let (h, s1) = fc1.forward(&xs)?;
                let (_, s2) = fc2.forward(&h.map_local(|t| Activation::Gelu.forward(t))?)?;
                let pre = h.into_local();
                let backward = |buckets: &mut data_parallel::GradBuckets<f64>| {
                    let da = if hooked {
                        fc2.backward_hooked(s2, &dys, buckets)?
                    } else {
                        let da = fc2.backward(s2, &dys)?;
                        buckets.ready_all(&fc2)?;
                        da
                    };
                    let dh = da.try_map_local(|g| Activation::Gelu.backward(&pre, g))?;
                    if hooked {
                        fc1.backward_hooked(s1, &dh, buckets).map(drop)
                    } else {
                        fc1.backward(s1, &dh)?;
                        buckets.ready_all(&fc1)
                    }
                };
                runs.push(if overlap {
                    data_parallel::overlapped(&dpr, size_of::<f64>(), backward)?.1
                } else {
                    let mut local = data_parallel::GradBuckets::collect();
                    backward(&mut local)?;
                    data_parallel::all_reduce_mean(&dpr, 64, &local.into_grads())?
                });
            }
            let same = runs[1..].iter().all(|r| *r == runs[0]);
            // fc2's [W2 rows, b2], then fc1's [W1 columns, b1 part]: the whole averages.
            let g = &runs[0];
            let whole =
                |t: &Tensor<f64>, p| DistTensor::from_local(&tpr, t.clone(), p)?.to_global();
            Ok((
                same,
                [
                    whole(&g[2], Placement::Shard(1))?,
                    whole(&g[3], Placement::Shard(0))?,
                    whole(&g[0], Placement::Shard(0))?,
                    g[1].clone(),
                ],
            ))
        })
        .unwrap();
    let weights = [&w1, &b1, &w2, &b2].map(f64s);
    let replica = |d: usize| {
        let rows = d * per..(d + 1) * per;
        reference::mlp(
            &f64s(&slice(&x, 0, rows.clone())),
            &weights,
            Activation::Gelu,
            &f64s(&slice(&dy, 0, rows)),
        )
    };
    let (r0, r1) = (replica(0), replica(1));
    for (r, (same, got)) in out.into_iter().enumerate() {
        assert!(same, "rank {r}: hooked, by layer and after the pass differ");
        for (i, name) in ["W1", "b1", "W2", "b2"].iter().enumerate() {
            let want = (&r0[i + 2] + &r1[i + 2]) / 2.0;
            let err = rel_err(&f64s(&got[i]), &want);
            assert!(err < 1e-12, "rank {r}: {name} off the mean of the replicas by {err:.1e}");
        }
    }
}

/// A hook's calls that do not make up a layer are typed errors: an index past the layer's
/// count, an index twice, another count mid-layer, and a layer left unfinished at the end of
/// the pass.
#[test]
fn grad_buckets_reject_hook_calls_that_do_not_make_up_a_layer() {
    let g = Tensor::<f64>::random(&[3], 1);
    let mut b = data_parallel::GradBuckets::<f64>::collect();
    let bad = |e: dist_tensor::Result<()>| matches!(e, Err(Error::InvalidArgument { .. }));
    assert!(bad(b.grad_ready(2, 2, &g)), "index past the count");
    b.grad_ready(1, 2, &g).unwrap();
    assert!(bad(b.grad_ready(1, 2, &g)), "index twice");
    assert!(bad(b.grad_ready(0, 3, &g)), "another count");
    b.grad_ready(0, 2, &g).unwrap();
    b.grad_ready(0, 1, &g).unwrap(); // a layer of one: complete at once
    assert_eq!(b.into_grads().len(), 3);
    let unfinished = World::threads(2)
        .unwrap()
        .run(|rank| {
            let mesh = DeviceMesh::new(rank, &[("dp", 2)])?;
            let dp = mesh.averager("dp")?;
            let done =
                data_parallel::overlapped(&dp, 1 << 20, |buckets| buckets.grad_ready(0, 2, &g));
            Ok(matches!(done, Err(Error::InvalidArgument { .. })))
        })
        .unwrap();
    assert_eq!(unfinished, vec![true, true], "a layer left unfinished");
}

#[test]
fn every_op_over_every_group_of_a_2x2_mesh_on_processes() {
    const NAME: &str = "every_op_over_every_group_of_a_2x2_mesh_on_processes";
    if common::jobs::in_rank(|w| Ok(format!("{:?}", w.run(|rank| mesh_ops(rank, 2, 2))?[0]))) {
        return;
    }
    for exit in &common::jobs::run_job(NAME, 4, &[]) {
        let out = exit.stdout_text();
        assert!(exit.success() && out.contains("RESULT []"), "rank {}: {out}", exit.rank);
    }
}

#[test]
fn zero1_equals_adam_on_every_rank_bit_for_bit() {
    let steps = 5;
    for (dp, tp) in [(2, 2), (4, 1), (3, 2)] {
        let world = World::threads(dp * tp).unwrap();
        let adam = train_with(&world, dp, tp, steps, Averaging::ByLayer, Optimizer::Adam);
        let zero = train_with(&world, dp, tp, steps, Averaging::Hooked, Optimizer::Zero1);
        assert_eq!(adam, zero, "mesh {dp}x{tp}");
        assert!(zero[0][steps - 1] < zero[0][0], "it learns: {:?}", zero[0]);
    }
    // And Adam on the mesh is Adam on one rank with the whole batch.
    let one =
        train_with(&World::threads(1).unwrap(), 1, 1, steps, Averaging::After, Optimizer::Adam);
    let mesh =
        train_with(&World::threads(4).unwrap(), 2, 2, steps, Averaging::Hooked, Optimizer::Zero1);
    let diff = mesh[0].iter().zip(&one[0]).fold(0.0f64, |m, (a, b)| m.max((a - b).abs()));
    assert!(diff < 1e-12 * one[0][0], "{:?} vs {:?}", mesh[0], one[0]);
}

/// The placements of a 2-D tensor along one mesh dimension.
const PLACEMENTS: [Placement; 4] =
    [Placement::Replicate, Placement::Partial, Placement::Shard(0), Placement::Shard(1)];

/// The piece of `g` that mesh coordinates `coords` of a mesh of `shape` hold under `placements`
/// (every `Partial` ignored): each `Shard` cuts the previous one's piece as numpy.array_split
/// cuts, in the mesh's order.
fn piece_of(
    g: &ndarray::ArrayD<f64>,
    placements: &[Placement],
    shape: &[usize],
    coords: &[usize],
) -> ndarray::ArrayD<f64> {
    let mut out = g.clone();
    for (d, p) in placements.iter().enumerate() {
        if let Placement::Shard(k) = *p {
            let range = common::pieces(out.shape()[k], shape[d])[coords[d]].clone();
            out = out.slice_axis(ndarray::Axis(k), ndarray::Slice::from(range)).to_owned();
        }
    }
    out
}

/// The addend of the global tensor that the ranks at `coords` hold along the `Partial`
/// dimensions of `placements` (one seeded tensor per combination of their coordinates, rounded
/// to `T`), widened to f64.
fn addend<T: Element>(
    gshape: &[usize],
    placements: &[Placement],
    coords: &[usize],
) -> ndarray::ArrayD<f64> {
    let seed = placements
        .iter()
        .zip(coords)
        .enumerate()
        .filter(|(_, (p, _))| **p == Placement::Partial)
        .fold(17u64, |s, (d, (_, &c))| s + (c as u64 + 1) * 10u64.pow(d as u32 + 1));
    common::f64s(&Tensor::<f64>::random(gshape, seed).cast::<T>())
}

/// On a `dp x tp` mesh in `T`: a tensor made with `from_local` under every pair of placements
/// (the `Partial` ones holding different addends), gathered, and redistributed to `targets(i)`
/// of its pairs; every global tensor and every sharded part against the f64 reference.
fn mesh_tensor_case<T: Element>(
    dp: usize,
    tp: usize,
    gshape: &[usize],
    targets: impl Fn(usize) -> Vec<usize> + Sync,
) -> Vec<String> {
    use dist_tensor::mesh::MeshTensor;
    let shape = [dp, tp];
    let pairs: Vec<[Placement; 2]> =
        PLACEMENTS.iter().flat_map(|&a| PLACEMENTS.iter().map(move |&b| [a, b])).collect();
    let fails = World::threads(dp * tp)
        .unwrap()
        .run(|rank| {
            let mesh = DeviceMesh::new(rank, &[("dp", dp), ("tp", tp)])?;
            let coords = mesh.coords().to_vec();
            let mut fails = Vec::new();
            for (i, from) in pairs.iter().enumerate() {
                // The global tensor: the sum of the addends over every Partial coordinate.
                let mut want = ndarray::ArrayD::<f64>::zeros(gshape);
                let mut terms = 0;
                for c in (0..dp * tp).map(|p| [p / tp, p % tp]) {
                    let first_elsewhere =
                        (0..2).any(|d| from[d] != Placement::Partial && c[d] != 0);
                    if !first_elsewhere {
                        want += &addend::<T>(gshape, from, &c);
                        terms += 1;
                    }
                }
                let mine = piece_of(&addend::<T>(gshape, from, &coords), from, &shape, &coords);
                let local = Tensor::from_array(mine.mapv(T::from_f64));
                let x = MeshTensor::from_local(&mesh, local, from)?;
                let tol = tolerance::<T>(terms) * 4.0;
                let mut check = |what: String, got: &Tensor<T>, want: &ndarray::ArrayD<f64>| {
                    let (got, want) = (common::f64s(got), want.clone());
                    if got.shape() != want.shape() {
                        fails.push(format!(
                            "{what}: shape {:?}, want {:?}",
                            got.shape(),
                            want.shape()
                        ));
                        return;
                    }
                    let scale = vec![(terms as f64) * 4.0; want.len()];
                    let (got, want): (Vec<f64>, Vec<f64>) =
                        (got.iter().copied().collect(), want.iter().copied().collect());
                    fails.extend(off(&what, &got, &want, &scale, tol));
                };
                let at = format!("{dp}x{tp} {} rank {} {from:?}", T::DTYPE, rank.rank());
                if x.global_shape() != gshape {
                    fails.push(format!("{at}: global shape {:?}", x.global_shape()));
                    continue;
                }
                check(format!("{at} to_global"), &x.to_global()?, &want);
                for j in targets(i) {
                    let to = &pairs[j];
                    let y = x.redistribute(to)?;
                    if !to.contains(&Placement::Partial) {
                        check(
                            format!("{at} -> {to:?} local"),
                            y.local(),
                            &piece_of(&want, to, &shape, &coords),
                        );
                    }
                    check(format!("{at} -> {to:?} to_global"), &y.to_global()?, &want);
                }
            }
            Ok(fails)
        })
        .unwrap();
    fails.into_iter().flatten().collect()
}

#[test]
fn mesh_tensors_redistribute_between_placements_on_every_mesh() {
    let start = Instant::now();
    let mut fails = Vec::new();
    for (dp, tp) in MESHES {
        // Every pair to every pair in f64, uneven ([5, 7]) and fewer rows than ranks ([1, 3]).
        fails.extend(mesh_tensor_case::<f64>(dp, tp, &[5, 7], |_| (0..16).collect()));
        fails.extend(mesh_tensor_case::<f64>(dp, tp, &[1, 3], |i| vec![(i * 5 + 3) % 16]));
        // Every pair to three others in the other dtypes.
        let some = |i: usize| (1..4).map(|k| (i + 5 * k) % 16).collect();
        fails.extend(mesh_tensor_case::<f32>(dp, tp, &[5, 7], some));
        fails.extend(mesh_tensor_case::<half::f16>(dp, tp, &[5, 7], some));
        fails.extend(mesh_tensor_case::<bf16>(dp, tp, &[5, 7], some));
    }
    assert!(fails.is_empty(), "{} failures: {:#?}", fails.len(), &fails[..fails.len().min(20)]);
    eprintln!("mesh tensors: {:?}", start.elapsed());
}

/// What `body` gives on every rank of a world of 4 threads, given the rank's place in the
/// `dp 2 x tp 2` mesh.
fn on_2x2_mesh<R: Send>(
    body: impl Fn(&Rank<'_>, &DeviceMesh<'_>) -> dist_tensor::Result<R> + Sync,
) -> dist_tensor::Result<Vec<R>> {
    World::threads(4)
        .unwrap()
        .run(|rank| body(rank, &DeviceMesh::new(rank, &[("dp", 2), ("tp", 2)])?))
}

#[test]
fn mesh_tensor_placements_are_checked() {
    use dist_tensor::mesh::MeshTensor;
    let global = Tensor::<f32>::random(&[3, 4], 1);
    let err = on_2x2_mesh(|_, mesh| {
        MeshTensor::from_global(mesh, &global, &[Placement::Replicate]).map(drop)
    })
    .unwrap_err();
    assert!(err.to_string().contains("1 placements for a mesh of 2"), "{err}");
    let err = on_2x2_mesh(|_, mesh| {
        let x = MeshTensor::from_global(mesh, &global, &[Placement::Replicate; 2])?;
        x.redistribute(&[Placement::Shard(2), Placement::Replicate]).map(drop)
    })
    .unwrap_err();
    assert!(matches!(err.rank_error(), Error::DimOutOfRange { dim: 2, .. }), "{err}");
    // Parts whose sizes disagree outside the sharded dimension: every rank refuses.
    let err = on_2x2_mesh(|rank, mesh| {
        let local = Tensor::<f32>::zeros(&[2, 2 + rank.rank() % 2]);
        MeshTensor::from_local(mesh, local, &[Placement::Shard(0), Placement::Replicate]).map(drop)
    })
    .unwrap_err();
    assert!(matches!(err.rank_error(), Error::RanksDisagree { .. }), "{err}");
}
