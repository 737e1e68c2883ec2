/* Bucketed gradient all-reduce, overlapped with the backward on CUDA. */
#include "grad_sync.h"

#include <string.h>

static int launch(grad_sync_t *g, size_t upto, sp_err *err)
{
    model_t *m = g->m;
    while (g->launched < upto) {
        size_t len = upto - g->launched < g->bucket ? upto - g->launched : g->bucket;
        /* a partial bucket waits for more, unless it is the arena's tail */
        if (len < g->bucket && upto < m->n_trainable)
            break;
        tensor_t t = tensor_view(m->grad, g->launched, len);
        int rc;
        if (g->overlap) {
            m->be->ops->stream_fence(m->be, g->stream, m->be->stream);
            rc = comm_device_allreduce(g->comm, t.p, len, COMM_F32, COMM_SUM, g->stream, err);
        } else {
            rc = comm_allreduce(g->comm, t.p, len, COMM_F32, COMM_SUM, err);
        }
        if (rc)
            return rc;
        g->launched += len;
    }
    return 0;
}

static void on_ready(void *ctx, size_t upto)
{
    grad_sync_t *g = ctx;
    if (!g->err.code)
        launch(g, upto, &g->err);
}

void grad_sync_begin(grad_sync_t *g, model_t *m, comm_t *comm, double bucket_mb)
{
    memset(g, 0, sizeof *g);
    g->m = m;
    g->comm = comm;
    g->bucket = (size_t)(bucket_mb * 1024.0 * 1024.0 / 4.0);
    if (g->bucket < 1)
        g->bucket = 1;
    int device = strcmp(m->be->name, "cuda") == 0;
    g->overlap = device && comm_size(comm) > 1 && m->be->ops->aux_stream &&
                 m->be->ops->stream_fence;
    if (g->overlap) {
        g->stream = m->be->ops->aux_stream(m->be);
        m->grads_ready = on_ready;
        m->grads_ready_ctx = g;
    } else {
        m->grads_ready = NULL;
    }
}

int grad_sync_finish(grad_sync_t *g, sp_err *err)
{
    model_t *m = g->m;
    m->grads_ready = NULL;
    if (g->err.code)
        return sp_fail(err, g->err.code, "%s", g->err.msg);
    if (comm_size(g->comm) == 1 || m->n_trainable == 0)
        return 0;
    int device = strcmp(m->be->name, "cuda") == 0;
    if (device && !g->overlap) { /* no aux stream: reduce on the compute stream */
        g->overlap = 1;
        g->stream = m->be->stream;
        for (size_t off = 0; off < m->n_trainable; off += g->bucket) {
            size_t len = m->n_trainable - off < g->bucket ? m->n_trainable - off : g->bucket;
            tensor_t t = tensor_view(m->grad, off, len);
            if (comm_device_allreduce(g->comm, t.p, len, COMM_F32, COMM_SUM, g->stream, err))
                return err->code;
        }
        return comm_device_wait(g->comm, g->stream, err);
    }
    if (launch(g, m->n_trainable, err))
        return err->code;
    if (g->overlap) {
        if (comm_device_wait(g->comm, g->stream, err))
            return err->code;
        m->be->ops->stream_fence(m->be, m->be->stream, g->stream);
    }
    return 0;
}

int grad_sync(model_t *m, comm_t *comm, double bucket_mb, sp_err *err)
{
    grad_sync_t g;
    grad_sync_begin(&g, m, comm, bucket_mb);
    return grad_sync_finish(&g, err);
}
