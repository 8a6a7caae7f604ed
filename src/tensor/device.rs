//! [`Device`]: where a tensor's elements live and where a world runs. Defined here, in the tensor
//! layer, because a tensor reports it; what a device can do (its topology, its capability table)
//! is the device layer's (`device/kind.rs`), and the public path `dist_tensor::device::Device`
//! is a re-export.

use std::fmt;
use std::str::FromStr;

use crate::{Error, Result};

/// Where a tensor lives and a world runs: the host (the default; there the host simulation of an
/// NPU runs the tile kernels), Ascend NPU `n` (an index among the visible devices, see [`VISIBLE_DEVICES`](crate::device::ascend::VISIBLE_DEVICES); a
/// [`World::ascend`](crate::World::ascend) world runs its ranks' kernels on NPUs), or NVIDIA GPU `n`.
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
