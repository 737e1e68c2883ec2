/* checkpoint/uploader.h — the background push of checkpoints to an object
 * store: one thread, a bounded queue of jobs "push local directory D to
 * prefix P/" (store_push_dir: MANIFEST.json last), retried with backoff while
 * the store is down, then retention (store_prune_steps, MANIFEST first).
 * Owns the thread and the queue; borrows the store, which must outlive it.
 *
 * Queue policy: jobs are pushed oldest first. When max_queue jobs are waiting
 * and another is submitted, the oldest waiting one is dropped (the newer
 * checkpoint supersedes it). A job that failed and waits for its retry counts
 * as waiting; the job being transferred is never dropped. A job fails for
 * good (and is dropped, with an event) on a local error (its directory is
 * gone or unreadable), a bad prefix, a different checkpoint already at its
 * prefix, credentials the store refuses (401/403) or a bucket that does not
 * exist; any other store error (the store down, slow or failing) is retried,
 * except that a sharded checkpoint whose ranks did not all put their shard
 * (STORE_EPEER) is dropped when a newer checkpoint is waiting.
 *
 * uploader_hurry (the job stopping) keeps only the newest: see below.
 *
 * A job may also be held before its push, for as long as may_push says
 * "not yet": it stays in the queue (oldest first, dropped like any waiting
 * job when newer ones fill it).
 *
 * Every function may be called from any thread; on_event and may_push run
 * on the uploader thread and may call the store (not the uploader). */
#ifndef SPOTUNE_UPLOADER_H
#define SPOTUNE_UPLOADER_H

#include <stdint.h>

#include "checkpoint/store.h"

typedef struct uploader uploader_t;

typedef enum uploader_event_kind {
    UPLOADER_FILE_DONE,   /* key uploaded (MANIFEST.json is the last of a job) */
    UPLOADER_JOB_DONE,    /* prefix complete remotely */
    UPLOADER_JOB_RETRY,   /* failed; err says why; retried in retry_in_s */
    UPLOADER_JOB_FAILED,  /* failed for good and dropped; err says why */
    UPLOADER_JOB_DROPPED, /* waiting to retry, superseded by newer jobs (drops at
                             submit time are reported by uploader_submit instead) */
    UPLOADER_PRUNED,      /* key deleted by retention */
    UPLOADER_PRUNE_FAILED /* retention failed (tried again after the next push) */
} uploader_event_kind;

typedef struct uploader_event {
    uploader_event_kind kind;
    const char *local_dir, *prefix; /* the job (NULL for prune events) */
    const char *key;                /* FILE_DONE, PRUNED */
    const sp_err *err;              /* JOB_RETRY, JOB_FAILED, PRUNE_FAILED */
    int rc;                         /* with err: the STORE_E* value */
    int attempt;                    /* 1 for the first try */
    double retry_in_s;              /* JOB_RETRY */
    double seconds;                 /* JOB_DONE: the successful attempt's transfer time */
    uint64_t bytes;                 /* JOB_DONE: bytes of the files pushed */
} uploader_event;

typedef struct uploader_opts {
    int max_queue;       /* waiting jobs, default 2 */
    double retry_base_s; /* job backoff ceiling: default 1 s, doubling ... */
    double retry_max_s;  /* ... up to 60 s (full jitter below it) */
    int keep;            /* retention after each push: keep the newest `keep`; 0: none */
    int keep_every;      /* ... and every step that is a multiple of this; 0: none */
    void (*on_event)(void *arg, const uploader_event *ev);
    /* Asked before each push (NULL: always yes), with arg: 1 push now; 0
     * not yet: the job waits, is asked again every UPLOADER_HOLD_S, and no
     * event is sent (the job's lease on the prefix not yet written); -1
     * never: the job fails for good with *why. */
    int (*may_push)(void *arg, sp_err *why);
    void *arg;
} uploader_opts;

#define UPLOADER_HOLD_S 0.5

int uploader_start(uploader_t **out, store_t *store, const uploader_opts *opts, sp_err *err);

/* Queues "push local_dir to prefix/". Returns how many waiting jobs were
 * dropped to make room (0 or more), or a negative STORE_E* on a bad argument.
 * local_dir must stay until the job is done. */
int uploader_submit(uploader_t *u, const char *local_dir, const char *prefix, sp_err *err);

/* uploader_submit of a sharded checkpoint whose ranks put their own shard
 * files: they are not sent, and MANIFEST.json waits for them, up to wait_s
 * each try (store_xfer_opts.shards_put_by_ranks). */
int uploader_submit_sharded(uploader_t *u, const char *local_dir, const char *prefix,
                            double wait_s, sp_err *err);

/* Submitted checkpoints not yet complete remotely (the "remote is behind by
 * N" figure): waiting jobs plus the one in progress. */
int uploader_pending(uploader_t *u);

/* Blocks until nothing is pending or timeout_s passes (< 0: no limit).
 * Returns 1 when everything submitted was pushed (or failed for good), else 0. */
int uploader_wait(uploader_t *u, double timeout_s);

/* The job is stopping (a spot notice: seconds count): from now on only
 * the newest checkpoint matters. Every waiting job but the newest is
 * dropped, the push in flight is canceled when a newer job waits (and
 * dropped, not retried), and retention waits until nothing newer does.
 * Returns how many older checkpoints will not be pushed. */
int uploader_hurry(uploader_t *u);

/* Changes retention for the pushes that follow (keep 0: none). */
void uploader_set_retention(uploader_t *u, int keep, int keep_every);

/* Copies the latest job failure (retry or for good) into *err; returns 1 if
 * there was one since the last successful push, else 0. */
int uploader_last_error(uploader_t *u, sp_err *err);

/* Cancels the transfer in flight, stops the thread and frees u. Jobs still
 * pending are abandoned (their local directories are untouched); call
 * uploader_wait first to give them time. NULL is a no-op. */
void uploader_stop(uploader_t *u);

#endif
