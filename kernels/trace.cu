// Clock calibration of the event trace (src/cuda/trace.rs calibrate): one thread stores
// %globaltimer into mapped host memory `iters` times; the host, spinning on the word, pairs each
// value it sees with its own clock. `out[1]` = 1 when done.
#include "fep_abi.h"
#include "fep_trace.cuh"

extern "C" __global__ void fep_trace_clock(const fep_trace_clock_params p) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    volatile unsigned long long* v = reinterpret_cast<unsigned long long*>(p.out);
    for (unsigned int i = 0; i < p.iters; ++i) {
        v[0] = fep::globaltimer_ns();
        __threadfence_system();
        __nanosleep(200);
    }
    v[1] = 1ull;
    __threadfence_system();
}
