// get_dispatch_layout in one launch (DeepEP V1 semantics; the Rust reference is
// src/ep/layout.rs, which the GPU tests compare against).
//
// Each block walks tiles of `tile_tokens` tokens (grid-stride over tiles):
//   pass 1  every (token, k) entry, coalesced: expert histogram in shared memory, entry -> rank;
//   pass 2  per entry, is it the token's first entry on its rank / its node? -> rank and node
//           histograms, and a 1 in the tile's is_token_in_rank rows staged in shared memory;
//   copy    the tile's rows are one contiguous span of the output: 16-byte stores.
// Then each block adds its histograms into `workspace` (global atomics); the last block to finish
// (ticket counter, threadfence-reduction pattern) moves the sums into the outputs with atomicExch,
// which also leaves the workspace zero for the next launch. No memset, no second launch.
#include "fep_abi.h"
#include "fep_device.cuh"

namespace {
constexpr int kThreads = FEP_LAYOUT_THREADS;
}

extern "C" __global__ void __launch_bounds__(kThreads) fep_dispatch_layout(const fep_layout_params p) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int num_experts = p.num_experts;
    const int num_ranks = p.num_ranks;
    const int num_topk = p.num_topk;
    const int tile_tokens = p.tile_tokens;
    const int ranks_per_node = p.ranks_per_node;
    const int num_nodes = num_ranks / ranks_per_node;
    const int experts_per_rank = num_experts / num_ranks;
    const int num_bins = num_experts + num_ranks + num_nodes;

    // Shared memory: hist [num_bins] | entry_rank [tile_tokens * num_topk] | stage (16-aligned)
    // [tile_tokens * num_ranks] bytes. The launcher sizes it the same way (src/cuda/layout.rs).
    int* hist = reinterpret_cast<int*>(smem);
    int* entry_rank = hist + num_bins;
    const int stage_off = ((num_bins + tile_tokens * num_topk) * 4 + 15) & ~15;
    unsigned char* stage = smem + stage_off;
    uint4* stage4 = reinterpret_cast<uint4*>(stage);

    for (int i = threadIdx.x; i < num_bins; i += kThreads) hist[i] = 0;

    const int64_t* topk_idx = reinterpret_cast<const int64_t*>(p.topk_idx);
    uint8_t* in_rank = reinterpret_cast<uint8_t*>(p.is_token_in_rank);
    fep_dev_error* err = reinterpret_cast<fep_dev_error*>(p.dev_error);
    // NOTES: tile_tokens is a multiple of 16, so every tile's first row starts 16-aligned
    // relative to the output; the pointer itself decides whether 16-byte stores are allowed.
    const bool vec_out = (p.is_token_in_rank & 15) == 0;

    const int num_tiles = (p.num_tokens + tile_tokens - 1) / tile_tokens;
    for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
        const int t0 = tile * tile_tokens;
        const int n = min(tile_tokens, p.num_tokens - t0);
        const int num_entries = n * num_topk;
        const int tile_bytes = n * num_ranks;
        for (int i = threadIdx.x; i < (tile_bytes + 15) / 16; i += kThreads)
            stage4[i] = make_uint4(0, 0, 0, 0);
        __syncthreads();

        const int64_t* src = topk_idx + static_cast<int64_t>(t0) * num_topk;
        for (int i = threadIdx.x; i < num_entries; i += kThreads) {
            const int64_t e = __ldg(reinterpret_cast<const long long*>(src) + i);
            int r = -1;
            if (e >= 0 && e < num_experts) {
                atomicAdd(&hist[e], 1);
                r = static_cast<int>(e) / experts_per_rank;
            } else if (e != -1) {
                fep::report_error(err, FEP_DEV_BAD_INPUT, p.rank, 0, UINT32_MAX,
                                  static_cast<uint64_t>(num_experts), static_cast<uint64_t>(e));
            }
            entry_rank[i] = r;
        }
        __syncthreads();

        for (int i = threadIdx.x; i < num_entries; i += kThreads) {
            const int r = entry_rank[i];
            if (r < 0) continue;
            const int t = i / num_topk;
            const int k = i - t * num_topk;
            const int* row = entry_rank + t * num_topk;
            const int node = r / ranks_per_node;
            bool first_rank = true, first_node = true;
            for (int j = 0; j < k; ++j) {
                const int rj = row[j];
                if (rj < 0) continue;
                first_rank &= rj != r;
                first_node &= rj / ranks_per_node != node;
            }
            if (first_rank) {
                atomicAdd(&hist[num_experts + r], 1);
                stage[t * num_ranks + r] = 1;
            }
            if (first_node) atomicAdd(&hist[num_experts + num_ranks + node], 1);
        }
        __syncthreads();

        uint8_t* dst = in_rank + static_cast<int64_t>(t0) * num_ranks;
        int done = 0;
        if (vec_out) {
            const int nvec = tile_bytes / 16;
            uint4* dst4 = reinterpret_cast<uint4*>(dst);
            for (int i = threadIdx.x; i < nvec; i += kThreads) dst4[i] = stage4[i];
            done = nvec * 16;
        }
        for (int i = done + threadIdx.x; i < tile_bytes; i += kThreads) dst[i] = stage[i];
        __syncthreads();  // the next tile re-zeroes the stage
    }

    int* acc = reinterpret_cast<int*>(p.workspace);
    for (int i = threadIdx.x; i < num_bins; i += kThreads) {
        const int v = hist[i];
        if (v != 0) atomicAdd(&acc[i], v);
    }
    __threadfence();
    __syncthreads();
    __shared__ bool is_last;
    if (threadIdx.x == 0) {
        const unsigned ticket = atomicAdd(reinterpret_cast<unsigned*>(&acc[num_bins]), 1u);
        is_last = ticket == gridDim.x - 1;
    }
    __syncthreads();
    if (!is_last) return;
    __threadfence();

    int* per_expert = reinterpret_cast<int*>(p.num_tokens_per_expert);
    int* per_rank = reinterpret_cast<int*>(p.num_tokens_per_rank);
    int* per_node = reinterpret_cast<int*>(p.num_tokens_per_node);
    for (int i = threadIdx.x; i < num_bins; i += kThreads) {
        const int v = atomicExch(&acc[i], 0);
        if (i < num_experts) {
            per_expert[i] = v;
        } else if (i < num_experts + num_ranks) {
            per_rank[i - num_experts] = v;
        } else if (per_node != nullptr) {
            per_node[i - num_experts - num_ranks] = v;
        }
    }
    if (threadIdx.x == 0) atomicExch(&acc[num_bins], 0);
}
