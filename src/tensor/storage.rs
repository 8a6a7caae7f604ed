//! Where a [`Tensor`]'s elements live: host memory (an ndarray array) or a GPU's memory (feature
//! `cuda`), in the manner of candle's storage enum. Host methods reach the array through `Deref`;
//! on a tensor that lives on a GPU they panic and say to call [`Tensor::to_host`] first.

use std::ops::{Deref, DerefMut};

use ndarray::{ArcArray, ArrayD, IxDyn};

use super::{Element, Tensor};
use crate::device::Device;
use crate::device::cuda::{self, DeviceStorage};
use crate::shmem::Rank;
use crate::{Error, Result};

/// The elements of a tensor.
pub(crate) enum Storage<T: Element> {
    /// In host memory, row-major and contiguous; shared copy-on-write between clones.
    Host(ArcArray<T, IxDyn>),
    /// In a GPU's memory.
    Device(DeviceStorage<T>),
}

impl<T: Element> Storage<T> {
    pub(crate) fn shape(&self) -> &[usize] {
        match self {
            Storage::Host(a) => a.shape(),
            Storage::Device(d) => d.shape(),
        }
    }

    pub(crate) fn device(&self) -> Device {
        match self {
            Storage::Host(_) => Device::Host,
            Storage::Device(d) => Device::Cuda(d.ordinal() as u32),
        }
    }
}

impl<T: Element> From<ArrayD<T>> for Storage<T> {
    fn from(a: ArrayD<T>) -> Self {
        Storage::Host(a.into_shared())
    }
}

#[track_caller]
fn on_device(device: Device) -> ! {
    panic!(
        "this tensor lives on {device}: call Tensor::to_host() before using its elements on the host"
    )
}

impl<T: Element> Deref for Storage<T> {
    type Target = ArcArray<T, IxDyn>;

    fn deref(&self) -> &ArcArray<T, IxDyn> {
        match self {
            Storage::Host(a) => a,
            Storage::Device(_) => on_device(self.device()),
        }
    }
}

impl<T: Element> DerefMut for Storage<T> {
    fn deref_mut(&mut self) -> &mut ArcArray<T, IxDyn> {
        let device = self.device();
        match self {
            Storage::Host(a) => a,
            Storage::Device(_) => on_device(device),
        }
    }
}

impl<T: Element> Clone for Storage<T> {
    /// Host arrays are shared until one of the clones writes (copy-on-write); device tensors share
    /// their (immutable) buffer.
    fn clone(&self) -> Self {
        match self {
            Storage::Host(a) => Storage::Host(a.clone()),
            Storage::Device(d) => Storage::Device(d.clone()),
        }
    }
}

impl<T: Element> PartialEq for Storage<T> {
    /// Host arrays compare by value; device tensors are equal when they are the same buffer (call
    /// `to_host` to compare values).
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (Storage::Host(a), Storage::Host(b)) => a == b,
            (Storage::Device(a), Storage::Device(b)) => a.same_buffer(b),
            _ => false,
        }
    }
}

impl<T: Element> std::fmt::Debug for Storage<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Storage::Host(a) => a.fmt(f),
            Storage::Device(d) => write!(f, "Tensor on {} of shape {:?}", self.device(), d.shape()),
        }
    }
}

impl<T: Element> Tensor<T> {
    /// Where the elements live: [`Device::Host`], or [`Device::Cuda`] for a tensor on a GPU.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{Device, Tensor};
    /// assert_eq!(Tensor::<f32>::zeros(&[2]).device(), Device::Host);
    /// ```
    pub fn device(&self) -> Device {
        self.data.device()
    }

    /// A copy on `device`: the host, or a GPU (`Device::Cuda(n)`, feature `cuda`). Moving to a
    /// GPU copies asynchronously on that GPU's stream; inside a [`World::cuda`](crate::World::cuda)
    /// use [`Tensor::to_rank`] instead, so that waits report the world's failures.
    ///
    /// # Errors
    /// [`Error::DeviceUnavailable`] for an NPU, or a GPU in a build without `cuda`;
    /// [`Error::LibraryNotFound`] when the NVIDIA driver is absent; as [`Tensor::to_host`] when
    /// the tensor is on a GPU.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{Device, Tensor};
    /// let t = Tensor::<f32>::random(&[3, 4], 1);
    /// match t.to_device(Device::Cuda(0)) {
    ///     Ok(on_gpu) => assert_eq!(on_gpu.to_host()?, t),
    ///     Err(e) => println!("no GPU: {e}"),
    /// }
    /// assert_eq!(t.to_device(Device::Host)?, t);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn to_device(&self, device: Device) -> Result<Tensor<T>> {
        self.to_device_in(device, None)
    }

    /// A copy on `rank`'s device (its GPU in a GPU world, the host otherwise); waiting for it
    /// reports the world's failure instead of hanging.
    ///
    /// # Errors
    /// As [`Tensor::to_device`].
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{Device, Tensor, World};
    /// let t = Tensor::<f32>::random(&[2, 2], 1);
    /// let back = World::threads(1)?.run(|rank| t.to_rank(rank))?;
    /// assert_eq!(back[0].device(), Device::Host);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn to_rank(&self, rank: &Rank<'_>) -> Result<Tensor<T>> {
        self.to_device_in(rank.device(), rank.cuda_world().map(|w| (w, rank.rank())))
    }

    pub(crate) fn to_device_in(
        &self,
        device: Device,
        world: Option<(&cuda::CudaWorld, usize)>,
    ) -> Result<Tensor<T>> {
        match (&self.data, device) {
            (_, Device::Host) => self.to_host(),
            (Storage::Device(d), Device::Cuda(n)) if d.ordinal() == n as usize => Ok(self.clone()),
            (Storage::Device(_), Device::Cuda(_)) => self.to_host()?.to_device_in(device, world),
            (Storage::Host(a), Device::Cuda(n)) => {
                let host = a.as_slice().expect("a Tensor is always contiguous");
                let data = cuda::upload(n as usize, host, a.shape(), world)?;
                Ok(Tensor::from_device_storage(data))
            }
            (_, Device::Ascend(_)) => Err(Error::DeviceUnavailable {
                op: "Tensor::to_device",
                device: device.to_string(),
                reason: "tensors cannot live on an NPU yet".into(),
            }),
        }
    }

    /// A copy in host memory (for a tensor on a GPU: once the work that writes it is done).
    ///
    /// # Errors
    /// For a tensor on a GPU: what the GPU work that writes it failed with ([`Error::WaitTimeout`]
    /// naming rank, program, signal and values; [`Error::PeerFailed`]; [`Error::DeviceStatus`]).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::Tensor;
    /// let t = Tensor::<f64>::random(&[2, 3], 5);
    /// assert_eq!(t.to_host()?, t);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn to_host(&self) -> Result<Tensor<T>> {
        match &self.data {
            Storage::Host(_) => Ok(self.clone()),
            Storage::Device(d) => Tensor::from_shape_vec(d.shape(), d.download()?),
        }
    }

    pub(crate) fn from_device_storage(data: DeviceStorage<T>) -> Tensor<T> {
        Tensor { data: Storage::Device(data) }
    }

    /// The GPU storage, if the tensor lives on a GPU.
    pub(crate) fn device_storage(&self) -> Option<&DeviceStorage<T>> {
        match &self.data {
            Storage::Host(_) => None,
            Storage::Device(d) => Some(d),
        }
    }
}
