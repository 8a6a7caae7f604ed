//! How a rank reaches its peers: by pointer for the ranks of its node, through the MPI proxy for
//! the others.
//!
//! A world of threads, or of processes of one host, is one node: every peer's segment is mapped
//! and `symm_at` gives a plain pointer. A world joined by MPI (feature `mpi`) has one node per
//! host (or per `DIST_TENSOR_RANKS_PER_NODE` ranks); a peer on another node has no pointer here,
//! and data reaches it through [`Transport::put`], which hands the transfer to the process's proxy
//! thread (see `shmem::mpi`). Without the feature the link type has no values, so every call
//! below that would use it is unreachable: no `cfg` leaks into the code that uses a transport.

use std::sync::Arc;
use std::sync::atomic::AtomicUsize;

use super::SignalOp;
use super::control::Control;
use super::world::WorldShared;
use crate::Result;

/// Which node each rank is on, and the ranks of each node in rank order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Nodes {
    node_of: Vec<usize>,
    ranks: Vec<Vec<usize>>,
}

impl Nodes {
    /// Every rank of a world of `n` on one node.
    pub(crate) fn single(n: usize) -> Nodes {
        Nodes { node_of: vec![0; n], ranks: vec![(0..n).collect()] }
    }

    /// Nodes from each rank's node label: nodes are numbered in the order of their lowest rank.
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))] // used by the MPI world only
    pub(crate) fn from_labels(labels: &[usize]) -> Nodes {
        let mut seen: Vec<usize> = Vec::new();
        let mut node_of = Vec::with_capacity(labels.len());
        let mut ranks: Vec<Vec<usize>> = Vec::new();
        for (rank, label) in labels.iter().enumerate() {
            let node = match seen.iter().position(|l| l == label) {
                Some(node) => node,
                None => {
                    seen.push(*label);
                    ranks.push(Vec::new());
                    seen.len() - 1
                }
            };
            node_of.push(node);
            ranks[node].push(rank);
        }
        Nodes { node_of, ranks }
    }

    #[cfg_attr(not(feature = "mpi"), allow(dead_code))] // used by the MPI world only
    pub(crate) fn num_ranks(&self) -> usize {
        self.node_of.len()
    }

    pub(crate) fn count(&self) -> usize {
        self.ranks.len()
    }

    pub(crate) fn node_of(&self, rank: usize) -> usize {
        self.node_of[rank]
    }

    /// The ranks of `node`, in rank order.
    pub(crate) fn ranks(&self, node: usize) -> &[usize] {
        &self.ranks[node]
    }

    /// `rank`'s index among the ranks of its node.
    pub(crate) fn local_index(&self, rank: usize) -> usize {
        let node = &self.ranks[self.node_of[rank]];
        node.iter().position(|&r| r == rank).expect("a rank is on its node")
    }

    /// The rank of `node` that stands for `rank` there: the one with the same local index, or
    /// that index modulo the node's size when nodes differ in size. Hierarchical ops send a
    /// rank's data to its stand-in on every other node, which forwards it on its node.
    pub(crate) fn stand_in(&self, node: usize, rank: usize) -> usize {
        let ranks = &self.ranks[node];
        ranks[self.local_index(rank) % ranks.len()]
    }
}

/// One transfer to a peer on another node: `rows` rows of `row_bytes` bytes from `src` (rows
/// `src_stride` bytes apart) to byte `dst_offset` of the peer's segment (rows `dst_stride` apart),
/// then `signal`, if any, applied to the signal cell at that byte offset of the peer's segment.
#[cfg_attr(not(feature = "mpi"), allow(dead_code))] // used by the MPI world only
#[derive(Debug, Clone, Copy)]
pub(crate) struct Put {
    pub(crate) peer: usize,
    pub(crate) dst_offset: usize,
    pub(crate) dst_stride: usize,
    pub(crate) src: *const u8,
    pub(crate) src_stride: usize,
    pub(crate) rows: usize,
    pub(crate) row_bytes: usize,
    pub(crate) signal: Option<(usize, SignalOp)>,
}

impl Put {
    /// A signal alone: no data.
    pub(crate) fn signal_only(peer: usize, offset: usize, op: SignalOp) -> Put {
        Put {
            peer,
            dst_offset: 0,
            dst_stride: 0,
            src: std::ptr::null(),
            src_stride: 0,
            rows: 0,
            row_bytes: 0,
            signal: Some((offset, op)),
        }
    }

    #[cfg_attr(not(feature = "mpi"), allow(dead_code))] // used by the MPI world only
    pub(crate) fn bytes(&self) -> usize {
        self.rows * self.row_bytes
    }
}

/// Elements of an MPI collective: bytes (moved as they are), or floats (summed by MPI).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Elem {
    Bytes,
    F32,
    F64,
}

/// An MPI collective for an unfused baseline, on buffers the caller hands over (see
/// [`Transport::collective`]); counts and displacements in elements.
#[cfg_attr(not(feature = "mpi"), allow(dead_code))] // used by the MPI world only
pub(crate) enum CollectiveKind {
    AllGatherV {
        send: *const u8,
        send_count: usize,
        recv: *mut u8,
        counts: Vec<usize>,
        displs: Vec<usize>,
        elem: Elem,
    },
    ReduceScatter {
        send: *const u8,
        recv: *mut u8,
        counts: Vec<usize>,
        elem: Elem,
    },
    AllToAllV {
        send: *const u8,
        send_counts: Vec<usize>,
        send_displs: Vec<usize>,
        recv: *mut u8,
        recv_counts: Vec<usize>,
        recv_displs: Vec<usize>,
        elem: Elem,
    },
}

impl CollectiveKind {
    pub(crate) fn name(&self) -> &'static str {
        match self {
            CollectiveKind::AllGatherV { .. } => "MPI_Iallgatherv",
            CollectiveKind::ReduceScatter { .. } => "MPI_Ireduce_scatter",
            CollectiveKind::AllToAllV { .. } => "MPI_Ialltoallv",
        }
    }
}

/// Buffers a collective owns while MPI may use them: the caller gets them back when it
/// completed, and never if the world failed first (then they stay with the proxy, so that a late
/// completion cannot write into freed memory).
pub(crate) type Owned = Vec<Box<dyn std::any::Any + Send>>;

#[cfg(feature = "mpi")]
pub(crate) type Link = super::mpi::Link;

/// Without the `mpi` feature there is no link to another node: this type has no values.
#[cfg(not(feature = "mpi"))]
pub(crate) enum Link {}

#[cfg(not(feature = "mpi"))]
impl Link {
    pub(crate) fn for_group(
        &self,
        _id: u64,
        _heap: Arc<super::heap::Heap>,
        _index: usize,
    ) -> Arc<Link> {
        match *self {}
    }
    pub(crate) fn put(&self, _world: &WorldShared, _put: &Put) -> Result<()> {
        match *self {}
    }
    pub(crate) fn quiet(&self, _world: &WorldShared, _rank: usize) -> Result<()> {
        match *self {}
    }
    pub(crate) fn blocked(&self) -> &AtomicUsize {
        match *self {}
    }
    pub(crate) fn shutdown(&self, _control: &Control) {
        match *self {}
    }
    pub(crate) fn collective(
        &self,
        _world: &WorldShared,
        _rank: usize,
        _kind: CollectiveKind,
        _buffers: Owned,
    ) -> Result<Owned> {
        match *self {}
    }
}

/// The world of a job started by an MPI launcher, when the `mpi` feature is on: `None` otherwise
/// (the job's processes then meet as the processes of one host).
pub(crate) fn join_by_mpi(env: &super::job_env::JobEnv) -> Option<Result<super::World>> {
    #[cfg(feature = "mpi")]
    if env.by_mpi() {
        return Some(super::mpi::world_from_env(env));
    }
    let _ = env;
    None
}

/// A world's way to its peers.
pub(crate) struct Transport {
    pub(crate) nodes: Nodes,
    pub(crate) link: Option<Arc<Link>>,
}

impl Transport {
    /// Every rank on this node, reached by pointer.
    pub(crate) fn local(n: usize) -> Transport {
        Transport { nodes: Nodes::single(n), link: None }
    }

    /// The link to other nodes, if the world has any.
    pub(crate) fn link(&self) -> Option<&Link> {
        self.link.as_deref()
    }

    /// Counts threads blocked in a wait (the proxy polls harder while any is), if there is a
    /// proxy; and wakes it when the first one blocks.
    pub(crate) fn blocked(&self) -> Option<&AtomicUsize> {
        self.link().map(Link::blocked)
    }

    /// Hands `put` to the proxy (for a peer on another node).
    pub(crate) fn put(&self, world: &WorldShared, put: &Put) -> Result<()> {
        match self.link() {
            Some(link) => link.put(world, put),
            None => unreachable!("a put to another node in a world of one node"),
        }
    }

    /// Waits until every transfer this rank handed to the proxy has left its source.
    pub(crate) fn quiet(&self, world: &WorldShared, rank: usize) -> Result<()> {
        match self.link() {
            Some(link) => link.quiet(world, rank),
            None => Ok(()),
        }
    }

    /// Runs an MPI collective on every rank (an unfused baseline), on `buffers`, which `kind`
    /// points into; returns them.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) in a world not joined by MPI, or
    /// for counts MPI cannot take; [`Error::PeerFailed`](crate::Error::PeerFailed) if the world
    /// fails meanwhile.
    pub(crate) fn collective(
        &self,
        world: &WorldShared,
        rank: usize,
        kind: CollectiveKind,
        buffers: Owned,
    ) -> Result<Owned> {
        match self.link() {
            Some(link) => link.collective(world, rank, kind, buffers),
            // A group of ranks of one node has no link either: say so, not that the job lacks
            // MPI (what it said of the groups inside a node of an MPI job).
            None if world.parent.is_some() => Err(crate::Error::InvalidArgument {
                op: kind.name(),
                rank,
                reason: "an MPI collective (an unfused baseline) runs over the whole world of an \
                         MPI job, not over a group"
                    .into(),
            }),
            None => Err(crate::Error::InvalidArgument {
                op: kind.name(),
                rank,
                reason: "an MPI collective needs a world joined by MPI (feature `mpi`, started by \
                         mpirun)"
                    .into(),
            }),
        }
    }

    /// At the end of the world: tells the peers on other nodes and waits for theirs.
    pub(crate) fn shutdown(&self, control: &Control) {
        if let Some(link) = self.link() {
            link.shutdown(control);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nodes_are_numbered_by_their_lowest_rank_and_stand_ins_wrap() {
        let nodes = Nodes::from_labels(&[7, 3, 7, 3, 9]);
        assert_eq!(nodes.count(), 3);
        assert_eq!(nodes.ranks(0), &[0, 2]);
        assert_eq!(nodes.ranks(1), &[1, 3]);
        assert_eq!(nodes.ranks(2), &[4]);
        assert_eq!(nodes.local_index(3), 1);
        assert_eq!(nodes.stand_in(1, 2), 3); // local index 1 on node 1
        assert_eq!(nodes.stand_in(2, 3), 4); // node 2 has one rank
        assert_eq!(nodes.stand_in(0, 4), 0);
        assert_eq!(Nodes::single(3).ranks(0), &[0, 1, 2]);
    }
}
