//! ep-bench: the benchmark runner (the project's main job).
//!
//! One file: it is the binary's glue (the clap `Cli`/`Common`, launching or joining the ranks,
//! printing and writing rows) around the crate's library (src/lib.rs), where the reusable work
//! lives.
//!
//! With no arguments it launches its ranks itself as local processes; when the torchrun /
//! PyTorchJob variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...) or Open MPI's are set
//! it joins that job as one rank instead.

use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use ep_bench::fabric::{self as fb, FabricRow, PingpongRow};
use ep_bench::report::{self, EpRow, RunSettings};
use fabric_ep::bootstrap::{Bootstrap, LocalJob, TcpStore};

#[derive(Parser, Debug)]
#[command(name = "ep-bench", version, about = "fabric-ep benchmark runner")]
struct Cli {
    #[command(subcommand)]
    cmd: Option<Cmd>,
    #[command(flatten)]
    common: Common,
}

#[derive(Args, Debug, Clone)]
struct Common {
    /// Number of ranks to launch locally (ignored when joining a torchrun/MPI/Kubernetes job).
    #[arg(long, default_value_t = 4, global = true)]
    ranks: usize,
    /// Ranks per node; below --ranks it forces the internode (libfabric) path.
    #[arg(long, global = true)]
    ranks_per_node: Option<usize>,
    /// libfabric provider: shm, tcp, "tcp;ofi_rxm", "udp;ofi_rxd", efa (default: $FI_PROVIDER,
    /// libfabric's own variable, else shm).
    #[arg(long, env = "FI_PROVIDER", default_value = "shm", global = true)]
    provider: String,
    /// Seconds any rank may wait for a peer before failing (default: $FEP_TIMEOUT_S, else 60;
    /// `verify`: 20, each case's deadline following from it).
    #[arg(long, env = "FEP_TIMEOUT_S", global = true)]
    timeout: Option<u64>,
    /// EP mode (normal / low-latency dispatch+combine).
    #[arg(long, value_enum, default_value_t = Mode::Both, global = true)]
    mode: Mode,
    /// gpu | host (default: gpu when one is present, else host).
    #[arg(long, value_enum, global = true)]
    backend: Option<Backend>,
    /// Tokens per rank (default: normal mode 512 on the host backend, 4096 on the GPU;
    /// low-latency 128, also its maximum per rank; `plan` 4096).
    #[arg(long, global = true)]
    tokens: Option<usize>,
    /// Hidden size: channels per token.
    #[arg(long, default_value_t = 7168, global = true)]
    hidden: usize,
    /// Experts each token selects.
    #[arg(long, default_value_t = 8, global = true)]
    topk: usize,
    /// Experts in all, spread evenly over the ranks.
    #[arg(long, default_value_t = 256, global = true)]
    experts: usize,
    /// FP8 dispatch (e4m3, one fp32 scale per 128 channels).
    #[arg(long, global = true)]
    fp8: bool,
    /// Write the result rows (every setting of the run in each) as JSON to FILE; without FILE,
    /// or with "-", print them after the table.
    #[arg(long, global = true, value_name = "FILE", num_args = 0..=1, default_missing_value = "-")]
    json: Option<std::path::PathBuf>,
    /// Write the result rows as CSV to FILE (header row of field names); without FILE, or with
    /// "-", print them after the table.
    #[arg(long, global = true, value_name = "FILE", num_args = 0..=1, default_missing_value = "-")]
    csv: Option<std::path::PathBuf>,
    /// Run once per token count (comma list) and collect every row; with --plot, draw them.
    #[arg(long, value_delimiter = ',')]
    sweep_tokens: Vec<usize>,
    /// Run once per rank count (comma list) and collect every row; with --plot, draw them.
    #[arg(long, value_delimiter = ',')]
    sweep_ranks: Vec<usize>,
    /// Write an SVG plot of median latency over the sweep to this file.
    #[arg(long)]
    plot: Option<std::path::PathBuf>,
    /// GPU backend: bf16 dispatch instead of its default, fp8 (DeepEP's standard setting).
    #[arg(long, conflicts_with = "fp8")]
    bf16: bool,
    /// GPU backend: run the ranks as local processes (CUDA IPC between them) instead of threads
    /// of one process. Processes sharing one GPU need the MPS control daemon
    /// (`nvidia-cuda-mps-control -d`), or their kernels time-slice (slow steps, timeouts).
    #[arg(long, global = true)]
    procs: bool,
    /// GPU backend, low-latency: also time the step captured once in a CUDA graph and
    /// replayed (each replay checked like an eager step).
    #[arg(long)]
    cuda_graph: bool,
    /// GPU backend, normal mode: after the first step, dispatch with the cached handle (no
    /// layout, no notify, no host count sync), so the dispatch row times the data path alone
    /// (its op reads "dispatch (cached)"; every step still checked).
    #[arg(long, global = true)]
    cached: bool,
    /// GPU backend, normal mode: skip the NCCL all-to-all (+ permute) comparison.
    #[arg(long)]
    no_nccl: bool,
    /// GPU backend: the SM budget per rank (blocks per kernel launch; even), both modes,
    /// instead of the defaults (normal: the GPU's SMs shared by the ranks, at most 32; low
    /// latency: the whole share). The normal mode's equal-SM copy rows use the same budget.
    #[arg(long, global = true)]
    sms: Option<usize>,
    /// GPU backend, normal mode: records per chunk of the per-peer queues (default: the
    /// Buffer's, `GpuOptions::chunk_tokens`, 16).
    #[arg(long, global = true)]
    gpu_chunk: Option<usize>,
    /// GPU backend, normal mode: chunks in flight per peer queue (default: the Buffer's,
    /// `ep::gpu::default_slots_per_peer`: 32 up to 8 ranks, else 16).
    #[arg(long, global = true)]
    gpu_slots: Option<usize>,
    /// Normal mode: after the direct run, run DeepEP's internode hierarchy (one copy per
    /// destination node to a gateway, then a fan-out inside the node) on the same inputs, every
    /// result checked. Host backend (`ep::hier`): also prints both routings' internode bytes.
    /// GPU backend (`ep::hier_gpu`, ranks as threads or --procs): both runs split the ranks into
    /// nodes of --ranks-per-node, other nodes reached through the proxy lane over --provider (no
    /// NCCL comparison). Needs --ranks-per-node below the number of ranks.
    #[arg(long)]
    hierarchy: bool,
    /// Host backend: write to the ranks of this rank's node through this provider (e.g. shm)
    /// and to the other nodes through --provider, as GPUs use NVLink inside a node and the NIC
    /// between nodes (`BufferOptions::intranode_provider`; the hierarchy's node stage too).
    #[arg(long)]
    intranode_provider: Option<String>,
    /// Host backend, a bench aid: cap each rank's writes to other nodes at this many GB/s
    /// (`BufferOptions::emulate_network_gbps`), so a NIC-bound cluster can be imitated on one
    /// machine where every link is a memory copy. Applies to the direct path and the
    /// hierarchy's rail stage alike.
    #[arg(long)]
    emulate_network_gbps: Option<f64>,
    /// Timed iterations per operation (the fabric benchmark: at least 1000 below 1 MiB).
    #[arg(long, default_value_t = 20, global = true)]
    iters: usize,
}

impl Common {
    /// `--timeout`, or its default of 60 s.
    fn timeout_s(&self) -> u64 {
        self.timeout.unwrap_or(60)
    }
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// RMA-write bandwidth and latency between two ranks, beside Debian's fi_pingpong.
    Fabric {
        /// Message sizes in bytes.
        #[arg(long, value_delimiter = ',', default_values_t = [65536usize, 1 << 20, 8 << 20])]
        sizes: Vec<usize>,
        /// Latency message size.
        #[arg(long, default_value_t = 8)]
        lat_bytes: usize,
        /// Writes in flight for the streaming figure.
        #[arg(long, default_value_t = 16)]
        window: usize,
        /// Streaming: rotate the writes' source and target offsets over this many bytes (0: every
        /// write reuses offset 0, as fi_pingpong does, so its bytes stay in the CPU's caches; a
        /// span beyond the last-level cache measures copies of data from memory, which is what
        /// the GPU proxy lanes move).
        #[arg(long, default_value_t = 0)]
        span: usize,
        /// Skip fi_pingpong.
        #[arg(long)]
        no_pingpong: bool,
    },
    /// Buffer bytes, memory regions, messages per step and bytes per peer for a setting at each
    /// rank count (no communication): size a cluster before renting it.
    Plan {
        /// Rank counts to tabulate (`--at 16,32` or `--at 16 32`).
        #[arg(
            long = "at",
            value_delimiter = ',',
            num_args = 1..,
            default_values_t = [8u64, 16, 32, 64, 128, 256]
        )]
        at: Vec<u64>,
        /// Normal-mode chunk tokens (one RMA write).
        #[arg(long, default_value_t = 64)]
        chunk_tokens: u64,
        /// Normal-mode chunk slots per peer queue.
        #[arg(long, default_value_t = 4)]
        slots_per_peer: u64,
        /// Low-latency tokens per rank.
        #[arg(long, default_value_t = 128)]
        ll_tokens: u64,
        /// Largest memory region the provider takes, bytes.
        #[arg(long, default_value_t = 1 << 30)]
        max_region: u64,
        /// Also print the internode comparison of direct per-rank sends (what is built) and
        /// DeepEP's hierarchy (one copy per destination node, then NVLink fan-out): token copies
        /// and bytes counted on generated routings, --ranks-per-node (default 8) per node.
        #[arg(long)]
        hierarchy: bool,
    },
    /// A seeded randomized matrix over both modes, every output compared with the
    /// single-process reference; the last line is `verify: N cases, M mismatches, H hangs` and
    /// the exit status is non-zero unless M and H are 0. Every failure prints the command that
    /// replays it alone.
    Verify {
        /// Cases to draw (case i is a function of --seed and i alone).
        #[arg(long, default_value_t = 300)]
        cases: usize,
        /// The matrix's seed (a failure prints the command that replays its case alone)
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Run only this case (with its description).
        #[arg(long)]
        case: Option<usize>,
        /// Run the whole matrix this many times in this process (state left between calls).
        #[arg(long, default_value_t = 1)]
        repeat: usize,
        /// Ranks as threads or processes (auto: drawn per case; --procs means processes).
        #[arg(long, value_enum, default_value_t = LaunchArg::Auto)]
        launch: LaunchArg,
        /// Print every case as it ends.
        #[arg(long)]
        verbose: bool,
        /// Cases run at once, each its own job of processes (needs ranks as processes:
        /// --launch procs; on one GPU, MPS).
        #[arg(long, default_value_t = 1)]
        jobs: usize,
    },
    /// All-to-all of RMA writes with immediate data between all ranks, every byte checked.
    Selftest {
        /// Bytes every rank writes to each peer.
        #[arg(long, default_value_t = 1 << 20)]
        bytes_per_peer: usize,
        /// Writes those bytes are split into.
        #[arg(long, default_value_t = 8)]
        msgs_per_peer: usize,
    },
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Normal,
    LowLatency,
    Both,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum LaunchArg {
    Auto,
    Threads,
    Procs,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Backend {
    Gpu,
    Host,
}

/// `plan --hierarchy`: the routings' seed (rank `r` draws with `PLAN_HIERARCHY_SEED + r`).
const PLAN_HIERARCHY_SEED: u64 = 1;

/// Open MPI sets its own variables; map them onto the torchrun names the bootstrap reads.
fn adopt_mpi_env() {
    let map = [
        ("OMPI_COMM_WORLD_RANK", "RANK"),
        ("OMPI_COMM_WORLD_SIZE", "WORLD_SIZE"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "LOCAL_RANK"),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "LOCAL_WORLD_SIZE"),
    ];
    for (from, to) in map {
        if let (Ok(v), Err(_)) = (std::env::var(from), std::env::var(to)) {
            std::env::set_var(to, v);
        }
    }
}

fn in_job() -> bool {
    std::env::var_os("RANK").is_some() && std::env::var_os("WORLD_SIZE").is_some()
}

fn main() -> ExitCode {
    adopt_mpi_env();
    let cli = Cli::parse();
    if cli.cmd.is_none() && !in_job() && !cli.common.procs && cli.common.ranks > 1 {
        // GPU ranks would be threads of this process: before the first CUDA call (the GPU probe
        // below), one thread so far. Harmless for the host backend.
        ep_bench::ep_gpu::set_work_queues_for_threads();
    }
    if let Some(Cmd::Verify { .. }) = &cli.cmd {
        return verify(&cli);
    }
    let res = match &cli.cmd {
        Some(Cmd::Plan { at, chunk_tokens, slots_per_peer, ll_tokens, max_region, hierarchy }) => {
            let c = &cli.common;
            let num_tokens = c.tokens.unwrap_or(4096) as u64;
            fabric_ep::protocol::plan::plan_table(
                at,
                c.experts as u64,
                c.hidden as u64,
                c.topk as u64,
                c.fp8,
                num_tokens,
                *ll_tokens,
                *chunk_tokens,
                *slots_per_peer,
                *max_region,
            )
            .and_then(|t| {
                print!("{t}");
                if !*hierarchy {
                    return Ok(());
                }
                // P5 nodes hold 8 GPUs; the seed is fixed so the table is reproducible.
                let t = ep_bench::plan::hierarchy_table(
                    at,
                    c.ranks_per_node.unwrap_or(8) as u64,
                    c.experts as u64,
                    c.hidden as u64,
                    c.topk as u64,
                    c.fp8,
                    num_tokens,
                    PLAN_HIERARCHY_SEED,
                )?;
                print!("\n{t}");
                Ok(())
            })
            .map_err(|e| e.into())
        }
        _ if cli.common.emulate_network_gbps.is_some_and(|g| !(g > 0.0 && g.is_finite())) => {
            Err(format!(
                "--emulate-network-gbps: {} must be a positive number of GB/s",
                cli.common.emulate_network_gbps.unwrap_or_default()
            )
            .into())
        }
        _ if (cli.common.intranode_provider.is_some()
            || cli.common.emulate_network_gbps.is_some())
            && (gpu_backend(&cli)
                || cli.common.backend == Some(Backend::Gpu)
                || cli.common.mode == Mode::LowLatency) =>
        {
            let flag = if cli.common.intranode_provider.is_some() {
                "--intranode-provider"
            } else {
                "--emulate-network-gbps"
            };
            Err(format!("{flag}: the host backend's normal mode only (pass --backend host)").into())
        }
        _ if cli.common.hierarchy && cli.common.mode == Mode::LowLatency => {
            Err("--hierarchy: normal mode only (pass --mode normal)".into())
        }
        _ if cli.common.hierarchy
            && !in_job()
            && cli
                .common
                .ranks_per_node
                .is_none_or(|p| p == 0 || p >= cli.common.ranks || cli.common.ranks % p != 0) =>
        {
            Err(format!(
                "--hierarchy: needs --ranks-per-node dividing --ranks ({}) and below it: 2 or \
                 more nodes",
                cli.common.ranks
            )
            .into())
        }
        _ if (cli.common.cached
            || cli.common.gpu_chunk.is_some()
            || cli.common.gpu_slots.is_some())
            && !(gpu_backend(&cli) || (in_job() && cli.common.backend == Some(Backend::Gpu))) =>
        {
            let flag = if cli.common.cached {
                "--cached"
            } else if cli.common.gpu_chunk.is_some() {
                "--gpu-chunk"
            } else {
                "--gpu-slots"
            };
            Err(format!(
                "{flag}: the GPU backend's normal mode only (this run uses the host backend)"
            )
            .into())
        }
        _ if in_job() => run_rank(&cli),
        _ if gpu_backend(&cli) => run_gpu(&cli),
        _ => launch(&cli),
    };
    match res {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ep-bench: error: {e}");
            ExitCode::FAILURE
        }
    }
}

type AnyResult<T> = Result<T, Box<dyn std::error::Error>>;

/// `ep-bench verify`: the matrix (launcher), or one rank of one case (inside a job).
fn verify(cli: &Cli) -> ExitCode {
    use ep_bench::verify::{self as v, Launch, VerifyBackend, VerifyOptions};
    let c = &cli.common;
    let Some(Cmd::Verify { cases, seed, case, repeat, launch, verbose, jobs }) = &cli.cmd else {
        return ExitCode::FAILURE;
    };
    let backend = match c.backend {
        Some(Backend::Gpu) => VerifyBackend::Gpu,
        Some(Backend::Host) => VerifyBackend::Host,
        None if fabric_ep::cuda::gpu_available() => VerifyBackend::Gpu,
        None => VerifyBackend::Host,
    };
    let launch = match (launch, c.procs) {
        (_, true) | (LaunchArg::Procs, _) => Launch::Procs,
        (LaunchArg::Threads, _) => Launch::Threads,
        (LaunchArg::Auto, _) => Launch::Auto,
    };
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => {
            eprintln!("ep-bench: error: current_exe: {e}");
            return ExitCode::FAILURE;
        }
    };
    let opts = VerifyOptions {
        backend,
        cases: *cases,
        seed: *seed,
        case: *case,
        repeat: *repeat,
        launch,
        timeout: Duration::from_secs(c.timeout.unwrap_or(v::DEFAULT_TIMEOUT_S).max(1)),
        verbose: *verbose,
        jobs: *jobs,
        exe,
    };
    if *jobs == 0 || (*jobs > 1 && launch != Launch::Procs) {
        eprintln!(
            "ep-bench: error: invalid argument --jobs: {jobs}; expected 1, or more with ranks as \
             processes (--launch procs), whose cases share nothing but the machine"
        );
        return ExitCode::FAILURE;
    }
    let rank_fn: v::RankFn = match backend {
        VerifyBackend::Host => v::host_rank,
        VerifyBackend::Gpu => ep_bench::verify_gpu::gpu_rank,
    };
    if in_job() {
        let res = TcpStore::from_env(opts.timeout * 2)
            .map_err(fabric_ep::Error::from)
            .and_then(|b| v::rank_process(&opts, std::sync::Arc::new(b), rank_fn));
        return match res {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("ep-bench: error: {e}");
                ExitCode::FAILURE
            }
        };
    }
    if backend == VerifyBackend::Gpu && launch != Launch::Procs {
        // GPU ranks as threads of this process: before the first CUDA call.
        ep_bench::ep_gpu::set_work_queues_for_threads();
    }
    let (_, m, h) = v::run_matrix(&opts, rank_fn);
    if m == 0 && h == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// Launcher: start the ranks as local processes running this same command line.
fn launch(cli: &Cli) -> AnyResult<()> {
    let c = &cli.common;
    if cli.cmd.is_none() && (!c.sweep_tokens.is_empty() || !c.sweep_ranks.is_empty()) {
        return sweep(cli);
    }
    let ranks = match cli.cmd {
        Some(Cmd::Fabric { .. }) => 2,
        _ => c.ranks,
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    if cli.cmd.is_none() {
        let rows = run_job_streaming(c, &args, ranks, "running")?;
        return print_files(c, &rows);
    }
    let out = run_job(c, &args, ranks, "running")?;
    match &cli.cmd {
        Some(Cmd::Fabric { sizes, lat_bytes, window, no_pingpong, span }) => {
            let rows: Vec<FabricRow> = out.lines().filter_map(parse_row).collect();
            print_fabric_table(c, &rows, *lat_bytes, sizes, *window, *no_pingpong)?;
            if *span > 0 {
                println!(
                    "(streaming writes rotate over {span} bytes of both buffers: beyond the \
                     last-level cache, data comes from memory)"
                );
            }
        }
        _ => print!("{out}"),
    }
    Ok(())
}

/// Starts `ranks` local processes of this binary with `args`, waits (with a spinner on a
/// terminal), and returns rank 0's standard output; any failed rank is an error naming it.
fn run_job(c: &Common, args: &[String], ranks: usize, what: &str) -> AnyResult<String> {
    run_job_with(c, args, ranks, what, &mut |_, _| {})
}

/// [`run_job`] for an EP run: rank 0's lines are printed as they come, its result rows as the
/// table's lines (above the spinner on a terminal, plain lines otherwise), so a long run shows
/// each row when it finishes; returns the rows.
fn run_job_streaming(
    c: &Common,
    args: &[String],
    ranks: usize,
    what: &str,
) -> AnyResult<Vec<EpRow>> {
    let mut table = stream_table(c);
    let mut rows = Vec::new();
    run_job_with(c, args, ranks, what, &mut |bar, line| {
        let text = match EpRow::parse(line) {
            Some(r) => {
                let t = table.line(&r);
                rows.push(r);
                t
            }
            None => format!("{line}\n"),
        };
        bar.suspend(|| {
            use std::io::Write;
            let mut out = std::io::stdout().lock();
            let _ = out.write_all(text.as_bytes()).and_then(|_| out.flush());
        });
    })?;
    Ok(rows)
}

/// The table's columns for the rows a run of `c` can produce (wide ops with --cached or
/// --cuda-graph, NCCL's and the equal-SM copy's backend names on the GPU), fixed before the
/// first row is printed.
fn stream_table(c: &Common) -> report::TableStream {
    let op = if c.cached || c.cuda_graph { "dispatch+hook (graph)".len() } else { 0 };
    let gpu = c.procs || c.backend == Some(Backend::Gpu);
    report::TableStream::new(op, if gpu { "copy (132 SMs)".len() } else { 0 })
}

/// [`run_job`], handing each complete line of rank 0's standard output to `on_line` while the
/// ranks run.
fn run_job_with(
    c: &Common,
    args: &[String],
    ranks: usize,
    what: &str,
    on_line: &mut dyn FnMut(&indicatif::ProgressBar, &str),
) -> AnyResult<String> {
    if ranks == 0 {
        return Err("--ranks must be at least 1".into());
    }
    let exe = std::env::current_exe()?;
    let local = c.ranks_per_node.unwrap_or(ranks).min(ranks);
    let bar = indicatif::ProgressBar::new_spinner();
    bar.set_message(format!("{what}: {ranks} ranks ({local} per node) over {}", c.provider));
    bar.enable_steady_tick(Duration::from_millis(120));
    let marker = [(LAUNCHED_VAR.to_string(), "1".to_string())];
    let mut job = LocalJob::spawn(&exe, args, ranks, local, &marker)?;
    let out0 = job.stdout_path(0);
    let limit = Duration::from_secs(c.timeout_s() + 120);
    let outcomes = std::thread::scope(|s| {
        let waiter = s.spawn(|| job.wait(limit));
        let mut tail = StdoutTail::default();
        while !waiter.is_finished() {
            tail.poll(&out0, &mut |l| on_line(&bar, l));
            std::thread::sleep(Duration::from_millis(50));
        }
        tail.poll(&out0, &mut |l| on_line(&bar, l));
        tail.finish(&mut |l| on_line(&bar, l));
        waiter.join().unwrap_or_else(|_| Err(std::io::Error::other("the job's waiter panicked")))
    });
    bar.finish_and_clear();
    let outcomes = outcomes?;
    let mut failed = Vec::new();
    for (r, o) in outcomes.iter().enumerate() {
        if !o.success() {
            failed.push(r);
            eprintln!("rank {r} failed: {o}");
        }
    }
    if !failed.is_empty() {
        return Err(format!("ranks {failed:?} failed").into());
    }
    // The ranks' diagnostics (FEP_LOG lines carry their rank), in rank order.
    for o in &outcomes {
        eprint!("{}", o.stderr);
    }
    Ok(outcomes.into_iter().next().map(|o| o.stdout).unwrap_or_default())
}

/// What was read so far of a growing file: complete lines are handed on, a partial one waits.
#[derive(Default)]
struct StdoutTail {
    read: u64,
    partial: Vec<u8>,
}

impl StdoutTail {
    /// Hands on the complete lines added to `path` since the last call.
    fn poll(&mut self, path: &std::path::Path, on_line: &mut dyn FnMut(&str)) {
        use std::io::{Read, Seek, SeekFrom};
        let Ok(mut f) = std::fs::File::open(path) else { return };
        if f.seek(SeekFrom::Start(self.read)).is_err() {
            return;
        }
        let mut buf = Vec::new();
        if let Ok(n) = f.read_to_end(&mut buf) {
            self.read += n as u64;
            self.partial.extend_from_slice(&buf);
        }
        while let Some(i) = self.partial.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = self.partial.drain(..=i).collect();
            on_line(String::from_utf8_lossy(&line[..i]).trim_end_matches('\r'));
        }
    }

    /// A last line without its newline.
    fn finish(&mut self, on_line: &mut dyn FnMut(&str)) {
        if !self.partial.is_empty() {
            on_line(&String::from_utf8_lossy(&std::mem::take(&mut self.partial)));
        }
    }
}

/// For every normal-mode row of ours with an NCCL + permute row of the same op and rank count,
/// the ratio of the medians (above 1: ours is faster).
fn print_nccl_ratios(rows: &[EpRow]) {
    for t in rows.iter().filter(|r| r.backend == "nccl+permute") {
        let ours = rows
            .iter()
            .find(|o| o.backend == "gpu" && o.mode == t.mode && o.op == t.op && o.ranks == t.ranks);
        if let Some(o) = ours {
            println!(
                "vs NCCL all-to-all + permute, {} {} at {} rank(s): {:.2}x (their median / ours: \
                 {:.1} / {:.1} us; above 1: ours faster)",
                t.mode,
                t.op,
                t.ranks,
                t.median_us / o.median_us,
                t.median_us,
                o.median_us
            );
        }
    }
}

/// The one table, then JSON/CSV when asked: printed for "-", else written to the file.
fn print_rows(c: &Common, rows: &[EpRow]) -> AnyResult<()> {
    print!("{}", report::table(rows));
    print_files(c, rows)
}

/// JSON/CSV of `rows` when asked: printed for "-", else written to the file.
fn print_files(c: &Common, rows: &[EpRow]) -> AnyResult<()> {
    let outputs = [(&c.json, "JSON", "--json"), (&c.csv, "CSV", "--csv")];
    for (path, what, flag) in outputs {
        let Some(path) = path else { continue };
        let text = if what == "JSON" { report::json(rows) } else { report::csv(rows) };
        if path.as_os_str() == "-" {
            print!("{text}");
        } else {
            std::fs::write(path, text)
                .map_err(|e| format!("{flag}: cannot write {}: {e}", path.display()))?;
            println!("{what}: {} rows in {}", rows.len(), path.display());
        }
    }
    Ok(())
}

/// Set by [`run_job`] on the ranks it starts: their launcher prints and writes the results.
const LAUNCHED_VAR: &str = "FEP_BENCH_LAUNCHED";

/// The rows this process emitted ([`emit`]).
static EMITTED: std::sync::Mutex<Vec<EpRow>> = std::sync::Mutex::new(Vec::new());

/// The table rank 0 of a job that no ep-bench launched prints a row at a time (its columns
/// set by [`run_rank`]; `None`: rows go to a launcher of ours).
static EXTERNAL_TABLE: std::sync::Mutex<Option<report::TableStream>> = std::sync::Mutex::new(None);

/// Rank 0 hands a result row on as it finishes, and keeps it: under ep-bench's launcher as a
/// tagged line (the launcher prints the table), in a job no ep-bench launched (torchrun,
/// mpirun, a PyTorchJob) as the table's line itself, so both print the same lines; that rank
/// writes --json/--csv at the end ([`finish_external`]).
fn emit(row: EpRow) {
    match EXTERNAL_TABLE.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
        Some(t) => {
            use std::io::Write;
            let mut out = std::io::stdout().lock();
            let _ = out.write_all(t.line(&row).as_bytes()).and_then(|_| out.flush());
        }
        None => println!("{}", row.to_line()),
    }
    EMITTED.lock().unwrap_or_else(|e| e.into_inner()).push(row);
}

/// End of a rank's run: rank 0 of a job with no ep-bench launcher writes what it emitted as
/// --json/--csv (its table is printed already).
fn finish_external(c: &Common, rank: usize) -> AnyResult<()> {
    if rank != 0 || std::env::var_os(LAUNCHED_VAR).is_some() {
        return Ok(());
    }
    let rows = std::mem::take(&mut *EMITTED.lock().unwrap_or_else(|e| e.into_inner()));
    if rows.is_empty() {
        return Ok(());
    }
    print_files(c, &rows)
}

/// The settings a run's rows carry (`fp8`: the dispatch payload; the GPU backend adds its device
/// and SM budgets, [`gpu_settings`]).
fn run_settings(c: &Common, ranks_per_node: usize, fp8: bool) -> RunSettings {
    RunSettings {
        ranks_per_node,
        provider: c.provider.clone(),
        topk: c.topk,
        experts: c.experts,
        fp8,
        iters: c.iters.max(1),
        ..RunSettings::default()
    }
}

/// [`run_settings`] of a GPU run on `dev` with `on_gpu` ranks per GPU: the budgets the Buffer
/// takes by default (normal mode capped, low latency its whole share).
fn gpu_settings(
    c: &Common,
    ranks_per_node: usize,
    dev: &fabric_ep::cuda::Device,
    on_gpu: usize,
) -> RunSettings {
    let sms = dev.sm_count() as usize;
    RunSettings {
        gpu: Some(dev.name().to_string()),
        sms_normal: Some(c.sms.unwrap_or_else(|| sm_budget(sms, on_gpu))),
        sms_low_latency: Some(c.sms.unwrap_or((sms / on_gpu.max(1)) & !1)),
        ..run_settings(c, ranks_per_node, !c.bf16)
    }
}

/// `--args` without `flag` (and its value), so a sweep can set it per point.
fn without_flag(args: &[String], flag: &str) -> Vec<String> {
    let mut out = Vec::with_capacity(args.len());
    let mut skip = false;
    for a in args {
        if skip {
            skip = false;
        } else if a == flag {
            skip = true;
        } else if !a.starts_with(&format!("{flag}=")) {
            out.push(a.clone());
        }
    }
    out
}

/// `--sweep-tokens` / `--sweep-ranks`: one job per point, every row collected, one table, and
/// an SVG plot with `--plot`.
fn sweep(cli: &Cli) -> AnyResult<()> {
    let c = &cli.common;
    let base: Vec<String> = std::env::args().skip(1).collect();
    let (x, points): (&str, Vec<usize>) = if c.sweep_ranks.is_empty() {
        ("tokens", c.sweep_tokens.clone())
    } else {
        ("ranks", c.sweep_ranks.clone())
    };
    let mut rows = Vec::new();
    for (i, &p) in points.iter().enumerate() {
        let mut args = without_flag(&without_flag(&base, "--tokens"), "--ranks");
        let ranks = if x == "ranks" { p } else { c.ranks };
        args.extend(["--ranks".to_string(), ranks.to_string()]);
        if x == "tokens" {
            args.extend(["--tokens".to_string(), p.to_string()]);
        } else if let Some(t) = c.tokens {
            args.extend(["--tokens".to_string(), t.to_string()]);
        }
        let out =
            run_job(c, &args, ranks, &format!("sweep point {}/{} ({x} {p})", i + 1, points.len()))?;
        rows.extend(out.lines().filter_map(EpRow::parse));
    }
    print_rows(c, &rows)?;
    if let Some(path) = &c.plot {
        std::fs::write(path, report::svg_plot(&rows, x))?;
        println!("plot of median us over {x}: {}", path.display());
    }
    Ok(())
}

/// One rank of a job (launched by us, torchrun, mpirun or Kubernetes).
fn run_rank(cli: &Cli) -> AnyResult<()> {
    let c = &cli.common;
    let boot = TcpStore::from_env(Duration::from_secs(c.timeout_s()))?;
    let rank = boot.rank();
    if rank == 0 && std::env::var_os(LAUNCHED_VAR).is_none() {
        *EXTERNAL_TABLE.lock().unwrap_or_else(|e| e.into_inner()) = Some(stream_table(c));
    }
    match &cli.cmd {
        Some(Cmd::Fabric { sizes, lat_bytes, window, span, .. }) => {
            let mut all = vec![*lat_bytes];
            all.extend(sizes.iter().copied().filter(|s| s != lat_bytes));
            let rows = fb::rma_bench(&boot, &c.provider, &all, fabric_iters(c), *window, *span)?;
            for r in rows {
                println!(
                    "@row {} {} {} {}",
                    r.bytes, r.stream_mbps, r.pingpong_mbps, r.pingpong_us
                );
            }
        }
        Some(Cmd::Selftest { bytes_per_peer, msgs_per_peer }) => {
            let rep = fb::alltoall_selftest(
                &boot,
                &c.provider,
                *bytes_per_peer,
                *msgs_per_peer,
                Duration::from_secs(c.timeout_s()),
            )?;
            if boot.rank() == 0 {
                println!(
                    "selftest ok: {} ranks over {}, {} bytes to each peer in {} writes each, {:.1} ms",
                    boot.world_size(),
                    c.provider,
                    bytes_per_peer,
                    msgs_per_peer,
                    rep.elapsed.as_secs_f64() * 1e3
                );
            }
        }
        Some(Cmd::Plan { .. }) => {
            return Err("`plan` runs without ranks: do not launch it as a job".into())
        }
        Some(Cmd::Verify { .. }) => {
            return Err("`verify` is handled before any job starts (bug)".into())
        }
        None if c.backend == Some(Backend::Gpu) => run_gpu_rank(c, std::sync::Arc::new(boot))?,
        None => {
            let boot: std::sync::Arc<dyn Bootstrap> = std::sync::Arc::new(boot);
            if c.mode != Mode::LowLatency {
                run_normal_rank(c, boot.clone())?;
            }
            if c.mode != Mode::Normal {
                run_ll_rank(c, boot)?;
            }
        }
    }
    finish_external(c, rank)
}

/// `--mode normal` (and the normal half of `--mode both`) on this rank.
fn run_normal_rank(c: &Common, boot: std::sync::Arc<dyn Bootstrap>) -> AnyResult<()> {
    use ep_bench::ep::{run_normal, run_normal_hier, NormalBenchParams};
    use fabric_ep::ep::buffer::{Buffer, BufferOptions};
    use fabric_ep::ep::hier::HierBuffer;
    use fabric_ep::protocol::config::{DispatchDtype, EpConfig, EpSettings};
    let (rank, world) = (boot.rank(), boot.world_size());
    let mut s = EpSettings::new(rank, world, c.experts, c.hidden, c.topk);
    s.ranks_per_node = c.ranks_per_node.unwrap_or(world).min(world);
    s.timeout = Duration::from_secs(c.timeout_s());
    if c.fp8 {
        s.dispatch_dtype = DispatchDtype::Fp8E4m3;
    }
    let cfg = EpConfig::new(s)?;
    let opts = BufferOptions {
        intranode_provider: c.intranode_provider.clone(),
        emulate_network_gbps: c.emulate_network_gbps,
        ..BufferOptions::host(&c.provider)
    };
    let mut buf = Buffer::new(cfg.clone(), boot.clone(), opts.clone())?;
    let p = NormalBenchParams {
        num_tokens: c.tokens.unwrap_or(512),
        seed: 0x5eed,
        drop_pct: 5,
        iters: c.iters.max(1),
        warmup: 2,
        combine_weights: true,
        one_way: false,
    };
    let rep = run_normal(&mut buf, &p)?;
    buf.destroy()?;
    let hier = if c.hierarchy {
        if cfg.ranks_per_node >= world {
            return Err("--hierarchy: needs --ranks-per-node below the number of ranks".into());
        }
        let mut hb = HierBuffer::new(cfg.clone(), boot.clone(), opts)?;
        let (hrep, bytes) = run_normal_hier(&mut hb, &p)?;
        hb.destroy()?;
        let words = [bytes.direct, bytes.hier, bytes.hier_forwarded];
        let blob: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        let all = boot.all_gather(&blob)?;
        let mut sum = [0u64; 3];
        for b in &all {
            for (i, w) in b.chunks_exact(8).take(3).enumerate() {
                sum[i] += u64::from_le_bytes(w.try_into()?);
            }
        }
        Some((hrep, sum))
    } else {
        None
    };
    if rank == 0 {
        let st = run_settings(c, cfg.ranks_per_node, c.fp8);
        let (dg, dm, dp) = rep.dispatch_figures();
        let (cg, cm, cp) = rep.combine_figures();
        println!(
            "ep-bench normal (host backend): {world} ranks, {} per node, provider {}{}, \
             tokens {}, hidden {}, top-{} of {} experts, {}, {} iters (+{} warm-up), \
             every result checked against the reference",
            cfg.ranks_per_node,
            c.provider,
            c.intranode_provider
                .as_ref()
                .map(|p| format!(" (inside a node: {p})"))
                .unwrap_or_default()
                + &c.emulate_network_gbps
                    .map(|g| format!("; writes to other nodes capped at {g} GB/s per rank"))
                    .unwrap_or_default(),
            p.num_tokens,
            cfg.hidden,
            cfg.num_topk,
            cfg.num_experts,
            if c.fp8 { "fp8 dispatch" } else { "bf16 dispatch" },
            p.iters,
            p.warmup
        );
        let row = |op: &str, gbps, median_us, p99_us, bytes| {
            EpRow {
                mode: "normal".into(),
                op: op.into(),
                backend: "host".into(),
                ranks: world,
                tokens: p.num_tokens,
                hidden: cfg.hidden,
                gbps,
                median_us,
                p99_us,
                bytes,
                ..EpRow::default()
            }
            .with(&st)
        };
        emit(row("dispatch", dg, dm, dp, rep.dispatch_bytes));
        emit(row("combine", cg, cm, cp, rep.combine_bytes));
        if let Some((h, sum)) = &hier {
            let (dg, dm, dp) = h.dispatch_figures();
            let (cg, cm, cp) = h.combine_figures();
            let hrow =
                |op: &str, g, m, p, b| EpRow { mode: "normal-hier".into(), ..row(op, g, m, p, b) };
            emit(hrow("dispatch", dg, dm, dp, h.dispatch_bytes));
            emit(hrow("combine", cg, cm, cp, h.combine_bytes));
            let mb = |b: u64| b as f64 / world as f64 / 1e6;
            println!(
                "internode bytes per rank per dispatch (mean of {world} ranks, measured on the \
                 routings): direct {:.3} MB, hierarchy {:.3} MB ({:.2}x fewer); the hierarchy's \
                 gateways also forward {:.3} MB inside their node (metadata lane included)",
                mb(sum[0]),
                mb(sum[1]),
                sum[0] as f64 / sum[1].max(1) as f64,
                mb(sum[2])
            );
        }
        println!(
            "GB/s = bytes of the tokens rank 0 sends (dispatch) / receives (combine) per second \
             (DeepEP's definition), at the median time"
        );
    }
    Ok(())
}

/// `--mode low-latency` (and the low-latency half of `--mode both`) on this rank: every rank
/// with `--tokens` (= max tokens per rank, default 128) tokens, each result checked against the
/// reference; rows of the same table as normal mode.
fn run_ll_rank(c: &Common, boot: std::sync::Arc<dyn Bootstrap>) -> AnyResult<()> {
    use ep_bench::ep::{run_low_latency, LlBenchParams, LlBenchReport};
    use fabric_ep::ep::buffer::{Buffer, BufferOptions};
    use fabric_ep::protocol::config::{EpConfig, EpSettings};
    let (rank, world) = (boot.rank(), boot.world_size());
    let m = c.tokens.unwrap_or(128);
    let mut s = EpSettings::new(rank, world, c.experts, c.hidden, c.topk);
    s.ranks_per_node = c.ranks_per_node.unwrap_or(world).min(world);
    s.timeout = Duration::from_secs(c.timeout_s());
    s.max_tokens_per_rank = m;
    let cfg = EpConfig::new(s)?;
    let mut buf = Buffer::new(cfg.clone(), boot, BufferOptions::host(&c.provider))?;
    let p = LlBenchParams {
        tokens: vec![m],
        seed: 0x11ed,
        drop_pct: 5,
        use_fp8: c.fp8,
        round_scale: false,
        iters: c.iters.max(1),
        warmup: 2,
    };
    let rep = run_low_latency(&mut buf, &p)?;
    buf.destroy()?;
    if rank == 0 {
        println!(
            "ep-bench low-latency (host backend): {world} ranks, {} per node, provider {}, \
             {m} tokens per rank (= max), hidden {}, top-{} of {} experts, {} dispatch / bf16 \
             combine, {} iters (+{} warm-up) without and with the recv hook, every result \
             checked against the reference",
            cfg.ranks_per_node,
            c.provider,
            cfg.hidden,
            cfg.num_topk,
            cfg.num_experts,
            if c.fp8 { "fp8" } else { "bf16" },
            p.iters,
            p.warmup
        );
        let st = run_settings(c, cfg.ranks_per_node, c.fp8);
        let rows = [
            ("dispatch", rep.dispatch_bytes, &rep.dispatch_s),
            ("dispatch+hook", rep.dispatch_bytes, &rep.dispatch_hook_s),
            ("combine", rep.combine_bytes, &rep.combine_s),
            ("combine+hook", rep.combine_bytes, &rep.combine_hook_s),
        ];
        for (op, bytes, v) in rows {
            let (gbps, median_us, p99_us) = LlBenchReport::figures(bytes, v);
            let row = EpRow {
                mode: "low-latency".into(),
                op: op.into(),
                backend: "host".into(),
                ranks: world,
                tokens: m,
                hidden: cfg.hidden,
                gbps,
                median_us,
                p99_us,
                bytes,
                ..EpRow::default()
            };
            emit(row.with(&st));
        }
        println!(
            "ll GB/s = bytes of the rows rank 0 sends (dispatch, once per selected expert, \
             payload + fp8 scales) / receives (combine, bf16) per second at the median; \
             +hook = send, then hook completion, back to back"
        );
    }
    Ok(())
}

/// The fabric benchmark's iteration count below 1 MiB (`--iters`, at least 1000).
fn fabric_iters(c: &Common) -> usize {
    c.iters.max(1000)
}

fn parse_row(line: &str) -> Option<FabricRow> {
    let f: Vec<&str> = line.strip_prefix("@row ")?.split_whitespace().collect();
    Some(FabricRow {
        bytes: f.first()?.parse().ok()?,
        stream_mbps: f.get(1)?.parse().ok()?,
        pingpong_mbps: f.get(2)?.parse().ok()?,
        pingpong_us: f.get(3)?.parse().ok()?,
    })
}

fn mbps(v: f64) -> String {
    if v < 100.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.0}")
    }
}

fn human(bytes: usize) -> String {
    match bytes {
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{}MiB", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{}KiB", b >> 10),
        b => format!("{b}B"),
    }
}

fn print_fabric_table(
    c: &Common,
    rows: &[FabricRow],
    lat_bytes: usize,
    sizes: &[usize],
    window: usize,
    no_pingpong: bool,
) -> AnyResult<()> {
    println!(
        "ep-bench fabric: provider {}, libfabric {}, 2 local processes",
        c.provider,
        fabric_ep::fabric::library_version()
    );
    println!(
        "{:>7} | {:>14} {:>14} {:>10} | {:>14} {:>10} | {:>8} {:>8}",
        "size",
        "rma stream",
        "rma pingpong",
        "rma us",
        "fi_pingpong",
        "fi_pp us",
        "stream%",
        "lat x"
    );
    for r in rows {
        let pp: Option<PingpongRow> = if no_pingpong {
            None
        } else {
            Some(fb::fi_pingpong(&c.provider, r.bytes, fb::iters_for(r.bytes, fabric_iters(c)))?)
        };
        let (ppm, ppu) = pp.map(|p| (p.mbps, p.usec_per_xfer)).unwrap_or((f64::NAN, f64::NAN));
        let is_lat = r.bytes == lat_bytes && !sizes.contains(&lat_bytes);
        println!(
            "{:>7} | {:>9} MB/s {:>9} MB/s {:>10.2} | {:>9} MB/s {:>10.2} | {:>7.0}% {:>8}",
            human(r.bytes),
            mbps(r.stream_mbps),
            mbps(r.pingpong_mbps),
            r.pingpong_us,
            mbps(ppm),
            ppu,
            100.0 * r.stream_mbps / ppm,
            if is_lat { format!("{:.2}", r.pingpong_us / ppu) } else { "-".into() }
        );
    }
    println!(
        "rma stream: {window}-deep window of RMA writes with immediate data, receiver counts arrivals; \
         rma pingpong: one write each way per iteration (fi_pingpong's pattern, which uses \
         send/recv); MB/s = 1e6 bytes/s; us = half round trip; stream% = rma stream / fi_pingpong; \
         lat x = rma us / fi_pingpong us."
    );
    Ok(())
}

/// The GPU backend is used for EP runs (no subcommand) with `--backend gpu`, and by default
/// when a GPU is visible. Inside a torchrun/MPI job (`run_rank`) only with `--backend gpu`.
fn gpu_backend(cli: &Cli) -> bool {
    cli.cmd.is_none()
        && match cli.common.backend {
            Some(Backend::Gpu) => true,
            Some(Backend::Host) => false,
            None => fabric_ep::cuda::gpu_available(),
        }
}

/// The GPU runs' parameters from the command line (`tokens`: the mode's default count).
fn gpu_params(c: &Common, ranks: usize, tokens: usize) -> ep_bench::ep_gpu::GpuBenchParams {
    ep_bench::ep_gpu::GpuBenchParams {
        num_tokens: c.tokens.unwrap_or(tokens),
        hidden: c.hidden,
        num_topk: c.topk,
        num_experts: c.experts,
        fp8: !c.bf16,
        iters: c.iters.max(1),
        timeout: Duration::from_secs(c.timeout_s()),
        num_sms: c.sms,
        ..ep_bench::ep_gpu::GpuBenchParams::normal_standard(ranks)
    }
}

/// One rank's figures of a GPU run as table rows.
fn gpu_rows(
    mode: &str,
    hook: bool,
    p: &ep_bench::ep_gpu::GpuBenchParams,
    r0: &ep_bench::ep::NormalBenchReport,
) -> Vec<EpRow> {
    let suffix = if hook { "+hook" } else { "" };
    labelled_rows(mode, suffix, "gpu", p, r0)
}

/// Normal-mode GPU rows; `cached`: the dispatch row's op reads "dispatch (cached)".
fn normal_rows(
    cached: bool,
    p: &ep_bench::ep_gpu::GpuBenchParams,
    r0: &ep_bench::ep::NormalBenchReport,
) -> Vec<EpRow> {
    let mut rows = gpu_rows("normal", false, p, r0);
    if cached {
        for r in rows.iter_mut().filter(|r| r.op == "dispatch") {
            r.op = "dispatch (cached)".into();
        }
    }
    rows
}

/// One node; after the checked steps, `--iters` steps back to back are timed (processes leave the
/// barrier before each checked step at different moments and a step's notify waits for the last
/// rank: `GpuSplit::back_to_back`); `--cached`: dispatches after the first with the cached handle;
/// `--gpu-chunk` / `--gpu-slots`: the queue shape.
fn normal_split(c: &Common, ranks: usize) -> ep_bench::ep_gpu::GpuSplit {
    ep_bench::ep_gpu::GpuSplit {
        cached: c.cached,
        back_to_back: c.iters.max(1),
        chunk_tokens: c.gpu_chunk,
        slots_per_peer: c.gpu_slots,
        ..ep_bench::ep_gpu::GpuSplit::one_node(ranks)
    }
}

/// `--hierarchy` on the GPU: [`normal_split`] with nodes of `--ranks-per-node` (below
/// `world`), other nodes through the proxy lane over `--provider`.
fn hier_split(c: &Common, world: usize) -> AnyResult<ep_bench::ep_gpu::GpuSplit> {
    let rpn = c.ranks_per_node.unwrap_or(world);
    if rpn == 0 || rpn >= world || world % rpn != 0 {
        return Err(format!(
            "--hierarchy: needs --ranks-per-node dividing the {world} ranks and below it"
        )
        .into());
    }
    Ok(ep_bench::ep_gpu::GpuSplit {
        ranks_per_node: rpn,
        provider: c.provider.clone(),
        ..normal_split(c, world)
    })
}

/// The hierarchy's rows ([`normal_rows`], mode "normal-hier").
fn hier_rows(
    cached: bool,
    p: &ep_bench::ep_gpu::GpuBenchParams,
    r0: &ep_bench::ep::NormalBenchReport,
) -> Vec<EpRow> {
    let mut rows = normal_rows(cached, p, r0);
    for row in rows.iter_mut() {
        row.mode = "normal-hier".into();
    }
    rows
}

/// As [`gpu_rows`], with the op's suffix and the backend column given.
fn labelled_rows(
    mode: &str,
    op_suffix: &str,
    backend: &str,
    p: &ep_bench::ep_gpu::GpuBenchParams,
    r0: &ep_bench::ep::NormalBenchReport,
) -> Vec<EpRow> {
    let figs = [
        ("dispatch", r0.dispatch_figures(), r0.dispatch_bytes),
        ("combine", r0.combine_figures(), r0.combine_bytes),
    ];
    figs.into_iter()
        .map(|(op, (gbps, median_us, p99_us), bytes)| EpRow {
            mode: mode.into(),
            op: format!("{op}{op_suffix}"),
            backend: backend.into(),
            ranks: p.num_ranks,
            tokens: p.num_tokens,
            hidden: p.hidden,
            gbps,
            median_us,
            p99_us,
            bytes,
            ..EpRow::default()
        })
        .collect()
}

/// The equal-SM copy ceiling beside rank 0's normal-mode rows: a plain row copy of the
/// dispatch's and the combine's bytes on `budget` blocks (`ep_gpu::copy_ceiling`), as rows of
/// backend "copy", and how much of it each kernel reaches (the cached dispatch is the kernel
/// alone; a fresh dispatch also holds the layout, the notify and the host count sync).
fn copy_rows(
    dev: &fabric_ep::cuda::Device,
    p: &ep_bench::ep_gpu::GpuBenchParams,
    r0: &ep_bench::ep::NormalBenchReport,
    budget: usize,
    c: &Common,
) -> AnyResult<Vec<EpRow>> {
    let mut out = Vec::new();
    let ours = [
        ("dispatch", r0.dispatch_figures().1, r0.dispatch_bytes),
        ("combine", r0.combine_figures().1, r0.combine_bytes),
    ];
    for (op, ours_us, bytes) in ours {
        let (us, gbps) = ep_bench::ep_gpu::copy_ceiling(dev, bytes, budget, c.iters.max(1))?;
        let which = if op == "dispatch" && c.cached { "dispatch (cached)" } else { op };
        println!(
            "equal-SM copy ({budget} SMs) of the {op}'s {:.1} MB: {us:.1} us ({gbps:.0} GB/s); \
             the {which} reaches {:.0}% of it",
            bytes as f64 / 1e6,
            100.0 * us / ours_us.max(1e-9)
        );
        out.push(EpRow {
            mode: "normal".into(),
            op: format!("{op} bytes"),
            backend: format!("copy ({budget} SMs)"),
            ranks: p.num_ranks,
            tokens: p.num_tokens,
            hidden: p.hidden,
            gbps,
            median_us: us,
            p99_us: us,
            bytes,
            ..EpRow::default()
        });
    }
    Ok(out)
}

/// The default SM budget of a rank when `on_gpu` ranks share a GPU of `sms` SMs.
fn sm_budget(sms: usize, on_gpu: usize) -> usize {
    (sms / on_gpu.max(1)).min(fabric_ep::ep::gpu::DEFAULT_MAX_SMS) & !1
}

const GPU_LEGEND: &str = "rank 0's figures. GB/s = bytes of the tokens rank 0 sends (dispatch: \
    once per destination rank in normal mode, once per selected expert in low-latency mode; fp8 \
    payload + scales) or receives (combine, bf16) per second at the median (DeepEP's \
    definition). normal dispatch = GPU layout + notify + host count sync + dispatch kernel \
    (--cached: the dispatch kernel with the cached handle); combine = combine kernel; \
    low-latency = send + receive kernels (hook: the receive launched by the hook right after the \
    send). Times from CUDA events, of steps back to back after the checked ones (each checked \
    against the reference, the last timed one too).";

const MPS_HINT: &str = "ranks as processes sharing one GPU need the MPS control daemon \
    (`nvidia-cuda-mps-control -d`, before the ranks start): without it their kernels time-slice \
    the GPU, every wait on a peer lasts until a context switch, and long ones time out naming it";

/// `--backend gpu`: every rank a thread of this process on one GPU, each with its own
/// `Buffer` (GPU backend), every result checked against the reference, CUDA-event timings.
/// With `--procs` the ranks are local processes instead ([`run_gpu_rank`] in each).
fn run_gpu(cli: &Cli) -> AnyResult<()> {
    use ep_bench::ep_gpu::{run_ll_gpu, run_normal_gpu_split, GpuBenchParams};
    let c = &cli.common;
    if c.ranks == 0 {
        return Err("--ranks must be at least 1".into());
    }
    if c.procs {
        // Fail here, not in every rank, when there is no GPU (no context is made here).
        fabric_ep::cuda::device_count()?;
        let args: Vec<String> = std::env::args().skip(1).collect();
        let rows = run_job_streaming(c, &args, c.ranks, "GPU ranks as processes")
            .map_err(|e| format!("{e} (if a rank timed out: {MPS_HINT})"))?;
        print_files(c, &rows)?;
        print_nccl_ratios(&rows);
        println!("{GPU_LEGEND}");
        return Ok(());
    }
    let dev = fabric_ep::cuda::Device::from_env()?;
    let base = |tokens: usize| gpu_params(c, c.ranks, tokens);
    let sms = dev.sm_count() as usize;
    println!(
        "ep-bench (GPU backend): {} ranks as THREADS of one process on one GPU ({}, {} SMs, \
         SM budget per rank: normal {}, low-latency {}), {} dispatch / bf16 combine, top-{} of \
         {} experts, {} iters (+{} warm-up); every result checked against the reference",
        c.ranks,
        dev.name(),
        sms,
        c.sms.unwrap_or_else(|| sm_budget(sms, c.ranks)),
        c.sms.unwrap_or((sms / c.ranks) & !1),
        if c.bf16 { "bf16" } else { "fp8" },
        c.topk,
        c.experts,
        c.iters.max(1),
        base(0).warmup
    );
    // Rank 0's figures, as rows of the same table (and JSON/CSV) as the host path.
    let mut rows: Vec<EpRow> = Vec::new();
    // NCCL's all-to-all with the permute around it, on the same inputs: one rank per GPU (NCCL
    // refuses two ranks on one GPU), so at min(ranks, GPUs) ranks, with our figure at that
    // world size beside it when it differs from --ranks.
    if c.hierarchy && matches!(c.mode, Mode::Normal | Mode::Both) {
        // Direct and hierarchy on the same node split and inputs.
        let p = base(4096);
        let split = hier_split(c, c.ranks)?;
        let r = run_normal_gpu_split(&dev, &p, &split)?;
        rows.extend(r.first().map(|r0| normal_rows(c.cached, &p, r0)).unwrap_or_default());
        let (h, bytes) = ep_bench::ep_gpu::run_normal_gpu_hier(&dev, &p, &split)?;
        let mb = |b: u64| b as f64 / c.ranks as f64 / 1e6;
        println!(
            "internode bytes per rank per dispatch (mean of {} ranks, computed from the \
             routings): direct {:.3} MB, hierarchy {:.3} MB ({:.2}x fewer)",
            c.ranks,
            mb(bytes.direct),
            mb(bytes.hier),
            bytes.direct as f64 / bytes.hier.max(1) as f64
        );
        if let Some(r0) = h.first() {
            rows.extend(hier_rows(c.cached, &p, r0));
        }
        println!(
            "nodes of {} ranks: other nodes through the proxy lane over {} (mapped host \
             memory); the hierarchy's stages take half of each rank's SM budget each",
            split.ranks_per_node, c.provider
        );
    } else if matches!(c.mode, Mode::Normal | Mode::Both) {
        let p = base(4096);
        let r = run_normal_gpu_split(&dev, &p, &normal_split(c, p.num_ranks))?;
        rows.extend(r.first().map(|r0| normal_rows(c.cached, &p, r0)).unwrap_or_default());
        if let Some(r0) = r.first() {
            let budget = c.sms.unwrap_or_else(|| sm_budget(sms, c.ranks));
            rows.extend(copy_rows(&dev, &p, r0, budget, c)?);
        }
        if !c.no_nccl {
            let gpus = fabric_ep::cuda::device_count()?;
            let world = p.num_ranks.min(gpus);
            match ep_bench::nccl::nccl_library() {
                Err(why) => println!("NCCL comparison skipped: {why}"),
                Ok(lib) => {
                    let devices = (0..world)
                        .map(fabric_ep::cuda::Device::new)
                        .collect::<Result<Vec<_>, _>>()?;
                    let pn = GpuBenchParams { num_ranks: world, ..p.clone() };
                    let ours = if world == p.num_ranks {
                        r
                    } else {
                        run_normal_gpu_split(&dev, &pn, &normal_split(c, world))?
                    };
                    let theirs = ep_bench::nccl::run_nccl_baseline(&devices, &pn, c.iters.max(1))?;
                    println!(
                        "NCCL comparison: {lib}, {world} rank(s) on {world} GPU(s) \
                         ({} ranks requested, {gpus} GPU(s) here)",
                        p.num_ranks
                    );
                    if let (Some(o), Some(t)) = (ours.first(), theirs.first()) {
                        if world != p.num_ranks {
                            rows.extend(normal_rows(c.cached, &pn, o));
                        }
                        rows.extend(labelled_rows("normal", "", "nccl+permute", &pn, t));
                    }
                }
            }
        }
    }
    if matches!(c.mode, Mode::LowLatency | Mode::Both) {
        for hook in [false, true] {
            let p = GpuBenchParams { hook, ..base(128) };
            let r = run_ll_gpu(&dev, &p)?;
            rows.extend(
                r.first().map(|r0| gpu_rows("low-latency", hook, &p, r0)).unwrap_or_default(),
            );
        }
        if c.cuda_graph {
            let p = GpuBenchParams { graph: true, ..base(128) };
            let r = run_ll_gpu(&dev, &p)?;
            if let Some(r0) = r.first() {
                rows.extend(labelled_rows("low-latency", " (graph)", "gpu", &p, r0));
            }
        }
    }
    let split_rpn = if c.hierarchy { c.ranks_per_node.unwrap_or(c.ranks) } else { c.ranks };
    let st = gpu_settings(c, split_rpn, &dev, c.ranks);
    let rows: Vec<EpRow> = rows.into_iter().map(|r| r.with(&st)).collect();
    print_rows(c, &rows)?;
    print_nccl_ratios(&rows);
    println!("{GPU_LEGEND}");
    Ok(())
}

/// `--backend gpu` as one rank of a job (`--procs` launches them; torchrun/MPI jobs too): this
/// rank's GPU is `LOCAL_RANK` modulo the visible GPUs, peers in other processes are reached
/// through CUDA IPC; every result checked; rank 0 prints the rows for the launcher.
fn run_gpu_rank(c: &Common, boot: std::sync::Arc<dyn Bootstrap>) -> AnyResult<()> {
    use ep_bench::ep_gpu::{run_ll_gpu_process, run_normal_gpu_rank, GpuBenchParams};
    let dev = fabric_ep::cuda::Device::from_env()?;
    let (rank, world, local) = (boot.rank(), boot.world_size(), boot.local_world_size());
    let gpus = fabric_ep::cuda::device_count()?;
    let on_gpu = local.div_ceil(gpus.max(1));
    let hint = |e: fabric_ep::Error| -> Box<dyn std::error::Error> {
        match e {
            e @ fabric_ep::Error::Timeout { .. } if on_gpu > 1 => {
                format!("{e} ({MPS_HINT})").into()
            }
            e => e.into(),
        }
    };
    let base = |tokens: usize| gpu_params(c, world, tokens);
    let sms = dev.sm_count() as usize;
    if rank == 0 {
        println!(
            "ep-bench (GPU backend): {world} ranks as PROCESSES ({local} on this node, {on_gpu} \
             per GPU, CUDA IPC between processes; {}, {sms} SMs, SM budget {} per rank), {} \
             dispatch / bf16 combine, top-{} of {} experts, {} iters (+{} warm-up); every \
             result checked against the reference",
            dev.name(),
            sm_budget(sms, on_gpu),
            if c.bf16 { "bf16" } else { "fp8" },
            c.topk,
            c.experts,
            c.iters.max(1),
            base(0).warmup
        );
    }
    let mut rows: Vec<EpRow> = Vec::new();
    if c.hierarchy && matches!(c.mode, Mode::Normal | Mode::Both) {
        // Direct and hierarchy on the same node split and inputs (no NCCL comparison).
        let p = base(4096);
        let split = hier_split(c, world)?;
        let r = run_normal_gpu_rank(&dev, &p, &split, boot.clone()).map_err(hint)?;
        rows.extend(normal_rows(c.cached, &p, &r));
        let h = ep_bench::ep_gpu::run_normal_gpu_hier_rank(&dev, &p, &split, boot.clone())
            .map_err(hint)?;
        rows.extend(hier_rows(c.cached, &p, &h));
        if rank == 0 {
            println!(
                "nodes of {} ranks: other nodes through the proxy lane over {}; the \
                 hierarchy's stages take half of each rank's SM budget each",
                split.ranks_per_node, c.provider
            );
        }
    } else if matches!(c.mode, Mode::Normal | Mode::Both) {
        let p = base(4096);
        let r =
            run_normal_gpu_rank(&dev, &p, &normal_split(c, world), boot.clone()).map_err(hint)?;
        rows.extend(normal_rows(c.cached, &p, &r));
        // NCCL's all-to-all + permute on the same inputs, when every process has its own GPU
        // (NCCL refuses two ranks on one GPU).
        if !c.no_nccl {
            match (on_gpu, ep_bench::nccl::nccl_library()) {
                (1, Ok(lib)) => {
                    let t = ep_bench::nccl::run_nccl_baseline_rank(
                        &dev,
                        &p,
                        boot.clone(),
                        c.iters.max(1),
                    )?;
                    rows.extend(labelled_rows("normal", "", "nccl+permute", &p, &t));
                    if rank == 0 {
                        println!("NCCL comparison: {lib}, {world} processes, one GPU each");
                    }
                }
                (1, Err(why)) if rank == 0 => println!("NCCL comparison skipped: {why}"),
                (k, _) if k > 1 && rank == 0 => println!(
                    "NCCL comparison skipped: {k} ranks per GPU (NCCL needs one GPU per rank)"
                ),
                _ => {}
            }
        }
    }
    if matches!(c.mode, Mode::LowLatency | Mode::Both) {
        for hook in [false, true] {
            let p = GpuBenchParams { hook, ..base(128) };
            let r = run_ll_gpu_process(&dev, &p, boot.clone()).map_err(hint)?;
            rows.extend(gpu_rows("low-latency", hook, &p, &r));
        }
    }
    if rank == 0 {
        let split_rpn = if c.hierarchy { c.ranks_per_node.unwrap_or(world) } else { world };
        let st = gpu_settings(c, split_rpn, &dev, on_gpu);
        for r in rows {
            emit(r.with(&st));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    /// Every flag and subcommand of ep-bench says what it does in `--help`.
    #[test]
    fn every_flag_has_help() {
        fn walk(cmd: &clap::Command, missing: &mut Vec<String>) {
            for a in cmd.get_arguments() {
                let builtin = matches!(a.get_id().as_str(), "help" | "version");
                if !builtin && a.get_help().is_none() && a.get_long_help().is_none() {
                    missing.push(format!("{} --{}", cmd.get_name(), a.get_id()));
                }
            }
            for sub in cmd.get_subcommands().filter(|s| s.get_name() != "help") {
                if sub.get_about().is_none() {
                    missing.push(format!("subcommand {}", sub.get_name()));
                }
                walk(sub, missing);
            }
        }
        let mut missing = Vec::new();
        walk(&Cli::command(), &mut missing);
        assert!(missing.is_empty(), "flags without help text: {missing:?}");
        Cli::command().debug_assert();
    }

    /// A rank's stdout is handed on a complete line at a time while it grows (rows stream to
    /// the table as they finish); a last line without its newline comes at the end.
    #[test]
    fn stdout_tail_hands_on_complete_lines_as_they_come() {
        use std::io::Write;
        let path = std::env::temp_dir().join(format!("ep-bench-tail-{}", std::process::id()));
        let mut f = std::fs::File::create(&path).unwrap();
        let mut tail = StdoutTail::default();
        let mut got = Vec::new();
        tail.poll(&path, &mut |l| got.push(l.to_string()));
        assert!(got.is_empty());
        f.write_all(b"first\nsec").unwrap();
        tail.poll(&path, &mut |l| got.push(l.to_string()));
        assert_eq!(got, ["first"]);
        f.write_all(b"ond\r\nthird").unwrap();
        tail.poll(&path, &mut |l| got.push(l.to_string()));
        assert_eq!(got, ["first", "second"]);
        tail.finish(&mut |l| got.push(l.to_string()));
        assert_eq!(got, ["first", "second", "third"]);
        let _ = std::fs::remove_file(&path);
        // A file that is not there yet: nothing, no error.
        tail.poll(&path, &mut |l| got.push(l.to_string()));
        assert_eq!(got.len(), 3);
    }

    /// --json/--csv take an optional FILE ("-" and no value: standard output); --provider and
    /// --timeout fall back on FI_PROVIDER and FEP_TIMEOUT_S (read by clap at parse time).
    #[test]
    fn output_flags_and_env_defaults() {
        let c = Cli::try_parse_from(["ep-bench", "--json", "--csv", "rows.csv", "--ranks", "2"])
            .unwrap()
            .common;
        assert_eq!(c.json.as_deref(), Some(std::path::Path::new("-")));
        assert_eq!(c.csv.as_deref(), Some(std::path::Path::new("rows.csv")));
        assert_eq!(c.ranks, 2);
        let c = Cli::try_parse_from(["ep-bench", "--json=out.json"]).unwrap().common;
        assert_eq!(c.json.as_deref(), Some(std::path::Path::new("out.json")));
        assert!(c.csv.is_none());
        let provider = Cli::command()
            .get_arguments()
            .find(|a| a.get_id() == "provider")
            .and_then(|a| a.get_env().map(|e| e.to_os_string()));
        assert_eq!(provider.as_deref(), Some(std::ffi::OsStr::new("FI_PROVIDER")));
        let timeout = Cli::command()
            .get_arguments()
            .find(|a| a.get_id() == "timeout")
            .and_then(|a| a.get_env().map(|e| e.to_os_string()));
        assert_eq!(timeout.as_deref(), Some(std::ffi::OsStr::new("FEP_TIMEOUT_S")));
    }
}
