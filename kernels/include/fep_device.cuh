// fep_device.cuh: device helpers shared by the kernels: system-scope loads/stores, the error
// record, bounded waits and the proxy ring push.
//
// NOTES: every wait in a kernel goes through fep_wait_geq (or another helper here that takes a
// cycle budget). A wait that runs out records an fep_dev_error (first writer wins) and returns
// false; the caller must then leave the kernel without touching protocol state, and the host turns
// the record into CudaError::Device after the stream synchronises.
#pragma once

#include <stdint.h>

#include "fep_abi.h"

namespace fep {

// Loads/stores that other agents (the CPU proxy, a peer process) observe: system scope.
__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
    uint64_t v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ uint32_t ld_volatile_u32(const uint32_t* p) {
    uint32_t v;
    asm volatile("ld.volatile.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Records an error; the first writer wins (atomicCAS on the claim word in device memory), later
// ones are dropped. The record's fields are written and fenced before `code`, so a host that
// polls during a run never sees a code with stale fields. `ref.record == 0`: no reporting.
__device__ __forceinline__ void report_error(const fep_dev_error_ref& ref, uint32_t code, uint32_t rank,
                                             uint32_t phase, uint32_t peer, uint64_t expected,
                                             uint64_t observed) {
    if (ref.record == 0) return;
    uint32_t* claim = reinterpret_cast<uint32_t*>(ref.claim);
    if (claim != nullptr && atomicCAS(claim, 0u, 1u) != 0u) return;
    volatile fep_dev_error* err = reinterpret_cast<volatile fep_dev_error*>(ref.record);
    err->rank = rank;
    err->phase = phase;
    err->peer = peer;
    err->expected = expected;
    err->observed = observed;
    __threadfence_system();
    err->code = code;
    __threadfence_system();
}

// True once some thread (of any block) has claimed the error record: waiters give up early then.
// Reads the device-memory claim word (cheap), not the record over PCIe.
__device__ __forceinline__ bool error_raised(const fep_dev_error_ref& ref) {
    return ref.claim != 0 && ld_volatile_u32(reinterpret_cast<const uint32_t*>(ref.claim)) != 0u;
}

struct WaitCtx {
    fep_dev_error_ref err;
    uint64_t budget_cycles;
    uint32_t rank;
    uint32_t phase;
    uint32_t peer;
};

// Spins until *p >= expected (acquire, system scope); `*seen` (optional) gets the value that
// ended the wait. Returns false after `budget_cycles` clock64 cycles (recording
// FEP_DEV_WAIT_TIMEOUT) or as soon as another waiter raised an error.
__device__ __forceinline__ bool wait_geq(const uint64_t* p, uint64_t expected, const WaitCtx& ctx,
                                         uint64_t* seen = nullptr) {
    const long long start = clock64();
    uint64_t v = ld_acquire_sys(p);
    while (v < expected) {
        if (static_cast<uint64_t>(clock64() - start) > ctx.budget_cycles) {
            report_error(ctx.err, FEP_DEV_WAIT_TIMEOUT, ctx.rank, ctx.phase, ctx.peer, expected, v);
            return false;
        }
        if (error_raised(ctx.err)) return false;
        __nanosleep(64);
        v = ld_acquire_sys(p);
    }
    if (seen != nullptr) *seen = v;
    return true;
}

// Spins until the high half of *p equals `expected` modulo 2^32 (acquire, system scope), for a
// word that packs two wrapping 32-bit counters as (hi << 32) | lo and changes by one atomic
// update at a time (a counter line's `packed` word, fep_abi.h FEP_COUNTER_PACKED_OFFSET): `*seen`
// gets the word that ended the wait, so both halves come from the same single-copy-atomic 64-bit
// load. A high half "ahead" (0 < hi - expected < 2^31, wrapping) is an overrun: it records
// FEP_DEV_BAD_COUNT (expected and the high half seen) and returns false; "behind" keeps waiting.
// Otherwise bounded as wait_geq: FEP_DEV_WAIT_TIMEOUT (expected, the last high half seen) after
// `budget_cycles` clock64 cycles, false as soon as another waiter raised an error.
// NOTES: modular, not >=: the halves wrap (a slot's sums pass 2^32 after ~33 M calls of 128 rows,
// well within a training run), and the waiter keeps only 32-bit bases, so "reached" is a
// difference of zero and the sign of the difference tells ahead from behind (serial-number
// arithmetic; a peer is never 2^31 calls away from its receiver).
__device__ __forceinline__ bool wait_packed_eq(const uint64_t* p, uint32_t expected,
                                               const WaitCtx& ctx, uint64_t* seen) {
    const long long start = clock64();
    uint64_t v = ld_acquire_sys(p);
    for (;;) {
        const uint32_t hi = static_cast<uint32_t>(v >> 32);
        const uint32_t d = hi - expected;
        if (d == 0u) break;
        if (d < 0x80000000u) {
            report_error(ctx.err, FEP_DEV_BAD_COUNT, ctx.rank, ctx.phase, ctx.peer, expected, hi);
            return false;
        }
        if (static_cast<uint64_t>(clock64() - start) > ctx.budget_cycles) {
            report_error(ctx.err, FEP_DEV_WAIT_TIMEOUT, ctx.rank, ctx.phase, ctx.peer, expected,
                         hi);
            return false;
        }
        if (error_raised(ctx.err)) return false;
        __nanosleep(64);
        v = ld_acquire_sys(p);
    }
    *seen = v;
    return true;
}

// The proxy ring (fep_abi.h): one producer thread per ring. `head` is the producer's own copy
// of hdr->head (it is the only writer), kept by the caller across pushes.
// NOTES: the entry is written and fenced (system scope) before head is published, so the proxy
// never reads a half-written command; the producer never writes while head - tail == capacity.
__device__ __forceinline__ bool ring_push(fep_ring_hdr* hdr, fep_cmd* entries, uint32_t capacity,
                                          uint64_t& head, fep_cmd cmd, const WaitCtx& ctx) {
    if (head - ld_acquire_sys(&hdr->tail) >= capacity) {
        // Full: wait (bounded) for the consumer to free one slot.
        if (!wait_geq(&hdr->tail, head - capacity + 1, ctx)) return false;
    }
    cmd.seq = static_cast<uint32_t>(head);
    fep_cmd* slot = entries + (head % capacity);
    // Two 16-byte stores per command (slots are 32 bytes at 16-byte aligned offsets).
    uint4 lo, hi;
    memcpy(&lo, &cmd, sizeof(lo));
    memcpy(&hi, reinterpret_cast<const char*>(&cmd) + sizeof(lo), sizeof(hi));
    uint4* dst = reinterpret_cast<uint4*>(slot);
    dst[0] = lo;
    dst[1] = hi;
    __threadfence_system();
    head += 1;
    st_release_sys(&hdr->head, head);
    return true;
}

}  // namespace fep
