//! The tape: a node per tracked value, created only when an input of an op is tracked, so a
//! forward pass over untracked values builds nothing and keeps nothing.
//!
//! Nodes are numbered in creation order. An op's inputs exist before its output, so walking the
//! nodes reachable from the loss in decreasing number visits every node after all the nodes that
//! use it: each node's gradient is complete before its backward function runs.

use std::cell::RefCell;
use std::collections::HashSet;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::{Element, Error, Result, Tensor};

static NEXT_ID: AtomicU64 = AtomicU64::new(0);

/// A node's backward function: given the gradient of its output, it accumulates the gradients of
/// its inputs into their nodes. Run once, then dropped with what it saved.
pub(crate) type BackwardFn<'a, T> = Box<dyn FnOnce(&Tensor<T>) -> Result<()> + 'a>;

/// A tracked value's node: its gradient so far, and (unless it is a leaf) how to pass the
/// gradient on to its inputs.
pub(crate) struct Node<'a, T: Element> {
    id: u64,
    shape: Vec<usize>,
    grad: RefCell<Option<Tensor<T>>>,
    backward: RefCell<Option<BackwardFn<'a, T>>>,
    parents: Vec<Rc<dyn AnyNode<'a> + 'a>>,
    leaf: bool,
}

/// A node of any element type (a cast joins nodes of two types).
pub(crate) trait AnyNode<'a> {
    fn id(&self) -> u64;
    fn parents(&self) -> &[Rc<dyn AnyNode<'a> + 'a>];
    /// Runs the backward function on the gradient gathered so far; a leaf keeps its gradient.
    fn run(&self) -> Result<()>;
}

impl<'a, T: Element> Node<'a, T> {
    pub(crate) fn leaf(shape: &[usize]) -> Rc<Self> {
        Rc::new(Node {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            shape: shape.to_vec(),
            grad: RefCell::new(None),
            backward: RefCell::new(None),
            parents: Vec::new(),
            leaf: true,
        })
    }

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
            leaf: false,
        })
    }

    /// Adds `g` to the gradient gathered so far.
    pub(crate) fn accumulate(&self, g: Tensor<T>) -> Result<()> {
        if g.shape() != self.shape.as_slice() {
            return Err(Error::InvalidShape {
                op: "autograd::backward",
                reason: format!(
                    "a gradient of shape {:?} reached a value of shape {:?} (an op's backward \
                     returned the wrong shape)",
                    g.shape(),
                    self.shape
                ),
            });
        }
        let mut slot = self.grad.borrow_mut();
        *slot = Some(match slot.take() {
            None => g,
            Some(sum) => sum + &g,
        });
        Ok(())
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

    pub(crate) fn is_leaf(&self) -> bool {
        self.leaf
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
        if self.leaf {
            return Ok(());
        }
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

/// Runs the backward pass from `root`, whose gradient has been set: every reachable node in
/// decreasing creation order.
pub(crate) fn backward_from<'a>(root: Rc<dyn AnyNode<'a> + 'a>) -> Result<()> {
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
    for node in order {
        node.run()?;
    }
    Ok(())
}
