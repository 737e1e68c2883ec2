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
 * Packed documents (seg, backend.h) are given as what they are, separate
 * sequences: with seg's document table (packed_doc_table, which the
 * trainer stages when be->doc_table), the graph's batch is the table's
 * capacity C of sequences of at most T tokens, each at its ragged offset
 * (its first token's row times the tensor's row stride, computed on the
 * device from the table) with its length (0 for the table's unused
 * entries), causal within itself. cuDNN keeps their stats token-major
 * ([B T, nh], its ragged layout), moved to and from lse by a small kernel.
 * One graph per capacity: a handful a run (C is a power of two). Needs
 * cuDNN 9.6 (64-bit ragged offsets, ragged stats).
 *
 * Where it does not apply (packed documents without their table; not
 * bf16; head dim not a multiple of 8 or above 256; rows not 16-byte
 * aligned), where cuDNN is not found, or where it refuses a graph, the
 * call returns 0 and the fused kernels run; the reason is printed once a
 * process (and cuda_cudnn_status says it). A graph that was built but
 * fails to run is an error of the op.
 *
 * Determinism: the backward asks for cuDNN's deterministic algorithm
 * unless SPOTUNE_CUDNN_DETERMINISTIC=0 (dQ is otherwise accumulated with
 * atomics in fp32); the forward is deterministic either way.
 *
 * Workspace: a graph may take SPOTUNE_CUDNN_WORKSPACE_BUDGET bytes (512
 * MiB unless set); one that asks for more is refused, and the fused kernels
 * run that shape. The deterministic backward keeps dP (B x heads x T^2 x 2
 * bytes: 4.3 GB at the 7B shape's seq 8192) unless told a limit
 * (CUDNN_FRONTEND_ATTN_DP_WORKSPACE_LIMIT, which the frontend reads as it
 * builds), under which cuDNN 9.25 and later on Hopper accumulate dQ in
 * order with a workspace linear in T: cuda_cudnn_setup_env sets that
 * limit to 7/8 of the budget, unless the variable is set already.
 *
 * The layout the graphs declare, the ragged arguments and the budget are
 * cuda_cudnn_layout.cu's (cuda_cudnn.cuh); this file builds, runs and
 * keeps the graphs. */
#include <cstring> /* before the frontend, which uses std::strlen */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_cudnn.cuh"

#define STREAM(be) (CUDA_IMPL(be)->stream)

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
 * take at all (before asking cuDNN; if not, it says so once); cap as
 * doc_cap gives it. */
static int cudnn_shape_fits(dtype_t dt, int hd, const void *const *ptrs, int nptr,
                            const int *lds, int nld, int cap)
{
    if (cap < 0) {
        say_once("packed documents came without their document table (the trainer stages it "
                 "when SPOTUNE_CUDA_ATTENTION=cudnn is set as the backend is created)");
        return 0;
    }
    int fits = dt == DT_BF16 && hd % 8 == 0 && hd <= 256;
    for (int i = 0; i < nptr; i++)
        fits = fits && !((uintptr_t)ptrs[i] & 15u);
    for (int i = 0; i < nld; i++)
        fits = fits && lds[i] % 8 == 0;
    if (!fits)
        say_once("this call's shape, dtype or alignment is not one it takes (bf16, head dim a "
                 "multiple of 8 up to 256, 16-byte aligned rows)");
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
    size_t version; /* cuDNN's, as 90600 for 9.6.0 */
    char why[512];
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
    if (cudnn_ws_budget(s->why, sizeof s->why) < 0) {
        s->ready = -1;
        return s;
    }
    cuda_cudnn_setup_env();
    cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(im->stream, &cap) != cudaSuccess ||
        cap != cudaStreamCaptureStatusNone) { /* the handle is made outside a capture */
        (void)cudaGetLastError();
        snprintf(s->why, sizeof s->why, "cuDNN is set up outside a CUDA graph capture, and "
                                        "this call is the first to ask for it");
        return s; /* ready 0: asked again by the next call */
    }
    try {
        size_t v = fe::detail::get_backend_version();
        s->version = v;
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

typedef std::shared_ptr<fe::graph::Tensor_attributes> cudnn_t;

/* An index tensor of the graph: n entries, int32 or int64. */
static cudnn_t cudnn_index(fe::graph::Graph &g, const char *name, int uid, int64_t n, int wide)
{
    return g.tensor(fe::graph::Tensor_attributes()
                        .set_name(name)
                        .set_uid(uid)
                        .set_dim({n, 1, 1, 1})
                        .set_stride({1, 1, 1, 1})
                        .set_data_type(wide ? fe::DataType_t::INT64 : fe::DataType_t::INT32));
}

/* Tensor uid of key k's graph, t (an input the graph makes now when t is
 * NULL; an output of its node), as cudnn_layout lays it out: its uid,
 * dims and strides, the stats fp32, and for packed documents its ragged
 * offsets (a tensor of their own, uid U_OFF + uid - U_Q). */
static cudnn_t cudnn_tensor(fe::graph::Graph &g, const cudnn_key &k, int uid, cudnn_t t)
{
    int64_t d[4], st[4];
    int64_t mult = cudnn_layout(k, uid, d, st);
    const char *name = cudnn_names[uid - U_Q];
    if (!t)
        t = g.tensor(fe::graph::Tensor_attributes().set_name(name));
    t->set_uid(uid).set_dim({d[0], d[1], d[2], d[3]}).set_stride({st[0], st[1], st[2], st[3]});
    if (uid == U_STATS)
        t->set_data_type(fe::DataType_t::FLOAT);
    if (mult) {
        char off[16];
        snprintf(off, sizeof off, "offsets_%s", name);
        t->set_ragged_offset(cudnn_index(g, off, U_OFF + uid - U_Q, k.C + 1, 1));
    }
    return t;
}

/* The graph of key k: attention forward (O and the stats) or backward (dQ,
 * dK, dV); for a GPU of compute capability sm (0: the current device's).
 * Packed documents: C sequences of at most T tokens, each of its own
 * length (the padding mask), causal within itself. */
static std::shared_ptr<fe::graph::Graph> cudnn_graph(const cudnn_key &k, int sm)
{
    auto g = std::make_shared<fe::graph::Graph>();
    if (sm > 0)
        g->set_sm_version(sm);
    g->set_io_data_type(fe::DataType_t::BFLOAT16)
        .set_intermediate_data_type(fe::DataType_t::FLOAT)
        .set_compute_data_type(fe::DataType_t::FLOAT);
    float scale = 1.0f / sqrtf((float)k.hd);
    auto Q = cudnn_tensor(*g, k, U_Q, nullptr);
    auto K = cudnn_tensor(*g, k, U_K, nullptr);
    auto V = cudnn_tensor(*g, k, U_V, nullptr);
    cudnn_t sq, skv;
    if (k.C) {
        sq = cudnn_index(*g, "seq_len_q", U_SEQ_Q, k.C, 0);
        skv = cudnn_index(*g, "seq_len_kv", U_SEQ_KV, k.C, 0);
    }
    if (!k.bwd) {
        auto o = fe::graph::SDPA_attributes()
                     .set_name("attention")
                     .set_generate_stats(true)
                     .set_attn_scale(scale)
                     .set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT)
                     .set_diagonal_band_right_bound(0);
        if (k.C)
            o.set_padding_mask(true).set_seq_len_q(sq).set_seq_len_kv(skv);
        auto [O, S] = g->sdpa(Q, K, V, o);
        cudnn_tensor(*g, k, U_O, O)->set_output(true);
        cudnn_tensor(*g, k, U_STATS, S)->set_output(true);
        return g;
    }
    auto O = cudnn_tensor(*g, k, U_O, nullptr);
    auto dO = cudnn_tensor(*g, k, U_DO, nullptr);
    auto S = cudnn_tensor(*g, k, U_STATS, nullptr);
    auto o = fe::graph::SDPA_backward_attributes()
                 .set_name("attention_backward")
                 .set_attn_scale(scale)
                 .set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT)
                 .set_diagonal_band_right_bound(0)
                 .set_deterministic_algorithm(k.det != 0);
    if (k.C) /* the workspace sized by the tokens, not C x T */
        o.set_padding_mask(true)
            .set_seq_len_q(sq)
            .set_seq_len_kv(skv)
            .set_max_total_seq_len_q((int64_t)k.B * k.T)
            .set_max_total_seq_len_kv((int64_t)k.B * k.T);
    auto [dQ, dK, dV] = g->sdpa_backward(Q, K, V, O, dO, S, o);
    cudnn_tensor(*g, k, U_DQ, dQ)->set_output(true);
    cudnn_tensor(*g, k, U_DK, dK)->set_output(true);
    cudnn_tensor(*g, k, U_DV, dV)->set_output(true);
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
        fe::error_t built = g->build(s->h, {fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK});
        fe::error_t r = built.is_good() ? g->get_workspace_size(ws) : built;
        if (!r.is_good()) {
            snprintf(s->why, sizeof s->why, "cuDNN refused the %s graph (B %d, T %d, heads %d/%d, "
                     "head dim %d, documents %d): %s", k.bwd ? "backward" : "forward", k.B, k.T,
                     k.nh, k.nkv, k.hd, k.C, r.get_message().c_str());
            return NULL;
        }
        char over[384];
        if (cuda_cudnn_workspace_allowed((long long)ws, over, sizeof over) != 1) {
            snprintf(s->why, sizeof s->why, "the %s graph (B %d, T %d, heads %d/%d, head dim "
                     "%d, documents %d) is not run: %s", k.bwd ? "backward" : "forward", k.B,
                     k.T, k.nh, k.nkv, k.hd, k.C, over);
            return NULL;
        }
        e->g = g;
        e->ws = ws;
        double dt = sp_now() - t0;
        if (dt > 1.0) /* a one-time cost worth a line: engines compiled at run time */
            fprintf(stderr, "spotune: cuDNN built its attention %s graph (B %d, T %d, heads "
                            "%d/%d, head dim %d, documents %d) in %.1f s, once for this shape\n",
                    k.bwd ? "backward" : "forward", k.B, k.T, k.nh, k.nkv, k.hd, k.C, dt);
    } catch (const std::exception &x) {
        snprintf(s->why, sizeof s->why, "cuDNN graph: %s", x.what());
        return NULL;
    }
    return e;
}

/* Runs the graph of key k on the pointers of its uids (packed documents:
 * with the ragged arguments computed first from the device table, and the
 * stats moved between lse and their token-major place); 1 done, 0 not
 * (the reason printed once), -1 failed (the op's error set). */
static int cudnn_run(backend_t *be, const cudnn_key &k, std::unordered_map<int64_t, void *> &ptrs,
                     const int *table, float *lse)
{
    cudnn_state *s = cudnn_get(be);
    if (s->ready <= 0) {
        say_once(s->why);
        return 0;
    }
    if (k.C && s->version < 90600) {
        snprintf(s->why, sizeof s->why, "cuDNN %zu is older than 9.6, which packed documents "
                 "need (64-bit ragged offsets, ragged stats)", s->version);
        say_once(s->why);
        return 0;
    }
    cudnn_entry *e = cudnn_plan(be, s, k);
    if (!e) {
        say_once(s->why);
        return 0;
    }
    size_t wsb = align256((size_t)e->ws), extra = k.C ? ragged_bytes(k) : 0;
    char *ws = NULL;
    if (wsb + extra > 0 && !(ws = (char *)cuda_scratch(be, wsb + extra)))
        return -1;
    float *st = NULL;
    if (k.C) {
        int *seqlen;
        long long *off;
        if (ragged_args(be, k, table, ws + wsb, &seqlen, &off, &st) ||
            (k.bwd && stats_move(be, lse, st, k.B, k.T, k.nh, 0)))
            return -1;
        ptrs[U_STATS] = st;
        ptrs[U_SEQ_Q] = seqlen;
        ptrs[U_SEQ_KV] = seqlen;
        const int uids[] = {U_Q, U_K, U_V, U_O, U_STATS, U_DO, U_DQ, U_DK, U_DV};
        for (int uid : uids)
            if (ptrs.count(uid))
                ptrs[U_OFF + uid - U_Q] = off + (size_t)ragged_array(uid) * (k.C + 1);
    }
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
    if (k.C && !k.bwd && stats_move(be, lse, st, k.B, k.T, k.nh, 1))
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
    int C = doc_cap(seg, B, T);
    if (!cudnn_shape_fits(q.dt, hd, p, 5, lds, 3, C))
        return 0;
    cudnn_key key = {0, B, T, nh, nkv, hd, q_ld, kv_ld, nh * hd, 0, 0, 0, C};
    std::unordered_map<int64_t, void *> ptrs = {
        {U_Q, q.p}, {U_K, k.p}, {U_V, v.p}, {U_O, out.p}, {U_STATS, lse.p}};
    return cudnn_run(be, key, ptrs, doc_table_of(seg, B, T), (float *)lse.p);
}

extern "C" int cuda_cudnn_attention_backward(backend_t *be, tensor_t dq, tensor_t dk, tensor_t dv,
                                             tensor_t dout, tensor_t out, tensor_t lse,
                                             tensor_t q, tensor_t k, tensor_t v, tensor_t seg,
                                             int B, int T, int nh, int nkv, int hd, int q_ld,
                                             int kv_ld, int dq_ld, int dkv_ld)
{
    const void *p[] = {q.p, k.p, v.p, out.p, dout.p, dq.p, dk.p, dv.p, lse.p};
    const int lds[] = {q_ld, kv_ld, nh * hd, dq_ld, dkv_ld};
    int C = doc_cap(seg, B, T);
    if (!cudnn_shape_fits(q.dt, hd, p, 9, lds, 5, C))
        return 0;
    cudnn_key key = {1,     B,      T,          nh, nkv, hd, q_ld, kv_ld, nh * hd, dq_ld, dkv_ld,
                     cudnn_deterministic(), C};
    std::unordered_map<int64_t, void *> ptrs = {
        {U_Q, q.p},     {U_K, k.p},       {U_V, v.p},   {U_O, out.p},  {U_DO, dout.p},
        {U_STATS, lse.p}, {U_DQ, dq.p}, {U_DK, dk.p}, {U_DV, dv.p}};
    return cudnn_run(be, key, ptrs, doc_table_of(seg, B, T), (float *)lse.p);
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
 * loaded for its version alone; C > 0: packed documents, a table of
 * capacity C. 1 valid; 0 not, or cuDNN absent, with why. For the tests
 * (tests/test_cudnn_graphs.c), where no GPU may be. */
extern "C" int cuda_cudnn_validate(int sm, int bwd, int B, int T, int nh, int nkv, int hd,
                                   int q_ld, int kv_ld, int dq_ld, int dkv_ld, int C, char *why,
                                   size_t n)
{
    void *lib = cudnn_library(why, n);
    if (!lib)
        return 0;
    fe::cudnn_dlhandle = lib;
    cudnn_key k = {bwd, B, T, nh, nkv, hd, q_ld, kv_ld, nh * hd, dq_ld, dkv_ld, 1, C};
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
    for (int i = 0; i < CUDNN_CACHE; i++) /* the plans before the handle they were built on */
        s->e[i].g.reset();
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
                                   int q_ld, int kv_ld, int dq_ld, int dkv_ld, int C, char *why,
                                   size_t n)
{
    (void)sm, (void)bwd, (void)B, (void)T, (void)nh, (void)nkv, (void)hd, (void)q_ld, (void)kv_ld;
    (void)dq_ld, (void)dkv_ld, (void)C;
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
