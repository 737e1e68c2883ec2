/* trainer/grad_sync.h — summing the gradient arena over the ranks, in
 * buckets of comm.bucket_mb. On the CPU the buckets go over MPI after the
 * backward. On CUDA each bucket is handed to NCCL on the backend's second
 * stream as soon as the backward has finished it (the model's grads_ready
 * hook), so communication overlaps the rest of the backward. Each rank
 * scaled its gradients by 1 / (trained tokens of the whole step), so the sum
 * is the mean gradient.
 *
 * With a sharded optimizer (model.shard_count > 1) the arena is
 * reduce-scattered instead, after the backward: each rank receives the summed
 * gradient of its own shard only (model.grad_shard), and after the AdamW step
 * grad_sync_gather_weights all-gathers the updated compute copy so that every
 * rank has every weight again.
 *
 * With sharded gradients as well (ZeRO stage 2, model.shard_grads) no rank
 * holds the whole gradient: the backward writes each segment (the head, a
 * layer, the embedding) into a reused bucket buffer, and as soon as it has
 * finished one (the grads_ready hook, during every micro-batch) the part of
 * the segment in rank r's shard is reduced to rank r (comm_reduce, rank
 * order; comm_device_reduce on the aux stream on CUDA), which adds it into
 * its grad_shard. The reduction of a segment overlaps the backward of the
 * next; the compute stream waits for it only then, before the bucket is
 * zeroed for the segment after next. The same code runs on the CPU, where
 * the reduction is done when comm_reduce returns. The sum over the ranks of
 * each micro-batch is accumulated, instead of each rank's micro-batches
 * summed and then reduced: the same gradient up to summation order.
 *
 * On CUDA "more than one rank" is comm_device_collectives(): a world of one
 * with a one-rank NCCL communicator made on request takes the same device
 * path (a check of it on one GPU). */
#ifndef SPOTUNE_GRAD_SYNC_H
#define SPOTUNE_GRAD_SYNC_H

#include "../comm/comm.h"
#include "model.h"

typedef struct grad_sync {
    model_t *m;
    comm_t *comm;
    size_t bucket;   /* elements per bucket */
    int overlap;     /* device buffers reduced on the aux stream during the backward */
    void *stream;    /* the aux stream (CUDA) */
    size_t launched; /* arena prefix already handed to the collective */
    int device;      /* device buffers (CUDA) */
    int peers;       /* a collective is needed (has_peers) */
    int seg;         /* sharded gradients: the next segment of this micro-batch */
    int pending;     /* its segment reduced, not yet added into grad_shard; -1: none */
    sp_err err;      /* first failure inside the hook */
} grad_sync_t;

/* Prepares for one step (installs the hook on m when overlapping, and
 * always with sharded gradients: call it before the step's first
 * micro-batch, after model_zero_grads). With captured micro-batches
 * (model_opts.graphs, runtime.cuda_graphs) nothing overlaps: the
 * reduction runs after the backward, which is then one graph on every
 * micro-batch; sharded gradients still reduce during the backward (and
 * those micro-batches run eagerly). */
void grad_sync_begin(grad_sync_t *g, model_t *m, comm_t *comm, double bucket_mb);
/* Reduces what is left and waits until every bucket is summed. */
int grad_sync_finish(grad_sync_t *g, sp_err *err);
/* A step given up between two micro-batches (a stop): the reductions in
 * flight (sharded gradients) are waited for and nothing more is reduced;
 * the gradients are the caller's to drop. Every rank gives up after the
 * same micro-batch, so every collective begun has all its ranks. */
int grad_sync_abandon(grad_sync_t *g, sp_err *err);
/* Both at once, after the backward (no overlap); refused with sharded
 * gradients, which must be reduced during the backward. */
int grad_sync(model_t *m, comm_t *comm, double bucket_mb, sp_err *err);
/* Sharded optimizer: every rank's updated shard of the compute copy to every
 * rank (nothing to do when unsharded). */
int grad_sync_gather_weights(model_t *m, comm_t *comm, sp_err *err);
/* The sharded path's two collectives on explicit buffers (the model's
 * arenas above; a test gives them any): grad, F32 holding comm_size x
 * shard_len elements, reduce-scattered so that rank r's shard (F32,
 * shard_len) receives the sum of block r; and the block of copy at shard_lo
 * (this rank's, shard_len elements) all-gathered in place into every rank's
 * copy. On CUDA through NCCL on the compute stream, waited for. */
int grad_sync_reduce_scatter(backend_t *be, comm_t *comm, tensor_t grad, tensor_t shard,
                             size_t shard_len, sp_err *err);
int grad_sync_allgather(backend_t *be, comm_t *comm, tensor_t copy, size_t shard_lo,
                        size_t shard_len, sp_err *err);
/* The gradient's global sum of squares: model_grad_sumsq summed over the
 * shards when sharded. */
int grad_sync_sumsq(model_t *m, comm_t *comm, double *sumsq, sp_err *err);
/* The step's update, after grad_sync_finish: the gradient's global norm
 * (*gnorm), AdamW with a's learning rate and step and the norm clipped to
 * max_norm (a->grad_scale is not used), and the weights gathered when
 * sharded. Unsharded this is model_update (the host waits for nothing
 * between the norm and the update; a captured span with graphs); sharded,
 * the norm is summed over the ranks on the host first. When the norm is
 * not finite nothing is updated (returns 0; the caller fails the step). */
int grad_sync_update(model_t *m, comm_t *comm, const adamw_args *a, double max_norm,
                     double *gnorm, sp_err *err);
/* Device gradients over NCCL, where the backend is CUDA and the world has
 * more than one rank: the ranks' GPUs checked distinct, the communicator
 * made, and the backend's host waits put under the watchdog
 * (backend_t.wait_hook, comm_watch_wait_begin: a wait for work behind a
 * collective whose peer never comes ends the job after comm.timeout_s).
 * Elsewhere nothing (0). */
int grad_sync_device_init(backend_t *be, comm_t *comm, sp_err *err);

#endif
