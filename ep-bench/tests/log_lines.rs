//! FEP_LOG: a small host-backend job (ep-bench, two ranks as processes, shm between them as two
//! nodes) logs its set-up decisions at info, each line prefixed with its rank; the default
//! (warn) prints none of them; a bad FEP_LOG is named in a warning and the run goes on.

use std::process::Output;

mod common;

fn ep_bench(log: Option<&str>) -> Output {
    let mut c = common::ep_bench();
    for v in ["FEP_LOG", "RUST_LOG", "FI_PROVIDER", "FEP_TIMEOUT_S", "FEP_NICS", "FEP_SYSFS_ROOT"] {
        c.env_remove(v);
    }
    if let Some(l) = log {
        c.env("FEP_LOG", l);
    }
    let args = "--ranks 2 --ranks-per-node 1 --provider shm --backend host --mode both \
                --tokens 16 --hidden 128 --topk 2 --experts 8 --iters 2";
    let out = c.args(args.split(' ')).output().unwrap();
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

#[test]
fn info_lines_name_provider_domain_and_registrations_per_rank() {
    let out = ep_bench(Some("info"));
    let err = String::from_utf8_lossy(&out.stderr);
    for rank in 0..2 {
        let p = format!("fabric-ep[rank {rank}] INFO ");
        let mine: Vec<&str> = err.lines().filter(|l| l.starts_with(&p)).collect();
        let has = |what: &str| mine.iter().any(|l| l.contains(what));
        assert!(
            has(&format!("rank {rank} (local 0) endpoint 0/1: provider shm fabric shm domain shm")),
            "rank {rank}: no provider/domain line in\n{err}"
        );
        assert!(has("mr_mode 0x"), "rank {rank}: no MR mode in\n{err}");
        assert!(has("registered ") && has("bytes of Host memory on shm"), "{err}");
        assert!(has("host buffer: rank") && has("timeout"), "{err}");
        assert!(has("proxy: rank") && has("worker(s)"), "{err}");
    }
    // Every line is a rank's (or the process's, before the bootstrap) and none repeats the
    // per-step path: a handful per rank, not one per iteration.
    for l in err.lines() {
        assert!(l.starts_with("fabric-ep["), "unprefixed line: {l}");
    }
    let n = err.lines().count();
    assert!(n < 60, "{n} lines: logging on the step path?\n{err}");
    // The results still go to stdout as without logging.
    assert!(String::from_utf8_lossy(&out.stdout).contains("median us"));
}

#[test]
fn default_level_is_warn() {
    let out = ep_bench(None);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains(" INFO "), "{err}");
}

#[test]
fn a_bad_fep_log_is_named_and_the_default_applies() {
    let out = ep_bench(Some("chatty"));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("WARN log: FEP_LOG=\"chatty\""), "{err}");
    assert!(!err.contains(" INFO "), "{err}");
}
