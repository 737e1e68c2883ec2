/* tests/cuda_emu/emu_runtime.cc — the emulated device's runtime
 * (cuda_emu_runtime.h): memory on the host, streams that run their work at
 * once (or record it while captured), graphs that replay a record, events
 * on the host clock. Single-threaded, as the backend uses the runtime.
 *
 * SPOTUNE_CUDA_EMU_DEFER=all: streams hold their work instead, as a GPU
 * that lags the host as far as it may; =aux: only the streams made while
 * another is alive (the backend's communication stream lags its compute
 * stream, which runs its work at once). A held stream's work runs only
 * when something must see it — a host wait on the stream, on an event
 * recorded on it, or on the device (cudaStreamSynchronize,
 * cudaEventSynchronize, cudaDeviceSynchronize, and the calls that
 * synchronize implicitly:
 * cudaFree, cudaFreeHost, a copy to pageable host memory), or another
 * stream's work that waits on such an event (cudaStreamWaitEvent) and runs
 * itself. So a missing wait shows: a kernel that reads what another stream
 * has not yet written (nothing orders them) reads the old values, a host
 * read of device results without a wait reads them before they are made,
 * a pinned host buffer reused before its copy ran sends the new contents.
 * Copies from pageable host memory are taken at the call, as the driver
 * stages them; cudaMemcpy and cudaMemset (the legacy default stream) do not
 * wait for the backend's non-blocking streams, as on a GPU. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <new>
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
    int lags;                               /* SPOTUNE_CUDA_EMU_DEFER: it holds its work */
    std::deque<std::function<void()>> held; /* the work not yet run */
    uint64_t issued, done;                  /* work items given to it, and run */
};

struct emu_event {
    double t;       /* seconds, when the work before it ran */
    int complete;   /* that work has run */
    emu_stream *s;  /* deferred: the stream it was recorded on, and the */
    uint64_t pos;   /* count of its items the record follows */
};

static cudaError_t last_error = cudaSuccess;
static emu_stream *capturing; /* the stream of the open capture (thread-local mode) */
static std::vector<emu_stream *> streams; /* every stream alive, for device-wide waits */

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

/* SPOTUNE_CUDA_EMU_DEFER: 0 off, 1 "all", 2 "aux" */
static int defer_mode(void)
{
    static int mode = -1;
    if (mode < 0) {
        const char *e = getenv("SPOTUNE_CUDA_EMU_DEFER");
        mode = !e || !*e || !strcmp(e, "0") ? 0 : !strcmp(e, "aux") ? 2 : 1;
    }
    return mode;
}

/* Runs s's held work until upto items of it have run. */
static void run_until(emu_stream *s, uint64_t upto)
{
    while (s->done < upto && !s->held.empty()) {
        std::function<void()> fn = std::move(s->held.front());
        s->held.pop_front();
        s->done++;
        fn();
    }
}

static void run_stream(emu_stream *s)
{
    if (s)
        run_until(s, s->issued);
}

/* every stream's held work (a device-wide wait) */
static void run_all(void)
{
    for (int again = 1; again;) {
        again = 0;
        for (size_t i = 0; i < streams.size(); i++)
            if (!streams[i]->held.empty()) {
                run_stream(streams[i]);
                again = 1;
            }
    }
}

void emu_enqueue(cudaStream_t s, std::function<void()> fn)
{
    if (s && s->capturing) {
        if (!s->invalid)
            s->g->ops.push_back(fn);
        return;
    }
    if (s && s->lags) {
        s->held.push_back(std::move(fn));
        s->issued++;
        return;
    }
    fn();
}

/* For the NCCL emulation (emu_nccl.c), which runs a collective once issued:
 * the work held on s before it runs first. */
extern "C" void spotune_emu_stream_run(void *s)
{
    run_stream((emu_stream *)s);
}

/* ... and work it adds to s: fn(arg) when s's work comes to it */
extern "C" void spotune_emu_stream_enqueue(void *s, void (*fn)(void *), void *arg)
{
    emu_enqueue((emu_stream *)s, [=]() { fn(arg); });
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

/* Each kernel's limit on dynamic shared memory (cudaFuncSetAttribute), by
 * its address; 48 KiB where none was set. */
static std::map<const void *, size_t> func_smem;
static std::mutex func_smem_lock;

cudaError_t emu_func_set_max_smem(const void *kernel, int bytes)
{
    if (bytes < 0 || bytes > 227 * 1024)
        return fail(cudaErrorInvalidValue);
    std::lock_guard<std::mutex> g(func_smem_lock);
    func_smem[kernel] = (size_t)bytes;
    return cudaSuccess;
}

size_t emu_func_max_smem(const void *kernel)
{
    std::lock_guard<std::mutex> g(func_smem_lock);
    auto it = func_smem.find(kernel);
    return it == func_smem.end() ? (size_t)48 * 1024 : it->second;
}

void emu_launch_refused(const char *why, size_t smem, size_t limit)
{
    fprintf(stderr, "cuda_emu: launch refused: %s (%zu bytes, the limit %zu)\n", why, smem, limit);
    fail(cudaErrorInvalidValue);
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

static int current_device; /* cudaSetDevice's */
static unsigned peer_enabled[8]; /* bit p of [d]: d has enabled access to p */

cudaError_t cudaSetDevice(int d)
{
    if (!valid_device(d))
        return fail(cudaErrorInvalidDevice);
    current_device = d;
    return cudaSuccess;
}

/* CUDA 13.0 (the toolkit this is written against); the driver's may be set
 * lower (SPOTUNE_CUDA_EMU_DRIVER_VERSION) to show an insufficient driver. */
#define EMU_CUDA_VERSION 13000

cudaError_t cudaDriverGetVersion(int *v)
{
    if (!v)
        return fail(cudaErrorInvalidValue);
    const char *env = getenv("SPOTUNE_CUDA_EMU_DRIVER_VERSION");
    *v = env && atoi(env) > 0 ? atoi(env) : EMU_CUDA_VERSION;
    return cudaSuccess;
}

cudaError_t cudaRuntimeGetVersion(int *v)
{
    if (!v)
        return fail(cudaErrorInvalidValue);
    *v = EMU_CUDA_VERSION;
    return cudaSuccess;
}

/* Every emulated device reaches every other (one host memory). */
cudaError_t cudaDeviceCanAccessPeer(int *can, int dev, int peer)
{
    if (!valid_device(dev) || !valid_device(peer))
        return fail(cudaErrorInvalidDevice);
    *can = dev != peer;
    return cudaSuccess;
}

/* As documented: access from the current device to peer; the device itself
 * is not a peer (cudaErrorInvalidDevice), a second enable is
 * cudaErrorPeerAccessAlreadyEnabled; flags must be 0. */
cudaError_t cudaDeviceEnablePeerAccess(int peer, unsigned flags)
{
    if (flags != 0)
        return fail(cudaErrorInvalidValue);
    if (!valid_device(peer) || peer == current_device)
        return fail(cudaErrorInvalidDevice);
    if (peer_enabled[current_device] & (1u << peer))
        return fail(cudaErrorPeerAccessAlreadyEnabled);
    peer_enabled[current_device] |= 1u << peer;
    return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int *v, cudaDeviceAttr a, int d)
{
    if (!valid_device(d))
        return fail(cudaErrorInvalidDevice);
    /* shared memory a multiprocessor: an H100's 228 KiB, or another GPU's
     * (SPOTUNE_CUDA_EMU_SMEM_PER_SM, bytes: 102400 for sm_86/89's 100 KiB) */
    const char *e = getenv("SPOTUNE_CUDA_EMU_SMEM_PER_SM");
    int smem = e && *e ? atoi(e) : 228 * 1024;
    *v = a == cudaDevAttrComputeCapabilityMajor             ? 9
         : a == cudaDevAttrComputeMode                      ? cudaComputeModeDefault
         : a == cudaDevAttrMultiProcessorCount              ? 1 /* as cudaGetDeviceProperties says */
         : a == cudaDevAttrMaxSharedMemoryPerMultiprocessor ? smem
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
    p->ECCEnabled = 1;
    p->pciBusID = 0x10 + d;
    return cudaSuccess;
}

cudaError_t cudaMemGetInfo(size_t *free_b, size_t *total_b)
{
    *free_b = *total_b = EMU_MEMORY;
    return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize(void)
{
    if (refused_in_capture())
        return cudaErrorStreamCaptureUnsupported;
    run_all();
    return cudaSuccess;
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
    run_all(); /* cudaFree synchronizes the device */
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

/* pinned host memory (cudaMallocHost, cudaHostAlloc): its start and size */
static std::map<uintptr_t, size_t> pinned;

static int is_pinned(const void *p)
{
    auto it = pinned.upper_bound((uintptr_t)p);
    if (it == pinned.begin())
        return 0;
    --it;
    return (uintptr_t)p < it->first + it->second;
}

cudaError_t cudaMallocHost(void **p, size_t bytes)
{
    *p = malloc(bytes ? bytes : 1);
    if (!*p)
        return fail(cudaErrorMemoryAllocation);
    pinned[(uintptr_t)*p] = bytes ? bytes : 1;
    return cudaSuccess;
}

cudaError_t cudaHostAlloc(void **p, size_t bytes, unsigned flags)
{
    (void)flags;
    return cudaMallocHost(p, bytes);
}

cudaError_t cudaFreeHost(void *p)
{
    run_all(); /* as cudaFree */
    pinned.erase((uintptr_t)p);
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

/* SPOTUNE_CUDA_EMU_COPY=corrupt: the last byte of every copy between
 * device buffers comes out inverted (a device whose copies fail silently,
 * for the doctor's checks); read at each copy. */
static void copy_d2d(void *dst, const void *src, size_t bytes)
{
    memmove(dst, src, bytes);
    const char *e = getenv("SPOTUNE_CUDA_EMU_COPY");
    if (bytes && e && strcmp(e, "corrupt") == 0)
        ((unsigned char *)dst)[bytes - 1] ^= 0xFF;
}

cudaError_t cudaMemcpy(void *dst, const void *src, size_t bytes, cudaMemcpyKind k)
{
    if (refused_in_capture())
        return cudaErrorStreamCaptureUnsupported;
    if (k == cudaMemcpyDeviceToDevice)
        copy_d2d(dst, src, bytes);
    else
        memmove(dst, src, bytes);
    return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, cudaMemcpyKind k,
                            cudaStream_t s)
{
    if (k == cudaMemcpyDeviceToDevice) {
        emu_enqueue(s, [=]() { copy_d2d(dst, src, bytes); });
        return cudaSuccess;
    }
    int deferred = s && !s->capturing && s->lags;
    if (deferred && k == cudaMemcpyHostToDevice && !is_pinned(src)) {
        /* pageable: the driver takes the source before the call returns */
        std::shared_ptr<std::vector<char>> copy =
            std::make_shared<std::vector<char>>((const char *)src, (const char *)src + bytes);
        emu_enqueue(s, [=]() { memmove(dst, copy->data(), bytes); });
        return cudaSuccess;
    }
    emu_enqueue(s, [=]() { memmove(dst, src, bytes); });
    if (deferred && k == cudaMemcpyDeviceToHost && !is_pinned(dst))
        run_stream(s); /* to pageable memory: the call returns once the copy is done */
    return cudaSuccess;
}

/* Between devices: one host memory, so a copy like any other. */
cudaError_t cudaMemcpyPeer(void *dst, int dst_dev, const void *src, int src_dev, size_t bytes)
{
    if (!valid_device(dst_dev) || !valid_device(src_dev))
        return fail(cudaErrorInvalidDevice);
    return cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToDevice);
}

cudaError_t cudaMemcpyPeerAsync(void *dst, int dst_dev, const void *src, int src_dev,
                                size_t bytes, cudaStream_t s)
{
    if (!valid_device(dst_dev) || !valid_device(src_dev))
        return fail(cudaErrorInvalidDevice);
    return cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s);
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
    *s = new (std::nothrow) emu_stream();
    if (!*s)
        return fail(cudaErrorMemoryAllocation);
    (*s)->lags = defer_mode() == 1 || (defer_mode() == 2 && !streams.empty());
    streams.push_back(*s);
    return cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t s)
{
    if (!s)
        return cudaSuccess;
    run_stream(s); /* its work still runs, as on a GPU */
    for (size_t i = 0; i < streams.size(); i++)
        if (streams[i] == s) {
            streams.erase(streams.begin() + (long)i);
            break;
        }
    delete s->g;
    delete s;
    return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t s)
{
    if (refused_in_capture())
        return cudaErrorStreamCaptureUnsupported;
    run_stream(s);
    return cudaSuccess;
}

cudaError_t cudaStreamQuery(cudaStream_t s)
{
    if (s && s->capturing && s->invalid)
        return cudaErrorStreamCaptureInvalidated;
    if (s && !s->capturing && !s->held.empty()) {
        run_stream(s); /* not done when asked; done by the time it is asked again */
        return cudaErrorNotReady;
    }
    return cudaSuccess;
}

/* Later work of s waits for what e's record followed: a held item of s
 * when s lags, else that work runs now (without SPOTUNE_CUDA_EMU_DEFER it
 * has run: every wait is met). */
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags)
{
    (void)flags;
    if (!e)
        return fail(cudaErrorInvalidValue);
    emu_stream *t = e->s;
    uint64_t pos = e->pos;
    if (!t || t == s || (s && s->capturing))
        return cudaSuccess;
    if (s && s->lags) {
        s->held.push_back([=]() { run_until(t, pos); });
        s->issued++;
    } else {
        run_until(t, pos);
    }
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
    if (!e)
        return fail(cudaErrorInvalidValue);
    if (!(s && s->capturing))
        e->complete = 0;
    emu_enqueue(s, [=]() {
        e->t = now_s();
        e->complete = 1;
    });
    if (s && !s->capturing && s->lags) {
        e->s = s;
        e->pos = s->issued;
    } else {
        e->s = NULL;
    }
    return cudaSuccess;
}

cudaError_t cudaEventSynchronize(cudaEvent_t e)
{
    if (refused_in_capture())
        return cudaErrorStreamCaptureUnsupported;
    if (e && e->s)
        run_until(e->s, e->pos);
    return cudaSuccess;
}

/* as the runtime: cudaErrorNotReady while either event's work has not run */
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t a, cudaEvent_t b)
{
    if (!a || !b)
        return fail(cudaErrorInvalidValue);
    if (!a->complete || !b->complete)
        return fail(cudaErrorNotReady);
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
