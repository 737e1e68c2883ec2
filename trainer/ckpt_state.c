/* The model's trainable state to and from a checkpoint snapshot: rank 0's
 * snapshot (attributes, metrics, arrays), the gather of a sharded optimizer's
 * state to rank 0, and the broadcast restore on every rank. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "checkpointing_internal.h"
#include "grad_sync.h"
#include "state_check.h"

#define VERSION_TAG "spotune " SPOTUNE_VERSION /* from CMake (trainer/CMakeLists.txt) */
#define RNG_TAG "splitmix64-counter-v1"

/* ---- snapshots ------------------------------------------------------------------------ */

/* A trainable parameter's three arrays in a checkpoint: the group's prefix
 * + the parameter's name (at most 159 bytes, so a name fits in 256). */
static const char *const groups[3] = {"params/", "adam_m/", "adam_v/"};

static int add_param_arrays(model_t *m, ckpt_snapshot *s, sp_err *err)
{
    for (int i = 0; i < m->nparams; i++) {
        param_t *p = &m->params[i];
        if (!p->trainable)
            continue;
        tensor_t src[3] = {p->master, tensor_view(m->adam_m, p->offset, p->n),
                           tensor_view(m->adam_v, p->offset, p->n)};
        for (int g = 0; g < 3; g++) {
            char name[256];
            snprintf(name, sizeof name, "%s%s", groups[g], p->name);
            float *buf = ckpt_add_array(s, name, p->ndim, p->shape);
            if (!buf)
                return sp_fail(err, SP_EXIT_OTHER, "out of host memory for a checkpoint");
            be_download(m->be, buf, DT_F32, src[g]);
        }
    }
    return be_check(m->be, err);
}

/* Copies len values of the flat trainable arena starting at flat element
 * `start` into the per-parameter arrays (arrays[i] for params[i]). */
static void scatter_to_params(model_t *m, float **arrays, size_t start, const float *v, size_t len)
{
    for (int i = 0; i < m->nparams; i++) {
        param_t *p = &m->params[i];
        if (!p->trainable || !arrays[i])
            continue;
        size_t lo = p->offset > start ? p->offset : start;
        size_t hi = p->offset + p->n < start + len ? p->offset + p->n : start + len;
        if (lo < hi)
            memcpy(arrays[i] + (lo - p->offset), v + (lo - start), sizeof(float) * (hi - lo));
    }
}

/* Sharded optimizer (every rank calls this): rank 0 gathers every rank's
 * shard of the masters and moments, a piece at a time, into the snapshot's
 * per-parameter arrays, so the checkpoint is the same as an unsharded run's
 * and resumes on any number of ranks. s is NULL on the other ranks; code is
 * rank 0's result so far, which all ranks learn before moving data. */
int ckpt_state_gather(ckpt_ctl *c, model_t *m, ckpt_snapshot *s, int32_t code, sp_err *err)
{
    int root = c->rank == 0, S = m->shard_count;
    size_t piece = m->shard_len < ((size_t)1 << 22) ? m->shard_len : (size_t)1 << 22;
    float *send = malloc(sizeof(float) * piece);
    float *recv = root ? malloc(sizeof(float) * piece * (size_t)S) : NULL;
    float **arrays = root ? calloc((size_t)m->nparams, sizeof *arrays) : NULL;
    if (!code && (!send || (root && (!recv || !arrays))))
        code = sp_fail(err, SP_EXIT_OTHER, "out of host memory for a checkpoint");
    tensor_t src[3] = {m->master, m->adam_m, m->adam_v};
    for (int g = 0; g < 3; g++) {
        for (int i = 0; root && !code && i < m->nparams; i++) {
            param_t *p = &m->params[i];
            char name[256];
            if (!p->trainable)
                continue;
            snprintf(name, sizeof name, "%s%s", groups[g], p->name);
            arrays[i] = ckpt_add_array(s, name, p->ndim, p->shape);
            if (!arrays[i])
                code = sp_fail(err, SP_EXIT_OTHER, "out of host memory for a checkpoint");
        }
        int32_t all = code;
        if (comm_allreduce(c->comm, &all, 1, COMM_I32, COMM_MAX, err))
            break;
        if (all) {
            code = code ? code : sp_fail(err, all, "rank 0 could not snapshot the optimizer");
            break;
        }
        for (size_t k = 0; k < m->shard_len; k += piece) {
            size_t len = m->shard_len - k < piece ? m->shard_len - k : piece;
            be_download(m->be, send, DT_F32, tensor_view(src[g], k, len));
            if (be_check(m->be, err) || comm_gather(c->comm, send, recv, len, COMM_F32, 0, err))
                goto out;
            for (int r = 0; root && r < S; r++)
                scatter_to_params(m, arrays, (size_t)r * m->shard_len + k,
                                  recv + (size_t)r * len, len);
        }
    }
out:
    free(send);
    free(recv);
    free(arrays);
    return err->code ? err->code : code;
}

static char *read_small_file(const char *path, size_t *n)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    size_t cap = 1 << 16, len = 0, got;
    char *buf = malloc(cap);
    while (buf && (got = fread(buf + len, 1, cap - len, f)) > 0) {
        len += got;
        if (len == cap) {
            char *g = realloc(buf, cap *= 2);
            if (!g) {
                free(buf);
                buf = NULL;
            }
            buf = g;
        }
    }
    fclose(f);
    *n = len;
    return buf;
}

int ckpt_state_snapshot(ckpt_ctl *c, model_t *m, const train_progress *p, ckpt_snapshot *s,
                    sp_err *err)
{
    const config_t *cfg = c->cfg;
    ckpt_snapshot_init(s);
    s->step = p->step;
    s->world_size = c->world;
    memcpy(s->config_hash, c->config_hash, sizeof s->config_hash);
    memcpy(s->base_model, c->base_identity, sizeof s->base_model);
    char *yaml = NULL;
    size_t yaml_len = 0;
    FILE *mem = open_memstream(&yaml, &yaml_len);
    int rc = mem ? config_write_yaml(cfg, mem, err) : sp_fail(err, SP_EXIT_OTHER, "out of memory");
    if (mem)
        fclose(mem);
    int bad = rc || ckpt_set_int(s, "step", p->step) ||
              ckpt_set_int(s, "cursor", (int64_t)p->cursor) ||
              ckpt_set_real(s, "elapsed_s", p->elapsed_s) ||
              ckpt_set_int(s, "global_batch", c->global_batch) ||
              ckpt_set_int(s, "world_size", c->world) || ckpt_set_int(s, "seed", cfg->seed) ||
              ckpt_set_str(s, "config", yaml) || ckpt_set_str(s, "config_hash", c->config_hash) ||
              ckpt_set_str(s, "base_model", c->base_identity) ||
              ckpt_set_str(s, "data_identity", c->data_identity) ||
              ckpt_set_str(s, "mode", cfg->mode == MODE_LORA ? "lora" : "full") ||
              ckpt_set_str(s, "rng", RNG_TAG) || ckpt_set_str(s, "writer", VERSION_TAG);
    free(yaml);
    /* the curve so far travels with the checkpoint, so a new machine has it */
    if (!bad && c->metrics && c->metrics->f) {
        size_t n = 0;
        fflush(c->metrics->f);
        char *path = sp_strf("%s/metrics.jsonl", cfg->run_dir);
        char *text = path ? read_small_file(path, &n) : NULL;
        if (text)
            bad = ckpt_add_file(s, "metrics.jsonl", text, n) != 0;
        bad |= !path;
        free(text);
        free(path);
    }
    if (bad && !err->code)
        sp_fail(err, SP_EXIT_OTHER, "out of memory building a checkpoint");
    if (err->code || (m->shard_count == 1 && add_param_arrays(m, s, err))) {
        ckpt_snapshot_free(s);
        return err->code;
    }
    return 0;
}

/* A parameter's AdamW moment: all of it, or (sharded) the part in this rank's shard. */
static void upload_moment(model_t *m, const param_t *p, tensor_t arena, tensor_t whole,
                          const float *v)
{
    if (m->shard_count == 1) {
        be_upload(m->be, whole, v, DT_F32);
        return;
    }
    size_t s = m->shard_lo, e = m->shard_lo + m->shard_len;
    size_t lo = p->offset > s ? p->offset : s, hi = p->offset + p->n < e ? p->offset + p->n : e;
    if (lo < hi)
        be_upload(m->be, tensor_view(arena, lo - s, hi - lo), v + (lo - p->offset), DT_F32);
}

/* Where a restore reads: rank 0's snapshot s (a gathered checkpoint), or a
 * sharded checkpoint's reader r: every rank's own (every_rank), or rank 0's
 * only, which broadcasts what it reads. */
typedef struct restore_src {
    const ckpt_snapshot *s;
    ckpt_sharded *r;
    int every_rank;
} restore_src;

/* Elements [a, b) of p's group g into buf + a. */
static int src_read(const restore_src *src, int g, const param_t *p, size_t a, size_t b,
                    float *buf, sp_err *err)
{
    char name[256];
    snprintf(name, sizeof name, "%s%s", groups[g], p->name);
    uint64_t n = 0;
    const ckpt_array *x = NULL;
    if (src->s)
        n = (x = ckpt_find_array(src->s, name)) ? x->n : 0;
    else
        n = ckpt_sharded_tensor(src->r, p->name, NULL, NULL);
    if (n != p->n)
        return sp_fail(err, SP_EXIT_INPUT, "the checkpoint %s %s",
                       n ? "has the wrong size of" : "lacks", name);
    if (x) { /* its values were checked when it was read (state_check_contents) */
        memcpy(buf + a, x->data + a, sizeof(float) * (b - a));
        return 0;
    }
    if (ckpt_sharded_read(src->r, g, p->name, a, b - a, buf + a, err))
        return err->code;
    return state_check_shard_values(src->r, g, p->name, buf + a, b - a, a, err);
}

/* The part [a, b) of p's group g that this rank keeps: all of it, but in a
 * sharded run only what lies in the rank's shard. */
static void kept_part(const model_t *m, const param_t *p, size_t *a, size_t *b)
{
    *a = 0;
    *b = p->n;
    if (m->shard_count == 1)
        return;
    size_t s = m->shard_lo, e = m->shard_lo + m->shard_len;
    size_t lo = p->offset > s ? p->offset : s, hi = p->offset + p->n < e ? p->offset + p->n : e;
    *a = lo < hi ? lo - p->offset : 0;
    *b = lo < hi ? hi - p->offset : 0;
}

/* Every rank: the trainable state from src, a parameter at a time. Where
 * every rank reads its own and the optimizer is sharded, a rank reads only
 * its shard's masters and moments; the compute copy is then rebuilt from the
 * masters and all-gathered, as after an optimizer step. */
static int restore_from(ckpt_ctl *c, model_t *m, const restore_src *src, sp_err *err)
{
    int own = src->every_rank && m->shard_count > 1;
    for (int i = 0; i < m->nparams; i++) {
        param_t *p = &m->params[i];
        if (!p->trainable)
            continue;
        tensor_t dst[3] = {{0}};
        if (m->shard_count == 1) {
            dst[1] = tensor_view(m->adam_m, p->offset, p->n);
            dst[2] = tensor_view(m->adam_v, p->offset, p->n);
        }
        float *buf = malloc(sizeof(float) * p->n);
        int32_t code = buf ? 0 : sp_fail(err, SP_EXIT_OTHER, "out of host memory");
        for (int g = 0; g < 3; g++) {
            size_t a = 0, b = p->n;
            if (own)
                kept_part(m, p, &a, &b);
            if (!code && a < b && (src->every_rank || c->rank == 0))
                code = src_read(src, g, p, a, b, buf, err);
            if (comm_allreduce(c->comm, &code, 1, COMM_I32, COMM_MAX, err)) {
                free(buf);
                return err->code;
            }
            if (code) {
                free(buf);
                return err->code ? err->code
                                 : sp_fail(err, code, "another rank could not restore %s%s",
                                           groups[g], p->name);
            }
            if (!src->every_rank && comm_bcast(c->comm, buf, sizeof(float) * p->n, 0, err)) {
                free(buf);
                return err->code;
            }
            if (g == 0 && !own)
                model_param_upload(m, p, buf, DT_F32);
            else
                upload_moment(m, p, g == 0 ? m->master : g == 1 ? m->adam_m : m->adam_v, dst[g],
                              buf);
        }
        free(buf);
    }
    if (own && m->shard_len) /* masters -> this rank's part of the compute copy -> every rank */
        be_copy(m->be, tensor_view(m->copy, m->shard_lo, m->shard_len), m->master);
    if (be_check(m->be, err) || (own && grad_sync_gather_weights(m, c->comm, err)))
        return err->code;
    return 0;
}

/* Every rank: the trainable state from rank 0's snapshot (s is NULL elsewhere). */
int ckpt_state_restore(ckpt_ctl *c, model_t *m, const ckpt_snapshot *s, sp_err *err)
{
    restore_src src = {.s = s};
    return restore_from(c, m, &src, err);
}

int ckpt_shards_restore(ckpt_ctl *c, model_t *m, const char *dir, sp_err *err)
{
    restore_src src = {0};
    sp_err mine = {0};
    int32_t cannot = ckpt_sharded_open(&src.r, dir, &mine) != 0;
    int32_t flags[2] = {cannot, c->rank == 0 && cannot};
    if (comm_allreduce(c->comm, flags, 2, COMM_I32, COMM_MAX, err)) {
        ckpt_sharded_close(src.r);
        return err->code;
    }
    if (flags[1]) /* rank 0 chose it and cannot read it: the checkpoint is bad */
        return c->rank == 0 ? sp_fail(err, mine.code, "%s", mine.msg)
                            : sp_fail(err, SP_EXIT_INPUT, "rank 0 cannot read %s", dir);
    src.every_rank = !flags[0];
    if (!src.every_rank && c->rank != 0) { /* another machine: rank 0 reads for it */
        ckpt_sharded_close(src.r);
        src.r = NULL;
    }
    if (c->rank == 0)
        log_event(c->log, c->metrics, "info", "restoring the sharded checkpoint %s: %s", dir,
                  src.every_rank ? "every rank reads the ranges it keeps"
                                 : "some rank cannot see it; rank 0 reads and broadcasts");
    int rc = restore_from(c, m, &src, err);
    ckpt_sharded_close(src.r);
    return rc;
}

/* Rank 0's MANIFEST text (from local_dir) on every rank (*text: heap). */
static int share_manifest(ckpt_ctl *c, const char *local_dir, char **text, sp_err *err)
{
    int64_t n = -1;
    char *buf = NULL;
    if (c->rank == 0) {
        char *path = sp_strf("%s/%s", local_dir, CKPT_MANIFEST);
        FILE *f = path ? fopen(path, "rb") : NULL;
        if (f && fseek(f, 0, SEEK_END) == 0 && (n = ftell(f)) >= 0 &&
            fseek(f, 0, SEEK_SET) == 0 && (buf = malloc((size_t)n + 1)) &&
            fread(buf, 1, (size_t)n, f) != (size_t)n)
            n = -1;
        if (f)
            fclose(f);
        free(path);
    }
    if (comm_bcast(c->comm, &n, sizeof n, 0, err)) {
        free(buf);
        return err->code;
    }
    if (n < 0) {
        free(buf);
        return sp_fail(err, SP_EXIT_INPUT, "%s/%s: rank 0 cannot read it", local_dir,
                       CKPT_MANIFEST);
    }
    if (c->rank != 0 && !(buf = malloc((size_t)n + 1)))
        return sp_fail(err, SP_EXIT_OTHER, "out of memory");
    if (comm_bcast(c->comm, buf, (size_t)n, 0, err)) {
        free(buf);
        return err->code;
    }
    buf[n] = 0;
    *text = buf;
    return 0;
}

int ckpt_shards_restore_store(ckpt_ctl *c, model_t *m, const char *url, const char *name,
                              const char *local_dir, int local_copy, int *damaged, sp_err *err)
{
    *damaged = 0;
    char *text = NULL;
    if (share_manifest(c, local_dir, &text, err))
        return err->code;
    store_opts so;
    ckpt_remote_opts(c->cfg, 0, &so);
    store_t *st = NULL;
    restore_src src = {.every_rank = 1};
    sp_err mine = {0};
    int32_t code = store_open(&st, url, &so, &mine) ? (mine.code ? mine.code : SP_EXIT_OTHER)
                   : ckpt_sharded_open_mixed(&src.r, text, local_copy ? local_dir : NULL, st,
                                             name, &mine);
    free(text);
    int32_t all = code;
    if (comm_allreduce(c->comm, &all, 1, COMM_I32, COMM_MAX, err))
        goto out;
    if (all) {
        if (code)
            sp_fail(err, code, "%s", mine.msg);
        else
            sp_fail(err, all, "another rank cannot read the checkpoint %s/%s", url, name);
        goto out;
    }
    if (c->rank == 0)
        log_event(c->log, c->metrics, "info",
                  "restoring the sharded checkpoint %s/%s: every rank reads the ranges it keeps "
                  "from %s, each block checked against MANIFEST.json",
                  url, name,
                  local_copy ? "its machine's copy where it holds the shard, else the store"
                             : "the store");
    if (restore_from(c, m, &src, err)) {
        /* the first rank that found a damaged block tells every rank what it found */
        int32_t who = ckpt_sharded_damaged(src.r) ? c->rank : c->world;
        sp_err e2 = {0};
        if (comm_allreduce(c->comm, &who, 1, COMM_I32, COMM_MIN, &e2) == 0 && who < c->world) {
            *damaged = 1;
            char msg[SP_ERR_MSG_MAX];
            snprintf(msg, sizeof msg, "%s", err->msg);
            if (comm_bcast(c->comm, msg, sizeof msg, who, &e2) == 0)
                sp_cutf(err->msg, sizeof err->msg, "%s", msg);
        }
    }
    if (!err->code && local_copy) { /* which of the files each rank read came from where */
        int a, b;
        ckpt_sharded_files_read(src.r, &a, &b);
        int32_t n[2] = {a, b};
        if (comm_allreduce(c->comm, n, 2, COMM_I32, COMM_SUM, err))
            goto out;
        if (c->rank == 0)
            log_event(c->log, c->metrics, "info",
                      "the ranks read %d shard file(s) from their own machines' disks and %d "
                      "from %s",
                      (int)n[0], (int)n[1], url);
    }
out:
    ckpt_sharded_close(src.r);
    store_close(st);
    return err->code;
}
