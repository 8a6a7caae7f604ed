//! Device memory: plain `cuMemAlloc` allocations (a peer reaches them through context peer access;
//! cudarc's stream-ordered pool memory it cannot), cached by size for reuse; the symmetric heap
//! that collective allocations come from; and, in a world of processes, the rank-private pool in
//! its exported segment that its tensors come from (so that peers can read any of them).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::{result as cu, sys};

use super::driver::{Check, CudaDevice};
use crate::{Error, Result};

/// Sizes are rounded up to this, so that freed buffers serve later requests of similar size.
fn bucket(bytes: usize) -> usize {
    const SMALL: usize = 512;
    const LARGE: usize = 2 << 20;
    if bytes <= LARGE { bytes.div_ceil(SMALL) * SMALL } else { bytes.div_ceil(LARGE) * LARGE }
}

/// One allocation of device memory on one GPU, for work on one stream, given back to the GPU's
/// cache for that stream when dropped.
///
/// Work on a stream runs in order, so memory given back while work that uses it is still queued
/// is only reused by work queued after it on the same stream (hence a cache per stream).
pub(crate) struct DeviceBuffer {
    pub(crate) ptr: sys::CUdeviceptr,
    pub(crate) bytes: usize,
    pub(crate) gpu: Arc<CudaDevice>,
    stream: usize,
    /// The pool it came from (a world of processes), which takes it back; `None`: `cuMemAlloc`
    /// memory, back to the GPU's cache.
    pub(crate) pool: Option<Arc<TensorPool>>,
}

impl DeviceBuffer {
    /// At least `bytes` bytes on `gpu` (none for zero bytes), contents unspecified, for work
    /// queued on `stream`.
    pub(crate) fn new(
        gpu: &Arc<CudaDevice>,
        bytes: usize,
        stream: sys::CUstream,
    ) -> Result<DeviceBuffer> {
        let stream = stream as usize;
        if bytes == 0 {
            return Ok(DeviceBuffer { ptr: 0, bytes: 0, gpu: gpu.clone(), stream, pool: None });
        }
        let size = bucket(bytes);
        let cached = gpu
            .free_cache
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_mut(&(stream, size))
            .and_then(Vec::pop);
        if let Some(ptr) = cached {
            return Ok(DeviceBuffer { ptr, bytes: size, gpu: gpu.clone(), stream, pool: None });
        }
        gpu.bind()?;
        // SAFETY: plain allocation; freed when the cache is dropped.
        let ptr = match unsafe { cu::malloc_sync(size) } {
            Ok(ptr) => ptr,
            Err(_) => {
                // Out of memory, perhaps only because of cached buffers: free them and retry.
                release_cache(gpu)?;
                // SAFETY: as above.
                unsafe { cu::malloc_sync(size) }.map_err(|e| Error::DeviceStatus {
                    call: "cuMemAlloc",
                    code: e.0 as i32,
                    message: format!(
                        "cuda:{}: could not allocate {size} bytes: {}",
                        gpu.ordinal,
                        e.error_string()
                            .map(|s| s.to_string_lossy().into_owned())
                            .unwrap_or_default()
                    ),
                })?
            }
        };
        Ok(DeviceBuffer { ptr, bytes: size, gpu: gpu.clone(), stream, pool: None })
    }

    /// At least `bytes` bytes of `pool` (none for zero bytes), contents unspecified, for work
    /// queued on `stream`.
    pub(crate) fn in_pool(
        pool: &Arc<TensorPool>,
        bytes: usize,
        stream: sys::CUstream,
    ) -> Result<DeviceBuffer> {
        let (stream, gpu) = (stream as usize, pool.gpu.clone());
        if bytes == 0 {
            // Still of the pool: tensors made from this one come from it too.
            return Ok(DeviceBuffer { ptr: 0, bytes: 0, gpu, stream, pool: Some(pool.clone()) });
        }
        let size = bucket(bytes);
        let ptr = pool.take(stream, size, bytes)?;
        Ok(DeviceBuffer { ptr, bytes: size, gpu, stream, pool: Some(pool.clone()) })
    }
}

/// Frees every cached buffer of `gpu`.
fn release_cache(gpu: &CudaDevice) -> Result<()> {
    let cached = std::mem::take(&mut *gpu.free_cache.lock().unwrap_or_else(|p| p.into_inner()));
    gpu.synchronize_now()?;
    for ptr in cached.into_values().flatten() {
        // SAFETY: cached pointers came from cuMemAlloc, and the GPU is idle.
        unsafe { cu::free_sync(ptr) }.check("cuMemFree")?;
    }
    Ok(())
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.bytes == 0 {
            return;
        }
        if let Some(pool) = &self.pool {
            pool.give_back(self.stream, self.bytes, self.ptr);
        } else {
            let mut cache = self.gpu.free_cache.lock().unwrap_or_else(|p| p.into_inner());
            cache.entry((self.stream, self.bytes)).or_default().push(self.ptr);
        }
    }
}

/// Frees the cached buffers of `stream` on `gpu` (the stream is going away; it must be idle).
pub(crate) fn release_stream_cache(gpu: &CudaDevice, stream: sys::CUstream) {
    let mut cache = gpu.free_cache.lock().unwrap_or_else(|p| p.into_inner());
    let keys: Vec<(usize, usize)> =
        cache.keys().filter(|k| k.0 == stream as usize).copied().collect();
    for key in keys {
        for ptr in cache.remove(&key).unwrap_or_default() {
            // SAFETY: cached pointers came from cuMemAlloc; their stream is idle.
            let _ = unsafe { cu::free_sync(ptr) };
        }
    }
}

/// Free blocks (offset, bytes) of a range, sorted by offset: first fit, merged on free.
struct FreeList {
    blocks: Vec<(usize, usize)>,
}

impl FreeList {
    fn new(capacity: usize) -> FreeList {
        FreeList { blocks: vec![(0, capacity)] }
    }

    /// The offset of `size` bytes, taken from the first block that holds them.
    fn take(&mut self, size: usize) -> Option<usize> {
        let slot = self.blocks.iter().position(|&(_, len)| len >= size)?;
        let (offset, len) = self.blocks[slot];
        if len == size {
            self.blocks.remove(slot);
        } else {
            self.blocks[slot] = (offset + size, len - size);
        }
        Some(offset)
    }

    /// Gives `size` bytes at `offset` back, merged with the free blocks beside it.
    fn give(&mut self, offset: usize, size: usize) {
        let at = self.blocks.partition_point(|&(o, _)| o < offset);
        // A block given twice, or one that overlaps a free block, would be handed out twice.
        assert!(
            self.blocks.get(at).is_none_or(|&(o, _)| offset + size <= o)
                && (at == 0 || self.blocks[at - 1].0 + self.blocks[at - 1].1 <= offset),
            "device memory at offset {offset} ({size} bytes) freed twice"
        );
        self.blocks.insert(at, (offset, size));
        if at + 1 < self.blocks.len() && offset + size == self.blocks[at + 1].0 {
            self.blocks[at].1 += self.blocks.remove(at + 1).1;
        }
        if at > 0 && self.blocks[at - 1].0 + self.blocks[at - 1].1 == offset {
            self.blocks[at - 1].1 += self.blocks.remove(at).1;
        }
    }

    /// (largest block, all free bytes).
    fn room(&self) -> (usize, usize) {
        let largest = self.blocks.iter().map(|&(_, l)| l).max().unwrap_or(0);
        (largest, self.blocks.iter().map(|&(_, l)| l).sum())
    }
}

/// The memory a rank of a world of processes makes its tensors in: its own part of the segment
/// it exported, so that any tensor's address means the same memory in every process and a
/// kernel can publish it to its peers as it is (a `cuMemAlloc` address means nothing in another
/// process). Rank-private: no allocation here is collective. Freed buffers are cached per stream
/// and size, as the GPU's `cuMemAlloc` cache is (memory given back while work that uses it is
/// queued is only reused by work queued after it on the same stream).
pub(crate) struct TensorPool {
    rank: usize,
    gpu: Arc<CudaDevice>,
    base: sys::CUdeviceptr,
    capacity: usize,
    free: Mutex<FreeList>,
    /// Freed buffers by (stream, bytes).
    cache: Mutex<HashMap<(usize, usize), Vec<sys::CUdeviceptr>>>,
    /// What keeps the pool's addresses mapped (the world's window, shared with its heap):
    /// tensors may outlive the world.
    mapping: Option<Arc<dyn Send + Sync>>,
}

impl TensorPool {
    /// The pool of `rank` over `capacity` bytes at `base`, mapped as long as `mapping` lives.
    pub(crate) fn new(
        rank: usize,
        gpu: &Arc<CudaDevice>,
        base: sys::CUdeviceptr,
        capacity: usize,
        mapping: Arc<dyn Send + Sync>,
    ) -> TensorPool {
        TensorPool {
            rank,
            gpu: gpu.clone(),
            base,
            capacity,
            free: Mutex::new(FreeList::new(capacity)),
            cache: Mutex::new(HashMap::new()),
            mapping: Some(mapping),
        }
    }

    /// `size` bytes (a `bucket`) for `stream`; `asked` is what the caller asked for, for the
    /// error.
    fn take(&self, stream: usize, size: usize, asked: usize) -> Result<sys::CUdeviceptr> {
        let cached = self
            .cache
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_mut(&(stream, size))
            .and_then(Vec::pop);
        if let Some(ptr) = cached {
            return Ok(ptr);
        }
        if let Some(offset) = self.free.lock().unwrap_or_else(|p| p.into_inner()).take(size) {
            return Ok(self.base + offset as u64);
        }
        // Full, perhaps only of cached buffers: once the GPU is idle, any stream may reuse them.
        let cached = std::mem::take(&mut *self.cache.lock().unwrap_or_else(|p| p.into_inner()));
        self.gpu.synchronize_now()?;
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        for ((_, bytes), ptrs) in cached {
            for ptr in ptrs {
                free.give((ptr - self.base) as usize, bytes);
            }
        }
        if let Some(offset) = free.take(size) {
            return Ok(self.base + offset as u64);
        }
        let (largest, all) = free.room();
        Err(Error::OutOfMemory {
            op: "a GPU tensor in a world of processes",
            bytes: asked,
            what: format!(
                "rank {}'s tensor pool (the part of its GPU heap segment its tensors live in, so \
                 that peers can read them) has {all} of {} bytes free, {largest} in one piece; \
                 set {} larger",
                self.rank,
                self.capacity,
                super::GPU_HEAP_BYTES_ENV
            ),
        })
    }

    fn give_back(&self, stream: usize, size: usize, ptr: sys::CUdeviceptr) {
        debug_assert!(ptr >= self.base && ptr + size as u64 <= self.base + self.capacity as u64);
        let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        cache.entry((stream, size)).or_default().push(ptr);
    }
}

impl Drop for TensorPool {
    fn drop(&mut self) {
        let mapping = self.mapping.take();
        // Idle first: no kernel of this process may still reach addresses being unmapped.
        if self.gpu.synchronize_now().is_ok() {
            drop(mapping);
        } else {
            std::mem::forget(mapping); // a stuck GPU: leak rather than unmap under it
        }
    }
}

/// A region of every rank's symmetric heap: the same offset on each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SymmRegion {
    pub(crate) offset: usize,
    pub(crate) bytes: usize,
}

/// The symmetric heap of a GPU world: one plain device allocation per rank, of one capacity.
/// Allocations are collective (every rank in the same order), so a region has the same offset on
/// every rank and `symm_at(region, peer)` is the peer's base plus that offset.
pub(crate) struct SymmetricHeap {
    bases: Vec<sys::CUdeviceptr>,
    gpus: Vec<Arc<CudaDevice>>,
    capacity: usize,
    /// Per rank: its free blocks.
    free: Vec<Mutex<FreeList>>,
    /// Per rank: how many allocations it made; and what the first rank to make each one got.
    sequence: Vec<Mutex<u64>>,
    record: Mutex<Vec<(usize, usize, usize)>>,
    /// For a heap of a world of processes: the mappings of every rank's segment (see `vmm`),
    /// released in Drop instead of `cuMemFree`.
    mapped: Option<Box<dyn Send + Sync>>,
}

const HEAP_ALIGN: usize = 256;

impl SymmetricHeap {
    /// `capacity` bytes on every GPU of `gpus`, rank `r` on `gpus[r]`.
    pub(crate) fn new(gpus: &[Arc<CudaDevice>], capacity: usize) -> Result<SymmetricHeap> {
        let capacity = capacity.div_ceil(HEAP_ALIGN) * HEAP_ALIGN;
        let mut bases = Vec::new();
        for gpu in gpus {
            gpu.bind()?;
            // SAFETY: plain allocation, freed in Drop.
            let base = unsafe { cu::malloc_sync(capacity) }.map_err(|e| Error::DeviceStatus {
                call: "cuMemAlloc",
                code: e.0 as i32,
                message: format!("cuda:{}: symmetric heap of {capacity} bytes: {e}", gpu.ordinal),
            })?;
            bases.push(base);
        }
        let n = gpus.len();
        Ok(SymmetricHeap {
            bases,
            gpus: gpus.to_vec(),
            capacity,
            free: (0..n).map(|_| Mutex::new(FreeList::new(capacity))).collect(),
            sequence: (0..n).map(|_| Mutex::new(0)).collect(),
            record: Mutex::new(Vec::new()),
            mapped: None,
        })
    }

    /// A heap whose segments `mapping` already holds: rank `r`'s at `bases[r]`, each of
    /// `capacity` bytes (a world of processes: its own segment and every peer's, imported).
    pub(crate) fn from_mapped(
        gpus: &[Arc<CudaDevice>],
        bases: Vec<sys::CUdeviceptr>,
        capacity: usize,
        mapping: Box<dyn Send + Sync>,
    ) -> SymmetricHeap {
        let n = bases.len();
        SymmetricHeap {
            bases,
            gpus: gpus.to_vec(),
            capacity,
            free: (0..n).map(|_| Mutex::new(FreeList::new(capacity))).collect(),
            sequence: (0..n).map(|_| Mutex::new(0)).collect(),
            record: Mutex::new(Vec::new()),
            mapped: Some(mapping),
        }
    }

    /// Collective: allocates `bytes` on `rank`'s segment. Every rank must make the same calls
    /// in the same order; a rank whose region differs from the first rank's gets an error.
    pub(crate) fn alloc(&self, rank: usize, bytes: usize) -> Result<SymmRegion> {
        let size = bytes.max(1).div_ceil(HEAP_ALIGN) * HEAP_ALIGN;
        let mut free = self.free[rank].lock().unwrap_or_else(|p| p.into_inner());
        let Some(offset) = free.take(size) else {
            let (largest, total) = free.room();
            return Err(Error::SymmetricMemoryExhausted {
                rank,
                requested: bytes,
                largest_free: largest,
                free: total,
                capacity: self.capacity,
            });
        };
        drop(free);
        let region = SymmRegion { offset, bytes: size };
        let mut seq = self.sequence[rank].lock().unwrap_or_else(|p| p.into_inner());
        let index = *seq as usize;
        *seq += 1;
        let mut record = self.record.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(&(first_rank, first_offset, first_bytes)) = record.get(index) {
            if (first_offset, first_bytes) != (offset, size) {
                return Err(Error::AllocationMismatch {
                    sequence: index as u64,
                    rank_a: first_rank,
                    bytes_a: first_bytes,
                    offset_a: first_offset,
                    rank_b: rank,
                    bytes_b: size,
                    offset_b: offset,
                    purpose_a: "GPU symmetric heap".into(),
                    purpose_b: "GPU symmetric heap".into(),
                });
            }
        } else {
            record.push((rank, offset, size));
        }
        Ok(region)
    }

    /// Gives `region` back on `rank`'s segment (collective like `alloc`: no rank may still use
    /// it, which the caller ensures by synchronizing first).
    pub(crate) fn free(&self, rank: usize, region: SymmRegion) {
        self.free[rank].lock().unwrap_or_else(|p| p.into_inner()).give(region.offset, region.bytes);
    }

    /// `region` on `peer`'s GPU: the peer's base plus the region's offset (for `peer` = this
    /// rank, the local address).
    pub(crate) fn symm_at(&self, region: SymmRegion, peer: usize) -> u64 {
        self.bases[peer] + region.offset as u64
    }
}

impl Drop for SymmetricHeap {
    fn drop(&mut self) {
        if let Some(mapping) = self.mapped.take() {
            // Idle first: no kernel of this process may still reach a segment being unmapped.
            if self.gpus.first().is_some_and(|g| g.synchronize_now().is_ok()) {
                drop(mapping);
            } else {
                std::mem::forget(mapping); // a stuck GPU: leak rather than unmap under it
            }
            return;
        }
        for (gpu, &base) in self.gpus.iter().zip(&self.bases) {
            if gpu.synchronize_now().is_ok() {
                // SAFETY: allocated in `new`; the GPU is idle.
                let _ = unsafe { cu::free_sync(base) };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::FreeList;

    #[test]
    fn a_free_list_hands_out_first_fit_and_merges_what_comes_back() {
        let mut list = FreeList::new(1000);
        let (a, b, c) = (list.take(100).unwrap(), list.take(200).unwrap(), list.take(300).unwrap());
        assert_eq!((a, b, c), (0, 100, 300));
        assert_eq!(list.take(401), None);
        list.give(b, 200);
        assert_eq!(list.room(), (400, 600));
        assert_eq!(list.take(150), Some(100), "first fit: the hole before the tail");
        list.give(100, 150);
        list.give(a, 100);
        list.give(c, 300);
        assert_eq!(list.blocks, [(0, 1000)], "every block merged back");
    }

    #[test]
    #[should_panic(expected = "freed twice")]
    fn a_block_given_back_twice_is_a_panic_not_a_second_owner() {
        let mut list = FreeList::new(1000);
        let a = list.take(100).unwrap();
        let _b = list.take(100).unwrap();
        list.give(a, 100);
        list.give(a, 100);
    }
}
