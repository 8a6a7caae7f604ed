//! Local-only updates of a [`DistTensor`]: each rank changes its own part, and nothing is
//! exchanged, since every rank can tell the new layout from what it already knows.

use ndarray::ArrayViewMutD;

use super::{DistTensor, Placement};
use crate::tensor::{Element, Tensor};
use crate::{Error, Result};

impl<'r, T: Element> DistTensor<'r, T> {
    /// `f` applied to this rank's part; the placement stays. No communication.
    ///
    /// `f` may change the sizes of dimensions other than a sharded one (a local product with a
    /// replicated weight changes the last), but not the number of dimensions of a sharded tensor
    /// nor the size of its sharded dimension: the other ranks' sizes along it would be unknown
    /// without an exchange ([`DistTensor::from_local`] does that one). Every rank's `f` must
    /// give the same sizes in the other dimensions; that is not checked here (it would take an
    /// exchange), the next collective op checks the shapes it needs.
    ///
    /// On a `Partial` tensor the result is the sum of the `f`s of the parts: right for linear
    /// maps (a scale), wrong for others (GELU of a partial sum): reduce first. In a GPU world `f`
    /// gets the part on the GPU, where the tensor's math runs (operators, activations, softmax,
    /// norms, sums, casts, permutes, products); a Rust closure over its elements cannot run
    /// there ([`Tensor::try_map`], [`Tensor::try_map_inplace`] and [`Tensor::zip_map`] return a
    /// typed error naming those methods; [`Tensor::to_host`] first to use one).
    ///
    /// # Errors
    /// [`Error::InvalidShape`] on this rank when `f` changed the number of dimensions or the
    /// sharded dimension's size.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{DistTensor, Placement, Tensor, World};
    /// let h = Tensor::<f32>::random(&[6, 8], 1);
    /// let w = Tensor::<f32>::random(&[8, 3], 2);
    /// let outs = World::threads(2)?.run(|rank| {
    ///     let x = DistTensor::from_global(rank, &h, Placement::Shard(0))?;
    ///     let y = x.map_local(|t| t.gelu())?; // elementwise, no exchange
    ///     let z = y.try_map_local(|t| t.matmul(&w))?; // rows stay, columns become 3
    ///     assert_eq!(z.global_shape(), vec![6, 3]);
    ///     z.to_global()
    /// })?;
    /// let want = h.gelu().matmul(&w)?;
    /// assert!(outs[0].as_slice().iter().zip(want.as_slice()).all(|(a, b)| (a - b).abs() < 1e-5));
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn map_local<U: Element>(
        &self,
        f: impl FnOnce(&Tensor<T>) -> Tensor<U>,
    ) -> Result<DistTensor<'r, U>> {
        self.try_map_local(|t| Ok(f(t)))
    }

    /// [`DistTensor::map_local`] with a fallible `f` (a softmax, a product).
    ///
    /// # Errors
    /// `f`'s error, and as [`DistTensor::map_local`].
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{DistTensor, Placement, Tensor, World};
    /// let scores = Tensor::<f64>::random(&[4, 5], 1);
    /// World::threads(2)?.run(|rank| {
    ///     let s = DistTensor::from_global(rank, &scores, Placement::Shard(0))?;
    ///     let p = s.try_map_local(|t| t.softmax(1))?;
    ///     let total = p.local().sum();
    ///     assert!((total - p.local().shape()[0] as f64).abs() < 1e-12); // each row sums to 1
    ///     Ok(())
    /// })?;
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn try_map_local<U: Element>(
        &self,
        f: impl FnOnce(&Tensor<T>) -> Result<Tensor<U>>,
    ) -> Result<DistTensor<'r, U>> {
        let out = f(&self.local)?;
        self.with_local("DistTensor::map_local", out)
    }

    /// `f` applied to this rank's parts of `self` and `other`, which must have the same
    /// placement, global shape and split (a residual add of two row-sharded tensors). No
    /// communication. The result keeps `self`'s placement; `f`'s output follows the rules of
    /// [`DistTensor::map_local`].
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the two are laid out differently (placements, global
    /// shapes or splits differ) or belong to different ranks; as [`DistTensor::map_local`].
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{DistTensor, Placement, Tensor, World};
    /// let (a, b) = (Tensor::<f32>::random(&[5, 4], 1), Tensor::<f32>::random(&[5, 4], 2));
    /// let outs = World::threads(3)?.run(|rank| {
    ///     let x = DistTensor::from_global(rank, &a, Placement::Shard(0))?;
    ///     let y = DistTensor::from_global(rank, &b, Placement::Shard(0))?;
    ///     x.zip_local(&y, |x, y| x + y)?.to_global()
    /// })?;
    /// assert_eq!(outs[0], &a + &b);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn zip_local<V: Element, U: Element>(
        &self,
        other: &DistTensor<'r, V>,
        f: impl FnOnce(&Tensor<T>, &Tensor<V>) -> Tensor<U>,
    ) -> Result<DistTensor<'r, U>> {
        self.try_zip_local(other, |a, b| Ok(f(a, b)))
    }

    /// [`DistTensor::zip_local`] with a fallible `f`.
    ///
    /// # Errors
    /// `f`'s error, and as [`DistTensor::zip_local`].
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{DistTensor, Placement, Split, Tensor, World};
    /// let (a, b) = (Tensor::<f32>::random(&[5, 4], 1), Tensor::<f32>::random(&[5, 4], 2));
    /// World::threads(2)?.run(|rank| {
    ///     let x = DistTensor::from_global(rank, &a, Placement::Shard(0))?; // rows 3, 2
    ///     let y = DistTensor::from_global_split(rank, &b, 0, vec![1, 4])?;
    ///     assert!(x.try_zip_local(&y, |x, y| x.zip_map(y, |p, q| p * q)).is_err());
    ///     let y = y.redistribute_split(0, Split::Even)?; // line the rows up
    ///     assert!(x.try_zip_local(&y, |x, y| x.zip_map(y, |p, q| p * q)).is_ok());
    ///     Ok(())
    /// })?;
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn try_zip_local<V: Element, U: Element>(
        &self,
        other: &DistTensor<'r, V>,
        f: impl FnOnce(&Tensor<T>, &Tensor<V>) -> Result<Tensor<U>>,
    ) -> Result<DistTensor<'r, U>> {
        const OP: &str = "DistTensor::zip_local";
        let me = self.rank.rank();
        let invalid = |reason: String| Error::InvalidArgument { op: OP, rank: me, reason };
        if !std::ptr::eq(self.rank, other.rank) {
            return Err(invalid("the two tensors belong to different ranks".to_string()));
        }
        if (self.placement, &self.global_shape, &self.splits)
            != (other.placement, &other.global_shape, &other.splits)
        {
            return Err(invalid(format!(
                "the tensors are laid out differently: {} of {:?} split {:?}, and {} of {:?} \
                 split {:?}; redistribute one to match the other",
                self.placement,
                self.global_shape,
                self.splits,
                other.placement,
                other.global_shape,
                other.splits
            )));
        }
        let out = f(&self.local, &other.local)?;
        self.with_local(OP, out)
    }

    /// This rank's part, mutably, as an ndarray view: its shape cannot change, so the layout
    /// the ranks agreed on stays true. No communication. If another tensor shares the elements
    /// (a replicated part shares the global tensor), they are copied first.
    ///
    /// # Panics
    /// In a GPU world, where the part lives on the GPU (as every host method of a GPU tensor).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{DistTensor, Placement, Tensor, World};
    /// let global = Tensor::<f32>::zeros(&[4, 2]);
    /// let outs = World::threads(2)?.run(|rank| {
    ///     let mut x = DistTensor::from_global(rank, &global, Placement::Shard(0))?;
    ///     x.local_mut().fill(rank.rank() as f32 + 1.0);
    ///     x.to_global()
    /// })?;
    /// assert_eq!(outs[0].as_slice(), &[1., 1., 1., 1., 2., 2., 2., 2.]);
    /// assert!(global.as_slice().iter().all(|&v| v == 0.0)); // untouched
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn local_mut(&mut self) -> ArrayViewMutD<'_, T> {
        self.local.view_mut()
    }

    /// The same tensor in another element type (each part converted on its rank, through f64,
    /// rounded once). No communication. In a GPU world the part is converted on the GPU.
    ///
    /// # Errors
    /// None today; a `Result` so that a failing device can report.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{DistTensor, Placement, Tensor, World};
    /// use half::bf16;
    /// let global = Tensor::<f32>::random(&[3, 4], 1);
    /// let outs = World::threads(2)?.run(|rank| {
    ///     let x = DistTensor::from_global(rank, &global, Placement::Shard(1))?;
    ///     let b = x.cast::<bf16>()?;
    ///     assert_eq!(b.placement(), x.placement());
    ///     b.to_global()
    /// })?;
    /// assert_eq!(outs[0], global.cast::<bf16>());
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn cast<U: Element>(&self) -> Result<DistTensor<'r, U>> {
        // On a GPU the cast runs there.
        let local = self.local.cast();
        Ok(DistTensor::new(
            self.rank,
            local,
            self.placement,
            self.global_shape.clone(),
            self.splits.clone(),
        )
        .with_rows_from(self.rows_from.clone()))
    }

    /// `self` with its part replaced by `local`, checked as [`DistTensor::map_local`] says.
    fn with_local<U: Element>(
        &self,
        op: &'static str,
        local: Tensor<U>,
    ) -> Result<DistTensor<'r, U>> {
        let (old, new) = (self.local.shape(), local.shape());
        let mut global = new.to_vec();
        if let Placement::Shard(d) = self.placement {
            if new.len() != old.len() || new[d] != old[d] {
                return Err(Error::InvalidShape {
                    op,
                    reason: format!(
                        "rank {}: the local part went from {old:?} to {new:?}; a {} tensor keeps \
                         its number of dimensions and its size along dimension {d} in a local \
                         update (DistTensor::from_local exchanges new sizes)",
                        self.rank.rank(),
                        self.placement
                    ),
                });
            }
            global[d] = self.global_shape[d];
        }
        let rows_from =
            self.rows_from.clone().and_then(|r| r.after_reshape(&self.global_shape, &global));
        Ok(DistTensor::new(self.rank, local, self.placement, global, self.splits.clone())
            .with_rows_from(rows_from))
    }
}
