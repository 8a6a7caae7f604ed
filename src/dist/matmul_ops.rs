//! The tensor-parallel products of a [`DistTensor`]: `all_gather_matmul`, `matmul_reduce_scatter`.

use ndarray::ArrayView2;

use super::{DistTensor, Placement};
use crate::fused::all_gather_matmul::all_gather_matmul_checked;
use crate::fused::matmul_reduce_scatter::matmul_reduce_scatter_checked;

use crate::tensor::{Element, Tensor, array_split};
use crate::{Error, Result};

/// Weights as 2-D views, and what is wrong with them on this rank: a weight that is not 2-D
/// becomes an empty view, and its real shape travels with the fused op's shape exchange, so that
/// every rank fails together instead of this one failing alone while its peers wait.
fn weight_views<'a, T: Element>(ws: &[&'a Tensor<T>]) -> (Vec<ArrayView2<'a, T>>, Option<String>) {
    let mut problem = None;
    let views = ws
        .iter()
        .enumerate()
        .map(|(i, w)| {
            w.view2("weight").unwrap_or_else(|_| {
                problem.get_or_insert_with(|| {
                    format!("weight {i} has shape {:?}; weights are 2-D matrices", w.shape())
                });
                ArrayView2::from_shape((0, 0), &[]).expect("empty")
            })
        })
        .collect();
    (views, problem)
}

fn require<T: Element>(
    x: &DistTensor<'_, T>,
    op: &'static str,
    takes: &[Placement],
    expected: &str,
) -> Result<()> {
    if x.global_shape.len() != 2 || !takes.contains(&x.placement) {
        return Err(Error::UnsupportedPlacement {
            op,
            placement: format!("{} of a {}-D tensor", x.placement, x.global_shape.len()),
            expected: expected.to_string(),
        });
    }
    Ok(())
}

impl<'r, T: Element> DistTensor<'r, T> {
    /// `all_gather(self) @ w`, fused: `self` is `[M, K]` sharded on rows (`Shard(0)`, local
    /// `[m_r, K]`), `w` this rank's `[K, n_r]` (a column shard of the weight). The result is
    /// `[M, n_r]` on every rank: the product, sharded on columns (`Shard(1)`).
    ///
    /// # Errors
    /// On every rank: [`Error::UnsupportedPlacement`] unless `self` is a 2-D `Shard(0)` tensor;
    /// [`Error::InnerDimMismatch`] naming a rank whose `w` does not have `K` rows; and as every
    /// collective.
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
        self.gather_products(ws, true)
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
        Ok(self.gather_products(&[w], false)?.remove(0))
    }

    fn gather_products(&self, ws: &[&Tensor<T>], fused: bool) -> Result<Vec<Self>> {
        require(
            self,
            "all_gather_matmul",
            &[Placement::Shard(0)],
            "a 2-D Shard(0) tensor [m_r, K]",
        )?;
        if let Some(world) = self.gpus() {
            return self.gpu_gather_products(world, ws, fused);
        }
        let (views, problem) = weight_views(ws);
        let x = self.local.view2("all_gather_matmul")?;
        let out = all_gather_matmul_checked(self.rank, x, &views, problem, fused)?;
        let m: usize = out.row_counts.iter().sum();
        Ok(out
            .outputs
            .into_iter()
            .zip(out.col_counts)
            .map(|(local, cols)| {
                let global = vec![m, cols.iter().sum()];
                DistTensor::new(
                    self.rank,
                    Tensor::from_array(local.into_dyn()),
                    Placement::Shard(1),
                    global,
                    cols,
                )
            })
            .collect())
    }

    /// `sum over ranks of self_r @ w_r`, reduce-scattered on rows, fused: `self` is `[M, K]`
    /// sharded on columns (`Shard(1)`, local `[M, k_r]`, with `w` this rank's `[k_r, N]`), or a
    /// `Partial` `[M, K]` (with `w` the whole `[K, N]`). The result is `[M, N]` sharded on rows
    /// (`Shard(0)`, split as `numpy.array_split`). The sum runs in rank order: the same bits on
    /// every run.
    ///
    /// # Errors
    /// On every rank: [`Error::UnsupportedPlacement`] unless `self` is a 2-D `Shard(1)` or
    /// `Partial` tensor; [`Error::InnerDimMismatch`] naming a rank whose `w` does not fit; and as
    /// every collective.
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
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn matmul_reduce_scatter(&self, w: &Tensor<T>) -> Result<Self> {
        self.reduce_product(w, true)
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
        self.reduce_product(w, false)
    }

    fn reduce_product(&self, w: &Tensor<T>, fused: bool) -> Result<Self> {
        require(
            self,
            "matmul_reduce_scatter",
            &[Placement::Shard(1), Placement::Partial],
            "a 2-D Shard(1) tensor [M, k_r] or a 2-D Partial tensor [M, K]",
        )?;
        if let Some(world) = self.gpus() {
            return self.gpu_reduce_product(world, w, fused);
        }
        let (mut views, problem) = weight_views(&[w]);
        let x = self.local.view2("matmul_reduce_scatter")?;
        let local = matmul_reduce_scatter_checked(self.rank, x, views.remove(0), problem, fused)?;
        let m = self.global_shape[0];
        let global = vec![m, local.ncols()];
        let splits = array_split(m, self.rank.num_ranks());
        Ok(DistTensor::new(
            self.rank,
            Tensor::from_array(local.into_dyn()),
            Placement::Shard(0),
            global,
            splits,
        ))
    }
}
