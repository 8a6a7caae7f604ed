//! Conversions between [`Tensor`] and ndarray arrays of any dimension, and vectors.

use ndarray::{ArcArray, Array, ArrayBase, ArrayD, ArrayView, ArrayViewMut, Data, Dimension};

use super::{Element, Tensor};

/// Takes the array without a copy when it is row-major (any dimension type).
///
/// # Examples
/// ```
/// use dist_tensor::Tensor;
/// use ndarray::array;
/// let t = Tensor::from(array![[1.0f32, 2.0], [3.0, 4.0]]); // an Array2, no into_dyn()
/// assert_eq!(t.shape(), &[2, 2]);
/// ```
impl<T: Element, D: Dimension> From<Array<T, D>> for Tensor<T> {
    fn from(array: Array<T, D>) -> Self {
        Tensor::from_array(array.into_dyn())
    }
}

/// Copies the viewed elements, in row-major order.
///
/// # Examples
/// ```
/// use dist_tensor::Tensor;
/// use ndarray::array;
/// let a = array![[1.0f64, 2.0], [3.0, 4.0]];
/// let t = Tensor::from(a.t()); // a transposed view
/// assert_eq!(t.as_slice(), &[1.0, 3.0, 2.0, 4.0]);
/// ```
impl<T: Element, D: Dimension> From<ArrayView<'_, T, D>> for Tensor<T> {
    fn from(view: ArrayView<'_, T, D>) -> Self {
        Tensor::from_array(view.into_dyn().as_standard_layout().into_owned())
    }
}

/// Copies the viewed elements, in row-major order.
///
/// # Examples
/// ```
/// use dist_tensor::Tensor;
/// use ndarray::Array1;
/// let mut a = Array1::<f32>::zeros(3);
/// let t = Tensor::from(a.view_mut());
/// assert_eq!(t.shape(), &[3]);
/// ```
impl<T: Element, D: Dimension> From<ArrayViewMut<'_, T, D>> for Tensor<T> {
    fn from(view: ArrayViewMut<'_, T, D>) -> Self {
        Tensor::from(view.into_dyn().view())
    }
}

/// Copies the array's elements, in row-major order.
///
/// # Examples
/// ```
/// use dist_tensor::Tensor;
/// use ndarray::array;
/// let a = array![1.0f32, 2.0, 3.0];
/// let t = Tensor::from(&a);
/// assert_eq!(t.as_slice(), a.as_slice().unwrap());
/// ```
impl<T: Element, S: Data<Elem = T>, D: Dimension> From<&ArrayBase<S, D>> for Tensor<T> {
    fn from(array: &ArrayBase<S, D>) -> Self {
        Tensor::from(array.view())
    }
}

/// Shares the array's elements without a copy when it is row-major (copy-on-write, as tensors
/// share theirs).
///
/// # Examples
/// ```
/// use dist_tensor::Tensor;
/// use ndarray::{ArcArray, IxDyn};
/// let shared = ArcArray::<f32, _>::zeros(IxDyn(&[2, 3]));
/// let t = Tensor::from(shared.clone());
/// assert_eq!(t.as_slice().as_ptr(), shared.as_ptr());
/// ```
impl<T: Element, D: Dimension> From<ArcArray<T, D>> for Tensor<T> {
    fn from(array: ArcArray<T, D>) -> Self {
        if array.is_standard_layout() {
            Tensor::from_shared(array.into_dyn())
        } else {
            Tensor::from(array.view())
        }
    }
}

/// A 1-D tensor.
///
/// # Examples
/// ```
/// use dist_tensor::Tensor;
/// let t = Tensor::from(vec![1.0f32, 2.0]);
/// assert_eq!(t.shape(), &[2]);
/// ```
impl<T: Element> From<Vec<T>> for Tensor<T> {
    fn from(data: Vec<T>) -> Self {
        Tensor::from_array(ArrayD::from_shape_vec(vec![data.len()], data).expect("1-D"))
    }
}

/// The tensor's elements as an ndarray array, without a copy unless another tensor shares them.
///
/// # Examples
/// ```
/// use dist_tensor::Tensor;
/// use ndarray::ArrayD;
/// let a: ArrayD<f32> = Tensor::<f32>::zeros(&[2, 2]).into();
/// assert_eq!(a.shape(), &[2, 2]);
/// ```
impl<T: Element> From<Tensor<T>> for ArrayD<T> {
    fn from(t: Tensor<T>) -> Self {
        t.into_array()
    }
}
