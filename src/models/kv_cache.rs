//! [`KvCache`]: the keys and values a model's attention has computed, kept so that a decoded
//! token attends to them instead of recomputing the window. Paged, as vLLM's: a pool of
//! fixed-size blocks, each holding `block_size` positions of every layer's keys and values for
//! this rank's KV heads, and a block table per sequence, so a sequence grows without copying
//! and sequences of any lengths share one pool. A sequence that needs a block the pool does not
//! have is refused before anything is written: nothing of it, or of another sequence, is lost.

use crate::{Error, Result};

/// A sequence in a [`KvCache`] (from [`KvCache::add_sequence`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SeqId(usize);

/// One sequence's block table and the positions it holds.
#[derive(Debug, Clone, Default)]
struct Sequence {
    blocks: Vec<usize>,
    len: usize,
}

/// A paged cache of keys and values for one model on one rank (see the module docs). Every
/// rank of a model makes the same cache (the same blocks, each of its own heads), so a refusal
/// is the same on every rank.
///
/// # Examples
/// ```
/// use dist_tensor::models::KvCache;
/// let mut cache = KvCache::new(2, 8, 4, 3)?; // 2 layers, 8 values per position, blocks of 4, 3 blocks
/// let a = cache.add_sequence();
/// cache.reserve(a, 9)?; // 3 blocks
/// let b = cache.add_sequence();
/// assert!(cache.reserve(b, 1).is_err()); // none left: refused, nothing changed
/// cache.remove_sequence(a);
/// cache.reserve(b, 12)?;
/// assert_eq!(cache.free_blocks(), 0);
/// # Ok::<(), dist_tensor::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct KvCache {
    layers: usize,
    width: usize,
    block_size: usize,
    /// `blocks x layers x [K, V] x block_size x width`.
    pool: Vec<f32>,
    free: Vec<usize>,
    capacity: usize,
    sequences: Vec<Option<Sequence>>,
}

impl KvCache {
    /// A pool of `blocks` blocks of `block_size` positions, each position `width` values (this
    /// rank's KV heads times the head size) of keys and as many of values, for `layers` layers.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a zero block size; [`Error::OutOfMemory`] when the pool's
    /// size overflows or cannot be allocated.
    pub fn new(layers: usize, width: usize, block_size: usize, blocks: usize) -> Result<Self> {
        const OP: &str = "KvCache::new";
        if block_size == 0 {
            return Err(Error::InvalidArgument {
                op: OP,
                rank: 0,
                reason: "a block of 0 positions".into(),
            });
        }
        let elems = [layers, 2, block_size, width, blocks]
            .iter()
            .try_fold(1usize, |a, &b| a.checked_mul(b));
        let what =
            || format!("{blocks} blocks of {block_size} positions, {layers} layers x {width}");
        let Some(elems) = elems else {
            return Err(Error::OutOfMemory { op: OP, bytes: usize::MAX, what: what() });
        };
        let mut pool = Vec::new();
        pool.try_reserve_exact(elems).map_err(|_| Error::OutOfMemory {
            op: OP,
            bytes: elems.saturating_mul(4),
            what: what(),
        })?;
        pool.resize(elems, 0.0);
        Ok(KvCache {
            layers,
            width,
            block_size,
            pool,
            free: (0..blocks).rev().collect(),
            capacity: blocks,
            sequences: Vec::new(),
        })
    }

    /// A new, empty sequence.
    pub fn add_sequence(&mut self) -> SeqId {
        let slot = self.sequences.iter().position(Option::is_none);
        match slot {
            Some(i) => {
                self.sequences[i] = Some(Sequence::default());
                SeqId(i)
            }
            None => {
                self.sequences.push(Some(Sequence::default()));
                SeqId(self.sequences.len() - 1)
            }
        }
    }

    /// Forgets `seq`, its blocks back in the pool (a finished or preempted request).
    pub fn remove_sequence(&mut self, seq: SeqId) {
        if let Some(s) = self.sequences.get_mut(seq.0).and_then(Option::take) {
            self.free.extend(s.blocks.into_iter().rev());
        }
    }

    /// Positions `seq` holds (0 for an unknown one).
    pub fn len(&self, seq: SeqId) -> usize {
        self.sequence(seq).map_or(0, |s| s.len)
    }

    /// Whether `seq` holds no position.
    pub fn is_empty(&self, seq: SeqId) -> bool {
        self.len(seq) == 0
    }

    /// Blocks in the pool not held by a sequence.
    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }

    /// Positions per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks in the pool.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    fn sequence(&self, seq: SeqId) -> Option<&Sequence> {
        self.sequences.get(seq.0).and_then(Option::as_ref)
    }

    fn unknown(seq: SeqId, op: &'static str) -> Error {
        Error::InvalidArgument {
            op,
            rank: 0,
            reason: format!("sequence {} is not in the cache", seq.0),
        }
    }

    /// Makes room for `more` positions after `seq`'s: blocks from the pool as needed. On a
    /// refusal nothing changes.
    ///
    /// # Errors
    /// [`Error::OutOfMemory`] naming the blocks needed and free; [`Error::InvalidArgument`] for
    /// an unknown sequence.
    pub fn reserve(&mut self, seq: SeqId, more: usize) -> Result<()> {
        const OP: &str = "KvCache::reserve";
        let bs = self.block_size;
        let free = self.free.len();
        let s = self.sequence(seq).ok_or_else(|| Self::unknown(seq, OP))?;
        let need = (s.len + more).div_ceil(bs).saturating_sub(s.blocks.len());
        if need > free {
            return Err(Error::OutOfMemory {
                op: OP,
                bytes: need * self.block_bytes(),
                what: format!(
                    "{more} more positions for sequence {} (holding {}): {need} blocks of {bs} \
                     positions, {free} free of {}; nothing was written (free a sequence, or make \
                     a larger cache)",
                    seq.0, s.len, self.capacity
                ),
            });
        }
        let taken: Vec<usize> = (0..need).filter_map(|_| self.free.pop()).collect();
        if let Some(Some(s)) = self.sequences.get_mut(seq.0) {
            s.blocks.extend(taken);
        }
        Ok(())
    }

    /// [`KvCache::reserve`] for several sequences at once (a batch): all of them, or, when
    /// the pool has too few blocks for their sum, none.
    ///
    /// # Errors
    /// As [`KvCache::reserve`]; [`Error::InvalidArgument`] for a sequence named twice.
    pub fn reserve_all(&mut self, batch: &[(SeqId, usize)]) -> Result<()> {
        const OP: &str = "KvCache::reserve";
        let bs = self.block_size;
        let mut need = 0;
        for (i, &(seq, more)) in batch.iter().enumerate() {
            if batch[..i].iter().any(|&(s, _)| s == seq) {
                return Err(Error::InvalidArgument {
                    op: OP,
                    rank: 0,
                    reason: format!("sequence {} is twice in one batch", seq.0),
                });
            }
            let s = self.sequence(seq).ok_or_else(|| Self::unknown(seq, OP))?;
            need += (s.len + more).div_ceil(bs).saturating_sub(s.blocks.len());
        }
        if need > self.free.len() {
            return Err(Error::OutOfMemory {
                op: OP,
                bytes: need * self.block_bytes(),
                what: format!(
                    "a batch of {} sequences: {need} blocks of {bs} positions, {} free of {}; \
                     nothing was written (free a sequence, or make a larger cache)",
                    batch.len(),
                    self.free.len(),
                    self.capacity
                ),
            });
        }
        for &(seq, more) in batch {
            self.reserve(seq, more)?;
        }
        Ok(())
    }

    fn block_bytes(&self) -> usize {
        self.layers * 2 * self.block_size * self.width * 4
    }

    /// Where position `pos` of `seq`'s keys (`which` 0) or values (1) of `layer` start in the
    /// pool. The position's block must be reserved.
    fn at(&self, seq: SeqId, layer: usize, which: usize, pos: usize) -> usize {
        let s = self.sequence(seq).expect("a sequence of this cache");
        let (block, row) = (s.blocks[pos / self.block_size], pos % self.block_size);
        (((block * self.layers + layer) * 2 + which) * self.block_size + row) * self.width
    }

    /// Stores position `pos`'s keys and values of `layer` (`width` each).
    pub(crate) fn write(&mut self, seq: SeqId, layer: usize, pos: usize, k: &[f32], v: &[f32]) {
        let w = self.width;
        let (ka, va) = (self.at(seq, layer, 0, pos), self.at(seq, layer, 1, pos));
        self.pool[ka..ka + w].copy_from_slice(&k[..w]);
        self.pool[va..va + w].copy_from_slice(&v[..w]);
    }

    /// Position `pos`'s keys of `layer`.
    pub(crate) fn keys(&self, seq: SeqId, layer: usize, pos: usize) -> &[f32] {
        let a = self.at(seq, layer, 0, pos);
        &self.pool[a..a + self.width]
    }

    /// Position `pos`'s values of `layer`.
    pub(crate) fn values(&self, seq: SeqId, layer: usize, pos: usize) -> &[f32] {
        let a = self.at(seq, layer, 1, pos);
        &self.pool[a..a + self.width]
    }

    /// `seq` holds `more` more positions (their keys and values written).
    pub(crate) fn advance(&mut self, seq: SeqId, more: usize) {
        if let Some(Some(s)) = self.sequences.get_mut(seq.0) {
            s.len += more;
        }
    }

    /// The values per position this cache was made for.
    pub(crate) fn width(&self) -> usize {
        self.width
    }

    /// The layers this cache was made for.
    pub(crate) fn layers(&self) -> usize {
        self.layers
    }
}
