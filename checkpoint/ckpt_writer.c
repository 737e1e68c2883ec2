/* The background writer thread. */
#define _POSIX_C_SOURCE 200809L
#include "ckpt_writer.h"
#include "store.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

struct ckpt_writer {
    char *root;
    ckpt_written_fn done;
    void *ctx;
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    ckpt_snapshot job;
    ckpt_shard shard;     /* a shard job (shard_dir set) instead of a snapshot */
    char *shard_dir;
    int has_job, busy, stop;
    sp_err last; /* the last write's outcome */
    ckpt_shard_info last_shard;
    int shard_written; /* the shard job in progress has written its file (uploading now) */
    store_t *store;    /* where a written shard is put (NULL: nowhere) */
    double put_deadline_s; /* a shard's put is tried again for this long */
    int drop_shards;   /* remove a shard file after its upload */
    ckpt_may_put_fn may_put; /* asked before each put (NULL: always) */
    void *may_put_arg;
    /* the last shard whose put failed for good, kept in kept_dir (NULL: none) */
    char *kept_dir;
    ckpt_shard_info kept_info;
    int64_t kept_step;
};

/* path while it exists, else committed when that holds a file of the
 * shard's size (the same checkpoint, renamed). */
static const char *committed_or(const char *path, const char *committed, uint64_t size)
{
    struct stat sb;
    if (stat(path, &sb) == 0 || !committed)
        return path;
    return stat(committed, &sb) == 0 && (uint64_t)sb.st_size == size ? committed : path;
}

/* The written shard into the store, unless a complete checkpoint of its
 * step is there (never overwrite one). The ranks do not wait for uploads;
 * rank 0's push of MANIFEST.json waits for every shard, up to
 * checkpoint.upload_deadline_s. So a failure (the store's own retries used
 * up, or the check before the put) is tried again, after a pause that
 * doubles up to 4 s, until put_deadline_s after the first try: a passing
 * fault must not leave the checkpoint incomplete in the store while rank 0
 * waits for it. A gate's "not yet" counts as such a failure, its "never"
 * ends the tries. The last failure is printed. Returns 0 when the shard is
 * in the store (or need not be). dir is the checkpoint's .tmp- directory:
 * where the ranks share it, rank 0 commits the checkpoint (renames it to
 * step-N) once every shard is written, without waiting for the puts, so a
 * put that has not opened its file by then (a loaded machine) reads it
 * from the committed directory. */
static int upload_shard(ckpt_writer *w, const char *dir, int64_t step_no,
                        const ckpt_shard_info *info, double deadline_s, sp_err *out)
{
    char step[64];
    ckpt_dir_name(step, sizeof step, step_no);
    char *key = sp_strf("%s/%s", step, info->name), *mkey = sp_strf("%s/%s", step, CKPT_MANIFEST);
    char *path = sp_strf("%s/%s", dir, info->name);
    const char *slash = strrchr(dir, '/');
    char *committed = slash ? sp_strf("%.*s/%s/%s", (int)(slash - dir), dir, step, info->name)
                            : sp_strf("%s/%s", step, info->name);
    sp_err e = {0};
    double until = sp_now() + deadline_s, pause = 0.25;
    int tries = 0;
    for (;;) {
        memset(&e, 0, sizeof e);
        int there = 0, go = 1;
        tries++;
        if (!key || !mkey || !path)
            sp_fail(&e, SP_EXIT_OTHER, "out of memory");
        else if ((go = w->may_put ? w->may_put(w->may_put_arg, &e) : 1) > 0 &&
                 store_exists(w->store, mkey, &there, NULL, &e) == 0 && !there)
            store_put_file(w->store, key, committed_or(path, committed, info->size), 0, &e);
        if (go <= 0 && !e.code) /* a gate that gives no reason */
            sp_fail(&e, SP_EXIT_OTHER, go ? "the put is not allowed" : "the put is held");
        if (!e.code || go < 0 || !key || !mkey || !path || sp_now() + pause > until)
            break;
        struct timespec ts = {(time_t)pause, (long)((pause - (double)(time_t)pause) * 1e9)};
        nanosleep(&ts, NULL);
        pause = pause * 2 < 4 ? pause * 2 : 4;
    }
    if (e.code)
        fprintf(stderr,
                "warning: checkpoint shard %s was not put in %s (%d tries in %g s): %s; that "
                "checkpoint will not be complete there (the remote store is behind)%s%s\n",
                key ? key : info->name, store_url(w->store), tries, deadline_s, e.msg,
                w->drop_shards && path ? "; the shard stays at " : "",
                w->drop_shards && path ? path : "");
    if (e.code && out)
        sp_fail(out, e.code, "checkpoint shard %s was not put in %s (%d tries in %g s): %s",
                key ? key : info->name, store_url(w->store), tries, deadline_s, e.msg);
    free(key);
    free(mkey);
    free(path);
    free(committed);
    return e.code ? -1 : 0;
}

/* The shard file name in dir removed, and dir with it once empty (the last
 * of this machine's ranks to finish removes it). */
static void drop_shard(const char *dir, const char *name)
{
    char *path = sp_strf("%s/%s", dir, name);
    if (path)
        unlink(path);
    free(path);
    rmdir(dir);
}

/* A shard job: the rank's shard file written into dir. */
static void write_shard(ckpt_writer *w, char *dir, ckpt_shard *sh)
{
    sp_err err = {0};
    ckpt_shard_info info;
    ckpt_shard_write(dir, sh, &info, &err);
    pthread_mutex_lock(&w->mu);
    w->last = err;
    w->last_shard = info;
    w->shard_written = 1;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
    int kept = 0; /* a written shard the store does not hold: never deleted */
    if (!err.code && w->store)
        kept = upload_shard(w, dir, sh->step, &info, w->put_deadline_s, NULL) != 0;
    if (w->drop_shards && !kept)
        drop_shard(dir, info.name);
    int64_t step = sh->step;
    ckpt_shard_free(sh);
    pthread_mutex_lock(&w->mu);
    /* an older kept shard is superseded once a newer one is written (put or
     * kept): only the last is ever tried again, so on a machine that keeps
     * nothing (drop) it goes, and a long store outage holds one shard of
     * this rank on disk, not one per checkpoint */
    char *stale = NULL;
    ckpt_shard_info stale_info = w->kept_info;
    if (w->kept_dir && !err.code) {
        if (w->drop_shards)
            stale = w->kept_dir;
        else
            free(w->kept_dir);
        w->kept_dir = NULL;
    }
    if (stale) { /* before the job counts as done */
        pthread_mutex_unlock(&w->mu);
        drop_shard(stale, stale_info.name);
        free(stale);
        pthread_mutex_lock(&w->mu);
    }
    if (kept) { /* ckpt_writer_put_kept may try it again */
        w->kept_dir = dir, w->kept_info = info, w->kept_step = step;
    } else {
        free(dir);
    }
    w->busy = 0;
    pthread_cond_broadcast(&w->cv);
}

static void *writer_main(void *arg)
{
    ckpt_writer *w = arg;
    sp_name_thread("ckpt-writer");
    pthread_mutex_lock(&w->mu);
    for (;;) {
        while (!w->has_job && !w->stop)
            pthread_cond_wait(&w->cv, &w->mu);
        if (!w->has_job && w->stop)
            break;
        ckpt_snapshot s = w->job;
        ckpt_shard sh = w->shard;
        char *shard_dir = w->shard_dir;
        memset(&w->job, 0, sizeof w->job);
        memset(&w->shard, 0, sizeof w->shard);
        w->shard_dir = NULL;
        w->has_job = 0;
        w->busy = 1;
        w->shard_written = 0;
        pthread_mutex_unlock(&w->mu);
        if (shard_dir) {
            write_shard(w, shard_dir, &sh);
            continue;
        }

        sp_err err = {0};
        char *dir = NULL;
        double t0 = sp_now();
        ckpt_write(w->root, &s, &dir, &err);
        double dt = sp_now() - t0;
        if (w->done)
            w->done(w->ctx, dir, &s, dt, &err);
        free(dir);
        ckpt_snapshot_free(&s);

        pthread_mutex_lock(&w->mu);
        w->last = err;
        w->busy = 0;
        pthread_cond_broadcast(&w->cv);
    }
    pthread_mutex_unlock(&w->mu);
    return NULL;
}

int ckpt_writer_start(ckpt_writer **out, const char *root, ckpt_written_fn done, void *ctx,
                      sp_err *err)
{
    ckpt_writer *w = calloc(1, sizeof *w);
    if (!w)
        return sp_fail(err, SP_EXIT_OTHER, "out of memory");
    w->root = strdup(root);
    if (!w->root) {
        free(w);
        return sp_fail(err, SP_EXIT_OTHER, "out of memory");
    }
    w->done = done;
    w->ctx = ctx;
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->cv, NULL);
    if (pthread_create(&w->thread, NULL, writer_main, w) != 0) {
        free(w->root);
        free(w);
        return sp_fail(err, SP_EXIT_OTHER, "cannot start the checkpoint writer thread");
    }
    *out = w;
    return 0;
}

static void wait_idle(ckpt_writer *w)
{
    while (w->has_job || w->busy)
        pthread_cond_wait(&w->cv, &w->mu);
}

int ckpt_writer_submit(ckpt_writer *w, ckpt_snapshot *s, double *waited_s, sp_err *err)
{
    double t0 = sp_now();
    pthread_mutex_lock(&w->mu);
    wait_idle(w);
    if (waited_s)
        *waited_s = sp_now() - t0;
    w->job = *s;
    memset(s, 0, sizeof *s);
    w->has_job = 1;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
    (void)err;
    return 0;
}

int ckpt_writer_submit_shard(ckpt_writer *w, const char *dir, ckpt_shard *sh, double *waited_s,
                             sp_err *err)
{
    char *d = strdup(dir);
    if (!d)
        return sp_fail(err, SP_EXIT_OTHER, "out of memory");
    double t0 = sp_now();
    pthread_mutex_lock(&w->mu);
    wait_idle(w);
    if (waited_s)
        *waited_s = sp_now() - t0;
    w->shard = *sh;
    memset(sh, 0, sizeof *sh);
    w->shard_dir = d;
    w->has_job = 1;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
    return 0;
}

void ckpt_writer_set_store(ckpt_writer *w, store_t *st, double put_deadline_s)
{
    pthread_mutex_lock(&w->mu);
    wait_idle(w);
    w->store = st;
    w->put_deadline_s = put_deadline_s;
    pthread_mutex_unlock(&w->mu);
}

void ckpt_writer_set_gate(ckpt_writer *w, ckpt_may_put_fn may_put, void *arg)
{
    pthread_mutex_lock(&w->mu);
    wait_idle(w);
    w->may_put = may_put;
    w->may_put_arg = arg;
    pthread_mutex_unlock(&w->mu);
}

int ckpt_writer_put_kept(ckpt_writer *w, int64_t step, double deadline_s, sp_err *err)
{
    pthread_mutex_lock(&w->mu);
    wait_idle(w);
    char *dir = w->kept_step == step ? w->kept_dir : NULL;
    ckpt_shard_info info = w->kept_info;
    if (dir)
        w->kept_dir = NULL;
    pthread_mutex_unlock(&w->mu);
    if (!dir || !w->store) {
        free(dir);
        return 0;
    }
    fprintf(stderr,
            "checkpoint shard %s of step %lld: its put is tried again for up to %g s (the run's "
            "last checkpoint waits for it)\n",
            info.name, (long long)step, deadline_s);
    int rc = upload_shard(w, dir, step, &info, deadline_s, err);
    if (!rc && w->drop_shards)
        drop_shard(dir, info.name);
    pthread_mutex_lock(&w->mu);
    if (rc && !w->kept_dir) /* still kept: a later call may try again */
        w->kept_dir = dir, dir = NULL;
    pthread_mutex_unlock(&w->mu);
    free(dir);
    return rc;
}

void ckpt_writer_drop_shards(ckpt_writer *w, int drop)
{
    pthread_mutex_lock(&w->mu);
    w->drop_shards = drop;
    pthread_mutex_unlock(&w->mu);
}

int ckpt_writer_wait_written(ckpt_writer *w)
{
    pthread_mutex_lock(&w->mu);
    while (w->has_job || (w->busy && !w->shard_written))
        pthread_cond_wait(&w->cv, &w->mu);
    pthread_mutex_unlock(&w->mu);
    return 0;
}

int ckpt_writer_shard_result(ckpt_writer *w, int *busy, ckpt_shard_info *info, sp_err *err)
{
    pthread_mutex_lock(&w->mu);
    *busy = w->has_job || (w->busy && !w->shard_written);
    sp_err last = w->last;
    *info = w->last_shard;
    pthread_mutex_unlock(&w->mu);
    if (!*busy && last.code)
        return sp_fail(err, last.code, "%s", last.msg);
    return 0;
}

int ckpt_writer_wait(ckpt_writer *w, sp_err *err)
{
    pthread_mutex_lock(&w->mu);
    wait_idle(w);
    sp_err last = w->last;
    pthread_mutex_unlock(&w->mu);
    if (last.code)
        return sp_fail(err, last.code, "%s", last.msg);
    return 0;
}

void ckpt_writer_stop(ckpt_writer *w)
{
    if (!w)
        return;
    pthread_mutex_lock(&w->mu);
    wait_idle(w);
    w->stop = 1;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
    pthread_join(w->thread, NULL);
    pthread_mutex_destroy(&w->mu);
    pthread_cond_destroy(&w->cv);
    if (w->store)
        store_close(w->store);
    free(w->root);
    free(w->kept_dir);
    free(w);
}
