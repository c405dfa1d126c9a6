//! Benchmark of low-latency dispatch and combine (kernels/ll_*.cu) with N ranks as threads on
//! one GPU, timed with CUDA events: warm-up, then many steps rotating over input sets; median /
//! p99 per phase. A phase = every rank's send + receive kernels (eager, not a graph); its time
//! runs from an event on rank 0's stream, which every rank's stream waits for, to an event after
//! every rank's receive. The host enqueues each step behind a gate kernel (fep_wait_test spinning
//! on mapped host memory) and opens the gate once everything is queued, so launch gaps are not
//! counted.
//!
//! `gpu_ll_bench [--ranks 1,4] [--tokens 128 --hidden 7168 --topk 8 --experts 256] [--bf16]
//!               [--dump DIR]` (DIR: inputs for scripts/bench_ll_torch.py)

use clap::Parser;
use ep_bench::stats::percentile;
use fabric_ep::abi;
use fabric_ep::cuda::launch::wait_test;
use fabric_ep::cuda::{gpu_available, Device, DeviceBuffer, Event, HostMapped};
use fabric_ep::ep::ll_gpu::{LlDispatchOut, LlGpuConfig, LlGpuGroup};
use fabric_ep::protocol::quant::f32_to_bf16;
use fabric_ep::util::SplitMix64;
use std::io::Write;
use std::time::Duration;

#[derive(Parser, Debug)]
struct Args {
    #[arg(long, default_value = "1,4")]
    ranks: String,
    #[arg(long, default_value_t = 128)]
    tokens: usize,
    #[arg(long, default_value_t = 7168)]
    hidden: usize,
    #[arg(long, default_value_t = 8)]
    topk: usize,
    #[arg(long, default_value_t = 256)]
    experts: usize,
    /// bf16 dispatch instead of fp8.
    #[arg(long)]
    bf16: bool,
    /// Blocks per rank (default: SMs / ranks).
    #[arg(long)]
    sm_budget: Option<u32>,
    #[arg(long, default_value_t = 300)]
    iters: usize,
    #[arg(long, default_value_t = 30)]
    warmup: usize,
    /// Input sets rotated through.
    #[arg(long, default_value_t = 4)]
    sets: usize,
    #[arg(long)]
    dump: Option<std::path::PathBuf>,
    /// Also time rank 0's send kernel alone (an event after it; the rest of the phase is the
    /// receive). The event sits between the two kernels, so run it with FEP_LL_PDL=0: with
    /// programmatic dependent launch it would take the overlap away.
    #[arg(long)]
    split: bool,
    /// Copy every combine row, the rank's own experts' too (the hook's way); default: the own
    /// rows stay in the expert outputs and the receive reads them there (`combine_send_pull`,
    /// what `Buffer` does without the hook).
    #[arg(long)]
    no_pull: bool,
}

struct Set {
    x: DeviceBuffer,
    topk: DeviceBuffer,
    w: DeviceBuffer,
    hx: Vec<u16>,
    htopk: Vec<i64>,
    hw: Vec<f32>,
}

fn make_set(
    dev: &Device,
    rng: &mut SplitMix64,
    a: &Args,
) -> Result<Set, Box<dyn std::error::Error>> {
    let hx: Vec<u16> =
        (0..a.tokens * a.hidden).map(|_| f32_to_bf16((rng.unit_f32() - 0.5) * 8.0)).collect();
    let mut htopk = Vec::with_capacity(a.tokens * a.topk);
    for _ in 0..a.tokens {
        let mut row: Vec<i64> = Vec::new();
        while row.len() < a.topk {
            let g = rng.below(a.experts as u64) as i64;
            if !row.contains(&g) {
                row.push(g);
            }
        }
        htopk.extend_from_slice(&row);
    }
    let hw: Vec<f32> = (0..a.tokens * a.topk).map(|_| rng.unit_f32()).collect();
    Ok(Set {
        x: DeviceBuffer::from_slice(dev, &hx)?,
        topk: DeviceBuffer::from_slice(dev, &htopk)?,
        w: DeviceBuffer::from_slice(dev, &hw)?,
        hx,
        htopk,
        hw,
    })
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    ep_bench::ep_gpu::set_work_queues_for_threads();
    let a = Args::parse();
    if !gpu_available() {
        println!("SKIP: no GPU visible");
        return Ok(());
    }
    let dev = Device::from_env()?;
    let ranks: Vec<usize> =
        a.ranks.split(',').map(|s| s.trim().parse()).collect::<Result<_, _>>()?;
    let gate = HostMapped::new(&dev, 8)?;
    let gate_ctr = gate.atomic_u64(0)?;
    let mut gate_val = 0u64;
    for &nr in &ranks {
        let cfg = LlGpuConfig {
            num_ranks: nr,
            num_experts: a.experts,
            hidden: a.hidden,
            num_topk: a.topk,
            max_tokens_per_rank: a.tokens,
            use_fp8: !a.bf16,
            round_scale: false,
            sm_budget: a.sm_budget,
            timeout: Duration::from_secs(10),
        };
        let mut g = LlGpuGroup::new(&dev, cfg.clone())?;
        let mut rng = SplitMix64(42 + nr as u64);
        let sets: Vec<Vec<Set>> = (0..nr)
            .map(|_| (0..a.sets).map(|_| make_set(&dev, &mut rng, &a)).collect())
            .collect::<Result<_, _>>()?;
        let y_len = cfg.num_local_experts() * cfg.rows_per_expert() * cfg.hidden;
        let ys: Vec<DeviceBuffer> = (0..nr)
            .map(|_| {
                let h: Vec<u16> =
                    (0..y_len).map(|_| f32_to_bf16((rng.unit_f32() - 0.5) * 2.0)).collect();
                DeviceBuffer::from_slice(&dev, &h)
            })
            .collect::<Result<_, _>>()?;
        let outs: Vec<LlDispatchOut> =
            (0..nr).map(|_| LlDispatchOut::new(&dev, &cfg)).collect::<Result<_, _>>()?;
        let combs: Vec<DeviceBuffer> = (0..nr)
            .map(|_| DeviceBuffer::new(&dev, a.tokens * a.hidden * 2))
            .collect::<Result<_, _>>()?;
        if let (Some(dir), 1) = (&a.dump, nr) {
            std::fs::create_dir_all(dir)?;
            for (i, s) in sets[0].iter().enumerate() {
                std::fs::write(dir.join(format!("x{i}.bin")), bytemuck::cast_slice(&s.hx))?;
                std::fs::write(dir.join(format!("topk{i}.bin")), bytemuck::cast_slice(&s.htopk))?;
                std::fs::write(dir.join(format!("w{i}.bin")), bytemuck::cast_slice(&s.hw))?;
            }
            let mut f = std::fs::File::create(dir.join("meta.json"))?;
            write!(
                f,
                "{{\"tokens\": {}, \"hidden\": {}, \"topk\": {}, \"experts\": {}, \"sets\": {}}}",
                a.tokens, a.hidden, a.topk, a.experts, a.sets
            )?;
        }
        let start = Event::new(&dev)?;
        let mid = Event::new(&dev)?;
        let stop = Event::new(&dev)?;
        let joins: Vec<Event> =
            (0..nr).map(|_| Event::new_untimed(&dev)).collect::<Result<_, _>>()?;
        let (mut td, mut tc) = (Vec::new(), Vec::new());
        let (mut sd, mut sc) = (Vec::new(), Vec::new());
        for it in 0..a.warmup + a.iters {
            let si = it % a.sets;
            for phase in 0..2 {
                gate_val += 1;
                let gp = abi::fep_wait_test_params {
                    counter: gate.device_ptr(),
                    expected: gate_val,
                    budget_cycles: 20_000_000_000,
                    rank: 0,
                    phase: 0,
                    peer: u32::MAX,
                    ..Default::default()
                };
                // SAFETY: the gate outlives the synchronisation below.
                unsafe { wait_test(g.ranks[0].stream(), gp)? };
                start.record(g.ranks[0].stream())?;
                for r in g.ranks.iter().skip(1) {
                    r.stream().wait_event(&start)?;
                }
                let mut tickets = Vec::with_capacity(nr);
                for r in 0..nr {
                    let s = &sets[r][si];
                    // SAFETY: every buffer lives until finish() below.
                    let t = unsafe {
                        if phase == 0 {
                            g.ranks[r].dispatch_send(&s.x, &s.topk, a.tokens, &outs[r])?
                        } else {
                            if a.no_pull {
                                g.ranks[r].combine_send(&ys[r], &outs[r], a.tokens)?
                            } else {
                                g.ranks[r].combine_send_pull(&ys[r], &outs[r], a.tokens)?
                            }
                        }
                    };
                    tickets.push(t);
                    if a.split && r == 0 {
                        mid.record(g.ranks[0].stream())?;
                    }
                }
                for r in 0..nr {
                    let s = &sets[r][si];
                    // SAFETY: as above.
                    unsafe {
                        // Chained (programmatic dependent launch) unless --split put an event
                        // between rank 0's send and receive.
                        let t = if a.split && r == 0 { tickets[r] } else { tickets[r].chained() };
                        if phase == 0 {
                            g.ranks[r].dispatch_recv(t, &outs[r])?
                        } else {
                            g.ranks[r].combine_recv(t, &s.topk, &s.w, &outs[r], &combs[r])?
                        }
                    };
                }
                let s0 = g.ranks[0].stream();
                for (j, r) in joins.iter().zip(&g.ranks).skip(1) {
                    j.record(r.stream())?;
                    s0.wait_event(j)?;
                }
                stop.record(s0)?;
                gate_ctr.store(gate_val, std::sync::atomic::Ordering::Release);
                g.finish()?;
                let us = start.elapsed_ms(&stop)? as f64 * 1e3;
                let send_us = if a.split { start.elapsed_ms(&mid)? as f64 * 1e3 } else { 0.0 };
                if it >= a.warmup {
                    if phase == 0 {
                        td.push(us);
                        sd.push(send_us);
                    } else {
                        tc.push(us);
                        sc.push(send_us);
                    }
                }
            }
        }
        // Sanity: every rank received T*K rows in total across the group.
        let mut rows = 0i64;
        for o in &outs {
            let c: Vec<i32> = o.recv_count.to_vec()?;
            rows += c.iter().map(|&v| v as i64).sum::<i64>();
        }
        let want = (nr * a.tokens * a.topk) as i64;
        if rows != want {
            return Err(format!("ranks {nr}: {rows} rows received, expected {want}").into());
        }
        for v in [&mut td, &mut tc, &mut sd, &mut sc] {
            v.sort_by(|x, y| x.total_cmp(y));
        }
        if a.split {
            println!(
                "LL_SPLIT ranks={nr} dispatch_send_median_us={:.2} combine_send_median_us={:.2} \
                 (rank 0's send kernel from the phase start; the rest is the receive)",
                percentile(&sd, 50.0),
                percentile(&sc, 50.0)
            );
        }
        println!(
            "LL_RESULT ranks={nr} grid={} tokens={} hidden={} topk={} experts={} dtype={} \
             dispatch_median_us={:.2} dispatch_p99_us={:.2} combine_median_us={:.2} combine_p99_us={:.2} iters={} \
             pdl={} pull={}",
            g.ranks[0].grid(),
            a.tokens,
            a.hidden,
            a.topk,
            a.experts,
            if a.bf16 { "bf16" } else { "fp8" },
            percentile(&td, 50.0),
            percentile(&td, 99.0),
            percentile(&tc, 50.0),
            percentile(&tc, 99.0),
            a.iters,
            fabric_ep::cuda::launch::ll_pdl(),
            !a.no_pull
        );
    }
    Ok(())
}
