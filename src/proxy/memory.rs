//! Shared regions, the command rings and the counters, over raw memory the GPU can also see.
//!
//! One file: the three structures the kernels and the proxy share (`SharedRegion`, the command
//! rings, the counters) share its region ownership (`Owner`) and concurrency rules (the NOTES
//! below).
//!
//! NOTES: every field another agent (GPU, other thread) writes concurrently is accessed through
//! atomics (head, tail, counters) or volatile copies of whole entries after an Acquire of head.
//! Plain `&mut` references into these regions are never formed.

use std::alloc::{self, Layout};
use std::any::Any;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::abi::{FepCmd, CMD_BYTES, HEAD_OFFSET, RING_HDR_BYTES, TAIL_OFFSET};
use super::ProxyError;

/// Alignment every region must have (the ring header is 128 bytes, head/tail on 64-byte lines).
pub const REGION_ALIGN: usize = 128;

enum Owner {
    Host(Layout),
    External(#[allow(dead_code)] Box<dyn Any + Send + Sync>),
}

/// A block of memory shared with other agents: host memory from [`SharedRegion::alloc_host`], or
/// memory someone else owns (pinned mapped host memory from the CUDA layer, a registered buffer)
/// kept alive by a keepalive object.
pub struct SharedRegion {
    ptr: NonNull<u8>,
    len: usize,
    owner: Owner,
}

// SAFETY: the region is plain memory; every concurrent access goes through atomics or through
// the `unsafe` copy functions whose contracts forbid racing writers.
unsafe impl Send for SharedRegion {}
// SAFETY: as above.
unsafe impl Sync for SharedRegion {}

impl std::fmt::Debug for SharedRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedRegion").field("ptr", &self.ptr).field("len", &self.len).finish()
    }
}

impl SharedRegion {
    /// `len` zeroed bytes of host memory, [`REGION_ALIGN`]-aligned (CI and the host backend).
    pub fn alloc_host(len: usize) -> Result<Self, ProxyError> {
        let size = len.max(1).div_ceil(REGION_ALIGN) * REGION_ALIGN;
        let layout = Layout::from_size_align(size, REGION_ALIGN)
            .map_err(|_| ProxyError::Alloc { what: "shared region", bytes: len })?;
        // SAFETY: size is non-zero.
        let ptr = unsafe { alloc::alloc_zeroed(layout) };
        let ptr =
            NonNull::new(ptr).ok_or(ProxyError::Alloc { what: "shared region", bytes: len })?;
        Ok(SharedRegion { ptr, len, owner: Owner::Host(layout) })
    }

    /// Wraps memory owned elsewhere.
    ///
    /// # Safety
    /// `ptr` must be valid for reads and writes of `len` bytes, from any thread, for as long as
    /// `keepalive` lives (it is dropped with the region), and nothing may free or remap it before.
    pub unsafe fn from_raw(
        ptr: *mut u8,
        len: usize,
        keepalive: Box<dyn Any + Send + Sync>,
    ) -> Result<Self, ProxyError> {
        let ptr = NonNull::new(ptr).filter(|p| (p.as_ptr() as usize) % REGION_ALIGN == 0).ok_or(
            ProxyError::Misaligned {
                what: "shared region",
                ptr: ptr as usize,
                align: REGION_ALIGN,
            },
        )?;
        Ok(SharedRegion { ptr, len, owner: Owner::External(keepalive) })
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn check(&self, what: &'static str, offset: usize, length: usize) -> Result<(), ProxyError> {
        match offset.checked_add(length) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(ProxyError::OutOfBounds {
                rank: u32::MAX,
                peer: u32::MAX,
                what,
                offset: offset as u64,
                length: length as u64,
                len: self.len,
            }),
        }
    }

    /// Copies `src` into the region at `offset` (bounds-checked).
    ///
    /// # Safety
    /// Nobody else may read or write these bytes concurrently (e.g. the data of a command not yet
    /// completed, or a receive area a transport may still write).
    pub unsafe fn write(&self, offset: usize, src: &[u8]) -> Result<(), ProxyError> {
        self.check("write", offset, src.len())?;
        // SAFETY: in bounds (checked); exclusivity is the caller's contract.
        unsafe { std::ptr::copy(src.as_ptr(), self.ptr.as_ptr().add(offset), src.len()) };
        Ok(())
    }

    /// Copies bytes at `offset` out of the region into `dst` (bounds-checked).
    ///
    /// # Safety
    /// Nobody may write these bytes concurrently (wait for their arrival counter first).
    pub unsafe fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), ProxyError> {
        self.check("read", offset, dst.len())?;
        // SAFETY: in bounds (checked); no concurrent writer is the caller's contract.
        unsafe { std::ptr::copy(self.ptr.as_ptr().add(offset), dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// The u64 at `offset` as an atomic. Caller guarantees `offset + 8 <= len`, 8-byte alignment.
    #[inline]
    pub(crate) fn atomic_u64(&self, offset: usize) -> &AtomicU64 {
        debug_assert!(offset % 8 == 0 && offset + 8 <= self.len);
        // SAFETY: in bounds and aligned (caller + REGION_ALIGN); AtomicU64 has u64's layout and
        // the memory lives as long as `self`.
        unsafe { &*(self.ptr.as_ptr().add(offset) as *const AtomicU64) }
    }
}

impl Drop for SharedRegion {
    fn drop(&mut self) {
        if let Owner::Host(layout) = self.owner {
            // SAFETY: allocated in alloc_host with this layout.
            unsafe { alloc::dealloc(self.ptr.as_ptr(), layout) };
        }
    }
}

/// Geometry of a ring region: `num_rings` rings, each a 128-byte header plus `capacity` entries,
/// each ring starting on a [`REGION_ALIGN`] boundary.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingLayout {
    pub num_rings: u32,
    pub capacity: u32,
}

impl RingLayout {
    pub fn new(num_rings: u32, capacity: u32) -> Result<Self, ProxyError> {
        if num_rings == 0 {
            return Err(ProxyError::InvalidConfig {
                what: "num_rings",
                msg: "must be >= 1".into(),
            });
        }
        if capacity == 0 {
            return Err(ProxyError::InvalidConfig { what: "capacity", msg: "must be >= 1".into() });
        }
        let l = RingLayout { num_rings, capacity };
        l.stride().checked_mul(num_rings as usize).ok_or(ProxyError::InvalidConfig {
            what: "capacity",
            msg: "ring region too large".into(),
        })?;
        Ok(l)
    }

    /// Bytes from one ring's header to the next.
    pub fn stride(&self) -> usize {
        (RING_HDR_BYTES + CMD_BYTES * self.capacity as usize).div_ceil(REGION_ALIGN) * REGION_ALIGN
    }

    /// Byte offset of ring `ring`'s header in the region.
    pub fn ring_offset(&self, ring: u32) -> usize {
        self.stride() * ring as usize
    }

    /// Total bytes of the region.
    pub fn bytes(&self) -> usize {
        self.stride() * self.num_rings as usize
    }
}

struct RingInner {
    region: SharedRegion,
    layout: RingLayout,
    producer_claimed: Vec<AtomicBool>,
    consumer_claimed: Vec<AtomicBool>,
}

/// The command rings (shared handle). Hand out one [`RingProducer`] per ring (CPU producers) or
/// the raw layout to kernels; a [`super::Proxy`] claims the consumer side.
#[derive(Clone)]
pub struct RingMemory {
    inner: Arc<RingInner>,
}

impl std::fmt::Debug for RingMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RingMemory").field("layout", &self.inner.layout).finish()
    }
}

impl RingMemory {
    /// Rings in zeroed host memory.
    pub fn new_host(layout: RingLayout) -> Result<Self, ProxyError> {
        Self::new(SharedRegion::alloc_host(layout.bytes())?, layout)
    }

    /// Rings over `region`; sets every head and tail to 0. No producer may be running yet.
    pub fn new(region: SharedRegion, layout: RingLayout) -> Result<Self, ProxyError> {
        let layout = RingLayout::new(layout.num_rings, layout.capacity)?;
        if region.len() < layout.bytes() {
            return Err(ProxyError::RegionTooSmall {
                what: "ring region",
                len: region.len(),
                needed: layout.bytes(),
            });
        }
        for r in 0..layout.num_rings {
            let base = layout.ring_offset(r);
            region.atomic_u64(base + HEAD_OFFSET).store(0, Ordering::Release);
            region.atomic_u64(base + TAIL_OFFSET).store(0, Ordering::Release);
        }
        let n = layout.num_rings as usize;
        Ok(RingMemory {
            inner: Arc::new(RingInner {
                region,
                layout,
                producer_claimed: (0..n).map(|_| AtomicBool::new(false)).collect(),
                consumer_claimed: (0..n).map(|_| AtomicBool::new(false)).collect(),
            }),
        })
    }

    pub fn layout(&self) -> RingLayout {
        self.inner.layout
    }

    pub fn region(&self) -> &SharedRegion {
        &self.inner.region
    }

    fn check_ring(&self, ring: u32) -> Result<(), ProxyError> {
        let num_rings = self.inner.layout.num_rings;
        if ring >= num_rings {
            return Err(ProxyError::RingIndex { ring, num_rings });
        }
        Ok(())
    }

    /// Tickets published so far on `ring`.
    pub fn head(&self, ring: u32) -> Result<u64, ProxyError> {
        self.check_ring(ring)?;
        Ok(self.head_atomic(ring).load(Ordering::Acquire))
    }

    /// Tickets consumed (handed to the transport) so far on `ring`.
    pub fn tail(&self, ring: u32) -> Result<u64, ProxyError> {
        self.check_ring(ring)?;
        Ok(self.tail_atomic(ring).load(Ordering::Acquire))
    }

    /// The destination of every command published on `ring` and not yet handed to the
    /// transport (tail to head), counted per rank: what a stalled ring still owes whom. A
    /// diagnostic read of entries the producer may not overwrite (they are unconsumed).
    pub fn queued_destinations(&self, ring: u32) -> Result<Vec<(u32, u64)>, ProxyError> {
        self.check_ring(ring)?;
        let (head, tail) = (self.head(ring)?, self.tail(ring)?);
        let capacity = u64::from(self.inner.layout.capacity);
        let mut per: Vec<(u32, u64)> = Vec::new();
        for t in tail..head.min(tail + capacity) {
            // SAFETY: (t % capacity) < capacity: inside the ring; the entry was published (t <
            // head, Acquire above) and is not reused before the tail passes it.
            let e =
                unsafe { std::ptr::read_volatile(self.entries(ring).add((t % capacity) as usize)) };
            match per.iter_mut().find(|(d, _)| *d == e.dst_rank) {
                Some((_, n)) => *n += 1,
                None => per.push((e.dst_rank, 1)),
            }
        }
        per.sort_unstable();
        Ok(per)
    }

    fn head_atomic(&self, ring: u32) -> &AtomicU64 {
        self.inner.region.atomic_u64(self.inner.layout.ring_offset(ring) + HEAD_OFFSET)
    }

    fn tail_atomic(&self, ring: u32) -> &AtomicU64 {
        self.inner.region.atomic_u64(self.inner.layout.ring_offset(ring) + TAIL_OFFSET)
    }

    fn entries(&self, ring: u32) -> *mut FepCmd {
        let off = self.inner.layout.ring_offset(ring) + RING_HDR_BYTES;
        // SAFETY: in bounds (layout checked against the region in `new`).
        unsafe { self.inner.region.as_ptr().add(off) as *mut FepCmd }
    }

    fn claim(&self, ring: u32, role: &'static str) -> Result<(), ProxyError> {
        self.check_ring(ring)?;
        let flags = if role == "producer" {
            &self.inner.producer_claimed
        } else {
            &self.inner.consumer_claimed
        };
        if flags[ring as usize].swap(true, Ordering::AcqRel) {
            return Err(ProxyError::RingClaimed { ring, role });
        }
        Ok(())
    }

    fn release(&self, ring: u32, role: &'static str) {
        let flags = if role == "producer" {
            &self.inner.producer_claimed
        } else {
            &self.inner.consumer_claimed
        };
        flags[ring as usize].store(false, Ordering::Release);
    }

    /// The producer side of `ring` (one at a time; released on drop). It continues from the head
    /// in memory, so a new producer picks up where a dropped one stopped.
    pub fn producer(&self, ring: u32) -> Result<RingProducer, ProxyError> {
        self.claim(ring, "producer")?;
        let head = self.head_atomic(ring).load(Ordering::Acquire);
        let tail = self.tail_atomic(ring).load(Ordering::Acquire);
        let capacity = u64::from(self.inner.layout.capacity);
        Ok(RingProducer {
            entries: self.entries(ring),
            mem: self.clone(),
            ring,
            capacity,
            head,
            published: head,
            cached_tail: tail,
            idx: (head % capacity) as usize,
        })
    }

    pub(crate) fn consumer(&self, ring: u32) -> Result<RingConsumer, ProxyError> {
        // One stripe is the whole ring; `pop` of the one-element list cannot come back empty.
        self.striped_consumers(ring, 1)?
            .pop()
            .ok_or(ProxyError::RingIndex { ring, num_rings: self.inner.layout.num_rings })
    }

    /// The consumer side of `ring` split `n` ways (claimed once, released when the last stripe
    /// drops): stripe `i` takes the tickets `t` with `t % n == i`, and the tail the producer sees
    /// is the lowest ticket some stripe has not posted yet (every ticket below it was posted by
    /// its stripe). With `n == 1` this is the plain single consumer.
    ///
    /// NOTES: for a lane whose kernels push into ONE ring (the low-latency lane: one batch of
    /// commands per call) but whose bytes are copied by the CPU (shm, tcp): several workers then
    /// post one ring's writes on their own endpoints in parallel. The protocol is order-agnostic
    /// (receivers count arrivals per slot), so which worker posts a command does not matter.
    pub(crate) fn striped_consumers(
        &self,
        ring: u32,
        n: u32,
    ) -> Result<Vec<RingConsumer>, ProxyError> {
        if n == 0 {
            return Err(ProxyError::InvalidConfig { what: "stripes", msg: "must be >= 1".into() });
        }
        self.claim(ring, "consumer")?;
        let base = self.tail_atomic(ring).load(Ordering::Acquire);
        let capacity = u64::from(self.inner.layout.capacity);
        let stride = u64::from(n);
        let first = |i: u64| base + (i + stride - base % stride) % stride;
        let share = Arc::new(StripeShare {
            mem: self.clone(),
            ring,
            next: (0..stride).map(|i| AtomicU64::new(first(i))).collect(),
        });
        Ok((0..stride)
            .map(|i| {
                let tail = first(i);
                RingConsumer {
                    entries: self.entries(ring),
                    share: share.clone(),
                    stripe: i as usize,
                    stride,
                    ring,
                    capacity,
                    tail,
                    cached_head: base,
                    idx: (tail % capacity) as usize,
                }
            })
            .collect())
    }
}

/// What the stripes of one ring share: each stripe's next unposted ticket. Holds the ring's
/// consumer claim until the last stripe drops.
struct StripeShare {
    mem: RingMemory,
    ring: u32,
    next: Vec<AtomicU64>,
}

impl Drop for StripeShare {
    fn drop(&mut self) {
        self.mem.release(self.ring, "consumer");
    }
}

/// A command as a producer states it; the ring adds `seq`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Command {
    pub dst_rank: u32,
    pub local_offset: u64,
    pub remote_offset: u64,
    pub length: u32,
    pub imm: u32,
}

/// The producer side of one ring: the CPU stand-in for a GPU block (tests, host backend).
pub struct RingProducer {
    mem: RingMemory,
    entries: *mut FepCmd,
    ring: u32,
    capacity: u64,
    /// Next ticket to write (staged, maybe unpublished).
    head: u64,
    /// Head as last stored to memory.
    published: u64,
    /// Tail as last read; only ever behind the real tail.
    cached_tail: u64,
    /// `head % capacity`.
    idx: usize,
}

// SAFETY: the raw pointer points into `mem`'s region, which is Send + Sync; the claim makes this
// the ring's only producer.
unsafe impl Send for RingProducer {}

impl std::fmt::Debug for RingProducer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RingProducer")
            .field("ring", &self.ring)
            .field("head", &self.head)
            .field("published", &self.published)
            .finish()
    }
}

impl RingProducer {
    pub fn ring(&self) -> u32 {
        self.ring
    }

    /// Next ticket (staged commands included).
    pub fn head(&self) -> u64 {
        self.head
    }

    fn has_space(&mut self) -> bool {
        if self.head - self.cached_tail < self.capacity {
            return true;
        }
        self.cached_tail = self.mem.tail_atomic(self.ring).load(Ordering::Acquire);
        self.head - self.cached_tail < self.capacity
    }

    /// Writes `cmd` into the next entry without publishing it; `false` (nothing written) when the
    /// ring is full. Publish staged entries with [`RingProducer::publish`].
    #[inline]
    pub fn stage(&mut self, cmd: &Command) -> bool {
        self.stage_raw(&FepCmd {
            local_offset: cmd.local_offset,
            remote_offset: cmd.remote_offset,
            length: cmd.length,
            dst_rank: cmd.dst_rank,
            imm: cmd.imm,
            seq: self.head as u32,
        })
    }

    /// Like [`RingProducer::stage`] but writes the record exactly as given, `seq` included (what a
    /// kernel does; tests use it to corrupt `seq`).
    #[inline]
    pub fn stage_raw(&mut self, entry: &FepCmd) -> bool {
        // NOTES: never write an entry while head - tail == capacity: the consumer may still be
        // reading it (the ring never overwrites an unconsumed command).
        if !self.has_space() {
            return false;
        }
        // SAFETY: idx < capacity, so the entry is inside the ring; the consumer does not read it
        // until head passes it (published with Release below).
        unsafe { std::ptr::write_volatile(self.entries.add(self.idx), *entry) };
        self.head += 1;
        self.idx += 1;
        if self.idx as u64 == self.capacity {
            self.idx = 0;
        }
        true
    }

    /// Publishes every staged entry (one Release store of head).
    #[inline]
    pub fn publish(&mut self) {
        if self.published != self.head {
            self.mem.head_atomic(self.ring).store(self.head, Ordering::Release);
            self.published = self.head;
        }
    }

    /// Stages and publishes `cmd`; `false` when the ring is full.
    pub fn try_push(&mut self, cmd: &Command) -> bool {
        let ok = self.stage(cmd);
        self.publish();
        ok
    }

    /// Stages and publishes `cmd`, waiting (bounded) while the ring is full. Returns its ticket.
    pub fn push(&mut self, cmd: &Command, timeout: Duration) -> Result<u64, ProxyError> {
        let ticket = self.head;
        if self.try_push(cmd) {
            return Ok(ticket);
        }
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            if self.try_push(cmd) {
                return Ok(ticket);
            }
            if start.elapsed() >= timeout {
                return Err(ProxyError::RingFull {
                    ring: self.ring,
                    capacity: self.capacity,
                    head: self.head,
                    tail: self.cached_tail,
                    waited: start.elapsed(),
                    queued: self.mem.queued_destinations(self.ring).unwrap_or_default(),
                });
            }
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }
}

impl Drop for RingProducer {
    fn drop(&mut self) {
        self.publish();
        self.mem.release(self.ring, "producer");
    }
}

/// The consumer side of one ring (or one stripe of it: [`RingMemory::striped_consumers`]), held
/// by a proxy worker.
pub(crate) struct RingConsumer {
    share: Arc<StripeShare>,
    entries: *const FepCmd,
    /// This stripe's index and the number of stripes (1: the whole ring).
    stripe: usize,
    stride: u64,
    pub(crate) ring: u32,
    pub(crate) capacity: u64,
    /// Next ticket of this stripe to consume.
    pub(crate) tail: u64,
    /// Head as last read.
    pub(crate) cached_head: u64,
    /// `tail % capacity`.
    idx: usize,
}

// SAFETY: see RingProducer.
unsafe impl Send for RingConsumer {}

impl RingConsumer {
    /// This stripe's tickets below `cached_head` not consumed yet; `None` when the head is
    /// impossible (behind what this stripe consumed, or more than `capacity` ahead of it).
    #[inline]
    pub(crate) fn pending(&self) -> Option<u64> {
        let (h, t) = (self.cached_head, self.tail);
        if h >= t {
            let d = h - t;
            (d <= self.capacity).then(|| d.div_ceil(self.stride))
        } else {
            // A stripe's next ticket may lie past the head by less than the stride (its
            // ticket is not pushed yet); further means the head went backwards.
            (t - h < self.stride).then_some(0)
        }
    }

    /// Reloads head (Acquire); returns [`Self::pending`].
    #[inline]
    pub(crate) fn refresh(&mut self) -> Option<u64> {
        self.cached_head = self.share.mem.head_atomic(self.ring).load(Ordering::Acquire);
        self.pending()
    }

    /// The entry at `idx` (a volatile copy: a GPU writes it).
    #[inline]
    pub(crate) fn entry(&self) -> FepCmd {
        // SAFETY: idx < capacity; the entry was published by a head the caller Acquired.
        unsafe { std::ptr::read_volatile(self.entries.add(self.idx)) }
    }

    #[inline]
    pub(crate) fn advance(&mut self) {
        self.tail += self.stride;
        if self.stride == 1 {
            self.idx += 1;
            if self.idx as u64 == self.capacity {
                self.idx = 0;
            }
        } else {
            self.idx = (self.tail % self.capacity) as usize;
        }
    }

    /// Publishes what this stripe consumed (Release): the producer may reuse every entry below
    /// the lowest ticket a stripe has not posted.
    #[inline]
    pub(crate) fn publish_tail(&self) {
        let tail = self.share.mem.tail_atomic(self.ring);
        if self.stride == 1 {
            tail.store(self.tail, Ordering::Release);
            return;
        }
        // NOTES (SeqCst): two stripes publishing at once each store their own position and then
        // load the others': with release/acquire both loads may miss the other's store (store
        // buffering, allowed on x86), both minima would be stale and, if those were the last
        // posts before the producer waits for space, nobody would raise the tail again. In the
        // single total order of SeqCst operations the later store's thread sees the earlier one,
        // so one of the two minima is current. fetch_max keeps the tail monotonic whichever
        // stripe's update lands last (a stale, lower minimum never moves it back).
        self.share.next[self.stripe].store(self.tail, Ordering::SeqCst);
        let low = self.share.next.iter().map(|n| n.load(Ordering::SeqCst)).min();
        tail.fetch_max(low.unwrap_or(self.tail), Ordering::SeqCst);
    }
}

/// Bytes from one slot's counters to the next, and from one ring's `sends_completed` to the next
/// (fep_abi.h `FEP_COUNTER_STRIDE`): a cache line each.
///
/// NOTES: kernels poll these words over PCIe. Measured on the H200 (event trace): reads of ONE
/// host cache line from many SMs are served one after another (about 1-2 us each), so words that
/// different waiters poll must not share a line; a slot's `arrivals`, `sums` and `packed` do
/// (they describe the same arrivals).
pub const COUNTER_STRIDE: usize = crate::abi::FEP_COUNTER_STRIDE as usize;

const ARRIVALS_OFFSET: usize = crate::abi::FEP_COUNTER_ARRIVALS_OFFSET as usize;
const SUMS_OFFSET: usize = crate::abi::FEP_COUNTER_SUMS_OFFSET as usize;
const PACKED_OFFSET: usize = crate::abi::FEP_COUNTER_PACKED_OFFSET as usize;
const _: () = assert!(ARRIVALS_OFFSET % 8 == 0 && ARRIVALS_OFFSET + 8 <= COUNTER_STRIDE);
const _: () = assert!(SUMS_OFFSET % 8 == 0 && SUMS_OFFSET + 8 <= COUNTER_STRIDE);
const _: () = assert!(PACKED_OFFSET % 8 == 0 && PACKED_OFFSET + 8 <= COUNTER_STRIDE);
const _: () = assert!(
    ARRIVALS_OFFSET != SUMS_OFFSET
        && SUMS_OFFSET != PACKED_OFFSET
        && ARRIVALS_OFFSET != PACKED_OFFSET
);

/// The `packed` word for `arrivals` and `sums`: `((arrivals mod 2^32) << 32) | (sums mod 2^32)`
/// (fep_abi.h `FEP_COUNTER_PACKED_OFFSET`).
#[inline]
pub const fn pack_counters(arrivals: u64, sums: u64) -> u64 {
    ((arrivals & 0xffff_ffff) << 32) | (sums & 0xffff_ffff)
}

/// The halves of a `packed` word: (arrivals mod 2^32, sums mod 2^32).
#[inline]
pub const fn unpack_counters(packed: u64) -> (u32, u32) {
    ((packed >> 32) as u32, packed as u32)
}

/// `packed` after one more arrival carrying `value`: each half advances modulo 2^32 on its own
/// (no carry from the sums half into the arrivals half).
#[inline]
pub const fn packed_add(packed: u64, value: u32) -> u64 {
    let (a, s) = unpack_counters(packed);
    ((a.wrapping_add(1) as u64) << 32) | s.wrapping_add(value) as u64
}

/// Geometry of the counter region: per slot one [`COUNTER_STRIDE`] line holding `arrivals` (u64
/// at +0: writes that arrived), `sums` (u64 at +8: the sum of their immediate values) and
/// `packed` (u64 at +16: `((arrivals mod 2^32) << 32) | (sums mod 2^32)`, see
/// [`CounterMemory::record_arrival`]); then, from a [`REGION_ALIGN`] boundary, one line per ring
/// holding `sends_completed` (u64 at +0). The offsets are fep_abi.h's `FEP_COUNTER_*_OFFSET`.
///
/// NOTES: `packed` lets a kernel learn a slot's arrival and its count from ONE 64-bit read of
/// mapped host memory (one PCIe round trip; fep_ll.cuh px_count) instead of reading `arrivals`
/// and then `sums`. Its halves wrap, so its readers compare modulo 2^32; host code keeps using
/// the full-width `arrivals` and `sums`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CounterLayout {
    pub num_slots: u32,
    pub num_rings: u32,
}

impl CounterLayout {
    fn lines_bytes(n: u32) -> usize {
        (COUNTER_STRIDE * n as usize).div_ceil(REGION_ALIGN) * REGION_ALIGN
    }

    /// Offset of `arrivals[0]`; slot `s` at `+ s * COUNTER_STRIDE`.
    pub fn arrivals_offset(&self) -> usize {
        ARRIVALS_OFFSET
    }

    /// Offset of `sums[0]`; slot `s` at `+ s * COUNTER_STRIDE`.
    pub fn sums_offset(&self) -> usize {
        SUMS_OFFSET
    }

    /// Offset of `packed[0]`; slot `s` at `+ s * COUNTER_STRIDE`.
    pub fn packed_offset(&self) -> usize {
        PACKED_OFFSET
    }

    /// Offset of ring 0's `sends_completed`; ring `r` at `+ r * COUNTER_STRIDE`.
    pub fn sends_completed_offset(&self) -> usize {
        Self::lines_bytes(self.num_slots)
    }

    /// Offset of `arrivals[slot]`.
    pub fn arrival_offset(&self, slot: u32) -> usize {
        self.arrivals_offset() + COUNTER_STRIDE * slot as usize
    }

    pub fn bytes(&self) -> usize {
        Self::lines_bytes(self.num_slots) + Self::lines_bytes(self.num_rings)
    }
}

struct CounterInner {
    region: SharedRegion,
    layout: CounterLayout,
}

/// Arrival counters and send completions (shared handle). Workers write them; kernels and CPU
/// consumers poll them.
#[derive(Clone)]
pub struct CounterMemory {
    inner: Arc<CounterInner>,
}

impl std::fmt::Debug for CounterMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CounterMemory").field("layout", &self.inner.layout).finish()
    }
}

impl CounterMemory {
    pub fn new_host(layout: CounterLayout) -> Result<Self, ProxyError> {
        Self::new(SharedRegion::alloc_host(layout.bytes())?, layout)
    }

    /// Counters over `region`; zeroes them all.
    pub fn new(region: SharedRegion, layout: CounterLayout) -> Result<Self, ProxyError> {
        if layout.num_slots == 0 {
            return Err(ProxyError::InvalidConfig {
                what: "num_slots",
                msg: "must be >= 1".into(),
            });
        }
        if region.len() < layout.bytes() {
            return Err(ProxyError::RegionTooSmall {
                what: "counter region",
                len: region.len(),
                needed: layout.bytes(),
            });
        }
        let c = CounterMemory { inner: Arc::new(CounterInner { region, layout }) };
        c.reset();
        Ok(c)
    }

    pub fn layout(&self) -> CounterLayout {
        self.inner.layout
    }

    pub fn region(&self) -> &SharedRegion {
        &self.inner.region
    }

    /// Zeroes every counter. Only while nothing is in flight (between phases).
    pub fn reset(&self) {
        for off in (0..self.inner.layout.bytes()).step_by(8) {
            self.inner.region.atomic_u64(off).store(0, Ordering::Release);
        }
    }

    fn check_slot(&self, slot: u32) -> Result<(), ProxyError> {
        let num_slots = self.inner.layout.num_slots;
        if slot >= num_slots {
            return Err(ProxyError::SlotIndex { slot, num_slots });
        }
        Ok(())
    }

    #[inline]
    pub(crate) fn arrivals_atomic(&self, slot: u32) -> &AtomicU64 {
        self.inner.region.atomic_u64(self.inner.layout.arrival_offset(slot))
    }

    #[inline]
    pub(crate) fn sums_atomic(&self, slot: u32) -> &AtomicU64 {
        self.inner
            .region
            .atomic_u64(self.inner.layout.sums_offset() + COUNTER_STRIDE * slot as usize)
    }

    #[inline]
    pub(crate) fn packed_atomic(&self, slot: u32) -> &AtomicU64 {
        self.inner
            .region
            .atomic_u64(self.inner.layout.packed_offset() + COUNTER_STRIDE * slot as usize)
    }

    #[inline]
    pub(crate) fn sends_atomic(&self, ring: u32) -> &AtomicU64 {
        let l = &self.inner.layout;
        self.inner.region.atomic_u64(l.sends_completed_offset() + COUNTER_STRIDE * ring as usize)
    }

    /// Writes that arrived for `slot` (Acquire: their bytes and `sums` are visible after it).
    pub fn arrivals(&self, slot: u32) -> Result<u64, ProxyError> {
        self.check_slot(slot)?;
        Ok(self.arrivals_atomic(slot).load(Ordering::Acquire))
    }

    /// Sum of the immediate values that arrived for `slot`.
    pub fn sums(&self, slot: u32) -> Result<u64, ProxyError> {
        self.check_slot(slot)?;
        Ok(self.sums_atomic(slot).load(Ordering::Acquire))
    }

    /// `slot`'s `packed` word: `((arrivals mod 2^32) << 32) | (sums mod 2^32)` (Acquire: what
    /// the arrivals it counts carried is visible after it). Split it with [`unpack_counters`].
    pub fn packed(&self, slot: u32) -> Result<u64, ProxyError> {
        self.check_slot(slot)?;
        Ok(self.packed_atomic(slot).load(Ordering::Acquire))
    }

    /// Local completions of `ring`'s writes: its send data up to that many commands is reusable.
    pub fn sends_completed(&self, ring: u32) -> Result<u64, ProxyError> {
        let num_rings = self.inner.layout.num_rings;
        if ring >= num_rings {
            return Err(ProxyError::RingIndex { ring, num_rings });
        }
        Ok(self.sends_atomic(ring).load(Ordering::Acquire))
    }

    /// Records one arrival. `slot` was bounds-checked by the caller.
    #[inline]
    pub(crate) fn record_arrival(&self, slot: u32, value: u32) {
        // NOTES: sums first, then packed, then arrivals, the last two with Release: whoever
        // Acquires arrivals == n also sees the n values summed in `sums` and in `packed` (and
        // the bytes the transport wrote before the event); a kernel that Acquires `packed` with
        // n in its high half sees those bytes too (it reads nothing else of the line).
        // `packed` changes by a compare-exchange of the whole word, not a fetch_add of
        // (1 << 32 | value): a fetch_add would carry into the arrivals half whenever the sums
        // half wraps. Several workers may record on the same slot at once; a lost race retries
        // from the value that won, so every record lands exactly once, and the word a reader
        // loads is always the result of whole records (both halves of the same arrivals). Each
        // record is an RMW, so it continues the release sequence of the records before it.
        self.sums_atomic(slot).fetch_add(u64::from(value), Ordering::Relaxed);
        let packed = self.packed_atomic(slot);
        let mut cur = packed.load(Ordering::Relaxed);
        while let Err(now) = packed.compare_exchange_weak(
            cur,
            packed_add(cur, value),
            Ordering::Release,
            Ordering::Relaxed,
        ) {
            cur = now;
        }
        self.arrivals_atomic(slot).fetch_add(1, Ordering::Release);
    }

    /// Sets `slot`'s three counters as if `arrivals` writes summing to `sums` had arrived
    /// (tests: counters near 2^32). Only while nothing records on the slot.
    #[cfg(test)]
    pub(crate) fn preset(&self, slot: u32, arrivals: u64, sums: u64) {
        self.sums_atomic(slot).store(sums, Ordering::Relaxed);
        self.packed_atomic(slot).store(pack_counters(arrivals, sums), Ordering::Release);
        self.arrivals_atomic(slot).store(arrivals, Ordering::Release);
    }

    #[inline]
    pub(crate) fn record_sends(&self, ring: u32, count: u32) {
        self.sends_atomic(ring).fetch_add(u64::from(count), Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_are_aligned_and_disjoint() {
        let l = RingLayout::new(3, 5).unwrap();
        assert_eq!(l.stride(), 384); // 128 + 160 -> 288 -> 384
        assert_eq!(l.ring_offset(2), 768);
        assert_eq!(l.bytes(), 1152);
        assert!(RingLayout::new(0, 4).is_err());
        assert!(RingLayout::new(1, 0).is_err());
        let c = CounterLayout { num_slots: 17, num_rings: 3 };
        assert_eq!(COUNTER_STRIDE, 64);
        assert_eq!(c.sums_offset(), 8);
        assert_eq!(c.packed_offset(), 16);
        assert_eq!(c.arrival_offset(2), 128);
        assert_eq!(c.sends_completed_offset(), 1152); // 17 lines -> 1088 -> 1152
        assert_eq!(c.bytes(), 1152 + 256);
    }

    const LOW: u64 = 1 << 32;

    /// The line as the kernels address it: `packed` at +16 of the slot's line, beside
    /// `arrivals` (+0) and `sums` (+8).
    fn line_word(c: &CounterMemory, slot: u32, offset: usize) -> u64 {
        let mut b = [0u8; 8];
        // SAFETY: single-threaded here; in bounds.
        unsafe { c.region().read(COUNTER_STRIDE * slot as usize + offset, &mut b).unwrap() };
        u64::from_ne_bytes(b)
    }

    #[test]
    fn packed_word_follows_single_records() {
        let c = CounterMemory::new_host(CounterLayout { num_slots: 3, num_rings: 1 }).unwrap();
        c.record_arrival(0, 5);
        c.record_arrival(0, 7);
        c.record_arrival(2, 0); // an empty write: counted, adds nothing
        assert_eq!((c.arrivals(0).unwrap(), c.sums(0).unwrap()), (2, 12));
        assert_eq!(c.packed(0).unwrap(), (2 << 32) | 12);
        assert_eq!(unpack_counters(c.packed(0).unwrap()), (2, 12));
        assert_eq!(c.packed(1).unwrap(), 0, "other slots untouched");
        assert_eq!(c.packed(2).unwrap(), pack_counters(1, 0));
        assert_eq!(line_word(&c, 0, 0), 2);
        assert_eq!(line_word(&c, 0, 8), 12);
        assert_eq!(line_word(&c, 0, 16), (2 << 32) | 12);
        assert!(matches!(c.packed(3), Err(ProxyError::SlotIndex { slot: 3, num_slots: 3 })));
        c.reset();
        assert_eq!(c.packed(0).unwrap(), 0, "reset zeroes packed too");
    }

    /// The sums half passing 2^32 leaves the arrivals half alone (a fetch_add of
    /// `1 << 32 | value` would carry into it), and the arrivals half wraps on its own.
    #[test]
    fn packed_halves_wrap_without_carry() {
        assert_eq!(packed_add(pack_counters(5, LOW - 1), 1), pack_counters(6, 0));
        assert_eq!(packed_add(pack_counters(5, LOW - 3), 16383), pack_counters(6, 16380));
        assert_eq!(packed_add(u64::MAX, 1), 0);
        assert_eq!(packed_add(pack_counters(LOW - 1, 9), 0), pack_counters(0, 9));
        assert_eq!(pack_counters(LOW + 3, 5 * LOW + 4), (3 << 32) | 4);

        let c = CounterMemory::new_host(CounterLayout { num_slots: 2, num_rings: 1 }).unwrap();
        c.preset(0, 7, LOW - 3);
        c.record_arrival(0, 5);
        assert_eq!(c.packed(0).unwrap(), (8 << 32) | 2);
        assert_eq!((c.arrivals(0).unwrap(), c.sums(0).unwrap()), (8, LOW + 2));
        c.preset(1, LOW - 1, 3 * LOW - 1);
        c.record_arrival(1, 1);
        assert_eq!(c.packed(1).unwrap(), 0, "both halves wrap to zero, nothing spills");
        assert_eq!((c.arrivals(1).unwrap(), c.sums(1).unwrap()), (LOW, 3 * LOW));
        c.record_arrival(1, 16383);
        assert_eq!(c.packed(1).unwrap(), (1 << 32) | 16383);
    }

    /// Several workers record on the same slots at once (the proxy's workers share the counter
    /// memory): every record lands in both halves, across 2^32 in both.
    #[test]
    fn concurrent_records_all_land_in_packed() {
        const THREADS: u64 = 4;
        const PER: u64 = 100_000;
        let c = CounterMemory::new_host(CounterLayout { num_slots: 2, num_rings: 1 }).unwrap();
        let (a0, s0) = (LOW - 1_000, LOW - 12_345);
        c.preset(1, a0, s0);
        let value = |t: u64, i: u64| ((t * 7_919 + i * 104_729) % 16_384) as u32;
        std::thread::scope(|s| {
            for t in 0..THREADS {
                let c = c.clone();
                s.spawn(move || {
                    for i in 0..PER {
                        c.record_arrival((i % 2) as u32, value(t, i));
                    }
                });
            }
        });
        for slot in 0..2u32 {
            let (base_a, base_s) = if slot == 1 { (a0, s0) } else { (0, 0) };
            let n = THREADS * PER / 2;
            let sum: u64 = (0..THREADS)
                .flat_map(|t| {
                    (0..PER).filter(move |i| i % 2 == u64::from(slot)).map(move |i| (t, i))
                })
                .map(|(t, i)| u64::from(value(t, i)))
                .sum();
            assert_eq!(c.arrivals(slot).unwrap(), base_a + n, "slot {slot} arrivals");
            assert_eq!(c.sums(slot).unwrap(), base_s + sum, "slot {slot} sums");
            assert_eq!(
                c.packed(slot).unwrap(),
                pack_counters(base_a + n, base_s + sum),
                "slot {slot} packed"
            );
        }
        assert!(c.arrivals(1).unwrap() > LOW && c.sums(1).unwrap() > LOW, "both halves wrapped");
    }

    /// What a kernel's single load can see while workers record: always whole records (both
    /// halves of the same arrivals, here all carrying the same value) and never going back.
    #[test]
    fn concurrent_readers_see_whole_records() {
        const THREADS: u64 = 3;
        const PER: u64 = 100_000;
        const V: u32 = 3;
        let c = CounterMemory::new_host(CounterLayout { num_slots: 1, num_rings: 1 }).unwrap();
        let (a0, s0) = (LOW - 30_000, LOW - 50_000);
        c.preset(0, a0, s0);
        let done = AtomicBool::new(false);
        std::thread::scope(|s| {
            let reader = s.spawn(|| {
                let (h0, l0) = unpack_counters(pack_counters(a0, s0));
                let mut last = 0u32;
                let mut reads = 0u64;
                loop {
                    let finished = done.load(Ordering::Acquire);
                    let (h, l) = unpack_counters(c.packed(0).unwrap());
                    let n = h.wrapping_sub(h0);
                    assert_eq!(l.wrapping_sub(l0), n.wrapping_mul(V), "torn or carried: {h} {l}");
                    assert!(n >= last, "went back from {last} to {n}");
                    last = n;
                    reads += 1;
                    if finished {
                        return (last, reads);
                    }
                }
            });
            let writers: Vec<_> = (0..THREADS)
                .map(|_| {
                    s.spawn(|| {
                        for _ in 0..PER {
                            c.record_arrival(0, V);
                        }
                    })
                })
                .collect();
            for w in writers {
                w.join().unwrap();
            }
            done.store(true, Ordering::Release);
            let (last, reads) = reader.join().unwrap();
            assert_eq!(u64::from(last), THREADS * PER, "after {reads} reads");
        });
        assert_eq!(c.packed(0).unwrap(), pack_counters(a0 + THREADS * PER, s0 + THREADS * PER * 3));
    }

    #[test]
    fn producer_never_overwrites_and_claims_are_exclusive() {
        let rings = RingMemory::new_host(RingLayout::new(2, 3).unwrap()).unwrap();
        let mut p = rings.producer(1).unwrap();
        assert!(matches!(rings.producer(1), Err(ProxyError::RingClaimed { ring: 1, .. })));
        assert!(matches!(rings.producer(2), Err(ProxyError::RingIndex { ring: 2, .. })));
        let cmd = Command { dst_rank: 0, imm: 7, ..Default::default() };
        for _ in 0..3 {
            assert!(p.try_push(&cmd));
        }
        assert!(!p.try_push(&cmd), "4th push into a 3-entry ring must wait");
        let err = p.push(&cmd, Duration::from_millis(5)).unwrap_err();
        assert!(matches!(err, ProxyError::RingFull { ring: 1, head: 3, tail: 0, .. }), "{err}");
        assert_eq!(rings.head(1).unwrap(), 3);
        let mut c = rings.consumer(1).unwrap();
        assert_eq!(c.refresh(), Some(3));
        for t in 0..3u32 {
            assert_eq!(c.entry().seq, t);
            c.advance();
        }
        c.publish_tail();
        assert!(p.try_push(&cmd));
        assert_eq!(c.refresh(), Some(1));
        assert_eq!(c.entry().seq, 3);
        drop(p);
        let p2 = rings.producer(1).unwrap();
        assert_eq!(p2.head(), 4);
    }

    #[test]
    fn stripes_share_a_ring_and_publish_the_lowest_unposted_ticket() {
        let rings = RingMemory::new_host(RingLayout::new(1, 4).unwrap()).unwrap();
        let mut p = rings.producer(0).unwrap();
        let cmd = Command { dst_rank: 0, imm: 7, ..Default::default() };
        assert!(p.try_push(&cmd)); // ticket 0, before the stripes exist
        {
            let mut c = rings.consumer(0).unwrap();
            assert_eq!(c.refresh(), Some(1));
            c.advance();
            c.publish_tail();
        }
        let mut s = rings.striped_consumers(0, 3).unwrap();
        assert!(matches!(rings.consumer(0), Err(ProxyError::RingClaimed { .. })));
        // From tail 1: stripe 1 starts at ticket 1, stripe 2 at 2, stripe 0 at 3.
        assert_eq!(s.iter().map(|c| c.tail).collect::<Vec<_>>(), [3, 1, 2]);
        for _ in 0..4 {
            assert!(p.try_push(&cmd)); // tickets 1..=4
        }
        assert!(!p.try_push(&cmd), "ring full: tail 1 + capacity 4");
        assert_eq!(s[0].refresh(), Some(1)); // ticket 3 (4 is stripe 1's)
        assert_eq!(s[1].refresh(), Some(2)); // 1 and 4
        assert_eq!(s[2].refresh(), Some(1)); // 2
                                             // Stripe 2 posts ticket 2: tickets 1 (stripe 1) is still unposted, the tail stays.
        assert_eq!(s[2].entry().seq, 2);
        s[2].advance();
        s[2].publish_tail();
        assert_eq!(rings.tail(0).unwrap(), 1);
        assert_eq!(s[2].refresh(), Some(0), "ticket 5 is not pushed yet");
        // Stripe 1 posts 1: everything below 3 (stripe 0's next) is posted.
        assert_eq!(s[1].entry().seq, 1);
        s[1].advance();
        s[1].publish_tail();
        assert_eq!(rings.tail(0).unwrap(), 3);
        assert_eq!(s[1].entry().seq, 4);
        // A head behind what a stripe consumed is impossible.
        s[1].cached_head = 0;
        assert_eq!(s[1].pending(), None);
        drop(s);
        // The claim goes with the last stripe.
        assert!(rings.consumer(0).is_ok());
    }

    #[test]
    fn raw_regions_are_checked() {
        let mut buf = vec![0u8; 4096];
        let misaligned = buf.as_mut_ptr().wrapping_add(1 + (128 - buf.as_ptr() as usize % 128));
        // SAFETY: the pointer is rejected before use.
        let r = unsafe { SharedRegion::from_raw(misaligned, 64, Box::new(())) };
        assert!(matches!(r, Err(ProxyError::Misaligned { .. })));
        // SAFETY: null is rejected.
        let r = unsafe { SharedRegion::from_raw(std::ptr::null_mut(), 64, Box::new(())) };
        assert!(matches!(r, Err(ProxyError::Misaligned { .. })));
        let small = SharedRegion::alloc_host(100).unwrap();
        let r = RingMemory::new(small, RingLayout::new(1, 4).unwrap());
        assert!(matches!(r, Err(ProxyError::RegionTooSmall { needed: 256, .. })));
        let reg = SharedRegion::alloc_host(16).unwrap();
        // SAFETY: single-threaded.
        unsafe {
            assert!(reg.write(10, &[1; 7]).is_err());
            reg.write(8, &[3; 8]).unwrap();
            let mut out = [0u8; 16];
            reg.read(0, &mut out).unwrap();
            assert_eq!(out, [0, 0, 0, 0, 0, 0, 0, 0, 3, 3, 3, 3, 3, 3, 3, 3]);
        }
    }
}
