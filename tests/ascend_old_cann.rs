//! An AscendCL older than CANN 8.3 (no `aclrtBinaryLoadFromData` and the other kernel-launch
//! calls): the world still builds, and an op that needs a kernel says which symbol is missing
//! and which CANN it takes. Against the stand-in (`tests/cann_stand_in/`), in a binary of its
//! own (the stand-ins find each other through the process's global symbols).
#![cfg(target_os = "linux")]

mod cann_stand_in;

use std::time::Duration;

use cann_stand_in::{CannStandIn, Variant};
use dist_tensor::device::ascend::{Ascend, AscendWorldBuilder};
use dist_tensor::{Error, Result, collectives};

/// Every test of this file, named `ascend::*` so that `cargo test ascend` selects them.
mod ascend {
    use super::*;

    #[test]
    fn a_runtime_without_the_kernel_calls_names_the_first_one_missing() -> Result<()> {
        let cann =
            CannStandIn::build(&cann_stand_in::scratch_dir("old-cann"), Variant::NoKernelCalls);
        cann.acl.set_device_count(2);
        // SAFETY: the stand-in exports the AscendCL symbols with the headers' C signatures.
        let runtime = unsafe { Ascend::open_path(&cann.acl.path) }?;
        assert!(!runtime.library().provides("aclrtBinaryLoadFromData"));
        assert!(!runtime.library().provides("aclrtLaunchKernelWithConfig"));
        assert!(runtime.library().provides("aclrtMalloc"));
        let world = AscendWorldBuilder::new(&[0, 1])
            .runtime(runtime)
            .heap_bytes(1 << 20)
            .wait_timeout(Duration::from_secs(5))
            .build()?;
        // An error after every rank agreed fails the world: its first failure, typed.
        let run = world.run(|rank| collectives::all_gather(rank, &[1.0f32]));
        match run.expect_err("the run fails").rank_error() {
            Error::SymbolMissing { symbol, library } => {
                assert_eq!(*symbol, "aclrtBinaryLoadFromData");
                assert!(library.contains("needs CANN 8.3 or later"), "{library}");
            }
            other => panic!("expected a missing symbol, got {other:?}"),
        }
        // Compiled (the compiler is there), never loaded.
        assert!(cann.acl.log().iter().any(|l| l.starts_with("aclrtcCompileProg(all_gather,")));
        Ok(())
    }
}
