/* kernels/backend.h — the op interface the model is written against, once.
 *
 * Owns: device memory (tensor handles), host<->device copies, and every math
 * op of a Llama-family training step, each backward beside its forward.
 * Knows nothing of models, files or ranks.
 *
 * Conventions shared by every backend:
 *  - Matrices are row-major. A tensor is a handle to device memory; host code
 *    never dereferences t.p (on the CPU backend it happens to be host memory).
 *  - be->act_dt is the dtype of activations and of the compute copy of
 *    weights: F32 on the CPU backend, BF16 on CUDA. Reductions, norms,
 *    softmax and the loss are computed in fp32 on every backend.
 *  - Ops whose comment says "+=" accumulate into their output; the others
 *    overwrite it.
 *  - Ops do not return errors: a failure is recorded in the backend's sticky
 *    error (first one wins, with file:line) and read with be_check().
 *  - Callers run the ops through the be_* functions at the end of this file,
 *    never through be->ops: they check every call's arguments, the same way
 *    for every backend, before the backend sees them.
 */
#ifndef SPOTUNE_BACKEND_H
#define SPOTUNE_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "../base/base.h"

typedef enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2, DT_I32 = 3, DT_U8 = 4 } dtype_t;

size_t dtype_size(dtype_t dt);
const char *dtype_name(dtype_t dt);

typedef struct tensor {
    void *p;    /* device address of element 0 */
    size_t n;   /* number of elements */
    dtype_t dt;
} tensor_t;

/* A view of n elements starting at element off (bounds checked: a bad view
 * aborts the process, since it is a programming error, not bad input). */
tensor_t tensor_view(tensor_t t, size_t off, size_t n);

typedef struct adamw_args {
    float lr, beta1, beta2, eps, weight_decay;
    float grad_scale; /* gradients are multiplied by this first (clipping) */
    int64_t step;     /* 1-based, for bias correction */
    /* Optional (both or neither), for an update launched without the host
     * reading the gradient norm first, the same every step (so a captured
     * span can hold it):
     *  - hyper: F32 [3] in device memory, adamw_hyper()'s values (the
     *    learning rate and the bias corrections), in place of lr and step;
     *  - sumsq: the gradient's sum of squares, a double in device memory
     *    (F32 [2], 8-byte aligned; be_sumsq_into writes it), in place of
     *    grad_scale: the scale is adamw_clip_scale(sqrt(sumsq), max_norm),
     *    and when the sum is not finite nothing is updated. */
    tensor_t hyper, sumsq;
    double max_norm;
} adamw_args;

/* The positions of n token ids grouped by id, for embedding_backward:
 * order[k], the positions sorted by id (stable: each id's in position
 * order); runs[0] = u, the number of distinct ids; runs[1 + j], where the
 * j-th id's positions start in order (j < u); runs[1 + u] = n. O(n).
 * 0, or -1 when out of host memory. */
int embedding_order(const int32_t *tokens, int n, int32_t *order, int32_t *runs);

/* The documents of packed rows (attention's seg, I32 [B,T]) as a table,
 * for a backend that runs them as separate sequences (be->doc_table):
 * table[i] = b T + t, where document i starts (a document: a run of one
 * row's positions whose seg is the run's own first position), in order;
 * table[n..C] = B T after the n documents. C, returned, is the table's
 * capacity: n rounded up to a power of two, at least 8 and at most B T
 * (few capacities, so a backend builds few plans, and captured spans
 * differ only where it does). table holds B T + 1 entries; C + 1 are
 * written. 0 when seg is not such a set of documents (a position whose
 * seg is not its run's first position, or outside [0, t]): no table then,
 * and the attention masks by seg alone. */
int packed_doc_table(const int32_t *seg, int B, int T, int32_t *table);

/* hyper's values for a's lr and step: {lr, lr / (1 - beta1^step),
 * sqrt(1 - beta2^step)}, as every backend's AdamW derives them. */
void adamw_hyper(const adamw_args *a, float hyper[3]);

#ifdef __CUDACC__
#define BE_HOST_DEVICE __host__ __device__
#else
#define BE_HOST_DEVICE
#endif
/* Gradient clipping (train.clip_grad_norm): the factor the gradient is
 * multiplied by, 1 when max_norm <= 0 or the norm is within it (a NaN norm
 * included: the caller tests it), else max_norm / (norm + 1e-6). On the host
 * and in kernels, so both give the same bits. */
static inline BE_HOST_DEVICE double adamw_clip_scale(double norm, double max_norm)
{
    if (max_norm <= 0 || !(norm > max_norm))
        return 1.0;
    return max_norm / (norm + 1e-6);
}

typedef struct backend backend_t;

typedef struct backend_ops {
    /* memory: alloc returns zeroed memory, or a tensor with p == NULL and the
     * sticky error set */
    tensor_t (*alloc)(backend_t *be, dtype_t dt, size_t n);
    void (*free)(backend_t *be, tensor_t *t);
    /* copies between host and device memory; they return once the copy is
     * complete (ordered after the work already on the compute stream) */
    void (*h2d)(backend_t *be, void *dst, const void *src, size_t bytes);
    void (*d2h)(backend_t *be, void *dst, const void *src, size_t bytes);
    /* optional (without them: malloc'd host memory and h2d): pinned host
     * memory, and a host-to-device copy from it that returns at once,
     * ordered after the work already on the compute stream; h2d_wait
     * returns when every such copy enqueued so far has completed, so that
     * their sources may be written again */
    void *(*host_alloc)(backend_t *be, size_t bytes);
    void (*host_free)(backend_t *be, void *p);
    void (*h2d_async)(backend_t *be, void *dst, const void *src, size_t bytes);
    void (*h2d_wait)(backend_t *be);
    void (*zero)(backend_t *be, tensor_t t);
    /* dst = src, converting between F32 and BF16 if their dtypes differ */
    void (*copy)(backend_t *be, tensor_t dst, tensor_t src);
    void (*sync)(backend_t *be);
    /* A block of columns between row-major matrices of one dtype:
     * dst[r * dst_ld + c] = src[r * src_ld + c], r < rows, c < cols (splits
     * a fused product's output into its parts, and joins them back) */
    void (*copy2d)(backend_t *be, tensor_t dst, tensor_t src, int rows, int cols, int dst_ld,
                   int src_ld);

    /* C[M,N] = alpha * op(A) op(B) + beta * C; op(A) is M x K (A stored K x M
     * when transA), op(B) is K x N (B stored N x K when transB). A and B are
     * act_dt (or F32 on the CPU backend); C is act_dt or F32. lda, ldb, ldc:
     * the row strides of A, B and C as stored (row-major; at least the
     * stored widths, checked by be_matmul_ld), so a product can read or
     * write a block of columns of a wider matrix. */
    void (*matmul)(backend_t *be, tensor_t C, tensor_t A, tensor_t B, int M, int N, int K,
                   int transA, int transB, float alpha, float beta, int lda, int ldb, int ldc);
    /* D[M,N] = alpha * op(A) op(B) + beta * C with C and D distinct (the
     * residual stream's add without a copy: cuBLASLt reads C and writes D);
     * optional: without it be_matmul_into copies C into D and runs matmul */
    void (*matmul_cd)(backend_t *be, tensor_t D, tensor_t C, tensor_t A, tensor_t B, int M, int N,
                      int K, int transA, int transB, float alpha, float beta);
    /* batch products as matmul's, product b on the matrices that start
     * sa, sb, sc elements of A, B, C after product b - 1's (the LoRA
     * branches of a fused group, one call); optional: without it
     * be_matmul_batched runs matmul once per product */
    void (*matmul_batched)(backend_t *be, tensor_t C, tensor_t A, tensor_t B, int M, int N, int K,
                           int transA, int transB, float alpha, float beta, int lda, int ldb,
                           int ldc, int batch, unsigned long sa, unsigned long sb,
                           unsigned long sc);

    /* out = w * (x * rstd), rstd[r] = 1/sqrt(mean(x[r]^2) + eps) (F32) */
    void (*rmsnorm_forward)(backend_t *be, tensor_t out, tensor_t rstd, tensor_t x, tensor_t w,
                            int rows, int cols, float eps);
    /* dx += d/dx, dw += d/dw (F32; skipped when dw.p == NULL) */
    void (*rmsnorm_backward)(backend_t *be, tensor_t dx, tensor_t dw, tensor_t dout, tensor_t x,
                             tensor_t w, tensor_t rstd, int rows, int cols);

    /* x = the rotation of src, [B,T,nh,hd] each, rotate-half convention;
     * the token rows of x and src start x_ld and src_ld elements apart (nh
     * hd when contiguous; more for the column block of a fused q/k/v
     * product). src is x itself for the rotation in place (the same
     * stride; each pair i, i + hd/2 is read before it is written), else
     * they do not overlap. cos, sin are F32 [T, hd/2], row p the angles of
     * position p. pos: I32 [B,T], the position of each token (packed
     * documents restart at 0), values taken in [0, T) (clamped); absent
     * (p == NULL): position t. inverse applies the transposed rotation (the
     * backward). */
    void (*rope)(backend_t *be, tensor_t x, tensor_t src, tensor_t cos, tensor_t sin,
                 tensor_t pos, int B, int T, int nh, int hd, int inverse, int x_ld, int src_ld);

    /* Causal grouped-query attention, scale 1/sqrt(hd).
     * q, out [B,T,nh,hd]; k, v [B,T,nkv,hd]; lse F32 [B,nh,T] (log-sum-exp
     * of each softmax row, kept for the backward). dq, dk, dv overwritten.
     * Rows (b T + t: one token's heads) of q lie q_ld elements apart, of k
     * and v kv_ld, of dq dq_ld, of dk and dv dkv_ld (nh hd and nkv hd:
     * contiguous; the fused q/k/v product's output or its gradient: the
     * column blocks of one [B T, nh hd + 2 nkv hd] matrix); out and dout
     * are contiguous. seg: I32 [B,T], variable-length sequences packed in a row: query t
     * attends to keys j in [seg[b,t], t] only (the first position of its
     * document; values clamped to [0, t]), so no token sees another
     * document; absent (p == NULL): every key j <= t. Where be->doc_table
     * is set, seg may hold more than B T entries: then they are followed
     * by the rows' document table, C + 1 entries (packed_doc_table, C =
     * seg.n - B T - 1), which a backend may use instead of the starts (the
     * CUDA backend's attention by cuDNN runs the documents as sequences of
     * their own); the others read the first B T. */
    void (*attention_forward)(backend_t *be, tensor_t out, tensor_t lse, tensor_t q, tensor_t k,
                              tensor_t v, tensor_t seg, int B, int T, int nh, int nkv, int hd,
                              int q_ld, int kv_ld);
    void (*attention_backward)(backend_t *be, tensor_t dq, tensor_t dk, tensor_t dv,
                               tensor_t dout, tensor_t out, tensor_t lse, tensor_t q,
                               tensor_t k, tensor_t v, tensor_t seg, int B, int T, int nh,
                               int nkv, int hd, int q_ld, int kv_ld, int dq_ld, int dkv_ld);

    /* out = silu(g) * u over [rows, cols]: g and u are read with row
     * stride ld (cols: contiguous; 2 cols: the two column halves of one
     * [rows, 2 cols] matrix, the fused gate/up product), out is contiguous.
     * The backward overwrites dg and du (stride ld, as g and u) from dout
     * (contiguous); dg and du may be g and u themselves (in place: each
     * element of g and u is read before it is written). */
    void (*swiglu_forward)(backend_t *be, tensor_t out, tensor_t g, tensor_t u, int rows,
                           int cols, int ld);
    void (*swiglu_backward)(backend_t *be, tensor_t dg, tensor_t du, tensor_t dout, tensor_t g,
                            tensor_t u, int rows, int cols, int ld);

    /* out[i,:] = table[tokens[i],:]; tokens I32 [n]; backward: dtable += (F32),
     * deterministic: the rows of one id are summed in position order, then
     * added (each row of dtable has one writer). order (I32 [n]) and runs
     * (I32 [n + 2]) group the positions by id: embedding_order() makes them
     * from the tokens on the host; ids outside the table train nothing. */
    void (*embedding_forward)(backend_t *be, tensor_t out, tensor_t table, tensor_t tokens, int n,
                              int H);
    void (*embedding_backward)(backend_t *be, tensor_t dtable, tensor_t dout, tensor_t tokens,
                               tensor_t order, tensor_t runs, int n, int H);

    /* Fused softmax cross-entropy and its backward, in place.
     * logits [rows,V] (act_dt) becomes dlogits = (softmax - onehot) * g,
     * g = grad_scale, times scale[0] when scale is given (F32 [1] in device
     * memory: a factor that changes from step to step without changing the
     * launch, see be_trace); loss[r] (F32) = -log softmax(logits[r])[targets[r]].
     * targets I32; a row with target < 0 is ignored: loss 0, dlogits 0. */
    void (*cross_entropy)(backend_t *be, tensor_t logits, tensor_t loss, tensor_t targets,
                          int rows, int V, float grad_scale, tensor_t scale);

    /* y += alpha * x */
    void (*add)(backend_t *be, tensor_t y, tensor_t x, float alpha, size_t n);
    /* y[r,:] += b;  db += sum_r dy[r,:] (F32) */
    void (*add_bias)(backend_t *be, tensor_t y, tensor_t b, int rows, int cols);
    void (*bias_backward)(backend_t *be, tensor_t db, tensor_t dy, int rows, int cols);
    /* DoRA. weight_norm: n[o] = || W[o,:] + scale * (B A)[o,:] ||_2 (F32 n [out];
     * W [out,in], A [r,in], B [out,r]; r == 0: the row norms of W, A and B
     * untouched), accumulated in fp32 or wider.
     * col_scale: y[r,c] *= num[c] / den[c] (den F32).
     * col_dot: out[c] += sum_r x[r,c] * y[r,c] / den[c] (out, den F32). */
    void (*weight_norm)(backend_t *be, tensor_t n, tensor_t W, tensor_t A, tensor_t B,
                        float scale, int out, int in, int r);
    void (*col_scale)(backend_t *be, tensor_t y, tensor_t num, tensor_t den, int rows, int cols);
    void (*col_dot)(backend_t *be, tensor_t out, tensor_t x, tensor_t y, tensor_t den, int rows,
                    int cols);

    /* QLoRA: the first n elements of an NF4 matrix with double quantization
     * (kernels/nf4.h, bitsandbytes' layout), out[i] = maps[code_i] *
     * (maps[16 + absmax[i/64]] * nested[i/16384] + offset), computed in F32
     * and written in out's dtype. codes U8 [(n+1)/2] (two per byte, the
     * first in the high nibble), absmax U8 [ceil(n/64)], nested F32
     * [ceil(n/16384)], maps F32 [16 + 256] (the NF4 values, then the 8-bit
     * dynamic map). */
    void (*dequant_nf4)(backend_t *be, tensor_t out, tensor_t codes, tensor_t absmax,
                        tensor_t nested, tensor_t maps, float offset, size_t n);
    /* QLoRA's quantization where the weights are (kernels/nf4.h
     * nf4_quantize_codes, bit for bit): the first n values of x in blocks
     * of 64, absmax[b] the block's largest |x| (a partial last block's at
     * least 1e-38), each value scaled by it and given the code of the
     * nearest NF4 value of maps[0..15] (ties to the lower; two codes a
     * byte, the first in the high nibble; an odd n pads with 0.0's code).
     * codes U8 [(n+1)/2], absmax F32 [ceil(n/64)], x F32 or BF16 [n], maps
     * as dequant_nf4's. The double quantization of absmax stays the
     * host's (nf4_quantize_absmax): its offset is a sum in order. */
    void (*quantize_nf4)(backend_t *be, tensor_t codes, tensor_t absmax, tensor_t x,
                         tensor_t maps, size_t n);

    /* out = in * keep / (1 - p), keep = uniform(s, offset + i) >= p, s = seed
     * plus (mod 2^64), when seed_dev is given, the 64-bit value it holds (I32
     * [2] in device memory, low word first: a seed that changes from step to
     * step without changing the launch). The same call on gradients is the
     * backward. p == 0 copies. */
    void (*dropout)(backend_t *be, tensor_t out, tensor_t in, size_t n, float p, uint64_t seed,
                    tensor_t seed_dev, uint64_t offset);

    /* sum of squares of x (F32) in double, returned to the host (synchronous);
     * deterministic: does not depend on the number of threads */
    double (*sumsq)(backend_t *be, tensor_t x, size_t n);
    /* the same sum written to device memory (out: F32 [2] holding a double,
     * 8-byte aligned), in stream order: nothing waits for it */
    void (*sumsq_into)(backend_t *be, tensor_t out, tensor_t x, size_t n);
    /* acc (F32 [2] holding a double, 8-byte aligned) += s, where s is the
     * sum of x[0..n) (F32) taken from 0.0 one by one in that order in
     * double, so every backend gives the bits of that loop on the host; in
     * stream order (the step's loss summed in device memory, read once a
     * step) */
    void (*sum_add)(backend_t *be, tensor_t acc, tensor_t x, size_t n);

    /* AdamW with decoupled decay on F32 params, grads, moments; when
     * param_copy.p != NULL it receives the updated params in its dtype. */
    void (*adamw)(backend_t *be, tensor_t param, tensor_t param_copy, tensor_t grad, tensor_t m,
                  tensor_t v, size_t n, const adamw_args *a);

    /* x[i] = lo + (hi-lo)*uniform(seed, offset+i);  x[i] = mean + std*normal(...) */
    void (*fill_uniform)(backend_t *be, tensor_t x, size_t n, float lo, float hi, uint64_t seed,
                         uint64_t offset);
    void (*fill_normal)(backend_t *be, tensor_t x, size_t n, float mean, float std, uint64_t seed,
                        uint64_t offset);

    /* Streams for overlapping communication with compute (CUDA); NULL on
     * the CPU. aux_stream: a second stream (cudaStream_t), owned by the
     * backend; stream_fence: makes `waiter` wait for everything enqueued so
     * far on `waitee`. */
    void *(*aux_stream)(backend_t *be);
    void (*stream_fence)(backend_t *be, void *waiter, void *waitee);

    /* Step profile (be_prof_*, backend_prof.c): prof_mark records a
     * timestamp in slot i in stream order (CUDA: an event on the compute
     * stream); prof_read waits for slots 0..n-1 and gives each as ms after
     * slot 0, then releases them. NULL on the CPU, whose ops return when
     * done: the host clock serves. */
    void (*prof_mark)(backend_t *be, int i);
    int (*prof_read)(backend_t *be, double *ms, int n);

    /* Captured spans (be_graph_*, backend_trace.c); NULL where the backend
     * has none (the CPU: backend_trace.c records and replays the op list
     * instead). graph_begin starts capturing the compute stream (0, or -1
     * with the sticky error set); graph_end stops it and instantiates the
     * graph: a handle, or NULL with why (n bytes) when the capture or the
     * instantiation failed, the sticky error as it was at graph_begin;
     * graph_launch runs it on the compute stream: 0, 1 when it is stale
     * (memory its kernels use beyond their arguments, the backend's
     * scratch, was reallocated since the capture), -1 with the sticky error
     * set; graph_free releases it. */
    int (*graph_begin)(backend_t *be);
    void *(*graph_end)(backend_t *be, char *why, size_t n);
    int (*graph_launch)(backend_t *be, void *g);
    void (*graph_free)(backend_t *be, void *g);

    void (*destroy)(backend_t *be);
} backend_ops;

struct backend {
    const backend_ops *ops;
    const char *name;      /* "cpu" or "cuda" */
    dtype_t act_dt;        /* activations and compute weights */
    int threads;           /* host threads the backend uses */
    size_t bytes_in_use;   /* device memory currently allocated */
    size_t bytes_peak;
    char device_name[128];
    int device;            /* the GPU ordinal in use (CUDA); -1 on the CPU */
    int device_count;      /* GPUs this process sees (CUDA); 0 on the CPU */
    unsigned char device_uuid[16]; /* the GPU's UUID (CUDA); zero on the CPU */
    sp_err err;            /* sticky: first failure, with file:line */
    void *stream;          /* CUDA: the compute stream (cudaStream_t); CPU: NULL */
    size_t mem_total;      /* device memory free for this process at creation (CPU: 0) */
    size_t workspace_bytes; /* the backend's own scratch at most (matmul workspace,
                               attention blocks), for memory plans */
    void *impl;
    struct be_prof *prof; /* a step profile being recorded (backend_prof.c), or NULL */
    struct be_trace *trace; /* a launch trace being taken (backend_trace.c), or NULL */
    /* 1: the attention takes packed rows' document table after seg (the
     * CUDA backend when the attention by cuDNN is asked for); the trainer
     * then stages it with the starts */
    int doc_table;
    /* tests: when set, be_graph_end refuses every capture with this reason,
     * as a device may (so the fallback runs on a backend that never refuses) */
    const char *graph_refuse;
    /* Set by the backend's owner: called with what (a short name) as the
     * host starts to wait for the device's work (a sync, a copy to or from
     * the host, a free, a grown scratch; the CUDA backend) and with NULL
     * when that wait ends. The trainer's watchdog watches such waits when
     * gradients cross GPUs (grad_sync_watch_waits): the work waited for may
     * be behind a collective whose peer never comes, and the GPU never
     * says so. */
    void (*wait_hook)(void *ctx, const char *what);
    void *wait_ctx;
};

/* Creates "cpu" or "cuda" ("auto": cuda when a device is visible, else cpu).
 * device is the GPU ordinal (ignored by cpu); threads 0 = all cores. */
int backend_create(backend_t **out, const char *kind, int device, int threads, sp_err *err);
void backend_destroy(backend_t *be);
/* 1 when this binary was built with the CUDA backend and a device is visible. */
int backend_cuda_available(void);
/* The CPU backend's BLAS: OpenBLAS's name for the kernels it chose
 * (openblas_get_corename); their kind (backend_cpu_blas_kind: "generic",
 * the fallbacks for a CPU it does not recognise, "AVX2", Haswell and Zen,
 * or NULL: AVX-512 and other sets); and, when they are generic on a CPU
 * with AVX-512 or AVX2 + FMA, or AVX2 ones on a CPU with AVX-512 (about
 * half the speed there: docs/perf.md), the OPENBLAS_CORETYPE value that
 * would use the wider units ("SkylakeX", "Haswell"; NULL when the choice
 * is fine). spotune's main sets OPENBLAS_CORETYPE to
 * that value and runs itself again when the user has not set it
 * (trainer/main.c); backend_cpu_blas_describe writes the kernels in use, and
 * when spotune chose them, what OpenBLAS had chosen ("OpenBLAS SkylakeX
 * kernels (OPENBLAS_CORETYPE set by spotune: ... generic Prescott ...)"),
 * then what the products with a side of 64 or less run on ("; products ...
 * (LoRA's): spotune's AVX-512 tiles"). */
const char *backend_cpu_blas_core(void);
const char *backend_cpu_blas_better(void);
const char *backend_cpu_blas_kind(void);
void backend_cpu_blas_describe(char *buf, size_t n);
/* The tiles the CPU backend's products with a side of 64 or less take
 * (SPOTUNE_CPU_SKINNY: 0 none, 1 avx2 avx512; CPU_SKINNY_* in
 * cpu/cpu_backend.h) into *isa; -1 with err (exit code 2) for a value that
 * names no choice or tiles this CPU has not got, which the CPU backend
 * refuses at its creation. */
int backend_cpu_skinny_choice(int *isa, sp_err *err);
/* Number of usable CUDA devices; when 0, why (n bytes) says why: the CUDA
 * error of cudaGetDeviceCount (no device, insufficient driver, ...), or that
 * this build has no CUDA backend. Creates no CUDA context (safe before fork). */
int backend_cuda_probe(char *why, size_t n);
/* A C entry point of the CUDA module (loading it on first use), e.g. the
 * doctor's measurements (kernels/cuda/cuda_doctor.h); NULL with why set when
 * the module or the symbol is missing. */
void *backend_cuda_symbol(const char *name, char *why, size_t n);

/* Copies the sticky error into err and returns its code (0 if none). */
int be_check(backend_t *be, sp_err *err);
/* Records a failure in the sticky error (first wins). */
void be_fail(backend_t *be, const char *file, int line, const char *fmt, ...) SP_PRINTF(4, 5);
/* be_fail with the message prefixed (a backend's "device 0 (name): "). */
void be_vfail(backend_t *be, const char *file, int line, const char *prefix, const char *fmt,
              va_list ap) SP_PRINTF(5, 0);

/* Upload n host values of dtype src_dt into t (converting to t.dt). */
void be_upload(backend_t *be, tensor_t t, const void *src, dtype_t src_dt);
/* Download t into n host values of dtype dst_dt (converting). */
void be_download(backend_t *be, void *dst, dtype_t dst_dt, tensor_t t);

/* Staged uploads: the host does not wait for the device. be_host_alloc
 * gives pinned host memory on CUDA (malloc'd memory elsewhere; NULL when
 * out of memory), be_upload_staged enqueues t = t.n values of t's dtype at
 * src (memory from be_host_alloc) after the work already enqueued and may
 * return before the copy has run: src must not be written again before
 * be_staged_wait, which returns when every staged copy has completed.
 * Without a device stream (the CPU) the copy is made at once. */
void *be_host_alloc(backend_t *be, size_t bytes);
void be_host_free(backend_t *be, void *p);
void be_upload_staged_at(const char *file, int line, backend_t *be, tensor_t t, const void *src);
void be_staged_wait_at(const char *file, int line, backend_t *be);
#define be_upload_staged(...) be_upload_staged_at(__FILE__, __LINE__, __VA_ARGS__)
#define be_staged_wait(be) be_staged_wait_at(__FILE__, __LINE__, (be))

/* Host-side conversion of n values between F32, BF16 and F16; I32/U8 only to
 * themselves. Returns 0, or -1 when the pair is unsupported. */
int dtype_convert(void *dst, dtype_t dst_dt, const void *src, dtype_t src_dt, size_t n);

/* ---- step profile (backend_prof.c) --------------------------------------------
 * Where a span of work (spotune bench: one training step) spends its time,
 * by group of ops: the matrix products (GEMM), the LoRA branches (every op
 * between be_prof_lora(be, 1) and be_prof_lora(be, 0), which nest), the
 * attention ops, the optimizer (adamw, and sumsq: the gradient norm),
 * communication (every op between be_prof_comm(be, 1) and (be, 0), and the
 * host's waits there), and elementwise (every other op). The group changes
 * at the first op of another group; each span between two changes is timed
 * in stream order (CUDA events) or by the host clock (CPU), so the groups
 * add up to the span. Without be_prof_start the calls cost a test of a
 * pointer. */
enum {
    BE_PROF_GEMM,
    BE_PROF_LORA,
    BE_PROF_ATTENTION,
    BE_PROF_ELEMENTWISE,
    BE_PROF_OPTIMIZER,
    BE_PROF_COMM,
    BE_PROF_GROUPS
};
extern const char *const be_prof_names[BE_PROF_GROUPS]; /* "gemm", "lora", ... */
/* Starts recording (0; -1: out of memory, nothing recorded). */
int be_prof_start(backend_t *be);
void be_prof_lora(backend_t *be, int on);
void be_prof_comm(backend_t *be, int on);
/* The checked op `op` is about to run (backend_ops.c calls it for every op). */
void be_prof_op(backend_t *be, const char *op);
/* Stops recording: ms[g] the time of each group (0 and ms zeroed when
 * nothing was recorded or the device failed; the sticky error says why). */
int be_prof_stop(backend_t *be, double ms[BE_PROF_GROUPS]);

/* ---- launch traces and captured spans (backend_trace.c) ----------------------
 * A trace is a digest of what a span of ops launches: every op that runs on
 * the device and every argument it is given (tensor addresses, sizes and
 * dtypes, scalars), in order. Two spans with one digest launch the same
 * kernels with the same arguments: what differs between them is in device
 * memory only, so a span captured once (a CUDA graph) may run again in place
 * of the other. Barriers are the calls a captured span cannot hold: copies
 * between host and device memory, sync, alloc, free, sumsq (the host reads
 * its result) and stream fences; a trace counts them and names the first
 * with its file:line. dry: the ops are checked and traced but not run, and
 * neither are the barriers that move or wait for data (copies, sync, sumsq,
 * which then returns 0, stream fences): the span's real run does them. A
 * dry trace's alloc and free do run, as the host code that calls them
 * keeps what they give (a buffer allocated on first use stays allocated).
 * Traces do not nest. */
typedef struct be_trace {
    uint64_t digest;
    size_t ops;      /* device ops traced */
    size_t barriers; /* barrier calls in the span */
    char first_barrier[160]; /* "h2d at trainer/model_graph.c:706" */
    int dry;
    /* recorded op list (the CPU's captured span): words, nwords */
    int record;
    uint64_t *words;
    size_t nwords, cap;
} be_trace;
void be_trace_start(backend_t *be, be_trace *t, int dry);
void be_trace_stop(backend_t *be);

/* A captured span. be_graph_begin: the ops that follow are captured, not
 * run (0; -1 when the sticky error is set or the backend refused, nothing
 * captured). be_graph_end: the span as a graph, or NULL with why (n bytes)
 * when it cannot be one (a barrier inside it, or the device refused the
 * capture); either way the sticky error is as it was at be_graph_begin and
 * nothing of the span has run. be_graph_launch runs the span again with the
 * arguments it was captured with: 0; 1 when the graph is stale (capture it
 * again); -1 on failure (sticky error). CUDA: stream capture, one CUDA
 * graph; elsewhere the checked op list is recorded and replayed, the same
 * contract (so the CPU backend tests what a graph may and may not hold).
 * digest: the trace of the captured span. */
typedef struct be_graph {
    uint64_t digest;
    size_t ops;
    void *exec;      /* the backend's graph (CUDA), or NULL */
    uint64_t *words; /* the recorded op list (elsewhere) */
    size_t nwords;
} be_graph;
int be_graph_begin(backend_t *be);
be_graph *be_graph_end(backend_t *be, char *why, size_t n);
int be_graph_launch(backend_t *be, be_graph *g);
void be_graph_free(backend_t *be, be_graph *g);

/* ---- the ops, checked (backend_ops.c) --------------------------------------
 * Every caller runs the ops through these: each checks its arguments, then
 * calls the backend's op. A bad call is recorded in the sticky error as
 * "OP: WHAT" with the caller's file:line, and the op is not run, so it never
 * reaches memory. Checked, in order: size arguments not negative (and what
 * an op needs of them: positive attention shapes, nh a multiple of nkv, an
 * even hd for rope, dropout p below 1); then each tensor in the order of the
 * arguments: allocated when the op touches any of it, holding at least the
 * elements the shape needs ("matmul: C has 12 elements, M x N = 16"; a
 * larger tensor is fine, the op uses its first elements), of a dtype the op
 * takes; then how tensors relate (the operands of a matmul, of attention
 * share a dtype). Float tensors are F32 or be->act_dt (so F32 only on the
 * CPU); the tensors the comments above call F32 are F32, token ids and
 * targets I32, NF4 codes and 8-bit absmax U8. The same bad call fails with the same message on every
 * backend; backends check only what is theirs (CUDA: the dtype triples
 * cuBLASLt multiplies, conversions between F32 and BF16 only).
 * Token ids and targets are device data, not checked here: on every backend
 * an id outside the table reads a zero row and adds no gradient, and a
 * target outside [0, V) ignores its row, as a negative one does. */
tensor_t be_alloc_at(const char *file, int line, backend_t *be, dtype_t dt, size_t n);
void be_free_at(const char *file, int line, backend_t *be, tensor_t *t);
void be_h2d_at(const char *file, int line, backend_t *be, void *dst, const void *src,
               size_t bytes);
void be_d2h_at(const char *file, int line, backend_t *be, void *dst, const void *src,
               size_t bytes);
void be_zero_at(const char *file, int line, backend_t *be, tensor_t t);
void be_copy_at(const char *file, int line, backend_t *be, tensor_t dst, tensor_t src);
void be_sync_at(const char *file, int line, backend_t *be);
void be_copy2d_at(const char *file, int line, backend_t *be, tensor_t dst, tensor_t src, int rows,
                  int cols, int dst_ld, int src_ld);
void be_matmul_at(const char *file, int line, backend_t *be, tensor_t C, tensor_t A, tensor_t B,
                  int M, int N, int K, int transA, int transB, float alpha, float beta);
/* D = alpha op(A) op(B) + beta C: be_matmul reading C and writing D (both
 * [M, N], one dtype; D == C is be_matmul). */
void be_matmul_into_at(const char *file, int line, backend_t *be, tensor_t D, tensor_t A,
                       tensor_t B, tensor_t C, int M, int N, int K, int transA, int transB,
                       float alpha, float beta);
/* be_matmul on matrices stored with row strides lda, ldb, ldc (each at least
 * its stored width: A is M x K, or K x M when transA; B is K x N, or N x K
 * when transB; C is M x N): a block of columns of wider matrices. */
void be_matmul_ld_at(const char *file, int line, backend_t *be, tensor_t C, tensor_t A,
                     tensor_t B, int M, int N, int K, int transA, int transB, float alpha,
                     float beta, int lda, int ldb, int ldc);
/* be_matmul_ld batch times: product b reads and writes the matrices that
 * start sa, sb, sc elements of A, B, C after product b - 1's (each checked
 * as be_matmul_ld checks one); one call where the backend has it. */
void be_matmul_batched_at(const char *file, int line, backend_t *be, tensor_t C, tensor_t A,
                          tensor_t B, int M, int N, int K, int transA, int transB, float alpha,
                          float beta, int lda, int ldb, int ldc, int batch, size_t sa, size_t sb,
                          size_t sc);
void be_rmsnorm_forward_at(const char *file, int line, backend_t *be, tensor_t out, tensor_t rstd,
                           tensor_t x, tensor_t w, int rows, int cols, float eps);
void be_rmsnorm_backward_at(const char *file, int line, backend_t *be, tensor_t dx, tensor_t dw,
                            tensor_t dout, tensor_t x, tensor_t w, tensor_t rstd, int rows,
                            int cols);
void be_rope_at(const char *file, int line, backend_t *be, tensor_t x, tensor_t cos, tensor_t sin,
                tensor_t pos, int B, int T, int nh, int hd, int inverse);
/* The rotation of src into x with row strides (the op's general form;
 * be_rope: in place, contiguous) */
void be_rope_ld_at(const char *file, int line, backend_t *be, tensor_t x, tensor_t src,
                   tensor_t cos, tensor_t sin, tensor_t pos, int B, int T, int nh, int hd,
                   int inverse, int x_ld, int src_ld);
void be_attention_forward_at(const char *file, int line, backend_t *be, tensor_t out,
                             tensor_t lse, tensor_t q, tensor_t k, tensor_t v, tensor_t seg, int B,
                             int T, int nh, int nkv, int hd);
void be_attention_backward_at(const char *file, int line, backend_t *be, tensor_t dq,
                              tensor_t dk, tensor_t dv, tensor_t dout, tensor_t out, tensor_t lse,
                              tensor_t q, tensor_t k, tensor_t v, tensor_t seg, int B, int T,
                              int nh, int nkv, int hd);
/* Attention with the row strides of q, k and v (and of their gradients):
 * the ops' general form; be_attention_forward / _backward: contiguous */
void be_attention_forward_ld_at(const char *file, int line, backend_t *be, tensor_t out,
                                tensor_t lse, tensor_t q, tensor_t k, tensor_t v, tensor_t seg,
                                int B, int T, int nh, int nkv, int hd, int q_ld, int kv_ld);
void be_attention_backward_ld_at(const char *file, int line, backend_t *be, tensor_t dq,
                                 tensor_t dk, tensor_t dv, tensor_t dout, tensor_t out,
                                 tensor_t lse, tensor_t q, tensor_t k, tensor_t v, tensor_t seg,
                                 int B, int T, int nh, int nkv, int hd, int q_ld, int kv_ld,
                                 int dq_ld, int dkv_ld);
void be_swiglu_forward_at(const char *file, int line, backend_t *be, tensor_t out, tensor_t g,
                          tensor_t u, int rows, int cols, int ld);
void be_swiglu_backward_at(const char *file, int line, backend_t *be, tensor_t dg, tensor_t du,
                           tensor_t dout, tensor_t g, tensor_t u, int rows, int cols, int ld);
void be_embedding_forward_at(const char *file, int line, backend_t *be, tensor_t out,
                             tensor_t table, tensor_t tokens, int n, int H);
void be_embedding_backward_at(const char *file, int line, backend_t *be, tensor_t dtable,
                              tensor_t dout, tensor_t tokens, tensor_t order, tensor_t runs,
                              int n, int H);
void be_cross_entropy_at(const char *file, int line, backend_t *be, tensor_t logits,
                         tensor_t loss, tensor_t targets, int rows, int V, float grad_scale,
                         tensor_t scale);
void be_add_at(const char *file, int line, backend_t *be, tensor_t y, tensor_t x, float alpha,
               size_t n);
void be_add_bias_at(const char *file, int line, backend_t *be, tensor_t y, tensor_t b, int rows,
                    int cols);
void be_bias_backward_at(const char *file, int line, backend_t *be, tensor_t db, tensor_t dy,
                         int rows, int cols);
void be_weight_norm_at(const char *file, int line, backend_t *be, tensor_t n, tensor_t W,
                       tensor_t A, tensor_t B, float scale, int out, int in, int r);
void be_col_scale_at(const char *file, int line, backend_t *be, tensor_t y, tensor_t num,
                     tensor_t den, int rows, int cols);
void be_col_dot_at(const char *file, int line, backend_t *be, tensor_t out, tensor_t x,
                   tensor_t y, tensor_t den, int rows, int cols);
void be_dequant_nf4_at(const char *file, int line, backend_t *be, tensor_t out, tensor_t codes,
                       tensor_t absmax, tensor_t nested, tensor_t maps, float offset, size_t n);
void be_quantize_nf4_at(const char *file, int line, backend_t *be, tensor_t codes, tensor_t absmax,
                        tensor_t x, tensor_t maps, size_t n);
void be_dropout_at(const char *file, int line, backend_t *be, tensor_t out, tensor_t in, size_t n,
                   float p, uint64_t seed, tensor_t seed_dev, uint64_t offset);
/* 0.0 when the call is refused */
double be_sumsq_at(const char *file, int line, backend_t *be, tensor_t x, size_t n);
void be_sumsq_into_at(const char *file, int line, backend_t *be, tensor_t out, tensor_t x,
                      size_t n);
void be_sum_add_at(const char *file, int line, backend_t *be, tensor_t acc, tensor_t x, size_t n);
void be_adamw_at(const char *file, int line, backend_t *be, tensor_t param, tensor_t param_copy,
                 tensor_t grad, tensor_t m, tensor_t v, size_t n, const adamw_args *a);
void be_fill_uniform_at(const char *file, int line, backend_t *be, tensor_t x, size_t n, float lo,
                        float hi, uint64_t seed, uint64_t offset);
void be_fill_normal_at(const char *file, int line, backend_t *be, tensor_t x, size_t n,
                       float mean, float std, uint64_t seed, uint64_t offset);
/* 1 when the backend has a second stream and fences (CUDA) */
int be_has_streams(backend_t *be);
/* NULL on a backend without streams */
void *be_aux_stream_at(const char *file, int line, backend_t *be);
/* nothing on a backend without streams */
void be_stream_fence_at(const char *file, int line, backend_t *be, void *waiter, void *waitee);

#define be_alloc(...) be_alloc_at(__FILE__, __LINE__, __VA_ARGS__)
#define be_free(...) be_free_at(__FILE__, __LINE__, __VA_ARGS__)
#define be_h2d(...) be_h2d_at(__FILE__, __LINE__, __VA_ARGS__)
#define be_d2h(...) be_d2h_at(__FILE__, __LINE__, __VA_ARGS__)
#define be_zero(...) be_zero_at(__FILE__, __LINE__, __VA_ARGS__)
#define be_copy(...) be_copy_at(__FILE__, __LINE__, __VA_ARGS__)
#define be_sync(be) be_sync_at(__FILE__, __LINE__, (be))
#define be_copy2d(...) be_copy2d_at(__FILE__, __LINE__, __VA_ARGS__)
#define be_matmul(...) be_matmul_at(__FILE__, __LINE__, __VA_ARGS__)
#define be_matmul_ld(...) be_matmul_ld_at(__FILE__, __LINE__, __VA_ARGS__)
#define be_matmul_into(...) be_matmul_into_at(__FILE__, __LINE__, __VA_ARGS__)
#define be_matmul_batched(...) be_matmul_batched_at(__FILE__, __LINE__, __VA_ARGS__)
#define be_rmsnorm_forward(...) be_rmsnorm_forward_at(__FILE__, __LINE__, __VA_ARGS__)
#define be_rmsnorm_backward(...) be_rmsnorm_backward_at(__FILE__, __LINE__, __VA_ARGS__)
#define be_rope(...) be_rope_at(__FILE__, __LINE__, __VA_ARGS__)
#define be_rope_ld(...) be_rope_ld_at(__FILE__, __LINE__, __VA_ARGS__)
#define be_attention_forward(...) be_attention_forward_at(__FILE__, __LINE__, __VA_ARGS__)
#define be_attention_backward(...) be_attention_backward_at(__FILE__, __LINE__, __VA_ARGS__)
#define be_attention_forward_ld(...) be_attention_forward_ld_at(__FILE__, __LINE__, __VA_ARGS__)
#define be_attention_backward_ld(...) be_attention_backward_ld_at(__FILE__, __LINE__, __VA_ARGS__)
#define be_swiglu_forward(...) be_swiglu_forward_at(__FILE__, __LINE__, __VA_ARGS__)
#define be_swiglu_backward(...) be_swiglu_backward_at(__FILE__, __LINE__, __VA_ARGS__)
#define be_embedding_forward(...) be_embedding_forward_at(__FILE__, __LINE__, __VA_ARGS__)
#define be_embedding_backward(...) be_embedding_backward_at(__FILE__, __LINE__, __VA_ARGS__)
#define be_cross_entropy(...) be_cross_entropy_at(__FILE__, __LINE__, __VA_ARGS__)
#define be_add(...) be_add_at(__FILE__, __LINE__, __VA_ARGS__)
#define be_add_bias(...) be_add_bias_at(__FILE__, __LINE__, __VA_ARGS__)
#define be_bias_backward(...) be_bias_backward_at(__FILE__, __LINE__, __VA_ARGS__)
#define be_weight_norm(...) be_weight_norm_at(__FILE__, __LINE__, __VA_ARGS__)
#define be_col_scale(...) be_col_scale_at(__FILE__, __LINE__, __VA_ARGS__)
#define be_col_dot(...) be_col_dot_at(__FILE__, __LINE__, __VA_ARGS__)
#define be_dequant_nf4(...) be_dequant_nf4_at(__FILE__, __LINE__, __VA_ARGS__)
#define be_quantize_nf4(...) be_quantize_nf4_at(__FILE__, __LINE__, __VA_ARGS__)
#define be_dropout(...) be_dropout_at(__FILE__, __LINE__, __VA_ARGS__)
#define be_sumsq(...) be_sumsq_at(__FILE__, __LINE__, __VA_ARGS__)
#define be_sumsq_into(...) be_sumsq_into_at(__FILE__, __LINE__, __VA_ARGS__)
#define be_sum_add(...) be_sum_add_at(__FILE__, __LINE__, __VA_ARGS__)
#define be_adamw(...) be_adamw_at(__FILE__, __LINE__, __VA_ARGS__)
#define be_fill_uniform(...) be_fill_uniform_at(__FILE__, __LINE__, __VA_ARGS__)
#define be_fill_normal(...) be_fill_normal_at(__FILE__, __LINE__, __VA_ARGS__)
#define be_aux_stream(be) be_aux_stream_at(__FILE__, __LINE__, (be))
#define be_stream_fence(...) be_stream_fence_at(__FILE__, __LINE__, __VA_ARGS__)

#endif
