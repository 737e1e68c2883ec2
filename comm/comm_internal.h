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
#define COMM_DEFAULT_CHUNK_BYTES ((size_t)4 << 20)
#define COMM_MAX_CHUNK_BYTES ((size_t)1 << 30) /* keeps every MPI count < INT_MAX */
/* An all-reduce chunk of at most this many bytes is all-gathered whole and
 * reduced on every rank (one collective); larger ones are reduce-scattered
 * and all-gathered (bandwidth-optimal). Both give the same bits.
 * Env SPOTUNE_COMM_SMALL_BYTES overrides it (tests use it to force a path). */
#define COMM_DEFAULT_SMALL_BYTES ((size_t)16 << 10)

/* The collective in flight is published with two atomic stores (no lock,
 * no syscall on the hot path); the watchdog thread looks at it a few times
 * per timeout and ends the job when it has run too long. mu/cv only serve
 * to stop the thread promptly. */
struct comm_watchdog {
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int started; /* thread running (MPI worlds only) */
    int stop;    /* under mu */
    _Atomic int64_t busy_since_ns; /* monotonic start of the collective in flight, 0: none */
    _Atomic(const char *) what;    /* its name (a literal) */
    _Atomic int64_t timeout_ns;    /* <= 0: never */
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
    struct comm_device *dev; /* NULL until comm_device_init */
    int nccl_world_of_one;   /* comm_opts.nccl_world_of_one */
};

/* Marks the start and end of a blocking collective for the watchdog. */
void comm_watch_begin(comm_t *c, const char *what);
void comm_watch_end(comm_t *c);

/* Records an MPI failure as "file:line: rank R on HOST: fn: reason". */
int comm_mpi_fail(comm_t *c, sp_err *err, int rc, const char *fn, const char *file, int line);
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
