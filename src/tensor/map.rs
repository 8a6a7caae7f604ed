//! Elementwise maps: [`Tensor::map`] over one tensor, [`Tensor::zip_map`] over two, broadcast as
//! numpy and ndarray broadcast (trailing dimensions aligned; a dimension of 1 stretches).

use ndarray::{IxDyn, Zip};

use super::{Element, Tensor};
use crate::{Error, Result};

/// The shape two shapes broadcast to, numpy's rule: align the trailing dimensions; each pair must
/// be equal or one of them 1. `None` when they do not broadcast.
pub(crate) fn broadcast_shape(a: &[usize], b: &[usize]) -> Option<Vec<usize>> {
    let ndim = a.len().max(b.len());
    let dim = |s: &[usize], i: usize| if i < ndim - s.len() { 1 } else { s[i - (ndim - s.len())] };
    (0..ndim)
        .map(|i| match (dim(a, i), dim(b, i)) {
            (x, y) if x == y => Some(x),
            (1, y) => Some(y),
            (x, 1) => Some(x),
            _ => None,
        })
        .collect()
}

/// The error for shapes that do not broadcast.
pub(crate) fn broadcast_error(op: &'static str, a: &[usize], b: &[usize]) -> Error {
    Error::InvalidShape {
        op,
        reason: format!(
            "shapes {a:?} and {b:?} do not broadcast (trailing dimensions must be equal or 1)"
        ),
    }
}

/// The error for a Rust closure given a tensor on a GPU (`map`, `zip_map`): closures run on the
/// host, so the GPU's own methods say what to compute there.
pub(crate) fn closure_on_gpu(op: &'static str, device: crate::Device) -> Error {
    Error::DeviceUnavailable {
        op,
        device: device.to_string(),
        reason: "a Rust closure cannot run on a GPU: use the tensor's GPU methods (+ - * / with \
                 tensors or scalars, neg, gelu, gelu_tanh, silu, relu, softmax, sum, mean, \
                 sum_axis, mean_axis, rms_norm, layer_norm, cast, permute, transpose, reshape, \
                 matmul), or call to_host() first"
            .into(),
    }
}

/// `Ok` for a tensor in host memory; for one on a device, the typed error of an op that has no
/// device kernel yet (indexing, joining, scans, top-k): it names the op and the way out.
pub(crate) fn require_host<T: Element>(op: &'static str, t: &Tensor<T>) -> Result<()> {
    if t.is_on_host() {
        return Ok(());
    }
    Err(Error::DeviceUnavailable {
        op,
        device: t.device().to_string(),
        reason: "this op runs on the host only for now: call Tensor::to_host() first".into(),
    })
}

impl<T: Element> Tensor<T> {
    /// `f` applied to every element, in a new tensor of the same shape.
    ///
    /// `f` sees the elements as they are; for a half type, widen inside `f` to compute in f32
    /// (as the crate's own elementwise ops do, rounding once).
    ///
    /// # Panics
    /// If the output cannot be allocated (as [`Tensor::zeros`]); the elementwise ops built on
    /// `map` (activations, operators) do the same. On a tensor that lives on a GPU, where a Rust
    /// closure cannot run: [`Tensor::try_map`] returns that as an error naming the GPU methods.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::Tensor;
    /// let t = Tensor::<f32>::from_shape_vec(&[3], vec![1.0, -2.0, 3.0])?;
    /// assert_eq!(t.map(|x| x.abs()).as_slice(), &[1.0, 2.0, 3.0]);
    /// // A map may change the element type.
    /// let halves = t.map(|x| half::bf16::from_f32(x / 2.0));
    /// assert_eq!(halves.as_slice()[1].to_f32(), -1.0);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    #[track_caller]
    pub fn map<U: Element>(&self, f: impl FnMut(T) -> U) -> Tensor<U> {
        self.try_map(f).unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`Tensor::map`], or an error where `f` cannot run.
    ///
    /// # Errors
    /// [`Error::DeviceUnavailable`] for a tensor on a GPU (a Rust closure runs on the host): the
    /// message names the GPU methods to use instead;
    /// [`Error::OutOfMemory`](crate::Error::OutOfMemory) when the output cannot be allocated.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::Tensor;
    /// let t = Tensor::<f32>::from_shape_vec(&[2], vec![1.0, -2.0])?;
    /// assert_eq!(t.try_map(|x| x * 3.0)?.as_slice(), &[3.0, -6.0]);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn try_map<U: Element>(&self, mut f: impl FnMut(T) -> U) -> Result<Tensor<U>> {
        if !self.is_on_host() {
            return Err(closure_on_gpu("Tensor::map", self.device()));
        }
        let mut out = Tensor::<U>::scratch("Tensor::map", self.shape())?;
        for (o, &x) in out.as_mut_slice().iter_mut().zip(self.as_slice()) {
            *o = f(x);
        }
        Ok(out)
    }

    /// `f` applied to every element in place.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::Tensor;
    /// let mut t = Tensor::<f64>::from_shape_vec(&[2], vec![1.0, 4.0])?;
    /// t.map_inplace(|x| x.sqrt());
    /// assert_eq!(t.as_slice(), &[1.0, 2.0]);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    ///
    /// # Panics
    /// On a tensor that lives on a GPU, where a Rust closure cannot run:
    /// [`Tensor::try_map_inplace`] returns that as an error naming the GPU methods.
    #[track_caller]
    pub fn map_inplace(&mut self, f: impl FnMut(T) -> T) {
        self.try_map_inplace(f).unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`Tensor::map_inplace`], or an error where `f` cannot run (the tensor is left as it was).
    ///
    /// # Errors
    /// [`Error::DeviceUnavailable`] for a tensor on a GPU (a Rust closure runs on the host): the
    /// message names the GPU methods to use instead.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::Tensor;
    /// let mut t = Tensor::<f32>::from_shape_vec(&[2], vec![1.0, -2.0])?;
    /// t.try_map_inplace(|x| x * 3.0)?;
    /// assert_eq!(t.as_slice(), &[3.0, -6.0]);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn try_map_inplace(&mut self, mut f: impl FnMut(T) -> T) -> Result<()> {
        if !self.is_on_host() {
            return Err(closure_on_gpu("Tensor::map_inplace", self.device()));
        }
        for x in self.as_mut_slice() {
            *x = f(*x);
        }
        Ok(())
    }

    /// `f` applied to pairs of elements of `self` and `other`, broadcast to a common shape as
    /// numpy and ndarray broadcast (trailing dimensions aligned; a dimension of 1 stretches).
    ///
    /// # Errors
    /// [`Error::InvalidShape`] when the shapes do not broadcast;
    /// [`Error::OutOfMemory`] when the output cannot be allocated;
    /// [`Error::DeviceUnavailable`] when either lives on a GPU (a Rust closure runs on the host):
    /// the message names the GPU methods to use instead.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::Tensor;
    /// let x = Tensor::<f32>::from_shape_vec(&[2, 3], vec![1., 2., 3., 4., 5., 6.])?;
    /// let row = Tensor::<f32>::from_shape_vec(&[3], vec![10., 20., 30.])?;
    /// let y = x.zip_map(&row, |a, b| a * b)?; // the row stretches over both rows of x
    /// assert_eq!(y.shape(), &[2, 3]);
    /// assert_eq!(y.as_slice(), &[10., 40., 90., 40., 100., 180.]);
    /// assert!(x.zip_map(&Tensor::<f32>::zeros(&[2]), |a, b| a + b).is_err());
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn zip_map<V: Element, U: Element>(
        &self,
        other: &Tensor<V>,
        mut f: impl FnMut(T, V) -> U,
    ) -> Result<Tensor<U>> {
        for device in [self.device(), other.device()] {
            if device != crate::Device::Host {
                return Err(closure_on_gpu("Tensor::zip_map", device));
            }
        }
        let (a, b) = (self.shape(), other.shape());
        if a == b {
            let mut out = Tensor::<U>::scratch("Tensor::zip_map", a)?;
            let pairs = self.as_slice().iter().zip(other.as_slice());
            for (o, (&x, &y)) in out.as_mut_slice().iter_mut().zip(pairs) {
                *o = f(x, y);
            }
            return Ok(out);
        }
        let shape =
            broadcast_shape(a, b).ok_or_else(|| broadcast_error("Tensor::zip_map", a, b))?;
        let (x, y) = (self.view(), other.view());
        let x = x.broadcast(IxDyn(&shape)).expect("checked by broadcast_shape");
        let y = y.broadcast(IxDyn(&shape)).expect("checked by broadcast_shape");
        let mut out = Tensor::<U>::scratch("Tensor::zip_map", &shape)?;
        Zip::from(out.view_mut()).and(&x).and(&y).for_each(|o, &x, &y| *o = f(x, y));
        Ok(out)
    }

    /// `f(self_element, other_element)` written into `self`, with `other` broadcast to `self`'s
    /// shape. Returns `false` (and changes nothing) when it does not broadcast to it.
    pub(crate) fn zip_assign<V: Element>(
        &mut self,
        other: &Tensor<V>,
        mut f: impl FnMut(T, V) -> T,
    ) -> bool {
        if self.shape() == other.shape() {
            for (x, &y) in self.as_mut_slice().iter_mut().zip(other.as_slice()) {
                *x = f(*x, y);
            }
            return true;
        }
        let shape = self.shape().to_vec();
        let y = other.view();
        let Some(y) = y.broadcast(IxDyn(&shape)) else {
            return false;
        };
        Zip::from(self.view_mut()).and(&y).for_each(|x, &y| *x = f(*x, y));
        true
    }
}

#[cfg(test)]
mod tests {
    use super::broadcast_shape;

    #[test]
    fn broadcast_shapes_follow_numpy() {
        assert_eq!(broadcast_shape(&[2, 3], &[3]), Some(vec![2, 3]));
        assert_eq!(broadcast_shape(&[4, 1, 5], &[3, 1]), Some(vec![4, 3, 5]));
        assert_eq!(broadcast_shape(&[], &[2]), Some(vec![2]));
        assert_eq!(broadcast_shape(&[0, 1], &[1, 7]), Some(vec![0, 7]));
        assert_eq!(broadcast_shape(&[2, 3], &[2]), None);
        assert_eq!(broadcast_shape(&[0], &[2]), None);
    }
}
