//! Normal mode's internode lane on the GPU: peers on other nodes are reached through the CPU
//! proxy (libfabric RMA writes with immediate data) instead of device pointers.
//!
//! Per rank: registered send and receive regions with the host backend's geometry
//! ([`Geometry`]: `R x spp` data slots and two-deep notify records, packed per MR chunk), one
//! command ring per kernel block (block `b` of whichever normal kernel runs pushes into ring
//! `b`), the proxy's counters, and proxy workers (one by default, `FEP_GPU_PROXY_WORKERS`),
//! each over its own [`FabricTransport`] whose peers are the other-node ranks only. The kernels' side of the protocol is in `fep_abi.h`
//! (`fep_normal_proxy`): a sender stages a chunk in its send region and pushes one command
//! (write + immediate `data(src, slot) | rows`), the receiver waits (bounded) on the slot's
//! arrival counter and reads the receive region, and returns a zero-length credit per slot.
//!
//! Where the regions live ([`RegionKind::select`]):
//! - the provider reports `FI_HMEM` (EFA with GPUDirect RDMA, `fi_efa(7)`): device memory,
//!   registered with `FI_HMEM_CUDA` (`fi_mr(3)` `iface`/`device.cuda`): the kernel stages and
//!   reads at device-memory speed and the NIC reads/writes GPU memory directly. Not testable on
//!   the one-GPU machine (shm/tcp have no CUDA HMEM there).
//! - otherwise (shm, tcp;ofi_rxm here): pinned host memory mapped into the GPU, registered with
//!   libfabric as host memory; the kernel writes and reads it over PCIe. Two ways to get it:
//!   `cuMemHostAlloc(DEVICEMAP)` ([`RegionKind::MappedHost`], the default, measured) or ordinary
//!   anonymous pages pinned with `cuMemHostRegister(DEVICEMAP)` ([`RegionKind::RegisteredHost`],
//!   `FEP_GPU_PROXY_HOSTMEM=register`: an experiment on whether the shm provider's
//!   cross-process copy is faster on ordinary pages; built, not yet run on the GPU).
//!
//! NOTES: the wire protocol mirrors the host backend's (same geometry, same data immediate
//! `slot id | rows`, same notify record `[seq, tokens, per-expert]` and two-deep notify slots, no
//! notify ack) with one difference: credits are per (source, slot) zero-length writes instead of
//! a count per source, because the GPU combine frees chunks out of order (any warp may finish a
//! chunk's last token), so "n chunks credited" would not say which slot is free.

use std::sync::Arc;
use std::time::Duration;

use super::super::connect::exchange_fabric;
use super::super::host::Geometry;
use super::super::normal_comm::{CommMap, NormalGpuSettings};
use crate::abi;
use crate::bootstrap::Bootstrap;
use crate::cuda::{Device, DeviceBuffer, HostMapped};
use crate::fabric::{Info, InfoQuery, MemKind, MemoryRegion, Placement, Stack};
use crate::proxy::{
    CounterLayout, CounterMemory, FabricTransport, Proxy, ProxyConfig, RingLayout, RingMemory,
    SharedRegion,
};
use crate::{Error, Result};

/// Immediate value bits of the lane (18 bits of slot id, as every lane).
const VALUE_BITS: u32 = crate::protocol::plan::IMM_VALUE_BITS;

/// Where the registered send/receive regions live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RegionKind {
    /// `cuMemHostAlloc(DEVICEMAP)` memory, registered as host memory.
    MappedHost,
    /// Anonymous pages pinned and mapped with `cuMemHostRegister(DEVICEMAP)`, registered as host
    /// memory.
    RegisteredHost,
    /// Device memory registered through `FI_HMEM_CUDA`.
    Device,
}

impl RegionKind {
    /// Device memory when the provider reports `FI_HMEM` (and `FEP_GPU_PROXY_HMEM` is not `0`),
    /// else host memory: `cuMemHostAlloc` memory, or registered anonymous pages with
    /// `FEP_GPU_PROXY_HOSTMEM=register`.
    pub fn select(info: &Info) -> RegionKind {
        let off = std::env::var("FEP_GPU_PROXY_HMEM").is_ok_and(|v| v == "0");
        if info.hmem() && !off {
            RegionKind::Device
        } else if std::env::var("FEP_GPU_PROXY_HOSTMEM").is_ok_and(|v| v == "register") {
            RegionKind::RegisteredHost
        } else {
            RegionKind::MappedHost
        }
    }
}

/// Anonymous host pages (mmap), pinned and mapped into the GPU with `cuMemHostRegister`;
/// unregistered and unmapped on drop.
struct RegisteredHost {
    dev: Device,
    ptr: *mut u8,
    len: usize,
    dptr: u64,
}

// SAFETY: plain memory owned by this value; every concurrent access goes through the proxy's
// and the kernels' protocol (no Rust references into it).
unsafe impl Send for RegisteredHost {}
// SAFETY: as above.
unsafe impl Sync for RegisteredHost {}

impl RegisteredHost {
    fn new(dev: &Device, len: usize) -> Result<Self> {
        use cudarc::driver::sys;
        dev.bind()?;
        let len = len.max(1).div_ceil(4096) * 4096;
        // SAFETY: a fresh private anonymous mapping (zero-filled by the kernel).
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(Error::Other(format!(
                "mmap of {len} bytes for the proxy lane failed: {}",
                std::io::Error::last_os_error()
            )));
        }
        let flags = sys::CU_MEMHOSTREGISTER_DEVICEMAP | sys::CU_MEMHOSTREGISTER_PORTABLE;
        // SAFETY: `p` is `len` bytes of our own mapping; the context is bound.
        let reg = crate::cuda::driver::check("cuMemHostRegister", unsafe {
            sys::cuMemHostRegister_v2(p, len, flags)
        });
        if let Err(e) = reg {
            // SAFETY: our mapping, registered with nobody.
            unsafe { libc::munmap(p, len) };
            return Err(e.into());
        }
        let mut m = RegisteredHost { dev: dev.clone(), ptr: p.cast(), len, dptr: 0 };
        let mut d: sys::CUdeviceptr = 0;
        // SAFETY: `p` is registered with DEVICEMAP; out-pointer valid.
        crate::cuda::driver::check("cuMemHostGetDevicePointer", unsafe {
            sys::cuMemHostGetDevicePointer_v2(&mut d, p, 0)
        })?;
        m.dptr = d;
        Ok(m)
    }
}

impl Drop for RegisteredHost {
    fn drop(&mut self) {
        let _ = self.dev.bind();
        // SAFETY: registered and mapped by `new`; nobody uses it any more (the lane drops its
        // registrations and the proxy first).
        unsafe {
            let _ = cudarc::driver::sys::cuMemHostUnregister(self.ptr.cast());
            libc::munmap(self.ptr.cast(), self.len);
        }
    }
}

/// Settings of the lane (the same on every rank).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProxyLaneSettings {
    /// libfabric provider (`shm`, `tcp;ofi_rxm`, `efa`).
    pub provider: String,
    /// Ranks per node: peers with another `rank / ranks_per_node` go through the proxy.
    pub ranks_per_node: usize,
    /// Entries of each block's ring.
    pub ring_capacity: u32,
    /// Proxy workers of the lane, each with its own endpoint (its own fabric stack): ring `b`
    /// is drained by worker `b % workers`, which writes to worker `b % workers` of the peer.
    /// Every rank must use the same number (checked at connect).
    pub workers: usize,
}

/// Default proxy workers per lane when `FEP_GPU_PROXY_WORKERS` is not set. Measured on the H200
/// (2 processes x 1 rank per node, shm, 4096 tokens, hidden 7168, chunk 32 x 16 slots;
/// `gpu_normal_proxy_bench`): dispatch through the proxy 3.8 GB/s with 1 worker, 10.7 with 4,
/// 10.6 with 6; 8 workers (16 spinning threads on that 16-core host) were unsteady. Each worker
/// is a spinning thread per rank: more only pay where the provider's copies run on the CPU (shm,
/// tcp).
pub const DEFAULT_PROXY_WORKERS: usize = 4;
/// Most proxy workers per lane.
pub const MAX_PROXY_WORKERS: usize = 16;

impl ProxyLaneSettings {
    /// 128-entry rings; workers from `FEP_GPU_PROXY_WORKERS` (1 to 16), else
    /// [`DEFAULT_PROXY_WORKERS`].
    pub fn new(provider: &str, ranks_per_node: usize) -> Result<Self> {
        Ok(ProxyLaneSettings {
            provider: provider.to_string(),
            ranks_per_node,
            ring_capacity: 128,
            workers: workers_from_env(std::env::var("FEP_GPU_PROXY_WORKERS").ok().as_deref())?,
        })
    }
}

/// `FEP_GPU_PROXY_WORKERS`'s value (unset: the default).
fn workers_from_env(v: Option<&str>) -> Result<usize> {
    parse_workers("FEP_GPU_PROXY_WORKERS", v, DEFAULT_PROXY_WORKERS)
}

/// A proxy-worker count from environment variable `name`'s value `v` (unset: `default`):
/// a whole number from 1 to [`MAX_PROXY_WORKERS`], else an error naming the variable.
pub(crate) fn parse_workers(name: &'static str, v: Option<&str>, default: usize) -> Result<usize> {
    let Some(v) = v else { return Ok(default) };
    match v.trim().parse::<usize>() {
        Ok(n) if (1..=MAX_PROXY_WORKERS).contains(&n) => Ok(n),
        _ => Err(Error::arg(name, format!("{v:?}: a whole number from 1 to {MAX_PROXY_WORKERS}"))),
    }
}

/// The bitmask of `rank`'s peers on other nodes.
pub fn other_node_mask(rank: usize, num_ranks: usize, ranks_per_node: usize) -> Result<u32> {
    if ranks_per_node == 0 || num_ranks % ranks_per_node != 0 || num_ranks > 32 {
        return Err(Error::arg(
            "ranks_per_node",
            format!("{ranks_per_node} must divide num_ranks {num_ranks} (at most 32 ranks)"),
        ));
    }
    let node = rank / ranks_per_node;
    Ok((0..num_ranks).filter(|p| p / ranks_per_node != node).fold(0u32, |m, p| m | (1 << p)))
}

enum RegionMem {
    Host(HostMapped),
    Registered(RegisteredHost),
    Device(DeviceBuffer),
}

impl RegionMem {
    fn alloc(dev: &Device, kind: RegionKind, len: usize) -> Result<Self> {
        Ok(match kind {
            RegionKind::MappedHost => {
                let m = HostMapped::new(dev, len)?;
                // SAFETY: `m` is `len` bytes of host memory nobody else uses yet.
                unsafe { std::ptr::write_bytes(m.as_ptr(), 0, m.len()) };
                RegionMem::Host(m)
            }
            RegionKind::RegisteredHost => RegionMem::Registered(RegisteredHost::new(dev, len)?),
            RegionKind::Device => RegionMem::Device(DeviceBuffer::zeroed(dev, len)?),
        })
    }
    fn device_ptr(&self) -> u64 {
        match self {
            RegionMem::Host(m) => m.device_ptr(),
            RegionMem::Registered(m) => m.dptr,
            RegionMem::Device(b) => b.device_ptr(),
        }
    }
    fn len(&self) -> usize {
        match self {
            RegionMem::Host(m) => m.len(),
            RegionMem::Registered(m) => m.len,
            RegionMem::Device(b) => b.len(),
        }
    }
    /// The address libfabric registers: the host pointer, or the device pointer for HMEM.
    fn reg_ptr(&self) -> *mut u8 {
        match self {
            RegionMem::Host(m) => m.as_ptr(),
            RegionMem::Registered(m) => m.ptr,
            RegionMem::Device(b) => b.device_ptr() as usize as *mut u8,
        }
    }
    fn mem_kind(&self, dev: &Device) -> MemKind {
        match self {
            RegionMem::Host(_) | RegionMem::Registered(_) => MemKind::Host,
            RegionMem::Device(_) => MemKind::Cuda { device: dev.ordinal() as i32 },
        }
    }
}

/// Mapped host memory as a proxy [`SharedRegion`] (kept alive by it), plus its GPU address.
fn mapped_region(dev: &Device, len: usize) -> Result<(SharedRegion, u64)> {
    let m = HostMapped::new(dev, len)?;
    // SAFETY: fresh host memory nobody else uses yet.
    unsafe { std::ptr::write_bytes(m.as_ptr(), 0, m.len()) };
    let (ptr, dptr) = (m.as_ptr(), m.device_ptr());
    // SAFETY: `m` is `len` bytes of pinned memory, valid from any thread until it drops, which
    // happens when the region (its keepalive owner) drops.
    let region = unsafe { SharedRegion::from_raw(ptr, len, Box::new(m)) }?;
    Ok((region, dptr))
}

/// One rank's proxy lane of normal mode (see the module docs).
pub struct NormalProxyLane {
    rank: usize,
    mask: u32,
    kind: RegionKind,
    geo: Geometry,
    abi: abi::fep_normal_proxy,
    provider: String,
    // NOTES: field order is drop order: the proxy (its worker holds the transport, the send
    // registration and the endpoint) stops first, then the receive registration, the stack,
    // and only then the memory the registrations name.
    proxy: Proxy,
    counters: CounterMemory,
    _rings: RingMemory,
    _recv_mrs: Vec<MemoryRegion>,
    _stacks: Vec<Stack>,
    _send: Arc<RegionMem>,
    _recv: Arc<RegionMem>,
}

impl std::fmt::Debug for NormalProxyLane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NormalProxyLane")
            .field("rank", &self.rank)
            .field("mask", &format_args!("{:#x}", self.mask))
            .field("kind", &self.kind)
            .field("provider", &self.provider)
            .finish()
    }
}

/// Header every rank publishes: the lane's shape, which must be equal everywhere.
fn header(s: &NormalGpuSettings, l: &ProxyLaneSettings, bytes: u64) -> Vec<u8> {
    let mut h = Vec::with_capacity(48);
    for v in [
        s.num_ranks as u64,
        s.chunk_tokens as u64,
        s.slots_per_peer as u64,
        l.ranks_per_node as u64,
        l.ring_capacity as u64,
        bytes,
        l.workers as u64,
    ] {
        h.extend_from_slice(&v.to_le_bytes());
    }
    h
}

impl NormalProxyLane {
    /// Opens the provider (one stack per worker), allocates the regions and registers them with
    /// every stack, exchanges them with every rank through `boot`, starts the proxy (`l.workers`
    /// workers, `num_rings` rings: the most blocks any normal kernel of this rank launches) and
    /// waits until every rank's proxy runs.
    ///
    /// NOTES (several workers): a worker's thread both posts its rings' writes and progresses
    /// its endpoint, and on shm the receiving side's progress copies each write's bytes
    /// (cross-memory attach); one thread then bounds the lane at one CPU copy stream of data the
    /// GPU just wrote (not in the CPU's caches). Workers share the arrival counters (atomic adds)
    /// and the rings are split between them, so chunks of different blocks move in parallel.
    /// Collective: every rank of the group calls it (also ranks whose peers are all local).
    pub fn connect(
        dev: &Device,
        boot: &dyn Bootstrap,
        s: &NormalGpuSettings,
        l: &ProxyLaneSettings,
        num_rings: u32,
    ) -> Result<NormalProxyLane> {
        let (rank, r) = (boot.rank(), s.num_ranks);
        if boot.world_size() != r {
            return Err(Error::arg(
                "boot",
                format!("bootstrap of {} ranks, settings have {r}", boot.world_size()),
            ));
        }
        if l.ring_capacity == 0 || l.ring_capacity % 4 != 0 {
            return Err(Error::arg(
                "ring_capacity",
                format!("{}: a positive multiple of 4", l.ring_capacity),
            ));
        }
        if !(1..=MAX_PROXY_WORKERS).contains(&l.workers) {
            return Err(Error::arg(
                "workers",
                format!("{}: from 1 to {MAX_PROXY_WORKERS}", l.workers),
            ));
        }
        let mask = other_node_mask(rank, r, l.ranks_per_node)?;
        let map = CommMap::new(s)?;
        let layout = map.layout;
        let query = InfoQuery::provider(&l.provider);
        // Worker w on the NIC select gives endpoint w of this rank (nearest the GPU, round-robin).
        let place = Placement {
            rank: Some(rank),
            local_rank: rank % l.ranks_per_node.max(1),
            gpu_pci: dev.pci_bus_id().ok(),
            lane: 0,
            lanes: l.workers,
        };
        let stacks = (0..l.workers)
            .map(|w| Stack::open_placed(&query, r, &place.lane(w, l.workers)).map_err(Error::from))
            .collect::<Result<Vec<_>>>()?;
        let stride = stacks[0].info.max_region_bytes().max(4096) as u64;
        let geo = Geometry::new(&layout, stride)?;
        let kind = RegionKind::select(&stacks[0].info);
        let prov = stacks[0].info.provider();
        if kind != RegionKind::Device && prov.starts_with("efa") {
            crate::fep_warn!(
                "normal proxy lane: {prov} without GPU memory registration (FI_HMEM {}): staging \
                 through host memory ({kind:?})",
                if stacks[0].info.hmem() { "off by FEP_GPU_PROXY_HMEM=0" } else { "not offered" }
            );
        }
        crate::fep_info!(
            "normal proxy lane: {} workers, send and receive regions of {} bytes each in {kind:?} \
             memory, ring capacity {}",
            l.workers,
            geo.bytes,
            l.ring_capacity
        );
        let send = Arc::new(RegionMem::alloc(dev, kind, geo.bytes as usize)?);
        let recv = Arc::new(RegionMem::alloc(dev, kind, geo.bytes as usize)?);
        let hdr = header(s, l, geo.bytes);
        let mut transports = Vec::with_capacity(l.workers);
        let mut recv_mrs = Vec::with_capacity(l.workers);
        for stack in &stacks {
            // SAFETY: both regions outlive their registrations (field order of the lane; the
            // send registrations live in the transports, which the proxy drops first).
            let send_mr = Arc::new(unsafe {
                stack.register(send.reg_ptr(), send.len(), send.mem_kind(dev))?
            });
            let recv_mr =
                unsafe { stack.register(recv.reg_ptr(), recv.len(), recv.mem_kind(dev))? };
            let fp = exchange_fabric(boot, stack, &recv_mr.remote(), &hdr, geo.bytes)?;
            for (peer, h) in fp.headers.iter().enumerate() {
                if *h != hdr {
                    return Err(Error::ConfigMismatch(format!(
                        "rank {peer}'s normal proxy lane (ranks, chunk, slots, ranks_per_node, \
                         ring, bytes, workers) differs from rank {rank}'s"
                    )));
                }
            }
            let peers = fp
                .into_proxy_peers()
                .into_iter()
                .enumerate()
                .map(|(p, e)| if mask >> p & 1 == 1 { e } else { None })
                .collect();
            transports.push(FabricTransport::new(rank as u32, stack.ep.clone(), send_mr, peers)?);
            recv_mrs.push(recv_mr);
        }
        let ring_layout = RingLayout::new(num_rings, l.ring_capacity)?;
        let (ring_region, ring_dptr) = mapped_region(dev, ring_layout.bytes())?;
        let rings = RingMemory::new(ring_region, ring_layout)?;
        let ids = (r * (2 * s.slots_per_peer + 1)) as u32;
        let counter_layout = CounterLayout { num_slots: ids, num_rings };
        let (counter_region, counters_dptr) = mapped_region(dev, counter_layout.bytes())?;
        let counters = CounterMemory::new(counter_region, counter_layout)?;
        // The worker spins (kernels push every few microseconds while a step runs) and backs off
        // after a second without work.
        let pcfg = ProxyConfig {
            rank: rank as u32,
            value_bits: VALUE_BITS,
            idle_spin: Duration::from_secs(1),
            idle_yield: Duration::from_secs(2),
            ..ProxyConfig::default()
        };
        let proxy = Proxy::start(pcfg, rings.clone(), counters.clone(), transports)?;
        // Every rank's proxy runs and every region is registered before anyone writes.
        boot.barrier()?;
        let abi = abi::fep_normal_proxy {
            ring: ring_dptr,
            send: send.device_ptr(),
            recv: recv.device_ptr(),
            arrivals: counters_dptr + counter_layout.arrivals_offset() as u64,
            stride: geo.stride,
            notify_base: geo.notify_base,
            mask,
            num_rings,
            ring_capacity: l.ring_capacity,
            ring_stride: ring_layout.stride() as u32,
            value_bits: VALUE_BITS,
            data_per_region: geo.data.units_per_region as u32,
            notify_per_region: geo.notify.units_per_region as u32,
            notify_bytes: layout.notify_record_bytes as u32,
        };
        Ok(NormalProxyLane {
            rank,
            mask,
            kind,
            geo,
            abi,
            provider: l.provider.clone(),
            proxy,
            counters,
            _rings: rings,
            _recv_mrs: recv_mrs,
            _stacks: stacks,
            _send: send,
            _recv: recv,
        })
    }

    /// What the kernels get (`fep_normal_comm.proxy`).
    pub fn as_abi(&self) -> abi::fep_normal_proxy {
        self.abi
    }
    /// Bit `p`: peer `p` is reached through this lane.
    pub fn mask(&self) -> u32 {
        self.mask
    }
    pub fn region_kind(&self) -> RegionKind {
        self.kind
    }
    pub fn geometry(&self) -> &Geometry {
        &self.geo
    }
    /// Rings of the lane (the most blocks a normal kernel of this rank may launch).
    pub fn num_rings(&self) -> u32 {
        self.abi.num_rings
    }
    /// The proxy's counters (arrivals per immediate slot id).
    pub fn counters(&self) -> &CounterMemory {
        &self.counters
    }

    /// The proxy worker's error, if it stopped on one (typed, naming the peer).
    pub fn check(&self) -> Result<()> {
        self.proxy.check().map_err(Error::from)
    }

    /// Zeroes the counters (with [`NormalGpuRank::reset`](super::super::normal_gpu::NormalGpuRank::reset):
    /// every rank, no kernel running and no write in flight).
    pub fn reset_counters(&self) {
        self.counters.reset();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::config::DispatchDtype;
    use crate::protocol::plan::NormalLayout;

    /// The kernels' placement (fep_normal.cuh `px_data_off` / `px_notify_off`), from the
    /// fields the lane hands them, equals the host backend's geometry for every slot and record.
    #[test]
    fn kernel_offsets_are_the_host_geometry() {
        let l = NormalLayout::from_parts(4, 64, 2048, 8, DispatchDtype::Fp8E4m3, 16, 3).unwrap();
        for stride in [l.slot_bytes, 3 * l.slot_bytes + 100, 1 << 30] {
            let g = Geometry::new(&l, stride).unwrap();
            let (dpr, npr) = (g.data.units_per_region, g.notify.units_per_region);
            let place =
                |unit: u64, per: u64, bytes: u64| (unit / per) * stride + (unit % per) * bytes;
            for peer in 0..4u64 {
                for slot in 0..3u64 {
                    let k = place(peer * 3 + slot, dpr, l.slot_bytes);
                    assert_eq!(k, g.data_offset(peer as usize, slot), "stride {stride}");
                }
                for seq in 0..4u64 {
                    let k = g.notify_base + place((seq % 2) * 4 + peer, npr, l.notify_record_bytes);
                    assert_eq!(k, g.notify_offset(peer as usize, seq), "stride {stride}");
                }
            }
            assert!(dpr <= u32::MAX as u64 && npr <= u32::MAX as u64);
        }
    }

    #[test]
    fn workers_come_from_the_environment_value() {
        assert_eq!(workers_from_env(None).unwrap(), DEFAULT_PROXY_WORKERS);
        assert_eq!(workers_from_env(Some(" 4 ")).unwrap(), 4);
        for bad in ["0", "17", "two", ""] {
            let e = workers_from_env(Some(bad)).unwrap_err().to_string();
            assert!(e.contains("FEP_GPU_PROXY_WORKERS"), "{bad:?}: {e}");
        }
        // The low-latency lane's variable: its own default, its own name in errors.
        assert_eq!(parse_workers("FEP_LL_PROXY_WORKERS", None, 1).unwrap(), 1);
        assert_eq!(parse_workers("FEP_LL_PROXY_WORKERS", Some("16"), 1).unwrap(), 16);
        let e = parse_workers("FEP_LL_PROXY_WORKERS", Some("-1"), 1).unwrap_err().to_string();
        assert!(e.contains("FEP_LL_PROXY_WORKERS"), "{e}");
    }

    #[test]
    fn masks_name_other_nodes() {
        assert_eq!(other_node_mask(0, 2, 1).unwrap(), 0b10);
        assert_eq!(other_node_mask(1, 2, 1).unwrap(), 0b01);
        assert_eq!(other_node_mask(1, 4, 2).unwrap(), 0b1100);
        assert_eq!(other_node_mask(2, 4, 2).unwrap(), 0b0011);
        assert_eq!(other_node_mask(3, 4, 4).unwrap(), 0);
        assert!(other_node_mask(0, 4, 3).is_err());
        assert!(other_node_mask(0, 4, 0).is_err());
    }
}
