/* Records of the baseline kernels (kernels/baseline.cu; Rust: ep-bench/src/nccl.rs): the permute
 * and un-permute around NCCL's all-to-all that ep-bench times beside our dispatch/combine ("the
 * standard stack"). Included by fep_abi.h, so bindgen and the size checks see it. */
#ifndef FEP_BASELINE_H
#define FEP_BASELINE_H

#include <stddef.h>
#include <stdint.h>

#define FEP_BASELINE_THREADS 256

/* out row i = src row index[i] (bytes). Any grid; grid-stride over rows. */
typedef struct fep_gather_rows_params {
    uint64_t src;       /* const bytes [*, row_bytes] */
    uint64_t index;     /* const int32 [num_rows]: the source row of each output row */
    uint64_t dst;       /* out bytes [num_rows, row_bytes] */
    uint32_t row_bytes; /* a multiple of 16; src and dst 16-byte aligned */
    int32_t num_rows;
} fep_gather_rows_params; /* 32 bytes */

/* out[t] = bf16(sum over j in [offsets[t], offsets[t+1]) of src[rows[j]]), fp32 accumulation in
 * j order, round to nearest even. Any grid; grid-stride over tokens. */
typedef struct fep_segment_sum_params {
    uint64_t src;     /* const bf16 [*, hidden] */
    uint64_t offsets; /* const int32 [num_tokens + 1] */
    uint64_t rows;    /* const int32 [offsets[num_tokens]] */
    uint64_t out;     /* out bf16 [num_tokens, hidden] */
    int32_t hidden;   /* a multiple of 8 */
    int32_t num_tokens;
} fep_segment_sum_params; /* 40 bytes */

/* The equal-SM copy ceiling (ep-bench's "copy" rows): dst = src over `vecs` 16-byte vectors,
 * grid-stride with four loads in flight per thread before their stores. Any grid: the SM budget
 * the figure is for. */
#define FEP_COPY_THREADS 1024
typedef struct fep_copy_params {
    uint64_t src;  /* const, 16-byte aligned */
    uint64_t dst;  /* 16-byte aligned, not overlapping src */
    uint64_t vecs; /* 16-byte vectors to copy */
} fep_copy_params; /* 24 bytes */

#ifdef __cplusplus
static_assert(sizeof(fep_copy_params) == 24, "fep_copy_params layout");
static_assert(sizeof(fep_gather_rows_params) == 32, "fep_gather_rows_params layout");
static_assert(sizeof(fep_segment_sum_params) == 40, "fep_segment_sum_params layout");
#endif

#endif /* FEP_BASELINE_H */
