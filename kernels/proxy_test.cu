// Kernels that drive the real CPU proxy (src/proxy) through its command ring and arrival counters:
// the GPU proxy tests (tests/gpu_proxy.rs) and the latency bench
// (ep-bench/examples/gpu_proxy_bench.rs).
// Every wait is bounded (fep_device.cuh); a wait that runs out records the error and the kernel
// leaves without touching the ring again.
#include "fep_abi.h"
#include "fep_device.cuh"

namespace fep_proxy_test {

// NOTES: the Rust side (tests/common/gpu_proxy.rs: msg_len, msg_byte) computes the same
// functions; change both together.
__device__ __forceinline__ uint32_t mix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x85ebca6bu;
    x ^= x >> 13;
    x *= 0xc2b2ae35u;
    x ^= x >> 16;
    return x;
}

// Length of message i from rank src: every 5th is count-only (0 bytes), the rest 1..=stride.
__device__ __forceinline__ uint32_t msg_len(uint32_t src, uint32_t i, uint32_t stride) {
    if (i % 5u == 4u) return 0u;
    return 1u + mix32(src * 0x9e3779b1u ^ (i + 0x01234567u)) % stride;
}

__device__ __forceinline__ uint8_t msg_byte(uint32_t src, uint32_t dst, uint32_t i, uint32_t j) {
    return static_cast<uint8_t>(
        mix32(src * 0x01000193u ^ dst * 0x9e3779b1u ^ i * 0x85ebca77u ^ j * 0xc2b2ae3du));
}

__device__ __forceinline__ uint64_t globaltimer() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

}  // namespace fep_proxy_test

// One block. For each message: all threads write its payload into the send region (mapped host
// memory), fence (system scope), then thread 0 pushes the command (imm = imm_slot | length).
// Then thread 0 waits (bounded) for the peer's num_msgs arrivals, and all threads check every
// byte the peer's messages delivered, counting mismatches in device memory.
extern "C" __global__ void fep_proxy_exchange_test(const fep_proxy_exchange_params p) {
    __shared__ int ok;
    const fep::WaitCtx ctx{p.dev_error, p.budget_cycles, p.rank, p.phase, p.peer};
    fep_ring_hdr* hdr = reinterpret_cast<fep_ring_hdr*>(p.ring);
    fep_cmd* entries = reinterpret_cast<fep_cmd*>(hdr + 1);
    uint64_t head = 0;
    if (threadIdx.x == 0) {
        ok = 1;
        head = fep::ld_acquire_sys(&hdr->head);
    }
    __syncthreads();
    const uint32_t max_len = p.value_bits >= 32u ? 0xffffffffu : (1u << p.value_bits) - 1u;
    const uint32_t slot_bits = p.value_bits >= 32u ? 0u : p.imm_slot << p.value_bits;
    uint8_t* send = reinterpret_cast<uint8_t*>(p.send);
    for (uint32_t i = 0; p.push != 0u && i < p.num_msgs; ++i) {
        const uint32_t len = fep_proxy_test::msg_len(p.rank, i, p.stride);
        uint8_t* dst = send + static_cast<uint64_t>(i) * p.stride;
        for (uint32_t j = threadIdx.x; j < len; j += blockDim.x) {
            dst[j] = fep_proxy_test::msg_byte(p.rank, p.peer, i, j);
        }
        // NOTES: every writer fences its own payload stores (system scope) before the barrier,
        // so the command thread 0 publishes next never names bytes the proxy could read stale.
        __threadfence_system();
        __syncthreads();
        if (threadIdx.x == 0) {
            if (len > max_len) {
                fep::report_error(p.dev_error, FEP_DEV_BAD_INPUT, p.rank, p.phase, p.peer, max_len,
                                  len);
                ok = 0;
            } else {
                fep_cmd cmd;
                cmd.local_offset = static_cast<uint64_t>(i) * p.stride;
                cmd.remote_offset = p.remote_base + static_cast<uint64_t>(i) * p.stride;
                cmd.length = len;
                cmd.dst_rank = p.peer;
                cmd.imm = slot_bits | len;
                cmd.seq = 0;
                if (!fep::ring_push(hdr, entries, p.capacity, head, cmd, ctx)) ok = 0;
            }
        }
        __syncthreads();
        if (!ok) return;
    }
    if (threadIdx.x == 0) {
        const uint64_t* arrivals = reinterpret_cast<const uint64_t*>(p.arrivals);
        if (!fep::wait_geq(arrivals, p.arrival_base + p.num_msgs, ctx)) ok = 0;
    }
    __syncthreads();
    if (!ok) return;
    const volatile uint8_t* recv = reinterpret_cast<const volatile uint8_t*>(p.recv);
    uint32_t bad = 0;
    for (uint32_t i = 0; i < p.num_msgs; ++i) {
        const uint32_t len = fep_proxy_test::msg_len(p.peer, i, p.stride);
        const volatile uint8_t* src = recv + p.recv_base + static_cast<uint64_t>(i) * p.stride;
        for (uint32_t j = threadIdx.x; j < len; j += blockDim.x) {
            bad += src[j] != fep_proxy_test::msg_byte(p.peer, p.rank, i, j);
        }
    }
    if (bad != 0u) atomicAdd(reinterpret_cast<uint32_t*>(p.mismatches), bad);
}

// One thread: `iters` rounds of push-then-wait (initiator) or wait-then-push (responder) through
// the proxy, stamping clock64 after each round.
extern "C" __global__ void fep_proxy_pingpong(const fep_proxy_pingpong_params p) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    const fep::WaitCtx ctx{p.dev_error, p.budget_cycles, p.rank, p.phase, p.peer};
    fep_ring_hdr* hdr = reinterpret_cast<fep_ring_hdr*>(p.ring);
    fep_cmd* entries = reinterpret_cast<fep_cmd*>(hdr + 1);
    const uint64_t* arrivals = reinterpret_cast<const uint64_t*>(p.arrivals);
    uint64_t* ts = reinterpret_cast<uint64_t*>(p.timestamps);
    uint64_t* gt = reinterpret_cast<uint64_t*>(p.globaltimer);
    uint64_t head = fep::ld_acquire_sys(&hdr->head);
    gt[0] = fep_proxy_test::globaltimer();
    ts[0] = static_cast<uint64_t>(clock64());
    for (uint32_t i = 0; i < p.iters; ++i) {
        if (p.initiator != 0u) {
            if (!fep::ring_push(hdr, entries, p.capacity, head, p.cmd, ctx)) return;
            if (!fep::wait_geq(arrivals, p.arrival_base + i + 1u, ctx)) return;
        } else {
            if (!fep::wait_geq(arrivals, p.arrival_base + i + 1u, ctx)) return;
            if (!fep::ring_push(hdr, entries, p.capacity, head, p.cmd, ctx)) return;
        }
        ts[i + 1] = static_cast<uint64_t>(clock64());
    }
    gt[1] = fep_proxy_test::globaltimer();
}
