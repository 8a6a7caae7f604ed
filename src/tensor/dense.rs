//! [`Tensor`]: a row-major, contiguous n-dimensional array on ndarray.
//!
//! Host elements are shared, copy-on-write (ndarray's `ArcArray`): cloning a tensor is cheap, and
//! the first write through a clone copies it. Replicated weights and `DistTensor` parts that every
//! rank holds whole share one buffer, and a reshape shares its input's.

use ndarray::{ArcArray, Array2, ArrayD, ArrayView2, ArrayViewD, ArrayViewMutD, IxDyn};
use rand::{Rng, SeedableRng, rngs::StdRng};

use super::storage::Storage;
use super::{Element, matmul, pool};
use crate::{Error, Result};

/// A local n-dimensional tensor, always row-major and contiguous, in host memory or (feature
/// `cuda`) on a GPU.
///
/// On a GPU the local math runs there, by kernels of its own: the arithmetic operators (with
/// tensors, broadcast, and with scalars), negation, the activations, `softmax`, `sum` / `mean`
/// (whole and per axis), `rms_norm`, `layer_norm`, `cast`, `permute` / `transpose` /
/// `reshape` / `insert_axis` and `matmul` (batched too); the result stays on that GPU.
///
/// # Panics
/// Methods that read or write the elements on the host (`as_slice`, `view`, `map`, ...) panic
/// on a tensor that lives on a GPU: call [`Tensor::to_host`] first ([`Tensor::try_map`],
/// [`Tensor::zip_map`] and [`Tensor::view2`] return a typed error instead).
///
/// # Examples
/// ```
/// use dist_tensor::Tensor;
///
/// let t = Tensor::<f32>::from_shape_vec(&[2, 3], vec![1., 2., 3., 4., 5., 6.])?;
/// assert_eq!(t.shape(), &[2, 3]);
/// let p = t.permute(&[1, 0])?;
/// assert_eq!(p.as_slice(), &[1., 4., 2., 5., 3., 6.]);
/// # Ok::<(), dist_tensor::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor<T: Element> {
    pub(super) data: Storage<T>,
}

impl<T: Element> Drop for Tensor<T> {
    /// Gives a large buffer back to the cache in `tensor::pool`, for the next output to reuse,
    /// when this tensor was the last to share it.
    fn drop(&mut self) {
        if let Storage::Host(array) = &mut self.data
            && let Ok(data) = std::mem::replace(array, empty()).try_into_owned_nocopy()
        {
            pool::give(data.into_raw_vec_and_offset().0);
        }
    }
}

/// An array that owns no allocation.
fn empty<T: Clone>() -> ArcArray<T, IxDyn> {
    ArrayD::from_shape_vec(IxDyn(&[0]), Vec::new()).expect("an empty array").into_shared()
}

impl<T: Element> Tensor<T> {
    /// Wraps an ndarray array of any dimension (`Array2` as well as `ArrayD`), copying it into
    /// row-major order if it is not already.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::Tensor;
    /// use ndarray::array;
    ///
    /// let a = array![[1.0f64, 2.0], [3.0, 4.0]].reversed_axes(); // an Array2
    /// let t = Tensor::from_array(a);
    /// assert_eq!(t.as_slice(), &[1.0, 3.0, 2.0, 4.0]);
    /// assert_eq!(Tensor::from_array(array![1.0f32, 2.0, 3.0].into_dyn()).shape(), &[3]);
    /// ```
    pub fn from_array<D: ndarray::Dimension>(array: ndarray::Array<T, D>) -> Self {
        let array = array.into_dyn();
        let data = if array.is_standard_layout() {
            array
        } else {
            array.as_standard_layout().into_owned()
        };
        Tensor { data: data.into() }
    }

    /// Wraps shared, row-major host elements without a copy.
    pub(crate) fn from_shared(data: ArcArray<T, IxDyn>) -> Self {
        debug_assert!(data.is_standard_layout());
        Tensor { data: Storage::Host(data) }
    }

    /// A copy of the data as an ndarray array.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::Tensor;
    /// let t = Tensor::<f32>::zeros(&[2, 2]);
    /// assert_eq!(t.to_array().shape(), &[2, 2]);
    /// ```
    // On a device tensor these panic ("call Tensor::to_host()"): the panic names the caller.
    #[track_caller]
    pub fn to_array(&self) -> ArrayD<T> {
        self.data.to_array()
    }

    /// The data as an ndarray array, without a copy unless another tensor shares it.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::Tensor;
    /// let a = Tensor::<f32>::zeros(&[3]).into_array();
    /// assert_eq!(a.len(), 3);
    /// ```
    #[track_caller]
    pub fn into_array(mut self) -> ArrayD<T> {
        std::mem::replace(&mut self.data, Storage::Host(empty())).into_array()
    }

    /// A tensor of `shape` from row-major `data`.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] when `data.len()` is not the product of `shape`.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::Tensor;
    /// assert!(Tensor::<f32>::from_shape_vec(&[2, 2], vec![1.0; 3]).is_err());
    /// ```
    pub fn from_shape_vec(shape: &[usize], data: Vec<T>) -> Result<Self> {
        let len = data.len();
        let data = ArrayD::from_shape_vec(IxDyn(shape), data).map_err(|_| Error::InvalidShape {
            op: "Tensor::from_shape_vec",
            reason: format!("{len} elements do not fill shape {shape:?}"),
        })?;
        Ok(Tensor { data: data.into() })
    }

    /// A tensor of zeros.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::Tensor;
    /// assert!(Tensor::<f64>::zeros(&[2, 3]).as_slice().iter().all(|&x| x == 0.0));
    /// ```
    ///
    /// # Panics
    /// If the tensor cannot be allocated (its size overflows, or the machine cannot hold it):
    /// use [`Tensor::try_zeros`] where the shape comes from data.
    #[track_caller]
    pub fn zeros(shape: &[usize]) -> Self {
        Self::try_zeros(shape).unwrap_or_else(|e| panic!("{e}"))
    }

    /// A tensor of zeros, or an error if it cannot be allocated.
    ///
    /// # Errors
    /// [`Error::OutOfMemory`](crate::Error::OutOfMemory) naming the bytes when the shape's size
    /// overflows or the machine cannot hold it.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{Error, Tensor};
    /// assert_eq!(Tensor::<f32>::try_zeros(&[2, 3])?.len(), 6);
    /// let err = Tensor::<f32>::try_zeros(&[1 << 40, 1 << 30]).unwrap_err();
    /// assert!(matches!(err, Error::OutOfMemory { .. }), "{err}");
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn try_zeros(shape: &[usize]) -> Result<Self> {
        let mut t = Self::scratch("Tensor::zeros", shape)?;
        t.as_mut_slice().fill(T::zero());
        Ok(t)
    }

    /// The number of elements of `shape`, or an out-of-memory error for `op` if it overflows.
    fn checked_len(op: &'static str, shape: &[usize]) -> Result<usize> {
        // ndarray also needs the product of the axes that are not empty to fit an `isize`
        // (`[1 << 40, 0, 1 << 30]` holds no element, yet its strides would overflow).
        let strides = shape
            .iter()
            .filter(|&&d| d != 0)
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .filter(|&n| n <= isize::MAX as usize);
        let len = strides.and_then(|_| shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d)));
        len.ok_or_else(|| crate::Error::OutOfMemory {
            op,
            bytes: usize::MAX,
            what: format!("a tensor of shape {shape:?}: the size overflows"),
        })
    }

    /// A tensor whose values are unspecified (zeros, or what a dropped tensor held), taken from
    /// the buffer cache: for outputs a kernel overwrites entirely.
    pub(crate) fn scratch(op: &'static str, shape: &[usize]) -> Result<Self> {
        let data = pool::take(op, Self::checked_len(op, shape)?)?;
        let data = ArrayD::from_shape_vec(IxDyn(shape), data).map_err(|e| {
            crate::Error::InvalidShape { op, reason: format!("shape {shape:?}: {e}") }
        })?;
        Ok(Tensor { data: data.into() })
    }

    /// A tensor of values drawn uniformly from `[-1, 1)` by a generator seeded with `seed`: the same
    /// seed gives the same tensor on every run and every machine.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::Tensor;
    /// let a = Tensor::<f32>::random(&[4, 5], 7);
    /// assert_eq!(a, Tensor::<f32>::random(&[4, 5], 7));
    /// assert!(a.as_slice().iter().all(|&x| (-1.0..1.0).contains(&x) && x != 0.0));
    /// ```
    ///
    /// # Panics
    /// If the tensor cannot be allocated: use [`Tensor::try_random`] where the shape comes from
    /// data.
    #[track_caller]
    pub fn random(shape: &[usize], seed: u64) -> Self {
        Self::try_random(shape, seed).unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`Tensor::random`], or an error if the tensor cannot be allocated.
    ///
    /// # Errors
    /// [`Error::OutOfMemory`](crate::Error::OutOfMemory) when the shape's size overflows or the
    /// machine cannot hold it.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::Tensor;
    /// assert_eq!(Tensor::<f32>::try_random(&[3, 2], 1)?, Tensor::random(&[3, 2], 1));
    /// assert!(Tensor::<f32>::try_random(&[usize::MAX, 2], 1).is_err());
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn try_random(shape: &[usize], seed: u64) -> Result<Self> {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut t = Self::scratch("Tensor::random", shape)?;
        // Redraw what rounds to 1.0 or 0 in the element type (only the half types ever do), so
        // values stay in [-1, 1) and are never zero.
        let mut draw = || loop {
            let x = T::from_f64(rng.random_range(-1.0..1.0));
            if x.to_f64() < 1.0 && x.to_f64() != 0.0 {
                return x;
            }
        };
        for x in t.as_mut_slice() {
            *x = draw();
        }
        Ok(t)
    }

    /// The shape.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::Tensor;
    /// assert_eq!(Tensor::<f32>::zeros(&[2, 0, 3]).shape(), &[2, 0, 3]);
    /// ```
    pub fn shape(&self) -> &[usize] {
        self.data.shape()
    }

    /// The number of dimensions.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::Tensor;
    /// assert_eq!(Tensor::<f32>::zeros(&[2, 3]).ndim(), 2);
    /// ```
    pub fn ndim(&self) -> usize {
        self.shape().len()
    }

    /// The number of elements.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::Tensor;
    /// assert_eq!(Tensor::<f32>::zeros(&[2, 3]).len(), 6);
    /// ```
    pub fn len(&self) -> usize {
        self.shape().iter().product()
    }

    /// Whether the tensor has no elements.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::Tensor;
    /// assert!(Tensor::<f32>::zeros(&[2, 0]).is_empty());
    /// ```
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The elements in row-major order.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::Tensor;
    /// assert_eq!(Tensor::<f32>::zeros(&[2]).as_slice(), &[0.0, 0.0]);
    /// ```
    #[track_caller]
    pub fn as_slice(&self) -> &[T] {
        self.data.as_slice()
    }

    /// The elements in row-major order, mutably (copied first if another tensor shares them).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::Tensor;
    /// let mut t = Tensor::<f32>::zeros(&[2]);
    /// t.as_mut_slice()[1] = 5.0;
    /// assert_eq!(t.as_slice(), &[0.0, 5.0]);
    /// ```
    #[track_caller]
    pub fn as_mut_slice(&mut self) -> &mut [T] {
        self.data.as_mut_slice()
    }

    /// An ndarray view.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::Tensor;
    /// assert_eq!(Tensor::<f32>::zeros(&[2, 3]).view().ndim(), 2);
    /// ```
    #[track_caller]
    pub fn view(&self) -> ArrayViewD<'_, T> {
        self.data.view()
    }

    /// A mutable ndarray view (the elements are copied first if another tensor shares them).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::Tensor;
    /// let mut t = Tensor::<f32>::zeros(&[2, 2]);
    /// t.view_mut()[[1, 0]] = 3.0;
    /// assert_eq!(t.as_slice(), &[0.0, 0.0, 3.0, 0.0]);
    /// ```
    #[track_caller]
    pub fn view_mut(&mut self) -> ArrayViewMutD<'_, T> {
        self.data.view_mut()
    }

    /// A 2-D view.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] when the tensor is not 2-D; `op` names the caller in the message;
    /// [`Error::DeviceUnavailable`] for a tensor on a GPU (no host view of it exists).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::Tensor;
    /// assert!(Tensor::<f32>::zeros(&[2, 3]).view2("example").is_ok());
    /// assert!(Tensor::<f32>::zeros(&[2]).view2("example").is_err());
    /// ```
    pub fn view2(&self, op: &'static str) -> Result<ArrayView2<'_, T>> {
        if !self.is_on_host() {
            return Err(Error::DeviceUnavailable {
                op,
                device: self.device().to_string(),
                reason: "a host view of a tensor on a GPU: call Tensor::to_host() first".into(),
            });
        }
        self.data.view().into_dimensionality().map_err(|_| Error::InvalidShape {
            op,
            reason: format!("expected a 2-D tensor, got shape {:?}", self.shape()),
        })
    }

    /// The same elements under another shape of equal size (shared, not copied).
    ///
    /// # Errors
    /// [`Error::InvalidShape`] when the sizes differ.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::Tensor;
    /// let t = Tensor::<f32>::random(&[2, 6], 1);
    /// let r = t.reshape(&[3, 4])?;
    /// assert_eq!(r.shape(), &[3, 4]);
    /// assert_eq!(r.as_slice(), t.as_slice());
    /// assert!(t.reshape(&[5]).is_err());
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn reshape(&self, shape: &[usize]) -> Result<Self> {
        let data = self.data.reshaped(shape).ok_or_else(|| Error::InvalidShape {
            op: "Tensor::reshape",
            reason: format!("cannot reshape {:?} into {shape:?}", self.shape()),
        })??;
        Ok(Tensor { data })
    }

    /// Reorders the axes: axis `i` of the result is axis `axes[i]` of `self`. The result is
    /// contiguous again (a copy).
    ///
    /// # Errors
    /// [`Error::InvalidShape`] when `axes` is not a permutation of `0..ndim`.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::Tensor;
    /// let t = Tensor::<f32>::zeros(&[2, 3, 4]);
    /// assert_eq!(t.permute(&[2, 0, 1])?.shape(), &[4, 2, 3]);
    /// assert!(t.permute(&[0, 0, 1]).is_err());
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn permute(&self, axes: &[usize]) -> Result<Self> {
        let mut seen = vec![false; self.ndim()];
        let valid = axes.len() == self.ndim()
            && axes.iter().all(|&a| a < seen.len() && !std::mem::replace(&mut seen[a], true));
        if !valid {
            return Err(Error::InvalidShape {
                op: "Tensor::permute",
                reason: format!("{axes:?} is not a permutation of the axes of {:?}", self.shape()),
            });
        }
        if !self.is_on_host() {
            return super::dispatch::permute(self, axes);
        }
        Ok(Tensor {
            data: self.data.view().permuted_axes(axes).as_standard_layout().into_owned().into(),
        })
    }

    /// Converts every element to another element type (through f64, so exactly where it fits).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::Tensor;
    /// use half::bf16;
    /// let t = Tensor::<f32>::from_shape_vec(&[2], vec![1.0, 0.5])?;
    /// let b = t.cast::<bf16>();
    /// assert_eq!(b.as_slice(), &[bf16::from_f32(1.0), bf16::from_f32(0.5)]);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn cast<U: Element>(&self) -> Tensor<U> {
        if !self.is_on_host() {
            return super::arith::or_panic(super::dispatch::cast::<T, U>(self));
        }
        Tensor { data: self.data.view().mapv(|x| U::from_f64(x.to_f64())).into() }
    }

    /// The matrix product `self @ rhs` on the calling thread: `[m, k] @ [k, n]`, or batched,
    /// `[..., m, k] @ [..., k, n]` with the batch dimensions broadcast as numpy's `matmul`
    /// broadcasts them (a 2-D operand is used for every matrix of the other). Tensors on a GPU
    /// multiply there (cuBLASLt; one GEMM per matrix of a batch).
    ///
    /// # Errors
    /// [`Error::InvalidShape`] when either has fewer than 2 dimensions or the batch dimensions do
    /// not broadcast; [`Error::InnerDimMismatch`] when `k` differs;
    /// [`Error::OutOfMemory`](crate::Error::OutOfMemory) when the output cannot be allocated;
    /// [`Error::InvalidArgument`] for operands on different devices.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::Tensor;
    /// let a = Tensor::<f32>::from_shape_vec(&[1, 2], vec![1.0, 2.0])?;
    /// let b = Tensor::<f32>::from_shape_vec(&[2, 1], vec![3.0, 4.0])?;
    /// assert_eq!(a.matmul(&b)?.as_slice(), &[11.0]);
    /// // Batched: per head, [H, S, D] @ [H, D, S] -> [H, S, S].
    /// let (q, kt) = (Tensor::<f32>::random(&[3, 5, 4], 1), Tensor::<f32>::random(&[3, 4, 5], 2));
    /// assert_eq!(q.matmul(&kt)?.shape(), &[3, 5, 5]);
    /// assert!(q.matmul(&q).is_err()); // inner dimensions 4 and 5
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn matmul(&self, rhs: &Tensor<T>) -> Result<Tensor<T>> {
        match (self.is_on_host(), rhs.is_on_host()) {
            (false, false) if self.ndim() == 2 && rhs.ndim() == 2 => {
                return super::dispatch::matmul(self, rhs);
            }
            (false, false) => {
                let batch = super::batched::check_shapes(self.shape(), rhs.shape())?;
                return super::dispatch::batched_matmul(self, rhs, &batch);
            }
            (true, true) => {}
            _ => {
                return Err(Error::InvalidArgument {
                    op: "Tensor::matmul",
                    rank: 0,
                    reason: format!(
                        "operands on {} and {}: move one first",
                        self.device(),
                        rhs.device()
                    ),
                });
            }
        }
        self.matmul_threads(rhs, 1)
    }

    /// [`Tensor::matmul`] on host tensors, on `threads` threads of the rayon pool.
    ///
    /// # Errors
    /// As [`Tensor::matmul`].
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::Tensor;
    /// let a = Tensor::<f64>::random(&[8, 4], 1);
    /// let b = Tensor::<f64>::random(&[4, 3], 2);
    /// assert_eq!(a.matmul_threads(&b, 2)?.shape(), &[8, 3]);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn matmul_threads(&self, rhs: &Tensor<T>, threads: usize) -> Result<Tensor<T>> {
        if self.ndim() != 2 || rhs.ndim() != 2 {
            return super::batched::matmul_nd(self, rhs, threads);
        }
        let c: Array2<T> =
            matmul(self.view2("Tensor::matmul")?, rhs.view2("Tensor::matmul")?, threads)?;
        Ok(Tensor { data: c.into_dyn().into() })
    }
}
