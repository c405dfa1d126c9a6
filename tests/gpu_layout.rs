//! GPU: the layout kernel against the Rust reference (src/protocol/layout.rs).
//! Ignored without `--include-ignored` (CI has no GPU); scripts/gpu-check.sh runs them.

mod common;
use common::gpu::gpu;
use fabric_ep::cuda::{CudaError, DevErrorRecord, Device, DeviceBuffer, Stream};
use fabric_ep::ep::layout_gpu::{DispatchLayoutGpu, LayoutBuffers, LayoutTuning, LayoutVariant};
use fabric_ep::protocol::layout::{dispatch_layout, random_topk_idx, Layout, LayoutShape};
use fabric_ep::util::SplitMix64;
use std::time::Duration;

const POISON: u8 = 0xAB;

/// Runs the kernel on `idx` with poisoned outputs and returns the result.
fn run_gpu(
    dev: &Device,
    stream: &Stream,
    gpu: &DispatchLayoutGpu,
    s: LayoutShape,
    idx: &[i64],
    tuning: LayoutTuning,
) -> Layout {
    let topk = DeviceBuffer::from_slice(dev, idx).unwrap();
    let out = LayoutBuffers::new(gpu, s.num_tokens).unwrap();
    out.poison(POISON).unwrap();
    let err = DevErrorRecord::new(dev).unwrap();
    // SAFETY: buffers outlive the synchronisation below; one launch at a time on `gpu`.
    unsafe { gpu.launch(stream, &topk, s.num_tokens, s.num_topk, &out, Some(&err), 0, tuning) }
        .unwrap();
    stream.synchronize_within(Duration::from_secs(20)).unwrap();
    err.check().unwrap();
    out.to_host(s.num_tokens).unwrap()
}

/// Both variants against the reference.
fn check(dev: &Device, stream: &Stream, gpu: &DispatchLayoutGpu, s: LayoutShape, idx: &[i64]) {
    for v in [LayoutVariant::Cluster, LayoutVariant::Grid] {
        check_one(dev, stream, gpu, s, idx, LayoutTuning { variant: Some(v), tile: None });
    }
}

fn check_one(
    dev: &Device,
    stream: &Stream,
    gpu: &DispatchLayoutGpu,
    s: LayoutShape,
    idx: &[i64],
    tuning: LayoutTuning,
) {
    let want = dispatch_layout(
        idx,
        s.num_tokens,
        s.num_topk,
        s.num_experts,
        s.num_ranks,
        s.ranks_per_node,
    )
    .unwrap();
    let got = run_gpu(dev, stream, gpu, s, idx, tuning);
    if got != want {
        let bad_row = (0..s.num_tokens).find(|&t| {
            let r = t * s.num_ranks..(t + 1) * s.num_ranks;
            got.is_token_in_rank[r.clone()] != want.is_token_in_rank[r]
        });
        panic!(
            "{s:?} {tuning:?}: GPU differs from reference\n per_rank {:?}\n want     {:?}\n per_node {:?} want {:?}\n \
             per_expert equal: {}\n first bad row: {bad_row:?}",
            got.num_tokens_per_rank,
            want.num_tokens_per_rank,
            got.num_tokens_per_node,
            want.num_tokens_per_node,
            got.num_tokens_per_expert == want.num_tokens_per_expert
        );
    }
}

#[test]
#[ignore = "needs a GPU: scripts/gpu-check.sh runs it"]
fn gpu_layout_matches_reference_random() {
    let Some(dev) = gpu() else { return };
    let stream = Stream::new(&dev).unwrap();
    let mut rng = SplitMix64(0x1a0);
    let mut cases = 0;
    for &ranks in &[1usize, 2, 3, 4, 5, 7, 8, 12, 16, 24, 32, 48, 64] {
        // Experts: multiples of ranks in 8..=288.
        let all: Vec<usize> = (1..=288 / ranks).map(|m| m * ranks).filter(|&e| e >= 8).collect();
        let (first, last) = (all[0], all[all.len() - 1]);
        let experts_list: Vec<usize> =
            all.into_iter().filter(|&e| e == first || e == last || e == 256).collect();
        let rpn = if ranks % 8 == 0 {
            8
        } else if ranks % 4 == 0 {
            4
        } else {
            1
        };
        for &experts in &experts_list {
            let gpu = DispatchLayoutGpu::new(&dev, experts, ranks, rpn).unwrap();
            for topk in 1..=9usize {
                for &tokens in &[0usize, 1, 33, 257, 1000, 4096] {
                    if tokens == 4096 && topk % 4 != 0 {
                        continue;
                    }
                    let drop = [0u64, 10, 50][(cases % 3) as usize];
                    let s = LayoutShape::new(tokens, topk, experts, ranks, rpn).unwrap();
                    let idx = random_topk_idx(&mut rng, s, drop, cases % 7 == 0);
                    check(&dev, &stream, &gpu, s, &idx);
                    cases += 1;
                }
            }
        }
    }
    eprintln!("layout: {cases} random cases match the reference");
    assert!(cases > 500);
}

#[test]
#[ignore = "needs a GPU: scripts/gpu-check.sh runs it"]
fn gpu_layout_all_tokens_one_expert_and_all_dropped() {
    let Some(dev) = gpu() else { return };
    let stream = Stream::new(&dev).unwrap();
    let gpu = DispatchLayoutGpu::new(&dev, 256, 64, 8).unwrap();
    let s = LayoutShape::new(4096, 8, 256, 64, 8).unwrap();
    let mut idx = vec![-1i64; 4096 * 8];
    for t in 0..4096 {
        idx[t * 8 + t % 8] = 77;
    }
    check(&dev, &stream, &gpu, s, &idx);
    let got = run_gpu(&dev, &stream, &gpu, s, &idx, LayoutTuning::default());
    assert_eq!(got.num_tokens_per_expert[77], 4096);
    assert_eq!(got.num_tokens_per_rank[77 / 4], 4096);
    let dropped = vec![-1i64; 4096 * 8];
    check(&dev, &stream, &gpu, s, &dropped);
}

#[test]
#[ignore = "needs a GPU: scripts/gpu-check.sh runs it"]
fn gpu_layout_zero_tokens_writes_zero_counts() {
    let Some(dev) = gpu() else { return };
    let stream = Stream::new(&dev).unwrap();
    let gpu = DispatchLayoutGpu::new(&dev, 64, 8, 8).unwrap();
    let s = LayoutShape::new(0, 8, 64, 8, 8).unwrap();
    let got = run_gpu(&dev, &stream, &gpu, s, &[], LayoutTuning::default());
    assert_eq!(got.num_tokens_per_rank, vec![0; 8]);
    assert_eq!(got.num_tokens_per_node, vec![0; 1]);
    assert_eq!(got.num_tokens_per_expert, vec![0; 64]);
}

#[test]
#[ignore = "needs a GPU: scripts/gpu-check.sh runs it"]
fn gpu_layout_every_tile_size_and_reused_workspace() {
    let Some(dev) = gpu() else { return };
    let stream = Stream::new(&dev).unwrap();
    let gpu = DispatchLayoutGpu::new(&dev, 288, 48, 8).unwrap();
    let mut rng = SplitMix64(99);
    let variants = [LayoutVariant::Cluster, LayoutVariant::Grid];
    for (tile, variant) in
        [16usize, 32, 64, 128, 256, 1024].into_iter().flat_map(|t| variants.map(|v| (t, v)))
    {
        let tuning = LayoutTuning { variant: Some(variant), tile: Some(tile) };
        for &tokens in &[1usize, 100, 5000, 20000] {
            let s = LayoutShape::new(tokens, 9, 288, 48, 8).unwrap();
            let idx = random_topk_idx(&mut rng, s, 5, false);
            let want = dispatch_layout(&idx, tokens, 9, 288, 48, 8).unwrap();
            // Twice on the same workspace: the kernel must leave it zero.
            for _ in 0..2 {
                assert_eq!(run_gpu(&dev, &stream, &gpu, s, &idx, tuning), want, "{tuning:?}");
            }
        }
    }
}

/// `is_token_in_rank` at an odd address: the byte-store path.
#[test]
#[ignore = "needs a GPU: scripts/gpu-check.sh runs it"]
fn gpu_layout_unaligned_output() {
    let Some(dev) = gpu() else { return };
    let stream = Stream::new(&dev).unwrap();
    let (tokens, topk, experts, ranks) = (777usize, 6, 60, 12);
    let gpu = DispatchLayoutGpu::new(&dev, experts, ranks, 4).unwrap();
    let s = LayoutShape::new(tokens, topk, experts, ranks, 4).unwrap();
    let idx = random_topk_idx(&mut SplitMix64(5), s, 10, false);
    let want = dispatch_layout(&idx, tokens, topk, experts, ranks, 4).unwrap();
    let topk_buf = DeviceBuffer::from_slice(&dev, &idx).unwrap();
    let out = LayoutBuffers::new(&gpu, tokens).unwrap();
    out.poison(POISON).unwrap();
    let in_rank = DeviceBuffer::new(&dev, tokens * ranks + 3).unwrap();
    in_rank.memset(POISON).unwrap();
    let p = fabric_ep::abi::fep_layout_params {
        topk_idx: topk_buf.device_ptr(),
        num_tokens_per_rank: out.num_tokens_per_rank.device_ptr(),
        num_tokens_per_node: 0, // skipped on purpose
        num_tokens_per_expert: out.num_tokens_per_expert.device_ptr(),
        is_token_in_rank: in_rank.device_ptr() + 1,
        num_tokens: tokens as i32,
        num_topk: topk as i32,
        ..Default::default()
    };
    for variant in [LayoutVariant::Cluster, LayoutVariant::Grid] {
        in_rank.memset(POISON).unwrap();
        out.poison(POISON).unwrap();
        // SAFETY: all buffers outlive the synchronisation.
        unsafe { gpu.launch_raw(&stream, p, LayoutTuning { variant: Some(variant), tile: None }) }
            .unwrap();
        stream.synchronize_within(Duration::from_secs(20)).unwrap();
        let bytes: Vec<u8> = in_rank.to_vec().unwrap();
        assert_eq!(bytes[0], POISON);
        assert_eq!(bytes[tokens * ranks + 1], POISON, "no write past the end");
        let rows: Vec<bool> = bytes[1..=tokens * ranks].iter().map(|&b| b != 0).collect();
        assert!(bytes[1..=tokens * ranks].iter().all(|&b| b <= 1), "bool bytes");
        assert_eq!(rows, want.is_token_in_rank);
        assert_eq!(out.num_tokens_per_rank.to_vec::<i32>().unwrap(), want.num_tokens_per_rank);
        assert_eq!(out.num_tokens_per_expert.to_vec::<i32>().unwrap(), want.num_tokens_per_expert);
        assert!(out.num_tokens_per_node.to_vec::<u8>().unwrap().iter().all(|&b| b == POISON));
    }
}

/// An index out of range: the kernel skips it and records BAD_INPUT naming the value.
#[test]
#[ignore = "needs a GPU: scripts/gpu-check.sh runs it"]
fn gpu_layout_bad_index_is_a_device_error() {
    let Some(dev) = gpu() else { return };
    let stream = Stream::new(&dev).unwrap();
    let gpu = DispatchLayoutGpu::new(&dev, 64, 8, 8).unwrap();
    let mut idx = vec![1i64; 100 * 4];
    idx[123] = 64;
    let topk = DeviceBuffer::from_slice(&dev, &idx).unwrap();
    let out = LayoutBuffers::new(&gpu, 100).unwrap();
    let err = DevErrorRecord::new(&dev).unwrap();
    for variant in [LayoutVariant::Cluster, LayoutVariant::Grid] {
        err.reset().unwrap();
        let tuning = LayoutTuning { variant: Some(variant), tile: None };
        // SAFETY: buffers outlive the synchronisation.
        unsafe { gpu.launch(&stream, &topk, 100, 4, &out, Some(&err), 5, tuning) }.unwrap();
        stream.synchronize_within(Duration::from_secs(20)).unwrap();
        match err.check() {
            Err(CudaError::Device {
                what: "BAD_INPUT",
                rank: 5,
                expected: 64,
                observed: 64,
                ..
            }) => {}
            other => panic!("expected a BAD_INPUT device error, got {other:?}"),
        }
        assert_eq!(out.num_tokens_per_expert.to_vec::<i32>().unwrap()[1], 399);
    }
}
