//! Local math on one GPU tensor: the device arms of `Tensor`'s elementwise ops, activations,
//! casts, softmax, normalizations, reductions, permutations and batched products. Each launches
//! a kernel of `kernels/local.cu` on the input's stream (the stream that wrote it, so no wait is
//! needed) and returns a new tensor of the same home; nothing waits for the GPU here.

use std::ffi::c_void;

use super::blas;
use super::driver::{Check, Event, stream_wait};
use super::kernels::{self, Function, Source};
use super::storage::DeviceStorage;
use super::{Binary, Unary};
use crate::tensor::{DType, Element};
use crate::{Error, Result};

/// Most dimensions the broadcast and permutation kernels take (`DT_MAX_DIMS`) after merging.
const MAX_DIMS: usize = 8;

pub(super) fn function<T: Element>(x: &DeviceStorage<T>, name: &'static str) -> Result<Function> {
    x.gpu().bind()?;
    kernels::function(x.gpu(), Source::Local, T::DTYPE, name)
}

/// Grid for `items` elements walked `per_thread` at a time by a grid-stride kernel.
pub(super) fn grid<T: Element>(
    x: &DeviceStorage<T>,
    f: Function,
    items: usize,
    per_thread: usize,
) -> u32 {
    kernels::grid_for(x.gpu(), f, (items.div_ceil(per_thread) as u64).div_ceil(32))
}

/// Launches `f` on `x`'s stream with `words` as its parameters, in order: for kernels whose
/// parameters are all 64-bit (pointers and counts).
pub(super) fn launch_words<T: Element>(
    x: &DeviceStorage<T>,
    f: Function,
    grid: u32,
    words: &[u64],
) -> Result<()> {
    let mut words = words.to_vec();
    let mut params: Vec<*mut c_void> =
        words.iter_mut().map(|w| w as *mut u64 as *mut c_void).collect();
    kernels::launch_raw(f, grid, kernels::BLOCK, x.stream(), &mut params)
}

/// Elements per 16-byte vector.
pub(super) fn vec_len<T>() -> usize {
    16 / size_of::<T>()
}

/// Vectors a thread of the chunked elementwise kernels takes (`DT_UNROLL`).
const UNROLL: usize = 4;

/// Grid of the chunked elementwise kernels (`DT_UNARY`) for `vectors` 16-byte steps: a block
/// per chunk of `UNROLL` steps a thread, not one wave of resident blocks (on one H200 such a
/// wave, one or two vectors a thread, ran silu of [8192, 8192] bf16 at 1.26-1.30x the copy
/// roofline, the chunks at 1.11x). The kernels walk chunks grid-stride past the cap.
pub(super) fn chunk_grid(vectors: usize) -> u32 {
    vectors.div_ceil(UNROLL * kernels::BLOCK as usize).clamp(1, 1 << 24) as u32
}

/// A new tensor of `shape` where `like` lives.
pub(super) fn output<T: Element, U: Element>(
    like: &DeviceStorage<T>,
    shape: &[usize],
) -> Result<DeviceStorage<U>> {
    DeviceStorage::uninit(like.gpu(), shape, like.home())
}

/// `op` on every element of `x` (with `scalar` for the scalar forms).
pub(crate) fn unary<T: Element>(
    x: &DeviceStorage<T>,
    op: Unary,
    scalar: f64,
) -> Result<DeviceStorage<T>> {
    let out = output::<T, T>(x, x.shape())?;
    let n = x.len();
    if n == 0 {
        return Ok(out);
    }
    let name = match op {
        Unary::Neg => "dt_neg",
        Unary::Relu => "dt_relu",
        Unary::Silu => "dt_silu",
        Unary::Gelu => "dt_gelu",
        Unary::GeluTanh => "dt_gelu_tanh",
        Unary::AddScalar => "dt_add_s",
        Unary::SubScalar => "dt_sub_s",
        Unary::MulScalar => "dt_mul_s",
        Unary::DivScalar => "dt_div_s",
        Unary::ScalarSub => "dt_rsub_s",
        Unary::ScalarDiv => "dt_rdiv_s",
    };
    let f = function(x, name)?;
    let (mut o, mut i, mut len, mut s) = (out.ptr(), x.ptr(), n as u64, scalar);
    let mut params = [
        &mut o as *mut u64 as *mut c_void,
        &mut i as *mut u64 as *mut c_void,
        &mut len as *mut u64 as *mut c_void,
        &mut s as *mut f64 as *mut c_void,
    ];
    let grid = chunk_grid(n / vec_len::<T>());
    kernels::launch_raw(f, grid, kernels::BLOCK, x.stream(), &mut params)?;
    Ok(out)
}

/// Whether `bias` runs along the last dimension of `x` in one pass of the bias kernels
/// (`DT_BIAS_ACT` in local.cu): `[cols]` with cols a whole number of 16-byte vectors, and `x`
/// fewer than 2^32 vectors. Otherwise the bias is added, and activated, in two passes.
pub(super) fn bias_fits<T: Element>(x: &DeviceStorage<T>, bias: &DeviceStorage<T>) -> bool {
    let cols = x.shape().last().copied().unwrap_or(0);
    let vectors = (x.len() / vec_len::<T>()) as u64;
    bias.shape() == [cols] && cols > 0 && cols.is_multiple_of(vec_len::<T>()) && vectors < 1 << 32
}

/// `act(x + bias)` for `bias` along `x`'s last dimension (broadcast over the rows), the sum
/// rounded to `T` first: the bits of the add and then the activation, in one pass where
/// [`bias_fits`] (the sum is not stored), else in those two.
pub(crate) fn bias_activation<T: Element>(
    x: &DeviceStorage<T>,
    bias: &DeviceStorage<T>,
    act: Unary,
) -> Result<DeviceStorage<T>> {
    same_gpu("bias and activation", x, bias)?;
    let name = match act {
        Unary::Gelu => "dt_bias_gelu",
        Unary::GeluTanh => "dt_bias_gelu_tanh",
        Unary::Silu => "dt_bias_silu",
        Unary::Relu => "dt_bias_relu",
        other => {
            return Err(Error::InvalidArgument {
                op: "bias and activation",
                rank: 0,
                reason: format!("{other:?} is not an activation"),
            });
        }
    };
    if !bias_fits(x, bias) {
        return unary(&binary(x, bias, Binary::Add, x.shape())?, act, 0.0);
    }
    let out = output::<T, T>(x, x.shape())?;
    let n = x.len();
    after(x, bias)?;
    let f = function(x, name)?;
    let cols = x.shape().last().copied().unwrap_or(0) as u64;
    launch_words(
        x,
        f,
        chunk_grid(n / vec_len::<T>()),
        &[out.ptr(), x.ptr(), bias.ptr(), n as u64, cols],
    )?;
    Ok(out)
}

/// `BinaryArgs` in local.cu./// `BinaryArgs` in local.cu.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
struct BinaryArgs {
    out: u64,
    a: u64,
    b: u64,
    n: u64,
    shape: [u64; MAX_DIMS],
    sa: [u64; MAX_DIMS],
    sb: [u64; MAX_DIMS],
    ndim: u32,
    flat: u32,
    vec: u32,
}

/// Row-major strides of `shape` aligned to the last `ndim` dimensions, 0 where `shape` is 1 or
/// missing (broadcast).
fn broadcast_strides(shape: &[usize], ndim: usize) -> Vec<u64> {
    let mut strides = vec![0u64; ndim];
    let mut step = 1u64;
    for (i, &d) in shape.iter().enumerate().rev() {
        let at = ndim - (shape.len() - i);
        strides[at] = if d == 1 { 0 } else { step };
        step *= d as u64;
    }
    strides
}

/// Merges neighbouring dimensions that every stride list walks as one (so that most broadcasts
/// fit the kernel's dimensions): `(shape, strides per operand)`.
fn merged(shape: &[usize], strides: &[Vec<u64>]) -> (Vec<u64>, Vec<Vec<u64>>) {
    let mut out_shape: Vec<u64> = Vec::new();
    let mut out_strides: Vec<Vec<u64>> = vec![Vec::new(); strides.len()];
    for (d, &len) in shape.iter().enumerate() {
        if len == 1 {
            continue;
        }
        let joins = !out_shape.is_empty()
            && strides.iter().zip(&out_strides).all(|(s, o)| {
                let last = *o.last().expect("same length as out_shape");
                last == s[d] * len as u64
            });
        if joins {
            *out_shape.last_mut().expect("not empty") *= len as u64;
            for (s, o) in strides.iter().zip(out_strides.iter_mut()) {
                *o.last_mut().expect("not empty") = s[d];
            }
        } else {
            out_shape.push(len as u64);
            for (s, o) in strides.iter().zip(out_strides.iter_mut()) {
                o.push(s[d]);
            }
        }
    }
    (out_shape, out_strides)
}

/// The arguments of the broadcasting kernel for `a` and `b` broadcast to `out` (pointers
/// left for the caller): flat when both have the output's shape, else the output's dimensions
/// merged where both inputs allow, with each input's strides (0 where it is broadcast).
fn binary_plan(a: &[usize], b: &[usize], out: &[usize], vec_width: u64) -> Result<BinaryArgs> {
    let n: usize = out.iter().product();
    let mut args = BinaryArgs { n: n as u64, ..Default::default() };
    if a == out && b == out {
        // Also described as one dimension of contiguous inputs, for the strided walk that
        // takes same-shape tensors too large for the flat kernel's 32-bit indices.
        args.flat = 1;
        args.ndim = 1;
        (args.shape[0], args.sa[0], args.sb[0]) = (n as u64, 1, 1);
        args.vec = u32::from((n as u64).is_multiple_of(vec_width));
        return Ok(args);
    }
    let nd = out.len();
    let strides = [broadcast_strides(a, nd), broadcast_strides(b, nd)];
    let (shape, strides) = merged(out, &strides);
    if shape.len() > MAX_DIMS {
        return Err(Error::InvalidShape {
            op: "Tensor arithmetic",
            reason: format!(
                "broadcasting {a:?} with {b:?} needs {} dimensions on a GPU (at most {MAX_DIMS})",
                shape.len()
            ),
        });
    }
    args.ndim = shape.len() as u32;
    args.shape[..shape.len()].copy_from_slice(&shape);
    args.sa[..shape.len()].copy_from_slice(&strides[0]);
    args.sb[..shape.len()].copy_from_slice(&strides[1]);
    args.vec = u32::from(walks_in_vectors(&shape, &strides, vec_width));
    Ok(args)
}

/// Whether the broadcast kernel may walk 16-byte vectors of `width` elements (see `vec` in
/// local.cu): the last dimension holds whole vectors, and each input is broadcast along it (one
/// element a vector) or contiguous with every other stride whole vectors (so its vectors are
/// aligned: tensors start 256-byte aligned).
fn walks_in_vectors(shape: &[u64], strides: &[Vec<u64>], width: u64) -> bool {
    let Some(&last) = shape.last() else { return false };
    let l = shape.len() - 1;
    last % width == 0
        && strides.iter().all(|s| match s[l] {
            0 => true,
            1 => s[..l].iter().all(|&st| st % width == 0),
            _ => false,
        })
}

/// Threads of a block of the same-shape arithmetic kernels (`DT_FLAT_BLOCK` in local.cu).
const FLAT_BLOCK: u32 = 128;

/// `a op b`, broadcast to `out_shape` (which the caller computed).
pub(crate) fn binary<T: Element>(
    a: &DeviceStorage<T>,
    b: &DeviceStorage<T>,
    op: Binary,
    out_shape: &[usize],
) -> Result<DeviceStorage<T>> {
    same_gpu("Tensor arithmetic", a, b)?;
    let out = output::<T, T>(a, out_shape)?;
    let n: usize = out_shape.iter().product();
    if n == 0 {
        return Ok(out);
    }
    let mut args = binary_plan(a.shape(), b.shape(), out_shape, vec_len::<T>() as u64)?;
    // Inputs of the output's shape have a kernel of their own (`DT_BINARY_FLAT`), with 32-bit
    // indices: tensors of 2^32 vectors (64 GiB) or more take the strided walk.
    let vectors = (n / vec_len::<T>()) as u64;
    let flat = args.flat == 1 && vectors < 1 << 32;
    args.flat = u32::from(flat);
    let name = match (op, flat) {
        (Binary::Add, false) => "dt_add",
        (Binary::Sub, false) => "dt_sub",
        (Binary::Mul, false) => "dt_mul",
        (Binary::Div, false) => "dt_div",
        (Binary::Add, true) => "dt_add_flat",
        (Binary::Sub, true) => "dt_sub_flat",
        (Binary::Mul, true) => "dt_mul_flat",
        (Binary::Div, true) => "dt_div_flat",
    };
    let f = function(a, name)?;
    (args.out, args.a, args.b) = (out.ptr(), a.ptr(), b.ptr());
    after(a, b)?;
    if flat {
        // Two vectors a thread (DT_FLAT_BLOCK in local.cu), at least one block for the tail.
        let grid = vectors.div_ceil(2 * FLAT_BLOCK as u64).max(1) as u32;
        kernels::launch(f, grid, FLAT_BLOCK, a.stream(), &args)?;
    } else {
        let grid = grid(a, f, n, if args.vec == 1 { vec_len::<T>() } else { 1 });
        kernels::launch(f, grid, kernels::BLOCK, a.stream(), &args)?;
    }
    Ok(out)
}

/// Orders work queued next on `a`'s stream after the work that writes `b`, when `b` was written
/// on another stream (a tensor made outside the world, or by another rank on the same GPU).
pub(super) fn after<T: Element, U: Element>(
    a: &DeviceStorage<T>,
    b: &DeviceStorage<U>,
) -> Result<()> {
    if a.stream() == b.stream() {
        return Ok(());
    }
    let event = Event::new(false)?;
    event.record(b.stream())?;
    stream_wait(a.stream(), &event)
}

pub(super) fn same_gpu<T: Element, U: Element>(
    op: &'static str,
    a: &DeviceStorage<T>,
    b: &DeviceStorage<U>,
) -> Result<()> {
    if a.ordinal() != b.ordinal() {
        return Err(Error::InvalidArgument {
            op,
            rank: 0,
            reason: format!(
                "operands on different devices: cuda:{} and cuda:{}",
                a.ordinal(),
                b.ordinal()
            ),
        });
    }
    Ok(())
}

/// Every element converted to `U` (through f64, rounded once, as on the host).
pub(crate) fn cast<T: Element, U: Element>(x: &DeviceStorage<T>) -> Result<DeviceStorage<U>> {
    let out = output::<T, U>(x, x.shape())?;
    let n = x.len();
    if n == 0 {
        return Ok(out);
    }
    let name = match U::DTYPE {
        DType::F32 => "dt_cast_f32",
        DType::F64 => "dt_cast_f64",
        DType::F16 => "dt_cast_f16",
        DType::BF16 => "dt_cast_bf16",
    };
    let f = function(x, name)?;
    // Steps of 16 bytes of the narrower type (`E` in `DT_CAST`).
    let step = 16 / size_of::<T>().min(size_of::<U>());
    launch_words(x, f, chunk_grid(n / step), &[out.ptr(), x.ptr(), n as u64])?;
    Ok(out)
}

/// `LaneArgs` in local.cu.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct LaneArgs {
    out: u64,
    x: u64,
    w: u64,
    b: u64,
    outer: u64,
    n: u64,
    inner: u64,
    eps: f64,
    mode: u32,
}

/// `(outer, n, inner)` of `shape` around `axis`.
fn lanes(shape: &[usize], axis: usize) -> (usize, usize, usize) {
    (shape[..axis].iter().product(), shape[axis], shape[axis + 1..].iter().product())
}

/// Launches a lane kernel with one block per lane (at most a full GPU of blocks).
fn launch_lanes<T: Element>(
    x: &DeviceStorage<T>,
    name: &'static str,
    args: &LaneArgs,
    blocks: usize,
) -> Result<()> {
    let f = function(x, name)?;
    let full = x.gpu().sm_count as u64 * f.blocks_per_sm as u64;
    let grid = (blocks as u64).clamp(1, full) as u32;
    kernels::launch(f, grid, kernels::BLOCK, x.stream(), args)
}

/// The longest row the row kernels keep in registers (`DT_ROW_CACHE * DT_ROW_THREADS` in
/// local.cu: 32 accumulator values a thread, 16 in f64, 256 threads).
fn row_cache<T: Element>() -> usize {
    if size_of::<T::Acc>() == 8 { 16 * 256 } else { 32 * 256 }
}

/// The kernel for lanes of `n` along the last axis (`inner == 1`): the row kernel (`{rows}_vec`
/// where a row is whole 16-byte vectors) when a row fits the registers, else `general`.
fn row_kernel<T: Element>(
    n: usize,
    inner: usize,
    rows: [&'static str; 2],
    general: &'static str,
) -> &'static str {
    match (inner == 1 && n <= row_cache::<T>(), n.is_multiple_of(vec_len::<T>())) {
        (true, true) => rows[1],
        (true, false) => rows[0],
        (false, _) => general,
    }
}

/// Softmax along `axis` (checked by the caller).
pub(crate) fn softmax<T: Element>(x: &DeviceStorage<T>, axis: usize) -> Result<DeviceStorage<T>> {
    let out = output::<T, T>(x, x.shape())?;
    if x.len() == 0 {
        return Ok(out);
    }
    let (outer, n, inner) = lanes(x.shape(), axis);
    let args = LaneArgs {
        out: out.ptr(),
        x: x.ptr(),
        outer: outer as u64,
        n: n as u64,
        inner: inner as u64,
        ..Default::default()
    };
    let name = row_kernel::<T>(n, inner, ["dt_softmax_rows", "dt_softmax_rows_vec"], "dt_softmax");
    launch_lanes(x, name, &args, outer * inner)?;
    Ok(out)
}

/// rms_norm (`layer` false: no mean, no bias) or layer_norm over the last axis; the caller
/// checked the parameters' shapes.
pub(crate) fn norm<T: Element>(
    x: &DeviceStorage<T>,
    weight: Option<&DeviceStorage<T>>,
    bias: Option<&DeviceStorage<T>>,
    eps: f64,
    layer: bool,
) -> Result<DeviceStorage<T>> {
    for p in weight.iter().chain(bias.iter()) {
        same_gpu("Tensor::layer_norm", x, p)?;
        after(x, p)?;
    }
    let out = output::<T, T>(x, x.shape())?;
    if x.len() == 0 {
        return Ok(out);
    }
    let n = *x.shape().last().expect("checked by the caller");
    let args = LaneArgs {
        out: out.ptr(),
        x: x.ptr(),
        w: weight.map_or(0, |w| w.ptr()),
        b: bias.map_or(0, |b| b.ptr()),
        outer: (x.len() / n) as u64,
        n: n as u64,
        inner: 1,
        eps,
        mode: u32::from(weight.is_some()) | u32::from(bias.is_some()) << 1 | u32::from(layer) << 2,
    };
    let name = row_kernel::<T>(n, 1, ["dt_norm_rows", "dt_norm_rows_vec"], "dt_norm");
    launch_lanes(x, name, &args, x.len() / n)?;
    Ok(out)
}

/// Elements of a whole-tensor sum each block of its first pass adds up.
const TOTAL_CHUNK: usize = 16 << 10;

/// The sum (or mean) of every element of `x`, a 0-D tensor. Over more than one chunk, in two
/// passes: one block per chunk into a partial in the accumulator type, then one block over the
/// partials (a lane of `sum_axis` has a single block: on one H200, `mse_loss` of [8192, 4096]
/// bf16, whose f64 sum of 33.5 M squared errors went through it, took 52.2 ms; 1.2 ms after).
pub(crate) fn total<T: Element>(x: &DeviceStorage<T>, mean: bool) -> Result<DeviceStorage<T>> {
    let len = x.len();
    if len <= TOTAL_CHUNK {
        let flat = x.reshaped(&[len])?;
        return sum_axis(&flat, 0, mean);
    }
    let out = output::<T, T>(x, &[])?;
    let chunks = len.div_ceil(TOTAL_CHUNK);
    let partials = output::<T, T::Acc>(x, &[chunks])?;
    let args = LaneArgs {
        out: partials.ptr(),
        x: x.ptr(),
        outer: chunks as u64,
        n: TOTAL_CHUNK as u64,
        inner: len as u64,
        mode: u32::from(mean),
        ..Default::default()
    };
    launch_lanes(x, "dt_sum_chunks", &args, chunks)?;
    let args = LaneArgs { out: out.ptr(), x: partials.ptr(), ..args };
    launch_lanes(x, "dt_sum_partials", &args, 1)?;
    // The partials go back to the cache once the second pass (queued on the same stream) is
    // done with them: only work queued after it reuses them.
    drop(partials);
    Ok(out)
}

/// Sum (or mean) over `axis`, which is removed.
pub(crate) fn sum_axis<T: Element>(
    x: &DeviceStorage<T>,
    axis: usize,
    mean: bool,
) -> Result<DeviceStorage<T>> {
    let mut shape = x.shape().to_vec();
    shape.remove(axis);
    let out = output::<T, T>(x, &shape)?;
    let (outer, n, inner) = lanes(x.shape(), axis);
    if outer * inner == 0 {
        return Ok(out);
    }
    let args = LaneArgs {
        out: out.ptr(),
        x: x.ptr(),
        outer: outer as u64,
        n: n as u64,
        inner: inner as u64,
        mode: u32::from(mean),
        ..Default::default()
    };
    if inner == 1 {
        launch_lanes(x, "dt_sum", &args, outer)?;
        return Ok(out);
    }
    sum_columns(x, &out, (outer, n, inner), mean)?;
    Ok(out)
}

/// `ColumnArgs` in local.cu.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct ColumnArgs {
    out: u64,
    x: u64,
    partial: u64,
    outer: u64,
    n: u64,
    inner: u64,
    rows: u64,
    chunks: u64,
    mode: u32,
}

/// Blocks of `dt_sum_columns` to aim for: a few waves of a full H200 (132 SMs x 8 blocks).
const COLUMN_BLOCKS: usize = 4096;

/// `out` = the sums (or means) of `x`'s lanes `(outer, n, inner)` with `inner > 1`, in two
/// passes (see `dt_sum_columns`): the rows cut into chunks so that the first pass has about
/// [`COLUMN_BLOCKS`] blocks, each chunk at least 64 rows.
fn sum_columns<T: Element>(
    x: &DeviceStorage<T>,
    out: &DeviceStorage<T>,
    (outer, n, inner): (usize, usize, usize),
    mean: bool,
) -> Result<()> {
    // A thread adds one lane, or a 16-byte vector of neighbouring lanes where rows are whole
    // vectors; a block's tile is 32 threads across.
    let vec = if inner.is_multiple_of(vec_len::<T>()) { vec_len::<T>() } else { 1 };
    let tiles = outer * inner.div_ceil(32 * vec);
    let chunks = COLUMN_BLOCKS.div_ceil(tiles).clamp(1, n.div_ceil(64).max(1));
    let rows = n.div_ceil(chunks).max(1);
    let chunks = n.div_ceil(rows).max(1);
    let partials = output::<T, T::Acc>(x, &[chunks * outer * inner])?;
    let args = ColumnArgs {
        out: out.ptr(),
        x: x.ptr(),
        partial: partials.ptr(),
        outer: outer as u64,
        n: n as u64,
        inner: inner as u64,
        rows: rows as u64,
        chunks: chunks as u64,
        mode: u32::from(mean),
    };
    let f = function(x, if vec > 1 { "dt_sum_columns_vec" } else { "dt_sum_columns" })?;
    let full = x.gpu().sm_count as u64 * f.blocks_per_sm as u64;
    let blocks = ((tiles * chunks) as u64).clamp(1, full) as u32;
    kernels::launch(f, blocks, kernels::BLOCK, x.stream(), &args)?;
    let f = function(x, "dt_sum_columns_partials")?;
    kernels::launch(f, grid(x, f, outer * inner, 1), kernels::BLOCK, x.stream(), &args)?;
    // As in `total`: the partials go back to the cache behind the second pass on this stream.
    drop(partials);
    Ok(())
}

/// `PermuteArgs` in local.cu.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
struct PermuteArgs {
    out: u64,
    x: u64,
    n: u64,
    shape: [u64; MAX_DIMS],
    sx: [u64; MAX_DIMS],
    ndim: u32,
}

/// How a permutation moves the elements.
#[derive(Debug, PartialEq, Eq)]
enum PermutePlan {
    /// Not at all (only axes of length 1 move): a reshape.
    Reshape,
    /// `[batch, rows, cols] -> [batch, cols, rows]`: the tiled transpose.
    Transpose { batch: u64, rows: u64, cols: u64 },
    /// Anything else: each output element reads its input offset (pointers left unset).
    General(PermuteArgs),
}

/// The plan for `permute(axes)` of a row-major tensor of `shape` (axes checked by the caller).
fn permute_plan(shape: &[usize], axes: &[usize]) -> Result<PermutePlan> {
    let out: Vec<usize> = axes.iter().map(|&a| shape[a]).collect();
    let nd = shape.len();
    let mut in_strides = vec![0u64; nd];
    let mut step = 1u64;
    for d in (0..nd).rev() {
        in_strides[d] = step;
        step *= shape[d] as u64;
    }
    let strides: Vec<u64> = axes.iter().map(|&a| in_strides[a]).collect();
    let row_major = broadcast_strides(&out, nd);
    let (mshape, mstrides) = merged(&out, &[strides, row_major]);
    if mshape.len() <= 1 || mstrides[0] == mstrides[1] {
        return Ok(PermutePlan::Reshape);
    }
    let k = mshape.len();
    // The output's last axis walks the input's rows (stride `cols` in the input) and its
    // second-to-last the input's columns (stride 1); leading axes in the same order.
    let (rows, cols) = (mshape[k - 1], mshape[k - 2]);
    let batch_ok = (0..k - 2).all(|d| mstrides[0][d] == mstrides[1][d]);
    if batch_ok && mstrides[0][k - 2] == 1 && mstrides[0][k - 1] == cols {
        let n: u64 = mshape.iter().product();
        return Ok(PermutePlan::Transpose { batch: n / (rows * cols), rows, cols });
    }
    if k > MAX_DIMS {
        return Err(Error::InvalidShape {
            op: "Tensor::permute",
            reason: format!(
                "{axes:?} of {shape:?} needs {k} dimensions on a GPU (at most {MAX_DIMS})"
            ),
        });
    }
    let mut args = PermuteArgs { n: mshape.iter().product(), ndim: k as u32, ..Default::default() };
    args.shape[..k].copy_from_slice(&mshape);
    args.sx[..k].copy_from_slice(&mstrides[0]);
    Ok(PermutePlan::General(args))
}

/// Axis `i` of the result is axis `axes[i]` of `x` (a valid permutation, checked by the caller).
/// No copy when the order of the elements does not change (only axes of length 1 move); a
/// swap of the last two axes (after merging) goes through the tiled transpose.
pub(crate) fn permute<T: Element>(
    x: &DeviceStorage<T>,
    axes: &[usize],
) -> Result<DeviceStorage<T>> {
    let shape: Vec<usize> = axes.iter().map(|&a| x.shape()[a]).collect();
    if x.len() == 0 {
        return x.reshaped(&shape);
    }
    let plan = permute_plan(x.shape(), axes)?;
    let out = output::<T, T>(x, &shape)?;
    match plan {
        PermutePlan::Reshape => return x.reshaped(&shape),
        PermutePlan::Transpose { batch, rows, cols } => {
            let f = function(x, "dt_transpose")?;
            // `DT_TILE` in local.cu.
            let tile = if size_of::<T>() == 8 { 32 } else { 64 };
            let tiles = batch * rows.div_ceil(tile) * cols.div_ceil(tile);
            let full = x.gpu().sm_count as u64 * f.blocks_per_sm as u64;
            let grid = tiles.clamp(1, full) as u32;
            launch_words(x, f, grid, &[out.ptr(), x.ptr(), batch, rows, cols])?;
        }
        PermutePlan::General(mut args) => {
            let f = function(x, "dt_permute")?;
            (args.out, args.x) = (out.ptr(), x.ptr());
            let grid = grid(x, f, x.len(), 1);
            kernels::launch(f, grid, kernels::BLOCK, x.stream(), &args)?;
        }
    }
    Ok(out)
}

/// A tensor of zeros of `shape` where `like` lives.
pub(crate) fn zeros_like<T: Element>(
    like: &DeviceStorage<T>,
    shape: &[usize],
) -> Result<DeviceStorage<T>> {
    let out = output::<T, T>(like, shape)?;
    let bytes = out.len() * size_of::<T>();
    if bytes > 0 {
        like.gpu().bind()?;
        // SAFETY: the buffer holds `bytes` bytes; zero bits are zero in every element type.
        unsafe { cudarc::driver::result::memset_d8_async(out.ptr(), 0, bytes, out.stream()) }
            .check("cuMemsetD8Async")?;
    }
    Ok(out)
}

/// `a[..., m, k] @ b[..., k, n]` with the batch dimensions broadcast (`batch` is their
/// broadcast shape, computed and checked by the caller): cuBLASLt's strided-batched GEMM over
/// the batch, each operand read in place (a broadcast operand with batch stride 0). Where the
/// broadcast leaves no single stride per operand (say `[2, 1]` against `[1, 3]`), one such call
/// per index of the outer dimensions.
pub(crate) fn batched_matmul<T: Element>(
    a: &DeviceStorage<T>,
    b: &DeviceStorage<T>,
    batch: &[usize],
) -> Result<DeviceStorage<T>> {
    same_gpu("Tensor::matmul", a, b)?;
    after(a, b)?;
    let (sa, sb) = (a.shape(), b.shape());
    let (m, k, n) = (sa[sa.len() - 2], sa[sa.len() - 1], sb[sb.len() - 1]);
    let mut shape = batch.to_vec();
    shape.extend([m, n]);
    let out = output::<T, T>(a, &shape)?;
    let nd = batch.len();
    let strides =
        [broadcast_strides(&sa[..sa.len() - 2], nd), broadcast_strides(&sb[..sb.len() - 2], nd)];
    // Batch dimensions that walk as one (in matrices); the last is one strided-batched call.
    let (dims, walks) = merged(batch, &strides);
    let (inner, outer) = match dims.split_last() {
        Some((&inner, outer)) => (inner as usize, outer.to_vec()),
        None => (1, Vec::new()),
    };
    let stride_of = |w: &Vec<u64>| w.last().copied().unwrap_or(0);
    let (mat_a, mat_b, mat_c) = ((m * k) as u64, (k * n) as u64, (m * n) as u64);
    let calls: u64 = outer.iter().product();
    let es = size_of::<T>() as u64;
    a.gpu().bind()?;
    for o in 0..calls {
        let (mut rest, mut ia, mut ib) = (o, 0u64, 0u64);
        for d in (0..outer.len()).rev() {
            let c = rest % outer[d];
            rest /= outer[d];
            ia += c * walks[0][d];
            ib += c * walks[1][d];
        }
        blas::matmul_batched(
            a.gpu(),
            a.stream(),
            (
                a.ptr() + ia * mat_a * es,
                b.ptr() + ib * mat_b * es,
                out.ptr() + o * inner as u64 * mat_c * es,
            ),
            (m, n, k),
            blas::Batch {
                count: inner,
                stride_a: stride_of(&walks[0]) * mat_a,
                stride_b: stride_of(&walks[1]) * mat_b,
            },
            T::DTYPE,
            T::DTYPE,
        )?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    //! The host side of the kernels' index math, run here the way the kernels walk it (the
    //! kernels themselves run in tests/cuda_tensor_math.rs where a GPU is).
    use super::*;
    use ndarray::{ArrayD, IxDyn};

    /// The input offsets `dt_add` (not flat) reads for output element `i`, as the kernel
    /// computes them.
    fn binary_offsets(p: &BinaryArgs, i: u64) -> (u64, u64) {
        let (mut rest, mut ia, mut ib) = (i, 0, 0);
        for d in (0..p.ndim as usize).rev() {
            let c = rest % p.shape[d];
            rest /= p.shape[d];
            ia += c * p.sa[d];
            ib += c * p.sb[d];
        }
        (ia, ib)
    }

    fn numbered(shape: &[usize]) -> ArrayD<u64> {
        ArrayD::from_shape_vec(IxDyn(shape), (0..shape.iter().product::<usize>() as u64).collect())
            .unwrap()
    }

    #[test]
    fn broadcast_offsets_follow_numpy() {
        let cases: [(&[usize], &[usize]); 9] = [
            (&[2, 3], &[3]),
            (&[3, 1, 5], &[4, 1]),
            (&[7, 1], &[1, 11]),
            (&[5, 2, 3], &[5, 1, 3]),
            (&[1], &[4, 6]),
            (&[2, 3, 4, 5], &[1, 3, 1, 5]),
            (&[6], &[1]),
            (&[1, 1], &[1]),
            (&[2, 1, 2, 1, 2, 1, 2, 1], &[1, 2, 1, 2, 1, 2, 1, 2]),
        ];
        for (a, b) in cases {
            let out = crate::tensor::broadcast_shape(a, b).unwrap();
            let p = binary_plan(a, b, &out, 8).unwrap();
            let (na, nb) = (numbered(a), numbered(b));
            let (wa, wb) = (na.broadcast(IxDyn(&out)).unwrap(), nb.broadcast(IxDyn(&out)).unwrap());
            for (i, (x, y)) in wa.iter().zip(wb.iter()).enumerate() {
                assert_eq!(binary_offsets(&p, i as u64), (*x, *y), "{a:?} with {b:?}, element {i}");
            }
            assert_eq!(p.flat, 0);
        }
        let same = binary_plan(&[4, 5], &[4, 5], &[4, 5], 8).unwrap();
        assert_eq!(same.flat, 1);
        // Same shapes also walk as one contiguous dimension (the strided walk's fallback for
        // tensors too large for the flat kernel).
        for i in 0..20 {
            assert_eq!(binary_offsets(&same, i), (i, i));
        }
        // Nine dimensions that no merging joins are more than the kernel takes: a typed error.
        let (a, b) = ([2, 1, 2, 1, 2, 1, 2, 1, 2], [1, 2, 1, 2, 1, 2, 1, 2, 1]);
        let err = binary_plan(&a, &b, &[2; 9], 8).unwrap_err();
        assert!(matches!(err, Error::InvalidShape { .. }), "{err}");
    }

    /// The vector walk of `dt_add` reads, for each vector of `width` output elements, a vector
    /// (stride 1) or one element (stride 0) of each input at the offsets of its first element:
    /// the same offsets the element walk reads, and vectors whole and aligned.
    #[test]
    fn vector_walks_read_what_the_element_walk_reads() {
        let width = 4u64;
        let cases: [(&[usize], &[usize], bool); 9] = [
            (&[6, 8], &[8], true),
            (&[3, 5, 8], &[5, 1], true),
            (&[3, 4], &[4], true),
            (&[2, 6], &[6], false),
            (&[3, 8], &[3, 1], true),
            (&[3, 5, 4], &[5, 4], true),
            (&[3, 5, 6], &[5, 1], false),
            (&[4, 3, 4], &[1, 3, 4], true),
            (&[5, 1], &[1, 6], false),
        ];
        for (a, b, vectors) in cases {
            let out = crate::tensor::broadcast_shape(a, b).unwrap();
            let p = binary_plan(a, b, &out, width).unwrap();
            assert_eq!(p.vec == 1, vectors, "{a:?} with {b:?}");
            if p.vec == 0 {
                continue;
            }
            let last = p.ndim as usize - 1;
            for v in 0..p.n / width {
                let (ia, ib) = binary_offsets(&p, v * width);
                for (at, stride) in [(ia, p.sa[last]), (ib, p.sb[last])] {
                    assert!(stride == 0 || at % width == 0, "{a:?} with {b:?}: vector {v}");
                }
                for j in 0..width {
                    let want = binary_offsets(&p, v * width + j);
                    let got = (ia + j * p.sa[last], ib + j * p.sb[last]);
                    assert_eq!(got, want, "{a:?} with {b:?}, element {}", v * width + j);
                }
            }
        }
    }

    #[test]
    fn permutations_read_the_right_elements() {
        let shapes: [&[usize]; 5] =
            [&[2, 3, 4], &[3, 37, 45], &[1, 5, 1, 7], &[2, 3, 4, 5], &[6, 1]];
        for shape in shapes {
            let nd = shape.len();
            let x = numbered(shape);
            let mut axes: Vec<usize> = (0..nd).collect();
            // Every permutation, by Heap's algorithm.
            let mut perms = Vec::new();
            fn heap(k: usize, a: &mut Vec<usize>, out: &mut Vec<Vec<usize>>) {
                if k <= 1 {
                    out.push(a.clone());
                    return;
                }
                for i in 0..k {
                    heap(k - 1, a, out);
                    let j = if k.is_multiple_of(2) { i } else { 0 };
                    a.swap(j, k - 1);
                }
            }
            heap(nd, &mut axes, &mut perms);
            for axes in perms {
                let want = x.clone().permuted_axes(IxDyn(&axes)).as_standard_layout().into_owned();
                let got: Vec<u64> = match permute_plan(shape, &axes).unwrap() {
                    PermutePlan::Reshape => x.iter().copied().collect(),
                    PermutePlan::Transpose { batch, rows, cols } => {
                        // dt_transpose: out[b][c][r] = x[b][r][c].
                        let src: Vec<u64> = x.iter().copied().collect();
                        let mut out = vec![0; src.len()];
                        for b in 0..batch {
                            for r in 0..rows {
                                for c in 0..cols {
                                    let base = b * rows * cols;
                                    out[(base + c * rows + r) as usize] =
                                        src[(base + r * cols + c) as usize];
                                }
                            }
                        }
                        out
                    }
                    PermutePlan::General(p) => {
                        let src: Vec<u64> = x.iter().copied().collect();
                        (0..p.n)
                            .map(|i| {
                                let (mut rest, mut ix) = (i, 0);
                                for d in (0..p.ndim as usize).rev() {
                                    ix += (rest % p.shape[d]) * p.sx[d];
                                    rest /= p.shape[d];
                                }
                                src[ix as usize]
                            })
                            .collect()
                    }
                };
                assert_eq!(got, want.iter().copied().collect::<Vec<_>>(), "{shape:?} {axes:?}");
            }
        }
        // The last two axes of a batch take the tiled transpose.
        assert!(matches!(
            permute_plan(&[3, 37, 45], &[0, 2, 1]).unwrap(),
            PermutePlan::Transpose { batch: 3, rows: 37, cols: 45 }
        ));
        assert_eq!(permute_plan(&[1, 5, 1], &[2, 1, 0]).unwrap(), PermutePlan::Reshape);
    }
}
