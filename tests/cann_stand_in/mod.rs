//! Builds the CANN **test stand-ins** (the `*_stand_in.c` files beside this file) and drives
//! their test controls.
//!
//! The stand-ins are small C libraries exporting the AscendCL, `aclrtc`, Ascend SHMEM, HCCL and
//! `aclnn` symbols that `dist_tensor::device::ascend` loads, so that the run-time loader and the
//! NPU dispatch can be exercised end to end on machines without CANN. They run no kernel and
//! compute nothing: they record every call (in one shared log, kept by the AscendCL stand-in)
//! and answer as the vendor's headers say. They are compiled here, by the tests, with the system
//! C compiler (`$CC`, or `cc`) into a scratch directory under `target/`, and are used by nothing
//! but the `tests/ascend_*.rs` files. `ascendc/` holds a declared surface of Ascend C's device
//! API, for compiling the kernel sources with the host compiler (syntax only).
//!
//! [`CannStandIn::build_executing`] builds the same stand-ins with `-DSTANDIN_EXECUTE`: the
//! executing CANN. Its `aclrtc` compiles the kernel source the crate sends with the host C++
//! compiler against `ascendc_cpu/` (a CPU implementation of the Ascend C and Ascend SHMEM device
//! calls the kernels use, with its pipes, unified buffer, cube server and rule checks) into a
//! shared object, cached under `target/tmp/ascend_kernel_cache/`; its AscendCL loads that object
//! and runs a launch on CPU threads, one per core, with the device's core counts.
//!
//! What both sides declare alike is written once beside them: `ascendc_types.h` and
//! `ascendc_matmul_type.h` (types of Ascend C the surface and `ascendc_cpu/` share) and
//! `standin_launch_info.h` (what the executing AscendCL hands a launch of `ascendc_cpu/`).

// Each test file uses a different part of this helper.
#![allow(dead_code)]

use std::ffi::{CStr, CString, c_char, c_int};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Which AscendCL stand-in to build.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Variant {
    /// Every symbol the crate uses.
    Full,
    /// Without `aclrtGetDeviceInfo`, as an older CANN.
    NoDeviceInfo,
    /// Without the required `aclrtSetDevice`.
    NoSetDevice,
    /// Without the kernel-launch calls of CANN 8.3 (`aclrtBinaryLoadFromData`, ...).
    NoKernelCalls,
}

impl Variant {
    fn defines(self) -> &'static [&'static str] {
        match self {
            Variant::Full => &[],
            Variant::NoDeviceInfo => &["-DSTANDIN_NO_DEVICE_INFO"],
            Variant::NoSetDevice => &["-DSTANDIN_NO_SET_DEVICE"],
            Variant::NoKernelCalls => &["-DSTANDIN_NO_KERNEL_CALLS"],
        }
    }
}

fn source(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/cann_stand_in").join(name)
}

/// A fresh, empty scratch directory for one test, unique to this process.
pub fn scratch_dir(tag: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("cann_stand_in")
        .join(format!("{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create the stand-in's scratch directory");
    dir
}

/// The CPU implementation of the Ascend C subset the executing stand-in compiles kernels against.
pub fn ascendc_cpu_dir() -> PathBuf {
    source("ascendc_cpu")
}

/// Why the executing stand-in cannot run kernels here: its `aclrtc` compiles them with the host
/// C++ compiler (`$CXX`, or `c++`, through the shell), and there is none. `None` where there is
/// one. The tests that run kernels on the stand-in say they skipped, with this, instead of
/// failing on a machine that has only the Rust toolchain (CI installs one: they run there).
pub fn no_cxx_compiler() -> Option<String> {
    let compiler =
        std::env::var("CXX").ok().filter(|c| !c.trim().is_empty()).unwrap_or_else(|| "c++".into());
    let found = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!("{compiler} --version"))
        .output()
        .is_ok_and(|out| out.status.success());
    (!found).then(|| {
        format!("no C++ compiler ({compiler}) for the stand-in's aclrtc to compile Ascend C with")
    })
}

/// Where the executing `aclrtc` keeps the kernels it compiled (by hash of source and options),
/// across test runs.
pub fn kernel_cache_dir() -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join("ascend_kernel_cache")
}

/// Compiles `source_name` into the shared library `out`.
fn compile(source_name: &str, out: &Path, defines: &[&str]) {
    if let Some(parent) = out.parent() {
        std::fs::create_dir_all(parent).expect("create the stand-in's directory");
    }
    let compiler = std::env::var("CC").unwrap_or_else(|_| "cc".to_string());
    let output = Command::new(&compiler)
        .args(["-shared", "-fPIC", "-O1", "-o"])
        .arg(out)
        .arg(source(source_name))
        .args(defines)
        .arg("-ldl")
        .arg("-lpthread")
        .output()
        .unwrap_or_else(|e| panic!("cannot run the C compiler {compiler:?}: {e}"));
    assert!(
        output.status.success(),
        "building the CANN test stand-in {source_name} failed:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// A built AscendCL stand-in, held open so its test controls can be called.
pub struct AclStandIn {
    /// The library file.
    pub path: PathBuf,
    library: libloading::Library,
}

impl AclStandIn {
    /// Builds `variant` as `dir/file_name` (such as `lib64/libascendcl.so`) and opens it.
    pub fn build(dir: &Path, file_name: &str, variant: Variant) -> AclStandIn {
        let path = dir.join(file_name);
        compile("acl_stand_in.c", &path, variant.defines());
        // SAFETY: the stand-in was just built from acl_stand_in.c; its only initialiser resets
        // its own state.
        let library = unsafe { libloading::Library::new(&path) }.expect("open the stand-in");
        AclStandIn { path, library }
    }

    /// Calls a `standin_` control.
    fn control<T: Copy>(&self, name: &str) -> T {
        // SAFETY: every control is looked up with the type of its definition in
        // acl_stand_in.c (each call site below names it).
        unsafe { *self.library.get::<T>(name.as_bytes()).expect("stand-in control") }
    }

    /// Back to the defaults (1 device of 24 AI and 48 vector cores), log cleared.
    pub fn reset(&self) {
        let f: unsafe extern "C" fn() = self.control("standin_reset");
        // SAFETY: `void standin_reset(void)`.
        unsafe { f() }
    }

    /// How many devices the stand-in reports.
    pub fn set_device_count(&self, count: u32) {
        let f: unsafe extern "C" fn(u32) = self.control("standin_set_device_count");
        // SAFETY: `void standin_set_device_count(uint32_t)`.
        unsafe { f(count) }
    }

    /// The core counts of every device.
    pub fn set_cores(&self, ai_cores: i64, vector_cores: i64) {
        let f: unsafe extern "C" fn(i64, i64) = self.control("standin_set_cores");
        // SAFETY: `void standin_set_cores(int64_t, int64_t)`.
        unsafe { f(ai_cores, vector_cores) }
    }

    /// The chip name the stand-in reports.
    pub fn set_soc_name(&self, name: &str) {
        let f: unsafe extern "C" fn(*const c_char) = self.control("standin_set_soc_name");
        let name = CString::new(name).unwrap();
        // SAFETY: `void standin_set_soc_name(const char *)`, which copies the string.
        unsafe { f(name.as_ptr()) }
    }

    /// Makes `call` fail with `code` from now on, with `message` for `aclGetRecentErrMsg`.
    pub fn fail(&self, call: &str, code: i32, message: &str) {
        let f: unsafe extern "C" fn(*const c_char, c_int, *const c_char) =
            self.control("standin_fail");
        let (call, message) = (CString::new(call).unwrap(), CString::new(message).unwrap());
        // SAFETY: `void standin_fail(const char *, int, const char *)`, which copies both.
        unsafe { f(call.as_ptr(), code, message.as_ptr()) }
    }

    /// When `kernel` is launched, copy `data` to the address passed as its argument `arg`.
    pub fn on_launch(&self, kernel: &str, arg: usize, data: &[u8]) {
        let f: unsafe extern "C" fn(*const c_char, c_int, *const u8, usize) =
            self.control("standin_on_launch");
        let kernel = CString::new(kernel).unwrap();
        // SAFETY: `void standin_on_launch(const char *, int, const void *, size_t)`, which copies
        // both.
        unsafe { f(kernel.as_ptr(), arg as c_int, data.as_ptr(), data.len()) }
    }

    /// The unified buffer of every vector core (executing stand-in only).
    pub fn set_ub_bytes(&self, bytes: u64) {
        let f: unsafe extern "C" fn(u64) = self.control("standin_set_ub_bytes");
        // SAFETY: `void standin_set_ub_bytes(uint64_t)`.
        unsafe { f(bytes) }
    }

    /// Device `d`'s kernels start `d * ms` milliseconds late (executing stand-in only).
    pub fn set_launch_stagger(&self, ms: i32) {
        let f: unsafe extern "C" fn(c_int) = self.control("standin_set_launch_stagger");
        // SAFETY: `void standin_set_launch_stagger(int)`.
        unsafe { f(ms) }
    }

    /// Every call so far, in order.
    pub fn log(&self) -> Vec<String> {
        let f: unsafe extern "C" fn() -> *const c_char = self.control("standin_log");
        // SAFETY: `const char *standin_log(void)` returns the stand-in's NUL-terminated log.
        let text = unsafe { CStr::from_ptr(f()) }.to_string_lossy().into_owned();
        text.split(';').filter(|s| !s.is_empty()).map(str::to_string).collect()
    }
}

/// Builds the HCCL stand-ins in `dir`: `libhccl.so` without the communicator calls, and, when
/// `with_hcomm`, `libhcomm.so` with them (the newer CANN layout).
pub fn build_hccl(dir: &Path, with_hcomm: bool) {
    compile("hccl_stand_in.c", &dir.join("libhccl.so"), &[]);
    if with_hcomm {
        compile("hccl_stand_in.c", &dir.join("libhcomm.so"), &["-DSTANDIN_COMM_CALLS"]);
    }
}

/// Whether this process has `path` mapped (Linux: `/proc/self/maps`).
pub fn is_loaded(path: &Path) -> bool {
    let maps = std::fs::read_to_string("/proc/self/maps").expect("read /proc/self/maps");
    let wanted = path.canonicalize().unwrap_or_else(|_| path.to_path_buf());
    maps.lines().any(|line| line.ends_with(&*wanted.to_string_lossy()))
}

/// The whole stand-in CANN in one directory, as an install's `lib64` holds it: AscendCL,
/// `aclrtc`, Ascend SHMEM, HCCL (with `libhcomm.so`) and the operator library.
pub struct CannStandIn {
    /// The directory.
    pub dir: PathBuf,
    /// The AscendCL stand-in, with the controls.
    pub acl: AclStandIn,
    shmem: libloading::Library,
    /// The executing `aclrtc`, held open so that its controls' state lives as long as this.
    rtc: Option<libloading::Library>,
}

impl CannStandIn {
    /// Builds every stand-in into `dir`, the AscendCL one as `variant`.
    pub fn build(dir: &Path, variant: Variant) -> CannStandIn {
        let acl = AclStandIn::build(dir, "libascendcl.so", variant);
        compile("rtc_stand_in.c", &dir.join("libacl_rtc.so"), &[]);
        compile("shmem_stand_in.c", &dir.join("libshmem.so"), &[]);
        compile("nnop_stand_in.c", &dir.join("libopapi.so"), &[]);
        build_hccl(dir, true);
        // SAFETY: the stand-in was just built from shmem_stand_in.c; its initialiser only clears
        // its own table.
        let shmem = unsafe { libloading::Library::new(dir.join("libshmem.so")) }.expect("open");
        CannStandIn { dir: dir.to_path_buf(), acl, shmem, rtc: None }
    }

    /// Builds the executing stand-ins into `dir`: kernels are compiled for the CPU and run.
    pub fn build_executing(dir: &Path) -> CannStandIn {
        let execute = ["-DSTANDIN_EXECUTE"];
        let path = dir.join("libascendcl.so");
        compile("acl_stand_in.c", &path, &execute);
        // SAFETY: the stand-in was just built from acl_stand_in.c; its only initialiser resets
        // its own state.
        let library = unsafe { libloading::Library::new(&path) }.expect("open the stand-in");
        let acl = AclStandIn { path, library };
        let ascendc =
            format!("-DSTANDIN_ASCENDC_DIR={:?}", ascendc_cpu_dir().display().to_string());
        let cache = format!("-DSTANDIN_CACHE_DIR={:?}", kernel_cache_dir().display().to_string());
        compile("rtc_stand_in.c", &dir.join("libacl_rtc.so"), &[execute[0], &ascendc, &cache]);
        compile("shmem_stand_in.c", &dir.join("libshmem.so"), &[]);
        compile("nnop_stand_in.c", &dir.join("libopapi.so"), &[]);
        build_hccl(dir, true);
        // SAFETY: as in `build`.
        let shmem = unsafe { libloading::Library::new(dir.join("libshmem.so")) }.expect("open");
        // SAFETY: the aclrtc stand-in just built; its initialisers do nothing.
        let rtc = unsafe { libloading::Library::new(dir.join("libacl_rtc.so")) }.expect("open");
        CannStandIn { dir: dir.to_path_buf(), acl, shmem, rtc: Some(rtc) }
    }

    /// Makes the executing `aclrtc` compile `kernel` with every `from` replaced by `to` (a
    /// mutated copy of the kernel, for negative controls); a compile error if `from` is absent.
    pub fn mutate(&self, kernel: &str, from: &str, to: &str) {
        let rtc = self.rtc();
        // SAFETY: `void standin_rtc_mutate(const char *, const char *, const char *)`, defined in
        // rtc_stand_in.c, which copies its arguments.
        let f = unsafe {
            *rtc.get::<unsafe extern "C" fn(*const c_char, *const c_char, *const c_char)>(
                b"standin_rtc_mutate",
            )
            .expect("stand-in control")
        };
        let (kernel, from, to) =
            (CString::new(kernel).unwrap(), CString::new(from).unwrap(), CString::new(to).unwrap());
        // SAFETY: as above.
        unsafe { f(kernel.as_ptr(), from.as_ptr(), to.as_ptr()) }
    }

    /// Back to the kernels as the crate sends them.
    pub fn clear_mutations(&self) {
        let rtc = self.rtc();
        // SAFETY: `void standin_rtc_clear_mutations(void)`, defined in rtc_stand_in.c.
        let f = unsafe {
            *rtc.get::<unsafe extern "C" fn()>(b"standin_rtc_clear_mutations")
                .expect("stand-in control")
        };
        // SAFETY: as above.
        unsafe { f() }
    }

    fn rtc(&self) -> &libloading::Library {
        self.rtc.as_ref().expect("the executing stand-in (build_executing)")
    }

    /// Makes the SHMEM stand-in keep one PE for the whole process (the last initialised), as a
    /// library with process-wide state would; `false` goes back to one PE per device.
    pub fn shmem_process_global(&self, on: bool) {
        // SAFETY: `void standin_shmem_process_global(int)`, defined in shmem_stand_in.c.
        let f = unsafe {
            *self
                .shmem
                .get::<unsafe extern "C" fn(c_int)>(b"standin_shmem_process_global")
                .expect("stand-in control")
        };
        // SAFETY: as above.
        unsafe { f(c_int::from(on)) }
    }
}
