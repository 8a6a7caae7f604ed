//! A product kernel for few rows (decode: one to [`MAX_ROWS`] tokens), f32 with AVX-512.
//!
//! With few rows a product is bound by reading the weight `b` from memory more than by
//! arithmetic, so what matters is that `b` is read once, as a stream the prefetchers follow.
//! General GEMM kernels pack `b` in blocks and reuse each block for many rows; with 16 rows the
//! packing costs about as much as the product. Here `a` is packed once (transposed, a few KiB) and
//! `b` is read in place:
//!
//! - the output block of up to 8 rows and 32 columns lives in registers (16 of the 32 vector
//!   registers) while [`K_BLOCK`] rows of `b` go through it; each 32-column piece of `b` is loaded
//!   once from memory and used by every row (by the second group of 8 rows from L1);
//! - the column blocks walk along the same [`K_BLOCK`] rows of `b`, so `b` is read as that many
//!   sequential streams, with a software prefetch into L2 a few blocks ahead in each;
//! - the output is read and written once per [`K_BLOCK`] rows of `b` (it stays in cache).
//!
//! Ragged column edges use masked loads and stores. Elsewhere (no AVX-512, more rows, strided
//! columns) the `gemm` crate runs instead.

/// The most rows this kernel takes.
pub(crate) const MAX_ROWS: usize = 16;
/// Rows of `a` per register tile.
const GROUP_ROWS: usize = 8;
/// Rows of `b` per pass over the output.
const K_BLOCK: usize = 128;
/// Columns of `b` prefetched (into L2) ahead of the block being read, along each row. Into L2,
/// not L1: with a row stride that is a multiple of 4 KiB every row's line of a block falls in
/// the same L1 set, so lines prefetched into L1 for many rows evict each other before use.
const PREFETCH_COLS: usize = 128;

/// Whether this CPU runs the kernel.
pub(crate) fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `c = a * b`, or `c += a * b` when `read_c`, for `m <= MAX_ROWS` rows; columns of `b` and `c`
/// contiguous (row strides `ldb`, `ldc`), `a` with any strides. Returns false, doing nothing, if
/// the kernel does not apply here (no AVX-512, too many rows).
///
/// # Safety
/// Every pointer valid for the elements its shape and strides reach; `c` overlaps neither
/// operand; nothing else writes any of them during the call.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gemm(
    m: usize,
    n: usize,
    k: usize,
    (c, ldc): (*mut f32, usize),
    read_c: bool,
    (a, a_rs, a_cs): (*const f32, isize, isize),
    (b, ldb): (*const f32, usize),
) -> bool {
    if m == 0 || m > MAX_ROWS || !available() {
        return false;
    }
    if k == 0 {
        if !read_c {
            for i in 0..m {
                // SAFETY: row i of c has n elements.
                unsafe { std::ptr::write_bytes(c.add(i * ldc), 0, n) };
            }
        }
        return true;
    }
    // `a` transposed and padded: MAX_ROWS floats per step of k, the rows in the first m.
    let mut at = vec![0.0f32; k * MAX_ROWS];
    for (kk, column) in at.chunks_exact_mut(MAX_ROWS).enumerate() {
        for (i, v) in column[..m].iter_mut().enumerate() {
            // SAFETY: (i, kk) is inside `a`, as the caller guarantees.
            *v = unsafe { *a.offset(i as isize * a_rs + kk as isize * a_cs) };
        }
    }
    #[cfg(target_arch = "x86_64")]
    // SAFETY: AVX-512F is present (checked above); the caller guarantees the operands.
    unsafe {
        avx512::gemm(m, n, k, c, ldc, read_c, &at, b, ldb)
    };
    true
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::{GROUP_ROWS, K_BLOCK, MAX_ROWS, PREFETCH_COLS};

    /// The mask of the valid lanes of a 16-lane vector whose first column is `col` of `n`.
    fn lanes(col: usize, n: usize) -> __mmask16 {
        match n.saturating_sub(col) {
            r if r >= 16 => 0xffff,
            r => (1u16 << r) - 1,
        }
    }

    /// Walks the K blocks and column blocks; each group of up to 8 rows runs the kernel made for
    /// its row count, so that its accumulators are registers.
    ///
    /// # Safety
    /// AVX-512F present; as [`super::gemm`], with `at` the packed `a` (`k * MAX_ROWS` floats).
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn gemm(
        m: usize,
        n: usize,
        k: usize,
        c: *mut f32,
        ldc: usize,
        read_c: bool,
        at: &[f32],
        b: *const f32,
        ldb: usize,
    ) {
        assert!(at.len() >= k * MAX_ROWS, "a packed for every step of k");
        let mut k0 = 0;
        while k0 < k {
            let kb = K_BLOCK.min(k - k0);
            let load_c = k0 > 0 || read_c;
            let b_block = b.wrapping_add(k0 * ldb);
            let a_block = &at[k0 * MAX_ROWS..];
            for j in (0..n).step_by(32) {
                let masks = [lanes(j, n), lanes(j + 16, n)];
                for g in (0..m).step_by(GROUP_ROWS) {
                    let tile = Tile { c: c.wrapping_add(g * ldc + j), ldc, load_c, masks };
                    let (b, a) = (b_block.wrapping_add(j), &a_block[g..]);
                    // Only the first group prefetches: the others find the block in L1.
                    let prefetch = g == 0 && j + 32 + PREFETCH_COLS <= n;
                    macro_rules! rows {
                        ($($mr:literal)*) => {
                            match (m - g).min(GROUP_ROWS) {
                                // SAFETY: forwarded; the group has exactly MR rows.
                                $($mr => unsafe { tile.run::<$mr>(kb, a, b, ldb, prefetch) },)*
                                _ => unreachable!("1 to {GROUP_ROWS} rows"),
                            }
                        };
                    }
                    rows!(1 2 3 4 5 6 7 8);
                }
            }
            k0 += kb;
        }
    }

    /// Up to 8 rows and 32 columns of the output.
    struct Tile {
        c: *mut f32,
        ldc: usize,
        /// Whether to add to the output (else it is overwritten).
        load_c: bool,
        /// Valid lanes of the two 16-column halves.
        masks: [__mmask16; 2],
    }

    impl Tile {
        /// `tile (+)= a[.., :kb] * b[:kb, ..32]` with `MR` rows in registers.
        ///
        /// # Safety
        /// `c`, and `b` with row stride `ldb`, valid for `MR` (respectively `kb`) rows of the
        /// masked columns; `a` holds `kb` steps of `MAX_ROWS` floats, this group's rows first.
        #[target_feature(enable = "avx512f")]
        unsafe fn run<const MR: usize>(
            &self,
            kb: usize,
            a: &[f32],
            b: *const f32,
            ldb: usize,
            prefetch: bool,
        ) {
            assert!(a.len() >= (kb - 1) * MAX_ROWS + MR, "a packed for the block");
            let [m0, m1] = self.masks;
            let mut acc = [[_mm512_setzero_ps(); 2]; MR];
            if self.load_c {
                for (i, row) in acc.iter_mut().enumerate() {
                    let c = self.c.wrapping_add(i * self.ldc);
                    // SAFETY: row i of the tile, masked to the valid columns.
                    *row = unsafe {
                        [
                            _mm512_maskz_loadu_ps(m0, c),
                            _mm512_maskz_loadu_ps(m1, c.wrapping_add(16)),
                        ]
                    };
                }
            }
            let a = a.as_ptr();
            for kk in 0..kb {
                let row = b.wrapping_add(kk * ldb);
                // SAFETY: row kk of b's block, masked to the valid columns; the prefetch stays
                // inside the row (the caller checks), and is only a hint.
                let bv = unsafe {
                    if prefetch {
                        _mm_prefetch::<_MM_HINT_T1>(row.add(PREFETCH_COLS).cast());
                        _mm_prefetch::<_MM_HINT_T1>(row.add(PREFETCH_COLS + 16).cast());
                    }
                    [_mm512_maskz_loadu_ps(m0, row), _mm512_maskz_loadu_ps(m1, row.add(16))]
                };
                for (i, r) in acc.iter_mut().enumerate() {
                    // SAFETY: step kk of the packed a has MAX_ROWS >= MR floats (asserted).
                    let x = _mm512_set1_ps(unsafe { *a.add(kk * MAX_ROWS + i) });
                    r[0] = _mm512_fmadd_ps(x, bv[0], r[0]);
                    r[1] = _mm512_fmadd_ps(x, bv[1], r[1]);
                }
            }
            for (i, row) in acc.iter().enumerate() {
                let c = self.c.wrapping_add(i * self.ldc);
                // SAFETY: as the loads above.
                unsafe {
                    _mm512_mask_storeu_ps(c, m0, row[0]);
                    _mm512_mask_storeu_ps(c.wrapping_add(16), m1, row[1]);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng, rngs::StdRng};

    /// Every row count, ragged columns, k not a multiple of the block, strided `a`, both modes,
    /// against an f64 reference.
    #[test]
    fn matches_f64_reference() {
        if !available() {
            return;
        }
        let mut rng = StdRng::seed_from_u64(7);
        for m in 1..=MAX_ROWS {
            for (k, n) in
                [(0, 5), (1, 1), (17, 33), (40, 16), (3, 200), (129, 47), (300, 131), (513, 40)]
            {
                let a: Vec<f32> = (0..m * k).map(|_| rng.random_range(-1.0..1.0)).collect();
                let ldb = n + 3;
                let b: Vec<f32> = (0..k * ldb).map(|_| rng.random_range(-1.0..1.0)).collect();
                let ldc = n + 5;
                let c0: Vec<f32> = (0..m * ldc).map(|_| rng.random_range(-1.0..1.0)).collect();
                for read_c in [false, true] {
                    let mut c = c0.clone();
                    // `a` read transposed: element (i, kk) at kk * m + i.
                    let at: Vec<f32> = (0..k * m).map(|x| a[(x % m) * k + x / m]).collect();
                    // SAFETY: shapes and strides as allocated above.
                    let ran = unsafe {
                        gemm(
                            m,
                            n,
                            k,
                            (c.as_mut_ptr(), ldc),
                            read_c,
                            (at.as_ptr(), 1, m as isize),
                            (b.as_ptr(), ldb),
                        )
                    };
                    assert!(ran);
                    for i in 0..m {
                        for j in 0..ldc {
                            let got = c[i * ldc + j] as f64;
                            if j >= n {
                                assert_eq!(got, c0[i * ldc + j] as f64, "past the columns");
                                continue;
                            }
                            let base = if read_c { c0[i * ldc + j] as f64 } else { 0.0 };
                            let want = base
                                + (0..k)
                                    .map(|kk| a[i * k + kk] as f64 * b[kk * ldb + j] as f64)
                                    .sum::<f64>();
                            let tol = 1e-6 * (k as f64 + 1.0) * 4.0;
                            assert!(
                                (got - want).abs() <= tol,
                                "m={m} k={k} n={n} read_c={read_c} ({i},{j}): {got} vs {want}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn declines_what_it_does_not_do() {
        let mut c = [0.0f32; 17];
        let a = [1.0f32; 17];
        let b = [1.0f32; 1];
        // SAFETY: the kernel returns before touching anything.
        let ran = unsafe {
            gemm(17, 1, 1, (c.as_mut_ptr(), 1), false, (a.as_ptr(), 1, 1), (b.as_ptr(), 1))
        };
        assert!(!ran);
        assert_eq!(c, [0.0; 17]);
    }
}
