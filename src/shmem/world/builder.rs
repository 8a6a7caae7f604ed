//! [`WorldBuilder`]: a world's settings before it is made, from code or the environment.

use std::sync::Arc;
use std::time::Duration;

use super::{World, WorldShared};
use crate::shmem::control::Control;
use crate::shmem::device_runtime::{DeviceRuntime, OpenDevice};
use crate::shmem::exchange::reserved_bytes;
use crate::shmem::heap::{Heap, segment_bytes};
use crate::shmem::mapping::Mapping;
use crate::shmem::topology::Topology;
use crate::{Error, Result};

/// Default capacity of each rank's heap segment. Address space only: untouched pages cost nothing.
pub const DEFAULT_HEAP_BYTES: usize = 1 << 30;
/// Default time a wait gives a peer before it reports a timeout.
pub const DEFAULT_WAIT_TIMEOUT: Duration = Duration::from_secs(60);
/// Environment variable that overrides the heap capacity per rank, in bytes.
pub const HEAP_BYTES_ENV: &str = "DIST_TENSOR_HEAP_BYTES";
/// Environment variable that overrides the wait timeout, in milliseconds (at least 1).
pub const WAIT_TIMEOUT_ENV: &str = "DIST_TENSOR_WAIT_TIMEOUT_MS";

/// Settings of a [`World`] before it is made.
///
/// # Examples
/// ```
/// use std::time::Duration;
/// use dist_tensor::{device::Topology, World};
///
/// let world = World::builder(2)
///     .heap_capacity(64 << 20)
///     .topology(Topology::ascend_910b())
///     .wait_timeout(Duration::from_secs(5))
///     .build()?;
/// assert_eq!(world.topology().aicore_num(), 24);
/// # Ok::<(), dist_tensor::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct WorldBuilder {
    num_ranks: usize,
    heap_capacity: Option<usize>,
    topology: Option<Topology>,
    wait_timeout: Option<Duration>,
    device: Option<DeviceSetup>,
}

/// How a builder puts its world on a device (a backend's part; see `device_runtime`).
#[derive(Clone)]
pub(crate) enum DeviceSetup {
    /// A device world the backend opened already (an NPU world's builder does).
    Opened(Arc<dyn DeviceRuntime>),
    /// Opened when the world is built, for its rank count and wait timeout, by the backend
    /// named here (for the builder's `Debug`).
    Open { backend: &'static str, open: OpenDevice },
}

impl std::fmt::Debug for DeviceSetup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceSetup::Opened(device) => write!(f, "Opened({})", device.device_of(0)),
            DeviceSetup::Open { backend, .. } => write!(f, "Open({backend})"),
        }
    }
}

pub(crate) fn env_number(name: &'static str) -> Result<Option<u64>> {
    match std::env::var(name) {
        Ok(text) => text.trim().parse().map(Some).map_err(|_| Error::InvalidArgument {
            op: "World::build",
            rank: 0,
            reason: format!("{name}={text:?} is not a whole number"),
        }),
        Err(_) => Ok(None),
    }
}

impl WorldBuilder {
    /// Capacity of each rank's heap segment in bytes (default [`DEFAULT_HEAP_BYTES`], or the
    /// environment variable [`HEAP_BYTES_ENV`](crate::shmem::HEAP_BYTES_ENV)).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::World;
    /// let world = World::builder(2).heap_capacity(1 << 20).build()?;
    /// assert!(world.heap_capacity() <= 1 << 20); // less what the runtime keeps for barriers
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn heap_capacity(mut self, bytes: usize) -> Self {
        self.heap_capacity = Some(bytes);
        self
    }

    /// The topology each rank's simulated device has (default [`Topology::host_default`]).
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{device::Topology, World};
    /// let world = World::builder(2).topology(Topology::new(4, 2)?).build()?;
    /// assert_eq!(world.topology().aivector_core_num(), 8);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn topology(mut self, topology: Topology) -> Self {
        self.topology = Some(topology);
        self
    }

    /// How long a wait gives a peer (default [`DEFAULT_WAIT_TIMEOUT`], or the environment variable
    /// [`WAIT_TIMEOUT_ENV`](crate::shmem::WAIT_TIMEOUT_ENV) in milliseconds). Code wins over the environment.
    ///
    /// # Examples
    /// ```
    /// use std::time::Duration;
    /// use dist_tensor::World;
    /// let world = World::builder(2).wait_timeout(Duration::from_millis(500)).build()?;
    /// let seen = world.run(|rank| Ok(rank.wait_timeout()))?;
    /// assert_eq!(seen, vec![Duration::from_millis(500); 2]);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn wait_timeout(mut self, timeout: Duration) -> Self {
        self.wait_timeout = Some(timeout);
        self
    }

    /// Runs the ranks' kernels on a device backend instead of the host simulation (used by the
    /// device worlds' constructors, such as `World::ascend` and `WorldBuilder::cuda`).
    pub(crate) fn device_setup(mut self, device: DeviceSetup) -> Self {
        self.device = Some(device);
        self
    }

    /// Makes the world: maps the heap segments.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a world of zero ranks, an environment override that is not
    /// a number, or a heap that cannot be mapped.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::World;
    /// assert!(World::builder(0).build().is_err());
    /// assert_eq!(World::builder(3).build()?.num_ranks(), 3);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn build(self) -> Result<World> {
        let n = self.num_ranks;
        if n == 0 {
            return Err(Error::InvalidArgument {
                op: "World::build",
                rank: 0,
                reason: "a world needs at least one rank".into(),
            });
        }
        if n > crate::shmem::job_env::MAX_WORLD_SIZE {
            return Err(Error::InvalidArgument {
                op: "World::build",
                rank: 0,
                reason: format!(
                    "{n} ranks: more than the {} a world may have",
                    crate::shmem::job_env::MAX_WORLD_SIZE
                ),
            });
        }
        let settings =
            Settings::resolve(self.heap_capacity, self.wait_timeout)?.for_ranks(n, false)?;
        let heap = Heap::anonymous(n, settings.capacity, settings.reserved)?;
        let control =
            Mapping::anonymous(Control::bytes(n)).map_err(|e| Error::InvalidArgument {
                op: "World::build",
                rank: 0,
                reason: format!("cannot map the control block: {e}"),
            })?;
        let topology = self.topology.unwrap_or_else(|| Topology::host_default(n));
        let mut shared = WorldShared::new(heap, Control::create(control, n), topology, &settings);
        shared.device = match self.device {
            None => None,
            Some(DeviceSetup::Opened(device)) => Some(device),
            Some(DeviceSetup::Open { open, .. }) => Some(open(n, settings.wait_timeout)?),
        };
        Ok(World { shared: Arc::new(shared), here: None })
    }
}

/// A world's settings, from the builder or else the environment, checked.
pub(crate) struct Settings {
    pub(crate) capacity: usize,
    pub(crate) reserved: usize,
    pub(crate) wait_timeout: Duration,
}

impl Settings {
    pub(crate) fn resolve(
        heap_capacity: Option<usize>,
        wait_timeout: Option<Duration>,
    ) -> Result<Settings> {
        crate::tensor::pool::check_env()?;
        let capacity = match heap_capacity {
            Some(bytes) => bytes,
            None => env_number(HEAP_BYTES_ENV)?.map_or(DEFAULT_HEAP_BYTES, |b| b as usize),
        };
        let wait_timeout = match wait_timeout {
            Some(t) => t,
            None => match env_number(WAIT_TIMEOUT_ENV)? {
                Some(0) => {
                    return Err(Error::InvalidArgument {
                        op: "World::build",
                        rank: 0,
                        reason: format!(
                            "{WAIT_TIMEOUT_ENV}=0: a wait timeout of 0 ms fails healthy runs; \
                             give at least 1"
                        ),
                    });
                }
                Some(ms) => Duration::from_millis(ms),
                None => DEFAULT_WAIT_TIMEOUT,
            },
        };
        if wait_timeout.is_zero() {
            return Err(Error::InvalidArgument {
                op: "World::build",
                rank: 0,
                reason: "a wait timeout of zero fails healthy runs".into(),
            });
        }
        Ok(Settings { capacity, reserved: 0, wait_timeout })
    }

    /// With the runtime's reserved part for `num_ranks` ranks (on several nodes: `inboxes`), and
    /// the capacity rounded.
    pub(crate) fn for_ranks(mut self, num_ranks: usize, inboxes: bool) -> Result<Settings> {
        let reserved = reserved_bytes(num_ranks, inboxes);
        let (capacity, reserved) = segment_bytes(self.capacity, reserved)?;
        self.capacity = capacity;
        self.reserved = reserved;
        Ok(self)
    }
}

impl World {
    /// Settings for a world of `num_ranks` ranks.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::World;
    /// let world = World::builder(4).build()?;
    /// assert_eq!(world.num_ranks(), 4);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn builder(num_ranks: usize) -> WorldBuilder {
        WorldBuilder {
            num_ranks,
            heap_capacity: None,
            topology: None,
            wait_timeout: None,
            device: None,
        }
    }
}
