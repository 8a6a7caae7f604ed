//! `perf_report --moe`: an expert-parallel MoE block (dispatch, each expert's SwiGLU on its
//! rows, combine) three ways: one kernel (`fused::moe_experts`: the products start on the rows
//! that have arrived, read where they landed, their outputs put straight back), the fused
//! dispatch and combine around the grouped products, and the unfused baseline (`all_to_all_v`
//! each way, the reorders, the weighted sum); on 2 and 4 ranks, balanced and skewed routing
//! (one expert given half of the slots). Beside them, the experts alone: the same grouped
//! products on the same rows, no communication, timed in the same run (what the block would
//! cost with its communication free). `--quick`: fewer and smaller rows.

use dist_tensor::fused::{
    Dispatched, moe_combine, moe_combine_unfused, moe_dispatch, moe_dispatch_unfused, moe_experts,
};
use dist_tensor::tensor::{Routed, Router, grouped_matmul, route};
use dist_tensor::{Rank, Result, Tensor, World};

use super::machine::Cpu;
use super::measure::{Pair, Spread, load, pairs, together};

/// One row: world, tokens per rank, experts, top-k, skewed routing.
struct Row {
    ranks: usize,
    tokens: usize,
    experts: usize,
    top_k: usize,
    skewed: bool,
}

const HIDDEN: usize = 1024;
const FFN: usize = 256;

/// This rank's routing: random logits, and where skewed, half of all slots sent to expert 0.
fn routing(r: &Row, rank: usize) -> Result<Routed<f32>> {
    let logits = Tensor::<f32>::random(&[r.tokens, r.experts], 40 + rank as u64);
    let routed = route(&logits, &Router::softmax_top_k(r.top_k))?;
    if !r.skewed {
        return Ok(routed);
    }
    let mut expert = routed.expert.clone();
    let k = r.top_k;
    for t in (0..r.tokens).filter(|t| t % 2 == 0) {
        // Expert 0 into the first slot, the expert it displaces into 0's old slot if it had one.
        let row = &mut expert[t * k..(t + 1) * k];
        let was = row[0];
        if let Some(s) = row.iter().position(|&e| e == 0) {
            row[s] = was;
        }
        row[0] = 0;
    }
    Routed::from_parts(r.experts, expert, routed.weight)
}

/// The experts of this rank on their rows: SwiGLU through two grouped products; their weights
/// stacked too, for the one-kernel op.
struct Experts {
    gate_up: Vec<Tensor<f32>>,
    down: Vec<Tensor<f32>>,
    stacked: (Tensor<f32>, Tensor<f32>),
}

impl Experts {
    fn apply(&self, got: &Dispatched<f32>, threads: usize) -> Result<Tensor<f32>> {
        let gu = grouped_matmul(&got.rows, &got.expert_rows, &refs(&self.gate_up), threads)?;
        let rows = gu.shape()[0];
        let g = gu.as_slice();
        let mut act = Vec::with_capacity(rows * FFN);
        for r in 0..rows {
            let (gate, up) = g[r * 2 * FFN..(r + 1) * 2 * FFN].split_at(FFN);
            act.extend(gate.iter().zip(up).map(|(&a, &b)| a / (1.0 + (-a).exp()) * b));
        }
        let act = Tensor::from_shape_vec(&[rows, FFN], act)?;
        grouped_matmul(&act, &got.expert_rows, &refs(&self.down), threads)
    }
}

fn refs(v: &[Tensor<f32>]) -> Vec<&Tensor<f32>> {
    v.iter().collect()
}

fn block(
    rank: &Rank<'_>,
    x: &Tensor<f32>,
    routed: &Routed<f32>,
    experts: &Experts,
    fused: bool,
) -> Result<()> {
    let threads = rank.topology().aicore_num();
    let got =
        if fused { moe_dispatch(rank, x, routed)? } else { moe_dispatch_unfused(rank, x, routed)? };
    let y = experts.apply(&got, threads)?;
    let _ = if fused {
        moe_combine(rank, &y, &got, &routed.weight)?
    } else {
        moe_combine_unfused(rank, &y, &got, &routed.weight)?
    };
    Ok(())
}

fn row(r: &Row, reps: usize) -> Result<()> {
    let timed = World::threads(r.ranks)?.run(|rank| {
        let me = rank.rank();
        let x = Tensor::<f32>::random(&[r.tokens, HIDDEN], me as u64);
        let routed = routing(r, me)?;
        let local = dist_tensor::tensor::array_split(r.experts, r.ranks)[me];
        let gate_up: Vec<Tensor<f32>> =
            (0..local).map(|e| Tensor::random(&[HIDDEN, 2 * FFN], 100 + e as u64)).collect();
        let down: Vec<Tensor<f32>> =
            (0..local).map(|e| Tensor::random(&[FFN, HIDDEN], 200 + e as u64)).collect();
        let stack = |ts: &[Tensor<f32>], shape: [usize; 2]| {
            let data = ts.iter().flat_map(|t| t.as_slice().to_vec()).collect();
            Tensor::from_shape_vec(&[local, shape[0], shape[1]], data)
        };
        let stacked = (stack(&gate_up, [HIDDEN, 2 * FFN])?, stack(&down, [FFN, HIDDEN])?);
        let experts = Experts { gate_up, down, stacked };
        let one_kernel = || {
            let (gu, d) = (&experts.stacked.0, &experts.stacked.1);
            moe_experts(rank, &x, &routed, gu, d).map(drop)
        };
        let unfused = || block(rank, &x, &routed, &experts, false);
        let timed = pairs(rank, reps, one_kernel, unfused)?;
        let around = pairs(rank, reps, || block(rank, &x, &routed, &experts, true), unfused)?;
        // The experts alone on the same rows, from barrier to barrier.
        let got = moe_dispatch(rank, &x, &routed)?;
        let threads = rank.topology().aicore_num();
        let mut alone = || experts.apply(&got, threads).map(drop);
        let compute: Vec<f64> =
            (0..reps).map(|_| together(rank, &mut alone)).collect::<Result<_>>()?;
        Ok((timed, around, compute, got.rows.shape()[0]))
    })?;
    let (pairs, around, compute, _): &(Vec<Pair>, Vec<Pair>, Vec<f64>, usize) = &timed[0];
    let received: Vec<usize> = timed.iter().map(|t| t.3).collect();
    let one = Spread::of(pairs.iter().map(|p| p.fused)).median;
    let unfused = Spread::of(pairs.iter().chain(around).map(|p| p.unfused)).median;
    let fused_around = Spread::of(around.iter().map(|p| p.fused)).median;
    let alone = Spread::of(compute.iter().copied()).median;
    println!(
        "| {} | {} | {} | {} | {} | {:?} | {:.3} | {:.3} | {:.3} | {} | {} | {:.3} | {:.2}x |",
        r.ranks,
        r.tokens,
        r.experts,
        r.top_k,
        if r.skewed { "skewed" } else { "balanced" },
        received,
        one * 1e3,
        fused_around * 1e3,
        unfused * 1e3,
        Spread::of_ratios(pairs).ratio(),
        Spread::of_ratios(around).ratio(),
        alone * 1e3,
        one / alone
    );
    Ok(())
}

pub fn main(quick: bool) -> Result<()> {
    println!("CPU: {}; load {}", Cpu::read().describe(), load());
    println!(
        "moe block, f32: hidden {HIDDEN}, each expert a SwiGLU of width {FFN}; experts split over \
         the ranks (threads); medians of pairs, fused and unfused in turn\n"
    );
    println!(
        "| ranks | tokens a rank | experts | top-k | routing | rows each rank receives | one kernel ms | fused dispatch + combine ms | unfused ms | one kernel / unfused (quartiles) | fused d + c / unfused (quartiles) | experts alone ms | one kernel / experts alone |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    let (shapes, tokens, reps): (&[(usize, usize)], &[usize], usize) =
        if quick { (&[(8, 2)], &[256], 5) } else { (&[(8, 1), (8, 2), (64, 8)], &[256, 2048], 9) };
    let ranks: &[usize] = if quick { &[2] } else { &[2, 4] };
    for &n in ranks {
        for &t in tokens {
            for &(experts, top_k) in shapes {
                for skewed in [false, true] {
                    row(&Row { ranks: n, tokens: t, experts, top_k, skewed }, reps)?;
                }
            }
        }
    }
    println!(
        "\nexperts alone: this rank's grouped SwiGLU on the rows it received, no dispatch or \
         combine (rank 0's median). A skewed row gives expert 0 (on rank 0) half of all slots."
    );
    Ok(())
}
