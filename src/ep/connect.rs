//! Connecting one rank's libfabric endpoint to every peer through the bootstrap: one
//! all-gather of (caller header, endpoint name, receive-region descriptor), every length
//! checked, the addresses inserted into the AV. Shared by the normal and low-latency lanes and
//! the fabric benchmarks.

use std::sync::Arc;

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
        let p = parse_blob(rank, peer, b, min_region)?;
        headers.push(p.header.to_vec());
        names.push(p.name.to_vec());
        regions.push(p.region);
    }
    Ok(FabricPeers { headers, addrs: stack.connect(&names)?, regions })
}

/// One peer's connection blob, parsed (borrowing from the blob).
#[derive(Debug)]
pub struct ConnectBlob<'a> {
    pub header: &'a [u8],
    pub name: &'a [u8],
    pub region: RemoteRegion,
}

/// Longest endpoint name accepted from a peer (libfabric's are tens of bytes; EFA's 32).
pub const MAX_EP_NAME: usize = 4096;

/// Parses what `peer` published (`u32 len, header, u32 len, endpoint name, region`): every
/// length is checked against the blob before use, and the region must hold `min_region`
/// bytes. Any violation is [`Error::Protocol`] naming `peer`. Pure: the fuzz harness calls it.
pub fn parse_blob(rank: usize, peer: usize, b: &[u8], min_region: u64) -> Result<ConnectBlob<'_>> {
    let bad = |what: &str| malformed(rank, peer, b.len(), what);
    let field = |at: usize| -> Result<(&[u8], usize)> {
        let len = b.get(at..at + 4).and_then(|s| s.try_into().ok()).map(u32::from_le_bytes);
        let len = len.ok_or_else(|| bad("truncated length"))? as usize;
        let end = at.checked_add(4 + len).ok_or_else(|| bad("field length overflows"))?;
        let body = b.get(at + 4..end).ok_or_else(|| bad("truncated field"))?;
        Ok((body, end))
    };
    let (header, at) = field(0)?;
    let (name, at) = field(at)?;
    if name.is_empty() || name.len() > MAX_EP_NAME {
        return Err(bad(&format!("endpoint name of {} bytes (1..={MAX_EP_NAME})", name.len())));
    }
    let region = RemoteRegion::from_bytes(&b[at..]).map_err(|e| bad(&e.to_string()))?;
    if region.len < min_region {
        return Err(bad(&format!(
            "receive region of {} bytes, expected at least {min_region}",
            region.len
        )));
    }
    Ok(ConnectBlob { header, name, region })
}

/// The proxy's view of dead ranks: the bootstrap's (the TCP store pushes a rank's death to
/// every rank at once), so a step waiting on a dead peer ends within milliseconds, naming it.
pub(crate) fn peer_watch(boot: &Arc<dyn Bootstrap>) -> crate::proxy::PeerWatch {
    let b = boot.clone();
    Arc::new(move || b.dead_peers())
}
