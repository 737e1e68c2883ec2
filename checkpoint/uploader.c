/* checkpoint/uploader.c — the background checkpoint pusher: a thread taking
 * jobs from a bounded queue (oldest first), pushing each with store_push_dir
 * once may_push allows it, putting a failed or held job back at the head
 * with a deadline, and running retention after each success. The mutex
 * guards the queue and counters; events are delivered with the mutex
 * released. */
#define _GNU_SOURCE
#include "checkpoint/uploader.h"
#include "checkpoint/ckpt.h"
#include "checkpoint/store_impl.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct job {
    char *dir, *prefix;
    int attempt;       /* tries made so far */
    double not_before; /* sp_now() deadline of the next try */
    double shards_wait_s; /* > 0: the ranks put the shard files (uploader_submit_sharded) */
} job;

struct uploader {
    store_t *store;
    uploader_opts o;
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t work_cv; /* a job was queued, or stop */
    pthread_cond_t idle_cv; /* pending went down */
    job *q;                 /* waiting jobs, oldest first */
    int qn;
    int busy;               /* a job is in progress */
    int stop;
    int hurry;              /* uploader_hurry: the newest first */
    atomic_int cancel;      /* uploader_stop */
    atomic_int job_cancel;  /* the push or prune in flight: stopped, or hurried past */
    sp_err last_err;
    int has_err;
    uint64_t rng;
};

static void job_free(job *j)
{
    free(j->dir);
    free(j->prefix);
    j->dir = j->prefix = NULL;
}

static void emit(uploader_t *u, uploader_event ev)
{
    if (u->o.on_event)
        u->o.on_event(u->o.arg, &ev);
}

/* Waits on cv until the monotonic time `until` (or forever if until < 0). */
static int wait_until(pthread_cond_t *cv, pthread_mutex_t *mu, double until)
{
    if (until < 0)
        return pthread_cond_wait(cv, mu);
    double left = until - sp_now();
    if (left <= 0)
        return ETIMEDOUT;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    double t = (double)ts.tv_sec + ts.tv_nsec * 1e-9 + left;
    ts.tv_sec = (time_t)t;
    ts.tv_nsec = (long)((t - (double)ts.tv_sec) * 1e9);
    return pthread_cond_timedwait(cv, mu, &ts);
}

/* ---- the thread ------------------------------------------------------------- */

typedef struct job_ctx {
    uploader_t *u;
    const job *j; /* NULL while pruning */
} job_ctx;

static void on_key(void *arg, const char *key)
{
    job_ctx *c = arg;
    uploader_event ev = {.kind = c->j ? UPLOADER_FILE_DONE : UPLOADER_PRUNED,
                         .local_dir = c->j ? c->j->dir : NULL,
                         .prefix = c->j ? c->j->prefix : NULL,
                         .key = key,
                         .attempt = c->j ? c->j->attempt : 0};
    emit(c->u, ev);
}

static void run_retention(uploader_t *u)
{
    pthread_mutex_lock(&u->mu);
    int keep = u->o.keep, every = u->o.keep_every;
    pthread_mutex_unlock(&u->mu);
    if (keep <= 0)
        return;
    pthread_mutex_lock(&u->mu);
    int newer = u->hurry && u->qn > 0; /* the newest first: pruned after it */
    pthread_mutex_unlock(&u->mu);
    if (newer)
        return;
    sp_err e = {0};
    job_ctx c = {u, NULL};
    store_xfer_opts x = {&u->job_cancel, on_key, &c, 0, 0};
    if (store_prune_steps(u->store, keep, every, &x, NULL, &e) && !atomic_load(&u->job_cancel))
        emit(u, (uploader_event){.kind = UPLOADER_PRUNE_FAILED, .err = &e});
}

/* Failures that trying again cannot mend: a local error, a bad prefix,
 * another checkpoint at the prefix, credentials the store refuses, no such
 * bucket. */
static int permanent(int rc)
{
    return rc == STORE_ELOCAL || rc == STORE_EUSAGE || rc == STORE_EEXIST ||
           rc == STORE_EAUTH || rc == STORE_ENOBUCKET;
}

/* Called with the mutex held, the job just tried and failed: requeue or drop. */
static uploader_event_kind requeue(uploader_t *u, job *j, int rc, double *retry_in)
{
    if (permanent(rc))
        return UPLOADER_JOB_FAILED;
    /* a rank's shard is missing: a newer checkpoint waiting is worth more
     * than waiting longer for it */
    if (rc == STORE_EPEER && u->qn > 0)
        return UPLOADER_JOB_DROPPED;
    if (u->qn >= u->o.max_queue)
        return UPLOADER_JOB_DROPPED; /* it is the oldest waiting job */
    store_opts bo = {.retry_base_s = u->o.retry_base_s, .retry_max_s = u->o.retry_max_s};
    *retry_in = store_backoff_s(&bo, j->attempt - 1, &u->rng);
    j->not_before = sp_now() + *retry_in;
    memmove(u->q + 1, u->q, (size_t)u->qn * sizeof *u->q);
    u->q[0] = *j;
    u->qn++;
    return UPLOADER_JOB_RETRY;
}

static void finish_job(uploader_t *u, job *j, int rc, const sp_err *e, double seconds)
{
    double retry_in = 0;
    uploader_event_kind kind = UPLOADER_JOB_DONE;
    job copy = *j; /* requeue moves j's strings into the queue */
    sp_err passed = {0};
    pthread_mutex_lock(&u->mu);
    int stopping = u->stop;
    if (rc == STORE_ECANCELED && !stopping && u->hurry && u->qn > 0) {
        kind = UPLOADER_JOB_DROPPED; /* hurried past: a newer checkpoint goes first */
        sp_fail(&passed, SP_EXIT_OTHER, "superseded by a newer checkpoint, pushed first as "
                "the job stops");
        e = &passed;
    } else if (rc) {
        u->last_err = *e;
        u->has_err = 1;
        kind = stopping ? UPLOADER_JOB_FAILED : requeue(u, j, rc, &retry_in);
    } else {
        u->has_err = 0;
    }
    if (kind == UPLOADER_JOB_RETRY) { /* the queue owns the strings now: copy for the event */
        u->busy = 0;                  /* counted once, as a waiting job */
        copy.dir = strdup(j->dir);
        copy.prefix = strdup(j->prefix);
    }
    pthread_mutex_unlock(&u->mu);
    if (!stopping)
        emit(u, (uploader_event){.kind = kind, .local_dir = copy.dir, .prefix = copy.prefix,
                                 .err = rc ? e : NULL, .rc = rc, .attempt = copy.attempt,
                                 .retry_in_s = retry_in, .seconds = rc ? 0 : seconds,
                                 .bytes = rc ? 0 : ckpt_tree_bytes(copy.dir)});
    job_free(&copy);
    pthread_mutex_lock(&u->mu);
    u->busy = 0; /* only now: uploader_wait returns after the events and retention */
    pthread_cond_broadcast(&u->idle_cv);
    pthread_mutex_unlock(&u->mu);
}

/* may_push said "not yet": j goes back to the head of the queue, asked
 * again after UPLOADER_HOLD_S; dropped (with an event) when newer jobs have
 * filled the queue meanwhile. */
static void hold_job(uploader_t *u, job *j)
{
    pthread_mutex_lock(&u->mu);
    int drop = u->qn >= u->o.max_queue || u->stop;
    if (!drop) {
        j->not_before = sp_now() + UPLOADER_HOLD_S;
        memmove(u->q + 1, u->q, (size_t)u->qn * sizeof *u->q);
        u->q[0] = *j;
        u->qn++;
    }
    pthread_mutex_unlock(&u->mu);
    if (drop) {
        sp_err e = {0};
        sp_fail(&e, SP_EXIT_OTHER, "superseded by newer checkpoints while its push was held");
        if (!u->stop)
            emit(u, (uploader_event){.kind = UPLOADER_JOB_DROPPED, .local_dir = j->dir,
                                     .prefix = j->prefix, .err = &e});
        job_free(j);
    }
    pthread_mutex_lock(&u->mu);
    u->busy = 0;
    pthread_cond_broadcast(&u->idle_cv);
    pthread_mutex_unlock(&u->mu);
}

static void run_job(uploader_t *u, job *j)
{
    if (u->o.may_push) {
        sp_err why = {0};
        int ok = u->o.may_push(u->o.arg, &why);
        if (ok < 0) {
            if (!why.code)
                sp_fail(&why, SP_EXIT_USAGE, "the push of %s is not allowed", j->prefix);
            finish_job(u, j, STORE_EUSAGE, &why, 0); /* permanent: fails for good */
            return;
        }
        if (ok == 0) {
            hold_job(u, j);
            return;
        }
    }
    job_ctx c = {u, j};
    atomic_store(&u->job_cancel, atomic_load(&u->cancel));
    store_xfer_opts x = {&u->job_cancel, on_key, &c, j->shards_wait_s > 0, j->shards_wait_s};
    sp_err e = {0};
    j->attempt++;
    double t0 = sp_now();
    int rc = store_push_dir(u->store, j->dir, j->prefix, &x, &e);
    double seconds = sp_now() - t0;
    if (!rc)
        run_retention(u);
    finish_job(u, j, rc, &e, seconds);
}

/* With the mutex held: takes the head job when due; 0 when it should stop. */
static int next_job(uploader_t *u, job *out)
{
    while (!u->stop) {
        if (u->qn == 0) {
            wait_until(&u->work_cv, &u->mu, -1);
            continue;
        }
        if (u->q[0].not_before > sp_now()) {
            wait_until(&u->work_cv, &u->mu, u->q[0].not_before);
            continue;
        }
        *out = u->q[0];
        memmove(u->q, u->q + 1, (size_t)(u->qn - 1) * sizeof *u->q);
        u->qn--;
        u->busy = 1;
        return 1;
    }
    return 0;
}

static void *uploader_main(void *arg)
{
    uploader_t *u = arg;
    sp_name_thread("ckpt-upload");
    for (;;) {
        job j;
        pthread_mutex_lock(&u->mu);
        int got = next_job(u, &j);
        pthread_mutex_unlock(&u->mu);
        if (!got)
            return NULL;
        run_job(u, &j);
    }
}

/* ---- API -------------------------------------------------------------------- */

static void apply_defaults(uploader_opts *o)
{
    if (o->max_queue <= 0)
        o->max_queue = 2;
    if (o->retry_base_s <= 0)
        o->retry_base_s = 1;
    if (o->retry_max_s <= 0)
        o->retry_max_s = 60;
}

static int init_sync(uploader_t *u)
{
    pthread_condattr_t ca;
    if (pthread_condattr_init(&ca) || pthread_condattr_setclock(&ca, CLOCK_MONOTONIC))
        return -1;
    int rc = pthread_mutex_init(&u->mu, NULL) || pthread_cond_init(&u->work_cv, &ca) ||
             pthread_cond_init(&u->idle_cv, &ca);
    pthread_condattr_destroy(&ca);
    return rc ? -1 : 0;
}

int uploader_start(uploader_t **out, store_t *store, const uploader_opts *opts, sp_err *err)
{
    *out = NULL;
    uploader_t *u = calloc(1, sizeof *u);
    if (!u)
        return store_fail(store, err, STORE_EFAIL, NULL, "uploader: out of memory");
    u->store = store;
    u->o = opts ? *opts : (uploader_opts){0};
    apply_defaults(&u->o);
    u->rng = store_rng_seed();
    atomic_init(&u->cancel, 0);
    atomic_init(&u->job_cancel, 0);
    u->q = calloc((size_t)u->o.max_queue + 1, sizeof *u->q);
    if (!u->q || init_sync(u)) {
        free(u->q);
        free(u);
        return store_fail(store, err, STORE_EFAIL, NULL, "uploader: cannot initialise");
    }
    if (pthread_create(&u->thread, NULL, uploader_main, u)) {
        pthread_mutex_destroy(&u->mu);
        pthread_cond_destroy(&u->work_cv);
        pthread_cond_destroy(&u->idle_cv);
        free(u->q);
        free(u);
        return store_fail(store, err, STORE_EFAIL, NULL, "uploader: cannot start its thread");
    }
    *out = u;
    return 0;
}

static int submit(uploader_t *u, const char *local_dir, const char *prefix, double shards_wait_s,
                  sp_err *err)
{
    job j = {strdup(local_dir ? local_dir : ""), strdup(prefix ? prefix : ""), 0, 0,
             shards_wait_s};
    if (!j.dir || !j.prefix || !local_dir || !*local_dir) {
        job_free(&j);
        return store_fail(u->store, err, STORE_EUSAGE, prefix, "uploader: bad job");
    }
    int dropped = 0;
    pthread_mutex_lock(&u->mu);
    while (u->qn >= u->o.max_queue) { /* drop the oldest waiting job */
        job_free(&u->q[0]);
        memmove(u->q, u->q + 1, (size_t)(u->qn - 1) * sizeof *u->q);
        u->qn--;
        dropped++;
    }
    u->q[u->qn++] = j;
    pthread_cond_signal(&u->work_cv);
    pthread_mutex_unlock(&u->mu);
    return dropped;
}

int uploader_hurry(uploader_t *u)
{
    if (!u)
        return 0;
    pthread_mutex_lock(&u->mu);
    u->hurry = 1;
    int dropped = 0;
    while (u->qn > 1) { /* the oldest waiting ones */
        job_free(&u->q[0]);
        memmove(u->q, u->q + 1, (size_t)(u->qn - 1) * sizeof *u->q);
        u->qn--;
        dropped++;
    }
    if (u->qn > 0)
        u->q[0].not_before = 0; /* no backoff left to wait out */
    if (u->busy && u->qn > 0) {
        atomic_store(&u->job_cancel, 1);
        dropped++;
    }
    pthread_cond_broadcast(&u->work_cv);
    pthread_mutex_unlock(&u->mu);
    return dropped;
}

int uploader_submit(uploader_t *u, const char *local_dir, const char *prefix, sp_err *err)
{
    return submit(u, local_dir, prefix, 0, err);
}

int uploader_submit_sharded(uploader_t *u, const char *local_dir, const char *prefix,
                            double wait_s, sp_err *err)
{
    return submit(u, local_dir, prefix, wait_s > 0 ? wait_s : 1, err);
}

int uploader_pending(uploader_t *u)
{
    pthread_mutex_lock(&u->mu);
    int n = u->qn + u->busy;
    pthread_mutex_unlock(&u->mu);
    return n;
}

int uploader_wait(uploader_t *u, double timeout_s)
{
    double until = timeout_s < 0 ? -1 : sp_now() + timeout_s;
    pthread_mutex_lock(&u->mu);
    while (u->qn + u->busy > 0)
        if (wait_until(&u->idle_cv, &u->mu, until) == ETIMEDOUT)
            break;
    int done = u->qn + u->busy == 0;
    pthread_mutex_unlock(&u->mu);
    return done;
}

void uploader_set_retention(uploader_t *u, int keep, int keep_every)
{
    pthread_mutex_lock(&u->mu);
    u->o.keep = keep;
    u->o.keep_every = keep_every;
    pthread_mutex_unlock(&u->mu);
}

int uploader_last_error(uploader_t *u, sp_err *err)
{
    pthread_mutex_lock(&u->mu);
    int has = u->has_err;
    if (has && err && !err->code)
        *err = u->last_err;
    pthread_mutex_unlock(&u->mu);
    return has;
}

void uploader_stop(uploader_t *u)
{
    if (!u)
        return;
    pthread_mutex_lock(&u->mu);
    u->stop = 1;
    atomic_store(&u->cancel, 1);
    atomic_store(&u->job_cancel, 1);
    pthread_cond_broadcast(&u->work_cv);
    pthread_mutex_unlock(&u->mu);
    pthread_join(u->thread, NULL);
    for (int i = 0; i < u->qn; i++)
        job_free(&u->q[i]);
    pthread_mutex_destroy(&u->mu);
    pthread_cond_destroy(&u->work_cv);
    pthread_cond_destroy(&u->idle_cv);
    free(u->q);
    free(u);
}
