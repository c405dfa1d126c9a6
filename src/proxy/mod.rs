//! CPU proxy: GPU->CPU command rings in shared (mapped host) memory, and worker threads that turn
//! commands into RMA writes with immediate data and turn completions into counters producers and
//! consumers poll.
//!
//! - [`RingMemory`] / [`RingProducer`]: single-producer/single-consumer rings laid out as
//!   `fep_ring_hdr` + `capacity` x `fep_cmd` (kernels/include/fep_abi.h).
//! - [`CounterMemory`]: per-slot `arrivals`, `sums` and `packed` (both modulo 2^32 in one word,
//!   what the LL kernels poll), per-ring `sends_completed` (u64 each).
//! - [`Transport`]: where writes go. [`LoopbackTransport`] (in-process ranks, CI) and the libfabric
//!   transport implement it.
//! - [`Proxy`]: the worker threads and the bounded host-side waits.

mod abi;
mod fabric;
mod loopback;
mod memory;
mod transport;
mod worker;

use std::sync::Arc;
use std::time::Duration;

use crate::protocol::plan::ImmError;

pub use abi::{FepCmd, FepRingHdr, CMD_BYTES, HEAD_OFFSET, RING_HDR_BYTES, TAIL_OFFSET};
pub use fabric::{FabricPeer, FabricTransport};
pub use loopback::{LoopbackGroup, LoopbackOptions, LoopbackTransport};
pub use memory::{
    pack_counters, packed_add, unpack_counters, Command, CounterLayout, CounterMemory, RingLayout,
    RingMemory, RingProducer, SharedRegion, REGION_ALIGN,
};
pub use transport::{SplitTransport, Throttled, Transport, TransportEvent, WriteOp};
#[cfg(test)]
pub(crate) use worker::worker_name;
pub(crate) use worker::worker_rank;
pub use worker::{ArrivalWait, Lagging, PeerWatch, Proxy, ProxyConfig};

/// "waiting for 3 sends to rank 2, 1 to rank 5 (what)", or "" when nothing is owed.
fn owed_list(owed: &[(u32, u64)], what: &str) -> String {
    if owed.is_empty() {
        return String::new();
    }
    let parts: Vec<String> = owed
        .iter()
        .enumerate()
        .map(|(i, (peer, n))| {
            let s = if *n == 1 { "" } else { "s" };
            if i == 0 {
                format!("{n} send{s} to rank {peer}")
            } else {
                format!("{n} to rank {peer}")
            }
        })
        .collect();
    format!("; waiting for {} ({what})", parts.join(", "))
}

/// "writing to rank 3"; for a completion error naming no peer (the target side of a peer's
/// write: libfabric's error entries carry no source address) "peer unknown (...)"; else what
/// an endpoint-wide failure is.
fn fabric_peer(peer: Option<u32>, source: &crate::fabric::FabricError) -> String {
    match peer {
        Some(p) => format!("writing to rank {p}"),
        None if matches!(source, crate::fabric::FabricError::Completion { .. }) => {
            "with peer unknown (no source address in the completion)".into()
        }
        None => "on the endpoint (not tied to one peer's write)".into(),
    }
}

fn gone_how(by: Option<u32>) -> String {
    match by {
        None => "has left the job (the bootstrap saw its connection close)".into(),
        Some(b) => format!(
            "stopped responding (rank {b} timed out waiting for it and reported it before failing)"
        ),
    }
}

fn waiting_list(w: &[u32]) -> String {
    if w.is_empty() {
        String::new()
    } else {
        format!("; this wait still needed ranks {w:?}")
    }
}

/// Errors from the proxy. Each names the rank, ring, peer, slot or immediate it is about.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    /// A setting failed validation.
    #[error("invalid proxy setting `{what}`: {msg}")]
    InvalidConfig { what: &'static str, msg: String },
    /// Host allocation of a shared region failed.
    #[error("allocating {bytes} bytes of host memory for {what} failed")]
    Alloc { what: &'static str, bytes: usize },
    /// A raw region handed in is null or misaligned.
    #[error("{what}: region at {ptr:#x} must be non-null and {align}-byte aligned")]
    Misaligned { what: &'static str, ptr: usize, align: usize },
    /// A region is smaller than its layout needs.
    #[error("{what}: region of {len} bytes, layout needs {needed}")]
    RegionTooSmall { what: &'static str, len: usize, needed: usize },
    /// An access `[offset, offset + length)` falls outside a region.
    #[error(
        "rank {rank}: {what} [{offset}, +{length}) is outside its {len}-byte region (peer {peer})"
    )]
    OutOfBounds { rank: u32, peer: u32, what: &'static str, offset: u64, length: u64, len: usize },
    /// A ring index past the ring count.
    #[error("ring {ring} does not exist ({num_rings} rings)")]
    RingIndex { ring: u32, num_rings: u32 },
    /// A counter slot index past the slot count (host-side access).
    #[error("slot {slot} does not exist ({num_slots} slots)")]
    SlotIndex { slot: u32, num_slots: u32 },
    /// Somebody already holds the producer or consumer side of this ring.
    #[error("ring {ring}: its {role} is already claimed")]
    RingClaimed { ring: u32, role: &'static str },
    /// A bounded producer wait for ring space ran out; `queued` counts the commands still in the
    /// ring per destination rank (the proxy could not hand them to the transport).
    #[error(
        "ring {ring}: still full after {waited:?} (capacity {capacity}, head {head}, tail \
         {tail}){}", owed_list(.queued, "queued")
    )]
    RingFull {
        ring: u32,
        capacity: u64,
        head: u64,
        tail: u64,
        waited: Duration,
        queued: Vec<(u32, u64)>,
    },
    /// The producer published a head that is behind tail or more than `capacity` ahead of it.
    #[error("rank {rank} ring {ring}: impossible head {head} (tail {tail}, capacity {capacity})")]
    BadHead { rank: u32, ring: u32, head: u64, tail: u64, capacity: u64 },
    /// An entry's `seq` is not the low 32 bits of its ticket: the entry was not (fully) written,
    /// or was overwritten.
    #[error(
        "rank {rank} ring {ring}: entry for ticket {ticket} has seq {found}, expected {expected}"
    )]
    BadSeq { rank: u32, ring: u32, ticket: u64, expected: u32, found: u32 },
    /// An immediate whose slot is past the counter slots: a protocol error, never a wild write.
    #[error(
        "rank {rank}: immediate {imm:#010x} names slot {slot}, but there are {num_slots} slots"
    )]
    BadSlot { rank: u32, imm: u32, slot: u32, num_slots: u32 },
    /// A command names a destination rank that does not exist.
    #[error(
        "rank {rank} ring {ring}: command for rank {dst_rank}, but there are {num_ranks} ranks"
    )]
    BadRank { rank: u32, ring: u32, dst_rank: u32, num_ranks: u32 },
    /// The transport reported completions for a ring this proxy does not have.
    #[error("rank {rank}: completion for ring {ring}, but there are {num_rings} rings")]
    BadCompletion { rank: u32, ring: u32, num_rings: u32 },
    /// The bootstrap saw a rank leave (its connection closed: killed, crashed, or it closed its
    /// bootstrap), or heard from rank `reported_by` that it stopped responding (that rank's
    /// bounded wait on it ran out; a stopped process keeps its connection open): every wait of
    /// the job ends at once naming it.
    /// `waiting`: the ranks the interrupted wait still needed (the rank that left may have
    /// done so because of one of them: a survivor that timed out on a stalled rank leaves too).
    #[error("rank {rank}: rank {peer} {}{}", gone_how(*.reported_by), waiting_list(.waiting))]
    PeerDead { rank: u32, peer: u32, waiting: Vec<u32>, reported_by: Option<u32> },
    /// The transport cannot reach a peer (it left, or its endpoint failed).
    #[error("rank {rank}: peer {peer} is unreachable: {msg}")]
    PeerUnreachable { rank: u32, peer: u32, msg: String },
    /// A libfabric call or completion failed. `peer`: the destination of the failed write (its
    /// op context), `None` where nothing names one (a target-side completion error).
    #[error("rank {rank}: libfabric failure {}: {source}", fabric_peer(*.peer, .source))]
    Fabric { rank: u32, peer: Option<u32>, source: crate::fabric::FabricError },
    /// Any other transport failure.
    #[error("rank {rank}: transport failure: {msg}")]
    Transport { rank: u32, msg: String },
    /// A bounded wait for arrivals ran out; `lagging` names each slot and peer still short.
    #[error("rank {rank}: timed out after {waited:?} waiting for arrivals: {}", worker::lagging_list(.lagging))]
    ArrivalTimeout { rank: u32, waited: Duration, lagging: Vec<Lagging> },
    /// A bounded wait for local send completions ran out. `owed` lists, per destination rank,
    /// the writes posted and not completed, and `queued` the commands not yet posted.
    #[error(
        "rank {rank} ring {ring}: timed out after {waited:?} with {observed}/{expected} sends \
         completed{}{}", owed_list(.owed, "posted, not completed"), owed_list(.queued, "queued")
    )]
    SendTimeout {
        rank: u32,
        ring: u32,
        expected: u64,
        observed: u64,
        waited: Duration,
        owed: Vec<(u32, u64)>,
        queued: Vec<(u32, u64)>,
    },
    /// A worker stopped on an error; `source` is that error.
    #[error("proxy worker {worker} failed: {source}")]
    WorkerFailed { worker: String, source: Arc<ProxyError> },
    /// A wait found the workers stopped (shut down) without an error.
    #[error("rank {rank}: the proxy workers are stopped")]
    WorkerStopped { rank: u32 },
    /// The OS refused to start a worker thread.
    #[error("starting proxy worker {worker}: {source}")]
    Spawn { worker: String, source: std::io::Error },
    /// A worker did not report ready within the start timeout.
    #[error("proxy worker {worker} not ready after {waited:?}")]
    StartTimeout { worker: String, waited: Duration },
    /// A worker thread panicked (a bug: library code does not panic).
    #[error("proxy worker {worker} panicked")]
    WorkerPanicked { worker: String },
}

/// The immediate codec's errors are the proxy's invalid settings: `value_bits` is one, and a
/// command's immediate is built for the split it sets.
impl From<ImmError> for ProxyError {
    fn from(e: ImmError) -> Self {
        ProxyError::InvalidConfig { what: e.what, msg: e.msg }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fabric::FabricError;

    fn completion(op_context: u64, flags: u64) -> FabricError {
        FabricError::Completion {
            err: 265,
            prov_errno: 0,
            text: "Truncation error".into(),
            op_context,
            len: 20432,
            flags,
        }
    }

    #[test]
    fn a_fabric_error_names_its_peer_or_says_why_it_cannot() {
        let remote = crate::fabric::sys::FI_REMOTE_WRITE as u64;
        let e = ProxyError::Fabric { rank: 3, peer: None, source: completion(0, remote) };
        let msg = e.to_string();
        assert!(msg.contains("peer unknown (no source address in the completion)"), "{msg}");
        assert!(msg.contains("target side of a peer's operation"), "{msg}");
        assert!(!msg.contains("None"), "{msg}");
        let e = ProxyError::Fabric { rank: 3, peer: Some(5), source: completion(7, 0) };
        let msg = e.to_string();
        assert!(msg.contains("writing to rank 5"), "{msg}");
        assert!(!msg.contains("target side"), "{msg}");
        let call = FabricError::Timeout { what: "x".into(), waited: Duration::from_secs(1) };
        let e = ProxyError::Fabric { rank: 3, peer: None, source: call };
        assert!(e.to_string().contains("on the endpoint"), "{e}");
    }
}
