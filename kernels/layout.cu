// get_dispatch_layout in one launch (DeepEP V1 semantics; the Rust reference is
// src/protocol/layout.rs, which the GPU tests compare against). Two variants, same tile code:
//
// Tile work (per block, for tiles of `tile_tokens` tokens):
//   pass 1  every (token, k) entry, coalesced, several loads in flight per thread: expert
//           histogram in shared memory, entry -> rank;
//   pass 2  per entry, is it the token's first entry on its rank / its node? -> rank and node
//           histograms, and a 1 in the tile's is_token_in_rank rows staged in shared memory;
//   copy    the tile's rows are one contiguous span of the output: 16-byte stores.
//
// fep_dispatch_layout (the default): any grid; each block adds its histograms into `workspace`
//   (global atomics); the last block to finish (ticket, threadfence-reduction pattern) moves the
//   sums into the outputs with atomicExch, which leaves the workspace zero for the next launch.
//   H200, 4096 x top-8, 256 experts, 64 ranks, tile 32 (128 blocks): median 9.9 us per launch.
// fep_dispatch_layout_cluster: exactly one cluster of FEP_LAYOUT_CLUSTER_BLOCKS blocks; the
//   blocks sum their histograms through distributed shared memory (no global atomics, no
//   workspace). Predicted faster (no fence/atomic round trips), measured slower: 16.7 us on the
//   same input, the work of 128 SMs squeezed onto 8. Kept for comparison, not the default.
#include <cooperative_groups.h>

#include "fep_abi.h"
#include "fep_device.cuh"

namespace {

namespace cg = cooperative_groups;

constexpr int kUnroll = 4;  // loads in flight per thread in pass 1

struct SmemLayout {
    int* hist;                // [num_bins]: experts | ranks | nodes
    int* entry_rank;          // [tile_tokens * num_topk]
    unsigned char* stage;     // [tile_tokens * num_ranks], 16-byte aligned
};

// NOTES: src/ep/layout_gpu.rs (DispatchLayoutGpu::plan) sizes the dynamic shared memory the same
// way.
__device__ __forceinline__ SmemLayout carve(unsigned char* smem, int num_bins, int tile_tokens,
                                            int num_topk) {
    SmemLayout s;
    s.hist = reinterpret_cast<int*>(smem);
    s.entry_rank = s.hist + num_bins;
    s.stage = smem + (((num_bins + tile_tokens * num_topk) * 4 + 15) & ~15);
    return s;
}

// Processes tiles first_tile, first_tile + stride, ... into the block's shared histograms
// (zeroed here). Ends with a barrier when it ran at least one tile.
template <int kThreads>
__device__ __forceinline__ void layout_tiles(const fep_layout_params& p, const SmemLayout& s,
                                             int first_tile, int stride) {
    const int num_experts = p.num_experts;
    const int num_ranks = p.num_ranks;
    const int num_topk = p.num_topk;
    const int tile_tokens = p.tile_tokens;
    const int ranks_per_node = p.ranks_per_node;
    const int num_bins = num_experts + num_ranks + num_ranks / ranks_per_node;
    const int experts_per_rank = num_experts / num_ranks;

    for (int i = threadIdx.x; i < num_bins; i += kThreads) s.hist[i] = 0;

    const long long* topk_idx = reinterpret_cast<const long long*>(p.topk_idx);
    uint8_t* in_rank = reinterpret_cast<uint8_t*>(p.is_token_in_rank);
    uint4* stage4 = reinterpret_cast<uint4*>(s.stage);
    // NOTES: tile_tokens is a multiple of 16, so every tile's first row starts 16-aligned
    // relative to the output; the pointer itself decides whether 16-byte stores are allowed.
    const bool vec_out = (p.is_token_in_rank & 15) == 0;

    const int num_tiles = (p.num_tokens + tile_tokens - 1) / tile_tokens;
    for (int tile = first_tile; tile < num_tiles; tile += stride) {
        const int t0 = tile * tile_tokens;
        const int n = min(tile_tokens, p.num_tokens - t0);
        const int num_entries = n * num_topk;
        const int tile_bytes = n * num_ranks;
        for (int i = threadIdx.x; i < (tile_bytes + 15) / 16; i += kThreads)
            stage4[i] = make_uint4(0, 0, 0, 0);
        __syncthreads();

        const long long* src = topk_idx + static_cast<int64_t>(t0) * num_topk;
        for (int base = 0; base < num_entries; base += kThreads * kUnroll) {
            long long v[kUnroll];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
                const int i = base + u * kThreads + threadIdx.x;
                v[u] = i < num_entries ? __ldg(src + i) : -1;
            }
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
                const int i = base + u * kThreads + threadIdx.x;
                if (i >= num_entries) break;
                const long long e = v[u];
                int r = -1;
                if (e >= 0 && e < num_experts) {
                    atomicAdd(&s.hist[e], 1);
                    r = static_cast<int>(e) / experts_per_rank;
                } else if (e != -1) {
                    fep::report_error(p.dev_error, FEP_DEV_BAD_INPUT, p.rank, 0, UINT32_MAX,
                                      static_cast<uint64_t>(num_experts), static_cast<uint64_t>(e));
                }
                s.entry_rank[i] = r;
            }
        }
        __syncthreads();

        for (int i = threadIdx.x; i < num_entries; i += kThreads) {
            const int r = s.entry_rank[i];
            if (r < 0) continue;
            const int t = i / num_topk;
            const int k = i - t * num_topk;
            const int* row = s.entry_rank + t * num_topk;
            const int node = r / ranks_per_node;
            bool first_rank = true, first_node = true;
            for (int j = 0; j < k; ++j) {
                const int rj = row[j];
                if (rj < 0) continue;
                first_rank &= rj != r;
                first_node &= rj / ranks_per_node != node;
            }
            if (first_rank) {
                atomicAdd(&s.hist[num_experts + r], 1);
                s.stage[t * num_ranks + r] = 1;
            }
            if (first_node) atomicAdd(&s.hist[num_experts + num_ranks + node], 1);
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
        for (int i = done + threadIdx.x; i < tile_bytes; i += kThreads) dst[i] = s.stage[i];
        __syncthreads();  // the next tile re-zeroes the stage
    }
}

__device__ __forceinline__ void write_bin(const fep_layout_params& p, int i, int v) {
    const int num_experts = p.num_experts;
    const int num_ranks = p.num_ranks;
    if (i < num_experts) {
        reinterpret_cast<int*>(p.num_tokens_per_expert)[i] = v;
    } else if (i < num_experts + num_ranks) {
        reinterpret_cast<int*>(p.num_tokens_per_rank)[i - num_experts] = v;
    } else if (p.num_tokens_per_node != 0) {
        reinterpret_cast<int*>(p.num_tokens_per_node)[i - num_experts - num_ranks] = v;
    }
}

}  // namespace

extern "C" __global__ void __launch_bounds__(FEP_LAYOUT_THREADS)
    fep_dispatch_layout(const fep_layout_params p) {
    constexpr int kThreads = FEP_LAYOUT_THREADS;
    extern __shared__ __align__(16) unsigned char smem[];
    const int num_bins = p.num_experts + p.num_ranks + p.num_ranks / p.ranks_per_node;
    const SmemLayout s = carve(smem, num_bins, p.tile_tokens, p.num_topk);
    layout_tiles<kThreads>(p, s, blockIdx.x, gridDim.x);
    // (A block that ran no tile reads only the bins it zeroed itself: same thread, same index.)

    int* acc = reinterpret_cast<int*>(p.workspace);
    for (int i = threadIdx.x; i < num_bins; i += kThreads) {
        const int v = s.hist[i];
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
    for (int i = threadIdx.x; i < num_bins; i += kThreads) write_bin(p, i, atomicExch(&acc[i], 0));
    if (threadIdx.x == 0) atomicExch(&acc[num_bins], 0);
}

extern "C" __global__ void __cluster_dims__(FEP_LAYOUT_CLUSTER_BLOCKS, 1, 1)
    __launch_bounds__(FEP_LAYOUT_CLUSTER_THREADS)
        fep_dispatch_layout_cluster(const fep_layout_params p) {
    constexpr int kThreads = FEP_LAYOUT_CLUSTER_THREADS;
    constexpr int kBlocks = FEP_LAYOUT_CLUSTER_BLOCKS;
    extern __shared__ __align__(16) unsigned char smem[];
    const int num_bins = p.num_experts + p.num_ranks + p.num_ranks / p.ranks_per_node;
    const SmemLayout s = carve(smem, num_bins, p.tile_tokens, p.num_topk);
    cg::cluster_group cluster = cg::this_cluster();
    const int me = static_cast<int>(cluster.block_rank());
    layout_tiles<kThreads>(p, s, me, kBlocks);
    cluster.sync();  // every block's histograms are final and visible cluster-wide
    for (int i = me + threadIdx.x * kBlocks; i < num_bins; i += kBlocks * kThreads) {
        int v = 0;
#pragma unroll
        for (int r = 0; r < kBlocks; ++r) v += cluster.map_shared_rank(s.hist, r)[i];
        write_bin(p, i, v);
    }
    cluster.sync();  // no block leaves while others still read its shared memory
}
