//! Normal mode's forced-internode GPU path: 2 processes x 1 rank per node on one GPU (run it
//! under MPS so the two processes' kernels are co-resident), every byte between the ranks through
//! the CPU proxy over libfabric (`--provider`, default shm; mapped host buffers), at DeepEP's
//! standard settings (4096 tokens per rank, hidden 7168, top-8 of 256 experts, fp8 dispatch,
//! bf16 combine), for each `--chunks` size and `--slots` count. Every step is checked against the reference.
//!
//! Printed per chunk size and mode (rank 0's CUDA-event times, median and p99):
//! - `cached`: dispatch with a cached handle (the dispatch kernel alone) and combine;
//! - `fresh`: GPU layout + notify + one host sync + dispatch, and combine.
//!
//! GB/s two ways: DeepEP's (bytes of the tokens this rank sends in dispatch / receives in
//! combine, its own copy included) and `proxy` (only the bytes that crossed the proxy: tokens
//! sent to the other node). Then `fi_pingpong -p <provider> -e rdm` at the same message size (the
//! dispatch chunk write: chunk_tokens x record bytes) in the same run, `--pingpong-runs` times
//! per size (default 3; its figure moves by tens of percent between runs on the shared host), and
//! the ratio of the proxy dispatch GB/s to the best of those runs.
//!
//! `--one-way`: rank 1 routes its tokens to its own experts, so the proxy carries rank 0's
//! dispatch one way and its combine the other, one direction at a time (as fi_pingpong loads the
//! link); the default routing loads both directions at once.
//!
//! `gpu_normal_proxy_bench [--chunks 16,32,64] [--slots 8,32] [--iters 20] [--warmup 3]
//!  [--provider shm] [--tokens 4096] [--pingpong-iters 2000] [--pingpong-runs 3]`

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use ep_bench::ep::rank_inputs;
use ep_bench::ep_gpu::{run_normal_gpu_rank, GpuBenchParams, GpuSplit};
use ep_bench::fabric::fi_pingpong;
use ep_bench::stats::Summary;
use fabric_ep::bootstrap::{Bootstrap, LocalJob, TcpStore};
use fabric_ep::cuda::{gpu_available, Device, DeviceTrace};
use fabric_ep::protocol::config::{DispatchDtype, EpConfig, EpSettings};
use fabric_ep::protocol::layout::dispatch_layout;
use fabric_ep::protocol::plan::NormalLayout;

const ROLE: &str = "FEP_GPU_NORMAL_PROXY_BENCH_ROLE";

#[derive(Parser, Debug, Clone)]
struct Args {
    /// Records per chunk (one proxy write each), one run per value.
    #[arg(long, value_delimiter = ',', default_value = "16,32,64")]
    chunks: Vec<usize>,
    /// Chunks in flight per pair, one run per value (with every chunk size).
    #[arg(long, value_delimiter = ',', default_value = "8")]
    slots: Vec<usize>,
    #[arg(long, default_value_t = 20)]
    iters: usize,
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    #[arg(long, default_value = "shm")]
    provider: String,
    /// Tokens per rank.
    #[arg(long, default_value_t = 4096)]
    tokens: usize,
    /// SM budget per rank.
    #[arg(long, default_value_t = 32)]
    sms: usize,
    #[arg(long, default_value_t = 2000)]
    pingpong_iters: usize,
    /// fi_pingpong runs per write size (its figure varies from run to run on a shared host):
    /// the ratio is taken against the best of them.
    #[arg(long, default_value_t = 3)]
    pingpong_runs: usize,
    /// Internal: the chunk size a rank process runs.
    #[arg(long, hide = true, default_value_t = 0)]
    child_chunk: usize,
    /// Internal: the slots per pair a rank process runs.
    #[arg(long, hide = true, default_value_t = 0)]
    child_slots: usize,
    /// After the timed runs, this many more cached-handle steps with the event trace on: each
    /// rank prints where its proxy-lane chunks spend their time (`bench::trace::
    /// normal_proxy_spans`). Needs a diagnosis build (`FEP_TRACE_NORMAL=1 cargo build ...`):
    /// the normal kernels carry no trace points otherwise.
    #[arg(long, default_value_t = 0)]
    trace: usize,
    /// Rank 1 routes its tokens to its own experts only: rank 0's dispatch goes to rank 1 and
    /// rank 1's combine answers come back, one direction at a time as in fi_pingpong (default:
    /// both ranks send to each other at once, DeepEP's random routing).
    #[arg(long)]
    one_way: bool,
}

fn params(a: &Args) -> GpuBenchParams {
    GpuBenchParams {
        num_tokens: a.tokens,
        iters: a.iters,
        warmup: a.warmup,
        num_sms: Some(a.sms),
        timeout: Duration::from_secs(30),
        one_way: a.one_way,
        ..GpuBenchParams::normal_standard(2)
    }
}

/// Bytes this rank sends to the other node (tokens x fp8 token bytes), as the reference routes.
fn proxy_bytes(p: &GpuBenchParams, rank: usize) -> Result<(u64, u64), String> {
    let mut s = EpSettings::new(rank, 2, p.num_experts, p.hidden, p.num_topk);
    s.ranks_per_node = 1;
    s.max_tokens_per_rank = p.num_tokens;
    s.dispatch_dtype = DispatchDtype::Fp8E4m3;
    let cfg = EpConfig::new(s).map_err(|e| e.to_string())?;
    let hp = p.host_params();
    let inp = rank_inputs(&cfg, &hp, rank).map_err(|e| e.to_string())?;
    let lay = dispatch_layout(&inp.topk_idx, p.num_tokens, p.num_topk, p.num_experts, 2, 2)
        .map_err(|e| e.to_string())?;
    let other = lay.num_tokens_per_rank[1 - rank].max(0) as u64;
    let h = p.hidden as u64;
    Ok((other * cfg.dispatch_dtype.token_bytes(h), other * 2 * h))
}

fn child(a: &Args) {
    let store = TcpStore::from_env(Duration::from_secs(30)).expect("join the store");
    let rank = store.rank();
    let dev = Device::from_env().expect("open the GPU");
    let boot: Arc<dyn Bootstrap> = Arc::new(store);
    let p = params(a);
    let (pd, pc) = proxy_bytes(&p, rank).expect("proxy bytes");
    for cached in [true, false] {
        let s = GpuSplit {
            ranks_per_node: 1,
            provider: a.provider.clone(),
            chunk_tokens: Some(a.child_chunk),
            slots_per_peer: Some(a.child_slots),
            cached,
            back_to_back: 0,
        };
        let r = run_normal_gpu_rank(&dev, &p, &s, boot.clone())
            .unwrap_or_else(|e| panic!("rank {rank} chunk {} cached {cached}: {e}", a.child_chunk));
        let list = |v: &[f64]| v.iter().map(|x| format!("{:.3}", x * 1e6)).collect::<Vec<_>>();
        println!(
            "NPROXY rank={rank} chunk={} slots={} mode={} dispatch_bytes={} combine_bytes={} \
             proxy_dispatch_bytes={pd} proxy_combine_bytes={pc} d_us={} c_us={}",
            a.child_chunk,
            a.child_slots,
            if cached { "cached" } else { "fresh" },
            r.dispatch_bytes,
            r.combine_bytes,
            list(&r.dispatch_s).join(","),
            list(&r.combine_s).join(",")
        );
    }
    if a.trace > 0 {
        traced(a, &dev, &p, rank, boot.clone());
    }
    boot.barrier().expect("final barrier");
    println!("CHILD_OK");
}

/// `--trace`: `a.trace` cached steps with the device and host trace on; prints one NPTRACE line
/// per rank with its span table.
fn traced(a: &Args, dev: &Device, p: &GpuBenchParams, rank: usize, boot: Arc<dyn Bootstrap>) {
    if !fabric_ep::cuda::NORMAL_TRACE_POINTS {
        println!("NPTRACE rank={rank} this build has no normal-mode trace points: rebuild with FEP_TRACE_NORMAL=1");
        return;
    }
    // Installed before the Buffer exists and removed after it is gone: no kernel of this
    // process runs meanwhile (the trace is per process; each rank is one).
    let tr = DeviceTrace::install(dev, 1 << 20).expect("install the trace");
    fabric_ep::trace::enable_host();
    let tp = GpuBenchParams { iters: a.trace, warmup: 1, ..p.clone() };
    let s = GpuSplit {
        ranks_per_node: 1,
        provider: a.provider.clone(),
        chunk_tokens: Some(a.child_chunk),
        slots_per_peer: Some(a.child_slots),
        cached: true,
        back_to_back: 0,
    };
    run_normal_gpu_rank(dev, &tp, &s, boot).unwrap_or_else(|e| panic!("rank {rank} traced: {e}"));
    let mut recs = tr.read().expect("read the trace");
    recs.extend(fabric_ep::trace::take_host());
    recs.sort_by_key(|r| r.t_ns);
    drop(tr);
    let table = ep_bench::trace::span_table(&ep_bench::trace::normal_proxy_spans(&recs));
    for line in table.lines() {
        println!("NPTRACE rank={rank} chunk={} slots={} {line}", a.child_chunk, a.child_slots);
    }
}

struct Line {
    mode: String,
    dispatch_bytes: f64,
    combine_bytes: f64,
    proxy_d: f64,
    proxy_c: f64,
    d: Summary,
    c: Summary,
}

fn parse(line: &str) -> Option<Line> {
    let field = |k: &str| {
        line.split_whitespace().find_map(|w| w.strip_prefix(k).and_then(|v| v.strip_prefix('=')))
    };
    let num = |k: &str| field(k).and_then(|v| v.parse::<f64>().ok());
    let list = |k: &str| -> Vec<f64> {
        field(k).map(|v| v.split(',').filter_map(|x| x.parse().ok()).collect()).unwrap_or_default()
    };
    Some(Line {
        mode: field("mode")?.to_string(),
        dispatch_bytes: num("dispatch_bytes")?,
        combine_bytes: num("combine_bytes")?,
        proxy_d: num("proxy_dispatch_bytes")?,
        proxy_c: num("proxy_combine_bytes")?,
        d: Summary::of_us(&mut list("d_us")),
        c: Summary::of_us(&mut list("c_us")),
    })
}

fn run_chunk(chunk: usize, slots: usize) -> Result<Vec<Line>, String> {
    let exe: PathBuf = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    args.push(format!("--child-chunk={chunk}"));
    args.push(format!("--child-slots={slots}"));
    let env = [(ROLE.to_string(), "1".to_string())];
    let mut job = LocalJob::spawn(&exe, &args, 2, 2, &env).map_err(|e| e.to_string())?;
    let out = job.wait(Duration::from_secs(300)).map_err(|e| e.to_string())?;
    let all = out.iter().map(|o| o.to_string()).collect::<String>();
    if !out.iter().all(|o| o.success() && o.stdout.contains("CHILD_OK")) {
        return Err(format!("chunk {chunk}: a rank failed:\n{all}"));
    }
    for o in &out {
        for l in o.stdout.lines().filter(|l| l.starts_with("NPTRACE ")) {
            println!("{l}");
        }
    }
    Ok(out[0].stdout.lines().filter(|l| l.starts_with("NPROXY ")).filter_map(parse).collect())
}

fn main() {
    let a = Args::parse();
    if std::env::var_os(ROLE).is_some() {
        child(&a);
        return;
    }
    if !gpu_available() {
        eprintln!("SKIP: no GPU visible (gpu_available() is false)");
        return;
    }
    let mps = std::env::var_os("CUDA_MPS_PIPE_DIRECTORY").is_some();
    let dev = Device::from_env().expect("open the GPU");
    let p = params(&a);
    println!(
        "gpu_normal_proxy_bench: {} ({} SMs), 2 processes x 1 rank per node, provider {}, \
         {} tokens/rank, hidden {}, top-{} of {}, fp8 dispatch / bf16 combine, {} SMs/rank, \
         slots {:?}, iters {} + warm-up {}, routing {}, MPS env {}",
        dev.name(),
        dev.sm_count(),
        a.provider,
        p.num_tokens,
        p.hidden,
        p.num_topk,
        p.num_experts,
        a.sms,
        a.slots,
        a.iters,
        a.warmup,
        if a.one_way { "one-way (rank 1 keeps its tokens)" } else { "both ways (random)" },
        if mps { "set" } else { "unset (two processes time-slice the GPU)" }
    );
    drop(dev);
    let mut failed = false;
    println!(
        "| chunk | slots | write bytes | mode | dispatch us med / p99 | dispatch GB/s (DeepEP) | dispatch GB/s (proxy) | combine us med / p99 | combine GB/s (DeepEP) | combine GB/s (proxy) | fi_pingpong MB/s | proxy dispatch / fi_pingpong |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    let mut pingpong = std::collections::HashMap::new();
    for (&chunk, &slots) in a.chunks.iter().flat_map(|c| a.slots.iter().map(move |s| (c, s))) {
        let layout = NormalLayout::from_parts(
            2,
            p.num_experts as u64,
            p.hidden as u64,
            p.num_topk as u64,
            DispatchDtype::Fp8E4m3,
            chunk as u64,
            slots as u64,
        )
        .expect("layout");
        let write = chunk as u64 * layout.dispatch_record.bytes;
        let lines = match run_chunk(chunk, slots) {
            Ok(l) => l,
            Err(e) => {
                eprintln!("FAILED: {e}");
                failed = true;
                continue;
            }
        };
        // fi_pingpong at this write size, measured once per size (best of `pingpong_runs`).
        let pp_mbps = *pingpong.entry(write).or_insert_with(|| {
            let mut runs = Vec::new();
            for _ in 0..a.pingpong_runs.max(1) {
                match fi_pingpong(&a.provider, write as usize, a.pingpong_iters) {
                    Ok(r) => runs.push(r.mbps),
                    Err(e) => eprintln!("fi_pingpong -S {write}: {e}"),
                }
            }
            let best = runs.iter().copied().fold(f64::NAN, f64::max);
            let worst = runs.iter().copied().fold(f64::NAN, f64::min);
            println!(
                "FI_PINGPONG bytes={write} runs={} best_mbps={best:.1} worst_mbps={worst:.1}",
                runs.len()
            );
            best
        });
        for l in lines {
            let gbps = |bytes: f64, us: f64| bytes / (us * 1e-6) / 1e9;
            let (dd, dp) = (gbps(l.dispatch_bytes, l.d.median_us), gbps(l.proxy_d, l.d.median_us));
            let (cd, cp) = (gbps(l.combine_bytes, l.c.median_us), gbps(l.proxy_c, l.c.median_us));
            let ratio = dp * 1e3 / pp_mbps;
            println!(
                "| {chunk} | {slots} | {write} | {} | {:.0} / {:.0} | {dd:.2} | {dp:.2} | {:.0} / {:.0} | {cd:.2} | {cp:.2} | {pp_mbps:.0} | {ratio:.2} |",
                l.mode, l.d.median_us, l.d.p99_us, l.c.median_us, l.c.p99_us
            );
            println!(
                "NPROXY_RESULT provider={} one_way={} chunk={chunk} slots={slots} write_bytes={write} mode={} \
                 dispatch_us={:.1} dispatch_p99_us={:.1} dispatch_gbps={dd:.3} \
                 dispatch_proxy_gbps={dp:.3} combine_us={:.1} combine_p99_us={:.1} \
                 combine_gbps={cd:.3} combine_proxy_gbps={cp:.3} fi_pingpong_mbps={pp_mbps:.1} \
                 ratio={ratio:.3}",
                a.provider, a.one_way, l.mode, l.d.median_us, l.d.p99_us, l.c.median_us, l.c.p99_us
            );
        }
    }
    if failed {
        std::process::exit(1);
    }
}
