/* The step profile (backend.h, "step profile"): a list of marks, each
 * opening a span of one group; the backend times the marks (CUDA events)
 * or the host clock does (CPU), and the spans are summed by group. */
#include <stdlib.h>
#include <string.h>

#include "backend.h"

#define PROF_MARKS 65536 /* spans per profile; later changes of group are not marked */

const char *const be_prof_names[BE_PROF_GROUPS] = {"gemm",        "lora",      "attention",
                                                   "elementwise", "optimizer", "communication"};

struct be_prof {
    int n;           /* marks made */
    int group;       /* the group of the span open now */
    int lora, comm;  /* nesting depths */
    int group_of[PROF_MARKS];
    double host[PROF_MARKS]; /* sp_now() at each mark, when the backend has no prof_mark */
};

static void mark(backend_t *be, int group)
{
    struct be_prof *p = be->prof;
    if (p->n >= PROF_MARKS - 1) /* the last slot closes the profile */
        return;
    if (be->ops->prof_mark)
        be->ops->prof_mark(be, p->n);
    else
        p->host[p->n] = sp_now();
    p->group_of[p->n++] = group;
    p->group = group;
}

int be_prof_start(backend_t *be)
{
    free(be->prof);
    be->prof = calloc(1, sizeof *be->prof);
    if (!be->prof)
        return -1;
    mark(be, BE_PROF_ELEMENTWISE);
    return 0;
}

void be_prof_op(backend_t *be, const char *op)
{
    struct be_prof *p = be->prof;
    if (!p)
        return;
    int g;
    if (p->comm)
        g = BE_PROF_COMM;
    else if (p->lora)
        g = BE_PROF_LORA;
    else if (!strcmp(op, "matmul") || !strcmp(op, "matmul_batched"))
        g = BE_PROF_GEMM;
    else if (!strcmp(op, "attention_forward") || !strcmp(op, "attention_backward"))
        g = BE_PROF_ATTENTION;
    else if (!strcmp(op, "adamw") || !strcmp(op, "sumsq") || !strcmp(op, "sumsq_into"))
        g = BE_PROF_OPTIMIZER;
    else if (!strcmp(op, "h2d") || !strcmp(op, "d2h") || !strcmp(op, "sync") ||
             !strcmp(op, "alloc") || !strcmp(op, "free"))
        return; /* transfers and waits: the span they are in */
    else
        g = BE_PROF_ELEMENTWISE;
    if (g != p->group)
        mark(be, g);
}

static void region(backend_t *be, int *depth, int on, int group)
{
    if (!be->prof)
        return;
    *depth += on ? 1 : -1;
    if (*depth < 0)
        *depth = 0;
    /* entering: the region's time starts now (host waits included); leaving:
     * the next op says what follows */
    if (on && *depth == 1 && be->prof->group != group)
        mark(be, group);
}

void be_prof_lora(backend_t *be, int on)
{
    if (be->prof)
        region(be, &be->prof->lora, on, be->prof->comm ? BE_PROF_COMM : BE_PROF_LORA);
}

void be_prof_comm(backend_t *be, int on)
{
    if (be->prof)
        region(be, &be->prof->comm, on, BE_PROF_COMM);
}

int be_prof_stop(backend_t *be, double ms[BE_PROF_GROUPS])
{
    struct be_prof *p = be->prof;
    memset(ms, 0, sizeof(double) * BE_PROF_GROUPS);
    if (!p)
        return 0;
    int n = p->n, ok = 1;
    if (be->ops->prof_mark) {
        be->ops->prof_mark(be, n);
    } else {
        p->host[n] = sp_now();
    }
    double *t = malloc(sizeof(double) * (size_t)(n + 1));
    if (!t) {
        ok = 0;
    } else if (be->ops->prof_read) {
        ok = be->ops->prof_read(be, t, n + 1) == 0;
    } else {
        for (int i = 0; i <= n; i++)
            t[i] = (p->host[i] - p->host[0]) * 1e3;
    }
    for (int i = 0; ok && i < n; i++)
        ms[p->group_of[i]] += t[i + 1] - t[i];
    free(t);
    free(p);
    be->prof = NULL;
    if (!ok)
        memset(ms, 0, sizeof(double) * BE_PROF_GROUPS);
    return ok ? 0 : -1;
}
