//! flash_decode's tile kernel on the host (the op, its agreement and its unfused baseline:
//! [`crate::fused::flash_decode`]).
//!
//! One launch, two phases, no host barrier between them. A task of the first phase is one
//! `(batch, span of this rank's keys)` (`tensor::decode_attention::spans`: whole chunks of 256
//! keys, at least 16 tasks a rank where there are chunks enough): the scores of every query head
//! against the span (its kv head's keys), their softmax and the weighted sum of the span's
//! values, normalised, with the log-sum-exp of the scores (chunk by chunk, merged): one *record*
//! `[o (Dv), lse]` per query head. The task
//! writes its records straight into every rank's symmetric receive buffer (peers rotated, its own
//! rank too), at the place the agreed key counts give them; each program then adds the number of
//! tasks it finished to each rank's signal for this source (a put carries its own signal to a
//! peer on another node). A task of the second phase is one `(batch, head)`: once every source's
//! count is complete, it combines the records of every rank's spans (log-sum-exp weights, in
//! rank order, so that every rank computes the same bits) into the output row.
//!
//! One program per AI core (the host's cores over the ranks of the node): the tasks are
//! arithmetic on streamed keys, and two threads on one core only take turns.
//!
//! A receive buffer is rewritten only in the next call, after its agreement exchange, which every
//! rank enters only once it has read its buffer in this one.

use crate::Result;
use crate::device::{LaunchMode, launch, tile};
use crate::shmem::{
    GlobalPtr, GlobalPtrMut, NotifySem, Rank, Scope, SignalBuf, SignalOp, SymmBuf, Token, WaitCmp,
    WaitSem, Workspace, consume_token, symm_at,
};
use crate::tensor::decode_attention::{Combine, DecodeScratch, Heads, decode_span_records, spans};
use crate::tensor::{Element, Tensor};

const OP: &str = "flash_decode";

/// The agreed shapes of one call: `q` `[batch, heads, d]` on every rank, rank `r`'s keys
/// `[batch, keys[r], kv_heads, d]` and values `[batch, keys[r], kv_heads, dv]`.
#[derive(Debug, Clone)]
pub(crate) struct DecodeLayout {
    pub(crate) batch: usize,
    pub(crate) heads: usize,
    pub(crate) kv_heads: usize,
    pub(crate) d: usize,
    pub(crate) dv: usize,
    pub(crate) keys: Vec<usize>,
    pub(crate) scale: f64,
}

impl DecodeLayout {
    /// The heads and widths.
    pub(crate) fn heads(&self) -> Heads {
        Heads { heads: self.heads, kv_heads: self.kv_heads, d: self.d, dv: self.dv }
    }

    /// Spans of rank `r`'s keys per sequence (see `decode_attention::spans`).
    pub(crate) fn spans(&self, r: usize) -> usize {
        spans(self.keys[r], self.batch).0
    }

    /// Values of one record: the output row and its log-sum-exp.
    pub(crate) fn record(&self) -> usize {
        self.dv + 1
    }

    /// First-phase tasks of rank `r`: one per (batch, span).
    pub(crate) fn tasks(&self, r: usize) -> usize {
        self.batch * self.spans(r)
    }

    /// Where rank `r`'s records start in every receive buffer, and (last) the buffer's length.
    pub(crate) fn source_offsets(&self) -> Vec<usize> {
        let mut offsets = vec![0];
        for r in 0..self.keys.len() {
            let last = *offsets.last().expect("starts with 0");
            offsets.push(last + self.batch * self.spans(r) * self.heads * self.record());
        }
        offsets
    }
}

struct FlashDecodeWorkspace<A: Element> {
    recv: Option<SymmBuf<A>>,
    arrived: SignalBuf,
    expected: Vec<u64>,
}

impl<A: Element> Workspace for FlashDecodeWorkspace<A> {
    fn symmetric_bytes(&self) -> usize {
        self.arrived.len() * 64 + self.recv.as_ref().map_or(0, |r| r.len() * size_of::<A>())
    }
}

impl<A: Element> FlashDecodeWorkspace<A> {
    fn new(rank: &Rank<'_>) -> Result<Self> {
        let n = rank.num_ranks();
        Ok(FlashDecodeWorkspace {
            recv: None,
            arrived: rank.alloc_signals_for("flash_decode arrived", n)?,
            expected: vec![0; n],
        })
    }
}

/// The kernel: this rank's `[batch, heads, dv]` output and `[batch, heads]` log-sum-exp, the
/// same on every rank.
pub(crate) fn flash_decode<T: Element>(
    rank: &Rank<'_>,
    layout: &DecodeLayout,
    q: &Tensor<T>,
    k: &Tensor<T>,
    v: &Tensor<T>,
) -> Result<(Tensor<T>, Tensor<T::Acc>)> {
    rank.with_workspace(FlashDecodeWorkspace::<T::Acc>::new, |ws| run(rank, ws, layout, q, k, v))
}

fn run<T: Element>(
    rank: &Rank<'_>,
    ws: &mut FlashDecodeWorkspace<T::Acc>,
    l: &DecodeLayout,
    q: &Tensor<T>,
    k: &Tensor<T>,
    v: &Tensor<T>,
) -> Result<(Tensor<T>, Tensor<T::Acc>)> {
    let (me, n) = (rank.rank(), rank.num_ranks());
    let offsets = l.source_offsets();
    rank.reserve_for("flash_decode receive", &mut ws.recv, offsets[n].max(1))?;
    for src in 0..n {
        ws.expected[src] += l.tasks(src) as u64;
    }
    let mut out = Tensor::<T>::scratch(OP, &[l.batch, l.heads, l.dv])?;
    let mut lse = Tensor::<T::Acc>::scratch(OP, &[l.batch, l.heads])?;
    let (out_ptr, lse_ptr) = (
        GlobalPtrMut::from_slice(out.as_mut_slice()),
        GlobalPtrMut::from_slice(lse.as_mut_slice()),
    );
    let (recv, arrived, expected) =
        (ws.recv.as_ref().expect("reserved"), &ws.arrived, &ws.expected);
    let inputs = (q.as_slice(), k.as_slice(), v.as_slice());
    // SAFETY: a task writes its records into each rank's receive buffer at the place of its own
    // (source, batch, span, heads), which no other task of any rank writes, and announces them
    // after writing; records are read only after every source's count is complete. A receive
    // buffer is rewritten only after the next call's exchange. Output rows have one writer each.
    unsafe {
        launch(rank, LaunchMode::VectorOnly, rank.topology().aicore_num(), |p| {
            let mut scratch = Scratch::<T>::new(l);
            let mut done = 0u64;
            for t in p.tasks(l.tasks(me)) {
                partial(l, inputs, t, me, &mut scratch);
                for dst in (0..n).map(|i| (me + i) % n) {
                    let at = offsets[me] + scratch.record_at;
                    let records = &scratch.records[..];
                    if p.is_local(dst) {
                        tile::store_1d(symm_at(recv, dst) + at, records, records.len());
                    } else {
                        // Through the proxy: the put carries its own signal.
                        let signal = (arrived, me);
                        let from = GlobalPtr::from_slice(records);
                        p.put_signal(recv.ptr() + at, dst, from, records.len(), signal, add(1))?;
                    }
                }
                done += 1;
            }
            if done > 0 {
                for dst in (0..n).map(|i| (me + i) % n).filter(|&dst| p.is_local(dst)) {
                    p.notify(arrived, me, dst, add(done), Scope::Peer, NotifySem::Release)?;
                }
            }
            let mut tokens: Vec<Option<Token>> = vec![None; n];
            for task in p.tasks(l.batch * l.heads) {
                for src in (0..n).filter(|&s| l.tasks(s) > 0) {
                    if tokens[src].is_none() {
                        let want = WaitCmp::Ge(expected[src]);
                        tokens[src] =
                            Some(p.wait_from(arrived, src, src, want, WaitSem::Acquire)?);
                    }
                }
                combine(l, &offsets, recv, &tokens, task, &mut scratch, out_ptr, lse_ptr);
            }
            Ok(())
        })?;
    }
    Ok((out, lse))
}

fn add(count: u64) -> SignalOp {
    SignalOp::Add(count)
}

/// A program's own memory: a task's scratch and records, a combine task's rows.
struct Scratch<T: Element> {
    task: DecodeScratch<T::Acc>,
    records: Vec<T::Acc>,
    /// One chunk's records, merged into `records`.
    chunk_records: Vec<T::Acc>,
    /// Where the last task's records go in a source's part of the receive buffer.
    record_at: usize,
    /// A record read back, the output row a combine task accumulates, and that row rounded.
    record: Vec<T::Acc>,
    combined: Vec<T::Acc>,
    out_row: Vec<T>,
}

impl<T: Element> Scratch<T> {
    fn new(l: &DecodeLayout) -> Self {
        let zero = <T::Acc as Element>::zero();
        let h = l.heads();
        Scratch {
            task: DecodeScratch::new(&h),
            records: vec![zero; h.heads * h.record()],
            chunk_records: vec![zero; h.heads * h.record()],
            record_at: 0,
            record: vec![zero; h.record()],
            combined: vec![zero; l.dv],
            out_row: vec![T::zero(); l.dv],
        }
    }
}

/// Task `t` of the first phase on rank `me`: the records of one (batch, span) into
/// `s.records`, and where they go into `s.record_at`.
fn partial<T: Element>(
    l: &DecodeLayout,
    (q, k, v): (&[T], &[T], &[T]),
    t: usize,
    me: usize,
    s: &mut Scratch<T>,
) {
    let (h, (count, per)) = (l.heads(), spans(l.keys[me], l.batch));
    let (b, span) = (t / count, t % count);
    let (key0, keys) = (span * per, tile::valid_len(span * per, per, l.keys[me]));
    let (k_row, v_row) = (l.kv_heads * l.d, l.kv_heads * l.dv);
    let q = &q[b * l.heads * l.d..][..l.heads * l.d];
    let k = &k[(b * l.keys[me] + key0) * k_row..];
    let v = &v[(b * l.keys[me] + key0) * v_row..];
    let records = (&mut s.records[..], &mut s.chunk_records[..]);
    decode_span_records(&h, q, (k, k_row), (v, v_row), keys, l.scale, &mut s.task, records);
    s.record_at = (b * count + span) * l.heads * h.record();
}

/// Task `task` of the second phase: `(batch, head)`'s output row from every source's records,
/// weighted by their log-sum-exp, in rank order.
///
/// # Safety
/// Every source with tasks has a token in `tokens` (its records are complete).
#[allow(clippy::too_many_arguments)]
unsafe fn combine<T: Element>(
    l: &DecodeLayout,
    offsets: &[usize],
    recv: &SymmBuf<T::Acc>,
    tokens: &[Option<Token>],
    task: usize,
    s: &mut Scratch<T>,
    out: GlobalPtrMut<'_, T>,
    lse: GlobalPtrMut<'_, T::Acc>,
) {
    let (b, h, rec) = (task / l.heads, task % l.heads, l.record());
    let zero = <T::Acc as Element>::zero();
    let mut sum = Combine::new(&mut s.combined);
    for (src, token) in tokens.iter().enumerate() {
        let Some(token) = *token else { continue };
        let from = GlobalPtr::from(consume_token(recv.ptr(), token));
        for span in 0..l.spans(src) {
            let at = offsets[src] + ((b * l.spans(src) + span) * l.heads + h) * rec;
            // SAFETY: the record is complete (the token) and inside the buffer.
            unsafe { tile::load_1d(from + at, &mut s.record, rec, zero) };
            sum.add(&s.record);
        }
    }
    let lse_row = sum.finish(&mut s.out_row);
    // SAFETY: row (b, h) of the output and of the log-sum-exp is this task's alone.
    unsafe {
        tile::store_1d(out + task * l.dv, &s.out_row, l.dv);
        tile::store_1d(lse + task, &[lse_row], 1);
    }
}
