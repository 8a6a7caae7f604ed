//! The CANN loader end to end, against the test stand-in (`tests/cann_stand_in/`): symbols
//! resolve, calls go in the right order, a 910B's core counts become a 24 x 2 topology, a
//! failing status carries the vendor's message, and an older runtime takes the fallback path.
//!
//! Every test opens its own build of the stand-in by explicit path (no `$ASCEND_HOME_PATH`).
//! They still run one at a time: one sets `ASCEND_RT_VISIBLE_DEVICES`, which the stand-in's
//! `aclInit` reads with C's `getenv`, and that must not race with a change to the environment.
#![cfg(target_os = "linux")]

mod cann_stand_in;

use std::path::Path;
use std::sync::{Mutex, MutexGuard};

use cann_stand_in::{AclStandIn, Variant};
use dist_tensor::device::Topology;
use dist_tensor::device::ascend::{Ascend, CoreCounts, VISIBLE_DEVICES, result, sys};
use dist_tensor::{Error, Result};

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Builds `variant` in a fresh directory as `lib64/libascendcl.so`.
fn stand_in(tag: &str, variant: Variant) -> AclStandIn {
    AclStandIn::build(&cann_stand_in::scratch_dir(tag), "lib64/libascendcl.so", variant)
}

fn open(stand_in: &AclStandIn) -> Result<Ascend> {
    // SAFETY: the stand-in exports the AscendCL symbols with the headers' C signatures.
    unsafe { Ascend::open_path(&stand_in.path) }
}

/// Every test of this file, named `ascend::*` so that `cargo test ascend` selects them.
mod ascend {
    use super::*;

    #[test]
    fn symbols_resolve() -> Result<()> {
        let _serial = serial();
        let full = stand_in("symbols-full", Variant::Full);
        // SAFETY: as in `open`.
        let acl = unsafe { sys::Acl::load(&full.path) }?;
        assert_eq!(acl.path(), full.path);
        for symbol in [
            "aclInit",
            "aclFinalize",
            "aclrtGetDeviceCount",
            "aclrtSetDevice",
            "aclrtResetDevice",
            "aclrtGetSocName",
            "aclGetRecentErrMsg",
            "aclrtGetDeviceInfo",
            "aclGetDeviceCapability",
        ] {
            assert!(acl.provides(symbol), "{symbol} should resolve");
        }

        let older = stand_in("symbols-older", Variant::NoDeviceInfo);
        // SAFETY: as in `open`.
        let acl = unsafe { sys::Acl::load(&older.path) }?;
        assert!(!acl.provides("aclrtGetDeviceInfo"), "the optional symbol is an absent Option");
        assert!(acl.provides("aclGetDeviceCapability"));
        Ok(())
    }

    #[test]
    fn calls_go_in_order_from_init_to_finalize() -> Result<()> {
        let _serial = serial();
        let npu = stand_in("order", Variant::Full);
        npu.set_device_count(2);
        npu.set_soc_name("Ascend910B3");
        {
            let ascend = open(&npu)?;
            assert_eq!(ascend.device_count()?, 2);
            let device = ascend.device(1)?;
            assert_eq!(device.index(), 1);
            assert_eq!(device.soc_name()?, "Ascend910B3");
            assert_eq!(device.topology()?, Topology::ascend_910b());
        } // the device is reset, then the runtime finalised
        assert_eq!(
            npu.log(),
            [
                "aclInit(NULL)",
                "aclrtGetDeviceCount",
                "aclrtGetDeviceCount",
                "aclrtSetDevice(1)",
                "aclrtGetSocName",
                "aclrtGetDeviceInfo(1,101)",
                "aclrtGetDeviceInfo(1,201)",
                "aclrtResetDevice(1)",
                "aclFinalize",
            ]
        );
        Ok(())
    }

    #[test]
    fn a_910b_with_24_ai_cores_and_48_vector_cores_is_24_by_2() -> Result<()> {
        let _serial = serial();
        let npu = stand_in("910b", Variant::Full);
        npu.set_cores(24, 48);
        let ascend = open(&npu)?;
        let device = ascend.device(0)?;
        assert_eq!(device.core_counts()?, CoreCounts { ai_cores: 24, vector_cores: 48 });
        let topology = device.topology()?;
        assert_eq!((topology.aicore_num(), topology.sub_vec_num()), (24, 2));
        assert_eq!(topology.aivector_core_num(), 48);
        // The newer query answered; the older one was never needed.
        assert!(!npu.log().iter().any(|call| call.starts_with("aclGetDeviceCapability")));

        // Counts are read, not assumed: another product gives another topology.
        npu.set_cores(20, 40);
        assert_eq!(device.topology()?, Topology::new(20, 2)?);
        Ok(())
    }

    #[test]
    fn an_older_runtime_falls_back_to_acl_get_device_capability() -> Result<()> {
        let _serial = serial();
        let npu = stand_in("fallback", Variant::NoDeviceInfo);
        let ascend = open(&npu)?;
        let topology = ascend.device(0)?.topology()?;
        assert_eq!((topology.aicore_num(), topology.sub_vec_num()), (24, 2));
        let log = npu.log();
        let queries: Vec<&str> = log
            .iter()
            .map(String::as_str)
            .filter(|call| call.contains("Capability") || call.contains("DeviceInfo"))
            .collect();
        // AI cores are info 0, vector cores info 1.
        assert_eq!(queries, ["aclGetDeviceCapability(0,0)", "aclGetDeviceCapability(0,1)"]);
        Ok(())
    }

    #[test]
    fn a_failing_newer_query_falls_back_to_the_older_one() -> Result<()> {
        let _serial = serial();
        let npu = stand_in("newer-fails", Variant::Full);
        npu.fail("aclrtGetDeviceInfo", 207_000, "EE1005: feature not supported (stand-in)");
        let ascend = open(&npu)?;
        assert_eq!(ascend.device(0)?.topology()?, Topology::ascend_910b());
        let log = npu.log();
        let start = log.iter().position(|c| c == "aclrtGetDeviceInfo(0,101)").unwrap();
        assert_eq!(
            log[start..start + 3],
            ["aclrtGetDeviceInfo(0,101)", "aclGetRecentErrMsg", "aclGetDeviceCapability(0,0)"]
        );
        Ok(())
    }

    #[test]
    fn a_failing_status_carries_the_vendor_message() -> Result<()> {
        let _serial = serial();
        let npu = stand_in("failing-status", Variant::Full);
        npu.fail(
            "aclrtSetDevice",
            107_001,
            "EE1001: device 0 is held by another process (stand-in)",
        );
        let ascend = open(&npu)?;
        let err = ascend.device(0).unwrap_err();
        match &err {
            Error::DeviceStatus { call, code, message } => {
                assert_eq!(*call, "aclrtSetDevice");
                assert_eq!(*code, 107_001);
                assert_eq!(message, "EE1001: device 0 is held by another process (stand-in)");
            }
            other => panic!("expected a status error, got {other:?}"),
        }
        assert_eq!(
            err.to_string(),
            "aclrtSetDevice failed with status 107001: EE1001: device 0 is held by another process \
             (stand-in)"
        );
        // The message is fetched right after the failing call, before anything else.
        let log = npu.log();
        let failed = log.iter().position(|c| c == "aclrtSetDevice(0)").unwrap();
        assert_eq!(log[failed + 1], "aclGetRecentErrMsg");
        Ok(())
    }

    #[test]
    fn when_both_core_queries_fail_the_error_is_the_vendors() -> Result<()> {
        let _serial = serial();
        let npu = stand_in("both-fail", Variant::NoDeviceInfo);
        npu.fail("aclGetDeviceCapability", 100_000, "EE1006: capability query refused (stand-in)");
        let ascend = open(&npu)?;
        let err = ascend.device(0)?.topology().unwrap_err();
        assert!(matches!(
            err,
            Error::DeviceStatus { call: "aclGetDeviceCapability", code: 100_000, ref message }
                if message.contains("EE1006")
        ));
        Ok(())
    }

    #[test]
    fn a_failing_init_is_reported_not_panicked() {
        let _serial = serial();
        let npu = stand_in("init-fails", Variant::Full);
        npu.fail("aclInit", 500_000, "EE9999: driver not ready (stand-in)");
        let err = open(&npu).unwrap_err();
        assert!(matches!(err, Error::DeviceStatus { call: "aclInit", code: 500_000, .. }));
        assert!(err.to_string().contains("EE9999: driver not ready"));
    }

    #[test]
    fn a_missing_required_symbol_is_named_with_its_library() {
        let _serial = serial();
        let broken = stand_in("no-set-device", Variant::NoSetDevice);
        let err = open(&broken).unwrap_err();
        match &err {
            Error::SymbolMissing { symbol, library } => {
                assert_eq!(*symbol, "aclrtSetDevice");
                assert_eq!(Path::new(library), broken.path);
            }
            other => panic!("expected a missing symbol, got {other:?}"),
        }
        // Nothing was called: the table failed before aclInit.
        assert!(broken.log().is_empty());
    }

    #[test]
    fn no_device_is_a_clear_error() -> Result<()> {
        let _serial = serial();
        let npu = stand_in("no-device", Variant::Full);
        npu.set_device_count(0);
        let ascend = open(&npu)?;
        assert_eq!(ascend.device_count()?, 0);
        let err = ascend.device(0).unwrap_err();
        assert!(matches!(err, Error::DeviceUnavailable { op: "Ascend::device", .. }));
        assert!(err.to_string().contains("sees no device"), "{err}");

        npu.reset();
        npu.set_device_count(2);
        drop(ascend);
        let ascend = open(&npu)?;
        let err = ascend.device(2).unwrap_err();
        assert!(err.to_string().contains("2 devices (indices 0 to 1)"), "{err}");
        // The rejected index never reached aclrtSetDevice.
        assert!(!npu.log().iter().any(|c| c.starts_with("aclrtSetDevice")));
        Ok(())
    }

    #[test]
    fn counts_that_make_no_topology_are_refused_with_the_counts() -> Result<()> {
        let _serial = serial();
        let npu = stand_in("odd-counts", Variant::Full);
        npu.set_cores(8, 7);
        let ascend = open(&npu)?;
        let err = ascend.device(0)?.topology().unwrap_err();
        assert!(matches!(err, Error::DeviceUnavailable { op: "AscendDevice::topology", .. }));
        assert!(err.to_string().contains("7 vector cores are not a whole multiple of 8 AI cores"));
        npu.set_cores(-1, 48);
        assert!(ascend.device(0)?.core_counts().unwrap_err().to_string().contains("-1 AI cores"));
        Ok(())
    }

    #[test]
    fn visible_devices_are_honoured() -> Result<()> {
        let _serial = serial();
        let npu = stand_in("visible", Variant::Full);
        npu.set_device_count(4);
        // SAFETY: every test of this binary holds SERIAL, so no other thread reads or writes the
        // environment meanwhile.
        unsafe { std::env::set_var(VISIBLE_DEVICES, "1,3") };
        let outcome = (|| -> Result<()> {
            let ascend = open(&npu)?;
            // The runtime applies the variable: two devices, indices 0 and 1.
            assert_eq!(ascend.device_count()?, 2);
            let device = ascend.device(1)?;
            assert_eq!((device.index(), device.physical_id()), (1, 3));
            let err = ascend.device(2).unwrap_err();
            assert!(err.to_string().contains("ASCEND_RT_VISIBLE_DEVICES=1,3"), "{err}");
            Ok(())
        })();
        // SAFETY: as for `set_var` above.
        unsafe { std::env::remove_var(VISIBLE_DEVICES) };
        outcome
    }

    #[test]
    fn discovery_tries_libascendcl_first_then_the_newer_libacl_rt() -> Result<()> {
        let _serial = serial();
        // Only the newer name present.
        let root = cann_stand_in::scratch_dir("newer-name");
        let newer = AclStandIn::build(&root, "lib64/libacl_rt.so", Variant::Full);
        // SAFETY: the directories searched hold the stand-in, or a CANN install.
        let acl = unsafe { sys::Acl::discover(Some(&root)) }?;
        assert_eq!(acl.path(), newer.path);

        // Both present: the classic name wins.
        let root = cann_stand_in::scratch_dir("both-names");
        let _newer = AclStandIn::build(&root, "lib64/libacl_rt.so", Variant::Full);
        let classic = AclStandIn::build(&root, "lib64/libascendcl.so", Variant::Full);
        // SAFETY: as above.
        let acl = unsafe { sys::Acl::discover(Some(&root)) }?;
        assert_eq!(acl.path(), classic.path);
        let ascend = Ascend::with_library(std::sync::Arc::new(acl))?;
        assert_eq!(ascend.device(0)?.topology()?, Topology::ascend_910b());
        Ok(())
    }

    #[test]
    fn discovery_lists_every_path_tried() {
        let _serial = serial();
        let root = cann_stand_in::scratch_dir("empty-home");
        // SAFETY: the directories searched hold a CANN install when they hold anything.
        match unsafe { sys::Acl::discover(Some(&root)) } {
            Err(Error::LibraryNotFound { library, tried }) => {
                assert!(library.starts_with("AscendCL"));
                let home = root.join("lib64");
                assert_eq!(tried[0], format!("{}/libascendcl.so (no such file)", home.display()));
                assert_eq!(tried[1], format!("{}/libacl_rt.so (no such file)", home.display()));
                for root in sys::INSTALL_ROOTS {
                    for name in sys::ACL_FILE_NAMES {
                        let path = format!("{root}/lib64/{name}");
                        assert!(tried.iter().any(|t| t.starts_with(&path)), "{path} not listed");
                    }
                }
                for name in sys::ACL_FILE_NAMES {
                    let line = format!("{name} on the loader's search path");
                    assert!(tried.iter().any(|t| t.starts_with(&line)), "{line} not listed");
                }
                assert_eq!(tried.len(), 8);
            }
            // A machine with CANN installed finds it in the usual places instead.
            Ok(acl) => assert!(!acl.path().starts_with(&root)),
            Err(e) => panic!("unexpected error: {e}"),
        }
    }

    #[test]
    fn hccl_is_opened_only_when_asked_for_and_beside_ascendcl() -> Result<()> {
        let _serial = serial();
        let dir = cann_stand_in::scratch_dir("hccl-newer-layout");
        let npu = AclStandIn::build(&dir, "libascendcl.so", Variant::Full);
        cann_stand_in::build_hccl(&dir, true);
        let hccl_path = dir.join("libhccl.so");

        let ascend = open(&npu)?;
        assert!(!cann_stand_in::is_loaded(&hccl_path), "HCCL must not open with the runtime");
        let hccl = ascend.hccl()?;
        assert!(cann_stand_in::is_loaded(&hccl_path));
        assert_eq!(hccl.path(), hccl_path);
        // Newer CANN: the communicator calls come from libhcomm.so.
        assert_eq!(hccl.comm_path(), Some(dir.join("libhcomm.so").as_path()));
        assert!(hccl.provides("HcclCommInitRootInfo") && hccl.provides("HcclGetErrorString"));

        let root = result::hccl_root_info(&hccl)?;
        assert!(root.as_bytes().starts_with(b"dist-tensor hccl stand-in root"));
        let err = result::hccl_check(&hccl, "HcclCommInitRootInfo", 1).unwrap_err();
        assert_eq!(
            err.to_string(),
            "HcclCommInitRootInfo failed with status 1: parameter error (stand-in)"
        );
        // Opened once.
        assert!(std::sync::Arc::ptr_eq(&hccl, &ascend.hccl()?));
        Ok(())
    }

    #[test]
    fn hccl_not_found_lists_the_paths_tried() -> Result<()> {
        let _serial = serial();
        let dir = cann_stand_in::scratch_dir("hccl-absent");
        let npu = AclStandIn::build(&dir, "libascendcl.so", Variant::Full);
        let ascend = open(&npu)?;
        match ascend.hccl() {
            Err(Error::LibraryNotFound { library, tried }) => {
                assert!(library.starts_with("HCCL"));
                assert_eq!(tried[0], format!("{}/libhccl.so (no such file)", dir.display()));
                assert!(
                    tried.iter().any(|t| t.starts_with("libhccl.so on the loader's search path"))
                );
            }
            Ok(hccl) => assert!(!hccl.path().starts_with(&dir)),
            Err(e) => panic!("unexpected error: {e}"),
        }
        // The runtime itself is unaffected.
        assert_eq!(ascend.device(0)?.topology()?, Topology::ascend_910b());
        Ok(())
    }

    #[test]
    fn newer_hccl_without_libhcomm_names_the_missing_call() -> Result<()> {
        let _serial = serial();
        let dir = cann_stand_in::scratch_dir("hccl-no-hcomm");
        let npu = AclStandIn::build(&dir, "libascendcl.so", Variant::Full);
        cann_stand_in::build_hccl(&dir, false);
        let ascend = open(&npu)?;
        match ascend.hccl() {
            Err(Error::SymbolMissing { symbol, library }) => {
                assert_eq!(symbol, "HcclGetRootInfo");
                assert!(library.contains("libhccl.so") && library.contains("no libhcomm.so found"));
            }
            Ok(hccl) => panic!("the stand-in's libhccl.so has no communicator calls: {hccl:?}"),
            Err(e) => panic!("unexpected error: {e}"),
        }
        Ok(())
    }
}
