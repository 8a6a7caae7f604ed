//! A product kernel for few rows (decode: one to [`MAX_ROWS`] tokens), f32 with AVX-512.
//!
//! With few rows a product is bound by reading the weight `b` from memory more than by
//! arithmetic, so what matters is that `b` is read once, in a pattern memory serves at its full
//! rate, while the arithmetic goes on. General GEMM kernels pack `b` in blocks and reuse each
//! block for many rows; with 16 rows the packing costs about as much as the product. Here `a` is
//! packed once (transposed, a few KiB) and `b` is read in place:
//!
//! - the output block of up to 8 rows and 32 columns lives in registers (16 of the 32 vector
//!   registers) while a k-block of [`k_block`] rows of `b` goes through it; each 32-column piece
//!   of `b` is loaded once from L2 and used by every row (by the second group of 8 rows from L1:
//!   8 rows of 2 lines fit one L1 set's ways even when the rows are a power of two apart);
//! - between k-blocks the output rows wait in a packed buffer (each 32-column tile's rows
//!   contiguous), not in `c`: output rows a power of two apart would alias in L1 and stall loads
//!   of `b` behind stores to `c` (4 KiB aliasing). The buffer goes to `c` at the end;
//! - while the tiles multiply one k-block, they prefetch the next one into L2, one cache line per
//!   k-step, in memory order (row by row, each row left to right). So memory sees a few
//!   sequential streams, which it serves as fast as a plain read, while the tiles read `b` from
//!   L2 across rows.
//!
//! The profile that chose this (one core, the weight from memory; timed variants of the kernel):
//! reading the weight straight through takes about as long as the product with the weight in
//! cache, but the earlier order (128 rows of `b` at a time, 128 bytes of each, prefetched 512
//! bytes ahead along each row, the output in `c`) read at half the straight-through rate and
//! overlapped little with the arithmetic. `perf_report`'s one-core rows give the rate this
//! kernel reaches (weight GB/s) beside the machine's read bandwidth.
//!
//! Ragged column edges use masked loads and stores. Elsewhere (no AVX-512, more rows, strided
//! columns) the `gemm` crate runs instead.

/// The most rows this kernel takes.
pub(crate) const MAX_ROWS: usize = 16;
/// Rows of `a` per register tile.
const GROUP_ROWS: usize = 8;
/// Bytes of `b` per k-block: the block being multiplied and the next one, prefetched, both sit
/// in L2 (1 MiB per core on Zen 4, 2 MiB on Zen 5) beside the packed output.
const K_BLOCK_BYTES: usize = 256 << 10;

/// Rows of `b` per k-block for `n` columns: as many as fit [`K_BLOCK_BYTES`], from 8 to 32. Every
/// k-block loads and stores each output tile's accumulators once (16 vector loads and 16 stores
/// per 8 rows of a tile); with 8 rows of `b` per block that traffic is a quarter of the
/// arithmetic's cycles, with 32 a sixteenth. Timed on a Zen 4 (16 rows, k = 4096, 2 threads on
/// 2048 columns each, 4 on 1024): 8 to 10% faster at 32 rows than at 8, and slower again at 64
/// (the blocks leave L2). The blocking does not change the order of the sums: the same bits.
fn k_block(n: usize) -> usize {
    (K_BLOCK_BYTES / (n.max(1) * size_of::<f32>())).clamp(8, 32)
}
/// Columns per tile of the output.
const TILE_COLS: usize = 32;

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
    // The output between k-blocks, packed: tile t's rows at t * MAX_ROWS * TILE_COLS.
    let tiles = n.div_ceil(TILE_COLS);
    let mut packed = vec![0.0f32; tiles * MAX_ROWS * TILE_COLS];
    if read_c {
        for (t, tile) in packed.chunks_exact_mut(MAX_ROWS * TILE_COLS).enumerate() {
            let cols = TILE_COLS.min(n - t * TILE_COLS);
            for (i, row) in tile.chunks_exact_mut(TILE_COLS).take(m).enumerate() {
                // SAFETY: row i of c has n elements; these are columns t * 32 .. + cols.
                let from =
                    unsafe { std::slice::from_raw_parts(c.add(i * ldc + t * TILE_COLS), cols) };
                row[..cols].copy_from_slice(from);
            }
        }
    }
    #[cfg(target_arch = "x86_64")]
    // SAFETY: AVX-512F is present (checked above); the caller guarantees the operands.
    unsafe {
        avx512::gemm(m, n, k, &mut packed, read_c, &at, b, ldb)
    };
    for (t, tile) in packed.chunks_exact(MAX_ROWS * TILE_COLS).enumerate() {
        let cols = TILE_COLS.min(n - t * TILE_COLS);
        for (i, row) in tile.chunks_exact(TILE_COLS).take(m).enumerate() {
            // SAFETY: as above; `c` overlaps neither operand nor the buffer.
            let to =
                unsafe { std::slice::from_raw_parts_mut(c.add(i * ldc + t * TILE_COLS), cols) };
            to.copy_from_slice(&row[..cols]);
        }
    }
    true
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::{GROUP_ROWS, MAX_ROWS, TILE_COLS, k_block};

    /// The mask of the valid lanes of a 16-lane vector whose first column is `col` of `n`.
    fn lanes(col: usize, n: usize) -> __mmask16 {
        match n.saturating_sub(col) {
            r if r >= 16 => 0xffff,
            r => (1u16 << r) - 1,
        }
    }

    /// A walk over rows `row..end` of `b`'s `n` columns, one 64-byte line at a time in memory
    /// order: the next k-block, prefetched into L2.
    #[derive(Clone, Copy)]
    struct Prefetch {
        b: *const f32,
        ldb: usize,
        n: usize,
        row: usize,
        col: usize,
        end: usize,
    }

    impl Prefetch {
        /// Prefetches the next line and moves on (nothing once past the last row).
        #[inline(always)]
        fn step(&mut self) {
            if self.row < self.end {
                let at = self.b.wrapping_add(self.row * self.ldb + self.col);
                // SAFETY: a prefetch is only a hint (SSE, part of x86-64); `at` is inside `b`.
                unsafe { _mm_prefetch::<_MM_HINT_T1>(at.cast()) };
                self.col += 16;
                if self.col >= self.n {
                    self.col = 0;
                    self.row += 1;
                }
            }
        }
    }

    /// Walks the k-blocks and column tiles; each group of up to 8 rows runs the kernel made for
    /// its row count, so that its accumulators are registers. `packed` holds the output tiles
    /// (see [`super::gemm`]): read first when `read_c`.
    ///
    /// # Safety
    /// AVX-512F present; `b` valid for `k` rows of `n` columns at row stride `ldb`; `at` the
    /// packed `a` (`k * MAX_ROWS` floats).
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn gemm(
        m: usize,
        n: usize,
        k: usize,
        packed: &mut [f32],
        read_c: bool,
        at: &[f32],
        b: *const f32,
        ldb: usize,
    ) {
        assert!(at.len() >= k * MAX_ROWS, "a packed for every step of k");
        assert!(packed.len() >= n.div_ceil(TILE_COLS) * MAX_ROWS * TILE_COLS, "a tile per column");
        let block = k_block(n);
        let mut k0 = 0;
        while k0 < k {
            let kb = block.min(k - k0);
            let end = (k0 + kb + block).min(k);
            let mut next = Prefetch { b, ldb, n, row: k0 + kb, col: 0, end };
            // Lines of the next block per k-step of this one's tiles: all of them covered.
            let next_lines = (end - k0 - kb) * n.div_ceil(16);
            let steps = n.div_ceil(TILE_COLS) * m.div_ceil(GROUP_ROWS) * kb;
            let per_step = next_lines.div_ceil(steps).max(1);
            let load_c = k0 > 0 || read_c;
            let b_block = b.wrapping_add(k0 * ldb);
            let a_block = &at[k0 * MAX_ROWS..];
            for (t, tile_c) in packed.chunks_exact_mut(MAX_ROWS * TILE_COLS).enumerate() {
                let j = t * TILE_COLS;
                if j >= n {
                    break;
                }
                let masks = [lanes(j, n), lanes(j + 16, n)];
                for g in (0..m).step_by(GROUP_ROWS) {
                    let tile = Tile { c: &mut tile_c[g * TILE_COLS..], load_c, masks };
                    let (b, a) = (b_block.wrapping_add(j), &a_block[g..]);
                    macro_rules! rows {
                        ($($mr:literal)*) => {
                            match (m - g).min(GROUP_ROWS) {
                                // SAFETY: forwarded; the group has exactly MR rows.
                                $($mr => unsafe {
                                    tile.run::<$mr>(kb, a, b, ldb, &mut next, per_step)
                                },)*
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

    /// Up to 8 rows and 32 columns of the output, in the packed buffer (rows 32 floats apart).
    struct Tile<'a> {
        c: &'a mut [f32],
        /// Whether to add to the output (else it is overwritten).
        load_c: bool,
        /// Valid lanes of the two 16-column halves.
        masks: [__mmask16; 2],
    }

    impl Tile<'_> {
        /// `tile (+)= a[.., :kb] * b[:kb, ..32]` with `MR` rows in registers, prefetching
        /// `per_step` lines of `next` at every step.
        ///
        /// # Safety
        /// `b` with row stride `ldb` valid for `kb` rows of the masked columns; `a` holds `kb`
        /// steps of `MAX_ROWS` floats, this group's rows first; `next` walks inside `b`'s matrix.
        #[target_feature(enable = "avx512f")]
        unsafe fn run<const MR: usize>(
            self,
            kb: usize,
            a: &[f32],
            b: *const f32,
            ldb: usize,
            next: &mut Prefetch,
            per_step: usize,
        ) {
            assert!(a.len() >= (kb - 1) * MAX_ROWS + MR, "a packed for the block");
            assert!(self.c.len() >= MR * super::TILE_COLS, "the tile's rows");
            let c = self.c.as_mut_ptr();
            let mut acc = [[_mm512_setzero_ps(); 2]; MR];
            if self.load_c {
                for (i, row) in acc.iter_mut().enumerate() {
                    // SAFETY: row i of the tile: 32 floats inside the buffer (asserted).
                    *row = unsafe {
                        [_mm512_loadu_ps(c.add(i * 32)), _mm512_loadu_ps(c.add(i * 32 + 16))]
                    };
                }
            }
            let [m0, m1] = self.masks;
            let a = a.as_ptr();
            let mut walk = *next;
            for kk in 0..kb {
                for _ in 0..per_step {
                    walk.step();
                }
                let row = b.wrapping_add(kk * ldb);
                // SAFETY: row kk of b's block, masked to the valid columns (plain loads where
                // all 32 are valid: a little faster than masked ones here).
                let bv = unsafe {
                    if m1 == 0xffff {
                        [_mm512_loadu_ps(row), _mm512_loadu_ps(row.add(16))]
                    } else {
                        [_mm512_maskz_loadu_ps(m0, row), _mm512_maskz_loadu_ps(m1, row.add(16))]
                    }
                };
                for (i, r) in acc.iter_mut().enumerate() {
                    // SAFETY: step kk of the packed a has MAX_ROWS >= MR floats (asserted).
                    let x = _mm512_set1_ps(unsafe { *a.add(kk * MAX_ROWS + i) });
                    r[0] = _mm512_fmadd_ps(x, bv[0], r[0]);
                    r[1] = _mm512_fmadd_ps(x, bv[1], r[1]);
                }
            }
            *next = walk;
            for (i, row) in acc.iter().enumerate() {
                // SAFETY: as the loads above.
                unsafe {
                    _mm512_storeu_ps(c.add(i * 32), row[0]);
                    _mm512_storeu_ps(c.add(i * 32 + 16), row[1]);
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
            // Nothing to check against a reference here: the kernel must decline, so that the
            // caller takes the general product (which tests/matmul.rs checks), and say so.
            let (mut c, a, b) = ([7.0f32; 4], [1.0f32; 4], [1.0f32; 4]);
            // SAFETY: the kernel returns before touching anything on this CPU.
            let ran = unsafe {
                gemm(2, 2, 2, (c.as_mut_ptr(), 2), false, (a.as_ptr(), 2, 1), (b.as_ptr(), 2))
            };
            assert!(!ran && c == [7.0; 4], "the kernel ran without AVX-512");
            eprintln!("few_rows::matches_f64_reference skipped: this CPU has no AVX-512F");
            return;
        }
        let mut rng = StdRng::seed_from_u64(7);
        for m in 1..=MAX_ROWS {
            for (k, n) in [
                (0, 5),
                (1, 1),
                (17, 33),
                (40, 16),
                (3, 200),
                (129, 47),
                (300, 131),
                (513, 40),
                // Many tiles and k-blocks, both ragged.
                (37, 2100),
            ] {
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
