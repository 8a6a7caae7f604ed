//! [`World::run`]: the closure once per rank, and how a rank's failure ends the others' waits.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;

use super::{World, WorldShared};
use crate::shmem::control::RankState;
use crate::shmem::rank::Rank;
use crate::{Error, Result};

impl World {
    /// Runs `f` once per rank, each on its own thread, and returns the results in rank order.
    /// For a world of processes ([`World::from_env`]) it runs `f` once, for this process's rank,
    /// and returns that one result (see [`World::ranks_here`]).
    ///
    /// `f` may borrow from the caller. Runs of one world cannot overlap (a second `run` while one
    /// is going, or from inside `f`, is an error); buffers a rank keeps
    /// (such as workspaces cached by the collectives) stay valid from one run to the next.
    ///
    /// # Errors
    /// If any rank returns an error or panics, the world fails: every rank's waits return
    /// [`Error::PeerFailed`] at once (saying what the failed rank said), and `run` returns
    /// [`Error::RankFailed`] naming the rank that failed first, with its error typed as `source`
    /// (see [`Error::rank_error`], [`Error::downcast_ref`]) and every rank that failed of its own.
    /// A rank that returns from `f` while a peer still waits for it (in a collective, a barrier,
    /// or a wait only it could satisfy) ends that wait at once with [`Error::PeerGone`]. A
    /// failed world stays failed: later runs return the same error.
    ///
    /// `?` works on the user's own errors inside `f`: the standard ones convert through `From`
    /// into [`Error::User`], any other through [`Error::user`]:
    /// ```
    /// use dist_tensor::{Error, World};
    ///
    /// let err = World::threads(2)?
    ///     .run(|rank| {
    ///         let config = std::fs::read_to_string(format!("/no/config-{}.toml", rank.rank()))?;
    ///         Ok(config.len())
    ///     })
    ///     .unwrap_err();
    /// let io: &std::io::Error = err.downcast_ref().expect("the io::Error, typed");
    /// assert_eq!(io.kind(), std::io::ErrorKind::NotFound);
    /// assert!(matches!(&err, Error::RankFailed { failed_ranks, .. } if failed_ranks == &[0, 1]));
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    ///
    /// # Examples
    /// ```
    /// use dist_tensor::{Error, World};
    ///
    /// let err = World::threads(4)?
    ///     .run(|rank| {
    ///         if rank.rank() == 2 {
    ///             return Err(Error::InvalidArgument { op: "demo", rank: 2, reason: "bad".into() });
    ///         }
    ///         let _ = rank.barrier_all()?; // would wait forever for rank 2; returns PeerFailed instead
    ///         Ok(())
    ///     })
    ///     .unwrap_err();
    /// assert!(matches!(err, Error::RankFailed { rank: 2, .. }), "{err}");
    /// # Ok::<(), dist_tensor::Error>(())
    /// ```
    pub fn run<R, F>(&self, f: F) -> Result<Vec<R>>
    where
        R: Send,
        F: Fn(&Rank<'_>) -> Result<R> + Sync,
    {
        // Runs of one world must not overlap (their ranks would share signals and workspaces); a
        // `run` inside a rank's closure would wait for itself for ever.
        let _serialized = match self.shared.run_lock.try_lock() {
            Ok(guard) => guard,
            Err(std::sync::TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => {
                return Err(Error::InvalidArgument {
                    op: "World::run",
                    rank: 0,
                    reason:
                        "this world is already running (runs of one world cannot overlap or nest)"
                            .into(),
                });
            }
        };
        let shared = &*self.shared;
        // A failure already recorded is of an earlier run, unless (a world of processes) the
        // rank that failed had entered more runs than this one: then it is of the run this
        // rank is entering.
        let earlier = self.here.is_none_or(|me| {
            let control = &shared.control;
            control.first_failure().is_none_or(|(failed, _)| {
                control.runs(failed).load(std::sync::atomic::Ordering::Acquire)
                    <= control.runs(me).load(std::sync::atomic::Ordering::Acquire)
            })
        });
        if let Some(err) = shared.world_error(earlier) {
            if let (false, Some(me)) = (earlier, self.here) {
                // This rank has now had its part of that run: a later run's failure record is
                // then of an earlier one.
                shared.control.runs(me).fetch_add(1, std::sync::atomic::Ordering::AcqRel);
            }
            return Err(err);
        }
        if let Some(me) = self.here {
            // A world of processes: this process is one rank.
            shared.control.enter_run(me);
            return match run_rank(shared, me, &f) {
                Some(value) => Ok(vec![value]),
                None => Err(shared.world_error(false).expect("the rank failed")),
            };
        }
        let n = shared.num_ranks();
        for r in 0..n {
            shared.control.enter_run(r);
        }
        let f = &f;
        let outcomes: Vec<Option<R>> = std::thread::scope(|scope| {
            let mut handles = Vec::with_capacity(n);
            for r in 0..n {
                let spawned = std::thread::Builder::new()
                    .name(format!("rank-{r}"))
                    .spawn_scoped(scope, move || run_rank(shared, r, f));
                match spawned {
                    Ok(handle) => handles.push(handle),
                    Err(err) => {
                        // The ranks already started stop at once: the world has failed.
                        let err = Error::System {
                            op: "World::run",
                            rank: r,
                            what: "cannot start the rank's thread".into(),
                            source: Arc::new(err),
                        };
                        shared.fail_with(r, &err);
                        for rest in r..n {
                            shared.control.set_state(rest, RankState::Failed);
                        }
                        break;
                    }
                }
            }
            let mut outcomes: Vec<Option<R>> =
                handles.into_iter().map(|h| h.join().unwrap_or(None)).collect();
            outcomes.resize_with(n, || None);
            outcomes
        });
        if let Some(err) = shared.world_error(false) {
            return Err(err);
        }
        Ok(outcomes
            .into_iter()
            .map(|o| o.expect("no failure recorded, so every rank returned"))
            .collect())
    }
}

/// One rank's part of a run: the closure, then its state for the peers to see.
pub(crate) fn run_rank<R, F>(shared: &WorldShared, r: usize, f: &F) -> Option<R>
where
    F: Fn(&Rank<'_>) -> Result<R>,
{
    let rank = Rank::new(shared, r);
    // On a device world, a rank's part ends once its device work is done.
    let body = || {
        let value = f(&rank)?;
        match &shared.device {
            Some(device) => device.finish_rank(r).map(|()| value),
            None => Ok(value),
        }
    };
    let outcome = catch_unwind(AssertUnwindSafe(body));
    let err = match outcome {
        Ok(Ok(value)) => {
            shared.control.set_state(r, RankState::Returned);
            return Some(value);
        }
        Ok(Err(err)) => err,
        // A typed panic (`symm_at` on a peer of another node) stays typed.
        Err(panic) => match panic.downcast::<Error>() {
            Ok(err) => *err,
            Err(panic) => Error::Panicked { rank: r, message: panic_message(&*panic) },
        },
    };
    shared.fail_with(r, &err);
    shared.control.set_state(r, RankState::Failed);
    None
}

/// The text of a panic payload.
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "(a panic without a message)".to_string()
    }
}
