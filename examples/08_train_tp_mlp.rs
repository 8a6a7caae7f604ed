//! 08: training a tensor-parallel MLP, forward and backward through the fused ops, checked
//! against the same model trained on one rank.
//!
//! The model is one MLP block, `y = gelu(x @ W1 + b1) @ W2 + b2`, with `W1` split by columns
//! (`ColumnParallelLinear`) and `W2` by rows (`RowParallelLinear`), and the tokens sharded over
//! the ranks (the sequence-parallel arrangement): each step's forward pass is one fused
//! `all_gather_matmul` and one fused `matmul_reduce_scatter`, and its backward pass the same two
//! ops the other way round (the input gradient of each layer through the other layer's op, the
//! weights read transposed in place, the gathered activations kept from the forward pass). Adam
//! steps every rank's own shards. The data are synthetic and seeded: the targets are
//! `tanh(x @ A)` for a fixed random `A`, learned by mean squared error.
//!
//! The same model is also trained on one rank with plain `Tensor` math in f64, with its own
//! Adam; the example prints both loss curves and `ok` if they agree within the element type's
//! tolerance and the loss fell to less than half (it exits with status 1 otherwise).
//!
//! Run: `cargo run --release --example 08_train_tp_mlp [-- --processes 4 | --ranks 4]
//! [--dtype bf16] [--steps 40] [--tokens 130] [--hidden 32] [--ffn 128] [--save DIR]
//! [--resume DIR] [--mesh 2x2]`
//!
//! `--ranks N` runs N ranks as threads (4 by default); `--processes N` runs them as N processes
//! of this program instead; under mpirun or torchrun each process is one rank
//! (`World::from_env`).
//!
//! `--device cuda` trains on GPUs (feature `cuda`): the N ranks dealt over the GPUs present (N
//! ranks share one GPU where there is one), the weights, activations, gradients and Adam's state
//! on the GPUs, the steps GPU kernels; checked against the same one-rank f64 curve on the host.
//!
//! `--mesh DPxTP` trains on a mesh of `DP x TP` ranks (their product the world's size): the MLP
//! tensor-parallel over each `tp` group (inside a node), the tokens split into `DP` equal shares
//! of the batch, one per `dp` coordinate, and the gradients averaged over each `dp` group in
//! buckets while the backward pass goes on (`mesh::data_parallel`). The curve is checked against
//! the same one-rank curve on the whole batch. Not with `--save` or `--resume`.
//!
//! `--save DIR` saves the training state (the model's shards and Adam's, and the step count)
//! into the checkpoint directory `DIR` after the last step. `--resume DIR` loads one (saved by a
//! world of any size) and trains `--steps` more steps from it; the example then also trains the
//! same number of steps in total without a break on this world, and checks the resumed losses
//! against it: bitwise when the saving world had as many ranks, within the element type's
//! tolerance otherwise (and, as always, against the one-rank f64 curve). So
//! `-- --steps 20 --save /tmp/ck` then `-- --steps 20 --resume /tmp/ck --ranks 2` is 40 steps,
//! 20 on 4 ranks and 20 on 2.

#[path = "common/device.rs"]
mod device;

use std::path::PathBuf;

use dist_tensor::checkpoint::{self, Checkpoint, Entry};
use dist_tensor::mesh::{DeviceMesh, data_parallel};
use dist_tensor::nn::{
    Activation, Adam, ColumnParallelLinear, Module, Optimizer, ParallelMlp, RowParallelLinear,
    mse_loss,
};
use dist_tensor::{DistTensor, Element, Error, Placement, Split, Tensor, World};
use half::bf16;

const LR: f64 = 1e-2;

struct Config {
    steps: usize,
    tokens: usize,
    hidden: usize,
    ffn: usize,
    dtype: String,
    save: Option<PathBuf>,
    resume: Option<PathBuf>,
    /// `(dp, tp)` from `--mesh DPxTP`.
    mesh: Option<(usize, usize)>,
}

fn parse(args: Vec<String>) -> Result<Config, String> {
    let mut c = Config {
        steps: 40,
        tokens: 130,
        hidden: 32,
        ffn: 128,
        dtype: "f32".into(),
        save: None,
        resume: None,
        mesh: None,
    };
    let mut it = args.into_iter();
    while let Some(flag) = it.next() {
        let value = it.next().ok_or(format!("{flag} needs a value"))?;
        let number = || value.parse::<usize>().map_err(|_| format!("{flag} {value}: not a number"));
        match flag.as_str() {
            "--steps" => c.steps = number()?,
            "--tokens" => c.tokens = number()?,
            "--hidden" => c.hidden = number()?,
            "--ffn" => c.ffn = number()?,
            "--dtype" if value == "f32" || value == "bf16" => c.dtype = value,
            "--save" => c.save = Some(value.into()),
            "--resume" => c.resume = Some(value.into()),
            "--mesh" => {
                let sizes = value
                    .split_once('x')
                    .and_then(|(a, b)| Some((a.parse().ok()?, b.parse().ok()?)));
                c.mesh = Some(sizes.ok_or(format!("--mesh {value}: not DPxTP (such as 2x2)"))?);
            }
            _ => return Err(format!("unknown argument {flag} {value}; see the file's header")),
        }
    }
    if c.steps == 0 || c.tokens == 0 || c.hidden == 0 || c.ffn == 0 {
        return Err("sizes and steps must be positive".into());
    }
    if let Some((dp, _)) = c.mesh {
        if c.save.is_some() || c.resume.is_some() {
            return Err("--mesh trains from the start, without --save or --resume".into());
        }
        if dp == 0 || !c.tokens.is_multiple_of(dp) {
            return Err(format!("--mesh: {} tokens do not split into {dp} equal shares", c.tokens));
        }
    }
    Ok(c)
}

/// The data and the initial weights, whole: `x`, the targets, and `W1, b1, W2, b2`.
struct Problem {
    x: Tensor<f64>,
    target: Tensor<f64>,
    weights: [Tensor<f64>; 4],
}

impl Problem {
    fn new(c: &Config) -> Self {
        let x = Tensor::<f64>::random(&[c.tokens, c.hidden], 1);
        let scaled = |shape: &[usize], seed: u64, fan_in: usize| {
            Tensor::<f64>::random(shape, seed) * (1.0 / (fan_in as f64).sqrt())
        };
        let mix = scaled(&[c.hidden, c.hidden], 2, c.hidden) * 2.0;
        let target = x.matmul(&mix).expect("shapes fit").map(f64::tanh);
        let weights = [
            scaled(&[c.hidden, c.ffn], 3, c.hidden),
            scaled(&[c.ffn], 4, c.hidden),
            scaled(&[c.ffn, c.hidden], 5, c.ffn),
            scaled(&[c.hidden], 6, c.ffn),
        ];
        Problem { x, target, weights }
    }

    /// The loss before each step, trained on one rank with plain `Tensor` math and Adam in f64.
    fn one_rank_curve(&self, steps: usize) -> Result<Vec<f64>, Error> {
        let (x, act) = (&self.x, Activation::Gelu);
        let mut w = self.weights.clone();
        let mut moments: Vec<(Vec<f64>, Vec<f64>)> =
            w.iter().map(|t| (vec![0.0; t.len()], vec![0.0; t.len()])).collect();
        let n = self.target.len() as f64;
        let mut curve = Vec::new();
        for step in 1..=steps as i32 {
            let h = &x.matmul(&w[0])? + &w[1];
            let a = act.forward(&h);
            let diff = &(&a.matmul(&w[2])? + &w[3]) - &self.target;
            curve.push((&diff * &diff).sum() / n);
            let dy = diff * (2.0 / n);
            let dh = act.backward(&h, &dy.matmul(&w[2].transpose(0, 1)?)?)?;
            let grads = [
                x.transpose(0, 1)?.matmul(&dh)?,
                dh.sum_axis(0)?,
                a.transpose(0, 1)?.matmul(&dy)?,
                dy.sum_axis(0)?,
            ];
            for ((p, g), (m, v)) in w.iter_mut().zip(&grads).zip(&mut moments) {
                for (j, &g) in g.as_slice().iter().enumerate() {
                    m[j] = 0.9 * m[j] + 0.1 * g;
                    v[j] = 0.999 * v[j] + 0.001 * g * g;
                    let (mhat, vhat) =
                        (m[j] / (1.0 - 0.9f64.powi(step)), v[j] / (1.0 - 0.999f64.powi(step)));
                    p.as_mut_slice()[j] -= LR * mhat / (vhat.sqrt() + 1e-8);
                }
            }
        }
        Ok(curve)
    }
}

/// What a run of the tensor-parallel model gives: the loss before each step it took (every
/// rank sees the same), the step it started from, and the number of ranks that saved the
/// checkpoint it resumed (if it did).
struct Run {
    curves: Vec<Vec<f64>>,
    start: usize,
    saved_world: Option<usize>,
}

/// Trains the tensor-parallel model in `T` on `world` for `steps` steps: from the initial
/// weights, or from the checkpoint in `resume`; saves the state into `save` at the end.
fn parallel_run<T: Element>(
    world: &World,
    p: &Problem,
    steps: usize,
    resume: Option<&PathBuf>,
    save: Option<&PathBuf>,
) -> Result<Run, Error> {
    let [w1, b1, w2, b2] = p.weights.each_ref().map(|t| t.cast::<T>());
    let (x, target) = (p.x.cast::<T>(), p.target.cast::<T>());
    let runs = world.run(|rank| {
        // Each rank keeps its columns of W1 and b1, its rows of W2, and all of b2.
        let fc1 = ColumnParallelLinear::from_global(rank, &w1, Some(&b1), Split::Even)?;
        let fc2 = RowParallelLinear::from_global(rank, &w2, Some(&b2), Split::Even)?;
        if rank.rank() == 0 && rank.device() != dist_tensor::Device::Host {
            println!(
                "rank 0 trains on {}: its W1 shard lives on {}",
                rank.device(),
                fc1.weight().value().device()
            );
        }
        let mut mlp = ParallelMlp::from_layers(fc1, Activation::Gelu, fc2);
        let mut adam = Adam::<T>::new(LR);
        let (mut start, mut saved_world) = (0, None);
        if let Some(dir) = resume {
            // Whatever world saved it: each rank reads its own parts of the weights and moments.
            let ck = Checkpoint::open(rank, dir)?;
            mlp.load_state_dict(&ck, "model")?;
            adam.load_state_dict(&ck, &mlp, "optim")?;
            let step = ck.load::<f64>("train.step", Placement::Replicate)?;
            start = step.local().as_slice()[0] as usize;
            saved_world = Some(ck.saved_world());
        }
        // The tokens sharded over the ranks, and their targets alike.
        let xs = DistTensor::from_global(rank, &x, Placement::Shard(0))?;
        let ts = DistTensor::from_global(rank, &target, Placement::Shard(0))?;
        let mut curve = Vec::with_capacity(steps);
        for _ in 0..steps {
            let (y, saved) = mlp.forward(&xs)?;
            let (loss, dy) = mse_loss(&y, &ts)?;
            mlp.zero_grad();
            mlp.backward(saved, &dy)?;
            adam.step(mlp.parameters_mut())?;
            curve.push(loss);
        }
        if let Some(dir) = save {
            let step = Tensor::from(vec![(start + steps) as f64]);
            let step = DistTensor::from_global(rank, &step, Placement::Replicate)?;
            let mut entries = mlp.state_dict("model")?;
            entries.extend(adam.state_dict(&mlp, "optim")?);
            entries.push(Entry::new("train.step", &step)?);
            checkpoint::save(rank, dir, &entries)?;
        }
        Ok((curve, start, saved_world))
    })?;
    let (start, saved_world) = (runs[0].1, runs[0].2);
    Ok(Run { curves: runs.into_iter().map(|r| r.0).collect(), start, saved_world })
}

/// Trains the model in `T` on a `dp x tp` mesh of `world` for `steps` steps: tensor-parallel over
/// each `tp` group, each `dp` coordinate on its share of the tokens, the gradients averaged over
/// `dp` in buckets during the backward pass. Returns every rank's curve of the global batch's
/// loss and the mesh's report on its layout (rank 0's).
fn mesh_run<T: Element>(
    world: &World,
    p: &Problem,
    steps: usize,
    (dp, tp): (usize, usize),
) -> Result<(Run, Option<String>), Error> {
    let [w1, b1, w2, b2] = p.weights.each_ref().map(|t| t.cast::<T>());
    let (x, target) = (p.x.cast::<T>(), p.target.cast::<T>());
    let share = p.x.shape()[0] / dp;
    let runs = world.run(|rank| {
        let mesh = DeviceMesh::new(rank, &[("dp", dp), ("tp", tp)])?;
        let (tpr, dpr) = (mesh.rank_of("tp")?, mesh.averager("dp")?);
        let mut fc1 = ColumnParallelLinear::from_global(&tpr, &w1, Some(&b1), Split::Even)?;
        let mut fc2 = RowParallelLinear::from_global(&tpr, &w2, Some(&b2), Split::Even)?;
        let mut adam = Adam::<T>::new(LR);
        // This dp coordinate's share of the tokens, sharded over its tp group.
        let rows = |t: &Tensor<T>| -> Result<Tensor<T>, Error> {
            let at = mesh.coord("dp")? * share;
            let (all, k) = (t.as_slice(), t.shape()[1]);
            Tensor::from_shape_vec(&[share, k], all[at * k..(at + share) * k].to_vec())
        };
        let xs = DistTensor::from_global(&tpr, &rows(&x)?, Placement::Shard(0))?;
        let ts = DistTensor::from_global(&tpr, &rows(&target)?, Placement::Shard(0))?;
        let mut curve = Vec::with_capacity(steps);
        for _ in 0..steps {
            let (h, s1) = fc1.forward(&xs)?;
            let a = h.map_local(|t| Activation::Gelu.forward(t))?;
            let (y, s2) = fc2.forward(&a)?;
            let (loss, dy) = mse_loss(&y, &ts)?;
            curve.push(dpr.mean(&[loss])?[0]);
            fc1.zero_grad();
            fc2.zero_grad();
            let pre = h.into_local();
            // Each gradient goes to be averaged as soon as it is complete: fc2's while fc1's
            // are computed, fc1's weight while its input gradient is.
            let ((), mean) = data_parallel::overlapped(&dpr, 16 << 10, |buckets| {
                let da = fc2.backward_hooked(s2, &dy, buckets)?;
                let dh = da.try_map_local(|g| Activation::Gelu.backward(&pre, g))?;
                fc1.backward_hooked(s1, &dh, buckets).map(drop)
            })?;
            let mut params = fc2.parameters_mut();
            params.extend(fc1.parameters_mut());
            for (param, grad) in params.iter_mut().zip(mean) {
                param.zero_grad();
                param.accumulate_grad(grad)?;
            }
            adam.step(params)?;
        }
        Ok((curve, mesh.layout_warning().map(str::to_string)))
    })?;
    let warning = runs[0].1.clone();
    Ok((
        Run { curves: runs.into_iter().map(|r| r.0).collect(), start: 0, saved_world: None },
        warning,
    ))
}

fn main() -> Result<(), Error> {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let Some(world) = device::world_from_args(&mut args, 4)? else { return Ok(()) };
    let config = parse(args).unwrap_or_else(|e| {
        eprintln!("{e}");
        std::process::exit(2);
    });
    let lead = world.ranks_here().contains(&0); // rank 0 prints
    let Config { steps, tokens, hidden, ffn, .. } = config;
    let n = world.num_ranks();
    if lead {
        println!(
            "training a tensor-parallel MLP on {n} ranks: x [{tokens}, {hidden}] -> gelu(x @ W1 [{hidden}, {ffn}] + b1) @ W2 [{ffn}, {hidden}] + b2, \
             {}, Adam lr {LR}, {steps} steps",
            config.dtype
        );
    }
    let problem = Problem::new(&config);
    let (resume, save) = (config.resume.as_ref(), config.save.as_ref());
    // Relative to the first loss: f32 rounds each op's result to 24 bits (6e-8), bf16 to 8
    // (2e-3); Adam's updates amplify the differences a little over the steps.
    let (run, tolerance) = match (config.mesh, config.dtype.as_str()) {
        (Some((dp, tp)), dtype) => {
            if dp * tp != n {
                eprintln!("--mesh {dp}x{tp}: {} ranks on a world of {n}", dp * tp);
                std::process::exit(2);
            }
            let (run, warning) = match dtype {
                "bf16" => mesh_run::<bf16>(&world, &problem, steps, (dp, tp))?,
                _ => mesh_run::<f32>(&world, &problem, steps, (dp, tp))?,
            };
            if lead {
                println!(
                    "on a mesh of dp {dp} x tp {tp}: gradients averaged over dp during the backward pass"
                );
                if let Some(warning) = warning {
                    println!("layout: {warning}");
                }
            }
            (run, if dtype == "bf16" { 2e-2 } else { 1e-4 })
        }
        (None, "bf16") => (parallel_run::<bf16>(&world, &problem, steps, resume, save)?, 2e-2),
        (None, _) => (parallel_run::<f32>(&world, &problem, steps, resume, save)?, 1e-4),
    };
    let start = run.start;
    let want = problem.one_rank_curve(start + steps)?;
    // A resumed run: the same number of steps in total without a break, on this world.
    let straight = match (run.saved_world, config.dtype.as_str()) {
        (None, _) => None,
        (Some(_), "bf16") => {
            Some(parallel_run::<bf16>(&world, &problem, start + steps, None, None)?)
        }
        (Some(_), _) => Some(parallel_run::<f32>(&world, &problem, start + steps, None, None)?),
    };
    let mut ok = true;
    for (i, (r, got)) in world.ranks_here().zip(&run.curves).enumerate() {
        let first = want[0]; // the loss before any step: differences are relative to it
        let want = &want[start..];
        let worst = got.iter().zip(want).fold(0.0f64, |m, (g, w)| m.max((g - w).abs())) / first;
        // From the start, the loss falls to less than half; resumed, it must not rise.
        let fell =
            if start == 0 { got[steps - 1] < got[0] / 2.0 } else { got[steps - 1] <= got[0] };
        ok &= worst <= tolerance && fell && got == &run.curves[0];
        let mut versus = String::new();
        if let (Some(straight), Some(saved)) = (&straight, run.saved_world) {
            let line = &straight.curves[i][start..];
            let same_world = saved == n;
            let diff = got.iter().zip(line).fold(0.0f64, |m, (g, s)| m.max((g - s).abs())) / first;
            let matches = if same_world { got == line } else { diff <= tolerance };
            ok &= matches;
            versus = format!(
                "resumed at step {start} from a checkpoint of {saved} ranks; trained straight on \
                 {n} ranks the last loss is {:.6}: {}",
                line[steps - 1],
                match (same_world, matches) {
                    (true, true) => "bitwise the same".to_string(),
                    (false, true) =>
                        format!("{diff:.1e} of the first loss apart (tolerance {tolerance:.0e})"),
                    (_, false) => format!("DIFFERENT ({diff:.1e} of the first loss)"),
                }
            );
        }
        if r == 0 {
            for step in (0..steps).filter(|s| s % 5 == 0 || *s == steps - 1) {
                println!(
                    "step {:3}: loss {:.6}   (one rank, f64: {:.6})",
                    start + step,
                    got[step],
                    want[step]
                );
            }
            println!(
                "largest difference from the one-rank curve: {worst:.1e} of the first loss \
                 (tolerance {tolerance:.0e}); loss {:.4} -> {:.4}{}",
                got[0],
                got[steps - 1],
                if fell { "" } else { ": it did not fall" }
            );
            if !versus.is_empty() {
                println!("{versus}");
            }
            if let Some(dir) = save {
                println!(
                    "saved the training state at step {} into {}",
                    start + steps,
                    dir.display()
                );
            }
        }
    }
    if !ok {
        eprintln!(
            "the tensor-parallel training differs from the one-rank training (or the resumed one \
             from the straight one), or did not learn"
        );
        std::process::exit(1);
    }
    if lead {
        println!("ok");
    }
    Ok(())
}
