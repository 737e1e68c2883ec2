/* comm/comm_internal.h — the comm_t record and what the comm sources share:
 * the watchdog hooks, MPI error reporting, the fixed-order local reduction
 * and the device teardown. Not for use outside comm/ (the all-reduce
 * benchmark reads the MPI communicator from here to time MPI itself). */
#ifndef SPOTUNE_COMM_INTERNAL_H
#define SPOTUNE_COMM_INTERNAL_H

#include <mpi.h>
#include <pthread.h>
#include <stdatomic.h>

#include "comm.h"

#define COMM_DEFAULT_TIMEOUT_S 60.0
/* comm_abort waits this long for MPI_Abort to end the job, then the rank
 * exits by itself with the same code. */
#define COMM_ABORT_GRACE_S 5.0
#define COMM_DEFAULT_CHUNK_BYTES ((size_t)4 << 20)
#define COMM_MAX_CHUNK_BYTES ((size_t)1 << 30) /* keeps every MPI count < INT_MAX */
/* An all-reduce chunk of at most this many bytes is all-gathered whole and
 * reduced on every rank (one collective); larger ones are reduce-scattered
 * and all-gathered (bandwidth-optimal). Both give the same bits.
 * Env SPOTUNE_COMM_SMALL_BYTES overrides it (tests use it to force a path). */
#define COMM_DEFAULT_SMALL_BYTES ((size_t)16 << 10)

/* The collective in flight is published with atomic stores (no lock, no
 * syscall on the hot path); the watchdog thread looks at it a few times per
 * timeout and ends the job when it has run too long. It also answers the
 * roll calls of other ranks (below). mu/cv serve to stop the thread
 * promptly, and to stop its roll-call service before MPI_Finalize. */
struct comm_watchdog {
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int started; /* thread running (MPI worlds only) */
    int stop;    /* under mu */
    int roll_quit, roll_closed; /* under mu: stop serving asks / it has stopped */
    _Atomic int64_t busy_since_ns; /* monotonic start of the collective in flight, 0: none */
    _Atomic int64_t seq;           /* collectives begun so far (the same count on every rank) */
    _Atomic(const char *) what;    /* its name (a literal) */
    _Atomic int device_wait;       /* 1: a wait for device work (comm_watch_wait_begin) */
    _Atomic int64_t timeout_ns;    /* <= 0: never */
};

/* The roll call (comm_roll.c): when a collective times out, the watchdog of
 * the rank that noticed asks every other rank where it is, on a
 * communicator of its own, and names in its abort message the ranks and
 * hosts that did not answer. Only the watchdog thread uses it after
 * comm_roll_open. */
#define COMM_HOST_MAX 64 /* bytes of a host name kept for each rank */
struct comm_roll {
    MPI_Comm comm;       /* private duplicate of the world: asks and answers only */
    MPI_Request ask;     /* the receive posted for the next ask */
    int64_t ask_buf[2];  /* what it receives */
    int64_t ask_out[2];  /* this rank's own ask: {collective number, 1} */
    int64_t *answers;    /* size x 2: {collective number, in it} as answered to each rank */
    int64_t *got;        /* size x 2: the answers to this rank's own ask */
    MPI_Request *reqs;   /* 2 x size: its receives and sends */
    char *hosts;         /* size x COMM_HOST_MAX: every rank's host name */
    int on;              /* asks are being answered */
};

struct comm_device; /* comm_nccl.c */

struct comm {
    int rank, size, local_rank, local_size;
    char host[256];
    int use_mpi;  /* the world is MPI_COMM_WORLD (launched by mpirun/srun) */
    int owns_mpi; /* MPI_Init_thread was ours, so MPI_Finalize is too */
    MPI_Comm world; /* private duplicate of MPI_COMM_WORLD, errors returned */
    double timeout_s; /* <= 0: never */
    size_t chunk_bytes;
    size_t small_bytes;
    int *counts, *displs, *scounts, *rcounts, *rdispls; /* size entries each (one block) */
    const void **blocks; /* size entries: the per-rank inputs of a fold */
    void *scratch;
    size_t scratch_cap;
    struct comm_watchdog wd;
    struct comm_roll roll;
    struct comm_device *dev; /* NULL until comm_device_init */
    int nccl_world_of_one;   /* comm_opts.nccl_world_of_one */
};

/* Marks the start and end of a blocking collective for the watchdog
 * (comm_watch_wait_begin, comm.h, for the waits on device work). */
void comm_watch_begin(comm_t *c, const char *what);

/* comm_roll.c. open: at start, every rank (gathers the host names, posts
 * the first receive); serve: answer the asks that arrived; close: stop
 * answering (before MPI_Finalize); free: after it. call: ask every other
 * rank, wait up to wait_s for the answers (answering others meanwhile), and
 * append "; no answer from ranks 2, 3 on HOST" and the like to the message
 * in out (capacity cap). */
int comm_roll_open(comm_t *c, sp_err *err);
void comm_roll_serve(comm_t *c);
void comm_roll_close(comm_t *c);
void comm_roll_free(comm_t *c);
void comm_roll_call(comm_t *c, double wait_s, char *out, size_t cap);

/* Records an MPI failure as "file:line: rank R on HOST: fn: reason". */
int comm_mpi_fail(comm_t *c, sp_err *err, int rc, const char *fn, const char *file, int line);
/* 1 when an MPI thread level (MPI_Query_thread's) lets the watchdog thread
 * call MPI beside the training thread; else 0 and why says what to use. */
int comm_mpi_thread_level_ok(int provided, char *why, size_t n);
#define COMM_MPI(c, err, fn, args)                                                       \
    do {                                                                                 \
        int mpi_rc_ = fn args;                                                           \
        if (mpi_rc_ != MPI_SUCCESS)                                                      \
            return comm_mpi_fail((c), (err), mpi_rc_, #fn, __FILE__, __LINE__);          \
    } while (0)

/* dst[i] = blk[0][i] op blk[1][i] op ... op blk[k-1][i], left to right;
 * AVG divides by k at the end. dst may be one of the blocks. The one place
 * the reduction order is fixed. Returns -1 on a bad dt/op. */
int comm_reduce_blocks(void *dst, const void *const *blk, size_t n, int k, comm_dtype dt,
                       comm_op op);

/* Releases the device communicator (comm_nccl.c); called by comm_finalize. */
void comm_device_free(comm_t *c);
/* The ncclComm_t behind the device collectives, NULL without one (the
 * benchmark times NCCL itself on it). */
void *comm_device_nccl(comm_t *c);

#endif
