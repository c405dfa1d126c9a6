//! EP runners shared by `ep-bench --mode normal` and the tests: deterministic per-rank inputs
//! (every rank can compute every rank's, hence the full reference), a checked normal-mode
//! dispatch + combine loop, and DeepEP's bandwidth figures.

use std::time::Instant;

use crate::stats::percentile;
use fabric_ep::ep::buffer::{
    Buffer, CombineArgs, CombineOutput, DispatchArgs, DispatchOutput, Tokens,
};
use fabric_ep::ep::hier::{HierBuffer, HierDispatchArgs, HierDispatchOutput};
use fabric_ep::protocol::config::{DispatchDtype, EpConfig};
use fabric_ep::protocol::hier::META_CHANNELS;
use fabric_ep::protocol::layout::Layout;
use fabric_ep::protocol::layout::{random_topk_idx, LayoutShape};
use fabric_ep::protocol::quant::{dequantize_row, f32_to_bf16, quantize_bf16};
use fabric_ep::protocol::reference::{self as refm, NormalCombineOut, NormalDispatchOut};
use fabric_ep::util::SplitMix64;
use fabric_ep::{Error, Result};

/// What to run.
#[derive(Clone, Debug)]
pub struct NormalBenchParams {
    /// Tokens per rank; `tokens_for_rank` may vary it per rank.
    pub num_tokens: usize,
    pub seed: u64,
    /// Percent of top-k entries replaced by -1.
    pub drop_pct: u64,
    /// Timed iterations (each: fresh dispatch + combine, both checked).
    pub iters: usize,
    /// Untimed iterations first.
    pub warmup: usize,
    /// Combine with weights.
    pub combine_weights: bool,
    /// Every rank but rank 0 routes its tokens to its own experts only, so between ranks only
    /// rank 0's tokens travel in dispatch (and their answers in combine): one direction at a
    /// time, as `fi_pingpong` measures a link (the proxy bench's `--one-way`).
    pub one_way: bool,
}

/// One rank's inputs.
#[derive(Clone, Debug)]
pub struct RankInputs {
    pub x_bf16: Vec<u16>,
    /// e4m3 bytes and scales of `x_bf16`, for fp8 configs.
    pub x_fp8: Option<(Vec<u8>, Vec<f32>)>,
    pub topk_idx: Vec<i64>,
    pub topk_weights: Vec<f32>,
}

impl RankInputs {
    /// `x` as the buffer's dispatch dtype wants it.
    pub fn tokens(&self) -> Tokens<'_> {
        match &self.x_fp8 {
            Some((x, scales)) => Tokens::Fp8 { x, scales },
            None => Tokens::Bf16(&self.x_bf16),
        }
    }
}

/// Rank `rank`'s inputs, from `(seed, rank)` alone.
pub fn rank_inputs(cfg: &EpConfig, p: &NormalBenchParams, rank: usize) -> Result<RankInputs> {
    let mut rng = SplitMix64(p.seed ^ (rank as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
    let (t, h) = (p.num_tokens, cfg.hidden);
    let x_bf16: Vec<u16> = (0..t * h).map(|_| f32_to_bf16((rng.unit_f32() - 0.5) * 4.0)).collect();
    let shape =
        LayoutShape::new(t, cfg.num_topk, cfg.num_experts, cfg.num_ranks, cfg.ranks_per_node)?;
    let topk_idx = if p.one_way && rank > 0 {
        // Drawn among this rank's own experts (distinct per token, as everywhere), then shifted
        // to their global ids.
        let local = cfg.num_experts / cfg.num_ranks;
        let own = LayoutShape::new(t, cfg.num_topk, local, 1, 1)?;
        let first = (rank * local) as i64;
        let v = random_topk_idx(&mut rng, own, p.drop_pct, false);
        v.into_iter().map(|e| if e < 0 { e } else { e + first }).collect()
    } else {
        random_topk_idx(&mut rng, shape, p.drop_pct, false)
    };
    let topk_weights = (0..t * cfg.num_topk).map(|_| rng.unit_f32()).collect();
    let x_fp8 = match cfg.dispatch_dtype {
        DispatchDtype::Fp8E4m3 => Some(quantize_bf16(&x_bf16, h, false)?),
        DispatchDtype::Bf16 => None,
    };
    Ok(RankInputs { x_bf16, x_fp8, topk_idx, topk_weights })
}

/// The bf16 rows a rank feeds to combine: `recv_x` itself (bf16), or dequantized (fp8).
pub fn combine_input(recv_x: &refm::Tokens, hidden: usize) -> Result<Vec<u16>> {
    match recv_x {
        refm::Tokens::Bf16(x) => Ok(x.clone()),
        refm::Tokens::Fp8 { x, scales } => {
            let g = hidden / 128;
            let rows = x.len() / hidden;
            let mut out = Vec::with_capacity(x.len());
            let mut row = vec![0f32; hidden];
            for r in 0..rows {
                dequantize_row(
                    &x[r * hidden..(r + 1) * hidden],
                    &scales[r * g..(r + 1) * g],
                    &mut row,
                )?;
                out.extend(row.iter().map(|&v| f32_to_bf16(v)));
            }
            Ok(out)
        }
    }
}

/// The reference outputs of every rank: dispatch, then combine of [`combine_input`].
pub fn reference(
    cfg: &EpConfig,
    inputs: &[RankInputs],
    expert_alignment: usize,
    num_worst_tokens: Option<usize>,
    combine_weights: bool,
) -> Result<(Vec<NormalDispatchOut>, Vec<NormalCombineOut>)> {
    let opts = (expert_alignment, num_worst_tokens, combine_weights);
    reference_grouped(cfg, inputs, opts, cfg.num_ranks)
}

/// [`reference`] with the combine summed per `group` ranks, as the hierarchy sums
/// ([`refm::normal_combine_grouped`]); `opts` = (expert_alignment, num_worst_tokens,
/// combine_weights).
pub fn reference_grouped(
    cfg: &EpConfig,
    inputs: &[RankInputs],
    opts: (usize, Option<usize>, bool),
    group: usize,
) -> Result<(Vec<NormalDispatchOut>, Vec<NormalCombineOut>)> {
    let (expert_alignment, num_worst_tokens, combine_weights) = opts;
    let params = refm::NormalParams {
        num_experts: cfg.num_experts,
        hidden: cfg.hidden,
        num_topk: cfg.num_topk,
        expert_alignment,
        num_worst_tokens,
    };
    let rin: Vec<refm::NormalRankInput> = inputs
        .iter()
        .map(|i| refm::NormalRankInput {
            x: i.tokens(),
            topk_idx: &i.topk_idx,
            topk_weights: &i.topk_weights,
        })
        .collect();
    let d = refm::normal_dispatch(&params, &rin)?;
    let xs: Vec<Vec<u16>> =
        d.iter().map(|o| combine_input(&o.recv_x, cfg.hidden)).collect::<Result<_>>()?;
    let cin: Vec<refm::NormalCombineInput> = d
        .iter()
        .zip(&xs)
        .map(|(o, x)| refm::NormalCombineInput {
            x,
            topk_weights: combine_weights.then_some(&o.recv_topk_weights[..]),
        })
        .collect();
    let c = refm::normal_combine_grouped(&params, &d, &cin, group)?;
    Ok((d, c))
}

/// Compares a dispatch result with the reference; the error names the rank and the field.
pub fn check_dispatch(rank: usize, got: &DispatchOutput, want: &NormalDispatchOut) -> Result<()> {
    check_dispatch_view(rank, &DispatchView::direct(got), want)
}

/// The fields of a dispatch result that [`check_dispatch_view`] compares, for both routings.
#[derive(Clone, Copy, Debug)]
pub struct DispatchView<'a> {
    pub recv_x: &'a refm::Tokens,
    pub recv_topk_idx: &'a [i64],
    pub recv_topk_weights: &'a [f32],
    pub num_recv_tokens_per_expert: &'a [usize],
    pub num_recv_tokens: usize,
    pub rank_prefix: &'a [u64],
    pub recv_src_idx: &'a [i32],
}

impl<'a> DispatchView<'a> {
    /// The direct path's result.
    pub fn direct(o: &'a DispatchOutput) -> Self {
        DispatchView {
            recv_x: &o.recv_x,
            recv_topk_idx: &o.recv_topk_idx,
            recv_topk_weights: &o.recv_topk_weights,
            num_recv_tokens_per_expert: &o.num_recv_tokens_per_expert,
            num_recv_tokens: o.num_recv_tokens,
            rank_prefix: o.handle.rank_prefix(),
            recv_src_idx: o.handle.recv_src_idx(),
        }
    }

    /// The hierarchy's result.
    pub fn hier(o: &'a HierDispatchOutput) -> Self {
        DispatchView {
            recv_x: &o.recv_x,
            recv_topk_idx: &o.recv_topk_idx,
            recv_topk_weights: &o.recv_topk_weights,
            num_recv_tokens_per_expert: &o.num_recv_tokens_per_expert,
            num_recv_tokens: o.num_recv_tokens,
            rank_prefix: o.handle.rank_prefix(),
            recv_src_idx: o.handle.recv_src_idx(),
        }
    }
}

/// [`check_dispatch`] of either routing's result.
pub fn check_dispatch_view(
    rank: usize,
    got: &DispatchView<'_>,
    want: &NormalDispatchOut,
) -> Result<()> {
    let bad = |what: &str| {
        Err(Error::Other(format!("rank {rank}: dispatch {what} differs from the reference")))
    };
    if *got.recv_x != want.recv_x {
        return bad("recv_x");
    }
    if !got.recv_topk_idx.is_empty() && got.recv_topk_idx != &want.recv_topk_idx[..] {
        return bad("recv_topk_idx");
    }
    if !got.recv_topk_weights.is_empty() && got.recv_topk_weights != &want.recv_topk_weights[..] {
        return bad("recv_topk_weights");
    }
    if got.num_recv_tokens_per_expert != &want.num_recv_tokens_per_expert[..] {
        return bad("num_recv_tokens_per_expert");
    }
    if got.num_recv_tokens != want.num_recv_tokens {
        return bad("num_recv_tokens");
    }
    let prefix: Vec<usize> = got.rank_prefix.iter().map(|&v| v as usize).collect();
    if prefix != want.rank_prefix {
        return bad("rank_prefix");
    }
    if got.recv_src_idx != &want.recv_src_idx[..] {
        return bad("source indices");
    }
    Ok(())
}

/// Timings and sizes of [`run_normal`] on this rank.
#[derive(Clone, Debug)]
pub struct NormalBenchReport {
    /// Per timed iteration, seconds.
    pub dispatch_s: Vec<f64>,
    pub combine_s: Vec<f64>,
    /// Bytes of the tokens this rank sends in dispatch (token payload + fp8 scales, once per
    /// destination rank), DeepEP's definition.
    pub dispatch_bytes: u64,
    /// Bytes of the bf16 tokens this rank receives in combine.
    pub combine_bytes: u64,
}

/// `(median, p99)` of `v` (seconds) in microseconds ([`percentile`]; NaN when empty).
pub fn median_p99_us(v: &[f64]) -> (f64, f64) {
    (percentile(v, 50.0) * 1e6, percentile(v, 99.0) * 1e6)
}

impl NormalBenchReport {
    /// `(GB/s at the median, median us, p99 us)` of dispatch.
    pub fn dispatch_figures(&self) -> (f64, f64, f64) {
        let (m, p) = median_p99_us(&self.dispatch_s);
        (self.dispatch_bytes as f64 / (m * 1e-6) / 1e9, m, p)
    }
    /// `(GB/s at the median, median us, p99 us)` of combine.
    pub fn combine_figures(&self) -> (f64, f64, f64) {
        let (m, p) = median_p99_us(&self.combine_s);
        (self.combine_bytes as f64 / (m * 1e-6) / 1e9, m, p)
    }
}

/// One routing of normal mode as [`run_normal`] and [`run_normal_hier`] drive it.
trait NormalPath {
    type Out;
    fn dispatch(&mut self, me: &RankInputs, layout: &Layout) -> Result<Self::Out>;
    fn view(out: &Self::Out) -> DispatchView<'_>;
    fn combine(&mut self, out: &Self::Out, x: &[u16], w: Option<&[f32]>) -> Result<CombineOutput>;
    /// The hierarchy's measured rows of this dispatch: (rail rows to other nodes, rows this
    /// rank forwarded as a gateway); `None` for the direct path.
    fn hier_rows(&self, out: &Self::Out) -> Option<(u64, u64)>;
}

impl NormalPath for Buffer {
    type Out = DispatchOutput;
    fn dispatch(&mut self, me: &RankInputs, layout: &Layout) -> Result<DispatchOutput> {
        Buffer::dispatch(
            self,
            &DispatchArgs {
                x: me.tokens(),
                topk_idx: Some(&me.topk_idx),
                topk_weights: Some(&me.topk_weights),
                layout: Some(layout),
                ..DispatchArgs::default()
            },
        )
    }
    fn view(out: &DispatchOutput) -> DispatchView<'_> {
        DispatchView::direct(out)
    }
    fn combine(
        &mut self,
        out: &DispatchOutput,
        x: &[u16],
        w: Option<&[f32]>,
    ) -> Result<CombineOutput> {
        Buffer::combine(self, &CombineArgs { x, handle: &out.handle, topk_weights: w })
    }
    fn hier_rows(&self, _: &DispatchOutput) -> Option<(u64, u64)> {
        None
    }
}

impl NormalPath for HierBuffer {
    type Out = HierDispatchOutput;
    fn dispatch(&mut self, me: &RankInputs, _layout: &Layout) -> Result<HierDispatchOutput> {
        HierBuffer::dispatch(
            self,
            &HierDispatchArgs {
                x: me.tokens(),
                topk_idx: Some(&me.topk_idx),
                topk_weights: Some(&me.topk_weights),
                ..HierDispatchArgs::default()
            },
        )
    }
    fn view(out: &HierDispatchOutput) -> DispatchView<'_> {
        DispatchView::hier(out)
    }
    fn combine(
        &mut self,
        out: &HierDispatchOutput,
        x: &[u16],
        w: Option<&[f32]>,
    ) -> Result<CombineOutput> {
        HierBuffer::combine(self, x, &out.handle, w)
    }
    fn hier_rows(&self, out: &HierDispatchOutput) -> Option<(u64, u64)> {
        let (node, local) = self.position();
        Some((out.handle.internode_rows_sent(node), out.handle.forwarded_rows(local)))
    }
}

/// Runs `warmup + iters` fresh dispatches + combines on `buf` with this rank's deterministic
/// inputs, checks every result against the reference computed from every rank's inputs, and
/// times the checked iterations. Collective.
pub fn run_normal(buf: &mut Buffer, p: &NormalBenchParams) -> Result<NormalBenchReport> {
    let cfg = buf.config().clone();
    run_path(buf, &cfg, p, cfg.num_ranks).map(|(rep, _)| rep)
}

/// Bytes one rank's dispatch puts on the network (to other nodes) per step, measured on the
/// routing structures of the run: the direct path's `is_token_in_rank` (one copy per destination
/// rank on another node) and the hierarchy's rail stage (one per destination node), plus the
/// bytes this rank forwarded as a gateway inside its node (rows with the metadata lane).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct InternodeBytes {
    pub direct: u64,
    pub hier: u64,
    pub hier_forwarded: u64,
}

/// [`run_normal`] through DeepEP's hierarchy ([`HierBuffer`]): the same inputs and checks, the
/// combine checked against the node-grouped sum ([`reference_grouped`]); also returns the
/// internode bytes of both routings.
pub fn run_normal_hier(
    buf: &mut HierBuffer,
    p: &NormalBenchParams,
) -> Result<(NormalBenchReport, InternodeBytes)> {
    let cfg = buf.config().clone();
    let group = cfg.ranks_per_node;
    run_path(buf, &cfg, p, group)
}

impl InternodeBytes {
    /// The internode bytes of one rank's routing (`topk_idx [T, K]`) computed from the routing
    /// alone: one copy per destination rank on another node (direct), one per destination node
    /// (the hierarchy's rail stage). `hier_forwarded` is not known without the other ranks'
    /// routings (0).
    pub fn of_routing(cfg: &EpConfig, topk_idx: &[i64]) -> Result<Self> {
        let (k, r, rpn) = (cfg.num_topk, cfg.num_ranks, cfg.ranks_per_node);
        let layout = fabric_ep::protocol::layout::dispatch_layout(
            topk_idx,
            topk_idx.len() / k,
            k,
            cfg.num_experts,
            r,
            rpn,
        )?;
        let my_node = cfg.rank / rpn;
        let hier: u64 = layout
            .is_token_in_rank
            .chunks(r)
            .map(|row| {
                (0..r / rpn)
                    .filter(|&n| n != my_node && row[n * rpn..(n + 1) * rpn].contains(&true))
                    .count() as u64
            })
            .sum();
        let token_bytes = cfg.dispatch_dtype.token_bytes(cfg.hidden as u64);
        Ok(InternodeBytes {
            direct: direct_internode_rows(cfg, &layout) * token_bytes,
            hier: hier * token_bytes,
            hier_forwarded: 0,
        })
    }
}

/// Direct internode bytes of [`InternodeBytes`] for this layout (see [`run_path`]).
fn direct_internode_rows(cfg: &EpConfig, layout: &Layout) -> u64 {
    let (rpn, r) = (cfg.ranks_per_node, cfg.num_ranks);
    let my_node = cfg.rank / rpn;
    layout
        .is_token_in_rank
        .chunks(r)
        .map(|row| (0..r).filter(|&d| d / rpn != my_node && row[d]).count() as u64)
        .sum()
}

fn run_path<P: NormalPath>(
    buf: &mut P,
    cfg: &EpConfig,
    p: &NormalBenchParams,
    group: usize,
) -> Result<(NormalBenchReport, InternodeBytes)> {
    let rank = cfg.rank;
    let inputs: Vec<RankInputs> =
        (0..cfg.num_ranks).map(|r| rank_inputs(cfg, p, r)).collect::<Result<_>>()?;
    let (want_d, want_c) = reference_grouped(cfg, &inputs, (1, None, p.combine_weights), group)?;
    let me = &inputs[rank];
    let layout = fabric_ep::protocol::layout::dispatch_layout(
        &me.topk_idx,
        me.topk_idx.len() / cfg.num_topk,
        cfg.num_topk,
        cfg.num_experts,
        cfg.num_ranks,
        cfg.ranks_per_node,
    )?;
    let token_bytes = cfg.dispatch_dtype.token_bytes(cfg.hidden as u64);
    let sent: u64 = layout.num_tokens_per_rank.iter().map(|&c| c.max(0) as u64).sum();
    let mut rep = NormalBenchReport {
        dispatch_s: Vec::new(),
        combine_s: Vec::new(),
        dispatch_bytes: sent * token_bytes,
        combine_bytes: sent * 2 * cfg.hidden as u64,
    };
    let mut bytes = InternodeBytes {
        direct: direct_internode_rows(cfg, &layout) * token_bytes,
        ..Default::default()
    };
    if std::env::var("FEP_TEST_EP_DIE_RANK").ok().and_then(|v| v.parse().ok()) == Some(rank) {
        // Failure tests: this rank vanishes right before its first dispatch.
        std::process::exit(3);
    }
    for it in 0..p.warmup + p.iters {
        let t0 = Instant::now();
        let out = buf.dispatch(me, &layout)?;
        let td = t0.elapsed().as_secs_f64();
        let v = P::view(&out);
        check_dispatch_view(rank, &v, &want_d[rank])?;
        let x = combine_input(v.recv_x, cfg.hidden)?;
        let w = p.combine_weights.then_some(v.recv_topk_weights);
        let t1 = Instant::now();
        let c = buf.combine(&out, &x, w)?;
        let tc = t1.elapsed().as_secs_f64();
        if c.combined_x != want_c[rank].combined_x
            || c.combined_topk_weights != want_c[rank].combined_topk_weights
        {
            return Err(Error::Other(format!(
                "rank {rank}: combine differs from the reference (iteration {it})"
            )));
        }
        if let (0, Some((hier, fwd))) = (it, buf.hier_rows(&out)) {
            bytes.hier = hier * token_bytes;
            let lane = cfg.dispatch_dtype.token_bytes(META_CHANNELS as u64);
            bytes.hier_forwarded = fwd * (token_bytes + lane);
        }
        if it >= p.warmup {
            rep.dispatch_s.push(td);
            rep.combine_s.push(tc);
        }
    }
    Ok((rep, bytes))
}

// ---------------------------------------------------------------------------------------------
// Low-latency mode
// ---------------------------------------------------------------------------------------------

use fabric_ep::ep::buffer::{LlCombineArgs, LlDispatchArgs, LlDispatchOutput, OwnedTokens};
use fabric_ep::protocol::reference::{LlDispatchOut, LlParams};

/// What [`run_low_latency`] runs.
#[derive(Clone, Debug)]
pub struct LlBenchParams {
    /// Tokens on each rank (`<= max_tokens_per_rank`), indexed by rank modulo its length.
    pub tokens: Vec<usize>,
    pub seed: u64,
    /// Percent of top-k entries replaced by -1.
    pub drop_pct: u64,
    pub use_fp8: bool,
    pub round_scale: bool,
    /// Timed iterations per mode (without hook, then with).
    pub iters: usize,
    pub warmup: usize,
}

/// One rank's low-latency inputs.
#[derive(Clone, Debug)]
pub struct LlRankInputs {
    /// `[T, H]` bf16.
    pub x: Vec<u16>,
    /// `[T, K]`.
    pub topk_idx: Vec<i64>,
    pub topk_weights: Vec<f32>,
}

/// Rank `rank`'s LL inputs, from `(seed, rank)` alone.
pub fn ll_rank_inputs(cfg: &EpConfig, p: &LlBenchParams, rank: usize) -> Result<LlRankInputs> {
    let mut rng = SplitMix64(p.seed ^ (rank as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
    let t = p.tokens.get(rank % p.tokens.len().max(1)).copied().unwrap_or(0);
    let h = cfg.hidden;
    let x = (0..t * h).map(|_| f32_to_bf16((rng.unit_f32() - 0.5) * 4.0)).collect();
    let shape =
        LayoutShape::new(t, cfg.num_topk, cfg.num_experts, cfg.num_ranks, cfg.ranks_per_node)?;
    let topk_idx = random_topk_idx(&mut rng, shape, p.drop_pct, false);
    let topk_weights = (0..t * cfg.num_topk).map(|_| rng.unit_f32()).collect();
    Ok(LlRankInputs { x, topk_idx, topk_weights })
}

/// The reference's LL parameters for `cfg`.
pub fn ll_params(cfg: &EpConfig, use_fp8: bool, round_scale: bool) -> LlParams {
    LlParams {
        num_experts: cfg.num_experts,
        hidden: cfg.hidden,
        num_topk: cfg.num_topk,
        max_tokens_per_rank: cfg.max_tokens_per_rank,
        use_fp8,
        round_scale,
    }
}

/// The bf16 expert outputs a rank feeds to LL combine: its received rows (dequantized when
/// fp8), rows past the counts zero. `[L, S, H]`.
pub fn ll_combine_input(
    recv_x: &OwnedTokens,
    recv_count: &[u32],
    hidden: usize,
) -> Result<Vec<u16>> {
    let l = recv_count.len().max(1);
    let (len, g) = match recv_x {
        OwnedTokens::Bf16(x) => (x.len(), 0),
        OwnedTokens::Fp8 { x, .. } => (x.len(), hidden / 128),
    };
    let s_rows = len / hidden / l;
    let mut out = vec![0u16; len];
    let mut row = vec![0f32; hidden];
    for (e, &c) in recv_count.iter().enumerate() {
        for i in 0..c as usize {
            let o = e * s_rows + i;
            let dst = &mut out[o * hidden..(o + 1) * hidden];
            match recv_x {
                OwnedTokens::Bf16(x) => dst.copy_from_slice(&x[o * hidden..(o + 1) * hidden]),
                OwnedTokens::Fp8 { x, scales } => {
                    dequantize_row(
                        &x[o * hidden..(o + 1) * hidden],
                        &scales[o * g..(o + 1) * g],
                        &mut row,
                    )?;
                    for (d, &v) in dst.iter_mut().zip(&row) {
                        *d = f32_to_bf16(v);
                    }
                }
            }
        }
    }
    Ok(out)
}

/// Reference LL dispatch and combine of every rank (combine of [`ll_combine_input`]).
pub fn ll_reference(
    cfg: &EpConfig,
    inputs: &[LlRankInputs],
    use_fp8: bool,
    round_scale: bool,
) -> Result<(Vec<LlDispatchOut>, Vec<Vec<u16>>)> {
    let p = ll_params(cfg, use_fp8, round_scale);
    let rin: Vec<refm::LlRankInput> =
        inputs.iter().map(|i| refm::LlRankInput { x: &i.x, topk_idx: &i.topk_idx }).collect();
    let d = refm::ll_dispatch(&p, &rin)?;
    let ys: Vec<Vec<u16>> = d
        .iter()
        .map(|o| ll_combine_input(&o.recv_x, &o.recv_count, cfg.hidden))
        .collect::<Result<_>>()?;
    let cin: Vec<refm::LlCombineInput> = inputs
        .iter()
        .zip(&ys)
        .map(|(i, y)| refm::LlCombineInput {
            x: y,
            topk_idx: &i.topk_idx,
            topk_weights: &i.topk_weights,
        })
        .collect();
    let c = refm::ll_combine(&p, &d, &cin)?;
    Ok((d, c))
}

/// [`ll_reference`] of rank `rank` alone: its dispatch output and its combine output, built
/// without any other rank's `[L, S, hidden]` output. Each expert returns the row it received
/// ([`ll_combine_input`]: the token's bf16 row, or its fp8 cast dequantized), so the combine
/// needs only this rank's own tokens. Every process of a job checks its own rank: with the full
/// reference each held every rank's outputs (at DeepEP's setting, 128 tokens of hidden 7168 to
/// 256 experts, 470 MB per rank).
pub fn ll_reference_rank(
    cfg: &EpConfig,
    inputs: &[LlRankInputs],
    rank: usize,
    use_fp8: bool,
    round_scale: bool,
) -> Result<(LlDispatchOut, Vec<u16>)> {
    let p = ll_params(cfg, use_fp8, round_scale);
    let rin: Vec<refm::LlRankInput> =
        inputs.iter().map(|i| refm::LlRankInput { x: &i.x, topk_idx: &i.topk_idx }).collect();
    let d = refm::ll_dispatch_for(&p, &rin, rank)?;
    let me = inputs.get(rank).ok_or_else(|| Error::arg("rank", format!("{rank}: no inputs")))?;
    let h = cfg.hidden;
    let t = me.x.len() / h;
    // The row every expert returns for token `t`, as ll_combine_input makes it from recv_x.
    let rows: Vec<u16> = if use_fp8 {
        let g = h / 128;
        let (mut q, mut sc, mut f) = (vec![0u8; h], vec![0f32; g], vec![0f32; h]);
        let mut out = Vec::with_capacity(t * h);
        for tok in 0..t {
            fabric_ep::protocol::quant::quantize_row_bf16(
                &me.x[tok * h..(tok + 1) * h],
                round_scale,
                &mut q,
                &mut sc,
            )?;
            dequantize_row(&q, &sc, &mut f)?;
            out.extend(f.iter().map(|&v| f32_to_bf16(v)));
        }
        out
    } else {
        me.x.clone()
    };
    let c = refm::ll_combine_rows(&p, &me.topk_idx, &me.topk_weights, |tok, _, _| {
        Ok(&rows[tok * h..(tok + 1) * h])
    })?;
    Ok((d, c))
}

/// Compares an LL dispatch result with the reference: counts, ranges, and per valid row the
/// payload (bf16 bits or fp8 bytes + scales) and source info; with `full`, the padding rows
/// too (zero / -1). The error names the rank, expert and row.
pub fn check_ll_dispatch(
    rank: usize,
    got: &LlDispatchOutput,
    want: &LlDispatchOut,
    hidden: usize,
    full: bool,
) -> Result<()> {
    let bad = |what: String| {
        Err(Error::Other(format!(
            "rank {rank}: low-latency dispatch {what} differs from the reference"
        )))
    };
    if got.recv_count != want.recv_count {
        return bad(format!("recv_count ({:?} vs {:?})", got.recv_count, want.recv_count));
    }
    if got.layout_range != want.layout_range {
        return bad("layout_range".into());
    }
    if full {
        if got.recv_x != want.recv_x {
            return bad("recv_x".into());
        }
        if got.recv_src_rank != want.recv_src_rank || got.recv_src_idx != want.recv_src_idx {
            return bad("source info".into());
        }
        return Ok(());
    }
    let l = got.recv_count.len().max(1);
    let s_rows = got.recv_src_rank.len() / l;
    let g = hidden / 128;
    for (e, &c) in got.recv_count.iter().enumerate() {
        for i in 0..c as usize {
            let o = e * s_rows + i;
            let same = match (&got.recv_x, &want.recv_x) {
                (OwnedTokens::Bf16(a), OwnedTokens::Bf16(b)) => {
                    a[o * hidden..(o + 1) * hidden] == b[o * hidden..(o + 1) * hidden]
                }
                (OwnedTokens::Fp8 { x: a, scales: sa }, OwnedTokens::Fp8 { x: b, scales: sb }) => {
                    a[o * hidden..(o + 1) * hidden] == b[o * hidden..(o + 1) * hidden]
                        && sa[o * g..(o + 1) * g] == sb[o * g..(o + 1) * g]
                }
                _ => false,
            };
            if !same {
                return bad(format!("recv_x (local expert {e}, row {i})"));
            }
            if got.recv_src_rank[o] != want.recv_src_rank[o]
                || got.recv_src_idx[o] != want.recv_src_idx[o]
            {
                return bad(format!("source info (local expert {e}, row {i})"));
            }
        }
    }
    Ok(())
}

/// Timings of [`run_low_latency`] on this rank, seconds per timed iteration.
#[derive(Clone, Debug, Default)]
pub struct LlBenchReport {
    pub dispatch_s: Vec<f64>,
    pub combine_s: Vec<f64>,
    /// With `return_recv_hook`: send + hook completion, back to back.
    pub dispatch_hook_s: Vec<f64>,
    pub combine_hook_s: Vec<f64>,
    /// Bytes of the tokens this rank sends in dispatch (payload + fp8 scales, once per
    /// selected expert), DeepEP's LL definition.
    pub dispatch_bytes: u64,
    /// Bytes of the bf16 rows this rank receives in combine (once per selected expert).
    pub combine_bytes: u64,
}

impl LlBenchReport {
    /// `(GB/s at the median, median us, p99 us)`.
    pub fn figures(bytes: u64, v: &[f64]) -> (f64, f64, f64) {
        let (m, p) = median_p99_us(v);
        (bytes as f64 / (m * 1e-6) / 1e9, m, p)
    }
}

/// Runs `warmup + iters` LL dispatch + combine without the hook, then as many with it, on
/// `buf` with this rank's deterministic inputs; checks every result against the reference
/// computed from every rank's inputs (valid rows of dispatch, all of combine); times the
/// checked iterations. Collective.
pub fn run_low_latency(buf: &mut Buffer, p: &LlBenchParams) -> Result<LlBenchReport> {
    let cfg = buf.config().clone();
    let rank = cfg.rank;
    let inputs: Vec<LlRankInputs> =
        (0..cfg.num_ranks).map(|r| ll_rank_inputs(&cfg, p, r)).collect::<Result<_>>()?;
    let (want_d, want_c) = ll_reference_rank(&cfg, &inputs, rank, p.use_fp8, p.round_scale)?;
    let me = &inputs[rank];
    let rows = me.topk_idx.iter().filter(|&&g| g >= 0).count() as u64;
    let token_bytes = if p.use_fp8 {
        DispatchDtype::Fp8E4m3.token_bytes(cfg.hidden as u64)
    } else {
        DispatchDtype::Bf16.token_bytes(cfg.hidden as u64)
    };
    let mut rep = LlBenchReport {
        dispatch_bytes: rows * token_bytes,
        combine_bytes: rows * 2 * cfg.hidden as u64,
        ..LlBenchReport::default()
    };
    let mut y: Option<Vec<u16>> = None;
    for hook in [false, true] {
        for it in 0..p.warmup + p.iters {
            let t0 = Instant::now();
            let d = buf
                .low_latency_dispatch(&LlDispatchArgs {
                    x: &me.x,
                    topk_idx: &me.topk_idx,
                    use_fp8: p.use_fp8,
                    round_scale: p.round_scale,
                    return_recv_hook: hook,
                })?
                .complete(buf)?;
            let td = t0.elapsed().as_secs_f64();
            check_ll_dispatch(rank, &d, &want_d, cfg.hidden, false)?;
            // The expert outputs are the same every iteration (checked above): convert once.
            let x = match &y {
                Some(x) => x,
                None => y.insert(ll_combine_input(&d.recv_x, &d.recv_count, cfg.hidden)?),
            };
            let t1 = Instant::now();
            let c = buf
                .low_latency_combine(&LlCombineArgs {
                    x,
                    topk_idx: &me.topk_idx,
                    topk_weights: &me.topk_weights,
                    handle: &d.handle,
                    return_recv_hook: hook,
                })?
                .complete(buf)?;
            let tc = t1.elapsed().as_secs_f64();
            if c.combined_x != want_c {
                return Err(Error::Other(format!(
                    "rank {rank}: low-latency combine differs from the reference (iteration {it}, hook {hook})"
                )));
            }
            if it >= p.warmup {
                let (ds, cs) = if hook {
                    (&mut rep.dispatch_hook_s, &mut rep.combine_hook_s)
                } else {
                    (&mut rep.dispatch_s, &mut rep.combine_s)
                };
                ds.push(td);
                cs.push(tc);
            }
        }
    }
    Ok(rep)
}

#[cfg(test)]
mod tests {
    use super::*;
    use fabric_ep::protocol::config::EpSettings;

    fn inputs(rank: usize, one_way: bool) -> RankInputs {
        let mut s = EpSettings::new(rank, 2, 16, 128, 4);
        s.max_tokens_per_rank = 64;
        let cfg = EpConfig::new(s).unwrap();
        let p = NormalBenchParams {
            num_tokens: 64,
            seed: 7,
            drop_pct: 10,
            iters: 1,
            warmup: 0,
            combine_weights: true,
            one_way,
        };
        rank_inputs(&cfg, &p, rank).unwrap()
    }

    #[test]
    fn one_rank_reference_is_the_full_references_row() {
        for (fp8, round_scale) in [(false, false), (true, false), (true, true)] {
            let mut s = EpSettings::new(0, 3, 12, 256, 4);
            s.max_tokens_per_rank = 9;
            let cfg = EpConfig::new(s).unwrap();
            let p = LlBenchParams {
                tokens: vec![9, 0, 4],
                seed: 5,
                drop_pct: 20,
                use_fp8: fp8,
                round_scale,
                iters: 1,
                warmup: 0,
            };
            let inputs: Vec<LlRankInputs> =
                (0..3).map(|r| ll_rank_inputs(&cfg, &p, r).unwrap()).collect();
            let (d, c) = ll_reference(&cfg, &inputs, fp8, round_scale).unwrap();
            for r in 0..3 {
                let (dr, cr) = ll_reference_rank(&cfg, &inputs, r, fp8, round_scale).unwrap();
                assert_eq!(dr, d[r], "rank {r} dispatch, fp8 {fp8}");
                assert_eq!(cr, c[r], "rank {r} combine, fp8 {fp8}");
            }
            assert!(c[0].iter().any(|&v| v != 0), "a combine of all zeros proves nothing");
        }
    }

    #[test]
    fn one_way_keeps_the_other_ranks_tokens_home() {
        // Rank 0 routes as before; rank 1 only to its own experts 8..16, distinct per token,
        // with -1 entries still drawn.
        assert_eq!(inputs(0, true).topk_idx, inputs(0, false).topk_idx);
        let idx = inputs(1, true).topk_idx;
        assert!(idx.iter().any(|&e| e < 0), "drop_pct still applies");
        for row in idx.chunks(4) {
            let v: Vec<i64> = row.iter().copied().filter(|&e| e >= 0).collect();
            assert!(v.iter().all(|&e| (8..16).contains(&e)), "row {row:?} leaves rank 1");
            let mut d = v.clone();
            d.sort_unstable();
            d.dedup();
            assert_eq!(d.len(), v.len(), "row {row:?} repeats an expert");
        }
        // Without it rank 1 sends to rank 0 too.
        assert!(inputs(1, false).topk_idx.iter().any(|&e| (0..8).contains(&e)));
    }
}
