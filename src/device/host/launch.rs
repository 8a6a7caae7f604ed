//! `launch`: run a tile kernel's programs on a rank's device.

use crate::Result;
use crate::device::{LaunchMode, Program, host};
use crate::shmem::Rank;

/// Runs `kernel` as `grid` programs on `rank`'s device, every program resident at once (kernels
/// may spin-wait on each other). In [`LaunchMode::Mix`] each program runs once per vector
/// sub-core of the topology, told its `sub_vec_id`; in [`LaunchMode::VectorOnly`] once.
///
/// On the host every program instance is a thread; `launch` returns when all have. What the
/// programs do to shared memory is governed by the tile operations' access contract (see
/// [`tile`](super::tile)).
///
/// # Errors
/// The first error a program returned, or [`Error::KernelPanicked`](crate::Error::KernelPanicked)
/// if one panicked. Either also fails the world, so that programs and ranks waiting on this one
/// stop with [`Error::PeerFailed`](crate::Error::PeerFailed) instead of hanging.
///
/// # Examples
/// ```
/// use dist_tensor::device::{launch, tile, LaunchMode};
/// use dist_tensor::shmem::GlobalPtrMut;
/// use dist_tensor::World;
///
/// let out = World::threads(1)?.run(|rank| {
///     let mut out = vec![0.0f32; 100];
///     let ptr = GlobalPtrMut::from_slice(&mut out);
///     launch(rank, LaunchMode::VectorOnly, 4, |p| {
///         for block in p.tasks(100usize.div_ceil(16)) {
///             let start = block * 16;
///             let valid = tile::valid_len(start, 16, 100); // a mask, not padding
///             // SAFETY: each task writes its own block of 16 elements; blocks are disjoint.
///             unsafe { tile::store_1d(ptr + start, &[block as f32; 16], valid) };
///         }
///         Ok(())
///     })?;
///     Ok(out)
/// })?;
/// assert_eq!(out[0][99], 6.0);
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn launch<F>(rank: &Rank<'_>, mode: LaunchMode, grid: usize, kernel: F) -> Result<()>
where
    F: Fn(&Program<'_>) -> Result<()> + Sync,
{
    let sub_vec_num = match mode {
        LaunchMode::Mix => rank.topology().sub_vec_num(),
        LaunchMode::VectorOnly => 1,
    };
    host::run_programs(rank, grid, sub_vec_num, &kernel)
}
