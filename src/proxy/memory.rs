//! Shared regions, the command rings and the counters, over raw memory the GPU can also see.
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
        self.claim(ring, "consumer")?;
        let tail = self.tail_atomic(ring).load(Ordering::Acquire);
        let capacity = u64::from(self.inner.layout.capacity);
        Ok(RingConsumer {
            entries: self.entries(ring),
            mem: self.clone(),
            ring,
            capacity,
            tail,
            cached_head: tail,
            idx: (tail % capacity) as usize,
        })
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

/// The consumer side of one ring, held by a proxy worker.
pub(crate) struct RingConsumer {
    mem: RingMemory,
    entries: *const FepCmd,
    pub(crate) ring: u32,
    pub(crate) capacity: u64,
    /// Next ticket to consume.
    pub(crate) tail: u64,
    /// Head as last read.
    pub(crate) cached_head: u64,
    /// `tail % capacity`.
    pub(crate) idx: usize,
}

// SAFETY: see RingProducer.
unsafe impl Send for RingConsumer {}

impl RingConsumer {
    /// Reloads head (Acquire); returns how many entries are readable.
    #[inline]
    pub(crate) fn refresh(&mut self) -> u64 {
        self.cached_head = self.mem.head_atomic(self.ring).load(Ordering::Acquire);
        self.cached_head.wrapping_sub(self.tail)
    }

    /// The entry at `idx` (a volatile copy: a GPU writes it).
    #[inline]
    pub(crate) fn entry(&self) -> FepCmd {
        // SAFETY: idx < capacity; the entry was published by a head the caller Acquired.
        unsafe { std::ptr::read_volatile(self.entries.add(self.idx)) }
    }

    #[inline]
    pub(crate) fn advance(&mut self) {
        self.tail += 1;
        self.idx += 1;
        if self.idx as u64 == self.capacity {
            self.idx = 0;
        }
    }

    /// Publishes `tail` (Release): the producer may now reuse the entries before it.
    #[inline]
    pub(crate) fn publish_tail(&self) {
        self.mem.tail_atomic(self.ring).store(self.tail, Ordering::Release);
    }
}

impl Drop for RingConsumer {
    fn drop(&mut self) {
        self.mem.release(self.ring, "consumer");
    }
}

/// Bytes from one slot's counters to the next, and from one ring's `sends_completed` to the next
/// (fep_abi.h `FEP_COUNTER_STRIDE`): a cache line each.
///
/// NOTES: kernels poll these words over PCIe. Measured on the H200 (event trace): reads of ONE
/// host cache line from many SMs are served one after another (about 1-2 us each), so words that
/// different waiters poll must not share a line; a slot's `arrivals` and `sums` do (they are read
/// together).
pub const COUNTER_STRIDE: usize = crate::abi::FEP_COUNTER_STRIDE as usize;

/// Geometry of the counter region: per slot one [`COUNTER_STRIDE`] line holding `arrivals` (u64
/// at +0) and `sums` (u64 at +8); then, from a [`REGION_ALIGN`] boundary, one line per ring
/// holding `sends_completed` (u64 at +0).
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
        0
    }

    /// Offset of `sums[0]`; slot `s` at `+ s * COUNTER_STRIDE`.
    pub fn sums_offset(&self) -> usize {
        8
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
        // NOTES: sums first, then arrivals with Release: whoever Acquires arrivals == n also
        // sees the n values summed (and the bytes the transport wrote before the event).
        self.sums_atomic(slot).fetch_add(u64::from(value), Ordering::Relaxed);
        self.arrivals_atomic(slot).fetch_add(1, Ordering::Release);
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
        assert_eq!(c.arrival_offset(2), 128);
        assert_eq!(c.sends_completed_offset(), 1152); // 17 lines -> 1088 -> 1152
        assert_eq!(c.bytes(), 1152 + 256);
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
        assert_eq!(c.refresh(), 3);
        for t in 0..3u32 {
            assert_eq!(c.entry().seq, t);
            c.advance();
        }
        c.publish_tail();
        assert!(p.try_push(&cmd));
        assert_eq!(c.refresh(), 1);
        assert_eq!(c.entry().seq, 3);
        drop(p);
        let p2 = rings.producer(1).unwrap();
        assert_eq!(p2.head(), 4);
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
