/* Checkpoint policy, snapshots of the model, resume. */
#define _GNU_SOURCE
#include "checkpointing.h"

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "../checkpoint/ckpt.h"
#include "../checkpoint/ckpt_writer.h"
#include "../checkpoint/lease.h"
#include "../checkpoint/store.h"
#include "../checkpoint/uploader.h"
#include "signals.h"
#include "state_check.h"

#define VERSION_TAG "spotune 0.1.0"
#define RNG_TAG "splitmix64-counter-v1"

struct ckpt_ctl {
    const config_t *cfg;
    comm_t *comm;
    int rank, world;
    FILE *log;
    metrics_t *metrics;
    char root[4096];
    char base_identity[17], config_hash[17];
    ckpt_writer *writer;
    store_t *store;
    uploader_t *up;
    store_t *lease_store; /* the lease's own handle, with short retries */
    lease_t *lease;
    pthread_mutex_t remote_mu; /* the two fields below, set on the uploader thread */
    int64_t remote_step;       /* newest step known complete remotely (-1: none) */
    int remote_refused;        /* the store refused a push for good (see on_upload) */
    double last_time;
    int64_t last_step;
    int64_t global_batch; /* windows per step: this run's, after any resume re-split */
    int fresh_metrics; /* the run directory had no metrics yet (a new machine) */
};

/* ---- logging from any thread (stdio locks each call) ------------------------- */

static void on_written(void *ctx, const char *dir, const ckpt_snapshot *s, double write_s,
                       const sp_err *err)
{
    ckpt_ctl *c = ctx;
    if (!dir) { /* the end or a stop waits for this write and fails with it */
        log_event(c->log, c->metrics, "warning",
                  "checkpoint step %lld was not written: %s; training goes on and the next "
                  "checkpoint tries again",
                  (long long)s->step, err->msg);
        return;
    }
    log_event(c->log, c->metrics, "checkpoint_committed",
              "step %lld committed to %s (%.1f MiB, written in %.2f s)", (long long)s->step, dir,
              (double)s->bytes / 1048576.0, write_s);
    sp_err perr = {0};
    if (ckpt_prune(c->root, (int)c->cfg->ckpt_keep, c->cfg->ckpt_keep_every, NULL, NULL, &perr))
        log_event(c->log, c->metrics, "warning", "retention: %s", perr.msg);
    pthread_mutex_lock(&c->remote_mu);
    int refused = c->remote_refused;
    pthread_mutex_unlock(&c->remote_mu);
    if (c->up && !refused && !lease_lost(c->lease, NULL)) {
        sp_err uerr = {0};
        const char *name = strrchr(dir, '/') + 1;
        int dropped = uploader_submit(c->up, dir, name, &uerr);
        if (dropped < 0)
            log_event(c->log, c->metrics, "warning", "upload of %s not queued: %s", name,
                      uerr.msg);
        else if (dropped > 0)
            log_event(c->log, c->metrics, "warning",
                      "the remote store is behind: %d older checkpoint(s) will not be pushed "
                      "(superseded by %s)",
                      dropped, name);
    }
}

static void on_upload(void *arg, const uploader_event *ev)
{
    ckpt_ctl *c = arg;
    switch (ev->kind) {
    case UPLOADER_JOB_DONE: {
        long long step = -1;
        if (ev->prefix && sscanf(ev->prefix, "step-%lld", &step) == 1) {
            pthread_mutex_lock(&c->remote_mu);
            if (step > c->remote_step)
                c->remote_step = step;
            pthread_mutex_unlock(&c->remote_mu);
        }
        log_event(c->log, c->metrics, "checkpoint_uploaded", "%s/%s", store_url(c->store),
                  ev->prefix);
        break;
    }
    case UPLOADER_JOB_RETRY:
        log_event(c->log, c->metrics, "warning",
                  "upload of %s failed (attempt %d), retrying in %.0f s: %s", ev->prefix,
                  ev->attempt, ev->retry_in_s, ev->err ? ev->err->msg : "");
        break;
    case UPLOADER_JOB_FAILED: {
        /* credentials refused or no such bucket: said once, loudly; the store
         * gets nothing more from this run, which ends non-zero */
        int refused = ev->rc == STORE_EAUTH || ev->rc == STORE_ENOBUCKET;
        pthread_mutex_lock(&c->remote_mu);
        int first = refused && !c->remote_refused;
        c->remote_refused |= refused;
        pthread_mutex_unlock(&c->remote_mu);
        log_event(c->log, c->metrics, refused ? "error" : "warning",
                  "upload of %s failed for good: %s%s", ev->prefix ? ev->prefix : "?",
                  ev->err ? ev->err->msg : "",
                  first ? "; this run pushes nothing more to the store" : "");
        break;
    }
    case UPLOADER_PRUNE_FAILED:
        log_event(c->log, c->metrics, "warning", "remote retention failed: %s",
                  ev->err ? ev->err->msg : "");
        break;
    default:
        break;
    }
}

/* ---- open / close ------------------------------------------------------------------ */

/* quick: for what decides whether and where the job starts (the lease, the
 * listing at resume): few retries and a short deadline, so that a store that
 * is down or hangs delays the start by seconds; the uploads in the
 * background keep the store's patient defaults (store.h). */
static void remote_opts(const config_t *cfg, int quick, store_opts *so)
{
    memset(so, 0, sizeof *so);
    so->endpoint = cfg->ckpt_endpoint && *cfg->ckpt_endpoint ? cfg->ckpt_endpoint : NULL;
    so->region = cfg->ckpt_region && *cfg->ckpt_region ? cfg->ckpt_region : NULL;
    so->addressing = cfg->ckpt_addressing == ADDR_PATH      ? STORE_ADDR_PATH
                     : cfg->ckpt_addressing == ADDR_VIRTUAL ? STORE_ADDR_VHOST
                                                            : STORE_ADDR_AUTO;
    so->part_bytes = (size_t)cfg->ckpt_part_mb << 20;
    if (quick) {
        so->max_retries = 2;
        so->timeout_s = 10;
        so->request_deadline_s = 30;
    }
}

/* Without a lease (checkpoint.lease_s 0), the write that proves the store
 * takes this job's checkpoints: a small object, put and deleted. c->lease_store
 * is then only this probe's. */
static int probe_remote(ckpt_ctl *c, int *connected, sp_err *err)
{
    sp_err e = {0};
    const char *key = ".spotune-probe";
    int rc = store_put_bytes(c->lease_store, key, "probe\n", 6, 0, &e);
    if (!rc)
        store_delete(c->lease_store, key, &e);
    *connected = rc == 0;
    if (rc == STORE_EAUTH || rc == STORE_ENOBUCKET) {
        *err = e;
        sp_err_prefix(err, "%s: the store refuses to hold this job's checkpoints: ",
                      store_url(c->store));
        return err->code = SP_EXIT_USAGE;
    }
    return 0;
}

/* Rank 0: the store, the job's lease on its prefix (also the probe that the
 * store takes writes from these credentials), and the uploader. */
static int open_remote(ckpt_ctl *c, sp_err *err)
{
    const config_t *cfg = c->cfg;
    store_opts so, quick;
    remote_opts(cfg, 0, &so);
    remote_opts(cfg, 1, &quick);
    if (store_open(&c->store, cfg->ckpt_remote, &so, err) ||
        store_open(&c->lease_store, cfg->ckpt_remote, &quick, err)) {
        sp_err_prefix(err, "checkpoint.remote: ");
        if (!err->code)
            err->code = SP_EXIT_USAGE;
        return err->code;
    }
    char note[2048] = "";
    int connected = 0;
    lease_opts lo = {.ttl_s = cfg->ckpt_lease_s,
                     .wait_s = cfg->ckpt_lease_s + 5,
                     .take_over = cfg->ckpt_take_over,
                     .run_dir = cfg->run_dir};
    int rc;
    if (cfg->ckpt_lease_s > 0) {
        rc = lease_acquire(&c->lease, c->lease_store, &lo, &connected, note, sizeof note, err);
        c->lease_store = NULL; /* the lease's now */
    } else {
        rc = probe_remote(c, &connected, err);
    }
    if (rc)
        return rc;
    if (note[0])
        log_event(c->log, c->metrics, "warning", "%s", note);
    if (!connected)
        log_event(c->log, c->metrics, "warning",
                  "%s does not answer now; training starts, and checkpoints are pushed when it "
                  "does",
                  store_url(c->store));
    uploader_opts uo = {.keep = (int)cfg->ckpt_keep,
                        .keep_every = (int)cfg->ckpt_keep_every,
                        .on_event = on_upload,
                        .arg = c};
    if (uploader_start(&c->up, c->store, &uo, err))
        return err->code ? err->code : SP_EXIT_OTHER;
    return 0;
}

int ckpt_ctl_open(ckpt_ctl **out, const config_t *cfg, comm_t *comm, const char *base_identity,
                  FILE *log, metrics_t *metrics, sp_err *err)
{
    ckpt_ctl *c = calloc(1, sizeof *c);
    if (!c)
        return sp_fail(err, SP_EXIT_OTHER, "out of memory");
    c->cfg = cfg;
    c->comm = comm;
    c->rank = comm_rank(comm);
    c->world = comm_size(comm);
    c->log = log;
    c->metrics = metrics;
    c->last_time = sp_now();
    c->last_step = -1;
    c->remote_step = -1;
    pthread_mutex_init(&c->remote_mu, NULL);
    c->global_batch = (int64_t)c->world * cfg->micro_batch * cfg->grad_accum;
    snprintf(c->root, sizeof c->root, "%s/checkpoints", cfg->run_dir);
    char mpath[4096];
    struct stat msb;
    snprintf(mpath, sizeof mpath, "%s/metrics.jsonl", cfg->run_dir);
    c->fresh_metrics = stat(mpath, &msb) != 0 || msb.st_size == 0;
    snprintf(c->base_identity, sizeof c->base_identity, "%s", base_identity);
    snprintf(c->config_hash, sizeof c->config_hash, "%016llx",
             (unsigned long long)config_math_hash(cfg));
    *out = c;
    int rc = 0;
    if (c->rank == 0) {
        if (mkdir(c->root, 0755) != 0 && errno != EEXIST)
            rc = sp_fail(err, SP_EXIT_OTHER, "%s: cannot create: %s", c->root, strerror(errno));
        if (!rc)
            rc = ckpt_writer_start(&c->writer, c->root, on_written, c, err);
        if (!rc && cfg->ckpt_remote && *cfg->ckpt_remote)
            rc = open_remote(c, err);
    }
    /* every rank learns whether rank 0 could open its side */
    int32_t code = rc;
    if (comm_allreduce(comm, &code, 1, COMM_I32, COMM_MAX, err))
        return err->code;
    if (code && !rc)
        return sp_fail(err, code, "rank 0 could not set up checkpointing");
    return rc;
}

int ckpt_ctl_remote_behind(ckpt_ctl *c)
{
    return c && c->up ? uploader_pending(c->up) : -1;
}

/* At the end of a finished run: the final checkpoint must be in the remote
 * store too, or the run does not count as done (a supervisor restarts it, and
 * the restart pushes the checkpoint). */
static int check_final_pushed(ckpt_ctl *c, sp_err *err)
{
    pthread_mutex_lock(&c->remote_mu);
    int64_t have = c->remote_step;
    int refused = c->remote_refused;
    pthread_mutex_unlock(&c->remote_mu);
    if (have >= c->last_step)
        return 0;
    sp_err why = {0};
    int known = uploader_last_error(c->up, &why);
    return sp_fail(err, SP_EXIT_OTHER,
                   "training finished, but its final checkpoint (step %lld) is not in %s: %s%s%s; "
                   "it is complete in %s, and running the same command again pushes it",
                   (long long)c->last_step, store_url(c->store),
                   refused ? "the store refused it"
                   : have < 0 ? "the store received no checkpoint of this run"
                              : "the store is behind",
                   known ? ": " : "", known ? why.msg : "", c->root);
}

int ckpt_ctl_close(ckpt_ctl *c, int wait_uploads, sp_err *err)
{
    if (!c)
        return 0;
    int rc = 0;
    if (c->writer) {
        rc = ckpt_writer_wait(c->writer, err);
        ckpt_writer_stop(c->writer);
        if (rc && wait_uploads)
            sp_err_prefix(err, "training finished, but its last checkpoint was not written: ");
    }
    if (c->up) {
        if (wait_uploads && uploader_pending(c->up) > 0) {
            log_event(c->log, c->metrics, "info", "waiting up to %.0f s for %d upload(s) to %s",
                      c->cfg->ckpt_final_upload_timeout_s, uploader_pending(c->up),
                      store_url(c->store));
            if (!uploader_wait(c->up, c->cfg->ckpt_final_upload_timeout_s))
                log_event(c->log, c->metrics, "warning",
                          "the remote store is %d checkpoint(s) behind; the local checkpoints in "
                          "%s are complete",
                          uploader_pending(c->up), c->root);
        }
        if (!rc && wait_uploads)
            rc = check_final_pushed(c, err);
        uploader_stop(c->up);
    }
    lease_release(c->lease);
    if (c->store)
        store_close(c->store);
    if (c->lease_store)
        store_close(c->lease_store);
    pthread_mutex_destroy(&c->remote_mu);
    free(c);
    return rc;
}

/* ---- snapshots ------------------------------------------------------------------------ */

static int add_param_arrays(model_t *m, ckpt_snapshot *s, sp_err *err)
{
    for (int i = 0; i < m->nparams; i++) {
        param_t *p = &m->params[i];
        if (!p->trainable)
            continue;
        const char *groups[3] = {"params/", "adam_m/", "adam_v/"};
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
static int gather_sharded(ckpt_ctl *c, model_t *m, ckpt_snapshot *s, int32_t code, sp_err *err)
{
    int root = c->rank == 0, S = m->shard_count;
    size_t piece = m->shard_len < ((size_t)1 << 22) ? m->shard_len : (size_t)1 << 22;
    float *send = malloc(sizeof(float) * piece);
    float *recv = root ? malloc(sizeof(float) * piece * (size_t)S) : NULL;
    float **arrays = root ? calloc((size_t)m->nparams, sizeof *arrays) : NULL;
    if (!code && (!send || (root && (!recv || !arrays))))
        code = sp_fail(err, SP_EXIT_OTHER, "out of host memory for a checkpoint");
    const char *groups[3] = {"params/", "adam_m/", "adam_v/"};
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

static int snapshot(ckpt_ctl *c, model_t *m, const train_progress *p, ckpt_snapshot *s,
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
              ckpt_set_str(s, "mode", cfg->mode == MODE_LORA ? "lora" : "full") ||
              ckpt_set_str(s, "rng", RNG_TAG) || ckpt_set_str(s, "writer", VERSION_TAG);
    free(yaml);
    /* the curve so far travels with the checkpoint, so a new machine has it */
    if (!bad && c->metrics && c->metrics->f) {
        char path[4096];
        size_t n = 0;
        fflush(c->metrics->f);
        snprintf(path, sizeof path, "%s/metrics.jsonl", cfg->run_dir);
        char *text = read_small_file(path, &n);
        if (text)
            bad = ckpt_add_file(s, "metrics.jsonl", text, n) != 0;
        free(text);
    }
    if (bad && !err->code)
        sp_fail(err, SP_EXIT_OTHER, "out of memory building a checkpoint");
    if (err->code || (m->shard_count == 1 && add_param_arrays(m, s, err))) {
        ckpt_snapshot_free(s);
        return err->code;
    }
    return 0;
}

/* ---- the step boundary ----------------------------------------------------------------- */

static int write_now(ckpt_ctl *c, model_t *m, const train_progress *p, const char *reason,
                     sp_err *err)
{
    int sharded = m->shard_count > 1;
    if (c->rank != 0 && !sharded)
        return 0;
    double t0 = sp_now(), waited = 0;
    ckpt_snapshot s;
    if (c->rank != 0) /* send this rank's shard of the optimizer state to rank 0 */
        return gather_sharded(c, m, NULL, 0, err);
    int32_t code = snapshot(c, m, p, &s, err);
    if (sharded && gather_sharded(c, m, code ? NULL : &s, code, err)) {
        if (!code)
            ckpt_snapshot_free(&s);
        return err->code;
    }
    if (code)
        return code;
    size_t bytes = s.bytes;
    if (ckpt_writer_submit(c->writer, &s, &waited, err))
        return err->code;
    double stall = sp_now() - t0;
    if (c->metrics && c->metrics->f) {
        /* the stall is what a user tunes cadence by: its own record */
        fprintf(c->metrics->f,
                "{\"event\":\"checkpoint\",\"step\":%lld,\"reason\":\"%s\",\"stall_s\":%.6f,"
                "\"waited_for_previous_s\":%.6f,\"bytes\":%zu,\"time\":%.3f}\n",
                (long long)p->step, reason, stall, waited, bytes, sp_wall_time());
        fflush(c->metrics->f);
    }
    if (c->log)
        fprintf(c->log,
                "checkpoint step %lld (%s): training held %.3f s (snapshot %.1f MiB%s); writing "
                "in the background\n",
                (long long)p->step, reason, stall, (double)bytes / 1048576.0,
                waited > 0.001 ? ", including a wait for the previous write" : "");
    if (c->log)
        fflush(c->log);
    return 0;
}

int ckpt_ctl_boundary(ckpt_ctl *c, model_t *m, const train_progress *p, int final, int *stop,
                      sp_err *err)
{
    const config_t *cfg = c->cfg;
    *stop = 0;
    int32_t flags[3] = {signals_received() > 0, 0, 0};
    sp_err lost = {0};
    if (c->rank == 0 && cfg->ckpt_every_minutes > 0 &&
        sp_now() - c->last_time >= cfg->ckpt_every_minutes * 60.0)
        flags[1] = 1;
    if (c->rank == 0)
        flags[2] = lease_lost(c->lease, &lost);
    if (comm_allreduce(c->comm, flags, 3, COMM_I32, COMM_MAX, err))
        return err->code;
    if (flags[2]) /* another job took the remote prefix over: this one ends */
        return c->rank == 0 ? sp_fail(err, SP_EXIT_USAGE, "%s; this job stops", lost.msg)
                            : sp_fail(err, SP_EXIT_USAGE, "rank 0 lost the remote prefix");
    int every = cfg->ckpt_every_steps > 0 && p->step % cfg->ckpt_every_steps == 0;
    const char *reason = flags[0] ? "signal" : final ? "end" : every ? "every_steps"
                         : flags[1] ? "every_minutes" : NULL;
    if (!reason)
        return 0;
    if (p->step != c->last_step) {
        if (write_now(c, m, p, reason, err))
            return err->code;
        c->last_step = p->step;
        c->last_time = sp_now();
    }
    if (!flags[0])
        return 0;
    /* stop: commit, push up to the deadline, and only then let every rank go */
    int32_t code = 0;
    if (c->rank == 0) {
        if (c->log) {
            fprintf(c->log, "stop requested (%s): committing checkpoint step %lld\n",
                    signals_received() ? signals_first_name() : "another rank",
                    (long long)p->step);
            fflush(c->log);
        }
        code = ckpt_writer_wait(c->writer, err);
        if (!code && c->up) {
            int pushed = uploader_wait(c->up, cfg->ckpt_upload_deadline_s);
            log_event(c->log, c->metrics, pushed ? "info" : "warning",
                      pushed ? "checkpoint step %lld is in %s"
                             : "checkpoint step %lld is not yet in %s after %.0f s; it is "
                               "complete locally",
                      (long long)p->step, store_url(c->store), cfg->ckpt_upload_deadline_s);
        }
    }
    double saved = comm_timeout(c->comm);
    comm_set_timeout(c->comm, saved + cfg->ckpt_upload_deadline_s + 600.0);
    int rc = comm_allreduce(c->comm, &code, 1, COMM_I32, COMM_MAX, err);
    comm_set_timeout(c->comm, saved);
    if (rc)
        return rc;
    if (code)
        return c->rank == 0 ? code : sp_fail(err, code, "rank 0 could not commit the checkpoint");
    *stop = 1;
    return 0;
}

/* ---- resume --------------------------------------------------------------------------- */

typedef struct resume_header {
    int32_t code, found;
    int64_t step, grad_accum;
    uint64_t cursor;
    double elapsed_s;
    char msg[1536];
} resume_header;

static void report_bad(void *ctx, const ckpt_info *bad)
{
    ckpt_ctl *c = ctx;
    log_event(c->log, c->metrics, "warning", "skipping checkpoint %s: %s", bad->name,
              bad->problem);
}

/* Downloads remote step-N into the local root and verifies it. *corrupt
 * (if given) is set when the download succeeded but the files do not match
 * their MANIFEST. */
static int pull_verified(ckpt_ctl *c, store_t *st, const char *name, char *path, size_t n,
                         int *corrupt, sp_err *err)
{
    char local[4096];
    if (corrupt)
        *corrupt = 0;
    snprintf(local, sizeof local, "%s/%s", c->root, name);
    ckpt_remove_tree(local); /* a broken local copy of the same step */
    if (store_pull_dir(st, name, local, NULL, err))
        return err->code ? err->code : SP_EXIT_OTHER;
    ckpt_manifest mf;
    if (ckpt_verify(local, &mf, err)) {
        ckpt_remove_tree(local);
        if (corrupt)
            *corrupt = 1;
        return err->code;
    }
    snprintf(path, n, "%s", local);
    return 0;
}

/* The newest remote checkpoint newer than local_step that verifies. */
static int find_remote(ckpt_ctl *c, int64_t local_step, char *path, size_t n, int *found,
                       sp_err *err)
{
    store_listing l;
    *found = 0;
    /* The listing gets few, short retries: a store that is down must not hold
     * the start of training for minutes (the uploads, in the background, keep
     * the patient defaults). */
    store_opts quick;
    remote_opts(c->cfg, 1, &quick);
    store_t *lister = NULL;
    int lrc = store_open(&lister, c->cfg->ckpt_remote, &quick, err) ||
              store_list(lister, "step-", &l, err);
    store_close(lister);
    if (lrc) {
        log_event(c->log, c->metrics, "warning",
                  "cannot list %s (%s); resuming from local checkpoints only",
                  store_url(c->store), err->msg);
        sp_err_clear(err);
        return 0;
    }
    pthread_mutex_lock(&c->remote_mu);
    for (size_t i = 0; i < l.n; i++) { /* what the store has: the catch-up push decides by it */
        long long step;
        if (sscanf(l.items[i].key, "step-%lld/", &step) == 1 &&
            strstr(l.items[i].key, "/" CKPT_MANIFEST) && step > c->remote_step)
            c->remote_step = step;
    }
    pthread_mutex_unlock(&c->remote_mu);
    for (size_t i = l.n; i-- > 0 && !*found;) { /* sorted: newest last */
        const char *k = l.items[i].key;
        long long step;
        char name[64];
        if (sscanf(k, "step-%lld/", &step) != 1 || !strstr(k, "/" CKPT_MANIFEST) ||
            step <= local_step)
            continue;
        ckpt_dir_name(name, sizeof name, step);
        log_event(c->log, c->metrics, "info", "downloading %s/%s", store_url(c->store), name);
        sp_err perr = {0};
        int corrupt = 0;
        if (pull_verified(c, c->store, name, path, n, &corrupt, &perr) == 0) {
            *found = 1;
            continue;
        }
        log_event(c->log, c->metrics, "warning", "skipping remote checkpoint %s: %s", name,
                  perr.msg);
        if (!corrupt)
            continue;
        /* It does not exist by the protocol; retiring its MANIFEST says so to
         * every reader and lets this run push the step again when it gets there. */
        char key[128];
        snprintf(key, sizeof key, "%s/%s", name, CKPT_MANIFEST);
        sp_err derr = {0};
        if (store_delete(c->store, key, &derr) == 0)
            log_event(c->log, c->metrics, "warning",
                      "removed the MANIFEST of %s/%s from the store: its files do not match it",
                      store_url(c->store), name);
        else
            log_event(c->log, c->metrics, "warning", "cannot retire %s/%s: %s",
                      store_url(c->store), name, derr.msg);
    }
    store_list_free(&l);
    return 0;
}

/* Rank 0: which checkpoint to restore (path empty: none). */
static int choose(ckpt_ctl *c, const char *resume, char *path, size_t n, sp_err *err)
{
    path[0] = 0;
    if (strcmp(resume, "none") == 0)
        return 0;
    if (strncmp(resume, "s3://", 5) == 0 || strncmp(resume, "file://", 7) == 0) {
        char url[4096];
        snprintf(url, sizeof url, "%s", resume);
        char *slash = strrchr(url, '/');
        if (!slash || strncmp(slash + 1, "step-", 5) != 0)
            return sp_fail(err, SP_EXIT_USAGE, "--resume %s: expected .../step-NNNNNNNN", resume);
        *slash = 0;
        store_opts so = {0};
        so.endpoint = *c->cfg->ckpt_endpoint ? c->cfg->ckpt_endpoint : NULL;
        so.region = *c->cfg->ckpt_region ? c->cfg->ckpt_region : NULL;
        store_t *st;
        if (store_open(&st, url, &so, err))
            return err->code ? err->code : SP_EXIT_USAGE;
        int rc = pull_verified(c, st, slash + 1, path, n, NULL, err);
        store_close(st);
        return rc;
    }
    if (strcmp(resume, "auto") != 0) {
        ckpt_manifest mf;
        if (ckpt_verify(resume, &mf, err))
            return err->code;
        snprintf(path, n, "%s", resume);
        return 0;
    }
    int found = 0;
    if (ckpt_find_latest(c->root, path, n, &found, report_bad, c, err))
        return err->code;
    int64_t local_step = -1;
    if (found) {
        const char *b = strrchr(path, '/');
        local_step = strtoll(b + 6, NULL, 10);
    } else {
        path[0] = 0;
    }
    if (c->store) {
        int rfound = 0;
        char rpath[4096];
        if (find_remote(c, local_step, rpath, sizeof rpath, &rfound, err))
            return err->code;
        if (rfound)
            snprintf(path, n, "%s", rpath);
    }
    return 0;
}

/* The attributes a resume reads, each of the type and range this writer
 * gives it: state.h5 can be damaged and still match its MANIFEST. */
static int check_state(const ckpt_snapshot *s, const char *path, sp_err *err)
{
    static const struct {
        const char *name;
        int type;
        double min;
    } need[] = {{"step", CKPT_ATTR_INT, 0},         {"cursor", CKPT_ATTR_INT, 0},
                {"global_batch", CKPT_ATTR_INT, 1}, {"world_size", CKPT_ATTR_INT, 1},
                {"elapsed_s", CKPT_ATTR_REAL, 0},   {"config", CKPT_ATTR_STR, 0},
                {"mode", CKPT_ATTR_STR, 0}};
    static const char *const types[] = {"an integer", "a number", "a string"};
    for (size_t i = 0; i < sizeof need / sizeof need[0]; i++) {
        const ckpt_attr *a = ckpt_get(s, need[i].name);
        if (!a)
            return sp_fail(err, SP_EXIT_INPUT, "%s/%s lacks the attribute '%s'", path,
                           CKPT_STATE_FILE, need[i].name);
        double v = a->type == CKPT_ATTR_INT ? (double)a->i : a->d;
        if (a->type != need[i].type || (a->type != CKPT_ATTR_STR && !(v >= need[i].min)) ||
            (a->type == CKPT_ATTR_REAL && !isfinite(v)))
            return sp_fail(err, SP_EXIT_INPUT,
                           "%s/%s: the attribute '%s' is not %s of at least %g (damaged?)", path,
                           CKPT_STATE_FILE, need[i].name, types[need[i].type], need[i].min);
    }
    if (ckpt_get(s, "step")->i != s->step)
        return sp_fail(err, SP_EXIT_INPUT, "%s/%s says step %lld, its MANIFEST step %lld", path,
                       CKPT_STATE_FILE, (long long)ckpt_get(s, "step")->i, (long long)s->step);
    return 0;
}

static int check_compatible(ckpt_ctl *c, const ckpt_snapshot *s, const char *path,
                            int64_t micro_batch, int64_t *ga, sp_err *err)
{
    const config_t *cfg = c->cfg;
    if (check_state(s, path, err))
        return err->code;
    const ckpt_attr *conf = ckpt_get(s, "config"), *gb = ckpt_get(s, "global_batch");
    if (strcmp(s->config_hash, c->config_hash) != 0) {
        config_t was;
        char diff[1200] = "";
        config_defaults(&was);
        if (config_load_text(&was, conf->s, "checkpoint config", err) == 0)
            config_diff_math(&was, cfg, diff, sizeof diff);
        config_free(&was);
        sp_err_clear(err);
        return sp_fail(err, SP_EXIT_USAGE,
                       "%s was trained with different settings: %s. Resuming would change the "
                       "math of the run; restore them, or start afresh with --resume none or a "
                       "new run.dir",
                       path, diff[0] ? diff : "(the config hash differs)");
    }
    if (cfg->mode == MODE_LORA && strcmp(s->base_model, c->base_identity) != 0)
        return sp_fail(err, SP_EXIT_USAGE,
                       "%s was trained on another base model (identity %s; %s is %s): a LoRA "
                       "checkpoint only fits the model it was trained on",
                       path, s->base_model, cfg->model_path, c->base_identity);
    int64_t G = gb->i, per = (int64_t)c->world * micro_batch;
    if (per * *ga == G)
        return 0;
    if (G % per != 0)
        return sp_fail(err, SP_EXIT_USAGE,
                       "%s has a global batch of %lld windows, which %d ranks x micro_batch %lld "
                       "cannot split evenly; choose train.micro_batch so that %d x micro_batch "
                       "divides %lld",
                       path, (long long)G, c->world, (long long)micro_batch, c->world,
                       (long long)G);
    log_event(c->log, c->metrics, "info",
              "the checkpoint ran with %d rank(s); train.grad_accum is now %lld to keep the "
              "global batch of %lld windows",
              s->world_size, (long long)(G / per), (long long)G);
    *ga = G / per;
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

/* Every rank: the trainable state from rank 0's snapshot (s is NULL elsewhere). */
static int restore_params(ckpt_ctl *c, model_t *m, const ckpt_snapshot *s, sp_err *err)
{
    for (int i = 0; i < m->nparams; i++) {
        param_t *p = &m->params[i];
        if (!p->trainable)
            continue;
        const char *groups[3] = {"params/", "adam_m/", "adam_v/"};
        tensor_t dst[3] = {{0}};
        if (m->shard_count == 1) {
            dst[1] = tensor_view(m->adam_m, p->offset, p->n);
            dst[2] = tensor_view(m->adam_v, p->offset, p->n);
        }
        float *buf = malloc(sizeof(float) * p->n);
        int32_t code = buf ? 0 : SP_EXIT_OTHER;
        for (int g = 0; g < 3; g++) {
            char name[256];
            snprintf(name, sizeof name, "%s%s", groups[g], p->name);
            if (s && !code) {
                const ckpt_array *a = ckpt_find_array(s, name);
                if (!a || a->n != p->n)
                    code = sp_fail(err, SP_EXIT_INPUT, "the checkpoint %s %s", a ? "has the wrong size of" : "lacks", name);
                else
                    memcpy(buf, a->data, sizeof(float) * p->n);
            }
            if (comm_allreduce(c->comm, &code, 1, COMM_I32, COMM_MAX, err))
                return err->code;
            if (code) {
                free(buf);
                return err->code ? err->code : sp_fail(err, code, "rank 0 could not restore %s", name);
            }
            if (comm_bcast(c->comm, buf, sizeof(float) * p->n, 0, err))
                return err->code;
            if (g == 0)
                model_param_upload(m, p, buf, DT_F32);
            else
                upload_moment(m, p, g == 1 ? m->adam_m : m->adam_v, dst[g], buf);
        }
        free(buf);
    }
    return be_check(m->be, err);
}

/* A resumed run rewrites metrics.jsonl without the records of steps after
 * the checkpoint, so the curve a user plots has no repeated steps; on a new
 * machine (no metrics yet) it starts from the checkpoint's copy. */
static void trim_metrics(ckpt_ctl *c, const char *ckpt_dir, int64_t step)
{
    if (!c->metrics || !c->metrics->f)
        return;
    char path[4096], tmp[4200], saved[4200];
    snprintf(path, sizeof path, "%s/metrics.jsonl", c->cfg->run_dir);
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    snprintf(saved, sizeof saved, "%s/metrics.jsonl", ckpt_dir);
    fflush(c->metrics->f);
    FILE *in = fopen(c->fresh_metrics ? saved : path, "r"), *out = fopen(tmp, "w");
    char *line = NULL;
    size_t cap = 0;
    while (in && out && getline(&line, &cap, in) > 0) {
        const char *sp = strstr(line, "\"step\":");
        if (!sp || strtoll(sp + 7, NULL, 10) <= step)
            fputs(line, out);
    }
    if (c->fresh_metrics && out) { /* this process's own records so far */
        FILE *mine = fopen(path, "r");
        while (mine && getline(&line, &cap, mine) > 0)
            fputs(line, out);
        if (mine)
            fclose(mine);
    }
    free(line);
    if (in)
        fclose(in);
    if (out && fclose(out) == 0 && rename(tmp, path) == 0) {
        fclose(c->metrics->f);
        c->metrics->f = fopen(path, "a");
    }
}

/* Rank 0, resuming from a local checkpoint newer than any in the remote
 * store (a run that stopped before its push finished, or whose store was
 * down): it is pushed now, so the store catches up even if the run has
 * nothing left to train. A push of what the store has already is a no-op. */
static void push_if_missing(ckpt_ctl *c, const char *path, int64_t step)
{
    pthread_mutex_lock(&c->remote_mu);
    int64_t have = c->remote_step;
    pthread_mutex_unlock(&c->remote_mu);
    if (!c->up || step <= have)
        return;
    sp_err e = {0};
    const char *name = strrchr(path, '/') ? strrchr(path, '/') + 1 : path;
    if (uploader_submit(c->up, path, name, &e) < 0)
        log_event(c->log, c->metrics, "warning", "upload of %s not queued: %s", name, e.msg);
    else
        log_event(c->log, c->metrics, "info", "%s lacks checkpoint step %lld: pushing it",
                  store_url(c->store), (long long)step);
}

int ckpt_ctl_resume(ckpt_ctl *c, model_t *m, const char *resume, int64_t micro_batch,
                    int64_t *grad_accum, train_progress *p, int *resumed, sp_err *err)
{
    resume_header h;
    memset(&h, 0, sizeof h);
    ckpt_snapshot s;
    ckpt_snapshot_init(&s);
    char path[4096] = "";
    *resumed = 0;
    if (c->rank == 0) {
        sp_err e = {0};
        int64_t ga = *grad_accum;
        int rc = choose(c, resume, path, sizeof path, &e);
        if (!rc && path[0]) {
            rc = state_read_checked(path, &s, &e);
            if (!rc)
                rc = check_compatible(c, &s, path, micro_batch, &ga, &e);
        }
        h.code = rc;
        h.found = !rc && path[0];
        snprintf(h.msg, sizeof h.msg, "%s", e.msg);
        if (h.found)
            push_if_missing(c, path, s.step);
        if (h.found) {
            const ckpt_attr *cur = ckpt_get(&s, "cursor"), *el = ckpt_get(&s, "elapsed_s");
            h.step = s.step;
            h.cursor = cur ? (uint64_t)cur->i : 0;
            h.elapsed_s = el ? el->d : 0;
            h.grad_accum = ga;
        }
    }
    if (comm_bcast(c->comm, &h, sizeof h, 0, err))
        return err->code;
    /* checkpoint.every_minutes counts from here, not from before a download */
    c->last_time = sp_now();
    if (h.code) {
        ckpt_snapshot_free(&s);
        return sp_fail(err, h.code, "%s", h.msg);
    }
    if (!h.found)
        return 0;
    int rc = restore_params(c, m, c->rank == 0 ? &s : NULL, err);
    ckpt_snapshot_free(&s);
    if (rc)
        return rc;
    p->step = h.step;
    p->cursor = h.cursor;
    p->elapsed_s = h.elapsed_s;
    *grad_accum = h.grad_accum;
    /* the checkpoint's global batch, re-split over this rank count, is what
     * every later checkpoint of this run records */
    c->global_batch = (int64_t)c->world * micro_batch * h.grad_accum;
    *resumed = 1;
    c->last_step = h.step;
    if (c->rank == 0) {
        trim_metrics(c, path, h.step);
        log_event(c->log, c->metrics, "resume", "resumed from %s: step %lld, sample %llu", path,
                  (long long)h.step, (unsigned long long)h.cursor);
    }
    return 0;
}
