/* comm/comm_nccl.c — collectives over device buffers, on NCCL.
 *
 * Owns: binding the rank to its CUDA device, the NCCL communicator (unique
 * id made by rank 0 and broadcast over MPI; created non-blocking so that no
 * call can hang forever), enqueuing collectives on the caller's stream, and
 * waiting for them with a timeout: comm_device_wait polls the stream and
 * NCCL's asynchronous error, and aborts the communicator on error or
 * timeout. A world of one (under mpirun -np 1 too) has no communicator: its
 * collectives are local copies, unless comm_opts.nccl_world_of_one asked for a one-rank
 * NCCL communicator (to run the NCCL path on a single GPU). Without CUDA every entry point returns an error.
 *
 * NCCL and the CUDA runtime are loaded on first use (dlopen), not linked:
 * the CUDA build's binary starts, and trains on the CPU or on one GPU, on a
 * machine without them (one GPU needs only the runtime); what cannot be
 * loaded is named when it is needed. */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "comm_internal.h"

#ifndef SPOTUNE_COMM_NCCL

int comm_device_available(void) { return 0; }

void comm_nccl_version(char *buf, size_t n)
{
    snprintf(buf, n, "no NCCL (spotune was built without CUDA)");
}

static int no_cuda(sp_err *err, const char *fn)
{
    return sp_fail(err, SP_EXIT_OTHER, "%s: spotune was built without CUDA", fn);
}

void comm_device_free(comm_t *c) { (void)c; }
void *comm_device_nccl(comm_t *c)
{
    (void)c;
    return NULL;
}

int comm_device_init(comm_t *c, int device, sp_err *err)
{
    (void)c, (void)device;
    return no_cuda(err, "comm_device_init");
}

int comm_device_allreduce(comm_t *c, void *buf, size_t n, comm_dtype dt, comm_op op,
                          void *stream, sp_err *err)
{
    (void)c, (void)buf, (void)n, (void)dt, (void)op, (void)stream;
    return no_cuda(err, "comm_device_allreduce");
}

int comm_device_reduce_scatter(comm_t *c, const void *send, void *recv, size_t n, comm_dtype dt,
                               comm_op op, void *stream, sp_err *err)
{
    (void)c, (void)send, (void)recv, (void)n, (void)dt, (void)op, (void)stream;
    return no_cuda(err, "comm_device_reduce_scatter");
}

int comm_device_allgather(comm_t *c, const void *send, void *recv, size_t n, comm_dtype dt,
                          void *stream, sp_err *err)
{
    (void)c, (void)send, (void)recv, (void)n, (void)dt, (void)stream;
    return no_cuda(err, "comm_device_allgather");
}

int comm_device_bcast(comm_t *c, void *buf, size_t n, comm_dtype dt, int root, void *stream,
                      sp_err *err)
{
    (void)c, (void)buf, (void)n, (void)dt, (void)root, (void)stream;
    return no_cuda(err, "comm_device_bcast");
}

int comm_device_reduce(comm_t *c, void *buf, size_t n, comm_dtype dt, comm_op op, int root,
                       void *stream, sp_err *err)
{
    (void)c, (void)buf, (void)n, (void)dt, (void)op, (void)root, (void)stream;
    return no_cuda(err, "comm_device_reduce");
}

int comm_device_wait(comm_t *c, void *stream, sp_err *err)
{
    (void)c, (void)stream;
    return no_cuda(err, "comm_device_wait");
}

int comm_device_group_begin(comm_t *c, sp_err *err)
{
    (void)c;
    return no_cuda(err, "comm_device_group_begin");
}

int comm_device_group_end(comm_t *c, sp_err *err)
{
    (void)c;
    return no_cuda(err, "comm_device_group_end");
}

int comm_device_collectives(const comm_t *c)
{
    return c->size > 1;
}

#else /* SPOTUNE_COMM_NCCL */

#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <nccl.h>
#include <pthread.h>

/* ---- the libraries, loaded on first use ---------------------------------- */

#define NCCL_FNS(X)                                                                          \
    X(ncclGetVersion) X(ncclGetUniqueId) X(ncclCommInitRankConfig) X(ncclCommGetAsyncError)  \
    X(ncclCommFinalize) X(ncclCommDestroy) X(ncclCommAbort) X(ncclGetErrorString)             \
    X(ncclGetLastError) X(ncclGroupStart) X(ncclGroupEnd) X(ncclAllReduce) X(ncclReduce)      \
    X(ncclBroadcast) X(ncclReduceScatter) X(ncclAllGather)
#define CUDART_FNS(X)                                                                        \
    X(cudaSetDevice) X(cudaMemcpyAsync) X(cudaStreamQuery) X(cudaGetErrorName)                \
    X(cudaGetErrorString)

#define NCCL_STR_(x) #x
#define NCCL_STR(x) NCCL_STR_(x)

static struct {
#define X(f) __typeof__(f) *f;
    NCCL_FNS(X) CUDART_FNS(X)
#undef X
    int nccl_ok, cudart_ok;
    char nccl_why[512], cudart_why[512];
} lib;
static pthread_once_t lib_once = PTHREAD_ONCE_INIT;

/* soname as the loader finds it, else (a bare name) in build_dir, where
 * the build found it: what a linked library's RUNPATH gave before. The
 * loader's reason for the first into why when neither opens. */
static void *lib_open(const char *soname, const char *build_dir, char *why, size_t n)
{
    void *h = dlopen(soname, RTLD_NOW | RTLD_GLOBAL);
    if (h)
        return h;
    const char *e = dlerror();
    snprintf(why, n, "%s", e ? e : soname);
    if (strchr(soname, '/') || !build_dir[0])
        return NULL;
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", build_dir, soname);
    return dlopen(path, RTLD_NOW | RTLD_GLOBAL);
}

/* name from the process (a library already loaded, or one preloaded in
 * NCCL's place: the tests' emulation), else from soname, opened once into
 * *h; NULL with why set. */
static void *lib_sym(void **h, const char *soname, const char *build_dir, const char *name,
                     char *why, size_t n)
{
    void *p = dlsym(RTLD_DEFAULT, name);
    if (p)
        return p;
    if (!*h && !(*h = lib_open(soname, build_dir, why, n)))
        return NULL;
    if (!(p = dlsym(*h, name)))
        snprintf(why, n, "%s has no %s", soname, name);
    return p;
}

/* SPOTUNE_NCCL_LIBRARY: the NCCL to open instead of libnccl.so.<major>
 * (a path, or a name the loader searches for). */
static const char *nccl_soname(void)
{
    const char *e = getenv("SPOTUNE_NCCL_LIBRARY");
    return e && *e ? e : "libnccl.so." NCCL_STR(NCCL_MAJOR);
}

static void lib_load(void)
{
    void *nccl = NULL, *cudart = NULL;
    char cudart_name[64];
    const char *nccl_name = nccl_soname();
    snprintf(cudart_name, sizeof cudart_name, "libcudart.so.%d", CUDART_VERSION / 1000);
    lib.nccl_ok = lib.cudart_ok = 1;
#define X(f)                                                                                 \
    if (lib.nccl_ok &&                                                                       \
        !(*(void **)&lib.f = lib_sym(&nccl, nccl_name, SPOTUNE_NCCL_DIR, #f, lib.nccl_why,  \
                                     sizeof lib.nccl_why)))                                 \
        lib.nccl_ok = 0;
    NCCL_FNS(X)
#undef X
#define X(f)                                                                                 \
    if (lib.cudart_ok && !(*(void **)&lib.f = lib_sym(&cudart, cudart_name, SPOTUNE_CUDART_DIR, \
                                                      #f, lib.cudart_why,                       \
                                                      sizeof lib.cudart_why)))                  \
        lib.cudart_ok = 0;
    CUDART_FNS(X)
#undef X
}

static int have_nccl(void)
{
    pthread_once(&lib_once, lib_load);
    return lib.nccl_ok;
}

static int have_cudart(void)
{
    pthread_once(&lib_once, lib_load);
    return lib.cudart_ok;
}

struct comm_device {
    int device;
    ncclComm_t nccl; /* NULL in a world of one without MPI */
    int broken;      /* set once the communicator was aborted */
    int grouped;     /* inside comm_device_group_begin/end with NCCL */
};

int comm_device_available(void)
{
    return have_nccl() && have_cudart();
}

void comm_nccl_version(char *buf, size_t n)
{
    int v = 0;
    if (!have_nccl())
        snprintf(buf, n, "not loadable (%s)", lib.nccl_why);
    else if (lib.ncclGetVersion(&v) != ncclSuccess)
        snprintf(buf, n, "unknown (ncclGetVersion failed)");
    else /* NCCL_VERSION_CODE: 10000 major + 100 minor + patch since 2.9 */
        snprintf(buf, n, "NCCL %d.%d.%d", v / 10000, v / 100 % 100, v % 100);
}

/* ---- error reporting ---------------------------------------------------- */

static int cuda_fail(comm_t *c, sp_err *err, cudaError_t e, const char *fn, const char *file,
                     int line)
{
    return sp_fail(err, SP_EXIT_OTHER, "%s:%d: rank %d on %s: %s: %s (%s)", file, line, c->rank,
                   c->host, fn, lib.cudaGetErrorString(e), lib.cudaGetErrorName(e));
}

/* comm, when there is one, adds NCCL's own last message. */
static int nccl_fail(comm_t *c, ncclComm_t comm, sp_err *err, ncclResult_t r, const char *fn,
                     const char *file, int line)
{
    const char *last = comm ? lib.ncclGetLastError(comm) : NULL;
    return sp_fail(err, SP_EXIT_OTHER, "%s:%d: rank %d on %s: %s: %s%s%s", file, line, c->rank,
                   c->host, fn, lib.ncclGetErrorString(r), last && last[0] ? ": " : "",
                   last ? last : "");
}

#define CUDA_TRY(c, err, fn, args)                                                       \
    do {                                                                                 \
        cudaError_t cuda_rc_ = lib.fn args;                                              \
        if (cuda_rc_ != cudaSuccess)                                                     \
            return cuda_fail((c), (err), cuda_rc_, #fn, __FILE__, __LINE__);             \
    } while (0)

static ncclDataType_t nccl_type(comm_dtype dt)
{
    switch (dt) {
    case COMM_F32: return ncclFloat32;
    case COMM_F64: return ncclFloat64;
    case COMM_I32: return ncclInt32;
    case COMM_I64: return ncclInt64;
    case COMM_U8: return ncclUint8;
    default: return ncclBfloat16;
    }
}

static ncclRedOp_t nccl_op(comm_op op)
{
    switch (op) {
    case COMM_MAX: return ncclMax;
    case COMM_MIN: return ncclMin;
    case COMM_AVG: return ncclAvg;
    default: return ncclSum;
    }
}

/* ---- waiting on a non-blocking communicator ----------------------------- */

/* Sleeps a little longer each time, from a spin to 1 ms: a collective that
 * ends in microseconds is seen at once, a long one costs no CPU. */
static void backoff(int *spins)
{
    struct timespec ts = {0, 0};
    if (*spins < 100) {
        (*spins)++;
        return;
    }
    ts.tv_nsec = *spins < 1100 ? 10000L : 1000000L;
    (*spins)++;
    nanosleep(&ts, NULL);
}

/* Aborts the communicator (the job is ending; its own error adds
 * nothing), after closing a group left open: an abort inside one waits
 * for a group end that would never come. */
static void device_break(comm_t *c)
{
    if (c->dev->nccl && c->dev->grouped)
        (void)lib.ncclGroupEnd();
    if (c->dev->nccl)
        lib.ncclCommAbort(c->dev->nccl);
    c->dev->nccl = NULL;
    c->dev->broken = 1;
}

/* Polls the communicator until its pending operation (init, an enqueue,
 * finalize) leaves ncclInProgress; aborts it on error or timeout. */
static int nccl_settle(comm_t *c, ncclComm_t comm, const char *what, const char *file, int line,
                       sp_err *err)
{
    double t0 = sp_now();
    int spins = 0;
    for (;;) {
        ncclResult_t state = ncclInProgress;
        ncclResult_t r = lib.ncclCommGetAsyncError(comm, &state);
        if (r != ncclSuccess)
            state = r;
        if (state == ncclSuccess)
            return 0;
        if (state != ncclInProgress) {
            nccl_fail(c, comm, err, state, what, file, line);
            lib.ncclCommAbort(comm);
            return err->code;
        }
        if (c->timeout_s > 0 && sp_now() - t0 > c->timeout_s) {
            lib.ncclCommAbort(comm);
            return sp_fail(err, SP_EXIT_OTHER,
                           "%s:%d: rank %d on %s: %s timed out after %g s (a peer may have died)",
                           file, line, c->rank, c->host, what, c->timeout_s);
        }
        backoff(&spins);
    }
}

/* The return of an enqueue on a non-blocking communicator: ncclInProgress
 * means "still being enqueued", so settle before the next NCCL call. */
static int nccl_enqueued(comm_t *c, ncclResult_t r, const char *fn, const char *file, int line,
                         sp_err *err)
{
    if (r == ncclSuccess)
        return 0;
    if (r == ncclInProgress) {
        ncclComm_t comm = c->dev->nccl;
        int rc = nccl_settle(c, comm, fn, file, line, err);
        if (rc) {
            c->dev->nccl = NULL;
            c->dev->broken = 1;
        }
        return rc;
    }
    nccl_fail(c, c->dev->nccl, err, r, fn, file, line);
    device_break(c);
    return err->code;
}
/* rc, after the watch over the call that gave it ends */
static int nccl_watched(comm_t *c, int rc)
{
    comm_watch_end(c);
    return rc;
}

/* An NCCL call under the watchdog (comm_watch_wait_begin): a call that
 * waits for peers (connecting, a full queue, the emulated NCCL's
 * collectives), its settling and an abort that hangs all end the job
 * after the timeout. */
#define NCCL_ENQUEUE(c, err, fn, args)                                                  \
    (comm_watch_wait_begin((c), #fn),                                                   \
     nccl_watched((c), nccl_enqueued((c), lib.fn args, #fn, __FILE__, __LINE__, (err))))

/* ---- communicator ------------------------------------------------------- */

/* Rank 0's unique id, with whether it could make one, so a failure there
 * reaches every rank instead of leaving them in ncclCommInitRank. */
struct nccl_id_msg {
    int ok;
    ncclUniqueId id;
};

static int share_unique_id(comm_t *c, ncclUniqueId *id, sp_err *err)
{
    struct nccl_id_msg msg;
    memset(&msg, 0, sizeof msg);
    if (c->rank == 0) {
        ncclResult_t r = lib.ncclGetUniqueId(&msg.id);
        msg.ok = r == ncclSuccess;
        if (!msg.ok)
            nccl_fail(c, NULL, err, r, "ncclGetUniqueId", __FILE__, __LINE__);
    }
    if (comm_bcast(c, &msg, sizeof msg, 0, err))
        return err->code;
    if (!msg.ok)
        return sp_fail(err, SP_EXIT_OTHER, "%s:%d: rank %d on %s: rank 0 could not make an NCCL id",
                       __FILE__, __LINE__, c->rank, c->host);
    *id = msg.id;
    return 0;
}

static int nccl_create(comm_t *c, struct comm_device *dev, sp_err *err)
{
    ncclUniqueId id;
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    ncclComm_t comm = NULL;
    ncclResult_t r;
    if (share_unique_id(c, &id, err))
        return err->code;
    config.blocking = 0;
    r = lib.ncclCommInitRankConfig(&comm, c->size, id, c->rank, &config);
    if (r != ncclSuccess && r != ncclInProgress) {
        nccl_fail(c, comm, err, r, "ncclCommInitRankConfig", __FILE__, __LINE__);
        if (comm)
            lib.ncclCommAbort(comm);
        return err->code;
    }
    if (nccl_settle(c, comm, "ncclCommInitRankConfig", __FILE__, __LINE__, err))
        return err->code;
    dev->nccl = comm;
    return 0;
}

/* Every rank learns whether any rank failed a step, so that all return an
 * error together instead of some waiting for the others in the next step.
 * A rank that failed keeps its own error. */
static int agree(comm_t *c, int failed, const char *step, sp_err *err)
{
    sp_err ignored = {0};
    int any = 0;
    if (!c->use_mpi)
        return failed ? err->code : 0;
    if (failed) {
        comm_any(c, 1, &any, &ignored);
        return err->code;
    }
    if (comm_any(c, 0, &any, err))
        return err->code;
    if (any)
        return sp_fail(err, SP_EXIT_OTHER, "%s:%d: rank %d on %s: %s failed on another rank",
                       __FILE__, __LINE__, c->rank, c->host, step);
    return 0;
}

/* Ranks that share gradients on CUDA need NCCL: said before the device is
 * touched, by every rank (agree() then ends all of them). */
static int need_nccl(comm_t *c, sp_err *err)
{
    if (have_nccl())
        return 0;
    int ranks = c->nccl_world_of_one ? 1 : c->size;
    return sp_fail(err, SP_EXIT_OTHER,
                   "%d rank%s on CUDA sharing gradients need%s NCCL, which could not be loaded: "
                   "%s (install NCCL %d, put its folder on LD_LIBRARY_PATH, or name the library "
                   "in SPOTUNE_NCCL_LIBRARY)",
                   ranks, ranks == 1 ? "" : "s", ranks == 1 ? "s" : "", lib.nccl_why, NCCL_MAJOR);
}

static int bind_device(comm_t *c, int device, sp_err *err)
{
    if (!have_cudart())
        return sp_fail(err, SP_EXIT_OTHER, "the CUDA runtime could not be loaded: %s",
                       lib.cudart_why);
    CUDA_TRY(c, err, cudaSetDevice, (device));
    return 0;
}

int comm_device_init(comm_t *c, int device, sp_err *err)
{
    struct comm_device *dev;
    int rc;
    if (c->dev) { /* the same device again: the communicator is kept */
        if (c->dev->device == device && !c->dev->broken)
            return 0;
        return sp_fail(err, SP_EXIT_OTHER,
                       "comm_device_init: this rank's NCCL communicator is %s on CUDA device %d "
                       "(asked for device %d)",
                       c->dev->broken ? "aborted" : "bound", c->dev->device, device);
    }
    /* a world of one (under mpirun -np 1 too) needs no communicator: its
     * collectives are local copies */
    int nccl = (c->use_mpi && c->size > 1) || c->nccl_world_of_one;
    dev = calloc(1, sizeof *dev);
    rc = !dev   ? sp_fail(err, SP_EXIT_OTHER, "comm_device_init: out of memory")
         : nccl ? need_nccl(c, err)
                : 0;
    rc = rc ? rc : bind_device(c, device, err);
    rc = agree(c, rc != 0, "binding the CUDA device", err);
    if (!rc && nccl) {
        rc = nccl_create(c, dev, err); /* its wait has its own timeout: nccl_settle */
        rc = agree(c, rc != 0, "creating the NCCL communicator", err);
    }
    if (rc) {
        if (dev && dev->nccl)
            lib.ncclCommAbort(dev->nccl);
        free(dev);
        return rc;
    }
    dev->device = device;
    c->dev = dev;
    return 0;
}

/* Finalize flushes the communicator's pending work; if that fails or
 * overruns the timeout, nccl_settle has aborted it already. */
static void nccl_release(comm_t *c, ncclComm_t comm)
{
    sp_err ignored = {0};
    ncclResult_t r = lib.ncclCommFinalize(comm);
    if (r != ncclSuccess && r != ncclInProgress) {
        lib.ncclCommAbort(comm);
        return;
    }
    if (nccl_settle(c, comm, "ncclCommFinalize", __FILE__, __LINE__, &ignored) == 0)
        lib.ncclCommDestroy(comm);
}

void *comm_device_nccl(comm_t *c)
{
    return c->dev ? (void *)c->dev->nccl : NULL;
}

void comm_device_free(comm_t *c)
{
    if (!c->dev)
        return;
    if (c->dev->nccl) {
        comm_watch_wait_begin(c, "ncclCommFinalize"); /* the abort it may end in can hang */
        nccl_release(c, c->dev->nccl);
        comm_watch_end(c);
    }
    free(c->dev);
    c->dev = NULL;
}

int comm_device_collectives(const comm_t *c)
{
    return c->size > 1 || (c->nccl_world_of_one && c->dev && c->dev->nccl);
}

/* ---- collectives -------------------------------------------------------- */

static int device_ready(comm_t *c, const char *fn, comm_dtype dt, comm_op op, sp_err *err)
{
    if (!c->dev)
        return sp_fail(err, SP_EXIT_OTHER, "%s: comm_device_init was not called", fn);
    if (c->dev->broken)
        return sp_fail(err, SP_EXIT_OTHER, "%s: rank %d on %s: the NCCL communicator was aborted",
                       fn, c->rank, c->host);
    if (comm_dtype_size(dt) == 0 || (unsigned)op > COMM_AVG)
        return sp_fail(err, SP_EXIT_OTHER, "%s: unknown dtype %d or op %d", fn, (int)dt, (int)op);
    return 0;
}

/* A world of one: the data is already where NCCL would put it, or a copy away. */
static int local_copy(comm_t *c, const void *send, void *recv, size_t bytes, void *stream,
                      sp_err *err)
{
    if (send != recv && bytes > 0)
        CUDA_TRY(c, err, cudaMemcpyAsync,
                 (recv, send, bytes, cudaMemcpyDeviceToDevice, (cudaStream_t)stream));
    return 0;
}

int comm_device_allreduce(comm_t *c, void *buf, size_t n, comm_dtype dt, comm_op op,
                          void *stream, sp_err *err)
{
    if (device_ready(c, "comm_device_allreduce", dt, op, err))
        return err->code;
    if (!c->dev->nccl)
        return 0;
    return NCCL_ENQUEUE(c, err, ncclAllReduce, (buf, buf, n, nccl_type(dt), nccl_op(op),
                                                c->dev->nccl, (cudaStream_t)stream));
}

int comm_device_reduce_scatter(comm_t *c, const void *send, void *recv, size_t n, comm_dtype dt,
                               comm_op op, void *stream, sp_err *err)
{
    if (device_ready(c, "comm_device_reduce_scatter", dt, op, err))
        return err->code;
    if (!c->dev->nccl)
        return local_copy(c, send, recv, n * comm_dtype_size(dt), stream, err);
    return NCCL_ENQUEUE(c, err, ncclReduceScatter, (send, recv, n, nccl_type(dt), nccl_op(op),
                                                    c->dev->nccl, (cudaStream_t)stream));
}

int comm_device_allgather(comm_t *c, const void *send, void *recv, size_t n, comm_dtype dt,
                          void *stream, sp_err *err)
{
    if (device_ready(c, "comm_device_allgather", dt, COMM_SUM, err))
        return err->code;
    if (!c->dev->nccl)
        return local_copy(c, send, recv, n * comm_dtype_size(dt), stream, err);
    return NCCL_ENQUEUE(c, err, ncclAllGather,
                        (send, recv, n, nccl_type(dt), c->dev->nccl, (cudaStream_t)stream));
}

int comm_device_bcast(comm_t *c, void *buf, size_t n, comm_dtype dt, int root, void *stream,
                      sp_err *err)
{
    if (device_ready(c, "comm_device_bcast", dt, COMM_SUM, err))
        return err->code;
    if (root < 0 || root >= c->size)
        return sp_fail(err, SP_EXIT_OTHER, "comm_device_bcast: root %d outside world of %d", root,
                       c->size);
    if (!c->dev->nccl)
        return 0;
    return NCCL_ENQUEUE(c, err, ncclBroadcast, (buf, buf, n, nccl_type(dt), root, c->dev->nccl,
                                                (cudaStream_t)stream));
}

int comm_device_reduce(comm_t *c, void *buf, size_t n, comm_dtype dt, comm_op op, int root,
                       void *stream, sp_err *err)
{
    if (device_ready(c, "comm_device_reduce", dt, op, err))
        return err->code;
    if (root < 0 || root >= c->size)
        return sp_fail(err, SP_EXIT_OTHER, "comm_device_reduce: root %d outside world of %d",
                       root, c->size);
    if (!c->dev->nccl)
        return 0;
    return NCCL_ENQUEUE(c, err, ncclReduce, (buf, buf, n, nccl_type(dt), nccl_op(op), root,
                                             c->dev->nccl, (cudaStream_t)stream));
}

int comm_device_group_begin(comm_t *c, sp_err *err)
{
    if (device_ready(c, "comm_device_group_begin", COMM_F32, COMM_SUM, err))
        return err->code;
    if (!c->dev->nccl || c->dev->grouped)
        return 0;
    ncclResult_t r = lib.ncclGroupStart();
    if (r != ncclSuccess) {
        nccl_fail(c, c->dev->nccl, err, r, "ncclGroupStart", __FILE__, __LINE__);
        device_break(c);
        return err->code;
    }
    c->dev->grouped = 1;
    return 0;
}

int comm_device_group_end(comm_t *c, sp_err *err)
{
    if (!c->dev || !c->dev->grouped)
        return c->dev ? 0 : sp_fail(err, SP_EXIT_OTHER,
                                    "comm_device_group_end: comm_device_init was not called");
    c->dev->grouped = 0;
    if (!c->dev->nccl) /* aborted inside the group: the job ends with that error */
        return sp_fail(err, SP_EXIT_OTHER,
                       "comm_device_group_end: rank %d on %s: the NCCL communicator was aborted",
                       c->rank, c->host);
    return NCCL_ENQUEUE(c, err, ncclGroupEnd, ());
}

/* One look at the communicator's asynchronous error; aborts it on error. */
static int device_async_ok(comm_t *c, sp_err *err)
{
    ncclResult_t state = ncclSuccess;
    ncclResult_t r;
    if (!c->dev->nccl)
        return 0;
    r = lib.ncclCommGetAsyncError(c->dev->nccl, &state);
    if (r != ncclSuccess)
        state = r;
    if (state == ncclSuccess || state == ncclInProgress)
        return 0;
    nccl_fail(c, c->dev->nccl, err, state, "ncclCommGetAsyncError", __FILE__, __LINE__);
    device_break(c);
    return err->code;
}

/* comm_device_wait's polling (its own timeout below the watchdog's) */
static int device_wait_poll(comm_t *c, void *stream, sp_err *err)
{
    double t0 = sp_now();
    int spins = 0;
    for (;;) {
        cudaError_t q = lib.cudaStreamQuery((cudaStream_t)stream);
        if (q == cudaSuccess)
            return device_async_ok(c, err);
        if (q != cudaErrorNotReady) {
            cuda_fail(c, err, q, "cudaStreamQuery", __FILE__, __LINE__);
            device_break(c);
            return err->code;
        }
        if (device_async_ok(c, err))
            return err->code;
        if (c->timeout_s > 0 && sp_now() - t0 > c->timeout_s) {
            device_break(c);
            return sp_fail(err, SP_EXIT_OTHER,
                           "%s:%d: rank %d on %s: device collective timed out after %g s "
                           "(a peer may have died)",
                           __FILE__, __LINE__, c->rank, c->host, c->timeout_s);
        }
        backoff(&spins);
    }
}

int comm_device_wait(comm_t *c, void *stream, sp_err *err)
{
    if (device_ready(c, "comm_device_wait", COMM_F32, COMM_SUM, err))
        return err->code;
    comm_watch_wait_begin(c, "comm_device_wait"); /* a query that blocks, an abort that hangs */
    int rc = device_wait_poll(c, stream, err);
    comm_watch_end(c);
    return rc;
}

#endif /* SPOTUNE_COMM_NCCL */
