// Small kernels that exercise the device-side protocol helpers (fep_device.cuh): the bounded waits
// (on a counter, and on a packed counter word's wrapping high half) and their error record, and
// the proxy ring push. The GPU tests (tests/gpu_device_wait.rs) run
// them now; the proxy's GPU test uses fep_ring_push_test against the real proxy.
#include "fep_abi.h"
#include "fep_device.cuh"

// One thread waits for *counter >= expected within the budget.
extern "C" __global__ void fep_wait_test(const fep_wait_test_params p) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    const fep::WaitCtx ctx{p.dev_error, p.budget_cycles, p.rank,
                           p.phase, p.peer};
    fep::wait_geq(reinterpret_cast<const uint64_t*>(p.counter), p.expected, ctx);
}

// One thread pushes num_cmds commands (command i: offsets i * length, imm = i) into the ring, then
// waits for the arrival counter to reach arrival_expected. Every wait is bounded.
extern "C" __global__ void fep_ring_push_test(const fep_ring_push_test_params p) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    const fep::WaitCtx ctx{p.dev_error, p.budget_cycles, p.rank,
                           p.phase, p.dst_rank};
    fep_ring_hdr* hdr = reinterpret_cast<fep_ring_hdr*>(p.ring);
    fep_cmd* entries = reinterpret_cast<fep_cmd*>(hdr + 1);
    uint64_t head = fep::ld_acquire_sys(&hdr->head);
    for (uint32_t i = 0; i < p.num_cmds; ++i) {
        fep_cmd cmd;
        cmd.local_offset = static_cast<uint64_t>(i) * p.length;
        cmd.remote_offset = static_cast<uint64_t>(i) * p.length;
        cmd.length = p.length;
        cmd.dst_rank = p.dst_rank;
        cmd.imm = i;
        cmd.seq = 0;
        if (!fep::ring_push(hdr, entries, p.capacity, head, cmd, ctx)) return;
    }
    fep::wait_geq(reinterpret_cast<const uint64_t*>(p.arrival), p.arrival_expected, ctx);
}

// One thread waits until the high half of *counter equals the low 32 bits of `expected` modulo
// 2^32 (fep::wait_packed_eq, a counter line's packed word); on success it stores the word that
// ended the wait at counter + 8 (release, system scope), so the host checks both halves came from
// that one load.
extern "C" __global__ void fep_wait_packed_test(const fep_wait_test_params p) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    const fep::WaitCtx ctx{p.dev_error, p.budget_cycles, p.rank, p.phase, p.peer};
    uint64_t* counter = reinterpret_cast<uint64_t*>(p.counter);
    uint64_t seen = 0;
    if (fep::wait_packed_eq(counter, static_cast<uint32_t>(p.expected), ctx, &seen)) {
        fep::st_release_sys(counter + 1, seen);
    }
}
