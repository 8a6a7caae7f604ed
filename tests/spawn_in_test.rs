//! `World::spawn_local` inside a `#[test]`: each child re-runs only the test that started it,
//! not the whole suite.

use dist_tensor::World;

#[test]
fn spawn_local_in_a_test_reruns_only_that_test() {
    if World::launched() {
        let world = World::from_env().unwrap();
        let sizes = world.run(|rank| Ok(rank.num_ranks())).unwrap();
        println!("CHILD ran in a world of {}", sizes[0]);
        return;
    }
    let exits = World::spawn_local(2).unwrap();
    for exit in &exits {
        let out = exit.stdout_text();
        assert!(exit.success(), "rank {}: {out}\n{}", exit.rank, exit.stderr_text());
        assert!(out.contains("CHILD ran in a world of 2"), "rank {}: {out}", exit.rank);
        assert!(out.contains("running 1 test"), "rank {}: {out}", exit.rank);
        assert!(!out.contains("THE OTHER TEST RAN"), "rank {} ran the suite: {out}", exit.rank);
    }
}

#[test]
fn another_test_that_the_children_must_not_run() {
    if World::launched() {
        println!("THE OTHER TEST RAN");
    }
}

/// `World::from_args` with `--processes`: when one rank is killed, the parent's error names that
/// rank, not rank 0 (which then fails only because its peer is gone).
#[test]
fn from_args_names_the_rank_that_was_killed() {
    let mut args: Vec<String> = ["--processes", "3"].iter().map(|s| s.to_string()).collect();
    if World::launched() {
        let world = World::from_args(&mut args, 3).unwrap().unwrap();
        let out = world.run(|rank| {
            if rank.rank() == 2 {
                let me = rustix::process::getpid();
                rustix::process::kill_process(me, rustix::process::Signal::KILL).unwrap();
            }
            dist_tensor::collectives::all_gather(rank, &[1.0f32]).map(drop)
        });
        if out.is_err() {
            std::process::exit(1); // a rank that failed because rank 2 is gone
        }
        return;
    }
    let err = World::from_args(&mut args, 3).unwrap_err();
    match &err {
        dist_tensor::Error::RankFailed { rank, reason, failed_ranks, .. } => {
            assert_eq!(*rank, 2, "{err}");
            assert!(reason.contains("killed by signal 9"), "{err}");
            assert_eq!(failed_ranks, &[0, 1, 2], "{err}");
        }
        other => panic!("{other}"),
    }
    assert!(World::builder(usize::MAX).build().unwrap_err().to_string().contains("more than"));
}

/// A rank that enters a run its peer already failed in hears of that failure as of this run, not
/// "in an earlier run"; a later run does say earlier.
#[test]
fn a_failure_of_the_run_being_entered_is_not_called_earlier() {
    if World::launched() {
        let world = World::from_env().unwrap();
        world.run(|rank| rank.barrier_all().map(drop)).unwrap();
        let me = world.ranks_here().start;
        if me == 0 {
            std::thread::sleep(std::time::Duration::from_millis(300));
        }
        let second = world.run(|rank| {
            if rank.rank() == 1 {
                return Err(dist_tensor::Error::user(std::io::Error::other("rank 1 gives up")));
            }
            rank.barrier_all().map(drop)
        });
        println!("SECOND {}", second.unwrap_err());
        let third = world.run(|rank| rank.barrier_all().map(drop));
        println!("THIRD {}", third.unwrap_err());
        return;
    }
    let exits = World::spawn_local(2).unwrap();
    let line = |tag: &str| {
        let out = exits[0].stdout_text();
        out.lines().find_map(|l| l.strip_prefix(tag).map(str::to_string)).unwrap_or(out)
    };
    let second = line("SECOND ");
    assert!(second.contains("rank 1 gives up") && !second.contains("earlier"), "{second}");
    let third = line("THIRD ");
    assert!(third.contains("(in an earlier run) rank 1 gives up"), "{third}");
}
