//! [`Module`]: a model as one value with named, nested parameters, and what steps it:
//! [`AdamW`], gradient clipping by the global norm across ranks ([`clip_grad_norm`]), the sum
//! over ranks of replicated parameters' gradients ([`sync_grads`]), and a warm-up + cosine
//! learning rate ([`WarmupCosine`]).

use std::collections::HashMap;

use super::Var;
use crate::collectives::all_reduce;
use crate::{Element, Rank, Result, Tensor};

/// How a parameter is laid out over the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sharing {
    /// Each rank holds its own part (a column block, a vocabulary slice): its gradient is
    /// complete on the rank.
    Sharded,
    /// Every rank holds all of it and uses it on its own rows: each rank's gradient is a partial
    /// sum, summed over ranks by [`sync_grads`] (a norm's weight in a sequence-parallel block).
    Replicated,
}

/// `prefix.name`, or `name` at the top.
pub fn join(prefix: &str, name: &str) -> String {
    if prefix.is_empty() { name.to_string() } else { format!("{prefix}.{name}") }
}

/// A model or a part of one: its parameters, each with a dotted name (`layers.0.attn.qkv.weight`)
/// and its [`Sharing`]. A layer implements the two visits; the rest follows.
pub trait Module<'a, T: Element> {
    /// Calls `f` with every parameter's full name (under `prefix`), the parameter and its
    /// sharing, in a fixed order.
    fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, &Var<'a, T>, Sharing));

    /// As [`Module::visit`], with the parameters mutable (for an optimizer's step).
    fn visit_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Var<'a, T>, Sharing));

    /// Every parameter with its dotted name.
    fn named_parameters(&self) -> Vec<(String, Var<'a, T>)> {
        let mut out = Vec::new();
        self.visit("", &mut |name, v, _| out.push((name.to_string(), v.clone())));
        out
    }

    /// Every parameter.
    fn parameters(&self) -> Vec<Var<'a, T>> {
        self.named_parameters().into_iter().map(|(_, v)| v).collect()
    }

    /// Forgets every parameter's gradient.
    fn zero_grad(&self) {
        self.visit("", &mut |_, v, _| v.zero_grad());
    }
}

/// A list of modules (the layers of a model): named by index, `0.`, `1.`, ...
impl<'a, T: Element, M: Module<'a, T>> Module<'a, T> for Vec<M> {
    fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, &Var<'a, T>, Sharing)) {
        for (i, m) in self.iter().enumerate() {
            m.visit(&join(prefix, &i.to_string()), f);
        }
    }

    fn visit_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Var<'a, T>, Sharing)) {
        for (i, m) in self.iter_mut().enumerate() {
            m.visit_mut(&join(prefix, &i.to_string()), f);
        }
    }
}

/// Sums the gradients of the [`Sharing::Replicated`] parameters over the ranks (one all_reduce
/// for all of them). Collective.
///
/// # Errors
/// As [`all_reduce`].
pub fn sync_grads<'a, T: Element>(model: &dyn Module<'a, T>, rank: &Rank<'_>) -> Result<()> {
    let mut vars = Vec::new();
    model.visit("", &mut |_, v, s| {
        if s == Sharing::Replicated {
            vars.push(v.clone());
        }
    });
    let flat: Vec<T> = vars
        .iter()
        .flat_map(|v| v.grad().unwrap_or_else(|| Tensor::zeros(v.shape())).as_slice().to_vec())
        .collect();
    let summed = all_reduce(rank, &flat)?;
    let mut at = 0;
    for v in &vars {
        let n = v.value().len();
        v.set_grad(Some(Tensor::from_shape_vec(v.shape(), summed[at..at + n].to_vec())?));
        at += n;
    }
    Ok(())
}

/// Scales every gradient so that their global norm (over every parameter of every rank: each
/// sharded part once, each replicated parameter once) is at most `max_norm`; returns the norm
/// before. Call after [`sync_grads`]. Collective.
///
/// # Errors
/// As [`all_reduce`].
pub fn clip_grad_norm<'a, T: Element>(
    model: &dyn Module<'a, T>,
    max_norm: f64,
    rank: &Rank<'_>,
) -> Result<f64> {
    let (mut sharded, mut replicated) = (0.0f64, 0.0f64);
    model.visit("", &mut |_, v, s| {
        let sq: f64 =
            v.grad().map_or(0.0, |g| g.as_slice().iter().map(|x| x.to_f64().powi(2)).sum());
        match s {
            Sharing::Sharded => sharded += sq,
            Sharing::Replicated => replicated += sq,
        }
    });
    let norm = (all_reduce(rank, &[sharded])?[0] + replicated).sqrt();
    if norm > max_norm {
        let k = T::from_f64(max_norm / (norm + 1e-12));
        model.visit("", &mut |_, v, _| {
            if let Some(g) = v.grad() {
                v.set_grad(Some(g * k));
            }
        });
    }
    Ok(norm)
}

/// A learning rate that rises linearly from 0 to `peak` over `warmup` steps, then falls along a
/// half cosine to `min` at step `total` (and stays there).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WarmupCosine {
    /// The rate at the end of the warm-up.
    pub peak: f64,
    /// The rate at `total` and after.
    pub min: f64,
    /// Steps of warm-up.
    pub warmup: usize,
    /// The step at which the cosine reaches `min`.
    pub total: usize,
}

impl WarmupCosine {
    /// The rate at `step` (from 0).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::autograd::WarmupCosine;
    /// let s = WarmupCosine { peak: 1.0, min: 0.1, warmup: 10, total: 110 };
    /// assert_eq!(s.lr(0), 0.1); // 1/10 of the way up
    /// assert_eq!(s.lr(9), 1.0);
    /// assert!((s.lr(60) - 0.55).abs() < 1e-12); // half way down
    /// assert_eq!(s.lr(500), 0.1);
    /// ```
    pub fn lr(&self, step: usize) -> f64 {
        if step < self.warmup {
            return self.peak * (step + 1) as f64 / self.warmup as f64;
        }
        let span = self.total.saturating_sub(self.warmup).max(1);
        let t = ((step - self.warmup) as f64 / span as f64).min(1.0);
        self.min + 0.5 * (self.peak - self.min) * (1.0 + (std::f64::consts::PI * t).cos())
    }
}

/// Adam with decoupled weight decay (AdamW), stepping every parameter of a [`Module`] in one
/// call; its moments are kept per parameter name, in f64.
#[derive(Debug, Clone)]
pub struct AdamW {
    /// The learning rate (set it per step from a schedule).
    pub lr: f64,
    /// The moment decay rates.
    pub betas: (f64, f64),
    /// Added to the root of the second moment.
    pub eps: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
    step: u32,
    moments: HashMap<String, (Vec<f64>, Vec<f64>)>,
}

impl AdamW {
    /// `lr`, betas (0.9, 0.999), eps 1e-8, no weight decay.
    pub fn new(lr: f64) -> Self {
        AdamW {
            lr,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.0,
            step: 0,
            moments: HashMap::new(),
        }
    }

    /// One step of every parameter that has a gradient.
    ///
    /// # Errors
    /// [`Error::InvalidShape`](crate::Error::InvalidShape) when a parameter's value changed shape.
    pub fn step<'a, T: Element>(&mut self, model: &mut dyn Module<'a, T>) -> Result<()> {
        self.step += 1;
        let (b1, b2) = self.betas;
        let (c1, c2) = (1.0 - b1.powi(self.step as i32), 1.0 - b2.powi(self.step as i32));
        let (lr, eps, wd) = (self.lr, self.eps, self.weight_decay);
        let moments = &mut self.moments;
        let mut result = Ok(());
        model.visit_mut("", &mut |name, v, _| {
            let Some(g) = v.grad() else { return };
            let n = g.len();
            let (m, s) =
                moments.entry(name.to_string()).or_insert_with(|| (vec![0.0; n], vec![0.0; n]));
            let mut next = v.value().clone();
            for (i, (x, g)) in next.as_mut_slice().iter_mut().zip(g.as_slice()).enumerate() {
                let g = g.to_f64();
                m[i] = b1 * m[i] + (1.0 - b1) * g;
                s[i] = b2 * s[i] + (1.0 - b2) * g * g;
                let x0 = x.to_f64();
                *x = T::from_f64(x0 - lr * (m[i] / c1 / ((s[i] / c2).sqrt() + eps) + wd * x0));
            }
            if let Err(e) = v.set_value(next) {
                result = Err(e);
            }
        });
        result
    }
}
