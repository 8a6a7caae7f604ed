//! 07: a whole transformer block, attention and MLP, distributed two ways and checked against the
//! same block computed on one rank in f64.
//!
//! The block (pre-norm, as in LLaMA and GPT-NeoX), on `x: [B, S, E]`:
//!
//! ```text
//! h = x + Attention(rms_norm(x) * g1)        causal, H heads of D = E / H
//! y = h + gelu(rms_norm(h) * g2 @ W1) @ W2
//! ```
//!
//! Activations are sharded on the sequence, `[B, s_r, E]` (`Shard(1)`), in both variants:
//!
//! - **tensor-parallel** (Megatron with sequence parallelism): Q, K and V come from one
//!   `all_gather_matmul_many` with their weights' columns split in *whole heads*
//!   (`Split::Units(D)`), attention runs on each rank's heads, and the output projection's
//!   `matmul_reduce_scatter` hands back exactly the sequence rows `x` has, so the residual add is
//!   local. The MLP is the same pattern with `W1` split by columns and `W2` by rows.
//! - **Ulysses** (sequence-parallel attention): every rank projects its own rows with the whole
//!   weights, one `all_to_all` trades sequence for heads, attention runs on each rank's heads over
//!   the whole sequence, and a second `all_to_all` trades back. The MLP is tensor-parallel.
//!
//! The sequence is not divisible by the world, and on 3 ranks 8 heads split 3, 3, 2. Both
//! variants run on 4 and 3 ranks in f32 and bf16; each prints its largest difference from the f64
//! result, and the example prints `ok` only if every one is within its type's tolerance (it
//! exits with status 1 otherwise).
//!
//! Run: `cargo run --release --example 07_transformer_block [-- --processes 4]`
//!
//! `--processes N` runs the ranks as N processes of this program instead of threads (and only
//! that world); under mpirun or torchrun each process is one rank (`World::from_env`).
//!
//! `--device cuda [--ranks N]` runs the block on GPUs (feature `cuda`): a world of N ranks (4 by
//! default), dealt over the GPUs present (so N ranks share one GPU where there is one), every
//! tensor of the block on the ranks' GPUs and every op between the fused ones a GPU kernel, and
//! checked against the same f64 host reference.

#[path = "common/device.rs"]
mod device;

use dist_tensor::{DistTensor, Element, Error, Placement, Rank, Split, Tensor, World};
use half::bf16;

const BATCH: usize = 2;
const SEQ: usize = 13; // prime: divides by no world
const HEADS: usize = 8;
const HEAD_DIM: usize = 8;
const EMBED: usize = HEADS * HEAD_DIM;
const FFN: usize = 4 * EMBED;
const EPS: f64 = 1e-5;

/// The block's parameters, whole.
struct Weights<T: Element> {
    wq: Tensor<T>,
    wk: Tensor<T>,
    wv: Tensor<T>,
    wo: Tensor<T>,
    w1: Tensor<T>,
    w2: Tensor<T>,
    g1: Tensor<T>,
    g2: Tensor<T>,
}

impl Weights<f64> {
    /// Seeded random weights, scaled by `1 / sqrt(fan_in)` so activations stay near 1.
    fn random() -> Self {
        let w = |rows: usize, cols: usize, seed: u64| {
            Tensor::<f64>::random(&[rows, cols], seed) * (1.0 / (rows as f64).sqrt())
        };
        let gain = |seed: u64| Tensor::<f64>::random(&[EMBED], seed) * 0.5 + 1.0;
        Weights {
            wq: w(EMBED, EMBED, 1),
            wk: w(EMBED, EMBED, 2),
            wv: w(EMBED, EMBED, 3),
            wo: w(EMBED, EMBED, 4),
            w1: w(EMBED, FFN, 5),
            w2: w(FFN, EMBED, 6),
            g1: gain(7),
            g2: gain(8),
        }
    }

    fn cast<T: Element>(&self) -> Weights<T> {
        Weights {
            wq: self.wq.cast(),
            wk: self.wk.cast(),
            wv: self.wv.cast(),
            wo: self.wo.cast(),
            w1: self.w1.cast(),
            w2: self.w2.cast(),
            g1: self.g1.cast(),
            g2: self.g2.cast(),
        }
    }
}

impl<T: Element> Weights<T> {
    /// A copy of every weight where `rank` computes (its GPU in a GPU world, else the host).
    fn on(&self, rank: &Rank<'_>) -> Result<Weights<T>, Error> {
        let here = |t: &Tensor<T>| {
            Ok::<_, Error>(DistTensor::from_global(rank, t, Placement::Replicate)?.into_local())
        };
        Ok(Weights {
            wq: here(&self.wq)?,
            wk: here(&self.wk)?,
            wv: here(&self.wv)?,
            wo: here(&self.wo)?,
            w1: here(&self.w1)?,
            w2: here(&self.w2)?,
            g1: here(&self.g1)?,
            g2: here(&self.g2)?,
        })
    }
}

/// This rank's shards of the weights for the tensor-parallel products: Q, K, V by columns and
/// the output projection by rows, in whole heads; the MLP's first weight by columns and second
/// by rows.
struct Shards<T: Element> {
    wq: Tensor<T>,
    wk: Tensor<T>,
    wv: Tensor<T>,
    wo: Tensor<T>,
    w1: Tensor<T>,
    w2: Tensor<T>,
}

impl<T: Element> Shards<T> {
    fn of(rank: &Rank<'_>, w: &Weights<T>) -> Result<Self, Error> {
        let heads = Split::Units(HEAD_DIM);
        let cols = |t: &Tensor<T>| DistTensor::from_global_split(rank, t, 1, heads.clone());
        let rows = |t: &Tensor<T>| DistTensor::from_global_split(rank, t, 0, heads.clone());
        Ok(Shards {
            wq: cols(&w.wq)?.into_local(),
            wk: cols(&w.wk)?.into_local(),
            wv: cols(&w.wv)?.into_local(),
            wo: rows(&w.wo)?.into_local(),
            w1: DistTensor::from_global(rank, &w.w1, Placement::Shard(1))?.into_local(),
            w2: DistTensor::from_global(rank, &w.w2, Placement::Shard(0))?.into_local(),
        })
    }
}

/// 0 on and below the diagonal, `-inf` above: token `i` attends to tokens `0..=i`.
fn causal_mask<T: Element>() -> Tensor<T> {
    let mask = ndarray::Array2::from_shape_fn((SEQ, SEQ), |(i, j)| {
        T::from_f64(if j <= i { 0.0 } else { f64::NEG_INFINITY })
    });
    Tensor::from(mask)
}

/// Causal attention of the heads in `q`, `k`, `v`, each `[B, S, h, D]`: the result has their
/// shape. The same function serves every rank's heads and the one-rank reference.
fn attention<T: Element>(
    q: &Tensor<T>,
    k: &Tensor<T>,
    v: &Tensor<T>,
    mask: &Tensor<T>,
) -> Result<Tensor<T>, Error> {
    let q = q.permute(&[0, 2, 1, 3])?; // [B, h, S, D]
    let kt = k.permute(&[0, 2, 3, 1])?; // [B, h, D, S]
    let v = v.permute(&[0, 2, 1, 3])?; // [B, h, S, D]
    let scale = T::from_f64(1.0 / (HEAD_DIM as f64).sqrt());
    let scores = q.matmul(&kt)? * scale + mask; // [B, h, S, S], the mask broadcast
    scores.softmax(3)?.matmul(&v)?.permute(&[0, 2, 1, 3])
}

/// The MLP half of the block, tensor-parallel, with its residual: `h` is `[B, s_r, E]`.
fn mlp<'r, T: Element>(
    h: &DistTensor<'r, T>,
    w: &Weights<T>,
    s: &Shards<T>,
) -> Result<DistTensor<'r, T>, Error> {
    let a = h.try_map_local(|t| t.rms_norm(Some(&w.g2), EPS))?;
    let f = a.all_gather_matmul(&s.w1)?.map_local(|t| t.gelu())?; // [B, S, F / p], Shard(2)
    let m = f.matmul_reduce_scatter(&s.w2)?; // [B, s_r, E]: the rows h has
    h.zip_local(&m, |h, m| h + m)
}

/// The block, tensor-parallel: attention heads split over the ranks. Returns the output and the
/// number of heads each rank attended.
fn tensor_parallel<'r, T: Element>(
    x: &DistTensor<'r, T>,
    w: &Weights<T>,
    s: &Shards<T>,
    mask: &Tensor<T>,
) -> Result<(DistTensor<'r, T>, Vec<usize>), Error> {
    let a = x.try_map_local(|t| t.rms_norm(Some(&w.g1), EPS))?;
    // One gather of the sequence for all three projections: each [B, S, h_r * D], Shard(2).
    let qkv = a.all_gather_matmul_many(&[&s.wq, &s.wk, &s.wv])?;
    let heads = |t: &DistTensor<'r, T>| t.reshape(&[BATCH, SEQ, HEADS, HEAD_DIM]);
    let (q, k, v) = (heads(&qkv[0])?, heads(&qkv[1])?, heads(&qkv[2])?); // h_r whole heads
    let ctx = q.try_map_local(|q| attention(q, k.local(), v.local(), mask))?;
    let o = ctx.reshape(&[BATCH, SEQ, EMBED])?.matmul_reduce_scatter(&s.wo)?; // [B, s_r, E]
    let h = x.zip_local(&o, |x, o| x + o)?;
    Ok((mlp(&h, w, s)?, q.shard_sizes().to_vec()))
}

/// The block, Ulysses: attention sequence-parallel, heads traded for sequence and back. Returns
/// the output and the number of heads each rank attended.
fn ulysses<'r, T: Element>(
    x: &DistTensor<'r, T>,
    w: &Weights<T>,
    s: &Shards<T>,
    mask: &Tensor<T>,
) -> Result<(DistTensor<'r, T>, Vec<usize>), Error> {
    let a = x.try_map_local(|t| t.rms_norm(Some(&w.g1), EPS))?;
    // Each rank projects its own rows with the whole weight: [B, s_r, H, D], then all of the
    // sequence for its heads: [B, S, h_r, D].
    let project = |wp: &Tensor<T>| {
        a.try_map_local(|t| t.matmul(wp))?.reshape(&[BATCH, SEQ, HEADS, HEAD_DIM])?.all_to_all(2, 1)
    };
    let (q, k, v) = (project(&w.wq)?, project(&w.wk)?, project(&w.wv)?);
    let ctx = q.try_map_local(|q| attention(q, k.local(), v.local(), mask))?;
    let ctx = ctx.all_to_all(1, 2)?.reshape(&[BATCH, SEQ, EMBED])?; // [B, s_r, E]
    let o = ctx.try_map_local(|t| t.matmul(&w.wo))?;
    let h = x.zip_local(&o, |x, o| x + o)?;
    Ok((mlp(&h, w, s)?, q.shard_sizes().to_vec()))
}

/// The block on one rank, in f64: the reference.
fn reference(x: &Tensor<f64>, w: &Weights<f64>) -> Result<Tensor<f64>, Error> {
    let mask = causal_mask::<f64>();
    let heads = |t: Tensor<f64>| t.reshape(&[BATCH, SEQ, HEADS, HEAD_DIM]);
    let a = x.rms_norm(Some(&w.g1), EPS)?;
    let (q, k, v) = (heads(a.matmul(&w.wq)?)?, heads(a.matmul(&w.wk)?)?, heads(a.matmul(&w.wv)?)?);
    let ctx = attention(&q, &k, &v, &mask)?.reshape(&[BATCH, SEQ, EMBED])?;
    let h = x + &ctx.matmul(&w.wo)?;
    let f = h.rms_norm(Some(&w.g2), EPS)?.matmul(&w.w1)?.gelu();
    Ok(&h + &f.matmul(&w.w2)?)
}

/// What one run gives: the block's output (widened to f64), and each rank's sequence rows and
/// attention heads (as every rank knows them).
struct Outcome {
    output: Tensor<f64>,
    rows: Vec<usize>,
    heads: Vec<usize>,
    /// Where the first rank computed.
    device: String,
}

/// Runs one variant on `world` in `T`; the outcome is that of this process's first rank.
fn run<T: Element>(
    world: &World,
    x: &Tensor<f64>,
    weights: &Weights<f64>,
    variant: &str,
) -> Result<Outcome, Error> {
    let (x, w, mask) = (x.cast::<T>(), weights.cast::<T>(), causal_mask::<T>());
    let mut outs = world.run(|rank| {
        let shards = Shards::of(rank, &w)?;
        // The whole weights and the mask where this rank computes: its GPU in a GPU world.
        let (w, mask) = (w.on(rank)?, DistTensor::from_global(rank, &mask, Placement::Replicate)?);
        let xs = DistTensor::from_global(rank, &x, Placement::Shard(1))?; // [B, s_r, E]
        let (y, heads) = match variant {
            "tensor-parallel" => tensor_parallel(&xs, &w, &shards, mask.local())?,
            _ => ulysses(&xs, &w, &shards, mask.local())?,
        };
        assert_eq!(y.shard_sizes(), xs.shard_sizes(), "the block keeps the rows");
        let output = y.to_global()?.cast::<f64>().to_host()?;
        let device = rank.device().to_string();
        Ok(Outcome { output, rows: y.shard_sizes().to_vec(), heads, device })
    })?;
    Ok(outs.swap_remove(0))
}

fn main() -> Result<(), Error> {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let gpu = device::cuda_world_from_args(&mut args, 4)?;
    let on_gpu = gpu.is_some();
    let world = match gpu {
        Some(world) => world,
        None => match World::from_args(&mut args, 4)? {
            Some(world) => world,
            None => return Ok(()),
        },
    };
    if !args.is_empty() {
        eprintln!(
            "unknown arguments {args:?}; the flags are --processes N, --device cuda [--ranks N]"
        );
        std::process::exit(2);
    }
    let lead = world.ranks_here().contains(&0); // rank 0 prints
    // Threads: 4 ranks, then 3 (8 heads split 3, 3, 2). Processes, or GPUs: the one world asked
    // for.
    let mut worlds = vec![world];
    if !World::launched() && !on_gpu {
        worlds.push(World::threads(3)?);
    }
    if lead {
        println!(
            "transformer block: x [{BATCH}, {SEQ}, {EMBED}], {HEADS} heads of {HEAD_DIM}, MLP {EMBED} -> {FFN} -> {EMBED}"
        );
    }
    let x = Tensor::<f64>::random(&[BATCH, SEQ, EMBED], 9);
    let weights = Weights::random();
    let want = reference(&x, &weights)?;
    let size = want.as_slice().iter().fold(0.0f64, |m, v| m.max(v.abs()));
    let mut all_ok = true;
    for world in &worlds {
        let n = world.num_ranks();
        for variant in ["tensor-parallel", "Ulysses"] {
            // Relative to the output's largest value. Every op rounds its result to the element
            // type once: f32 to 24 bits (unit roundoff 6e-8), bf16 to 8 bits (2e-3), about a
            // dozen times through the block. A torn head or misaligned row is off by the size of
            // an activation, about 1.
            for (dtype, tolerance) in [("f32", 1e-5), ("bf16", 2e-2)] {
                let Outcome { output, rows, heads, device } = match dtype {
                    "f32" => run::<f32>(world, &x, &weights, variant)?,
                    _ => run::<bf16>(world, &x, &weights, variant)?,
                };
                let worst = (&output - &want).as_slice().iter().fold(0.0f64, |m, d| m.max(d.abs()));
                let ok = worst <= tolerance * size;
                all_ok &= ok;
                if lead {
                    println!(
                        "{n} ranks on {device}, {variant:15} {dtype:4}: rows {rows:?}, heads {heads:?}: \
                         largest difference {:.1e} of {size:.2} (tolerance {tolerance:.0e}){}",
                        worst / size,
                        if ok { "" } else { "  WRONG" }
                    );
                }
            }
        }
    }
    if !all_ok {
        eprintln!("the distributed block differs from the one-rank f64 block");
        std::process::exit(1);
    }
    if lead {
        println!("ok");
    }
    Ok(())
}
