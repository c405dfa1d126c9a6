/* fep_abi.h: every record that crosses the CUDA/Rust line.
 *
 * build.rs runs bindgen over this file (Rust side: src/abi.rs, #[repr(C)] + bytemuck::Pod),
 * and both languages assert the sizes and offsets below, so the two sides cannot drift.
 * Device pointers travel as uint64_t so every struct is plain old data.
 * NOTES: change a layout => bump FEP_ABI_VERSION (it is part of the config hash ranks exchange).
 */
#ifndef FEP_ABI_H
#define FEP_ABI_H

#include <stddef.h>
#include <stdint.h>

#define FEP_ABI_VERSION 4

/* ---- proxy command ring (GPU producer -> CPU proxy consumer) ---------------------------------
 * One single-producer/single-consumer ring per producing block. The producer fills entry
 * `head % capacity`, fences (system scope), then publishes head+1. The consumer reads entries
 * in [tail, head), posts them, then publishes tail. The producer never writes an entry while
 * head - tail == capacity: the ring never overwrites an unconsumed command. */
typedef struct fep_cmd {
    uint64_t local_offset;  /* bytes into the sender's registered send region */
    uint64_t remote_offset; /* bytes into the receiver's registered receive region */
    uint32_t length;        /* bytes to write; 0 is a valid "empty" message (count-only) */
    uint32_t dst_rank;      /* global rank of the receiver */
    uint32_t imm;           /* immediate data for the receiver's completion (EFA carries 4 bytes) */
    uint32_t seq;           /* low 32 bits of the slot's ticket: the consumer checks it */
} fep_cmd;                  /* 32 bytes */

typedef struct fep_ring_hdr {
    uint64_t head;      /* written by the producer only: tickets [0, head) are published */
    uint64_t _pad0[7];  /* head and tail on their own 64-byte lines */
    uint64_t tail;      /* written by the consumer only: tickets [0, tail) are consumed */
    uint64_t _pad1[7];
} fep_ring_hdr;         /* 128 bytes, followed by `capacity` fep_cmd entries */

/* ---- device-side error record (mapped host memory) -------------------------------------------
 * A kernel whose bounded wait runs out writes one of these (first writer wins via `code`) and
 * exits; the host turns it into a typed error naming rank, phase and what was awaited. */
#define FEP_DEV_OK 0u
#define FEP_DEV_WAIT_TIMEOUT 1u
#define FEP_DEV_BAD_COUNT 2u
#define FEP_DEV_BAD_INPUT 3u /* an input out of range: observed = the value, expected = its bound */

typedef struct fep_dev_error {
    uint32_t code;     /* FEP_DEV_* ; 0 = no error */
    uint32_t rank;     /* the rank that detected it */
    uint32_t phase;    /* protocol phase id (see src/ep) */
    uint32_t peer;     /* the rank it waited for, or UINT32_MAX */
    uint64_t expected; /* what the wait needed */
    uint64_t observed; /* what it had seen when it gave up */
} fep_dev_error;       /* 32 bytes */

/* Where a kernel reports errors: the record (mapped host memory, read by the host after the
 * stream synchronises) and a claim word in DEVICE memory that decides the first writer.
 * NOTES: the claim cannot live in the mapped record: GPUs without host-native atomics (PCIe, no
 * CU_DEVICE_ATTRIBUTE_HOST_NATIVE_ATOMIC_SUPPORTED) may not run atomics on host memory
 * (compute-sanitizer rejects them). Both zero before a launch; record == 0: no reporting. */
typedef struct fep_dev_error_ref {
    uint64_t record; /* fep_dev_error* (mapped host memory), or 0 */
    uint64_t claim;  /* uint32_t* (device memory): 0 = unclaimed */
} fep_dev_error_ref; /* 16 bytes */

/* ---- get_dispatch_layout ----------------------------------------------------------------------
 * One launch computes every output (see kernels/layout.cu). Counting semantics (DeepEP V1):
 * a token counts once per rank and once per node it goes to; per expert, every top-k entry counts.
 * NOTES: `workspace` is int32 [num_experts + num_ranks + num_nodes + 1], all zero before the first
 * launch (cuMemAlloc + memset once); every launch leaves it zero again. One workspace per stream:
 * two launches in flight at once on one workspace give wrong counts. */
#define FEP_LAYOUT_THREADS 256          /* threads per block of fep_dispatch_layout */
#define FEP_LAYOUT_CLUSTER_THREADS 1024 /* threads per block of fep_dispatch_layout_cluster */
#define FEP_LAYOUT_CLUSTER_BLOCKS 8     /* its grid: exactly one cluster of this many blocks */

typedef struct fep_layout_params {
    uint64_t topk_idx;              /* const int64_t [num_tokens, num_topk]; -1 = no expert */
    uint64_t num_tokens_per_rank;   /* int32_t [num_ranks] */
    uint64_t num_tokens_per_node;   /* int32_t [num_nodes], or 0 to skip */
    uint64_t num_tokens_per_expert; /* int32_t [num_experts] */
    uint64_t is_token_in_rank;      /* uint8_t (bool) [num_tokens, num_ranks] */
    uint64_t workspace;             /* int32_t scratch, see NOTES above (grid variant only) */
    fep_dev_error_ref dev_error;    /* out-of-range indices are reported here */
    int32_t num_tokens;
    int32_t num_topk;
    int32_t num_experts;
    int32_t num_ranks;
    int32_t ranks_per_node;
    int32_t tile_tokens;            /* tokens per shared-memory tile, a multiple of 16 (launcher picks) */
    int32_t rank;                   /* this rank, for the error record */
    int32_t _pad;
} fep_layout_params; /* 96 bytes */

/* ---- test kernels (kernels/test_kernels.cu): the device-wait and proxy-ring paths ------------
 * fep_wait_test waits until *counter >= expected (fep::wait_geq). fep_wait_packed_test takes the
 * same record and waits until the high half of *counter equals the low 32 bits of `expected`
 * modulo 2^32 (fep::wait_packed_eq, a counter line's `packed` word); on success it stores the
 * word that ended the wait at counter + 8 (so that allocation needs 16 bytes). */
typedef struct fep_wait_test_params {
    uint64_t counter;            /* const uint64_t* (mapped host memory or device): waited on */
    fep_dev_error_ref dev_error;
    uint64_t expected;      /* wait until *counter >= expected (packed: see above) */
    uint64_t budget_cycles; /* clock64 cycles before giving up */
    uint32_t rank;
    uint32_t phase;
    uint32_t peer;
    uint32_t _pad;
} fep_wait_test_params; /* 56 bytes */

typedef struct fep_ring_push_test_params {
    uint64_t ring;             /* fep_ring_hdr* followed by `capacity` fep_cmd (mapped host memory) */
    uint64_t arrival;          /* const uint64_t* arrival counter (mapped host memory) */
    fep_dev_error_ref dev_error;
    uint64_t budget_cycles;    /* per bounded wait (ring full, arrival) */
    uint64_t arrival_expected; /* after pushing, wait until *arrival >= this */
    uint32_t capacity;         /* ring entries, > 0 */
    uint32_t num_cmds;         /* commands to push; command i: offsets i * length, imm = i */
    uint32_t dst_rank;
    uint32_t length;
    uint32_t rank;
    uint32_t phase;
} fep_ring_push_test_params; /* 72 bytes */

/* ---- proxy kernels (kernels/proxy_test.cu): a kernel drives the real CPU proxy ---------------
 * Message `i` of rank `src` for rank `dst` is fep_msg_len(src, i, stride) bytes (0 = count-only)
 * of fep_msg_byte(src, dst, i, j); the Rust tests compute the same functions (tests/gpu_proxy*). */
typedef struct fep_proxy_exchange_params {
    uint64_t ring;          /* fep_ring_hdr* + `capacity` fep_cmd (mapped host memory) */
    uint64_t send;          /* uint8_t* this rank's send region, GPU address (mapped host memory) */
    uint64_t recv;          /* const uint8_t* this rank's receive region, GPU address */
    uint64_t arrivals;      /* const uint64_t*: arrivals of the slot the peer writes (mapped) */
    uint64_t mismatches;    /* uint32_t* (DEVICE memory): received bytes unlike the pattern */
    fep_dev_error_ref dev_error;
    uint64_t budget_cycles; /* per bounded wait (ring full, arrivals) */
    uint64_t arrival_base;  /* arrivals counted on that slot before this launch */
    uint64_t remote_base;   /* bytes into the PEER's receive region where this rank's messages go */
    uint64_t recv_base;     /* bytes into THIS rank's receive region of the peer's messages */
    uint32_t capacity;      /* ring entries, > 0 */
    uint32_t num_msgs;      /* messages each way; message i at offset i * stride on both sides */
    uint32_t stride;        /* bytes reserved per message; lengths are at most this */
    uint32_t rank;
    uint32_t peer;
    uint32_t phase;
    uint32_t imm_slot;      /* the counter slot this rank's messages name at the peer */
    uint32_t value_bits;    /* imm = imm_slot << value_bits | length (length must fit) */
    uint32_t push;          /* 0: push nothing (a silent rank), only wait */
    uint32_t _pad;
} fep_proxy_exchange_params; /* 128 bytes */

/* Ping-pong through the proxy: the initiator pushes then waits, the responder waits then pushes,
 * `iters` times; thread 0 stamps clock64 after every round (and globaltimer at both ends, so the
 * host converts cycles to ns). */
typedef struct fep_proxy_pingpong_params {
    uint64_t ring;          /* fep_ring_hdr* + `capacity` fep_cmd (mapped host memory) */
    uint64_t arrivals;      /* const uint64_t*: the counter this rank waits on (mapped) */
    uint64_t timestamps;    /* uint64_t [iters + 1] (device memory): clock64 at start, per round */
    uint64_t globaltimer;   /* uint64_t [2] (device memory): %globaltimer at start and end */
    fep_dev_error_ref dev_error;
    uint64_t budget_cycles; /* per bounded wait */
    uint64_t arrival_base;  /* the counter's value before this launch */
    fep_cmd cmd;            /* what every push sends (seq is filled in by the push) */
    uint32_t capacity;
    uint32_t iters;
    uint32_t initiator;     /* 1: push, then wait; 0: wait, then push */
    uint32_t rank;
    uint32_t peer;
    uint32_t phase;
} fep_proxy_pingpong_params; /* 120 bytes */
/* ---- low-latency dispatch / combine (kernels/ll_dispatch.cu, kernels/ll_combine.cu) ----------
 * Buffer: src/protocol/plan/ll.rs LlLayout (two sets x {send, recv} x E units of unit_bytes):
 *   unit_offset(set, area, unit) = ((set * 2 + area) * E + unit) * unit_bytes (with a proxy lane:
 *   placed by fep_ll_proxy's units_per_region / region_stride)
 *   dispatch recv: unit e * R + src, row i = the i-th token of src that selected local expert e
 *   combine  recv: unit g = expert_rank * L + e, row i = answer to the i-th token of this rank
 *                  that selected g (the same `pos` the dispatch used)
 * Flags: uint64 [2 sets][2 phases (0 dispatch, 1 combine)][E] in the RECEIVER's device memory;
 *   dispatch flag index e * R + src, combine flag index g. Value = (tag << 32) | count, written
 *   once per call with a release store after the rows; tag = the call's epoch (>= 1, grows by one
 *   per LL call on every rank), so no reset pass is needed and a stale value is never mistaken
 *   for a fresh one.
 * Transport per peer: FEP_LL_TRANSPORT_PEER = stores through a device pointer (same GPU, NVLink
 *   or an IPC mapping). FEP_LL_TRANSPORT_PROXY (a peer on another node): the rows are staged in
 *   THIS rank's send area (area 0 of the set; dispatch unit = global expert g, combine unit =
 *   e * R + dst) and the send's last block pushes one fep_cmd per (peer, expert) through the CPU
 *   proxy (fep_ll_proxy below): an RMA write of all rows into the peer's receive unit with
 *   imm = slot << value_bits | count (an empty write when count is 0). Slots are
 *   src/protocol/plan/imm.rs LlImm's, as the receiver sees them: dispatch set * E + (e * R + src),
 *   combine (2 + set) * E + (src * L + e) - i.e. (phase * 2 + set) * E + the receive unit. For a
 *   PROXY entry `buf` and `flags` are unused and `proxy` is the peer's index among the proxy peers
 *   (the order of its commands in a push batch). The receiver polls the slot's `packed` counter
 *   word (below) and waits (bounded) until its high half = arr_base[slot] + calls of (phase, set)
 *   since the last clean, modulo 2^32; the count is its low half - sums_seen[slot], modulo 2^32
 *   (fep_ll.cuh px_count). */
#define FEP_LL_THREADS 512
#define FEP_LL_SEG_BYTES 4096 /* bytes of a row one warp copies per work item (fep_ll.cuh kSegBytes) */
#define FEP_LL_TRANSPORT_PEER 0u
#define FEP_LL_TRANSPORT_PROXY 1u
#define FEP_PHASE_LL_DISPATCH_SEND 16u
#define FEP_PHASE_LL_DISPATCH_RECV 17u
#define FEP_PHASE_LL_COMBINE_SEND 18u
#define FEP_PHASE_LL_COMBINE_RECV 19u

/* Bytes between two slots' proxy counters and between two rings' sends_completed words: one
 * cache line each (src/proxy/memory.rs COUNTER_STRIDE says why). A slot's line, written by the
 * receiving CPU proxy once per arrival (src/proxy/memory.rs CounterMemory::record_arrival):
 *   +0  arrivals: writes that arrived (u64)
 *   +8  sums: the sum of their immediate values (u64)
 *   +16 packed: ((arrivals mod 2^32) << 32) | (sums mod 2^32), each arrival ONE atomic update of
 *       the whole word with no carry from the low half into the high half. A kernel learns a
 *       slot's arrival and its count from one 64-bit load (one PCIe round trip instead of two
 *       dependent ones); arrivals is updated last, so a host waiter that acquires it sees the
 *       other two words up to date.
 * sends_completed lines hold one u64 at +0. */
#define FEP_COUNTER_STRIDE 64u
#define FEP_COUNTER_ARRIVALS_OFFSET 0u
#define FEP_COUNTER_SUMS_OFFSET 8u
#define FEP_COUNTER_PACKED_OFFSET 16u

/* Event trace (diagnosis; kernels/include/fep_trace.cuh, src/trace.rs). When the host has set
 * the module global `fep_trace_words` (FEP_TRACE), marked points of the kernels append a record:
 * words[0] = records taken (atomic), record i = words[1 + 2i] %globaltimer ns, words[2 + 2i] =
 * kind << 48 | rank << 32 | arg. Host-side points (the proxy) use the same kinds. */
#define FEP_TRACE_LL_SEND_BEGIN 1u     /* + 16 * phase (0 dispatch, 1 combine); block 0 enters */
#define FEP_TRACE_LL_SEND_STAGED 2u    /* block 0: the staging area is free (proxy lane) */
#define FEP_TRACE_LL_SEND_PUBLISHED 3u /* last block: commands and flags published; arg = set */
#define FEP_TRACE_LL_RECV_BEGIN 4u     /* block 0 enters */
#define FEP_TRACE_LL_RECV_COUNTS 5u    /* block 0: every count seen */
#define FEP_TRACE_LL_RECV_END 6u       /* block 0 done */
#define FEP_TRACE_PHASE_STRIDE 16u
/* Normal mode, chunks to or from a peer through the proxy lane (kernels/normal_*.cu), thread 0
 * of the block: + 16 * phase (0 dispatch, 1 combine); arg = block index. */
#define FEP_TRACE_NP_SEND_WAIT 32u     /* a sender starts waiting for its slot's credit */
#define FEP_TRACE_NP_SEND_STAGE 33u    /* credit seen: staging the chunk into host memory */
#define FEP_TRACE_NP_SEND_PUSHED 34u   /* chunk staged, fenced, its command pushed */
#define FEP_TRACE_NP_RECV_WAIT 35u     /* a receiver (combine: forwarder) starts waiting */
#define FEP_TRACE_NP_RECV_COPY 36u     /* the chunk arrived: copying it out of host memory */
#define FEP_TRACE_NP_RECV_DONE 37u     /* copied; credit pushed (combine: device flag set) */
#define FEP_TRACE_PROXY_POSTED 64u     /* proxy: a batch of writes posted; arg = writes */
#define FEP_TRACE_PROXY_ARRIVAL 65u    /* proxy: a write arrived; arg = counter slot */
#define FEP_TRACE_PROXY_SEND_DONE 66u  /* proxy: local write completions; arg = count */
#define FEP_TRACE_PROXY_RING_SEEN 67u  /* proxy: new ring entries seen; arg = entries */

/* fep_trace_clock (kernels/trace.cu): one thread stores %globaltimer into out[0] (mapped host
 * memory) `iters` times, then out[1] = 1. */
typedef struct fep_trace_clock_params {
    uint64_t out;
    uint32_t iters;
    uint32_t _pad;
} fep_trace_clock_params;

typedef struct fep_ll_peer {
    uint64_t buf;       /* the peer's LL buffer base, as this rank's kernels address it */
    uint64_t flags;     /* the peer's flag array (see above) */
    uint32_t transport; /* FEP_LL_TRANSPORT_* */
    uint32_t _pad;
    uint64_t proxy;     /* PROXY transport: index among this rank's proxy peers; else 0 */
} fep_ll_peer;          /* 32 bytes */

/* The proxy lane of one rank (all zero: no proxy peers). Counters and the ring are mapped host
 * memory (src/proxy: CounterMemory, RingMemory); `state` is device memory, u64 words:
 *   [0] ring head (the producer's copy)   [1 + set] head after the last push batch on the set
 *   [3 + phase * 2 + set] push batches ever made (cumulative: the clean fence compares them)
 *   [7 + phase * 2 + set] calls since the last clean (receives expect arr_base + this)
 *   [12 + slot] arr_base   [12 + num_slots + slot] sums_seen   (num_slots = 4 * E): the slot's
 *     arrivals and sums at the last clean, and sums as of the last count taken, each modulo 2^32
 *     (the halves of the `packed` counter word; high 32 bits of these state words zero)
 *   [12 + 2 * num_slots + slot] the count block 0 read for the current call (mirror)
 *   [12 + 3 * num_slots + phase * 2 + set] ready: the call whose counts the mirror holds
 *   [12 + 3 * num_slots + 4] sends_seen: the largest sends_completed a leader block has read   [11] the ring tail last read
 * NOTES: a send kernel first waits (bounded) until sends_completed >= state[1 + set] (the NIC
 * has read the staging of the set's previous use), stages, then its last block pushes the whole
 * batch (entries written by many threads, one system fence, one release store of head). Only
 * block 0 reads the host words (sends_completed, packed counters); other blocks wait for its
 * mirror/ready/staged words in device memory (fep_ll.cuh, "one poller per host word"). */
typedef struct fep_ll_proxy {
    uint64_t ring;            /* fep_ring_hdr* + capacity fep_cmd (mapped host), 0 = none */
    uint64_t arrivals;        /* arrivals of slot s at + s * FEP_COUNTER_STRIDE (mapped host);
                                 not read by the LL kernels since they poll `packed` */
    uint64_t packed;          /* the slots' packed counter words, the same stride (mapped host) */
    uint64_t sends_completed; /* const uint64_t* of the ring (mapped host) */
    uint64_t state;           /* uint64_t [12 + 3 * num_slots + 5] (device), fep_ll.cuh */
    uint32_t capacity;        /* ring entries, >= E (one call's batch) */
    uint32_t value_bits;      /* imm = slot << value_bits | count */
    uint32_t num_proxy_peers;
    uint32_t units_per_region; /* 0: units are contiguous (unit u at u * unit_bytes); else unit u
                                  at (u / units_per_region) * region_stride + (u % ..) *
                                  unit_bytes, so no message crosses a registered chunk (the
                                  host lane's LlGeometry); every rank of a job uses the same */
    uint64_t region_stride;
} fep_ll_proxy;               /* 64 bytes */

typedef struct fep_ll_dispatch_params {
    uint64_t x;             /* const bf16 [num_tokens, hidden] */
    uint64_t topk_idx;      /* const int64 [num_tokens, num_topk], -1 = none, distinct per token */
    uint64_t peers;         /* const fep_ll_peer [num_ranks] */
    uint64_t workspace;     /* uint32 [1] ticket counter, zero between launches (kernel resets) */
    uint64_t pos;           /* out int32 [num_tokens, num_topk]: row within the expert's block */
    uint64_t local_buf;     /* this rank's LL buffer */
    uint64_t local_flags;   /* this rank's flags */
    uint64_t recv_x;        /* out [L, R * M, hidden] e4m3 bytes or bf16 */
    uint64_t recv_scales;   /* out f32 [L, R * M, hidden / 128] (fp8 only) */
    uint64_t recv_src_rank; /* out int32 [L, R * M] */
    uint64_t recv_src_idx;  /* out int32 [L, R * M] */
    uint64_t recv_count;    /* out int32 [L] */
    uint64_t layout_range;  /* out int32 [L, R, 2] (begin, count) */
    fep_dev_error_ref dev_error;
    uint64_t epoch;         /* uint64 [2] per-set call counters of this rank, device memory, zero
                               at start: the send's last block publishes tag = epoch[set] + 1 and
                               stores it back; the receive expects tag = epoch[set] */
    uint64_t budget_cycles; /* per bounded wait */
    uint64_t unit_bytes;
    uint32_t record_bytes;  /* LL dispatch record (payload, scales, src idx, padded to 128) */
    uint32_t scales_offset;
    uint32_t src_idx_offset;
    int32_t num_tokens;
    int32_t hidden;
    int32_t num_topk;
    int32_t num_experts;
    int32_t num_ranks;
    int32_t max_tokens;     /* M = max_tokens_per_rank */
    int32_t rank;
    int32_t set;            /* 0 or 1 */
    int32_t use_fp8;
    int32_t round_scale;
    int32_t _pad;
    fep_ll_proxy proxy;     /* peers with FEP_LL_TRANSPORT_PROXY go through it */
    uint64_t wait_stats;    /* int64 [num_ranks] or 0: the receive's block 0 atomically adds, per
                               source rank, the %globaltimer nanoseconds from the start of its
                               wait until each of that rank's flags (or counts) was seen (DeepEP's
                               dispatch_wait_recv_cost_stats) */
    uint64_t shrink_mask;   /* shrink mode (DeepEP's enable_shrink), else 0: uint32 [num_ranks] in
                               mapped host memory, 1 = masked. The sends write nothing to a masked
                               rank, the receives do not wait for it (its messages count as
                               empty, its experts as -1 in combine); a receive wait on a rank
                               that runs out of budget masks the rank (stores 1) instead of
                               failing. The host masks ranks too (the caller's update, a rank the
                               bootstrap saw die), also while a kernel runs. */
    uint64_t shrink_decide; /* shrink mode: uint64 [2 phases][2 sets][num_experts] device memory,
                               zero after a clean: per receive unit (tag << 2) | 1 (arrived) or
                               | 2 (masked), set once per call by compare-and-swap, so that every
                               block of a receive takes a unit whose wait ran out the same way */
} fep_ll_dispatch_params;   /* 288 bytes */

typedef struct fep_ll_combine_params {
    uint64_t x;             /* const bf16 [L, R * M, hidden]: expert outputs, rows as dispatched */
    uint64_t topk_idx;      /* const int64 [num_tokens, num_topk] (as passed to dispatch) */
    uint64_t topk_weights;  /* const f32 [num_tokens, num_topk] */
    uint64_t pos;           /* const int32 [num_tokens, num_topk] from this rank's dispatch */
    uint64_t layout_range;  /* const int32 [L, R, 2] from this rank's dispatch */
    uint64_t peers;         /* const fep_ll_peer [num_ranks] */
    uint64_t workspace;     /* uint32 [1] ticket counter, zero between launches */
    uint64_t local_buf;
    uint64_t local_flags;
    uint64_t out;           /* out bf16 [num_tokens, hidden] */
    fep_dev_error_ref dev_error;
    uint64_t epoch;         /* as in fep_ll_dispatch_params */
    uint64_t budget_cycles;
    uint64_t unit_bytes;
    uint32_t record_bytes;  /* LL combine record: 2 * hidden */
    int32_t num_tokens;
    int32_t hidden;
    int32_t num_topk;
    int32_t num_experts;
    int32_t num_ranks;
    int32_t max_tokens;
    int32_t rank;
    int32_t set;
    int32_t self_pull;      /* 1: rows of this rank's own experts stay in `x`: the send skips them
                               and the receive reads them from `x` (send and receive of one call,
                               no hook, so `x` is unchanged in between); 0: copied as the others */
    fep_ll_proxy proxy;     /* as in fep_ll_dispatch_params */
    uint64_t wait_stats;    /* as in fep_ll_dispatch_params, per rank that answers (DeepEP's
                               combine_wait_recv_cost_stats) */
    uint64_t shrink_mask;   /* as in fep_ll_dispatch_params */
    uint64_t shrink_decide; /* as in fep_ll_dispatch_params */
} fep_ll_combine_params;    /* 248 bytes */

/* ---- normal mode, intranode (kernels/normal_*.cu; Rust: src/ep/normal_gpu.rs) ----------------
 * Every rank owns one comm buffer (device memory, zeroed once). Peers write into it through
 * peer pointers (same process: plain device pointers; other processes: IPC mappings). Offsets
 * are the same on every rank (computed once in Rust from plan/normal.rs's NormalLayout):
 *   recv    [src R][slot spp] slot_bytes   chunks of records written by `src`
 *   flag    u64 [src R][slot spp]          written by `src`: cumulative chunk index + 1 (release)
 *   credit  u64 [dst R][slot spp]          written by `dst`: cumulative chunk index + 1 consumed
 *   notify  [src R] notify_bytes           u64 epoch | u32 num_tokens | u32 pad | u32 [L] counts
 *   ack     u64 [dst R]                    written by `dst`: last notify epoch it has read
 *   state   local only: u64 sent_base[R] | u64 recv_base[R] | u32 tickets[4] |
 *           u32 notify_tokens[R] | u32 notify_experts[R][L] | u32 consumed[R][spp]
 * NOTES: the queue of pair (s -> r) is a FIFO of chunks numbered cumulatively over the buffer's
 * life (dispatch and combine chunks of that pair continue one numbering); chunk c lives in slot
 * c % spp. Writer: wait credit[r][slot] >= c - spp + 1, write records, barrier, st.release.sys
 * flag = c + 1. Reader: ld.acquire flag >= c + 1, read records, barrier, st.release.sys
 * credit = c + 1. Payload is always written before the flag that publishes it and read after the
 * flag was observed; a slot is never rewritten before its credit came back. */
#define FEP_NORMAL_MAX_RANKS 8
#define FEP_NORMAL_THREADS 512         /* threads per block of dispatch / combine */
#define FEP_NORMAL_MAX_MOVERS 8        /* bulk-copy warps of a dispatch block, at most */
#define FEP_NORMAL_NOTIFY_THREADS 1024 /* threads per block of notify (one block per rank) */
#define FEP_NORMAL_PHASE_NOTIFY 1u
#define FEP_NORMAL_PHASE_DISPATCH_SEND 2u
#define FEP_NORMAL_PHASE_DISPATCH_RECV 3u
#define FEP_NORMAL_PHASE_COMBINE_SEND 4u
#define FEP_NORMAL_PHASE_COMBINE_RECV 5u

/* Normal mode through the proxy (peers on other nodes; src/ep/gpu/normal_proxy.rs). A peer whose
 * bit is set in `mask` is never addressed through peer_base: the sender stages a chunk in its
 * registered send region and pushes one ring command (RMA write + immediate); the receiver waits on
 * the proxy's arrival counter (mapped host memory) and reads the registered receive region;
 * credits go back as zero-length writes. Both regions share the host backend's geometry
 * (src/ep/host/mod.rs Geometry: data slots and two-deep notify records packed per MR chunk of
 * `stride` bytes). Immediate slot ids (value in the low `value_bits`):
 *   data   [0, R*spp)           id = src * spp + slot           value = rows
 *   notify [R*spp, +R)          id = R*spp + src                value = seq mod 2^value_bits
 *   credit [R*spp + R, +R*spp)  id = R*spp + R + src * spp + slot, value 1 (zero-length write)
 * Chunk c of a pair sits in slot c % spp (the numbering of the device queues): it has arrived
 * when arrivals[data(src, slot)] >= c / spp + 1, and its slot is free for chunk c when
 * arrivals[credit(dst, slot)] >= c / spp. */
typedef struct fep_normal_proxy {
    uint64_t ring;        /* GPU address: num_rings rings of ring_stride bytes (mapped host) */
    uint64_t send;        /* GPU address of this rank's registered send (staging) region */
    uint64_t recv;        /* GPU address of this rank's registered receive region */
    uint64_t arrivals;    /* GPU address of arrivals[0]; id i at + i * FEP_COUNTER_STRIDE (mapped host) */
    uint64_t stride;      /* MR chunk of the provider: no slot or record crosses a multiple */
    uint64_t notify_base; /* offset of the notify section in both regions */
    uint32_t mask;        /* bit p: peer p is reached through the proxy */
    uint32_t num_rings;   /* >= blocks of every normal kernel; block b pushes into ring b */
    uint32_t ring_capacity;
    uint32_t ring_stride; /* bytes from one ring header to the next */
    uint32_t value_bits;  /* immediate split (14) */
    uint32_t data_per_region;   /* data slots per MR chunk */
    uint32_t notify_per_region; /* notify records per MR chunk */
    uint32_t notify_bytes;      /* one record, plan/normal.rs NotifyRecord wire form [seq, tokens, L] */
} fep_normal_proxy; /* 80 bytes */

typedef struct fep_normal_comm {
    uint64_t peer_base[FEP_NORMAL_MAX_RANKS]; /* comm buffer of each rank, as this rank sees it */
    uint64_t recv_offset;
    uint64_t flag_offset;
    uint64_t credit_offset;
    uint64_t notify_offset;
    uint64_t ack_offset;
    uint64_t state_offset;
    uint64_t slot_bytes;          /* chunk_tokens * max(dispatch record, combine record) */
    uint64_t notify_bytes;        /* one notify record, 16-byte multiple */
    fep_dev_error_ref dev_error;
    uint64_t budget_cycles;       /* per bounded wait */
    uint32_t rank;
    uint32_t num_ranks;           /* <= FEP_NORMAL_MAX_RANKS */
    uint32_t slots_per_peer;
    uint32_t chunk_tokens;
    uint32_t num_local_experts;
    uint32_t _pad;
    fep_normal_proxy proxy;       /* peers on other nodes (ABI 3); mask 0: none */
} fep_normal_comm; /* 256 bytes */

/* What dispatch leaves for combine (and what a cached dispatch reuses), all device memory. */
typedef struct fep_normal_handle {
    uint64_t send_token_ids;     /* int32 [R][num_tokens]: tokens sent to each rank, in order */
    uint64_t send_pos;           /* int32 [num_tokens][R]: index in that list, or -1 */
    uint64_t send_counts;        /* int32 [R] */
    uint64_t rank_prefix;        /* int32 [R + 1]: rows received from src s start at [s] */
    uint64_t recv_expert_counts; /* int32 [L]: per local expert, rounded up to the alignment */
    int32_t num_tokens;          /* this rank's input tokens */
    int32_t _pad;
} fep_normal_handle; /* 48 bytes */

typedef struct fep_normal_notify_params {
    fep_normal_comm comm;
    fep_normal_handle handle;
    uint64_t is_token_in_rank;      /* uint8 [num_tokens][R] (layout output) */
    uint64_t num_tokens_per_expert; /* int32 [E] (layout output) */
    uint64_t epoch;                 /* 1, 2, ... per fresh dispatch (same on every rank) */
    int32_t expert_alignment;       /* >= 1 */
    int32_t out_capacity;           /* rows the receive outputs hold: more is an error */
    /* Mapped host memory (0: none) the last block also writes the totals into, for the host to
     * read without a stream synchronisation: int32 rank_prefix[R + 1] at byte 8, then int32
     * per-local-expert counts[L]; then the u64 at byte 0 is release-stored to `epoch`. */
    uint64_t host_counts;
} fep_normal_notify_params; /* 344 bytes */

typedef struct fep_normal_dispatch_params {
    fep_normal_comm comm;
    fep_normal_handle handle;
    uint64_t x;                 /* bf16 [T][H] or e4m3 [T][H] */
    uint64_t x_scales;          /* f32 [T][H/128] (fp8) or 0 */
    uint64_t topk_idx;          /* int64 [T][K] global ids, -1 = none */
    uint64_t topk_weights;      /* f32 [T][K] */
    uint64_t recv_x;            /* [out_rows][payload] */
    uint64_t recv_x_scales;     /* f32 [out_rows][H/128] (fp8) or 0 */
    uint64_t recv_topk_idx;     /* int64 [out_rows][K] local ids */
    uint64_t recv_topk_weights; /* f32 [out_rows][K] */
    uint64_t recv_src_idx;      /* int32 [out_rows] */
    int32_t out_rows;           /* rows of the outputs; rows past the received are padding */
    int32_t num_topk;
    uint32_t record_bytes;      /* plan/record.rs RecordLayout::normal_dispatch */
    uint32_t payload_bytes;
    uint32_t num_scales;        /* 0 for bf16 */
    uint32_t scales_offset;
    uint32_t topk_idx_offset;
    uint32_t topk_weights_offset;
    uint32_t src_idx_offset;
    /* Warps of a block that move row payloads with bulk copies through shared memory
     * (fep_tma.cuh), 1..FEP_NORMAL_MAX_MOVERS; 0: every warp copies rows through registers.
     * The kernel also falls back to registers when the launch has too little shared memory. */
    uint32_t bulk_movers;
} fep_normal_dispatch_params; /* 416 bytes */

typedef struct fep_normal_combine_params {
    fep_normal_comm comm;
    fep_normal_handle handle;
    uint64_t x;                 /* bf16 [rows][H]: this rank's processed received rows */
    uint64_t topk_weights;      /* f32 [rows][K] or 0 */
    uint64_t combined_x;        /* bf16 [T][H] */
    uint64_t combined_weights;  /* f32 [T][K] or 0 */
    int32_t hidden;
    int32_t num_topk;
    uint32_t record_bytes;      /* plan/record.rs RecordLayout::normal_combine */
    uint32_t topk_weights_offset;
} fep_normal_combine_params; /* 352 bytes */

#ifdef __cplusplus
static_assert(sizeof(fep_cmd) == 32, "fep_cmd layout");
static_assert(sizeof(fep_ring_hdr) == 128, "fep_ring_hdr layout");
static_assert(sizeof(fep_dev_error) == 32, "fep_dev_error layout");
static_assert(sizeof(fep_dev_error_ref) == 16, "fep_dev_error_ref layout");
static_assert(sizeof(fep_layout_params) == 96, "fep_layout_params layout");
static_assert(sizeof(fep_wait_test_params) == 56, "fep_wait_test_params layout");
static_assert(sizeof(fep_ring_push_test_params) == 72, "fep_ring_push_test_params layout");
static_assert(offsetof(fep_cmd, length) == 16 && offsetof(fep_cmd, seq) == 28, "fep_cmd fields");
static_assert(offsetof(fep_ring_hdr, tail) == 64, "fep_ring_hdr tail on its own line");
static_assert(offsetof(fep_dev_error, expected) == 16, "fep_dev_error fields");
static_assert(offsetof(fep_layout_params, num_tokens) == 64, "fep_layout_params fields");
static_assert(offsetof(fep_ring_push_test_params, capacity) == 48, "fep_ring_push_test_params");
static_assert(sizeof(fep_proxy_exchange_params) == 128, "fep_proxy_exchange_params layout");
static_assert(sizeof(fep_proxy_pingpong_params) == 120, "fep_proxy_pingpong_params layout");
static_assert(offsetof(fep_proxy_exchange_params, capacity) == 88, "fep_proxy_exchange_params");
static_assert(offsetof(fep_proxy_pingpong_params, cmd) == 64, "fep_proxy_pingpong_params fields");
static_assert(sizeof(fep_ll_peer) == 32, "fep_ll_peer layout");
static_assert(sizeof(fep_trace_clock_params) == 16, "fep_trace_clock_params layout");
static_assert(sizeof(fep_ll_dispatch_params) == 288, "fep_ll_dispatch_params layout");
static_assert(sizeof(fep_ll_combine_params) == 248, "fep_ll_combine_params layout");
static_assert(offsetof(fep_ll_dispatch_params, epoch) == 120, "fep_ll_dispatch_params fields");
static_assert(offsetof(fep_ll_combine_params, record_bytes) == 120, "fep_ll_combine_params fields");
static_assert(sizeof(fep_ll_proxy) == 64, "fep_ll_proxy layout");
static_assert(FEP_COUNTER_PACKED_OFFSET % 8 == 0 &&
                  FEP_COUNTER_PACKED_OFFSET + 8 <= FEP_COUNTER_STRIDE,
              "the packed counter word sits inside its slot's line");
static_assert(sizeof(fep_normal_comm) == 256, "fep_normal_comm layout");
static_assert(sizeof(fep_normal_handle) == 48, "fep_normal_handle layout");
static_assert(sizeof(fep_normal_notify_params) == 344, "fep_normal_notify_params layout");
static_assert(sizeof(fep_normal_dispatch_params) == 416, "fep_normal_dispatch_params layout");
static_assert(sizeof(fep_normal_combine_params) == 352, "fep_normal_combine_params layout");
static_assert(offsetof(fep_normal_comm, dev_error) == 128, "fep_normal_comm fields");
static_assert(sizeof(fep_normal_proxy) == 80, "fep_normal_proxy layout");
static_assert(offsetof(fep_normal_comm, proxy) == 176, "fep_normal_comm proxy");
#endif

#include "fep_baseline.h"

#endif /* FEP_ABI_H */
