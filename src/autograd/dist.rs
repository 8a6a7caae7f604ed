//! [`DVar`]: a [`DistTensor`] in a differentiable computation, its ops recording their duals
//! (the table and what a gradient means per placement are on [`DVar`]).

use super::Var;
use super::graph::LeafHook;
use super::var::record;
use crate::{DistTensor, Element, MatmulOptions, Placement, Result, Tensor};

/// A [`DistTensor`] that may be tracked: this rank's part is a [`Var`], the rest is the
/// `DistTensor`'s layout. Every distributed op records its dual, so the backward pass runs
/// through the same fused kernels as the forward pass:
///
/// | forward | backward |
/// | --- | --- |
/// | `all_gather_matmul(x, w)` | `dx = matmul_reduce_scatter(dh, w^T)` (w read transposed), `dw = X^T dh` with `X` the rows the forward gathered |
/// | `matmul_reduce_scatter(a, w)` | `da = all_gather_matmul(dy, w^T)`, `dw = a^T dY` with `dY` the rows that gathered |
/// | `all_to_all(s, g)` | `all_to_all(g, s)` |
/// | `redistribute`: all_gather / all_to_all / reduce_scatter / all_reduce / local slices | reduce_scatter / all_to_all back / all_gather / all_reduce / local slices |
///
/// **What a gradient means per placement.** The loss is one scalar for the whole world. The
/// gradient of a `Shard` value is sharded as the value (each rank holds the gradient of its
/// shard). The gradient of a `Replicate` value is held as partial sums (the sum over ranks is the
/// gradient): every rank uses the replicated value in its own part of the computation, and its
/// part of the gradient is what that use contributes. The gradient of a `Partial` value is the
/// whole gradient on every rank (each summand gets all of it). [`DVar::backward`] on a replicated
/// loss therefore seeds 1 on rank 0 and 0 on the others; a replicated parameter's gradient is
/// summed over ranks by [`DVar::grad_reduced`].
///
/// # Examples
/// ```
/// use dist_tensor::autograd::{DVar, Var};
/// use dist_tensor::{DistTensor, Placement, Tensor, World};
/// let (x, w) = (Tensor::<f64>::random(&[6, 4], 1), Tensor::<f64>::random(&[4, 3], 2));
/// let grads = World::threads(2)?.run(|rank| {
///     let x = DVar::constant(DistTensor::from_global(rank, &x, Placement::Shard(0))?);
///     let w_r = Var::param(DistTensor::from_global(rank, &w, Placement::Shard(1))?.into_local());
///     let h = x.all_gather_matmul(&w_r)?; // [6, 3] sharded on columns
///     let hl = h.local(); // this rank's columns: the loss is the sum of the ranks' parts
///     (hl * hl).sum().backward()?; // collective: every rank runs its part of the pass
///     Ok(w_r.grad().unwrap())
/// })?;
/// // d sum((x w)^2) / dw = 2 x^T (x w), column-sharded.
/// let want = x.transpose(0, 1)?.matmul(&x.matmul(&w)?)? * 2.0;
/// assert!((grads[0].as_slice()[0] - want.as_slice()[0]).abs() < 1e-12);
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub struct DVar<'r, T: Element> {
    value: DistTensor<'r, T>,
    local: Var<'r, T>,
}

impl<T: Element> Clone for DVar<'_, T> {
    fn clone(&self) -> Self {
        DVar { value: self.value.clone(), local: self.local.clone() }
    }
}

impl<'r, T: Element> DVar<'r, T> {
    /// An untracked distributed value.
    pub fn constant(value: DistTensor<'r, T>) -> Self {
        let local = Var::constant(value.local().clone());
        DVar { value, local }
    }

    /// A tracked leaf: this rank's part is a parameter.
    pub fn param(value: DistTensor<'r, T>) -> Self {
        let local = Var::param(value.local().clone());
        DVar { value, local }
    }

    /// `local`, this rank's part (tracked or not, and then its gradient flows back into it),
    /// under `placement`. Collective, as [`DistTensor::from_local`].
    ///
    /// # Errors
    /// As [`DistTensor::from_local`].
    pub fn from_var(
        rank: &'r crate::Rank<'r>,
        local: &Var<'r, T>,
        placement: Placement,
    ) -> Result<Self> {
        let value = DistTensor::from_local(rank, local.value().clone(), placement)?;
        Ok(DVar { value, local: local.clone() })
    }

    /// A value and its part's variable, which the caller knows to agree.
    pub(crate) fn from_parts(value: DistTensor<'r, T>, local: Var<'r, T>) -> Self {
        DVar { value, local }
    }

    /// The distributed value.
    pub fn value(&self) -> &DistTensor<'r, T> {
        &self.value
    }

    /// This rank's part, as a [`Var`] (its gradient is this rank's part of the gradient).
    pub fn local(&self) -> &Var<'r, T> {
        &self.local
    }

    /// The placement.
    pub fn placement(&self) -> Placement {
        self.value.placement()
    }

    /// Whether it is tracked.
    pub fn is_tracked(&self) -> bool {
        self.local.is_tracked()
    }

    /// This rank's part of the accumulated gradient of a leaf (see [`DVar`] for what it means
    /// per placement).
    pub fn grad(&self) -> Option<Tensor<T>> {
        self.local.grad()
    }

    /// The gradient of a leaf as the value is placed: for `Replicate`, the partial sums of the
    /// ranks all-reduced (collective; every rank must call it); otherwise [`DVar::grad`].
    /// Zeros where no gradient reached this rank.
    ///
    /// # Errors
    /// As [`DistTensor::redistribute`].
    pub fn grad_reduced(&self) -> Result<Tensor<T>> {
        let g = self.local.grad().unwrap_or_else(|| Tensor::zeros(self.value.local().shape()));
        if self.placement() != Placement::Replicate {
            return Ok(g);
        }
        let partial = DistTensor::from_local(self.value.rank(), g, Placement::Partial)?;
        Ok(partial.redistribute(Placement::Replicate)?.into_local())
    }

    /// Forgets the accumulated gradient.
    pub fn zero_grad(&self) {
        self.local.zero_grad();
    }

    /// A local computation on this rank's part (any [`Var`] ops); the placement stays, and the
    /// result follows the rules of [`DistTensor::map_local`] (a sharded dimension keeps its
    /// size).
    ///
    /// # Errors
    /// `f`'s error; as [`DistTensor::map_local`].
    pub fn map(&self, f: impl FnOnce(&Var<'r, T>) -> Result<Var<'r, T>>) -> Result<DVar<'r, T>> {
        let local = f(&self.local)?;
        let value = self.value.map_local(|_| local.value().clone())?;
        Ok(DVar { value, local })
    }

    /// A local computation on this rank's parts of `self` and `other` (laid out alike, as
    /// [`DistTensor::zip_local`] needs): a residual add.
    ///
    /// # Errors
    /// `f`'s error; as [`DistTensor::zip_local`].
    pub fn zip(
        &self,
        other: &DVar<'r, T>,
        f: impl FnOnce(&Var<'r, T>, &Var<'r, T>) -> Result<Var<'r, T>>,
    ) -> Result<DVar<'r, T>> {
        let local = f(&self.local, &other.local)?;
        let value = self.value.zip_local(&other.value, |_, _| local.value().clone())?;
        Ok(DVar { value, local })
    }

    /// [`DistTensor::reshape`], differentiated.
    ///
    /// # Errors
    /// As [`DistTensor::reshape`].
    pub fn reshape(&self, shape: &[usize]) -> Result<DVar<'r, T>> {
        let value = self.value.reshape(shape)?;
        let local = self.local.reshape(value.local().shape())?;
        Ok(DVar { value, local })
    }

    /// A result `value` of `self`'s part, tracked when `self` is; `backward` maps the result's
    /// gradient (a `DistTensor` placed as `value`) to `self`'s part's gradient.
    fn dual(
        &self,
        value: DistTensor<'r, T>,
        backward: impl FnOnce(DistTensor<'r, T>) -> Result<Tensor<T>> + 'r,
    ) -> DVar<'r, T> {
        let like = value.clone();
        let local = record(value.local().clone(), &[&self.local], move |g, _| {
            let g = like.map_local(|_| g.clone())?;
            Ok(vec![Some(backward(g)?)])
        });
        DVar { value, local }
    }

    /// `all_gather(self) @ w`, fused ([`DistTensor::all_gather_matmul`]), with `w` this rank's
    /// columns of the weight. The backward pass: `dx = matmul_reduce_scatter(dh, w^T)` reading
    /// `w` transposed in place, split back as `self` was; `dw = X^T dh` with the rows the forward
    /// gathered (kept only when `w` is tracked).
    ///
    /// # Errors
    /// As [`DistTensor::all_gather_matmul_keep_input`].
    pub fn all_gather_matmul(&self, w: &Var<'r, T>) -> Result<DVar<'r, T>> {
        self.all_gather_matmul_fused(w, true)
    }

    /// [`DVar::all_gather_matmul`], with `fused == false` running the unfused baselines (all_gather,
    /// then the product; the product, then reduce_scatter) forward and backward: what
    /// [`nn`](crate::nn)'s layers do after `.fused(false)`.
    pub(crate) fn all_gather_matmul_fused(
        &self,
        w: &Var<'r, T>,
        fused: bool,
    ) -> Result<DVar<'r, T>> {
        let base = MatmulOptions::new().unfused(!fused);
        if !self.is_tracked() && !w.is_tracked() {
            let mut h = self.value.all_gather_matmul_with(&[w.value()], &base)?;
            return Ok(DVar::constant(h.remove(0)));
        }
        let (mut h, gathered) = self.value.all_gather_matmul_keep_input(&[w.value()], &base)?;
        let h = h.remove(0);
        let like = h.clone();
        let x = self.value.clone();
        let wv = w.value().clone();
        // Two nodes: the input's gradient, recorded first, and the weight's, recorded after it
        // and so run before it in the backward pass. The weight's gradient is then complete (and
        // a hook of its leaf told, see `Recorded::backward_hooked`) before the input's exchange
        // and product start: data parallelism sends it while they run. The same products as
        // one node computing both, in the other order: the same bits.
        let input_side = record(h.local().clone(), &[&self.local], move |g, _| {
            let dh = like.map_local(|_| g.clone())?;
            // dh's whole rows on this rank's columns: dx is the sum over ranks, scattered back
            // into x's rows (x's dimension and sizes).
            let (dim, sizes) = match x.placement() {
                Placement::Shard(d) => (d, x.shard_sizes().to_vec()),
                _ => (0, Vec::new()),
            };
            let opts = base.transpose_weights(true);
            let opts = if sizes.is_empty() { opts } else { opts.output_split(dim, sizes) };
            let dx = dh.matmul_reduce_scatter_with(&wv, &opts)?;
            Ok(vec![Some(dx.into_local())])
        });
        if !w.is_tracked() {
            return Ok(DVar { value: h, local: input_side });
        }
        let threads = h.rank().topology().aicore_num();
        let local = record(h.local().clone(), &[&input_side, w], move |g, need| {
            let dw = weight_grad(gathered.local(), g, threads)?;
            // The whole output gradient goes on to the input's node (nothing when the input is
            // untracked: that node records nothing then).
            Ok(vec![need[0].then(|| g.clone()), Some(dw)])
        });
        Ok(DVar { value: h, local })
    }

    /// `reduce_scatter(self @ w)`, fused ([`DistTensor::matmul_reduce_scatter`]), with `self`
    /// sharded on its last dimension and `w` this rank's rows of the weight. The backward pass:
    /// `da = all_gather_matmul(dy, w^T)` reading `w` transposed, `dw = a^T dY` with the rows of
    /// `dy` that op gathered.
    ///
    /// # Errors
    /// As [`DistTensor::matmul_reduce_scatter`].
    pub fn matmul_reduce_scatter(&self, w: &Var<'r, T>) -> Result<DVar<'r, T>> {
        self.matmul_reduce_scatter_fused(w, true)
    }

    /// [`DVar::matmul_reduce_scatter`], with `fused == false` running the unfused baselines
    /// forward and backward (as [`DVar::all_gather_matmul_fused`]).
    pub(crate) fn matmul_reduce_scatter_fused(
        &self,
        w: &Var<'r, T>,
        fused: bool,
    ) -> Result<DVar<'r, T>> {
        let base = MatmulOptions::new().unfused(!fused);
        let y = self.value.matmul_reduce_scatter_with(w.value(), &base)?;
        let like = y.clone();
        let (a, wv) = (self.local.value().clone(), w.value().clone());
        let local = record(y.local().clone(), &[&self.local, w], move |g, need| {
            let dy = like.map_local(|_| g.clone())?;
            let opts = base.transpose_weights(true);
            let (mut da, dyg) = dy.all_gather_matmul_keep_input(&[&wv], &opts)?;
            let da = da.remove(0).into_local();
            let dw = if need[1] {
                Some(weight_grad(&a, dyg.local(), dyg.rank().topology().aicore_num())?)
            } else {
                None
            };
            Ok(vec![need[0].then_some(da), dw])
        });
        Ok(DVar { value: y, local })
    }

    /// [`DistTensor::all_to_all`]; the backward pass is the reverse all_to_all, split back as
    /// `self` was.
    ///
    /// # Errors
    /// As [`DistTensor::all_to_all`].
    pub fn all_to_all(&self, scatter_dim: usize, gather_dim: usize) -> Result<DVar<'r, T>> {
        let y = self.value.all_to_all(scatter_dim, gather_dim)?;
        if !self.is_tracked() {
            return Ok(DVar::constant(y));
        }
        let sizes = self.value.shard_sizes().to_vec();
        Ok(self.dual(y, move |g| {
            let back = g.all_to_all(gather_dim, scatter_dim)?;
            let back = if back.shard_sizes() == sizes.as_slice() {
                back
            } else {
                back.redistribute_split(gather_dim, sizes)?
            };
            Ok(back.into_local())
        }))
    }

    /// `self` sharded on `dim` cut into `sizes` ([`DistTensor::redistribute_split`]; nothing
    /// when it is cut so already); the backward pass cuts the gradient back as `self` was.
    /// Collective.
    pub(crate) fn resplit(&self, dim: usize, sizes: &[usize]) -> Result<DVar<'r, T>> {
        if self.value.placement() == Placement::Shard(dim) && self.value.shard_sizes() == sizes {
            return Ok(self.clone());
        }
        let y = self.value.redistribute_split(dim, sizes.to_vec())?;
        if !self.is_tracked() {
            return Ok(DVar::constant(y));
        }
        let back = match self.value.placement() {
            Placement::Shard(i) => Some((i, self.value.shard_sizes().to_vec())),
            _ => None,
        };
        let from = self.value.clone();
        Ok(self.dual(y, move |g| match back {
            // Same placement, other cut: `grad_back` would keep the cut.
            Some((i, sizes)) => Ok(g.redistribute_split(i, sizes)?.into_local()),
            None => grad_back(&from, g),
        }))
    }

    /// [`DistTensor::redistribute`]; the backward pass is its dual (see the module docs).
    ///
    /// # Errors
    /// As [`DistTensor::redistribute`].
    pub fn redistribute(&self, to: Placement) -> Result<DVar<'r, T>> {
        let y = self.value.redistribute(to)?;
        if !self.is_tracked() {
            return Ok(DVar::constant(y));
        }
        let from = self.value.clone();
        Ok(self.dual(y, move |g| grad_back(&from, g)))
    }

    /// Differentiates a scalar loss (one element) with respect to every tracked leaf on every
    /// rank. Collective: every rank calls it. A replicated loss is seeded 1 on rank 0 and 0
    /// elsewhere (its gradient is held as partial sums); a sharded or partial one 1 everywhere.
    ///
    /// # Errors
    /// As [`Var::backward`].
    pub fn backward(&self) -> Result<()> {
        self.backward_hooked(None)
    }

    /// [`DVar::backward`], telling `hook` each leaf's number as soon as its gradient is complete
    /// (what data parallelism's buckets send while the pass goes on).
    pub(crate) fn backward_hooked(&self, hook: Option<LeafHook<'_>>) -> Result<()> {
        let one = if self.placement() == Placement::Replicate && self.value.rank().rank() != 0 {
            0.0
        } else {
            1.0
        };
        let seed = self.value.local().map(|_| T::from_f64(one));
        self.local.backward_hooked(seed, hook)
    }
}

/// `x` of `[..., k]` as the matrix `[rows, k]` (counting rows by the leading dimensions, so
/// that `k = 0` keeps them).
fn as_rows<T: Element>(x: &Tensor<T>) -> Result<Tensor<T>> {
    let (last, lead) = x.shape().split_last().expect("at least 1-D");
    x.reshape(&[lead.iter().product(), *last])
}

/// `a^T @ b` over the rows of `a: [..., p]` and `b: [..., q]`: `[p, q]`, the gradient of a
/// weight, on `threads` threads (a rank's share of the cores, as the fused ops take) on the host;
/// `a` is read transposed in place, with no copy, on the host and on a GPU.
fn weight_grad<T: Element>(a: &Tensor<T>, b: &Tensor<T>, threads: usize) -> Result<Tensor<T>> {
    as_rows(a)?.matmul_lhs_transposed(&as_rows(b)?, threads)
}

/// `g`'s part under another placement (collective, as [`DistTensor::from_local`]).
fn placed<'r, T: Element>(g: DistTensor<'r, T>, to: Placement) -> Result<DistTensor<'r, T>> {
    DistTensor::from_local(g.rank(), g.into_local(), to)
}

/// The gradient of `from` (this rank's part, placed as `from`) given `g`, the gradient of
/// `from.redistribute(g.placement())`.
fn grad_back<'r, T: Element>(from: &DistTensor<'r, T>, g: DistTensor<'r, T>) -> Result<Tensor<T>> {
    use Placement::{Partial, Replicate, Shard};
    let back = match (from.placement(), g.placement()) {
        (a, b) if a == b => g,
        // Shard -> Shard (all_to_all): back, split as before.
        (Shard(i), Shard(_)) => g.redistribute_split(i, from.shard_sizes().to_vec())?,
        // Shard -> Replicate (all_gather): the partial sums, reduce-scattered.
        (Shard(i), Replicate) => {
            placed(g, Partial)?.redistribute_split(i, from.shard_sizes().to_vec())?
        }
        // Shard -> Partial (in place): the whole gradient is everywhere; take this shard.
        (Shard(i), Partial) => {
            placed(g, Replicate)?.redistribute_split(i, from.shard_sizes().to_vec())?
        }
        // Replicate -> Shard (local slice): this rank's slice, zeros around (partial sums).
        (Replicate, Shard(_)) => g.redistribute(Partial)?,
        // Replicate -> Partial (rank 0 keeps it): rank 0 gets the whole gradient.
        (Replicate, Partial) => placed(g, Replicate)?.redistribute(Partial)?,
        // Partial -> Shard (reduce_scatter): every summand gets the whole gradient.
        (Partial, Shard(_)) => g.redistribute(Replicate)?,
        // Partial -> Replicate (all_reduce): the partial sums of the gradient, all-reduced.
        (Partial, Replicate) => placed(g, Partial)?.redistribute(Replicate)?,
        (a, b) => unreachable!("{a:?} -> {b:?} is covered above"),
    };
    Ok(back.into_local())
}
