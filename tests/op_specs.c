/* The ops' descriptions and guarded tensors of the op suites (op_specs.h). */
#include "op_specs.h"

#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

/* ---- the ops, called with tensors t[] and sizes d[] ----------------------------------- */

static void c_matmul(backend_t *be, const tensor_t *t, const int *d)
{
    be_matmul(be, t[0], t[1], t[2], d[0], d[1], d[2], 0, 0, 1.0f, 0.0f);
}
/* batch products M x K by K x N stored one after another */
static void c_matmul_batched(backend_t *be, const tensor_t *t, const int *d)
{
    be_matmul_batched(be, t[0], t[1], t[2], d[0], d[1], d[2], 0, 0, 1.0f, 0.0f, d[2], d[1], d[1],
                      d[3], (size_t)(d[0] > 0 && d[2] > 0 ? d[0] * d[2] : 0),
                      (size_t)(d[2] > 0 && d[1] > 0 ? d[2] * d[1] : 0),
                      (size_t)(d[0] > 0 && d[1] > 0 ? d[0] * d[1] : 0));
}
static void c_rmsnorm_forward(backend_t *be, const tensor_t *t, const int *d)
{
    be_rmsnorm_forward(be, t[0], t[1], t[2], t[3], d[0], d[1], 1e-5f);
}
static void c_rmsnorm_backward(backend_t *be, const tensor_t *t, const int *d)
{
    be_rmsnorm_backward(be, t[0], t[1], t[2], t[3], t[4], t[5], d[0], d[1]);
}
static void c_rope(backend_t *be, const tensor_t *t, const int *d)
{
    be_rope(be, t[0], t[1], t[2], t[3], d[0], d[1], d[2], d[3], 0);
}
static void c_attention_forward(backend_t *be, const tensor_t *t, const int *d)
{
    be_attention_forward(be, t[0], t[1], t[2], t[3], t[4], t[5], d[0], d[1], d[2], d[3], d[4]);
}
static void c_attention_backward(backend_t *be, const tensor_t *t, const int *d)
{
    be_attention_backward(be, t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7], t[8], t[9], d[0],
                          d[1], d[2], d[3], d[4]);
}
/* the same with row strides (q/k/v as column blocks: backend.h) */
static void c_attention_forward_ld(backend_t *be, const tensor_t *t, const int *d)
{
    be_attention_forward_ld(be, t[0], t[1], t[2], t[3], t[4], t[5], d[0], d[1], d[2], d[3], d[4],
                            d[5], d[6]);
}
static void c_attention_backward_ld(backend_t *be, const tensor_t *t, const int *d)
{
    be_attention_backward_ld(be, t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7], t[8], t[9], d[0],
                             d[1], d[2], d[3], d[4], d[5], d[6], d[7], d[8]);
}
static void c_swiglu_forward(backend_t *be, const tensor_t *t, const int *d)
{
    be_swiglu_forward(be, t[0], t[1], t[2], d[0], d[1], d[2]);
}
static void c_swiglu_backward(backend_t *be, const tensor_t *t, const int *d)
{
    be_swiglu_backward(be, t[0], t[1], t[2], t[3], t[4], d[0], d[1], d[2]);
}
static void c_embedding_forward(backend_t *be, const tensor_t *t, const int *d)
{
    be_embedding_forward(be, t[0], t[1], t[2], d[0], d[1]);
}
static void c_embedding_backward(backend_t *be, const tensor_t *t, const int *d)
{
    be_embedding_backward(be, t[0], t[1], t[2], t[3], t[4], d[0], d[1]);
}
static void c_cross_entropy(backend_t *be, const tensor_t *t, const int *d)
{
    be_cross_entropy(be, t[0], t[1], t[2], d[0], d[1], 1.0f, t[3]);
}
static void c_add(backend_t *be, const tensor_t *t, const int *d)
{
    (void)d;
    be_add(be, t[0], t[1], 0.5f, N_ELEM);
}
static void c_add_bias(backend_t *be, const tensor_t *t, const int *d)
{
    be_add_bias(be, t[0], t[1], d[0], d[1]);
}
static void c_bias_backward(backend_t *be, const tensor_t *t, const int *d)
{
    be_bias_backward(be, t[0], t[1], d[0], d[1]);
}
static void c_weight_norm(backend_t *be, const tensor_t *t, const int *d)
{
    be_weight_norm(be, t[0], t[1], t[2], t[3], 0.5f, d[0], d[1], d[2]);
}
static void c_dequant_nf4(backend_t *be, const tensor_t *t, const int *d)
{
    (void)d;
    be_dequant_nf4(be, t[0], t[1], t[2], t[3], t[4], 0.5f, N_ELEM);
}
static void c_quantize_nf4(backend_t *be, const tensor_t *t, const int *d)
{
    (void)d;
    be_quantize_nf4(be, t[0], t[1], t[2], t[3], N_ELEM);
}
static void c_col_scale(backend_t *be, const tensor_t *t, const int *d)
{
    be_col_scale(be, t[0], t[1], t[2], d[0], d[1]);
}
static void c_col_dot(backend_t *be, const tensor_t *t, const int *d)
{
    be_col_dot(be, t[0], t[1], t[2], t[3], d[0], d[1]);
}
static void c_dropout(backend_t *be, const tensor_t *t, const int *d)
{
    (void)d;
    be_dropout(be, t[0], t[1], N_ELEM, 0.5f, 7, t[2], 0);
}
static void c_sumsq(backend_t *be, const tensor_t *t, const int *d)
{
    (void)d;
    be_sumsq(be, t[0], N_ELEM);
}
static void c_adamw(backend_t *be, const tensor_t *t, const int *d)
{
    (void)d;
    adamw_args a = {.lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f,
                    .weight_decay = 0.01f, .grad_scale = 1.0f, .step = 1};
    be_adamw(be, t[0], t[1], t[2], t[3], t[4], N_ELEM, &a);
}
/* the values in device memory: the learning rate, bias corrections, the
 * gradient's sum of squares (F32 [2] holding a double) */
static void c_adamw_dev(backend_t *be, const tensor_t *t, const int *d)
{
    (void)d;
    adamw_args a = {.beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .weight_decay = 0.01f,
                    .hyper = t[5], .sumsq = t[6], .max_norm = 1.0};
    be_adamw(be, t[0], t[1], t[2], t[3], t[4], N_ELEM, &a);
}
static void c_sumsq_into(backend_t *be, const tensor_t *t, const int *d)
{
    (void)d;
    be_sumsq_into(be, t[0], t[1], N_ELEM);
}
static void c_sum_add(backend_t *be, const tensor_t *t, const int *d)
{
    (void)d;
    be_sum_add(be, t[0], t[1], N_ELEM);
}
static void c_fill_uniform(backend_t *be, const tensor_t *t, const int *d)
{
    (void)d;
    be_fill_uniform(be, t[0], N_ELEM, -1.0f, 1.0f, 3, 0);
}
static void c_fill_normal(backend_t *be, const tensor_t *t, const int *d)
{
    (void)d;
    be_fill_normal(be, t[0], N_ELEM, 0.0f, 1.0f, 3, 0);
}

/* ---- the ops' arguments --------------------------------------------------------------- */

#define SW_LD "(rows-1) x ld + cols"
#define ATT_LD "(B x T - 1) x ld + heads x hd"

const op_spec op_specs[] = {
    {"matmul", c_matmul, 3,
     {T_("C", 16, "M x N", TAKES_FLOAT), T_("A", 12, "M x K", TAKES_FLOAT),
      T_("B", 12, "K x N", TAKES_FLOAT)},
     3, {"M", "N", "K"}, {4, 4, 3}},
    {"matmul_batched", c_matmul_batched, 3,
     {T_("C", 18, "(batch-1) x sc + M x N", TAKES_FLOAT),
      T_("A", 12, "(batch-1) x sa + M x K", TAKES_FLOAT),
      T_("B", 18, "(batch-1) x sb + K x N", TAKES_FLOAT)},
     4, {"M", "N", "K", "batch"}, {2, 3, 2, 3}},
    {"rmsnorm_forward", c_rmsnorm_forward, 4,
     {T_("out", 12, "rows x cols", TAKES_FLOAT), T_("rstd", 3, "rows", TAKES_F32),
      T_("x", 12, "rows x cols", TAKES_FLOAT), T_("w", 4, "cols", TAKES_FLOAT)},
     2, {"rows", "cols"}, {3, 4}},
    {"rmsnorm_backward", c_rmsnorm_backward, 6,
     {T_("dx", 12, "rows x cols", TAKES_FLOAT), {"dw", 4, 4, "cols", TAKES_F32, 1},
      T_("dout", 12, "rows x cols", TAKES_FLOAT), T_("x", 12, "rows x cols", TAKES_FLOAT),
      T_("w", 4, "cols", TAKES_FLOAT), T_("rstd", 3, "rows", TAKES_F32)},
     2, {"rows", "cols"}, {3, 4}},
    {"rope", c_rope, 4,
     {T_("x", 24, "B x T x nh x hd", TAKES_FLOAT), T_("cos", 6, "T x hd/2", TAKES_F32),
      T_("sin", 6, "T x hd/2", TAKES_F32), {"pos", 3, 3, "B x T", TAKES_I32, 1}},
     4, {"B", "T", "nh", "hd"}, {1, 3, 2, 4}},
    {"attention_forward", c_attention_forward, 6,
     {T_("out", 24, "B x T x nh x hd", TAKES_FLOAT), T_("lse", 6, "B x nh x T", TAKES_F32),
      T_("q", 24, "B x T x nh x hd", TAKES_FLOAT), T_("k", 12, "B x T x nkv x hd", TAKES_FLOAT),
      T_("v", 12, "B x T x nkv x hd", TAKES_FLOAT), {"seg", 3, 3, "B x T", TAKES_I32, 1}},
     5, {"B", "T", "nh", "nkv", "hd"}, {1, 3, 2, 1, 4}},
    {"attention_backward", c_attention_backward, 10,
     {T_("dq", 24, "B x T x nh x hd", TAKES_FLOAT), T_("dk", 12, "B x T x nkv x hd", TAKES_FLOAT),
      T_("dv", 12, "B x T x nkv x hd", TAKES_FLOAT),
      T_("dout", 24, "B x T x nh x hd", TAKES_FLOAT),
      T_("out", 24, "B x T x nh x hd", TAKES_FLOAT), T_("lse", 6, "B x nh x T", TAKES_F32),
      T_("q", 24, "B x T x nh x hd", TAKES_FLOAT), T_("k", 12, "B x T x nkv x hd", TAKES_FLOAT),
      T_("v", 12, "B x T x nkv x hd", TAKES_FLOAT), {"seg", 3, 3, "B x T", TAKES_I32, 1}},
     5, {"B", "T", "nh", "nkv", "hd"}, {1, 3, 2, 1, 4}},
    /* with row strides: q (dq) 10 and k, v (dk, dv) 6, so (3 - 1) 10 + 8
     * and (3 - 1) 6 + 4 elements */
    {"attention_forward", c_attention_forward_ld, 6,
     {T_("out", 24, "B x T x nh x hd", TAKES_FLOAT), T_("lse", 6, "B x nh x T", TAKES_F32),
      T_("q", 28, ATT_LD, TAKES_FLOAT), T_("k", 16, ATT_LD, TAKES_FLOAT),
      T_("v", 16, ATT_LD, TAKES_FLOAT), {"seg", 3, 3, "B x T", TAKES_I32, 1}},
     7, {"B", "T", "nh", "nkv", "hd", "q_ld", "kv_ld"}, {1, 3, 2, 1, 4, 10, 6}},
    {"attention_backward", c_attention_backward_ld, 10,
     {T_("dq", 28, ATT_LD, TAKES_FLOAT), T_("dk", 16, ATT_LD, TAKES_FLOAT),
      T_("dv", 16, ATT_LD, TAKES_FLOAT), T_("dout", 24, "B x T x nh x hd", TAKES_FLOAT),
      T_("out", 24, "B x T x nh x hd", TAKES_FLOAT), T_("lse", 6, "B x nh x T", TAKES_F32),
      T_("q", 28, ATT_LD, TAKES_FLOAT), T_("k", 16, ATT_LD, TAKES_FLOAT),
      T_("v", 16, ATT_LD, TAKES_FLOAT), {"seg", 3, 3, "B x T", TAKES_I32, 1}},
     9, {"B", "T", "nh", "nkv", "hd", "q_ld", "kv_ld", "dq_ld", "dkv_ld"},
     {1, 3, 2, 1, 4, 10, 6, 10, 6}},
    /* g, u (dg, du) [2, 5] with row stride 7: 12 elements; out, dout 10 */
    {"swiglu_forward", c_swiglu_forward, 3,
     {T_("out", 10, "rows x cols", TAKES_FLOAT), T_("g", 12, SW_LD, TAKES_FLOAT),
      T_("u", 12, SW_LD, TAKES_FLOAT)},
     3, {"rows", "cols", "ld"}, {2, 5, 7}},
    {"swiglu_backward", c_swiglu_backward, 5,
     {T_("dg", 12, SW_LD, TAKES_FLOAT), T_("du", 12, SW_LD, TAKES_FLOAT),
      T_("dout", 10, "rows x cols", TAKES_FLOAT), T_("g", 12, SW_LD, TAKES_FLOAT),
      T_("u", 12, SW_LD, TAKES_FLOAT)},
     3, {"rows", "cols", "ld"}, {2, 5, 7}},
    /* the table: 5 rows of H, of which the op needs one at least */
    {"embedding_forward", c_embedding_forward, 3,
     {T_("out", 12, "n x H", TAKES_FLOAT), {"table", 20, 4, "H", TAKES_FLOAT, 0},
      T_("tokens", 3, "n", TAKES_I32)},
     2, {"n", "H"}, {3, 4}},
    /* ids 0 (order and runs as embedding_order makes them: zeros, a run of
     * length 0 at each of 0 ids) */
    {"embedding_backward", c_embedding_backward, 5,
     {{"dtable", 20, 4, "H", TAKES_F32, 0}, T_("dout", 12, "n x H", TAKES_FLOAT),
      T_("tokens", 3, "n", TAKES_I32), T_("order", 3, "n", TAKES_I32),
      T_("runs", 5, "n + 2", TAKES_I32)},
     2, {"n", "H"}, {3, 4}},
    {"cross_entropy", c_cross_entropy, 4,
     {T_("logits", 15, "rows x V", TAKES_FLOAT), T_("loss", 3, "rows", TAKES_F32),
      T_("targets", 3, "rows", TAKES_I32), {"scale", 1, 1, "1", TAKES_F32, 1}},
     2, {"rows", "V"}, {3, 5}},
    {"add", c_add, 2, {T_("y", E_, "n", TAKES_FLOAT), T_("x", E_, "n", TAKES_FLOAT)}, 0, {NULL},
     {0}},
    {"add_bias", c_add_bias, 2,
     {T_("y", 12, "rows x cols", TAKES_FLOAT), T_("b", 4, "cols", TAKES_FLOAT)}, 2,
     {"rows", "cols"}, {3, 4}},
    {"bias_backward", c_bias_backward, 2,
     {T_("db", 4, "cols", TAKES_F32), T_("dy", 12, "rows x cols", TAKES_FLOAT)}, 2,
     {"rows", "cols"}, {3, 4}},
    {"weight_norm", c_weight_norm, 4,
     {T_("n", 3, "out", TAKES_F32), T_("W", 12, "out x in", TAKES_FLOAT),
      T_("A", 8, "r x in", TAKES_FLOAT), T_("B", 6, "out x r", TAKES_FLOAT)},
     3, {"out", "in", "r"}, {3, 4, 2}},
    {"col_scale", c_col_scale, 3,
     {T_("y", 12, "rows x cols", TAKES_FLOAT), T_("num", 4, "cols", TAKES_FLOAT),
      T_("den", 4, "cols", TAKES_F32)},
     2, {"rows", "cols"}, {3, 4}},
    {"col_dot", c_col_dot, 4,
     {T_("out", 4, "cols", TAKES_F32), T_("x", 12, "rows x cols", TAKES_FLOAT),
      T_("y", 12, "rows x cols", TAKES_FLOAT), T_("den", 4, "cols", TAKES_F32)},
     2, {"rows", "cols"}, {3, 4}},
    /* n = 10: 5 bytes of codes, one block of absmax, one nested block */
    {"dequant_nf4", c_dequant_nf4, 5,
     {T_("out", E_, "n", TAKES_FLOAT), T_("codes", 5, "(n+1)/2", TAKES_U8),
      T_("absmax", 1, "ceil(n/64)", TAKES_U8), T_("nested", 1, "ceil(n/16384)", TAKES_F32),
      T_("maps", 272, "16 + 256", TAKES_F32)},
     0, {NULL}, {0}},
    {"quantize_nf4", c_quantize_nf4, 4,
     {T_("codes", 5, "(n+1)/2", TAKES_U8), T_("absmax", 1, "ceil(n/64)", TAKES_F32),
      T_("x", E_, "n", TAKES_FLOAT), T_("maps", 272, "16 + 256", TAKES_F32)},
     0, {NULL}, {0}},
    {"dropout", c_dropout, 3,
     {T_("out", E_, "n", TAKES_FLOAT), T_("in", E_, "n", TAKES_FLOAT),
      {"seed_dev", 2, 2, "2 (a 64-bit seed)", TAKES_I32, 1}},
     0, {NULL}, {0}},
    {"sumsq", c_sumsq, 1, {T_("x", E_, "n", TAKES_FLOAT)}, 0, {NULL}, {0}},
    {"adamw", c_adamw, 5,
     {T_("param", E_, "n", TAKES_F32), {"param_copy", E_, E_, "n", TAKES_FLOAT, 1},
      T_("grad", E_, "n", TAKES_F32), T_("m", E_, "n", TAKES_F32), T_("v", E_, "n", TAKES_F32)},
     0, {NULL}, {0}},
    {"adamw", c_adamw_dev, 7,
     {T_("param", E_, "n", TAKES_F32), {"param_copy", E_, E_, "n", TAKES_FLOAT, 1},
      T_("grad", E_, "n", TAKES_F32), T_("m", E_, "n", TAKES_F32), T_("v", E_, "n", TAKES_F32),
      T_("a->hyper", 3, "3 (lr and the bias corrections)", TAKES_F32),
      T_("a->sumsq", 2, "2 (a double)", TAKES_F32)},
     0, {NULL}, {0}},
    {"sumsq_into", c_sumsq_into, 2,
     {T_("out", 2, "2 (a double)", TAKES_F32), T_("x", E_, "n", TAKES_FLOAT)}, 0, {NULL}, {0}},
    {"sum_add", c_sum_add, 2,
     {T_("acc", 2, "2 (a double)", TAKES_F32), T_("x", E_, "n", TAKES_F32)}, 0, {NULL}, {0}},
    {"fill_uniform", c_fill_uniform, 1, {T_("x", E_, "n", TAKES_FLOAT)}, 0, {NULL}, {0}},
    {"fill_normal", c_fill_normal, 1, {T_("x", E_, "n", TAKES_FLOAT)}, 0, {NULL}, {0}},
};

const size_t op_spec_count = sizeof op_specs / sizeof op_specs[0];
const char op_specs_file[] = __FILE__;

void op_embedding_order(backend_t *be, const int32_t *tok, int n, tensor_t *order,
                        tensor_t *runs)
{
    int32_t *h = malloc(sizeof *h * (2 * (size_t)n + 2));
    cr_assert(h && embedding_order(tok, n, h, h + n) == 0);
    *order = be_alloc(be, DT_I32, (size_t)n);
    *runs = be_alloc(be, DT_I32, (size_t)n + 2);
    be_upload(be, *order, h, DT_I32);
    be_upload(be, *runs, h + n, DT_I32);
    free(h);
}

/* ---- guarded tensors ------------------------------------------------------------------ */



void arena_make(arena *a, backend_t *be, const op_spec *s)
{
    memset(a, 0, sizeof *a);
    a->be = be;
    a->n = s->nt;
    for (int i = 0; i < s->nt; i++) {
        const targ *t = &s->t[i];
        dtype_t dt = t->takes == TAKES_I32 ? DT_I32 : t->takes == TAKES_U8 ? DT_U8 : DT_F32;
        size_t n = t->n + 2 * GUARD;
        a->parent[i] = be_alloc(be, dt, n);
        cr_assert(a->parent[i].p, "%s: allocating %s", s->op, t->name);
        a->esz[i] = dtype_size(dt);
        a->bytes[i] = n * a->esz[i];
        a->image[i] = malloc(a->bytes[i]);
        cr_assert(a->image[i]);
        memset(a->image[i], 0, a->bytes[i]); /* ids, codes */
        for (size_t j = 0; j < n && dt == DT_F32; j++) {
            float f = FILL;
            memcpy(a->image[i] + 4 * j, &f, 4);
        }
    }
}

/* Every allocation back to its image. */
void arena_reset(arena *a)
{
    for (int i = 0; i < a->n; i++)
        be_h2d(a->be, a->parent[i].p, a->image[i], a->bytes[i]);
}

/* The view of argument i the valid call passes. */
tensor_t arena_arg(const arena *a, const op_spec *s, int i)
{
    return tensor_view(a->parent[i], GUARD, s->t[i].n);
}

/* Elements [lo, hi) of allocation i are as they were. */
int arena_same(const arena *a, int i, size_t lo, size_t hi, const char *what)
{
    unsigned char *now = malloc(a->bytes[i]);
    cr_assert(now);
    be_d2h(a->be, now, a->parent[i].p, a->bytes[i]);
    size_t e = a->esz[i];
    int same = memcmp(now + e * lo, a->image[i] + e * lo, e * (hi - lo)) == 0;
    free(now);
    cr_expect(same, "%s: memory changed", what);
    return same;
}

void arena_free(arena *a)
{
    for (int i = 0; i < a->n; i++) {
        be_free(a->be, &a->parent[i]);
        free(a->image[i]);
    }
}
