//! The libfabric transport: RMA writes with immediate data from one registered send region into
//! each peer's registered receive region, over one RDM endpoint and its CQ.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::fabric::{
    BurstLimit, Completion, Endpoint, FabricError, FiAddr, MemoryRegion, RemoteRegion,
};

use super::transport::{Transport, TransportEvent, WriteOp};
use super::ProxyError;

/// Where a peer rank is and what it lets us write into.
#[derive(Clone, Debug)]
pub struct FabricPeer {
    /// The peer's address in the endpoint's AV.
    pub addr: FiAddr,
    /// The peer's receive region.
    pub recv: RemoteRegion,
}

const CQ_BATCH: usize = 64;
const CQ_ROUNDS: usize = 16;

/// The most writes one transport keeps in flight (posted, local completion not read): past it a
/// post is back-pressured like the provider's EAGAIN. Far above what a provider accepts.
const MAX_OPS_IN_FLIGHT: usize = 1 << 20;

/// One write in flight: what its completion credits and (for a [`BurstLimit`]) what it costs.
#[derive(Clone, Copy, Debug)]
struct Op {
    dst: u32,
    ring: u32,
    packets: u64,
}

/// The writes in flight, by op context: context `i + 1` is `slots[i]` (0 is never used:
/// remote-write completions carry 0). A completion, or a completion error, finds its write's
/// destination and ring here.
#[derive(Debug, Default)]
struct InFlight {
    slots: Vec<Option<Op>>,
    free: Vec<usize>,
    count: u64,
    packets: u64,
}

impl InFlight {
    fn insert(&mut self, op: Op) -> Option<u64> {
        let i = match self.free.pop() {
            Some(i) => i,
            None if self.slots.len() < MAX_OPS_IN_FLIGHT => {
                self.slots.push(None);
                self.slots.len() - 1
            }
            None => return None,
        };
        self.slots[i] = Some(op);
        self.count += 1;
        self.packets += op.packets;
        Some(i as u64 + 1)
    }

    /// Returns the slot of `context` to the free list (the post that took it failed).
    fn cancel(&mut self, context: u64) {
        let _ = self.take(context);
    }

    fn take(&mut self, context: u64) -> Option<Op> {
        let i = usize::try_from(context.checked_sub(1)?).ok()?;
        let op = self.slots.get_mut(i)?.take()?;
        self.free.push(i);
        self.count -= 1;
        self.packets -= op.packets;
        Some(op)
    }
}

/// One worker's endpoint. The endpoint's CQ must be used by this transport alone while it runs
/// (the proxy reads every completion on it).
pub struct FabricTransport {
    rank: u32,
    // NOTES: field order is drop order: the endpoint reference goes before the send region, and
    // Drop below leaks the region rather than unregister it under writes still in flight.
    ep: Arc<Endpoint>,
    send: Arc<MemoryRegion>,
    peers: Vec<Option<FabricPeer>>,
    cq_buf: Vec<Completion>,
    in_flight: InFlight,
    /// The provider's bound on packets in flight, if it has one ([`BurstLimit`]).
    burst: Option<BurstLimit>,
    drop_timeout: Duration,
}

impl std::fmt::Debug for FabricTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FabricTransport")
            .field("rank", &self.rank)
            .field("peers", &self.peers.len())
            .field("in_flight", &self.in_flight.count)
            .field("burst", &self.burst)
            .finish()
    }
}

impl FabricTransport {
    /// `peers[r]` is rank `r` (`None`: never written to, e.g. a rank reached another way).
    /// `send` must be registered on `ep`'s domain (and bound to `ep` where the provider asks).
    pub fn new(
        rank: u32,
        ep: Arc<Endpoint>,
        send: Arc<MemoryRegion>,
        peers: Vec<Option<FabricPeer>>,
    ) -> Result<Self, ProxyError> {
        if ep.imm_limit() < u64::from(u32::MAX) {
            return Err(ProxyError::InvalidConfig {
                what: "endpoint",
                msg: format!("immediate data limit {:#x} is under 32 bits", ep.imm_limit()),
            });
        }
        let burst = ep.domain().info().burst_limit().map_err(|e| ProxyError::InvalidConfig {
            what: "FEP_RXD_MAX_PACKETS",
            msg: e.to_string(),
        })?;
        if let Some(b) = &burst {
            crate::fep_debug!(
                target: "fabric_ep::fabric",
                "rank {rank}: provider {} takes at most ~{} packets in flight per endpoint ({} \
                 bytes each at least)",
                ep.domain().info().provider(),
                b.packets,
                b.packet_payload
            );
        }
        Ok(FabricTransport {
            rank,
            ep,
            send,
            peers,
            cq_buf: vec![Completion { context: 0, flags: 0, len: 0, data: 0 }; CQ_BATCH],
            in_flight: InFlight::default(),
            burst,
            drop_timeout: Duration::from_secs(2),
        })
    }

    /// Writes posted whose local completion has not been read yet.
    pub fn in_flight(&self) -> u64 {
        self.in_flight.count
    }

    fn fabric_err(&self, peer: Option<u32>, source: FabricError) -> ProxyError {
        ProxyError::Fabric { rank: self.rank, peer, source }
    }
}

impl Transport for FabricTransport {
    #[inline]
    fn post_write(&mut self, op: &WriteOp) -> Result<bool, ProxyError> {
        let Some(Some(peer)) = self.peers.get(op.dst_rank as usize) else {
            return Err(ProxyError::BadRank {
                rank: self.rank,
                ring: op.ring,
                dst_rank: op.dst_rank,
                num_ranks: self.peers.len() as u32,
            });
        };
        let packets = self.burst.map_or(1, |b| b.packets_of(u64::from(op.length)));
        if let Some(b) = &self.burst {
            // One write always goes when nothing is in flight, however large: the provider's
            // own window splits it.
            if self.in_flight.count > 0 && self.in_flight.packets + packets > b.packets {
                return Ok(false);
            }
        }
        let Some(ctx) = self.in_flight.insert(Op { dst: op.dst_rank, ring: op.ring, packets })
        else {
            return Ok(false);
        };
        let local_offset = usize::try_from(op.local_offset).unwrap_or(usize::MAX);
        // SAFETY: `send` stays registered while this transport lives, and Drop keeps it
        // registered while writes are in flight; the peer's region is the peer's to keep (a
        // peer that unregisters early turns into a completion error here, not memory
        // unsafety). Send bytes stay unchanged until `sends_completed` covers them: that is
        // the producer's protocol.
        let posted = unsafe {
            self.ep.try_write(
                &self.send,
                local_offset,
                op.length as usize,
                peer.addr,
                &peer.recv,
                op.remote_offset,
                Some(u64::from(op.imm)),
                ctx,
            )
        };
        match posted {
            Ok(true) => Ok(true),
            Ok(false) => {
                self.in_flight.cancel(ctx);
                Ok(false)
            }
            Err(e) => {
                self.in_flight.cancel(ctx);
                Err(self.fabric_err(Some(op.dst_rank), e))
            }
        }
    }

    fn poll(&mut self, events: &mut Vec<TransportEvent>) -> Result<(), ProxyError> {
        // At most CQ_ROUNDS full batches per poll, so a flood of arrivals cannot starve the rings.
        for _ in 0..CQ_ROUNDS {
            let n = match self.ep.cq().read(&mut self.cq_buf) {
                Ok(n) => n,
                Err(e) => {
                    // The failed write's destination, from its op context; a target-side
                    // error (a peer's write landing here) carries no context and no source
                    // address, so it names no peer.
                    let peer = match &e {
                        FabricError::Completion { op_context, .. } if !e.is_target_side() => {
                            self.in_flight.take(*op_context).map(|op| op.dst)
                        }
                        _ => None,
                    };
                    return Err(self.fabric_err(peer, e));
                }
            };
            for c in &self.cq_buf[..n] {
                if c.has_data() {
                    events.push(TransportEvent::Arrival { imm: c.data as u32, len: c.len as u32 });
                } else if c.is_local_tx() && c.context != 0 {
                    let Some(Op { dst, ring, .. }) = self.in_flight.take(c.context) else {
                        return Err(ProxyError::Transport {
                            rank: self.rank,
                            msg: format!(
                                "a local completion names op context {:#x}, which no write in \
                                 flight has",
                                c.context
                            ),
                        });
                    };
                    match events.last_mut() {
                        Some(TransportEvent::SendDone { ring: r, dst: d, count })
                            if *r == ring && *d == dst =>
                        {
                            *count += 1
                        }
                        _ => events.push(TransportEvent::SendDone { ring, dst, count: 1 }),
                    }
                }
            }
            if n < self.cq_buf.len() {
                break;
            }
        }
        Ok(())
    }

    fn abandon_in_flight(&mut self) {
        self.drop_timeout = Duration::ZERO;
    }
}

impl Drop for FabricTransport {
    fn drop(&mut self) {
        // The worker drains before it stops; this covers a transport dropped some other way.
        let start = Instant::now();
        let mut events = Vec::new();
        while self.in_flight.count > 0 && start.elapsed() < self.drop_timeout {
            events.clear();
            if self.poll(&mut events).is_err() {
                break;
            }
        }
        if self.in_flight.count > 0 {
            // NOTES: unregistering memory a provider may still read is undefined behaviour on
            // its side; keeping the registration (a bounded leak) is the safe failure.
            std::mem::forget(self.send.clone());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_flight_slots_are_reused_and_account_packets() {
        let mut f = InFlight::default();
        let a = f.insert(Op { dst: 3, ring: 1, packets: 5 }).unwrap();
        let b = f.insert(Op { dst: 4, ring: 0, packets: 2 }).unwrap();
        assert!(a != 0 && b != 0 && a != b, "contexts are nonzero and distinct");
        assert_eq!((f.count, f.packets), (2, 7));
        let op = f.take(a).unwrap();
        assert_eq!((op.dst, op.ring), (3, 1));
        assert!(f.take(a).is_none(), "a context completes once");
        assert!(f.take(0).is_none() && f.take(99).is_none(), "unknown contexts name nothing");
        assert_eq!((f.count, f.packets), (1, 2));
        let c = f.insert(Op { dst: 5, ring: 2, packets: 1 }).unwrap();
        assert_eq!(c, a, "a freed slot is reused");
        f.cancel(b);
        assert_eq!((f.count, f.packets), (1, 1));
    }

    #[test]
    fn a_burst_limit_counts_a_header_packet_and_segments() {
        let b = BurstLimit { packets: 256, packet_payload: 1000 };
        assert_eq!(b.packets_of(0), 1);
        assert_eq!(b.packets_of(999), 1);
        assert_eq!(b.packets_of(1000), 2);
        assert_eq!(b.packets_of(40_000), 41);
    }
}
