//! The differentiable ops on [`Var`](super::Var), one family per file.

mod activation;
pub(crate) mod arith;
mod attention;
mod attention_device;
mod index;
mod join;
mod layout;
mod matmul;
mod moe;
mod norm;
mod reduce;
mod scan;
mod select;
mod top;
