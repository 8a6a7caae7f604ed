//! The one training stack end to end on the GPT: a run stopped, saved and resumed on another
//! world size and mesh (ZeRO-1 and data parallelism's buckets on, gradient accumulation,
//! clipping and a cosine schedule) gives the unbroken run's losses; f16 loss scaling skips an
//! overflowing step on every rank; the replicas of a data-parallel run that forgot to average
//! are caught; bad inputs that used to give silent wrong results are typed errors; a model
//! leaves `World::run`.
//!
//! # Tolerance
//! Resumed on the same mesh the run is the same computation: bitwise. On another world size the
//! sums of the tensor-parallel products and the reductions go in another order: each loss within
//! `2e-5` of the first (a few f32 roundings of 6e-8, grown over a few steps; a lost optimizer
//! state or a wrong step count is off by 1e-3 or more).

use std::path::{Path, PathBuf};

use dist_tensor::autograd::vocab_parallel_cross_entropy;
use dist_tensor::mesh::zero::Zero1;
use dist_tensor::mesh::{DataParallel, DeviceMesh};
use dist_tensor::nn::gpt::{AttentionForm, Gpt, GptConfig};
use dist_tensor::nn::{Adam, LossScaler, Module, Optimizer, WarmupCosine};
use dist_tensor::train::Trainer;
use dist_tensor::{Error, Tensor, World};

const CONFIG: GptConfig =
    GptConfig { vocab: 13, embed: 16, heads: 4, hidden: 24, layers: 2, seq_len: 6 };
/// Sequences per step (the global batch), split over the data-parallel replicas and then into
/// micro-batches.
const BATCH: usize = 4;
const STEPS: usize = 6;
const SCHEDULE: WarmupCosine = WarmupCosine { peak: 1e-2, min: 1e-3, warmup: 2, total: STEPS };

/// Step `step`'s global batch: `BATCH` sequences of ids and next-token targets.
fn batch(step: usize) -> Vec<(Vec<usize>, Vec<Option<usize>>)> {
    (0..BATCH)
        .map(|b| {
            let ids: Vec<usize> =
                (0..CONFIG.seq_len).map(|i| (i * 5 + b * 3 + step * 7) % 13).collect();
            let targets = (0..CONFIG.seq_len).map(|i| Some((ids[i] * 2 + 1) % 13)).collect();
            (ids, targets)
        })
        .collect()
}

/// How a run is laid out: its mesh, ZeRO or plain Adam, micro-batches per step.
#[derive(Clone, Copy, Debug)]
struct Layout {
    dp: usize,
    tp: usize,
    zero: bool,
    accumulate: usize,
}

/// Trains steps `from..to` on `layout` (resuming from `resume` when given, saving into `save`
/// after); rank 0's losses.
fn run(
    layout: Layout,
    from: usize,
    to: usize,
    resume: Option<&Path>,
    save: Option<&Path>,
) -> Vec<f64> {
    let Layout { dp, tp, zero, accumulate } = layout;
    let curves = World::threads(dp * tp)
        .unwrap()
        .run(|rank| {
            let mesh = DeviceMesh::new(rank, &[("dp", dp), ("tp", tp)])?;
            let tpr = mesh.rank_of("tp")?;
            let replica = mesh.coord("dp")?;
            let mut gpt = Gpt::<f32>::new(&tpr, CONFIG, AttentionForm::TensorParallel, 5)?;
            let adam = Adam::new(1e-2).weight_decay(0.01);
            let opt: Box<dyn Optimizer<f32> + '_> = if zero {
                Box::new(Zero1::new(adam, mesh.averager("dp")?))
            } else {
                Box::new(adam)
            };
            let mut trainer = Trainer::new(opt)
                .schedule(SCHEDULE)
                .clip_grad_norm(0.5)
                .accumulate(accumulate)
                .data_parallel(
                    DataParallel::new(mesh.averager("dp")?).bucket_bytes(256).check_every(1),
                );
            if let Some(dir) = resume {
                trainer.resume(&tpr, dir, &mut gpt)?;
                assert_eq!(trainer.steps(), from);
            }
            let mut losses = Vec::new();
            for step in from..to {
                // This replica's share of the batch, in micro-batches.
                let share: Vec<_> =
                    batch(step).into_iter().skip(replica * BATCH / dp).take(BATCH / dp).collect();
                for micro in share.chunks(share.len() / accumulate) {
                    let ids: Vec<usize> = micro.iter().flat_map(|(i, _)| i.clone()).collect();
                    let targets: Vec<Option<usize>> =
                        micro.iter().flat_map(|(_, t)| t.clone()).collect();
                    let loss = vocab_parallel_cross_entropy(&gpt.forward(&tpr, &ids)?, &targets)?;
                    if let Some(report) = trainer.step(&loss, &mut gpt, &tpr)? {
                        assert_eq!(report.step, step);
                        losses.push(report.loss);
                    }
                }
            }
            if let Some(dir) = save {
                trainer.save(&tpr, dir, &gpt)?;
            }
            Ok(losses)
        })
        .unwrap();
    assert!(
        curves.iter().all(|c| c == &curves[0]),
        "every rank reports the same losses: {curves:?}"
    );
    curves[0].clone()
}

fn scratch(name: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("dist-tensor-training-{name}-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    dir
}

#[test]
fn a_run_resumed_on_another_world_and_mesh_gives_the_unbroken_losses() {
    let saved_on = Layout { dp: 2, tp: 2, zero: true, accumulate: 2 };
    let unbroken = run(saved_on, 0, STEPS, None, None);
    assert!(unbroken[STEPS - 1] < unbroken[0], "the run learns: {unbroken:?}");
    let half = STEPS / 2;
    let dir = scratch("resume");
    let first = run(saved_on, 0, half, None, Some(&dir));
    assert_eq!(first[..], unbroken[..half], "the same steps before the break");
    // The same mesh: the same computation, bit for bit.
    let same = run(saved_on, half, STEPS, Some(&dir), None);
    assert_eq!(same[..], unbroken[half..], "resumed on the saving mesh");
    // 3 ranks of tensor parallelism and no data parallelism; 2 replicas of 1 rank with ZeRO; one
    // rank with plain Adam and no accumulation: each reads the state its own way.
    for layout in [
        Layout { dp: 1, tp: 3, zero: false, accumulate: 2 },
        Layout { dp: 2, tp: 1, zero: true, accumulate: 1 },
        Layout { dp: 1, tp: 1, zero: false, accumulate: 4 },
    ] {
        let resumed = run(layout, half, STEPS, Some(&dir), None);
        for (step, (got, want)) in resumed.iter().zip(&unbroken[half..]).enumerate() {
            assert!(
                (got - want).abs() <= 2e-5 * unbroken[0],
                "{layout:?} step {}: {got} vs unbroken {want}",
                half + step
            );
        }
        println!("resumed on {layout:?}: {resumed:?} (unbroken {:?})", &unbroken[half..]);
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn accumulated_micro_batches_step_as_the_whole_batch() {
    let whole = run(Layout { dp: 1, tp: 2, zero: false, accumulate: 1 }, 0, 3, None, None);
    let micro = run(Layout { dp: 1, tp: 2, zero: false, accumulate: 4 }, 0, 3, None, None);
    for (a, b) in whole.iter().zip(&micro) {
        assert!((a - b).abs() <= 2e-5 * whole[0], "{whole:?} vs {micro:?}");
    }
}

/// Trains 4 steps of the f16 GPT with loss scaling; on step `poison` rank 1's loss is
/// multiplied by infinity. Every rank's (stepped flags, scale, skipped count, whether the
/// parameters moved at each step).
fn f16_run(poison: usize) -> Vec<(Vec<bool>, f64, u64, Vec<bool>)> {
    World::threads(2)
        .unwrap()
        .run(|rank| {
            let mut gpt = Gpt::<half::f16>::new(rank, CONFIG, AttentionForm::TensorParallel, 5)?;
            let mut trainer = Trainer::new(Adam::new(1e-2)).loss_scaling(LossScaler::new(1024.0));
            let (mut stepped, mut moved) = (Vec::new(), Vec::new());
            for step in 0..4 {
                let (ids, targets): (Vec<Vec<usize>>, Vec<Vec<Option<usize>>>) =
                    batch(step).into_iter().unzip();
                let (ids, targets) = (ids.concat(), targets.concat());
                let mut loss = vocab_parallel_cross_entropy(&gpt.forward(rank, &ids)?, &targets)?;
                if step == poison && rank.rank() == 1 {
                    loss = loss.map(|l| Ok(l.scale(f64::INFINITY)))?;
                }
                let before: Vec<Tensor<half::f16>> =
                    gpt.parameters().iter().map(|p| p.value().clone()).collect();
                let report = trainer.step(&loss, &mut gpt, rank)?.expect("a step per call");
                stepped.push(!report.skipped);
                moved.push(gpt.parameters().iter().zip(&before).any(|(p, b)| p.value() != b));
            }
            let s = trainer.scaler().unwrap();
            Ok((stepped, s.scale(), s.skipped(), moved))
        })
        .unwrap()
}

#[test]
fn f16_loss_scaling_skips_an_overflowing_step_on_every_rank() {
    let out = f16_run(1);
    for (rank, (stepped, scale, skipped, moved)) in out.iter().enumerate() {
        assert_eq!(stepped, &[true, false, true, true], "rank {rank}");
        assert_eq!(moved, stepped, "rank {rank}: the parameters move exactly on the steps taken");
        assert_eq!((*scale, *skipped), (512.0, 1), "rank {rank}: halved once, one skip counted");
    }
}

/// Rank 0's losses of `steps` steps of the GPT in `T` on 2 ranks (f32 master weights in Adam
/// for the half types).
fn curve<T: dist_tensor::Element>(steps: usize) -> Vec<f64> {
    World::threads(2)
        .unwrap()
        .run(|rank| {
            let mut gpt = Gpt::<T>::new(rank, CONFIG, AttentionForm::TensorParallel, 5)?;
            let mut trainer = Trainer::new(Adam::new(1e-2)).schedule(SCHEDULE).clip_grad_norm(1.0);
            let mut losses = Vec::new();
            for step in 0..steps {
                let (ids, targets): (Vec<Vec<usize>>, Vec<Vec<Option<usize>>>) =
                    batch(step % 2).into_iter().unzip();
                let loss = vocab_parallel_cross_entropy(
                    &gpt.forward(rank, &ids.concat())?,
                    &targets.concat(),
                )?;
                losses.extend(trainer.step(&loss, &mut gpt, rank)?.map(|r| r.loss));
            }
            Ok(losses)
        })
        .unwrap()
        .remove(0)
}

#[test]
fn bf16_training_ends_within_two_percent_of_f32() {
    let (full, half) = (curve::<f32>(STEPS), curve::<half::bf16>(STEPS));
    let (f, h) = (full[STEPS - 1], half[STEPS - 1]);
    println!(
        "after {STEPS} steps: f32 {f:.5}, bf16 {h:.5} ({:.2}% apart)",
        100.0 * (h - f).abs() / f
    );
    assert!(f < full[0] * 0.9, "the f32 run learns: {full:?}");
    assert!((h - f).abs() <= 0.02 * f, "bf16 {half:?} against f32 {full:?}");
}

#[test]
fn an_overflow_on_one_rank_skips_the_step_on_every_rank() {
    let out = World::threads(3)
        .unwrap()
        .run(|rank| {
            let mut gpt = Gpt::<half::f16>::new(rank, CONFIG, AttentionForm::TensorParallel, 5)?;
            let (mut adam, mut scaler) = (Adam::new(1e-2), LossScaler::new(256.0));
            let (ids, targets): (Vec<Vec<usize>>, Vec<Vec<Option<usize>>>) =
                batch(0).into_iter().unzip();
            let loss = vocab_parallel_cross_entropy(
                &gpt.forward(rank, &ids.concat())?,
                &targets.concat(),
            )?;
            scaler.scale_loss(&loss)?.backward()?;
            // Only rank 2's own shard of the head overflows: no other rank can see it in its
            // gradients, only through the scaler's exchange.
            if rank.rank() == 2 {
                let head = &mut gpt.head;
                let mut bad = Tensor::<half::f16>::zeros(head.value().shape());
                bad.as_mut_slice()[0] = half::f16::INFINITY;
                head.accumulate_grad(bad)?;
            }
            let before: Vec<Tensor<half::f16>> =
                gpt.parameters().iter().map(|p| p.value().clone()).collect();
            let stepped = scaler.step(&mut adam, &mut gpt, rank)?;
            let moved = gpt.parameters().iter().zip(&before).any(|(p, b)| p.value() != b);
            Ok((stepped, moved, scaler.skipped(), scaler.scale()))
        })
        .unwrap();
    assert!(out.iter().all(|o| *o == (false, false, 1, 128.0)), "{out:?}");
}

#[test]
fn replicas_that_forgot_to_average_are_caught() {
    let errors = World::threads(2).unwrap().run(|rank| {
        let mesh = DeviceMesh::new(rank, &[("dp", 2), ("tp", 1)])?;
        let tpr = mesh.rank_of("tp")?;
        let mut gpt = Gpt::<f32>::new(&tpr, CONFIG, AttentionForm::TensorParallel, 5)?;
        let mut adam = Adam::new(1e-2);
        let mut dp = DataParallel::new(mesh.averager("dp")?).check_every(3);
        for step in 0..3 {
            // Each replica its own data, and no average: the replicas drift apart.
            let (ids, targets) = batch(step + 10 * rank.rank()).swap_remove(0);
            gpt.zero_grad();
            vocab_parallel_cross_entropy(&gpt.forward(&tpr, &ids)?, &targets)?.backward()?;
            if let Err(e) = dp.step(&mut adam, &mut gpt) {
                return Ok(Some((step, e)));
            }
        }
        Ok(None)
    });
    let errors = errors.unwrap();
    for (rank, e) in errors.iter().enumerate() {
        match e {
            Some((2, Error::RanksDisagree { op: "DataParallel::check_replicas", .. })) => {}
            other => panic!("rank {rank}: {other:?}"),
        }
    }
}

#[test]
fn bad_token_ids_and_head_widths_are_typed_errors() {
    World::threads(2)
        .unwrap()
        .run(|rank| {
            let gpt = Gpt::<f32>::new(rank, CONFIG, AttentionForm::TensorParallel, 5)?;
            let ids = [1, 2, 3, 13, 4, 5];
            match gpt.forward(rank, &ids) {
                Err(Error::InvalidArgument { op: "Embedding::forward", reason, .. }) => {
                    assert!(
                        reason.contains("13") && reason.contains("vocabulary has 13"),
                        "{reason}"
                    );
                }
                other => panic!("id 13 of 13: {:?}", other.map(|_| ())),
            }
            let wide = GptConfig { embed: 66, ..CONFIG }; // 66 does not divide by 4 heads
            match Gpt::<f32>::new(rank, wide, AttentionForm::TensorParallel, 5) {
                Err(Error::InvalidShape { op: "CausalSelfAttention::new", .. }) => {}
                other => panic!("embed 66 over 4 heads: {:?}", other.map(|_| ())),
            }
            Ok(())
        })
        .unwrap();
}

#[test]
fn a_trained_model_leaves_the_world() {
    fn is_send<S: Send>(_: &S) {}
    let models = World::threads(2)
        .unwrap()
        .run(|rank| Gpt::<f32>::new(rank, CONFIG, AttentionForm::TensorParallel, 5))
        .unwrap();
    is_send(&models);
    // Each rank's part, back in a world of the same size: the forward pass runs on it.
    let logits = World::threads(2)
        .unwrap()
        .run(|rank| {
            let gpt = &models[rank.rank()];
            let (ids, _) = batch(0).swap_remove(0);
            Ok(gpt.forward(rank, &ids)?.value().to_global()?.shape().to_vec())
        })
        .unwrap();
    assert_eq!(logits[0], [CONFIG.seq_len, CONFIG.vocab]);
}

#[test]
fn one_parameter_of_the_last_replica_drifting_is_named() {
    let errors = World::threads(3)
        .unwrap()
        .run(|rank| {
            let mesh = DeviceMesh::new(rank, &[("dp", 3), ("tp", 1)])?;
            let tpr = mesh.rank_of("tp")?;
            let mut gpt = Gpt::<f32>::new(&tpr, CONFIG, AttentionForm::TensorParallel, 5)?;
            if mesh.coord("dp")? == 2 {
                // One element of one parameter, on the last replica only.
                let w = gpt.layers[1].norm2.weight.value_mut();
                w.as_mut_slice()[3] += 1e-3;
            }
            let dp = DataParallel::new(mesh.averager("dp")?);
            Ok(dp.check_replicas(&gpt).err())
        })
        .unwrap();
    for (rank, e) in errors.iter().enumerate() {
        match e {
            Some(Error::RanksDisagree { rank_b: 2, value_a, .. }) => {
                assert!(value_a.starts_with("layers.1.norm2.weight"), "rank {rank}: {value_a}")
            }
            other => panic!("rank {rank}: {other:?}"),
        }
    }
}

#[test]
fn the_global_gradient_norm_counts_every_rank_and_replicated_parameters_once() {
    // Rank r's shard has a gradient of norm r + 1 (the largest on the last rank); a replicated
    // parameter has the same gradient of norm 2 on every rank.
    let out = World::threads(3)
        .unwrap()
        .run(|rank| {
            let r = rank.rank() as f64;
            let mut shard = dist_tensor::nn::Param::sharded(Tensor::<f64>::zeros(&[2]), 0);
            shard.accumulate_grad(Tensor::from(vec![(r + 1.0) * 0.6, (r + 1.0) * 0.8]))?;
            let mut replicated = dist_tensor::nn::Param::new(Tensor::<f64>::zeros(&[1]));
            replicated.accumulate_grad(Tensor::from(vec![2.0]))?;
            let model = vec![shard, replicated];
            dist_tensor::nn::grad_norm(&model, rank)
        })
        .unwrap();
    let want = (1.0f64 + 4.0 + 9.0 + 4.0).sqrt();
    for (rank, norm) in out.iter().enumerate() {
        assert!((norm - want).abs() < 1e-12, "rank {rank}: {norm} vs {want}");
    }
}
