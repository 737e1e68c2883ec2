/* kernels/cpu/cpu_backend.h — the CPU backend: float32 throughout, OpenBLAS
 * sgemm and OpenMP loops (the fast path), or plain loops for every op (the
 * reference, kind "cpu-ref"). Attention: the fast path's is blocked
 * (cpu_attention_flash.c) for windows of 2048 tokens and more, the T x T
 * sgemm one (cpu_attention_blas.c) for shorter ones (SPOTUNE_CPU_ATTENTION=
 * flash or blas at creation: always that one); the reference's the plain
 * loops of cpu_ops.c. Owns its thread settings and nothing else. */
#ifndef SPOTUNE_CPU_BACKEND_H
#define SPOTUNE_CPU_BACKEND_H

#include "../backend.h"

int cpu_backend_create(backend_t **out, int threads, int reference, sp_err *err);

/* Whether be is the reference backend ("cpu-ref": plain loops). */
int cpu_is_reference(const backend_t *be);

/* dst[i] = exp(a src[i] + b) for i < n (dst may be src): libmvec's vector
 * expf where the CPU has AVX-512 or AVX2 (within 2 ulp), expf elsewhere
 * (cpu_vmath.c); cpu_vexp_kind() says which ("libmvec avx512", ...). The
 * fast path's softmax, loss and SwiGLU; the reference keeps expf. */
void cpu_vexp(float *dst, const float *src, size_t n, float a, float b);
const char *cpu_vexp_kind(void);
/* The same through one routine, "avx512", "avx2" or "expf" (tests); -1 when
 * the CPU or the build has not got it. */
int cpu_vexp_with(const char *isa, float *dst, const float *src, size_t n, float a, float b);

/* Products with one side of at most CPU_SKINNY_MAX (LoRA's rank-r ones) by
 * register tiles (cpu_skinny.c) of AVX-512 or AVX2 (with FMA): C = alpha
 * op(A) op(B) + beta C as cblas_sgemm row-major, by isa's tiles. Returns 1
 * when it computed C, 0 when the shape is not skinny or the CPU has not got
 * isa (the caller then runs sgemm). cpu_skinny_isa(): the best this CPU has
 * (CPU_SKINNY_NONE without AVX2 and FMA). The fast path uses the best unless
 * SPOTUNE_CPU_SKINNY says otherwise at the backend's creation: 0 (sgemm for
 * all), avx2, avx512, or 1 (the default: the best). */
#define CPU_SKINNY_MAX 64
enum { CPU_SKINNY_NONE = 0, CPU_SKINNY_AVX2 = 1, CPU_SKINNY_AVX512 = 2 };
int cpu_skinny_matmul(int isa, float *C, const float *A, const float *B, int M, int N, int K,
                      int transA, int transB, float alpha, float beta, int lda, int ldb, int ldc);
int cpu_skinny_isa(void);
/* Products this process has computed there (tests). */
unsigned long cpu_skinny_count(void);

/* The math ops, shared by the fast and reference tables (cpu_ops.c). */
void cpu_rmsnorm_forward(backend_t *be, tensor_t out, tensor_t rstd, tensor_t x, tensor_t w,
                         int rows, int cols, float eps);
void cpu_rmsnorm_backward(backend_t *be, tensor_t dx, tensor_t dw, tensor_t dout, tensor_t x,
                          tensor_t w, tensor_t rstd, int rows, int cols);
void cpu_rope(backend_t *be, tensor_t x, tensor_t src, tensor_t cos, tensor_t sin, tensor_t pos,
              int B, int T, int nh, int hd, int inverse, int x_ld, int src_ld);
/* (the attention ops with the row strides of backend.h's) */
void cpu_attention_forward(backend_t *be, tensor_t out, tensor_t lse, tensor_t q, tensor_t k,
                           tensor_t v, tensor_t seg, int B, int T, int nh, int nkv, int hd,
                           int q_ld, int kv_ld);
void cpu_attention_backward(backend_t *be, tensor_t dq, tensor_t dk, tensor_t dv, tensor_t dout,
                            tensor_t out, tensor_t lse, tensor_t q, tensor_t k, tensor_t v,
                            tensor_t seg, int B, int T, int nh, int nkv, int hd, int q_ld,
                            int kv_ld, int dq_ld, int dkv_ld);
/* The previous fast-path attention (sgemm per head over T x T scores, in
 * causal row blocks, cpu_attention_blas.c): windows under 2048 tokens, or
 * SPOTUNE_CPU_ATTENTION=blas. */
void cpu_attention_forward_blas(backend_t *be, tensor_t out, tensor_t lse, tensor_t q, tensor_t k,
                                tensor_t v, tensor_t seg, int B, int T, int nh, int nkv, int hd,
                                int q_ld, int kv_ld);
void cpu_attention_backward_blas(backend_t *be, tensor_t dq, tensor_t dk, tensor_t dv,
                                 tensor_t dout, tensor_t out, tensor_t lse, tensor_t q,
                                 tensor_t k, tensor_t v, tensor_t seg, int B, int T, int nh,
                                 int nkv, int hd, int q_ld, int kv_ld, int dq_ld, int dkv_ld);
/* The default attention of the fast path: blocked, online softmax, O(T)
 * memory (FlashAttention-2 on the CPU, cpu_attention_flash.c), over tiles of
 * FLASH_BR query rows and FLASH_BC keys. */
#define FLASH_BR 64
#define FLASH_BC 64
void cpu_attention_forward_flash(backend_t *be, tensor_t out, tensor_t lse, tensor_t q,
                                 tensor_t k, tensor_t v, tensor_t seg, int B, int T, int nh,
                                 int nkv, int hd, int q_ld, int kv_ld);
void cpu_attention_backward_flash(backend_t *be, tensor_t dq, tensor_t dk, tensor_t dv,
                                  tensor_t dout, tensor_t out, tensor_t lse, tensor_t q,
                                  tensor_t k, tensor_t v, tensor_t seg, int B, int T, int nh,
                                  int nkv, int hd, int q_ld, int kv_ld, int dq_ld, int dkv_ld);
/* The first key query t of row b attends to: seg[b*T + t] clamped to
 * [0, t], or 0 without segments (backend.h, attention). */
static inline int cpu_seg_lo(const int32_t *seg, size_t bt, int t)
{
    if (!seg)
        return 0;
    int v = seg[bt];
    return v < 0 ? 0 : v > t ? t : v;
}
void cpu_swiglu_forward(backend_t *be, tensor_t out, tensor_t g, tensor_t u, int rows, int cols,
                        int ld);
void cpu_swiglu_backward(backend_t *be, tensor_t dg, tensor_t du, tensor_t dout, tensor_t g,
                         tensor_t u, int rows, int cols, int ld);
void cpu_embedding_forward(backend_t *be, tensor_t out, tensor_t table, tensor_t tokens, int n,
                           int H);
void cpu_embedding_backward(backend_t *be, tensor_t dtable, tensor_t dout, tensor_t tokens,
                            tensor_t order, tensor_t runs, int n, int H);
void cpu_cross_entropy(backend_t *be, tensor_t logits, tensor_t loss, tensor_t targets, int rows,
                       int V, float grad_scale, tensor_t scale);
void cpu_add(backend_t *be, tensor_t y, tensor_t x, float alpha, size_t n);
void cpu_add_bias(backend_t *be, tensor_t y, tensor_t b, int rows, int cols);
void cpu_bias_backward(backend_t *be, tensor_t db, tensor_t dy, int rows, int cols);
void cpu_weight_norm(backend_t *be, tensor_t n, tensor_t W, tensor_t A, tensor_t B, float scale,
                     int out, int in, int r);
void cpu_dequant_nf4(backend_t *be, tensor_t out, tensor_t codes, tensor_t absmax, tensor_t nested,
                     tensor_t maps, float offset, size_t n);
void cpu_quantize_nf4(backend_t *be, tensor_t codes, tensor_t absmax, tensor_t x, tensor_t maps,
                      size_t n);
void cpu_col_scale(backend_t *be, tensor_t y, tensor_t num, tensor_t den, int rows, int cols);
void cpu_col_dot(backend_t *be, tensor_t out, tensor_t x, tensor_t y, tensor_t den, int rows,
                 int cols);
void cpu_dropout(backend_t *be, tensor_t out, tensor_t in, size_t n, float p, uint64_t seed,
                 tensor_t seed_dev, uint64_t offset);
double cpu_sumsq(backend_t *be, tensor_t x, size_t n);
void cpu_sumsq_into(backend_t *be, tensor_t out, tensor_t x, size_t n);
void cpu_sum_add(backend_t *be, tensor_t acc, tensor_t x, size_t n);
void cpu_adamw(backend_t *be, tensor_t param, tensor_t param_copy, tensor_t grad, tensor_t m,
               tensor_t v, size_t n, const adamw_args *a);
void cpu_fill_uniform(backend_t *be, tensor_t x, size_t n, float lo, float hi, uint64_t seed,
                      uint64_t offset);
void cpu_fill_normal(backend_t *be, tensor_t x, size_t n, float mean, float std, uint64_t seed,
                     uint64_t offset);

#endif
