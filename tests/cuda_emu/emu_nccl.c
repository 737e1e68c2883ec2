/* tests/cuda_emu/emu_nccl.c — NCCL for ranks on the emulated CUDA device:
 * the NCCL calls of comm/comm_nccl.c (and the five CUDA runtime calls it
 * makes) for processes on one host, through POSIX shared memory, so that
 * the device collectives of training run, with two or more ranks, without
 * a GPU. Preloaded (LD_PRELOAD=libspotune_nccl_emu.so) into processes whose
 * SPOTUNE_CUDA_MODULE names the emulated device's module; its definitions
 * then take the place of libnccl's and libcudart's in comm_nccl.c.
 *
 * Like the emulated device, a collective runs at once, in the calling
 * thread, in the order it is issued (after the work the device holds on
 * its stream; with SPOTUNE_CUDA_EMU_DEFER, on a lagging stream, its result
 * is written when the stream's work comes to it): every rank copies its
 * part into its slot of the segment, all meet at a barrier, each reduces
 * the slots in rank order (so every rank gets the same bits: sums in float
 * for bf16, rounded once), all meet again; large buffers go chunk by
 * chunk. Calls inside ncclGroupStart/End are held and run at ncclGroupEnd.
 * A communicator made non-blocking answers ncclInProgress and then
 * ncclSuccess from ncclCommGetAsyncError, as NCCL may. A peer that never
 * comes (died, or issued other collectives) is an error after
 * SPOTUNE_NCCL_EMU_TIMEOUT_S (default 60) seconds (never: it is waited
 * for for ever, as NCCL does, whose GPU reports nothing), and a peer's
 * ncclCommAbort ends the others' waits at once: both become the
 * communicator's asynchronous error (ncclRemoteError) with a message.
 * A collective on a stream being captured is refused (ncclInvalidUsage):
 * unlike NCCL this cannot be recorded into a graph. SPOTUNE_NCCL_EMU_STALL=
 * R:N stops rank R, alive, in its N-th collective (a hung GPU); R:N:S
 * holds it there S seconds only (a slow first connection).
 *
 * Not emulated: anything NCCL does on a network or between hosts, timing
 * and overlap with compute, ring or tree summation orders. */
#define _GNU_SOURCE
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <nccl.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "emu_bf16.h"

#define EMU_MAX_RANKS 16
#define EMU_CHUNK ((size_t)1 << 18) /* bytes a rank puts into a slot at a time */
#define EMU_ID_MAGIC "spotune-nccl-emu"

/* The segment all ranks of one communicator map. */
typedef struct seg_header {
    atomic_int nranks;  /* set by the first rank to arrive */
    atomic_int joined;  /* ranks that mapped it */
    atomic_int present[EMU_MAX_RANKS];
    atomic_int count;   /* the barrier: ranks arrived in this generation */
    atomic_uint gen;    /* the barrier's generation */
    atomic_int aborted; /* rank + 1 of a rank that aborted, else 0 */
} seg_header;

typedef struct ncclComm {
    seg_header *seg;
    size_t seg_bytes;
    unsigned char *slots; /* nranks slots of nranks * EMU_CHUNK bytes */
    int nranks, rank;
    int blocking;
    ncclResult_t async; /* ncclCommGetAsyncError's answer */
    char last[512];
} ncclComm;

/* ---- errors --------------------------------------------------------------------------- */

static void set_last(ncclComm *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void set_last(ncclComm *c, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->last, sizeof c->last, fmt, ap);
    va_end(ap);
}

static char init_error[512]; /* the last error outside a communicator */

const char *ncclGetErrorString(ncclResult_t r)
{
    switch (r) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error (emulated NCCL)";
    case ncclSystemError: return "unhandled system error (emulated NCCL)";
    case ncclInternalError: return "internal error (emulated NCCL)";
    case ncclInvalidArgument: return "invalid argument (emulated NCCL)";
    case ncclInvalidUsage: return "invalid usage (emulated NCCL)";
    case ncclRemoteError: return "remote process exited or there was a network error (emulated NCCL)";
    case ncclInProgress: return "NCCL operation in progress";
    default: return "unknown result code";
    }
}

const char *ncclGetLastError(ncclComm_t c)
{
    return c ? c->last : init_error;
}

ncclResult_t ncclGetVersion(int *v)
{
    if (!v)
        return ncclInvalidArgument;
    *v = NCCL_VERSION_CODE;
    return ncclSuccess;
}

/* ---- the emulated device's stream -------------------------------------------------- */

/* A function of the module SPOTUNE_CUDA_MODULE names, once the process has
 * loaded it; NULL before or without it. */
static void *module_fn(const char *name)
{
    const char *mod = getenv("SPOTUNE_CUDA_MODULE");
    void *h = mod ? dlopen(mod, RTLD_LAZY | RTLD_NOLOAD) : NULL;
    void *fn = NULL;
    if (h) {
        fn = dlsym(h, name);
        dlclose(h); /* still loaded: the process holds it */
    }
    return fn;
}

static int stream_capturing(cudaStream_t s)
{
    static int (*fn)(void *);
    if (!fn)
        *(void **)&fn = module_fn("spotune_emu_stream_capturing");
    return fn && fn((void *)s);
}

/* The work the emulated device holds on s (SPOTUNE_CUDA_EMU_DEFER) runs
 * before what this emulation does at once on s: so a collective sees what
 * the stream's earlier work, and what that waited for, wrote. */
static void stream_run(cudaStream_t s)
{
    static void (*fn)(void *);
    if (!fn)
        *(void **)&fn = module_fn("spotune_emu_stream_run");
    if (fn)
        fn((void *)s);
}

/* With SPOTUNE_CUDA_EMU_DEFER a lagging stream holds its work until it must
 * run: a collective then writes its result when s's work comes to it, not
 * when issued (its inputs are read at the call, where every rank meets),
 * so work of another stream that reads the result without waiting for s
 * sees the old values (on a stream that does not lag, the write is at
 * once). NULL without it: the result is written at once. */
typedef void (*enqueue_fn)(void *s, void (*fn)(void *), void *arg);
static enqueue_fn deferred_enqueue(void)
{
    static enqueue_fn fn;
    static int looked;
    if (!looked) {
        const char *e = getenv("SPOTUNE_CUDA_EMU_DEFER");
        if (e && *e && strcmp(e, "0") != 0)
            *(void **)&fn = module_fn("spotune_emu_stream_enqueue");
        looked = 1;
    }
    return fn;
}

typedef struct late_write {
    void *dst;
    size_t bytes;
    unsigned char data[];
} late_write;

static void late_write_run(void *arg)
{
    late_write *w = arg;
    memcpy(w->dst, w->data, w->bytes);
    free(w);
}

/* The CUDA runtime calls of comm_nccl.c, on the emulated device: its
 * memory is host memory and its work is done once issued. */
cudaError_t cudaSetDevice(int device)
{
    return device >= 0 && device < EMU_MAX_RANKS ? cudaSuccess : cudaErrorInvalidDevice;
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, enum cudaMemcpyKind kind,
                            cudaStream_t s)
{
    (void)kind;
    if (stream_capturing(s))
        return cudaErrorStreamCaptureUnsupported;
    stream_run(s);
    if (bytes)
        memmove(dst, src, bytes);
    return cudaSuccess;
}

cudaError_t cudaStreamQuery(cudaStream_t s)
{
    stream_run(s); /* asked whether it is done: it is, from now */
    return cudaSuccess;
}

const char *cudaGetErrorName(cudaError_t e)
{
    switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorStreamCaptureUnsupported: return "cudaErrorStreamCaptureUnsupported";
    default: return "cudaErrorUnknown";
    }
}

const char *cudaGetErrorString(cudaError_t e)
{
    return e == cudaSuccess ? "no error" : "emulated CUDA runtime error (emu_nccl.c)";
}

/* ---- meeting the other ranks ---------------------------------------------------------- */

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static double timeout_s(void)
{
    const char *env = getenv("SPOTUNE_NCCL_EMU_TIMEOUT_S");
    if (env && strcmp(env, "never") == 0) /* as NCCL: a peer that never comes is no error */
        return INFINITY;
    double t = env ? atof(env) : 60.0;
    return t > 0 ? t : 60.0;
}

static void pause_a_little(int *spins)
{
    struct timespec ts = {0, *spins < 200 ? 0L : *spins < 2000 ? 20000L : 1000000L};
    (*spins)++;
    if (ts.tv_nsec)
        nanosleep(&ts, NULL);
}

/* 0 once every rank arrived; ncclRemoteError (the communicator's async
 * error set, with why) when a peer aborted or the wait timed out. */
static ncclResult_t barrier(ncclComm *c, const char *what)
{
    seg_header *h = c->seg;
    unsigned gen = atomic_load(&h->gen);
    if (atomic_fetch_add(&h->count, 1) == c->nranks - 1) {
        atomic_store(&h->count, 0);
        atomic_fetch_add(&h->gen, 1);
        return ncclSuccess;
    }
    double t0 = now_s(), limit = timeout_s();
    int spins = 0;
    while (atomic_load(&h->gen) == gen) {
        int ab = atomic_load(&h->aborted);
        if (ab) {
            set_last(c, "%s: rank %d aborted the communicator", what, ab - 1);
            c->async = ncclRemoteError;
            return ncclRemoteError;
        }
        if (now_s() - t0 > limit) {
            set_last(c, "%s: rank %d waited %g s for its peers (SPOTUNE_NCCL_EMU_TIMEOUT_S): "
                     "a peer died or issued other collectives", what, c->rank, limit);
            c->async = ncclRemoteError;
            atomic_store(&h->aborted, c->rank + 1); /* the others stop waiting too */
            return ncclRemoteError;
        }
        pause_a_little(&spins);
    }
    return ncclSuccess;
}

/* ---- communicators ------------------------------------------------------------------- */

ncclResult_t ncclGetUniqueId(ncclUniqueId *id)
{
    struct timespec ts;
    if (!id)
        return ncclInvalidArgument;
    clock_gettime(CLOCK_REALTIME, &ts);
    memset(id, 0, sizeof *id);
    snprintf(id->internal, sizeof id->internal, "%s-%ld-%ld-%ld", EMU_ID_MAGIC, (long)getpid(),
             (long)ts.tv_sec, ts.tv_nsec);
    return ncclSuccess;
}

static size_t segment_bytes(int nranks)
{
    return 4096 + (size_t)nranks * (size_t)nranks * EMU_CHUNK;
}

static ncclResult_t init_fail(ncclResult_t r, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static ncclResult_t init_fail(ncclResult_t r, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(init_error, sizeof init_error, fmt, ap);
    va_end(ap);
    return r;
}

static ncclResult_t comm_open(ncclComm **out, int nranks, const ncclUniqueId *id, int rank,
                              int blocking)
{
    char name[160];
    *out = NULL;
    if (!module_fn("spotune_emu_stream_capturing"))
        return init_fail(ncclInvalidUsage, "the NCCL emulation runs on the emulated CUDA device "
                         "only (SPOTUNE_CUDA_MODULE naming libspotune_cuda_emu.so, loaded)");
    if (strncmp(id->internal, EMU_ID_MAGIC, strlen(EMU_ID_MAGIC)) != 0)
        return init_fail(ncclInvalidArgument, "not a unique id of the NCCL emulation");
    if (nranks < 1 || nranks > EMU_MAX_RANKS || rank < 0 || rank >= nranks)
        return init_fail(ncclInvalidArgument, "rank %d of %d (the emulation takes 1 to %d ranks)",
                         rank, nranks, EMU_MAX_RANKS);
    snprintf(name, sizeof name, "/%.120s", id->internal);
    int fd = shm_open(name, O_CREAT | O_RDWR, 0600);
    if (fd < 0)
        return init_fail(ncclSystemError, "shm_open %s: %s", name, strerror(errno));
    size_t bytes = segment_bytes(nranks);
    struct stat st;
    if (fstat(fd, &st) != 0 || ((size_t)st.st_size < bytes && ftruncate(fd, (off_t)bytes) != 0)) {
        int e = errno;
        close(fd);
        return init_fail(ncclSystemError, "sizing %s: %s", name, strerror(e));
    }
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED)
        return init_fail(ncclSystemError, "mmap %s: %s", name, strerror(errno));
    ncclComm *c = calloc(1, sizeof *c);
    if (!c) {
        munmap(p, bytes);
        return init_fail(ncclSystemError, "out of memory");
    }
    c->seg = p;
    c->seg_bytes = bytes;
    c->slots = (unsigned char *)p + 4096;
    c->nranks = nranks;
    c->rank = rank;
    c->blocking = blocking;
    int expect = 0;
    seg_header *h = c->seg;
    if (!atomic_compare_exchange_strong(&h->nranks, &expect, nranks) && expect != nranks) {
        munmap(p, bytes);
        free(c);
        return init_fail(ncclInvalidArgument, "rank %d says %d ranks, a peer said %d", rank, nranks,
                         expect);
    }
    if (atomic_exchange(&h->present[rank], 1)) {
        munmap(p, bytes);
        free(c);
        return init_fail(ncclInvalidArgument, "rank %d joined twice", rank);
    }
    atomic_fetch_add(&h->joined, 1);
    ncclResult_t r = barrier(c, "ncclCommInitRank");
    if (r == ncclSuccess && rank == 0)
        shm_unlink(name); /* every rank has it mapped: nothing is left behind */
    if (r != ncclSuccess) {
        init_fail(r, "%s", c->last);
        shm_unlink(name);
        munmap(p, bytes);
        free(c);
        return r;
    }
    *out = c;
    return ncclSuccess;
}

static ncclResult_t answer(ncclComm *c, ncclResult_t r)
{
    if (r == ncclSuccess && !c->blocking) {
        c->async = ncclSuccess;
        return ncclInProgress;
    }
    return r;
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank,
                                    ncclConfig_t *config)
{
    if (!comm)
        return ncclInvalidArgument;
    int blocking = !config || config->blocking == NCCL_CONFIG_UNDEF_INT || config->blocking;
    ncclResult_t r = comm_open(comm, nranks, &id, rank, blocking);
    return r == ncclSuccess ? answer(*comm, r) : r;
}

ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank)
{
    return ncclCommInitRankConfig(comm, nranks, id, rank, NULL);
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t c, ncclResult_t *state)
{
    if (!c || !state)
        return ncclInvalidArgument;
    *state = c->async;
    return ncclSuccess;
}

ncclResult_t ncclCommFinalize(ncclComm_t c)
{
    return c ? answer(c, c->async) : ncclInvalidArgument;
}

static void comm_close(ncclComm *c)
{
    munmap(c->seg, c->seg_bytes);
    free(c);
}

ncclResult_t ncclCommDestroy(ncclComm_t c)
{
    if (!c)
        return ncclInvalidArgument;
    comm_close(c);
    return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t c)
{
    if (!c)
        return ncclInvalidArgument;
    int none = 0;
    atomic_compare_exchange_strong(&c->seg->aborted, &none, c->rank + 1);
    comm_close(c);
    return ncclSuccess;
}

/* ---- arithmetic ---------------------------------------------------------------------- */

static size_t type_size(ncclDataType_t t)
{
    switch (t) {
    case ncclInt8: case ncclUint8: return 1;
    case ncclBfloat16: return 2;
    case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
    case ncclInt64: case ncclUint64: case ncclFloat64: return 8;
    default: return 0; /* not emulated: fp16, fp8 */
    }
}

/* The value of element i of slot data p as a double (integers exactly up
 * to 2^53), and back. */
static double get(const unsigned char *p, size_t i, ncclDataType_t t)
{
    switch (t) {
    case ncclInt8: return ((const int8_t *)p)[i];
    case ncclUint8: return p[i];
    case ncclBfloat16: return emu_bf16_to_f32(((const uint16_t *)p)[i]);
    case ncclInt32: return ((const int32_t *)p)[i];
    case ncclUint32: return ((const uint32_t *)p)[i];
    case ncclFloat32: return ((const float *)p)[i];
    case ncclInt64: return (double)((const int64_t *)p)[i];
    case ncclUint64: return (double)((const uint64_t *)p)[i];
    default: return ((const double *)p)[i];
    }
}

static void put(unsigned char *p, size_t i, ncclDataType_t t, double v)
{
    switch (t) {
    case ncclInt8: ((int8_t *)p)[i] = (int8_t)v; break;
    case ncclUint8: p[i] = (uint8_t)v; break;
    case ncclBfloat16: ((uint16_t *)p)[i] = emu_f32_to_bf16((float)v); break;
    case ncclInt32: ((int32_t *)p)[i] = (int32_t)v; break;
    case ncclUint32: ((uint32_t *)p)[i] = (uint32_t)v; break;
    case ncclFloat32: ((float *)p)[i] = (float)v; break;
    case ncclInt64: ((int64_t *)p)[i] = (int64_t)v; break;
    case ncclUint64: ((uint64_t *)p)[i] = (uint64_t)v; break;
    default: ((double *)p)[i] = v; break;
    }
}

static int is_float(ncclDataType_t t)
{
    return t == ncclBfloat16 || t == ncclFloat32 || t == ncclFloat64;
}

/* Element i of the reduction over the ranks' pieces at src[r] (rank
 * order). Float sums accumulate in the type's own precision (float for
 * bf16 and f32, double for f64): one rounding to the type at the end. */
static double reduce_one(const unsigned char *const *src, int nranks, size_t i, ncclDataType_t t,
                         ncclRedOp_t op)
{
    if (t == ncclBfloat16 || t == ncclFloat32) {
        float acc = (float)get(src[0], i, t);
        for (int r = 1; r < nranks; r++) {
            float v = (float)get(src[r], i, t);
            acc = op == ncclMax ? fmaxf(acc, v) : op == ncclMin ? fminf(acc, v) : acc + v;
        }
        return op == ncclAvg ? (double)(acc / (float)nranks) : (double)acc;
    }
    double acc = get(src[0], i, t);
    for (int r = 1; r < nranks; r++) {
        double v = get(src[r], i, t);
        acc = op == ncclMax ? fmax(acc, v) : op == ncclMin ? fmin(acc, v) : acc + v;
    }
    if (op == ncclAvg)
        acc = is_float(t) ? acc / nranks : trunc(acc / nranks);
    return acc;
}

/* ---- collectives --------------------------------------------------------------------- */

typedef enum { OP_ALLREDUCE, OP_REDUCE, OP_BCAST, OP_REDUCE_SCATTER, OP_ALLGATHER } op_kind;

typedef struct coll {
    op_kind kind;
    const void *send;
    void *recv;
    size_t count;
    ncclDataType_t type;
    ncclRedOp_t op;
    int root;
    ncclComm *comm;
    cudaStream_t stream;
} coll;

static const char *kind_name(op_kind k)
{
    static const char *const names[] = {"ncclAllReduce", "ncclReduce", "ncclBroadcast",
                                        "ncclReduceScatter", "ncclAllGather"};
    return names[k];
}

static unsigned char *slot(ncclComm *c, int rank, int piece)
{
    return c->slots + ((size_t)rank * (size_t)c->nranks + (size_t)piece) * EMU_CHUNK;
}

/* One collective, chunk by chunk: each rank puts its pieces in its slots,
 * all meet, each takes what it receives, all meet again. */
/* SPOTUNE_NCCL_EMU_STALL=R:N: rank R's N-th collective run (from 1) never
 * returns: the rank stays alive and stuck, as one whose GPU hung, which
 * the launcher cannot see (the others' watchdogs must end the job).
 * R:N:S: it returns after S seconds (NCCL connecting slowly). */
static void stall_if_asked(const ncclComm *c)
{
    static int runs;
    const char *e = getenv("SPOTUNE_NCCL_EMU_STALL");
    int r, n, secs = -1;
    if (!e || sscanf(e, "%d:%d:%d", &r, &n, &secs) < 2 || r != c->rank || ++runs != n)
        return;
    if (secs >= 0) {
        fprintf(stderr, "nccl-emu: rank %d holds its collective %d for %d s "
                        "(SPOTUNE_NCCL_EMU_STALL)\n", r, n, secs);
        struct timespec ts = {secs, 0};
        while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
            ;
        return;
    }
    fprintf(stderr, "nccl-emu: rank %d stalls in its collective %d (SPOTUNE_NCCL_EMU_STALL)\n",
            r, n);
    for (;;)
        pause();
}

static ncclResult_t run(const coll *o)
{
    stall_if_asked(o->comm);
    ncclComm *c = o->comm;
    stream_run(o->stream);
    size_t es = type_size(o->type);
    size_t per = EMU_CHUNK / es; /* elements of one piece */
    const unsigned char *send = o->send;
    unsigned char *recv = o->recv;
    enqueue_fn later = deferred_enqueue();
    late_write *w = NULL;
    if (later && !(o->kind == OP_REDUCE && c->rank != o->root)) {
        size_t bytes = o->count * es * (o->kind == OP_ALLGATHER ? (size_t)c->nranks : 1);
        w = malloc(sizeof *w + (bytes ? bytes : 1));
        if (!w)
            return ncclSystemError;
        w->dst = o->recv;
        w->bytes = bytes;
        recv = w->data;
    }
    const unsigned char *src[EMU_MAX_RANKS];
    for (size_t off = 0; off < o->count || (off == 0 && o->count == 0); off += per) {
        size_t n = o->count - off < per ? o->count - off : per;
        switch (o->kind) { /* put */
        case OP_ALLREDUCE: case OP_REDUCE: case OP_ALLGATHER:
            memcpy(slot(c, c->rank, 0), send + off * es, n * es);
            break;
        case OP_BCAST:
            if (c->rank == o->root)
                memcpy(slot(c, c->rank, 0), send + off * es, n * es);
            break;
        case OP_REDUCE_SCATTER:
            for (int d = 0; d < c->nranks; d++)
                memcpy(slot(c, c->rank, d), send + ((size_t)d * o->count + off) * es, n * es);
            break;
        }
        ncclResult_t r = barrier(c, kind_name(o->kind));
        if (r) {
            free(w);
            return r;
        }
        switch (o->kind) { /* take */
        case OP_ALLREDUCE: case OP_REDUCE: case OP_REDUCE_SCATTER: {
            if (o->kind == OP_REDUCE && c->rank != o->root)
                break;
            int piece = o->kind == OP_REDUCE_SCATTER ? c->rank : 0;
            for (int s = 0; s < c->nranks; s++)
                src[s] = slot(c, s, piece);
            for (size_t i = 0; i < n; i++)
                put(recv + off * es, i, o->type, reduce_one(src, c->nranks, i, o->type, o->op));
            break;
        }
        case OP_BCAST:
            memcpy(recv + off * es, slot(c, o->root, 0), n * es);
            break;
        case OP_ALLGATHER:
            for (int s = 0; s < c->nranks; s++)
                memcpy(recv + ((size_t)s * o->count + off) * es, slot(c, s, 0), n * es);
            break;
        }
        r = barrier(c, kind_name(o->kind));
        if (r) {
            free(w);
            return r;
        }
        if (o->count == 0)
            break;
    }
    if (w)
        later((void *)o->stream, late_write_run, w);
    return ncclSuccess;
}

/* calls held between ncclGroupStart and ncclGroupEnd (this thread's) */
static _Thread_local int group_depth;
static _Thread_local coll *held;
static _Thread_local size_t nheld, capheld;

static ncclResult_t issue(coll o)
{
    ncclComm *c = o.comm;
    if (!c)
        return ncclInvalidArgument;
    if (c->async != ncclSuccess) {
        set_last(c, "%s on a communicator that failed", kind_name(o.kind));
        return ncclInvalidUsage;
    }
    if (!type_size(o.type) || (unsigned)o.op > ncclAvg ||
        ((o.kind == OP_REDUCE || o.kind == OP_BCAST) && (o.root < 0 || o.root >= c->nranks))) {
        set_last(c, "%s: datatype %d, op %d or root %d not emulated", kind_name(o.kind),
                 (int)o.type, (int)o.op, o.root);
        return ncclInvalidArgument;
    }
    if (stream_capturing(o.stream)) {
        set_last(c, "%s on a stream being captured: the emulation cannot record a collective "
                 "into a graph", kind_name(o.kind));
        return ncclInvalidUsage;
    }
    if (group_depth > 0) {
        if (nheld == capheld) {
            size_t cap = capheld ? 2 * capheld : 16;
            coll *p = realloc(held, cap * sizeof *p);
            if (!p)
                return ncclSystemError;
            held = p, capheld = cap;
        }
        held[nheld++] = o;
        return ncclSuccess;
    }
    return answer(c, run(&o));
}

ncclResult_t ncclGroupStart(void)
{
    group_depth++;
    return ncclSuccess;
}

ncclResult_t ncclGroupEnd(void)
{
    if (group_depth <= 0)
        return ncclInvalidUsage;
    if (--group_depth > 0)
        return ncclSuccess;
    ncclResult_t r = ncclSuccess;
    ncclComm *last = NULL;
    for (size_t i = 0; i < nheld && r == ncclSuccess; i++)
        r = run(&held[i]), last = held[i].comm;
    nheld = 0;
    return last ? answer(last, r) : r;
}

ncclResult_t ncclAllReduce(const void *send, void *recv, size_t count, ncclDataType_t type,
                           ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream)
{
    return issue((coll){OP_ALLREDUCE, send, recv, count, type, op, 0, comm, stream});
}

ncclResult_t ncclReduce(const void *send, void *recv, size_t count, ncclDataType_t type,
                        ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream)
{
    return issue((coll){OP_REDUCE, send, recv, count, type, op, root, comm, stream});
}

ncclResult_t ncclBroadcast(const void *send, void *recv, size_t count, ncclDataType_t type,
                           int root, ncclComm_t comm, cudaStream_t stream)
{
    return issue((coll){OP_BCAST, send, recv, count, type, ncclSum, root, comm, stream});
}

ncclResult_t ncclReduceScatter(const void *send, void *recv, size_t count, ncclDataType_t type,
                               ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream)
{
    return issue((coll){OP_REDUCE_SCATTER, send, recv, count, type, op, 0, comm, stream});
}

ncclResult_t ncclAllGather(const void *send, void *recv, size_t count, ncclDataType_t type,
                           ncclComm_t comm, cudaStream_t stream)
{
    return issue((coll){OP_ALLGATHER, send, recv, count, type, ncclSum, 0, comm, stream});
}
