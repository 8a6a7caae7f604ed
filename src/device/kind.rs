//! Where work runs, chosen at the user boundary: the host simulation or a real NPU.

use std::fmt;
use std::str::FromStr;

use super::ascend::Ascend;
use super::capability::{self, Op};
use crate::shmem::topology::Topology;
use crate::tensor::DType;
use crate::{Error, Result};

/// A device to run on: the host simulation of an NPU (the default) or Ascend NPU `n` (an index
/// among the visible devices, see [`VISIBLE_DEVICES`](super::ascend::VISIBLE_DEVICES); a
/// [`World::ascend`](crate::World::ascend) world runs its ranks' kernels on NPUs).
///
/// # Examples
/// ```
/// use dist_tensor::device::Device;
///
/// assert_eq!(Device::default(), Device::Host);
/// assert_eq!("ascend:1".parse::<Device>()?, Device::Ascend(1));
/// assert_eq!(Device::Ascend(1).to_string(), "ascend:1");
/// # Ok::<(), dist_tensor::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Device {
    /// The host simulation: the tile kernels run as CPU threads.
    #[default]
    Host,
    /// Ascend NPU `n`, reached through the CANN runtime loaded at run time.
    Ascend(u32),
    /// NVIDIA GPU `n` (a CUDA ordinal), feature `cuda`: tensors live in its memory and the
    /// `DistTensor` ops of a [`World::cuda`](crate::World::cuda) run there.
    Cuda(u32),
}

impl Device {
    /// Whether this is the host simulation.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::device::Device;
    /// assert!(Device::Host.is_host());
    /// assert!(!Device::Ascend(0).is_host());
    /// ```
    pub fn is_host(&self) -> bool {
        matches!(self, Device::Host)
    }

    /// The topology a world of `world_size` ranks runs with on this device: for the host, the
    /// machine's cores shared out ([`Topology::host_default`]); for an NPU, the device's own
    /// core counts read from it (each rank has a device of its own), so the host simulation can
    /// run with an NPU's true topology.
    ///
    /// # Errors
    /// For an NPU: [`Error::LibraryNotFound`] listing every path tried when CANN is absent;
    /// [`Error::DeviceUnavailable`] when there is no such device; [`Error::DeviceStatus`] with
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
    /// [`Error::DeviceUnavailable`] naming `op`, the backend and the ops that have a kernel there.
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

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Host => write!(f, "host"),
            Device::Ascend(index) => write!(f, "ascend:{index}"),
            Device::Cuda(index) => write!(f, "cuda:{index}"),
        }
    }
}

/// Parses `host` (or `cpu`), `ascend:N` (or `npu:N`), `cuda:N` (or `gpu:N`), and `ascend` /
/// `npu` / `cuda` / `gpu` for device 0; case is ignored.
///
/// # Examples
/// ```
/// use dist_tensor::device::Device;
/// assert_eq!("NPU:3".parse::<Device>()?, Device::Ascend(3));
/// assert_eq!("cpu".parse::<Device>()?, Device::Host);
/// assert_eq!("gpu:1".parse::<Device>()?, Device::Cuda(1));
/// assert!("tpu:0".parse::<Device>().is_err());
/// # Ok::<(), dist_tensor::Error>(())
/// ```
impl FromStr for Device {
    type Err = Error;

    fn from_str(s: &str) -> Result<Device> {
        let text = s.trim().to_ascii_lowercase();
        let invalid = || Error::InvalidArgument {
            op: "Device::from_str",
            rank: 0,
            reason: format!(
                "{s:?} is not a device: expected host, cpu, ascend:N, npu:N, cuda:N or gpu:N"
            ),
        };
        match text.as_str() {
            "host" | "cpu" => Ok(Device::Host),
            "ascend" | "npu" => Ok(Device::Ascend(0)),
            "cuda" | "gpu" => Ok(Device::Cuda(0)),
            _ => {
                let (kind, index) = text.split_once(':').ok_or_else(invalid)?;
                let index: u32 = index.parse().map_err(|_| invalid())?;
                match kind {
                    "ascend" | "npu" => Ok(Device::Ascend(index)),
                    "cuda" | "gpu" => Ok(Device::Cuda(index)),
                    _ => Err(invalid()),
                }
            }
        }
    }
}
