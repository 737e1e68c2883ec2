/* The checkpoint controller's object store (rank 0): opening it with the
 * job's lease, the uploads' events, the final push, finding and pulling
 * remote checkpoints at resume, and pushing a local one the store lacks. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "checkpointing_internal.h"

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
        double mb_s = ev->seconds > 0 ? (double)ev->bytes / 1e6 / ev->seconds : 0.0;
        double deadline = c->cfg->ckpt_upload_deadline_s;
        pthread_mutex_lock(&c->remote_mu);
        c->upload_s = ev->seconds;
        c->upload_mb_s = mb_s;
        int slow = ev->seconds > deadline && !c->upload_slow_said;
        c->upload_slow_said |= slow;
        pthread_mutex_unlock(&c->remote_mu);
        log_event_with(c->log, c->metrics, "checkpoint_uploaded",
                       json_pack("{s:I, s:f, s:f}", "bytes", (json_int_t)ev->bytes, "seconds",
                                 ev->seconds, "mb_per_s", mb_s),
                       "%s/%s (%.1f MiB in %.2f s, %.1f MB/s)", store_url(c->store), ev->prefix,
                       (double)ev->bytes / 1048576.0, ev->seconds, mb_s);
        if (slow)
            log_event(c->log, c->metrics, "warning",
                      "pushing %s took %.0f s, longer than checkpoint.upload_deadline_s (%.0f "
                      "s): a checkpoint written on a preemption notice would not reach the "
                      "store before the machine goes (the previous one would be used); raise "
                      "the deadline to what the cloud's notice allows, or checkpoint more often",
                      ev->prefix, ev->seconds, deadline);
        break;
    }
    case UPLOADER_JOB_RETRY:
        log_event(c->log, c->metrics, "warning",
                  "upload of %s failed (attempt %d), retrying in %.0f s: %s", ev->prefix,
                  ev->attempt, ev->retry_in_s, ev->err ? ev->err->msg : "");
        break;
    case UPLOADER_JOB_FAILED: {
        /* credentials refused, no such bucket or another region: said once,
         * loudly; the store gets nothing more from this run, which ends
         * non-zero */
        int refused = ev->rc == STORE_EAUTH || ev->rc == STORE_ENOBUCKET ||
                      ev->rc == STORE_EUSAGE;
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
    case UPLOADER_JOB_DROPPED:
        log_event(c->log, c->metrics, "warning",
                  "%s will not be complete in the store (superseded by a newer checkpoint): %s",
                  ev->prefix ? ev->prefix : "?", ev->err ? ev->err->msg : "");
        break;
    case UPLOADER_PRUNE_FAILED:
        log_event(c->log, c->metrics, "warning", "remote retention failed: %s",
                  ev->err ? ev->err->msg : "");
        break;
    default:
        break;
    }
}

/* quick: for what decides whether and where the job starts (the lease, the
 * listing at resume): few retries and a short deadline, so that a store that
 * is down or hangs delays the start by seconds; the uploads in the
 * background keep the store's patient defaults (store.h). */
void ckpt_remote_opts(const config_t *cfg, int quick, store_opts *so)
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

/* The uploader's gate: with a lease, nothing is pushed before it is written
 * (a store that did not answer at start may hold another live job's
 * checkpoints under this prefix), and nothing after it is lost. */
static int may_push(void *arg, sp_err *why)
{
    ckpt_ctl *c = arg;
    if (!c->lease)
        return 1;
    if (lease_lost(c->lease, why))
        return -1;
    if (lease_held(c->lease))
        return 1;
    sp_fail(why, SP_EXIT_OTHER,
            "this job's lease on %s is not written yet (the store did not answer at start)",
            store_url(c->store));
    return 0;
}

int ckpt_remote_may_put(void *arg, sp_err *why)
{
    ckpt_ctl *c = arg;
    if (c->rank == 0)
        return may_push(c, why);
    return lease_check(c->gate_store, c->lease_job, why);
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
    if (rc == STORE_EAUTH || rc == STORE_ENOBUCKET || rc == STORE_EUSAGE) {
        *err = e;
        sp_err_prefix(err, "%s: the store refuses to hold this job's checkpoints: ",
                      store_url(c->store));
        return err->code = SP_EXIT_USAGE;
    }
    return 0;
}

/* Rank 0: the store, the job's lease on its prefix (also the probe that the
 * store takes writes from these credentials), and the uploader. */
int ckpt_remote_open(ckpt_ctl *c, sp_err *err)
{
    const config_t *cfg = c->cfg;
    store_opts so, quick;
    ckpt_remote_opts(cfg, 0, &so);
    ckpt_remote_opts(cfg, 1, &quick);
    if (store_open(&c->store, cfg->ckpt_remote, &so, err) ||
        store_open(&c->lease_store, cfg->ckpt_remote, &quick, err)) {
        sp_err_prefix(err, "checkpoint.remote: ");
        if (!err->code)
            err->code = SP_EXIT_USAGE;
        return err->code;
    }
    char note[SP_ERR_MSG_MAX] = "";
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
                  "does%s",
                  store_url(c->store),
                  c->lease ? " and this job's lease on the prefix is written" : "");
    uploader_opts uo = {.keep = (int)cfg->ckpt_keep,
                        .keep_every = (int)cfg->ckpt_keep_every,
                        .on_event = on_upload,
                        .may_push = may_push,
                        .arg = c};
    if (uploader_start(&c->up, c->store, &uo, err))
        return err->code ? err->code : SP_EXIT_OTHER;
    return 0;
}

/* At the end of a finished run: the final checkpoint must be in the remote
 * store too, or the run does not count as done (a supervisor restarts it, and
 * the restart pushes the checkpoint). */
int ckpt_remote_final_pushed(ckpt_ctl *c, sp_err *err)
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

/* Downloads remote step-N into the local root and verifies it. *corrupt
 * (if given) is set when the download succeeded but the files do not match
 * their MANIFEST. */
int ckpt_remote_pull(ckpt_ctl *c, store_t *st, const char *name, char **path, int *corrupt,
                     sp_err *err)
{
    *path = NULL;
    if (corrupt)
        *corrupt = 0;
    free(c->ranged_url);
    c->ranged_url = NULL;
    /* a sharded checkpoint whose blocks carry checksums stays in the store:
     * only its MANIFEST, state and metrics come here */
    char *key = sp_strf("%s/%s", name, CKPT_MANIFEST), *text = NULL;
    size_t n = 0;
    sp_err merr = {0};
    int ranged = key && store_get_bytes(st, key, (void **)&text, &n, &merr) == 0 &&
                 strlen(text) == n && ckpt_sharded_ranged(text);
    free(key);
    char *local = ranged ? sp_strf("%s/.remote-%s", c->root, name)
                         : sp_strf("%s/%s", c->root, name);
    if (!local) {
        free(text);
        return sp_fail(err, SP_EXIT_OTHER, "out of memory");
    }
    int rc = 0;
    if (ranged) {
        if (ckpt_pull_unsharded(st, name, text, local, corrupt, err))
            rc = err->code ? err->code : SP_EXIT_OTHER;
        else if (!(c->ranged_url = strdup(store_url(st))))
            rc = sp_fail(err, SP_EXIT_OTHER, "out of memory");
        free(text);
        if (rc)
            free(local);
        else
            *path = local;
        return rc;
    }
    free(text);
    ckpt_remove_tree(local); /* a broken local copy of the same step */
    ckpt_manifest mf;
    if (store_pull_dir(st, name, local, NULL, err)) {
        rc = err->code ? err->code : SP_EXIT_OTHER;
    } else if (ckpt_verify(local, &mf, err)) {
        ckpt_manifest_free(&mf);
        ckpt_remove_tree(local);
        if (corrupt)
            *corrupt = 1;
        rc = err->code;
    }
    ckpt_manifest_free(&mf);
    if (rc)
        free(local);
    else
        *path = local;
    return rc;
}

/* The newest remote checkpoint newer than local_step that verifies. */
int ckpt_remote_retire(ckpt_ctl *c, const char *name, sp_err *err)
{
    char key[128];
    snprintf(key, sizeof key, "%s/%s", name, CKPT_MANIFEST);
    return store_delete(c->store, key, err);
}

/* The store's checkpoints, listed with few, short retries: a store that is
 * down must not hold the start of training (or a step) for minutes (the
 * uploads, in the background, keep the patient defaults). */
static int list_quick(ckpt_ctl *c, store_listing *l, sp_err *err)
{
    store_opts quick;
    ckpt_remote_opts(c->cfg, 1, &quick);
    store_t *lister = NULL;
    int lrc = store_open(&lister, c->cfg->ckpt_remote, &quick, err) ||
              store_list(lister, "step-", l, err);
    store_close(lister);
    return lrc;
}

int64_t ckpt_remote_newer(ckpt_ctl *c, int64_t step)
{
    if (!c->list_pending || sp_now() < c->list_next)
        return -1;
    pthread_mutex_lock(&c->remote_mu);
    int pushed = c->remote_step >= 0;
    pthread_mutex_unlock(&c->remote_mu);
    if (c->lease ? !lease_held(c->lease) : !pushed) /* the store has not answered yet */
        return -1;
    store_listing l;
    sp_err err = {0};
    if (list_quick(c, &l, &err)) { /* the quick listing can hold a step: 10 s, 20, ... 320 */
        c->list_wait = c->list_wait > 0 ? (c->list_wait < 320 ? 2 * c->list_wait : 320) : 10;
        c->list_next = sp_now() + c->list_wait;
        return -1;
    }
    c->list_pending = 0;
    int64_t newest = -1;
    for (size_t i = 0; i < l.n; i++) {
        long long s;
        if (sscanf(l.items[i].key, "step-%lld/", &s) == 1 &&
            strstr(l.items[i].key, "/" CKPT_MANIFEST) && s > newest)
            newest = s;
    }
    store_list_free(&l);
    log_event(c->log, c->metrics, "info",
              "%s answers: its newest checkpoint is %s%lld (this job is at step %lld)",
              store_url(c->store), newest < 0 ? "none, " : "step ", (long long)newest,
              (long long)step);
    return newest > step ? newest : -1;
}

int ckpt_remote_find(ckpt_ctl *c, int64_t local_step, char **path, sp_err *err)
{
    store_listing l;
    *path = NULL;
    if (list_quick(c, &l, err)) {
        log_event(c->log, c->metrics, "warning",
                  "cannot list %s (%s); resuming from local checkpoints only, and listing it "
                  "again once it answers: a newer checkpoint there then stops this job so "
                  "that a restart resumes it",
                  store_url(c->store), err->msg);
        sp_err_clear(err);
        c->list_pending = 1;
        c->list_next = 0;
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
    for (size_t i = l.n; i-- > 0 && !*path;) { /* sorted: newest last */
        const char *k = l.items[i].key;
        long long step;
        char name[64];
        if (sscanf(k, "step-%lld/", &step) != 1 || !strstr(k, "/" CKPT_MANIFEST) ||
            step <= local_step || step >= c->remote_skip_from || step >= c->remote_refused_from)
            continue;
        ckpt_dir_name(name, sizeof name, step);
        log_event(c->log, c->metrics, "info", "downloading %s/%s", store_url(c->store), name);
        sp_err perr = {0};
        int corrupt = 0;
        if (ckpt_remote_pull(c, c->store, name, path, &corrupt, &perr) == 0)
            continue;
        log_event(c->log, c->metrics, "warning", "skipping remote checkpoint %s: %s", name,
                  perr.msg);
        if (!corrupt)
            continue;
        /* It does not exist by the protocol; retiring its MANIFEST says so to
         * every reader and lets this run push the step again when it gets there. */
        sp_err derr = {0};
        if (ckpt_remote_retire(c, name, &derr) == 0)
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

/* Rank 0, resuming from a local checkpoint newer than any in the remote
 * store (a run that stopped before its push finished, or whose store was
 * down): it is pushed now, so the store catches up even if the run has
 * nothing left to train. A push of what the store has already is a no-op. */
void ckpt_remote_push_if_missing(ckpt_ctl *c, const char *path, int64_t step)
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

/* The MB/s of the newest checkpoint_uploaded record in RUN_DIR/metrics.jsonl
 * that has one, or 0. */
static double last_upload_rate(const config_t *cfg)
{
    char *path = sp_strf("%s/metrics.jsonl", cfg->run_dir);
    FILE *f = path ? fopen(path, "r") : NULL;
    free(path);
    double rate = 0;
    char *line = NULL;
    size_t cap = 0;
    while (f && getline(&line, &cap, f) > 0) {
        if (!strstr(line, "\"checkpoint_uploaded\""))
            continue;
        json_t *o = json_loads(line, 0, NULL);
        json_t *r = json_object_get(o, "mb_per_s");
        if (json_is_number(r) && json_number_value(r) > 0)
            rate = json_number_value(r);
        json_decref(o);
    }
    free(line);
    if (f)
        fclose(f);
    return rate;
}

void ckpt_remote_budget_check(ckpt_ctl *c, uint64_t state_bytes)
{
    if (c->rank != 0 || !c->up)
        return;
    double rate = last_upload_rate(c->cfg), deadline = c->cfg->ckpt_upload_deadline_s;
    if (rate <= 0)
        return; /* nothing measured yet: the first push says (on_upload) */
    double need = (double)state_bytes / 1e6 / rate;
    if (need > deadline)
        log_event_with(c->log, c->metrics, "warning",
                       json_pack("{s:s, s:I, s:f, s:f, s:f}", "check", "upload_budget",
                                 "checkpoint_bytes", (json_int_t)state_bytes, "mb_per_s", rate,
                                 "upload_s", need, "deadline_s", deadline),
                       "at the upload rate this run last measured (%.1f MB/s), a checkpoint of "
                       "%.1f MiB needs about %.0f s to reach %s, longer than "
                       "checkpoint.upload_deadline_s (%.0f s): on a preemption notice the "
                       "newest checkpoint would stay behind (the previous one would be used)",
                       rate, (double)state_bytes / 1048576.0, need, store_url(c->store),
                       deadline);
}
