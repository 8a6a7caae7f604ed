//! The symmetric heap: one segment of equal capacity per rank, addressed by offsets.
//!
//! Offsets, not references, so that the same layout can later serve ranks that are processes
//! sharing `/dev/shm` or hosts joined by one-sided windows: a symmetric allocation is an offset
//! that means the same thing in every rank's segment.

use std::collections::HashMap;
use std::sync::Mutex;

use memmap2::MmapMut;

use crate::{Error, Result};

/// Allocation granularity and alignment: two cache lines, so that buffers never share a line.
pub(crate) const ALIGN: usize = 128;

/// One rank's segment: an anonymous mapping, so pages that are never touched cost nothing.
struct Segment {
    _map: MmapMut,
    base: *mut u8,
}

// SAFETY: the segment is plain memory shared by the ranks' threads; every access through `base`
// goes through the pointer types of `shmem`, whose users synchronize through signals.
unsafe impl Send for Segment {}
// SAFETY: as above.
unsafe impl Sync for Segment {}

/// Free blocks of one segment, sorted by offset, coalesced on free.
#[derive(Debug)]
struct FreeList {
    blocks: Vec<(usize, usize)>,
    /// How many allocations this rank has made: the position in the collective sequence.
    sequence: u64,
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

/// What the first rank to make allocation number `sequence` got, for the others to compare.
struct LogEntry {
    rank: usize,
    offset: usize,
    bytes: usize,
    seen: usize,
}

/// The heap of a world: segments, their free lists, and the check that allocation is collective.
pub(crate) struct Heap {
    segments: Vec<Segment>,
    capacity: usize,
    reserved: usize,
    free_lists: Vec<Mutex<FreeList>>,
    log: Mutex<HashMap<u64, LogEntry>>,
}

impl Heap {
    /// Maps `num_ranks` segments of `capacity` bytes; the first `reserved` bytes of each are kept
    /// for the runtime's own signals (the barrier).
    pub(crate) fn new(num_ranks: usize, capacity: usize, reserved: usize) -> Result<Heap> {
        let capacity = capacity.next_multiple_of(ALIGN);
        let reserved = reserved.next_multiple_of(ALIGN);
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
        let mut segments = Vec::with_capacity(num_ranks);
        for rank in 0..num_ranks {
            let mut map = MmapMut::map_anon(capacity).map_err(|e| Error::InvalidArgument {
                op: "World::build",
                rank,
                reason: format!("cannot map a symmetric heap segment of {capacity} bytes: {e}"),
            })?;
            let base = map.as_mut_ptr();
            segments.push(Segment { _map: map, base });
        }
        let free_lists = (0..num_ranks)
            .map(|_| {
                Mutex::new(FreeList { blocks: vec![(reserved, capacity - reserved)], sequence: 0 })
            })
            .collect();
        Ok(Heap { segments, capacity, reserved, free_lists, log: Mutex::new(HashMap::new()) })
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
    pub(crate) fn base(&self, rank: usize) -> *mut u8 {
        self.segments[rank].base
    }

    /// Bytes free in `rank`'s segment.
    pub(crate) fn free_bytes(&self, rank: usize) -> usize {
        lock(&self.free_lists[rank]).free_bytes()
    }

    /// Allocates `bytes` on `rank`, and checks that every rank's allocation of the same number in
    /// the sequence got the same offset and size.
    pub(crate) fn alloc(&self, rank: usize, bytes: usize) -> Result<usize> {
        let rounded = bytes.max(1).checked_next_multiple_of(ALIGN).unwrap_or(usize::MAX);
        let (offset, sequence) = {
            let mut list = lock(&self.free_lists[rank]);
            let Some(offset) = list.alloc(rounded) else {
                return Err(Error::SymmetricMemoryExhausted {
                    rank,
                    requested: bytes,
                    largest_free: list.largest_free(),
                    free: list.free_bytes(),
                    capacity: self.capacity - self.reserved,
                });
            };
            list.sequence += 1;
            (offset, list.sequence)
        };
        let mut log = lock(&self.log);
        let entry =
            log.entry(sequence).or_insert(LogEntry { rank, offset, bytes: rounded, seen: 0 });
        if entry.offset != offset || entry.bytes != rounded {
            let err = Error::AllocationMismatch {
                sequence,
                rank_a: entry.rank,
                bytes_a: entry.bytes,
                offset_a: entry.offset,
                rank_b: rank,
                bytes_b: rounded,
                offset_b: offset,
            };
            drop(log);
            self.free(rank, offset, bytes);
            return Err(err);
        }
        entry.seen += 1;
        if entry.seen == self.num_ranks() {
            log.remove(&sequence);
        }
        Ok(offset)
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
        let mut list = FreeList { blocks: vec![(0, 1024)], sequence: 0 };
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
        let heap = Heap::new(1, 4096, 128).unwrap();
        heap.alloc(0, 3000).unwrap();
        let err = heap.alloc(0, 2000).unwrap_err().to_string();
        assert!(err.contains("asked for 2000 bytes"), "{err}");
        assert!(err.contains("largest free block is 896 bytes"), "{err}");
    }
}
