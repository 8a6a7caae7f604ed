//! 09: training a small GPT with autograd, tensor- and sequence-parallel, checked against the
//! same model on one rank in f64.
//!
//! The model ([`Gpt`]): token and position embeddings (the token table vocab-parallel), 2
//! pre-norm blocks of causal self-attention (4 heads) and a GELU MLP, a final RMS norm and a
//! vocab-parallel head; the loss is [`vocab_parallel_cross_entropy`], which never gathers the
//! logits. The activations between layers are sharded by tokens. Attention runs in two forms:
//! heads split over the ranks (Q, K, V through `all_gather_matmul`, the output through
//! `matmul_reduce_scatter`), and Ulysses (tokens traded for heads by `all_to_all`). Nothing is
//! differentiated by hand: `loss.backward()` runs every op's dual, the fused ops included.
//!
//! The task needs no download: reverse a sequence. Each example is 6 random digits, a
//! separator, then the 6 digits reversed; the model reads it left to right and is scored on the
//! 6 reversed digits (the first 6 are random: nothing to learn). Guessing gives ln 10 = 2.30;
//! the example trains until the loss is below 0.05 (it has learned to reverse) and fails if it
//! is not by the last step.
//!
//! Before that, the first steps of each form are compared with the same model trained on one
//! rank in f64 (the same weights, data, AdamW, clipping and schedule): the losses must agree to
//! 1e-4 of the first loss in f32.
//!
//! Run: `cargo run --release --example 09_train_gpt [-- --processes 4] [--steps 150]`
//!
//! `--bench N` times N training steps instead (f32, heads split over the ranks, after 3
//! unmeasured ones) and prints their median and fastest: the step that
//! `benches/torch/gpt_step.py` times in PyTorch (docs/results/2026-12-01-gpt-step-vs-torch-zen4.md).

use dist_tensor::autograd::gpt::{AttentionForm, Gpt, GptConfig};
use dist_tensor::autograd::{
    AdamW, Module, WarmupCosine, clip_grad_norm, sync_grads, vocab_parallel_cross_entropy,
};
use dist_tensor::{Element, Error, Rank, World};
use rand::{Rng, SeedableRng, rngs::StdRng};

const DIGITS: usize = 6;
const SEP: usize = 10;
const BATCH: usize = 8;
const COMPARE: usize = 8;
const THRESHOLD: f64 = 0.05;

const CONFIG: GptConfig =
    GptConfig { vocab: 11, embed: 32, heads: 4, hidden: 64, layers: 2, seq_len: 2 * DIGITS };

/// The ids and targets of step `step`'s batch: `BATCH` sequences of `2 DIGITS` tokens read, the
/// next token the target where it is a reversed digit.
fn batch(step: usize) -> (Vec<usize>, Vec<Option<usize>>) {
    let mut rng = StdRng::seed_from_u64(1000 + step as u64);
    let (mut ids, mut targets) = (Vec::new(), Vec::new());
    for _ in 0..BATCH {
        let digits: Vec<usize> = (0..DIGITS).map(|_| rng.random_range(0..10)).collect();
        let mut seq = digits.clone();
        seq.push(SEP);
        seq.extend(digits.iter().rev());
        ids.extend(&seq[..2 * DIGITS]);
        targets.extend((1..=2 * DIGITS).map(|i| (i > DIGITS).then_some(seq[i])));
    }
    (ids, targets)
}

/// The first `steps` steps of a run of `total` (the schedule's length) on this rank; the loss
/// of each.
fn train<'r, T: Element>(
    rank: &'r Rank<'r>,
    form: AttentionForm,
    steps: usize,
    total: usize,
) -> Result<Vec<f64>, Error> {
    let mut model = Gpt::<T>::new(rank, CONFIG, form, 7)?;
    let mut opt = AdamW::new(0.0);
    let schedule = WarmupCosine { peak: 1e-2, min: 1e-3, warmup: 20, total };
    let mut curve = Vec::with_capacity(steps);
    for step in 0..steps {
        let (ids, targets) = batch(step);
        let logits = model.forward(&ids)?;
        let loss = vocab_parallel_cross_entropy(&logits, &targets)?;
        model.zero_grad();
        loss.backward()?;
        sync_grads(&model, rank)?;
        clip_grad_norm(&model, 1.0, rank)?;
        opt.lr = schedule.lr(step);
        opt.step(&mut model)?;
        curve.push(loss.local().value().as_slice()[0].to_f64());
    }
    Ok(curve)
}

/// Times `steps` training steps of the f32 model after 3 unmeasured ones; each step's seconds.
fn time_steps(rank: &Rank<'_>, steps: usize) -> Result<Vec<f64>, Error> {
    let mut model = Gpt::<f32>::new(rank, CONFIG, AttentionForm::TensorParallel, 7)?;
    let mut opt = AdamW::new(1e-3);
    let mut times = Vec::with_capacity(steps);
    for step in 0..steps + 3 {
        let (ids, targets) = batch(step);
        let start = std::time::Instant::now();
        let logits = model.forward(&ids)?;
        let loss = vocab_parallel_cross_entropy(&logits, &targets)?;
        model.zero_grad();
        loss.backward()?;
        sync_grads(&model, rank)?;
        clip_grad_norm(&model, 1.0, rank)?;
        opt.step(&mut model)?;
        if step >= 3 {
            times.push(start.elapsed().as_secs_f64());
        }
    }
    Ok(times)
}

fn bench(world: &World, steps: usize) -> Result<(), Error> {
    let mut times = world.run(|rank| time_steps(rank, steps))?;
    if world.ranks_here().contains(&0) {
        let t = &mut times[0];
        t.sort_by(f64::total_cmp);
        println!(
            "gpt step (09's model, f32, {} ranks, batch {BATCH} x {} tokens): median {:.3} ms, \
             fastest {:.3} ms over {steps} steps",
            world.num_ranks(),
            CONFIG.seq_len,
            t[t.len() / 2] * 1e3,
            t[0] * 1e3
        );
    }
    Ok(())
}

fn main() -> Result<(), Error> {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let Some(world) = World::from_args(&mut args, 4)? else { return Ok(()) };
    if let [flag, n] = args.as_slice()
        && flag == "--bench"
    {
        return bench(&world, n.parse().unwrap_or(30).max(1));
    }
    let steps: usize = match args.as_slice() {
        [] => 150,
        [flag, n] if flag == "--steps" => n.parse().unwrap_or_else(|_| {
            eprintln!("--steps takes a number");
            std::process::exit(2)
        }),
        _ => {
            eprintln!("usage: 09_train_gpt [--processes N] [--steps N | --bench N]");
            std::process::exit(2)
        }
    };
    let lead = world.ranks_here().contains(&0);
    let n = world.num_ranks();
    let want = World::threads(1)?
        .run(|rank| train::<f64>(rank, AttentionForm::TensorParallel, COMPARE, steps))?
        .remove(0);
    let mut ok = true;
    for form in [AttentionForm::TensorParallel, AttentionForm::Ulysses] {
        let curves = world.run(|rank| train::<f32>(rank, form, steps, steps))?;
        let got = &curves[0];
        let worst = got.iter().zip(&want).fold(0.0f64, |m, (g, w)| m.max((g - w).abs())) / want[0];
        let last = got[steps - 1];
        let learned = last < THRESHOLD;
        let same = curves.iter().all(|c| c == got);
        ok &= worst <= 1e-4 && learned && same;
        if lead {
            println!(
                "{form:?} on {n} ranks, f32, {steps} steps (one rank, f64, for the first {COMPARE}):"
            );
            for step in 0..COMPARE {
                println!(
                    "  step {step:3}: loss {:.6}   (one rank, f64: {:.6})",
                    got[step], want[step]
                );
            }
            for step in (COMPARE..steps).filter(|s| s % 50 == 0 || *s == steps - 1) {
                println!("  step {step:3}: loss {:.6}", got[step]);
            }
            println!(
                "  largest difference from f64 over the first {COMPARE} steps: {worst:.1e} of the \
                 first loss (tolerance 1e-4); final loss {last:.4} (threshold {THRESHOLD}){}",
                if learned { "" } else { ": NOT LEARNED" }
            );
        }
    }
    if !ok {
        eprintln!("the parallel training differs from one rank in f64, or did not learn");
        std::process::exit(1);
    }
    if lead {
        println!("ok");
    }
    Ok(())
}
