// fep_tma.cuh: rows moved through shared memory by the Hopper bulk-copy engine (TMA, 1-D bulk
// copies): global -> shared with an mbarrier counting the bytes, then shared -> global as a
// bulk group. One thread issues; the data never passes through registers.
//
// NOTES: why. A warp that copies a row through registers holds at most its registers' worth in
// flight (a 7168-byte fp8 row at 14 vectors a lane with 128 registers, 16 warps a block) and
// waits a whole memory round trip per row before its stores go out: the dispatch ran at two
// thirds of a plain copy kernel with the same SMs, stalled on loads (Nsight Compute: long
// scoreboard most of each issued instruction's cycles). Through shared memory a block keeps
// its whole ring of rows in flight (some 200 KB on an H100/H200) while the stores of the rows
// that landed drain, and the remaining warps do the rows' small fields meanwhile.
//
// Requirements (checked by the callers' choice of path): sm_90, every source and destination
// row 16-byte aligned with a length a multiple of 16, rows not overlapping.
#pragma once

#include <stdint.h>

namespace fep::tma {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ uint32_t dynamic_smem_bytes() {
    uint32_t v;
    asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(v));
    return v;
}

__device__ __forceinline__ void bar_init(uint64_t* bar) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(bar)) : "memory");
}

// The inits visible to the bulk-copy engine (the async proxy) before its first complete_tx.
__device__ __forceinline__ void bar_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

__device__ __forceinline__ void bar_expect(uint64_t* bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)),
                 "r"(bytes)
                 : "memory");
}

__device__ __forceinline__ bool bar_try_wait(uint64_t* bar, uint32_t parity) {
    uint32_t done;
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n"
        "}\n"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(parity)
        : "memory");
    return done != 0;
}

// A local bulk load completes or faults (a bad address ends the context): no timeout needed.
__device__ __forceinline__ void bar_wait(uint64_t* bar, uint32_t parity) {
    while (!bar_try_wait(bar, parity)) {
    }
}

__device__ __forceinline__ void load(void* smem, const void* gmem, uint32_t bytes, uint64_t* bar) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
            "r"(smem_addr(smem)),
        "l"(gmem), "r"(bytes), "r"(smem_addr(bar))
        : "memory");
}

__device__ __forceinline__ void store(void* gmem, const void* smem, uint32_t bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(gmem),
                 "r"(smem_addr(smem)), "r"(bytes)
                 : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

// At most N of this thread's bulk stores still reading shared memory.
template <int N>
__device__ __forceinline__ void wait_reads() {
    asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}

// Every bulk store of this thread complete (its writes performed).
__device__ __forceinline__ void wait_writes() {
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

// One mover's share of the dynamic shared memory: `stages` slots of `stage` bytes (128-byte
// aligned) with an mbarrier each.
struct Ring {
    uint64_t* bars;
    uint8_t* data;
    uint32_t stage;
    uint32_t stages;
};

constexpr uint32_t kMaxStages = 64;
// Stores in flight (still reading their slot) before a slot is reloaded.
constexpr int kStoresInFlight = 2;

// Mover `m` of `movers`' ring in the block's dynamic shared memory, for rows of `row_bytes`
// (a row of more than 16 KiB moves in pieces). `stages` < 4: too little memory for a pipeline
// (the caller keeps its register path).
__device__ __forceinline__ uint32_t pitch(const Ring& r) { return (r.stage + 127u) & ~127u; }

__device__ __forceinline__ Ring ring(uint32_t m, uint32_t movers, uint32_t row_bytes) {
    extern __shared__ __align__(128) uint8_t fep_dyn_smem[];
    const uint32_t share = (dynamic_smem_bytes() / movers) & ~127u;
    Ring r;
    r.stage = min(row_bytes, 16384u);  // bytes per piece
    const uint32_t head = kMaxStages * 8;
    r.stages = share > head ? min(kMaxStages, (share - head) / pitch(r)) : 0;
    uint8_t* base = fep_dyn_smem + static_cast<size_t>(m) * share;
    r.bars = reinterpret_cast<uint64_t*>(base);
    r.data = base + head;
    return r;
}

// Its mbarriers initialised, once per kernel, by the warp that owns the ring.
__device__ __forceinline__ void ring_init(const Ring& r, int lane) {
    if (lane == 0) {
        for (uint32_t s = 0; s < r.stages; ++s) bar_init(r.bars + s);
        bar_init_fence();
    }
    __syncwarp();
}

// Orders this thread's generic-proxy accesses (a flag or credit it acquired, after a barrier)
// with its bulk copies, both ways.
__device__ __forceinline__ void proxy_fence() { asm volatile("fence.proxy.async;" ::: "memory"); }

// One warp moves `n` rows of `bytes`: row i from `src + (ids ? ids[i] : i) * src_stride` to
// `dst + i * dst_stride`. Lane 0 issues every copy; the other lanes fetch the ids 32 rows at a
// time, a batch ahead. `used`: pieces this ring has moved so far in the kernel (each slot's
// mbarrier phase follows from it); returns it advanced by this call's. Returns once every
// write is performed (and fenced: ordered before the caller's later generic-proxy stores,
// e.g. a flag).
__device__ __forceinline__ uint32_t warp_move_rows(const Ring r, uint32_t used, uint32_t n,
                                                   const int32_t* ids, const uint8_t* src,
                                                   uint64_t src_stride, uint8_t* dst,
                                                   uint64_t dst_stride, uint32_t bytes, int lane) {
    if (n == 0) return used;
    const uint32_t P = (bytes + r.stage - 1) / r.stage;
    const uint32_t total = n * P;  // callers keep n * P within 32 bits
    const uint32_t S = r.stages;
    const uint32_t pt = pitch(r);
    if (lane == 0) proxy_fence();
    // The ids of the rows [32 b, 32 b + 32) the loads are in, and of the next batch.
    int32_t cur = 0, nxt = 0;
    uint32_t cur_b = 0;
    if (ids != nullptr) {
        cur = static_cast<uint32_t>(lane) < n ? __ldg(ids + lane) : 0;
        nxt = 32u + lane < n ? __ldg(ids + 32 + lane) : 0;
    }
    // Load side: piece q is (lrow, lpart) into slot ls; store side: piece c is (srow, spart)
    // from slot ss of phase sph.
    uint32_t q = 0, c = 0;
    uint32_t lrow = 0, lpart = 0, ls = used % S;
    uint32_t srow = 0, spart = 0, ss = ls, sph = (used / S) & 1u;
    auto issue_load = [&]() {
        if (ids != nullptr && (lrow >> 5) != cur_b) {
            cur = nxt;
            ++cur_b;
            const uint32_t k = (cur_b + 1) * 32u + lane;
            nxt = k < n ? __ldg(ids + k) : 0;
        }
        const int64_t row = ids != nullptr ? __shfl_sync(0xffffffffu, cur, lrow & 31u) : lrow;
        const uint32_t off = lpart * r.stage;
        const uint32_t len = min(r.stage, bytes - off);
        if (lane == 0) {
            bar_expect(r.bars + ls, len);
            load(r.data + static_cast<size_t>(ls) * pt, src + row * src_stride + off, len,
                 r.bars + ls);
        }
        if (++lpart == P) {
            lpart = 0;
            ++lrow;
        }
        if (++ls == S) ls = 0;
        ++q;
    };
    while (q < total && q < S) issue_load();
    while (c < total) {
        if (lane == 0) {
            bar_wait(r.bars + ss, sph);
            const uint32_t off = spart * r.stage;
            store(dst + static_cast<uint64_t>(srow) * dst_stride + off,
                  r.data + static_cast<size_t>(ss) * pt, min(r.stage, bytes - off));
            wait_reads<kStoresInFlight>();
        }
        __syncwarp();
        if (++spart == P) {
            spart = 0;
            ++srow;
        }
        if (++ss == S) {
            ss = 0;
            sph ^= 1u;
        }
        ++c;
        // A slot is free once its previous piece's store has read it: every store but the
        // last kStoresInFlight has.
        while (q < total && q + kStoresInFlight < c + S) issue_load();
    }
    if (lane == 0) {
        wait_writes();
        proxy_fence();
    }
    __syncwarp();
    return used + total;
}

}  // namespace fep::tma
