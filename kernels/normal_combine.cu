// Normal-mode combine with a dispatch handle (peer stores; the proxy for peers on other nodes).
// Same queues as dispatch, the other direction; grid: the rank's SM budget, FEP_NORMAL_THREADS
// threads, first half send, second half receive (a single rank: every block receives).
//   sender   (towards d != this rank): the rows this rank received from d (rank_prefix[d] ..),
//            in order, chunked by C, as combine records (bf16 row, top-k weights) into d's recv
//            slots;
//   forwarder (peers on other nodes only): the first receiver blocks copy each arrived chunk from
//            the proxy receive region into the peer's device slot and publish its device flag;
//   receiver: one warp per token of this rank (tokens gw, gw + W, ... ascending): for every rank
//            r the token went to, ascending, wait for the chunk holding it (send_pos[t][r] gives
//            the row), sum the rows in fp32 in that order, round to bf16 once. The last warp to
//            finish a row of a chunk (per-slot counter) returns its credit. This rank's own rows
//            are read where they are, in x (row rank_prefix[me] + send_pos[t][me]) and
//            topk_weights: no chunk, flag or credit, and combine leaves the (me -> me) queue's
//            bases alone (dispatch's chunks of that pair keep their own numbering).
// NOTES: no deadlock although a chunk's rows are consumed by many warps: the lowest unfinished
// token's rows sit in each rank's lowest unconsumed chunk, which its sender may always send
// (credits for every earlier chunk are back), and every warp walks its tokens in ascending order.
#include "fep_abi.h"
#include "fep_device.cuh"
#include "fep_normal.cuh"

namespace {

__device__ __forceinline__ void combine_add_bf16x8(float (&acc)[8], const uint4& v) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        acc[2 * i] += __uint_as_float(w[i] << 16);
        acc[2 * i + 1] += __uint_as_float(w[i] & 0xffff0000u);
    }
}

__device__ __forceinline__ uint32_t combine_bf16_bits(float f) {
    // Round to nearest even (NaN kept quiet), as src/protocol/quant.rs f32_to_bf16.
    const uint32_t u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u >> 16) | 0x40u;
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

// Two floats to packed bf16 (lo in the low half): one cvt.rn.bf16x2.f32 (round to nearest even,
// subnormals kept: the same bits as combine_bf16_bits for every non-NaN input), and the integer
// path only where an input is NaN, whose bits the hardware makes canonical and the reference
// keeps. NOTES (issue rate): the receiver was bound by instructions issued, not by memory (ncu:
// 6.6 cycles per issued instruction at 4 warps per scheduler, i.e. an issue about every 1.7
// cycles); the integer rounding was about 10 instructions a value.
__device__ __forceinline__ uint32_t combine_pack2(float lo, float hi) {
    uint32_t r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    if (lo != lo || hi != hi) r = combine_bf16_bits(lo) | (combine_bf16_bits(hi) << 16);
    return r;
}

// Each -0.0 half of two packed bf16 values made +0.0 (0.0 + -0.0 in the sum); others unchanged.
__device__ __forceinline__ uint32_t combine_pos_zero2(uint32_t w) {
    return w & ~(__vcmpeq2(w & 0x7fff7fffu, 0u) & 0x80008000u);
}

__device__ __forceinline__ uint4 combine_pos_zero(uint4 v) {
    return make_uint4(combine_pos_zero2(v.x), combine_pos_zero2(v.y), combine_pos_zero2(v.z),
                      combine_pos_zero2(v.w));
}

__device__ __forceinline__ uint4 combine_pack(const float (&acc)[8]) {
    uint4 o;
    o.x = combine_pack2(acc[0], acc[1]);
    o.y = combine_pack2(acc[2], acc[3]);
    o.z = combine_pack2(acc[4], acc[5]);
    o.w = combine_pack2(acc[6], acc[7]);
    return o;
}


// One token's output row: the sum of np rows (rows[0..np), ascending by rank) in fp32, rounded
// to bf16 once. kU 16-byte vectors per lane per rank are loaded before any is added, so up to
// kNp * kU loads are in flight per lane (few ranks: more vectors each, as a plain copy has).
template <int kNp, int kU>
__device__ __forceinline__ void combine_row(uint4* __restrict__ dst, const uint4* const (&rows)[FEP_NORMAL_MAX_RANKS],
                                            int np, uint32_t row16, int lane) {
    if constexpr (kNp == 1) {
        // One rank (np is 0 or 1): the sum of one row is the row itself (a bf16 value converts
        // to fp32 and back unchanged), so it is copied, with -0.0 made +0.0 as 0.0 + -0.0 makes
        // it (fp8 rows dequantised to bf16 hold -0.0); a token routed nowhere gets zeros.
        for (uint32_t i = lane; i < row16; i += 32 * kU) {
            uint4 v[kU];
#pragma unroll
            for (int u = 0; u < kU; ++u) {
                v[u] = make_uint4(0u, 0u, 0u, 0u);
                if (np == 1 && i + 32 * u < row16) v[u] = __ldcg(rows[0] + i + 32 * u);
            }
#pragma unroll
            for (int u = 0; u < kU; ++u) {
                if (i + 32 * u < row16) dst[i + 32 * u] = combine_pos_zero(v[u]);
            }
        }
    } else {
        for (uint32_t i = lane; i < row16; i += 32 * kU) {
            uint4 v[kNp][kU];
#pragma unroll
            for (int q = 0; q < kNp; ++q) {
#pragma unroll
                for (int u = 0; u < kU; ++u) {
                    if (q < np && i + 32 * u < row16) v[q][u] = __ldcg(rows[q] + i + 32 * u);
                }
            }
#pragma unroll
            for (int u = 0; u < kU; ++u) {
                float a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
                for (int q = 0; q < kNp; ++q) {
                    if (q < np) combine_add_bf16x8(a, v[q][u]);
                }
                if (i + 32 * u < row16) dst[i + 32 * u] = combine_pack(a);
            }
        }
    }
}
}  // namespace

namespace {

// The kernel body, with the receiver's row variant fixed at compile time (see the kernels at the
// end): ptxas spilled when one kernel held several variants, though each fits alone.
template <int kNp, int kU>
__device__ __forceinline__ void combine_body(const fep_normal_combine_params& p) {
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
    const int num_send = R > 1 ? static_cast<int>(gridDim.x) / 2 : 0;
    const int num_recv = gridDim.x - num_send;
    const int32_t* prefix = reinterpret_cast<const int32_t*>(p.handle.rank_prefix);
    const int32_t* send_counts = reinterpret_cast<const int32_t*>(p.handle.send_counts);
    const uint32_t row16 = static_cast<uint32_t>(p.hidden) / 8;  // 16-byte vectors per row
    __shared__ bool ok;
    // Proxy ring of this block: the receiver's warps take turns (lock) and share the head.
    __shared__ unsigned long long px_head;
    __shared__ int px_lock;
    if (threadIdx.x == 0) {
        px_lock = 0;
        px_head = p.comm.proxy.mask != 0u
                      ? fep::ld_acquire_sys(&comm.px_ring(blockIdx.x)->head)
                      : 0;
    }
    __syncthreads();

    if (static_cast<int>(blockIdx.x) < num_send) {
        // ---- sender: rows received from d go back to d ----
        // Peers other than this rank: peer index q = j % (R - 1), nsub blocks per peer.
        const int j = blockIdx.x;
        const int P = R - 1;
        const int q = j % P;
        const int d = (me + 1 + q) % R;
        const int nsub = (num_send - q + P - 1) / P;
        const int32_t row0 = prefix[d];
        const uint32_t n = static_cast<uint32_t>(prefix[d + 1] - row0);
        const uint32_t chunks = div_ceil(n, C);
        const uint64_t base = comm.sent_base()[d];
        const uint4* x = reinterpret_cast<const uint4*>(p.x);
        const float* w = reinterpret_cast<const float*>(p.topk_weights);
        const bool px = comm.via_proxy(d);
        Pusher pusher{};
        if (threadIdx.x == 0 && px) pusher = Pusher::at(comm, blockIdx.x, px_head);
        for (uint32_t k = j / P; k < chunks; k += nsub) {
            const uint64_t cum = base + k;
            const uint32_t slot = static_cast<uint32_t>(cum % spp);
            if (threadIdx.x == 0) {
                const fep::WaitCtx ctx = comm.wait_ctx(FEP_NORMAL_PHASE_COMBINE_SEND, d);
                if (px) FEP_NP_TRACE(FEP_TRACE_PHASE_STRIDE + FEP_TRACE_NP_SEND_WAIT, me);
                ok = cum < spp ||
                     (px ? fep::wait_geq(comm.px_arrivals(comm.px_credit_id(d, slot)), cum / spp,
                                         ctx)
                         : fep::wait_geq(comm.credit_ptr(me, d, slot), cum - spp + 1, ctx));
                if (px) FEP_NP_TRACE(FEP_TRACE_PHASE_STRIDE + FEP_TRACE_NP_SEND_STAGE, me);
            }
            __syncthreads();
            if (!ok) break;
            const uint32_t rows = min(C, n - k * C);
            uint8_t* dst =
                px ? comm.px_send(comm.px_data_off(d, slot)) : comm.slot_ptr(d, me, slot);
            for (uint32_t i = warp; i < rows; i += kWarps) {
                const int64_t row = static_cast<int64_t>(row0) + k * C + i;
                uint8_t* rec = dst + static_cast<uint64_t>(i) * p.record_bytes;
                warp_copy16<false>(reinterpret_cast<uint4*>(rec), x + row * row16, row16, lane);
                if (lane < K) {
                    reinterpret_cast<float*>(rec + p.topk_weights_offset)[lane] =
                        w != nullptr ? w[row * K + lane] : 0.0f;
                }
            }
            if (px) __threadfence_system();  // staged rows visible to the proxy before the push
            __syncthreads();
            if (threadIdx.x == 0) {
                if (px) {
                    ok = pusher.push(static_cast<uint32_t>(d), comm.px_data_off(d, slot),
                                     comm.px_data_off(me, slot), rows * p.record_bytes,
                                     comm.px_imm(comm.px_data_id(me, slot), rows),
                                     comm.wait_ctx(FEP_NORMAL_PHASE_COMBINE_SEND, d));
                    FEP_NP_TRACE(FEP_TRACE_PHASE_STRIDE + FEP_TRACE_NP_SEND_PUSHED, me);
                } else {
                    fep::st_release_sys(comm.flag_ptr(d, me, slot), cum + 1);
                }
            }
        }
    } else {
        // Forwarders: for every peer on another node, the first receiver blocks (two per peer,
        // one when blocks are few) move its arrived chunks from the proxy receive region (mapped
        // host memory) into this rank's device slot of that peer and publish the device flag, as
        // a same-node peer's stores would. The token warps then read device memory only and
        // poll device flags: one host-memory poller per forwarder instead of one per token warp,
        // and bulk PCIe reads with many loads in flight.
        const uint32_t mask = p.comm.proxy.mask;
        const int nprox = __popc(mask);
        const int fpp = nprox == 0 ? 0 : (num_recv >= 4 * nprox + 1 ? 2 : 1);
        const int num_fwd = nprox * fpp;  // < num_recv: num_recv >= R > nprox
        const int jr = static_cast<int>(blockIdx.x) - num_send;
        if (jr < num_fwd) {
            uint32_t m = mask;
            for (int i = 0; i < jr / fpp; ++i) m &= m - 1;
            const int r = __ffs(m) - 1;
            const uint32_t n = static_cast<uint32_t>(send_counts[r]);
            const uint32_t chunks = div_ceil(n, C);
            const uint64_t base = comm.recv_base()[r];
            for (uint32_t k = static_cast<uint32_t>(jr % fpp); k < chunks; k += fpp) {
                const uint64_t cum = base + k;
                const uint32_t slot = static_cast<uint32_t>(cum % spp);
                if (threadIdx.x == 0) {
                    FEP_NP_TRACE(FEP_TRACE_PHASE_STRIDE + FEP_TRACE_NP_RECV_WAIT, me);
                    ok = fep::wait_geq(comm.px_arrivals(comm.px_data_id(r, slot)), cum / spp + 1,
                                       comm.wait_ctx(FEP_NORMAL_PHASE_COMBINE_RECV, r));
                    FEP_NP_TRACE(FEP_TRACE_PHASE_STRIDE + FEP_TRACE_NP_RECV_COPY, me);
                }
                __syncthreads();
                if (!ok) break;
                const uint32_t rows = min(C, n - k * C);
                const uint4* from =
                    reinterpret_cast<const uint4*>(comm.px_recv(comm.px_data_off(r, slot)));
                block_copy16_px(reinterpret_cast<uint4*>(comm.slot_ptr(me, r, slot)), from,
                                rows * p.record_bytes / 16);
                __threadfence();
                __syncthreads();
                if (threadIdx.x == 0) {
                    fep::st_release_sys(comm.flag_ptr(me, r, slot), cum + 1);
                    FEP_NP_TRACE(FEP_TRACE_PHASE_STRIDE + FEP_TRACE_NP_RECV_DONE, me);
                }
            }
        } else {
            // ---- receiver: one warp per token ----
            const int j = jr - num_fwd;
            const int64_t num_warps = static_cast<int64_t>(num_recv - num_fwd) * kWarps;
            const int32_t* send_pos = reinterpret_cast<const int32_t*>(p.handle.send_pos);
            uint4* out = reinterpret_cast<uint4*>(p.combined_x);
            float* out_w = reinterpret_cast<float*>(p.combined_weights);
            const uint8_t* own_x = reinterpret_cast<const uint8_t*>(p.x);
            const float* own_w = reinterpret_cast<const float*>(p.topk_weights);
            const int64_t own_row0 = prefix[me];
            bool alive = true;
            // NOTES (latency): a warp's tokens are a chain of dependent memory round trips
            // (send_pos, then the rows, then the weights). With few ranks (kEarly: registers to
            // spare) the next token's send_pos is loaded while this token's rows are, and the
            // weights' loads are issued before the rows' and added after them, so only the
            // rows' loads wait in line. R <= kNp (the host picks the variant by rank count).
            constexpr bool kEarly = kNp <= 2;
            const int64_t t0 = static_cast<int64_t>(j) * kWarps + warp;
            int32_t pos_cur[kNp];
#pragma unroll
            for (int r = 0; r < kNp; ++r) {
                pos_cur[r] = (kEarly && r < R && t0 < T) ? send_pos[t0 * R + r] : -1;
            }
            for (int64_t t = t0; t < T && alive; t += num_warps) {
                int32_t pos_next[kNp];
                const int64_t tn = t + num_warps;
#pragma unroll
                for (int r = 0; r < kNp; ++r) {
                    if (!kEarly) pos_cur[r] = r < R ? send_pos[t * R + r] : -1;
                    pos_next[r] = (kEarly && r < R && tn < T) ? send_pos[tn * R + r] : -1;
                }
                // rec[r]: the token's row in r's chunk, or null; indexed only by unrolled constants.
                const uint8_t* rec[kMaxRanks];
#pragma unroll
                for (int r = 0; r < kMaxRanks; ++r) rec[r] = nullptr;
#pragma unroll
                for (int r = 0; r < kNp; ++r) {
                    if (r >= R) continue;
                    const int32_t pos = pos_cur[r];
                    if (pos < 0) continue;
                    if (r == me) {  // this rank's own row, in place (x)
                        rec[r] = own_x + static_cast<uint64_t>(own_row0 + pos) * row16 * 16;
                        continue;
                    }
                    const uint64_t cum = comm.recv_base()[r] + static_cast<uint32_t>(pos) / C;
                    const uint32_t slot = static_cast<uint32_t>(cum % spp);
                    bool got = true;
                    if (lane == 0) {
                        // Same-node peers' stores, or a forwarder (peers on other nodes), set it.
                        got = fep::wait_geq(comm.flag_ptr(me, r, slot), cum + 1,
                                            comm.wait_ctx(FEP_NORMAL_PHASE_COMBINE_RECV, r));
                    }
                    got = __shfl_sync(0xffffffffu, got, 0);
                    if (!got) alive = false;
                    rec[r] = comm.slot_ptr(me, r, slot) +
                             static_cast<uint64_t>(static_cast<uint32_t>(pos) % C) * p.record_bytes;
                }
                if (!alive) break;
                // The rows to sum, ascending by rank, packed to the front: lane r holds rank
                // r's row pointer and the q-th present rank comes by shuffle, so every array
                // below is indexed by constants (registers, no local memory).
                uint32_t present = 0;
#pragma unroll
                for (int r = 0; r < kMaxRanks; ++r) present |= rec[r] != nullptr ? 1u << r : 0u;
                const int np = __popc(present);
                uint64_t lane_ptr = 0;
#pragma unroll
                for (int r = 0; r < kMaxRanks; ++r)
                    if (lane == r) lane_ptr = reinterpret_cast<uint64_t>(rec[r]);
                const uint4* rows[kMaxRanks];
                {
                    uint32_t m = present;
#pragma unroll
                    for (int q = 0; q < kMaxRanks; ++q) {
                        const int r = m != 0u ? __ffs(m) - 1 : 0;
                        m &= m - 1u;
                        rows[q] = reinterpret_cast<const uint4*>(
                            __shfl_sync(0xffffffffu, lane_ptr, r));
                    }
                }
                // The weights of the present ranks, q-th present rank in wq[q] (loaded now, summed
                // after the rows in the same ascending order).
                const bool want_w = out_w != nullptr && lane < K;
                float wq[kNp];
#pragma unroll
                for (int q = 0; q < kNp; ++q) wq[q] = 0.0f;
                auto load_weights = [&]() {
                    uint32_t m = present;
#pragma unroll
                    for (int q = 0; q < kNp; ++q) {
                        if (m == 0u) break;
                        const int r = __ffs(m) - 1;
                        m &= m - 1u;
                        if (r == me) {
                            int32_t pos_me = 0;
#pragma unroll
                            for (int rr = 0; rr < kNp; ++rr)
                                if (rr == me) pos_me = pos_cur[rr];
                            const int64_t row = own_row0 + pos_me;
                            wq[q] = own_w != nullptr ? own_w[row * K + lane] : 0.0f;
                        } else {
                            wq[q] = __ldcg(reinterpret_cast<const float*>(
                                               reinterpret_cast<const uint8_t*>(rows[q]) +
                                               p.topk_weights_offset) +
                                           lane);
                        }
                    }
                };
                if (kEarly && want_w) load_weights();
                uint4* dst = out + t * row16;
                combine_row<kNp, kU>(dst, rows, np, row16, lane);
                if (!kEarly && want_w) load_weights();
                if (want_w) {
                    float a = 0.0f;
#pragma unroll
                    for (int q = 0; q < kNp; ++q) {
                        if (q < np) a += wq[q];
                    }
                    out_w[t * K + lane] = a;
                }
                __syncwarp();
                // Only peers' chunks take credits: a token whose rows are all this rank's own
                // (every token at one rank) skips the fence, a memory round trip per token.
                if (lane == 0 && (present & ~(1u << me)) != 0u) {
                    // NOTES: every lane's reads of this token's rows are done (__syncwarp); the
                    // warp that brings a chunk's counter to its row count resets it and returns the
                    // credit (the slot's next chunk cannot arrive before that credit).
                    __threadfence();
#pragma unroll
                    for (int r = 0; r < kNp; ++r) {
                        const int32_t pos = pos_cur[r];
                        if (r >= R || pos < 0 || r == me) continue;  // own rows: no chunk to credit
                        const uint32_t k = static_cast<uint32_t>(pos) / C;
                        const uint64_t cum = comm.recv_base()[r] + k;
                        const uint32_t slot = static_cast<uint32_t>(cum % spp);
                        const uint32_t rows = min(C, static_cast<uint32_t>(send_counts[r]) - k * C);
                        uint32_t* cnt_ptr = comm.consumed(r, slot);
                        if (atomicAdd(cnt_ptr, 1u) + 1u == rows) {
                            atomicExch(cnt_ptr, 0u);
                            __threadfence();
                            if (comm.via_proxy(r)) {
                                // A zero-length write to r; the block's ring under its lock.
                                while (atomicCAS(&px_lock, 0, 1) != 0) __nanosleep(32);
                                __threadfence_block();
                                volatile unsigned long long* h = &px_head;
                                Pusher pu = Pusher::at(comm, blockIdx.x, *h);
                                pu.push(static_cast<uint32_t>(r), 0, 0, 0,
                                        comm.px_imm(comm.px_credit_id(me, slot), 1),
                                        comm.wait_ctx(FEP_NORMAL_PHASE_COMBINE_RECV, r));
                                *h = pu.head;
                                __threadfence_block();
                                atomicExch(&px_lock, 0);
                            } else {
                                fep::st_release_sys(comm.credit_ptr(r, me, slot), cum + 1);
                            }
                        }
                    }
                }
                __syncwarp();
#pragma unroll
                for (int r = 0; r < kNp; ++r) pos_cur[r] = pos_next[r];
            }
        }
    }

    if (!last_block(comm.ticket(2))) return;
    if (threadIdx.x < static_cast<unsigned>(R) && static_cast<int>(threadIdx.x) != me) {
        const int r = threadIdx.x;  // the (me -> me) pair had no combine chunk
        comm.sent_base()[r] += div_ceil(static_cast<uint32_t>(prefix[r + 1] - prefix[r]), C);
        comm.recv_base()[r] += div_ceil(static_cast<uint32_t>(send_counts[r]), C);
    }
}

}  // namespace

// One kernel per row variant, chosen by the host from the number of ranks (src/cuda/launch.rs):
// a token's rows come from at most num_ranks ranks, and fewer ranks leave registers for more
// 16-byte loads in flight per lane (at one rank 14, two round trips for a 7168-wide row).
extern "C" __global__ void __launch_bounds__(FEP_NORMAL_THREADS)
    fep_normal_combine(const fep_normal_combine_params p) {
    combine_body<fep::normal::kMaxRanks, 2>(p);
}

extern "C" __global__ void __launch_bounds__(FEP_NORMAL_THREADS)
    fep_normal_combine_2(const fep_normal_combine_params p) {
    combine_body<2, 4>(p);
}

extern "C" __global__ void __launch_bounds__(FEP_NORMAL_THREADS)
    fep_normal_combine_1(const fep_normal_combine_params p) {
    combine_body<1, 14>(p);
}
