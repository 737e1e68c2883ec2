/* comm/comm_roll.c — the roll call: who is missing when a collective times out.
 *
 * Owns: every rank's host name (gathered once at start), and a private
 * duplicate of the world on which the watchdog threads talk among
 * themselves. Each watchdog keeps a receive posted for an "ask" and answers
 * it with where its rank is (the number of the collective it is in or last
 * left, and whether it is in it). When a collective overruns, the watchdog
 * of the rank that noticed asks every other rank and waits a moment; the
 * abort message then names the ranks and hosts that did not answer (a node
 * lost or cut off) and those that answered from an earlier collective
 * (alive, but stuck elsewhere).
 *
 * Only the watchdog thread touches the roll-call state after comm_roll_open.
 * Everything here is non-blocking and bounded in time: a peer that is gone
 * leaves a receive that never completes, nothing more. */
#define _POSIX_C_SOURCE 200809L
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "comm_internal.h"

enum { TAG_ASK = 1, TAG_ANSWER = 2 };

int comm_roll_open(comm_t *c, sp_err *err)
{
    struct comm_roll *r = &c->roll;
    size_t n = (size_t)c->size;
    char mine[COMM_HOST_MAX];
    r->comm = MPI_COMM_NULL;
    r->hosts = calloc(n, COMM_HOST_MAX);
    r->answers = calloc(2 * n, sizeof *r->answers);
    r->got = calloc(2 * n, sizeof *r->got);
    r->reqs = calloc(2 * n, sizeof *r->reqs);
    if (!r->hosts || !r->answers || !r->got || !r->reqs)
        return sp_fail(err, SP_EXIT_OTHER, "comm: out of memory for the roll call of %d ranks",
                       c->size);
    sp_cutf(mine, sizeof mine, "%s", c->host); /* a label in messages */
    COMM_MPI(c, err, MPI_Allgather,
             (mine, COMM_HOST_MAX, MPI_CHAR, r->hosts, COMM_HOST_MAX, MPI_CHAR, c->world));
    COMM_MPI(c, err, MPI_Comm_dup, (c->world, &r->comm));
    COMM_MPI(c, err, MPI_Comm_set_errhandler, (r->comm, MPI_ERRORS_RETURN));
    COMM_MPI(c, err, MPI_Irecv, (r->ask_buf, 2, MPI_INT64_T, MPI_ANY_SOURCE, TAG_ASK, r->comm,
                                 &r->ask));
    r->on = 1;
    return 0;
}

/* Answers the asks that have arrived: {collective number, in it}. The
 * answer buffer is this peer's own slot, so it stays valid while the send
 * is in flight; a peer asks once, when it aborts. */
void comm_roll_serve(comm_t *c)
{
    struct comm_roll *r = &c->roll;
    while (r->on) {
        int done = 0;
        MPI_Status st;
        if (MPI_Test(&r->ask, &done, &st) != MPI_SUCCESS) {
            r->on = 0;
            return;
        }
        if (!done)
            return;
        int q = st.MPI_SOURCE;
        if (q >= 0 && q < c->size) {
            int64_t *a = &r->answers[2 * q];
            MPI_Request sent;
            a[0] = atomic_load(&c->wd.seq);
            a[1] = atomic_load(&c->wd.busy_since_ns) != 0;
            if (MPI_Isend(a, 2, MPI_INT64_T, q, TAG_ANSWER, r->comm, &sent) == MPI_SUCCESS)
                MPI_Request_free(&sent);
        }
        if (MPI_Irecv(r->ask_buf, 2, MPI_INT64_T, MPI_ANY_SOURCE, TAG_ASK, r->comm, &r->ask) !=
            MPI_SUCCESS)
            r->on = 0;
    }
}

void comm_roll_close(comm_t *c)
{
    struct comm_roll *r = &c->roll;
    if (!r->on)
        return;
    r->on = 0;
    MPI_Cancel(&r->ask);
    MPI_Wait(&r->ask, MPI_STATUS_IGNORE);
}

void comm_roll_free(comm_t *c)
{
    struct comm_roll *r = &c->roll;
    free(r->hosts);
    free(r->answers);
    free(r->got);
    free(r->reqs);
    memset(r, 0, sizeof *r);
}

/* ---- the message ---------------------------------------------------------- */

typedef struct text {
    char *p;
    size_t cap, len;
} text;

static void put(text *t, const char *fmt, ...)
{
    va_list ap;
    if (t->len + 1 >= t->cap)
        return;
    va_start(ap, fmt);
    int n = vsnprintf(t->p + t->len, t->cap - t->len, fmt, ap);
    va_end(ap);
    if (n > 0)
        t->len = t->len + (size_t)n < t->cap ? t->len + (size_t)n : t->cap - 1;
}

static const char *host_of(const comm_t *c, int rank)
{
    return c->roll.hosts + (size_t)rank * COMM_HOST_MAX;
}

/* "rank 2 on b", "ranks 2, 3 on b, rank 5 on c": runs of ranks on one host
 * together, at most `max_named` ranks named. */
static void put_ranks(text *t, const comm_t *c, const int *ranks, int k)
{
    const int max_named = 16;
    int named = 0;
    for (int i = 0; i < k && named < max_named;) {
        int j = i + 1;
        while (j < k && j - i + named < max_named &&
               strcmp(host_of(c, ranks[j]), host_of(c, ranks[i])) == 0)
            j++;
        put(t, "%s%s %d", i ? ", " : "", j - i > 1 ? "ranks" : "rank", ranks[i]);
        for (int m = i + 1; m < j; m++)
            put(t, ", %d", ranks[m]);
        put(t, " on %s", host_of(c, ranks[i]));
        named += j - i;
        i = j;
    }
    if (k > named)
        put(t, " and %d more", k - named);
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

void comm_roll_call(comm_t *c, double wait_s, char *out, size_t cap)
{
    struct comm_roll *r = &c->roll;
    int n = c->size, me = c->rank, pending = 0;
    if (!r->on || n < 2 || cap == 0)
        return;
    int64_t *ask = r->ask_out, seq = atomic_load(&c->wd.seq);
    ask[0] = seq;
    ask[1] = 1;
    MPI_Request *recv = r->reqs, *send = r->reqs + n;
    for (int q = 0; q < n; q++) {
        recv[q] = send[q] = MPI_REQUEST_NULL;
        if (q == me)
            continue;
        if (MPI_Irecv(&r->got[2 * q], 2, MPI_INT64_T, q, TAG_ANSWER, r->comm, &recv[q]) !=
            MPI_SUCCESS)
            recv[q] = MPI_REQUEST_NULL;
        else
            pending++;
        if (MPI_Isend(ask, 2, MPI_INT64_T, q, TAG_ASK, r->comm, &send[q]) != MPI_SUCCESS)
            send[q] = MPI_REQUEST_NULL;
    }
    /* wait for the answers, answering the asks of ranks that time out too */
    char *answered = calloc((size_t)n, 1);
    if (!answered)
        return;
    struct timespec tick = {0, 10 * 1000 * 1000};
    for (double t0 = now_s(); pending > 0 && now_s() - t0 < wait_s;) {
        for (int q = 0; q < n; q++) {
            int done = 0;
            if (recv[q] == MPI_REQUEST_NULL || answered[q])
                continue;
            if (MPI_Test(&recv[q], &done, MPI_STATUS_IGNORE) == MPI_SUCCESS && done) {
                answered[q] = 1;
                pending--;
            }
        }
        comm_roll_serve(c);
        if (pending > 0)
            nanosleep(&tick, NULL);
    }
    /* sends to ranks that never answered stay in flight: the job is ending */
    int *silent = malloc(sizeof *silent * (size_t)n), *behind = malloc(sizeof *behind * (size_t)n);
    int ns = 0, nb = 0;
    if (silent && behind) {
        for (int q = 0; q < n; q++) {
            if (q == me)
                continue;
            if (!answered[q])
                silent[ns++] = q;
            else if (r->got[2 * q] < seq)
                behind[nb++] = q;
        }
        text t = {out, cap, strlen(out) < cap ? strlen(out) : cap - 1};
        if (ns) {
            put(&t, "; no answer from ");
            put_ranks(&t, c, silent, ns);
        }
        if (nb) {
            put(&t, "; ");
            put_ranks(&t, c, behind, nb);
            put(&t, " answer%s but %s not reached this collective", nb > 1 ? "" : "s",
                nb > 1 ? "have" : "has");
        }
        if (!ns && !nb)
            put(&t, "; every rank answered from this collective");
    }
    free(silent);
    free(behind);
    free(answered);
}
