//! NCCL, for the unfused baselines a user would write: a collective, then cuBLASLt.
//! Communicators for every GPU of a world are made at once (`ncclCommInitAll`), on first use.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::sys;
use cudarc::nccl::{result as nc, sys as nc_sys};

use super::driver::{CudaDevice, guarded, require_library};
use crate::tensor::DType;
use crate::{Error, Result};

fn nccl_error(call: &'static str, e: nc::NcclError) -> Error {
    Error::DeviceStatus { call, code: e.0 as i32, message: format!("{:?}", e.0) }
}

fn check(call: &'static str, r: std::result::Result<nc::NcclStatus, nc::NcclError>) -> Result<()> {
    r.map(|_| ()).map_err(|e| nccl_error(call, e))
}

pub(crate) fn nccl_type(d: DType) -> nc_sys::ncclDataType_t {
    match d {
        DType::F32 => nc_sys::ncclDataType_t::ncclFloat32,
        DType::F64 => nc_sys::ncclDataType_t::ncclFloat64,
        DType::F16 => nc_sys::ncclDataType_t::ncclFloat16,
        DType::BF16 => nc_sys::ncclDataType_t::ncclBfloat16,
    }
}

/// One communicator per rank of a GPU world.
pub(crate) struct Nccl {
    comms: Vec<usize>,
    /// Set once the communicators were aborted (which frees them: they must not be destroyed).
    aborted: std::sync::atomic::AtomicBool,
}

impl Nccl {
    pub(crate) fn new(gpus: &[Arc<CudaDevice>]) -> Result<Nccl> {
        require_library("NCCL (libnccl)", "nccl", nc_sys::is_culib_present)?;
        let devices: Vec<i32> = gpus.iter().map(|g| g.ordinal as i32).collect();
        let mut comms = vec![std::ptr::null_mut(); gpus.len()];
        guarded("libnccl", || {
            // SAFETY: `comms` has room for one communicator per device.
            check("ncclCommInitAll", unsafe {
                nc::comm_init_all(comms.as_mut_ptr(), devices.len() as i32, devices.as_ptr())
            })
        })?;
        Ok(Nccl {
            comms: comms.into_iter().map(|c| c as usize).collect(),
            aborted: Default::default(),
        })
    }

    /// Rank `rank`'s communicator of a world of `n` processes, one GPU each, joined through
    /// `id` (rank 0's `ncclGetUniqueId`, which the world's rendezvous sent to every rank).
    /// Collective: every rank calls it. The other ranks' slots stay empty (they are other
    /// processes).
    pub(crate) fn init_rank(
        gpu: &CudaDevice,
        n: usize,
        rank: usize,
        id: nc_sys::ncclUniqueId,
    ) -> Result<Nccl> {
        require_library("NCCL (libnccl)", "nccl", nc_sys::is_culib_present)?;
        gpu.bind()?;
        let mut comm = std::ptr::null_mut();
        guarded("libnccl", || {
            // SAFETY: `comm` receives one communicator; every rank passes the same id.
            check("ncclCommInitRank", unsafe {
                nc::comm_init_rank(&mut comm, n as i32, id, rank as i32)
            })
        })?;
        let mut comms = vec![0usize; n];
        comms[rank] = comm as usize;
        Ok(Nccl { comms, aborted: Default::default() })
    }

    /// A fresh id for [`Nccl::init_rank`] (rank 0 makes it).
    pub(crate) fn unique_id() -> Result<nc_sys::ncclUniqueId> {
        require_library("NCCL (libnccl)", "nccl", nc_sys::is_culib_present)?;
        guarded("libnccl", || nc::get_uniqueid().map_err(|e| nccl_error("ncclGetUniqueId", e)))
    }

    fn comm(&self, rank: usize) -> nc_sys::ncclComm_t {
        self.comms[rank] as nc_sys::ncclComm_t
    }

    /// Ends every operation of every communicator (the failure path: a peer will never join).
    pub(crate) fn abort(&self) {
        if self.aborted.swap(true, std::sync::atomic::Ordering::AcqRel) {
            return;
        }
        for &c in self.comms.iter().filter(|&&c| c != 0) {
            // SAFETY: `c` is a communicator of this world; NCCL allows aborting from any thread.
            let _ = unsafe { nc::comm_abort(c as nc_sys::ncclComm_t) };
        }
    }

    /// Rank `rank` sends `send[p]` (pointer, elements) to every rank p and receives `recv[p]` from
    /// every rank p, in one group: all_gather, all_to_all and their uneven forms.
    pub(crate) fn send_recv(
        &self,
        rank: usize,
        stream: sys::CUstream,
        dtype: DType,
        send: &[(u64, usize)],
        recv: &[(u64, usize)],
    ) -> Result<()> {
        let comm = self.comm(rank);
        let t = nccl_type(dtype);
        let s = stream as nc_sys::cudaStream_t;
        check("ncclGroupStart", nc::group_start())?;
        for (p, (&(sp, sn), &(rp, rn))) in send.iter().zip(recv).enumerate() {
            if sn > 0 {
                // SAFETY: `sp` holds `sn` elements of `dtype` on this rank's GPU.
                check("ncclSend", unsafe {
                    nc::send(sp as *const c_void, sn, t, p as i32, comm, s)
                })?;
            }
            if rn > 0 {
                // SAFETY: `rp` has room for `rn` elements.
                check("ncclRecv", unsafe {
                    nc::recv(rp as *mut c_void, rn, t, p as i32, comm, s)
                })?;
            }
        }
        check("ncclGroupEnd", nc::group_end())
    }

    /// `ncclAllGather` of `count` elements per rank.
    pub(crate) fn all_gather(
        &self,
        rank: usize,
        stream: sys::CUstream,
        dtype: DType,
        send: u64,
        recv: u64,
        count: usize,
    ) -> Result<()> {
        // SAFETY: `send` holds `count` elements, `recv` room for world * count.
        check("ncclAllGather", unsafe {
            nc::all_gather(
                send as *const c_void,
                recv as *mut c_void,
                count,
                nccl_type(dtype),
                self.comm(rank),
                stream as nc_sys::cudaStream_t,
            )
        })
    }

    /// `ncclReduceScatter` (sum) of `count` elements per rank.
    pub(crate) fn reduce_scatter(
        &self,
        rank: usize,
        stream: sys::CUstream,
        dtype: DType,
        send: u64,
        recv: u64,
        count: usize,
    ) -> Result<()> {
        // SAFETY: `send` holds world * count elements, `recv` room for count.
        check("ncclReduceScatter", unsafe {
            nc::reduce_scatter(
                send as *const c_void,
                recv as *mut c_void,
                count,
                nccl_type(dtype),
                nc_sys::ncclRedOp_t::ncclSum,
                self.comm(rank),
                stream as nc_sys::cudaStream_t,
            )
        })
    }

    /// Sum-reduces, for every rank p, `parts[p]` (pointer into this rank's input, elements) onto
    /// rank p's `out` (uneven reduce_scatter, one `ncclReduce` per root in a group).
    pub(crate) fn reduce_to_each(
        &self,
        rank: usize,
        stream: sys::CUstream,
        dtype: DType,
        parts: &[(u64, usize)],
        out: u64,
    ) -> Result<()> {
        let comm = self.comm(rank);
        check("ncclGroupStart", nc::group_start())?;
        for (root, &(p, count)) in parts.iter().enumerate() {
            if count == 0 {
                continue;
            }
            let recv = if root == rank { out } else { 0 };
            // SAFETY: `p` holds `count` elements; on the root `out` has room for them.
            check("ncclReduce", unsafe {
                nc::reduce(
                    p as *const c_void,
                    recv as *mut c_void,
                    count,
                    nccl_type(dtype),
                    nc_sys::ncclRedOp_t::ncclSum,
                    root as i32,
                    comm,
                    stream as nc_sys::cudaStream_t,
                )
            })?;
        }
        check("ncclGroupEnd", nc::group_end())
    }
}

impl Drop for Nccl {
    fn drop(&mut self) {
        if *self.aborted.get_mut() {
            return;
        }
        for &c in self.comms.iter().filter(|&&c| c != 0) {
            // SAFETY: each communicator is destroyed once.
            let _ = unsafe { nc::comm_destroy(c as nc_sys::ncclComm_t) };
        }
    }
}
