//! The layers of a small GPT on autograd, tensor- and sequence-parallel (Megatron-LM with
//! sequence parallelism): activations between layers are `[N, E]` (`N = B S` tokens) sharded on
//! rows; [`Embedding`] holds a slice of the vocabulary per rank; [`CausalSelfAttention`] splits
//! the heads over the ranks (Q, K, V through `all_gather_matmul`, the output projection through
//! `matmul_reduce_scatter`) or, in its Ulysses form, trades the token shards for heads with
//! `all_to_all`; [`Mlp`] is a column- then a row-parallel product; the head is vocab-parallel,
//! for [`vocab_parallel_cross_entropy`](super::vocab_parallel_cross_entropy). Every layer is a
//! [`Module`]; [`Gpt`] is the model, built from a seed so that every world size and element type
//! starts from the same weights.

use super::{DVar, Module, Sharing, Var, join};
use crate::tensor::{array_split, split_offsets};
use crate::{Element, Placement, Rank, Result, Tensor};

/// The shape of a [`Gpt`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GptConfig {
    /// Tokens in the vocabulary.
    pub vocab: usize,
    /// Features per token.
    pub embed: usize,
    /// Attention heads.
    pub heads: usize,
    /// Features of the MLP's hidden layer.
    pub hidden: usize,
    /// Blocks.
    pub layers: usize,
    /// Tokens per sequence (the positions learned).
    pub seq_len: usize,
}

/// How attention is spread over the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionForm {
    /// Heads split over ranks: Q, K, V by `all_gather_matmul`, output by `matmul_reduce_scatter`.
    TensorParallel,
    /// Weights replicated; tokens traded for heads by `all_to_all` (DeepSpeed-Ulysses).
    Ulysses,
}

/// `global` cut along `axis` into this rank's part of `sizes`.
fn part<T: Element>(
    global: &Tensor<T>,
    axis: usize,
    sizes: &[usize],
    rank: usize,
) -> Result<Tensor<T>> {
    let start: usize = sizes[..rank].iter().sum();
    Ok(Var::<T>::constant(global.clone()).narrow(axis, start, sizes[rank])?.into_value())
}

/// A seeded `[rows, cols]` weight of scale `1 / sqrt(rows)`, made in f64 and rounded once.
fn init<T: Element>(rows: usize, cols: usize, seed: u64) -> Tensor<T> {
    (Tensor::<f64>::random(&[rows, cols], seed) * (1.0 / (rows as f64).sqrt())).cast()
}

fn ones<'r, T: Element>(n: usize) -> Var<'r, T> {
    Var::param(Tensor::<f64>::zeros(&[n]).map(|_| T::from_f64(1.0)))
}

/// A vocab-parallel embedding: this rank holds rows `start..start + v_r` of the `[V, E]` table.
pub struct Embedding<'r, T: Element> {
    /// This rank's rows of the table.
    pub weight: Var<'r, T>,
    start: usize,
    rank: &'r Rank<'r>,
}

impl<'r, T: Element> Embedding<'r, T> {
    /// This rank's rows of `table` (split as `numpy.array_split`).
    ///
    /// # Errors
    /// [`Error::InvalidShape`](crate::Error::InvalidShape) unless `table` is 2-D.
    pub fn new(rank: &'r Rank<'r>, table: &Tensor<T>) -> Result<Self> {
        let sizes = array_split(table.shape()[0], rank.num_ranks());
        let start = sizes[..rank.rank()].iter().sum();
        Ok(Embedding { weight: Var::param(part(table, 0, &sizes, rank.rank())?), start, rank })
    }

    /// The embeddings of `ids` (every token id, the same on every rank), `[N, E]` sharded on
    /// rows: each rank looks up the ids in its slice (zeros elsewhere), and one reduce-scatter
    /// sums and shards them.
    ///
    /// # Errors
    /// As [`Var::gather_rows`] and the collectives.
    pub fn forward(&self, ids: &[usize]) -> Result<DVar<'r, T>> {
        let v_r = self.weight.shape()[0];
        let local: Vec<Option<usize>> = ids
            .iter()
            .map(|&i| (self.start..self.start + v_r).contains(&i).then(|| i - self.start))
            .collect();
        let rows = self.weight.gather_rows(&local)?;
        DVar::from_var(self.rank, &rows, Placement::Partial)?.redistribute(Placement::Shard(0))
    }
}

/// RMS normalization with a learnable weight (replicated: each rank normalizes its rows).
pub struct RmsNorm<'r, T: Element> {
    /// One value per feature.
    pub weight: Var<'r, T>,
}

impl<'r, T: Element> RmsNorm<'r, T> {
    /// Weights of one.
    pub fn new(features: usize) -> Self {
        RmsNorm { weight: ones(features) }
    }

    /// `x / rms(x) * weight` row by row.
    ///
    /// # Errors
    /// As [`Var::rms_norm`].
    pub fn forward(&self, x: &DVar<'r, T>) -> Result<DVar<'r, T>> {
        x.map(|x| x.rms_norm(Some(&self.weight), 1e-5))
    }
}

/// Layer normalization with a learnable weight and bias (both replicated, as [`RmsNorm`]'s:
/// each rank normalizes its rows, and each weight's gradient is the ranks' partial sums, summed
/// by [`sync_grads`](super::sync_grads)).
///
/// # Examples
/// ```
/// use dist_tensor::autograd::gpt::LayerNorm;
/// use dist_tensor::autograd::{DVar, sync_grads};
/// use dist_tensor::{DistTensor, Placement, Tensor, World};
/// let x = Tensor::<f64>::random(&[5, 4], 1);
/// let grads = World::threads(2)?.run(|rank| {
///     let norm = LayerNorm::<f64>::new(4);
///     let xs = DVar::constant(DistTensor::from_global(rank, &x, Placement::Shard(0))?);
///     let y = norm.forward(&xs)?;
///     (y.local() * y.local()).sum().backward()?; // each rank's rows
///     sync_grads(&norm, rank)?;
///     Ok(norm.bias.grad().unwrap())
/// })?;
/// assert_eq!(grads[0], grads[1]); // summed over the ranks' rows
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub struct LayerNorm<'r, T: Element> {
    /// One scale per feature, ones at first.
    pub weight: Var<'r, T>,
    /// One shift per feature, zeros at first.
    pub bias: Var<'r, T>,
    /// Added to the variance (1e-5, PyTorch's default).
    pub eps: f64,
}

impl<'r, T: Element> LayerNorm<'r, T> {
    /// Weights of one, biases of zero.
    pub fn new(features: usize) -> Self {
        LayerNorm {
            weight: ones(features),
            bias: Var::param(Tensor::zeros(&[features])),
            eps: 1e-5,
        }
    }

    /// `(x - mean(x)) / sqrt(var(x) + eps) * weight + bias` row by row.
    ///
    /// # Errors
    /// As [`Var::layer_norm`].
    pub fn forward(&self, x: &DVar<'r, T>) -> Result<DVar<'r, T>> {
        x.map(|x| x.layer_norm(Some(&self.weight), Some(&self.bias), self.eps))
    }
}

impl<'r, T: Element> Module<'r, T> for LayerNorm<'r, T> {
    fn visit(&self, p: &str, f: &mut dyn FnMut(&str, &Var<'r, T>, Sharing)) {
        f(&join(p, "weight"), &self.weight, Sharing::Replicated);
        f(&join(p, "bias"), &self.bias, Sharing::Replicated);
    }

    fn visit_mut(&mut self, p: &str, f: &mut dyn FnMut(&str, &mut Var<'r, T>, Sharing)) {
        f(&join(p, "weight"), &mut self.weight, Sharing::Replicated);
        f(&join(p, "bias"), &mut self.bias, Sharing::Replicated);
    }
}

impl<'r, T: Element> Module<'r, T> for RmsNorm<'r, T> {
    fn visit(&self, p: &str, f: &mut dyn FnMut(&str, &Var<'r, T>, Sharing)) {
        f(&join(p, "weight"), &self.weight, Sharing::Replicated);
    }

    fn visit_mut(&mut self, p: &str, f: &mut dyn FnMut(&str, &mut Var<'r, T>, Sharing)) {
        f(&join(p, "weight"), &mut self.weight, Sharing::Replicated);
    }
}

/// Causal multi-head self-attention, its heads split over the ranks or (Ulysses) its tokens.
pub struct CausalSelfAttention<'r, T: Element> {
    /// `[E, h D]`: this rank's heads' columns (tensor-parallel) or all (Ulysses); so `k`, `v`.
    pub q: Var<'r, T>,
    /// Keys' projection.
    pub k: Var<'r, T>,
    /// Values' projection.
    pub v: Var<'r, T>,
    /// `[h D, E]`: this rank's heads' rows, or all.
    pub out: Var<'r, T>,
    form: AttentionForm,
    heads: usize,
    head_dim: usize,
    seq_len: usize,
}

impl<'r, T: Element> CausalSelfAttention<'r, T> {
    /// The layer from the global weights `[E, H D]` (q, k, v) and `[H D, E]` (out), cut for this
    /// rank: whole heads per rank (`numpy.array_split` of the heads) in the tensor-parallel
    /// form, everything in the Ulysses form.
    ///
    /// # Errors
    /// As [`Var::narrow`].
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        rank: &Rank<'_>,
        form: AttentionForm,
        heads: usize,
        seq_len: usize,
        [q, k, v, out]: [&Tensor<T>; 4],
    ) -> Result<Self> {
        let head_dim = q.shape()[1] / heads;
        let mine = |t: &Tensor<T>, axis: usize| -> Result<Var<'r, T>> {
            Ok(Var::param(match form {
                AttentionForm::Ulysses => t.clone(),
                AttentionForm::TensorParallel => {
                    let sizes: Vec<usize> =
                        array_split(heads, rank.num_ranks()).iter().map(|h| h * head_dim).collect();
                    part(t, axis, &sizes, rank.rank())?
                }
            }))
        };
        Ok(CausalSelfAttention {
            q: mine(q, 1)?,
            k: mine(k, 1)?,
            v: mine(v, 1)?,
            out: mine(out, 0)?,
            form,
            heads,
            head_dim,
            seq_len,
        })
    }

    /// Attention over whole sequences: `q`, `k`, `v` `[N, h, D]` (all N tokens, h heads here).
    fn attend(&self, q: &Var<'r, T>, k: &Var<'r, T>, v: &Var<'r, T>) -> Result<Var<'r, T>> {
        let (n, h, d) = (q.shape()[0], q.shape()[1], self.head_dim);
        let b = n / self.seq_len.max(1);
        let heads_first =
            |x: &Var<'r, T>| x.reshape(&[b, self.seq_len, h, d])?.permute(&[0, 2, 1, 3]);
        let o = heads_first(q)?.scaled_dot_product_attention(
            &heads_first(k)?,
            &heads_first(v)?,
            true,
        )?;
        o.permute(&[0, 2, 1, 3])?.reshape(&[n, h, d])
    }

    /// `x` `[N, E]` sharded on rows (whole sequences of `seq_len` tokens) to the same.
    ///
    /// # Errors
    /// As the fused ops and [`Var::scaled_dot_product_attention`].
    pub fn forward(&self, x: &DVar<'r, T>) -> Result<DVar<'r, T>> {
        let d = self.head_dim;
        match self.form {
            AttentionForm::TensorParallel => {
                let (q, k, v) = (
                    x.all_gather_matmul(&self.q)?,
                    x.all_gather_matmul(&self.k)?,
                    x.all_gather_matmul(&self.v)?,
                );
                let o = q.map(|q| {
                    let h = q.shape()[1] / d;
                    let split = |t: &Var<'r, T>| t.reshape(&[t.shape()[0], h, d]);
                    let o = self.attend(&split(q)?, &split(k.local())?, &split(v.local())?)?;
                    o.reshape(&[o.shape()[0], h * d])
                })?;
                o.matmul_reduce_scatter(&self.out)
            }
            AttentionForm::Ulysses => {
                let heads = self.heads;
                let project = |w: &Var<'r, T>| -> Result<DVar<'r, T>> {
                    let n = x.value().global_shape()[0];
                    x.map(|x| x.matmul(w))?.reshape(&[n, heads, d])?.all_to_all(1, 0)
                };
                let (q, k, v) = (project(&self.q)?, project(&self.k)?, project(&self.v)?);
                let o = q.map(|q| self.attend(q, k.local(), v.local()))?.all_to_all(0, 1)?;
                let n = o.value().global_shape()[0];
                o.reshape(&[n, heads * d])?.map(|o| o.matmul(&self.out))
            }
        }
    }
}

/// `gelu(x W1) W2`: `W1` split by columns, `W2` by rows.
pub struct Mlp<'r, T: Element> {
    /// `[E, F_r]`.
    pub fc1: Var<'r, T>,
    /// `[F_r, E]`.
    pub fc2: Var<'r, T>,
}

impl<'r, T: Element> Mlp<'r, T> {
    /// This rank's columns of `fc1` and rows of `fc2`.
    ///
    /// # Errors
    /// As [`Var::narrow`].
    pub fn new(rank: &Rank<'_>, fc1: &Tensor<T>, fc2: &Tensor<T>) -> Result<Self> {
        let sizes = array_split(fc1.shape()[1], rank.num_ranks());
        Ok(Mlp {
            fc1: Var::param(part(fc1, 1, &sizes, rank.rank())?),
            fc2: Var::param(part(fc2, 0, &sizes, rank.rank())?),
        })
    }

    /// `x` `[N, E]` sharded on rows to the same.
    ///
    /// # Errors
    /// As the fused ops.
    pub fn forward(&self, x: &DVar<'r, T>) -> Result<DVar<'r, T>> {
        x.all_gather_matmul(&self.fc1)?.map(|h| Ok(h.gelu()))?.matmul_reduce_scatter(&self.fc2)
    }
}

/// A pre-norm block: `x + attn(norm(x))`, then `+ mlp(norm(.))`.
pub struct Block<'r, T: Element> {
    /// Before attention.
    pub norm1: RmsNorm<'r, T>,
    /// Attention.
    pub attn: CausalSelfAttention<'r, T>,
    /// Before the MLP.
    pub norm2: RmsNorm<'r, T>,
    /// The MLP.
    pub mlp: Mlp<'r, T>,
}

/// A GPT: token and position embeddings, blocks, a final norm and a vocab-parallel head.
pub struct Gpt<'r, T: Element> {
    /// Token embedding, vocab-parallel.
    pub embed: Embedding<'r, T>,
    /// Position embedding `[S, E]`, replicated.
    pub pos: Var<'r, T>,
    /// The blocks.
    pub layers: Vec<Block<'r, T>>,
    /// The final norm.
    pub norm: RmsNorm<'r, T>,
    /// `[E, V_r]`: this rank's columns of the head.
    pub head: Var<'r, T>,
    rank: &'r Rank<'r>,
    config: GptConfig,
}

impl<'r, T: Element> Gpt<'r, T> {
    /// The model of `config` with weights drawn from `seed` (the same global weights on every
    /// world and in every element type), cut for this rank.
    ///
    /// # Errors
    /// As the layers' constructors.
    pub fn new(
        rank: &'r Rank<'r>,
        config: GptConfig,
        form: AttentionForm,
        seed: u64,
    ) -> Result<Self> {
        let GptConfig { vocab, embed, heads, hidden, layers, seq_len } = config;
        let table = (Tensor::<f64>::random(&[vocab, embed], seed) * 0.5).cast::<T>();
        let pos = (Tensor::<f64>::random(&[seq_len, embed], seed + 1) * 0.5).cast::<T>();
        let blocks = (0..layers as u64)
            .map(|l| {
                let s = seed + 10 * (l + 1);
                let w = [
                    init(embed, embed, s),
                    init(embed, embed, s + 1),
                    init(embed, embed, s + 2),
                    init(embed, embed, s + 3),
                ];
                Ok(Block {
                    norm1: RmsNorm::new(embed),
                    attn: CausalSelfAttention::new(
                        rank,
                        form,
                        heads,
                        seq_len,
                        [&w[0], &w[1], &w[2], &w[3]],
                    )?,
                    norm2: RmsNorm::new(embed),
                    mlp: Mlp::new(rank, &init(embed, hidden, s + 4), &init(hidden, embed, s + 5))?,
                })
            })
            .collect::<Result<_>>()?;
        let head = init::<T>(embed, vocab, seed + 2);
        let sizes = array_split(vocab, rank.num_ranks());
        Ok(Gpt {
            embed: Embedding::new(rank, &table)?,
            pos: Var::param(pos),
            layers: blocks,
            norm: RmsNorm::new(embed),
            head: Var::param(part(&head, 1, &sizes, rank.rank())?),
            rank,
            config,
        })
    }

    /// The logits `[N, V]` sharded on the vocabulary for `ids`, `B` whole sequences of
    /// `seq_len` tokens one after the other.
    ///
    /// # Errors
    /// As the layers.
    pub fn forward(&self, ids: &[usize]) -> Result<DVar<'r, T>> {
        let mut x = self.embed.forward(ids)?;
        // Each rank adds the positions of its rows.
        let first = split_offsets(x.value().shard_sizes())[self.rank.rank()];
        let s = self.config.seq_len;
        let rows: Vec<Option<usize>> =
            (first..first + x.local().shape()[0]).map(|i| Some(i % s)).collect();
        let pos = self.pos.gather_rows(&rows)?;
        x = x.map(|x| Ok(x + &pos))?;
        for block in &self.layers {
            let a = block.attn.forward(&block.norm1.forward(&x)?)?;
            x = x.zip(&a, |x, a| Ok(x + a))?;
            let m = block.mlp.forward(&block.norm2.forward(&x)?)?;
            x = x.zip(&m, |x, m| Ok(x + m))?;
        }
        self.norm.forward(&x)?.all_gather_matmul(&self.head)
    }
}

impl<'r, T: Element> Module<'r, T> for Block<'r, T> {
    fn visit(&self, p: &str, f: &mut dyn FnMut(&str, &Var<'r, T>, Sharing)) {
        let attn = if self.attn.form == AttentionForm::Ulysses {
            Sharing::Replicated
        } else {
            Sharing::Sharded
        };
        f(&join(p, "norm1.weight"), &self.norm1.weight, Sharing::Replicated);
        f(&join(p, "attn.q.weight"), &self.attn.q, attn);
        f(&join(p, "attn.k.weight"), &self.attn.k, attn);
        f(&join(p, "attn.v.weight"), &self.attn.v, attn);
        f(&join(p, "attn.out.weight"), &self.attn.out, attn);
        f(&join(p, "norm2.weight"), &self.norm2.weight, Sharing::Replicated);
        f(&join(p, "mlp.fc1.weight"), &self.mlp.fc1, Sharing::Sharded);
        f(&join(p, "mlp.fc2.weight"), &self.mlp.fc2, Sharing::Sharded);
    }

    fn visit_mut(&mut self, p: &str, f: &mut dyn FnMut(&str, &mut Var<'r, T>, Sharing)) {
        let attn = if self.attn.form == AttentionForm::Ulysses {
            Sharing::Replicated
        } else {
            Sharing::Sharded
        };
        f(&join(p, "norm1.weight"), &mut self.norm1.weight, Sharing::Replicated);
        f(&join(p, "attn.q.weight"), &mut self.attn.q, attn);
        f(&join(p, "attn.k.weight"), &mut self.attn.k, attn);
        f(&join(p, "attn.v.weight"), &mut self.attn.v, attn);
        f(&join(p, "attn.out.weight"), &mut self.attn.out, attn);
        f(&join(p, "norm2.weight"), &mut self.norm2.weight, Sharing::Replicated);
        f(&join(p, "mlp.fc1.weight"), &mut self.mlp.fc1, Sharing::Sharded);
        f(&join(p, "mlp.fc2.weight"), &mut self.mlp.fc2, Sharing::Sharded);
    }
}

impl<'r, T: Element> Module<'r, T> for Gpt<'r, T> {
    fn visit(&self, p: &str, f: &mut dyn FnMut(&str, &Var<'r, T>, Sharing)) {
        f(&join(p, "embed.weight"), &self.embed.weight, Sharing::Sharded);
        f(&join(p, "pos"), &self.pos, Sharing::Replicated);
        self.layers.visit(&join(p, "layers"), f);
        f(&join(p, "norm.weight"), &self.norm.weight, Sharing::Replicated);
        f(&join(p, "head.weight"), &self.head, Sharing::Sharded);
    }

    fn visit_mut(&mut self, p: &str, f: &mut dyn FnMut(&str, &mut Var<'r, T>, Sharing)) {
        f(&join(p, "embed.weight"), &mut self.embed.weight, Sharing::Sharded);
        f(&join(p, "pos"), &mut self.pos, Sharing::Replicated);
        self.layers.visit_mut(&join(p, "layers"), f);
        f(&join(p, "norm.weight"), &mut self.norm.weight, Sharing::Replicated);
        f(&join(p, "head.weight"), &mut self.head, Sharing::Sharded);
    }
}
