//! Symmetric buffers and the pointers kernels use: remote pointers are plain pointers.
//!
//! Three pointer types carry the seed's rules:
//! - [`SymmPtr`] points into symmetric memory, local or a peer's. It can be written (stores,
//!   copies) but not read: reading symmetric memory needs a [`Token`] from a wait or a barrier,
//!   through [`consume_token`] (rule 3).
//! - [`GlobalPtr`] points at memory a program may read: a local tensor, or symmetric memory after
//!   [`consume_token`] (as [`GlobalPtrMut`]).
//! - [`GlobalPtrMut`] may also be written.
//!
//! [`symm_at`] takes a buffer handle, never a pointer, so an offset can only be added after it
//! (rule 1); the local buffer's own pointer is [`SymmBuf::ptr`], equal to `symm_at(buf, my_rank)`
//! (rule 2).

use std::marker::PhantomData;
use std::sync::Arc;

use super::heap::Heap;
use super::signal::Token;
use crate::tensor::Pod;

/// A symmetric allocation: the same offset in every rank's heap segment, `len` elements long.
///
/// Made by [`Rank::alloc`](crate::Rank::alloc), collectively. Dropping it returns the space to the
/// rank's heap; peers must be done writing into it first (a later collective allocation, which
/// includes a barrier, cannot complete before they are).
///
/// # Examples
/// ```
/// use dist_tensor::{shmem::symm_at, World};
///
/// let offsets = World::threads(2)?.run(|rank| {
///     let buf = rank.alloc::<f32>(1000)?;
///     assert_eq!(symm_at(&buf, rank.rank()), buf.ptr()); // rule 2
///     Ok(buf.offset())
/// })?;
/// assert_eq!(offsets[0], offsets[1]);
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub struct SymmBuf<T: Pod> {
    heap: Arc<Heap>,
    owner: usize,
    offset: usize,
    len: usize,
    _elem: PhantomData<T>,
}

impl<T: Pod> SymmBuf<T> {
    pub(crate) fn new(heap: Arc<Heap>, owner: usize, offset: usize, len: usize) -> Self {
        SymmBuf { heap, owner, offset, len, _elem: PhantomData }
    }

    /// Number of elements.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::World;
    /// World::threads(2)?.run(|rank| {
    ///     assert_eq!(rank.alloc::<f32>(10)?.len(), 10);
    ///     Ok(())
    /// })?;
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no elements.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::World;
    /// World::threads(1)?.run(|rank| {
    ///     assert!(rank.alloc::<u8>(0)?.is_empty());
    ///     assert!(!rank.alloc::<u8>(1)?.is_empty());
    ///     Ok(())
    /// })?;
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Byte offset of the buffer in every rank's segment.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::World;
    /// let offsets = World::threads(3)?.run(|rank| Ok(rank.alloc::<u32>(64)?.offset()))?;
    /// assert!(offsets.iter().all(|&o| o == offsets[0])); // the same on every rank
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// The local buffer's base pointer (rule 2: no `symm_at` needed for the local rank).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{shmem::symm_at, World};
    /// World::threads(2)?.run(|rank| {
    ///     let buf = rank.alloc::<f64>(8)?;
    ///     assert_eq!(buf.ptr(), symm_at(&buf, rank.rank()));
    ///     assert_eq!(buf.ptr().len(), 8);
    ///     Ok(())
    /// })?;
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn ptr(&self) -> SymmPtr<'_, T> {
        self.at(self.owner)
    }

    fn at(&self, rank: usize) -> SymmPtr<'_, T> {
        let base = self.heap.base(rank);
        // SAFETY: offset + len * size_of::<T>() lies inside the segment: the heap handed it out.
        let ptr = unsafe { base.add(self.offset) } as *mut T;
        SymmPtr { ptr, len: self.len, _buf: PhantomData }
    }
}

impl<T: Pod> Drop for SymmBuf<T> {
    fn drop(&mut self) {
        self.heap.free(self.owner, self.offset, self.len * size_of::<T>());
    }
}

impl<T: Pod> std::fmt::Debug for SymmBuf<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SymmBuf")
            .field("rank", &self.owner)
            .field("offset", &self.offset)
            .field("len", &self.len)
            .field("type", &std::any::type_name::<T>())
            .finish()
    }
}

/// The base pointer of `buf` in `peer`'s segment: a remote pointer that is a plain pointer.
///
/// It takes the buffer handle itself, so an offset pointer cannot be passed (rule 1):
/// ```compile_fail,E0308
/// use dist_tensor::{shmem::symm_at, World};
/// World::threads(2)?.run(|rank| {
///     let buf = rank.alloc::<f32>(64)?;
///     let wrong = symm_at(&(buf.ptr() + 8), 1); // an offset pointer: does not compile
///     Ok(())
/// })?;
/// # Ok::<(), dist_tensor::Error>(())
/// ```
///
/// # Panics
/// If `peer` is not a rank of the buffer's world (a programmer mistake inside a kernel; the
/// panic fails the launch and the world, it does not hang it). If `peer` is on another node of a
/// world joined by MPI, where no pointer to its memory exists: the panic carries
/// [`Error::PeerNotLocal`](crate::Error::PeerNotLocal), which the launch and
/// [`World::run`](crate::World::run) return typed. Ask [`Rank::is_local`](crate::Rank::is_local)
/// first, or use [`try_symm_at`]; data reaches such a peer through
/// [`Rank::put_signal`](crate::Rank::put_signal).
///
/// # Examples
/// ```
/// use dist_tensor::shmem::symm_at;
/// use dist_tensor::device::tile;
/// use dist_tensor::World;
///
/// World::threads(2)?.run(|rank| {
///     let buf = rank.alloc::<f64>(4)?;
///     let peer = (rank.rank() + 1) % rank.num_ranks();
///     // Offsets come after symm_at.
///     // SAFETY: nobody reads the buffer in this example.
///     unsafe { tile::store_1d(symm_at(&buf, peer) + 1, &[rank.rank() as f64], 1) };
///     let _ = rank.barrier_all()?;
///     Ok(())
/// })?;
/// # Ok::<(), dist_tensor::Error>(())
/// ```
#[track_caller]
pub fn symm_at<T: Pod>(buf: &SymmBuf<T>, peer: usize) -> SymmPtr<'_, T> {
    match try_symm_at(buf, peer) {
        Ok(ptr) => ptr,
        Err(err @ crate::Error::PeerNotLocal { .. }) => std::panic::panic_any(err),
        Err(err) => panic!("{err}"),
    }
}

/// [`symm_at`] as a `Result`: the peer's copy of `buf`, or an error for a peer with no pointer
/// here.
///
/// # Errors
/// [`Error::PeerNotLocal`](crate::Error::PeerNotLocal) for a peer on another node of a world
/// joined by MPI; [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a rank outside
/// the world.
///
/// # Examples
/// ```
/// use dist_tensor::shmem::{symm_at, try_symm_at};
/// use dist_tensor::World;
/// World::threads(2)?.run(|rank| {
///     let buf = rank.alloc::<f32>(4)?;
///     assert_eq!(try_symm_at(&buf, 1)?, symm_at(&buf, 1)); // every rank of a thread world is local
///     assert!(try_symm_at(&buf, 2).is_err());
///     Ok(())
/// })?;
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn try_symm_at<T: Pod>(buf: &SymmBuf<T>, peer: usize) -> crate::Result<SymmPtr<'_, T>> {
    let n = buf.heap.num_ranks();
    if peer >= n {
        return Err(crate::Error::InvalidArgument {
            op: "symm_at",
            rank: buf.owner,
            reason: format!("rank {peer} is outside a world of {n} ranks"),
        });
    }
    if !buf.heap.mapped(peer) {
        return Err(crate::Error::PeerNotLocal { op: "symm_at", rank: buf.owner, peer });
    }
    Ok(buf.at(peer))
}

/// Makes symmetric memory that a wait or barrier has synchronized readable (rule 3). Costs nothing
/// at run time: it only ties the read to the token.
///
/// Without it, symmetric memory cannot be read at all:
/// ```compile_fail,E0277
/// use dist_tensor::{device::tile, World};
/// World::threads(1)?.run(|rank| {
///     let buf = rank.alloc::<f32>(4)?;
///     let _token = rank.barrier_all()?;
///     let mut out = [0.0f32; 4];
///     // SymmPtr is not readable: does not compile (the unsafe block is not what is missing)
///     unsafe { tile::load_1d(buf.ptr(), &mut out, 4, 0.0) };
///     Ok(())
/// })?;
/// # Ok::<(), dist_tensor::Error>(())
/// ```
///
/// # Examples
/// ```
/// use dist_tensor::shmem::{consume_token, symm_at, NotifySem, Scope, SignalOp, WaitCmp, WaitSem};
/// use dist_tensor::device::tile;
/// use dist_tensor::World;
///
/// let seen = World::threads(2)?.run(|rank| {
///     let data = rank.alloc::<f32>(1)?;
///     let ready = rank.alloc_signals(1)?;
///     let peer = 1 - rank.rank();
///     // SAFETY: the peer reads `data` only after the release notify below.
///     unsafe { tile::store_1d(symm_at(&data, peer), &[10.0 + rank.rank() as f32], 1) };
///     rank.notify(&ready, 0, peer, SignalOp::Set(1), Scope::Peer, NotifySem::Release)?;
///     let token = rank.wait(&ready, 0, WaitCmp::Eq(1), WaitSem::Acquire)?;
///     let mut got = [0.0f32];
///     // SAFETY: the peer wrote `data` before its release notify, acquired by the wait.
///     unsafe { tile::load_1d(consume_token(data.ptr(), token), &mut got, 1, 0.0) };
///     let _ = rank.barrier_all()?; // nobody frees `data` while the peer may still write it
///     Ok(got[0])
/// })?;
/// assert_eq!(seen, vec![11.0, 10.0]);
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn consume_token<T: Pod>(ptr: SymmPtr<'_, T>, token: Token) -> GlobalPtrMut<'_, T> {
    let _ = token;
    GlobalPtrMut { ptr: ptr.ptr, len: ptr.len, _mem: PhantomData }
}

/// A pointer into symmetric memory (local or a peer's): writable, readable only through
/// [`consume_token`]. `add` moves it; every access is bounds-checked against the buffer.
pub struct SymmPtr<'a, T> {
    ptr: *mut T,
    len: usize,
    _buf: PhantomData<&'a ()>,
}

impl<'a> SymmPtr<'a, u8> {
    /// The same bytes as elements of `T` (whole elements only).
    ///
    /// # Panics
    /// If the address is not aligned for `T`.
    #[track_caller]
    pub(crate) fn cast<T>(self) -> SymmPtr<'a, T> {
        assert!(self.ptr.cast::<T>().is_aligned(), "symmetric bytes not aligned for the type");
        SymmPtr { ptr: self.ptr.cast(), len: self.len / size_of::<T>().max(1), _buf: PhantomData }
    }
}

/// A pointer to memory a program may read: a local tensor, or consumed symmetric memory.
pub struct GlobalPtr<'a, T> {
    ptr: *const T,
    len: usize,
    _mem: PhantomData<&'a [T]>,
}

/// A pointer to memory a program may read and write: a local output tensor, or consumed
/// symmetric memory. Copies of it alias: programs must write disjoint parts.
pub struct GlobalPtrMut<'a, T> {
    ptr: *mut T,
    len: usize,
    _mem: PhantomData<&'a mut [T]>,
}

macro_rules! pointer_common {
    ($name:ident) => {
        impl<T> std::ops::Add<usize> for $name<'_, T> {
            type Output = Self;

            /// The pointer `n` elements further on: `ptr + offs`, as in the seed.
            ///
            /// # Panics
            /// If that is past the end of the memory the pointer came from.
            #[track_caller]
            fn add(self, n: usize) -> Self {
                assert!(
                    n <= self.len,
                    concat!(stringify!($name), " + {}: past the end ({} elements)"),
                    n,
                    self.len
                );
                // SAFETY: n <= len, so the result is inside or one past the end of the memory.
                Self { ptr: unsafe { self.ptr.add(n) }, len: self.len - n, ..self }
            }
        }

        impl<'a, T> $name<'a, T> {
            /// Elements from here to the end of the memory.
            ///
            /// # Examples
            /// ```
            /// use dist_tensor::shmem::GlobalPtr;
            /// let data = [1, 2, 3];
            /// let p = GlobalPtr::from_slice(&data);
            /// assert_eq!(p.len(), 3);
            /// assert_eq!((p + 2).len(), 1);
            /// ```
            pub fn len(&self) -> usize {
                self.len
            }

            /// Whether no element is left.
            ///
            /// # Examples
            /// ```
            /// use dist_tensor::shmem::GlobalPtr;
            /// let data = [1.0f32, 2.0];
            /// let p = GlobalPtr::from_slice(&data);
            /// assert!(!p.is_empty());
            /// assert!((p + 2).is_empty());
            /// ```
            pub fn is_empty(&self) -> bool {
                self.len == 0
            }
        }

        impl<T> Clone for $name<'_, T> {
            fn clone(&self) -> Self {
                *self
            }
        }

        impl<T> Copy for $name<'_, T> {}

        impl<T> PartialEq for $name<'_, T> {
            fn eq(&self, other: &Self) -> bool {
                std::ptr::eq(self.ptr, other.ptr) && self.len == other.len
            }
        }

        impl<T> Eq for $name<'_, T> {}

        impl<T> std::fmt::Debug for $name<'_, T> {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, concat!(stringify!($name), "({:p}, len {})"), self.ptr, self.len)
            }
        }

        // SAFETY: these are addresses, like raw pointers; every access through them is an
        // `unsafe` tile operation whose caller upholds the access contract (see `device::tile`).
        unsafe impl<T: Send> Send for $name<'_, T> {}
        // SAFETY: as above.
        unsafe impl<T: Sync> Sync for $name<'_, T> {}
    };
}

pointer_common!(SymmPtr);
pointer_common!(GlobalPtr);
pointer_common!(GlobalPtrMut);

impl<'a, T> GlobalPtr<'a, T> {
    /// Points at the start of `data`.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::shmem::GlobalPtr;
    /// let data = [1.0f32, 2.0, 3.0];
    /// assert_eq!((GlobalPtr::from_slice(&data) + 1).len(), 2);
    /// ```
    pub fn from_slice(data: &'a [T]) -> Self {
        GlobalPtr { ptr: data.as_ptr(), len: data.len(), _mem: PhantomData }
    }
}

impl<'a, T> GlobalPtrMut<'a, T> {
    /// Points at the start of `data`, which kernels then write through copies of the pointer.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::shmem::GlobalPtrMut;
    /// let mut data = [0.0f32; 3];
    /// assert_eq!(GlobalPtrMut::from_slice(&mut data).len(), 3);
    /// ```
    pub fn from_slice(data: &'a mut [T]) -> Self {
        GlobalPtrMut { ptr: data.as_mut_ptr(), len: data.len(), _mem: PhantomData }
    }
}

impl<'a, T> From<GlobalPtrMut<'a, T>> for GlobalPtr<'a, T> {
    fn from(p: GlobalPtrMut<'a, T>) -> Self {
        GlobalPtr { ptr: p.ptr, len: p.len, _mem: PhantomData }
    }
}

mod sealed {
    pub trait Sealed {}
    impl<T> Sealed for super::SymmPtr<'_, T> {}
    impl<T> Sealed for super::GlobalPtr<'_, T> {}
    impl<T> Sealed for super::GlobalPtrMut<'_, T> {}
}

/// Pointers tile operations may read through: [`GlobalPtr`] and [`GlobalPtrMut`], never a
/// [`SymmPtr`] that no token has made readable.
pub trait Readable<T>: Copy + sealed::Sealed {
    /// Address and the number of elements readable from it.
    #[doc(hidden)]
    fn raw_read(self) -> (*const T, usize);
}

/// Pointers tile operations may write through: [`SymmPtr`] and [`GlobalPtrMut`].
pub trait Writable<T>: Copy + sealed::Sealed {
    /// Address and the number of elements writable from it.
    #[doc(hidden)]
    fn raw_write(self) -> (*mut T, usize);
}

impl<T> Readable<T> for GlobalPtr<'_, T> {
    fn raw_read(self) -> (*const T, usize) {
        (self.ptr, self.len)
    }
}

impl<T> Readable<T> for GlobalPtrMut<'_, T> {
    fn raw_read(self) -> (*const T, usize) {
        (self.ptr, self.len)
    }
}

impl<T> Writable<T> for GlobalPtrMut<'_, T> {
    fn raw_write(self) -> (*mut T, usize) {
        (self.ptr, self.len)
    }
}

impl<T> Writable<T> for SymmPtr<'_, T> {
    fn raw_write(self) -> (*mut T, usize) {
        (self.ptr, self.len)
    }
}
