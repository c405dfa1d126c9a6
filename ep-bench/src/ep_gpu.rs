//! GPU runners shared by `ep-bench --backend gpu` and tests/gpu_buffer.rs / tests/gpu_ipc.rs:
//! every rank with its own `Buffer` (`Backend::Gpu`), deterministic inputs from a seed, every
//! result checked against the single-process reference (src/protocol/reference.rs), times from CUDA
//! events. [`run_normal_gpu`] / [`run_ll_gpu`] run every rank as a thread of this process (an
//! in-process bootstrap); [`run_normal_gpu_rank`] / [`run_ll_gpu_rank`] run one rank of a job
//! whose ranks are processes (any bootstrap: `TcpStore` under `LocalJob` or torchrun), each
//! process building the same inputs and reference from the seed.
//!
//! One file: the normal, hierarchical and low-latency GPU runners all take `GpuBenchParams` and
//! share its upload, thread, timing and checking helpers.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::ep::{
    self as host_bench, InternodeBytes, NormalBenchParams, NormalBenchReport, RankInputs,
};
use fabric_ep::bootstrap::{Bootstrap, InProcGroup};
use fabric_ep::cuda::{DevErrorRecord, Device, DeviceBuffer, Event, GraphExec, HostMapped, Stream};
use fabric_ep::ep::buffer::{Buffer, BufferOptions};
use fabric_ep::ep::gpu::{
    DevSlice, GpuBuffer, GpuCombineArgs, GpuDispatchArgs, GpuDispatchBuffers, GpuHandle,
    GpuLlCombineArgs, GpuLlDispatchArgs, GpuNotifyArgs, GpuOptions,
};
use fabric_ep::ep::hier_gpu::{GpuHierBuffer, GpuHierDispatchArgs, GpuHierHandle};
use fabric_ep::ep::ll_gpu::LlDispatchHost;
use fabric_ep::protocol::config::{DispatchDtype, EpConfig, EpSettings};
use fabric_ep::protocol::layout::{dispatch_layout, random_topk_idx, LayoutShape};
use fabric_ep::protocol::quant::f32_to_bf16;
use fabric_ep::protocol::reference::{self as refm, NormalCombineOut, NormalDispatchOut, Tokens};
use fabric_ep::util::SplitMix64;
use fabric_ep::{Error, Result};

/// The shape of a GPU run (both modes).
#[derive(Clone, Debug)]
pub struct GpuBenchParams {
    pub num_ranks: usize,
    /// Tokens per rank (normal), or `max_tokens_per_rank` = tokens per rank (low-latency).
    pub num_tokens: usize,
    pub hidden: usize,
    pub num_topk: usize,
    pub num_experts: usize,
    /// fp8 dispatch (combine is bf16).
    pub fp8: bool,
    pub iters: usize,
    pub warmup: usize,
    pub seed: u64,
    /// Percent of top-k entries replaced by -1.
    pub drop_pct: u64,
    pub timeout: Duration,
    /// Per-rank SM budget; `None`: SMs / ranks.
    pub num_sms: Option<usize>,
    /// Normal: use `num_worst_tokens` (no host sync) instead of the two-step form.
    pub worst: bool,
    /// Low-latency: hook mode (send, then the hook's receive) instead of one call.
    pub hook: bool,
    /// Low-latency: after one eager step, capture each phase (dispatch, combine) once in a CUDA
    /// graph and replay it, with two input cases alternating in the same buffers.
    pub graph: bool,
    /// Normal mode: [`NormalBenchParams::one_way`] routing (only rank 0's tokens leave it).
    pub one_way: bool,
}

impl GpuBenchParams {
    /// The host bench's input parameters for the same run (token count, seed, drop rate,
    /// iterations; combine with weights): the inputs and references GPU runs check against.
    pub fn host_params(&self) -> NormalBenchParams {
        NormalBenchParams {
            num_tokens: self.num_tokens,
            seed: self.seed,
            drop_pct: self.drop_pct,
            iters: self.iters,
            warmup: self.warmup,
            combine_weights: true,
            one_way: self.one_way,
        }
    }

    /// DeepEP's standard normal setting: 4096 tokens, hidden 7168, top-8 of 256, fp8 dispatch.
    pub fn normal_standard(num_ranks: usize) -> Self {
        GpuBenchParams {
            num_ranks,
            num_tokens: 4096,
            hidden: 7168,
            num_topk: 8,
            num_experts: 256,
            fp8: true,
            iters: 20,
            warmup: 3,
            seed: 0x5eed,
            drop_pct: 0,
            timeout: Duration::from_secs(30),
            num_sms: None,
            worst: false,
            hook: false,
            graph: false,
            one_way: false,
        }
    }
    /// DeepEP's standard low-latency setting: 128 tokens, otherwise as normal.
    pub fn ll_standard(num_ranks: usize) -> Self {
        GpuBenchParams { num_tokens: 128, ..Self::normal_standard(num_ranks) }
    }

    pub(crate) fn config(&self, rank: usize) -> Result<EpConfig> {
        self.config_split(rank, self.num_ranks)
    }

    fn config_split(&self, rank: usize, ranks_per_node: usize) -> Result<EpConfig> {
        let mut s =
            EpSettings::new(rank, self.num_ranks, self.num_experts, self.hidden, self.num_topk);
        s.ranks_per_node = ranks_per_node;
        s.timeout = self.timeout;
        s.max_tokens_per_rank = self.num_tokens.max(1);
        if self.fp8 {
            s.dispatch_dtype = DispatchDtype::Fp8E4m3;
        }
        EpConfig::new(s)
    }

    fn gpu_options(&self, dev: &Device, normal: bool) -> GpuOptions {
        GpuOptions {
            num_sms: self.num_sms,
            normal,
            low_latency: !normal,
            ..GpuOptions::new(dev.clone())
        }
    }
}

/// Where the ranks of a normal-mode GPU run sit, and the queue shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuSplit {
    /// Ranks per (simulated) node: peers on other nodes go through the proxy lane
    /// (`ep::gpu::normal_proxy`), the others through device pointers.
    pub ranks_per_node: usize,
    /// The proxy lane's libfabric provider.
    pub provider: String,
    /// Records per chunk; `None`: `GpuOptions`' default.
    pub chunk_tokens: Option<usize>,
    /// Chunks in flight per pair; `None`: `GpuOptions`' default.
    pub slots_per_peer: Option<usize>,
    /// After the first step, dispatch with the cached handle (no layout, no notify).
    pub cached: bool,
    /// After the checked steps, this many steps back to back on the stream (no barrier, no
    /// poison between them; the outputs are poisoned once before and the last step is checked),
    /// timed per step; the report then holds these instead of the checked steps' times. With
    /// ranks as processes, the ranks leave the barrier before each checked step at different
    /// moments and the first rank's notify or dispatch waits for the last (on two GPUs the fresh
    /// dispatch timed that way was 619 us, back to back 373-382 us): timed back to back, the
    /// ranks stay in step through the protocol itself. 0: time the checked steps.
    pub back_to_back: usize,
}

impl GpuSplit {
    /// Every rank on one node (no proxy), the default queue shape.
    pub fn one_node(num_ranks: usize) -> Self {
        GpuSplit {
            ranks_per_node: num_ranks,
            provider: "shm".to_string(),
            chunk_tokens: None,
            slots_per_peer: None,
            cached: false,
            back_to_back: 0,
        }
    }
}

/// Per-rank figures of a GPU run, in the host runner's shape (bytes as DeepEP counts them).
pub type GpuReport = Vec<NormalBenchReport>;

pub(crate) fn upload<T: bytemuck::Pod>(dev: &Device, v: &[T]) -> Result<DeviceBuffer> {
    if v.is_empty() {
        return Ok(DeviceBuffer::zeroed(dev, 16)?);
    }
    Ok(DeviceBuffer::from_slice(dev, v)?)
}

fn mismatch(rank: usize, what: &str, it: usize) -> Error {
    Error::Other(format!("rank {rank}: GPU {what} differs from the reference (iteration {it})"))
}

/// Runs `f(rank, boot)` on one thread per rank; the first error wins (by rank).
pub(crate) fn on_threads<T: Send>(
    n: usize,
    timeout: Duration,
    f: impl Fn(usize, Arc<dyn Bootstrap>) -> Result<T> + Sync,
) -> Result<Vec<T>> {
    let boots = InProcGroup::new(n, n, timeout)?;
    let res: Vec<Result<T>> = std::thread::scope(|s| {
        let hs: Vec<_> = boots
            .into_iter()
            .enumerate()
            .map(|(rank, b)| {
                let f = &f;
                std::thread::Builder::new()
                    .name(format!("gpu-rank-{rank}"))
                    .spawn_scoped(s, move || f(rank, Arc::new(b)))
            })
            .collect();
        hs.into_iter()
            .enumerate()
            .map(|(r, h)| match h {
                Ok(h) => h
                    .join()
                    .unwrap_or_else(|_| Err(Error::Other(format!("rank {r}: thread panicked")))),
                Err(e) => Err(Error::Other(format!("rank {r}: spawn: {e}"))),
            })
            .collect()
    });
    // NOTES: a rank that failed on the host leaves its peers waiting: report the root cause
    // (non-timeout errors first) and every rank's error, not just the lowest rank's timeout.
    let mut errs: Vec<(usize, Error)> = Vec::new();
    let mut oks = Vec::with_capacity(n);
    for (r, x) in res.into_iter().enumerate() {
        match x {
            Ok(v) => oks.push(v),
            Err(e) => errs.push((r, e)),
        }
    }
    if errs.is_empty() {
        return Ok(oks);
    }
    errs.sort_by_key(|(r, e)| (matches!(e, Error::Timeout { .. }), *r));
    let all: Vec<String> = errs.iter().map(|(r, e)| format!("rank {r}: {e}")).collect();
    let (r0, first) = errs.swap_remove(0);
    if all.len() == 1 {
        return Err(first);
    }
    Err(Error::Other(format!("rank {r0} failed first: {}", all.join("; "))))
}

fn elapsed_s(a: &Event, b: &Event) -> Result<f64> {
    Ok(a.elapsed_ms(b)? as f64 * 1e-3)
}

/// A rank's normal-mode input tokens on the device: `x` (e4m3 bytes or bf16) and, for fp8, the
/// scales.
pub(crate) fn upload_tokens(
    dev: &Device,
    me: &RankInputs,
) -> Result<(DeviceBuffer, Option<DeviceBuffer>)> {
    Ok(match &me.x_fp8 {
        Some((q, s)) => (upload(dev, q)?, Some(upload(dev, s)?)),
        None => (upload(dev, &me.x_bf16)?, None),
    })
}

/// Checks one rank's normal dispatch outputs (device) against the reference.
#[allow(clippy::too_many_arguments)]
fn check_normal_dispatch(
    rank: usize,
    it: usize,
    fp8: bool,
    out: &GpuDispatchBuffers,
    handle_prefix: &[i32],
    handle_experts: &[i32],
    want: &NormalDispatchOut,
    hidden: usize,
    topk: usize,
) -> Result<()> {
    let n = want.num_recv_tokens;
    let pw: Vec<i32> = want.rank_prefix.iter().map(|&v| v as i32).collect();
    if handle_prefix != &pw[..] {
        return Err(mismatch(rank, "rank_prefix", it));
    }
    let ew: Vec<i32> = want.num_recv_tokens_per_expert.iter().map(|&v| v as i32).collect();
    if handle_experts != &ew[..] {
        return Err(mismatch(rank, "tokens per expert", it));
    }
    let rx: Vec<u8> = out.recv_x.to_vec()?;
    match &want.recv_x {
        Tokens::Bf16(v) => {
            if rx[..n * hidden * 2] != *bytemuck::cast_slice::<u16, u8>(&v[..n * hidden]) {
                return Err(mismatch(rank, "recv_x (bf16)", it));
            }
        }
        Tokens::Fp8 { x, scales } => {
            if !fp8 || rx[..n * hidden] != x[..n * hidden] {
                return Err(mismatch(rank, "recv_x (fp8)", it));
            }
            let s: Vec<f32> = out.recv_x_scales.as_ref().map_or(Ok(Vec::new()), |b| b.to_vec())?;
            let g = n * (hidden / 128);
            if s.get(..g) != scales.get(..g) {
                return Err(mismatch(rank, "recv_x_scales", it));
            }
        }
    }
    let ti: Vec<i64> = out.recv_topk_idx.to_vec()?;
    if ti[..n * topk] != want.recv_topk_idx[..n * topk] {
        return Err(mismatch(rank, "recv_topk_idx", it));
    }
    let tw: Vec<f32> = out.recv_topk_weights.to_vec()?;
    if tw[..n * topk] != want.recv_topk_weights[..n * topk] {
        return Err(mismatch(rank, "recv_topk_weights", it));
    }
    let si: Vec<i32> = out.recv_src_idx.to_vec()?;
    if si[..n] != want.recv_src_idx[..n] {
        return Err(mismatch(rank, "recv_src_idx", it));
    }
    Ok(())
}

/// Normal mode: `warmup + iters` fresh dispatches (GPU layout, notify, then either the host
/// learns the count or `num_worst_tokens`, then dispatch) and combines, every one checked.
/// Dispatch time: from before the layout to after the dispatch kernel (the host sync included),
/// combine time: the combine kernel; both from CUDA events. Returns each rank's report. (Each
/// step here is timed between barriers; [`GpuSplit::back_to_back`] times steps back to back.)
pub fn run_normal_gpu(dev: &Device, p: &GpuBenchParams) -> Result<GpuReport> {
    run_normal_gpu_split(dev, p, &GpuSplit::one_node(p.num_ranks))
}

/// [`run_normal_gpu`] with ranks split into nodes of `split.ranks_per_node` (threads of this
/// process; other-node peers through the proxy lane) and the given queue shape.
pub fn run_normal_gpu_split(
    dev: &Device,
    p: &GpuBenchParams,
    split: &GpuSplit,
) -> Result<GpuReport> {
    let prep = NormalPrep::new(p, split)?;
    on_threads(p.num_ranks, p.timeout, |rank, boot| normal_rank(dev, p, split, &prep, rank, boot))
}

/// One rank of [`run_normal_gpu_split`] in this process (one process per rank, e.g. under
/// `LocalJob` with a `TcpStore`): the same inputs and checks, this rank's report.
pub fn run_normal_gpu_rank(
    dev: &Device,
    p: &GpuBenchParams,
    split: &GpuSplit,
    boot: Arc<dyn Bootstrap>,
) -> Result<NormalBenchReport> {
    check_world(p, &*boot)?;
    let prep = NormalPrep::new(p, split)?;
    normal_rank(dev, p, split, &prep, boot.rank(), boot)
}

/// [`run_normal_gpu_split`] through DeepEP's hierarchy ([`GpuHierBuffer`]: the rail stage to
/// other nodes through the proxy lane, then the node stage): ranks as threads of this process,
/// the same inputs, dispatch checked against the direct reference, combine against the
/// node-grouped sum; timed as [`run_normal_gpu_split`] (each dispatch includes its host
/// synchronisations). `split.ranks_per_node` must divide the ranks and be below them. Also
/// returns the internode bytes of both routings summed over the ranks
/// ([`InternodeBytes::of_routing`]).
pub fn run_normal_gpu_hier(
    dev: &Device,
    p: &GpuBenchParams,
    split: &GpuSplit,
) -> Result<(GpuReport, InternodeBytes)> {
    let rpn = split.ranks_per_node;
    if rpn == 0 || rpn >= p.num_ranks || p.num_ranks % rpn != 0 {
        return Err(Error::arg(
            "ranks_per_node",
            format!(
                "{rpn}: the hierarchy needs 2 or more nodes of equal size ({} ranks)",
                p.num_ranks
            ),
        ));
    }
    let prep = NormalPrep::grouped(p, split, rpn)?;
    let mut bytes = InternodeBytes::default();
    for (rank, me) in prep.inputs.iter().enumerate() {
        let b = InternodeBytes::of_routing(&p.config_split(rank, rpn)?, &me.topk_idx)?;
        bytes.direct += b.direct;
        bytes.hier += b.hier;
    }
    let rep = on_threads(p.num_ranks, p.timeout, |rank, boot| {
        hier_rank(dev, p, split, &prep, rank, boot)
    })?;
    Ok((rep, bytes))
}

/// One rank of [`run_normal_gpu_hier`] in this process (one process per rank; the node stage
/// reaches its peers through CUDA IPC): the same inputs and checks, this rank's report.
pub fn run_normal_gpu_hier_rank(
    dev: &Device,
    p: &GpuBenchParams,
    split: &GpuSplit,
    boot: Arc<dyn Bootstrap>,
) -> Result<NormalBenchReport> {
    check_world(p, &*boot)?;
    let prep = NormalPrep::grouped(p, split, split.ranks_per_node)?;
    hier_rank(dev, p, split, &prep, boot.rank(), boot)
}

fn check_world(p: &GpuBenchParams, boot: &dyn Bootstrap) -> Result<()> {
    if boot.world_size() != p.num_ranks {
        return Err(Error::arg(
            "num_ranks",
            format!("{} in the parameters, the job has {}", p.num_ranks, boot.world_size()),
        ));
    }
    Ok(())
}

/// Every rank's inputs and the reference outputs (the same in every process).
struct NormalPrep {
    inputs: Vec<RankInputs>,
    want_d: Vec<NormalDispatchOut>,
    want_c: Vec<NormalCombineOut>,
    worst: Option<usize>,
}

impl NormalPrep {
    fn new(p: &GpuBenchParams, split: &GpuSplit) -> Result<Self> {
        Self::grouped(p, split, p.num_ranks)
    }

    /// As [`Self::new`] with the combine summed per `group` ranks (the hierarchy's order).
    fn grouped(p: &GpuBenchParams, split: &GpuSplit, group: usize) -> Result<Self> {
        let cfg0 = p.config_split(0, split.ranks_per_node)?;
        let hp = p.host_params();
        let inputs: Vec<RankInputs> = (0..p.num_ranks)
            .map(|r| host_bench::rank_inputs(&cfg0, &hp, r))
            .collect::<Result<_>>()?;
        let total: usize = p.num_tokens * p.num_ranks;
        let worst = p.worst.then_some(total.max(1));
        let (want_d, want_c) =
            host_bench::reference_grouped(&cfg0, &inputs, (1, worst, true), group)?;
        Ok(NormalPrep { inputs, want_d, want_c, worst })
    }
}

/// One rank's device data of a normal-mode run: its inputs, the combine's inputs (the expert
/// outputs of the reference) and outputs, its stream, and its buffer options.
struct NormalRankData {
    cfg: EpConfig,
    opts: GpuOptions,
    x: DeviceBuffer,
    xs: Option<DeviceBuffer>,
    ti: DeviceBuffer,
    tw: DeviceBuffer,
    cx: DeviceBuffer,
    cw: DeviceBuffer,
    out_c: DeviceBuffer,
    out_cw: DeviceBuffer,
    stream: Stream,
}

impl NormalRankData {
    /// Uploads rank `rank`'s data; returns it with an empty report of its byte counts.
    fn new(
        dev: &Device,
        p: &GpuBenchParams,
        split: &GpuSplit,
        prep: &NormalPrep,
        rank: usize,
    ) -> Result<(Self, NormalBenchReport)> {
        let cfg = p.config_split(rank, split.ranks_per_node)?;
        let (t, h, k) = (p.num_tokens, cfg.hidden, cfg.num_topk);
        let mut opts =
            GpuOptions { proxy_provider: split.provider.clone(), ..p.gpu_options(dev, true) };
        opts.chunk_tokens = split.chunk_tokens.unwrap_or(opts.chunk_tokens);
        opts.slots_per_peer = split.slots_per_peer.or(opts.slots_per_peer);
        let me = &prep.inputs[rank];
        let want = &prep.want_d[rank];
        let (x, xs) = upload_tokens(dev, me)?;
        let lay =
            dispatch_layout(&me.topk_idx, t, k, cfg.num_experts, cfg.num_ranks, cfg.num_ranks)?;
        let sent: u64 = lay.num_tokens_per_rank.iter().map(|&c| c.max(0) as u64).sum();
        let rep = NormalBenchReport {
            dispatch_s: Vec::new(),
            combine_s: Vec::new(),
            dispatch_bytes: sent * cfg.dispatch_dtype.token_bytes(h as u64),
            combine_bytes: sent * 2 * h as u64,
        };
        let d = NormalRankData {
            x,
            xs,
            ti: upload(dev, &me.topk_idx)?,
            tw: upload(dev, &me.topk_weights)?,
            cx: upload(dev, &host_bench::combine_input(&want.recv_x, h)?)?,
            cw: upload(dev, &want.recv_topk_weights)?,
            out_c: DeviceBuffer::new(dev, (t * h * 2).max(16))?,
            out_cw: DeviceBuffer::new(dev, (t * k * 4).max(16))?,
            stream: Stream::new(dev)?,
            cfg,
            opts,
        };
        Ok((d, rep))
    }

    fn dispatch_args(&self) -> GpuDispatchArgs<'_> {
        GpuDispatchArgs {
            x: DevSlice::of(&self.x),
            x_scales: self.xs.as_ref().map(DevSlice::of),
            topk_idx: DevSlice::of(&self.ti),
            topk_weights: DevSlice::of(&self.tw),
            stream: &self.stream,
        }
    }

    fn combine_args(&self) -> GpuCombineArgs<'_> {
        GpuCombineArgs {
            x: DevSlice::of(&self.cx),
            topk_weights: Some(DevSlice::of(&self.cw)),
            combined_x: DevSlice::of(&self.out_c),
            combined_topk_weights: Some(DevSlice::of(&self.out_cw)),
            stream: &self.stream,
        }
    }

    /// Fills every output with a pattern no step writes, on the stream.
    fn poison(&self, o: &GpuDispatchBuffers) -> Result<()> {
        for b in [&o.recv_x, &o.recv_topk_idx, &o.recv_topk_weights, &o.recv_src_idx, &self.out_c] {
            b.memset_async(0xAB, &self.stream)?;
        }
        if let Some(b) = &o.recv_x_scales {
            b.memset_async(0xAB, &self.stream)?;
        }
        Ok(())
    }

    /// Checks this step's outputs: the dispatch (`o`, with the handle's `prefix` and per-expert
    /// counts) and the combine, against the reference.
    #[allow(clippy::too_many_arguments)]
    fn check(
        &self,
        p: &GpuBenchParams,
        prep: &NormalPrep,
        rank: usize,
        it: usize,
        o: &GpuDispatchBuffers,
        prefix: &[i32],
        experts: &[i32],
    ) -> Result<()> {
        let (t, h, k) = (p.num_tokens, self.cfg.hidden, self.cfg.num_topk);
        check_normal_dispatch(rank, it, p.fp8, o, prefix, experts, &prep.want_d[rank], h, k)?;
        let want = &prep.want_c[rank];
        let got: Vec<u16> = self.out_c.to_vec()?;
        if got[..t * h] != want.combined_x[..] {
            return Err(mismatch(rank, "combined_x", it));
        }
        let gw: Vec<f32> = self.out_cw.to_vec()?;
        if Some(&gw[..t * k]) != want.combined_topk_weights.as_deref() {
            return Err(mismatch(rank, "combined_topk_weights", it));
        }
        Ok(())
    }
}

/// The steps of a normal-mode run, for any path's state `S`: `warmup + iters` checked steps,
/// each between barriers (`step(s, cached, after_dispatch, after_combine)`, `sync(s)`,
/// `check(s, it)`), then [`GpuSplit::back_to_back`] steps timed back to back (the last checked).
/// Fills `rep`'s times.
#[allow(clippy::too_many_arguments)]
fn run_steps<S>(
    dev: &Device,
    p: &GpuBenchParams,
    split: &GpuSplit,
    boot: &dyn Bootstrap,
    d: &NormalRankData,
    o: &GpuDispatchBuffers,
    rep: &mut NormalBenchReport,
    s: &mut S,
    step: impl Fn(&mut S, bool, &Event, &Event) -> Result<()>,
    sync: impl Fn(&mut S) -> Result<()>,
    check: impl Fn(&S, usize) -> Result<()>,
) -> Result<()> {
    let nb = split.back_to_back;
    // [0..3]: the checked steps; [3 + 2 i]: before back-to-back step i, [4 + 2 i] after its
    // dispatch, [5 + 2 i] after its combine (= before step i + 1).
    let ev: Vec<Event> =
        (0..4 + 2 * nb).map(|_| Event::new(dev)).collect::<std::result::Result<_, _>>()?;
    for it in 0..p.warmup + p.iters {
        boot.barrier()?;
        d.poison(o)?;
        ev[0].record(&d.stream)?;
        step(s, split.cached && it > 0, &ev[1], &ev[2])?;
        sync(s)?;
        check(s, it)?;
        if it >= p.warmup {
            rep.dispatch_s.push(elapsed_s(&ev[0], &ev[1])?);
            rep.combine_s.push(elapsed_s(&ev[1], &ev[2])?);
        }
    }
    if nb > 0 {
        boot.barrier()?;
        d.poison(o)?;
        sync(s)?;
        boot.barrier()?;
        ev[3].record(&d.stream)?;
        for i in 0..nb {
            step(s, split.cached, &ev[4 + 2 * i], &ev[5 + 2 * i])?;
        }
        sync(s)?;
        // The last step is still checked (the timed loop must not trade correctness).
        check(s, p.warmup + p.iters + nb - 1)?;
        rep.dispatch_s.clear();
        rep.combine_s.clear();
        for i in 0..nb {
            rep.dispatch_s.push(elapsed_s(&ev[3 + 2 * i], &ev[4 + 2 * i])?);
            rep.combine_s.push(elapsed_s(&ev[4 + 2 * i], &ev[5 + 2 * i])?);
        }
    }
    boot.barrier()?;
    Ok(())
}

fn normal_rank(
    dev: &Device,
    p: &GpuBenchParams,
    split: &GpuSplit,
    prep: &NormalPrep,
    rank: usize,
    boot: Arc<dyn Bootstrap>,
) -> Result<NormalBenchReport> {
    let (d, mut rep) = NormalRankData::new(dev, p, split, prep, rank)?;
    let (t, worst) = (p.num_tokens, prep.worst);
    let mut buf = Buffer::new(d.cfg.clone(), boot.clone(), BufferOptions::gpu(d.opts.clone()))?;
    let gpu = buf.gpu()?;
    let handle = gpu.new_handle(t)?;
    // NOTES: every device allocation before the first barrier: with ranks as threads of one
    // context, allocating or freeing while a peer's kernel spins on this rank can stall both
    // until the timeout. At most `t` tokens come from each rank.
    let o = GpuDispatchBuffers::new(gpu, worst.unwrap_or(t * d.cfg.num_ranks).max(1))?;
    // One step on the stream: notify (unless `reuse`: the cached handle), dispatch, then
    // `after_dispatch` is recorded, combine, then `after_combine`.
    // SAFETY (callers): every buffer lives until the stream synchronises (sync_gpu); all ranks
    // run the same sequence of calls.
    let step = |(gpu, handle): &mut (&mut GpuBuffer, GpuHandle),
                reuse: bool,
                after_dispatch: &Event,
                after_combine: &Event|
     -> Result<()> {
        let notify = GpuNotifyArgs {
            num_worst_tokens: worst,
            ..GpuNotifyArgs::new(DevSlice::of(&d.ti), t, &d.stream)
        };
        unsafe {
            let rows = if reuse {
                // Same routing every iteration: the first notify's handle is reused.
                handle.num_out_rows().unwrap_or(0)
            } else {
                let info = gpu.notify_gpu(&notify, handle)?;
                info.map_or(worst.unwrap_or(0), |i| i.num_recv_tokens)
            };
            if o.rows < rows {
                return Err(Error::Other(format!("rank {rank}: {rows} rows exceed the bound")));
            }
            gpu.dispatch_gpu(&d.dispatch_args(), handle, &o.out())?;
            after_dispatch.record(&d.stream)?;
            gpu.combine_gpu(&d.combine_args(), handle)?;
            after_combine.record(&d.stream)?;
        }
        Ok(())
    };
    let sync = |(gpu, _): &mut (&mut GpuBuffer, GpuHandle)| gpu.sync_gpu(&d.stream);
    let check = |(_, handle): &(&mut GpuBuffer, GpuHandle), it: usize| -> Result<()> {
        let prefix: Vec<i32> = handle.device().rank_prefix.to_vec()?;
        let experts: Vec<i32> = handle.device().recv_expert_counts.to_vec()?;
        d.check(p, prep, rank, it, &o, &prefix, &experts)
    };
    let mut st = (gpu, handle);
    run_steps(dev, p, split, &*boot, &d, &o, &mut rep, &mut st, step, sync, check)?;
    drop(st);
    drop(o);
    buf.destroy()?;
    Ok(rep)
}

fn hier_rank(
    dev: &Device,
    p: &GpuBenchParams,
    split: &GpuSplit,
    prep: &NormalPrep,
    rank: usize,
    boot: Arc<dyn Bootstrap>,
) -> Result<NormalBenchReport> {
    let (d, mut rep) = NormalRankData::new(dev, p, split, prep, rank)?;
    let (t, worst) = (p.num_tokens, prep.worst);
    let opts = BufferOptions::gpu(d.opts.clone());
    let mut hb = GpuHierBuffer::new(d.cfg.clone(), boot.clone(), opts)?;
    // Every allocation before the first barrier (see normal_rank).
    let handle = hb.new_handle(t)?;
    let rows = worst.unwrap_or(t * d.cfg.num_ranks).max(1);
    let o = GpuDispatchBuffers::for_config(dev, &d.cfg, rows)?;
    let step = |(hb, handle): &mut (GpuHierBuffer, GpuHierHandle),
                cached: bool,
                after_dispatch: &Event,
                after_combine: &Event|
     -> Result<()> {
        let a = d.dispatch_args();
        let args = GpuHierDispatchArgs {
            x: a.x,
            x_scales: a.x_scales,
            topk_idx: a.topk_idx,
            topk_weights: a.topk_weights,
            num_tokens: t,
            expert_alignment: 1,
            num_worst_tokens: worst,
            cached,
            stream: &d.stream,
        };
        // SAFETY: every buffer lives until the stream synchronises (sync_gpu); all ranks run
        // the same sequence of calls.
        unsafe {
            hb.dispatch_gpu(&args, handle, &o.out())?;
            after_dispatch.record(&d.stream)?;
            hb.combine_gpu(&d.combine_args(), handle)?;
        }
        after_combine.record(&d.stream)?;
        Ok(())
    };
    let sync = |(hb, _): &mut (GpuHierBuffer, GpuHierHandle)| hb.sync_gpu(&d.stream);
    let check = |(_, handle): &(GpuHierBuffer, GpuHierHandle), it: usize| -> Result<()> {
        let prefix: Vec<i32> = handle.rank_prefix().iter().map(|&v| v as i32).collect();
        let experts = handle.num_recv_tokens_per_expert();
        d.check(p, prep, rank, it, &o, &prefix, experts)
            .map_err(|e| Error::Other(format!("{e} (the hierarchy)")))
    };
    let mut st = (hb, handle);
    run_steps(dev, p, split, &*boot, &d, &o, &mut rep, &mut st, step, sync, check)?;
    let (hb, handle) = st;
    drop(handle);
    drop(o);
    hb.destroy()?;
    Ok(rep)
}

/// One rank's low-latency inputs.
struct LlInput {
    x: Vec<u16>,
    topk_idx: Vec<i64>,
    topk_weights: Vec<f32>,
}

fn ll_inputs(p: &GpuBenchParams, seed: u64) -> Result<Vec<LlInput>> {
    (0..p.num_ranks)
        .map(|r| {
            let mut rng = SplitMix64(seed ^ (r as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
            let t = p.num_tokens;
            let shape = LayoutShape::new(t, p.num_topk, p.num_experts, p.num_ranks, p.num_ranks)?;
            let topk_idx = random_topk_idx(&mut rng, shape, p.drop_pct, false);
            let x = (0..t * p.hidden).map(|_| f32_to_bf16((rng.unit_f32() - 0.5) * 8.0)).collect();
            let topk_weights = (0..t * p.num_topk).map(|_| rng.unit_f32()).collect();
            Ok(LlInput { x, topk_idx, topk_weights })
        })
        .collect()
}

fn ll_params(p: &GpuBenchParams) -> refm::LlParams {
    refm::LlParams {
        num_experts: p.num_experts,
        hidden: p.hidden,
        num_topk: p.num_topk,
        max_tokens_per_rank: p.num_tokens,
        use_fp8: p.fp8,
        round_scale: false,
    }
}

/// Checks one rank's low-latency dispatch against the reference (rows past the counts are
/// not part of the contract and are skipped).
fn check_ll_dispatch(
    rank: usize,
    it: usize,
    p: &GpuBenchParams,
    got: &LlDispatchHost,
    want: &refm::LlDispatchOut,
) -> Result<()> {
    let (h, nr) = (p.hidden, p.num_ranks);
    let l = p.num_experts / nr;
    let s = nr * p.num_tokens;
    let wc: Vec<i32> = want.recv_count.iter().map(|&c| c as i32).collect();
    if got.recv_count != wc {
        return Err(mismatch(rank, "low-latency recv_count", it));
    }
    let lr: Vec<i32> = want.layout_range.iter().flat_map(|&(b, c)| [b as i32, c as i32]).collect();
    if got.layout_range != lr {
        return Err(mismatch(rank, "low-latency layout_range", it));
    }
    for e in 0..l {
        let rows = e * s..e * s + want.recv_count[e] as usize;
        if got.recv_src_rank[rows.clone()] != want.recv_src_rank[rows.clone()]
            || got.recv_src_idx[rows.clone()] != want.recv_src_idx[rows.clone()]
        {
            return Err(mismatch(rank, "low-latency source info", it));
        }
        match &want.recv_x {
            Tokens::Bf16(x) => {
                let gx: &[u16] = bytemuck::cast_slice(&got.recv_x);
                if gx[rows.start * h..rows.end * h] != x[rows.start * h..rows.end * h] {
                    return Err(mismatch(rank, "low-latency recv_x (bf16)", it));
                }
            }
            Tokens::Fp8 { x, scales } => {
                let g = h / 128;
                if got.recv_x[rows.start * h..rows.end * h] != x[rows.start * h..rows.end * h] {
                    return Err(mismatch(rank, "low-latency recv_x (fp8)", it));
                }
                let a = &got.recv_scales[rows.start * g..rows.end * g];
                let b = &scales[rows.start * g..rows.end * g];
                if a.iter().zip(b).any(|(u, v)| u.to_bits() != v.to_bits()) {
                    return Err(mismatch(rank, "low-latency scales", it));
                }
            }
        }
    }
    Ok(())
}

/// For a `main` that runs GPU ranks as threads of this process: sets
/// `CUDA_DEVICE_MAX_CONNECTIONS=32` unless the caller set it (a `Buffer` refuses ranks as
/// threads with too few hardware work queues). Call it first thing in `main`, before any thread
/// or CUDA call: the driver reads the variable when it starts.
pub fn set_work_queues_for_threads() {
    if std::env::var_os("CUDA_DEVICE_MAX_CONNECTIONS").is_none() {
        std::env::set_var("CUDA_DEVICE_MAX_CONNECTIONS", "32");
    }
}

/// Where the ranks of a low-latency run sit, and what runs beyond the checked iterations.
#[derive(Clone, Debug)]
pub struct LlRunOptions {
    /// Ranks per node: peers on other nodes go through the proxy (`ep::gpu::ll_proxy`).
    pub ranks_per_node: usize,
    /// The proxy path's libfabric provider (`None`: libfabric's choice).
    pub provider: Option<String>,
    /// After the checked iterations: this many dispatch + combine pairs back to back on the
    /// stream (no host barrier, no check, no poison), timed per phase; the report then holds
    /// these instead of the checked ones.
    pub timed_iters: usize,
    /// Timed loop as CUDA-graph replays: one dispatch + combine pair is captured once and
    /// replayed `timed_iters` times (one launch per pair); only whole pairs are timed
    /// ([`LlRankReport::pair_s`]).
    pub graph: bool,
    /// After the checked iterations, before the timed loop: this many pairs back to back with
    /// the event trace on ([`fabric_ep::trace`]: kernel points and proxy points on one clock), in
    /// [`LlRankReport::trace`]. 0: no trace.
    pub trace_pairs: usize,
    /// The ranks are threads of this process (set by [`run_ll_gpu_on`]).
    pub ranks_share_process: bool,
}

impl LlRunOptions {
    /// Every rank on one node.
    pub fn one_node(num_ranks: usize) -> Self {
        LlRunOptions {
            ranks_per_node: num_ranks.max(1),
            provider: None,
            timed_iters: 0,
            graph: false,
            trace_pairs: 0,
            ranks_share_process: false,
        }
    }
}

/// Inputs and reference outputs of every rank of a low-latency run (deterministic from the
/// seed, so every process of a multi-process run computes the same).
pub struct LlCase {
    inputs: Vec<LlInput>,
    ys: Vec<Vec<u16>>,
    want_d: Vec<refm::LlDispatchOut>,
    want_c: Vec<Vec<u16>>,
    /// With `GpuBenchParams::graph`: a second case (other routing and data) that the checked
    /// steps alternate with, so a replayed graph must follow what its buffers hold.
    alt: Option<Box<LlCase>>,
}

impl LlCase {
    pub fn new(p: &GpuBenchParams) -> Result<Self> {
        let mut c = Self::with_seed(p, p.seed)?;
        if p.graph {
            c.alt = Some(Box::new(Self::with_seed(p, p.seed ^ 0x6a09_e667_f3bc_c908)?));
        }
        Ok(c)
    }

    fn with_seed(p: &GpuBenchParams, seed: u64) -> Result<Self> {
        let inputs = ll_inputs(p, seed)?;
        let lp = ll_params(p);
        let rin: Vec<refm::LlRankInput> =
            inputs.iter().map(|i| refm::LlRankInput { x: &i.x, topk_idx: &i.topk_idx }).collect();
        let want_d = refm::ll_dispatch(&lp, &rin)?;
        let (nr, h, m) = (p.num_ranks, p.hidden, p.num_tokens);
        let l = p.num_experts / nr;
        let s = nr * m;
        // Expert outputs: random bf16 on the rows each rank received (the rest is never read).
        let ys: Vec<Vec<u16>> = want_d
            .iter()
            .enumerate()
            .map(|(r, w)| {
                let mut rng = SplitMix64(seed.wrapping_add(77 + r as u64));
                let mut y = vec![0u16; l * s * h];
                for e in 0..l {
                    let n = w.recv_count[e] as usize;
                    for v in &mut y[e * s * h..(e * s + n) * h] {
                        *v = f32_to_bf16((rng.unit_f32() - 0.5) * 4.0 + 1e-3);
                    }
                }
                y
            })
            .collect();
        let cin: Vec<refm::LlCombineInput> = inputs
            .iter()
            .zip(&ys)
            .map(|(i, y)| refm::LlCombineInput {
                x: y,
                topk_idx: &i.topk_idx,
                topk_weights: &i.topk_weights,
            })
            .collect();
        let want_c = refm::ll_combine(&lp, &want_d, &cin)?;
        Ok(LlCase { inputs, ys, want_d, want_c, alt: None })
    }

    /// Rows rank `src` sends rank `dst` in one dispatch, and the messages (one per local
    /// expert of `dst`) that carry them.
    pub fn rows_between(&self, p: &GpuBenchParams, src: usize, dst: usize) -> (usize, usize) {
        let l = p.num_experts / p.num_ranks;
        let rows =
            self.inputs[src].topk_idx.iter().filter(|&&g| g >= 0 && g as usize / l == dst).count();
        (rows, l)
    }
}

/// Low-latency mode: `warmup + iters` dispatches and combines (`p.hook`: each as send, then the
/// hook's receive), every one checked against the reference; then (eager, not `p.graph`) `iters`
/// pairs back to back, the last checked too. Times from CUDA events around dispatch (send +
/// receive) and combine (send + receive): of the back-to-back pairs when there are (each rank
/// paced by its peers' data, as in a run of many steps, not by a host barrier per step), else
/// of the checked steps.
pub fn run_ll_gpu(dev: &Device, p: &GpuBenchParams) -> Result<GpuReport> {
    run_ll_gpu_on(dev, p, &ll_options(p))
}

/// [`run_ll_gpu`]'s options: one node, the timed back-to-back pairs unless `p.graph`.
fn ll_options(p: &GpuBenchParams) -> LlRunOptions {
    LlRunOptions {
        timed_iters: if p.graph { 0 } else { p.iters },
        ..LlRunOptions::one_node(p.num_ranks)
    }
}

/// [`run_ll_gpu`] with `o.ranks_per_node` ranks per node (ranks are still threads of this
/// process; peers on other "nodes" go through the proxy over `o.provider`).
pub fn run_ll_gpu_on(dev: &Device, p: &GpuBenchParams, o: &LlRunOptions) -> Result<GpuReport> {
    Ok(run_ll_gpu_threads(dev, p, o)?.into_iter().map(|r| r.report).collect())
}

/// [`run_ll_gpu_on`] with every rank's full report (rank order).
pub fn run_ll_gpu_threads(
    dev: &Device,
    p: &GpuBenchParams,
    o: &LlRunOptions,
) -> Result<Vec<LlRankReport>> {
    let case = LlCase::new(p)?;
    let o = LlRunOptions { ranks_share_process: true, ..o.clone() };
    on_threads(p.num_ranks, p.timeout, |rank, boot| run_ll_gpu_rank(dev, p, &o, &case, rank, boot))
}

/// One rank of [`run_ll_gpu`]'s job when the ranks are processes of one node (`boot` is this
/// rank's bootstrap; its world size must be `p.num_ranks`; `dev` this rank's GPU).
pub fn run_ll_gpu_process(
    dev: &Device,
    p: &GpuBenchParams,
    boot: Arc<dyn Bootstrap>,
) -> Result<NormalBenchReport> {
    check_world(p, &*boot)?;
    let case = LlCase::new(p)?;
    let rank = boot.rank();
    Ok(run_ll_gpu_rank(dev, p, &ll_options(p), &case, rank, boot)?.report)
}

/// What one rank of a low-latency run measured.
pub struct LlRankReport {
    pub report: NormalBenchReport,
    /// Hook mode, timed loop only: per pair, the send part of each phase (from the phase's start
    /// to after its send kernel; the rest of the phase is the hook's receive). Empty otherwise.
    pub dispatch_send_s: Vec<f64>,
    pub combine_send_s: Vec<f64>,
    /// Timed loop: host seconds per pair spent enqueueing (launches, event records); when it
    /// is near the pair's GPU time, the GPU waited for the host and the phases are host-bound.
    pub host_enqueue_s: f64,
    /// Graph mode: per replay, the whole pair (dispatch + combine).
    pub pair_s: Vec<f64>,
    /// `LlRunOptions::trace_pairs`: the kernels' and this process's proxy points, host clock.
    pub trace: Vec<fabric_ep::trace::TraceRecord>,
}

/// Pairs of the LL timed loop enqueued behind one gate (see `run_ll_gpu_rank`): few enough that
/// the enqueued launches never fill the stream's queue while the gate holds it.
const GATE_PAIRS: usize = 32;

/// One rank of a low-latency run (the body [`run_ll_gpu_on`] runs per thread; a process of a
/// multi-process run calls it with its own bootstrap). Collective over `boot`. An error of a
/// rank with a proxy lane carries the lane's snapshot (`GpuBuffer::ll_proxy_snapshot`).
pub fn run_ll_gpu_rank(
    dev: &Device,
    p: &GpuBenchParams,
    o: &LlRunOptions,
    case: &LlCase,
    rank: usize,
    boot: Arc<dyn Bootstrap>,
) -> Result<LlRankReport> {
    let (h, m) = (p.hidden, p.num_tokens);
    let mut cfg = p.config(rank)?;
    if o.ranks_per_node != cfg.ranks_per_node {
        let mut s = cfg.settings().clone();
        s.ranks_per_node = o.ranks_per_node;
        cfg = EpConfig::new(s)?;
    }
    let me = &case.inputs[rank];
    let t = m;
    let opts = GpuOptions { ll_provider: o.provider.clone(), ..p.gpu_options(dev, false) };
    let mut buf = Buffer::new(cfg, boot.clone(), BufferOptions::gpu(opts))?;
    let mut x = upload(dev, &me.x)?;
    let mut ti = upload(dev, &me.topk_idx)?;
    let mut tw = upload(dev, &me.topk_weights)?;
    let mut y = upload(dev, &case.ys[rank])?;
    let out_c = DeviceBuffer::new(dev, (t * h * 2).max(16))?;
    let stream = Stream::new(dev)?;
    // Timed loop: 5 events per pair (start, after dispatch send, dispatch, combine send,
    // combine).
    let n_ev = 5 * o.timed_iters + 3;
    let ev: Vec<Event> =
        (0..n_ev).map(|_| Event::new(dev)).collect::<std::result::Result<_, _>>()?;
    let pairs = me.topk_idx.iter().filter(|&&e| e >= 0).count() as u64;
    let tok_bytes = if p.fp8 { h + h / 128 * 4 } else { 2 * h } as u64;
    let mut rep = LlRankReport {
        report: NormalBenchReport {
            dispatch_s: Vec::new(),
            combine_s: Vec::new(),
            dispatch_bytes: pairs * tok_bytes,
            combine_bytes: pairs * 2 * h as u64,
        },
        dispatch_send_s: Vec::new(),
        combine_send_s: Vec::new(),
        host_enqueue_s: 0.0,
        pair_s: Vec::new(),
        trace: Vec::new(),
    };
    let gpu = buf.gpu()?;
    let out = gpu.new_ll_dispatch_out()?;
    let da = GpuLlDispatchArgs {
        x: DevSlice::of(&x),
        topk_idx: DevSlice::of(&ti),
        num_tokens: t,
        use_fp8: p.fp8,
        return_recv_hook: p.hook,
        stream: &stream,
    };
    let ca = GpuLlCombineArgs {
        x: DevSlice::of(&y),
        topk_idx: DevSlice::of(&ti),
        topk_weights: DevSlice::of(&tw),
        num_tokens: t,
        handle: &out,
        out: DevSlice::of(&out_c),
        return_recv_hook: p.hook,
        stream: &stream,
    };
    // A host word that holds each rank's step (or chunk of timed pairs) until every rank has
    // enqueued it (`fep_wait_test` spinning on it; bounded by twice the timeout).
    let gate = HostMapped::new(dev, 8)?;
    let gate_err = DevErrorRecord::new(dev)?;
    let gate_word = gate.atomic_u64(0)?;
    let mut gate_val = 0u64;
    let gate_params = |expected: u64| fabric_ep::abi::fep_wait_test_params {
        counter: gate.device_ptr(),
        dev_error: gate_err.as_abi(),
        expected,
        budget_cycles: (p.timeout.as_secs_f64() * 4e9) as u64,
        rank: rank as u32,
        phase: 0,
        peer: u32::MAX,
        _pad: 0,
    };
    let res = (|| -> Result<()> {
        let r = &mut rep.report;
        // The phases of a checked step (each: send, then the hook's receive when hooked).
        // SAFETY (all uses): every buffer lives until sync_gpu below; all ranks make the same
        // calls.
        let dispatch = |gpu: &mut fabric_ep::ep::gpu::GpuBuffer| -> Result<()> {
            unsafe {
                if let Some(hook) = gpu.low_latency_dispatch_gpu(&da, &out)? {
                    gpu.low_latency_dispatch_recv_gpu(hook, &out, &stream)?;
                }
            }
            Ok(())
        };
        let combine = |gpu: &mut fabric_ep::ep::gpu::GpuBuffer| -> Result<()> {
            unsafe {
                if let Some(hook) = gpu.low_latency_combine_gpu(&ca)? {
                    gpu.low_latency_combine_recv_gpu(hook, &ca)?;
                }
            }
            Ok(())
        };
        // Both outputs of the pair just run (after a sync) against case `c`'s reference.
        let check = |c: &LlCase, it: usize, what: &str| -> Result<()> {
            check_ll_dispatch(rank, it, p, &out.to_host()?, &c.want_d[rank])?;
            let got: Vec<u16> = out_c.to_vec()?;
            if got[..t * h] != c.want_c[rank][..] {
                return Err(mismatch(rank, what, it));
            }
            Ok(())
        };
        // `p.graph`: step 0 eager, then each phase captured once in its own graph (events
        // between the launches time each phase) and replayed, the two cases alternating.
        let cases: Vec<&LlCase> = std::iter::once(case).chain(case.alt.as_deref()).collect();
        let mut graphs: Option<(GraphExec, GraphExec)> = None;
        for it in 0..p.warmup + p.iters {
            let c = cases[it % cases.len()];
            if cases.len() > 1 {
                // Host copies outside any step (no kernel of this rank in flight), finished
                // when they return (`Device::blocking`): the step's kernels read them next.
                let i = &c.inputs[rank];
                x.copy_from_host(&i.x)?;
                ti.copy_from_host(&i.topk_idx)?;
                tw.copy_from_host(&i.topk_weights)?;
                y.copy_from_host(&c.ys[rank])?;
            }
            if p.graph && it == 1 {
                let (gd, ()) = GraphExec::capture(&stream, || dispatch(gpu))?;
                let (gc, ()) = GraphExec::capture(&stream, || combine(gpu))?;
                graphs = Some((gd, gc));
            }
            // The step's kernels wait behind a gate that every rank opens after a barrier, once
            // all of them are enqueued: the events then time the GPU work, not the host's launch
            // gaps or (ranks as processes) the ranks' skew in reaching the step.
            out.recv_x.memset_async(0xAB, &stream)?;
            out_c.memset_async(0xAB, &stream)?;
            stream.synchronize_within(p.timeout)?;
            gate_val += 1;
            // SAFETY: the gate word and its error record outlive sync_gpu below.
            unsafe { fabric_ep::cuda::launch::wait_test(&stream, gate_params(gate_val))? };
            // Host time to enqueue the step's first phase: a call that blocks here (an implicit
            // device synchronisation behind a peer's waiting kernel) is named on stderr.
            let enqueue = Instant::now();
            ev[0].record(&stream)?;
            match &graphs {
                Some((gd, _)) => gd.launch(&stream)?,
                None => dispatch(gpu)?,
            }
            if enqueue.elapsed() > Duration::from_millis(500) {
                eprintln!(
                    "rank {rank} iteration {it}: enqueueing the dispatch took {:.3} s",
                    enqueue.elapsed().as_secs_f64()
                );
            }
            ev[1].record(&stream)?;
            match &graphs {
                Some((_, gc)) => gc.launch(&stream)?,
                None => combine(gpu)?,
            }
            ev[2].record(&stream)?;
            boot.barrier()?;
            gate_word.store(gate_val, std::sync::atomic::Ordering::Release);
            gpu.sync_gpu(&stream)?;
            gate_err.check().map_err(|e| Error::Other(format!("rank {rank}: step gate: {e}")))?;
            check(c, it, "low-latency combine")?;
            if it >= p.warmup {
                r.dispatch_s.push(elapsed_s(&ev[0], &ev[1])?);
                r.combine_s.push(elapsed_s(&ev[1], &ev[2])?);
            }
        }
        if o.trace_pairs > 0 {
            // The trace is per process (a module global, a process-wide host list): with ranks
            // as threads rank 0 installs and reads it for all. Installed and removed between
            // barriers, when no rank's kernel runs.
            let owner = !o.ranks_share_process || rank == 0;
            let cap = (64 * o.trace_pairs * p.num_ranks).max(1024) as u32;
            let tr =
                if owner { Some(fabric_ep::cuda::DeviceTrace::install(dev, cap)?) } else { None };
            if owner {
                fabric_ep::trace::enable_host();
            }
            boot.barrier()?;
            for _ in 0..o.trace_pairs {
                dispatch(gpu)?;
                combine(gpu)?;
            }
            gpu.sync_gpu(&stream)?;
            boot.barrier()?;
            if let Some(tr) = tr {
                let host = fabric_ep::trace::take_host();
                rep.trace = tr.read()?;
                rep.trace.extend(host);
                rep.trace.sort_by_key(|r| r.t_ns);
            }
            boot.barrier()?;
            let it = p.warmup + p.iters + o.trace_pairs;
            check(case, it, "low-latency combine (traced pairs)")?;
        }
        if o.timed_iters == 0 {
            return Ok(());
        }
        boot.barrier()?;
        if o.graph {
            // SAFETY: as above; the graph names the same buffers, alive until the sync below.
            let (g, ()) = GraphExec::capture(&stream, || -> Result<()> {
                unsafe {
                    if let Some(hook) = gpu.low_latency_dispatch_gpu(&da, &out)? {
                        gpu.low_latency_dispatch_recv_gpu(hook, &out, &stream)?;
                    }
                    if let Some(hook) = gpu.low_latency_combine_gpu(&ca)? {
                        gpu.low_latency_combine_recv_gpu(hook, &ca)?;
                    }
                }
                Ok(())
            })?;
            boot.barrier()?;
            let t0 = std::time::Instant::now();
            ev[0].record(&stream)?;
            for i in 0..o.timed_iters {
                g.launch(&stream)?;
                ev[i + 1].record(&stream)?;
            }
            rep.host_enqueue_s = t0.elapsed().as_secs_f64() / o.timed_iters as f64;
            gpu.sync_gpu(&stream)?;
            let it = p.warmup + p.iters + o.timed_iters;
            check(case, it, "low-latency combine (graph replay)")?;
            for i in 0..o.timed_iters {
                rep.pair_s.push(elapsed_s(&ev[i], &ev[i + 1])?);
            }
            return Ok(());
        }
        // Gated in chunks: each chunk of pairs is enqueued behind a kernel that spins on a host
        // word, and every rank opens its gate after a barrier, so the events time the GPU's
        // work, not the host's enqueue (a host slower than the GPU would put its launch gaps
        // into the phases; with ranks as processes, their skew too).
        let mut chunk_t = Instant::now();
        let mut enqueue_s = 0.0;
        for i in 0..o.timed_iters {
            if i % GATE_PAIRS == 0 {
                chunk_t = Instant::now();
                gate_val += 1;
                // SAFETY: the gate word and its error record outlive sync_gpu below.
                unsafe { fabric_ep::cuda::launch::wait_test(&stream, gate_params(gate_val))? };
            }
            let e = &ev[5 * i..5 * i + 5];
            e[0].record(&stream)?;
            // SAFETY: as above; each rank's calls are ordered on its stream, so call N + 2 of
            // any rank starts after its peers' call N receives (DeepEP's set contract).
            unsafe {
                if let Some(hook) = gpu.low_latency_dispatch_gpu(&da, &out)? {
                    e[1].record(&stream)?;
                    gpu.low_latency_dispatch_recv_gpu(hook, &out, &stream)?;
                }
                e[2].record(&stream)?;
                if let Some(hook) = gpu.low_latency_combine_gpu(&ca)? {
                    e[3].record(&stream)?;
                    gpu.low_latency_combine_recv_gpu(hook, &ca)?;
                }
                e[4].record(&stream)?;
            }
            if i % GATE_PAIRS == GATE_PAIRS - 1 || i + 1 == o.timed_iters {
                enqueue_s += chunk_t.elapsed().as_secs_f64();
                boot.barrier()?;
                gate_word.store(gate_val, std::sync::atomic::Ordering::Release);
                // The chunk runs now; the next one is enqueued meanwhile.
            }
        }
        rep.host_enqueue_s = enqueue_s / o.timed_iters as f64;
        gpu.sync_gpu(&stream)?;
        gate_err
            .check()
            .map_err(|e| Error::Other(format!("rank {rank}: timed loop's gate: {e}")))?;
        // The last pair is still checked (the timed loop must not trade correctness).
        let it = p.warmup + p.iters + o.timed_iters;
        check(case, it, "low-latency combine (timed loop)")?;
        r.dispatch_s.clear();
        r.combine_s.clear();
        for i in 0..o.timed_iters {
            let e = &ev[5 * i..5 * i + 5];
            r.dispatch_s.push(elapsed_s(&e[0], &e[2])?);
            r.combine_s.push(elapsed_s(&e[2], &e[4])?);
            if p.hook {
                rep.dispatch_send_s.push(elapsed_s(&e[0], &e[1])?);
                rep.combine_send_s.push(elapsed_s(&e[2], &e[3])?);
            }
        }
        Ok(())
    })();
    if let Err(e) = res {
        // Both snapshots, when there are, ride on the error (diagnosis of a failed run).
        let snaps: Vec<String> =
            [gpu.ll_proxy_snapshot(), gpu.ll_state_snapshot()].into_iter().flatten().collect();
        return Err(match e {
            _ if snaps.is_empty() => e,
            // A timeout stays typed (callers tell it apart); the snapshots go into its detail.
            Error::Timeout { rank, phase, peers, waited, detail } => Error::Timeout {
                rank,
                phase,
                peers,
                waited,
                detail: format!("{detail} [{}]", snaps.join("] [")),
            },
            e => Error::Other(format!("{e} [{}]", snaps.join("] ["))),
        });
    }
    boot.barrier()?;
    drop(out);
    buf.destroy()?;
    Ok(rep)
}

/// The equal-SM copy ceiling beside a kernel's figure: a plain copy of `bytes` (rounded down
/// to 16-byte vectors; `fep_copy_bytes`: grid-stride, four 16-byte loads in flight per thread,
/// no routing) on a grid of `sms` blocks of 1024 threads, timed as a median over `iters`
/// launches (after two untimed ones). Returns (median us, GB/s of `bytes` copied, counted once
/// as the dispatch/combine rows count theirs; the memory traffic is twice that).
pub fn copy_ceiling(dev: &Device, bytes: u64, sms: usize, iters: usize) -> Result<(f64, f64)> {
    let vecs = (bytes / 16).max(1);
    let src = DeviceBuffer::new(dev, vecs as usize * 16)?;
    let dst = DeviceBuffer::new(dev, vecs as usize * 16)?;
    src.memset(0x3c)?;
    let stream = Stream::new(dev)?;
    let (a, b) = (Event::new(dev)?, Event::new(dev)?);
    let mut times = Vec::with_capacity(iters.max(1));
    for it in 0..iters.max(1) + 2 {
        a.record(&stream)?;
        // SAFETY: src and dst hold `vecs * 16` bytes each, live until the synchronisation below.
        unsafe {
            fabric_ep::cuda::launch::copy_bytes(
                &stream,
                sms.max(1) as u32,
                fabric_ep::abi::fep_copy_params {
                    src: src.device_ptr(),
                    dst: dst.device_ptr(),
                    vecs,
                },
            )?;
        }
        b.record(&stream)?;
        stream.synchronize()?;
        if it >= 2 {
            times.push(elapsed_s(&a, &b)? * 1e6);
        }
    }
    let med = crate::stats::percentile(&times, 50.0);
    Ok((med, (vecs * 16) as f64 / (med * 1e-6) / 1e9))
}
