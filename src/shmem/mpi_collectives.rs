//! MPI's own collectives on a rank's vectors, for the unfused baselines a user of MPI would write
//! (`fused::mpi`): the proxy runs them (see `shmem::mpi::collective`). A world not joined by MPI
//! has none: each returns a typed error.
//!
//! The vectors are handed over and handed back: while MPI may still use them (a world that fails
//! mid-call) they stay with the proxy, never freed under it.

use std::any::Any;

use super::Rank;
use super::transport::{CollectiveKind, Elem, Owned};
use crate::tensor::{DType, Element, split_offsets};
use crate::{Error, Result};

/// Takes back the vector of `T` at `index` of what a collective returned.
fn take<T: Element>(mut owned: Owned, index: usize) -> Vec<T> {
    let boxed: Box<dyn Any + Send> = owned.swap_remove(index);
    *boxed.downcast::<Vec<T>>().expect("a collective returns the vectors it was given")
}

/// Bytes of `count` elements of `T`.
fn bytes<T>(counts: &[usize]) -> Vec<usize> {
    counts.iter().map(|&c| c * size_of::<T>()).collect()
}

impl Rank<'_> {
    /// `MPI_Allgatherv`: every rank's `send` (`counts[r]` elements from rank `r`), concatenated.
    pub(crate) fn mpi_all_gather_v<T: Element>(
        &self,
        send: Vec<T>,
        counts: &[usize],
    ) -> Result<Vec<T>> {
        let total: usize = counts.iter().sum();
        let mut recv = crate::tensor::pool::take::<T>("MPI_Allgatherv", total)?;
        let byte_counts = bytes::<T>(counts);
        let kind = CollectiveKind::AllGatherV {
            send: send.as_ptr().cast(),
            send_count: send.len() * size_of::<T>(),
            recv: recv.as_mut_ptr().cast(),
            displs: split_offsets(&byte_counts)[..counts.len()].to_vec(),
            counts: byte_counts,
            elem: Elem::Bytes,
        };
        let owned = self.world.transport.collective(
            self.world,
            self.rank,
            kind,
            vec![Box::new(send), Box::new(recv)],
        )?;
        Ok(take(owned, 1))
    }

    /// `MPI_Reduce_scatter` with `MPI_SUM`: this rank's `counts[me]` elements of the sum of every
    /// rank's `send`. f32 and f64 only (MPI has no half types).
    pub(crate) fn mpi_reduce_scatter<T: Element>(
        &self,
        send: Vec<T>,
        counts: &[usize],
    ) -> Result<Vec<T>> {
        let elem = match T::DTYPE {
            DType::F32 => Elem::F32,
            DType::F64 => Elem::F64,
            other => {
                return Err(Error::InvalidArgument {
                    op: "MPI_Reduce_scatter",
                    rank: self.rank,
                    reason: format!("MPI sums f32 and f64, not {other:?}"),
                });
            }
        };
        let mut recv = crate::tensor::pool::take::<T>("MPI_Reduce_scatter", counts[self.rank])?;
        let kind = CollectiveKind::ReduceScatter {
            send: send.as_ptr().cast(),
            recv: recv.as_mut_ptr().cast(),
            counts: counts.to_vec(),
            elem,
        };
        let owned = self.world.transport.collective(
            self.world,
            self.rank,
            kind,
            vec![Box::new(send), Box::new(recv)],
        )?;
        Ok(take(owned, 1))
    }

    /// `MPI_Alltoallv`: `send_counts[r]` elements of `send` (in rank order) to rank `r`;
    /// `recv_counts[r]` elements from rank `r`, concatenated in rank order.
    pub(crate) fn mpi_all_to_all_v<T: Element>(
        &self,
        send: Vec<T>,
        send_counts: &[usize],
        recv_counts: &[usize],
    ) -> Result<Vec<T>> {
        let total: usize = recv_counts.iter().sum();
        let mut recv = crate::tensor::pool::take::<T>("MPI_Alltoallv", total)?;
        let (sc, rc) = (bytes::<T>(send_counts), bytes::<T>(recv_counts));
        let n = send_counts.len();
        let kind = CollectiveKind::AllToAllV {
            send: send.as_ptr().cast(),
            send_displs: split_offsets(&sc)[..n].to_vec(),
            send_counts: sc,
            recv: recv.as_mut_ptr().cast(),
            recv_displs: split_offsets(&rc)[..n].to_vec(),
            recv_counts: rc,
            elem: Elem::Bytes,
        };
        let owned = self.world.transport.collective(
            self.world,
            self.rank,
            kind,
            vec![Box::new(send), Box::new(recv)],
        )?;
        Ok(take(owned, 1))
    }
}
