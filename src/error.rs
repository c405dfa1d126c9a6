//! The crate-wide error: every layer's typed error, plus argument errors that name the argument.

use std::time::Duration;

/// Every public call returns this (or a layer's own error that converts into it).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Fabric(#[from] crate::fabric::FabricError),
    #[error(transparent)]
    Bootstrap(#[from] crate::bootstrap::BootstrapError),
    #[error(transparent)]
    Cuda(#[from] crate::cuda::CudaError),
    #[error(transparent)]
    Proxy(#[from] crate::proxy::ProxyError),
    /// Bad input, caught before anything is sent.
    #[error("invalid argument `{arg}`: {msg}")]
    InvalidArgument { arg: &'static str, msg: String },
    /// A bounded wait ran out; `peers` names the ranks that did not deliver. `detail` is empty
    /// or says more (a kernel's wait: the value it waited for and the last it saw).
    #[error(
        "rank {rank}: timed out after {waited:?} in {phase} waiting for ranks {peers:?}{detail}"
    )]
    Timeout {
        rank: usize,
        phase: &'static str,
        peers: Vec<usize>,
        waited: Duration,
        detail: String,
    },
    /// Ranks connected with different settings.
    #[error("config mismatch at connect: {0}")]
    ConfigMismatch(String),
    /// Data that arrived from the network failed a bounds check.
    #[error("rank {rank}: bad data from rank {peer} in {phase}: {msg}")]
    Protocol { rank: usize, peer: usize, phase: &'static str, msg: String },
    /// This rank's bounded wait ran out on ranks that were themselves waiting: rank `peer`,
    /// which rank `reported_by` (one of them, or further up the chain) timed out on and
    /// reported, is the likely cause. `source` is this rank's own error, as it was.
    #[error(
        "rank {rank}: rank {peer} stopped responding (rank {reported_by} timed out waiting for \
         it and reported it); this rank failed waiting on ranks that waited on it: {source}"
    )]
    Upstream { rank: usize, peer: usize, reported_by: usize, source: Box<Error> },
    #[error("{0}")]
    Other(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The immediate codec's errors, through the proxy's (`ProxyError::InvalidConfig`): the split
/// is a proxy setting.
impl From<crate::protocol::plan::ImmError> for Error {
    fn from(e: crate::protocol::plan::ImmError) -> Self {
        Error::Proxy(e.into())
    }
}

impl Error {
    /// Shorthand for [`Error::InvalidArgument`].
    pub fn arg(arg: &'static str, msg: impl Into<String>) -> Self {
        Error::InvalidArgument { arg, msg: msg.into() }
    }

    /// A proxy error of rank `rank` in `phase`: an arrival wait that ran out becomes
    /// [`Error::Timeout`] naming the lagging peers (each once, ascending); the rest stay
    /// [`Error::Proxy`].
    pub fn from_proxy(rank: usize, phase: &'static str, e: crate::proxy::ProxyError) -> Self {
        match e {
            crate::proxy::ProxyError::ArrivalTimeout { waited, lagging, .. } => {
                let mut peers: Vec<usize> = lagging.iter().map(|l| l.peer as usize).collect();
                peers.sort_unstable();
                peers.dedup();
                Error::Timeout { rank, phase, peers, waited, detail: String::new() }
            }
            other => Error::Proxy(other),
        }
    }

    /// The ranks this error says stopped responding: the peers a bounded wait ran out on
    /// ([`Error::Timeout`]'s, a proxy wait's lagging or owed peers), ascending, each once. Empty
    /// for every other error (a rank the bootstrap already knows gone is not one of these).
    pub fn unresponsive_peers(&self) -> Vec<usize> {
        let mut v: Vec<usize> = match self {
            Error::Timeout { peers, .. } => peers.clone(),
            Error::Proxy(e) => proxy_unresponsive(e),
            Error::Upstream { source, .. } => return source.unresponsive_peers(),
            _ => Vec::new(),
        };
        v.retain(|&p| p != u32::MAX as usize);
        v.sort_unstable();
        v.dedup();
        v
    }

    /// `self` once this rank has reported the peers it timed out on: if the bootstrap has since
    /// heard that a rank this error does not name stopped responding (reported by a rank it
    /// does name, or further up that chain), [`Error::Upstream`] naming that rank; else `self`.
    pub fn with_upstream(self, rank: usize, dead: &[crate::bootstrap::DeadPeer]) -> Self {
        let mine = self.unresponsive_peers();
        if mine.is_empty() {
            return self;
        }
        // Walk the chain from the ranks this wait needed: a rank they reported, and so on.
        let mut reach = mine.clone();
        let mut found = None;
        while let Some(d) = dead
            .iter()
            .find(|d| d.reported_by.is_some_and(|b| reach.contains(&b)) && !reach.contains(&d.rank))
        {
            reach.push(d.rank);
            found = Some(*d);
        }
        match found {
            Some(d) if d.rank != rank => Error::Upstream {
                rank,
                peer: d.rank,
                reported_by: d.reported_by.unwrap_or(usize::MAX),
                source: Box::new(self),
            },
            _ => self,
        }
    }

    /// A CUDA-layer error as the crate's: a wait a kernel recorded as timed out
    /// (`FEP_DEV_WAIT_TIMEOUT`) becomes [`Error::Timeout`] naming the rank, the phase (named by
    /// `phase_name`) and the peer, `waited` being the configured timeout, and keeping what the
    /// wait expected and the last value it saw (for a flag, `tag << 32 | count`): that tells a
    /// message that never came from one that came late or with another tag. Any other error
    /// converts as it is.
    pub fn from_device(
        e: crate::cuda::CudaError,
        phase_name: fn(u32) -> &'static str,
        waited: Duration,
    ) -> Self {
        match e {
            crate::cuda::CudaError::Device {
                code, rank, phase, peer, expected, observed, ..
            } if code == crate::abi::FEP_DEV_WAIT_TIMEOUT => Error::Timeout {
                rank: rank as usize,
                phase: phase_name(phase),
                peers: peer.map(|p| vec![p as usize]).unwrap_or_default(),
                waited,
                detail: format!(" (expected {expected:#x}, last saw {observed:#x})"),
            },
            e => e.into(),
        }
    }
}

fn proxy_unresponsive(e: &crate::proxy::ProxyError) -> Vec<usize> {
    use crate::proxy::ProxyError as P;
    match e {
        P::ArrivalTimeout { lagging, .. } => lagging.iter().map(|l| l.peer as usize).collect(),
        P::SendTimeout { owed, queued, .. } => {
            owed.iter().chain(queued).map(|&(p, _)| p as usize).collect()
        }
        P::WorkerFailed { source, .. } => proxy_unresponsive(source),
        _ => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::CudaError;

    fn device(code: u32) -> CudaError {
        CudaError::Device {
            code,
            what: "X",
            rank: 2,
            phase: 7,
            peer: Some(1),
            expected: 0x1_0000_0000,
            observed: 0,
        }
    }

    #[test]
    fn a_kernel_wait_timeout_becomes_a_typed_timeout_with_its_values() {
        let e = Error::from_device(
            device(crate::abi::FEP_DEV_WAIT_TIMEOUT),
            |p| if p == 7 { "phase seven" } else { "other" },
            Duration::from_secs(3),
        );
        match &e {
            Error::Timeout { rank: 2, phase: "phase seven", peers, waited, detail } => {
                assert_eq!(peers, &vec![1]);
                assert_eq!(*waited, Duration::from_secs(3));
                assert!(detail.contains("expected 0x100000000") && detail.contains("last saw 0x0"));
            }
            other => panic!("expected a timeout, got {other:?}"),
        }
        assert!(e.to_string().contains("waiting for ranks [1] (expected"), "{e}");
    }

    fn timeout(rank: usize, peers: Vec<usize>) -> Error {
        Error::Timeout {
            rank,
            phase: "ll combine",
            peers,
            waited: Duration::from_secs(4),
            detail: String::new(),
        }
    }

    #[test]
    fn a_wait_on_a_rank_that_waited_on_a_stopped_one_names_the_stopped_one() {
        use crate::bootstrap::DeadPeer;
        let dead = [DeadPeer { rank: 1, reported_by: Some(2) }];
        let e = timeout(0, vec![2]).with_upstream(0, &dead);
        match &e {
            Error::Upstream { rank: 0, peer: 1, reported_by: 2, source } => {
                assert!(matches!(**source, Error::Timeout { .. }));
            }
            other => panic!("expected the upstream rank, got {other:?}"),
        }
        assert!(e.to_string().contains("rank 1 stopped responding (rank 2 timed out"), "{e}");
        assert_eq!(e.unresponsive_peers(), vec![2], "the ranks this wait needed");
        assert_eq!(crate::ffi::fep_status::from(&e), crate::ffi::fep_status::FEP_ERR_TIMEOUT);
        // Further up: 0 waited on 3, 3 on 2, 2 on 1.
        let chain = [
            DeadPeer { rank: 2, reported_by: Some(3) },
            DeadPeer { rank: 1, reported_by: Some(2) },
        ];
        assert!(matches!(
            timeout(0, vec![3]).with_upstream(0, &chain),
            Error::Upstream { peer: 1, reported_by: 2, .. }
        ));
    }

    #[test]
    fn an_error_that_names_the_stopped_rank_or_no_chain_stays_as_it_is() {
        use crate::bootstrap::DeadPeer;
        let dead = [DeadPeer { rank: 1, reported_by: Some(2) }];
        assert!(matches!(timeout(0, vec![1, 2]).with_upstream(0, &dead), Error::Timeout { .. }));
        // Reported by a rank this wait did not need: not its chain.
        assert!(matches!(timeout(0, vec![3]).with_upstream(0, &dead), Error::Timeout { .. }));
        // A rank that left (not reported) is named by the waits themselves.
        let left = [DeadPeer { rank: 1, reported_by: None }];
        assert!(matches!(timeout(0, vec![2]).with_upstream(0, &left), Error::Timeout { .. }));
        // This rank itself at the top of the chain (it was reported while slow): unchanged.
        let me = [DeadPeer { rank: 0, reported_by: Some(2) }];
        assert!(matches!(timeout(0, vec![2]).with_upstream(0, &me), Error::Timeout { .. }));
        assert!(matches!(
            Error::arg("x", "y").with_upstream(0, &dead),
            Error::InvalidArgument { .. }
        ));
    }

    #[test]
    fn other_device_errors_stay_cuda_errors() {
        let e = Error::from_device(
            device(crate::abi::FEP_DEV_BAD_COUNT),
            |_| "p",
            Duration::from_secs(1),
        );
        assert!(matches!(e, Error::Cuda(CudaError::Device { .. })), "{e:?}");
    }
}
