/* comm/comm_mpi.c — the process world, the watchdog and the job-wide abort.
 *
 * Owns: detecting a launcher (mpirun, srun) and starting MPI only then (a
 * process started by hand, or a Criterion test, is a world of one that makes
 * no MPI call at all); rank, local rank and host; the watchdog thread that
 * ends the job when a collective overruns comm.timeout_s, naming the ranks
 * and hosts that did not answer its roll call (comm_roll.c); comm_abort,
 * which never waits more than COMM_ABORT_GRACE_S for MPI_Abort (a launcher
 * that has lost a node may never carry it out) before the rank exits by
 * itself. The host collectives themselves live in comm_host.c. */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "comm_internal.h"

/* ---- launcher detection and settings ------------------------------------ */

static int env_set(const char *name)
{
    const char *v = getenv(name);
    return v && v[0];
}

/* True when a process manager started us, so MPI_Init will find its peers. */
static int under_launcher(void)
{
    if (env_set("OMPI_COMM_WORLD_SIZE") || env_set("PMIX_RANK") || env_set("PMI_RANK"))
        return 1;
    return env_set("SLURM_PROCID") &&
           (env_set("PMI_FD") || env_set("PMI_SIZE") || env_set("PMIX_NAMESPACE"));
}

static int env_int(const char *name, int fallback)
{
    const char *v = getenv(name);
    char *end;
    long x;
    if (!v || !v[0])
        return fallback;
    x = strtol(v, &end, 10);
    return (*end || x < 0 || x > INT_MAX) ? fallback : (int)x;
}

/* A size in bytes from the environment, or `fallback` when unset. */
static int env_bytes(const char *name, size_t fallback, size_t *out, sp_err *err)
{
    const char *v = getenv(name);
    char *end;
    unsigned long long x;
    *out = fallback;
    if (!v || !v[0])
        return 0;
    errno = 0;
    x = strtoull(v, &end, 10);
    if (errno || *end || v[0] == '-')
        return sp_fail(err, SP_EXIT_USAGE, "%s=%s: expected a number of bytes", name, v);
    *out = (size_t)x;
    return 0;
}

static double resolve_timeout(double t)
{
    return t == 0 ? COMM_DEFAULT_TIMEOUT_S : t;
}

static int apply_opts(comm_t *c, const comm_opts *opts, sp_err *err)
{
    comm_opts none = {0};
    if (!opts)
        opts = &none;
    comm_set_timeout(c, opts->timeout_s);
    c->nccl_world_of_one = opts->nccl_world_of_one != 0;
    c->chunk_bytes = opts->chunk_bytes;
    if (c->chunk_bytes == 0 &&
        env_bytes("SPOTUNE_COMM_CHUNK_BYTES", COMM_DEFAULT_CHUNK_BYTES, &c->chunk_bytes, err))
        return err->code;
    if (c->chunk_bytes == 0)
        c->chunk_bytes = COMM_DEFAULT_CHUNK_BYTES;
    if (c->chunk_bytes > COMM_MAX_CHUNK_BYTES)
        c->chunk_bytes = COMM_MAX_CHUNK_BYTES;
    return env_bytes("SPOTUNE_COMM_SMALL_BYTES", COMM_DEFAULT_SMALL_BYTES, &c->small_bytes, err);
}

/* ---- watchdog ----------------------------------------------------------- */

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static struct timespec ns_timespec(int64_t ns)
{
    struct timespec ts = {(time_t)(ns / 1000000000), (long)(ns % 1000000000)};
    return ts;
}

/* How often the watchdog looks: a tenth of the timeout, within 10 ms..1 s,
 * so it fires at most 10% (or 1 s) late. */
static int64_t watchdog_period_ns(int64_t timeout_ns)
{
    int64_t p = timeout_ns > 0 ? timeout_ns / 10 : 1000000000;
    return p < 10000000 ? 10000000 : p > 1000000000 ? 1000000000 : p;
}

static void abort_guard(comm_t *c, int code, double after_s, const char *msg);

/* The rank that notices asks the others where they are (each answers within
 * its own watchdog period, at most 1 s), so the message names who is
 * missing; the roll call and MPI_Abort together are bounded by the guard. */
static _Noreturn void watchdog_fire(comm_t *c, const char *what, int device_wait,
                                    int64_t timeout_ns)
{
    char msg[1024];
    double wait_s = 2e-9 * (double)watchdog_period_ns(timeout_ns) + 0.5;
    if (device_wait)
        snprintf(msg, sizeof msg, "the wait for the GPU's work (%s; device collectives among it) "
                 "timed out after %g s (a peer may have died)", what ? what : "?",
                 (double)timeout_ns * 1e-9);
    else
        snprintf(msg, sizeof msg, "collective %s timed out after %g s (a peer may have died)",
                 what ? what : "?", (double)timeout_ns * 1e-9);
    abort_guard(c, SP_EXIT_OTHER, wait_s + COMM_ABORT_GRACE_S, msg);
    comm_roll_call(c, wait_s, msg, sizeof msg);
    comm_abort(c, SP_EXIT_OTHER, msg);
}

static void *watchdog_main(void *arg)
{
    comm_t *c = arg;
    sp_name_thread("comm-watchdog");
    struct comm_watchdog *w = &c->wd;
    pthread_mutex_lock(&w->mu);
    while (!w->stop) {
        int quit = w->roll_quit;
        pthread_mutex_unlock(&w->mu);
        if (quit)
            comm_roll_close(c);
        else
            comm_roll_serve(c);
        int64_t limit = atomic_load(&w->timeout_ns);
        int64_t since = atomic_load(&w->busy_since_ns);
        if (limit > 0 && since > 0 && now_ns() - since > limit)
            watchdog_fire(c, atomic_load(&w->what), atomic_load(&w->device_wait), limit);
        pthread_mutex_lock(&w->mu);
        if (quit && !w->roll_closed) {
            w->roll_closed = 1;
            pthread_cond_broadcast(&w->cv);
        }
        if (w->stop || (w->roll_quit && !w->roll_closed))
            continue;
        struct timespec ts = ns_timespec(now_ns() + watchdog_period_ns(limit));
        pthread_cond_timedwait(&w->cv, &w->mu, &ts);
    }
    pthread_mutex_unlock(&w->mu);
    return NULL;
}

static int watchdog_start(comm_t *c, sp_err *err)
{
    pthread_condattr_t attr;
    int rc = pthread_condattr_init(&attr);
    if (!rc)
        rc = pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    if (!rc)
        rc = pthread_cond_init(&c->wd.cv, &attr);
    pthread_condattr_destroy(&attr);
    if (!rc)
        rc = pthread_mutex_init(&c->wd.mu, NULL);
    if (!rc)
        rc = pthread_create(&c->wd.thread, NULL, watchdog_main, c);
    if (rc)
        return sp_fail(err, SP_EXIT_OTHER, "%s:%d: watchdog thread: %s", __FILE__, __LINE__,
                       strerror(rc));
    c->wd.started = 1;
    return 0;
}

/* The watchdog stops answering roll calls (its receive cancelled): from
 * here on MPI may be finalized under it. */
static void roll_stop(comm_t *c)
{
    struct comm_watchdog *w = &c->wd;
    if (!w->started)
        return;
    pthread_mutex_lock(&w->mu);
    w->roll_quit = 1;
    pthread_cond_broadcast(&w->cv);
    while (!w->roll_closed)
        pthread_cond_wait(&w->cv, &w->mu);
    pthread_mutex_unlock(&w->mu);
}

static void watchdog_stop(comm_t *c)
{
    if (!c->wd.started)
        return;
    pthread_mutex_lock(&c->wd.mu);
    c->wd.stop = 1;
    pthread_cond_broadcast(&c->wd.cv);
    pthread_mutex_unlock(&c->wd.mu);
    pthread_join(c->wd.thread, NULL);
    pthread_cond_destroy(&c->wd.cv);
    pthread_mutex_destroy(&c->wd.mu);
    c->wd.started = 0;
}

void comm_watch_begin(comm_t *c, const char *what)
{
    atomic_fetch_add_explicit(&c->wd.seq, 1, memory_order_relaxed);
    atomic_store_explicit(&c->wd.what, what, memory_order_relaxed);
    atomic_store_explicit(&c->wd.device_wait, 0, memory_order_relaxed);
    atomic_store_explicit(&c->wd.busy_since_ns, now_ns(), memory_order_release);
}

void comm_watch_wait_begin(comm_t *c, const char *what)
{
    if (!c)
        return;
    atomic_store_explicit(&c->wd.what, what, memory_order_relaxed);
    atomic_store_explicit(&c->wd.device_wait, 1, memory_order_relaxed);
    atomic_store_explicit(&c->wd.busy_since_ns, now_ns(), memory_order_release);
}

void comm_watch_end(comm_t *c)
{
    if (!c)
        return;
    atomic_store_explicit(&c->wd.busy_since_ns, 0, memory_order_release);
}

void comm_set_timeout(comm_t *c, double timeout_s)
{
    c->timeout_s = resolve_timeout(timeout_s);
    atomic_store(&c->wd.timeout_ns, c->timeout_s > 0 ? (int64_t)(c->timeout_s * 1e9) : 0);
}

double comm_timeout(const comm_t *c)
{
    return c->timeout_s;
}

/* ---- errors and abort --------------------------------------------------- */

int comm_mpi_fail(comm_t *c, sp_err *err, int rc, const char *fn, const char *file, int line)
{
    char reason[MPI_MAX_ERROR_STRING] = "unknown MPI error";
    int len = 0;
    if (MPI_Error_string(rc, reason, &len) != MPI_SUCCESS)
        snprintf(reason, sizeof reason, "MPI error %d", rc);
    return sp_fail(err, SP_EXIT_OTHER, "%s:%d: rank %d on %s: %s: %s", file, line, c->rank,
                   c->host, fn, reason);
}

/* MPI is live when we, or whoever started it, have not finalized it yet.
 * Asked only under a launcher, so a world of one makes no MPI call. */
static int mpi_live(void)
{
    int init = 0, fini = 0;
    if (!under_launcher())
        return 0;
    MPI_Initialized(&init);
    if (init)
        MPI_Finalized(&fini);
    return init && !fini;
}

/* ---- the abort guard: a rank never outlives its abort by more than a few
 * seconds. MPI_Abort asks the launcher to kill the job; a launcher that is
 * itself tearing the job down, or that waits on a node it can no longer
 * reach, may never do it, and the rank would hang until SIGKILL. */

static struct {
    atomic_int started, printed;
    int code, rank;
    double after_s;
    char host[COMM_HOST_MAX];
    char msg[1024];
} guard;

static void *guard_main(void *arg)
{
    (void)arg;
    struct timespec ts = {(time_t)guard.after_s,
                          (long)((guard.after_s - (double)(time_t)guard.after_s) * 1e9)};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
    if (!atomic_exchange(&guard.printed, 1))
        fprintf(stderr, "spotune: rank %d on %s: %s\n", guard.rank, guard.host, guard.msg);
    fprintf(stderr, "spotune: rank %d on %s: the job did not end within %g s of the abort; "
                    "exiting with code %d\n",
            guard.rank, guard.host, guard.after_s, guard.code);
    fflush(stderr);
    _exit(guard.code);
}

/* Starts the guard once (the first caller sets the deadline and the message
 * it prints if nothing was printed by then). */
static void abort_guard(comm_t *c, int code, double after_s, const char *msg)
{
    pthread_t t;
    pthread_attr_t attr;
    if (atomic_exchange(&guard.started, 1))
        return;
    guard.code = code;
    guard.rank = c ? c->rank : env_int("OMPI_COMM_WORLD_RANK", env_int("PMIX_RANK", 0));
    sp_cutf(guard.host, sizeof guard.host, "%s", c ? c->host : "?"); /* a label */
    snprintf(guard.msg, sizeof guard.msg, "%s", msg ? msg : "aborted");
    guard.after_s = after_s;
    if (pthread_attr_init(&attr) == 0) {
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        if (pthread_create(&t, &attr, guard_main, NULL) != 0)
            atomic_store(&guard.started, 0); /* no guard: MPI_Abort alone */
        pthread_attr_destroy(&attr);
    }
}

_Noreturn void comm_abort(comm_t *c, int code, const char *msg)
{
    char host[256] = "?";
    int rank = c ? c->rank : env_int("OMPI_COMM_WORLD_RANK", env_int("PMIX_RANK", 0));
    if (c)
        snprintf(host, sizeof host, "%s", c->host);
    else if (gethostname(host, sizeof host - 1) != 0)
        snprintf(host, sizeof host, "?");
    if (code == 0)
        code = SP_EXIT_OTHER;
    int use_mpi = (c && c->use_mpi) || (!c && mpi_live());
    if (use_mpi)
        abort_guard(c, code, COMM_ABORT_GRACE_S, msg);
    atomic_store(&guard.printed, 1);
    fprintf(stderr, "spotune: rank %d on %s: %s\n", rank, host, msg ? msg : "aborted");
    fflush(stderr);
    /* MPI_Abort from the watchdog thread needs MPI_THREAD_MULTIPLE, which
     * comm_init asks for. MPI_COMM_WORLD (not our duplicate of it) so that
     * Open MPI's own notice names the communicator plainly. */
    if (use_mpi)
        MPI_Abort(MPI_COMM_WORLD, code);
    exit(code);
}

/* ---- world -------------------------------------------------------------- */

static int world_alloc(comm_t *c, sp_err *err)
{
    size_t n = (size_t)c->size;
    c->counts = calloc(5 * n, sizeof *c->counts);
    if (!c->counts)
        return sp_fail(err, SP_EXIT_OTHER, "comm: out of memory for %d ranks", c->size);
    c->displs = c->counts + n;
    c->scounts = c->counts + 2 * n;
    c->rcounts = c->counts + 3 * n;
    c->rdispls = c->counts + 4 * n;
    c->blocks = calloc(n, sizeof *c->blocks);
    if (!c->blocks)
        return sp_fail(err, SP_EXIT_OTHER, "comm: out of memory for %d ranks", c->size);
    return 0;
}

/* Ranks that share memory share a node: their order there is the local rank. */
static int world_local(comm_t *c, sp_err *err)
{
    MPI_Comm node;
    int rc = MPI_Comm_split_type(c->world, MPI_COMM_TYPE_SHARED, c->rank, MPI_INFO_NULL, &node);
    if (rc != MPI_SUCCESS) {
        c->local_rank = env_int("OMPI_COMM_WORLD_LOCAL_RANK", -1);
        c->local_size = env_int("OMPI_COMM_WORLD_LOCAL_SIZE", -1);
        if (c->local_rank < 0 || c->local_size < 1)
            return comm_mpi_fail(c, err, rc, "MPI_Comm_split_type", __FILE__, __LINE__);
        return 0;
    }
    COMM_MPI(c, err, MPI_Comm_rank, (node, &c->local_rank));
    COMM_MPI(c, err, MPI_Comm_size, (node, &c->local_size));
    COMM_MPI(c, err, MPI_Comm_free, (&node));
    return 0;
}

int comm_mpi_thread_level_ok(int provided, char *why, size_t n)
{
    if (provided >= MPI_THREAD_MULTIPLE)
        return 1;
    const char *name = provided == MPI_THREAD_SERIALIZED ? "MPI_THREAD_SERIALIZED"
                       : provided == MPI_THREAD_FUNNELED ? "MPI_THREAD_FUNNELED"
                       : provided == MPI_THREAD_SINGLE   ? "MPI_THREAD_SINGLE"
                                                         : "an unknown level";
    snprintf(why, n,
             "the MPI library gives %s (%d); spotune needs MPI_THREAD_MULTIPLE: its watchdog "
             "thread answers roll calls while the training thread is in a collective. Use an "
             "MPI built with thread support (Open MPI 3 and later by default; MPICH with "
             "--enable-threads=multiple)",
             name, provided);
    return 0;
}

static int world_init_mpi(comm_t *c, int *argc, char ***argv, sp_err *err)
{
    int init = 0, provided = 0;
    COMM_MPI(c, err, MPI_Initialized, (&init));
    if (!init) {
        COMM_MPI(c, err, MPI_Init_thread, (argc, argv, MPI_THREAD_MULTIPLE, &provided));
        c->owns_mpi = 1;
    }
    COMM_MPI(c, err, MPI_Query_thread, (&provided)); /* also when MPI was initialised before */
    char why[512];
    if (!comm_mpi_thread_level_ok(provided, why, sizeof why))
        return sp_fail(err, SP_EXIT_OTHER, "%s", why);
    c->use_mpi = 1;
    COMM_MPI(c, err, MPI_Comm_dup, (MPI_COMM_WORLD, &c->world));
    COMM_MPI(c, err, MPI_Comm_set_errhandler, (c->world, MPI_ERRORS_RETURN));
    COMM_MPI(c, err, MPI_Comm_rank, (c->world, &c->rank));
    COMM_MPI(c, err, MPI_Comm_size, (c->world, &c->size));
    if (world_local(c, err) || world_alloc(c, err) || comm_roll_open(c, err))
        return err->code;
    return watchdog_start(c, err);
}

static int world_init_single(comm_t *c, sp_err *err)
{
    c->world = MPI_COMM_NULL;
    c->rank = c->local_rank = 0;
    c->size = c->local_size = 1;
    return world_alloc(c, err);
}

int comm_init(comm_t **out, int *argc, char ***argv, const comm_opts *opts, sp_err *err)
{
    comm_t *c = calloc(1, sizeof *c);
    int rc;
    *out = NULL;
    if (!c)
        return sp_fail(err, SP_EXIT_OTHER, "comm_init: out of memory");
    if (gethostname(c->host, sizeof c->host - 1) != 0)
        snprintf(c->host, sizeof c->host, "unknown-host");
    rc = apply_opts(c, opts, err);
    if (!rc)
        rc = under_launcher() ? world_init_mpi(c, argc, argv, err)
                                    : world_init_single(c, err);
    if (rc) {
        watchdog_stop(c);
        comm_roll_free(c);
        free(c->counts);
        free(c->blocks);
        free(c); /* MPI stays up: the caller ends the job with comm_abort(NULL) */
        return rc;
    }
    *out = c;
    return 0;
}

void comm_finalize(comm_t *c)
{
    if (!c)
        return;
    comm_device_free(c);
    if (c->use_mpi) {
        roll_stop(c);
        comm_watch_begin(c, "finalize");
        if (c->roll.comm != MPI_COMM_NULL)
            MPI_Comm_free(&c->roll.comm);
        MPI_Comm_free(&c->world);
        if (c->owns_mpi)
            MPI_Finalize();
        comm_watch_end(c);
    }
    watchdog_stop(c);
    comm_roll_free(c);
    free(c->scratch);
    free(c->counts);
    free(c->blocks);
    free(c);
}

int comm_rank(const comm_t *c) { return c->rank; }
int comm_size(const comm_t *c) { return c->size; }
int comm_local_rank(const comm_t *c) { return c->local_rank; }
int comm_local_size(const comm_t *c) { return c->local_size; }

int comm_cores_per_rank(const comm_t *c)
{
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    int local = comm_local_size(c) > 0 ? comm_local_size(c) : 1;
    return cores / local > 0 ? (int)(cores / local) : 1;
}
const char *comm_host(const comm_t *c) { return c->host; }

/* One rank's GPU as comm_check_devices_distinct gathers it (bytes: no padding
 * is left uninitialised, the struct is zeroed first). */
struct rank_device {
    unsigned char id[16];
    int32_t ordinal, visible, local_size;
    char host[COMM_HOST_MAX];
};

static void uuid_text(const unsigned char id[16], char *buf, size_t n)
{
    /* as nvidia-smi -L writes it: GPU-8-4-4-4-12 hex digits */
    snprintf(buf, n,
             "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", id[0],
             id[1], id[2], id[3], id[4], id[5], id[6], id[7], id[8], id[9], id[10], id[11], id[12],
             id[13], id[14], id[15]);
}

int comm_check_devices_distinct(comm_t *c, const unsigned char id[16], int ordinal, int visible,
                                sp_err *err)
{
    static const unsigned char none[16];
    struct rank_device mine, *all;
    if (c->size < 2)
        return 0;
    memset(&mine, 0, sizeof mine);
    memcpy(mine.id, id, sizeof mine.id);
    mine.ordinal = ordinal;
    mine.visible = visible;
    mine.local_size = c->local_size;
    sp_cutf(mine.host, sizeof mine.host, "%s", c->host);
    all = calloc((size_t)c->size, sizeof *all);
    if (!all)
        return sp_fail(err, SP_EXIT_OTHER, "comm: out of memory for %d ranks", c->size);
    if (comm_allgather(c, &mine, all, sizeof mine, COMM_U8, err)) {
        free(all);
        return err->code;
    }
    int found = 0;
    for (int r = 1; r < c->size && !found; r++) {
        if (!memcmp(all[r].id, none, sizeof none))
            continue;
        for (int q = 0; q < r; q++) {
            if (memcmp(all[q].id, all[r].id, sizeof all[r].id))
                continue;
            const struct rank_device *a = &all[q];
            char uuid[64];
            int per = a->visible > 0 ? a->visible : 1;
            uuid_text(a->id, uuid, sizeof uuid);
            sp_fail(err, SP_EXIT_USAGE,
                    "ranks %d and %d on %s both use GPU %d (%s), but each rank needs a GPU of "
                    "its own (NCCL refuses two ranks on one device, and both would plan on its "
                    "whole memory): %s runs %d ranks and each sees %d GPU%s; start at most %d "
                    "rank%s per host (mpirun -np %d on one machine, --map-by ppr:%d:node on "
                    "several), or give each rank its own GPU with CUDA_VISIBLE_DEVICES",
                    q, r, a->host, a->ordinal, uuid, a->host, a->local_size, a->visible,
                    a->visible == 1 ? "" : "s", per, per == 1 ? "" : "s", per, per);
            found = 1;
            break;
        }
    }
    free(all);
    return found ? err->code : 0;
}

void comm_mpi_version(char *buf, size_t n)
{
    char v[MPI_MAX_LIBRARY_VERSION_STRING];
    int len = 0;
    /* callable before MPI_Init (MPI-3), so a world of one says it too */
    if (n == 0)
        return;
    if (MPI_Get_library_version(v, &len) != MPI_SUCCESS)
        len = 0;
    v[len < (int)sizeof v ? len : (int)sizeof v - 1] = 0;
    v[strcspn(v, "\n,")] = 0; /* the first clause: "Open MPI v4.1.4" */
    snprintf(buf, n, "%s", v[0] ? v : "unknown");
}

int comm_device_for_rank(const comm_t *c, int visible_devices)
{
    return visible_devices > 0 ? c->local_rank % visible_devices : 0;
}
