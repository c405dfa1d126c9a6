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

use std::sync::Arc;

pub use av::{AddressVector, FiAddr};
pub use cq::{Completion, CompletionQueue};
pub use domain::{Domain, Fabric};
pub use endpoint::Endpoint;
pub use error::{strerror, FabricError, Result};
pub use info::{api_version, find, find_first, library_version, Info, InfoQuery};
pub use libfabric_sys as sys;
pub use mr::{MemKind, MemoryRegion, RemoteRegion};

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
    /// Opens everything for the first entry matching `query`.
    pub fn open(query: &InfoQuery, num_peers: usize) -> Result<Stack> {
        Self::open_info(find_first(query)?, num_peers)
    }

    /// Opens everything for one `fi_info` entry (e.g. one of several NICs from [`find`]).
    pub fn open_info(info: Info, num_peers: usize) -> Result<Stack> {
        let fabric = Fabric::open(&info)?;
        let domain = Domain::open(&fabric, &info)?;
        let cq = CompletionQueue::open(&domain, 0)?;
        let av = AddressVector::open(&domain, num_peers)?;
        let ep = Endpoint::open(&domain, &cq, &av)?;
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
