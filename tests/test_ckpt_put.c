/* A rank's shard puts into the remote store (ckpt_writer with a store):
 * tried again until the deadline, kept on disk when they fail for good and
 * tried again at the run's end, one kept shard at most, held by the gate
 * (the job's lease) until the prefix is this job's, and read from the
 * committed checkpoint when rank 0 renamed it first. */
#define _POSIX_C_SOURCE 200809L
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "checkpoint/ckpt.h"
#include "checkpoint/ckpt_writer.h"
#include "checkpoint/store.h"
#include "test_util.h"

static char *dir;

static void setup(void)
{
    dir = tu_tempdir("ckpt-put");
}

static void teardown(void)
{
    tu_rmtree(dir);
    free(dir);
}

TestSuite(ckpt_put, .init = setup, .fini = teardown);

/* Rank 0's only shard of step: 64 elements of each group, values of the step. */
static ckpt_shard one_shard(int64_t step)
{
    ckpt_shard sh = {.step = step, .rank = 0, .count = 1, .lo = 0, .hi = 64};
    for (int g = 0; g < CKPT_SHARD_GROUPS; g++) {
        sh.data[g] = malloc(sizeof(float) * 64);
        cr_assert(sh.data[g]);
        for (int e = 0; e < 64; e++)
            sh.data[g][e] = (float)(step * 1000 + g * 100 + e);
    }
    return sh;
}

/* A writer putting its shards into the file:// store at store_dir (which
 * exists) for deadline_s a put, behind may_put (NULL: none), dropping its
 * shards once put. */
static ckpt_writer *put_writer(const char *store_dir, double deadline_s, ckpt_may_put_fn may_put,
                               void *arg)
{
    store_t *st;
    sp_err err = {0};
    cr_assert_eq(store_open(&st, tu_fmt("file://%s", store_dir), NULL, &err), 0, "%s", err.msg);
    ckpt_writer *w;
    cr_assert_eq(ckpt_writer_start(&w, dir, NULL, NULL, &err), 0, "%s", err.msg);
    ckpt_writer_set_store(w, st, deadline_s);
    if (may_put)
        ckpt_writer_set_gate(w, may_put, arg);
    ckpt_writer_drop_shards(w, 1);
    return w;
}

/* A rank's shard put that fails at first (the store's step path is a file
 * for the first 1.5 s: the check and the put both fail) is tried again until
 * it lands, within the deadline: the shard is in the store, whole, and with
 * drop_shards the local file is removed only then. With a deadline already
 * spent the failure is final and the local shard stays; put_kept: then the
 * run's end tries it again. */
static void shard_put(double deadline_s, double unblock_after_s, int expect_in_store,
                      int put_kept)
{
    char *store_dir = sp_strf("%s/store-%g", dir, deadline_s);
    char *tmp = sp_strf("%s/.tmp-shard", dir), *blocker = sp_strf("%s/step-00000005", store_dir);
    cr_assert_eq(mkdir(store_dir, 0755), 0);
    cr_assert_eq(mkdir(tmp, 0755), 0);
    FILE *f = fopen(blocker, "w"); /* a file where the step's directory goes */
    cr_assert(f);
    fclose(f);
    sp_err err = {0};
    ckpt_writer *w = put_writer(store_dir, deadline_s, NULL, NULL);
    ckpt_shard sh = one_shard(5);
    double waited;
    double t0 = sp_now();
    cr_assert_eq(ckpt_writer_submit_shard(w, tmp, &sh, &waited, &err), 0, "%s", err.msg);
    struct timespec ts = {0, 50 * 1000 * 1000};
    while (sp_now() - t0 < unblock_after_s)
        nanosleep(&ts, NULL);
    char name[64];
    ckpt_shard_name(name, sizeof name, 0, 1);
    if (put_kept) { /* the run's end: tried again for the final deadline */
        cr_assert_eq(ckpt_writer_wait_written(w), 0);
        cr_expect_eq(ckpt_writer_put_kept(w, 5, 0.3, &err), -1,
                     "the put of the kept shard passed while the store is still blocked");
        cr_expect(tu_contains(err.msg, name) && tu_contains(err.msg, "step-00000005"),
                  "the failure does not name the shard: %s", err.msg);
        cr_expect_eq(ckpt_writer_put_kept(w, 4, 30.0, &err), 0, "step 4 had no kept shard");
        memset(&err, 0, sizeof err);
        t0 = sp_now();
        pid_t pid = fork(); /* the blocker removed 1 s into the put's retries */
        cr_assert_geq(pid, 0);
        if (pid == 0) {
            sleep(1);
            _exit(unlink(blocker) ? 1 : 0);
        }
        cr_expect_eq(ckpt_writer_put_kept(w, 5, 30.0, &err), 0, "%s", err.msg);
        int status;
        cr_assert_eq(waitpid(pid, &status, 0), pid);
        cr_expect(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the blocker was not removed");
        cr_expect_gt(sp_now() - t0, 0.9, "the put passed before the store was unblocked");
    } else {
        cr_assert_eq(unlink(blocker), 0);
    }
    ckpt_writer_stop(w); /* after the shard's upload */
    struct stat sb;
    int in_store = stat(tu_fmt("%s/step-00000005/%s", store_dir, name), &sb) == 0;
    int local = stat(tu_fmt("%s/%s", tmp, name), &sb) == 0;
    cr_expect_eq(in_store, expect_in_store, "the shard %s in the store (deadline %g s)",
                 in_store ? "is" : "is not", deadline_s);
    cr_expect_eq(local, !expect_in_store, "the local shard %s", local ? "stayed" : "was removed");
    free(store_dir), free(tmp), free(blocker);
}

Test(ckpt_put, a_failed_shard_put_is_tried_again_until_its_deadline)
{
    shard_put(30.0, 1.5, 1, 0);
}

Test(ckpt_put, a_shard_put_failing_past_its_deadline_keeps_the_local_shard)
{
    shard_put(0.5, 1.5, 0, 0);
}

/* The run's end (ckpt_writer_put_kept): a shard kept after its put failed
 * for good is tried again for the final deadline; while the store stays
 * blocked that fails naming the shard, another step's has nothing to put,
 * and once the store is back the shard lands and its local file goes. */
Test(ckpt_put, a_kept_shard_is_put_at_the_runs_end_once_the_store_is_back)
{
    shard_put(0.5, 1.0, 1, 1);
}

/* A long store outage on a machine that keeps no shards (drop): a shard kept
 * after its put failed for good is removed once the rank's next shard is
 * written, kept in its turn or put; the disk holds one kept shard at most. */
Test(ckpt_put, a_newer_shard_supersedes_a_kept_one)
{
    char *store_dir = sp_strf("%s/store-outage", dir);
    cr_assert_eq(mkdir(store_dir, 0755), 0);
    const int steps[3] = {5, 6, 7};
    char *tmp[3];
    for (int i = 0; i < 3; i++) {
        tmp[i] = sp_strf("%s/.tmp-outage-%d", dir, steps[i]);
        cr_assert_eq(mkdir(tmp[i], 0755), 0);
    }
    for (int i = 0; i < 2; i++) { /* steps 5 and 6: a file where the step's directory goes */
        FILE *f = fopen(tu_fmt("%s/step-%08d", store_dir, steps[i]), "w");
        cr_assert(f);
        fclose(f);
    }
    sp_err err = {0};
    ckpt_writer *w = put_writer(store_dir, 0.3, NULL, NULL);
    char name[64];
    ckpt_shard_name(name, sizeof name, 0, 1);
    struct stat sb;
    for (int i = 0; i < 3; i++) {
        ckpt_shard sh = one_shard(steps[i]);
        double waited;
        /* waits for the previous shard's job, its put's retries included */
        cr_assert_eq(ckpt_writer_submit_shard(w, tmp[i], &sh, &waited, &err), 0, "%s", err.msg);
        if (i == 2) { /* step 6's job done: step 6 kept, step 5 gone with its directory */
            cr_expect(stat(tu_fmt("%s/%s", tmp[1], name), &sb) == 0,
                      "step 6's kept shard is not on disk");
            cr_expect(stat(tu_fmt("%s/%s", tmp[0], name), &sb) != 0 && stat(tmp[0], &sb) != 0,
                      "step 5's kept shard stayed after step 6's was written");
        }
    }
    ckpt_writer_stop(w);
    for (int i = 0; i < 3; i++)
        cr_expect(stat(tu_fmt("%s/%s", tmp[i], name), &sb) != 0,
                  "step %d's shard is still on disk", steps[i]);
    cr_expect(stat(tu_fmt("%s/step-00000007/%s", store_dir, name), &sb) == 0,
              "step 7's shard is not in the store");
    for (int i = 0; i < 3; i++)
        free(tmp[i]);
    free(store_dir);
}

/* The gate (ckpt_writer_set_gate): a rank puts its shard only into a prefix
 * whose lease is its job's. */
typedef struct gate_state {
    pthread_mutex_t mu;
    int state, asked;
} gate_state;

static int gate_fn(void *arg, sp_err *why)
{
    gate_state *g = arg;
    pthread_mutex_lock(&g->mu);
    int s = g->state;
    g->asked++;
    pthread_mutex_unlock(&g->mu);
    if (s == 0)
        sp_fail(why, SP_EXIT_OTHER, "the job's lease is not written yet (test gate)");
    if (s < 0)
        sp_fail(why, SP_EXIT_USAGE, "another job holds the prefix (test gate)");
    return s;
}

static void gate_set(gate_state *g, int state)
{
    pthread_mutex_lock(&g->mu);
    g->state = state;
    pthread_mutex_unlock(&g->mu);
}

static int gate_asked(gate_state *g)
{
    pthread_mutex_lock(&g->mu);
    int n = g->asked;
    pthread_mutex_unlock(&g->mu);
    return n;
}

static void submit(ckpt_writer *w, const char *tmp, int64_t step)
{
    sp_err err = {0};
    double waited;
    cr_assert_eq(mkdir(tmp, 0755), 0);
    ckpt_shard sh = one_shard(step);
    cr_assert_eq(ckpt_writer_submit_shard(w, tmp, &sh, &waited, &err), 0, "%s", err.msg);
}

/* "Not yet" holds the shard off the store while it is asked again (with
 * pauses) and it lands once the gate opens within the deadline; shut past
 * the deadline the shard is kept, the run's end tries it again and fails
 * with the gate's reason while it stays shut, and puts it once it opens;
 * "never" ends the tries at once, the shard kept. */
Test(ckpt_put, the_gate_holds_a_shard_until_the_prefix_is_the_jobs)
{
    char name[64];
    ckpt_shard_name(name, sizeof name, 0, 1);
    struct stat sb;
    sp_err err = {0};
    gate_state g = {.mu = PTHREAD_MUTEX_INITIALIZER};
    /* opens after 1.2 s, the deadline 30 s */
    char *sd = sp_strf("%s/gated", dir), *tmp = sp_strf("%s/.tmp-gated", dir);
    cr_assert_eq(mkdir(sd, 0755), 0);
    ckpt_writer *w = put_writer(sd, 30.0, gate_fn, &g);
    double t0 = sp_now();
    submit(w, tmp, 5);
    cr_assert_eq(ckpt_writer_wait_written(w), 0);
    while (sp_now() - t0 < 1.2)
        nanosleep(&(struct timespec){0, 20 * 1000 * 1000}, NULL);
    cr_expect(stat(tu_fmt("%s/step-00000005/%s", sd, name), &sb) != 0,
              "the shard reached the store while the gate was shut");
    cr_expect(stat(tu_fmt("%s/step-00000005", sd), &sb) != 0, "the store was written to");
    cr_expect_geq(gate_asked(&g), 3, "asked %d times in 1.2 s (pauses of 0.25, 0.5 s)",
                  gate_asked(&g));
    cr_expect(stat(tu_fmt("%s/%s", tmp, name), &sb) == 0, "the held shard left the disk");
    gate_set(&g, 1);
    cr_assert_eq(ckpt_writer_wait(w, &err), 0, "%s", err.msg);
    cr_expect(stat(tu_fmt("%s/step-00000005/%s", sd, name), &sb) == 0,
              "the shard is not in the store once the gate opened");
    cr_expect(stat(tu_fmt("%s/%s", tmp, name), &sb) != 0, "the put shard stayed on disk");
    cr_expect_lt(sp_now() - t0, 10.0, "the put took %.1f s after the gate opened", sp_now() - t0);
    ckpt_writer_stop(w);
    free(sd), free(tmp);

    /* shut past a 0.5 s deadline: kept; the run's end */
    gate_set(&g, 0);
    sd = sp_strf("%s/gated-late", dir), tmp = sp_strf("%s/.tmp-gated-late", dir);
    cr_assert_eq(mkdir(sd, 0755), 0);
    w = put_writer(sd, 0.5, gate_fn, &g);
    submit(w, tmp, 6);
    cr_assert_eq(ckpt_writer_wait(w, &err), 0, "%s", err.msg);
    cr_expect(stat(tu_fmt("%s/%s", tmp, name), &sb) == 0, "the shard held past the deadline "
                                                            "was not kept");
    cr_expect_eq(ckpt_writer_put_kept(w, 6, 0.3, &err), -1, "put while the gate is shut");
    cr_expect(tu_contains(err.msg, "the job's lease is not written yet (test gate)") &&
                  tu_contains(err.msg, name),
              "the failure does not name the shard and the gate's reason: %s", err.msg);
    cr_expect(stat(tu_fmt("%s/step-00000006", sd), &sb) != 0, "the store was written to");
    gate_set(&g, 1);
    memset(&err, 0, sizeof err);
    cr_expect_eq(ckpt_writer_put_kept(w, 6, 30.0, &err), 0, "%s", err.msg);
    cr_expect(stat(tu_fmt("%s/step-00000006/%s", sd, name), &sb) == 0, "not put at the end");
    cr_expect(stat(tu_fmt("%s/%s", tmp, name), &sb) != 0, "the put shard stayed on disk");
    ckpt_writer_stop(w);
    free(sd), free(tmp);

    /* "never": one question, no tries for the 30 s deadline */
    gate_set(&g, -1);
    int asked = gate_asked(&g);
    sd = sp_strf("%s/gated-never", dir), tmp = sp_strf("%s/.tmp-gated-never", dir);
    cr_assert_eq(mkdir(sd, 0755), 0);
    w = put_writer(sd, 30.0, gate_fn, &g);
    t0 = sp_now();
    submit(w, tmp, 7);
    cr_assert_eq(ckpt_writer_wait(w, &err), 0, "%s", err.msg);
    cr_expect_lt(sp_now() - t0, 5.0, "refused for good, yet tried for %.1f s", sp_now() - t0);
    cr_expect_eq(gate_asked(&g) - asked, 1, "asked %d times", gate_asked(&g) - asked);
    cr_expect(stat(tu_fmt("%s/step-00000007", sd), &sb) != 0, "the store was written to");
    cr_expect(stat(tu_fmt("%s/%s", tmp, name), &sb) == 0, "the refused shard left the disk");
    ckpt_writer_stop(w);
    free(sd), free(tmp);
}

/* Rank 0 commits a checkpoint (renames its .tmp- directory to step-N) once
 * every rank's shard is written, without waiting for their puts: a put that
 * had not opened its file by then (the gate below renames the directory
 * before the first put, as a loaded machine lets rank 0 do) failed on every
 * try, and the stop checkpoint of a preempted job never reached the store
 * whole. The put reads the shard from the committed directory. */
typedef struct commit_first {
    const char *tmp, *committed;
    int renamed;
} commit_first;

static int commit_before_put(void *arg, sp_err *why)
{
    commit_first *c = arg;
    if (!c->renamed && rename(c->tmp, c->committed) != 0)
        return sp_fail(why, SP_EXIT_OTHER, "rename failed (test gate)"), 0;
    c->renamed = 1;
    return 1;
}

Test(ckpt_put, a_shard_committed_before_its_put_is_put_from_the_checkpoint)
{
    char name[64];
    ckpt_shard_name(name, sizeof name, 0, 1);
    char *sd = sp_strf("%s/committed-store", dir), *tmp = sp_strf("%s/.tmp-step-00000007-1", dir),
         *fin = sp_strf("%s/step-00000007", dir);
    cr_assert_eq(mkdir(sd, 0755), 0);
    commit_first c = {.tmp = tmp, .committed = fin};
    ckpt_writer *w = put_writer(sd, 2.0, commit_before_put, &c);
    ckpt_writer_drop_shards(w, 0); /* run.dir shared: the shard stays in the checkpoint */
    submit(w, tmp, 7);
    sp_err err = {0};
    cr_assert_eq(ckpt_writer_wait(w, &err), 0, "%s", err.msg);
    ckpt_writer_stop(w);
    cr_assert(c.renamed, "the gate was never asked");
    size_t a = 0, b = 0;
    char *put = tu_read_file(tu_fmt("%s/step-00000007/%s", sd, name), &a);
    char *mine = tu_read_file(tu_fmt("%s/%s", fin, name), &b);
    cr_expect(put != NULL, "the shard is not in the store");
    cr_expect(mine != NULL, "the committed shard left the checkpoint");
    cr_expect(put && mine && a == b && a > 0 && memcmp(put, mine, a) == 0,
              "the store's shard (%zu bytes) is not the committed one (%zu)", a, b);
    free(put), free(mine);
    free(sd), free(tmp), free(fin);
}
