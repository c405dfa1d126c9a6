/* fabric-ep C example: a normal-mode dispatch/combine round trip on the host backend.
 *
 * Against an installed library (`make install PREFIX=/opt/fabric-ep`):
 *   export PKG_CONFIG_PATH=/opt/fabric-ep/lib/pkgconfig
 *   cc -std=c11 ffi/examples/roundtrip.c $(pkg-config --cflags --libs fabric_ep) -o roundtrip
 *   cc -std=c11 ffi/examples/roundtrip.c $(pkg-config --cflags --libs fabric_ep-static) -o roundtrip_static
 *   ./roundtrip 4            # forks 4 ranks on this machine, provider shm
 * fabric_ep.pc's Libs carry -Wl,-rpath to the prefix, so no LD_LIBRARY_PATH is needed; CMake:
 * ffi/examples/CMakeLists.txt. Against the build tree (`make lib`, which also makes the
 * libfabric_ep.so.0 link the program records):
 *   cc -std=c11 -I ffi/include ffi/examples/roundtrip.c -L target/release -lfabric_ep \
 *      -Wl,-rpath,$PWD/target/release -o roundtrip
 *
 * Each rank dispatches its tokens, returns what it received unchanged, and checks that combine
 * gives back x times the number of distinct ranks each token went to (DeepEP's identity check).
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

enum { TOKENS = 24, HIDDEN = 256, TOPK = 2, EXPERTS = 16 };

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

static int run_rank(int rank, int ranks) {
    fep_config cfg;
    fep_config_init(&cfg);
    cfg.rank = rank;
    cfg.num_ranks = ranks;
    cfg.num_experts = EXPERTS;
    cfg.hidden = HIDDEN;
    cfg.num_topk = TOPK;
    cfg.max_tokens_per_rank = 32;
    cfg.timeout_s = 30.0;
    cfg.provider = "shm";

    fep_size_hints hints;
    CHECK(fep_get_size_hints(&cfg, &hints));
    fep_buffer *buf = NULL;
    CHECK(fep_buffer_create(&cfg, NULL, NULL, &buf)); /* torchrun-style env vars */

    static uint16_t x[TOKENS * HIDDEN];
    static int64_t idx[TOKENS * TOPK];
    static float w[TOKENS * TOPK];
    for (int t = 0; t < TOKENS; t++) {
        for (int h = 0; h < HIDDEN; h++) x[t * HIDDEN + h] = f2bf((float)((rank * 7 + t * 3 + h) % 17) - 8.0f);
        idx[t * TOPK + 0] = (t * 5 + rank) % EXPERTS;
        idx[t * TOPK + 1] = (t % 4 == 3) ? -1 : (t * 3 + rank + 1) % EXPERTS; /* some "no expert" */
        w[t * TOPK + 0] = 0.75f;
        w[t * TOPK + 1] = 0.25f;
    }
    fep_tensor tx = {x, FEP_DTYPE_BF16, 2, {TOKENS, HIDDEN}};
    fep_tensor ti = {idx, FEP_DTYPE_I64, 2, {TOKENS, TOPK}};
    fep_tensor tw = {w, FEP_DTYPE_F32, 2, {TOKENS, TOPK}};

    fep_handle *h = NULL;
    int64_t rows = 0;
    CHECK(fep_dispatch(buf, &tx, NULL, &ti, &tw, NULL, 1, 0, NULL, &h, &rows));
    uint16_t *recv_x = calloc((size_t)(rows ? rows : 1) * HIDDEN, 2);
    int64_t *recv_idx = calloc((size_t)(rows ? rows : 1) * TOPK, 8);
    int32_t per_expert[EXPERTS];
    fep_tensor trx = {recv_x, FEP_DTYPE_BF16, 2, {rows, HIDDEN}};
    fep_tensor tri = {recv_idx, FEP_DTYPE_I64, 2, {rows, TOPK}};
    fep_tensor tpe = {per_expert, FEP_DTYPE_I32, 1, {EXPERTS / ranks}};
    CHECK(fep_handle_copy_out(h, &trx, NULL, &tri, NULL, &tpe));

    static uint16_t combined[TOKENS * HIDDEN];
    fep_tensor tc = {combined, FEP_DTYPE_BF16, 2, {TOKENS, HIDDEN}};
    CHECK(fep_combine(buf, h, &trx, NULL, &tc, NULL, NULL));

    int bad = 0;
    for (int t = 0; t < TOKENS && !bad; t++) {
        int dests = 0;
        for (int r = 0; r < ranks; r++) {
            int hit = 0;
            for (int k = 0; k < TOPK; k++) {
                int64_t e = idx[t * TOPK + k];
                if (e >= 0 && e / (EXPERTS / ranks) == r) hit = 1;
            }
            dests += hit;
        }
        for (int hh = 0; hh < HIDDEN; hh++) {
            float want = bf2f(x[t * HIDDEN + hh]) * (float)dests;
            if (bf2f(combined[t * HIDDEN + hh]) != want) {
                fprintf(stderr, "rank %d token %d ch %d: got %g want %g\n", rank, t, hh,
                        bf2f(combined[t * HIDDEN + hh]), want);
                bad = 1;
                break;
            }
        }
    }
    /* Low-latency round trip with the receive hook: dispatch sends, the hook receives; each
     * expert returns its rows unchanged, so combine must give x * (sum of the valid weights). */
    {
        int local = EXPERTS / ranks, slots = ranks * 32;
        fep_ll_op *d = NULL, *c = NULL;
        CHECK(fep_low_latency_dispatch(buf, &tx, &ti, false, false, true, NULL, &d));
        CHECK(fep_ll_op_complete(buf, d)); /* the hook */
        uint16_t *ll_x = calloc((size_t)local * slots * HIDDEN, 2);
        int32_t *cnt = calloc((size_t)local, 4);
        fep_tensor tlx = {ll_x, FEP_DTYPE_BF16, 3, {local, slots, HIDDEN}};
        fep_tensor tcnt = {cnt, FEP_DTYPE_I32, 1, {local}};
        CHECK(fep_ll_dispatch_copy_out(d, &tlx, NULL, &tcnt, NULL, NULL, NULL));
        CHECK(fep_low_latency_combine(buf, d, &tlx, &ti, &tw, false, NULL, &c));
        static uint16_t ll_out[TOKENS * HIDDEN];
        fep_tensor tlo = {ll_out, FEP_DTYPE_BF16, 2, {TOKENS, HIDDEN}};
        CHECK(fep_ll_combine_copy_out(c, &tlo));
        for (int t = 0; t < TOKENS && !bad; t++) {
            float wsum = 0.0f;
            for (int k = 0; k < TOPK; k++)
                if (idx[t * TOPK + k] >= 0) wsum += w[t * TOPK + k];
            for (int hh = 0; hh < HIDDEN; hh++) {
                float want = bf2f(x[t * HIDDEN + hh]) * wsum;
                if (bf2f(ll_out[t * HIDDEN + hh]) != want) {
                    fprintf(stderr, "rank %d LL token %d ch %d: got %g want %g\n", rank, t, hh,
                            bf2f(ll_out[t * HIDDEN + hh]), want);
                    bad = 1;
                    break;
                }
            }
        }
        fep_ll_op_destroy(d);
        fep_ll_op_destroy(c);
        free(ll_x);
        free(cnt);
    }
    /* A bad argument is an error naming it, not a crash. */
    fep_tensor wrong = tx;
    wrong.dtype = FEP_DTYPE_F32;
    fep_handle *h2 = NULL;
    fep_status s = fep_dispatch(buf, &wrong, NULL, &ti, &tw, NULL, 1, 0, NULL, &h2, &rows);
    if (s != FEP_ERR_INVALID_ARGUMENT || strstr(fep_last_error(), "`x`") == NULL) {
        fprintf(stderr, "rank %d: expected an invalid-argument error naming x, got %d: %s\n", rank, s,
                fep_last_error());
        bad = 1;
    }
    fep_handle_destroy(h);
    CHECK(fep_buffer_destroy(buf));
    free(recv_x);
    free(recv_idx);
    if (!bad)
        printf("rank %d: %lld rows received, combine == x * destinations for %d tokens, low-latency combine == x * weights (normal buffer %llu bytes)\n",
               rank, (long long)rows, TOKENS, (unsigned long long)hints.normal_bytes);
    return bad;
}

static int free_port(void) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {0};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof a) != 0 || getsockname(fd, (struct sockaddr *)&a, &len) != 0)
        return 29511;
    int port = ntohs(a.sin_port);
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
    char port[16], job[32];
    snprintf(port, sizeof port, "%d", free_port());
    snprintf(job, sizeof job, "c-example-%d", (int)getpid());
    setenv("MASTER_ADDR", "127.0.0.1", 1);
    setenv("FEP_MASTER_PORT", port, 1);
    setenv("MASTER_PORT", port, 1);
    setenv("FEP_JOB_ID", job, 1);
    char buf[16];
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
