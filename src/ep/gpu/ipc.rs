//! How this rank's kernels reach each peer's comm buffers (the intranode peer path of
//! [`GpuBuffer::connect`](super::GpuBuffer)).
//!
//! Every rank first sends its identity: a random per-process token and its pid, the machine's
//! boot id, its CUDA context and its GPU's UUID. From that, per peer:
//! - same process, same context (ranks as threads of one GPU): the peer's device pointers as
//!   they are ([`PeerPath::Direct`]);
//! - same process, another GPU: the same pointers once peer access is enabled (it must be
//!   possible: `cuDeviceCanAccessPeer`) ([`PeerPath::DirectPeer`]);
//! - another process of this machine, same GPU or one this GPU can access: CUDA IPC
//!   ([`PeerPath::Ipc`]): each such rank exports every allocation its peers write or read
//!   (`cuIpcGetMemHandle` of the allocation's base, plus the pointer's offset in it) after the
//!   buffers exist, and every peer opens them (`cuIpcOpenMemHandle`, lazy peer access) and owns
//!   the mappings ([`PeerMaps`]) until [`PeerMaps::close`] at teardown;
//! - anything else (another machine, a GPU this one cannot access): an [`Error::Protocol`]
//!   naming the peer, at connect.
//!
//! NOTES (co-residency across processes): receive kernels spin on other ranks' sends, so every
//! rank's kernel must be resident at once. Processes sharing one GPU only run kernels at the
//! same time under MPS (`nvidia-cuda-mps-control -d`); without it the GPU time-slices between
//! their contexts, each wait on another process lasts until a context switch (milliseconds per
//! step), and a wait longer than the timeout fails ([`Error::Timeout`] naming a peer, not a
//! hang). [`Peers::ranks_on_this_gpu`] counts the ranks that share this GPU for the SM budget.

use std::sync::OnceLock;

use crate::bootstrap::Bootstrap;
use crate::cuda::{ipc_export, Device, IpcHandle, IpcMapping};
use crate::util::SplitMix64;
use crate::{Error, Result};

/// How this rank reaches a peer's device memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeerPath {
    /// This rank itself.
    Local,
    /// Same process and context: its pointers as they are.
    Direct,
    /// Same process, another GPU: its pointers, peer access enabled.
    DirectPeer,
    /// Another process of this machine: CUDA IPC mappings of its allocations.
    Ipc {
        /// The peer uses this GPU too (else one this GPU can access).
        same_gpu: bool,
    },
    /// On another node (`ranks_per_node`): no pointers; the proxy lane reaches it.
    Remote,
}

/// Identity blob: token, pid, host, context, then the GPU UUID.
const ID_BYTES: usize = 4 * 8 + 16;
/// One exported pointer: IPC handle, offset in the allocation, allocation size.
const EXPORT_BYTES: usize = 64 + 8 + 8;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Identity {
    token: u64,
    pid: u64,
    host: u64,
    ctx: u64,
    uuid: [u8; 16],
}

impl Identity {
    fn of(dev: &Device) -> Result<Self> {
        Ok(Identity {
            token: process_token(),
            pid: u64::from(std::process::id()),
            host: host_id(),
            ctx: dev.as_raw() as u64,
            uuid: dev.uuid()?,
        })
    }
    fn to_bytes(self) -> Vec<u8> {
        let mut b = Vec::with_capacity(ID_BYTES);
        for v in [self.token, self.pid, self.host, self.ctx] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        b.extend_from_slice(&self.uuid);
        b
    }
    fn from_bytes(b: &[u8]) -> Option<Self> {
        if b.len() != ID_BYTES {
            return None;
        }
        let u = |i: usize| u64::from_le_bytes(b[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
        Some(Identity {
            token: u(0),
            pid: u(1),
            host: u(2),
            ctx: u(3),
            uuid: b[32..48].try_into().ok()?,
        })
    }
    fn same_process(&self, o: &Identity) -> bool {
        self.host == o.host && self.token == o.token
    }
}

/// A random number fixed for this process: pids repeat across containers and machines, this
/// does not (in practice).
fn process_token() -> u64 {
    static TOKEN: OnceLock<u64> = OnceLock::new();
    *TOKEN.get_or_init(|| {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        let here = &nanos as *const u64 as u64;
        let mut r = SplitMix64(nanos ^ u64::from(std::process::id()).rotate_left(32) ^ here);
        r.next_u64() | 1
    })
}

/// This machine: a hash of the kernel's boot id (shared by every container of the host), else of
/// the host name.
fn host_id() -> u64 {
    let s = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .or_else(|_| std::fs::read_to_string("/etc/hostname"))
        .unwrap_or_default();
    // FNV-1a.
    s.trim()
        .bytes()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
}

fn uuid_str(u: &[u8; 16]) -> String {
    let h: String = u.iter().map(|b| format!("{b:02x}")).collect();
    format!("GPU-{}-{}-{}-{}-{}", &h[..8], &h[8..12], &h[12..16], &h[16..20], &h[20..])
}

/// Every rank's identity and this rank's path to each.
#[derive(Debug)]
pub struct Peers {
    rank: usize,
    ids: Vec<Identity>,
    paths: Vec<PeerPath>,
}

impl Peers {
    /// Sends this rank's identity to every rank (one all-gather) and decides the path to each
    /// peer; enables peer access for same-process peers on another GPU. Collective. A peer that
    /// cannot be reached is an [`Error::Protocol`] naming it.
    /// `remote(peer)`: the peer is on another node (the config's `ranks_per_node`), reached
    /// through a proxy lane whatever machine it runs on.
    pub fn exchange(
        boot: &dyn Bootstrap,
        dev: &Device,
        rank: usize,
        remote: &dyn Fn(usize) -> bool,
    ) -> Result<Self> {
        let me = Identity::of(dev)?;
        let all = boot.all_gather(&me.to_bytes())?;
        let mut ids = Vec::with_capacity(all.len());
        let mut paths = Vec::with_capacity(all.len());
        for (peer, b) in all.iter().enumerate() {
            let unreachable =
                |msg: String| Error::Protocol { rank, peer, phase: "GPU connect", msg };
            let id = Identity::from_bytes(b).ok_or_else(|| {
                unreachable(format!("malformed GPU identity of {} bytes", b.len()))
            })?;
            let path = if peer == rank {
                PeerPath::Local
            } else if remote(peer) {
                PeerPath::Remote
            } else if id.host != me.host {
                return Err(unreachable(format!(
                    "rank {peer} runs on another machine (process {}) but in this rank's node \
                     (ranks_per_node): same-node peers are reached through device pointers or \
                     CUDA IPC, so they must share a machine",
                    id.pid
                )));
            } else if id.same_process(&me) && id.ctx == me.ctx {
                PeerPath::Direct
            } else if id.same_process(&me) {
                let ord = Device::ordinal_of_uuid(&id.uuid)?.ok_or_else(|| {
                    unreachable(format!("its GPU {} is not visible here", uuid_str(&id.uuid)))
                })?;
                let other = Device::new(ord)?;
                if !dev.can_access_peer(&other)? {
                    return Err(unreachable(format!(
                        "rank {peer} is a thread of this process on GPU {} ({}), which GPU {} \
                         cannot access (cuDeviceCanAccessPeer)",
                        ord,
                        uuid_str(&id.uuid),
                        dev.ordinal()
                    )));
                }
                dev.enable_peer_access(&other)?;
                PeerPath::DirectPeer
            } else if id.uuid == me.uuid {
                PeerPath::Ipc { same_gpu: true }
            } else {
                // NOTES: a GPU hidden from this process (CUDA_VISIBLE_DEVICES) cannot be checked
                // here; cuIpcOpenMemHandle then decides (lazy peer access).
                if dev.can_access_uuid(&id.uuid)? == Some(false) {
                    return Err(unreachable(format!(
                        "rank {peer} (process {}) uses GPU {}, which this rank's GPU {} cannot \
                         access (cuDeviceCanAccessPeer)",
                        id.pid,
                        uuid_str(&id.uuid),
                        uuid_str(&me.uuid)
                    )));
                }
                PeerPath::Ipc { same_gpu: false }
            };
            ids.push(id);
            paths.push(path);
        }
        Ok(Peers { rank, ids, paths })
    }

    /// The path to each rank (this rank's entry is [`PeerPath::Local`]).
    pub fn paths(&self) -> &[PeerPath] {
        &self.paths
    }

    /// Ranks (this one included) whose kernels run on this rank's GPU: they share its SMs.
    pub fn ranks_on_this_gpu(&self) -> usize {
        let me = &self.ids[self.rank];
        self.ids.iter().filter(|i| i.host == me.host && i.uuid == me.uuid).count()
    }

    /// Whether this rank maps any peer's memory through IPC (then it exports its own).
    pub fn any_ipc(&self) -> bool {
        self.paths.iter().any(|p| matches!(p, PeerPath::Ipc { .. }))
    }

    /// Whether any two ranks of the job are in different processes: the same answer on every
    /// rank (every rank saw every identity), so every rank takes part in the same collectives.
    pub fn world_uses_ipc(&self) -> bool {
        self.ids.iter().any(|i| !i.same_process(&self.ids[0]))
    }

    /// This rank's export section of the connection blob: for each pointer of `ptrs` (0 =
    /// none) the IPC handle of its allocation, its offset in it and the allocation's size; empty
    /// when no peer maps this rank through IPC.
    pub fn export(&self, dev: &Device, ptrs: &[u64]) -> Result<Vec<u8>> {
        if !self.any_ipc() {
            return Ok(Vec::new());
        }
        let mut b = Vec::with_capacity(ptrs.len() * EXPORT_BYTES);
        for &p in ptrs {
            let (h, off, size) =
                if p == 0 { (IpcHandle([0; 64]), 0, 0) } else { ipc_export(dev, p)? };
            b.extend_from_slice(h.as_bytes());
            b.extend_from_slice(&off.to_le_bytes());
            b.extend_from_slice(&(size as u64).to_le_bytes());
        }
        Ok(b)
    }

    /// Peer `peer`'s pointers `ptrs` (in its address space) as this rank's kernels address
    /// them: unchanged for this rank and same-process peers; for an IPC peer, its allocations
    /// (from `section`, its [`Self::export`]) opened here, the mappings kept in `maps`.
    pub fn resolve(
        &self,
        dev: &Device,
        peer: usize,
        ptrs: &[u64],
        section: &[u8],
        maps: &mut PeerMaps,
    ) -> Result<Vec<u64>> {
        if self.paths[peer] == PeerPath::Remote {
            return Ok(vec![0; ptrs.len()]);
        }
        if !matches!(self.paths[peer], PeerPath::Ipc { .. }) {
            return Ok(ptrs.to_vec());
        }
        let rank = self.rank;
        let bad = |msg: String| Error::Protocol { rank, peer, phase: "GPU connect", msg };
        if section.len() != ptrs.len() * EXPORT_BYTES {
            return Err(bad(format!(
                "IPC export section of {} bytes, expected {} for {} buffers",
                section.len(),
                ptrs.len() * EXPORT_BYTES,
                ptrs.len()
            )));
        }
        let mut out = Vec::with_capacity(ptrs.len());
        for (i, (&p, e)) in ptrs.iter().zip(section.chunks_exact(EXPORT_BYTES)).enumerate() {
            if p == 0 {
                out.push(0);
                continue;
            }
            let h = IpcHandle::from_bytes(&e[..64])?;
            let off = u64::from_le_bytes(e[64..72].try_into().expect("8 bytes"));
            let size = u64::from_le_bytes(e[72..80].try_into().expect("8 bytes"));
            if size == 0 || off >= size {
                return Err(bad(format!(
                    "buffer {i}: offset {off} in an allocation of {size} bytes"
                )));
            }
            let m = IpcMapping::open(dev, &h, size as usize).map_err(|e| {
                bad(format!(
                    "cuIpcOpenMemHandle of its buffer {i} ({size} bytes, process {}, GPU {}): {e}",
                    self.ids[peer].pid,
                    uuid_str(&self.ids[peer].uuid)
                ))
            })?;
            out.push(m.device_ptr() + off);
            maps.0.push(m);
        }
        Ok(out)
    }
}

/// IPC mappings of peers' allocations, owned by one rank; unmapped by [`Self::close`] or on drop.
#[derive(Default)]
pub struct PeerMaps(Vec<IpcMapping>);

impl PeerMaps {
    /// Unmaps every mapping (no kernel of this rank may still run).
    pub fn close(&mut self) {
        self.0.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identity_round_trip_and_same_process() {
        let a = Identity { token: 7, pid: 1, host: 9, ctx: 0x1000, uuid: [3; 16] };
        assert_eq!(Identity::from_bytes(&a.to_bytes()), Some(a));
        assert_eq!(Identity::from_bytes(&a.to_bytes()[1..]), None);
        let b = Identity { pid: 2, ..a };
        assert!(a.same_process(&b), "the token decides, not the pid");
        assert!(!a.same_process(&Identity { token: 8, ..a }));
        assert!(!a.same_process(&Identity { host: 10, ..a }));
        assert_eq!(process_token(), process_token());
        assert_ne!(process_token(), 0);
        assert_eq!(host_id(), host_id());
        assert_eq!(uuid_str(&[0xab; 16]).len(), 4 + 36);
    }
}
