//! Compiled kernels, kept for the life of a world, and the argument list of one launch.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use super::KernelSource;
use crate::device::ascend::npu::lock;
use crate::device::ascend::result;
use crate::device::ascend::sys::Rtc;
use crate::{Error, Result};

/// What identifies a compiled binary: the kernel, and every option it was compiled with (the
/// architecture, the element type, the include directories).
type Key = (&'static str, String);

/// One entry: compiled at most once, however many ranks ask for it at the same time.
type Entry = Arc<OnceLock<Result<Arc<Vec<u8>>>>>;

/// Device binaries compiled by `aclrtc`, by kernel and options: each kernel is compiled at its
/// first use and then loaded on every device from the same bytes.
#[derive(Default)]
pub(crate) struct KernelCache {
    entries: Mutex<HashMap<Key, Entry>>,
}

impl KernelCache {
    /// The binary of `source` compiled with `options`, compiling it if no rank has yet. The
    /// first result (binary or error) is kept: a source that does not compile fails the same
    /// way on every later call, with the same log.
    pub(crate) fn binary(
        &self,
        rtc: &Rtc,
        source: &KernelSource,
        options: &[String],
    ) -> Result<Arc<Vec<u8>>> {
        let key = (source.name(), options.join(" "));
        let entry = lock(&self.entries).entry(key).or_default().clone();
        entry
            .get_or_init(|| {
                result::rtc::compile(rtc, source.name(), &source.assemble(), options).map(Arc::new)
            })
            .clone()
    }
}

/// The arguments of one launch, each checked against the kernel's parameter list as it is
/// added: the launcher names every argument, and a name or kind out of the kernel's order is an
/// error at the launch, not a kernel reading the wrong pointer.
pub(crate) struct KernelArgs {
    kernel: &'static str,
    params: Vec<(String, String)>,
    values: Vec<[u8; 8]>,
    problem: Option<String>,
}

impl KernelArgs {
    pub(crate) fn new(source: &KernelSource) -> KernelArgs {
        KernelArgs {
            kernel: source.name(),
            params: source.params(),
            values: Vec::new(),
            problem: None,
        }
    }

    fn push(mut self, name: &str, kind: &str, bytes: [u8; 8]) -> KernelArgs {
        if self.problem.is_none() {
            let at = self.values.len();
            match self.params.get(at) {
                Some((param, ty)) if param == name && ty == kind => self.values.push(bytes),
                Some((param, ty)) => {
                    self.problem = Some(format!(
                        "argument {at} is `{kind} {name}`, the kernel's parameter {at} is `{ty} {param}`"
                    ))
                }
                None => {
                    self.problem = Some(format!(
                        "argument {at} (`{name}`) is past the kernel's {} parameters",
                        self.params.len()
                    ))
                }
            }
        }
        self
    }

    /// A device pointer (`GM_ADDR`).
    pub(crate) fn ptr(self, name: &str, ptr: super::super::npu::Handle) -> KernelArgs {
        self.push(name, "GM_ADDR", (ptr.0 as u64).to_ne_bytes())
    }

    /// A scalar (`int64_t`).
    pub(crate) fn int(self, name: &str, value: usize) -> KernelArgs {
        let value = i64::try_from(value).unwrap_or(i64::MAX);
        self.push(name, "int64_t", value.to_ne_bytes())
    }

    /// The values in order, or the error naming the first argument that does not match.
    pub(crate) fn finish(self) -> Result<Vec<[u8; 8]>> {
        let problem = self.problem.or_else(|| {
            (self.values.len() != self.params.len()).then(|| {
                format!(
                    "{} arguments for the kernel's {} parameters (next: `{}`)",
                    self.values.len(),
                    self.params.len(),
                    self.params[self.values.len()].0
                )
            })
        });
        match problem {
            None => Ok(self.values),
            Some(reason) => Err(Error::InvalidArgument {
                op: "Ascend kernel launch",
                rank: 0,
                reason: format!("kernel {}: {reason}", self.kernel),
            }),
        }
    }
}
