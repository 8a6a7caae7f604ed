//! The backward pass of rms_norm and layer_norm on one GPU tensor (`kernels/norm_grad.cu`): `dx`
//! from one block per row, and the weight and bias gradients (column sums over the rows) in two
//! passes over the whole GPU. Launched on `x`'s stream, after the streams that wrote the others;
//! nothing waits for the GPU here.

use super::kernels::{self, Source};
use super::local::{after, grid, output, same_gpu};
use super::storage::DeviceStorage;
use crate::Result;
use crate::tensor::Element;

const OP: &str = "norm backward";

/// `NormGradArgs` in norm_grad.cu.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct NormGradArgs {
    dx: u64,
    x: u64,
    w: u64,
    g: u64,
    stats: u64,
    dw: u64,
    db: u64,
    partial: u64,
    rows: u64,
    n: u64,
    chunk_rows: u64,
    chunks: u64,
    eps: f64,
    centered: u32,
}

/// Blocks of `dt_norm_grad_columns` to aim for: a few waves of a full H200, as `sum_columns`.
const COLUMN_BLOCKS: usize = 4096;

/// `dx`, and the weight and bias gradients `(dw, db)` where asked for.
pub(crate) type NormGrads<T> = (DeviceStorage<T>, Option<(DeviceStorage<T>, DeviceStorage<T>)>);

/// `dx`, and (with `params`) the gradients `(dw, db)` of one value per feature, of rms_norm
/// (`centered` false) or layer_norm of `x` over its last axis, for the output's gradient `dy`
/// (the shape of `x`) and the weight `w` (`[n]`, or none for 1); the caller checked the shapes.
pub(crate) fn norm_backward<T: Element>(
    x: &DeviceStorage<T>,
    w: Option<&DeviceStorage<T>>,
    dy: &DeviceStorage<T>,
    eps: f64,
    centered: bool,
    params: bool,
) -> Result<NormGrads<T>> {
    same_gpu(OP, x, dy)?;
    after(x, dy)?;
    if let Some(w) = w {
        same_gpu(OP, x, w)?;
        after(x, w)?;
    }
    let n = *x.shape().last().expect("checked by the caller");
    let rows = x.len().checked_div(n).unwrap_or(0);
    let dx = output::<T, T>(x, x.shape())?;
    let grads =
        if params { Some((output::<T, T>(x, &[n])?, output::<T, T>(x, &[n])?)) } else { None };
    if n == 0 {
        return Ok((dx, grads));
    }
    let tiles = n.div_ceil(32);
    let chunks = COLUMN_BLOCKS.div_ceil(tiles).clamp(1, rows.div_ceil(64).max(1));
    let chunk_rows = rows.div_ceil(chunks).max(1);
    let chunks = rows.div_ceil(chunk_rows).max(1);
    // The kernels' grad_t is f64 for f32 and f64, f32 for the half types: scratch buffers of as
    // many f64 hold as many grad_t of either width.
    let stats = if params { Some(output::<T, f64>(x, &[2 * rows])?) } else { None };
    let partials = if params { Some(output::<T, f64>(x, &[chunks * 2 * n])?) } else { None };
    let args = NormGradArgs {
        dx: dx.ptr(),
        x: x.ptr(),
        w: w.map_or(0, |w| w.ptr()),
        g: dy.ptr(),
        stats: stats.as_ref().map_or(0, |s| s.ptr()),
        dw: grads.as_ref().map_or(0, |(dw, _)| dw.ptr()),
        db: grads.as_ref().map_or(0, |(_, db)| db.ptr()),
        partial: partials.as_ref().map_or(0, |p| p.ptr()),
        rows: rows as u64,
        n: n as u64,
        chunk_rows: chunk_rows as u64,
        chunks: chunks as u64,
        eps,
        centered: u32::from(centered),
    };
    x.gpu().bind()?;
    let full = |f: kernels::Function| x.gpu().sm_count as u64 * f.blocks_per_sm as u64;
    if rows > 0 {
        let f = kernels::function(x.gpu(), Source::NormGrad, T::DTYPE, "dt_norm_grad_rows")?;
        let blocks = (rows as u64).clamp(1, full(f)) as u32;
        kernels::launch(f, blocks, kernels::BLOCK, x.stream(), &args)?;
    }
    if params {
        // With no rows the first pass writes zero partials, so dw and db come out zero.
        let f = kernels::function(x.gpu(), Source::NormGrad, T::DTYPE, "dt_norm_grad_columns")?;
        let blocks = ((tiles * chunks) as u64).clamp(1, full(f)) as u32;
        kernels::launch(f, blocks, kernels::BLOCK, x.stream(), &args)?;
        let f = kernels::function(x.gpu(), Source::NormGrad, T::DTYPE, "dt_norm_grad_partials")?;
        kernels::launch(f, grid(x, f, n, 1), kernels::BLOCK, x.stream(), &args)?;
    }
    // The scratch buffers go back to the cache behind the kernels queued on this stream: only
    // work queued after them reuses the memory.
    drop(stats);
    drop(partials);
    Ok((dx, grads))
}
