/* RoPE and attention of the CUDA backend against the CPU twin (the other
 * ops: tests/test_cuda_ops.c): RoPE and its inverse, with positions of
 * packed documents; attention on small and odd shapes, packed documents,
 * several 512-row blocks and the shapes of real models (7B, 8B GQA, T 4096;
 * skipped with SPOTUNE_TEST_SHAPES=reduced), compared chunk by chunk; and
 * the fused FlashAttention-2 kernels (cuda_ops/flash_*) on odd shapes,
 * deterministic and within tolerance of the unfused path. Tolerances:
 * TOL_BF16 and TOL_F32 (cuda_ops_util.h), and those of the real shapes
 * below. Without a usable CUDA device main prints "skipped: no usable CUDA
 * device: " and the CUDA error (cuda_test_main.h), and exits 77. */
#define _POSIX_C_SOURCE 200809L /* setenv */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attn_columns.h"
#include "cuda_attention_util.h"
#include "cuda_ops_util.h"
#include "cuda_test_main.h"
#include "kernels/backend.h"

TestSuite(cuda_ops, .init = cuda_ops_setup, .fini = cuda_ops_teardown, .timeout = 300);

/* ---- RoPE ------------------------------------------------------------------------------ */

/* pos: the position of each of the B*T tokens (packed documents), or NULL */
static void check_rope_pos(int B, int T, int nh, int hd, const int32_t *pos)
{
    size_t n = (size_t)B * T * nh * hd, half = (size_t)hd / 2;
    float *x = rnd(n, 1.0f), *c = malloc(sizeof(float) * T * half), *s = malloc(sizeof(float) * T * half);
    for (int t = 0; t < T; t++)
        for (size_t i = 0; i < half; i++) {
            double th = t * pow(10000.0, -2.0 * (double)i / hd);
            c[t * half + i] = (float)cos(th);
            s[t * half + i] = (float)sin(th);
        }
    for (int inverse = 0; inverse < 2; inverse++) {
        tensor_t gx = up(gpu, gpu->act_dt, x, n), gc = up(gpu, DT_F32, c, T * half);
        tensor_t gs = up(gpu, DT_F32, s, T * half);
        tensor_t cx = up(cpu, DT_F32, x, n), cc = up(cpu, DT_F32, c, T * half);
        tensor_t cs = up(cpu, DT_F32, s, T * half);
        tensor_t gp = {0}, cp = {0};
        if (pos) {
            gp = be_alloc(gpu, DT_I32, (size_t)B * T), cp = be_alloc(cpu, DT_I32, (size_t)B * T);
            cr_assert(gp.p && cp.p);
            be_upload(gpu, gp, pos, DT_I32), be_upload(cpu, cp, pos, DT_I32);
        }
        be_rope(gpu, gx, gc, gs, gp, B, T, nh, hd, inverse);
        be_rope(cpu, cx, cc, cs, cp, B, T, nh, hd, inverse);
        gpu_ok();
        char what[96];
        snprintf(what, sizeof what, "rope B%d T%d nh%d hd%d inverse %d%s", B, T, nh, hd, inverse,
                 pos ? " packed" : "");
        expect_close(what, gx, cx, n, TOL_BF16);
        drop(gpu, &gx), drop(gpu, &gc), drop(gpu, &gs), drop(cpu, &cx), drop(cpu, &cc), drop(cpu, &cs);
        if (pos)
            drop(gpu, &gp), drop(cpu, &cp);
    }
    free(x), free(c), free(s);
}

static void check_rope(int B, int T, int nh, int hd)
{
    check_rope_pos(B, T, nh, hd, NULL);
}

Test(cuda_ops, rope_and_its_inverse)
{
    check_rope(2, 5, 3, 8);
    check_rope(1, 17, 2, 64);
    check_rope(3, 33, 4, 128);
}

Test(cuda_ops, rope_positions_of_packed_documents)
{
    int B = 2, T = 300;
    int32_t *seg = malloc(sizeof(int32_t) * B * T), *pos = malloc(sizeof(int32_t) * B * T);
    packed_rows(B, T, 70, seg, pos);
    check_rope_pos(B, T, 4, 64, pos);
    free(seg), free(pos);
}

/* ---- attention ------------------------------------------------------------------------- */

/* Real shapes: the attention tensors [B,T,heads,hd] are also compared chunk
 * by chunk, (batch row, head, 256 query rows) each against its own largest
 * value, so that a wrong head, kv-head chunk or row block cannot hide behind
 * larger values elsewhere, and as a whole by the relative RMS error
 * ||gpu - cpu|| / ||cpu||.
 *
 * Why these tolerances (bf16): the GPU rounds P to bf16 before P V and the
 * output to bf16 (2^-9 = 2e-3 relative each, random); in the backward dS =
 * P (dP - D) / sqrt(hd) is rounded to bf16 before dS K and dS^T Q, and a
 * row of dS sums to zero (D = rowsum(dO * O) is the P-weighted mean of dP):
 * that cancellation leaves dQ = dS K much smaller than the sum of its terms'
 * sizes while the roundings of dS do not cancel, so dQ and dK carry the
 * largest relative error. A float64 emulation of exactly these roundings
 * (P, O, dS and the outputs rounded to bf16, fp32 sums) on uniform inputs
 * like these gives, at T 2048 hd 128 and T 4096 hd 64: out 3.7-4.0e-3
 * chunkwise and 2.3e-3 RMS; dQ 3.9-4.6e-3 and 2.9e-3; dK 4.1-4.8e-3 and
 * 2.9e-3; dV 4.0e-3 and 2.3e-3. TOL_BLOCK and TOL_RMS are twice the worst of
 * these. A masking error of one key at a row-block boundary already moves a
 * chunk by about 2%; a wrong head or chunk mapping by O(1). lse is F32 from
 * fp32 scores on both sides: TOL_F32 (the emulation: 1e-7). */
#define TOL_BLOCK 1e-2
#define TOL_RMS 6e-3

static void expect_close_chunks(const char *what, tensor_t g, tensor_t c, int B, int T, int heads,
                                int hd)
{
    float *a = down(gpu, g), *b = down(cpu, c);
    size_t n = (size_t)B * T * heads * hd;
    double worst = 0, se = 0, sr = 0;
    int worst_b = 0, worst_h = 0, worst_t = 0;
    for (int bb = 0; bb < B; bb++)
        for (int h = 0; h < heads; h++)
            for (int t0 = 0; t0 < T; t0 += 256) {
                double m = 0, e = 0;
                for (int t = t0; t < T && t < t0 + 256; t++) {
                    size_t base = (((size_t)bb * T + t) * heads + h) * hd;
                    for (int d = 0; d < hd; d++) {
                        double want = b[base + d], diff = fabs((double)a[base + d] - want);
                        if (fabs(want) > m)
                            m = fabs(want);
                        if (diff > e || diff != diff)
                            e = diff != diff ? INFINITY : diff;
                    }
                }
                double r = m > 0 ? e / m : e;
                if (r > worst || r != r)
                    worst = r != r ? INFINITY : r, worst_b = bb, worst_h = h, worst_t = t0;
            }
    for (size_t i = 0; i < n; i++) {
        double d = (double)a[i] - b[i];
        se += d * d;
        sr += (double)b[i] * b[i];
    }
    double rms = sr > 0 ? sqrt(se / sr) : sqrt(se);
    if (rms != rms)
        rms = INFINITY;
    cr_expect(worst <= TOL_BLOCK,
              "%s: chunk (batch %d, head %d, rows %d..%d) rel err %.3g > %.3g", what, worst_b,
              worst_h, worst_t, worst_t + 255, worst, TOL_BLOCK);
    cr_expect(rms <= TOL_RMS, "%s: relative RMS error %.3g > %.3g", what, rms, TOL_RMS);
    fprintf(stderr, "%s: worst chunk %.2e (batch %d head %d rows %d..), RMS %.2e\n", what, worst,
            worst_b, worst_h, worst_t, rms);
    free(a);
    free(b);
}

/* max |x| <= tol (absolute): a tensor that is zero but for rounding */
#define TOL_ZERO 1e-4
static void expect_small(const char *what, tensor_t g, size_t n, double tol)
{
    float *a = down(gpu, g);
    double m = 0;
    for (size_t i = 0; i < n; i++)
        if (fabs((double)a[i]) > m || a[i] != a[i])
            m = a[i] != a[i] ? INFINITY : fabs((double)a[i]);
    cr_expect(m <= tol, "%s: max |x| %.3g > %.3g (should be 0 up to rounding)", what, m, tol);
    free(a);
}

/* seg: packed documents ([B*T] first keys, backend.h; seg_n entries of it
 * on the GPU: with the document table after them, or not), or NULL */
void check_attention_packed(int B, int T, int nh, int nkv, int hd, int chunks, const int32_t *seg,
                            size_t seg_n)
{
    size_t nq = (size_t)B * T * nh * hd, nk = (size_t)B * T * nkv * hd, nl = (size_t)B * nh * T;
    float *q = rnd(nq, 1.5f), *k = rnd(nk, 1.5f), *v = rnd(nk, 1.0f), *dout = rnd(nq, 1.0f);
    dtype_t a = gpu->act_dt;
    tensor_t gq = up(gpu, a, q, nq), gk = up(gpu, a, k, nk), gv = up(gpu, a, v, nk);
    tensor_t go = up(gpu, a, NULL, nq), gl = up(gpu, DT_F32, NULL, nl), gdo = up(gpu, a, dout, nq);
    tensor_t gdq = up(gpu, a, NULL, nq), gdk = up(gpu, a, NULL, nk), gdv = up(gpu, a, NULL, nk);
    tensor_t cq = up(cpu, DT_F32, q, nq), ck = up(cpu, DT_F32, k, nk), cv = up(cpu, DT_F32, v, nk);
    tensor_t co = up(cpu, DT_F32, NULL, nq), cl = up(cpu, DT_F32, NULL, nl);
    tensor_t cdo = up(cpu, DT_F32, dout, nq), cdq = up(cpu, DT_F32, NULL, nq);
    tensor_t cdk = up(cpu, DT_F32, NULL, nk), cdv = up(cpu, DT_F32, NULL, nk);
    tensor_t gsg = {0}, csg = {0};
    if (seg) {
        gsg = be_alloc(gpu, DT_I32, seg_n), csg = be_alloc(cpu, DT_I32, (size_t)B * T);
        cr_assert(gsg.p && csg.p);
        be_upload(gpu, gsg, seg, DT_I32), be_upload(cpu, csg, seg, DT_I32);
    }
    be_attention_forward(gpu, go, gl, gq, gk, gv, gsg, B, T, nh, nkv, hd);
    be_attention_forward(cpu, co, cl, cq, ck, cv, csg, B, T, nh, nkv, hd);
    gpu_ok();
    char what[128];
    snprintf(what, sizeof what, "attention B%d T%d nh%d nkv%d hd%d%s", B, T, nh, nkv, hd,
             !seg ? "" : seg_n > (size_t)B * T ? " packed (document table)" : " packed");
    char w2[160];
    snprintf(w2, sizeof w2, "%s out", what);
    expect_close(w2, go, co, nq, TOL_BF16);
    if (chunks)
        expect_close_chunks(w2, go, co, B, T, nh, hd);
    snprintf(w2, sizeof w2, "%s lse", what);
    expect_close(w2, gl, cl, nl, TOL_F32);
    /* the backward from the same forward output on both sides (the GPU's,
     * rounded to bf16, is what the model keeps) */
    float *o = down(gpu, go);
    be_upload(cpu, co, o, DT_F32);
    free(o);
    be_attention_backward(gpu, gdq, gdk, gdv, gdo, go, gl, gq, gk, gv, gsg, B, T, nh, nkv, hd);
    be_attention_backward(cpu, cdq, cdk, cdv, cdo, co, cl, cq, ck, cv, csg, B, T, nh, nkv, hd);
    gpu_ok();
    if (T == 1) {
        /* one key: P = 1 and dS = P (dP - D) = 0, so dq and dk are rounding
         * noise on both sides (no relative comparison); inputs are O(1) */
        expect_small("attention T1 dq", gdq, nq, TOL_ZERO);
        expect_small("attention T1 dk", gdk, nk, TOL_ZERO);
    } else {
        snprintf(w2, sizeof w2, "%s dq", what);
        expect_close(w2, gdq, cdq, nq, TOL_BF16);
        if (chunks)
            expect_close_chunks(w2, gdq, cdq, B, T, nh, hd);
        snprintf(w2, sizeof w2, "%s dk", what);
        expect_close(w2, gdk, cdk, nk, TOL_BF16);
        if (chunks)
            expect_close_chunks(w2, gdk, cdk, B, T, nkv, hd);
    }
    snprintf(w2, sizeof w2, "%s dv", what);
    expect_close(w2, gdv, cdv, nk, TOL_BF16);
    if (chunks)
        expect_close_chunks(w2, gdv, cdv, B, T, nkv, hd);
    tensor_t gs[] = {gq, gk, gv, go, gl, gdo, gdq, gdk, gdv};
    tensor_t cs[] = {cq, ck, cv, co, cl, cdo, cdq, cdk, cdv};
    for (int i = 0; i < 9; i++)
        drop(gpu, &gs[i]), drop(cpu, &cs[i]);
    if (seg)
        drop(gpu, &gsg), drop(cpu, &csg);
    free(q), free(k), free(v), free(dout);
}

static void check_attention_seg(int B, int T, int nh, int nkv, int hd, int chunks,
                                const int32_t *seg)
{
    check_attention_packed(B, T, nh, nkv, hd, chunks, seg, (size_t)B * T);
}

void check_attention_at(int B, int T, int nh, int nkv, int hd, int chunks)
{
    check_attention_seg(B, T, nh, nkv, hd, chunks, NULL);
}

void check_attention(int B, int T, int nh, int nkv, int hd)
{
    check_attention_at(B, T, nh, nkv, hd, 0);
}

Test(cuda_ops, attention_small_and_odd_shapes)
{
    check_attention(1, 1, 1, 1, 8);
    check_attention(2, 7, 6, 2, 8);   /* grouped: 3 query heads per kv head */
    check_attention(1, 33, 4, 4, 16);
    check_attention(2, 65, 8, 2, 32);
    check_attention(1, 11, 3, 1, 5);  /* odd head_dim, one kv head */
}

/* Packed documents (data.packing): short rows, and rows whose documents
 * cross the 512-row blocks, against the CPU backend's masked attention
 * (itself checked against a per-document reference in
 * tests/test_ops_attention.c). */
Test(cuda_ops, attention_packed_documents)
{
    int32_t *seg = malloc(sizeof(int32_t) * 2 * 1031), *pos = malloc(sizeof(int32_t) * 2 * 1031);
    packed_rows(2, 37, 9, seg, pos);
    check_attention_seg(2, 37, 6, 2, 16, 0, seg);
    packed_rows(2, 1031, 400, seg, pos);
    check_attention_seg(2, 1031, 4, 2, 64, 1, seg);
    check_attention_seg(2, 1031, 4, 2, 80, 1, seg); /* the unfused path */
    free(seg), free(pos);
}

/* hd 64 goes to the fused kernels; hd 96 and 80 (models the fused kernels
 * do not take) to the unfused path, whose 512-row blocks these cross */
Test(cuda_ops, attention_several_row_blocks)
{
    check_attention(1, 600, 2, 1, 64);  /* T > 512: two query-row blocks */
    check_attention(2, 1031, 4, 2, 64); /* three blocks, odd T */
    check_attention(1, 600, 2, 1, 96);
    check_attention(2, 1031, 4, 2, 80);
}

/* The shapes of real models, checked chunk by chunk (expect_close_chunks):
 * four 512-row blocks per head at T 2048, eight at T 4096; the backward's
 * kv heads in chunks (e.g. 21 + 11 heads at 7B), and the batched products
 * whose outputs interleave across heads. */
static void skip_if_reduced(void)
{
    if (cuda_test_reduced_shapes())
        cr_skip_test("real shapes skipped: SPOTUNE_TEST_SHAPES=reduced");
}

Test(cuda_ops, attention_llama2_7b_shape_t2048_32_heads_hd128)
{
    skip_if_reduced();
    check_attention_at(1, 2048, 32, 32, 128, 1);
}

Test(cuda_ops, attention_llama3_8b_gqa_shape_t2048_32_heads_8_kv_hd128)
{
    skip_if_reduced();
    check_attention_at(1, 2048, 32, 8, 128, 1);
}

Test(cuda_ops, attention_t4096_hd64_32_heads_8_kv)
{
    skip_if_reduced();
    check_attention_at(1, 4096, 32, 8, 64, 1);
}

/* A real shape on the unfused path (SPOTUNE_CUDA_ATTENTION=unfused, read on
 * each call; each test is a process of its own): its 512-row blocks and
 * kv-head chunks, which the fused kernels otherwise take from it. */
Test(cuda_ops, attention_unfused_llama3_8b_gqa_shape_t2048)
{
    skip_if_reduced();
    setenv("SPOTUNE_CUDA_ATTENTION", "unfused", 1);
    check_attention_at(1, 2048, 32, 8, 128, 1);
    unsetenv("SPOTUNE_CUDA_ATTENTION");
}

/* ---- the fused kernels (kernels/cuda/cuda_flash.cu) ---------------------------------
 * BF16 with hd 64 or 128 runs the fused FlashAttention-2 kernels (the shapes
 * above with hd 64 and 128 do too). Here the odd shapes: T 1, 7, 37, 130 (the
 * forward's 64-row and 64-key tiles and the dK/dV kernel's 32-row tiles all
 * partial), GQA groups 1, 4, 8, with and without packed documents (up to 50
 * tokens, crossing tiles), against the CPU backend chunk by chunk, with the
 * tolerances of the unfused path (same roundings: P and dS to bf16). */
static void check_flash_shapes(int hd, int packed)
{
    static const int Ts[] = {1, 7, 37, 130};
    static const int heads[][2] = {{2, 2}, {4, 1}, {8, 1}};
    int32_t seg[2 * 130], pos[2 * 130];
    for (int i = 0; i < 4; i++)
        for (int g = 0; g < 3; g++) {
            if (packed)
                packed_rows(2, Ts[i], 50, seg, pos);
            check_attention_seg(2, Ts[i], heads[g][0], heads[g][1], hd, 1, packed ? seg : NULL);
        }
}

Test(cuda_ops, flash_attention_odd_shapes_hd64)
{
    check_flash_shapes(64, 0);
}

Test(cuda_ops, flash_attention_odd_shapes_hd128)
{
    check_flash_shapes(128, 0);
}

Test(cuda_ops, flash_attention_odd_shapes_packed_documents)
{
    check_flash_shapes(64, 1);
    check_flash_shapes(128, 1);
}

/* The fused kernels have no atomics: two runs give the same bits. The
 * unfused path (SPOTUNE_CUDA_ATTENTION=unfused) agrees within TOL_BF16
 * (lse TOL_F32) but not bit for bit (other summation orders), which also
 * shows that the fused kernels ran in the first place. */
Test(cuda_ops, flash_attention_is_deterministic_and_agrees_with_unfused)
{
    int B = 2, T = 300, nh = 8, nkv = 2, hd = 128;
    size_t nq = (size_t)B * T * nh * hd, nk = (size_t)B * T * nkv * hd, nl = (size_t)B * nh * T;
    size_t ns[5] = {nq, nl, nq, nk, nk};
    const char *names[5] = {"out", "lse", "dq", "dk", "dv"};
    float *q = rnd(nq, 1.5f), *k = rnd(nk, 1.5f), *v = rnd(nk, 1.0f), *dout = rnd(nq, 1.0f);
    int32_t seg[2 * 300], pos[2 * 300];
    packed_rows(B, T, 120, seg, pos);
    gpu_attn a = gpu_attention(q, k, v, dout, seg, B, T, nh, nkv, hd);
    gpu_attn b = gpu_attention(q, k, v, dout, seg, B, T, nh, nkv, hd);
    cr_assert_eq(setenv("SPOTUNE_CUDA_ATTENTION", "unfused", 1), 0);
    gpu_attn u = gpu_attention(q, k, v, dout, seg, B, T, nh, nkv, hd);
    unsetenv("SPOTUNE_CUDA_ATTENTION");
    int differs = 0;
    for (int i = 0; i < 5; i++) {
        cr_expect(memcmp(a.o[i], b.o[i], sizeof(float) * ns[i]) == 0, "fused %s: runs differ",
                  names[i]);
        double e = rel_err(a.o[i], u.o[i], ns[i]), tol = i == 1 ? TOL_F32 : TOL_BF16;
        cr_expect(e <= tol, "fused vs unfused %s: rel err %.3g > %.3g", names[i], e, tol);
        differs |= memcmp(a.o[i], u.o[i], sizeof(float) * ns[i]) != 0;
    }
    if (!cuda_test_standin()) /* a stand-in backend has one attention */
        cr_expect(differs,
                  "fused and unfused results are bit-identical: the fused kernels did not run");
    for (int i = 0; i < 5; i++)
        free(a.o[i]), free(b.o[i]), free(u.o[i]);
    free(q), free(k), free(v), free(dout);
}

/* ---- row strides: q, k, v as the column blocks of one matrix ---------------------- */

#define PAD_VALUE 1024.0f /* what the padding columns hold (exact in bf16) */

/* gpu_attention with q, k, v read as the column blocks of one [B T, qd +
 * 2 kvd + pad] matrix and dq, dk, dv written as those of another (the
 * trainer's layout of the fused q/k/v product), the pad columns of both
 * holding PAD_VALUE; the outputs as contiguous host arrays, and *pad_ok 0
 * when a pad column (or q) changed. */
gpu_attn gpu_attention_strided(const float *q, const float *k, const float *v,
                               const float *dout, const int32_t *seg, int B, int T, int nh,
                               int nkv, int hd, int pad, int *pad_ok)
{
    int qd = nh * hd, kvd = nkv * hd, N = qd + 2 * kvd + pad, rows = B * T;
    size_t nm = (size_t)rows * N, nq = (size_t)rows * qd, nl = (size_t)B * nh * T;
    float *in = malloc(sizeof(float) * nm), *gr = malloc(sizeof(float) * nm);
    cr_assert(in && gr);
    attn_to_columns(in, N, q, k, v, rows, qd, kvd, PAD_VALUE);
    for (size_t i = 0; i < nm; i++)
        gr[i] = PAD_VALUE;
    dtype_t a = gpu->act_dt;
    tensor_t gin = up(gpu, a, in, nm), ggr = up(gpu, a, gr, nm);
    tensor_t go = up(gpu, a, NULL, nq), gl = up(gpu, DT_F32, NULL, nl), gdo = up(gpu, a, dout, nq);
    tensor_t gsg = {0};
    if (seg) {
        gsg = be_alloc(gpu, DT_I32, (size_t)rows);
        cr_assert(gsg.p);
        be_upload(gpu, gsg, seg, DT_I32);
    }
    float *in_before = down(gpu, gin); /* (rounded to the activations' dtype) */
    tensor_t gk = tensor_view(gin, (size_t)qd, nm - (size_t)qd);
    tensor_t gv = tensor_view(gin, (size_t)(qd + kvd), nm - (size_t)(qd + kvd));
    tensor_t dk = tensor_view(ggr, (size_t)qd, nm - (size_t)qd);
    tensor_t dv = tensor_view(ggr, (size_t)(qd + kvd), nm - (size_t)(qd + kvd));
    be_attention_forward_ld(gpu, go, gl, gin, gk, gv, gsg, B, T, nh, nkv, hd, N, N);
    be_attention_backward_ld(gpu, ggr, dk, dv, gdo, go, gl, gin, gk, gv, gsg, B, T, nh, nkv, hd,
                             N, N, N, N);
    gpu_ok();
    gpu_attn r;
    r.grew = 0;
    r.o[0] = down(gpu, go), r.o[1] = down(gpu, gl);
    float *g = down(gpu, ggr), *in_after = down(gpu, gin);
    for (int i = 2; i < 5; i++) {
        r.o[i] = malloc(sizeof(float) * (size_t)rows * (i == 2 ? qd : kvd));
        cr_assert(r.o[i]);
    }
    *pad_ok = memcmp(in_before, in_after, sizeof(float) * nm) == 0 &&
              attn_from_columns(g, N, r.o[2], r.o[3], r.o[4], rows, qd, kvd, PAD_VALUE);
    tensor_t gs[] = {gin, ggr, go, gl, gdo};
    for (int i = 0; i < 5; i++)
        drop(gpu, &gs[i]);
    if (seg)
        drop(gpu, &gsg);
    free(in), free(gr), free(g), free(in_before), free(in_after);
    return r;
}

/* The trainer's fused q/k/v layout (backend.h's row strides): each
 * attention with q, k, v and their gradients as the column blocks of
 * wider matrices against the same attention on contiguous tensors: the
 * fused kernels (the stored dS, recomputing dQ, the wgmma kernels where
 * they run) the same bits, as only their addresses differ; the unfused
 * path within TOL_BF16 (lse TOL_F32: its products' plans differ with the
 * strides); nothing outside the blocks written, q, k, v unchanged.
 * hd 128 GQA with packed documents and 8 padding columns, hd 64 MHA with
 * none (the layout itself); and a row stride not a multiple of 8
 * elements, which the fused kernels leave to the unfused path. */
Test(cuda_ops, attention_on_column_blocks_matches_contiguous)
{
    static const char *modes[] = {NULL, "fused-recompute", "fused-wgmma", "unfused"};
    static const int shapes[][6] = {{2, 150, 8, 2, 128, 8}, {1, 97, 4, 4, 64, 0},
                                    {1, 70, 2, 1, 64, 4}};
    for (int si = 0; si < 3; si++) {
        int B = shapes[si][0], T = shapes[si][1], nh = shapes[si][2], nkv = shapes[si][3];
        int hd = shapes[si][4], pad = shapes[si][5];
        size_t nq = (size_t)B * T * nh * hd, nk = (size_t)B * T * nkv * hd, nl = (size_t)B * nh * T;
        size_t ns[5] = {nq, nl, nq, nk, nk};
        const char *names[5] = {"out", "lse", "dq", "dk", "dv"};
        float *q = rnd(nq, 1.5f), *k = rnd(nk, 1.5f), *v = rnd(nk, 1.0f), *dout = rnd(nq, 1.0f);
        int32_t *seg = malloc(sizeof(int32_t) * (size_t)B * T);
        int32_t *pos = malloc(sizeof(int32_t) * (size_t)B * T);
        cr_assert(seg && pos);
        packed_rows(B, T, 60, seg, pos);
        for (size_t mi = 0; mi < sizeof modes / sizeof modes[0]; mi++) {
            if (modes[mi])
                cr_assert_eq(setenv("SPOTUNE_CUDA_ATTENTION", modes[mi], 1), 0);
            /* a stride not a multiple of 8: the unfused path either way */
            int fused = !(modes[mi] && !strcmp(modes[mi], "unfused")) && pad % 8 == 0;
            int ok = 0;
            gpu_attn c = gpu_attention(q, k, v, dout, seg, B, T, nh, nkv, hd);
            gpu_attn st = gpu_attention_strided(q, k, v, dout, seg, B, T, nh, nkv, hd, pad, &ok);
            unsetenv("SPOTUNE_CUDA_ATTENTION");
            cr_expect(ok, "%s B%d T%d nh%d nkv%d hd%d pad %d: a padding column or q/k/v changed",
                      modes[mi] ? modes[mi] : "default", B, T, nh, nkv, hd, pad);
            for (int i = 0; i < 5; i++) {
                double e = rel_err(st.o[i], c.o[i], ns[i]), tol = i == 1 ? TOL_F32 : TOL_BF16;
                if (fused && pad % 8 == 0 && !cuda_test_standin())
                    cr_expect(memcmp(st.o[i], c.o[i], sizeof(float) * ns[i]) == 0,
                              "%s B%d T%d nh%d nkv%d hd%d pad %d: strided %s differs from "
                              "contiguous (rel err %.3g)", modes[mi] ? modes[mi] : "default", B,
                              T, nh, nkv, hd, pad, names[i], e);
                else
                    cr_expect(e <= tol, "%s B%d T%d nh%d nkv%d hd%d pad %d: strided %s: rel err "
                                        "%.3g > %.3g", modes[mi] ? modes[mi] : "default", B, T,
                              nh, nkv, hd, pad, names[i], e, tol);
            }
            for (int i = 0; i < 5; i++)
                free(c.o[i]), free(st.o[i]);
        }
        free(q), free(k), free(v), free(dout), free(seg), free(pos);
    }
}

/* dQ three ways (SPOTUNE_CUDA_ATTENTION and SPOTUNE_CUDA_FLASH_DS_BUDGET, read
 * on each call): recomputing S and dP (fused-recompute); from the dS the
 * dK/dV kernel stores, in two chunks of one head (a budget of one head's
 * dS, 153 tiles of 8 KiB at T 1031) and in one (the default here); and a
 * budget too small for one head, which falls back to recomputing. Seen
 * by the scratch: 1 MiB for D (recomputing), 2 MiB with one head's dS, 3
 * with both (the scratch grows in whole MiB and never shrinks, so the
 * order matters). Each within tolerance of the CPU (check_attention_seg,
 * its own inputs); chunking changes no bit; dK and dV are the same
 * kernel's sums either way (the same bits); the fallback is the
 * recomputing path bit for bit. */
Test(cuda_ops, flash_attention_dq_stored_in_chunks_or_recomputed)
{
    int B = 1, T = 1031, nh = 2, nkv = 2, hd = 128;
    size_t nq = (size_t)B * T * nh * hd, nk = (size_t)B * T * nkv * hd, nl = (size_t)B * nh * T;
    size_t ns[5] = {nq, nl, nq, nk, nk}, mib = (size_t)1 << 20;
    const char *names[5] = {"out", "lse", "dq", "dk", "dv"};
    float *q = rnd(nq, 1.5f), *k = rnd(nk, 1.5f), *v = rnd(nk, 1.0f), *dout = rnd(nq, 1.0f);
    int32_t *seg = malloc(sizeof(int32_t) * T), *pos = malloc(sizeof(int32_t) * T);
    cr_assert(seg && pos);
    packed_rows(B, T, 400, seg, pos);
    const size_t head_ds = 153 * 64 * 64 * 2; /* 17 key blocks: 17 x 18 / 2 tiles */
    char budget[32];
    snprintf(budget, sizeof budget, "%zu", head_ds);

    cr_assert_eq(setenv("SPOTUNE_CUDA_ATTENTION", "fused-recompute", 1), 0);
    gpu_attn r = gpu_attention(q, k, v, dout, seg, B, T, nh, nkv, hd);
    check_attention_seg(B, T, nh, nkv, hd, 1, seg);
    unsetenv("SPOTUNE_CUDA_ATTENTION");
    cr_assert_eq(setenv("SPOTUNE_CUDA_FLASH_DS_BUDGET", budget, 1), 0);
    gpu_attn c = gpu_attention(q, k, v, dout, seg, B, T, nh, nkv, hd);
    check_attention_seg(B, T, nh, nkv, hd, 1, seg);
    unsetenv("SPOTUNE_CUDA_FLASH_DS_BUDGET");
    gpu_attn s = gpu_attention(q, k, v, dout, seg, B, T, nh, nkv, hd);
    check_attention_seg(B, T, nh, nkv, hd, 1, seg);
    cr_assert_eq(setenv("SPOTUNE_CUDA_FLASH_DS_BUDGET", "1", 1), 0);
    gpu_attn f = gpu_attention(q, k, v, dout, seg, B, T, nh, nkv, hd);
    unsetenv("SPOTUNE_CUDA_FLASH_DS_BUDGET");

    if (!cuda_test_standin()) { /* a stand-in backend has one attention, no scratch */
        cr_expect(r.grew <= mib, "recomputing dQ: the backward added %zu bytes (D: 1 MiB)", r.grew);
        cr_expect(c.grew == mib, "dS in chunks of one head: the backward added %zu bytes, not "
                                 "the 1 MiB of one head's %zu", c.grew, head_ds);
        cr_expect(s.grew == mib, "dS in one chunk: the backward added %zu bytes, not 1 MiB more "
                                 "for the second head", s.grew);
        cr_expect(f.grew == 0, "a budget under one head's dS: the backward added %zu bytes",
                  f.grew);
    }
    for (int i = 0; i < 5; i++) {
        cr_expect(memcmp(c.o[i], s.o[i], sizeof(float) * ns[i]) == 0,
                  "%s: two chunks and one differ", names[i]);
        cr_expect(memcmp(f.o[i], r.o[i], sizeof(float) * ns[i]) == 0,
                  "%s: the fallback differs from fused-recompute", names[i]);
        if (i != 2)
            cr_expect(memcmp(s.o[i], r.o[i], sizeof(float) * ns[i]) == 0,
                      "%s: differs between stored and recomputed dQ", names[i]);
    }
    double e = rel_err(s.o[2], r.o[2], nq);
    cr_expect(e <= TOL_BF16, "dq stored vs recomputed: rel err %.3g > %.3g", e, TOL_BF16);
    for (int i = 0; i < 5; i++)
        free(r.o[i]), free(c.o[i]), free(s.o[i]), free(f.o[i]);
    free(q), free(k), free(v), free(dout), free(seg), free(pos);
}

/* The forward and the dK/dV kernel by warpgroup products
 * (SPOTUNE_CUDA_ATTENTION=fused-wgmma, kernels/cuda/cuda_flash_wgmma.cu).
 * Where they run (a GPU of compute capability 9.0 with the sm_90a build,
 * and the emulated device): against the CPU like every fused path
 * (check_attention_seg, odd shapes, packed documents, both head dims),
 * and against the mma.sync kernels on the same inputs: the same numbers
 * on the emulated device (the same products in the same order there; a
 * zero may differ in sign), within the bf16 tolerance on a GPU (its
 * tensor cores' order within a product is its own). Where they cannot
 * run, the backend says so (cuda_flash_wgmma_selected) and the mma.sync
 * kernels run: the same bits as without the variable. */
static int wgmma_selected(void)
{
    char why[256];
    void *sym = backend_cuda_symbol("cuda_flash_wgmma_selected", why, sizeof why);
    int (*fn)(backend_t *);
    cr_assert(sym || cuda_test_standin(), "cuda_flash_wgmma_selected: %s", why);
    if (!sym)
        return 0;
    memcpy(&fn, &sym, sizeof fn);
    return fn(gpu);
}

static void check_wgmma(int B, int T, int nh, int nkv, int hd, int max_doc)
{
    size_t nq = (size_t)B * T * nh * hd, nk = (size_t)B * T * nkv * hd, nl = (size_t)B * nh * T;
    attn_in in = attn_inputs(B, T, nh, nkv, hd, max_doc);
    gpu_attn m = gpu_attention(in.q, in.k, in.v, in.dout, in.seg, B, T, nh, nkv, hd);
    cr_assert_eq(setenv("SPOTUNE_CUDA_ATTENTION", "fused-wgmma", 1), 0);
    int sel = wgmma_selected();
    gpu_attn w = gpu_attention(in.q, in.k, in.v, in.dout, in.seg, B, T, nh, nkv, hd);
    check_attention_seg(B, T, nh, nkv, hd, 1, in.seg);
    unsetenv("SPOTUNE_CUDA_ATTENTION");
    int emulated = strstr(gpu->device_name, "emulated") != NULL;
    if (!cuda_test_standin())
        cr_expect(sel || !emulated, "the emulated device does not run the wgmma kernels");
    size_t ns[5] = {nq, nl, nq, nk, nk};
    const char *names[5] = {"out", "lse", "dq", "dk", "dv"};
    for (int i = 0; i < 5; i++) {
        size_t differ = 0;
        for (size_t j = 0; j < ns[i]; j++)
            differ += !(m.o[i][j] == w.o[i][j]);
        int same = sel ? differ == 0 : memcmp(m.o[i], w.o[i], sizeof(float) * ns[i]) == 0;
        double e = rel_err(w.o[i], m.o[i], ns[i]), tol = i == 1 ? TOL_F32 : TOL_BF16;
        if (!sel || emulated)
            cr_expect(same, "B%d T%d nh%d nkv%d hd%d: %s differs from the mma.sync kernels' in "
                            "%zu of %zu (rel err %.3g)%s", B, T, nh, nkv, hd, names[i], differ,
                      ns[i], e, sel ? "" : ", where the wgmma kernels do not run");
        else
            cr_expect(e <= tol, "B%d T%d nh%d nkv%d hd%d: wgmma vs mma.sync %s: rel err %.3g > "
                                "%.3g", B, T, nh, nkv, hd, names[i], e, tol);
    }
    for (int i = 0; i < 5; i++)
        free(m.o[i]), free(w.o[i]);
    attn_inputs_free(&in);
}

/* The forward and dK/dV kernels with the operands they reuse (Q; K and V)
 * staged in shared memory (the default) against the ones holding them in
 * registers (SPOTUNE_CUDA_ATTENTION=fused-regs): the same fragments reach
 * the same products in the same order, so every output is the same bits,
 * on a GPU as on the emulated device: grouped-query attention split by
 * query head (the fp32 shares) and by kv head, packed documents, odd T,
 * both head dims. */
static void check_regs(int B, int T, int nh, int nkv, int hd, int max_doc)
{
    size_t nq = (size_t)B * T * nh * hd, nk = (size_t)B * T * nkv * hd, nl = (size_t)B * nh * T;
    attn_in in = attn_inputs(B, T, nh, nkv, hd, max_doc);
    gpu_attn m = gpu_attention(in.q, in.k, in.v, in.dout, in.seg, B, T, nh, nkv, hd);
    check_attention_seg(B, T, nh, nkv, hd, 1, in.seg);
    cr_assert_eq(setenv("SPOTUNE_CUDA_ATTENTION", "fused-regs", 1), 0);
    gpu_attn r = gpu_attention(in.q, in.k, in.v, in.dout, in.seg, B, T, nh, nkv, hd);
    unsetenv("SPOTUNE_CUDA_ATTENTION");
    size_t ns[5] = {nq, nl, nq, nk, nk};
    const char *names[5] = {"out", "lse", "dq", "dk", "dv"};
    for (int i = 0; i < 5; i++)
        cr_expect(memcmp(m.o[i], r.o[i], sizeof(float) * ns[i]) == 0,
                  "B%d T%d nh%d nkv%d hd%d: %s with the operands in registers differs from staged "
                  "(rel err %.3g)", B, T, nh, nkv, hd, names[i], rel_err(r.o[i], m.o[i], ns[i]));
    for (int i = 0; i < 5; i++)
        free(m.o[i]), free(r.o[i]);
    attn_inputs_free(&in);
}

Test(cuda_ops, flash_attention_operands_staged_or_in_registers)
{
    check_regs(2, 37, 4, 1, 64, 0);
    check_regs(1, 130, 8, 1, 128, 0);
    check_regs(2, 300, 8, 2, 128, 120);
}

/* Which variants the backend picks: the staged operands
 * (cuda_flash_operands_staged) at head dim 128 only, and only where a
 * multiprocessor still holds as many blocks with them (three forward
 * blocks of 52 KiB, two dK/dV blocks of 70 KiB, and the runtime's 1 KiB
 * each); registers where it would not (an sm_86 or sm_89 GPU's 100 KiB; on
 * the emulated device SPOTUNE_CUDA_EMU_SMEM_PER_SM says how much it has,
 * 228 KiB unset), and with SPOTUNE_CUDA_ATTENTION=fused-regs. dQ from the
 * stored dS with two buffers (cuda_flash_dq_double_buffered) where four
 * blocks of 52 KiB fit (head dim 128; 36 KiB at 64), else one. */
Test(cuda_ops, flash_attention_operands_staged_where_shared_memory_holds_them)
{
    char why[256];
    void *sym = backend_cuda_symbol("cuda_flash_operands_staged", why, sizeof why);
    if (cuda_test_standin() && !sym)
        cr_skip_test("a stand-in backend has one attention");
    cr_assert(sym, "cuda_flash_operands_staged: %s", why);
    void (*staged)(backend_t *, int, int *, int *);
    memcpy(&staged, &sym, sizeof staged);
    sym = backend_cuda_symbol("cuda_flash_dq_double_buffered", why, sizeof why);
    cr_assert(sym, "cuda_flash_dq_double_buffered: %s", why);
    int (*two)(backend_t *, int);
    memcpy(&two, &sym, sizeof two);
    int fwd = -1, dkdv = -1;
    staged(gpu, 64, &fwd, &dkdv);
    cr_expect(fwd == 0 && dkdv == 0, "head dim 64: forward %d, dK/dV %d staged", fwd, dkdv);
    cr_assert_eq(setenv("SPOTUNE_CUDA_ATTENTION", "fused-regs", 1), 0);
    staged(gpu, 128, &fwd, &dkdv);
    unsetenv("SPOTUNE_CUDA_ATTENTION");
    cr_expect(fwd == 0 && dkdv == 0, "fused-regs: forward %d, dK/dV %d staged", fwd, dkdv);
    if (!strstr(gpu->device_name, "emulated")) {
        staged(gpu, 128, &fwd, &dkdv); /* this GPU's own answer, whatever it is */
        cr_log_info("head dim 128 on %s: forward %s, dK/dV %s, dQ from %d buffer(s)",
                    gpu->device_name, fwd ? "staged" : "in registers",
                    dkdv ? "staged" : "in registers", two(gpu, 128) ? 2 : 1);
        return;
    }
    static const struct {
        const char *bytes;
        int fwd, dkdv, dq128, dq64;
    } gpus[] = {{NULL, 1, 1, 1, 1},         /* H100, H200: 228 KiB */
                {"217088", 1, 1, 1, 1},     /* four dQ blocks of 52 + 1 KiB, exactly */
                {"217087", 1, 1, 0, 1},     /* a byte short of them */
                {"167936", 1, 1, 0, 1},     /* A100: 164 KiB */
                {"159744", 1, 1, 0, 1},     /* three forward blocks of 51 + 1 KiB, exactly */
                {"159743", 0, 1, 0, 1},     /* a byte short of them */
                {"151552", 0, 1, 0, 1},     /* 148 KiB: two 70 KiB blocks, not three of 52 */
                {"102400", 0, 0, 0, 0}};    /* sm_86, sm_89: 100 KiB */
    for (size_t i = 0; i < sizeof gpus / sizeof gpus[0]; i++) {
        if (gpus[i].bytes)
            cr_assert_eq(setenv("SPOTUNE_CUDA_EMU_SMEM_PER_SM", gpus[i].bytes, 1), 0);
        staged(gpu, 128, &fwd, &dkdv);
        int dq128 = two(gpu, 128), dq64 = two(gpu, 64);
        unsetenv("SPOTUNE_CUDA_EMU_SMEM_PER_SM");
        cr_expect(fwd == gpus[i].fwd && dkdv == gpus[i].dkdv && dq128 == gpus[i].dq128 &&
                      dq64 == gpus[i].dq64,
                  "%s bytes a multiprocessor: forward %d, dK/dV %d staged, dQ two buffers %d "
                  "(hd 128), %d (hd 64); want %d, %d, %d, %d",
                  gpus[i].bytes ? gpus[i].bytes : "228 KiB of", fwd, dkdv, dq128, dq64,
                  gpus[i].fwd, gpus[i].dkdv, gpus[i].dq128, gpus[i].dq64);
    }
}

/* How the GPU reads a wgmma descriptor (cuda_wgmma_probe): a known product
 * with B staged as the forward stages K (K-major) and V (MN-major), each
 * with the leading- and stride-dimension offsets as the forward gives them
 * and swapped. The forward's must be exact (small integers); should they
 * not be, the message says which variants were, which is the fix. On the
 * emulated device the swapped ones must differ, so that the probe can tell
 * them apart. Where the wgmma kernels cannot run (not compute capability
 * 9.0, or a build without sm_90a) the test is skipped, and says so. */
Test(cuda_ops, wgmma_descriptors_as_the_forward_builds_them)
{
    char why[256];
    void *sym = backend_cuda_symbol("cuda_wgmma_probe", why, sizeof why);
    if (cuda_test_standin() && !sym)
        cr_skip_test("a stand-in backend has no wgmma");
    cr_assert(sym, "cuda_wgmma_probe: %s", why);
    int (*probe)(backend_t *, int[4]);
    memcpy(&probe, &sym, sizeof probe);
    int ok[4] = {-1, -1, -1, -1};
    int rc = probe(gpu, ok);
    if (rc == 1)
        cr_skip_test("the wgmma kernels do not run on %s (compute capability 9.0 and the sm_90a "
                     "build only)", gpu->device_name);
    gpu_ok(); /* a CUDA error names itself */
    cr_assert_eq(rc, 0, "the probe failed");
    cr_expect(ok[0] && ok[2], "wgmma reads B otherwise than the forward stages it: K-major as "
                              "built %s, swapped %s; MN-major as built %s, swapped %s",
              ok[0] ? "right" : "WRONG", ok[1] ? "right" : "wrong", ok[2] ? "right" : "WRONG",
              ok[3] ? "right" : "wrong");
    if (strstr(gpu->device_name, "emulated"))
        cr_expect(!ok[1] && !ok[3], "the swapped descriptors give the same product: the probe "
                                    "cannot tell them apart");
}

Test(cuda_ops, flash_attention_wgmma_kernels)
{
    check_wgmma(2, 37, 4, 1, 64, 0);
    check_wgmma(1, 130, 8, 1, 128, 0);
    check_wgmma(2, 300, 8, 2, 128, 120);
    check_wgmma(1, 1031, 2, 2, 64, 400);
}

/* The 7B shape with dQ recomputed (fused-recompute; the default stores dS
 * at this shape), as a GPU runs it for long sequences. */
Test(cuda_ops, attention_llama2_7b_shape_dq_recomputed)
{
    skip_if_reduced();
    setenv("SPOTUNE_CUDA_ATTENTION", "fused-recompute", 1);
    check_attention_at(1, 2048, 32, 32, 128, 1);
    unsetenv("SPOTUNE_CUDA_ATTENTION");
}

/* ---- main: skip (77, with the CUDA error) without a usable device -------------------- */

int main(int argc, char *argv[])
{
    return cuda_test_main(argc, argv);
}
