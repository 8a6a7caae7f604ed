//! The Ulysses all_to_all on GPUs (any scatter and gather dims; sizes need not divide by the world
//! size), fused, and its unfused baseline (permute, NCCL all_to_all, permute).
//!
//! Fused: one `dt_exchange` kernel. Every rank publishes its input's address to its peers; the
//! kernel's tasks (source rank rotated by this rank, run, chunk) read `symm_at(x, src)` over
//! NVLink and write the final layout with 16-byte accesses: no permute copies.

use super::{CHUNK_BYTES, exchange, offsets, out_tensor};
use crate::device::cuda::kernels::Runs;
use crate::device::cuda::storage::DeviceStorage;
use crate::device::cuda::world::{CudaRank, OP_ALL_TO_ALL};
use crate::tensor::Element;
use crate::{Error, Result};

const OP: &str = "all_to_all";

/// The geometry of one all_to_all: the tensor seen as `[p0, a, p1, b, p2]` around the two dims.
struct Geometry {
    p0: usize,
    p1: usize,
    p2: usize,
    /// Whether the scatter dim is the later of the two (`b`).
    scatter_later: bool,
    /// Full size of the scatter dim, and every rank's share of it.
    s_full: usize,
    s_split: Vec<usize>,
    s_off: Vec<usize>,
    /// Every rank's size along the gather dim, their offsets and the total.
    g_split: Vec<usize>,
    g_off: Vec<usize>,
    g_total: usize,
}

impl Geometry {
    fn new(
        shape: &[usize],
        scatter: usize,
        gather: usize,
        g_split: &[usize],
        n: usize,
    ) -> Geometry {
        let (a, b) = (scatter.min(gather), scatter.max(gather));
        let prod = |d: &[usize]| d.iter().product::<usize>();
        let s_full = shape[scatter];
        let s_split = super::array_split(s_full, n);
        let g_off = offsets(g_split);
        Geometry {
            p0: prod(&shape[..a]),
            p1: prod(&shape[a + 1..b]),
            p2: prod(&shape[b + 1..]),
            scatter_later: scatter == b,
            s_full,
            s_off: offsets(&s_split),
            s_split,
            g_total: g_off[n],
            g_split: g_split.to_vec(),
            g_off,
        }
    }

    /// The output shape on rank `r`.
    fn out_shape(&self, shape: &[usize], scatter: usize, gather: usize, r: usize) -> Vec<usize> {
        let mut s = shape.to_vec();
        s[scatter] = self.s_split[r];
        s[gather] = self.g_total;
        s
    }

    /// Runs moving rank `src`'s input (laid out `src_base` + its natural layout, or a compact
    /// part when `compact`) to rank `dst`'s output.
    fn runs(&self, src: usize, dst: usize, es: usize, src_compact: bool) -> Runs {
        let (p0, p1, p2) = (self.p0, self.p1, self.p2);
        let (gs, go, gt) = (self.g_split[src], self.g_off[src], self.g_total);
        let (sc, so) = (self.s_split[dst], self.s_off[dst]);
        if self.scatter_later {
            // src [p0, gs, p1, S, p2] (or compact [p0, gs, p1, sc, p2]) -> dst [p0, gt, p1, sc, p2].
            let (row, first) = if src_compact { (sc * p2, 0) } else { (self.s_full * p2, so * p2) };
            Runs::new(
                (p0, gs, p1),
                sc * p2,
                (first, gs * p1 * row, p1 * row, row),
                (go * p1 * sc * p2, gt * p1 * sc * p2, p1 * sc * p2, sc * p2),
                es,
                CHUNK_BYTES,
            )
        } else {
            // src [p0, S, p1, gs, p2] (or compact [p0, sc, p1, gs, p2]) -> dst [p0, sc, p1, gt, p2].
            let (outer, first) =
                if src_compact { (sc, 0) } else { (self.s_full, so * p1 * gs * p2) };
            Runs::new(
                (p0, sc, p1),
                gs * p2,
                (first, outer * p1 * gs * p2, p1 * gs * p2, gs * p2),
                (go * p2, sc * p1 * gt * p2, p1 * gt * p2, gt * p2),
                es,
                CHUNK_BYTES,
            )
        }
    }

    /// Elements rank `src` sends rank `dst`.
    fn part_len(&self, src: usize, dst: usize) -> usize {
        self.p0 * self.p1 * self.p2 * self.g_split[src] * self.s_split[dst]
    }

    /// The runs that pack rank `src`'s input for `dst` into a compact part (for NCCL).
    fn pack_runs(&self, src: usize, dst: usize, es: usize, base: usize) -> Runs {
        let mut r = self.runs(src, dst, es, false);
        let (p1, p2, gs, sc) = (self.p1, self.p2, self.g_split[src], self.s_split[dst]);
        if self.scatter_later {
            // Compact part [p0, gs, p1, sc, p2].
            (r.dbase, r.d0, r.da, r.d1) =
                (base as u64, (gs * p1 * sc * p2) as u64, (p1 * sc * p2) as u64, (sc * p2) as u64);
        } else {
            // Compact part [p0, sc, p1, gs, p2].
            (r.dbase, r.d0, r.da, r.d1) =
                (base as u64, (sc * p1 * gs * p2) as u64, (p1 * gs * p2) as u64, (gs * p2) as u64);
        }
        r
    }
}

fn check_dims(shape: &[usize], scatter: usize, gather: usize) -> Option<String> {
    if scatter >= shape.len() || gather >= shape.len() || scatter == gather {
        Some(format!(
            "dims {scatter} (scatter) and {gather} (gather) of a {}-D tensor",
            shape.len()
        ))
    } else {
        None
    }
}

/// The dimensions were agreed by the caller through the world's one exchange; checked here
/// against this rank's tensor.
fn check_here<T: Element>(x: &DeviceStorage<T>, scatter: usize, gather: usize) -> Result<()> {
    match check_dims(x.shape(), scatter, gather) {
        Some(reason) => Err(Error::InvalidShape { op: OP, reason }),
        None => Ok(()),
    }
}

/// The fused op: `x` is this rank's part, sharded on `gather` with sizes `g_split`; the result is
/// sharded on `scatter` (`array_split`) and whole along `gather`.
pub(crate) fn all_to_all<T: Element>(
    g: &CudaRank<'_>,
    x: &DeviceStorage<T>,
    scatter: usize,
    gather: usize,
    g_split: &[usize],
) -> Result<DeviceStorage<T>> {
    g.check()?;
    check_here(x, scatter, gather)?;
    let (n, r) = (g.num_ranks(), g.rank);
    if g_split.len() != n || g_split[r] != x.shape()[gather] {
        return Err(Error::InvalidShape {
            op: OP,
            reason: format!("gather sizes {g_split:?} do not fit shape {:?}", x.shape()),
        });
    }
    let geo = Geometry::new(x.shape(), scatter, gather, g_split, n);
    let out: DeviceStorage<T> = out_tensor(g, &geo.out_shape(x.shape(), scatter, gather, r))?;
    let es = size_of::<T>();
    let parts: Vec<Runs> = (0..n).map(|i| geo.runs((r + i) % n, r, es, false)).collect();
    if n == 1 {
        exchange::<T>(g, None, OP_ALL_TO_ALL, 0, x.ptr(), out.ptr(), &parts, &[], g.stream())?;
        return Ok(out);
    }
    g.with_state("all_to_all", |st| {
        st.epoch += 1;
        exchange::<T>(g, Some(st), OP_ALL_TO_ALL, 1, x.ptr(), out.ptr(), &parts, &[], g.stream())
    })?;
    Ok(out)
}

/// The unfused baseline a user would write: permute into one contiguous part per rank, NCCL
/// all_to_all (grouped send/recv), permute into the output layout. In a world whose ranks share
/// a GPU (which NCCL refuses) it is the world's own exchange kernel.
pub(crate) fn all_to_all_unfused<T: Element>(
    g: &CudaRank<'_>,
    x: &DeviceStorage<T>,
    scatter: usize,
    gather: usize,
    g_split: &[usize],
) -> Result<DeviceStorage<T>> {
    g.check()?;
    check_here(x, scatter, gather)?;
    if g.world.shares_devices() {
        // NCCL refuses ranks that share a GPU: the world's own exchange (the fused kernel).
        return all_to_all(g, x, scatter, gather, g_split);
    }
    let (n, r) = (g.num_ranks(), g.rank);
    let geo = Geometry::new(x.shape(), scatter, gather, g_split, n);
    let out: DeviceStorage<T> = out_tensor(g, &geo.out_shape(x.shape(), scatter, gather, r))?;
    let es = size_of::<T>();
    let send_len: Vec<usize> = (0..n).map(|d| geo.part_len(r, d)).collect();
    let recv_len: Vec<usize> = (0..n).map(|s| geo.part_len(s, r)).collect();
    let send_off = offsets(&send_len);
    let recv_off = offsets(&recv_len);
    let send: DeviceStorage<T> = out_tensor(g, &[send_off[n]])?;
    let recv: DeviceStorage<T> = out_tensor(g, &[recv_off[n]])?;
    let pack: Vec<Runs> = (0..n).map(|d| geo.pack_runs(r, d, es, send_off[d])).collect();
    exchange::<T>(g, None, OP_ALL_TO_ALL, 0, x.ptr(), send.ptr(), &pack, &[], g.stream())?;
    let nccl = g.world.nccl()?;
    let at = |base: u64, o: usize| base + (o * es) as u64;
    let sends: Vec<(u64, usize)> =
        (0..n).map(|d| (at(send.ptr(), send_off[d]), send_len[d])).collect();
    let recvs: Vec<(u64, usize)> =
        (0..n).map(|s| (at(recv.ptr(), recv_off[s]), recv_len[s])).collect();
    nccl.send_recv(r, g.stream(), T::DTYPE, &sends, &recvs)?;
    let unpack: Vec<Runs> = (0..n)
        .map(|s| {
            let mut runs = geo.runs(s, r, es, true);
            runs.sbase += recv_off[s] as u64;
            runs
        })
        .collect();
    exchange::<T>(g, None, OP_ALL_TO_ALL, 0, recv.ptr(), out.ptr(), &unpack, &[], g.stream())?;
    Ok(out)
}
