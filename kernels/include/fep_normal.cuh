// fep_normal.cuh: shared pieces of the normal-mode kernels (kernels/normal_*.cu): the comm
// buffer's addressing, the per-pair chunk queue (flags and credits), and warp copy helpers.
//
// NOTES: queue protocol (fep_abi.h has the buffer map). For pair (s -> r), chunk c (cumulative
// over the buffer's life, dispatch and combine chunks of the pair continue one numbering) sits in
// slot c % spp of r's recv region [s]. The writer waits credit >= c - spp + 1 (the reader has
// finished chunk c - spp of that slot), stores the records, passes a block (or warp) barrier, then
// one thread publishes flag = c + 1 with st.release.sys. The reader acquires flag >= c + 1, reads,
// passes a barrier, then one thread publishes credit = c + 1 with st.release.sys. Payload stores
// are therefore ordered before the flag (release after the barrier), payload reads after it
// (acquire before the barrier), and slot reuse after the reader's credit. Reads of the queue use
// ld.global.cg (L2) so no stale L1 line of an earlier chunk in the slot is ever seen.
//
// NOTES: per-rank progress counters (state.sent_base / recv_base) advance only in each kernel's
// last block to finish (ticket), after every block has read them; kernels of one rank are
// ordered by its stream. After any device error the buffer's protocol state is undefined: the
// host must zero every rank's comm buffer (collectively) before the next step.
#pragma once

#include <stdint.h>

#include "fep_abi.h"
#include "fep_device.cuh"
#include "fep_trace.cuh"

// Trace points of the proxy-lane chunks (fep_abi.h FEP_TRACE_NP_*; arg = block), compiled only
// into a diagnosis build (build.rs FEP_TRACE_NORMAL=1): these kernels sit at their register limit
// and the points made ptxas spill in fep_normal_dispatch.
#if defined(FEP_TRACE_NORMAL)
#define FEP_NP_TRACE(kind, rank) fep::trace((kind), (rank), blockIdx.x)
#else
#define FEP_NP_TRACE(kind, rank) ((void)0)
#endif

namespace fep {
namespace normal {

constexpr int kMaxRanks = FEP_NORMAL_MAX_RANKS;
constexpr int kWarpSize = 32;

// Local state area of the comm buffer (byte offsets from state_offset); Rust mirrors this in
// src/ep/normal_gpu.rs (state_bytes).
constexpr uint64_t kStateSentBase = 0;        // u64 [kMaxRanks]
constexpr uint64_t kStateRecvBase = 64;       // u64 [kMaxRanks]
constexpr uint64_t kStateTickets = 128;       // u32 [4]: 0 notify, 1 dispatch, 2 combine
constexpr uint64_t kStateNotifyTokens = 144;  // u32 [kMaxRanks]
constexpr uint64_t kStateConsumed = 176;      // u32 [kMaxRanks][spp]
// then u32 notify_experts [kMaxRanks][L] at kStateConsumed + 4 * kMaxRanks * spp

struct Comm {
    const fep_normal_comm& c;

    __device__ __forceinline__ uint8_t* base(int rank) const {
        return reinterpret_cast<uint8_t*>(c.peer_base[rank]);
    }
    __device__ __forceinline__ uint8_t* mine() const { return base(c.rank); }
    __device__ __forceinline__ uint8_t* state() const { return mine() + c.state_offset; }
    __device__ __forceinline__ uint64_t* sent_base() const {
        return reinterpret_cast<uint64_t*>(state() + kStateSentBase);
    }
    __device__ __forceinline__ uint64_t* recv_base() const {
        return reinterpret_cast<uint64_t*>(state() + kStateRecvBase);
    }
    __device__ __forceinline__ uint32_t* ticket(int i) const {
        return reinterpret_cast<uint32_t*>(state() + kStateTickets) + i;
    }
    __device__ __forceinline__ uint32_t* notify_tokens() const {
        return reinterpret_cast<uint32_t*>(state() + kStateNotifyTokens);
    }
    __device__ __forceinline__ uint32_t* consumed(int peer, uint32_t slot) const {
        return reinterpret_cast<uint32_t*>(state() + kStateConsumed) +
               static_cast<uint64_t>(peer) * c.slots_per_peer + slot;
    }
    __device__ __forceinline__ uint32_t* notify_experts(int src) const {
        return reinterpret_cast<uint32_t*>(state() + kStateConsumed) +
               static_cast<uint64_t>(kMaxRanks) * c.slots_per_peer +
               static_cast<uint64_t>(src) * c.num_local_experts;
    }
    // Slot `slot` of the queue from `src`, in `owner`'s recv region.
    __device__ __forceinline__ uint8_t* slot_ptr(int owner, int src, uint32_t slot) const {
        return base(owner) + c.recv_offset +
               (static_cast<uint64_t>(src) * c.slots_per_peer + slot) * c.slot_bytes;
    }
    // Flag of (src -> owner) slot, in owner's buffer.
    __device__ __forceinline__ uint64_t* flag_ptr(int owner, int src, uint32_t slot) const {
        return reinterpret_cast<uint64_t*>(base(owner) + c.flag_offset) +
               static_cast<uint64_t>(src) * c.slots_per_peer + slot;
    }
    // Credit of (owner -> dst) slot, in owner's buffer (written by dst).
    __device__ __forceinline__ uint64_t* credit_ptr(int owner, int dst, uint32_t slot) const {
        return reinterpret_cast<uint64_t*>(base(owner) + c.credit_offset) +
               static_cast<uint64_t>(dst) * c.slots_per_peer + slot;
    }
    __device__ __forceinline__ uint8_t* notify_ptr(int owner, int src) const {
        return base(owner) + c.notify_offset + static_cast<uint64_t>(src) * c.notify_bytes;
    }
    __device__ __forceinline__ uint64_t* ack_ptr(int owner, int dst) const {
        return reinterpret_cast<uint64_t*>(base(owner) + c.ack_offset) + dst;
    }
    __device__ __forceinline__ WaitCtx wait_ctx(uint32_t phase, uint32_t peer) const {
        return WaitCtx{c.dev_error, c.budget_cycles, c.rank, phase, peer};
    }

    // ---- peers through the proxy (fep_abi.h fep_normal_proxy) ----
    __device__ __forceinline__ bool via_proxy(int peer) const {
        return ((c.proxy.mask >> peer) & 1u) != 0u;
    }
    __device__ __forceinline__ uint64_t px_place(uint64_t unit, uint32_t per_region,
                                                 uint64_t unit_bytes) const {
        return (unit / per_region) * c.proxy.stride + (unit % per_region) * unit_bytes;
    }
    // Offset of data slot (peer, slot): the receive slot of source `peer`, or the staging slot
    // for destination `peer` (host Geometry::data_offset).
    __device__ __forceinline__ uint64_t px_data_off(int peer, uint32_t slot) const {
        return px_place(static_cast<uint64_t>(peer) * c.slots_per_peer + slot,
                        c.proxy.data_per_region, c.slot_bytes);
    }
    // Offset of peer's notify record with sequence number seq (host Geometry::notify_offset).
    __device__ __forceinline__ uint64_t px_notify_off(int peer, uint64_t seq) const {
        return c.proxy.notify_base + px_place((seq % 2) * c.num_ranks + peer,
                                              c.proxy.notify_per_region, c.proxy.notify_bytes);
    }
    __device__ __forceinline__ uint8_t* px_send(uint64_t off) const {
        return reinterpret_cast<uint8_t*>(c.proxy.send) + off;
    }
    __device__ __forceinline__ const uint8_t* px_recv(uint64_t off) const {
        return reinterpret_cast<const uint8_t*>(c.proxy.recv) + off;
    }
    __device__ __forceinline__ uint32_t px_data_id(int src, uint32_t slot) const {
        return static_cast<uint32_t>(src) * c.slots_per_peer + slot;
    }
    __device__ __forceinline__ uint32_t px_notify_id(int src) const {
        return c.num_ranks * c.slots_per_peer + static_cast<uint32_t>(src);
    }
    __device__ __forceinline__ uint32_t px_credit_id(int src, uint32_t slot) const {
        return c.num_ranks * c.slots_per_peer + c.num_ranks +
               static_cast<uint32_t>(src) * c.slots_per_peer + slot;
    }
    __device__ __forceinline__ const uint64_t* px_arrivals(uint32_t id) const {
        return reinterpret_cast<const uint64_t*>(c.proxy.arrivals) + id * (FEP_COUNTER_STRIDE / 8);
    }
    __device__ __forceinline__ uint32_t px_imm(uint32_t id, uint32_t value) const {
        return (id << c.proxy.value_bits) | value;
    }
    __device__ __forceinline__ fep_ring_hdr* px_ring(uint32_t ring) const {
        return reinterpret_cast<fep_ring_hdr*>(c.proxy.ring +
                                               static_cast<uint64_t>(ring) * c.proxy.ring_stride);
    }
};

// One block's producer side of its proxy ring (ring blockIdx.x). The kernels of one rank are
// ordered by its stream and only this block of the running kernel pushes into the ring, so the
// head is read back from the header at the start of every kernel.
struct Pusher {
    fep_ring_hdr* hdr;
    fep_cmd* entries;
    uint32_t capacity;
    uint64_t head;

    __device__ __forceinline__ static Pusher open(const Comm& comm, uint32_t ring) {
        Pusher p{};
        if (comm.c.proxy.mask == 0u) return p;
        p.hdr = comm.px_ring(ring);
        p.entries = reinterpret_cast<fep_cmd*>(p.hdr + 1);
        p.capacity = comm.c.proxy.ring_capacity;
        p.head = ld_acquire_sys(&p.hdr->head);
        return p;
    }
    // The ring's producer side with a head the caller keeps (several warps of one block taking
    // turns under a lock, see normal_combine.cu).
    __device__ __forceinline__ static Pusher at(const Comm& comm, uint32_t ring, uint64_t head) {
        Pusher p{};
        p.hdr = comm.px_ring(ring);
        p.entries = reinterpret_cast<fep_cmd*>(p.hdr + 1);
        p.capacity = comm.c.proxy.ring_capacity;
        p.head = head;
        return p;
    }
    // One RMA write of `len` bytes from send-region offset `local` into `dst`'s receive region at
    // `remote`, with immediate `imm` (len 0: a count-only message). The caller has fenced the
    // payload (system scope) and passed a barrier before.
    __device__ __forceinline__ bool push(uint32_t dst, uint64_t local, uint64_t remote,
                                         uint32_t len, uint32_t imm, const WaitCtx& ctx) {
        fep_cmd cmd;
        cmd.local_offset = local;
        cmd.remote_offset = remote;
        cmd.length = len;
        cmd.dst_rank = dst;
        cmd.imm = imm;
        cmd.seq = 0;
        return ring_push(hdr, entries, capacity, head, cmd, ctx);
    }
};

__device__ __forceinline__ uint4 ld_cg(const uint4* p) { return __ldcg(p); }
__device__ __forceinline__ uint4 ld_nc(const uint4* p) { return __ldg(p); }

// A warp copies n 16-byte vectors, kUnroll loads in flight per lane. `kFromQueue`: the source is
// a queue slot (L2 loads), else read-only input (non-coherent path).
// NOTES: the last, partial batch is guarded rather than copied one vector per lane at a time:
// each such step was a full memory round trip (a 7168-byte fp8 row took 1 batch of 8 and then 6
// single steps).
template <bool kFromQueue, int kUnroll = 8>
__device__ __forceinline__ void warp_copy16(uint4* __restrict__ dst, const uint4* __restrict__ src,
                                            int n, int lane) {
    for (int i = lane; i < n; i += kUnroll * kWarpSize) {
        uint4 v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            if (i + u * kWarpSize < n)
                v[u] = kFromQueue ? ld_cg(src + i + u * kWarpSize) : ld_nc(src + i + u * kWarpSize);
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            if (i + u * kWarpSize < n) dst[i + u * kWarpSize] = v[u];
        }
    }
}

// A warp copies n 4-byte words.
template <bool kFromQueue>
__device__ __forceinline__ void warp_copy4(uint32_t* dst, const uint32_t* src, int n, int lane) {
    for (int i = lane; i < n; i += kWarpSize) dst[i] = kFromQueue ? __ldcg(src + i) : __ldg(src + i);
}

// A block copies n 16-byte vectors out of a proxy receive region (uncached loads, kUnroll in
// flight per thread: a PCIe read is a round trip; the partial last batch guarded, as above).
__device__ __forceinline__ void block_copy16_px(uint4* __restrict__ dst,
                                                const uint4* __restrict__ src, uint32_t n) {
    constexpr uint32_t kUnroll = 8;
    const uint32_t step = blockDim.x;
    for (uint32_t i = threadIdx.x; i < n; i += kUnroll * step) {
        uint4 v[kUnroll];
#pragma unroll
        for (uint32_t u = 0; u < kUnroll; ++u) {
            if (i + u * step < n) v[u] = __ldcv(src + i + u * step);
        }
#pragma unroll
        for (uint32_t u = 0; u < kUnroll; ++u) {
            if (i + u * step < n) dst[i + u * step] = v[u];
        }
    }
}

__device__ __forceinline__ uint32_t div_ceil(uint32_t a, uint32_t b) { return (a + b - 1) / b; }

// The last block of a grid to arrive (ticket pattern) returns true; the ticket is reset there.
// Every block must call it exactly once, after its last use of the state it may update.
__device__ __forceinline__ bool last_block(uint32_t* ticket) {
    __shared__ bool is_last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        const uint32_t t = atomicAdd(ticket, 1u);
        is_last = t == gridDim.x - 1;
        if (is_last) atomicExch(ticket, 0u);
    }
    __syncthreads();
    if (is_last) __threadfence();
    return is_last;
}

}  // namespace normal
}  // namespace fep
