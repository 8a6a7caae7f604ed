//! [`WordExchange`]: every rank tells every rank a few words, without a barrier.
//!
//! What a collective or fused op does first: each rank pushes its arguments (lengths, shapes, a
//! flag for "my input is invalid") into every peer's slot and sets the peer's signal to the call
//! number. Every rank then knows every rank's arguments, validates them the same way and, if
//! something is wrong, fails together with the others, never leaving a peer waiting. Slots
//! alternate between calls; a rank cannot get two calls ahead of a peer (each exchange waits for
//! every peer), so a slot is never overwritten while a peer reads it. The same fact makes an
//! exchange a safe point to reuse the op's other buffers: when it returns, every peer has left the
//! previous call.

use super::{
    NotifySem, Rank, Scope, SignalBuf, SignalOp, SymmBuf, WaitCmp, WaitSem, consume_token, symm_at,
};
use crate::device::tile;
use crate::{Error, Result};

/// A metadata exchange between all ranks of a world. Keep one per op in the op's workspace.
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
pub struct WordExchange {
    slots: SymmBuf<u64>,
    ready: SignalBuf,
    words: usize,
    calls: u64,
}

impl WordExchange {
    /// An exchange of up to `words` words per rank (plus the flag of
    /// [`WordExchange::exchange_checked`]). Collective (it allocates).
    ///
    /// # Errors
    /// As [`Rank::alloc`].
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::shmem::WordExchange;
    /// use dist_tensor::World;
    /// World::threads(2)?.run(|rank| {
    ///     let mut ex = WordExchange::new(rank, 2)?;
    ///     assert!(ex.exchange(rank, &[1, 2, 3]).is_err()); // more than 2 words
    ///     assert_eq!(ex.exchange(rank, &[1, 2])?.len(), 2);
    ///     Ok(())
    /// })?;
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn new(rank: &Rank<'_>, words: usize) -> Result<Self> {
        let n = rank.num_ranks();
        Ok(WordExchange {
            // Each slot: its length, exchange_checked's flag, then the words.
            slots: rank.alloc(2 * n * (words + 2))?,
            ready: rank.alloc_signals(n)?,
            words,
            calls: 0,
        })
    }

    /// Bytes of symmetric memory it holds.
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::shmem::WordExchange;
    /// use dist_tensor::World;
    /// World::threads(2)?.run(|rank| {
    ///     let free = rank.heap_free_bytes();
    ///     let ex = WordExchange::new(rank, 4)?;
    ///     assert!(ex.symmetric_bytes() > 0);
    ///     assert!(ex.symmetric_bytes() <= free - rank.heap_free_bytes());
    ///     Ok(())
    /// })?;
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn symmetric_bytes(&self) -> usize {
        self.slots.len() * 8 + self.ready.len() * 64
    }

    /// Sends `mine` to every rank; returns every rank's words in rank order (each as long as
    /// that rank sent).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `mine` is longer than the exchange holds (on this rank
    /// only: a programmer mistake); otherwise as [`Rank::wait`].
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
        self.send(rank, mine, self.words)
    }

    /// Sends up to `limit` words (the flag of `exchange_checked` comes on top of `words`).
    fn send(&mut self, rank: &Rank<'_>, mine: &[u64], limit: usize) -> Result<Vec<Vec<u64>>> {
        let (me, n) = (rank.rank(), rank.num_ranks());
        if mine.len() > limit {
            return Err(Error::InvalidArgument {
                op: "WordExchange::exchange",
                rank: me,
                reason: format!("{} words do not fit an exchange of {limit}", mine.len()),
            });
        }
        let stride = self.words + 2;
        self.calls += 1;
        let slot = (self.calls % 2) as usize * n;
        let mut message = vec![mine.len() as u64];
        message.extend_from_slice(mine);
        for i in 0..n {
            let peer = (me + i) % n;
            let at = symm_at(&self.slots, peer) + (slot + me) * stride;
            // SAFETY: this rank's slot in the peer's current half is written only by this rank,
            // and the peer read it two calls ago at the latest (see the module docs).
            unsafe { tile::store_1d(at, &message, message.len()) };
            let set = SignalOp::Set(self.calls);
            rank.notify(&self.ready, me, peer, set, Scope::Peer, NotifySem::Release)?;
        }
        let mut all = Vec::with_capacity(n);
        for p in 0..n {
            let token = rank.wait(&self.ready, p, WaitCmp::Ge(self.calls), WaitSem::Acquire)?;
            let mut words = vec![0u64; stride];
            let at = consume_token(self.slots.ptr(), token) + (slot + p) * stride;
            // SAFETY: rank p wrote this slot before its release notify, which was acquired.
            unsafe { tile::load_1d(at, &mut words, stride, 0) };
            let len = words[0] as usize;
            words.truncate(len + 1);
            words.remove(0);
            all.push(words);
        }
        Ok(all)
    }

    /// [`WordExchange::exchange`], carrying a flag for "this rank's input is invalid": if any
    /// rank passes a `problem`, every rank returns [`Error::InvalidArgument`] naming that rank
    /// (with the reason on the rank itself).
    ///
    /// # Errors
    /// As described, and as [`WordExchange::exchange`].
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
    /// assert!(errs[0].starts_with("demo: invalid argument on rank 1"));
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn exchange_checked(
        &mut self,
        rank: &Rank<'_>,
        op: &'static str,
        words: &[u64],
        problem: Option<String>,
    ) -> Result<Vec<Vec<u64>>> {
        let mut mine = Vec::with_capacity(words.len() + 1);
        mine.push(u64::from(problem.is_some()));
        mine.extend_from_slice(words);
        let all = self.send(rank, &mine, self.words + 1)?;
        if let Some(bad) = all.iter().position(|w| w[0] != 0) {
            let reason = match problem {
                Some(p) if bad == rank.rank() => p,
                _ => format!("rank {bad} passed invalid arguments (its error says which)"),
            };
            return Err(Error::InvalidArgument { op, rank: bad, reason });
        }
        Ok(all.into_iter().map(|mut w| w.split_off(1)).collect())
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
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn check_agree(op: &'static str, all: &[Vec<u64>], index: usize, what: &str) -> Result<u64> {
    let first = all[0][index];
    if let Some(bad) = all.iter().position(|w| w[index] != first) {
        return Err(Error::RanksDisagree {
            op,
            rank_a: 0,
            value_a: format!("{what} = {first}"),
            rank_b: bad,
            value_b: format!("{what} = {}", all[bad][index]),
        });
    }
    Ok(first)
}
