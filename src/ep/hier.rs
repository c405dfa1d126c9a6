//! DeepEP's internode hierarchy for normal mode, host backend: one network copy of a token per
//! destination *node*, then a fan-out inside the node; built from two [`Buffer`]s so it reuses
//! the direct path's protocol, proxy and transport unchanged.
//!
//! ```text
//!  rank (m, l) --rail buffer (ranks with local index l, one per node)--> gateway (n, l)
//!  gateway (n, l) --node buffer (the ranks of node n)--> rank (n, j)
//! ```
//!
//! * **Rail stage** ([`Buffer`] over the `nodes` ranks with this rank's local index, 1 rank per
//!   node, the world's experts): rail rank `n` owns exactly node `n`'s experts, so a token goes
//!   once to every node where it has an expert, to the gateway with the sender's local index
//!   (DeepEP's rule), carrying its top-k as node-local expert ids.
//! * **Node stage** ([`Buffer`] over the node's ranks, the node's experts, hidden + 128): the
//!   gateway forwards what it received. The 128 extra channels are a metadata lane: the source
//!   node and the token's index on its source (bytes copied verbatim by both dtypes' dispatch),
//!   so the final rank can restore the direct path's row order (source rank ascending, token
//!   order within a source) and source indices.
//! * **Combine** mirrors it: node-stage combine to the gateway (the node's partial sum, rounded
//!   to bf16 there, as DeepEP's gateway does), then rail-stage combine to the source.
//!
//! The outputs equal the direct path's exactly in dispatch; the combine's sum is grouped by node
//! (`reference::normal_combine_grouped` with `ranks_per_node`), so it may differ from the
//! direct sum by the partial's bf16 rounding.
//!
//! NOTES: the stages are whole dispatches, with a host pass between them that widens rows and,
//! at the end, reorders them. The GPU backend's hierarchy ([`super::hier_gpu`]) composes the same
//! stages with device copies instead, and shares this module's sub-communicators and config
//! check. The pure part both use (stage settings, the metadata lane, the final order) is
//! [`crate::protocol::hier`]. DeepEP's gateway forwards from its receive buffer inside the
//! kernel; that is not built (docs/ARCHITECTURE.md, "Internode: direct per-rank sends vs
//! DeepEP's hierarchy").

use std::sync::Arc;

use super::buffer::{
    check_boot, Backend, Buffer, BufferOptions, CombineArgs, CombineOutput, DispatchArgs,
    OwnedTokens, Tokens, TransportKind,
};
use super::handle::DispatchHandle;
use crate::bootstrap::{Bootstrap, BootstrapError};
use crate::protocol::config::EpConfig;
use crate::protocol::hier::{
    final_order, narrow, permute_rows, read_meta, rows_by_source, stage_settings, widen,
    META_CHANNELS,
};
use crate::proxy::{Lagging, ProxyError};
use crate::{Error, Result};

/// Tag mixed into the world's config hash exchange (a hierarchical rank never connects to a
/// direct one).
const HIER_HASH_TAG: u64 = 0x6869_6572_6172_6368; // "hierarch"

/// A sub-communicator of a parent bootstrap: every collective is the parent's (all ranks call
/// it in the same order), filtered to `members`.
pub(crate) struct SubGroup {
    parent: Arc<dyn Bootstrap>,
    members: Vec<usize>,
    index: usize,
    /// The members share one node (the node stage) or are one per node (the rail stage).
    one_node: bool,
}

impl Bootstrap for SubGroup {
    fn rank(&self) -> usize {
        self.index
    }
    fn world_size(&self) -> usize {
        self.members.len()
    }
    fn local_rank(&self) -> usize {
        if self.one_node {
            self.index
        } else {
            0
        }
    }
    fn local_world_size(&self) -> usize {
        if self.one_node {
            self.members.len()
        } else {
            1
        }
    }
    fn all_gather(&self, data: &[u8]) -> std::result::Result<Vec<Vec<u8>>, BootstrapError> {
        let mut all = self.parent.all_gather(data)?;
        Ok(self.members.iter().map(|&m| std::mem::take(&mut all[m])).collect())
    }
    // Deaths are not mapped into the stages: a stage sees only its members, and a rank
    // blocked on a member that left because of a rank outside the stage would name the
    // member, not the cause; the stages' bounded waits name job ranks instead (`world_err`).
    // A stage's own timeout is still reported to the job, in job ranks.
    fn report_unresponsive(&self, peers: &[usize]) {
        let job: Vec<usize> = peers.iter().filter_map(|&p| self.members.get(p).copied()).collect();
        self.parent.report_unresponsive(&job);
    }
}

/// Arguments of a hierarchical dispatch (as [`DispatchArgs`], without `layout`: each stage
/// computes its own).
#[derive(Clone, Copy, Debug)]
pub struct HierDispatchArgs<'a> {
    pub x: Tokens<'a>,
    pub topk_idx: Option<&'a [i64]>,
    pub topk_weights: Option<&'a [f32]>,
    /// Cached-handle dispatch: both stages reuse their routing (no notify).
    pub handle: Option<&'a HierHandle>,
    pub expert_alignment: usize,
    pub num_worst_tokens: Option<usize>,
}

impl Default for HierDispatchArgs<'_> {
    fn default() -> Self {
        HierDispatchArgs {
            x: Tokens::Bf16(&[]),
            topk_idx: None,
            topk_weights: None,
            handle: None,
            expert_alignment: 1,
            num_worst_tokens: None,
        }
    }
}

/// The routing of one hierarchical dispatch: both stages' handles and the final row order.
#[derive(Clone, Debug)]
pub struct HierHandle {
    buffer_id: usize,
    rail: DispatchHandle,
    node: DispatchHandle,
    /// `perm[p]` = the node stage's row that is output row `p`.
    perm: Vec<u32>,
    rank_prefix: Vec<u64>,
    recv_src_idx: Vec<i32>,
    num_out_rows: usize,
}

impl HierHandle {
    /// Tokens this rank dispatched.
    pub fn num_tokens(&self) -> usize {
        self.rail.num_tokens()
    }
    /// `[num_ranks + 1]` prefix of received rows per source rank (as the direct path's).
    pub fn rank_prefix(&self) -> &[u64] {
        &self.rank_prefix
    }
    /// `[num_recv_tokens]` token index of each row on its source rank.
    pub fn recv_src_idx(&self) -> &[i32] {
        &self.recv_src_idx
    }
    pub fn num_recv_tokens(&self) -> usize {
        self.perm.len()
    }
    /// Rows of the dispatch outputs (`num_worst_tokens` when it was given).
    pub fn num_out_rows(&self) -> usize {
        self.num_out_rows
    }
    /// Rows the rail stage sent to gateways on other nodes: the tokens that crossed the
    /// network (each once per destination node).
    pub fn internode_rows_sent(&self, my_node: usize) -> u64 {
        let nodes = self.rail.rank_prefix().len() - 1;
        let t = self.rail.num_tokens();
        let in_rank = self.rail.is_token_in_rank();
        (0..t)
            .map(|i| (0..nodes).filter(|&n| n != my_node && in_rank[i * nodes + n]).count() as u64)
            .sum()
    }
    /// Rows the node stage forwarded to other ranks of this node (this rank as a gateway).
    pub fn forwarded_rows(&self, my_local: usize) -> u64 {
        let rpn = self.node.rank_prefix().len() - 1;
        let t = self.node.num_tokens();
        let in_rank = self.node.is_token_in_rank();
        (0..t)
            .map(|i| (0..rpn).filter(|&j| j != my_local && in_rank[i * rpn + j]).count() as u64)
            .sum()
    }
}

/// Result of a hierarchical dispatch: the fields of [`super::buffer::DispatchOutput`], equal to
/// the direct path's, with a [`HierHandle`].
#[derive(Clone, Debug)]
pub struct HierDispatchOutput {
    pub recv_x: OwnedTokens,
    pub recv_topk_idx: Vec<i64>,
    pub recv_topk_weights: Vec<f32>,
    pub num_recv_tokens_per_expert: Vec<usize>,
    pub num_recv_tokens: usize,
    pub handle: HierHandle,
}

/// One rank's normal-mode buffer with DeepEP's internode hierarchy (host backend, libfabric).
pub struct HierBuffer {
    cfg: EpConfig,
    rail: Buffer,
    node: Buffer,
    id: usize,
}

impl std::fmt::Debug for HierBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HierBuffer").field("rank", &self.cfg.rank).finish_non_exhaustive()
    }
}

impl HierBuffer {
    /// Connects both stages (collective: every rank of `boot` calls it). Host backend over
    /// libfabric only: the rail stage over `opts.provider`, the node stage over
    /// `opts.intranode_provider` (else the same provider). The world's config hash is checked
    /// first, so a rank built for the direct path or with other settings fails here.
    pub fn new(cfg: EpConfig, boot: Arc<dyn Bootstrap>, opts: BufferOptions) -> Result<Self> {
        if opts.backend != Backend::Host {
            return Err(Error::arg(
                "backend",
                "the hierarchical buffer is built for the host backend only",
            ));
        }
        if !matches!(opts.transport, TransportKind::Fabric) {
            return Err(Error::arg(
                "transport",
                "the hierarchical buffer runs over libfabric only",
            ));
        }
        check_boot(&cfg, &*boot)?;
        let (rs, ns) = stage_settings(&cfg)?;
        let near = opts.intranode_provider.as_deref().unwrap_or("");
        check_world(&cfg, &*boot, "BufferOptions::intranode_provider", near.as_bytes(), &[])?;
        let (rail_boot, node_boot) = stage_boots(&cfg, boot);
        // The rail stage's peers are all on other nodes (`provider`); the node stage's all on
        // this one (`intranode_provider` when given).
        let node_opts = BufferOptions {
            provider: opts.intranode_provider.clone().unwrap_or_else(|| opts.provider.clone()),
            intranode_provider: None,
            emulate_network_gbps: None,
            ..opts.clone()
        };
        let rail_opts = BufferOptions { intranode_provider: None, ..opts };
        let rail = Buffer::new(EpConfig::new(rs)?, Arc::new(rail_boot), rail_opts)?;
        let node = Buffer::new(EpConfig::new(ns)?, Arc::new(node_boot), node_opts)?;
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(1);
        let id = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(HierBuffer { cfg, rail, node, id })
    }

    pub fn config(&self) -> &EpConfig {
        &self.cfg
    }

    /// This rank's node and local index.
    pub fn position(&self) -> (usize, usize) {
        (self.cfg.rank / self.cfg.ranks_per_node, self.cfg.rank % self.cfg.ranks_per_node)
    }

    /// [`world_err`] for the rail stage (sub-rank = node index).
    fn rail_err(&self, e: Error) -> Error {
        let (rpn, local) = (self.cfg.ranks_per_node, self.cfg.rank % self.cfg.ranks_per_node);
        world_err(e, "rail", |n| n * rpn + local)
    }

    /// [`world_err`] for the node stage (sub-rank = local index).
    fn node_err(&self, e: Error) -> Error {
        let first = self.cfg.rank / self.cfg.ranks_per_node * self.cfg.ranks_per_node;
        world_err(e, "node", |j| first + j)
    }

    /// Both stages' registered bytes.
    pub fn registered_bytes(&self) -> u64 {
        self.rail.registered_bytes() + self.node.registered_bytes()
    }

    /// Tears both stages down (collective, like [`Buffer::destroy`]).
    pub fn destroy(self) -> Result<()> {
        let r = self.rail.destroy();
        let n = self.node.destroy();
        r.and(n)
    }

    /// Dispatch through the rail stage, then the node stage; outputs as the direct path's.
    pub fn dispatch(&mut self, args: &HierDispatchArgs<'_>) -> Result<HierDispatchOutput> {
        let h = self.cfg.hidden;
        if let Some(hd) = args.handle {
            if hd.buffer_id != self.id {
                return Err(Error::arg("handle", "comes from another hierarchical buffer"));
            }
        }
        let rail_out = self.rail.dispatch(&DispatchArgs {
            x: args.x,
            topk_idx: args.topk_idx,
            topk_weights: args.topk_weights,
            layout: None,
            handle: args.handle.map(|hd| &hd.rail),
            expert_alignment: 1,
            num_worst_tokens: None,
        });
        let rail_out = rail_out.map_err(|e| self.rail_err(e))?;
        let n1 = rail_out.num_recv_tokens;
        let src_node = rows_by_source(rail_out.handle.rank_prefix(), n1);
        let wide = widen(&rail_out.recv_x, h, n1, |i| {
            (src_node[i] as u32, rail_out.handle.recv_src_idx()[i] as u32)
        });
        // A cached dispatch given top-k returns it, as the direct path's does: the rail stage's
        // node-local ids route the node stage exactly as the handle's.
        let with_topk = args.topk_idx.is_some();
        let node_out = self.node.dispatch(&DispatchArgs {
            x: wide.as_ref(),
            topk_idx: with_topk.then_some(&rail_out.recv_topk_idx[..]),
            topk_weights: with_topk.then_some(&rail_out.recv_topk_weights[..]),
            layout: None,
            handle: args.handle.map(|hd| &hd.node),
            expert_alignment: args.expert_alignment,
            num_worst_tokens: None,
        });
        let node_out = node_out.map_err(|e| self.node_err(e))?;
        let n2 = node_out.num_recv_tokens;
        let rows = match args.num_worst_tokens {
            None => n2,
            Some(w) if w >= n2 => w,
            Some(w) => {
                return Err(Error::arg(
                    "num_worst_tokens",
                    format!("rank {} receives {n2} tokens, more than {w}", self.cfg.rank),
                ))
            }
        };
        // Final order: key = source rank = m * rpn + l (l: the gateway, m: the source node
        // carried in the lane); a stable counting sort keeps token order within a source.
        let gateway = rows_by_source(node_out.handle.rank_prefix(), n2);
        let meta = read_meta(&node_out.recv_x, h, n2);
        let (perm, rank_prefix, src_idx) = final_order(&self.cfg, &meta, &gateway)?;
        let k = self.cfg.num_topk;
        let recv_x = narrow(&node_out.recv_x, h, &perm, rows);
        let recv_topk_idx = permute_rows(&node_out.recv_topk_idx, &perm, rows, k, -1, with_topk);
        let recv_topk_weights =
            permute_rows(&node_out.recv_topk_weights, &perm, rows, k, 0.0, with_topk);
        let num_recv_tokens_per_expert = node_out.num_recv_tokens_per_expert.clone();
        Ok(HierDispatchOutput {
            recv_x,
            recv_topk_idx,
            recv_topk_weights,
            num_recv_tokens_per_expert,
            num_recv_tokens: n2,
            handle: HierHandle {
                buffer_id: self.id,
                rail: rail_out.handle,
                node: node_out.handle,
                perm,
                rank_prefix,
                recv_src_idx: src_idx,
                num_out_rows: rows,
            },
        })
    }

    /// Combine through the node stage (to the gateways), then the rail stage (to the sources).
    /// `x [rows, H]` and `topk_weights [rows, K]` in the dispatch's output order.
    pub fn combine(
        &mut self,
        x: &[u16],
        handle: &HierHandle,
        topk_weights: Option<&[f32]>,
    ) -> Result<CombineOutput> {
        if handle.buffer_id != self.id {
            return Err(Error::arg("handle", "comes from another hierarchical buffer"));
        }
        let (h, k) = (self.cfg.hidden, self.cfg.num_topk);
        let rows = handle.num_out_rows;
        if x.len() != rows * h {
            return Err(Error::arg("x", format!("length {}, expected {rows} * {h}", x.len())));
        }
        if let Some(w) = topk_weights {
            if w.len() != rows * k {
                return Err(Error::arg(
                    "topk_weights",
                    format!("length {}, expected {rows} * {k}", w.len()),
                ));
            }
        }
        let n2 = handle.perm.len();
        let hw = h + META_CHANNELS;
        let mut node_x = vec![0u16; n2 * hw];
        let mut node_w = topk_weights.map(|_| vec![0f32; n2 * k]);
        for (p, &i) in handle.perm.iter().enumerate() {
            let i = i as usize;
            node_x[i * hw..i * hw + h].copy_from_slice(&x[p * h..(p + 1) * h]);
            if let (Some(nw), Some(w)) = (node_w.as_mut(), topk_weights) {
                nw[i * k..(i + 1) * k].copy_from_slice(&w[p * k..(p + 1) * k]);
            }
        }
        let at_gateway = self.node.combine(&CombineArgs {
            x: &node_x,
            handle: &handle.node,
            topk_weights: node_w.as_deref(),
        });
        let at_gateway = at_gateway.map_err(|e| self.node_err(e))?;
        let n1 = handle.node.num_tokens();
        let mut rail_x = vec![0u16; n1 * h];
        for i in 0..n1 {
            rail_x[i * h..(i + 1) * h].copy_from_slice(&at_gateway.combined_x[i * hw..i * hw + h]);
        }
        let out = self.rail.combine(&CombineArgs {
            x: &rail_x,
            handle: &handle.rail,
            topk_weights: at_gateway.combined_topk_weights.as_deref(),
        });
        out.map_err(|e| self.rail_err(e))
    }
}

/// Exchanges the world's config hash (tagged: a hierarchical rank never connects to a direct
/// one) plus `agree` bytes every rank must send alike (the setting `what` names, for the error)
/// and `free` bytes each rank may differ in; returns every rank's `free` bytes. Collective.
pub(crate) fn check_world(
    cfg: &EpConfig,
    boot: &dyn Bootstrap,
    what: &str,
    agree: &[u8],
    free: &[u8],
) -> Result<Vec<Vec<u8>>> {
    let mut blob = (cfg.hash() ^ HIER_HASH_TAG).to_le_bytes().to_vec();
    blob.extend_from_slice(&(free.len() as u64).to_le_bytes());
    blob.extend_from_slice(free);
    blob.extend_from_slice(agree);
    let all = boot.all_gather(&blob)?;
    let mut frees = Vec::with_capacity(all.len());
    for (peer, b) in all.iter().enumerate() {
        let word =
            |i: usize| b.get(i..i + 8).and_then(|s| s.try_into().ok()).map(u64::from_le_bytes);
        let (Some(h), Some(n)) = (word(0), word(8)) else {
            return Err(Error::ConfigMismatch(format!(
                "rank {peer} sent a {}-byte config hash (not a hierarchical rank?)",
                b.len()
            )));
        };
        cfg.check_peer_hash(peer, h ^ HIER_HASH_TAG)?;
        let n = n as usize;
        let (their_free, their_agree) = match b.get(16..16 + n) {
            Some(f) => (f, &b[16 + n..]),
            None => {
                return Err(Error::ConfigMismatch(format!(
                    "rank {peer} sent a malformed hierarchy blob ({} bytes)",
                    b.len()
                )))
            }
        };
        if their_agree != agree {
            return Err(Error::ConfigMismatch(format!(
                "rank {} and rank {peer} disagree on {what} ({:?} here, {:?} there)",
                cfg.rank,
                String::from_utf8_lossy(agree),
                String::from_utf8_lossy(their_agree)
            )));
        }
        frees.push(their_free.to_vec());
    }
    Ok(frees)
}

/// The two stages' sub-communicators of `boot` for this rank: (rail, node).
pub(crate) fn stage_boots(cfg: &EpConfig, boot: Arc<dyn Bootstrap>) -> (SubGroup, SubGroup) {
    let (rpn, nodes) = (cfg.ranks_per_node, cfg.num_ranks / cfg.ranks_per_node);
    let (node_i, local) = (cfg.rank / rpn, cfg.rank % rpn);
    let rail = SubGroup {
        parent: boot.clone(),
        members: (0..nodes).map(|n| n * rpn + local).collect(),
        index: node_i,
        one_node: false,
    };
    let node = SubGroup {
        parent: boot,
        members: (0..rpn).map(|j| node_i * rpn + j).collect(),
        index: local,
        one_node: true,
    };
    (rail, node)
}

/// An error of a stage's buffer with its ranks (indices in the stage's sub-communicator)
/// turned into the job's ranks, so a timeout names the rank an operator must look at.
/// `Timeout`, `Protocol` and the proxy's errors are mapped ([`proxy_world_err`]); libfabric's
/// own (`Error::Fabric`) name no rank. Bootstrap errors name job ranks already (the sub-groups
/// use the job's all-gather).
pub(crate) fn world_err(e: Error, stage: &str, to_world: impl Fn(usize) -> usize) -> Error {
    match e {
        Error::Proxy(p) => Error::Proxy(proxy_world_err(p, stage, &to_world)),
        Error::Timeout { rank, phase, peers, waited, detail } => Error::Timeout {
            rank: to_world(rank),
            phase,
            peers: peers.into_iter().map(&to_world).collect(),
            waited,
            detail: format!("{detail} (the hierarchy's {stage} stage)"),
        },
        Error::Protocol { rank, peer, phase, msg } => Error::Protocol {
            rank: to_world(rank),
            peer: to_world(peer),
            phase,
            msg: format!("{msg} (the hierarchy's {stage} stage)"),
        },
        e => e,
    }
}

/// [`world_err`] for a proxy error: the rank and peer fields in job ranks. A command's
/// destination (`BadRank::dst_rank`) stays a stage index, as the count it is checked against;
/// the messages of `PeerUnreachable` and `Transport` name the stage, and so does a failed
/// worker's name (with the worker's job rank), its shared cause being left as it is.
fn proxy_world_err(p: ProxyError, stage: &str, to_world: &impl Fn(usize) -> usize) -> ProxyError {
    let w = |r: u32| to_world(r as usize) as u32;
    match p {
        ProxyError::OutOfBounds { rank, peer, what, offset, length, len } => {
            ProxyError::OutOfBounds { rank: w(rank), peer: w(peer), what, offset, length, len }
        }
        ProxyError::BadHead { rank, ring, head, tail, capacity } => {
            ProxyError::BadHead { rank: w(rank), ring, head, tail, capacity }
        }
        ProxyError::BadSeq { rank, ring, ticket, expected, found } => {
            ProxyError::BadSeq { rank: w(rank), ring, ticket, expected, found }
        }
        ProxyError::BadSlot { rank, imm, slot, num_slots } => {
            ProxyError::BadSlot { rank: w(rank), imm, slot, num_slots }
        }
        ProxyError::BadRank { rank, ring, dst_rank, num_ranks } => {
            ProxyError::BadRank { rank: w(rank), ring, dst_rank, num_ranks }
        }
        ProxyError::BadCompletion { rank, ring, num_rings } => {
            ProxyError::BadCompletion { rank: w(rank), ring, num_rings }
        }
        ProxyError::PeerUnreachable { rank, peer, msg } => ProxyError::PeerUnreachable {
            rank: w(rank),
            peer: w(peer),
            msg: format!("{msg} (the hierarchy's {stage} stage)"),
        },
        ProxyError::Fabric { rank, peer, source } => {
            ProxyError::Fabric { rank: w(rank), peer: peer.map(w), source }
        }
        // `reported_by` comes from the job's bootstrap: a job rank already.
        ProxyError::PeerDead { rank, peer, waiting, reported_by } => ProxyError::PeerDead {
            rank: w(rank),
            peer: w(peer),
            waiting: waiting.into_iter().map(w).collect(),
            reported_by,
        },
        ProxyError::Transport { rank, msg } => ProxyError::Transport {
            rank: w(rank),
            msg: format!("{msg} (the hierarchy's {stage} stage)"),
        },
        ProxyError::ArrivalTimeout { rank, waited, lagging } => ProxyError::ArrivalTimeout {
            rank: w(rank),
            waited,
            lagging: lagging
                .into_iter()
                .map(|l| Lagging { peer: if l.peer == u32::MAX { l.peer } else { w(l.peer) }, ..l })
                .collect(),
        },
        ProxyError::SendTimeout { rank, ring, expected, observed, waited, owed, queued } => {
            let m = |v: Vec<(u32, u64)>| v.into_iter().map(|(p, n)| (w(p), n)).collect();
            ProxyError::SendTimeout {
                rank: w(rank),
                ring,
                expected,
                observed,
                waited,
                owed: m(owed),
                queued: m(queued),
            }
        }
        ProxyError::RingFull { ring, capacity, head, tail, waited, queued } => {
            ProxyError::RingFull {
                ring,
                capacity,
                head,
                tail,
                waited,
                queued: queued.into_iter().map(|(p, n)| (w(p), n)).collect(),
            }
        }
        ProxyError::WorkerStopped { rank } => ProxyError::WorkerStopped { rank: w(rank) },
        // The failed worker's error is shared (an Arc, not rebuilt here): its ranks stay the
        // stage's, and the worker's name says so and gives the worker's job rank.
        ProxyError::WorkerFailed { worker, source } => {
            let job = crate::proxy::worker_rank(&worker)
                .map(|r| format!("job rank {}; ", w(r)))
                .unwrap_or_default();
            ProxyError::WorkerFailed {
                worker: format!(
                    "{worker} ({job}ranks in the cause are the hierarchy's {stage} stage's)"
                ),
                source,
            }
        }
        // The rest name no rank.
        p => p,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stage_proxy_errors_name_job_ranks() {
        // Rail stage of rank 6 in a 2 x 4 job: sub-rank = node index, job rank = n * 4 + 2.
        let to_world = |n: usize| n * 4 + 2;
        let e = world_err(
            Error::Proxy(ProxyError::PeerUnreachable { rank: 1, peer: 0, msg: "gone".into() }),
            "rail",
            to_world,
        );
        assert!(
            matches!(&e, Error::Proxy(ProxyError::PeerUnreachable { rank: 6, peer: 2, msg })
                if msg == "gone (the hierarchy's rail stage)"),
            "{e:?}"
        );
        let lag = |peer| Lagging { peer, slot: 3, expected: 2, observed: 1 };
        let e = world_err(
            Error::Proxy(ProxyError::ArrivalTimeout {
                rank: 1,
                waited: std::time::Duration::from_secs(1),
                lagging: vec![lag(0), lag(u32::MAX)],
            }),
            "rail",
            to_world,
        );
        let Error::Proxy(ProxyError::ArrivalTimeout { rank: 6, lagging, .. }) = &e else {
            panic!("{e:?}")
        };
        assert_eq!(lagging.iter().map(|l| l.peer).collect::<Vec<_>>(), vec![2, u32::MAX]);
        let e = world_err(
            Error::Proxy(ProxyError::BadRank { rank: 0, ring: 1, dst_rank: 5, num_ranks: 2 }),
            "rail",
            to_world,
        );
        assert!(
            matches!(
                e,
                Error::Proxy(ProxyError::BadRank { rank: 2, dst_rank: 5, num_ranks: 2, .. })
            ),
            "{e:?}"
        );
        let e = world_err(Error::Proxy(ProxyError::WorkerStopped { rank: 1 }), "node", |j| 4 + j);
        assert!(matches!(e, Error::Proxy(ProxyError::WorkerStopped { rank: 5 })), "{e:?}");
        let inner = std::sync::Arc::new(ProxyError::WorkerStopped { rank: 1 });
        let failed = |worker: String| {
            Error::Proxy(ProxyError::WorkerFailed { worker, source: inner.clone() })
        };
        let e = world_err(failed(crate::proxy::worker_name(1, 0)), "rail", to_world);
        assert_eq!(
            e.to_string(),
            "proxy worker fep-proxy-1-0 (job rank 6; ranks in the cause are the hierarchy's rail \
             stage's) failed: rank 1: the proxy workers are stopped"
        );
        let e = world_err(failed("other".into()), "node", |j| 4 + j);
        let Error::Proxy(ProxyError::WorkerFailed { worker, source }) = &e else { panic!("{e:?}") };
        assert_eq!(worker, "other (ranks in the cause are the hierarchy's node stage's)");
        assert!(std::sync::Arc::ptr_eq(source, &inner));
    }
}
