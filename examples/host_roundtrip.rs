//! A normal-mode dispatch and combine on the host backend, the way a program uses the library:
//! four ranks as threads of this process (a real job runs one process per rank and bootstraps
//! with `TcpStore::from_env`), each with its own `Buffer` over libfabric's `shm` provider.
//!
//! Every rank sends its tokens to the ranks that hold their top-k experts, returns what it
//! received unchanged, and checks the combine: each token comes back as the sum over the
//! distinct ranks it went to, so `combined = x * destination ranks`. No GPU needed:
//!
//! ```sh
//! cargo run --example host_roundtrip            # or: -- --ranks 2 --provider "tcp;ofi_rxm"
//! ```

use std::sync::Arc;
use std::time::Duration;

use fabric_ep::bootstrap::{Bootstrap, InProcGroup};
use fabric_ep::ep::buffer::{Buffer, BufferOptions, CombineArgs, DispatchArgs, Tokens};
use fabric_ep::protocol::config::{EpConfig, EpSettings};
use fabric_ep::protocol::quant::{bf16_to_f32, f32_to_bf16};

const EXPERTS_PER_RANK: usize = 2;
const HIDDEN: usize = 256;
const TOPK: usize = 2;
const TOKENS: usize = 8;

/// Rank `rank`'s top-k routing, `[TOKENS, TOPK]` global expert ids (-1 = none): spread over
/// every expert, some tokens sending twice to one rank and one to no expert.
fn routing(rank: usize, num_experts: usize) -> Vec<i64> {
    let mut idx = Vec::with_capacity(TOKENS * TOPK);
    for t in 0..TOKENS {
        let first = (rank + t) % num_experts;
        let second = (rank + 3 * t + 1) % num_experts;
        let row = match t {
            5 => [-1, -1],
            _ if second == first => [first as i64, -1],
            _ => [first as i64, second as i64],
        };
        idx.extend_from_slice(&row);
    }
    idx
}

/// Token `t` of rank `rank`: every channel the same small integer, exact in bf16 also when
/// summed over a few ranks.
fn token_value(rank: usize, t: usize) -> f32 {
    (rank * TOKENS + t + 1) as f32
}

fn run_rank(
    rank: usize,
    num_ranks: usize,
    boot: Arc<dyn Bootstrap>,
    provider: &str,
) -> fabric_ep::Result<()> {
    let num_experts = EXPERTS_PER_RANK * num_ranks;
    let mut settings = EpSettings::new(rank, num_ranks, num_experts, HIDDEN, TOPK);
    settings.timeout = Duration::from_secs(30);
    // Validated once here; the buffer then trusts the setting.
    let cfg = EpConfig::new(settings)?;
    let mut buf = Buffer::new(cfg, boot, BufferOptions::host(provider))?;

    let topk_idx = routing(rank, num_experts);
    let topk_weights = vec![1.0f32; TOKENS * TOPK];
    let x: Vec<u16> = (0..TOKENS)
        .flat_map(|t| std::iter::repeat_n(f32_to_bf16(token_value(rank, t)), HIDDEN))
        .collect();

    let out = buf.dispatch(&DispatchArgs {
        x: Tokens::Bf16(&x),
        topk_idx: Some(&topk_idx),
        topk_weights: Some(&topk_weights),
        ..DispatchArgs::default()
    })?;
    let recv_x = out.recv_x_bf16().expect("a bf16 dispatch receives bf16");
    // What every rank sends here: one row per (token, this rank) pair of its routing.
    let expected_rows: usize = (0..num_ranks)
        .map(|src| {
            routing(src, num_experts)
                .chunks(TOPK)
                .filter(|row| row.iter().any(|&e| e >= 0 && e as usize / EXPERTS_PER_RANK == rank))
                .count()
        })
        .sum();
    assert_eq!(out.num_recv_tokens, expected_rows, "rank {rank}: received rows");

    // The experts would run here; this rank returns its rows as they came.
    let comb = buf.combine(&CombineArgs { x: recv_x, handle: &out.handle, topk_weights: None })?;
    for (t, row) in topk_idx.chunks(TOPK).enumerate() {
        let mut dest: Vec<usize> =
            row.iter().filter(|&&e| e >= 0).map(|&e| e as usize / EXPERTS_PER_RANK).collect();
        dest.sort_unstable();
        dest.dedup();
        let want = token_value(rank, t) * dest.len() as f32;
        let got = &comb.combined_x[t * HIDDEN..(t + 1) * HIDDEN];
        assert!(
            got.iter().all(|&v| bf16_to_f32(v) == want),
            "rank {rank} token {t}: combined {} instead of {want}",
            bf16_to_f32(got[0])
        );
    }
    println!(
        "rank {rank}: dispatched {TOKENS} tokens, received {} rows, combine matches",
        out.num_recv_tokens
    );
    // A collective: every rank destroys its buffer.
    buf.destroy()
}

fn main() {
    let mut num_ranks = 4;
    let mut provider = "shm".to_string();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match (a.as_str(), args.next()) {
            ("--ranks", Some(v)) => num_ranks = v.parse().expect("--ranks: a number"),
            ("--provider", Some(v)) => provider = v,
            _ => panic!("usage: host_roundtrip [--ranks N] [--provider NAME]"),
        }
    }
    // One bootstrap per rank: the all-gathers the buffers connect with run between threads.
    let boots = InProcGroup::new(num_ranks, num_ranks, Duration::from_secs(30))
        .expect("in-process bootstrap");
    let results: Vec<fabric_ep::Result<()>> = std::thread::scope(|s| {
        let ranks: Vec<_> = boots
            .into_iter()
            .enumerate()
            .map(|(rank, boot)| {
                let provider = provider.as_str();
                s.spawn(move || run_rank(rank, num_ranks, Arc::new(boot), provider))
            })
            .collect();
        ranks.into_iter().map(|h| h.join().expect("rank thread panicked")).collect()
    });
    for (rank, r) in results.into_iter().enumerate() {
        if let Err(e) = r {
            eprintln!("rank {rank}: {e}");
            std::process::exit(1);
        }
    }
    println!("{num_ranks} ranks over {provider}: every combine matches its input");
}
