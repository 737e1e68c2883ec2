/* tests/attn_columns.h — the trainer's fused q/k/v layout for the attention
 * tests (test_ops_attention.c, test_cuda_attention.c): q, k, v (or their
 * gradients) as the column blocks of one [rows, N] matrix, N >= qd + 2 kvd,
 * the columns past them padding. */
#ifndef SPOTUNE_TEST_ATTN_COLUMNS_H
#define SPOTUNE_TEST_ATTN_COLUMNS_H

#include <string.h>

/* m [rows, N]: every element pad, then q [rows, qd], k and v [rows, kvd]
 * into its column blocks */
static inline void attn_to_columns(float *m, int N, const float *q, const float *k,
                                   const float *v, int rows, int qd, int kvd, float pad)
{
    for (size_t i = 0; i < (size_t)rows * (size_t)N; i++)
        m[i] = pad;
    for (int r = 0; r < rows; r++) {
        memcpy(m + (size_t)r * N, q + (size_t)r * qd, sizeof(float) * (size_t)qd);
        memcpy(m + (size_t)r * N + qd, k + (size_t)r * kvd, sizeof(float) * (size_t)kvd);
        memcpy(m + (size_t)r * N + qd + kvd, v + (size_t)r * kvd, sizeof(float) * (size_t)kvd);
    }
}

/* The column blocks of m back into q, k, v; 1 when every padding column
 * still holds pad. */
static inline int attn_from_columns(const float *m, int N, float *q, float *k, float *v,
                                    int rows, int qd, int kvd, float pad)
{
    int ok = 1;
    for (int r = 0; r < rows; r++) {
        const float *row = m + (size_t)r * N;
        memcpy(q + (size_t)r * qd, row, sizeof(float) * (size_t)qd);
        memcpy(k + (size_t)r * kvd, row + qd, sizeof(float) * (size_t)kvd);
        memcpy(v + (size_t)r * kvd, row + qd + kvd, sizeof(float) * (size_t)kvd);
        for (int c = qd + 2 * kvd; c < N; c++)
            ok &= row[c] == pad;
    }
    return ok;
}

#endif
