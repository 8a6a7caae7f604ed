//! The tape: a node per tracked value, created only when an input of an op is tracked, so a
//! forward pass over untracked values builds nothing and keeps nothing.
//!
//! Nodes are numbered in creation order. An op's inputs exist before its output, so walking the
//! nodes reachable from the loss in decreasing number visits every node after all the nodes that
//! use it: each node's gradient is complete before its backward function runs. A leaf's gradient
//! is complete once the last node that uses it has run, which can be long before the walk ends
//! (leaves are made first, so they come last in the walk): [`backward_from`] can tell a hook of
//! each leaf then, as PyTorch's hooks after a gradient's accumulation fire.

use std::cell::RefCell;
use std::collections::HashSet;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use crate::{Element, Error, Result, Tensor};

static NEXT_ID: AtomicU64 = AtomicU64::new(0);

/// A node's backward function: given the gradient of its output, it accumulates the gradients of
/// its inputs into their nodes. Run once, then dropped with what it saved.
pub(crate) type BackwardFn<'a, T> = Box<dyn FnOnce(&Tensor<T>) -> Result<()> + 'a>;

/// An op's output node: its gradient so far, and how to pass it on to its inputs.
pub(crate) struct Node<'a, T: Element> {
    id: u64,
    shape: Vec<usize>,
    grad: RefCell<Option<Tensor<T>>>,
    backward: RefCell<Option<BackwardFn<'a, T>>>,
    parents: Vec<Rc<dyn AnyNode<'a> + 'a>>,
}

/// A leaf (a parameter): only its gradient. It borrows nothing, so one leaf serves graphs of any
/// lifetime, and it may be shared between threads: an `nn` layer's [`Param`](crate::nn::Param)
/// keeps its gradient in one, the layer staying `Send` and its parameter usable in every forward
/// pass as a [`Var`](super::Var) of that pass's lifetime.
pub(crate) struct Leaf<T: Element> {
    id: u64,
    shape: Vec<usize>,
    grad: Mutex<Option<Tensor<T>>>,
}

/// A tracked value's node: a leaf, or an op's output.
pub(crate) enum Tracked<'a, T: Element> {
    Leaf(Arc<Leaf<T>>),
    Op(Rc<Node<'a, T>>),
}

impl<T: Element> Clone for Tracked<'_, T> {
    fn clone(&self) -> Self {
        match self {
            Tracked::Leaf(l) => Tracked::Leaf(l.clone()),
            Tracked::Op(n) => Tracked::Op(n.clone()),
        }
    }
}

/// A leaf as a node of the graph walk (a leaf's `run` does nothing).
struct LeafNode<T: Element>(Arc<Leaf<T>>);

impl<'a, T: Element> AnyNode<'a> for LeafNode<T> {
    fn id(&self) -> u64 {
        self.0.id
    }

    fn is_leaf(&self) -> bool {
        true
    }

    fn parents(&self) -> &[Rc<dyn AnyNode<'a> + 'a>] {
        &[]
    }

    fn run(&self) -> Result<()> {
        Ok(())
    }
}

/// `g` added to `slot`, after checking its shape against `shape`.
fn add_into<T: Element>(slot: &mut Option<Tensor<T>>, shape: &[usize], g: Tensor<T>) -> Result<()> {
    if g.shape() != shape {
        return Err(Error::InvalidShape {
            op: "autograd::backward",
            reason: format!(
                "a gradient of shape {:?} reached a value of shape {:?} (an op's backward \
                 returned the wrong shape)",
                g.shape(),
                shape
            ),
        });
    }
    *slot = Some(match slot.take() {
        None => g,
        Some(sum) => sum + &g,
    });
    Ok(())
}

impl<T: Element> Leaf<T> {
    pub(crate) fn new(shape: &[usize]) -> Arc<Self> {
        Arc::new(Leaf {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            shape: shape.to_vec(),
            grad: Mutex::new(None),
        })
    }

    fn slot(&self) -> std::sync::MutexGuard<'_, Option<Tensor<T>>> {
        // A panic while the gradient was held leaves a whole tensor or none: still usable.
        self.grad.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Its number: the same in every graph it is a leaf of (see [`backward_from`]'s hook).
    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    pub(crate) fn accumulate(&self, g: Tensor<T>) -> Result<()> {
        add_into(&mut self.slot(), &self.shape, g)
    }

    pub(crate) fn grad(&self) -> Option<Tensor<T>> {
        self.slot().clone()
    }

    pub(crate) fn take_grad(&self) -> Option<Tensor<T>> {
        self.slot().take()
    }

    pub(crate) fn set_grad(&self, g: Option<Tensor<T>>) {
        *self.slot() = g;
    }
}

impl<'a, T: Element> Tracked<'a, T> {
    pub(crate) fn accumulate(&self, g: Tensor<T>) -> Result<()> {
        match self {
            Tracked::Leaf(l) => l.accumulate(g),
            Tracked::Op(n) => n.accumulate(g),
        }
    }

    pub(crate) fn grad(&self) -> Option<Tensor<T>> {
        match self {
            Tracked::Leaf(l) => l.grad(),
            Tracked::Op(n) => n.grad(),
        }
    }

    pub(crate) fn take_grad(&self) -> Option<Tensor<T>> {
        match self {
            Tracked::Leaf(l) => l.take_grad(),
            Tracked::Op(n) => n.take_grad(),
        }
    }

    pub(crate) fn set_grad(&self, g: Option<Tensor<T>>) {
        match self {
            Tracked::Leaf(l) => l.set_grad(g),
            Tracked::Op(n) => n.set_grad(g),
        }
    }

    /// The node in the graph walk.
    pub(crate) fn as_any(&self) -> Rc<dyn AnyNode<'a> + 'a> {
        match self {
            Tracked::Leaf(l) => Rc::new(LeafNode(l.clone())),
            Tracked::Op(n) => n.clone(),
        }
    }
}

/// A node of any element type (a cast joins nodes of two types).
pub(crate) trait AnyNode<'a> {
    fn id(&self) -> u64;
    /// Whether it is a leaf (a parameter), whose gradient a hook may be told of.
    fn is_leaf(&self) -> bool {
        false
    }
    fn parents(&self) -> &[Rc<dyn AnyNode<'a> + 'a>];
    /// Runs the backward function on the gradient gathered so far; a leaf keeps its gradient.
    fn run(&self) -> Result<()>;
}

impl<'a, T: Element> Node<'a, T> {
    pub(crate) fn interior(
        shape: &[usize],
        parents: Vec<Rc<dyn AnyNode<'a> + 'a>>,
        backward: BackwardFn<'a, T>,
    ) -> Rc<Self> {
        Rc::new(Node {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            shape: shape.to_vec(),
            grad: RefCell::new(None),
            backward: RefCell::new(Some(backward)),
            parents,
        })
    }

    /// Adds `g` to the gradient gathered so far.
    pub(crate) fn accumulate(&self, g: Tensor<T>) -> Result<()> {
        add_into(&mut self.grad.borrow_mut(), &self.shape, g)
    }

    pub(crate) fn grad(&self) -> Option<Tensor<T>> {
        self.grad.borrow().clone()
    }

    pub(crate) fn take_grad(&self) -> Option<Tensor<T>> {
        self.grad.borrow_mut().take()
    }

    pub(crate) fn set_grad(&self, g: Option<Tensor<T>>) {
        *self.grad.borrow_mut() = g;
    }
}

impl<'a, T: Element> AnyNode<'a> for Node<'a, T> {
    fn id(&self) -> u64 {
        self.id
    }

    fn parents(&self) -> &[Rc<dyn AnyNode<'a> + 'a>] {
        &self.parents
    }

    fn run(&self) -> Result<()> {
        let Some(g) = self.grad.borrow_mut().take() else {
            return Ok(());
        };
        let Some(backward) = self.backward.borrow_mut().take() else {
            return Err(Error::InvalidArgument {
                op: "autograd::backward",
                rank: 0,
                reason: "the graph was already differentiated once: backward frees what the \
                         forward pass saved; run the forward pass again"
                    .to_string(),
            });
        };
        backward(&g)
    }
}

/// Called with a leaf's number ([`Leaf::id`]) once its gradient is complete in a backward pass.
pub(crate) type LeafHook<'h> = &'h mut dyn FnMut(u64) -> Result<()>;

/// Runs the backward pass from `root`, whose gradient has been set: every reachable node in
/// decreasing creation order. With `hook`, each reachable leaf's number is passed to it right
/// after the last node that uses the leaf has run (its gradient is then complete for this pass),
/// before the nodes after it; in the walk's order, so the same on every rank of a model.
pub(crate) fn backward_from<'a>(
    root: Rc<dyn AnyNode<'a> + 'a>,
    mut hook: Option<LeafHook<'_>>,
) -> Result<()> {
    let mut seen = HashSet::new();
    let mut order: Vec<Rc<dyn AnyNode<'a> + 'a>> = Vec::new();
    let mut stack = vec![root];
    while let Some(node) = stack.pop() {
        if !seen.insert(node.id()) {
            continue;
        }
        stack.extend(node.parents().iter().cloned());
        order.push(node);
    }
    order.sort_by_key(|n| std::cmp::Reverse(n.id()));
    // For each step of the walk, the leaves whose last user it is.
    let mut complete: Vec<Vec<u64>> = vec![Vec::new(); order.len()];
    if hook.is_some() {
        let mut last_user = std::collections::HashMap::new();
        for (at, node) in order.iter().enumerate() {
            for parent in node.parents().iter().filter(|p| p.is_leaf()) {
                last_user.insert(parent.id(), at);
            }
        }
        let mut leaves: Vec<(u64, usize)> = last_user.into_iter().collect();
        // Leaves of one step in a fixed order (by number: creation order).
        leaves.sort_unstable();
        for (leaf, at) in leaves {
            complete[at].push(leaf);
        }
    }
    for (node, leaves) in order.into_iter().zip(complete) {
        node.run()?;
        if let Some(hook) = hook.as_mut() {
            for leaf in leaves {
                hook(leaf)?;
            }
        }
    }
    Ok(())
}
