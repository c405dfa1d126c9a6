//! Safe libfabric: one owner per fid, each holding an `Arc` to its parent, so teardown runs in
//! dependency order by construction. Errors name the call, code and text.
//!
//! ```text
//! Info -> Fabric -> Domain -> { CompletionQueue, AddressVector, Endpoint, MemoryRegion }
//! ```
//! [`Stack`] opens the whole chain for one provider/NIC in one call.

mod av;
mod cq;
mod domain;
mod endpoint;
mod error;
mod info;
mod mr;
pub mod topo;

use std::sync::Arc;

pub use av::{AddressVector, FiAddr};
pub use cq::{Completion, CompletionQueue};
pub use domain::{Domain, Fabric};
pub use endpoint::Endpoint;
pub use error::{strerror, FabricError, Result};
pub use info::{
    api_version, find, find_first, library_version, select, select_with, BurstLimit, Info,
    InfoQuery,
};
pub use libfabric_sys as sys;
pub use mr::{MemKind, MemoryRegion, RemoteRegion};
pub use topo::Placement;

/// Fabric, domain, CQ, AV and one endpoint for one provider/NIC.
pub struct Stack {
    pub info: Info,
    pub fabric: Arc<Fabric>,
    pub domain: Arc<Domain>,
    pub cq: Arc<CompletionQueue>,
    pub av: Arc<AddressVector>,
    pub ep: Arc<Endpoint>,
}

impl Stack {
    /// Opens everything for the entry [`select`] picks for an endpoint placed nowhere in
    /// particular (no GPU, local rank 0, one endpoint): with `FEP_NICS` unset, the first
    /// domain libfabric lists.
    pub fn open(query: &InfoQuery, num_peers: usize) -> Result<Stack> {
        Self::open_placed(query, num_peers, &Placement::default())
    }

    /// Opens everything for the NIC [`select`] picks for `placement` (the rank's GPU, its
    /// local rank, which of its endpoints this is).
    pub fn open_placed(
        query: &InfoQuery,
        num_peers: usize,
        placement: &Placement,
    ) -> Result<Stack> {
        if let Some(r) = placement.rank {
            crate::log::set_rank(r);
        }
        Self::open_info(select(query, placement)?, num_peers)
    }

    /// Opens everything for one `fi_info` entry (e.g. one of several NICs from [`find`]).
    pub fn open_info(info: Info, num_peers: usize) -> Result<Stack> {
        let fabric = Fabric::open(&info)?;
        let domain = Domain::open(&fabric, &info)?;
        let cq = CompletionQueue::open(&domain, 0)?;
        let av = AddressVector::open(&domain, num_peers)?;
        let ep = Endpoint::open(&domain, &cq, &av)?;
        crate::fep_debug!(target: "fabric_ep::fabric", "opened {}", info.describe());
        Ok(Stack { info, fabric, domain, cq, av, ep })
    }

    /// Inserts peers' endpoint names (indexed by rank) and returns their addresses, by rank.
    pub fn connect(&self, names: &[Vec<u8>]) -> Result<Vec<FiAddr>> {
        names.iter().map(|n| self.av.insert(n)).collect()
    }

    /// Registers memory for this stack's endpoint (binding it where `FI_MR_ENDPOINT` asks).
    ///
    /// # Safety
    /// As [`MemoryRegion::register`].
    pub unsafe fn register(
        &self,
        base: *mut u8,
        len: usize,
        kind: MemKind,
    ) -> Result<MemoryRegion> {
        MemoryRegion::register(&self.domain, Some(&self.ep), base, len, kind)
    }
}
