/* tests/comm_prog.c — spotune-comm-prog: the MPI side of the comm tests.
 *
 *   mpirun -np N spotune-comm-prog CASE [TIMEOUT_S]
 *
 * Each CASE runs one collective scenario on every rank and checks the
 * result against a reference computed locally (every rank can generate
 * every other rank's input: inputs are a pure function of rank and index).
 * Success: rank 0 prints "ok CASE" and every rank exits 0. A wrong result
 * ends the job through comm_abort, so no rank is left waiting. The failure
 * cases (kill, abort, hang) end the job on purpose; test_comm.c checks how.
 * Started without mpirun it runs the same checks in a world of one. */
#define _POSIX_C_SOURCE 200809L
#include <inttypes.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "comm/comm.h"

#ifdef SPOTUNE_COMM_NCCL
#include <cuda_runtime_api.h>
#endif

#define EXIT_SKIP 77 /* ctest's and test_comm.c's "skipped" */

static const comm_dtype all_dtypes[] = {COMM_F32, COMM_F64, COMM_I32, COMM_I64, COMM_U8, COMM_BF16};
static const comm_op all_ops[] = {COMM_SUM, COMM_AVG, COMM_MAX, COMM_MIN};
static const char *dt_names[] = {"f32", "f64", "i32", "i64", "u8", "bf16"};
static const char *op_names[] = {"sum", "max", "min", "avg"};

#define NELEM(a) (sizeof(a) / sizeof((a)[0]))

static _Noreturn void fail(comm_t *c, const char *fmt, ...) SP_PRINTF(2, 3);

static _Noreturn void fail(comm_t *c, const char *fmt, ...)
{
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    comm_abort(c, SP_EXIT_OTHER, msg);
}

static void check(comm_t *c, int rc, const sp_err *err)
{
    if (rc)
        comm_abort(c, rc, err->msg);
}

/* ---- inputs: element i of rank r, a pure function ----------------------- */

/* Magnitudes spread over 2^-10..2^10 so that float sums depend on order. */
static double gen_real(uint64_t seed, int r, size_t i)
{
    double u = 2.0 * sp_rng_uniform(seed, (uint64_t)r << 40 | i) - 1.0;
    return u * (double)(1 << (i % 21)) / 1024.0;
}

static uint64_t gen_bits(uint64_t seed, int r, size_t i)
{
    return sp_rng_u64(seed ^ 0x5bd1e995u, (uint64_t)r << 40 | i);
}

/* Element i of rank r's input, written to elem. */
static void gen_elem(comm_dtype dt, uint64_t seed, int r, size_t i, void *elem)
{
    switch (dt) {
    case COMM_F32: *(float *)elem = (float)gen_real(seed, r, i); break;
    case COMM_F64: *(double *)elem = gen_real(seed, r, i); break;
    case COMM_I32: *(int32_t *)elem = (int32_t)(uint32_t)gen_bits(seed, r, i); break;
    case COMM_I64: *(int64_t *)elem = (int64_t)gen_bits(seed, r, i); break;
    case COMM_U8: *(uint8_t *)elem = (uint8_t)gen_bits(seed, r, i); break;
    case COMM_BF16: *(uint16_t *)elem = sp_f32_to_bf16((float)gen_real(seed, r, i)); break;
    }
}

/* Rank r's input: n elements starting at global index first. */
static void gen_input(comm_dtype dt, uint64_t seed, int r, size_t first, size_t n, void *buf)
{
    size_t es = comm_dtype_size(dt);
    for (size_t k = 0; k < n; k++)
        gen_elem(dt, seed, r, first + k, (char *)buf + k * es);
}

/* ---- reference: the reduction written out, rank 0 first ----------------- */

static double combine_real(double a, double b, comm_op op)
{
    if (op == COMM_MAX)
        return b > a ? b : a;
    if (op == COMM_MIN)
        return b < a ? b : a;
    return a + b;
}

static float combine_f32(float a, float b, comm_op op)
{
    if (op == COMM_MAX)
        return b > a ? b : a;
    if (op == COMM_MIN)
        return b < a ? b : a;
    return a + b;
}

/* Integers: sums wrap, compared as signed for max/min. */
static int64_t combine_int(int64_t a, int64_t b, comm_op op, int bits)
{
    if (op == COMM_MAX)
        return b > a ? b : a;
    if (op == COMM_MIN)
        return b < a ? b : a;
    uint64_t s = (uint64_t)a + (uint64_t)b;
    if (bits == 32)
        return (int32_t)(uint32_t)s;
    if (bits == 8)
        return (uint8_t)s;
    return (int64_t)s;
}

static int64_t int_elem(comm_dtype dt, const void *elem)
{
    switch (dt) {
    case COMM_I32: return *(const int32_t *)elem;
    case COMM_I64: return *(const int64_t *)elem;
    default: return *(const uint8_t *)elem;
    }
}

static void ref_elem(comm_dtype dt, comm_op op, int size, uint64_t seed, size_t i, void *out)
{
    union { float f; double d; int64_t i; uint16_t h; } tmp;
    if (dt == COMM_F64) {
        double acc = gen_real(seed, 0, i);
        for (int r = 1; r < size; r++)
            acc = combine_real(acc, gen_real(seed, r, i), op);
        ((double *)out)[0] = op == COMM_AVG ? acc / size : acc;
    } else if (dt == COMM_F32 || dt == COMM_BF16) {
        float acc = 0;
        for (int r = 0; r < size; r++) {
            gen_elem(dt, seed, r, i, &tmp);
            float v = dt == COMM_F32 ? tmp.f : sp_bf16_to_f32(tmp.h);
            acc = r == 0 ? v : combine_f32(acc, v, op);
        }
        if (op == COMM_AVG)
            acc /= (float)size;
        if (dt == COMM_F32)
            ((float *)out)[0] = acc;
        else
            ((uint16_t *)out)[0] = sp_f32_to_bf16(acc);
    } else {
        int bits = dt == COMM_I32 ? 32 : dt == COMM_I64 ? 64 : 8;
        int64_t acc = 0;
        for (int r = 0; r < size; r++) {
            gen_elem(dt, seed, r, i, &tmp);
            acc = r == 0 ? int_elem(dt, &tmp) : combine_int(acc, int_elem(dt, &tmp), op, bits);
        }
        if (op == COMM_AVG)
            acc /= size;
        memcpy(out, (char *)&acc, comm_dtype_size(dt)); /* little-endian low bytes */
    }
}

/* out[k] = reference of global element first + k. */
static void reference(comm_dtype dt, comm_op op, int size, uint64_t seed, size_t first, size_t n,
                      void *out)
{
    size_t es = comm_dtype_size(dt);
    for (size_t k = 0; k < n; k++)
        ref_elem(dt, op, size, seed, first + k, (char *)out + k * es);
}

static void expect_same(comm_t *c, const char *what, const void *got, const void *want, size_t n,
                        comm_dtype dt)
{
    size_t es = comm_dtype_size(dt);
    for (size_t i = 0; i < n; i++)
        if (memcmp((const char *)got + i * es, (const char *)want + i * es, es))
            fail(c, "%s: element %zu of %zu differs (%s)", what, i, n, dt_names[dt]);
}

static void *xmalloc(comm_t *c, size_t bytes)
{
    void *p = malloc(bytes ? bytes : 1);
    if (!p)
        fail(c, "out of memory (%zu bytes)", bytes);
    return p;
}

/* ---- cases -------------------------------------------------------------- */

static const size_t sizes[] = {0, 1, 1000, 12007};

static void case_allreduce(comm_t *c)
{
    sp_err err = {0};
    for (size_t s = 0; s < NELEM(sizes); s++)
        for (size_t d = 0; d < NELEM(all_dtypes); d++)
            for (size_t o = 0; o < NELEM(all_ops); o++) {
                comm_dtype dt = all_dtypes[d];
                comm_op op = all_ops[o];
                size_t n = sizes[s], es = comm_dtype_size(dt);
                uint64_t seed = 1000 + s * 100 + d * 10 + o;
                char what[64];
                void *buf = xmalloc(c, n * es), *want = xmalloc(c, n * es);
                gen_input(dt, seed, comm_rank(c), 0, n, buf);
                check(c, comm_allreduce(c, buf, n, dt, op, &err), &err);
                reference(dt, op, comm_size(c), seed, 0, n, want);
                snprintf(what, sizeof what, "allreduce %s %s n=%zu", dt_names[dt],
                         op_names[op], n);
                expect_same(c, what, buf, want, n, dt);
                free(buf);
                free(want);
            }
}

/* Prints a hash of a large float sum and average; equal on every rank. */
static void case_determinism(comm_t *c)
{
    sp_err err = {0};
    size_t n = 100003;
    uint64_t h = SP_FNV_INIT, first = 0;
    float *buf = xmalloc(c, n * sizeof(float));
    for (int rep = 0; rep < 3; rep++) {
        uint64_t hr = SP_FNV_INIT;
        for (int o = 0; o < 2; o++) {
            gen_input(COMM_F32, 77 + (uint64_t)o, comm_rank(c), 0, n, buf);
            check(c, comm_allreduce(c, buf, n, COMM_F32, o ? COMM_AVG : COMM_SUM, &err), &err);
            hr = sp_fnv1a(hr, buf, n * sizeof(float));
        }
        if (rep == 0)
            first = hr;
        else if (hr != first)
            fail(c, "determinism: repetition %d differs from the first", rep);
    }
    h = first;
    uint64_t *all = xmalloc(c, sizeof(uint64_t) * (size_t)comm_size(c));
    check(c, comm_allgather(c, &h, all, 1, COMM_I64, &err), &err);
    for (int r = 0; r < comm_size(c); r++)
        if (all[r] != h)
            fail(c, "determinism: rank %d's result differs from rank %d's", r, comm_rank(c));
    if (comm_rank(c) == 0)
        printf("hash %016" PRIx64 "\n", h);
    free(all);
    free(buf);
}

static void case_bcast(comm_t *c)
{
    sp_err err = {0};
    const size_t lens[] = {0, 1, 1000, 100003};
    for (int root = 0; root < comm_size(c); root++)
        for (size_t l = 0; l < NELEM(lens); l++) {
            size_t n = lens[l];
            uint8_t *buf = xmalloc(c, n), *want = xmalloc(c, n);
            gen_input(COMM_U8, 5 + l, root, 0, n, want);
            if (comm_rank(c) == root)
                memcpy(buf, want, n);
            else
                memset(buf, 0xEE, n);
            check(c, comm_bcast(c, buf, n, root, &err), &err);
            expect_same(c, "bcast", buf, want, n, COMM_U8);
            free(buf);
            free(want);
        }
}

static void allgather_one(comm_t *c, comm_dtype dt, size_t n, int in_place)
{
    sp_err err = {0};
    size_t es = comm_dtype_size(dt), total = n * (size_t)comm_size(c);
    char *recv = xmalloc(c, total * es), *want = xmalloc(c, total * es);
    char *mine = in_place ? recv + (size_t)comm_rank(c) * n * es : xmalloc(c, n * es);
    memset(recv, 0xEE, total * es);
    gen_input(dt, 9, comm_rank(c), 0, n, mine);
    for (int r = 0; r < comm_size(c); r++)
        gen_input(dt, 9, r, 0, n, want + (size_t)r * n * es);
    check(c, comm_allgather(c, mine, recv, n, dt, &err), &err);
    expect_same(c, in_place ? "allgather in place" : "allgather", recv, want, total, dt);
    if (!in_place)
        free(mine);
    free(recv);
    free(want);
}

static void case_allgather(comm_t *c)
{
    for (size_t s = 0; s < NELEM(sizes); s++)
        for (size_t d = 0; d < NELEM(all_dtypes); d++)
            for (int in_place = 0; in_place < 2; in_place++)
                allgather_one(c, all_dtypes[d], sizes[s], in_place);
}

/* Every root in turn receives each rank's n elements in rank order; the
 * other ranks' receive buffers are not touched. */
static void gather_one(comm_t *c, comm_dtype dt, size_t n, int root)
{
    sp_err err = {0};
    size_t es = comm_dtype_size(dt), total = n * (size_t)comm_size(c);
    char *recv = xmalloc(c, total * es + 1), *want = xmalloc(c, total * es + 1);
    char *mine = xmalloc(c, n * es + 1);
    memset(recv, 0xEE, total * es);
    memset(want, 0xEE, total * es);
    gen_input(dt, 11 + (uint64_t)root, comm_rank(c), 0, n, mine);
    if (comm_rank(c) == root)
        for (int r = 0; r < comm_size(c); r++)
            gen_input(dt, 11 + (uint64_t)root, r, 0, n, want + (size_t)r * n * es);
    check(c, comm_gather(c, mine, recv, n, dt, root, &err), &err);
    expect_same(c, comm_rank(c) == root ? "gather at the root" : "gather leaves others alone",
                recv, want, total, dt);
    free(mine);
    free(recv);
    free(want);
}

static void case_gather(comm_t *c)
{
    for (size_t s = 0; s < NELEM(sizes); s++)
        for (size_t d = 0; d < NELEM(all_dtypes); d++)
            for (int root = 0; root < comm_size(c); root++)
                gather_one(c, all_dtypes[d], sizes[s], root);
    sp_err err = {0};
    float x = 1.0f, y[8];
    if (comm_gather(c, &x, y, 1, COMM_F32, comm_size(c), &err) == 0)
        fail(c, "gather to root %d (not a rank) succeeded", comm_size(c));
}

/* Rank r's input is blocks [size][n] of global elements 0..size*n; it must
 * receive the reduced block r, i.e. global elements r*n .. r*n+n. */
static void reduce_scatter_one(comm_t *c, comm_dtype dt, comm_op op, size_t n, int in_place)
{
    sp_err err = {0};
    size_t es = comm_dtype_size(dt), total = n * (size_t)comm_size(c);
    size_t first = (size_t)comm_rank(c) * n;
    uint64_t seed = 300 + (uint64_t)dt * 10 + (uint64_t)op;
    char *send = xmalloc(c, total * es), *want = xmalloc(c, n * es);
    char *recv = in_place ? send + first * es : xmalloc(c, n * es);
    gen_input(dt, seed, comm_rank(c), 0, total, send);
    check(c, comm_reduce_scatter(c, send, recv, n, dt, op, &err), &err);
    reference(dt, op, comm_size(c), seed, first, n, want);
    expect_same(c, in_place ? "reduce_scatter in place" : "reduce_scatter", recv, want, n, dt);
    if (!in_place)
        free(recv);
    free(send);
    free(want);
}

static void case_reduce_scatter(comm_t *c)
{
    for (size_t s = 0; s < NELEM(sizes); s++)
        for (size_t d = 0; d < NELEM(all_dtypes); d++)
            for (size_t o = 0; o < NELEM(all_ops); o++)
                reduce_scatter_one(c, all_dtypes[d], all_ops[o], sizes[s], (int)(o % 2));
}

/* comm_reduce: the root's buffer receives the reduction (bit-identical to
 * the reference fold in rank order), every other rank's is left as it was. */
static void reduce_one(comm_t *c, comm_dtype dt, comm_op op, size_t n, int root)
{
    sp_err err = {0};
    size_t es = comm_dtype_size(dt);
    uint64_t seed = 500 + (uint64_t)dt * 10 + (uint64_t)op;
    char *buf = xmalloc(c, n * es + 1), *want = xmalloc(c, n * es + 1);
    gen_input(dt, seed, comm_rank(c), 0, n, buf);
    if (comm_rank(c) == root)
        reference(dt, op, comm_size(c), seed, 0, n, want);
    else
        memcpy(want, buf, n * es);
    check(c, comm_reduce(c, buf, n, dt, op, root, &err), &err);
    expect_same(c, comm_rank(c) == root ? "reduce at the root" : "reduce leaves others alone",
                buf, want, n, dt);
    free(buf);
    free(want);
}

static void case_reduce(comm_t *c)
{
    for (size_t s = 0; s < NELEM(sizes); s++)
        for (size_t d = 0; d < NELEM(all_dtypes); d++)
            for (size_t o = 0; o < NELEM(all_ops); o++)
                reduce_one(c, all_dtypes[d], all_ops[o], sizes[s],
                           (int)((s + o) % (size_t)comm_size(c)));
    sp_err err = {0};
    float x = 1.0f;
    if (comm_reduce(c, &x, 1, COMM_F32, COMM_SUM, comm_size(c), &err) == 0)
        fail(c, "reduce to root %d (not a rank) succeeded", comm_size(c));
}

static void case_any(comm_t *c)
{
    sp_err err = {0};
    for (int who = -1; who < comm_size(c); who++) {
        int any = -1;
        check(c, comm_any(c, comm_rank(c) == who ? 7 : 0, &any, &err), &err);
        if (any != (who >= 0))
            fail(c, "any: got %d when rank %d said yes", any, who);
        check(c, comm_barrier(c, &err), &err);
    }
}

/* The last rank dies with SIGKILL after a few all-reduces; the others keep
 * calling collectives until the launcher ends the job. */
static void case_kill(comm_t *c)
{
    sp_err err = {0};
    float x[256] = {0};
    for (int i = 0; i < 100000; i++) {
        if (i == 3 && comm_rank(c) == comm_size(c) - 1)
            raise(SIGKILL);
        check(c, comm_allreduce(c, x, NELEM(x), COMM_F32, COMM_SUM, &err), &err);
    }
}

/* The last rank finds bad input and ends the job with exit code 3. */
static void case_abort(comm_t *c)
{
    sp_err err = {0};
    float x = 1;
    check(c, comm_barrier(c, &err), &err);
    if (comm_rank(c) == comm_size(c) - 1)
        comm_abort(c, SP_EXIT_INPUT, "bad input: token 99 outside the vocabulary");
    check(c, comm_allreduce(c, &x, 1, COMM_F32, COMM_SUM, &err), &err);
    check(c, comm_barrier(c, &err), &err);
}

/* The last rank skips an all-reduce (stuck elsewhere); the watchdog on the
 * others must end the job. */
static void case_hang(comm_t *c)
{
    sp_err err = {0};
    float x = 1;
    check(c, comm_barrier(c, &err), &err);
    if (comm_rank(c) == comm_size(c) - 1) {
        struct timespec ts = {120, 0};
        nanosleep(&ts, NULL);
        return;
    }
    check(c, comm_allreduce(c, &x, 1, COMM_F32, COMM_SUM, &err), &err);
}

/* ---- device collectives (NCCL), where there are GPUs --------------------- */

#ifdef SPOTUNE_COMM_NCCL

#define CUDA_OK(c, call)                                                                 \
    do {                                                                                 \
        cudaError_t e_ = (call);                                                         \
        if (e_ != cudaSuccess)                                                           \
            fail((c), "%s:%d: %s: %s", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
    } while (0)

/* NCCL sums in its own order: compare within a tolerance scaled by the
 * magnitudes summed (exact for data movement, max and integers). */
static void expect_close(comm_t *c, const char *what, const float *got, const float *want,
                         size_t n, int size)
{
    for (size_t i = 0; i < n; i++) {
        double tol = 1e-6 * size * (1.0 + fabs((double)want[i]));
        if (fabs((double)got[i] - (double)want[i]) > tol)
            fail(c, "%s: element %zu of %zu is %.9g, expected %.9g", what, i, n, got[i], want[i]);
    }
}

static void device_allreduce(comm_t *c, float *d, size_t n, comm_op op, cudaStream_t s)
{
    sp_err err = {0};
    uint64_t seed = 500 + (uint64_t)op;
    float *h = xmalloc(c, n * sizeof(float)), *want = xmalloc(c, n * sizeof(float));
    gen_input(COMM_F32, seed, comm_rank(c), 0, n, h);
    CUDA_OK(c, cudaMemcpy(d, h, n * sizeof(float), cudaMemcpyHostToDevice));
    check(c, comm_device_allreduce(c, d, n, COMM_F32, op, s, &err), &err);
    check(c, comm_device_wait(c, s, &err), &err);
    CUDA_OK(c, cudaMemcpy(h, d, n * sizeof(float), cudaMemcpyDeviceToHost));
    reference(COMM_F32, op, comm_size(c), seed, 0, n, want);
    expect_close(c, "device allreduce", h, want, n, comm_size(c));
    free(h);
    free(want);
}

static void device_reduce_scatter(comm_t *c, float *d, size_t n, cudaStream_t s)
{
    sp_err err = {0};
    size_t total = n * (size_t)comm_size(c), first = (size_t)comm_rank(c) * n;
    float *h = xmalloc(c, total * sizeof(float)), *want = xmalloc(c, n * sizeof(float));
    gen_input(COMM_F32, 600, comm_rank(c), 0, total, h);
    CUDA_OK(c, cudaMemcpy(d, h, total * sizeof(float), cudaMemcpyHostToDevice));
    check(c, comm_device_reduce_scatter(c, d, d + total, n, COMM_F32, COMM_SUM, s, &err), &err);
    check(c, comm_device_wait(c, s, &err), &err);
    CUDA_OK(c, cudaMemcpy(h, d + total, n * sizeof(float), cudaMemcpyDeviceToHost));
    reference(COMM_F32, COMM_SUM, comm_size(c), 600, first, n, want);
    expect_close(c, "device reduce_scatter", h, want, n, comm_size(c));
    free(h);
    free(want);
}

static void device_allgather_bcast(comm_t *c, float *d, size_t n, cudaStream_t s)
{
    sp_err err = {0};
    size_t total = n * (size_t)comm_size(c);
    float *h = xmalloc(c, total * sizeof(float)), *want = xmalloc(c, total * sizeof(float));
    for (int r = 0; r < comm_size(c); r++)
        gen_input(COMM_F32, 700, r, 0, n, want + (size_t)r * n);
    CUDA_OK(c, cudaMemcpy(d, want + (size_t)comm_rank(c) * n, n * sizeof(float),
                          cudaMemcpyHostToDevice));
    check(c, comm_device_allgather(c, d, d + n, n, COMM_F32, s, &err), &err);
    check(c, comm_device_wait(c, s, &err), &err);
    CUDA_OK(c, cudaMemcpy(h, d + n, total * sizeof(float), cudaMemcpyDeviceToHost));
    expect_same(c, "device allgather", h, want, total, COMM_F32);
    int root = comm_size(c) - 1;
    CUDA_OK(c, cudaMemcpy(d, comm_rank(c) == root ? want : h, n * sizeof(float),
                          cudaMemcpyHostToDevice));
    check(c, comm_device_bcast(c, d, n, COMM_F32, root, s, &err), &err);
    check(c, comm_device_wait(c, s, &err), &err);
    CUDA_OK(c, cudaMemcpy(h, d, n * sizeof(float), cudaMemcpyDeviceToHost));
    expect_same(c, "device bcast", h, want, n, COMM_F32);
    free(h);
    free(want);
}

static int gpus_for_every_rank(comm_t *c, int *ndev)
{
    sp_err err = {0};
    int missing, any = 0;
    *ndev = 0;
    missing = cudaGetDeviceCount(ndev) != cudaSuccess || *ndev < comm_local_size(c);
    check(c, comm_any(c, missing, &any, &err), &err);
    return !any;
}

static void case_device(comm_t *c)
{
    sp_err err = {0};
    const size_t lens[] = {1, 1000, 100003};
    int ndev;
    float *d = NULL;
    cudaStream_t s;
    if (!gpus_for_every_rank(c, &ndev)) {
        if (comm_rank(c) == 0)
            printf("skip: fewer GPUs than ranks on a node\n");
        comm_finalize(c);
        exit(EXIT_SKIP);
    }
    check(c, comm_device_init(c, comm_device_for_rank(c, ndev), &err), &err);
    CUDA_OK(c, cudaStreamCreate(&s));
    CUDA_OK(c, cudaMalloc((void **)&d, 2 * 100003 * sizeof(float) * (size_t)comm_size(c)));
    for (size_t l = 0; l < NELEM(lens); l++) {
        for (size_t o = 0; o < NELEM(all_ops); o++)
            device_allreduce(c, d, lens[l], all_ops[o], s);
        device_reduce_scatter(c, d, lens[l], s);
        device_allgather_bcast(c, d, lens[l], s);
    }
    CUDA_OK(c, cudaFree(d));
    CUDA_OK(c, cudaStreamDestroy(s));
}

#else

static void case_device(comm_t *c)
{
    if (comm_rank(c) == 0)
        printf("skip: built without CUDA\n");
    comm_finalize(c);
    exit(EXIT_SKIP);
}

#endif

/* Ranks on one host: local ranks 0..n-1 (every rank of this test runs on
 * one machine), local size n, and GPU local_rank mod visible devices. */
static void case_local(comm_t *c)
{
    sp_err err = {0};
    int n = comm_size(c), local = comm_local_rank(c);
    int32_t all[64] = {0};
    if (n > 64)
        fail(c, "local: at most 64 ranks");
    int32_t mine = local;
    check(c, comm_allgather(c, &mine, all, 1, COMM_I32, &err), &err);
    for (int r = 0; r < n; r++)
        for (int q = 0; q < r; q++)
            if (all[r] == all[q])
                fail(c, "local: ranks %d and %d both have local rank %d", q, r, all[r]);
    if (local < 0 || local >= n || comm_local_size(c) != n)
        fail(c, "local: local rank %d, local size %d, world %d", local, comm_local_size(c), n);
    if (comm_device_for_rank(c, n) != local || comm_device_for_rank(c, 2) != local % 2 ||
        comm_device_for_rank(c, 0) != 0)
        fail(c, "local: rank %d (local %d) binds to GPUs %d of %d, %d of 2", comm_rank(c), local,
             comm_device_for_rank(c, n), n, comm_device_for_rank(c, 2));
    if (comm_rank(c) == 0)
        printf("local ranks distinct, %d per host\n", n);
}

/* A made-up GPU UUID: one per key (0: none, all zero bytes). */
static void fake_uuid(int key, unsigned char id[16])
{
    memset(id, 0, 16);
    if (key > 0) {
        id[0] = 0xa1;
        id[15] = (unsigned char)key;
    }
}

/* Every rank on a GPU of its own (ranks 1 and 2 on none: no GPU is never a
 * collision): no error. */
static void case_distinct_gpus(comm_t *c)
{
    sp_err err = {0};
    unsigned char id[16];
    int r = comm_rank(c);
    fake_uuid(r == 1 || r == 2 ? 0 : r + 1, id);
    check(c, comm_check_devices_distinct(c, id, comm_local_rank(c), comm_size(c), &err), &err);
}

/* Two GPUs visible to each rank and the rank bound to local_rank mod 2, so
 * with 4 ranks ranks 0 and 2 share GPU 0: every rank gets the same usage
 * error, which rank 0 prints. */
static void case_shared_gpu(comm_t *c)
{
    sp_err err = {0};
    unsigned char id[16];
    int dev = comm_device_for_rank(c, 2);
    fake_uuid(dev + 1, id);
    int rc = comm_check_devices_distinct(c, id, dev, 2, &err);
    if (rc != SP_EXIT_USAGE || !strstr(err.msg, "ranks 0 and 2 on "))
        fail(c, "shared_gpu: rank %d got %d: %s", comm_rank(c), rc, err.msg);
    if (comm_rank(c) == 0)
        printf("error: %s\n", err.msg);
}

struct prog_case {
    const char *name;
    void (*run)(comm_t *c);
};

static const struct prog_case cases[] = {
    {"allreduce", case_allreduce}, {"determinism", case_determinism},
    {"bcast", case_bcast},         {"allgather", case_allgather},
    {"gather", case_gather},       {"local", case_local},
    {"reduce_scatter", case_reduce_scatter}, {"any", case_any},
    {"reduce", case_reduce},
    {"kill", case_kill},           {"abort", case_abort},
    {"hang", case_hang},           {"device", case_device},
    {"distinct_gpus", case_distinct_gpus}, {"shared_gpu", case_shared_gpu},
};

int main(int argc, char **argv)
{
    comm_t *c = NULL;
    comm_opts opts = {0};
    sp_err err = {0};
    if (argc < 2) {
        fprintf(stderr, "usage: spotune-comm-prog CASE [TIMEOUT_S]\n");
        return SP_EXIT_USAGE;
    }
    if (argc > 2)
        opts.timeout_s = atof(argv[2]);
    if (comm_init(&c, &argc, &argv, &opts, &err))
        comm_abort(NULL, err.code, err.msg);
    for (size_t i = 0; i < NELEM(cases); i++) {
        if (strcmp(argv[1], cases[i].name))
            continue;
        cases[i].run(c);
        if (comm_rank(c) == 0)
            printf("ok %s on %d rank(s)\n", cases[i].name, comm_size(c));
        fflush(stdout);
        comm_finalize(c);
        return 0;
    }
    fail(c, "unknown case %s", argv[1]);
}
