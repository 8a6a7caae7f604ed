//! `perf_report --flash-decode`: the sequence-parallel flash-decode (one query per sequence, the
//! KV cache split by sequence over the ranks), fused against its unfused baseline (local
//! attention with its log-sum-exp, `all_gather`, combine), on 1, 2 and 4 ranks, beside the
//! floor: the KV cache's bytes read once at the machine's read bandwidth on all cores (decode
//! attention is bound by them; the ranks share the cores and the memory here).
//! `--quick`: fewer and shorter rows.

use dist_tensor::fused::{flash_decode, flash_decode_unfused};
use dist_tensor::{Element, Result, Tensor, World};
use half::bf16;

use super::machine::{Cpu, Limits};
use super::measure::{Pair, Spread, load, pairs};

/// One row: the world, the batch, and the keys in all (split evenly over the ranks).
struct Row {
    ranks: usize,
    batch: usize,
    keys: usize,
}

const HEADS: usize = 32;
const KV_HEADS: usize = 8;
const D: usize = 128;

fn row<T: Element>(r: &Row, reps: usize, limits: &Limits) -> Result<()> {
    let q = Tensor::<T>::random(&[r.batch, HEADS, D], 1);
    let scale = 1.0 / (D as f64).sqrt();
    let timed = World::threads(r.ranks)?.run(|rank| {
        let mine = dist_tensor::tensor::array_split(r.keys, r.ranks)[rank.rank()];
        let seed = 10 + rank.rank() as u64;
        let k = Tensor::<T>::random(&[r.batch, mine, KV_HEADS, D], seed);
        let v = Tensor::<T>::random(&[r.batch, mine, KV_HEADS, D], seed + 100);
        let fused = || flash_decode(rank, &q, &k, &v, scale).map(drop);
        let unfused = || flash_decode_unfused(rank, &q, &k, &v, scale).map(drop);
        pairs(rank, reps, fused, unfused)
    })?;
    let pairs: &[Pair] = &timed[0];
    let fused = Spread::of(pairs.iter().map(|p| p.fused)).median;
    let unfused = Spread::of(pairs.iter().map(|p| p.unfused)).median;
    let bytes = (2 * r.batch * r.keys * KV_HEADS * D * size_of::<T>()) as f64;
    let floor = bytes / limits.read_bw;
    println!(
        "| {} | {} | {} | {} | {:.3} | {:.3} | {} | {:.3} | {:.2}x |",
        T::DTYPE,
        r.ranks,
        r.batch,
        r.keys,
        fused * 1e3,
        unfused * 1e3,
        Spread::of_ratios(pairs).ratio(),
        floor * 1e3,
        fused / floor
    );
    Ok(())
}

pub fn main(quick: bool) -> Result<()> {
    let limits = Limits::measure();
    println!("CPU: {}; load {}", Cpu::read().describe(), load());
    println!("{}", limits.describe());
    println!(
        "flash_decode: {HEADS} query heads on {KV_HEADS} kv heads, d = {D}; the keys split \
         evenly over the ranks (threads); medians of pairs, fused and unfused in turn\n"
    );
    println!(
        "| dtype | ranks | batch | keys | fused ms | unfused ms | fused / unfused (quartiles) | floor ms | fused / floor |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    let (keys, reps): (&[usize], usize) =
        if quick { (&[1024, 8192], 5) } else { (&[512, 4096, 16384], 11) };
    for &ranks in &[1, 2, 4] {
        for &batch in &[1, 8] {
            for &k in keys {
                let r = Row { ranks, batch, keys: k };
                row::<bf16>(&r, reps, &limits)?;
                if !quick {
                    row::<f32>(&r, reps, &limits)?;
                }
            }
        }
    }
    println!(
        "\nfloor: the KV cache (K and V, every key of every sequence) read once at {:.1} GB/s, \
         this machine's read bandwidth on all cores.",
        limits.read_bw / 1e9
    );
    Ok(())
}
