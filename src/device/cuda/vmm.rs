//! GPU memory that other processes can map: CUDA's virtual memory API.
//!
//! A segment is made with `cuMemCreate` asking for a POSIX file-descriptor handle, exported with
//! `cuMemExportToShareableHandle` (an fd, which travels over a Unix socket with `SCM_RIGHTS`),
//! and mapped in every process with `cuMemImportFromShareableHandle`, `cuMemAddressReserve`,
//! `cuMemMap` and `cuMemSetAccess` (read-write for that process's own device). Sizes are whole
//! multiples of the device's allocation granularity. Plain `cuMemAlloc` memory cannot be shared
//! this way, and `cuIpcGetMemHandle` cannot be opened by the process that made it, nor twice on
//! one device, which the ranks that share a GPU need.
//!
//! The physical memory lives until every process has released its handle and unmapped it: a
//! killed process's mapping goes with it (the driver releases what a dead process held), so
//! nothing is left behind.

use std::os::fd::{FromRawFd, OwnedFd};

use cudarc::driver::sys;

use super::driver::{Check, CudaDevice};
use crate::{Error, Result};

fn properties(gpu: &CudaDevice) -> sys::CUmemAllocationProp {
    // SAFETY: a plain C struct for which all zeroes is a valid (empty) value.
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes =
        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = gpu.ordinal as i32;
    prop
}

/// Whether `gpu` can share memory with other processes through file descriptors, and the
/// granularity its segments are made in.
pub(crate) fn granularity(gpu: &CudaDevice) -> Result<usize> {
    use sys::CUdevice_attribute::*;
    let attr = |a| {
        let mut v = 0;
        // SAFETY: `dev` is a valid device handle; `v` is written.
        unsafe { sys::cuDeviceGetAttribute(&mut v, a, gpu.dev) }
            .check("cuDeviceGetAttribute")
            .map(|_| v)
    };
    for (a, what) in [
        (CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED, "the virtual memory API"),
        (
            CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
            "sharing memory through file descriptors",
        ),
    ] {
        if attr(a)? == 0 {
            return Err(Error::DeviceUnavailable {
                op: "World::from_env",
                device: format!("cuda:{}", gpu.ordinal),
                reason: format!("it does not support {what}, which a world of processes needs"),
            });
        }
    }
    let prop = properties(gpu);
    let mut g = 0usize;
    // SAFETY: `prop` describes an allocation on this device; `g` is written.
    unsafe {
        sys::cuMemGetAllocationGranularity(
            &mut g,
            &prop,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
        )
    }
    .check("cuMemGetAllocationGranularity")?;
    Ok(g.max(1))
}

/// A segment's physical memory in this process: made here, or imported from a peer's fd.
pub(crate) struct Handle {
    handle: sys::CUmemGenericAllocationHandle,
    bytes: usize,
}

// SAFETY: a plain driver handle, usable from any thread.
unsafe impl Send for Handle {}
// SAFETY: as for Send; never mutated.
unsafe impl Sync for Handle {}

impl Handle {
    /// New memory of `bytes` (a multiple of [`granularity`]) on `gpu`, and the fd that lets
    /// other processes map it.
    pub(crate) fn create(gpu: &CudaDevice, bytes: usize) -> Result<(Handle, OwnedFd)> {
        gpu.bind()?;
        let prop = properties(gpu);
        let mut handle = 0;
        // SAFETY: `prop` is filled in; `handle` is written and released in Drop.
        unsafe { sys::cuMemCreate(&mut handle, bytes, &prop, 0) }.result().map_err(|e| {
            Error::DeviceStatus {
                call: "cuMemCreate",
                code: e.0 as i32,
                message: format!(
                    "cuda:{}: a symmetric heap segment of {bytes} bytes ({e}; set {} smaller?)",
                    gpu.ordinal,
                    super::GPU_HEAP_BYTES_ENV
                ),
            }
        })?;
        let made = Handle { handle, bytes };
        let mut fd: i32 = -1;
        // SAFETY: the handle was made with a POSIX fd handle type; `fd` receives a new fd.
        unsafe {
            sys::cuMemExportToShareableHandle(
                &mut fd as *mut i32 as *mut std::ffi::c_void,
                handle,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        }
        .check("cuMemExportToShareableHandle")?;
        // SAFETY: the driver gave this process a new fd that nothing else owns.
        Ok((made, unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// A peer's memory of `bytes` from the fd it exported (the fd may close afterwards).
    pub(crate) fn import(gpu: &CudaDevice, fd: &OwnedFd, bytes: usize) -> Result<Handle> {
        use std::os::fd::AsRawFd;
        gpu.bind()?;
        let mut handle = 0;
        // SAFETY: the driver reads the fd's number from the pointer's value (its convention for
        // POSIX handles) and does not take the fd.
        unsafe {
            sys::cuMemImportFromShareableHandle(
                &mut handle,
                fd.as_raw_fd() as usize as *mut std::ffi::c_void,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
        }
        .check("cuMemImportFromShareableHandle")?;
        Ok(Handle { handle, bytes })
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: made or imported once; every mapping of it is gone (a `Window` drops its
        // mappings before its handles).
        let _ = unsafe { sys::cuMemRelease(self.handle) };
    }
}

/// A range of GPU addresses of this process with segments mapped in it: every process of a
/// world reserves the same range, so that an address in any segment means the same memory in
/// every process (kernels publish pointers to their peers).
pub(crate) struct Window {
    pub(crate) base: sys::CUdeviceptr,
    size: usize,
    mapped: Vec<(sys::CUdeviceptr, usize)>,
    handles: Vec<Handle>,
}

// SAFETY: addresses and driver handles, usable from any thread with the context bound.
unsafe impl Send for Window {}
// SAFETY: as for Send; not mutated once built.
unsafe impl Sync for Window {}

impl Window {
    /// Reserves `size` bytes of addresses: anywhere (`at` = 0), or exactly at `at`.
    pub(crate) fn reserve(gpu: &CudaDevice, size: usize, at: sys::CUdeviceptr) -> Result<Window> {
        gpu.bind()?;
        let align = granularity(gpu)?;
        let mut base = 0;
        // SAFETY: reserves a fresh range; freed in Drop.
        unsafe { sys::cuMemAddressReserve(&mut base, size, align, at, 0) }
            .check("cuMemAddressReserve")?;
        let window = Window { base, size, mapped: Vec::new(), handles: Vec::new() };
        if at != 0 && base != at {
            return Err(Error::DeviceUnavailable {
                op: "World::from_env",
                device: format!("cuda:{}", gpu.ordinal),
                reason: format!(
                    "the GPU addresses {at:#x}.. that rank 0 reserved for the symmetric heap are                      taken in this process (the driver offered {base:#x})"
                ),
            });
        }
        Ok(window)
    }

    /// Maps `handle` at `offset` of the window, read-write for `gpu`; returns its address.
    pub(crate) fn map(&mut self, gpu: &CudaDevice, offset: usize, handle: Handle) -> Result<u64> {
        let bytes = handle.bytes;
        assert!(offset + bytes <= self.size, "a segment outside its window");
        let ptr = self.base + offset as u64;
        // SAFETY: inside the reserved range, not mapped yet, of the handle's size.
        unsafe { sys::cuMemMap(ptr, bytes, 0, handle.handle, 0) }.check("cuMemMap")?;
        self.mapped.push((ptr, bytes));
        self.handles.push(handle);
        // SAFETY: a plain C struct; all zeroes is valid.
        let mut access: sys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
        access.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        access.location.id = gpu.ordinal as i32;
        access.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        // SAFETY: the range is mapped; one descriptor.
        unsafe { sys::cuMemSetAccess(ptr, bytes, &access, 1) }.check("cuMemSetAccess")?;
        Ok(ptr)
    }
}

impl Drop for Window {
    fn drop(&mut self) {
        // SAFETY: each mapping is undone once, then the range; the caller made sure no work of
        // this process still uses it. The handles are released after (their Drop).
        unsafe {
            for &(ptr, bytes) in &self.mapped {
                let _ = sys::cuMemUnmap(ptr, bytes);
            }
            let _ = sys::cuMemAddressFree(self.base, self.size);
        }
        self.handles.clear();
    }
}
