//! Repeats one checked multi-rank GPU case (ranks as threads of this process, a fresh `Buffer`
//! per round, as `tests/gpu_buffer.rs` does) and counts the rounds that fail, instead of
//! stopping at the first: the tool for measuring an intermittent failure's rate and whether a
//! change moves it.
//!
//! `gpu_flake_stress [--mode ll|normal] [--ranks 4] [--rounds 20] [--timeout-s 3] [--hook]
//!                   [--standard] [--sms N]`
//!
//! Prints one line per failed round (its first 3000 characters) and a final
//! `STRESS_RESULT mode=.. ranks=.. rounds=.. failed=..` line.

use clap::Parser;
use ep_bench::ep_gpu::{run_ll_gpu, run_normal_gpu, GpuBenchParams};
use fabric_ep::cuda::{gpu_available, Device};
use std::time::{Duration, Instant};

#[derive(Parser, Debug)]
struct Args {
    /// `ll` (low-latency dispatch + combine) or `normal` (num_worst_tokens form).
    #[arg(long, default_value = "ll")]
    mode: String,
    #[arg(long, default_value_t = 4)]
    ranks: usize,
    #[arg(long, default_value_t = 20)]
    rounds: usize,
    /// Per-wait timeout; a failure costs about this long.
    #[arg(long, default_value_t = 3)]
    timeout_s: u64,
    #[arg(long)]
    hook: bool,
    /// DeepEP's standard shape (LL: 128 tokens; normal: 4096) instead of the small one.
    #[arg(long)]
    standard: bool,
    /// Blocks per rank (default: the library's).
    #[arg(long)]
    sms: Option<usize>,
    /// Steps per round.
    #[arg(long, default_value_t = 2)]
    iters: usize,
}

fn params(a: &Args, round: usize) -> GpuBenchParams {
    let ll = a.mode == "ll";
    let base = match (ll, a.standard) {
        (true, true) => GpuBenchParams::ll_standard(a.ranks),
        (false, true) => GpuBenchParams::normal_standard(a.ranks),
        (true, false) => GpuBenchParams {
            num_tokens: 64,
            hidden: 2048,
            num_experts: 64,
            drop_pct: 10,
            ..GpuBenchParams::ll_standard(a.ranks)
        },
        (false, false) => GpuBenchParams {
            num_tokens: 200,
            num_experts: 64,
            drop_pct: 40,
            worst: true,
            ..GpuBenchParams::normal_standard(a.ranks)
        },
    };
    GpuBenchParams {
        iters: a.iters,
        warmup: 0,
        seed: 0x5eed + round as u64,
        timeout: Duration::from_secs(a.timeout_s),
        num_sms: a.sms,
        hook: a.hook,
        ..base
    }
}

fn main() {
    let a = Args::parse();
    if !gpu_available() {
        eprintln!("gpu_flake_stress: no GPU");
        std::process::exit(2);
    }
    if a.mode != "ll" && a.mode != "normal" {
        eprintln!("gpu_flake_stress: --mode must be ll or normal, not {:?}", a.mode);
        std::process::exit(2);
    }
    let dev = Device::from_env().expect("open the GPU");
    let t0 = Instant::now();
    let mut failed = 0;
    for round in 0..a.rounds {
        let p = params(&a, round);
        let r = if a.mode == "ll" { run_ll_gpu(&dev, &p) } else { run_normal_gpu(&dev, &p) };
        if let Err(e) = r {
            failed += 1;
            let s = e.to_string();
            println!("round {round} FAILED: {}", s.chars().take(3000).collect::<String>());
        }
    }
    println!(
        "STRESS_RESULT mode={} ranks={} standard={} hook={} sms={} rounds={} failed={} secs={:.1}",
        a.mode,
        a.ranks,
        a.standard,
        a.hook,
        a.sms.map_or("default".to_string(), |s| s.to_string()),
        a.rounds,
        failed,
        t0.elapsed().as_secs_f64()
    );
}
