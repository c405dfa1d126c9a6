//! Helpers shared by ep-bench's integration tests (`mod common;` in each tests/*.rs). fabric-ep's
//! own test helpers are in the repository's tests/common/.

// Every tests/*.rs is its own crate and uses only some of these helpers.
#![allow(dead_code)]

use std::process::Command;

/// The ep-bench binary of this build, which never joins an outer job by accident (the launcher's
/// variables are removed).
pub fn ep_bench() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_ep-bench"));
    for v in ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]
    {
        c.env_remove(v);
    }
    c
}
