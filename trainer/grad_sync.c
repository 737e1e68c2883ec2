/* Bucketed gradient all-reduce. */
#include "grad_sync.h"

#include <string.h>

int grad_sync(model_t *m, comm_t *comm, double bucket_mb, sp_err *err)
{
    if (comm_size(comm) == 1 || m->n_trainable == 0)
        return 0;
    size_t n = m->n_trainable;
    size_t bucket = (size_t)(bucket_mb * 1024.0 * 1024.0 / 4.0);
    if (bucket < 1)
        bucket = 1;
    int device = strcmp(m->be->name, "cuda") == 0;
    if (device)
        m->be->ops->sync(m->be); /* gradients complete before NCCL reads them */
    for (size_t off = 0; off < n; off += bucket) {
        size_t len = n - off < bucket ? n - off : bucket;
        tensor_t g = tensor_view(m->grad, off, len);
        int rc = device ? comm_device_allreduce(comm, g.p, len, COMM_F32, COMM_SUM, m->be->stream,
                                                err)
                        : comm_allreduce(comm, g.p, len, COMM_F32, COMM_SUM, err);
        if (rc)
            return rc;
    }
    return device ? comm_device_wait(comm, m->be->stream, err) : 0;
}
