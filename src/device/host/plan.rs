//! What the fused kernels share: how rows are sharded, how a product is cut into tiles, and which
//! vector sub-cores communicate and which compute.

use std::any::TypeId;
use std::ops::Deref;

use ndarray::{Array2, ArrayView2};

use crate::shmem::{GlobalPtr, GlobalPtrMut};
use crate::tensor::{Element, FEW_ROWS, pool, split_offsets, transpose_into};
use crate::{Error, Result};

/// An operand in its accumulator type: borrowed as it is when the element type is its own
/// accumulator (f32, f64), widened once otherwise (f16, bf16 to f32), so that the tiles of a
/// product never widen the same operand twice.
pub(crate) enum AccData<'a, A: Element> {
    Borrowed(&'a [A]),
    Widened(Vec<A>),
}

impl<'a, A: Element> AccData<'a, A> {
    pub(crate) fn new<T: Element<Acc = A>>(op: &'static str, data: &'a [T]) -> Result<Self> {
        if TypeId::of::<T>() == TypeId::of::<A>() {
            // SAFETY: `T` and `A` are the same type, so the slice is reinterpreted as itself.
            Ok(AccData::Borrowed(unsafe {
                std::slice::from_raw_parts(data.as_ptr().cast(), data.len())
            }))
        } else {
            let mut widened = pool::take::<A>(op, data.len())?;
            for (w, &x) in widened.iter_mut().zip(data) {
                *w = x.to_acc();
            }
            Ok(AccData::Widened(widened))
        }
    }
}

impl<A: Element> Deref for AccData<'_, A> {
    type Target = [A];

    fn deref(&self) -> &[A] {
        match self {
            AccData::Borrowed(data) => data,
            AccData::Widened(data) => data,
        }
    }
}

impl<A: Element> Drop for AccData<'_, A> {
    fn drop(&mut self) {
        if let AccData::Widened(data) = self {
            pool::give(std::mem::take(data));
        }
    }
}

/// A weight as the tiles of a product read it: its elements in the accumulator type, in memory
/// order, and the strides `[row, column]` that address them. A row-major weight (`[n, 1]`) is read
/// in place, and so is a transposed one (a column-major view, `[1, k]`: the backward pass's
/// `w.t()`) in a product of at most [`BLOCK_ROWS`] rows; any other layout is copied once into
/// row-major order.
pub(crate) struct WeightData<'a, A: Element> {
    data: AccData<'a, A>,
    pub(crate) strides: [usize; 2],
}

impl<'a, A: Element> WeightData<'a, A> {
    /// The weight of a product of `rows` rows. A transposed weight is copied into row-major order
    /// when the product has more rows than one tile: the `gemm` crate packs each tile's block of
    /// it once per block of rows, and packs a column-major block much slower than a row-major one,
    /// while the copy is one pass over the weight.
    pub(crate) fn new<T: Element<Acc = A>>(
        op: &'static str,
        w: ArrayView2<'a, T>,
        rows: usize,
    ) -> Result<Self> {
        match in_memory_order(w) {
            Some((data, strides)) if strides[1] == 1 || w.ncols() == 1 || rows <= BLOCK_ROWS => {
                Ok(WeightData { data: AccData::new(op, data)?, strides })
            }
            Some((data, [1, ld])) => Ok(WeightData {
                data: AccData::Widened(transposed(op, data, ld, w.dim(), T::to_acc)?),
                strides: [w.ncols(), 1],
            }),
            _ => {
                let mut copy = pool::take::<A>(op, w.len())?;
                for (c, &x) in copy.iter_mut().zip(w.iter()) {
                    *c = x.to_acc();
                }
                Ok(WeightData { data: AccData::Widened(copy), strides: [w.ncols(), 1] })
            }
        }
    }

    /// The tiles' pointer to the weight's first element.
    pub(crate) fn ptr(&self) -> GlobalPtr<'_, A> {
        GlobalPtr::from_slice(&self.data)
    }
}

/// A matrix's elements in memory order with its (non-negative) strides `[row, column]`, where it
/// is one contiguous block: a row-major or a transposed (column-major) view, read in place.
pub(crate) fn in_memory_order<'a, T>(w: ArrayView2<'a, T>) -> Option<(&'a [T], [usize; 2])> {
    let strides = w.strides();
    match (usize::try_from(strides[0]), usize::try_from(strides[1])) {
        (Ok(rs), Ok(cs)) => w.to_slice_memory_order().map(|data| (data, [rs, cs])),
        _ => None,
    }
}

/// The `rows x cols` matrix stored column-major in `data` (column `j` at `j * ld`), in row-major
/// order and the accumulator type (see [`transpose_into`]).
fn transposed<T: Element, U: Element>(
    op: &'static str,
    data: &[T],
    ld: usize,
    dims: (usize, usize),
    convert: impl Fn(T) -> U,
) -> Result<Vec<U>> {
    let mut out = pool::take::<U>(op, dims.0 * dims.1)?;
    transpose_into(&mut out, data, ld, dims, convert);
    Ok(out)
}

/// An output array whose values are unspecified, from the buffer cache: every element is written
/// by the kernel that fills it.
pub(crate) fn scratch<T: Element>(
    op: &'static str,
    (rows, cols): (usize, usize),
) -> Result<Array2<T>> {
    let len = rows.checked_mul(cols).ok_or_else(|| Error::OutOfMemory {
        op,
        bytes: usize::MAX,
        what: format!("a {rows} x {cols} output: the size overflows"),
    })?;
    Ok(Array2::from_shape_vec((rows, cols), pool::take(op, len)?).expect("rows x cols"))
}

/// Most rows per tile of a product, and most columns: tiles large enough that the `gemm` crate's
/// packing of each weight block is amortized over many rows, small enough that a program's tiles
/// are spread over every computing lane and that each call's blocks stay in cache.
pub(crate) const BLOCK_ROWS: usize = 512;
/// See [`BLOCK_ROWS`].
pub(crate) const BLOCK_COLS: usize = 512;
/// Below this many rows per shard, a product is cut into tiles over all its rows rather than
/// shard by shard: tiles of a few rows would pack the weight once per shard for little work.
pub(crate) const MIN_SHARD_ROWS: usize = BLOCK_ROWS / 2;

/// How many rows of `row_len` elements make a chunk of about `target` elements (at least one).
pub(crate) fn row_chunks(row_len: usize, target: usize) -> usize {
    (target / row_len.max(1)).max(1)
}

/// Which sub-cores of a mix launch communicate and which compute, as
/// `(communication lanes, first computing sub-core)`: sub-core 0 communicates and the others
/// compute; with a single sub-core per AI core, it does both, communication first.
pub(crate) fn compute_lanes(sub_vec_num: usize) -> (usize, usize) {
    if sub_vec_num > 1 { (1, 1) } else { (1, 0) }
}

/// How many programs of a mix launch of `grid` programs compute.
pub(crate) fn computing_programs(grid: usize, sub_vec_num: usize) -> usize {
    grid * (sub_vec_num - compute_lanes(sub_vec_num).1)
}

/// Where a product's tiles go: straight into the output when the element type is its own
/// accumulator (f32, f64), through an accumulator tile and one rounding otherwise.
pub(crate) enum Output<'a, T: Element> {
    Direct(GlobalPtrMut<'a, T::Acc>),
    Rounded(GlobalPtrMut<'a, T>),
}

impl<T: Element> Clone for Output<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T: Element> Copy for Output<'_, T> {}

impl<'a, T: Element> Output<'a, T> {
    pub(crate) fn new(data: &'a mut [T]) -> Self {
        if TypeId::of::<T>() == TypeId::of::<T::Acc>() {
            // SAFETY: `T` and `T::Acc` are the same type, so the slice is reinterpreted as itself.
            let same =
                unsafe { std::slice::from_raw_parts_mut(data.as_mut_ptr().cast(), data.len()) };
            Output::Direct(GlobalPtrMut::from_slice(same))
        } else {
            Output::Rounded(GlobalPtrMut::from_slice(data))
        }
    }
}

/// Rows per rank, and where each rank's rows start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Shards {
    counts: Vec<usize>,
    offsets: Vec<usize>,
}

impl Shards {
    pub(crate) fn new(counts: Vec<usize>) -> Self {
        let offsets = split_offsets(&counts);
        Shards { counts, offsets }
    }

    pub(crate) fn counts(&self) -> &[usize] {
        &self.counts
    }

    pub(crate) fn count(&self, rank: usize) -> usize {
        self.counts[rank]
    }

    pub(crate) fn offset(&self, rank: usize) -> usize {
        self.offsets[rank]
    }

    pub(crate) fn total(&self) -> usize {
        *self.offsets.last().expect("at least one rank")
    }

    /// The ranks whose (non-empty) rows intersect `start..start + len`.
    pub(crate) fn covering(&self, start: usize, len: usize) -> impl Iterator<Item = usize> + '_ {
        (0..self.counts.len()).filter(move |&r| {
            self.counts[r] > 0 && self.offsets[r] < start + len && start < self.offsets[r + 1]
        })
    }
}

/// One output tile of a product: rows `row..row + rows` of segment `segment`, columns
/// `col..col + cols` of weight `weight`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct GemmTask {
    pub(crate) segment: usize,
    pub(crate) row: usize,
    pub(crate) rows: usize,
    pub(crate) weight: usize,
    pub(crate) col: usize,
    pub(crate) cols: usize,
}

/// The output tiles of products over row segments (in the order given) and several weights of
/// their own widths, flattened: segment, then row block, then weight, then column block.
#[derive(Debug, Clone)]
pub(crate) struct GemmTiles {
    segments: Vec<(usize, usize)>,
    widths: Vec<usize>,
    /// Tiles before each segment, and in all.
    starts: Vec<usize>,
    /// Tiles of one row block, before each weight, and in all.
    per_row_block: Vec<usize>,
    pub(crate) block_rows: usize,
    pub(crate) block_cols: usize,
}

impl GemmTiles {
    /// Tiles for row `segments` (start, rows) and weights of `widths` columns, cut so that each of
    /// `lanes` computing programs gets a tile of every segment.
    pub(crate) fn new(segments: &[(usize, usize)], widths: &[usize], lanes: usize) -> Self {
        let longest = segments.iter().map(|s| s.1).max().unwrap_or(0);
        let widest = widths.iter().copied().max().unwrap_or(0);
        let lanes = lanes.max(1);
        let (block_rows, block_cols) = if longest <= FEW_ROWS {
            // Few rows (decode): every tile takes all of them and the lanes split the columns, so
            // the weight is read once in all (row tiles would each read all of it).
            (longest.max(1), widest.div_ceil(lanes).next_multiple_of(32).max(1))
        } else {
            let block_rows = longest.div_ceil(lanes).clamp(1, BLOCK_ROWS);
            // Short tiles get wider, keeping about the same area: fewer calls, each weight row
            // read in longer runs.
            (block_rows, widest.clamp(1, BLOCK_COLS * (BLOCK_ROWS / block_rows).max(1)))
        };
        let per_row_block =
            split_offsets(&widths.iter().map(|&w| w.div_ceil(block_cols)).collect::<Vec<_>>());
        let row_block_tiles = *per_row_block.last().expect("offsets end with the total");
        let starts = split_offsets(
            &segments
                .iter()
                .map(|s| s.1.div_ceil(block_rows) * row_block_tiles)
                .collect::<Vec<_>>(),
        );
        GemmTiles {
            segments: segments.to_vec(),
            widths: widths.to_vec(),
            starts,
            per_row_block,
            block_rows,
            block_cols,
        }
    }

    pub(crate) fn count(&self) -> usize {
        *self.starts.last().expect("offsets end with the total")
    }

    pub(crate) fn get(&self, task: usize) -> GemmTask {
        let segment = self.starts.partition_point(|&s| s <= task) - 1;
        let within = task - self.starts[segment];
        let row_block_tiles = *self.per_row_block.last().expect("total");
        let (row_block, in_block) = (within / row_block_tiles, within % row_block_tiles);
        let weight = self.per_row_block.partition_point(|&s| s <= in_block) - 1;
        let col = (in_block - self.per_row_block[weight]) * self.block_cols;
        let (start, len) = self.segments[segment];
        let row = row_block * self.block_rows;
        GemmTask {
            segment,
            row: start + row,
            rows: len.saturating_sub(row).min(self.block_rows),
            weight,
            col,
            cols: self.widths[weight].saturating_sub(col).min(self.block_cols),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiles_cover_every_output_element_once() {
        let segments = [(300, 5), (0, 300), (305, 0), (305, 600)];
        let widths = [7, 2500, 1];
        let tiles = GemmTiles::new(&segments, &widths, 1);
        let total_rows = 905;
        let mut hits: Vec<Vec<u8>> = widths.iter().map(|&w| vec![0; total_rows * w]).collect();
        for t in 0..tiles.count() {
            let task = tiles.get(t);
            assert!(task.rows > 0 && task.cols > 0, "{task:?}");
            for r in task.row..task.row + task.rows {
                for c in task.col..task.col + task.cols {
                    hits[task.weight][r * widths[task.weight] + c] += 1;
                }
            }
        }
        assert!(hits.iter().flatten().all(|&h| h == 1));
        // Segments come in the order given.
        assert_eq!(tiles.get(0).row, 300);
    }

    #[test]
    fn few_rows_split_columns_not_rows() {
        let tiles = GemmTiles::new(&[(0, 16)], &[4096], 4);
        assert_eq!(tiles.count(), 4);
        for t in 0..4 {
            let task = tiles.get(t);
            assert_eq!((task.row, task.rows, task.cols), (0, 16, 1024), "{task:?}");
        }
    }

    #[test]
    fn covering_skips_empty_shards() {
        let shards = Shards::new(vec![2, 0, 3, 1]);
        assert_eq!(shards.covering(0, 6).collect::<Vec<_>>(), vec![0, 2, 3]);
        assert_eq!(shards.covering(2, 1).collect::<Vec<_>>(), vec![2]);
        assert_eq!(shards.total(), 6);
    }
}
