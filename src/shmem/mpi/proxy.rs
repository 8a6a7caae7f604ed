//! The proxy thread: the one caller of MPI in its process, which keeps transfers moving while the
//! rank's kernels compute.
//!
//! Rank threads (the rank's host code and its programs) hand it requests through a queue: puts
//! (rows to a peer on another node, then a signal there) and, for the unfused baselines, MPI
//! collectives. Its loop, over and over:
//!
//! 1. looks at this process's rank in the node's control block (its state, runs entered, the
//!    node's first failure, node peers found dead);
//! 2. takes the queued requests and starts them: a put is one control message (with the rows
//!    inline when small, copied when the put was made), then data messages straight from the
//!    source (`MPI_Isend` with a strided datatype);
//! 3. tells every process of the other nodes what changed in step 1 (after the puts of step 2,
//!    so a peer that sees a rank return has seen everything it sent);
//! 4. receives control messages (`MPI_Improbe`): a put's small rows are copied into the heap, a
//!    large put's data receives are posted straight into the heap (`MPI_Irecv`, strided);
//! 5. completes what finished, in order per source: a put's signal is applied (release, then the
//!    waiters' doorbell) only once its rows are in memory; states and goodbyes after everything
//!    the source sent before them;
//! 6. every few milliseconds, looks for processes of other nodes that died (see `liveness`).
//!
//! It never blocks in MPI. While a transfer or an MPI collective is in flight, it polls without
//! sleeping (yielding the core): MPI moves data only while it is called. While only a rank thread
//! waits (or a throttled put its turn), it naps 10 to 50 microseconds; inside a run with nothing in
//! flight, for tens of microseconds; outside runs, for up to two milliseconds, or until a request
//! wakes it.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::collective::{CollTask, Running as RunningColl};
use super::liveness::Liveness;
use super::raw::{self, Block, Comm, Failure, TAG_CTRL, TAG_DATA};
use super::throttle::Throttle;
use super::wire::{INLINE_BYTES, Message, pieces};
use crate::shmem::control::{Control, POST_WORDS, RankState};
use crate::shmem::heap::{Heap, lock};
use crate::shmem::signal::{apply, cell};
use crate::shmem::sync::{Cell, WaitOutcome, wait_until};
use crate::shmem::transport::{Nodes, Owned, Put};
use crate::shmem::world::WorldShared;
use crate::{Error, Result};

/// How often the proxy looks for dead processes of other nodes.
const LIVENESS_EVERY: Duration = Duration::from_millis(5);
/// How long a rank's post must stay the same before the proxy relays it (see `post_to_relay`).
const POST_RELAY_AFTER: Duration = Duration::from_millis(50);
/// Naps when idle: with transfers in flight or a rank thread waiting (first and longest), inside
/// a run with nothing in flight, and outside runs. A request wakes a napping proxy at once.
const HOT_NAP: Duration = Duration::from_micros(10);
const HOT_NAP_MAX: Duration = Duration::from_micros(50);
const WARM_NAP: Duration = Duration::from_micros(40);
const WARM_NAP_MAX: Duration = Duration::from_micros(500);
const COLD_NAP: Duration = Duration::from_millis(2);
/// How long a failed world's processes wait for each other's goodbyes before leaving MPI
/// unfinalized (mpirun then ends the job).
const FAILED_GOODBYE: Duration = Duration::from_secs(5);

/// A put's source rows, read by the proxy until the put's data messages complete.
pub(crate) struct Source {
    ptr: *const u8,
    stride: usize,
    rows: usize,
    row_bytes: usize,
}

// SAFETY: the pointer is only read, by the proxy thread, while the rank that made the put keeps
// the memory unchanged (until its `quiet` returns: the put's contract).
unsafe impl Send for Source {}

/// What rank threads ask of the proxy.
pub(crate) enum Request {
    Put {
        peer: usize,
        control: Vec<u8>,
        data: Option<Source>,
    },
    /// An MPI collective, and the buffers it works on (kept alive while MPI may use them).
    Collective(Arc<CollTask>, Arc<Mutex<Option<Owned>>>),
}

/// What the rank threads and the proxy share.
pub(crate) struct Inner {
    pub(crate) me: usize,
    queue: Mutex<VecDeque<Request>>,
    nudge: Condvar,
    napping: AtomicBool,
    /// Puts whose source the proxy reads (large ones), made and done; `quiet` waits on `done`.
    issued: AtomicU64,
    done: Cell,
    pending_to: Vec<AtomicU64>,
    /// Rank threads blocked in a wait: the proxy polls hard while any is.
    pub(crate) blocked: AtomicUsize,
    stop: AtomicBool,
    /// The heaps of this process's groups whose members are on several nodes, by group id, with
    /// this rank's index in each: a put from another node names the heap it writes into.
    heaps: Mutex<HashMap<u64, (Arc<Heap>, usize)>>,
    /// Groups this rank has dropped: a late put into one is received and thrown away.
    retired: Mutex<HashSet<u64>>,
}

impl Inner {
    pub(crate) fn new(me: usize, n: usize) -> Inner {
        Inner {
            me,
            queue: Mutex::new(VecDeque::new()),
            nudge: Condvar::new(),
            napping: AtomicBool::new(false),
            issued: AtomicU64::new(0),
            done: Cell::new(),
            pending_to: (0..n).map(|_| AtomicU64::new(0)).collect(),
            blocked: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
            heaps: Mutex::new(HashMap::new()),
            retired: Mutex::new(HashSet::new()),
        }
    }

    /// Makes group `id`'s heap (this rank is member `index` of it) the target of the puts from
    /// other nodes that name it; those that came first wait in the proxy until now.
    pub(crate) fn register(&self, id: u64, heap: Arc<Heap>, index: usize) {
        lock(&self.heaps).insert(id, (heap, index));
        self.wake();
    }

    /// This rank dropped group `id`: puts that still name it are thrown away.
    pub(crate) fn retire(&self, id: u64) {
        lock(&self.retired).insert(id);
        lock(&self.heaps).remove(&id);
    }

    /// Where a put into heap `id` goes: this rank's segment of it (`Some`), nowhere (the group is
    /// gone: `Some(None)`), or not known yet (`None`: the group is still being made here).
    fn target(&self, id: u64) -> Option<Option<(Arc<Heap>, usize)>> {
        if let Some((heap, index)) = lock(&self.heaps).get(&id) {
            return Some(Some((heap.clone(), *index)));
        }
        lock(&self.retired).contains(&id).then_some(None)
    }

    pub(crate) fn push(&self, request: Request) {
        lock(&self.queue).push_back(request);
        if self.napping.load(Ordering::SeqCst) {
            self.nudge.notify_one();
        }
    }

    pub(crate) fn wake(&self) {
        if self.napping.load(Ordering::SeqCst) {
            let _guard = lock(&self.queue);
            self.nudge.notify_one();
        }
    }

    /// Hands `put` (its peer a rank of the world, into that rank's segment of heap `heap`: 0 for
    /// the world's, else a group's id) to the proxy: small rows are copied now (the source is
    /// free at once), large ones are sent from the source later (`quiet` waits for them).
    pub(crate) fn put(&self, put: &Put, heap: u64) {
        let bytes = put.bytes();
        let inline = bytes <= INLINE_BYTES;
        let payload = inline.then(|| {
            let mut payload = Vec::with_capacity(bytes);
            for row in 0..put.rows {
                // SAFETY: the put's contract: `rows` rows of `row_bytes` bytes, `src_stride`
                // apart, readable and unchanged while the put is made.
                let from = unsafe {
                    std::slice::from_raw_parts(put.src.add(row * put.src_stride), put.row_bytes)
                };
                payload.extend_from_slice(from);
            }
            payload
        });
        let message = Message::Put {
            heap,
            dst_offset: put.dst_offset,
            dst_stride: put.dst_stride,
            rows: put.rows,
            row_bytes: put.row_bytes,
            signal: put.signal,
            inline: payload,
        };
        let data = (!inline).then(|| {
            self.issued.fetch_add(1, Ordering::SeqCst);
            self.pending_to[put.peer].fetch_add(1, Ordering::SeqCst);
            Source {
                ptr: put.src,
                stride: put.src_stride,
                rows: put.rows,
                row_bytes: put.row_bytes,
            }
        });
        self.push(Request::Put { peer: put.peer, control: message.encode(), data });
    }

    /// Waits until every large put made so far has left its source.
    pub(crate) fn quiet(&self, world: &WorldShared, rank: usize) -> Result<()> {
        let target = self.issued.load(Ordering::SeqCst);
        let done = &self.done;
        if done.value.load(Ordering::Acquire) >= target {
            return Ok(());
        }
        let pending = || -> Vec<usize> {
            (0..self.pending_to.len())
                .filter(|&p| self.pending_to[p].load(Ordering::Acquire) > 0)
                .collect()
        };
        let control = &world.control;
        let outcome = wait_until(
            &world.watch(),
            done,
            || done.value.load(Ordering::Acquire) >= target,
            || {
                let peer = pending().into_iter().find(|&p| control.has_left(p, rank))?;
                Some(Error::PeerGone {
                    rank,
                    peer,
                    how: control.how_left(peer),
                    waiting: "for its puts to that rank to leave (quiet)".into(),
                })
            },
        );
        match outcome {
            WaitOutcome::Ready => Ok(()),
            WaitOutcome::Failed => Err(world.peer_failed(rank)),
            WaitOutcome::Gone(err) => Err(err),
            WaitOutcome::TimedOut => Err(Error::CallTimeout {
                rank,
                call: "quiet (puts to other nodes still in flight)".into(),
                missing: pending(),
                timeout: world.wait_timeout,
            }),
        }
    }

    /// Asks the proxy to finish: it tells the other nodes and ends MPI.
    pub(crate) fn stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
        self.wake();
    }
}

/// What the proxy gets from the world it serves.
pub(crate) struct Attach {
    pub(crate) heap: Arc<Heap>,
    pub(crate) control: Control,
    pub(crate) inner: Arc<Inner>,
}

/// A send in flight: its requests, and what they read.
struct SendOp {
    requests: Vec<raw::Request>,
    _control: Vec<u8>,
    /// The peer, for a put whose source the rank keeps for it.
    borrowed_for: Option<usize>,
}

/// What to do once a source's earlier transfers to this process are complete.
enum Action {
    /// A signal at a byte offset of this rank's segment (its index) of a heap.
    Signal(Arc<Heap>, usize, usize, crate::shmem::SignalOp),
    State {
        rank: usize,
        state: u32,
        runs: u32,
    },
    Post {
        rank: usize,
        words: [u64; POST_WORDS],
    },
    Bye,
}

/// A receive in flight (or an action waiting behind one), in arrival order per source.
struct RecvOp {
    requests: Vec<raw::Request>,
    action: Option<Action>,
    /// What the requests write into: the heap (kept mapped until they complete), or a scratch
    /// buffer for a put into a group this rank already dropped.
    _into: Option<Arc<Heap>>,
    _scratch: Vec<u8>,
}

/// What this process last told the other nodes.
struct Announced {
    state: u32,
    runs: u32,
    died: Vec<bool>,
    failure: bool,
    /// The rank's post last relayed, and the one seen now with since when it has not changed.
    post: [u64; POST_WORDS],
    seen_post: ([u64; POST_WORDS], Instant),
}

/// The proxy's own state, on its thread.
pub(crate) struct Proxy {
    inner: Arc<Inner>,
    comm: Comm,
    me: usize,
    nodes: Nodes,
    remote: Vec<usize>,
    heap: Arc<Heap>,
    control: Control,
    sends: Vec<SendOp>,
    receives: Vec<VecDeque<RecvOp>>,
    /// Per source, control messages that wait (with everything the source sent after them) for a
    /// group heap this process has not registered yet.
    stalled: Vec<VecDeque<Message>>,
    collectives: Vec<RunningColl>,
    deferred: VecDeque<(Instant, Request)>,
    throttle: Option<Throttle>,
    liveness: Liveness,
    last_liveness: Instant,
    announced: Announced,
    goodbyes: Vec<bool>,
}

impl Proxy {
    pub(crate) fn new(
        comm: Comm,
        nodes: Nodes,
        attach: Attach,
        liveness: Liveness,
        throttle: Option<Throttle>,
    ) -> Proxy {
        let inner = attach.inner;
        let me = inner.me;
        let n = nodes.num_ranks();
        let my_node = nodes.node_of(me);
        let remote = (0..n).filter(|&r| nodes.node_of(r) != my_node).collect();
        Proxy {
            inner,
            comm,
            me,
            nodes,
            remote,
            heap: attach.heap,
            control: attach.control,
            sends: Vec::new(),
            receives: (0..n).map(|_| VecDeque::new()).collect(),
            stalled: (0..n).map(|_| VecDeque::new()).collect(),
            collectives: Vec::new(),
            deferred: VecDeque::new(),
            throttle,
            liveness,
            last_liveness: Instant::now(),
            announced: Announced {
                state: u32::MAX,
                runs: 0,
                died: vec![false; n],
                failure: false,
                post: [0; POST_WORDS],
                seen_post: ([0; POST_WORDS], Instant::now()),
            },
            goodbyes: vec![false; n],
        }
    }

    /// Runs until asked to stop, then says goodbye. Returns whether every peer of the other
    /// nodes said goodbye (or died), so that `MPI_Finalize` cannot hang.
    pub(crate) fn run(mut self) -> bool {
        let mut idle = 0u32;
        let mut healthy = true;
        while !self.inner.stop.load(Ordering::SeqCst) {
            match self.step() {
                Ok(true) => idle = 0,
                Ok(false) => {
                    idle = idle.saturating_add(1);
                    self.rest(idle);
                }
                Err(failure) => {
                    self.fatal(failure);
                    healthy = false;
                    break;
                }
            }
        }
        if !healthy {
            // MPI failed here: the world is failed; wait for the stop without touching MPI.
            while !self.inner.stop.load(Ordering::SeqCst) {
                self.watch_liveness();
                std::thread::sleep(COLD_NAP);
            }
            return false;
        }
        self.leave()
    }

    /// One round of the loop; whether anything happened.
    fn step(&mut self) -> std::result::Result<bool, Failure> {
        let seen = self.look();
        let mut progressed = self.drain()?;
        // A state goes after every put made before it; throttled puts wait in `deferred`, so
        // states wait for them (the next round looks again).
        if self.deferred.is_empty() {
            progressed |= self.announce(seen)?;
        }
        progressed |= self.unstall()?;
        progressed |= self.receive()?;
        progressed |= self.complete()?;
        if self.last_liveness.elapsed() >= LIVENESS_EVERY {
            self.watch_liveness();
        }
        Ok(progressed)
    }

    fn hot(&self) -> bool {
        !self.sends.is_empty()
            || self.receives.iter().any(|q| !q.is_empty())
            || self.stalled.iter().any(|q| !q.is_empty())
            || !self.collectives.is_empty()
            || !self.deferred.is_empty()
            || self.inner.blocked.load(Ordering::Relaxed) > 0
    }

    /// Between rounds that did nothing: spin, yield or nap by how busy the process is.
    fn rest(&self, idle: u32) {
        if idle < 32 {
            std::hint::spin_loop();
            return;
        }
        if idle < 64 {
            std::thread::yield_now();
            return;
        }
        if !self.collectives.is_empty()
            || !self.sends.is_empty()
            || self.receives.iter().any(|q| !q.is_empty())
        {
            // An MPI transfer moves on only while MPI is called: poll it flat out.
            std::thread::yield_now();
            return;
        }
        // Naps that grow while nothing happens, shortest while something is in flight: a
        // polling proxy takes a core from the kernels it serves (2 cores, 4 ranks: measured).
        let naps = (idle - 64).min(8);
        let nap = if self.hot() {
            (HOT_NAP * (1 << naps)).min(HOT_NAP_MAX)
        } else {
            match self.control.state(self.me) {
                RankState::Running => (WARM_NAP * (1 << naps)).min(WARM_NAP_MAX),
                _ => COLD_NAP,
            }
        };
        let nap = match self.deferred.front() {
            Some((at, _)) => nap.min(at.saturating_duration_since(Instant::now())),
            None => nap,
        };
        self.inner.napping.store(true, Ordering::SeqCst);
        let queue = lock(&self.inner.queue);
        if queue.is_empty() && !self.inner.stop.load(Ordering::SeqCst) {
            let _ = self.inner.nudge.wait_timeout(queue, nap);
        }
        self.inner.napping.store(false, Ordering::SeqCst);
    }

    /// What to tell the other nodes, as the control block has it now.
    fn look(&self) -> (u32, u32, Vec<usize>, Option<(usize, String)>) {
        let state = self.control.state(self.me) as u32;
        let runs = self.control.runs(self.me).load(Ordering::Acquire);
        let my_node = self.nodes.node_of(self.me);
        let died = self
            .nodes
            .ranks(my_node)
            .iter()
            .copied()
            .filter(|&r| !self.announced.died[r] && self.control.state(r) == RankState::Died)
            .collect();
        let failure = if self.announced.failure {
            None
        } else {
            self.control.first_failure().filter(|(r, _)| self.nodes.node_of(*r) == my_node)
        };
        (state, runs, died, failure)
    }

    fn announce(
        &mut self,
        (state, runs, died, failure): (u32, u32, Vec<usize>, Option<(usize, String)>),
    ) -> std::result::Result<bool, Failure> {
        let mut messages = Vec::new();
        // The post first: a peer that sees this rank return sees its last call.
        if let Some(post) = self.post_to_relay(state) {
            self.announced.post = post;
            messages.push(Message::Post { rank: self.me, words: post });
        }
        if (state, runs) != (self.announced.state, self.announced.runs) {
            self.announced.state = state;
            self.announced.runs = runs;
            messages.push(Message::State { rank: self.me, state, runs });
        }
        for rank in died {
            self.announced.died[rank] = true;
            let runs = self.control.runs(rank).load(Ordering::Acquire);
            messages.push(Message::State { rank, state: RankState::Died as u32, runs });
        }
        if let Some((rank, reason)) = failure {
            self.announced.failure = true;
            messages.push(Message::Fail { rank, reason });
        }
        let any = !messages.is_empty();
        for message in messages {
            self.broadcast(&message)?;
        }
        Ok(any)
    }

    /// This rank's post, when the other nodes should see it now: a wait that has lasted
    /// [`POST_RELAY_AFTER`] (the look for a cycle waits longer than that), the end of a relayed
    /// wait (at once, so that no stale wait lingers there), and the last call of a rank that left
    /// its run. Calls that do not block for long are never relayed: no traffic for them.
    fn post_to_relay(&mut self, state: u32) -> Option<[u64; POST_WORDS]> {
        let post = self.control.post_words(self.me)?;
        let now = Instant::now();
        if post != self.announced.seen_post.0 {
            self.announced.seen_post = (post, now);
        }
        let relayed = &self.announced.post;
        let due = Control::words_blocked(relayed)
            || state != RankState::Running as u32
            || now >= self.announced.seen_post.1 + POST_RELAY_AFTER;
        (post != *relayed && due).then_some(post)
    }

    /// Sends a control message to every process of the other nodes (but those found dead).
    fn broadcast(&mut self, message: &Message) -> std::result::Result<(), Failure> {
        let bytes = message.encode();
        for i in 0..self.remote.len() {
            let peer = self.remote[i];
            if self.control.state(peer) != RankState::Died {
                self.send_control(peer, bytes.clone(), None)?;
            }
        }
        Ok(())
    }

    fn send_control(
        &mut self,
        peer: usize,
        control: Vec<u8>,
        data: Option<Source>,
    ) -> std::result::Result<(), Failure> {
        let block = Block::rows(control.as_ptr() as *mut u8, 1, control.len(), control.len())?;
        let mut requests = vec![raw::isend(self.comm, &block, peer, TAG_CTRL)?];
        let borrowed_for = data.as_ref().map(|_| peer);
        if let Some(source) = data {
            for piece in pieces(source.rows, source.row_bytes) {
                // SAFETY: inside the source rows (the put's contract keeps them readable).
                let at = unsafe {
                    source.ptr.add(piece.first_row * source.stride + piece.col) as *mut u8
                };
                let block = Block::rows(at, piece.rows, piece.bytes, source.stride)?;
                requests.push(raw::isend(self.comm, &block, peer, TAG_DATA)?);
            }
        }
        self.sends.push(SendOp { requests, _control: control, borrowed_for });
        Ok(())
    }

    /// Starts the queued requests (those the throttle lets go).
    fn drain(&mut self) -> std::result::Result<bool, Failure> {
        let taken: Vec<Request> = lock(&self.inner.queue).drain(..).collect();
        let mut progressed = !taken.is_empty();
        for request in taken {
            match (&mut self.throttle, request) {
                (Some(throttle), Request::Put { peer, control, data }) => {
                    let bytes = data.as_ref().map_or(control.len(), |s| s.rows * s.row_bytes);
                    let at = throttle.release_at(bytes);
                    self.deferred.push_back((at, Request::Put { peer, control, data }));
                }
                (_, request) => self.start(request)?,
            }
        }
        let now = Instant::now();
        while self.deferred.front().is_some_and(|(at, _)| *at <= now) {
            let (_, request) = self.deferred.pop_front().expect("a front");
            self.start(request)?;
            progressed = true;
        }
        Ok(progressed)
    }

    fn start(&mut self, request: Request) -> std::result::Result<(), Failure> {
        match request {
            Request::Put { peer, control, data } => self.send_control(peer, control, data),
            Request::Collective(task, buffers) => {
                let running = task.start(self.comm, buffers)?;
                self.collectives.push(running);
                Ok(())
            }
        }
    }

    /// Receives the control messages that have arrived.
    fn receive(&mut self) -> std::result::Result<bool, Failure> {
        let mut progressed = false;
        for _ in 0..256 {
            let Some((source, bytes)) = raw::probe_control(self.comm)? else { break };
            progressed = true;
            let Some(message) = Message::decode(&bytes) else {
                return Err((
                    format!("a message from rank {source}"),
                    format!("{} bytes that are not a dist-tensor control message", bytes.len()),
                ));
            };
            let waits = match &message {
                // A failure is news at once.
                Message::Fail { .. } => false,
                Message::Put { heap, .. } => !self.stalled[source].is_empty() || !self.known(*heap),
                _ => !self.stalled[source].is_empty(),
            };
            if waits {
                self.stalled[source].push_back(message);
            } else {
                self.handle(source, message)?;
            }
        }
        Ok(progressed)
    }

    /// Whether a put into heap `heap` can be handled now: the world's, or a group's this rank
    /// registered (or dropped).
    fn known(&self, heap: u64) -> bool {
        heap == 0 || self.inner.target(heap).is_some()
    }

    /// Handles the stalled messages whose group heap is now registered (or dropped), in order.
    fn unstall(&mut self) -> std::result::Result<bool, Failure> {
        let mut progressed = false;
        for source in 0..self.stalled.len() {
            while let Some(front) = self.stalled[source].front() {
                if let Message::Put { heap, .. } = front
                    && !self.known(*heap)
                {
                    break;
                }
                let message = self.stalled[source].pop_front().expect("a front");
                self.handle(source, message)?;
                progressed = true;
            }
        }
        Ok(progressed)
    }

    fn handle(&mut self, source: usize, message: Message) -> std::result::Result<(), Failure> {
        let op = match message {
            Message::Put { heap, dst_offset, dst_stride, rows, row_bytes, signal, inline } => {
                let target = match heap {
                    0 => Some((self.heap.clone(), self.me)),
                    id => self.inner.target(id).expect("a stalled put waits for its heap"),
                };
                let Some((heap, index)) = target else {
                    // Into a group this rank dropped: nothing waits for it any more; its data
                    // messages are received (MPI matches them in order) and thrown away.
                    let mut scratch =
                        vec![0u8; if inline.is_some() { 0 } else { rows * row_bytes }];
                    let mut requests = Vec::new();
                    if inline.is_none() && !scratch.is_empty() {
                        for piece in pieces(rows, row_bytes) {
                            let at = piece.first_row * row_bytes + piece.col;
                            // SAFETY: inside the scratch buffer, which the receive keeps.
                            let ptr = unsafe { scratch.as_mut_ptr().add(at) };
                            let block = Block::rows(ptr, piece.rows, piece.bytes, row_bytes)?;
                            requests.push(raw::irecv(self.comm, &block, source, TAG_DATA)?);
                        }
                    }
                    let op = RecvOp { requests, action: None, _into: None, _scratch: scratch };
                    self.receives[source].push_back(op);
                    return Ok(());
                };
                let base = heap.base(index);
                let end =
                    dst_offset + if rows == 0 { 0 } else { (rows - 1) * dst_stride + row_bytes };
                if end > heap.capacity() {
                    return Err((
                        format!("a put from rank {source}"),
                        format!("bytes {dst_offset}..{end} are outside the heap segment"),
                    ));
                }
                if let Some(payload) = &inline
                    && payload.len() != rows * row_bytes
                {
                    return Err((
                        format!("a put from rank {source}"),
                        format!(
                            "{} inline bytes for {rows} rows of {row_bytes} bytes",
                            payload.len()
                        ),
                    ));
                }
                let mut requests = Vec::new();
                match inline {
                    Some(payload) => {
                        for row in 0..rows {
                            // SAFETY: inside this rank's segment (checked above); the sender's
                            // contract keeps this rank's threads off these bytes until the signal.
                            unsafe {
                                std::ptr::copy_nonoverlapping(
                                    payload.as_ptr().add(row * row_bytes),
                                    base.add(dst_offset + row * dst_stride),
                                    row_bytes,
                                )
                            };
                        }
                    }
                    None => {
                        for piece in pieces(rows, row_bytes) {
                            let at = dst_offset + piece.first_row * dst_stride + piece.col;
                            // SAFETY: inside this rank's segment (checked above).
                            let ptr = unsafe { base.add(at) };
                            let block = Block::rows(ptr, piece.rows, piece.bytes, dst_stride)?;
                            requests.push(raw::irecv(self.comm, &block, source, TAG_DATA)?);
                        }
                    }
                }
                let action =
                    signal.map(|(offset, op)| Action::Signal(heap.clone(), index, offset, op));
                RecvOp { requests, action, _into: Some(heap), _scratch: Vec::new() }
            }
            Message::State { rank, state, runs } => RecvOp {
                requests: Vec::new(),
                action: Some(Action::State { rank, state, runs }),
                _into: None,
                _scratch: Vec::new(),
            },
            Message::Fail { rank, reason } => {
                // A failure is news at once, whatever is still in flight.
                self.control.fail(rank, &reason);
                return Ok(());
            }
            Message::Post { rank, words } => RecvOp {
                requests: Vec::new(),
                action: Some(Action::Post { rank, words }),
                _into: None,
                _scratch: Vec::new(),
            },
            Message::Bye => RecvOp {
                requests: Vec::new(),
                action: Some(Action::Bye),
                _into: None,
                _scratch: Vec::new(),
            },
        };
        self.receives[source].push_back(op);
        Ok(())
    }

    /// Completes what finished: receives in order per source, sends, collectives.
    fn complete(&mut self) -> std::result::Result<bool, Failure> {
        let mut progressed = false;
        for source in 0..self.receives.len() {
            while let Some(front) = self.receives[source].front_mut() {
                let mut k = 0;
                while k < front.requests.len() {
                    if raw::test(&mut front.requests[k], || {
                        format!("a receive from rank {source}")
                    })? {
                        front.requests.swap_remove(k);
                    } else {
                        k += 1;
                    }
                }
                if !front.requests.is_empty() {
                    break;
                }
                let op = self.receives[source].pop_front().expect("a front");
                progressed = true;
                if let Some(action) = op.action {
                    self.act(source, action);
                }
            }
        }
        let mut k = 0;
        while k < self.sends.len() {
            let send = &mut self.sends[k];
            let mut j = 0;
            while j < send.requests.len() {
                if raw::test(&mut send.requests[j], || "a send".into())? {
                    send.requests.swap_remove(j);
                } else {
                    j += 1;
                }
            }
            if send.requests.is_empty() {
                let send = self.sends.swap_remove(k);
                progressed = true;
                if let Some(peer) = send.borrowed_for {
                    self.inner.pending_to[peer].fetch_sub(1, Ordering::SeqCst);
                    self.inner.done.value.fetch_add(1, Ordering::Release);
                    self.inner.done.ring();
                }
            } else {
                k += 1;
            }
        }
        let mut k = 0;
        while k < self.collectives.len() {
            if self.collectives[k].test()? {
                self.collectives.swap_remove(k);
                progressed = true;
            } else {
                k += 1;
            }
        }
        Ok(progressed)
    }

    fn act(&mut self, source: usize, action: Action) {
        match action {
            Action::Signal(heap, index, offset, op) => {
                let cell = cell(&heap, index, offset);
                apply(cell, op, Ordering::Release);
            }
            Action::State { rank, state, runs } => {
                if rank >= self.nodes.num_ranks()
                    || self.nodes.node_of(rank) == self.nodes.node_of(self.me)
                {
                    return; // this node's ranks are known first hand
                }
                self.control.runs(rank).store(runs, Ordering::Release);
                let state = RankState::from_u32(state);
                if state == RankState::Died {
                    self.control.mark_died_any(rank, -1);
                } else {
                    self.control.set_state(rank, state);
                }
            }
            Action::Post { rank, words } => {
                if rank < self.nodes.num_ranks()
                    && self.nodes.node_of(rank) != self.nodes.node_of(self.me)
                {
                    self.control.store_post_words(rank, &words);
                }
            }
            Action::Bye => self.goodbyes[source] = true,
        }
    }

    /// Looks for processes of other nodes whose connection ended without a goodbye.
    fn watch_liveness(&mut self) {
        self.last_liveness = Instant::now();
        for (peer, said_bye) in self.liveness.ended() {
            if said_bye || self.goodbyes[peer] {
                continue;
            }
            if self.control.mark_died_any(peer, -1) {
                let node = self.nodes.node_of(peer);
                self.control.fail(
                    peer,
                    &format!(
                        "rank {peer} (node {node}) ended without leaving its world: its process \
                         is gone (killed, or exited inside run)"
                    ),
                );
            }
        }
    }

    /// MPI failed on this process: the rank fails, with MPI's message.
    fn fatal(&mut self, (call, message): Failure) {
        let err = Error::Mpi { rank: self.me, call, message };
        self.control.fail(self.me, &err.to_string());
        eprintln!("dist-tensor: {err}");
    }

    /// Tells the other nodes this process is done, and waits for theirs: everything they send
    /// comes before their goodbye, so afterwards nothing is in flight and MPI can end.
    fn leave(mut self) -> bool {
        let seen = self.look();
        if self.drain().is_err() {
            return false;
        }
        // Deferred (throttled) puts go now, before the last states and the goodbye.
        while let Some((_, request)) = self.deferred.pop_front() {
            if self.start(request).is_err() {
                return false;
            }
        }
        if self.announce(seen).and_then(|_| self.broadcast(&Message::Bye)).is_err() {
            return false;
        }
        self.liveness.bye();
        let mut deadline = None;
        loop {
            let died = |p: usize| self.control.state(p) == RankState::Died;
            let missing = self.remote.iter().any(|&p| !self.goodbyes[p] && !died(p));
            if !missing {
                // With a peer dead, MPI_Finalize can wait for it for ever (sends to it never
                // complete): the job is over, and mpirun ends it.
                return !(0..self.nodes.num_ranks()).any(died);
            }
            if self.control.failed() {
                let at = *deadline.get_or_insert_with(|| Instant::now() + FAILED_GOODBYE);
                if Instant::now() >= at {
                    return false;
                }
            }
            match self.step() {
                Ok(true) => {}
                Ok(false) => std::thread::sleep(Duration::from_micros(50)),
                Err(_) => return false,
            }
        }
    }
}

/// Start-up results the proxy thread sends back.
pub(crate) type Started = std::result::Result<super::Started, Error>;
