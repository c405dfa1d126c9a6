//! GPU proxy latency (issue 3), printed as one table:
//!
//! (a) GPU push -> CPU sees it. A one-thread kernel ping-pongs with the CPU: it pushes a command
//!     into the ring (mapped host memory), the CPU sees it and bumps a counter in mapped host
//!     memory, the kernel sees the counter and pushes the next. The kernel stamps clock64 after
//!     every round (converted to ns with %globaltimer over the whole run); the table gives the
//!     HALF round trip (GPU->CPU and CPU->GPU are not equally fast: it is their mean). Two CPU
//!     sides: `bare` (a CPU thread spinning on the ring head, publishing tail and the counter),
//!     and `proxy+loopback` (the real `Proxy` worker, `LoopbackTransport`, arrival counter).
//! (b) Kernel push -> remote arrival counter -> remote kernel sees it: two processes on the one
//!     GPU, each with its proxy over libfabric (`--provider`, default shm, mapped host buffers
//!     registered as host memory); rank 0's kernel pushes, rank 1's kernel waits for the arrival
//!     and pushes back, and so on. Half round trip, beside `fi_pingpong` (rdm endpoint, same
//!     provider and message size, half round trip as it reports usec/xfer) run in the same job.
//!     Two processes on one GPU time-slice unless MPS is running: the run says which.
//!
//! Measured on the H200 machine (`bash gpu-bundle/gpu-check.sh run`,
//! 16 CPUs, Debian's libfabric 1.17 carried in the bundle for both this and fi_pingpong):
//!
//! | path | bytes | one-way median | p99 | fi_pingpong (same provider, size) |
//! |---|---|---|---|---|
//! | (a) bare ring, CPU spin thread | 0 | 2.55 us | 2.61 us | |
//! | (a) proxy worker + loopback | 8 | 2.69 us | 2.75 us | |
//! | (b) shm, 2 procs, MPS | 8 / 64 / 4096 | 5.94 / 5.95 / 6.97 us | 9.6 / 9.2 / 11.2 us | 0.95 / 0.99 / 2.65 us |
//! | (b) tcp;ofi_rxm, 2 procs, MPS | 64 | 12.03 us | 19.0 us | 13.73 us |
//! | (b) shm, 2 procs, no MPS (time-sliced) | 64 | 2246 us | 2247 us | 1.34 us |
//!
//! (b)'s gap to fi_pingpong is the two GPU<->host-memory crossings per direction (kernel push seen
//! by the CPU, arrival counter seen by the kernel), about what (a) measures for a whole (a) round.
//!
//! `gpu_proxy_bench [--iters N] [--warmup N] [--sizes 8,64,4096] [--provider shm]
//!  [--remote-iters N] [--remote-warmup N] [--skip-local] [--skip-remote] [--label TEXT]`

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use clap::Parser;
use ep_bench::fabric::fi_pingpong;
use ep_bench::stats::Summary;
use fabric_ep::abi::{self, fep_cmd, fep_proxy_pingpong_params};
use fabric_ep::bootstrap::{Bootstrap, LocalJob, TcpStore};
use fabric_ep::cuda::{
    gpu_available, launch, DevErrorRecord, Device, DeviceBuffer, HostMapped, Stream,
};
use fabric_ep::protocol::plan::ImmCodec;
use fabric_ep::proxy::{
    CounterLayout, CounterMemory, LoopbackGroup, LoopbackOptions, Proxy, RingLayout, RingMemory,
};

// Shared with tests/gpu_proxy.rs; this example uses only part of it.
#[allow(dead_code)]
#[path = "../../tests/common/gpu_proxy.rs"]
mod gpu_proxy;
use gpu_proxy::{cycles, gpu_proxy_config, mapped_region, GpuRank, RankSetup};

const ROLE: &str = "FEP_GPU_PROXY_BENCH_ROLE";
const CAPACITY: u32 = 64;
const PHASE: u32 = 31;
/// Per-wait budget of the bench kernels (~30 s at 2 GHz): only a broken path runs into it.
const BUDGET: Duration = Duration::from_secs(30);

#[derive(Parser, Debug, Clone)]
struct Args {
    /// Timed rounds per case (after the warm-up rounds).
    #[arg(long, default_value_t = 20_000)]
    iters: u32,
    /// Warm-up rounds per case (same launch, not timed).
    #[arg(long, default_value_t = 1_000)]
    warmup: u32,
    /// Timed rounds of the two-process case (default: --iters).
    #[arg(long)]
    remote_iters: Option<u32>,
    /// Warm-up rounds of the two-process case (default: --warmup).
    #[arg(long)]
    remote_warmup: Option<u32>,
    /// Message sizes (bytes) of the two-process case and fi_pingpong.
    #[arg(long, value_delimiter = ',', default_value = "8,64,4096")]
    sizes: Vec<usize>,
    #[arg(long, default_value = "shm")]
    provider: String,
    #[arg(long)]
    skip_local: bool,
    #[arg(long)]
    skip_remote: bool,
    /// Free text put on every row (e.g. "MPS" or "time-sliced").
    #[arg(long, default_value = "")]
    label: String,
}

/// One row of the table.
struct Row {
    path: String,
    size: usize,
    half: Summary,
    round_trip_median_us: f64,
    note: String,
}

/// Per-round durations (us) from the kernel's clock64 stamps, converted with the globaltimer
/// span of the whole launch; the first `warmup` rounds are dropped. Also returns the mean round
/// from globaltimer alone (a check on the conversion).
fn rounds_us(ts: &[u64], gt: &[u64], warmup: usize) -> (Vec<f64>, f64) {
    let cycles_total = (ts[ts.len() - 1] - ts[0]) as f64;
    let ns_total = (gt[1] - gt[0]) as f64;
    let ns_per_cycle = if cycles_total > 0.0 { ns_total / cycles_total } else { 0.0 };
    let rounds: Vec<f64> =
        ts.windows(2).skip(warmup).map(|w| (w[1] - w[0]) as f64 * ns_per_cycle / 1e3).collect();
    (rounds, ns_total / 1e3 / (ts.len() - 1) as f64)
}

fn row(path: &str, size: usize, rounds: &[f64], mean_gt_us: f64, label: &str) -> Row {
    let mut half: Vec<f64> = rounds.iter().map(|r| r / 2.0).collect();
    let mut rt = rounds.to_vec();
    let half = Summary::of_us(&mut half);
    let rt = Summary::of_us(&mut rt);
    Row {
        path: path.to_string(),
        size,
        half,
        round_trip_median_us: rt.median_us,
        note: format!("mean round {mean_gt_us:.2} us (globaltimer){label}"),
    }
}

/// Timestamps + globaltimer buffers, the launch, a bounded wait, and the error record check.
fn run_pingpong(
    dev: &Device,
    stream: &Stream,
    err: &DevErrorRecord,
    mut p: fep_proxy_pingpong_params,
) -> Result<(Vec<u64>, Vec<u64>), String> {
    let ts = DeviceBuffer::zeroed(dev, 8 * (p.iters as usize + 1)).map_err(|e| e.to_string())?;
    let gt = DeviceBuffer::zeroed(dev, 16).map_err(|e| e.to_string())?;
    p.timestamps = ts.device_ptr();
    p.globaltimer = gt.device_ptr();
    p.dev_error = err.as_abi();
    // SAFETY: ring, counters, ts, gt and err outlive the synchronisation below.
    unsafe { launch::proxy_pingpong(stream, p) }.map_err(|e| e.to_string())?;
    stream.synchronize_within(Duration::from_secs(300)).map_err(|e| e.to_string())?;
    err.check().map_err(|e| e.to_string())?;
    Ok((ts.to_vec().map_err(|e| e.to_string())?, gt.to_vec().map_err(|e| e.to_string())?))
}

fn pingpong_params(
    ring: u64,
    arrivals: u64,
    base: u64,
    cmd: fep_cmd,
    iters: u32,
) -> fep_proxy_pingpong_params {
    fep_proxy_pingpong_params {
        ring,
        arrivals,
        timestamps: 0,
        globaltimer: 0,
        dev_error: Default::default(),
        budget_cycles: cycles(BUDGET, 2.0),
        arrival_base: base,
        cmd,
        capacity: CAPACITY,
        iters,
        initiator: 1,
        rank: 0,
        peer: 0,
        phase: PHASE,
    }
}

/// (a) bare: a CPU thread consumes the ring and answers through a mapped counter.
fn local_bare(dev: &Device, args: &Args) -> Result<Row, String> {
    let stream = Stream::new(dev).map_err(|e| e.to_string())?;
    let err = DevErrorRecord::new(dev).map_err(|e| e.to_string())?;
    let ring =
        HostMapped::new(dev, abi::ring_bytes(CAPACITY as usize)).map_err(|e| e.to_string())?;
    let counter = HostMapped::new(dev, 8).map_err(|e| e.to_string())?;
    let total = args.iters + args.warmup;
    let p = pingpong_params(ring.device_ptr(), counter.device_ptr(), 0, fep_cmd::default(), total);
    let stop = AtomicBool::new(false);
    let (res, consumed) = std::thread::scope(|s| {
        let h = s.spawn(|| -> Result<u64, String> {
            let head = ring.atomic_u64(0).map_err(|e| e.to_string())?;
            let tail = ring.atomic_u64(64).map_err(|e| e.to_string())?;
            let arr = counter.atomic_u64(0).map_err(|e| e.to_string())?;
            let deadline = Instant::now() + Duration::from_secs(120);
            let mut t = 0u64;
            while t < u64::from(total) && !stop.load(Ordering::Relaxed) {
                let h = head.load(Ordering::Acquire);
                while t < h {
                    let c: fep_cmd = ring
                        .read(128 + (t % u64::from(CAPACITY)) as usize * 32)
                        .map_err(|e| e.to_string())?;
                    if c.seq != t as u32 {
                        return Err(format!("bare consumer: seq {} at ticket {t}", c.seq));
                    }
                    t += 1;
                    tail.store(t, Ordering::Release);
                    arr.store(t, Ordering::Release);
                }
                if Instant::now() > deadline {
                    return Err(format!("bare consumer stuck at {t}"));
                }
                std::hint::spin_loop();
            }
            Ok(t)
        });
        let r = run_pingpong(dev, &stream, &err, p);
        stop.store(true, Ordering::Relaxed);
        (r, h.join().unwrap_or_else(|_| Err("consumer panicked".into())))
    });
    let (ts, gt) = res?;
    let consumed = consumed?;
    if consumed != u64::from(total) {
        return Err(format!("bare consumer saw {consumed} of {total} commands"));
    }
    let (rounds, mean) = rounds_us(&ts, &gt, args.warmup as usize);
    Ok(row("(a) GPU push -> CPU spin thread -> GPU (bare ring)", 0, &rounds, mean, &args.label))
}

/// (a) through the real proxy worker and the loopback transport.
fn local_proxy(dev: &Device, args: &Args, size: usize) -> Result<Row, String> {
    let e = |x: &dyn std::fmt::Display| x.to_string();
    let stream = Stream::new(dev).map_err(|x| e(&x))?;
    let err = DevErrorRecord::new(dev).map_err(|x| e(&x))?;
    let group = LoopbackGroup::host(1, size.max(64), size.max(64), LoopbackOptions::default())
        .map_err(|x| e(&x))?;
    let ring_layout = RingLayout::new(1, CAPACITY).map_err(|x| e(&x))?;
    let (ring_region, ring_dptr) = mapped_region(dev, ring_layout.bytes());
    let rings = RingMemory::new(ring_region, ring_layout).map_err(|x| e(&x))?;
    let counter_layout = CounterLayout { num_slots: 1, num_rings: 1 };
    let (counter_region, counters_dptr) = mapped_region(dev, counter_layout.bytes());
    let counters = CounterMemory::new(counter_region, counter_layout).map_err(|x| e(&x))?;
    let config = gpu_proxy_config(Duration::MAX);
    let transport = group.transport(0).map_err(|x| e(&x))?;
    let proxy =
        Proxy::start(config, rings, counters.clone(), vec![transport]).map_err(|x| e(&x))?;
    let total = args.iters + args.warmup;
    let cmd = fep_cmd {
        length: size as u32,
        imm: ImmCodec::default().encode(0, 1).map_err(|x| e(&x))?,
        ..Default::default()
    };
    let arrivals = counters_dptr + counter_layout.arrivals_offset() as u64;
    let p = pingpong_params(ring_dptr, arrivals, 0, cmd, total);
    let res = run_pingpong(dev, &stream, &err, p);
    let check = proxy.check().map_err(|x| e(&x));
    let arrived = counters.arrivals(0).map_err(|x| e(&x))?;
    proxy.shutdown().map_err(|x| e(&x))?;
    check?;
    let (ts, gt) = res?;
    if arrived != u64::from(total) {
        return Err(format!("proxy+loopback: {arrived} arrivals for {total} commands"));
    }
    let (rounds, mean) = rounds_us(&ts, &gt, args.warmup as usize);
    Ok(row("(a) GPU push -> proxy worker (loopback) -> GPU", size, &rounds, mean, &args.label))
}

/// A rank of the two-process ping-pong. Rank 0 prints `REMOTE <size> <rounds us...>` lines.
fn child(args: &Args) {
    let store = TcpStore::from_env(Duration::from_secs(30)).expect("join the store");
    let (rank, n) = (store.rank() as u32, store.world_size() as u32);
    assert_eq!(n, 2, "two ranks");
    let peer = 1 - rank;
    let gather = |d: &[u8]| store.all_gather(d).expect("all_gather");
    let max = args.sizes.iter().copied().max().unwrap_or(8).max(64);
    let setup = RankSetup {
        provider: args.provider.clone(),
        rank,
        num_ranks: n,
        send_bytes: max,
        recv_bytes: max * n as usize,
        capacity: CAPACITY,
        config: gpu_proxy_config(Duration::MAX),
    };
    let r = GpuRank::open(&setup, 0, &gather);
    let codec = ImmCodec::default();
    let iters = args.remote_iters.unwrap_or(args.iters);
    let warmup = args.remote_warmup.unwrap_or(args.warmup);
    let total = iters + warmup;
    let mut base = 0u64;
    for &size in &args.sizes {
        gather(b"go");
        let cmd = fep_cmd {
            local_offset: 0,
            remote_offset: (rank as usize * max) as u64,
            length: size as u32,
            dst_rank: peer,
            imm: codec.encode(rank, 1).expect("imm"),
            seq: 0,
        };
        let mut p = pingpong_params(r.ring_dptr, r.arrivals_dptr(peer), base, cmd, total);
        p.initiator = u32::from(rank == 0);
        p.rank = rank;
        p.peer = peer;
        let t = Instant::now();
        let (ts, gt) = run_pingpong(&r.dev, &r.stream, &r.err, p)
            .unwrap_or_else(|e| panic!("rank {rank} size {size}: {e}"));
        base += u64::from(total);
        let arrived = r.counters.arrivals(peer).unwrap();
        assert_eq!(arrived, base, "rank {rank}: arrivals from {peer}");
        if rank == 0 {
            let (rounds, mean) = rounds_us(&ts, &gt, warmup as usize);
            let list: Vec<String> = rounds.iter().map(|x| format!("{x:.3}")).collect();
            println!("REMOTE {size} {mean:.3} {}", list.join(" "));
            eprintln!("size {size}: {total} rounds in {:?}", t.elapsed());
        }
    }
    r.proxy.check().unwrap();
    gather(b"done");
    println!("CHILD_OK");
}

fn remote(args: &Args) -> Result<Vec<Row>, String> {
    let exe: PathBuf = std::env::current_exe().map_err(|e| e.to_string())?;
    let child_args: Vec<String> = std::env::args().skip(1).collect();
    let env = [(ROLE.to_string(), "1".to_string())];
    let mut job = LocalJob::spawn(&exe, &child_args, 2, 2, &env).map_err(|e| e.to_string())?;
    let out = job.wait(Duration::from_secs(400)).map_err(|e| e.to_string())?;
    let all = out.iter().map(|o| o.to_string()).collect::<String>();
    if !out.iter().all(|o| o.success() && o.stdout.contains("CHILD_OK")) {
        return Err(format!("two-process ping-pong failed:\n{all}"));
    }
    let mut rows = Vec::new();
    for line in out[0].stdout.lines().filter(|l| l.starts_with("REMOTE ")) {
        let mut f = line.split_whitespace().skip(1);
        let size: usize = f.next().and_then(|s| s.parse().ok()).ok_or("bad REMOTE line")?;
        let mean: f64 = f.next().and_then(|s| s.parse().ok()).ok_or("bad REMOTE line")?;
        let rounds: Vec<f64> = f.filter_map(|s| s.parse().ok()).collect();
        let path = format!("(b) kernel -> proxy -> {} -> proxy -> kernel, 2 procs", args.provider);
        rows.push(row(&path, size, &rounds, mean, &args.label));
    }
    Ok(rows)
}

fn main() {
    let args = Args::parse();
    if std::env::var_os(ROLE).is_some() {
        child(&args);
        return;
    }
    if !gpu_available() {
        eprintln!("SKIP: no GPU visible (gpu_available() is false)");
        return;
    }
    let mps = std::env::var_os("CUDA_MPS_PIPE_DIRECTORY").is_some();
    let dev = Device::from_env().expect("open the GPU");
    println!(
        "gpu_proxy_bench: {} ({} SMs), iters {} + warm-up {}, provider {}, MPS env {}",
        dev.name(),
        dev.sm_count(),
        args.iters,
        args.warmup,
        args.provider,
        if mps { "set" } else { "unset (two processes time-slice the GPU)" }
    );
    let mut rows: Vec<Row> = Vec::new();
    let mut failed = false;
    if !args.skip_local {
        for r in [local_bare(&dev, &args), local_proxy(&dev, &args, 8)] {
            match r {
                Ok(row) => rows.push(row),
                Err(e) => {
                    eprintln!("FAILED: {e}");
                    failed = true;
                }
            }
        }
    }
    let mut fi_rows = Vec::new();
    if !args.skip_remote {
        match remote(&args) {
            Ok(r) => rows.extend(r),
            Err(e) => {
                eprintln!("FAILED: {e}");
                failed = true;
            }
        }
        for &size in &args.sizes {
            let iters = args.remote_iters.unwrap_or(args.iters).max(1000) as usize;
            fi_rows.push((size, iters, fi_pingpong(&args.provider, size, iters)));
        }
    }
    println!();
    println!(
        "| path | bytes | one-way median (us) | one-way p99 (us) | round trip median (us) | rounds | note |"
    );
    println!("|---|---|---|---|---|---|---|");
    for r in &rows {
        println!(
            "| {} | {} | {:.2} | {:.2} | {:.2} | {} | {} |",
            r.path,
            r.size,
            r.half.median_us,
            r.half.p99_us,
            r.round_trip_median_us,
            r.half.n,
            r.note
        );
        println!(
            "PROXY_RESULT path=\"{}\" bytes={} half_median_us={:.3} half_p99_us={:.3}{}",
            r.path,
            r.size,
            r.half.median_us,
            r.half.p99_us,
            if args.label.is_empty() {
                String::new()
            } else {
                format!(" label=\"{}\"", args.label)
            }
        );
    }
    for (size, iters, r) in &fi_rows {
        match r {
            Ok(pp) => {
                println!(
                    "| fi_pingpong -p {} -e rdm (msg send/recv, CPU only) | {size} | {:.2} | - | - | {iters} | usec/xfer as printed ({:.1} MB/s) |",
                    args.provider, pp.usec_per_xfer, pp.mbps
                );
                println!(
                    "FI_PINGPONG provider={} bytes={size} usec_per_xfer={:.3}",
                    args.provider, pp.usec_per_xfer
                );
            }
            Err(e) => {
                println!("| fi_pingpong -p {} | {size} | n/a | - | - | - | {e} |", args.provider)
            }
        }
    }
    if failed {
        std::process::exit(1);
    }
}
