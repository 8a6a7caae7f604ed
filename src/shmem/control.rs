//! The control block: what every rank of a world must see of every other, in one shared mapping.
//!
//! Ranks that are threads of this process map it once; ranks that are processes map the same
//! memfd. Either way the code that reads and writes it is the same:
//!
//! | what | where | who writes |
//! | --- | --- | --- |
//! | failure flag and first-failure record (rank, message) | header, text area | the first rank to fail |
//! | `exits`: how many times a rank left the running state | header | a rank that returns or fails, a peer that finds a rank dead |
//! | per rank: state (idle, running, returned, failed, died, left) and how many runs it entered | rank record | the rank; a peer for `died` |
//! | per rank: pid, exit status | rank record | the rank; a peer that reaps it |
//! | per rank: its latest collective call (group, op, number), whether it is still in it, and which rank it waits for | rank record | the rank (see `crossed`) |
//!
//! Blocked waits sleep on futexes beside each signal (in the heap, see `sync`), which are
//! process-shared like everything here.
//!
//! Per-rank state that no peer reads (the free list of the rank's own segment, its call
//! counter, its workspaces) stays in the rank's own process.

use std::sync::atomic::{AtomicI32, AtomicU32, AtomicU64, Ordering};

use super::mapping::Mapping;

const MAGIC: u64 = 0x6469_7374_5f74_656e; // "dist_ten"
const HEADER_BYTES: usize = 64;
/// Room for the first failure's message; longer messages are cut.
pub(crate) const FAILURE_TEXT_BYTES: usize = 4096;
const RECORD_BYTES: usize = 192;
/// Where a rank's record keeps its latest collective call (see [`Control::post_call`]).
const POST_AT: usize = 64;
/// Bytes of an op's name a post keeps: the exchange's own limit.
const POST_NAME_BYTES: usize = 40;
/// Words of a post: version, group, call number (and the in-call bit), target, owner, and six
/// of the op's name and element type.
pub(crate) const POST_WORDS: usize = 11;
/// The post's "still in the call" bit, beside the call number.
const IN_CALL: u64 = 1 << 63;
/// The owner word's "calls came from more than one thread" bit.
const MULTI: u64 = 1 << 63;

/// Where a rank is in its life: peers read it to stop waiting for a rank that left.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub(crate) enum RankState {
    /// Not in `run` (before the first, between runs, or not joined yet).
    Idle = 0,
    /// Inside `run`.
    Running = 1,
    /// Returned from `run` without an error of its own.
    Returned = 2,
    /// Returned an error or panicked.
    Failed = 3,
    /// Its process ended without returning (killed, or exited from inside `run`).
    Died = 4,
    /// Its process dropped its world: no more runs will come from it.
    Left = 5,
}

impl RankState {
    pub(crate) fn from_u32(v: u32) -> RankState {
        match v {
            1 => RankState::Running,
            2 => RankState::Returned,
            3 => RankState::Failed,
            4 => RankState::Died,
            5 => RankState::Left,
            _ => RankState::Idle,
        }
    }
}

/// The shared control block of a world.
pub(crate) struct Control {
    map: Mapping,
    num_ranks: usize,
}

impl Control {
    /// Bytes of a control block for `num_ranks` ranks.
    pub(crate) fn bytes(num_ranks: usize) -> usize {
        // World sizes are bounded (`job_env::MAX_WORLD_SIZE`) long before this could overflow.
        HEADER_BYTES + FAILURE_TEXT_BYTES + num_ranks.saturating_mul(RECORD_BYTES)
    }

    /// Takes a fresh (zeroed) mapping of at least [`Control::bytes`] and writes its header.
    pub(crate) fn create(map: Mapping, num_ranks: usize) -> Control {
        assert!(map.len() >= Self::bytes(num_ranks), "control block mapping too small");
        let control = Control { map, num_ranks };
        control.word(8).store(num_ranks as u64, Ordering::Relaxed);
        control.word(0).store(MAGIC, Ordering::Release);
        control
    }

    /// Opens a control block another process created; checks it is one, for this world size.
    pub(crate) fn open(map: Mapping, num_ranks: usize) -> Result<Control, String> {
        if map.len() < Self::bytes(num_ranks) {
            return Err(format!("a control block of {} bytes is too small", map.len()));
        }
        let control = Control { map, num_ranks };
        if control.word(0).load(Ordering::Acquire) != MAGIC {
            return Err("the shared control block is not one of dist-tensor's".into());
        }
        let n = control.word(8).load(Ordering::Relaxed);
        if n != num_ranks as u64 {
            return Err(format!(
                "the control block is for {n} ranks, this process for {num_ranks}"
            ));
        }
        Ok(control)
    }

    pub(crate) fn mapping(&self) -> &Mapping {
        &self.map
    }

    fn word(&self, offset: usize) -> &AtomicU64 {
        debug_assert!(offset.is_multiple_of(8) && offset + 8 <= self.map.len());
        // SAFETY: inside the mapping, 8-aligned (the mapping is page-aligned); the control block
        // is only ever accessed through atomics.
        unsafe { &*(self.map.base().add(offset) as *const AtomicU64) }
    }

    fn half(&self, offset: usize) -> &AtomicU32 {
        debug_assert!(offset.is_multiple_of(4) && offset + 4 <= self.map.len());
        // SAFETY: as in `word`, 4-aligned.
        unsafe { &*(self.map.base().add(offset) as *const AtomicU32) }
    }

    fn record(&self, rank: usize) -> usize {
        assert!(rank < self.num_ranks, "rank {rank} outside a world of {}", self.num_ranks);
        HEADER_BYTES + FAILURE_TEXT_BYTES + rank * RECORD_BYTES
    }

    // ---- failure --------------------------------------------------------------------------

    /// Whether some rank failed.
    pub(crate) fn failed(&self) -> bool {
        self.half(16).load(Ordering::Acquire) != 0
    }

    /// Records `rank`'s failure with its message unless another came first; sets the flag
    /// either way. Returns whether this one was first.
    pub(crate) fn fail(&self, rank: usize, message: &str) -> bool {
        let first =
            self.word(24).compare_exchange(0, rank as u64 + 1, Ordering::AcqRel, Ordering::Acquire);
        let is_first = first.is_ok();
        if is_first {
            let text = truncate(message, FAILURE_TEXT_BYTES);
            // SAFETY: only the first failing rank writes the text area, once, before it
            // publishes its length with release ordering; readers read it only after acquiring
            // that length.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    text.as_ptr(),
                    self.map.base().add(HEADER_BYTES),
                    text.len(),
                )
            };
            self.half(20).store(text.len() as u32 + 1, Ordering::Release);
        }
        self.half(16).store(1, Ordering::Release);
        is_first
    }

    /// The first failure: its rank and message (empty while its writer is still writing it).
    pub(crate) fn first_failure(&self) -> Option<(usize, String)> {
        let first = self.word(24).load(Ordering::Acquire);
        if first == 0 {
            return None;
        }
        // The block is shared with other processes: a rank number or a length out of range is
        // read as what it can be, never used to read outside the block.
        let rank = usize::try_from(first - 1).unwrap_or(usize::MAX).min(self.num_ranks);
        let mut len = self.half(20).load(Ordering::Acquire);
        for _ in 0..10_000 {
            if len != 0 {
                break;
            }
            std::hint::spin_loop();
            len = self.half(20).load(Ordering::Acquire);
        }
        let text = if len == 0 {
            String::from("(its message was still being written)")
        } else {
            let mut bytes = vec![0u8; (len as usize - 1).min(FAILURE_TEXT_BYTES)];
            // SAFETY: the writer stored these bytes before releasing `len`, which was acquired.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    self.map.base().add(HEADER_BYTES),
                    bytes.as_mut_ptr(),
                    bytes.len(),
                )
            };
            String::from_utf8_lossy(&bytes).into_owned()
        };
        if rank == self.num_ranks {
            return Some((
                0,
                format!("(a failure record names rank {}, outside the world) {text}", first - 1),
            ));
        }
        Some((rank, text))
    }

    // ---- rank states ----------------------------------------------------------------------

    /// How many times a rank left the running state: a waiter that sees it change looks at who.
    pub(crate) fn exits(&self) -> u32 {
        self.half(32).load(Ordering::Acquire)
    }

    pub(crate) fn state(&self, rank: usize) -> RankState {
        RankState::from_u32(self.half(self.record(rank)).load(Ordering::Acquire))
    }

    /// How many runs `rank` has entered.
    pub(crate) fn runs(&self, rank: usize) -> &AtomicU32 {
        self.half(self.record(rank) + 16)
    }

    /// Enters a run: counts it, then sets the state to running.
    pub(crate) fn enter_run(&self, rank: usize) {
        // A new run starts with no call posted and no thread owning the rank's calls.
        for at in (POST_AT..RECORD_BYTES).step_by(8) {
            self.word(self.record(rank) + at).store(0, Ordering::Release);
        }
        self.runs(rank).fetch_add(1, Ordering::AcqRel);
        self.set_state(rank, RankState::Running);
    }

    /// Whether `peer` will never again send anything to `me` in `me`'s current run: it failed,
    /// died or dropped its world, or returned from the run `me` is in (a peer that returned from
    /// an earlier run, in a world of processes, is still on its way to this one).
    pub(crate) fn has_left(&self, peer: usize, me: usize) -> bool {
        match self.state(peer) {
            RankState::Idle | RankState::Running => false,
            RankState::Returned => {
                self.runs(peer).load(Ordering::Acquire) >= self.runs(me).load(Ordering::Acquire)
            }
            RankState::Failed | RankState::Died | RankState::Left => true,
        }
    }

    /// Sets `rank`'s state. Leaving `Running` is published with release ordering after
    /// everything the rank did, so a peer that sees it also sees every signal it sent.
    pub(crate) fn set_state(&self, rank: usize, state: RankState) {
        let old = self.half(self.record(rank)).swap(state as u32, Ordering::AcqRel);
        // Waiters look at who left when this count changes.
        if old != state as u32 && state != RankState::Running {
            self.half(32).fetch_add(1, Ordering::AcqRel);
        }
    }

    /// Marks `rank` as died (a peer found its process gone) unless it already failed, died or
    /// left its world in order; returns the state it was in when this call changed it. A rank
    /// that was not running (before its first run or between two) gets [`DIED_BETWEEN_RUNS`] as
    /// its status: it will never come to the next run, and a peer waiting for it there must
    /// hear so at once rather than at the wait timeout.
    pub(crate) fn mark_died(&self, rank: usize, status: i32) -> Option<RankState> {
        let cell = self.half(self.record(rank));
        let mut seen = cell.load(Ordering::Acquire);
        let was = loop {
            let was = RankState::from_u32(seen);
            if !matches!(was, RankState::Idle | RankState::Running | RankState::Returned) {
                return None;
            }
            match cell.compare_exchange(
                seen,
                RankState::Died as u32,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => break was,
                Err(now) => seen = now,
            }
        };
        let status = if was == RankState::Running { status } else { DIED_BETWEEN_RUNS };
        self.exit_status(rank).store(status, Ordering::Release);
        self.half(32).fetch_add(1, Ordering::AcqRel);
        Some(was)
    }

    /// Marks `rank` as died whatever it was doing, unless it already died or left its world in
    /// order (a process of another node whose connection ended: it may have been between runs);
    /// returns whether this call changed it.
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))] // used by the MPI world only
    pub(crate) fn mark_died_any(&self, rank: usize, status: i32) -> bool {
        let cell = self.half(self.record(rank));
        let mut seen = cell.load(Ordering::Acquire);
        loop {
            if matches!(RankState::from_u32(seen), RankState::Died | RankState::Left) {
                return false;
            }
            match cell.compare_exchange(
                seen,
                RankState::Died as u32,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => break,
                Err(now) => seen = now,
            }
        }
        self.exit_status(rank).store(status, Ordering::Release);
        self.half(32).fetch_add(1, Ordering::AcqRel);
        true
    }

    /// `rank`'s process id (0 until it joined).
    pub(crate) fn pid(&self, rank: usize) -> &AtomicU32 {
        self.half(self.record(rank) + 8)
    }

    /// How `rank`'s process ended, as found by a peer (a wait status).
    pub(crate) fn exit_status(&self, rank: usize) -> &AtomicI32 {
        // SAFETY: as in `half`; i32 and u32 atomics have the same layout.
        unsafe { &*(self.map.base().add(self.record(rank) + 12) as *const AtomicI32) }
    }

    /// How a rank that is no longer running left, for messages.
    pub(crate) fn how_left(&self, rank: usize) -> String {
        match self.state(rank) {
            RankState::Returned => "returned from run".into(),
            RankState::Failed => "failed".into(),
            RankState::Died => describe_status(self.exit_status(rank).load(Ordering::Acquire)),
            RankState::Idle => "is not in run".into(),
            RankState::Left => "dropped its world".into(),
            RankState::Running => "is running".into(),
        }
    }
}

/// A rank's latest collective call as its record shows it (see [`Control::post_call`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Post {
    /// Changes with every call posted (even when the post is whole).
    pub(crate) version: u64,
    /// The group the call is on (0: the world itself).
    pub(crate) group: u64,
    /// The call's number in that group.
    pub(crate) seq: u64,
    /// Whether the rank is still in the call.
    pub(crate) in_call: bool,
    /// The rank the call waits for, once it blocked.
    pub(crate) target: Option<usize>,
    /// Whether the rank's calls came from more than one thread in this run.
    pub(crate) multi: bool,
    /// The op and its element type, as the exchange names them.
    pub(crate) op: String,
    pub(crate) dtype: String,
}

impl Control {
    fn post_word(&self, rank: usize, i: usize) -> &AtomicU64 {
        self.word(self.record(rank) + POST_AT + 8 * i)
    }

    /// Posts that `rank` (the calling thread, `thread`, a nonzero token) entered call `seq` of
    /// `group` with `op<dtype>`: a few stores to the rank's own record per call, read by peers
    /// only while they wait (see `crossed`). A seqlock: the version is odd while it is written.
    pub(crate) fn post_call(
        &self,
        rank: usize,
        group: u64,
        seq: u64,
        op: &str,
        dtype: &str,
        thread: u64,
    ) {
        let owner = self.post_word(rank, 4);
        let seen = owner.load(Ordering::Acquire);
        if seen == 0 {
            let _ = owner.compare_exchange(0, thread, Ordering::AcqRel, Ordering::Acquire);
        } else if seen & !MULTI != thread {
            owner.fetch_or(MULTI, Ordering::AcqRel);
        }
        let version = self.post_word(rank, 0);
        version.fetch_add(1, Ordering::AcqRel);
        self.post_word(rank, 1).store(group, Ordering::Release);
        self.post_word(rank, 3).store(0, Ordering::Release);
        let mut name = [0u8; POST_NAME_BYTES + 8];
        for (i, b) in op.bytes().take(POST_NAME_BYTES).enumerate() {
            name[i] = b;
        }
        for (i, b) in dtype.bytes().take(8).enumerate() {
            name[POST_NAME_BYTES + i] = b;
        }
        for (i, chunk) in name.chunks(8).enumerate() {
            let word = u64::from_le_bytes(chunk.try_into().expect("8 bytes"));
            self.post_word(rank, 5 + i).store(word, Ordering::Release);
        }
        self.post_word(rank, 2).store((seq & !IN_CALL) | IN_CALL, Ordering::Release);
        version.fetch_add(1, Ordering::AcqRel);
    }

    /// Posts the rank `rank`'s call waits for (`None`: nobody in particular).
    pub(crate) fn post_target(&self, rank: usize, target: Option<usize>) {
        let word = target.map_or(0, |t| t as u64 + 1);
        let at = self.post_word(rank, 3);
        if at.load(Ordering::Relaxed) != word {
            at.store(word, Ordering::Release);
        }
    }

    /// Posts that `rank` left its call (the post stays, as its latest call).
    pub(crate) fn post_done(&self, rank: usize) {
        self.post_word(rank, 3).store(0, Ordering::Release);
        self.post_word(rank, 2).fetch_and(!IN_CALL, Ordering::AcqRel);
    }

    /// `rank`'s post as it is stored (a consistent copy), for the MPI proxy to relay to the
    /// other nodes, whose control blocks have no other way to see it; `None` while it is being
    /// written.
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))] // used by the MPI proxy only
    pub(crate) fn post_words(&self, rank: usize) -> Option<[u64; POST_WORDS]> {
        let before = self.post_word(rank, 0).load(Ordering::Acquire);
        if before % 2 == 1 {
            return None;
        }
        let mut words = [0u64; POST_WORDS];
        for (i, w) in words.iter_mut().enumerate() {
            *w = self.post_word(rank, i).load(Ordering::Acquire);
        }
        (self.post_word(rank, 0).load(Ordering::Acquire) == before && words[0] == before)
            .then_some(words)
    }

    /// Stores the post of `rank` (a rank of another node) that its proxy relayed, under the
    /// seqlock `read_post` reads: odd while written, the sender's version after.
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))] // used by the MPI proxy only
    pub(crate) fn store_post_words(&self, rank: usize, words: &[u64; POST_WORDS]) {
        let version = self.post_word(rank, 0);
        // Odd (and never 0, which reads as "no post") while the words change.
        version.store(words[0] | 1, Ordering::Release);
        for (i, &w) in words.iter().enumerate().skip(1) {
            self.post_word(rank, i).store(w, Ordering::Release);
        }
        version.store(words[0], Ordering::Release);
    }

    /// Whether a post's words say the rank is blocked in a call, waiting for a peer.
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))] // used by the MPI proxy only
    pub(crate) fn words_blocked(words: &[u64; POST_WORDS]) -> bool {
        words[2] & IN_CALL != 0 && words[3] != 0
    }

    /// `rank`'s latest call, if it posted one in this run and the post was whole when read.
    pub(crate) fn read_post(&self, rank: usize) -> Option<Post> {
        for _ in 0..100 {
            let before = self.post_word(rank, 0).load(Ordering::Acquire);
            if before == 0 {
                return None;
            }
            if before % 2 == 1 {
                std::hint::spin_loop();
                continue;
            }
            let word = |i| self.post_word(rank, i).load(Ordering::Acquire);
            let (group, seq, target, owner) = (word(1), word(2), word(3), word(4));
            let bytes: Vec<u8> = (5..11).flat_map(|i| word(i).to_le_bytes()).collect();
            if self.post_word(rank, 0).load(Ordering::Acquire) != before {
                continue;
            }
            let text = |b: &[u8]| {
                let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
                String::from_utf8_lossy(&b[..end]).into_owned()
            };
            return Some(Post {
                version: before,
                group,
                seq: seq & !IN_CALL,
                in_call: seq & IN_CALL != 0,
                // A target outside the world (only a forged block has one) is no target.
                target: target.checked_sub(1).map(|t| t as usize).filter(|&t| t < self.num_ranks),
                multi: owner & MULTI != 0,
                op: text(&bytes[..POST_NAME_BYTES]),
                dtype: text(&bytes[POST_NAME_BYTES..]),
            });
        }
        None
    }
}

/// A wait status in words: `exited with status 3`, `was killed by signal 9`.
/// The exit status recorded for a rank whose process was found gone while it was not in a run.
pub(crate) const DIED_BETWEEN_RUNS: i32 = -2;

pub(crate) fn describe_status(status: i32) -> String {
    if status == DIED_BETWEEN_RUNS {
        "ended between runs (its process is gone: killed, or exited without dropping its world)"
            .into()
    } else if status < 0 {
        "ended without returning from run (its process is gone: killed, or exited inside run)"
            .into()
    } else if status & 0x7f == 0 {
        format!("exited with status {} without returning from run", (status >> 8) & 0xff)
    } else {
        format!("was killed by signal {}", status & 0x7f)
    }
}

/// The longest prefix of `text` of at most `max` bytes that ends on a character boundary.
fn truncate(text: &str, max: usize) -> &str {
    let mut end = text.len().min(max);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_failure_wins_and_states_count_exits() {
        let control = Control::create(Mapping::anonymous(Control::bytes(3)).unwrap(), 3);
        assert!(!control.failed());
        control.set_state(1, RankState::Running);
        control.set_state(1, RankState::Returned);
        assert_eq!(control.exits(), 1);
        assert!(control.fail(2, "two broke"));
        assert!(!control.fail(0, "zero broke too"));
        assert!(control.failed());
        assert_eq!(control.first_failure(), Some((2, "two broke".to_string())));
        assert_eq!(control.how_left(1), "returned from run");
    }

    #[test]
    fn a_forged_failure_record_is_read_within_the_block() {
        let control = Control::create(Mapping::anonymous(Control::bytes(2)).unwrap(), 2);
        control.word(24).store(u64::MAX, Ordering::Release);
        control.half(20).store(u32::MAX, Ordering::Release);
        let (rank, text) = control.first_failure().unwrap();
        assert_eq!(rank, 0);
        assert!(text.starts_with("(a failure record names rank"), "{text}");
        assert!(text.len() < FAILURE_TEXT_BYTES + 100);
    }

    #[test]
    fn a_long_message_is_cut_on_a_character_boundary() {
        assert_eq!(truncate("aé", 2), "a");
        assert_eq!(truncate("abc", 10), "abc");
    }
}
