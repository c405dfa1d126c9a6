//! Host backend of low-latency mode: the protocol of plan.rs's `LlLayout` run by the calling CPU
//! thread, through its own command ring, proxy and transport (separate from normal mode's, so the
//! two immediate id spaces never share counters).
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

use std::sync::Arc;
use std::time::Duration;

use super::{region_mut, region_ref};
use crate::bootstrap::Bootstrap;
use crate::ep::plan::{imm_decode, imm_encode, LlArea, LlLayout, RegionPlan, LL_NUM_SETS};
use crate::fabric::{MemoryRegion, Stack};
use crate::proxy::{ArrivalWait, Command, Proxy, ProxyError, RingProducer, SharedRegion};
use crate::{Error, Result};

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
    /// Acks this rank sent to every rank, per set.
    acks_sent: [u64; 2],
    /// Per set: the call whose receive is still outstanding (a hook not completed yet).
    pub pending: [Option<u64>; 2],
    /// Bumped by every fence: hooks from before it are refused.
    pub generation: u64,
    /// Why the lane refuses calls until `clean_low_latency_buffer`.
    pub broken: Option<String>,
}

impl LlComm {
    pub fn new(
        rank: usize,
        geo: LlGeometry,
        timeout: Duration,
        producer: RingProducer,
        proxy: Proxy,
        send: Arc<SharedRegion>,
        recv: Arc<SharedRegion>,
    ) -> Self {
        let ids = geo.layout.imm.num_ids() as usize;
        LlComm {
            rank,
            num_ranks: geo.layout.num_ranks as usize,
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
            ack_base: vec![0; 2 * geo.layout.num_ranks as usize],
            acks_sent: [0, 0],
            pending: [None, None],
            generation: 0,
            broken: None,
        }
    }

    fn proxy_err(&self, phase: &'static str, e: ProxyError) -> Error {
        Error::from_proxy(self.rank, phase, e)
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

    /// Counter slots the LL lane needs: LlImm's `4E` plus `2R` ack ids.
    pub fn num_slots(layout: &LlLayout) -> Result<u32> {
        let n = layout.imm.num_ids() + LL_NUM_SETS * layout.num_ranks;
        imm_encode(n - 1, 0)?;
        Ok(n as u32)
    }

    fn ack_id(&self, set: u64, src: u64) -> u32 {
        (self.geo.layout.imm.num_ids() + set * self.num_ranks as u64 + src) as u32
    }

    /// Before the sends of a call on `set`: waits (bounded) until every rank acked every
    /// earlier call on this set since the last fence (module NOTES).
    pub fn wait_set_free(&self, phase: LlPhase, set: u64) -> Result<()> {
        let earlier = self.calls / LL_NUM_SETS + u64::from(self.calls % LL_NUM_SETS > set);
        let r = self.num_ranks as u64;
        let waits: Vec<ArrivalWait> = (0..r)
            .map(|p| ArrivalWait {
                slot: self.ack_id(set, p),
                expected: self.ack_base[(set * r + p) as usize] + earlier,
                peer: p as u32,
            })
            .collect();
        self.proxy.wait_all(&waits, self.timeout).map_err(|e| self.proxy_err(phase.name(), e))
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

    /// Pushes one message; `issued_unit` is its sender-side unit (see `issued`).
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
        let e = self.geo.layout.num_experts;
        self.issued[((phase as u64 * LL_NUM_SETS + set) * e + issued_unit) as usize] += 1;
        Ok(())
    }

    pub fn publish(&mut self) {
        self.producer.publish();
    }

    /// Waits (bounded) for one message of `(phase, set)` from every rank for every local
    /// expert; returns the counts `[L, R]` (index `e * R + src`). Errors name the ranks that did
    /// not deliver, or the peer that overran the set.
    pub fn wait_counts(&self, phase: LlPhase, set: u64) -> Result<Vec<u32>> {
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
        self.proxy.wait_all(&waits, self.timeout).map_err(|e| self.proxy_err(phase.name(), e))?;
        let counters = self.proxy.counters();
        let mut counts = Vec::with_capacity(waits.len());
        for w in &waits {
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
    /// marks the messages consumed and waits (bounded) until this rank's own writes completed
    /// locally (its staging is reusable).
    pub fn finish_recv(&mut self, phase: LlPhase, set: u64) -> Result<()> {
        let (l, r) = (self.geo.layout.num_local_experts, self.num_ranks as u64);
        let counters = self.proxy.counters().clone();
        for e in 0..l {
            for src in 0..r {
                let id = self.recv_id(phase, set, src, e)? as usize;
                let arrived = counters.arrivals(id as u32).map_err(Error::Proxy)?;
                if arrived != self.expected[id] + 1 {
                    return Err(self.overrun(phase, src as usize, set));
                }
                self.expected[id] += 1;
                self.sums_seen[id] = counters.sums(id as u32).map_err(Error::Proxy)?;
            }
        }
        for dst in 0..self.num_ranks {
            let imm = imm_encode(u64::from(self.ack_id(set, self.rank as u64)), 0)?;
            let cmd =
                Command { dst_rank: dst as u32, local_offset: 0, remote_offset: 0, length: 0, imm };
            self.producer.push(&cmd, self.timeout).map_err(|e| self.proxy_err(phase.name(), e))?;
            self.pushed += 1;
        }
        self.acks_sent[set as usize] += 1;
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

    /// The collective fence of `clean_low_latency_buffer` (module NOTES).
    pub fn fence(&mut self, boot: &dyn Bootstrap) -> Result<()> {
        const PHASE: &str = "clean_low_latency_buffer";
        self.producer.publish();
        self.proxy.check().map_err(Error::Proxy)?;
        self.wait_sends(PHASE)?;
        let mut blob = Vec::with_capacity(8 * self.issued.len() + 16);
        for v in self.issued.iter().chain(&self.acks_sent) {
            blob.extend_from_slice(&v.to_le_bytes());
        }
        let all = boot.all_gather(&blob)?;
        let e_count = self.geo.layout.num_experts;
        let (l, r) = (self.geo.layout.num_local_experts, self.num_ranks as u64);
        let me = self.rank as u64;
        let mut waits = Vec::new();
        for (src, b) in all.iter().enumerate() {
            if b.len() != blob.len() {
                return Err(Error::Protocol {
                    rank: self.rank,
                    peer: src,
                    phase: PHASE,
                    msg: format!("{} bytes of write counts, expected {}", b.len(), blob.len()),
                });
            }
            let issued = |phase: u64, set: u64, unit: u64| -> u64 {
                let i = (((phase * LL_NUM_SETS + set) * e_count + unit) * 8) as usize;
                u64::from_le_bytes(b[i..i + 8].try_into().unwrap_or([0; 8]))
            };
            for set in 0..LL_NUM_SETS {
                for e in 0..l {
                    let d = issued(0, set, me * l + e);
                    let c = issued(1, set, e * r + me);
                    for (phase, n) in [(LlPhase::Dispatch, d), (LlPhase::Combine, c)] {
                        let id = self.recv_id(phase, set, src as u64, e)?;
                        waits.push(ArrivalWait { slot: id, expected: n, peer: src as u32 });
                    }
                }
                let i = ((4 * e_count + set) * 8) as usize;
                let acks = u64::from_le_bytes(b[i..i + 8].try_into().unwrap_or([0; 8]));
                let id = self.ack_id(set, src as u64);
                waits.push(ArrivalWait { slot: id, expected: acks, peer: src as u32 });
            }
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
            let ack0 = self.ack_id(0, 0);
            if w.slot >= ack0 {
                self.ack_base[(w.slot - ack0) as usize] = arrived;
            } else {
                self.expected[w.slot as usize] = arrived;
                self.sums_seen[w.slot as usize] = counters.sums(w.slot).map_err(Error::Proxy)?;
            }
        }
        self.calls = 0;
        self.pending = [None, None];
        self.generation += 1;
        self.broken = None;
        boot.barrier()?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ep::config::DispatchDtype;

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
