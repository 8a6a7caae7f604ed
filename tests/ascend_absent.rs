//! A machine without CANN (this one, and CI): asking for an Ascend device returns the
//! not-found error listing every path tried, and the host works as before. Where CANN is
//! installed, the same tests check that it is found instead.

use std::path::PathBuf;

use dist_tensor::Error;
use dist_tensor::World;
use dist_tensor::device::ascend::{Ascend, AscendWorldBuilder, sys};
use dist_tensor::device::capability::Op;
use dist_tensor::device::{Device, Topology};

/// `$ASCEND_HOME_PATH` when set and not empty, as the loader reads it.
fn ascend_home() -> Option<PathBuf> {
    std::env::var_os(sys::ASCEND_HOME_PATH).filter(|v| !v.is_empty()).map(PathBuf::from)
}

/// The AscendCL files of the search order that exist on this machine: none where CANN is absent
/// (the situation these tests are about); where there are some, the tests check that the runtime
/// is found instead.
fn installed_runtime_files() -> Vec<PathBuf> {
    sys::search_order(ascend_home().as_deref(), &sys::ACL_FILE_NAMES)
        .into_iter()
        .filter(|path| path.is_absolute() && path.exists())
        .collect()
}

/// The library of AscendCL's not-found error.
const ACL: &str = "AscendCL (libascendcl.so or libacl_rt.so)";

/// What asking for an Ascend device gave. Where CANN is installed: fails on an error that
/// `missing` says is a library not found, and gives `None`. Where it is absent (the case of
/// these tests): the error, which must be AscendCL's not-found error, and the paths it tried.
fn acl_not_found<T: std::fmt::Debug>(
    result: dist_tensor::Result<T>,
    missing: impl Fn(&Error) -> bool,
) -> Option<(Error, Vec<String>)> {
    let installed = installed_runtime_files();
    if !installed.is_empty() {
        if let Err(e) = &result
            && missing(e)
        {
            panic!("AscendCL is installed at {installed:?}, yet: {e}");
        }
        return None;
    }
    let err = result.unwrap_err();
    let Error::LibraryNotFound { library, tried } = &err else {
        panic!("expected the library-not-found error, got {err:?}");
    };
    assert_eq!(*library, ACL);
    let tried = tried.clone();
    Some((err, tried))
}

/// Every test of this file, named `ascend::*` so that `cargo test ascend` selects them.
mod ascend {
    use super::*;

    #[test]
    fn asking_for_an_ascend_device_lists_every_path_tried() {
        // Where CANN is installed, the runtime must be found (a device may still be missing, or
        // the driver fail): no library may be missing.
        let missing = |e: &Error| matches!(e, Error::LibraryNotFound { .. });
        let Some((err, tried)) = acl_not_found(Device::Ascend(0).topology(4), missing) else {
            return;
        };
        // `$ASCEND_HOME_PATH` (or that it is not set), then every install root, each file name...
        let home = ascend_home();
        let mut want: Vec<String> = Vec::new();
        if home.is_none() {
            want.push("$ASCEND_HOME_PATH (not set)".into());
        }
        if let Some(home) = &home {
            for name in sys::ACL_FILE_NAMES {
                want.push(format!("{} (no such file)", home.join("lib64").join(name).display()));
            }
        }
        want.extend([
            "/usr/local/Ascend/ascend-toolkit/latest/lib64/libascendcl.so (no such file)"
                .to_string(),
            "/usr/local/Ascend/ascend-toolkit/latest/lib64/libacl_rt.so (no such file)".to_string(),
            "/usr/local/Ascend/cann/lib64/libascendcl.so (no such file)".to_string(),
            "/usr/local/Ascend/cann/lib64/libacl_rt.so (no such file)".to_string(),
        ]);
        assert_eq!(tried[..want.len()], want[..], "{err}");
        // ...then the loader's own search path, with its reason.
        assert_eq!(tried.len(), want.len() + 2, "{err}");
        assert!(
            tried[want.len()].starts_with("libascendcl.so on the loader's search path ("),
            "{err}"
        );
        assert!(
            tried[want.len() + 1].starts_with("libacl_rt.so on the loader's search path ("),
            "{err}"
        );
        assert!(
            err.to_string()
                .starts_with("AscendCL (libascendcl.so or libacl_rt.so) not found; tried: ")
        );
    }

    #[test]
    fn every_entry_point_gives_the_same_not_found_error() {
        let via_table = sys::Acl::load_default();
        let via_runtime = Ascend::open();
        let installed = installed_runtime_files();
        if !installed.is_empty() {
            // The table loads from one of the installed files, and opening the runtime does not
            // report it missing.
            let table = via_table
                .unwrap_or_else(|e| panic!("AscendCL is installed at {installed:?}, yet: {e}"));
            assert!(
                installed.iter().any(|p| p == table.path()),
                "{:?} not in {installed:?}",
                table.path()
            );
            assert!(table.provides("aclInit"));
            if let Err(e @ Error::LibraryNotFound { .. }) = &via_runtime {
                panic!(
                    "the table loaded from {}, yet Ascend::open says: {e}",
                    table.path().display()
                );
            }
            return;
        }
        let via_device = Device::Ascend(3).topology(1).unwrap_err().to_string();
        let via_runtime = via_runtime.unwrap_err().to_string();
        let via_table = via_table.unwrap_err().to_string();
        assert!(via_table.contains("not found; tried: "), "{via_table}");
        assert_eq!(via_device, via_runtime);
        assert_eq!(via_runtime, via_table);
    }

    #[test]
    fn the_host_works_as_before() {
        assert_eq!(Device::default(), Device::Host);
        assert_eq!(Device::Host.topology(2).unwrap(), Topology::host_default(2));
        assert!(Device::Host.ensure_supported(Op::AllGatherMatmul).is_ok());
    }

    #[test]
    fn world_ascend_without_cann_names_the_libraries_searched() {
        // Where CANN is installed, AscendCL must be found.
        let missing = |e: &Error| matches!(e, Error::LibraryNotFound { library: ACL, .. });
        let Some((err, tried)) = acl_not_found(World::ascend(&[0, 1]), missing) else {
            return;
        };
        assert!(tried.iter().any(|t| t.starts_with("/usr/local/Ascend/cann/lib64/libascendcl.so")));
        assert!(tried.iter().any(|t| t.starts_with("libacl_rt.so on the loader's search path")));
        // The same error, whatever the entry point.
        assert_eq!(err.to_string(), Ascend::open().unwrap_err().to_string());
        let built = AscendWorldBuilder::new(&[0]).without_shmem().build().unwrap_err();
        assert_eq!(built.to_string(), err.to_string());
    }

    #[test]
    fn ops_without_an_npu_kernel_say_so() {
        // Every op of the table has an Ascend C kernel but the expert-parallel pair, which the
        // same table refuses, typed.
        for op in Op::ALL {
            let on_npu = Device::Ascend(0).ensure_supported(op);
            match op {
                Op::MoeDispatch | Op::MoeCombine => {
                    let err = on_npu.unwrap_err();
                    assert!(err.to_string().contains("has no NPU kernel"), "{op}: {err}");
                }
                _ => assert!(on_npu.is_ok(), "{op}"),
            }
        }
        // The GPU has no all_to_all_v kernel: the same table says so, typed.
        let err = Device::Cuda(0).ensure_supported(Op::AllToAllV).unwrap_err();
        let Error::DeviceUnavailable { op: named, device, reason } = &err else {
            panic!("expected DeviceUnavailable, got {err:?}");
        };
        assert_eq!((*named, device.as_str()), ("all_to_all_v", "cuda"));
        assert!(reason.contains("all_to_all_v has no GPU kernel"), "{reason}");
        assert!(reason.contains("all_gather_matmul"), "{reason}");
        assert!(err.to_string().starts_with("all_to_all_v: device cuda unavailable: "), "{err}");
    }

    #[test]
    fn devices_parse_from_text() {
        assert_eq!("host".parse::<Device>().unwrap(), Device::Host);
        assert_eq!("ascend:7".parse::<Device>().unwrap(), Device::Ascend(7));
        assert_eq!("npu".parse::<Device>().unwrap(), Device::Ascend(0));
        let err = "ascend:-1".parse::<Device>().unwrap_err();
        assert!(matches!(err, Error::InvalidArgument { op: "Device::from_str", .. }));
    }
}
