//! Bootstrap tests: multi-process over the TCP store (the test binary re-executes itself as the
//! ranks, through `LocalJob`), in-process threads, and the callback wrapper.
//!
//! A child process runs only `child_rank`, which reads its role from `FEP_TEST_ROLE`; without that
//! variable (a normal `cargo test` run) it returns at once.

use std::fs::File;
use std::net::TcpStream;
use std::process::Command;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use fabric_ep::bootstrap::{
    Bootstrap, BootstrapError, CallbackBootstrap, InProcGroup, LocalJob, RankOutcome, SecretSource,
    TcpStore, TcpStoreOptions,
};
use fabric_ep::util::SplitMix64;

mod common;

const ROLE: &str = "FEP_TEST_ROLE";
const TIMEOUT_MS: &str = "FEP_TEST_TIMEOUT_MS";
const CHILD_OK: &str = "CHILD_OK";
/// Bound on a whole multi-process job, far above what any of them needs.
const JOB_WALL: Duration = Duration::from_secs(25);

/// Rank `rank`'s blob for round `round`: lengths differ per rank and round (some are empty), bytes
/// are pseudo-random, so a misplaced or truncated blob cannot pass.
fn blob(rank: usize, round: usize) -> Vec<u8> {
    let len = (rank * 131 + round * 17) % 97;
    let mut g = SplitMix64(((rank as u64) << 32) | round as u64);
    (0..len).map(|_| g.next_u64() as u8).collect()
}

/// A large blob, so results span many reads and the store's writes hit a full socket buffer.
fn big_blob(rank: usize) -> Vec<u8> {
    let mut g = SplitMix64(0xB16 + rank as u64);
    (0..100_000 + rank * 1000).map(|_| g.next_u64() as u8).collect()
}

fn env_usize(var: &str) -> usize {
    std::env::var(var).ok().and_then(|v| v.parse().ok()).unwrap_or_else(|| panic!("{var} unset"))
}

/// All-gathers of rank-specific blobs of different lengths, several rounds, a big one and a
/// barrier, checked byte for byte; `b` must report the identity the launcher gave it.
fn gather_rounds(b: &dyn Bootstrap, expect_local: Option<(usize, usize)>) {
    let world = b.world_size();
    assert!(b.rank() < world);
    if let Some(local) = expect_local {
        assert_eq!((b.local_rank(), b.local_world_size()), local);
    }
    for round in 0..4 {
        let got = b.all_gather(&blob(b.rank(), round)).expect("all_gather");
        assert_eq!(got.len(), world);
        for (r, g) in got.iter().enumerate() {
            assert_eq!(g, &blob(r, round), "rank {} round {round}: blob of rank {r}", b.rank());
        }
    }
    b.barrier().expect("barrier");
    let got = b.all_gather(&big_blob(b.rank())).expect("big all_gather");
    for (r, g) in got.iter().enumerate() {
        assert!(g == &big_blob(r), "rank {}: big blob of rank {r} differs", b.rank());
    }
    let empty = b.all_gather(&[]).expect("empty all_gather");
    assert_eq!(empty, vec![Vec::<u8>::new(); world]);
    b.barrier().expect("final barrier");
}

/// Wall-clock milliseconds, comparable between the processes of one machine (detection times).
fn epoch_ms() -> u128 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis()).unwrap_or(0)
}

/// CPU time this process has used so far (all threads), from `getrusage`.
fn cpu_time() -> Duration {
    // SAFETY: `rusage` is plain data that getrusage fills; the pointer is to a live local.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above; RUSAGE_SELF is always valid.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    assert_eq!(rc, 0, "getrusage");
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// Rank `rank` of stores `instance` and round `round`: tagged so a blob from another instance
/// cannot pass.
fn tagged(instance: u64, rank: usize, round: usize) -> Vec<u8> {
    let mut b = blob(rank, round);
    b.extend_from_slice(&instance.to_le_bytes());
    b
}

fn check_tagged(got: &[Vec<u8>], instance: u64, round: usize) {
    for (r, g) in got.iter().enumerate() {
        assert_eq!(g, &tagged(instance, r, round), "instance {instance} round {round}: rank {r}");
    }
}

/// Rank 0 of a store whose descriptors run out: the store must back off, not spin, and take the
/// waiting rank once descriptors are back.
fn emfile_role(timeout: Duration) {
    let base = TcpStoreOptions::from_env(timeout).expect("options");
    let o0 = TcpStoreOptions { world_size: 2, local_world_size: 2, ..base.clone() };
    let s0 = TcpStore::new(o0.clone()).expect("rank 0");
    // SAFETY: `rlimit` is plain data and the pointers are to live locals.
    let mut lim: libc::rlimit = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) }, 0);
    let saved = lim;
    let open_now = std::fs::read_dir("/proc/self/fd").expect("fds").count() as libc::rlim_t;
    lim.rlim_cur = open_now + 8;
    // SAFETY: as above.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) }, 0);
    let mut hog = Vec::new();
    loop {
        match File::open("/dev/null") {
            Ok(f) => hog.push(f),
            Err(e) if e.raw_os_error() == Some(libc::EMFILE) => break,
            Err(e) => panic!("open: {e}"),
        }
    }
    // One descriptor for a connection the store cannot accept: it waits in the listen queue,
    // and the listener stays readable while every accept fails with EMFILE.
    drop(hog.pop());
    let queued = TcpStream::connect(("127.0.0.1", o0.port)).expect("queued connect");
    let cpu0 = cpu_time();
    thread::sleep(Duration::from_millis(1500));
    let used = cpu_time() - cpu0;
    println!("CPU_MS={} over 1500 ms with descriptors exhausted", used.as_millis());
    assert!(used < Duration::from_millis(300), "the store spins: {used:?} of CPU in 1.5 s");
    drop(hog);
    // SAFETY: as above.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &saved) }, 0);
    let t0 = Instant::now();
    let o1 = TcpStoreOptions { rank: 1, local_rank: 1, ..o0 };
    let h = thread::spawn(move || TcpStore::new(o1).and_then(|s1| s1.barrier()));
    s0.barrier().expect("rank 0 barrier");
    h.join().expect("rank 1 thread").expect("rank 1 joins once descriptors are back");
    println!("JOINED_AFTER_MS={}", t0.elapsed().as_millis());
    assert!(t0.elapsed() < Duration::from_secs(4), "took {:?}", t0.elapsed());
    drop(queued);
}

fn csv(s: &str) -> Vec<usize> {
    s.split(',').filter(|x| !x.is_empty()).map(|x| x.parse().expect("rank list")).collect()
}

/// The body of a rank process. Roles (`FEP_TEST_ROLE`, optionally `role:arg`):
/// `gather`; `expect_job_mismatch`; `expect_auth`; `expect_world_mismatch:<store world>`;
/// `expect_timeout:<missing ranks csv>`; `exit_early`; `join_then_hang`;
/// `join_then_expect_gone:<rank>`; `poll_dead:<rank>`; `join_then_expect_store_lost`;
/// `expect_env:<VAR>`; `two_alive`; `sequential:<n>`; `emfile`.
/// It prints `CHILD_OK` only when the role's expectation held (the parent checks for it, so a
/// child that ran no test at all cannot pass).
#[test]
fn child_rank() {
    let Ok(role) = std::env::var(ROLE) else { return };
    let timeout = Duration::from_millis(env_usize(TIMEOUT_MS) as u64);
    let (role, arg) = role.split_once(':').unwrap_or((role.as_str(), ""));
    match role {
        "gather" => {
            let s = TcpStore::from_env(timeout).expect("join the store");
            let local = (env_usize("LOCAL_RANK"), env_usize("LOCAL_WORLD_SIZE"));
            assert_eq!(s.job_id(), std::env::var("FEP_JOB_ID").expect("job id"));
            assert_eq!(s.secret_source(), SecretSource::Explicit, "the launcher gives a secret");
            gather_rounds(&s, Some(local));
            // End on a big round and drop at once: rank 0's store must still deliver the result to
            // ranks slower than rank 0 before it shuts down.
            let got = s.all_gather(&big_blob(s.rank() + 7)).expect("last all_gather");
            for (r, g) in got.iter().enumerate() {
                assert!(g == &big_blob(r + 7), "last round: blob of rank {r} differs");
            }
        }
        "expect_job_mismatch" => match TcpStore::from_env(timeout) {
            Err(BootstrapError::JobIdMismatch { ours, theirs, addr }) => {
                assert_eq!(ours, std::env::var("FEP_JOB_ID").expect("job id"));
                assert!(theirs.starts_with("fep-local-") && theirs != ours, "theirs = {theirs}");
                assert!(addr.ends_with(&std::env::var("MASTER_PORT").expect("port")));
                println!(
                    "refused as expected: {}",
                    BootstrapError::JobIdMismatch { ours, theirs, addr }
                );
            }
            other => panic!("expected JobIdMismatch, got {:?}", other.err()),
        },
        "expect_world_mismatch" => match TcpStore::from_env(timeout) {
            Err(e @ BootstrapError::WorldSizeMismatch { .. }) => {
                let BootstrapError::WorldSizeMismatch { ours, theirs, rank } = &e else {
                    unreachable!()
                };
                assert_eq!((*ours, *theirs), (env_usize("WORLD_SIZE"), csv(arg)[0]));
                assert_eq!(*rank, env_usize("RANK"));
                println!("refused as expected: {e}");
            }
            other => panic!("expected WorldSizeMismatch, got {:?}", other.err()),
        },
        "expect_auth" => match TcpStore::from_env(timeout) {
            Err(e @ BootstrapError::Auth { .. }) => {
                let BootstrapError::Auth { detail, .. } = &e else { unreachable!() };
                assert!(detail.contains("FEP_JOB_SECRET"), "{e}");
                assert!(!detail.contains("fep-local-"), "a refused rank learns no job id: {e}");
                println!("refused as expected: {e}");
            }
            other => panic!("expected Auth, got {:?}", other.err()),
        },
        "expect_timeout" => {
            let s = TcpStore::from_env(timeout).expect("join the store");
            let t0 = Instant::now();
            match s.all_gather(b"x") {
                Err(e @ BootstrapError::Timeout { .. }) => {
                    let BootstrapError::Timeout { missing, .. } = &e else { unreachable!() };
                    assert_eq!(missing, &csv(arg), "{e}");
                    // The round's deadline runs from the first rank's arrival, so a rank that
                    // started late may wait less; the parent checks the job took the timeout.
                    let took = t0.elapsed();
                    assert!(took <= timeout + Duration::from_secs(3), "too slow: {took:?}");
                    println!("timed out as expected: {e}");
                }
                other => panic!("expected Timeout, got {other:?}"),
            }
        }
        "exit_early" => {}
        "join_then_hang" => {
            let s = TcpStore::from_env(timeout).expect("join the store");
            s.barrier().expect("first barrier");
            if s.rank() == 0 {
                // Once this second barrier completes, every rank has *received* the first one's
                // result (they contributed after it): killing the store's host then cannot cut
                // the first barrier short for anyone.
                s.barrier().expect("second barrier");
            }
            println!("JOINED");
            thread::sleep(Duration::from_secs(30));
            panic!("the parent should have killed this rank");
        }
        "join_then_expect_gone" => {
            let s = TcpStore::from_env(timeout).expect("join the store");
            s.barrier().expect("first barrier");
            let t0 = Instant::now();
            println!("WAITING");
            match s.all_gather(b"after") {
                Err(e @ BootstrapError::PeerGone { .. }) => {
                    println!("DETECTED_MS={}", epoch_ms());
                    let BootstrapError::PeerGone { rank, .. } = &e else { unreachable!() };
                    assert_eq!(vec![*rank], csv(arg), "{e}");
                    // Other survivors that already failed may have left too: the victim must be
                    // listed.
                    assert!(s.dead_ranks().contains(rank), "dead set {:?}", s.dead_ranks());
                    assert!(t0.elapsed() < timeout, "not fast: {:?}", t0.elapsed());
                    println!("failed as expected: {e}");
                }
                other => panic!("expected PeerGone, got {other:?}"),
            }
        }
        "poll_dead" => {
            // Not in any collective when the peer dies (as a data path waiting on that peer):
            // the store's push must reach it all the same.
            let s = TcpStore::from_env(timeout).expect("join the store");
            s.barrier().expect("first barrier");
            let victim = csv(arg)[0];
            println!("POLLING");
            let until = Instant::now() + timeout;
            while !s.is_dead(victim) && Instant::now() < until {
                thread::sleep(Duration::from_millis(1));
            }
            println!("DETECTED_MS={}", epoch_ms());
            assert!(s.is_dead(victim), "rank {victim} not seen dead within {timeout:?}");
            // The other survivors exit once they have failed, so they (and rank 0's store) may
            // be gone too by now; the victim must be listed and no collective may succeed.
            assert!(s.dead_ranks().contains(&victim), "{:?}", s.dead_ranks());
            match s.barrier() {
                Err(BootstrapError::PeerGone { .. } | BootstrapError::StoreLost { .. }) => {}
                other => panic!("expected PeerGone or StoreLost, got {other:?}"),
            }
        }
        "join_then_expect_store_lost" => {
            let s = TcpStore::from_env(timeout).expect("join the store");
            s.barrier().expect("first barrier");
            let t0 = Instant::now();
            // Rank 0 is killed right after the second barrier: its result may or may not have
            // left rank 0 by then, so that barrier may succeed or fail; the next call must fail.
            let res = s.barrier().and_then(|()| s.all_gather(b"after"));
            match res {
                Err(e @ BootstrapError::StoreLost { .. }) => {
                    assert!(t0.elapsed() < timeout, "not fast: {:?}", t0.elapsed());
                    assert!(e.to_string().contains("rank 0"), "{e}");
                    println!("failed as expected: {e}");
                }
                other => panic!("expected StoreLost, got {other:?}"),
            }
        }
        "two_alive" => {
            // A normal and a low-latency Buffer alive together, as DeepEP users keep them.
            let a = TcpStore::from_env(timeout).expect("store a");
            let b = TcpStore::from_env(timeout).expect("store b, alive with a");
            assert_eq!((a.instance(), b.instance()), (0, 1));
            assert_eq!(a.secret_source(), SecretSource::JobId, "torchrun-like: no secret given");
            for round in 0..4 {
                let (ga, gb) = if (a.rank() + round) % 2 == 0 {
                    let ga = a.all_gather(&tagged(0, a.rank(), round)).expect("a");
                    (ga, b.all_gather(&tagged(1, b.rank(), round)).expect("b"))
                } else {
                    // Both orders on different ranks: each instance must wait only for its own.
                    thread::scope(|sc| {
                        let hb = sc.spawn(|| b.all_gather(&tagged(1, b.rank(), round)));
                        let ga = a.all_gather(&tagged(0, a.rank(), round)).expect("a");
                        (ga, hb.join().expect("thread").expect("b"))
                    })
                };
                check_tagged(&ga, 0, round);
                check_tagged(&gb, 1, round);
            }
            a.barrier().expect("a last");
            drop(a);
            let gb = b.all_gather(&tagged(1, b.rank(), 9)).expect("b after a closed");
            check_tagged(&gb, 1, 9);
            drop(b);
            // And a third after both are gone (rank 0 starts a new server on the same port).
            let c = TcpStore::from_env(timeout).expect("store c");
            assert_eq!(c.instance(), 2);
            check_tagged(&c.all_gather(&tagged(2, c.rank(), 0)).expect("c"), 2, 0);
        }
        "sequential" => {
            let n: u64 = arg.parse().expect("count");
            let rank = env_usize("RANK");
            let mut ok = 0;
            for i in 0..n {
                // Rank-dependent jitter, so that ranks leave and arrive in varying order.
                thread::sleep(Duration::from_millis(((rank * 13 + i as usize * 7) % 23) as u64));
                let res = TcpStore::from_env(timeout).and_then(|s| {
                    assert_eq!(s.instance(), i);
                    let got = s.all_gather(&tagged(i, rank, 0))?;
                    check_tagged(&got, i, 0);
                    Ok(())
                });
                match res {
                    Ok(()) => ok += 1,
                    Err(e) => println!("iteration {i}: {e}"),
                }
            }
            println!("SEQUENTIAL_OK={ok}/{n}");
            assert_eq!(ok, n);
        }
        "emfile" => emfile_role(timeout),
        "expect_env" => match TcpStore::from_env(timeout) {
            Err(e @ BootstrapError::Env { .. }) => {
                let BootstrapError::Env { var, .. } = &e else { unreachable!() };
                assert_eq!(*var, arg, "{e}");
                assert!(e.to_string().contains(arg));
                println!("failed as expected: {e}");
            }
            other => panic!("expected Env error for {arg}, got {:?}", other.err()),
        },
        other => panic!("unknown {ROLE} '{other}'"),
    }
    println!("{CHILD_OK}");
}

// ---------------------------------------------------------------------------------------------
// Multi-process harness

fn child_args() -> Vec<String> {
    let mut args = common::child_args();
    args.push("--include-ignored".to_string());
    args
}

fn kv(k: &str, v: impl ToString) -> (String, String) {
    (k.to_string(), v.to_string())
}

/// Starts `world` ranks of this test binary; `rank_env(r)` gives rank `r` its role and overrides.
fn start(
    world: usize,
    local: usize,
    timeout_ms: u64,
    rank_env: &dyn Fn(usize) -> Vec<(String, String)>,
) -> LocalJob {
    let extra = [kv(TIMEOUT_MS, timeout_ms)];
    LocalJob::spawn_with(&common::exe(), &child_args(), world, local, &extra, rank_env)
        .expect("spawn ranks")
}

/// Every rank in `ranks` exited 0 after printing `CHILD_OK`.
/// `FEP_TEST_SHOW=1` prints every rank's output even when the test passes (to read the messages).
fn assert_ok(out: &[RankOutcome], ranks: impl IntoIterator<Item = usize>) {
    if std::env::var_os("FEP_TEST_SHOW").is_some() {
        eprintln!("{}", common::report(out));
    }
    for r in ranks {
        let o = &out[r];
        assert!(
            o.success() && o.stdout.contains(CHILD_OK),
            "rank {r} did not pass its role\n{}",
            common::report(out)
        );
    }
}

fn tcp_gather(world: usize, local: usize) {
    let start_t = Instant::now();
    let mut job = start(world, local, 10_000, &|_| vec![kv(ROLE, "gather")]);
    let out = job.wait(JOB_WALL).expect("wait");
    assert_ok(&out, 0..world);
    eprintln!("world {world}: {:?}", start_t.elapsed());
}

#[test]
fn tcp_all_gather_world_2() {
    tcp_gather(2, 2);
}

#[test]
fn tcp_all_gather_world_4_two_nodes() {
    tcp_gather(4, 2);
}

#[test]
fn tcp_all_gather_world_8() {
    tcp_gather(8, 3);
}

#[test]
fn tcp_wrong_job_id_is_refused_by_name() {
    // Same secret (the launcher's), another job id: told apart by name after proving the secret.
    let mut job = start(2, 2, 2000, &|r| match r {
        1 => vec![kv(ROLE, "expect_job_mismatch"), kv("FEP_JOB_ID", "intruder-job")],
        // The intruder is not counted as rank 1, so rank 0 times out naming it.
        _ => vec![kv(ROLE, "expect_timeout:1")],
    });
    let out = job.wait(JOB_WALL).expect("wait");
    assert_ok(&out, 0..2);
    assert!(out[1].stdout.contains("'intruder-job'"), "{}", common::report(&out));
}

#[test]
fn tcp_wrong_secret_is_refused_and_learns_nothing() {
    let mut job = start(2, 2, 2000, &|r| match r {
        1 => vec![kv(ROLE, "expect_auth"), kv("FEP_JOB_SECRET", "not-the-job-secret-at-all")],
        _ => vec![kv(ROLE, "expect_timeout:1")],
    });
    let out = job.wait(JOB_WALL).expect("wait");
    assert_ok(&out, 0..2);
}

#[test]
fn tcp_world_size_mismatch_is_refused_alone() {
    // The misconfigured rank fails at once; the job is not failed for it, so rank 0 waits for a
    // real rank 1 and then times out naming it, with the refusal in the message.
    let t0 = Instant::now();
    let mut job = start(2, 2, 3000, &|r| match r {
        1 => vec![kv(ROLE, "expect_world_mismatch:2"), kv("WORLD_SIZE", 3)],
        _ => vec![kv(ROLE, "expect_timeout:1")],
    });
    let out = job.wait(JOB_WALL).expect("wait");
    assert_ok(&out, 0..2);
    assert!(out[0].stdout.contains("WORLD_SIZE=3"), "{}", common::report(&out));
    assert!(t0.elapsed() >= Duration::from_secs(3), "the job failed early: {:?}", t0.elapsed());
}

/// `DETECTED_MS=` printed by rank `rank`.
fn detected_ms(out: &[RankOutcome], rank: usize) -> u128 {
    out[rank]
        .stdout
        .lines()
        .find_map(|l| l.split_once("DETECTED_MS=").map(|(_, v)| v))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("rank {rank} printed no detection time\n{}", common::report(out)))
}

#[test]
fn tcp_killed_rank_is_named_to_every_rank_within_2_s() {
    // Ranks 0 and 1 block in an all-gather, rank 3 is in no collective (polls is_dead, as a data
    // path would); rank 2 is killed. The timeout is far away: detection must not wait for it.
    let (world, victim, timeout_ms) = (4, 2, 20_000);
    let mut job = start(world, 4, timeout_ms, &|r| {
        let role = match r {
            _ if r == victim => "join_then_hang".to_string(),
            3 => format!("poll_dead:{victim}"),
            _ => format!("join_then_expect_gone:{victim}"),
        };
        vec![kv(ROLE, role)]
    });
    wait_for_line(&job, victim, "JOINED");
    wait_for_line(&job, 3, "POLLING");
    wait_for_line(&job, 0, "WAITING");
    wait_for_line(&job, 1, "WAITING");
    thread::sleep(Duration::from_millis(100)); // let them block in the all-gather
    let killed_at = epoch_ms();
    job.kill_rank(victim).expect("kill");
    let out = job.wait(JOB_WALL).expect("wait");
    assert_ok(&out, (0..world).filter(|&r| r != victim));
    assert!(out[victim].killed);
    let lat: Vec<(usize, u128)> = [0, 1, 3]
        .into_iter()
        .map(|r| (r, detected_ms(&out, r).saturating_sub(killed_at)))
        .collect();
    eprintln!("death of rank {victim} detected after (rank, ms): {lat:?}");
    for (r, ms) in lat {
        assert!(ms < 2000, "rank {r} took {ms} ms to learn rank {victim} died");
    }
}

/// Environment of a torchrun job: no FEP_* variables at all, the store on MASTER_PORT + 1, the
/// secret derived from the run id.
fn torchrun_env(role: &str, run_id: &str) -> Vec<(String, String)> {
    vec![
        kv(ROLE, role),
        kv("FEP_MASTER_PORT", ""),
        kv("FEP_JOB_ID", ""),
        kv("FEP_JOB_SECRET", ""),
        kv("TORCHELASTIC_RUN_ID", run_id),
    ]
}

#[test]
fn tcp_two_stores_alive_at_once_from_one_environment() {
    let run_id = format!("two-alive-{}", std::process::id());
    let mut job = start(3, 3, 10_000, &|_| torchrun_env("two_alive", &run_id));
    let out = job.wait(JOB_WALL).expect("wait");
    assert_ok(&out, 0..3);
}

#[test]
fn tcp_stores_created_and_destroyed_10_times_in_turn() {
    let run_id = format!("sequential-{}", std::process::id());
    let mut job = start(3, 3, 10_000, &|_| torchrun_env("sequential:10", &run_id));
    let out = job.wait(JOB_WALL).expect("wait");
    assert_ok(&out, 0..3);
    for o in &out {
        assert!(o.stdout.contains("SEQUENTIAL_OK=10/10"), "{}", common::report(&out));
    }
}

#[test]
fn tcp_store_out_of_descriptors_backs_off_and_recovers() {
    let mut job = start(1, 1, 10_000, &|_| vec![kv(ROLE, "emfile")]);
    let out = job.wait(JOB_WALL).expect("wait");
    assert_ok(&out, 0..1);
    // libtest's "test child_rank ... " may share the line: take the value from the key on.
    let line = |p: &str| {
        out[0]
            .stdout
            .lines()
            .find_map(|l| l.find(p).map(|i| l[i..].to_string()))
            .unwrap_or_default()
    };
    eprintln!("{} ; {}", line("CPU_MS="), line("JOINED_AFTER_MS="));
}

#[test]
fn tcp_killed_rank_0_is_reported_as_lost_store() {
    let world = 3;
    let mut job = start(world, 3, 6000, &|r| {
        vec![kv(ROLE, if r == 0 { "join_then_hang" } else { "join_then_expect_store_lost" })]
    });
    wait_for_line(&job, 0, "JOINED");
    job.kill_rank(0).expect("kill");
    let out = job.wait(JOB_WALL).expect("wait");
    assert_ok(&out, 1..world);
}

#[test]
fn tcp_rank_that_never_joins_is_named_in_the_timeout() {
    let t0 = Instant::now();
    let mut job = start(3, 3, 2000, &|r| {
        vec![kv(ROLE, if r == 1 { "exit_early" } else { "expect_timeout:1" })]
    });
    let out = job.wait(JOB_WALL).expect("wait");
    assert_ok(&out, 0..3);
    let took = t0.elapsed();
    assert!(took >= Duration::from_secs(2) && took < Duration::from_secs(12), "took {took:?}");
}

#[test]
fn tcp_missing_or_bad_env_var_is_named() {
    /// (variable the error must name, variables to set, variables to remove)
    type Case = (&'static str, &'static [(&'static str, &'static str)], &'static [&'static str]);
    let cases: [Case; 3] = [
        (
            "MASTER_ADDR",
            &[("MASTER_PORT", "29999"), ("RANK", "0"), ("WORLD_SIZE", "1")],
            &["MASTER_ADDR"],
        ),
        (
            "RANK",
            &[
                ("MASTER_ADDR", "127.0.0.1"),
                ("MASTER_PORT", "29999"),
                ("RANK", "abc"),
                ("WORLD_SIZE", "1"),
            ],
            &[],
        ),
        (
            "WORLD_SIZE",
            &[("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29999"), ("RANK", "0")],
            &["WORLD_SIZE"],
        ),
    ];
    let mut children = Vec::new();
    for (var, set, remove) in cases {
        let mut cmd = Command::new(common::exe());
        cmd.args(child_args()).env(ROLE, format!("expect_env:{var}")).env(TIMEOUT_MS, "1000");
        for k in ["FEP_MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE"].iter().chain(remove) {
            cmd.env_remove(k);
        }
        for (k, v) in set {
            cmd.env(k, v);
        }
        children.push((var, cmd.output().expect("run child")));
    }
    for (var, out) in children {
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains(CHILD_OK),
            "case {var}: {}\n{stdout}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// Waits (bounded) until rank `rank` has printed `line`.
fn wait_for_line(job: &LocalJob, rank: usize, line: &str) {
    let until = Instant::now() + Duration::from_secs(20);
    while Instant::now() < until {
        if std::fs::read_to_string(job.stdout_path(rank)).is_ok_and(|s| s.contains(line)) {
            return;
        }
        thread::sleep(Duration::from_millis(10));
    }
    panic!("rank {rank} never printed {line}");
}

// ---------------------------------------------------------------------------------------------
// In-process

fn run_threads<T: Send + 'static>(
    ranks: Vec<impl Bootstrap + 'static>,
    body: impl Fn(&dyn Bootstrap) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let body = Arc::new(body);
    let handles: Vec<_> = ranks
        .into_iter()
        .map(|b| {
            let body = Arc::clone(&body);
            thread::spawn(move || body(&b))
        })
        .collect();
    handles.into_iter().map(|h| h.join().expect("rank thread panicked")).collect()
}

#[test]
fn inproc_all_gather_2_to_16_threads() {
    for (world, local) in [(2, 2), (3, 2), (5, 5), (8, 4), (16, 8)] {
        let group = InProcGroup::new(world, local, Duration::from_secs(20)).expect("group");
        run_threads(group, move |b| {
            let local_world = local.min(world - b.rank() / local * local);
            gather_rounds(b, Some((b.rank() % local, local_world)));
        });
    }
}

#[test]
fn inproc_timeout_names_the_missing_rank() {
    let timeout = Duration::from_millis(300);
    let mut group = InProcGroup::new(4, 4, timeout).expect("group");
    let silent = group.remove(2); // alive, never calls
    let results = run_threads(group, |b| {
        let t0 = Instant::now();
        (b.all_gather(b"x"), t0.elapsed())
    });
    // The first rank to arrive waits the whole timeout; the others at most that long.
    let longest = results.iter().map(|(_, took)| *took).max().unwrap_or_default();
    assert!(longest >= timeout && longest < timeout * 10, "took {longest:?}");
    for (res, _) in results {
        match res {
            Err(BootstrapError::Timeout { missing, round: 0, .. }) => assert_eq!(missing, vec![2]),
            other => panic!("expected Timeout naming rank 2, got {other:?}"),
        }
    }
    drop(silent);
}

#[test]
fn inproc_dropped_rank_is_gone() {
    let mut group = InProcGroup::new(3, 3, Duration::from_secs(10)).expect("group");
    drop(group.remove(1));
    let results = run_threads(group, |b| {
        let t0 = Instant::now();
        (b.barrier(), t0.elapsed())
    });
    for (res, took) in results {
        assert!(matches!(res, Err(BootstrapError::PeerGone { rank: 1, .. })), "{res:?}");
        assert!(took < Duration::from_secs(5), "took {took:?}");
    }
}

// ---------------------------------------------------------------------------------------------
// Callback

/// A callback bootstrap per rank whose equal-length all-gather runs over an in-process group (what
/// a torch process group or MPI would do), checking the wrapper keeps lengths equal.
fn callback_group(world: usize) -> Vec<CallbackBootstrap> {
    InProcGroup::new(world, world, Duration::from_secs(20))
        .expect("group")
        .into_iter()
        .map(|ib| {
            let (rank, local) = (ib.rank(), ib.local_rank());
            let f = move |send: &[u8], recv: &mut [u8]| -> Result<(), String> {
                let all = ib.all_gather(send).map_err(|e| e.to_string())?;
                if recv.len() != send.len() * all.len() {
                    return Err(format!(
                        "recv is {} bytes for {} x {}",
                        recv.len(),
                        all.len(),
                        send.len()
                    ));
                }
                for (r, blob) in all.iter().enumerate() {
                    if blob.len() != send.len() {
                        return Err(format!(
                            "rank {r} sent {} bytes, we sent {}",
                            blob.len(),
                            send.len()
                        ));
                    }
                    recv[r * send.len()..(r + 1) * send.len()].copy_from_slice(blob);
                }
                Ok(())
            };
            CallbackBootstrap::new(rank, world, local, world, Box::new(f)).expect("callback")
        })
        .collect()
}

#[test]
fn callback_over_inproc_gathers_variable_blobs() {
    for world in [1, 2, 4, 7] {
        run_threads(callback_group(world), move |b| gather_rounds(b, Some((b.rank(), world))));
    }
}

#[test]
fn callback_failure_is_reported() {
    let b =
        CallbackBootstrap::new(0, 2, 0, 2, Box::new(|_, _| Err("process group aborted".into())))
            .expect("new");
    match b.all_gather(b"abc") {
        Err(e @ BootstrapError::Callback(_)) => {
            assert!(e.to_string().contains("process group aborted"), "{e}")
        }
        other => panic!("expected Callback error, got {other:?}"),
    }
    assert!(CallbackBootstrap::new(2, 2, 0, 2, Box::new(|_, _| Ok(()))).is_err());
}
