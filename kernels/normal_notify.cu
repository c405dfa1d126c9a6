// Normal-mode notify: one block per peer rank b (peer stores, or the proxy for b on another node).
//   1. the send plan towards b: tokens with is_token_in_rank[t][b], in token order
//      (send_token_ids[b][*], send_pos[t][b], send_counts[b]) by a block-wide scan;
//   2. this rank's notify record for b (token count, counts per b-local expert) into b's buffer,
//      after b has acknowledged the previous epoch, published with flag = epoch;
//   3. b's record for this rank, read after its flag reached epoch, kept in local state, and
//      acknowledged in b's buffer;
//   4. the last block: rank_prefix, per-local-expert counts (aligned), capacity check.
// NOTES: one notify slot per pair suffices because a sender waits for the receiver's ack of the
// previous epoch before it overwrites the record; epochs are the host's count of fresh
// dispatches, equal on every rank.
#include "fep_abi.h"
#include "fep_device.cuh"
#include "fep_normal.cuh"

namespace {

constexpr int kNotifyThreads = FEP_NORMAL_NOTIFY_THREADS;
constexpr int kNotifyWarps = kNotifyThreads / 32;

// Exclusive scan of one flag per thread over the block; returns this thread's offset and writes
// the block total into *total. Uses `warp_sums[kNotifyWarps]` of shared memory.
__device__ __forceinline__ int notify_block_scan(bool flag, int* warp_sums, int* total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const unsigned ballot = __ballot_sync(0xffffffffu, flag);
    const int in_warp = __popc(ballot & ((1u << lane) - 1u));
    if (lane == 0) warp_sums[warp] = __popc(ballot);
    __syncthreads();
    if (warp == 0) {
        const int v = lane < kNotifyWarps ? warp_sums[lane] : 0;
        int incl = v;
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
            const int o = __shfl_up_sync(0xffffffffu, incl, d);
            if (lane >= d) incl += o;
        }
        if (lane < kNotifyWarps) warp_sums[lane] = incl - v;
        if (lane == 31) warp_sums[kNotifyWarps] = incl;
    }
    __syncthreads();
    const int off = warp_sums[warp] + in_warp;
    *total = warp_sums[kNotifyWarps];
    __syncthreads();  // warp_sums reused by the next call
    return off;
}

}  // namespace

extern "C" __global__ void __launch_bounds__(FEP_NORMAL_NOTIFY_THREADS)
    fep_normal_notify(const fep_normal_notify_params p) {
    const fep::normal::Comm comm{p.comm};
    const int me = static_cast<int>(p.comm.rank);
    const int num_ranks = static_cast<int>(p.comm.num_ranks);
    const int b = blockIdx.x;  // the peer this block serves
    const int num_tokens = p.handle.num_tokens;
    const int L = static_cast<int>(p.comm.num_local_experts);
    __shared__ int warp_sums[kNotifyWarps + 1];
    __shared__ bool ok;
    if (threadIdx.x == 0) ok = !fep::error_raised(p.comm.dev_error);

    // 1. Send plan towards b.
    const uint8_t* in_rank = reinterpret_cast<const uint8_t*>(p.is_token_in_rank);
    int32_t* send_ids = reinterpret_cast<int32_t*>(p.handle.send_token_ids) +
                        static_cast<int64_t>(b) * num_tokens;
    int32_t* send_pos = reinterpret_cast<int32_t*>(p.handle.send_pos);
    int count = 0;
    for (int t0 = 0; t0 < num_tokens; t0 += kNotifyThreads) {
        const int t = t0 + threadIdx.x;
        const bool hit = t < num_tokens && in_rank[static_cast<int64_t>(t) * num_ranks + b] != 0;
        int tile_total;
        const int off = notify_block_scan(hit, warp_sums, &tile_total);
        if (t < num_tokens) {
            send_pos[static_cast<int64_t>(t) * num_ranks + b] = hit ? count + off : -1;
            if (hit) send_ids[count + off] = t;
        }
        count += tile_total;
    }
    if (threadIdx.x == 0) reinterpret_cast<int32_t*>(p.handle.send_counts)[b] = count;

    // 2. Our record for b. Peer store: once b has acknowledged the previous one. Proxy (b on
    // another node): staged in the send region's two-deep notify area (the host backend's wire
    // form [seq, tokens, per-expert]) and written with one command; no ack is needed, because b
    // writes record slot seq % 2 again only at seq + 2, after this rank's notify seq + 1, which
    // starts after this block has read record seq (stream order).
    const bool px = comm.via_proxy(b);
    const uint64_t seq = p.epoch - 1;
    fep::normal::Pusher pusher{};
    if (threadIdx.x == 0 && px) pusher = fep::normal::Pusher::open(comm, blockIdx.x);
    if (threadIdx.x == 0 && ok && !px) {
        ok = fep::wait_geq(comm.ack_ptr(me, b), p.epoch - 1,
                           comm.wait_ctx(FEP_NORMAL_PHASE_NOTIFY, b));
    }
    __syncthreads();
    const int32_t* per_expert_in = reinterpret_cast<const int32_t*>(p.num_tokens_per_expert);
    if (px) {
        uint32_t* words = reinterpret_cast<uint32_t*>(comm.px_send(comm.px_notify_off(b, seq)));
        if (ok) {
            for (int e = threadIdx.x; e < L; e += kNotifyThreads) words[2 + e] = per_expert_in[b * L + e];
            if (threadIdx.x == 0) {
                words[0] = static_cast<uint32_t>(seq);
                words[1] = static_cast<uint32_t>(count);
            }
        }
        __threadfence_system();
        __syncthreads();
        if (threadIdx.x == 0 && ok) {
            const uint32_t mask = (1u << p.comm.proxy.value_bits) - 1u;
            ok = pusher.push(static_cast<uint32_t>(b), comm.px_notify_off(b, seq),
                             comm.px_notify_off(me, seq), p.comm.proxy.notify_bytes,
                             comm.px_imm(comm.px_notify_id(me), static_cast<uint32_t>(seq) & mask),
                             comm.wait_ctx(FEP_NORMAL_PHASE_NOTIFY, b));
        }
    } else {
        uint8_t* out_rec = comm.notify_ptr(b, me);
        if (ok) {
            uint32_t* words = reinterpret_cast<uint32_t*>(out_rec + 16);
            for (int e = threadIdx.x; e < L; e += kNotifyThreads) words[e] = per_expert_in[b * L + e];
            if (threadIdx.x == 0) reinterpret_cast<uint32_t*>(out_rec + 8)[0] = count;
        }
        __syncthreads();
        if (threadIdx.x == 0 && ok)
            fep::st_release_sys(reinterpret_cast<uint64_t*>(out_rec), p.epoch);
    }

    // 3. b's record for us.
    if (px) {
        const uint8_t* in_rec = comm.px_recv(comm.px_notify_off(b, seq));
        if (threadIdx.x == 0 && ok) {
            ok = fep::wait_geq(comm.px_arrivals(comm.px_notify_id(b)), p.epoch,
                               comm.wait_ctx(FEP_NORMAL_PHASE_NOTIFY, b));
            if (ok) {
                const uint32_t seen = __ldcv(reinterpret_cast<const uint32_t*>(in_rec));
                if (seen != static_cast<uint32_t>(seq)) {
                    fep::report_error(p.comm.dev_error, FEP_DEV_BAD_COUNT, me,
                                      FEP_NORMAL_PHASE_NOTIFY, b, seq, seen);
                    ok = false;
                }
            }
        }
        __syncthreads();
        if (ok) {
            const uint32_t* words = reinterpret_cast<const uint32_t*>(in_rec);
            uint32_t* keep = comm.notify_experts(b);
            for (int e = threadIdx.x; e < L; e += kNotifyThreads) keep[e] = __ldcv(words + 2 + e);
            if (threadIdx.x == 0) comm.notify_tokens()[b] = __ldcv(words + 1);
        }
        __syncthreads();
    } else {
        const uint8_t* in_rec = comm.notify_ptr(me, b);
        if (threadIdx.x == 0 && ok) {
            ok = fep::wait_geq(reinterpret_cast<const uint64_t*>(in_rec), p.epoch,
                               comm.wait_ctx(FEP_NORMAL_PHASE_NOTIFY, b));
            if (ok) {
                const uint64_t seen =
                    fep::ld_acquire_sys(reinterpret_cast<const uint64_t*>(in_rec));
                if (seen != p.epoch) {
                    fep::report_error(p.comm.dev_error, FEP_DEV_BAD_COUNT, me,
                                      FEP_NORMAL_PHASE_NOTIFY, b, p.epoch, seen);
                    ok = false;
                }
            }
        }
        __syncthreads();
        if (ok) {
            const uint32_t* words = reinterpret_cast<const uint32_t*>(in_rec + 16);
            uint32_t* keep = comm.notify_experts(b);
            for (int e = threadIdx.x; e < L; e += kNotifyThreads) keep[e] = __ldcg(words + e);
            if (threadIdx.x == 0)
                comm.notify_tokens()[b] = __ldcg(reinterpret_cast<const uint32_t*>(in_rec + 8));
        }
        __syncthreads();
        if (threadIdx.x == 0 && ok) fep::st_release_sys(comm.ack_ptr(b, me), p.epoch);
    }

    // 4. Totals, in the last block.
    if (!fep::normal::last_block(comm.ticket(0))) return;
    // One read of the error word for the whole block (the barriers below need every thread).
    __shared__ int s_failed;
    if (threadIdx.x == 0) s_failed = fep::error_raised(p.comm.dev_error) ? 1 : 0;
    __syncthreads();
    if (s_failed) return;
    int32_t* prefix = reinterpret_cast<int32_t*>(p.handle.rank_prefix);
    if (threadIdx.x == 0) {
        uint64_t total = 0;
        prefix[0] = 0;
        for (int s = 0; s < num_ranks; ++s) {
            const uint32_t n = comm.notify_tokens()[s];
            total += n;
            prefix[s + 1] = static_cast<int32_t>(total > 0x7fffffffull ? 0x7fffffff : total);
        }
        if (total > static_cast<uint64_t>(p.out_capacity)) {
            fep::report_error(p.comm.dev_error, FEP_DEV_BAD_COUNT, me, FEP_NORMAL_PHASE_NOTIFY,
                              UINT32_MAX, static_cast<uint64_t>(p.out_capacity), total);
        }
    }
    int32_t* per_expert = reinterpret_cast<int32_t*>(p.handle.recv_expert_counts);
    const int align = p.expert_alignment > 0 ? p.expert_alignment : 1;
    for (int e = threadIdx.x; e < L; e += kNotifyThreads) {
        int64_t c = 0;
        for (int s = 0; s < num_ranks; ++s) c += comm.notify_experts(s)[e];
        c = (c + align - 1) / align * align;
        per_expert[e] = static_cast<int32_t>(c > 0x7fffffff ? 0x7fffffff : c);
        if (p.host_counts != 0) {
            reinterpret_cast<int32_t*>(p.host_counts + 8)[num_ranks + 1 + e] = per_expert[e];
        }
    }
    // The host's copy: the same totals in mapped memory, then the epoch after a system fence,
    // so a host that reads the epoch reads the totals of this notify (fep_abi.h host_counts).
    if (p.host_counts != 0) {
        if (threadIdx.x == 0) {
            int32_t* hp = reinterpret_cast<int32_t*>(p.host_counts + 8);
            for (int s = 0; s <= num_ranks; ++s) hp[s] = prefix[s];
        }
        __threadfence_system();
        __syncthreads();
        if (threadIdx.x == 0) {
            __threadfence_system();
            fep::st_release_sys(reinterpret_cast<uint64_t*>(p.host_counts), p.epoch);
        }
    }
}
