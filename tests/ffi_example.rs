//! The C library as a user gets it: `make install` into a temporary prefix, the installed files'
//! contract (SONAME, RUNPATH, exports = the header's functions, pkg-config and CMake files), and
//! the C examples (ffi/examples/roundtrip.c, a dispatch/combine round trip on the host backend;
//! ffi/examples/ep_shapes.c, DeepEP's per-call shape: two normal shapes and a low-latency one on
//! one `fep_ep`) built against the prefix through pkg-config, shared and static, and through
//! CMake, then run with 1 to 4 forked ranks without LD_LIBRARY_PATH.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// target/<profile>, where `cargo build --lib` puts the C libraries: cargo runs this test from
/// target/<profile>/deps.
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    exe.parent().and_then(Path::parent).expect("profile dir").to_path_buf()
}

fn output(cmd: &mut Command) -> Output {
    let out = cmd.output().unwrap_or_else(|e| panic!("run {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn stdout(cmd: &mut Command) -> String {
    String::from_utf8(output(cmd).stdout).expect("utf-8 output")
}

/// `make install PREFIX=<tmp>` once per test binary, with the profile `cargo test` built (its
/// `lib` step is `cargo build --lib --no-default-features` of that profile: the shipped library,
/// without the bench kernels, a build of its own the first time).
fn prefix() -> &'static Path {
    static PREFIX: OnceLock<PathBuf> = OnceLock::new();
    PREFIX.get_or_init(|| {
        let prefix = Path::new(env!("CARGO_TARGET_TMPDIR")).join("ffi-install");
        let _ = std::fs::remove_dir_all(&prefix);
        let dir = profile_dir();
        let profile = if dir.file_name().and_then(|n| n.to_str()) == Some("release") {
            "release"
        } else {
            "debug"
        };
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        output(
            Command::new("make")
                .args(["-s", "--no-print-directory", "install"])
                .arg(format!("PREFIX={}", prefix.display()))
                .arg(format!("PROFILE={profile}"))
                .arg(format!("CARGO={cargo}"))
                .env("CARGO_TARGET_DIR", dir.parent().expect("target dir"))
                .current_dir(root()),
        );
        prefix
    })
}

fn lib() -> PathBuf {
    prefix().join("lib")
}

/// pkg-config over the prefix only (a system-wide fabric_ep must not stand in for it).
fn pkg_config(args: &[&str]) -> Vec<String> {
    let out = stdout(
        Command::new("pkg-config")
            .args(args)
            .env("PKG_CONFIG_PATH", lib().join("pkgconfig"))
            .env_remove("PKG_CONFIG_LIBDIR"),
    );
    out.split_whitespace().map(str::to_string).collect()
}

fn readelf_dynamic(file: &Path) -> String {
    stdout(Command::new("readelf").arg("-d").arg(file))
}

/// The functions ffi/include/fabric_ep.h declares (declarations start in column 0).
fn header_functions() -> BTreeSet<String> {
    let text = std::fs::read_to_string(root().join("ffi/include/fabric_ep.h")).unwrap();
    let mut names = BTreeSet::new();
    for line in text.lines() {
        if !line.starts_with(|c: char| c.is_ascii_alphabetic()) || line.starts_with("typedef") {
            continue;
        }
        // The name is the identifier right before the first parenthesis.
        let Some(paren) = line.find('(') else { continue };
        let head = line[..paren].trim_end();
        let start =
            head.rfind(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).map_or(0, |i| i + 1);
        if head[start..].starts_with("fep_") {
            names.insert(head[start..].to_string());
        }
    }
    names
}

fn build_pkg_config(out: &Path, package: &str) {
    build_example(out, package, "roundtrip.c")
}

fn build_example(out: &Path, package: &str, source: &str) {
    let flags = pkg_config(&["--cflags", "--libs", package]);
    output(
        Command::new("cc")
            .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-O1"])
            .arg(root().join("ffi/examples").join(source))
            .args(&flags)
            .arg("-o")
            .arg(out),
    );
}

/// Runs the round-trip example with `ranks` forked ranks, with no library path from the
/// environment.
fn run(exe: &Path, ranks: usize) {
    run_checked(exe, ranks, "combine == x * destinations");
}

/// Runs the shapes example likewise.
fn run_shapes(exe: &Path, ranks: usize) {
    run_checked(exe, ranks, "3 shapes on one fep_ep");
}

/// Runs an example with `ranks` forked ranks; every rank must print `per_rank`.
fn run_checked(exe: &Path, ranks: usize, per_rank: &str) {
    let out = Command::new(exe)
        .arg(ranks.to_string())
        .env_remove("RANK")
        .env_remove("LD_LIBRARY_PATH")
        .output()
        .expect("run the C example");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{exe:?} {ranks}: {}\n{stdout}\n{stderr}", out.status);
    assert!(stdout.contains(&format!("ok: {ranks} ranks")), "{stdout}");
    assert_eq!(stdout.matches(per_rank).count(), ranks, "{stdout}");
}

fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn installed_library_has_soname_runpath_and_exports_only_the_header() {
    let lib = lib();
    for f in [
        "libfabric_ep.so.0",
        "libfabric_ep.so",
        "libfabric_ep.a",
        "pkgconfig/fabric_ep.pc",
        "pkgconfig/fabric_ep-static.pc",
        "cmake/fabric_ep/fabric_epConfig.cmake",
        "cmake/fabric_ep/fabric_epConfigVersion.cmake",
    ] {
        assert!(lib.join(f).exists(), "make install did not install lib/{f}");
    }
    assert!(prefix().join("include/fabric_ep.h").is_file());
    assert_eq!(
        std::fs::read_link(lib.join("libfabric_ep.so")).unwrap(),
        Path::new("libfabric_ep.so.0")
    );
    let real = std::fs::read_link(lib.join("libfabric_ep.so.0")).unwrap();
    assert!(real.to_string_lossy().starts_with("libfabric_ep.so.0."), "{real:?}");
    assert!(lib.join(&real).is_file());

    let dynamic = readelf_dynamic(&lib.join("libfabric_ep.so.0"));
    assert!(dynamic.contains("Library soname: [libfabric_ep.so.0]"), "{dynamic}");
    assert!(dynamic.contains("(RUNPATH)") && dynamic.contains("[$ORIGIN]"), "{dynamic}");

    let nm = stdout(
        Command::new("nm").args(["-D", "--defined-only"]).arg(lib.join("libfabric_ep.so.0")),
    );
    let exported: BTreeSet<String> = nm
        .lines()
        .filter_map(|l| l.split_whitespace().nth(2))
        .map(|s| s.split('@').next().unwrap_or(s).to_string())
        .collect();
    let declared = header_functions();
    assert!(declared.len() >= 30, "parsed too few declarations from the header: {declared:?}");
    assert_eq!(exported, declared, "exported symbols (left) differ from the header's functions");
}

#[test]
fn pkg_config_shared_link_runs_without_library_path() {
    let libs = pkg_config(&["--libs", "fabric_ep"]);
    let rpath = format!("-Wl,-rpath,{}", lib().display());
    assert!(libs.contains(&rpath), "{libs:?}");
    // --static adds what libfabric_ep.a needs: libfabric and the Rust runtime's libraries.
    let static_libs = pkg_config(&["--static", "--libs", "fabric_ep"]);
    for l in ["-lfabric", "-lpthread", "-ldl", "-lgcc_s"] {
        assert!(static_libs.iter().any(|s| s == l), "{l} missing from {static_libs:?}");
    }
    let dir = scratch("ffi-pkg-shared");
    let exe = dir.join("roundtrip");
    build_pkg_config(&exe, "fabric_ep");
    let dynamic = readelf_dynamic(&exe);
    assert!(dynamic.contains("Shared library: [libfabric_ep.so.0]"), "{dynamic}");
    assert!(dynamic.contains(&lib().display().to_string()), "no run path to the prefix: {dynamic}");
    run(&exe, 1);
    run(&exe, 4);
    let shapes = dir.join("ep_shapes");
    build_example(&shapes, "fabric_ep", "ep_shapes.c");
    run_shapes(&shapes, 1);
    run_shapes(&shapes, 4);
}

#[test]
fn pkg_config_static_link_needs_no_fabric_ep_library() {
    let dir = scratch("ffi-pkg-static");
    let exe = dir.join("roundtrip_static");
    build_pkg_config(&exe, "fabric_ep-static");
    let dynamic = readelf_dynamic(&exe);
    assert!(
        !dynamic.contains("libfabric_ep"),
        "the static build needs the shared library: {dynamic}"
    );
    assert!(dynamic.contains("libfabric.so"), "{dynamic}");
    run(&exe, 1);
    run(&exe, 2);
    let shapes = dir.join("ep_shapes_static");
    build_example(&shapes, "fabric_ep-static", "ep_shapes.c");
    assert!(!readelf_dynamic(&shapes).contains("libfabric_ep"));
    run_shapes(&shapes, 2);
}

#[test]
fn cmake_package_links_shared_and_static() {
    if Command::new("cmake").arg("--version").output().is_err() {
        // scripts/setup.sh installs cmake; a machine set up otherwise says so here.
        eprintln!("SKIPPED cmake_package_links_shared_and_static: no cmake on PATH");
        return;
    }
    let dir = scratch("ffi-cmake");
    output(
        Command::new("cmake")
            .arg("-S")
            .arg(root().join("ffi/examples"))
            .arg("-B")
            .arg(&dir)
            .arg(format!("-DCMAKE_PREFIX_PATH={}", prefix().display())),
    );
    output(Command::new("cmake").arg("--build").arg(&dir));
    let shared = dir.join("roundtrip");
    let stat = dir.join("roundtrip_static");
    assert!(readelf_dynamic(&shared).contains("[libfabric_ep.so.0]"));
    assert!(!readelf_dynamic(&stat).contains("libfabric_ep"));
    run(&shared, 2);
    run(&stat, 4);
    run_shapes(&dir.join("ep_shapes"), 2);
    run_shapes(&dir.join("ep_shapes_static"), 1);
}
