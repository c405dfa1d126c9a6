//! The GPU backend's side of `ep-bench verify` (`--backend gpu`): the same cases, inputs and
//! references as the host side (`crate::verify`), run through `Buffer`s with `Backend::Gpu`
//! (device pointers, the caller's stream). Ranks as threads of this process share GPU 0; as
//! processes (`--procs`, under MPS when they share a GPU) each takes `LOCAL_RANK` modulo the
//! GPUs.
//!
//! Per shape every device allocation is made before the first barrier (handle, outputs, every
//! call's inputs): with ranks as threads of one context, an allocation or a pageable copy while a
//! peer's kernel spins on this rank can stall both until the timeout. Each step starts after a
//! barrier (nobody still reads the previous step's outputs back), runs on the rank's stream,
//! synchronises (bounded), then reads its outputs back and compares them.
//!
//! Differences from the host side, all of them API: the GPU's low-latency buffers are sized
//! for the config's dtype (every call of a shape uses it, no `round_scale`), and a cached
//! dispatch always passes `topk_idx` and weights (its kernel reads them).

use std::sync::Arc;
use std::time::Duration;

use super::ep_gpu::upload;
use super::verify::{
    ll_dispatch_diff, normal_dispatch_diff, shape_config, CallKind, CallRef, CaseRefs, CaseSpec,
    Checks, GotTokens, LlCallRef, LlGot, Mode, NormalCallRef, NormalGot, RankIn, RankVerdict,
    ShapeSpec,
};
use fabric_ep::bootstrap::Bootstrap;
use fabric_ep::cuda::{Device, DeviceBuffer, Stream};
use fabric_ep::ep::buffer::{Buffer, BufferOptions};
use fabric_ep::ep::gpu::{
    DevSlice, GpuBuffer, GpuCombineArgs, GpuDispatchArgs, GpuDispatchBuffers, GpuHandle,
    GpuLlCombineArgs, GpuLlDispatchArgs, GpuNotifyArgs, GpuOptions,
};
use fabric_ep::ep::hier_gpu::{GpuHierBuffer, GpuHierDispatchArgs, GpuHierHandle};
use fabric_ep::ep::ll_gpu::{LlDispatchHost, LlDispatchOut};
use fabric_ep::{Error, Result};

/// One rank of a case on the GPU backend ([`super::verify::RankFn`]).
pub fn gpu_rank(
    spec: &CaseSpec,
    refs: &CaseRefs,
    rank: usize,
    boot: Arc<dyn Bootstrap>,
    timeout: Duration,
) -> RankVerdict {
    let mut checks = Checks::default();
    let dev = if spec.procs { Device::from_env() } else { Device::new(0) };
    let dev = match dev {
        Ok(d) => d,
        Err(e) => return RankVerdict::Failed(e.into()),
    };
    match gpu_rank_inner(&dev, spec, refs, rank, boot, timeout, &mut checks) {
        Ok(()) => checks.verdict(),
        Err(e) => RankVerdict::Failed(e),
    }
}

fn gpu_rank_inner(
    dev: &Device,
    spec: &CaseSpec,
    refs: &CaseRefs,
    rank: usize,
    boot: Arc<dyn Bootstrap>,
    timeout: Duration,
    checks: &mut Checks,
) -> Result<()> {
    for (si, sh) in spec.shapes.iter().enumerate() {
        let cfg = shape_config(spec, sh, rank, timeout)?;
        let mut o = GpuOptions {
            normal: spec.mode == Mode::Normal,
            low_latency: spec.mode == Mode::LowLatency,
            proxy_provider: spec.provider.to_string(),
            ll_provider: Some(spec.provider.to_string()),
            ..GpuOptions::new(dev.clone())
        };
        if let Some(c) = sh.chunk_tokens {
            o.chunk_tokens = c;
        }
        o.slots_per_peer = sh.slots_per_peer;
        o.num_sms = shared_sm_budget(dev, spec, sh);
        if sh.hier {
            let mut hb = GpuHierBuffer::new(cfg, boot.clone(), BufferOptions::gpu(o))?;
            // As below: a failed step leaves no collective teardown.
            gpu_hier_shape(dev, &mut hb, &*boot, sh, si, refs, rank, checks)?;
            hb.destroy()?;
            continue;
        }
        let mut buf = Buffer::new(cfg, boot.clone(), BufferOptions::gpu(o))?;
        let res = match spec.mode {
            Mode::Normal => gpu_normal_shape(dev, &mut buf, &*boot, sh, si, refs, rank, checks),
            Mode::LowLatency => gpu_ll_shape(dev, &mut buf, &*boot, sh, si, refs, rank, checks),
        };
        // A failed step leaves peers' kernels waiting: no collective teardown then.
        res?;
        buf.destroy()?;
    }
    Ok(())
}

/// With several cases sharing the GPU, each rank's SM budget is its share of the GPU (every
/// rank's kernels of every case must be resident at once), but never below what the shape
/// needs (normal mode: two blocks per peer; the hierarchy: that for each of its two stages).
/// `None` (one case at a time): the buffer's own default.
fn shared_sm_budget(dev: &Device, spec: &CaseSpec, sh: &ShapeSpec) -> Option<usize> {
    let jobs: usize =
        std::env::var(super::verify::JOBS_ENV).ok()?.parse().ok().filter(|&j| j > 1)?;
    let r = spec.num_ranks;
    let share = (dev.sm_count() as usize / (jobs * r)) & !1;
    let need = match (spec.mode, sh.hier) {
        (Mode::LowLatency, _) => 2,
        (Mode::Normal, false) => 2 * r,
        (Mode::Normal, true) => 4 * (r / spec.ranks_per_node).max(spec.ranks_per_node),
    };
    Some(share.max(need))
}

fn normal_ref(refs: &CaseRefs, si: usize, ci: usize) -> Result<&NormalCallRef> {
    match refs.get(si, ci)? {
        CallRef::Normal(r) => Ok(r),
        CallRef::Ll(_) => Err(Error::Other("reference of the wrong mode (bug)".into())),
    }
}

fn ll_ref(refs: &CaseRefs, si: usize, ci: usize) -> Result<&LlCallRef> {
    match refs.get(si, ci)? {
        CallRef::Ll(r) => Ok(r),
        CallRef::Normal(_) => Err(Error::Other("reference of the wrong mode (bug)".into())),
    }
}

/// One rank's inputs of one normal step on the device.
struct NormalDevIn {
    x: DeviceBuffer,
    xs: Option<DeviceBuffer>,
    ti: DeviceBuffer,
    tw: DeviceBuffer,
    y: DeviceBuffer,
    yw: Option<DeviceBuffer>,
    tokens: usize,
}

impl NormalDevIn {
    fn new(dev: &Device, me: &RankIn, y: &[u16], yw: Option<&[f32]>) -> Result<Self> {
        let (x, xs) = match &me.x_fp8 {
            Some((q, s)) => (upload(dev, q)?, Some(upload(dev, s)?)),
            None => (upload(dev, &me.x)?, None),
        };
        Ok(NormalDevIn {
            x,
            xs,
            ti: upload(dev, &me.topk_idx)?,
            tw: upload(dev, &me.topk_weights)?,
            y: upload(dev, y)?,
            yw: yw.map(|w| upload(dev, w)).transpose()?,
            tokens: me.topk_idx.len(),
        })
    }
}

impl NormalDevIn {
    /// The combine of this step's expert outputs into `out_c` (and `out_cw` with weights).
    fn combine_args<'a>(
        &self,
        out_c: &DeviceBuffer,
        out_cw: &DeviceBuffer,
        stream: &'a Stream,
    ) -> GpuCombineArgs<'a> {
        GpuCombineArgs {
            x: DevSlice::of(&self.y),
            topk_weights: self.yw.as_ref().map(DevSlice::of),
            combined_x: DevSlice::of(out_c),
            combined_topk_weights: self.yw.as_ref().map(|_| DevSlice::of(out_cw)),
            stream,
        }
    }
}

/// The outputs of a normal step read back.
struct NormalHost {
    rows: usize,
    fp8: bool,
    recv_x: Vec<u8>,
    scales: Vec<f32>,
    topk_idx: Vec<i64>,
    topk_weights: Vec<f32>,
    src_idx: Vec<i32>,
    prefix: Vec<u64>,
    per_expert: Vec<usize>,
    combined: Vec<u16>,
    combined_w: Option<Vec<f32>>,
}

#[allow(clippy::too_many_arguments)]
fn gpu_normal_shape(
    dev: &Device,
    buf: &mut Buffer,
    boot: &dyn Bootstrap,
    sh: &ShapeSpec,
    si: usize,
    refs: &CaseRefs,
    rank: usize,
    checks: &mut Checks,
) -> Result<()> {
    let (h, k) = (sh.hidden, sh.topk);
    let gpu = buf.gpu()?;
    // Every allocation first (module NOTES).
    let NormalSteps { steps, cap_tokens, cap_rows, .. } = normal_steps(dev, sh, si, refs, rank)?;
    let mut handle = gpu.new_handle(cap_tokens)?;
    let o = GpuDispatchBuffers::new(gpu, cap_rows)?;
    let out_c = DeviceBuffer::new(dev, (cap_tokens * h * 2).max(16))?;
    let out_cw = DeviceBuffer::new(dev, (cap_tokens * k * 4).max(16))?;
    let stream = Stream::new(dev)?;
    boot.barrier()?;
    for (ci, call) in sh.calls.iter().enumerate() {
        let CallKind::Normal(n) = &call.kind else {
            return Err(Error::Other("call of the wrong mode (bug)".into()));
        };
        let r = normal_ref(refs, si, ci)?;
        let at = |w: &str| format!("rank {rank} shape {si} call {ci} {w}");
        let (fresh, cached) = &steps[ci];
        let t = fresh.tokens / k;
        for _ in 0..n.repeat.max(1) {
            boot.barrier()?;
            let got = normal_step(
                gpu,
                &o,
                &out_c,
                &out_cw,
                &stream,
                fresh,
                &mut handle,
                t,
                Some(n.alignment),
                r.worst,
                h,
                k,
            )?;
            compare_normal(checks, &at(""), &got, &r.fresh, rank, h, k);
            if let (Some(c), Some(cr)) = (cached, &r.cached) {
                boot.barrier()?;
                let got = normal_step(
                    gpu,
                    &o,
                    &out_c,
                    &out_cw,
                    &stream,
                    c,
                    &mut handle,
                    t,
                    None,
                    r.worst,
                    h,
                    k,
                )?;
                compare_normal(checks, &at("cached "), &got, cr, rank, h, k);
            }
            refs.step_done();
        }
    }
    boot.barrier()?;
    Ok(())
}

/// Fills a step's outputs with a pattern no step writes, so a row left unwritten shows.
fn poison(
    o: &GpuDispatchBuffers,
    out_c: &DeviceBuffer,
    out_cw: &DeviceBuffer,
    stream: &Stream,
) -> Result<()> {
    for b in [&o.recv_x, &o.recv_topk_idx, &o.recv_topk_weights, &o.recv_src_idx, out_c, out_cw] {
        b.memset_async(0xAB, stream)?;
    }
    if let Some(b) = &o.recv_x_scales {
        b.memset_async(0xAB, stream)?;
    }
    Ok(())
}

/// The output rows a step announced fit the outputs made for it.
fn fits(rows: usize, o: &GpuDispatchBuffers) -> Result<()> {
    if rows > o.rows {
        return Err(Error::Other(format!("{rows} rows, more than all ranks' tokens ({})", o.rows)));
    }
    Ok(())
}

/// A normal shape's inputs on the device, one (fresh, cached) pair per call, and the sizes its
/// outputs need.
struct NormalSteps {
    steps: Vec<(NormalDevIn, Option<NormalDevIn>)>,
    /// This rank's most input tokens in a call.
    cap_tokens: usize,
    /// Room for whatever arrives (all tokens of all ranks), so a wrong count is reported as a
    /// mismatch rather than refused.
    cap_rows: usize,
    /// Any rank's most input tokens in a call.
    most_tokens: usize,
}

fn normal_steps(
    dev: &Device,
    sh: &ShapeSpec,
    si: usize,
    refs: &CaseRefs,
    rank: usize,
) -> Result<NormalSteps> {
    let k = sh.topk;
    let mut out = NormalSteps { steps: Vec::new(), cap_tokens: 1, cap_rows: 1, most_tokens: 1 };
    for ci in 0..sh.calls.len() {
        let r = normal_ref(refs, si, ci)?;
        let f = &r.fresh;
        let fresh = NormalDevIn::new(dev, &f.inputs[rank], &f.y[rank], f.yw[rank].as_deref())?;
        let cached = match &r.cached {
            Some(c) => {
                Some(NormalDevIn::new(dev, &c.inputs[rank], &c.y[rank], c.yw[rank].as_deref())?)
            }
            None => None,
        };
        let tokens: Vec<usize> = f.inputs.iter().map(|i| i.topk_idx.len() / k).collect();
        out.cap_tokens = out.cap_tokens.max(tokens[rank]);
        out.most_tokens = out.most_tokens.max(tokens.iter().copied().max().unwrap_or(1));
        let all: usize = tokens.iter().sum();
        out.cap_rows = out.cap_rows.max(all).max(f.want_d[rank].recv_topk_idx.len() / k);
        out.steps.push((fresh, cached));
    }
    Ok(out)
}

/// A normal shape through DeepEP's hierarchy (`GpuHierBuffer`: rail stage across nodes, node
/// stage within), against the same references as the direct path (the combine's gateways round
/// each node's partial sum to bf16, as the reference's grouping does).
#[allow(clippy::too_many_arguments)]
fn gpu_hier_shape(
    dev: &Device,
    hb: &mut GpuHierBuffer,
    boot: &dyn Bootstrap,
    sh: &ShapeSpec,
    si: usize,
    refs: &CaseRefs,
    rank: usize,
    checks: &mut Checks,
) -> Result<()> {
    let (h, k) = (sh.hidden, sh.topk);
    let cfg = hb.config().clone();
    let NormalSteps { steps, cap_tokens, cap_rows, most_tokens } =
        normal_steps(dev, sh, si, refs, rank)?;
    // Handles are made for the case's largest tokens per rank on every rank alike (a gateway
    // receives what its peers send).
    let mut handle = hb.new_handle(most_tokens)?;
    let o = GpuDispatchBuffers::for_config(dev, &cfg, cap_rows)?;
    let out_c = DeviceBuffer::new(dev, (cap_tokens * h * 2).max(16))?;
    let out_cw = DeviceBuffer::new(dev, (cap_tokens * k * 4).max(16))?;
    let stream = Stream::new(dev)?;
    boot.barrier()?;
    for (ci, call) in sh.calls.iter().enumerate() {
        let CallKind::Normal(n) = &call.kind else {
            return Err(Error::Other("call of the wrong mode (bug)".into()));
        };
        let r = normal_ref(refs, si, ci)?;
        let at = |w: &str| format!("rank {rank} shape {si} call {ci} hierarchy {w}");
        let (fresh, cached) = &steps[ci];
        for _ in 0..n.repeat.max(1) {
            boot.barrier()?;
            let got = hier_step(
                hb,
                &o,
                &out_c,
                &out_cw,
                &stream,
                fresh,
                &mut handle,
                false,
                n,
                r.worst,
                h,
                k,
            )?;
            compare_normal(checks, &at(""), &got, &r.fresh, rank, h, k);
            if let (Some(c), Some(cr)) = (cached, &r.cached) {
                boot.barrier()?;
                let got = hier_step(
                    hb,
                    &o,
                    &out_c,
                    &out_cw,
                    &stream,
                    c,
                    &mut handle,
                    true,
                    n,
                    r.worst,
                    h,
                    k,
                )?;
                compare_normal(checks, &at("cached "), &got, cr, rank, h, k);
            }
            refs.step_done();
        }
    }
    boot.barrier()?;
    Ok(())
}

/// One hierarchical step: dispatch (fresh, or on the handle's routing when `cached`), combine,
/// sync, read back.
#[allow(clippy::too_many_arguments)]
fn hier_step(
    hb: &mut GpuHierBuffer,
    o: &GpuDispatchBuffers,
    out_c: &DeviceBuffer,
    out_cw: &DeviceBuffer,
    stream: &Stream,
    d: &NormalDevIn,
    handle: &mut GpuHierHandle,
    cached: bool,
    n: &super::verify::NormalCall,
    worst: Option<usize>,
    h: usize,
    k: usize,
) -> Result<NormalHost> {
    poison(o, out_c, out_cw, stream)?;
    let t = d.tokens / k;
    let args = GpuHierDispatchArgs {
        x: DevSlice::of(&d.x),
        x_scales: d.xs.as_ref().map(DevSlice::of),
        topk_idx: DevSlice::of(&d.ti),
        topk_weights: DevSlice::of(&d.tw),
        num_tokens: t,
        expert_alignment: n.alignment,
        num_worst_tokens: worst,
        cached,
        stream,
    };
    // SAFETY: every buffer lives until sync_gpu below; all ranks make the same calls.
    unsafe {
        let rows = hb.prepare(&args, handle)?;
        fits(rows, o)?;
        hb.finish(handle, &o.out(), stream)?;
        let ca = d.combine_args(out_c, out_cw, stream);
        hb.combine_gpu(&ca, handle)?;
    }
    hb.sync_gpu(stream)?;
    let prefix = handle.rank_prefix().to_vec();
    let per_expert =
        handle.num_recv_tokens_per_expert().iter().map(|&v| v.max(0) as usize).collect();
    read_normal(o, out_c, out_cw, d, handle.num_out_rows(), prefix, per_expert, t, h, k)
}

/// One normal step: notify (fresh: `align` is `Some`) or the handle as it is (cached),
/// dispatch, combine, sync, read back.
#[allow(clippy::too_many_arguments)]
fn normal_step(
    gpu: &mut GpuBuffer,
    o: &GpuDispatchBuffers,
    out_c: &DeviceBuffer,
    out_cw: &DeviceBuffer,
    stream: &Stream,
    d: &NormalDevIn,
    handle: &mut GpuHandle,
    t: usize,
    align: Option<usize>,
    worst: Option<usize>,
    h: usize,
    k: usize,
) -> Result<NormalHost> {
    poison(o, out_c, out_cw, stream)?;
    // SAFETY: every buffer lives until sync_gpu below; all ranks make the same calls.
    unsafe {
        if let Some(a) = align {
            let notify = GpuNotifyArgs {
                expert_alignment: a,
                num_worst_tokens: worst,
                ..GpuNotifyArgs::new(DevSlice::of(&d.ti), t, stream)
            };
            gpu.notify_gpu(&notify, handle)?;
        }
        let rows = handle.num_out_rows().unwrap_or(0);
        fits(rows, o)?;
        let da = GpuDispatchArgs {
            x: DevSlice::of(&d.x),
            x_scales: d.xs.as_ref().map(DevSlice::of),
            topk_idx: DevSlice::of(&d.ti),
            topk_weights: DevSlice::of(&d.tw),
            stream,
        };
        gpu.dispatch_gpu(&da, handle, &o.out())?;
        let ca = d.combine_args(out_c, out_cw, stream);
        gpu.combine_gpu(&ca, handle)?;
    }
    gpu.sync_gpu(stream)?;
    let rows = handle.num_out_rows().unwrap_or(0);
    let prefix: Vec<u64> =
        handle.device().rank_prefix.to_vec::<i32>()?.into_iter().map(|v| v as u64).collect();
    let per_expert: Vec<usize> = handle
        .device()
        .recv_expert_counts
        .to_vec::<i32>()?
        .into_iter()
        .map(|v| v.max(0) as usize)
        .collect();
    read_normal(o, out_c, out_cw, d, rows, prefix, per_expert, t, h, k)
}

/// A normal step's outputs read back (the stream has synchronised): `rows` output rows of
/// `o`, `t` combined tokens.
#[allow(clippy::too_many_arguments)]
fn read_normal(
    o: &GpuDispatchBuffers,
    out_c: &DeviceBuffer,
    out_cw: &DeviceBuffer,
    d: &NormalDevIn,
    rows: usize,
    prefix: Vec<u64>,
    per_expert: Vec<usize>,
    t: usize,
    h: usize,
    k: usize,
) -> Result<NormalHost> {
    let fp8 = o.recv_x_scales.is_some();
    let payload = if fp8 { h } else { 2 * h };
    let take = |v: Vec<u8>, n: usize| -> Vec<u8> { v.into_iter().take(n).collect() };
    let recv_x = take(o.recv_x.to_vec()?, rows * payload);
    let scales: Vec<f32> = match &o.recv_x_scales {
        Some(b) => b.to_vec::<f32>()?.into_iter().take(rows * (h / 128)).collect(),
        None => Vec::new(),
    };
    let combined_w = match &d.yw {
        Some(_) => Some(out_cw.to_vec::<f32>()?.into_iter().take(t * k).collect()),
        None => None,
    };
    Ok(NormalHost {
        rows,
        fp8,
        recv_x,
        scales,
        topk_idx: o.recv_topk_idx.to_vec::<i64>()?.into_iter().take(rows * k).collect(),
        topk_weights: o.recv_topk_weights.to_vec::<f32>()?.into_iter().take(rows * k).collect(),
        src_idx: o.recv_src_idx.to_vec::<i32>()?.into_iter().take(rows).collect(),
        prefix,
        per_expert,
        combined: out_c.to_vec::<u16>()?.into_iter().take(t * h).collect(),
        combined_w,
    })
}

fn compare_normal(
    checks: &mut Checks,
    at: &str,
    got: &NormalHost,
    want: &super::verify::NormalStepRef,
    rank: usize,
    h: usize,
    k: usize,
) {
    let wd = &want.want_d[rank];
    let bf16: Vec<u16>;
    let recv_x = if got.fp8 {
        GotTokens::Fp8 { x: &got.recv_x, scales: &got.scales }
    } else {
        bf16 = u16_le(&got.recv_x);
        GotTokens::Bf16(&bf16)
    };
    let n = got.prefix.last().copied().unwrap_or(0) as usize;
    let g = NormalGot {
        recv_x,
        recv_topk_idx: Some(&got.topk_idx),
        recv_topk_weights: Some(&got.topk_weights),
        per_expert: &got.per_expert,
        num_recv_tokens: n,
        rank_prefix: &got.prefix,
        recv_src_idx: &got.src_idx,
    };
    let rows_want = wd.recv_topk_idx.len() / k.max(1);
    if got.rows != rows_want {
        checks.note(
            &format!("{at}dispatch"),
            Some(format!("{} output rows (want {rows_want})", got.rows)),
        );
    }
    checks.note(&format!("{at}dispatch"), normal_dispatch_diff(&g, wd, h, k));
    let wc = &want.want_c[rank];
    checks.combine(
        &format!("{at}combine"),
        &got.combined,
        &wc.combined_x,
        got.combined_w.as_deref(),
        wc.combined_topk_weights.as_deref(),
        h,
    );
}

/// One rank's low-latency inputs of one call on the device.
struct LlDevIn {
    first: Option<(DeviceBuffer, DeviceBuffer, usize)>,
    x: DeviceBuffer,
    ti: DeviceBuffer,
    tokens: usize,
    y: DeviceBuffer,
    cti: DeviceBuffer,
    tw: DeviceBuffer,
}

#[allow(clippy::too_many_arguments)]
fn gpu_ll_shape(
    dev: &Device,
    buf: &mut Buffer,
    boot: &dyn Bootstrap,
    sh: &ShapeSpec,
    si: usize,
    refs: &CaseRefs,
    rank: usize,
    checks: &mut Checks,
) -> Result<()> {
    let (h, k) = (sh.hidden, sh.topk);
    let gpu = buf.gpu()?;
    let mut ins = Vec::new();
    for ci in 0..sh.calls.len() {
        let r = ll_ref(refs, si, ci)?;
        let me = &r.last.inputs[rank];
        let first = match &r.first {
            Some(f) => {
                let i = &f.inputs[rank];
                Some((upload(dev, &i.x)?, upload(dev, &i.topk_idx)?, i.topk_idx.len() / k))
            }
            None => None,
        };
        ins.push(LlDevIn {
            first,
            x: upload(dev, &me.x)?,
            ti: upload(dev, &me.topk_idx)?,
            tokens: me.topk_idx.len() / k,
            y: upload(dev, &r.y[rank])?,
            cti: upload(dev, &r.combine_topk[rank])?,
            tw: upload(dev, &me.topk_weights)?,
        });
    }
    let out_a = gpu.new_ll_dispatch_out()?;
    let out_b = gpu.new_ll_dispatch_out()?;
    let out_c = DeviceBuffer::new(dev, (sh.max_tokens * h * 2).max(16))?;
    let stream = Stream::new(dev)?;
    boot.barrier()?;
    for (ci, call) in sh.calls.iter().enumerate() {
        let CallKind::Ll(l) = &call.kind else {
            return Err(Error::Other("call of the wrong mode (bug)".into()));
        };
        let r = ll_ref(refs, si, ci)?;
        let at = |w: &str| format!("rank {rank} shape {si} call {ci} {w}");
        let d = &ins[ci];
        for rep in 0..l.repeat.max(1) {
            boot.barrier()?;
            if l.clean_before && rep == 0 {
                gpu.clean_low_latency_gpu()?;
                boot.barrier()?;
            }
            for b in [&out_a.recv_x, &out_b.recv_x, &out_c] {
                b.memset_async(0xAB, &stream)?;
            }
            let dargs =
                |x: &DeviceBuffer, ti: &DeviceBuffer, t: usize, hook: bool| GpuLlDispatchArgs {
                    x: DevSlice::of(x),
                    topk_idx: DevSlice::of(ti),
                    num_tokens: t,
                    use_fp8: l.fp8,
                    return_recv_hook: hook,
                    stream: &stream,
                };
            // SAFETY: every buffer lives until sync_gpu below; all ranks make the same calls.
            unsafe {
                match &d.first {
                    Some((fx, fti, ft)) if l.overlap => {
                        let ha =
                            gpu.low_latency_dispatch_gpu(&dargs(fx, fti, *ft, true), &out_a)?;
                        let hb = gpu.low_latency_dispatch_gpu(
                            &dargs(&d.x, &d.ti, d.tokens, true),
                            &out_b,
                        )?;
                        if let Some(hk) = ha {
                            gpu.low_latency_dispatch_recv_gpu(hk, &out_a, &stream)?;
                        }
                        if let Some(hk) = hb {
                            gpu.low_latency_dispatch_recv_gpu(hk, &out_b, &stream)?;
                        }
                        // The combine below is call n + 2 of the first dispatch and reuses its
                        // buffer set. The low-latency contract (DeepEP's): every rank has
                        // finished call n's receive before any rank starts call n + 2. With no
                        // expert work between, a peer's combine could otherwise write into this
                        // rank's set while the first dispatch's receive still reads it.
                        gpu.sync_gpu(&stream)?;
                        boot.barrier()?;
                    }
                    first => {
                        if let Some((fx, fti, ft)) = first {
                            let hk = gpu.low_latency_dispatch_gpu(
                                &dargs(fx, fti, *ft, l.hook_dispatch),
                                &out_a,
                            )?;
                            if let Some(hk) = hk {
                                gpu.low_latency_dispatch_recv_gpu(hk, &out_a, &stream)?;
                            }
                        }
                        let hk = gpu.low_latency_dispatch_gpu(
                            &dargs(&d.x, &d.ti, d.tokens, l.hook_dispatch),
                            &out_b,
                        )?;
                        if let Some(hk) = hk {
                            gpu.low_latency_dispatch_recv_gpu(hk, &out_b, &stream)?;
                        }
                    }
                }
                let ca = GpuLlCombineArgs {
                    x: DevSlice::of(&d.y),
                    topk_idx: DevSlice::of(&d.cti),
                    topk_weights: DevSlice::of(&d.tw),
                    num_tokens: d.tokens,
                    handle: &out_b,
                    out: DevSlice::of(&out_c),
                    return_recv_hook: l.hook_combine,
                    stream: &stream,
                };
                if let Some(hk) = gpu.low_latency_combine_gpu(&ca)? {
                    gpu.low_latency_combine_recv_gpu(hk, &ca)?;
                }
            }
            gpu.sync_gpu(&stream)?;
            if let Some(f) = &r.first {
                compare_ll(checks, &at("first dispatch"), &out_a, &f.want_d[rank], l.fp8, h)?;
            }
            compare_ll(checks, &at("dispatch"), &out_b, &r.last.want_d[rank], l.fp8, h)?;
            let got: Vec<u16> = out_c.to_vec::<u16>()?.into_iter().take(d.tokens * h).collect();
            checks.combine(&at("combine"), &got, &r.want_c[rank], None, None, h);
            if l.combine_twice {
                // The same handle again, the other hook mode (after a barrier: the read-back above
                // must not overlap a peer's kernels).
                boot.barrier()?;
                out_c.memset_async(0xAB, &stream)?;
                let ca = GpuLlCombineArgs {
                    x: DevSlice::of(&d.y),
                    topk_idx: DevSlice::of(&d.cti),
                    topk_weights: DevSlice::of(&d.tw),
                    num_tokens: d.tokens,
                    handle: &out_b,
                    out: DevSlice::of(&out_c),
                    return_recv_hook: !l.hook_combine,
                    stream: &stream,
                };
                // SAFETY: as above.
                unsafe {
                    if let Some(hk) = gpu.low_latency_combine_gpu(&ca)? {
                        gpu.low_latency_combine_recv_gpu(hk, &ca)?;
                    }
                }
                gpu.sync_gpu(&stream)?;
                let got: Vec<u16> = out_c.to_vec::<u16>()?.into_iter().take(d.tokens * h).collect();
                checks.combine(&at("second combine"), &got, &r.want_c[rank], None, None, h);
            }
            refs.step_done();
        }
    }
    boot.barrier()?;
    Ok(())
}

fn compare_ll(
    checks: &mut Checks,
    at: &str,
    out: &LlDispatchOut,
    want: &fabric_ep::protocol::reference::LlDispatchOut,
    fp8: bool,
    h: usize,
) -> Result<()> {
    let g: LlDispatchHost = out.to_host()?;
    let count: Vec<u32> = g.recv_count.iter().map(|&c| c.max(0) as u32).collect();
    let range: Vec<(u32, u32)> = g
        .layout_range
        .chunks(2)
        .map(|p| (p[0].max(0) as u32, p.get(1).copied().unwrap_or(0).max(0) as u32))
        .collect();
    let bf16: Vec<u16>;
    let recv_x = if fp8 {
        GotTokens::Fp8 { x: &g.recv_x, scales: &g.recv_scales }
    } else {
        bf16 = u16_le(&g.recv_x);
        GotTokens::Bf16(&bf16)
    };
    let got = LlGot {
        recv_x,
        recv_count: &count,
        recv_src_rank: &g.recv_src_rank,
        recv_src_idx: &g.recv_src_idx,
        layout_range: &range,
    };
    checks.note(at, ll_dispatch_diff(&got, want, h));
    Ok(())
}

fn u16_le(b: &[u8]) -> Vec<u16> {
    b.chunks_exact(2).map(|p| u16::from_le_bytes([p[0], p[1]])).collect()
}
