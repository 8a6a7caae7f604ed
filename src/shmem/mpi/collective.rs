//! MPI's own collectives, run by the proxy for the unfused baselines (`MPI_Allgatherv`,
//! `MPI_Reduce_scatter`, `MPI_Alltoallv`), as non-blocking calls it tests in its loop: the proxy
//! keeps serving puts, states and failures meanwhile, and a world that fails while one is in
//! flight ends the rank's wait instead of hanging it.

use std::ffi::c_int;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use mpi::ffi;

use super::raw::{self, Comm, Failure};
use crate::shmem::sync::Cell;
use crate::shmem::transport::{CollectiveKind, Elem, Owned};

/// A collective a rank asked for (its counts as MPI takes them), and its completion.
pub(crate) struct CollTask {
    kind: CollectiveKind,
    /// Counts and displacements (in elements), alive until the collective completes.
    arrays: [Vec<c_int>; 4],
    pub(crate) done: Cell,
}

// SAFETY: the raw pointers in the kind are the rank's buffers, which it keeps alive and leaves
// alone until `done` is set; only the proxy thread passes them to MPI.
unsafe impl Send for CollTask {}
// SAFETY: as above; the rank thread only reads `done`.
unsafe impl Sync for CollTask {}

/// A collective in flight, holding its buffers.
pub(crate) struct Running {
    task: Arc<CollTask>,
    _buffers: Arc<Mutex<Option<Owned>>>,
    request: raw::Request,
}

fn datatype(elem: Elem) -> raw::Datatype {
    // SAFETY: reading MPI handle constants that rsmpi's C shim initialised.
    unsafe {
        match elem {
            Elem::Bytes => ffi::RSMPI_UINT8_T,
            Elem::F32 => ffi::RSMPI_FLOAT,
            Elem::F64 => ffi::RSMPI_DOUBLE,
        }
    }
}

fn ints(values: &[usize]) -> Result<Vec<c_int>, String> {
    values
        .iter()
        .map(|&v| c_int::try_from(v))
        .collect::<Result<_, _>>()
        .map_err(|_| "a count above 2^31 elements: too large for one MPI call".to_string())
}

impl CollTask {
    pub(crate) fn new(kind: CollectiveKind) -> Result<CollTask, String> {
        let arrays = match &kind {
            CollectiveKind::AllGatherV { send_count, counts, displs, .. } => {
                [ints(&[*send_count])?, ints(counts)?, ints(displs)?, Vec::new()]
            }
            CollectiveKind::ReduceScatter { counts, .. } => {
                [ints(counts)?, Vec::new(), Vec::new(), Vec::new()]
            }
            CollectiveKind::AllToAllV {
                send_counts,
                send_displs,
                recv_counts,
                recv_displs,
                ..
            } => [ints(send_counts)?, ints(send_displs)?, ints(recv_counts)?, ints(recv_displs)?],
        };
        Ok(CollTask { kind, arrays, done: Cell::new() })
    }

    /// Starts the collective on `comm`.
    pub(crate) fn start(
        self: Arc<Self>,
        comm: Comm,
        buffers: Arc<Mutex<Option<Owned>>>,
    ) -> Result<Running, Failure> {
        let mut request = raw::null_request();
        let [a, b, c, d] = &self.arrays;
        // SAFETY: the rank's buffers stay alive and untouched until `done` is set, and the count
        // arrays live in the task, which `Running` keeps until MPI completes the call.
        let rc = unsafe {
            match &self.kind {
                CollectiveKind::AllGatherV { send, recv, elem, .. } => ffi::MPI_Iallgatherv(
                    send.cast(),
                    a[0],
                    datatype(*elem),
                    recv.cast(),
                    b.as_ptr(),
                    c.as_ptr(),
                    datatype(*elem),
                    comm,
                    &mut request,
                ),
                CollectiveKind::ReduceScatter { send, recv, elem, .. } => ffi::MPI_Ireduce_scatter(
                    send.cast(),
                    recv.cast(),
                    a.as_ptr(),
                    datatype(*elem),
                    ffi::RSMPI_SUM,
                    comm,
                    &mut request,
                ),
                CollectiveKind::AllToAllV { send, recv, elem, .. } => ffi::MPI_Ialltoallv(
                    send.cast(),
                    a.as_ptr(),
                    b.as_ptr(),
                    datatype(*elem),
                    recv.cast(),
                    c.as_ptr(),
                    d.as_ptr(),
                    datatype(*elem),
                    comm,
                    &mut request,
                ),
            }
        };
        raw::check(rc, || format!("{} (an unfused baseline)", self.kind.name()))?;
        Ok(Running { task: self, _buffers: buffers, request })
    }
}

impl Running {
    /// Whether the collective completed; tells the rank when it has.
    pub(crate) fn test(&mut self) -> Result<bool, Failure> {
        let name = self.task.kind.name();
        if !raw::test(&mut self.request, || name.to_string())? {
            return Ok(false);
        }
        self.task.done.value.store(1, Ordering::Release);
        self.task.done.ring();
        Ok(true)
    }
}
