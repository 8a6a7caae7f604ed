//! The symmetric heap: one segment of equal capacity per rank, addressed by offsets.
//!
//! Offsets, not references, so that the same layout can later serve ranks that are processes
//! sharing memfd segments or hosts joined by one-sided windows: a symmetric allocation is an offset
//! that means the same thing in every rank's segment.

use std::sync::Mutex;

use super::mapping::Mapping;
use crate::{Error, Result};

/// Allocation granularity and alignment: two cache lines, so that buffers never share a line.
pub(crate) const ALIGN: usize = 128;

/// Free blocks of one segment, sorted by offset, coalesced on free.
#[derive(Debug)]
struct FreeList {
    blocks: Vec<(usize, usize)>,
}

impl FreeList {
    fn alloc(&mut self, bytes: usize) -> Option<usize> {
        let i = self.blocks.iter().position(|&(_, size)| size >= bytes)?;
        let (offset, size) = self.blocks[i];
        if size == bytes {
            self.blocks.remove(i);
        } else {
            self.blocks[i] = (offset + bytes, size - bytes);
        }
        Some(offset)
    }

    fn free(&mut self, offset: usize, bytes: usize) {
        let i = self.blocks.partition_point(|&(o, _)| o < offset);
        self.blocks.insert(i, (offset, bytes));
        if i + 1 < self.blocks.len() && offset + bytes == self.blocks[i + 1].0 {
            self.blocks[i].1 += self.blocks[i + 1].1;
            self.blocks.remove(i + 1);
        }
        if i > 0 && self.blocks[i - 1].0 + self.blocks[i - 1].1 == offset {
            self.blocks[i - 1].1 += self.blocks[i].1;
            self.blocks.remove(i);
        }
    }

    fn free_bytes(&self) -> usize {
        self.blocks.iter().map(|b| b.1).sum()
    }

    fn largest_free(&self) -> usize {
        self.blocks.iter().map(|b| b.1).max().unwrap_or(0)
    }
}

/// The heap of a world as this process sees it: the segments of every rank of its node mapped
/// (the table of peer bases; ranks on other nodes, in a world joined by MPI, have none here), and
/// the free lists of the segments this process allocates in (every rank's for a thread world, its
/// own for a process world). Whether ranks allocate alike is checked by the allocation's exchange
/// (`Rank::alloc`), not here.
pub(crate) struct Heap {
    segments: Vec<Option<Mapping>>,
    capacity: usize,
    reserved: usize,
    free_lists: Vec<Mutex<FreeList>>,
}

/// `capacity` rounded up to the allocation granularity, or an error if that overflows or leaves
/// nothing after the runtime's `reserved` bytes.
pub(crate) fn segment_bytes(capacity: usize, reserved: usize) -> Result<(usize, usize)> {
    let too_large = || Error::InvalidArgument {
        op: "World::build",
        rank: 0,
        reason: format!(
            "a symmetric heap of {capacity} bytes per rank does not fit the address space"
        ),
    };
    let reserved = reserved.checked_next_multiple_of(ALIGN).ok_or_else(too_large)?;
    let capacity = capacity.checked_next_multiple_of(ALIGN).ok_or_else(too_large)?;
    if capacity > isize::MAX as usize {
        return Err(too_large());
    }
    if capacity <= reserved {
        return Err(Error::InvalidArgument {
            op: "World::build",
            rank: 0,
            reason: format!(
                "a symmetric heap of {capacity} bytes leaves nothing after the runtime's \
                 {reserved} reserved bytes"
            ),
        });
    }
    Ok((capacity, reserved))
}

impl Heap {
    /// A heap over `segments` (one per rank, each `capacity` bytes, the first `reserved` of
    /// which the runtime keeps for itself; `None` for a rank whose memory this process cannot
    /// map, on another node).
    pub(crate) fn new(segments: Vec<Option<Mapping>>, capacity: usize, reserved: usize) -> Heap {
        let free_lists = (0..segments.len())
            .map(|_| Mutex::new(FreeList { blocks: vec![(reserved, capacity - reserved)] }))
            .collect();
        Heap { segments, capacity, reserved, free_lists }
    }

    /// Maps `num_ranks` anonymous segments: the heap of a thread world.
    pub(crate) fn anonymous(num_ranks: usize, capacity: usize, reserved: usize) -> Result<Heap> {
        let mut segments = Vec::with_capacity(num_ranks);
        for rank in 0..num_ranks {
            segments.push(Some(Mapping::anonymous(capacity).map_err(|e| {
                Error::InvalidArgument {
                    op: "World::build",
                    rank,
                    reason: format!("cannot map a symmetric heap segment of {capacity} bytes: {e}"),
                }
            })?));
        }
        Ok(Heap::new(segments, capacity, reserved))
    }

    pub(crate) fn num_ranks(&self) -> usize {
        self.segments.len()
    }

    /// Segment capacity in bytes, the runtime's reserved part included.
    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }

    /// Bytes at the start of each segment that the runtime keeps for itself.
    pub(crate) fn reserved(&self) -> usize {
        self.reserved
    }

    /// Base address of `rank`'s segment.
    ///
    /// # Panics
    /// If `rank`'s segment is not mapped in this process (a rank on another node): callers ask
    /// [`Heap::mapped`] first wherever a peer may be remote.
    #[track_caller]
    pub(crate) fn base(&self, rank: usize) -> *mut u8 {
        match &self.segments[rank] {
            Some(segment) => segment.base(),
            None => panic!("rank {rank}'s heap segment is on another node: no pointer to it here"),
        }
    }

    /// Whether `rank`'s segment is mapped in this process (it is on this node).
    pub(crate) fn mapped(&self, rank: usize) -> bool {
        self.segments.get(rank).is_some_and(Option::is_some)
    }

    /// Bytes free in `rank`'s segment.
    pub(crate) fn free_bytes(&self, rank: usize) -> usize {
        lock(&self.free_lists[rank]).free_bytes()
    }

    /// Takes `bytes` from `rank`'s free list (rounded up to [`ALIGN`]); returns the offset, or
    /// the error saying what is left.
    pub(crate) fn alloc(&self, rank: usize, bytes: usize) -> Result<usize> {
        let rounded = bytes.max(1).checked_next_multiple_of(ALIGN).unwrap_or(usize::MAX);
        let mut list = lock(&self.free_lists[rank]);
        list.alloc(rounded).ok_or_else(|| Error::SymmetricMemoryExhausted {
            rank,
            requested: bytes,
            largest_free: list.largest_free(),
            free: list.free_bytes(),
            capacity: self.capacity - self.reserved,
        })
    }

    /// Returns an allocation made by [`Heap::alloc`] to `rank`'s free list.
    pub(crate) fn free(&self, rank: usize, offset: usize, bytes: usize) {
        lock(&self.free_lists[rank]).free(offset, bytes.max(1).next_multiple_of(ALIGN));
    }
}

/// Locks a mutex, ignoring poisoning: the data under these locks stays consistent even when a
/// thread panicked while holding one (every update is a single step).
pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_list_coalesces_neighbours() {
        let mut list = FreeList { blocks: vec![(0, 1024)] };
        let a = list.alloc(128).unwrap();
        let b = list.alloc(256).unwrap();
        let c = list.alloc(128).unwrap();
        assert_eq!((a, b, c), (0, 128, 384));
        list.free(b, 256);
        list.free(a, 128);
        assert_eq!(list.blocks, vec![(0, 384), (512, 512)]);
        list.free(c, 128);
        assert_eq!(list.blocks, vec![(0, 1024)]);
    }

    #[test]
    fn exhaustion_names_request_and_what_is_left() {
        let heap = Heap::anonymous(1, 4096, 128).unwrap();
        heap.alloc(0, 3000).unwrap();
        let err = heap.alloc(0, 2000).unwrap_err().to_string();
        assert!(err.contains("asked for 2000 bytes"), "{err}");
        assert!(err.contains("largest free block is 896 bytes"), "{err}");
    }
}
