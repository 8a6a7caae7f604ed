//! The tensor-parallel products of a [`DistTensor`]: `all_gather_matmul`, `matmul_reduce_scatter`,
//! on `[..., K]` tensors: the leading dimensions are flattened into the rows of the fused 2-D
//! kernels and restored after.
//!
//! A tensor sharded on a leading dimension `d` is, row-major, `[A, S, C, K]` with `A` and `C` the
//! products of the leading dimensions before and after `d`; rank `r` holds the rows
//! `(a, offset_r + i, c)`. When `A` is 1 those rows are one run of the flattened rows and the
//! kernels see them as they are; otherwise the gathered product is put back in row-major order
//! (`all_gather_matmul`), or the rows are grouped by rank before the reduce-scatter
//! (`matmul_reduce_scatter`): one local copy each.

use ndarray::{Array2, ArrayView2, Axis, Slice};

use super::tensor::RowSplit;
use super::{DistTensor, Placement, Split};
use crate::device::capability::{self, Feature, Op};
use crate::fused::operand::Operand;
use crate::fused::{AgPath, RsPath, all_gather_matmul, matmul_reduce_scatter};
use crate::tensor::{Element, Tensor, array_split, pool, split_offsets};
use crate::{Error, Result};

/// How a tensor-parallel product reads its weight, which kernel runs, and how its output rows
/// are split: the options of [`DistTensor::all_gather_matmul_with`],
/// [`DistTensor::all_gather_matmul_keep_input`] and [`DistTensor::matmul_reduce_scatter_with`].
///
/// The default is what [`DistTensor::all_gather_matmul`] and
/// [`DistTensor::matmul_reduce_scatter`] do: the weight as it is, the fused kernel, the default
/// output split.
///
/// # Examples
/// ```
/// use dist_tensor::{MatmulOptions, Split};
/// let backward = MatmulOptions::new().transpose_weights(true);
/// assert_ne!(backward, MatmulOptions::default());
/// let baseline = MatmulOptions::new().unfused(true).output_split(0, Split::Sizes(vec![3, 2]));
/// assert_ne!(baseline, MatmulOptions::new().unfused(true));
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MatmulOptions {
    transpose_weights: bool,
    unfused: bool,
    output_split: Option<(usize, Split)>,
    ag_path: Option<AgPath>,
    rs_path: Option<RsPath>,
}

impl MatmulOptions {
    /// The defaults: weights as they are, fused, the default output split.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::MatmulOptions;
    /// assert_eq!(MatmulOptions::new(), MatmulOptions::default());
    /// ```
    pub fn new() -> Self {
        MatmulOptions::default()
    }

    /// With `true`, each weight is read transposed (the caller makes no transposed copy): the
    /// product is `x @ w^T` for a `w` of `[n, K]`, as the backward pass of a layer needs
    /// (`dx = dy @ w^T`). The fused kernels pass the transposed view's strides to the GEMM, or,
    /// in a product of more rows than one tile, copy the weight once into row-major order, which
    /// the GEMM packs faster for every block of rows.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{DistTensor, MatmulOptions, Placement, Tensor, World};
    /// let (x, w) = (Tensor::<f64>::random(&[5, 4], 1), Tensor::<f64>::random(&[3, 4], 2));
    /// let want = x.matmul(&w.transpose(0, 1)?)?;
    /// let got = World::threads(2)?.run(|rank| {
    ///     let x = DistTensor::from_global(rank, &x, Placement::Shard(0))?;
    ///     let w = DistTensor::from_global(rank, &w, Placement::Shard(0))?; // [n_r, K]
    ///     let opts = MatmulOptions::new().transpose_weights(true);
    ///     x.all_gather_matmul_with(&[w.local()], &opts)?.remove(0).to_global()
    /// })?;
    /// assert!((&got[0] - &want).as_slice().iter().all(|d| d.abs() < 1e-12));
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn transpose_weights(mut self, transpose: bool) -> Self {
        self.transpose_weights = transpose;
        self
    }

    /// With `true`, the unfused baseline runs (the collective, then the local product): the same
    /// results, for comparison.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{DistTensor, MatmulOptions, Placement, Tensor, World};
    /// let (h, w) = (Tensor::<f64>::random(&[5, 6], 1), Tensor::<f64>::random(&[6, 3], 2));
    /// World::threads(3)?.run(|rank| {
    ///     let h = DistTensor::from_global(rank, &h, Placement::Shard(1))?;
    ///     let w = DistTensor::from_global(rank, &w, Placement::Shard(0))?;
    ///     let fused = h.matmul_reduce_scatter(w.local())?;
    ///     let unfused = h.matmul_reduce_scatter_with(w.local(), &MatmulOptions::new().unfused(true))?;
    ///     assert!((fused.local() - unfused.local()).as_slice().iter().all(|d| d.abs() < 1e-12));
    ///     Ok(())
    /// })?;
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn unfused(mut self, unfused: bool) -> Self {
        self.unfused = unfused;
        self
    }

    /// [`DistTensor::matmul_reduce_scatter_with`] only: the output sharded on leading dimension
    /// `dim`, cut as `split` says (as
    /// [`matmul_reduce_scatter_split`](DistTensor::matmul_reduce_scatter_split)). The
    /// all_gather_matmul calls reject it: their output is sharded on its last dimension.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{DistTensor, MatmulOptions, Placement, Tensor, World};
    /// let (h, w) = (Tensor::<f64>::random(&[5, 6], 1), Tensor::<f64>::random(&[6, 3], 2));
    /// let sizes = World::threads(2)?.run(|rank| {
    ///     let h = DistTensor::from_global(rank, &h, Placement::Shard(1))?;
    ///     let w = DistTensor::from_global(rank, &w, Placement::Shard(0))?;
    ///     let opts = MatmulOptions::new().output_split(0, vec![1, 4]);
    ///     Ok(h.matmul_reduce_scatter_with(w.local(), &opts)?.shard_sizes().to_vec())
    /// })?;
    /// assert_eq!(sizes[0], vec![1, 4]);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn output_split(mut self, dim: usize, split: impl Into<Split>) -> Self {
        self.output_split = Some((dim, split.into()));
        self
    }

    /// The path `all_gather_matmul` takes on a device backend whose kernels have several (see
    /// [`AgPath`]), instead of the one its shape chooses: for measuring both paths on one shape
    /// and testing each. Every rank must ask for the same; the host and NPU kernels have one
    /// path and take no notice.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::MatmulOptions;
    /// use dist_tensor::fused::AgPath;
    /// let opts = MatmulOptions::new().all_gather_matmul_path(AgPath::Overlap);
    /// assert_ne!(opts, MatmulOptions::new());
    /// ```
    pub fn all_gather_matmul_path(mut self, path: AgPath) -> Self {
        self.ag_path = Some(path);
        self
    }

    /// The path `matmul_reduce_scatter` takes on a device backend whose kernels have several
    /// (see [`RsPath`]), as [`MatmulOptions::all_gather_matmul_path`].
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::MatmulOptions;
    /// use dist_tensor::fused::RsPath;
    /// let opts = MatmulOptions::new().matmul_reduce_scatter_path(RsPath::Chunked);
    /// assert_ne!(opts, MatmulOptions::new());
    /// ```
    pub fn matmul_reduce_scatter_path(mut self, path: RsPath) -> Self {
        self.rs_path = Some(path);
        self
    }
}

/// Weights as operands (read transposed when asked), and what is wrong with them on this rank: a
/// weight that is not 2-D becomes an empty view, and its real shape travels with the fused op's
/// shape exchange, so that every rank fails together instead of this one failing alone while its
/// peers wait. Only shapes are read here: the weights may live on any device.
fn weight_operands<'a, T: Element>(
    ws: &[&'a Tensor<T>],
    transpose: bool,
) -> (Vec<Operand<'a, T>>, Option<String>) {
    let mut problem = None;
    let operands = ws
        .iter()
        .enumerate()
        .map(|(i, w)| {
            if w.ndim() == 2 {
                Operand::Tensor(w, transpose)
            } else {
                problem.get_or_insert_with(|| {
                    format!("weight {i} has shape {:?}; weights are 2-D matrices", w.shape())
                });
                Operand::View(ArrayView2::from_shape((0, 0), &[]).expect("empty"))
            }
        })
        .collect();
    (operands, problem)
}

/// How the leading dimensions `lead` of a `[..., K]` tensor, sharded on `lead[dim]` as `sizes`,
/// map to the flattened rows.
struct Rows {
    /// Product of the leading dimensions before `dim`.
    outer: usize,
    /// Product of those after it.
    inner: usize,
    sizes: Vec<usize>,
}

impl Rows {
    fn new(lead: &[usize], dim: usize, sizes: Vec<usize>) -> Self {
        Rows { outer: lead[..dim].iter().product(), inner: lead[dim + 1..].iter().product(), sizes }
    }

    /// Flattened rows rank `r` holds.
    fn of(&self, r: usize) -> usize {
        self.outer * self.sizes[r] * self.inner
    }

    /// Rank-major rows (every rank's rows in turn, as the gather delivers them) in row-major
    /// order of the whole tensor.
    fn to_global_order<T: Element>(&self, by_rank: Tensor<T>) -> Result<Tensor<T>> {
        if self.outer <= 1 {
            return Ok(by_rank); // already in order (or empty)
        }
        if !by_rank.is_on_host() {
            // On a GPU: reordered on the host (one round trip), then back where it was.
            let host = self.to_global_order(by_rank.to_host()?)?;
            return host.into_place_of(&by_rank);
        }
        // More than one outer block: an N-D input, computed on the host (the capability table
        // refuses it elsewhere).
        let by_rank: Array2<T> =
            by_rank.into_array().into_dimensionality().expect("a product is 2-D");
        let (m, n) = by_rank.dim();
        let run = m / self.outer; // rows of one outer block, all ranks
        // Every row is written below.
        let data = pool::take("all_gather_matmul", m * n)?;
        let mut out = Array2::from_shape_vec((m, n), data).expect("m x n");
        let offsets = split_offsets(&self.sizes);
        let mut at = 0;
        for (&size, &offset) in self.sizes.iter().zip(&offsets) {
            let (len, start) = (size * self.inner, offset * self.inner);
            for a in 0..self.outer {
                let src = by_rank.slice_axis(Axis(0), Slice::from(at..at + len));
                let dst = a * run + start;
                out.slice_axis_mut(Axis(0), Slice::from(dst..dst + len)).assign(&src);
                at += len;
            }
        }
        pool::give(by_rank.into_raw_vec_and_offset().0);
        Ok(Tensor::from_array(out.into_dyn()))
    }

    /// The inverse of [`Rows::to_global_order`]: row-major rows grouped by the rank that keeps
    /// them.
    fn to_rank_order<T: Element>(&self, x: ArrayView2<'_, T>) -> Result<Array2<T>> {
        let (m, k) = x.dim();
        let run = m / self.outer.max(1);
        let offsets = split_offsets(&self.sizes);
        // Every row is written below.
        let data = pool::take("matmul_reduce_scatter", m * k)?;
        let mut out = Array2::from_shape_vec((m, k), data).expect("m x k");
        let mut at = 0;
        for (&size, &offset) in self.sizes.iter().zip(&offsets) {
            let (len, start) = (size * self.inner, offset * self.inner);
            for a in 0..self.outer {
                let src =
                    x.slice_axis(Axis(0), Slice::from(a * run + start..a * run + start + len));
                out.slice_axis_mut(Axis(0), Slice::from(at..at + len)).assign(&src);
                at += len;
            }
        }
        Ok(out)
    }
}

/// `t` with `shape` (the same elements): as it is when it has that shape already, which keeps a
/// device tensor where it is.
fn reshaped<T: Element>(t: Tensor<T>, shape: &[usize]) -> Result<Tensor<T>> {
    if t.shape() == shape { Ok(t) } else { t.reshape(shape) }
}

impl<'r, T: Element> DistTensor<'r, T> {
    /// `all_gather(self) @ w`, fused: `self` is `[M, K]` sharded on rows (`Shard(0)`, local
    /// `[m_r, K]`), `w` this rank's `[K, n_r]` (a column shard of the weight). The result is
    /// `[M, n_r]` on every rank: the product, sharded on columns (`Shard(1)`).
    ///
    /// `self` may have more dimensions, `[..., K]`, sharded on any but the last (`[B, S, K]`
    /// sharded on `B` or on the sequence `S`): the leading dimensions are the rows, and the result
    /// is `[..., n_r]`, sharded on its last dimension. The result remembers how its rows were
    /// split, for the [`matmul_reduce_scatter`](DistTensor::matmul_reduce_scatter) that follows.
    ///
    /// # Errors
    /// On every rank: [`Error::UnsupportedPlacement`] unless `self` has 2 or more dimensions and
    /// is sharded on one before the last; [`Error::InnerDimMismatch`] naming a rank whose `w`
    /// does not have `K` rows; and as every collective.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{DistTensor, Placement, Tensor, World};
    /// let x = Tensor::<f32>::random(&[6, 4], 1);
    /// let w = Tensor::<f32>::random(&[4, 5], 2);
    /// let want = x.matmul(&w)?;
    /// let got = World::threads(2)?.run(|rank| {
    ///     let x = DistTensor::from_global(rank, &x, Placement::Shard(0))?;
    ///     let w = DistTensor::from_global(rank, &w, Placement::Shard(1))?;
    ///     let h = x.all_gather_matmul(w.local())?;
    ///     assert_eq!(h.placement(), Placement::Shard(1));
    ///     h.to_global()
    /// })?;
    /// assert_eq!(got[0], want);
    ///
    /// // [B, S, K] sharded on the sequence: the leading dimensions are the rows.
    /// let x = Tensor::<f32>::random(&[2, 5, 4], 3);
    /// let want = x.reshape(&[10, 4])?.matmul(&w)?.reshape(&[2, 5, 5])?;
    /// let got = World::threads(2)?.run(|rank| {
    ///     let x = DistTensor::from_global(rank, &x, Placement::Shard(1))?;
    ///     let w = DistTensor::from_global(rank, &w, Placement::Shard(1))?;
    ///     let h = x.all_gather_matmul(w.local())?;
    ///     assert_eq!(h.placement(), Placement::Shard(2));
    ///     h.to_global()
    /// })?;
    /// assert_eq!(got[0], want);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn all_gather_matmul(&self, w: &Tensor<T>) -> Result<Self> {
        Ok(self.all_gather_matmul_many(&[w])?.remove(0))
    }

    /// [`DistTensor::all_gather_matmul`] with several weights: one gather, several products (as
    /// for fused Q, K, V projections). Up to [`MAX_WEIGHTS`](crate::fused::MAX_WEIGHTS) weights.
    ///
    /// # Errors
    /// As [`DistTensor::all_gather_matmul`].
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{DistTensor, Placement, Tensor, World};
    /// World::threads(2)?.run(|rank| {
    ///     let x = DistTensor::from_local(rank, Tensor::<f32>::random(&[3, 8], 1), Placement::Shard(0))?;
    ///     let (q, k) = (Tensor::random(&[8, 4], 2), Tensor::random(&[8, 2], 3));
    ///     let outs = x.all_gather_matmul_many(&[&q, &k])?;
    ///     assert_eq!(outs[1].local().shape(), &[6, 2]);
    ///     assert_eq!(outs[1].global_shape(), vec![6, 4]);
    ///     Ok(())
    /// })?;
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn all_gather_matmul_many(&self, ws: &[&Tensor<T>]) -> Result<Vec<Self>> {
        Ok(self.gather_products(ws, &MatmulOptions::new(), false)?.0)
    }

    /// [`DistTensor::all_gather_matmul_many`] as `opts` say: weights transposed in place
    /// (`x @ w^T` for each `w` of `[n_r, K]`), or the unfused baseline.
    ///
    /// # Errors
    /// As [`DistTensor::all_gather_matmul`]; [`Error::InvalidArgument`] on every rank when `opts`
    /// has an output split (on GPUs a transposed weight is read in place by cuBLASLt's transpose flag).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{DistTensor, MatmulOptions, Placement, Tensor, World};
    /// // The backward pass of a row-parallel layer y = h @ w (w: [N_ffn, E] split by rows):
    /// // dh = all_gather(dy) @ w_r^T, reading w_r [n_r, E] transposed, in place.
    /// let (dy, w) = (Tensor::<f32>::random(&[7, 4], 1), Tensor::<f32>::random(&[6, 4], 2));
    /// let want = dy.matmul(&w.transpose(0, 1)?)?; // [7, 6]
    /// let got = World::threads(3)?.run(|rank| {
    ///     let dy = DistTensor::from_global(rank, &dy, Placement::Shard(0))?;
    ///     let w = DistTensor::from_global(rank, &w, Placement::Shard(0))?;
    ///     let opts = MatmulOptions::new().transpose_weights(true);
    ///     let dh = dy.all_gather_matmul_with(&[w.local()], &opts)?.remove(0);
    ///     assert_eq!(dh.placement(), Placement::Shard(1));
    ///     dh.to_global()
    /// })?;
    /// assert!((&got[0] - &want).as_slice().iter().all(|d| d.abs() < 1e-5));
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn all_gather_matmul_with(
        &self,
        ws: &[&Tensor<T>],
        opts: &MatmulOptions,
    ) -> Result<Vec<Self>> {
        Ok(self.gather_products(ws, opts, false)?.0)
    }

    /// [`DistTensor::all_gather_matmul_with`] that also returns the gathered input: the whole
    /// `[..., K]` tensor, [`Placement::Replicate`], in its global order. The fused kernel copies
    /// out the rows it received anyway, so a backward pass (the weight gradient
    /// `x^T @ dy`) needs no second gather.
    ///
    /// # Errors
    /// As [`DistTensor::all_gather_matmul_with`]; [`Error::DeviceUnavailable`] in an Ascend world
    /// (its kernel does not keep the gathered rows).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{DistTensor, MatmulOptions, Placement, Tensor, World};
    /// let (x, w) = (Tensor::<f32>::random(&[2, 5, 4], 1), Tensor::<f32>::random(&[4, 6], 2));
    /// let got = World::threads(2)?.run(|rank| {
    ///     let xs = DistTensor::from_global(rank, &x, Placement::Shard(1))?; // [B, s_r, K]
    ///     let w = DistTensor::from_global(rank, &w, Placement::Shard(1))?;
    ///     let (h, input) = xs.all_gather_matmul_keep_input(&[w.local()], &MatmulOptions::new())?;
    ///     assert_eq!((h[0].local().shape(), input.placement()), (&[2, 5, 3][..], Placement::Replicate));
    ///     Ok(input.into_local())
    /// })?;
    /// assert_eq!(got[0], x);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn all_gather_matmul_keep_input(
        &self,
        ws: &[&Tensor<T>],
        opts: &MatmulOptions,
    ) -> Result<(Vec<Self>, Self)> {
        let (products, input) = self.gather_products(ws, opts, true)?;
        Ok((products, input.expect("asked for")))
    }

    /// The unfused baseline of [`DistTensor::all_gather_matmul`]: all_gather, then a local product.
    ///
    /// # Errors
    /// As [`DistTensor::all_gather_matmul`].
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{DistTensor, Placement, Tensor, World};
    /// let x = Tensor::<f32>::random(&[6, 4], 1);
    /// let w = Tensor::<f32>::random(&[4, 5], 2);
    /// let want = x.matmul(&w)?;
    /// let got = World::threads(2)?.run(|rank| {
    ///     let x = DistTensor::from_global(rank, &x, Placement::Shard(0))?;
    ///     let w = DistTensor::from_global(rank, &w, Placement::Shard(1))?;
    ///     x.all_gather_matmul_unfused(w.local())?.to_global()
    /// })?;
    /// assert_eq!(got[0], want);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn all_gather_matmul_unfused(&self, w: &Tensor<T>) -> Result<Self> {
        Ok(self.gather_products(&[w], &MatmulOptions::new().unfused(true), false)?.0.remove(0))
    }

    /// The products, and the gathered input when `keep_input`.
    fn gather_products(
        &self,
        ws: &[&Tensor<T>],
        opts: &MatmulOptions,
        keep_input: bool,
    ) -> Result<(Vec<Self>, Option<Self>)> {
        let fused = !opts.unfused;
        const OP: &str = "all_gather_matmul";
        let ndim = self.global_shape.len();
        let d = match self.placement {
            Placement::Shard(d) if ndim >= 2 && d + 1 < ndim => d,
            placement => {
                return Err(Error::UnsupportedPlacement {
                    op: OP,
                    placement: format!("{placement} of a {ndim}-D tensor"),
                    expected: "a tensor [..., K] of 2 or more dimensions sharded on a dimension \
                               before the last (Shard(0) of [M, K])"
                        .to_string(),
                });
            }
        };
        let lead = &self.global_shape[..ndim - 1];
        let rows = Rows::new(lead, d, self.splits.clone());
        let (weights, mut problem) = weight_operands(ws, opts.transpose_weights);
        if let Some((dim, split)) = &opts.output_split {
            problem.get_or_insert_with(|| {
                format!(
                    "an output split ({split:?} of dimension {dim}) was given; all_gather_matmul's \
                     output is sharded on its last dimension"
                )
            });
        }
        let x = Operand::from(&self.local);
        let out = all_gather_matmul::run(
            self.rank,
            x,
            &weights,
            problem,
            fused,
            keep_input,
            opts.ag_path,
        )
        .map_err(|e| with_global_shape(e, &self.global_shape))?;
        let rows_from = RowSplit { dim: d, sizes: self.splits.clone() };
        let input = match out.gathered {
            Some(gathered) => {
                let local = rows.to_global_order(gathered)?.reshape(&self.global_shape)?;
                let global = self.global_shape.clone();
                Some(DistTensor::new(self.rank, local, Placement::Replicate, global, Vec::new()))
            }
            None => None,
        };
        let products = out
            .outputs
            .into_iter()
            .zip(out.col_counts)
            .map(|(product, cols)| {
                let product = rows.to_global_order(product)?;
                let (mut local_shape, mut global) = (lead.to_vec(), lead.to_vec());
                local_shape.push(product.shape()[1]);
                global.push(cols.iter().sum());
                let local = reshaped(product, &local_shape)?;
                Ok(DistTensor::new(self.rank, local, Placement::Shard(ndim - 1), global, cols)
                    .with_rows_from(Some(rows_from.clone())))
            })
            .collect::<Result<_>>()?;
        Ok((products, input))
    }

    /// `sum over ranks of self_r @ w_r`, reduce-scattered on rows, fused: `self` is `[M, K]`
    /// sharded on columns (`Shard(1)`, local `[M, k_r]`, with `w` this rank's `[k_r, N]`), or a
    /// `Partial` `[M, K]` (with `w` the whole `[K, N]`). The result is `[M, N]` sharded on rows
    /// (`Shard(0)`). The sum runs in rank order: the same bits on every run.
    ///
    /// `self` may have more dimensions, `[..., K]` sharded on the last: the result is `[..., N]`.
    ///
    /// The rows are split as the matching [`all_gather_matmul`](DistTensor::all_gather_matmul)'s
    /// input was (same dimension, same sizes) when `self` comes from one through local updates
    /// ([`map_local`](DistTensor::map_local), [`reshape`](DistTensor::reshape) that keeps the
    /// leading dimensions): a block's output lines up with its input for the residual add.
    /// Otherwise the first dimension is split as `numpy.array_split`.
    /// [`matmul_reduce_scatter_split`](DistTensor::matmul_reduce_scatter_split) chooses.
    ///
    /// # Errors
    /// On every rank: [`Error::UnsupportedPlacement`] unless `self` has 2 or more dimensions and
    /// is sharded on the last or `Partial`; [`Error::InnerDimMismatch`] naming a rank whose `w`
    /// does not fit; and as every collective.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{DistTensor, Placement, Tensor, World};
    /// let h = Tensor::<f64>::random(&[5, 6], 1);
    /// let w = Tensor::<f64>::random(&[6, 3], 2);
    /// let want = h.matmul(&w)?;
    /// let got = World::threads(3)?.run(|rank| {
    ///     let h = DistTensor::from_global(rank, &h, Placement::Shard(1))?;
    ///     let w = DistTensor::from_global(rank, &w, Placement::Shard(0))?;
    ///     h.matmul_reduce_scatter(w.local())?.to_global()
    /// })?;
    /// let err = (&got[0].to_array() - &want.to_array()).iter().fold(0.0f64, |m, d| m.max(d.abs()));
    /// assert!(err < 1e-12);
    ///
    /// // The rows come back split as the all_gather_matmul's input was: [10, 6], not [8, 8].
    /// let (x, w1, w2) = (Tensor::<f64>::random(&[16, 4], 3), Tensor::random(&[4, 6], 4), Tensor::random(&[6, 4], 5));
    /// let splits = World::threads(2)?.run(|rank| {
    ///     let x = DistTensor::from_global_split(rank, &x, 0, vec![10, 6])?;
    ///     let w1 = DistTensor::from_global(rank, &w1, Placement::Shard(1))?;
    ///     let w2 = DistTensor::from_global(rank, &w2, Placement::Shard(0))?;
    ///     let h = x.all_gather_matmul(w1.local())?.map_local(|t| t.gelu())?;
    ///     let y = h.matmul_reduce_scatter(w2.local())?;
    ///     let residual = y.zip_local(&x, |y, x| y + x)?; // lined up, no exchange
    ///     Ok(residual.shard_sizes().to_vec())
    /// })?;
    /// assert_eq!(splits[0], vec![10, 6]);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn matmul_reduce_scatter(&self, w: &Tensor<T>) -> Result<Self> {
        self.reduce_product(w, &MatmulOptions::new())
    }

    /// [`DistTensor::matmul_reduce_scatter`] as `opts` say: the weight transposed in place
    /// (`sum over ranks of self_r @ w_r^T` for a `w_r` of `[N, k_r]`), the unfused baseline, or
    /// the output split given.
    ///
    /// # Errors
    /// As [`DistTensor::matmul_reduce_scatter_split`]; [`Error::DeviceUnavailable`] for a
    /// transposed weight in a GPU world.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{DistTensor, MatmulOptions, Placement, Tensor, World};
    /// // The backward pass of a column-parallel layer h = x @ w (w: [E, F] split by columns):
    /// // dx = reduce_scatter(dh_r @ w_r^T), reading w_r [E, f_r] transposed, in place.
    /// let (dh, w) = (Tensor::<f64>::random(&[7, 6], 1), Tensor::<f64>::random(&[4, 6], 2));
    /// let want = dh.matmul(&w.transpose(0, 1)?)?; // [7, 4]
    /// let got = World::threads(3)?.run(|rank| {
    ///     let dh = DistTensor::from_global(rank, &dh, Placement::Shard(1))?;
    ///     let w = DistTensor::from_global(rank, &w, Placement::Shard(1))?; // [E, f_r]
    ///     let opts = MatmulOptions::new().transpose_weights(true);
    ///     dh.matmul_reduce_scatter_with(w.local(), &opts)?.to_global()
    /// })?;
    /// assert!((&got[0] - &want).as_slice().iter().all(|d| d.abs() < 1e-12));
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn matmul_reduce_scatter_with(&self, w: &Tensor<T>, opts: &MatmulOptions) -> Result<Self> {
        self.reduce_product(w, opts)
    }

    /// [`DistTensor::matmul_reduce_scatter`] with the output sharded on leading dimension `dim`
    /// (of `[..., N]`), cut as `split` says. Every rank must pass the same split.
    ///
    /// # Errors
    /// As [`DistTensor::matmul_reduce_scatter`]; [`Error::DimOutOfRange`] when `dim` is not a
    /// leading dimension; [`Error::InvalidArgument`] when the split does not fit its length.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{DistTensor, Placement, Tensor, World};
    /// let h = Tensor::<f64>::random(&[2, 7, 6], 1); // [B, S, K]
    /// let w = Tensor::<f64>::random(&[6, 3], 2);
    /// let want = h.matmul(&w)?;
    /// let got = World::threads(3)?.run(|rank| {
    ///     let h = DistTensor::from_global(rank, &h, Placement::Shard(2))?;
    ///     let w = DistTensor::from_global(rank, &w, Placement::Shard(0))?;
    ///     let y = h.matmul_reduce_scatter_split(w.local(), 1, vec![1, 2, 4])?; // on the sequence
    ///     assert_eq!(y.placement(), Placement::Shard(1));
    ///     assert_eq!(y.local().shape(), &[2, [1, 2, 4][rank.rank()], 3]);
    ///     y.to_global()
    /// })?;
    /// let err = (&got[0] - &want).as_slice().iter().fold(0.0f64, |m, d| m.max(d.abs()));
    /// assert!(err < 1e-12);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn matmul_reduce_scatter_split(
        &self,
        w: &Tensor<T>,
        dim: usize,
        split: impl Into<Split>,
    ) -> Result<Self> {
        self.reduce_product(w, &MatmulOptions::new().output_split(dim, split))
    }

    /// The unfused baseline of [`DistTensor::matmul_reduce_scatter`]: a local product, then
    /// reduce_scatter.
    ///
    /// # Errors
    /// As [`DistTensor::matmul_reduce_scatter`].
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{DistTensor, Placement, Tensor, World};
    /// let h = Tensor::<f64>::random(&[5, 6], 1);
    /// let w = Tensor::<f64>::random(&[6, 3], 2);
    /// let want = h.matmul(&w)?;
    /// let got = World::threads(3)?.run(|rank| {
    ///     let h = DistTensor::from_global(rank, &h, Placement::Shard(1))?;
    ///     let w = DistTensor::from_global(rank, &w, Placement::Shard(0))?;
    ///     h.matmul_reduce_scatter_unfused(w.local())?.to_global()
    /// })?;
    /// let err = (&got[0].to_array() - &want.to_array()).iter().fold(0.0f64, |m, d| m.max(d.abs()));
    /// assert!(err < 1e-12);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn matmul_reduce_scatter_unfused(&self, w: &Tensor<T>) -> Result<Self> {
        self.reduce_product(w, &MatmulOptions::new().unfused(true))
    }

    fn reduce_product(&self, w: &Tensor<T>, opts: &MatmulOptions) -> Result<Self> {
        let fused = !opts.unfused;
        const OP: &str = "matmul_reduce_scatter";
        let ndim = self.global_shape.len();
        let (me, n) = (self.rank.rank(), self.rank.num_ranks());
        let takes = match self.placement {
            Placement::Shard(d) => d + 1 == ndim,
            Placement::Partial => true,
            Placement::Replicate => false,
        };
        if ndim < 2 || !takes {
            return Err(Error::UnsupportedPlacement {
                op: OP,
                placement: format!("{} of a {ndim}-D tensor", self.placement),
                expected: "a tensor [..., k_r] of 2 or more dimensions sharded on its last \
                           dimension (Shard(1) of [M, k_r]), or a Partial [..., K]"
                    .to_string(),
            });
        }
        let lead = &self.global_shape[..ndim - 1];
        let (dim, sizes) = match &opts.output_split {
            Some((dim, _)) if *dim >= lead.len() => {
                return Err(Error::DimOutOfRange { op: OP, dim: *dim, ndim: lead.len() });
            }
            Some((dim, split)) => (*dim, split.sizes_for(OP, me, lead[*dim], n)?),
            None => match &self.rows_from {
                Some(r) if r.fits(&self.global_shape, self.placement, n) => {
                    (r.dim, r.sizes.clone())
                }
                _ => (0, array_split(lead[0], n)),
            },
        };
        let rows = Rows::new(lead, dim, sizes);
        let grouped;
        let x = if rows.outer == 1 {
            Operand::from(&self.local)
        } else {
            // Rows grouped by the rank that keeps them: a host copy, so the table is asked
            // first whether this world takes an N-D input at all.
            capability::check_features(
                Op::MatmulReduceScatter,
                self.rank.device(),
                &[Feature::NdInput],
            )?;
            // A part on a GPU is grouped on the host (the op moves it back at its entry).
            let local = self.local.host_tensor()?;
            grouped = rows.to_rank_order(Operand::from(&*local).view(OP)?)?;
            Operand::View(grouped.view())
        };
        let (mut weights, problem) = weight_operands(&[w], opts.transpose_weights);
        let (product, counts) = matmul_reduce_scatter::run(
            self.rank,
            x,
            weights.remove(0),
            rows.of(me),
            problem,
            fused,
            opts.rs_path,
        )
        .map_err(|e| with_global_shape(e, &self.global_shape))?;
        if let Some(r) = (0..n).find(|&r| counts[r] != rows.of(r)) {
            return Err(Error::RanksDisagree {
                op: OP,
                rank_a: me,
                value_a: format!(
                    "output rows {:?}",
                    (0..n).map(|r| rows.of(r)).collect::<Vec<_>>()
                ),
                rank_b: r,
                value_b: format!("{} output rows of its own", counts[r]),
            });
        }
        let cols = product.shape()[1];
        let (mut local_shape, mut global) = (lead.to_vec(), lead.to_vec());
        local_shape[dim] = rows.sizes[me];
        local_shape.push(cols);
        global.push(cols);
        let local = reshaped(product, &local_shape)?;
        Ok(DistTensor::new(self.rank, local, Placement::Shard(dim), global, rows.sizes))
    }
}

/// A product's shape error names the input's global shape beside the rank's local part, so the
/// user can read it against the shapes they wrote.
fn with_global_shape(e: Error, global: &[usize]) -> Error {
    match e {
        Error::InnerDimMismatch { op, rank, left, right, left_global: None } => {
            Error::InnerDimMismatch { op, rank, left, right, left_global: Some(global.to_vec()) }
        }
        e => e,
    }
}
