/* kernels/cuda/cuda_cudnn.cu — causal grouped-query attention, forward and
 * backward, by cuDNN's fused scaled-dot-product attention (its flash
 * attention engines: on Hopper, warpgroup products fed by the tensor memory
 * accelerator), when SPOTUNE_CUDA_ATTENTION=cudnn asks for it
 * (docs/cuda.md, "Attention by cuDNN").
 *
 * The graphs are made by the cuDNN frontend (header-only C++ over cuDNN's
 * graph API, from PyPI: scripts/requirements-build.txt), compiled with its
 * dynamic loading: this module never links cuDNN; libcudnn.so.9 is opened
 * at the first call that asks for it, so a machine without cuDNN loads the
 * backend as before. One graph per shape (direction, B, T, heads, head dim,
 * row strides) is built on first use and kept (CUDNN_CACHE of them, the
 * oldest replaced); none is built while the stream is being captured into
 * a CUDA graph.
 *
 * Layouts, as the fused kernels take them: q [B, T, *] with row stride
 * q_ld and head h at column h hd, k and v with kv_ld, out and dout [B, T,
 * nh hd], dq with dq_ld, dk and dv with dkv_ld; lse [B, nh, T] fp32, the
 * natural-log sum over the keys of exp(scale q.k) (cuDNN's "stats", the
 * same as the fused kernels save: a forward of one and a backward of the
 * other agree). Scale 1/sqrt(hd), causal from the top left.
 *
 * Where it does not apply (packed documents: the segment starts have no
 * counterpart in a graph of dense rows; not bf16; head dim not a multiple
 * of 8 or above 256; rows not 16-byte aligned), where cuDNN is not found,
 * or where it refuses a graph, the call returns 0 and the fused kernels
 * run; the reason is printed once a process (and cuda_cudnn_status says
 * it). A graph that was built but fails to run is an error of the op.
 *
 * Determinism: the backward asks for cuDNN's deterministic algorithm
 * unless SPOTUNE_CUDNN_DETERMINISTIC=0 (dQ is otherwise accumulated with
 * atomics in fp32); the forward is deterministic either way. */
#include <cstring> /* before the frontend, which uses std::strlen */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_internal.h"

/* Whether SPOTUNE_CUDA_ATTENTION asks for cuDNN (read on every call). */
extern "C" int cuda_cudnn_requested(void)
{
    const char *e = getenv("SPOTUNE_CUDA_ATTENTION");
    return e && strcmp(e, "cudnn") == 0;
}

static int said; /* the fallback reason printed (once a process) */

static void say_once(const char *why)
{
    if (!said) {
        said = 1;
        fprintf(stderr, "spotune: attention by cuDNN (SPOTUNE_CUDA_ATTENTION=cudnn): %s; the "
                        "fused kernels run instead\n", why);
    }
}

/* Whether a call of this shape and these pointers is one cuDNN's graph can
 * take at all (before asking cuDNN; if not, it says so once). */
static int cudnn_shape_fits(dtype_t dt, int hd, const void *const *ptrs, int nptr,
                            const int *lds, int nld, const void *seg)
{
    int fits = dt == DT_BF16 && !seg && hd % 8 == 0 && hd <= 256;
    for (int i = 0; i < nptr; i++)
        fits = fits && !((uintptr_t)ptrs[i] & 15u);
    for (int i = 0; i < nld; i++)
        fits = fits && lds[i] % 8 == 0;
    if (!fits)
        say_once("this call's shape, dtype or alignment is not one it takes (bf16, head dim a "
                 "multiple of 8 up to 256, no packed documents, 16-byte aligned rows)");
    return fits;
}

#if defined(SPOTUNE_CUDNN_FRONTEND) && !defined(SPOTUNE_CUDA_EMU)

#define NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING
#define CUDNN_FRONTEND_SKIP_JSON_LIB
#include <dlfcn.h>

#include <cudnn_frontend.h>

namespace cudnn_frontend {
void *cudnn_dlhandle = nullptr; /* the frontend's handle of libcudnn (dynamic loading) */
}
namespace fe = cudnn_frontend;

#define CUDNN_CACHE 16

enum { U_Q = 1, U_K, U_V, U_O, U_STATS, U_DO, U_DQ, U_DK, U_DV };

/* What makes two calls' graphs the same. */
typedef struct cudnn_key {
    int bwd, B, T, nh, nkv, hd, ldq, ldk, ldo, lddq, lddk, det;
} cudnn_key;

typedef struct cudnn_entry {
    cudnn_key key;
    std::shared_ptr<fe::graph::Graph> g;
    int64_t ws; /* workspace bytes */
    int used;   /* 1: key holds; g NULL when cuDNN refused it (not asked again) */
} cudnn_entry;

/* A backend's cuDNN: its handle on the backend's stream and its graphs. */
typedef struct cudnn_state {
    int ready; /* 1 the handle exists; -1 unavailable (why) */
    cudnnHandle_t h;
    cudnn_entry e[CUDNN_CACHE];
    int next; /* the entry the next new graph takes */
    long ran; /* calls cuDNN ran (cuda_cudnn_calls) */
    char why[320];
} cudnn_state;

/* libcudnn.so.9, opened once a process; NULL with why set when absent. */
static void *cudnn_library(char *why, size_t n)
{
    static void *lib;
    static char err[256];
    if (!lib && !err[0]) {
        lib = dlopen("libcudnn.so.9", RTLD_NOW | RTLD_LOCAL);
        if (!lib) {
            const char *d = dlerror();
            snprintf(err, sizeof err, "libcudnn.so.9 not found (%s)", d ? d : "dlopen failed");
        }
    }
    if (!lib)
        snprintf(why, n, "%s", err);
    return lib;
}

/* The backend's state, its handle created on first use (ready -1 when cuDNN
 * cannot be used here, the reason in why). */
static cudnn_state *cudnn_get(backend_t *be)
{
    cuda_impl *im = CUDA_IMPL(be);
    cudnn_state *s = (cudnn_state *)im->cudnn;
    if (!s) {
        s = new cudnn_state();
        im->cudnn = s;
    }
    if (s->ready)
        return s;
    void *lib = cudnn_library(s->why, sizeof s->why);
    if (!lib) {
        s->ready = -1;
        return s;
    }
    fe::cudnn_dlhandle = lib;
    try {
        size_t v = fe::detail::get_backend_version();
        if (v < 90000) {
            snprintf(s->why, sizeof s->why, "cuDNN %zu is older than 9.0", v);
            s->ready = -1;
            return s;
        }
        cudnnStatus_t st = fe::detail::create_handle(&s->h);
        if (st == CUDNN_STATUS_SUCCESS)
            st = fe::detail::set_stream(s->h, im->stream);
        if (st != CUDNN_STATUS_SUCCESS) {
            snprintf(s->why, sizeof s->why, "cudnnCreate/cudnnSetStream failed (status %d)",
                     (int)st);
            s->ready = -1;
            return s;
        }
    } catch (const std::exception &x) {
        snprintf(s->why, sizeof s->why, "cuDNN could not be used: %s", x.what());
        s->ready = -1;
        return s;
    }
    s->ready = 1;
    return s;
}

/* A [d0, d1, d2, d3] bf16 tensor of the graph with these strides. */
static std::shared_ptr<fe::graph::Tensor_attributes>
cudnn_tensor(fe::graph::Graph &g, const char *name, int uid, int64_t d0, int64_t d1, int64_t d2,
             int64_t d3, int64_t s0, int64_t s1, int64_t s2)
{
    return g.tensor(fe::graph::Tensor_attributes()
                        .set_name(name)
                        .set_uid(uid)
                        .set_dim({d0, d1, d2, d3})
                        .set_stride({s0, s1, s2, 1}));
}

/* The graph of key k: attention forward (O and the stats) or backward (dQ,
 * dK, dV); for a GPU of compute capability sm (0: the current device's). */
static std::shared_ptr<fe::graph::Graph> cudnn_graph(const cudnn_key &k, int sm)
{
    auto g = std::make_shared<fe::graph::Graph>();
    if (sm > 0)
        g->set_sm_version(sm);
    g->set_io_data_type(fe::DataType_t::BFLOAT16)
        .set_intermediate_data_type(fe::DataType_t::FLOAT)
        .set_compute_data_type(fe::DataType_t::FLOAT);
    int64_t B = k.B, T = k.T, nh = k.nh, nkv = k.nkv, hd = k.hd;
    float scale = 1.0f / sqrtf((float)k.hd);
    auto Q = cudnn_tensor(*g, "Q", U_Q, B, nh, T, hd, T * k.ldq, hd, k.ldq);
    auto K = cudnn_tensor(*g, "K", U_K, B, nkv, T, hd, T * k.ldk, hd, k.ldk);
    auto V = cudnn_tensor(*g, "V", U_V, B, nkv, T, hd, T * k.ldk, hd, k.ldk);
    if (!k.bwd) {
        auto o = fe::graph::SDPA_attributes()
                     .set_name("attention")
                     .set_generate_stats(true)
                     .set_attn_scale(scale)
                     .set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT)
                     .set_diagonal_band_right_bound(0);
        auto [O, S] = g->sdpa(Q, K, V, o);
        O->set_output(true).set_uid(U_O).set_dim({B, nh, T, hd}).set_stride(
            {T * k.ldo, hd, k.ldo, 1});
        S->set_output(true)
            .set_uid(U_STATS)
            .set_data_type(fe::DataType_t::FLOAT)
            .set_dim({B, nh, T, 1})
            .set_stride({nh * T, T, 1, 1});
        return g;
    }
    auto O = cudnn_tensor(*g, "O", U_O, B, nh, T, hd, T * k.ldo, hd, k.ldo);
    auto dO = cudnn_tensor(*g, "dO", U_DO, B, nh, T, hd, T * k.ldo, hd, k.ldo);
    auto S = g->tensor(fe::graph::Tensor_attributes()
                           .set_name("stats")
                           .set_uid(U_STATS)
                           .set_dim({B, nh, T, 1})
                           .set_stride({nh * T, T, 1, 1})
                           .set_data_type(fe::DataType_t::FLOAT));
    auto o = fe::graph::SDPA_backward_attributes()
                 .set_name("attention_backward")
                 .set_attn_scale(scale)
                 .set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT)
                 .set_diagonal_band_right_bound(0)
                 .set_deterministic_algorithm(k.det != 0);
    auto [dQ, dK, dV] = g->sdpa_backward(Q, K, V, O, dO, S, o);
    dQ->set_output(true).set_uid(U_DQ).set_dim({B, nh, T, hd}).set_stride(
        {T * k.lddq, hd, k.lddq, 1});
    dK->set_output(true).set_uid(U_DK).set_dim({B, nkv, T, hd}).set_stride(
        {T * k.lddk, hd, k.lddk, 1});
    dV->set_output(true).set_uid(U_DV).set_dim({B, nkv, T, hd}).set_stride(
        {T * k.lddk, hd, k.lddk, 1});
    return g;
}

/* The built graph of key k: from the cache, or built now (not while the
 * stream is captured); NULL with s->why set when cuDNN refuses it. */
static cudnn_entry *cudnn_plan(backend_t *be, cudnn_state *s, const cudnn_key &k)
{
    for (int i = 0; i < CUDNN_CACHE; i++)
        if (s->e[i].used && memcmp(&s->e[i].key, &k, sizeof k) == 0) {
            if (!s->e[i].g)
                snprintf(s->why, sizeof s->why, "cuDNN refused the %s graph of this shape",
                         k.bwd ? "backward" : "forward");
            return s->e[i].g ? &s->e[i] : NULL;
        }
    cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(CUDA_IMPL(be)->stream, &cap) != cudaSuccess ||
        cap != cudaStreamCaptureStatusNone) {
        (void)cudaGetLastError();
        snprintf(s->why, sizeof s->why, "no graph for this shape yet, and none is built during a "
                                        "CUDA graph capture");
        return NULL;
    }
    cudnn_entry *e = &s->e[s->next];
    s->next = (s->next + 1) % CUDNN_CACHE;
    e->key = k;
    e->used = 1; /* refused until built */
    e->g.reset();
    double t0 = sp_now();
    try {
        auto g = cudnn_graph(k, 0);
        int64_t ws = 0;
        fe::error_t built = g->build(s->h, {fe::HeurMode_t::A});
        fe::error_t r = built.is_good() ? g->get_workspace_size(ws) : built;
        if (!r.is_good()) {
            snprintf(s->why, sizeof s->why, "cuDNN refused the %s graph (B %d, T %d, heads %d/%d, "
                     "head dim %d): %s", k.bwd ? "backward" : "forward", k.B, k.T, k.nh, k.nkv,
                     k.hd, r.get_message().c_str());
            return NULL;
        }
        e->g = g;
        e->ws = ws;
        double dt = sp_now() - t0;
        if (dt > 1.0) /* a one-time cost worth a line: engines compiled at run time */
            fprintf(stderr, "spotune: cuDNN built its attention %s graph (B %d, T %d, heads "
                            "%d/%d, head dim %d) in %.1f s, once for this shape\n",
                    k.bwd ? "backward" : "forward", k.B, k.T, k.nh, k.nkv, k.hd, dt);
    } catch (const std::exception &x) {
        snprintf(s->why, sizeof s->why, "cuDNN graph: %s", x.what());
        return NULL;
    }
    return e;
}

/* Runs the graph of key k on the pointers of its uids; 1 done, 0 not
 * (the reason printed once), -1 failed (the op's error set). */
static int cudnn_run(backend_t *be, const cudnn_key &k, std::unordered_map<int64_t, void *> &ptrs)
{
    cudnn_state *s = cudnn_get(be);
    if (s->ready < 0) {
        say_once(s->why);
        return 0;
    }
    cudnn_entry *e = cudnn_plan(be, s, k);
    if (!e) {
        say_once(s->why);
        return 0;
    }
    void *ws = NULL;
    if (e->ws > 0 && !(ws = cuda_scratch(be, (size_t)e->ws)))
        return -1;
    try {
        fe::error_t r = e->g->execute(s->h, ptrs, ws);
        if (!r.is_good()) {
            cuda_fail(be, __FILE__, __LINE__, "cuDNN attention %s: %s",
                      k.bwd ? "backward" : "forward", r.get_message().c_str());
            return -1;
        }
    } catch (const std::exception &x) {
        cuda_fail(be, __FILE__, __LINE__, "cuDNN attention %s: %s",
                  k.bwd ? "backward" : "forward", x.what());
        return -1;
    }
    if (cuda_ok(be, cudaGetLastError(), "cuDNN attention", __FILE__, __LINE__))
        return -1;
    s->ran++;
    return 1;
}

static int cudnn_deterministic(void)
{
    const char *e = getenv("SPOTUNE_CUDNN_DETERMINISTIC");
    return !(e && strcmp(e, "0") == 0);
}

extern "C" int cuda_cudnn_attention_forward(backend_t *be, tensor_t out, tensor_t lse, tensor_t q,
                                            tensor_t k, tensor_t v, tensor_t seg, int B, int T,
                                            int nh, int nkv, int hd, int q_ld, int kv_ld)
{
    const void *p[] = {q.p, k.p, v.p, out.p, lse.p};
    const int lds[] = {q_ld, kv_ld, nh * hd};
    if (!cudnn_shape_fits(q.dt, hd, p, 5, lds, 3, seg.p))
        return 0;
    cudnn_key key = {0, B, T, nh, nkv, hd, q_ld, kv_ld, nh * hd, 0, 0, 0};
    std::unordered_map<int64_t, void *> ptrs = {
        {U_Q, q.p}, {U_K, k.p}, {U_V, v.p}, {U_O, out.p}, {U_STATS, lse.p}};
    return cudnn_run(be, key, ptrs);
}

extern "C" int cuda_cudnn_attention_backward(backend_t *be, tensor_t dq, tensor_t dk, tensor_t dv,
                                             tensor_t dout, tensor_t out, tensor_t lse,
                                             tensor_t q, tensor_t k, tensor_t v, tensor_t seg,
                                             int B, int T, int nh, int nkv, int hd, int q_ld,
                                             int kv_ld, int dq_ld, int dkv_ld)
{
    const void *p[] = {q.p, k.p, v.p, out.p, dout.p, dq.p, dk.p, dv.p, lse.p};
    const int lds[] = {q_ld, kv_ld, nh * hd, dq_ld, dkv_ld};
    if (!cudnn_shape_fits(q.dt, hd, p, 9, lds, 5, seg.p))
        return 0;
    cudnn_key key = {1,     B,      T,          nh, nkv, hd, q_ld, kv_ld, nh * hd, dq_ld, dkv_ld,
                     cudnn_deterministic()};
    std::unordered_map<int64_t, void *> ptrs = {
        {U_Q, q.p},     {U_K, k.p},       {U_V, v.p},   {U_O, out.p},  {U_DO, dout.p},
        {U_STATS, lse.p}, {U_DQ, dq.p}, {U_DK, dk.p}, {U_DV, dv.p}};
    return cudnn_run(be, key, ptrs);
}

extern "C" int cuda_cudnn_status(backend_t *be, char *why, size_t n)
{
    cudnn_state *s = cudnn_get(be);
    if (s->ready < 0)
        snprintf(why, n, "%s", s->why);
    else
        snprintf(why, n, "cuDNN %zu", fe::detail::get_backend_version());
    return s->ready > 0;
}

/* The frontend's own checks of the graph a call of this shape would build
 * on a GPU of compute capability sm (90: H100, H200; 80: A100)
 * (fe::graph::Graph::validate: dims, strides, data types, what its
 * attention node takes there), with no GPU and no handle: libcudnn.so.9
 * loaded for its version alone. 1 valid; 0 not, or cuDNN absent, with
 * why. For the tests (tests/test_cudnn_graphs.c), where no GPU may be. */
extern "C" int cuda_cudnn_validate(int sm, int bwd, int B, int T, int nh, int nkv, int hd,
                                   int q_ld, int kv_ld, int dq_ld, int dkv_ld, char *why, size_t n)
{
    void *lib = cudnn_library(why, n);
    if (!lib)
        return 0;
    fe::cudnn_dlhandle = lib;
    cudnn_key k = {bwd, B, T, nh, nkv, hd, q_ld, kv_ld, nh * hd, dq_ld, dkv_ld, 1};
    try {
        auto g = cudnn_graph(k, sm);
        fe::error_t r = g->validate();
        if (!r.is_good()) {
            snprintf(why, n, "%s", r.get_message().c_str());
            return 0;
        }
        snprintf(why, n, "valid (cuDNN %zu)", fe::detail::get_backend_version());
    } catch (const std::exception &x) {
        snprintf(why, n, "%s", x.what());
        return 0;
    }
    return 1;
}

extern "C" long cuda_cudnn_calls(backend_t *be)
{
    cudnn_state *s = (cudnn_state *)CUDA_IMPL(be)->cudnn;
    return s ? s->ran : 0;
}

extern "C" void cuda_cudnn_release(backend_t *be)
{
    cuda_impl *im = CUDA_IMPL(be);
    cudnn_state *s = (cudnn_state *)im->cudnn;
    if (!s)
        return;
    if (s->ready > 0) {
        try {
            fe::detail::destroy_handle(s->h);
        } catch (const std::exception &) {
            /* nothing to release then */
        }
    }
    delete s;
    im->cudnn = NULL;
}

#else /* built without the cuDNN frontend, or on the emulated device */

#ifdef SPOTUNE_CUDA_EMU
#define CUDNN_ABSENT "the emulated device has no cuDNN"
#elif defined(SPOTUNE_CUDNN_NO_HEADER)
#define CUDNN_ABSENT "this build's CUDA toolkit has no cudnn.h"
#else
#define CUDNN_ABSENT "this build has no cuDNN frontend (scripts/requirements-build.txt)"
#endif

static int cudnn_absent(void)
{
    say_once(CUDNN_ABSENT);
    return 0;
}

extern "C" int cuda_cudnn_attention_forward(backend_t *be, tensor_t out, tensor_t lse, tensor_t q,
                                            tensor_t k, tensor_t v, tensor_t seg, int B, int T,
                                            int nh, int nkv, int hd, int q_ld, int kv_ld)
{
    (void)be, (void)out, (void)lse, (void)q, (void)k, (void)v, (void)seg, (void)B, (void)T;
    (void)nh, (void)nkv, (void)hd, (void)q_ld, (void)kv_ld, (void)cudnn_shape_fits;
    return cudnn_absent();
}

extern "C" int cuda_cudnn_attention_backward(backend_t *be, tensor_t dq, tensor_t dk, tensor_t dv,
                                             tensor_t dout, tensor_t out, tensor_t lse,
                                             tensor_t q, tensor_t k, tensor_t v, tensor_t seg,
                                             int B, int T, int nh, int nkv, int hd, int q_ld,
                                             int kv_ld, int dq_ld, int dkv_ld)
{
    (void)be, (void)dq, (void)dk, (void)dv, (void)dout, (void)out, (void)lse, (void)q, (void)k;
    (void)v, (void)seg, (void)B, (void)T, (void)nh, (void)nkv, (void)hd, (void)q_ld, (void)kv_ld;
    (void)dq_ld, (void)dkv_ld;
    return cudnn_absent();
}

extern "C" int cuda_cudnn_status(backend_t *be, char *why, size_t n)
{
    (void)be;
    snprintf(why, n, "%s", CUDNN_ABSENT);
    return 0;
}

extern "C" int cuda_cudnn_validate(int sm, int bwd, int B, int T, int nh, int nkv, int hd,
                                   int q_ld, int kv_ld, int dq_ld, int dkv_ld, char *why, size_t n)
{
    (void)sm, (void)bwd, (void)B, (void)T, (void)nh, (void)nkv, (void)hd, (void)q_ld, (void)kv_ld;
    (void)dq_ld, (void)dkv_ld;
    snprintf(why, n, "%s", CUDNN_ABSENT);
    return 0;
}

extern "C" long cuda_cudnn_calls(backend_t *be)
{
    (void)be;
    return 0;
}

extern "C" void cuda_cudnn_release(backend_t *be)
{
    (void)be;
}

#endif
