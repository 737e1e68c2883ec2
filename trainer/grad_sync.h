/* trainer/grad_sync.h — summing the gradient arena over the ranks, in
 * buckets of comm.bucket_mb: host buffers over MPI, device buffers over NCCL
 * on the backend's stream. */
#ifndef SPOTUNE_GRAD_SYNC_H
#define SPOTUNE_GRAD_SYNC_H

#include "../comm/comm.h"
#include "model.h"

int grad_sync(model_t *m, comm_t *comm, double bucket_mb, sp_err *err);

#endif
