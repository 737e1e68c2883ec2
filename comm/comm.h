/* comm/comm.h — ranks, devices and collectives.
 *
 * Owns: the process world (MPI when launched by mpirun/srun, a single-process
 * world otherwise), the local rank -> GPU binding, collectives over host
 * buffers (MPI) and device buffers (NCCL, bootstrapped over MPI), the
 * "does any rank say stop" agreement, timeouts (a watchdog on MPI, async
 * error polling and ncclCommAbort on NCCL) and the job-wide abort.
 * Knows nothing of models.
 *
 * Every collective either completes on all ranks or ends the whole job:
 * a rank that fails calls comm_abort(), and a collective that does not
 * finish within the timeout aborts the job with a message naming the rank
 * and host, so no rank is ever left blocked. */
#ifndef SPOTUNE_COMM_H
#define SPOTUNE_COMM_H

#include <stddef.h>
#include <stdint.h>

#include "../base/base.h"

typedef struct comm comm_t;

typedef enum { COMM_F32 = 0, COMM_F64, COMM_I32, COMM_I64, COMM_U8, COMM_BF16 } comm_dtype;
typedef enum { COMM_SUM = 0, COMM_MAX, COMM_MIN, COMM_AVG } comm_op;

typedef struct comm_opts {
    double timeout_s; /* a collective that takes longer aborts the job (default 60) */
} comm_opts;

/* Initialises MPI when the process was started by a launcher (mpirun, srun),
 * else a world of one with no MPI at all. */
int comm_init(comm_t **out, int *argc, char ***argv, const comm_opts *opts, sp_err *err);
void comm_finalize(comm_t *c);

int comm_rank(const comm_t *c);
int comm_size(const comm_t *c);
int comm_local_rank(const comm_t *c);
int comm_local_size(const comm_t *c);
const char *comm_host(const comm_t *c);
/* GPU ordinal this rank should use: local rank modulo the visible devices. */
int comm_device_for_rank(const comm_t *c, int visible_devices);
void comm_set_timeout(comm_t *c, double timeout_s);

/* Host-buffer collectives (MPI; trivial copies in a world of one). */
int comm_allreduce(comm_t *c, void *buf, size_t n, comm_dtype dt, comm_op op, sp_err *err);
int comm_bcast(comm_t *c, void *buf, size_t bytes, int root, sp_err *err);
/* recv holds size * n elements; rank r's n elements land at offset r*n */
int comm_allgather(comm_t *c, const void *send, void *recv, size_t n, comm_dtype dt, sp_err *err);
/* send holds size * n elements; rank r receives the reduced block r (n elements) */
int comm_reduce_scatter(comm_t *c, const void *send, void *recv, size_t n, comm_dtype dt,
                        comm_op op, sp_err *err);
/* *any = 1 on every rank if flag is non-zero on at least one rank */
int comm_any(comm_t *c, int flag, int *any, sp_err *err);
int comm_barrier(comm_t *c, sp_err *err);

/* Ends every rank of the job: prints "rank R on HOST: msg" to stderr and
 * exits with code (MPI_Abort under a launcher). Never returns. */
void comm_abort(comm_t *c, int code, const char *msg);

/* Device-buffer collectives (NCCL). comm_device_init binds the rank to a
 * CUDA device and builds a non-blocking NCCL communicator. The collectives
 * are enqueued on stream (a cudaStream_t) and return at once;
 * comm_device_wait blocks until the stream's work is done, polling NCCL for
 * asynchronous errors and aborting the communicator on timeout.
 * Without a CUDA build they return an error. */
int comm_device_init(comm_t *c, int device, sp_err *err);
int comm_device_allreduce(comm_t *c, void *buf, size_t n, comm_dtype dt, comm_op op,
                          void *stream, sp_err *err);
int comm_device_reduce_scatter(comm_t *c, const void *send, void *recv, size_t n, comm_dtype dt,
                               comm_op op, void *stream, sp_err *err);
int comm_device_allgather(comm_t *c, const void *send, void *recv, size_t n, comm_dtype dt,
                          void *stream, sp_err *err);
int comm_device_bcast(comm_t *c, void *buf, size_t n, comm_dtype dt, int root, void *stream,
                      sp_err *err);
int comm_device_wait(comm_t *c, void *stream, sp_err *err);

#endif
