//! The libfabric transport: RMA writes with immediate data from one registered send region into
//! each peer's registered receive region, over one RDM endpoint and its CQ.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::fabric::{Completion, Endpoint, FabricError, FiAddr, MemoryRegion, RemoteRegion};

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
    in_flight: u64,
    drop_timeout: Duration,
}

impl std::fmt::Debug for FabricTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FabricTransport")
            .field("rank", &self.rank)
            .field("peers", &self.peers.len())
            .field("in_flight", &self.in_flight)
            .finish()
    }
}

/// The op context carries the destination and the ring, so completions credit the ring and
/// completion errors name the peer. 0 is never used (remote-write completions carry 0).
fn context(dst_rank: u32, ring: u32) -> u64 {
    (u64::from(dst_rank) << 32) | (u64::from(ring) + 1)
}

fn peer_of(context: u64) -> u32 {
    (context >> 32) as u32
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
        Ok(FabricTransport {
            rank,
            ep,
            send,
            peers,
            cq_buf: vec![Completion { context: 0, flags: 0, len: 0, data: 0 }; CQ_BATCH],
            in_flight: 0,
            drop_timeout: Duration::from_secs(2),
        })
    }

    /// Writes posted whose local completion has not been read yet.
    pub fn in_flight(&self) -> u64 {
        self.in_flight
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
                context(op.dst_rank, op.ring),
            )
        }
        .map_err(|e| self.fabric_err(Some(op.dst_rank), e))?;
        if posted {
            self.in_flight += 1;
        }
        Ok(posted)
    }

    fn poll(&mut self, events: &mut Vec<TransportEvent>) -> Result<(), ProxyError> {
        // At most CQ_ROUNDS full batches per poll, so a flood of arrivals cannot starve the rings.
        for _ in 0..CQ_ROUNDS {
            let n = match self.ep.cq().read(&mut self.cq_buf) {
                Ok(n) => n,
                Err(e) => {
                    let peer = match &e {
                        FabricError::Completion { op_context, .. } if *op_context != 0 => {
                            Some(peer_of(*op_context))
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
                    let ring = ((c.context & 0xffff_ffff) - 1) as u32;
                    let dst = peer_of(c.context);
                    self.in_flight = self.in_flight.saturating_sub(1);
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
}

impl Drop for FabricTransport {
    fn drop(&mut self) {
        // The worker drains before it stops; this covers a transport dropped some other way.
        let start = Instant::now();
        let mut events = Vec::new();
        while self.in_flight > 0 && start.elapsed() < self.drop_timeout {
            events.clear();
            if self.poll(&mut events).is_err() {
                break;
            }
        }
        if self.in_flight > 0 {
            // NOTES: unregistering memory a provider may still read is undefined behaviour on
            // its side; keeping the registration (a bounded leak) is the safe failure.
            std::mem::forget(self.send.clone());
        }
    }
}
