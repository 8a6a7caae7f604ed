//! The two ways a product reaches the `gemm` crate.
//!
//! f32 and f64 go straight to it, strided operands included. f16 and bf16 are widened to f32
//! first and run through the f32 kernel: the crate has no bf16 kernel, and one path for both half
//! types keeps their rounding the same (one rounding of an f32 accumulator).
//!
//! The crate is built with its `x86-v4` feature: AVX-512 kernels, chosen at run time on CPUs that
//! have AVX-512F (others keep the AVX2 or SSE kernels). `perf_report` prints the one-core GFLOP/s
//! and the fraction of the measured peak it reaches.

use std::any::TypeId;

use gemm::Parallelism;

use super::{Element, few_rows};

fn parallelism(threads: usize) -> Parallelism {
    if threads <= 1 { Parallelism::None } else { Parallelism::Rayon(threads) }
}

/// `acc += a * b` (or `acc = a * b` when `read_acc` is false) for a type `gemm` supports natively.
///
/// # Safety
/// As [`Element::gemm_acc`].
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn native<T: 'static + num_traits::One + num_traits::Zero>(
    m: usize,
    n: usize,
    k: usize,
    (dst, dst_rs, dst_cs): (*mut T, isize, isize),
    read_acc: bool,
    (lhs, lhs_rs, lhs_cs): (*const T, isize, isize),
    (rhs, rhs_rs, rhs_cs): (*const T, isize, isize),
    threads: usize,
) {
    if m == 0 || n == 0 {
        return;
    }
    if TypeId::of::<T>() == TypeId::of::<f32>()
        && m <= few_rows::MAX_ROWS
        && rhs_cs == 1
        && dst_cs == 1
    {
        // SAFETY: T is f32 (checked), so the casts are the identity; forwarded from the caller.
        let ran = unsafe {
            few_rows_threaded(
                m,
                n,
                k,
                (dst.cast(), dst_rs),
                read_acc,
                (lhs.cast(), lhs_rs, lhs_cs),
                (rhs.cast(), rhs_rs),
                threads,
            )
        };
        if ran {
            return;
        }
    }
    if k == 0 {
        if !read_acc {
            for i in 0..m as isize {
                for j in 0..n as isize {
                    // SAFETY: (i, j) is inside dst's shape.
                    unsafe { *dst.offset(i * dst_rs + j * dst_cs) = T::zero() };
                }
            }
        }
        return;
    }
    // SAFETY: the caller guarantees the operands; gemm computes dst := 1*dst + 1*lhs*rhs, and
    // ignores dst's old value when read_dst is false.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            dst_cs,
            dst_rs,
            read_acc,
            lhs,
            lhs_cs,
            lhs_rs,
            rhs,
            rhs_cs,
            rhs_rs,
            T::one(),
            T::one(),
            false,
            false,
            false,
            parallelism(threads),
        )
    }
}

/// [`few_rows::gemm`] with its columns split over `threads` threads (whole blocks of 16 columns).
/// Returns whether it ran.
///
/// # Safety
/// As [`few_rows::gemm`]; row strides non-negative.
#[allow(clippy::too_many_arguments)]
unsafe fn few_rows_threaded(
    m: usize,
    n: usize,
    k: usize,
    (c, ldc): (*mut f32, isize),
    read_c: bool,
    a: (*const f32, isize, isize),
    (b, ldb): (*const f32, isize),
    threads: usize,
) -> bool {
    let (Ok(ldc), Ok(ldb)) = (usize::try_from(ldc), usize::try_from(ldb)) else {
        return false;
    };
    let parts = threads.min(n.div_ceil(16)).max(1);
    if parts == 1 {
        // SAFETY: forwarded from the caller.
        return unsafe { few_rows::gemm(m, n, k, (c, ldc), read_c, a, (b, ldb)) };
    }
    if m > few_rows::MAX_ROWS || !few_rows::available() {
        return false;
    }
    let width = n.div_ceil(16).div_ceil(parts) * 16;
    // Raw pointers are not Send: pass addresses. Each part writes its own columns of `c`.
    let (c_addr, b_addr, a_addr) = (c as usize, b as usize, a.0 as usize);
    rayon::scope(|s| {
        for j in (0..n).step_by(width) {
            s.spawn(move |_| {
                let cols = width.min(n - j);
                let (c, b) =
                    ((c_addr as *mut f32).wrapping_add(j), (b_addr as *const f32).wrapping_add(j));
                // SAFETY: columns j..j + cols of `b` and `c`, inside both; parts are disjoint.
                let ran = unsafe {
                    few_rows::gemm(
                        m,
                        cols,
                        k,
                        (c, ldc),
                        read_c,
                        (a_addr as *const f32, a.1, a.2),
                        (b, ldb),
                    )
                };
                debug_assert!(ran, "checked before the split");
            });
        }
    });
    true
}

/// The `rows x cols` matrix stored column-major in `data` (column `j` at `j * ld`), written
/// row-major into `out` through `convert`. In blocks of 32 rows by 16 columns, written row by
/// row: each output row's part is written whole (16 f32 are one 64-byte line), and the 16 columns
/// read stay in the first-level cache. (Writing down a block's columns instead touches rows that
/// lie a power of two apart, which share a cache set and evict each other: several times
/// slower.)
pub(crate) fn transpose_into<T: Copy, U>(
    out: &mut [U],
    data: &[T],
    ld: usize,
    (rows, cols): (usize, usize),
    convert: impl Fn(T) -> U,
) {
    const BLOCK_I: usize = 32;
    const BLOCK_J: usize = 16;
    for i0 in (0..rows).step_by(BLOCK_I) {
        for j0 in (0..cols).step_by(BLOCK_J) {
            let js = j0..(j0 + BLOCK_J).min(cols);
            for i in i0..(i0 + BLOCK_I).min(rows) {
                let row = &mut out[i * cols..(i + 1) * cols];
                for j in js.clone() {
                    row[j] = convert(data[j * ld + i]);
                }
            }
        }
    }
}

/// The `rows x cols` operand at `src` (strides `rs`, `cs`) widened to f32 into `out`, row-major.
/// A column-major operand (a transposed weight in a backward pass) goes through
/// [`transpose_into`]: read element by element down its rows, it took several times as long.
///
/// # Safety
/// `src` must address a `rows x cols` operand with those strides.
unsafe fn widen<T: Element<Acc = f32>>(
    rows: usize,
    cols: usize,
    (src, rs, cs): (*const T, isize, isize),
    out: &mut Vec<f32>,
) {
    if rs == 1 && cs > 1 && rows > 1 && cols > 1 {
        let ld = cs as usize;
        // SAFETY: column j's `rows` elements start at `j * ld`; the last ends the operand.
        let data = unsafe { std::slice::from_raw_parts(src, (cols - 1) * ld + rows) };
        // Every element is written below: a buffer kept from a product of the same size is
        // reused as it is, without zeroing it first.
        out.resize(rows * cols, 0.0);
        transpose_into(out, data, ld, (rows, cols), |x| x.to_acc());
        return;
    }
    out.clear();
    out.reserve(rows * cols);
    for i in 0..rows as isize {
        if cs == 1 {
            // SAFETY: a row of `cols` contiguous elements, as the caller guarantees.
            let row = unsafe { std::slice::from_raw_parts(src.offset(i * rs), cols) };
            out.extend(row.iter().map(|x| x.to_acc()));
        } else {
            for j in 0..cols as isize {
                // SAFETY: (i, j) is inside the operand.
                out.push(unsafe { *src.offset(i * rs + j * cs) }.to_acc());
            }
        }
    }
}

thread_local! {
    static WIDENED: std::cell::RefCell<(Vec<f32>, Vec<f32>)> =
        const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
}

/// `acc += a * b` for a half type, by widening both operands to f32.
///
/// # Safety
/// As [`Element::gemm_acc`].
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn widened<T: Element<Acc = f32>>(
    m: usize,
    n: usize,
    k: usize,
    acc: (*mut f32, isize, isize),
    read_acc: bool,
    a: (*const T, isize, isize),
    b: (*const T, isize, isize),
    threads: usize,
) {
    WIDENED.with(|bufs| {
        // A reentrant call (from inside gemm's own rayon workers) would find the buffers taken;
        // it never happens because gemm does not call back into us, but fall back to fresh ones.
        let mut fresh = (Vec::new(), Vec::new());
        let mut guard = bufs.try_borrow_mut();
        let (wa, wb) = match guard.as_deref_mut() {
            Ok(pair) => (&mut pair.0, &mut pair.1),
            Err(_) => (&mut fresh.0, &mut fresh.1),
        };
        // SAFETY: forwarded from the caller's contract; the widened copies are contiguous.
        unsafe {
            widen(m, k, a, wa);
            widen(k, n, b, wb);
            native(
                m,
                n,
                k,
                acc,
                read_acc,
                (wa.as_ptr(), k as isize, 1),
                (wb.as_ptr(), n as isize, 1),
                threads,
            );
        }
    });
}
