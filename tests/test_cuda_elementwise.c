/* The 16-byte vector paths of the CUDA backend's elementwise ops
 * (kernels/cuda/cuda_vec.cu: add, add_bias, SwiGLU forward and backward
 * (also on the two column halves of one [rows, 2 cols] matrix, the
 * backward in place, as the fused gate/up product runs), dropout, RMSNorm
 * forward and backward, RoPE (also out of and into a column block of a
 * wider matrix, as the fused q/k/v product runs), AdamW with its compute
 * copy)
 * against the scalar kernels they stand for and against the CPU twin.
 *
 * Each op runs on the same inputs three times: on the GPU with
 * SPOTUNE_CUDA_ELEMENTWISE=scalar (the scalar kernels of cuda_ops.cu), on
 * the GPU with =vector (the default), and on the CPU backend. The two GPU
 * runs must agree bit for bit in every output (the vector path changes
 * memory access only, RMSNorm's reduction order included); the vector run
 * must agree with the CPU within TOL_BF16 / TOL_F32 (cuda_ops_util.h; AdamW
 * 1e-6, as tests/test_cuda_ops.c). Cases: the activation dtype and F32, on
 * shapes the vector path takes (cols 4096 and 11008: 7B hidden and FFN
 * widths, RoPE hd 128) and on shapes it declines, which run the scalar
 * kernels: cols 4103 (not a multiple of 8; RoPE hd 10) and a view one
 * element into its buffer (no tensor 16-byte aligned). And which calls the
 * vector path takes, through its entry points (cuda_vec.cu) directly.
 *
 * Without a usable CUDA device main prints "skipped: no usable CUDA device: "
 * and the CUDA error (cuda_test_main.h), and exits 77. */
#define _POSIX_C_SOURCE 200809L /* setenv */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_ops_util.h"
#include "cuda_test_main.h"
#include "kernels/backend.h"

TestSuite(cuda_elementwise, .init = cuda_ops_setup, .fini = cuda_ops_teardown, .timeout = 300);

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
    SWIGLU_GU_FWD, /* gate and up the column halves of one [rows, 2 cols] matrix */
    SWIGLU_GU_BWD, /* the same, the gradients written over them in place */
    ROPE_LD        /* RoPE out of a column block of [rows, 2 cols] and, inverse, into one */
};

#define MAX_OUT 4
#define TOL_ADAMW 1e-6
#define NO_CPU -1.0 /* an output the CPU run does not have (AdamW's copy) */

/* The buffers of one run: views at an offset into fresh zeroed allocations. */
typedef struct bufs {
    backend_t *be;
    tensor_t base[12];
    int nb;
} bufs;

static tensor_t put(bufs *b, dtype_t dt, const float *h, size_t n, size_t off)
{
    cr_assert_lt(b->nb, 12);
    tensor_t t = up(b->be, dt, NULL, n + off);
    b->base[b->nb++] = t;
    tensor_t v = tensor_view(t, off, n);
    if (h)
        be_upload(b->be, v, h, DT_F32);
    return v;
}

/* RoPE's head dim on a row of cols: 128 where it divides cols, else 10
 * (half of it odd: the scalar kernel) */
static int rope_hd(int cols)
{
    return cols % 128 == 0 ? 128 : 10;
}

/* The host inputs of one case: four of rows x cols, one of cols. */
typedef struct inputs {
    float *a, *b, *c, *d, *w;
} inputs;

/* Runs op on be (tensors of dtype dt at element offset off; AdamW's master,
 * gradient and moments F32, its copy dt, none on the CPU) and downloads
 * its outputs into out[] (lengths in len[]); returns how many, their
 * tolerances against the CPU in tol[]. */
static int run_op(backend_t *be, int op, int rows, int cols, dtype_t dt, size_t off,
                  const inputs *in, float **out, size_t *len, double *tol)
{
    bufs b = {.be = be};
    size_t n = (size_t)rows * cols;
    double ta = dt == DT_BF16 ? TOL_BF16 : TOL_F32;
    tensor_t o[MAX_OUT] = {{0}};
    int no = 0;
    switch (op) {
    case ADD: {
        tensor_t y = put(&b, dt, in->a, n, off), x = put(&b, dt, in->b, n, off);
        be_add(be, y, x, -0.7f, n);
        o[no] = y, tol[no++] = ta;
        break;
    }
    case ADD_BIAS: {
        tensor_t y = put(&b, dt, in->a, n, off), bias = put(&b, dt, in->w, cols, off);
        be_add_bias(be, y, bias, rows, cols);
        o[no] = y, tol[no++] = ta;
        break;
    }
    case SWIGLU_FWD: {
        tensor_t g = put(&b, dt, in->a, n, off), u = put(&b, dt, in->b, n, off);
        tensor_t r = put(&b, dt, NULL, n, off);
        be_swiglu_forward(be, r, g, u, rows, cols, cols);
        o[no] = r, tol[no++] = ta;
        break;
    }
    case SWIGLU_BWD: {
        tensor_t g = put(&b, dt, in->a, n, off), u = put(&b, dt, in->b, n, off);
        tensor_t d = put(&b, dt, in->c, n, off);
        tensor_t dg = put(&b, dt, NULL, n, off), du = put(&b, dt, NULL, n, off);
        be_swiglu_backward(be, dg, du, d, g, u, rows, cols, cols);
        o[no] = dg, tol[no++] = ta;
        o[no] = du, tol[no++] = ta;
        break;
    }
    case SWIGLU_GU_FWD:
    case SWIGLU_GU_BWD: {
        float *h = malloc(sizeof(float) * 2 * n);
        for (int r = 0; r < rows; r++) {
            memcpy(h + (size_t)r * 2 * cols, in->a + (size_t)r * cols, sizeof(float) * cols);
            memcpy(h + (size_t)r * 2 * cols + cols, in->b + (size_t)r * cols, sizeof(float) * cols);
        }
        tensor_t gu = put(&b, dt, h, 2 * n, off), u = tensor_view(gu, (size_t)cols, 2 * n - cols);
        free(h);
        if (op == SWIGLU_GU_FWD) {
            tensor_t r = put(&b, dt, NULL, n, off);
            be_swiglu_forward(be, r, gu, u, rows, cols, 2 * cols);
            o[no] = r, tol[no++] = ta;
        } else {
            tensor_t d = put(&b, dt, in->c, n, off);
            be_swiglu_backward(be, gu, u, d, gu, u, rows, cols, 2 * cols);
            o[no] = gu, tol[no++] = ta;
        }
        break;
    }
    case DROPOUT: {
        tensor_t x = put(&b, dt, in->a, n, off), r = put(&b, dt, NULL, n, off);
        be_dropout(be, r, x, n, 0.3f, 99, (tensor_t){0}, 12345);
        o[no] = r, tol[no++] = ta;
        break;
    }
    case RMSNORM_FWD:
    case RMSNORM_BWD: {
        tensor_t x = put(&b, dt, in->a, n, off), w = put(&b, dt, in->w, cols, off);
        tensor_t r = put(&b, dt, NULL, n, off), rstd = put(&b, DT_F32, NULL, rows, off);
        be_rmsnorm_forward(be, r, rstd, x, w, rows, cols, 1e-5f);
        if (op == RMSNORM_FWD) {
            o[no] = r, tol[no++] = ta;
            o[no] = rstd, tol[no++] = TOL_F32;
            break;
        }
        tensor_t d = put(&b, dt, in->c, n, off), dx = put(&b, dt, in->d, n, off);
        tensor_t dw = put(&b, DT_F32, NULL, cols, off);
        be_rmsnorm_backward(be, dx, dw, d, x, w, rstd, rows, cols);
        o[no] = dx, tol[no++] = ta;
        o[no] = dw, tol[no++] = TOL_F32;
        break;
    }
    case ROPE: {
        int hd = rope_hd(cols), nh = cols / hd, hh = hd / 2;
        size_t nx = (size_t)rows * nh * hd;
        tensor_t x = put(&b, dt, in->a, nx, off), xi = put(&b, dt, in->d, nx, off);
        tensor_t c = put(&b, DT_F32, in->b, (size_t)rows * hh, off);
        tensor_t s = put(&b, DT_F32, in->c, (size_t)rows * hh, off);
        tensor_t none = {0};
        be_rope(be, x, c, s, none, 1, rows, nh, hd, 0);
        be_rope(be, xi, c, s, none, 1, rows, nh, hd, 1); /* the inverse */
        o[no] = x, tol[no++] = ta;
        o[no] = xi, tol[no++] = ta;
        break;
    }
    case ROPE_LD: {
        int hd = rope_hd(cols), nh = cols / hd, hh = hd / 2, w = nh * hd, ld = 2 * cols;
        float *h = malloc(sizeof(float) * 2 * n);
        for (int r = 0; r < rows; r++) { /* [a-row | d-row] */
            memcpy(h + (size_t)r * ld, in->a + (size_t)r * cols, sizeof(float) * cols);
            memcpy(h + (size_t)r * ld + cols, in->d + (size_t)r * cols, sizeof(float) * cols);
        }
        tensor_t wide = put(&b, dt, h, 2 * n, off), back = put(&b, dt, NULL, 2 * n, off);
        free(h);
        tensor_t x = put(&b, dt, NULL, (size_t)rows * w, off);
        tensor_t xi = put(&b, dt, in->d, (size_t)rows * w, off);
        tensor_t c = put(&b, DT_F32, in->b, (size_t)rows * hh, off);
        tensor_t s = put(&b, DT_F32, in->c, (size_t)rows * hh, off);
        tensor_t none = {0};
        be_rope_ld(be, x, wide, c, s, none, 1, rows, nh, hd, 0, w, ld);
        be_rope_ld(be, tensor_view(back, (size_t)cols, 2 * n - cols), xi, c, s, none, 1, rows, nh,
                   hd, 1, ld, w);
        o[no] = x, tol[no++] = ta;
        o[no] = back, tol[no++] = ta;
        break;
    }
    case ADAMW: {
        float *v = malloc(sizeof(float) * n);
        for (size_t i = 0; i < n; i++)
            v[i] = fabsf(in->d[i]) * 1e-3f;
        tensor_t p = put(&b, DT_F32, in->a, n, off), g = put(&b, DT_F32, in->b, n, off);
        tensor_t m = put(&b, DT_F32, in->c, n, off), vv = put(&b, DT_F32, v, n, off);
        free(v);
        int with_copy = be == gpu && be != cpu;
        tensor_t copy = with_copy ? put(&b, dt, NULL, n, off) : (tensor_t){0};
        adamw_args a = {.lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f,
                        .weight_decay = 0.1f, .grad_scale = 0.5f, .step = 10};
        be_adamw(be, p, copy, g, m, vv, n, &a);
        o[no] = p, tol[no++] = TOL_ADAMW;
        o[no] = m, tol[no++] = TOL_ADAMW;
        o[no] = vv, tol[no++] = TOL_ADAMW;
        if (with_copy)
            o[no] = copy, tol[no++] = NO_CPU;
        break;
    }
    default:
        cr_assert_fail("op %d", op);
    }
    be_sync(be);
    for (int k = 0; k < no; k++) {
        out[k] = down(be, o[k]);
        len[k] = o[k].n;
    }
    for (int i = 0; i < b.nb; i++)
        drop(be, &b.base[i]);
    return no;
}

static const char *op_names[] = {"add",          "add_bias",     "swiglu_forward",
                                 "swiglu_backward", "dropout",   "rmsnorm_forward",
                                 "rmsnorm_backward", "rope",     "adamw",
                                 "swiglu_gate_up_forward", "swiglu_gate_up_backward_in_place",
                                 "rope_between_column_blocks"};

/* One case: scalar and vector GPU runs bit for bit, the vector run against
 * the CPU within tolerance. */
static void check_case(int op, int rows, int cols, dtype_t dt, size_t off)
{
    size_t n = (size_t)rows * cols;
    inputs in = {rnd(n, 4.0f), rnd(n, 2.0f), rnd(n, 1.0f), rnd(n, 0.5f), rnd(cols, 1.5f)};
    float *sc[MAX_OUT] = {0}, *ve[MAX_OUT] = {0}, *cp[MAX_OUT] = {0};
    size_t ls[MAX_OUT], lv[MAX_OUT], lc[MAX_OUT];
    double tol[MAX_OUT], tc[MAX_OUT];
    cr_assert_eq(setenv("SPOTUNE_CUDA_ELEMENTWISE", "scalar", 1), 0);
    int ns = run_op(gpu, op, rows, cols, dt, off, &in, sc, ls, tol);
    cr_assert_eq(setenv("SPOTUNE_CUDA_ELEMENTWISE", "vector", 1), 0);
    int nv = run_op(gpu, op, rows, cols, dt, off, &in, ve, lv, tol);
    unsetenv("SPOTUNE_CUDA_ELEMENTWISE");
    int nc = run_op(cpu, op, rows, cols, DT_F32, 0, &in, cp, lc, tc);
    gpu_ok();
    cr_assert_eq(ns, nv);
    for (int k = 0; k < nv; k++) {
        cr_assert_eq(ls[k], lv[k]);
        size_t bad = 0, first = 0;
        for (size_t i = 0; i < lv[k]; i++)
            if (memcmp(&sc[k][i], &ve[k][i], sizeof(float)) != 0 && !bad++)
                first = i;
        cr_expect_eq(bad, 0,
                     "%s %dx%d %s off %zu, output %d: %zu values of the vector path differ "
                     "from the scalar kernel's (first at %zu: %.9g vs %.9g)",
                     op_names[op], rows, cols, dtype_name(dt), off, k, bad, first,
                     ve[k][first], sc[k][first]);
        if (tol[k] == NO_CPU)
            continue;
        cr_assert_lt(k, nc);
        cr_assert_eq(lc[k], lv[k]);
        double e = rel_err(ve[k], cp[k], lv[k]);
        cr_expect(e <= tol[k], "%s %dx%d %s off %zu, output %d: rel err %.3g > %.3g vs the CPU",
                  op_names[op], rows, cols, dtype_name(dt), off, k, e, tol[k]);
    }
    for (int k = 0; k < MAX_OUT; k++)
        free(sc[k]), free(ve[k]), free(cp[k]);
    free(in.a), free(in.b), free(in.c), free(in.d), free(in.w);
}

/* The cases of one op: aligned 7B widths (vector path), then cols not a
 * multiple of 8 and a misaligned view (scalar kernels), in the activation
 * dtype and in F32. */
static void check_op(int op)
{
    dtype_t dts[] = {gpu->act_dt, DT_F32};
    for (int d = 0; d < 2; d++) {
        if (d == 1 && dts[0] == DT_F32)
            break;
        check_case(op, 33, 4096, dts[d], 0);
        check_case(op, 5, 11008, dts[d], 0);
        check_case(op, 7, 4103, dts[d], 0);
        check_case(op, 9, 1024, dts[d], 1);
    }
}

Test(cuda_elementwise, add_vector_is_scalar_bit_for_bit)
{
    check_op(ADD);
}

Test(cuda_elementwise, add_bias_vector_is_scalar_bit_for_bit)
{
    check_op(ADD_BIAS);
}

Test(cuda_elementwise, swiglu_forward_vector_is_scalar_bit_for_bit)
{
    check_op(SWIGLU_FWD);
}

Test(cuda_elementwise, swiglu_backward_vector_is_scalar_bit_for_bit)
{
    check_op(SWIGLU_BWD);
}

Test(cuda_elementwise, swiglu_on_the_gate_up_halves_vector_is_scalar_bit_for_bit)
{
    check_op(SWIGLU_GU_FWD);
}

Test(cuda_elementwise, swiglu_backward_in_place_on_the_gate_up_halves_vector_is_scalar)
{
    check_op(SWIGLU_GU_BWD);
}

Test(cuda_elementwise, rope_between_column_blocks_vector_is_scalar_bit_for_bit)
{
    check_op(ROPE_LD);
}

Test(cuda_elementwise, dropout_vector_keeps_the_mask_bit_for_bit)
{
    check_op(DROPOUT);
}

Test(cuda_elementwise, rmsnorm_forward_vector_is_scalar_bit_for_bit)
{
    check_op(RMSNORM_FWD);
}

Test(cuda_elementwise, rmsnorm_backward_vector_is_scalar_bit_for_bit)
{
    check_op(RMSNORM_BWD);
}

Test(cuda_elementwise, rope_vector_is_scalar_bit_for_bit)
{
    check_op(ROPE);
}

Test(cuda_elementwise, adamw_vector_is_scalar_bit_for_bit)
{
    check_op(ADAMW);
}

/* ---- which calls the vector path takes --------------------------------------------------- */

typedef int (*vec_add_fn)(backend_t *, tensor_t, tensor_t, float, size_t);
typedef int (*vec_rms_fn)(backend_t *, tensor_t, tensor_t, tensor_t, tensor_t, int, int, float);
typedef int (*vec_nf4_fn)(backend_t *, tensor_t, tensor_t, tensor_t, tensor_t, tensor_t, float,
                          size_t);

static void *cuda_symbol(const char *name)
{
    char why[256];
    void *sym = backend_cuda_symbol(name, why, sizeof why);
    cr_assert(sym, "%s: %s", name, why);
    return sym;
}

/* The entry points of cuda_vec.cu directly: 1 (taken, and run) on aligned
 * tensors of a multiple of 8 elements, 0 (the scalar kernel's turn) on a
 * misaligned view (dequant_nf4's codes: not on a word), an odd size, an
 * RMSNorm row over its shared memory, and
 * under SPOTUNE_CUDA_ELEMENTWISE=scalar: else the bit-for-bit tests above
 * could pass with the vector path never running. */
Test(cuda_elementwise, the_vector_path_takes_aligned_multiples_of_8_only)
{
    if (cuda_test_standin())
        cr_skip_test("the stand-in backend has no vector path");
    vec_add_fn add;
    vec_rms_fn rms;
    void *a = cuda_symbol("cuda_vec_add"), *r = cuda_symbol("cuda_vec_rmsnorm_forward");
    memcpy(&add, &a, sizeof add);
    memcpy(&rms, &r, sizeof rms);
    dtype_t dt = gpu->act_dt;
    tensor_t y = up(gpu, dt, NULL, 4104), x = up(gpu, dt, NULL, 4104);
    tensor_t y32 = up(gpu, DT_F32, NULL, 4104), rstd = up(gpu, DT_F32, NULL, 4);
    unsetenv("SPOTUNE_CUDA_ELEMENTWISE");
    cr_expect_eq(add(gpu, y, x, 1.0f, 4096), 1, "aligned, n 4096");
    cr_expect_eq(add(gpu, y, y32, 1.0f, 4096), 1, "mixed dtypes, aligned");
    cr_expect_eq(add(gpu, y, x, 1.0f, 4100), 0, "n 4100: not a multiple of 8");
    cr_expect_eq(add(gpu, tensor_view(y, 1, 4096), tensor_view(x, 1, 4096), 1.0f, 4096), 0,
                 "views one element in: misaligned");
    cr_expect_eq(add(gpu, tensor_view(y, 8, 4096), tensor_view(x, 8, 4096), 1.0f, 4096), 1,
                 "views 8 elements in: aligned");
    tensor_t w = tensor_view(x, 0, 1024), o = tensor_view(y, 0, 4096);
    cr_expect_eq(rms(gpu, o, rstd, tensor_view(x, 0, 4096), w, 4, 1024, 1e-5f), 1, "4 x 1024");
    cr_expect_eq(rms(gpu, tensor_view(y, 0, 4100), rstd, tensor_view(x, 0, 4100),
                     tensor_view(x, 0, 1025), 4, 1025, 1e-5f),
                 0, "4 x 1025");
    tensor_t big = up(gpu, DT_F32, NULL, 24576);
    cr_expect_eq(rms(gpu, big, rstd, big, tensor_view(big, 0, 24576), 1, 24576, 1e-5f), 0,
                 "a row of 96 KiB: over the shared memory");
    /* dequant_nf4: 8 elements share 4 code bytes, read as one word */
    vec_nf4_fn nf4;
    void *d = cuda_symbol("cuda_vec_dequant_nf4");
    memcpy(&nf4, &d, sizeof nf4);
    tensor_t codes = be_alloc(gpu, DT_U8, 2056), qabs = be_alloc(gpu, DT_U8, 65);
    tensor_t nested = up(gpu, DT_F32, NULL, 1), maps = up(gpu, DT_F32, NULL, 272);
    be_zero(gpu, codes), be_zero(gpu, qabs);
    cr_expect_eq(nf4(gpu, y, codes, qabs, nested, maps, 0.0f, 4096), 1, "dequant_nf4 n 4096");
    cr_expect_eq(nf4(gpu, y32, codes, qabs, nested, maps, 0.0f, 4096), 1, "dequant_nf4 into F32");
    cr_expect_eq(nf4(gpu, y, codes, qabs, nested, maps, 0.0f, 4100), 0, "dequant_nf4 n 4100");
    cr_expect_eq(nf4(gpu, tensor_view(y, 1, 4096), codes, qabs, nested, maps, 0.0f, 4096), 0,
                 "dequant_nf4 into a view one element in");
    cr_expect_eq(nf4(gpu, y, tensor_view(codes, 2, 2048), qabs, nested, maps, 0.0f, 4096), 0,
                 "dequant_nf4 from codes 2 bytes in: not a word");
    cr_assert_eq(setenv("SPOTUNE_CUDA_ELEMENTWISE", "scalar", 1), 0);
    cr_expect_eq(add(gpu, y, x, 1.0f, 4096), 0, "SPOTUNE_CUDA_ELEMENTWISE=scalar");
    cr_expect_eq(nf4(gpu, y, codes, qabs, nested, maps, 0.0f, 4096), 0,
                 "dequant_nf4 under SPOTUNE_CUDA_ELEMENTWISE=scalar");
    unsetenv("SPOTUNE_CUDA_ELEMENTWISE");
    gpu_ok();
    drop(gpu, &y), drop(gpu, &x), drop(gpu, &y32), drop(gpu, &rstd), drop(gpu, &big);
    drop(gpu, &codes), drop(gpu, &qabs), drop(gpu, &nested), drop(gpu, &maps);
}

/* ---- main: skip (77, with the CUDA error) without a usable device -------------------- */

int main(int argc, char *argv[])
{
    return cuda_test_main(argc, argv);
}
