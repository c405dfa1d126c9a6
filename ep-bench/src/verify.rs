//! `ep-bench verify`: a seeded, reproducible randomized matrix over both modes, every output
//! compared with the single-process reference (`protocol::reference`).
//!
//! Case `i` of seed `s` is drawn from `(s, i)` alone ([`draw_case`]), so `--case i` replays it
//! by itself, in a process of its own or inside the whole matrix. A case is a sequence of
//! shapes (hidden, top-k, experts, dtype, queue shape), each on a fresh `Buffer` (the engine's
//! buffers are fixed by its config), and each shape a sequence of calls on that buffer with
//! new token counts, routings and options. Every rank of every call compares its outputs with
//! the reference computed from every rank's inputs:
//! - normal mode: `recv_x` (bf16 bits, or e4m3 bytes and scales), the rows' order within each
//!   source, `recv_topk_idx`, `recv_topk_weights`, per-expert counts (aligned), `rank_prefix`,
//!   source indices, exactly; the combine (fresh and cached handle) within fp32 accumulation
//!   tolerance ([`close_bf16`]; the host backend is also bit-equal and that is counted);
//! - low latency: counts, `layout_range`, source info and rows exactly; the combine within the
//!   same tolerance; with and without the hook, two dispatches before a combine, two hooks
//!   outstanding, a clean between calls.
//!
//! Ranks run as threads of this process ([`InProcGroup`]) or as processes (`LocalJob`, each
//! process rebuilding the case and its reference from the seed). Each case has a deadline; a
//! case over it is a hang, and so is a rank whose bounded wait ran out (`Error::Timeout`: a
//! stalled protocol caught by the bound). Any other error, and any output that differs, is a
//! mismatch.

use std::collections::BTreeMap;
use std::sync::mpsc;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use fabric_ep::bootstrap::{Bootstrap, BootstrapError, InProcGroup};
use fabric_ep::ep::buffer::{
    Buffer, BufferOptions, CombineArgs, CombineOutput, DispatchArgs, DispatchOutput, LlCombineArgs,
    LlDispatchArgs, LlDispatchOutput, OwnedTokens, Tokens,
};
use fabric_ep::ep::hier::{HierBuffer, HierDispatchArgs, HierDispatchOutput};
use fabric_ep::protocol::config::{DispatchDtype, EpConfig, EpSettings};
use fabric_ep::protocol::quant::{bf16_to_f32, dequantize_row, f32_to_bf16, quantize_bf16};
use fabric_ep::protocol::reference::{self as refm};
use fabric_ep::util::SplitMix64;
use fabric_ep::{Error, Result};

/// The providers every matrix covers (those of this machine).
pub const PROVIDERS: [&str; 3] = ["shm", "tcp;ofi_rxm", "udp;ofi_rxd"];

/// Which engine a matrix runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VerifyBackend {
    Host,
    Gpu,
}

impl VerifyBackend {
    pub fn name(self) -> &'static str {
        match self {
            VerifyBackend::Host => "host",
            VerifyBackend::Gpu => "gpu",
        }
    }
}

/// Where a case's ranks run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Launch {
    /// Drawn per case (host: about a quarter as processes; GPU: threads).
    Auto,
    Threads,
    Procs,
}

impl Launch {
    pub fn name(self) -> &'static str {
        match self {
            Launch::Auto => "auto",
            Launch::Threads => "threads",
            Launch::Procs => "procs",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Mode {
    Normal,
    LowLatency,
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::Normal => "normal",
            Mode::LowLatency => "low-latency",
        }
    }
}

/// How a call's tokens choose their experts.
#[derive(Clone, Debug, PartialEq)]
pub enum Routing {
    /// Distinct experts, uniform.
    Uniform,
    /// Each pick from `hot` with probability `p` (skewed load).
    Hot { hot: Vec<usize>, p: f32 },
    /// Every token to this one expert only (the other entries -1).
    OneExpert(usize),
    /// No token picks an expert of this rank (it receives nothing).
    Starve(usize),
}

/// One normal-mode call: a fresh dispatch + combine, optionally followed by a cached dispatch
/// + combine on its handle.
#[derive(Clone, Debug, PartialEq)]
pub struct NormalCall {
    pub alignment: usize,
    /// `num_worst_tokens = (most rows any rank receives) + extra`.
    pub worst_extra: Option<usize>,
    /// Combine with weights.
    pub weights: bool,
    /// Pass the layout from `get_dispatch_layout` (else the buffer computes it).
    pub pass_layout: bool,
    /// After the fresh step, a cached dispatch (new token values, same routing) and its
    /// combine; `Some(true)`: with `topk_idx` and (new) weights, `Some(false)`: `x` only.
    pub cached: Option<bool>,
    /// The whole call this many times back to back (a benchmark's loop), each checked.
    pub repeat: usize,
}

/// One low-latency call: a dispatch (two with `double`) and a combine.
#[derive(Clone, Debug, PartialEq)]
pub struct LlCall {
    pub fp8: bool,
    pub round_scale: bool,
    pub hook_dispatch: bool,
    pub hook_combine: bool,
    /// Dispatch inputs A, then inputs B, and combine B's (DeepEP's test dispatches twice
    /// before some combines).
    pub double: bool,
    /// With `double`: both dispatches hooked, A's hook completed after B's send.
    pub overlap: bool,
    /// Combine with some more top-k entries masked (-1) than the dispatch had.
    pub combine_mask: bool,
    /// `clean_low_latency_buffer` before this call.
    pub clean_before: bool,
    /// A second combine on the same handle (DeepEP's test combines each dispatch twice).
    pub combine_twice: bool,
    /// The whole call this many times back to back (a benchmark's loop), each checked.
    pub repeat: usize,
}

#[derive(Clone, Debug, PartialEq)]
pub enum CallKind {
    Normal(NormalCall),
    Ll(LlCall),
}

/// One call on a shape's buffer.
#[derive(Clone, Debug, PartialEq)]
pub struct CallSpec {
    /// Tokens of each rank.
    pub tokens: Vec<usize>,
    pub routing: Routing,
    /// Probability that a top-k entry is -1.
    pub mask: f32,
    pub seed: u64,
    pub kind: CallKind,
}

/// One buffer shape and the calls made on it.
#[derive(Clone, Debug, PartialEq)]
pub struct ShapeSpec {
    pub hidden: usize,
    pub topk: usize,
    pub experts: usize,
    /// The config's dispatch dtype (normal mode; the GPU's low-latency buffers too).
    pub fp8: bool,
    /// Normal mode queue shape (`None`: the backend's default).
    pub chunk_tokens: Option<usize>,
    pub slots_per_peer: Option<usize>,
    /// Low-latency capacity (tokens per rank).
    pub max_tokens: usize,
    /// Normal mode, host backend, 2 or more nodes: DeepEP's hierarchy (`ep::hier::HierBuffer`)
    /// instead of direct sends; its combine is checked against the node-grouped sum.
    pub hier: bool,
    pub calls: Vec<CallSpec>,
}

/// A whole case: everything is fixed by `(seed, index)`.
#[derive(Clone, Debug, PartialEq)]
pub struct CaseSpec {
    pub index: usize,
    pub seed: u64,
    pub backend: VerifyBackend,
    pub mode: Mode,
    pub procs: bool,
    pub provider: &'static str,
    /// Host backend, normal mode, split: a node's ranks over this provider.
    pub intranode: Option<&'static str>,
    pub num_ranks: usize,
    pub ranks_per_node: usize,
    /// Host backend: `FEP_MR_MAX_BYTES` for the case, so buffers are registered (and their
    /// slots placed) in many chunks; `None`: the default (1 GiB).
    pub mr_max_bytes: Option<u64>,
    /// Host backend: command ring entries (`BufferOptions::ring_capacity`; small rings make
    /// every step wait for ring space); `None`: the default.
    pub ring_capacity: Option<u32>,
    /// Host backend, normal mode, split: writes to other nodes capped at this many GB/s
    /// (`BufferOptions::emulate_network_gbps`: backpressure as EAGAIN).
    pub emulate_gbps: Option<f64>,
    pub shapes: Vec<ShapeSpec>,
}

impl CaseSpec {
    /// Ranks of more than one node: the internode path.
    pub fn split(&self) -> bool {
        self.ranks_per_node < self.num_ranks
    }

    /// One line: what the case runs.
    pub fn describe(&self) -> String {
        let mut s = format!(
            "case {}: {} {} ranks as {} ({} per node{}), {}{}",
            self.index,
            self.mode.name(),
            self.num_ranks,
            if self.procs { "processes" } else { "threads" },
            self.ranks_per_node,
            self.intranode.map(|p| format!(", intranode {p}")).unwrap_or_default(),
            self.provider,
            self.mr_max_bytes.map(|b| format!(", FEP_MR_MAX_BYTES={b}")).unwrap_or_default()
                + &self.ring_capacity.map(|c| format!(", ring {c}")).unwrap_or_default()
                + &self.emulate_gbps.map(|g| format!(", network {g} GB/s")).unwrap_or_default()
        );
        for (i, sh) in self.shapes.iter().enumerate() {
            s += &format!(
                "; shape {i}: {}hidden {} top-{} of {} experts{}{}",
                if sh.hier { "hierarchy, " } else { "" },
                sh.hidden,
                sh.topk,
                sh.experts,
                if sh.fp8 { " fp8" } else { " bf16" },
                match self.mode {
                    Mode::Normal => format!(
                        ", chunk {} x {} slots",
                        sh.chunk_tokens.map_or("default".into(), |c| c.to_string()),
                        sh.slots_per_peer.map_or("default".into(), |c| c.to_string())
                    ),
                    Mode::LowLatency => format!(", max {} tokens", sh.max_tokens),
                }
            );
            for (j, c) in sh.calls.iter().enumerate() {
                let r = match &c.routing {
                    Routing::Uniform => "uniform".to_string(),
                    Routing::Hot { hot, p } => format!("hot {hot:?} p {p:.2}"),
                    Routing::OneExpert(g) => format!("all to expert {g}"),
                    Routing::Starve(v) => format!("rank {v} starved"),
                };
                s += &format!(" | call {j}: tokens {:?}, {r}, mask {:.2}", c.tokens, c.mask);
                match &c.kind {
                    CallKind::Normal(n) => {
                        s += &format!(", align {}", n.alignment);
                        if let Some(w) = n.worst_extra {
                            s += &format!(", worst +{w}");
                        }
                        s += if n.weights { ", weights" } else { ", no weights" };
                        if n.pass_layout {
                            s += ", layout";
                        }
                        match n.cached {
                            Some(true) => s += ", cached (with top-k)",
                            Some(false) => s += ", cached (x only)",
                            None => {}
                        }
                        if n.repeat > 1 {
                            s += &format!(", {} times", n.repeat);
                        }
                    }
                    CallKind::Ll(l) => {
                        s += if l.fp8 { ", fp8" } else { ", bf16" };
                        if l.round_scale {
                            s += " round-scale";
                        }
                        s += &format!(
                            ", hook {}/{}",
                            if l.hook_dispatch { "d" } else { "-" },
                            if l.hook_combine { "c" } else { "-" }
                        );
                        if l.double {
                            s += if l.overlap {
                                ", two dispatches (overlapped)"
                            } else {
                                ", two dispatches"
                            };
                        }
                        if l.combine_mask {
                            s += ", combine mask";
                        }
                        if l.clean_before {
                            s += ", clean first";
                        }
                        if l.combine_twice {
                            s += ", combine twice";
                        }
                        if l.repeat > 1 {
                            s += &format!(", {} times", l.repeat);
                        }
                    }
                }
            }
        }
        s
    }
}

fn mix(a: u64, b: u64) -> u64 {
    let mut r = SplitMix64(a ^ b.wrapping_mul(0xD6E8_FEB8_6659_FD93));
    r.next_u64()
}

fn chance(rng: &mut SplitMix64, p: f32) -> bool {
    rng.unit_f32() < p
}

fn pick<T: Copy>(rng: &mut SplitMix64, v: &[T]) -> T {
    v[rng.below(v.len() as u64) as usize]
}

/// Uniform in `lo..=hi`.
fn between(rng: &mut SplitMix64, lo: usize, hi: usize) -> usize {
    lo + rng.below((hi - lo + 1) as u64) as usize
}

/// Elements of one rank's normal-mode tokens (`tokens x hidden`) a call may hold: keeps a case
/// within the 2-core CI machine's time (debug builds included) while every hidden size runs.
const NORMAL_ELEMS: usize = 1 << 19;
/// Most normal-mode tokens per rank in one call.
const NORMAL_MAX_TOKENS: usize = 4096;
/// Elements of one rank's low-latency receive buffer (`experts x max_tokens x hidden`) on the
/// host backend: every rank's `[L, R * max_tokens, hidden]` output, its reference and its
/// registered sets are this size, all ranks of a case in one process.
const LL_ELEMS_HOST: usize = 1 << 21;
/// The same on the GPU backend (device memory; the host still builds the reference).
const LL_ELEMS_GPU: usize = 1 << 24;
/// Calls repeated back to back move at most this many elements (all ranks' tokens x hidden).
const REPEAT_ELEMS: usize = 1 << 18;
/// Most low-latency tokens per rank (DeepEP's 128 and beyond).
const LL_MAX_TOKENS: usize = 256;
/// The GPU normal kernels' top-k limit (`ep::normal_gpu`); the host backend takes up to
/// `plan::MAX_TOPK` = 256.
pub const GPU_MAX_TOPK: usize = 32;
/// The GPU normal kernels' rank limit (`FEP_NORMAL_MAX_RANKS`).
const GPU_MAX_RANKS: usize = 8;

/// Draws case `index` of `seed` for `backend`; `launch` forces threads or processes.
pub fn draw_case(seed: u64, index: usize, backend: VerifyBackend, launch: Launch) -> CaseSpec {
    let case_seed = mix(seed, index as u64 + 1);
    let mut rng = SplitMix64(case_seed);
    // Stratified so that every (mode, provider) pair is drawn equally often.
    let mode = if index % 2 == 0 { Mode::Normal } else { Mode::LowLatency };
    let provider = PROVIDERS[(index / 2) % PROVIDERS.len()];
    let procs = match launch {
        Launch::Threads => false,
        Launch::Procs => true,
        Launch::Auto => backend == VerifyBackend::Host && chance(&mut rng, 0.25),
    };
    let num_ranks = if procs {
        pick(&mut rng, &[2, 2, 3, 4, 4, 4])
    } else {
        pick(&mut rng, &[1, 2, 2, 3, 4, 4, 5, 6, 8])
    };
    let num_ranks = match backend {
        VerifyBackend::Gpu => num_ranks.min(GPU_MAX_RANKS),
        VerifyBackend::Host => num_ranks,
    };
    let ranks_per_node = if num_ranks > 1 && chance(&mut rng, 0.5) {
        let divs: Vec<usize> = (1..num_ranks).filter(|d| num_ranks % d == 0).collect();
        pick(&mut rng, &divs)
    } else {
        num_ranks
    };
    // Low latency across nodes as processes, with a provider that cannot register GPU memory
    // (every provider of this test machine: no FI_HMEM), keeps its buffer in host memory, which
    // CUDA IPC cannot share with another process of the node: the Buffer refuses that at
    // connect with an error saying so (on EFA, with FI_HMEM, the buffer is device memory and
    // the split runs). Such cases are drawn with one process per node instead.
    let ranks_per_node = if backend == VerifyBackend::Gpu
        && procs
        && mode == Mode::LowLatency
        && ranks_per_node < num_ranks
    {
        1
    } else {
        ranks_per_node
    };
    let intranode = (backend == VerifyBackend::Host
        && mode == Mode::Normal
        && ranks_per_node < num_ranks
        && provider != "shm"
        && chance(&mut rng, 0.5))
    .then_some("shm");
    let n_shapes = pick(&mut rng, &[1, 1, 1, 2, 2, 3]);
    let shapes: Vec<ShapeSpec> = (0..n_shapes)
        .map(|_| draw_shape(&mut rng, backend, mode, num_ranks, ranks_per_node))
        .collect();
    let host = backend == VerifyBackend::Host;
    let mr_max_bytes = (host && chance(&mut rng, 0.3))
        .then(|| {
            largest_unit(mode, num_ranks, &shapes).map(|u| u.next_power_of_two() << rng.below(3))
        })
        .flatten();
    let ring_capacity = (host && chance(&mut rng, 0.2)).then(|| pick(&mut rng, &[1, 2, 3, 8, 64]));
    let emulate_gbps =
        (host && mode == Mode::Normal && ranks_per_node < num_ranks && chance(&mut rng, 0.2))
            .then(|| pick(&mut rng, &[1.0, 4.0]));
    CaseSpec {
        index,
        seed,
        backend,
        mode,
        procs,
        provider,
        intranode,
        num_ranks,
        ranks_per_node,
        mr_max_bytes,
        ring_capacity,
        emulate_gbps,
        shapes,
    }
}

/// The largest unit one write fills (a normal-mode slot, a low-latency message unit), over the
/// shapes: the smallest registration chunk that holds every unit.
fn largest_unit(mode: Mode, r: usize, shapes: &[ShapeSpec]) -> Option<u64> {
    let mut max = 0u64;
    for sh in shapes {
        let dtype = if sh.fp8 { DispatchDtype::Fp8E4m3 } else { DispatchDtype::Bf16 };
        // Every host Buffer builds its normal-mode buffers; the low-latency lane comes on top;
        // the hierarchy's node stage carries 128 more channels.
        let hidden = sh.hidden + if sh.hier { fabric_ep::protocol::hier::META_CHANNELS } else { 0 };
        let slot = fabric_ep::protocol::plan::NormalLayout::from_parts(
            r as u64,
            sh.experts as u64,
            hidden as u64,
            sh.topk as u64,
            dtype,
            sh.chunk_tokens.unwrap_or(fabric_ep::protocol::config::DEFAULT_CHUNK_TOKENS) as u64,
            sh.slots_per_peer.unwrap_or(fabric_ep::protocol::config::DEFAULT_SLOTS_PER_PEER) as u64,
        )
        .ok()?
        .slot_bytes;
        max = max.max(slot);
        if mode == Mode::LowLatency {
            let unit = fabric_ep::protocol::plan::LlLayout::from_parts(
                r as u64,
                sh.experts as u64,
                sh.hidden as u64,
                DispatchDtype::Bf16,
                sh.max_tokens as u64,
            )
            .ok()?
            .unit_bytes;
            max = max.max(unit);
        }
    }
    Some(max.max(4096))
}

fn draw_hidden(rng: &mut SplitMix64) -> usize {
    match rng.below(10) {
        0..=2 => pick(rng, &[2560, 5120, 6144, 7168]),
        3..=4 => 128 * between(rng, 1, 4),
        _ => 128 * between(rng, 1, 64),
    }
}

fn draw_shape(
    rng: &mut SplitMix64,
    backend: VerifyBackend,
    mode: Mode,
    r: usize,
    rpn: usize,
) -> ShapeSpec {
    let hidden = draw_hidden(rng);
    // Experts: any multiple of the rank count in 8..=288, small ones more often (cost).
    let (lo, hi) = (8usize.div_ceil(r), 288 / r);
    let cap = match rng.below(10) {
        0..=3 => (32 / r).max(lo),
        4..=7 => (128 / r).max(lo),
        _ => hi,
    };
    let experts = r * between(rng, lo, cap.min(hi));
    // Both backends at the GPU normal kernels' limit (the host takes more: plan::MAX_TOPK).
    let topk_cap = GPU_MAX_TOPK.min(experts);
    let topk = if chance(rng, 0.85) {
        between(rng, 1, 9.min(topk_cap))
    } else {
        between(rng, 1, topk_cap)
    };
    let fp8 = chance(rng, 0.5);
    let (chunk_tokens, slots_per_peer) = match backend {
        VerifyBackend::Host => {
            (Some(pick(rng, &[1, 2, 3, 7, 16, 64, 64, 128])), Some(between(rng, 1, 4)))
        }
        // The GPU path at its defaults (what jobs run), sometimes a larger chunk.
        VerifyBackend::Gpu => (chance(rng, 0.25).then_some(32), None),
    };
    let budget = match backend {
        VerifyBackend::Host => LL_ELEMS_HOST,
        VerifyBackend::Gpu => LL_ELEMS_GPU,
    };
    let ll_cap = (budget / (experts * hidden)).clamp(1, LL_MAX_TOKENS);
    let max_tokens = match rng.below(4) {
        0 => ll_cap,
        1 => between(rng, 1, ll_cap.min(8)),
        _ => between(rng, 1, ll_cap),
    };
    let n_calls = pick(rng, &[1, 2, 2, 3]);
    // At most 256 chunks per peer queue and call: with 1-token chunks over udp;ofi_rxd on an
    // oversubscribed CPU, 4096 credit round trips took 265 s (waits over 20 s each, no stall).
    let chunk_cap = chunk_tokens.unwrap_or(fabric_ep::protocol::config::DEFAULT_CHUNK_TOKENS) * 256;
    let normal_cap = (NORMAL_ELEMS / hidden).clamp(1, NORMAL_MAX_TOKENS).min(chunk_cap);
    let calls = (0..n_calls)
        .map(|_| {
            let cap = match mode {
                Mode::Normal => normal_cap,
                Mode::LowLatency => max_tokens,
            };
            draw_call(rng, backend, mode, r, hidden, experts, fp8, cap)
        })
        .collect();
    // The hierarchy's node stage holds the experts of one node: `experts / nodes` of them.
    // Its stages are Buffers whose configs need top-k within their experts (a limit of
    // `ep::hier`: `num_topk <= num_experts / nodes`).
    let hier = mode == Mode::Normal && rpn < r && topk <= experts / (r / rpn) && chance(rng, 0.4);
    ShapeSpec { hidden, topk, experts, fp8, chunk_tokens, slots_per_peer, max_tokens, hier, calls }
}

#[allow(clippy::too_many_arguments)]
fn draw_call(
    rng: &mut SplitMix64,
    backend: VerifyBackend,
    mode: Mode,
    r: usize,
    hidden: usize,
    experts: usize,
    shape_fp8: bool,
    cap: usize,
) -> CallSpec {
    let unequal = chance(rng, 0.3);
    let big = rng.below(r as u64) as usize;
    let tokens: Vec<usize> = (0..r)
        .map(|i| {
            if unequal {
                return if i == big { cap } else { between(rng, 0, (cap / 16).max(1)) };
            }
            match rng.below(20) {
                0..=2 => 0,
                3..=4 => cap,
                5 => 1,
                _ => between(rng, 0, cap),
            }
        })
        .collect();
    let routing = match rng.below(10) {
        0..=3 => Routing::Uniform,
        4..=5 => {
            let n = between(rng, 1, 4.min(experts));
            let hot = (0..n).map(|_| rng.below(experts as u64) as usize).collect();
            Routing::Hot { hot, p: 0.5 + 0.5 * rng.unit_f32() }
        }
        6 => Routing::OneExpert(rng.below(experts as u64) as usize),
        _ if r > 1 => Routing::Starve(rng.below(r as u64) as usize),
        _ => Routing::Uniform,
    };
    let mask = if chance(rng, 0.4) { 0.0 } else { 0.5 * rng.unit_f32() };
    let seed = rng.next_u64();
    // Benchmark-like loops on small calls only (a case's cost stays bounded).
    let small = tokens.iter().sum::<usize>() * hidden <= REPEAT_ELEMS;
    let kind = match mode {
        Mode::Normal => CallKind::Normal(NormalCall {
            alignment: pick(rng, &[1, 1, 4, 128]),
            worst_extra: chance(rng, 0.3).then(|| pick(rng, &[0, 0, 1, 5, 64])),
            weights: chance(rng, 0.7),
            pass_layout: chance(rng, 0.5),
            cached: chance(rng, 0.4).then(|| chance(rng, 0.5)),
            repeat: if small && chance(rng, 0.15) { between(rng, 2, 12) } else { 1 },
        }),
        Mode::LowLatency => {
            // The GPU's low-latency buffers are sized for the config's dtype; the host's per
            // call.
            let fp8 = match backend {
                VerifyBackend::Host => chance(rng, 0.5),
                VerifyBackend::Gpu => shape_fp8,
            };
            let double = chance(rng, 0.25);
            CallKind::Ll(LlCall {
                fp8,
                round_scale: backend == VerifyBackend::Host && fp8 && chance(rng, 0.3),
                hook_dispatch: chance(rng, 0.5),
                hook_combine: chance(rng, 0.5),
                double,
                overlap: double && chance(rng, 0.5),
                combine_mask: chance(rng, 0.2),
                clean_before: chance(rng, 0.15),
                combine_twice: chance(rng, 0.2),
                repeat: if small && chance(rng, 0.15) { between(rng, 2, 24) } else { 1 },
            })
        }
    };
    CallSpec { tokens, routing, mask, seed, kind }
}

// ---------------------------------------------------------------------------------------------
// Inputs and references
// ---------------------------------------------------------------------------------------------

/// `k` distinct experts for one token under `routing`, then each entry -1 with probability
/// `mask`.
fn draw_topk(
    rng: &mut SplitMix64,
    k: usize,
    experts: usize,
    local: usize,
    routing: &Routing,
    mask: f32,
    out: &mut Vec<i64>,
) {
    let start = out.len();
    match routing {
        Routing::OneExpert(g) => {
            let at = rng.below(k as u64) as usize;
            out.extend((0..k).map(|j| if j == at { *g as i64 } else { -1 }));
            return;
        }
        Routing::Uniform | Routing::Hot { .. } | Routing::Starve(_) => {}
    }
    let excluded = |g: usize| matches!(routing, Routing::Starve(v) if g / local == *v);
    let allowed = experts - if matches!(routing, Routing::Starve(_)) { local } else { 0 };
    for j in 0..k {
        if j >= allowed {
            out.push(-1);
            continue;
        }
        let taken = |g: usize, out: &Vec<i64>| out[start..].contains(&(g as i64));
        let mut g = None;
        if let Routing::Hot { hot, p } = routing {
            if chance(rng, *p) {
                let c = hot[rng.below(hot.len() as u64) as usize];
                if !taken(c, out) {
                    g = Some(c);
                }
            }
        }
        let g = match g {
            Some(g) => g,
            None => {
                let mut found = None;
                for _ in 0..64 {
                    let c = rng.below(experts as u64) as usize;
                    if !excluded(c) && !taken(c, out) {
                        found = Some(c);
                        break;
                    }
                }
                // Dense picks: the first free expert after a random start.
                found.unwrap_or_else(|| {
                    let s = rng.below(experts as u64) as usize;
                    (0..experts)
                        .map(|i| (s + i) % experts)
                        .find(|&c| !excluded(c) && !taken(c, out))
                        .unwrap_or(0)
                })
            }
        };
        out.push(g as i64);
    }
    for e in &mut out[start..] {
        if mask > 0.0 && chance(rng, mask) {
            *e = -1;
        }
    }
}

/// One rank's inputs of one call.
#[derive(Clone, Debug)]
pub struct RankIn {
    pub x: Vec<u16>,
    /// e4m3 bytes and scales of `x` (normal mode, fp8 configs).
    pub x_fp8: Option<(Vec<u8>, Vec<f32>)>,
    pub topk_idx: Vec<i64>,
    pub topk_weights: Vec<f32>,
}

impl RankIn {
    pub fn tokens(&self) -> Tokens<'_> {
        match &self.x_fp8 {
            Some((x, s)) => Tokens::Fp8 { x, scales: s },
            None => Tokens::Bf16(&self.x),
        }
    }
}

fn bf16_values(rng: &mut SplitMix64, n: usize, scale: f32) -> Vec<u16> {
    (0..n).map(|_| f32_to_bf16((rng.unit_f32() - 0.5) * scale)).collect()
}

/// Every rank's inputs of call `c`: `salt` draws other token values (the cached dispatch's) for
/// the same routing.
fn call_inputs(sh: &ShapeSpec, c: &CallSpec, salt: u64, fp8_x: bool) -> Result<Vec<RankIn>> {
    let (h, k, e) = (sh.hidden, sh.topk, sh.experts);
    let r = c.tokens.len();
    let local = e / r;
    (0..r)
        .map(|rank| {
            let t = c.tokens[rank];
            let mut rr = SplitMix64(mix(c.seed, rank as u64 + 1));
            let mut topk_idx = Vec::with_capacity(t * k);
            for _ in 0..t {
                draw_topk(&mut rr, k, e, local, &c.routing, c.mask, &mut topk_idx);
            }
            let mut rx = SplitMix64(mix(c.seed ^ salt, 0x5eed + rank as u64));
            // A few rows far from the others' magnitude (fp8 scales per 128 channels).
            let mut x = bf16_values(&mut rx, t * h, 4.0);
            for tok in 0..t {
                if rx.below(16) == 0 {
                    for v in &mut x[tok * h..(tok + 1) * h] {
                        *v = f32_to_bf16(bf16_to_f32(*v) * 300.0);
                    }
                }
            }
            let topk_weights = (0..t * k).map(|_| rx.unit_f32() + 0.01).collect();
            let x_fp8 = if fp8_x { Some(quantize_bf16(&x, h, false)?) } else { None };
            Ok(RankIn { x, x_fp8, topk_idx, topk_weights })
        })
        .collect()
}

/// The bf16 value a rank's expert returns for a received row: the row itself (dequantized for
/// fp8) scaled by a factor of the receiving rank, so answers from different ranks differ.
fn expert_output(v: f32, rank: usize) -> u16 {
    f32_to_bf16(v * (1.0 + 0.25 * rank as f32) - 0.125 * rank as f32)
}

fn rows_f32(x: &OwnedTokens, hidden: usize, row: usize, out: &mut [f32]) -> Result<()> {
    match x {
        OwnedTokens::Bf16(v) => {
            for (o, &b) in out.iter_mut().zip(&v[row * hidden..(row + 1) * hidden]) {
                *o = bf16_to_f32(b);
            }
            Ok(())
        }
        OwnedTokens::Fp8 { x, scales } => {
            let g = hidden / 128;
            dequantize_row(
                &x[row * hidden..(row + 1) * hidden],
                &scales[row * g..(row + 1) * g],
                out,
            )
        }
    }
}

/// The reference of one normal-mode step (fresh or cached).
#[derive(Debug)]
pub struct NormalStepRef {
    pub inputs: Vec<RankIn>,
    pub want_d: Vec<refm::NormalDispatchOut>,
    /// Combine inputs `[rows, hidden]` and weights per rank.
    pub y: Vec<Vec<u16>>,
    pub yw: Vec<Option<Vec<f32>>>,
    pub want_c: Vec<refm::NormalCombineOut>,
}

/// The reference of one normal-mode call.
#[derive(Debug)]
pub struct NormalCallRef {
    pub worst: Option<usize>,
    pub fresh: NormalStepRef,
    pub cached: Option<NormalStepRef>,
}

/// The reference of one low-latency dispatch + combine.
#[derive(Debug)]
pub struct LlStepRef {
    pub inputs: Vec<RankIn>,
    pub want_d: Vec<refm::LlDispatchOut>,
}

/// The reference of one low-latency call.
#[derive(Debug)]
pub struct LlCallRef {
    /// The first dispatch of a `double` call (checked, not combined).
    pub first: Option<LlStepRef>,
    pub last: LlStepRef,
    /// Combine inputs per rank: expert outputs `[L, S, hidden]`, top-k (maybe masked more) and
    /// weights.
    pub y: Vec<Vec<u16>>,
    pub combine_topk: Vec<Vec<i64>>,
    pub want_c: Vec<Vec<u16>>,
}

#[derive(Debug)]
pub enum CallRef {
    Normal(NormalCallRef),
    Ll(LlCallRef),
}

fn normal_params(sh: &ShapeSpec, n: &NormalCall, worst: Option<usize>) -> refm::NormalParams {
    refm::NormalParams {
        num_experts: sh.experts,
        hidden: sh.hidden,
        num_topk: sh.topk,
        expert_alignment: n.alignment,
        num_worst_tokens: worst,
    }
}

/// Tokens rank `d` receives (rows), from the routing alone.
fn recv_rows(inputs: &[RankIn], k: usize, local: usize, d: usize) -> usize {
    inputs
        .iter()
        .map(|i| {
            i.topk_idx
                .chunks(k.max(1))
                .filter(|row| row.iter().any(|&g| g >= 0 && g as usize / local == d))
                .count()
        })
        .sum()
}

fn normal_step_ref(
    sh: &ShapeSpec,
    n: &NormalCall,
    worst: Option<usize>,
    inputs: Vec<RankIn>,
    salt: u64,
    group: usize,
) -> Result<NormalStepRef> {
    let p = normal_params(sh, n, worst);
    let rin: Vec<refm::NormalRankInput> = inputs
        .iter()
        .map(|i| refm::NormalRankInput {
            x: i.tokens(),
            topk_idx: &i.topk_idx,
            topk_weights: &i.topk_weights,
        })
        .collect();
    let want_d = refm::normal_dispatch(&p, &rin)?;
    let (h, k) = (sh.hidden, sh.topk);
    let mut y = Vec::with_capacity(want_d.len());
    let mut yw = Vec::with_capacity(want_d.len());
    let mut row = vec![0f32; h];
    for (rank, d) in want_d.iter().enumerate() {
        let rows = d.recv_topk_idx.len() / k;
        // Padding rows (num_worst_tokens) hold values the combine must ignore.
        let mut v = vec![f32_to_bf16(3.0); rows * h];
        for i in 0..d.num_recv_tokens {
            rows_f32(&d.recv_x, h, i, &mut row)?;
            for (o, &a) in v[i * h..(i + 1) * h].iter_mut().zip(&row) {
                *o = expert_output(a, rank);
            }
        }
        y.push(v);
        let mut rw = SplitMix64(mix(salt, 0xc0de + rank as u64));
        yw.push(n.weights.then(|| (0..rows * k).map(|_| rw.unit_f32() - 0.25).collect()));
    }
    let cin: Vec<refm::NormalCombineInput> = y
        .iter()
        .zip(&yw)
        .map(|(x, w)| refm::NormalCombineInput { x, topk_weights: w.as_deref() })
        .collect();
    // The hierarchy's gateways round each node's partial sum to bf16 (`group` ranks a node).
    let want_c = refm::normal_combine_grouped(&p, &want_d, &cin, group)?;
    Ok(NormalStepRef { inputs, want_d, y, yw, want_c })
}

fn normal_call_ref(
    sh: &ShapeSpec,
    c: &CallSpec,
    n: &NormalCall,
    rpn: usize,
) -> Result<NormalCallRef> {
    let group = if sh.hier { rpn } else { c.tokens.len() };
    let inputs = call_inputs(sh, c, 0, sh.fp8)?;
    let local = sh.experts / c.tokens.len();
    let worst = n.worst_extra.map(|extra| {
        (0..c.tokens.len()).map(|d| recv_rows(&inputs, sh.topk, local, d)).max().unwrap_or(0)
            + extra
    });
    let fresh = normal_step_ref(sh, n, worst, inputs, c.seed, group)?;
    let cached = match n.cached {
        None => None,
        Some(_) => {
            // New token values and weights, the same routing.
            let mut again = call_inputs(sh, c, 0xcac4e, sh.fp8)?;
            for (a, f) in again.iter_mut().zip(&fresh.inputs) {
                a.topk_idx.clone_from(&f.topk_idx);
            }
            Some(normal_step_ref(sh, n, worst, again, c.seed ^ 0xcac4e, group)?)
        }
    };
    Ok(NormalCallRef { worst, fresh, cached })
}

fn ll_params(sh: &ShapeSpec, l: &LlCall) -> refm::LlParams {
    refm::LlParams {
        num_experts: sh.experts,
        hidden: sh.hidden,
        num_topk: sh.topk,
        max_tokens_per_rank: sh.max_tokens,
        use_fp8: l.fp8,
        round_scale: l.round_scale,
    }
}

fn ll_step_ref(sh: &ShapeSpec, l: &LlCall, inputs: Vec<RankIn>) -> Result<LlStepRef> {
    let rin: Vec<refm::LlRankInput> =
        inputs.iter().map(|i| refm::LlRankInput { x: &i.x, topk_idx: &i.topk_idx }).collect();
    let want_d = refm::ll_dispatch(&ll_params(sh, l), &rin)?;
    Ok(LlStepRef { inputs, want_d })
}

fn ll_call_ref(sh: &ShapeSpec, c: &CallSpec, l: &LlCall) -> Result<LlCallRef> {
    let first = if l.double {
        let mut c2 = c.clone();
        c2.seed = mix(c.seed, 0xf125);
        Some(ll_step_ref(sh, l, call_inputs(sh, &c2, 0, false)?)?)
    } else {
        None
    };
    let last = ll_step_ref(sh, l, call_inputs(sh, c, 0, false)?)?;
    let (h, k) = (sh.hidden, sh.topk);
    let r = c.tokens.len();
    let l_count = sh.experts / r;
    let s_rows = r * sh.max_tokens;
    let mut y = Vec::with_capacity(r);
    let mut row = vec![0f32; h];
    for (rank, d) in last.want_d.iter().enumerate() {
        // Rows past the counts hold values the combine must ignore.
        let mut v = vec![f32_to_bf16(-5.0); l_count * s_rows * h];
        for (e, &cnt) in d.recv_count.iter().enumerate() {
            for i in 0..cnt as usize {
                let o = e * s_rows + i;
                rows_f32(&d.recv_x, h, o, &mut row)?;
                for (dst, &a) in v[o * h..(o + 1) * h].iter_mut().zip(&row) {
                    *dst = expert_output(a, rank);
                }
            }
        }
        y.push(v);
    }
    let combine_topk: Vec<Vec<i64>> = last
        .inputs
        .iter()
        .enumerate()
        .map(|(rank, i)| {
            let mut m = SplitMix64(mix(c.seed, 0x3a5c + rank as u64));
            i.topk_idx
                .iter()
                .map(|&g| if l.combine_mask && m.below(5) == 0 { -1 } else { g })
                .collect()
        })
        .collect();
    let cin: Vec<refm::LlCombineInput> = (0..r)
        .map(|rank| refm::LlCombineInput {
            x: &y[rank],
            topk_idx: &combine_topk[rank],
            topk_weights: &last.inputs[rank].topk_weights,
        })
        .collect();
    let want_c = refm::ll_combine(&ll_params(sh, l), &last.want_d, &cin)?;
    let _ = k;
    Ok(LlCallRef { first, last, y, combine_topk, want_c })
}

/// The references of a case, built on first use (ranks as threads share one; a process builds
/// its own): `[shape][call]`.
pub struct CaseRefs {
    spec: CaseSpec,
    calls: Vec<Vec<OnceLock<std::result::Result<CallRef, String>>>>,
    /// Calls completed by the ranks sharing this (ranks as threads): the matrix's sign of
    /// progress, so a slow case is not taken for a stuck one.
    progress: std::sync::atomic::AtomicU64,
}

impl CaseRefs {
    pub fn new(spec: &CaseSpec) -> Self {
        let calls =
            spec.shapes.iter().map(|s| s.calls.iter().map(|_| OnceLock::new()).collect()).collect();
        CaseRefs { spec: spec.clone(), calls, progress: Default::default() }
    }

    /// A rank finished one call.
    pub fn step_done(&self) {
        self.progress.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    fn progress(&self) -> u64 {
        self.progress.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The reference of call `c` of shape `s` (an error if the reference itself refused it).
    pub fn get(&self, s: usize, c: usize) -> Result<&CallRef> {
        let cell = &self.calls[s][c];
        let v = cell.get_or_init(|| {
            let sh = &self.spec.shapes[s];
            let call = &sh.calls[c];
            let r = match &call.kind {
                CallKind::Normal(n) => {
                    normal_call_ref(sh, call, n, self.spec.ranks_per_node).map(CallRef::Normal)
                }
                CallKind::Ll(l) => ll_call_ref(sh, call, l).map(CallRef::Ll),
            };
            r.map_err(|e| e.to_string())
        });
        v.as_ref().map_err(|e| Error::Other(format!("reference of shape {s} call {c}: {e}")))
    }
}

// ---------------------------------------------------------------------------------------------
// Comparison
// ---------------------------------------------------------------------------------------------

/// Whether a combine output value is within fp32 accumulation tolerance of the reference's:
/// the same fp32 terms summed in another order differ by a few units of the last fp32 place of
/// the largest partial sum, and rounding to bf16 can then land one bf16 step away; `scale` is
/// the largest magnitude in the row (a bound on the partial sums' size).
pub fn close_bf16(got: u16, want: u16, scale: f32) -> bool {
    if got == want {
        return true;
    }
    let (g, w) = (bf16_to_f32(got), bf16_to_f32(want));
    if !g.is_finite() || !w.is_finite() {
        return false;
    }
    let ulp = |v: f32| (v.abs().max(f32::MIN_POSITIVE)) * (1.0 / 128.0);
    (g - w).abs() <= ulp(w).max(ulp(g)) + scale * 1e-5
}

/// The first difference between two bf16 combine outputs `[T, hidden]`, within tolerance;
/// `exact` is cleared when any value differs at all.
fn combine_diff(got: &[u16], want: &[u16], hidden: usize, exact: &mut bool) -> Option<String> {
    if got.len() != want.len() {
        return Some(format!("length {} (want {})", got.len(), want.len()));
    }
    if got == want {
        return None;
    }
    *exact = false;
    for (t, (g, w)) in got.chunks(hidden).zip(want.chunks(hidden)).enumerate() {
        let scale = w.iter().map(|&v| bf16_to_f32(v).abs()).fold(0f32, f32::max);
        for (c, (&a, &b)) in g.iter().zip(w).enumerate() {
            if !close_bf16(a, b, scale) {
                return Some(format!(
                    "token {t} channel {c}: {} (want {})",
                    bf16_to_f32(a),
                    bf16_to_f32(b)
                ));
            }
        }
    }
    None
}

fn weights_diff(got: &[f32], want: &[f32], exact: &mut bool) -> Option<String> {
    if got.len() != want.len() {
        return Some(format!("length {} (want {})", got.len(), want.len()));
    }
    for (i, (&a, &b)) in got.iter().zip(want).enumerate() {
        if a.to_bits() != b.to_bits() {
            *exact = false;
            if (a - b).abs() > 1e-5 * (1.0 + b.abs()) {
                return Some(format!("entry {i}: {a} (want {b})"));
            }
        }
    }
    None
}

/// The first difference of a normal dispatch: names the field and the row (with its source).
pub(crate) fn normal_dispatch_diff(
    got: &NormalGot<'_>,
    want: &refm::NormalDispatchOut,
    hidden: usize,
    topk: usize,
) -> Option<String> {
    let src_of = |row: usize| -> String {
        match (want.recv_src_rank.get(row), want.recv_src_idx.get(row)) {
            (Some(s), Some(t)) => format!(" (source rank {s}, token {t})"),
            _ => " (padding)".into(),
        }
    };
    if got.num_recv_tokens != want.num_recv_tokens {
        return Some(format!(
            "num_recv_tokens {} (want {})",
            got.num_recv_tokens, want.num_recv_tokens
        ));
    }
    let prefix: Vec<usize> = got.rank_prefix.iter().map(|&v| v as usize).collect();
    if prefix != want.rank_prefix {
        return Some(format!("rank_prefix {prefix:?} (want {:?})", want.rank_prefix));
    }
    if got.per_expert != &want.num_recv_tokens_per_expert[..] {
        return Some(format!(
            "num_recv_tokens_per_expert {:?} (want {:?})",
            got.per_expert, want.num_recv_tokens_per_expert
        ));
    }
    let rows = want.recv_topk_idx.len() / topk;
    match (got.recv_x, &want.recv_x) {
        (GotTokens::Bf16(g), OwnedTokens::Bf16(w)) => {
            if g.len() != w.len() {
                return Some(format!("recv_x has {} rows (want {rows})", g.len() / hidden));
            }
            if let Some(r) = (0..rows)
                .find(|&r| g[r * hidden..(r + 1) * hidden] != w[r * hidden..(r + 1) * hidden])
            {
                return Some(format!("recv_x row {r}{}", src_of(r)));
            }
        }
        (GotTokens::Fp8 { x: g, scales: gs }, OwnedTokens::Fp8 { x: w, scales: ws }) => {
            let gr = hidden / 128;
            if g.len() != w.len() || gs.len() != ws.len() {
                return Some(format!("recv_x has {} rows (want {rows})", g.len() / hidden));
            }
            for r in 0..rows {
                if g[r * hidden..(r + 1) * hidden] != w[r * hidden..(r + 1) * hidden] {
                    return Some(format!("recv_x (e4m3) row {r}{}", src_of(r)));
                }
                let (a, b) = (&gs[r * gr..(r + 1) * gr], &ws[r * gr..(r + 1) * gr]);
                if a.iter().zip(b).any(|(u, v)| u.to_bits() != v.to_bits()) {
                    return Some(format!("recv_x scales row {r}{}", src_of(r)));
                }
            }
        }
        _ => return Some("recv_x dtype".into()),
    }
    if let Some(ti) = got.recv_topk_idx {
        if ti.len() != want.recv_topk_idx.len() {
            return Some(format!(
                "recv_topk_idx length {} (want {})",
                ti.len(),
                want.recv_topk_idx.len()
            ));
        }
        if let Some(i) = (0..ti.len()).find(|&i| ti[i] != want.recv_topk_idx[i]) {
            return Some(format!(
                "recv_topk_idx row {} entry {}: {} (want {}){}",
                i / topk,
                i % topk,
                ti[i],
                want.recv_topk_idx[i],
                src_of(i / topk)
            ));
        }
    }
    if let Some(tw) = got.recv_topk_weights {
        if tw.len() != want.recv_topk_weights.len() {
            return Some(format!(
                "recv_topk_weights length {} (want {})",
                tw.len(),
                want.recv_topk_weights.len()
            ));
        }
        let w = &want.recv_topk_weights;
        if let Some(i) = (0..tw.len()).find(|&i| tw[i].to_bits() != w[i].to_bits()) {
            return Some(format!(
                "recv_topk_weights row {} entry {}{}",
                i / topk,
                i % topk,
                src_of(i / topk)
            ));
        }
    }
    let n = want.num_recv_tokens;
    if got.recv_src_idx.len() < n || got.recv_src_idx[..n] != want.recv_src_idx[..] {
        let r =
            (0..n).find(|&r| got.recv_src_idx.get(r) != Some(&want.recv_src_idx[r])).unwrap_or(0);
        return Some(format!("source index of row {r}{}", src_of(r)));
    }
    None
}

/// Received tokens as a backend returns them (borrowed).
#[derive(Clone, Copy, Debug)]
pub(crate) enum GotTokens<'a> {
    Bf16(&'a [u16]),
    Fp8 { x: &'a [u8], scales: &'a [f32] },
}

/// A normal dispatch's outputs as [`normal_dispatch_diff`] compares them.
pub(crate) struct NormalGot<'a> {
    pub recv_x: GotTokens<'a>,
    /// `None`: not returned (a cached dispatch without top-k).
    pub recv_topk_idx: Option<&'a [i64]>,
    pub recv_topk_weights: Option<&'a [f32]>,
    pub per_expert: &'a [usize],
    pub num_recv_tokens: usize,
    pub rank_prefix: &'a [u64],
    pub recv_src_idx: &'a [i32],
}

/// Low-latency dispatch outputs as [`ll_dispatch_diff`] compares them.
pub(crate) struct LlGot<'a> {
    pub recv_x: GotTokens<'a>,
    pub recv_count: &'a [u32],
    pub recv_src_rank: &'a [i32],
    pub recv_src_idx: &'a [i32],
    pub layout_range: &'a [(u32, u32)],
}

/// The first difference of a low-latency dispatch (valid rows only: rows past the counts are
/// not part of the contract).
pub(crate) fn ll_dispatch_diff(
    got: &LlGot<'_>,
    want: &refm::LlDispatchOut,
    hidden: usize,
) -> Option<String> {
    if got.recv_count != &want.recv_count[..] {
        return Some(format!("recv_count {:?} (want {:?})", got.recv_count, want.recv_count));
    }
    if got.layout_range != &want.layout_range[..] {
        return Some("layout_range".into());
    }
    let l = want.recv_count.len().max(1);
    let s_rows = want.recv_src_rank.len() / l;
    let g = hidden / 128;
    for (e, &c) in want.recv_count.iter().enumerate() {
        for i in 0..c as usize {
            let o = e * s_rows + i;
            let at = || {
                format!(
                    " (local expert {e} row {i}: source rank {}, token {})",
                    want.recv_src_rank[o], want.recv_src_idx[o]
                )
            };
            if got.recv_src_rank.get(o) != Some(&want.recv_src_rank[o])
                || got.recv_src_idx.get(o) != Some(&want.recv_src_idx[o])
            {
                return Some(format!("source info{}", at()));
            }
            let same = match (got.recv_x, &want.recv_x) {
                (GotTokens::Bf16(a), OwnedTokens::Bf16(b)) => {
                    a.get(o * hidden..(o + 1) * hidden) == Some(&b[o * hidden..(o + 1) * hidden])
                }
                (GotTokens::Fp8 { x: a, scales: sa }, OwnedTokens::Fp8 { x: b, scales: sb }) => {
                    a.get(o * hidden..(o + 1) * hidden) == Some(&b[o * hidden..(o + 1) * hidden])
                        && sa.get(o * g..(o + 1) * g).is_some_and(|s| {
                            s.iter()
                                .zip(&sb[o * g..(o + 1) * g])
                                .all(|(u, v)| u.to_bits() == v.to_bits())
                        })
                }
                _ => return Some("recv_x dtype".into()),
            };
            if !same {
                return Some(format!("recv_x{}", at()));
            }
        }
    }
    None
}

// ---------------------------------------------------------------------------------------------
// One rank
// ---------------------------------------------------------------------------------------------

/// What one rank found.
#[derive(Debug)]
pub enum RankVerdict {
    /// Every output matched; `exact_combines` of `combines` were bit-equal; `digest`: the
    /// [`Checks::digest`] of the rank's combine outputs.
    Ok { combines: usize, exact_combines: usize, digest: u64 },
    /// An output differed (the first one), the rank went on to keep its peers in step.
    Mismatch(String),
    /// A call failed.
    Failed(Error),
}

/// Collects a rank's checks: the first mismatch, and how many combines were bit-equal.
#[derive(Default)]
pub(crate) struct Checks {
    pub first: Option<String>,
    pub combines: usize,
    pub exact: usize,
    /// Wrapping sum of an FNV-1a hash per combine output (its label, which names the rank and
    /// the call, and its bits): dispatch outputs are compared bit-exact, combines only within
    /// tolerance, so two runs of one seed are bit-identical exactly when their digests agree.
    /// A sum, so the order in which ranks and cases report does not matter.
    pub digest: u64,
}

fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for &b in *p {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

impl Checks {
    pub fn note(&mut self, at: &str, diff: Option<String>) {
        if let (None, Some(d)) = (&self.first, diff) {
            self.first = Some(format!("{at}: {d}"));
        }
    }

    /// A combine output (and its weights) against the reference.
    pub fn combine(
        &mut self,
        at: &str,
        got: &[u16],
        want: &[u16],
        got_w: Option<&[f32]>,
        want_w: Option<&[f32]>,
        hidden: usize,
    ) {
        let mut exact = true;
        self.note(
            at,
            combine_diff(got, want, hidden, &mut exact).map(|d| format!("combined_x {d}")),
        );
        match (got_w, want_w) {
            (Some(g), Some(w)) => self.note(
                at,
                weights_diff(g, w, &mut exact).map(|d| format!("combined_topk_weights {d}")),
            ),
            (None, None) => {}
            (g, _) => self.note(
                at,
                Some(format!(
                    "combined_topk_weights {} (want the other)",
                    if g.is_some() { "returned" } else { "missing" }
                )),
            ),
        }
        self.combines += 1;
        self.exact += usize::from(exact);
        let gw: &[f32] = got_w.unwrap_or(&[]);
        self.digest = self.digest.wrapping_add(fnv1a(&[
            at.as_bytes(),
            bytemuck::cast_slice(got),
            bytemuck::cast_slice(gw),
        ]));
    }

    pub fn verdict(self) -> RankVerdict {
        match self.first {
            Some(m) => RankVerdict::Mismatch(m),
            None => RankVerdict::Ok {
                combines: self.combines,
                exact_combines: self.exact,
                digest: self.digest,
            },
        }
    }
}

/// Rank `rank`'s config for shape `sh` of `spec`.
pub fn shape_config(
    spec: &CaseSpec,
    sh: &ShapeSpec,
    rank: usize,
    timeout: Duration,
) -> Result<EpConfig> {
    let mut s = EpSettings::new(rank, spec.num_ranks, sh.experts, sh.hidden, sh.topk);
    s.ranks_per_node = spec.ranks_per_node;
    s.timeout = timeout;
    s.max_tokens_per_rank = sh.max_tokens;
    if let Some(c) = sh.chunk_tokens {
        s.chunk_tokens = c;
    }
    if let Some(p) = sh.slots_per_peer {
        s.slots_per_peer = p;
    }
    if sh.fp8 {
        s.dispatch_dtype = DispatchDtype::Fp8E4m3;
    }
    EpConfig::new(s)
}

fn got_tokens(x: &OwnedTokens) -> GotTokens<'_> {
    match x {
        OwnedTokens::Bf16(v) => GotTokens::Bf16(v),
        OwnedTokens::Fp8 { x, scales } => GotTokens::Fp8 { x, scales },
    }
}

fn normal_got(o: &DispatchOutput) -> NormalGot<'_> {
    NormalGot {
        recv_x: got_tokens(&o.recv_x),
        recv_topk_idx: Some(&o.recv_topk_idx),
        recv_topk_weights: Some(&o.recv_topk_weights),
        per_expert: &o.num_recv_tokens_per_expert,
        num_recv_tokens: o.num_recv_tokens,
        rank_prefix: o.handle.rank_prefix(),
        recv_src_idx: o.handle.recv_src_idx(),
    }
}

fn ll_got(o: &LlDispatchOutput) -> LlGot<'_> {
    LlGot {
        recv_x: got_tokens(&o.recv_x),
        recv_count: &o.recv_count,
        recv_src_rank: &o.recv_src_rank,
        recv_src_idx: &o.recv_src_idx,
        layout_range: &o.layout_range,
    }
}

/// One rank of a case on the host backend: every shape on a fresh `Buffer`, every call checked.
pub fn host_rank(
    spec: &CaseSpec,
    refs: &CaseRefs,
    rank: usize,
    boot: Arc<dyn Bootstrap>,
    timeout: Duration,
) -> RankVerdict {
    let mut checks = Checks::default();
    match host_rank_inner(spec, refs, rank, boot, timeout, &mut checks) {
        Ok(()) => checks.verdict(),
        Err(e) => RankVerdict::Failed(e),
    }
}

fn host_rank_inner(
    spec: &CaseSpec,
    refs: &CaseRefs,
    rank: usize,
    boot: Arc<dyn Bootstrap>,
    timeout: Duration,
    checks: &mut Checks,
) -> Result<()> {
    let at = |s: usize, c: usize, what: &str| format!("rank {rank} shape {s} call {c} {what}");
    test_stall(rank, spec, timeout);
    for (si, sh) in spec.shapes.iter().enumerate() {
        let cfg = shape_config(spec, sh, rank, timeout)?;
        let mut opts = BufferOptions {
            intranode_provider: spec.intranode.map(str::to_string),
            emulate_network_gbps: spec.emulate_gbps,
            ..BufferOptions::host(spec.provider)
        };
        if let Some(c) = spec.ring_capacity {
            opts.ring_capacity = c;
        }
        let mut eng = if sh.hier {
            HostNormal::Hier(Box::new(HierBuffer::new(cfg, boot.clone(), opts)?))
        } else {
            HostNormal::Direct(Box::new(Buffer::new(cfg, boot.clone(), opts)?))
        };
        for (ci, call) in sh.calls.iter().enumerate() {
            let cref = refs.get(si, ci)?;
            match (&call.kind, cref, &mut eng) {
                (CallKind::Normal(n), CallRef::Normal(r), eng) => {
                    for _ in 0..n.repeat.max(1) {
                        host_normal_call(eng, sh, n, r, rank, &|w| at(si, ci, w), checks)?;
                        refs.step_done();
                    }
                }
                (CallKind::Ll(l), CallRef::Ll(r), HostNormal::Direct(buf)) => {
                    for i in 0..l.repeat.max(1) {
                        let l = LlCall { clean_before: l.clean_before && i == 0, ..l.clone() };
                        host_ll_call(buf, sh, &l, r, rank, &|w| at(si, ci, w), checks)?;
                        refs.step_done();
                    }
                }
                _ => return Err(Error::Other("reference of the wrong mode (bug)".into())),
            }
        }
        match eng {
            HostNormal::Direct(b) => (*b).destroy()?,
            HostNormal::Hier(b) => (*b).destroy()?,
        }
    }
    Ok(())
}

/// Normal mode's two routings on the host backend.
enum HostNormal {
    Direct(Box<Buffer>),
    Hier(Box<HierBuffer>),
}

/// A dispatch result of either routing.
enum HostOut {
    Direct(Box<DispatchOutput>),
    Hier(Box<HierDispatchOutput>),
}

impl HostOut {
    fn got(&self) -> NormalGot<'_> {
        match self {
            HostOut::Direct(o) => normal_got(o),
            HostOut::Hier(o) => NormalGot {
                recv_x: got_tokens(&o.recv_x),
                recv_topk_idx: Some(&o.recv_topk_idx),
                recv_topk_weights: Some(&o.recv_topk_weights),
                per_expert: &o.num_recv_tokens_per_expert,
                num_recv_tokens: o.num_recv_tokens,
                rank_prefix: o.handle.rank_prefix(),
                recv_src_idx: o.handle.recv_src_idx(),
            },
        }
    }
}

impl HostNormal {
    /// A fresh dispatch (`cached: None`) or one on a previous dispatch's handle.
    fn dispatch(
        &mut self,
        me: &RankIn,
        with_topk: bool,
        layout: bool,
        n: &NormalCall,
        worst: Option<usize>,
        cached: Option<&HostOut>,
    ) -> Result<HostOut> {
        let idx = with_topk.then_some(&me.topk_idx[..]);
        let w = with_topk.then_some(&me.topk_weights[..]);
        match (self, cached) {
            (HostNormal::Direct(b), c) => {
                let lay = if layout { Some(b.get_dispatch_layout(&me.topk_idx)?) } else { None };
                let handle = match c {
                    Some(HostOut::Direct(o)) => Some(&o.handle),
                    Some(HostOut::Hier(_)) => return Err(Error::Other("handle kind (bug)".into())),
                    None => None,
                };
                Ok(HostOut::Direct(Box::new(b.dispatch(&DispatchArgs {
                    x: me.tokens(),
                    topk_idx: idx,
                    topk_weights: w,
                    layout: lay.as_ref(),
                    handle,
                    expert_alignment: n.alignment,
                    num_worst_tokens: worst,
                })?)))
            }
            (HostNormal::Hier(b), c) => {
                let handle = match c {
                    Some(HostOut::Hier(o)) => Some(&o.handle),
                    Some(HostOut::Direct(_)) => {
                        return Err(Error::Other("handle kind (bug)".into()))
                    }
                    None => None,
                };
                Ok(HostOut::Hier(Box::new(b.dispatch(&HierDispatchArgs {
                    x: me.tokens(),
                    topk_idx: idx,
                    topk_weights: w,
                    handle,
                    expert_alignment: n.alignment,
                    num_worst_tokens: worst,
                })?)))
            }
        }
    }

    fn combine(&mut self, out: &HostOut, y: &[u16], w: Option<&[f32]>) -> Result<CombineOutput> {
        match (self, out) {
            (HostNormal::Direct(b), HostOut::Direct(o)) => {
                b.combine(&CombineArgs { x: y, handle: &o.handle, topk_weights: w })
            }
            (HostNormal::Hier(b), HostOut::Hier(o)) => b.combine(y, &o.handle, w),
            _ => Err(Error::Other("handle kind (bug)".into())),
        }
    }
}

fn host_normal_call(
    eng: &mut HostNormal,
    sh: &ShapeSpec,
    n: &NormalCall,
    r: &NormalCallRef,
    rank: usize,
    at: &dyn Fn(&str) -> String,
    checks: &mut Checks,
) -> Result<()> {
    let (h, k) = (sh.hidden, sh.topk);
    let me = &r.fresh.inputs[rank];
    let out = eng.dispatch(me, true, n.pass_layout, n, r.worst, None)?;
    checks.note(&at("dispatch"), normal_dispatch_diff(&out.got(), &r.fresh.want_d[rank], h, k));
    let mut c = eng.combine(&out, &r.fresh.y[rank], r.fresh.yw[rank].as_deref())?;
    if test_corrupt() {
        corrupt(&mut c.combined_x);
    }
    let want = &r.fresh.want_c[rank];
    checks.combine(
        &at("combine"),
        &c.combined_x,
        &want.combined_x,
        c.combined_topk_weights.as_deref(),
        want.combined_topk_weights.as_deref(),
        h,
    );
    if let (Some(with_topk), Some(cr)) = (n.cached, &r.cached) {
        let me2 = &cr.inputs[rank];
        let out2 = eng.dispatch(me2, with_topk, false, n, r.worst, Some(&out))?;
        let mut got = out2.got();
        if !with_topk {
            let returned = got.recv_topk_idx.is_some_and(|v| !v.is_empty())
                || got.recv_topk_weights.is_some_and(|v| !v.is_empty());
            if returned {
                checks.note(&at("cached dispatch"), Some("returned top-k it was not given".into()));
            }
            got.recv_topk_idx = None;
            got.recv_topk_weights = None;
        }
        checks.note(&at("cached dispatch"), normal_dispatch_diff(&got, &cr.want_d[rank], h, k));
        let c2 = eng.combine(&out2, &cr.y[rank], cr.yw[rank].as_deref())?;
        let want = &cr.want_c[rank];
        checks.combine(
            &at("cached combine"),
            &c2.combined_x,
            &want.combined_x,
            c2.combined_topk_weights.as_deref(),
            want.combined_topk_weights.as_deref(),
            h,
        );
    }
    Ok(())
}

fn host_ll_call(
    buf: &mut Buffer,
    sh: &ShapeSpec,
    l: &LlCall,
    r: &LlCallRef,
    rank: usize,
    at: &dyn Fn(&str) -> String,
    checks: &mut Checks,
) -> Result<()> {
    let h = sh.hidden;
    if l.clean_before {
        buf.clean_low_latency_buffer()?;
    }
    fn args<'a>(i: &'a RankIn, l: &LlCall, hook: bool) -> LlDispatchArgs<'a> {
        LlDispatchArgs {
            x: &i.x,
            topk_idx: &i.topk_idx,
            use_fp8: l.fp8,
            round_scale: l.round_scale,
            return_recv_hook: hook,
        }
    }
    let last_in = &r.last.inputs[rank];
    let d = match &r.first {
        Some(first) if l.overlap => {
            // Two hooks outstanding: A's receive completes after B's send (allowed: before
            // this rank's call after next).
            let a = buf.low_latency_dispatch(&args(&first.inputs[rank], l, true))?;
            let b = buf.low_latency_dispatch(&args(last_in, l, true))?;
            let da = a.complete(buf)?;
            checks.note(
                &at("first dispatch"),
                ll_dispatch_diff(&ll_got(&da), &first.want_d[rank], h),
            );
            b.complete(buf)?
        }
        Some(first) => {
            let da = buf
                .low_latency_dispatch(&args(&first.inputs[rank], l, l.hook_dispatch))?
                .complete(buf)?;
            checks.note(
                &at("first dispatch"),
                ll_dispatch_diff(&ll_got(&da), &first.want_d[rank], h),
            );
            buf.low_latency_dispatch(&args(last_in, l, l.hook_dispatch))?.complete(buf)?
        }
        None => buf.low_latency_dispatch(&args(last_in, l, l.hook_dispatch))?.complete(buf)?,
    };
    checks.note(&at("dispatch"), ll_dispatch_diff(&ll_got(&d), &r.last.want_d[rank], h));
    let mut c = buf
        .low_latency_combine(&LlCombineArgs {
            x: &r.y[rank],
            topk_idx: &r.combine_topk[rank],
            topk_weights: &last_in.topk_weights,
            handle: &d.handle,
            return_recv_hook: l.hook_combine,
        })?
        .complete(buf)?;
    if test_corrupt() {
        corrupt(&mut c.combined_x);
    }
    checks.combine(&at("combine"), &c.combined_x, &r.want_c[rank], None, None, h);
    if l.combine_twice {
        // The same handle again, the other hook mode.
        let c = buf
            .low_latency_combine(&LlCombineArgs {
                x: &r.y[rank],
                topk_idx: &r.combine_topk[rank],
                topk_weights: &last_in.topk_weights,
                handle: &d.handle,
                return_recv_hook: !l.hook_combine,
            })?
            .complete(buf)?;
        checks.combine(&at("second combine"), &c.combined_x, &r.want_c[rank], None, None, h);
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The matrix
// ---------------------------------------------------------------------------------------------

/// How a case ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CaseOutcome {
    Ok { combines: usize, exact_combines: usize, digest: u64 },
    Mismatch(String),
    Hang(String),
}

/// What `ep-bench verify` was asked.
#[derive(Clone, Debug)]
pub struct VerifyOptions {
    pub backend: VerifyBackend,
    pub cases: usize,
    pub seed: u64,
    /// Run only this case.
    pub case: Option<usize>,
    pub repeat: usize,
    pub launch: Launch,
    /// Bound on every wait of a case's ranks; the case's deadline follows from it.
    pub timeout: Duration,
    /// Print every case as it ends.
    pub verbose: bool,
    /// Cases run at once (ranks as processes only: each case is its own job with its own store,
    /// so cases share nothing but the machine). 1 runs them one after another.
    pub jobs: usize,
    /// This binary (to launch ranks as processes).
    pub exe: std::path::PathBuf,
}

/// Collective steps of a call (each a dispatch + combine pair, or a clean).
fn call_steps(c: &CallSpec) -> usize {
    match &c.kind {
        CallKind::Normal(n) => n.repeat.max(1) * (1 + usize::from(n.cached.is_some())),
        CallKind::Ll(l) => {
            l.repeat.max(1) * (1 + usize::from(l.double) + usize::from(l.combine_twice))
                + usize::from(l.clean_before)
        }
    }
}

/// Test hooks of the matrix's own failure paths (tests/ep_verify_host.rs): every rank's
/// combine output gets one value changed (`FEP_TEST_VERIFY_CORRUPT=1`), or this rank sleeps
/// past its case's deadline before its first call (`FEP_TEST_VERIFY_STALL_RANK=r`).
fn test_corrupt() -> bool {
    std::env::var("FEP_TEST_VERIFY_CORRUPT").is_ok_and(|v| v == "1")
}

fn test_stall(rank: usize, spec: &CaseSpec, timeout: Duration) {
    if std::env::var("FEP_TEST_VERIFY_STALL_RANK").ok().and_then(|v| v.parse().ok()) == Some(rank) {
        let o = VerifyOptions {
            backend: spec.backend,
            cases: 0,
            seed: 0,
            case: None,
            repeat: 1,
            launch: Launch::Auto,
            timeout,
            verbose: false,
            jobs: 1,
            exe: Default::default(),
        };
        std::thread::sleep(o.deadline(spec) + Duration::from_secs(2));
    }
}

fn corrupt(v: &mut [u16]) {
    if let Some(x) = v.first_mut() {
        *x ^= 0x4000;
    }
}

/// Default bound on one wait in a case.
pub const DEFAULT_TIMEOUT_S: u64 = 20;

impl VerifyOptions {
    /// The command that replays case `i` alone.
    pub fn replay(&self, i: usize) -> String {
        let mut s = format!(
            "ep-bench verify --backend {} --seed {} --case {i}",
            self.backend.name(),
            self.seed
        );
        if self.launch != Launch::Auto {
            s += &format!(" --launch {}", self.launch.name());
        }
        if self.timeout != Duration::from_secs(DEFAULT_TIMEOUT_S) {
            s += &format!(" --timeout {}", self.timeout.as_secs());
        }
        s
    }

    /// How long a case with its ranks as threads may go without any rank finishing a call
    /// before it is a hang: every wait's bound three times over (a failed rank's peers time out
    /// one after another) plus room for a shape's set-up.
    pub fn stall_limit(&self) -> Duration {
        self.timeout * 3 + Duration::from_secs(20)
    }

    /// The deadline of a whole case (ranks as processes, whose progress this process does not
    /// see; and a bound on a threads case that progresses forever): every wait's bound, three
    /// times over, plus room for the data and the set-up.
    pub fn deadline(&self, spec: &CaseSpec) -> Duration {
        let calls: usize =
            spec.shapes.iter().map(|s| 1 + s.calls.iter().map(call_steps).sum::<usize>()).sum();
        self.timeout * 3 + Duration::from_secs(20 + 3 * calls as u64 * spec.num_ranks as u64)
    }
}

/// The runners a backend provides to the matrix.
pub type RankFn = fn(&CaseSpec, &CaseRefs, usize, Arc<dyn Bootstrap>, Duration) -> RankVerdict;

fn is_timeout(e: &Error) -> bool {
    matches!(e, Error::Timeout { .. } | Error::Bootstrap(BootstrapError::Timeout { .. }))
        || matches!(e, Error::Proxy(fabric_ep::proxy::ProxyError::SendTimeout { .. }))
}

/// Folds the ranks' verdicts into the case's outcome: a failure other than a timeout is the
/// root cause (its peers then time out waiting for it); timeouts alone are a hang.
pub fn fold_verdicts(v: Vec<(usize, RankVerdict)>) -> CaseOutcome {
    let mut combines = 0;
    let mut exact = 0;
    let mut digest = 0u64;
    let mut mismatch = None;
    let mut failed = None;
    let mut timeouts = Vec::new();
    for (r, x) in v {
        match x {
            RankVerdict::Ok { combines: c, exact_combines: e, digest: d } => {
                combines += c;
                exact += e;
                digest = digest.wrapping_add(d);
            }
            RankVerdict::Mismatch(m) => {
                mismatch.get_or_insert(m);
            }
            RankVerdict::Failed(e) if is_timeout(&e) => timeouts.push(format!("rank {r}: {e}")),
            RankVerdict::Failed(e) => {
                failed.get_or_insert(format!("rank {r} failed: {e}"));
            }
        }
    }
    if let Some(f) = failed {
        return CaseOutcome::Mismatch(f);
    }
    if !timeouts.is_empty() {
        return CaseOutcome::Hang(timeouts.join("; "));
    }
    if let Some(m) = mismatch {
        return CaseOutcome::Mismatch(m);
    }
    CaseOutcome::Ok { combines, exact_combines: exact, digest }
}

/// Sets (or removes) `FEP_MR_MAX_BYTES` for `spec`: read when each rank opens its provider. No
/// rank of this case runs yet, and every earlier case's ranks ended (or hung, their
/// registrations long done).
fn apply_mr_env(spec: &CaseSpec) {
    match spec.mr_max_bytes {
        Some(b) => std::env::set_var("FEP_MR_MAX_BYTES", b.to_string()),
        None => std::env::remove_var("FEP_MR_MAX_BYTES"),
    }
}

/// Runs a case with its ranks as threads of this process; a rank still running at the deadline
/// makes it a hang (its thread is left behind: its waits are bounded, so it ends by itself).
pub fn run_case_threads(opts: &VerifyOptions, spec: &CaseSpec, rank_fn: RankFn) -> CaseOutcome {
    let r = spec.num_ranks;
    let boots = match InProcGroup::new(r, spec.ranks_per_node, opts.timeout) {
        Ok(b) => b,
        Err(e) => return CaseOutcome::Mismatch(format!("bootstrap: {e}")),
    };
    let refs = Arc::new(CaseRefs::new(spec));
    apply_mr_env(spec);
    let spec = Arc::new(spec.clone());
    let (tx, rx) = mpsc::channel();
    for (rank, b) in boots.into_iter().enumerate() {
        let (tx, refs, spec, timeout) = (tx.clone(), refs.clone(), spec.clone(), opts.timeout);
        let spawned =
            std::thread::Builder::new().name(format!("verify-rank-{rank}")).spawn(move || {
                let boot: Arc<dyn Bootstrap> = Arc::new(b);
                let v = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    rank_fn(&spec, &refs, rank, boot, timeout)
                }))
                .unwrap_or_else(|p| {
                    let msg = p
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_default();
                    RankVerdict::Failed(Error::Other(format!("rank {rank} panicked: {msg}")))
                });
                let _ = tx.send((rank, v));
            });
        if let Err(e) = spawned {
            return CaseOutcome::Mismatch(format!("spawn rank {rank}: {e}"));
        }
    }
    drop(tx);
    let start = Instant::now();
    // Progress decides (stall_limit); the deadline only bounds a case that never ends.
    let deadline = start + opts.deadline(&spec) * 4;
    let (mut seen, mut last_change) = (refs.progress(), start);
    let mut got = Vec::with_capacity(r);
    while got.len() < r {
        let now = Instant::now();
        if refs.progress() != seen {
            (seen, last_change) = (refs.progress(), now);
        }
        let stalled = now.duration_since(last_change) >= opts.stall_limit();
        if now < deadline && !stalled {
            match rx.recv_timeout(Duration::from_millis(250)) {
                Ok(v) => {
                    got.push(v);
                    last_change = Instant::now();
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
            }
            continue;
        }
        let done: Vec<usize> = got.iter().map(|(r, _)| *r).collect();
        let stuck: Vec<usize> = (0..r).filter(|x| !done.contains(x)).collect();
        let mut why = if stalled {
            format!(
                "ranks {stuck:?} still running, no call finished for {:?} (after {} \
                 calls in {:.1} s)",
                opts.stall_limit(),
                seen,
                start.elapsed().as_secs_f64()
            )
        } else {
            format!(
                "ranks {stuck:?} still running at the case's deadline ({:?})",
                opts.deadline(&spec)
            )
        };
        if let CaseOutcome::Mismatch(m) | CaseOutcome::Hang(m) = fold_verdicts(got) {
            why += &format!("; the others: {m}");
        }
        return CaseOutcome::Hang(why);
    }
    got.sort_by_key(|(r, _)| *r);
    fold_verdicts(got)
}

/// Set by the matrix for its rank processes when it runs several cases at once (`--jobs`):
/// how many cases share the GPU (the GPU side sizes each rank's SM budget from it).
pub const JOBS_ENV: &str = "FEP_VERIFY_GPU_JOBS";

/// The line a rank process prints last, read back by [`run_case_procs`].
const RANK_LINE: &str = "verify-rank";

/// Runs a case with its ranks as processes of this binary (`exe verify ... --case i` as a job
/// of `LocalJob`); a job still running at the deadline is killed and makes the case a hang.
pub fn run_case_procs(opts: &VerifyOptions, spec: &CaseSpec) -> CaseOutcome {
    let mut args: Vec<String> = [
        "verify",
        "--backend",
        opts.backend.name(),
        "--seed",
        &opts.seed.to_string(),
        "--case",
        &spec.index.to_string(),
        "--timeout",
        &opts.timeout.as_secs().to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    if opts.launch != Launch::Auto {
        args.extend(["--launch".to_string(), opts.launch.name().to_string()]);
    }
    // Given to this job's ranks alone (cases may run at once): an empty value reads as unset.
    let mr = (
        "FEP_MR_MAX_BYTES".to_string(),
        spec.mr_max_bytes.map(|b| b.to_string()).unwrap_or_default(),
    );
    let mut job = match fabric_ep::bootstrap::LocalJob::spawn(
        &opts.exe,
        &args,
        spec.num_ranks,
        spec.ranks_per_node,
        &[mr, (JOBS_ENV.to_string(), opts.jobs.to_string())],
    ) {
        Ok(j) => j,
        Err(e) => return CaseOutcome::Mismatch(format!("launch: {e}")),
    };
    let outcomes = match job.wait(opts.deadline(spec)) {
        Ok(o) => o,
        Err(e) => return CaseOutcome::Mismatch(format!("wait: {e}")),
    };
    let mut verdicts = Vec::new();
    let mut stuck = Vec::new();
    let mut other = Vec::new();
    for o in &outcomes {
        if o.timed_out {
            stuck.push(o.rank);
            continue;
        }
        let line = o.stdout.lines().rev().find(|l| l.starts_with(RANK_LINE));
        match line.and_then(parse_rank_line) {
            Some(v) => verdicts.push((o.rank, v)),
            None => other.push(format!("{o}")),
        }
    }
    if !stuck.is_empty() {
        let mut why = format!(
            "ranks {stuck:?} still running at the case's deadline ({:?}), killed",
            opts.deadline(spec)
        );
        if let CaseOutcome::Mismatch(m) | CaseOutcome::Hang(m) = fold_verdicts(verdicts) {
            why += &format!("; the others: {m}");
        }
        return CaseOutcome::Hang(why);
    }
    if !other.is_empty() {
        return CaseOutcome::Mismatch(format!(
            "a rank ended without a verdict: {}",
            other.join("\n")
        ));
    }
    fold_verdicts(verdicts)
}

/// `verify-rank R ok C E` / `verify-rank R mismatch MSG` / `verify-rank R timeout MSG` /
/// `verify-rank R failed MSG`.
fn rank_line(rank: usize, v: &RankVerdict) -> String {
    match v {
        RankVerdict::Ok { combines, exact_combines, digest } => {
            format!("{RANK_LINE} {rank} ok {combines} {exact_combines} {digest:#x}")
        }
        RankVerdict::Mismatch(m) => format!("{RANK_LINE} {rank} mismatch {}", m.replace('\n', " ")),
        RankVerdict::Failed(e) if is_timeout(e) => {
            format!("{RANK_LINE} {rank} timeout {}", e.to_string().replace('\n', " "))
        }
        RankVerdict::Failed(e) => {
            format!("{RANK_LINE} {rank} failed {}", e.to_string().replace('\n', " "))
        }
    }
}

fn parse_rank_line(l: &str) -> Option<RankVerdict> {
    let mut it = l.splitn(4, ' ');
    let (_, _, kind, rest) = (it.next()?, it.next()?, it.next()?, it.next().unwrap_or(""));
    Some(match kind {
        "ok" => {
            let mut n = rest.split_whitespace();
            let mut num = || n.next().and_then(|v| v.parse::<usize>().ok());
            let (combines, exact_combines) = (num()?, num()?);
            let digest =
                n.next().and_then(|v| u64::from_str_radix(v.trim_start_matches("0x"), 16).ok())?;
            RankVerdict::Ok { combines, exact_combines, digest }
        }
        "mismatch" => RankVerdict::Mismatch(rest.to_string()),
        "timeout" => RankVerdict::Failed(Error::Timeout {
            rank: 0,
            phase: "(a rank process)",
            peers: Vec::new(),
            waited: Duration::ZERO,
            detail: format!(": {rest}"),
        }),
        _ => RankVerdict::Failed(Error::Other(rest.to_string())),
    })
}

/// One rank process of a case (`ep-bench verify --case i` inside a job): rebuilds the case and
/// its reference from the seed, runs its rank, prints its verdict line. The exit status is 0
/// whatever the verdict (the launcher reads the line).
pub fn rank_process(opts: &VerifyOptions, boot: Arc<dyn Bootstrap>, rank_fn: RankFn) -> Result<()> {
    let i = opts.case.ok_or_else(|| Error::arg("case", "a rank process runs one case (--case)"))?;
    let spec = draw_case(opts.seed, i, opts.backend, opts.launch);
    if boot.world_size() != spec.num_ranks {
        return Err(Error::arg(
            "WORLD_SIZE",
            format!("{} ranks, case {i} has {}", boot.world_size(), spec.num_ranks),
        ));
    }
    let rank = boot.rank();
    let refs = CaseRefs::new(&spec);
    let v = rank_fn(&spec, &refs, rank, boot, opts.timeout);
    println!("{}", rank_line(rank, &v));
    Ok(())
}

/// One row of the summary table.
#[derive(Default, Clone, Debug)]
struct Tally {
    cases: usize,
    mismatches: usize,
    hangs: usize,
    wall: Duration,
}

/// The whole matrix: every case (or `--case`), `repeat` times in this process; prints failures
/// as they happen (with their replay command), then the table, then the last line `verify: N
/// cases, M mismatches, H hangs`. Returns `(N, M, H)`.
pub fn run_matrix(opts: &VerifyOptions, rank_fn: RankFn) -> (usize, usize, usize) {
    let t0 = Instant::now();
    let indices: Vec<usize> = match opts.case {
        Some(i) => vec![i],
        None => (0..opts.cases).collect(),
    };
    let mut table: BTreeMap<(Mode, &'static str, bool, bool), Tally> = BTreeMap::new();
    let (mut n, mut m, mut h) = (0, 0, 0);
    let (mut combines, mut exact) = (0, 0);
    // Per pass: the digest of every case's combine outputs (see `Checks::digest`).
    let mut pass_digests: Vec<u64> = Vec::new();
    let passes = opts.repeat.max(1);
    pass_digests.resize(passes, 0);
    let work: Vec<(usize, usize)> =
        (0..passes).flat_map(|p| indices.iter().map(move |&i| (p, i))).collect();
    let mut record = |pass: usize, i: usize, spec: &CaseSpec, out: CaseOutcome, dt: Duration| {
        let row = table.entry((spec.mode, spec.provider, spec.split(), spec.procs)).or_default();
        row.cases += 1;
        row.wall += dt;
        n += 1;
        let pass_s = if passes > 1 { format!(" (pass {})", pass + 1) } else { String::new() };
        match &out {
            CaseOutcome::Ok { combines: c, exact_combines: e, digest: d } => {
                combines += c;
                exact += e;
                // Keyed by the case so two cases' digests cannot cancel; a sum, so the order
                // cases finish in (several at once) does not matter.
                pass_digests[pass] = pass_digests[pass]
                    .wrapping_add(fnv1a(&[&(i as u64).to_le_bytes(), &d.to_le_bytes()]));
                if opts.verbose || opts.case.is_some() {
                    println!("case {i}{pass_s}: ok in {:.2} s", dt.as_secs_f64());
                }
            }
            CaseOutcome::Mismatch(why) | CaseOutcome::Hang(why) => {
                let hang = matches!(out, CaseOutcome::Hang(_));
                if hang {
                    h += 1;
                    row.hangs += 1;
                } else {
                    m += 1;
                    row.mismatches += 1;
                }
                if opts.case.is_none() && !opts.verbose {
                    println!("{}", spec.describe());
                }
                println!(
                    "case {i}{pass_s}: {} after {:.2} s: {why}\n  replay: {}",
                    if hang { "HANG" } else { "MISMATCH" },
                    dt.as_secs_f64(),
                    opts.replay(i)
                );
            }
        }
    };
    let run_one = |i: usize| {
        let spec = draw_case(opts.seed, i, opts.backend, opts.launch);
        if opts.case.is_some() || opts.verbose {
            println!("{}", spec.describe());
        }
        let t = Instant::now();
        let out = if spec.procs {
            run_case_procs(opts, &spec)
        } else {
            run_case_threads(opts, &spec, rank_fn)
        };
        (spec, out, t.elapsed())
    };
    if opts.jobs <= 1 || opts.launch != Launch::Procs {
        for &(pass, i) in &work {
            let (spec, out, dt) = run_one(i);
            record(pass, i, &spec, out, dt);
        }
    } else {
        // Workers take the next case in turn; results are recorded here as they end.
        let next = std::sync::atomic::AtomicUsize::new(0);
        let (tx, rx) = mpsc::channel();
        std::thread::scope(|s| {
            for _ in 0..opts.jobs.min(work.len()) {
                let (tx, next, work, run_one) = (tx.clone(), &next, &work, &run_one);
                s.spawn(move || loop {
                    let k = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some(&(pass, i)) = work.get(k) else { break };
                    let (spec, out, dt) = run_one(i);
                    if tx.send((pass, i, spec, out, dt)).is_err() {
                        break;
                    }
                });
            }
            drop(tx);
            for (pass, i, spec, out, dt) in rx {
                record(pass, i, &spec, out, dt);
            }
        });
    }
    println!(
        "{:<12} {:<12} {:<10} {:<9} {:>6} {:>10} {:>6} {:>9}",
        "mode", "provider", "split", "ranks as", "cases", "mismatches", "hangs", "wall s"
    );
    for ((mode, prov, split, procs), t) in &table {
        println!(
            "{:<12} {:<12} {:<10} {:<9} {:>6} {:>10} {:>6} {:>9.1}",
            mode.name(),
            prov,
            if *split { "internode" } else { "one node" },
            if *procs { "processes" } else { "threads" },
            t.cases,
            t.mismatches,
            t.hangs,
            t.wall.as_secs_f64()
        );
    }
    println!(
        "backend {}, seed {}, {} pass(es), {:.1} s; combines bit-equal to the reference: {exact} \
         of {combines} (the rest within fp32 accumulation tolerance)",
        opts.backend.name(),
        opts.seed,
        opts.repeat.max(1),
        t0.elapsed().as_secs_f64()
    );
    if m == 0 && h == 0 {
        // Every pass ran the same cases: equal digests mean bit-identical outputs.
        let same = pass_digests.windows(2).all(|w| w[0] == w[1]);
        println!(
            "output digest {:#018x}{}",
            pass_digests.first().copied().unwrap_or(0),
            match (pass_digests.len(), same) {
                (1, _) => String::new(),
                (p, true) => format!(" (all {p} passes bit-identical)"),
                (p, false) => format!(
                    " (passes differ: {}; {p} passes)",
                    pass_digests.iter().map(|d| format!("{d:#x}")).collect::<Vec<_>>().join(", ")
                ),
            }
        );
    }
    println!("verify: {n} cases, {m} mismatches, {h} hangs");
    (n, m, h)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_case_is_a_function_of_seed_and_index() {
        for i in 0..40 {
            let a = draw_case(9, i, VerifyBackend::Host, Launch::Auto);
            assert_eq!(a, draw_case(9, i, VerifyBackend::Host, Launch::Auto));
            assert_eq!(a.mode, if i % 2 == 0 { Mode::Normal } else { Mode::LowLatency });
            assert_eq!(a.num_ranks % a.ranks_per_node, 0);
            for sh in &a.shapes {
                assert_eq!(sh.experts % a.num_ranks, 0);
                assert!((8..=288).contains(&sh.experts), "{}", sh.experts);
                assert!(sh.hidden % 128 == 0 && (128..=8192).contains(&sh.hidden));
                assert!(sh.topk >= 1 && sh.topk <= sh.experts.min(GPU_MAX_TOPK));
                for c in &sh.calls {
                    assert_eq!(c.tokens.len(), a.num_ranks);
                    if a.mode == Mode::LowLatency {
                        assert!(c.tokens.iter().all(|&t| t <= sh.max_tokens));
                    }
                }
            }
        }
        assert_ne!(
            draw_case(9, 3, VerifyBackend::Host, Launch::Auto),
            draw_case(10, 3, VerifyBackend::Host, Launch::Auto)
        );
        let g = draw_case(9, 5, VerifyBackend::Gpu, Launch::Procs);
        assert!(g.procs && g.num_ranks <= GPU_MAX_RANKS);
    }

    #[test]
    fn routings_keep_their_promises() {
        let mut rng = SplitMix64(3);
        let (k, e, l) = (6, 24, 6);
        for routing in [
            Routing::Uniform,
            Routing::Hot { hot: vec![3, 3, 7], p: 0.9 },
            Routing::OneExpert(5),
            Routing::Starve(2),
        ] {
            let mut v = Vec::new();
            for _ in 0..200 {
                draw_topk(&mut rng, k, e, l, &routing, 0.0, &mut v);
            }
            for row in v.chunks(k) {
                let set: Vec<i64> = row.iter().copied().filter(|&g| g >= 0).collect();
                let mut d = set.clone();
                d.sort_unstable();
                d.dedup();
                assert_eq!(d.len(), set.len(), "{routing:?}: {row:?} repeats an expert");
                match &routing {
                    Routing::OneExpert(g) => assert_eq!(set, vec![*g as i64]),
                    Routing::Starve(s) => assert!(set.iter().all(|&g| g as usize / l != *s)),
                    _ => assert_eq!(set.len(), k),
                }
            }
            if let Routing::Hot { .. } = routing {
                let hot = v.iter().filter(|&&g| g == 3 || g == 7).count();
                assert!(hot > 200, "hot experts drawn {hot} times of {}", v.len());
            }
        }
        // The mask share applies.
        let mut v = Vec::new();
        for _ in 0..500 {
            draw_topk(&mut rng, 4, 16, 4, &Routing::Uniform, 0.5, &mut v);
        }
        let masked = v.iter().filter(|&&g| g < 0).count();
        assert!((800..1200).contains(&masked), "{masked} of 2000 masked");
    }

    #[test]
    fn tolerance_accepts_reordered_sums_and_rejects_wrong_values() {
        let w = f32_to_bf16(1.5);
        assert!(close_bf16(w, w, 1.5));
        // One bf16 step away: a reordered fp32 sum may round there.
        assert!(close_bf16(w + 1, w, 1.5));
        assert!(!close_bf16(f32_to_bf16(1.6), w, 1.5));
        assert!(!close_bf16(f32_to_bf16(f32::NAN), w, 1.5));
        let mut exact = true;
        let a = vec![f32_to_bf16(1.0), f32_to_bf16(2.0)];
        let b = vec![f32_to_bf16(1.0), f32_to_bf16(2.5)];
        assert!(combine_diff(&a, &b, 2, &mut exact).is_some());
        assert!(!exact);
    }

    #[test]
    fn digest_tells_bits_apart() {
        let run = |v: u16| {
            let mut c = Checks::default();
            c.combine("rank 0 call 0", &[v, 2], &[v, 2], None, None, 2);
            c.digest
        };
        assert_eq!(run(1), run(1));
        assert_ne!(run(1), run(3));
        let mut a = Checks::default();
        a.combine("rank 0", &[1], &[1], None, None, 1);
        let mut b = Checks::default();
        b.combine("rank 1", &[1], &[1], None, None, 1);
        assert_ne!(a.digest, b.digest, "the label (rank, call) is part of the hash");
    }

    #[test]
    fn verdict_lines_round_trip() {
        let v = RankVerdict::Ok { combines: 3, exact_combines: 2, digest: 0xfeed_0000_beef };
        assert!(matches!(
            parse_rank_line(&rank_line(1, &v)),
            Some(RankVerdict::Ok { combines: 3, exact_combines: 2, digest: 0xfeed_0000_beef })
        ));
        let m = parse_rank_line(&rank_line(0, &RankVerdict::Mismatch("recv_x row 3".into())));
        assert!(matches!(m, Some(RankVerdict::Mismatch(s)) if s == "recv_x row 3"));
        let t = Error::Timeout {
            rank: 2,
            phase: "x",
            peers: vec![1],
            waited: Duration::ZERO,
            detail: String::new(),
        };
        let p = parse_rank_line(&rank_line(2, &RankVerdict::Failed(t))).unwrap();
        assert!(matches!(fold_verdicts(vec![(2, p)]), CaseOutcome::Hang(_)));
        // A failure beats the timeouts it causes.
        let f = parse_rank_line(&rank_line(0, &RankVerdict::Failed(Error::Other("boom".into()))))
            .unwrap();
        let t = Error::Timeout {
            rank: 1,
            phase: "x",
            peers: vec![0],
            waited: Duration::ZERO,
            detail: String::new(),
        };
        assert!(matches!(
            fold_verdicts(vec![(0, f), (1, RankVerdict::Failed(t))]),
            CaseOutcome::Mismatch(s) if s.contains("boom")
        ));
    }
}
