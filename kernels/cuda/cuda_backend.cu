/* kernels/cuda/cuda_backend.cu — the CUDA backend's device, stream and
 * handles; memory (plain cudaMalloc, zeroed, counted in bytes_in_use and
 * bytes_peak), host<->device copies, copy/convert, the shared scratch
 * buffer, error reporting, and the op table. The math lives in
 * cuda_matmul.cu, cuda_ops.cu and cuda_attention.cu. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_internal.h"

/* ---- errors ----------------------------------------------------------------- */

static int device_of(backend_t *be)
{
    return be && be->impl ? CUDA_IMPL(be)->device : -1;
}

extern "C" void cuda_fail(backend_t *be, const char *file, int line, const char *fmt, ...)
{
    if (be->err.code)
        return;
    char where[160];
    snprintf(where, sizeof where, "device %d (%s): ", device_of(be), be->device_name);
    va_list ap;
    va_start(ap, fmt);
    be_vfail(be, file, line, where, fmt, ap);
    va_end(ap);
}

extern "C" int cuda_ok(backend_t *be, cudaError_t e, const char *call, const char *file, int line)
{
    if (e == cudaSuccess)
        return 0;
    cuda_fail(be, file, line, "%.300s: %s (%s)", call, cudaGetErrorString(e), cudaGetErrorName(e));
    return -1;
}

extern "C" int cublas_ok(backend_t *be, cublasStatus_t s, const char *call, const char *file,
                         int line)
{
    if (s == CUBLAS_STATUS_SUCCESS)
        return 0;
    cuda_fail(be, file, line, "%.300s: %s (%d)", call, cublasGetStatusString(s), (int)s);
    return -1;
}

/* ---- memory ----------------------------------------------------------------- */

static void count_alloc(backend_t *be, size_t bytes)
{
    be->bytes_in_use += bytes;
    if (be->bytes_in_use > be->bytes_peak)
        be->bytes_peak = be->bytes_in_use;
}

static tensor_t cuda_alloc(backend_t *be, dtype_t dt, size_t n)
{
    tensor_t t = {NULL, n, dt};
    cuda_impl *im = CUDA_IMPL(be);
    size_t bytes = n * dtype_size(dt);
    size_t rounded = (bytes + 255) & ~(size_t)255;
    if (rounded == 0)
        rounded = 256;
    void *p = NULL;
    cudaError_t e = cudaMalloc(&p, rounded);
    if (e != cudaSuccess) {
        size_t free_b = 0, total_b = 0;
        cudaGetLastError();
        cudaMemGetInfo(&free_b, &total_b);
        cuda_fail(be, __FILE__, __LINE__,
                  "cudaMalloc of %zu bytes (%zu elements of %s): %s; %.1f MiB in use by spotune, "
                  "%.1f MiB free on the device",
                  rounded, n, dtype_name(dt), cudaGetErrorString(e),
                  (double)be->bytes_in_use / 1048576.0, (double)free_b / 1048576.0);
        t.n = 0;
        return t;
    }
    if (CUDA_OK(be, cudaMemsetAsync(p, 0, rounded, im->stream))) {
        cudaFree(p);
        t.n = 0;
        return t;
    }
    t.p = p;
    count_alloc(be, bytes);
    return t;
}

static void cuda_free(backend_t *be, tensor_t *t)
{
    if (t->p) {
        /* cudaFree waits for the device; nothing queued can still use t.
         * A free that fails (a sticky device fault) keeps its count: the
         * memory was not given back */
        if (CUDA_OK(be, CUDA_WAITING(be, "cudaFree", cudaFree(t->p))) == 0)
            be->bytes_in_use -= t->n * dtype_size(t->dt);
    }
    t->p = NULL;
    t->n = 0;
}

extern "C" void *cuda_scratch(backend_t *be, size_t bytes)
{
    cuda_impl *im = CUDA_IMPL(be);
    if (bytes <= im->scratch_bytes)
        return im->scratch;
    size_t want = (bytes + ((size_t)1 << 20) - 1) & ~(((size_t)1 << 20) - 1);
    if (im->scratch) {
        if (CUDA_OK(be, CUDA_WAITING(be, "scratch", cudaStreamSynchronize(im->stream))) ||
            CUDA_OK(be, CUDA_WAITING(be, "scratch", cudaFree(im->scratch))))
            return NULL;
        be->bytes_in_use -= im->scratch_bytes;
        im->scratch = NULL;
        im->scratch_bytes = 0;
    }
    void *p = NULL;
    if (CUDA_OK(be, cudaMalloc(&p, want)))
        return NULL;
    im->scratch = p;
    im->scratch_bytes = want;
    count_alloc(be, want);
    return p;
}

/* ---- copies ----------------------------------------------------------------- */

/* Both directions wait for the copy: the caller may reuse or free its host
 * buffer, or read the result, as soon as the call returns. */
static void cuda_h2d(backend_t *be, void *dst, const void *src, size_t bytes)
{
    cuda_impl *im = CUDA_IMPL(be);
    if (!bytes || be->err.code)
        return;
    if (!CUDA_OK(be, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, im->stream)))
        CUDA_OK(be, CUDA_WAITING(be, "h2d", cudaStreamSynchronize(im->stream)));
}

static void cuda_d2h(backend_t *be, void *dst, const void *src, size_t bytes)
{
    cuda_impl *im = CUDA_IMPL(be);
    if (!bytes)
        return;
    if (be->err.code) { /* the device's results are not to be trusted */
        memset(dst, 0, bytes);
        return;
    }
    if (CUDA_OK(be, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, im->stream)) ||
        CUDA_OK(be, CUDA_WAITING(be, "d2h", cudaStreamSynchronize(im->stream))))
        memset(dst, 0, bytes);
}

/* Staged uploads (backend.h): pinned host memory, a copy enqueued without
 * waiting, and an event after it that h2d_wait waits for. */
static void *cuda_host_alloc(backend_t *be, size_t bytes)
{
    void *p = NULL;
    if (cudaHostAlloc(&p, bytes ? bytes : 1, cudaHostAllocDefault) != cudaSuccess) {
        (void)cudaGetLastError(); /* not sticky: the caller reports no memory */
        (void)be;
        return NULL;
    }
    return p;
}

static void cuda_host_free(backend_t *be, void *p)
{
    (void)be;
    cudaFreeHost(p);
}

static void cuda_h2d_async(backend_t *be, void *dst, const void *src, size_t bytes)
{
    cuda_impl *im = CUDA_IMPL(be);
    if (!bytes || be->err.code)
        return;
    if (!im->staged && CUDA_OK(be, cudaEventCreateWithFlags(&im->staged, cudaEventDisableTiming)))
        return;
    if (!CUDA_OK(be, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, im->stream)) &&
        !CUDA_OK(be, cudaEventRecord(im->staged, im->stream)))
        im->staged_pending = 1;
}

static void cuda_h2d_wait(backend_t *be)
{
    cuda_impl *im = CUDA_IMPL(be);
    if (!im->staged_pending)
        return;
    im->staged_pending = 0;
    CUDA_OK(be, CUDA_WAITING(be, "h2d_wait", cudaEventSynchronize(im->staged)));
}

static void cuda_zero(backend_t *be, tensor_t t)
{
    if (!t.n || be->err.code)
        return;
    CUDA_OK(be, cudaMemsetAsync(t.p, 0, t.n * dtype_size(t.dt), CUDA_IMPL(be)->stream));
}

static void cuda_copy(backend_t *be, tensor_t dst, tensor_t src)
{
    /* equal sizes, and a conversion between float dtypes: checked
     * (kernels/backend_ops.c); this backend converts F32 <-> BF16 only */
    if (be->err.code || !src.n || dst.p == src.p)
        return;
    if (dst.dt == src.dt) {
        CUDA_OK(be, cudaMemcpyAsync(dst.p, src.p, src.n * dtype_size(src.dt),
                                    cudaMemcpyDeviceToDevice, CUDA_IMPL(be)->stream));
        return;
    }
    if ((dst.dt != DT_F32 && dst.dt != DT_BF16) || (src.dt != DT_F32 && src.dt != DT_BF16)) {
        cuda_fail(be, __FILE__, __LINE__, "copy: from %s to %s: this backend converts between F32 "
                  "and BF16 only", dtype_name(src.dt), dtype_name(dst.dt));
        return;
    }
    cuda_convert(be, dst.p, dst.dt, src.p, src.dt, src.n);
}

static void cuda_copy2d(backend_t *be, tensor_t dst, tensor_t src, int rows, int cols,
                        int dst_ld, int src_ld)
{
    if (be->err.code)
        return;
    size_t es = dtype_size(src.dt);
    CUDA_OK(be, cudaMemcpy2DAsync(dst.p, (size_t)dst_ld * es, src.p, (size_t)src_ld * es,
                                  (size_t)cols * es, (size_t)rows, cudaMemcpyDeviceToDevice,
                                  CUDA_IMPL(be)->stream));
}

static void cuda_sync(backend_t *be)
{
    CUDA_OK(be, CUDA_WAITING(be, "sync", cudaStreamSynchronize(CUDA_IMPL(be)->stream)));
}

/* ---- streams ---------------------------------------------------------------- */

/* The second stream (gradient all-reduce overlapping the backward); the
 * backend owns it and destroys it with itself. */
static void *cuda_aux_stream(backend_t *be)
{
    cuda_impl *im = CUDA_IMPL(be);
    if (!im->aux && CUDA_OK(be, cudaStreamCreateWithFlags(&im->aux, cudaStreamNonBlocking)))
        return NULL;
    return (void *)im->aux;
}

/* waiter waits (on the device, the host does not) for all work enqueued on
 * waitee so far. */
static void cuda_stream_fence(backend_t *be, void *waiter, void *waitee)
{
    cuda_impl *im = CUDA_IMPL(be);
    if (be->err.code || !waiter || !waitee || waiter == waitee)
        return;
    if (!im->fence && CUDA_OK(be, cudaEventCreateWithFlags(&im->fence, cudaEventDisableTiming)))
        return;
    if (!CUDA_OK(be, cudaEventRecord(im->fence, (cudaStream_t)waitee)))
        CUDA_OK(be, cudaStreamWaitEvent((cudaStream_t)waiter, im->fence, 0));
}

/* ---- step profile (backend_prof.c) ------------------------------------------ */

/* Mark i: an event recorded on the compute stream (events created once and
 * kept for the next profile). */
static void cuda_prof_mark(backend_t *be, int i)
{
    cuda_impl *im = CUDA_IMPL(be);
    if (be->err.code || i < 0)
        return;
    if (i >= im->prof_cap) {
        int cap = im->prof_cap ? 2 * im->prof_cap : 1024;
        while (cap <= i)
            cap *= 2;
        cudaEvent_t *ev = (cudaEvent_t *)realloc(im->prof_ev, sizeof *ev * (size_t)cap);
        if (!ev) {
            cuda_fail(be, __FILE__, __LINE__, "out of host memory for %d profile events", cap);
            return;
        }
        memset(ev + im->prof_cap, 0, sizeof *ev * (size_t)(cap - im->prof_cap));
        im->prof_ev = ev;
        im->prof_cap = cap;
    }
    if (!im->prof_ev[i] && CUDA_OK(be, cudaEventCreate(&im->prof_ev[i])))
        return;
    CUDA_OK(be, cudaEventRecord(im->prof_ev[i], im->stream));
}

/* Marks 0..n-1 as ms after mark 0, once the last has happened. */
static int cuda_prof_read(backend_t *be, double *ms, int n)
{
    cuda_impl *im = CUDA_IMPL(be);
    if (be->err.code || n < 1 || n > im->prof_cap)
        return -1;
    for (int i = 0; i < n; i++) /* a mark never recorded: no profile, not a device error */
        if (!im->prof_ev[i])
            return -1;
    if (CUDA_OK(be, CUDA_WAITING(be, "prof_read", cudaEventSynchronize(im->prof_ev[n - 1]))))
        return -1;
    for (int i = 0; i < n; i++) {
        float f = 0;
        if (CUDA_OK(be, cudaEventElapsedTime(&f, im->prof_ev[0], im->prof_ev[i])))
            return -1;
        ms[i] = f;
    }
    return 0;
}

/* ---- captured spans: one CUDA graph per span ----------------------------------- */

/* A graph and the scratch it was captured with: kernels that use the
 * backend's scratch hold its address, so a graph is stale once the scratch
 * was reallocated. */
typedef struct cuda_graph {
    cudaGraphExec_t exec;
    void *scratch;
} cuda_graph;

/* Thread-local mode: a call of this thread that the capture cannot hold
 * (a synchronous copy, a sync, cudaMalloc) fails instead of running, and
 * the capture with it; graph_end reports it and the caller runs the span
 * again without a graph. */
static int cuda_graph_begin(backend_t *be)
{
    cuda_impl *im = CUDA_IMPL(be);
    if (be->err.code)
        return -1;
    return CUDA_OK(be, cudaStreamBeginCapture(im->stream, cudaStreamCaptureModeThreadLocal)) ? -1
                                                                                            : 0;
}

static void *cuda_graph_end(backend_t *be, char *why, size_t n)
{
    cuda_impl *im = CUDA_IMPL(be);
    cudaGraph_t graph = NULL;
    cudaError_t e = cudaStreamEndCapture(im->stream, &graph);
    if (be->err.code) { /* an op failed while captured: nothing of it ran */
        snprintf(why, n, "%s", be->err.msg);
        cudaError_t q = cudaStreamQuery(im->stream);
        if (q != cudaSuccess && q != cudaErrorNotReady && q != cudaErrorStreamCaptureInvalidated &&
            q != cudaErrorStreamCaptureUnmatched) {
            /* the device itself has failed (a fault of work before the
             * capture: sticky): that error stays, the run ends with it */
            if (graph)
                cudaGraphDestroy(graph);
            return NULL;
        }
        memset(&be->err, 0, sizeof be->err);
        if (graph)
            cudaGraphDestroy(graph);
        (void)cudaGetLastError();
        return NULL;
    }
    if (e != cudaSuccess || !graph) {
        snprintf(why, n, "cudaStreamEndCapture: %s", cudaGetErrorString(e));
        (void)cudaGetLastError();
        return NULL;
    }
    cudaGraphExec_t exec = NULL;
    e = cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphDestroy(graph);
    cuda_graph *g = NULL;
    if (e != cudaSuccess)
        snprintf(why, n, "cudaGraphInstantiate: %s", cudaGetErrorString(e));
    else if (!(g = (cuda_graph *)malloc(sizeof *g)))
        snprintf(why, n, "out of host memory");
    if (!g) {
        if (exec)
            cudaGraphExecDestroy(exec);
        (void)cudaGetLastError();
        return NULL;
    }
    g->exec = exec;
    g->scratch = im->scratch;
    return g;
}

static int cuda_graph_launch(backend_t *be, void *h)
{
    cuda_graph *g = (cuda_graph *)h;
    cuda_impl *im = CUDA_IMPL(be);
    if (g->scratch != im->scratch)
        return 1;
    return CUDA_OK(be, cudaGraphLaunch(g->exec, im->stream)) ? -1 : 0;
}

static void cuda_graph_free(backend_t *be, void *h)
{
    (void)be;
    cuda_graph *g = (cuda_graph *)h;
    if (g) {
        cudaGraphExecDestroy(g->exec);
        free(g);
    }
}

/* ---- lifetime --------------------------------------------------------------- */

static void cuda_destroy(backend_t *be)
{
    cuda_impl *im = CUDA_IMPL(be);
    if (im) {
        if (im->aux)
            cudaStreamSynchronize(im->aux);
        if (im->stream)
            cudaStreamSynchronize(im->stream);
        cuda_mm_destroy(be);
        cuda_cudnn_release(be);
        if (im->scratch)
            cudaFree(im->scratch);
        if (im->host_sum)
            cudaFreeHost(im->host_sum);
        if (im->blas)
            cublasDestroy(im->blas);
        if (im->lt)
            cublasLtDestroy(im->lt);
        if (im->fence)
            cudaEventDestroy(im->fence);
        if (im->staged)
            cudaEventDestroy(im->staged);
        for (int i = 0; i < im->prof_cap; i++)
            if (im->prof_ev[i])
                cudaEventDestroy(im->prof_ev[i]);
        free(im->prof_ev);
        if (im->aux)
            cudaStreamDestroy(im->aux);
        if (im->stream)
            cudaStreamDestroy(im->stream);
        free(im);
    }
    free(be);
}

/* C++20 designated initializers: the compiler checks the field order. */
static const backend_ops cuda_ops_table = {
    .alloc = cuda_alloc,
    .free = cuda_free,
    .h2d = cuda_h2d,
    .d2h = cuda_d2h,
    .host_alloc = cuda_host_alloc,
    .host_free = cuda_host_free,
    .h2d_async = cuda_h2d_async,
    .h2d_wait = cuda_h2d_wait,
    .zero = cuda_zero,
    .copy = cuda_copy,
    .sync = cuda_sync,
    .copy2d = cuda_copy2d,
    .matmul = cuda_matmul,
    .matmul_cd = cuda_matmul_cd,
    .matmul_batched = cuda_matmul_batched,
    .rmsnorm_forward = cuda_rmsnorm_forward,
    .rmsnorm_backward = cuda_rmsnorm_backward,
    .rope = cuda_rope,
    .attention_forward = cuda_attention_forward,
    .attention_backward = cuda_attention_backward,
    .swiglu_forward = cuda_swiglu_forward,
    .swiglu_backward = cuda_swiglu_backward,
    .embedding_forward = cuda_embedding_forward,
    .embedding_backward = cuda_embedding_backward,
    .cross_entropy = cuda_cross_entropy,
    .add = cuda_add,
    .add_bias = cuda_add_bias,
    .bias_backward = cuda_bias_backward,
    .weight_norm = cuda_weight_norm,
    .col_scale = cuda_col_scale,
    .col_dot = cuda_col_dot,
    .dequant_nf4 = cuda_dequant_nf4,
    .quantize_nf4 = cuda_quantize_nf4,
    .dropout = cuda_dropout,
    .sumsq = cuda_sumsq,
    .sumsq_into = cuda_sumsq_into,
    .sum_add = cuda_sum_add,
    .adamw = cuda_adamw,
    .fill_uniform = cuda_fill_uniform,
    .fill_normal = cuda_fill_normal,
    .aux_stream = cuda_aux_stream,
    .stream_fence = cuda_stream_fence,
    .prof_mark = cuda_prof_mark,
    .prof_read = cuda_prof_read,
    .graph_begin = cuda_graph_begin,
    .graph_end = cuda_graph_end,
    .graph_launch = cuda_graph_launch,
    .graph_free = cuda_graph_free,
    .destroy = cuda_destroy,
};

extern "C" int cuda_backend_probe(char *why, size_t n)
{
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess) {
        cudaGetLastError(); /* no driver, an old driver, no device: clear it, say why */
        if (why && n)
            snprintf(why, n, "cudaGetDeviceCount: %s (%s)", cudaGetErrorString(e),
                     cudaGetErrorName(e));
        return 0;
    }
    if (count <= 0) {
        if (why && n)
            snprintf(why, n, "cudaGetDeviceCount: 0 devices (CUDA_VISIBLE_DEVICES hides them?)");
        return 0;
    }
    /* A device in prohibited compute mode accepts no context; the attribute
     * is read without creating one. */
    int usable = 0, mode = 0;
    for (int d = 0; d < count; d++)
        if (cudaDeviceGetAttribute(&mode, cudaDevAttrComputeMode, d) == cudaSuccess &&
            mode != cudaComputeModeProhibited)
            usable++;
    cudaGetLastError();
    if (usable == 0) {
        if (why && n)
            snprintf(why, n, "cudaDeviceGetAttribute: all %d devices are in prohibited compute "
                             "mode (cudaComputeModeProhibited)", count);
        return 0;
    }
    if (why && n)
        snprintf(why, n, "%d CUDA device%s", count, count == 1 ? "" : "s");
    return count;
}

extern "C" int cuda_backend_device_count(void)
{
    return cuda_backend_probe(NULL, 0);
}

/* The setup after the device is bound; any failure is left in be->err. */
static int cuda_setup(backend_t *be, cuda_impl *im)
{
    cudaDeviceProp prop;
    if (CUDA_OK(be, cudaGetDeviceProperties(&prop, im->device)))
        return -1;
    snprintf(be->device_name, sizeof be->device_name, "%.127s", prop.name);
    im->sms = prop.multiProcessorCount;
    memcpy(be->device_uuid, prop.uuid.bytes, sizeof be->device_uuid);
    size_t free_b = 0, total_b = 0;
    if (CUDA_OK(be, cudaMemGetInfo(&free_b, &total_b)))
        return -1;
    be->mem_total = free_b; /* what this process can still plan on */
    /* matmul workspace, attention score blocks, and the fp32 dK/dV
     * accumulators of a long sequence */
    be->workspace_bytes = ((size_t)32 << 20) + ((size_t)256 << 20) + ((size_t)64 << 20);
    if (im->cudnn_ws > ((size_t)256 << 20)) /* the attention by cuDNN: its workspace budget */
        be->workspace_bytes += im->cudnn_ws - ((size_t)256 << 20);
    if (CUDA_OK(be, cudaStreamCreateWithFlags(&im->stream, cudaStreamNonBlocking)))
        return -1;
    be->stream = (void *)im->stream;
    if (CUBLAS_OK(be, cublasCreate(&im->blas)) || CUBLAS_OK(be, cublasLtCreate(&im->lt)) ||
        CUBLAS_OK(be, cublasSetStream(im->blas, im->stream)))
        return -1;
    if (CUDA_OK(be, cudaMallocHost((void **)&im->host_sum, sizeof(double))))
        return -1;
    return cuda_mm_init(be);
}

extern "C" int cuda_backend_create(backend_t **out, int device, int threads, sp_err *err)
{
    *out = NULL;
    char why[256];
    int count = cuda_backend_probe(why, sizeof why);
    if (count <= 0)
        return sp_fail(err, SP_EXIT_USAGE,
                       "runtime.backend: cuda requested but no CUDA device is usable: %s (no "
                       "NVIDIA driver or too old a one, no GPU, or CUDA_VISIBLE_DEVICES hides "
                       "them)",
                       why);
    backend_t *be = (backend_t *)calloc(1, sizeof *be);
    cuda_impl *im = (cuda_impl *)calloc(1, sizeof *im);
    if (!be || !im) {
        free(be);
        free(im);
        return sp_fail(err, SP_EXIT_OTHER, "out of memory creating the CUDA backend");
    }
    im->device = (device < 0 ? 0 : device) % count;
    be->device = im->device;
    be->device_count = count;
    be->ops = &cuda_ops_table;
    be->name = "cuda";
    be->act_dt = DT_BF16;
    be->doc_table = cuda_cudnn_requested(); /* cuDNN runs packed documents by their table */
    if (be->doc_table) /* before the trainer's threads read the environment */
        cuda_cudnn_setup_env();
    im->cudnn_ws = be->doc_table ? cuda_cudnn_workspace_budget() : 0;
    be->threads = threads > 0 ? threads : 1;
    be->impl = im;
    snprintf(be->device_name, sizeof be->device_name, "CUDA device %d", im->device);
    if (!CUDA_OK(be, cudaSetDevice(im->device)))
        cuda_setup(be, im);
    if (be->err.code) {
        int code = sp_fail(err, be->err.code, "%s", be->err.msg);
        cuda_destroy(be);
        return code;
    }
    *out = be;
    return 0;
}
