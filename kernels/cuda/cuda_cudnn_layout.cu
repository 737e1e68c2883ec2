/* kernels/cuda/cuda_cudnn_layout.cu — the parts of the attention by cuDNN
 * that need no cuDNN frontend (cuda_cudnn.cuh): the dims, strides and
 * ragged offsets its graphs declare, computed for packed documents on the
 * device from their table (and moved stats), with the tests' hooks that
 * check them on any device (cuda_cudnn_ragged_args, cuda_cudnn_stats_lse);
 * and the workspace budget and the frontend's dP limit (cuda_cudnn.cu's
 * head comment, "Workspace"). Kept apart from the frontend, which the
 * emulated device's build lacks. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_cudnn.cuh"

#define STREAM(be) (CUDA_IMPL(be)->stream)

/* ---- packed documents' table -------------------------------------------------- */

/* seg's document table: its capacity C (seg.n - B T - 1); 0 for dense rows
 * (no seg); -1 for packed rows without a table. */
int doc_cap(tensor_t seg, int B, int T)
{
    size_t bt = (size_t)B * (size_t)T;
    if (!seg.p)
        return 0;
    return seg.n > bt + 1 ? (int)(seg.n - bt - 1) : -1;
}

/* seg's document table on the device (after its B T starts), or NULL. */
const int *doc_table_of(tensor_t seg, int B, int T)
{
    return seg.p ? (const int *)seg.p + (size_t)B * T : NULL;
}

/* ---- the graphs' tensors ------------------------------------------------------ */

extern const char *const cudnn_names[9] = {"Q", "K", "V", "O", "stats", "dO", "dQ", "dK", "dV"};

int ragged_array(int uid)
{
    switch (uid) {
    case U_Q:
        return R_Q;
    case U_K:
    case U_V:
        return R_KV;
    case U_O:
    case U_DO:
        return R_O;
    case U_DQ:
        return R_DQ;
    case U_DK:
    case U_DV:
        return R_DKV;
    default:
        return R_ST;
    }
}

/* Tensor uid's dims and strides in key k's graph; its ragged offsets'
 * multiplier is returned (sequence i's element 0 at table[i] times it),
 * 0 for dense rows. Token rows b T + t of q lie ldq apart, head h at
 * column h hd (the same for the others with theirs); the stats are lse's
 * [B, nh, T] for dense rows, token-major [B T, nh] for packed ones. */
int64_t cudnn_layout(const cudnn_key &k, int uid, int64_t dim[4], int64_t st[4])
{
    int64_t nb = k.C ? k.C : k.B, T = k.T, nh = k.nh, hd = k.hd;
    if (uid == U_STATS) {
        int64_t d[4] = {nb, nh, T, 1}, dense[4] = {nh * T, T, 1, 1}, ragged[4] = {nh * T, 1, nh, 1};
        for (int i = 0; i < 4; i++)
            dim[i] = d[i], st[i] = k.C ? ragged[i] : dense[i];
        return k.C ? nh : 0;
    }
    int kv = uid == U_K || uid == U_V || uid == U_DK || uid == U_DV;
    int64_t ld = uid == U_Q ? k.ldq : uid == U_K || uid == U_V ? k.ldk : uid == U_DQ ? k.lddq
               : uid == U_DK || uid == U_DV ? k.lddk : k.ldo;
    int64_t d[4] = {nb, kv ? k.nkv : nh, T, hd}, s[4] = {T * ld, hd, ld, 1};
    for (int i = 0; i < 4; i++)
        dim[i] = d[i], st[i] = s[i];
    return k.C ? ld : 0;
}

/* The multipliers of the ragged offset arrays. */
typedef struct ragged_mult {
    long long m[R_N];
} ragged_mult;

static ragged_mult ragged_mults(const cudnn_key &k)
{
    static const int rep[R_N] = {U_Q, U_K, U_O, U_DQ, U_DK, U_STATS};
    ragged_mult r;
    int64_t d[4], s[4];
    for (int i = 0; i < R_N; i++)
        r.m[i] = (long long)cudnn_layout(k, rep[i], d, s);
    return r;
}

size_t align256(size_t x)
{
    return (x + 255) & ~(size_t)255;
}

/* Device bytes a packed call's ragged arguments take: the sequence lengths
 * (C int32), the offset arrays (R_N x (C + 1) int64), the token-major
 * stats (B T nh fp32). */
size_t ragged_bytes(const cudnn_key &k)
{
    return align256((size_t)k.C * 4) + align256((size_t)R_N * (k.C + 1) * 8) +
           (size_t)k.B * k.T * k.nh * 4;
}

/* seqlen[i] = table[i + 1] - table[i] (i < C); off[r][i] = table[i] m[r]. */
__global__ void cudnn_ragged_kernel(const int *table, int C, ragged_mult m, int *seqlen,
                                    long long *off)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i > C)
        return;
    long long t = table[i];
    for (int r = 0; r < R_N; r++)
        off[(size_t)r * (C + 1) + i] = t * m.m[r];
    if (i < C)
        seqlen[i] = table[i + 1] - table[i];
}

/* lse [B, nh, T] from the token-major stats st [B T, nh] (to_lse), or
 * st from lse. */
__global__ void cudnn_stats_kernel(float *lse, float *st, int T, int nh, size_t n, int to_lse)
{
    GRID_STRIDE(i, n)
    {
        size_t t = i % (size_t)T, h = (i / (size_t)T) % (size_t)nh, b = i / ((size_t)T * nh);
        size_t j = (b * (size_t)T + t) * (size_t)nh + h;
        if (to_lse)
            lse[i] = st[j];
        else
            st[j] = lse[i];
    }
}

int stats_move(backend_t *be, float *lse, float *st, int B, int T, int nh, int to_lse)
{
    size_t n = (size_t)B * T * nh;
    LAUNCH(cudnn_stats_kernel, cuda_blocks(n), CUDA_BLOCK, 0, STREAM(be))(lse, st, T, nh, n,
                                                                          to_lse);
    return LAUNCHED(be, "cudnn_stats_kernel");
}

/* A packed call's ragged arguments in buf (ragged_bytes(k)), from the
 * device table (seg's tail): their places in *seqlen, *off, *st. */
int ragged_args(backend_t *be, const cudnn_key &k, const int *table, char *buf,
                       int **seqlen, long long **off, float **st)
{
    *seqlen = (int *)buf;
    *off = (long long *)(buf + align256((size_t)k.C * 4));
    *st = (float *)((char *)*off + align256((size_t)R_N * (k.C + 1) * 8));
    unsigned blocks = (unsigned)((k.C + 1 + CUDA_BLOCK - 1) / CUDA_BLOCK);
    LAUNCH(cudnn_ragged_kernel, blocks, CUDA_BLOCK, 0, STREAM(be))(table, k.C, ragged_mults(k),
                                                                   *seqlen, *off);
    return LAUNCHED(be, "cudnn_ragged_kernel");
}

/* For the tests, on any device (the emulated one included): what a
 * packed backward call of this shape gives cuDNN for one of its tensors
 * (by name: "Q", "K", "V", "O", "stats", "dO", "dQ", "dK", "dV"): dims and
 * strides as its graph declares them, the ragged offsets (C + 1, in
 * elements) and the sequence lengths (C) computed on the device from
 * seg's document table. C, or -1 (no table, an unknown name, or a device
 * error, which is then recorded). */
extern "C" int cuda_cudnn_ragged_args(backend_t *be, tensor_t seg, int B, int T, int nh, int nkv,
                                      int hd, int q_ld, int kv_ld, int dq_ld, int dkv_ld,
                                      const char *tensor, long long dim[4], long long stride[4],
                                      long long *off, int *seqlen)
{
    int C = doc_cap(seg, B, T), uid = 0;
    for (int i = 0; i < 9; i++)
        if (strcmp(tensor, cudnn_names[i]) == 0)
            uid = U_Q + i;
    if (C <= 0 || !uid || be->err.code)
        return -1;
    cudnn_key k = {1, B, T, nh, nkv, hd, q_ld, kv_ld, nh * hd, dq_ld, dkv_ld, 1, C};
    int64_t d[4], s[4];
    cudnn_layout(k, uid, d, s);
    for (int i = 0; i < 4; i++)
        dim[i] = (long long)d[i], stride[i] = (long long)s[i];
    char *buf = (char *)cuda_scratch(be, ragged_bytes(k));
    int *sq;
    long long *of;
    float *st;
    if (!buf || ragged_args(be, k, doc_table_of(seg, B, T), buf, &sq, &of, &st))
        return -1;
    cudaStream_t stream = STREAM(be);
    if (CUDA_OK(be, cudaMemcpyAsync(off, of + (size_t)ragged_array(uid) * (C + 1),
                                    sizeof(long long) * (C + 1), cudaMemcpyDeviceToHost, stream)) ||
        CUDA_OK(be, cudaMemcpyAsync(seqlen, sq, sizeof(int) * C, cudaMemcpyDeviceToHost, stream)) ||
        CUDA_OK(be, cudaStreamSynchronize(stream)))
        return -1;
    return C;
}

/* For the tests: lse [B, nh, T] from token-major stats st [B T, nh]
 * (to_lse), or st from lse, as a packed call moves them. */
extern "C" int cuda_cudnn_stats_lse(backend_t *be, tensor_t st, tensor_t lse, int B, int T, int nh,
                                    int to_lse)
{
    return be->err.code ? -1 : stats_move(be, (float *)lse.p, (float *)st.p, B, T, nh, to_lse);
}

/* ---- the workspace budget ------------------------------------------------ */

#define CUDNN_DP_LIMIT_VAR "CUDNN_FRONTEND_ATTN_DP_WORKSPACE_LIMIT"

/* The bytes a graph's workspace may take (SPOTUNE_CUDNN_WORKSPACE_BUDGET,
 * a whole number of bytes above 0, or CUDNN_WS_BUDGET); -1 when the
 * variable is malformed, with why. */
long long cudnn_ws_budget(char *why, size_t n)
{
    const char *e = getenv("SPOTUNE_CUDNN_WORKSPACE_BUDGET");
    if (!e || !*e)
        return CUDNN_WS_BUDGET;
    char *end = NULL;
    errno = 0;
    long long v = strtoll(e, &end, 10);
    if (errno || end == e || *end || v <= 0) {
        snprintf(why, n, "SPOTUNE_CUDNN_WORKSPACE_BUDGET=%.40s is not a number of bytes above 0",
                 e);
        return -1;
    }
    return v;
}

/* Whether a graph asking for ws bytes of workspace may run: 1 yes; 0 over
 * the budget, -1 the budget malformed, each with why. For the tests too
 * (tests/test_cudnn_graphs.c). */
extern "C" int cuda_cudnn_workspace_allowed(long long ws, char *why, size_t n)
{
    long long budget = cudnn_ws_budget(why, n);
    if (budget < 0)
        return -1;
    if (ws <= budget)
        return 1;
    snprintf(why, n, "its workspace would be %.2f GiB, over the %.2f GiB budget "
             "(SPOTUNE_CUDNN_WORKSPACE_BUDGET, bytes; the deterministic backward keeps dP, B x "
             "heads x T^2 x 2 bytes, where cuDNN before 9.25 or a GPU before Hopper cannot "
             "accumulate dQ in order)", (double)ws / (1 << 30), (double)budget / (1 << 30));
    return 0;
}

extern "C" size_t cuda_cudnn_workspace_budget(void)
{
    char why[160];
    long long b = cudnn_ws_budget(why, sizeof why);
    return (size_t)(b > 0 ? b : CUDNN_WS_BUDGET);
}

/* Tells the frontend the dP workspace it may plan for the deterministic
 * backward (CUDNN_DP_LIMIT_VAR: 7/8 of the budget, leaving the rest of
 * the graph's workspace room), unless that variable is set already or
 * the budget is malformed (cudnn_get says so then). Called as the backend
 * is created, before the trainer starts threads that read the environment
 * (libcurl's), and again before the first graph is built. */
extern "C" void cuda_cudnn_setup_env(void)
{
    char why[160], v[32];
    long long budget = cudnn_ws_budget(why, sizeof why);
    const char *set = getenv(CUDNN_DP_LIMIT_VAR);
    if (budget < 0 || (set && *set))
        return;
    snprintf(v, sizeof v, "%lld", budget - budget / 8);
    setenv(CUDNN_DP_LIMIT_VAR, v, 0);
}

