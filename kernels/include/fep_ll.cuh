// fep_ll.cuh: helpers shared by the low-latency kernels (kernels/ll_dispatch.cu,
// kernels/ll_combine.cu): buffer/flag addressing (src/ep/plan.rs LlLayout), bf16 bit tricks,
// fp8 group scales bit-identical to src/ep/quant.rs, and the "last block publishes" ticket.
#pragma once

#include <stdint.h>

#include "fep_abi.h"
#include "fep_device.cuh"

namespace fep {
namespace ll {

constexpr int kThreads = FEP_LL_THREADS;
constexpr int kWarps = kThreads / 32;
constexpr float kFp8Max = 448.0f;
constexpr float kFp8AmaxMin = 1e-4f;  // src/ep/quant.rs FP8_AMAX_MIN (DeepEP's kFP8Margin)

// LlLayout::unit_offset: ((set * 2 + area) * E + unit) * unit_bytes.
__device__ __forceinline__ uint64_t unit_offset(int set, int area, int num_experts, int unit,
                                                uint64_t unit_bytes) {
    return (static_cast<uint64_t>(set * 2 + area) * num_experts + unit) * unit_bytes;
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

// f32 -> bf16 bits, round to nearest even: exactly src/ep/quant.rs f32_to_bf16 (NaN kept quiet).
__device__ __forceinline__ uint32_t f32_to_bf16(float x) {
    const uint32_t b = __float_as_uint(x);
    if ((b & 0x7fffffffu) > 0x7f800000u) return (b >> 16) | 0x40u;
    return (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
}

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
    return f32_to_bf16(lo) | (f32_to_bf16(hi) << 16);
}

// src/ep/quant.rs fp8_group_scale: returns mult (into the cast), writes the stored scale.
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
// block: the last to finish, which then publishes the flags; it also re-zeroes the ticket.
// NOTES (ordering): each thread fences at system scope after its payload stores (peer memory may
// be another GPU's), the barrier then makes thread 0's ticket increment follow every thread's
// stores; the last block fences again after reading the ticket, so its release stores of the
// flags are ordered after every block's payload (fence cumulativity). A receiver that acquires a
// flag therefore sees all rows of that message.
__device__ __forceinline__ bool last_block_ticket(uint32_t* ticket) {
    __shared__ int s_last;
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) {
        const uint32_t old = atomicAdd(ticket, 1u);
        __threadfence_system();
        s_last = (old == gridDim.x - 1);
        if (s_last) *ticket = 0u;  // every other block has taken its ticket already
    }
    __syncthreads();
    return s_last != 0;
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
constexpr int kSegBytes = 32 * kSegChunks * 16;

// One warp copies chunks [seg * 256, seg * 256 + 256) of a row of n16 chunks, src read via L2.
__device__ __forceinline__ void copy_seg(const uint4* src, uint4* dst, int n16, int seg, int lane) {
    uint4 v[kSegChunks];
#pragma unroll
    for (int j = 0; j < kSegChunks; ++j) v[j] = make_uint4(0, 0, 0, 0);
    const int c0 = seg * 32 * kSegChunks + lane;
#pragma unroll
    for (int j = 0; j < kSegChunks; ++j) {
        if (c0 + 32 * j < n16) v[j] = __ldcg(src + c0 + 32 * j);
    }
#pragma unroll
    for (int j = 0; j < kSegChunks; ++j) {
        if (c0 + 32 * j < n16) dst[c0 + 32 * j] = v[j];
    }
}

}  // namespace ll
}  // namespace fep
