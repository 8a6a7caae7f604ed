//! The MPI calls the proxy makes, as functions that return MPI's own message on failure.
//!
//! rsmpi's safe layer serves start-up (initialisation, the shared-memory split, small blocking
//! collectives); what it lacks (matched probes, non-blocking sends and receives into raw heap
//! memory, derived datatypes for strided rows, non-blocking collectives) comes from `mpi::ffi`,
//! wrapped here. The communicator returns errors (`MPI_ERRORS_RETURN`), so a failed call comes
//! back as a code, turned into text by `MPI_Error_string`.
//!
//! Every function here is called only on the proxy thread, the one thread that initialised MPI
//! and the only one that calls it (`MPI_THREAD_FUNNELED`).

use std::ffi::{c_int, c_void};

use mpi::ffi;

pub(crate) type Comm = ffi::MPI_Comm;
pub(crate) type Request = ffi::MPI_Request;
pub(crate) type Datatype = ffi::MPI_Datatype;

/// Tag of control messages: a header (and small payloads inline), received by matched probe.
pub(crate) const TAG_CTRL: c_int = 1;
/// Tag of bulk data, received straight into the heap.
pub(crate) const TAG_DATA: c_int = 2;

/// MPI's message for `code`.
pub(crate) fn error_string(code: c_int) -> String {
    let mut text = vec![0u8; 512];
    let mut len: c_int = 0;
    // SAFETY: the buffer holds MPI_MAX_ERROR_STRING (256 in OpenMPI and MPICH) characters.
    let rc = unsafe { ffi::MPI_Error_string(code, text.as_mut_ptr().cast(), &mut len) };
    if rc != 0 {
        return format!("MPI error code {code}");
    }
    text.truncate(len.max(0) as usize);
    String::from_utf8_lossy(&text).into_owned()
}

/// `Ok` for `MPI_SUCCESS`, else `what` and MPI's message.
pub(crate) fn check(rc: c_int, what: impl FnOnce() -> String) -> Result<(), (String, String)> {
    if rc == 0 { Ok(()) } else { Err((what(), error_string(rc))) }
}

/// What an MPI call returned when it failed: the call with its purpose, and MPI's message.
pub(crate) type Failure = (String, String);

pub(crate) fn null_request() -> Request {
    // SAFETY: reading an MPI handle constant that rsmpi's C shim initialised.
    unsafe { ffi::RSMPI_REQUEST_NULL }
}

pub(crate) fn bytes_type() -> Datatype {
    // SAFETY: as in `null_request`.
    unsafe { ffi::RSMPI_UINT8_T }
}

/// Sets the communicator to return errors instead of aborting the job.
pub(crate) fn errors_return(comm: Comm) -> Result<(), Failure> {
    // SAFETY: a valid communicator and a predefined error handler.
    let rc = unsafe { ffi::MPI_Comm_set_errhandler(comm, ffi::RSMPI_ERRORS_RETURN) };
    check(rc, || "MPI_Comm_set_errhandler(MPI_ERRORS_RETURN)".into())
}

/// A block of memory as MPI sees it: `count` items of `datatype` from `ptr`; the datatype is
/// derived (and freed once the operation started) when rows are strided.
pub(crate) struct Block {
    pub(crate) ptr: *mut c_void,
    pub(crate) count: c_int,
    pub(crate) datatype: Datatype,
    derived: bool,
}

impl Block {
    /// `rows` rows of `row_bytes` bytes at `ptr`, `stride` bytes apart.
    pub(crate) fn rows(
        ptr: *mut u8,
        rows: usize,
        row_bytes: usize,
        stride: usize,
    ) -> Result<Block, Failure> {
        let too_big = || ("describing a transfer".to_string(), "more than 2^31 items".into());
        if rows <= 1 || stride == row_bytes {
            let count = c_int::try_from(rows * row_bytes).map_err(|_| too_big())?;
            return Ok(Block { ptr: ptr.cast(), count, datatype: bytes_type(), derived: false });
        }
        let rows_c = c_int::try_from(rows).map_err(|_| too_big())?;
        let row_c = c_int::try_from(row_bytes).map_err(|_| too_big())?;
        let mut datatype = bytes_type();
        // SAFETY: plain arguments; MPI writes the new type's handle.
        let rc = unsafe {
            ffi::MPI_Type_create_hvector(
                rows_c,
                row_c,
                stride as ffi::MPI_Aint,
                bytes_type(),
                &mut datatype,
            )
        };
        check(rc, || "MPI_Type_create_hvector".into())?;
        // SAFETY: a type MPI just made.
        let rc = unsafe { ffi::MPI_Type_commit(&mut datatype) };
        check(rc, || "MPI_Type_commit".into())?;
        Ok(Block { ptr: ptr.cast(), count: 1, datatype, derived: true })
    }
}

impl Drop for Block {
    fn drop(&mut self) {
        if self.derived {
            // SAFETY: a type this block made; MPI keeps it alive for operations that use it.
            unsafe { ffi::MPI_Type_free(&mut self.datatype) };
        }
    }
}

/// Starts sending `block` to `dest`.
pub(crate) fn isend(
    comm: Comm,
    block: &Block,
    dest: usize,
    tag: c_int,
) -> Result<Request, Failure> {
    let mut request = null_request();
    // SAFETY: the caller keeps the memory alive and unchanged until the request completes.
    let rc = unsafe {
        ffi::MPI_Isend(
            block.ptr,
            block.count,
            block.datatype,
            dest as c_int,
            tag,
            comm,
            &mut request,
        )
    };
    check(rc, || format!("MPI_Isend to rank {dest}"))?;
    Ok(request)
}

/// Starts receiving `block` from `source`.
pub(crate) fn irecv(
    comm: Comm,
    block: &Block,
    source: usize,
    tag: c_int,
) -> Result<Request, Failure> {
    let mut request = null_request();
    // SAFETY: the caller keeps the memory alive and untouched until the request completes.
    let rc = unsafe {
        ffi::MPI_Irecv(
            block.ptr,
            block.count,
            block.datatype,
            source as c_int,
            tag,
            comm,
            &mut request,
        )
    };
    check(rc, || format!("MPI_Irecv from rank {source}"))?;
    Ok(request)
}

/// Whether `request` completed (it becomes the null request then).
pub(crate) fn test(request: &mut Request, what: impl FnOnce() -> String) -> Result<bool, Failure> {
    let mut flag: c_int = 0;
    // SAFETY: a request this proxy started; the status is ignored.
    let rc = unsafe { ffi::MPI_Test(request, &mut flag, ffi::RSMPI_STATUS_IGNORE) };
    check(rc, what)?;
    Ok(flag != 0)
}

/// A control message waiting to be received, if any: its source and bytes.
pub(crate) fn probe_control(comm: Comm) -> Result<Option<(usize, Vec<u8>)>, Failure> {
    let mut flag: c_int = 0;
    // SAFETY: rsmpi's C shim initialised the constant.
    let mut message = unsafe { ffi::RSMPI_MESSAGE_NULL };
    // SAFETY: the status is plain data that MPI fills.
    let mut status: ffi::MPI_Status = unsafe { std::mem::zeroed() };
    // SAFETY: valid communicator and out-pointers.
    let rc = unsafe {
        ffi::MPI_Improbe(
            ffi::RSMPI_ANY_SOURCE,
            TAG_CTRL,
            comm,
            &mut flag,
            &mut message,
            &mut status,
        )
    };
    check(rc, || "MPI_Improbe".into())?;
    if flag == 0 {
        return Ok(None);
    }
    let mut count: c_int = 0;
    // SAFETY: the status of the matched message.
    let rc = unsafe { ffi::MPI_Get_count(&status, bytes_type(), &mut count) };
    check(rc, || "MPI_Get_count".into())?;
    let mut bytes = vec![0u8; count.max(0) as usize];
    // SAFETY: the buffer holds the matched message's bytes.
    let rc = unsafe {
        ffi::MPI_Mrecv(
            bytes.as_mut_ptr().cast(),
            count,
            bytes_type(),
            &mut message,
            ffi::RSMPI_STATUS_IGNORE,
        )
    };
    check(rc, || format!("MPI_Mrecv from rank {}", status.MPI_SOURCE))?;
    Ok(Some((status.MPI_SOURCE as usize, bytes)))
}
