//! The process default found through `$ASCEND_HOME_PATH`: the stand-in (`tests/cann_stand_in/`)
//! is built under a scratch CANN root, the variable points at it, and `Device::Ascend(0)` then
//! reports the device's own topology.
//!
//! One test only, in its own binary: the process default is opened once per process, and the
//! variable is set before anything reads it.
#![cfg(target_os = "linux")]

mod cann_stand_in;

use cann_stand_in::{AclStandIn, Variant};
use dist_tensor::device::ascend::{Ascend, sys};
use dist_tensor::device::capability::Op;
use dist_tensor::device::{Device, Topology};
use dist_tensor::{Error, Result};

/// Every test of this file, named `ascend::*` so that `cargo test ascend` selects them.
mod ascend {
    use super::*;

    #[test]
    fn ascend_home_path_leads_to_the_runtime_and_its_topology() -> Result<()> {
        let home = cann_stand_in::scratch_dir("ascend-home");
        let npu = AclStandIn::build(&home, "lib64/libascendcl.so", Variant::Full);
        npu.set_device_count(2);
        // SAFETY: this binary's only test; no other thread reads or writes the environment.
        unsafe { std::env::set_var(sys::ASCEND_HOME_PATH, &home) };

        // A world with an NPU's true topology, read from the device.
        assert_eq!(Device::Ascend(0).topology(8)?, Topology::ascend_910b());
        assert_eq!(Device::Ascend(1).topology(8)?, Topology::ascend_910b());
        let ascend = Ascend::open()?;
        assert_eq!(ascend.library().path(), npu.path);
        assert_eq!(ascend.device_count()?, 2);

        // Opened and initialised once for the process.
        let inits = npu.log().iter().filter(|call| call.starts_with("aclInit")).count();
        assert_eq!(inits, 1);
        assert!(!npu.log().iter().any(|call| call == "aclFinalize"));

        // No such device.
        let err = Device::Ascend(2).topology(8).unwrap_err();
        assert!(matches!(err, Error::DeviceUnavailable { .. }), "{err}");

        // The fused ops have NPU kernels.
        assert!(Device::Ascend(0).ensure_supported(Op::AllGatherMatmul).is_ok());
        Ok(())
    }
}
