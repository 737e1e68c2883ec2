/* trainer/grad_sync.h — summing the gradient arena over the ranks, in
 * buckets of comm.bucket_mb. On the CPU the buckets go over MPI after the
 * backward. On CUDA each bucket is handed to NCCL on the backend's second
 * stream as soon as the backward has finished it (the model's grads_ready
 * hook), so communication overlaps the rest of the backward. Each rank
 * scaled its gradients by 1 / (trained tokens of the whole step), so the sum
 * is the mean gradient. */
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
    sp_err err;      /* first failure inside the hook */
} grad_sync_t;

/* Prepares for one step (installs the hook on m when overlapping). */
void grad_sync_begin(grad_sync_t *g, model_t *m, comm_t *comm, double bucket_mb);
/* Reduces what is left and waits until every bucket is summed. */
int grad_sync_finish(grad_sync_t *g, sp_err *err);
/* Both at once, after the backward (no overlap). */
int grad_sync(model_t *m, comm_t *comm, double bucket_mb, sp_err *err);

#endif
