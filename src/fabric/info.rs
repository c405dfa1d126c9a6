//! Provider discovery: `fi_getinfo` with the capabilities EP needs, and an owned `fi_info`.

use std::ffi::{CStr, CString};
use std::ptr;

use libfabric_sys as sys;

use super::error::{FabricError, Result};
use super::topo::{NicCandidate, NicChoice, NicsOverride, Placement, Sysfs};

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

/// Mode bits a provider may not require of this layer: `FI_RX_CQ_DATA` (a write carrying
/// remote CQ data would consume a posted receive at the target; the proxy posts none),
/// `FI_CONTEXT`/`FI_CONTEXT2` (op contexts are plain cookies, not provider-owned structs) and
/// `FI_MSG_PREFIX`. The hints ask for none, so `fi_getinfo` should return no entry needing one
/// (EFA's `efa-direct` fabric, which needs `FI_CONTEXT2`, is left out and its `efa` fabric is
/// used); an entry that sets one anyway is dropped rather than run against its contract.
pub(crate) const UNSUPPORTED_MODES: u64 =
    sys::FI_RX_CQ_DATA | sys::FI_CONTEXT | sys::FI_CONTEXT2 | sys::FI_MSG_PREFIX;

/// A bound on the packets one endpoint may have in flight, for a provider that cannot be
/// handed an unbounded burst ([`Info::burst_limit`]). Writes are counted in packets of at least
/// `packet_payload` bytes (a zero-length write is one packet).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BurstLimit {
    pub packets: u64,
    pub packet_payload: u64,
}

impl BurstLimit {
    /// Packets a write of `len` bytes takes (an upper bound: the header packet, then segments).
    pub fn packets_of(&self, len: u64) -> u64 {
        1 + len / self.packet_payload.max(1)
    }
}

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
        // We accept no mode bits (UNSUPPORTED_MODES says why): providers that insist on one
        // are filtered out by fi_getinfo, and `find` drops any entry that sets one anyway.
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
    let found = out.len();
    let needing: Vec<String> = out
        .iter()
        .filter(|i| i.mode() & UNSUPPORTED_MODES != 0)
        .map(|i| format!("{} needs mode {:#x}", i.domain_name(), i.mode() & UNSUPPORTED_MODES))
        .collect();
    let out: Vec<Info> = out
        .into_iter()
        .filter(|i| {
            i.cq_data_size() >= 4
                && (i.mr_mode() & !MR_MODES_SUPPORTED) == 0
                && i.mode() & UNSUPPORTED_MODES == 0
        })
        .collect();
    if out.is_empty() {
        let modes = if needing.is_empty() {
            String::new()
        } else {
            format!(
                " and no mode this layer cannot honour (FI_RX_CQ_DATA, FI_CONTEXT, FI_CONTEXT2, \
                 FI_MSG_PREFIX: {})",
                needing.join(", ")
            )
        };
        return Err(FabricError::NoProvider {
            provider: query.provider.clone().unwrap_or_else(|| "<any>".into()),
            hmem: query.hmem,
            text: format!(
                "{found} entries found, but none with >= 4 bytes of CQ data and supported \
                 mr_mode{modes}"
            ),
        });
    }
    Ok(out)
}

/// The entry for one endpoint placed by `placement`: among the domains (NICs) of the fabric
/// libfabric lists first (tcp lists loopback as a fabric of its own: never mixed in), the
/// nearest to the rank's GPU, or those `FEP_NICS` names, round-robin over the rank's
/// endpoints ([`super::topo`]). With one domain this is [`find_first`]'s entry. Logs the
/// choice at info (debug for the second and later endpoints), and a warning when the NIC is
/// not behind the GPU's PCIe switch.
pub fn select(query: &InfoQuery, placement: &Placement) -> Result<Info> {
    let nics = NicsOverride::from_env()?;
    select_with(find(query)?, &Sysfs::from_env(), &nics, placement)
}

/// [`select`] over given entries (`all`, in libfabric's order), sysfs root and `FEP_NICS`.
pub fn select_with(
    all: Vec<Info>,
    sysfs: &Sysfs,
    nics: &NicsOverride,
    placement: &Placement,
) -> Result<Info> {
    // One entry per domain: the first libfabric lists (its preferred attributes), of the first
    // entry's fabric unless FEP_NICS names a domain elsewhere.
    let first_fabric = all.first().map(|i| i.fabric_name()).unwrap_or_default();
    let mut entries: Vec<Info> = Vec::new();
    for info in all {
        if !entries.iter().any(|e| e.domain_name() == info.domain_name()) {
            entries.push(info);
        }
    }
    let (same, other): (Vec<Info>, Vec<Info>) =
        entries.into_iter().partition(|i| i.fabric_name() == first_fabric);
    let mut entries = same;
    if !matches!(nics, NicsOverride::Auto) {
        entries.extend(other);
    }
    if entries.len() == 1 && matches!(nics, NicsOverride::Auto) {
        let info = entries.swap_remove(0);
        log_choice(&info, placement, None);
        return Ok(info);
    }
    let candidates: Vec<NicCandidate> = entries
        .iter()
        .map(|i| NicCandidate { domain: i.domain_name(), pci: i.nic_pci() })
        .collect();
    let choice = super::topo::choose(sysfs, nics, placement, &candidates)?;
    let info = entries.swap_remove(choice.index);
    log_choice(&info, placement, Some(&choice));
    Ok(info)
}

fn log_choice(info: &Info, p: &Placement, choice: Option<&NicChoice>) {
    let who = match p.rank {
        Some(r) => format!("rank {r} (local {}) endpoint {}/{}", p.local_rank, p.lane, p.lanes),
        None => format!("endpoint {}/{}", p.lane, p.lanes),
    };
    let gpu = p.gpu_pci.as_deref().unwrap_or("none");
    let Some(c) = choice else {
        if p.lane == 0 {
            crate::fep_info!(
                target: "fabric_ep::fabric",
                "{who}: provider {} fabric {} domain {} (the only one in its fabric) mr_mode {:#x} hmem {}",
                info.provider(),
                info.fabric_name(),
                info.domain_name(),
                info.mr_mode(),
                info.hmem()
            );
        }
        return;
    };
    let set: Vec<&str> = c.set.iter().map(|n| n.domain.as_str()).collect();
    let why =
        if c.overridden { "FEP_NICS".to_string() } else { c.chosen.proximity.describe().into() };
    let line = format!(
        "{who}: provider {} fabric {} domain {} mr_mode {:#x} hmem {} (NIC {}, GPU {gpu}: \
         {why}; one of {}: {})",
        info.provider(),
        info.fabric_name(),
        info.domain_name(),
        info.mr_mode(),
        info.hmem(),
        c.chosen.pci.as_deref().unwrap_or("?"),
        c.set.len(),
        set.join(",")
    );
    if p.lane == 0 {
        crate::fep_info!(target: "fabric_ep::fabric", "{line}");
    } else {
        crate::fep_debug!(target: "fabric_ep::fabric", "{line}");
    }
    let far = p.gpu_pci.is_some()
        && !c.overridden
        && c.chosen.proximity != super::topo::Proximity::SameSwitch;
    if far && p.lane == 0 {
        crate::fep_warn!(
            target: "fabric_ep::fabric",
            "{who}: no NIC behind GPU {gpu}'s PCIe switch; using {} ({}): traffic crosses the \
             host's PCIe/CPU links",
            info.domain_name(),
            c.chosen.proximity.describe()
        );
    }
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
    /// The mode bits the entry requires: its own and its transmit and receive contexts'.
    pub fn mode(&self) -> u64 {
        let r = self.raw();
        // SAFETY: tx_attr and rx_attr, when set, point at the entry's own attributes.
        let ctx = unsafe {
            (if r.tx_attr.is_null() { 0 } else { (*r.tx_attr).mode })
                | (if r.rx_attr.is_null() { 0 } else { (*r.rx_attr).mode })
        };
        r.mode | ctx
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
    /// The bound on packets in flight per endpoint this provider needs, if any.
    /// `FEP_RXD_MAX_PACKETS` overrides it (0: none); a value that is not a number is an error.
    ///
    /// NOTES: `ofi_rxd` sends every packet its window allows at once (new writes, retransmits,
    /// the rest of a window an ack opened) and reads the completions of its datagram endpoint's
    /// queue (`tx_size + rx_size` entries) only in its progress calls. The `udp` provider of
    /// libfabric before 2.4 refuses a send into a full queue (rxd logs "error sending packet:
    /// -11") but writes a receive completion into it unchecked (fixed upstream: "prov/udp: fix
    /// CQ overflow case"), overwriting an unread entry: rxd then handles a packet twice or
    /// never and frees a packet buffer twice, and the writes it reports are garbled
    /// (target-side FI_ETRUNC, "Cannot process packet") or never complete. What the queue holds
    /// between two progress calls grows with the packets unacknowledged (each retransmit round
    /// resends them all, and every packet received, duplicates too, is acked with a send of its
    /// own), which the writes in flight bound: a sixteenth of `tx_size` keeps it far from full.
    /// The bound makes the overrun rare, not impossible: a receiver that stays busy with
    /// arrivals can still let acks pile up (libfabric 2.4 fixes the provider).
    pub fn burst_limit(&self) -> Result<Option<BurstLimit>> {
        if !self.provider().split(';').any(|p| p == "ofi_rxd") {
            return Ok(None);
        }
        let packets = match std::env::var("FEP_RXD_MAX_PACKETS") {
            Ok(v) => match v.trim().parse::<u64>() {
                Ok(0) => return Ok(None),
                Ok(n) => n,
                Err(_) => {
                    return Err(FabricError::arg(
                        "FEP_RXD_MAX_PACKETS",
                        format!("{v:?} is not a packet count (0 turns the bound off)"),
                    ))
                }
            },
            Err(_) => (self.tx_size() as u64 / 16).max(16),
        };
        // inject_size (the inline RMA payload) is below rxd's segment payload: an overestimate
        // of the packets, on the safe side.
        Ok(Some(BurstLimit { packets, packet_payload: (self.inject_size() as u64).max(256) }))
    }

    /// The NIC's PCI address when the provider reports it (`nic->bus_attr`), `dddd:bb:dd.f`.
    pub fn nic_pci(&self) -> Option<String> {
        // SAFETY: nic, when set, points at the provider's fid_nic for this entry, and bus_attr,
        // when set, at its bus attributes; both live as long as the entry.
        unsafe {
            let nic = self.raw().nic;
            if nic.is_null() || (*nic).bus_attr.is_null() {
                return None;
            }
            let bus = &*(*nic).bus_attr;
            if bus.bus_type != sys::fi_bus_type_FI_BUS_PCI {
                return None;
            }
            let p = bus.attr.pci;
            Some(format!(
                "{:04x}:{:02x}:{:02x}.{:x}",
                p.domain_id, p.bus_id, p.device_id, p.function_id
            ))
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mode_bit_of_the_receive_context_counts_as_required() {
        // SAFETY: a fresh fi_info from fi_allocinfo, owned (and freed) by `Info`.
        let info = Info { ptr: unsafe { sys::fi_allocinfo() } };
        assert!(!info.ptr.is_null());
        assert_eq!(info.mode() & UNSUPPORTED_MODES, 0);
        // SAFETY: fi_allocinfo allocates rx_attr.
        unsafe { (*(*info.ptr).rx_attr).mode = sys::FI_RX_CQ_DATA };
        assert_eq!(info.mode() & UNSUPPORTED_MODES, sys::FI_RX_CQ_DATA);
    }
}
