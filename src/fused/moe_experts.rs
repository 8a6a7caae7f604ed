//! An expert-parallel MoE MLP in one kernel: dispatch, each expert's SwiGLU, combine.
//!
//! Fused (`moe_experts`): one launch on each rank (see `device::host::moe_experts`): the rows
//! are put into their experts' ranks, each (expert, source) block's SwiGLU starts as soon as
//! that source's rows have arrived, reading them where they landed, its output rows are put
//! straight back into the source's buffer, and each source sums its tokens' rows with their
//! gate weights once every owner is done. Unfused (`moe_experts_unfused`), as a user writes it
//! with this library: [`moe_dispatch_unfused`](super::moe_dispatch_unfused), the experts'
//! products ([`grouped_matmul`]), [`moe_combine_unfused`](super::moe_combine_unfused).

use super::moe_combine::combine_with;
use super::moe_dispatch::{agree, rows_with};
use crate::Result;
use crate::device::host::moe_dispatch::MoePlan;
use crate::device::host::moe_experts::swiglu_unit;
use crate::device::{DeviceWorld, host};
use crate::shmem::Rank;
use crate::tensor::{Element, Routed, Tensor, array_split, grouped_matmul};

const OP: &str = "moe_experts";
const UNFUSED_OP: &str = "moe_experts_unfused";

/// The MoE MLP of this rank's tokens `x` (`[tokens, hidden]`), routed by `routed`, with this
/// rank's experts' weights `gate_up` (`[local experts, hidden, 2 ffn]`: each expert's gate
/// columns, then its up columns) and `down` (`[local experts, ffn, hidden]`); experts split
/// over the ranks as `numpy.array_split` splits them. Each expert computes
/// `(silu(x w_gate) * (x w_up)) w_down` (each product accumulated in the accumulator type and
/// rounded to `T`; the activation in the accumulator type, its silu and product rounded to
/// `T`), and each token gets
/// the sum of its experts' outputs times its gate weights: `[tokens, hidden]`. Collective.
/// It consults the capability table's `moe_dispatch` row.
///
/// # Errors
/// On every rank: as [`moe_dispatch`](super::moe_dispatch), and [`crate::Error::InvalidArgument`]
/// naming the rank whose weights are not of its experts' shapes.
///
/// # Examples
/// ```
/// use dist_tensor::fused::{moe_experts, moe_experts_unfused};
/// use dist_tensor::tensor::{route, Router, Tensor};
/// use dist_tensor::World;
/// World::threads(2)?.run(|rank| {
///     // 4 experts (2 a rank) of width 6 on 8 features, top-2.
///     let x = Tensor::<f64>::random(&[5, 8], rank.rank() as u64);
///     let routed = route(&Tensor::<f64>::random(&[5, 4], 9), &Router::softmax_top_k(2))?;
///     let gate_up = Tensor::<f64>::random(&[2, 8, 12], 20 + rank.rank() as u64);
///     let down = Tensor::<f64>::random(&[2, 6, 8], 30 + rank.rank() as u64);
///     let a = moe_experts(rank, &x, &routed, &gate_up, &down)?;
///     let b = moe_experts_unfused(rank, &x, &routed, &gate_up, &down)?;
///     assert!(a.as_slice().iter().zip(b.as_slice()).all(|(p, q)| (p - q).abs() < 1e-12));
///     Ok(())
/// })?;
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn moe_experts<T: Element>(
    rank: &Rank<'_>,
    x: &Tensor<T>,
    routed: &Routed<T>,
    gate_up: &Tensor<T>,
    down: &Tensor<T>,
) -> Result<Tensor<T>> {
    run(rank, x, routed, (gate_up, down), true)
}

/// The unfused baseline of [`moe_experts`]: dispatch, the experts' products, combine, each
/// its own collective or local op.
///
/// # Errors
/// As [`moe_experts`].
pub fn moe_experts_unfused<T: Element>(
    rank: &Rank<'_>,
    x: &Tensor<T>,
    routed: &Routed<T>,
    gate_up: &Tensor<T>,
    down: &Tensor<T>,
) -> Result<Tensor<T>> {
    run(rank, x, routed, (gate_up, down), false)
}

/// What is wrong with this rank's expert weights, if anything.
fn weights_problem<T: Element>(
    rank: &Rank<'_>,
    routed: &Routed<T>,
    hidden: usize,
    (gate_up, down): (&Tensor<T>, &Tensor<T>),
) -> Option<String> {
    let local = array_split(routed.experts, rank.num_ranks())[rank.rank()];
    let (g, d) = (gate_up.shape(), down.shape());
    let ffn = d.get(1).copied().unwrap_or(0);
    let fits = g == [local, hidden, 2 * ffn] && d == [local, ffn, hidden];
    let on_host = gate_up.is_on_host() && down.is_on_host();
    (!fits || !on_host).then(|| {
        format!(
            "expert weights gate_up {g:?} and down {d:?} (on the host) for {local} experts of \
             {hidden} features: [{local}, {hidden}, 2 ffn] and [{local}, ffn, {hidden}]"
        )
    })
}

fn run<T: Element>(
    rank: &Rank<'_>,
    x: &Tensor<T>,
    routed: &Routed<T>,
    weights: (&Tensor<T>, &Tensor<T>),
    fused: bool,
) -> Result<Tensor<T>> {
    let op = if fused { OP } else { UNFUSED_OP };
    let hidden = x.shape().get(1).copied().unwrap_or(0);
    let plan = agree(op, rank, x, routed, || weights_problem(rank, routed, hidden, weights))?;
    if fused && matches!(rank.device_world(), DeviceWorld::Host) {
        return host::moe_experts::moe_experts(rank, &plan, x, &routed.weight, weights)
            .inspect_err(|e| rank.fail_after_agreeing(e));
    }
    let rows = rows_with(rank, &plan, x, false)?;
    let y = experts_unfused(&plan, &rows, weights, rank.topology().aicore_num())
        .inspect_err(|e| rank.fail_after_agreeing(e))?;
    combine_with(rank, &y, &plan, &routed.weight, false)
}

/// Each expert's SwiGLU on its rows through two grouped products.
fn experts_unfused<T: Element>(
    plan: &MoePlan,
    rows: &Tensor<T>,
    (gate_up, down): (&Tensor<T>, &Tensor<T>),
    threads: usize,
) -> Result<Tensor<T>> {
    let (local, h, ffn) = (down.shape()[0], down.shape()[2], down.shape()[1]);
    let groups: Vec<usize> =
        plan.experts_of(plan.me).map(|e| plan.counts.iter().map(|c| c[e]).sum()).collect();
    let per_expert = |w: &Tensor<T>, shape: [usize; 2]| -> Result<Vec<Tensor<T>>> {
        (0..local).map(|i| w.index_select(0, &[i])?.reshape(&shape)).collect()
    };
    let (gu_w, down_w) = (per_expert(gate_up, [h, 2 * ffn])?, per_expert(down, [ffn, h])?);
    let gu = grouped_matmul(rows, &groups, &gu_w.iter().collect::<Vec<_>>(), threads)?;
    let g = gu.as_slice();
    let act: Vec<T> = (0..rows.shape()[0] * ffn)
        .map(|at| {
            let (r, i) = (at / ffn, at % ffn);
            swiglu_unit::<T>(g[r * 2 * ffn + i].to_acc(), g[r * 2 * ffn + ffn + i].to_acc())
        })
        .collect();
    let act = Tensor::from_shape_vec(&[rows.shape()[0], ffn], act)?;
    grouped_matmul(&act, &groups, &down_w.iter().collect::<Vec<_>>(), threads)
}
