//! A cache of large element buffers, so that the outputs of one call reuse the memory freed by the
//! previous one.
//!
//! A fresh large output costs page faults (the kernel maps and zeroes every 4 KiB page on first
//! touch), which can take longer than the copy that fills it. Tensors give their buffers back
//! here when dropped, and ops take their outputs from here, so a loop of calls touches fresh
//! pages only on its first iteration. Buffers under 1 MiB are left to the allocator; the cache
//! holds at most [`DEFAULT_POOL_BYTES`] (or `DIST_TENSOR_POOL_BYTES`). When a buffer given back
//! does not fit, the buffers given back longest ago go to the allocator to make room (least
//! recently used first), so a program whose sizes change keeps the sizes it uses now.

use std::any::{Any, TypeId};
use std::sync::{Mutex, OnceLock};

use super::{Element, short_type_name};
use crate::{Error, Result};

/// Smallest buffer worth keeping, in bytes.
const MIN_POOLED_BYTES: usize = 1 << 20;
/// Default cap on the bytes the cache holds.
pub const DEFAULT_POOL_BYTES: usize = 1 << 30;
/// Environment variable that overrides the cap, in bytes (0 turns the cache off).
pub const POOL_BYTES_ENV: &str = "DIST_TENSOR_POOL_BYTES";

/// One cached buffer: a `Vec<T>`, fully initialized up to its `len`.
struct Entry {
    elem: TypeId,
    bytes: usize,
    /// When it was given back (a counter): the smallest goes first.
    given: u64,
    buffer: Box<dyn Any + Send>,
}

struct Pool {
    entries: Vec<Entry>,
    bytes: usize,
    cap: usize,
    clock: u64,
}

impl Pool {
    fn new(cap: usize) -> Pool {
        Pool { entries: Vec::new(), bytes: 0, cap, clock: 0 }
    }

    /// The smallest cached buffer of `T` that holds `len` elements and wastes at most half of
    /// itself, truncated to `len`.
    fn take<T: Element>(&mut self, len: usize) -> Option<Vec<T>> {
        let elem = TypeId::of::<T>();
        let (i, _) = self
            .entries
            .iter()
            .enumerate()
            .filter(|(_, e)| e.elem == elem)
            .map(|(i, e)| (i, e.buffer.downcast_ref::<Vec<T>>().expect("keyed by type")))
            .filter(|(_, b)| b.len() >= len && b.capacity() <= 2 * len)
            .min_by_key(|(_, b)| b.capacity())?;
        let entry = self.entries.swap_remove(i);
        self.bytes -= entry.bytes;
        let mut buffer = *entry.buffer.downcast::<Vec<T>>().expect("keyed by type");
        buffer.truncate(len);
        Some(buffer)
    }

    /// Keeps `buffer`, first giving the least recently given buffers to the allocator until it
    /// fits; a buffer larger than the whole cache is not kept (and evicts nothing).
    fn give<T: Element>(&mut self, buffer: Vec<T>) {
        let bytes = buffer.capacity() * size_of::<T>();
        if bytes > self.cap {
            return;
        }
        while self.bytes + bytes > self.cap {
            let (oldest, _) = self
                .entries
                .iter()
                .enumerate()
                .min_by_key(|(_, e)| e.given)
                .expect("the cache holds what it counts");
            self.bytes -= self.entries.swap_remove(oldest).bytes;
        }
        self.clock += 1;
        self.bytes += bytes;
        self.entries.push(Entry {
            elem: TypeId::of::<T>(),
            bytes,
            given: self.clock,
            buffer: Box::new(buffer),
        });
    }
}

/// The cache's capacity from [`POOL_BYTES_ENV`], or an error naming a value that is not a
/// number.
fn env_cap() -> Result<usize> {
    match std::env::var(POOL_BYTES_ENV) {
        Ok(text) => text.trim().parse().map_err(|_| Error::InvalidArgument {
            op: "World::build",
            rank: 0,
            reason: format!("{POOL_BYTES_ENV}={text:?} is not a whole number of bytes"),
        }),
        Err(_) => Ok(DEFAULT_POOL_BYTES),
    }
}

/// Checks [`POOL_BYTES_ENV`]: a world refuses to start on a value that is not a number (the
/// cache itself, made lazily, then caches nothing rather than guess).
pub(crate) fn check_env() -> Result<()> {
    env_cap().map(drop)
}

fn pool() -> &'static Mutex<Pool> {
    static POOL: OnceLock<Mutex<Pool>> = OnceLock::new();
    POOL.get_or_init(|| Mutex::new(Pool::new(env_cap().unwrap_or(0))))
}

fn lock() -> std::sync::MutexGuard<'static, Pool> {
    pool().lock().unwrap_or_else(|e| e.into_inner())
}

/// A buffer of `len` elements for `op`: a cached one that fits (its contents unspecified), or a
/// fresh zeroed one from the allocator.
///
/// # Errors
/// [`Error::OutOfMemory`] naming `op` and the bytes when the allocator refuses the request or its
/// size overflows: never an abort.
pub(crate) fn take<T: Element>(op: &'static str, len: usize) -> Result<Vec<T>> {
    let elems = || format!("{len} elements of {}", short_type_name::<T>());
    let bytes = len.checked_mul(size_of::<T>()).ok_or_else(|| Error::OutOfMemory {
        op,
        bytes: usize::MAX,
        what: format!("{}: the size overflows", elems()),
    })?;
    if bytes >= MIN_POOLED_BYTES
        && let Some(buffer) = lock().take(len)
    {
        return Ok(buffer);
    }
    zeroed(len).ok_or_else(|| Error::OutOfMemory { op, bytes, what: elems() })
}

/// A vector of `len` zeros straight from the allocator (`calloc`: the pages are zeroed when first
/// touched, as `vec![0.0; len]` does), or `None` if the allocator refuses.
pub(crate) fn zeroed<T: Element>(len: usize) -> Option<Vec<T>> {
    let layout = std::alloc::Layout::array::<T>(len).ok()?;
    if layout.size() == 0 {
        return Some(vec![T::zero(); len]);
    }
    // SAFETY: the layout has a non-zero size.
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) } as *mut T;
    if ptr.is_null() {
        return None;
    }
    // SAFETY: `ptr` was allocated by the global allocator with the layout of `len` elements of
    // `T`, and all-zero bytes are the value zero of every element type (f32, f64, f16, bf16).
    Some(unsafe { Vec::from_raw_parts(ptr, len, len) })
}

/// Gives a buffer back for later [`take`]s (or to the allocator, if small or larger than the
/// cache), making room by giving the least recently given buffers to the allocator.
pub(crate) fn give<T: Element>(buffer: Vec<T>) {
    if buffer.capacity() * size_of::<T>() >= MIN_POOLED_BYTES {
        lock().give(buffer);
    }
}

/// Bytes the buffer cache holds now.
///
/// # Examples
/// ```
/// use dist_tensor::{tensor, Tensor};
/// let t = Tensor::<f32>::zeros(&[1 << 20]); // 4 MiB
/// let buffer = t.as_slice().as_ptr();
/// drop(t); // given back to the cache...
/// assert!(tensor::pooled_bytes() >= 4 << 20);
/// let u = Tensor::<f32>::zeros(&[1 << 20]); // ...and taken again
/// assert_eq!(u.as_slice().as_ptr(), buffer);
/// ```
pub fn pooled_bytes() -> usize {
    lock().bytes
}

/// Returns every cached buffer to the allocator.
///
/// # Examples
/// ```
/// use dist_tensor::tensor;
/// tensor::release_pool();
/// assert_eq!(tensor::pooled_bytes(), 0);
/// ```
pub fn release_pool() {
    let mut pool = lock();
    pool.entries.clear();
    pool.bytes = 0;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_given_buffer_is_taken_again_only_when_it_fits() {
        let len = (MIN_POOLED_BYTES / 4) * 3;
        let mut buffer = take::<f32>("test", len).unwrap();
        buffer[0] = 42.0;
        let address = buffer.as_ptr();
        give(buffer);
        let other_type = take::<f64>("test", len / 2).unwrap();
        assert_ne!(other_type.as_ptr() as *const f32, address);
        let smaller = take::<f32>("test", len - 5).unwrap();
        assert_eq!(smaller.as_ptr(), address);
        assert_eq!(smaller.len(), len - 5);
        give(smaller);
        // Far smaller requests do not take a big buffer.
        let far_smaller = take::<f32>("test", len / 3).unwrap();
        assert_ne!(far_smaller.as_ptr(), address);
    }

    /// Regression: a full cache took no more buffers, so once it held other sizes, every call
    /// of a later op page-faulted its outputs in (the unfused Ulysses rows of a long perf_report
    /// slowed down several times over). Now the least recently given buffers make room.
    #[test]
    fn a_full_cache_makes_room_for_the_sizes_used_now() {
        const MIB: usize = 1 << 20;
        let mut pool = Pool::new(4 * MIB);
        let buffer = |mib: usize| vec![0.0f32; mib * MIB / 4];
        // Full of sizes an earlier phase used.
        pool.give(buffer(2));
        pool.give(vec![0.0f64; 2 * MIB / 8]);
        assert_eq!(pool.bytes, 4 * MIB);
        // A later phase gives back 3 MiB buffers: the oldest go, the new one stays...
        let mut now = buffer(3);
        let address = now.as_ptr();
        for _ in 0..3 {
            pool.give(now);
            assert!(pool.bytes <= pool.cap);
            now = pool.take::<f32>(3 * MIB / 4).expect("the size used now is cached");
            assert_eq!(now.as_ptr(), address, "the same buffer every call");
        }
        // ...having evicted both old ones (4 + 3 MiB do not fit in 4).
        pool.give(now);
        assert!(pool.take::<f64>(2 * MIB / 8).is_none());
        assert_eq!((pool.entries.len(), pool.bytes), (1, 3 * MIB));
    }

    /// Least recently given first: a buffer given back again is younger than the others.
    #[test]
    fn the_least_recently_given_buffer_goes_first() {
        const MIB: usize = 1 << 20;
        let mut pool = Pool::new(3 * MIB);
        pool.give(vec![0.0f32; MIB / 4]); // A
        pool.give(vec![0.0f64; MIB / 8]); // B
        let a = pool.take::<f32>(MIB / 4).unwrap();
        pool.give(a); // A again: now the younger
        pool.give(vec![0.0f32; 2 * MIB / 4]); // C needs 2 MiB: B (the oldest) goes
        assert!(pool.take::<f64>(MIB / 8).is_none());
        assert!(pool.take::<f32>(MIB / 4).is_some());
        // A buffer larger than the cache is not kept, and evicts nothing.
        pool.give(vec![0.0f32; 4 * MIB / 4]);
        assert!(pool.take::<f32>(2 * MIB / 4).is_some());
    }

    #[test]
    fn a_request_the_machine_cannot_hold_is_an_error_naming_op_and_bytes() {
        let err = take::<f64>("demo", usize::MAX / 4).unwrap_err().to_string();
        assert!(err.contains("demo: out of memory") && err.contains("overflows"), "{err}");
        let err = take::<f32>("demo", 1 << 60).unwrap_err().to_string(); // 4 EiB
        assert!(
            err.contains("demo: out of memory: cannot allocate 4611686018427387904 bytes"),
            "{err}"
        );
    }
}
