// Low-latency combine (DeepEP V1 LL semantics; oracle: src/protocol/reference.rs ll_combine).
//
// fep_ll_combine_send (any grid, FEP_LL_THREADS threads): the expert rank sends row i of unit
//   (e, dst) of its dispatch result (layout_range: rows begin .. begin + count of x[e]) back to
//   rank dst's combine receive block g = rank * L + e, row i. Rows of all units are spread over
//   every warp of the grid (segments of 4 KiB). The last block publishes one flag per (dst, e),
//   zero counts included: (tag << 32) | count. With `self_pull` the units whose dst is this rank
//   are not copied (their flags are still published): the receive reads those rows from x.
// fep_ll_combine_recv (the hook; any grid): bounded wait for all E flags (each count checked
//   against this rank's own top-k), then per token t the weighted sum over its top-k in fp32,
//   k ascending, one fma per step (acc = fma(y, w, acc)), rounded once to bf16 (RNE). The same
//   sum whether a row is read from the receive block or (self_pull) from x: bit-identical. With
//   `wait_stats`, block 0 adds per answering rank the %globaltimer ns from the start of its wait
//   until each of that rank's flags was seen (DeepEP's combine_wait_recv_cost_stats).
// Proxy peers (fep_abi.h): rows for them are staged in this rank's send area (unit e * R + dst)
//   and pushed as one command per (peer, local expert); the receive waits on the packed counter
//   word of unit g (arrival and count in one read, fep_ll.cuh px_count) and checks the count
//   against its own top-k, as it does a flag's.
// Shrink mode (fep_abi.h shrink_mask; same-node peers): the send writes nothing to a masked
//   rank; the receive leaves a masked expert rank's rows out of every sum (as -1 entries of
//   topk_idx), and masks one whose wait runs out (fep_ll.cuh shrink_wait).
#include "fep_abi.h"
#include "fep_device.cuh"
#include "fep_ll.cuh"
#include "fep_trace.cuh"

extern "C" __global__ void __launch_bounds__(FEP_LL_THREADS, 2)
    fep_ll_combine_send(const fep_ll_combine_params p) {
    using namespace fep::ll;
    pdl_enter();  // before any read (fep_ll.cuh)
    // NOTES: dynamic shared memory = (2 * E + 1 + R) * 4, as the dispatch receive (same unit
    // order); the last R ints: this block's snapshot of the shrink mask (fep_ll.cuh NOTES).
    extern __shared__ __align__(16) unsigned char smem[];
    const int E = p.num_experts, R = p.num_ranks, L = E / R, M = p.max_tokens;
    const int H = p.hidden;
    const size_t S = static_cast<size_t>(R) * M;
    int32_t* s_cnt = reinterpret_cast<int32_t*>(smem);
    int32_t* s_start = s_cnt + E;
    int32_t* s_mask = s_start + E + 1;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int32_t* range = reinterpret_cast<const int32_t*>(p.layout_range);
    const fep_ll_peer* peers = reinterpret_cast<const fep_ll_peer*>(p.peers);
    const bool marker = blockIdx.x == 0 && tid == 0;  // the thread that marks trace points
    if (marker) fep::trace(FEP_TRACE_PHASE_STRIDE + FEP_TRACE_LL_SEND_BEGIN, p.rank, p.set);

    // s_cnt: rows this launch copies per unit (0 for the rank's own units under self_pull);
    // the flags carry unit_count (every row the unit holds).
    auto unit_count = [&](int u) {
        int c = range[2 * u + 1];
        if (c < 0 || c > M) {
            fep::report_error(p.dev_error, FEP_DEV_BAD_INPUT, p.rank, FEP_PHASE_LL_COMBINE_SEND,
                              u % R, static_cast<uint64_t>(M), static_cast<uint64_t>(c));
            c = 0;
        }
        return c;
    };
    for (int u = tid; u < E; u += kThreads) {
        s_cnt[u] = (p.self_pull != 0 && u % R == p.rank) ? 0 : unit_count(u);
    }
    for (int r = tid; r < R; r += kThreads) s_mask[r] = rank_masked(p.shrink_mask, r) ? 1 : 0;
    __syncthreads();
    block_exclusive_scan(s_cnt, s_start, E);

    if (p.proxy.ring != 0) {
        const fep::WaitCtx ctx{p.dev_error, p.budget_cycles, static_cast<uint32_t>(p.rank),
                               FEP_PHASE_LL_COMBINE_SEND, UINT32_MAX};
        if (!px_staging_free(p.proxy, p.set, E, ctx)) return;  // block-uniform; nothing published
        if (marker) fep::trace(FEP_TRACE_PHASE_STRIDE + FEP_TRACE_LL_SEND_STAGED, p.rank, p.set);
    }
    const int row_bytes = 2 * H;
    const int n16 = row_bytes / 16;
    const int segs = (row_bytes + kSegBytes - 1) / kSegBytes;
    const int total = s_start[E] * segs;
    for (int item = blockIdx.x * kWarps + warp; item < total; item += gridDim.x * kWarps) {
        const int n = item / segs, seg = item - n * segs;
        const int u = find_unit(s_start, E, n);
        const int i = n - s_start[u];
        const int e = u / R, dst = u % R;
        if (s_mask[dst]) continue;  // a masked destination gets no rows (s_cnt keeps them: the
                                    // item numbering is the same in every block)
        const size_t in_row = static_cast<size_t>(e) * S + range[2 * u] + i;
        const uint64_t out =
            (is_proxy(peers, dst) ? p.local_buf + unit_offset(p.set, 0, E, u, p.unit_bytes, p.proxy)
                                  : peers[dst].buf +
                                        unit_offset(p.set, 1, E, p.rank * L + e, p.unit_bytes, p.proxy)) +
            static_cast<uint64_t>(i) * p.record_bytes;
        copy_seg(reinterpret_cast<const uint4*>(p.x) + in_row * n16, reinterpret_cast<uint4*>(out),
                 n16, seg, lane);
    }

    if (!last_block_ticket(reinterpret_cast<uint32_t*>(p.workspace))) return;
    __shared__ uint64_t s_tag;
    uint64_t* epoch = reinterpret_cast<uint64_t*>(p.epoch) + p.set;
    if (tid == 0) s_tag = *epoch + 1;
    __syncthreads();
    if (p.proxy.ring != 0) {
        // One command per (proxy peer, local expert e): batch index proxy_index * L + e.
        const fep::WaitCtx ctx{p.dev_error, p.budget_cycles, static_cast<uint32_t>(p.rank),
                               FEP_PHASE_LL_COMBINE_SEND, UINT32_MAX};
        const uint32_t n = p.proxy.num_proxy_peers * static_cast<uint32_t>(L);
        const uint64_t head = px_reserve(p.proxy, n, ctx);
        if (head == UINT64_MAX) return;  // recorded; no flag published either
        for (int u = tid; u < E; u += kThreads) {
            const int e = u / R, dst = u % R;
            if (!is_proxy(peers, dst)) continue;
            const fep_cmd cmd = px_cmd(unit_offset(p.set, 0, E, u, p.unit_bytes, p.proxy),
                                       unit_offset(p.set, 1, E, p.rank * L + e, p.unit_bytes, p.proxy),
                                       static_cast<uint32_t>(s_cnt[u]), p.record_bytes, dst,
                                       px_slot(1, p.set, E, p.rank * L + e), p.proxy.value_bits);
            px_put(p.proxy, head + peers[dst].proxy * L + e, cmd);
        }
        px_publish(p.proxy, head, n, 1, p.set);
    }
    for (int u = tid; u < E; u += kThreads) {
        const int e = u / R, dst = u % R;
        if (is_proxy(peers, dst)) continue;
        if (rank_masked(p.shrink_mask, dst)) continue;  // read again: fep_ll.cuh NOTES (shrink)
        const int c = (p.self_pull != 0 && dst == p.rank) ? unit_count(u) : s_cnt[u];
        fep::st_release_sys(flag_ptr(peers[dst].flags, p.set, 1, E, p.rank * L + e),
                            flag_value(s_tag, static_cast<uint32_t>(c)));
    }
    if (tid == 0) {
        *epoch = s_tag;
        fep::trace(FEP_TRACE_PHASE_STRIDE + FEP_TRACE_LL_SEND_PUBLISHED, p.rank, p.set);
    }
}

extern "C" __global__ void __launch_bounds__(FEP_LL_THREADS, 2)
    fep_ll_combine_recv(const fep_ll_combine_params p) {
    using namespace fep::ll;
    pdl_enter();  // before any read (fep_ll.cuh)
    // NOTES: dynamic shared memory = K * 8 + K * 4 + E * 4 (rows and weights of the current
    // token, then this rank's count per expert).
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ int s_fail;
    const int T = p.num_tokens, K = p.num_topk, E = p.num_experts, R = p.num_ranks;
    const int L = E / R, H = p.hidden;
    uint64_t* s_row = reinterpret_cast<uint64_t*>(smem);
    float* s_w = reinterpret_cast<float*>(smem + static_cast<size_t>(K) * 8);
    int32_t* s_hist = reinterpret_cast<int32_t*>(s_w + K);
    const int tid = threadIdx.x;
    const int64_t* topk = reinterpret_cast<const int64_t*>(p.topk_idx);
    const float* weights = reinterpret_cast<const float*>(p.topk_weights);
    const int32_t* pos = reinterpret_cast<const int32_t*>(p.pos);

    const uint64_t tag = reinterpret_cast<const uint64_t*>(p.epoch)[p.set];
    const bool marker = blockIdx.x == 0 && tid == 0;
    if (marker) fep::trace(FEP_TRACE_PHASE_STRIDE + FEP_TRACE_LL_RECV_BEGIN, p.rank, p.set);
    if (tid == 0) s_fail = 0;
    if (p.proxy.ring != 0 && blockIdx.x == 0 && tid == kThreads - 1 && E < kThreads) {
        px_refresh_sends_seen(p.proxy, E);
    }
    for (int g = tid; g < E; g += kThreads) s_hist[g] = 0;
    __syncthreads();
    // NOTES: s_hist counts the rows this combine reads per expert. The owner of expert g sends
    // back every row this rank dispatched to g, so its count may exceed s_hist[g] when the
    // caller masks entries of topk_idx (-1) for the combine (DeepEP allows it): only fewer rows
    // than this combine reads is an error.
    for (int i = tid; i < T * K; i += kThreads) {
        const int64_t g = topk[i];
        if (g >= 0 && g < E) atomicAdd(&s_hist[g], 1);
    }
    __syncthreads();
    const fep_ll_peer* peers = reinterpret_cast<const fep_ll_peer*>(p.peers);
    // Every block waits for every flag; block 0's waits are the ones timed (one per expert).
    const bool timed = p.wait_stats != 0 && blockIdx.x == 0;
    const uint64_t wait_start = timed ? fep::globaltimer_ns() : 0;
    for (int g = tid; g < E; g += kThreads) {
        const fep::WaitCtx ctx{p.dev_error, p.budget_cycles, static_cast<uint32_t>(p.rank),
                               FEP_PHASE_LL_COMBINE_RECV, static_cast<uint32_t>(g / L)};
        const uint64_t* f = flag_ptr(p.local_flags, p.set, 1, E, g);
        if (p.shrink_mask != 0 && g / L != p.rank) {
            // Shrink mode: a masked expert rank (or one whose wait runs out) answers nothing;
            // its experts count as -1 entries (s_hist[g] = -1 tells the sum below).
            uint64_t v = 0;
            const int st = shrink_wait(f, flag_value(tag, 0), decide_ptr(p.shrink_decide, 1, p.set, E, g),
                                       tag, p.shrink_mask, g / L, ctx, &v);
            if (st == kShrinkFailed) {
                s_fail = 1;
            } else if (st == kShrinkMasked) {
                s_hist[g] = -1;
            } else if ((v >> 32) != (flag_value(tag, 0) >> 32) ||
                       (v & 0xffffffffull) < static_cast<uint64_t>(s_hist[g])) {
                fep::report_error(p.dev_error, FEP_DEV_BAD_COUNT, p.rank, FEP_PHASE_LL_COMBINE_RECV,
                                  g / L, flag_value(tag, s_hist[g]), v);
                s_fail = 1;
            }
        } else if (p.proxy.ring != 0 && is_proxy(peers, g / L)) {
            if (blockIdx.x != 0) continue;  // only block 0 polls the proxy's counters (handoff)
            uint64_t n = 0;
            if (!px_count(p.proxy, 1, p.set, px_slot(1, p.set, E, g), 4u * E, ctx, &n)) {
                s_fail = 1;
            } else if (n < static_cast<uint64_t>(s_hist[g])) {
                fep::report_error(p.dev_error, FEP_DEV_BAD_COUNT, p.rank, FEP_PHASE_LL_COMBINE_RECV,
                                  g / L, s_hist[g], n);
                s_fail = 1;
            }
        } else if (!fep::wait_geq(f, flag_value(tag, 0), ctx)) {
            s_fail = 1;
        } else {
            const uint64_t v = fep::ld_acquire_sys(f);
            if ((v >> 32) != (flag_value(tag, 0) >> 32) ||
                (v & 0xffffffffull) < static_cast<uint64_t>(s_hist[g])) {
                fep::report_error(p.dev_error, FEP_DEV_BAD_COUNT, p.rank, FEP_PHASE_LL_COMBINE_RECV,
                                  g / L, flag_value(tag, s_hist[g]), v);
                s_fail = 1;
            }
        }
        if (timed) {
            atomicAdd(reinterpret_cast<unsigned long long*>(p.wait_stats) + (g / L),
                      static_cast<unsigned long long>(fep::globaltimer_ns() - wait_start));
        }
    }
    if (p.proxy.ring != 0) {
        // Block 0 checked every proxy unit's count against s_hist; the others only wait for it.
        const fep::WaitCtx ctx{p.dev_error, p.budget_cycles, static_cast<uint32_t>(p.rank),
                               FEP_PHASE_LL_COMBINE_RECV, UINT32_MAX};
        px_counts_handoff(p.proxy, 1, p.set, E, ctx, &s_fail);
    }
    __syncthreads();
    if (s_fail) return;  // block-uniform
    if (marker) fep::trace(FEP_TRACE_PHASE_STRIDE + FEP_TRACE_LL_RECV_COUNTS, p.rank, p.set);

    const uint64_t base = p.local_buf;
    const bool sys = p.proxy.ring != 0;  // the buffer takes writes from outside the GPU (ld_recv)
    const int n8 = H / 8;  // one uint4 = 8 bf16 channels per thread and step
    const int32_t* range = reinterpret_cast<const int32_t*>(p.layout_range);
    const size_t S = static_cast<size_t>(R) * p.max_tokens;
    for (int t = blockIdx.x; t < T; t += gridDim.x) {
        for (int k = tid; k < K; k += kThreads) {
            const int64_t g = topk[t * K + k];
            uint64_t row = 0;
            if (g >= 0 && g < E && p.self_pull != 0 && g / L == p.rank) {
                // This rank's own expert e: the row is x[e][begin of unit (e, me) + pos]
                // (layout_range and pos from this rank's dispatch).
                const int e = static_cast<int>(g) % L;
                const int64_t at = static_cast<int64_t>(range[2 * (e * R + p.rank)]) + pos[t * K + k];
                if (at < 0 || at >= static_cast<int64_t>(S)) {
                    // A layout that does not come from this rank's dispatch: recorded, not read.
                    fep::report_error(p.dev_error, FEP_DEV_BAD_INPUT, p.rank,
                                      FEP_PHASE_LL_COMBINE_RECV, static_cast<uint32_t>(p.rank),
                                      static_cast<uint64_t>(S), static_cast<uint64_t>(at));
                } else {
                    row = p.x + (static_cast<size_t>(e) * S + static_cast<size_t>(at)) *
                                    static_cast<uint64_t>(2 * H);
                }
            } else if (g >= 0 && g < E && s_hist[g] >= 0) {  // s_hist < 0: masked (shrink)
                row = base + unit_offset(p.set, 1, E, static_cast<int>(g), p.unit_bytes, p.proxy) +
                      static_cast<uint64_t>(pos[t * K + k]) * p.record_bytes;
            }
            s_row[k] = row;
            s_w[k] = weights[t * K + k];
        }
        __syncthreads();
        uint4* out = reinterpret_cast<uint4*>(p.out) + static_cast<size_t>(t) * n8;
        for (int i = tid; i < n8; i += kThreads) {
            float acc[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[j] = 0.0f;
            for (int k0 = 0; k0 < K; k0 += 8) {
                uint4 v[8];
#pragma unroll
                for (int j = 0; j < 8; ++j) v[j] = make_uint4(0, 0, 0, 0);
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const int k = k0 + j;
                    if (k < K && s_row[k] != 0) v[j] = ld_recv(reinterpret_cast<const uint4*>(s_row[k]) + i, sys);
                }
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const int k = k0 + j;
                    if (k < K && s_row[k] != 0) {
                        const float w = s_w[k];
                        const uint32_t ws[4] = {v[j].x, v[j].y, v[j].z, v[j].w};
#pragma unroll
                        for (int c = 0; c < 4; ++c) {
                            acc[2 * c] = fmaf(bf16_lo(ws[c]), w, acc[2 * c]);
                            acc[2 * c + 1] = fmaf(bf16_hi(ws[c]), w, acc[2 * c + 1]);
                        }
                    }
                }
            }
            out[i] = make_uint4(pack_bf16x2(acc[0], acc[1]), pack_bf16x2(acc[2], acc[3]),
                                pack_bf16x2(acc[4], acc[5]), pack_bf16x2(acc[6], acc[7]));
        }
        __syncthreads();  // s_row / s_w are rewritten for the next token
    }
    if (marker) fep::trace(FEP_TRACE_PHASE_STRIDE + FEP_TRACE_LL_RECV_END, p.rank, p.set);
}
