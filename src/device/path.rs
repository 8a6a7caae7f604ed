//! The paths a device backend's fused kernels take (today the GPUs'), as enums: chosen by shape
//! unless the call's options ask for one ([`MatmulOptions`](crate::MatmulOptions)), which is how
//! a report measures both paths on one shape and a test runs each. Every rank must ask for the
//! same path: it travels in the op's agreement exchange.

use std::fmt;

/// The path of `all_gather_matmul` on GPUs.
///
/// # Examples
/// ```
/// use dist_tensor::fused::AgPath;
/// assert_eq!(AgPath::Overlap.to_string(), "overlap");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AgPath {
    /// One rank: one GEMM.
    Local,
    /// Few rows per rank (decoding): one kernel pushes every rank's rows to every rank, then one
    /// GEMM per weight over all rows reads the weight once.
    Gather,
    /// Copy engines push the rows while this rank's own rows are multiplied, then each peer's
    /// rows as they arrive.
    Overlap,
}

/// The path of `matmul_reduce_scatter` on GPUs.
///
/// # Examples
/// ```
/// use dist_tensor::fused::RsPath;
/// assert_eq!(RsPath::Chunked.to_string(), "chunked");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RsPath {
    /// One rank: one GEMM.
    Local,
    /// Few rows per rank: one GEMM over all rows (the weight read once), then the partials move.
    Single,
    /// One GEMM per destination rank, each partial moving while the next is computed.
    Chunked,
}

impl AgPath {
    /// The word the agreement exchange carries (0: chosen by shape).
    pub(crate) fn word(path: Option<AgPath>) -> u64 {
        path.map_or(0, |p| p as u64 + 1)
    }
}

impl RsPath {
    /// The word the agreement exchange carries (0: chosen by shape).
    pub(crate) fn word(path: Option<RsPath>) -> u64 {
        path.map_or(0, |p| p as u64 + 1)
    }
}

impl fmt::Display for AgPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            AgPath::Local => "local",
            AgPath::Gather => "gather",
            AgPath::Overlap => "overlap",
        })
    }
}

impl fmt::Display for RsPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            RsPath::Local => "local",
            RsPath::Single => "single",
            RsPath::Chunked => "chunked",
        })
    }
}
