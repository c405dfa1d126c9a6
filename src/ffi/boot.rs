//! A bootstrap the caller owns (`fep_boot_*`): the torchrun / PyTorchJob environment's TCP store
//! joined once and shared by every buffer created over it with [`super::fep_buffer_create_boot`].
//!
//! NOTES: DeepEP callers keep several buffers alive at once (a normal and a low-latency one; the
//! Python package one per model shape), each created collectively. Joining the environment's store
//! once per buffer would need a fresh port or store instance per buffer; one store whose
//! collectives are taken in the same order on every rank needs neither.

use std::os::raw::c_void;
use std::sync::Arc;
use std::time::Duration;

use super::{fep_status, guard};
use crate::bootstrap::{Bootstrap, TcpStore};
use crate::error::Error;

/// A joined bootstrap (opaque); free it with [`fep_boot_destroy`] after every buffer created
/// over it.
pub struct fep_boot {
    inner: Option<Arc<dyn Bootstrap>>,
}

impl fep_boot {
    pub(crate) fn get(&self) -> Result<Arc<dyn Bootstrap>, Error> {
        self.inner.clone().ok_or_else(|| Error::arg("boot", "destroyed bootstrap"))
    }
}

/// Joins the store named by the torchrun variables (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`,
/// `MASTER_PORT` or `FEP_MASTER_PORT`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`). Collective: every rank
/// calls it. `timeout_s` bounds the rendezvous; 0: 60 s; it must be finite and not negative.
///
/// # Safety
/// `out` must be a valid pointer.
#[no_mangle]
pub unsafe extern "C" fn fep_boot_create(timeout_s: f64, out: *mut *mut fep_boot) -> fep_status {
    guard(|| {
        let out = out.as_mut().ok_or_else(|| Error::arg("out", "NULL pointer"))?;
        *out = std::ptr::null_mut();
        if !timeout_s.is_finite() || timeout_s < 0.0 {
            return Err(Error::arg("timeout_s", format!("{timeout_s}: must be finite and >= 0")));
        }
        let t = if timeout_s == 0.0 { 60.0 } else { timeout_s };
        let timeout =
            Duration::try_from_secs_f64(t).map_err(|e| Error::arg("timeout_s", e.to_string()))?;
        let store: Arc<dyn Bootstrap> = Arc::new(TcpStore::from_env(timeout)?);
        *out = super::live::boxed(fep_boot { inner: Some(store) });
        Ok(())
    })
}

/// This rank, the world size, the rank within its node and the node's rank count.
///
/// # Safety
/// `boot` must come from [`fep_boot_create`]; the out-pointers may be NULL.
#[no_mangle]
pub unsafe extern "C" fn fep_boot_rank(
    boot: *const fep_boot,
    rank: *mut i32,
    num_ranks: *mut i32,
    local_rank: *mut i32,
    local_world_size: *mut i32,
) -> fep_status {
    guard(|| {
        let b = super::live::get(boot, "boot")?.get()?;
        for (p, v) in [
            (rank, b.rank()),
            (num_ranks, b.world_size()),
            (local_rank, b.local_rank()),
            (local_world_size, b.local_world_size()),
        ] {
            if let Some(p) = p.as_mut() {
                *p = i32::try_from(v).map_err(|_| Error::arg("boot", "rank exceeds int32"))?;
            }
        }
        Ok(())
    })
}

/// Equal-length all-gather over the bootstrap (the `fep_allgather_fn` signature, `user` = the
/// `fep_boot`): `send` has `len` bytes (at most 256 MiB), `recv` `len * num_ranks`. Returns 0 on
/// success, else a `fep_status` (the message through `fep_last_error`). Collective.
///
/// # Safety
/// `send`/`recv` must hold the bytes above; `user` must be a live `fep_boot`.
#[no_mangle]
pub unsafe extern "C" fn fep_boot_allgather(
    send: *const c_void,
    len: usize,
    recv: *mut c_void,
    user: *mut c_void,
) -> i32 {
    guard(|| {
        let b = super::live::get(user as *const fep_boot, "user")?.get()?;
        let n = b.world_size();
        if len > crate::bootstrap::MAX_BLOB {
            return Err(Error::arg(
                "len",
                format!(
                    "{len} bytes, above the {}-byte limit of one contribution",
                    crate::bootstrap::MAX_BLOB
                ),
            ));
        }
        let total = len.checked_mul(n).ok_or_else(|| Error::arg("len", "len * ranks overflows"))?;
        super::check_extent::<u8>("len", total)?;
        if len > 0 && send.is_null() {
            return Err(Error::arg("send", "NULL pointer with len > 0"));
        }
        if len > 0 && recv.is_null() {
            return Err(Error::arg("recv", "NULL pointer with len > 0"));
        }
        let data = if len == 0 { &[][..] } else { std::slice::from_raw_parts(send.cast(), len) };
        let all = b.all_gather(data)?;
        let mut off = 0usize;
        for (peer, part) in all.iter().enumerate() {
            if part.len() != len {
                return Err(Error::Protocol {
                    rank: b.rank(),
                    peer,
                    phase: "all-gather",
                    msg: format!("{} bytes, expected {len}", part.len()),
                });
            }
            if len > 0 {
                std::ptr::copy_nonoverlapping(part.as_ptr(), recv.cast::<u8>().add(off), len);
            }
            off += len;
        }
        debug_assert_eq!(off, total);
        Ok(())
    }) as i32
}

/// Leaves the bootstrap (rank 0 stops the store once every rank has left or the timeout
/// passed). NULL is a no-op; every buffer created over it must be destroyed first.
///
/// # Safety
/// `boot` must come from [`fep_boot_create`] and not be used afterwards.
#[no_mangle]
pub unsafe extern "C" fn fep_boot_destroy(boot: *mut fep_boot) -> fep_status {
    guard(|| {
        if !boot.is_null() {
            let mut b = super::live::take(boot, "boot")?;
            b.inner.take();
        }
        Ok(())
    })
}
