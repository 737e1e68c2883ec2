/* kernels/cuda/dev/attn_bench.c — the attention workbench (not part of the
 * trainer): every version of the CUDA backend's attention on the same
 * random inputs, each checked against the CPU backend and timed with CUDA
 * events, one table row per (shape, version).
 *
 * Versions: "fused" (kernels/cuda/cuda_flash.cu, its default: dQ from the
 * dS the dK/dV kernel stores where that fits; a shape it does not take
 * runs the unfused path and the row says "fallback"), "fused-regs" (the
 * same, the forward holding Q and the dK/dV kernel K and V in registers
 * instead of reading them from shared memory, as before 2026-12-06),
 * "fused-recompute"
 * (the same kernels, dQ recomputing S and dP), "fused-wgmma" (the forward
 * by Hopper warpgroup products, cuda_flash_wgmma.cu, on a GPU of compute
 * capability 9.0; elsewhere the row says it ran mma.sync), "unfused" (the cuBLASLt
 * path of cuda_attention.cu) and "cudnn" (cuDNN's fused attention,
 * cuda_cudnn.cu; where cuDNN did not run both calls the row says so and
 * times the fused kernels), chosen through SPOTUNE_CUDA_ATTENTION as the
 * backend reads it on every call.
 *
 * Check: out, dq, dk, dv within 1e-2 of the CPU's largest value (bf16, the
 * tolerance of tests/test_cuda_ops.c), lse within 1e-4. The CPU reference is
 * the CPU backend's blocked attention on the same bf16-rounded values. Its
 * backward uses the CPU's own forward output, not the GPU's bf16 one (the
 * test does upload the GPU's): D = rowsum(dO * O) differs by that rounding,
 * about 1-2e-3 of dq's largest value, inside the 1e-2 but part of it.
 *
 * usage: attn_bench [--shape B,T,nh,nkv,hd]... [--packed MAXLEN] [--iters N]
 *                   [--no-check]
 * Without --shape: a default set (the 7B and 8B shapes at T 2048, hd 64 at
 * T 4096, an odd T). See README.md. */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_util.h"
#include "kernels/backend.h"

#define TOL_BF16 1e-2
#define TOL_F32 1e-4
#define MAX_SHAPES 16

typedef struct shape {
    int B, T, nh, nkv, hd;
} shape;

typedef struct opts {
    shape shapes[MAX_SHAPES];
    int nshapes, packed, iters, check;
} opts;

/* The host inputs of one shape (bf16-rounded floats) and the CPU's outputs. */
typedef struct inputs {
    float *q, *k, *v, *dout;
    int32_t *seg; /* NULL without --packed; the starts, then their document table */
    size_t seg_n; /* seg's entries */
    float *want[5]; /* out, lse, dq, dk, dv */
    size_t n[5];
} inputs;

/* The device tensors of one run. */
typedef struct dev_set {
    tensor_t q, k, v, dout, out, lse, dq, dk, dv, seg;
} dev_set;

static const char *out_names[5] = {"out", "lse", "dq", "dk", "dv"};

static int fail_be(backend_t *be, const char *what)
{
    return bench_fail_be("attn_bench", be, what);
}

/* Packed documents of 1..maxlen tokens: seg[b*T + t] = start of t's
 * document, followed by their table (packed_doc_table, which the
 * attention by cuDNN runs them by; the other versions read the starts);
 * *n: seg's entries. */
static int32_t *packed_seg(int B, int T, int maxlen, size_t *n)
{
    size_t bt = (size_t)B * T;
    int32_t *seg = malloc(sizeof(int32_t) * (2 * bt + 1));
    uint64_t draw = 0;
    if (!seg)
        return NULL;
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T;) {
            int len = 1 + (int)(sp_rng_u64(0xbe7c, draw++) % (uint64_t)maxlen);
            for (int i = t; i < t + len && i < T; i++)
                seg[(size_t)b * T + i] = t;
            t += len;
        }
    *n = bt + (size_t)packed_doc_table(seg, B, T, seg + bt) + 1;
    return seg;
}

static void free_inputs(inputs *in)
{
    free(in->q), free(in->k), free(in->v), free(in->dout), free(in->seg);
    for (int i = 0; i < 5; i++)
        free(in->want[i]);
}

static void free_set(backend_t *be, dev_set *d)
{
    tensor_t *all[] = {&d->q, &d->k, &d->v, &d->dout, &d->out, &d->lse, &d->dq, &d->dk, &d->dv,
                       &d->seg};
    for (int i = 0; i < 10; i++)
        be_free(be, all[i]);
}

/* Allocates and uploads one shape's tensors on be (activations in act_dt). */
static int make_set(backend_t *be, const shape *s, const inputs *in, dev_set *d)
{
    size_t nq = (size_t)s->B * s->T * s->nh * s->hd, nk = (size_t)s->B * s->T * s->nkv * s->hd;
    dtype_t a = be->act_dt;
    memset(d, 0, sizeof *d);
    d->q = be_alloc(be, a, nq), d->k = be_alloc(be, a, nk), d->v = be_alloc(be, a, nk);
    d->dout = be_alloc(be, a, nq), d->out = be_alloc(be, a, nq);
    d->lse = be_alloc(be, DT_F32, (size_t)s->B * s->nh * s->T);
    d->dq = be_alloc(be, a, nq), d->dk = be_alloc(be, a, nk), d->dv = be_alloc(be, a, nk);
    if (in->seg)
        d->seg = be_alloc(be, DT_I32, in->seg_n);
    if (fail_be(be, "alloc"))
        return -1;
    be_upload(be, d->q, in->q, DT_F32), be_upload(be, d->k, in->k, DT_F32);
    be_upload(be, d->v, in->v, DT_F32), be_upload(be, d->dout, in->dout, DT_F32);
    if (in->seg)
        be_upload(be, d->seg, in->seg, DT_I32);
    return fail_be(be, "upload");
}

static void forward(backend_t *be, const shape *s, dev_set *d)
{
    be_attention_forward(be, d->out, d->lse, d->q, d->k, d->v, d->seg, s->B, s->T, s->nh, s->nkv,
                         s->hd);
}

static void backward(backend_t *be, const shape *s, dev_set *d)
{
    be_attention_backward(be, d->dq, d->dk, d->dv, d->dout, d->out, d->lse, d->q, d->k, d->v,
                          d->seg, s->B, s->T, s->nh, s->nkv, s->hd);
}

/* Downloads the five outputs into fresh host arrays. */
static int download_outputs(backend_t *be, dev_set *d, float *got[5])
{
    tensor_t t[5] = {d->out, d->lse, d->dq, d->dk, d->dv};
    for (int i = 0; i < 5; i++) {
        got[i] = malloc(sizeof(float) * (t[i].n ? t[i].n : 1));
        if (!got[i])
            return -1;
        be_download(be, got[i], DT_F32, t[i]);
    }
    return fail_be(be, "download");
}

static int make_inputs(const shape *s, const opts *o, inputs *in)
{
    size_t nq = (size_t)s->B * s->T * s->nh * s->hd, nk = (size_t)s->B * s->T * s->nkv * s->hd;
    memset(in, 0, sizeof *in);
    in->q = bench_random_bf16(nq, 1.5f, 1), in->k = bench_random_bf16(nk, 1.5f, 2);
    in->v = bench_random_bf16(nk, 1.0f, 3), in->dout = bench_random_bf16(nq, 1.0f, 4);
    in->seg = o->packed ? packed_seg(s->B, s->T, o->packed, &in->seg_n) : NULL;
    in->n[0] = in->n[2] = nq, in->n[3] = in->n[4] = nk, in->n[1] = (size_t)s->B * s->nh * s->T;
    return in->q && in->k && in->v && in->dout && (!o->packed || in->seg) ? 0 : -1;
}

/* The CPU backend's forward and backward: the reference outputs. */
static int reference(backend_t *cpu, const shape *s, inputs *in)
{
    dev_set d;
    int rc = make_set(cpu, s, in, &d);
    /* make_set zeroes d first: free_set below frees what it allocated */
    if (rc == 0) {
        forward(cpu, s, &d);
        backward(cpu, s, &d);
        rc = download_outputs(cpu, &d, in->want);
    }
    free_set(cpu, &d);
    return rc;
}

/* One call of fn on (be, s, d): bench_time_ms's callback. */
typedef struct timed_call {
    backend_t *be;
    const shape *s;
    dev_set *d;
    void (*fn)(backend_t *, const shape *, dev_set *);
} timed_call;

static void call_once(void *p)
{
    timed_call *c = p;
    c->fn(c->be, c->s, c->d);
}

/* Milliseconds per call of fn, over iters calls (bench_time_ms). */
static double time_op(backend_t *be, const shape *s, dev_set *d,
                      void (*fn)(backend_t *, const shape *, dev_set *), int iters)
{
    timed_call c = {be, s, d, fn};
    return bench_time_ms("attn_bench", be, call_once, &c, iters);
}

/* A function of the CUDA module by name, or NULL. */
static void *module_fn(const char *name)
{
    char why[256];
    return backend_cuda_symbol(name, why, sizeof why);
}

/* Whether the fused kernels take this call (cuda_flash_handles in the module). */
static int fused_takes(backend_t *be, const shape *s, dev_set *d)
{
    typedef int (*handles_fn)(backend_t *, dtype_t, int, int, int, int, int, const void *const *,
                              int, const int *, int);
    void *sym = module_fn("cuda_flash_handles");
    if (!sym)
        return 0;
    handles_fn fn;
    memcpy(&fn, &sym, sizeof fn);
    const void *ptrs[] = {d->q.p, d->k.p, d->v.p, d->out.p, d->dout.p, d->dq.p, d->dk.p, d->dv.p};
    const int lds[] = {s->nh * s->hd, s->nkv * s->hd, s->nh * s->hd, s->nkv * s->hd};
    return fn(be, d->q.dt, s->B, s->T, s->nh, s->nkv, s->hd, ptrs, 8, lds, 4);
}

/* Whether the wgmma kernels run now (cuda_flash_wgmma_selected
 * in the module: SPOTUNE_CUDA_ATTENTION=fused-wgmma, the sm_90a build, a
 * GPU of compute capability 9.0). */
static int wgmma_runs(backend_t *be)
{
    void *sym = module_fn("cuda_flash_wgmma_selected");
    int (*fn)(backend_t *);
    if (!sym)
        return 0;
    memcpy(&fn, &sym, sizeof fn);
    return fn(be);
}

/* How many calls cuDNN has run on this backend (cuda_cudnn_calls in the
 * module; 0 without it). */
static long cudnn_calls(backend_t *be)
{
    void *sym = module_fn("cuda_cudnn_calls");
    long (*fn)(backend_t *);
    if (!sym)
        return 0;
    memcpy(&fn, &sym, sizeof fn);
    return fn(be);
}

/* One table row: version on shape. Returns 1 when the check failed. */
static int run_version(backend_t *gpu, const shape *s, const inputs *in, const opts *o,
                       const char *version)
{
    setenv("SPOTUNE_CUDA_ATTENTION", version, 1);
    dev_set d;
    float *got[5] = {0};
    int bad = 0;
    if (make_set(gpu, s, in, &d) != 0) {
        free_set(gpu, &d);
        return 1;
    }
    const char *note =
        strncmp(version, "fused", 5) == 0 && !fused_takes(gpu, s, &d) ? " fallback"
        : strcmp(version, "fused-wgmma") == 0 && !wgmma_runs(gpu)   ? " (mma.sync: not sm_90)"
                                                                     : "";
    long c0 = cudnn_calls(gpu);
    forward(gpu, s, &d);
    backward(gpu, s, &d);
    if (strcmp(version, "cudnn") == 0 && cudnn_calls(gpu) - c0 < 2)
        note = " (fused: cuDNN did not run it, stderr says why)";
    double worst = 0;
    const char *worst_name = "-";
    if (o->check && download_outputs(gpu, &d, got) == 0)
        for (int i = 0; i < 5; i++) {
            double e = bench_rel_err(got[i], in->want[i], in->n[i]);
            bad |= e > (i == 1 ? TOL_F32 : TOL_BF16);
            if (e > worst || e != e)
                worst = e, worst_name = out_names[i];
        }
    double fms = time_op(gpu, s, &d, forward, o->iters);
    double bms = time_op(gpu, s, &d, backward, o->iters);
    /* causal: half of the T x T products; forward 2, backward 5 of them */
    double flop = 2.0 * s->B * s->nh * (double)s->T * s->T / 2.0 * s->hd;
    printf("| %d,%d,%d,%d,%d | %-8s%s | %9.3f | %9.3f | %7.1f | %7.1f | %-3s %.2e | %s |\n", s->B,
           s->T, s->nh, s->nkv, s->hd, version, note, fms, bms,
           fms > 0 ? 2 * flop / (fms * 1e9) : 0.0, bms > 0 ? 5 * flop / (bms * 1e9) : 0.0,
           worst_name, worst, !o->check ? "not checked" : bad || fms < 0 || bms < 0 ? "FAIL" : "ok");
    for (int i = 0; i < 5; i++)
        free(got[i]);
    free_set(gpu, &d);
    return bad || fms < 0 || bms < 0;
}

static int parse(int argc, char **argv, opts *o)
{
    memset(o, 0, sizeof *o);
    o->iters = 10;
    o->check = 1;
    for (int i = 1; i < argc; i++) {
        shape *s = &o->shapes[o->nshapes];
        if (strcmp(argv[i], "--shape") == 0 && i + 1 < argc && o->nshapes < MAX_SHAPES &&
            sscanf(argv[++i], "%d,%d,%d,%d,%d", &s->B, &s->T, &s->nh, &s->nkv, &s->hd) == 5)
            o->nshapes++;
        else if (strcmp(argv[i], "--packed") == 0 && i + 1 < argc)
            o->packed = atoi(argv[++i]);
        else if (strcmp(argv[i], "--iters") == 0 && i + 1 < argc)
            o->iters = atoi(argv[++i]);
        else if (strcmp(argv[i], "--no-check") == 0)
            o->check = 0;
        else {
            fprintf(stderr, "usage: attn_bench [--shape B,T,nh,nkv,hd]... [--packed MAXLEN] "
                            "[--iters N] [--no-check]\n");
            return -1;
        }
    }
    if (o->iters < 1 || o->packed < 0)
        return -1;
    static const shape defaults[] = {
        {1, 2048, 32, 32, 128}, {1, 2048, 32, 8, 128}, {1, 4096, 32, 8, 64}, {2, 1031, 8, 2, 64}};
    for (int i = 0; o->nshapes == 0 && i < 4; i++)
        o->shapes[i] = defaults[i];
    if (o->nshapes == 0)
        o->nshapes = 4;
    return 0;
}

int main(int argc, char **argv)
{
    opts o;
    backend_t *gpu = NULL, *cpu = NULL;
    if (parse(argc, argv, &o) != 0)
        return 2;
    if (bench_backends("attn_bench", &gpu, &cpu) != 0)
        return 77;
    printf("device: %s; %d iterations; %s\n\n", gpu->device_name, o.iters,
           o.packed ? "packed documents" : "no packing");
    printf("| B,T,nh,nkv,hd | version | fwd ms | bwd ms | fwd TFLOP/s | bwd TFLOP/s | worst "
           "rel err | check |\n|---|---|---|---|---|---|---|---|\n");
    int failures = 0;
    for (int i = 0; i < o.nshapes; i++) {
        inputs in;
        const shape *s = &o.shapes[i];
        if (make_inputs(s, &o, &in) != 0 || (o.check && reference(cpu, s, &in) != 0)) {
            fprintf(stderr, "attn_bench: inputs or reference failed for shape %d\n", i);
            free_inputs(&in);
            failures++;
            continue;
        }
        failures += run_version(gpu, s, &in, &o, "fused");
        failures += run_version(gpu, s, &in, &o, "fused-regs");
        failures += run_version(gpu, s, &in, &o, "fused-recompute");
        failures += run_version(gpu, s, &in, &o, "fused-wgmma");
        failures += run_version(gpu, s, &in, &o, "unfused");
        failures += run_version(gpu, s, &in, &o, "cudnn");
        free_inputs(&in);
    }
    unsetenv("SPOTUNE_CUDA_ATTENTION");
    backend_destroy(gpu);
    backend_destroy(cpu);
    return failures ? 1 : 0;
}
