//! Memory the ranks share: one mapping, anonymous (ranks that are threads of this process) or
//! backed by a memfd (ranks that are processes, which receive the fd and map it themselves).

use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use memmap2::{MmapMut, MmapOptions};

/// A shared, writable mapping; its base address never changes while it lives.
pub(crate) struct Mapping {
    map: MmapMut,
    /// The memfd behind it, for a process world (kept to hand to peers); `None` when anonymous.
    fd: Option<OwnedFd>,
}

// SAFETY: the mapping is plain memory; every access through its base pointer goes through the
// atomics and pointer types of `shmem`, whose users synchronize through signals.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// An anonymous mapping of `len` bytes, zero-filled: pages that are never touched cost nothing.
    pub(crate) fn anonymous(len: usize) -> std::io::Result<Mapping> {
        Ok(Mapping { map: MmapMut::map_anon(len)?, fd: None })
    }

    /// A new memfd of `len` bytes (sparse: zero-filled on first touch), mapped shared. A memfd has
    /// no name in any file system, so nothing is left behind when every process is gone.
    pub(crate) fn memfd(name: &str, len: usize) -> std::io::Result<Mapping> {
        use rustix::fs::{MemfdFlags, SealFlags};
        let fd = rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)?;
        rustix::fs::ftruncate(&fd, len as u64)?;
        // Its size is fixed for good: no process that holds it can shrink it under a peer's
        // mapping (a read past the end of a memfd is a SIGBUS, not an error).
        rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)?;
        Self::from_fd(fd, len)
    }

    /// Maps `len` bytes of a memfd that a peer created and passed over: only a memfd sealed
    /// against shrinking, of at least `len` bytes.
    pub(crate) fn from_fd(fd: OwnedFd, len: usize) -> std::io::Result<Mapping> {
        let seals = rustix::fs::fcntl_get_seals(&fd).map_err(|e| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("a shared segment that is not a sealed memfd ({e})"),
            )
        })?;
        if !seals.contains(rustix::fs::SealFlags::SHRINK) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "a shared segment whose size is not sealed: its owner could shrink it under this \
                 process's mapping",
            ));
        }
        let file = File::from(fd);
        let size = file.metadata()?.len();
        if size < len as u64 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("a shared segment of {size} bytes where {len} were expected"),
            ));
        }
        // SAFETY: the memfd is only ever used as shared memory by the ranks of one world, which
        // access it through atomics and synchronized pointers, never as a Rust reference to
        // bytes that another process changes underneath.
        let map = unsafe { MmapOptions::new().len(len).map_mut(&file)? };
        Ok(Mapping { map, fd: Some(file.into()) })
    }

    pub(crate) fn base(&self) -> *mut u8 {
        self.map.as_ptr() as *mut u8
    }

    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    /// The memfd behind the mapping, if it has one.
    pub(crate) fn fd(&self) -> Option<BorrowedFd<'_>> {
        self.fd.as_ref().map(|fd| fd.as_fd())
    }
}
