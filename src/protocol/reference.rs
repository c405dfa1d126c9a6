//! Single-process reference of both modes, computed from ALL ranks' inputs: the oracle every
//! backend is tested against. Deliberately plain loops, independent of plan/'s math, so the
//! two can check each other.
//!
//! One file: the oracle is deliberately plain and kept in one place, both modes beside the input
//! checks they share, so it can be read and audited as a whole.
//!
//! Conventions: rank `r` holds global experts `r * L .. (r + 1) * L`, `L = num_experts /
//! num_ranks`; `topk_idx` entries are global expert ids (i64), `-1` = no expert; bf16 travels as
//! its `u16` bits; fp8 is e4m3fn bytes plus f32 scales per 128 channels. Sums are fp32 in a
//! fixed order (normal combine: destination ranks ascending; low-latency combine: `k`
//! ascending, each step one fused multiply-add `acc = fma(y, w, acc)`) and rounded to bf16
//! once, round to nearest even.

use std::collections::HashMap;

use super::quant::{bf16_to_f32, f32_to_bf16, quantize_row_bf16, FP8_GROUP};
use crate::{Error, Result};

/// One rank's tokens, borrowed.
#[derive(Clone, Copy, Debug)]
pub enum TokensRef<'a> {
    /// `x [num_tokens, hidden]` bf16 bits.
    Bf16(&'a [u16]),
    /// `x [num_tokens, hidden]` e4m3fn, `scales [num_tokens, hidden / 128]` f32.
    Fp8 { x: &'a [u8], scales: &'a [f32] },
}

/// Tokens, owned (same shapes as [`TokensRef`]).
#[derive(Clone, Debug, PartialEq)]
pub enum Tokens {
    Bf16(Vec<u16>),
    Fp8 { x: Vec<u8>, scales: Vec<f32> },
}

impl Tokens {
    /// A borrowed view (what dispatch takes).
    pub fn as_ref(&self) -> TokensRef<'_> {
        match self {
            Tokens::Bf16(v) => TokensRef::Bf16(v),
            Tokens::Fp8 { x, scales } => TokensRef::Fp8 { x, scales },
        }
    }
}

impl TokensRef<'_> {
    /// Rows, after checking the shapes against `hidden`.
    fn num_rows(&self, hidden: usize) -> Result<usize> {
        match *self {
            TokensRef::Bf16(x) => {
                if x.len() % hidden != 0 {
                    return Err(Error::arg(
                        "x",
                        format!("length {} is not a multiple of hidden {hidden}", x.len()),
                    ));
                }
                Ok(x.len() / hidden)
            }
            TokensRef::Fp8 { x, scales } => {
                if hidden % FP8_GROUP != 0 {
                    return Err(Error::arg(
                        "hidden",
                        format!("{hidden} is not a multiple of 128, as fp8 needs"),
                    ));
                }
                if x.len() % hidden != 0 {
                    return Err(Error::arg(
                        "x",
                        format!("length {} is not a multiple of hidden {hidden}", x.len()),
                    ));
                }
                let t = x.len() / hidden;
                if scales.len() != t * (hidden / FP8_GROUP) {
                    return Err(Error::arg(
                        "scales",
                        format!("length {}, expected {t} * {}", scales.len(), hidden / FP8_GROUP),
                    ));
                }
                Ok(t)
            }
        }
    }
}

fn check_common(
    num_ranks: usize,
    num_experts: usize,
    hidden: usize,
    num_topk: usize,
) -> Result<usize> {
    if num_ranks == 0 {
        return Err(Error::arg("inputs", "no ranks"));
    }
    if num_experts == 0 || num_experts % num_ranks != 0 {
        return Err(Error::arg(
            "num_experts",
            format!("{num_experts} is not a positive multiple of num_ranks {num_ranks}"),
        ));
    }
    if hidden == 0 || hidden % 8 != 0 {
        return Err(Error::arg("hidden", format!("{hidden} is not a positive multiple of 8")));
    }
    if num_topk == 0 || num_topk > num_experts {
        return Err(Error::arg("num_topk", format!("{num_topk} not in 1..={num_experts}")));
    }
    Ok(num_experts / num_ranks)
}

fn check_topk(
    topk_idx: &[i64],
    num_tokens: usize,
    num_topk: usize,
    num_experts: usize,
    distinct: bool,
) -> Result<()> {
    if topk_idx.len() != num_tokens * num_topk {
        return Err(Error::arg(
            "topk_idx",
            format!("length {}, expected {num_tokens} * {num_topk}", topk_idx.len()),
        ));
    }
    for t in 0..num_tokens {
        for k in 0..num_topk {
            let g = topk_idx[t * num_topk + k];
            if g < -1 || g >= num_experts as i64 {
                return Err(Error::arg(
                    "topk_idx",
                    format!("token {t}, k {k}: expert {g} out of range"),
                ));
            }
            if distinct && g >= 0 && (0..k).any(|j| topk_idx[t * num_topk + j] == g) {
                return Err(Error::arg("topk_idx", format!("token {t}, k {k}: expert {g} twice")));
            }
        }
    }
    Ok(())
}

fn check_weights(w: &[f32], num_tokens: usize, num_topk: usize) -> Result<()> {
    if w.len() != num_tokens * num_topk {
        return Err(Error::arg(
            "topk_weights",
            format!("length {}, expected {num_tokens} * {num_topk}", w.len()),
        ));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Normal mode
// ---------------------------------------------------------------------------------------------

/// Settings of a normal-mode reference run (`num_ranks` = number of inputs).
#[derive(Clone, Copy, Debug)]
pub struct NormalParams {
    pub num_experts: usize,
    pub hidden: usize,
    pub num_topk: usize,
    /// Tokens per local expert are rounded up to this (>= 1).
    pub expert_alignment: usize,
    /// Fixed output rows (DeepEP's `num_worst_tokens`), or `None` for exactly the received.
    pub num_worst_tokens: Option<usize>,
}

/// One rank's normal-mode dispatch input.
#[derive(Clone, Copy, Debug)]
pub struct NormalRankInput<'a> {
    pub x: TokensRef<'a>,
    /// `[num_tokens, num_topk]` global expert ids, -1 = none.
    pub topk_idx: &'a [i64],
    /// `[num_tokens, num_topk]`.
    pub topk_weights: &'a [f32],
}

/// One rank's normal-mode dispatch result.
#[derive(Clone, Debug, PartialEq)]
pub struct NormalDispatchOut {
    /// `[rows, hidden]` (fp8: plus `scales [rows, hidden / 128]`): each token once per
    /// destination rank, grouped by source rank ascending, token order within a source.
    /// `rows = num_worst_tokens` when given (rows past `num_recv_tokens` are zero), else
    /// `num_recv_tokens`.
    pub recv_x: Tokens,
    /// `[rows, num_topk]` local expert ids; -1 where the expert is elsewhere, the entry was -1,
    /// or the row is padding.
    pub recv_topk_idx: Vec<i64>,
    /// `[rows, num_topk]`; 0 where `recv_topk_idx` is -1.
    pub recv_topk_weights: Vec<f32>,
    /// Real rows received.
    pub num_recv_tokens: usize,
    /// `[num_ranks + 1]` prefix: rows from source `s` are `rank_prefix[s]..rank_prefix[s + 1]`.
    pub rank_prefix: Vec<usize>,
    /// `[num_recv_tokens]` source rank of each row.
    pub recv_src_rank: Vec<i32>,
    /// `[num_recv_tokens]` token index of each row on its source.
    pub recv_src_idx: Vec<i32>,
    /// `[L]` topk entries naming each local expert, rounded up to `expert_alignment`.
    pub num_recv_tokens_per_expert: Vec<usize>,
    /// This rank's own input tokens (the rows of its combine output).
    pub num_tokens: usize,
}

/// Normal dispatch for every rank at once; `inputs[r]` is rank r's input.
pub fn normal_dispatch(
    p: &NormalParams,
    inputs: &[NormalRankInput<'_>],
) -> Result<Vec<NormalDispatchOut>> {
    let r_count = inputs.len();
    let l = check_common(r_count, p.num_experts, p.hidden, p.num_topk)?;
    if p.expert_alignment == 0 {
        return Err(Error::arg("expert_alignment", "must be at least 1"));
    }
    let (h, k) = (p.hidden, p.num_topk);
    let fp8 = matches!(inputs[0].x, TokensRef::Fp8 { .. });
    let mut num_tokens = Vec::with_capacity(r_count);
    for inp in inputs {
        if fp8 != matches!(inp.x, TokensRef::Fp8 { .. }) {
            return Err(Error::arg("x", "ranks disagree on bf16 vs fp8"));
        }
        let t = inp.x.num_rows(h)?;
        check_topk(inp.topk_idx, t, k, p.num_experts, false)?;
        check_weights(inp.topk_weights, t, k)?;
        num_tokens.push(t);
    }
    let groups = h / FP8_GROUP;

    let mut outs = Vec::with_capacity(r_count);
    for dst in 0..r_count {
        let (lo, hi) = ((dst * l) as i64, ((dst + 1) * l) as i64);
        let mut x_bf16 = Vec::new();
        let mut x_fp8 = Vec::new();
        let mut scales = Vec::new();
        let mut recv_topk_idx = Vec::new();
        let mut recv_topk_weights = Vec::new();
        let mut recv_src_rank = Vec::new();
        let mut recv_src_idx = Vec::new();
        let mut rank_prefix = vec![0usize];
        let mut per_expert = vec![0usize; l];
        for (src, inp) in inputs.iter().enumerate() {
            for t in 0..num_tokens[src] {
                let row = &inp.topk_idx[t * k..(t + 1) * k];
                if !row.iter().any(|&g| g >= lo && g < hi) {
                    continue;
                }
                match inp.x {
                    TokensRef::Bf16(x) => x_bf16.extend_from_slice(&x[t * h..(t + 1) * h]),
                    TokensRef::Fp8 { x, scales: s } => {
                        x_fp8.extend_from_slice(&x[t * h..(t + 1) * h]);
                        scales.extend_from_slice(&s[t * groups..(t + 1) * groups]);
                    }
                }
                for (j, &g) in row.iter().enumerate() {
                    if g >= lo && g < hi {
                        recv_topk_idx.push(g - lo);
                        recv_topk_weights.push(inp.topk_weights[t * k + j]);
                        per_expert[(g - lo) as usize] += 1;
                    } else {
                        recv_topk_idx.push(-1);
                        recv_topk_weights.push(0.0);
                    }
                }
                recv_src_rank.push(src as i32);
                recv_src_idx.push(t as i32);
            }
            rank_prefix.push(recv_src_rank.len());
        }
        let num_recv_tokens = recv_src_rank.len();
        let rows = match p.num_worst_tokens {
            None => num_recv_tokens,
            Some(w) if w >= num_recv_tokens => w,
            Some(w) => {
                return Err(Error::arg(
                    "num_worst_tokens",
                    format!("rank {dst} receives {num_recv_tokens} tokens, more than {w}"),
                ))
            }
        };
        x_bf16.resize(if fp8 { 0 } else { rows * h }, 0);
        x_fp8.resize(if fp8 { rows * h } else { 0 }, 0);
        scales.resize(if fp8 { rows * groups } else { 0 }, 0.0);
        recv_topk_idx.resize(rows * k, -1);
        recv_topk_weights.resize(rows * k, 0.0);
        let a = p.expert_alignment;
        outs.push(NormalDispatchOut {
            recv_x: if fp8 { Tokens::Fp8 { x: x_fp8, scales } } else { Tokens::Bf16(x_bf16) },
            recv_topk_idx,
            recv_topk_weights,
            num_recv_tokens,
            rank_prefix,
            recv_src_rank,
            recv_src_idx,
            num_recv_tokens_per_expert: per_expert.iter().map(|c| c.div_ceil(a) * a).collect(),
            num_tokens: num_tokens[dst],
        });
    }
    Ok(outs)
}

/// One rank's normal-mode combine input.
#[derive(Clone, Copy, Debug)]
pub struct NormalCombineInput<'a> {
    /// `[rows, hidden]` bf16, `rows` as in that rank's `recv_x`; only the first
    /// `num_recv_tokens` rows are sent back.
    pub x: &'a [u16],
    /// Optional `[rows, num_topk]` weights, summed back like `x`.
    pub topk_weights: Option<&'a [f32]>,
}

/// One rank's normal-mode combine result.
#[derive(Clone, Debug, PartialEq)]
pub struct NormalCombineOut {
    /// `[num_tokens, hidden]` bf16: per token, the fp32 sum over the ranks it went to
    /// (ascending) of what each returned; 0 for tokens that went nowhere.
    pub combined_x: Vec<u16>,
    /// `[num_tokens, num_topk]` when weights were given: the same sum over the weights.
    pub combined_topk_weights: Option<Vec<f32>>,
}

/// Normal combine for every rank at once, using `dispatched` (from [`normal_dispatch`]) as the
/// handle.
pub fn normal_combine(
    p: &NormalParams,
    dispatched: &[NormalDispatchOut],
    inputs: &[NormalCombineInput<'_>],
) -> Result<Vec<NormalCombineOut>> {
    normal_combine_grouped(p, dispatched, inputs, dispatched.len().max(1))
}

/// [`normal_combine`] summed as the hierarchy sums (`ep::hier`): destination ranks in groups of
/// `group` consecutive ranks (a node); each group's fp32 partial (ranks ascending) is rounded to
/// bf16 (the gateway's output), then the partials are summed in fp32 (groups ascending) and
/// rounded again. Weights: the same grouping, without rounding. `group = num_ranks` is
/// [`normal_combine`] exactly (a bf16 value converts to fp32 and back unchanged).
pub fn normal_combine_grouped(
    p: &NormalParams,
    dispatched: &[NormalDispatchOut],
    inputs: &[NormalCombineInput<'_>],
    group: usize,
) -> Result<Vec<NormalCombineOut>> {
    let r_count = dispatched.len();
    if group == 0 || r_count % group != 0 {
        return Err(Error::arg("group", format!("{group} does not divide {r_count} ranks")));
    }
    check_common(r_count, p.num_experts, p.hidden, p.num_topk)?;
    if inputs.len() != r_count {
        return Err(Error::arg("inputs", format!("{} inputs for {r_count} ranks", inputs.len())));
    }
    let (h, k) = (p.hidden, p.num_topk);
    let with_w = inputs[0].topk_weights.is_some();
    for (r, inp) in inputs.iter().enumerate() {
        let rows = dispatched[r].recv_topk_idx.len() / k;
        if inp.x.len() != rows * h {
            return Err(Error::arg(
                "x",
                format!("rank {r}: length {}, expected {rows} * {h}", inp.x.len()),
            ));
        }
        match inp.topk_weights {
            Some(w) if w.len() != rows * k => {
                return Err(Error::arg(
                    "topk_weights",
                    format!("rank {r}: length {}, expected {rows} * {k}", w.len()),
                ))
            }
            None if with_w => return Err(Error::arg("topk_weights", "given on some ranks only")),
            Some(_) if !with_w => {
                return Err(Error::arg("topk_weights", "given on some ranks only"))
            }
            _ => {}
        }
    }
    let zeros = |w: usize| -> Vec<Vec<f32>> {
        dispatched.iter().map(|d| vec![0f32; d.num_tokens * w]).collect()
    };
    let (mut acc_x, mut acc_w) = (zeros(h), zeros(k));
    let (mut part_x, mut part_w) = (zeros(h), zeros(k));
    // Destination ranks ascending: the fixed fp32 summation order.
    for (r, d) in dispatched.iter().enumerate() {
        for row in 0..d.num_recv_tokens {
            let (s, t) = (d.recv_src_rank[row] as usize, d.recv_src_idx[row] as usize);
            if s >= r_count || t >= dispatched[s].num_tokens {
                return Err(Error::arg(
                    "dispatched",
                    format!("rank {r} row {row}: bad source ({s}, {t})"),
                ));
            }
            for c in 0..h {
                part_x[s][t * h + c] += bf16_to_f32(inputs[r].x[row * h + c]);
            }
            if let Some(w) = inputs[r].topk_weights {
                for j in 0..k {
                    part_w[s][t * k + j] += w[row * k + j];
                }
            }
        }
        if (r + 1) % group == 0 {
            for (acc, part) in acc_x.iter_mut().zip(&mut part_x) {
                for (a, v) in acc.iter_mut().zip(part.iter_mut()) {
                    *a += bf16_to_f32(f32_to_bf16(*v));
                    *v = 0.0;
                }
            }
            for (acc, part) in acc_w.iter_mut().zip(&mut part_w) {
                for (a, v) in acc.iter_mut().zip(part.iter_mut()) {
                    *a += *v;
                    *v = 0.0;
                }
            }
        }
    }
    Ok(acc_x
        .into_iter()
        .zip(acc_w)
        .map(|(x, w)| NormalCombineOut {
            combined_x: x.into_iter().map(f32_to_bf16).collect(),
            combined_topk_weights: with_w.then_some(w),
        })
        .collect())
}

// ---------------------------------------------------------------------------------------------
// Low-latency mode
// ---------------------------------------------------------------------------------------------

/// Settings of a low-latency reference run (`num_ranks` = number of inputs).
#[derive(Clone, Copy, Debug)]
pub struct LlParams {
    pub num_experts: usize,
    pub hidden: usize,
    pub num_topk: usize,
    pub max_tokens_per_rank: usize,
    /// Cast the bf16 input to e4m3 with per-128 scales.
    pub use_fp8: bool,
    /// Power-of-two scales (DeepEP's `round_scale`).
    pub round_scale: bool,
}

/// One rank's low-latency dispatch input.
#[derive(Clone, Copy, Debug)]
pub struct LlRankInput<'a> {
    /// `[num_tokens <= max_tokens_per_rank, hidden]` bf16.
    pub x: &'a [u16],
    /// `[num_tokens, num_topk]` global expert ids, -1 = none, distinct per token.
    pub topk_idx: &'a [i64],
}

/// One rank's low-latency dispatch result. `S = num_ranks * max_tokens_per_rank`.
#[derive(Clone, Debug, PartialEq)]
pub struct LlDispatchOut {
    /// `[L, S, hidden]` (fp8: plus `scales [L, S, hidden / 128]`); for local expert e, rows
    /// from source 0 first, then source 1, ..., sender's token order within a source; rows past
    /// `recv_count[e]` are zero.
    pub recv_x: Tokens,
    /// `[L]` rows per local expert.
    pub recv_count: Vec<u32>,
    /// `[L, S]` source rank per row, -1 past the count.
    pub recv_src_rank: Vec<i32>,
    /// `[L, S]` token index on the source per row, -1 past the count.
    pub recv_src_idx: Vec<i32>,
    /// `[L, num_ranks]` `(begin, count)` of each source's rows within `recv_x[e]`.
    pub layout_range: Vec<(u32, u32)>,
    /// This rank's own input tokens.
    pub num_tokens: usize,
}

fn ll_check(p: &LlParams, num_ranks: usize) -> Result<usize> {
    let l = check_common(num_ranks, p.num_experts, p.hidden, p.num_topk)?;
    if p.use_fp8 && p.hidden % FP8_GROUP != 0 {
        return Err(Error::arg(
            "hidden",
            format!("{} is not a multiple of 128, as fp8 needs", p.hidden),
        ));
    }
    if p.max_tokens_per_rank == 0 {
        return Err(Error::arg("max_tokens_per_rank", "must be at least 1"));
    }
    Ok(l)
}

/// Low-latency dispatch for every rank at once.
pub fn ll_dispatch(p: &LlParams, inputs: &[LlRankInput<'_>]) -> Result<Vec<LlDispatchOut>> {
    (0..inputs.len()).map(|dst| ll_dispatch_for(p, inputs, dst)).collect()
}

/// [`ll_dispatch`]'s output of rank `dst` alone (a process checking one rank needs no other
/// rank's `[L, S, hidden]` output).
pub fn ll_dispatch_for(
    p: &LlParams,
    inputs: &[LlRankInput<'_>],
    dst: usize,
) -> Result<LlDispatchOut> {
    let r_count = inputs.len();
    let l = ll_check(p, r_count)?;
    if dst >= r_count {
        return Err(Error::arg("dst", format!("{dst} not in 0..{r_count}")));
    }
    let (h, k, m) = (p.hidden, p.num_topk, p.max_tokens_per_rank);
    let mut num_tokens = Vec::new();
    for inp in inputs {
        if inp.x.len() % h != 0 {
            return Err(Error::arg(
                "x",
                format!("length {} is not a multiple of hidden {h}", inp.x.len()),
            ));
        }
        let t = inp.x.len() / h;
        if t > m {
            return Err(Error::arg("x", format!("{t} tokens, more than max_tokens_per_rank {m}")));
        }
        check_topk(inp.topk_idx, t, k, p.num_experts, true)?;
        num_tokens.push(t);
    }
    let s_rows = r_count * m;
    let groups = h / FP8_GROUP;
    let mut x = vec![0u16; l * s_rows * h];
    let mut src_rank = vec![-1i32; l * s_rows];
    let mut src_idx = vec![-1i32; l * s_rows];
    let mut recv_count = vec![0u32; l];
    let mut layout_range = vec![(0u32, 0u32); l * r_count];
    for e in 0..l {
        let g = (dst * l + e) as i64;
        for (src, inp) in inputs.iter().enumerate() {
            let begin = recv_count[e];
            for t in 0..num_tokens[src] {
                if inp.topk_idx[t * k..(t + 1) * k].contains(&g) {
                    let row = e * s_rows + recv_count[e] as usize;
                    x[row * h..(row + 1) * h].copy_from_slice(&inp.x[t * h..(t + 1) * h]);
                    src_rank[row] = src as i32;
                    src_idx[row] = t as i32;
                    recv_count[e] += 1;
                }
            }
            layout_range[e * r_count + src] = (begin, recv_count[e] - begin);
        }
    }
    let recv_x = if p.use_fp8 {
        let mut q = vec![0u8; x.len()];
        let mut scales = vec![0f32; l * s_rows * groups];
        for (e, &count) in recv_count.iter().enumerate() {
            for i in 0..count as usize {
                let row = e * s_rows + i;
                quantize_row_bf16(
                    &x[row * h..(row + 1) * h],
                    p.round_scale,
                    &mut q[row * h..(row + 1) * h],
                    &mut scales[row * groups..(row + 1) * groups],
                )?;
            }
        }
        Tokens::Fp8 { x: q, scales }
    } else {
        Tokens::Bf16(x)
    };
    Ok(LlDispatchOut {
        recv_x,
        recv_count,
        recv_src_rank: src_rank,
        recv_src_idx: src_idx,
        layout_range,
        num_tokens: num_tokens[dst],
    })
}

/// One rank's low-latency combine input.
#[derive(Clone, Copy, Debug)]
pub struct LlCombineInput<'a> {
    /// `[L, num_ranks * max_tokens_per_rank, hidden]` bf16 expert outputs, rows as dispatched.
    pub x: &'a [u16],
    /// This rank's original `[num_tokens, num_topk]` ids (as passed to dispatch).
    pub topk_idx: &'a [i64],
    /// `[num_tokens, num_topk]`.
    pub topk_weights: &'a [f32],
}

/// Low-latency combine for every rank at once: per token, `sum_k w[k] * y[expert k][row of the
/// token]` over entries that are not -1, fp32 in `k` order, bf16 out `[num_tokens, hidden]`.
pub fn ll_combine(
    p: &LlParams,
    dispatched: &[LlDispatchOut],
    inputs: &[LlCombineInput<'_>],
) -> Result<Vec<Vec<u16>>> {
    let r_count = dispatched.len();
    let l = ll_check(p, r_count)?;
    if inputs.len() != r_count {
        return Err(Error::arg("inputs", format!("{} inputs for {r_count} ranks", inputs.len())));
    }
    let (h, k) = (p.hidden, p.num_topk);
    let s_rows = r_count * p.max_tokens_per_rank;
    // (expert rank, local expert, source rank, source token) -> row, from the handle.
    let mut where_row: HashMap<(usize, usize, i32, i32), usize> = HashMap::new();
    for (r, d) in dispatched.iter().enumerate() {
        for e in 0..l {
            for i in 0..d.recv_count[e] as usize {
                let row = e * s_rows + i;
                where_row.insert((r, e, d.recv_src_rank[row], d.recv_src_idx[row]), row);
            }
        }
    }
    for (r, inp) in inputs.iter().enumerate() {
        if inp.x.len() != l * s_rows * h {
            return Err(Error::arg(
                "x",
                format!("rank {r}: length {}, expected {l} * {s_rows} * {h}", inp.x.len()),
            ));
        }
        let t = dispatched[r].num_tokens;
        check_topk(inp.topk_idx, t, k, p.num_experts, true)?;
        check_weights(inp.topk_weights, t, k)?;
    }
    let mut outs = Vec::new();
    for (s, inp) in inputs.iter().enumerate() {
        let out = ll_combine_rows(p, inp.topk_idx, inp.topk_weights, |t, j, g| {
            let (r, e) = (g / l, g % l);
            let row = *where_row.get(&(r, e, s as i32, t as i32)).ok_or_else(|| {
                Error::arg(
                    "topk_idx",
                    format!("rank {s} token {t} k {j}: expert {g} was not dispatched"),
                )
            })?;
            Ok(&inputs[r].x[row * h..(row + 1) * h])
        })?;
        outs.push(out);
    }
    Ok(outs)
}

/// The low-latency combine of one rank's tokens (`topk_idx`, `topk_weights` `[T, K]`):
/// `acc = fma(y, w, acc)` over each token's entries that are not -1, `k` ascending, fp32,
/// rounded to bf16 once; `expert_row(t, k, g)` is the `[hidden]` bf16 row expert `g` returned
/// for token `t`'s entry `k`. [`ll_combine`] is this with the rows looked up in every expert
/// rank's outputs.
pub fn ll_combine_rows<'a>(
    p: &LlParams,
    topk_idx: &[i64],
    topk_weights: &[f32],
    mut expert_row: impl FnMut(usize, usize, usize) -> Result<&'a [u16]>,
) -> Result<Vec<u16>> {
    let (h, k) = (p.hidden, p.num_topk);
    if k == 0 || topk_idx.len() % k != 0 {
        return Err(Error::arg("topk_idx", format!("length {} is not [T, {k}]", topk_idx.len())));
    }
    let t_count = topk_idx.len() / k;
    check_weights(topk_weights, t_count, k)?;
    let mut out = vec![0u16; t_count * h];
    let mut acc = vec![0f32; h];
    for t in 0..t_count {
        acc.fill(0.0);
        for j in 0..k {
            let g = topk_idx[t * k + j];
            if g < 0 {
                continue;
            }
            let w = topk_weights[t * k + j];
            let y = expert_row(t, j, g as usize)?;
            if y.len() != h {
                return Err(Error::arg("expert_row", format!("{} values, hidden is {h}", y.len())));
            }
            for c in 0..h {
                // Fused multiply-add, as nvcc contracts `acc += y * w` on the GPU.
                acc[c] = bf16_to_f32(y[c]).mul_add(w, acc[c]);
            }
        }
        for c in 0..h {
            out[t * h + c] = f32_to_bf16(acc[c]);
        }
    }
    Ok(out)
}

// Index loops over ranks/tokens/channels read closest to the math they check.
#[allow(clippy::needless_range_loop, clippy::type_complexity)]
#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::protocol::quant::{dequantize_row, quantize_bf16};
    use crate::util::SplitMix64;

    /// `[t, k]` distinct experts per token, each entry -1 with probability `p_mask`.
    pub(crate) fn random_topk(
        rng: &mut SplitMix64,
        t: usize,
        k: usize,
        e: usize,
        p_mask: f32,
    ) -> Vec<i64> {
        let mut out = Vec::with_capacity(t * k);
        for _ in 0..t {
            let mut row: Vec<i64> = Vec::new();
            while row.len() < k {
                let g = rng.below(e as u64) as i64;
                if !row.contains(&g) {
                    row.push(g);
                }
            }
            for g in &mut row {
                if rng.unit_f32() < p_mask {
                    *g = -1;
                }
            }
            out.extend(row);
        }
        out
    }

    pub(crate) fn random_bf16(rng: &mut SplitMix64, n: usize) -> Vec<u16> {
        (0..n).map(|_| f32_to_bf16((rng.unit_f32() - 0.5) * 8.0)).collect()
    }

    fn distinct_ranks(row: &[i64], l: usize) -> usize {
        let mut ranks: Vec<usize> =
            row.iter().filter(|&&g| g >= 0).map(|&g| g as usize / l).collect();
        ranks.sort();
        ranks.dedup();
        ranks.len()
    }

    #[test]
    fn normal_small_example_by_hand() {
        // 2 ranks, 4 experts (2 local), hidden 8, top-2.
        let h = 8;
        let x0: Vec<u16> = (0..3 * h as u16).collect(); // tokens 0..3 of rank 0
        let x1: Vec<u16> = (100..100 + 2 * h as u16).collect();
        let idx0 = [0, 1, /**/ 2, -1, /**/ 3, 0];
        let w0 = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6];
        let idx1 = [-1, -1, /**/ 1, 2];
        let w1 = [0.7, 0.8, 0.9, 1.0];
        let p = NormalParams {
            num_experts: 4,
            hidden: h,
            num_topk: 2,
            expert_alignment: 4,
            num_worst_tokens: None,
        };
        let inputs = [
            NormalRankInput { x: TokensRef::Bf16(&x0), topk_idx: &idx0, topk_weights: &w0 },
            NormalRankInput { x: TokensRef::Bf16(&x1), topk_idx: &idx1, topk_weights: &w1 },
        ];
        let out = normal_dispatch(&p, &inputs).unwrap();
        // Rank 0 (experts 0, 1): rank 0 tokens 0 and 2, then rank 1 token 1.
        let d0 = &out[0];
        assert_eq!(d0.rank_prefix, vec![0, 2, 3]);
        assert_eq!(d0.recv_src_rank, vec![0, 0, 1]);
        assert_eq!(d0.recv_src_idx, vec![0, 2, 1]);
        assert_eq!(d0.recv_topk_idx, vec![0, 1, -1, 0, 1, -1]);
        assert_eq!(d0.recv_topk_weights, vec![0.1, 0.2, 0.0, 0.6, 0.9, 0.0]);
        assert_eq!(d0.num_recv_tokens_per_expert, vec![4, 4]); // 2 and 2, aligned to 4
        let mut want = x0[0..h].to_vec();
        want.extend_from_slice(&x0[2 * h..3 * h]);
        want.extend_from_slice(&x1[h..2 * h]);
        assert_eq!(d0.recv_x, Tokens::Bf16(want));
        // Rank 1 (experts 2, 3): rank 0 tokens 1 and 2, rank 1 token 1.
        let d1 = &out[1];
        assert_eq!(d1.rank_prefix, vec![0, 2, 3]);
        assert_eq!(d1.recv_src_idx, vec![1, 2, 1]);
        assert_eq!(d1.recv_topk_idx, vec![0, -1, 1, -1, -1, 0]);
        assert_eq!(d1.recv_topk_weights, vec![0.3, 0.0, 0.5, 0.0, 0.0, 1.0]);
        assert_eq!(d1.num_recv_tokens_per_expert, vec![4, 4]); // 2 and 1, aligned

        // num_worst_tokens pads; too small is an error naming it.
        let pw = NormalParams { num_worst_tokens: Some(5), expert_alignment: 1, ..p };
        let outw = normal_dispatch(&pw, &inputs).unwrap();
        assert_eq!(outw[0].num_recv_tokens, 3);
        assert_eq!(outw[0].recv_topk_idx.len(), 10);
        assert_eq!(&outw[0].recv_topk_idx[6..], &[-1, -1, -1, -1]);
        assert_eq!(outw[0].num_recv_tokens_per_expert, vec![2, 2]);
        match &outw[0].recv_x {
            Tokens::Bf16(x) => assert_eq!(x.len(), 5 * h),
            _ => panic!(),
        }
        let pw = NormalParams { num_worst_tokens: Some(2), ..p };
        assert!(matches!(
            normal_dispatch(&pw, &inputs),
            Err(Error::InvalidArgument { arg: "num_worst_tokens", .. })
        ));
    }

    fn run_normal_identity(
        seed: u64,
        r: usize,
        e: usize,
        k: usize,
        h: usize,
        tokens: &[usize],
        p_mask: f32,
    ) {
        let mut rng = SplitMix64(seed);
        let l = e / r;
        let xs: Vec<Vec<u16>> = tokens.iter().map(|&t| random_bf16(&mut rng, t * h)).collect();
        let idxs: Vec<Vec<i64>> =
            tokens.iter().map(|&t| random_topk(&mut rng, t, k, e, p_mask)).collect();
        let ws: Vec<Vec<f32>> =
            tokens.iter().map(|&t| (0..t * k).map(|_| rng.unit_f32()).collect()).collect();
        let inputs: Vec<NormalRankInput> = (0..r)
            .map(|i| NormalRankInput {
                x: TokensRef::Bf16(&xs[i]),
                topk_idx: &idxs[i],
                topk_weights: &ws[i],
            })
            .collect();
        let p = NormalParams {
            num_experts: e,
            hidden: h,
            num_topk: k,
            expert_alignment: 1,
            num_worst_tokens: None,
        };
        let d = normal_dispatch(&p, &inputs).unwrap();
        // Every (token, rank) pair with an expert there arrives exactly once.
        let total: usize = d.iter().map(|o| o.num_recv_tokens).sum();
        let expect: usize = (0..r)
            .map(|i| {
                (0..tokens[i])
                    .map(|t| distinct_ranks(&idxs[i][t * k..(t + 1) * k], l))
                    .sum::<usize>()
            })
            .sum();
        assert_eq!(total, expect);
        for o in &d {
            for (e_local, &c) in o.num_recv_tokens_per_expert.iter().enumerate() {
                assert_eq!(c, o.recv_topk_idx.iter().filter(|&&v| v == e_local as i64).count());
            }
        }
        let recv: Vec<Vec<u16>> = d
            .iter()
            .map(|o| match &o.recv_x {
                Tokens::Bf16(x) => x.clone(),
                _ => unreachable!(),
            })
            .collect();
        let cin: Vec<NormalCombineInput> = (0..r)
            .map(|i| NormalCombineInput {
                x: &recv[i],
                topk_weights: Some(&d[i].recv_topk_weights),
            })
            .collect();
        let c = normal_combine(&p, &d, &cin).unwrap();
        for i in 0..r {
            for t in 0..tokens[i] {
                let n = distinct_ranks(&idxs[i][t * k..(t + 1) * k], l) as f32;
                for ch in 0..h {
                    let want = f32_to_bf16(bf16_to_f32(xs[i][t * h + ch]) * n);
                    // As values: a token that went nowhere is +0, `x * 0` may be -0.
                    let got = bf16_to_f32(c[i].combined_x[t * h + ch]);
                    assert_eq!(got, bf16_to_f32(want), "rank {i} token {t} ch {ch}");
                }
                let cw = c[i].combined_topk_weights.as_ref().unwrap();
                for j in 0..k {
                    let want = if idxs[i][t * k + j] >= 0 { ws[i][t * k + j] } else { 0.0 };
                    assert_eq!(cw[t * k + j], want);
                }
            }
        }
    }

    #[test]
    fn normal_identity_combine_is_x_times_distinct_ranks() {
        run_normal_identity(1, 4, 16, 4, 64, &[37, 50, 0, 13], 0.1);
        run_normal_identity(2, 1, 8, 2, 16, &[20], 0.0);
        run_normal_identity(3, 8, 64, 8, 32, &[10, 0, 0, 9, 11, 3, 0, 40], 0.2);
        run_normal_identity(4, 3, 3, 3, 8, &[5, 6, 7], 0.0); // every token to every rank
        run_normal_identity(5, 4, 8, 2, 8, &[16, 16, 16, 16], 1.0); // all -1
    }

    #[test]
    fn normal_all_tokens_to_one_expert_and_zero_token_ranks() {
        let (r, e, k, h) = (4, 8, 2, 16);
        let mut rng = SplitMix64(9);
        let tokens = [30, 0, 12, 0];
        let xs: Vec<Vec<u16>> = tokens.iter().map(|&t| random_bf16(&mut rng, t * h)).collect();
        let idxs: Vec<Vec<i64>> = tokens.iter().map(|&t| [5, -1].repeat(t)).collect();
        let ws: Vec<Vec<f32>> = tokens.iter().map(|&t| vec![1.0; t * k]).collect();
        let inputs: Vec<NormalRankInput> = (0..r)
            .map(|i| NormalRankInput {
                x: TokensRef::Bf16(&xs[i]),
                topk_idx: &idxs[i],
                topk_weights: &ws[i],
            })
            .collect();
        let p = NormalParams {
            num_experts: e,
            hidden: h,
            num_topk: k,
            expert_alignment: 8,
            num_worst_tokens: None,
        };
        let d = normal_dispatch(&p, &inputs).unwrap();
        assert_eq!(d.iter().map(|o| o.num_recv_tokens).collect::<Vec<_>>(), vec![0, 0, 42, 0]);
        assert_eq!(d[2].rank_prefix, vec![0, 30, 30, 42, 42]);
        assert_eq!(d[2].num_recv_tokens_per_expert, vec![0, 48]);
        assert_eq!(d[0].num_recv_tokens_per_expert, vec![0, 0]);
    }

    #[test]
    fn normal_fp8_passes_bytes_and_scales_through() {
        let (h, k) = (256, 2);
        let mut rng = SplitMix64(5);
        let x0 = random_bf16(&mut rng, 3 * h);
        let x1 = random_bf16(&mut rng, 2 * h);
        let (q0, s0) = quantize_bf16(&x0, h, false).unwrap();
        let (q1, s1) = quantize_bf16(&x1, h, true).unwrap();
        let idx0 = [0, 3, 1, -1, 2, 3];
        let idx1 = [3, 2, -1, -1];
        let w = [1.0f32; 6];
        let p = NormalParams {
            num_experts: 4,
            hidden: h,
            num_topk: k,
            expert_alignment: 1,
            num_worst_tokens: None,
        };
        let inputs = [
            NormalRankInput {
                x: TokensRef::Fp8 { x: &q0, scales: &s0 },
                topk_idx: &idx0,
                topk_weights: &w,
            },
            NormalRankInput {
                x: TokensRef::Fp8 { x: &q1, scales: &s1 },
                topk_idx: &idx1,
                topk_weights: &w[..4],
            },
        ];
        let d = normal_dispatch(&p, &inputs).unwrap();
        // Rank 1 (experts 2, 3): rank 0 tokens 0 and 2, rank 1 token 0.
        let Tokens::Fp8 { x, scales } = &d[1].recv_x else { panic!() };
        assert_eq!(&x[..h], &q0[..h]);
        assert_eq!(&x[h..2 * h], &q0[2 * h..3 * h]);
        assert_eq!(&x[2 * h..], &q1[..h]);
        assert_eq!(&scales[..2], &s0[..2]);
        assert_eq!(&scales[2..4], &s0[4..6]);
        assert_eq!(&scales[4..], &s1[..2]);
        // Mixed dtypes and bad shapes are argument errors.
        let bad = [
            inputs[0],
            NormalRankInput { x: TokensRef::Bf16(&x1), topk_idx: &idx1, topk_weights: &w[..4] },
        ];
        assert!(matches!(normal_dispatch(&p, &bad), Err(Error::InvalidArgument { arg: "x", .. })));
        let bad = [
            inputs[0],
            NormalRankInput { x: TokensRef::Fp8 { x: &q1, scales: &s1[1..] }, ..inputs[1] },
        ];
        assert!(matches!(
            normal_dispatch(&p, &bad),
            Err(Error::InvalidArgument { arg: "scales", .. })
        ));
        let idx_bad = [0, 4, 1, -1, 2, 3];
        let bad = [NormalRankInput { topk_idx: &idx_bad, ..inputs[0] }, inputs[1]];
        assert!(matches!(
            normal_dispatch(&p, &bad),
            Err(Error::InvalidArgument { arg: "topk_idx", .. })
        ));
    }

    fn ll_inputs(
        seed: u64,
        tokens: &[usize],
        k: usize,
        e: usize,
        h: usize,
        p_mask: f32,
    ) -> (Vec<Vec<u16>>, Vec<Vec<i64>>, Vec<Vec<f32>>) {
        let mut rng = SplitMix64(seed);
        let xs = tokens.iter().map(|&t| random_bf16(&mut rng, t * h)).collect();
        let idxs = tokens.iter().map(|&t| random_topk(&mut rng, t, k, e, p_mask)).collect();
        // Weights that are multiples of 1/8, so sums of products are exact in fp32.
        let ws = tokens
            .iter()
            .map(|&t| (0..t * k).map(|_| rng.below(9) as f32 / 8.0).collect())
            .collect();
        (xs, idxs, ws)
    }

    #[test]
    fn ll_small_example_by_hand() {
        // 2 ranks, 4 experts, hidden 8, top-2, max 3 tokens.
        let h = 8;
        let x0: Vec<u16> = (0..2 * h as u16).collect();
        let x1: Vec<u16> = (50..50 + 3 * h as u16).collect();
        let idx0 = [1, 2, /**/ 1, -1];
        let idx1 = [-1, 3, /**/ 1, 0, /**/ 2, 1];
        let p = LlParams {
            num_experts: 4,
            hidden: h,
            num_topk: 2,
            max_tokens_per_rank: 3,
            use_fp8: false,
            round_scale: false,
        };
        let d = ll_dispatch(
            &p,
            &[LlRankInput { x: &x0, topk_idx: &idx0 }, LlRankInput { x: &x1, topk_idx: &idx1 }],
        )
        .unwrap();
        let s = 6; // num_ranks * max_tokens
                   // Rank 0, local expert 1 (global 1): rank 0 tokens 0, 1, then rank 1 tokens 1, 2.
        assert_eq!(d[0].recv_count, vec![1, 4]);
        assert_eq!(&d[0].recv_src_rank[s..s + 5], &[0, 0, 1, 1, -1]);
        assert_eq!(&d[0].recv_src_idx[s..s + 5], &[0, 1, 1, 2, -1]);
        assert_eq!(d[0].layout_range, vec![(0, 0), (0, 1), (0, 2), (2, 2)]);
        let Tokens::Bf16(rx) = &d[0].recv_x else { panic!() };
        assert_eq!(&rx[s * h..(s + 1) * h], &x0[..h]);
        assert_eq!(&rx[(s + 3) * h..(s + 4) * h], &x1[2 * h..3 * h]);
        assert!(rx[(s + 4) * h..].iter().all(|&v| v == 0));
        // Rank 1: local expert 0 (global 2) gets rank 0 token 0, rank 1 token 2; local 1 gets rank 1 token 0.
        assert_eq!(d[1].recv_count, vec![2, 1]);
        assert_eq!(d[1].layout_range, vec![(0, 1), (1, 1), (0, 0), (0, 1)]);
    }

    #[test]
    fn ll_identity_combine_is_weighted_sum() {
        for (seed, tokens, k, e, h, mask) in [
            (1u64, vec![7usize, 0, 8, 3], 4usize, 16usize, 32usize, 0.2f32),
            (2, vec![8, 8], 2, 2, 16, 0.0), // every token to both experts
            (3, vec![5, 6, 0], 3, 3, 8, 1.0), // all -1
            (4, vec![1], 1, 4, 8, 0.0),
        ] {
            let m = 8;
            let r = tokens.len();
            let (xs, idxs, ws) = ll_inputs(seed, &tokens, k, e, h, mask);
            let p = LlParams {
                num_experts: e,
                hidden: h,
                num_topk: k,
                max_tokens_per_rank: m,
                use_fp8: false,
                round_scale: false,
            };
            let inputs: Vec<LlRankInput> =
                (0..r).map(|i| LlRankInput { x: &xs[i], topk_idx: &idxs[i] }).collect();
            let d = ll_dispatch(&p, &inputs).unwrap();
            // Each (token, expert) pair appears exactly once.
            let rows: u32 = d.iter().flat_map(|o| o.recv_count.iter()).sum();
            assert_eq!(rows as usize, idxs.iter().flatten().filter(|&&g| g >= 0).count());
            let ys: Vec<Vec<u16>> = d
                .iter()
                .map(|o| match &o.recv_x {
                    Tokens::Bf16(x) => x.clone(),
                    _ => unreachable!(),
                })
                .collect();
            let cin: Vec<LlCombineInput> = (0..r)
                .map(|i| LlCombineInput { x: &ys[i], topk_idx: &idxs[i], topk_weights: &ws[i] })
                .collect();
            let c = ll_combine(&p, &d, &cin).unwrap();
            for i in 0..r {
                for t in 0..tokens[i] {
                    let wsum: f32 =
                        (0..k).filter(|&j| idxs[i][t * k + j] >= 0).map(|j| ws[i][t * k + j]).sum();
                    for ch in 0..h {
                        let want = f32_to_bf16(bf16_to_f32(xs[i][t * h + ch]) * wsum);
                        assert_eq!(
                            bf16_to_f32(c[i][t * h + ch]),
                            bf16_to_f32(want),
                            "seed {seed} rank {i} token {t} ch {ch}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn ll_fp8_rows_are_the_cast_of_bf16_rows() {
        let (tokens, k, e, h) = (vec![6usize, 4], 2, 4, 256);
        let (xs, idxs, _) = ll_inputs(8, &tokens, k, e, h, 0.1);
        let m = 6;
        for round_scale in [false, true] {
            let p = LlParams {
                num_experts: e,
                hidden: h,
                num_topk: k,
                max_tokens_per_rank: m,
                use_fp8: true,
                round_scale,
            };
            let pb = LlParams { use_fp8: false, ..p };
            let inputs: Vec<LlRankInput> =
                (0..2).map(|i| LlRankInput { x: &xs[i], topk_idx: &idxs[i] }).collect();
            let d = ll_dispatch(&p, &inputs).unwrap();
            let db = ll_dispatch(&pb, &inputs).unwrap();
            for (o, ob) in d.iter().zip(&db) {
                assert_eq!(o.recv_src_idx, ob.recv_src_idx);
                let (Tokens::Fp8 { x, scales }, Tokens::Bf16(xb)) = (&o.recv_x, &ob.recv_x) else {
                    panic!()
                };
                let mut back = vec![0f32; h];
                for row in 0..x.len() / h {
                    dequantize_row(
                        &x[row * h..(row + 1) * h],
                        &scales[row * 2..row * 2 + 2],
                        &mut back,
                    )
                    .unwrap();
                    for c in 0..h {
                        let v = bf16_to_f32(xb[row * h + c]);
                        assert!((back[c] - v).abs() <= v.abs() / 16.0 + 2e-3, "{} vs {v}", back[c]);
                    }
                }
            }
        }
    }

    #[test]
    fn ll_bad_input_is_an_argument_error() {
        let h = 8;
        let x = vec![0u16; 4 * h];
        let idx = vec![0i64; 4];
        let p = LlParams {
            num_experts: 2,
            hidden: h,
            num_topk: 1,
            max_tokens_per_rank: 3,
            use_fp8: false,
            round_scale: false,
        };
        let e = ll_dispatch(
            &p,
            &[
                LlRankInput { x: &x, topk_idx: &idx },
                LlRankInput { x: &x[..h], topk_idx: &idx[..1] },
            ],
        );
        assert!(matches!(e, Err(Error::InvalidArgument { arg: "x", .. })), "{e:?}");
        let p2 = LlParams { num_topk: 2, max_tokens_per_rank: 4, ..p };
        let dup = [1i64, 1, 0, -1, 0, 1, -1, -1];
        let e = ll_dispatch(
            &p2,
            &[LlRankInput { x: &x, topk_idx: &dup }, LlRankInput { x: &x, topk_idx: &dup }],
        );
        assert!(matches!(e, Err(Error::InvalidArgument { arg: "topk_idx", .. })), "{e:?}");
        let p3 = LlParams { num_experts: 3, ..p };
        let e = ll_dispatch(&p3, &[LlRankInput { x: &x[..h], topk_idx: &idx[..1] }; 2]);
        assert!(matches!(e, Err(Error::InvalidArgument { arg: "num_experts", .. })), "{e:?}");
        let p4 = LlParams { use_fp8: true, ..p };
        let e = ll_dispatch(&p4, &[LlRankInput { x: &x[..h], topk_idx: &idx[..1] }; 2]);
        assert!(matches!(e, Err(Error::InvalidArgument { arg: "hidden", .. })), "{e:?}");
    }
}
