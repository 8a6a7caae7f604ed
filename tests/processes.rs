//! Ranks as processes of one host. Each test re-executes this test binary as the ranks of its
//! job (`World::local_job`, the test's own name as the filter): in a child, `World::launched()`
//! is true and the test body is one rank; in the test itself, it starts the job, bounds every
//! child by a timeout (a hang fails the test, it does not hang CI), and checks what each rank
//! printed, how each ended, and that nothing is left behind.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use dist_tensor::collectives::{self, ReduceOp};
use dist_tensor::shmem::RankExit;
use dist_tensor::shmem::job_env::{JOIN_TIMEOUT_ENV, RANK_ENV, WORLD_SIZE_ENV};
use dist_tensor::{Error, Rank, Tensor, World, fused};
use half::{bf16, f16};

mod common;

use common::checks::{Checks, summed, widen};
use common::jobs::{in_rank, printed, result, run_job};
use common::{digest, seeded};

/// How long a fault may take to end every other rank (the wait timeout stays at its 60 s default).
const BOUND: Duration = Duration::from_secs(1);

/// Files a crash could leave: anything of ours in `/dev/shm` or `/tmp`.
fn our_files() -> BTreeSet<String> {
    ["/dev/shm", "/tmp"]
        .iter()
        .filter_map(|dir| std::fs::read_dir(dir).ok())
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|name| name.contains("dist-tensor") || name.contains("dist_tensor"))
        .collect()
}

/// Runs test `name` as `n` ranks with extra `env`; checks that no file and no process is left.
fn job(name: &str, n: usize, env: &[(&str, &str)]) -> Vec<RankExit> {
    let before = our_files();
    let exits = run_job(name, n, env);
    let after = our_files();
    assert!(after.is_subset(&before), "left behind: {:?}", after.difference(&before));
    exits
}

// ---- the same numbers as threads ------------------------------------------------------------

/// Every collective and fused op, in several element types and odd sizes: one digest per
/// result, in order, then `|` and what [`Checks`] found wrong against the f64 references
/// (nothing when all is well).
fn battery(rank: &Rank<'_>) -> dist_tensor::Result<String> {
    let (me, n) = (rank.rank(), rank.num_ranks());
    let mut out = Vec::new();
    let mut check = Checks::default();
    // Sums of n values of sevenths in the accumulator (f32 for every type but f64), rounded once.
    let sum_tol = |eps: f64| (n as f64 + 1.0) * eps;
    // Collectives: uneven lengths where allowed.
    let x: Vec<f32> = seeded(me, 5 + 3 * me, 1);
    let got = collectives::all_gather(rank, &x)?;
    check.exact(
        "all_gather",
        &got,
        (0..n).flat_map(|r| widen(&seeded::<f32>(r, 5 + 3 * r, 1))).collect(),
    );
    out.push(digest(&got));
    let same: Vec<f32> = seeded(me, 37, 2);
    let got = collectives::reduce_scatter(rank, &same, ReduceOp::Sum)?;
    check.close(
        "reduce_scatter",
        &got,
        summed::<f32>(n, 37, 2, Some(me)),
        sum_tol(f32::EPSILON.into()),
    );
    out.push(digest(&got));
    let got = collectives::reduce_scatter(rank, &same, ReduceOp::Mean)?;
    let [sum, scale] = summed::<f32>(n, 37, 2, Some(me));
    let mean = [sum, scale].map(|v| v.iter().map(|x| x / n as f64).collect());
    check.close("reduce_scatter mean", &got, mean, sum_tol(f32::EPSILON.into()) + 1e-7);
    out.push(digest(&got));
    let got = collectives::all_reduce(rank, &same)?;
    check.close("all_reduce", &got, summed::<f32>(n, 37, 2, None), sum_tol(f32::EPSILON.into()));
    out.push(digest(&got));
    let even: Vec<f32> = seeded(me, 3 * n, 3);
    let got = collectives::all_to_all(rank, &even)?;
    let want =
        (0..n).flat_map(|r| widen(&seeded::<f32>(r, 3 * n, 3)[3 * me..3 * me + 3])).collect();
    check.exact("all_to_all", &got, want);
    out.push(digest(&got));
    let counts_of = |r: usize| -> Vec<usize> { (0..n).map(|p| (p + r) % 3).collect() };
    let counts = counts_of(me);
    let v: Vec<f64> = seeded(me, counts.iter().sum(), 4);
    let got = collectives::all_to_all_v(rank, &v, &counts)?;
    let want = (0..n)
        .flat_map(|r| {
            let c = counts_of(r);
            let from: usize = c[..me].iter().sum();
            seeded::<f64>(r, c.iter().sum(), 4)[from..from + c[me]].to_vec()
        })
        .collect();
    check.exact("all_to_all_v", &got, want);
    out.push(digest(&got));
    let got = collectives::broadcast(rank, &seeded::<f64>(me, 11, 5), n - 1)?;
    check.exact("broadcast", &got, seeded(n - 1, 11, 5));
    out.push(digest(&got));
    let got = collectives::all_reduce(rank, &seeded::<f64>(me, 23, 6))?;
    check.close("all_reduce f64", &got, summed::<f64>(n, 23, 6, None), sum_tol(f64::EPSILON));
    out.push(digest(&got));
    let got = collectives::all_gather(rank, &seeded::<bf16>(me, 9, 7))?;
    check.exact(
        "all_gather bf16",
        &got,
        (0..n).flat_map(|r| widen(&seeded::<bf16>(r, 9, 7))).collect(),
    );
    out.push(digest(&got));
    let got = collectives::all_reduce(rank, &seeded::<f16>(me, 19, 8))?;
    let half_tol = f64::from(f16::EPSILON) / 2.0 + sum_tol(f32::EPSILON.into());
    check.close("all_reduce f16", &got, summed::<f16>(n, 19, 8, None), half_tol);
    out.push(digest(&got));
    // Fused ops, f32 and bf16, uneven rows.
    let x = Tensor::from_shape_vec(&[13 + me, 64], seeded::<f32>(me, (13 + me) * 64, 9))?;
    let w = Tensor::from_shape_vec(&[64, 24], seeded::<f32>(me, 64 * 24, 10))?;
    let ag = fused::all_gather_matmul(rank, x.view2("x")?, &[w.view2("w")?])?;
    let got = ag.outputs[0].as_slice().expect("standard");
    check.gathered_product::<f32>("all_gather_matmul", got, (me, n), |r| 13 + r);
    out.push(digest(got));
    let ag = fused::all_gather_matmul_unfused(rank, x.view2("x")?, &[w.view2("w")?])?;
    let got = ag.outputs[0].as_slice().expect("standard");
    check.gathered_product::<f32>("all_gather_matmul_unfused", got, (me, n), |r| 13 + r);
    out.push(digest(got));
    let xb = x.cast::<bf16>();
    let wb = w.cast::<bf16>();
    let ag = fused::all_gather_matmul(rank, xb.view2("x")?, &[wb.view2("w")?])?;
    let got = ag.outputs[0].as_slice().expect("standard");
    check.gathered_product::<bf16>("all_gather_matmul bf16", got, (me, n), |r| 13 + r);
    out.push(digest(got));
    let h = Tensor::from_shape_vec(&[50, 16], seeded::<f32>(me, 50 * 16, 11))?;
    let w2 = Tensor::from_shape_vec(&[16, 20], seeded::<f32>(me, 16 * 20, 12))?;
    let rs = fused::matmul_reduce_scatter(rank, h.view2("h")?, w2.view2("w")?)?;
    let got = rs.as_slice().expect("standard");
    check.reduce_scattered_product("matmul_reduce_scatter", got, (me, n), (50, 16, 20));
    out.push(digest(got));
    let rs = fused::matmul_reduce_scatter_unfused(rank, h.view2("h")?, w2.view2("w")?)?;
    let got = rs.as_slice().expect("standard");
    check.reduce_scattered_product("matmul_reduce_scatter_unfused", got, (me, n), (50, 16, 20));
    out.push(digest(got));
    // Ulysses all_to_all: [B, s_r, H, D] -> [B, S, h_r, D] and back; S and H not divisible.
    let s_r = 3 + me % 2;
    let q = Tensor::from_shape_vec(&[2, s_r, 7, 8], seeded::<f32>(me, 2 * s_r * 7 * 8, 13))?;
    let shape = |r: usize| [2, 3 + r % 2, 7, 8];
    let heads = fused::all_to_all(rank, &q, 2, 1)?;
    check.heads_all_to_all("ulysses all_to_all", heads.output.as_slice(), (me, n), shape, 13);
    out.push(digest(heads.output.as_slice()));
    let got = fused::all_to_all_unfused(rank, &q, 2, 1)?.output;
    check.heads_all_to_all("ulysses all_to_all_unfused", got.as_slice(), (me, n), shape, 13);
    out.push(digest(got.as_slice()));
    // The DistTensor layer: an MLP block end to end.
    let (y, _) = check.run_mlp_block("mlp block", rank)?;
    out.push(digest(y.as_slice()));
    Ok(format!("{}|{}", out.join(","), check.fails.join("; ")))
}

/// The references' verdict in a [`battery`] result: what they found wrong, if anything.
fn reference_failures(result: &str) -> &str {
    result.rsplit_once('|').map_or("no verdict", |(_, fails)| fails)
}

#[test]
fn collectives_and_fused_ops_as_processes_give_the_same_bits_as_threads_at_worlds_1_to_4() {
    if in_rank(|world| Ok(world.run(battery)?.remove(0))) {
        return;
    }
    for n in 1..=4 {
        let threads = World::threads(n).unwrap().run(battery).unwrap();
        for (r, t) in threads.iter().enumerate() {
            assert_eq!(reference_failures(t), "", "threads world {n}, rank {r}");
        }
        let exits = job(
            "collectives_and_fused_ops_as_processes_give_the_same_bits_as_threads_at_worlds_1_to_4",
            n,
            &[],
        );
        for exit in &exits {
            assert!(exit.success(), "world {n}, rank {}: {}", exit.rank, exit.stderr_text());
            let got = result(exit);
            assert_eq!(reference_failures(&got), "", "world {n}, rank {}", exit.rank);
            assert_eq!(got, threads[exit.rank], "world {n}, rank {}", exit.rank);
        }
    }
}

/// Each rank's first Ulysses output, held while later calls run (their outputs dropped, so the
/// blocks go round), then the rank's last one: the held output lives in this process's own heap
/// segment, which the later calls' peers write into.
fn held_outputs(rank: &Rank<'_>) -> dist_tensor::Result<(Tensor<f32>, Tensor<f32>)> {
    let me = rank.rank();
    let q = |salt| Tensor::from_shape_vec(&[2, 3 + me, 5, 4], seeded(me, 2 * (3 + me) * 20, salt));
    let first = fused::all_to_all(rank, &q(1)?, 2, 1)?.output;
    let mut last = fused::all_to_all(rank, &q(2)?, 2, 1)?.output;
    for salt in 3..7 {
        drop(last);
        last = fused::all_to_all(rank, &q(salt)?, 2, 1)?.output;
    }
    Ok((first, last))
}

/// What is wrong with rank `me`'s held outputs of [`held_outputs`] against the all_to_all
/// written out in f64 (`first` from the inputs of salt 1, `last` of salt 6), if anything.
fn held_failures(me: usize, n: usize, (first, last): &(Tensor<f32>, Tensor<f32>)) -> String {
    let mut check = Checks::default();
    for (what, got, salt) in [("first", first, 1), ("last", last, 6)] {
        check.heads_all_to_all(what, got.as_slice(), (me, n), |r| [2, 3 + r, 5, 4], salt);
    }
    check.fails.join("; ")
}

#[test]
fn held_outputs_keep_their_values_and_outlive_the_world_as_processes() {
    let digests = |(first, last): &(Tensor<f32>, Tensor<f32>)| {
        format!("{} {}", digest(first.as_slice()), digest(last.as_slice()))
    };
    if in_rank(|world| {
        let (me, n) = (world.ranks_here().start, world.num_ranks());
        let mine = world.run(held_outputs)?.remove(0);
        drop(world);
        // Checked after the world is gone: the held blocks must have outlived it.
        Ok(format!("{}|{}", digests(&mine), held_failures(me, n, &mine)))
    }) {
        return;
    }
    for n in [2, 3] {
        let threads = World::threads(n).unwrap().run(held_outputs).unwrap();
        for (r, t) in threads.iter().enumerate() {
            assert_eq!(held_failures(r, n, t), "", "threads world {n}, rank {r}");
        }
        let exits =
            job("held_outputs_keep_their_values_and_outlive_the_world_as_processes", n, &[]);
        for exit in &exits {
            assert!(exit.success(), "world {n}, rank {}: {}", exit.rank, exit.stderr_text());
            let got = result(exit);
            assert_eq!(reference_failures(&got), "", "world {n}, rank {}", exit.rank);
            let want = format!("{}|", digests(&threads[exit.rank]));
            assert_eq!(got, want, "world {n}, rank {}", exit.rank);
        }
    }
}

// ---- faults -----------------------------------------------------------------------------------

/// The body of every fault test: rank 1 does `fault` after a first collective; the others go
/// into an all_gather that needs it, then try a barrier. Each other rank prints how long its
/// pending wait took to fail, and both errors.
fn fault_body(
    world: World,
    fault: impl Fn(&Rank<'_>) -> dist_tensor::Result<()> + Sync,
) -> dist_tensor::Result<String> {
    let out = world.run(|rank| {
        collectives::all_gather(rank, &[rank.rank() as f32])?; // everyone is in
        if rank.rank() == 1 {
            fault(rank)?;
            return Ok("rank 1 went on".to_string());
        }
        let start = Instant::now();
        let pending = collectives::all_gather(rank, &[1.0f32]).map(drop).unwrap_err();
        let ms = start.elapsed().as_millis();
        let next = rank.barrier_all().map(drop).unwrap_err();
        Ok(format!("{ms} ms | {pending} | {next}"))
    })?;
    Ok(out[0].clone())
}

/// Checks the ranks other than 1: each ended its pending wait within the bound, naming rank 1
/// and saying one of `says`; rank 1 ended as `rank1` says.
fn check_fault(exits: &[RankExit], says: &[&str], rank1: impl Fn(&RankExit) -> bool) {
    for exit in exits {
        if exit.rank == 1 {
            assert!(
                rank1(exit),
                "rank 1 {}: {}{}",
                exit.describe(),
                exit.stdout_text(),
                exit.stderr_text()
            );
            continue;
        }
        let text = result(exit);
        let ms: u128 = text.split(" ms").next().unwrap().parse().unwrap();
        assert!(ms < BOUND.as_millis(), "rank {}: {text}", exit.rank);
        let (pending, next) = text.split_once(" | ").unwrap().1.split_once(" | ").unwrap();
        for err in [pending, next] {
            assert!(err.contains("rank 1"), "rank {}: {err}", exit.rank);
            assert!(says.iter().any(|s| err.contains(s)), "rank {}: {err}", exit.rank);
        }
    }
}

#[test]
fn a_killed_rank_ends_every_other_ranks_waits_at_once_naming_it() {
    if in_rank(|world| fault_body(world, |_| common::jobs::kill_self())) {
        return;
    }
    let exits = job("a_killed_rank_ends_every_other_ranks_waits_at_once_naming_it", 3, &[]);
    check_fault(&exits, &["ended without returning from run"], |e| {
        e.describe() == "killed by signal 9"
    });
}

#[test]
fn a_panicking_rank_ends_every_other_ranks_waits_at_once_naming_it() {
    if in_rank(|world| fault_body(world, |_| panic!("rank one gives up"))) {
        return;
    }
    let exits = job("a_panicking_rank_ends_every_other_ranks_waits_at_once_naming_it", 3, &[]);
    check_fault(&exits, &["rank one gives up"], |e| {
        printed(e, "ERROR").is_some_and(|t| t.contains("panicked"))
    });
}

#[test]
fn a_rank_returning_early_ends_every_other_ranks_waits_at_once_naming_it() {
    if in_rank(|world| fault_body(world, |_| Ok(()))) {
        return;
    }
    let exits =
        job("a_rank_returning_early_ends_every_other_ranks_waits_at_once_naming_it", 3, &[]);
    // Returned, and then (its process going on to drop its world) perhaps gone further.
    check_fault(&exits, &["returned from run", "dropped its world"], |e| e.success());
}

#[test]
fn a_rank_returning_an_error_ends_every_other_ranks_waits_at_once_with_what_it_said() {
    if in_rank(|world| fault_body(world, |_| Err(Error::user("disk full on rank one")))) {
        return;
    }
    let exits = job(
        "a_rank_returning_an_error_ends_every_other_ranks_waits_at_once_with_what_it_said",
        3,
        &[],
    );
    check_fault(&exits, &["disk full on rank one"], |e| {
        printed(e, "ERROR").is_some_and(|t| t.contains("disk full"))
    });
}

// ---- bad environments -----------------------------------------------------------------------

fn env_error(name: &str, n: usize, env: &[(&str, &str)]) -> Vec<String> {
    job(name, n, env)
        .iter()
        .map(|e| {
            printed(e, "ERROR")
                .unwrap_or_else(|| panic!("rank {} joined: {}", e.rank, e.stdout_text()))
        })
        .collect()
}

#[test]
fn a_world_size_of_zero_is_refused() {
    if in_rank(|_| Ok("joined".into())) {
        return;
    }
    let errors = env_error("a_world_size_of_zero_is_refused", 1, &[(WORLD_SIZE_ENV, "0")]);
    assert!(errors[0].contains("DIST_TENSOR_WORLD_SIZE=0"), "{}", errors[0]);
}

#[test]
fn a_rank_not_below_the_world_size_is_refused() {
    if in_rank(|_| Ok("joined".into())) {
        return;
    }
    let errors = env_error("a_rank_not_below_the_world_size_is_refused", 1, &[(RANK_ENV, "3")]);
    assert!(
        errors[0].contains("DIST_TENSOR_RANK=3 is not below DIST_TENSOR_WORLD_SIZE=1"),
        "{}",
        errors[0]
    );
}

#[test]
fn launchers_that_disagree_on_the_rank_are_refused() {
    if in_rank(|_| Ok("joined".into())) {
        return;
    }
    let errors = env_error(
        "launchers_that_disagree_on_the_rank_are_refused",
        1,
        &[("OMPI_COMM_WORLD_RANK", "1"), ("OMPI_COMM_WORLD_SIZE", "2")],
    );
    assert!(errors[0].contains("conflicting ranks"), "{}", errors[0]);
}

#[test]
fn a_missing_world_size_is_refused() {
    if World::launched() {
        let err = World::from_env().unwrap_err();
        println!("ERROR {err}");
        return;
    }
    let exe = std::env::current_exe().unwrap();
    let out = std::process::Command::new(exe)
        .args([
            "a_missing_world_size_is_refused",
            "--exact",
            "--nocapture",
            "--test-threads=1",
            "-q",
        ])
        .env("PMI_RANK", "0")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains(
            "ERROR World::from_env: bad environment: PMI_RANK is set but PMI_SIZE is not"
        ),
        "{text}"
    );
}

#[test]
fn a_peer_that_never_joins_is_a_bounded_error_naming_it() {
    if World::launched() {
        let skip = std::env::var("SKIP_RANK").unwrap();
        if std::env::var(RANK_ENV).unwrap() == skip {
            println!("RESULT stayed away");
            return;
        }
        let start = Instant::now();
        let err = World::from_env().unwrap_err();
        println!("ERROR {} ms | {err}", start.elapsed().as_millis());
        return;
    }
    let name = "a_peer_that_never_joins_is_a_bounded_error_naming_it";
    // Rank 2 never comes: rank 0 (the host) names it; rank 1 learns that rank 0 gave up.
    let exits = job(name, 3, &[(JOIN_TIMEOUT_ENV, "300"), ("SKIP_RANK", "2")]);
    let host = printed(&exits[0], "ERROR").unwrap();
    assert!(host.contains("ranks [2] of 3 did not join"), "{host}");
    let ms: u128 = host.split(" ms").next().unwrap().parse().unwrap();
    assert!((300..5_000).contains(&ms), "{host}");
    assert!(printed(&exits[1], "ERROR").is_some());
    // Rank 0 never comes: the others time out connecting.
    let exits = job(name, 2, &[(JOIN_TIMEOUT_ENV, "300"), ("SKIP_RANK", "0")]);
    let guest = printed(&exits[1], "ERROR").unwrap();
    assert!(
        guest.contains("rank 0 of job") && guest.contains("did not open the rendezvous"),
        "{guest}"
    );
}

// ---- agreement across processes -------------------------------------------------------------

#[test]
fn ranks_in_different_calls_or_allocations_fail_together_across_processes() {
    if in_rank(|world| {
        let out = world.run(|rank| {
            let me = rank.rank();
            let start = Instant::now();
            let op = if me == 0 {
                collectives::all_gather(rank, &[1.0f32]).map(drop).unwrap_err()
            } else {
                collectives::broadcast(rank, &[1.0f32], 0).map(drop).unwrap_err()
            };
            let alloc = rank.alloc::<f64>(if me == 0 { 10 } else { 20 }).map(drop).unwrap_err();
            // Both failed together, and the ranks are still in step.
            let sum = collectives::all_reduce(rank, &[1.0f32])?[0];
            Ok(format!("{} ms | {op} | {alloc} | {sum}", start.elapsed().as_millis()))
        })?;
        Ok(out[0].clone())
    }) {
        return;
    }
    let exits =
        job("ranks_in_different_calls_or_allocations_fail_together_across_processes", 2, &[]);
    for exit in &exits {
        let text = result(exit);
        let ms: u128 = text.split(" ms").next().unwrap().parse().unwrap();
        assert!(ms < BOUND.as_millis(), "{text}");
        assert!(text.contains("rank 0 is in all_gather<f32> #"), "{text}");
        assert!(text.contains("rank 1 in broadcast<f32> #"), "{text}");
        assert!(text.contains("rank 0 allocated 80 bytes for Rank::alloc<f64>"), "{text}");
        assert!(text.ends_with("| 2"), "{text}");
    }
}

#[test]
fn a_rank_between_two_runs_is_not_taken_for_gone() {
    if in_rank(|world| {
        let mut sums = Vec::new();
        for run in 0..3 {
            let out = world.run(|rank| {
                // Rank 1 is slow to enter each run: its peers wait for it in the all_reduce,
                // seeing it as returned from the previous run.
                if rank.rank() == 1 {
                    std::thread::sleep(Duration::from_millis(50));
                }
                Ok(collectives::all_reduce(rank, &[(run + rank.rank()) as f32])?[0])
            })?;
            sums.push(out[0].to_string());
        }
        Ok(sums.join(" "))
    }) {
        return;
    }
    let exits = job("a_rank_between_two_runs_is_not_taken_for_gone", 3, &[]);
    for exit in &exits {
        assert_eq!(result(exit), "3 6 9", "rank {}: {}", exit.rank, exit.stderr_text());
    }
}

#[test]
fn a_rank_killed_between_runs_ends_its_peers_next_run_at_once() {
    if in_rank(|world| {
        world.run(|rank| rank.barrier_all().map(drop))?;
        if world.ranks_here().contains(&1) {
            // Between runs: its state says it returned from the first, so only its process's
            // end can tell the peers that it will never come to the second.
            common::jobs::kill_self()
        }
        std::thread::sleep(Duration::from_millis(200)); // the kill lands before the next run
        let start = Instant::now();
        let err = world.run(|rank| rank.barrier_all().map(drop)).unwrap_err();
        Ok(format!("{} ms | {err}", start.elapsed().as_millis()))
    }) {
        return;
    }
    let exits = job("a_rank_killed_between_runs_ends_its_peers_next_run_at_once", 3, &[]);
    assert_eq!(exits[1].describe(), "killed by signal 9");
    for exit in [&exits[0], &exits[2]] {
        let text = result(exit);
        let ms: u128 = text.split(" ms").next().unwrap().parse().unwrap();
        assert!(ms < BOUND.as_millis(), "rank {}: {text}", exit.rank);
        assert!(text.contains("rank 1 ended between runs"), "rank {}: {text}", exit.rank);
    }
}

#[test]
fn a_rank_that_drops_its_world_ends_its_peers_next_run_at_once() {
    if in_rank(|world| {
        world.run(|rank| rank.barrier_all().map(drop))?;
        if world.ranks_here().contains(&1) {
            drop(world);
            std::thread::sleep(Duration::from_millis(500)); // the process lives on
            return Ok("dropped".into());
        }
        let start = Instant::now();
        let err = world.run(|rank| rank.barrier_all().map(drop)).unwrap_err();
        Ok(format!("{} ms | {err}", start.elapsed().as_millis()))
    }) {
        return;
    }
    let exits = job("a_rank_that_drops_its_world_ends_its_peers_next_run_at_once", 2, &[]);
    let text = result(&exits[0]);
    let ms: u128 = text.split(" ms").next().unwrap().parse().unwrap();
    assert!(ms < BOUND.as_millis(), "{text}");
    assert!(text.contains("rank 1 dropped its world"), "{text}");
}
