/* fabric-ep C example: DeepEP's per-call shape on one object (fep_ep), host backend.
 *
 * DeepEP sizes one Buffer from byte counts and takes the model shape with each call; a fabric-ep
 * buffer is laid out for one shape. A fep_ep is created once from DeepEP's arguments
 * (num_nvl_bytes, num_rdma_bytes, low_latency_mode), sized here with fep_ep_need_bytes, and
 * hands out the native buffer of each shape: created on the shape's first request (on every rank
 * at once: every rank makes the same calls in the same order), the same buffer after. This
 * program uses two normal-mode shapes (hidden 256 top-2, hidden 512 top-4) and a low-latency
 * one on one object, checks each round trip, and shows a shape over the capacity refused.
 *
 * Build as roundtrip.c (pkg-config fabric_ep or fabric_ep-static, or CMake), then
 *   ./ep_shapes 4            # forks 4 ranks on this machine, provider shm
 * Exit status 0 when every rank checked out. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/wait.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include "fabric_ep.h"

enum { TOKENS = 24, EXPERTS = 16, LL_TOKENS = 32 };

static uint16_t f2bf(float f) { uint32_t u; memcpy(&u, &f, 4); return (uint16_t)(u >> 16); } /* exact for the values used */
static float bf2f(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }

#define CHECK(call)                                                                                \
    do {                                                                                           \
        fep_status s_ = (call);                                                                    \
        if (s_ != FEP_OK) {                                                                        \
            fprintf(stderr, "rank %d: %s -> %s: %s\n", rank, #call, fep_status_string(s_),        \
                    fep_last_error());                                                             \
            return 1;                                                                              \
        }                                                                                          \
    } while (0)

/* The inputs of one shape: tokens of hidden `hidden`, top-`topk` routing with some -1. */
static void fill(int rank, int hidden, int topk, uint16_t *x, int64_t *idx, float *w) {
    for (int t = 0; t < TOKENS; t++) {
        for (int h = 0; h < hidden; h++) x[t * hidden + h] = f2bf((float)((rank * 7 + t * 3 + h) % 17) - 8.0f);
        for (int k = 0; k < topk; k++) {
            idx[t * topk + k] = (t % 5 == 4 && k == topk - 1) ? -1 : (t * 5 + rank + k * 3) % EXPERTS;
            w[t * topk + k] = 1.0f / (float)(k + 1);
        }
    }
}

/* Normal mode on `buf` (a buffer of shape hidden/topk): dispatch, return the rows unchanged,
 * combine; the result must be x times the number of distinct ranks each token went to. */
static int normal_round(fep_buffer *buf, int rank, int ranks, int hidden, int topk) {
    uint16_t *x = calloc((size_t)TOKENS * hidden, 2), *combined = calloc((size_t)TOKENS * hidden, 2);
    int64_t *idx = calloc((size_t)TOKENS * topk, 8);
    float *w = calloc((size_t)TOKENS * topk, 4);
    fill(rank, hidden, topk, x, idx, w);
    fep_tensor tx = {x, FEP_DTYPE_BF16, 2, {TOKENS, hidden}};
    fep_tensor ti = {idx, FEP_DTYPE_I64, 2, {TOKENS, topk}};
    fep_tensor tw = {w, FEP_DTYPE_F32, 2, {TOKENS, topk}};
    fep_handle *h = NULL;
    int64_t rows = 0;
    CHECK(fep_dispatch(buf, &tx, NULL, &ti, &tw, NULL, 1, 0, NULL, &h, &rows));
    uint16_t *recv_x = calloc((size_t)(rows ? rows : 1) * hidden, 2);
    fep_tensor trx = {recv_x, FEP_DTYPE_BF16, 2, {rows, hidden}};
    CHECK(fep_handle_copy_out(h, &trx, NULL, NULL, NULL, NULL));
    fep_tensor tc = {combined, FEP_DTYPE_BF16, 2, {TOKENS, hidden}};
    CHECK(fep_combine(buf, h, &trx, NULL, &tc, NULL, NULL));
    fep_handle_destroy(h);
    int bad = 0;
    for (int t = 0; t < TOKENS && !bad; t++) {
        int dests = 0;
        for (int r = 0; r < ranks; r++) {
            int hit = 0;
            for (int k = 0; k < topk; k++)
                if (idx[t * topk + k] >= 0 && idx[t * topk + k] / (EXPERTS / ranks) == r) hit = 1;
            dests += hit;
        }
        for (int c = 0; c < hidden; c++) {
            float want = bf2f(x[t * hidden + c]) * (float)dests;
            if (bf2f(combined[t * hidden + c]) != want) {
                fprintf(stderr, "rank %d hidden %d token %d ch %d: got %g want %g\n", rank, hidden, t,
                        c, bf2f(combined[t * hidden + c]), want);
                bad = 1;
                break;
            }
        }
    }
    free(x);
    free(combined);
    free(idx);
    free(w);
    free(recv_x);
    return bad;
}

/* Low latency on `buf`: every expert returns its rows unchanged, so combine must give x times
 * the sum of the valid weights. */
static int ll_round(fep_buffer *buf, int rank, int ranks, int hidden, int topk) {
    int local = EXPERTS / ranks, slots = ranks * LL_TOKENS;
    uint16_t *x = calloc((size_t)TOKENS * hidden, 2), *out = calloc((size_t)TOKENS * hidden, 2);
    int64_t *idx = calloc((size_t)TOKENS * topk, 8);
    float *w = calloc((size_t)TOKENS * topk, 4);
    uint16_t *ll_x = calloc((size_t)local * slots * hidden, 2);
    fill(rank, hidden, topk, x, idx, w);
    fep_tensor tx = {x, FEP_DTYPE_BF16, 2, {TOKENS, hidden}};
    fep_tensor ti = {idx, FEP_DTYPE_I64, 2, {TOKENS, topk}};
    fep_tensor tw = {w, FEP_DTYPE_F32, 2, {TOKENS, topk}};
    fep_ll_op *d = NULL, *c = NULL;
    CHECK(fep_low_latency_dispatch(buf, &tx, &ti, false, false, false, NULL, &d));
    fep_tensor tlx = {ll_x, FEP_DTYPE_BF16, 3, {local, slots, hidden}};
    CHECK(fep_ll_dispatch_copy_out(d, &tlx, NULL, NULL, NULL, NULL, NULL));
    CHECK(fep_low_latency_combine(buf, d, &tlx, &ti, &tw, false, NULL, &c));
    fep_tensor to = {out, FEP_DTYPE_BF16, 2, {TOKENS, hidden}};
    CHECK(fep_ll_combine_copy_out(c, &to));
    fep_ll_op_destroy(d);
    fep_ll_op_destroy(c);
    int bad = 0;
    for (int t = 0; t < TOKENS && !bad; t++) {
        float wsum = 0.0f;
        for (int k = 0; k < topk; k++)
            if (idx[t * topk + k] >= 0) wsum += w[t * topk + k];
        for (int ch = 0; ch < hidden; ch++) {
            float want = bf2f(x[t * hidden + ch]) * wsum;
            if (bf2f(out[t * hidden + ch]) != bf2f(f2bf(want))) {
                fprintf(stderr, "rank %d LL token %d ch %d: got %g want %g\n", rank, t, ch,
                        bf2f(out[t * hidden + ch]), want);
                bad = 1;
                break;
            }
        }
    }
    free(x);
    free(out);
    free(idx);
    free(w);
    free(ll_x);
    return bad;
}

static int run_rank(int rank, int ranks) {
    fep_ep_config cfg;
    fep_ep_config_init(&cfg);
    cfg.low_latency_mode = 1;
    cfg.timeout_s = 30.0;
    cfg.provider = "shm";

    /* DeepEP's size hints: the bytes of each shape this job will use. */
    uint64_t need_a = 0, need_b = 0, need_ll = 0;
    CHECK(fep_ep_need_bytes(&cfg, ranks, FEP_MODE_NORMAL, EXPERTS, 256, 2, FEP_DTYPE_BF16, 0, &need_a));
    CHECK(fep_ep_need_bytes(&cfg, ranks, FEP_MODE_NORMAL, EXPERTS, 512, 4, FEP_DTYPE_BF16, 0, &need_b));
    CHECK(fep_ep_need_bytes(&cfg, ranks, FEP_MODE_LOW_LATENCY, EXPERTS, 256, 2, FEP_DTYPE_BF16, LL_TOKENS,
                            &need_ll));
    cfg.num_nvl_bytes = (int64_t)(need_a > need_b ? need_a : need_b);
    cfg.num_rdma_bytes = (int64_t)need_ll;

    fep_ep *ep = NULL;
    CHECK(fep_ep_create(&cfg, NULL, NULL, &ep)); /* torchrun-style env vars: the store, joined once */

    fep_buffer *a = NULL, *b = NULL, *again = NULL, *ll = NULL;
    CHECK(fep_ep_buffer(ep, FEP_MODE_NORMAL, EXPERTS, 256, 2, FEP_DTYPE_BF16, 0, &a));
    int bad = normal_round(a, rank, ranks, 256, 2);
    CHECK(fep_ep_buffer(ep, FEP_MODE_NORMAL, EXPERTS, 512, 4, FEP_DTYPE_BF16, 0, &b));
    bad |= normal_round(b, rank, ranks, 512, 4);
    CHECK(fep_ep_buffer(ep, FEP_MODE_LOW_LATENCY, EXPERTS, 256, 2, FEP_DTYPE_BF16, LL_TOKENS, &ll));
    bad |= ll_round(ll, rank, ranks, 256, 2);
    /* The first shape again: its buffer, nothing created. */
    CHECK(fep_ep_buffer(ep, FEP_MODE_NORMAL, EXPERTS, 256, 2, FEP_DTYPE_BF16, 0, &again));
    if (again != a) {
        fprintf(stderr, "rank %d: the first shape asked again got another buffer\n", rank);
        bad = 1;
    }
    bad |= normal_round(a, rank, ranks, 256, 2);

    /* A shape needing more than the object was sized for is refused, naming the argument. */
    fep_buffer *big = NULL;
    fep_status s = fep_ep_buffer(ep, FEP_MODE_NORMAL, EXPERTS, 7168, 8, FEP_DTYPE_BF16, 0, &big);
    if (s != FEP_ERR_INVALID_ARGUMENT || strstr(fep_last_error(), "num_nvl_bytes") == NULL || big) {
        fprintf(stderr, "rank %d: expected a refusal naming num_nvl_bytes, got %d: %s\n", rank, s,
                fep_last_error());
        bad = 1;
    }
    /* The object owns its buffers: fep_ep_destroy frees them, fep_buffer_destroy is refused. */
    if (fep_buffer_destroy(a) != FEP_ERR_INVALID_ARGUMENT) {
        fprintf(stderr, "rank %d: fep_buffer_destroy of an object's buffer was accepted\n", rank);
        bad = 1;
    }
    int32_t nbuf = 0;
    CHECK(fep_ep_info(ep, NULL, NULL, NULL, &nbuf, NULL));
    CHECK(fep_ep_destroy(ep));
    if (nbuf != 3) {
        fprintf(stderr, "rank %d: %d buffers, expected 3\n", rank, nbuf);
        bad = 1;
    }
    if (!bad)
        printf("rank %d: %d shapes on one fep_ep (normal %llu / %llu bytes, low latency %llu), every round trip checked\n",
               rank, nbuf, (unsigned long long)need_a, (unsigned long long)need_b,
               (unsigned long long)need_ll);
    return bad;
}

static int free_port(void) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {0};
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof sa;
    if (fd < 0 || bind(fd, (struct sockaddr *)&sa, sizeof sa) != 0 || getsockname(fd, (struct sockaddr *)&sa, &len) != 0)
        return 29521;
    int port = ntohs(sa.sin_port);
    close(fd);
    return port;
}

int main(int argc, char **argv) {
    int ranks = argc > 1 ? atoi(argv[1]) : 2;
    if (ranks < 1 || EXPERTS % ranks != 0) {
        fprintf(stderr, "usage: %s RANKS (a divisor of %d)\n", argv[0], EXPERTS);
        return 2;
    }
    if (fep_abi_version() != FEP_ABI_VERSION) {
        fprintf(stderr, "header/library ABI mismatch\n");
        return 2;
    }
    char port[16], job[32], buf[16];
    snprintf(port, sizeof port, "%d", free_port());
    snprintf(job, sizeof job, "c-ep-shapes-%d", (int)getpid());
    setenv("MASTER_ADDR", "127.0.0.1", 1);
    setenv("FEP_MASTER_PORT", port, 1);
    setenv("MASTER_PORT", port, 1);
    setenv("FEP_JOB_ID", job, 1);
    snprintf(buf, sizeof buf, "%d", ranks);
    setenv("WORLD_SIZE", buf, 1);
    setenv("LOCAL_WORLD_SIZE", buf, 1);
    for (int r = 0; r < ranks; r++) {
        pid_t pid = fork();
        if (pid == 0) {
            snprintf(buf, sizeof buf, "%d", r);
            setenv("RANK", buf, 1);
            setenv("LOCAL_RANK", buf, 1);
            int rc = run_rank(r, ranks);
            fflush(stdout);
            fflush(stderr);
            _exit(rc);
        }
    }
    int failed = 0;
    for (int r = 0; r < ranks; r++) {
        int st = 0;
        wait(&st);
        if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) failed++;
    }
    if (failed) fprintf(stderr, "%d of %d ranks failed\n", failed, ranks);
    else printf("ok: %d ranks\n", ranks);
    return failed ? 1 : 0;
}
