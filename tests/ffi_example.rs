//! Builds the C example against the library (shared and static) and runs its dispatch/combine
//! round trip on the host backend with 2 and 4 forked ranks.

use std::path::{Path, PathBuf};
use std::process::Command;

/// `cargo test` builds the library as an rlib only; build the cdylib and staticlib the example
/// links against (a no-op when they are fresh).
fn build_c_libraries() {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let profile = target_dir();
    let mut cmd = Command::new(cargo);
    cmd.args(["build", "--lib", "--quiet"]).current_dir(env!("CARGO_MANIFEST_DIR"));
    if profile.file_name().and_then(|n| n.to_str()) == Some("release") {
        cmd.arg("--release");
    }
    if let Some(t) = profile.parent() {
        cmd.env("CARGO_TARGET_DIR", t);
    }
    let st = cmd.status().expect("run cargo build --lib");
    assert!(st.success(), "cargo build --lib failed");
}

fn target_dir() -> PathBuf {
    // target/<profile>/ep-bench -> target/<profile>
    Path::new(env!("CARGO_BIN_EXE_ep-bench")).parent().expect("profile dir").to_path_buf()
}

fn build(out: &Path, static_link: bool) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let lib = target_dir();
    let mut cc = Command::new("cc");
    cc.args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-O1"])
        .arg("-I")
        .arg(root.join("ffi/include"))
        .arg(root.join("ffi/examples/roundtrip.c"))
        .arg("-o")
        .arg(out);
    if static_link {
        cc.arg(lib.join("libfabric_ep.a")).args([
            "-lfabric",
            "-lpthread",
            "-ldl",
            "-lm",
            "-lgcc_s",
        ]);
    } else {
        cc.arg(format!("-L{}", lib.display()))
            .arg("-lfabric_ep")
            .arg(format!("-Wl,-rpath,{}", lib.display()));
    }
    let st = cc.status().expect("run cc");
    assert!(st.success(), "building the C example failed");
}

fn run(exe: &Path, ranks: usize) {
    let out = Command::new(exe)
        .arg(ranks.to_string())
        .env_remove("RANK")
        .output()
        .expect("run the C example");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{exe:?} {ranks}: {stdout}\n{stderr}");
    assert!(stdout.contains(&format!("ok: {ranks} ranks")), "{stdout}");
    assert_eq!(stdout.matches("combine == x * destinations").count(), ranks, "{stdout}");
}

#[test]
fn c_example_shared_and_static() {
    let dir = std::env::temp_dir().join(format!("fep-c-example-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    build_c_libraries();
    let shared = dir.join("roundtrip_shared");
    let stat = dir.join("roundtrip_static");
    build(&shared, false);
    build(&stat, true);
    run(&shared, 2);
    run(&stat, 4);
    let _ = std::fs::remove_dir_all(&dir);
}
