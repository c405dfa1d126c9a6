//! ep-bench in a job: rank 0 of a job no ep-bench launched (torchrun-style variables, set here
//! by `LocalJob`) prints the same lines as ep-bench's own launcher (descriptions, one table
//! whose rows come as they finish), with no launcher-only tagged lines; the ranks' FEP_LOG
//! lines reach the launcher's stderr. Host backend, small shapes.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use fabric_ep::bootstrap::LocalJob;

const ARGS: &str = "--backend host --mode both --tokens 16 --hidden 128 --topk 2 --experts 8 \
                    --iters 2 --provider shm";

/// The lines with the figures (the last three columns of a table row) cut off.
fn shape(out: &str) -> Vec<String> {
    out.lines()
        .map(|l| match l.split_once(" | ") {
            Some((head, _)) if !l.starts_with("mode ") => head.to_string(),
            _ => l.to_string(),
        })
        .collect()
}

#[test]
fn external_rank_zero_prints_what_the_launcher_prints() {
    let mut c = Command::new(env!("CARGO_BIN_EXE_ep-bench"));
    for v in ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]
    {
        c.env_remove(v);
    }
    c.env_remove("FEP_LOG").env_remove("RUST_LOG");
    let local = c.args(["--ranks", "2"]).args(ARGS.split(' ')).output().unwrap();
    let local_out = String::from_utf8_lossy(&local.stdout);
    assert!(local.status.success(), "{local_out}\n{}", String::from_utf8_lossy(&local.stderr));

    let args: Vec<String> = ARGS.split(' ').map(str::to_string).collect();
    let exe = Path::new(env!("CARGO_BIN_EXE_ep-bench"));
    let env = [("FEP_LOG".to_string(), "warn".to_string())];
    let mut job = LocalJob::spawn(exe, &args, 2, 2, &env).unwrap();
    let outcomes = job.wait(Duration::from_secs(120)).unwrap();
    for (r, o) in outcomes.iter().enumerate() {
        assert!(o.success(), "rank {r}: {o}");
    }
    let ext = &outcomes[0].stdout;
    assert!(!ext.contains("@ep "), "launcher-only tagged lines in a job's output:\n{ext}");
    assert_eq!(shape(ext), shape(&local_out), "external:\n{ext}\nlauncher:\n{local_out}");
    // One header, then six rows (normal: 2, low latency: 4).
    assert_eq!(ext.lines().filter(|l| l.starts_with("mode ")).count(), 1, "{ext}");
    assert_eq!(ext.lines().filter(|l| l.contains(" | ")).count(), 7, "{ext}");
    assert!(outcomes[1].stdout.is_empty(), "rank 1 printed: {}", outcomes[1].stdout);
}

#[test]
fn the_launcher_passes_its_ranks_log_lines_on() {
    let out = Command::new(env!("CARGO_BIN_EXE_ep-bench"))
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .env("FEP_LOG", "info")
        .args(["--ranks", "2"])
        .args(ARGS.split(' '))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    for r in 0..2 {
        assert!(err.contains(&format!("fabric-ep[rank {r}] INFO ")), "rank {r}:\n{err}");
    }
}
