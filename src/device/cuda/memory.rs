//! Device memory: plain `cuMemAlloc` allocations (a peer reaches them through context peer access;
//! cudarc's stream-ordered pool memory it cannot), cached by size for reuse, and the symmetric
//! heap that collective allocations come from.

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
            return Ok(DeviceBuffer { ptr: 0, bytes: 0, gpu: gpu.clone(), stream });
        }
        let size = bucket(bytes);
        let cached = gpu
            .free_cache
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_mut(&(stream, size))
            .and_then(Vec::pop);
        if let Some(ptr) = cached {
            return Ok(DeviceBuffer { ptr, bytes: size, gpu: gpu.clone(), stream });
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
        Ok(DeviceBuffer { ptr, bytes: size, gpu: gpu.clone(), stream })
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
        if self.bytes > 0 {
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
    /// Per rank: free blocks (offset, bytes), sorted by offset.
    free: Vec<Mutex<Vec<(usize, usize)>>>,
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
            free: (0..n).map(|_| Mutex::new(vec![(0, capacity)])).collect(),
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
            free: (0..n).map(|_| Mutex::new(vec![(0, capacity)])).collect(),
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
        let Some(slot) = free.iter().position(|&(_, len)| len >= size) else {
            let total = free.iter().map(|&(_, l)| l).sum();
            let largest = free.iter().map(|&(_, l)| l).max().unwrap_or(0);
            return Err(Error::SymmetricMemoryExhausted {
                rank,
                requested: bytes,
                largest_free: largest,
                free: total,
                capacity: self.capacity,
            });
        };
        let (offset, len) = free[slot];
        if len == size {
            free.remove(slot);
        } else {
            free[slot] = (offset + size, len - size);
        }
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
        let mut free = self.free[rank].lock().unwrap_or_else(|p| p.into_inner());
        let at = free.partition_point(|&(o, _)| o < region.offset);
        free.insert(at, (region.offset, region.bytes));
        // Merge with the neighbours.
        let mut i = at.saturating_sub(1);
        while i + 1 < free.len() {
            if free[i].0 + free[i].1 == free[i + 1].0 {
                free[i].1 += free[i + 1].1;
                free.remove(i + 1);
            } else if i > at {
                break;
            } else {
                i += 1;
            }
        }
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
