//! Host backend of normal mode: the protocol of plan/ run by the calling CPU thread, through the
//! same command ring, proxy and transport the GPU kernels use.
//!
//! One call = one event loop on the caller's thread: it stages chunks into free send slots and
//! pushes one command per chunk, consumes arrived chunks of each source strictly in chunk order
//! (by the arrival counters the proxy publishes), and returns credits. It never relies on the
//! order in which two writes land.

pub(crate) mod ll;

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::protocol::plan::{
    imm_decode, NormalLayout, NotifyRecord, Phase, RegionPlan, IMM_VALUE_MAX, NOTIFY_SLOTS,
};
use crate::proxy::{ArrivalWait, Command, Proxy, ProxyError, RingProducer, SharedRegion};
use crate::util::Backoff;
use crate::{Error, Result};

/// Where the normal-mode slots sit inside one registered buffer (send staging and receive area
/// share this geometry).
///
/// ```text
/// [data: R * spp slots, packed per memory region][notify: 2 * R records, packed per region]
/// ```
///
// NOTES: a provider registers a buffer in chunks of `stride` bytes (fabric::MemoryRegion) and an
// RMA write must stay inside one chunk on both sides. Slots are therefore packed
// `units_per_region` to a chunk (plan's RegionPlan) and every chunk starts at a multiple of
// `stride`, so no slot and no notify record ever crosses a chunk boundary.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    pub layout: NormalLayout,
    pub stride: u64,
    pub data: RegionPlan,
    pub notify: RegionPlan,
    pub notify_base: u64,
    /// Bytes of the whole buffer.
    pub bytes: u64,
}

fn section_end(base: u64, plan: &RegionPlan, stride: u64) -> Result<u64> {
    if plan.num_regions == 0 {
        return Ok(base);
    }
    let (_, last) = plan.region_range(plan.num_regions - 1)?;
    Ok(base + (plan.num_regions - 1) * stride + last)
}

impl Geometry {
    /// `stride`: the provider's memory-region chunk (power of two, >= one slot).
    pub fn new(layout: &NormalLayout, stride: u64) -> Result<Self> {
        let data = layout.data_region_plan(stride)?;
        let notify = layout.notify_region_plan(stride)?;
        let data_end = section_end(0, &data, stride)?;
        let first_notify = notify.units_per_region * notify.unit_bytes;
        let notify_base = if notify.num_regions > 1 || data_end % stride + first_notify > stride {
            data_end.div_ceil(stride) * stride
        } else {
            data_end
        };
        let bytes = section_end(notify_base, &notify, stride)?;
        Ok(Geometry { layout: *layout, stride, data, notify, notify_base, bytes })
    }

    fn place(plan: &RegionPlan, stride: u64, unit: u64) -> u64 {
        (unit / plan.units_per_region) * stride + (unit % plan.units_per_region) * plan.unit_bytes
    }

    /// Offset of data slot `(peer, slot)`: the receive slot of source `peer`, or the staging
    /// slot for destination `peer`.
    pub fn data_offset(&self, peer: usize, slot: u64) -> u64 {
        let unit = peer as u64 * self.layout.slots_per_peer + slot;
        Self::place(&self.data, self.stride, unit)
    }

    /// Offset of the notify record of `peer` with sequence number `seq`.
    pub fn notify_offset(&self, peer: usize, seq: u64) -> u64 {
        let unit = (seq % NOTIFY_SLOTS) * self.layout.num_ranks + peer as u64;
        self.notify_base + Self::place(&self.notify, self.stride, unit)
    }
}

/// What one step moves: per peer row counts, known on both sides before the step starts.
pub(crate) struct StepCounts<'a> {
    /// `[R]` rows this rank sends to each destination.
    pub send: &'a [u64],
    /// `[R]` rows this rank receives from each source.
    pub recv: &'a [u64],
}

/// The communication state of one rank: regions, ring, proxy and the protocol counters.
///
/// NOTES: every counter here is cumulative over the buffer's life, like the proxy's arrival
/// counters, so nothing is ever reset while a write may be in flight: chunk `k` of a step sits
/// in slot `k % spp`, and it has arrived when that slot's arrivals exceed what this rank has
/// consumed from it.
pub(crate) struct HostComm {
    pub rank: usize,
    pub num_ranks: usize,
    pub geo: Geometry,
    pub timeout: Duration,
    // NOTES: field order is drop order: the producer releases its ring, then the proxy stops
    // and joins its workers (who hold the transports), then the regions may go.
    producer: RingProducer,
    proxy: Proxy,
    pub send: Arc<SharedRegion>,
    pub recv: Arc<SharedRegion>,
    pushed: u64,
    data_consumed: Vec<u64>,
    data_sums: Vec<u64>,
    sent_chunks: Vec<u64>,
    notify_seq: u64,
}

impl HostComm {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        rank: usize,
        geo: Geometry,
        timeout: Duration,
        producer: RingProducer,
        proxy: Proxy,
        send: Arc<SharedRegion>,
        recv: Arc<SharedRegion>,
    ) -> Self {
        let r = geo.layout.num_ranks as usize;
        let data_ids = 2 * r * geo.layout.slots_per_peer as usize;
        HostComm {
            rank,
            num_ranks: r,
            geo,
            timeout,
            producer,
            proxy,
            send,
            recv,
            pushed: 0,
            data_consumed: vec![0; data_ids],
            data_sums: vec![0; data_ids],
            sent_chunks: vec![0; r],
            notify_seq: 0,
        }
    }

    fn layout(&self) -> &NormalLayout {
        &self.geo.layout
    }

    fn proxy_err(&self, phase: &'static str, e: ProxyError) -> Error {
        Error::from_proxy(self.rank, phase, e)
    }

    /// Stage and publish one command; `false` when the ring is full (retry later).
    fn try_push(&mut self, cmd: &Command) -> bool {
        if self.producer.stage(cmd) {
            self.pushed += 1;
            true
        } else {
            self.producer.publish();
            false
        }
    }

    fn push_blocking(&mut self, cmd: &Command, phase: &'static str) -> Result<()> {
        self.producer.push(cmd, self.timeout).map_err(|e| self.proxy_err(phase, e))?;
        self.pushed += 1;
        Ok(())
    }

    /// Waits (bounded) until every command pushed so far completed locally: the staging areas
    /// are then free and nothing of this step is left in the ring.
    fn wait_sends(&self, phase: &'static str) -> Result<()> {
        self.proxy
            .wait_sends(self.producer.ring(), self.pushed, self.timeout)
            .map_err(|e| self.proxy_err(phase, e))
    }

    fn counter_id(imm: u32) -> u32 {
        imm_decode(imm).0 as u32
    }

    /// The notify step: send `records[dst]` to every rank (itself included), wait for every
    /// rank's record, return them by source. Errors name the ranks that did not deliver.
    pub fn notify(&mut self, mut records: Vec<NotifyRecord>) -> Result<Vec<NotifyRecord>> {
        let (r, seq) = (self.num_ranks, self.notify_seq);
        if records.len() != r {
            return Err(Error::arg("records", format!("{} records for {r} ranks", records.len())));
        }
        let rec_bytes = self.layout().notify_record_bytes;
        let mut buf = vec![0u8; rec_bytes as usize];
        for (dst, rec) in records.iter_mut().enumerate() {
            rec.seq = seq as u32;
            rec.encode(&mut buf)?;
            let off = self.geo.notify_offset(dst, seq);
            // SAFETY: the notify staging record (dst, seq % 2) was last sent at seq - 2, whose
            // write completed before that step ended (wait_sends); nobody else writes it.
            unsafe { self.send.write(off as usize, &buf) }.map_err(Error::Proxy)?;
            let cmd = Command {
                dst_rank: dst as u32,
                local_offset: off,
                remote_offset: self.geo.notify_offset(self.rank, seq),
                length: rec_bytes as u32,
                imm: self.layout().imm.notify(self.rank as u64, seq)?,
            };
            self.push_blocking(&cmd, "notify")?;
        }
        self.producer.publish();
        let waits: Vec<ArrivalWait> = (0..r)
            .map(|src| {
                Ok(ArrivalWait {
                    slot: Self::counter_id(self.layout().imm.notify(src as u64, seq)?),
                    expected: seq + 1,
                    peer: src as u32,
                })
            })
            .collect::<Result<_>>()?;
        self.proxy.wait_all(&waits, self.timeout).map_err(|e| self.proxy_err("notify", e))?;
        let mut out = Vec::with_capacity(r);
        let l = self.layout().num_local_experts;
        for src in 0..r {
            let off = self.geo.notify_offset(src, seq) as usize;
            let mut b = vec![0u8; rec_bytes as usize];
            // SAFETY: the record arrived (counter Acquired above) and src writes this slot
            // again only at seq + 2, after this rank's notify seq + 1 (plan/normal.rs NOTES).
            unsafe { self.recv.read(off, &mut b) }.map_err(Error::Proxy)?;
            let rec = NotifyRecord::decode(&b, l)?;
            if rec.seq != seq as u32 {
                return Err(Error::Protocol {
                    rank: self.rank,
                    peer: src,
                    phase: "notify",
                    msg: format!("record has sequence number {}, expected {seq}", rec.seq),
                });
            }
            out.push(rec);
        }
        self.notify_seq += 1;
        Ok(out)
    }

    /// One data step of `phase`: sends `counts.send[dst]` rows to each destination (rows built
    /// by `write_row(dst, i, record)`) and receives `counts.recv[src]` rows from each source
    /// (handed to `read_row(src, i, record)`), through the bounded slot queues. Returns once
    /// every chunk it sent was credited, every chunk it expects was consumed, and every command
    /// completed locally.
    // Index loops over ranks read closest to the protocol.
    #[allow(clippy::needless_range_loop)]
    pub fn step(
        &mut self,
        phase: Phase,
        counts: &StepCounts<'_>,
        mut write_row: impl FnMut(usize, u64, &mut [u8]) -> Result<()>,
        mut read_row: impl FnMut(usize, u64, &[u8]) -> Result<()>,
    ) -> Result<()> {
        let name = match phase {
            Phase::Dispatch => "dispatch",
            Phase::Combine => "combine",
        };
        let r = self.num_ranks;
        let layout = *self.layout();
        let spp = layout.slots_per_peer;
        let rec_bytes = layout.record(phase).bytes as usize;
        let send_chunks: Vec<u64> = counts.send.iter().map(|&n| layout.num_chunks(n)).collect();
        let recv_chunks: Vec<u64> = counts.recv.iter().map(|&n| layout.num_chunks(n)).collect();
        let mut next_k = vec![0u64; r];
        let mut consume_k = vec![0u64; r];
        let mut pending_credit = vec![0u64; r];
        let credit_ids: Vec<u32> = (0..r)
            .map(|d| Ok(Self::counter_id(layout.imm.credit(d as u64, 0)?)))
            .collect::<Result<_>>()?;
        let target_credits: Vec<u64> =
            (0..r).map(|d| self.sent_chunks[d] + send_chunks[d]).collect();
        let counters = self.proxy.counters().clone();
        // The deadline bounds the time without progress (a chunk sent, consumed or credited),
        // not the whole exchange: slow but live peers on a busy machine never time out.
        let mut idle_since = Instant::now();
        // The event loop's idle policy (many ranks may share few cores).
        let mut backoff = Backoff::new(64, 2048);
        let mut passes = 0u32;
        loop {
            let mut progress = false;
            let mut ring_full = false;
            // Send: destinations rotated from this rank, so ranks do not all start on rank 0.
            for j in 0..r {
                let dst = (self.rank + j) % r;
                while !ring_full && next_k[dst] < send_chunks[dst] {
                    let credited = counters.sums(credit_ids[dst]).map_err(Error::Proxy)?;
                    if self.sent_chunks[dst] - credited >= spp {
                        break;
                    }
                    let k = next_k[dst];
                    let slot = layout.chunk_slot(k);
                    let (begin, end) = layout.chunk_range(counts.send[dst], k);
                    let off = self.geo.data_offset(dst, slot);
                    let len = (end - begin) as usize * rec_bytes;
                    // SAFETY: staging slot (dst, slot) last carried chunk k - spp (or an older
                    // step's chunk), which dst credited (checked above): its bytes were read.
                    // Only this thread writes staging.
                    let chunk = unsafe { region_mut(&self.send, off, len)? };
                    for (i, rec) in chunk.chunks_exact_mut(rec_bytes).enumerate() {
                        write_row(dst, begin + i as u64, rec)?;
                    }
                    let cmd = Command {
                        dst_rank: dst as u32,
                        local_offset: off,
                        remote_offset: self.geo.data_offset(self.rank, slot),
                        length: len as u32,
                        imm: layout.imm.data(phase, self.rank as u64, slot, end - begin)?,
                    };
                    if !self.try_push(&cmd) {
                        ring_full = true;
                        break;
                    }
                    next_k[dst] += 1;
                    self.sent_chunks[dst] += 1;
                    progress = true;
                }
            }
            // Receive: each source strictly in chunk order.
            for j in 0..r {
                let src = (self.rank + r - j) % r;
                while consume_k[src] < recv_chunks[src] {
                    let k = consume_k[src];
                    let slot = layout.chunk_slot(k);
                    let id = Self::counter_id(layout.imm.data(phase, src as u64, slot, 0)?);
                    let arrived = counters.arrivals(id).map_err(Error::Proxy)?;
                    let idx = id as usize;
                    if arrived <= self.data_consumed[idx] {
                        break;
                    }
                    let bad = |msg: String| Error::Protocol {
                        rank: self.rank,
                        peer: src,
                        phase: name,
                        msg,
                    };
                    if arrived > self.data_consumed[idx] + 1 {
                        return Err(bad(format!(
                            "slot {slot} written {} times before it was consumed",
                            arrived - self.data_consumed[idx]
                        )));
                    }
                    let rows = counters.sums(id).map_err(Error::Proxy)? - self.data_sums[idx];
                    let (begin, end) = layout.chunk_range(counts.recv[src], k);
                    if rows != end - begin {
                        return Err(bad(format!(
                            "chunk {k} carries {rows} rows, expected {}",
                            end - begin
                        )));
                    }
                    let off = self.geo.data_offset(src, slot);
                    // SAFETY: the chunk arrived (Acquire on its counter) and src does not write
                    // this slot again before this rank credits it, below.
                    let chunk = unsafe { region_ref(&self.recv, off, rows as usize * rec_bytes)? };
                    for (i, rec) in chunk.chunks_exact(rec_bytes).enumerate() {
                        read_row(src, begin + i as u64, rec)?;
                    }
                    self.data_consumed[idx] += 1;
                    self.data_sums[idx] += rows;
                    consume_k[src] += 1;
                    pending_credit[src] += 1;
                    progress = true;
                }
            }
            // Credits: one zero-length write per source per pass, batching the chunks consumed.
            for src in 0..r {
                if pending_credit[src] > 0 && !ring_full {
                    let n = pending_credit[src].min(IMM_VALUE_MAX as u64);
                    let cmd = Command {
                        dst_rank: src as u32,
                        local_offset: 0,
                        remote_offset: 0,
                        length: 0,
                        imm: layout.imm.credit(self.rank as u64, n)?,
                    };
                    if self.try_push(&cmd) {
                        pending_credit[src] -= n;
                        progress = true;
                    } else {
                        ring_full = true;
                    }
                }
            }
            self.producer.publish();
            let sent_all = (0..r).all(|d| next_k[d] == send_chunks[d]);
            let got_all = (0..r).all(|s| consume_k[s] == recv_chunks[s]);
            let credits_out = pending_credit.iter().all(|&c| c == 0);
            if sent_all && got_all && credits_out {
                let mut credited_all = true;
                for d in 0..r {
                    if counters.sums(credit_ids[d]).map_err(Error::Proxy)? < target_credits[d] {
                        credited_all = false;
                        break;
                    }
                }
                if credited_all {
                    break;
                }
            }
            if progress {
                backoff.reset();
                idle_since = Instant::now();
                continue;
            }
            passes = passes.wrapping_add(1);
            if passes % 64 == 0 {
                self.proxy.check_running().map_err(|e| self.proxy_err(name, e))?;
                if idle_since.elapsed() >= self.timeout {
                    let mut peers = Vec::new();
                    for p in 0..r {
                        let credited = counters.sums(credit_ids[p]).map_err(Error::Proxy)?;
                        if consume_k[p] < recv_chunks[p] || credited < target_credits[p] {
                            peers.push(p);
                        }
                    }
                    return Err(Error::Timeout {
                        rank: self.rank,
                        phase: name,
                        peers,
                        waited: idle_since.elapsed(),
                        detail: " without progress".into(),
                    });
                }
            }
            backoff.snooze();
        }
        self.wait_sends(name)
    }
}

/// `len` bytes of `region` at `off`, writable.
///
/// # Safety
/// Nobody else may read or write these bytes while the slice lives.
// The region is shared memory (the NIC reads it); exclusivity is this unsafe fn's contract.
#[allow(clippy::mut_from_ref)]
unsafe fn region_mut(region: &SharedRegion, off: u64, len: usize) -> Result<&mut [u8]> {
    check_range(region, off, len)?;
    // SAFETY: in bounds (checked); exclusivity is the caller's contract.
    Ok(unsafe { std::slice::from_raw_parts_mut(region.as_ptr().add(off as usize), len) })
}

/// `len` bytes of `region` at `off`, read-only.
///
/// # Safety
/// Nobody may write these bytes while the slice lives.
unsafe fn region_ref(region: &SharedRegion, off: u64, len: usize) -> Result<&[u8]> {
    check_range(region, off, len)?;
    // SAFETY: in bounds (checked); no concurrent writer is the caller's contract.
    Ok(unsafe { std::slice::from_raw_parts(region.as_ptr().add(off as usize), len) })
}

fn check_range(region: &SharedRegion, off: u64, len: usize) -> Result<()> {
    match (off as usize).checked_add(len) {
        Some(end) if end <= region.len() => Ok(()),
        _ => Err(Error::Other(format!(
            "slot [{off}, +{len}) outside the {}-byte buffer (geometry bug)",
            region.len()
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::config::DispatchDtype;

    #[test]
    fn geometry_never_crosses_a_chunk() {
        let l = NormalLayout::from_parts(8, 16, 256, 4, DispatchDtype::Bf16, 7, 3).unwrap();
        for stride in [l.slot_bytes, l.slot_bytes * 2 + 16, 4096 * 16, 1 << 30] {
            let g = Geometry::new(&l, stride).unwrap();
            let mut seen = Vec::new();
            for p in 0..8 {
                for s in 0..3 {
                    let o = g.data_offset(p, s);
                    assert_eq!(o / stride, (o + l.slot_bytes - 1) / stride, "stride {stride}");
                    seen.push((o, l.slot_bytes));
                }
                for seq in 0..2 {
                    let o = g.notify_offset(p, seq);
                    let n = l.notify_record_bytes;
                    assert_eq!(o / stride, (o + n - 1) / stride, "stride {stride}");
                    seen.push((o, n));
                }
            }
            seen.sort();
            for w in seen.windows(2) {
                assert!(w[0].0 + w[0].1 <= w[1].0, "overlap at stride {stride}");
            }
            let (o, n) = *seen.last().unwrap();
            assert!(o + n <= g.bytes);
        }
    }
}
