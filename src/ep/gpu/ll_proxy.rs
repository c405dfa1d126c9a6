//! The low-latency GPU path to peers on other nodes (`ranks_per_node < num_ranks`): the LL
//! kernels stage those peers' rows in this rank's send area and push one command per
//! (destination rank, destination local expert) into a ring in mapped host memory; this rank's
//! CPU proxy ([`crate::proxy`]: `FEP_LL_PROXY_WORKERS` worker threads, each with its own
//! endpoint, each posting a stripe of the ring's tickets) posts one libfabric RMA write per
//! command with `imm = slot << 14 | row count` (an empty write when the count is 0); the
//! receiving proxy adds the count to `sums[slot]` and bumps `arrivals[slot]`, and keeps both
//! modulo 2^32 in one word, `packed[slot]`, which the receiving kernel polls (bounded): one read
//! tells the arrival and carries the count ([`poll_packed`] is the kernel's logic on the host).
//! Same-node peers keep the device-pointer path (mixed tables).
//! No host synchronisation anywhere in a step, so a step stays capturable in a CUDA graph.
//!
//! Wire protocol = the host backend's (`ep::host::ll`): LlImm's counter slots (dispatch
//! `set * E + e * R + src`, combine `(2 + set) * E + src * L + e`), one message per
//! (phase, set, source, unit) per call, order-agnostic (only counters are read), two buffer sets
//! alternating by call parity. Unlike the host lane there are no per-call acks: the GPU path
//! keeps DeepEP's contract (every rank completes call N's receive before any rank starts call
//! N + 2), as its device-pointer path does.
//!
//! Memory: where `fi_getinfo` with `FI_HMEM` answers for the provider (EFA on P5 with GPUDirect
//! RDMA: `FI_EFA_USE_DEVICE_RDMA=1`, fi_efa(7)), the LL buffer stays in device memory and is
//! registered with `FI_HMEM_CUDA` (fi_mr(3), `fi_mr_regattr` with `iface`/`device.cuda`);
//! otherwise (`tcp;ofi_rxm`, `udp;ofi_rxd`, and shm where libfabric lacks CUDA support: it lists
//! `FI_HMEM` but its CUDA registration fails with ENOSYS, so the registration is the probe) it is
//! pinned host memory mapped into the GPU (`cuMemHostAlloc`, DEVICEMAP) registered as host
//! memory. `FEP_LL_HMEM=0` forces the second. The HMEM branch has not run with a real HMEM
//! provider here (no such NIC).
//!
// NOTES (clean): `clean_low_latency_gpu` ends with [`LlProxyLane::fence`], the host lane's exact
// fence: every rank waits until its own writes completed, all-gathers how many push batches it
// ever made per (phase, set), and every receiver waits (bounded) until each slot's arrivals equal
// what the sender pushed; then the device state is re-based on the counters (arr_base, sums_seen,
// calls since clean = 0; [`rebase_state`]). A stale write can therefore never pass for a later
// call's message.
//
// NOTES (wrap): arr_base and sums_seen are the halves of the slot's `packed` word, 32-bit values
// (fep_ll.cuh px_count compares and subtracts modulo 2^32). Nothing ever resets the counters, and
// a slot's sums pass 2^32 after ~33 M calls of 128 rows: the receive's arithmetic is modular
// everywhere, so neither a wrap between two cleans nor a clean just before or after one matters
// (unit test `counts_and_cleans_across_2_pow_32`).
//
// NOTES (layout): the buffer is registered in chunks of `Info::max_region_bytes` and an RMA
// write must stay inside one, so with a proxy lane units are placed as the host lane's
// `LlGeometry` places them (`fep_ll_proxy.units_per_region / region_stride`; every rank of the
// job has a lane, so device-pointer peers agree on the placement). Limits: row counts in 14
// bits (`max_tokens_per_rank <= 16383`), a ring of two calls' commands (`2 E` entries).

use std::sync::Arc;
use std::time::Duration;

use crate::abi;
use crate::bootstrap::Bootstrap;
use crate::cuda::{Device, DeviceBuffer, HostMapped};
use crate::ep::host::ll::LlGeometry;
use crate::ep::ll_gpu::{LlGpuRank, LlMem};
use crate::fabric::{select, InfoQuery, MemKind, MemoryRegion, Placement, Stack};
use crate::protocol::plan::{LlLayout, IMM_VALUE_BITS, IMM_VALUE_MAX};
use crate::proxy::{
    pack_counters, unpack_counters, ArrivalWait, CounterLayout, CounterMemory, FabricTransport,
    Proxy, ProxyConfig, ProxyError, RingLayout, RingMemory, SharedRegion,
};
use crate::{Error, Result};

/// u64 words of the device state before the per-slot arrays (fep_abi.h `fep_ll_proxy`).
const STATE_HEAD_WORDS: usize = 12;
const ST_SET_HEAD: usize = 1;
const ST_PUSHED: usize = 3;
const ST_CALLS: usize = 7;

/// Counter slots of the lane: LlImm's `4 E`.
pub fn num_slots(num_experts: usize) -> usize {
    4 * num_experts
}

/// u64 words of the device state for `num_experts` (fep_ll.cuh: arr_base, sums_seen and the
/// leader blocks' mirror per slot, then ready[4] and sends_seen).
pub fn state_words(num_experts: usize) -> usize {
    STATE_HEAD_WORDS + 3 * num_slots(num_experts) + 5
}

/// First word of `ready[phase * 2 + set]` (the receive leader's handoff, fep_ll.cuh st_ready).
fn ready_word(num_experts: usize) -> usize {
    STATE_HEAD_WORDS + 3 * num_slots(num_experts)
}

/// What one read of a slot's `packed` counter word tells a receive waiting for the call `calls`
/// since the clean that set `arr_base` and with `sums_seen` counted so far (fep_ll.cuh px_count
/// and fep_device.cuh wait_packed_eq are its device twins; every comparison modulo 2^32).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PackedPoll {
    /// The call's message is in; `count` rows (the sums half minus `sums_seen`).
    Arrived { count: u32 },
    /// Not yet (the arrivals half is behind): keep waiting.
    Behind,
    /// The arrivals half is past the call: a peer two calls ahead on the set, a contract
    /// violation (the kernel records `FEP_DEV_BAD_COUNT`).
    Ahead,
}

/// See [`PackedPoll`]. `arr_base` and `sums_seen` are state words; only their low 32 bits count.
pub fn poll_packed(packed: u64, arr_base: u64, calls: u64, sums_seen: u64) -> PackedPoll {
    let expected = arr_base.wrapping_add(calls) as u32;
    let (arrivals, sums) = unpack_counters(packed);
    match arrivals.wrapping_sub(expected) {
        0 => PackedPoll::Arrived { count: sums.wrapping_sub(sums_seen as u32) },
        d if d < 1 << 31 => PackedPoll::Ahead,
        _ => PackedPoll::Behind,
    }
}

/// The rank whose messages land on counter `slot` (the inverse of [`slot`]: dispatch unit
/// `e * R + src`, combine unit `src * L + e`).
fn slot_source(slot: usize, num_experts: usize, num_ranks: usize) -> usize {
    let (e, r) = (num_experts.max(1), num_ranks.max(1));
    let unit = slot % e;
    if slot / e < 2 {
        unit % r
    } else {
        unit / (e / r).max(1)
    }
}

/// Re-bases the device state `st` at a clean (module NOTES): the ring words at `head`, calls
/// since clean and the receive leaders' `ready` words to 0, and per slot arr_base and sums_seen
/// to the halves of its `packed` word. Every slot must be quiet (no write in flight: the clean
/// fence awaited them all); a `packed` word that disagrees with its slot's `arrivals` and `sums`
/// (modulo 2^32) is reported as [`Error::Protocol`] naming the slot's source rank.
fn rebase_state(
    st: &mut [u64],
    counters: &CounterMemory,
    num_experts: usize,
    num_ranks: usize,
    rank: usize,
    head: u64,
) -> Result<()> {
    let s = num_slots(num_experts);
    if st.len() != state_words(num_experts) {
        return Err(Error::Other(format!(
            "proxy state of {} words, expected {}",
            st.len(),
            state_words(num_experts)
        )));
    }
    st[0] = head;
    st[ST_SET_HEAD] = head;
    st[ST_SET_HEAD + 1] = head;
    for w in &mut st[ST_CALLS..STATE_HEAD_WORDS] {
        *w = 0;
    }
    for i in 0..s {
        // NOTES: arrivals first: the proxy updates it last (Release), so packed and sums read
        // after it hold at least those arrivals; on a quiet slot exactly those.
        let arrivals = counters.arrivals(i as u32)?;
        let sums = counters.sums(i as u32)?;
        let packed = counters.packed(i as u32)?;
        if packed != pack_counters(arrivals, sums) {
            return Err(Error::Protocol {
                rank,
                peer: slot_source(i, num_experts, num_ranks),
                phase: "clean_low_latency_buffer",
                msg: format!(
                    "slot {i} changed during the clean: packed {packed:#x}, arrivals {arrivals}, \
                     sums {sums}"
                ),
            });
        }
        let (a, sm) = unpack_counters(packed);
        st[STATE_HEAD_WORDS + i] = u64::from(a);
        st[STATE_HEAD_WORDS + s + i] = u64::from(sm);
    }
    // Calls since clean restart at 0, so do the receive leaders' handoff words (they hold the
    // last call number each finished); `staged` is a ring head and only grows.
    for w in &mut st[ready_word(num_experts)..ready_word(num_experts) + 4] {
        *w = 0;
    }
    Ok(())
}

/// Counter slot of a message as the receiver names it: `(phase * 2 + set) * E + receive unit`
/// (dispatch unit `e * R + src`, combine unit `src * L + e`): LlImm's ids.
pub fn slot(phase: usize, set: usize, num_experts: usize, unit: usize) -> usize {
    (phase * 2 + set) * num_experts + unit
}

/// Ring entries: eight calls' worth of commands (one call pushes at most `E`), so a send kernel
/// reads the ring's tail from host memory only every few calls (fep_ll.cuh px_reserve).
pub fn ring_capacity(num_experts: usize) -> u32 {
    (8 * num_experts).max(256) as u32
}

/// Whether rank `peer` is reached through the proxy from `rank` (another node).
pub fn is_remote(rank: usize, peer: usize, ranks_per_node: usize) -> bool {
    rank / ranks_per_node != peer / ranks_per_node
}

/// Checks the settings the proxy path adds to the kernels' own.
pub fn check_limits(max_tokens: usize, num_experts: usize) -> Result<()> {
    if max_tokens > IMM_VALUE_MAX as usize {
        return Err(Error::arg(
            "max_tokens_per_rank",
            format!(
                "{max_tokens}: a row count travels in the {IMM_VALUE_BITS}-bit immediate \
                 (at most {IMM_VALUE_MAX})"
            ),
        ));
    }
    crate::protocol::plan::imm_encode(num_slots(num_experts) as u64 - 1, 0)?;
    Ok(())
}

fn geo_bytes(geo: &LlGeometry) -> Result<usize> {
    usize::try_from(geo.bytes)
        .map_err(|_| Error::arg("max_tokens_per_rank", "LL buffer larger than memory"))
}

/// Mapped host memory as a proxy region, with its GPU address.
fn mapped_region(dev: &Device, len: usize) -> Result<(SharedRegion, u64)> {
    let m = HostMapped::new(dev, len)?;
    let (ptr, dptr) = (m.as_ptr(), m.device_ptr());
    // SAFETY: `m` is `len` bytes of pinned memory, valid from any thread until dropped, which
    // happens when the region (its keepalive owner) drops.
    let region = unsafe { SharedRegion::from_raw(ptr, len, Box::new(m)) }?;
    Ok((region, dptr))
}

/// Default proxy workers of the low-latency lane when `FEP_LL_PROXY_WORKERS` is not set.
/// Measured on the H200 (2 processes x 1 rank per node under MPS, shm, 128 tokens, hidden 7168,
/// top-8 of 256, fp8: 128 writes of 28-59 KB per phase; `gpu_ll_proxy_bench --cases standard`):
/// dispatch / combine phase 2510 / 2407 us with 1 worker, 1018 / 1221 with 2, 980 / 924 with 4,
/// 976 / 760 with 6; one token per phase unchanged (22.9 / 21.5 us with 1, 22.4 / 21.6 with 4).
/// Like the normal lane's default: each worker is a spinning thread (it backs off after 50 ms
/// without work), and more only pay where the provider's copies run on the CPU.
pub const DEFAULT_LL_PROXY_WORKERS: usize = 4;

/// The first half of the lane, before the LL buffer exists: the provider is opened (one stack
/// per proxy worker) and decides where the buffer lives.
pub(crate) struct LlProxyPrep {
    // NOTES: field order is drop order: the registrations before the stacks and the memory.
    /// The LL buffer's registration with each stack (`mrs[i]` belongs to `stacks[i]`).
    mrs: Vec<Arc<MemoryRegion>>,
    stacks: Vec<Stack>,
    mem: LlMem,
    kind: MemKind,
    geo: LlGeometry,
    /// Why `FI_HMEM` was not used although the provider offered it (its registration failed).
    hmem_refused: Option<String>,
}

impl LlProxyPrep {
    /// Opens `provider` (with `FI_HMEM` when it has it) and allocates the LL buffer of `layout`
    /// where that provider can register it, its units placed per registered chunk
    /// ([`LlGeometry`]: no message crosses a chunk). `provider` `None`: libfabric's choice
    /// (`FI_PROVIDER`, else the first match). One stack (endpoint) per proxy worker:
    /// `FEP_LL_PROXY_WORKERS` (1 to 16, default [`DEFAULT_LL_PROXY_WORKERS`]), each on the
    /// NIC [`select`] gives it (nearest to `dev`, round-robin by worker).
    pub fn open(
        dev: &Device,
        provider: Option<&str>,
        (rank, local_rank): (usize, usize),
        num_ranks: usize,
        layout: LlLayout,
    ) -> Result<Self> {
        let workers = super::normal_proxy::parse_workers(
            "FEP_LL_PROXY_WORKERS",
            std::env::var("FEP_LL_PROXY_WORKERS").ok().as_deref(),
            DEFAULT_LL_PROXY_WORKERS,
        )?;
        let query = InfoQuery { provider: provider.map(str::to_string), ..Default::default() };
        let place = Placement {
            rank: Some(rank),
            local_rank,
            gpu_pci: dev.pci_bus_id().ok(),
            lane: 0,
            lanes: workers,
        };
        let try_hmem = std::env::var("FEP_LL_HMEM").map_or(true, |v| v != "0");
        let hmem_info = if try_hmem {
            select(&InfoQuery { hmem: true, ..query.clone() }, &place).ok().filter(|i| i.hmem())
        } else {
            None
        };
        // NOTES: a provider may list FI_HMEM and still refuse CUDA memory at registration
        // (a libfabric built without CUDA support answers ENOSYS, seen with Debian's shm on the
        // H200 machine): the first registration is the test, host memory the fallback.
        let mut hmem_refused = None;
        if let Some(info) = hmem_info {
            let stack = Stack::open_info(info, num_ranks)?;
            let geo = Self::geometry(&stack, layout)?;
            let b = Arc::new(DeviceBuffer::new(dev, geo_bytes(&geo)?)?);
            let kind = MemKind::Cuda { device: dev.ordinal() as i32 };
            let (ptr, len) = (b.device_ptr() as usize as *mut u8, b.len());
            // SAFETY: `b` is device memory of `len` bytes, kept alive by the rank's `LlMem`
            // (which outlives the lane holding this registration).
            match unsafe { stack.register(ptr, len, kind) } {
                Ok(mr) => {
                    // SAFETY: as above.
                    let q = InfoQuery { hmem: true, ..query.clone() };
                    let (stacks, mrs) = unsafe {
                        Self::more_stacks(
                            stack,
                            (&q, &place),
                            num_ranks,
                            mr,
                            workers,
                            ptr,
                            len,
                            kind,
                        )?
                    };
                    crate::fep_info!(
                        "low-latency proxy lane: {workers} workers, buffer of {len} bytes in GPU \
                         memory registered with FI_HMEM"
                    );
                    return Ok(LlProxyPrep {
                        mrs,
                        stacks,
                        mem: LlMem::Device(b),
                        kind,
                        geo,
                        hmem_refused: None,
                    });
                }
                Err(e) => hmem_refused = Some(e.to_string()),
            }
        }
        let stack = Stack::open_placed(&query, num_ranks, &place)?;
        let geo = Self::geometry(&stack, layout)?;
        let m = Arc::new(HostMapped::new(dev, geo_bytes(&geo)?)?);
        // SAFETY: as above, for pinned host memory.
        let mr = unsafe { stack.register(m.as_ptr(), m.len(), MemKind::Host)? };
        // SAFETY: as above.
        let (stacks, mrs) = unsafe {
            let (ptr, len) = (m.as_ptr(), m.len());
            Self::more_stacks(
                stack,
                (&query, &place),
                num_ranks,
                mr,
                workers,
                ptr,
                len,
                MemKind::Host,
            )?
        };
        match &hmem_refused {
            Some(why) => crate::fep_warn!(
                "low-latency proxy lane: the provider offers FI_HMEM but refused GPU memory \
                 ({why}); staging through pinned host memory ({} bytes, {workers} workers)",
                m.len()
            ),
            None => crate::fep_info!(
                "low-latency proxy lane: {workers} workers, buffer of {} bytes in pinned host \
                 memory (no FI_HMEM{})",
                m.len(),
                if try_hmem { "" } else { ": FEP_LL_HMEM=0" }
            ),
        }
        Ok(LlProxyPrep { mrs, stacks, mem: LlMem::Host(m), kind: MemKind::Host, geo, hmem_refused })
    }

    /// `first` (with the buffer's registration `mr`) and `workers - 1` more stacks of `query`,
    /// worker `w` placed as endpoint `w` of `place`, each with its own registration of the
    /// buffer.
    ///
    /// # Safety
    /// `ptr` / `len` / `kind` name the LL buffer, which outlives every registration.
    #[allow(clippy::too_many_arguments)]
    unsafe fn more_stacks(
        first: Stack,
        (query, place): (&InfoQuery, &Placement),
        num_peers: usize,
        mr: MemoryRegion,
        workers: usize,
        ptr: *mut u8,
        len: usize,
        kind: MemKind,
    ) -> Result<(Vec<Stack>, Vec<Arc<MemoryRegion>>)> {
        let (mut stacks, mut mrs) = (vec![first], vec![Arc::new(mr)]);
        for w in 1..workers {
            let s = Stack::open_placed(query, num_peers, &place.lane(w, workers))?;
            // SAFETY: the caller's.
            mrs.push(Arc::new(unsafe { s.register(ptr, len, kind)? }));
            stacks.push(s);
        }
        Ok((stacks, mrs))
    }

    fn geometry(stack: &Stack, layout: LlLayout) -> Result<LlGeometry> {
        LlGeometry::new(layout, stack.info.max_region_bytes().max(4096) as u64)
    }

    /// The LL buffer to build the rank with.
    pub fn mem(&self) -> LlMem {
        self.mem.clone()
    }

    /// Registers the buffer, exchanges regions and endpoint names with every rank (collective),
    /// starts the proxy, rewrites the proxy peers' entries of `table` and installs the lane's
    /// kernel view into `rank`.
    pub fn connect(
        self,
        boot: &Arc<dyn Bootstrap>,
        ranks_per_node: usize,
        rank: &mut LlGpuRank,
        table: &mut [abi::fep_ll_peer],
        timeout: Duration,
    ) -> Result<LlProxyLane> {
        let cfg = rank.config().clone();
        let (me, nr, e) = (rank.rank(), cfg.num_ranks, cfg.num_experts);
        check_limits(cfg.max_tokens_per_rank, e)?;
        let dev = rank.stream().device().clone();
        let bytes = self.geo.bytes;
        let remote: Vec<bool> = (0..nr).map(|p| is_remote(me, p, ranks_per_node)).collect();
        // Every rank must run as many workers (worker i writes to worker i of each peer): the
        // first exchange carries the count and every rank checks it before the next one.
        let workers = self.stacks.len();
        let hdr = (workers as u64).to_le_bytes();
        let mut transports = Vec::with_capacity(workers);
        for (stack, mr) in self.stacks.iter().zip(&self.mrs) {
            let peers =
                crate::ep::connect::exchange_fabric(&**boot, stack, &mr.remote(), &hdr, bytes)?;
            for (peer, h) in peers.headers.iter().enumerate() {
                if h[..] != hdr[..] {
                    return Err(Error::ConfigMismatch(format!(
                        "rank {peer}'s low-latency proxy lane runs a different number of workers \
                         than rank {me}'s {workers} (FEP_LL_PROXY_WORKERS must be equal on every \
                         rank)"
                    )));
                }
            }
            let peers = peers
                .into_proxy_peers()
                .into_iter()
                .zip(&remote)
                .map(|(p, &r)| if r { p } else { None })
                .collect();
            transports.push(FabricTransport::new(me as u32, stack.ep.clone(), mr.clone(), peers)?);
        }
        let capacity = ring_capacity(e);
        let ring_layout = RingLayout::new(1, capacity)?;
        let (ring_region, ring_dptr) = mapped_region(&dev, ring_layout.bytes())?;
        let rings = RingMemory::new(ring_region, ring_layout)?;
        let counter_layout = CounterLayout { num_slots: num_slots(e) as u32, num_rings: 1 };
        let (counter_region, counters_dptr) = mapped_region(&dev, counter_layout.bytes())?;
        let counters = CounterMemory::new(counter_region, counter_layout)?;
        // NOTES: the worker spins for a while after each command before it backs off: a
        // kernel's next push often follows a round trip of several microseconds.
        let spin = Duration::from_millis(50);
        let pcfg = ProxyConfig {
            rank: me as u32,
            value_bits: IMM_VALUE_BITS,
            idle_spin: spin,
            idle_yield: spin + Duration::from_millis(5),
            // The kernels push one call's commands into the one ring: every worker posts a
            // stripe of them on its own endpoint.
            stripe_rings: true,
            ..ProxyConfig::default()
        };
        let proxy = Proxy::start(pcfg, rings.clone(), counters.clone(), transports)?;
        // Every rank's proxy runs and every region is registered before anyone writes.
        boot.barrier()?;
        let mut n_proxy = 0u32;
        for (p, entry) in table.iter_mut().enumerate() {
            if remote[p] {
                *entry = abi::fep_ll_peer {
                    buf: 0,
                    flags: 0,
                    transport: abi::FEP_LL_TRANSPORT_PROXY,
                    _pad: 0,
                    proxy: u64::from(n_proxy),
                };
                n_proxy += 1;
            }
        }
        let px = abi::fep_ll_proxy {
            ring: ring_dptr,
            arrivals: counters_dptr + counter_layout.arrivals_offset() as u64,
            packed: counters_dptr + counter_layout.packed_offset() as u64,
            sends_completed: counters_dptr + counter_layout.sends_completed_offset() as u64,
            state: 0,
            capacity,
            value_bits: IMM_VALUE_BITS,
            num_proxy_peers: n_proxy,
            units_per_region: u32::try_from(self.geo.plan.units_per_region)
                .map_err(|_| Error::arg("num_experts", "too many LL units per region"))?,
            region_stride: self.geo.stride,
        };
        let state = DeviceBuffer::zeroed(&dev, state_words(e) * 8)?;
        // Zeroed on return (DeviceBuffer's fills wait for themselves), before any launch.
        rank.set_proxy(px, state);
        Ok(LlProxyLane {
            proxy,
            rings,
            counters,
            _mrs: self.mrs,
            _stacks: self.stacks,
            boot: boot.clone(),
            rank: me,
            remote,
            hmem: matches!(self.kind, MemKind::Cuda { .. }),
            hmem_refused: self.hmem_refused,
            timeout,
        })
    }
}

/// The proxy lane of one GPU rank.
pub(crate) struct LlProxyLane {
    // NOTES: field order is drop order: the proxy (its workers and the transport holding the
    // registration) stops first, then the registration, then the endpoint.
    proxy: Proxy,
    rings: RingMemory,
    counters: CounterMemory,
    _mrs: Vec<Arc<MemoryRegion>>,
    _stacks: Vec<Stack>,
    boot: Arc<dyn Bootstrap>,
    rank: usize,
    /// `remote[p]`: rank `p` is reached through the proxy.
    remote: Vec<bool>,
    hmem: bool,
    hmem_refused: Option<String>,
    timeout: Duration,
}

impl LlProxyLane {
    /// Why the provider's `FI_HMEM` was not used (its CUDA registration failed), if so.
    pub fn hmem_refused(&self) -> Option<&str> {
        self.hmem_refused.as_deref()
    }

    /// `Err` once the proxy worker stopped on an error (a peer unreachable, a bad immediate).
    pub fn check(&self) -> Result<()> {
        self.proxy.check().map_err(Error::Proxy)
    }

    /// Proxy workers of the lane (each with its own endpoint).
    pub fn workers(&self) -> usize {
        self._stacks.len()
    }

    /// Whether the LL buffer is GPU memory registered with `FI_HMEM`.
    pub fn hmem(&self) -> bool {
        self.hmem
    }

    fn proxy_err(&self, phase: &'static str, e: ProxyError) -> Error {
        Error::from_proxy(self.rank, phase, e)
    }

    /// A one-line picture of the lane for error reports: the proxy's health, ring head/tail,
    /// sends completed, the device state's counters, and every slot a remote peer writes whose
    /// `packed` word is not what the receive of its (phase, set) expects ([`poll_packed`] not
    /// `Arrived`: behind or ahead), or disagrees with its `arrivals` and `sums`. Reads the device
    /// state: call it only when this rank's stream is idle (after a failed sync).
    pub fn snapshot(&self, rank: &LlGpuRank) -> String {
        let mut out = format!("rank {} proxy lane ({} workers): ", self.rank, self.workers());
        match self.proxy.check() {
            Ok(()) => out.push_str("proxy ok"),
            Err(e) => out.push_str(&format!("proxy FAILED: {e}")),
        }
        let ring = (self.rings.head(0), self.rings.tail(0), self.counters.sends_completed(0));
        if let (Ok(h), Ok(t), Ok(c)) = ring {
            out.push_str(&format!("; ring head {h} tail {t} sends completed {c}"));
        }
        let Some(Ok(st)) = rank.proxy_state().map(|b| b.to_vec::<u64>()) else {
            return out + "; device state unreadable";
        };
        let cfg = rank.config();
        let (nr, e) = (cfg.num_ranks, cfg.num_experts);
        let l = e / nr;
        out.push_str(&format!("; device state {:?}", &st[..STATE_HEAD_WORDS]));
        let s = num_slots(e);
        let mut odd = Vec::new();
        for (src, _) in self.remote.iter().enumerate().filter(|(_, r)| **r) {
            for phase in 0..2 {
                for set in 0..2 {
                    let calls = st[ST_CALLS + phase * 2 + set];
                    for le in 0..l {
                        let unit = if phase == 0 { le * nr + src } else { src * l + le };
                        let sl = slot(phase, set, e, unit);
                        // arrivals before packed (the proxy writes it last): packed is then at
                        // least as recent, so a mismatch on a quiet slot is real.
                        let a = self.counters.arrivals(sl as u32).unwrap_or(u64::MAX);
                        let sums = self.counters.sums(sl as u32).unwrap_or(u64::MAX);
                        let packed = self.counters.packed(sl as u32).unwrap_or(u64::MAX);
                        let (base, seen) =
                            (st[STATE_HEAD_WORDS + sl], st[STATE_HEAD_WORDS + s + sl]);
                        let poll = poll_packed(packed, base, calls, seen);
                        let torn = packed != pack_counters(a, sums);
                        if !matches!(poll, PackedPoll::Arrived { .. }) || torn {
                            let (pa, ps) = unpack_counters(packed);
                            odd.push(format!(
                                "src {src} phase {phase} set {set} unit {unit}: {poll:?}{}: \
                                 packed arrivals {pa} sums {ps} (arrivals {a}, sums {sums}), \
                                 base {base} + calls {calls}, sums seen {seen} (mod 2^32)",
                                if torn { ", packed disagrees" } else { "" }
                            ));
                        }
                    }
                }
            }
        }
        let n = odd.len();
        odd.truncate(8);
        out + &format!("; {n} slots off: {}", odd.join(" | "))
    }

    /// The collective fence of `clean_low_latency_gpu` (module NOTES). Every rank calls it after
    /// its stream drained (`LlGpuRank::clean`).
    pub fn fence(&self, rank: &mut LlGpuRank) -> Result<()> {
        const PHASE: &str = "clean_low_latency_buffer";
        self.check()?;
        let head = self.rings.head(0)?;
        self.proxy.wait_sends(0, head, self.timeout).map_err(|e| self.proxy_err(PHASE, e))?;
        let cfg = rank.config().clone();
        let (nr, e) = (cfg.num_ranks, cfg.num_experts);
        let l = e / nr;
        let state =
            rank.proxy_state().ok_or_else(|| Error::Other("no proxy state on this rank".into()))?;
        let mut st: Vec<u64> = state.to_vec()?;
        let pushed = &st[ST_PUSHED..ST_PUSHED + 4];
        let blob: Vec<u8> = pushed.iter().flat_map(|v| v.to_le_bytes()).collect();
        let all = self.boot.all_gather(&blob)?;
        let mut waits = Vec::new();
        for (src, b) in all.iter().enumerate() {
            if b.len() != blob.len() {
                return Err(Error::Protocol {
                    rank: self.rank,
                    peer: src,
                    phase: PHASE,
                    msg: format!("{} bytes of push counts, expected {}", b.len(), blob.len()),
                });
            }
            if !self.remote[src] {
                continue;
            }
            for phase in 0..2 {
                for set in 0..2 {
                    let i = (phase * 2 + set) * 8;
                    let n = u64::from_le_bytes(b[i..i + 8].try_into().unwrap_or([0; 8]));
                    for le in 0..l {
                        let unit = if phase == 0 { le * nr + src } else { src * l + le };
                        waits.push(ArrivalWait {
                            slot: slot(phase, set, e, unit) as u32,
                            expected: n,
                            peer: src as u32,
                        });
                    }
                }
            }
        }
        self.proxy.wait_all(&waits, self.timeout).map_err(|e| self.proxy_err(PHASE, e))?;
        for w in &waits {
            let arrived = self.counters.arrivals(w.slot)?;
            if arrived != w.expected {
                return Err(Error::Protocol {
                    rank: self.rank,
                    peer: w.peer as usize,
                    phase: PHASE,
                    msg: format!(
                        "{arrived} writes arrived on slot {}, it sent {}",
                        w.slot, w.expected
                    ),
                });
            }
        }
        rebase_state(&mut st, &self.counters, e, nr, self.rank, head)?;
        rank.upload_proxy_state(&st)?;
        self.boot.barrier()?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_llimm_ids() {
        let imm = crate::protocol::plan::LlImm::new(4, 16).unwrap();
        let (r, e, l) = (4usize, 16usize, 4usize);
        for set in 0..2 {
            for le in 0..l {
                for src in 0..r {
                    let d = imm.dispatch(set as u64, le as u64, src as u64, 3).unwrap();
                    let (id, v) = crate::protocol::plan::imm_decode(d);
                    assert_eq!((id as usize, v), (slot(0, set, e, le * r + src), 3));
                    let c = imm.combine(set as u64, src as u64, le as u64, 0).unwrap();
                    assert_eq!(
                        crate::protocol::plan::imm_decode(c).0 as usize,
                        slot(1, set, e, src * l + le)
                    );
                }
            }
        }
        assert_eq!(state_words(16), 12 + 3 * 64 + 5);
        assert!(ring_capacity(256) >= 256);
        for set in 0..2 {
            for le in 0..l {
                for src in 0..r {
                    assert_eq!(slot_source(slot(0, set, e, le * r + src), e, r), src);
                    assert_eq!(slot_source(slot(1, set, e, src * l + le), e, r), src);
                }
            }
        }
    }

    const LOW: u64 = 1 << 32;

    #[test]
    fn poll_packed_is_modular() {
        use crate::proxy::pack_counters as pack;
        let arrived = |count| PackedPoll::Arrived { count };
        assert_eq!(poll_packed(pack(5, 100), 4, 1, 90), arrived(10));
        assert_eq!(poll_packed(pack(4, 100), 4, 1, 90), PackedPoll::Behind);
        assert_eq!(poll_packed(pack(6, 100), 4, 1, 90), PackedPoll::Ahead);
        // The arrivals half wraps: expected (2^32 - 1) + 1 = 0 modulo 2^32.
        assert_eq!(poll_packed(pack(LOW, 5), LOW - 1, 1, LOW - 3), arrived(8));
        assert_eq!(poll_packed(pack(LOW - 1, 5), LOW - 1, 1, 0), PackedPoll::Behind);
        assert_eq!(poll_packed(pack(LOW + 1, 5), LOW - 1, 1, 0), PackedPoll::Ahead);
        // Far behind is behind (a peer that has not sent for many calls), never ahead.
        assert_eq!(poll_packed(pack(7, 0), 7, 1 << 31, 0), PackedPoll::Behind);
        // Only the low 32 bits of the state words count.
        assert_eq!(poll_packed(pack(2, 16383), LOW + 1, 1, 7 * LOW), arrived(16383));
        assert_eq!(poll_packed(pack(0, 0), 0, 0, 0), arrived(0));
    }

    /// The receive's modular logic ([`poll_packed`], the kernel's px_count on the host) and the
    /// clean's re-base ([`rebase_state`]) across 2^32: every slot starts just below 2^32 in both
    /// counters; 400 calls wrap every slot's arrivals and sums, with cleans in between (some of
    /// them just before, some just after a slot wraps).
    #[test]
    fn counts_and_cleans_across_2_pow_32() {
        let (nr, e) = (2usize, 4usize);
        let s = num_slots(e);
        let layout = CounterLayout { num_slots: s as u32, num_rings: 1 };
        let counters = CounterMemory::new_host(layout).unwrap();
        for i in 0..s as u64 {
            counters.preset(i as u32, LOW - 3 - 11 * i, LOW - 20_000 * (i + 1));
        }
        let mut st = vec![0u64; state_words(e)];
        rebase_state(&mut st, &counters, e, nr, 0, 5).unwrap();
        assert_eq!(&st[..3], &[5, 5, 5]);
        assert_eq!(st[STATE_HEAD_WORDS + 2], u64::from((LOW - 25) as u32));
        // px_count on the host: one read of packed decides; an arrival advances sums_seen.
        let count = |st: &mut [u64], phase: usize, set: usize, sl: usize| {
            let packed = counters.packed(sl as u32).unwrap();
            let (base, calls) = (st[STATE_HEAD_WORDS + sl], st[ST_CALLS + phase * 2 + set]);
            let p = poll_packed(packed, base, calls, st[STATE_HEAD_WORDS + s + sl]);
            if let PackedPoll::Arrived { .. } = p {
                st[STATE_HEAD_WORDS + s + sl] = u64::from(unpack_counters(packed).1);
            }
            p
        };
        let mut cleans = 0;
        for call in 0..400u64 {
            let set = (call % 2) as usize;
            for phase in 0..2 {
                st[ST_CALLS + phase * 2 + set] += 1; // the send's px_publish
                for unit in 0..e {
                    let sl = slot(phase, set, e, unit);
                    assert_eq!(count(&mut st, phase, set, sl), PackedPoll::Behind, "call {call}");
                    let rows = ((call * 7_919 + sl as u64 * 104_729) % 16_384) as u32;
                    counters.record_arrival(sl as u32, rows);
                    let got = count(&mut st, phase, set, sl);
                    assert_eq!(got, PackedPoll::Arrived { count: rows }, "call {call} slot {sl}");
                }
            }
            if call % 9 == 4 || call == 5 || call == 6 {
                rebase_state(&mut st, &counters, e, nr, 0, 5).unwrap();
                assert!(st[ST_CALLS..STATE_HEAD_WORDS].iter().all(|&w| w == 0));
                cleans += 1;
            }
        }
        assert!(cleans > 40);
        for i in 0..s as u32 {
            let (a, sums) = (counters.arrivals(i).unwrap(), counters.sums(i).unwrap());
            assert!(a > LOW && sums > LOW, "slot {i}: arrivals {a} sums {sums} wrapped");
            assert_eq!(counters.packed(i).unwrap(), crate::proxy::pack_counters(a, sums));
        }

        // A peer two calls ahead on a set: its next message is in before this receive's.
        let sl = slot(0, 1, e, 3);
        st[ST_CALLS + 1] += 1;
        counters.record_arrival(sl as u32, 1);
        counters.record_arrival(sl as u32, 1);
        assert_eq!(count(&mut st, 0, 1, sl), PackedPoll::Ahead);
    }

    #[test]
    fn rebase_rejects_a_slot_that_moved() {
        let (nr, e) = (2usize, 4usize);
        let layout = CounterLayout { num_slots: num_slots(e) as u32, num_rings: 1 };
        let counters = CounterMemory::new_host(layout).unwrap();
        let mut st = vec![0u64; state_words(e)];
        assert!(matches!(rebase_state(&mut st[1..], &counters, e, nr, 0, 0), Err(Error::Other(_))));
        // A record half done (sums and packed counted, arrivals not yet): seen as moving.
        let sl = slot(1, 0, e, 3) as u32; // combine, unit 3 = src 1 * L 2 + e 1
        counters.sums_atomic(sl).fetch_add(9, std::sync::atomic::Ordering::Relaxed);
        counters
            .packed_atomic(sl)
            .store(crate::proxy::pack_counters(1, 9), std::sync::atomic::Ordering::Release);
        match rebase_state(&mut st, &counters, e, nr, 3, 0) {
            Err(Error::Protocol { rank: 3, peer: 1, phase: "clean_low_latency_buffer", msg }) => {
                assert!(msg.contains(&format!("slot {sl}")), "{msg}");
            }
            other => panic!("expected a protocol error, got {other:?}"),
        }
    }

    /// The kernels' `unit_offset` with a proxy lane (fep_ll.cuh) places every unit where the
    /// host lane's `LlGeometry` does, and no unit crosses a registered chunk.
    #[test]
    fn kernel_placement_is_ll_geometry() {
        use crate::protocol::config::DispatchDtype;
        use crate::protocol::plan::LlArea;
        let l = LlLayout::from_parts(4, 16, 256, DispatchDtype::Fp8E4m3, 8).unwrap();
        for stride in [l.unit_bytes, l.unit_bytes * 3 + 16, 1 << 20] {
            let g = LlGeometry::new(l, stride).unwrap();
            let upr = g.plan.units_per_region;
            for set in 0..2u64 {
                for (ai, area) in [(0u64, LlArea::Send), (1, LlArea::Recv)] {
                    for unit in 0..16u64 {
                        let u = (set * 2 + ai) * 16 + unit;
                        let kernel = (u / upr) * stride + (u % upr) * l.unit_bytes;
                        assert_eq!(kernel, g.offset(set, area, unit).unwrap());
                        assert_eq!(kernel / stride, (kernel + l.unit_bytes - 1) / stride);
                        assert!(kernel + l.unit_bytes <= g.bytes);
                    }
                }
            }
        }
    }

    #[test]
    fn node_split_and_limits() {
        assert!(!is_remote(0, 1, 2));
        assert!(is_remote(1, 2, 2));
        assert!(is_remote(0, 1, 1));
        assert!(check_limits(16383, 256).is_ok());
        assert!(matches!(
            check_limits(16384, 256),
            Err(Error::InvalidArgument { arg: "max_tokens_per_rank", .. })
        ));
    }
}
