// fep_ll.cuh: helpers shared by the low-latency kernels (kernels/ll_dispatch.cu,
// kernels/ll_combine.cu): buffer/flag addressing (src/protocol/plan/ll.rs LlLayout), bf16 bit
// tricks, fp8 group scales bit-identical to src/protocol/quant.rs, and the "last block publishes"
// ticket.
#pragma once

#include <stdint.h>

#include "fep_abi.h"
#include "fep_device.cuh"

namespace fep {
namespace ll {

constexpr int kThreads = FEP_LL_THREADS;
constexpr int kWarps = kThreads / 32;
constexpr float kFp8Max = 448.0f;
constexpr float kFp8AmaxMin = 1e-4f;  // src/protocol/quant.rs FP8_AMAX_MIN (DeepEP's kFP8Margin)

// LlLayout::unit_offset: ((set * 2 + area) * E + unit) * unit_bytes, or with a proxy lane that
// places units per registered chunk (fep_ll_proxy.units_per_region), the host's LlGeometry.
__device__ __forceinline__ uint64_t unit_offset(int set, int area, int num_experts, int unit,
                                                uint64_t unit_bytes, const fep_ll_proxy& px) {
    const uint64_t u = static_cast<uint64_t>(set * 2 + area) * num_experts + unit;
    if (px.units_per_region == 0) return u * unit_bytes;
    return (u / px.units_per_region) * px.region_stride + (u % px.units_per_region) * unit_bytes;
}

// Flag slot: [set][phase][E].
__device__ __forceinline__ uint64_t* flag_ptr(uint64_t flags, int set, int phase, int num_experts,
                                              int unit) {
    return reinterpret_cast<uint64_t*>(flags) +
           (static_cast<uint64_t>(set * 2 + phase) * num_experts + unit);
}

__device__ __forceinline__ uint64_t flag_value(uint64_t tag, uint32_t count) {
    return (tag << 32) | count;
}

__device__ __forceinline__ int warp_sum(int v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

// f32 -> bf16 bits, round to nearest even: exactly src/protocol/quant.rs f32_to_bf16 (NaN kept
// quiet).
__device__ __forceinline__ uint32_t f32_to_bf16(float x) {
    const uint32_t b = __float_as_uint(x);
    if ((b & 0x7fffffffu) > 0x7f800000u) return (b >> 16) | 0x40u;
    return (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
}

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
    return f32_to_bf16(lo) | (f32_to_bf16(hi) << 16);
}

// src/protocol/quant.rs fp8_group_scale: returns mult (into the cast), writes the stored scale.
__device__ __forceinline__ float fp8_group_scale(float amax, bool round_scale, float* scale) {
    amax = fmaxf(amax, kFp8AmaxMin);
    if (round_scale && isfinite(amax)) {
        const uint32_t bits = __float_as_uint(amax * (1.0f / kFp8Max));
        const int e = static_cast<int>((bits >> 23) & 0xffu) - 127 + ((bits & 0x7fffffu) != 0u);
        *scale = __uint_as_float(static_cast<uint32_t>(e + 127) << 23);
        return __uint_as_float(static_cast<uint32_t>(127 - e) << 23);
    }
    *scale = amax * (1.0f / kFp8Max);
    return kFp8Max / amax;  // NOTES: IEEE division (no fast-math), as Rust's `/`
}

// Two f32 -> two e4m3 bytes (x in the low byte), round to nearest even, SATFINITE.
__device__ __forceinline__ uint32_t fp8x2(float x, float y) {
    uint16_t r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %2, %1;" : "=h"(r) : "f"(x), "f"(y));
    return r;
}

// Every block calls this once at the end of its sends (all threads). Returns true in exactly one
// block: the last to finish, which then publishes the flags; it also re-zeroes the ticket. A grid
// of one block is its own last block: no atomic, no fence (the ticket stays zero).
// NOTES (ordering): the block barrier makes every thread's payload stores (peer GPU memory, or
// with a proxy lane the mapped host memory the CPU proxy reads) performed relative to thread 0,
// whose fence at system scope is cumulative over them (PTX memory model; scope .sys includes the
// host's threads) before its ticket increment; the last block fences again after reading the
// ticket and passes a barrier, so the release stores that publish (flags, or the proxy ring's
// head) follow every block's payload in causality order, and a reader that acquires them sees all
// rows. Every thread used to fence its own stores as well when the CPU reads them
// (a proxy lane): redundant under the model, and each system fence waits for the PCIe writes in
// flight (the 1-token proxy phase spent ~11 us between staging and publishing; ll_notes.md).
__device__ __forceinline__ bool last_block_ticket(uint32_t* ticket) {
    __shared__ int s_last;
    __syncthreads();
    if (gridDim.x == 1) return true;
    if (threadIdx.x == 0) {
        __threadfence_system();
        const uint32_t old = atomicAdd(ticket, 1u);
        __threadfence_system();
        s_last = (old == gridDim.x - 1);
        if (s_last) *ticket = 0u;  // every other block has taken its ticket already
    }
    __syncthreads();
    return s_last != 0;
}

// Programmatic dependent launch (sm_90). Each LL kernel calls this first: it waits until the
// previous grid of the stream has completed and its memory is visible (a no-op unless the kernel
// was launched with the programmatic-stream-serialization attribute), then lets the next grid
// launch. src/cuda/launch.rs gives the attribute only to a receive launched right after its send
// on the same stream ("chained"; FEP_LL_PDL=0: never), so the receive's blocks are resident and
// waiting when the send ends. Not across anything else: with an event record/wait between the
// two kernels, or across CUDA-graph boundaries, the H200 let the later kernel pass the wait
// while the earlier one still ran (kernels/ll_notes.md, "PDL"). Nothing is read before
// the wait.
__device__ __forceinline__ void pdl_enter() {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// Exclusive prefix sum of `cnt[0..n)` into `start[0..n]` (start[n] = total), n <= kThreads * 8.
// All threads of the block call it; ends with a barrier.
__device__ __forceinline__ void block_exclusive_scan(const int32_t* cnt, int32_t* start, int n) {
    __shared__ int32_t s_warp[kWarps];
    constexpr int kPer = 8;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int first = tid * kPer;
    int local = 0;
#pragma unroll
    for (int j = 0; j < kPer; ++j) local += (first + j < n) ? cnt[first + j] : 0;
    int incl = local;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int v = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += v;
    }
    if (lane == 31) s_warp[warp] = incl;
    __syncthreads();
    int warp_base = 0;
    for (int w = 0; w < warp; ++w) warp_base += s_warp[w];
    int run = warp_base + incl - local;
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
        if (first + j < n) {
            start[first + j] = run;
            run += cnt[first + j];
        }
    }
    if (tid == kThreads - 1) start[n] = run;  // the last thread's run is the total
    __syncthreads();
}

// Largest u with start[u] <= row (start ascending, start[0] = 0, row < start[n]).
__device__ __forceinline__ int find_unit(const int32_t* start, int n, int row) {
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (start[mid] <= row) lo = mid; else hi = mid - 1;
    }
    return lo;
}

// Rows are copied by warps in segments of kSegChunks 16-byte chunks per lane (8 loads in flight).
constexpr int kSegChunks = 8;
// fp8 scales per received row loaded by each lane before the row's copy (dispatch receive).
constexpr int kScaleBatch = 4;
constexpr int kSegBytes = 32 * kSegChunks * 16;
static_assert(kSegBytes == FEP_LL_SEG_BYTES, "the host sizes LL grids with FEP_LL_SEG_BYTES");

// Loads of received rows. `sys`: the rows may have been written by a NIC or the CPU (the proxy
// path: mapped host memory, or GPU memory under FI_HMEM), which the GPU's L2 does not see:
// ld.cv drops a matching L2 line of system memory and fetches again (PTX ISA, cache operators),
// so a row read two calls ago at the same address is never returned stale.
template <typename T>
__device__ __forceinline__ T ld_recv(const T* p, bool sys) {
    return sys ? __ldcv(p) : __ldcg(p);
}

// One warp copies chunks [seg * 256, seg * 256 + 256) of a row of n16 chunks, src read via L2
// (`sys`: see ld_recv).
__device__ __forceinline__ void copy_seg(const uint4* src, uint4* dst, int n16, int seg, int lane,
                                         bool sys = false) {
    uint4 v[kSegChunks];
#pragma unroll
    for (int j = 0; j < kSegChunks; ++j) v[j] = make_uint4(0, 0, 0, 0);
    const int c0 = seg * 32 * kSegChunks + lane;
#pragma unroll
    for (int j = 0; j < kSegChunks; ++j) {
        if (c0 + 32 * j < n16) v[j] = ld_recv(src + c0 + 32 * j, sys);
    }
#pragma unroll
    for (int j = 0; j < kSegChunks; ++j) {
        if (c0 + 32 * j < n16) dst[c0 + 32 * j] = v[j];
    }
}

// ---- shrink mode (fep_abi.h shrink_mask / shrink_decide) -----------------------------------
// NOTES: the mask only grows while a kernel runs (the host unmasks only between calls, and a
// clean follows), so a send that snapshots it per block and re-reads it before publishing a
// flag never publishes a count whose rows some block skipped: a flag goes out only when the
// destination was unmasked at the end, hence all along.
__device__ __forceinline__ bool rank_masked(uint64_t mask, int r) {
    return mask != 0 && ld_volatile_u32(reinterpret_cast<const uint32_t*>(mask) + r) != 0u;
}

__device__ __forceinline__ void mask_rank(uint64_t mask, int r) {
    asm volatile("st.volatile.global.u32 [%0], %1;" ::"l"(reinterpret_cast<uint32_t*>(mask) + r),
                 "r"(1u)
                 : "memory");
    __threadfence_system();
}

__device__ __forceinline__ uint64_t ld_relaxed_gpu(const uint64_t* p) {
    uint64_t v;
    asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

// The decision word of receive unit `unit` of (phase, set).
__device__ __forceinline__ unsigned long long* decide_ptr(uint64_t decide, int phase, int set,
                                                          int num_experts, int unit) {
    return reinterpret_cast<unsigned long long*>(decide) +
           (static_cast<size_t>(phase * 2 + set) * num_experts + unit);
}

enum ShrinkWait { kShrinkFailed = -1, kShrinkMasked = 0, kShrinkArrived = 1 };

// Shrink mode's bounded wait for *flag >= want from rank `src`: kShrinkArrived (*seen = the
// flag) or kShrinkMasked (src masked, by the host or because the budget ran out here or in
// another block, which then stored the mask); kShrinkFailed once another waiter raised an error.
// The unit's decision word makes the outcome the same in every block of the launch.
__device__ __forceinline__ int shrink_wait(const uint64_t* flag, uint64_t want,
                                           unsigned long long* decide, uint64_t tag,
                                           uint64_t mask, int src, const fep::WaitCtx& ctx,
                                           uint64_t* seen) {
    const unsigned long long arrived = (tag << 2) | 1ull, masked = (tag << 2) | 2ull;
    const long long start = clock64();
    for (uint32_t spin = 0;; ++spin) {
        const unsigned long long d = ld_relaxed_gpu(reinterpret_cast<const uint64_t*>(decide));
        if (d == masked) return kShrinkMasked;
        if (d == arrived) {
            *seen = fep::ld_acquire_sys(flag);
            return kShrinkArrived;
        }
        // The host's mask lives in host memory: read on the first poll (a rank masked before
        // the launch counts as empty even if its flag came) and every 256th (~20 us) after.
        // Whatever is decided goes through the word: another block may read the mask before
        // the host's store lands.
        const bool host_masked = (spin & 255u) == 0u && rank_masked(mask, src);
        const uint64_t v = host_masked ? 0 : fep::ld_acquire_sys(flag);
        if (!host_masked && v >= want) {
            const unsigned long long o = atomicCAS(decide, d, arrived);
            if (o == d || o == arrived) {
                *seen = v;
                return kShrinkArrived;
            }
            continue;  // another block decided (masked): read it above
        }
        const bool out =
            !host_masked && static_cast<uint64_t>(clock64() - start) > ctx.budget_cycles;
        if (host_masked || out) {
            const unsigned long long o = atomicCAS(decide, d, masked);
            if (o == d || o == masked) {
                if (out) mask_rank(mask, src);
                return kShrinkMasked;
            }
            continue;  // it arrived meanwhile (another block saw it)
        }
        if (fep::error_raised(ctx.err)) return kShrinkFailed;
        __nanosleep(64);
    }
}

// ---- proxy transport (fep_abi.h fep_ll_proxy) ----------------------------------------------
constexpr int kStHead = 0;        // ring head, the producer's copy
constexpr int kStSetHead = 1;     // + set: head after the set's last push batch
constexpr int kStPushed = 3;      // + phase * 2 + set: push batches ever made
constexpr int kStCalls = 7;       // + phase * 2 + set: calls since the last clean
constexpr int kStTailSeen = 11;   // the ring tail the last reserve read from the host
constexpr int kStBase = 12;       // arr_base[S], sums_seen[S], mirror[S], ready[4], sends_seen
// arr_base and sums_seen hold 32-bit values (modulo 2^32, as the halves of a counter line's
// `packed` word; px_count).
// With S = num_slots = 4 E: where the receive's leader block leaves each proxy unit's count of
// the current call (mirror), the call it finished (ready, per phase * 2 + set), and the largest
// sends_completed a send's leader block has read from the host (sends_seen).
__device__ __forceinline__ int st_mirror(int num_slots) { return kStBase + 2 * num_slots; }
__device__ __forceinline__ int st_ready(int num_slots) { return kStBase + 3 * num_slots; }
__device__ __forceinline__ int st_sends_seen(int num_slots) { return kStBase + 3 * num_slots + 4; }

// NOTES (one poller per host word): every kernel polls a word of mapped host memory from ONE
// thread of block 0 (the leader) and hands the result to the other blocks through device memory.
// Measured on the H200 (event trace, 2 ranks x 66 blocks): when every block polled the proxy's
// counters itself, a counter the proxy had bumped was seen 300 us later and a staging check that
// was already true took 70-120 us: the GPU's reads of one host line from many SMs queue behind
// each other over PCIe. Device-memory polls by the followers cost about a microsecond.

__device__ __forceinline__ uint64_t* px_state(const fep_ll_proxy& px) {
    return reinterpret_cast<uint64_t*>(px.state);
}

__device__ __forceinline__ bool is_proxy(const fep_ll_peer* peers, int r) {
    return peers[r].transport == FEP_LL_TRANSPORT_PROXY;
}

// Counter slot of a message as its receiver names it: (phase * 2 + set) * E + receive unit.
__device__ __forceinline__ uint32_t px_slot(int phase, int set, int num_experts, int unit) {
    return static_cast<uint32_t>((phase * 2 + set) * num_experts + unit);
}

// A follower block's bounded wait for its leader: a little longer than the leader's own, so a
// peer that never sends is reported by the leader (which names it), not by a follower.
__device__ __forceinline__ fep::WaitCtx follower_ctx(fep::WaitCtx ctx) {
    ctx.budget_cycles += ctx.budget_cycles / 8;
    return ctx;
}

// All threads of every send block, before staging rows in the set's send area: waits (bounded)
// until the NIC has read the staging of the set's previous use (sends_completed >= the head
// after that use's push). Block 0's thread 0 first looks at `sends_seen`, the largest value a
// leader has read from the host: usually enough already (the previous call's leader read it
// after those writes completed), so no PCIe round trip; else it polls the host word and records
// what it read. The other blocks wait for `sends_seen` in device memory. Block-uniform result.
__device__ __forceinline__ bool px_staging_free(const fep_ll_proxy& px, int set, int num_experts,
                                                const fep::WaitCtx& ctx) {
    __shared__ int s_ok;
    if (threadIdx.x == 0) {
        uint64_t* st = px_state(px);
        uint64_t* seen_word = st + st_sends_seen(4 * num_experts);
        const uint64_t need = st[kStSetHead + set];
        if (blockIdx.x == 0) {
            s_ok = 1;
            if (fep::ld_acquire_sys(seen_word) < need) {
                uint64_t v = 0;
                s_ok = fep::wait_geq(reinterpret_cast<const uint64_t*>(px.sends_completed), need,
                                     ctx, &v);
                if (s_ok) {  // a max: a receive may have raised it meanwhile (px_refresh_sends_seen)
                    atomicMax(reinterpret_cast<unsigned long long*>(seen_word),
                              static_cast<unsigned long long>(v));
                }
            }
        } else {
            s_ok = fep::wait_geq(seen_word, need, follower_ctx(ctx));
        }
    }
    __syncthreads();
    return s_ok != 0;
}

// One thread of a receive kernel, off its critical path (a thread with no unit to count): reads
// the host's sends_completed once and raises `sends_seen` to it, so the next send's staging check
// (px_staging_free) usually finds its need met in device memory instead of waiting for a PCIe
// read: by this receive, the sends of the call before this one (the other set's last use) have
// long completed. The host counter only grows and is read, never guessed: `sends_seen` never
// exceeds it. Measured: the 1-token proxy send spent ~3 us before staging (ll_notes.md).
__device__ __forceinline__ void px_refresh_sends_seen(const fep_ll_proxy& px, int num_experts) {
    const uint64_t v = fep::ld_acquire_sys(reinterpret_cast<const uint64_t*>(px.sends_completed));
    atomicMax(reinterpret_cast<unsigned long long*>(px_state(px) + st_sends_seen(4 * num_experts)),
              static_cast<unsigned long long>(v));
}

// All threads of the publishing block: reserves `n` ring entries (thread 0 waits, bounded, for
// space). Returns the first ticket, or UINT64_MAX (block-uniform) when the wait ran out.
__device__ __forceinline__ uint64_t px_reserve(const fep_ll_proxy& px, uint32_t n,
                                               const fep::WaitCtx& ctx) {
    __shared__ uint64_t s_head;
    if (threadIdx.x == 0) {
        // The tail the last reserve read is kept in the state: the host's (a PCIe round trip) is
        // read only when that one leaves too little room.
        fep_ring_hdr* hdr = reinterpret_cast<fep_ring_hdr*>(px.ring);
        uint64_t* st = px_state(px);
        uint64_t head = st[kStHead];
        if (head + n - st[kStTailSeen] > px.capacity) {
            uint64_t tail = 0;
            if (fep::wait_geq(&hdr->tail, head + n - px.capacity, ctx, &tail)) {
                st[kStTailSeen] = tail;
            } else {
                head = UINT64_MAX;
            }
        }
        s_head = head;
    }
    __syncthreads();
    return s_head;
}

// Writes command `cmd` as ring ticket `ticket` (any thread; the publish fences).
__device__ __forceinline__ void px_put(const fep_ll_proxy& px, uint64_t ticket, fep_cmd cmd) {
    cmd.seq = static_cast<uint32_t>(ticket);
    fep_cmd* entries = reinterpret_cast<fep_cmd*>(px.ring + sizeof(fep_ring_hdr));
    uint4 lo, hi;
    memcpy(&lo, &cmd, sizeof(lo));
    memcpy(&hi, reinterpret_cast<const char*>(&cmd) + sizeof(lo), sizeof(hi));
    uint4* dst = reinterpret_cast<uint4*>(entries + ticket % px.capacity);
    dst[0] = lo;
    dst[1] = hi;
}

// All threads of the publishing block, after px_put of tickets [head, head + n): a barrier, then
// thread 0 publishes head + n with a release store at system scope (cumulative over the block's
// ring entries and, through the ticket, every block's staged rows) and counts the call.
__device__ __forceinline__ void px_publish(const fep_ll_proxy& px, uint64_t head, uint32_t n,
                                           int phase, int set) {
    __syncthreads();
    if (threadIdx.x == 0) {
        fep_ring_hdr* hdr = reinterpret_cast<fep_ring_hdr*>(px.ring);
        uint64_t* st = px_state(px);
        fep::st_release_sys(&hdr->head, head + n);
        st[kStHead] = head + n;
        st[kStSetHead + set] = head + n;
        st[kStPushed + phase * 2 + set] += 1;
        st[kStCalls + phase * 2 + set] += 1;
    }
}

// The command of one message: rows at `local` (this rank's staging) to `remote` (the peer's
// receive unit), `count` rows of `record_bytes`; an empty write when count is 0.
__device__ __forceinline__ fep_cmd px_cmd(uint64_t local, uint64_t remote, uint32_t count,
                                          uint32_t record_bytes, int dst, uint32_t slot,
                                          uint32_t value_bits) {
    fep_cmd c;
    c.local_offset = count ? local : 0;
    c.remote_offset = count ? remote : 0;
    c.length = count * record_bytes;
    c.dst_rank = static_cast<uint32_t>(dst);
    c.imm = (slot << value_bits) | count;
    c.seq = 0;
    return c;
}

// One thread of the receive's leader block (block 0): waits (bounded) for this call's message
// on `slot`, returns its row count, advances sums_seen and leaves the count in mirror[slot] for
// the followers; false after a timeout or an overrun (recorded, naming ctx.peer).
// NOTES (one PCIe read per poll): the proxy keeps a third word in the slot's
// counter line, packed = (arrivals << 32) | sums, both modulo 2^32, updated as one atomic word
// (src/proxy/memory.rs CounterMemory::record_arrival). One ld.acquire.sys of it both tells the
// arrival and carries the count: the leader used to poll `arrivals` and then
// read `sums` (+8, same line) with a second, dependent acquire: two PCIe round trips (~1-1.5 us
// each on the H200) between an arrival and its count. Arithmetic is modulo 2^32 (the halves
// wrap; fep::wait_packed_eq): the message has arrived when the high half = arr_base + calls of
// (phase, set) since clean, a high half ahead of that is a peer two calls ahead on this set
// (contract violation, FEP_DEV_BAD_COUNT as before), and the count is low half - sums_seen.
// arr_base and sums_seen are 32-bit values in their state words (the clean writes the halves of
// `packed`: src/ep/gpu/ll_proxy.rs rebase_state; its poll_packed is this logic on the host, run
// across 2^32 by the CPU tests). One message per slot and call, its count < 2^14, so the low
// half moves by less than 2^32 between two counts.
__device__ __forceinline__ bool px_count(const fep_ll_proxy& px, int phase, int set, uint32_t slot,
                                         uint32_t num_slots, const fep::WaitCtx& ctx,
                                         uint64_t* count) {
    uint64_t* st = px_state(px);
    const uint32_t expected =
        static_cast<uint32_t>(st[kStBase + slot] + st[kStCalls + phase * 2 + set]);
    constexpr uint32_t kStride = FEP_COUNTER_STRIDE / 8;  // u64 words per slot line
    const uint64_t* word = reinterpret_cast<const uint64_t*>(px.packed) + slot * kStride;
    uint64_t seen = 0;
    if (!fep::wait_packed_eq(word, expected, ctx, &seen)) return false;
    const uint32_t sum = static_cast<uint32_t>(seen);
    const uint32_t n = sum - static_cast<uint32_t>(st[kStBase + num_slots + slot]);
    *count = n;
    st[kStBase + num_slots + slot] = sum;
    st[st_mirror(static_cast<int>(num_slots)) + slot] = n;
    return true;
}

// All threads of every receive block, after the leader's threads have run px_count for their
// units (and any flag waits are done): the leader publishes that the call's counts are in the
// mirror (ready[phase * 2 + set] = the call number, calls since clean); a follower waits for it
// (bounded). `*fail` is the block's failure flag (shared). Ends with a barrier; a grid of one
// block only passes the barrier.
// NOTES: the leader's system fence orders the rows the proxy/NIC wrote (seen through its
// acquire of the counters) before the release; a follower fences again after its acquire, so
// its reads of those rows (ld.cv, past the caches) follow.
__device__ __forceinline__ void px_counts_handoff(const fep_ll_proxy& px, int phase, int set,
                                                  int num_experts, const fep::WaitCtx& ctx,
                                                  int* fail) {
    uint64_t* st = px_state(px);
    uint64_t* ready = st + st_ready(4 * num_experts) + phase * 2 + set;
    const uint64_t call = st[kStCalls + phase * 2 + set];
    __syncthreads();
    // One block: no follower to hand to. Its threads' reads of the rows follow the leader
    // thread's acquire of the counters through the barrier (happens-before is transitive).
    if (gridDim.x == 1) return;
    if (threadIdx.x == 0) {
        if (blockIdx.x == 0) {
            if (*fail == 0) {
                __threadfence_system();
                fep::st_release_sys(ready, call);
            }
        } else if (!fep::wait_geq(ready, call, follower_ctx(ctx))) {
            *fail = 1;
        } else {
            __threadfence_system();
        }
    }
    __syncthreads();
}

// A follower's count of proxy unit `slot` for the current call (after px_counts_handoff).
__device__ __forceinline__ uint64_t px_mirrored_count(const fep_ll_proxy& px, uint32_t slot,
                                                      uint32_t num_slots) {
    return fep::ld_acquire_sys(px_state(px) + st_mirror(static_cast<int>(num_slots)) + slot);
}

}  // namespace ll
}  // namespace fep
