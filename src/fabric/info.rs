//! Provider discovery: `fi_getinfo` with the capabilities EP needs, and an owned `fi_info`.

use std::ffi::{CStr, CString};
use std::ptr;

use libfabric_sys as sys;

use super::error::{FabricError, Result};

/// The capabilities every EP endpoint asks for.
pub(crate) const EP_CAPS: u64 = (sys::FI_MSG as u64)
    | (sys::FI_RMA as u64)
    | (sys::FI_WRITE as u64)
    | (sys::FI_REMOTE_WRITE as u64)
    | (sys::FI_SEND as u64)
    | (sys::FI_RECV as u64);

/// Every memory-registration mode bit this layer knows how to honour. A provider may ask for any
/// subset; `FI_MR_RAW` (keys wider than 64 bits) is deliberately absent.
pub(crate) const MR_MODES_SUPPORTED: u32 = sys::FI_MR_LOCAL
    | sys::FI_MR_VIRT_ADDR
    | sys::FI_MR_ALLOCATED
    | sys::FI_MR_PROV_KEY
    | sys::FI_MR_ENDPOINT
    | sys::FI_MR_HMEM;

/// What to look for.
#[derive(Clone, Debug, Default)]
pub struct InfoQuery {
    /// A provider string as `fi_info -p` takes it (`shm`, `tcp`, `tcp;ofi_rxm`, `udp;ofi_rxd`,
    /// `efa`). `None` honours `FI_PROVIDER` (libfabric reads it) or takes the first match.
    pub provider: Option<String>,
    /// A domain (NIC) name, e.g. `rdmap16s27-rdm`; `None` = all domains.
    pub domain: Option<String>,
    /// Require `FI_HMEM` (registering GPU memory directly, as EFA with GPUDirect does).
    pub hmem: bool,
}

impl InfoQuery {
    pub fn provider(name: &str) -> Self {
        InfoQuery { provider: Some(name.to_string()), ..Default::default() }
    }
}

/// One owned `fi_info` entry (a `fi_dupinfo` copy), freed on drop.
pub struct Info {
    ptr: *mut sys::fi_info,
}

// SAFETY: an `Info` is an owned, immutable copy; libfabric does not touch it behind our back.
unsafe impl Send for Info {}
unsafe impl Sync for Info {}

impl Drop for Info {
    fn drop(&mut self) {
        // SAFETY: ptr came from fi_dupinfo and is freed exactly once.
        unsafe { sys::fi_freeinfo(self.ptr) }
    }
}

impl Clone for Info {
    fn clone(&self) -> Self {
        // SAFETY: ptr is a valid fi_info; fi_dupinfo deep-copies one entry.
        let ptr = unsafe { sys::fi_dupinfo(self.ptr) };
        assert!(!ptr.is_null(), "fi_dupinfo: out of memory");
        Info { ptr }
    }
}

impl std::fmt::Debug for Info {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Info")
            .field("provider", &self.provider())
            .field("domain", &self.domain_name())
            .field("mr_mode", &format_args!("{:#x}", self.mr_mode()))
            .field("hmem", &self.hmem())
            .finish()
    }
}

/// A hints struct from `fi_allocinfo`, freed on drop (also on early return).
struct Hints(*mut sys::fi_info);
impl Drop for Hints {
    fn drop(&mut self) {
        // SAFETY: allocated by fi_allocinfo; string fields we set were strdup'ed (malloc).
        unsafe { sys::fi_freeinfo(self.0) }
    }
}

fn strdup(s: &str, arg: &'static str) -> Result<*mut libc::c_char> {
    let c = CString::new(s).map_err(|_| FabricError::arg(arg, "contains a NUL byte"))?;
    // SAFETY: c is a valid C string; fi_freeinfo frees the copy with free().
    Ok(unsafe { libc::strdup(c.as_ptr()) })
}

/// The libfabric API version this crate was built against.
pub fn api_version() -> u32 {
    sys::make_version(sys::FI_MAJOR_VERSION, sys::FI_MINOR_VERSION)
}

/// The runtime library's version as "major.minor".
pub fn library_version() -> String {
    // SAFETY: fi_version takes no arguments.
    let v = unsafe { sys::fi_version() };
    format!("{}.{}", v >> 16, v & 0xffff)
}

/// All entries that offer RDM endpoints with the EP capabilities, in libfabric's order.
pub fn find(query: &InfoQuery) -> Result<Vec<Info>> {
    // SAFETY: plain allocation; every field we set below is owned by the hints struct.
    let hints = Hints(unsafe { sys::fi_allocinfo() });
    if hints.0.is_null() {
        return Err(FabricError::arg("hints", "fi_allocinfo returned NULL (out of memory)"));
    }
    unsafe {
        let h = &mut *hints.0;
        h.caps = EP_CAPS | if query.hmem { sys::FI_HMEM } else { 0 };
        // We accept no mode bits: no FI_CONTEXT (we pass plain cookies as op contexts) and no
        // FI_RX_CQ_DATA (remote CQ data must not consume posted receives). Providers that
        // insist on either are filtered out by fi_getinfo.
        h.mode = 0;
        h.addr_format = sys::FI_FORMAT_UNSPEC;
        (*h.ep_attr).type_ = sys::fi_ep_type_FI_EP_RDM;
        let d = &mut *h.domain_attr;
        d.mr_mode = MR_MODES_SUPPORTED as i32;
        d.threading = sys::fi_threading_FI_THREAD_SAFE;
        d.av_type = sys::fi_av_type_FI_AV_TABLE;
        if let Some(p) = &query.provider {
            (*h.fabric_attr).prov_name = strdup(p, "provider")?;
        }
        if let Some(dn) = &query.domain {
            d.name = strdup(dn, "domain")?;
        }
    }
    let mut list: *mut sys::fi_info = ptr::null_mut();
    // SAFETY: hints is valid; list receives a newly allocated list or stays NULL.
    let ret =
        unsafe { sys::fi_getinfo(api_version(), ptr::null(), ptr::null(), 0, hints.0, &mut list) };
    if ret < 0 || list.is_null() {
        let provider = query
            .provider
            .clone()
            .or_else(|| std::env::var("FI_PROVIDER").ok())
            .unwrap_or_else(|| "<any>".into());
        return Err(FabricError::NoProvider {
            provider,
            hmem: query.hmem,
            text: super::error::strerror(ret),
        });
    }
    let mut out = Vec::new();
    let mut cur = list;
    // SAFETY: walk the list fi_getinfo returned, duplicating each entry, then free the list.
    unsafe {
        while !cur.is_null() {
            let dup = sys::fi_dupinfo(cur);
            if !dup.is_null() {
                (*dup).next = ptr::null_mut();
                out.push(Info { ptr: dup });
            }
            cur = (*cur).next;
        }
        sys::fi_freeinfo(list);
    }
    let out: Vec<Info> = out
        .into_iter()
        .filter(|i| i.cq_data_size() >= 4 && (i.mr_mode() & !MR_MODES_SUPPORTED) == 0)
        .collect();
    if out.is_empty() {
        return Err(FabricError::NoProvider {
            provider: query.provider.clone().unwrap_or_else(|| "<any>".into()),
            hmem: query.hmem,
            text: "entries found, but none with >= 4 bytes of CQ data and supported mr_mode".into(),
        });
    }
    Ok(out)
}

/// The first entry [`find`] returns.
pub fn find_first(query: &InfoQuery) -> Result<Info> {
    // `find` never returns an empty list.
    Ok(find(query)?.swap_remove(0))
}

fn cstr(p: *const libc::c_char) -> String {
    if p.is_null() {
        String::new()
    } else {
        // SAFETY: libfabric strings are NUL-terminated.
        unsafe { CStr::from_ptr(p).to_string_lossy().into_owned() }
    }
}

impl Info {
    pub fn as_raw(&self) -> *mut sys::fi_info {
        self.ptr
    }
    fn raw(&self) -> &sys::fi_info {
        // SAFETY: ptr is a valid fi_info for self's lifetime.
        unsafe { &*self.ptr }
    }
    fn domain_attr(&self) -> &sys::fi_domain_attr {
        // SAFETY: fi_getinfo always fills domain_attr.
        unsafe { &*self.raw().domain_attr }
    }
    /// Provider string, e.g. `shm` or `tcp;ofi_rxm`.
    pub fn provider(&self) -> String {
        // SAFETY: fabric_attr is always present in returned entries.
        cstr(unsafe { (*self.raw().fabric_attr).prov_name })
    }
    pub fn fabric_name(&self) -> String {
        cstr(unsafe { (*self.raw().fabric_attr).name })
    }
    pub fn domain_name(&self) -> String {
        cstr(self.domain_attr().name)
    }
    pub fn caps(&self) -> u64 {
        self.raw().caps
    }
    /// True when GPU memory can be registered directly (`FI_HMEM`).
    pub fn hmem(&self) -> bool {
        self.caps() & sys::FI_HMEM != 0
    }
    pub fn mr_mode(&self) -> u32 {
        self.domain_attr().mr_mode as u32
    }
    pub fn mr_key_size(&self) -> usize {
        self.domain_attr().mr_key_size
    }
    /// Bytes of immediate data a write may carry (EFA: 4).
    pub fn cq_data_size(&self) -> usize {
        self.domain_attr().cq_data_size
    }
    pub fn max_msg_size(&self) -> usize {
        // SAFETY: ep_attr is always present in returned entries.
        unsafe { (*self.raw().ep_attr).max_msg_size }
    }
    pub fn inject_size(&self) -> usize {
        // SAFETY: tx_attr is always present in returned entries.
        unsafe { (*self.raw().tx_attr).inject_size }
    }
    pub fn tx_size(&self) -> usize {
        unsafe { (*self.raw().tx_attr).size }
    }
    pub fn rx_size(&self) -> usize {
        unsafe { (*self.raw().rx_attr).size }
    }
    /// The largest single memory region this layer registers on this provider; larger buffers
    /// are registered in chunks of this size. `FEP_MR_MAX_BYTES` overrides it.
    ///
    /// NOTES: libfabric 1.x exposes no per-region size limit in `fi_info`; EFA's devices cap a
    /// region (DeepEP-style libraries failed past it), so the default is a conservative 1 GiB
    /// everywhere, a power of two so slot layouts can divide it.
    pub fn max_region_bytes(&self) -> usize {
        if let Some(v) = std::env::var("FEP_MR_MAX_BYTES").ok().and_then(|v| v.parse().ok()) {
            return v;
        }
        1 << 30
    }
    /// A one-line human description.
    pub fn describe(&self) -> String {
        format!(
            "provider={} fabric={} domain={} mr_mode={:#x} cq_data={}B hmem={} max_msg={}",
            self.provider(),
            self.fabric_name(),
            self.domain_name(),
            self.mr_mode(),
            self.cq_data_size(),
            self.hmem(),
            self.max_msg_size()
        )
    }
}
