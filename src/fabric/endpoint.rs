//! RDM endpoint: RMA writes with immediate data, and send/recv for small control messages.
//! Posting is `unsafe`: the buffers must stay registered (and unmoved) until the completion.

use std::ptr;
use std::sync::Arc;

use libfabric_sys as sys;

use super::av::{AddressVector, FiAddr};
use super::cq::CompletionQueue;
use super::domain::{close_fid, Domain};
use super::error::{check, check_ctx, FabricError, Result, EAGAIN};
use super::mr::{MemoryRegion, RemoteRegion};
use crate::util::Deadline;

/// An enabled `FI_EP_RDM` endpoint bound to one CQ (transmit + receive) and one AV.
pub struct Endpoint {
    ptr: *mut sys::fid_ep,
    imm_limit: u64,
    inject_size: usize,
    cq: Arc<CompletionQueue>,
    av: Arc<AddressVector>,
    domain: Arc<Domain>,
}

// SAFETY: the domain is opened FI_THREAD_SAFE.
unsafe impl Send for Endpoint {}
unsafe impl Sync for Endpoint {}

impl Endpoint {
    /// Opens, binds and enables an endpoint. Several endpoints may share a domain.
    ///
    /// NOTES: the `shm` provider of libfabric 1.17 names each endpoint's region
    /// `/dev/shm/<pid>:<domain>:<endpoint>` and leaves it behind when the process dies without
    /// closing it (killed, `exit`). A later process that gets the same pid then fails
    /// `fi_enable` with EBUSY. Names with our pid can only be such leftovers before this
    /// process opens its first shm endpoint, so they are removed once, then.
    pub fn open(
        domain: &Arc<Domain>,
        cq: &Arc<CompletionQueue>,
        av: &Arc<AddressVector>,
    ) -> Result<Arc<Endpoint>> {
        if domain.info().provider().starts_with("shm") {
            remove_stale_shm_names();
        }
        let mut ptr = ptr::null_mut();
        // SAFETY: domain open, info valid; ptr receives the new fid.
        check("fi_endpoint", unsafe {
            sys::fi_endpoint(domain.as_raw(), domain.info().as_raw(), &mut ptr, ptr::null_mut())
        } as i64)?;
        let cq_bytes = domain.info().cq_data_size().min(8);
        let ep = Endpoint {
            ptr,
            imm_limit: if cq_bytes >= 8 { u64::MAX } else { (1u64 << (8 * cq_bytes)) - 1 },
            inject_size: domain.info().inject_size(),
            cq: cq.clone(),
            av: av.clone(),
            domain: domain.clone(),
        };
        // From here on, an error drops `ep`, which closes the fid.
        unsafe {
            check(
                "fi_ep_bind(cq)",
                sys::fi_ep_bind(
                    ptr,
                    &mut (*cq.as_raw()).fid,
                    (sys::FI_TRANSMIT | sys::FI_RECV) as u64,
                ) as i64,
            )?;
            check("fi_ep_bind(av)", sys::fi_ep_bind(ptr, &mut (*av.as_raw()).fid, 0) as i64)?;
            check("fi_enable", sys::fi_enable(ptr) as i64)?;
        }
        Ok(Arc::new(ep))
    }

    pub fn as_raw(&self) -> *mut sys::fid_ep {
        self.ptr
    }
    pub fn cq(&self) -> &Arc<CompletionQueue> {
        &self.cq
    }
    pub fn av(&self) -> &Arc<AddressVector> {
        &self.av
    }
    pub fn domain(&self) -> &Arc<Domain> {
        &self.domain
    }
    /// The largest immediate value a write may carry on this provider.
    pub fn imm_limit(&self) -> u64 {
        self.imm_limit
    }

    /// This endpoint's address, to hand to peers (`fi_getname`).
    pub fn name(&self) -> Result<Vec<u8>> {
        let mut buf = vec![0u8; 256];
        let mut len = buf.len();
        // SAFETY: buf has len bytes; on -FI_ETOOSMALL len holds the size needed.
        let mut ret =
            unsafe { sys::fi_getname(&mut (*self.ptr).fid, buf.as_mut_ptr().cast(), &mut len) };
        if ret == -(sys::FI_ETOOSMALL as i32) {
            buf.resize(len, 0);
            ret =
                unsafe { sys::fi_getname(&mut (*self.ptr).fid, buf.as_mut_ptr().cast(), &mut len) };
        }
        check("fi_getname", ret as i64)?;
        buf.truncate(len);
        Ok(buf)
    }

    /// Posts an RMA write of `len` bytes from `local[local_off..]` to `remote[remote_off..]` at
    /// peer `dest`, with `imm` delivered in the peer's completion (`FI_REMOTE_CQ_DATA`) when
    /// given. `context` comes back in the local completion. Returns `Ok(false)` when the provider
    /// is back-pressured (`-FI_EAGAIN`): drive progress ([`CompletionQueue::progress`]) and post
    /// the same write again. A zero-length write with `imm` is a valid "empty message".
    ///
    /// # Safety
    /// `local` and the remote region must stay registered, and the local bytes unchanged, until
    /// this write's local completion has been read.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn try_write(
        &self,
        local: &MemoryRegion,
        local_off: usize,
        len: usize,
        dest: FiAddr,
        remote: &RemoteRegion,
        remote_off: u64,
        imm: Option<u64>,
        context: u64,
    ) -> Result<bool> {
        if let Some(v) = imm {
            if v > self.imm_limit {
                return Err(FabricError::arg(
                    "imm",
                    format!("{v:#x} exceeds the provider's {}-bit CQ data", self.imm_bits()),
                ));
            }
        }
        let (addr, mut desc) = local.local(local_off, len)?;
        let (raddr, key) = remote.target(remote_off, len as u64)?;
        let iov = libc::iovec { iov_base: addr.cast(), iov_len: len };
        let rma = sys::fi_rma_iov { addr: raddr, len, key };
        let msg = sys::fi_msg_rma {
            msg_iov: (&iov as *const libc::iovec).cast(),
            desc: &mut desc,
            iov_count: 1,
            addr: dest,
            rma_iov: &rma,
            rma_iov_count: 1,
            context: context as *mut libc::c_void,
            data: imm.unwrap_or(0),
        };
        let flags = sys::FI_COMPLETION as u64
            | if imm.is_some() { sys::FI_REMOTE_CQ_DATA as u64 } else { 0 };
        let ret = sys::fi_writemsg(self.ptr, &msg, flags) as i64;
        if ret == EAGAIN {
            return Ok(false);
        }
        check_ctx("fi_writemsg", ret, || format!("dest {dest}, {len} bytes, imm {imm:?}"))?;
        Ok(true)
    }

    /// Writes a small message inline (`fi_inject_writedata`): the source bytes are copied before
    /// the call returns and no local completion is generated, which saves a CQ entry per message
    /// on the latency path. `len` must not exceed [`inject_size`](Self::inject_size).
    /// Returns `Ok(false)` on back-pressure, as [`try_write`](Self::try_write).
    pub fn try_inject_write(
        &self,
        data: &[u8],
        dest: FiAddr,
        remote: &RemoteRegion,
        remote_off: u64,
        imm: u64,
    ) -> Result<bool> {
        if data.len() > self.inject_size {
            return Err(FabricError::arg(
                "len",
                format!(
                    "{} bytes exceeds the provider's inject size {}",
                    data.len(),
                    self.inject_size
                ),
            ));
        }
        if imm > self.imm_limit {
            return Err(FabricError::arg(
                "imm",
                format!("{imm:#x} exceeds the provider's CQ data"),
            ));
        }
        let (raddr, key) = remote.target(remote_off, data.len() as u64)?;
        // SAFETY: inject copies `data` before returning; the remote region is the peer's concern
        // (it must keep it registered while peers may write, which the protocol guarantees).
        let ret = unsafe {
            sys::fi_inject_writedata(
                self.ptr,
                data.as_ptr().cast(),
                data.len(),
                imm,
                dest,
                raddr,
                key,
            )
        } as i64;
        if ret == EAGAIN {
            return Ok(false);
        }
        check_ctx("fi_inject_writedata", ret, || format!("dest {dest}, {} bytes", data.len()))?;
        Ok(true)
    }

    /// Largest message [`try_inject_write`](Self::try_inject_write) takes.
    pub fn inject_size(&self) -> usize {
        self.inject_size
    }

    /// [`try_write`](Self::try_write), driving progress on EAGAIN until posted or `deadline`.
    /// Completions read meanwhile stay in the CQ's stash: nothing is lost.
    ///
    /// # Safety
    /// As [`try_write`](Self::try_write).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn write(
        &self,
        local: &MemoryRegion,
        local_off: usize,
        len: usize,
        dest: FiAddr,
        remote: &RemoteRegion,
        remote_off: u64,
        imm: Option<u64>,
        context: u64,
        deadline: Deadline,
    ) -> Result<()> {
        self.retry(deadline, "posting an RMA write", || {
            self.try_write(local, local_off, len, dest, remote, remote_off, imm, context)
        })
    }

    /// Posts a receive for a control message into `mr[off..off+len]`.
    ///
    /// # Safety
    /// The buffer must stay registered and untouched until the receive completes.
    pub unsafe fn try_recv(
        &self,
        mr: &MemoryRegion,
        off: usize,
        len: usize,
        context: u64,
    ) -> Result<bool> {
        let (addr, desc) = mr.local(off, len)?;
        let ret = sys::fi_recv(
            self.ptr,
            addr.cast(),
            len,
            desc,
            FiAddr::MAX, // FI_ADDR_UNSPEC ((uint64_t)-1): a macro bindgen cannot see
            context as *mut libc::c_void,
        ) as i64;
        if ret == EAGAIN {
            return Ok(false);
        }
        check_ctx("fi_recv", ret, || format!("{len} bytes"))?;
        Ok(true)
    }

    /// Sends a control message from `mr[off..off+len]` to `dest`.
    ///
    /// # Safety
    /// The buffer must stay registered and unchanged until the send completes.
    pub unsafe fn try_send(
        &self,
        mr: &MemoryRegion,
        off: usize,
        len: usize,
        dest: FiAddr,
        context: u64,
    ) -> Result<bool> {
        let (addr, desc) = mr.local(off, len)?;
        let ret = sys::fi_send(self.ptr, addr.cast(), len, desc, dest, context as *mut libc::c_void)
            as i64;
        if ret == EAGAIN {
            return Ok(false);
        }
        check_ctx("fi_send", ret, || format!("dest {dest}, {len} bytes"))?;
        Ok(true)
    }

    /// Runs `post` until it is accepted, driving progress on back-pressure, bounded by `deadline`.
    pub fn retry(
        &self,
        deadline: Deadline,
        what: &str,
        mut post: impl FnMut() -> Result<bool>,
    ) -> Result<()> {
        loop {
            if post()? {
                return Ok(());
            }
            self.cq.progress()?;
            if deadline.expired() {
                return Err(FabricError::Timeout {
                    what: format!("{what}: the provider stayed back-pressured (EAGAIN)"),
                    waited: deadline.elapsed(),
                });
            }
            std::hint::spin_loop();
        }
    }

    fn imm_bits(&self) -> u32 {
        64 - self.imm_limit.leading_zeros()
    }
}

/// Removes `/dev/shm/<pid>:*` left by a dead process that had this pid (see `Endpoint::open`).
fn remove_stale_shm_names() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let prefix = format!("{}:", std::process::id());
        let Ok(dir) = std::fs::read_dir("/dev/shm") else { return };
        for e in dir.flatten() {
            if e.file_name().to_str().is_some_and(|n| n.starts_with(&prefix)) {
                let _ = std::fs::remove_file(e.path());
            }
        }
    });
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        // SAFETY: regions bound to this endpoint (FI_MR_ENDPOINT) hold an Arc to it.
        unsafe { close_fid(&mut (*self.ptr).fid, "ep") }
    }
}
