/* kernels/cuda/cuda_cudnn.cuh — what the attention by cuDNN (cuda_cudnn.cu,
 * its graphs and their runs) shares with cuda_cudnn_layout.cu (the layout
 * the graphs declare, the ragged arguments of packed documents computed on
 * the device, and the workspace budget): parts that build and are tested
 * without the cuDNN frontend, on any device, the emulated one included. */
#ifndef SPOTUNE_CUDA_CUDNN_CUH
#define SPOTUNE_CUDA_CUDNN_CUH

#include <stdint.h>

#include "cuda_internal.h"

/* The graphs' tensors by uid; U_OFF + (uid - U_Q): uid's ragged offsets. */
enum { U_Q = 1, U_K, U_V, U_O, U_STATS, U_DO, U_DQ, U_DK, U_DV, U_SEQ_Q, U_SEQ_KV, U_OFF };

/* their names, U_Q to U_DV */
extern const char *const cudnn_names[9];

/* What makes two calls' graphs the same; C: packed documents, the table's
 * capacity (the graph's batch of sequences), 0 for dense rows. */
typedef struct cudnn_key {
    int bwd, B, T, nh, nkv, hd, ldq, ldk, ldo, lddq, lddk, det, C;
} cudnn_key;

/* The ragged offset arrays, one per row stride: R_Q (Q), R_KV (K, V), R_O
 * (O, dO), R_DQ, R_DKV (dK, dV), R_ST (the stats). */
enum { R_Q, R_KV, R_O, R_DQ, R_DKV, R_ST, R_N };

/* seg's document table: its capacity (doc_cap: 0 for dense rows, -1 for
 * packed rows without a table) and its place on the device */
int doc_cap(tensor_t seg, int B, int T);
const int *doc_table_of(tensor_t seg, int B, int T);

/* The ragged offset array of tensor uid (R_*). */
int ragged_array(int uid);
/* Tensor uid's dims and strides in key k's graph; returns its ragged
 * offsets' multiplier, 0 for dense rows. */
int64_t cudnn_layout(const cudnn_key &k, int uid, int64_t dim[4], int64_t st[4]);
size_t align256(size_t x);
/* Device bytes a packed call's ragged arguments take. */
size_t ragged_bytes(const cudnn_key &k);
/* lse [B, nh, T] from the token-major stats st [B T, nh] (to_lse), or st
 * from lse; 0 or -1 (a failed launch, recorded). */
int stats_move(backend_t *be, float *lse, float *st, int B, int T, int nh, int to_lse);
/* A packed call's ragged arguments in buf (ragged_bytes(k)) from the
 * device table: their places in *seqlen, *off, *st; 0 or -1. */
int ragged_args(backend_t *be, const cudnn_key &k, const int *table, char *buf, int **seqlen,
                long long **off, float **st);

#define CUDNN_WS_BUDGET ((long long)512 << 20)
/* The bytes a graph's workspace may take (SPOTUNE_CUDNN_WORKSPACE_BUDGET,
 * or CUDNN_WS_BUDGET); -1 when the variable is malformed, with why. */
long long cudnn_ws_budget(char *why, size_t n);

#endif
