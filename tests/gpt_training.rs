//! Training curves of the GPT at worlds 1, 2, 3, 4 and 8 (more ranks than heads: some
//! hold none), tensor-parallel and Ulysses, in f32 and bf16, against the same model on one rank
//! in f64; and the model's parameter names.

use dist_tensor::autograd::vocab_parallel_cross_entropy;
use dist_tensor::nn::gpt::{AttentionForm, Gpt, GptConfig};
use dist_tensor::nn::{Adam, LrSchedule, Module, WarmupCosine, clip_grad_norm, sync_grads};
use dist_tensor::{Element, Rank, Result, World};

const CONFIG: GptConfig =
    GptConfig { vocab: 13, embed: 16, heads: 4, hidden: 24, layers: 2, seq_len: 5 };
const STEPS: usize = 5;

/// Two sequences of 5 tokens (10 rows: uneven over 3, 4 and 8 ranks), every target
/// counted but the first of each sequence.
fn batch(step: usize) -> (Vec<usize>, Vec<Option<usize>>) {
    let ids: Vec<usize> = (0..10).map(|i| (i * 7 + step * 3) % 13).collect();
    let targets = (0..10).map(|i| (i % 5 != 0).then_some((i * 5 + step) % 13)).collect();
    (ids, targets)
}

fn train<'r, T: Element>(rank: &'r Rank<'r>, form: AttentionForm) -> Result<Vec<f64>> {
    let mut model = Gpt::<T>::new(rank, CONFIG, form, 3)?;
    let mut opt = Adam::new(0.0);
    let schedule = WarmupCosine { peak: 1e-2, min: 1e-3, warmup: 2, total: STEPS };
    let mut curve = Vec::new();
    for step in 0..STEPS {
        let (ids, targets) = batch(0); // one batch, learned by heart
        let loss = vocab_parallel_cross_entropy(&model.forward(rank, &ids)?, &targets)?;
        model.zero_grad();
        loss.backward()?;
        sync_grads(&model, rank)?;
        clip_grad_norm(&model, 0.5, rank)?;
        opt.set_lr(schedule.lr(step));
        opt.step(model.parameters_mut())?;
        curve.push(loss.local().value().as_slice()[0].to_f64());
    }
    Ok(curve)
}

#[test]
fn curves_match_one_rank_f64_at_every_world_in_both_forms() {
    let want = World::threads(1)
        .unwrap()
        .run(|rank| train::<f64>(rank, AttentionForm::TensorParallel))
        .unwrap()
        .remove(0);
    assert!(want[STEPS - 1] < want[0], "the reference learns: {want:?}");
    for world in [1, 2, 3, 4, 8] {
        for form in [AttentionForm::TensorParallel, AttentionForm::Ulysses] {
            let w = World::threads(world).unwrap();
            let f32s = w.run(|rank| train::<f32>(rank, form)).unwrap();
            let bf16s = w.run(|rank| train::<half::bf16>(rank, form)).unwrap();
            for (curves, tol) in [(&f32s, 1e-5), (&bf16s, 3e-2)] {
                assert!(curves.iter().all(|c| c == &curves[0]), "ranks agree on the loss");
                let worst =
                    curves[0].iter().zip(&want).fold(0.0f64, |m, (g, w)| m.max((g - w).abs()));
                assert!(
                    worst / want[0] < tol,
                    "world {world} {form:?}: {:?} vs {want:?}",
                    curves[0]
                );
            }
        }
    }
}

#[test]
fn parameters_are_named_by_dotted_paths() {
    let names = World::threads(2)
        .unwrap()
        .run(|rank| {
            let model = Gpt::<f32>::new(rank, CONFIG, AttentionForm::TensorParallel, 1)?;
            Ok(model.named_parameters().into_iter().map(|(n, _)| n).collect::<Vec<_>>())
        })
        .unwrap();
    let names = &names[0];
    assert_eq!(names.len(), 2 + 2 * 8 + 2);
    for want in [
        "embed.weight",
        "pos",
        "layers.0.attn.q.weight",
        "layers.1.mlp.fc2.weight",
        "norm.weight",
        "head.weight",
    ] {
        assert!(names.iter().any(|n| n == want), "{want} in {names:?}");
    }
}
