/* tests/test_lease.c — the remote prefix's lease when jobs race for it:
 * the stores' compare-and-swap put (store_put_bytes_if) on file://, on an
 * S3 endpoint that honours If-None-Match and If-Match, and on one that
 * answers them 501 (the fallback); jobs that start together, or take over
 * an expired lease together, get one lease between them; a renewal never
 * writes over a lease that another job wrote after the renewal read it.
 * The S3 endpoint is tests/tools/fake_s3.py, which can hold a GET's answer
 * to open the window between a job's read and its write, and can ignore
 * the conditions, as some stores do: then the same races give the lease to
 * several jobs, which shows the window is really open in these tests. */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "checkpoint/lease.h"
#include "checkpoint/store.h"
#include "test_store_util.h"
#include "test_util.h"

/* the fake endpoint checks no signature; the client needs keys to sign */
static void fake_keys(void)
{
    setenv("AWS_ACCESS_KEY_ID", "lease-test", 1);
    setenv("AWS_SECRET_ACCESS_KEY", "lease-test-secret", 1);
    unsetenv("AWS_SESSION_TOKEN");
}

TestSuite(lease, .timeout = 120, .init = fake_keys);

typedef struct fake_s3 {
    char *dir, log[600], url[128], requests[600];
    int pid;
} fake_s3;

/* The fake endpoint: conditions "honour", "ignore" or "501"; slow_get_s > 0
 * holds the answer to each GET of LEASE.json that long. */
static fake_s3 fake_start(const char *conditions, double slow_get_s)
{
    fake_s3 f = {.dir = tu_tempdir("lease")};
    snprintf(f.log, sizeof f.log, "%s/fake_s3.out", f.dir);
    snprintf(f.requests, sizeof f.requests, "%s/requests.log", f.dir);
    f.pid = tu_fake_server("fake_s3.py", f.log,
                           tu_fmt("--conditions %s --log %s%s", conditions, f.requests,
                                  slow_get_s > 0 ? tu_fmt(" --slow-get LEASE.json:%g", slow_get_s)
                                                 : ""),
                           f.url, sizeof f.url);
    return f;
}

static void fake_stop(fake_s3 *f)
{
    kill(f->pid, SIGTERM);
    tu_wait(f->pid, 10);
    tu_rmtree(f->dir);
    free(f->dir);
}

static store_t *fake_store(const fake_s3 *f)
{
    store_opts o = {.endpoint = f->url, .region = "us-east-1", .max_retries = 2,
                    .retry_base_s = 0.05, .timeout_s = 10};
    store_t *st = NULL;
    sp_err err = {0};
    cr_assert_eq(store_open(&st, "s3://lease/run", &o, &err), 0, "%s", err.msg);
    return st;
}

/* How many times needle is in the fake's request log (a request as it comes
 * is "METHOD PATH CONDITION", "-" for none; "done ..." as it is answered). */
static int requests_with(const fake_s3 *f, const char *needle)
{
    char *text = tu_read_file(f->requests, NULL);
    int k = 0;
    for (const char *p = text; p && (p = strstr(p, needle)); p += strlen(needle))
        k++;
    free(text);
    return k;
}

/* ---- the compare-and-swap put ------------------------------------------------ */

Test(lease, a_conditional_put_replaces_only_what_was_read_on_file)
{
    tu_file_fx f = tu_file_store("cas");
    tu_check_put_if(f.s);
    tu_file_store_close(&f);
}

/* tu_check_put_if on the fake endpoint answering conditions so; the fake
 * is left running for the caller to read its request log. */
static fake_s3 fake_checked(const char *conditions)
{
    fake_s3 f = fake_start(conditions, 0);
    store_t *st = fake_store(&f);
    tu_check_put_if(st);
    store_close(st);
    return f;
}

Test(lease, a_conditional_put_replaces_only_what_was_read_on_s3)
{
    fake_s3 f = fake_checked("honour");
    cr_expect_eq(requests_with(&f, " If-Match:\""), 3, "If-Match was not sent for each replace");
    cr_expect_eq(requests_with(&f, " If-None-Match:*"), 2, "If-None-Match was not sent");
    fake_stop(&f);
}

/* A store that answers If-Match (and If-None-Match) with 501: the same
 * results through a HEAD before a plain PUT, and the 501 asked only once
 * per store handle. */
Test(lease, a_store_without_conditional_puts_gets_the_head_check)
{
    fake_s3 f = fake_checked("501");
    cr_expect_eq(requests_with(&f, " If-Match:\""), 1, "the 501 to If-Match was not remembered");
    cr_expect_eq(requests_with(&f, " If-None-Match:*"), 1,
                 "the 501 to If-None-Match was not remembered");
    cr_expect_geq(requests_with(&f, "HEAD /lease/run/cas/LEASE.json -"), 4,
                  "the fallback did not check with a HEAD");
    fake_stop(&f);
}

/* ---- jobs that race for the lease -------------------------------------------- */

enum { RACERS = 4 };

typedef struct racer {
    const fake_s3 *fake; /* or file:// url */
    const char *url;
    pthread_barrier_t *go;
    lease_t *lease;
    int rc;
    sp_err err;
    char note[SP_ERR_MSG_MAX];
} racer;

static void *race(void *arg)
{
    racer *r = arg;
    store_t *st = NULL;
    if (r->fake) {
        st = fake_store(r->fake);
    } else {
        sp_err e = {0};
        cr_assert_eq(store_open(&st, r->url, NULL, &e), 0, "%s", e.msg);
    }
    lease_opts lo = {.ttl_s = 30, .wait_s = 0, .run_dir = "/runs/race"};
    int connected = 0;
    pthread_barrier_wait(r->go);
    r->rc = lease_acquire(&r->lease, st, &lo, &connected, r->note, sizeof r->note, &r->err);
    if (r->rc == 0 && !connected) {
        r->rc = -1;
        snprintf(r->err.msg, sizeof r->err.msg, "the store did not answer");
    }
    return NULL;
}

/* n jobs start at once on one prefix: how many hold its lease. Each loser's
 * error must name the prefix in use; notes go to winner_note. */
static int race_for_lease(const fake_s3 *fake, const char *url, int n, char *winner_note)
{
    racer r[RACERS];
    pthread_t th[RACERS];
    pthread_barrier_t go;
    pthread_barrier_init(&go, NULL, (unsigned)n);
    for (int i = 0; i < n; i++) {
        r[i] = (racer){.fake = fake, .url = url, .go = &go};
        cr_assert_eq(pthread_create(&th[i], NULL, race, &r[i]), 0);
    }
    int held = 0;
    for (int i = 0; i < n; i++) {
        pthread_join(th[i], NULL);
        if (r[i].rc == 0) {
            held++;
            if (winner_note)
                snprintf(winner_note, SP_ERR_MSG_MAX, "%s", r[i].note);
        } else {
            cr_expect(tu_contains(r[i].err.msg, "is in use by another job"),
                      "a job that lost the race says: %s", r[i].err.msg);
        }
    }
    for (int i = 0; i < n; i++)
        lease_release(r[i].lease);
    pthread_barrier_destroy(&go);
    return held;
}

Test(lease, jobs_starting_together_on_s3_get_one_lease)
{
    /* every job reads "no lease" before any writes one (each GET answered
     * 0.5 s late): only the conditional write decides */
    fake_s3 f = fake_start("honour", 0.5);
    int held = race_for_lease(&f, NULL, RACERS, NULL);
    cr_expect_eq(held, 1, "%d of %d jobs starting together hold the lease", held, RACERS);
    cr_expect_eq(requests_with(&f, "DELETE /lease/run/LEASE.json -"), 1,
                 "the winner's lease was not deleted once at its end");
    fake_stop(&f);

    /* the same race on a store that ignores the conditions: several hold it */
    f = fake_start("ignore", 0.5);
    held = race_for_lease(&f, NULL, RACERS, NULL);
    cr_expect_gt(held, 1, "the race's window did not open: %d job(s) held the lease", held);
    fake_stop(&f);
}

Test(lease, jobs_starting_together_on_file_get_one_lease)
{
    tu_file_fx f = tu_file_store("race");
    for (int round = 0; round < 10; round++) {
        char *url = tu_path_in(f.url, tu_fmt("round-%d", round));
        int held = race_for_lease(NULL, url, RACERS, NULL);
        cr_expect_eq(held, 1, "round %d: %d of %d jobs hold the lease", round, held, RACERS);
        free(url);
    }
    tu_file_store_close(&f);
}

/* A lease that has expired (another host's, renewed long ago) is taken over
 * by one of the jobs that find it together; the others wait for the
 * winner, whose note names the expired holder. */
Test(lease, an_expired_lease_found_by_several_jobs_goes_to_one)
{
    fake_s3 f = fake_start("honour", 0.5);
    store_t *st = fake_store(&f);
    const char *old = tu_fmt("{\"host\": \"gone-host\", \"pid\": 4242, \"job\": "
                             "\"00000000deadbeef\", \"run_dir\": \"/runs/old\", \"started\": "
                             "%.3f, \"renewed\": %.3f, \"ttl_s\": 30}",
                             sp_wall_time() - 4000, sp_wall_time() - 3000);
    sp_err err = {0};
    cr_assert_eq(store_put_bytes(st, "LEASE.json", old, strlen(old), 0, &err), 0, "%s", err.msg);
    store_close(st);
    char note[SP_ERR_MSG_MAX] = "";
    int held = race_for_lease(&f, NULL, 3, note);
    cr_expect_eq(held, 1, "%d of 3 jobs took over the expired lease", held);
    cr_expect(tu_contains(note, "taking over the lease of pid 4242 on host gone-host") &&
                  tu_contains(note, "which has expired"),
              "the winner's note: %s", note);
    fake_stop(&f);
}

/* A job renews its lease (every ttl/3); another job's lease is written
 * while the renewal's read is on its way back. The renewal's write must
 * fail, and the job learn that it lost the prefix: 1 when the other's
 * lease is still there after that, 0 when the renewal wrote over it. */
static int renewal_after_a_takeover(const char *conditions)
{
    fake_s3 f = fake_start(conditions, 0.5);
    lease_opts lo = {.ttl_s = 1.5, .wait_s = 0, .run_dir = "/runs/renew"};
    lease_t *l = NULL;
    int connected = 0;
    char note[SP_ERR_MSG_MAX];
    sp_err err = {0};
    cr_assert_eq(lease_acquire(&l, fake_store(&f), &lo, &connected, note, sizeof note, &err), 0,
                 "%s", err.msg);
    cr_assert(connected);
    /* the renewal's next GET: answered 0.5 s late, with the lease as it was */
    const char *get = "GET /lease/run/LEASE.json -";
    int gets = requests_with(&f, get);
    for (int i = 0; i < 400 && requests_with(&f, get) == gets; i++)
        tu_sleep(0.01);
    cr_assert_gt(requests_with(&f, get), gets, "the renewal did not read the lease");
    store_t *other = fake_store(&f);
    const char *theirs = tu_fmt("{\"host\": \"other-host\", \"pid\": 7, \"job\": "
                                "\"feedfacefeedface\", \"run_dir\": \"/runs/other\", \"started\": "
                                "%.3f, \"renewed\": %.3f, \"ttl_s\": 30}",
                                sp_wall_time(), sp_wall_time());
    cr_assert_eq(store_put_bytes(other, "LEASE.json", theirs, strlen(theirs), 0, &err), 0, "%s",
                 err.msg);
    /* the renewal's write, then its second read (0.5 s) */
    for (int i = 0; i < 300 && !lease_lost(l, NULL); i++)
        tu_sleep(0.01);
    int lost = lease_lost(l, &err);
    if (lost)
        cr_expect(tu_contains(err.msg, "another job holds this prefix now: pid 7 on host "
                                       "other-host"),
                  "the lost lease's error: %s", err.msg);
    void *data = NULL;
    size_t n = 0;
    cr_assert_eq(store_get_bytes(other, "LEASE.json", &data, &n, &err), 0, "%s", err.msg);
    int kept = tu_contains(data, "feedfacefeedface");
    free(data);
    lease_release(l);
    store_close(other);
    fake_stop(&f);
    cr_expect_eq(lost, kept, "lost %d, the other's lease kept %d", lost, kept);
    return kept;
}

Test(lease, a_renewal_never_writes_over_a_newer_lease)
{
    cr_expect(renewal_after_a_takeover("honour"),
              "the renewal wrote over the lease written after its read");
    /* where the store ignores If-Match, it does */
    cr_expect(!renewal_after_a_takeover("ignore"), "the race's window did not open");
}
