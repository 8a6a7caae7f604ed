//! The host runtime: signals, symmetric memory, barriers, failure handling.

use std::time::{Duration, Instant};

use dist_tensor::device::tile;
use dist_tensor::error::ProgramLabel;
use dist_tensor::shmem::{NotifySem, Scope, SignalOp, WaitCmp, WaitSem, consume_token, symm_at};
use dist_tensor::{Error, World};

/// The value rank `from` sends rank `to` in `round`.
fn ping_payload(from: usize, to: usize, round: u64) -> f64 {
    (round * 10_000 + from as u64 * 100 + to as u64) as f64
}

/// Every rank pings every other, 20 rounds: it writes a payload into the peer's `inbox` through
/// `symm_at`, then notifies; the peer waits for the ping, reads the payload, echoes what it read
/// into the sender's `echo` and answers with a pong; the sender waits for the pong and checks
/// the echo. A wait that returns before its signal is set reads the previous round's payload (or
/// nothing): every round one rank is 2 ms late with its pings, so that its peers are surely
/// waiting when they come.
#[test]
fn signals_ping_pong_between_every_pair_of_ranks() {
    const ROUNDS: u64 = 20;
    for n in [2, 3, 5, 8] {
        let fails = World::threads(n)
            .unwrap()
            .run(|rank| {
                let me = rank.rank();
                // Signal `peer` of rank r counts the pings from `peer`; each rank answers each.
                let ping = rank.alloc_signals(n)?;
                let pong = rank.alloc_signals(n)?;
                // `inbox[p]` of rank r: what p sent r this round; `echo[p]`: what p read from r.
                let inbox = rank.alloc::<f64>(n)?;
                let echo = rank.alloc::<f64>(n)?;
                let mut got = [0.0f64];
                let mut fails = Vec::new();
                for round in 1..=ROUNDS {
                    if me == round as usize % n {
                        std::thread::sleep(Duration::from_millis(2));
                    }
                    for i in 1..n {
                        let peer = (me + i) % n;
                        // SAFETY: `peer` reads this slot only after the ping below, and answered
                        // the previous round's ping (the pong this rank waited for) after reading.
                        unsafe {
                            tile::store_1d(
                                symm_at(&inbox, peer) + me,
                                &[ping_payload(me, peer, round)],
                                1,
                            )
                        };
                        rank.notify(
                            &ping,
                            me,
                            peer,
                            SignalOp::Add(1),
                            Scope::Peer,
                            NotifySem::Release,
                        )?;
                    }
                    // Answer every ping of this round, then wait for every answer.
                    for i in 1..n {
                        let peer = (me + n - i) % n;
                        let token = rank.wait(&ping, peer, WaitCmp::Ge(round), WaitSem::Acquire)?;
                        // SAFETY: `peer` wrote the slot before its release notify, acquired above.
                        unsafe {
                            tile::load_1d(
                                consume_token(inbox.ptr(), token) + peer,
                                &mut got,
                                1,
                                f64::NAN,
                            )
                        };
                        if got[0] != ping_payload(peer, me, round) {
                            fails.push(format!(
                                "world {n}, rank {me}, round {round}: the ping from {peer} \
                                 carried {}, want {}",
                                got[0],
                                ping_payload(peer, me, round)
                            ));
                        }
                        // SAFETY: `peer` reads its echo slot only after the pong below, and
                        // read the previous one before sending this round's ping.
                        unsafe { tile::store_1d(symm_at(&echo, peer) + me, &got, 1) };
                        rank.notify(
                            &pong,
                            me,
                            peer,
                            SignalOp::Set(round),
                            Scope::Peer,
                            NotifySem::Release,
                        )?;
                    }
                    for i in 1..n {
                        let peer = (me + i) % n;
                        let token = rank.wait(&pong, peer, WaitCmp::Ge(round), WaitSem::Acquire)?;
                        // SAFETY: `peer` wrote the echo before its release notify, acquired above.
                        unsafe {
                            tile::load_1d(
                                consume_token(echo.ptr(), token) + peer,
                                &mut got,
                                1,
                                f64::NAN,
                            )
                        };
                        if got[0] != ping_payload(me, peer, round) {
                            fails.push(format!(
                                "world {n}, rank {me}, round {round}: {peer} echoed {}, want {}",
                                got[0],
                                ping_payload(me, peer, round)
                            ));
                        }
                    }
                }
                let _ = rank.barrier_all()?;
                Ok(fails)
            })
            .unwrap_or_else(|e| panic!("world {n}: {e}"));
        let fails: Vec<String> = fails.into_iter().flatten().collect();
        assert!(
            fails.is_empty(),
            "{} failures:\n{}",
            fails.len(),
            fails[..fails.len().min(10)].join("\n")
        );
    }
}

/// Every rank sends to its right neighbour through `symm_at`, 10,000 rounds, with a full/empty
/// handshake; every payload must arrive exactly.
#[test]
fn producer_store_then_release_is_seen_by_acquire_exactly() {
    const ROUNDS: u64 = 10_000;
    const WORDS: usize = 67; // odd on purpose
    for n in 2..=8 {
        let received = World::threads(n)
            .unwrap()
            .run(|rank| {
                let (me, right, left) =
                    (rank.rank(), (rank.rank() + 1) % n, (rank.rank() + n - 1) % n);
                let slot = rank.alloc::<f64>(WORDS)?;
                let full = rank.alloc_signals(1)?;
                let empty = rank.alloc_signals(1)?;
                let mut payload = vec![0.0f64; WORDS];
                let mut got = vec![0.0f64; WORDS];
                let mut checked = 0u64;
                for round in 1..=ROUNDS {
                    // Wait until the right neighbour has read the previous round.
                    if round > 1 {
                        let _ = rank.wait(&empty, 0, WaitCmp::Ge(round - 1), WaitSem::Acquire)?;
                    }
                    for (w, p) in payload.iter_mut().enumerate() {
                        *p = (round * 1000 + me as u64) as f64 + w as f64 / 128.0;
                    }
                    // SAFETY: the right neighbour reads the slot only after `full`, and released it
                    // (through `empty`) before this round.
                    unsafe { tile::store_1d(symm_at(&slot, right), &payload, WORDS) };
                    rank.notify(
                        &full,
                        0,
                        right,
                        SignalOp::Set(round),
                        Scope::Peer,
                        NotifySem::Release,
                    )?;

                    let token = rank.wait(&full, 0, WaitCmp::Eq(round), WaitSem::Acquire)?;
                    let slot_data = consume_token(slot.ptr(), token);
                    // SAFETY: the left neighbour wrote the slot before its release notify.
                    unsafe { tile::load_1d(slot_data, &mut got, WORDS, f64::NAN) };
                    for (w, &g) in got.iter().enumerate() {
                        let want = (round * 1000 + left as u64) as f64 + w as f64 / 128.0;
                        assert_eq!(g, want, "rank {me} round {round} word {w}");
                    }
                    checked += 1;
                    rank.notify(
                        &empty,
                        0,
                        left,
                        SignalOp::Set(round),
                        Scope::Peer,
                        NotifySem::Release,
                    )?;
                }
                let _ = rank.barrier_all()?;
                Ok(checked)
            })
            .unwrap_or_else(|e| panic!("world {n}: {e}"));
        assert_eq!(received, vec![ROUNDS; n]);
    }
}

#[test]
fn barrier_all_repeated_a_thousand_times() {
    for n in 1..=8 {
        let counts = World::threads(n)
            .unwrap()
            .run(|rank| {
                // Each rank bumps its counter between barriers; after each barrier every rank
                // must see every counter at the same round.
                let counter = rank.alloc::<f64>(1)?;
                let mut seen = vec![0.0f64; 1];
                for round in 1..=1000u32 {
                    // SAFETY: peers read the counter only between the two barriers of a round.
                    unsafe { tile::store_1d(counter.ptr(), &[round as f64], 1) };
                    let token = rank.barrier_all()?;
                    for peer in 0..n {
                        let theirs = consume_token(symm_at(&counter, peer), token);
                        // SAFETY: written before the barrier; rewritten only after the next one.
                        unsafe { tile::load_1d(theirs, &mut seen, 1, 0.0) };
                        assert_eq!(seen[0], round as f64, "round {round}, peer {peer}");
                    }
                    // Nobody may overwrite a counter before everyone has read it.
                    let _ = rank.barrier_all()?;
                }
                Ok(1000)
            })
            .unwrap_or_else(|e| panic!("world {n}: {e}"));
        assert_eq!(counts, vec![1000; n]);
    }
}

#[test]
fn allocations_have_equal_offsets_on_every_rank() {
    let offsets = World::threads(4)
        .unwrap()
        .run(|rank| {
            let a = rank.alloc::<f32>(1)?;
            let b = rank.alloc::<half::bf16>(1001)?;
            let s = rank.alloc_signals(7)?;
            let c = rank.alloc::<f64>(0)?;
            drop(b);
            let d = rank.alloc::<f32>(10)?; // reuses b's space
            let offsets = vec![a.offset(), c.offset(), d.offset()];
            drop(s);
            Ok(offsets)
        })
        .unwrap();
    assert!(offsets.iter().all(|o| o == &offsets[0]), "{offsets:?}");
    assert_ne!(offsets[0][0], offsets[0][1]);
}

#[test]
fn allocations_that_differ_across_ranks_are_an_error() {
    let err = World::threads(2)
        .unwrap()
        .run(|rank| rank.alloc::<f32>(if rank.rank() == 0 { 100 } else { 1000 }).map(|_| ()))
        .unwrap_err();
    let text = err.to_string();
    assert!(text.contains("symmetric allocation differs across ranks in call #1"), "{text}");
}

#[test]
fn heap_exhaustion_names_the_request_and_what_is_left() {
    let world = World::builder(3).heap_capacity(1 << 20).build().unwrap();
    let err = world
        .run(|rank| {
            let _kept = rank.alloc::<f32>(200_000)?; // 800,000 bytes
            rank.alloc::<f32>(100_000).map(|_| ()) // 400,000 more: does not fit
        })
        .unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, Error::RankFailed { .. }), "{err:?}");
    assert!(text.contains("symmetric memory exhausted"), "{text}");
    assert!(text.contains("asked for 400000 bytes"), "{text}");
    assert!(text.contains(&format!("free of {}", world.heap_capacity())), "{text}");
}

#[test]
fn wait_timeout_error_names_rank_program_signal_and_values() {
    let world = World::builder(2).wait_timeout(Duration::from_millis(50)).build().unwrap();
    let start = Instant::now();
    let err = world
        .run(|rank| {
            let sigs = rank.alloc_signals(4)?;
            if rank.rank() == 1 {
                rank.notify(&sigs, 3, 1, SignalOp::Set(2), Scope::Device, NotifySem::Release)?;
                rank.wait(&sigs, 3, WaitCmp::Ge(5), WaitSem::Acquire).map(|_| ())
            } else {
                // Rank 0 does not wait: with the same 50 ms timeout its own wait would race rank
                // 1's to fail first (the panic-on-rank-2 test covers waiters being released). It
                // stays in `run` past rank 1's timeout: a rank that returned would end rank 1's
                // wait at once instead (tests/reliability.rs).
                std::thread::sleep(Duration::from_millis(300));
                Ok(())
            }
        })
        .unwrap_err();
    let text = err.to_string();
    assert!(start.elapsed() < Duration::from_secs(5));
    assert_eq!(
        text,
        "rank 1 failed first: rank 1, program host: wait on signal 3 timed out after 50ms: \
         awaited >= 5, saw 2"
    );
}

#[test]
fn wait_timeout_inside_a_kernel_names_the_program() {
    let world = World::builder(1).wait_timeout(Duration::from_millis(20)).build().unwrap();
    let err = world
        .run(|rank| {
            let sigs = rank.alloc_signals(1)?;
            dist_tensor::device::launch(rank, dist_tensor::device::LaunchMode::VectorOnly, 3, |p| {
                if p.program_id() == 2 {
                    let _ = p.wait(&sigs, 0, WaitCmp::Eq(1), WaitSem::Relaxed)?;
                }
                Ok(())
            })
        })
        .unwrap_err();
    match err {
        Error::RankFailed { rank: 0, reason, .. } => {
            assert!(reason.contains("program 2 (sub_vec 0): wait on signal 0"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
    let _ = ProgramLabel::Host;
}

#[test]
fn a_panic_on_rank_2_of_4_fails_every_rank_within_the_timeout() {
    let timeout = Duration::from_secs(30);
    let world = World::builder(4).wait_timeout(timeout).build().unwrap();
    let start = Instant::now();
    let err = world
        .run(|rank| {
            let sigs = rank.alloc_signals(1)?;
            if rank.rank() == 2 {
                panic!("rank two gives up");
            }
            // Wait for a signal rank 2 will never send: must be released by its failure.
            let _ = rank.wait(&sigs, 0, WaitCmp::Eq(1), WaitSem::Acquire)?;
            Ok(())
        })
        .unwrap_err();
    assert!(start.elapsed() < Duration::from_secs(5), "took {:?}", start.elapsed());
    match &err {
        Error::RankFailed { rank: 2, reason, .. } => assert!(reason.contains("rank two gives up")),
        other => panic!("{other:?}"),
    }
    // The world stays failed.
    let again = world.run(|_| Ok(())).unwrap_err();
    assert!(matches!(again, Error::RankFailed { rank: 2, .. }), "{again:?}");
}

#[test]
fn a_panicking_program_fails_the_launch_and_the_world() {
    let err = World::threads(2)
        .unwrap()
        .run(|rank| {
            let sigs = rank.alloc_signals(1)?;
            dist_tensor::device::launch(rank, dist_tensor::device::LaunchMode::Mix, 2, |p| {
                if rank.rank() == 1 && p.program_id() == 1 && p.sub_vec_id() == 0 {
                    let tiny = [0.0f32; 2];
                    let mut out = [0.0f32; 4];
                    // Out of bounds: the tile op panics instead of reading past the end.
                    let src = dist_tensor::shmem::GlobalPtr::from_slice(&tiny);
                    // SAFETY: local arrays only; the bounds check panics before any access.
                    unsafe { tile::load_1d(src, &mut out, 4, 0.0) };
                }
                // Everyone else waits for a signal that never comes.
                let _ = p.wait(&sigs, 0, WaitCmp::Eq(1), WaitSem::Acquire)?;
                Ok(())
            })
        })
        .unwrap_err();
    let text = err.to_string();
    assert!(
        text.starts_with("rank 1 failed first: rank 1, program 1 (sub_vec 0): kernel panicked"),
        "{text}"
    );
    assert!(text.contains("needs 4 elements, 2 available"), "{text}");
}

#[test]
fn two_launches_in_a_row_reuse_signals_without_a_reset_barrier() {
    const LEN: usize = 1000;
    const BLOCK: usize = 64;
    let n = 4;
    let sums = World::threads(n)
        .unwrap()
        .run(|rank| {
            let me = rank.rank();
            // Two halves, by epoch parity: a fast peer may push epoch 2 while we still read epoch 1.
            let inbox = rank.alloc::<f32>(2 * n * LEN)?;
            let arrived = rank.alloc_signals(n)?;
            let mut sums = Vec::new();
            for epoch in 1..=2u64 {
                let data: Vec<f32> =
                    (0..LEN).map(|i| (epoch as usize * 10_000 + me * 1000 + i) as f32).collect();
                let src = dist_tensor::shmem::GlobalPtr::from_slice(&data);
                let half = (epoch as usize % 2) * n * LEN;
                let mut total = vec![0.0f64; n];
                let totals = std::sync::Mutex::new(&mut total);
                // SAFETY: each peer's block of the inbox is written by that peer alone, and read
                // only after its epoch signal is acquired.
                unsafe {
                    dist_tensor::device::launch(
                        rank,
                        dist_tensor::device::LaunchMode::Mix,
                        2,
                        |p| {
                            if p.sub_vec_id() == 0 {
                                // Push my row to every peer, rotated, then signal the epoch.
                                for i in p.tasks(n) {
                                    let peer = (me + i) % n;
                                    for b in 0..LEN.div_ceil(BLOCK) {
                                        let start = b * BLOCK;
                                        let valid = tile::valid_len(start, BLOCK, LEN);
                                        tile::copy_2d(
                                            symm_at(&inbox, peer) + (half + me * LEN + start),
                                            LEN,
                                            src + start,
                                            LEN,
                                            (1, valid),
                                        );
                                    }
                                    p.notify(
                                        &arrived,
                                        me,
                                        peer,
                                        SignalOp::Set(epoch),
                                        Scope::Peer,
                                        NotifySem::Release,
                                    )?;
                                }
                            } else {
                                for peer in p.tasks_on_sub_vecs(1, n) {
                                    let token = p.wait(
                                        &arrived,
                                        peer,
                                        WaitCmp::Ge(epoch),
                                        WaitSem::Acquire,
                                    )?;
                                    let row =
                                        consume_token(inbox.ptr(), token) + (half + peer * LEN);
                                    let mut got = vec![0.0f32; LEN];
                                    tile::load_1d(row, &mut got, LEN, 0.0);
                                    totals.lock().unwrap()[peer] =
                                        got.iter().map(|&x| x as f64).sum();
                                }
                            }
                            Ok(())
                        },
                    )?;
                }
                sums.push(total);
                // No barrier and no reset between the launches: the signals carry the epoch, and
                // the second launch waits for `>= 2`, so it never mistakes epoch 1 for epoch 2.
            }
            let _ = rank.barrier_all()?;
            Ok(sums)
        })
        .unwrap();
    for (me, per_epoch) in sums.iter().enumerate() {
        for (e, totals) in per_epoch.iter().enumerate() {
            for (peer, &t) in totals.iter().enumerate() {
                let base = ((e + 1) * 10_000 + peer * 1000) as f64;
                let want = base * LEN as f64 + (LEN * (LEN - 1) / 2) as f64;
                assert_eq!(t, want, "rank {me} epoch {} from peer {peer}", e + 1);
            }
        }
    }
}

#[test]
fn symm_at_own_rank_is_the_local_buffer_and_device_scope_stays_local() {
    World::threads(3)
        .unwrap()
        .run(|rank| {
            let buf = rank.alloc::<f32>(16)?;
            assert_eq!(symm_at(&buf, rank.rank()), buf.ptr());
            assert_ne!(symm_at(&buf, (rank.rank() + 1) % 3), buf.ptr());
            let sigs = rank.alloc_signals(1)?;
            let err = rank
                .notify(
                    &sigs,
                    0,
                    (rank.rank() + 1) % 3,
                    SignalOp::Set(1),
                    Scope::Device,
                    NotifySem::Relaxed,
                )
                .unwrap_err();
            assert!(err.to_string().contains("with scope Device"), "{err}");
            let err = rank
                .notify(&sigs, 1, 0, SignalOp::Set(1), Scope::Peer, NotifySem::Relaxed)
                .unwrap_err();
            assert!(
                err.to_string().contains("signal index 1 is out of range for 1 signals"),
                "{err}"
            );
            Ok(())
        })
        .unwrap();
}

/// A launch from inside a kernel would need the rank's program threads, which are busy running
/// the outer launch: an error, not a deadlock.
#[test]
fn a_launch_inside_a_kernel_is_an_error() {
    let err = World::threads(1)
        .unwrap()
        .run(|rank| {
            dist_tensor::device::launch(
                rank,
                dist_tensor::device::LaunchMode::VectorOnly,
                2,
                |_| {
                    dist_tensor::device::launch(
                        rank,
                        dist_tensor::device::LaunchMode::VectorOnly,
                        2,
                        |_| Ok(()),
                    )
                },
            )
        })
        .unwrap_err();
    assert!(err.to_string().contains("already in use on this rank"), "{err}");
}

#[test]
fn a_run_inside_a_run_is_an_error_not_a_deadlock() {
    let world = World::threads(2).unwrap();
    let inner = world.run(|_rank| Ok(world.run(|_| Ok(())).unwrap_err().to_string())).unwrap();
    assert!(inner[0].contains("already running"), "{}", inner[0]);
    world.run(|_| Ok(())).unwrap(); // and the world still works
}
