//! Build script: the CUDA kernels and the Rust side of the CUDA/Rust ABI.
//!
//! 1. nvcc compiles every `kernels/*.cu` into ONE fatbin (sm_90 SASS + compute_90 PTX, more
//!    architectures through `FEP_CUDA_ARCHS`, e.g. "90,100") in `OUT_DIR`; `src/cuda/module.rs`
//!    embeds it with `include_bytes!` and loads it at run time through the driver API. The .cu files
//!    become one translation unit (a generated file that `#include`s each of them): one nvcc run,
//!    one module, no relocatable device code and device link step. Kernel files therefore keep
//!    their helpers in anonymous namespaces and their entry points `extern "C"` with unique names.
//!    The test kernels and the bench's baselines ([`BENCH_KERNEL_FILES`]) are compiled only with
//!    the `bench-kernels` feature (off by default, so the C library, `make install` and the
//!    Python module hold only what the library launches; ep-bench turns it on).
//! 2. bindgen turns `kernels/include/fep_abi.h` into `OUT_DIR/abi.rs` (`src/abi.rs` includes it).
//! 3. The C library's link arguments ([`c_library_link_args`]): SONAME and RUNPATH.
//!
//! Nothing links against libcuda or libcudart: cudarc loads libcuda at run time.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

const ENV_VARS: &[&str] = &[
    "NVCC",
    "CUDA_HOME",
    "CUDA_PATH",
    "PATH",
    "FEP_CUDA_ARCHS",
    "FEP_ALLOW_SPILLS",
    "NVCC_CCBIN",
    "FEP_TRACE_NORMAL",
];

/// kernels/*.cu compiled only with the `bench-kernels` feature: the device-wait and ring-push
/// test kernels (tests/gpu_device_wait.rs, the GPU bench's start gate), the proxy exchange and
/// ping-pong (tests/gpu_proxy.rs, ep-bench/examples/gpu_proxy_bench.rs), and the baselines
/// ep-bench compares with (NCCL's permute and un-permute, the copy kernel of its "copy" rows).
/// src/cuda/module.rs and src/cuda/launch.rs gate their kernels the same way.
const BENCH_KERNEL_FILES: &[&str] = &["baseline.cu", "proxy_test.cu", "test_kernels.cu"];

fn bench_kernels() -> bool {
    env::var_os("CARGO_FEATURE_BENCH_KERNELS").is_some()
}

/// `FEP_TRACE_NORMAL=1`: a diagnosis build whose normal-mode kernels carry trace points on their
/// proxy-lane chunks (kernels/normal_*.cu, `FEP_NP_TRACE`). Off by default: the kernels sit at
/// their register limit and the points made ptxas spill, so a traced build reports spills as a
/// warning instead of failing; the Rust side sees `cfg(fep_trace_normal)`.
fn trace_normal() -> bool {
    env::var("FEP_TRACE_NORMAL").is_ok_and(|v| v.trim() == "1")
}

fn main() {
    let root = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let out = PathBuf::from(env::var("OUT_DIR").expect("OUT_DIR"));
    for var in ENV_VARS {
        println!("cargo:rerun-if-env-changed={var}");
    }
    let kernels = root.join("kernels");
    println!("cargo:rerun-if-changed={}", kernels.display());
    let mut files = Vec::new();
    walk(&kernels, &mut files);
    for f in &files {
        println!("cargo:rerun-if-changed={}", f.display());
    }

    build_fatbin(&root, &out, &files);
    build_abi(&kernels, &out);
    c_library_link_args();
}

/// The cdylib is the C library `make install` ships as `libfabric_ep.so.0`:
/// - SONAME `libfabric_ep.so.0`: programs linked against it record this name and keep working
///   across compatible updates of the file behind it (a C ABI break bumps it, with
///   `FEP_ABI_VERSION`, which programs check at run time through `fep_abi_version()`);
/// - RUNPATH `$ORIGIN`: a libfabric (or other dependency) installed beside the library is found
///   without LD_LIBRARY_PATH (a container or tarball layout), the system's otherwise.
///
/// No version script of ours: rustc links every cdylib with its own (its `#[no_mangle]`
/// functions global, everything else local), and a second script given to the linker can add
/// globals but not take rustc's away, so it would constrain nothing. What the library exports
/// (exactly the `fep_*` functions of ffi/include/fabric_ep.h) is checked on the installed file
/// by tests/ffi_example.rs (`nm -D --defined-only`). GNU-style linkers only: Linux targets.
fn c_library_link_args() {
    if env::var("CARGO_CFG_TARGET_OS").as_deref() != Ok("linux") {
        return;
    }
    for arg in ["-Wl,-soname,libfabric_ep.so.0", "-Wl,-rpath,$ORIGIN", "-Wl,--enable-new-dtags"] {
        println!("cargo:rustc-cdylib-link-arg={arg}");
    }
}

fn walk(dir: &Path, files: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            walk(&p, files);
        } else {
            files.push(p);
        }
    }
    files.sort();
}

fn find_nvcc(root: &Path) -> Option<PathBuf> {
    if let Some(p) = env::var_os("NVCC") {
        let p = PathBuf::from(p);
        if p.is_file() {
            return Some(p);
        }
        panic!("NVCC={} does not name a file", p.display());
    }
    let mut candidates = Vec::new();
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(h) = env::var_os(var) {
            candidates.push(PathBuf::from(h).join("bin/nvcc"));
        }
    }
    if let Some(path) = env::var_os("PATH") {
        candidates.extend(env::split_paths(&path).map(|d| d.join("nvcc")));
    }
    candidates.push(root.join("tools/cuda/nvidia/cu13/bin/nvcc"));
    candidates.push(PathBuf::from("/usr/local/cuda/bin/nvcc"));
    candidates.into_iter().find(|p| p.is_file())
}

fn archs() -> Vec<String> {
    let spec = env::var("FEP_CUDA_ARCHS").unwrap_or_else(|_| "90".into());
    let mut v: Vec<String> = spec
        .split([',', ' ', ';'])
        .map(|s| s.trim().trim_start_matches("sm_").to_string())
        .filter(|s| !s.is_empty())
        .collect();
    for a in &v {
        if !a.chars().all(|c| c.is_ascii_alphanumeric()) {
            panic!("FEP_CUDA_ARCHS: bad architecture {a:?} (expected e.g. \"90,100\")");
        }
    }
    if v.is_empty() {
        v.push("90".into());
    }
    v
}

fn build_fatbin(root: &Path, out: &Path, files: &[PathBuf]) {
    let nvcc = find_nvcc(root).unwrap_or_else(|| {
        panic!(
            "nvcc not found (looked at $NVCC, $CUDA_HOME/bin, $PATH, ./tools/cuda/nvidia/cu13/bin, \
             /usr/local/cuda/bin). Run `make setup` (or `bash scripts/setup.sh`), which installs the \
             pinned CUDA 13.0 compiler wheels into ./tools, or set NVCC=/path/to/nvcc."
        )
    });

    // One translation unit that includes every kernels/*.cu (top level only; headers live in
    // kernels/include), the bench kernels only with their feature.
    let mut unit = String::from("// generated by build.rs: every kernels/*.cu in one unit\n");
    let kernels = root.join("kernels");
    let bench = bench_kernels();
    for f in files {
        let name = f.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if !bench && BENCH_KERNEL_FILES.contains(&name) {
            continue;
        }
        if f.parent() == Some(kernels.as_path()) && f.extension().is_some_and(|e| e == "cu") {
            unit.push_str(&format!("#include \"{}\"\n", f.display()));
        }
    }
    let unit_path = out.join("fep_kernels_all.cu");
    fs::write(&unit_path, unit).expect("write the generated kernel unit");

    let fatbin = out.join("fep_kernels.fatbin");
    println!("cargo::rustc-check-cfg=cfg(fep_trace_normal)");
    if trace_normal() {
        println!("cargo:rustc-cfg=fep_trace_normal");
    }
    let mut cmd = Command::new(&nvcc);
    if trace_normal() {
        cmd.arg("-DFEP_TRACE_NORMAL=1");
    }
    cmd.arg("-fatbin")
        .arg("-std=c++17")
        .arg("-O3")
        .args(["-Xptxas", "-v"])
        .arg("-Werror=all-warnings")
        .arg(format!("-I{}", kernels.join("include").display()));
    if let Some(ccbin) = env::var_os("NVCC_CCBIN") {
        cmd.arg("-ccbin").arg(ccbin);
    }
    let archs = archs();
    for a in &archs {
        cmd.arg(format!("-gencode=arch=compute_{a},code=sm_{a}"));
    }
    // PTX of the newest architecture asked for: the driver can JIT it for later GPUs.
    let newest = archs.last().expect("at least one arch");
    cmd.arg(format!("-gencode=arch=compute_{newest},code=compute_{newest}"));
    cmd.arg("-o").arg(&fatbin).arg(&unit_path);

    let output = cmd
        .output()
        .unwrap_or_else(|e| panic!("failed to run {}: {e} (run `make setup`)", nvcc.display()));
    let stderr = String::from_utf8_lossy(&output.stderr);
    if !output.status.success() {
        panic!(
            "nvcc failed ({}):\n{}\n{}",
            output.status,
            String::from_utf8_lossy(&output.stdout),
            stderr
        );
    }
    fs::write(out.join("ptxas.log"), stderr.as_bytes()).expect("write ptxas.log");

    // `-Xptxas -v`: a kernel that spills to local memory is a bug (issue 3).
    let spills = spilling_functions(&stderr);
    if !spills.is_empty() {
        let msg = format!(
            "ptxas reports local-memory spills in: {} (full report: {})",
            spills.join(", "),
            out.join("ptxas.log").display()
        );
        if env::var_os("FEP_ALLOW_SPILLS").is_some() || trace_normal() {
            println!("cargo:warning={msg}");
        } else {
            panic!("{msg}; fix the kernel, or set FEP_ALLOW_SPILLS=1 to build anyway");
        }
    }
}

/// Function names whose ptxas report shows "N bytes spill stores" with N > 0.
fn spilling_functions(log: &str) -> Vec<String> {
    let mut current = String::new();
    let mut bad = Vec::new();
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            current = rest.split('\'').next().unwrap_or("").to_string();
        } else if let Some(rest) = line.split("Function properties for ").nth(1) {
            current = rest.trim().to_string();
        }
        if let Some(pos) = line.find(" bytes spill stores") {
            let n: u64 = line[..pos]
                .rsplit(|c: char| !c.is_ascii_digit())
                .next()
                .and_then(|s| s.parse().ok())
                .unwrap_or(0);
            if n > 0 && !bad.contains(&current) {
                bad.push(current.clone());
            }
        }
    }
    bad
}

#[derive(Debug)]
struct PodDerives;

impl bindgen::callbacks::ParseCallbacks for PodDerives {
    fn add_derives(&self, info: &bindgen::callbacks::DeriveInfo<'_>) -> Vec<String> {
        if info.name.starts_with("fep_") {
            vec!["bytemuck::Pod".into(), "bytemuck::Zeroable".into()]
        } else {
            vec![]
        }
    }
}

fn build_abi(kernels: &Path, out: &Path) {
    let header = kernels.join("include/fep_abi.h");
    let bindings = bindgen::Builder::default()
        .header(header.to_string_lossy())
        .allowlist_type("fep_.*")
        .allowlist_var("FEP_.*")
        .derive_default(true)
        .derive_debug(true)
        .derive_eq(true)
        .layout_tests(false)
        .generate_comments(true)
        .parse_callbacks(Box::new(PodDerives))
        .generate()
        .unwrap_or_else(|e| {
            panic!(
                "bindgen failed on {} ({e}); is libclang installed (`make setup` installs \
                 libclang-dev)?",
                header.display()
            )
        });
    bindings.write_to_file(out.join("abi.rs")).expect("write abi.rs");
}
