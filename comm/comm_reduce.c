/* comm/comm_reduce.c — the local, fixed-order reduction behind every host
 * all-reduce and reduce-scatter: k blocks (one per rank, in rank order)
 * folded into one, left to right. Determinism of the host collectives rests
 * on this order alone. Integer sums wrap (computed unsigned, no UB). */
#include "comm_internal.h"

/* NaN-propagating max/min: a NaN on any rank survives, whatever its rank. */
#define FMAX(a, b) (((b) > (a) || (b) != (b)) ? (b) : (a))
#define FMIN(a, b) (((b) < (a) || (b) != (b)) ? (b) : (a))
#define IMAX(a, b) ((b) > (a) ? (b) : (a))
#define IMIN(a, b) ((b) < (a) ? (b) : (a))
#define FADD(a, b) ((a) + (b))
#define ADD_I32(a, b) ((int32_t)((uint32_t)(a) + (uint32_t)(b)))
#define ADD_I64(a, b) ((int64_t)((uint64_t)(a) + (uint64_t)(b)))
#define ADD_U8(a, b) ((uint8_t)((a) + (b)))

/* Work in tiles that stay in L1: each tile of dst is read from every block
 * into acc, folded, then written once, so dst may be one of the blocks. */
#define TILE 512

/* The fold of one tile, T the element type, ACC the accumulator type,
 * LOAD/STORE the conversions between them (identity but for bf16). */
#define FOLD_TILE(T, ACC, COMBINE, LOAD, STORE)                                          \
    do {                                                                                 \
        for (size_t i = 0; i < m; i++)                                                   \
            acc[i] = LOAD(((const T *)blk[0])[t + i]);                                   \
        for (int j = 1; j < k; j++) {                                                    \
            const T *b = (const T *)blk[j] + t;                                          \
            for (size_t i = 0; i < m; i++)                                               \
                acc[i] = COMBINE(acc[i], LOAD(b[i]));                                    \
        }                                                                                \
        if (op == COMM_AVG)                                                              \
            for (size_t i = 0; i < m; i++)                                               \
                acc[i] = (ACC)(acc[i] / (ACC)k);                                         \
        for (size_t i = 0; i < m; i++)                                                   \
            ((T *)dst)[t + i] = STORE(acc[i]);                                           \
    } while (0)

#define SAME(x) (x)

/* One function per dtype: the op switch sits outside the element loops so
 * each loop is a plain, vectorisable fold. */
#define DEFINE_FOLD(NAME, T, ACC, ADD, MAX, MIN, LOAD, STORE)                            \
    static void NAME(void *dst, const void *const *blk, size_t n, int k, comm_op op)     \
    {                                                                                    \
        ACC acc[TILE];                                                                   \
        for (size_t t = 0; t < n; t += TILE) {                                           \
            size_t m = n - t < TILE ? n - t : TILE;                                      \
            if (op == COMM_MAX)                                                          \
                FOLD_TILE(T, ACC, MAX, LOAD, STORE);                                     \
            else if (op == COMM_MIN)                                                     \
                FOLD_TILE(T, ACC, MIN, LOAD, STORE);                                     \
            else                                                                         \
                FOLD_TILE(T, ACC, ADD, LOAD, STORE);                                     \
        }                                                                                \
    }

DEFINE_FOLD(fold_f32, float, float, FADD, FMAX, FMIN, SAME, SAME)
DEFINE_FOLD(fold_f64, double, double, FADD, FMAX, FMIN, SAME, SAME)
DEFINE_FOLD(fold_i32, int32_t, int32_t, ADD_I32, IMAX, IMIN, SAME, SAME)
DEFINE_FOLD(fold_i64, int64_t, int64_t, ADD_I64, IMAX, IMIN, SAME, SAME)
DEFINE_FOLD(fold_u8, uint8_t, uint8_t, ADD_U8, IMAX, IMIN, SAME, SAME)
/* bf16 is accumulated in fp32 across the blocks and rounded once. */
DEFINE_FOLD(fold_bf16, uint16_t, float, FADD, FMAX, FMIN, sp_bf16_to_f32, sp_f32_to_bf16)

int comm_reduce_blocks(void *dst, const void *const *blk, size_t n, int k, comm_dtype dt,
                       comm_op op)
{
    if (k < 1 || (unsigned)op > COMM_AVG)
        return -1;
    switch (dt) {
    case COMM_F32: fold_f32(dst, blk, n, k, op); return 0;
    case COMM_F64: fold_f64(dst, blk, n, k, op); return 0;
    case COMM_I32: fold_i32(dst, blk, n, k, op); return 0;
    case COMM_I64: fold_i64(dst, blk, n, k, op); return 0;
    case COMM_U8: fold_u8(dst, blk, n, k, op); return 0;
    case COMM_BF16: fold_bf16(dst, blk, n, k, op); return 0;
    default: return -1;
    }
}

size_t comm_dtype_size(comm_dtype dt)
{
    switch (dt) {
    case COMM_F32: case COMM_I32: return 4;
    case COMM_F64: case COMM_I64: return 8;
    case COMM_U8: return 1;
    case COMM_BF16: return 2;
    default: return 0;
    }
}
