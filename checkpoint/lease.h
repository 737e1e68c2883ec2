/* checkpoint/lease.h — one job per run directory and per remote prefix.
 *
 * The run directory: run_lock_take holds an exclusive lock on RUN_DIR/.lock
 * (an open-file-description lock, released by the kernel when the process
 * ends, however it ends) for the life of the job, and writes who holds it
 * (host, pid, job id, start time) into the file, so that a second job is told
 * whom it waits for, and a job that finds the file but no holder says whose
 * run it takes over.
 *
 * The remote prefix: a lease object, LEASE.json, beside the checkpoints:
 * {host, pid, job, run_dir, started, renewed, ttl_s}. A job acquires it
 * (reading it first: a live lease of another job makes it wait up to its time
 * to live, then refuse, unless told to take over), renews it every ttl/3 from
 * a thread of its own, and deletes it at the end. A lease not renewed for its
 * time to live (by the clock of the machine that reads it) is expired; one of
 * a process on this host that no longer exists is stale: both are taken over
 * with a note. Each write replaces only the lease as it was read
 * (store_put_bytes_if: If-None-Match or If-Match on S3): a job that finds it
 * written by another job in between reads and judges it again, so jobs that
 * race for the prefix end with one holder, and a renewal never writes over a
 * takeover. Writing it at start is also the probe of the store: a store
 * that refuses the credentials (401/403) or has no such bucket fails the
 * acquisition at once (STORE_EAUTH, STORE_ENOBUCKET); one that does not answer
 * is retried by the renewal thread while the job goes on.
 *
 * Threads: the renewal thread only touches the store (safe with the uploader,
 * see store.h) and the lease's own state; lease_* may be called from any
 * thread. */
#ifndef SPOTUNE_LEASE_H
#define SPOTUNE_LEASE_H

#include "checkpoint/store.h"

#define LEASE_KEY "LEASE.json"

typedef struct run_lock run_lock;

/* Takes RUN_DIR/.lock (RUN_DIR must exist), waiting up to wait_s while a live
 * job holds it. note (n bytes) receives a line about a previous holder that
 * has ended ("" if none). Errors: SP_EXIT_USAGE when another job still holds
 * it after wait_s (naming it), SP_EXIT_OTHER when the file cannot be used. */
int run_lock_take(run_lock **out, const char *run_dir, double wait_s, char *note, size_t n,
                  sp_err *err);
void run_lock_release(run_lock *l);

typedef struct lease lease_t;

typedef struct lease_opts {
    double ttl_s;       /* a lease not renewed for this long is expired (> 0) */
    double wait_s;      /* how long to wait for another job's live lease to expire */
    int take_over;      /* take a live lease of another job without waiting */
    const char *run_dir; /* recorded in the lease, for the messages of other jobs */
} lease_opts;

/* Acquires the lease of the store's prefix and starts renewing it. Takes
 * st, which only the lease uses from then on (it is closed with the lease,
 * or at once on failure): open it with short retries (store_opts), since
 * the acquisition decides whether the job starts. On
 * success *connected says whether it could be written now (0: the store did
 * not answer; the thread keeps trying) and note receives a line about a lease
 * taken over ("" if none). Errors: SP_EXIT_USAGE for another job's live lease
 * (naming its host, pid, run directory and age) and for a store that refuses
 * the credentials or has no such bucket (the store's own message). */
int lease_acquire(lease_t **out, store_t *st, const lease_opts *o, int *connected, char *note,
                  size_t n, sp_err *err);
/* 1 when another job has taken the prefix over (err then says which); the
 * job must push nothing more. */
int lease_lost(lease_t *l, sp_err *err);
/* 1 once this job's lease has been written to the store and while it is
 * not lost: until then (the store did not answer at start) the job must
 * not push, since the prefix may be another live job's. */
int lease_held(lease_t *l);
/* Stops renewing and deletes the lease if it is still this job's, waiting
 * for that at most a few seconds (a hung store is left to the thread, which
 * ends with the process). NULL is a no-op. */
void lease_release(lease_t *l);

/* This job's id as its lease records it (16 hex digits): rank 0 hands it to
 * the other ranks, which put into the prefix without holding the lease. */
const char *lease_job(const lease_t *l);
/* Those ranks' check before a put: 1 when the lease in st's prefix is job's;
 * 0 when it is not, or cannot be read now (why says which: no lease yet,
 * another job's, or the store's error), and nothing may be put. */
int lease_check(store_t *st, const char *job, sp_err *why);

#endif
