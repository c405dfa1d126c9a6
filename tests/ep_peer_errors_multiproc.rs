//! A peer that dies (SIGKILL) or stops (SIGSTOP) in the middle of a run of normal dispatches
//! and combines: every surviving rank's error must name it. Ranks are OS processes (this test
//! binary re-executed, one per rank) driving the C ABI over the environment's TCP store and
//! libfabric's tcp;ofi_rxm, so the errors are the ones a C or Python caller sees.

use std::ffi::CStr;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::ptr::{null, null_mut};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use fabric_ep::ffi::*;

const ROLE: &str = "FEP_PEER_TEST_RANK";
const WORLD: usize = 3;
const VICTIM: usize = 1;

fn last_error() -> String {
    unsafe { CStr::from_ptr(fep_last_error()) }.to_string_lossy().into_owned()
}

/// One rank: dispatch + combine until a call fails; prints `iter N` after each and `ERROR
/// <message>` at the end (then exits without a collective teardown: a peer is gone).
fn rank_main(rank: usize) -> ! {
    let mut c = std::mem::MaybeUninit::<fep_config>::uninit();
    let mut cfg = unsafe {
        fep_config_init(c.as_mut_ptr());
        c.assume_init()
    };
    (cfg.rank, cfg.num_ranks, cfg.ranks_per_node, cfg.local_rank) =
        (rank as i32, WORLD as i32, 1, 0);
    (cfg.num_experts, cfg.hidden, cfg.num_topk) = (6, 256, 2);
    cfg.timeout_s = 4.0;
    let provider = c"tcp;ofi_rxm";
    cfg.provider = provider.as_ptr();
    let mut b = null_mut();
    let st = unsafe { fep_buffer_create(&cfg, None, null_mut(), &mut b) };
    if st != fep_status::FEP_OK {
        println!("SETUP {st:?} {}", last_error());
        std::process::exit(3);
    }
    let t = 32i64;
    let x = vec![0x3f80u16; (t * 256) as usize];
    let idx: Vec<i64> = (0..t).flat_map(|i| [i % 6, (i + 1) % 6]).collect();
    let w = vec![0.5f32; (t * 2) as usize];
    let ten = |p: *const u16, d, s0, s1| fep_tensor {
        data: p as *mut _,
        dtype: d,
        ndim: 2,
        shape: [s0, s1, 0, 0],
    };
    let tx = ten(x.as_ptr(), FEP_DTYPE_BF16, t, 256);
    let ti = ten(idx.as_ptr().cast(), FEP_DTYPE_I64, t, 2);
    let tw = ten(w.as_ptr().cast(), FEP_DTYPE_F32, t, 2);
    let mut out_x = vec![0u16; (t * 256) as usize];
    for iter in 0u64.. {
        let (mut h, mut rows) = (null_mut(), 0i64);
        let st = unsafe {
            fep_dispatch(b, &tx, null(), &ti, &tw, null(), 1, 0, null_mut(), &mut h, &mut rows)
        };
        if st != fep_status::FEP_OK {
            println!("ERROR {}", last_error());
            std::process::exit(2);
        }
        let recv = vec![0u16; (rows * 256) as usize];
        let tr = ten(recv.as_ptr(), FEP_DTYPE_BF16, rows, 256);
        let mut tc = ten(out_x.as_mut_ptr(), FEP_DTYPE_BF16, t, 256);
        let st = unsafe { fep_combine(b, h, &tr, null(), &mut tc, null_mut(), null_mut()) };
        unsafe { fep_handle_destroy(h) };
        if st != fep_status::FEP_OK {
            println!("ERROR {}", last_error());
            std::process::exit(2);
        }
        println!("iter {iter}");
    }
    unreachable!()
}

/// The ranks, their stdout lines (rank, line) on one channel.
fn launch(test: &str) -> (Vec<Child>, mpsc::Receiver<(usize, String)>) {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let (tx, rx) = mpsc::channel();
    let mut kids = Vec::new();
    for r in 0..WORLD {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "--nocapture", "--test-threads=1", test])
            .env(ROLE, r.to_string())
            .env("RANK", r.to_string())
            .env("WORLD_SIZE", WORLD.to_string())
            .env("LOCAL_RANK", "0")
            .env("LOCAL_WORLD_SIZE", "1")
            .env("MASTER_ADDR", "127.0.0.1")
            .env("FEP_MASTER_PORT", port.to_string())
            .env("FEP_JOB_ID", format!("peer-errors-{}-{port}", std::process::id()))
            .env_remove("FI_PROVIDER")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn a rank");
        let out = child.stdout.take().unwrap();
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send((r, line));
            }
        });
        kids.push(child);
    }
    (kids, rx)
}

/// Whether `msg` names rank `peer` as the one at fault (a world of 3: "rank 1" is unambiguous
/// once the rank's own prefix is skipped; a timeout lists it in "waiting for ranks [..]").
fn names_peer(msg: &str, peer: usize) -> bool {
    let body = msg.split_once(": ").map_or(msg, |(_, b)| b);
    let listed = body.split("ranks [").skip(1).any(|s| {
        s.split(']').next().is_some_and(|l| l.split(", ").any(|v| v.trim() == peer.to_string()))
    });
    listed || body.contains(&format!("rank {peer}"))
}

fn run(test: &str, stop_instead_of_kill: bool) {
    if let Ok(r) = std::env::var(ROLE) {
        rank_main(r.parse().unwrap());
    }
    let (mut kids, rx) = launch(test);
    let start = Instant::now();
    // Let every rank run a few steps, so the victim goes down in the middle of the run.
    let mut iters = [0u64; WORLD];
    while iters.iter().any(|&i| i < 3) {
        let (r, line) = rx.recv_timeout(Duration::from_secs(60)).expect("ranks make progress");
        if let Some(n) = line.strip_prefix("iter ") {
            iters[r] = n.parse::<u64>().unwrap() + 1;
        } else if line.starts_with("ERROR") || line.starts_with("SETUP") {
            panic!("rank {r} before the fault: {line}");
        }
    }
    let victim = kids[VICTIM].id() as i32;
    let sig = if stop_instead_of_kill { libc::SIGSTOP } else { libc::SIGKILL };
    // SAFETY: a plain signal to a child this test spawned and has not reaped.
    assert_eq!(unsafe { libc::kill(victim, sig) }, 0);
    let faulted = Instant::now();
    let mut errors: Vec<Option<String>> = vec![None; WORLD];
    let mut last_error_after = Duration::ZERO;
    let deadline = Instant::now() + Duration::from_secs(60);
    while (0..WORLD).any(|r| r != VICTIM && errors[r].is_none()) && Instant::now() < deadline {
        if let Ok((r, line)) = rx.recv_timeout(Duration::from_millis(200)) {
            if let Some(m) = line.strip_prefix("ERROR ") {
                errors[r] = Some(m.to_string());
                last_error_after = faulted.elapsed();
            }
        }
    }
    eprintln!("every survivor failed within {last_error_after:?} of the fault");
    if !stop_instead_of_kill {
        // A killed rank's store connection closes at once and the store tells every rank: no
        // survivor waits out its 4 s timeout.
        assert!(
            last_error_after < Duration::from_secs(2),
            "the death was reported after {last_error_after:?}"
        );
    }
    let took = start.elapsed();
    for k in &mut kids {
        let _ = k.kill();
        let _ = k.wait();
    }
    for r in (0..WORLD).filter(|&r| r != VICTIM) {
        let msg = errors[r].as_deref().unwrap_or_else(|| panic!("rank {r} reported no error"));
        eprintln!("rank {r}: {msg}");
        assert!(names_peer(msg, VICTIM), "rank {r}'s error does not name rank {VICTIM}: {msg}");
        assert!(!msg.contains("peer None"), "{msg}");
    }
    assert!(took < Duration::from_secs(90), "{took:?}");
}

// Each test re-executes itself once per rank (`ROLE` set): a rank process runs `rank_main`.
#[test]
fn a_peer_killed_mid_run_is_named_by_every_survivor() {
    run("a_peer_killed_mid_run_is_named_by_every_survivor", false);
}

#[test]
fn a_peer_stopped_mid_run_is_named_by_every_survivor() {
    run("a_peer_stopped_mid_run_is_named_by_every_survivor", true);
}

#[test]
fn the_peer_check_reads_messages_right() {
    assert!(names_peer("rank 0: timed out after 4s in dispatch waiting for ranks [1]", 1));
    assert!(names_peer("rank 2: timed out after 4s in notify waiting for ranks [0, 1]", 1));
    assert!(names_peer(
        "proxy worker fep-proxy-0-0 failed: rank 0: libfabric failure writing to rank 1: x",
        1
    ));
    assert!(!names_peer("rank 1: timed out after 4s in dispatch waiting for ranks [2]", 1));
    assert!(!names_peer("rank 0: libfabric failure on the endpoint: x", 1));
}
