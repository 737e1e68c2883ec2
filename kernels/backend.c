/* Backend selection, dtype helpers and the host-side conversions shared by
 * every backend. */
#define _GNU_SOURCE /* readlink */
#include "backend_trace.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/cpu_backend.h"
#ifdef SPOTUNE_WITH_CUDA
#include <dlfcn.h>
#include <limits.h>
#include <pthread.h>
#include <unistd.h>
#endif

int embedding_order(const int32_t *tokens, int n, int32_t *order, int32_t *runs)
{
    /* two stable counting passes over 16-bit digits (LSD radix) */
    int32_t *tmp = malloc(sizeof *tmp * (size_t)(n > 0 ? n : 1));
    size_t *count = calloc(65537, sizeof *count);
    if (!tmp || !count) {
        free(tmp);
        free(count);
        return -1;
    }
    for (int i = 0; i < n; i++)
        tmp[i] = i;
    int32_t *src = tmp, *dst = order;
    for (int shift = 0; shift < 32; shift += 16) {
        memset(count, 0, 65537 * sizeof *count);
        for (int i = 0; i < n; i++)
            count[1 + (((uint32_t)tokens[src[i]] >> shift) & 0xffff)]++;
        for (int d = 0; d < 65536; d++)
            count[d + 1] += count[d];
        for (int i = 0; i < n; i++)
            dst[count[((uint32_t)tokens[src[i]] >> shift) & 0xffff]++] = src[i];
        int32_t *t = src;
        src = dst;
        dst = t;
    }
    /* two passes: the result is back in tmp's first buffer, i.e. src == tmp */
    if (n > 0 && src != order)
        memcpy(order, src, sizeof *order * (size_t)n);
    int u = 0;
    for (int k = 0; k < n; k++)
        if (k == 0 || tokens[order[k]] != tokens[order[k - 1]])
            runs[1 + u++] = k;
    runs[0] = u;
    runs[1 + u] = n;
    free(tmp);
    free(count);
    return 0;
}

int packed_doc_table(const int32_t *seg, int B, int T, int32_t *table)
{
    int n = 0;
    for (int b = 0; b < B; b++) {
        const int32_t *r = seg + (size_t)b * T;
        for (int t = 0, start = 0; t < T; t++) {
            if (t > 0 && r[t] != r[t - 1])
                start = t; /* a new run */
            if (r[t] != start)
                return 0; /* not its run's first position: not whole documents */
            if (t == start)
                table[n++] = (int32_t)((size_t)b * T + (size_t)t);
        }
    }
    int bt = B * T, cap = 8;
    while (cap < n)
        cap *= 2;
    if (cap > bt)
        cap = bt;
    for (int i = n; i <= cap; i++)
        table[i] = bt;
    return cap;
}

void adamw_hyper(const adamw_args *a, float hyper[3])
{
    double bc1 = 1.0 - pow((double)a->beta1, (double)a->step);
    double bc2 = 1.0 - pow((double)a->beta2, (double)a->step);
    hyper[0] = a->lr;
    hyper[1] = (float)(a->lr / bc1);
    hyper[2] = (float)sqrt(bc2);
}

size_t dtype_size(dtype_t dt)
{
    switch (dt) {
    case DT_F32: return 4;
    case DT_BF16: return 2;
    case DT_F16: return 2;
    case DT_I32: return 4;
    case DT_U8: return 1;
    }
    return 0;
}

const char *dtype_name(dtype_t dt)
{
    switch (dt) {
    case DT_F32: return "F32";
    case DT_BF16: return "BF16";
    case DT_F16: return "F16";
    case DT_I32: return "I32";
    case DT_U8: return "U8";
    }
    return "?";
}

tensor_t tensor_view(tensor_t t, size_t off, size_t n)
{
    if (off > t.n || n > t.n - off) {
        fprintf(stderr, "spotune: internal error: tensor view [%zu, +%zu) outside %zu elements\n",
                off, n, t.n);
        abort();
    }
    tensor_t v = t;
    if (t.p)
        v.p = (char *)t.p + off * dtype_size(t.dt);
    v.n = n;
    return v;
}

void be_vfail(backend_t *be, const char *file, int line, const char *prefix, const char *fmt,
              va_list ap)
{
    if (be->err.code)
        return;
    char body[1536];
    vsnprintf(body, sizeof body, fmt, ap);
    sp_fail(&be->err, SP_EXIT_OTHER, "%s backend: %s%s (%s:%d)", be->name, prefix, body, file,
            line);
}

void be_fail(backend_t *be, const char *file, int line, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    be_vfail(be, file, line, "", fmt, ap);
    va_end(ap);
}

int be_check(backend_t *be, sp_err *err)
{
    if (!be->err.code)
        return 0;
    return sp_fail(err, be->err.code, "%s", be->err.msg);
}

int dtype_convert(void *dst, dtype_t dst_dt, const void *src, dtype_t src_dt, size_t n)
{
    if (dst_dt == src_dt) {
        memcpy(dst, src, n * dtype_size(dst_dt));
        return 0;
    }
    if (dst_dt == DT_F32) {
        float *d = dst;
        const uint16_t *s = src;
        if (src_dt == DT_BF16) {
            for (size_t i = 0; i < n; i++)
                d[i] = sp_bf16_to_f32(s[i]);
            return 0;
        }
        if (src_dt == DT_F16) {
            for (size_t i = 0; i < n; i++)
                d[i] = sp_f16_to_f32(s[i]);
            return 0;
        }
        return -1;
    }
    if (dst_dt == DT_BF16 || dst_dt == DT_F16) {
        uint16_t *d = dst;
        uint16_t (*to)(float) = dst_dt == DT_BF16 ? sp_f32_to_bf16 : sp_f32_to_f16;
        if (src_dt == DT_F32) {
            const float *s = src;
            for (size_t i = 0; i < n; i++)
                d[i] = to(s[i]);
            return 0;
        }
        if (src_dt == DT_BF16 || src_dt == DT_F16) {
            const uint16_t *s = src;
            float (*from)(uint16_t) = src_dt == DT_BF16 ? sp_bf16_to_f32 : sp_f16_to_f32;
            for (size_t i = 0; i < n; i++)
                d[i] = to(from(s[i]));
            return 0;
        }
    }
    return -1;
}

void be_upload(backend_t *be, tensor_t t, const void *src, dtype_t src_dt)
{
    size_t bytes = t.n * dtype_size(t.dt);
    if (!be_trace_barrier(be, "upload", NULL, 0))
        return; /* a dry trace */
    if (src_dt == t.dt) {
        be->ops->h2d(be, t.p, src, bytes);
        return;
    }
    void *tmp = malloc(bytes ? bytes : 1);
    if (!tmp) {
        be_fail(be, __FILE__, __LINE__, "out of host memory converting %zu bytes", bytes);
        return;
    }
    if (dtype_convert(tmp, t.dt, src, src_dt, t.n) != 0)
        be_fail(be, __FILE__, __LINE__, "cannot convert %s to %s", dtype_name(src_dt),
                dtype_name(t.dt));
    else
        be->ops->h2d(be, t.p, tmp, bytes);
    free(tmp);
}

void be_download(backend_t *be, void *dst, dtype_t dst_dt, tensor_t t)
{
    size_t bytes = t.n * dtype_size(t.dt);
    if (!be_trace_barrier(be, "download", NULL, 0))
        return; /* a dry trace */
    if (dst_dt == t.dt) {
        be->ops->d2h(be, dst, t.p, bytes);
        return;
    }
    void *tmp = malloc(bytes ? bytes : 1);
    if (!tmp) {
        be_fail(be, __FILE__, __LINE__, "out of host memory converting %zu bytes", bytes);
        return;
    }
    be->ops->d2h(be, tmp, t.p, bytes);
    if (dtype_convert(dst, dst_dt, tmp, t.dt, t.n) != 0)
        be_fail(be, __FILE__, __LINE__, "cannot convert %s to %s", dtype_name(t.dt),
                dtype_name(dst_dt));
    free(tmp);
}

#ifdef SPOTUNE_WITH_CUDA
/* The CUDA backend lives in a module of its own, libspotune_cuda.so, loaded
 * on first use: a process that never touches a GPU does not pay for loading
 * cuBLAS (its constructors alone take some 100 ms, during which a stop signal
 * would meet the default action instead of spotune's handler), and the
 * binary starts where no CUDA library is installed (comm_nccl.c opens
 * NCCL and the runtime on first use too). Looked for in
 * $SPOTUNE_CUDA_MODULE, beside the executable, one folder up (the tests),
 * ../lib, and then the library search path. */
#define CUDA_MODULE "libspotune_cuda.so"

typedef struct cuda_api {
    int (*create)(backend_t **out, int device, int threads, sp_err *err);
    int (*device_count)(void);
    int (*probe)(char *why, size_t n);
    void *handle;
    char error[1024]; /* why it could not be loaded ("" when it was) */
} cuda_api;

static cuda_api cuda;
static pthread_once_t cuda_once = PTHREAD_ONCE_INIT;

static void *open_module(char *tried, size_t n)
{
    const char *env = getenv("SPOTUNE_CUDA_MODULE");
    if (env && *env) {
        void *h = dlopen(env, RTLD_NOW | RTLD_LOCAL);
        if (!h)
            sp_cutf(tried, n, "SPOTUNE_CUDA_MODULE=%s: %s", env, dlerror());
        return h;
    }
    char exe[PATH_MAX];
    ssize_t len = readlink("/proc/self/exe", exe, sizeof exe);
    exe[len > 0 && (size_t)len < sizeof exe ? len : 0] = 0; /* cut: not known */
    char *slash = strrchr(exe, '/');
    if (slash)
        *slash = 0;
    const char *const rel[] = {"/", "/../", "/../lib/"};
    for (size_t i = 0; slash && i < sizeof rel / sizeof rel[0]; i++) {
        char *path = sp_strf("%s%s%s", exe, rel[i], CUDA_MODULE);
        if (!path || access(path, F_OK) != 0) {
            free(path);
            continue;
        }
        void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
        free(path);
        if (!h) /* it is there but cannot load: say why */
            sp_cutf(tried, n, "%s", dlerror());
        return h;
    }
    void *h = dlopen(CUDA_MODULE, RTLD_NOW | RTLD_LOCAL);
    if (!h)
        sp_cutf(tried, n, "%s", dlerror());
    return h;
}

static void load_cuda(void)
{
    char tried[900] = "";
    void *h = open_module(tried, sizeof tried);
    cuda.handle = h;
    if (h) {
        *(void **)&cuda.create = dlsym(h, "cuda_backend_create");
        *(void **)&cuda.device_count = dlsym(h, "cuda_backend_device_count");
        *(void **)&cuda.probe = dlsym(h, "cuda_backend_probe");
    }
    if (!h || !cuda.create || !cuda.device_count || !cuda.probe)
        snprintf(cuda.error, sizeof cuda.error, "the CUDA backend (%s) cannot be loaded: %s",
                 CUDA_MODULE, h ? "it lacks its entry points" : tried);
}

/* The loaded module, or NULL with why (n bytes) set. */
static const cuda_api *cuda_module(char *why, size_t n)
{
    pthread_once(&cuda_once, load_cuda);
    if (cuda.error[0]) {
        if (why && n)
            snprintf(why, n, "%s", cuda.error);
        return NULL;
    }
    return &cuda;
}
#endif

int backend_cuda_probe(char *why, size_t n)
{
#ifdef SPOTUNE_WITH_CUDA
    const cuda_api *api = cuda_module(why, n);
    return api ? api->probe(why, n) : 0;
#else
    if (why && n)
        snprintf(why, n, "this spotune was built without the CUDA backend (nvcc was not found "
                         "when it was configured, or SPOTUNE_CUDA=OFF)");
    return 0;
#endif
}

void *backend_cuda_symbol(const char *name, char *why, size_t n)
{
#ifdef SPOTUNE_WITH_CUDA
    const cuda_api *api = cuda_module(why, n);
    if (!api)
        return NULL;
    void *sym = dlsym(api->handle, name);
    if (!sym && why && n)
        snprintf(why, n, "the CUDA backend (%s) lacks %s", CUDA_MODULE, name);
    return sym;
#else
    (void)name; /* nothing to look up without the module */
    if (why && n)
        snprintf(why, n, "this spotune was built without the CUDA backend (nvcc was not found "
                         "when it was configured, or SPOTUNE_CUDA=OFF)");
    return NULL;
#endif
}

int backend_cuda_available(void)
{
    return backend_cuda_probe(NULL, 0) > 0;
}

int backend_create(backend_t **out, const char *kind, int device, int threads, sp_err *err)
{
    *out = NULL;
    if (strcmp(kind, "auto") == 0)
        kind = backend_cuda_available() ? "cuda" : "cpu";
    if (strcmp(kind, "cpu") == 0)
        return cpu_backend_create(out, threads, 0, err);
    if (strcmp(kind, "cpu-ref") == 0)
        return cpu_backend_create(out, threads, 1, err);
    if (strcmp(kind, "cuda") == 0) {
#ifdef SPOTUNE_WITH_CUDA
        char why[1024];
        const cuda_api *api = cuda_module(why, sizeof why);
        if (!api)
            return sp_fail(err, SP_EXIT_USAGE, "runtime.backend: cuda: %s", why);
        return api->create(out, device, threads, err);
#else
        (void)device;
        return sp_fail(err, SP_EXIT_USAGE,
                       "runtime.backend: cuda requested but this spotune was built without CUDA "
                       "(rebuild with nvcc on PATH)");
#endif
    }
    return sp_fail(err, SP_EXIT_USAGE, "unknown backend '%s' (expected auto, cpu, cpu-ref or cuda)",
                   kind);
}

void backend_destroy(backend_t *be)
{
    if (!be)
        return;
    free(be->prof); /* a profile never stopped */
    be->prof = NULL;
    be->ops->destroy(be);
}
