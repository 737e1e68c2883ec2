/* kernels/cuda/dev/elem_bench.c — the elementwise workbench (not part of
 * the trainer): both versions of the CUDA backend's hot elementwise ops on
 * the same random inputs, each checked against the CPU backend and timed
 * with CUDA events, one table row per (shape, op, version).
 *
 * Ops: add, add_bias, swiglu_fwd, swiglu_bwd, dropout, rmsnorm_fwd,
 * rmsnorm_bwd (dx; no dw, as for a frozen norm), rope (hd 128 where it
 * divides the columns, else 10), adamw (F32 master and moments, a
 * compute copy in the activation dtype), and the strided forms the fused
 * products use: swiglu_gu (gate and up the column halves of one
 * [rows, 2 cols] matrix) and rope_ld (out of its first column block), and
 * dequant_nf4 (QLoRA: the shape as a weight quantized to NF4 on the host,
 * dequantized into the activation dtype). Versions: "scalar" (cuda_ops.cu, one element a thread
 * step) and "vector" (cuda_vec.cu, 16-byte loads and stores), chosen
 * through SPOTUNE_CUDA_ELEMENTWISE as the backend reads it on every call.
 * On a shape the vector path declines (columns not a multiple of 8, an
 * RMSNorm row over 46 KiB of shared memory) the scalar kernel runs and the
 * row says "fallback".
 *
 * Check: each output within 1e-2 of the CPU's largest value (bf16; 1e-4
 * for rstd, 1e-6 for AdamW's F32 state: the tolerances of
 * tests/test_cuda_ops.c), and the vector version's outputs bit for bit the
 * scalar version's (column "= scalar").
 *
 * usage: elem_bench [--shape ROWS,COLS]... [--iters N] [--no-check]
 * Without --shape: 2048 x 4096 and 2048 x 11008 (the 7B hidden and FFN
 * widths at 2048 tokens) and the odd 1031 x 4103. See README.md. */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_util.h"
#include "kernels/backend.h"
#include "kernels/nf4.h"

#define TOL_BF16 1e-2
#define TOL_F32 1e-4
#define TOL_ADAMW 1e-6
#define NO_CPU -1.0 /* an output the CPU run does not have (AdamW's copy) */
#define MAX_SHAPES 16
#define MAX_OUT 4
#define MAX_T 10
#define VEC_ROW_SMEM 47104 /* cuda_vec.cu's */

enum {
    ADD,
    ADD_BIAS,
    SWIGLU_FWD,
    SWIGLU_BWD,
    DROPOUT,
    RMSNORM_FWD,
    RMSNORM_BWD,
    ROPE,
    ADAMW,
    SWIGLU_GU, /* swiglu_fwd on the two column halves of one [rows, 2 cols] matrix */
    ROPE_LD,   /* rope out of the first column block of [rows, 2 cols] */
    DEQUANT,   /* dequant_nf4 (QLoRA) of a rows x cols weight quantized on the host */
    NOPS
};

static const char *op_names[NOPS] = {"add",         "add_bias",  "swiglu_fwd",  "swiglu_bwd",
                                     "dropout",     "rmsnorm_fwd", "rmsnorm_bwd", "rope",
                                     "adamw",       "swiglu_gu",  "rope_ld",     "dequant_nf4"};

typedef struct shape {
    int rows, cols;
} shape;

typedef struct opts {
    shape shapes[MAX_SHAPES];
    int nshapes, iters, check;
} opts;

/* The host inputs of one shape (bf16-rounded floats): four of rows x cols,
 * one of cols. */
typedef struct inputs {
    float *a, *b, *c, *d, *w;
} inputs;

/* The tensors of one op on one backend; out[] are views of t[]. */
typedef struct op_set {
    backend_t *be;
    int op;
    shape s;
    tensor_t t[MAX_T];
    int nt;
    tensor_t out[MAX_OUT];
    double tol[MAX_OUT];
    int nout;
    float nf4_offset; /* DEQUANT: the absmax offset */
} op_set;

static int fail_be(backend_t *be, const char *what)
{
    return bench_fail_be("elem_bench", be, what);
}

static int rope_hd(int cols)
{
    return cols % 128 == 0 ? 128 : 10;
}

/* A tensor of n elements on r->be holding h (NULL: zeros). */
static tensor_t put(op_set *r, dtype_t dt, const float *h, size_t n)
{
    tensor_t t = be_alloc(r->be, dt, n);
    if (r->nt < MAX_T)
        r->t[r->nt++] = t;
    if (h && t.p)
        be_upload(r->be, t, h, DT_F32);
    return t;
}

static void output(op_set *r, tensor_t t, double tol)
{
    r->out[r->nout] = t;
    r->tol[r->nout++] = tol;
}

static void free_set(op_set *r)
{
    for (int i = 0; i < r->nt; i++)
        if (r->t[i].p)
            be_free(r->be, &r->t[i]);
    r->nt = 0;
}

/* The tensors of r->op on r->be from the inputs (activations in dt; AdamW
 * with a compute copy in dt when with_copy). The t[] order is what run_op
 * uses. */
static int make_set(op_set *r, dtype_t dt, const inputs *in, int with_copy)
{
    size_t n = (size_t)r->s.rows * r->s.cols, cols = (size_t)r->s.cols, rows = (size_t)r->s.rows;
    double ta = dt == DT_BF16 ? TOL_BF16 : TOL_F32;
    tensor_t none = {0};
    switch (r->op) {
    case ADD:
        output(r, put(r, dt, in->a, n), ta);
        put(r, dt, in->b, n);
        break;
    case ADD_BIAS:
        output(r, put(r, dt, in->a, n), ta);
        put(r, dt, in->w, cols);
        break;
    case SWIGLU_FWD:
        put(r, dt, in->a, n), put(r, dt, in->b, n);
        output(r, put(r, dt, NULL, n), ta);
        break;
    case SWIGLU_BWD:
        put(r, dt, in->a, n), put(r, dt, in->b, n), put(r, dt, in->c, n);
        output(r, put(r, dt, NULL, n), ta);
        output(r, put(r, dt, NULL, n), ta);
        break;
    case DROPOUT:
        put(r, dt, in->a, n);
        output(r, put(r, dt, NULL, n), ta);
        break;
    case RMSNORM_FWD:
    case RMSNORM_BWD: /* x, w, out, rstd, then dout, dx */
        put(r, dt, in->a, n), put(r, dt, in->w, cols);
        put(r, dt, NULL, n), put(r, DT_F32, NULL, rows);
        if (r->op == RMSNORM_FWD) {
            output(r, r->t[2], ta);
            output(r, r->t[3], TOL_F32);
            break;
        }
        put(r, dt, in->c, n);
        output(r, put(r, dt, in->d, n), ta);
        if (fail_be(r->be, "alloc"))
            return -1;
        be_rmsnorm_forward(r->be, r->t[2], r->t[3], r->t[0], r->t[1], r->s.rows, r->s.cols,
                           1e-5f);
        break;
    case ROPE: {
        int hd = rope_hd(r->s.cols), hh = hd / 2;
        output(r, put(r, dt, in->a, rows * (size_t)(r->s.cols / hd) * hd), ta);
        put(r, DT_F32, in->b, rows * hh), put(r, DT_F32, in->c, rows * hh);
        break;
    }
    case SWIGLU_GU:
    case ROPE_LD: { /* [a-row | b-row] [rows, 2 cols], then the output */
        float *h = malloc(sizeof(float) * (n ? 2 * n : 1));
        if (!h)
            return -1;
        for (size_t i = 0; i < rows; i++) {
            memcpy(h + i * 2 * cols, in->a + i * cols, sizeof(float) * cols);
            memcpy(h + i * 2 * cols + cols, in->b + i * cols, sizeof(float) * cols);
        }
        put(r, dt, h, 2 * n);
        free(h);
        if (r->op == SWIGLU_GU) {
            output(r, put(r, dt, NULL, n), ta);
            break;
        }
        int hd = rope_hd(r->s.cols), hh = hd / 2;
        output(r, put(r, dt, NULL, rows * (size_t)(r->s.cols / hd) * hd), ta);
        put(r, DT_F32, in->c, rows * hh), put(r, DT_F32, in->d, rows * hh);
        break;
    }
    case DEQUANT: { /* codes, 8-bit absmax, nested absmax, the maps, then the output */
        size_t nb = nf4_blocks(n), nn = nf4_nested_blocks(n);
        uint8_t *codes = malloc(nf4_code_bytes(n) + nb);
        float *am = malloc(sizeof(float) * (nb + nn)), maps[16 + 256];
        if (!codes || !am) {
            free(codes), free(am);
            return -1;
        }
        nf4_quantize_codes(in->a, n, codes, am);
        r->nf4_offset = nf4_absmax_offset(am, nb);
        nf4_quantize_absmax(am, nb, r->nf4_offset, nf4_dynamic_map, codes + nf4_code_bytes(n),
                            am + nb);
        memcpy(maps, nf4_quant_map, sizeof nf4_quant_map);
        memcpy(maps + 16, nf4_dynamic_map, sizeof nf4_dynamic_map);
        tensor_t tc = put(r, DT_U8, NULL, nf4_code_bytes(n)), tq = put(r, DT_U8, NULL, nb);
        if (tc.p && tq.p) {
            be_upload(r->be, tc, codes, DT_U8);
            be_upload(r->be, tq, codes + nf4_code_bytes(n), DT_U8);
        }
        put(r, DT_F32, am + nb, nn), put(r, DT_F32, maps, 16 + 256);
        output(r, put(r, dt, NULL, n), ta);
        free(codes), free(am);
        break;
    }
    case ADAMW: { /* P, G, M, V, copy */
        float *v = malloc(sizeof(float) * (n ? n : 1));
        if (!v)
            return -1;
        for (size_t i = 0; i < n; i++)
            v[i] = fabsf(in->d[i]) * 1e-3f;
        output(r, put(r, DT_F32, in->a, n), TOL_ADAMW);
        put(r, DT_F32, in->b, n);
        output(r, put(r, DT_F32, in->c, n), TOL_ADAMW);
        output(r, put(r, DT_F32, v, n), TOL_ADAMW);
        free(v);
        if (with_copy)
            output(r, put(r, dt, NULL, n), NO_CPU);
        else
            r->t[r->nt++] = none;
        break;
    }
    }
    return fail_be(r->be, "alloc and upload");
}

static void run_op(op_set *r)
{
    backend_t *be = r->be;
    tensor_t *t = r->t, none = {0};
    int rows = r->s.rows, cols = r->s.cols;
    size_t n = (size_t)rows * cols;
    switch (r->op) {
    case ADD:
        be_add(be, t[0], t[1], -0.7f, n);
        break;
    case ADD_BIAS:
        be_add_bias(be, t[0], t[1], rows, cols);
        break;
    case SWIGLU_FWD:
        be_swiglu_forward(be, t[2], t[0], t[1], rows, cols, cols);
        break;
    case SWIGLU_BWD:
        be_swiglu_backward(be, t[3], t[4], t[2], t[0], t[1], rows, cols, cols);
        break;
    case DROPOUT:
        be_dropout(be, t[1], t[0], n, 0.1f, 42, (tensor_t){0}, 0);
        break;
    case RMSNORM_FWD:
        be_rmsnorm_forward(be, t[2], t[3], t[0], t[1], rows, cols, 1e-5f);
        break;
    case RMSNORM_BWD:
        be_rmsnorm_backward(be, t[5], none, t[4], t[0], t[1], t[3], rows, cols);
        break;
    case ROPE: {
        int hd = rope_hd(cols);
        be_rope(be, t[0], t[1], t[2], none, 1, rows, cols / hd, hd, 0);
        break;
    }
    case ADAMW: {
        adamw_args a = {.lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f,
                        .weight_decay = 0.1f, .grad_scale = 0.5f, .step = 10};
        be_adamw(be, t[0], t[4], t[1], t[2], t[3], n, &a);
        break;
    }
    case SWIGLU_GU:
        be_swiglu_forward(be, t[1], t[0], tensor_view(t[0], (size_t)cols, 2 * n - (size_t)cols),
                          rows, cols, 2 * cols);
        break;
    case ROPE_LD: {
        int hd = rope_hd(cols), w = cols / hd * hd;
        be_rope_ld(be, t[1], t[0], t[2], t[3], none, 1, rows, cols / hd, hd, 0, w, 2 * cols);
        break;
    }
    case DEQUANT:
        be_dequant_nf4(be, t[4], t[0], t[1], t[2], t[3], r->nf4_offset, n);
        break;
    }
}

/* Bytes an op must move at the least: each tensor read once, each output
 * written once (tables and per-row values left out). */
static double op_bytes(int op, const shape *s, dtype_t dt)
{
    double n = (double)s->rows * s->cols, e = dt == DT_BF16 ? 2 : 4;
    switch (op) {
    case ADD:
    case SWIGLU_FWD:
    case SWIGLU_GU:
        return 3 * n * e;
    case ADD_BIAS:
    case DROPOUT:
    case RMSNORM_FWD:
        return 2 * n * e;
    case SWIGLU_BWD:
        return 5 * n * e;
    case RMSNORM_BWD:
        return 4 * n * e;
    case ROPE:
    case ROPE_LD: {
        int hd = rope_hd(s->cols);
        return 2 * (double)s->rows * (s->cols / hd) * hd * e;
    }
    case ADAMW:
        return 7 * n * 4 + n * e;
    case DEQUANT: /* 4-bit codes and an 8-bit absmax per 64 in, the weight out */
        return n / 2 + n / 64 + n * e;
    }
    return 0;
}

/* Whether cuda_vec.cu takes the op at this shape (its conditions; every
 * tensor here is a fresh allocation, so aligned). */
static int vector_takes(int op, const shape *s, dtype_t dt)
{
    size_t e = dt == DT_BF16 ? 2 : 4;
    if (op == ROPE || op == ROPE_LD) /* ROPE_LD's strides: w and 2 cols */
        return (rope_hd(s->cols) / 2) % 8 == 0 && s->cols % 4 == 0;
    if (op == DEQUANT) /* the elements, not the columns */
        return (size_t)s->rows * s->cols % 8 == 0;
    if (s->cols % 8)
        return 0;
    if (op == RMSNORM_FWD)
        return (size_t)s->cols * e <= VEC_ROW_SMEM;
    if (op == RMSNORM_BWD)
        return (size_t)s->cols * 2 * e <= VEC_ROW_SMEM;
    return 1;
}

/* Downloads r's outputs into fresh host arrays. */
static int download_outputs(op_set *r, float *got[MAX_OUT])
{
    for (int i = 0; i < r->nout; i++) {
        got[i] = malloc(sizeof(float) * (r->out[i].n ? r->out[i].n : 1));
        if (!got[i])
            return -1;
        be_download(r->be, got[i], DT_F32, r->out[i]);
    }
    return fail_be(r->be, "download");
}

/* One call of the op in r: bench_time_ms's callback. */
static void call_once(void *r)
{
    run_op(r);
}

/* The CPU backend's outputs of op: the reference (want[], nwant). */
static int reference(backend_t *cpu, int op, const shape *s, const inputs *in,
                     float *want[MAX_OUT], int *nwant)
{
    op_set r = {.be = cpu, .op = op, .s = *s};
    int rc = make_set(&r, DT_F32, in, 0);
    if (rc == 0) {
        run_op(&r);
        rc = download_outputs(&r, want);
        *nwant = r.nout;
    }
    free_set(&r);
    return rc;
}

static void free_outputs(float *o[MAX_OUT])
{
    for (int i = 0; i < MAX_OUT; i++)
        free(o[i]), o[i] = NULL;
}

/* One table row: version of op on shape. scalar_out: the scalar version's
 * outputs (filled by the scalar row, compared by the vector row). Returns
 * 1 when the check failed. */
static int run_version(backend_t *gpu, int op, const shape *s, const inputs *in, const opts *o,
                       float *const want[MAX_OUT], float *scalar_out[MAX_OUT],
                       const char *version)
{
    setenv("SPOTUNE_CUDA_ELEMENTWISE", version, 1);
    int vec = strcmp(version, "vector") == 0;
    op_set r = {.be = gpu, .op = op, .s = *s};
    float *got[MAX_OUT] = {0};
    int bad = 0;
    const char *same = "-";
    if (make_set(&r, gpu->act_dt, in, 1) != 0) {
        free_set(&r);
        return 1;
    }
    run_op(&r);
    double worst = 0;
    if (download_outputs(&r, got) != 0)
        bad = 1;
    for (int i = 0; !bad && i < r.nout; i++) {
        if (o->check && r.tol[i] != NO_CPU) {
            double e = bench_rel_err(got[i], want[i], r.out[i].n);
            bad |= !(e <= r.tol[i]);
            if (e > worst || e != e)
                worst = e;
        }
        if (vec) {
            int differs = !scalar_out[i] ||
                          memcmp(got[i], scalar_out[i], sizeof(float) * r.out[i].n) != 0;
            same = differs || strcmp(same, "NO") == 0 ? "NO" : "yes";
            bad |= differs;
        }
    }
    double ms = bench_time_ms("elem_bench", gpu, call_once, &r, o->iters);
    double gbs = ms > 0 ? op_bytes(op, s, gpu->act_dt) / (ms * 1e6) : 0.0;
    const char *note = vec && !vector_takes(op, s, gpu->act_dt) ? " fallback" : "";
    printf("| %d x %d | %-11s | %s%s | %8.3f | %7.1f | %.2e | %-3s | %s |\n", s->rows, s->cols,
           op_names[op], version, note, ms, gbs, worst, same,
           bad || ms < 0 ? "FAIL" : !o->check ? "not checked" : "ok");
    if (!vec)
        for (int i = 0; i < MAX_OUT; i++) /* kept for the vector row */
            scalar_out[i] = got[i], got[i] = NULL;
    free_outputs(got);
    free_set(&r);
    return bad || ms < 0;
}

static int parse(int argc, char **argv, opts *o)
{
    memset(o, 0, sizeof *o);
    o->iters = 20;
    o->check = 1;
    for (int i = 1; i < argc; i++) {
        shape *s = &o->shapes[o->nshapes];
        if (strcmp(argv[i], "--shape") == 0 && i + 1 < argc && o->nshapes < MAX_SHAPES &&
            sscanf(argv[++i], "%d,%d", &s->rows, &s->cols) == 2 && s->rows > 0 && s->cols > 0)
            o->nshapes++;
        else if (strcmp(argv[i], "--iters") == 0 && i + 1 < argc)
            o->iters = atoi(argv[++i]);
        else if (strcmp(argv[i], "--no-check") == 0)
            o->check = 0;
        else {
            fprintf(stderr, "usage: elem_bench [--shape ROWS,COLS]... [--iters N] [--no-check]\n");
            return -1;
        }
    }
    if (o->iters < 1)
        return -1;
    static const shape defaults[] = {{2048, 4096}, {2048, 11008}, {1031, 4103}};
    for (int i = 0; o->nshapes == 0 && i < 3; i++)
        o->shapes[i] = defaults[i];
    if (o->nshapes == 0)
        o->nshapes = 3;
    return 0;
}

static void free_inputs(inputs *in)
{
    free(in->a), free(in->b), free(in->c), free(in->d), free(in->w);
}

int main(int argc, char **argv)
{
    opts o;
    backend_t *gpu = NULL, *cpu = NULL;
    if (parse(argc, argv, &o) != 0)
        return 2;
    if (bench_backends("elem_bench", &gpu, &cpu) != 0)
        return 77;
    printf("device: %s; activations %s; %d iterations\n\n", gpu->device_name,
           dtype_name(gpu->act_dt), o.iters);
    printf("| rows x cols | op | version | ms | GB/s | worst rel err | = scalar | check |\n"
           "|---|---|---|---|---|---|---|---|\n");
    int failures = 0;
    for (int i = 0; i < o.nshapes; i++) {
        const shape *s = &o.shapes[i];
        size_t n = (size_t)s->rows * s->cols;
        inputs in = {bench_random_bf16(n, 4.0f, 1), bench_random_bf16(n, 2.0f, 2),
                     bench_random_bf16(n, 1.0f, 3), bench_random_bf16(n, 0.5f, 4),
                     bench_random_bf16((size_t)s->cols, 1.5f, 5)};
        if (!in.a || !in.b || !in.c || !in.d || !in.w) {
            fprintf(stderr, "elem_bench: out of host memory for shape %d\n", i);
            free_inputs(&in);
            failures++;
            continue;
        }
        for (int op = 0; op < NOPS; op++) {
            float *want[MAX_OUT] = {0}, *scalar_out[MAX_OUT] = {0};
            int nwant = 0;
            if (o.check && reference(cpu, op, s, &in, want, &nwant) != 0) {
                fprintf(stderr, "elem_bench: the CPU reference of %s failed\n", op_names[op]);
                failures++;
                free_outputs(want);
                continue;
            }
            failures += run_version(gpu, op, s, &in, &o, want, scalar_out, "scalar");
            failures += run_version(gpu, op, s, &in, &o, want, scalar_out, "vector");
            free_outputs(want);
            free_outputs(scalar_out);
        }
        free_inputs(&in);
    }
    unsetenv("SPOTUNE_CUDA_ELEMENTWISE");
    backend_destroy(gpu);
    backend_destroy(cpu);
    return failures ? 1 : 0;
}
