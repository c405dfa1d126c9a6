//! The job secret and the handshake proofs of the TCP store.
//!
//! Every connection to the store runs a challenge-response: the rank sends a fresh nonce in its
//! hello, the store answers with its own fresh nonce, the rank proves it knows the job secret with
//! `HMAC-SHA256(key, "rank" | both nonces | instance | rank | world | job id)`, and the store's
//! welcome proves the same back with the `"store"` label. The secret never crosses the wire, a
//! recorded handshake cannot be replayed (the other side's nonce is new each time), and nothing
//! about the job (its id, its world size, any rank's blob) reaches a connection before its proof
//! checked out.
//!
//! # Threat model
//!
//! - With `FEP_JOB_SECRET` (at least [`MIN_SECRET_LEN`] bytes; give every rank the same random
//!   value, e.g. from the scheduler's secret store): a process without it can connect, but it is
//!   refused at its proof and cannot claim a rank, evict or block a real rank, or read anything.
//! - Without it the key is derived from the job id (`FEP_JOB_ID`, else `TORCHELASTIC_RUN_ID`,
//!   else `"none"`), so it is exactly as secret as that id. torchrun's launch environment holds
//!   nothing else common to all ranks and unknown to outsiders: `MASTER_ADDR`, `MASTER_PORT` and
//!   `WORLD_SIZE` are guessable (and `MASTER_ADDR` can differ between ranks), and the run id is a
//!   random UUID only for `--standalone` (torchrun's default is `"none"`; multi-node jobs usually
//!   pass a scheduler job number, and torchrun logs the id). The derived key still stops
//!   accidents: another job or a stale process on the same port is refused.
//! - A single-host job (`LOCAL_WORLD_SIZE == WORLD_SIZE`) serves and connects over loopback only,
//!   so without `FEP_JOB_SECRET` only processes on rank 0's host can reach the store at all.
//! - Not covered: anyone who can read a rank's environment (same user, root); a host on the path
//!   of the TCP connection, which sees the blobs (endpoint addresses, memory keys) in clear and
//!   could inject into a connection after its handshake, as with torch's own store; a flood of
//!   connections from a reachable host, which can delay ranks (they retry) but not join.

use std::fmt;
use std::io;

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

/// Shortest `FEP_JOB_SECRET` accepted: 16 bytes of text (e.g. 32 hex digits carry 128 bits).
pub const MIN_SECRET_LEN: usize = 16;
pub(super) const NONCE_LEN: usize = 32;
pub(super) const MAC_LEN: usize = 32;

type HmacSha256 = Hmac<Sha256>;

/// Where a [`JobSecret`] came from, for error messages (the key itself is never shown).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SecretSource {
    /// Given by the caller (`FEP_JOB_SECRET`).
    Explicit,
    /// Derived from the job id: only as secret as that id.
    JobId,
}

/// The key every rank of a job proves it holds. `Debug` does not show it.
#[derive(Clone, PartialEq, Eq)]
pub struct JobSecret {
    key: [u8; 32],
    source: SecretSource,
}

impl fmt::Debug for JobSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JobSecret").field("source", &self.source).finish_non_exhaustive()
    }
}

/// Which side a proof speaks for: the two directions use different labels, so a rank's proof can
/// never be reflected back as the store's.
#[derive(Clone, Copy)]
pub(super) enum Role {
    Rank,
    Store,
}

/// Everything a proof binds: both nonces and the claim, so a proof made for one claim is
/// worthless for another.
pub(super) struct Transcript<'a> {
    pub server_nonce: &'a [u8; NONCE_LEN],
    pub client_nonce: &'a [u8; NONCE_LEN],
    pub instance: u64,
    pub rank: u64,
    pub world: u64,
    pub job_id: &'a str,
}

impl JobSecret {
    /// A secret the caller chose (`FEP_JOB_SECRET`), stretched to a fixed-size key.
    pub fn new(secret: &[u8]) -> Self {
        JobSecret {
            key: digest(b"fabric-ep/bootstrap/secret/v1\0", secret),
            source: SecretSource::Explicit,
        }
    }

    /// The fallback key when no secret is given: a hash of the job id. It has the id's entropy,
    /// nothing more (see the module docs).
    pub fn from_job_id(job_id: &str) -> Self {
        JobSecret {
            key: digest(b"fabric-ep/bootstrap/job-id/v1\0", job_id.as_bytes()),
            source: SecretSource::JobId,
        }
    }

    pub fn source(&self) -> SecretSource {
        self.source
    }

    /// Same key, whatever the source.
    pub(super) fn same_key(&self, other: &JobSecret) -> bool {
        self.key == other.key
    }

    pub(super) fn prove(&self, role: Role, t: &Transcript<'_>) -> [u8; MAC_LEN] {
        self.mac(role, t).finalize().into_bytes().into()
    }

    /// Constant-time check of a proof (the `hmac` crate compares without early exit).
    pub(super) fn check(&self, role: Role, t: &Transcript<'_>, tag: &[u8]) -> bool {
        self.mac(role, t).verify_slice(tag).is_ok()
    }

    fn mac(&self, role: Role, t: &Transcript<'_>) -> HmacSha256 {
        // HMAC takes keys of any length, so construction cannot fail.
        let mut m = <HmacSha256 as Mac>::new_from_slice(&self.key).expect("HMAC accepts any key");
        m.update(match role {
            Role::Rank => b"fabric-ep/bootstrap/v2/rank\0",
            Role::Store => b"fabric-ep/bootstrap/v2/store\0",
        });
        m.update(t.server_nonce);
        m.update(t.client_nonce);
        m.update(&t.instance.to_le_bytes());
        m.update(&t.rank.to_le_bytes());
        m.update(&t.world.to_le_bytes());
        // Length-prefixed: the only variable field, last, so the encoding is unambiguous.
        m.update(&(t.job_id.len() as u64).to_le_bytes());
        m.update(t.job_id.as_bytes());
        m
    }
}

fn digest(domain: &[u8], data: &[u8]) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(domain);
    h.update(data);
    h.finalize().into()
}

/// Fresh random bytes from the kernel (`getrandom(2)`), for nonces and local job secrets.
pub(crate) fn random_bytes<const N: usize>() -> io::Result<[u8; N]> {
    let mut out = [0u8; N];
    let mut filled = 0;
    while filled < N {
        // SAFETY: the pointer and length describe the unfilled tail of `out`, which is
        // exclusively borrowed for the call.
        let n = unsafe { libc::getrandom(out[filled..].as_mut_ptr().cast(), N - filled, 0) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        filled += n as usize;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn transcript<'a>(s: &'a [u8; 32], c: &'a [u8; 32], job: &'a str) -> Transcript<'a> {
        Transcript { server_nonce: s, client_nonce: c, instance: 1, rank: 2, world: 4, job_id: job }
    }

    #[test]
    fn hmac_matches_rfc_4231_case_2() {
        // The crate pairing used for every proof, checked against a published vector.
        let mut m = <HmacSha256 as Mac>::new_from_slice(b"Jefe").expect("key");
        m.update(b"what do ya want for nothing?");
        let tag: [u8; 32] = m.finalize().into_bytes().into();
        let hex: String = tag.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
    }

    #[test]
    fn proofs_bind_key_role_and_every_field() {
        let (s, c) = ([1u8; 32], [2u8; 32]);
        let key = JobSecret::new(b"0123456789abcdef");
        let t = transcript(&s, &c, "job");
        let tag = key.prove(Role::Rank, &t);
        assert!(key.check(Role::Rank, &t, &tag));
        assert!(!key.check(Role::Store, &t, &tag), "a rank's proof must not pass as the store's");
        assert!(!JobSecret::new(b"0123456789abcdeF").check(Role::Rank, &t, &tag));
        assert!(!JobSecret::from_job_id("0123456789abcdef").check(Role::Rank, &t, &tag));
        let other = [3u8; 32];
        let variants = [
            Transcript { server_nonce: &other, ..transcript(&s, &c, "job") },
            Transcript { client_nonce: &other, ..transcript(&s, &c, "job") },
            Transcript { instance: 0, ..transcript(&s, &c, "job") },
            Transcript { rank: 3, ..transcript(&s, &c, "job") },
            Transcript { world: 5, ..transcript(&s, &c, "job") },
            transcript(&s, &c, "jo"),
        ];
        for v in &variants {
            assert!(!key.check(Role::Rank, v, &tag));
        }
        assert!(!key.check(Role::Rank, &t, &tag[..31]), "a truncated tag must fail");
    }

    #[test]
    fn debug_hides_the_key_and_nonces_differ() {
        let key = JobSecret::new(b"do-not-print-this-secret");
        let shown = format!("{key:?}");
        assert!(shown.contains("Explicit") && !shown.contains("key"), "{shown}");
        let (a, b) = (random_bytes::<32>().expect("a"), random_bytes::<32>().expect("b"));
        assert_ne!(a, b);
    }
}
