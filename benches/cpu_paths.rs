//! Criterion benches of the CPU paths the host backend runs every step: get_dispatch_layout in
//! Rust, fp8 quantisation, and the send plan built from is_token_in_rank.
//! Run: `cargo bench --bench cpu_paths`.

use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};
use fabric_ep::protocol::layout::{dispatch_layout, random_topk_idx, LayoutShape};
use fabric_ep::protocol::plan::SendPlan;
use fabric_ep::protocol::quant::{f32_to_bf16, quantize_bf16};
use fabric_ep::util::SplitMix64;

fn layout(c: &mut Criterion) {
    // DeepEP's standard setting: 4096 tokens x top-8 of 256 experts, 64 ranks of 8 per node.
    let shape = LayoutShape::new(4096, 8, 256, 64, 8).unwrap();
    let idx = random_topk_idx(&mut SplitMix64(1), shape, 5, false);
    let mut g = c.benchmark_group("layout");
    g.throughput(Throughput::Elements(4096));
    g.bench_function("dispatch_layout_4096x8_e256_r64", |b| {
        b.iter(|| dispatch_layout(black_box(&idx), 4096, 8, 256, 64, 8).unwrap())
    });
    let lay = dispatch_layout(&idx, 4096, 8, 256, 64, 8).unwrap();
    g.bench_function("send_plan_4096_r64", |b| {
        b.iter(|| {
            SendPlan::from_is_token_in_rank(black_box(&lay.is_token_in_rank), 4096, 64).unwrap()
        })
    });
    g.finish();
}

fn quant(c: &mut Criterion) {
    let hidden = 7168;
    let tokens = 128;
    let mut rng = SplitMix64(2);
    let x: Vec<u16> =
        (0..tokens * hidden).map(|_| f32_to_bf16(rng.unit_f32() * 8.0 - 4.0)).collect();
    let mut g = c.benchmark_group("quant");
    g.throughput(Throughput::Bytes((tokens * hidden * 2) as u64));
    g.bench_function("fp8_quantize_128x7168", |b| {
        b.iter(|| quantize_bf16(black_box(&x), hidden, false).unwrap())
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20).measurement_time(std::time::Duration::from_secs(2));
    targets = layout, quant
}
criterion_main!(benches);
