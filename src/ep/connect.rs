//! Connecting one rank's libfabric endpoint to every peer through the bootstrap: one
//! all-gather of (caller header, endpoint name, receive-region descriptor), every length
//! checked, the addresses inserted into the AV. Shared by the normal and low-latency lanes and
//! the fabric benchmarks.

use crate::bootstrap::Bootstrap;
use crate::error::{Error, Result};
use crate::fabric::{FiAddr, RemoteRegion, Stack};
use crate::proxy::FabricPeer;

/// What every peer published, indexed by rank.
pub struct FabricPeers {
    /// The caller's per-rank header (e.g. a config hash).
    pub headers: Vec<Vec<u8>>,
    pub addrs: Vec<FiAddr>,
    pub regions: Vec<RemoteRegion>,
}

impl FabricPeers {
    /// The peers as the proxy's `FabricTransport` takes them.
    pub fn into_proxy_peers(self) -> Vec<Option<FabricPeer>> {
        self.addrs
            .into_iter()
            .zip(self.regions)
            .map(|(addr, recv)| Some(FabricPeer { addr, recv }))
            .collect()
    }
}

fn malformed(rank: usize, peer: usize, len: usize, what: &str) -> Error {
    Error::Protocol {
        rank,
        peer,
        phase: "connect",
        msg: format!("malformed connection blob of {len} bytes: {what}"),
    }
}

/// All-gathers `header`, this endpoint's name and `recv` (the region peers write into), checks
/// that every peer's region holds at least `min_region` bytes, and fills the AV.
pub fn exchange_fabric(
    boot: &dyn Bootstrap,
    stack: &Stack,
    recv: &RemoteRegion,
    header: &[u8],
    min_region: u64,
) -> Result<FabricPeers> {
    let rank = boot.rank();
    let name = stack.ep.name()?;
    let mut blob = Vec::with_capacity(8 + header.len() + name.len() + 64);
    blob.extend_from_slice(&(header.len() as u32).to_le_bytes());
    blob.extend_from_slice(header);
    blob.extend_from_slice(&(name.len() as u32).to_le_bytes());
    blob.extend_from_slice(&name);
    blob.extend_from_slice(&recv.to_bytes());
    let all = boot.all_gather(&blob)?;
    let n = all.len();
    let (mut headers, mut names, mut regions) =
        (Vec::with_capacity(n), Vec::with_capacity(n), Vec::with_capacity(n));
    for (peer, b) in all.iter().enumerate() {
        let bad = |what: &str| malformed(rank, peer, b.len(), what);
        let field = |at: usize| -> Result<(&[u8], usize)> {
            let len = b.get(at..at + 4).and_then(|s| s.try_into().ok()).map(u32::from_le_bytes);
            let len = len.ok_or_else(|| bad("truncated length"))? as usize;
            let body = b.get(at + 4..at + 4 + len).ok_or_else(|| bad("truncated field"))?;
            Ok((body, at + 4 + len))
        };
        let (h, at) = field(0)?;
        let (nm, at) = field(at)?;
        let region = RemoteRegion::from_bytes(&b[at..]).map_err(|e| bad(&e.to_string()))?;
        if region.len < min_region {
            return Err(bad(&format!(
                "receive region of {} bytes, expected at least {min_region}",
                region.len
            )));
        }
        headers.push(h.to_vec());
        names.push(nm.to_vec());
        regions.push(region);
    }
    Ok(FabricPeers { headers, addrs: stack.connect(&names)?, regions })
}
