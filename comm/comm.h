/* comm/comm.h — ranks, devices and collectives.
 *
 * Owns: the process world (MPI when launched by mpirun/srun, a single-process
 * world otherwise), the local rank -> GPU binding, collectives over host
 * buffers (MPI) and device buffers (NCCL, bootstrapped over MPI), the
 * "does any rank say stop" agreement, timeouts (a watchdog on MPI, async
 * error polling and ncclCommAbort on NCCL) and the job-wide abort.
 * Knows nothing of models.
 *
 * A comm_t belongs to one thread (its watchdog thread aside): collectives
 * are called in the same order on every rank, one at a time.
 *
 * Every collective either completes on all ranks or ends the whole job:
 * a rank that fails calls comm_abort(), and a collective that does not
 * finish within the timeout aborts the job with a message naming the rank
 * and host that noticed and, after a roll call of the other ranks, those
 * that did not answer (a lost or cut-off node) or answered from an earlier
 * collective (stuck elsewhere), so no rank is ever left blocked. */
#ifndef SPOTUNE_COMM_H
#define SPOTUNE_COMM_H

#include <stddef.h>
#include <stdint.h>

#include "../base/base.h"

typedef struct comm comm_t;

typedef enum { COMM_F32 = 0, COMM_F64, COMM_I32, COMM_I64, COMM_U8, COMM_BF16 } comm_dtype;
typedef enum { COMM_SUM = 0, COMM_MAX, COMM_MIN, COMM_AVG } comm_op;

/* Zero in a field means its default, so `comm_opts o = {0}` is valid. */
typedef struct comm_opts {
    double timeout_s; /* a collective that takes longer aborts the job (default 60;
                         negative: never) */
    size_t chunk_bytes; /* host collectives move at most this much per MPI call
                           (default 4 MiB, or env SPOTUNE_COMM_CHUNK_BYTES) */
    int nccl_world_of_one; /* non-zero: comm_device_init builds a real one-rank NCCL
                              communicator even in a world of one without MPI, and
                              comm_device_collectives() says yes, so the device paths
                              (grad_sync's overlap, the sharded collectives) run through
                              NCCL on one GPU: a check of those paths, not for training */
} comm_opts;

/* Initialises MPI when the process was started by a launcher (mpirun, srun),
 * else a world of one with no MPI at all. On failure *out is NULL; if MPI
 * was already started, end the job with comm_abort(NULL, ...). */
int comm_init(comm_t **out, int *argc, char ***argv, const comm_opts *opts, sp_err *err);
void comm_finalize(comm_t *c);

int comm_rank(const comm_t *c);
int comm_size(const comm_t *c);
int comm_local_rank(const comm_t *c);
int comm_local_size(const comm_t *c);
/* The node's online cores shared between the node's ranks (at least 1): a
 * rank's CPU threads when none are configured. */
int comm_cores_per_rank(const comm_t *c);
const char *comm_host(const comm_t *c);
/* The MPI library's version ("Open MPI v4.1.4"), launched or not. */
void comm_mpi_version(char *buf, size_t n);
/* The NCCL library's version ("NCCL 2.21.5"), or why there is none. */
void comm_nccl_version(char *buf, size_t n);
/* GPU ordinal this rank should use: local rank modulo the visible devices. */
int comm_device_for_rank(const comm_t *c, int visible_devices);
/* Every rank says which GPU it bound: id, the device's 16-byte UUID (all
 * zero: no GPU, not checked), ordinal as the rank sees it, visible the
 * devices it sees. Two ranks on one GPU (more ranks on a host than GPUs,
 * or CUDA_VISIBLE_DEVICES giving two ranks the same one) is an error on
 * every rank that names both ranks, their host and the GPU, and says how
 * many ranks to start: NCCL refuses two ranks on one device, and each
 * rank would plan on memory the other also holds. A collective; 0 in a
 * world of one. */
int comm_check_devices_distinct(comm_t *c, const unsigned char id[16], int ordinal, int visible,
                                sp_err *err);
/* Same meaning as comm_opts.timeout_s: 0 restores 60 s, negative disables. */
void comm_set_timeout(comm_t *c, double timeout_s);
double comm_timeout(const comm_t *c);
/* Bytes per element of dt (0 for an unknown dtype). */
size_t comm_dtype_size(comm_dtype dt);

/* Host-buffer collectives (MPI; trivial copies in a world of one).
 * Reductions are computed in a fixed order (rank 0 + rank 1 + ... per
 * element), so results are bit-identical on every rank and from run to run
 * for a given world size, whatever MPI's own algorithms would do. AVG is
 * the sum divided by the world size (integers: truncated). BF16 is
 * accumulated in fp32 and rounded once. Any size works: large buffers are
 * moved in chunks. */
int comm_allreduce(comm_t *c, void *buf, size_t n, comm_dtype dt, comm_op op, sp_err *err);
int comm_bcast(comm_t *c, void *buf, size_t bytes, int root, sp_err *err);
/* recv holds size * n elements; rank r's n elements land at offset r*n */
int comm_allgather(comm_t *c, const void *send, void *recv, size_t n, comm_dtype dt, sp_err *err);
/* recv (root only; other ranks may pass NULL) holds size * n elements; rank
 * r's n elements land at offset r*n. */
int comm_gather(comm_t *c, const void *send, void *recv, size_t n, comm_dtype dt, int root,
                sp_err *err);
/* send holds size * n elements; rank r receives the reduced block r (n elements) */
int comm_reduce_scatter(comm_t *c, const void *send, void *recv, size_t n, comm_dtype dt,
                        comm_op op, sp_err *err);
/* buf holds n elements on every rank; root receives their reduction in place
 * (folded in rank order as above), the other ranks' buf is left as it was.
 * Sharded gradients (ZeRO stage 2) send each part of a bucket to the rank
 * that owns it this way. */
int comm_reduce(comm_t *c, void *buf, size_t n, comm_dtype dt, comm_op op, int root,
                sp_err *err);
/* *any = 1 on every rank if flag is non-zero on at least one rank */
int comm_any(comm_t *c, int flag, int *any, sp_err *err);
int comm_barrier(comm_t *c, sp_err *err);

/* Ends every rank of the job: prints "spotune: rank R on HOST: msg" to
 * stderr and exits with code (MPI_Abort under a launcher, so mpirun exits
 * with code too; code 0 becomes 1). When MPI_Abort has not ended the
 * process within a few seconds (a launcher that cannot reach a lost node
 * may never carry it out), the rank exits with code by itself. c may be
 * NULL (after comm_init failed). Safe to call from any thread. Never
 * returns. */
_Noreturn void comm_abort(comm_t *c, int code, const char *msg);

/* Device-buffer collectives (NCCL). comm_device_init binds the rank to a
 * CUDA device and builds a non-blocking NCCL communicator. The collectives
 * are enqueued on stream (a cudaStream_t) and return at once;
 * comm_device_wait blocks until the stream's work is done, polling NCCL for
 * asynchronous errors and aborting the communicator on timeout.
 * Without a CUDA build they return an error. In a world of one without MPI
 * no NCCL communicator is made (unless comm_opts.nccl_world_of_one): the
 * collectives are local copies. A second comm_device_init with the same
 * device keeps the communicator and returns 0 (a process that makes one
 * backend after another: spotune bench's two modes); another device, or a
 * communicator aborted, is an error.
 * After any error the communicator is aborted and unusable: end the job
 * with comm_abort(). */
int comm_device_available(void); /* 1 when built with CUDA and NCCL */
int comm_device_init(comm_t *c, int device, sp_err *err);
int comm_device_allreduce(comm_t *c, void *buf, size_t n, comm_dtype dt, comm_op op,
                          void *stream, sp_err *err);
int comm_device_reduce_scatter(comm_t *c, const void *send, void *recv, size_t n, comm_dtype dt,
                               comm_op op, void *stream, sp_err *err);
int comm_device_allgather(comm_t *c, const void *send, void *recv, size_t n, comm_dtype dt,
                          void *stream, sp_err *err);
/* comm_reduce on device buffers: root's buf receives the reduction in place */
int comm_device_reduce(comm_t *c, void *buf, size_t n, comm_dtype dt, comm_op op, int root,
                       void *stream, sp_err *err);
int comm_device_bcast(comm_t *c, void *buf, size_t n, comm_dtype dt, int root, void *stream,
                      sp_err *err);
int comm_device_wait(comm_t *c, void *stream, sp_err *err);
/* The device collectives enqueued between these two go to NCCL as one group
 * (ncclGroupStart/End): one launch for several, say the parts of a gradient
 * segment reduced to the ranks that own them. Call end after begin even
 * when a collective in between failed. Without an NCCL communicator (a
 * world of one) they do nothing. */
int comm_device_group_begin(comm_t *c, sp_err *err);
int comm_device_group_end(comm_t *c, sp_err *err);
/* 1 when gradients must go through the device collectives: a world of more
 * than one, or a one-rank NCCL communicator made on request
 * (comm_opts.nccl_world_of_one, after comm_device_init). */
int comm_device_collectives(const comm_t *c);

/* The watchdog over the host's waits for device work that may hold device
 * collectives (a stream sync, a copy to the host, a free: the CUDA
 * backend's, through backend_t.wait_hook; comm_device_wait and the NCCL
 * calls themselves): a GPU waiting for a peer that never comes (stuck, or
 * gone without its connections closing) reports nothing, so without this
 * the host would wait for ever. Between begin and end, a wait longer than
 * the timeout ends the job as a collective's would: "the wait for the
 * GPU's work (what; device collectives among it) timed out after N s",
 * then the roll call. what is a literal. Not counted as a collective (the
 * roll call's count); not nested in a host collective. */
void comm_watch_wait_begin(comm_t *c, const char *what);
void comm_watch_end(comm_t *c);

#endif
