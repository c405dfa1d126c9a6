//! Rank discovery and all-gather/barrier of connection info (endpoint addresses, memory keys).
//!
//! Three implementations sit behind one object-safe trait, [`Bootstrap`]:
//! - [`TcpStore`]: a small store served by rank 0 over TCP, configured from the env vars torchrun and
//!   Kubeflow's PyTorchJob set (`MASTER_ADDR`, `MASTER_PORT`, `RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//!   `LOCAL_WORLD_SIZE`). Every connection proves it knows the job's secret ([`JobSecret`]; the
//!   threat model is in `auth.rs`), so strangers are refused without disturbing the job, and a
//!   dead peer is pushed to every rank at once ([`Bootstrap::dead_ranks`]) and becomes an error that
//!   names it. Several stores in one process share rank 0's port (one server, one namespace each).
//! - [`InProcGroup`]: threads as ranks, for tests.
//! - [`CallbackBootstrap`]: the caller supplies an equal-length all-gather (C ABI, torch process
//!   groups); rank 0 serves a small liveness channel whose address travels in the first
//!   all-gather, so a dead peer is named as fast as with the TCP store.
//!
//! [`LocalJob`] starts N ranks of an executable as local processes with the same env vars torchrun
//! would set; `ep-bench` and the multi-process tests use it.
//!
//! NOTES: every wait here has a deadline, and every deadline error names the ranks that did not
//! deliver: a bootstrap that hangs on 256 ranks without saying who is missing is the failure mode
//! this module exists to prevent.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

mod auth;
mod callback;
mod inproc;
mod launch;
mod liveness;
mod reports;
mod server;
mod tcp;
mod wire;

pub use auth::{JobSecret, SecretSource, MIN_SECRET_LEN};
pub use callback::{AllGatherFn, CallbackBootstrap};
pub use inproc::{InProcBootstrap, InProcGroup};
pub use launch::{LocalJob, RankOutcome};
pub use tcp::{TcpStore, TcpStoreOptions};

/// The largest blob one rank may contribute to one all-gather (and the largest frame the TCP store
/// accepts). Bootstrap carries addresses and keys, not data: anything near this is a bug, and the
/// cap keeps a corrupt length from the network from becoming a huge allocation.
pub const MAX_BLOB: usize = 256 << 20;

/// The largest world any bootstrap accepts: per-rank state is allocated from the world size, which
/// comes from env vars, so an absurd value must be an error, not an allocation.
pub const MAX_WORLD: usize = 1 << 20;

/// Rank discovery plus a collective all-gather, the only collective EP set-up needs.
///
/// Object-safe so that the rest of the crate holds a `Box<dyn Bootstrap>` / `Arc<dyn Bootstrap>` and
/// does not care whether ranks found each other over TCP, in-process or through a caller's callback.
pub trait Bootstrap: Send + Sync {
    /// This process's rank, `0..world_size()`.
    fn rank(&self) -> usize;
    /// Number of ranks in the job.
    fn world_size(&self) -> usize;
    /// Rank among the ranks on this node, `0..local_world_size()`.
    fn local_rank(&self) -> usize;
    /// Number of ranks on this node.
    fn local_world_size(&self) -> usize;
    /// Every rank calls this in the same order; returns one blob per rank, indexed by rank.
    /// Blobs may differ in length. Bounded by the bootstrap's timeout.
    fn all_gather(&self, data: &[u8]) -> Result<Vec<Vec<u8>>, BootstrapError>;
    /// Returns once every rank has called `barrier` (or fails naming the ranks that did not).
    fn barrier(&self) -> Result<(), BootstrapError> {
        self.all_gather(&[]).map(|_| ())
    }
    /// Ranks this bootstrap has seen leave while it was open, in the order it heard of them:
    /// their connection closed (killed, crashed, or closed their bootstrap early). The first is
    /// the one to blame: a rank that fails because another died may leave right after it. A rank never leaves this list, and any
    /// collective that needs it fails naming it. Default: none known (a bootstrap that cannot watch
    /// its peers).
    fn dead_ranks(&self) -> Vec<usize> {
        Vec::new()
    }
    /// Whether `rank` is in [`dead_ranks`](Self::dead_ranks). For the TCP store and in-process
    /// groups this is one atomic load, so a data path waiting on a peer can ask it while polling.
    fn is_dead(&self, rank: usize) -> bool {
        self.dead_ranks().contains(&rank)
    }
    /// [`dead_ranks`](Self::dead_ranks) with how each was learnt: `reported_by: None` it left
    /// (its connection closed), `Some(r)` rank `r` reported it unresponsive before leaving (see
    /// [`report_unresponsive`](Self::report_unresponsive)).
    fn dead_peers(&self) -> Vec<DeadPeer> {
        self.dead_ranks().into_iter().map(|rank| DeadPeer { rank, reported_by: None }).collect()
    }
    /// This rank is failing because `peers` stopped responding (a bounded wait on them ran
    /// out): tell every other rank, so that their waits end naming the stalled rank rather than
    /// this one when it leaves. Best effort and bounded (1.5 s at most: the relay may hold the answer until the reports of
    /// the ranks named went out); a bootstrap that
    /// cannot tell its peers ignores it.
    fn report_unresponsive(&self, _peers: &[usize]) {}
}

/// A rank the bootstrap knows gone, and how it learnt it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeadPeer {
    pub rank: usize,
    /// `None`: its connection closed. `Some(r)`: rank `r` timed out waiting for it and said so.
    pub reported_by: Option<usize>,
}

/// Ranks known gone, written by whoever observes a death and read lock-free by the data path.
///
/// NOTES: each rank keeps the order in which it was reported. A death often brings a second
/// one: rank 0, failing because rank r died, exits, and a rank that heard of both must name r,
/// not the lower rank 0.
pub(crate) struct DeadSet {
    /// 0: alive; n: the n-th death reported.
    order: Box<[AtomicU64]>,
    /// 0: the rank left; r + 1: rank r reported it unresponsive (written before `order`).
    by: Box<[AtomicU64]>,
    reported: AtomicU64,
}

impl DeadSet {
    pub(crate) fn new(world: usize) -> Self {
        DeadSet {
            order: (0..world).map(|_| AtomicU64::new(0)).collect(),
            by: (0..world).map(|_| AtomicU64::new(0)).collect(),
            reported: 0.into(),
        }
    }

    /// Records `rank` as reported unresponsive by rank `by` (ranks out of range, or a rank
    /// naming itself, are ignored); a rank already recorded keeps its place and its cause.
    pub(crate) fn mark_unresponsive(&self, rank: usize, by: usize) {
        if rank == by || by >= self.order.len() {
            return;
        }
        let (Some(f), Some(b)) = (self.order.get(rank), self.by.get(rank)) else { return };
        if f.load(Ordering::Acquire) != 0 {
            return;
        }
        // Only while still unrecorded: a cause never changes once a reader may have seen it.
        let _ = b.compare_exchange(0, by as u64 + 1, Ordering::AcqRel, Ordering::Acquire);
        self.mark(rank);
    }

    /// [`Self::list`] with each rank's cause.
    pub(crate) fn peers(&self) -> Vec<DeadPeer> {
        self.list()
            .into_iter()
            .map(|rank| DeadPeer {
                rank,
                reported_by: match self.by[rank].load(Ordering::Acquire) {
                    0 => None,
                    n => Some(n as usize - 1),
                },
            })
            .collect()
    }

    /// Records `rank` (out-of-range ranks from the wire are ignored: they name no peer); a rank
    /// already recorded keeps its place.
    pub(crate) fn mark(&self, rank: usize) {
        if let Some(f) = self.order.get(rank) {
            if f.load(Ordering::Acquire) != 0 {
                return;
            }
            let n = self.reported.fetch_add(1, Ordering::AcqRel) + 1;
            let _ = f.compare_exchange(0, n, Ordering::AcqRel, Ordering::Acquire);
        }
    }

    pub(crate) fn is_dead(&self, rank: usize) -> bool {
        self.order.get(rank).is_some_and(|f| f.load(Ordering::Acquire) != 0)
    }

    /// The ranks recorded, first reported first.
    pub(crate) fn list(&self) -> Vec<usize> {
        if self.reported.load(Ordering::Acquire) == 0 {
            return Vec::new();
        }
        let mut dead: Vec<(u64, usize)> = (0..self.order.len())
            .filter_map(|r| match self.order[r].load(Ordering::Acquire) {
                0 => None,
                n => Some((n, r)),
            })
            .collect();
        dead.sort_unstable();
        dead.into_iter().map(|(_, r)| r).collect()
    }
}

/// Errors from bootstrapping. Each names what was wrong and, where a peer is at fault, which rank,
/// so the message alone tells an operator which process's log to open.
#[derive(Debug, thiserror::Error)]
pub enum BootstrapError {
    /// A launcher env var is missing or malformed.
    #[error("environment variable {var}: {msg}")]
    Env { var: &'static str, msg: String },
    /// The store at `addr` knows this rank's secret but serves another job id (two jobs given the
    /// same `FEP_JOB_SECRET`, or ranks given different job ids).
    #[error(
        "job id mismatch: this rank has '{ours}', the store at {addr} belongs to '{theirs}' \
         (another job with the same FEP_JOB_SECRET is using this MASTER_ADDR:MASTER_PORT, or \
         FEP_JOB_ID/TORCHELASTIC_RUN_ID differ between ranks)"
    )]
    JobIdMismatch { ours: String, theirs: String, addr: String },
    /// The handshake's proof of the job secret failed, in either direction.
    #[error("authentication with the bootstrap store at {addr} failed: {detail}")]
    Auth { addr: String, detail: String },
    /// `rank` was launched with `WORLD_SIZE=ours`, the store (rank 0) with `theirs`.
    #[error(
        "world size mismatch: rank {rank} has WORLD_SIZE={ours}, the store (rank 0) has \
         WORLD_SIZE={theirs}; launch every rank with the same WORLD_SIZE"
    )]
    WorldSizeMismatch { ours: usize, theirs: usize, rank: usize },
    /// A rank that cannot take part: out of range, or claimed twice.
    #[error("bad rank {rank} (world size {world_size}): {why}")]
    BadRank { rank: usize, world_size: usize, why: String },
    /// Options that cannot describe a job (zero ranks, local rank out of range, ...).
    #[error("invalid bootstrap configuration: {0}")]
    Config(String),
    /// A collective did not complete in time; `missing` are the ranks that never contributed.
    /// `note` (possibly empty) says what the store refused from processes claiming those ranks.
    #[error(
        "{op} round {round} timed out after {waited:?}: ranks {missing:?} never arrived (not started, \
         hung, or still busy with earlier work){note}; check those ranks' logs or raise the timeout"
    )]
    Timeout { op: &'static str, round: u64, missing: Vec<usize>, waited: Duration, note: String },
    /// A rank's connection closed while the job still needed it.
    #[error(
        "rank {rank} is gone ({op}): its bootstrap connection closed (process killed, crashed or \
         exited early); see rank {rank}'s log"
    )]
    PeerGone { rank: usize, op: &'static str },
    /// The store (served by rank 0) closed the connection or stopped answering.
    #[error(
        "lost the bootstrap store at {addr} (served by rank 0) during {op}: {detail}; rank 0 \
         probably crashed, was killed or exited early (see rank 0's log)"
    )]
    StoreLost { addr: String, op: &'static str, detail: String },
    /// A socket call failed.
    #[error("{call} {addr}: {source}")]
    Io {
        call: &'static str,
        addr: String,
        #[source]
        source: io::Error,
    },
    /// The other side sent something this protocol does not allow.
    #[error("bootstrap protocol error: {0}")]
    Protocol(String),
    /// The caller-supplied all-gather of a [`CallbackBootstrap`] failed.
    #[error("bootstrap all-gather callback failed: {0}")]
    Callback(String),
}

/// The longest any single wait is allowed to be, whatever timeout a caller passes: keeps
/// `Instant + timeout` from overflowing (`Duration::MAX` is a tempting "forever").
const MAX_WAIT: Duration = Duration::from_secs(7 * 24 * 3600);

/// `base + wait`, clamped to [`MAX_WAIT`] so it cannot overflow.
pub(crate) fn later(base: Instant, wait: Duration) -> Instant {
    base.checked_add(wait.min(MAX_WAIT)).unwrap_or(base)
}

/// Local world size of the node that holds `rank` when ranks are packed `local_world_size` per node
/// in rank order: the last node holds the remainder when `world_size` is not a multiple.
pub(crate) fn node_local_world(rank: usize, world_size: usize, local_world_size: usize) -> usize {
    let node_start = rank - rank % local_world_size;
    local_world_size.min(world_size - node_start)
}

/// Checks that `rank`, `world_size`, `local_rank` and `local_world_size` can describe a job.
pub(crate) fn check_ranks(
    rank: usize,
    world_size: usize,
    local_rank: usize,
    local_world_size: usize,
) -> Result<(), BootstrapError> {
    if world_size == 0 {
        return Err(BootstrapError::Config(
            "world size is 0; a job needs at least one rank".into(),
        ));
    }
    if world_size > MAX_WORLD {
        return Err(BootstrapError::Config(format!(
            "world size {world_size} is above the supported maximum {MAX_WORLD}"
        )));
    }
    if rank >= world_size {
        return Err(BootstrapError::BadRank {
            rank,
            world_size,
            why: format!("ranks are 0..{world_size}"),
        });
    }
    if local_world_size == 0 || local_world_size > world_size {
        return Err(BootstrapError::Config(format!(
            "local world size {local_world_size} is not in 1..={world_size} (the world size)"
        )));
    }
    if local_rank >= local_world_size {
        return Err(BootstrapError::Config(format!(
            "local rank {local_rank} is not below the local world size {local_world_size}"
        )));
    }
    Ok(())
}

/// The store protocol's decoders as the decoder fuzz harness (`tests/fuzz_decoders.rs`) calls
/// them: bytes as a rank or the store would receive them. Not an API.
#[doc(hidden)]
pub mod fuzz {
    use super::wire::{self, Fields};
    use super::DeadSet;

    /// Splits `bytes` into frames of at most `max_body` bytes; the number of whole frames.
    pub fn frames(bytes: &[u8], max_body: usize) -> Result<usize, String> {
        let mut buf = bytes.to_vec();
        wire::split_frames(&mut buf, max_body).map(|f| f.len())
    }

    /// What the store does with a rank's payload of `kind`: hello, proof or contribute.
    pub fn to_store(kind: u8, payload: &[u8]) -> Result<(), String> {
        match kind {
            wire::K_HELLO => wire::parse_hello(payload).map(drop).map_err(|e| format!("{e:?}")),
            wire::K_PROOF => wire::parse_proof(payload).map(drop),
            wire::K_CONTRIBUTE => wire::parse_contribute(payload).map(drop),
            wire::K_UNRESPONSIVE => wire::parse_unresponsive(payload, super::MAX_WORLD).map(drop),
            k => Err(format!("kind {k} is not sent to the store")),
        }
    }

    /// What a rank of a `world`-rank job does with the store's FAILED, GATHERED or PEER_GONE
    /// payload (the header fields; blobs follow as frames of their own).
    pub fn to_rank(kind: u8, payload: &[u8], world: usize) -> Result<(), String> {
        let mut f = Fields::new(payload, "fuzz");
        match kind {
            wire::K_FAILED => {
                let e =
                    super::tcp::failure("all_gather", std::time::Duration::ZERO, world, &mut f)?;
                // Whatever it names must be a rank of the job.
                match e {
                    super::BootstrapError::Timeout { missing, .. } if missing.len() > world => {
                        Err("more missing ranks than the world".into())
                    }
                    _ => Ok(()),
                }
            }
            wire::K_GATHERED => {
                let (_round, w) = (f.u64()?, f.usize()?);
                if w == world {
                    Ok(())
                } else {
                    Err(format!("{w} ranks"))
                }
            }
            wire::K_PEER_GONE => f.usize().map(drop),
            wire::K_PEER_UNRESPONSIVE => {
                let set = DeadSet::new(world);
                set.mark_unresponsive(f.usize()?, f.usize()?);
                Ok(())
            }
            k => Err(format!("kind {k} is not sent to a rank")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_local_world_handles_remainder() {
        assert_eq!(node_local_world(0, 6, 4), 4);
        assert_eq!(node_local_world(3, 6, 4), 4);
        assert_eq!(node_local_world(4, 6, 4), 2);
        assert_eq!(node_local_world(5, 6, 4), 2);
        assert_eq!(node_local_world(7, 8, 8), 8);
    }

    #[test]
    fn dead_set_lists_ranks_in_the_order_they_were_reported() {
        let d = DeadSet::new(4);
        assert!(d.list().is_empty());
        d.mark(3);
        d.mark(0);
        d.mark(3); // keeps its place
        d.mark(9); // out of range: names no peer
        assert_eq!(d.list(), vec![3, 0]);
        assert!(d.is_dead(0) && d.is_dead(3) && !d.is_dead(1) && !d.is_dead(9));
    }

    #[test]
    fn check_ranks_names_the_problem() {
        assert!(check_ranks(0, 1, 0, 1).is_ok());
        assert!(matches!(check_ranks(0, 0, 0, 1), Err(BootstrapError::Config(_))));
        assert!(matches!(check_ranks(0, MAX_WORLD + 1, 0, 1), Err(BootstrapError::Config(_))));
        assert!(matches!(
            check_ranks(4, 4, 0, 4),
            Err(BootstrapError::BadRank { rank: 4, world_size: 4, .. })
        ));
        assert!(matches!(check_ranks(1, 4, 0, 5), Err(BootstrapError::Config(_))));
        assert!(matches!(check_ranks(1, 4, 2, 2), Err(BootstrapError::Config(_))));
    }

    #[test]
    fn trait_is_object_safe() {
        fn takes(_: &dyn Bootstrap) {}
        let group = InProcGroup::new(1, 1, Duration::from_secs(1)).expect("group");
        takes(&group[0]);
    }
}
