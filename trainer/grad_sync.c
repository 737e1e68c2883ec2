/* Bucketed gradient all-reduce, overlapped with the backward on CUDA; the
 * sharded optimizer's reduce-scatter and all-gather; and sharded gradients,
 * reduced segment by segment into the owners' shards during the backward. */
#include "grad_sync.h"

#include <math.h>
#include <string.h>

static int launch_buckets(grad_sync_t *g, size_t upto, sp_err *err)
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
            be_stream_fence(m->be, g->stream, m->be->stream);
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

static int launch(grad_sync_t *g, size_t upto, sp_err *err)
{
    int on = g->peers; /* the step profile's communication: only where there is some */
    if (on)
        be_prof_comm(g->m->be, 1);
    int rc = launch_buckets(g, upto, err);
    if (on)
        be_prof_comm(g->m->be, 0);
    return rc;
}

static int on_device(const backend_t *be)
{
    return strcmp(be->name, "cuda") == 0;
}

/* Whether the gradients need a collective at all: a world of more than one,
 * or (device) a one-rank NCCL communicator made on request. */
static int has_peers(const model_t *m, const comm_t *comm)
{
    return on_device(m->be) ? comm_device_collectives(comm) : comm_size(comm) > 1;
}

int grad_sync_reduce_scatter(backend_t *be, comm_t *comm, tensor_t grad, tensor_t shard,
                             size_t shard_len, sp_err *err)
{
    if (grad.n < shard_len * (size_t)comm_size(comm) || shard.n < shard_len)
        return sp_fail(err, SP_EXIT_OTHER,
                       "reduce-scatter of %zu x %d elements from %zu into %zu", shard_len,
                       comm_size(comm), grad.n, shard.n);
    if (!on_device(be))
        return comm_reduce_scatter(comm, grad.p, shard.p, shard_len, COMM_F32, COMM_SUM, err);
    if (comm_device_reduce_scatter(comm, grad.p, shard.p, shard_len, COMM_F32, COMM_SUM,
                                   be->stream, err))
        return err->code;
    return comm_device_wait(comm, be->stream, err);
}

int grad_sync_allgather(backend_t *be, comm_t *comm, tensor_t copy, size_t shard_lo,
                        size_t shard_len, sp_err *err)
{
    if (be_check(be, err))
        return err->code;
    if (copy.n < shard_len * (size_t)comm_size(comm) || shard_lo + shard_len > copy.n)
        return sp_fail(err, SP_EXIT_OTHER, "all-gather of %zu x %d elements at %zu in %zu",
                       shard_len, comm_size(comm), shard_lo, copy.n);
    size_t es = dtype_size(copy.dt);
    void *mine = (char *)copy.p + shard_lo * es;
    comm_dtype dt = copy.dt == DT_F32 ? COMM_F32 : copy.dt == DT_BF16 ? COMM_BF16 : COMM_U8;
    size_t n = dt == COMM_U8 ? shard_len * es : shard_len;
    if (!on_device(be))
        return comm_allgather(comm, mine, copy.p, n, dt, err);
    if (comm_device_allgather(comm, mine, copy.p, n, dt, be->stream, err))
        return err->code;
    return comm_device_wait(comm, be->stream, err);
}

/* The whole (padded) arena, once: rank r receives the sum of shard r. */
static int reduce_scatter(model_t *m, comm_t *comm, sp_err *err)
{
    if (m->shard_count != comm_size(comm))
        return sp_fail(err, SP_EXIT_OTHER, "the optimizer is sharded %d ways over %d ranks",
                       m->shard_count, comm_size(comm));
    return grad_sync_reduce_scatter(m->be, comm, m->grad, m->grad_shard, m->shard_len, err);
}

/* ---- sharded gradients (ZeRO stage 2) ---------------------------------------------- */

/* [*a, *b): the part of [lo, lo + n) inside the shard [s, s + len); empty: *a >= *b. */
static void overlap(size_t lo, size_t n, size_t s, size_t len, size_t *a, size_t *b)
{
    *a = lo > s ? lo : s;
    *b = lo + n < s + len ? lo + n : s + len;
}

/* Segment k's reduction: each part of it that lies in rank r's shard is
 * summed into rank r's bucket, owners in rank order (on the device enqueued
 * on g->stream). */
static int reduce_segment_parts(grad_sync_t *g, int k, sp_err *err)
{
    model_t *m = g->m;
    size_t lo, a, b;
    tensor_t seg = model_grad_segment(m, k, &lo);
    if (!g->peers)
        return 0; /* the sum over one rank is its own gradient */
    /* on the device the parts go to NCCL as one group: one launch */
    if (g->device && comm_device_group_begin(g->comm, err))
        return err->code;
    int rc = 0;
    for (int r = 0; r < m->shard_count && !rc; r++) {
        overlap(lo, seg.n, (size_t)r * m->shard_len, m->shard_len, &a, &b);
        if (a >= b)
            continue;
        void *part = tensor_view(seg, a - lo, b - a).p;
        rc = g->device ? comm_device_reduce(g->comm, part, b - a, COMM_F32, COMM_SUM, r, g->stream,
                                            err)
                       : comm_reduce(g->comm, part, b - a, COMM_F32, COMM_SUM, r, err);
    }
    if (g->device) {
        sp_err end = {0};
        if (comm_device_group_end(g->comm, &end) && !rc) {
            *err = end;
            rc = end.code;
        }
    }
    return rc;
}

static int reduce_segment(grad_sync_t *g, int k, sp_err *err)
{
    int on = g->peers; /* the step profile's communication: only where there is some */
    if (on)
        be_prof_comm(g->m->be, 1);
    int rc = reduce_segment_parts(g, k, err);
    if (on)
        be_prof_comm(g->m->be, 0);
    return rc;
}

/* After segment k's reduction (the compute stream waits for it): this
 * rank's part of the sum is added into grad_shard and the bucket zeroed for
 * the segment after next. */
static void settle_segment(grad_sync_t *g, int k)
{
    model_t *m = g->m;
    size_t lo, a, b;
    tensor_t seg = model_grad_segment(m, k, &lo);
    if (g->stream != m->be->stream)
        be_stream_fence(m->be, m->be->stream, g->stream);
    overlap(lo, seg.n, m->shard_lo, m->shard_len, &a, &b);
    if (a < b)
        be_add(m->be, tensor_view(m->grad_shard, a - m->shard_lo, b - a),
               tensor_view(seg, a - lo, b - a), 1.0f, b - a);
    be_zero(m->be, seg);
}

/* The hook with sharded gradients: every segment the backward has finished
 * is reduced; the one before it, whose reduction has had a segment's
 * backward to overlap with, settled first (on the CPU the reduction is done
 * by then). After the micro-batch's last segment everything is settled. */
static int shard_launch(grad_sync_t *g, size_t upto, sp_err *err)
{
    model_t *m = g->m;
    if (g->peers && m->shard_count != comm_size(g->comm))
        return sp_fail(err, SP_EXIT_OTHER, "the gradients are sharded %d ways over %d ranks",
                       m->shard_count, comm_size(g->comm));
    while (g->seg < m->nsegs && m->seg_end[g->seg] <= upto) {
        size_t lo;
        int k = g->seg++;
        if (g->pending >= 0)
            settle_segment(g, g->pending);
        g->pending = -1;
        if (model_grad_segment(m, k, &lo).n == 0)
            continue;
        if (g->stream != m->be->stream)
            be_stream_fence(m->be, g->stream, m->be->stream);
        if (reduce_segment(g, k, err))
            return err->code;
        g->pending = k;
    }
    if (g->seg == m->nsegs) {
        if (g->pending >= 0)
            settle_segment(g, g->pending);
        g->pending = -1;
        g->seg = 0;
    }
    return 0;
}

static void on_ready(void *ctx, size_t upto)
{
    grad_sync_t *g = ctx;
    if (g->err.code)
        return;
    if (g->m->shard_grads)
        shard_launch(g, upto, &g->err);
    else
        launch(g, upto, &g->err);
}

/* Sharded gradients: every micro-batch's segments were reduced by the hook. */
static int shard_finish(grad_sync_t *g, sp_err *err)
{
    if (g->seg != 0 || g->pending >= 0)
        return sp_fail(err, SP_EXIT_OTHER,
                       "sharded gradients: a backward stopped after segment %d of %d", g->seg,
                       g->m->nsegs);
    if (!g->device || !g->peers)
        return 0;
    return comm_device_wait(g->comm, g->stream, err);
}

void grad_sync_begin(grad_sync_t *g, model_t *m, comm_t *comm, double bucket_mb)
{
    memset(g, 0, sizeof *g);
    g->m = m;
    g->comm = comm;
    g->bucket = (size_t)(bucket_mb * 1024.0 * 1024.0 / 4.0);
    if (g->bucket < 1)
        g->bucket = 1;
    g->device = on_device(m->be);
    g->peers = has_peers(m, comm);
    g->pending = -1;
    if (m->shard_grads) { /* the hook is required: the buckets are reused */
        g->stream = g->device && be_has_streams(m->be) ? be_aux_stream(m->be) : m->be->stream;
        m->grads_ready = on_ready;
        m->grads_ready_ctx = g;
        return;
    }
    /* with graphs (model_opts.graphs) the reduction waits for the backward's
     * end, so that the step's last micro-batch replays a graph too */
    g->overlap = g->device && g->peers && m->shard_count == 1 && be_has_streams(m->be) &&
                 !m->o.graphs;
    if (g->overlap) {
        g->stream = be_aux_stream(m->be);
        m->grads_ready = on_ready;
        m->grads_ready_ctx = g;
    } else {
        m->grads_ready = NULL;
    }
}

static int finish(grad_sync_t *g, sp_err *err)
{
    model_t *m = g->m;
    m->grads_ready = NULL;
    if (g->err.code)
        return sp_fail(err, g->err.code, "%s", g->err.msg);
    if (m->shard_grads)
        return shard_finish(g, err);
    if (!has_peers(m, g->comm) || m->n_trainable == 0)
        return 0;
    int device = on_device(m->be);
    if (m->shard_count > 1)
        return reduce_scatter(m, g->comm, err);
    if (device && !g->overlap) { /* graphs, or no aux stream: on the compute stream, now */
        void *stream = m->be->stream;
        for (size_t off = 0; off < m->n_trainable; off += g->bucket) {
            size_t len = m->n_trainable - off < g->bucket ? m->n_trainable - off : g->bucket;
            tensor_t t = tensor_view(m->grad, off, len);
            if (comm_device_allreduce(g->comm, t.p, len, COMM_F32, COMM_SUM, stream, err))
                return err->code;
        }
        return comm_device_wait(g->comm, stream, err);
    }
    if (launch(g, m->n_trainable, err))
        return err->code;
    if (g->overlap) {
        if (comm_device_wait(g->comm, g->stream, err))
            return err->code;
        be_stream_fence(m->be, m->be->stream, g->stream);
    }
    return 0;
}

int grad_sync_finish(grad_sync_t *g, sp_err *err)
{
    int on = has_peers(g->m, g->comm); /* the step profile's communication: only where there is some */
    if (on)
        be_prof_comm(g->m->be, 1);
    int rc = finish(g, err);
    if (on)
        be_prof_comm(g->m->be, 0);
    return rc;
}

int grad_sync_abandon(grad_sync_t *g, sp_err *err)
{
    if (g->m->shard_grads) /* the reductions in flight waited for, as at a step's end */
        return finish(g, err);
    g->m->grads_ready = NULL;
    /* unsharded, the buckets go only during the step's last micro-batch */
    if (!g->err.code && g->launched)
        return sp_fail(err, SP_EXIT_OTHER, "a step given up after its last micro-batch");
    return g->err.code ? sp_fail(err, g->err.code, "%s", g->err.msg) : 0;
}

int grad_sync(model_t *m, comm_t *comm, double bucket_mb, sp_err *err)
{
    grad_sync_t g;
    if (m->shard_grads)
        return sp_fail(err, SP_EXIT_OTHER,
                       "sharded gradients are reduced during the backward: use "
                       "grad_sync_begin before it and grad_sync_finish after");
    grad_sync_begin(&g, m, comm, bucket_mb);
    return grad_sync_finish(&g, err);
}

static int gather_weights(model_t *m, comm_t *comm, sp_err *err)
{
    if (m->shard_count == 1)
        return 0;
    return grad_sync_allgather(m->be, comm, m->copy, m->shard_lo, m->shard_len, err);
}

int grad_sync_gather_weights(model_t *m, comm_t *comm, sp_err *err)
{
    int on = m->shard_count > 1; /* the step profile's communication: only where there is some */
    if (on)
        be_prof_comm(m->be, 1);
    int rc = gather_weights(m, comm, err);
    if (on)
        be_prof_comm(m->be, 0);
    return rc;
}

int grad_sync_sumsq(model_t *m, comm_t *comm, double *sumsq, sp_err *err)
{
    *sumsq = model_grad_sumsq(m);
    if (m->shard_count == 1)
        return 0;
    be_prof_comm(m->be, 1);
    int rc = comm_allreduce(comm, sumsq, 1, COMM_F64, COMM_SUM, err);
    be_prof_comm(m->be, 0);
    return rc;
}

int grad_sync_update(model_t *m, comm_t *comm, const adamw_args *a, double max_norm,
                     double *gnorm, sp_err *err)
{
    if (m->shard_count == 1)
        return model_update(m, a, max_norm, gnorm, err);
    double sumsq = 0.0;
    if (grad_sync_sumsq(m, comm, &sumsq, err))
        return err->code;
    *gnorm = sqrt(sumsq);
    if (!isfinite(*gnorm))
        return 0;
    adamw_args h = *a;
    h.grad_scale = (float)adamw_clip_scale(*gnorm, max_norm);
    model_adamw(m, &h);
    if (be_check(m->be, err))
        return err->code;
    return grad_sync_gather_weights(m, comm, err);
}

/* backend_t.wait_hook: the backend's host waits under the watchdog */
static void watch_device_wait(void *ctx, const char *what)
{
    if (what)
        comm_watch_wait_begin((comm_t *)ctx, what);
    else
        comm_watch_end((comm_t *)ctx);
}

int grad_sync_device_init(backend_t *be, comm_t *comm, sp_err *err)
{
    if (strcmp(be->name, "cuda") != 0 || comm_size(comm) < 2)
        return 0;
    if (comm_check_devices_distinct(comm, be->device_uuid, be->device, be->device_count, err) ||
        comm_device_init(comm, be->device, err))
        return err->code;
    be->wait_hook = watch_device_wait;
    be->wait_ctx = comm;
    return 0;
}
