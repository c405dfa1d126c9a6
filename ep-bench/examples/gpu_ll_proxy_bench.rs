//! Low-latency dispatch and combine through the CPU proxy, forced internode on one GPU: two
//! processes x 1 rank per node (`ranks_per_node = 1`), so every message to the other rank is an
//! RMA write posted by the sender's proxy (libfabric, `--provider`), counted by the receiver's
//! proxy and polled by the receiving kernel (`ep::gpu::ll_proxy`). Run it under MPS (both
//! processes' kernels must be resident at once; scripts/gpu-check.sh's `llproxy` section starts
//! the daemon). Every case is checked against the reference first (`--checked` iterations), then
//! timed: `--iters` dispatch + combine pairs back to back on each rank's stream (no host barrier
//! or check in between; the last pair is checked), per phase = CUDA events around the send +
//! receive of that phase, on each rank. In the same run, `fi_pingpong` (the bundle's, same
//! provider) at the mean message size of each phase gives the fabric's own one-way latency;
//! the difference is what the GPU path (kernel -> ring -> proxy, counters -> kernel, staging
//! through mapped host memory) adds per phase.
//!
//! `--ipc-baseline`: each case also runs with both ranks on one node (the same processes and
//! kernels, CUDA IPC instead of the proxy), and `LLPROXY_SHARE` lines give the proxy's share of a
//! phase (proxy median - IPC median) and what of it exceeds fi_pingpong's latency.
//!
//! `--trace N`: before the timed loop, N pairs with the event trace on (`fabric_ep::trace`):
//! kernel points and both proxies' points on one clock, printed as a per-interval table
//! (`bench::trace`) and the timeline of one pair. `--threads`: the two ranks as threads of this
//! process instead (no MPS needed), same path through the proxies.
//!
//! `gpu_ll_proxy_bench [--provider shm] [--cases tiny,mid,standard] [--iters 2000] [--bf16]`
//! Cases: tiny = 1 token, hidden 128, top-1 of 2 experts (one message each way per phase);
//! mid = 16 tokens, hidden 2048, top-4 of 16; standard = 128 tokens, hidden 7168, top-8 of 256.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use ep_bench::ep::median_p99_us;
use ep_bench::ep_gpu::{run_ll_gpu_rank, GpuBenchParams, LlCase, LlRunOptions};
use ep_bench::fabric::fi_pingpong;
use fabric_ep::bootstrap::{Bootstrap, LocalJob, TcpStore};
use fabric_ep::cuda::{gpu_available, Device};
use fabric_ep::ep::ll_gpu::LlGpuConfig;

const ROLE: &str = "FEP_LL_PROXY_BENCH_ROLE";

#[derive(Parser, Debug, Clone)]
struct Args {
    #[arg(long, default_value = "shm")]
    provider: String,
    #[arg(long, default_value = "tiny,mid,standard")]
    cases: String,
    /// Timed dispatch + combine pairs per case.
    #[arg(long, default_value_t = 2000)]
    iters: usize,
    /// Checked iterations before the timed loop.
    #[arg(long, default_value_t = 3)]
    checked: usize,
    /// bf16 dispatch instead of fp8.
    #[arg(long)]
    bf16: bool,
    /// Hook mode (send, then the hook's receive) instead of one call per phase.
    #[arg(long)]
    hook: bool,
    /// Timed loop as CUDA-graph replays of a captured pair (only whole pairs are timed).
    #[arg(long)]
    graph: bool,
    /// fi_pingpong iterations per size.
    #[arg(long, default_value_t = 20000)]
    pingpong_iters: usize,
    /// Traced pairs before the timed loop (0: none).
    #[arg(long, default_value_t = 0)]
    trace: usize,
    /// Both ranks as threads of this process (no child processes, no MPS).
    #[arg(long)]
    threads: bool,
    /// Also run every case with both ranks on one node (same two processes, same kernels, CUDA
    /// IPC instead of the proxy) and print the proxy's share of a phase: proxy phase - IPC phase.
    #[arg(long)]
    ipc_baseline: bool,
}

/// Messages a rank receives per phase and call from its one peer: one per local expert.
fn msgs_per_call(p: &GpuBenchParams) -> usize {
    p.num_experts / p.num_ranks
}

/// Prints the trace's per-interval table and the timeline of the middle traced pair.
fn print_trace(name: &str, p: &GpuBenchParams, recs: &[fabric_ep::trace::TraceRecord]) {
    use ep_bench::trace::{breakdown, table, timeline};
    if recs.is_empty() {
        println!("TRACE {name}: no records");
        return;
    }
    println!("TRACE {name}: {} records", recs.len());
    print!("{}", table(&breakdown(recs, p.num_experts, msgs_per_call(p))));
    let begins: Vec<i64> = recs
        .iter()
        .filter(|r| r.rank == 0 && u32::from(r.kind) == fabric_ep::abi::FEP_TRACE_LL_SEND_BEGIN)
        .map(|r| r.t_ns)
        .collect();
    if begins.len() >= 3 {
        let mid = begins.len() / 2;
        println!("TRACE {name}: timeline of traced pair {mid} (from rank 0's dispatch send begin)");
        print!("{}", timeline(recs, begins[mid], begins[mid + 1] - begins[mid]));
    }
}

fn params(case: &str, a: &Args) -> Option<GpuBenchParams> {
    let (tokens, hidden, topk, experts) = match case {
        "tiny" => (1, 128, 1, 2),
        "mid" => (16, 2048, 4, 16),
        "standard" => (128, 7168, 8, 256),
        _ => return None,
    };
    Some(GpuBenchParams {
        num_ranks: 2,
        num_tokens: tokens,
        hidden,
        num_topk: topk,
        num_experts: experts,
        fp8: !a.bf16,
        iters: a.checked,
        warmup: 0,
        seed: 0x11b0,
        drop_pct: 0,
        timeout: Duration::from_secs(20),
        num_sms: None,
        worst: false,
        hook: a.hook,
        graph: false,
        one_way: false,
    })
}

/// Mean bytes per message rank `src` writes rank `dst` in each phase (dispatch: its tokens'
/// rows; combine: the answers to `dst`'s tokens), and the message count per phase.
fn msg_bytes(p: &GpuBenchParams, case: &LlCase, src: usize, dst: usize) -> (f64, f64, usize) {
    let (rows, msgs) = case.rows_between(p, src, dst);
    let (back, _) = case.rows_between(p, dst, src);
    let lc = LlGpuConfig {
        num_ranks: p.num_ranks,
        num_experts: p.num_experts,
        hidden: p.hidden,
        num_topk: p.num_topk,
        max_tokens_per_rank: p.num_tokens,
        use_fp8: p.fp8,
        round_scale: false,
        sm_budget: None,
        timeout: p.timeout,
    };
    let rec = lc.layout().map(|l| l.dispatch_record.bytes).unwrap_or(0) as f64;
    let d = rows as f64 * rec / msgs as f64;
    let c = back as f64 * 2.0 * p.hidden as f64 / msgs as f64;
    (d, c, msgs)
}

/// fi_pingpong iterations for one message of `bytes`: `--pingpong-iters`, fewer for large
/// messages (about 400 MB each way at most, at least 50 round trips).
fn phase_pingpong_iters(a: &Args, bytes: usize) -> usize {
    a.pingpong_iters.min((400_000_000 / bytes.max(1)).max(50))
}

/// The lane's proxy workers as the library reads them (`FEP_LL_PROXY_WORKERS`, else its
/// default), for the printed lines.
fn ll_workers() -> String {
    std::env::var("FEP_LL_PROXY_WORKERS")
        .unwrap_or_else(|_| fabric_ep::ep::gpu::ll_proxy::DEFAULT_LL_PROXY_WORKERS.to_string())
}

/// One rank per node over `--provider`, the timed loop and trace the flags ask for.
fn run_options(a: &Args, ranks_share_process: bool) -> LlRunOptions {
    LlRunOptions {
        ranks_per_node: 1,
        provider: Some(a.provider.clone()),
        timed_iters: a.iters,
        graph: a.graph,
        trace_pairs: a.trace,
        ranks_share_process,
    }
}

fn child(a: &Args) {
    let store = TcpStore::from_env(Duration::from_secs(60)).expect("join the store");
    let rank = store.rank();
    let boot: Arc<dyn Bootstrap> = Arc::new(store);
    let dev = Device::from_env().expect("open the GPU");
    let o = run_options(a, false);
    for name in a.cases.split(',') {
        let Some(p) = params(name, a) else { panic!("unknown case {name}") };
        let case = LlCase::new(&p).expect("reference");
        let rep = run_ll_gpu_rank(&dev, &p, &o, &case, rank, boot.clone())
            .unwrap_or_else(|e| panic!("rank {rank} case {name}: {e}"));
        for r in &rep.trace {
            println!("TRACEREC {name} {} {} {} {}", r.rank, r.t_ns, r.kind, r.arg);
        }
        let (dm, dp) = median_p99_us(&rep.report.dispatch_s);
        let (cm, cp) = median_p99_us(&rep.report.combine_s);
        let (ds, _) = median_p99_us(&rep.dispatch_send_s);
        let (cs, _) = median_p99_us(&rep.combine_send_s);
        let (pm, pp) = median_p99_us(&rep.pair_s);
        println!(
            "PHASES {name} {rank} {dm:.3} {dp:.3} {cm:.3} {cp:.3} {ds:.3} {cs:.3} {pm:.3} {pp:.3}"
        );
        println!(
            "HOST {name} {rank}: host enqueue {:.2} us per pair (GPU median pair {:.2} us{})",
            rep.host_enqueue_s * 1e6,
            if a.graph { pm } else { dm + cm },
            if a.graph { format!(", graph replay, p99 {pp:.2} us") } else { String::new() }
        );
        if a.ipc_baseline {
            // The same case, both ranks on one node: the kernels write each other's buffers
            // through CUDA IPC and no message goes through a proxy.
            let io =
                LlRunOptions { ranks_per_node: 2, provider: None, trace_pairs: 0, ..o.clone() };
            let rep = run_ll_gpu_rank(&dev, &p, &io, &case, rank, boot.clone())
                .unwrap_or_else(|e| panic!("rank {rank} case {name} (IPC baseline): {e}"));
            let (dm, _) = median_p99_us(&rep.report.dispatch_s);
            let (cm, _) = median_p99_us(&rep.report.combine_s);
            let (pm, _) = median_p99_us(&rep.pair_s);
            println!("IPCBASE {name} {rank} {dm:.3} {cm:.3} {pm:.3}");
        }
    }
    boot.barrier().expect("barrier");
    println!("CHILD_OK");
}

fn main() {
    let a = Args::parse();
    if std::env::var_os(ROLE).is_some() {
        child(&a);
        return;
    }
    if !gpu_available() {
        println!("SKIP: no GPU visible");
        return;
    }
    if a.threads {
        threads(&a);
        return;
    }
    let mps = std::env::var_os("CUDA_MPS_PIPE_DIRECTORY").is_some();
    println!(
        "gpu_ll_proxy_bench: 2 processes x 1 rank per node on one GPU, provider {}, {} proxy \
         workers, {} dispatch, hook {}, {} timed pairs per case after {} checked, MPS env {}",
        a.provider,
        ll_workers(),
        if a.bf16 { "bf16" } else { "fp8" },
        a.hook,
        a.iters,
        a.checked,
        if mps { "set" } else { "NOT set (kernels of the two processes time-slice)" }
    );
    let exe: PathBuf = std::env::current_exe().expect("current_exe");
    let args: Vec<String> = std::env::args().skip(1).collect();
    let env = [(ROLE.to_string(), "1".to_string())];
    let mut job = LocalJob::spawn(&exe, &args, 2, 2, &env).expect("spawn ranks");
    let out = job.wait(Duration::from_secs(300)).expect("wait for ranks");
    let all = out.iter().map(|o| o.to_string()).collect::<String>();
    if !out.iter().all(|o| o.success() && o.stdout.contains("CHILD_OK")) {
        eprintln!("ranks failed:\n{all}");
        std::process::exit(1);
    }
    println!(
        "| case | phase | rank | msgs to peer | mean bytes/msg | median us | p99 us | \
         fi_pingpong us/xfer (same size) | added by the GPU path (median - pingpong) |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for line in out.iter().flat_map(|o| o.stdout.lines()).filter(|l| l.starts_with("HOST ")) {
        println!("{line}");
    }
    let mut failed = false;
    for name in a.cases.split(',') {
        let Some(p) = params(name, &a) else { continue };
        let case = LlCase::new(&p).expect("reference");
        for (rank, o) in out.iter().enumerate() {
            let Some(line) =
                o.stdout.lines().find(|l| l.starts_with(&format!("PHASES {name} {rank} ")))
            else {
                failed = true;
                continue;
            };
            let f: Vec<f64> =
                line.split_whitespace().skip(3).filter_map(|x| x.parse().ok()).collect();
            if f.len() != 8 {
                failed = true;
                continue;
            }
            let (d, c, msgs) = msg_bytes(&p, &case, rank, 1 - rank);
            let ipc: Option<Vec<f64>> = o
                .stdout
                .lines()
                .find(|l| l.starts_with(&format!("IPCBASE {name} {rank} ")))
                .map(|l| l.split_whitespace().skip(3).filter_map(|x| x.parse().ok()).collect());
            let ipc = ipc.filter(|v| v.len() == 3);
            if a.ipc_baseline && ipc.is_none() {
                failed = true;
            }
            if a.graph {
                // Whole pairs only: half a pair against fi_pingpong at the dispatch size.
                let size = (d.round() as usize).max(1);
                let pp = fi_pingpong(&a.provider, size, a.pingpong_iters);
                let (pp_s, added) = match &pp {
                    Ok(r) => (
                        format!("{:.2}", r.usec_per_xfer),
                        format!("{:.2}", f[6] / 2.0 - r.usec_per_xfer),
                    ),
                    Err(e) => (format!("n/a ({e})"), "n/a".into()),
                };
                println!(
                    "| {name} | pair (graph replay) | {rank} | {msgs} | {d:.0} | {:.2} | {:.2} | \
                     {pp_s} | {added} (half a pair) |",
                    f[6], f[7]
                );
                println!(
                    "LLPROXY_RESULT provider={} case={name} phase=pair_graph rank={rank} \
                     bytes={size} median_us={:.2} p99_us={:.2} fi_pingpong_us={pp_s} \
                     added_half_pair_us={added}",
                    a.provider, f[6], f[7]
                );
                if let (Some(v), Ok(r)) = (&ipc, &pp) {
                    let share = (f[6] - v[2]) / 2.0;
                    println!(
                        "LLPROXY_SHARE provider={} case={name} phase=half_pair_graph rank={rank} \
                         proxy_median_us={:.2} ipc_median_us={:.2} proxy_share_us={share:.2} \
                         fi_pingpong_us={:.2} share_over_pingpong_us={:.2}",
                        a.provider,
                        f[6] / 2.0,
                        v[2] / 2.0,
                        r.usec_per_xfer,
                        share - r.usec_per_xfer
                    );
                }
                continue;
            }
            if a.hook {
                println!(
                    "| {name} | (hook) send part of the phase, median | {rank} | dispatch {:.2} us | \
                     combine {:.2} us | (the rest is the hook's receive) |",
                    f[4], f[5]
                );
            }
            for (i, (phase, med, p99, bytes)) in
                [("dispatch", f[0], f[1], d), ("combine", f[2], f[3], c)].into_iter().enumerate()
            {
                let size = (bytes.round() as usize).max(1);
                let pp = fi_pingpong(&a.provider, size, a.pingpong_iters);
                let (pp_s, added) = match &pp {
                    Ok(r) => {
                        (format!("{:.2}", r.usec_per_xfer), format!("{:.2}", med - r.usec_per_xfer))
                    }
                    Err(e) => (format!("n/a ({e})"), "n/a".into()),
                };
                println!(
                    "| {name} | {phase} | {rank} | {msgs} | {bytes:.0} | {med:.2} | {p99:.2} | {pp_s} | {added} |"
                );
                println!(
                    "LLPROXY_RESULT provider={} case={name} phase={phase} rank={rank} bytes={size} \
                     median_us={med:.2} p99_us={p99:.2} fi_pingpong_us={pp_s} added_us={added}",
                    a.provider
                );
                // The same bytes as ONE message (every message of the phase to the peer): what
                // the fabric alone needs to move them, a floor for a bandwidth-bound phase.
                let phase_bytes = size * msgs;
                let pp_phase = if msgs > 1 {
                    Some(fi_pingpong(
                        &a.provider,
                        phase_bytes,
                        phase_pingpong_iters(&a, phase_bytes),
                    ))
                } else {
                    None
                };
                let phase_s = match &pp_phase {
                    Some(Ok(r)) => format!("{:.2}", r.usec_per_xfer),
                    Some(Err(e)) => format!("n/a ({e})"),
                    None => "same".into(),
                };
                println!(
                    "LLPROXY_PHASE provider={} case={name} phase={phase} rank={rank} \
                     workers={} phase_bytes={phase_bytes} median_us={med:.2} \
                     fi_pingpong_phase_bytes_us={phase_s}",
                    a.provider,
                    ll_workers()
                );
                if let (Some(v), Ok(r)) = (&ipc, &pp) {
                    // The proxy's share: what the phase costs beyond the same kernels over IPC,
                    // then what of that is beyond the fabric's own one-way latency (at the mean
                    // message size, and at the phase's bytes as one message).
                    let share = med - v[i];
                    let over_phase = match &pp_phase {
                        Some(Ok(q)) => format!("{:.2}", share - q.usec_per_xfer),
                        Some(Err(_)) => "n/a".into(),
                        None => format!("{:.2}", share - r.usec_per_xfer),
                    };
                    println!(
                        "LLPROXY_SHARE provider={} case={name} phase={phase} rank={rank} \
                         workers={} proxy_median_us={med:.2} ipc_median_us={:.2} \
                         proxy_share_us={share:.2} fi_pingpong_us={:.2} \
                         share_over_pingpong_us={:.2} share_over_phase_bytes_pingpong_us={over_phase}",
                        a.provider,
                        ll_workers(),
                        v[i],
                        r.usec_per_xfer,
                        share - r.usec_per_xfer
                    );
                }
            }
        }
    }
    if failed {
        eprintln!("missing PHASES lines:\n{all}");
        std::process::exit(1);
    }
    if a.trace > 0 {
        for name in a.cases.split(',') {
            let Some(p) = params(name, &a) else { continue };
            let tag = format!("TRACEREC {name} ");
            let mut recs: Vec<fabric_ep::trace::TraceRecord> = out
                .iter()
                .flat_map(|o| o.stdout.lines())
                .filter_map(|l| l.strip_prefix(&tag))
                .filter_map(|l| {
                    let f: Vec<i64> = l.split_whitespace().filter_map(|x| x.parse().ok()).collect();
                    (f.len() == 4).then(|| fabric_ep::trace::TraceRecord {
                        t_ns: f[1],
                        kind: f[2] as u16,
                        rank: f[0] as u16,
                        arg: f[3] as u32,
                    })
                })
                .collect();
            recs.sort_by_key(|r| r.t_ns);
            print_trace(name, &p, &recs);
        }
    }
}

/// `--threads`: both ranks in this process (no MPS), same options; rank 0's CUDA-event
/// medians and, with `--trace`, the trace.
fn threads(a: &Args) {
    let dev = Device::from_env().expect("open the GPU");
    let o = run_options(a, true);
    println!(
        "gpu_ll_proxy_bench --threads: 2 ranks as threads x 1 rank per node, provider {}, hook {}",
        a.provider, a.hook
    );
    for name in a.cases.split(',') {
        let Some(p) = params(name, a) else { panic!("unknown case {name}") };
        let reps = ep_bench::ep_gpu::run_ll_gpu_threads(&dev, &p, &o)
            .unwrap_or_else(|e| panic!("case {name}: {e}"));
        for (rank, rep) in reps.iter().enumerate() {
            let (dm, dp) = median_p99_us(&rep.report.dispatch_s);
            let (cm, cp) = median_p99_us(&rep.report.combine_s);
            println!(
                "THREADS {name} rank {rank}: dispatch {dm:.2} us (p99 {dp:.2}), combine {cm:.2} us \
                 (p99 {cp:.2}), host enqueue {:.2} us per pair",
                rep.host_enqueue_s * 1e6
            );
        }
        print_trace(name, &p, &reps[0].trace);
    }
}
