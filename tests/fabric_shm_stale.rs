//! A region left in /dev/shm by a dead process that had this pid must not make our shm
//! endpoint fail (libfabric 1.17's shm names regions `<pid>:<domain>:<endpoint>`).

use fabric_ep::fabric::{InfoQuery, Stack};

#[test]
fn stale_shm_region_with_our_pid_is_removed() {
    let stale = format!("/dev/shm/{}:0:0", std::process::id());
    std::fs::write(&stale, b"left by a dead process").expect("create a stale region name");
    let stack =
        Stack::open(&InfoQuery::provider("shm"), 1).expect("shm endpoint despite the stale name");
    assert!(stack.ep.name().is_ok());
    drop(stack);
    assert!(
        !std::path::Path::new(&stale).exists()
            || std::fs::read(&stale).map(|b| b != b"left by a dead process").unwrap_or(true)
    );
}
