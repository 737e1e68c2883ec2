/* Malformed op calls and what each must do on every backend (op_checks.h).
 *
 * Each op is described once (op_specs.c): its tensor arguments (the elements its sizes
 * make them need, the dtypes it takes) and its size arguments, with one
 * valid call. From that the cases are made by breaking one argument at a
 * time, and the message each must give is written here from the rules of
 * kernels/backend.h, independently of kernels/backend_ops.c. Every tensor
 * is a view between two guard regions of its own allocation; a refused call
 * must leave the whole allocation as it was, the valid call its guards. */
#include "op_checks.h"
#include "op_specs.h"

#include <criterion/criterion.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- checking one call ---------------------------------------------------------------- */

void op_checks_expect_refused(backend_t *be, const char *want, const char *file,
                              const char *what)
{
    sp_err err = {0};
    cr_expect_neq(be_check(be, &err), 0, "%s: not refused (wanted \"%s\")", what, want);
    char prefix[600];
    snprintf(prefix, sizeof prefix, "%s backend: %s (%s:", be->name, want, file);
    cr_expect(strncmp(err.msg, prefix, strlen(prefix)) == 0, "%s:\n  got  \"%s\"\n  want \"%s...\"",
              what, err.msg, prefix);
    sp_err_clear(&be->err);
}

/* calls made in this file */
static void expect_refused(backend_t *be, const char *want, const char *what)
{
    op_checks_expect_refused(be, want, __FILE__, what);
}

static void expect_accepted(backend_t *be, const char *what)
{
    sp_err err = {0};
    be_sync(be);
    cr_expect_eq(be_check(be, &err), 0, "%s: %s", what, err.msg);
    sp_err_clear(&be->err);
}

/* Calls op s with args t, sizes d; it must be refused with want and change
 * no allocation. */
static void refused(arena *a, const op_spec *s, const tensor_t *t, const int *d, const char *want)
{
    char what[300];
    snprintf(what, sizeof what, "%s on %s, expecting \"%s\"", s->op, a->be->name, want);
    arena_reset(a);
    s->call(a->be, t, d);
    op_checks_expect_refused(a->be, want, op_specs_file, what);
    for (int i = 0; i < a->n; i++)
        arena_same(a, i, 0, a->bytes[i] / a->esz[i], what);
}

static const char *not_taken(takes_t takes, dtype_t *bad)
{
    switch (takes) {
    case TAKES_FLOAT:
        *bad = DT_I32;
        return "not a float dtype";
    case TAKES_F32:
        *bad = DT_I32;
        return "takes F32";
    case TAKES_I32:
        *bad = DT_F32;
        return "takes I32";
    case TAKES_U8:
        *bad = DT_F32;
        return "takes U8";
    }
    return "";
}

/* The valid call, then each argument broken in turn. */
static int check_op(backend_t *be, const op_spec *s)
{
    arena a;
    arena_make(&a, be, s);
    tensor_t t[10];
    int d[9];
    char want[300];
    int cases = 0;
    for (int i = 0; i < s->nt; i++)
        t[i] = arena_arg(&a, s, i);
    memcpy(d, s->d, sizeof d);

    /* the valid call (with its optional tensors present, then absent) */
    for (int absent = 0; absent < 2; absent++) {
        tensor_t tv[10];
        memcpy(tv, t, sizeof tv);
        for (int i = 0; i < s->nt && absent; i++)
            if (s->t[i].optional)
                tv[i] = (tensor_t){NULL, 0, DT_F32};
        arena_reset(&a);
        s->call(be, tv, d);
        char what[200];
        snprintf(what, sizeof what, "the valid %s on %s%s", s->op, be->name,
                 absent ? " without its optional tensors" : "");
        expect_accepted(be, what);
        for (int i = 0; i < s->nt; i++) {
            size_t n = s->t[i].n;
            arena_same(&a, i, 0, GUARD, what);
            arena_same(&a, i, GUARD + n, n + 2 * GUARD, what);
        }
    }

    for (int i = 0; i < s->nt; i++) {
        const targ *ta = &s->t[i];
        tensor_t keep = t[i];
        /* one element short of the need */
        t[i] = tensor_view(a.parent[i], GUARD, ta->need - 1);
        snprintf(want, sizeof want, "%s: %s has %zu elements, %s = %zu", s->op, ta->name,
                 ta->need - 1, ta->shape, ta->need);
        refused(&a, s, t, d, want);
        /* not allocated (an optional one is then absent: valid) */
        if (!ta->optional) {
            t[i] = (tensor_t){NULL, keep.n, keep.dt};
            snprintf(want, sizeof want, "%s: %s is not allocated", s->op, ta->name);
            refused(&a, s, t, d, want);
            cases++;
        }
        /* a dtype it does not take (same element size) */
        dtype_t bad = DT_I32;
        const char *why = not_taken(ta->takes, &bad);
        t[i] = keep;
        t[i].dt = bad;
        snprintf(want, sizeof want, "%s: %s has dtype %s, %s", s->op, ta->name, dtype_name(bad),
                 why);
        refused(&a, s, t, d, want);
        t[i] = keep;
        cases += 2;
    }
    for (int j = 0; j < s->nd; j++) {
        d[j] = -1;
        snprintf(want, sizeof want, "%s: %s = -1 is negative", s->op, s->dim[j]);
        refused(&a, s, t, d, want);
        d[j] = s->d[j];
        cases++;
    }
    arena_free(&a);
    return cases;
}

static const op_spec *spec_of(const char *op)
{
    for (size_t i = 0; i < op_spec_count; i++)
        if (!strcmp(op_specs[i].op, op))
            return &op_specs[i];
    cr_assert_fail("no spec for %s", op);
    return NULL;
}

/* The valid call of op with sizes d instead: refused with want. */
static void refused_sizes(backend_t *be, const char *op, const int *d, const char *want)
{
    const op_spec *s = spec_of(op);
    arena a;
    arena_make(&a, be, s);
    tensor_t t[10];
    for (int i = 0; i < s->nt; i++)
        t[i] = arena_arg(&a, s, i);
    refused(&a, s, t, d, want);
    arena_free(&a);
}

/* The rules of single ops, and the ops outside the table's pattern. */
static int check_rules(backend_t *be)
{
    int cases = 0;
    /* matmul: the product does not fit in C */
    {
        const op_spec *s = spec_of("matmul");
        arena a;
        arena_make(&a, be, s);
        tensor_t t[3] = {tensor_view(a.parent[0], GUARD, 12), arena_arg(&a, s, 1),
                         arena_arg(&a, s, 2)};
        refused(&a, s, t, s->d, "matmul: C has 12 elements, M x N = 16");
        /* K = 0: C = beta C, A and B are not read (may be absent) */
        t[0] = arena_arg(&a, s, 0);
        t[1] = t[2] = (tensor_t){NULL, 0, DT_F32};
        int d0[3] = {4, 4, 0};
        s->call(be, t, d0);
        expect_accepted(be, "matmul with K = 0 and no A, B");
        arena_free(&a);
        cases++;
    }
    /* attention: positive sizes, nh a multiple of nkv */
    for (int bwd = 0; bwd < 2; bwd++) {
        const char *op = bwd ? "attention_backward" : "attention_forward";
        char want[200];
        int d1[5] = {1, 3, 2, 0, 4}, d2[5] = {1, 3, 3, 2, 4}, d3[5] = {0, 3, 2, 1, 4};
        snprintf(want, sizeof want, "%s: nkv = 0, must be positive", op);
        refused_sizes(be, op, d1, want);
        snprintf(want, sizeof want, "%s: nh = 3 is not a multiple of nkv = 2", op);
        refused_sizes(be, op, d2, want);
        snprintf(want, sizeof want, "%s: B = 0, must be positive", op);
        refused_sizes(be, op, d3, want);
        cases += 3;
    }
    /* SwiGLU: the row stride of g and u is their width at least */
    for (int bwd = 0; bwd < 2; bwd++) {
        const char *op = bwd ? "swiglu_backward" : "swiglu_forward";
        char want[200];
        int d[3] = {2, 5, 4};
        snprintf(want, sizeof want, "%s: ld = 4 must be at least cols = 5", op);
        refused_sizes(be, op, d, want);
        cases++;
    }
    /* rope: rotate-half needs an even head dimension */
    {
        int d[4] = {1, 3, 2, 3};
        refused_sizes(be, "rope", d,
                      "rope: hd = 3 is odd (rotate-half pairs element i with i + hd/2)");
        cases++;
    }
    /* rope between strided matrices: strides of a row at least, x and src
     * apart or the same; past x's end */
    {
        /* B 1, T 3, nh 2, hd 4: rows of 8; x [3, 10], src a block of [3, 12] */
        tensor_t x = be_alloc(be, DT_F32, 28), src = be_alloc(be, DT_F32, 36);
        tensor_t cs = be_alloc(be, DT_F32, 6), sn = be_alloc(be, DT_F32, 6), none = {0};
        be_rope_ld(be, x, src, cs, sn, none, 1, 3, 2, 4, 0, 7, 12);
        expect_refused(be, "rope: x_ld = 7 and src_ld = 12 must be at least nh x hd = 8",
                       "rope with a row stride below the width");
        be_rope_ld(be, x, tensor_view(x, 2, 26), cs, sn, none, 1, 3, 2, 4, 0, 10, 9);
        expect_refused(be, "rope: x and src overlap without being the same tensor at the same "
                           "stride",
                       "rope from an overlapping view");
        be_rope_ld(be, tensor_view(x, 0, 27), src, cs, sn, none, 1, 3, 2, 4, 0, 10, 12);
        expect_refused(be, "rope: x has 27 elements, (B x T - 1) x ld + nh x hd = 28",
                       "rope past x's end");
        be_rope_ld(be, x, src, cs, sn, none, 1, 3, 2, 4, 0, 10, 12);
        expect_accepted(be, "rope between strided matrices");
        be_free(be, &x), be_free(be, &src), be_free(be, &cs), be_free(be, &sn);
        cases += 4;
    }
    /* dropout: p below 1 */
    {
        tensor_t x = be_alloc(be, DT_F32, N_ELEM), y = be_alloc(be, DT_F32, N_ELEM);
        be_dropout(be, y, x, N_ELEM, 1.0f, 7, (tensor_t){0}, 0);
        expect_refused(be, "dropout: p = 1, must be below 1", "dropout with p = 1");
        /* a device seed is one 64-bit value: 8-byte aligned */
        tensor_t sd = be_alloc(be, DT_I32, 4);
        be_dropout(be, y, x, N_ELEM, 0.5f, 7, tensor_view(sd, 1, 2), 0);
        expect_refused(be, "dropout: seed_dev is not 8-byte aligned",
                       "dropout with a misaligned device seed");
        be_dropout(be, y, x, N_ELEM, 0.5f, 7, tensor_view(sd, 2, 2), 0);
        expect_accepted(be, "dropout with an aligned device seed");
        be_free(be, &sd);
        be_free(be, &x);
        be_free(be, &y);
        cases += 3;
    }
    /* adamw: its hyperparameters */
    {
        tensor_t p = be_alloc(be, DT_F32, N_ELEM);
        be_adamw(be, p, (tensor_t){NULL, 0, DT_F32}, p, p, p, N_ELEM, NULL);
        expect_refused(be, "adamw: a (the hyperparameters) is NULL", "adamw without a");
        be_free(be, &p);
        cases++;
    }
    /* copy, zero, the host copies, alloc */
    {
        tensor_t f = be_alloc(be, DT_F32, N_ELEM), i = be_alloc(be, DT_I32, N_ELEM);
        tensor_t none = {NULL, N_ELEM, DT_F32};
        be_copy(be, f, tensor_view(f, 0, N_ELEM - 1));
        expect_refused(be, "copy: dst has 10 elements, src has 9", "copy of 9 into 10");
        be_copy(be, none, f);
        expect_refused(be, "copy: dst is not allocated", "copy into nothing");
        be_copy(be, f, none);
        expect_refused(be, "copy: src is not allocated", "copy from nothing");
        be_copy(be, f, i);
        expect_refused(be, "copy: from I32 to F32: only F32, BF16 and F16 convert",
                       "copy from I32 to F32");
        be_copy2d(be, f, f, 2, 5, 4, 5);
        expect_refused(be, "copy2d: dst_ld = 4 and src_ld = 5 must be at least cols = 5",
                       "copy2d with a row stride below the width");
        be_copy2d(be, tensor_view(f, 0, 8), f, 2, 3, 6, 5);
        expect_refused(be, "copy2d: dst has 8 elements, (rows-1) x dst_ld + cols = 9",
                       "copy2d past dst's end");
        be_copy2d(be, f, i, 2, 3, 5, 5);
        expect_refused(be, "copy2d: src has dtype I32, not a float dtype", "copy2d from I32");
        tensor_t g = be_alloc(be, DT_F32, N_ELEM);
        be_matmul_into(be, f, f, f, tensor_view(g, 0, 3), 2, 2, 2, 0, 0, 1.0f, 1.0f);
        expect_refused(be, "matmul: C has 3 elements, M x N = 4", "matmul into D from a short C");
        be_matmul_into(be, f, f, f, i, 2, 2, 2, 0, 0, 1.0f, 1.0f);
        expect_refused(be, "matmul: C has dtype I32, not a float dtype",
                       "matmul into D from an I32 C");
        be_free(be, &g);
        be_matmul_ld(be, f, f, f, 2, 2, 2, 0, 0, 1.0f, 0.0f, 1, 2, 2);
        expect_refused(be,
                       "matmul: lda = 1, ldb = 2, ldc = 2 must be at least the stored widths 2, "
                       "2, 2",
                       "matmul with a row stride below A's width");
        be_matmul_ld(be, f, f, f, 2, 2, 3, 1, 1, 1.0f, 0.0f, 2, 3, 1);
        expect_refused(be,
                       "matmul: lda = 2, ldb = 3, ldc = 1 must be at least the stored widths 2, "
                       "3, 2",
                       "matmul with a row stride below C's width");
        be_matmul_ld(be, tensor_view(f, 0, 8), f, f, 2, 3, 2, 0, 0, 1.0f, 0.0f, 2, 3, 6);
        expect_refused(be, "matmul: C has 8 elements, (M-1) x ldc + N = 9",
                       "matmul past C's end");
        be_matmul_ld(be, f, tensor_view(f, 0, 6), f, 2, 2, 3, 1, 0, 1.0f, 0.0f, 4, 2, 2);
        expect_refused(be, "matmul: A has 6 elements, (rows-1) x lda + cols = 10",
                       "matmul past A's end (transposed)");
        be_zero(be, none);
        expect_refused(be, "zero: t is not allocated", "zero of nothing");
        float host[N_ELEM];
        be_h2d(be, NULL, host, sizeof host);
        expect_refused(be, "h2d: dst is NULL (40 bytes)", "h2d to NULL");
        be_d2h(be, host, NULL, sizeof host);
        expect_refused(be, "d2h: src is NULL (40 bytes)", "d2h from NULL");
        tensor_t bad = be_alloc(be, (dtype_t)9, 4);
        expect_refused(be, "alloc: dtype 9 is not a dtype", "alloc of dtype 9");
        cr_expect_null(bad.p);
        be_free(be, &f);
        be_free(be, &i);
        cases += 11;
    }
    return cases;
}

int op_checks_run(backend_t *be)
{
    int cases = 0;
    for (size_t i = 0; i < op_spec_count; i++)
        cases += check_op(be, &op_specs[i]);
    cases += check_rules(be);
    return cases;
}

void op_checks_ids_outside(backend_t *be)
{
    const int n = 3, H = 4, vocab = 5, V = 5;
    int32_t ids[3] = {1, 99, -1};
    float table[20], got[12];
    for (int i = 0; i < vocab * H; i++)
        table[i] = (float)(i + 1);
    tensor_t tt = be_alloc(be, DT_F32, (size_t)vocab * H), ti = be_alloc(be, DT_I32, (size_t)n);
    tensor_t to = be_alloc(be, DT_F32, (size_t)n * H);
    be_upload(be, tt, table, DT_F32);
    be_upload(be, ti, ids, DT_I32);
    be_fill_uniform(be, to, to.n, 9.0f, 9.0f, 0, 0);
    be_embedding_forward(be, to, tt, ti, n, H);
    be_download(be, got, DT_F32, to);
    for (int c = 0; c < H; c++) {
        cr_expect_eq(got[c], table[H + c], "%s: row of id 1", be->name);
        cr_expect_eq(got[H + c], 0.0f, "%s: the row of id 99 (outside) is not zero", be->name);
        cr_expect_eq(got[2 * H + c], 0.0f, "%s: the row of id -1 is not zero", be->name);
    }
    /* the gradient: only id 1's row gets one */
    be_zero(be, tt);
    be_fill_uniform(be, to, to.n, 1.0f, 1.0f, 0, 0);
    tensor_t order, runs;
    op_embedding_order(be, ids, n, &order, &runs);
    be_embedding_backward(be, tt, to, ti, order, runs, n, H);
    be_free(be, &order);
    be_free(be, &runs);
    be_download(be, table, DT_F32, tt);
    for (int i = 0; i < vocab * H; i++)
        cr_expect_eq(table[i], i / H == 1 ? 1.0f : 0.0f, "%s: dtable[%d] = %g", be->name, i,
                     (double)table[i]);

    /* targets V and -1 ignore their rows: loss 0, dlogits 0 */
    int32_t targets[3] = {2, V, -1};
    float loss[3], dl[15];
    tensor_t tl = be_alloc(be, DT_F32, 15), tloss = be_alloc(be, DT_F32, 3);
    tensor_t tg = be_alloc(be, DT_I32, 3);
    be_fill_uniform(be, tl, 15, 0.5f, 0.5f, 0, 0);
    be_upload(be, tg, targets, DT_I32);
    be_cross_entropy(be, tl, tloss, tg, 3, V, 1.0f, (tensor_t){0});
    be_download(be, loss, DT_F32, tloss);
    be_download(be, dl, DT_F32, tl);
    cr_expect_gt(loss[0], 1.6f, "%s: loss of a uniform row over 5 (ln 5)", be->name);
    cr_expect_lt(loss[0], 1.62f, "%s: loss of a uniform row over 5 (ln 5)", be->name);
    for (int r = 1; r < 3; r++) {
        cr_expect_eq(loss[r], 0.0f, "%s: loss of ignored row %d", be->name, r);
        for (int v = 0; v < V; v++)
            cr_expect_eq(dl[r * V + v], 0.0f, "%s: dlogits of ignored row %d", be->name, r);
    }
    sp_err err = {0};
    cr_expect_eq(be_check(be, &err), 0, "%s", err.msg);
    be_free(be, &tt), be_free(be, &ti), be_free(be, &to);
    be_free(be, &tl), be_free(be, &tloss), be_free(be, &tg);
}
