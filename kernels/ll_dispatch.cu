// Low-latency dispatch (DeepEP V1 LL semantics; oracle: src/protocol/reference.rs ll_dispatch).
//
// fep_ll_dispatch_send (any grid, FEP_LL_THREADS threads): blocks stride over tokens. Per token:
//   the K destination rows, `pos[t][k]` = the number of earlier tokens that chose the same expert
//   (deterministic, no atomics), then the row is read once, cast to e4m3 once (or kept bf16) and
//   stored straight into each destination's receive block [e][this rank] through the peer
//   pointer. The last block to finish publishes one flag per (destination, local expert), the
//   zero-count ones included, with a release store: (tag << 32) | count.
// fep_ll_dispatch_recv (the hook; any grid): blocks stride over units (e, src). Bounded wait for
//   the flags of sources 0..src of expert e, prefix of their counts = begin, then the rows are
//   copied into the packed output at [e][begin + i] with their source info; unit (e, R-1) writes
//   recv_count[e]. Rows past recv_count are not written (DeepEP: undefined). With `wait_stats`,
//   block 0 adds per source the %globaltimer ns from the start of its wait until each of the
//   source's flags was seen (DeepEP's dispatch_wait_recv_cost_stats).
// Proxy peers (FEP_LL_TRANSPORT_PROXY, another node; fep_abi.h): the send stages their rows in
//   this rank's send area (unit g) and its last block pushes one command per (peer, local expert)
//   with the count in the immediate; instead of the unit's flag, the receive's leader polls the
//   unit's packed counter word (arrival and count in one read, fep_ll.cuh px_count). Rows land
//   in the same receive unit either way, so the copy is shared.
// Shrink mode (fep_abi.h shrink_mask; same-node peers): no rows or flag go to a masked rank; the
//   receive counts a masked source as empty, and masks one whose wait runs out (fep_ll.cuh
//   shrink_wait: one decision per unit for every block).
#include "fep_abi.h"
#include "fep_device.cuh"
#include "fep_ll.cuh"
#include "fep_trace.cuh"


extern "C" __global__ void __launch_bounds__(FEP_LL_THREADS, 2)
    fep_ll_dispatch_send(const fep_ll_dispatch_params p) {
    using namespace fep::ll;
    pdl_enter();  // before any read (fep_ll.cuh)
    // NOTES: dynamic shared memory = tail (record_bytes - scales_offset, a multiple of 16) +
    // K * 8 (destination rows) + (T * K + E + R) * 4; src/ep/ll_gpu.rs send_smem sizes it the
    // same. The last R ints: this block's snapshot of the shrink mask (fep_ll.cuh NOTES).
    // NOTES (whole lines): records are 128-byte aligned (plan/base.rs LL_DISPATCH_RECORD_ALIGN) and
    // every store below writes whole lines: each warp 512 payload bytes, and one warp per
    // destination the record's tail (scales, source index, zero padding) from shared memory,
    // 16 bytes per lane (no lone 4-byte scale stores). Measured: ~1 us less per dispatch on the
    // H200; the proxy lane's staging into host memory was not faster (src/protocol/plan/base.rs
    // LL_DISPATCH_RECORD_ALIGN).
    extern __shared__ __align__(16) unsigned char smem[];
    const int T = p.num_tokens, K = p.num_topk, E = p.num_experts, R = p.num_ranks;
    const int L = E / R;
    const int H = p.hidden;
    const int TK = T * K;
    const int tail16 = static_cast<int>((p.record_bytes - p.scales_offset) / 16);
    uint4* s_tail = reinterpret_cast<uint4*>(smem);
    unsigned char* smem_rest = smem + static_cast<size_t>(tail16) * 16;
    uint64_t* s_dst = reinterpret_cast<uint64_t*>(smem_rest);
    int32_t* s_topk = reinterpret_cast<int32_t*>(smem_rest + static_cast<size_t>(K) * 8);
    int32_t* s_count = s_topk + TK;
    int32_t* s_mask = s_count + E;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const bool marker = blockIdx.x == 0 && tid == 0;  // the thread that marks trace points
    if (marker) fep::trace(FEP_TRACE_LL_SEND_BEGIN, p.rank, p.set);

    const int64_t* topk = reinterpret_cast<const int64_t*>(p.topk_idx);
    for (int i = tid; i < TK; i += kThreads) {
        int64_t g = topk[i];
        if (g < -1 || g >= E) {
            fep::report_error(p.dev_error, FEP_DEV_BAD_INPUT, p.rank, FEP_PHASE_LL_DISPATCH_SEND,
                              UINT32_MAX, static_cast<uint64_t>(E), static_cast<uint64_t>(g));
            g = -1;
        }
        s_topk[i] = static_cast<int32_t>(g);
    }
    // The tail's padding stays zero; scales and the source index are rewritten per token.
    for (int j = tid; j < tail16; j += kThreads) s_tail[j] = make_uint4(0, 0, 0, 0);
    for (int r = tid; r < R; r += kThreads) s_mask[r] = rank_masked(p.shrink_mask, r) ? 1 : 0;
    __syncthreads();

    const fep_ll_peer* peers = reinterpret_cast<const fep_ll_peer*>(p.peers);
    int32_t* pos_out = reinterpret_cast<int32_t*>(p.pos);
    if (p.proxy.ring != 0) {
        const fep::WaitCtx ctx{p.dev_error, p.budget_cycles, static_cast<uint32_t>(p.rank),
                               FEP_PHASE_LL_DISPATCH_SEND, UINT32_MAX};
        if (!px_staging_free(p.proxy, p.set, E, ctx)) return;  // block-uniform; nothing published
        if (marker) fep::trace(FEP_TRACE_LL_SEND_STAGED, p.rank, p.set);
    }
    const int n_items = H / 16;  // 16 channels per thread and step (H % 128 == 0 for fp8, % 16 else)
    for (int t = blockIdx.x; t < T; t += gridDim.x) {
        for (int k = warp; k < K; k += kWarps) {
            const int g = s_topk[t * K + k];
            int c = 0;
            if (g >= 0) {
                for (int j = lane; j < t * K; j += 32) c += (s_topk[j] == g);
            }
            c = warp_sum(c);
            if (lane == 0) {
                uint64_t addr = 0;
                if (g >= 0 && !s_mask[g / L]) {  // a masked destination gets no rows
                    const int dst = g / L, e = g % L;
                    addr = is_proxy(peers, dst)
                               ? p.local_buf + unit_offset(p.set, 0, E, g, p.unit_bytes, p.proxy)
                               : peers[dst].buf +
                                     unit_offset(p.set, 1, E, e * R + p.rank, p.unit_bytes, p.proxy);
                    addr += static_cast<uint64_t>(c) * p.record_bytes;
                }
                s_dst[k] = addr;
                pos_out[t * K + k] = g >= 0 ? c : -1;
            }
        }
        __syncthreads();

        const uint4* xrow = reinterpret_cast<const uint4*>(p.x) + static_cast<size_t>(t) * (H / 8);
        for (int base = warp * 32; base < n_items; base += kThreads) {
            const int i = base + lane;
            const bool valid = i < n_items;
            if (!p.use_fp8) {
                // bf16: the warp's 32 items are 64 uint4; lane l moves uint4 l and l + 32 of
                // them, so each store instruction writes 512 contiguous bytes. NOTES: lane l
                // storing its item's two uint4 (2l, 2l + 1) left every instruction half its span
                // in holes: into mapped host memory (the proxy's staging) that cost 9x (H200,
                // traced: 1.4 ms to stage 7 MB, fp8's 3.6 MB took 157 us).
                const int nu = H / 8;
                const int u0 = 2 * base + lane, u1 = u0 + 32;
                const uint4 z = make_uint4(0, 0, 0, 0);
                const uint4 c0 = u0 < nu ? __ldg(xrow + u0) : z;
                const uint4 c1 = u1 < nu ? __ldg(xrow + u1) : z;
                for (int k = 0; k < K; ++k) {
                    const uint64_t d = s_dst[k];
                    if (d == 0) continue;
                    if (u0 < nu) reinterpret_cast<uint4*>(d)[u0] = c0;
                    if (u1 < nu) reinterpret_cast<uint4*>(d)[u1] = c1;
                }
                continue;
            }
            uint4 a = make_uint4(0, 0, 0, 0), b = make_uint4(0, 0, 0, 0);
            if (valid) {
                a = __ldg(xrow + 2 * i);
                b = __ldg(xrow + 2 * i + 1);
            }
            {  // fp8: lane l casts channels 16l .. 16l + 15 (8 lanes = one 128-channel group)
                const uint32_t w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
                float f[16];
                float amax = 0.0f;
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    f[2 * j] = bf16_lo(w[j]);
                    f[2 * j + 1] = bf16_hi(w[j]);
                    amax = fmaxf(amax, fmaxf(fabsf(f[2 * j]), fabsf(f[2 * j + 1])));
                }
                // 8 lanes = 128 channels = one scale group (groups never straddle a warp).
#pragma unroll
                for (int o = 1; o < 8; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
                float scale;
                const float mult = fp8_group_scale(amax, p.round_scale != 0, &scale);
                uint32_t q[4];
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    q[j] = fp8x2(f[4 * j] * mult, f[4 * j + 1] * mult) |
                           (fp8x2(f[4 * j + 2] * mult, f[4 * j + 3] * mult) << 16);
                }
                const uint4 qv = make_uint4(q[0], q[1], q[2], q[3]);
                if (valid) {
                    if ((lane & 7) == 0) reinterpret_cast<float*>(s_tail)[i >> 3] = scale;
                    for (int k = 0; k < K; ++k) {
                        const uint64_t d = s_dst[k];
                        if (d == 0) continue;
                        reinterpret_cast<uint4*>(d)[i] = qv;
                    }
                }
            }
        }
        if (tid == 0) {
            reinterpret_cast<int32_t*>(reinterpret_cast<unsigned char*>(s_tail) +
                                       (p.src_idx_offset - p.scales_offset))[0] = t;
        }
        __syncthreads();  // the tail is complete
        for (int k = warp; k < K; k += kWarps) {
            const uint64_t d = s_dst[k];
            if (d == 0) continue;
            uint4* dt = reinterpret_cast<uint4*>(d + p.scales_offset);
            for (int j = lane; j < tail16; j += 32) dt[j] = s_tail[j];
        }
        __syncthreads();  // s_dst and the tail are rewritten for the next token
    }

    if (!last_block_ticket(reinterpret_cast<uint32_t*>(p.workspace))) return;

    for (int g = tid; g < E; g += kThreads) s_count[g] = 0;
    __syncthreads();
    for (int i = tid; i < TK; i += kThreads) {
        if (s_topk[i] >= 0) atomicAdd(&s_count[s_topk[i]], 1);
    }
    __shared__ uint64_t s_tag;
    uint64_t* epoch = reinterpret_cast<uint64_t*>(p.epoch) + p.set;
    if (tid == 0) s_tag = *epoch + 1;
    __syncthreads();
    if (p.proxy.ring != 0) {
        // One command per (proxy peer, its local expert): batch index proxy_index * L + e.
        const fep::WaitCtx ctx{p.dev_error, p.budget_cycles, static_cast<uint32_t>(p.rank),
                               FEP_PHASE_LL_DISPATCH_SEND, UINT32_MAX};
        const uint32_t n = p.proxy.num_proxy_peers * static_cast<uint32_t>(L);
        const uint64_t head = px_reserve(p.proxy, n, ctx);
        if (head == UINT64_MAX) return;  // recorded; no flag published either
        for (int g = tid; g < E; g += kThreads) {
            const int dst = g / L, e = g % L;
            if (!is_proxy(peers, dst)) continue;
            const fep_cmd cmd = px_cmd(unit_offset(p.set, 0, E, g, p.unit_bytes, p.proxy),
                                       unit_offset(p.set, 1, E, e * R + p.rank, p.unit_bytes, p.proxy),
                                       static_cast<uint32_t>(s_count[g]), p.record_bytes, dst,
                                       px_slot(0, p.set, E, e * R + p.rank), p.proxy.value_bits);
            px_put(p.proxy, head + peers[dst].proxy * L + e, cmd);
        }
        px_publish(p.proxy, head, n, 0, p.set);
    }
    for (int g = tid; g < E; g += kThreads) {
        const int dst = g / L, e = g % L;
        if (is_proxy(peers, dst)) continue;
        if (rank_masked(p.shrink_mask, dst)) continue;  // read again: fep_ll.cuh NOTES (shrink)
        fep::st_release_sys(flag_ptr(peers[dst].flags, p.set, 0, E, e * R + p.rank),
                            flag_value(s_tag, static_cast<uint32_t>(s_count[g])));
    }
    if (tid == 0) {
        *epoch = s_tag;  // the receive (same stream, next) expects this tag
        fep::trace(FEP_TRACE_LL_SEND_PUBLISHED, p.rank, p.set);
    }
}

extern "C" __global__ void __launch_bounds__(FEP_LL_THREADS, 2)
    fep_ll_dispatch_recv(const fep_ll_dispatch_params p) {
    using namespace fep::ll;
    pdl_enter();  // before any read (fep_ll.cuh)
    // NOTES: dynamic shared memory = (2 * E + 1) * 4: counts and their prefix over units
    // u = e * R + src, which is exactly the packed output order (expert-major, then source).
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ int s_fail;
    const int E = p.num_experts, R = p.num_ranks, M = p.max_tokens;
    const int H = p.hidden;
    const size_t S = static_cast<size_t>(R) * M;
    int32_t* s_cnt = reinterpret_cast<int32_t*>(smem);
    int32_t* s_start = s_cnt + E;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

    // Written by this rank's send (earlier on the same stream).
    const uint64_t tag = reinterpret_cast<const uint64_t*>(p.epoch)[p.set];
    const bool marker = blockIdx.x == 0 && tid == 0;
    if (marker) fep::trace(FEP_TRACE_LL_RECV_BEGIN, p.rank, p.set);
    if (tid == 0) s_fail = 0;
    if (p.proxy.ring != 0 && blockIdx.x == 0 && tid == kThreads - 1 && E < kThreads) {
        px_refresh_sends_seen(p.proxy, E);
    }
    __syncthreads();
    // Every block waits for all E flags (one thread each, in parallel): it needs every count for
    // the prefix. The flag of unit (e, src) comes from rank src. Proxy units: only block 0 polls
    // the proxy's counters (host memory); the others take the counts from it (px_counts_handoff).
    const fep_ll_peer* peers = reinterpret_cast<const fep_ll_peer*>(p.peers);
    // Every block waits for every flag; block 0's waits are the ones timed (one per unit).
    const bool timed = p.wait_stats != 0 && blockIdx.x == 0;
    const uint64_t wait_start = timed ? fep::globaltimer_ns() : 0;
    for (int u = tid; u < E; u += kThreads) {
        const fep::WaitCtx ctx{p.dev_error, p.budget_cycles, static_cast<uint32_t>(p.rank),
                               FEP_PHASE_LL_DISPATCH_RECV, static_cast<uint32_t>(u % R)};
        const uint64_t* f = flag_ptr(p.local_flags, p.set, 0, E, u);
        int c = 0;
        if (p.shrink_mask != 0 && u % R != p.rank) {
            // Shrink mode (IPC peers only: the host refuses it with proxy peers): a masked
            // source, or one whose wait runs out, counts as empty.
            uint64_t v = 0;
            const int st = shrink_wait(f, flag_value(tag, 0), decide_ptr(p.shrink_decide, 0, p.set, E, u),
                                       tag, p.shrink_mask, u % R, ctx, &v);
            if (st == kShrinkFailed) {
                s_fail = 1;
            } else if (st == kShrinkArrived) {
                c = static_cast<int>(v & 0xffffffffu);
                if ((v >> 32) != tag || c > M) {
                    fep::report_error(p.dev_error, FEP_DEV_BAD_COUNT, p.rank,
                                      FEP_PHASE_LL_DISPATCH_RECV, u % R, flag_value(tag, M), v);
                    s_fail = 1;
                    c = 0;
                }
            }
        } else if (p.proxy.ring != 0 && is_proxy(peers, u % R)) {
            if (blockIdx.x != 0) continue;  // counted after the handoff below
            uint64_t n = 0;
            if (!px_count(p.proxy, 0, p.set, px_slot(0, p.set, E, u), 4u * E, ctx, &n)) {
                s_fail = 1;
            } else if (n > static_cast<uint64_t>(M)) {
                fep::report_error(p.dev_error, FEP_DEV_BAD_COUNT, p.rank,
                                  FEP_PHASE_LL_DISPATCH_RECV, u % R, M, n);
                s_fail = 1;
            } else {
                c = static_cast<int>(n);
            }
        } else if (!fep::wait_geq(f, flag_value(tag, 0), ctx)) {
            s_fail = 1;
        } else {
            const uint64_t v = fep::ld_acquire_sys(f);
            c = static_cast<int>(v & 0xffffffffu);
            if ((v >> 32) != tag || c > M) {
                fep::report_error(p.dev_error, FEP_DEV_BAD_COUNT, p.rank,
                                  FEP_PHASE_LL_DISPATCH_RECV, u % R, flag_value(tag, M), v);
                s_fail = 1;
                c = 0;
            }
        }
        s_cnt[u] = c;
        if (timed) {
            atomicAdd(reinterpret_cast<unsigned long long*>(p.wait_stats) + (u % R),
                      static_cast<unsigned long long>(fep::globaltimer_ns() - wait_start));
        }
    }
    if (p.proxy.ring != 0) {
        const fep::WaitCtx ctx{p.dev_error, p.budget_cycles, static_cast<uint32_t>(p.rank),
                               FEP_PHASE_LL_DISPATCH_RECV, UINT32_MAX};
        px_counts_handoff(p.proxy, 0, p.set, E, ctx, &s_fail);
        if (blockIdx.x != 0 && !s_fail) {
            for (int u = tid; u < E; u += kThreads) {
                if (is_proxy(peers, u % R)) {
                    s_cnt[u] = static_cast<int>(
                        px_mirrored_count(p.proxy, px_slot(0, p.set, E, u), 4u * E));
                }
            }
        }
    }
    __syncthreads();
    if (s_fail) return;  // block-uniform
    if (marker) fep::trace(FEP_TRACE_LL_RECV_COUNTS, p.rank, p.set);
    block_exclusive_scan(s_cnt, s_start, E);

    if (blockIdx.x == 0) {
        int32_t* range = reinterpret_cast<int32_t*>(p.layout_range);
        for (int u = tid; u < E; u += kThreads) {
            const int e = u / R, src = u % R;
            range[2 * u] = s_start[u] - s_start[e * R];
            range[2 * u + 1] = s_cnt[u];
            if (src == R - 1) {
                reinterpret_cast<int32_t*>(p.recv_count)[e] = s_start[u + 1] - s_start[e * R];
            }
        }
    }

    const int payload_bytes = p.use_fp8 ? H : 2 * H;
    const int n16 = payload_bytes / 16;
    const int segs = (payload_bytes + kSegBytes - 1) / kSegBytes;
    const int groups = H / 128;
    const int total = s_start[E] * segs;
    const unsigned char* recv = reinterpret_cast<const unsigned char*>(p.local_buf);
    const bool sys = p.proxy.ring != 0;  // the buffer takes writes from outside the GPU
    for (int item = blockIdx.x * kWarps + warp; item < total; item += gridDim.x * kWarps) {
        const int n = item / segs, seg = item - n * segs;
        const int u = find_unit(s_start, E, n);
        const int i = n - s_start[u];
        const int e = u / R, src = u % R;
        const size_t out_row = static_cast<size_t>(e) * S + (s_start[u] - s_start[e * R]) + i;
        const unsigned char* rec =
            recv + unit_offset(p.set, 1, E, u, p.unit_bytes, p.proxy) + static_cast<size_t>(i) * p.record_bytes;
        // The record's scales and source index are loaded before the row is stored, so every
        // load of the item is in flight at once (one round trip when the record is in host
        // memory, instead of three; hidden <= 16384 keeps all scales in the first batch).
        const float* rec_scales = reinterpret_cast<const float*>(rec + p.scales_offset);
        float sc[kScaleBatch];
        int src_i = 0;
        if (seg == 0) {
            if (p.use_fp8) {
#pragma unroll
                for (int j = 0; j < kScaleBatch; ++j) {
                    const int gi = lane + 32 * j;
                    sc[j] = gi < groups ? ld_recv(rec_scales + gi, sys) : 0.0f;
                }
            }
            if (lane == 0) src_i = ld_recv(reinterpret_cast<const int*>(rec + p.src_idx_offset), sys);
        }
        copy_seg(reinterpret_cast<const uint4*>(rec),
                 reinterpret_cast<uint4*>(p.recv_x) + out_row * n16, n16, seg, lane, sys);
        if (seg == 0) {
            if (p.use_fp8) {
                float* out_scales = reinterpret_cast<float*>(p.recv_scales) + out_row * groups;
#pragma unroll
                for (int j = 0; j < kScaleBatch; ++j) {
                    const int gi = lane + 32 * j;
                    if (gi < groups) out_scales[gi] = sc[j];
                }
                for (int gi = lane + 32 * kScaleBatch; gi < groups; gi += 32) {
                    out_scales[gi] = ld_recv(rec_scales + gi, sys);
                }
            }
            if (lane == 0) {
                reinterpret_cast<int32_t*>(p.recv_src_idx)[out_row] = src_i;
                reinterpret_cast<int32_t*>(p.recv_src_rank)[out_row] = src;
            }
        }
    }
    if (marker) fep::trace(FEP_TRACE_LL_RECV_END, p.rank, p.set);
}
