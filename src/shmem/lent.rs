//! Output blocks: blocks of a rank's symmetric heap lent to the tensors a collective returns, so
//! that peers write the result straight into its final place (one copy instead of two: no
//! receive buffer to copy out of).
//!
//! The rules that keep this sound:
//! - A block is lent to one tensor (shared by its clones) at a time, and only in a call where
//!   every rank reports its own copy of the block free: each rank puts the mask of its free
//!   blocks ([`Rank::free_output_blocks`]) in the call's exchange, and the call uses the AND of
//!   them. So a peer never writes into memory a tensor holds: a block becomes free when the last
//!   tensor holding it is dropped (an `Arc` count, read with acquire ordering), and a tensor is
//!   made only after every peer's writes have arrived.
//! - Which block a call takes, and when blocks are allocated or freed, is decided from agreed
//!   values only (the masks, the call's sizes, the blocks every rank allocated alike), so every
//!   rank decides the same and the heap stays symmetric. A block goes back to the heap only when
//!   it is free everywhere: in a call that needs room, or in [`Rank::release_workspaces`].
//! - A lent tensor holds its block, and through it the heap's mapping, for as long as it lives:
//!   it may outlive the call, the run and the world (its space then goes back to a heap nobody
//!   allocates from). In a world of processes the block is in this process's own segment.

use std::sync::Arc;

use super::buffer::SymmBuf;
use super::heap::lock;
use super::rank::Rank;
use crate::tensor::{LENT_ALIGN, LentMemory};
use crate::{Error, Result};

/// The most output blocks a rank keeps (one bit each in the exchanged mask).
pub(crate) const MAX_OUTPUT_BLOCKS: usize = 64;
/// The share of the heap that output blocks may take (the rest is for workspaces).
const HEAP_SHARE: usize = 2;

/// One symmetric block; the rank's list holds one reference, each tensor family one more.
struct Block {
    buf: SymmBuf<u8>,
}

/// A rank's output blocks, in the order every rank allocated them.
#[derive(Default)]
pub(crate) struct OutputBlocks {
    blocks: Vec<Arc<Block>>,
}

impl OutputBlocks {
    /// Bit `i` set when block `i` is held by no tensor of this rank.
    fn free_mask(&mut self) -> u64 {
        // `get_mut` reads the count with acquire ordering: everything the last tensor did with
        // the block happens before the peers' writes that the mask lets in.
        self.blocks
            .iter_mut()
            .enumerate()
            .filter_map(|(i, b)| Arc::get_mut(b).map(|_| i))
            .fold(0, |mask, i| mask | 1 << i)
    }

    /// Bytes of symmetric memory the blocks take.
    pub(crate) fn bytes(&self) -> usize {
        self.blocks.iter().map(|b| b.buf.len()).sum()
    }

    /// Frees the blocks free on every rank (`free_everywhere`, then spent: the blocks after the
    /// freed ones move up); the others keep their order. The same on every rank, so the heaps
    /// stay alike.
    fn free_idle(&mut self, free_everywhere: &mut u64) {
        let free_everywhere = std::mem::take(free_everywhere);
        let mut i = 0;
        self.blocks.retain(|_| {
            let keep = free_everywhere >> i & 1 == 0;
            i += 1;
            keep
        });
    }
}

/// A block taken for one call's output: peers write into it through [`OutputBlock::buf`], then
/// [`OutputBlock::lend`] hands it to the output tensor.
pub(crate) struct OutputBlock {
    block: Arc<Block>,
}

impl OutputBlock {
    /// The symmetric buffer, for `symm_at` (bytes: cast the pointers to the element type).
    pub(crate) fn buf(&self) -> &SymmBuf<u8> {
        &self.block.buf
    }

    /// The memory to make the output tensor of (`Tensor::lent`): the block counts as held until
    /// the tensor and all its clones are dropped.
    pub(crate) fn lend(self) -> Arc<dyn LentMemory> {
        Arc::new(Loan { block: self.block })
    }
}

/// A block held by a tensor family.
struct Loan {
    block: Arc<Block>,
}

// SAFETY: the block's bytes lie in a heap segment that its `SymmBuf` keeps mapped (through the
// heap's `Arc`) for as long as the loan lives; heap blocks are aligned to `heap::ALIGN`, a
// multiple of LENT_ALIGN; and while the loan lives the block is not free on this rank, so no call
// lets a peer write into it (see the module docs): only the loan's holders access it.
unsafe impl LentMemory for Loan {
    fn ptr(&self) -> *mut u8 {
        use super::buffer::Writable;
        self.block.buf.ptr().raw_write().0
    }

    fn bytes(&self) -> usize {
        self.block.buf.len()
    }
}

const _: () = assert!(super::heap::ALIGN.is_multiple_of(LENT_ALIGN));

/// The size to allocate for `bytes`: rounded up to an eighth of the power of two at or below it (at most
/// 12.5% more), so that outputs of nearby sizes share a block.
fn size_class(bytes: usize) -> usize {
    let bytes = bytes.max(4096);
    // Eight classes between two powers of two: the step is an eighth of the power at or below
    // `bytes` (an eighth of the one above would waste up to a quarter just past a power).
    let step = (1usize << bytes.ilog2()) / 8;
    bytes.next_multiple_of(step)
}

impl Rank<'_> {
    /// This rank's output blocks that no tensor holds, as a bit mask: a word for a call's
    /// exchange, whose AND over every rank is the `free_everywhere` of [`Rank::output_block`].
    pub(crate) fn free_output_blocks(&self) -> u64 {
        lock(&self.world.local[self.rank].output_blocks).free_mask()
    }

    /// An output block of at least `bytes` for this call: the smallest block free on every rank
    /// that fits (and is at most twice the size it would allocate), or a new one allocated on every rank.
    /// Collective: every rank passes the same `free_everywhere` (from the call's exchange) and
    /// `bytes`. `None` when there is no room (the rank keeps [`MAX_OUTPUT_BLOCKS`], the blocks
    /// would take more than half of the heap, or the heap is full even without the idle blocks):
    /// the call then copies through its receive buffer instead.
    ///
    /// # Errors
    /// As [`Rank::alloc`], but a heap too full for the block is `None`, not an error.
    pub(crate) fn output_block(
        &self,
        free_everywhere: u64,
        bytes: usize,
    ) -> Result<Option<OutputBlock>> {
        let mut blocks = lock(&self.world.local[self.rank].output_blocks);
        let size = size_class(bytes);
        let fits = |(i, b): &(usize, &Arc<Block>)| {
            free_everywhere >> i & 1 == 1 && b.buf.len() >= bytes && b.buf.len() / 2 <= size
        };
        let best = blocks.blocks.iter().enumerate().filter(fits).min_by_key(|(_, b)| b.buf.len());
        if let Some((_, block)) = best {
            return Ok(Some(OutputBlock { block: block.clone() }));
        }
        let budget =
            self.world.heap.capacity().saturating_sub(self.world.heap.reserved()) / HEAP_SHARE;
        let room = |b: &OutputBlocks| {
            b.blocks.len() < MAX_OUTPUT_BLOCKS && b.bytes().saturating_add(size) <= budget
        };
        // The idle blocks (free everywhere) go back to the heap when the new one needs room.
        let mut idle = free_everywhere;
        if !room(&blocks) {
            blocks.free_idle(&mut idle);
            if !room(&blocks) {
                return Ok(None);
            }
        }
        // Every rank's allocation fails alike (its exchange tells them all): a heap too full
        // is tried once more without the idle blocks, then the call goes without.
        let full = |err: &Error| {
            matches!(err, Error::SymmetricMemoryExhausted { .. } | Error::InvalidArgument { .. })
        };
        let buf = match self.alloc_for::<u8>("output block", size) {
            Ok(buf) => buf,
            Err(err) if full(&err) && idle != 0 => {
                blocks.free_idle(&mut idle);
                match self.alloc_for::<u8>("output block", size) {
                    Ok(buf) => buf,
                    Err(err) if full(&err) => return Ok(None),
                    Err(err) => return Err(err),
                }
            }
            Err(err) if full(&err) => return Ok(None),
            Err(err) => return Err(err),
        };
        let block = Arc::new(Block { buf });
        blocks.blocks.push(block.clone());
        Ok(Some(OutputBlock { block }))
    }

    /// Frees the output blocks that are free on every rank (`free_everywhere`, agreed).
    pub(crate) fn free_idle_output_blocks(&self, free_everywhere: u64) {
        lock(&self.world.local[self.rank].output_blocks).free_idle(&mut { free_everywhere });
    }

    /// Bytes of symmetric memory this rank's output blocks take.
    pub(crate) fn output_block_bytes(&self) -> usize {
        lock(&self.world.local[self.rank].output_blocks).bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_classes_waste_at_most_an_eighth() {
        for bytes in [1, 4095, 4096, 4097, 5000, 65_537, (1 << 26) + 3, 3 << 20] {
            let size = size_class(bytes);
            assert!(size >= bytes, "{bytes}");
            assert!(size <= bytes.max(4096) + bytes.max(4096) / 8 + 1, "{bytes} -> {size}");
        }
        assert_eq!(size_class(5000), 5120);
    }
}
