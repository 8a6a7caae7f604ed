//! 11: training a small mixture-of-experts transformer with expert parallelism.
//!
//! The model: a vocab-parallel embedding and positions, 2 blocks of (RMSNorm, causal
//! self-attention with its heads split over the ranks, RMSNorm, an expert-parallel
//! [`MoeLayer`]: 8 SwiGLU experts, top-2, each rank holding whole experts), a final norm and a
//! vocab-parallel head. The tokens are sharded over the ranks between the blocks, so each rank
//! routes its own tokens and the fused dispatch and combine move them to the experts and back.
//! The task is 09's: read 6 digits, then write them reversed; the loss is the cross-entropy of
//! the reversed digits plus 0.01 times the load-balancing loss.
//!
//! Run: `cargo run --release --example 11_moe -- [--ranks N | --processes N] [--steps N]
//! [--capacity F] [--unfused]`
//! - `--ranks N` threads (4 by default) or `--processes N`, `--steps N` (200), `--capacity F` a
//!   capacity factor
//!   (dropless by default; 1.0 drops what overflows an even split), `--unfused` the
//!   `all_to_all_v` baselines in place of the fused dispatch and combine.
//!
//! Prints every 20 steps the loss, the tokens each expert took (over every rank) and the slots
//! dropped, then the first and last losses. The run fails unless the loss falls below half of
//! the first.

use dist_tensor::autograd::{DVar, vocab_parallel_cross_entropy};
use dist_tensor::collectives::all_reduce;
use dist_tensor::nn::gpt::{AttentionForm, CausalSelfAttention, Embedding, RmsNorm};
use dist_tensor::nn::{Adam, Module, MoeLayer, Param};
use dist_tensor::tensor::Router;
use dist_tensor::train::Trainer;
use dist_tensor::{Error, Placement, Rank, Result, Tensor};
use rand::{Rng, SeedableRng, rngs::StdRng};

#[path = "common/device.rs"]
mod device;

const DIGITS: usize = 6;
const SEP: usize = 10;
const VOCAB: usize = 11;
const SEQ: usize = 2 * DIGITS;
const BATCH: usize = 8;
const EMBED: usize = 32;
const HEADS: usize = 4;
const EXPERTS: usize = 8;
const FFN: usize = 32;
const AUX: f64 = 0.01;

struct Options {
    steps: usize,
    capacity: Option<f64>,
    fused: bool,
}

/// One block: attention and an MoE layer, each after a norm, each added back.
struct Block {
    norm1: RmsNorm<f32>,
    attn: CausalSelfAttention<f32>,
    norm2: RmsNorm<f32>,
    moe: MoeLayer<f32>,
}
dist_tensor::impl_module!(Block: f32 { norm1, attn, norm2, moe });

struct Model {
    embed: Embedding<f32>,
    pos: Param<f32>,
    blocks: Vec<Block>,
    norm: RmsNorm<f32>,
    head: Param<f32>,
}
dist_tensor::impl_module!(Model: f32 { embed, pos, blocks, norm, head });

fn init(rows: usize, cols: usize, seed: u64) -> Tensor<f32> {
    (Tensor::<f64>::random(&[rows, cols], seed) * (1.0 / (rows as f64).sqrt())).cast()
}

/// This rank's columns `[rows, cols_r]` of a `[rows, cols]` tensor (array_split).
fn my_columns(rank: &Rank<'_>, t: &Tensor<f32>) -> Result<Tensor<f32>> {
    let sizes = dist_tensor::tensor::array_split(t.shape()[1], rank.num_ranks());
    let start: usize = sizes[..rank.rank()].iter().sum();
    let cols: Vec<usize> = (start..start + sizes[rank.rank()]).collect();
    t.index_select(1, &cols)
}

impl Model {
    fn new(rank: &Rank<'_>, o: &Options) -> Result<Model> {
        let router = Router { capacity_factor: o.capacity, ..Router::softmax_top_k(2) };
        let blocks = (0..2u64)
            .map(|l| {
                let s = 10 * (l + 1);
                let w = [0, 1, 2, 3].map(|i| init(EMBED, EMBED, s + i));
                let attn = CausalSelfAttention::new(
                    rank,
                    AttentionForm::TensorParallel,
                    HEADS,
                    SEQ,
                    [&w[0], &w[1], &w[2], &w[3]],
                )?;
                let moe = MoeLayer::new(rank, EMBED, FFN, EXPERTS, router, s + 5)?.fused(o.fused);
                Ok(Block { norm1: RmsNorm::new(EMBED), attn, norm2: RmsNorm::new(EMBED), moe })
            })
            .collect::<Result<_>>()?;
        let table = (Tensor::<f64>::random(&[VOCAB, EMBED], 1) * 0.5).cast();
        Ok(Model {
            embed: Embedding::new(rank, &table)?,
            pos: Param::new((Tensor::<f64>::random(&[SEQ, EMBED], 2) * 0.5).cast()),
            blocks,
            norm: RmsNorm::new(EMBED),
            head: Param::sharded(my_columns(rank, &init(EMBED, VOCAB, 3))?, 1),
        })
    }

    /// The loss of a batch (cross-entropy plus the weighted load-balancing losses, the same on
    /// every rank), and each block's per-expert loads and dropped slots on this rank.
    fn loss<'r>(
        &self,
        rank: &'r Rank<'r>,
        ids: &[usize],
        targets: &[Option<usize>],
    ) -> Result<(DVar<'r, f32>, Vec<f64>, usize)> {
        let mut x = self.embed.forward(rank, ids)?;
        let first: usize = x.value().shard_sizes()[..rank.rank()].iter().sum();
        let rows: Vec<Option<usize>> =
            (first..first + x.local().shape()[0]).map(|i| Some(i % SEQ)).collect();
        let pos = self.pos.var().gather_rows(&rows)?;
        x = x.map(|x| Ok(x + &pos))?;
        let (mut load, mut dropped) = (vec![0.0; EXPERTS], 0);
        let mut aux = None;
        for b in &self.blocks {
            let a = b.attn.forward(&b.norm1.forward(&x)?)?;
            x = x.zip(&a, |x, a| Ok(x + a))?;
            let m = b.moe.forward(rank, &b.norm2.forward(&x)?)?;
            x = x.zip(&m.out, |x, m| Ok(x + m))?;
            load.iter_mut().zip(&m.load).for_each(|(l, &n)| *l += n as f64);
            dropped += m.dropped;
            aux = Some(match aux {
                None => m.aux_loss,
                Some(sum) => &sum + &m.aux_loss,
            });
        }
        let logits = self.norm.forward(&x)?.all_gather_matmul(&self.head.var())?;
        let ce = vocab_parallel_cross_entropy(&logits, targets)?;
        // Each rank's balancing loss is over its own tokens: their mean over the ranks.
        let aux = aux.expect("two blocks").scale(AUX / rank.num_ranks() as f64);
        let aux =
            DVar::from_var(rank, &aux, Placement::Partial)?.redistribute(Placement::Replicate)?;
        Ok((ce.zip(&aux, |c, a| Ok(c + a))?, load, dropped))
    }
}

/// Step `step`'s batch: digits, the separator, the digits reversed; the targets the reversed
/// digits.
fn batch(step: usize) -> (Vec<usize>, Vec<Option<usize>>) {
    let mut rng = StdRng::seed_from_u64(1000 + step as u64);
    let (mut ids, mut targets) = (Vec::new(), Vec::new());
    for _ in 0..BATCH {
        let digits: Vec<usize> = (0..DIGITS).map(|_| rng.random_range(0..10)).collect();
        let mut seq = digits.clone();
        seq.push(SEP);
        seq.extend(digits.iter().rev());
        ids.extend_from_slice(&seq[..SEQ]);
        targets.extend((1..=SEQ).map(|i| (i > DIGITS).then_some(seq[i])));
    }
    (ids, targets)
}

fn train(rank: &Rank<'_>, o: &Options) -> Result<Vec<f64>> {
    let mut model = Model::new(rank, o)?;
    if rank.rank() == 0 {
        let names: Vec<String> = model.named_parameters().into_iter().map(|(n, _)| n).collect();
        let experts: Vec<&String> = names.iter().filter(|n| n.contains("experts")).collect();
        println!(
            "{} parameters on rank 0 ({} of them its experts' stacks, experts {:?} of each layer)",
            names.len(),
            experts.len(),
            model.blocks[0].moe.local_experts()
        );
    }
    let mut trainer = Trainer::new(Adam::new(1e-2)).clip_grad_norm(1.0);
    let mut curve = Vec::new();
    for step in 0..o.steps {
        let (ids, targets) = batch(step);
        let (loss, load, dropped) = model.loss(rank, &ids, &targets)?;
        let report = trainer.step(&loss, &mut model, rank)?.expect("no accumulation");
        curve.push(report.loss);
        if step % 20 == 0 || step + 1 == o.steps {
            // Loads and drops over every rank (per layer summed over the two layers).
            let mut words = load;
            words.push(dropped as f64);
            let all = all_reduce(rank, &words)?;
            if rank.rank() == 0 {
                let load: Vec<String> = all[..EXPERTS].iter().map(|v| format!("{v:.0}")).collect();
                println!(
                    "step {step:4}  loss {:.4}  tokens per expert [{}]  dropped {}",
                    report.loss,
                    load.join(" "),
                    all[EXPERTS]
                );
            }
        }
    }
    Ok(curve)
}

fn parse(args: Vec<String>) -> std::result::Result<Options, String> {
    let mut o = Options { steps: 200, capacity: None, fused: true };
    let mut args = args.into_iter();
    while let Some(a) = args.next() {
        let mut value = || args.next().ok_or(format!("{a} takes a value"));
        match a.as_str() {
            "--steps" => o.steps = value()?.parse().map_err(|e| format!("--steps: {e}"))?,
            "--capacity" => {
                o.capacity = Some(value()?.parse().map_err(|e| format!("--capacity: {e}"))?)
            }
            "--unfused" => o.fused = false,
            other => return Err(format!("unknown argument {other}")),
        }
    }
    Ok(o)
}

fn main() -> Result<()> {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let Some(world) = device::world_from_args(&mut args, 4)? else { return Ok(()) };
    let o = parse(args).unwrap_or_else(|e| {
        eprintln!(
            "{e}\nusage: 11_moe [--ranks N | --processes N] [--steps N] [--capacity F] [--unfused]"
        );
        std::process::exit(2)
    });
    let lead = world.ranks_here().contains(&0);
    if lead {
        println!(
            "MoE transformer: {EXPERTS} experts (top-2, {}) on {} ranks, {} dispatch and combine",
            o.capacity.map_or("dropless".to_string(), |f| format!("capacity factor {f}")),
            world.num_ranks(),
            if o.fused { "fused" } else { "unfused" }
        );
    }
    let curves = world.run(|rank| train(rank, &o))?;
    let curve = &curves[0];
    if curves.iter().any(|c| c != curve) {
        return Err(Error::InvalidArgument {
            op: "11_moe",
            rank: 0,
            reason: "the ranks' loss curves differ".into(),
        });
    }
    let (first, last) = (curve[0], curve[curve.len() - 1]);
    if lead {
        println!("loss {first:.4} -> {last:.4} in {} steps", curve.len());
    }
    // A NaN loss fails too: it is not below anything.
    if last.is_nan() || last >= first / 2.0 {
        return Err(Error::InvalidArgument {
            op: "11_moe",
            rank: 0,
            reason: format!("the loss did not halve ({first:.4} -> {last:.4})"),
        });
    }
    Ok(())
}
