//! Ranks on many hosts, MPI as the engine (feature `mpi`).
//!
//! A world joined by MPI is one process per rank, started by mpirun (or MPICH's Hydra). MPI says
//! who is who; the ranks of one node (one host, from MPI's shared-memory split, or
//! `DIST_TENSOR_RANKS_PER_NODE` ranks to make several nodes of one host) meet exactly as the
//! processes of a one-host world do (memfd segments passed over an abstract Unix socket, a shared
//! control block, pid watching) and reach each other by pointer. Ranks of other nodes have no
//! pointer here: data reaches them through the proxy thread (see `proxy`), the one caller of MPI
//! in the process (`MPI_THREAD_FUNNELED`: it initialises MPI and ends it), two-sided sends and
//! receives straight into the heap, then a local notify.
//!
//! Start-up, on the proxy thread: `MPI_Init_thread`, `MPI_ERRORS_RETURN` on the communicators, a
//! duplicate of `MPI_COMM_WORLD` for the library's own traffic, the shared-memory split, and one
//! all-gather of each rank's host, settings and liveness address (settings must agree); then the
//! liveness connections (see `liveness`). Back on the calling thread: the node's rendezvous;
//! then the proxy gets the heap and control block and starts its loop. At the end
//! ([`World`](crate::World)'s drop) the proxy announces the rank left, says goodbye to every
//! process of the other nodes, waits for theirs, and calls `MPI_Finalize`.

mod collective;
mod liveness;
mod proxy;
mod raw;
mod throttle;
mod wire;

use std::num::NonZeroU64;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use mpi::topology::Communicator;
use mpi::traits::{AsRaw, CommunicatorCollectives};

use super::control::{Control, RankState};
use super::heap::lock;
use super::job_env::{JOIN_TIMEOUT_ENV, JobEnv, RANKS_PER_NODE_ENV};
use super::mapping::Mapping;
use super::process::{Members, join};
use super::sync::{WaitOutcome, wait_until};
use super::transport::{CollectiveKind, Nodes, Owned, Put, Transport};
use super::world::{Settings, World, WorldKind, WorldShared, env_number};
use crate::shmem::topology::Topology;
use crate::{Error, Result};

use collective::CollTask;
use proxy::{Attach, Inner, Proxy, Request};
use throttle::Throttle;

/// What the proxy learned at start-up.
pub(crate) struct Started {
    rank: usize,
    size: usize,
    nodes: Nodes,
    /// Ranks on this host (the shared-memory split), which share its cores.
    host_size: usize,
}

fn environment(reason: String) -> Error {
    Error::Environment { op: "World::from_env", reason }
}

fn mpi_error(rank: usize, (call, message): raw::Failure) -> Error {
    Error::Mpi { rank, call, message }
}

/// The link of a world to its other nodes: the proxy thread, and what rank threads share with it.
///
/// A group whose members are on several nodes has a link of its own to the same proxy: its puts
/// name the group's heap, which every member registered with its proxy (and retires when the
/// group is dropped).
pub(crate) struct Link {
    inner: Arc<Inner>,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// The heap this link's puts land in: 0 for the world's, else the group's id.
    heap: u64,
}

impl Link {
    /// The link of group `id` (whose heap is `heap`, this rank its member `index`), through this
    /// world's proxy.
    pub(crate) fn for_group(
        &self,
        id: u64,
        heap: Arc<super::heap::Heap>,
        index: usize,
    ) -> Arc<Link> {
        self.inner.register(id, heap, index);
        Arc::new(Link { inner: self.inner.clone(), thread: Mutex::new(None), heap: id })
    }

    /// `put`'s peer is a rank of `world` (a group, maybe of a group): the proxy gets the world's
    /// rank and the heap it writes into.
    pub(crate) fn put(&self, world: &WorldShared, put: &Put) -> Result<()> {
        let peer = super::crossed::root_of(world, put.peer).1;
        self.inner.put(&Put { peer, ..*put }, self.heap);
        Ok(())
    }

    pub(crate) fn quiet(&self, world: &WorldShared, rank: usize) -> Result<()> {
        // The proxy counts puts by the world's ranks, whose states the world's control block has.
        let (root, rank) = super::crossed::root_of(world, rank);
        self.inner.quiet(root, rank)
    }

    pub(crate) fn blocked(&self) -> &AtomicUsize {
        &self.inner.blocked
    }

    /// Runs an MPI collective through the proxy and waits for it (see `Transport::collective`).
    pub(crate) fn collective(
        &self,
        world: &WorldShared,
        rank: usize,
        kind: CollectiveKind,
        buffers: Owned,
    ) -> Result<Owned> {
        let name = kind.name();
        if self.heap != 0 {
            return Err(Error::InvalidArgument {
                op: name,
                rank,
                reason: "an MPI collective (an unfused baseline) runs over the whole world, not \
                         over a group"
                    .into(),
            });
        }
        let task = CollTask::new(kind).map_err(|reason| Error::InvalidArgument {
            op: name,
            rank,
            reason,
        })?;
        let task = Arc::new(task);
        let buffers = Arc::new(Mutex::new(Some(buffers)));
        self.inner.push(Request::Collective(task.clone(), buffers.clone()));
        let control = &world.control;
        let n = world.num_ranks();
        let done = &task.done;
        let outcome = wait_until(
            &world.watch(),
            done,
            || done.value.load(Ordering::Acquire) != 0,
            || {
                let peer = (0..n).find(|&p| p != rank && control.has_left(p, rank))?;
                Some(Error::PeerGone {
                    rank,
                    peer,
                    how: control.how_left(peer),
                    waiting: format!("in {name}"),
                })
            },
        );
        match outcome {
            WaitOutcome::Ready => Ok(lock(&buffers).take().expect("the buffers come back once")),
            WaitOutcome::Failed => Err(world.peer_failed(rank)),
            WaitOutcome::Gone(err) => Err(err),
            WaitOutcome::TimedOut => Err(Error::CallTimeout {
                rank,
                call: name.into(),
                missing: Vec::new(),
                timeout: world.wait_timeout,
            }),
        }
    }

    /// Stops the proxy (it says goodbye to the other nodes and ends MPI) and waits for it.
    pub(crate) fn shutdown(&self, _control: &Control) {
        if self.heap != 0 {
            return; // a group's link: the world's stops the proxy
        }
        self.inner.stop();
        if let Some(thread) = lock(&self.thread).take() {
            let _ = thread.join();
        }
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        if self.heap != 0 {
            self.inner.retire(self.heap);
            return;
        }
        self.inner.stop();
        if let Some(thread) = lock(&self.thread).take() {
            let _ = thread.join();
        }
    }
}

/// This process as a rank of a world joined by MPI (see the module docs).
pub(crate) fn world_from_env(env: &JobEnv) -> Result<World> {
    let settings = Settings::resolve(None, None)?;
    let join_timeout = match env_number(JOIN_TIMEOUT_ENV)? {
        Some(ms) => Duration::from_millis(ms.max(1)),
        None => Duration::from_secs(60),
    };
    let per_node = match env_number(RANKS_PER_NODE_ENV)? {
        Some(0) => {
            return Err(environment(format!("{RANKS_PER_NODE_ENV}=0: a node needs a rank")));
        }
        other => other.map(|k| k as usize),
    };
    let throttle = Throttle::from_env()?;
    let (started_tx, started_rx) = mpsc::channel();
    let (attach_tx, attach_rx) = mpsc::channel::<Option<Attach>>();
    let (capacity, wait_ms) =
        (settings.capacity as u64, settings.wait_timeout.as_millis().min(u64::MAX as u128) as u64);
    let thread = std::thread::Builder::new()
        .name("dist-tensor-mpi".into())
        .spawn(move || {
            crate::shmem::latency::prompt_wakeups();
            proxy_thread(started_tx, attach_rx, capacity, wait_ms, per_node, join_timeout, throttle)
        })
        .map_err(|e| Error::System {
            op: "World::from_env",
            rank: env.rank,
            what: "cannot start the MPI proxy thread".into(),
            source: Arc::new(e),
        })?;
    let started = match started_rx.recv() {
        Ok(started) => started,
        Err(_) => Err(environment("the MPI proxy thread ended during start-up".into())),
    };
    let started = match started {
        Ok(started) => started,
        Err(err) => {
            let _ = thread.join();
            return Err(err);
        }
    };
    let Started { rank: me, size: n, nodes, host_size } = started;
    let node = nodes.node_of(me);
    let members = Members { world_size: n, ranks: nodes.ranks(node).to_vec() };
    let local_env = JobEnv {
        rank: nodes.local_index(me),
        world_size: members.ranks.len(),
        local_rank: nodes.local_index(me),
        local_world_size: members.ranks.len(),
        job_id: format!("{}:mpi-node{node}", env.job_id),
        launcher: env.launcher,
    };
    let joined = Settings { reserved: 0, ..settings }
        .for_ranks(n, nodes.count() > 1)
        .and_then(|settings| join(&local_env, &members, settings, join_timeout));
    let joined = match joined {
        Ok(joined) => joined,
        Err(err) => {
            let _ = attach_tx.send(None);
            let _ = thread.join();
            return Err(err);
        }
    };
    let topology = Topology::host_default(host_size);
    let mut shared = WorldShared::new(joined.heap, joined.control, topology, &joined.settings);
    // A group of this node's ranks meets as processes of one host do.
    shared.kind = WorldKind::Processes { job_id: local_env.job_id.clone(), join_timeout };
    let peers = joined.peers;
    shared.on_tick = Some(Box::new(move |control: &Control| peers.check(control)));
    let view = control_view(&shared.control, n, me)?;
    let inner = Arc::new(Inner::new(me, n));
    let attach = Attach { heap: shared.heap.clone(), control: view, inner: inner.clone() };
    if attach_tx.send(Some(attach)).is_err() {
        let _ = thread.join();
        return Err(environment("the MPI proxy thread ended during start-up".into()));
    }
    let link = Link { inner, thread: Mutex::new(Some(thread)), heap: 0 };
    shared.transport = Transport { nodes, link: Some(Arc::new(link)) };
    let pid = rustix::process::getpid().as_raw_nonzero().get() as u32;
    shared.control.pid(me).store(pid, Ordering::Release);
    shared.control.set_state(me, RankState::Running);
    Ok(World::from_process(shared, me))
}

/// A second mapping of the control block, for the proxy thread.
fn control_view(control: &Control, n: usize, me: usize) -> Result<Control> {
    let system = |what: &str, e: std::io::Error| Error::System {
        op: "World::from_env",
        rank: me,
        what: what.into(),
        source: Arc::new(e),
    };
    let fd = control.mapping().fd().expect("a process world's control block is a memfd");
    let fd = fd.try_clone_to_owned().map_err(|e| system("control block fd", e))?;
    let map = Mapping::from_fd(fd, Control::bytes(n)).map_err(|e| system("control block", e))?;
    Control::open(map, n).map_err(environment)
}

/// Words each rank tells every other at start-up.
const HELLO_WORDS: usize = 12;

/// The proxy thread: starts MPI, learns the world, serves it, ends MPI.
#[allow(clippy::too_many_arguments)]
fn proxy_thread(
    started: mpsc::Sender<proxy::Started>,
    attach: mpsc::Receiver<Option<Attach>>,
    capacity: u64,
    wait_ms: u64,
    per_node: Option<usize>,
    join_timeout: Duration,
    throttle: Option<Throttle>,
) {
    // Naps of tens of microseconds, not the default fifty plus.
    let _ = rustix::thread::set_current_timer_slack(NonZeroU64::new(1_000));
    let Some((universe, threading)) = mpi::initialize_with_threading(mpi::Threading::Funneled)
    else {
        let _ = started.send(Err(environment(
            "MPI is already initialised in this process: a process joins one world by MPI (MPI \
             cannot start twice)"
                .into(),
        )));
        return;
    };
    let world = universe.world();
    let me = world.rank() as usize;
    let fail = |err: Error| {
        let _ = started.send(Err(err));
    };
    if threading < mpi::Threading::Funneled {
        fail(environment(format!(
            "this MPI gives thread level {threading:?}; the proxy needs MPI_THREAD_FUNNELED"
        )));
        std::mem::forget(universe);
        return;
    }
    let setup = || -> Result<_> {
        raw::errors_return(world.as_raw()).map_err(|f| mpi_error(me, f))?;
        let comm = world.duplicate();
        raw::errors_return(comm.as_raw()).map_err(|f| mpi_error(me, f))?;
        let n = world.size() as usize;
        let host = world.split_shared(me as i32);
        let host_size = host.size() as usize;
        let mut host_ranks = vec![0u64; host_size];
        host.all_gather_into(&(me as u64), &mut host_ranks[..]);
        let host_label = host_ranks.iter().copied().min().unwrap_or(me as u64);
        let (listener, port) = liveness::listen().map_err(|e| Error::System {
            op: "World::from_env",
            rank: me,
            what: "cannot listen for the liveness connections".into(),
            source: Arc::new(e),
        })?;
        let name = mpi::environment::processor_name().unwrap_or_else(|_| "localhost".into());
        let address = liveness::Address { host: name, port };
        let mut mine = vec![host_label, capacity, wait_ms];
        mine.extend(address.to_words());
        let mut all = vec![0u64; n * HELLO_WORDS];
        world.all_gather_into(&mine[..], &mut all[..]);
        let hello = |r: usize| &all[r * HELLO_WORDS..(r + 1) * HELLO_WORDS];
        for r in 0..n {
            if hello(r)[1] != capacity || hello(r)[2] != wait_ms {
                return Err(environment(format!(
                    "ranks disagree on their settings: rank {r} has a heap of {} bytes and a \
                     wait timeout of {} ms, rank {me} {capacity} bytes and {wait_ms} ms (set \
                     DIST_TENSOR_HEAP_BYTES and DIST_TENSOR_WAIT_TIMEOUT_MS alike everywhere)",
                    hello(r)[1],
                    hello(r)[2]
                )));
            }
        }
        let hosts: Vec<u64> = (0..n).map(|r| hello(r)[0]).collect();
        let labels: Vec<usize> = match per_node {
            Some(k) => {
                let labels: Vec<usize> = (0..n).map(|r| r / k).collect();
                if let Some(r) = (0..n).find(|&r| hosts[r] != hosts[labels[r] * k]) {
                    return Err(environment(format!(
                        "{RANKS_PER_NODE_ENV}={k} puts rank {r} on a node with rank {}, but they \
                         are on different hosts: a node's ranks must share memory",
                        labels[r] * k
                    )));
                }
                labels
            }
            None => hosts.iter().map(|&h| h as usize).collect(),
        };
        let nodes = Nodes::from_labels(&labels);
        let my_node = nodes.node_of(me);
        let remote: Vec<usize> = (0..n).filter(|&r| nodes.node_of(r) != my_node).collect();
        let addresses: Vec<liveness::Address> =
            (0..n).map(|r| liveness::Address::from_words(&hello(r)[3..])).collect();
        let same_host: Vec<bool> = hosts.iter().map(|&h| h == hosts[me]).collect();
        let watch = liveness::Liveness::connect(
            me,
            listener,
            &addresses,
            &same_host,
            &remote,
            join_timeout,
        )
        .map_err(|reason| {
            environment(format!("rank {me}: liveness connections to other nodes: {reason}"))
        })?;
        Ok((comm, host, nodes, host_size, watch))
    };
    let (comm, host, nodes, host_size, watch) = match setup() {
        Ok(parts) => parts,
        Err(err) => {
            fail(err);
            // Without finalizing: the job cannot go on, and mpirun ends it.
            std::mem::forget(universe);
            return;
        }
    };
    let n = nodes.num_ranks();
    let _ = started.send(Ok(Started { rank: me, size: n, nodes: nodes.clone(), host_size }));
    let Ok(Some(attach)) = attach.recv() else {
        std::mem::forget((comm, host, universe));
        return;
    };
    let proxy = Proxy::new(comm.as_raw(), nodes, attach, watch, throttle);
    let clean = proxy.run();
    if clean {
        drop((comm, host, world));
        drop(universe); // MPI_Finalize
    } else {
        eprintln!(
            "dist-tensor: rank {me}: leaving MPI without MPI_Finalize (the world failed, or a \
             peer did not say goodbye): the launcher ends the job"
        );
        std::mem::forget((comm, host, universe));
    }
}
