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
