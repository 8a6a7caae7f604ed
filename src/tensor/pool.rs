//! A cache of large element buffers, so that the outputs of one call reuse the memory freed by the
//! previous one.
//!
//! A fresh large output costs page faults (the kernel maps and zeroes every 4 KiB page on first
//! touch), which can take longer than the copy that fills it. Tensors give their buffers back here when dropped, and ops take their outputs from here, so a
//! loop of calls touches fresh pages only on its first iteration. Buffers under 1 MiB are left to
//! the allocator; the cache holds at most [`DEFAULT_POOL_BYTES`] (or `DIST_TENSOR_POOL_BYTES`).

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use super::Element;

/// Smallest buffer worth keeping, in bytes.
const MIN_POOLED_BYTES: usize = 1 << 20;
/// Default cap on the bytes the cache holds.
pub const DEFAULT_POOL_BYTES: usize = 1 << 30;
/// Environment variable that overrides the cap, in bytes (0 turns the cache off).
pub const POOL_BYTES_ENV: &str = "DIST_TENSOR_POOL_BYTES";

struct Pool {
    /// Per element type: `Vec<Vec<T>>`, every buffer fully initialized up to its `len`.
    buffers: HashMap<TypeId, Box<dyn Any + Send>>,
    bytes: usize,
    cap: usize,
}

fn pool() -> &'static Mutex<Pool> {
    static POOL: OnceLock<Mutex<Pool>> = OnceLock::new();
    POOL.get_or_init(|| {
        let cap = std::env::var(POOL_BYTES_ENV)
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(DEFAULT_POOL_BYTES);
        Mutex::new(Pool { buffers: HashMap::new(), bytes: 0, cap })
    })
}

fn lock() -> std::sync::MutexGuard<'static, Pool> {
    pool().lock().unwrap_or_else(|e| e.into_inner())
}

fn buffers_of<T: Element>(pool: &mut Pool) -> &mut Vec<Vec<T>> {
    pool.buffers
        .entry(TypeId::of::<T>())
        .or_insert_with(|| Box::new(Vec::<Vec<T>>::new()))
        .downcast_mut()
        .expect("keyed by the element type")
}

/// A buffer of `len` elements whose values are unspecified (zeros, or what a dropped tensor
/// held): for outputs that a kernel overwrites entirely.
pub(crate) fn take<T: Element>(len: usize) -> Vec<T> {
    if len * size_of::<T>() >= MIN_POOLED_BYTES {
        let mut pool = lock();
        let buffers = buffers_of::<T>(&mut pool);
        // The smallest cached buffer that fits and wastes at most half of itself.
        let best = buffers
            .iter()
            .enumerate()
            .filter(|(_, b)| b.len() >= len && b.capacity() <= 2 * len)
            .min_by_key(|(_, b)| b.capacity())
            .map(|(i, _)| i);
        if let Some(i) = best {
            let mut buffer = buffers.swap_remove(i);
            pool.bytes -= buffer.capacity() * size_of::<T>();
            buffer.truncate(len);
            return buffer;
        }
    }
    vec![T::zero(); len]
}

/// Gives a buffer back for later [`take`]s (or to the allocator, if small or the cache is full).
pub(crate) fn give<T: Element>(buffer: Vec<T>) {
    let bytes = buffer.capacity() * size_of::<T>();
    if bytes < MIN_POOLED_BYTES {
        return;
    }
    let mut pool = lock();
    if pool.bytes + bytes <= pool.cap {
        pool.bytes += bytes;
        buffers_of::<T>(&mut pool).push(buffer);
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
    pool.buffers.clear();
    pool.bytes = 0;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_given_buffer_is_taken_again_only_when_it_fits() {
        let len = (MIN_POOLED_BYTES / 4) * 3;
        let mut buffer = take::<f32>(len);
        buffer[0] = 42.0;
        let address = buffer.as_ptr();
        give(buffer);
        let other_type = take::<f64>(len / 2);
        assert_ne!(other_type.as_ptr() as *const f32, address);
        let smaller = take::<f32>(len - 5);
        assert_eq!(smaller.as_ptr(), address);
        assert_eq!(smaller.len(), len - 5);
        give(smaller);
        // Far smaller requests do not take a big buffer.
        let far_smaller = take::<f32>(len / 3);
        assert_ne!(far_smaller.as_ptr(), address);
    }
}
