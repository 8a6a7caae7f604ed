//! The shape of a device: how many AI cores, how many vector sub-cores each.

use crate::{Error, Result};

/// How a kernel is launched on an AI core, which decides how many vector sub-cores each program
/// gets. The seed: a kernel with a cube part (`dot`) runs in mix mode, cube:vector 1:2; a kernel
/// without one runs vector-only, 0:1.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LaunchMode {
    /// One cube core with `sub_vec_num` vector sub-cores per program: each program runs once per
    /// vector sub-core, told its `sub_vec_id`.
    Mix,
    /// Vector cores only: each program runs once, as sub-core 0 of 1.
    VectorOnly,
}

/// The core counts of a device (or of the host simulation of one).
///
/// Kernels read these, never constants: the seed's rule is that core counts differ between
/// products and must be queried.
///
/// # Examples
/// ```
/// use dist_tensor::device::Topology;
///
/// let npu = Topology::ascend_910b();
/// assert_eq!((npu.aicore_num(), npu.sub_vec_num(), npu.aivector_core_num()), (24, 2, 48));
/// assert!(Topology::new(0, 2).is_err());
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Topology {
    aicore_num: usize,
    sub_vec_num: usize,
}

impl Topology {
    /// A topology of `aicore_num` AI cores with `sub_vec_num` vector sub-cores each.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when either count is zero.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::device::Topology;
    /// let t = Topology::new(8, 4)?;
    /// assert_eq!(t.aivector_core_num(), 32);
    /// assert!(Topology::new(8, 0).is_err());
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn new(aicore_num: usize, sub_vec_num: usize) -> Result<Self> {
        if aicore_num == 0 || sub_vec_num == 0 {
            return Err(Error::InvalidArgument {
                op: "Topology::new",
                rank: 0,
                reason: format!(
                    "core counts must be positive, got {aicore_num} AI cores x {sub_vec_num} \
                     vector sub-cores"
                ),
            });
        }
        Ok(Topology { aicore_num, sub_vec_num })
    }

    /// An Ascend 910B: 24 AI cores, 48 vector cores (2 per AI core).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::device::Topology;
    /// assert_eq!(Topology::ascend_910b(), Topology::new(24, 2)?);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn ascend_910b() -> Self {
        Topology { aicore_num: 24, sub_vec_num: 2 }
    }

    /// The host default for a world of `world_size` ranks: the machine's cores shared out between
    /// the ranks (at least one AI core each), two vector sub-cores per AI core as on an NPU.
    ///
    /// Mix kernels compute on one sub-core per AI core (sub-core 0 communicates), so their busy
    /// compute programs match the machine's cores unless there are more ranks than cores.
    /// Vector-only kernels (memory-bound copies) run on every vector sub-core, twice the cores:
    /// more copies in flight hide more memory latency.
    /// The communicating sub-cores of mix kernels are threads beside the computing ones, on the
    /// same cores: where the ranks' computing threads fill the machine (the default whenever the
    /// world size divides the cores, and 4 ranks on 2 cores), copies that run beside a GEMM take
    /// their time from it, so the fused products choose their schedule per call from the cores
    /// left over (see [`fused::all_gather_matmul_path`](crate::fused::all_gather_matmul_path)).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::device::Topology;
    /// let t = Topology::host_default(64);
    /// assert_eq!(t.aicore_num(), 1);
    /// assert_eq!(t.sub_vec_num(), 2);
    /// ```
    pub fn host_default(world_size: usize) -> Self {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        Topology { aicore_num: (cores / world_size.max(1)).max(1), sub_vec_num: 2 }
    }

    /// Number of AI cores (`get_aicore_num`).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::device::Topology;
    /// assert_eq!(Topology::new(6, 2)?.aicore_num(), 6);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn aicore_num(&self) -> usize {
        self.aicore_num
    }

    /// Vector sub-cores per AI core (`sub_vec_num`).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::device::Topology;
    /// assert_eq!(Topology::new(6, 2)?.sub_vec_num(), 2);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn sub_vec_num(&self) -> usize {
        self.sub_vec_num
    }

    /// All vector cores (`get_aivector_core_num`).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::device::Topology;
    /// assert_eq!(Topology::new(6, 2)?.aivector_core_num(), 12);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn aivector_core_num(&self) -> usize {
        self.aicore_num * self.sub_vec_num
    }
}
