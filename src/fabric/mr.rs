//! Memory registration: host or CUDA memory, in chunks no larger than the provider's region
//! limit, honouring the provider's `mr_mode` bits; and the serialisable remote descriptor peers
//! exchange so they can write into it.

use std::ptr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use libfabric_sys as sys;

use super::domain::{close_fid, Domain};
use super::endpoint::Endpoint;
use super::error::{check_ctx, FabricError, Result};

/// Where the registered memory lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemKind {
    /// Host memory (pinned mapped host buffers included).
    Host,
    /// CUDA device memory, registered through `FI_HMEM_CUDA` (needs a provider with `FI_HMEM`).
    Cuda { device: i32 },
}

/// Access for every EP buffer: local source/target of sends and writes, remote write target.
const ACCESS: u64 = (sys::FI_SEND as u64)
    | (sys::FI_RECV as u64)
    | (sys::FI_WRITE as u64)
    | (sys::FI_REMOTE_WRITE as u64)
    | (sys::FI_READ as u64)
    | (sys::FI_REMOTE_READ as u64);

/// Requested keys must be unique per domain when the provider does not pick them (no
/// `FI_MR_PROV_KEY`); a process-wide counter keeps them unique across domains too.
static NEXT_KEY: AtomicU64 = AtomicU64::new(1);

struct Chunk {
    mr: *mut sys::fid_mr,
    desc: *mut libc::c_void,
    key: u64,
}

/// A registered buffer: `len` bytes from `base`, as one or more provider regions of `chunk`
/// bytes each (the last may be shorter).
///
/// NOTES: an RMA operation must stay inside one chunk on each side (`chunk` is a power of two,
/// 1 GiB by default), so protocol layouts keep every message inside a chunk boundary.
pub struct MemoryRegion {
    base: usize,
    len: usize,
    chunk: usize,
    kind: MemKind,
    chunks: Vec<Chunk>,
    virt_addr: bool,
    _ep: Option<Arc<Endpoint>>,
    _domain: Arc<Domain>,
}

unsafe impl Send for MemoryRegion {}
unsafe impl Sync for MemoryRegion {}

impl MemoryRegion {
    /// Registers `len` bytes at `base`.
    ///
    /// `ep` must be given when the provider sets `FI_MR_ENDPOINT` (regions are then bound to and
    /// usable with that endpoint only).
    ///
    /// # Safety
    /// `base..base+len` must be memory of `kind` that stays allocated, and is not freed or
    /// remapped, until this region is dropped and no operation that names it is in flight.
    pub unsafe fn register(
        domain: &Arc<Domain>,
        ep: Option<&Arc<Endpoint>>,
        base: *mut u8,
        len: usize,
        kind: MemKind,
    ) -> Result<MemoryRegion> {
        let info = domain.info();
        if base.is_null() || len == 0 {
            return Err(FabricError::arg("len", "cannot register an empty or NULL buffer"));
        }
        if let MemKind::Cuda { .. } = kind {
            if !info.hmem() {
                return Err(FabricError::Unsupported {
                    provider: info.provider(),
                    msg: "CUDA memory needs FI_HMEM; use pinned mapped host buffers instead".into(),
                });
            }
        }
        if info.mr_key_size() > 8 {
            return Err(FabricError::Unsupported {
                provider: info.provider(),
                msg: format!("{}-byte MR keys (FI_MR_RAW) are not supported", info.mr_key_size()),
            });
        }
        let bind_ep = domain.requires(sys::FI_MR_ENDPOINT);
        if bind_ep && ep.is_none() {
            return Err(FabricError::arg("ep", "provider sets FI_MR_ENDPOINT: pass the endpoint"));
        }
        let chunk = info.max_region_bytes().max(4096);
        let mut mr = MemoryRegion {
            base: base as usize,
            len,
            chunk,
            kind,
            chunks: Vec::with_capacity(len.div_ceil(chunk)),
            virt_addr: domain.requires(sys::FI_MR_VIRT_ADDR),
            _ep: if bind_ep { ep.cloned() } else { None },
            _domain: domain.clone(),
        };
        let mut off = 0;
        while off < len {
            let n = chunk.min(len - off);
            // On failure `mr` drops here and closes the chunks registered so far.
            mr.chunks.push(register_chunk(domain, ep.filter(|_| bind_ep), base.add(off), n, kind)?);
            off += n;
        }
        // Registration happens at set-up only (buffers are registered once and reused).
        crate::fep_info!(
            target: "fabric_ep::fabric",
            "registered {len} bytes of {kind:?} memory on {}: {} region(s) of at most {chunk} \
             bytes, mr_mode {:#x}{}",
            info.domain_name(),
            mr.chunks.len(),
            info.mr_mode(),
            if bind_ep { ", bound to the endpoint" } else { "" }
        );
        Ok(mr)
    }

    pub fn base(&self) -> usize {
        self.base
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn kind(&self) -> MemKind {
        self.kind
    }
    pub fn num_chunks(&self) -> usize {
        self.chunks.len()
    }
    pub fn chunk_bytes(&self) -> usize {
        self.chunk
    }

    /// The descriptor peers need to write into this region.
    pub fn remote(&self) -> RemoteRegion {
        RemoteRegion {
            base: self.base as u64,
            len: self.len as u64,
            chunk: self.chunk as u64,
            virt_addr: self.virt_addr,
            keys: self.chunks.iter().map(|c| c.key).collect(),
        }
    }

    /// Local address and descriptor for `len` bytes at `off`, which must not cross a chunk.
    pub(crate) fn local(&self, off: usize, len: usize) -> Result<(*mut u8, *mut libc::c_void)> {
        let end = off.checked_add(len).filter(|&e| e <= self.len).ok_or_else(|| {
            FabricError::arg("local_offset", format!("{off}+{len} past region of {}", self.len))
        })?;
        let c = off / self.chunk;
        if len > 0 && (end - 1) / self.chunk != c {
            return Err(FabricError::arg(
                "local_offset",
                format!("{off}+{len} crosses a {}-byte region chunk", self.chunk),
            ));
        }
        let c = c.min(self.chunks.len() - 1);
        Ok(((self.base + off) as *mut u8, self.chunks[c].desc))
    }
}

unsafe fn register_chunk(
    domain: &Arc<Domain>,
    ep: Option<&Arc<Endpoint>>,
    addr: *mut u8,
    len: usize,
    kind: MemKind,
) -> Result<Chunk> {
    let iov = libc::iovec { iov_base: addr.cast(), iov_len: len };
    let mut attr: sys::fi_mr_attr = std::mem::zeroed();
    attr.mr_iov = (&iov as *const libc::iovec).cast();
    attr.iov_count = 1;
    attr.access = ACCESS;
    attr.requested_key = NEXT_KEY.fetch_add(1, Ordering::Relaxed);
    match kind {
        MemKind::Host => attr.iface = sys::fi_hmem_iface_FI_HMEM_SYSTEM,
        MemKind::Cuda { device } => {
            attr.iface = sys::fi_hmem_iface_FI_HMEM_CUDA;
            attr.device.cuda = device;
        }
    }
    let mut mr = ptr::null_mut();
    check_ctx(
        "fi_mr_regattr",
        sys::fi_mr_regattr(domain.as_raw(), &attr, 0, &mut mr) as i64,
        || format!("{len} bytes at {addr:p}, {kind:?}"),
    )?;
    let chunk = Chunk { mr, desc: sys::fi_mr_desc(mr), key: 0 };
    if let Some(ep) = ep {
        // FI_MR_ENDPOINT: bind to the endpoint, then enable, before the key is valid.
        let r = sys::fi_mr_bind(mr, &mut (*ep.as_raw()).fid, 0) as i64;
        if r < 0 {
            close_fid(&mut (*mr).fid, "mr");
            return Err(FabricError::call("fi_mr_bind", r, "FI_MR_ENDPOINT"));
        }
        let r = sys::fi_mr_enable(mr) as i64;
        if r < 0 {
            close_fid(&mut (*mr).fid, "mr");
            return Err(FabricError::call("fi_mr_enable", r, "FI_MR_ENDPOINT"));
        }
    }
    // With FI_MR_PROV_KEY the provider picks the key; otherwise it is the requested one.
    Ok(Chunk { key: sys::fi_mr_key(mr), ..chunk })
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        for c in &self.chunks {
            // SAFETY: each chunk's mr is closed exactly once; the caller guaranteed (register's
            // contract) that no operation naming it is still in flight.
            unsafe { close_fid(&mut (*c.mr).fid, "mr") }
        }
    }
}

/// What a peer needs to write into a [`MemoryRegion`]: exchanged through the bootstrap.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteRegion {
    pub base: u64,
    pub len: u64,
    pub chunk: u64,
    /// `FI_MR_VIRT_ADDR`: target addresses are virtual addresses, else offsets into the chunk.
    pub virt_addr: bool,
    pub keys: Vec<u64>,
}

impl RemoteRegion {
    /// Target address and key for `len` bytes at `off`, which must not cross a chunk.
    pub fn target(&self, off: u64, len: u64) -> Result<(u64, u64)> {
        let end = off.checked_add(len).filter(|&e| e <= self.len).ok_or_else(|| {
            FabricError::arg(
                "remote_offset",
                format!("{off}+{len} past remote region of {}", self.len),
            )
        })?;
        let c = off / self.chunk;
        if len > 0 && (end - 1) / self.chunk != c {
            return Err(FabricError::arg(
                "remote_offset",
                format!("{off}+{len} crosses a {}-byte remote chunk", self.chunk),
            ));
        }
        let c = (c as usize).min(self.keys.len().saturating_sub(1));
        let key = *self.keys.get(c).ok_or_else(|| FabricError::arg("remote", "no keys"))?;
        let in_chunk = off - c as u64 * self.chunk;
        let addr = if self.virt_addr {
            // `base` came from a peer: a region past the end of the address space is refused
            // here (and by `from_bytes`), never wrapped around.
            self.base.checked_add(off).ok_or_else(|| {
                FabricError::arg("remote", format!("base {:#x} + {off} overflows", self.base))
            })?
        } else {
            in_chunk
        };
        Ok((addr, key))
    }

    /// Little-endian wire form: base, len, chunk, flags, key count, keys.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(40 + 8 * self.keys.len());
        for x in [self.base, self.len, self.chunk, self.virt_addr as u64, self.keys.len() as u64] {
            v.extend_from_slice(&x.to_le_bytes());
        }
        for k in &self.keys {
            v.extend_from_slice(&k.to_le_bytes());
        }
        v
    }

    /// Parses [`to_bytes`](Self::to_bytes) output, checking every length.
    pub fn from_bytes(b: &[u8]) -> Result<RemoteRegion> {
        let word = |i: usize| -> Result<u64> {
            b.get(i * 8..i * 8 + 8)
                .map(|s| u64::from_le_bytes(s.try_into().unwrap_or([0; 8])))
                .ok_or_else(|| FabricError::arg("remote", format!("truncated ({} bytes)", b.len())))
        };
        let (base, len, chunk, flags, n) = (word(0)?, word(1)?, word(2)?, word(3)?, word(4)?);
        // Checked: `n` comes from a peer, and 8 * n may not fit.
        let want = n.checked_mul(8).and_then(|k| k.checked_add(40));
        if chunk == 0 || n != len.div_ceil(chunk) || Some(b.len() as u64) != want {
            return Err(FabricError::arg("remote", "inconsistent region descriptor"));
        }
        let virt_addr = flags & 1 != 0;
        if virt_addr && base.checked_add(len).is_none() {
            return Err(FabricError::arg("remote", format!("{len} bytes at {base:#x} overflow")));
        }
        let keys = (0..n as usize).map(|i| word(5 + i)).collect::<Result<Vec<_>>>()?;
        Ok(RemoteRegion { base, len, chunk, virt_addr, keys })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remote_region_roundtrip_and_bounds() {
        let r = RemoteRegion {
            base: 0x1000,
            len: 2500,
            chunk: 1024,
            virt_addr: true,
            keys: vec![7, 8, 9],
        };
        assert_eq!(RemoteRegion::from_bytes(&r.to_bytes()).unwrap(), r);
        assert_eq!(r.target(1030, 10).unwrap(), (0x1000 + 1030, 8));
        assert!(r.target(1020, 10).is_err(), "crosses a chunk");
        assert!(r.target(2490, 11).is_err(), "past the end");
        let o = RemoteRegion { virt_addr: false, ..r.clone() };
        assert_eq!(o.target(2048, 0).unwrap(), (0, 9));
        let mut bytes = r.to_bytes();
        bytes.pop();
        assert!(RemoteRegion::from_bytes(&bytes).is_err());
    }
}
