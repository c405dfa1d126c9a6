//! A bootstrap over a caller-supplied all-gather (the C ABI, a torch process group, MPI).
//!
//! Such collectives are equal-length (`MPI_Allgather`, `dist.all_gather_into_tensor`), so variable
//! blobs take two calls: first every rank's length (u64 LE), then every blob padded to the longest.

use parking_lot::Mutex;

use super::{check_ranks, Bootstrap, BootstrapError, MAX_BLOB};

/// An equal-length all-gather: `send` holds `L` bytes, `recv` has room for `L * world_size`; on
/// return `recv[r * L..(r + 1) * L]` holds rank `r`'s `send`. Every rank calls it with the same `L`.
/// `Err` carries the caller's own description of what failed.
pub type AllGatherFn = Box<dyn Fn(&[u8], &mut [u8]) -> Result<(), String> + Send + Sync>;

/// [`Bootstrap`] over an [`AllGatherFn`].
///
/// NOTES: the deadline belongs to the callback: this wrapper cannot interrupt a foreign collective,
/// so a callback that can block must carry its own timeout (torch's process groups and NCCL do).
pub struct CallbackBootstrap {
    rank: usize,
    world_size: usize,
    local_rank: usize,
    local_world_size: usize,
    all_gather: AllGatherFn,
    /// Two threads must not interleave the two calls one all-gather makes.
    call: Mutex<()>,
}

impl CallbackBootstrap {
    /// Wraps `all_gather` with the given identity (as the caller's launcher knows it).
    pub fn new(
        rank: usize,
        world_size: usize,
        local_rank: usize,
        local_world_size: usize,
        all_gather: AllGatherFn,
    ) -> Result<Self, BootstrapError> {
        check_ranks(rank, world_size, local_rank, local_world_size)?;
        Ok(CallbackBootstrap {
            rank,
            world_size,
            local_rank,
            local_world_size,
            all_gather,
            call: Mutex::new(()),
        })
    }

    fn call(&self, send: &[u8], what: &str) -> Result<Vec<u8>, BootstrapError> {
        let total = send.len().checked_mul(self.world_size).ok_or_else(|| {
            BootstrapError::Callback(format!(
                "{what}: {} bytes x {} ranks overflows",
                send.len(),
                self.world_size
            ))
        })?;
        let mut recv = vec![0u8; total];
        (self.all_gather)(send, &mut recv)
            .map_err(|e| BootstrapError::Callback(format!("rank {}: {what}: {e}", self.rank)))?;
        // A callback that does not place blobs by rank would silently scramble every address; our
        // own slot is the one thing we can check.
        let ours = &recv[self.rank * send.len()..(self.rank + 1) * send.len()];
        if ours != send {
            return Err(BootstrapError::Callback(format!(
                "rank {}: {what}: the callback did not put this rank's data at index {}; it must \
                 return blobs in rank order",
                self.rank, self.rank
            )));
        }
        Ok(recv)
    }
}

impl Bootstrap for CallbackBootstrap {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.world_size
    }
    fn local_rank(&self) -> usize {
        self.local_rank
    }
    fn local_world_size(&self) -> usize {
        self.local_world_size
    }

    fn all_gather(&self, data: &[u8]) -> Result<Vec<Vec<u8>>, BootstrapError> {
        if data.len() > MAX_BLOB {
            return Err(BootstrapError::Protocol(format!(
                "rank {}: all_gather blob of {} bytes exceeds the {MAX_BLOB}-byte limit",
                self.rank,
                data.len()
            )));
        }
        let _one_call = self.call.lock();
        let lens_raw = self.call(&(data.len() as u64).to_le_bytes(), "length exchange")?;
        let mut lens = Vec::with_capacity(self.world_size);
        for (r, chunk) in lens_raw.chunks_exact(8).enumerate() {
            let mut b = [0u8; 8];
            b.copy_from_slice(chunk);
            let len = u64::from_le_bytes(b);
            match usize::try_from(len) {
                Ok(len) if len <= MAX_BLOB => lens.push(len),
                _ => {
                    return Err(BootstrapError::Protocol(format!(
                        "rank {r} announced a {len}-byte blob, above the {MAX_BLOB}-byte limit"
                    )))
                }
            }
        }
        let max = lens.iter().copied().max().unwrap_or(0);
        // Every rank sees the same lengths, so all of them skip the second call together.
        if max == 0 {
            return Ok(vec![Vec::new(); self.world_size]);
        }
        let mut padded = vec![0u8; max];
        padded[..data.len()].copy_from_slice(data);
        let all = self.call(&padded, "data exchange")?;
        Ok(lens.iter().enumerate().map(|(r, &len)| all[r * max..r * max + len].to_vec()).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A one-rank "collective": copies send to recv.
    fn solo() -> AllGatherFn {
        Box::new(|send, recv| {
            recv.copy_from_slice(send);
            Ok(())
        })
    }

    #[test]
    fn single_rank_round_trips() {
        let b = CallbackBootstrap::new(0, 1, 0, 1, solo()).expect("new");
        assert_eq!(b.all_gather(b"abc").expect("gather"), vec![b"abc".to_vec()]);
        b.barrier().expect("barrier");
    }

    #[test]
    fn callback_error_is_reported() {
        let b = CallbackBootstrap::new(0, 1, 0, 1, Box::new(|_, _| Err("pg broken".into())))
            .expect("new");
        let err = b.all_gather(b"x").expect_err("callback fails");
        assert!(matches!(&err, BootstrapError::Callback(m) if m.contains("pg broken")), "{err}");
    }

    #[test]
    fn misplaced_blob_is_caught() {
        let b = CallbackBootstrap::new(
            1,
            2,
            1,
            2,
            Box::new(|send, recv| {
                recv[..send.len()].copy_from_slice(send);
                Ok(())
            }),
        )
        .expect("new");
        assert!(matches!(b.all_gather(b"x"), Err(BootstrapError::Callback(_))));
    }
}
