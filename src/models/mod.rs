//! Published models: Hugging Face directories (`config.json`, safetensors) loaded straight into
//! a tensor-parallel layout, each rank reading only its slice, and run.
//!
//! One file per architecture family, sharing blocks:
//!
//! | family | `architectures` | file |
//! | --- | --- | --- |
//! | Llama 2 / 3, Mistral, Qwen2, Qwen3 | `LlamaForCausalLM`, `MistralForCausalLM`, `Qwen2ForCausalLM`, `Qwen3ForCausalLM` | [`llama`] |
//! | Mixtral, Qwen2-MoE (shared expert) | `MixtralForCausalLM`, `Qwen2MoeForCausalLM` | [`llama`], its MoE block in `moe.rs` |
//! | GPT-2 | `GPT2LMHeadModel` | [`gpt2`] |
//!
//! [`load`] reads `config.json`, opens `model.safetensors` or the shards that
//! `model.safetensors.index.json` names, and builds the model on the rank's world in `T` (f32,
//! bf16, f16; the weights converted from the file's type, rounded once). The split is Megatron's:
//! attention by whole heads (q / k / v column-parallel, KV heads replicated when fewer than the
//! ranks, the output projection row-parallel), MLPs column- then row-parallel, the embedding and
//! the head vocab-parallel; between the blocks the activations are sharded on the sequence, so
//! each parallel product is one fused op ([`DistTensor::all_gather_matmul`](crate::DistTensor::all_gather_matmul),
//! [`DistTensor::matmul_reduce_scatter`](crate::DistTensor::matmul_reduce_scatter)).
//!
//! [`Model::forward`] runs a whole prompt. [`Model::generate`] prefills the prompt into a paged
//! [`KvCache`] and decodes one token at a time against it ([`Model::forward_cached`]), greedy
//! or sampled ([`GenerateOptions`]: temperature, top-k, top-p, repetition penalty, a seed, stop
//! tokens), handing each token to a callback as it comes; [`Model::generate_batch`] serves
//! several prompts by continuous batching (prefills beside decodes in one pass, preemption when
//! the cache runs out); [`Model::generate_greedy`] is the reference they are tested against
//! (the window recomputed every step).

pub mod blocks;
mod generate;
pub mod gpt2;
mod kv_cache;
pub mod llama;
mod moe;
mod moe_expert;
mod weights;

use std::path::Path;

use serde::de::DeserializeOwned;

pub use generate::GenerateOptions;
pub use gpt2::{Gpt2, Gpt2Config};
pub use kv_cache::{KvCache, SeqId};
pub use llama::{Llama, LlamaConfig};
pub use weights::{HF_INDEX, HF_SINGLE, Weights};

use crate::checkpoint::CheckpointErrorKind;
use crate::shmem::Rank;
use crate::tensor::{DType, Element, Tensor};
use crate::{Error, Result};

/// The config file of a model directory.
pub const CONFIG: &str = "config.json";

/// A loaded causal language model of any supported family.
pub enum Model<'r, T: Element> {
    /// Llama 2 / 3, Mistral, Qwen2, Qwen3, Mixtral, Qwen2-MoE.
    Llama(Box<Llama<'r, T>>),
    /// GPT-2.
    Gpt2(Box<Gpt2<'r, T>>),
}

/// The families and the `architectures` (or `model_type`) names that select them.
const LLAMA: &[&str] = &[
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
];
const LLAMA_TYPES: &[&str] = &["llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe"];
const GPT2: &[&str] = &["GPT2LMHeadModel"];

/// Loads the Hugging Face model in `dir` on `rank`'s world, in `T`: reads `config.json`, picks
/// the family from its `architectures` (or `model_type`), opens `model.safetensors` or the
/// sharded index, and each rank reads only its slice. Collective: every rank calls it.
///
/// # Errors
/// On every rank, and nothing half-loaded is returned:
/// - [`Error::Checkpoint`] naming the file (and the tensor): `config.json` missing or not
///   parsing, an unknown architecture ([`CheckpointErrorKind::Malformed`] naming it and the
///   known ones), no weights file, a truncated or damaged file, a missing tensor
///   ([`CheckpointErrorKind::TensorNotFound`]), a tensor of another shape
///   ([`CheckpointErrorKind::ShapeMismatch`]);
/// - [`Error::InvalidArgument`] naming the numbers when the world size does not divide the
///   attention heads (or the KV heads, or is not a multiple of fewer KV heads).
///
/// # Examples
/// ```
/// use dist_tensor::{World, models};
/// let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/models/llama3");
/// let new = World::threads(2)?.run(|rank| {
///     let model = models::load::<f32>(rank, dir)?;
///     model.generate_greedy(&[1, 0, 17, 42, 99, 126, 127], 8)
/// })?;
/// assert_eq!(new[0], [74, 96, 96, 96, 96, 92, 66, 57]); // as transformers generates
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn load<'r, T: Element>(rank: &'r Rank<'r>, dir: impl AsRef<Path>) -> Result<Model<'r, T>> {
    load_with(rank, dir, &LoadOptions::default())
}

/// How a mixture-of-experts block splits its experts over the ranks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ExpertLayout {
    /// Expert-parallel where the world's backend has the fused dispatch and combine (the
    /// capability table's `moe_dispatch`), else tensor-parallel.
    #[default]
    Auto,
    /// Every expert's MLP split over the ranks as a dense MLP's (each rank computes every
    /// expert for every token, the unchosen ones weighted 0): two fused products a block.
    TensorParallel,
    /// Whole experts per rank (split as `numpy.array_split` splits them); each token's rows
    /// dispatched to its top-k experts' ranks and combined back (`fused::moe_dispatch`,
    /// `fused::moe_combine`).
    ExpertParallel,
}

/// Choices made when a model is loaded.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoadOptions {
    /// The split of a mixture-of-experts block's experts.
    pub experts: ExpertLayout,
}

/// [`load`] with `options`.
///
/// # Errors
/// As [`load`]; [`Error::InvalidArgument`] for [`ExpertLayout::ExpertParallel`] on a backend
/// without the expert-parallel ops.
///
/// # Examples
/// ```
/// use dist_tensor::models::{self, ExpertLayout, LoadOptions};
/// use dist_tensor::World;
/// let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/models/mixtral");
/// let ids = World::threads(2)?.run(|rank| {
///     let mut all = Vec::new();
///     for experts in [ExpertLayout::TensorParallel, ExpertLayout::ExpertParallel] {
///         let model = models::load_with::<f32>(rank, dir, &LoadOptions { experts })?;
///         all.push(model.generate_greedy(&[1, 5, 9], 4)?);
///     }
///     Ok(all)
/// })?;
/// assert_eq!(ids[0][0], ids[0][1]); // the same tokens either way
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn load_with<'r, T: Element>(
    rank: &'r Rank<'r>,
    dir: impl AsRef<Path>,
    options: &LoadOptions,
) -> Result<Model<'r, T>> {
    let dir = dir.as_ref();
    let me = rank.rank();
    let raw: serde_json::Value = read_config(me, dir)?;
    let arch = raw
        .get("architectures")
        .and_then(|a| a.get(0))
        .and_then(|a| a.as_str())
        .map(str::to_string);
    let model_type = raw.get("model_type").and_then(|t| t.as_str()).unwrap_or("").to_string();
    let path = dir.join(CONFIG);
    let is = |names: &[&str], types: &[&str]| match &arch {
        Some(a) => names.contains(&a.as_str()),
        None => types.contains(&model_type.as_str()),
    };
    if is(LLAMA, LLAMA_TYPES) {
        let config: LlamaConfig = config_from(me, &path, raw)?;
        let weights = Weights::open(rank, dir)?;
        Ok(Model::Llama(Box::new(Llama::from_weights(rank, config, &weights, options)?)))
    } else if is(GPT2, &["gpt2"]) {
        let config: Gpt2Config = config_from(me, &path, raw)?;
        let weights = Weights::open(rank, dir)?;
        Ok(Model::Gpt2(Box::new(Gpt2::from_weights(rank, config, &weights)?)))
    } else {
        let known: Vec<&str> = LLAMA.iter().chain(GPT2).copied().collect();
        Err(weights::ck_error(
            me,
            &path,
            None,
            CheckpointErrorKind::Malformed {
                reason: format!(
                    "unknown architecture {} (model_type {model_type:?}); known: {}",
                    arch.as_deref().map_or("(none)".to_string(), |a| format!("{a:?}")),
                    known.join(", ")
                ),
            },
        ))
    }
}

/// The element type `config.json` says the weights were saved in (`dtype`, or the older
/// `torch_dtype`), if it names one this crate has: to load a model in its own type.
///
/// # Errors
/// [`Error::Checkpoint`] naming `config.json` when it is missing or not JSON.
///
/// # Examples
/// ```
/// use dist_tensor::{DType, models};
/// let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/models/qwen2");
/// assert_eq!(models::saved_dtype(dir)?, Some(DType::BF16));
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn saved_dtype(dir: impl AsRef<Path>) -> Result<Option<DType>> {
    let raw: serde_json::Value = read_config(0, dir.as_ref())?;
    let name = raw.get("dtype").or_else(|| raw.get("torch_dtype")).and_then(|v| v.as_str());
    Ok(match name {
        Some("float32") => Some(DType::F32),
        Some("bfloat16") => Some(DType::BF16),
        Some("float16") => Some(DType::F16),
        Some("float64") => Some(DType::F64),
        _ => None,
    })
}

impl<'r, T: Element> Model<'r, T> {
    /// The logits `[len, vocab]` (f32) of every position of `ids`, the whole prompt without a
    /// cache, on every rank. Collective.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an empty prompt or an id outside the vocabulary (GPT-2: a
    /// prompt longer than its positions); as the collectives.
    pub fn forward(&self, ids: &[u32]) -> Result<Tensor<f32>> {
        match self {
            Model::Llama(m) => m.forward(ids),
            Model::Gpt2(m) => m.forward(ids),
        }
    }

    /// A KV cache for this model on this rank: `blocks` blocks of `block_size` positions (the
    /// same on every rank).
    ///
    /// # Errors
    /// As [`KvCache::new`].
    pub fn kv_cache(&self, blocks: usize, block_size: usize) -> Result<KvCache> {
        match self {
            Model::Llama(m) => m.kv_cache(blocks, block_size),
            Model::Gpt2(m) => m.kv_cache(blocks, block_size),
        }
    }

    /// The logits `[len, vocab]` (f32) of `ids` at the positions after the `cache.len(seq)`
    /// that `seq` holds: a prompt's prefill (after a cached prefix, or from the start), or one
    /// decoded token. The new positions' keys and values join the cache; each query sees the
    /// keys up to its own position. The blocks are reserved before anything runs: a cache too
    /// small is refused with nothing written. Collective.
    ///
    /// # Errors
    /// As [`Model::forward`]; [`Error::OutOfMemory`] when the cache has too few free blocks
    /// (on every rank); [`Error::InvalidArgument`] for a cache made for another model.
    pub fn forward_cached(
        &self,
        cache: &mut KvCache,
        seq: SeqId,
        ids: &[u32],
    ) -> Result<Tensor<f32>> {
        let batch = [(seq, ids.len())];
        match self {
            Model::Llama(m) => m.forward_with(ids, Some((cache, &batch))),
            Model::Gpt2(m) => m.forward_with(ids, Some((cache, &batch))),
        }
    }

    /// [`Model::forward_cached`] of several sequences in one pass (one set of products over all
    /// their new rows, each row's attention over its own sequence): prompts being prefilled
    /// beside tokens being decoded. Their logits, sequence by sequence. The blocks of all are
    /// reserved, or none. Collective.
    ///
    /// # Errors
    /// As [`Model::forward_cached`]; [`Error::InvalidArgument`] for a sequence given twice or
    /// with no token.
    pub fn forward_batch(
        &self,
        cache: &mut KvCache,
        batch: &[(SeqId, &[u32])],
    ) -> Result<Vec<Tensor<f32>>> {
        let ids: Vec<u32> = batch.iter().flat_map(|(_, t)| t.iter().copied()).collect();
        let counts: Vec<(SeqId, usize)> = batch.iter().map(|(s, t)| (*s, t.len())).collect();
        let logits = match self {
            Model::Llama(m) => m.forward_with(&ids, Some((cache, &counts)))?,
            Model::Gpt2(m) => m.forward_with(&ids, Some((cache, &counts)))?,
        }
        .to_host()?;
        let vocab = logits.shape()[1];
        let mut first = 0;
        counts
            .iter()
            .map(|&(_, n)| {
                let rows = logits.as_slice()[first * vocab..(first + n) * vocab].to_vec();
                first += n;
                Tensor::from_shape_vec(&[n, vocab], rows)
            })
            .collect()
    }

    /// [`Model::generate`] for several prompts at once, by continuous batching: each step is
    /// one [`Model::forward_batch`] of the running requests' last tokens and the prefills of
    /// those admitted at that step; a request leaves when done (its blocks freed for the next).
    /// A cache of `blocks` blocks of `options.block_size` positions is shared by all; when the
    /// running requests outgrow it, the one admitted last is preempted (its blocks freed) and
    /// later resumed from its prompt and the tokens it had (recomputed). Request `i` samples
    /// from its own generator, seeded `options.seed + i`: greedy, each request gets the tokens it
    /// gets alone. Collective; every rank returns the same.
    ///
    /// # Errors
    /// As [`Model::forward_batch`]; [`Error::OutOfMemory`] when one request alone does not fit
    /// the cache.
    pub fn generate_batch(
        &self,
        prompts: &[Vec<u32>],
        options: &GenerateOptions,
        blocks: usize,
    ) -> Result<Vec<Vec<u32>>> {
        options.check()?;
        for p in prompts {
            check_ids(0, p)?;
        }
        if options.max_new == 0 {
            return Ok(vec![Vec::new(); prompts.len()]);
        }
        let mut cache = self.kv_cache(blocks, options.block_size)?;
        let bs = options.block_size;
        let mut samplers: Vec<generate::Sampler> = (0..prompts.len())
            .map(|i| {
                let seed = options.seed.wrapping_add(i as u64);
                generate::Sampler::new(&GenerateOptions { seed, ..options.clone() })
            })
            .collect();
        let mut out: Vec<Vec<u32>> = vec![Vec::new(); prompts.len()];
        let mut waiting: std::collections::VecDeque<usize> = (0..prompts.len()).collect();
        // Running requests: index, sequence, the tokens to feed at the next step.
        let mut running: Vec<(usize, SeqId, Vec<u32>)> = Vec::new();
        while !waiting.is_empty() || !running.is_empty() {
            // Admit while the free blocks hold the prompt and a block of growth, beside a block
            // of growth for each running request (the first always: alone, it fits or errs).
            let mut budget = cache.free_blocks().saturating_sub(running.len());
            while let Some(&i) = waiting.front() {
                let feed: Vec<u32> = prompts[i].iter().chain(&out[i]).copied().collect();
                let need = feed.len().div_ceil(bs) + 1;
                if !running.is_empty() && need > budget {
                    break;
                }
                budget = budget.saturating_sub(need);
                waiting.pop_front();
                running.push((i, cache.add_sequence(), feed));
            }
            let batch: Vec<(SeqId, &[u32])> =
                running.iter().map(|(_, s, feed)| (*s, &feed[..])).collect();
            let logits = match self.forward_batch(&mut cache, &batch) {
                Ok(l) => l,
                Err(Error::OutOfMemory { .. }) if running.len() > 1 => {
                    // Preempt the last admitted: its blocks back, its tokens kept.
                    let (i, seq, _) = running.pop().expect("more than one running");
                    cache.remove_sequence(seq);
                    waiting.push_front(i);
                    continue;
                }
                Err(e) => return Err(e),
            };
            let mut still = Vec::with_capacity(running.len());
            for ((i, seq, feed), l) in running.drain(..).zip(logits) {
                let vocab = l.shape()[1];
                let last = &l.as_slice()[(feed.len() - 1) * vocab..];
                let seen: Vec<u32> = prompts[i].iter().chain(&out[i]).copied().collect();
                let token = samplers[i].next(last, &seen);
                out[i].push(token);
                if out[i].len() >= options.max_new || options.stop.contains(&token) {
                    cache.remove_sequence(seq);
                } else {
                    still.push((i, seq, vec![token]));
                }
            }
            running = still;
        }
        Ok(out)
    }

    /// Up to `options.max_new` tokens after `prompt`: the prompt prefilled into a KV cache of
    /// its own, then one token at a time, each picked from the last position's logits as
    /// `options` say (the same on every rank: every rank has the same logits and generator)
    /// and handed to `on_token` as it comes; it ends after a stop token. Collective; every rank
    /// returns the tokens.
    ///
    /// # Errors
    /// As [`GenerateOptions::check`] and [`Model::forward_cached`].
    pub fn generate(
        &self,
        prompt: &[u32],
        options: &GenerateOptions,
        mut on_token: impl FnMut(u32),
    ) -> Result<Vec<u32>> {
        options.check()?;
        check_ids(0, prompt)?;
        let positions = prompt.len() + options.max_new;
        let mut cache =
            self.kv_cache(positions.div_ceil(options.block_size), options.block_size)?;
        let seq = cache.add_sequence();
        let mut sampler = generate::Sampler::new(options);
        let mut seen = prompt.to_vec();
        let mut next: Vec<u32> = prompt.to_vec();
        for _ in 0..options.max_new {
            let logits = self.forward_cached(&mut cache, seq, &next)?.to_host()?;
            let vocab = logits.shape()[1];
            let last = &logits.as_slice()[(next.len() - 1) * vocab..];
            let token = sampler.next(last, &seen);
            seen.push(token);
            on_token(token);
            if options.stop.contains(&token) {
                break;
            }
            next = vec![token];
        }
        Ok(seen.split_off(prompt.len()))
    }

    /// `max_new` tokens after `ids`, each the argmax of the last position's logits (the first on
    /// ties), the whole window recomputed at every step: the reference [`Model::generate`] is
    /// tested against. Collective; every rank returns them.
    ///
    /// # Errors
    /// As [`Model::forward`].
    pub fn generate_greedy(&self, ids: &[u32], max_new: usize) -> Result<Vec<u32>> {
        let mut seq = ids.to_vec();
        for _ in 0..max_new {
            let logits = self.forward(&seq)?.to_host()?;
            let vocab = logits.shape()[1];
            let last = &logits.as_slice()[(seq.len() - 1) * vocab..];
            seq.push(blocks::argmax(last));
        }
        Ok(seq.split_off(ids.len()))
    }

    /// The vocabulary size.
    pub fn vocab_size(&self) -> usize {
        match self {
            Model::Llama(m) => m.config().vocab_size,
            Model::Gpt2(m) => m.config().vocab_size,
        }
    }
}

/// Reads and parses `dir/config.json`.
pub(crate) fn read_config<C: DeserializeOwned>(rank: usize, dir: &Path) -> Result<C> {
    let path = dir.join(CONFIG);
    let text = std::fs::read_to_string(&path).map_err(|e| {
        let kind = if e.kind() == std::io::ErrorKind::NotFound {
            CheckpointErrorKind::MissingFile
        } else {
            CheckpointErrorKind::Io { action: "read".into(), message: e.to_string() }
        };
        weights::ck_error(rank, &path, None, kind)
    })?;
    serde_json::from_str(&text).map_err(|e| {
        weights::ck_error(
            rank,
            &path,
            None,
            CheckpointErrorKind::Malformed { reason: e.to_string() },
        )
    })
}

/// A family's config from the parsed `config.json`.
fn config_from<C: DeserializeOwned>(rank: usize, path: &Path, raw: serde_json::Value) -> Result<C> {
    serde_json::from_value(raw).map_err(|e| {
        weights::ck_error(
            rank,
            path,
            None,
            CheckpointErrorKind::Malformed { reason: e.to_string() },
        )
    })
}

/// Refuses a cache made for another model (its layers, or its values per position).
pub(crate) fn check_cache(rank: usize, cache: &KvCache, layers: usize, width: usize) -> Result<()> {
    if cache.layers() != layers || cache.width() != width {
        return Err(Error::InvalidArgument {
            op: blocks::FWD,
            rank,
            reason: format!(
                "a KV cache of {} layers x {} values per position, for a model of {layers} x {width} \
                 on this rank: make it with the model's kv_cache",
                cache.layers(),
                cache.width()
            ),
        });
    }
    Ok(())
}

/// One sequence's rows in a batched forward pass: the sequence, the positions it held before,
/// its new rows.
pub(crate) type Segment = (SeqId, usize, usize);

/// Checks `batch` (sequences and their new rows, `rows` in all) against `cache` and reserves
/// their blocks (all or none); each segment with the positions it held.
pub(crate) fn plan_batch(
    rank: usize,
    cache: &mut KvCache,
    batch: &[(SeqId, usize)],
    rows: usize,
    (layers, width): (usize, usize),
) -> Result<Vec<Segment>> {
    check_cache(rank, cache, layers, width)?;
    let total: usize = batch.iter().map(|&(_, n)| n).sum();
    if total != rows || batch.iter().any(|&(_, n)| n == 0) {
        return Err(Error::InvalidArgument {
            op: blocks::FWD,
            rank,
            reason: format!(
                "a batch of {} sequences with {total} new tokens for {rows} ids (each sequence at \
                 least one)",
                batch.len()
            ),
        });
    }
    cache.reserve_all(batch)?;
    Ok(batch.iter().map(|&(seq, n)| (seq, cache.len(seq), n)).collect())
}

/// Each row's position: every segment's `held..held + new`.
pub(crate) fn positions(segments: &[Segment]) -> Vec<usize> {
    segments.iter().flat_map(|&(_, held, n)| held..held + n).collect()
}

/// Layer `layer`'s attention of a batch's rows of `qkv`, segment by segment (each over its own
/// sequence's positions).
pub(crate) fn attend_batch<T: Element>(
    cache: &mut KvCache,
    segments: &[Segment],
    layer: usize,
    (qkv, stride, at): (&[f32], usize, [usize; 3]),
    spec: blocks::AttnSpec,
) -> Vec<f32> {
    let mut out = Vec::with_capacity(qkv.len() / stride * spec.q * spec.dim);
    let mut first = 0;
    for &(seq, held, n) in segments {
        let rows = &qkv[first * stride..(first + n) * stride];
        out.extend(attend_cached::<T>(cache, seq, layer, held, (rows, stride, at), spec));
        first += n;
    }
    out
}

/// Layer `layer`'s attention of the new rows of `qkv` (`[len, stride]`, heads at `at`) at
/// positions `offset..`: their keys and values written into `cache` first, then each query
/// over every position up to its own.
pub(crate) fn attend_cached<T: Element>(
    cache: &mut KvCache,
    seq: SeqId,
    layer: usize,
    offset: usize,
    (qkv, stride, at): (&[f32], usize, [usize; 3]),
    spec: blocks::AttnSpec,
) -> Vec<f32> {
    let [q_at, k_at, v_at] = at;
    let (d, w) = (spec.dim, spec.kv * spec.dim);
    let len = qkv.len() / stride;
    for i in 0..len {
        let row = &qkv[i * stride..];
        cache.write(seq, layer, offset + i, &row[k_at..k_at + w], &row[v_at..v_at + w]);
    }
    let cache = &*cache;
    blocks::attention_rows::<T>(
        len,
        offset,
        spec,
        |i, h| &qkv[i * stride + q_at + h * d..][..d],
        |j, h| &cache.keys(seq, layer, j)[h * d..][..d],
        |j, h| &cache.values(seq, layer, j)[h * d..][..d],
    )
}

/// Refuses an empty prompt.
pub(crate) fn check_ids(rank: usize, ids: &[u32]) -> Result<()> {
    if ids.is_empty() {
        return Err(Error::InvalidArgument {
            op: blocks::FWD,
            rank,
            reason: "an empty prompt".into(),
        });
    }
    Ok(())
}
