//! One rank's NPU: its context, stream and communicator, the device memory its ops keep between
//! calls (plain and symmetric), the kernels loaded on it, and the launch of one kernel.
//!
//! A rank's state is used only from that rank's thread during [`World::run`](crate::World::run);
//! each op first binds the rank's context to the calling thread ([`AscendRank::bind`]), since
//! CANN keeps the current context per thread.

use std::collections::HashMap;
use std::ffi::{CString, c_void};
use std::sync::{Mutex, MutexGuard};

use super::kernels::{self, KernelArgs, KernelSource, STATUS_BYTES};
use super::result;
use super::world::{AscendWorld, PathTaken};
use crate::error::ProgramLabel;
use crate::shmem::Rank;
use crate::{DType, Element, Error, Result};

/// Locks a mutex whose data stays consistent even if a holder panicked.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A runtime handle or device address: an opaque pointer the runtime hands out. It is not tied
/// to a thread (the runtime's calls take the handle, plus the thread's current context), so it
/// may be kept in state shared by the world's threads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Handle(pub(crate) *mut c_void);

// SAFETY: a `Handle` is only an address; every use goes through a runtime call that the caller
// makes on the owning rank's thread with its context bound.
unsafe impl Send for Handle {}
// SAFETY: as above; nothing is read through it on the host.
unsafe impl Sync for Handle {}

impl Handle {
    pub(crate) const NULL: Handle = Handle(std::ptr::null_mut());

    /// The address `elems` elements of `T` further on.
    pub(crate) fn add<T>(self, elems: usize) -> Handle {
        Handle(self.0.cast::<u8>().wrapping_add(elems * size_of::<T>()).cast())
    }
}

/// What a rank keeps between calls.
#[derive(Default)]
pub(crate) struct RankState {
    /// Plain device memory, by role: `(address, bytes)`.
    buffers: HashMap<&'static str, (Handle, usize)>,
    /// Symmetric memory (Ascend SHMEM), by role: `(address, bytes)`.
    symmetric: HashMap<&'static str, (Handle, usize)>,
    /// Cumulative signal counts each op has announced, by op.
    pub(crate) counts: HashMap<&'static str, Vec<u64>>,
    /// Loaded binaries and their entry points, by kernel and compile options.
    functions: HashMap<(&'static str, String), (Handle, Handle)>,
    /// Which path the rank's last op took.
    pub(crate) last_path: Option<PathTaken>,
}

/// One rank of an Ascend world: its device and the handles made for it.
pub(crate) struct AscendRankHandles {
    pub(crate) device: u32,
    pub(crate) context: Handle,
    pub(crate) stream: Handle,
    pub(crate) comm: Handle,
    pub(crate) state: Mutex<RankState>,
}

/// A rank of a running world, on its NPU: what the launchers work with.
pub(crate) struct AscendRank<'a> {
    pub(crate) world: &'a AscendWorld,
    pub(crate) rank: &'a Rank<'a>,
}

impl<'a> AscendRank<'a> {
    /// This rank's NPU state.
    pub(crate) fn npu(&self) -> &'a AscendRankHandles {
        &self.world.ranks[self.rank.rank()]
    }

    /// Binds the rank's context (and device) to the calling thread.
    pub(crate) fn bind(&self) -> Result<()> {
        // SAFETY: the context was made by `aclrtCreateContext` when the world was built and
        // lives until the world is dropped, after every run.
        unsafe { result::runtime::set_current_context(self.world.acl(), self.npu().context.0) }
    }

    /// Records which path this rank's op took.
    pub(crate) fn took(&self, path: PathTaken) {
        lock(&self.npu().state).last_path = Some(path);
    }

    /// Plain device memory of at least `bytes` for `role`, kept and grown (by half again) across
    /// calls. Its contents are whatever it held.
    pub(crate) fn buffer(&self, role: &'static str, bytes: usize) -> Result<Handle> {
        let acl = self.world.acl();
        let mut state = lock(&self.npu().state);
        let old = state.buffers.get(role).copied();
        if let Some((ptr, have)) = old {
            if have >= bytes {
                return Ok(ptr);
            }
            state.buffers.remove(role);
            // SAFETY: the buffer is this rank's, and no queued work uses it (every op
            // synchronises its stream before returning).
            unsafe { result::runtime::free(acl, ptr.0) }?;
        }
        let grown = bytes.max(old.map_or(0, |(_, have)| have * 3 / 2)).max(1);
        let ptr = Handle(result::runtime::malloc(acl, grown)?);
        state.buffers.insert(role, (ptr, grown));
        Ok(ptr)
    }

    /// Copies `data` into the device buffer for `role` (grown to fit) and returns its address.
    pub(crate) fn upload<T: Copy>(&self, role: &'static str, data: &[T]) -> Result<Handle> {
        let bytes = std::mem::size_of_val(data);
        let ptr = self.buffer(role, bytes)?;
        // SAFETY: `data` is valid for `bytes` reads; the buffer holds at least `bytes`.
        unsafe {
            result::runtime::copy_to_device(self.world.acl(), ptr.0, data.as_ptr().cast(), bytes)
        }?;
        Ok(ptr)
    }

    /// Copies `len` elements of `T` from device memory `src` into a new vector.
    pub(crate) fn download<T: Element>(&self, src: Handle, len: usize) -> Result<Vec<T>> {
        let mut out = vec![T::zero(); len];
        // SAFETY: `out` is valid for `len` elements; `src` is device memory of this rank that a
        // kernel filled with `len` elements (the launcher sized it).
        unsafe {
            result::runtime::copy_to_host(
                self.world.acl(),
                out.as_mut_ptr().cast(),
                src.0,
                len * size_of::<T>(),
            )
        }?;
        Ok(out)
    }

    /// Symmetric memory of at least `bytes` for `role`: the same offset on every rank, so a
    /// kernel reaches a peer's copy with `symm_at`. Collective: every rank calls it with the same
    /// `bytes` (derived from exchanged shapes) in the same order; kept and grown across calls.
    ///
    /// # Errors
    /// [`Error::DeviceUnavailable`] when the world has no Ascend SHMEM (the fused kernels need
    /// it); [`Error::DeviceStatus`] when the heap is full.
    pub(crate) fn symmetric(
        &self,
        op: &'static str,
        role: &'static str,
        bytes: usize,
    ) -> Result<Handle> {
        let shmem = self.world.shmem(op)?;
        let mut state = lock(&self.npu().state);
        let old = state.symmetric.get(role).copied();
        if let Some((ptr, have)) = old {
            if have >= bytes {
                return Ok(ptr);
            }
            state.symmetric.remove(role);
            // SAFETY: every rank frees the same allocation here (same role, same sizes), and no
            // kernel uses it: each rank synchronised its stream at the end of its last op, and
            // the shape exchange of this op came after that on every rank.
            unsafe { result::shmem::free(shmem, ptr.0) };
        }
        let grown = bytes.max(old.map_or(0, |(_, have)| have * 3 / 2)).max(1);
        let ptr = Handle(result::shmem::malloc(shmem, grown)?);
        state.symmetric.insert(role, (ptr, grown));
        Ok(ptr)
    }

    /// `len` int32 signals in symmetric memory for `op`, zero when first made and never reset
    /// (the counts only grow). The first call allocates, zeroes and then waits for every rank
    /// (a host barrier), so no peer signals into memory that is not yet zero.
    pub(crate) fn signals(&self, op: &'static str, len: usize) -> Result<Handle> {
        let role = op;
        let fresh = !lock(&self.npu().state).symmetric.contains_key(role);
        let ptr = self.symmetric(op, role, len * size_of::<i32>())?;
        if fresh {
            let zeros = vec![0i32; len];
            // SAFETY: the allocation holds `len` int32s, on this rank's device.
            unsafe {
                result::runtime::copy_to_device(
                    self.world.acl(),
                    ptr.0,
                    zeros.as_ptr().cast(),
                    len * size_of::<i32>(),
                )
            }?;
            let _ = self.rank.barrier_all()?;
        }
        Ok(ptr)
    }

    /// The cumulative counts `op` keeps (`len` of them, zero at first).
    pub(crate) fn with_counts<R>(
        &self,
        op: &'static str,
        len: usize,
        f: impl FnOnce(&mut Vec<u64>) -> R,
    ) -> R {
        let mut state = lock(&self.npu().state);
        let counts = state.counts.entry(op).or_insert_with(|| vec![0; len]);
        f(counts)
    }

    /// The status record kernels report a timed-out wait in (zeroed when made).
    fn status(&self) -> Result<Handle> {
        let fresh = !lock(&self.npu().state).buffers.contains_key("status");
        let ptr = self.buffer("status", STATUS_BYTES)?;
        if fresh {
            self.clear_status(ptr)?;
        }
        Ok(ptr)
    }

    fn clear_status(&self, ptr: Handle) -> Result<()> {
        let zeros = [0u8; STATUS_BYTES];
        // SAFETY: the status buffer holds STATUS_BYTES.
        unsafe {
            result::runtime::copy_to_device(self.world.acl(), ptr.0, zeros.as_ptr(), STATUS_BYTES)
        }
    }

    /// The loaded entry point of `source` for element type `dtype` on this rank's device:
    /// compiled at first use (once for the world, with the device's architecture and the element
    /// type as options), loaded on this device once.
    fn function(&self, op: &'static str, source: &KernelSource, dtype: DType) -> Result<Handle> {
        let options = self.world.compile_options(op, dtype)?;
        let key = (source.name(), options.join(" "));
        if let Some(&(_, func)) = lock(&self.npu().state).functions.get(&key) {
            return Ok(func);
        }
        let rtc = self.world.rtc(op)?;
        let binary = self.world.kernels.binary(rtc, source, &options)?;
        let acl = self.world.acl();
        let bin = Handle(result::runtime::binary_load(acl, &binary)?);
        let name = CString::new(source.name()).expect("kernel names have no NUL");
        // SAFETY: `bin` was just loaded on this rank's device (its context is bound).
        let func = Handle(unsafe { result::runtime::binary_get_function(acl, bin.0, &name) }?);
        lock(&self.npu().state).functions.insert(key, (bin, func));
        Ok(func)
    }

    /// Launches `source` for `T` with `args` on this rank's stream, on every core of its kind
    /// (the AI cores for a mix kernel, the vector cores otherwise), and waits for it: with the
    /// world's wait timeout plus a margin, so that a kernel waiting on a peer that never comes
    /// reports (through the status record) rather than hangs.
    ///
    /// # Errors
    /// [`Error::WaitTimeout`] naming the program, signal and values when a wait in the kernel
    /// timed out; the compile, load and launch errors of the calls on the way.
    pub(crate) fn launch<T: Element>(
        &self,
        op: &'static str,
        source: &KernelSource,
        args: KernelArgs,
    ) -> Result<()> {
        let func = self.function(op, source, T::DTYPE)?;
        let values = args.finish().map_err(|e| match e {
            Error::InvalidArgument { op, reason, .. } => {
                Error::InvalidArgument { op, rank: self.rank.rank(), reason }
            }
            other => other,
        })?;
        let acl = self.world.acl();
        let topology = self.rank.topology();
        let blocks = kernels::blocks(source, topology.aicore_num(), topology.sub_vec_num());
        let stream = self.npu().stream;
        // SAFETY: `func` is loaded on this device; the arguments are device addresses this
        // rank owns (kept in its state until the world is dropped) and scalars; the stream is
        // synchronised below, before any of them is reused.
        unsafe {
            let list = result::runtime::kernel_args_init(acl, func.0)?;
            for value in &values {
                result::runtime::kernel_args_append(acl, list, value)?;
            }
            result::runtime::kernel_args_finalize(acl, list)?;
            result::runtime::launch(acl, func.0, blocks, stream.0, list)?;
            result::runtime::synchronize_stream(acl, stream.0, self.world.sync_timeout())?;
        }
        self.check_status()
    }

    /// The status record's timeout, if a wait of the last kernel timed out (the record is
    /// cleared for the next launch).
    fn check_status(&self) -> Result<()> {
        let ptr = self.status()?;
        let record: Vec<i64> = {
            let mut words = [0i64; STATUS_BYTES / 8];
            // SAFETY: the status buffer holds STATUS_BYTES, on this rank's device.
            unsafe {
                result::runtime::copy_to_host(
                    self.world.acl(),
                    words.as_mut_ptr().cast(),
                    ptr.0,
                    STATUS_BYTES,
                )
            }?;
            words.to_vec()
        };
        if record[0] == 0 {
            return Ok(());
        }
        self.clear_status(ptr)?;
        let count = |v: i64| usize::try_from(v).unwrap_or(0);
        Err(Error::WaitTimeout {
            rank: self.rank.rank(),
            program: ProgramLabel::Program { id: count(record[1]), sub_vec: count(record[2]) },
            signal: count(record[3]),
            awaited: format!(">= {}", record[4]),
            seen: u64::try_from(record[5]).unwrap_or(0),
            timeout: self.rank.wait_timeout(),
        })
    }

    /// The status record's address, for a kernel's `status` argument.
    pub(crate) fn status_ptr(&self) -> Result<Handle> {
        self.status()
    }

    /// The kernels' wait budget, in device cycles.
    pub(crate) fn timeout_cycles(&self) -> usize {
        self.world.timeout_cycles()
    }
}

impl AscendRankHandles {
    /// Frees everything the rank's ops kept on its device (its context bound), except the
    /// symmetric memory, which Ascend SHMEM's finalisation releases.
    pub(crate) fn release(&self, world: &AscendWorld) {
        let acl = world.acl();
        let mut state = lock(&self.state);
        for (_, (ptr, _)) in state.buffers.drain() {
            // SAFETY: no work is queued (every op synchronised); nothing uses the buffer again.
            let _ = unsafe { result::runtime::free(acl, ptr.0) };
        }
        for (_, (bin, _)) in state.functions.drain() {
            // SAFETY: as above, for the loaded binaries.
            let _ = unsafe { result::runtime::binary_unload(acl, bin.0) };
        }
        state.symmetric.clear();
    }
}

impl<'w> Rank<'w> {
    /// This rank's NPU, when the world runs on Ascend NPUs; `None` on a host world.
    pub(crate) fn ascend(&self) -> Option<AscendRank<'_>> {
        match self.device_world() {
            crate::device::DeviceWorld::Ascend(world) => Some(AscendRank { world, rank: self }),
            _ => None,
        }
    }
}
