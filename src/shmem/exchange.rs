//! The exchange every collective call starts with: every rank tells every rank what the call is
//! and its arguments, without a separate barrier.
//!
//! One exchange per rank serves every call (every collective and fused op, every symmetric
//! allocation, every barrier), so that any two calls the ranks make at the same point meet in it,
//! whatever their op or element type. Each rank keeps its message in an *outbox* in its own
//! segment (double-buffered by call number), then adds one to an *arrival counter* of every rank
//! (also one pair per segment). A rank whose counter shows every rank's arrival reads what it
//! needs from the peers' outboxes through their segment bases. Per rank that is one write of the
//! message, `n` counter increments and `n` small reads: linear in the world size.
//!
//! A message says what the call is (its op, element type and the rank's call number `#k`),
//! carries the arguments and, if the rank found its own input invalid, what is wrong. So every
//! rank validates the same words the same way and fails together with the others: ranks in
//! different calls get [`Error::OpMismatch`] naming both sides, a rank's bad input becomes
//! [`Error::InvalidArgument`] naming it with its own words, and a rank that left `run`
//! ([`Error::PeerGone`]) or failed ([`Error::PeerFailed`]) ends the wait at once.
//!
//! Across nodes (a world joined by MPI) a rank cannot read a remote peer's outbox: it *puts* its
//! message into an *inbox* the peer keeps for it (in the peer's reserved part, one per rank and
//! parity) and the put's signal adds one to the peer's arrival counter, data first. A reader
//! takes a local peer's message from its outbox and a remote peer's from its own inbox; the rest
//! is the same.
//!
//! Why a rank cannot overwrite an outbox a peer still reads: a rank finishes call `k` only after
//! every rank arrived in it, so no rank can be in call `k + 2` (which reuses call `k`'s outbox)
//! while another is still in call `k`. The same argument makes the counters exact: counter
//! `k % 2` of a rank in call `k` has every rank's arrivals up to call `k - 2`, and some of call
//! `k`, never of call `k + 2`. And it makes an exchange a safe point to reuse an op's other
//! buffers: when it returns, every peer has left the previous call.

use std::sync::atomic::{AtomicU64, Ordering};

use super::crossed::{Crossing, Posted, left_elsewhere, root_of};
use super::sync::{Cell, WaitOutcome, wait_until_checked};
use super::transport::Put;
use super::{Rank, SignalOp};
use crate::tensor::{Element, Pod, short_type_name};
use crate::{Error, Result};

/// Most argument words a call sends to every rank.
pub const MAX_WORDS: usize = 64;
/// Most words a call sends to each rank in particular (see [`Rank::exchange`]).
pub(crate) const MAX_PERSONAL: usize = 2;
const NAME_BYTES: usize = 40;
const TEXT_BYTES: usize = 512;
const HEADER_WORDS: usize = 8;
const WORDS_AT: usize = HEADER_WORDS;
const TEXT_AT: usize = WORDS_AT + MAX_WORDS;
const PERSONAL_AT: usize = TEXT_AT + TEXT_BYTES / 8;
const CELL_BYTES: usize = 64;
const PROBLEM: u64 = 1 << 63;

/// What a collective call is: its op and element type (empty for none).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Call {
    pub(crate) op: &'static str,
    pub(crate) dtype: &'static str,
}

impl Call {
    /// A call with no element type (a barrier, a shape exchange).
    pub(crate) fn untyped(op: &'static str) -> Call {
        Call { op, dtype: "" }
    }

    /// A call on elements of type `T`.
    pub(crate) fn of<T: Element>(op: &'static str) -> Call {
        Call { op, dtype: dtype_name::<T>() }
    }

    /// A call on plain data of type `T` (a symmetric allocation).
    pub(crate) fn of_pod<T: Pod>(op: &'static str) -> Call {
        Call { op, dtype: short_type_name::<T>() }
    }
}

/// A 64-bit digest of `words` (FNV-1a), for checking that ranks hold the same long vector without
/// sending it whole.
pub(crate) fn digest(words: impl IntoIterator<Item = u64>) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for w in words {
        for b in w.to_le_bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

/// `f32`, `bf16`, ...
pub(crate) fn dtype_name<T: Element>() -> &'static str {
    match T::DTYPE {
        crate::DType::F32 => "f32",
        crate::DType::F64 => "f64",
        crate::DType::F16 => "f16",
        crate::DType::BF16 => "bf16",
    }
}

/// Bytes each rank's segment keeps for the exchange (and so for every barrier); with inboxes for
/// the messages of ranks on other nodes when the world has several nodes.
pub(crate) fn reserved_bytes(num_ranks: usize, inboxes: bool) -> usize {
    let inbox = if inboxes { 2 * num_ranks * outbox_bytes(num_ranks) } else { 0 };
    2 * CELL_BYTES + 2 * outbox_bytes(num_ranks) + inbox
}

/// Byte offset, in a rank's segment, of the inbox where rank `from`'s messages of `parity` land.
fn inbox_offset(num_ranks: usize, from: usize, parity: usize) -> usize {
    2 * CELL_BYTES + (2 + parity * num_ranks + from) * outbox_bytes(num_ranks)
}

fn outbox_bytes(num_ranks: usize) -> usize {
    ((PERSONAL_AT + MAX_PERSONAL * num_ranks) * 8).next_multiple_of(super::heap::ALIGN)
}

/// This rank's view of one exchange: every rank's words, and what each sent to this rank.
#[derive(Debug, Clone)]
pub(crate) struct Exchanged {
    words: Vec<u64>,
    starts: Vec<usize>,
    personal: Vec<u64>,
    per_rank: usize,
}

impl Exchanged {
    /// Number of ranks.
    pub(crate) fn len(&self) -> usize {
        self.starts.len() - 1
    }

    /// Every rank's words, in rank order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &[u64]> + '_ {
        (0..self.len()).map(|r| &self[r])
    }

    /// What rank `r` sent to this rank in particular.
    pub(crate) fn personal(&self, r: usize) -> &[u64] {
        &self.personal[r * self.per_rank..(r + 1) * self.per_rank]
    }

    /// Checks that word `index` is the same on every rank; returns it.
    pub(crate) fn agree(&self, op: &'static str, index: usize, what: &str) -> Result<u64> {
        let word = |r: usize| self[r].get(index).copied();
        let first = word(0);
        if let Some(bad) = (0..self.len()).find(|&r| word(r) != first) {
            let show = |w: Option<u64>| w.map_or("nothing".to_string(), |v| v.to_string());
            return Err(Error::RanksDisagree {
                op,
                rank_a: 0,
                value_a: format!("{what} = {}", show(first)),
                rank_b: bad,
                value_b: format!("{what} = {}", show(word(bad))),
            });
        }
        Ok(first.unwrap_or(0))
    }

    fn to_vecs(&self) -> Vec<Vec<u64>> {
        self.iter().map(<[u64]>::to_vec).collect()
    }
}

impl std::ops::Index<usize> for Exchanged {
    type Output = [u64];

    fn index(&self, r: usize) -> &[u64] {
        &self.words[self.starts[r]..self.starts[r + 1]]
    }
}

/// A call as a message shows it: `all_gather<f32> #12`.
pub(crate) fn describe(op: &str, dtype: &str, seq: u64) -> String {
    if dtype.is_empty() { format!("{op} #{seq}") } else { format!("{op}<{dtype}> #{seq}") }
}

fn pack_name(text: &str, bytes: usize) -> Vec<u64> {
    let mut packed = vec![0u64; bytes.div_ceil(8)];
    for (i, b) in text.bytes().take(bytes).enumerate() {
        packed[i / 8] |= u64::from(b) << (8 * (i % 8));
    }
    packed
}

fn unpack_name(words: &[u64]) -> String {
    let bytes: Vec<u8> =
        words.iter().flat_map(|w| w.to_le_bytes()).take_while(|&b| b != 0).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// The fixed words of a rank's message, as read by a peer.
struct Header {
    seq: u64,
    meta: u64,
    name: [u64; 5],
    dtype: u64,
}

impl Header {
    // A peer's words are read as what they can be: counts beyond what an outbox holds are cut
    // to it, so no value in shared memory makes a read leave the peer's outbox.
    fn words(&self) -> usize {
        ((self.meta & 0xffff) as usize).min(MAX_WORDS)
    }
    fn text_len(&self) -> usize {
        (((self.meta >> 16) & 0xffff) as usize).min(TEXT_BYTES)
    }
    fn per_rank(&self) -> usize {
        (((self.meta >> 32) & 0xff) as usize).min(MAX_PERSONAL)
    }
    fn problem(&self) -> bool {
        self.meta & PROBLEM != 0
    }
    fn same_call(&self, other: &Header) -> bool {
        self.seq == other.seq && self.name == other.name && self.dtype == other.dtype
    }
    fn describe(&self) -> String {
        describe(&unpack_name(&self.name), &unpack_name(&[self.dtype]), self.seq)
    }
}

/// Per rank, in its own process: the number of its last call.
#[derive(Debug, Default)]
pub(crate) struct CallCounter {
    pub(crate) seq: u64,
}

impl Rank<'_> {
    /// The arrival counter `parity` of `rank`.
    fn arrivals(&self, rank: usize, parity: usize) -> &Cell {
        let heap = &self.world.heap;
        // SAFETY: the first two 64-byte lines of every segment are the exchange's counters,
        // 8-aligned, accessed only atomically.
        unsafe { &*(heap.base(rank).add(parity * CELL_BYTES) as *const Cell) }
    }

    /// Word `i` of `rank`'s outbox `parity`.
    fn outbox(&self, rank: usize, parity: usize, i: usize) -> *mut u64 {
        let n = self.num_ranks();
        debug_assert!(i < PERSONAL_AT + MAX_PERSONAL * n);
        let offset = 2 * CELL_BYTES + parity * outbox_bytes(n) + i * 8;
        // SAFETY: inside the segment's reserved part (see `reserved_bytes`).
        unsafe { self.world.heap.base(rank).add(offset) as *mut u64 }
    }

    /// Word `i` of `rank`'s message of `parity` as this rank reads it: in `rank`'s outbox for a
    /// peer of this node, in this rank's inbox for `rank` for one on another node.
    fn message(&self, rank: usize, parity: usize, i: usize) -> *mut u64 {
        if self.world.heap.mapped(rank) {
            return self.outbox(rank, parity, i);
        }
        let offset = inbox_offset(self.num_ranks(), rank, parity) + i * 8;
        // SAFETY: inside this rank's reserved part, which has inboxes in a world of several
        // nodes (see `reserved_bytes`).
        unsafe { self.world.heap.base(self.rank).add(offset) as *mut u64 }
    }

    fn outbox_seq(&self, rank: usize, parity: usize) -> &AtomicU64 {
        // SAFETY: word 0 of a message is its call number, read only atomically. (In an inbox the
        // proxy's MPI receive writes it before the arrival signal; it is read earlier only to
        // name the ranks missing from a call that failed.)
        unsafe { &*(self.message(rank, parity, 0) as *const AtomicU64) }
    }

    fn read_words(&self, rank: usize, parity: usize, at: usize, out: &mut [u64]) {
        let from = self.message(rank, parity, at);
        // SAFETY: `rank` wrote these words before its release increment of this rank's arrival
        // counter, which this rank acquired; nobody writes them again before this rank's next
        // call (see the module docs).
        unsafe { std::ptr::copy_nonoverlapping(from as *const u64, out.as_mut_ptr(), out.len()) };
    }

    fn header(&self, rank: usize, parity: usize) -> Header {
        let mut w = [0u64; HEADER_WORDS];
        self.read_words(rank, parity, 1, &mut w[1..]);
        Header {
            seq: self.outbox_seq(rank, parity).load(Ordering::Acquire),
            meta: w[1],
            name: [w[2], w[3], w[4], w[5], w[6]],
            dtype: w[7],
        }
    }

    /// Tells every rank what this call is and `words` (at most [`MAX_WORDS`]), plus `personal`
    /// (empty, or [`MAX_PERSONAL`] or fewer words per rank, `k * n` in rank order: rank `r`
    /// receives `personal[k * r..k * (r + 1)]`); returns what every rank sent.
    ///
    /// A `problem` is this rank's own input being invalid: every rank then returns
    /// [`Error::InvalidArgument`] naming this rank, with `problem` as its reason.
    pub(crate) fn exchange(
        &self,
        call: Call,
        words: &[u64],
        problem: Option<String>,
        personal: &[u64],
    ) -> Result<Exchanged> {
        let (me, n) = (self.rank, self.num_ranks());
        let per_rank = personal.len() / n;
        let mut problem = problem;
        if words.len() > MAX_WORDS {
            problem.get_or_insert(format!(
                "{} argument words; an exchange carries at most {MAX_WORDS}",
                words.len()
            ));
        }
        if per_rank * n != personal.len() || per_rank > MAX_PERSONAL {
            problem.get_or_insert(format!(
                "{} personal words for {n} ranks; at most {MAX_PERSONAL} per rank",
                personal.len()
            ));
        }
        let words = &words[..words.len().min(MAX_WORDS)];
        let per_rank = if per_rank * n == personal.len() { per_rank.min(MAX_PERSONAL) } else { 0 };

        // One call of a rank at a time: two threads of one rank in collective calls at once
        // would share the rank's call number and outbox.
        let local = &self.world.local[me];
        let mut counter = local.calls.try_lock().map_err(|_| Error::InvalidArgument {
            op: call.op,
            rank: me,
            reason: "another collective call of this rank is in progress: collective calls of \
                     one rank must be made one at a time, from the rank's own thread"
                .into(),
        })?;
        counter.seq += 1;
        let seq = counter.seq;
        let parity = (seq % 2) as usize;
        // The call, posted to the world for as long as it lasts: what a rank blocked in a call on
        // another group looks at (see `crossed`).
        let (root, root_rank) = root_of(self.world, me);
        let group = self.world.group_id;
        let _posted = Posted::new(root, root_rank, group, seq, call.op, call.dtype);

        // The message, into this rank's own outbox.
        let text = problem.as_deref().map(|t| {
            let mut end = t.len().min(TEXT_BYTES);
            while !t.is_char_boundary(end) {
                end -= 1;
            }
            &t[..end]
        });
        let mut message = Vec::with_capacity(PERSONAL_AT + personal.len());
        message.push(0); // the call number, stored last (below)
        let mut meta = words.len() as u64 | (per_rank as u64) << 32;
        if let Some(text) = text {
            meta |= PROBLEM | (text.len() as u64) << 16;
        }
        message.push(meta);
        message.extend(pack_name(call.op, NAME_BYTES));
        message.extend(pack_name(call.dtype, 8));
        message.extend_from_slice(words);
        let mut at = vec![(WORDS_AT, message.len() - WORDS_AT)];
        if let Some(text) = text {
            let packed = pack_name(text, TEXT_BYTES);
            at.push((TEXT_AT, packed.len()));
            message.extend(packed);
        }
        at.push((PERSONAL_AT, per_rank * n));
        message.extend_from_slice(&personal[..per_rank * n]);
        // SAFETY: only this rank writes its outbox, and no peer reads this half now (see the
        // module docs); the words stay inside the reserved part.
        unsafe {
            let base = self.outbox(me, parity, 0);
            std::ptr::copy_nonoverlapping(message[1..HEADER_WORDS].as_ptr(), base.add(1), 7);
            let mut from = HEADER_WORDS;
            for (to, len) in at {
                std::ptr::copy_nonoverlapping(message[from..].as_ptr(), base.add(to), len);
                from += len;
            }
        }
        self.outbox_seq(me, parity).store(seq, Ordering::Release);

        // Arrive at every rank (rotated, so that they are not all hit at once); the arrival
        // that completes a rank's count wakes it.
        let target = seq.div_ceil(2) * n as u64;
        let control = &self.world.control;
        let message_bytes = (PERSONAL_AT + per_rank * n) * 8;
        for i in 0..n {
            let peer = (me + i) % n;
            if !self.world.heap.mapped(peer) {
                // On another node: the message into the peer's inbox for this rank, then its
                // arrival counter, through the proxy.
                let put = Put {
                    peer,
                    dst_offset: inbox_offset(n, me, parity),
                    dst_stride: message_bytes,
                    src: self.outbox(me, parity, 0) as *const u8,
                    src_stride: message_bytes,
                    rows: 1,
                    row_bytes: message_bytes,
                    signal: Some((parity * CELL_BYTES, SignalOp::Add(1))),
                };
                self.world.transport.put(self.world, &put)?;
                continue;
            }
            let cell = self.arrivals(peer, parity);
            if cell.value.fetch_add(1, Ordering::AcqRel) + 1 == target {
                cell.ring();
            }
        }

        // Wait for every rank's arrival.
        let mine = self.arrivals(me, parity);
        let here = || describe(call.op, call.dtype, seq);
        let missing = || -> Vec<usize> {
            (0..n).filter(|&p| self.outbox_seq(p, parity).load(Ordering::Acquire) != seq).collect()
        };
        let mut crossing = Crossing::new(root, root_rank);
        let outcome = wait_until_checked(
            &self.world.watch(),
            mine,
            || mine.value.load(Ordering::Acquire) >= target,
            || {
                let gone = missing().into_iter().find(|&p| control.has_left(p, me))?;
                let peer = root_of(self.world, gone).1;
                left_elsewhere(root, root_rank, peer, group, here()).or(Some(Error::PeerGone {
                    rank: me,
                    peer: gone,
                    how: control.how_left(gone),
                    waiting: format!("in {}", here()),
                }))
            },
            || {
                let waits_for = missing().first().map(|&p| root_of(self.world, p).1);
                crossing.stuck(waits_for)
            },
        );
        match outcome {
            WaitOutcome::Ready => {}
            WaitOutcome::Failed => return Err(self.world.peer_failed(me)),
            WaitOutcome::Gone(err) => return Err(err),
            WaitOutcome::TimedOut => {
                // A stopped process among the missing ranks (or among all, when every rank
                // posted the call) is the cause to name.
                let heap = &self.world.heap;
                let absent = missing();
                let suspect =
                    |p: usize| heap.mapped(p) && (absent.is_empty() || absent.contains(&p));
                if let Some((peer, pid)) = super::process::stopped_peer(control, me, n, suspect) {
                    return Err(Error::PeerGone {
                        rank: me,
                        peer,
                        how: format!(
                            "is stopped (pid {pid}: SIGSTOP or a debugger) and sent nothing for \
                             {:?}",
                            self.world.wait_timeout
                        ),
                        waiting: format!("in {}", here()),
                    });
                }
                return Err(Error::CallTimeout {
                    rank: me,
                    call: here(),
                    missing: absent,
                    timeout: self.world.wait_timeout,
                });
            }
        }

        // Every rank's message: the same call everywhere, then any rank's problem, then words.
        let headers: Vec<Header> = (0..n).map(|p| self.header(p, parity)).collect();
        if let Some(bad) = (1..n).find(|&p| !headers[p].same_call(&headers[0])) {
            return Err(Error::OpMismatch {
                rank_a: 0,
                call_a: headers[0].describe(),
                rank_b: bad,
                call_b: headers[bad].describe(),
            });
        }
        if let Some(bad) = (0..n).find(|&p| headers[p].problem()) {
            let reason = match (&problem, bad == me) {
                (Some(own), true) => own.clone(),
                _ => {
                    let mut packed = vec![0u64; headers[bad].text_len().div_ceil(8)];
                    self.read_words(bad, parity, TEXT_AT, &mut packed);
                    let mut text = unpack_name(&packed);
                    text.truncate(headers[bad].text_len());
                    text
                }
            };
            return Err(Error::InvalidArgument { op: call.op, rank: bad, reason });
        }
        let mut starts = Vec::with_capacity(n + 1);
        starts.push(0);
        for h in &headers {
            starts.push(starts.last().copied().unwrap_or(0) + h.words().min(MAX_WORDS));
        }
        let mut all = vec![0u64; starts[n]];
        let mut received = vec![0u64; n * per_rank];
        for p in 0..n {
            self.read_words(p, parity, WORDS_AT, &mut all[starts[p]..starts[p + 1]]);
            let theirs = headers[p].per_rank().min(per_rank);
            let to = &mut received[p * per_rank..p * per_rank + theirs];
            self.read_words(p, parity, PERSONAL_AT + me * headers[p].per_rank(), to);
        }
        Ok(Exchanged { words: all, starts, personal: received, per_rank })
    }
}

/// A metadata exchange between all ranks of a world, for kernels written outside the crate:
/// every rank tells every rank a few words. It goes through the rank's one exchange (see the
/// module docs), so it needs no symmetric memory of its own and meets every other collective
/// call: ranks in different calls get [`Error::OpMismatch`].
///
/// # Examples
/// ```
/// use dist_tensor::shmem::WordExchange;
/// use dist_tensor::World;
/// let seen = World::threads(3)?.run(|rank| {
///     let mut ex = WordExchange::new(rank, 2)?;
///     let all = ex.exchange(rank, &[rank.rank() as u64, 7])?;
///     Ok(all.iter().map(|w| w[0]).sum::<u64>())
/// })?;
/// assert_eq!(seen, vec![3, 3, 3]);
/// # Ok::<(), dist_tensor::Error>(())
/// ```
#[derive(Debug)]
pub struct WordExchange {
    words: usize,
}

impl WordExchange {
    /// An exchange of up to `words` words per rank (at most [`MAX_WORDS`], less the flag of
    /// [`WordExchange::exchange_checked`]).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for more words than an exchange carries.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::shmem::WordExchange;
    /// use dist_tensor::World;
    /// World::threads(2)?.run(|rank| {
    ///     assert!(WordExchange::new(rank, 1000).is_err());
    ///     let mut ex = WordExchange::new(rank, 2)?;
    ///     assert!(ex.exchange(rank, &[1, 2, 3]).is_err()); // more than 2 words: every rank fails
    ///     assert_eq!(ex.exchange(rank, &[1, 2])?.len(), 2);
    ///     Ok(())
    /// })?;
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn new(rank: &Rank<'_>, words: usize) -> Result<Self> {
        if words >= MAX_WORDS {
            return Err(Error::InvalidArgument {
                op: "WordExchange::new",
                rank: rank.rank(),
                reason: format!("{words} words; an exchange carries at most {}", MAX_WORDS - 1),
            });
        }
        Ok(WordExchange { words })
    }

    /// Bytes of symmetric memory it holds of its own: none, as every exchange goes through the
    /// part of the heap the runtime reserves.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::shmem::WordExchange;
    /// use dist_tensor::World;
    /// World::threads(2)?.run(|rank| {
    ///     let free = rank.heap_free_bytes();
    ///     let ex = WordExchange::new(rank, 4)?;
    ///     assert_eq!(ex.symmetric_bytes(), 0);
    ///     assert_eq!(rank.heap_free_bytes(), free);
    ///     Ok(())
    /// })?;
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn symmetric_bytes(&self) -> usize {
        0
    }

    /// Sends `mine` to every rank; returns every rank's words in rank order (each as long as
    /// that rank sent).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] on every rank when a rank's `mine` is longer than the exchange
    /// holds; otherwise as [`Rank::barrier_all`].
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::shmem::WordExchange;
    /// use dist_tensor::World;
    /// let seen = World::threads(2)?.run(|rank| {
    ///     let mut ex = WordExchange::new(rank, 2)?;
    ///     ex.exchange(rank, &[7, 7][..rank.rank()]) // rank 0 sends no words, rank 1 one
    /// })?;
    /// assert_eq!(seen[0], vec![vec![], vec![7]]);
    /// assert_eq!(seen[1], seen[0]);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn exchange(&mut self, rank: &Rank<'_>, mine: &[u64]) -> Result<Vec<Vec<u64>>> {
        let problem = (mine.len() > self.words)
            .then(|| format!("{} words do not fit an exchange of {}", mine.len(), self.words));
        let mine = &mine[..mine.len().min(self.words)];
        let all = rank.exchange(Call::untyped("WordExchange::exchange"), mine, problem, &[])?;
        Ok(all.to_vecs())
    }

    /// [`WordExchange::exchange`] for the collective call `op`, carrying a flag for "this rank's
    /// input is invalid": if any rank passes a `problem`, every rank returns
    /// [`Error::InvalidArgument`] naming that rank, with what it said.
    ///
    /// # Errors
    /// As described; [`Error::OpMismatch`] when ranks are in different calls; otherwise as
    /// [`WordExchange::exchange`].
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::shmem::WordExchange;
    /// use dist_tensor::World;
    /// let errs = World::threads(2)?.run(|rank| {
    ///     let mut ex = WordExchange::new(rank, 1)?;
    ///     let problem = (rank.rank() == 1).then(|| "bad input".to_string());
    ///     Ok(ex.exchange_checked(rank, "demo", &[1], problem).unwrap_err().to_string())
    /// })?;
    /// assert_eq!(errs[1], "demo: invalid argument on rank 1: bad input");
    /// assert_eq!(errs[0], errs[1]); // every rank says what rank 1 said
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn exchange_checked(
        &mut self,
        rank: &Rank<'_>,
        op: &'static str,
        words: &[u64],
        problem: Option<String>,
    ) -> Result<Vec<Vec<u64>>> {
        self.checked(rank, Call::untyped(op), words, problem)
    }

    /// [`WordExchange::exchange_checked`] for a call on elements of type `T`: ranks that call
    /// `op` with different element types get [`Error::OpMismatch`].
    ///
    /// # Errors
    /// As [`WordExchange::exchange_checked`].
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::shmem::WordExchange;
    /// use dist_tensor::{Error, World};
    /// let errs = World::threads(2)?.run(|rank| {
    ///     let mut ex = WordExchange::new(rank, 1)?;
    ///     let err = if rank.rank() == 0 {
    ///         ex.exchange_typed::<f32>(rank, "demo", &[1], None)
    ///     } else {
    ///         ex.exchange_typed::<f64>(rank, "demo", &[1], None)
    ///     };
    ///     Ok(err.unwrap_err())
    /// })?;
    /// assert!(matches!(errs[0], Error::OpMismatch { .. }));
    /// assert!(errs[1].to_string().contains("rank 0 is in demo<f32>"), "{}", errs[1]);
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn exchange_typed<T: Element>(
        &mut self,
        rank: &Rank<'_>,
        op: &'static str,
        words: &[u64],
        problem: Option<String>,
    ) -> Result<Vec<Vec<u64>>> {
        self.checked(rank, Call::of::<T>(op), words, problem)
    }

    fn checked(
        &mut self,
        rank: &Rank<'_>,
        call: Call,
        words: &[u64],
        problem: Option<String>,
    ) -> Result<Vec<Vec<u64>>> {
        let problem = problem.or_else(|| {
            (words.len() > self.words)
                .then(|| format!("{} words do not fit an exchange of {}", words.len(), self.words))
        });
        let words = &words[..words.len().min(self.words)];
        Ok(rank.exchange(call, words, problem, &[])?.to_vecs())
    }
}

/// Checks that word `index` is the same on every rank; returns it.
///
/// # Errors
/// [`Error::RanksDisagree`] naming rank 0 and the first rank that differs.
///
/// # Examples
/// ```
/// use dist_tensor::shmem::check_agree;
/// assert_eq!(check_agree("demo", &[vec![4], vec![4]], 0, "rows")?, 4);
/// assert!(check_agree("demo", &[vec![4], vec![5]], 0, "rows").is_err());
/// assert!(check_agree("demo", &[vec![4], vec![]], 0, "rows").is_err()); // a short rank
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn check_agree(op: &'static str, all: &[Vec<u64>], index: usize, what: &str) -> Result<u64> {
    let word = |r: usize| all[r].get(index).copied();
    let first = word(0);
    if let Some(bad) = (0..all.len()).find(|&r| word(r) != first) {
        let show = |w: Option<u64>| w.map_or("nothing".to_string(), |v| v.to_string());
        return Err(Error::RanksDisagree {
            op,
            rank_a: 0,
            value_a: format!("{what} = {}", show(first)),
            rank_b: bad,
            value_b: format!("{what} = {}", show(word(bad))),
        });
    }
    Ok(first.unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        #[test]
        fn any_header_reads_within_an_outbox(
            seq in proptest::prelude::any::<u64>(),
            meta in proptest::prelude::any::<u64>(),
            name in proptest::prelude::any::<[u64; 5]>(),
            dtype in proptest::prelude::any::<u64>(),
        ) {
            let h = Header { seq, meta, name, dtype };
            proptest::prop_assert!(h.words() <= MAX_WORDS);
            proptest::prop_assert!(h.text_len() <= TEXT_BYTES);
            proptest::prop_assert!(h.per_rank() <= MAX_PERSONAL);
            // The furthest word any reader takes for a peer's message, in the largest world.
            let n = 4096;
            proptest::prop_assert!(
                TEXT_AT + h.text_len().div_ceil(8) <= PERSONAL_AT
                    && PERSONAL_AT + (n - 1) * h.per_rank() + h.per_rank() <= outbox_bytes(n) / 8
            );
            let text = h.describe(); // names of any bytes, never a panic
            proptest::prop_assert!(text.len() < 200);
        }
    }

    #[test]
    fn names_pack_and_unpack() {
        assert_eq!(unpack_name(&pack_name("all_gather", NAME_BYTES)), "all_gather");
        assert_eq!(unpack_name(&pack_name("", 8)), "");
        assert_eq!(unpack_name(&pack_name("bf16", 8)), "bf16");
        assert_eq!(short_type_name::<half::f16>(), "f16");
        assert_eq!(describe("all_gather", "f32", 12), "all_gather<f32> #12");
        assert_eq!(describe("barrier_all", "", 3), "barrier_all #3");
    }
}
