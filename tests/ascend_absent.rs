//! A machine without CANN (this one, and CI): asking for an Ascend device returns the
//! not-found error listing every path tried, and the host works as before.

use std::path::Path;

use dist_tensor::Error;
use dist_tensor::World;
use dist_tensor::device::ascend::{Ascend, AscendWorldBuilder, sys};
use dist_tensor::device::{Device, Topology};

/// Whether this machine has no CANN where the loader looks (the situation these tests check).
fn cann_absent() -> bool {
    let home_set = std::env::var_os(sys::ASCEND_HOME_PATH).is_some();
    let installed = sys::INSTALL_ROOTS.iter().any(|root| Path::new(root).exists());
    if home_set || installed {
        eprintln!("CANN appears to be installed here; the absent-CANN checks do not apply");
    }
    !home_set && !installed
}

/// Every test of this file, named `ascend::*` so that `cargo test ascend` selects them.
mod ascend {
    use super::*;

    #[test]
    fn asking_for_an_ascend_device_lists_every_path_tried() {
        if !cann_absent() {
            return;
        }
        let err = Device::Ascend(0).topology(4).unwrap_err();
        let Error::LibraryNotFound { library, tried } = &err else {
            panic!("expected the library-not-found error, got {err:?}");
        };
        assert_eq!(*library, "AscendCL (libascendcl.so or libacl_rt.so)");
        assert_eq!(
            tried[..5],
            [
                "$ASCEND_HOME_PATH (not set)",
                "/usr/local/Ascend/ascend-toolkit/latest/lib64/libascendcl.so (no such file)",
                "/usr/local/Ascend/ascend-toolkit/latest/lib64/libacl_rt.so (no such file)",
                "/usr/local/Ascend/cann/lib64/libascendcl.so (no such file)",
                "/usr/local/Ascend/cann/lib64/libacl_rt.so (no such file)",
            ],
            "{err}"
        );
        // Then the loader's own search path, with its reason.
        let loader: Vec<&String> =
            tried.iter().filter(|t| t.contains("on the loader's search path")).collect();
        assert_eq!(loader.len(), 2, "{err}");
        assert!(loader[0].starts_with("libascendcl.so on the loader's search path ("));
        assert!(loader[1].starts_with("libacl_rt.so on the loader's search path ("));
        assert!(
            err.to_string()
                .starts_with("AscendCL (libascendcl.so or libacl_rt.so) not found; tried: ")
        );
    }

    #[test]
    fn every_entry_point_gives_the_same_not_found_error() {
        if !cann_absent() {
            return;
        }
        let via_device = Device::Ascend(3).topology(1).unwrap_err().to_string();
        let via_runtime = Ascend::open().unwrap_err().to_string();
        let via_table = sys::Acl::load_default().unwrap_err().to_string();
        assert_eq!(via_device, via_runtime);
        assert_eq!(via_runtime, via_table);
    }

    #[test]
    fn the_host_works_as_before() {
        assert_eq!(Device::default(), Device::Host);
        assert_eq!(Device::Host.topology(2).unwrap(), Topology::host_default(2));
        assert!(Device::Host.ensure_supported("all_gather_matmul").is_ok());
    }

    #[test]
    fn world_ascend_without_cann_names_the_libraries_searched() {
        if !cann_absent() {
            return;
        }
        let err = World::ascend(&[0, 1]).unwrap_err();
        let Error::LibraryNotFound { library, tried } = &err else {
            panic!("expected the library-not-found error, got {err:?}");
        };
        assert_eq!(*library, "AscendCL (libascendcl.so or libacl_rt.so)");
        assert!(tried.iter().any(|t| t.starts_with("/usr/local/Ascend/cann/lib64/libascendcl.so")));
        assert!(tried.iter().any(|t| t.starts_with("libacl_rt.so on the loader's search path")));
        // The same error, whatever the entry point.
        assert_eq!(err.to_string(), Ascend::open().unwrap_err().to_string());
        let built = AscendWorldBuilder::new(&[0]).without_shmem().build().unwrap_err();
        assert_eq!(built.to_string(), err.to_string());
    }

    #[test]
    fn ops_without_an_npu_kernel_say_so() {
        for op in dist_tensor::device::NPU_OPS {
            assert!(Device::Ascend(0).ensure_supported(op).is_ok(), "{op}");
        }
        let err = Device::Ascend(0).ensure_supported("layer_norm").unwrap_err();
        let Error::DeviceUnavailable { op: named, device, reason } = &err else {
            panic!("expected DeviceUnavailable, got {err:?}");
        };
        assert_eq!((*named, device.as_str()), ("layer_norm", "ascend:0"));
        assert!(reason.contains("layer_norm has no NPU kernel"), "{reason}");
        assert!(reason.contains("all_gather_matmul"), "{reason}");
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
