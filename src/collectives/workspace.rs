//! What every collective keeps between calls: a metadata exchange, a staging buffer, signals.
//!
//! A call goes in three steps, none of them a barrier:
//! 1. **Exchange** (the rank's one exchange, `shmem::exchange`): every rank learns what call every
//!    rank is in (op, element type, call number) and its arguments (lengths, counts), so they all
//!    validate them the same way and fail together, never leaving a peer waiting. The five
//!    collectives of one element type share this workspace; the exchange is what keeps a rank in
//!    one of them from meeting a rank in another (or in the same op on another type).
//! 2. **Publish**: a rank copies its input into its own staging buffer, and each program then adds
//!    one to a `ready` signal of every peer. Readers wait for `published x grid`: the count only
//!    grows, so no signal is ever reset.
//! 3. **Pull**: every rank reads what it needs from its peers' staging buffers (remote loads
//!    through `symm_at`, after the wait's token is consumed). A rank overwrites its staging only in
//!    its next call, after that call's exchange: by then every peer has finished this call.
//!
//! Across nodes (a world joined by MPI) there is no pointer to pull through. A rank instead
//! *pushes* to each rank of another node the part of its input that rank reads (a [`Region`]),
//! straight from its input with one put into that rank's *mirror* buffer, at the slot the call
//! gives it; the put's signal adds `grid` to the same `ready` count local publishers add one to
//! per program. A reader takes a remote source's part from its own mirror; every read goes
//! through a [`Source`] (a pointer and a row stride), so the collectives read both the same way.
//! The mirror is reused on the same terms as the staging buffer.

use crate::device::tile::valid_len;
use crate::device::{Program, tile};
use crate::shmem::{
    Call, Exchanged, GlobalPtr, NotifySem, Rank, Scope, SignalBuf, SignalOp, SymmBuf, WaitCmp,
    WaitSem, Workspace, consume_token, symm_at,
};
use crate::{Element, Error, Result};

/// Elements a program moves per task: large enough to amortize the task, small enough to stay in
/// the core's L2 cache.
pub(crate) const CHUNK_ELEMS: usize = 16 * 1024;

/// The buffers and signals of one element type's collectives on one rank.
pub(crate) struct CollectiveWorkspace<T: Element> {
    staging: Option<SymmBuf<T>>,
    /// Where ranks of other nodes put what this rank reads of their inputs.
    mirror: Option<SymmBuf<T>>,
    pub(crate) ready: SignalBuf,
    published: Vec<u64>,
}

impl<T: Element> Workspace for CollectiveWorkspace<T> {
    fn symmetric_bytes(&self) -> usize {
        let len = |b: &Option<SymmBuf<T>>| b.as_ref().map_or(0, |s| s.len() * size_of::<T>());
        self.ready.len() * 64 + len(&self.staging) + len(&self.mirror)
    }
}

/// The part of a source's input one reader reads: `rows` rows of `cols` elements from element
/// `start`, `stride` apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Region {
    pub(crate) start: usize,
    pub(crate) stride: usize,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
}

impl Region {
    /// One row of `len` elements from `start`.
    pub(crate) fn row(start: usize, len: usize) -> Region {
        Region { start, stride: len, rows: 1, cols: len }
    }
}

/// Where a reader finds a source's region: row `r`, column `c` of it is at `ptr + r * stride +
/// c`.
#[derive(Clone, Copy)]
pub(crate) struct Source<'a, T> {
    ptr: GlobalPtr<'a, T>,
    pub(crate) stride: usize,
}

impl<'a, T> Source<'a, T> {
    pub(crate) fn at(&self, row: usize, col: usize) -> GlobalPtr<'a, T> {
        self.ptr + (row * self.stride + col)
    }
}

/// A push to a rank of another node: what of this rank's input it reads, and its slot in that
/// rank's mirror.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RemoteTarget {
    pub(crate) rank: usize,
    pub(crate) region: Region,
    pub(crate) slot: usize,
}

impl<T: Element> CollectiveWorkspace<T> {
    fn new(rank: &Rank<'_>) -> Result<Self> {
        let n = rank.num_ranks();
        Ok(CollectiveWorkspace {
            staging: None,
            mirror: None,
            ready: rank.alloc_signals_for("collectives ready", n)?,
            published: vec![0; n],
        })
    }

    /// Makes the mirror hold at least `len` elements, in a world of several nodes (every rank
    /// passes the same `len`; collective).
    pub(crate) fn reserve_mirror(&mut self, rank: &Rank<'_>, len: usize) -> Result<()> {
        if rank.num_nodes() > 1 {
            rank.reserve_for("collectives mirror", &mut self.mirror, len)?;
        }
        Ok(())
    }

    /// The targets of this rank's pushes: every rank of another node for which `wanted` gives
    /// (region, slot), in rotated order.
    pub(crate) fn remote_targets(
        &self,
        rank: &Rank<'_>,
        wanted: impl Fn(usize) -> Option<(Region, usize)>,
    ) -> Vec<RemoteTarget> {
        let (me, n) = (rank.rank(), rank.num_ranks());
        (1..n)
            .map(|i| (me + i) % n)
            .filter(|&r| !rank.is_local(r))
            .filter_map(|r| wanted(r).map(|(region, slot)| RemoteTarget { rank: r, region, slot }))
            .collect()
    }

    /// The push step, run by every program of a launch: this program's share of `targets`, each
    /// one put straight from `input`, whose signal adds the program count to the target's
    /// `ready` count for this rank (as local publishers add one each). The rank calls
    /// [`Rank::quiet`] after the launch, before `input` may change.
    pub(crate) fn push_remote(
        &self,
        p: &Program<'_>,
        input: GlobalPtr<'_, T>,
        targets: &[RemoteTarget],
    ) -> Result<()> {
        let me = p.rank();
        for i in p.tasks(targets.len()) {
            let t = &targets[i];
            let mirror = self.mirror.as_ref().expect("reserve_mirror() comes first").ptr();
            let signal = Some((&self.ready, me, SignalOp::Add(p.num_programs() as u64)));
            let r = t.region;
            let (rows, cols) = if r.cols == 0 { (0, 0) } else { (r.rows, r.cols) };
            // SAFETY: the region lies in `input`, which the rank keeps unchanged until its quiet
            // after the launch; the target reads its slot only after this put's signal, and the
            // slot is rewritten only after the next call's exchange.
            unsafe {
                p.put_rows(
                    mirror + t.slot,
                    cols,
                    t.rank,
                    input + r.start,
                    r.stride,
                    (rows, cols),
                    signal,
                )?
            };
        }
        Ok(())
    }

    /// Makes the staging buffer hold at least `len` elements. Collective: every rank passes the
    /// same `len` (computed from exchanged metadata).
    pub(crate) fn reserve(&mut self, rank: &Rank<'_>, len: usize) -> Result<()> {
        rank.reserve_for("collectives staging", &mut self.staging, len)
    }

    /// The publish step, run by every program of a launch: copies this program's chunks of
    /// `input` (rows of `row_len` elements) into this rank's staging buffer at the same place,
    /// then tells every peer, rotated, that this program's part is in place.
    pub(crate) fn publish_part(
        &self,
        p: &Program<'_>,
        input: GlobalPtr<'_, T>,
        chunks: &Chunks,
        row_len: usize,
    ) -> Result<()> {
        let (me, n) = (p.rank(), p.num_ranks());
        if !(0..n).any(|q| q != me && p.is_local(q)) {
            return Ok(()); // no reader on this node
        }
        let staging = self.staging().ptr();
        let stream = chunks.rows * chunks.cols * size_of::<T>() >= tile::STREAM_OUTPUT_BYTES;
        for t in p.tasks(chunks.count) {
            let c = chunks.get(t);
            let at = c.row * row_len + c.col;
            let valid = (c.rows, c.cols);
            // SAFETY: only this rank writes its staging buffer, each chunk by one program, and
            // peers read it only after every program's notify below; the input is the caller's.
            unsafe {
                tile::copy_2d_maybe_streaming(
                    stream,
                    staging + at,
                    row_len,
                    input + at,
                    row_len,
                    valid,
                )
            };
        }
        for i in 1..n {
            let peer = (me + i) % n;
            if p.is_local(peer) {
                p.notify(&self.ready, me, peer, SignalOp::Add(1), Scope::Peer, NotifySem::Release)?;
            }
        }
        Ok(())
    }

    /// Where to read `region` of rank `src`'s input: this rank's own `input`; or, once all of
    /// `src`'s programs have published (`ready_at`, from [`CollectiveWorkspace::publish`]), its
    /// staging buffer through `symm_at` for a rank of this node, the mirror at `slot` (where
    /// `src` put the region) for one of another.
    pub(crate) fn source<'a>(
        &'a self,
        p: &Program<'_>,
        src: usize,
        input: GlobalPtr<'a, T>,
        ready_at: &[u64],
        region: Region,
        slot: usize,
    ) -> Result<Source<'a, T>> {
        if src == p.rank() {
            return Ok(Source { ptr: input + region.start, stride: region.stride });
        }
        let token =
            p.wait_from(&self.ready, src, src, WaitCmp::Ge(ready_at[src]), WaitSem::Acquire)?;
        if p.is_local(src) {
            let staging = GlobalPtr::from(consume_token(symm_at(self.staging(), src), token));
            return Ok(Source { ptr: staging + region.start, stride: region.stride });
        }
        let mirror = self.mirror.as_ref().expect("reserve_mirror() comes first").ptr();
        Ok(Source {
            ptr: GlobalPtr::from(consume_token(mirror, token)) + slot,
            stride: region.cols,
        })
    }

    /// The staging buffer (after [`CollectiveWorkspace::reserve`]).
    pub(crate) fn staging(&self) -> &SymmBuf<T> {
        self.staging.as_ref().expect("reserve() comes first")
    }

    /// Records that `publishers` publish in this call; returns, per rank, the `ready` count that
    /// means its publication of this call is complete (`grid` programs each add one).
    pub(crate) fn publish(&mut self, publishers: impl Fn(usize) -> bool, grid: usize) -> Vec<u64> {
        for (p, count) in self.published.iter_mut().enumerate() {
            if publishers(p) {
                *count += 1;
            }
        }
        self.published.iter().map(|&c| c * grid as u64).collect()
    }
}

/// Runs `f` with this rank's collective workspace for `T`.
pub(crate) fn with_workspace<T: Element, R>(
    rank: &Rank<'_>,
    f: impl FnOnce(&mut CollectiveWorkspace<T>) -> Result<R>,
) -> Result<R> {
    rank.with_workspace(CollectiveWorkspace::<T>::new, f)
}

/// Exchanges `words` (and `personal` words, `k` per rank) with every rank for the call `op` on
/// `T`, with this rank's `problem` if its input is invalid.
pub(crate) fn exchange_checked<T: Element>(
    rank: &Rank<'_>,
    op: &'static str,
    words: &[u64],
    problem: Option<String>,
    personal: &[u64],
) -> Result<Exchanged> {
    rank.exchange(Call::of::<T>(op), words, problem, personal)
}

/// Where a collective writes its result: a vector it allocates, or the caller's slice.
pub(crate) enum Out<'a, T> {
    Alloc,
    Into(&'a mut [T]),
}

impl<T: Element> Out<'_, T> {
    /// The metadata word that tells peers the caller's output length (`u64::MAX`: allocate).
    pub(crate) fn len_word(&self) -> u64 {
        match self {
            Out::Alloc => u64::MAX,
            Out::Into(s) => s.len() as u64,
        }
    }

    /// Runs `fill` on an output of `len` elements; returns the vector if it allocated one.
    pub(crate) fn fill(
        self,
        op: &'static str,
        len: usize,
        fill: impl FnOnce(&mut [T]) -> Result<()>,
    ) -> Result<Option<Vec<T>>> {
        match self {
            Out::Alloc => {
                // Every element is written by the kernel: a cached buffer needs no zeroing.
                let mut out = crate::tensor::pool::take(op, len)?;
                fill(&mut out)?;
                Ok(Some(out))
            }
            Out::Into(out) => fill(out).map(|()| None),
        }
    }
}

/// Checks every rank's output length (metadata word `index`) against what its result will be.
pub(crate) fn check_outputs(
    op: &'static str,
    all: &Exchanged,
    index: usize,
    expected: impl Fn(usize) -> usize,
) -> Result<()> {
    for (r, words) in all.iter().enumerate() {
        if words[index] != u64::MAX && words[index] != expected(r) as u64 {
            return Err(Error::InvalidArgument {
                op,
                rank: r,
                reason: format!(
                    "the output holds {} elements, the result has {}",
                    words[index],
                    expected(r)
                ),
            });
        }
    }
    Ok(())
}

/// A `rows x cols` block cut into tasks of about `target` elements: whole rows when rows are
/// short, pieces of one row when they are long.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Chunks {
    rows: usize,
    cols: usize,
    row_step: usize,
    col_step: usize,
    per_row: usize,
    pub(crate) count: usize,
}

/// One task of [`Chunks`]: its first row and column, and how many of each the mask keeps.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Chunk {
    pub(crate) row: usize,
    pub(crate) col: usize,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
}

impl Chunks {
    pub(crate) fn new(rows: usize, cols: usize, target: usize) -> Self {
        if rows == 0 || cols == 0 {
            return Chunks { rows, cols, row_step: 1, col_step: 1, per_row: 1, count: 0 };
        }
        let col_step = cols.min(target);
        let row_step = (target / col_step).clamp(1, rows);
        let per_row = cols.div_ceil(col_step);
        Chunks { rows, cols, row_step, col_step, per_row, count: rows.div_ceil(row_step) * per_row }
    }

    /// The largest task: the tile shape a program needs.
    pub(crate) fn block(&self) -> (usize, usize) {
        (self.row_step, self.col_step)
    }

    pub(crate) fn get(&self, task: usize) -> Chunk {
        let row = (task / self.per_row) * self.row_step;
        let col = (task % self.per_row) * self.col_step;
        Chunk {
            row,
            col,
            rows: valid_len(row, self.row_step, self.rows),
            cols: valid_len(col, self.col_step, self.cols),
        }
    }
}

/// Tasks flattened over peers in rotated order (`i`-th group is rank `(me + i) % n`), each peer
/// with its own number of chunks: finds the group and the chunk of a flat task index.
pub(crate) struct RotatedTasks {
    starts: Vec<usize>,
    me: usize,
}

impl RotatedTasks {
    pub(crate) fn new(me: usize, counts_by_rank: &[usize]) -> Self {
        let n = counts_by_rank.len();
        let mut starts = Vec::with_capacity(n + 1);
        starts.push(0);
        for i in 0..n {
            starts.push(starts[i] + counts_by_rank[(me + i) % n]);
        }
        RotatedTasks { starts, me }
    }

    pub(crate) fn total(&self) -> usize {
        *self.starts.last().expect("at least one rank")
    }

    /// `(source rank, chunk index within that rank's block)`.
    pub(crate) fn locate(&self, task: usize) -> (usize, usize) {
        let i = self.starts.partition_point(|&s| s <= task) - 1;
        let n = self.starts.len() - 1;
        ((self.me + i) % n, task - self.starts[i])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_a_block_exactly_once() {
        for (rows, cols, target) in [(1, 1, 4), (7, 13, 16), (3, 100, 16), (100, 3, 16), (0, 5, 8)]
        {
            let chunks = Chunks::new(rows, cols, target);
            let mut hits = vec![0u8; rows * cols];
            for t in 0..chunks.count {
                let c = chunks.get(t);
                assert!(c.rows * c.cols <= target.max(cols.min(target)));
                for r in c.row..c.row + c.rows {
                    for k in c.col..c.col + c.cols {
                        hits[r * cols + k] += 1;
                    }
                }
            }
            assert!(hits.iter().all(|&h| h == 1), "{rows}x{cols} by {target}");
        }
    }

    #[test]
    fn rotated_tasks_start_with_own_rank_and_skip_empty_ranks() {
        let tasks = RotatedTasks::new(2, &[1, 0, 2, 3]);
        let order: Vec<_> = (0..tasks.total()).map(|t| tasks.locate(t)).collect();
        assert_eq!(order, vec![(2, 0), (2, 1), (3, 0), (3, 1), (3, 2), (0, 0)]);
    }
}
