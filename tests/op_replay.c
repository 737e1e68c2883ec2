/* Every op captured as a graph (be_graph) and launched against the same
 * call made eagerly, on any backend (op_checks.h, op_checks_replay). */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "op_checks.h"
#include "op_specs.h"

/* Each allocation's bytes: F32 ones filled with values of their own in
 * [0.25, 1.25) (positive: moments, norms and denominators stay valid),
 * ids and codes 0. */
static void arena_vary(arena *a, int salt)
{
    for (int i = 0; i < a->n; i++)
        if (a->esz[i] == 4 && a->parent[i].dt == DT_F32)
            for (size_t j = 0; j < a->bytes[i] / 4; j++) {
                float f = 0.25f + (float)sp_rng_uniform((uint64_t)(salt * 16 + i), j);
                memcpy(a->image[i] + 4 * j, &f, 4);
            }
}

static unsigned char *arena_bytes(const arena *a, int i)
{
    unsigned char *b = malloc(a->bytes[i]);
    cr_assert(b);
    be_d2h(a->be, b, a->parent[i].p, a->bytes[i]);
    return b;
}

/* One call (made by fn with t and d) eagerly, then captured and launched
 * from the same bytes: the same results. */
static void replay_one_call(arena *a, const char *op, void (*fn)(backend_t *, const tensor_t *,
                                                                 const int *),
                            const tensor_t *t, const int *d)
{
    backend_t *be = a->be;
    sp_err err = {0};
    arena_reset(a);
    fn(be, t, d);
    cr_assert_eq(be_check(be, &err), 0, "%s eagerly: %s", op, err.msg);
    unsigned char *eager[10];
    for (int i = 0; i < a->n; i++)
        eager[i] = arena_bytes(a, i);
    arena_reset(a);
    cr_assert_eq(be_graph_begin(be), 0, "%s: be_graph_begin", op);
    fn(be, t, d);
    char why[300] = "";
    be_graph *g = be_graph_end(be, why, sizeof why);
    cr_assert_not_null(g, "%s: the capture failed: %s", op, why);
    cr_expect_eq(be_check(be, &err), 0, "%s captured: %s", op, err.msg);
    for (int i = 0; i < a->n; i++) {
        char what[200];
        snprintf(what, sizeof what, "%s: the capture (argument %d)", op, i);
        arena_same(a, i, 0, a->bytes[i] / a->esz[i], what);
    }
    cr_assert_eq(be_graph_launch(be, g), 0, "%s: launch", op);
    cr_assert_eq(be_check(be, &err), 0, "%s replayed: %s", op, err.msg);
    for (int i = 0; i < a->n; i++) {
        unsigned char *now = arena_bytes(a, i);
        cr_expect(memcmp(eager[i], now, a->bytes[i]) == 0,
                  "%s on %s: argument %d replayed differs from eager", op, be->name, i);
        free(now);
        free(eager[i]);
    }
    be_graph_free(be, g);
}

static void c_zero(backend_t *be, const tensor_t *t, const int *d)
{
    (void)d;
    be_zero(be, t[0]);
}
static void c_copy(backend_t *be, const tensor_t *t, const int *d)
{
    (void)d;
    be_copy(be, t[0], t[1]);
}
static void c_copy2d(backend_t *be, const tensor_t *t, const int *d)
{
    (void)d;
    be_copy2d(be, t[0], t[1], 3, 4, 6, 5);
}
static void c_matmul_into(backend_t *be, const tensor_t *t, const int *d)
{
    (void)d;
    be_matmul_into(be, t[0], t[1], t[2], t[3], 3, 4, 2, 0, 1, 1.0f, 0.5f);
}

int op_checks_replay(backend_t *be)
{
    int checked = 0;
    for (size_t k = 0; k < op_spec_count; k++) {
        const op_spec *s = &op_specs[k];
        arena a;
        arena_make(&a, be, s);
        arena_vary(&a, (int)k + 1);
        tensor_t t[10];
        for (int i = 0; i < s->nt; i++)
            t[i] = arena_arg(&a, s, i);
        if (strcmp(s->op, "sumsq") == 0) { /* a barrier: no graph holds it */
            cr_assert_eq(be_graph_begin(be), 0);
            s->call(be, t, s->d);
            char why[300] = "";
            cr_expect_null(be_graph_end(be, why, sizeof why), "sumsq was captured");
            cr_expect(strstr(why, "sumsq") != NULL, "why: %s", why);
        } else {
            replay_one_call(&a, s->op, s->call, t, s->d);
        }
        arena_free(&a);
        checked++;
    }
    /* the ops outside the table: zero, copy, copy2d (dst 3 x 6, src 3 x 5
     * strides), matmul_into (D, A 3 x 2, B 4 x 2, C 3 x 4) */
    static const op_spec extra[] = {
        {"zero", c_zero, 1, {T_("t", 12, "n", TAKES_FLOAT)}, 0, {NULL}, {0}},
        {"copy", c_copy, 2, {T_("dst", 12, "n", TAKES_FLOAT), T_("src", 12, "n", TAKES_FLOAT)},
         0, {NULL}, {0}},
        {"copy2d", c_copy2d, 2,
         {T_("dst", 16, "n", TAKES_FLOAT), T_("src", 14, "n", TAKES_FLOAT)}, 0, {NULL}, {0}},
        {"matmul_into", c_matmul_into, 4,
         {T_("D", 12, "n", TAKES_FLOAT), T_("A", 6, "n", TAKES_FLOAT),
          T_("B", 8, "n", TAKES_FLOAT), T_("C", 12, "n", TAKES_FLOAT)},
         0, {NULL}, {0}},
    };
    for (size_t k = 0; k < sizeof extra / sizeof extra[0]; k++) {
        arena a;
        arena_make(&a, be, &extra[k]);
        arena_vary(&a, 100 + (int)k);
        tensor_t t[10];
        for (int i = 0; i < extra[k].nt; i++)
            t[i] = arena_arg(&a, &extra[k], i);
        replay_one_call(&a, extra[k].op, extra[k].call, t, extra[k].d);
        arena_free(&a);
        checked++;
    }
    return checked;
}
