/* tests/cuda_attention_util.h — what the CUDA attention tests
 * (test_cuda_attention.c) share: rows of packed documents, a shape's
 * random inputs, and one forward + backward on the suite's GPU backend
 * with its outputs brought back. */
#ifndef SPOTUNE_TEST_CUDA_ATTENTION_UTIL_H
#define SPOTUNE_TEST_CUDA_ATTENTION_UTIL_H

#include <criterion/criterion.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "base/base.h"
#include "cuda_ops_util.h"
#include "kernels/backend.h"

/* Rows of packed documents: document lengths drawn from 1..max_len, so
 * starts fall anywhere (inside and across the 512-row blocks); seg[i] the
 * row index of i's document start, pos[i] its position in the document. */
static inline void packed_rows(int B, int T, int max_len, int32_t *seg, int32_t *pos)
{
    uint64_t draw = 0;
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T;) {
            int len = 1 + (int)(sp_rng_u64(0x5e9, draw++) % (uint64_t)max_len);
            for (int i = t; i < t + len && i < T; i++)
                seg[b * T + i] = t, pos[b * T + i] = i - t;
            t += len;
        }
}

/* A shape's random inputs: q, k, v, dout (the scales every attention test
 * here draws with, in this order), and with max_doc rows of packed
 * documents of 1..max_doc tokens (seg; NULL without). */
typedef struct attn_in {
    float *q, *k, *v, *dout;
    int32_t *seg, *pos;
} attn_in;

static inline attn_in attn_inputs(int B, int T, int nh, int nkv, int hd, int max_doc)
{
    size_t nq = (size_t)B * T * nh * hd, nk = (size_t)B * T * nkv * hd;
    attn_in in;
    in.q = rnd(nq, 1.5f), in.k = rnd(nk, 1.5f), in.v = rnd(nk, 1.0f), in.dout = rnd(nq, 1.0f);
    in.seg = in.pos = NULL;
    if (max_doc) {
        in.seg = malloc(sizeof(int32_t) * (size_t)B * T);
        in.pos = malloc(sizeof(int32_t) * (size_t)B * T);
        cr_assert(in.seg && in.pos);
        packed_rows(B, T, max_doc, in.seg, in.pos);
    }
    return in;
}

static inline void attn_inputs_free(attn_in *in)
{
    free(in->q), free(in->k), free(in->v), free(in->dout), free(in->seg), free(in->pos);
}

/* out, lse, dq, dk, dv of one forward + backward on the GPU (host copies),
 * and the device memory the backward added (its scratch's growth). */
typedef struct gpu_attn {
    float *o[5];
    size_t grew;
} gpu_attn;

/* seg_n: seg's entries (B T, or with the document table after them,
 * packed_doc_table, as the trainer stages them for be->doc_table). */
static inline gpu_attn gpu_attention_n(const float *q, const float *k, const float *v,
                                       const float *dout, const int32_t *seg, size_t seg_n, int B,
                                       int T, int nh, int nkv, int hd)
{
    size_t nq = (size_t)B * T * nh * hd, nk = (size_t)B * T * nkv * hd, nl = (size_t)B * nh * T;
    dtype_t a = gpu->act_dt;
    tensor_t gq = up(gpu, a, q, nq), gk = up(gpu, a, k, nk), gv = up(gpu, a, v, nk);
    tensor_t go = up(gpu, a, NULL, nq), gl = up(gpu, DT_F32, NULL, nl), gdo = up(gpu, a, dout, nq);
    tensor_t gdq = up(gpu, a, NULL, nq), gdk = up(gpu, a, NULL, nk), gdv = up(gpu, a, NULL, nk);
    tensor_t gsg = {0};
    if (seg) {
        gsg = be_alloc(gpu, DT_I32, seg_n);
        cr_assert(gsg.p);
        be_upload(gpu, gsg, seg, DT_I32);
    }
    be_attention_forward(gpu, go, gl, gq, gk, gv, gsg, B, T, nh, nkv, hd);
    gpu_ok();
    size_t before = gpu->bytes_in_use;
    be_attention_backward(gpu, gdq, gdk, gdv, gdo, go, gl, gq, gk, gv, gsg, B, T, nh, nkv, hd);
    gpu_ok();
    gpu_attn r;
    r.grew = gpu->bytes_in_use - before;
    tensor_t outs[5] = {go, gl, gdq, gdk, gdv};
    for (int i = 0; i < 5; i++)
        r.o[i] = down(gpu, outs[i]);
    tensor_t gs[] = {gq, gk, gv, go, gl, gdo, gdq, gdk, gdv};
    for (int i = 0; i < 9; i++)
        drop(gpu, &gs[i]);
    if (seg)
        drop(gpu, &gsg);
    return r;
}

static inline gpu_attn gpu_attention(const float *q, const float *k, const float *v,
                                     const float *dout, const int32_t *seg, int B, int T, int nh,
                                     int nkv, int hd)
{
    return gpu_attention_n(q, k, v, dout, seg, (size_t)B * T, B, T, nh, nkv, hd);
}

/* seg's rows followed by their document table (packed_doc_table), as the
 * trainer stages them for a backend with doc_table (malloc'd; *n entries). */
static inline int32_t *seg_with_table(const int32_t *seg, int B, int T, size_t *n)
{
    size_t bt = (size_t)B * T;
    int32_t *s = (int32_t *)malloc(sizeof *s * (2 * bt + 1));
    cr_assert(s);
    memcpy(s, seg, sizeof *s * bt);
    int C = packed_doc_table(seg, B, T, s + bt);
    cr_assert(C > 0, "packed_doc_table refused rows of whole documents");
    *n = bt + (size_t)C + 1;
    return s;
}

/* Defined in test_cuda_attention.c, for the suite's other file: the
 * GPU's attention against the CPU's (forward and backward, TOL_BF16 and
 * TOL_F32; chunks: also chunk by chunk), and gpu_attention with q, k, v and
 * their gradients as the column blocks of wider matrices (pad columns
 * besides; *pad_ok 0 when one changed). */
void check_attention(int B, int T, int nh, int nkv, int hd);
void check_attention_at(int B, int T, int nh, int nkv, int hd, int chunks);
/* check_attention_at's comparison of packed rows, seg (seg_n entries on the
 * GPU: with a document table after the B T starts, or not) */
void check_attention_packed(int B, int T, int nh, int nkv, int hd, int chunks, const int32_t *seg,
                            size_t seg_n);
gpu_attn gpu_attention_strided(const float *q, const float *k, const float *v, const float *dout,
                               const int32_t *seg, int B, int T, int nh, int nkv, int hd, int pad,
                               int *pad_ok);

#endif
