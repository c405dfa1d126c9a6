// Normal-mode dispatch, after notify (or with a cached handle). Peers on this node: peer stores;
// peers on other nodes (comm.proxy.mask): staged chunks, one proxy command each, arrival
// counters and zero-length credits (fep_abi.h fep_normal_proxy).
// Grid: the rank's SM budget, FEP_NORMAL_THREADS threads. The first half of the blocks send, the
// second half receive; block j of a half serves peer j % R (chunks j / R, j / R + n, ...), so each
// peer's queue has its own senders and receivers and no block ever waits on two peers.
//   sender   (towards d): per chunk, wait for the slot's credit, pack C records (payload, fp8
//            scales, local top-k ids and weights, source index: plan/record.rs's normal-dispatch record)
//            with one warp per row and 16-byte stores into d's recv slot, barrier, publish the flag;
//   receiver (from s):    per chunk, acquire the flag (a peer on another node: wait for the
//            arrival, then copy the chunk from the receive region into the device slot in one
//            wide pass), unpack the records into recv_x rows
//            rank_prefix[s] + chunk * C + row (grouped by source rank, token order within one),
//            barrier, return the credit.
// This rank's own rows skip the queue: the blocks that serve this rank on both sides copy them
// from x into recv_x directly (self_rows).
// Rows past the received ones (num_worst_tokens mode) are padding: zero x and scales, top-k -1
// and weight 0, source index -1.
#include "fep_abi.h"
#include "fep_device.cuh"
#include "fep_normal.cuh"
#include "fep_tma.cuh"

namespace {

// A row past the outputs (a count that disagrees with the handle): recorded, not written.
__device__ __forceinline__ void report_overflow(const fep_normal_dispatch_params& p, int src,
                                                int64_t out, int lane) {
    if (lane == 0) {
        fep::report_error(p.comm.dev_error, FEP_DEV_BAD_COUNT, p.comm.rank,
                          FEP_NORMAL_PHASE_DISPATCH_RECV, static_cast<uint32_t>(src),
                          static_cast<uint64_t>(p.out_rows), static_cast<uint64_t>(out));
    }
}

// self_rows through registers: one warp per row (rows too small for bulk copies, or too little
// shared memory for a ring).
__device__ __forceinline__ void self_rows_regs(const fep_normal_dispatch_params& p, int w, int W,
                                          int warp, int lane) {
    using namespace fep::normal;
    constexpr int kWarps = FEP_NORMAL_THREADS / 32;
    const int me = static_cast<int>(p.comm.rank);
    const int T = p.handle.num_tokens;
    const int K = p.num_topk;
    const int32_t* prefix = reinterpret_cast<const int32_t*>(p.handle.rank_prefix);
    const int32_t n = reinterpret_cast<const int32_t*>(p.handle.send_counts)[me];
    const int32_t* ids =
        reinterpret_cast<const int32_t*>(p.handle.send_token_ids) + static_cast<int64_t>(me) * T;
    const uint8_t* x = reinterpret_cast<const uint8_t*>(p.x);
    const float* xs = reinterpret_cast<const float*>(p.x_scales);
    const int64_t* topk = reinterpret_cast<const int64_t*>(p.topk_idx);
    const float* topw = reinterpret_cast<const float*>(p.topk_weights);
    uint8_t* rx = reinterpret_cast<uint8_t*>(p.recv_x);
    float* rxs = reinterpret_cast<float*>(p.recv_x_scales);
    int64_t* rtopk = reinterpret_cast<int64_t*>(p.recv_topk_idx);
    float* rtopw = reinterpret_cast<float*>(p.recv_topk_weights);
    int32_t* rsrc = reinterpret_cast<int32_t*>(p.recv_src_idx);
    const int64_t lo = static_cast<int64_t>(me) * p.comm.num_local_experts;
    const int64_t hi = lo + p.comm.num_local_experts;
    const int64_t row0 = prefix[me];
    const int64_t stride = static_cast<int64_t>(W) * kWarps;
    int64_t i = static_cast<int64_t>(w) * kWarps + warp;
    // The next row's token id is loaded a row ahead (one round trip fewer per row).
    int t_next = i < n ? ids[i] : 0;
    for (; i < n; i += stride) {
        const int t = t_next;
        if (i + stride < n) t_next = ids[i + stride];
        const int64_t out = row0 + i;
        if (out >= p.out_rows) {
            report_overflow(p, me, out, lane);
            continue;
        }
        // The routing and scale loads go out with the row's (before any store that could alias
        // them): one batch of loads per row where the row fits 10 vectors a lane (5 KiB; this
        // path serves rows under 2 KiB, and the bulk path beside it leaves no registers for
        // more).
        int64_t g = -1;
        float wt = 0.0f;
        if (lane < K) {
            g = topk[static_cast<int64_t>(t) * K + lane];
            wt = topw[static_cast<int64_t>(t) * K + lane];
        }
        const uint32_t ns = p.num_scales;
        const float* srow = xs + static_cast<int64_t>(t) * ns;
        float s0 = 0.0f, s1 = 0.0f;
        if (ns <= 64) {
            if (static_cast<uint32_t>(lane) < ns) s0 = __ldg(srow + lane);
            if (static_cast<uint32_t>(lane) + 32 < ns) s1 = __ldg(srow + lane + 32);
        }
        warp_copy16<false, 10>(reinterpret_cast<uint4*>(rx + out * p.payload_bytes),
                               reinterpret_cast<const uint4*>(x + static_cast<int64_t>(t) *
                                                                      p.payload_bytes),
                               p.payload_bytes / 16, lane);
        if (ns > 64) {
            warp_copy4<false>(reinterpret_cast<uint32_t*>(rxs + out * ns),
                              reinterpret_cast<const uint32_t*>(srow), ns, lane);
        } else {
            if (static_cast<uint32_t>(lane) < ns) rxs[out * ns + lane] = s0;
            if (static_cast<uint32_t>(lane) + 32 < ns) rxs[out * ns + lane + 32] = s1;
        }
        if (lane < K) {
            const bool here = g >= lo && g < hi;
            rtopk[out * K + lane] = here ? g - lo : -1;
            rtopw[out * K + lane] = here ? wt : 0.0f;
        }
        if (lane == 0) rsrc[out] = t;
    }
}


// One row's small fields (fp8 scales, the local top-k ids and weights, the source index), from
// token t's inputs into output row `out`.
__device__ __forceinline__ void self_row_fields(const fep_normal_dispatch_params& p, int t,
                                                int64_t out, int64_t lo, int64_t hi, int lane) {
    const int K = p.num_topk;
    const uint32_t ns = p.num_scales;
    const float* srow = reinterpret_cast<const float*>(p.x_scales) + static_cast<int64_t>(t) * ns;
    float* orow = reinterpret_cast<float*>(p.recv_x_scales) + out * ns;
    if (lane < K) {
        const int64_t g = reinterpret_cast<const int64_t*>(p.topk_idx)[static_cast<int64_t>(t) * K + lane];
        const float wt = reinterpret_cast<const float*>(p.topk_weights)[static_cast<int64_t>(t) * K + lane];
        const bool here = g >= lo && g < hi;
        reinterpret_cast<int64_t*>(p.recv_topk_idx)[out * K + lane] = here ? g - lo : -1;
        reinterpret_cast<float*>(p.recv_topk_weights)[out * K + lane] = here ? wt : 0.0f;
    }
    for (uint32_t i = lane; i < ns; i += 32) orow[i] = __ldg(srow + i);
    if (lane == 0) reinterpret_cast<int32_t*>(p.recv_src_idx)[out] = t;
}

// A queue record's small fields (fp8 scales, the top-k ids local to the destination and their
// weights, the source index) for token t; its payload is the movers'.
__device__ __forceinline__ void record_fields(const fep_normal_dispatch_params& p, uint8_t* rec,
                                              int t, int64_t lo, int64_t hi, int lane) {
    const int K = p.num_topk;
    if (p.num_scales != 0) {
        fep::normal::warp_copy4<false>(
            reinterpret_cast<uint32_t*>(rec + p.scales_offset),
            reinterpret_cast<const uint32_t*>(reinterpret_cast<const float*>(p.x_scales) +
                                              static_cast<int64_t>(t) * p.num_scales),
            p.num_scales, lane);
    }
    if (lane < K) {
        const int64_t g = reinterpret_cast<const int64_t*>(p.topk_idx)[static_cast<int64_t>(t) * K + lane];
        const float wt = reinterpret_cast<const float*>(p.topk_weights)[static_cast<int64_t>(t) * K + lane];
        const bool here = g >= lo && g < hi;
        reinterpret_cast<int32_t*>(rec + p.topk_idx_offset)[lane] = here ? static_cast<int32_t>(g - lo) : -1;
        reinterpret_cast<float*>(rec + p.topk_weights_offset)[lane] = here ? wt : 0.0f;
    }
    if (lane == 0) reinterpret_cast<int32_t*>(rec + p.src_idx_offset)[0] = t;
}

// A received record's small fields into output row `out`; its payload is the movers'.
__device__ __forceinline__ void unpack_fields(const fep_normal_dispatch_params& p,
                                              const uint8_t* rec, int64_t out, int lane) {
    const int K = p.num_topk;
    if (p.num_scales != 0) {
        fep::normal::warp_copy4<true>(
            reinterpret_cast<uint32_t*>(reinterpret_cast<float*>(p.recv_x_scales) + out * p.num_scales),
            reinterpret_cast<const uint32_t*>(rec + p.scales_offset), p.num_scales, lane);
    }
    if (lane < K) {
        reinterpret_cast<int64_t*>(p.recv_topk_idx)[out * K + lane] =
            __ldcg(reinterpret_cast<const int32_t*>(rec + p.topk_idx_offset) + lane);
        reinterpret_cast<float*>(p.recv_topk_weights)[out * K + lane] =
            __ldcg(reinterpret_cast<const float*>(rec + p.topk_weights_offset) + lane);
    }
    if (lane == 0) {
        reinterpret_cast<int32_t*>(p.recv_src_idx)[out] =
            __ldcg(reinterpret_cast<const int32_t*>(rec + p.src_idx_offset));
    }
}

// Warps 0 .. movers - 1 of a block (p.bulk_movers, the host's choice by row size) move row
// payloads with bulk copies through shared memory (fep_tma.cuh), each with its own ring; the
// other warps write the rows' small fields meanwhile.
__device__ __forceinline__ int movers_of(const fep_normal_dispatch_params& p) {
    return static_cast<int>(min(p.bulk_movers, static_cast<uint32_t>(FEP_NORMAL_MAX_MOVERS)));
}

// Whether this launch's rows go through the rings: movers asked for, 16-byte rows, and shared
// memory for a pipeline. Uniform across the grid.
__device__ __forceinline__ bool bulk_rows(const fep_normal_dispatch_params& p,
                                          const fep::tma::Ring& r) {
    return p.bulk_movers != 0 && r.stages >= 4 && p.payload_bytes % 16 == 0;
}

// This rank's own rows, straight from the inputs into the outputs: no queue record, flag or
// credit (the (me -> me) pair's queue is never used). The work is shared by the sender blocks
// that serve this rank and the receiver blocks that serve it: worker w of W takes a contiguous
// range of rows, its movers the payloads, its other warps the small fields. Rows keep the
// order of send_token_ids, as a peer's rows keep it through the queue.
__device__ __forceinline__ void self_rows(const fep_normal_dispatch_params& p, int w, int W,
                                          int warp, int lane, const fep::tma::Ring& ring,
                                          uint32_t& used) {
    using namespace fep::normal;
    constexpr int kWarps = FEP_NORMAL_THREADS / 32;
    if (!bulk_rows(p, ring)) {
        self_rows_regs(p, w, W, warp, lane);
        return;
    }
    const int movers = movers_of(p);
    const int me = static_cast<int>(p.comm.rank);
    const int T = p.handle.num_tokens;
    const int64_t row0 = reinterpret_cast<const int32_t*>(p.handle.rank_prefix)[me];
    const int64_t n = reinterpret_cast<const int32_t*>(p.handle.send_counts)[me];
    const int32_t* ids =
        reinterpret_cast<const int32_t*>(p.handle.send_token_ids) + static_cast<int64_t>(me) * T;
    const int64_t a = n * w / W, b = n * (w + 1) / W;
    if (warp < movers) {
        // Rows past the outputs are not moved (the field warps report them).
        const int64_t fit = max(a, min(b, static_cast<int64_t>(p.out_rows) - row0));
        const int64_t m0 = a + (fit - a) * warp / movers;
        const int64_t m1 = a + (fit - a) * (warp + 1) / movers;
        const uint64_t pb = p.payload_bytes;
        used = fep::tma::warp_move_rows(ring, used, static_cast<uint32_t>(m1 - m0), ids + m0,
                                 reinterpret_cast<const uint8_t*>(p.x), pb,
                                 reinterpret_cast<uint8_t*>(p.recv_x) + (row0 + m0) * pb, pb,
                                 p.payload_bytes, lane);
        return;
    }
    const int64_t lo = static_cast<int64_t>(me) * p.comm.num_local_experts;
    const int64_t hi = lo + p.comm.num_local_experts;
    const int kFieldWarps = kWarps - movers;
    int64_t i = a + warp - movers;
    // The next row's token id is loaded a row ahead (one round trip fewer per row).
    int t_next = i < b ? ids[i] : 0;
    for (; i < b; i += kFieldWarps) {
        const int t = t_next;
        if (i + kFieldWarps < b) t_next = ids[i + kFieldWarps];
        const int64_t out = row0 + i;
        if (out >= p.out_rows) {
            report_overflow(p, me, out, lane);
            continue;
        }
        self_row_fields(p, t, out, lo, hi, lane);
    }
}

}  // namespace

extern "C" __global__ void __launch_bounds__(FEP_NORMAL_THREADS)
    fep_normal_dispatch(const fep_normal_dispatch_params p) {
    using namespace fep::normal;
    const Comm comm{p.comm};
    const int me = static_cast<int>(p.comm.rank);
    const int R = static_cast<int>(p.comm.num_ranks);
    const uint32_t C = p.comm.chunk_tokens;
    const uint32_t spp = p.comm.slots_per_peer;
    const int T = p.handle.num_tokens;
    const int K = p.num_topk;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    constexpr int kWarps = FEP_NORMAL_THREADS / 32;
    const int num_send = gridDim.x / 2;
    const int num_recv = gridDim.x - num_send;
    const int32_t* prefix = reinterpret_cast<const int32_t*>(p.handle.rank_prefix);
    const int32_t* send_counts = reinterpret_cast<const int32_t*>(p.handle.send_counts);
    __shared__ bool ok;
    // Head of this block's proxy ring (thread 0 pushes; kept in shared memory, not registers).
    __shared__ unsigned long long px_head;
    const int movers = max(movers_of(p), 1);
    const fep::tma::Ring ring = fep::tma::ring(warp < movers ? warp : 0, movers, p.payload_bytes);
    const bool bulk = bulk_rows(p, ring);
    // A queue record's payload moves in bulk too where records keep 16-byte alignment (the
    // plan pads records to 16 bytes, src/protocol/plan/base.rs RECORD_ALIGN, and the receive
    // area starts at the buffer's base) and the pair is on this node (a staged chunk is the
    // proxy's, through host-visible memory).
    const bool bulk_queue = bulk && p.record_bytes % 16 == 0;
    uint32_t used = 0;
    if (bulk && warp < movers) fep::tma::ring_init(ring, lane);
    if (threadIdx.x == 0)
        px_head = p.comm.proxy.mask != 0u
                      ? fep::ld_acquire_sys(&comm.px_ring(blockIdx.x)->head)
                      : 0;
    __syncthreads();

    if (static_cast<int>(blockIdx.x) < num_send) {
        // ---- sender ----
        const int j = blockIdx.x;
        const int d = j % R;
        const int nsub = (num_send - d + R - 1) / R;
        const uint32_t n = static_cast<uint32_t>(send_counts[d]);
        const uint32_t chunks = div_ceil(n, C);
        const uint64_t base = comm.sent_base()[d];
        const int32_t* ids = reinterpret_cast<const int32_t*>(p.handle.send_token_ids) +
                             static_cast<int64_t>(d) * T;
        const uint8_t* x = reinterpret_cast<const uint8_t*>(p.x);
        const int64_t lo = static_cast<int64_t>(d) * p.comm.num_local_experts;
        const int64_t hi = lo + p.comm.num_local_experts;
        const bool px = comm.via_proxy(d);
        if (d == me) {
            self_rows(p, j / R, nsub + (num_recv - me + R - 1) / R, warp, lane, ring, used);
        }
        for (uint32_t k = j / R; d != me && k < chunks; k += nsub) {
            const uint64_t cum = base + k;
            const uint32_t slot = static_cast<uint32_t>(cum % spp);
            if (threadIdx.x == 0) {
                const fep::WaitCtx ctx = comm.wait_ctx(FEP_NORMAL_PHASE_DISPATCH_SEND, d);
                if (px) FEP_NP_TRACE(FEP_TRACE_NP_SEND_WAIT, me);
                ok = cum < spp ||
                     (px ? fep::wait_geq(comm.px_arrivals(comm.px_credit_id(d, slot)), cum / spp,
                                         ctx)
                         : fep::wait_geq(comm.credit_ptr(me, d, slot), cum - spp + 1, ctx));
                if (px) FEP_NP_TRACE(FEP_TRACE_NP_SEND_STAGE, me);
            }
            __syncthreads();
            if (!ok) break;
            const uint32_t rows = min(C, n - k * C);
            uint8_t* dst =
                px ? comm.px_send(comm.px_data_off(d, slot)) : comm.slot_ptr(d, me, slot);
            // Movers (bulk, a pair on this node) take the payloads, the other warps the fields;
            // else every warp copies whole records through registers.
            const bool bq = bulk_queue && !px;
            const int32_t* cids = ids + k * C;
            if (bq && warp < movers) {
                const uint32_t m0 = rows * warp / movers, m1 = rows * (warp + 1) / movers;
                used = fep::tma::warp_move_rows(ring, used, m1 - m0, cids + m0, x, p.payload_bytes,
                                                dst + static_cast<uint64_t>(m0) * p.record_bytes,
                                                p.record_bytes, p.payload_bytes, lane);
            } else {
                const uint32_t w0 = bq ? warp - movers : warp, ws = bq ? kWarps - movers : kWarps;
                for (uint32_t i = w0; i < rows; i += ws) {
                    const int t = cids[i];
                    uint8_t* rec = dst + static_cast<uint64_t>(i) * p.record_bytes;
                    if (!bq) {
                        warp_copy16<false>(reinterpret_cast<uint4*>(rec),
                                           reinterpret_cast<const uint4*>(
                                               x + static_cast<int64_t>(t) * p.payload_bytes),
                                           p.payload_bytes / 16, lane);
                    }
                    record_fields(p, rec, t, lo, hi, lane);
                }
            }
            if (px) __threadfence_system();  // staged rows visible to the proxy before the push
            __syncthreads();
            if (threadIdx.x == 0) {
                if (px) {
                    Pusher pusher = Pusher::at(comm, blockIdx.x, px_head);
                    ok = pusher.push(static_cast<uint32_t>(d), comm.px_data_off(d, slot),
                                     comm.px_data_off(me, slot), rows * p.record_bytes,
                                     comm.px_imm(comm.px_data_id(me, slot), rows),
                                     comm.wait_ctx(FEP_NORMAL_PHASE_DISPATCH_SEND, d));
                    px_head = pusher.head;
                    FEP_NP_TRACE(FEP_TRACE_NP_SEND_PUSHED, me);
                } else {
                    fep::st_release_sys(comm.flag_ptr(d, me, slot), cum + 1);
                }
            }
        }
    } else {
        // ---- receiver ----
        const int j = blockIdx.x - num_send;
        const int s = j % R;
        const int nsub = (num_recv - s + R - 1) / R;
        const int32_t row0 = prefix[s];
        const uint32_t n = static_cast<uint32_t>(prefix[s + 1] - row0);
        const uint32_t chunks = div_ceil(n, C);
        const uint64_t base = comm.recv_base()[s];
        uint8_t* rx = reinterpret_cast<uint8_t*>(p.recv_x);
        float* rxs = reinterpret_cast<float*>(p.recv_x_scales);
        int64_t* rtopk = reinterpret_cast<int64_t*>(p.recv_topk_idx);
        float* rtopw = reinterpret_cast<float*>(p.recv_topk_weights);
        int32_t* rsrc = reinterpret_cast<int32_t*>(p.recv_src_idx);
        const bool px = comm.via_proxy(s);
        if (s == me) {
            const int ns = (num_send - me + R - 1) / R;
            self_rows(p, ns + j / R, ns + nsub, warp, lane, ring, used);
        }
        for (uint32_t k = j / R; s != me && k < chunks; k += nsub) {
            const uint64_t cum = base + k;
            const uint32_t slot = static_cast<uint32_t>(cum % spp);
            if (threadIdx.x == 0) {
                const fep::WaitCtx ctx = comm.wait_ctx(FEP_NORMAL_PHASE_DISPATCH_RECV, s);
                if (px) FEP_NP_TRACE(FEP_TRACE_NP_RECV_WAIT, me);
                ok = px ? fep::wait_geq(comm.px_arrivals(comm.px_data_id(s, slot)), cum / spp + 1,
                                        ctx)
                        : fep::wait_geq(comm.flag_ptr(me, s, slot), cum + 1, ctx);
                if (px) FEP_NP_TRACE(FEP_TRACE_NP_RECV_COPY, me);
            }
            __syncthreads();
            if (!ok) break;
            const uint32_t rows = min(C, n - k * C);
            const uint8_t* src = comm.slot_ptr(me, s, slot);
            if (px) {
                // The chunk arrived in the receive region (mapped host memory, or device memory
                // a NIC wrote): bring it into this rank's device slot of the pair (unused by a
                // peer on another node) in one pass with many loads in flight, then unpack from
                // there. NOTES: unpacking straight from host memory cost a chain of dependent
                // PCIe reads per row (payload, scales, ids, weights, source): 105 us per 32-token
                // chunk on the H200 (traced).
                block_copy16_px(reinterpret_cast<uint4*>(comm.slot_ptr(me, s, slot)),
                                reinterpret_cast<const uint4*>(
                                    comm.px_recv(comm.px_data_off(s, slot))),
                                rows * p.record_bytes / 16);
                __syncthreads();
            }
            const bool bq = bulk_queue && !px;
            const int64_t first = static_cast<int64_t>(row0) + k * C;
            if (bq && warp < movers) {
                // Rows past the outputs are not moved (the field warps report them).
                const uint32_t fit = static_cast<uint32_t>(
                    max(int64_t{0}, min(static_cast<int64_t>(rows), p.out_rows - first)));
                const uint32_t m0 = fit * warp / movers, m1 = fit * (warp + 1) / movers;
                used = fep::tma::warp_move_rows(
                    ring, used, m1 - m0, nullptr, src + static_cast<uint64_t>(m0) * p.record_bytes,
                    p.record_bytes, rx + (first + m0) * p.payload_bytes, p.payload_bytes,
                    p.payload_bytes, lane);
            } else {
                const uint32_t w0 = bq ? warp - movers : warp, ws = bq ? kWarps - movers : kWarps;
                for (uint32_t i = w0; i < rows; i += ws) {
                    const int64_t out = first + i;
                    if (out >= p.out_rows) {
                        report_overflow(p, s, out, lane);
                        continue;
                    }
                    const uint8_t* rec = src + static_cast<uint64_t>(i) * p.record_bytes;
                    if (!bq) {
                        warp_copy16<true>(reinterpret_cast<uint4*>(rx + out * p.payload_bytes),
                                          reinterpret_cast<const uint4*>(rec),
                                          p.payload_bytes / 16, lane);
                    }
                    unpack_fields(p, rec, out, lane);
                }
            }
            __syncthreads();
            if (threadIdx.x == 0) {
                if (px) {
                    Pusher pusher = Pusher::at(comm, blockIdx.x, px_head);
                    ok = pusher.push(static_cast<uint32_t>(s), 0, 0, 0,
                                     comm.px_imm(comm.px_credit_id(me, slot), 1),
                                     comm.wait_ctx(FEP_NORMAL_PHASE_DISPATCH_RECV, s));
                    px_head = pusher.head;
                    FEP_NP_TRACE(FEP_TRACE_NP_RECV_DONE, me);
                } else {
                    fep::st_release_sys(comm.credit_ptr(s, me, slot), cum + 1);
                }
            }
        }
        // Padding rows (num_worst_tokens): every receiver warp takes rows in turn.
        const int64_t first_pad = prefix[R];
        const int64_t gw = static_cast<int64_t>(j) * kWarps + warp;
        for (int64_t out = first_pad + gw; out < p.out_rows; out += num_recv * kWarps) {
            uint4* row = reinterpret_cast<uint4*>(rx + out * p.payload_bytes);
            for (uint32_t i = lane; i < p.payload_bytes / 16; i += 32) row[i] = make_uint4(0, 0, 0, 0);
            for (uint32_t i = lane; i < p.num_scales; i += 32) rxs[out * p.num_scales + i] = 0.0f;
            if (lane < K) {
                rtopk[out * K + lane] = -1;
                rtopw[out * K + lane] = 0.0f;
            }
            if (lane == 0) rsrc[out] = -1;
        }
    }

    if (!last_block(comm.ticket(1))) return;
    if (threadIdx.x < static_cast<unsigned>(R) && static_cast<int>(threadIdx.x) != me) {
        const int r = threadIdx.x;  // the (me -> me) pair has no queue chunks (self_rows)
        comm.sent_base()[r] += div_ceil(static_cast<uint32_t>(send_counts[r]), C);
        comm.recv_base()[r] += div_ceil(static_cast<uint32_t>(prefix[r + 1] - prefix[r]), C);
    }
}
