//! What a [`Device`] can do, the device layer's half of it: the topology a world runs with there
//! and its capability check. The enum itself is the tensor layer's (`tensor/device.rs`): a tensor
//! reports it.

use super::ascend::Ascend;
use super::capability::{self, Op};
use crate::Result;
use crate::shmem::topology::Topology;
use crate::tensor::DType;
pub use crate::tensor::Device;

impl Device {
    /// The topology a world of `world_size` ranks runs with on this device: for the host, the
    /// machine's cores shared out ([`Topology::host_default`]); for an NPU, the device's own
    /// core counts read from it (each rank has a device of its own), so the host simulation can
    /// run with an NPU's true topology.
    ///
    /// # Errors
    /// For an NPU: [`Error::LibraryNotFound`](crate::Error::LibraryNotFound) listing every path tried when CANN is absent;
    /// [`Error::DeviceUnavailable`](crate::Error::DeviceUnavailable) when there is no such device; [`Error::DeviceStatus`](crate::Error::DeviceStatus) with
    /// the vendor's message when a query fails.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::device::{Device, Topology};
    /// use dist_tensor::Error;
    ///
    /// assert_eq!(Device::Host.topology(4)?, Topology::host_default(4));
    /// match Device::Ascend(0).topology(4) {
    ///     Ok(npu) => assert!(npu.aicore_num() > 0),
    ///     // No CANN on this machine: the error lists every path tried.
    ///     Err(Error::LibraryNotFound { tried, .. }) => {
    ///         assert!(tried.iter().any(|t| t.contains("/usr/local/Ascend/ascend-toolkit/latest")))
    ///     }
    ///     Err(e) => return Err(e),
    /// }
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn topology(&self, world_size: usize) -> Result<Topology> {
        match *self {
            Device::Host => Ok(Topology::host_default(world_size)),
            Device::Ascend(index) => Ascend::open()?.device(index)?.topology(),
            // The host simulation runs nothing on a GPU; a GPU world sizes its own grids.
            Device::Cuda(_) => Ok(Topology::host_default(world_size)),
        }
    }

    /// Checks that `op` has a kernel on this device's backend, before it starts: the capability
    /// table's answer for the op in f32 with no extra feature.
    ///
    /// # Errors
    /// [`Error::DeviceUnavailable`](crate::Error::DeviceUnavailable) naming `op`, the backend and the ops that have a kernel there.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::device::Device;
    /// use dist_tensor::device::capability::Op;
    /// use dist_tensor::Error;
    ///
    /// assert!(Device::Host.ensure_supported(Op::AllToAllV).is_ok());
    /// assert!(Device::Ascend(0).ensure_supported(Op::AllGatherMatmul).is_ok());
    /// let err = Device::Cuda(0).ensure_supported(Op::AllToAllV).unwrap_err();
    /// assert!(matches!(err, Error::DeviceUnavailable { op: "all_to_all_v", .. }));
    /// assert!(err.to_string().contains("no GPU kernel"), "{err}");
    /// ```
    pub fn ensure_supported(&self, op: Op) -> Result<()> {
        capability::check(op, *self, DType::F32, &[])
    }
}
