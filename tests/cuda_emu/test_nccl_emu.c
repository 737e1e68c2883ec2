/* The NCCL emulation (emu_nccl.c) itself, which test_cuda_comm and
 * test_cuda_ranks rely on: ranks are forked processes of this test (no MPI),
 * linked against the emulation directly, with the emulated device's module
 * loaded (SPOTUNE_CUDA_MODULE) as it must be.
 *  - every collective the project calls against its definition, on 3 ranks,
 *    sizes of 1 element and of more than one chunk (256 KiB), in place and
 *    not: sums in rank order, bit for bit (the same float additions in the
 *    same order; bf16 summed in float and rounded once), average, max, a
 *    reduce to a root (the others' buffers untouched), broadcast,
 *    reduce-scatter, all-gather, and calls held by a (nested) group;
 *  - bad calls: a datatype or root it does not emulate, a group end
 *    without a start, a unique id not its own, ranks that disagree on the
 *    rank count, and any use without the emulated module: refused with a
 *    message;
 *  - a peer that never comes (at init, or at a collective) is an error
 *    after SPOTUNE_NCCL_EMU_TIMEOUT_S, not a hang, and the communicator
 *    refuses further work; a peer's ncclCommAbort ends the wait at once;
 *    no shared-memory segment is left behind. */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <dlfcn.h>
#include <math.h>
#include <nccl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

TestSuite(nccl_emu, .timeout = 120);

static void load_module(void)
{
    const char *m = getenv("SPOTUNE_CUDA_MODULE");
    cr_assert(m && *m, "SPOTUNE_CUDA_MODULE names no module");
    cr_assert(dlopen(m, RTLD_LAZY | RTLD_GLOBAL), "%s", dlerror());
}

typedef int (*rank_fn)(int rank, int nranks, ncclUniqueId id);

/* Forks nranks processes running fn; each one's exit status into st. */
static void run_ranks(int nranks, rank_fn fn, ncclUniqueId id, int *st)
{
    pid_t pid[8];
    for (int r = 0; r < nranks; r++) {
        pid[r] = fork();
        cr_assert_geq(pid[r], 0, "fork");
        if (pid[r] == 0)
            _exit(fn(r, nranks, id));
    }
    for (int r = 0; r < nranks; r++) {
        int w = 0;
        cr_assert_eq(waitpid(pid[r], &w, 0), pid[r]);
        st[r] = WIFEXITED(w) ? WEXITSTATUS(w) : 128 + WTERMSIG(w);
    }
}

static ncclUniqueId new_id(void)
{
    ncclUniqueId id;
    cr_assert_eq(ncclGetUniqueId(&id), ncclSuccess);
    return id;
}

/* No segment of this id left in /dev/shm. */
static void expect_no_segment(const ncclUniqueId *id)
{
    char path[256];
    snprintf(path, sizeof path, "/dev/shm/%.120s", id->internal);
    cr_expect_neq(access(path, F_OK), 0, "%s was left behind", path);
}

/* fn on nranks forked ranks of a new communicator, with the emulation's
 * timeout (NULL: its default): every rank must exit 0, and nothing may be
 * left in /dev/shm. */
static void expect_ranks_pass(int nranks, rank_fn fn, const char *timeout_s)
{
    load_module();
    if (timeout_s)
        setenv("SPOTUNE_NCCL_EMU_TIMEOUT_S", timeout_s, 1);
    ncclUniqueId id = new_id();
    int st[8];
    run_ranks(nranks, fn, id, st);
    for (int r = 0; r < nranks; r++)
        cr_expect_eq(st[r], 0, "rank %d failed (its messages above)", r);
    expect_no_segment(&id);
}

/* ---- collectives against their definitions ----------------------------------------- */

#define N 70001 /* f32 elements: more than one 256 KiB chunk */
#define NB 140003 /* bf16 elements: likewise */

static int fails;

#define CHECK(cond, ...)                                                                         \
    do {                                                                                         \
        if (!(cond)) {                                                                           \
            fprintf(stderr, __VA_ARGS__);                                                        \
            fprintf(stderr, "\n");                                                               \
            fails++;                                                                             \
        }                                                                                        \
    } while (0)

/* A value whose float sum over the ranks depends on their order. */
static float val(int r, size_t i)
{
    return (float)((int)((i * 13 + (size_t)r * 7) % 101) - 50) * 0.37f + 1e-3f * (float)r +
           (float)i * 1e-7f;
}

static uint16_t to_bf16(float f) /* round to nearest even */
{
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static float from_bf16(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static float sum_in_order(int nranks, size_t i)
{
    float acc = val(0, i);
    for (int r = 1; r < nranks; r++)
        acc += val(r, i);
    return acc;
}

static void same_bits(const char *what, const float *got, int nranks, size_t n, float scale,
                      int avg)
{
    size_t bad = 0, first = 0;
    for (size_t i = 0; i < n; i++) {
        float want = sum_in_order(nranks, i);
        want = avg ? want / (float)nranks : want * scale;
        if (memcmp(&got[i], &want, 4) != 0 && bad++ == 0)
            first = i;
    }
    CHECK(bad == 0, "%s: %zu of %zu values differ, first at %zu: %.9g", what, bad, n, first,
          (double)got[first]);
}

static int collectives_rank(int rank, int nranks, ncclUniqueId id)
{
    ncclComm_t c;
    ncclResult_t r = ncclCommInitRank(&c, nranks, id, rank);
    if (r != ncclSuccess) {
        fprintf(stderr, "rank %d: init: %s\n", rank, ncclGetLastError(NULL));
        return 1;
    }
    float *a = malloc(sizeof(float) * N * nranks), *b = malloc(sizeof(float) * N * nranks);
    uint16_t *h = malloc(sizeof(uint16_t) * NB);
    int32_t *k = malloc(sizeof(int32_t) * N);

    /* all-reduce: sum in place (1 element, then N), average out of place */
    for (size_t len = 1; len <= N; len += N - 1) {
        for (size_t i = 0; i < len; i++)
            a[i] = val(rank, i);
        CHECK(ncclAllReduce(a, a, len, ncclFloat32, ncclSum, c, NULL) == ncclSuccess, "sum");
        same_bits(len == 1 ? "all-reduce sum, 1 element" : "all-reduce sum in place", a, nranks,
                  len, 1.0f, 0);
    }
    for (size_t i = 0; i < N; i++)
        a[i] = val(rank, i);
    CHECK(ncclAllReduce(a, b, N, ncclFloat32, ncclAvg, c, NULL) == ncclSuccess, "avg");
    same_bits("all-reduce average", b, nranks, N, 1.0f, 1);
    /* max over int32 */
    for (size_t i = 0; i < N; i++)
        k[i] = (int32_t)((i * 31 + (size_t)rank * 17) % 97) - 40;
    CHECK(ncclAllReduce(k, k, N, ncclInt32, ncclMax, c, NULL) == ncclSuccess, "max");
    size_t bad = 0;
    for (size_t i = 0; i < N; i++) {
        int32_t want = -1000;
        for (int q = 0; q < nranks; q++) {
            int32_t v = (int32_t)((i * 31 + (size_t)q * 17) % 97) - 40;
            want = v > want ? v : want;
        }
        bad += k[i] != want;
    }
    CHECK(bad == 0, "all-reduce max int32: %zu values differ", bad);
    /* bf16: summed in float in rank order, rounded once */
    for (size_t i = 0; i < NB; i++)
        h[i] = to_bf16(val(rank, i));
    CHECK(ncclAllReduce(h, h, NB, ncclBfloat16, ncclSum, c, NULL) == ncclSuccess, "bf16");
    bad = 0;
    for (size_t i = 0; i < NB; i++) {
        float acc = from_bf16(to_bf16(val(0, i)));
        for (int q = 1; q < nranks; q++)
            acc += from_bf16(to_bf16(val(q, i)));
        bad += h[i] != to_bf16(acc);
    }
    CHECK(bad == 0, "all-reduce bf16: %zu values differ from one rounding of the float sum", bad);

    /* reduce to root 1: the root gets the sum, the others' buffers untouched */
    for (size_t i = 0; i < N; i++)
        a[i] = val(rank, i), b[i] = -7.0f;
    CHECK(ncclReduce(a, b, N, ncclFloat32, ncclSum, 1, c, NULL) == ncclSuccess, "reduce");
    if (rank == 1) {
        same_bits("reduce to root 1", b, nranks, N, 1.0f, 0);
    } else {
        bad = 0;
        for (size_t i = 0; i < N; i++)
            bad += b[i] != -7.0f;
        CHECK(bad == 0, "reduce: rank %d's receive buffer changed (%zu values)", rank, bad);
    }

    /* broadcast from the last rank, in place */
    for (size_t i = 0; i < N; i++)
        a[i] = val(rank, i);
    CHECK(ncclBroadcast(a, a, N, ncclFloat32, nranks - 1, c, NULL) == ncclSuccess, "bcast");
    bad = 0;
    for (size_t i = 0; i < N; i++)
        bad += a[i] != val(nranks - 1, i);
    CHECK(bad == 0, "broadcast: %zu values are not the root's", bad);

    /* reduce-scatter: block q of every rank's buffer summed into rank q */
    for (int q = 0; q < nranks; q++)
        for (size_t i = 0; i < N; i++)
            a[(size_t)q * N + i] = val(rank, (size_t)q * N + i);
    CHECK(ncclReduceScatter(a, b, N, ncclFloat32, ncclSum, c, NULL) == ncclSuccess, "rs");
    bad = 0;
    for (size_t i = 0; i < N; i++) {
        float want = sum_in_order(nranks, (size_t)rank * N + i);
        bad += memcmp(&b[i], &want, 4) != 0;
    }
    CHECK(bad == 0, "reduce-scatter: %zu values of rank %d's block differ", bad, rank);

    /* all-gather in place: rank q's block at q * N */
    for (size_t i = 0; i < N * (size_t)nranks; i++)
        a[i] = -1.0f;
    for (size_t i = 0; i < N; i++)
        a[(size_t)rank * N + i] = val(rank, i);
    CHECK(ncclAllGather(a + (size_t)rank * N, a, N, ncclFloat32, c, NULL) == ncclSuccess, "ag");
    bad = 0;
    for (int q = 0; q < nranks; q++)
        for (size_t i = 0; i < N; i++)
            bad += a[(size_t)q * N + i] != val(q, i);
    CHECK(bad == 0, "all-gather in place: %zu values differ", bad);

    /* a nested group holds both calls until its outer end */
    for (size_t i = 0; i < N; i++)
        a[i] = val(rank, i), b[i] = val(rank, i);
    CHECK(ncclGroupStart() == ncclSuccess && ncclGroupStart() == ncclSuccess, "group start");
    CHECK(ncclAllReduce(a, a, N, ncclFloat32, ncclSum, c, NULL) == ncclSuccess, "held 1");
    CHECK(ncclAllReduce(b, b, 1, ncclFloat32, ncclSum, c, NULL) == ncclSuccess, "held 2");
    CHECK(ncclGroupEnd() == ncclSuccess, "inner end");
    CHECK(a[0] == val(rank, 0), "the inner group end ran a held call");
    CHECK(ncclGroupEnd() == ncclSuccess, "outer end");
    same_bits("grouped all-reduce 1", a, nranks, N, 1.0f, 0);
    same_bits("grouped all-reduce 2", b, nranks, 1, 1.0f, 0);
    CHECK(ncclGroupEnd() == ncclInvalidUsage, "a group end without a start is refused");

    /* what it does not emulate: refused, with a message, and nothing waits */
    CHECK(ncclAllReduce(a, a, 4, ncclFloat16, ncclSum, c, NULL) == ncclInvalidArgument, "fp16");
    CHECK(strstr(ncclGetLastError(c), "not emulated") != NULL, "fp16: %s", ncclGetLastError(c));
    CHECK(ncclReduce(a, a, 4, ncclFloat32, ncclSum, nranks, c, NULL) == ncclInvalidArgument,
          "a root past the last rank");
    CHECK(ncclCommFinalize(c) == ncclSuccess, "finalize");
    CHECK(ncclCommDestroy(c) == ncclSuccess, "destroy");
    free(a), free(b), free(h), free(k);
    return fails ? 1 : 0;
}

Test(nccl_emu, collectives_match_their_definitions_on_three_ranks)
{
    expect_ranks_pass(3, collectives_rank, NULL);
}

/* A non-blocking communicator answers "in progress", then success. */
static int nonblocking_rank(int rank, int nranks, ncclUniqueId id)
{
    ncclComm_t c;
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    CHECK(ncclCommInitRankConfig(&c, nranks, id, rank, &cfg) == ncclInProgress, "init");
    ncclResult_t state = ncclInternalError;
    CHECK(ncclCommGetAsyncError(c, &state) == ncclSuccess && state == ncclSuccess, "async");
    float x = (float)rank + 1.0f;
    CHECK(ncclAllReduce(&x, &x, 1, ncclFloat32, ncclSum, c, NULL) == ncclInProgress, "sum");
    CHECK(x == 3.0f, "sum %g", (double)x);
    ncclCommDestroy(c);
    return fails ? 1 : 0;
}

Test(nccl_emu, a_nonblocking_communicator_answers_in_progress)
{
    expect_ranks_pass(2, nonblocking_rank, NULL);
}

/* ---- bad use ----------------------------------------------------------------------------- */

Test(nccl_emu, refused_without_the_emulated_module)
{
    ncclComm_t c = NULL;
    ncclUniqueId id = new_id();
    cr_expect_eq(ncclCommInitRank(&c, 1, id, 0), ncclInvalidUsage);
    cr_expect(strstr(ncclGetLastError(NULL), "emulated CUDA device"), "%s",
              ncclGetLastError(NULL));
    cr_expect_null(c);
}

Test(nccl_emu, a_foreign_unique_id_and_bad_ranks_are_refused)
{
    load_module();
    ncclComm_t c = NULL;
    ncclUniqueId id;
    memset(&id, 0, sizeof id);
    snprintf(id.internal, sizeof id.internal, "not-ours");
    cr_expect_eq(ncclCommInitRank(&c, 1, id, 0), ncclInvalidArgument);
    cr_expect(strstr(ncclGetLastError(NULL), "unique id"), "%s", ncclGetLastError(NULL));
    id = new_id();
    cr_expect_eq(ncclCommInitRank(&c, 2, id, 2), ncclInvalidArgument);
    cr_expect(strstr(ncclGetLastError(NULL), "rank 2 of 2"), "%s", ncclGetLastError(NULL));
}

static int disagreeing_rank(int rank, int nranks, ncclUniqueId id)
{
    (void)nranks;
    ncclComm_t c;
    struct timespec ts = {0, 200000000L}; /* rank 1 comes second */
    if (rank == 1)
        nanosleep(&ts, NULL);
    ncclResult_t r = ncclCommInitRank(&c, rank == 0 ? 2 : 3, id, rank);
    if (rank == 1) {
        CHECK(r == ncclInvalidArgument, "rank 1: %d", (int)r);
        CHECK(strstr(ncclGetLastError(NULL), "a peer said 2"), "%s", ncclGetLastError(NULL));
    } else {
        CHECK(r == ncclRemoteError, "rank 0: %d", (int)r); /* its peer never joined */
        CHECK(strstr(ncclGetLastError(NULL), "waited"), "%s", ncclGetLastError(NULL));
    }
    return fails ? 1 : 0;
}

Test(nccl_emu, ranks_that_disagree_on_the_count_are_refused)
{
    expect_ranks_pass(2, disagreeing_rank, "1");
}

/* ---- peers that never come, and aborts ---------------------------------------------------- */

static int alone_rank(int rank, int nranks, ncclUniqueId id)
{
    ncclComm_t c = NULL;
    CHECK(ncclCommInitRank(&c, nranks + 1, id, rank) == ncclRemoteError, "init alone");
    CHECK(strstr(ncclGetLastError(NULL), "ncclCommInitRank: rank 0 waited 1 s"), "%s",
          ncclGetLastError(NULL));
    return fails ? 1 : 0;
}

Test(nccl_emu, a_peer_that_never_joins_is_an_error_after_the_timeout)
{
    expect_ranks_pass(1, alone_rank, "1"); /* rank 0 of 2 */
}

/* rank 1 joins, then leaves without the collective (mode 0) or aborts (1) */
static int leave_mode;

static int leaving_rank(int rank, int nranks, ncclUniqueId id)
{
    ncclComm_t c;
    if (ncclCommInitRank(&c, nranks, id, rank) != ncclSuccess)
        return 2;
    float x = 1.0f;
    if (rank == 1) {
        if (leave_mode)
            ncclCommAbort(c);
        else
            ncclCommDestroy(c);
        return 0;
    }
    ncclResult_t r = ncclAllReduce(&x, &x, 1, ncclFloat32, ncclSum, c, NULL);
    CHECK(r == ncclRemoteError, "the collective: %d", (int)r);
    const char *want = leave_mode ? "rank 1 aborted the communicator" : "rank 0 waited 2 s";
    CHECK(strstr(ncclGetLastError(c), want), "%s", ncclGetLastError(c));
    ncclResult_t state = ncclSuccess;
    CHECK(ncclCommGetAsyncError(c, &state) == ncclSuccess && state == ncclRemoteError,
          "the asynchronous error: %d", (int)state);
    CHECK(ncclAllReduce(&x, &x, 1, ncclFloat32, ncclSum, c, NULL) == ncclInvalidUsage,
          "a collective on the failed communicator");
    ncclCommAbort(c);
    return fails ? 1 : 0;
}

Test(nccl_emu, a_peer_that_leaves_is_an_error_after_the_timeout)
{
    leave_mode = 0;
    expect_ranks_pass(2, leaving_rank, "2");
}

/* With a timeout of 100 s the test's own (120 s) would end a wait that the
 * abort did not. */
Test(nccl_emu, a_peers_abort_ends_the_wait)
{
    leave_mode = 1;
    expect_ranks_pass(2, leaving_rank, "100");
}
