/* kernels/backend_trace.h — internal to kernels/: how the checked ops
 * (backend_ops.c) feed a launch trace (backend_trace.c, the API in
 * backend.h). Each op that runs on the device dispatches through
 * BE_DISPATCH, which, while a trace is taken, adds the op and each argument
 * to the digest (and to the recorded op list) before running it, or skips
 * running it in a dry trace or a recording. */
#ifndef SPOTUNE_BACKEND_TRACE_H
#define SPOTUNE_BACKEND_TRACE_H

#include "backend.h"

/* One id per device op; the recorded op list replays by it. */
enum be_op_id {
    OP_zero = 1,
    OP_copy,
    OP_copy2d,
    OP_matmul,
    OP_matmul_cd,
    OP_rmsnorm_forward,
    OP_rmsnorm_backward,
    OP_rope,
    OP_attention_forward,
    OP_attention_backward,
    OP_swiglu_forward,
    OP_swiglu_backward,
    OP_embedding_forward,
    OP_embedding_backward,
    OP_cross_entropy,
    OP_add,
    OP_add_bias,
    OP_bias_backward,
    OP_weight_norm,
    OP_col_scale,
    OP_col_dot,
    OP_dequant_nf4,
    OP_dropout,
    OP_adamw,
    OP_sumsq_into,
    OP_sum_add,
    OP_fill_uniform,
    OP_fill_normal,
    OP_quantize_nf4,
    OP_matmul_batched,
    OP_COUNT
};

/* the argument kinds a device op takes, each as words of the trace */
void be_trace_op(backend_t *be, int op);
void be_trace_tensor(backend_t *be, tensor_t t);
void be_trace_int(backend_t *be, int v);
void be_trace_float(backend_t *be, float v);
void be_trace_u64(backend_t *be, unsigned long v);
void be_trace_u64ll(backend_t *be, unsigned long long v);
void be_trace_adamw(backend_t *be, const adamw_args *a);
/* 1 when the traced op is to run (no trace, or a trace that runs ops) */
int be_trace_runs(backend_t *be);
/* A call a captured span cannot hold (what: "h2d", ...), counted: 1 when
 * the call is to run, 0 in a dry trace (backend.h, be_trace). */
int be_trace_barrier(backend_t *be, const char *what, const char *file, int line);

#define BE_TR_ARG(be, x)                                                                          \
    _Generic((x), tensor_t: be_trace_tensor, int: be_trace_int, float: be_trace_float,            \
             unsigned long: be_trace_u64, unsigned long long: be_trace_u64ll,                     \
             const adamw_args *: be_trace_adamw)(be, x)

#define BE_TR_N(...)                                                                              \
    BE_TR_N_(__VA_ARGS__, 20, 19, 18, 17, 16, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0)
#define BE_TR_N_(a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17, a18, \
                 a19, a20, N, ...)                                                                \
    N
#define BE_TR_CAT(a, b) BE_TR_CAT_(a, b)
#define BE_TR_CAT_(a, b) a##b
#define BE_TR_1(be, a) BE_TR_ARG(be, a)
#define BE_TR_2(be, a, ...) (BE_TR_ARG(be, a), BE_TR_1(be, __VA_ARGS__))
#define BE_TR_3(be, a, ...) (BE_TR_ARG(be, a), BE_TR_2(be, __VA_ARGS__))
#define BE_TR_4(be, a, ...) (BE_TR_ARG(be, a), BE_TR_3(be, __VA_ARGS__))
#define BE_TR_5(be, a, ...) (BE_TR_ARG(be, a), BE_TR_4(be, __VA_ARGS__))
#define BE_TR_6(be, a, ...) (BE_TR_ARG(be, a), BE_TR_5(be, __VA_ARGS__))
#define BE_TR_7(be, a, ...) (BE_TR_ARG(be, a), BE_TR_6(be, __VA_ARGS__))
#define BE_TR_8(be, a, ...) (BE_TR_ARG(be, a), BE_TR_7(be, __VA_ARGS__))
#define BE_TR_9(be, a, ...) (BE_TR_ARG(be, a), BE_TR_8(be, __VA_ARGS__))
#define BE_TR_10(be, a, ...) (BE_TR_ARG(be, a), BE_TR_9(be, __VA_ARGS__))
#define BE_TR_11(be, a, ...) (BE_TR_ARG(be, a), BE_TR_10(be, __VA_ARGS__))
#define BE_TR_12(be, a, ...) (BE_TR_ARG(be, a), BE_TR_11(be, __VA_ARGS__))
#define BE_TR_13(be, a, ...) (BE_TR_ARG(be, a), BE_TR_12(be, __VA_ARGS__))
#define BE_TR_14(be, a, ...) (BE_TR_ARG(be, a), BE_TR_13(be, __VA_ARGS__))
#define BE_TR_15(be, a, ...) (BE_TR_ARG(be, a), BE_TR_14(be, __VA_ARGS__))
#define BE_TR_16(be, a, ...) (BE_TR_ARG(be, a), BE_TR_15(be, __VA_ARGS__))
#define BE_TR_17(be, a, ...) (BE_TR_ARG(be, a), BE_TR_16(be, __VA_ARGS__))
#define BE_TR_18(be, a, ...) (BE_TR_ARG(be, a), BE_TR_17(be, __VA_ARGS__))
#define BE_TR_19(be, a, ...) (BE_TR_ARG(be, a), BE_TR_18(be, __VA_ARGS__))
#define BE_TR_20(be, a, ...) (BE_TR_ARG(be, a), BE_TR_19(be, __VA_ARGS__))
#define BE_TR_ALL(be, ...) BE_TR_CAT(BE_TR_, BE_TR_N(__VA_ARGS__))(be, __VA_ARGS__)

/* Runs be->ops->name(be, args...) unless skip (the call was refused, or
 * has nothing to do) or a trace that does not run ops is being taken;
 * traced unless skipped. The arguments are the op's own, in its order: the
 * recorded list replays them so (backend_trace.c, replay_one). */
#define BE_DISPATCH(skip, be, name, ...)                                                         \
    do {                                                                                          \
        if (!(skip) && (!(be)->trace || (be_trace_op(be, OP_##name), BE_TR_ALL(be, __VA_ARGS__),  \
                                        be_trace_runs(be))))                                      \
            (be)->ops->name((be), __VA_ARGS__);                                                   \
    } while (0)

#endif
