//! The Llama family: Llama 2 and 3, Mistral, Qwen2 (q / k / v biases), Qwen3 (q / k norms, an
//! explicit `head_dim`), and their sparse MoE variants Mixtral and Qwen2-MoE (shared expert;
//! the MoE block in `models::moe`). One decoder: RMSNorm, rotary attention with GQA / MQA, a SwiGLU MLP,
//! a tied or untied head.
//!
//! Tensor-parallel from the file: q / k / v split by whole heads (column-parallel, KV heads
//! replicated when fewer than the ranks), `o_proj` row-parallel, `gate_proj` / `up_proj`
//! column-parallel, `down_proj` row-parallel, the embedding and head vocab-parallel. The
//! activations between the blocks are sharded on the sequence.

use std::path::Path;

use serde::Deserialize;

use super::blocks::{
    AttnSpec, HeadPlan, Rope, RopeScaling, VocabShard, add_bias, apply_rope, attention, cat_cols,
    column, from_f32, head_rms_norm, row, rows, rt, t2, to_f32,
};
use super::kv_cache::{KvCache, SeqId};
use super::moe::{Moe, MoeNames};
use super::moe_expert::ExpertMoe;
use super::weights::Weights;
use crate::shmem::Rank;
use crate::tensor::{Element, Tensor};
use crate::{Error, Placement, Result, Split};

/// A Llama-family `config.json`, field names as Hugging Face spells them; absent keys take the
/// `transformers` defaults.
#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct LlamaConfig {
    /// `LlamaForCausalLM`, `MistralForCausalLM`, `Qwen2ForCausalLM`, `Qwen3ForCausalLM`.
    #[serde(default)]
    pub architectures: Vec<String>,
    /// `llama`, `mistral`, `qwen2`, `qwen3`.
    #[serde(default)]
    pub model_type: String,
    /// The model width.
    pub hidden_size: usize,
    /// The MLP width.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (the query heads when absent).
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    /// The head size (`hidden_size / num_attention_heads` when absent or null).
    #[serde(default)]
    pub head_dim: Option<usize>,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// RMSNorm epsilon.
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    /// Rotary base.
    #[serde(default = "default_theta")]
    pub rope_theta: f64,
    /// Rotary scaling (`linear`, `dynamic`, `llama3`).
    #[serde(default)]
    pub rope_scaling: Option<RopeScaling>,
    /// The longest sequence.
    #[serde(default = "default_max_positions")]
    pub max_position_embeddings: usize,
    /// Whether the head is the embedding (no `lm_head.weight` in the file).
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Biases on q / k / v / o (Qwen2 always has q / k / v biases).
    #[serde(default)]
    pub attention_bias: bool,
    /// Qwen2-MoE's q / k / v biases.
    #[serde(default)]
    pub qkv_bias: bool,
    /// Biases on the MLP's projections.
    #[serde(default)]
    pub mlp_bias: bool,
    /// The MLP's activation: `silu` (others: `gelu`, `gelu_pytorch_tanh`).
    #[serde(default = "default_act")]
    pub hidden_act: String,
    /// Mistral's sliding window.
    #[serde(default)]
    pub sliding_window: Option<usize>,
    /// Qwen's switch for the sliding window.
    #[serde(default)]
    pub use_sliding_window: Option<bool>,
    /// Qwen's per-layer attention kinds (`full_attention`, `sliding_attention`).
    #[serde(default)]
    pub layer_types: Option<Vec<String>>,
    /// MoE (Mixtral): experts per layer.
    #[serde(default)]
    pub num_local_experts: Option<usize>,
    /// MoE (Qwen2-MoE): experts per layer.
    #[serde(default)]
    pub num_experts: Option<usize>,
    /// MoE: experts each token is routed to.
    #[serde(default = "default_top_k")]
    pub num_experts_per_tok: usize,
    /// Qwen2-MoE: each expert's width (Mixtral's is `intermediate_size`).
    #[serde(default)]
    pub moe_intermediate_size: Option<usize>,
    /// Qwen2-MoE: the shared expert's width.
    #[serde(default)]
    pub shared_expert_intermediate_size: Option<usize>,
    /// Qwen2-MoE: whether the top-k routing weights are renormalised (Mixtral always does).
    #[serde(default)]
    pub norm_topk_prob: bool,
    /// Qwen2-MoE: every this many layers is sparse.
    #[serde(default = "default_sparse_step")]
    pub decoder_sparse_step: usize,
    /// Qwen2-MoE: layers that keep a dense MLP.
    #[serde(default)]
    pub mlp_only_layers: Vec<usize>,
    /// The saved element type (`float32`, `bfloat16`, ...), as transformers 4.56+ writes it.
    #[serde(default)]
    pub dtype: Option<String>,
    /// The saved element type, as older versions write it.
    #[serde(default)]
    pub torch_dtype: Option<String>,
}

fn default_eps() -> f64 {
    1e-6
}
fn default_theta() -> f64 {
    10000.0
}
fn default_max_positions() -> usize {
    2048
}
fn default_top_k() -> usize {
    2
}
fn default_sparse_step() -> usize {
    1
}
fn default_act() -> String {
    "silu".into()
}

impl LlamaConfig {
    /// The head size.
    pub fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// The key/value heads.
    pub fn kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    /// The sliding window of layer `i`, if it has one.
    fn window(&self, i: usize) -> Option<usize> {
        let w = self.sliding_window?;
        match (&self.layer_types, self.use_sliding_window) {
            (Some(types), _) => {
                (types.get(i).map(String::as_str) == Some("sliding_attention")).then_some(w)
            }
            (None, Some(false)) => None,
            _ => Some(w),
        }
    }

    fn qkv_bias(&self) -> bool {
        self.attention_bias || self.qkv_bias || self.model_type == "qwen2"
    }

    /// The experts of layer `i`, if it is sparse.
    fn experts(&self, i: usize) -> Option<usize> {
        match self.model_type.as_str() {
            "mixtral" => self.num_local_experts,
            "qwen2_moe" => self.num_experts.filter(|&e| {
                e > 0
                    && !self.mlp_only_layers.contains(&i)
                    && (i + 1).is_multiple_of(self.decoder_sparse_step.max(1))
            }),
            _ => None,
        }
    }
}

/// One decoder layer's part on this rank.
struct Layer<T: Element> {
    input_norm: Tensor<T>,
    /// `[hidden, (q + 2 kv) * head_dim]`: this rank's q, k, v columns side by side.
    qkv: Tensor<T>,
    qkv_bias: Option<Vec<f32>>,
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
    /// `[q * head_dim, hidden]`: this rank's rows.
    o: Tensor<T>,
    o_bias: Option<Vec<f32>>,
    post_norm: Tensor<T>,
    mlp: Mlp<T>,
    window: Option<usize>,
}

/// A layer's MLP: dense (SwiGLU), or a sparse MoE block.
enum Mlp<T: Element> {
    Dense(Dense<T>),
    Moe(Moe<T>),
    ExpertMoe(Box<ExpertMoe<T>>),
}

/// A dense MLP's part on this rank.
struct Dense<T: Element> {
    /// `[hidden, 2 * ffn_r]`: this rank's gate then up columns.
    gate_up: Tensor<T>,
    gate_up_bias: Option<Vec<f32>>,
    /// `[ffn_r, hidden]`.
    down: Tensor<T>,
    down_bias: Option<Vec<f32>>,
}

/// A Llama-family causal LM, tensor-parallel over `rank`'s world, its weights in `T`.
pub struct Llama<'r, T: Element> {
    rank: &'r Rank<'r>,
    config: LlamaConfig,
    plan: HeadPlan,
    ffn: usize,
    rope: Rope,
    embed: VocabShard<T>,
    layers: Vec<Layer<T>>,
    norm: Tensor<T>,
    /// `[hidden, vocab_r]`.
    head: Tensor<T>,
}

impl<'r, T: Element> Llama<'r, T> {
    /// Loads the model in `dir` (`config.json` and its safetensors), each rank reading its
    /// slice. Collective.
    ///
    /// # Errors
    /// As [`super::load`].
    pub fn load(rank: &'r Rank<'r>, dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let config: LlamaConfig = super::read_config(rank.rank(), dir)?;
        let weights = Weights::open(rank, dir)?;
        Self::from_weights(rank, config, &weights, &super::LoadOptions::default())
    }

    /// The model of `config` from `weights`. Collective.
    pub(crate) fn from_weights(
        rank: &'r Rank<'r>,
        config: LlamaConfig,
        w: &Weights<'r>,
        options: &super::LoadOptions,
    ) -> Result<Self> {
        let c = &config;
        let (me, world) = (rank.rank(), rank.num_ranks());
        let (hidden, d, heads, kv_heads) =
            (c.hidden_size, c.head_dim(), c.num_attention_heads, c.kv_heads());
        let plan = HeadPlan::new(heads, kv_heads, world, me)?;
        let ffn_sizes = Split::Even.sizes(c.intermediate_size, world)?;
        if ffn_sizes.contains(&0) {
            return Err(Error::InvalidArgument {
                op: super::blocks::OP,
                rank: me,
                reason: format!(
                    "intermediate_size {} is smaller than the {world} ranks",
                    c.intermediate_size
                ),
            });
        }
        if !["silu", "gelu", "gelu_pytorch_tanh", "gelu_new"].contains(&c.hidden_act.as_str()) {
            return Err(Error::InvalidArgument {
                op: super::blocks::OP,
                rank: me,
                reason: format!("hidden_act {:?} is not supported", c.hidden_act),
            });
        }
        let rope =
            Rope::new(d, c.rope_theta, c.rope_scaling.as_ref(), c.max_position_embeddings, me)?;
        let heads_split = || Split::Units(d);
        let f32v = |t: Tensor<T>| to_f32(&t);
        // Column-parallel [out, in] weights read by rows, transposed once to [in, out_r].
        let col = |name: &str, out: usize| -> Result<Tensor<T>> {
            t2(&w.part::<T>(name, &[out, hidden], Placement::Shard(0), heads_split())?)
        };
        // K / V: by heads, or the one replicated head this rank's queries read.
        let kv_part = |name: &str| -> Result<Tensor<T>> {
            if plan.kv_replicated {
                let all = w.whole::<T>(name, &[kv_heads * d, hidden])?;
                t2(&rows(&all, plan.kv_start * d, d)?)
            } else {
                col(name, kv_heads * d)
            }
        };
        let kv_bias = |name: &str| -> Result<Vec<f32>> {
            if plan.kv_replicated {
                let all = to_f32(&w.whole::<T>(name, &[kv_heads * d])?)?;
                Ok(all[plan.kv_start * d..(plan.kv_start + 1) * d].to_vec())
            } else {
                f32v(w.part::<T>(name, &[kv_heads * d], Placement::Shard(0), heads_split())?)
            }
        };
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for i in 0..c.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let a = format!("{p}.self_attn");
            let q = col(&format!("{a}.q_proj.weight"), heads * d)?;
            let k = kv_part(&format!("{a}.k_proj.weight"))?;
            let v = kv_part(&format!("{a}.v_proj.weight"))?;
            let qkv_bias = if c.qkv_bias() {
                let qb = f32v(w.part::<T>(
                    &format!("{a}.q_proj.bias"),
                    &[heads * d],
                    Placement::Shard(0),
                    heads_split(),
                )?)?;
                let kb = kv_bias(&format!("{a}.k_proj.bias"))?;
                let vb = kv_bias(&format!("{a}.v_proj.bias"))?;
                Some([qb, kb, vb].concat())
            } else {
                None
            };
            let (q_norm, k_norm) = if c.model_type == "qwen3" {
                (
                    Some(f32v(w.whole::<T>(&format!("{a}.q_norm.weight"), &[d])?)?),
                    Some(f32v(w.whole::<T>(&format!("{a}.k_norm.weight"), &[d])?)?),
                )
            } else {
                (None, None)
            };
            let o = t2(&w.part::<T>(
                &format!("{a}.o_proj.weight"),
                &[hidden, heads * d],
                Placement::Shard(1),
                heads_split(),
            )?)?;
            let o_bias = if c.attention_bias {
                Some(f32v(w.whole::<T>(&format!("{a}.o_proj.bias"), &[hidden])?)?)
            } else {
                None
            };
            let m = format!("{p}.mlp");
            let mlp = if let Some(experts) = c.experts(i) {
                let names = if c.model_type == "mixtral" {
                    let b = format!("{p}.block_sparse_moe");
                    MoeNames {
                        router: format!("{b}.gate.weight"),
                        expert: Box::new(move |e| {
                            ["w1", "w3", "w2"].map(|n| format!("{b}.experts.{e}.{n}.weight"))
                        }),
                        shared: None,
                    }
                } else {
                    let proj = |pre: &str| {
                        ["gate_proj", "up_proj", "down_proj"].map(|n| format!("{pre}.{n}.weight"))
                    };
                    let mm = m.clone();
                    MoeNames {
                        router: format!("{m}.gate.weight"),
                        expert: Box::new(move |e| {
                            ["gate_proj", "up_proj", "down_proj"]
                                .map(|n| format!("{mm}.experts.{e}.{n}.weight"))
                        }),
                        shared: c.shared_expert_intermediate_size.filter(|&s| s > 0).map(|_| {
                            (
                                proj(&format!("{m}.shared_expert")),
                                format!("{m}.shared_expert_gate.weight"),
                            )
                        }),
                    }
                };
                let ffn = c.moe_intermediate_size.unwrap_or(c.intermediate_size);
                let normalize = c.model_type == "mixtral" || c.norm_topk_prob;
                let shared = c.shared_expert_intermediate_size.unwrap_or(0);
                let (k, ep) = (c.num_experts_per_tok, expert_parallel(rank, options, T::DTYPE)?);
                if ep {
                    let moe = ExpertMoe::load(
                        rank, w, &names, hidden, experts, k, normalize, ffn, shared,
                    )?;
                    Mlp::ExpertMoe(Box::new(moe))
                } else {
                    Mlp::Moe(Moe::load(w, &names, hidden, experts, k, normalize, ffn, shared)?)
                }
            } else {
                let ffn = c.intermediate_size;
                let gate = t2(&w.part::<T>(
                    &format!("{m}.gate_proj.weight"),
                    &[ffn, hidden],
                    Placement::Shard(0),
                    Split::Even,
                )?)?;
                let up = t2(&w.part::<T>(
                    &format!("{m}.up_proj.weight"),
                    &[ffn, hidden],
                    Placement::Shard(0),
                    Split::Even,
                )?)?;
                let down = t2(&w.part::<T>(
                    &format!("{m}.down_proj.weight"),
                    &[hidden, ffn],
                    Placement::Shard(1),
                    Split::Even,
                )?)?;
                let (gate_up_bias, down_bias) = if c.mlp_bias {
                    let b = |n: &str| {
                        f32v(w.part::<T>(
                            &format!("{m}.{n}.bias"),
                            &[ffn],
                            Placement::Shard(0),
                            Split::Even,
                        )?)
                    };
                    (
                        Some([b("gate_proj")?, b("up_proj")?].concat()),
                        Some(f32v(w.whole::<T>(&format!("{m}.down_proj.bias"), &[hidden])?)?),
                    )
                } else {
                    (None, None)
                };
                Mlp::Dense(Dense {
                    gate_up: cat_cols(&[&gate, &up])?,
                    gate_up_bias,
                    down,
                    down_bias,
                })
            };
            layers.push(Layer {
                input_norm: w.whole(&format!("{p}.input_layernorm.weight"), &[hidden])?,
                qkv: cat_cols(&[&q, &k, &v])?,
                qkv_bias,
                q_norm,
                k_norm,
                o,
                o_bias,
                post_norm: w.whole(&format!("{p}.post_attention_layernorm.weight"), &[hidden])?,
                mlp,
                window: c.window(i),
            });
        }
        let embed = VocabShard::load(w, "model.embed_tokens.weight", c.vocab_size, hidden, rank)?;
        let head = if c.tie_word_embeddings && !w.contains("lm_head.weight") {
            t2(&embed.table)?
        } else {
            t2(&w.part::<T>(
                "lm_head.weight",
                &[c.vocab_size, hidden],
                Placement::Shard(0),
                Split::Even,
            )?)?
        };
        let norm = w.whole("model.norm.weight", &[hidden])?;
        Ok(Llama { rank, plan, ffn: ffn_sizes[me], rope, embed, layers, norm, head, config })
    }

    /// The configuration it was built from.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// The logits `[len, vocab]` of every position of `ids` (the whole prompt, no cache), on
    /// every rank. Collective.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an id outside the vocabulary or an empty prompt; as the
    /// collectives.
    pub fn forward(&self, ids: &[u32]) -> Result<Tensor<f32>> {
        self.forward_with(ids, None)
    }

    /// A cache of keys and values for this model on this rank: `blocks` blocks of
    /// `block_size` positions.
    ///
    /// # Errors
    /// As [`KvCache::new`].
    pub fn kv_cache(&self, blocks: usize, block_size: usize) -> Result<KvCache> {
        let width = self.plan.kv * self.config.head_dim();
        KvCache::new(self.layers.len(), width, block_size, blocks)
    }

    /// The logits `[len, vocab]` of `ids`: with a cache, a batch of sequences' new tokens one
    /// after the other (`batch`: each sequence and its count), each at the positions after
    /// those it holds, their keys and values joining it; without, the whole prompt.
    /// Collective.
    pub(crate) fn forward_with(
        &self,
        ids: &[u32],
        mut cache: Option<(&mut KvCache, &[(SeqId, usize)])>,
    ) -> Result<Tensor<f32>> {
        let c = &self.config;
        let (rank, eps, d) = (self.rank, c.rms_norm_eps, c.head_dim());
        super::check_ids(rank.rank(), ids)?;
        let len = ids.len();
        let (nq, nkv) = (self.plan.q, self.plan.kv);
        let shape = (self.layers.len(), nkv * d);
        let segments = match &mut cache {
            Some((cache, batch)) => super::plan_batch(rank.rank(), cache, batch, len, shape)?,
            None => Vec::new(),
        };
        // Each row's rotation, at its own position.
        let half = d / 2;
        let at_rows =
            if cache.is_some() { super::positions(&segments) } else { (0..len).collect() };
        let end = at_rows.iter().max().map_or(0, |p| p + 1);
        let (cos_all, sin_all) = self.rope.tables::<T>(end);
        let pick = |t: &[f32]| -> Vec<f32> {
            at_rows.iter().flat_map(|&p| t[p * half..(p + 1) * half].iter().copied()).collect()
        };
        let (cos, sin) = (&pick(&cos_all)[..], &pick(&sin_all)[..]);
        let stride = (nq + 2 * nkv) * d;
        let at = [0, nq * d, (nq + nkv) * d];
        let mut x = self.embed.embed(rank, ids, None)?;
        for (li, l) in self.layers.iter().enumerate() {
            let h = x.try_map_local(|t| t.rms_norm(Some(&l.input_norm), eps))?;
            let qkv = column(&h, &l.qkv)?;
            let qkv = match &l.qkv_bias {
                Some(b) => add_bias(&qkv, b)?,
                None => qkv,
            };
            let mut v = to_f32(&qkv)?;
            if let (Some(qn), Some(kn)) = (&l.q_norm, &l.k_norm) {
                head_rms_norm::<T>(&mut v, len, stride, at[0], nq, d, qn, eps);
                head_rms_norm::<T>(&mut v, len, stride, at[1], nkv, d, kn, eps);
            }
            apply_rope::<T>(&mut v, len, stride, at[0], nq, d, cos, sin);
            apply_rope::<T>(&mut v, len, stride, at[1], nkv, d, cos, sin);
            let spec =
                AttnSpec { q: nq, kv: nkv, dim: d, scale: (d as f32).powf(-0.5), window: l.window };
            let a = match &mut cache {
                None => attention::<T>(&v, len, stride, at, spec),
                Some((cache, _)) => {
                    super::attend_batch::<T>(cache, &segments, li, (&v, stride, at), spec)
                }
            };
            let a = from_f32::<T>(&[len, nq * d], &a)?;
            let o = row(rank, a, &l.o, &x)?;
            let o = match &l.o_bias {
                Some(b) => o.try_map_local(|t| add_bias(t, b))?,
                None => o,
            };
            x = x.zip_local(&o, |a, b| a + b)?;
            let h = x.try_map_local(|t| t.rms_norm(Some(&l.post_norm), eps))?;
            let y = match &l.mlp {
                Mlp::Moe(moe) => moe.forward(rank, &h, &x)?,
                Mlp::ExpertMoe(moe) => moe.forward(rank, &h, &x)?,
                Mlp::Dense(mlp) => {
                    let gu = column(&h, &mlp.gate_up)?;
                    let gu = match &mlp.gate_up_bias {
                        Some(b) => add_bias(&gu, b)?,
                        None => gu,
                    };
                    let act = self.activation(&gu)?;
                    let y = row(rank, act, &mlp.down, &x)?;
                    match &mlp.down_bias {
                        Some(b) => y.try_map_local(|t| add_bias(t, b))?,
                        None => y,
                    }
                }
            };
            x = x.zip_local(&y, |a, b| a + b)?;
        }
        if let Some((cache, _)) = cache {
            for &(seq, _, n) in &segments {
                cache.advance(seq, n);
            }
        }
        let h = x.try_map_local(|t| t.rms_norm(Some(&self.norm), eps))?;
        Ok(h.all_gather_matmul(&self.head)?.to_global()?.cast::<f32>())
    }

    /// `act(gate) * up` of `[len, 2 * ffn_r]` (gate then up columns).
    fn activation(&self, gu: &Tensor<T>) -> Result<Tensor<T>> {
        let f = self.ffn;
        let len = gu.shape()[0];
        let v = to_f32(gu)?;
        let act: fn(f32) -> f32 = match self.config.hidden_act.as_str() {
            "silu" => |x| x / (1.0 + (-x).exp()),
            "gelu" => {
                |x| (x as f64 * 0.5 * (1.0 + libm::erf(x as f64 / std::f64::consts::SQRT_2))) as f32
            }
            _ => |x| {
                let k = (2.0 / std::f32::consts::PI).sqrt();
                0.5 * x * (1.0 + (k * (x + 0.044715 * x * x * x)).tanh())
            },
        };
        let mut out = Vec::with_capacity(len * f);
        for r in 0..len {
            let row = &v[r * 2 * f..(r + 1) * 2 * f];
            for i in 0..f {
                out.push(rt::<T>(rt::<T>(act(row[i])) * row[f + i]));
            }
        }
        from_f32(&[len, f], &out)
    }
}

/// Whether this rank's MoE blocks are expert-parallel (`options`, on this backend).
fn expert_parallel(
    rank: &Rank<'_>,
    options: &super::LoadOptions,
    dtype: crate::DType,
) -> Result<bool> {
    use crate::device::capability::{Op, refusal};
    let refused = refusal(Op::MoeDispatch, rank.device(), dtype, &[]);
    match (options.experts, refused) {
        (super::ExpertLayout::TensorParallel, _) => Ok(false),
        (super::ExpertLayout::Auto, refused) => Ok(refused.is_none()),
        (super::ExpertLayout::ExpertParallel, None) => Ok(true),
        (super::ExpertLayout::ExpertParallel, Some(reason)) => Err(Error::InvalidArgument {
            op: "models::load",
            rank: rank.rank(),
            reason: format!("expert parallelism: {reason}"),
        }),
    }
}
