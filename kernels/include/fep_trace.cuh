// fep_trace.cuh: the optional event trace of the kernels (fep_abi.h FEP_TRACE_*, src/cuda/trace.rs).
//
// NOTES: off unless the host sets `fep_trace_words` (a module global, zero at load): one load of
// a global per marked point, then nothing. The records use %globaltimer, a nanosecond clock
// shared by every context on the GPU, so the records of two processes on one GPU line up
// directly; the host maps them onto its own clock with a measured offset (trace::calibrate).
#pragma once

#include <stdint.h>

#include "fep_abi.h"

extern "C" __device__ unsigned long long* fep_trace_words = nullptr;
extern "C" __device__ unsigned int fep_trace_capacity = 0;

namespace fep {

__device__ __forceinline__ uint64_t globaltimer_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Appends one record (any thread; callers mark from one thread of one block).
__device__ __forceinline__ void trace(uint32_t kind, int rank, uint32_t arg) {
    unsigned long long* w = fep_trace_words;
    if (w == nullptr) return;
    const unsigned long long i = atomicAdd(w, 1ull);
    if (i >= fep_trace_capacity) return;
    w[1 + 2 * i] = globaltimer_ns();
    w[2 + 2 * i] = (static_cast<unsigned long long>(kind) << 48) |
                   (static_cast<unsigned long long>(static_cast<uint32_t>(rank) & 0xffffu) << 32) | arg;
}

}  // namespace fep
