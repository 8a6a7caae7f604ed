//! The wait timeout can be set by an environment variable (its own test binary: the environment is
//! process-wide).

use std::time::{Duration, Instant};

use dist_tensor::shmem::{WAIT_TIMEOUT_ENV, WaitCmp, WaitSem};
use dist_tensor::{Error, World};

#[test]
fn the_environment_sets_the_wait_timeout_and_code_overrides_it() {
    // SAFETY: this binary's only test; no other thread reads the environment meanwhile.
    unsafe { std::env::set_var(WAIT_TIMEOUT_ENV, "30") };
    let world = World::threads(1).unwrap();
    assert_eq!(world.wait_timeout(), Duration::from_millis(30));
    let start = Instant::now();
    let err = world
        .run(|rank| {
            let sigs = rank.alloc_signals(1)?;
            rank.wait(&sigs, 0, WaitCmp::Eq(1), WaitSem::Acquire).map(drop)
        })
        .unwrap_err();
    assert!(start.elapsed() < Duration::from_secs(5));
    assert!(err.to_string().contains("timed out after 30ms"), "{err}");

    let world = World::builder(1).wait_timeout(Duration::from_secs(2)).build().unwrap();
    assert_eq!(world.wait_timeout(), Duration::from_secs(2));

    // SAFETY: as above.
    unsafe { std::env::set_var(WAIT_TIMEOUT_ENV, "soon") };
    let err = World::threads(1).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err:?}");
    assert!(err.to_string().contains("\"soon\" is not a whole number"), "{err}");
    // SAFETY: as above.
    unsafe { std::env::remove_var(WAIT_TIMEOUT_ENV) };
}
