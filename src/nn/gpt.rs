//! The layers of a small GPT on autograd, tensor- and sequence-parallel (Megatron-LM with
//! sequence parallelism): activations between layers are `[N, E]` (`N = B S` tokens) sharded on
//! rows; [`Embedding`] holds a slice of the vocabulary per rank; [`CausalSelfAttention`] splits
//! the heads over the ranks (Q, K, V through `all_gather_matmul`, the output projection through
//! `matmul_reduce_scatter`) or, in its Ulysses form, trades the token shards for heads with
//! `all_to_all`; [`Mlp`] is a column- then a row-parallel product; the head is vocab-parallel,
//! for [`vocab_parallel_cross_entropy`](crate::autograd::vocab_parallel_cross_entropy). Every
//! layer is a [`Module`] of [`Param`]s; [`Gpt`] is the model, built from a seed so that every
//! world size and element type starts from the same weights. A model holds no rank: it is
//! `Send`, leaves [`World::run`](crate::World::run), and its forward pass takes the rank.
//!
//! # Examples
//! A model trained in one run and returned out of it:
//! ```
//! use dist_tensor::autograd::vocab_parallel_cross_entropy;
//! use dist_tensor::nn::gpt::{AttentionForm, Gpt, GptConfig};
//! use dist_tensor::nn::{Adam, Module};
//! use dist_tensor::World;
//! let config = GptConfig { vocab: 7, embed: 8, heads: 2, hidden: 16, layers: 1, seq_len: 4 };
//! let models = World::threads(2)?.run(|rank| {
//!     let mut gpt = Gpt::<f32>::new(rank, config, AttentionForm::TensorParallel, 1)?;
//!     let mut adam = Adam::new(1e-2);
//!     let ids = [1, 2, 3, 4, 5, 6, 0, 1];
//!     let targets: Vec<Option<usize>> = ids.iter().map(|&i| Some((i + 1) % 7)).collect();
//!     let loss = vocab_parallel_cross_entropy(&gpt.forward(rank, &ids)?, &targets)?;
//!     loss.backward()?;
//!     adam.step(gpt.parameters_mut())?;
//!     Ok(gpt)
//! })?;
//! assert_eq!(models.len(), 2); // each rank's part of the model, outside the world
//! # Ok::<(), dist_tensor::Error>(())
//! ```

use crate::autograd::{DVar, Var};
use crate::nn::{Module, Param, join};
use crate::tensor::{array_split, split_offsets};
use crate::{Element, Error, Placement, Rank, Result, Tensor};

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

fn ones<T: Element>(n: usize) -> Param<T> {
    Param::new(Tensor::<f64>::zeros(&[n]).map(|_| T::from_f64(1.0)))
}

/// A vocab-parallel embedding: this rank holds rows `start..start + v_r` of the `[V, E]` table.
pub struct Embedding<T: Element> {
    /// This rank's rows of the table.
    pub weight: Param<T>,
    start: usize,
    vocab: usize,
}

impl<T: Element> Embedding<T> {
    /// This rank's rows of `table` (split as `numpy.array_split`).
    ///
    /// # Errors
    /// [`Error::InvalidShape`] unless `table` is 2-D.
    pub fn new(rank: &Rank<'_>, table: &Tensor<T>) -> Result<Self> {
        if table.ndim() != 2 {
            return Err(Error::InvalidShape {
                op: "Embedding::new",
                reason: format!("a table of shape {:?}: it must be [vocab, embed]", table.shape()),
            });
        }
        let vocab = table.shape()[0];
        let sizes = array_split(vocab, rank.num_ranks());
        let start = sizes[..rank.rank()].iter().sum();
        let weight = Param::sharded(part(table, 0, &sizes, rank.rank())?, 0);
        Ok(Embedding { weight, start, vocab })
    }

    /// The embeddings of `ids` (every token id, the same on every rank), `[N, E]` sharded on
    /// rows: each rank looks up the ids in its slice (zeros elsewhere), and one reduce-scatter
    /// sums and shards them.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an id not below the vocabulary (on every rank: the ids are
    /// the same on each); as [`Var::gather_rows`] and the collectives.
    pub fn forward<'r>(&self, rank: &'r Rank<'r>, ids: &[usize]) -> Result<DVar<'r, T>> {
        if let Some((at, &id)) = ids.iter().enumerate().find(|&(_, &id)| id >= self.vocab) {
            return Err(Error::InvalidArgument {
                op: "Embedding::forward",
                rank: rank.rank(),
                reason: format!(
                    "token id {id} at position {at} is out of range: the vocabulary has {} ids",
                    self.vocab
                ),
            });
        }
        let v_r = self.weight.value().shape()[0];
        let local: Vec<Option<usize>> = ids
            .iter()
            .map(|&i| (self.start..self.start + v_r).contains(&i).then(|| i - self.start))
            .collect();
        let rows = self.weight.var().gather_rows(&local)?;
        DVar::from_var(rank, &rows, Placement::Partial)?.redistribute(Placement::Shard(0))
    }
}

/// RMS normalization with a learnable weight (replicated: each rank normalizes its rows).
pub struct RmsNorm<T: Element> {
    /// One value per feature.
    pub weight: Param<T>,
}

impl<T: Element> RmsNorm<T> {
    /// Weights of one.
    pub fn new(features: usize) -> Self {
        RmsNorm { weight: ones(features) }
    }

    /// `x / rms(x) * weight` row by row.
    ///
    /// # Errors
    /// As [`Var::rms_norm`].
    pub fn forward<'r>(&self, x: &DVar<'r, T>) -> Result<DVar<'r, T>> {
        let w = self.weight.var();
        x.map(|x| x.rms_norm(Some(&w), 1e-5))
    }
}

/// Layer normalization with a learnable weight and bias (both replicated, as [`RmsNorm`]'s:
/// each rank normalizes its rows, and each weight's gradient is the ranks' partial sums, summed
/// by [`sync_grads`](crate::nn::sync_grads)).
///
/// # Examples
/// ```
/// use dist_tensor::nn::gpt::LayerNorm;
/// use dist_tensor::nn::sync_grads;
/// use dist_tensor::autograd::DVar;
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
pub struct LayerNorm<T: Element> {
    /// One scale per feature, ones at first.
    pub weight: Param<T>,
    /// One shift per feature, zeros at first.
    pub bias: Param<T>,
    /// Added to the variance (1e-5, PyTorch's default).
    pub eps: f64,
}

impl<T: Element> LayerNorm<T> {
    /// Weights of one, biases of zero.
    pub fn new(features: usize) -> Self {
        LayerNorm {
            weight: ones(features),
            bias: Param::new(Tensor::zeros(&[features])),
            eps: 1e-5,
        }
    }

    /// `(x - mean(x)) / sqrt(var(x) + eps) * weight + bias` row by row.
    ///
    /// # Errors
    /// As [`Var::layer_norm`].
    pub fn forward<'r>(&self, x: &DVar<'r, T>) -> Result<DVar<'r, T>> {
        let (w, b) = (self.weight.var(), self.bias.var());
        x.map(|x| x.layer_norm(Some(&w), Some(&b), self.eps))
    }
}

crate::impl_module!(LayerNorm<T> { weight, bias });
crate::impl_module!(RmsNorm<T> { weight });
crate::impl_module!(Embedding<T> { weight });

/// Causal multi-head self-attention, its heads split over the ranks or (Ulysses) its tokens.
pub struct CausalSelfAttention<T: Element> {
    /// `[E, h D]`: this rank's heads' columns (tensor-parallel) or all (Ulysses); so `k`, `v`.
    pub q: Param<T>,
    /// Keys' projection.
    pub k: Param<T>,
    /// Values' projection.
    pub v: Param<T>,
    /// `[h D, E]`: this rank's heads' rows, or all.
    pub out: Param<T>,
    form: AttentionForm,
    heads: usize,
    head_dim: usize,
    seq_len: usize,
}

impl<T: Element> CausalSelfAttention<T> {
    /// The layer from the global weights `[E, H D]` (q, k, v) and `[H D, E]` (out), cut for this
    /// rank: whole heads per rank (`numpy.array_split` of the heads) in the tensor-parallel
    /// form, everything in the Ulysses form.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] when the projections are not `[E, H D]` and `[H D, E]` of one
    /// `E`, or their width `H D` does not divide by the heads (the heads would drop columns);
    /// as [`Var::narrow`].
    pub fn new(
        rank: &Rank<'_>,
        form: AttentionForm,
        heads: usize,
        seq_len: usize,
        [q, k, v, out]: [&Tensor<T>; 4],
    ) -> Result<Self> {
        let op = "CausalSelfAttention::new";
        let width = match q.shape() {
            &[_, w] if heads > 0 && w.is_multiple_of(heads) && w > 0 => w,
            s => {
                return Err(Error::InvalidShape {
                    op,
                    reason: format!(
                        "a query projection of shape {s:?} for {heads} heads: its width must                          divide by the heads into whole heads"
                    ),
                });
            }
        };
        let e = q.shape()[0];
        for (name, t, want) in
            [("k", k, [e, width]), ("v", v, [e, width]), ("out", out, [width, e])]
        {
            if t.shape() != want {
                return Err(Error::InvalidShape {
                    op,
                    reason: format!("{name} is {:?}; it must be {want:?}", t.shape()),
                });
            }
        }
        let head_dim = width / heads;
        let mine = |t: &Tensor<T>, axis: usize| -> Result<Param<T>> {
            Ok(match form {
                AttentionForm::Ulysses => Param::new(t.clone()),
                AttentionForm::TensorParallel => {
                    let sizes: Vec<usize> =
                        array_split(heads, rank.num_ranks()).iter().map(|h| h * head_dim).collect();
                    Param::sharded(part(t, axis, &sizes, rank.rank())?, axis)
                }
            })
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
    fn attend<'r>(&self, q: &Var<'r, T>, k: &Var<'r, T>, v: &Var<'r, T>) -> Result<Var<'r, T>> {
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
    pub fn forward<'r>(&self, x: &DVar<'r, T>) -> Result<DVar<'r, T>> {
        let d = self.head_dim;
        let [wq, wk, wv, wo] = [&self.q, &self.k, &self.v, &self.out].map(Param::var);
        match self.form {
            AttentionForm::TensorParallel => {
                let (q, k, v) = (
                    x.all_gather_matmul(&wq)?,
                    x.all_gather_matmul(&wk)?,
                    x.all_gather_matmul(&wv)?,
                );
                let o = q.map(|q| {
                    let h = q.shape()[1] / d;
                    let split = |t: &Var<'r, T>| t.reshape(&[t.shape()[0], h, d]);
                    let o = self.attend(&split(q)?, &split(k.local())?, &split(v.local())?)?;
                    o.reshape(&[o.shape()[0], h * d])
                })?;
                o.matmul_reduce_scatter(&wo)
            }
            AttentionForm::Ulysses => {
                let heads = self.heads;
                let project = |w: &Var<'r, T>| -> Result<DVar<'r, T>> {
                    let n = x.value().global_shape()[0];
                    x.map(|x| x.matmul(w))?.reshape(&[n, heads, d])?.all_to_all(1, 0)
                };
                let (q, k, v) = (project(&wq)?, project(&wk)?, project(&wv)?);
                let o = q.map(|q| self.attend(q, k.local(), v.local()))?.all_to_all(0, 1)?;
                let n = o.value().global_shape()[0];
                o.reshape(&[n, heads * d])?.map(|o| o.matmul(&wo))
            }
        }
    }
}

/// `gelu(x W1) W2`: `W1` split by columns, `W2` by rows.
pub struct Mlp<T: Element> {
    /// `[E, F_r]`.
    pub fc1: Param<T>,
    /// `[F_r, E]`.
    pub fc2: Param<T>,
}

impl<T: Element> Mlp<T> {
    /// This rank's columns of `fc1` and rows of `fc2`.
    ///
    /// # Errors
    /// As [`Var::narrow`].
    pub fn new(rank: &Rank<'_>, fc1: &Tensor<T>, fc2: &Tensor<T>) -> Result<Self> {
        let sizes = array_split(fc1.shape()[1], rank.num_ranks());
        Ok(Mlp {
            fc1: Param::sharded(part(fc1, 1, &sizes, rank.rank())?, 1),
            fc2: Param::sharded(part(fc2, 0, &sizes, rank.rank())?, 0),
        })
    }

    /// `x` `[N, E]` sharded on rows to the same.
    ///
    /// # Errors
    /// As the fused ops.
    pub fn forward<'r>(&self, x: &DVar<'r, T>) -> Result<DVar<'r, T>> {
        x.all_gather_matmul(&self.fc1.var())?
            .map(|h| Ok(h.gelu()))?
            .matmul_reduce_scatter(&self.fc2.var())
    }
}

/// A pre-norm block: `x + attn(norm(x))`, then `+ mlp(norm(.))`.
pub struct Block<T: Element> {
    /// Before attention.
    pub norm1: RmsNorm<T>,
    /// Attention.
    pub attn: CausalSelfAttention<T>,
    /// Before the MLP.
    pub norm2: RmsNorm<T>,
    /// The MLP.
    pub mlp: Mlp<T>,
}

/// A GPT: token and position embeddings, blocks, a final norm and a vocab-parallel head.
pub struct Gpt<T: Element> {
    /// Token embedding, vocab-parallel.
    pub embed: Embedding<T>,
    /// Position embedding `[S, E]`, replicated.
    pub pos: Param<T>,
    /// The blocks.
    pub layers: Vec<Block<T>>,
    /// The final norm.
    pub norm: RmsNorm<T>,
    /// `[E, V_r]`: this rank's columns of the head.
    pub head: Param<T>,
    config: GptConfig,
}

impl<T: Element> Gpt<T> {
    /// The model of `config` with weights drawn from `seed` (the same global weights on every
    /// world and in every element type), cut for this rank.
    ///
    /// # Errors
    /// As the layers' constructors.
    pub fn new(rank: &Rank<'_>, config: GptConfig, form: AttentionForm, seed: u64) -> Result<Self> {
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
            pos: Param::new(pos),
            layers: blocks,
            norm: RmsNorm::new(embed),
            head: Param::sharded(part(&head, 1, &sizes, rank.rank())?, 1),
            config,
        })
    }

    /// The shape it was built with.
    pub fn config(&self) -> GptConfig {
        self.config
    }

    /// The logits `[N, V]` sharded on the vocabulary for `ids`, `B` whole sequences of
    /// `seq_len` tokens one after the other.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] unless `ids` are whole sequences; as the layers (a token id out
    /// of the vocabulary: [`Embedding::forward`]).
    pub fn forward<'r>(&self, rank: &'r Rank<'r>, ids: &[usize]) -> Result<DVar<'r, T>> {
        let s = self.config.seq_len;
        if ids.is_empty() || !ids.len().is_multiple_of(s) {
            return Err(Error::InvalidShape {
                op: "Gpt::forward",
                reason: format!("{} token ids: whole sequences of {s} tokens", ids.len()),
            });
        }
        let mut x = self.embed.forward(rank, ids)?;
        // Each rank adds the positions of its rows.
        let first = split_offsets(x.value().shard_sizes())[rank.rank()];
        let rows: Vec<Option<usize>> =
            (first..first + x.local().shape()[0]).map(|i| Some(i % s)).collect();
        let pos = self.pos.var().gather_rows(&rows)?;
        x = x.map(|x| Ok(x + &pos))?;
        for block in &self.layers {
            let a = block.attn.forward(&block.norm1.forward(&x)?)?;
            x = x.zip(&a, |x, a| Ok(x + a))?;
            let m = block.mlp.forward(&block.norm2.forward(&x)?)?;
            x = x.zip(&m, |x, m| Ok(x + m))?;
        }
        self.norm.forward(&x)?.all_gather_matmul(&self.head.var())
    }
}

/// Attention's projections named as linear layers' weights (`q.weight`, ..., `out.weight`).
impl<T: Element> Module<T> for CausalSelfAttention<T> {
    fn visit<'s>(&'s self, p: &str, f: &mut dyn FnMut(&str, &'s Param<T>)) {
        for (name, w) in [("q", &self.q), ("k", &self.k), ("v", &self.v), ("out", &self.out)] {
            f(&join(p, &join(name, "weight")), w);
        }
    }

    fn visit_mut<'s>(&'s mut self, p: &str, f: &mut dyn FnMut(&str, &'s mut Param<T>)) {
        let [q, k, v, out] = [&mut self.q, &mut self.k, &mut self.v, &mut self.out];
        for (name, w) in [("q", q), ("k", k), ("v", v), ("out", out)] {
            f(&join(p, &join(name, "weight")), w);
        }
    }
}

/// The MLP's two products named as linear layers' weights (`fc1.weight`, `fc2.weight`).
impl<T: Element> Module<T> for Mlp<T> {
    fn visit<'s>(&'s self, p: &str, f: &mut dyn FnMut(&str, &'s Param<T>)) {
        f(&join(p, "fc1.weight"), &self.fc1);
        f(&join(p, "fc2.weight"), &self.fc2);
    }

    fn visit_mut<'s>(&'s mut self, p: &str, f: &mut dyn FnMut(&str, &'s mut Param<T>)) {
        f(&join(p, "fc1.weight"), &mut self.fc1);
        f(&join(p, "fc2.weight"), &mut self.fc2);
    }
}

crate::impl_module!(Block<T> { norm1, attn, norm2, mlp });

/// The head named as a linear layer's weight (`head.weight`).
impl<T: Element> Module<T> for Gpt<T> {
    fn visit<'s>(&'s self, p: &str, f: &mut dyn FnMut(&str, &'s Param<T>)) {
        self.embed.visit(&join(p, "embed"), f);
        f(&join(p, "pos"), &self.pos);
        self.layers.visit(&join(p, "layers"), f);
        self.norm.visit(&join(p, "norm"), f);
        f(&join(p, "head.weight"), &self.head);
    }

    fn visit_mut<'s>(&'s mut self, p: &str, f: &mut dyn FnMut(&str, &'s mut Param<T>)) {
        self.embed.visit_mut(&join(p, "embed"), f);
        f(&join(p, "pos"), &mut self.pos);
        self.layers.visit_mut(&join(p, "layers"), f);
        self.norm.visit_mut(&join(p, "norm"), f);
        f(&join(p, "head.weight"), &mut self.head);
    }
}
