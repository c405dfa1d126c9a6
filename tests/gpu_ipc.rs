//! GPU: `Buffer` with `Backend::Gpu`, ranks as separate PROCESSES (2 and 4) sharing the GPU
//! (or, on a machine with as many GPUs as ranks, one GPU each): peers' comm buffers reached
//! through CUDA IPC. Every rank checks every output against the single-process reference
//! (src/protocol/reference.rs), as tests/gpu_buffer.rs does for ranks as threads: normal mode (bf16
//! and fp8, hidden 2048/4096/7168, two-step and `num_worst_tokens`) and low-latency (fp8 and
//! bf16, with and without the recv hook, DeepEP's shape). Plus a peer process that exits before
//! the dispatch: every other rank gets a typed timeout naming it, within the timeout.
//!
//! The test binary re-executes itself as the ranks (`LocalJob` + `TcpStore`, the path a torchrun
//! job takes). Processes sharing one GPU need MPS (their kernels spin on each other and must run
//! at once): scripts/gpu-check.sh's "ipc" section starts the control daemon around this binary.
//! Without a visible MPS daemon (and `FEP_TEST_IPC_WITHOUT_MPS` unset) the tests say SKIP, as
//! they do without a GPU (without MPS the processes time-slice the GPU: a step takes milliseconds,
//! and a wait longer than the timeout fails naming a peer). Ignored without `--include-ignored`
//! (CI has no GPU).

use std::sync::Arc;
use std::time::{Duration, Instant};

use ep_bench::ep_gpu::{run_ll_gpu_process, run_normal_gpu_rank, GpuBenchParams, GpuSplit};
use fabric_ep::bootstrap::{Bootstrap, RankOutcome, TcpStore};
use fabric_ep::cuda::{device_count, gpu_available, Device, DeviceBuffer, Stream};
use fabric_ep::ep::buffer::{Buffer, BufferOptions};
use fabric_ep::ep::gpu::{DevSlice, GpuLlDispatchArgs, GpuNotifyArgs, GpuOptions, PeerPath};
use fabric_ep::protocol::config::{DispatchDtype, EpConfig, EpSettings};
use fabric_ep::Error;

mod common;
use common::gpu::small;

const ROLE: &str = "FEP_GPU_IPC_ROLE";
const CHILD_OK: &str = "CHILD_OK";
const JOB_WALL: Duration = Duration::from_secs(240);
/// Device timeout of the dead-peer jobs.
const DEAD_TIMEOUT: Duration = Duration::from_secs(3);

/// A case string: `normal-<hidden>-<bf16|fp8>[-worst]`, `ll-<hidden>-<bf16|fp8>[-hook]`, or
/// `ll-std[-hook]` (DeepEP's low-latency shape: 128 tokens, hidden 7168, top-8 of 256, fp8).
fn params(case: &str, ranks: usize) -> (bool, GpuBenchParams) {
    let f: Vec<&str> = case.split('-').collect();
    let timeout = Duration::from_secs(20);
    if f[..] == ["ll", "std"] || f[..] == ["ll", "std", "hook"] {
        let p = GpuBenchParams {
            hook: f.len() == 3,
            iters: 2,
            warmup: 0,
            timeout,
            ..GpuBenchParams::ll_standard(ranks)
        };
        return (false, p);
    }
    let hidden: usize = f[1].parse().expect("hidden");
    let fp8 = match f[2] {
        "fp8" => true,
        "bf16" => false,
        d => panic!("dtype {d}"),
    };
    let flag = f.get(3).copied();
    match f[0] {
        "normal" => {
            let p = small(ranks, 300, hidden, fp8);
            let worst = flag == Some("worst");
            let drop_pct = if worst { 40 } else { p.drop_pct };
            (true, GpuBenchParams { worst, drop_pct, timeout, ..p })
        }
        "ll" => (
            false,
            GpuBenchParams { hook: flag == Some("hook"), timeout, ..small(ranks, 64, hidden, fp8) },
        ),
        m => panic!("mode {m}"),
    }
}

fn cfg(rank: usize, ranks: usize, timeout: Duration) -> EpConfig {
    let mut s = EpSettings::new(rank, ranks, 16, 512, 4);
    s.timeout = timeout;
    s.max_tokens_per_rank = 16;
    s.dispatch_dtype = DispatchDtype::Fp8E4m3;
    EpConfig::new(s).unwrap()
}

/// Every peer is reached through IPC (sharing this GPU when there are fewer GPUs than ranks),
/// and the SM budget counts the ranks on this GPU.
fn check_paths(dev: &Device, boot: &Arc<dyn Bootstrap>) {
    let (rank, n) = (boot.rank(), boot.world_size());
    let mut buf = Buffer::new(
        cfg(rank, n, Duration::from_secs(10)),
        boot.clone(),
        BufferOptions::gpu(GpuOptions::new(dev.clone())),
    )
    .unwrap_or_else(|e| panic!("rank {rank}: connect: {e}"));
    let gpu = buf.gpu().unwrap();
    let shared = n > device_count().unwrap();
    for (p, path) in gpu.peer_paths().iter().enumerate() {
        if p == rank {
            assert_eq!(*path, PeerPath::Local);
        } else if shared {
            assert_eq!(*path, PeerPath::Ipc { same_gpu: true }, "rank {rank} -> {p}");
        } else {
            assert!(matches!(path, PeerPath::Ipc { .. }), "rank {rank} -> {p}: {path:?}");
        }
    }
    let sms = dev.sm_count() as usize;
    let on_gpu = if shared { n } else { 1 };
    assert_eq!(gpu.num_sms(), (sms / on_gpu).min(32) & !1, "rank {rank}: SM budget");
    println!(
        "ok: rank {rank} reaches its {} peers through CUDA IPC, SM budget {}",
        n - 1,
        gpu.num_sms()
    );
    buf.destroy().unwrap();
}

fn run_cases(dev: &Device, boot: &Arc<dyn Bootstrap>, list: &str) {
    let (rank, n) = (boot.rank(), boot.world_size());
    check_paths(dev, boot);
    for case in list.split(',') {
        let t = Instant::now();
        let (normal, p) = params(case, n);
        let res = if normal {
            run_normal_gpu_rank(dev, &p, &GpuSplit::one_node(p.num_ranks), boot.clone())
        } else {
            run_ll_gpu_process(dev, &p, boot.clone())
        };
        let rep = res.unwrap_or_else(|e| panic!("rank {rank}: {case}: {e}"));
        assert_eq!(rep.dispatch_s.len(), p.iters);
        println!(
            "ok: {n} processes, rank {rank}: {case} ({} tokens, {} iterations checked, {:.1} s)",
            p.num_tokens,
            p.iters,
            t.elapsed().as_secs_f64()
        );
    }
}

/// Rank `dead` connects, then dies (SIGKILL) before the dispatch; every other rank's dispatch
/// (normal: its notify; low-latency: dispatch, then sync) must fail with a timeout naming it.
fn dead_peer(dev: &Device, boot: &Arc<dyn Bootstrap>, mode: &str, dead: usize) {
    let (rank, n) = (boot.rank(), boot.world_size());
    let mut buf = Buffer::new(
        cfg(rank, n, DEAD_TIMEOUT),
        boot.clone(),
        BufferOptions::gpu(GpuOptions::new(dev.clone())),
    )
    .unwrap_or_else(|e| panic!("rank {rank}: connect: {e}"));
    let gpu = buf.gpu().unwrap();
    let x = DeviceBuffer::zeroed(dev, 16 * 512 * 2).unwrap();
    let idx: Vec<i64> = (0..16 * 4).map(|i| (i % 16) as i64).collect();
    let idx = DeviceBuffer::from_slice(dev, &idx).unwrap();
    let stream = Stream::new(dev).unwrap();
    let mut handle = gpu.new_handle(16).unwrap();
    let ll_out = gpu.new_ll_dispatch_out().unwrap();
    // Every rank has mapped every other's buffers before anyone dies.
    boot.barrier().unwrap();
    if rank == dead {
        // SIGKILL: no destructor, no goodbye, like a crashed rank.
        // SAFETY: kill(2) on our own pid.
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    }
    let t = Instant::now();
    // SAFETY: every buffer outlives the stream synchronisation inside the calls below.
    let res = unsafe {
        match mode {
            "normal" => gpu
                .notify_gpu(&GpuNotifyArgs::new(DevSlice::of(&idx), 16, &stream), &mut handle)
                .map(|_| ()),
            "ll" => {
                let a = GpuLlDispatchArgs {
                    x: DevSlice::of(&x),
                    topk_idx: DevSlice::of(&idx),
                    num_tokens: 16,
                    use_fp8: true,
                    return_recv_hook: false,
                    stream: &stream,
                };
                gpu.low_latency_dispatch_gpu(&a, &ll_out).and_then(|_| gpu.sync_gpu(&stream))
            }
            m => panic!("mode {m}"),
        }
    };
    let took = t.elapsed();
    match res {
        Err(Error::Timeout { rank: r, phase, peers, .. }) => {
            assert_eq!(r, rank);
            assert_eq!(peers, vec![dead], "rank {rank} in {phase}");
            println!("timeout path: rank {rank} in {phase} names peers {peers:?} after {took:?} ({n} processes)");
        }
        other => panic!("rank {rank}: expected a timeout naming rank {dead}, got {other:?}"),
    }
    assert!(took < DEAD_TIMEOUT * 2 + Duration::from_secs(5), "rank {rank}: {took:?}");
    drop(x);
    // The dead rank never reaches the barrier: the bootstrap names it; the buffer is torn down.
    match buf.destroy() {
        Err(e) => println!("rank {rank}: destroy after the death: {e}"),
        Ok(()) => panic!("rank {rank}: destroy's barrier passed without rank {dead}"),
    }
}

/// The body of a rank process (`FEP_GPU_IPC_ROLE=cases:<case,...>` or `dead:<mode>:<rank>`); a
/// normal test run returns at once.
#[test]
fn child_rank() {
    let Ok(role) = std::env::var(ROLE) else { return };
    let boot: Arc<dyn Bootstrap> =
        Arc::new(TcpStore::from_env(Duration::from_secs(60)).expect("join the store"));
    let dev = Device::from_env().expect("open the GPU");
    match role.split_once(':') {
        Some(("cases", list)) => run_cases(&dev, &boot, list),
        Some(("dead", rest)) => {
            let (mode, r) = rest.split_once(':').expect("dead:<mode>:<rank>");
            dead_peer(&dev, &boot, mode, r.parse().expect("rank"));
        }
        _ => panic!("role {role}"),
    }
    println!("{CHILD_OK}");
}

fn run_job(n: usize, role: &str) -> Vec<RankOutcome> {
    common::run_child_ranks(n, &[(ROLE.to_string(), role.to_string())], JOB_WALL)
}

/// Every rank in `ok` exited cleanly and printed `CHILD_OK`; their "ok:" / "timeout path" lines
/// are echoed (scripts/gpu-check.sh runs with --nocapture).
fn assert_ok(what: &str, out: &[RankOutcome], ok: impl IntoIterator<Item = usize>) {
    let all = out.iter().map(|o| o.to_string()).collect::<String>();
    // A rank's first line follows libtest's "test child_rank ... " (--nocapture).
    for line in all.lines() {
        if let Some(i) = line.find("ok: ").or_else(|| line.find("timeout path")) {
            eprintln!("{}", &line[i..]);
        }
    }
    for r in ok {
        let o = &out[r];
        assert!(o.success() && o.stdout.contains(CHILD_OK), "{what}: rank {r} failed:\n{all}");
    }
}

/// The MPS control daemon's pipe directory holds its control pipe.
fn mps_running() -> bool {
    let dir = std::env::var("CUDA_MPS_PIPE_DIRECTORY").unwrap_or_else(|_| "/tmp/nvidia-mps".into());
    std::path::Path::new(&dir).join("control").exists()
}

/// A GPU, and MPS when `n` processes must share one.
fn ready(n: usize) -> bool {
    if !gpu_available() {
        eprintln!("SKIP: no GPU visible (gpu_available() is false)");
        return false;
    }
    let gpus = device_count().unwrap();
    if n > gpus && !mps_running() && std::env::var_os("FEP_TEST_IPC_WITHOUT_MPS").is_none() {
        eprintln!(
            "SKIP: {n} processes on {gpus} GPU(s) need the MPS control daemon (none found in \
             $CUDA_MPS_PIPE_DIRECTORY or /tmp/nvidia-mps): scripts/gpu-check.sh's ipc section \
             starts one"
        );
        return false;
    }
    true
}

#[test]
#[ignore = "needs a GPU (and MPS to share it): scripts/gpu-check.sh's ipc section runs it"]
fn processes_2_match_the_reference() {
    if !ready(2) {
        return;
    }
    let t = Instant::now();
    let cases = "normal-2048-bf16,normal-4096-fp8,normal-7168-bf16,normal-7168-fp8-worst,\
                 ll-2048-fp8,ll-2048-fp8-hook,ll-4096-bf16,ll-4096-bf16-hook";
    let out = run_job(2, &format!("cases:{cases}"));
    assert_ok("2 processes", &out, 0..2);
    eprintln!("2 processes: every case checked in {:?}", t.elapsed());
}

#[test]
#[ignore = "needs a GPU (and MPS to share it): scripts/gpu-check.sh's ipc section runs it"]
fn processes_4_match_the_reference() {
    if !ready(4) {
        return;
    }
    let t = Instant::now();
    let cases = "normal-2048-fp8,normal-4096-bf16,normal-7168-fp8,normal-4096-bf16-worst,\
                 ll-2048-bf16,ll-2048-bf16-hook,ll-7168-fp8-hook,ll-std,ll-std-hook";
    let out = run_job(4, &format!("cases:{cases}"));
    assert_ok("4 processes", &out, 0..4);
    eprintln!("4 processes: every case checked in {:?}", t.elapsed());
}

/// Named to run last (tests run in name order): a killed MPS client is the one case here that
/// could disturb the MPS server for whatever runs after it.
#[test]
#[ignore = "needs a GPU (and MPS to share it): scripts/gpu-check.sh's ipc section runs it"]
fn processes_x_peer_exiting_before_dispatch_is_named_by_every_other_rank() {
    if !ready(4) {
        return;
    }
    for mode in ["normal", "ll"] {
        let (n, dead) = (4, 3);
        let t = Instant::now();
        let out = run_job(n, &format!("dead:{mode}:{dead}"));
        assert_ok(&format!("{mode}, rank {dead} dies"), &out, (0..n).filter(|&r| r != dead));
        assert!(!out[dead].success(), "{mode}: the killed rank exited cleanly");
        assert!(t.elapsed() < Duration::from_secs(60), "{mode}: {:?}", t.elapsed());
        eprintln!("{mode}: dead peer named by every other rank, job {:?}", t.elapsed());
    }
}
