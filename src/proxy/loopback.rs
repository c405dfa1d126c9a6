//! In-process transport: a group of ranks sharing one address space (CI, host backend).
//!
//! `post_write` copies the bytes straight into the destination's receive region and queues the
//! arrival in a per-destination outbox; `poll` hands outboxes to their destinations (one lock per
//! destination per poll, none per command) and reports local completions. Options inject EAGAIN
//! and reorder deliveries the way SRD and `udp;ofi_rxd` do.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use super::memory::SharedRegion;
use super::transport::{Transport, TransportEvent, WriteOp};
use super::ProxyError;
use crate::util::SplitMix64;

/// Fault injection and limits for a [`LoopbackGroup`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoopbackOptions {
    /// Refuse (EAGAIN) every `eagain_every`-th post attempt; 0 = never. 1 is rejected (no progress).
    pub eagain_every: u32,
    /// Shuffle deliveries and hold some back to the next poll, seeded; `None` = in order.
    pub reorder_seed: Option<u64>,
    /// Posts accepted between two polls before backpressure (EAGAIN).
    pub max_outstanding: usize,
}

impl Default for LoopbackOptions {
    fn default() -> Self {
        LoopbackOptions { eagain_every: 0, reorder_seed: None, max_outstanding: 4096 }
    }
}

struct RankShared {
    send: Arc<SharedRegion>,
    recv: Arc<SharedRegion>,
    inbox: Mutex<Vec<(u32, u32)>>,
    alive: AtomicBool,
}

struct GroupInner {
    ranks: Vec<RankShared>,
    opts: LoopbackOptions,
}

/// The shared state of the in-process ranks. Make one [`LoopbackTransport`] per proxy worker with
/// [`LoopbackGroup::transport`].
#[derive(Clone)]
pub struct LoopbackGroup {
    inner: Arc<GroupInner>,
}

impl std::fmt::Debug for LoopbackGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoopbackGroup")
            .field("num_ranks", &self.inner.ranks.len())
            .field("opts", &self.inner.opts)
            .finish()
    }
}

impl LoopbackGroup {
    /// One `(send, recv)` region pair per rank.
    pub fn new(
        regions: Vec<(Arc<SharedRegion>, Arc<SharedRegion>)>,
        opts: LoopbackOptions,
    ) -> Result<Self, ProxyError> {
        if regions.is_empty() || regions.len() > u32::MAX as usize {
            return Err(ProxyError::InvalidConfig {
                what: "loopback ranks",
                msg: format!("{} ranks", regions.len()),
            });
        }
        if opts.eagain_every == 1 {
            return Err(ProxyError::InvalidConfig {
                what: "eagain_every",
                msg: "1 would refuse every post".into(),
            });
        }
        if opts.max_outstanding == 0 {
            return Err(ProxyError::InvalidConfig {
                what: "max_outstanding",
                msg: "must be >= 1".into(),
            });
        }
        let ranks = regions
            .into_iter()
            .map(|(send, recv)| RankShared {
                send,
                recv,
                inbox: Mutex::new(Vec::new()),
                alive: AtomicBool::new(true),
            })
            .collect();
        Ok(LoopbackGroup { inner: Arc::new(GroupInner { ranks, opts }) })
    }

    /// `num_ranks` ranks with zeroed host send/recv regions.
    pub fn host(
        num_ranks: u32,
        send_bytes: usize,
        recv_bytes: usize,
        opts: LoopbackOptions,
    ) -> Result<Self, ProxyError> {
        let regions = (0..num_ranks)
            .map(|_| {
                Ok((
                    Arc::new(SharedRegion::alloc_host(send_bytes)?),
                    Arc::new(SharedRegion::alloc_host(recv_bytes)?),
                ))
            })
            .collect::<Result<Vec<_>, ProxyError>>()?;
        Self::new(regions, opts)
    }

    pub fn num_ranks(&self) -> u32 {
        self.inner.ranks.len() as u32
    }

    fn rank(&self, rank: u32) -> Result<&RankShared, ProxyError> {
        self.inner.ranks.get(rank as usize).ok_or(ProxyError::BadRank {
            rank,
            ring: u32::MAX,
            dst_rank: rank,
            num_ranks: self.num_ranks(),
        })
    }

    pub fn send_region(&self, rank: u32) -> Result<&Arc<SharedRegion>, ProxyError> {
        Ok(&self.rank(rank)?.send)
    }

    pub fn recv_region(&self, rank: u32) -> Result<&Arc<SharedRegion>, ProxyError> {
        Ok(&self.rank(rank)?.recv)
    }

    /// Marks `rank` gone (or back): posts to a gone rank fail with `PeerUnreachable`.
    pub fn set_alive(&self, rank: u32, alive: bool) -> Result<(), ProxyError> {
        self.rank(rank)?.alive.store(alive, Ordering::Release);
        Ok(())
    }

    /// An endpoint for `rank`. A rank may have several (one per worker); they share its inbox.
    pub fn transport(&self, rank: u32) -> Result<LoopbackTransport, ProxyError> {
        self.rank(rank)?;
        let n = self.inner.ranks.len();
        let seed = self.inner.opts.reorder_seed;
        Ok(LoopbackTransport {
            group: self.clone(),
            rank,
            opts: self.inner.opts,
            rng: SplitMix64(seed.unwrap_or(0) ^ (u64::from(rank) << 32)),
            send_ptr: self.inner.ranks[rank as usize].send.as_ptr(),
            send_len: self.inner.ranks[rank as usize].send.len(),
            recv: self.inner.ranks.iter().map(|r| (r.recv.as_ptr(), r.recv.len())).collect(),
            outbox: (0..n).map(|_| Vec::new()).collect(),
            dirty: Vec::with_capacity(n),
            outstanding: 0,
            attempts: 0,
            send_done: Vec::new(),
            deferred: Vec::new(),
            scratch: Vec::new(),
        })
    }
}

/// One rank's endpoint in a [`LoopbackGroup`].
pub struct LoopbackTransport {
    group: LoopbackGroup,
    rank: u32,
    opts: LoopbackOptions,
    rng: SplitMix64,
    send_ptr: *mut u8,
    send_len: usize,
    recv: Vec<(*mut u8, usize)>,
    /// Arrivals `(imm, len)` per destination, not yet handed over.
    outbox: Vec<Vec<(u32, u32)>>,
    /// Destinations with a non-empty outbox.
    dirty: Vec<u32>,
    outstanding: usize,
    attempts: u64,
    /// `(ring, count)` runs of local completions since the last poll.
    send_done: Vec<(u32, u32, u32)>,
    /// Arrivals held back by reordering, delivered at the next poll.
    deferred: Vec<(u32, u32)>,
    scratch: Vec<(u32, u32)>,
}

// SAFETY: the raw pointers point into regions the group keeps alive (Arc); access to their bytes
// follows the proxy protocol (a send area is stable until its completion, a receive area is read
// after its arrival).
unsafe impl Send for LoopbackTransport {}

impl std::fmt::Debug for LoopbackTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoopbackTransport").field("rank", &self.rank).finish()
    }
}

fn shuffle(rng: &mut SplitMix64, v: &mut [(u32, u32)]) {
    for i in (1..v.len()).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        v.swap(i, j);
    }
}

impl LoopbackTransport {
    pub fn rank(&self) -> u32 {
        self.rank
    }

    fn out_of_bounds(&self, op: &WriteOp, what: &'static str, len: usize) -> ProxyError {
        let offset = if what == "local write source" { op.local_offset } else { op.remote_offset };
        ProxyError::OutOfBounds {
            rank: self.rank,
            peer: op.dst_rank,
            what,
            offset,
            length: u64::from(op.length),
            len,
        }
    }
}

impl Transport for LoopbackTransport {
    #[inline]
    fn post_write(&mut self, op: &WriteOp) -> Result<bool, ProxyError> {
        self.attempts += 1;
        if self.opts.eagain_every != 0 && self.attempts % u64::from(self.opts.eagain_every) == 0 {
            return Ok(false);
        }
        if self.outstanding >= self.opts.max_outstanding {
            return Ok(false);
        }
        let Some(&(dst_ptr, dst_len)) = self.recv.get(op.dst_rank as usize) else {
            return Err(ProxyError::BadRank {
                rank: self.rank,
                ring: op.ring,
                dst_rank: op.dst_rank,
                num_ranks: self.recv.len() as u32,
            });
        };
        let length = u64::from(op.length);
        if op.local_offset.checked_add(length).is_none_or(|end| end > self.send_len as u64) {
            return Err(self.out_of_bounds(op, "local write source", self.send_len));
        }
        if op.remote_offset.checked_add(length).is_none_or(|end| end > dst_len as u64) {
            return Err(self.out_of_bounds(op, "remote write target", dst_len));
        }
        if !self.group.inner.ranks[op.dst_rank as usize].alive.load(Ordering::Relaxed) {
            return Err(ProxyError::PeerUnreachable {
                rank: self.rank,
                peer: op.dst_rank,
                msg: "loopback peer marked gone".into(),
            });
        }
        if op.length > 0 {
            // SAFETY: both ranges are in bounds (checked above) of regions the group keeps alive;
            // `copy` tolerates a rank whose send and receive regions are the same memory.
            unsafe {
                std::ptr::copy(
                    self.send_ptr.add(op.local_offset as usize),
                    dst_ptr.add(op.remote_offset as usize),
                    op.length as usize,
                );
            }
        }
        let out = &mut self.outbox[op.dst_rank as usize];
        if out.is_empty() {
            self.dirty.push(op.dst_rank);
        }
        out.push((op.imm, op.length));
        self.outstanding += 1;
        match self.send_done.last_mut() {
            Some((ring, dst, count))
                if *ring == op.ring && *dst == op.dst_rank && *count < u32::MAX =>
            {
                *count += 1
            }
            _ => self.send_done.push((op.ring, op.dst_rank, 1)),
        }
        Ok(true)
    }

    fn poll(&mut self, events: &mut Vec<TransportEvent>) -> Result<(), ProxyError> {
        let reorder = self.opts.reorder_seed.is_some();
        // NOTES: the bytes were copied in post_write, before the arrival is handed over here; the
        // inbox mutex (or, for ourselves, program order) orders the copy before the arrival, and
        // the worker's Release on `arrivals` passes that on to whoever polls the counter.
        for i in 0..self.dirty.len() {
            let dst = self.dirty[i];
            let mut out = std::mem::take(&mut self.outbox[dst as usize]);
            if reorder {
                shuffle(&mut self.rng, &mut out);
            }
            if dst == self.rank {
                self.scratch.append(&mut out);
            } else {
                self.group.inner.ranks[dst as usize].inbox.lock().append(&mut out);
            }
            self.outbox[dst as usize] = out;
        }
        self.dirty.clear();
        self.outstanding = 0;
        {
            let mut inbox = self.group.inner.ranks[self.rank as usize].inbox.lock();
            if !inbox.is_empty() {
                self.scratch.append(&mut inbox);
            }
        }
        if reorder {
            // Deliver last poll's held-back arrivals among this poll's, and hold back about a
            // quarter of the new ones (never twice, so everything arrives by the next poll).
            let held = std::mem::take(&mut self.deferred);
            let mut now = held;
            for a in self.scratch.drain(..) {
                if self.rng.below(4) == 0 {
                    self.deferred.push(a);
                } else {
                    now.push(a);
                }
            }
            shuffle(&mut self.rng, &mut now);
            events.extend(now.iter().map(|&(imm, len)| TransportEvent::Arrival { imm, len }));
        } else {
            events.extend(
                self.scratch.drain(..).map(|(imm, len)| TransportEvent::Arrival { imm, len }),
            );
        }
        events.extend(
            self.send_done.drain(..).map(|(ring, dst, count)| TransportEvent::SendDone {
                ring,
                dst,
                count,
            }),
        );
        Ok(())
    }
}
