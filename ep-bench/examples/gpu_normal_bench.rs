//! Benchmark of normal-mode intranode dispatch/combine (kernels/normal_*.cu): `ranks` ranks as
//! streams of one process on one GPU, each kernel within its SM budget. Checked once against the
//! reference, then timed with CUDA events: warm-up, median of many iterations of all ranks'
//! kernels together (an event on a fork stream before, every rank's stream joined after).
//!
//! Reports (DeepEP's definition) dispatch GB/s = bytes of the tokens each rank sends (x + fp8
//! scales, one copy per destination rank, the rank itself included) / time, and combine GB/s =
//! bytes of bf16 rows each rank receives / time; and the aggregate bytes the kernels move through
//! device memory (each stage's reads + writes, counted below) against a cuMemcpyDtoD ceiling
//! (read + write) measured in the same run.
//!
//! `gpu_normal_bench [--tokens 4096 --hidden 7168 --topk 8 --experts 256 --ranks 4 --sms 32]`

use clap::Parser;
use ep_bench::stats::percentile;
use fabric_ep::cuda::{gpu_available, Device, DeviceBuffer, Event, Stream};
use fabric_ep::ep::normal_gpu::harness::{
    launch_combine, launch_dispatch, step, RankBuffers, RankInput, StepOptions,
};
use fabric_ep::ep::normal_gpu::{NormalGpuRank, NormalGpuSettings};
use fabric_ep::protocol::config::DispatchDtype;
use fabric_ep::protocol::layout::{random_topk_idx, LayoutShape};
use fabric_ep::protocol::quant::{f32_to_bf16, quantize_bf16};
use fabric_ep::protocol::reference::{
    normal_dispatch, NormalParams, NormalRankInput, Tokens, TokensRef,
};
use fabric_ep::util::SplitMix64;
use std::time::{Duration, Instant};

#[derive(Parser, Debug)]
struct Args {
    #[arg(long, default_value_t = 4096)]
    tokens: usize,
    #[arg(long, default_value_t = 7168)]
    hidden: usize,
    #[arg(long, default_value_t = 8)]
    topk: usize,
    #[arg(long, default_value_t = 256)]
    experts: usize,
    #[arg(long, default_value_t = 4)]
    ranks: usize,
    /// SM budget per rank (blocks per kernel).
    #[arg(long, default_value_t = 32)]
    sms: usize,
    /// bf16 dispatch instead of fp8.
    #[arg(long)]
    bf16: bool,
    #[arg(long, default_value = "16")]
    chunks: String,
    /// Chunk slots per peer queue (default: the Buffer's for `--ranks`,
    /// `ep::gpu::default_slots_per_peer`).
    #[arg(long)]
    spp: Option<usize>,
    #[arg(long, default_value_t = 50)]
    iters: usize,
    #[arg(long, default_value_t = 5)]
    warmup: usize,
    /// Skip the one-time check against the CPU reference.
    #[arg(long)]
    no_check: bool,
}

/// Times `launch` (all ranks) `iters` times after `warmup`; returns the median ms.
fn time_all(
    dev: &Device,
    fork: &Stream,
    streams: &[&Stream],
    warmup: usize,
    iters: usize,
    mut launch: impl FnMut() -> fabric_ep::Result<()>,
) -> fabric_ep::Result<f64> {
    let start = Event::new(dev)?;
    let stop = Event::new(dev)?;
    let joins: Vec<Event> =
        streams.iter().map(|_| Event::new_untimed(dev)).collect::<Result<_, _>>()?;
    let mut ms = Vec::with_capacity(iters);
    for i in 0..warmup + iters {
        start.record(fork)?;
        for s in streams {
            s.wait_event(&start)?;
        }
        launch()?;
        for (s, e) in streams.iter().zip(&joins) {
            e.record(s)?;
            fork.wait_event(e)?;
        }
        stop.record(fork)?;
        stop.synchronize()?;
        if i >= warmup {
            ms.push(start.elapsed_ms(&stop)? as f64);
        }
    }
    Ok(percentile(&ms, 50.0))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    ep_bench::ep_gpu::set_work_queues_for_threads();
    let a = Args::parse();
    if !gpu_available() {
        println!("SKIP: no GPU visible");
        return Ok(());
    }
    let dev = Device::from_env()?;
    let dtype = if a.bf16 { DispatchDtype::Bf16 } else { DispatchDtype::Fp8E4m3 };
    let (t, h, k, r) = (a.tokens, a.hidden, a.topk, a.ranks);
    let spp = a.spp.unwrap_or_else(|| fabric_ep::ep::gpu::default_slots_per_peer(r));
    println!(
        "device {} ({} SMs); {r} ranks x {} SMs, {t} tokens, hidden {h}, top-{k} of {} experts, {:?} dispatch",
        dev.name(),
        dev.sm_count(),
        a.sms,
        a.experts,
        dtype
    );

    // Device copy ceiling: cuMemcpyDtoD of 2 GiB, read + write counted.
    let copy_bytes = 2usize << 30;
    let src = DeviceBuffer::new(&dev, copy_bytes)?;
    src.memset(0x5A)?;
    let mut dst = DeviceBuffer::new(&dev, copy_bytes)?;
    dst.copy_from_device(&src)?;
    let mut cms = Vec::new();
    for _ in 0..10 {
        let t0 = Instant::now();
        dst.copy_from_device(&src)?;
        dev.synchronize()?;
        cms.push(t0.elapsed().as_secs_f64());
    }
    let ceiling = 2.0 * copy_bytes as f64 / percentile(&cms, 50.0) / 1e9;
    println!("copy ceiling: cuMemcpyDtoD 2 GiB: {ceiling:.0} GB/s (read + write)");
    drop(dst);
    drop(src);

    // Inputs.
    let mut rng = SplitMix64(42);
    let shape = LayoutShape::new(t, k, a.experts, r, r)?;
    let inputs: Vec<RankInput> = (0..r)
        .map(|_| {
            let idx = random_topk_idx(&mut rng, shape, 0, false);
            let w: Vec<f32> = (0..t * k).map(|_| rng.unit_f32()).collect();
            let xb: Vec<u16> =
                (0..t * h).map(|_| f32_to_bf16(rng.unit_f32() * 4.0 - 2.0)).collect();
            let (x, x_scales) = match dtype {
                DispatchDtype::Bf16 => (bytemuck::cast_slice(&xb).to_vec(), Vec::new()),
                DispatchDtype::Fp8E4m3 => quantize_bf16(&xb, h, false).expect("quantize"),
            };
            RankInput {
                num_tokens: t,
                x,
                x_scales,
                topk_idx: idx,
                topk_weights: w,
                // What the experts "computed": bf16 rows for combine (recv_x is fp8).
                combine_x: Some(
                    (0..t * r * h)
                        .map(|i| f32_to_bf16(((i * 2654435761) % 1000) as f32 * 1e-3 - 0.5))
                        .collect(),
                ),
                combine_weights: None,
            }
        })
        .collect();
    let want = if a.no_check {
        None
    } else {
        let p = NormalParams {
            num_experts: a.experts,
            hidden: h,
            num_topk: k,
            expert_alignment: 1,
            num_worst_tokens: None,
        };
        let x16s: Vec<Vec<u16>> = inputs
            .iter()
            .map(|i| i.x.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect())
            .collect();
        let ri: Vec<NormalRankInput> = inputs
            .iter()
            .zip(&x16s)
            .map(|(i, x16)| NormalRankInput {
                x: match dtype {
                    DispatchDtype::Bf16 => TokensRef::Bf16(x16.as_slice()),
                    DispatchDtype::Fp8E4m3 => TokensRef::Fp8 { x: &i.x, scales: &i.x_scales },
                },
                topk_idx: &i.topk_idx,
                topk_weights: &i.topk_weights,
            })
            .collect();
        Some(normal_dispatch(&p, &ri)?)
    };

    let mut rows_cap = 0;
    for chunk in a.chunks.split(',').map(|s| s.trim().parse::<usize>()) {
        let chunk = chunk?;
        let settings = NormalGpuSettings {
            chunk_tokens: chunk,
            slots_per_peer: spp,
            num_sms: a.sms,
            timeout: Duration::from_secs(10),
            ..NormalGpuSettings::new(r, a.experts, h, k, dtype)
        };
        let mut ranks = NormalGpuRank::local_group(&dev, &settings)?;
        let cap = t * r;
        let mut bufs: Vec<RankBuffers> = ranks
            .iter()
            .zip(&inputs)
            .map(|(rk, i)| RankBuffers::new(rk, i, cap))
            .collect::<Result<_, _>>()?;
        // One checked step (threads as ranks).
        let rows: Vec<usize> = std::thread::scope(|s| {
            let hs: Vec<_> = ranks
                .iter_mut()
                .zip(bufs.iter_mut())
                .map(|(rk, b)| {
                    s.spawn(move || step(rk, b, StepOptions::default()).map(|o| o.out_rows))
                })
                .collect();
            hs.into_iter().map(|h| h.join().expect("rank thread")).collect::<Result<Vec<_>, _>>()
        })?;
        rows_cap = rows_cap.max(*rows.iter().max().unwrap_or(&0));
        if let Some(w) = &want {
            for (i, b) in bufs.iter().enumerate() {
                let rx: Vec<u8> = b.recv_x.to_vec()?;
                let ok = match &w[i].recv_x {
                    Tokens::Bf16(v) => rx[..rows[i] * h * 2] == *bytemuck::cast_slice::<u16, u8>(v),
                    Tokens::Fp8 { x, .. } => rx[..rows[i] * h] == x[..],
                };
                if !ok || rows[i] != w[i].num_recv_tokens {
                    return Err(format!(
                        "chunk {chunk}: rank {i} recv_x differs from the reference"
                    )
                    .into());
                }
            }
            println!("chunk {chunk}: recv_x of every rank equals the reference");
        }
        let fork = Stream::new(&dev)?;
        // Field-wise borrows: streams shared with the timer, handles written by notify.
        let mut parts: Vec<_> = bufs
            .iter_mut()
            .map(|b| {
                (&b.stream, &b.layout_gpu, &b.layout, &b.topk_idx, &mut b.handle, b.num_tokens)
            })
            .collect();
        let streams: Vec<&Stream> = parts.iter().map(|p| p.0).collect();
        // SAFETY (all launches below): buffers live until the events synchronise in time_all.
        let notify_ms = time_all(&dev, &fork, &streams, a.warmup, a.iters, || {
            for (rk, (stream, lg, lb, topk, handle, n)) in ranks.iter_mut().zip(parts.iter_mut()) {
                unsafe {
                    lg.launch(stream, topk, *n, k, lb, None, rk.rank() as u32, Default::default())?;
                    rk.notify(stream, lb, *n, handle, 1, cap)?;
                }
            }
            Ok(())
        })?;
        drop(parts);
        let streams: Vec<&Stream> = bufs.iter().map(|b| &b.stream).collect();
        let disp_ms = time_all(&dev, &fork, &streams, a.warmup, a.iters, || {
            for (rk, (b, &n)) in ranks.iter().zip(bufs.iter().zip(&rows)) {
                unsafe { launch_dispatch(rk, b, n)? };
            }
            Ok(())
        })?;
        let comb_ms = time_all(&dev, &fork, &streams, a.warmup, a.iters, || {
            for (rk, (b, &n)) in ranks.iter().zip(bufs.iter().zip(&rows)) {
                unsafe { launch_combine(rk, b, n)? };
            }
            Ok(())
        })?;
        for (rk, b) in ranks.iter().zip(&bufs) {
            rk.finish(&b.stream)?;
        }

        // Bytes. Copies = (token, destination rank) pairs = sum of received rows.
        let copies: usize = rows.iter().sum();
        let map = ranks[0].comm_map();
        let drec = map.layout.dispatch_record.bytes as f64;
        let crec = map.layout.combine_record.bytes as f64;
        let tok = dtype.token_bytes(h as u64) as f64; // x + fp8 scales
        let meta = (k * (8 + 4) + 4) as f64; // topk ids + weights in, ids (i64) + weights + src out
        let disp_per_rank = copies as f64 / r as f64 * tok; // DeepEP: bytes each rank sends
        let comb_per_rank = copies as f64 / r as f64 * (2 * h) as f64; // bytes each rank receives
                                                                       // Dispatch moves per copy: read x row + meta, write record, read record, write outputs.
        let disp_moved = copies as f64 * (tok + drec + drec + tok + meta);
        // Combine moves per copy: read row + weights, and for a copy to another rank write its
        // record and read it back (a rank reads its own rows in place); per token: write the
        // bf16 row and the weights. Own copies: rank q's tokens with an expert on q.
        let lx = a.experts / r;
        let own: usize = inputs
            .iter()
            .enumerate()
            .map(|(q, inp)| {
                inp.topk_idx
                    .chunks(k)
                    .filter(|row| row.iter().any(|&e| e >= 0 && e as usize / lx == q))
                    .count()
            })
            .sum();
        let comb_moved = copies as f64 * (2 * h + 4 * k) as f64
            + (copies - own) as f64 * 2.0 * crec
            + (r * t) as f64 * (2 * h + 4 * k) as f64;
        let disp_floor = (r * t) as f64 * tok + copies as f64 * tok; // read x once, write each copy
        let comb_floor = copies as f64 * (2 * h) as f64 + (r * t * 2 * h) as f64;
        let us = |ms: f64| ms * 1e3;
        let gbs = |b: f64, ms: f64| b / (ms * 1e-3) / 1e9;
        println!(
            "NORMAL_RESULT chunk {chunk} spp {} sms {}: layout+notify {:.1} us | dispatch {:.1} us {:.1} GB/s per rank | combine {:.1} us {:.1} GB/s per rank",
            spp,
            a.sms,
            us(notify_ms),
            us(disp_ms),
            gbs(disp_per_rank, disp_ms),
            us(comb_ms),
            gbs(comb_per_rank, comb_ms)
        );
        println!(
            "NORMAL_MOVED chunk {chunk}: dispatch {:.2} GB moved -> {:.0} GB/s = {:.0}% of copy ceiling (floor {:.2} GB: {:.0}%) | combine {:.2} GB -> {:.0} GB/s = {:.0}% (floor {:.2} GB: {:.0}%) | copies {copies}",
            disp_moved / 1e9,
            gbs(disp_moved, disp_ms),
            100.0 * gbs(disp_moved, disp_ms) / ceiling,
            disp_floor / 1e9,
            100.0 * gbs(disp_floor, disp_ms) / ceiling,
            comb_moved / 1e9,
            gbs(comb_moved, comb_ms),
            100.0 * gbs(comb_moved, comb_ms) / ceiling,
            comb_floor / 1e9,
            100.0 * gbs(comb_floor, comb_ms) / ceiling,
        );
    }
    let _ = rows_cap;
    Ok(())
}
