//! Environment settings a world refuses rather than misreads (its own test binary: the
//! environment is process-wide).

use dist_tensor::World;
use dist_tensor::shmem::WAIT_TIMEOUT_ENV;
use dist_tensor::tensor::POOL_BYTES_ENV;

#[test]
fn a_zero_wait_timeout_or_a_garbage_pool_size_from_the_environment_is_an_error() {
    // SAFETY: this binary's only test; no other thread reads the environment meanwhile.
    unsafe { std::env::set_var(WAIT_TIMEOUT_ENV, "0") };
    let err = World::threads(2).unwrap_err().to_string();
    assert!(err.contains("DIST_TENSOR_WAIT_TIMEOUT_MS=0"), "{err}");
    // SAFETY: as above.
    unsafe { std::env::remove_var(WAIT_TIMEOUT_ENV) };

    // SAFETY: as above.
    unsafe { std::env::set_var(POOL_BYTES_ENV, "a lot") };
    let err = World::threads(2).unwrap_err().to_string();
    assert!(err.contains("DIST_TENSOR_POOL_BYTES=\"a lot\" is not a whole number"), "{err}");
    // SAFETY: as above.
    unsafe { std::env::remove_var(POOL_BYTES_ENV) };
    assert_eq!(World::threads(2).unwrap().num_ranks(), 2);
}
