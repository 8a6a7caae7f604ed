//! Calls that cross: ranks blocked in collective calls on different groups, each waiting for a
//! rank that is in another group's call, so that no call can ever finish.
//!
//! Every group is a world of its own with its own exchange (see `group`), so two ranks that call
//! on different groups never meet in an exchange that could compare their calls. Instead every
//! rank posts its latest call (group, op, number) in its record of its *world's* control block,
//! which every rank of the world on this host or node maps, for threads and processes alike: a
//! few stores to the rank's own record per call. A rank blocked in an exchange also posts which
//! rank it waits for, and past a short grace follows those posts from rank to rank: a chain that
//! comes back to a rank it passed is a cycle of ranks blocked in calls on different groups (a
//! rank missing from a call that is blocked in a call on the same group would be in the same
//! call), and the wait ends with [`Error::OpMismatch`] naming both calls; the failure fails the
//! world, so every rank involved stops. A cycle must stay the same (the same posts, the same
//! waits) for a while before it counts, so a post a rank has not yet cleared after its wait
//! ended does not make one. A rank whose calls come from more than one thread (the reducing
//! thread of data parallelism) may have another thread on its way to the call a peer waits for:
//! a chain through it proves nothing, and none is followed.
//!
//! A rank that returned from `run` while a peer waits for it in a group's call, with its last
//! call on another group, gets the same error (instead of [`Error::PeerGone`]).
//!
//! In a world joined by MPI a node's control block is its own: each process's proxy relays its
//! rank's post to the other nodes' blocks (a wait once it has lasted a little, its end at once, and
//! the last call of a rank that returned), so a chain follows ranks of every node.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::control::Post;
use super::exchange::describe;
use super::heap::lock;
use super::world::WorldShared;
use crate::Error;

/// How long a waiter blocks before it looks for a cycle: a correct program's calls on different
/// groups wait on each other only as long as the slowest rank's work between calls takes to
/// arrive, and the look costs reads of every rank's record.
const GRACE: Duration = Duration::from_millis(200);
/// How long a cycle must stay the same before it counts (see the module docs).
const STABLE: Duration = Duration::from_millis(300);

/// The calling thread's token in the posts: distinct per thread, never 0, below the post's flag.
fn thread_token() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    thread_local! {
        static TOKEN: u64 = NEXT.fetch_add(1, Ordering::Relaxed) & (u64::MAX >> 1);
    }
    TOKEN.with(|t| *t)
}

/// The world a world or group belongs to (itself for a world), and `rank`'s rank there.
pub(crate) fn root_of(world: &WorldShared, rank: usize) -> (&WorldShared, usize) {
    let (mut at, mut rank) = (world, rank);
    while let Some(link) = &at.parent {
        rank = link.members()[rank];
        at = link.world_ref();
    }
    (at, rank)
}

/// The id of the group of `color` made by split call `seq` of the group (or world) `parent`:
/// the same on every rank, never 0 (the world's own).
pub(crate) fn group_id(parent: u64, seq: u64, color: u64) -> u64 {
    super::exchange::digest([parent, seq, color]).max(1)
}

/// A group in words, for an error.
fn describe_group(root: &WorldShared, id: u64) -> String {
    if id == 0 {
        return "the world".into();
    }
    match lock(&root.groups).get(&id) {
        Some(members) => format!("the group of world ranks {members:?}"),
        None => format!("a group (id {id:#x}) this rank is not in"),
    }
}

fn describe_post(root: &WorldShared, post: &Post) -> String {
    format!("{} on {}", describe(&post.op, &post.dtype, post.seq), describe_group(root, post.group))
}

/// A rank's call, posted for as long as it lasts.
pub(crate) struct Posted<'a> {
    root: &'a WorldShared,
    rank: usize,
}

impl<'a> Posted<'a> {
    /// Posts that the world's rank `rank` of `root` entered call `seq` of `group`.
    pub(crate) fn new(
        root: &'a WorldShared,
        rank: usize,
        group: u64,
        seq: u64,
        op: &str,
        dtype: &str,
    ) -> Posted<'a> {
        root.control.post_call(rank, group, seq, op, dtype, thread_token());
        Posted { root, rank }
    }
}

impl Drop for Posted<'_> {
    fn drop(&mut self) {
        self.root.control.post_done(self.rank);
    }
}

/// What a waiter blocked in an exchange keeps between its looks for a cycle.
pub(crate) struct Crossing<'a> {
    root: &'a WorldShared,
    rank: usize,
    since: Instant,
    /// The cycle seen at the last look, and since when it has been the same.
    seen: Option<(Instant, Vec<(usize, Post)>)>,
}

impl<'a> Crossing<'a> {
    pub(crate) fn new(root: &'a WorldShared, rank: usize) -> Crossing<'a> {
        Crossing { root, rank, since: Instant::now(), seen: None }
    }

    /// On every tick of the wait: posts `target` (the world's rank this call waits for), and
    /// past the grace looks for a cycle of blocked calls through this rank's; the error once one
    /// has stayed the same for [`STABLE`].
    pub(crate) fn stuck(&mut self, target: Option<usize>) -> Option<Error> {
        let control = &self.root.control;
        control.post_target(self.rank, target);
        let now = Instant::now();
        if now < self.since + GRACE {
            return None;
        }
        let Some(chain) = self.chain() else {
            self.seen = None;
            return None;
        };
        match &self.seen {
            Some((from, seen)) if *seen == chain => {
                if now < *from + STABLE {
                    return None;
                }
            }
            _ => {
                self.seen = Some((now, chain));
                return None;
            }
        }
        let (me, mine) = &chain[0];
        let (peer, theirs) = &chain[1];
        let ranks: Vec<String> = chain.iter().map(|(r, _)| r.to_string()).collect();
        let back = chain.last().and_then(|(_, p)| p.target).unwrap_or(*me);
        Some(Error::OpMismatch {
            rank_a: *me,
            call_a: describe_post(self.root, mine),
            rank_b: *peer,
            call_b: format!(
                "{}; ranks {} -> {back} each wait for the next in calls on different groups, \
                 so none can finish",
                describe_post(self.root, theirs),
                ranks.join(" -> ")
            ),
        })
    }

    /// The ranks from this one, each blocked in a call that waits for the next, which is blocked
    /// in a call on another group, until the chain comes back to a rank in it; `None` where it
    /// ends (a rank that is not blocked, or whose calls come from several threads).
    fn chain(&self) -> Option<Vec<(usize, Post)>> {
        let control = &self.root.control;
        let n = self.root.num_ranks();
        let mut chain: Vec<(usize, Post)> = Vec::new();
        let mut at = self.rank;
        loop {
            if control.state(at) != super::control::RankState::Running {
                return None;
            }
            let post = control.read_post(at).filter(|p| p.in_call && !p.multi)?;
            if let Some((_, before)) = chain.last()
                && before.group == post.group
            {
                return None;
            }
            let next = post.target?;
            chain.push((at, post));
            if let Some((_, closing)) = chain.iter().find(|(r, _)| *r == next) {
                let last = &chain[chain.len() - 1].1;
                return (closing.group != last.group).then_some(chain);
            }
            if chain.len() > n {
                return None;
            }
            at = next;
        }
    }
}

/// The error for a wait on `peer` (a world's rank of `root`) that returned from `run` while this
/// rank waits for it in call `call` of `group`, when its last call was on another group.
pub(crate) fn left_elsewhere(
    root: &WorldShared,
    rank: usize,
    peer: usize,
    group: u64,
    call: String,
) -> Option<Error> {
    let control = &root.control;
    if control.state(peer) != super::control::RankState::Returned || !control.has_left(peer, rank) {
        return None;
    }
    let last = control.read_post(peer).filter(|p| !p.multi && p.group != group)?;
    Some(Error::OpMismatch {
        rank_a: rank,
        call_a: format!("{call} on {}", describe_group(root, group)),
        rank_b: peer,
        call_b: format!(
            "{}, its last call before it returned from run",
            describe_post(root, &last)
        ),
    })
}
