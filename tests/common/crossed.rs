//! Calls on the groups of a 2 x 2 mesh that cross (each rank waits for one blocked in a call on
//! another group) and correct calls that wait on each other across groups, for the tests of
//! every world kind (threads and processes in `mesh.rs`, MPI in `mpi.rs`).

use std::time::{Duration, Instant};

use dist_tensor::collectives;
use dist_tensor::mesh::DeviceMesh;
use dist_tensor::{Rank, World};

/// Ranks 0 and 3 all-reduce over their tp group first, ranks 1 and 2 over their dp group first,
/// then the other: 0 waits for 1 (tp), 1 for 3 (dp), 3 for 2 (tp) and 2 for 0 (dp), and no call
/// can finish. With `slow`, the same calls in the same order on every rank (tp, then dp), rank 3
/// coming late: correct calls that wait on each other across groups longer than the look for a
/// cycle takes. Returns how long the calls took and how they ended.
pub fn crossed_calls(rank: &Rank<'_>, slow: bool) -> dist_tensor::Result<String> {
    let mesh = DeviceMesh::new(rank, &[("dp", 2), ("tp", 2)])?;
    let crossed = !slow && matches!(rank.rank(), 1 | 2);
    let order = if crossed { ["dp", "tp"] } else { ["tp", "dp"] };
    let start = Instant::now();
    let mut sums = Vec::new();
    for _ in 0..2 {
        for dim in order {
            if slow && rank.rank() == 3 {
                std::thread::sleep(Duration::from_millis(700));
            }
            sums.push(collectives::all_reduce(&mesh.rank_of(dim)?, &[rank.rank() as f64])?[0]);
        }
    }
    Ok(format!("{} ms {sums:?}", start.elapsed().as_millis()))
}

/// What a rank's `crossed_calls` came to: its time and sums, or its time and error.
pub fn crossed_outcome(rank: &Rank<'_>, slow: bool) -> String {
    let start = Instant::now();
    crossed_calls(rank, slow)
        .unwrap_or_else(|e| format!("{} ms error: {e}", start.elapsed().as_millis()))
}

/// Checks every rank's outcome of `crossed_calls`: with crossed calls each failed within three
/// seconds (not at the 20 s wait timeout) with the mismatch; slow correct
/// calls all give the sums (tp then dp, twice).
pub fn check_crossed(outcomes: &[String], slow: bool) {
    for (r, out) in outcomes.iter().enumerate() {
        let ms: u64 = out.split(' ').next().and_then(|t| t.parse().ok()).expect(out);
        if slow {
            let tp = [1.0, 1.0, 5.0, 5.0][r];
            let dp = [2.0, 4.0, 2.0, 4.0][r];
            assert!(out.ends_with(&format!("{:?}", [tp, dp, tp, dp])), "rank {r}: {out}");
            continue;
        }
        assert!(out.contains("error") && ms < 3000, "rank {r}: {out}");
        assert!(out.contains("ranks are in different collective calls"), "rank {r}: {out}");
        assert!(out.contains("on different groups, so none can finish"), "rank {r}: {out}");
        assert!(out.contains("on the group of world ranks"), "rank {r}: {out}");
    }
}

/// A rank of a job of processes (one host or MPI): runs `crossed_calls` on `world`, a failed
/// call failing the rank's run so that the world stops; its line is how long that took and the
/// world's error, or its own time and sums.
pub fn crossed_in_job(world: &World, slow: bool) -> dist_tensor::Result<String> {
    let start = Instant::now();
    let out = world.run(|rank| crossed_calls(rank, slow));
    let ms = start.elapsed().as_millis();
    Ok(out.map_or_else(|e| format!("{ms} ms error: {e}"), |o| o[0].clone()))
}
