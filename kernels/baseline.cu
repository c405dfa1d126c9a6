// The standard stack's permute and un-permute around NCCL's all-to-all (ep-bench's comparison,
// ep-bench/src/nccl.rs): a row gather before the all-to-all, a per-token segmented sum after the
// return trip. Plain, vectorised (16-byte) memory-bound kernels: the baseline should be a fair one.

#include "fep_abi.h"
#include "fep_device.cuh"
#include "fep_ll.cuh"

extern "C" __global__ void __launch_bounds__(FEP_BASELINE_THREADS)
fep_gather_rows(const fep_gather_rows_params p) {
    const uint32_t vecs = p.row_bytes / 16;
    const int4* __restrict__ src = reinterpret_cast<const int4*>(p.src);
    const int32_t* __restrict__ index = reinterpret_cast<const int32_t*>(p.index);
    int4* __restrict__ dst = reinterpret_cast<int4*>(p.dst);
    for (int32_t row = blockIdx.x; row < p.num_rows; row += gridDim.x) {
        const int4* s = src + static_cast<size_t>(index[row]) * vecs;
        int4* d = dst + static_cast<size_t>(row) * vecs;
        for (uint32_t v = threadIdx.x; v < vecs; v += blockDim.x) d[v] = s[v];
    }
}

extern "C" __global__ void __launch_bounds__(FEP_BASELINE_THREADS)
fep_segment_sum(const fep_segment_sum_params p) {
    const int vecs = p.hidden / 8;  // 8 bf16 per 16-byte vector
    const uint4* __restrict__ src = reinterpret_cast<const uint4*>(p.src);
    const int32_t* __restrict__ offsets = reinterpret_cast<const int32_t*>(p.offsets);
    const int32_t* __restrict__ rows = reinterpret_cast<const int32_t*>(p.rows);
    uint4* __restrict__ out = reinterpret_cast<uint4*>(p.out);
    for (int32_t t = blockIdx.x; t < p.num_tokens; t += gridDim.x) {
        const int32_t begin = offsets[t], end = offsets[t + 1];
        for (int v = threadIdx.x; v < vecs; v += blockDim.x) {
            float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
            for (int32_t j = begin; j < end; ++j) {
                const uint4 w = src[static_cast<size_t>(rows[j]) * vecs + v];
                const uint32_t u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    acc[2 * q] += fep::ll::bf16_lo(u[q]);
                    acc[2 * q + 1] += fep::ll::bf16_hi(u[q]);
                }
            }
            out[static_cast<size_t>(t) * vecs + v] =
                make_uint4(fep::ll::pack_bf16x2(acc[0], acc[1]), fep::ll::pack_bf16x2(acc[2], acc[3]),
                           fep::ll::pack_bf16x2(acc[4], acc[5]),
                           fep::ll::pack_bf16x2(acc[6], acc[7]));
        }
    }
}

extern "C" __global__ void __launch_bounds__(FEP_COPY_THREADS) fep_copy_bytes(const fep_copy_params p) {
    const int4* __restrict__ src = reinterpret_cast<const int4*>(p.src);
    int4* __restrict__ dst = reinterpret_cast<int4*>(p.dst);
    const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
    uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    // Four independent 16-byte loads per thread before the stores: enough bytes in flight for
    // a small grid to reach its share of the memory bandwidth.
    for (; i + 3 * stride < p.vecs; i += 4 * stride) {
        const int4 a = __ldg(src + i);
        const int4 b = __ldg(src + i + stride);
        const int4 c = __ldg(src + i + 2 * stride);
        const int4 d = __ldg(src + i + 3 * stride);
        dst[i] = a;
        dst[i + stride] = b;
        dst[i + 2 * stride] = c;
        dst[i + 3 * stride] = d;
    }
    for (; i < p.vecs; i += stride) dst[i] = __ldg(src + i);
}
