//! [`Var`]: a tensor that may be tracked, and the helpers every op uses to record its backward
//! function only when one of its inputs is tracked.

use super::graph::{Leaf, LeafHook, Node, Tracked, backward_from};
use crate::{Element, Error, Result, Tensor};

/// A tensor in a differentiable computation: a value, and, when tracked, its node on the tape.
///
/// [`Var::param`] makes a tracked leaf (a parameter), [`Var::constant`] an untracked value
/// (an input, a target). An op on `Var`s records its backward function only when one of its
/// inputs is tracked; on untracked values it is the [`Tensor`] op and nothing more, so inference
/// keeps no tape. [`Var::backward`] differentiates a result with respect to every tracked leaf it
/// depends on; [`Var::grad`] reads a leaf's gradient. Gradients of leaves accumulate over
/// backward passes until [`Var::zero_grad`].
///
/// The lifetime `'a` is that of what backward functions may borrow: the rank of a distributed
/// op. Local computations use any lifetime (`'static` if asked).
///
/// A `Var` and its graph belong to one thread (one rank): a node is shared through `Rc`.
///
/// # Examples
/// ```
/// use dist_tensor::autograd::Var;
/// use dist_tensor::Tensor;
/// let w = Var::param(Tensor::<f64>::from_shape_vec(&[2], vec![1.0, 2.0])?);
/// let x = Var::constant(Tensor::<f64>::from_shape_vec(&[2], vec![3.0, 4.0])?);
/// let loss = (&w * &x).sum(); // 1*3 + 2*4
/// assert_eq!(loss.value().as_slice(), &[11.0]);
/// loss.backward()?;
/// assert_eq!(w.grad().unwrap().as_slice(), &[3.0, 4.0]);
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub struct Var<'a, T: Element> {
    pub(crate) value: Tensor<T>,
    pub(crate) node: Option<Tracked<'a, T>>,
}

impl<T: Element> Clone for Var<'_, T> {
    fn clone(&self) -> Self {
        Var { value: self.value.clone(), node: self.node.clone() }
    }
}

impl<T: Element> std::fmt::Debug for Var<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Var")
            .field("shape", &self.value.shape())
            .field("tracked", &self.is_tracked())
            .finish()
    }
}

impl<T: Element> From<Tensor<T>> for Var<'_, T> {
    fn from(value: Tensor<T>) -> Self {
        Var::constant(value)
    }
}

impl<'a, T: Element> Var<'a, T> {
    /// An untracked value: no gradient flows to it, and ops on it record nothing.
    pub fn constant(value: Tensor<T>) -> Self {
        Var { value, node: None }
    }

    /// A tracked leaf: a parameter whose gradient [`Var::backward`] computes.
    pub fn param(value: Tensor<T>) -> Self {
        let node = Tracked::Leaf(Leaf::new(value.shape()));
        Var { value, node: Some(node) }
    }

    /// A tracked leaf of `value` whose gradient accumulates in `leaf` (a parameter kept outside
    /// the graph, as an `nn` layer keeps its own).
    pub(crate) fn from_leaf(value: Tensor<T>, leaf: std::sync::Arc<Leaf<T>>) -> Self {
        Var { value, node: Some(Tracked::Leaf(leaf)) }
    }

    /// The leaf holding this value's gradient, if it is a tracked leaf.
    pub(crate) fn leaf(&self) -> Option<std::sync::Arc<Leaf<T>>> {
        match &self.node {
            Some(Tracked::Leaf(l)) => Some(l.clone()),
            _ => None,
        }
    }

    /// The value.
    pub fn value(&self) -> &Tensor<T> {
        &self.value
    }

    /// The value, without the node.
    pub fn into_value(self) -> Tensor<T> {
        self.value
    }

    /// The shape of the value.
    pub fn shape(&self) -> &[usize] {
        self.value.shape()
    }

    /// Whether the value is tracked (a parameter, or computed from one).
    pub fn is_tracked(&self) -> bool {
        self.node.is_some()
    }

    /// The same value, untracked: gradients stop here.
    pub fn detach(&self) -> Self {
        Var::constant(self.value.clone())
    }

    /// The gradient accumulated in this leaf by the backward passes so far (`None` if untracked,
    /// if no backward pass reached it, or if it is not a leaf: interior gradients are freed as
    /// the pass goes).
    pub fn grad(&self) -> Option<Tensor<T>> {
        self.node.as_ref().and_then(|n| n.grad())
    }

    /// Takes the accumulated gradient out, leaving none.
    pub fn take_grad(&self) -> Option<Tensor<T>> {
        self.node.as_ref().and_then(|n| n.take_grad())
    }

    /// Replaces the accumulated gradient of a tracked value (a clip, a sum over ranks); nothing
    /// for an untracked one.
    pub fn set_grad(&self, grad: Option<Tensor<T>>) {
        if let Some(n) = &self.node {
            n.set_grad(grad);
        }
    }

    /// Forgets the accumulated gradient.
    pub fn zero_grad(&self) {
        if let Some(n) = &self.node {
            n.set_grad(None);
        }
    }

    /// Replaces the value of a leaf (an optimizer's step), keeping its node and gradient.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] when the shape changes.
    pub fn set_value(&mut self, value: Tensor<T>) -> Result<()> {
        if value.shape() != self.value.shape() {
            return Err(Error::InvalidShape {
                op: "Var::set_value",
                reason: format!(
                    "the new value has shape {:?}, the variable {:?}",
                    value.shape(),
                    self.value.shape()
                ),
            });
        }
        self.value = value;
        Ok(())
    }

    /// Differentiates this value with respect to every tracked leaf it depends on, seeding its
    /// gradient with ones (for a scalar loss, `d loss / d loss = 1`; for any other shape, the
    /// gradient of the sum of its elements).
    ///
    /// # Errors
    /// An op's backward error; [`Error::InvalidArgument`] when the graph was differentiated
    /// already (its saved values are freed) or the value is untracked.
    pub fn backward(&self) -> Result<()> {
        // The seed lives where the value does (a loss on a GPU gets its ones there).
        let ones = Tensor::<T>::zeros(self.shape()).map(|_| T::from_f64(1.0));
        self.backward_with(ones.into_place_of(&self.value)?)
    }

    /// [`Var::backward`] seeded with `grad`, the gradient of some scalar with respect to this
    /// value.
    ///
    /// # Errors
    /// As [`Var::backward`]; [`Error::InvalidShape`] when `grad`'s shape is not the value's.
    pub fn backward_with(&self, grad: Tensor<T>) -> Result<()> {
        self.backward_hooked(grad, None)
    }

    /// [`Var::backward_with`], telling `hook` each leaf's number ([`Leaf::id`]) as soon as the
    /// leaf's gradient is complete (see `graph::backward_from`).
    pub(crate) fn backward_hooked(
        &self,
        grad: Tensor<T>,
        hook: Option<LeafHook<'_>>,
    ) -> Result<()> {
        let Some(node) = &self.node else {
            return Err(Error::InvalidArgument {
                op: "Var::backward",
                rank: 0,
                reason: "the value is untracked: it depends on no parameter".to_string(),
            });
        };
        node.accumulate(grad)?;
        match node {
            Tracked::Leaf(leaf) => hook.map_or(Ok(()), |hook| hook(leaf.id())),
            Tracked::Op(_) => backward_from(node.as_any(), hook),
        }
    }
}

/// The gradients an op's backward function returns, one per input (`None` where an input is
/// untracked or gets no gradient).
pub(crate) type Grads<T> = Vec<Option<Tensor<T>>>;

/// `value`, the output of an op on `inputs`, tracked when any input is: `backward` then gets the
/// output's gradient and which inputs need one, and returns their gradients.
pub(crate) fn record<'a, T: Element>(
    value: Tensor<T>,
    inputs: &[&Var<'a, T>],
    backward: impl FnOnce(&Tensor<T>, &[bool]) -> Result<Grads<T>> + 'a,
) -> Var<'a, T> {
    let nodes: Vec<Option<Tracked<'a, T>>> = inputs.iter().map(|v| v.node.clone()).collect();
    if nodes.iter().all(Option::is_none) {
        return Var::constant(value);
    }
    let parents = nodes.iter().flatten().map(Tracked::as_any).collect();
    let need: Vec<bool> = nodes.iter().map(Option::is_some).collect();
    let node = Node::interior(
        value.shape(),
        parents,
        Box::new(move |g: &Tensor<T>| {
            let grads = backward(g, &need)?;
            for (node, grad) in nodes.iter().zip(grads) {
                if let (Some(node), Some(grad)) = (node, grad) {
                    node.accumulate(grad)?;
                }
            }
            Ok(())
        }),
    );
    Var { value, node: Some(Tracked::Op(node)) }
}

/// `value`, computed from `input` of another element type, tracked when `input` is.
pub(crate) fn record_from<'a, T: Element, U: Element>(
    value: Tensor<U>,
    input: &Var<'a, T>,
    backward: impl FnOnce(&Tensor<U>) -> Result<Tensor<T>> + 'a,
) -> Var<'a, U> {
    let Some(parent) = input.node.clone() else {
        return Var::constant(value);
    };
    let node = Node::interior(
        value.shape(),
        vec![parent.as_any()],
        Box::new(move |g: &Tensor<U>| parent.accumulate(backward(g)?)),
    );
    Var { value, node: Some(Tracked::Op(node)) }
}
