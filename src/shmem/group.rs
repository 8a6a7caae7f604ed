//! Groups: some of a world's ranks, split off collectively (as `MPI_Comm_split` does), that behave
//! as a world of their own.
//!
//! A [`Group`] is a world in its own right, not a view of its parent: its own heap segments, its
//! own control block, its own exchange and call numbers, its own workspaces. So every collective,
//! fused op and [`DistTensor`](crate::DistTensor) works on [`Group::rank`] unchanged, calls on
//! different groups never meet (they proceed at once, independently), and a buffer of a group
//! has segments only for its members: a rank outside it is not addressable through it
//! ([`try_symm_at`](crate::shmem::try_symm_at) says so with a typed error).
//!
//! How the members meet depends on where the ranks live: in a world of threads the first member
//! to arrive maps the group's segments and the others take the same handle; in a world of
//! processes (of one host, or of one MPI node) the members meet as a job of their own, under a job
//! id derived from the world's, and pass each other their segments.
//!
//! Calls on different groups cannot be compared in an exchange, so a rank that calls on the
//! wrong group is found another way: every call is posted to the world, and ranks blocked in
//! calls on different groups that wait on each other in a cycle fail with
//! [`Error::OpMismatch`](crate::Error::OpMismatch) within a second (see `crossed`).
//!
//! A group and its world fail together: a rank's failure in a group fails the world (the ranks
//! outside the group stop), and a waiter blocked in a group looks at the world on every tick, so a
//! member that failed, returned or died in the world ends the group's waits as it would the
//! world's.

use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::control::{Control, RankState};
use super::exchange::Call;
use super::heap::{Heap, lock};
use super::mapping::Mapping;
use super::rank::Rank;
use super::world::{Settings, WorldKind, WorldShared};
use crate::{Error, Result};

/// Groups of a world of threads being made, by (split call number, color): the group's shared
/// state and how many members have yet to take it.
pub(crate) type Forming = HashMap<(u64, u64), (Arc<WorldShared>, usize)>;

/// What a group keeps of the world it was split from.
#[derive(Clone)]
pub(crate) struct ParentLink {
    /// The world. A group's handle borrows its world's rank, so the world outlives every use.
    world: *const WorldShared,
    /// The world's rank of each member, in the group's rank order.
    members: Vec<usize>,
}

// SAFETY: the pointer is only read, as a `&WorldShared` (which is `Sync`), while the group's
// handle (which borrows the world) lives.
unsafe impl Send for ParentLink {}
// SAFETY: as above.
unsafe impl Sync for ParentLink {}

impl ParentLink {
    fn world(&self) -> &WorldShared {
        // SAFETY: see the field's docs.
        unsafe { &*self.world }
    }

    /// The world the group was split from.
    pub(crate) fn world_ref(&self) -> &WorldShared {
        self.world()
    }

    /// The world's rank of each member, in the group's rank order.
    pub(crate) fn members(&self) -> &[usize] {
        &self.members
    }

    /// Records a member's failure in the world.
    pub(crate) fn fail_with(&self, member: usize, err: &Error) {
        self.world().fail_with(self.members[member], err);
    }

    /// What a group's waiter looks at on every tick: the world's own look (for dead processes),
    /// then the world's failure and the members' states, copied into the group's control block.
    fn look(&self, group: &Control) {
        let world = self.world();
        if let Some(on_tick) = &world.on_tick {
            on_tick(&world.control);
        }
        if world.control.failed()
            && !group.failed()
            && let Some((failed, reason)) = world.control.first_failure()
        {
            let at = self.members.iter().position(|&m| m == failed).unwrap_or(0);
            group.fail(at, &format!("(rank {failed} of the world) {reason}"));
        }
        for (i, &m) in self.members.iter().enumerate() {
            let state = world.control.state(m);
            let left = matches!(
                state,
                RankState::Returned | RankState::Failed | RankState::Died | RankState::Left
            );
            if left && group.state(i) == RankState::Running {
                let status = world.control.exit_status(m).load(Ordering::Acquire);
                group.exit_status(i).store(status, Ordering::Release);
                group.set_state(i, state);
            }
        }
    }
}

/// Some of a world's ranks, made by [`Rank::split`]: a world of their own for every collective,
/// fused op and [`DistTensor`](crate::DistTensor), through [`Group::rank`].
///
/// # Examples
/// ```
/// use dist_tensor::{collectives, World};
///
/// // Ranks 0, 2 and 1, 3 sum among themselves, at the same time.
/// let sums = World::threads(4)?.run(|rank| {
///     let group = rank.split((rank.rank() % 2) as u64, rank.rank() as u64)?;
///     collectives::all_reduce(&group.rank(), &[rank.rank() as f64; 2])
/// })?;
/// assert_eq!(sums, vec![vec![2.0; 2], vec![4.0; 2], vec![2.0; 2], vec![4.0; 2]]);
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub struct Group<'w> {
    shared: Arc<WorldShared>,
    index: usize,
    members: Vec<usize>,
    color: u64,
    _world: PhantomData<&'w WorldShared>,
}

impl<'w> Rank<'w> {
    /// Splits the world into groups, collectively (every rank calls it, as `MPI_Comm_split`):
    /// the ranks that give the same `color` form one group, ordered by `key` (then by rank).
    /// Each rank gets its own group's handle.
    ///
    /// # Errors
    /// As any collective call ([`Error::OpMismatch`] when ranks are in different calls);
    /// [`Error::InvalidArgument`] on a world of GPUs or NPUs (groups run on the host
    /// simulation); what making a world's segments can fail with. A group of an MPI world may
    /// have members on several nodes: they reach each other through the proxy, as the world's
    /// ranks do.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::World;
    /// let seen = World::threads(4)?.run(|rank| {
    ///     let group = rank.split((rank.rank() / 2) as u64, 0)?;
    ///     Ok((group.rank().rank(), group.size(), group.members().to_vec()))
    /// })?;
    /// assert_eq!(seen[3], (1, 2, vec![2, 3]));
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn split(&self, color: u64, key: u64) -> Result<Group<'w>> {
        const OP: &str = "Rank::split";
        let me = self.rank;
        let world = self.world;
        let problem = world.device.as_ref().map(|_| {
            format!("groups run on the host simulation; this world runs on {}", self.device())
        });
        let all = self.exchange(Call::untyped(OP), &[color, key], problem, &[])?;
        let seq = lock(&world.local[me].calls).seq;
        let mut members: Vec<usize> = (0..all.len()).filter(|&r| all[r][0] == color).collect();
        members.sort_by_key(|&r| (all[r][1], r));
        let index = members.iter().position(|&r| r == me).expect("a rank is in its own group");
        register_groups(world, seq, &all);
        let id = super::crossed::group_id(world.group_id, seq, color);
        let link = ParentLink { world: world as *const WorldShared, members: members.clone() };
        let shared = match &world.kind {
            WorldKind::Threads => self.take_threads_group(seq, color, id, link)?,
            WorldKind::Processes { job_id, join_timeout } => {
                // The members on this node meet as processes of one host (the job id of a
                // node's world names the node); those on other nodes are reached through the
                // proxy, which writes their puts into this group's heap.
                let job = format!("{job_id}.split{seq}.{color}");
                join_processes(world, link, id, index, job, *join_timeout)?
            }
        };
        Ok(Group { shared, index, members, color, _world: PhantomData })
    }

    /// The group of a world of threads: made by the first member to arrive, taken by the rest.
    fn take_threads_group(
        &self,
        seq: u64,
        color: u64,
        id: u64,
        link: ParentLink,
    ) -> Result<Arc<WorldShared>> {
        let world = self.world;
        let mut forming = lock(&world.forming);
        if let Some((shared, left)) = forming.get_mut(&(seq, color)) {
            let shared = shared.clone();
            *left -= 1;
            if *left == 0 {
                forming.remove(&(seq, color));
            }
            return Ok(shared);
        }
        let g = link.members.len();
        let settings = group_settings(world, g, false)?;
        let heap = Heap::anonymous(g, settings.capacity, settings.reserved)?;
        let control = Mapping::anonymous(Control::bytes(g)).map_err(|e| Error::System {
            op: "Rank::split",
            rank: self.rank,
            what: "cannot map the group's control block".into(),
            source: Arc::new(e),
        })?;
        let control = Control::create(control, g);
        for r in 0..g {
            control.set_state(r, RankState::Running);
        }
        let shared = Arc::new(group_world(world, heap, control, &settings, id, link));
        if g > 1 {
            forming.insert((seq, color), (shared.clone(), g - 1));
        }
        Ok(shared)
    }
}

/// Records, in the world the groups belong to, the world's ranks of every group split call `seq`
/// of `parent` made (every rank's color and key are in `all`), to name them in errors (see
/// `crossed`).
fn register_groups(parent: &WorldShared, seq: u64, all: &super::exchange::Exchanged) {
    let (root, _) = super::crossed::root_of(parent, 0);
    let mut colors: Vec<u64> = all.iter().map(|w| w[0]).collect();
    colors.sort_unstable();
    colors.dedup();
    let mut groups = lock(&root.groups);
    for color in colors {
        let mut members: Vec<usize> = (0..all.len()).filter(|&r| all[r][0] == color).collect();
        members.sort_by_key(|&r| (all[r][1], r));
        let in_root = members.iter().map(|&r| super::crossed::root_of(parent, r).1).collect();
        groups.insert(super::crossed::group_id(parent.group_id, seq, color), in_root);
    }
}

/// A group's settings: its world's heap capacity and wait timeout, its own reserved part (with
/// the inboxes of the exchange when its members are on several nodes).
fn group_settings(world: &WorldShared, g: usize, nodes: bool) -> Result<Settings> {
    let capacity = world.heap.capacity() - world.heap.reserved();
    Settings::resolve(Some(capacity), Some(world.wait_timeout))?.for_ranks(g, nodes)
}

/// A group's shared state over its segments and control block.
fn group_world(
    world: &WorldShared,
    heap: Heap,
    control: Control,
    settings: &Settings,
    id: u64,
    link: ParentLink,
) -> WorldShared {
    let mut shared = WorldShared::new(heap, control, world.topology.clone(), settings);
    shared.group_id = id;
    let look = link.clone();
    shared.on_tick = Some(Box::new(move |group: &Control| look.look(group)));
    shared.parent = Some(link);
    shared
}

/// The group of a world of processes: its members on this node meet as a job of their own; in a
/// world of several MPI nodes, the members elsewhere are reached through the world's proxy.
fn join_processes(
    world: &WorldShared,
    link: ParentLink,
    id: u64,
    index: usize,
    job_id: String,
    join_timeout: std::time::Duration,
) -> Result<Arc<WorldShared>> {
    let g = link.members.len();
    // The members on this node, by their index in the group.
    let here: Vec<usize> = (0..g).filter(|&i| world.heap.mapped(link.members[i])).collect();
    let local = here.iter().position(|&i| i == index).expect("a rank is on its own node");
    let env = super::job_env::JobEnv {
        rank: local,
        world_size: here.len(),
        local_rank: local,
        local_world_size: here.len(),
        job_id: job_id.clone(),
        launcher: "Rank::split",
    };
    let across = here.len() < g;
    let settings = group_settings(world, g, across)?;
    let members = super::process::Members { world_size: g, ranks: here };
    let joined = super::process::join(&env, &members, settings, join_timeout)?;
    let pid = rustix::process::getpid().as_raw_nonzero().get() as u32;
    joined.control.pid(index).store(pid, Ordering::Release);
    joined.control.set_state(index, RankState::Running);
    if across {
        // The members of other nodes are running (they made the split); their leaving reaches
        // this node's control block through the world's (see `ParentLink::look`).
        for i in (0..g).filter(|&i| !joined.heap.mapped(i)) {
            if joined.control.state(i) == RankState::Idle {
                joined.control.set_state(i, RankState::Running);
            }
        }
    }
    let peers = joined.peers;
    let mut shared = group_world(world, joined.heap, joined.control, &joined.settings, id, link);
    if across {
        let nodes = world.transport.nodes.clone();
        let members = shared.parent.as_ref().expect("a group has its world").members();
        let labels: Vec<usize> = members.iter().map(|&m| nodes.node_of(m)).collect();
        let outer = world.transport.link().expect("members on other nodes: a world of MPI");
        shared.transport = super::transport::Transport {
            nodes: super::transport::Nodes::from_labels(&labels),
            link: Some(outer.for_group(id, shared.heap.clone(), index)),
        };
    }
    let look = shared.parent.clone().expect("a group has its world");
    shared.on_tick = Some(Box::new(move |group: &Control| {
        peers.check(group);
        look.look(group);
    }));
    shared.kind = WorldKind::Processes { job_id, join_timeout };
    Ok(Arc::new(shared))
}

impl<'w> Group<'w> {
    /// This rank's handle in the group: pass it to any collective, fused op or
    /// [`DistTensor`](crate::DistTensor) constructor to run it over the group. Its
    /// [`rank`](Rank::rank) is the rank's index in the group.
    pub fn rank(&self) -> Rank<'_> {
        Rank::new(&self.shared, self.index)
    }

    /// Number of ranks in the group.
    pub fn size(&self) -> usize {
        self.members.len()
    }

    /// The world's rank of each member, in the group's rank order.
    pub fn members(&self) -> &[usize] {
        &self.members
    }

    /// The color the group was split by.
    pub fn color(&self) -> u64 {
        self.color
    }

    /// The group's rank of the world's rank `world_rank`, if it is a member.
    pub fn group_rank_of(&self, world_rank: usize) -> Option<usize> {
        self.members.iter().position(|&m| m == world_rank)
    }
}

impl std::fmt::Debug for Group<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Group")
            .field("color", &self.color)
            .field("rank", &self.index)
            .field("members", &self.members)
            .finish()
    }
}
