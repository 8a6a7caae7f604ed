//! Ranks as processes on GPUs: `World::from_env` with `DIST_TENSOR_DEVICE=cuda`, each process on
//! the GPU of its local rank (`local_rank % device count`), the symmetric heap in GPU memory
//! shared between the processes (CUDA's virtual memory API, fds over the world's Unix socket).
//! On a machine with one GPU every rank shares it.
//!
//! Each test re-executes this test binary as the ranks of its job (as `tests/processes.rs`
//! does). Without a GPU (or without `--features cuda`) each test prints why it was skipped and
//! passes: `cargo test --release --features cuda --test cuda_processes -- --nocapture`.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use dist_tensor::device::cuda;
use dist_tensor::shmem::RankExit;
use dist_tensor::shmem::job_env::JOIN_TIMEOUT_ENV;
use dist_tensor::{Device, Error, Rank, Tensor, World, collectives, fused};
use half::{bf16, f16};

mod common;

use common::checks::{Checks, summed, widen};
use common::jobs::{CHILD_TIMEOUT, in_rank, printed, result, run_job, test_args};
use common::{digest, seeded};

/// How long a fault may take to end the other ranks' device waits.
const BOUND: Duration = Duration::from_secs(2);
/// Each rank's GPU heap segment in these tests (small: several processes share one GPU).
const HEAP: &str = "268435456";
/// GPU memory a job may seem to leave behind (the driver's own bookkeeping moves a little).
const SLACK: usize = 64 << 20;

fn free_gpu_memory() -> usize {
    cuda::memory_info(0).expect("cuMemGetInfo").0
}

/// Runs test `name` as `n` ranks on the GPU with extra `env`; checks that no process is left and
/// that the GPU has its memory back.
fn job(name: &str, n: usize, env: &[(&str, &str)]) -> Vec<RankExit> {
    let before = free_gpu_memory();
    let mut all = vec![("DIST_TENSOR_DEVICE", "cuda"), ("DIST_TENSOR_GPU_HEAP_BYTES", HEAP)];
    all.extend_from_slice(env);
    let exits = run_job(name, n, &all);
    // The driver frees a dead process's memory asynchronously: give it a moment.
    let start = Instant::now();
    let mut free = free_gpu_memory();
    while free + SLACK < before && start.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(50));
        free = free_gpu_memory();
    }
    assert!(
        free + SLACK >= before,
        "the job left {} MiB of GPU memory behind",
        (before - free) >> 20
    );
    exits
}

// ---- the ops, against the f64 references ----------------------------------------------------

/// The ops a GPU world runs on its GPUs (collectives, fused ops, the DistTensor layer), in
/// several element types and odd sizes: one digest per result, then `|` and what [`Checks`]
/// found wrong against the f64 references (nothing when all is well).
fn battery(rank: &Rank<'_>) -> dist_tensor::Result<String> {
    let (me, n) = (rank.rank(), rank.num_ranks());
    assert!(matches!(rank.device(), Device::Cuda(_)), "rank {me} on {:?}", rank.device());
    let mut out = Vec::new();
    let mut check = Checks::default();
    let sum_tol = |eps: f64| (n as f64 + 1.0) * eps;
    // Uneven lengths: rank r has 5 + 3r elements (1 element and primes among them).
    let got = collectives::all_gather(rank, &seeded::<f32>(me, 5 + 3 * me, 1))?;
    let want = (0..n).flat_map(|r| widen(&seeded::<f32>(r, 5 + 3 * r, 1))).collect();
    check.exact("all_gather", &got, want);
    out.push(digest(&got));
    let same: Vec<f32> = seeded(me, 37, 2);
    let got = collectives::reduce_scatter(rank, &same, collectives::ReduceOp::Sum)?;
    check.close(
        "reduce_scatter",
        &got,
        summed::<f32>(n, 37, 2, Some(me)),
        sum_tol(f32::EPSILON.into()),
    );
    out.push(digest(&got));
    let got = collectives::all_reduce(rank, &same)?;
    check.close("all_reduce", &got, summed::<f32>(n, 37, 2, None), sum_tol(f32::EPSILON.into()));
    out.push(digest(&got));
    let got = collectives::broadcast(rank, &seeded::<f64>(me, 11, 5), n - 1)?;
    check.exact("broadcast", &got, seeded(n - 1, 11, 5));
    out.push(digest(&got));
    let got = collectives::all_reduce(rank, &seeded::<f64>(me, 23, 6))?;
    check.close("all_reduce f64", &got, summed::<f64>(n, 23, 6, None), sum_tol(f64::EPSILON));
    out.push(digest(&got));
    let got = collectives::all_gather(rank, &seeded::<bf16>(me, 9, 7))?;
    let want = (0..n).flat_map(|r| widen(&seeded::<bf16>(r, 9, 7))).collect();
    check.exact("all_gather bf16", &got, want);
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
    let (xb, wb) = (x.cast::<bf16>(), w.cast::<bf16>());
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
    // Ulysses all_to_all: [B, s_r, H, D] -> [B, S, h_r, D]; S and H not divisible.
    let s_r = 3 + me % 2;
    let q = Tensor::from_shape_vec(&[2, s_r, 7, 8], seeded::<f32>(me, 2 * s_r * 7 * 8, 13))?;
    let shape = |r: usize| [2, 3 + r % 2, 7, 8];
    // A tensor result stays on the rank's GPU: read it on the host.
    let heads = fused::all_to_all(rank, &q, 2, 1)?.output.to_host()?;
    check.heads_all_to_all("ulysses all_to_all", heads.as_slice(), (me, n), shape, 13);
    out.push(digest(heads.as_slice()));
    // The DistTensor layer: an MLP block end to end, fewer rows than some worlds have ranks.
    let (y, _) = check.run_mlp_block("mlp block", rank)?;
    out.push(digest(y.as_slice()));
    Ok(format!("{}|{}", out.join(","), check.fails.join("; ")))
}

fn reference_failures(result: &str) -> &str {
    result.rsplit_once('|').map_or("no verdict", |(_, fails)| fails)
}

#[test]
fn the_ops_as_processes_sharing_a_gpu_match_the_f64_references_at_2_and_3_processes() {
    const NAME: &str =
        "the_ops_as_processes_sharing_a_gpu_match_the_f64_references_at_2_and_3_processes";
    if in_rank(|world| Ok(world.run(battery)?.remove(0))) {
        return;
    }
    if !common::gpu::gpu_here(NAME) {
        return;
    }
    for n in [2, 3] {
        // The one-process GPU world with the same ranks on the same GPU, where this build has
        // it (ranks sharing a GPU): the processes must give its bits exactly.
        let threads = match World::cuda(&vec![0; n]) {
            Ok(world) => Some(world.run(battery).unwrap()),
            Err(e) => {
                println!("world {n}: not compared with a one-process world: {e}");
                None
            }
        };
        let exits = job(NAME, n, &[]);
        for exit in &exits {
            assert!(exit.success(), "world {n}, rank {}: {}", exit.rank, exit.stderr_text());
            let got = result(exit);
            assert_eq!(reference_failures(&got), "", "world {n}, rank {}", exit.rank);
            if let Some(threads) = &threads {
                assert_eq!(got, threads[exit.rank], "world {n}, rank {}", exit.rank);
            }
        }
        println!("world {n}: {} processes on one GPU match the f64 references", exits.len());
    }
}

// ---- the tensor pool ---------------------------------------------------------------------------

/// Each rank pulls 20 rank-1 tensors of 32 MiB (`cuda::broadcast`: rank 1 publishes its own
/// tensor's address) through a tensor pool of 256 MiB ([`HEAP`]), three such tensors alive at a
/// time: the pool must take back what is dropped. Then a tensor larger than the pool is a typed
/// error naming the rank and the setting, and the pool still serves after it.
fn pool_body(rank: &Rank<'_>) -> dist_tensor::Result<String> {
    const ELEMS: usize = 8 << 20; // 32 MiB of f32
    let me = rank.rank();
    for i in 0..20u64 {
        let mine = cuda::random::<f32>(rank, &[ELEMS], 100 * i + me as u64)?;
        let got = cuda::broadcast(rank, &mine, 1)?.to_host()?;
        let want = cuda::random::<f32>(rank, &[ELEMS], 100 * i + 1)?.to_host()?;
        if got != want {
            return Ok(format!("pull {i}: rank 1's tensor came wrong"));
        }
    }
    let err = match cuda::random::<f32>(rank, &[(300 << 20) / 4], 7) {
        Ok(_) => return Ok("a 300 MiB tensor fit in a 256 MiB pool".into()),
        Err(err) => err,
    };
    let named = err.to_string();
    if !matches!(err, Error::OutOfMemory { .. })
        || !named.contains(&format!("rank {me}'s tensor pool"))
        || !named.contains("DIST_TENSOR_GPU_HEAP_BYTES")
    {
        return Ok(format!("exhaustion said: {named}"));
    }
    let last = cuda::random::<f32>(rank, &[ELEMS * 3], 3)?; // 96 MiB, and as much pulled
    let got = cuda::broadcast(rank, &last, 0)?.to_host()?;
    let ok = got.as_slice().iter().all(|x| (-1.0..1.0).contains(x));
    Ok(if ok { format!("ok | {named}") } else { "the last pull came wrong".into() })
}

#[test]
fn a_process_worlds_tensors_come_from_its_pool_and_go_back_to_it() {
    const NAME: &str = "a_process_worlds_tensors_come_from_its_pool_and_go_back_to_it";
    if in_rank(|world| Ok(world.run(pool_body)?.remove(0))) {
        return;
    }
    if !common::gpu::gpu_here(NAME) {
        return;
    }
    let exits = job(NAME, 2, &[]);
    for exit in &exits {
        assert!(exit.success(), "rank {}: {}", exit.rank, exit.stderr_text());
    }
    let got = result(&exits[0]);
    assert!(got.starts_with("ok | "), "rank 0: {got}");
    println!("20 pulls of 32 MiB through a 256 MiB pool; then: {}", &got[5..]);
}

// ---- faults -----------------------------------------------------------------------------------

/// Runs `body` as every rank of `world`; `body` returns rank 0's text (how long it waited, `ms |
/// `, and the error it saw). In rank 0's process: that text, then ` | run: ` and what
/// `World::run` returned (once a peer failed, every rank's run fails with the first failure,
/// even where the closure itself returned `Ok`). In the other processes: what `run` returned.
fn rank0_sees(
    world: World,
    body: impl Fn(&Rank<'_>) -> dist_tensor::Result<Option<String>> + Sync,
) -> dist_tensor::Result<String> {
    let seen = std::sync::Mutex::new(None);
    let run = world.run(|rank| {
        if let Some(text) = body(rank)? {
            *seen.lock().unwrap() = Some(text);
        }
        Ok(())
    });
    match seen.into_inner().unwrap() {
        Some(text) => {
            let run = run.map_or_else(|e| e.to_string(), |_| "Ok".to_string());
            Ok(format!("{text} | run: {run}"))
        }
        None => run.map(|_| "a rank other than 0 went on".to_string()),
    }
}

/// Rank 0's device barrier and its wait for the GPU, timed, as the text [`rank0_sees`] wants.
fn rank0_waits(rank: &Rank<'_>) -> String {
    let start = Instant::now();
    let waited = match cuda::barrier(rank).and_then(|()| cuda::synchronize(rank)) {
        Ok(()) => "no error: the device barrier ended as if rank 1 were still there".to_string(),
        Err(err) => err.to_string(),
    };
    format!("{} ms | {waited}", start.elapsed().as_millis())
}

/// The body of the fault tests: after a first barrier, rank 1 fills its GPU's queue with work
/// (150 products of 4096 x 4096 f32 matrices, about 3 ms each on an H200), then every rank
/// meets on the host; rank 1
/// queues the device barrier behind its work (so its barrier kernel cannot signal before the
/// fault), lets rank 0 get well into its barrier kernel's wait for it (50 ms), then does
/// `fault`. Rank 0 times its barrier and device wait ([`rank0_waits`]).
fn fault_body(
    world: World,
    fault: impl Fn(&Rank<'_>) -> dist_tensor::Result<()> + Sync,
) -> dist_tensor::Result<String> {
    const LEAD: Duration = Duration::from_millis(50);
    rank0_sees(world, |rank| {
        // One barrier first, so that the timed one launches at once: its kernel compiled, its
        // state made (both took longer than rank 1's queue of work in a first GPU run).
        cuda::barrier(rank)?;
        cuda::synchronize(rank)?;
        let work = if rank.rank() == 1 {
            let a = cuda::random::<f32>(rank, &[4096, 4096], 1)?;
            let mut b = a.clone();
            for _ in 0..150 {
                b = b.matmul(&a)?; // queued, not waited for
            }
            Some(b)
        } else {
            None
        };
        let _ = rank.barrier_all()?; // everyone is in (on the host: the GPU queue stays full)
        if rank.rank() == 1 {
            cuda::barrier(rank)?;
            std::thread::sleep(LEAD);
            fault(rank)?;
            drop(work);
            return Ok(None);
        }
        Ok((rank.rank() == 0).then(|| rank0_waits(rank)))
    })
}

/// Checks rank 0: its device wait ended within the bound, naming rank 1 and saying one of
/// `says`, and its run ended as `run_says`; and rank 1 ended as `rank1` says.
fn check_fault(
    exits: &[RankExit],
    says: &[&str],
    run_says: &str,
    rank1: impl Fn(&RankExit) -> bool,
) {
    let one = &exits[1];
    assert!(rank1(one), "rank 1 {}: {}{}", one.describe(), one.stdout_text(), one.stderr_text());
    let text = result(&exits[0]);
    let ms: u128 = text.split(" ms").next().unwrap().parse().expect(&text);
    assert!(ms < BOUND.as_millis(), "rank 0: {text}");
    let (err, run) = text.split_once(" | ").unwrap().1.split_once(" | run: ").expect(&text);
    assert!(err.contains("rank 1"), "rank 0's device wait: {text}");
    assert!(says.iter().any(|s| err.contains(s)), "rank 0's device wait: {text}");
    assert!(run.starts_with(run_says), "rank 0's run: {text}");
    println!("rank 0's device barrier ended after {ms} ms: {err}; its run: {run}");
}

#[test]
fn a_process_killed_mid_kernel_ends_the_others_device_waits_naming_it() {
    const NAME: &str = "a_process_killed_mid_kernel_ends_the_others_device_waits_naming_it";
    if in_rank(|world| fault_body(world, |_| common::jobs::kill_self())) {
        return;
    }
    if !common::gpu::gpu_here(NAME) {
        return;
    }
    let exits = job(NAME, 2, &[]);
    check_fault(&exits, &["ended without returning from run"], "rank 1 failed first", |e| {
        e.describe() == "killed by signal 9"
    });
}

#[test]
fn a_panicking_process_ends_the_others_device_waits_naming_it() {
    const NAME: &str = "a_panicking_process_ends_the_others_device_waits_naming_it";
    if in_rank(|world| fault_body(world, |_| panic!("rank one gives up"))) {
        return;
    }
    if !common::gpu::gpu_here(NAME) {
        return;
    }
    let exits = job(NAME, 2, &[]);
    check_fault(&exits, &["rank one gives up"], "rank 1 failed first", |e| {
        printed(e, "ERROR").is_some_and(|t| t.contains("panicked"))
    });
}

#[test]
fn a_process_returning_early_ends_the_others_naming_it() {
    const NAME: &str = "a_process_returning_early_ends_the_others_naming_it";
    if in_rank(|world| {
        rank0_sees(world, |rank| {
            collectives::all_gather(rank, &[rank.rank() as f32])?;
            Ok((rank.rank() == 0).then(|| rank0_waits(rank)))
        })
    }) {
        return;
    }
    if !common::gpu::gpu_here(NAME) {
        return;
    }
    let exits = job(NAME, 2, &[]);
    // Returning early is no failure: rank 0's barrier fails, naming rank 1, but the world's
    // run is Ok (rank 0's closure returned what it saw).
    check_fault(&exits, &["returned from run", "dropped its world"], "Ok", |e| e.success());
}

#[test]
fn a_process_that_never_joins_fails_the_others_at_the_join_timeout() {
    const NAME: &str = "a_process_that_never_joins_fails_the_others_at_the_join_timeout";
    if World::launched() {
        if std::env::var("DIST_TENSOR_RANK").as_deref() == Ok("1") {
            return; // never joins
        }
        let start = Instant::now();
        let err = World::from_env().map(drop).unwrap_err();
        println!("RESULT {} ms | {err}", start.elapsed().as_millis());
        return;
    }
    if !common::gpu::gpu_here(NAME) {
        return;
    }
    let exits = job(NAME, 2, &[(JOIN_TIMEOUT_ENV, "1500")]);
    let text = result(&exits[0]);
    let ms: u128 = text.split(" ms").next().unwrap().parse().expect(&text);
    assert!((1500..10_000).contains(&ms), "{text}");
    assert!(text.contains("[1]") && text.contains("did not join"), "{text}");
}

// ---- launchers --------------------------------------------------------------------------------

/// A short job body for the launchers: an all_gather of the ranks on their GPUs.
fn launched_body(world: World) -> dist_tensor::Result<String> {
    let out = world.run(|rank| {
        assert!(matches!(rank.device(), Device::Cuda(_)));
        let got = collectives::all_gather(rank, &[rank.rank() as f32 + 0.5])?;
        Ok(format!("{} of {}: {got:?}", rank.rank(), rank.num_ranks()))
    })?;
    Ok(out[0].clone())
}

/// Waits (bounded) for processes this test started (not launched itself: no launcher's
/// variables are in its environment to pass on) and returns what each printed.
fn wait_all(mut children: Vec<std::process::Child>) -> Vec<String> {
    let start = Instant::now();
    let mut outs = Vec::new();
    for child in &mut children {
        loop {
            if child.try_wait().unwrap().is_some() || start.elapsed() > CHILD_TIMEOUT {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = child.kill();
    }
    for child in children {
        let out = child.wait_with_output().unwrap();
        outs.push(String::from_utf8_lossy(&out.stdout).into_owned());
        outs.push(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    outs
}

/// Test `name`, whose ranks run [`launched_body`] in a GPU world of 2 processes that `start`
/// starts (given this binary's path; `None` skips the test, having said why), where there is a
/// GPU: one of the children must print rank 0's result.
fn gpu_job_started_by_hand(
    name: &str,
    start: impl FnOnce(&std::path::Path) -> Option<Vec<std::process::Child>>,
) {
    if in_rank(launched_body) {
        return;
    }
    if !common::gpu::gpu_here(name) {
        return;
    }
    let Some(children) = start(&std::env::current_exe().unwrap()) else {
        return;
    };
    let all = wait_all(children).join("\n");
    assert!(all.contains("RESULT 0 of 2: [0.5, 1.5]"), "{all}");
}

#[test]
fn torchrun_variables_set_by_hand_start_a_gpu_world_of_processes() {
    const NAME: &str = "torchrun_variables_set_by_hand_start_a_gpu_world_of_processes";
    gpu_job_started_by_hand(NAME, |exe| {
        let run_id = format!("cuda-processes-{}", std::process::id());
        let children = (0..2)
            .map(|r| {
                let mut c = Command::new(exe);
                c.args(test_args(NAME)).stdout(Stdio::piped()).stderr(Stdio::piped());
                c.env("RANK", r.to_string())
                    .env("WORLD_SIZE", "2")
                    .env("LOCAL_RANK", r.to_string())
                    .env("LOCAL_WORLD_SIZE", "2")
                    .env("MASTER_ADDR", "127.0.0.1")
                    .env("MASTER_PORT", "29500")
                    .env("TORCHELASTIC_RUN_ID", &run_id)
                    .env("DIST_TENSOR_DEVICE", "cuda")
                    .env("DIST_TENSOR_GPU_HEAP_BYTES", HEAP)
                    .spawn()
                    .unwrap()
            })
            .collect();
        Some(children)
    });
}

#[test]
fn mpirun_starts_a_gpu_world_of_processes_without_the_mpi_feature() {
    const NAME: &str = "mpirun_starts_a_gpu_world_of_processes_without_the_mpi_feature";
    gpu_job_started_by_hand(NAME, |exe| {
        if cfg!(feature = "mpi") {
            println!("SKIPPED {NAME}: an mpi build joins through MPI itself");
            return None;
        }
        let Ok(mpirun) = which("mpirun") else {
            println!("SKIPPED {NAME}: no mpirun on this machine");
            return None;
        };
        let mut c = Command::new(mpirun);
        c.args(["-np", "2", "--allow-run-as-root", "--oversubscribe"])
            .args(["-x", "DIST_TENSOR_DEVICE=cuda", "-x"])
            .arg(format!("DIST_TENSOR_GPU_HEAP_BYTES={HEAP}"))
            .arg(exe)
            .args(test_args(NAME))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        Some(vec![c.spawn().unwrap()])
    });
}

fn which(program: &str) -> Result<std::path::PathBuf, Error> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join(program))
        .find(|p| p.is_file())
        .ok_or_else(|| Error::user(format!("{program} not found")))
}

// ---- without a GPU ------------------------------------------------------------------------------

#[test]
fn without_a_gpu_every_process_of_a_cuda_job_says_why_at_once() {
    const NAME: &str = "without_a_gpu_every_process_of_a_cuda_job_says_why_at_once";
    if in_rank(|world| Ok(format!("a world on {:?}", world.run(|rank| Ok(rank.device()))?))) {
        return;
    }
    if cuda::device_count().is_ok_and(|n| n > 0) {
        println!("SKIPPED {NAME}: this machine has a GPU (the other tests cover it)");
        return;
    }
    let start = Instant::now();
    let exits = World::local_job(2)
        .args(test_args(NAME))
        .env("DIST_TENSOR_DEVICE", "cuda")
        .timeout(CHILD_TIMEOUT)
        .run()
        .unwrap();
    // Well before the 60 s join timeout: a rank that cannot open its GPU fails the job at once.
    assert!(start.elapsed() < Duration::from_secs(30), "{:?}", start.elapsed());
    for exit in &exits {
        let err = printed(exit, "ERROR").unwrap_or_else(|| {
            panic!("rank {}: {}{}", exit.rank, exit.stdout_text(), exit.stderr_text())
        });
        // No GPU library (a `cuda` build), or no GPU backend at all (a default build).
        assert!(
            err.contains("libcuda") || err.contains("--features cuda") || err.contains("GPU"),
            "rank {}: {err}",
            exit.rank
        );
        println!("rank {}: {err}", exit.rank);
    }
}
