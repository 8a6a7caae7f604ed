//! Tile operations a kernel uses: masked loads and stores, `atomic_add`, `dot`.
//!
//! A 2-D access names the top-left element with a pointer (offsets added with `add`, after
//! `symm_at`), a row stride in elements, and a mask: the seed's
//! `(offs_m < M)[:, None] & (offs_n < N)[None, :]`, which for a block is "the first `valid.0` rows
//! and the first `valid.1` columns". Masked-off elements are neither read nor written: masks
//! instead of padding. Every access is bounds-checked against the memory the pointer came from.
//!
//! # The access contract
//!
//! Pointers are plain pointers, as in the seed: nothing stops two programs, or two ranks, from
//! touching the same memory at once, so the operations that access memory through them are
//! `unsafe`, like dereferencing a raw pointer. The caller promises that while an operation runs,
//! no other program, rank or thread writes what it reads or accesses what it writes (a kernel
//! orders such accesses with a release `notify` before an acquire `wait`, or a barrier; programs
//! write disjoint parts of shared outputs), and that its source and destination do not overlap.
//! Bounds are checked regardless: an access outside its memory panics.

use crate::Element;
use crate::shmem::{GlobalPtrMut, Readable, Writable};

/// How many of the `block` positions starting at `start` lie below `bound`: the length of the
/// mask `start + arange(block) < bound`.
///
/// # Examples
/// ```
/// use dist_tensor::device::tile::valid_len;
/// assert_eq!(valid_len(0, 16, 100), 16);
/// assert_eq!(valid_len(96, 16, 100), 4);
/// assert_eq!(valid_len(112, 16, 100), 0);
/// ```
pub fn valid_len(start: usize, block: usize, bound: usize) -> usize {
    bound.saturating_sub(start).min(block)
}

/// A small row-major block of values held by one program (what Triton keeps in registers).
///
/// # Examples
/// ```
/// use dist_tensor::device::tile::Tile;
/// let mut t = Tile::new(2, 3, 0.0f32);
/// t.as_mut_slice()[4] = 1.0;
/// assert_eq!(t.get(1, 1), 1.0);
/// assert_eq!(t.row(1), &[0.0, 1.0, 0.0]);
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct Tile<T> {
    rows: usize,
    cols: usize,
    data: Vec<T>,
}

impl<T: Copy> Tile<T> {
    /// A `rows x cols` tile filled with `fill` (`tl.full`, `tl.zeros`).
    ///
    /// # Panics
    /// If `rows * cols` overflows.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::device::tile::Tile;
    /// let t = Tile::new(2, 3, 7u32);
    /// assert_eq!(t.as_slice(), &[7; 6]);
    /// ```
    #[track_caller]
    pub fn new(rows: usize, cols: usize, fill: T) -> Self {
        let len = rows.checked_mul(cols).expect("Tile::new: rows * cols overflows");
        Tile { rows, cols, data: vec![fill; len] }
    }

    /// Rows.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::device::tile::Tile;
    /// assert_eq!(Tile::new(2, 3, 0.0f32).rows(), 2);
    /// ```
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Columns.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::device::tile::Tile;
    /// assert_eq!(Tile::new(2, 3, 0.0f32).cols(), 3);
    /// ```
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Element `(i, j)`.
    ///
    /// # Panics
    /// If `(i, j)` is outside the tile.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::device::tile::Tile;
    /// let mut t = Tile::new(2, 2, 0);
    /// t.as_mut_slice().copy_from_slice(&[1, 2, 3, 4]);
    /// assert_eq!(t.get(1, 0), 3);
    /// ```
    #[track_caller]
    pub fn get(&self, i: usize, j: usize) -> T {
        assert!(
            i < self.rows && j < self.cols,
            "({i}, {j}) outside a {}x{} tile",
            self.rows,
            self.cols
        );
        self.data[i * self.cols + j]
    }

    /// Row `i`.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::device::tile::Tile;
    /// let mut t = Tile::new(2, 3, 0.0f32);
    /// t.as_mut_slice()[3..].fill(1.0);
    /// assert_eq!(t.row(0), &[0.0; 3]);
    /// assert_eq!(t.row(1), &[1.0; 3]);
    /// ```
    pub fn row(&self, i: usize) -> &[T] {
        &self.data[i * self.cols..(i + 1) * self.cols]
    }

    /// All elements, row-major.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::device::tile::Tile;
    /// let t = Tile::new(3, 2, 1.5f64);
    /// assert_eq!(t.as_slice().len(), 6);
    /// assert!(t.as_slice().iter().all(|&v| v == 1.5));
    /// ```
    pub fn as_slice(&self) -> &[T] {
        &self.data
    }

    /// All elements, row-major, mutably.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::device::tile::Tile;
    /// let mut t = Tile::new(2, 2, 0);
    /// t.as_mut_slice()[1] = 9; // row 0, column 1
    /// assert_eq!(t.get(0, 1), 9);
    /// ```
    pub fn as_mut_slice(&mut self) -> &mut [T] {
        &mut self.data
    }

    /// Sets every element to `v`.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::device::tile::Tile;
    /// let mut t = Tile::new(2, 2, 0.0f32);
    /// t.fill(2.5);
    /// assert_eq!(t, Tile::new(2, 2, 2.5));
    /// ```
    pub fn fill(&mut self, v: T) {
        self.data.fill(v);
    }
}

impl<A: Element> Tile<A> {
    /// Rounds every element into `out`'s type (`acc.to(dtype)`), which must be the same size.
    ///
    /// # Panics
    /// If the shapes differ.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::device::tile::Tile;
    /// use half::bf16;
    /// let acc = Tile::new(1, 2, 1.5f32);
    /// let mut out = Tile::new(1, 2, bf16::ZERO);
    /// acc.cast_into(&mut out);
    /// assert_eq!(out.get(0, 1), bf16::from_f32(1.5));
    /// ```
    #[track_caller]
    pub fn cast_into<T: Element<Acc = A>>(&self, out: &mut Tile<T>) {
        assert_eq!((self.rows, self.cols), (out.rows, out.cols), "cast_into: tile shapes differ");
        for (o, &a) in out.data.iter_mut().zip(&self.data) {
            *o = T::from_acc(a);
        }
    }
}

/// Panics unless a mask of `valid` rows and columns fits a tile of `block` rows and columns.
#[track_caller]
fn check_mask(op: &str, valid: (usize, usize), block: (usize, usize)) {
    assert!(valid.0 <= block.0 && valid.1 <= block.1, "{op}: mask {valid:?} larger than the tile");
}

/// Panics unless a `rows x cols` access with `row_stride` fits in `len` elements.
#[track_caller]
fn check_fits(op: &str, len: usize, row_stride: usize, rows: usize, cols: usize) {
    if rows == 0 || cols == 0 {
        return;
    }
    let last = (rows - 1).checked_mul(row_stride).and_then(|r| r.checked_add(cols));
    let Some(last) = last else {
        panic!("{op}: access of {rows}x{cols} with row stride {row_stride} overflows")
    };
    assert!(
        cols <= row_stride || rows == 1,
        "{op}: rows of {cols} elements overlap with a row stride of {row_stride}"
    );
    assert!(
        last <= len,
        "{op}: access of {rows}x{cols} (row stride {row_stride}) needs {last} elements, {len} available"
    );
}

/// `out[i] = src[i]` for `i < valid`, `fill` beyond (`tl.load(ptr + arange, mask, other)`).
///
/// # Safety
/// The [access contract](self#the-access-contract): no other program, rank or thread writes
/// what this reads or touches what this writes while it runs (order such accesses with signals
/// or barriers), and source and destination do not overlap.
///
/// # Panics
/// If `valid > out.len()` or the access leaves the pointer's memory.
///
/// # Examples
/// ```
/// use dist_tensor::device::tile;
/// use dist_tensor::shmem::GlobalPtr;
/// let src = [1.0f32, 2.0, 3.0];
/// let mut out = [0.0f32; 4];
/// // SAFETY: nothing else accesses these arrays meanwhile.
/// unsafe { tile::load_1d(GlobalPtr::from_slice(&src) + 1, &mut out, 2, -1.0); }
/// assert_eq!(out, [2.0, 3.0, -1.0, -1.0]);
/// ```
#[track_caller]
pub unsafe fn load_1d<T: Copy, P: Readable<T>>(src: P, out: &mut [T], valid: usize, fill: T) {
    assert!(valid <= out.len(), "load_1d: mask of {valid} longer than the block of {}", out.len());
    let (ptr, len) = src.raw_read();
    check_fits("load_1d", len, valid, 1, valid);
    // SAFETY: `valid` elements fit in the source (checked); `out` is a separate Rust slice.
    unsafe { std::ptr::copy_nonoverlapping(ptr, out.as_mut_ptr(), valid) };
    out[valid..].fill(fill);
}

/// `dst[i] = data[i]` for `i < valid` (`tl.store(ptr + arange, data, mask)`).
///
/// # Safety
/// The [access contract](self#the-access-contract): no other program, rank or thread writes
/// what this reads or touches what this writes while it runs (order such accesses with signals
/// or barriers), and source and destination do not overlap.
///
/// # Panics
/// If `valid > data.len()` or the access leaves the pointer's memory.
///
/// # Examples
/// ```
/// use dist_tensor::device::tile;
/// use dist_tensor::shmem::GlobalPtrMut;
/// let mut dst = [0.0f64; 3];
/// // SAFETY: nothing else accesses these arrays meanwhile.
/// unsafe { tile::store_1d(GlobalPtrMut::from_slice(&mut dst), &[5.0, 6.0, 7.0, 8.0], 2); }
/// assert_eq!(dst, [5.0, 6.0, 0.0]);
/// ```
#[track_caller]
pub unsafe fn store_1d<T: Copy, P: Writable<T>>(dst: P, data: &[T], valid: usize) {
    assert!(
        valid <= data.len(),
        "store_1d: mask of {valid} longer than the block of {}",
        data.len()
    );
    let (ptr, len) = dst.raw_write();
    check_fits("store_1d", len, valid, 1, valid);
    // SAFETY: `valid` elements fit in the destination (checked); `data` is a separate slice.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), ptr, valid) };
}

/// Loads the first `valid.0` rows and `valid.1` columns of a 2-D block into `tile`, and `fill`
/// everywhere else.
///
/// # Safety
/// The [access contract](self#the-access-contract): no other program, rank or thread writes
/// what this reads or touches what this writes while it runs (order such accesses with signals
/// or barriers), and source and destination do not overlap.
///
/// # Panics
/// If the mask is larger than the tile or the access leaves the pointer's memory.
///
/// # Examples
/// ```
/// use dist_tensor::device::tile::{self, Tile};
/// use dist_tensor::shmem::GlobalPtr;
/// let m = [1, 2, 3, 4, 5, 6].map(|x| x as f32); // 2 x 3, row stride 3
/// let mut t = Tile::new(2, 2, 0.0f32);
/// // SAFETY: nothing else accesses these arrays meanwhile.
/// unsafe { tile::load_2d(GlobalPtr::from_slice(&m) + 1, 3, (2, 1), 9.0, &mut t); }
/// assert_eq!(t.as_slice(), &[2.0, 9.0, 5.0, 9.0]);
/// ```
#[track_caller]
pub unsafe fn load_2d<T: Copy, P: Readable<T>>(
    src: P,
    row_stride: usize,
    valid: (usize, usize),
    fill: T,
    tile: &mut Tile<T>,
) {
    let (rows, cols) = valid;
    check_mask("load_2d", valid, (tile.rows, tile.cols));
    let (ptr, len) = src.raw_read();
    check_fits("load_2d", len, row_stride, rows, cols);
    let tile_cols = tile.cols;
    if tile_cols == 0 {
        return;
    }
    for (i, row) in tile.data.chunks_exact_mut(tile_cols).enumerate() {
        if i < rows {
            // SAFETY: row i's `cols` elements are inside the source (checked above).
            unsafe {
                std::ptr::copy_nonoverlapping(ptr.add(i * row_stride), row.as_mut_ptr(), cols)
            };
            row[cols..].fill(fill);
        } else {
            row.fill(fill);
        }
    }
}

/// Stores the first `valid.0` rows and `valid.1` columns of `tile` into a 2-D block.
///
/// # Safety
/// The [access contract](self#the-access-contract): no other program, rank or thread writes
/// what this reads or touches what this writes while it runs (order such accesses with signals
/// or barriers), and source and destination do not overlap.
///
/// # Panics
/// If the mask is larger than the tile or the access leaves the pointer's memory.
///
/// # Examples
/// ```
/// use dist_tensor::device::tile::{self, Tile};
/// use dist_tensor::shmem::GlobalPtrMut;
/// let mut m = [0.0f32; 6]; // 2 x 3
/// let t = Tile::new(2, 2, 1.0f32);
/// // SAFETY: nothing else accesses these arrays meanwhile.
/// unsafe { tile::store_2d(GlobalPtrMut::from_slice(&mut m) + 1, 3, &t, (2, 2)); }
/// assert_eq!(m, [0.0, 1.0, 1.0, 0.0, 1.0, 1.0]);
/// ```
#[track_caller]
pub unsafe fn store_2d<T: Copy, P: Writable<T>>(
    dst: P,
    row_stride: usize,
    tile: &Tile<T>,
    valid: (usize, usize),
) {
    let (rows, cols) = valid;
    check_mask("store_2d", valid, (tile.rows, tile.cols));
    let (ptr, len) = dst.raw_write();
    check_fits("store_2d", len, row_stride, rows, cols);
    for i in 0..rows {
        // SAFETY: row i's `cols` elements are inside the destination (checked above).
        unsafe {
            std::ptr::copy_nonoverlapping(tile.row(i).as_ptr(), ptr.add(i * row_stride), cols)
        };
    }
}

/// Copies a `rows x cols` block from `src` to `dst` row by row: a masked load followed by a masked
/// store, without holding the block in a tile in between (what a communication kernel does when it
/// pushes rows to a peer).
///
/// # Safety
/// The [access contract](self#the-access-contract): no other program, rank or thread writes
/// what this reads or touches what this writes while it runs (order such accesses with signals
/// or barriers), and source and destination do not overlap.
///
/// # Panics
/// If either access leaves its pointer's memory.
///
/// # Examples
/// ```
/// use dist_tensor::device::tile;
/// use dist_tensor::shmem::{GlobalPtr, GlobalPtrMut};
/// let src = [1.0f32, 2.0, 3.0, 4.0]; // 2 x 2
/// let mut dst = [0.0f32; 6];         // 2 x 3
/// // SAFETY: nothing else accesses these arrays meanwhile.
/// unsafe { tile::copy_2d(GlobalPtrMut::from_slice(&mut dst), 3, GlobalPtr::from_slice(&src), 2, (2, 2)); }
/// assert_eq!(dst, [1.0, 2.0, 0.0, 3.0, 4.0, 0.0]);
/// ```
#[track_caller]
pub unsafe fn copy_2d<T: Copy, D: Writable<T>, S: Readable<T>>(
    dst: D,
    dst_row_stride: usize,
    src: S,
    src_row_stride: usize,
    valid: (usize, usize),
) {
    let (rows, cols) = valid;
    let (d, dlen) = dst.raw_write();
    let (s, slen) = src.raw_read();
    check_fits("copy_2d (destination)", dlen, dst_row_stride, rows, cols);
    check_fits("copy_2d (source)", slen, src_row_stride, rows, cols);
    if rows > 0 && dst_row_stride == cols && src_row_stride == cols {
        // SAFETY: both blocks are contiguous and inside their memory (checked); `copy` allows
        // overlap, and the caller's contract keeps other writers away.
        unsafe { std::ptr::copy(s, d, rows * cols) };
        return;
    }
    for i in 0..rows {
        // SAFETY: row i is inside both memories (checked above).
        unsafe { std::ptr::copy(s.add(i * src_row_stride), d.add(i * dst_row_stride), cols) };
    }
}

/// [`copy_2d`] with streaming stores (Triton's `eviction_policy="evict_first"`): for a
/// destination this program will not read again, such as a kernel's final output. Large blocks
/// go to memory without first being read into the cache (on x86-64; a plain copy elsewhere).
/// Ordered before any later notify or barrier.
///
/// # Safety
/// The [access contract](self#the-access-contract): no other program, rank or thread writes
/// what this reads or touches what this writes while it runs (order such accesses with signals
/// or barriers), and source and destination do not overlap.
///
/// # Panics
/// If either access leaves its pointer's memory.
///
/// # Examples
/// ```
/// use dist_tensor::device::tile;
/// use dist_tensor::shmem::{GlobalPtr, GlobalPtrMut};
/// let src = vec![1.0f32; 1 << 16];
/// let mut dst = vec![0.0f32; 1 << 16];
/// // SAFETY: nothing else accesses these arrays meanwhile.
/// unsafe { tile::copy_2d_streaming(GlobalPtrMut::from_slice(&mut dst), 256, GlobalPtr::from_slice(&src), 256, (256, 256)); }
/// assert_eq!(dst, src);
/// ```
#[track_caller]
pub unsafe fn copy_2d_streaming<T: Copy, D: Writable<T>, S: Readable<T>>(
    dst: D,
    dst_row_stride: usize,
    src: S,
    src_row_stride: usize,
    valid: (usize, usize),
) {
    let (rows, cols) = valid;
    if rows * cols * size_of::<T>() < stream::MIN_BYTES {
        // SAFETY: forwarded from this function's contract.
        return unsafe { copy_2d(dst, dst_row_stride, src, src_row_stride, valid) };
    }
    let (d, dlen) = dst.raw_write();
    let (s, slen) = src.raw_read();
    check_fits("copy_2d_streaming (destination)", dlen, dst_row_stride, rows, cols);
    check_fits("copy_2d_streaming (source)", slen, src_row_stride, rows, cols);
    if dst_row_stride == cols && src_row_stride == cols {
        // SAFETY: both blocks are contiguous and inside their memory (checked); they do not
        // overlap, by the caller's contract.
        unsafe { stream::copy_unfenced(s, d, rows * cols) };
    } else {
        for i in 0..rows {
            // SAFETY: row i is inside both memories (checked above).
            unsafe {
                stream::copy_unfenced(s.add(i * src_row_stride), d.add(i * dst_row_stride), cols)
            };
        }
    }
    stream::fence();
}

/// Outputs at least this large are written with streaming stores by the library's kernels: they
/// do not fit in the cache beside their inputs, so caching them only evicts data that is still
/// needed. Smaller outputs are likely read soon, from cache.
pub(crate) const STREAM_OUTPUT_BYTES: usize = 8 << 20;

/// One row of `cols` elements, streamed when `stream` is true whatever its length (a plain copy
/// otherwise), without the closing fence: for kernels that split each row of a large block
/// between several destinations, whose pieces are short while the whole is not. Call
/// [`stream_fence`] before anything that publishes the row.
///
/// # Safety
/// As [`copy_2d`].
#[track_caller]
pub(crate) unsafe fn copy_row_unfenced<T: Copy, D: Writable<T>, S: Readable<T>>(
    stream: bool,
    dst: D,
    src: S,
    cols: usize,
) {
    let (d, dlen) = dst.raw_write();
    let (s, slen) = src.raw_read();
    check_fits("copy_row_unfenced (destination)", dlen, cols, 1, cols);
    check_fits("copy_row_unfenced (source)", slen, cols, 1, cols);
    // SAFETY: both rows are inside their memory (checked); the caller's contract keeps other
    // accesses away and the two apart.
    unsafe {
        if stream {
            stream::copy_unfenced(s, d, cols);
        } else {
            std::ptr::copy_nonoverlapping(s, d, cols);
        }
    }
}

/// Orders the streaming stores of [`copy_row_unfenced`] before the stores that follow (a notify,
/// a barrier).
pub(crate) fn stream_fence() {
    stream::fence();
}

/// [`copy_2d_streaming`] when `stream` is true, [`copy_2d`] otherwise.
///
/// # Safety
/// As [`copy_2d`].
#[track_caller]
pub(crate) unsafe fn copy_2d_maybe_streaming<T: Copy, D: Writable<T>, S: Readable<T>>(
    stream: bool,
    dst: D,
    dst_row_stride: usize,
    src: S,
    src_row_stride: usize,
    valid: (usize, usize),
) {
    // SAFETY: forwarded from this function's contract.
    unsafe {
        if stream {
            copy_2d_streaming(dst, dst_row_stride, src, src_row_stride, valid)
        } else {
            copy_2d(dst, dst_row_stride, src, src_row_stride, valid)
        }
    }
}

/// Atomically adds the first `valid` rows and columns of `tile` into local memory
/// (`tl.atomic_add`). The target is local, the source typically remote, as the seed advises.
///
/// # Safety
/// The [access contract](self#the-access-contract): no other program, rank or thread writes
/// what this reads or touches what this writes while it runs (order such accesses with signals
/// or barriers), and source and destination do not overlap.
///
/// # Panics
/// If the mask is larger than the tile or the access leaves the pointer's memory.
///
/// # Examples
/// ```
/// use dist_tensor::device::tile::{self, Tile};
/// use dist_tensor::shmem::GlobalPtrMut;
/// let mut acc = [1.0f32; 4];
/// let t = Tile::new(2, 2, 0.5f32);
/// // SAFETY: nothing else accesses these arrays meanwhile.
/// unsafe { tile::atomic_add_2d(GlobalPtrMut::from_slice(&mut acc), 2, &t, (1, 2)); }
/// assert_eq!(acc, [1.5, 1.5, 1.0, 1.0]);
/// ```
#[track_caller]
pub unsafe fn atomic_add_2d<T: Element>(
    dst: GlobalPtrMut<'_, T>,
    row_stride: usize,
    tile: &Tile<T>,
    valid: (usize, usize),
) {
    let (rows, cols) = valid;
    check_mask("atomic_add_2d", valid, (tile.rows, tile.cols));
    let (ptr, len) = dst.raw_write();
    check_fits("atomic_add_2d", len, row_stride, rows, cols);
    for i in 0..rows {
        for (j, &v) in tile.row(i)[..cols].iter().enumerate() {
            // SAFETY: inside the destination (checked); elements are naturally aligned; other
            // programs touch these elements only through atomic_add.
            unsafe { T::atomic_add(ptr.add(i * row_stride + j), v) };
        }
    }
}

/// `acc[:m, :n] += a (m x k) * b (k x n)` with `(m, k, n) = valid`, accumulating in `T::Acc`
/// (`acc += tl.dot(a, b)`).
///
/// The operands are read in place from wherever they are (a local tensor, consumed symmetric
/// memory) through their row strides: interior and boundary tiles alike, since the mask only
/// shrinks the product and masked-off rows and columns are never touched. Elements of `acc`
/// outside the mask are left as they were; the store that follows masks them off.
///
/// # Safety
/// The [access contract](self#the-access-contract): no other program, rank or thread writes
/// what this reads or touches what this writes while it runs (order such accesses with signals
/// or barriers), and source and destination do not overlap.
///
/// # Panics
/// If the mask is larger than `acc` or an operand access leaves its pointer's memory.
///
/// # Examples
/// ```
/// use dist_tensor::device::tile::{self, Tile};
/// use dist_tensor::shmem::GlobalPtr;
/// let a = [1.0f32, 2.0, 3.0, 4.0]; // 2 x 2
/// let b = [1.0f32, 0.0, 0.0, 1.0]; // identity
/// let mut acc = Tile::new(2, 2, 0.0f32);
/// // SAFETY: nothing else accesses these arrays meanwhile.
/// unsafe { tile::dot(GlobalPtr::from_slice(&a), 2, GlobalPtr::from_slice(&b), 2, (2, 2, 2), &mut acc); }
/// assert_eq!(acc.as_slice(), &a);
/// ```
#[track_caller]
pub unsafe fn dot<T: Element, A: Readable<T>, B: Readable<T>>(
    a: A,
    a_row_stride: usize,
    b: B,
    b_row_stride: usize,
    valid: (usize, usize, usize),
    acc: &mut Tile<T::Acc>,
) {
    let (m, k, n) = valid;
    assert!(m <= acc.rows && n <= acc.cols, "dot: mask {valid:?} larger than the accumulator");
    let (pa, la) = a.raw_read();
    let (pb, lb) = b.raw_read();
    check_fits("dot (left operand)", la, a_row_stride, m, k);
    check_fits("dot (right operand)", lb, b_row_stride, k, n);
    if m == 0 || n == 0 || k == 0 {
        return;
    }
    let acc_raw = (acc.data.as_mut_ptr(), acc.cols as isize, 1);
    // SAFETY: the operand blocks are inside their memory (checked); `acc` is this program's own
    // tile, disjoint from both.
    unsafe {
        T::gemm_acc(
            m,
            n,
            k,
            acc_raw,
            true,
            (pa, a_row_stride as isize, 1),
            (pb, b_row_stride as isize, 1),
            1,
        )
    };
}

/// `dst[:m, :n] = a (m x k) * b (k x n)`, or `+=` when `accumulate`, with `(m, k, n) = valid`:
/// [`dot`] with the accumulator in memory instead of a tile.
///
/// On the host the accumulator of a large tile does not fit in registers anyway; writing the
/// product where it is finally wanted (an f32 output, a symmetric buffer of partial sums) saves
/// the copy out of an accumulator tile, and lets a tile be as large as the GEMM kernel likes.
///
/// # Safety
/// The [access contract](self#the-access-contract): no other program, rank or thread writes
/// what this reads or touches what this writes while it runs (order such accesses with signals
/// or barriers), and source and destination do not overlap.
///
/// # Panics
/// If an access leaves its pointer's memory.
///
/// # Examples
/// ```
/// use dist_tensor::device::tile;
/// use dist_tensor::shmem::{GlobalPtr, GlobalPtrMut};
/// let a = [1.0f32, 2.0]; // 1 x 2
/// let b = [3.0f32, 4.0]; // 2 x 1
/// let mut c = [10.0f32];
/// // SAFETY: nothing else accesses these arrays meanwhile.
/// unsafe { tile::dot_store(GlobalPtrMut::from_slice(&mut c), 1, GlobalPtr::from_slice(&a), 2, GlobalPtr::from_slice(&b), 1, (1, 2, 1), true); }
/// assert_eq!(c, [21.0]);
/// ```
#[track_caller]
#[allow(clippy::too_many_arguments)]
pub unsafe fn dot_store<T: Element, D: Writable<T::Acc>, A: Readable<T>, B: Readable<T>>(
    dst: D,
    dst_row_stride: usize,
    a: A,
    a_row_stride: usize,
    b: B,
    b_row_stride: usize,
    valid: (usize, usize, usize),
    accumulate: bool,
) {
    let (m, k, n) = valid;
    check_fits("dot_store (left operand)", a.raw_read().1, a_row_stride, m, k);
    check_fits("dot_store (right operand)", b.raw_read().1, b_row_stride, k, n);
    let (a_strides, b_strides) = ([a_row_stride, 1], [b_row_stride, 1]);
    // SAFETY: forwarded from this function's contract.
    unsafe { dot_store_strided(dst, dst_row_stride, a, a_strides, b, b_strides, valid, accumulate) }
}

/// [`dot_store`] with operands of any (non-negative) strides, `[row stride, column stride]` in
/// elements: a transposed operand is read in place, with strides `[1, ld]`
/// (`tl.dot(a, tl.trans(b))`). Operand elements may be read more than once (a stride of 0
/// broadcasts); the destination is row-major with `dst_row_stride`.
///
/// # Safety
/// The [access contract](self#the-access-contract): no other program, rank or thread writes
/// what this reads or touches what this writes while it runs (order such accesses with signals
/// or barriers), and source and destination do not overlap.
///
/// # Panics
/// If an access leaves its pointer's memory.
///
/// # Examples
/// ```
/// use dist_tensor::device::tile;
/// use dist_tensor::shmem::{GlobalPtr, GlobalPtrMut};
/// let a = [1.0f32, 2.0, 3.0, 4.0]; // 2 x 2
/// let w = [1.0f32, 10.0, 100.0, 1000.0]; // 2 x 2, read transposed: b = [[1, 100], [10, 1000]]
/// let mut c = [0.0f32; 4];
/// // SAFETY: nothing else accesses these arrays meanwhile.
/// unsafe {
///     tile::dot_store_strided(GlobalPtrMut::from_slice(&mut c), 2, GlobalPtr::from_slice(&a), [2, 1],
///                             GlobalPtr::from_slice(&w), [1, 2], (2, 2, 2), false);
/// }
/// assert_eq!(c, [21.0, 2100.0, 43.0, 4300.0]);
/// ```
#[track_caller]
#[allow(clippy::too_many_arguments)]
pub unsafe fn dot_store_strided<T: Element, D: Writable<T::Acc>, A: Readable<T>, B: Readable<T>>(
    dst: D,
    dst_row_stride: usize,
    a: A,
    a_strides: [usize; 2],
    b: B,
    b_strides: [usize; 2],
    valid: (usize, usize, usize),
    accumulate: bool,
) {
    let (m, k, n) = valid;
    let (pd, ld) = dst.raw_write();
    let (pa, la) = a.raw_read();
    let (pb, lb) = b.raw_read();
    check_fits("dot_store (destination)", ld, dst_row_stride, m, n);
    check_reads("dot_store (left operand)", la, a_strides, m, k);
    check_reads("dot_store (right operand)", lb, b_strides, k, n);
    if m == 0 || n == 0 {
        return;
    }
    let dst_raw = (pd, dst_row_stride as isize, 1);
    let [ars, acs] = a_strides.map(|s| s as isize);
    let [brs, bcs] = b_strides.map(|s| s as isize);
    // SAFETY: all three blocks are inside their memory (checked); the caller's access contract
    // makes the destination this program's alone while it writes.
    unsafe { T::gemm_acc(m, n, k, dst_raw, accumulate, (pa, ars, acs), (pb, brs, bcs), 1) };
}

/// Panics unless a strided `rows x cols` read fits in `len` elements.
#[track_caller]
fn check_reads(
    op: &str,
    len: usize,
    [row_stride, col_stride]: [usize; 2],
    rows: usize,
    cols: usize,
) {
    if rows == 0 || cols == 0 {
        return;
    }
    let last = (rows - 1)
        .checked_mul(row_stride)
        .zip((cols - 1).checked_mul(col_stride))
        .and_then(|(r, c)| r.checked_add(c)?.checked_add(1));
    let Some(last) = last else {
        panic!("{op}: read of {rows}x{cols} with strides [{row_stride}, {col_stride}] overflows")
    };
    assert!(
        last <= len,
        "{op}: read of {rows}x{cols} (strides [{row_stride}, {col_stride}]) needs {last} elements, {len} available"
    );
}

/// Copies with non-temporal ("streaming") stores on x86-64: a block that the copying program will
/// not read again goes to memory without first being read into the cache (a plain store first
/// reads the line it writes, so a large copy moves its output's bytes twice).
mod stream {
    /// Blocks from this size on are streamed: smaller ones are likely read again soon, from cache.
    pub(super) const MIN_BYTES: usize = 64 * 1024;

    /// Streams `count` elements without the closing fence: call [`fence`] before anything that
    /// publishes them (streaming stores are not ordered by a release store). With AVX-512 each
    /// store is a whole 64-byte line: a quarter of the instructions of 16-byte stores, and
    /// whole lines for the write-combining buffers to send on.
    ///
    /// # Safety
    /// As `std::ptr::copy_nonoverlapping`.
    pub(super) unsafe fn copy_unfenced<T: Copy>(src: *const T, dst: *mut T, count: usize) {
        let bytes = count * size_of::<T>();
        #[cfg(target_arch = "x86_64")]
        {
            let (s, d) = (src as *const u8, dst as *mut u8);
            if std::arch::is_x86_feature_detected!("avx512f") {
                // SAFETY: AVX-512F is present; the rest is forwarded.
                unsafe { x86::copy_lines(s, d, bytes) };
            } else {
                // SAFETY: forwarded (SSE2 is part of x86-64).
                unsafe { x86::copy_sse2(s, d, bytes) };
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        // SAFETY: forwarded.
        unsafe {
            std::ptr::copy_nonoverlapping(src, dst, count)
        }
    }

    #[cfg(target_arch = "x86_64")]
    mod x86 {
        use std::arch::x86_64::*;

        /// Copies `bytes` from `s` to `d` with 16-byte streaming stores.
        ///
        /// # Safety
        /// As `std::ptr::copy_nonoverlapping` on bytes.
        pub(super) unsafe fn copy_sse2(s: *const u8, d: *mut u8, bytes: usize) {
            let head = ((d as usize).wrapping_neg() % 16).min(bytes);
            let body = (bytes - head) / 16;
            // SAFETY: every access below is inside the two blocks of `bytes` bytes, which do not
            // overlap; `d + head` is 16-byte aligned, as streaming stores require.
            unsafe {
                std::ptr::copy_nonoverlapping(s, d, head);
                for i in 0..body {
                    let at = head + i * 16;
                    let v = _mm_loadu_si128(s.add(at) as *const __m128i);
                    _mm_stream_si128(d.add(at) as *mut __m128i, v);
                }
                let done = head + body * 16;
                std::ptr::copy_nonoverlapping(s.add(done), d.add(done), bytes - done);
            }
        }

        /// Copies `bytes` from `s` to `d` with 64-byte streaming stores (whole cache lines).
        ///
        /// # Safety
        /// AVX-512F present; as `std::ptr::copy_nonoverlapping` on bytes.
        #[target_feature(enable = "avx512f")]
        pub(super) unsafe fn copy_lines(s: *const u8, d: *mut u8, bytes: usize) {
            let head = ((d as usize).wrapping_neg() % 64).min(bytes);
            let body = (bytes - head) / 64;
            // SAFETY: every access below is inside the two blocks of `bytes` bytes, which do not
            // overlap; `d + head` is 64-byte aligned, as streaming stores require.
            unsafe {
                std::ptr::copy_nonoverlapping(s, d, head);
                // Four lines at a time, loads before stores: the loads of a group are in flight
                // together. On a loaded Zen 4 (a probe, 64 MiB copies by 2 threads, 16
                // interleaved medians) this was faster than one line at a time in 12 of 16, by
                // about 5% at the median: a small gain, within the machine's noise in each.
                let quads = body / 4;
                for i in 0..quads {
                    let at = head + i * 256;
                    let v0 = _mm512_loadu_si512(s.add(at) as *const __m512i);
                    let v1 = _mm512_loadu_si512(s.add(at + 64) as *const __m512i);
                    let v2 = _mm512_loadu_si512(s.add(at + 128) as *const __m512i);
                    let v3 = _mm512_loadu_si512(s.add(at + 192) as *const __m512i);
                    _mm512_stream_si512(d.add(at) as *mut __m512i, v0);
                    _mm512_stream_si512(d.add(at + 64) as *mut __m512i, v1);
                    _mm512_stream_si512(d.add(at + 128) as *mut __m512i, v2);
                    _mm512_stream_si512(d.add(at + 192) as *mut __m512i, v3);
                }
                for i in quads * 4..body {
                    let at = head + i * 64;
                    let v = _mm512_loadu_si512(s.add(at) as *const __m512i);
                    _mm512_stream_si512(d.add(at) as *mut __m512i, v);
                }
                let done = head + body * 64;
                std::ptr::copy_nonoverlapping(s.add(done), d.add(done), bytes - done);
            }
        }
    }

    /// Orders every streaming store before the stores that follow (a notify, a barrier).
    pub(super) fn fence() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `sfence` has no preconditions; SSE is part of x86-64.
        unsafe {
            std::arch::x86_64::_mm_sfence()
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shmem::{GlobalPtr, GlobalPtrMut};

    /// The streaming row copy (no size threshold) against the source: every length around the
    /// 64-byte lines and the four-line groups of the streaming loop, at every misalignment of
    /// either side, with the neighbours of the row left alone. (Fails when the loop drops or
    /// repeats a line, or writes past the row.)
    #[test]
    fn streamed_rows_equal_their_source_at_every_length_and_offset() {
        let src: Vec<f32> = (0..5000).map(|i| i as f32 * 0.5 + 1.0).collect();
        for len in [0, 1, 15, 16, 17, 63, 64, 65, 127, 128, 129, 255, 256, 257, 1000, 4099] {
            for (s_off, d_off) in [(0, 0), (1, 0), (0, 1), (3, 7), (15, 16), (16, 5)] {
                for stream in [true, false] {
                    let mut dst = vec![-1.0f32; len + 40];
                    // SAFETY: both rows lie inside their vectors, which nothing else touches.
                    unsafe {
                        copy_row_unfenced(
                            stream,
                            GlobalPtrMut::from_slice(&mut dst[d_off..]),
                            GlobalPtr::from_slice(&src[s_off..]),
                            len,
                        );
                    }
                    stream_fence();
                    let what = format!("len {len}, offsets {s_off}/{d_off}, stream {stream}");
                    assert_eq!(&dst[d_off..d_off + len], &src[s_off..s_off + len], "{what}");
                    assert!(dst[..d_off].iter().all(|&v| v == -1.0), "{what}: before the row");
                    assert!(dst[d_off + len..].iter().all(|&v| v == -1.0), "{what}: after it");
                }
            }
        }
    }
}
