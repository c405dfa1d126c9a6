//! Host backend of low-latency mode: the protocol of plan/ll.rs's `LlLayout` run by the calling CPU
//! thread, through its own command ring, proxy and transport (separate from normal mode's, so the
//! two immediate id spaces never share counters).
//!
//! One file: `LlComm` is one protocol (geometry, phases, fabric hold, lanes) over the state defined
//! here; the normal-mode host lane is mod.rs.
//!
//! One call = stage every message into the send area of its buffer set, push one command per
//! (destination rank, destination local expert) with the row count in the immediate (a
//! zero-length write when the count is 0), then (now, or later through a hook) wait until every
//! one of the `E` messages addressed to this rank arrived, read the counts from the arrival
//! counters and copy the rows out. Nothing depends on the order in which writes land.
//!
// NOTES: counters are cumulative over the lane's life (the proxy never resets them). For every
// counter id this engine keeps `expected[id]` (messages consumed) and `sums_seen[id]` (their
// counts summed); a call's message on `id` has arrived when `arrivals[id] > expected[id]`, and
// its count is `sums[id] - sums_seen[id]`. An arrival count past `expected[id] + 1` means a peer
// is two calls ahead on this set: a contract violation (see `Buffer::low_latency_dispatch`)
// reported as `Error::Protocol` naming that peer.
//
// NOTES: set reuse. Calls alternate between two buffer sets, so call N + 2 writes where call N's
// rows were. With hooks a fast rank could start call N + 2 before a slow peer completed call N's
// receive. So every completed receive sends a zero-length ack (id `4E + set * R + src`, past
// LlImm's ids) to every rank, and a call's sends first wait (bounded, naming the peers) until
// every rank acked every earlier call on its set. On the usual path those acks arrived a whole
// call earlier, so this costs R empty messages per call and no waiting.
//
// NOTES: clean (`fence`). After a failed call the counters of the ranks are out of step and
// writes of a slow peer may still be in flight. The fence is collective and exact: every rank
// waits until its own pushed writes completed locally, all-gathers how many writes it ever pushed
// to each (phase, set, unit), and every receiver waits (bounded) until its arrival counters reach
// exactly what its peers say they sent, then re-bases `expected`/`sums_seen` there. A stale write
// can therefore never be mistaken for a later call's message: it was counted before the fence
// returned. A barrier ends the fence so nobody's next call lands before a peer finished fencing.
// Limit: a peer whose proxy died (unreachable transport) cannot be fenced; clean then fails with
// the transport's error and the buffer must be rebuilt.
//
// NOTES: wait costs. Every receive wait is this module's own polling loop (`wait_peers`, the
// same bounds and errors as `Proxy::wait_all`), which also records, per wait, the nanoseconds
// from the start of the wait until its message was seen; the receive adds them per source rank
// (DeepEP's `*_wait_recv_cost_stats`: one wait per (local expert, source) message, summed).
//
// NOTES: shrink (DeepEP's `enable_shrink`). `mask[p]` set: no write goes to `p` (data, acks,
// clean messages) and no wait waits for it; its messages read as count 0. A wait that makes no
// progress for the timeout, or whose peer the bootstrap saw die, masks the lagging peers instead
// of failing (the proxy then watches no peers itself: a dead rank would fail every later wait).
// clean cannot use the bootstrap (a masked rank does not take part), so it runs in band among
// the ranks not masked: each sends every unmasked peer the number of writes it pushed there since
// its last report (4 zero-length messages, one base-2^14 digit of the count each, on four
// per-source slots whose cumulative sums therefore add up to the total), waits for every peer's
// report and until that many of the peer's writes arrived, re-bases its counters there, and ends
// with a done message to every unmasked peer and a wait for theirs; a peer that does not keep up
// within the timeout is masked. Limit: a clean consumes exactly one report per peer, so a pair
// is re-admitted exactly (unmask, then clean on both) when neither sent the other a report the
// other did not take in: when both had masked each other, as after a rank fails for good or
// after `low_latency_clean_mask_buffer` on every rank. A peer unmasked after it ran a clean
// that this rank missed (it had masked this rank only then) leaves a report behind; the next
// clean then sees more writes than reported and fails naming it (rebuild the buffer to use it).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{region_mut, region_ref};
use crate::bootstrap::Bootstrap;
use crate::fabric::{MemoryRegion, Stack};
use crate::protocol::plan::{
    imm_decode, imm_encode, LlArea, LlLayout, RegionPlan, IMM_VALUE_BITS, IMM_VALUE_MAX,
    LL_NUM_SETS,
};
use crate::proxy::{
    ArrivalWait, Command, CounterMemory, Lagging, Proxy, ProxyError, RingProducer, SharedRegion,
};
use crate::util::Backoff;
use crate::{Error, Result};

/// Digits (base `2^IMM_VALUE_BITS`) of a shrink-mode clean report: counts up to 2^56.
const REPORT_DIGITS: u64 = 4;

/// Where the low-latency units sit inside the one registered LL buffer.
///
// NOTES: `LlLayout::unit_offset` numbers the units contiguously; a provider registers the buffer
// in chunks of `stride` bytes and an RMA write must stay inside one chunk, so unit `u` is placed
// at `(u / units_per_region) * stride + (u % units_per_region) * unit_bytes` and no unit (hence
// no message) crosses a chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LlGeometry {
    /// Sized for bf16 dispatch records, the largest (fp8 messages use the same units).
    pub layout: LlLayout,
    pub stride: u64,
    pub plan: RegionPlan,
    /// Bytes of the whole buffer (both sets, send and receive areas).
    pub bytes: u64,
}

impl LlGeometry {
    pub fn new(layout: LlLayout, stride: u64) -> Result<Self> {
        let plan = layout.region_plan(stride)?;
        let units = plan.total_units;
        let last = units - 1;
        let bytes = (last / plan.units_per_region) * stride
            + (last % plan.units_per_region) * plan.unit_bytes
            + plan.unit_bytes;
        Ok(LlGeometry { layout, stride, plan, bytes })
    }

    /// Byte offset of a unit (see `LlLayout` for what the units of each area are).
    pub fn offset(&self, set: u64, area: LlArea, unit: u64) -> Result<u64> {
        let u = self.layout.unit_offset(set, area, unit)? / self.layout.unit_bytes;
        let upr = self.plan.units_per_region;
        Ok((u / upr) * self.stride + (u % upr) * self.plan.unit_bytes)
    }
}

/// Which half of a call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LlPhase {
    Dispatch = 0,
    Combine = 1,
}

impl LlPhase {
    pub fn name(self) -> &'static str {
        match self {
            LlPhase::Dispatch => "low-latency dispatch",
            LlPhase::Combine => "low-latency combine",
        }
    }
}

/// Keeps the libfabric objects of the LL lane alive behind its proxy.
pub(crate) struct LlFabricHold {
    // NOTES: field order is drop order: the registration before the stack that made it.
    pub _mr: Arc<MemoryRegion>,
    pub _stack: Stack,
}

/// The low-latency lane of one rank: its engine, registrations and memory.
pub(crate) struct LlLane {
    // NOTES: field order is drop order: the proxy (inside comm) stops before the registration
    // goes, and that before the memory it covers.
    pub comm: LlComm,
    pub _fabric: Option<LlFabricHold>,
    pub _mem: (Arc<SharedRegion>, Arc<SharedRegion>),
}

/// The communication state of the LL lane.
pub(crate) struct LlComm {
    pub rank: usize,
    pub num_ranks: usize,
    pub geo: LlGeometry,
    pub timeout: Duration,
    // NOTES: field order is drop order: producer, then proxy (joins workers), then regions.
    producer: RingProducer,
    proxy: Proxy,
    /// Staging (send areas are read by the NIC from here).
    pub send: Arc<SharedRegion>,
    /// Receive areas (peers write here). The same region as `send` over libfabric.
    pub recv: Arc<SharedRegion>,
    pushed: u64,
    /// `[4E]` per counter id: messages consumed.
    expected: Vec<u64>,
    /// `[4E]` per counter id: sum of the counts consumed.
    sums_seen: Vec<u64>,
    /// `[2 phases][2 sets][E]` writes this rank pushed, by (phase, set, sender-side unit:
    /// dispatch: global expert; combine: `local_expert * R + dst`).
    issued: Vec<u64>,
    /// LL calls since the last fence; the set of a call is `calls % 2`.
    pub calls: u64,
    /// `[2 sets][R]` ack arrivals at the last fence.
    ack_base: Vec<u64>,
    /// `[2 sets][R]` acks this rank sent to each rank.
    acks_to: Vec<u64>,
    /// `[R]` data and ack writes this rank pushed to each rank (what a shrink clean reports).
    sent_to: Vec<u64>,
    /// `[R]` the part of `sent_to` already reported to each rank.
    told: Vec<u64>,
    /// `[R]` shrink clean reports sent to each rank (`REPORT_DIGITS` messages each), and done
    /// messages sent to each.
    reports_to: Vec<u64>,
    done_to: Vec<u64>,
    /// `[R]` data and ack writes each rank reported having pushed here.
    peer_total: Vec<u64>,
    /// `[R]` per source: report messages consumed (per digit slot), their digit sums, done
    /// messages consumed.
    report_seen: Vec<u64>,
    digit_seen: Vec<[u64; REPORT_DIGITS as usize]>,
    done_seen: Vec<u64>,
    /// Per set: the call whose receive is still outstanding (a hook not completed yet).
    pub pending: [Option<u64>; 2],
    /// Bumped by every fence: hooks from before it are refused.
    pub generation: u64,
    /// Why the lane refuses calls until `clean_low_latency_buffer`.
    pub broken: Option<String>,
    /// Shrink mode (module NOTES): timeouts mask peers instead of failing.
    pub shrink: bool,
    /// `[R]` masked ranks (module NOTES).
    pub mask: Vec<bool>,
}

/// Whether the bootstrap has seen a rank die (`Bootstrap::is_dead`).
pub(crate) type DeadFn<'a> = &'a dyn Fn(usize) -> bool;

impl LlComm {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        rank: usize,
        geo: LlGeometry,
        timeout: Duration,
        producer: RingProducer,
        proxy: Proxy,
        send: Arc<SharedRegion>,
        recv: Arc<SharedRegion>,
        shrink: bool,
        mask: Vec<bool>,
    ) -> Self {
        let ids = geo.layout.imm.num_ids() as usize;
        let r = geo.layout.num_ranks as usize;
        LlComm {
            rank,
            num_ranks: r,
            geo,
            timeout,
            producer,
            proxy,
            send,
            recv,
            pushed: 0,
            expected: vec![0; ids],
            sums_seen: vec![0; ids],
            issued: vec![0; 4 * geo.layout.num_experts as usize],
            calls: 0,
            ack_base: vec![0; 2 * r],
            acks_to: vec![0; 2 * r],
            sent_to: vec![0; r],
            told: vec![0; r],
            reports_to: vec![0; r],
            done_to: vec![0; r],
            peer_total: vec![0; r],
            report_seen: vec![0; r],
            digit_seen: vec![[0; REPORT_DIGITS as usize]; r],
            done_seen: vec![0; r],
            pending: [None, None],
            generation: 0,
            broken: None,
            shrink,
            mask,
        }
    }

    fn proxy_err(&self, phase: &'static str, e: ProxyError) -> Error {
        Error::from_proxy(self.rank, phase, e)
    }

    fn masked(&self, peer: usize) -> bool {
        self.mask.get(peer).copied().unwrap_or(false)
    }

    /// Counter id of the message `(phase, set)` from `peer` for unit `(local_expert)`, seen by
    /// this rank as receiver.
    fn recv_id(&self, phase: LlPhase, set: u64, peer: u64, local_expert: u64) -> Result<u32> {
        let imm = match phase {
            LlPhase::Dispatch => self.geo.layout.imm.dispatch(set, local_expert, peer, 0)?,
            LlPhase::Combine => self.geo.layout.imm.combine(set, peer, local_expert, 0)?,
        };
        Ok(imm_decode(imm).0 as u32)
    }

    /// Counter slots the LL lane needs: LlImm's `4E`, `2R` ack ids, and per source the shrink
    /// clean's report digits and done message (`5R`).
    pub fn num_slots(layout: &LlLayout) -> Result<u32> {
        let n = layout.imm.num_ids() + (LL_NUM_SETS + REPORT_DIGITS + 1) * layout.num_ranks;
        imm_encode(n - 1, 0)?;
        Ok(n as u32)
    }

    fn ack_id(&self, set: u64, src: u64) -> u32 {
        (self.geo.layout.imm.num_ids() + set * self.num_ranks as u64 + src) as u32
    }

    fn digit_id(&self, digit: u64, src: u64) -> u32 {
        let r = self.num_ranks as u64;
        (self.geo.layout.imm.num_ids() + (LL_NUM_SETS + digit) * r + src) as u32
    }

    fn done_id(&self, src: u64) -> u32 {
        let r = self.num_ranks as u64;
        (self.geo.layout.imm.num_ids() + (LL_NUM_SETS + REPORT_DIGITS) * r + src) as u32
    }

    /// Every counter id `src` writes here: its dispatch and combine messages of both sets and
    /// its acks (what its `sent_to[this rank]` counts).
    fn data_ids_of(&self, src: u64) -> Result<Vec<u32>> {
        let l = self.geo.layout.num_local_experts;
        let mut ids = Vec::with_capacity((4 * l + 2) as usize);
        for set in 0..LL_NUM_SETS {
            for e in 0..l {
                ids.push(self.recv_id(LlPhase::Dispatch, set, src, e)?);
                ids.push(self.recv_id(LlPhase::Combine, set, src, e)?);
            }
            ids.push(self.ack_id(set, src));
        }
        Ok(ids)
    }

    /// Masks `peer` because of `why` (shrink mode), with a warning naming it.
    fn mask_peer(&mut self, peer: usize, phase: &'static str, why: &str) {
        if peer < self.num_ranks && !self.mask[peer] {
            crate::fep_warn!(
                "rank {}: {phase}: masking rank {peer} ({why}); later low-latency calls skip it",
                self.rank
            );
            self.mask[peer] = true;
        }
    }

    /// Sets or clears `peer`'s mask (DeepEP's `low_latency_update_mask_buffer`).
    pub fn set_mask(&mut self, peer: usize, masked: bool) -> Result<()> {
        if peer >= self.num_ranks {
            return Err(Error::arg("rank", format!("{peer} not in 0..{}", self.num_ranks)));
        }
        self.mask[peer] = masked;
        Ok(())
    }

    /// Waits (bounded) for every wait whose peer is not masked (module NOTES: wait costs,
    /// shrink): the same bound as `Proxy::wait_all` (the timeout counts time without an
    /// arrival) and, without shrink, its errors. `cost[peer]` (if given) gets, per wait, the
    /// nanoseconds from the start until its message was seen (or until its peer was masked).
    fn wait_peers(
        &mut self,
        phase: &'static str,
        waits: &[ArrivalWait],
        mut cost: Option<&mut [u64]>,
        dead: DeadFn<'_>,
    ) -> Result<()> {
        let counters: CounterMemory = self.proxy.counters().clone();
        for w in waits {
            counters.arrivals(w.slot).map_err(Error::Proxy)?;
        }
        let arrived = |w: &ArrivalWait| {
            counters.arrivals_atomic(w.slot).load(Ordering::Acquire) >= w.expected
        };
        let start = Instant::now();
        let mut pending: Vec<usize> =
            (0..waits.len()).filter(|&i| !self.masked(waits[i].peer as usize)).collect();
        let seen_sum = |pending: &[usize]| {
            pending.iter().fold(0u64, |acc, &i| {
                acc.wrapping_add(counters.arrivals_atomic(waits[i].slot).load(Ordering::Acquire))
            })
        };
        let mut seen = seen_sum(&pending);
        let mut idle_since = start;
        let mut backoff = Backoff::new(128, 4096);
        let mut passes = 0u32;
        loop {
            let before = pending.len();
            let ns = start.elapsed().as_nanos().min(u64::MAX as u128) as u64;
            pending.retain(|&i| {
                if !arrived(&waits[i]) {
                    return true;
                }
                if let Some(c) = cost.as_deref_mut() {
                    if let Some(slot) = c.get_mut(waits[i].peer as usize) {
                        *slot = slot.saturating_add(ns);
                    }
                }
                false
            });
            if pending.is_empty() {
                return Ok(());
            }
            if pending.len() != before {
                (idle_since, seen) = (Instant::now(), seen_sum(&pending));
                backoff.reset();
            }
            if self.shrink {
                self.proxy.check().map_err(|e| self.proxy_err(phase, e))?;
                passes = passes.wrapping_add(1);
                if passes % 64 == 0 {
                    let gone: Vec<usize> = pending
                        .iter()
                        .map(|&i| waits[i].peer as usize)
                        .filter(|&p| dead(p))
                        .collect();
                    if !gone.is_empty() {
                        for p in gone {
                            self.mask_peer(p, phase, "the bootstrap saw it leave");
                        }
                        self.drop_masked(&mut pending, waits, cost.as_deref_mut(), start);
                        continue;
                    }
                }
            } else if let Err(e) = self.proxy.check_running() {
                let e = match e {
                    ProxyError::PeerDead { rank, peer, reported_by, .. } => {
                        let mut waiting: Vec<u32> =
                            pending.iter().map(|&i| waits[i].peer).collect();
                        waiting.sort_unstable();
                        waiting.dedup();
                        ProxyError::PeerDead { rank, peer, waiting, reported_by }
                    }
                    e => e,
                };
                return Err(self.proxy_err(phase, e));
            }
            let now = seen_sum(&pending);
            if now != seen {
                (seen, idle_since) = (now, Instant::now());
                backoff.reset();
            }
            if idle_since.elapsed() >= self.timeout {
                if self.shrink {
                    let lagging: Vec<usize> =
                        pending.iter().map(|&i| waits[i].peer as usize).collect();
                    let why = format!("no message from it for {:?}", idle_since.elapsed());
                    for p in lagging {
                        self.mask_peer(p, phase, &why);
                    }
                    self.drop_masked(&mut pending, waits, cost.as_deref_mut(), start);
                    continue;
                }
                let lagging = pending
                    .iter()
                    .map(|&i| {
                        let w = &waits[i];
                        Lagging {
                            peer: w.peer,
                            slot: w.slot,
                            expected: w.expected,
                            observed: counters.arrivals_atomic(w.slot).load(Ordering::Acquire),
                        }
                    })
                    .collect();
                let e = ProxyError::ArrivalTimeout {
                    rank: self.rank as u32,
                    waited: idle_since.elapsed(),
                    lagging,
                };
                return Err(self.proxy_err(phase, e));
            }
            backoff.snooze();
        }
    }

    /// Drops the waits of masked peers, charging each the time waited so far.
    fn drop_masked(
        &self,
        pending: &mut Vec<usize>,
        waits: &[ArrivalWait],
        mut cost: Option<&mut [u64]>,
        start: Instant,
    ) {
        let ns = start.elapsed().as_nanos().min(u64::MAX as u128) as u64;
        pending.retain(|&i| {
            let p = waits[i].peer as usize;
            if !self.masked(p) {
                return true;
            }
            if let Some(slot) = cost.as_deref_mut().and_then(|c| c.get_mut(p)) {
                *slot = slot.saturating_add(ns);
            }
            false
        });
    }

    /// Shrink mode, before a call's writes: masks the ranks the bootstrap saw leave (a write to
    /// a dead rank may never complete, and this rank's later `wait_sends` would wait for it).
    pub fn mask_dead(&mut self, phase: &'static str, dead: DeadFn<'_>) {
        if !self.shrink {
            return;
        }
        for p in 0..self.num_ranks {
            if !self.mask[p] && dead(p) {
                self.mask_peer(p, phase, "the bootstrap saw it leave");
            }
        }
    }

    /// Before the sends of a call on `set`: waits (bounded) until every unmasked rank acked
    /// every earlier call on this set since the last fence (module NOTES).
    pub fn wait_set_free(&mut self, phase: LlPhase, set: u64, dead: DeadFn<'_>) -> Result<()> {
        self.mask_dead(phase.name(), dead);
        let earlier = self.calls / LL_NUM_SETS + u64::from(self.calls % LL_NUM_SETS > set);
        let r = self.num_ranks as u64;
        let waits: Vec<ArrivalWait> = (0..r)
            .map(|p| ArrivalWait {
                slot: self.ack_id(set, p),
                expected: self.ack_base[(set * r + p) as usize] + earlier,
                peer: p as u32,
            })
            .collect();
        self.wait_peers(phase.name(), &waits, None, dead)
    }

    /// `len` staging bytes at `off`, writable.
    ///
    /// # Safety
    /// The caller is the only writer; the area's previous writes completed (`wait_sends` ran in
    /// the receive of the call two before, which `Buffer` enforces).
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn staging(&self, off: u64, len: usize) -> Result<&mut [u8]> {
        // SAFETY: forwarded contract.
        unsafe { region_mut(&self.send, off, len) }
    }

    /// Pushes one message; `issued_unit` is its sender-side unit (see `issued`). A masked
    /// destination gets nothing (shrink).
    #[allow(clippy::too_many_arguments)]
    pub fn push(
        &mut self,
        phase: LlPhase,
        set: u64,
        issued_unit: u64,
        dst: usize,
        local_offset: u64,
        remote_offset: u64,
        length: u64,
        imm: u32,
    ) -> Result<()> {
        if self.masked(dst) {
            return Ok(());
        }
        let cmd = Command {
            dst_rank: dst as u32,
            local_offset: if length == 0 { 0 } else { local_offset },
            remote_offset: if length == 0 { 0 } else { remote_offset },
            length: u32::try_from(length)
                .map_err(|_| Error::arg("length", format!("{length} bytes in one message")))?,
            imm,
        };
        self.producer.push(&cmd, self.timeout).map_err(|e| self.proxy_err(phase.name(), e))?;
        self.pushed += 1;
        self.sent_to[dst] += 1;
        let e = self.geo.layout.num_experts;
        self.issued[((phase as u64 * LL_NUM_SETS + set) * e + issued_unit) as usize] += 1;
        Ok(())
    }

    /// Pushes one zero-length control message (ack or clean message) to `dst`.
    fn push_empty(&mut self, phase: &'static str, dst: usize, slot: u32, value: u64) -> Result<()> {
        let imm = imm_encode(u64::from(slot), value)?;
        let cmd =
            Command { dst_rank: dst as u32, local_offset: 0, remote_offset: 0, length: 0, imm };
        self.producer.push(&cmd, self.timeout).map_err(|e| self.proxy_err(phase, e))?;
        self.pushed += 1;
        Ok(())
    }

    pub fn publish(&mut self) {
        self.producer.publish();
    }

    /// Waits (bounded) for one message of `(phase, set)` from every unmasked rank for every
    /// local expert; returns the counts `[L, R]` (index `e * R + src`; 0 from masked ranks).
    /// `cost[src]` gets the nanoseconds waited for each of `src`'s messages (module NOTES).
    /// Errors name the ranks that did not deliver, or the peer that overran the set.
    pub fn wait_counts(
        &mut self,
        phase: LlPhase,
        set: u64,
        cost: &mut [u64],
        dead: DeadFn<'_>,
    ) -> Result<Vec<u32>> {
        let (l, r) = (self.geo.layout.num_local_experts, self.num_ranks as u64);
        let mut waits = Vec::with_capacity((l * r) as usize);
        for e in 0..l {
            for src in 0..r {
                let id = self.recv_id(phase, set, src, e)?;
                waits.push(ArrivalWait {
                    slot: id,
                    expected: self.expected[id as usize] + 1,
                    peer: src as u32,
                });
            }
        }
        self.wait_peers(phase.name(), &waits, Some(cost), dead)?;
        let counters = self.proxy.counters();
        let mut counts = Vec::with_capacity(waits.len());
        for w in &waits {
            if self.masked(w.peer as usize) {
                counts.push(0);
                continue;
            }
            let arrived = counters.arrivals(w.slot).map_err(Error::Proxy)?;
            if arrived > w.expected {
                return Err(self.overrun(phase, w.peer as usize, set));
            }
            let c = counters.sums(w.slot).map_err(Error::Proxy)? - self.sums_seen[w.slot as usize];
            counts.push(u32::try_from(c).unwrap_or(u32::MAX));
        }
        Ok(counts)
    }

    fn overrun(&self, phase: LlPhase, peer: usize, set: u64) -> Error {
        Error::Protocol {
            rank: self.rank,
            peer,
            phase: phase.name(),
            msg: format!(
                "wrote buffer set {set} again before this rank consumed it (a hook completed \
                 too late: every rank must complete call N's receive before any rank starts \
                 call N + 2)"
            ),
        }
    }

    /// After the rows of `(phase, set)` were copied out: checks no later write overran them,
    /// marks the messages consumed (masked ranks' are left), acks to every unmasked rank and
    /// waits (bounded) until this rank's own writes completed locally (its staging is
    /// reusable).
    pub fn finish_recv(&mut self, phase: LlPhase, set: u64) -> Result<()> {
        let (l, r) = (self.geo.layout.num_local_experts, self.num_ranks as u64);
        let counters = self.proxy.counters().clone();
        for e in 0..l {
            for src in 0..r {
                if self.masked(src as usize) {
                    continue;
                }
                let id = self.recv_id(phase, set, src, e)? as usize;
                let arrived = counters.arrivals(id as u32).map_err(Error::Proxy)?;
                if arrived != self.expected[id] + 1 {
                    return Err(self.overrun(phase, src as usize, set));
                }
                self.expected[id] += 1;
                self.sums_seen[id] = counters.sums(id as u32).map_err(Error::Proxy)?;
            }
        }
        let ack = self.ack_id(set, self.rank as u64);
        for dst in 0..self.num_ranks {
            if self.masked(dst) {
                continue;
            }
            self.push_empty(phase.name(), dst, ack, 0)?;
            self.acks_to[set as usize * self.num_ranks + dst] += 1;
            self.sent_to[dst] += 1;
        }
        self.producer.publish();
        self.wait_sends(phase.name())
    }

    pub fn wait_sends(&self, phase: &'static str) -> Result<()> {
        self.proxy
            .wait_sends(self.producer.ring(), self.pushed, self.timeout)
            .map_err(|e| self.proxy_err(phase, e))
    }

    /// `len` received bytes at `off`.
    ///
    /// # Safety
    /// The bytes arrived (their counter was read with Acquire) and no peer writes them again
    /// before this rank's call two later (the set contract).
    pub unsafe fn received(&self, off: u64, len: usize) -> Result<&[u8]> {
        // SAFETY: forwarded contract.
        unsafe { region_ref(&self.recv, off, len) }
    }

    /// Resets the call state after a fence.
    fn fenced(&mut self) {
        self.calls = 0;
        self.pending = [None, None];
        self.generation += 1;
        self.broken = None;
    }

    /// The collective fence of `clean_low_latency_buffer` (module NOTES); in shrink mode the
    /// in-band one among the unmasked ranks.
    pub fn fence(&mut self, boot: &dyn Bootstrap) -> Result<()> {
        if self.shrink {
            return self.fence_in_band(&|p| boot.is_dead(p));
        }
        const PHASE: &str = "clean_low_latency_buffer";
        self.producer.publish();
        self.proxy.check().map_err(Error::Proxy)?;
        self.wait_sends(PHASE)?;
        let r = self.num_ranks;
        let mut blob = Vec::with_capacity(8 * (self.issued.len() + 5 * r));
        for v in self
            .issued
            .iter()
            .chain(&self.acks_to)
            .chain(&self.reports_to)
            .chain(&self.done_to)
            .chain(&self.sent_to)
        {
            blob.extend_from_slice(&v.to_le_bytes());
        }
        let all = boot.all_gather(&blob)?;
        let e_count = self.geo.layout.num_experts;
        let l = self.geo.layout.num_local_experts;
        let me = self.rank as u64;
        let mut waits = Vec::new();
        let mut totals = vec![0u64; r];
        for (src, b) in all.iter().enumerate() {
            if b.len() != blob.len() {
                return Err(Error::Protocol {
                    rank: self.rank,
                    peer: src,
                    phase: PHASE,
                    msg: format!("{} bytes of write counts, expected {}", b.len(), blob.len()),
                });
            }
            let word = |i: u64| -> u64 {
                let i = (i * 8) as usize;
                u64::from_le_bytes(b[i..i + 8].try_into().unwrap_or([0; 8]))
            };
            let issued = |phase: u64, set: u64, unit: u64| {
                word((phase * LL_NUM_SETS + set) * e_count + unit)
            };
            let (rr, tail) = (r as u64, 4 * e_count);
            for set in 0..LL_NUM_SETS {
                for e in 0..l {
                    let d = issued(0, set, me * l + e);
                    let c = issued(1, set, e * rr + me);
                    for (phase, n) in [(LlPhase::Dispatch, d), (LlPhase::Combine, c)] {
                        let id = self.recv_id(phase, set, src as u64, e)?;
                        waits.push(ArrivalWait { slot: id, expected: n, peer: src as u32 });
                    }
                }
                let acks = word(tail + set * rr + me);
                let id = self.ack_id(set, src as u64);
                waits.push(ArrivalWait { slot: id, expected: acks, peer: src as u32 });
            }
            let reports = word(tail + 2 * rr + me);
            for k in 0..REPORT_DIGITS {
                let id = self.digit_id(k, src as u64);
                waits.push(ArrivalWait { slot: id, expected: reports, peer: src as u32 });
            }
            let done = word(tail + 3 * rr + me);
            waits.push(ArrivalWait {
                slot: self.done_id(src as u64),
                expected: done,
                peer: src as u32,
            });
            totals[src] = word(tail + 4 * rr + me);
        }
        self.proxy.wait_all(&waits, self.timeout).map_err(|e| self.proxy_err(PHASE, e))?;
        let counters = self.proxy.counters().clone();
        for w in &waits {
            let arrived = counters.arrivals(w.slot).map_err(Error::Proxy)?;
            if arrived != w.expected {
                return Err(Error::Protocol {
                    rank: self.rank,
                    peer: w.peer as usize,
                    phase: PHASE,
                    msg: format!(
                        "{arrived} writes arrived on slot {}, it sent {}",
                        w.slot, w.expected
                    ),
                });
            }
        }
        for (src, &total) in totals.iter().enumerate() {
            self.rebase(src, &counters)?;
            let p = src as u64;
            for k in 0..REPORT_DIGITS as usize {
                let id = self.digit_id(k as u64, p);
                self.digit_seen[src][k] = counters.sums(id).map_err(Error::Proxy)?;
            }
            self.report_seen[src] = counters.arrivals(self.digit_id(0, p)).map_err(Error::Proxy)?;
            self.done_seen[src] = counters.arrivals(self.done_id(p)).map_err(Error::Proxy)?;
            self.peer_total[src] = total;
        }
        self.told.clone_from(&self.sent_to);
        self.fenced();
        boot.barrier()?;
        Ok(())
    }

    /// Re-bases `src`'s data and ack counters at what arrived (every write it sent here did).
    fn rebase(&mut self, src: usize, counters: &CounterMemory) -> Result<()> {
        let r = self.num_ranks;
        for id in self.data_ids_of(src as u64)? {
            let arrived = counters.arrivals(id).map_err(Error::Proxy)?;
            let ack0 = self.ack_id(0, 0);
            if id >= ack0 {
                let set = ((id - ack0) as usize) / r;
                self.ack_base[set * r + src] = arrived;
            } else {
                self.expected[id as usize] = arrived;
                self.sums_seen[id as usize] = counters.sums(id).map_err(Error::Proxy)?;
            }
        }
        Ok(())
    }

    /// Shrink mode's clean: the in-band fence among the unmasked ranks (module NOTES). A rank
    /// that does not keep up within the timeout is masked.
    fn fence_in_band(&mut self, dead: DeadFn<'_>) -> Result<()> {
        const PHASE: &str = "clean_low_latency_buffer";
        self.producer.publish();
        self.proxy.check().map_err(Error::Proxy)?;
        self.mask_dead(PHASE, dead);
        self.wait_sends(PHASE)?;
        let r = self.num_ranks;
        let me = self.rank as u64;
        // 1. Report to every unmasked rank the writes pushed there since the last report.
        for dst in 0..r {
            if self.masked(dst) {
                continue;
            }
            let delta = self.sent_to[dst] - self.told[dst];
            if delta >> (IMM_VALUE_BITS as u64 * REPORT_DIGITS) != 0 {
                return Err(Error::Other(format!(
                    "rank {}: {PHASE}: {delta} writes to rank {dst} since the last clean do not \
                     fit a report",
                    self.rank
                )));
            }
            for k in 0..REPORT_DIGITS {
                let digit = (delta >> (IMM_VALUE_BITS as u64 * k)) & IMM_VALUE_MAX as u64;
                let slot = self.digit_id(k, me);
                self.push_empty(PHASE, dst, slot, digit)?;
            }
            self.reports_to[dst] += 1;
            self.told[dst] = self.sent_to[dst];
        }
        self.producer.publish();
        // 2. Every unmasked rank's report.
        let mut waits = Vec::new();
        for src in 0..r as u64 {
            for k in 0..REPORT_DIGITS {
                waits.push(ArrivalWait {
                    slot: self.digit_id(k, src),
                    expected: self.report_seen[src as usize] + 1,
                    peer: src as u32,
                });
            }
        }
        self.wait_peers(PHASE, &waits, None, dead)?;
        let counters = self.proxy.counters().clone();
        for src in 0..r {
            if self.masked(src) {
                continue;
            }
            let mut delta = 0u64;
            for k in 0..REPORT_DIGITS as usize {
                let now =
                    counters.sums(self.digit_id(k as u64, src as u64)).map_err(Error::Proxy)?;
                delta = delta.wrapping_add(
                    now.wrapping_sub(self.digit_seen[src][k]) << (IMM_VALUE_BITS * k as u32),
                );
                self.digit_seen[src][k] = now;
            }
            self.report_seen[src] += 1;
            self.peer_total[src] = self.peer_total[src].wrapping_add(delta);
        }
        // 3. Every write each of them reported, then the re-base.
        self.wait_totals(PHASE, &counters, dead)?;
        for src in 0..r {
            if !self.masked(src) {
                self.rebase(src, &counters)?;
            }
        }
        // 4. Done: nobody's next call lands before every unmasked rank re-based.
        for dst in 0..r {
            if self.masked(dst) {
                continue;
            }
            let slot = self.done_id(me);
            self.push_empty(PHASE, dst, slot, 0)?;
            self.done_to[dst] += 1;
        }
        self.producer.publish();
        let waits: Vec<ArrivalWait> = (0..r)
            .map(|src| ArrivalWait {
                slot: self.done_id(src as u64),
                expected: self.done_seen[src] + 1,
                peer: src as u32,
            })
            .collect();
        self.wait_peers(PHASE, &waits, None, dead)?;
        for src in 0..r {
            if !self.masked(src) {
                self.done_seen[src] += 1;
            }
        }
        self.wait_sends(PHASE)?;
        self.fenced();
        Ok(())
    }

    /// Step 3 of the in-band fence: waits until the writes of every unmasked rank that arrived
    /// here add up to what it reported (more is a protocol error naming it); a rank that stalls
    /// for the timeout is masked.
    fn wait_totals(
        &mut self,
        phase: &'static str,
        counters: &CounterMemory,
        dead: DeadFn<'_>,
    ) -> Result<()> {
        let r = self.num_ranks;
        let ids: Vec<Vec<u32>> =
            (0..r as u64).map(|p| self.data_ids_of(p)).collect::<Result<_>>()?;
        let total = |p: usize| -> u64 {
            ids[p].iter().fold(0u64, |acc, &id| {
                acc.wrapping_add(counters.arrivals_atomic(id).load(Ordering::Acquire))
            })
        };
        let mut idle_since = Instant::now();
        let mut backoff = Backoff::new(128, 4096);
        let mut last: Vec<u64> = (0..r).map(total).collect();
        loop {
            let mut waiting = Vec::new();
            for (p, seen) in last.iter_mut().enumerate() {
                if self.masked(p) {
                    continue;
                }
                let got = total(p);
                if got > self.peer_total[p] {
                    return Err(Error::Protocol {
                        rank: self.rank,
                        peer: p,
                        phase,
                        msg: format!(
                            "{got} writes arrived from it, it reported {}",
                            self.peer_total[p]
                        ),
                    });
                }
                if got < self.peer_total[p] {
                    waiting.push(p);
                }
                if got != *seen {
                    *seen = got;
                    idle_since = Instant::now();
                }
            }
            if waiting.is_empty() {
                return Ok(());
            }
            self.proxy.check().map_err(|e| self.proxy_err(phase, e))?;
            let stalled = idle_since.elapsed() >= self.timeout;
            for &p in &waiting {
                if dead(p) {
                    self.mask_peer(p, phase, "the bootstrap saw it leave");
                } else if stalled {
                    let why = format!("its writes stopped arriving {:?} ago", idle_since.elapsed());
                    self.mask_peer(p, phase, &why);
                }
            }
            backoff.snooze();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::config::DispatchDtype;

    #[test]
    fn ll_geometry_never_crosses_a_chunk() {
        let l = LlLayout::from_parts(4, 16, 256, DispatchDtype::Bf16, 8).unwrap();
        for stride in [l.unit_bytes, l.unit_bytes * 3 + 16, 1 << 20, 1 << 30] {
            let g = LlGeometry::new(l, stride).unwrap();
            let mut seen = Vec::new();
            for set in 0..2 {
                for area in [LlArea::Send, LlArea::Recv] {
                    for u in 0..16 {
                        let o = g.offset(set, area, u).unwrap();
                        assert_eq!(o / stride, (o + l.unit_bytes - 1) / stride, "stride {stride}");
                        seen.push(o);
                    }
                }
            }
            seen.sort();
            for w in seen.windows(2) {
                assert!(w[0] + l.unit_bytes <= w[1]);
            }
            assert!(seen.last().unwrap() + l.unit_bytes <= g.bytes);
        }
    }
}
