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
//! Run: `cargo run --release --example 08_train_tp_mlp [-- --processes 4] [--dtype bf16]
//! [--steps 40] [--tokens 130] [--hidden 32] [--ffn 128]`
//!
//! `--processes N` runs the ranks as N processes of this program instead of 4 threads; under
//! mpirun or torchrun each process is one rank (`World::from_env`).

use dist_tensor::nn::{
    Activation, Adam, ColumnParallelLinear, ParallelMlp, Parameters, RowParallelLinear, mse_loss,
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
}

fn parse(args: Vec<String>) -> Result<Config, String> {
    let mut c = Config { steps: 40, tokens: 130, hidden: 32, ffn: 128, dtype: "f32".into() };
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
            _ => return Err(format!("unknown argument {flag} {value}; see the file's header")),
        }
    }
    if c.steps == 0 || c.tokens == 0 || c.hidden == 0 || c.ffn == 0 {
        return Err("sizes and steps must be positive".into());
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

/// The loss before each step of the tensor-parallel model in `T` on `world` (this process's
/// ranks' curves; every rank sees the same one).
fn parallel_curve<T: Element>(
    world: &World,
    p: &Problem,
    steps: usize,
) -> Result<Vec<Vec<f64>>, Error> {
    let [w1, b1, w2, b2] = p.weights.each_ref().map(|t| t.cast::<T>());
    let (x, target) = (p.x.cast::<T>(), p.target.cast::<T>());
    world.run(|rank| {
        // Each rank keeps its columns of W1 and b1, its rows of W2, and all of b2.
        let fc1 = ColumnParallelLinear::from_global(rank, &w1, Some(&b1), Split::Even)?;
        let fc2 = RowParallelLinear::from_global(rank, &w2, Some(&b2), Split::Even)?;
        let mut mlp = ParallelMlp::from_layers(fc1, Activation::Gelu, fc2);
        let mut adam = Adam::<T>::new(LR);
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
        Ok(curve)
    })
}

fn main() -> Result<(), Error> {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let Some(world) = World::from_args(&mut args, 4)? else { return Ok(()) };
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
    let want = problem.one_rank_curve(steps)?;
    // Relative to the first loss: f32 rounds each op's result to 24 bits (6e-8), bf16 to 8
    // (2e-3); Adam's updates amplify the differences a little over the steps.
    let (curves, tolerance) = match config.dtype.as_str() {
        "bf16" => (parallel_curve::<bf16>(&world, &problem, steps)?, 2e-2),
        _ => (parallel_curve::<f32>(&world, &problem, steps)?, 1e-4),
    };
    let mut ok = true;
    for (r, got) in world.ranks_here().zip(&curves) {
        let worst = got.iter().zip(&want).fold(0.0f64, |m, (g, w)| m.max((g - w).abs())) / want[0];
        let fell = got[steps - 1] < got[0] / 2.0;
        ok &= worst <= tolerance && fell && got == &curves[0];
        if r == 0 {
            for step in (0..steps).filter(|s| s % 5 == 0 || *s == steps - 1) {
                println!(
                    "step {step:3}: loss {:.6}   (one rank, f64: {:.6})",
                    got[step], want[step]
                );
            }
            println!(
                "largest difference from the one-rank curve: {worst:.1e} of the first loss \
                 (tolerance {tolerance:.0e}); loss {:.4} -> {:.4}{}",
                got[0],
                got[steps - 1],
                if fell { "" } else { ": it did not fall to half" }
            );
        }
    }
    if !ok {
        eprintln!(
            "the tensor-parallel training differs from the one-rank training, or did not learn"
        );
        std::process::exit(1);
    }
    if lead {
        println!("ok");
    }
    Ok(())
}
