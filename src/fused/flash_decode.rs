//! Sequence-parallel flash-decode: one query token per sequence against a KV cache sharded by
//! sequence over the ranks (FlashDecoding's split of the keys, across ranks instead of across
//! thread blocks). Each rank attends to its own keys, giving a partial output and its
//! log-sum-exp; the partials are combined with log-sum-exp weights into the whole attention, the
//! same on every rank.
//!
//! Fused (`flash_decode`), the partials are written straight into every rank's symmetric buffer
//! as they are computed and combined in the same kernel once they have arrived (see
//! `device::host::flash_decode`): no collective, no host barrier between the two halves.
//! Unfused (`flash_decode_unfused`), as a user writes it with this library's parts: the local
//! decode attention with its log-sum-exp ([`decode_attention_lse`]), an
//! [`all_gather`](collectives::all_gather) of the partials, and the combine.

use crate::collectives;
use crate::device::capability::{self, Op};
use crate::device::host::flash_decode::DecodeLayout;
use crate::device::{DeviceWorld, ascend, cuda, device_data, host, to_world_device};
use crate::shmem::{Call, Rank};
use crate::tensor::decode_attention::{Combine, decode_shape_problem};
use crate::tensor::{Element, Tensor, decode_attention_lse};
use crate::{Error, Result};

const OP: &str = "flash_decode";
const UNFUSED_OP: &str = "flash_decode_unfused";

/// The result of a flash-decode: the attention of every query, the same on every rank.
#[derive(Debug, Clone, PartialEq)]
pub struct FlashDecodeOutput<T: Element> {
    /// `[batch, heads, dv]`: `softmax(q k^T * scale) v` over every rank's keys.
    pub output: Tensor<T>,
    /// `[batch, heads]`: the log-sum-exp of each query's scaled scores over every rank's keys
    /// (minus infinity where there are none), in the accumulator type.
    pub lse: Tensor<T::Acc>,
}

/// Attention of one query per sequence to keys sharded by sequence over the ranks. Collective.
///
/// `q` is `[batch, heads, d]`, the same on every rank; `k` and `v` are this rank's keys and
/// values, `[batch, keys, kv_heads, d]` and `[batch, keys, kv_heads, dv]` (the layout of a KV
/// cache; `keys` may differ between ranks, and be 0). Query head `h` attends with kv head
/// `h / (heads / kv_heads)` (grouped-query attention; `heads` a multiple of `kv_heads`, at most
/// 64 query heads per kv head). A decoding query sees every cached key, so there is no mask.
/// Every rank returns the whole result, bit for bit the same (the partials are combined in rank
/// order everywhere).
///
/// # Errors
/// On every rank: [`Error::InvalidArgument`] naming the rank whose shapes are wrong, or whose
/// backend has no kernel for the op or the element type (the capability table);
/// [`Error::RanksDisagree`] when ranks pass different `batch`, `heads`, `kv_heads`, `d`, `dv`
/// or `scale`; and as every collective.
///
/// # Examples
/// ```
/// use dist_tensor::fused::flash_decode;
/// use dist_tensor::tensor::scaled_dot_product_attention_lse;
/// use dist_tensor::{Tensor, World};
///
/// // 1 sequence, 4 query heads sharing 2 kv heads, d = 8; 10 cached keys split 3 + 7.
/// let q = Tensor::<f64>::random(&[1, 4, 8], 1);
/// let (k, v) = (Tensor::<f64>::random(&[1, 10, 2, 8], 2), Tensor::<f64>::random(&[1, 10, 2, 8], 3));
/// let scale = 1.0 / 8f64.sqrt();
/// let outs = World::threads(2)?.run(|rank| {
///     let (start, len) = if rank.rank() == 0 { (0, 3) } else { (3, 7) };
///     let keys: Vec<usize> = (start..start + len).collect();
///     let mine = |t: &Tensor<f64>| t.index_select(1, &keys);
///     Ok(flash_decode(rank, &q, &mine(&k)?, &mine(&v)?, scale)?.output)
/// })?;
/// assert_eq!(outs[0], outs[1]);
/// // The same as attending to all the keys at once: head 3 uses kv head 1.
/// let k1 = k.index_select(2, &[1])?.reshape(&[10, 8])?;
/// let v1 = v.index_select(2, &[1])?.reshape(&[10, 8])?;
/// let q3 = q.index_select(1, &[3])?.reshape(&[1, 8])?;
/// let (want, _) = scaled_dot_product_attention_lse(&q3, &k1, &v1, false, scale)?;
/// let got = &outs[0].as_slice()[3 * 8..];
/// assert!(got.iter().zip(want.as_slice()).all(|(a, b)| (a - b).abs() < 1e-12));
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn flash_decode<T: Element>(
    rank: &Rank<'_>,
    q: &Tensor<T>,
    k: &Tensor<T>,
    v: &Tensor<T>,
    scale: f64,
) -> Result<FlashDecodeOutput<T>> {
    run(rank, q, k, v, scale, true)
}

/// The unfused baseline of [`flash_decode`], as a user writes it with this library: the local
/// decode attention with its log-sum-exp ([`decode_attention_lse`]), one
/// [`all_gather`](collectives::all_gather) of every rank's outputs and log-sum-exps, and the
/// combine. The same results as [`flash_decode`] within rounding (its partial outputs are
/// rounded to `T` before they are combined).
///
/// # Errors
/// As [`flash_decode`].
///
/// # Examples
/// ```
/// use dist_tensor::fused::{flash_decode, flash_decode_unfused};
/// use dist_tensor::{Tensor, World};
/// World::threads(3)?.run(|rank| {
///     let q = Tensor::<f64>::random(&[2, 6, 4], 1);
///     let keys = 2 * rank.rank(); // 0, 2 and 4 keys
///     let k = Tensor::<f64>::random(&[2, keys, 3, 4], 2 + rank.rank() as u64);
///     let v = Tensor::<f64>::random(&[2, keys, 3, 5], 9 + rank.rank() as u64);
///     let (a, b) = (flash_decode(rank, &q, &k, &v, 0.5)?, flash_decode_unfused(rank, &q, &k, &v, 0.5)?);
///     assert!(a.output.as_slice().iter().zip(b.output.as_slice()).all(|(x, y)| (x - y).abs() < 1e-12));
///     Ok(())
/// })?;
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn flash_decode_unfused<T: Element>(
    rank: &Rank<'_>,
    q: &Tensor<T>,
    k: &Tensor<T>,
    v: &Tensor<T>,
    scale: f64,
) -> Result<FlashDecodeOutput<T>> {
    run(rank, q, k, v, scale, false)
}

/// Exchanges shapes and checks them on every rank.
fn agree<T: Element>(
    op: &'static str,
    rank: &Rank<'_>,
    q: &Tensor<T>,
    k: &Tensor<T>,
    v: &Tensor<T>,
    scale: f64,
) -> Result<DecodeLayout> {
    let (qs, ks, vs) = (q.shape(), k.shape(), v.shape());
    let problem = decode_shape_problem(qs, ks, vs)
        .or_else(|| (!scale.is_finite()).then(|| format!("the scale {scale} is not finite")))
        .or_else(|| capability::dtype_problem(Op::FlashDecode, rank.device(), T::DTYPE));
    let dim = |s: &[usize], i: usize| s.get(i).copied().unwrap_or(0) as u64;
    let words =
        [dim(qs, 0), dim(qs, 1), dim(ks, 2), dim(qs, 2), dim(vs, 3), scale.to_bits(), dim(ks, 1)];
    let all = rank.exchange(Call::of::<T>(op), &words, problem, &[])?;
    for (i, what) in ["batch", "heads", "kv_heads", "d", "dv"].into_iter().enumerate() {
        all.agree(OP, i, what)?;
    }
    let scales_agree = all.iter().all(|w| w[5] == scale.to_bits());
    if !scales_agree {
        let bad = all.iter().position(|w| w[5] != all[0][5]).expect("a disagreeing rank");
        return Err(Error::RanksDisagree {
            op: OP,
            rank_a: 0,
            value_a: format!("scale = {}", f64::from_bits(all[0][5])),
            rank_b: bad,
            value_b: format!("scale = {}", f64::from_bits(all[bad][5])),
        });
    }
    Ok(DecodeLayout {
        batch: qs[0],
        heads: qs[1],
        kv_heads: ks[2],
        d: qs[2],
        dv: vs[3],
        keys: all.iter().map(|w| w[6] as usize).collect(),
        scale,
    })
}

/// `flash_decode` (or its unfused baseline) on any world: the one place it chooses its backend.
fn run<T: Element>(
    rank: &Rank<'_>,
    q: &Tensor<T>,
    k: &Tensor<T>,
    v: &Tensor<T>,
    scale: f64,
    fused: bool,
) -> Result<FlashDecodeOutput<T>> {
    let op = if fused { OP } else { UNFUSED_OP };
    let layout = agree(op, rank, q, k, v, scale)?;
    let ran = match rank.device_world() {
        DeviceWorld::Host if fused => host::flash_decode::flash_decode(rank, &layout, q, k, v)
            .map(|(output, lse)| FlashDecodeOutput { output, lse }),
        DeviceWorld::Ascend(world) if fused => {
            let npu = ascend::AscendRank { world, rank };
            let (qs, ks, vs) = (q.as_slice(), k.as_slice(), v.as_slice());
            ascend::launch::flash_decode(&npu, &layout, qs, ks, vs).and_then(|(output, lse)| {
                // f32 from the NPU; the accumulator type of every NPU element type is f32.
                let lse = lse.into_iter().map(|x| <T::Acc as Element>::from_f64(f64::from(x)));
                let (rows, dv) = ([layout.batch, layout.heads], layout.dv);
                Ok(FlashDecodeOutput {
                    output: Tensor::from_shape_vec(&[rows[0], rows[1], dv], output)?,
                    lse: Tensor::from_shape_vec(&rows, lse.collect())?,
                })
            })
        }
        DeviceWorld::Cuda(gpus) => on_gpus(gpus, rank, &layout, (q, k, v), fused),
        _ => unfused(rank, &layout, q, k, v),
    };
    ran.inspect_err(|e| rank.fail_after_agreeing(e))
}

/// The op (or its unfused baseline) on this rank's GPU, the inputs moved there once.
fn on_gpus<T: Element>(
    gpus: &cuda::CudaWorld,
    rank: &Rank<'_>,
    layout: &DecodeLayout,
    (q, k, v): (&Tensor<T>, &Tensor<T>, &Tensor<T>),
    fused: bool,
) -> Result<FlashDecodeOutput<T>> {
    let [q, k, v] = [q, k, v].map(|t| to_world_device(rank, t.clone()));
    let (q, k, v) = (q?, k?, v?);
    let inputs = (device_data(&q), device_data(&k), device_data(&v));
    let (output, lse) = cuda::flash_decode(gpus, rank, layout, inputs, fused)?;
    Ok(FlashDecodeOutput {
        output: Tensor::from_device_storage(output),
        lse: Tensor::from_device_storage(lse),
    })
}

/// The unfused baseline after the agreement on `l`.
fn unfused<T: Element>(
    rank: &Rank<'_>,
    l: &DecodeLayout,
    q: &Tensor<T>,
    k: &Tensor<T>,
    v: &Tensor<T>,
) -> Result<FlashDecodeOutput<T>> {
    let (o, lse) = decode_attention_lse(q, k, v, l.scale)?;
    let (rows, record) = (l.batch * l.heads, l.dv + 1);
    let mut packed = Vec::with_capacity(rows * record);
    for (row, &s) in o.as_slice().chunks_exact(l.dv.max(1)).zip(lse.as_slice()) {
        packed.extend(row.iter().map(|x| x.to_acc()));
        packed.push(s);
    }
    packed.resize(rows * record, <T::Acc as Element>::zero());
    let all = collectives::all_gather(rank, &packed)?;
    let mut output = vec![T::zero(); rows * l.dv];
    let mut lses = Vec::with_capacity(rows);
    let mut acc = vec![<T::Acc as Element>::zero(); l.dv];
    for (r, out) in output.chunks_exact_mut(l.dv.max(1)).enumerate() {
        let mut sum = Combine::new(&mut acc);
        for src in 0..rank.num_ranks() {
            sum.add(&all[(src * rows + r) * record..][..record]);
        }
        lses.push(sum.finish(out));
    }
    Ok(FlashDecodeOutput {
        output: Tensor::from_shape_vec(&[l.batch, l.heads, l.dv], output)?,
        lse: Tensor::from_shape_vec(&[l.batch, l.heads], lses)?,
    })
}
