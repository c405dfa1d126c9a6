//! ep-bench's result files: `--json FILE` / `--csv FILE` rows carry every setting of the run,
//! written by ep-bench's own launcher, and by rank 0 when another launcher (torchrun, mpirun, a
//! PyTorchJob; here `LocalJob`, which sets the same variables) started the ranks; `FI_PROVIDER`
//! stands in for `--provider`. Host backend, small shapes.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use fabric_ep::bootstrap::LocalJob;

mod common;

fn ep_bench() -> Command {
    let mut c = common::ep_bench();
    // Nor inherit a provider or timeout.
    c.env_remove("FI_PROVIDER").env_remove("FEP_TIMEOUT_S");
    c
}

const SHAPE: [&str; 12] = [
    "--tokens",
    "24",
    "--hidden",
    "128",
    "--topk",
    "2",
    "--experts",
    "8",
    "--iters",
    "2",
    "--backend",
    "host",
];

fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn json_rows(path: &Path) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    match serde_json::from_str(&text).unwrap() {
        serde_json::Value::Array(rows) => rows,
        v => panic!("not an array: {v}"),
    }
}

/// Every row carries the settings of the run, the build's version and commit.
fn check_settings(row: &serde_json::Value, ranks: u64, nodes: u64, provider: &str, dtype: &str) {
    assert_eq!(row["ranks"], ranks, "{row}");
    assert_eq!(row["nodes"], nodes, "{row}");
    assert_eq!(row["provider"], provider, "{row}");
    assert_eq!(row["tokens"], 24, "{row}");
    assert_eq!(row["hidden"], 128, "{row}");
    assert_eq!(row["topk"], 2, "{row}");
    assert_eq!(row["experts"], 8, "{row}");
    assert_eq!(row["iters"], 2, "{row}");
    assert_eq!(row["dtype"], dtype, "{row}");
    assert_eq!(row["backend"], "host", "{row}");
    assert_eq!(row["sms"], serde_json::Value::Null, "{row}");
    assert_eq!(row["gpu"], serde_json::Value::Null, "{row}");
    assert_eq!(row["version"], fabric_ep::VERSION, "{row}");
    let commit = row["git_commit"].as_str().unwrap_or_default();
    assert!(commit == "unknown" || commit.len() >= 7, "{row}");
    assert!(row["median_us"].as_f64().is_some_and(|v| v > 0.0), "{row}");
}

#[test]
fn launcher_writes_json_and_csv_with_every_setting() {
    let dir = scratch("ep-bench-out-launcher");
    let (json, csv) = (dir.join("rows.json"), dir.join("rows.csv"));
    let out = ep_bench()
        .args(["--mode", "both", "--ranks", "4", "--ranks-per-node", "2", "--fp8"])
        .args(SHAPE)
        .arg("--json")
        .arg(&json)
        .arg("--csv")
        .arg(&csv)
        .env("FI_PROVIDER", "tcp;ofi_rxm")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("provider tcp;ofi_rxm"), "FI_PROVIDER not used: {stdout}");
    let rows = json_rows(&json);
    // normal: dispatch, combine; low-latency: the same with and without the hook.
    assert_eq!(rows.len(), 6, "{rows:?}");
    for r in &rows {
        check_settings(r, 4, 2, "tcp;ofi_rxm", "fp8");
    }
    let text = std::fs::read_to_string(&csv).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 7, "{text}");
    assert!(lines[0].starts_with("mode,op,backend,ranks,tokens,hidden,"), "{text}");
    let provider_col = lines[0].split(',').position(|h| h == "provider").unwrap();
    for l in &lines[1..] {
        assert_eq!(l.split(',').nth(provider_col), Some("tcp;ofi_rxm"), "{l}");
    }
    assert!(stdout.contains(&format!("JSON: 6 rows in {}", json.display())), "{stdout}");
}

#[test]
fn rank_zero_of_an_external_job_writes_the_files() {
    let dir = scratch("ep-bench-out-external");
    let json = dir.join("rows.json");
    let mut args: Vec<String> = ["--mode", "normal"].iter().map(|s| s.to_string()).collect();
    args.extend(SHAPE.iter().map(|s| s.to_string()));
    args.extend(["--json".to_string(), json.display().to_string()]);
    let env = [("FI_PROVIDER".to_string(), "shm".to_string())];
    let exe = Path::new(env!("CARGO_BIN_EXE_ep-bench"));
    let mut job = LocalJob::spawn(exe, &args, 2, 2, &env).unwrap();
    let outcomes = job.wait(Duration::from_secs(120)).unwrap();
    for (r, o) in outcomes.iter().enumerate() {
        assert!(o.success(), "rank {r}: {o}");
    }
    // Rank 0 prints the table itself (no launcher of ours reads its tagged lines).
    assert!(outcomes[0].stdout.contains("median us"), "{}", outcomes[0].stdout);
    assert!(!outcomes[1].stdout.contains("median us"), "{}", outcomes[1].stdout);
    let rows = json_rows(&json);
    assert_eq!(rows.len(), 2, "{rows:?}");
    for r in &rows {
        check_settings(r, 2, 1, "shm", "bf16");
    }
}
