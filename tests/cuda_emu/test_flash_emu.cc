/* tests/cuda_emu/test_flash_emu.cc — the fused attention kernels' own
 * source (kernels/cuda/cuda_flash_kernels.cuh, cuda_flash_backward.cuh)
 * run on the emulated device (cuda_emu.h), against the CPU backend's
 * attention on the same bf16 inputs: forward (out, lse) and backward (dq,
 * dk, dv, through the row-dot, dK/dV and dQ kernels; dQ both ways,
 * recomputing and from the stored dS in chunks; the forward, dK/dV and
 * dQ from the stored dS also by warpgroup products, cuda_flash_wgmma.cuh,
 * the mma.sync kernels' results here) on odd shapes: T 1, 7, 37,
 * 64, 130 (T not a multiple of the tiles), head dims 64 and 128, GQA groups 1, 2, 4 and 8,
 * two batch rows, packed documents. Launch shapes are the host code's
 * (fa_row_blocks, fa_key_blocks, fa_rowdot_blocks). Outputs start as NaN,
 * so an element no thread writes fails the comparison; in the sanitizer
 * build every load and store of the kernels is bounds-checked.
 *
 * Tolerances, as max |emu - cpu| / max |cpu| over a tensor (those of
 * tests/cuda_ops_util.h): 1e-2 for the bf16 outputs (one rounding is 2^-9;
 * P and dS are rounded to bf16 before their products), 1e-4 for lse (fp32
 * from identical inputs). With T 1, dq and dk are rounding noise on both
 * sides (P = 1, dS = 0): max |x| <= 1e-4.
 *
 * C++ only because the kernels are templates; written in the C style of
 * the rest. */
#include <criterion/criterion.h>
#include <signal.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_emu.h"
#include "kernels/cuda/cuda_flash_backward.cuh" /* and cuda_flash_kernels.cuh */
#include "kernels/cuda/cuda_flash_wgmma.cuh"

extern "C" {
#include "base/base.h"
}

#define TOL_BF16 1e-2
#define TOL_F32 1e-4
#define TOL_ZERO 1e-4

static backend_t *cpu;

static void setup(void)
{
    sp_err err;
    memset(&err, 0, sizeof err);
    cr_assert_eq(backend_create(&cpu, "cpu", 0, 0, &err), 0, "%s", err.msg);
}

static void teardown(void)
{
    backend_destroy(cpu);
}

TestSuite(cuda_emu, .init = setup, .fini = teardown, .timeout = 600);

/* ---- the launches ------------------------------------------------------------------ */

template <int HD, int QS> static void fwd_fn(void *p)
{
    flash_forward_kernel<HD, QS>(*(flash_args *)p);
}

template <int HD> static void fwd_wgmma_fn(void *p)
{
    flash_forward_wgmma_kernel<HD>(*(flash_args *)p);
}

template <int HD, int KVS> static void dkdv_fn(void *p)
{
    flash_dkdv_kernel<HD, KVS>(*(flash_args *)p);
}

template <int HD> static void dkdv_wgmma_fn(void *p)
{
    flash_dkdv_wgmma_kernel<HD>(*(flash_args *)p);
}

/* Elements where two bf16 tensors differ as numbers (+0 and -0 equal: a
 * product of 0 keeps the sign of its other factor; NaN differs). */
static size_t bf16_differ(const uint16_t *x, const uint16_t *y, size_t n)
{
    size_t d = 0;
    for (size_t i = 0; i < n; i++)
        d += !(sp_bf16_to_f32(x[i]) == sp_bf16_to_f32(y[i]));
    return d;
}

template <int HD> static void dq_wgmma_fn(void *p)
{
    flash_dq_stored_wgmma_kernel<HD>(*(flash_args *)p);
}

template <int HD> static void dq_fn(void *p)
{
    flash_dq_kernel<HD>(*(flash_args *)p);
}

template <int HD, int NBUF> static void dq_stored_fn(void *p)
{
    flash_dq_stored_kernel<HD, NBUF>(*(flash_args *)p);
}

typedef struct rowdot_arg {
    flash_args a;
    int hd;
} rowdot_arg;

static void rowdot_fn(void *p)
{
    rowdot_arg *r = (rowdot_arg *)p;
    flash_rowdot_kernel(r->a, r->hd);
}

typedef rowdot_arg reduce_arg; /* the same arguments */

static void reduce_fn(void *p)
{
    reduce_arg *r = (reduce_arg *)p;
    flash_dkdv_reduce_kernel(r->a, r->hd);
}

static emu_dim3 dim(unsigned x, unsigned y)
{
    emu_dim3 d = {x, y, 1};
    return d;
}

static void launch(unsigned gx, unsigned gy, unsigned threads, void (*fn)(void *), void *arg,
                   const char *what)
{
    cr_assert_eq(emu_launch(dim(gx, gy), dim(threads, 1), fn, arg), 0, "%s did not run to its end",
                 what);
}

/* The mma.sync forward and dK/dV kernels, with the operands they reuse
 * staged (staged 1; the backend's choice at head dim 128) or in registers
 * (0; at 64, and SPOTUNE_CUDA_ATTENTION=fused-regs). fns: head dim 64 in
 * registers, staged, 128 in registers, staged. */
static void launch_variant(unsigned gx, unsigned gy, int hd, int staged,
                           void (*const fns[4])(void *), size_t smem, flash_args *a,
                           const char *what)
{
    cr_assert_eq(emu_launch_smem(dim(gx, gy), dim(FA_THREADS, 1), smem,
                                 fns[(hd == 64 ? 0 : 2) + (staged ? 1 : 0)], a),
                 0, "%s did not run to its end", what);
}

static void launch_forward(unsigned gx, unsigned gy, int hd, int qs, flash_args *a,
                           const char *what)
{
    static void (*const fns[4])(void *) = {fwd_fn<64, 0>, fwd_fn<64, 1>, fwd_fn<128, 0>,
                                           fwd_fn<128, 1>};
    launch_variant(gx, gy, hd, qs, fns, fa_forward_smem(hd, qs), a, what);
}

static void launch_dkdv(unsigned gx, unsigned gy, int hd, int kvs, flash_args *a, const char *what)
{
    static void (*const fns[4])(void *) = {dkdv_fn<64, 0>, dkdv_fn<64, 1>, dkdv_fn<128, 0>,
                                           dkdv_fn<128, 1>};
    launch_variant(gx, gy, hd, kvs, fns, fa_dkdv_smem(hd, kvs), a, what);
}

static void launch_dkdv_wgmma(unsigned gx, unsigned gy, int hd, flash_args *a, const char *what)
{
    cr_assert_eq(emu_launch_smem(dim(gx, gy), dim(FA_THREADS, 1), fa_dkdv_wgmma_smem(hd),
                                 hd == 64 ? dkdv_wgmma_fn<64> : dkdv_wgmma_fn<128>, a),
                 0, "%s: flash_dkdv_wgmma_kernel did not run to its end", what);
}

/* ---- data -------------------------------------------------------------------------- */

static uint64_t draws = 1000;

/* n values uniform in [-scale, scale], rounded to bf16: bits in *h, the
 * same values as floats returned (both malloc'd). */
static float *rnd_bf16(size_t n, float scale, uint16_t **h)
{
    float *f = (float *)malloc(sizeof(float) * (n ? n : 1));
    *h = (uint16_t *)malloc(sizeof(uint16_t) * (n ? n : 1));
    cr_assert(f && *h);
    uint64_t seed = draws++;
    for (size_t i = 0; i < n; i++) {
        float x = (2.0f * sp_rng_uniform(seed, i) - 1.0f) * scale;
        (*h)[i] = sp_f32_to_bf16(x);
        f[i] = sp_bf16_to_f32((*h)[i]);
    }
    return f;
}

static uint16_t *nan_bf16(size_t n)
{
    uint16_t *p = (uint16_t *)malloc(sizeof(uint16_t) * (n ? n : 1));
    cr_assert(p);
    for (size_t i = 0; i < n; i++)
        p[i] = 0x7fc0u;
    return p;
}

static float *nan_f32(size_t n)
{
    float *p = (float *)malloc(sizeof(float) * (n ? n : 1));
    cr_assert(p);
    for (size_t i = 0; i < n; i++)
        p[i] = NAN;
    return p;
}

static tensor_t up(const float *h, size_t n)
{
    tensor_t t = be_alloc(cpu, DT_F32, n);
    cr_assert(t.p);
    if (h)
        be_upload(cpu, t, h, DT_F32);
    return t;
}

static float *down(tensor_t t, size_t n)
{
    float *h = (float *)malloc(sizeof(float) * (n ? n : 1));
    cr_assert(h);
    be_download(cpu, h, DT_F32, t);
    return h;
}

/* max |got - want| / max |want| <= tol; got is bf16 (bits) or f32 */
static void expect_close(const char *what, const uint16_t *gb, const float *gf, const float *want,
                         size_t n, double tol)
{
    double m = 0, e = 0;
    size_t at = 0;
    for (size_t i = 0; i < n; i++) {
        double g = gb ? (double)sp_bf16_to_f32(gb[i]) : (double)gf[i], d = fabs(g - want[i]);
        if (fabs((double)want[i]) > m)
            m = fabs((double)want[i]);
        if (d > e || d != d) {
            e = d != d ? INFINITY : d;
            at = i;
        }
    }
    double r = m > 0 ? e / m : e;
    fprintf(stderr, "%s: max error %.2e of max |cpu| %.3g\n", what, r, m);
    cr_expect(r <= tol, "%s: max error %.3g relative to max |cpu| %.3g, at element %zu "
                        "(emulated %.6g, cpu %.6g) > %.3g",
              what, r, m, at, gb ? (double)sp_bf16_to_f32(gb[at]) : (double)gf[at],
              (double)want[at], tol);
}

static void expect_small(const char *what, const uint16_t *gb, size_t n)
{
    double m = 0;
    for (size_t i = 0; i < n; i++) {
        double x = fabs((double)sp_bf16_to_f32(gb[i]));
        if (x > m || x != x)
            m = x != x ? INFINITY : x;
    }
    cr_expect(m <= TOL_ZERO, "%s: max |x| %.3g > %.3g (should be 0 up to rounding)", what, m,
              TOL_ZERO);
}

/* Packed documents: lengths drawn from 1..max_len; seg[b*T + t] the row of
 * t's document start. */
static void packed(int B, int T, int max_len, int32_t *seg)
{
    uint64_t d = 0;
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T;) {
            int len = 1 + (int)(sp_rng_u64(0x5e9, d++) % (uint64_t)max_len);
            for (int i = t; i < t + len && i < T; i++)
                seg[b * T + i] = t;
            t += len;
        }
}

/* ---- the check --------------------------------------------------------------------- */

static void check(int B, int T, int nh, int nkv, int hd, int max_doc)
{
    size_t nq = (size_t)B * T * nh * hd, nk = (size_t)B * T * nkv * hd, nl = (size_t)B * nh * T;
    uint16_t *hq, *hk, *hv, *hdo;
    float *q = rnd_bf16(nq, 1.5f, &hq), *k = rnd_bf16(nk, 1.5f, &hk), *v = rnd_bf16(nk, 1.0f, &hv);
    float *dout = rnd_bf16(nq, 1.0f, &hdo);
    int32_t *seg = NULL;
    tensor_t cseg = {};
    if (max_doc) {
        seg = (int32_t *)malloc(sizeof(int32_t) * (size_t)B * T);
        cr_assert(seg);
        packed(B, T, max_doc, seg);
        cseg = be_alloc(cpu, DT_I32, (size_t)B * T);
        cr_assert(cseg.p);
        be_upload(cpu, cseg, seg, DT_I32);
    }
    char what[128], w2[200];
    snprintf(what, sizeof what, "flash B%d T%d nh%d nkv%d hd%d%s", B, T, nh, nkv, hd,
             max_doc ? " packed" : "");

    /* forward */
    flash_args a;
    memset(&a, 0, sizeof a);
    a.q = hq, a.k = hk, a.v = hv, a.dout = hdo, a.seg = seg;
    a.B = B, a.T = T, a.nh = nh, a.nkv = nkv, a.scale = 1.0f / sqrtf((float)hd);
    a.ldq = a.ldo = a.lddq = nh * hd, a.ldk = a.lddk = nkv * hd; /* contiguous */
    uint16_t *out = nan_bf16(nq), *dq = nan_bf16(nq), *dk = nan_bf16(nk), *dv = nan_bf16(nk);
    float *lse = nan_f32(nl), *D = nan_f32(nl);
    a.out = out, a.lse = lse;
    launch_forward((unsigned)(B * nh), fa_row_blocks(T), hd, 1, &a, "flash_forward_kernel");
    tensor_t cq = up(q, nq), ck = up(k, nk), cv = up(v, nk), co = up(NULL, nq), cl = up(NULL, nl);
    be_attention_forward(cpu, co, cl, cq, ck, cv, cseg, B, T, nh, nkv, hd);
    cr_assert_eq(be_check(cpu, NULL), 0);
    float *wo = down(co, nq), *wl = down(cl, nl);
    snprintf(w2, sizeof w2, "%s out", what);
    expect_close(w2, out, NULL, wo, nq, TOL_BF16);
    snprintf(w2, sizeof w2, "%s lse", what);
    expect_close(w2, NULL, lse, wl, nl, TOL_F32);

    /* Q in registers (fused-regs) instead of staged: the same fragments,
     * products and order, so the same bits of out and lse */
    {
        flash_args ar = a;
        uint16_t *out_r = nan_bf16(nq);
        float *lse_r = nan_f32(nl);
        ar.out = out_r, ar.lse = lse_r;
        launch_forward((unsigned)(B * nh), fa_row_blocks(T), hd, 0, &ar,
                       "flash_forward_kernel (Q in registers)");
        cr_expect(memcmp(out_r, out, nq * sizeof *out) == 0 &&
                      memcmp(lse_r, lse, nl * sizeof *lse) == 0,
                  "%s: the forward with Q in registers differs from the staged one", what);
        free(out_r), free(lse_r);
    }

    /* the wgmma forward: the same products in the same order (k-steps of
     * 16, fp32 accumulation in k order, here), so the same bits */
    {
        flash_args aw = a;
        uint16_t *out_w = nan_bf16(nq);
        float *lse_w = nan_f32(nl);
        aw.out = out_w, aw.lse = lse_w;
        cr_assert_eq(emu_launch_smem(dim((unsigned)(B * nh), fa_row_blocks(T)), dim(FA_THREADS, 1),
                                     fa_wgmma_smem(hd), hd == 64 ? fwd_wgmma_fn<64> : fwd_wgmma_fn<128>,
                                     &aw),
                     0, "%s: flash_forward_wgmma_kernel did not run to its end", what);
        size_t bad = 0;
        for (size_t i = 0; i < nq; i++)
            bad += out_w[i] != out[i];
        for (size_t i = 0; i < nl; i++)
            bad += memcmp(&lse_w[i], &lse[i], sizeof(float)) != 0;
        cr_expect_eq(bad, 0, "%s: the wgmma forward differs from the mma.sync one in %zu of %zu "
                             "elements of out and lse", what, bad, nq + nl);
        free(out_w), free(lse_w);
    }

    /* backward, from the emulated forward's output on both sides */
    float *o = (float *)malloc(sizeof(float) * nq);
    cr_assert(o);
    for (size_t i = 0; i < nq; i++)
        o[i] = sp_bf16_to_f32(out[i]);
    be_upload(cpu, co, o, DT_F32);
    a.o = out, a.D = D, a.dq = dq, a.dk = dk, a.dv = dv;
    rowdot_arg ra = {a, hd};
    size_t nrows = (size_t)B * T * nh;
    launch(fa_rowdot_blocks(nrows), 1, FA_ROWDOT_THREADS, rowdot_fn, &ra, "flash_rowdot_kernel");
    /* grouped-query attention: by query head into fp32 shares, then summed
     * (fa_dkdv_split), as the backend launches it; also by kv head (the
     * other path), both checked */
    int split = fa_dkdv_split(B, T, nh, nkv, hd);
    float *shares = split ? nan_f32(2 * nq) : NULL;
    uint16_t *dk2 = nan_bf16(nk), *dv2 = nan_bf16(nk);
    if (split) {
        flash_args a2 = a;
        a2.dk = dk2, a2.dv = dv2;
        launch_dkdv((unsigned)(B * nkv), fa_key_blocks(T), hd, 1, &a2,
                    "flash_dkdv_kernel (by kv head)");
        a.dk_part = shares, a.dv_part = shares + nq;
    }
    launch_dkdv((unsigned)(B * (split ? nh : nkv)), fa_key_blocks(T), hd, 1, &a, "flash_dkdv_kernel");
    if (split) {
        reduce_arg rd = {a, hd};
        launch(fa_reduce_blocks(nk), 1, FA_REDUCE_THREADS, reduce_fn, &rd,
               "flash_dkdv_reduce_kernel");
    }
    /* K and V in registers (fused-regs) instead of staged: the same
     * fragments, products and order, so the same bits of dK and dV */
    {
        flash_args ar = a;
        uint16_t *dk_r = nan_bf16(nk), *dv_r = nan_bf16(nk);
        float *shares_r = split ? nan_f32(2 * nq) : NULL;
        ar.dk = dk_r, ar.dv = dv_r;
        ar.dk_part = split ? shares_r : NULL, ar.dv_part = split ? shares_r + nq : NULL;
        launch_dkdv((unsigned)(B * (split ? nh : nkv)), fa_key_blocks(T), hd, 0, &ar,
                    "flash_dkdv_kernel (K, V in registers)");
        if (split) {
            reduce_arg rdr = {ar, hd};
            launch(fa_reduce_blocks(nk), 1, FA_REDUCE_THREADS, reduce_fn, &rdr,
                   "flash_dkdv_reduce_kernel (K, V in registers)");
        }
        cr_expect(memcmp(dk_r, dk, nk * sizeof *dk) == 0 && memcmp(dv_r, dv, nk * sizeof *dv) == 0,
                  "%s: the dK/dV kernel with K and V in registers differs from the staged one "
                  "in %zu of dK's and %zu of dV's %zu elements",
                  what, bf16_differ(dk_r, dk, nk), bf16_differ(dv_r, dv, nk), nk);
        free(dk_r), free(dv_r), free(shares_r);
    }
    /* the dK/dV kernel by warpgroup products (cuda_flash_wgmma.cuh): the
     * same products in the same order, so the same dK and dV (as numbers:
     * its masked-out warps add zeros of either sign where the mma.sync
     * kernel skips them) */
    {
        flash_args aw = a;
        uint16_t *dk_w = nan_bf16(nk), *dv_w = nan_bf16(nk);
        float *shares_w = split ? nan_f32(2 * nq) : NULL;
        aw.dk = dk_w, aw.dv = dv_w;
        aw.dk_part = split ? shares_w : NULL, aw.dv_part = split ? shares_w + nq : NULL;
        launch_dkdv_wgmma((unsigned)(B * (split ? nh : nkv)), fa_key_blocks(T), hd, &aw, what);
        if (split) {
            reduce_arg rdw = {aw, hd};
            launch(fa_reduce_blocks(nk), 1, FA_REDUCE_THREADS, reduce_fn, &rdw,
                   "flash_dkdv_reduce_kernel (wgmma)");
        }
        size_t bk = bf16_differ(dk_w, dk, nk), bv = bf16_differ(dv_w, dv, nk);
        cr_expect(bk == 0 && bv == 0, "%s: the wgmma dK/dV kernel differs from the mma.sync one "
                                      "in %zu of dK's and %zu of dV's %zu elements", what, bk, bv, nk);
        free(dk_w), free(dv_w), free(shares_w);
    }
    launch((unsigned)(B * nh), fa_row_blocks(T), FA_THREADS, hd == 64 ? dq_fn<64> : dq_fn<128>,
           &a, "flash_dq_kernel");
    tensor_t cdo = up(dout, nq), cdq = up(NULL, nq), cdk = up(NULL, nk), cdv = up(NULL, nk);
    be_attention_backward(cpu, cdq, cdk, cdv, cdo, co, cl, cq, ck, cv, cseg, B, T, nh, nkv, hd);
    cr_assert_eq(be_check(cpu, NULL), 0);
    float *wdq = down(cdq, nq), *wdk = down(cdk, nk), *wdv = down(cdv, nk);
    if (T == 1) {
        snprintf(w2, sizeof w2, "%s dq", what);
        expect_small(w2, dq, nq);
        snprintf(w2, sizeof w2, "%s dk", what);
        expect_small(w2, dk, nk);
    } else {
        snprintf(w2, sizeof w2, "%s dq", what);
        expect_close(w2, dq, NULL, wdq, nq, TOL_BF16);
        snprintf(w2, sizeof w2, "%s dk", what);
        expect_close(w2, dk, NULL, wdk, nk, TOL_BF16);
    }
    snprintf(w2, sizeof w2, "%s dv", what);
    expect_close(w2, dv, NULL, wdv, nk, TOL_BF16);
    if (split) {
        snprintf(w2, sizeof w2, "%s dk (by kv head)", what);
        expect_close(w2, dk2, NULL, wdk, nk, TOL_BF16);
        snprintf(w2, sizeof w2, "%s dv (by kv head)", what);
        expect_close(w2, dv2, NULL, wdv, nk, TOL_BF16);
    }
    free(shares);

    /* dQ from the stored dS, in chunks as the backend walks them, with a
     * budget of about a third of the units (two chunks or more wherever
     * there are two units or more): with the split (units of one pair)
     * and, for grouped-query attention, also by kv head (units of a whole
     * group). The buffer starts as NaN: every element of the last chunk's
     * tiles must have been written, and a tile dQ reads that dK/dV did not
     * write would fail the comparison. dK and dV are the same kernel's sums:
     * the same bits as above. */
    for (int sp = split; sp >= 0; sp--) {
        fa_ds_plan whole = fa_ds_chunks(B, T, nh, nkv, sp, (size_t)1 << 40);
        size_t unit_bytes = whole.bytes / (size_t)whole.units;
        fa_ds_plan p =
            fa_ds_chunks(B, T, nh, nkv, sp, unit_bytes * (size_t)((whole.units + 2) / 3));
        cr_assert(p.chunks >= (whole.units >= 2 ? 2 : 1) && p.per_chunk >= 1 &&
                      p.unit == (sp ? 1 : nh / nkv),
                  "%s: %d chunks of %d units of %d pairs", what, p.chunks, p.per_chunk, p.unit);
        uint16_t *ds = nan_bf16(p.bytes / sizeof(uint16_t));
        uint16_t *dq3 = nan_bf16(nq), *dk3 = nan_bf16(nk), *dv3 = nan_bf16(nk);
        uint16_t *dq3b = nan_bf16(nq);
        float *shares3 = sp ? nan_f32(2 * nq) : NULL;
        flash_args a3 = a;
        a3.dq = dq3, a3.dk = dk3, a3.dv = dv3, a3.ds = ds;
        a3.dk_part = sp ? shares3 : NULL, a3.dv_part = sp ? shares3 + nq : NULL;
        for (int c = 0; c < p.chunks; c++) {
            int u0 = c * p.per_chunk, nu = p.units - u0 < p.per_chunk ? p.units - u0 : p.per_chunk;
            a3.pair0 = u0 * p.unit;
            launch_dkdv((unsigned)nu, fa_key_blocks(T), hd, 1, &a3,
                        "flash_dkdv_kernel (storing dS)");
            /* two buffers and one (cuda_flash_dq_double_buffered): the same
             * products in the same order */
            for (int nbuf = 2; nbuf >= 1; nbuf--) {
                flash_args ab = a3;
                ab.dq = nbuf == 2 ? dq3 : dq3b;
                static void (*const fns[4])(void *) = {dq_stored_fn<64, 1>, dq_stored_fn<64, 2>,
                                                       dq_stored_fn<128, 1>,
                                                       dq_stored_fn<128, 2>};
                void (*fn)(void *) = fns[(hd == 64 ? 0 : 2) + nbuf - 1];
                cr_assert_eq(emu_launch_smem(dim((unsigned)(nu * p.unit), fa_row_blocks(T)),
                                             dim(FA_THREADS, 1), fa_dq_stored_smem(hd, nbuf), fn,
                                             &ab),
                             0, "%s: flash_dq_stored_kernel (%d buffers) did not run to its end",
                             what, nbuf);
            }
        }
        cr_expect(memcmp(dq3b, dq3, nq * sizeof *dq3) == 0,
                  "%s: dQ from the stored dS with one buffer differs from two in %zu of %zu", what,
                  bf16_differ(dq3b, dq3, nq), nq);
        if (sp) {
            reduce_arg rd3 = {a3, hd};
            launch(fa_reduce_blocks(nk), 1, FA_REDUCE_THREADS, reduce_fn, &rd3,
                   "flash_dkdv_reduce_kernel (storing dS)");
        }
        /* the last chunk's tiles, every element written (none left NaN) */
        size_t last = (size_t)(p.units - (p.chunks - 1) * p.per_chunk) * p.unit * fa_ds_pair(T);
        size_t unwritten = 0;
        for (size_t i = 0; i < last; i++)
            unwritten += ds[i] == 0x7fc0u;
        cr_expect(unwritten == 0, "%s: %zu of the last chunk's %zu stored dS elements unwritten",
                  what, unwritten, last);
        snprintf(w2, sizeof w2, "%s dq (stored dS, %d chunks of %d pairs)", what, p.chunks,
                 p.per_chunk * p.unit);
        if (T == 1)
            expect_small(w2, dq3, nq);
        else
            expect_close(w2, dq3, NULL, wdq, nq, TOL_BF16);
        const uint16_t *wk = sp == split ? dk : dk2, *wv = sp == split ? dv : dv2;
        cr_expect(memcmp(dk3, wk, sizeof(uint16_t) * nk) == 0 &&
                      memcmp(dv3, wv, sizeof(uint16_t) * nk) == 0,
                  "%s: dK, dV differ when the dK/dV kernel also stores dS (%s)", what,
                  sp ? "split" : "by kv head");

        /* the same chunks with the wgmma dK/dV and dQ kernels: the stored
         * dS, dQ from it, dK and dV the mma.sync kernels' (as numbers) */
        uint16_t *ds_w = nan_bf16(p.bytes / sizeof(uint16_t));
        uint16_t *dq_w = nan_bf16(nq), *dk_w = nan_bf16(nk), *dv_w = nan_bf16(nk);
        float *shares_w = sp ? nan_f32(2 * nq) : NULL;
        flash_args aw = a3;
        aw.dq = dq_w, aw.dk = dk_w, aw.dv = dv_w, aw.ds = ds_w;
        aw.dk_part = sp ? shares_w : NULL, aw.dv_part = sp ? shares_w + nq : NULL;
        size_t ds_bad = 0;
        for (int c = 0; c < p.chunks; c++) {
            int u0 = c * p.per_chunk, nu = p.units - u0 < p.per_chunk ? p.units - u0 : p.per_chunk;
            aw.pair0 = a3.pair0 = u0 * p.unit;
            launch_dkdv_wgmma((unsigned)nu, fa_key_blocks(T), hd, &aw, what);
            cr_assert_eq(emu_launch_smem(dim((unsigned)(nu * p.unit), fa_row_blocks(T)),
                                         dim(FA_THREADS, 1), fa_dq_wgmma_smem(hd),
                                         hd == 64 ? dq_wgmma_fn<64> : dq_wgmma_fn<128>, &aw),
                         0, "%s: flash_dq_stored_wgmma_kernel did not run to its end", what);
            if (c == p.chunks - 1) /* the buffer holds the last chunk's tiles */
                ds_bad = bf16_differ(ds_w, ds, last);
        }
        if (sp) {
            reduce_arg rdw = {aw, hd};
            launch(fa_reduce_blocks(nk), 1, FA_REDUCE_THREADS, reduce_fn, &rdw,
                   "flash_dkdv_reduce_kernel (wgmma, storing dS)");
        }
        size_t qb = bf16_differ(dq_w, dq3, nq), kb = bf16_differ(dk_w, dk3, nk);
        size_t vb = bf16_differ(dv_w, dv3, nk);
        cr_expect(ds_bad == 0 && qb == 0 && kb == 0 && vb == 0,
                  "%s (%s): the wgmma dK/dV kernel's stored dS differs in %zu of %zu elements, "
                  "dq %zu, dk %zu, dv %zu", what, sp ? "split" : "by kv head", ds_bad, last, qb,
                  kb, vb);
        free(ds_w), free(dq_w), free(dk_w), free(dv_w), free(shares_w);
        free(ds), free(dq3), free(dq3b), free(dk3), free(dv3), free(shares3);
    }
    free(dk2), free(dv2);

    tensor_t ts[] = {cq, ck, cv, co, cl, cdo, cdq, cdk, cdv, cseg};
    for (int i = 0; i < 10; i++)
        if (ts[i].p)
            be_free(cpu, &ts[i]);
    free(q), free(k), free(v), free(dout), free(hq), free(hk), free(hv), free(hdo), free(seg);
    free(out), free(dq), free(dk), free(dv), free(lse), free(D), free(o);
    free(wo), free(wl), free(wdq), free(wdk), free(wdv);
}

Test(cuda_emu, flash_attention_odd_shapes_hd64)
{
    check(1, 1, 1, 1, 64, 0);
    check(1, 7, 2, 1, 64, 0);
    check(2, 37, 4, 1, 64, 0); /* GQA 4 */
    check(1, 64, 2, 2, 64, 0); /* one whole tile, groups of 1 */
    check(1, 130, 4, 2, 64, 0); /* GQA 2, three tiles, the last of 2 rows */
}

Test(cuda_emu, flash_attention_odd_shapes_hd128)
{
    check(1, 7, 1, 1, 128, 0);
    check(1, 130, 8, 1, 128, 0); /* GQA 8 */
    check(2, 37, 2, 2, 128, 0);
}

Test(cuda_emu, flash_attention_packed_documents)
{
    check(2, 100, 4, 1, 64, 9);   /* short documents: many starts inside each tile */
    check(1, 130, 2, 1, 128, 70); /* documents across tiles */
}

/* ---- the emulator's own refusals ------------------------------------------------- */

/* Half a warp at __syncthreads and the other half at a shuffle: neither
 * barrier can complete, a deadlock the launch reports (-1) instead of
 * hanging; the next launch runs normally. */
static void divergent_fn(void *p)
{
    int *out = (int *)p;
    if ((threadIdx.x & 31) < 16)
        __syncthreads();
    else
        out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, (int)threadIdx.x, 1);
}

static void lane_id_fn(void *p)
{
    int *out = (int *)p;
    out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, (int)threadIdx.x, 1);
}

Test(cuda_emu, a_divergent_barrier_is_a_failed_launch_not_a_hang)
{
    int out[64];
    cr_expect_eq(emu_launch(dim(1, 1), dim(64, 1), divergent_fn, out), -1);
    memset(out, 0xff, sizeof out);
    cr_assert_eq(emu_launch(dim(1, 1), dim(64, 1), lane_id_fn, out), 0);
    for (int i = 0; i < 64; i++)
        cr_expect_eq(out[i], i ^ 1, "lane %d got %d after a shuffle with lane %d", i, out[i], i ^ 1);
    cr_expect_eq(emu_launch(dim(1, 1), dim(2048, 1), lane_id_fn, out), -1, "a block of 2048");
}

/* A shuffle after some lanes of the warp returned: the emulator stops the
 * process naming it (no value of a gone lane is made up). */
static void lanes_gone_fn(void *p)
{
    int *out = (int *)p;
    if (threadIdx.x == 0)
        return;
    out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, (int)threadIdx.x, 1);
}

Test(cuda_emu, a_shuffle_with_lanes_gone_stops_the_process, .signal = SIGABRT)
{
    int out[32];
    emu_launch(dim(1, 1), dim(32, 1), lanes_gone_fn, out);
}

/* cp.async as on the device: a copy lands at the wait that completes its
 * group, and its destination reads as poison (0xff bytes, NaN) before, so
 * a kernel that reads a staged tile too early, or waits for too few
 * groups, computes with NaN here. */
typedef struct copy_arg {
    uint16_t src[2][32 * 8];
    uint16_t before[32], between[2][32], after[2][32];
} copy_arg;

static void copy_fn(void *p)
{
    copy_arg *c = (copy_arg *)p;
    uint16_t *sm = (uint16_t *)emu_dynamic_shared();
    int t = (int)threadIdx.x;
    cp_async16(sm + t * 8, c->src[0] + t * 8, 1);
    cp_async_commit();
    cp_async16(sm + 256 + t * 8, c->src[1] + t * 8, 1);
    cp_async_commit();
    c->before[t] = sm[t * 8];
    cp_async_wait<1>(); /* the first group */
    c->between[0][t] = sm[t * 8];
    c->between[1][t] = sm[256 + t * 8];
    cp_async_wait<0>();
    c->after[0][t] = sm[t * 8];
    c->after[1][t] = sm[256 + t * 8];
}

Test(cuda_emu, a_copy_lands_at_the_wait_that_completes_its_group)
{
    copy_arg c;
    memset(&c, 0, sizeof c);
    for (int i = 0; i < 32 * 8; i++)
        c.src[0][i] = (uint16_t)(0x3f00 + i), c.src[1][i] = (uint16_t)(0x4000 + i);
    cr_assert_eq(emu_launch_smem(dim(1, 1), dim(32, 1), 1024, copy_fn, &c), 0);
    for (int t = 0; t < 32; t++) {
        cr_expect_eq(c.before[t], 0xffffu, "thread %d read its tile before the wait", t);
        cr_expect_eq(c.between[0][t], 0x3f00 + t * 8, "thread %d, group 1 after wait_group 1", t);
        cr_expect_eq(c.between[1][t], 0xffffu, "thread %d, group 2 after wait_group 1", t);
        cr_expect_eq(c.after[0][t], 0x3f00 + t * 8);
        cr_expect_eq(c.after[1][t], 0x4000 + t * 8, "thread %d, group 2 after wait_group 0", t);
    }
}

static void copy_unwaited_fn(void *p)
{
    uint16_t *sm = (uint16_t *)emu_dynamic_shared();
    cp_async16(sm + threadIdx.x * 8, (const uint16_t *)p + threadIdx.x * 8, 1);
    cp_async_commit();
}

/* A block that ends with copies in flight stops the process (the device
 * would write shared memory after its threads are gone). */
Test(cuda_emu, a_block_ending_with_copies_in_flight_stops_the_process, .signal = SIGABRT)
{
    static uint16_t src[32 * 8];
    emu_launch_smem(dim(1, 1), dim(32, 1), 512, copy_unwaited_fn, src);
}
