//! How one rank's checkpoint error reaches every rank: [`agree`].

use crate::error::CheckpointError;
use crate::shmem::{Rank, WordExchange};
use crate::{Error, Result};

/// Words of one round of [`agree`]: an exchange carries fewer than 64.
const ROUND_WORDS: usize = 48;

/// Makes `local` (this rank's outcome of a collective checkpoint call) every rank's: `Ok` on every
/// rank when no rank failed, otherwise the error of the lowest rank with one, on every rank.
/// Errors other than checkpoint errors are forwarded as the rank's [`Error::InvalidArgument`]
/// text. Collective: one exchange when every rank succeeded, a few more to carry an error.
pub(crate) fn agree<T>(rank: &Rank<'_>, op: &'static str, local: Result<T>) -> Result<T> {
    let text = match &local {
        Ok(_) => String::new(),
        Err(Error::Checkpoint(e)) => {
            format!("C{}", serde_json::to_string(e).expect("an error serialises"))
        }
        Err(e) => format!("E{e}"),
    };
    let mut ex = WordExchange::new(rank, ROUND_WORDS)?;
    // Named by `op`, so ranks in different checkpoint calls fail with `OpMismatch`.
    let lens = ex.exchange_checked(rank, op, &[text.len() as u64], None)?;
    let lens: Vec<usize> = lens.iter().map(|w| w.first().copied().unwrap_or(0) as usize).collect();
    let Some(first) = lens.iter().position(|&l| l > 0) else { return local };
    // Only the first failing rank's text travels; every rank takes part in every round.
    let mut bytes = Vec::with_capacity(lens[first]);
    let mut sent = 0;
    while sent < lens[first] {
        let mine: Vec<u64> = if rank.rank() == first {
            text.as_bytes()[sent..(sent + ROUND_WORDS * 8).min(text.len())]
                .chunks(8)
                .map(|c| {
                    let mut w = [0u8; 8];
                    w[..c.len()].copy_from_slice(c);
                    u64::from_le_bytes(w)
                })
                .collect()
        } else {
            Vec::new()
        };
        let all = ex.exchange_checked(rank, op, &mine, None)?;
        for w in &all[first] {
            bytes.extend_from_slice(&w.to_le_bytes());
        }
        sent += ROUND_WORDS * 8;
    }
    bytes.truncate(lens[first]);
    if rank.rank() == first {
        return local;
    }
    let text = String::from_utf8_lossy(&bytes);
    if let Some(json) = text.strip_prefix('C')
        && let Ok(mut e) = serde_json::from_str::<CheckpointError>(json)
    {
        e.op = op;
        return Err(Error::Checkpoint(Box::new(e)));
    }
    Err(Error::InvalidArgument {
        op,
        rank: first,
        reason: text.strip_prefix('E').unwrap_or(&text).to_string(),
    })
}
