/* tests/test_cuda_attention_cudnn.c — the attention by cuDNN's fused
 * attention (SPOTUNE_CUDA_ATTENTION=cudnn, kernels/cuda/cuda_cudnn.cu): its
 * fallback to the fused kernels, and where cuDNN runs, its results against
 * the CPU. Part of test_cuda_attention (the same binary and suite: its
 * fixture, main and shared checks are test_cuda_attention.c's and
 * cuda_attention_util.h's). Tolerances: TOL_BF16 and TOL_F32
 * (cuda_ops_util.h). */
#define _POSIX_C_SOURCE 200809L /* setenv */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_attention_util.h"
#include "cuda_ops_util.h"
#include "cuda_test_main.h"
#include "kernels/backend.h"

/* Whether cuDNN runs attention on this backend (cuda_cudnn_status; why
 * says its version or why not) and how many calls it has run so far. */
static int cudnn_usable(char *why, size_t n, long *calls)
{
    char err[256];
    void *st = backend_cuda_symbol("cuda_cudnn_status", err, sizeof err);
    void *ca = backend_cuda_symbol("cuda_cudnn_calls", err, sizeof err);
    if (!st || !ca) {
        snprintf(why, n, "the backend has no cuDNN path: %s", err);
        *calls = 0;
        return 0;
    }
    int (*status)(backend_t *, char *, size_t);
    long (*ran)(backend_t *);
    memcpy(&status, &st, sizeof status);
    memcpy(&ran, &ca, sizeof ran);
    *calls = ran(gpu);
    return status(gpu, why, n);
}

/* Asked for and not run (packed documents without their document table;
 * on a device without cuDNN, every call, packed documents with their
 * table too): the fused kernels run the call instead, the same bits as
 * without the request, and cuDNN's count does not move. */
Test(cuda_ops, attention_by_cudnn_falls_back_to_the_fused_kernels)
{
    if (cuda_test_standin())
        cr_skip_test("a stand-in backend has one attention");
    int B = 2, T = 150, nh = 8, nkv = 2, hd = 128;
    size_t nq = (size_t)B * T * nh * hd, nk = (size_t)B * T * nkv * hd, nl = (size_t)B * nh * T;
    size_t ns[5] = {nq, nl, nq, nk, nk};
    const char *names[5] = {"out", "lse", "dq", "dk", "dv"};
    char why[320];
    long before, after;
    int usable = cudnn_usable(why, sizeof why, &before);
    if (strstr(gpu->device_name, "emulated"))
        cr_expect(!usable && strstr(why, "emulated device has no cuDNN"),
                  "the emulated device reports cuDNN %s: %s", usable ? "usable" : "unusable", why);
    static const char *const cases[3] = {"dense", "packed", "packed with its table"};
    for (int packed = 0; packed < 3; packed++) {
        if (packed != 1 && usable)
            continue; /* cuDNN runs these: attention_by_cudnn_matches_the_cpu */
        attn_in in = attn_inputs(B, T, nh, nkv, hd, packed ? 60 : 0);
        size_t n = (size_t)B * T;
        int32_t *seg = packed == 2 ? seg_with_table(in.seg, B, T, &n) : NULL;
        const int32_t *sg = seg ? seg : in.seg;
        gpu_attn d = gpu_attention(in.q, in.k, in.v, in.dout, in.seg, B, T, nh, nkv, hd);
        cr_assert_eq(setenv("SPOTUNE_CUDA_ATTENTION", "cudnn", 1), 0);
        gpu_attn c = gpu_attention_n(in.q, in.k, in.v, in.dout, sg, n, B, T, nh, nkv, hd);
        unsetenv("SPOTUNE_CUDA_ATTENTION");
        for (int i = 0; i < 5; i++)
            cr_expect(memcmp(d.o[i], c.o[i], sizeof(float) * ns[i]) == 0,
                      "%s: %s with cuDNN asked for differs from the fused kernels' (rel err "
                      "%.3g)", cases[packed], names[i], rel_err(c.o[i], d.o[i], ns[i]));
        for (int i = 0; i < 5; i++)
            free(d.o[i]), free(c.o[i]);
        free(seg);
        attn_inputs_free(&in);
    }
    cudnn_usable(why, sizeof why, &after);
    cr_expect_eq(after, before, "cuDNN ran %ld call(s) it should have left", after - before);
}

/* The CPU's attention over one document: q, k, v, dout [L, heads, hd]
 * contiguous in, out, lse [heads, L], dq, dk, dv out (dense, causal). */
static void cpu_document(int L, int nh, int nkv, int hd, const float *q, const float *k,
                         const float *v, const float *dout, float *res[5])
{
    size_t nq = (size_t)L * nh * hd, nk = (size_t)L * nkv * hd, nl = (size_t)nh * L;
    tensor_t cq = up(cpu, DT_F32, q, nq), ck = up(cpu, DT_F32, k, nk), cv = up(cpu, DT_F32, v, nk);
    tensor_t co = up(cpu, DT_F32, NULL, nq), cl = up(cpu, DT_F32, NULL, nl);
    tensor_t cdo = up(cpu, DT_F32, dout, nq), cdq = up(cpu, DT_F32, NULL, nq);
    tensor_t cdk = up(cpu, DT_F32, NULL, nk), cdv = up(cpu, DT_F32, NULL, nk);
    tensor_t none = {0};
    be_attention_forward(cpu, co, cl, cq, ck, cv, none, 1, L, nh, nkv, hd);
    be_attention_backward(cpu, cdq, cdk, cdv, cdo, co, cl, cq, ck, cv, none, 1, L, nh, nkv, hd);
    tensor_t outs[5] = {co, cl, cdq, cdk, cdv};
    for (int i = 0; i < 5; i++)
        res[i] = down(cpu, outs[i]);
    tensor_t all[] = {cq, ck, cv, co, cl, cdo, cdq, cdk, cdv};
    for (int i = 0; i < 9; i++)
        drop(cpu, &all[i]);
}

/* One tensor as a packed call declares it to cuDNN (cuda_cudnn_ragged_args)
 * and the host buffer it lies in, from element base. */
typedef struct ragged_view {
    const char *name;
    float *buf;
    size_t base, n; /* n: buf's elements */
    long long dim[4], st[4];
    long long *off;
} ragged_view;

/* Element (h, s, d) of sequence i of the view, as cuDNN addresses it
 * (inside the buffer: asserted). */
static size_t ragged_at(const ragged_view *r, int i, int h, int s, int d)
{
    long long at = (long long)r->base + r->off[i] + h * r->st[1] + s * r->st[2] + d * r->st[3];
    cr_assert(at >= 0 && (size_t)at < r->n, "%s: sequence %d, head %d, token %d, %d: element "
              "%lld outside its buffer of %zu", r->name, i, h, s, d, at, r->n);
    return (size_t)at;
}

/* Sequence i's [L, heads, hd] out of (to == 0) or into (to == 1) the view;
 * cover counts the elements written. */
static void ragged_move(const ragged_view *r, int i, int L, float *x, int to, int *cover)
{
    int heads = (int)r->dim[1], hd = (int)r->dim[3];
    for (int s = 0; s < L; s++)
        for (int h = 0; h < heads; h++)
            for (int d = 0; d < hd; d++) {
                size_t at = ragged_at(r, i, h, s, d), j = ((size_t)s * heads + h) * hd + d;
                if (to)
                    r->buf[at] = x[j], cover[at]++;
                else
                    x[j] = r->buf[at];
            }
}

/* Packed documents as cuDNN is given them, on any device (the emulated
 * one included, where cuDNN itself is not): each tensor read and written
 * through the dims, strides, ragged offsets and sequence lengths a packed
 * call declares (cuda_cudnn_ragged_args: the graph's layout, the offsets
 * and lengths computed by the device from seg's document table), each
 * document's attention run on its own by the CPU backend (dense, causal),
 * and the stats moved into lse by the device's kernel, give the CPU's
 * packed attention of the whole rows: out, lse, dq, dk, dv within TOL_F32
 * (the same arithmetic, one document at a time), every element of out,
 * the stats and the gradient written exactly once, the padding columns
 * never. q/k/v are the fused product's column blocks and dq/dk/dv its
 * gradient's (the trainer's layout); documents of 1 to 9 tokens, and a
 * row that is one document. */
Test(cuda_ops, packed_documents_as_cudnn_is_given_them)
{
    if (cuda_test_standin())
        cr_skip_test("a stand-in backend has no cuDNN layout");
    char err[256];
    void *fa = backend_cuda_symbol("cuda_cudnn_ragged_args", err, sizeof err);
    void *fs = backend_cuda_symbol("cuda_cudnn_stats_lse", err, sizeof err);
    cr_assert(fa && fs, "%s", err);
    int (*args)(backend_t *, tensor_t, int, int, int, int, int, int, int, int, int, const char *,
                long long *, long long *, long long *, int *);
    int (*stats_lse)(backend_t *, tensor_t, tensor_t, int, int, int, int);
    memcpy(&args, &fa, sizeof args);
    memcpy(&stats_lse, &fs, sizeof stats_lse);
    int B = 3, T = 41, nh = 4, nkv = 2, hd = 16, qd = nh * hd, kvd = nkv * hd;
    int N = qd + 2 * kvd + 8; /* the fused product's row, and padding columns */
    size_t bt = (size_t)B * T, nq = bt * qd, nk = bt * kvd, nl = bt * nh, nf = bt * N;
    attn_in in = attn_inputs(B, T, nh, nkv, hd, 9);
    for (int t = 0; t < T; t++)
        in.seg[2 * T + t] = 0, in.pos[2 * T + t] = t; /* row 2: one document */
    /* the reference: the CPU's packed attention of the whole rows */
    tensor_t cq = up(cpu, DT_F32, in.q, nq), ck = up(cpu, DT_F32, in.k, nk);
    tensor_t cv = up(cpu, DT_F32, in.v, nk), co = up(cpu, DT_F32, NULL, nq);
    tensor_t cl = up(cpu, DT_F32, NULL, nl), cdo = up(cpu, DT_F32, in.dout, nq);
    tensor_t cdq = up(cpu, DT_F32, NULL, nq), cdk = up(cpu, DT_F32, NULL, nk);
    tensor_t cdv = up(cpu, DT_F32, NULL, nk), csg = be_alloc(cpu, DT_I32, bt);
    cr_assert(csg.p);
    be_upload(cpu, csg, in.seg, DT_I32);
    be_attention_forward(cpu, co, cl, cq, ck, cv, csg, B, T, nh, nkv, hd);
    be_attention_backward(cpu, cdq, cdk, cdv, cdo, co, cl, cq, ck, cv, csg, B, T, nh, nkv, hd);
    tensor_t refs_t[5] = {co, cl, cdq, cdk, cdv};
    float *ref[5];
    for (int i = 0; i < 5; i++)
        ref[i] = down(cpu, refs_t[i]);
    /* the buffers as the trainer has them: q/k/v and their gradient as the
     * column blocks of [B T, N] matrices, out and dout [B T, qd], the
     * token-major stats [B T, nh] */
    float *qkv = calloc(nf, sizeof *qkv), *dqkv = calloc(nf, sizeof *dqkv);
    float *out = calloc(nq, sizeof *out), *dout = calloc(nq, sizeof *dout);
    float *st = calloc(nl, sizeof *st);
    int *cov_o = calloc(nq, sizeof(int)), *cov_d = calloc(nf, sizeof(int));
    int *cov_s = calloc(nl, sizeof(int));
    cr_assert(qkv && dqkv && out && dout && st && cov_o && cov_d && cov_s);
    for (size_t r = 0; r < bt; r++) {
        memcpy(qkv + r * N, in.q + r * qd, sizeof(float) * qd);
        memcpy(qkv + r * N + qd, in.k + r * kvd, sizeof(float) * kvd);
        memcpy(qkv + r * N + qd + kvd, in.v + r * kvd, sizeof(float) * kvd);
        memcpy(dout + r * qd, in.dout + r * qd, sizeof(float) * qd);
    }
    size_t n;
    int32_t *seg = seg_with_table(in.seg, B, T, &n);
    tensor_t gsg = be_alloc(gpu, DT_I32, n);
    cr_assert(gsg.p);
    be_upload(gpu, gsg, seg, DT_I32);
    int C = (int)(n - bt - 1), ndocs = 0;
    while (seg[bt + ndocs] < (int32_t)bt)
        ndocs++;
    const char *vn[9] = {"Q", "K", "V", "O", "stats", "dO", "dQ", "dK", "dV"};
    float *vb[9] = {qkv, qkv, qkv, out, st, dout, dqkv, dqkv, dqkv};
    size_t vo[9] = {0, (size_t)qd, (size_t)qd + kvd, 0, 0, 0, 0, (size_t)qd, (size_t)qd + kvd};
    size_t vs[9] = {nf, nf, nf, nq, nl, nq, nf, nf, nf};
    ragged_view v[9];
    for (int t = 0; t < 9; t++)
        v[t] = (ragged_view){.name = vn[t], .buf = vb[t], .base = vo[t], .n = vs[t]};
    int *len = calloc((size_t)C, sizeof(int));
    cr_assert(len);
    for (int t = 0; t < 9; t++) {
        v[t].off = calloc((size_t)C + 1, sizeof(long long));
        cr_assert(v[t].off);
        int c = args(gpu, gsg, B, T, nh, nkv, hd, N, N, N, N, v[t].name, v[t].dim, v[t].st,
                     v[t].off, len);
        gpu_ok();
        cr_assert_eq(c, C, "%s: %d sequences declared, the table holds %d", v[t].name, c, C);
        int heads = t == 1 || t == 2 || t == 7 || t == 8 ? nkv : nh;
        cr_expect(v[t].dim[0] == C && v[t].dim[1] == heads && v[t].dim[2] == T &&
                      v[t].dim[3] == (t == 4 ? 1 : hd),
                  "%s: dims [%lld, %lld, %lld, %lld]", v[t].name, v[t].dim[0], v[t].dim[1],
                  v[t].dim[2], v[t].dim[3]);
    }
    int total = 0;
    for (int i = 0; i < C; i++) {
        cr_assert(len[i] >= 0 && len[i] <= T, "sequence %d: length %d", i, len[i]);
        cr_expect(i < ndocs ? len[i] > 0 : len[i] == 0, "sequence %d of %d documents: length %d",
                  i, ndocs, len[i]);
        total += len[i];
    }
    cr_expect_eq(total, (int)bt, "the sequences hold %d tokens of %zu", total, bt);
    cr_expect(C >= ndocs && C >= 8 && (C & (C - 1)) == 0, "capacity %d for %d documents", C,
              ndocs);
    for (int i = 0; i < ndocs; i++) {
        int L = len[i];
        size_t a = (size_t)L * nh * hd, b = (size_t)L * nkv * hd;
        float *x[4] = {malloc(sizeof(float) * a), malloc(sizeof(float) * b),
                       malloc(sizeof(float) * b), malloc(sizeof(float) * a)};
        cr_assert(x[0] && x[1] && x[2] && x[3]);
        ragged_move(&v[0], i, L, x[0], 0, NULL);
        ragged_move(&v[1], i, L, x[1], 0, NULL);
        ragged_move(&v[2], i, L, x[2], 0, NULL);
        ragged_move(&v[5], i, L, x[3], 0, NULL);
        float *res[5];
        cpu_document(L, nh, nkv, hd, x[0], x[1], x[2], x[3], res);
        ragged_move(&v[3], i, L, res[0], 1, cov_o);
        for (int h = 0; h < nh; h++) /* lse [nh, L] into the stats */
            for (int s2 = 0; s2 < L; s2++) {
                size_t at = ragged_at(&v[4], i, h, s2, 0);
                st[at] = res[1][(size_t)h * L + s2], cov_s[at]++;
            }
        ragged_move(&v[6], i, L, res[2], 1, cov_d);
        ragged_move(&v[7], i, L, res[3], 1, cov_d);
        ragged_move(&v[8], i, L, res[4], 1, cov_d);
        for (int j = 0; j < 5; j++)
            free(res[j]);
        for (int j = 0; j < 4; j++)
            free(x[j]);
    }
    int once = 1;
    for (size_t i = 0; i < nq; i++)
        once = once && cov_o[i] == 1;
    for (size_t i = 0; i < nl; i++)
        once = once && cov_s[i] == 1;
    for (size_t r = 0; r < bt; r++)
        for (int c = 0; c < N; c++)
            once = once && cov_d[r * N + c] == (c < qd + 2 * kvd);
    cr_expect(once, "an element of out, the stats or the gradient is written twice or never");
    /* the stats into lse by the device, and back */
    tensor_t gst = up(gpu, DT_F32, st, nl), gl = up(gpu, DT_F32, NULL, nl);
    cr_expect_eq(stats_lse(gpu, gst, gl, B, T, nh, 1), 0);
    float *lse = down(gpu, gl);
    be_zero(gpu, gst);
    cr_expect_eq(stats_lse(gpu, gst, gl, B, T, nh, 0), 0);
    float *back = down(gpu, gst);
    gpu_ok();
    cr_expect(memcmp(back, st, sizeof(float) * nl) == 0, "lse back into the stats differs");
    float *got[5] = {out, lse, malloc(sizeof(float) * nq), malloc(sizeof(float) * nk),
                     malloc(sizeof(float) * nk)};
    cr_assert(got[2] && got[3] && got[4]);
    for (size_t r = 0; r < bt; r++) {
        memcpy(got[2] + r * qd, dqkv + r * N, sizeof(float) * qd);
        memcpy(got[3] + r * kvd, dqkv + r * N + qd, sizeof(float) * kvd);
        memcpy(got[4] + r * kvd, dqkv + r * N + qd + kvd, sizeof(float) * kvd);
    }
    const char *names[5] = {"out", "lse", "dq", "dk", "dv"};
    size_t ns[5] = {nq, nl, nq, nk, nk};
    for (int i = 0; i < 5; i++) {
        double e = rel_err(got[i], ref[i], ns[i]);
        cr_expect(e <= TOL_F32, "document by document, as cuDNN is given them: %s rel err %.3g "
                                "> %.3g", names[i], e, TOL_F32);
    }
    for (int i = 0; i < 5; i++)
        free(ref[i]);
    for (int i = 2; i < 5; i++)
        free(got[i]);
    for (int t = 0; t < 9; t++)
        free(v[t].off);
    tensor_t cs[] = {cq, ck, cv, co, cl, cdo, cdq, cdk, cdv, csg};
    for (int i = 0; i < 10; i++)
        drop(cpu, &cs[i]);
    drop(gpu, &gsg), drop(gpu, &gst), drop(gpu, &gl);
    free(qkv), free(dqkv), free(out), free(dout), free(st), free(cov_o), free(cov_d), free(cov_s);
    free(len), free(lse), free(back), free(seg);
    attn_inputs_free(&in);
}

/* Where cuDNN runs (a GPU with libcudnn.so.9; skipped, with the reason,
 * elsewhere): its forward and backward against the CPU backend at the
 * tolerances of the fused kernels' tests (out, dq, dk, dv TOL_BF16 of the
 * largest value, lse TOL_F32), two calls counted for each shape (so no
 * fallback passes for it): odd T, head dims 64 and 128, query groups 1, 4
 * and 8, and the 7B shape with full shapes; packed documents by their
 * table (dozens of short ones; the 7B shape's); q, k, v as the column blocks
 * of the fused product's output (and dq, dk, dv of its gradient; query
 * groups of 4) within TOL_BF16 of the contiguous call, counted too; the
 * same step twice the same bits (the deterministic backward); a backward
 * over its workspace budget refused, the fused kernels' backward after
 * cuDNN's forward still the CPU's. */
Test(cuda_ops, attention_by_cudnn_matches_the_cpu)
{
    char why[320];
    long c0, c1;
    if (!cudnn_usable(why, sizeof why, &c0))
        cr_skip_test("cuDNN does not run attention here: %s", why);
    cr_log_info("attention by %s", why);
    /* (a graph each, built on first use: kept few, as cuDNN may compile
     * kernels for them; the column blocks below are query groups of 4) */
    static const int shapes[][5] = {{2, 37, 4, 1, 64}, {1, 130, 8, 1, 128}, {1, 257, 4, 4, 128}};
    cr_assert_eq(setenv("SPOTUNE_CUDA_ATTENTION", "cudnn", 1), 0);
    for (int i = 0; i < 3; i++) {
        check_attention(shapes[i][0], shapes[i][1], shapes[i][2], shapes[i][3], shapes[i][4]);
        cudnn_usable(why, sizeof why, &c1);
        cr_expect_eq(c1 - c0, 2, "shape %d: cuDNN ran %ld of its 2 calls (%s)", i, c1 - c0, why);
        c0 = c1;
    }
    if (!cuda_test_reduced_shapes()) {
        check_attention_at(1, 2048, 32, 32, 128, 1);
        cudnn_usable(why, sizeof why, &c1);
        cr_expect_eq(c1 - c0, 2, "7B shape: cuDNN ran %ld of its 2 calls", c1 - c0);
        c0 = c1;
    }
    /* packed documents by their table: short ones (1 to 40 tokens, so
     * dozens of sequences, with odd lengths), and the 7B shape's (8
     * sequences of up to 2048: a deterministic dP of 2 GiB, over the
     * default workspace budget where cuDNN cannot accumulate dQ in order
     * (before 9.25): given 4 GiB, so that its results are checked on any
     * cuDNN) */
    static const int packed[][6] = {{2, 300, 8, 2, 128, 40}, {1, 2048, 32, 32, 128, 700}};
    for (int i = 0; i < (cuda_test_reduced_shapes() ? 1 : 2); i++) {
        const int *p = packed[i];
        if (i == 1)
            cr_assert_eq(setenv("SPOTUNE_CUDNN_WORKSPACE_BUDGET", "4294967296", 1), 0);
        int32_t *sg = malloc(sizeof(int32_t) * 2 * (size_t)p[0] * p[1]);
        cr_assert(sg);
        size_t n;
        packed_rows(p[0], p[1], p[5], sg, sg + (size_t)p[0] * p[1]); /* pos: discarded */
        int32_t *tab = seg_with_table(sg, p[0], p[1], &n);
        check_attention_packed(p[0], p[1], p[2], p[3], p[4], 1, tab, n);
        cudnn_usable(why, sizeof why, &c1);
        cr_expect_eq(c1 - c0, 2, "packed documents, T %d: cuDNN ran %ld of its 2 calls (%s)",
                     p[1], c1 - c0, why);
        c0 = c1;
        free(tab), free(sg);
        unsetenv("SPOTUNE_CUDNN_WORKSPACE_BUDGET");
    }
    /* a workspace budget of one byte: the backward (never without one) is
     * refused, and the fused kernels run it from whichever forward ran
     * (cuDNN's stats are the fused kernels' lse): still the CPU's results */
    cr_assert_eq(setenv("SPOTUNE_CUDNN_WORKSPACE_BUDGET", "1", 1), 0);
    check_attention(1, 96, 4, 2, 64);
    unsetenv("SPOTUNE_CUDNN_WORKSPACE_BUDGET");
    cudnn_usable(why, sizeof why, &c1);
    cr_expect(c1 - c0 <= 1, "a 1-byte workspace budget: cuDNN ran %ld calls, the backward's "
              "among them", c1 - c0);
    int B = 2, T = 150, nh = 8, nkv = 2, hd = 128, ok = 0;
    size_t nq = (size_t)B * T * nh * hd, nk = (size_t)B * T * nkv * hd, nl = (size_t)B * nh * T;
    size_t ns[5] = {nq, nl, nq, nk, nk};
    const char *names[5] = {"out", "lse", "dq", "dk", "dv"};
    attn_in in = attn_inputs(B, T, nh, nkv, hd, 0);
    gpu_attn a = gpu_attention(in.q, in.k, in.v, in.dout, NULL, B, T, nh, nkv, hd);
    gpu_attn b = gpu_attention(in.q, in.k, in.v, in.dout, NULL, B, T, nh, nkv, hd);
    cudnn_usable(why, sizeof why, &c0);
    gpu_attn st = gpu_attention_strided(in.q, in.k, in.v, in.dout, NULL, B, T, nh, nkv, hd, 8, &ok);
    cudnn_usable(why, sizeof why, &c1);
    unsetenv("SPOTUNE_CUDA_ATTENTION");
    cr_expect_eq(c1 - c0, 2, "column blocks (the trainer's layout): cuDNN ran %ld of its 2 calls",
                 c1 - c0);
    cr_expect(ok, "cuDNN on column blocks: a padding column or q/k/v changed");
    for (int i = 0; i < 5; i++) {
        double e = rel_err(st.o[i], a.o[i], ns[i]), tol = i == 1 ? TOL_F32 : TOL_BF16;
        cr_expect(e <= tol, "cuDNN strided %s: rel err %.3g > %.3g", names[i], e, tol);
        cr_expect(memcmp(a.o[i], b.o[i], sizeof(float) * ns[i]) == 0,
                  "cuDNN %s: two runs differ", names[i]);
    }
    for (int i = 0; i < 5; i++)
        free(a.o[i]), free(b.o[i]), free(st.o[i]);
    attn_inputs_free(&in);
}
