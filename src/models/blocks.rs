//! The pieces the model files share: the head split over the ranks, rotary embeddings (with the
//! `linear`, `dynamic` and `llama3` scalings), causal attention with GQA / MQA, the
//! vocab-parallel embedding and head, the column- and row-parallel products through the fused
//! ops, and the few tensor helpers the tensor layer does not have yet (column slices and
//! concatenation, element rounding to the model's type).
//!
//! The activations between blocks are sharded on the sequence (rows, split as
//! `numpy.array_split` cuts them): a column-parallel product is one fused `all_gather_matmul`
//! (every row, this rank's columns), a row-parallel product one fused `matmul_reduce_scatter`
//! (back to this rank's rows), as Megatron's sequence parallelism arranges them.

use serde::Deserialize;

use crate::dist_tensor::DistTensor;
use crate::shmem::Rank;
use crate::tensor::{Element, Tensor};
use crate::{Error, Placement, Result, Split};

pub(crate) const OP: &str = "models::load";
pub(crate) const FWD: &str = "models::forward";

/// `x` rounded to `T` and back: where the reference rounds an intermediate to the model's type.
#[inline]
pub(crate) fn rt<T: Element>(x: f32) -> f32 {
    T::from_f64(x as f64).to_f64() as f32
}

/// A tensor's elements widened to f32 (on the host).
pub(crate) fn to_f32<T: Element>(t: &Tensor<T>) -> Result<Vec<f32>> {
    Ok(t.to_host()?.as_slice().iter().map(|v| v.to_f64() as f32).collect())
}

/// A tensor of `shape` from f32 elements, each rounded once to `T`.
pub(crate) fn from_f32<T: Element>(shape: &[usize], v: &[f32]) -> Result<Tensor<T>> {
    Tensor::from_shape_vec(shape, v.iter().map(|&x| T::from_f64(x as f64)).collect())
}

/// Columns `start..start + n` of a `[rows, cols]` tensor.
pub(crate) fn cols<T: Element>(t: &Tensor<T>, start: usize, n: usize) -> Result<Tensor<T>> {
    let t = t.to_host()?;
    let (rows, c) = (t.shape()[0], t.shape()[1]);
    let s = t.as_slice();
    let mut out = Vec::with_capacity(rows * n);
    for r in 0..rows {
        out.extend_from_slice(&s[r * c + start..r * c + start + n]);
    }
    Tensor::from_shape_vec(&[rows, n], out)
}

/// Rows `start..start + n` of a `[rows, cols]` tensor.
pub(crate) fn rows<T: Element>(t: &Tensor<T>, start: usize, n: usize) -> Result<Tensor<T>> {
    let t = t.to_host()?;
    let c = t.shape()[1];
    Tensor::from_shape_vec(&[n, c], t.as_slice()[start * c..(start + n) * c].to_vec())
}

/// `[rows, c_i]` tensors side by side: `[rows, sum c_i]`.
pub(crate) fn cat_cols<T: Element>(parts: &[&Tensor<T>]) -> Result<Tensor<T>> {
    let parts: Vec<Tensor<T>> = parts.iter().map(|p| p.to_host()).collect::<Result<_>>()?;
    let rows = parts[0].shape()[0];
    let total: usize = parts.iter().map(|p| p.shape()[1]).sum();
    let mut out = Vec::with_capacity(rows * total);
    for r in 0..rows {
        for p in &parts {
            let c = p.shape()[1];
            out.extend_from_slice(&p.as_slice()[r * c..(r + 1) * c]);
        }
    }
    Tensor::from_shape_vec(&[rows, total], out)
}

/// `[a, b]` as `[b, a]`, contiguous.
pub(crate) fn t2<T: Element>(t: &Tensor<T>) -> Result<Tensor<T>> {
    t.transpose(0, 1)
}

/// Where this rank's heads are: its query heads, and the key/value heads they read (replicated
/// when there are fewer KV heads than ranks, as Megatron and vLLM do).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct HeadPlan {
    /// Query heads of this rank, and the first one's index.
    pub q: usize,
    pub q_start: usize,
    /// Key/value heads of this rank, and the first one's index.
    pub kv: usize,
    pub kv_start: usize,
    /// Whether every KV head is loaded by several ranks.
    pub kv_replicated: bool,
}

impl HeadPlan {
    /// The plan for `heads` query and `kv_heads` KV heads on `world` ranks.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the numbers when the world does not divide the heads,
    /// the KV heads do not divide the world (when fewer) or the query heads (always).
    pub fn new(heads: usize, kv_heads: usize, world: usize, rank: usize) -> Result<Self> {
        let bad = |reason: String| Error::InvalidArgument { op: OP, rank, reason };
        if heads == 0 || kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
            return Err(bad(format!(
                "{heads} attention heads are not a whole number of groups of {kv_heads} key/value heads"
            )));
        }
        if !heads.is_multiple_of(world) {
            return Err(bad(format!(
                "{heads} attention heads do not split over {world} ranks (the world size must divide the heads)"
            )));
        }
        let q = heads / world;
        if kv_heads >= world {
            if !kv_heads.is_multiple_of(world) {
                return Err(bad(format!(
                    "{kv_heads} key/value heads do not split over {world} ranks"
                )));
            }
            let kv = kv_heads / world;
            Ok(HeadPlan { q, q_start: rank * q, kv, kv_start: rank * kv, kv_replicated: false })
        } else {
            if !world.is_multiple_of(kv_heads) {
                return Err(bad(format!(
                    "{world} ranks are not a multiple of the {kv_heads} key/value heads, to replicate each on whole ranks"
                )));
            }
            let group = heads / kv_heads;
            Ok(HeadPlan {
                q,
                q_start: rank * q,
                kv: 1,
                kv_start: rank * q / group,
                kv_replicated: true,
            })
        }
    }
}

/// `rope_scaling` of a config, as Hugging Face spells it.
#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct RopeScaling {
    /// `linear`, `dynamic` or `llama3` (`type` in older configs).
    #[serde(default, alias = "type")]
    pub rope_type: String,
    /// The scaling factor.
    #[serde(default = "one")]
    pub factor: f64,
    /// llama3: the low-frequency factor.
    #[serde(default = "one")]
    pub low_freq_factor: f64,
    /// llama3: the high-frequency factor.
    #[serde(default = "four")]
    pub high_freq_factor: f64,
    /// llama3 (and dynamic, if given): the context length the model was trained on.
    #[serde(default)]
    pub original_max_position_embeddings: Option<usize>,
}

fn one() -> f64 {
    1.0
}
fn four() -> f64 {
    4.0
}

/// Rotary position embeddings as `transformers` computes them (`rotate_half` layout: the first
/// and second halves of each head are the pairs), in f32.
#[derive(Debug, Clone)]
pub(crate) struct Rope {
    dim: usize,
    theta: f64,
    inv_freq: Vec<f32>,
    /// For `dynamic`: the factor and the length past which the base grows.
    dynamic: Option<(f64, usize)>,
}

impl Rope {
    /// The rotary embedding of heads of `dim`, base `theta`, scaled as `scaling` says.
    pub fn new(
        dim: usize,
        theta: f64,
        scaling: Option<&RopeScaling>,
        max_positions: usize,
        rank: usize,
    ) -> Result<Self> {
        let base = Self::base_inv_freq(dim, theta);
        let mut rope = Rope { dim, theta, inv_freq: base.clone(), dynamic: None };
        let Some(s) = scaling else { return Ok(rope) };
        match s.rope_type.as_str() {
            "default" | "" => {}
            "linear" => {
                let f = s.factor as f32;
                rope.inv_freq = base.iter().map(|v| v / f).collect();
            }
            "dynamic" => {
                let max = s.original_max_position_embeddings.unwrap_or(max_positions);
                rope.dynamic = Some((s.factor, max));
            }
            "llama3" => {
                let old =
                    s.original_max_position_embeddings.ok_or_else(|| Error::InvalidArgument {
                        op: OP,
                        rank,
                        reason: "rope_scaling llama3 without original_max_position_embeddings"
                            .into(),
                    })? as f32;
                let (factor, low, high) =
                    (s.factor as f32, s.low_freq_factor as f32, s.high_freq_factor as f32);
                let low_wavelen = old / low;
                let high_wavelen = old / high;
                rope.inv_freq = base
                    .iter()
                    .map(|&f| {
                        let wavelen = 2.0 * std::f32::consts::PI / f;
                        let scaled = if wavelen > low_wavelen { f / factor } else { f };
                        let smooth = (old / wavelen - low) / (high - low);
                        let smoothed = (1.0 - smooth) * scaled / factor + smooth * scaled;
                        let medium = wavelen >= high_wavelen && wavelen <= low_wavelen; // no NaN here
                        if medium { smoothed } else { scaled }
                    })
                    .collect();
            }
            other => {
                return Err(Error::InvalidArgument {
                    op: OP,
                    rank,
                    reason: format!(
                        "rope_scaling type {other:?} is not supported (default, linear, dynamic, llama3 are)"
                    ),
                });
            }
        }
        Ok(rope)
    }

    /// `1 / theta^(2i / dim)`, in f32 as `transformers` computes it.
    fn base_inv_freq(dim: usize, theta: f64) -> Vec<f32> {
        (0..dim / 2).map(|i| 1.0 / (theta as f32).powf((2 * i) as f32 / dim as f32)).collect()
    }

    /// The cos and sin tables `[len, dim / 2]` for positions `0..len`, rounded to `T` as the
    /// reference casts them to the activations' type.
    pub fn tables<T: Element>(&self, len: usize) -> (Vec<f32>, Vec<f32>) {
        let inv_freq = match self.dynamic {
            Some((factor, max)) if len > max => {
                let d = self.dim as f64;
                let base = self.theta
                    * ((factor * len as f64 / max as f64) - (factor - 1.0)).powf(d / (d - 2.0));
                Self::base_inv_freq(self.dim, base)
            }
            _ => self.inv_freq.clone(),
        };
        let half = self.dim / 2;
        let mut cos = Vec::with_capacity(len * half);
        let mut sin = Vec::with_capacity(len * half);
        for p in 0..len {
            for f in &inv_freq {
                let a = p as f32 * f;
                cos.push(rt::<T>(a.cos()));
                sin.push(rt::<T>(a.sin()));
            }
        }
        (cos, sin)
    }
}

/// Applies the rotation to `heads` heads of `dim` in each row of `x` (`[len, stride]`, the heads
/// from column `start`), in place.
#[allow(clippy::too_many_arguments)]
pub(crate) fn apply_rope<T: Element>(
    x: &mut [f32],
    len: usize,
    stride: usize,
    start: usize,
    heads: usize,
    dim: usize,
    cos: &[f32],
    sin: &[f32],
) {
    let half = dim / 2;
    for p in 0..len {
        for h in 0..heads {
            let o = p * stride + start + h * dim;
            for i in 0..half {
                let (a, b) = (x[o + i], x[o + i + half]);
                let (c, s) = (cos[p * half + i], sin[p * half + i]);
                x[o + i] = rt::<T>(rt::<T>(a * c) + rt::<T>(-b * s));
                x[o + i + half] = rt::<T>(rt::<T>(b * c) + rt::<T>(a * s));
            }
        }
    }
}

/// RMS normalization of each head (`heads` heads of `dim` from column `start` of each row),
/// times `weight` (`[dim]`), in place, as Qwen3's q / k norms.
#[allow(clippy::too_many_arguments)]
pub(crate) fn head_rms_norm<T: Element>(
    x: &mut [f32],
    len: usize,
    stride: usize,
    start: usize,
    heads: usize,
    dim: usize,
    weight: &[f32],
    eps: f64,
) {
    for p in 0..len {
        for h in 0..heads {
            let o = p * stride + start + h * dim;
            let seg = &mut x[o..o + dim];
            let ms = seg.iter().map(|v| v * v).sum::<f32>() / dim as f32;
            let inv = 1.0 / (ms + eps as f32).sqrt();
            for (v, w) in seg.iter_mut().zip(weight) {
                *v = rt::<T>(w * rt::<T>(*v * inv));
            }
        }
    }
}

/// The attention shape of one rank's part.
#[derive(Debug, Clone, Copy)]
pub(crate) struct AttnSpec {
    /// Query heads, key/value heads, head size.
    pub q: usize,
    pub kv: usize,
    pub dim: usize,
    /// The factor the scores are multiplied by.
    pub scale: f32,
    /// A key at distance `window` or more before the query is masked (Mistral's sliding window).
    pub window: Option<usize>,
}

/// Causal attention over `len` positions: `qkv` is `[len, stride]` with the query heads at
/// `q_at`, keys at `k_at`, values at `v_at` (`dim` columns each, head-major); returns
/// `[len, q * dim]`. Query head `h` reads KV head `h / (q / kv)`. Rounded to `T` where
/// `transformers`' eager attention rounds (scores, probabilities, output).
pub(crate) fn attention<T: Element>(
    qkv: &[f32],
    len: usize,
    stride: usize,
    at: [usize; 3],
    s: AttnSpec,
) -> Vec<f32> {
    let [q_at, k_at, v_at] = at;
    let d = s.dim;
    attention_rows::<T>(
        len,
        0,
        s,
        |i, h| &qkv[i * stride + q_at + h * d..][..d],
        |j, h| &qkv[j * stride + k_at + h * d..][..d],
        |j, h| &qkv[j * stride + v_at + h * d..][..d],
    )
}

/// Causal attention of `len` queries at positions `offset..offset + len` over the keys and
/// values of positions `0..offset + len` (a prefill after a cached prefix, or one decoded
/// token: the causal mask aligned to the bottom right, a query at position `t` sees keys
/// `0..=t`, or the last `window` of them). `q(i, h)` is query row `i`'s head `h`, `k(j, h)` and
/// `v(j, h)` position `j`'s KV head `h` (`dim` each). Returns `[len, q * dim]`, rounded as
/// [`attention`]: with `offset` 0 and the same rows, the same bits.
pub(crate) fn attention_rows<'a, T: Element>(
    len: usize,
    offset: usize,
    s: AttnSpec,
    q: impl Fn(usize, usize) -> &'a [f32],
    k: impl Fn(usize, usize) -> &'a [f32],
    v: impl Fn(usize, usize) -> &'a [f32],
) -> Vec<f32> {
    let group = s.q / s.kv;
    let d = s.dim;
    let mut out = vec![0.0f32; len * s.q * d];
    let mut p = vec![0.0f32; offset + len];
    for h in 0..s.q {
        let kvh = h / group;
        for i in 0..len {
            let t = offset + i;
            let q = q(i, h);
            let first = s.window.map_or(0, |w| (t + 1).saturating_sub(w));
            let mut max = f32::NEG_INFINITY;
            for (j, pj) in p.iter_mut().enumerate().take(t + 1).skip(first) {
                let dot: f32 = q.iter().zip(k(j, kvh)).map(|(a, b)| a * b).sum();
                let sc = rt::<T>(rt::<T>(dot) * s.scale);
                *pj = sc;
                max = max.max(sc);
            }
            let mut sum = 0.0f32;
            for pj in &mut p[first..=t] {
                *pj = (*pj - max).exp();
                sum += *pj;
            }
            let o = &mut out[i * s.q * d + h * d..][..d];
            let mut acc = vec![0.0f32; d];
            for (j, &pj) in p.iter().enumerate().take(t + 1).skip(first) {
                let w = rt::<T>(pj / sum);
                for (a, b) in acc.iter_mut().zip(v(j, kvh)) {
                    *a += w * b;
                }
            }
            for (oo, a) in o.iter_mut().zip(&acc) {
                *oo = rt::<T>(*a);
            }
        }
    }
    out
}

/// The vocabulary-parallel embedding table of one rank: rows `start..start + rows` of the
/// whole table.
pub(crate) struct VocabShard<T: Element> {
    pub table: Tensor<T>,
    pub start: usize,
    pub vocab: usize,
}

impl<T: Element> VocabShard<T> {
    /// The table `name` (`[vocab, hidden]`), each rank reading its rows.
    pub fn load(
        w: &super::weights::Weights<'_>,
        name: &str,
        vocab: usize,
        hidden: usize,
        rank: &Rank<'_>,
    ) -> Result<Self> {
        let table = w.part::<T>(name, &[vocab, hidden], Placement::Shard(0), Split::Even)?;
        let sizes = Split::Even.sizes(vocab, rank.num_ranks())?;
        let start = sizes[..rank.rank()].iter().sum();
        Ok(VocabShard { table, start, vocab })
    }

    /// The embeddings of `ids`, sharded on the sequence: each rank looks up the ids of its
    /// vocabulary slice (zeros for the others), and one reduce-scatter sums them into each
    /// rank's rows. `add` (rank 0 only) is added before the sum (GPT-2's positions). Collective.
    pub fn embed<'r>(
        &self,
        rank: &'r Rank<'r>,
        ids: &[u32],
        add: Option<&Tensor<T>>,
    ) -> Result<DistTensor<'r, T>> {
        if let Some(&bad) = ids.iter().find(|&&i| i as usize >= self.vocab) {
            return Err(Error::InvalidArgument {
                op: FWD,
                rank: rank.rank(),
                reason: format!("token id {bad} is not below the vocabulary size {}", self.vocab),
            });
        }
        let table = self.table.to_host()?;
        let (n, hidden) = (table.shape()[0], table.shape()[1]);
        let mut out = vec![T::zero(); ids.len() * hidden];
        let src = table.as_slice();
        for (r, &id) in ids.iter().enumerate() {
            let id = id as usize;
            if id >= self.start && id < self.start + n {
                let row = id - self.start;
                out[r * hidden..(r + 1) * hidden]
                    .copy_from_slice(&src[row * hidden..(row + 1) * hidden]);
            }
        }
        let mut local = Tensor::from_shape_vec(&[ids.len(), hidden], out)?;
        if let (Some(a), 0) = (add, rank.rank()) {
            local = &local + a;
        }
        DistTensor::from_local(rank, local, Placement::Partial)?.redistribute(Placement::Shard(0))
    }
}

/// The column-parallel product of sequence-sharded `x` with this rank's columns `w`: every
/// row, this rank's columns (one fused `all_gather_matmul`). Collective.
pub(crate) fn column<T: Element>(x: &DistTensor<'_, T>, w: &Tensor<T>) -> Result<Tensor<T>> {
    Ok(x.all_gather_matmul(w)?.into_local())
}

/// The row-parallel product: this rank's columns `h` (`[len, k_r]`, every row) times its rows
/// of the weight `w` (`[k_r, n]`), summed over the ranks and scattered back to the rows of
/// `like` (one fused `matmul_reduce_scatter`). Collective.
pub(crate) fn row<'r, T: Element>(
    rank: &'r Rank<'r>,
    h: Tensor<T>,
    w: &Tensor<T>,
    like: &DistTensor<'r, T>,
) -> Result<DistTensor<'r, T>> {
    DistTensor::from_local(rank, h, Placement::Shard(1))?.matmul_reduce_scatter_split(
        w,
        0,
        like.shard_sizes().to_vec(),
    )
}

/// Adds a bias (`[n]`) to every row of `[rows, n]`, rounding to `T`.
pub(crate) fn add_bias<T: Element>(x: &Tensor<T>, bias: &[f32]) -> Result<Tensor<T>> {
    let mut v = to_f32(x)?;
    let n = bias.len();
    for (i, e) in v.iter_mut().enumerate() {
        *e = rt::<T>(*e + bias[i % n]);
    }
    from_f32(x.shape(), &v)
}

/// The index of the largest value (the first on ties, as `torch.argmax`).
pub(crate) fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}
