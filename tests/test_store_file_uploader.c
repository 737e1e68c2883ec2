/* tests/test_store_file_uploader.c — the checkpoint uploader on a file://
 * store (in-process, no server): retry while the store is unreachable,
 * jobs held until they may be pushed, the bounded queue, the newest first
 * when the job stops, prompt stop, its thread's name; and the lease check
 * the other ranks ask before their shard puts. The suite keeps the name
 * store_file (test_store_file.c has the store API's cases). */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "checkpoint/lease.h"
#include "checkpoint/store.h"
#include "checkpoint/uploader.h"
#include "test_store_util.h"

#define MIB ((size_t)1 << 20)

TestSuite(store_file, .timeout = 120);

/* ---- uploader ----------------------------------------------------------------- */

/* n checkpoint directories in local: step-00000100, -200, ... (seeds 0,
 * 1, ...; state.h5 of big bytes) */
static void make_steps(const char *local, char **c, int n, size_t big)
{
    for (int i = 0; i < n; i++) {
        char name[32];
        snprintf(name, sizeof name, "step-%08d", (i + 1) * 100);
        c[i] = tu_make_ckpt(local, name, (uint64_t)i, big);
    }
}

typedef struct ev_log {
    pthread_mutex_t mu;
    int done, retry, failed, dropped, files;
    char last_prefix[64];
    char last_err[256];
    int gate, asked; /* may_push's answer, and how often it was asked */
} ev_log;

static int gate_fn(void *arg, sp_err *why)
{
    ev_log *l = arg;
    pthread_mutex_lock(&l->mu);
    int answer = l->gate;
    l->asked++;
    pthread_mutex_unlock(&l->mu);
    if (answer < 0)
        sp_fail(why, SP_EXIT_USAGE, "another job holds this prefix now");
    return answer;
}

static void on_event(void *arg, const uploader_event *ev)
{
    ev_log *l = arg;
    pthread_mutex_lock(&l->mu);
    switch (ev->kind) {
    case UPLOADER_JOB_DONE:
        l->done++;
        snprintf(l->last_prefix, sizeof l->last_prefix, "%s", ev->prefix);
        break;
    case UPLOADER_JOB_RETRY: l->retry++; break;
    case UPLOADER_JOB_FAILED:
        l->failed++;
        snprintf(l->last_err, sizeof l->last_err, "%.200s", ev->err ? ev->err->msg : "");
        break;
    case UPLOADER_JOB_DROPPED: l->dropped++; break;
    case UPLOADER_FILE_DONE: l->files++; break;
    default: break;
    }
    pthread_mutex_unlock(&l->mu);
}

static int ev_get(ev_log *l, const int *field)
{
    pthread_mutex_lock(&l->mu);
    int v = *field;
    pthread_mutex_unlock(&l->mu);
    return v;
}

/* "Takes the store down": the store root's parent becomes a regular file. */
static void block_store(const tu_file_fx *f, const char *moved)
{
    cr_assert_eq(rename(f->root, moved), 0);
    tu_write_bytes(f->root, "blocker", 7);
}

static void unblock_store(const tu_file_fx *f, const char *moved)
{
    cr_assert_eq(unlink(f->root), 0);
    cr_assert_eq(rename(moved, f->root), 0);
}

Test(store_file, uploader_pushes_backlog_after_outage)
{
    tu_file_fx f = tu_file_store("upl");
    sp_err err = {0};
    cr_assert_eq(store_create_bucket(f.s, &err), 0);
    char *local = tu_path_in(f.dir, "local"), *moved = tu_path_in(f.dir, "moved");
    mkdir(local, 0777);
    char *c1 = tu_make_ckpt(local, "step-00000100", 1, 2 * MIB);
    char *c2 = tu_make_ckpt(local, "step-00000200", 2, 2 * MIB);
    block_store(&f, moved);

    ev_log ev = {.mu = PTHREAD_MUTEX_INITIALIZER};
    uploader_opts o = {.max_queue = 4, .retry_base_s = 0.05, .retry_max_s = 0.2,
                       .on_event = on_event, .arg = &ev};
    uploader_t *u;
    cr_assert_eq(uploader_start(&u, f.s, &o, &err), 0, "%s", err.msg);
    cr_assert_eq(uploader_submit(u, c1, "step-00000100", &err), 0);
    cr_assert_eq(uploader_submit(u, c2, "step-00000200", &err), 0);
    cr_assert_eq(uploader_wait(u, 0.6), 0, "store down: not everything pushed");
    cr_assert_eq(uploader_pending(u), 2, "remote is behind by 2");
    cr_assert_gt(ev_get(&ev, &ev.retry), 1, "the job was retried");
    sp_err last = {0};
    cr_assert_eq(uploader_last_error(u, &last), 1);
    cr_assert(strstr(last.msg, "file://"), "%s", last.msg);

    unblock_store(&f, moved);
    cr_assert_eq(uploader_wait(u, 20), 1, "backlog pushed after the store came back");
    cr_assert_eq(uploader_pending(u), 0);
    cr_assert_eq(ev_get(&ev, &ev.done), 2);
    cr_assert_str_eq(ev.last_prefix, "step-00000200", "oldest first");
    cr_assert_eq(uploader_last_error(u, NULL), 0);
    uploader_stop(u);

    char *b1 = tu_path_in(f.dir, "b1"), *b2 = tu_path_in(f.dir, "b2");
    cr_assert_eq(store_pull_dir(f.s, "step-00000100", b1, NULL, &err), 0, "%s", err.msg);
    cr_assert_eq(store_pull_dir(f.s, "step-00000200", b2, NULL, &err), 0, "%s", err.msg);
    tu_assert_same_tree(c1, b1);
    tu_assert_same_tree(c2, b2);
    free(b1);
    free(b2);
    free(c1);
    free(c2);
    free(local);
    free(moved);
    tu_file_store_close(&f);
}

/* may_push "not yet" (the lease not yet written): the jobs stay queued,
 * nothing reaches the store and no event is sent, while it is asked again;
 * "yes": they go, oldest first; "never" (the lease lost): the next job fails
 * for good with the gate's reason, and nothing of it reaches the store. */
Test(store_file, uploader_holds_jobs_until_it_may_push)
{
    tu_file_fx f = tu_file_store("gate");
    sp_err err = {0};
    cr_assert_eq(store_create_bucket(f.s, &err), 0);
    char *local = tu_path_in(f.dir, "local");
    mkdir(local, 0777);
    char *c1 = tu_make_ckpt(local, "step-00000100", 1, 4096);
    char *c2 = tu_make_ckpt(local, "step-00000200", 2, 4096);
    char *c3 = tu_make_ckpt(local, "step-00000300", 3, 4096);
    ev_log ev = {.mu = PTHREAD_MUTEX_INITIALIZER, .gate = 0};
    uploader_opts o = {.max_queue = 4, .on_event = on_event, .may_push = gate_fn, .arg = &ev};
    uploader_t *u;
    cr_assert_eq(uploader_start(&u, f.s, &o, &err), 0, "%s", err.msg);
    cr_assert_eq(uploader_submit(u, c1, "step-00000100", &err), 0);
    cr_assert_eq(uploader_submit(u, c2, "step-00000200", &err), 0);
    cr_assert_eq(uploader_wait(u, 1.6), 0, "held: not pushed");
    cr_expect_eq(uploader_pending(u), 2);
    cr_expect_geq(ev_get(&ev, &ev.asked), 3, "asked again every %.1f s", UPLOADER_HOLD_S);
    cr_expect_eq(ev_get(&ev, &ev.files) + ev_get(&ev, &ev.retry) + ev_get(&ev, &ev.failed) +
                     ev_get(&ev, &ev.dropped),
                 0, "no event while held");
    store_listing l = {0};
    cr_assert_eq(store_list(f.s, "", &l, &err), 0, "%s", err.msg);
    cr_expect_eq(l.n, 0, "%zu objects in the store while held", l.n);
    store_list_free(&l);
    pthread_mutex_lock(&ev.mu);
    ev.gate = 1;
    pthread_mutex_unlock(&ev.mu);
    cr_assert_eq(uploader_wait(u, 20), 1);
    cr_expect_eq(ev_get(&ev, &ev.done), 2);
    cr_expect_str_eq(ev.last_prefix, "step-00000200", "oldest first");
    pthread_mutex_lock(&ev.mu);
    ev.gate = -1;
    pthread_mutex_unlock(&ev.mu);
    cr_assert_eq(uploader_submit(u, c3, "step-00000300", &err), 0);
    cr_assert_eq(uploader_wait(u, 20), 1, "a job refused for good is not pending");
    cr_expect_eq(ev_get(&ev, &ev.failed), 1);
    cr_expect(strstr(ev.last_err, "another job holds this prefix now"), "%s", ev.last_err);
    int exists = 1;
    cr_assert_eq(store_exists(f.s, "step-00000300/MANIFEST.json", &exists, NULL, &err), 0);
    cr_expect_not(exists, "refused, yet pushed");
    uploader_stop(u);
    free(c1), free(c2), free(c3), free(local);
    tu_file_store_close(&f);
}

/* lease_check, the other ranks' question before each shard put: 1 only
 * while the store's lease is this job's (lease_job, as rank 0 gives it
 * out); before it is written, after it is released, another job's, or a
 * lease that cannot be read: 0, saying which. */
Test(store_file, lease_check_knows_the_jobs_own_lease_only)
{
    tu_file_fx f = tu_file_store("lease");
    sp_err err = {0};
    cr_assert_eq(store_create_bucket(f.s, &err), 0);
    const char *other = "0123456789abcdef";
    cr_expect_eq(lease_check(f.s, other, &err), 0, "no lease yet");
    cr_expect(strstr(err.msg, "LEASE.json: this job's lease is not written yet"), "%s", err.msg);
    store_t *ls;
    cr_assert_eq(store_open(&ls, f.url, NULL, &err), 0, "%s", err.msg);
    lease_opts lo = {.ttl_s = 30, .wait_s = 1, .run_dir = f.dir};
    lease_t *l;
    int connected = 0;
    char note[256];
    cr_assert_eq(lease_acquire(&l, ls, &lo, &connected, note, sizeof note, &err), 0, "%s",
                 err.msg);
    cr_expect(connected && lease_held(l));
    char job[17];
    snprintf(job, sizeof job, "%s", lease_job(l));
    cr_expect_eq(strlen(job), 16, "job id %s", job);
    memset(&err, 0, sizeof err);
    cr_expect_eq(lease_check(f.s, job, &err), 1, "%s", err.msg);
    cr_expect_eq(lease_check(f.s, other, &err), 0, "another job's id passed");
    cr_expect(strstr(err.msg, "is not this job's but that of pid") && strstr(err.msg, job),
              "%s", err.msg);
    lease_release(l);
    memset(&err, 0, sizeof err);
    cr_expect_eq(lease_check(f.s, job, &err), 0, "the released lease still counts");
    cr_expect(strstr(err.msg, "not written yet"), "%s", err.msg);
    /* a lease the store cannot give back: a directory where the object goes */
    char *bad = tu_path_in(f.root, "LEASE.json");
    cr_assert_eq(mkdir(bad, 0755), 0);
    memset(&err, 0, sizeof err);
    cr_expect_eq(lease_check(f.s, job, &err), 0, "an unreadable lease passed");
    cr_expect(strstr(err.msg, "LEASE.json cannot be read: "), "%s", err.msg);
    free(bad);
    tu_file_store_close(&f);
}

Test(store_file, uploader_bounded_queue_drops_oldest_waiting)
{
    tu_file_fx f = tu_file_store("drop");
    sp_err err = {0};
    cr_assert_eq(store_create_bucket(f.s, &err), 0);
    char *local = tu_path_in(f.dir, "local"), *moved = tu_path_in(f.dir, "moved");
    mkdir(local, 0777);
    char *c[4];
    make_steps(local, c, 4, 1000);
    block_store(&f, moved);
    ev_log ev = {.mu = PTHREAD_MUTEX_INITIALIZER};
    uploader_opts o = {.max_queue = 2, .retry_base_s = 0.05, .retry_max_s = 0.1, .keep = 2,
                       .on_event = on_event, .arg = &ev};
    uploader_t *u;
    cr_assert_eq(uploader_start(&u, f.s, &o, &err), 0);
    int dropped = 0;
    for (int i = 0; i < 4; i++) {
        dropped += uploader_submit(u, c[i], strrchr(c[i], '/') + 1, &err);
        usleep(100 * 1000); /* let the thread try (and fail) */
    }
    cr_assert_eq(dropped + ev_get(&ev, &ev.dropped), 2, "two of four superseded");
    cr_assert_eq(uploader_pending(u), 2);
    unblock_store(&f, moved);
    cr_assert_eq(uploader_wait(u, 20), 1);
    uploader_stop(u);
    int exists = 0;
    cr_assert_eq(store_exists(f.s, "step-00000400/MANIFEST.json", &exists, NULL, &err), 0);
    cr_assert(exists, "the newest checkpoint was pushed");
    cr_assert_eq(store_exists(f.s, "step-00000300/MANIFEST.json", &exists, NULL, &err), 0);
    cr_assert(exists);
    cr_assert_eq(store_exists(f.s, "step-00000100/MANIFEST.json", &exists, NULL, &err), 0);
    cr_assert_not(exists, "dropped");
    for (int i = 0; i < 4; i++)
        free(c[i]);
    free(local);
    free(moved);
    tu_file_store_close(&f);
}

/* on_event that holds the uploader's thread at the first file of a job
 * until the test lets it go (a push in flight for as long as it takes) */
typedef struct held_push {
    ev_log ev;
    int holding, release;
} held_push;

static void hold_first_file(void *arg, const uploader_event *e)
{
    held_push *h = arg;
    on_event(&h->ev, e);
    pthread_mutex_lock(&h->ev.mu);
    int hold = e->kind == UPLOADER_FILE_DONE && !h->release;
    h->holding = hold;
    pthread_mutex_unlock(&h->ev.mu);
    while (hold) {
        usleep(10 * 1000);
        pthread_mutex_lock(&h->ev.mu);
        hold = !h->release;
        pthread_mutex_unlock(&h->ev.mu);
    }
}

/* The job stops (a spot notice): uploader_hurry. The push in flight of an
 * older checkpoint is canceled and dropped, not retried; of the waiting
 * ones only the newest stays; the newest is pushed, and nothing older after
 * it. */
Test(store_file, uploader_hurry_pushes_the_newest_first)
{
    tu_file_fx f = tu_file_store("hurry");
    sp_err err = {0};
    cr_assert_eq(store_create_bucket(f.s, &err), 0);
    char *local = tu_path_in(f.dir, "local");
    mkdir(local, 0777);
    char *c[3];
    make_steps(local, c, 3, 4096);
    held_push h = {.ev = {.mu = PTHREAD_MUTEX_INITIALIZER}};
    uploader_opts o = {.max_queue = 4, .retry_base_s = 0.05, .retry_max_s = 0.1,
                       .on_event = hold_first_file, .arg = &h};
    uploader_t *u;
    cr_assert_eq(uploader_start(&u, f.s, &o, &err), 0, "%s", err.msg);
    cr_assert_eq(uploader_submit(u, c[0], "step-00000100", &err), 0);
    for (int i = 0; i < 500 && !ev_get(&h.ev, &h.holding); i++)
        usleep(10 * 1000);
    cr_assert(ev_get(&h.ev, &h.holding), "the first push never reached its first file");
    cr_assert_eq(uploader_submit(u, c[1], "step-00000200", &err), 0);
    cr_assert_eq(uploader_submit(u, c[2], "step-00000300", &err), 0);
    cr_expect_eq(uploader_hurry(u), 2, "step 200 waiting and step 100 in flight passed over");
    pthread_mutex_lock(&h.ev.mu);
    h.release = 1;
    pthread_mutex_unlock(&h.ev.mu);
    cr_assert_eq(uploader_wait(u, 20), 1);
    cr_expect_eq(ev_get(&h.ev, &h.ev.done), 1, "one push completed");
    cr_expect_str_eq(h.ev.last_prefix, "step-00000300", "the newest");
    cr_expect_eq(ev_get(&h.ev, &h.ev.dropped), 1, "the push in flight dropped");
    cr_expect_eq(ev_get(&h.ev, &h.ev.retry), 0, "a hurried push is not retried");
    int exists = 1;
    static const char *const gone[] = {"step-00000100/MANIFEST.json",
                                       "step-00000200/MANIFEST.json"};
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(store_exists(f.s, gone[i], &exists, NULL, &err), 0, "%s", err.msg);
        cr_expect_not(exists, "%s pushed after the hurry", gone[i]);
    }
    cr_assert_eq(store_exists(f.s, "step-00000300/MANIFEST.json", &exists, NULL, &err), 0);
    cr_expect(exists, "the newest checkpoint was not pushed");
    uploader_stop(u);
    for (int i = 0; i < 3; i++)
        free(c[i]);
    free(local);
    tu_file_store_close(&f);
}

/* The uploader's thread is named ckpt-upload while it runs (top -H, gdb)
 * and is gone once uploader_stop returns. */
Test(store_file, uploader_thread_is_named_and_gone_after_stop)
{
    tu_file_fx f = tu_file_store("named");
    sp_err err = {0};
    cr_assert_eq(store_create_bucket(f.s, &err), 0);
    cr_assert_eq(tu_threads_named("ckpt-upload"), 0);
    uploader_opts o = {.retry_base_s = 0.05, .retry_max_s = 0.1};
    uploader_t *u;
    cr_assert_eq(uploader_start(&u, f.s, &o, &err), 0, "%s", err.msg);
    int seen = 0;
    for (int i = 0; i < 200 && !seen; i++) {
        seen = tu_threads_named("ckpt-upload");
        if (!seen)
            usleep(10 * 1000); /* the thread names itself first thing */
    }
    cr_expect_eq(seen, 1, "no thread named ckpt-upload within 2 s of uploader_start");
    uploader_stop(u);
    cr_expect_eq(tu_threads_named("ckpt-upload"), 0, "the uploader's thread outlived its stop");
    tu_file_store_close(&f);
}

Test(store_file, uploader_drops_job_whose_directory_vanished_and_stops_promptly)
{
    tu_file_fx f = tu_file_store("gone");
    sp_err err = {0};
    ev_log ev = {.mu = PTHREAD_MUTEX_INITIALIZER};
    uploader_opts o = {.retry_base_s = 5, .retry_max_s = 5, .on_event = on_event, .arg = &ev};
    uploader_t *u;
    cr_assert_eq(uploader_start(&u, f.s, &o, &err), 0);
    char *gone = tu_path_in(f.dir, "no-such-dir");
    cr_assert_eq(uploader_submit(u, gone, "step-00000001", &err), 0);
    cr_assert_eq(uploader_wait(u, 10), 1);
    cr_assert_eq(ev_get(&ev, &ev.failed), 1, "failed for good, not retried");
    cr_assert_eq(ev_get(&ev, &ev.retry), 0);

    /* a job waiting for its 5 s retry does not delay stop */
    char *moved = tu_path_in(f.dir, "moved");
    cr_assert_eq(store_create_bucket(f.s, &err), 0);
    char *local = tu_path_in(f.dir, "local");
    mkdir(local, 0777);
    char *ck = tu_make_ckpt(local, "step-00000002", 3, 1000);
    block_store(&f, moved);
    cr_assert_eq(uploader_submit(u, ck, "step-00000002", &err), 0);
    usleep(200 * 1000);
    double t0 = sp_now();
    uploader_stop(u);
    /* far below the 5 s the retry would wait, with room for a loaded machine */
    cr_assert_lt(sp_now() - t0, 3.0, "stop took %.2f s", sp_now() - t0);
    unblock_store(&f, moved);
    free(ck);
    free(local);
    free(moved);
    free(gone);
    tu_file_store_close(&f);
}
