//! Routing across the nodes of a world joined by MPI, the one place the fused ops decide it: who
//! sends what to which node, through which rank of it (its *stand-in*, `Rank::stand_in`), in
//! what order, and in what chunks. `all_gather_matmul` pushes each shard once per node and the
//! stand-in forwards it ([`GatherRoutes`]); `matmul_reduce_scatter` reduces inside each node,
//! then a stand-in sends each node's sum to the rows' owner ([`ReducePlan`]); `all_to_all` puts
//! blocks to a rank of another node in chunks of [`REMOTE_CHUNK_ELEMS`] ([`chunk_elems`]). On one
//! node every route is a copy within it.

use crate::shmem::Rank;

/// Elements a fused op puts to a rank of another node at once (a world joined by MPI), the same
/// for every op: each put is one message through the proxies and MPI, whose cost per message is
/// tens of microseconds (measured over loopback TCP, see `perf_report --mpi`), so these chunks
/// are larger than the copies within a node.
pub(crate) const REMOTE_CHUNK_ELEMS: usize = 256 * 1024;

/// Elements per chunk from rank `src` to rank `dst`: `local` within a node,
/// [`REMOTE_CHUNK_ELEMS`] across nodes.
pub(crate) fn chunk_elems(rank: &Rank<'_>, src: usize, dst: usize, local: usize) -> usize {
    if rank.node_of(src) == rank.node_of(dst) { local } else { REMOTE_CHUNK_ELEMS }
}

/// `all_gather_matmul`: where a rank's rows go: copies to the ranks of its node, puts to its stand-ins on the other
/// nodes, and the shards of other nodes it forwards on its node.
pub(crate) struct GatherRoutes {
    /// Ranks of this node that get this rank's rows by copy (itself too when tiles read the
    /// gathered rows), rotated.
    pub(crate) local: Vec<usize>,
    /// This rank's stand-in on each other node, nodes in the order after this one.
    pub(crate) remote: Vec<usize>,
    /// Shards of other nodes this rank receives for its node, and the ranks it forwards them to.
    pub(crate) forwards: Vec<usize>,
    pub(crate) neighbours: Vec<usize>,
}

impl GatherRoutes {
    pub(crate) fn new(rank: &Rank<'_>, per_shard: bool) -> GatherRoutes {
        let (me, n) = (rank.rank(), rank.num_ranks());
        let (nodes, node) = (rank.num_nodes(), rank.node_of(me));
        let on_node = |r: usize| rank.node_of(r) == node;
        let local: Vec<usize> = (1..n)
            .map(|i| (me + i) % n)
            .filter(|&r| on_node(r))
            .chain((!per_shard).then_some(me))
            .collect();
        let remote = (1..nodes).map(|i| rank.stand_in((node + i) % nodes, me)).collect();
        // Shards arrive from the nodes before this one first (each sends to its next node first).
        let forwards = (1..nodes)
            .flat_map(|i| rank.node_ranks((node + nodes - i) % nodes).to_vec())
            .filter(|&s| rank.stand_in(node, s) == me)
            .collect();
        let neighbours = local.iter().copied().filter(|&r| r != me).collect();
        GatherRoutes { local, remote, forwards, neighbours }
    }

    /// Shards in the order they become available here: own, this node's (rotated), then the
    /// nodes before this one, nearest first.
    pub(crate) fn arrival_order(&self, rank: &Rank<'_>) -> Vec<usize> {
        let (me, n) = (rank.rank(), rank.num_ranks());
        let (nodes, node) = (rank.num_nodes(), rank.node_of(me));
        let mut order: Vec<usize> =
            (0..n).map(|i| (me + i) % n).filter(|&r| rank.node_of(r) == node).collect();
        for i in 1..nodes {
            order.extend_from_slice(rank.node_ranks((node + nodes - i) % nodes));
        }
        order
    }

    /// Who signals each shard's arrival on `rank`: the shard's rank itself when it is of this
    /// node or this rank stands in for it, else its stand-in on this node, which forwards it.
    pub(crate) fn signallers(&self, rank: &Rank<'_>) -> Vec<usize> {
        let me = rank.rank();
        let my_node = rank.node_of(me);
        (0..rank.num_ranks())
            .map(|s| {
                let forwarder = rank.stand_in(my_node, s);
                if rank.node_of(s) != my_node && forwarder != me { forwarder } else { s }
            })
            .collect()
    }
}

/// `matmul_reduce_scatter` across nodes: who reduces what on this rank's node (see
/// `matmul_reduce_scatter::nodes`).
pub(crate) struct ReducePlan {
    pub(crate) me: usize,
    pub(crate) node: usize,
    pub(crate) nodes: usize,
    /// This node's ranks, in rank order.
    pub(crate) locals: Vec<usize>,
    /// Ranks of other nodes whose rows this rank reduces here, nodes after this one first.
    pub(crate) served: Vec<usize>,
    pub(crate) node_of: Vec<usize>,
    /// `reducer[d]`: the rank of this node that reduces rank `d`'s rows here.
    pub(crate) reducer: Vec<usize>,
    /// `senders[c]`: the rank of node `c` that sends that node's sum of this rank's rows.
    pub(crate) senders: Vec<usize>,
}

impl ReducePlan {
    pub(crate) fn new(rank: &Rank<'_>) -> ReducePlan {
        let (me, n) = (rank.rank(), rank.num_ranks());
        let (nodes, node) = (rank.num_nodes(), rank.node_of(me));
        let node_of: Vec<usize> = (0..n).map(|r| rank.node_of(r)).collect();
        let reducer: Vec<usize> =
            (0..n).map(|d| if node_of[d] == node { d } else { rank.stand_in(node, d) }).collect();
        let served = (1..nodes)
            .flat_map(|i| rank.node_ranks((node + i) % nodes).to_vec())
            .filter(|&d| reducer[d] == me)
            .collect();
        let senders = (0..nodes).map(|c| rank.stand_in(c, me)).collect();
        let locals = rank.node_ranks(node).to_vec();
        ReducePlan { me, node, nodes, locals, served, node_of, reducer, senders }
    }

    /// The owners of the rows in the order this rank computes them: the nodes after this one
    /// first (nearest first), then this node's other ranks (rotated), its own last.
    pub(crate) fn tile_order(&self, rank: &Rank<'_>) -> Vec<usize> {
        let (me, world, node, nodes) = (self.me, rank.num_ranks(), self.node, self.nodes);
        (1..nodes)
            .flat_map(|i| rank.node_ranks((node + i) % nodes).to_vec())
            .chain((1..=world).map(|i| (me + i) % world).filter(|&r| self.node_of[r] == node))
            .collect()
    }

    /// The (reducer, node of the rows) pairs a tile covering `owners` is announced to.
    pub(crate) fn announce(&self, owners: impl Iterator<Item = usize>) -> Vec<(usize, usize)> {
        let mut to: Vec<(usize, usize)> =
            owners.map(|d| (self.reducer[d], self.node_of[d])).collect();
        to.sort_unstable();
        to.dedup();
        to
    }
}
