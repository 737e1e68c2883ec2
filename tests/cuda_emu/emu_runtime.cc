/* tests/cuda_emu/emu_runtime.cc — the emulated device's runtime
 * (cuda_emu_runtime.h): memory on the host, streams that run their work at
 * once (or record it while captured), graphs that replay a record, events
 * on the host clock. Single-threaded, as the backend uses the runtime. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <mutex>
#include <unordered_map>
#include <vector>

#include "cuda_emu.h"
#include "cuda_emu_runtime.h"

struct emu_graph {
    std::vector<std::function<void()>> ops;
};

struct emu_stream {
    int capturing; /* a capture is open on this stream */
    int invalid;   /* ... and a call it cannot hold broke it */
    emu_graph *g;
};

struct emu_event {
    double t; /* seconds, when the work before it ran */
};

static cudaError_t last_error = cudaSuccess;
static emu_stream *capturing; /* the stream of the open capture (thread-local mode) */

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static cudaError_t fail(cudaError_t e)
{
    last_error = e;
    return e;
}

/* A call the open capture cannot hold: it fails and the capture with it. */
static int refused_in_capture(void)
{
    if (!capturing)
        return 0;
    capturing->invalid = 1;
    fail(cudaErrorStreamCaptureUnsupported);
    return 1;
}

void emu_enqueue(cudaStream_t s, std::function<void()> fn)
{
    if (s && s->capturing) {
        if (!s->invalid)
            s->g->ops.push_back(fn);
        return;
    }
    fn();
}

/* For the NCCL emulation (emu_nccl.c), which runs a collective at once
 * and so cannot be recorded into a graph: whether s is being captured. */
extern "C" int spotune_emu_stream_capturing(void *s)
{
    return s && ((emu_stream *)s)->capturing;
}

void emu_launch_failed(void)
{
    fail(cudaErrorLaunchFailure);
}

/* ---- errors and the device --------------------------------------------------------- */

const char *cudaGetErrorName(cudaError_t e)
{
    switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
    case cudaErrorStreamCaptureUnsupported: return "cudaErrorStreamCaptureUnsupported";
    case cudaErrorStreamCaptureInvalidated: return "cudaErrorStreamCaptureInvalidated";
    case cudaErrorStreamCaptureUnmatched: return "cudaErrorStreamCaptureUnmatched";
    case cudaErrorNotSupported: return "cudaErrorNotSupported";
    case cudaErrorPeerAccessAlreadyEnabled: return "cudaErrorPeerAccessAlreadyEnabled";
    }
    return "cudaErrorUnknown";
}

const char *cudaGetErrorString(cudaError_t e)
{
    switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorLaunchFailure: return "the emulated launch failed (see the emulator's message)";
    case cudaErrorStreamCaptureUnsupported: return "operation not permitted when stream is capturing";
    case cudaErrorStreamCaptureInvalidated: return "operation failed due to a previous error during capture";
    default: return "emulated device error";
    }
}

cudaError_t cudaGetLastError(void)
{
    cudaError_t e = last_error;
    last_error = cudaSuccess;
    return e;
}

/* How many devices the process sees: 1, or SPOTUNE_CUDA_EMU_DEVICES (1 to
 * 8), so that ranks on one host each take their own (a distinct UUID each;
 * every process has its own memory anyway). */
static int device_count(void)
{
    const char *env = getenv("SPOTUNE_CUDA_EMU_DEVICES");
    int n = env ? atoi(env) : 1;
    return n >= 1 && n <= 8 ? n : 1;
}

static int valid_device(int d)
{
    return d >= 0 && d < device_count();
}

cudaError_t cudaGetDeviceCount(int *n)
{
    *n = device_count();
    return cudaSuccess;
}

cudaError_t cudaSetDevice(int d)
{
    return valid_device(d) ? cudaSuccess : fail(cudaErrorInvalidDevice);
}

cudaError_t cudaDeviceGetAttribute(int *v, cudaDeviceAttr a, int d)
{
    if (!valid_device(d))
        return fail(cudaErrorInvalidDevice);
    *v = a == cudaDevAttrComputeCapabilityMajor ? 9
         : a == cudaDevAttrComputeMode          ? cudaComputeModeDefault
                                                : 0;
    return cudaSuccess;
}

#define EMU_MEMORY ((size_t)64 << 30)

cudaError_t cudaGetDeviceProperties(cudaDeviceProp *p, int d)
{
    if (!valid_device(d))
        return fail(cudaErrorInvalidDevice);
    memset(p, 0, sizeof *p);
    snprintf(p->name, sizeof p->name, "emulated CUDA device (CPU)");
    memcpy(p->uuid.bytes, "spotune-emu-dev0", 16);
    p->uuid.bytes[15] = (char)('0' + d);
    p->totalGlobalMem = EMU_MEMORY;
    p->major = 9;
    p->multiProcessorCount = 1;
    return cudaSuccess;
}

cudaError_t cudaMemGetInfo(size_t *free_b, size_t *total_b)
{
    *free_b = *total_b = EMU_MEMORY;
    return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize(void)
{
    return refused_in_capture() ? cudaErrorStreamCaptureUnsupported : cudaSuccess;
}

/* ---- memory ------------------------------------------------------------------------ */

/* SPOTUNE_CUDA_EMU_GUARD=1 (the emulated suites set it): every device
 * allocation is its own mapping, with an inaccessible page before it and
 * one right after its end (its size rounded up to 256 bytes, the device's
 * alignment), so a kernel or copy that reads or writes past a buffer stops
 * the process with SIGSEGV where it happens instead of passing unseen. */
struct guarded {
    void *base;
    size_t len;
};
static std::mutex guard_lock;
static std::unordered_map<void *, guarded> guard_maps;

static int guard_on(void)
{
    const char *e = getenv("SPOTUNE_CUDA_EMU_GUARD");
    return e && *e && strcmp(e, "0") != 0;
}

static void *guarded_alloc(size_t rounded)
{
    size_t page = (size_t)sysconf(_SC_PAGESIZE), body = (rounded + page - 1) / page * page;
    size_t len = body + 2 * page;
    char *base = (char *)mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1,
                              0);
    if (base == (char *)MAP_FAILED)
        return NULL;
    if (mprotect(base, page, PROT_NONE) || mprotect(base + page + body, page, PROT_NONE)) {
        munmap(base, len);
        return NULL;
    }
    void *p = base + page + body - rounded;
    std::lock_guard<std::mutex> hold(guard_lock);
    guard_maps[p] = guarded{base, len};
    return p;
}

cudaError_t cudaMalloc(void **p, size_t bytes)
{
    *p = NULL;
    if (refused_in_capture())
        return cudaErrorStreamCaptureUnsupported;
    size_t rounded = bytes ? (bytes + 255) & ~(size_t)255 : 256;
    if (!(*p = guard_on() ? guarded_alloc(rounded) : aligned_alloc(256, rounded)))
        return fail(cudaErrorMemoryAllocation);
    return cudaSuccess;
}

cudaError_t cudaFree(void *p)
{
    if (refused_in_capture())
        return cudaErrorStreamCaptureUnsupported;
    {
        std::lock_guard<std::mutex> hold(guard_lock);
        auto g = guard_maps.find(p);
        if (g != guard_maps.end()) {
            munmap(g->second.base, g->second.len);
            guard_maps.erase(g);
            return cudaSuccess;
        }
    }
    free(p);
    return cudaSuccess;
}

cudaError_t cudaMallocHost(void **p, size_t bytes)
{
    *p = malloc(bytes ? bytes : 1);
    return *p ? cudaSuccess : fail(cudaErrorMemoryAllocation);
}

cudaError_t cudaHostAlloc(void **p, size_t bytes, unsigned flags)
{
    (void)flags;
    return cudaMallocHost(p, bytes);
}

cudaError_t cudaFreeHost(void *p)
{
    free(p);
    return cudaSuccess;
}

cudaError_t cudaMemset(void *p, int v, size_t bytes)
{
    if (refused_in_capture())
        return cudaErrorStreamCaptureUnsupported;
    memset(p, v, bytes);
    return cudaSuccess;
}

cudaError_t cudaMemsetAsync(void *p, int v, size_t bytes, cudaStream_t s)
{
    emu_enqueue(s, [=]() { memset(p, v, bytes); });
    return cudaSuccess;
}

cudaError_t cudaMemcpy(void *dst, const void *src, size_t bytes, cudaMemcpyKind k)
{
    (void)k;
    if (refused_in_capture())
        return cudaErrorStreamCaptureUnsupported;
    memmove(dst, src, bytes);
    return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, cudaMemcpyKind k,
                            cudaStream_t s)
{
    (void)k;
    emu_enqueue(s, [=]() { memmove(dst, src, bytes); });
    return cudaSuccess;
}

cudaError_t cudaMemcpy2DAsync(void *dst, size_t dpitch, const void *src, size_t spitch,
                              size_t width, size_t height, cudaMemcpyKind k, cudaStream_t s)
{
    (void)k;
    if (width > dpitch || width > spitch)
        return fail(cudaErrorInvalidValue);
    emu_enqueue(s, [=]() {
        for (size_t r = 0; r < height; r++)
            memmove((char *)dst + r * dpitch, (const char *)src + r * spitch, width);
    });
    return cudaSuccess;
}

/* ---- streams and events ------------------------------------------------------------ */

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags)
{
    (void)flags;
    *s = (emu_stream *)calloc(1, sizeof(emu_stream));
    return *s ? cudaSuccess : fail(cudaErrorMemoryAllocation);
}

cudaError_t cudaStreamDestroy(cudaStream_t s)
{
    if (s && s->g)
        delete s->g;
    free(s);
    return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t s)
{
    (void)s;
    return refused_in_capture() ? cudaErrorStreamCaptureUnsupported : cudaSuccess;
}

cudaError_t cudaStreamQuery(cudaStream_t s)
{
    if (s && s->capturing && s->invalid)
        return cudaErrorStreamCaptureInvalidated;
    return cudaSuccess;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags)
{
    (void)s, (void)e, (void)flags; /* work runs in issue order: every wait is met */
    return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t *e)
{
    *e = (emu_event *)calloc(1, sizeof(emu_event));
    return *e ? cudaSuccess : fail(cudaErrorMemoryAllocation);
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned flags)
{
    (void)flags;
    return cudaEventCreate(e);
}

cudaError_t cudaEventDestroy(cudaEvent_t e)
{
    free(e);
    return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s)
{
    emu_enqueue(s, [=]() { e->t = now_s(); });
    return cudaSuccess;
}

cudaError_t cudaEventSynchronize(cudaEvent_t e)
{
    (void)e;
    return refused_in_capture() ? cudaErrorStreamCaptureUnsupported : cudaSuccess;
}

cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t a, cudaEvent_t b)
{
    *ms = (float)((b->t - a->t) * 1e3);
    return cudaSuccess;
}

/* ---- capture and graphs ------------------------------------------------------------ */

cudaError_t cudaStreamBeginCapture(cudaStream_t s, cudaStreamCaptureMode m)
{
    (void)m;
    if (!s || s->capturing || capturing)
        return fail(cudaErrorInvalidValue);
    s->capturing = 1;
    s->invalid = 0;
    s->g = new emu_graph;
    capturing = s;
    return cudaSuccess;
}

cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t *g)
{
    *g = NULL;
    if (!s || !s->capturing)
        return fail(cudaErrorStreamCaptureUnmatched);
    s->capturing = 0;
    capturing = NULL;
    emu_graph *graph = s->g;
    s->g = NULL;
    if (s->invalid) {
        delete graph;
        return fail(cudaErrorStreamCaptureInvalidated);
    }
    *g = graph;
    return cudaSuccess;
}

cudaError_t cudaGraphInstantiate(cudaGraphExec_t *x, cudaGraph_t g, unsigned long long flags)
{
    (void)flags;
    *x = new emu_graph(*g);
    return cudaSuccess;
}

cudaError_t cudaGraphLaunch(cudaGraphExec_t x, cudaStream_t s)
{
    for (size_t i = 0; i < x->ops.size(); i++)
        emu_enqueue(s, x->ops[i]);
    return cudaSuccess;
}

cudaError_t cudaGraphDestroy(cudaGraph_t g)
{
    delete g;
    return cudaSuccess;
}

cudaError_t cudaGraphExecDestroy(cudaGraphExec_t x)
{
    delete x;
    return cudaSuccess;
}
