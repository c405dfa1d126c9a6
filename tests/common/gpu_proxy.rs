//! Shared by the GPU proxy tests (tests/gpu_proxy.rs) and the latency bench
//! (ep-bench/examples/gpu_proxy_bench.rs): one rank of a GPU job whose kernels drive the real CPU
//! proxy. Rings, counters, send and receive regions all live in pinned host memory mapped into
//! the GPU (`HostMapped`); the send and receive regions are registered with libfabric as host
//! memory.

use std::sync::Arc;
use std::time::Duration;

use fabric_ep::abi::fep_dev_error_ref;
use fabric_ep::cuda::{DevErrorRecord, Device, HostMapped, Stream};
use fabric_ep::fabric::{InfoQuery, MemKind, MemoryRegion, RemoteRegion, Stack};
use fabric_ep::proxy::{
    CounterLayout, CounterMemory, FabricPeer, FabricTransport, Proxy, ProxyConfig, RingLayout,
    RingMemory, SharedRegion,
};

/// murmur3's finaliser; kernels/proxy_test.cu has the same.
pub fn mix32(mut x: u32) -> u32 {
    x ^= x >> 16;
    x = x.wrapping_mul(0x85eb_ca6b);
    x ^= x >> 13;
    x = x.wrapping_mul(0xc2b2_ae35);
    x ^= x >> 16;
    x
}

/// Length of message `i` from rank `src` (kernels/proxy_test.cu `msg_len`).
pub fn msg_len(src: u32, i: u32, stride: u32) -> u32 {
    if i % 5 == 4 {
        return 0;
    }
    1 + mix32(src.wrapping_mul(0x9e37_79b1) ^ i.wrapping_add(0x0123_4567)) % stride
}

/// Byte `j` of message `i` from `src` to `dst` (kernels/proxy_test.cu `msg_byte`).
pub fn msg_byte(src: u32, dst: u32, i: u32, j: u32) -> u8 {
    mix32(
        src.wrapping_mul(0x0100_0193)
            ^ dst.wrapping_mul(0x9e37_79b1)
            ^ i.wrapping_mul(0x85eb_ca77)
            ^ j.wrapping_mul(0xc2b2_ae3d),
    ) as u8
}

/// What one rank opens.
#[derive(Clone, Debug)]
pub struct RankSetup {
    pub provider: String,
    pub rank: u32,
    pub num_ranks: u32,
    pub send_bytes: usize,
    pub recv_bytes: usize,
    /// Entries of the (single) ring.
    pub capacity: u32,
    pub config: ProxyConfig,
}

/// Mapped host memory handed to a `SharedRegion` (which keeps it alive), plus its GPU address.
pub fn mapped_region(dev: &Device, len: usize) -> (SharedRegion, u64) {
    let m = HostMapped::new(dev, len).expect("cuMemHostAlloc");
    let (ptr, dptr) = (m.as_ptr(), m.device_ptr());
    // SAFETY: `m` is `len` bytes of pinned memory, valid from any thread until it is dropped,
    // which happens when the region (its keepalive owner) drops.
    let region = unsafe { SharedRegion::from_raw(ptr, len, Box::new(m)) }.expect("region");
    (region, dptr)
}

/// One rank: device, stream, error record, the proxy (one worker, one ring, a counter slot per
/// source rank) over a `FabricTransport`.
/// NOTES: field order is drop order: the proxy (and the send registration inside its
/// transport) goes first, then the receive registration, the endpoint, and only then the memory.
pub struct GpuRank {
    pub proxy: Proxy,
    pub rings: RingMemory,
    pub counters: CounterMemory,
    rmr: MemoryRegion,
    pub stack: Stack,
    pub send: Arc<HostMapped>,
    pub recv: Arc<HostMapped>,
    pub ring_dptr: u64,
    pub counters_dptr: u64,
    pub err: DevErrorRecord,
    pub stream: Stream,
    pub dev: Device,
    pub rank: u32,
    pub num_ranks: u32,
}

impl GpuRank {
    /// Opens the device (`LOCAL_RANK` modulo the GPUs), the fabric stack, the mapped regions and
    /// the proxy; `gather` is the bootstrap's all-gather (called three times, by every rank).
    /// `poison` fills the receive region first, so unwritten bytes are recognisable.
    pub fn open(s: &RankSetup, poison: u8, gather: &dyn Fn(&[u8]) -> Vec<Vec<u8>>) -> GpuRank {
        let ctx = |what: &str| format!("{} rank {}: {what}", s.provider, s.rank);
        let dev = Device::from_env().unwrap_or_else(|e| panic!("{}: {e}", ctx("device")));
        let stream = Stream::new(&dev).unwrap();
        let err = DevErrorRecord::new(&dev).unwrap();
        let stack = Stack::open(&InfoQuery::provider(&s.provider), s.num_ranks as usize)
            .unwrap_or_else(|e| panic!("{}: {e}", ctx("open")));
        let names = gather(&stack.ep.name().unwrap_or_else(|e| panic!("{}: {e}", ctx("name"))));
        let addrs = stack.connect(&names).unwrap_or_else(|e| panic!("{}: {e}", ctx("connect")));
        let send = Arc::new(HostMapped::new(&dev, s.send_bytes).unwrap());
        let recv = Arc::new(HostMapped::new(&dev, s.recv_bytes).unwrap());
        // SAFETY: nothing else touches the receive region before it is registered and shared.
        unsafe { std::ptr::write_bytes(recv.as_ptr(), poison, recv.len()) };
        // SAFETY: both buffers outlive their registrations (field order of GpuRank).
        let smr = Arc::new(
            unsafe { stack.register(send.as_ptr(), send.len(), MemKind::Host) }
                .unwrap_or_else(|e| panic!("{}: {e}", ctx("register send"))),
        );
        let rmr = unsafe { stack.register(recv.as_ptr(), recv.len(), MemKind::Host) }
            .unwrap_or_else(|e| panic!("{}: {e}", ctx("register recv")));
        let remotes = gather(&rmr.remote().to_bytes());
        let peers = remotes
            .iter()
            .zip(&addrs)
            .map(|(b, &addr)| {
                Some(FabricPeer { addr, recv: RemoteRegion::from_bytes(b).expect("remote") })
            })
            .collect();
        let transport = FabricTransport::new(s.rank, stack.ep.clone(), smr, peers)
            .unwrap_or_else(|e| panic!("{}: {e}", ctx("transport")));
        let ring_layout = RingLayout::new(1, s.capacity).unwrap();
        let (ring_region, ring_dptr) = mapped_region(&dev, ring_layout.bytes());
        let rings = RingMemory::new(ring_region, ring_layout).unwrap();
        let counter_layout = CounterLayout { num_slots: s.num_ranks, num_rings: 1 };
        let (counter_region, counters_dptr) = mapped_region(&dev, counter_layout.bytes());
        let counters = CounterMemory::new(counter_region, counter_layout).unwrap();
        let config = ProxyConfig { rank: s.rank, ..s.config.clone() };
        let proxy = Proxy::start(config, rings.clone(), counters.clone(), vec![transport])
            .unwrap_or_else(|e| panic!("{}: {e}", ctx("proxy start")));
        gather(b"started");
        GpuRank {
            proxy,
            rings,
            counters,
            rmr,
            stack,
            send,
            recv,
            ring_dptr,
            counters_dptr,
            err,
            stream,
            dev,
            rank: s.rank,
            num_ranks: s.num_ranks,
        }
    }

    /// GPU address of `arrivals[slot]`.
    pub fn arrivals_dptr(&self, slot: u32) -> u64 {
        self.counters_dptr + self.counters.layout().arrival_offset(slot) as u64
    }

    pub fn dev_error(&self) -> fep_dev_error_ref {
        self.err.as_abi()
    }

    /// Byte `offset` of the receive region (volatile read).
    pub fn recv_byte(&self, offset: usize) -> u8 {
        self.recv.read::<u8>(offset).expect("recv offset")
    }
}

/// Proxy settings for GPU runs: the worker spins for a while before it backs off (a kernel's
/// next command often comes after a round trip of several microseconds).
pub fn gpu_proxy_config(spin: Duration) -> ProxyConfig {
    ProxyConfig {
        idle_spin: spin,
        idle_yield: spin.saturating_add(Duration::from_millis(5)),
        ..ProxyConfig::default()
    }
}

/// Clock cycles per `d` at `ghz` (the kernels' budgets are clock64 cycles).
pub fn cycles(d: Duration, ghz: f64) -> u64 {
    (d.as_secs_f64() * ghz * 1e9) as u64
}
