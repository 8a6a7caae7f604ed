//! GPT-2: learned positions, LayerNorm with biases, fused `c_attn` (Conv1D weights stored
//! `[in, out]`), a GELU MLP, the head tied to the token embedding.
//!
//! Tensor-parallel as the Llama family: attention by whole heads (each rank takes its heads'
//! q, k and v columns out of `c_attn`), `c_proj` row-parallel, `c_fc` column-parallel, the
//! MLP's `c_proj` row-parallel, the embedding and head vocab-parallel.

use std::path::Path;

use serde::Deserialize;

use super::blocks::{
    AttnSpec, HeadPlan, VocabShard, add_bias, attention, cat_cols, cols, column, from_f32, row, t2,
    to_f32,
};
use super::kv_cache::{KvCache, SeqId};
use super::weights::Weights;
use crate::shmem::Rank;
use crate::tensor::{Element, Tensor};
use crate::{Error, Placement, Result, Split};

/// A GPT-2 `config.json`, field names as Hugging Face spells them.
#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct Gpt2Config {
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Learned positions (the longest sequence).
    #[serde(default = "default_positions")]
    pub n_positions: usize,
    /// The model width.
    pub n_embd: usize,
    /// Layers.
    pub n_layer: usize,
    /// Heads.
    pub n_head: usize,
    /// The MLP width (`4 * n_embd` when absent or null).
    #[serde(default)]
    pub n_inner: Option<usize>,
    /// `gelu_new` (the tanh form), `gelu`, `gelu_pytorch_tanh` or `relu`.
    #[serde(default = "default_act")]
    pub activation_function: String,
    /// LayerNorm epsilon.
    #[serde(default = "default_eps")]
    pub layer_norm_epsilon: f64,
    /// Scores divided by `sqrt(head_dim)`.
    #[serde(default = "yes")]
    pub scale_attn_weights: bool,
    /// Scores also divided by the layer's index plus one.
    #[serde(default)]
    pub scale_attn_by_inverse_layer_idx: bool,
    /// Whether the head is the token embedding (GPT-2's default).
    #[serde(default = "yes")]
    pub tie_word_embeddings: bool,
}

fn default_positions() -> usize {
    1024
}
fn default_act() -> String {
    "gelu_new".into()
}
fn default_eps() -> f64 {
    1e-5
}
fn yes() -> bool {
    true
}

struct Layer<T: Element> {
    ln_1: (Tensor<T>, Tensor<T>),
    /// `[E, 3 * q * d]`: this rank's heads' q, k, v columns.
    c_attn: Tensor<T>,
    c_attn_bias: Vec<f32>,
    /// `[q * d, E]`.
    c_proj: Tensor<T>,
    c_proj_bias: Vec<f32>,
    ln_2: (Tensor<T>, Tensor<T>),
    /// `[E, F_r]`.
    c_fc: Tensor<T>,
    c_fc_bias: Vec<f32>,
    /// `[F_r, E]`.
    mlp_proj: Tensor<T>,
    mlp_proj_bias: Vec<f32>,
}

/// A GPT-2 LM, tensor-parallel over `rank`'s world, its weights in `T`.
pub struct Gpt2<'r, T: Element> {
    rank: &'r Rank<'r>,
    config: Gpt2Config,
    plan: HeadPlan,
    wte: VocabShard<T>,
    wpe: Tensor<T>,
    layers: Vec<Layer<T>>,
    ln_f: (Tensor<T>, Tensor<T>),
    head: Tensor<T>,
}

impl<'r, T: Element> Gpt2<'r, T> {
    /// Loads the model in `dir`, each rank reading its slice. Collective.
    ///
    /// # Errors
    /// As [`super::load`].
    pub fn load(rank: &'r Rank<'r>, dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let config: Gpt2Config = super::read_config(rank.rank(), dir)?;
        let weights = Weights::open(rank, dir)?;
        Self::from_weights(rank, config, &weights)
    }

    /// The model of `config` from `weights`. Collective.
    pub(crate) fn from_weights(
        rank: &'r Rank<'r>,
        config: Gpt2Config,
        w: &Weights<'r>,
    ) -> Result<Self> {
        let c = &config;
        let (me, world) = (rank.rank(), rank.num_ranks());
        let e = c.n_embd;
        let d = e / c.n_head.max(1);
        let ffn = c.n_inner.unwrap_or(4 * e);
        let plan = HeadPlan::new(c.n_head, c.n_head, world, me)?;
        if Split::Even.sizes(ffn, world)?.contains(&0) {
            return Err(Error::InvalidArgument {
                op: super::blocks::OP,
                rank: me,
                reason: format!("n_inner {ffn} is smaller than the {world} ranks"),
            });
        }
        let pre = if w.contains("transformer.wte.weight") { "transformer." } else { "" };
        let f32v = |t: Tensor<T>| to_f32(&t);
        let ln = |n: &str| -> Result<(Tensor<T>, Tensor<T>)> {
            Ok((w.whole(&format!("{n}.weight"), &[e])?, w.whole(&format!("{n}.bias"), &[e])?))
        };
        let (q0, qn) = (plan.q_start * d, plan.q * d);
        let mut layers = Vec::with_capacity(c.n_layer);
        for i in 0..c.n_layer {
            let p = format!("{pre}h.{i}");
            let attn = w.whole::<T>(&format!("{p}.attn.c_attn.weight"), &[e, 3 * e])?;
            let c_attn = cat_cols(&[
                &cols(&attn, q0, qn)?,
                &cols(&attn, e + q0, qn)?,
                &cols(&attn, 2 * e + q0, qn)?,
            ])?;
            let b = f32v(w.whole::<T>(&format!("{p}.attn.c_attn.bias"), &[3 * e])?)?;
            let c_attn_bias =
                [&b[q0..q0 + qn], &b[e + q0..e + q0 + qn], &b[2 * e + q0..2 * e + q0 + qn]]
                    .concat();
            layers.push(Layer {
                ln_1: ln(&format!("{p}.ln_1"))?,
                c_attn,
                c_attn_bias,
                c_proj: w.part(
                    &format!("{p}.attn.c_proj.weight"),
                    &[e, e],
                    Placement::Shard(0),
                    Split::Units(d),
                )?,
                c_proj_bias: f32v(w.whole(&format!("{p}.attn.c_proj.bias"), &[e])?)?,
                ln_2: ln(&format!("{p}.ln_2"))?,
                c_fc: w.part(
                    &format!("{p}.mlp.c_fc.weight"),
                    &[e, ffn],
                    Placement::Shard(1),
                    Split::Even,
                )?,
                c_fc_bias: f32v(w.part(
                    &format!("{p}.mlp.c_fc.bias"),
                    &[ffn],
                    Placement::Shard(0),
                    Split::Even,
                )?)?,
                mlp_proj: w.part(
                    &format!("{p}.mlp.c_proj.weight"),
                    &[ffn, e],
                    Placement::Shard(0),
                    Split::Even,
                )?,
                mlp_proj_bias: f32v(w.whole(&format!("{p}.mlp.c_proj.bias"), &[e])?)?,
            });
        }
        let wte = VocabShard::load(w, &format!("{pre}wte.weight"), c.vocab_size, e, rank)?;
        let wpe = w.whole(&format!("{pre}wpe.weight"), &[c.n_positions, e])?;
        let head = if c.tie_word_embeddings && !w.contains("lm_head.weight") {
            t2(&wte.table)?
        } else {
            t2(&w.part::<T>(
                "lm_head.weight",
                &[c.vocab_size, e],
                Placement::Shard(0),
                Split::Even,
            )?)?
        };
        let ln_f = ln(&format!("{pre}ln_f"))?;
        Ok(Gpt2 { rank, plan, wte, wpe, layers, ln_f, head, config })
    }

    /// The configuration it was built from.
    pub fn config(&self) -> &Gpt2Config {
        &self.config
    }

    /// The logits `[len, vocab]` of every position of `ids`, on every rank. Collective.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an empty prompt, one longer than `n_positions`, or an id
    /// outside the vocabulary; as the collectives.
    pub fn forward(&self, ids: &[u32]) -> Result<Tensor<f32>> {
        self.forward_with(ids, None)
    }

    /// A cache of keys and values for this model on this rank: `blocks` blocks of
    /// `block_size` positions.
    ///
    /// # Errors
    /// As [`KvCache::new`].
    pub fn kv_cache(&self, blocks: usize, block_size: usize) -> Result<KvCache> {
        let width = self.plan.q * (self.config.n_embd / self.config.n_head.max(1));
        KvCache::new(self.layers.len(), width, block_size, blocks)
    }

    /// The logits of `ids`: with a cache, a batch of sequences' new tokens (`batch`: each
    /// sequence and its count) after the positions each holds, the new keys and values joining
    /// the cache; without, the whole prompt. Collective.
    pub(crate) fn forward_with(
        &self,
        ids: &[u32],
        mut cache: Option<(&mut KvCache, &[(SeqId, usize)])>,
    ) -> Result<Tensor<f32>> {
        let c = &self.config;
        let rank = self.rank;
        super::check_ids(rank.rank(), ids)?;
        let len = ids.len();
        let (e, eps) = (c.n_embd, c.layer_norm_epsilon);
        let d = e / c.n_head;
        let q = self.plan.q;
        let end = match &cache {
            Some((cache, batch)) => batch.iter().map(|&(s, n)| cache.len(s) + n).max().unwrap_or(0),
            None => len,
        };
        if end > c.n_positions {
            return Err(Error::InvalidArgument {
                op: super::blocks::FWD,
                rank: rank.rank(),
                reason: format!(
                    "a sequence of {end} tokens (cached and new); GPT-2 has {} positions",
                    c.n_positions
                ),
            });
        }
        let shape = (self.layers.len(), q * d);
        let segments = match &mut cache {
            Some((cache, batch)) => super::plan_batch(rank.rank(), cache, batch, len, shape)?,
            None => Vec::new(),
        };
        let pos = if cache.is_some() {
            // Only the rows of the positions asked for (not the table up to the last of them).
            let table = self.wpe.to_host()?;
            let rows: Vec<T> = super::positions(&segments)
                .iter()
                .flat_map(|&p| table.as_slice()[p * e..(p + 1) * e].iter().copied())
                .collect();
            Tensor::from_shape_vec(&[len, e], rows)?
        } else {
            super::blocks::rows(&self.wpe, 0, len)?
        };
        let mut x = self.wte.embed(rank, ids, Some(&pos))?;
        for (i, l) in self.layers.iter().enumerate() {
            let h = x.try_map_local(|t| t.layer_norm(Some(&l.ln_1.0), Some(&l.ln_1.1), eps))?;
            let qkv = add_bias(&column(&h, &l.c_attn)?, &l.c_attn_bias)?;
            let mut scale = if c.scale_attn_weights { 1.0 / (d as f32).sqrt() } else { 1.0 };
            if c.scale_attn_by_inverse_layer_idx {
                scale /= (i + 1) as f32;
            }
            let spec = AttnSpec { q, kv: q, dim: d, scale, window: None };
            let v = to_f32(&qkv)?;
            let (stride, at) = (3 * q * d, [0, q * d, 2 * q * d]);
            let a = match &mut cache {
                None => attention::<T>(&v, len, stride, at, spec),
                Some((cache, _)) => {
                    super::attend_batch::<T>(cache, &segments, i, (&v, stride, at), spec)
                }
            };
            let a = from_f32::<T>(&[len, q * d], &a)?;
            let o = row(rank, a, &l.c_proj, &x)?.try_map_local(|t| add_bias(t, &l.c_proj_bias))?;
            x = x.zip_local(&o, |a, b| a + b)?;
            let h = x.try_map_local(|t| t.layer_norm(Some(&l.ln_2.0), Some(&l.ln_2.1), eps))?;
            let f = add_bias(&column(&h, &l.c_fc)?, &l.c_fc_bias)?;
            let f = match c.activation_function.as_str() {
                "gelu" => f.gelu(),
                "relu" => f.relu(),
                _ => f.gelu_tanh(),
            };
            let y =
                row(rank, f, &l.mlp_proj, &x)?.try_map_local(|t| add_bias(t, &l.mlp_proj_bias))?;
            x = x.zip_local(&y, |a, b| a + b)?;
        }
        if let Some((cache, _)) = cache {
            for &(seq, _, n) in &segments {
                cache.advance(seq, n);
            }
        }
        let h = x.try_map_local(|t| t.layer_norm(Some(&self.ln_f.0), Some(&self.ln_f.1), eps))?;
        Ok(h.all_gather_matmul(&self.head)?.to_global()?.cast::<f32>())
    }
}
