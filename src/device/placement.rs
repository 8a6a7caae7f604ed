//! Moving a tensor onto a device: the backends' half of [`Tensor::to_device`] (the tensor layer
//! knows how to bring a tensor back to the host, not how to put one on a GPU).

use super::cuda;
use crate::tensor::{Device, Element, Tensor};
use crate::{Error, Result};

impl<T: Element> Tensor<T> {
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

    /// A copy on `device`; a copy onto a GPU of `world` goes into that rank's memory and stream.
    pub(crate) fn to_device_in(
        &self,
        device: Device,
        world: Option<(&cuda::CudaWorld, usize)>,
    ) -> Result<Tensor<T>> {
        match device {
            Device::Host => self.to_host(),
            Device::Cuda(_) if self.device() == device => Ok(self.clone()),
            Device::Cuda(_) if !self.is_on_host() => self.to_host()?.to_device_in(device, world),
            Device::Cuda(n) => {
                let data = cuda::upload(n as usize, self.as_slice(), self.shape(), world)?;
                Ok(Tensor::from_device_storage(data))
            }
            Device::Ascend(_) => Err(Error::DeviceUnavailable {
                op: "Tensor::to_device",
                device: device.to_string(),
                reason: "tensors cannot live on an NPU yet".into(),
            }),
        }
    }
}
