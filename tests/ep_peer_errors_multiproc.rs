//! A peer that dies (SIGKILL) or stops (SIGSTOP) in the middle of a run of normal dispatches
//! and combines: every surviving rank's error must name it. Ranks are OS processes (this test
//! binary re-executed, one per rank) driving the C ABI over the environment's TCP store and
//! libfabric's tcp;ofi_rxm, so the errors are the ones a C or Python caller sees. The same with a
//! caller's all-gather callback instead of the store (what a torch process group gives): the
//! callback bootstrap's liveness channel must name a killed peer as fast as the store does.

use std::ffi::{c_void, CStr};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::raw::c_int;
use std::process::{Child, Command, Stdio};
use std::ptr::{null, null_mut};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use fabric_ep::ffi::*;

const ROLE: &str = "FEP_PEER_TEST_RANK";
/// Set (to the hub's port): the rank bootstraps over [`Hub`] through `fep_buffer_create`'s
/// all-gather callback, not the TCP store.
const HUB: &str = "FEP_PEER_TEST_HUB";
const WORLD: usize = 3;
/// The rank the fault hits, unless a test names another.
const VICTIM: usize = 1;

fn last_error() -> String {
    unsafe { CStr::from_ptr(fep_last_error()) }.to_string_lossy().into_owned()
}

/// A caller's collective as plain as can be: rank 0 holds one TCP connection per other rank and
/// answers every round with all blobs in rank order. It watches nobody: a dead rank only shows
/// as a read that fails, in the next round (the data path runs none).
struct Hub {
    rank: usize,
    /// Rank 0: the connections of ranks 1.. (index r - 1); else: the one to rank 0.
    conns: Vec<TcpStream>,
}

impl Hub {
    fn connect(rank: usize, port: u16) -> Hub {
        let io = Some(Duration::from_secs(60));
        if rank == 0 {
            let l = TcpListener::bind(("127.0.0.1", port)).expect("hub listen");
            let mut conns: Vec<Option<TcpStream>> = (1..WORLD).map(|_| None).collect();
            for _ in 1..WORLD {
                let (mut s, _) = l.accept().expect("hub accept");
                let mut r = [0u8; 8];
                s.read_exact(&mut r).expect("hub hello");
                s.set_read_timeout(io).unwrap();
                conns[u64::from_le_bytes(r) as usize - 1] = Some(s);
            }
            return Hub {
                rank,
                conns: conns.into_iter().map(|c| c.expect("every rank")).collect(),
            };
        }
        let t = Instant::now();
        let mut s = loop {
            match TcpStream::connect(("127.0.0.1", port)) {
                Ok(s) => break s,
                Err(e) if t.elapsed() < Duration::from_secs(20) => {
                    let _ = e;
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => panic!("rank {rank}: hub connect: {e}"),
            }
        };
        s.write_all(&(rank as u64).to_le_bytes()).unwrap();
        s.set_read_timeout(io).unwrap();
        Hub { rank, conns: vec![s] }
    }

    fn gather(&mut self, send: &[u8], recv: &mut [u8]) -> std::io::Result<()> {
        let n = send.len();
        if self.rank == 0 {
            recv[..n].copy_from_slice(send);
            for (i, c) in self.conns.iter_mut().enumerate() {
                c.read_exact(&mut recv[(i + 1) * n..(i + 2) * n])?;
            }
            for c in &mut self.conns {
                c.write_all(recv)?;
            }
        } else {
            self.conns[0].write_all(send)?;
            self.conns[0].read_exact(recv)?;
        }
        Ok(())
    }
}

unsafe extern "C" fn hub_gather(
    send: *const c_void,
    len: usize,
    recv: *mut c_void,
    user: *mut c_void,
) -> c_int {
    // SAFETY: `user` is the rank's Hub, alive for the whole process; the buffers are the
    // library's, `len` and `len * WORLD` bytes.
    let hub = unsafe { &mut *user.cast::<Hub>() };
    let send = unsafe { std::slice::from_raw_parts(send.cast::<u8>(), len) };
    let recv = unsafe { std::slice::from_raw_parts_mut(recv.cast::<u8>(), len * WORLD) };
    match hub.gather(send, recv) {
        Ok(()) => 0,
        Err(_) => -1,
    }
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
    let st = match std::env::var(HUB) {
        Ok(port) => {
            let hub = Box::leak(Box::new(Hub::connect(rank, port.parse().unwrap())));
            let user = (hub as *mut Hub).cast::<c_void>();
            unsafe { fep_buffer_create(&cfg, Some(hub_gather), user, &mut b) }
        }
        Err(_) => unsafe { fep_buffer_create(&cfg, None, null_mut(), &mut b) },
    };
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
fn launch(test: &str, hub: bool) -> (Vec<Child>, mpsc::Receiver<(usize, String)>) {
    let free = || TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let port = free();
    let hub_port = free();
    let (tx, rx) = mpsc::channel();
    let mut kids = Vec::new();
    for r in 0..WORLD {
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        if hub {
            // No store variables at all: the callback is the only bootstrap.
            cmd.env(HUB, hub_port.to_string());
        } else {
            cmd.env("MASTER_ADDR", "127.0.0.1")
                .env("FEP_MASTER_PORT", port.to_string())
                .env("FEP_JOB_ID", format!("peer-errors-{}-{port}", std::process::id()));
        }
        let mut child = cmd
            .args(["--exact", "--nocapture", "--test-threads=1", test])
            .env(ROLE, r.to_string())
            .env("RANK", r.to_string())
            .env("WORLD_SIZE", WORLD.to_string())
            .env("LOCAL_RANK", "0")
            .env("LOCAL_WORLD_SIZE", "1")
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

fn run(test: &str, stop_instead_of_kill: bool, hub: bool) {
    run_victim(test, stop_instead_of_kill, hub, VICTIM)
}

fn run_victim(test: &str, stop_instead_of_kill: bool, hub: bool, victim: usize) {
    if let Ok(r) = std::env::var(ROLE) {
        rank_main(r.parse().unwrap());
    }
    let (mut kids, rx) = launch(test, hub);
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
    let victim_pid = kids[victim].id() as i32;
    let sig = if stop_instead_of_kill { libc::SIGSTOP } else { libc::SIGKILL };
    // SAFETY: a plain signal to a child this test spawned and has not reaped.
    assert_eq!(unsafe { libc::kill(victim_pid, sig) }, 0);
    let faulted = Instant::now();
    let mut errors: Vec<Option<String>> = vec![None; WORLD];
    let mut last_error_after = Duration::ZERO;
    let deadline = Instant::now() + Duration::from_secs(60);
    while (0..WORLD).any(|r| r != victim && errors[r].is_none()) && Instant::now() < deadline {
        if let Ok((r, line)) = rx.recv_timeout(Duration::from_millis(200)) {
            if let Some(m) = line.strip_prefix("ERROR ") {
                errors[r] = Some(m.to_string());
                last_error_after = faulted.elapsed();
            }
        }
    }
    eprintln!("every survivor failed within {last_error_after:?} of the fault");
    if !stop_instead_of_kill {
        // A killed rank's store (or liveness) connection closes at once and rank 0 tells every
        // rank: no survivor waits out its 4 s timeout.
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
    for r in (0..WORLD).filter(|&r| r != victim) {
        let msg = errors[r].as_deref().unwrap_or_else(|| panic!("rank {r} reported no error"));
        eprintln!("rank {r}: {msg}");
        assert!(names_peer(msg, victim), "rank {r}'s error does not name rank {victim}: {msg}");
        assert!(!msg.contains("peer None"), "{msg}");
    }
    assert!(took < Duration::from_secs(90), "{took:?}");
}

// Each test re-executes itself once per rank (`ROLE` set): a rank process runs `rank_main`.
#[test]
fn a_peer_killed_mid_run_is_named_by_every_survivor() {
    run("a_peer_killed_mid_run_is_named_by_every_survivor", false, false);
}

#[test]
fn a_peer_killed_mid_run_is_named_by_every_survivor_over_a_callback_bootstrap() {
    run("a_peer_killed_mid_run_is_named_by_every_survivor_over_a_callback_bootstrap", false, true);
}

/// Rank 0 serves the callback bootstrap's liveness channel: its death closes every connection,
/// and the others name it instead of hanging.
#[test]
fn rank_0_killed_mid_run_is_named_by_every_survivor_over_a_callback_bootstrap() {
    run_victim(
        "rank_0_killed_mid_run_is_named_by_every_survivor_over_a_callback_bootstrap",
        false,
        true,
        0,
    );
}

#[test]
fn a_peer_stopped_mid_run_is_named_by_every_survivor() {
    run("a_peer_stopped_mid_run_is_named_by_every_survivor", true, false);
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
