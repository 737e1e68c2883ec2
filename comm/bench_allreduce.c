/* comm/bench_allreduce.c — spotune-bench-allreduce: times comm_allreduce
 * against plain MPI_Allreduce on the same host buffer (and, with --device,
 * comm_device_allreduce against plain ncclAllReduce), over sizes growing by
 * 4x, and prints one table row per size on rank 0.
 *
 *   mpirun -np 2 spotune-bench-allreduce [--min BYTES] [--max BYTES] [--device]
 *
 * Times are the mean per call of the slowest rank. algbw = bytes / time;
 * busbw = algbw * 2(n-1)/n, as nccl-tests defines it for all-reduce, so
 * it can be compared with the link's bandwidth whatever n is. */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm_internal.h"

#ifdef SPOTUNE_COMM_NCCL
#include <cuda_runtime_api.h>
#include <nccl.h>
#endif

typedef struct bench_args {
    size_t min_bytes, max_bytes;
    int device;
} bench_args;

static void usage(void)
{
    fprintf(stderr, "usage: mpirun -np N spotune-bench-allreduce [--min BYTES] [--max BYTES] "
                    "[--device]\n");
}

static int parse_args(int argc, char **argv, bench_args *a)
{
    a->min_bytes = (size_t)1 << 10;
    a->max_bytes = (size_t)256 << 20;
    a->device = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--device"))
            a->device = 1;
        else if (!strcmp(argv[i], "--min") && i + 1 < argc)
            a->min_bytes = strtoull(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--max") && i + 1 < argc)
            a->max_bytes = strtoull(argv[++i], NULL, 10);
        else
            return -1;
    }
    return a->min_bytes >= 4 && a->max_bytes >= a->min_bytes ? 0 : -1;
}

/* Enough calls to average out noise, few enough that 256 MiB stays quick. */
static int iters_for(size_t bytes)
{
    size_t it = ((size_t)64 << 20) / bytes;
    return it < 5 ? 5 : it > 200 ? 200 : (int)it;
}

/* The slowest rank's mean seconds per call. */
static double slowest(comm_t *c, double t0, int iters)
{
    double mine = (sp_now() - t0) / iters, all = mine;
    MPI_Allreduce(&mine, &all, 1, MPI_DOUBLE, MPI_MAX, c->world);
    return all;
}

static void die(comm_t *c, const sp_err *err)
{
    comm_abort(c, err->code ? err->code : SP_EXIT_OTHER, err->msg);
}

#define BENCH_MPI(c, call)                                                               \
    do {                                                                                 \
        int rc_ = (call);                                                                \
        if (rc_ != MPI_SUCCESS) {                                                        \
            sp_err e_ = {0};                                                             \
            comm_mpi_fail((c), &e_, rc_, #call, __FILE__, __LINE__);                     \
            die((c), &e_);                                                               \
        }                                                                                \
    } while (0)

static double time_comm(comm_t *c, float *buf, size_t n, int iters)
{
    sp_err err = {0};
    double t0;
    for (int w = 0; w < 2; w++)
        if (comm_allreduce(c, buf, n, COMM_F32, COMM_SUM, &err))
            die(c, &err);
    BENCH_MPI(c, MPI_Barrier(c->world));
    t0 = sp_now();
    for (int i = 0; i < iters; i++)
        if (comm_allreduce(c, buf, n, COMM_F32, COMM_SUM, &err))
            die(c, &err);
    return slowest(c, t0, iters);
}

static double time_mpi(comm_t *c, float *buf, size_t n, int iters)
{
    double t0;
    for (int w = 0; w < 2; w++)
        BENCH_MPI(c, MPI_Allreduce(MPI_IN_PLACE, buf, (int)n, MPI_FLOAT, MPI_SUM, c->world));
    BENCH_MPI(c, MPI_Barrier(c->world));
    t0 = sp_now();
    for (int i = 0; i < iters; i++)
        BENCH_MPI(c, MPI_Allreduce(MPI_IN_PLACE, buf, (int)n, MPI_FLOAT, MPI_SUM, c->world));
    return slowest(c, t0, iters);
}

static void print_header(comm_t *c, const char *what, const char *base)
{
    if (c->rank != 0)
        return;
    printf("# %s all-reduce, f32 sum, %d ranks on %d node(s)\n", what, c->size,
           c->size / (c->local_size ? c->local_size : 1));
    printf("%10s %10s %6s %11s %11s %11s %11s %11s %9s\n", "size", "count", "iters", "time(us)",
           "algbw(GB/s)", "busbw(GB/s)", base, "busbw(GB/s)", "ratio");
}

static void print_row(comm_t *c, size_t bytes, int iters, double t_comm, double t_base)
{
    double factor = 2.0 * (c->size - 1) / c->size;
    double alg = (double)bytes / t_comm / 1e9, alg_base = (double)bytes / t_base / 1e9;
    if (c->rank != 0)
        return;
    printf("%10zu %10zu %6d %11.1f %11.3f %11.3f %11.1f %11.3f %9.2f\n", bytes,
           bytes / sizeof(float), iters, t_comm * 1e6, alg, alg * factor, t_base * 1e6,
           alg_base * factor, t_comm / t_base);
    fflush(stdout);
}

static void bench_host(comm_t *c, const bench_args *a)
{
    float *buf = calloc(a->max_bytes / sizeof(float), sizeof(float));
    if (!buf)
        comm_abort(c, SP_EXIT_OTHER, "bench: out of memory for the buffer");
    print_header(c, "host (comm_allreduce vs MPI_Allreduce)", "MPI(us)");
    for (size_t bytes = a->min_bytes; bytes <= a->max_bytes; bytes *= 4) {
        size_t n = bytes / sizeof(float);
        int iters = iters_for(bytes);
        double t_comm = time_comm(c, buf, n, iters);
        double t_mpi = time_mpi(c, buf, n, iters);
        print_row(c, bytes, iters, t_comm, t_mpi);
    }
    free(buf);
}

#ifdef SPOTUNE_COMM_NCCL

#define BENCH_CUDA(c, call)                                                              \
    do {                                                                                 \
        cudaError_t e_ = (call);                                                         \
        if (e_ != cudaSuccess) {                                                         \
            char m_[512];                                                                \
            snprintf(m_, sizeof m_, "%s:%d: %s: %s", __FILE__, __LINE__, #call,          \
                     cudaGetErrorString(e_));                                            \
            comm_abort((c), SP_EXIT_OTHER, m_);                                          \
        }                                                                                \
    } while (0)

/* The communicator is non-blocking (comm_device_init): a call that returns
 * ncclInProgress is polled until it settles before the next NCCL call, as
 * NCCL requires. */
static void bench_nccl(comm_t *c, ncclComm_t nc, ncclResult_t r, const char *call,
                       const char *file, int line)
{
    while (r == ncclInProgress) {
        ncclResult_t state = ncclInProgress;
        ncclResult_t q = ncclCommGetAsyncError(nc, &state);
        r = q != ncclSuccess ? q : state;
    }
    if (r != ncclSuccess) {
        char m[512];
        snprintf(m, sizeof m, "%s:%d: %s: %s", file, line, call, ncclGetErrorString(r));
        comm_abort(c, SP_EXIT_OTHER, m);
    }
}
#define BENCH_NCCL(c, nc, call) bench_nccl((c), (nc), (call), #call, __FILE__, __LINE__)

static double time_device_comm(comm_t *c, float *buf, size_t n, int iters, cudaStream_t s)
{
    sp_err err = {0};
    double t0 = 0;
    for (int i = -2; i < iters; i++) {
        if (i == 0) {
            if (comm_device_wait(c, s, &err))
                die(c, &err);
            BENCH_MPI(c, MPI_Barrier(c->world));
            t0 = sp_now();
        }
        if (comm_device_allreduce(c, buf, n, COMM_F32, COMM_SUM, s, &err))
            die(c, &err);
    }
    if (comm_device_wait(c, s, &err))
        die(c, &err);
    return slowest(c, t0, iters);
}

/* The same calls straight to NCCL, on the communicator comm_device_init made. */
static double time_device_nccl(comm_t *c, float *buf, size_t n, int iters, cudaStream_t s)
{
    ncclComm_t nc = comm_device_nccl(c);
    double t0 = 0;
    for (int i = -2; i < iters; i++) {
        if (i == 0) {
            BENCH_CUDA(c, cudaStreamSynchronize(s));
            BENCH_MPI(c, MPI_Barrier(c->world));
            t0 = sp_now();
        }
        BENCH_NCCL(c, nc, ncclAllReduce(buf, buf, n, ncclFloat32, ncclSum, nc, s));
    }
    BENCH_CUDA(c, cudaStreamSynchronize(s));
    return slowest(c, t0, iters);
}

static void bench_device(comm_t *c, const bench_args *a)
{
    sp_err err = {0};
    int ndev = 0;
    float *buf = NULL;
    cudaStream_t s;
    BENCH_CUDA(c, cudaGetDeviceCount(&ndev));
    if (comm_device_init(c, comm_device_for_rank(c, ndev), &err))
        die(c, &err);
    if (!comm_device_nccl(c))
        comm_abort(c, SP_EXIT_USAGE,
                   "bench --device: run 2 or more ranks under mpirun (one rank has no NCCL "
                   "communicator)");
    BENCH_CUDA(c, cudaMalloc((void **)&buf, a->max_bytes));
    BENCH_CUDA(c, cudaMemset(buf, 0, a->max_bytes));
    BENCH_CUDA(c, cudaStreamCreate(&s));
    print_header(c, "device (comm_device_allreduce vs ncclAllReduce)", "NCCL(us)");
    for (size_t bytes = a->min_bytes; bytes <= a->max_bytes; bytes *= 4) {
        size_t n = bytes / sizeof(float);
        int iters = iters_for(bytes) < 20 ? 20 : iters_for(bytes);
        double t_comm = time_device_comm(c, buf, n, iters, s);
        double t_nccl = time_device_nccl(c, buf, n, iters, s);
        print_row(c, bytes, iters, t_comm, t_nccl);
    }
    BENCH_CUDA(c, cudaStreamDestroy(s));
    BENCH_CUDA(c, cudaFree(buf));
}

#else

static void bench_device(comm_t *c, const bench_args *a)
{
    (void)a;
    comm_abort(c, SP_EXIT_USAGE, "bench --device: spotune was built without CUDA");
}

#endif

int main(int argc, char **argv)
{
    comm_t *c = NULL;
    sp_err err = {0};
    bench_args a;
    if (comm_init(&c, &argc, &argv, NULL, &err))
        comm_abort(NULL, err.code, err.msg);
    if (parse_args(argc, argv, &a)) {
        if (c->rank == 0)
            usage();
        comm_finalize(c);
        return SP_EXIT_USAGE;
    }
    if (!c->use_mpi)
        comm_abort(c, SP_EXIT_USAGE, "spotune-bench-allreduce: run it under mpirun");
    if (a.device)
        bench_device(c, &a);
    else
        bench_host(c, &a);
    comm_finalize(c);
    return 0;
}
