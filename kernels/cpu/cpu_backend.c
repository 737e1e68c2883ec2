/* CPU backend: memory, copies and the matmul (OpenBLAS, cpu_skinny.c for
 * products with a side of at most 64, or plain loops).
 * Every op's arguments have been checked (kernels/backend_ops.c): sizes,
 * element counts and dtypes are what the op needs, floats F32 (act_dt). */
#include "cpu_backend.h"

#include <cblas.h>
#include <strings.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef enum { ATTN_AUTO = 0, ATTN_FLASH = 1, ATTN_BLAS = 2, ATTN_PLAIN = 3 } cpu_attn_kind;

/* ATTN_AUTO: the blocked attention from this many tokens a window (where its
 * O(T) memory and skipped tiles win: 1.02 s a step against 1.34 at 2048),
 * the sgemm one below (faster there: 0.35 s against 0.43 at 1024) */
#define CPU_FLASH_MIN_T 2048

typedef struct cpu_impl {
    int reference;
    cpu_attn_kind attn; /* the attention this backend runs */
    int skinny;         /* products with a side of <= 64 by cpu_skinny.c's tiles of
                           this CPU_SKINNY_* (NONE: sgemm) */
} cpu_impl;

int cpu_is_reference(const backend_t *be)
{
    return ((const cpu_impl *)be->impl)->reference;
}

static tensor_t cpu_alloc(backend_t *be, dtype_t dt, size_t n)
{
    tensor_t t = {NULL, n, dt};
    size_t bytes = n * dtype_size(dt);
    /* 64-byte alignment for vector loads; calloc-like zeroing */
    size_t rounded = (bytes + 63) & ~(size_t)63;
    t.p = aligned_alloc(64, rounded ? rounded : 64);
    if (!t.p) {
        be_fail(be, __FILE__, __LINE__, "out of memory allocating %zu bytes", bytes);
        t.n = 0;
        return t;
    }
    memset(t.p, 0, rounded ? rounded : 64);
    be->bytes_in_use += bytes;
    if (be->bytes_in_use > be->bytes_peak)
        be->bytes_peak = be->bytes_in_use;
    return t;
}

static void cpu_free(backend_t *be, tensor_t *t)
{
    if (t->p) {
        be->bytes_in_use -= t->n * dtype_size(t->dt);
        free(t->p);
    }
    t->p = NULL;
    t->n = 0;
}

static void cpu_h2d(backend_t *be, void *dst, const void *src, size_t bytes)
{
    (void)be;
    if (bytes)
        memcpy(dst, src, bytes);
}

static void cpu_zero(backend_t *be, tensor_t t)
{
    (void)be;
    if (t.n)
        memset(t.p, 0, t.n * dtype_size(t.dt));
}

static void cpu_copy(backend_t *be, tensor_t dst, tensor_t src)
{
    if (dtype_convert(dst.p, dst.dt, src.p, src.dt, src.n) != 0)
        be_fail(be, __FILE__, __LINE__, "copy from %s to %s unsupported", dtype_name(src.dt),
                dtype_name(dst.dt));
}

static void cpu_copy2d(backend_t *be, tensor_t dst, tensor_t src, int rows, int cols,
                       int dst_ld, int src_ld)
{
    size_t es = dtype_size(src.dt);
    (void)be;
#pragma omp parallel for schedule(static) if ((size_t)rows * (size_t)cols > 65536)
    for (int r = 0; r < rows; r++)
        memcpy((char *)dst.p + (size_t)r * (size_t)dst_ld * es,
               (const char *)src.p + (size_t)r * (size_t)src_ld * es, (size_t)cols * es);
}

static void cpu_sync(backend_t *be)
{
    (void)be;
}

/* The reference: C = alpha*op(A)op(B) + beta*C with a double accumulator. */
static void matmul_plain(float *C, const float *A, const float *B, int M, int N, int K,
                         int transA, int transB, float alpha, float beta, int lda, int ldb,
                         int ldc)
{
#pragma omp parallel for schedule(static)
    for (int i = 0; i < M; i++) {
        for (int j = 0; j < N; j++) {
            double acc = 0.0;
            for (int k = 0; k < K; k++) {
                float a = transA ? A[(size_t)k * lda + i] : A[(size_t)i * lda + k];
                float b = transB ? B[(size_t)j * ldb + k] : B[(size_t)k * ldb + j];
                acc += (double)a * (double)b;
            }
            float *c = &C[(size_t)i * ldc + j];
            *c = (float)(alpha * acc + (beta == 0.0f ? 0.0 : (double)beta * *c));
        }
    }
}

static void cpu_matmul(backend_t *be, tensor_t C, tensor_t A, tensor_t B, int M, int N, int K,
                       int transA, int transB, float alpha, float beta, int lda, int ldb, int ldc)
{
    if (M == 0 || N == 0)
        return;
    if (cpu_is_reference(be) || K == 0) {
        matmul_plain(C.p, A.p, B.p, M, N, K, transA, transB, alpha, beta, lda, ldb, ldc);
        return;
    }
    int isa = ((cpu_impl *)be->impl)->skinny;
    if (isa && cpu_skinny_matmul(isa, C.p, A.p, B.p, M, N, K, transA, transB, alpha, beta, lda,
                                 ldb, ldc))
        return;
    cblas_sgemm(CblasRowMajor, transA ? CblasTrans : CblasNoTrans,
                transB ? CblasTrans : CblasNoTrans, M, N, K, alpha, A.p, lda, B.p, ldb, beta,
                C.p, ldc);
}

static void cpu_destroy(backend_t *be)
{
    free(be->impl);
    free(be);
}

/* Attention: blocked (flash) on the fast path from CPU_FLASH_MIN_T tokens,
 * sgemm per head over T x T scores below (SPOTUNE_CPU_ATTENTION=flash or
 * blas: always that one); plain loops for the reference. */
static cpu_attn_kind cpu_attn(backend_t *be, int T)
{
    cpu_attn_kind k = ((cpu_impl *)be->impl)->attn;
    if (k == ATTN_AUTO)
        k = T >= CPU_FLASH_MIN_T ? ATTN_FLASH : ATTN_BLAS;
    return k;
}

static void cpu_attention_fwd(backend_t *be, tensor_t out, tensor_t lse, tensor_t q, tensor_t k,
                              tensor_t v, tensor_t seg, int B, int T, int nh, int nkv, int hd,
                              int ql, int kl)
{
    if (cpu_attn(be, T) == ATTN_PLAIN)
        cpu_attention_forward(be, out, lse, q, k, v, seg, B, T, nh, nkv, hd, ql, kl);
    else if (cpu_attn(be, T) == ATTN_BLAS)
        cpu_attention_forward_blas(be, out, lse, q, k, v, seg, B, T, nh, nkv, hd, ql, kl);
    else
        cpu_attention_forward_flash(be, out, lse, q, k, v, seg, B, T, nh, nkv, hd, ql, kl);
}

static void cpu_attention_bwd(backend_t *be, tensor_t dq, tensor_t dk, tensor_t dv, tensor_t dout,
                              tensor_t out, tensor_t lse, tensor_t q, tensor_t k, tensor_t v,
                              tensor_t seg, int B, int T, int nh, int nkv, int hd, int ql, int kl,
                              int dql, int dkl)
{
    if (cpu_attn(be, T) == ATTN_PLAIN)
        cpu_attention_backward(be, dq, dk, dv, dout, out, lse, q, k, v, seg, B, T, nh, nkv, hd, ql,
                               kl, dql, dkl);
    else if (cpu_attn(be, T) == ATTN_BLAS)
        cpu_attention_backward_blas(be, dq, dk, dv, dout, out, lse, q, k, v, seg, B, T, nh, nkv,
                                    hd, ql, kl, dql, dkl);
    else
        cpu_attention_backward_flash(be, dq, dk, dv, dout, out, lse, q, k, v, seg, B, T, nh, nkv,
                                     hd, ql, kl, dql, dkl);
}

static const backend_ops cpu_ops = {
    .alloc = cpu_alloc,
    .free = cpu_free,
    .h2d = cpu_h2d,
    .d2h = cpu_h2d,
    .zero = cpu_zero,
    .copy = cpu_copy,
    .sync = cpu_sync,
    .copy2d = cpu_copy2d,
    .matmul = cpu_matmul,
    .rmsnorm_forward = cpu_rmsnorm_forward,
    .rmsnorm_backward = cpu_rmsnorm_backward,
    .rope = cpu_rope,
    .attention_forward = cpu_attention_fwd,
    .attention_backward = cpu_attention_bwd,
    .swiglu_forward = cpu_swiglu_forward,
    .swiglu_backward = cpu_swiglu_backward,
    .embedding_forward = cpu_embedding_forward,
    .embedding_backward = cpu_embedding_backward,
    .cross_entropy = cpu_cross_entropy,
    .add = cpu_add,
    .add_bias = cpu_add_bias,
    .bias_backward = cpu_bias_backward,
    .weight_norm = cpu_weight_norm,
    .col_scale = cpu_col_scale,
    .col_dot = cpu_col_dot,
    .dequant_nf4 = cpu_dequant_nf4,
    .quantize_nf4 = cpu_quantize_nf4,
    .dropout = cpu_dropout,
    .sumsq = cpu_sumsq,
    .sumsq_into = cpu_sumsq_into,
    .sum_add = cpu_sum_add,
    .adamw = cpu_adamw,
    .fill_uniform = cpu_fill_uniform,
    .fill_normal = cpu_fill_normal,
    .destroy = cpu_destroy,
};

/* SPOTUNE_CPU_SKINNY: unset or 1 the best tiles this CPU has, 0 none
 * (sgemm), avx2 or avx512 those (refused where the CPU has not got them) */
int backend_cpu_skinny_choice(int *isa, sp_err *err)
{
    const char *v = getenv("SPOTUNE_CPU_SKINNY");
    int best = cpu_skinny_isa();
    if (!v || !*v || strcmp(v, "1") == 0) {
        *isa = best;
        return 0;
    }
    if (strcmp(v, "0") == 0) {
        *isa = CPU_SKINNY_NONE;
        return 0;
    }
    int want = strcmp(v, "avx2") == 0     ? CPU_SKINNY_AVX2
               : strcmp(v, "avx512") == 0 ? CPU_SKINNY_AVX512
                                          : -1;
    if (want < 0)
        return sp_fail(err, SP_EXIT_USAGE,
                       "SPOTUNE_CPU_SKINNY=%s: expected 0, 1, avx2 or avx512", v);
    if (want > best)
        return sp_fail(err, SP_EXIT_USAGE,
                       "SPOTUNE_CPU_SKINNY=%s: this CPU has not got %s (its best: %s)", v,
                       want == CPU_SKINNY_AVX512 ? "AVX-512" : "AVX2 with FMA",
                       best == CPU_SKINNY_AVX512 ? "avx512"
                       : best == CPU_SKINNY_AVX2 ? "avx2"
                                                 : "none");
    *isa = want;
    return 0;
}

int cpu_backend_create(backend_t **out, int threads, int reference, sp_err *err)
{
    backend_t *be = calloc(1, sizeof *be);
    cpu_impl *impl = calloc(1, sizeof *impl);
    if (!be || !impl) {
        free(be);
        free(impl);
        return sp_fail(err, SP_EXIT_OTHER, "out of memory creating the CPU backend");
    }
    if (threads <= 0) {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        threads = n > 0 ? (int)n : 1;
    }
    impl->reference = reference;
    if (!reference && backend_cpu_skinny_choice(&impl->skinny, err) != 0) {
        free(be);
        free(impl);
        return -1;
    }
    const char *attn = getenv("SPOTUNE_CPU_ATTENTION");
    impl->attn = reference                             ? ATTN_PLAIN
                 : attn && strcmp(attn, "blas") == 0  ? ATTN_BLAS
                 : attn && strcmp(attn, "flash") == 0 ? ATTN_FLASH
                                                      : ATTN_AUTO;
    be->ops = &cpu_ops;
    be->name = reference ? "cpu-ref" : "cpu";
    be->act_dt = DT_F32;
    be->threads = threads;
    be->device = -1;
    be->impl = impl;
    strcpy(be->device_name, "CPU");
    omp_set_num_threads(threads);
    openblas_set_num_threads(threads);
    *out = be;
    return 0;
}

const char *backend_cpu_blas_core(void)
{
    return openblas_get_corename();
}

/* What kind of kernel set OpenBLAS's name core is: "generic" (what its
 * runtime dispatch falls back to for a CPU it does not know, Prescott, and
 * the older cores below Haswell), "AVX2" (Haswell, Zen: 256-bit), or NULL
 * (AVX-512 sets, and names not listed here). */
static const char *blas_class(const char *core)
{
    static const char *const generic[] = {"prescott", "katmai",  "coppermine", "northwood",
                                          "banias",   "core2",   "penryn",     "dunnington",
                                          "nehalem",  "atom",    "unknown",    NULL};
    static const char *const avx2[] = {"haswell", "zen", "excavator", NULL};
    if (!core || !*core)
        return "generic";
    for (int i = 0; generic[i]; i++)
        if (strcasecmp(core, generic[i]) == 0)
            return "generic";
    for (int i = 0; avx2[i]; i++)
        if (strcasecmp(core, avx2[i]) == 0)
            return "AVX2";
    return NULL;
}

void backend_cpu_blas_describe(char *buf, size_t n)
{
    const char *core = openblas_get_corename(), *was = getenv("SPOTUNE_BLAS_FALLBACK");
    if (was && *was)
        snprintf(buf, n, "OpenBLAS %s kernels (OPENBLAS_CORETYPE set by spotune: OpenBLAS chose "
                 "its %s %s kernels for this CPU)",
                 core && *core ? core : "(unknown)", blas_class(was) ? blas_class(was) : "own",
                 was);
    else
        snprintf(buf, n, "OpenBLAS %s kernels", core && *core ? core : "(unknown)");
    int isa;
    sp_err err = {0};
    size_t used = strlen(buf);
    if (backend_cpu_skinny_choice(&isa, &err) != 0)
        snprintf(buf + used, n - used, "; %s", err.msg);
    else
        snprintf(buf + used, n - used, "; products with a side of 64 or less (LoRA's): %s",
                 isa == CPU_SKINNY_AVX512 ? "spotune's AVX-512 tiles"
                 : isa == CPU_SKINNY_AVX2 ? "spotune's AVX2 tiles"
                 : cpu_skinny_isa()       ? "OpenBLAS (SPOTUNE_CPU_SKINNY=0)"
                                          : "OpenBLAS (no AVX2 with FMA)");
}

const char *backend_cpu_blas_kind(void)
{
    return blas_class(openblas_get_corename());
}

const char *backend_cpu_blas_better(void)
{
    const char *kind = blas_class(openblas_get_corename());
    if (!kind)
        return NULL;
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx512cd"))
        return "SkylakeX";
    if (strcmp(kind, "generic") == 0 && __builtin_cpu_supports("avx2") &&
        __builtin_cpu_supports("fma"))
        return "Haswell";
    return NULL;
}
