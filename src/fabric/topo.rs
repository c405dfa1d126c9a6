//! NIC selection: which libfabric domain (NIC) each endpoint opens, from the PCI topology.
//!
//! A multi-NIC host (AWS P5: 8 GPUs, 32 EFA devices, 4 behind each GPU's PCIe switch) lists one
//! `fi_info` domain per NIC. Taking the first for every rank would put all GPUs' traffic on one
//! NIC and send it across the CPU's interconnect. Here each candidate NIC is ranked by its PCI
//! distance to the rank's GPU, read from sysfs:
//!
//! 1. the longest shared PCI path (`/sys/devices/pci0000:xx/<port>/<switch>/...`): sharing a
//!    bridge below the root complex = the same PCIe switch; sharing only `pci0000:xx` = the same
//!    root complex;
//! 2. then the same NUMA node (`numa_node`);
//! 3. then any other, and last the NICs whose place is unknown.
//!
//! The NICs tied for nearest are the rank's set; its endpoints (proxy workers) take them
//! round-robin ([`Placement`]). `FEP_NICS` replaces the automatic choice ([`NicsOverride`]).
//! The sysfs root is `FEP_SYSFS_ROOT` (default `/sys`), so tests build a fake tree.

use std::cmp::Reverse;
use std::path::{Path, PathBuf};

use super::error::{FabricError, Result};

/// Where one endpoint is opened: the rank's GPU and which of the rank's endpoints it is.
#[derive(Clone, Debug)]
pub struct Placement {
    /// The global rank, for the log lines (`None`: not known yet).
    pub rank: Option<usize>,
    /// The rank's index among its node's ranks: shifts the round-robin, so ranks that share a set
    /// of NICs (no GPU known, or several GPUs behind one switch) spread over it.
    pub local_rank: usize,
    /// The GPU's PCI address (`0000:53:00.0`, any case, 4- or 8-digit domain); `None` on the
    /// host backend, where every NIC is equally near.
    pub gpu_pci: Option<String>,
    /// This endpoint's index among the rank's endpoints of one lane (a proxy worker).
    pub lane: usize,
    /// The rank's endpoints in that lane (at least 1).
    pub lanes: usize,
}

impl Default for Placement {
    fn default() -> Self {
        Placement { rank: None, local_rank: 0, gpu_pci: None, lane: 0, lanes: 1 }
    }
}

impl Placement {
    /// Endpoint `lane` of `lanes` of the same rank.
    pub fn lane(&self, lane: usize, lanes: usize) -> Placement {
        Placement { lane, lanes, ..self.clone() }
    }
    /// Which entry of a set of `n` NICs this endpoint takes when the set is shared by the node's
    /// ranks: endpoint `lane` of local rank `l` takes `(l * lanes + lane) mod n`.
    fn shared_index(&self, n: usize) -> usize {
        (self.local_rank * self.lanes.max(1) + self.lane) % n.max(1)
    }
}

/// How near a NIC is to the GPU, best first (the derived order).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Proximity {
    /// Behind the same PCIe switch (shares a bridge below the root complex).
    SameSwitch,
    /// Under the same root complex (`pci0000:xx`), through different switches.
    SameRootComplex,
    /// On the same NUMA node, under another root complex.
    SameNuma,
    /// Elsewhere: another socket.
    Far,
    /// Where either the GPU or the NIC has no place in sysfs (or no GPU is known).
    Unknown,
}

impl Proximity {
    pub fn describe(self) -> &'static str {
        match self {
            Proximity::SameSwitch => "same PCIe switch as the GPU",
            Proximity::SameRootComplex => "same PCIe root complex as the GPU",
            Proximity::SameNuma => "same NUMA node as the GPU",
            Proximity::Far => "another NUMA node than the GPU",
            Proximity::Unknown => "no PCI topology known",
        }
    }
}

/// A normalised PCI address, `dddd:bb:dd.f` in lower case (`None` when `s` is not one).
pub fn normalize_bdf(s: &str) -> Option<String> {
    let s = s.trim();
    let (dom, rest) = match s.matches(':').count() {
        2 => s.split_once(':')?,
        1 => ("0", s),
        _ => return None,
    };
    let (bus, rest) = rest.split_once(':')?;
    let (dev, func) = rest.split_once('.')?;
    let hex = |v: &str, max: u32| {
        (!v.is_empty() && v.len() <= 8)
            .then(|| u32::from_str_radix(v, 16).ok())
            .flatten()
            .filter(|&x| x <= max)
    };
    Some(format!(
        "{:04x}:{:02x}:{:02x}.{:x}",
        hex(dom, 0xffff)?,
        hex(bus, 0xff)?,
        hex(dev, 0x1f)?,
        hex(func, 0x7)?
    ))
}

/// The PCI topology as sysfs shows it under `root`.
#[derive(Clone, Debug)]
pub struct Sysfs {
    root: PathBuf,
}

/// Where one PCI device sits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PciPlace {
    pub bdf: String,
    /// Path components under `devices/`, from `pci0000:xx` down to the device itself.
    pub path: Vec<String>,
    pub numa_node: Option<i32>,
}

impl Sysfs {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Sysfs { root: root.into() }
    }

    /// `FEP_SYSFS_ROOT`, else `/sys`.
    pub fn from_env() -> Self {
        Self::new(std::env::var_os("FEP_SYSFS_ROOT").unwrap_or_else(|| "/sys".into()))
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Where the PCI device `bdf` sits (`None`: sysfs does not list it).
    pub fn place(&self, bdf: &str) -> Option<PciPlace> {
        let bdf = normalize_bdf(bdf)?;
        let link = self.root.join("bus/pci/devices").join(&bdf);
        let dev = std::fs::canonicalize(&link).ok()?;
        let devices = std::fs::canonicalize(self.root.join("devices")).ok()?;
        let rel = dev.strip_prefix(&devices).ok()?;
        let path: Vec<String> =
            rel.components().map(|c| c.as_os_str().to_string_lossy().into_owned()).collect();
        if path.is_empty() {
            return None;
        }
        let numa_node = std::fs::read_to_string(dev.join("numa_node"))
            .ok()
            .and_then(|s| s.trim().parse::<i32>().ok())
            .filter(|&n| n >= 0);
        Some(PciPlace { bdf, path, numa_node })
    }

    /// The PCI address of the device behind a libfabric domain name: an RDMA device
    /// (`class/infiniband/<dev>`, EFA's domains are `<dev>-rdm` / `<dev>-dgrm`) or a network
    /// interface (`class/net/<if>`, as tcp's domains are named).
    pub fn domain_bdf(&self, domain: &str) -> Option<String> {
        let base = base_name(domain);
        let names = if base == domain { vec![domain] } else { vec![domain, base] };
        for name in names {
            for class in ["class/infiniband", "class/net"] {
                let link = self.root.join(class).join(name).join("device");
                if let Ok(dev) = std::fs::canonicalize(&link) {
                    if let Some(b) =
                        dev.file_name().and_then(|f| normalize_bdf(&f.to_string_lossy()))
                    {
                        return Some(b);
                    }
                }
            }
        }
        None
    }
}

/// A domain name less the endpoint-type suffix EFA adds (`rdmap16s27-rdm` -> `rdmap16s27`).
fn base_name(domain: &str) -> &str {
    for suffix in ["-rdm", "-dgrm"] {
        if let Some(b) = domain.strip_suffix(suffix) {
            if !b.is_empty() {
                return b;
            }
        }
    }
    domain
}

/// How near `nic` is to `gpu`, with the length of their shared PCI path (a tie-breaker: longer
/// is nearer).
pub fn proximity(gpu: Option<&PciPlace>, nic: Option<&PciPlace>) -> (Proximity, usize) {
    let (Some(g), Some(n)) = (gpu, nic) else { return (Proximity::Unknown, 0) };
    // Shared components above both devices (the devices themselves are never shared).
    let above = g.path.len().min(n.path.len()).saturating_sub(1);
    let shared = g.path.iter().zip(&n.path).take(above).take_while(|(a, b)| a == b).count();
    let p = if shared >= 2 {
        Proximity::SameSwitch
    } else if shared == 1 {
        Proximity::SameRootComplex
    } else if g.numa_node.is_some() && g.numa_node == n.numa_node {
        Proximity::SameNuma
    } else if g.numa_node.is_some() && n.numa_node.is_some() {
        Proximity::Far
    } else {
        Proximity::Unknown
    };
    (p, shared)
}

/// One NIC libfabric offers: its domain name and, when the provider reports it (`fi_info`'s
/// `nic->bus_attr`), its PCI address.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NicCandidate {
    pub domain: String,
    pub pci: Option<String>,
}

/// A ranked NIC.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankedNic {
    /// Index into the candidates given to [`rank_nics`].
    pub index: usize,
    pub domain: String,
    pub pci: Option<String>,
    pub proximity: Proximity,
    pub shared_path: usize,
}

/// Every candidate ranked by distance to `gpu_pci`, nearest first; ties keep libfabric's order
/// (a stable sort), so every rank of a node computes the same order.
pub fn rank_nics(sysfs: &Sysfs, gpu_pci: Option<&str>, nics: &[NicCandidate]) -> Vec<RankedNic> {
    let gpu = gpu_pci.and_then(|b| sysfs.place(b));
    let mut out: Vec<RankedNic> = nics
        .iter()
        .enumerate()
        .map(|(index, c)| {
            let pci =
                c.pci.as_deref().and_then(normalize_bdf).or_else(|| sysfs.domain_bdf(&c.domain));
            let place = pci.as_deref().and_then(|b| sysfs.place(b));
            let (proximity, shared_path) = proximity(gpu.as_ref(), place.as_ref());
            RankedNic { index, domain: c.domain.clone(), pci, proximity, shared_path }
        })
        .collect();
    out.sort_by_key(|n| (n.proximity, Reverse(n.shared_path)));
    out
}

/// The NICs tied for nearest (never empty when `nics` is not).
pub fn nearest(ranked: &[RankedNic]) -> Vec<RankedNic> {
    let Some(best) = ranked.first() else { return Vec::new() };
    let key = (best.proximity, best.shared_path);
    ranked.iter().take_while(|n| (n.proximity, n.shared_path) == key).cloned().collect()
}

/// `FEP_NICS`, parsed.
///
/// Syntax: unset, empty or `auto`: the automatic choice. A comma list of domain names
/// (`rdmap16s27-rdm,rdmap32s27-rdm`; EFA's `-rdm` suffix may be left off): every rank of the
/// node uses that list, shifted by its local rank like an automatic set. Per local rank:
/// `0:rdmap16s27,rdmap32s27;1:rdmap48s27;...`: local rank `l` uses its own list (not shifted),
/// a local rank not named chooses automatically; `auto` may stand for a list
/// (`0:auto;1:rdmap48s27`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NicsOverride {
    Auto,
    /// One list for every local rank.
    All(Vec<String>),
    /// `(local rank, list)`; `None` = automatic for that rank.
    PerRank(Vec<(usize, Option<Vec<String>>)>),
}

const NICS_VAR: &str = "FEP_NICS";

fn bad_nics(msg: impl Into<String>) -> FabricError {
    FabricError::arg(NICS_VAR, msg)
}

impl NicsOverride {
    /// `FEP_NICS` from the environment.
    pub fn from_env() -> Result<Self> {
        Self::parse(std::env::var(NICS_VAR).ok().as_deref())
    }

    pub fn parse(v: Option<&str>) -> Result<Self> {
        let v = v.map(str::trim).unwrap_or("");
        if v.is_empty() || v.eq_ignore_ascii_case("auto") {
            return Ok(NicsOverride::Auto);
        }
        let list = |s: &str| -> Result<Option<Vec<String>>> {
            let s = s.trim();
            if s.eq_ignore_ascii_case("auto") {
                return Ok(None);
            }
            let names: Vec<String> = s.split(',').map(|n| n.trim().to_string()).collect();
            if names.iter().any(|n| n.is_empty()) {
                return Err(bad_nics(format!("{v:?}: an empty name in the list {s:?}")));
            }
            Ok(Some(names))
        };
        if !v.contains(':') {
            return Ok(match list(v)? {
                Some(names) => NicsOverride::All(names),
                None => NicsOverride::Auto,
            });
        }
        let mut per = Vec::new();
        for part in v.split(';').map(str::trim).filter(|p| !p.is_empty()) {
            let (l, names) = part.split_once(':').ok_or_else(|| {
                bad_nics(format!("{v:?}: {part:?} is not `LOCAL_RANK:name[,name...]`"))
            })?;
            let l: usize = l.trim().parse().map_err(|_| {
                bad_nics(format!("{v:?}: {:?} is not a local rank (a whole number)", l.trim()))
            })?;
            if per.iter().any(|(r, _)| *r == l) {
                return Err(bad_nics(format!("{v:?}: local rank {l} is given twice")));
            }
            per.push((l, list(names)?));
        }
        Ok(NicsOverride::PerRank(per))
    }

    /// The names for local rank `l` and whether they are shared by the node's ranks (`None`:
    /// automatic).
    fn names_for(&self, l: usize) -> Option<(&[String], bool)> {
        match self {
            NicsOverride::Auto => None,
            NicsOverride::All(n) => Some((n, true)),
            NicsOverride::PerRank(per) => per
                .iter()
                .find(|(r, _)| *r == l)
                .and_then(|(_, n)| n.as_deref())
                .map(|n| (n, false)),
        }
    }
}

/// What [`choose`] picked, with the reasons for the log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NicChoice {
    /// Index into the candidates.
    pub index: usize,
    pub chosen: RankedNic,
    /// The set the endpoint was sharded over (the chosen one among them).
    pub set: Vec<RankedNic>,
    /// True when `FEP_NICS` named the set.
    pub overridden: bool,
}

/// Picks the NIC for one endpoint: the `FEP_NICS` names (`nics`) for this local rank when given,
/// else the nearest set, then round-robin over the set by endpoint (see [`Placement`]). Fails,
/// naming `FEP_NICS`, when a name matches no candidate.
pub fn choose(
    sysfs: &Sysfs,
    nics: &NicsOverride,
    placement: &Placement,
    candidates: &[NicCandidate],
) -> Result<NicChoice> {
    if candidates.is_empty() {
        return Err(FabricError::arg("candidates", "no NIC to choose from"));
    }
    let ranked = rank_nics(sysfs, placement.gpu_pci.as_deref(), candidates);
    let (set, shared, overridden) = match nics.names_for(placement.local_rank) {
        Some((names, shared)) => {
            let mut set = Vec::with_capacity(names.len());
            for name in names {
                let found =
                    ranked.iter().find(|n| n.domain == *name || base_name(&n.domain) == name);
                match found {
                    Some(n) => set.push(n.clone()),
                    None => {
                        let mut have: Vec<&str> =
                            candidates.iter().map(|c| c.domain.as_str()).collect();
                        have.dedup();
                        return Err(bad_nics(format!(
                            "no NIC (libfabric domain) named {name:?} for this provider; \
                             available: {}",
                            have.join(", ")
                        )));
                    }
                }
            }
            (set, shared, true)
        }
        None => (nearest(&ranked), true, false),
    };
    let at = if shared { placement.shared_index(set.len()) } else { placement.lane % set.len() };
    let chosen = set[at].clone();
    Ok(NicChoice { index: chosen.index, chosen, set, overridden })
}
