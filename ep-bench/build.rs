//! Build script: `FEP_GIT_COMMIT` for ep-bench's result rows ([`git_commit`]). The CUDA kernels
//! and the CUDA/Rust ABI are fabric-ep's (its build.rs).

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    let root = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    git_commit(&root);
}

/// `FEP_GIT_COMMIT` (ep-bench's rows carry it): the variable when set (builds from a tarball or a
/// container context without `.git`), else `git rev-parse HEAD` of the source tree, else
/// "unknown". The build script reruns when HEAD moves: HEAD and the branch it names are watched.
fn git_commit(root: &Path) {
    println!("cargo:rerun-if-env-changed=FEP_GIT_COMMIT");
    let git = |args: &[&str]| -> Option<String> {
        let o = Command::new("git").arg("-C").arg(root).args(args).output().ok()?;
        let s = String::from_utf8(o.stdout).ok()?.trim().to_string();
        (o.status.success() && !s.is_empty()).then_some(s)
    };
    let commit = env::var("FEP_GIT_COMMIT")
        .ok()
        .filter(|c| !c.trim().is_empty())
        .or_else(|| git(&["rev-parse", "HEAD"]))
        .unwrap_or_else(|| "unknown".to_string());
    if env::var_os("FEP_GIT_COMMIT").is_none() {
        let mut watch = vec!["HEAD".to_string(), "packed-refs".to_string()];
        if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
            watch.push(branch);
        }
        for w in watch {
            if let Some(p) = git(&["rev-parse", "--path-format=absolute", "--git-path", &w]) {
                if Path::new(&p).exists() {
                    println!("cargo:rerun-if-changed={p}");
                }
            }
        }
    }
    println!("cargo:rustc-env=FEP_GIT_COMMIT={}", commit.trim());
}
