/* kernels/backend_check.h — internal to kernels/: how backend_ops.c and
 * backend_matmul.c check an op's arguments before the backend runs it (a
 * refused call is recorded with be_fail as "OP: WHAT" at the caller's
 * file:line and goes no further). */
#ifndef SPOTUNE_BACKEND_CHECK_H
#define SPOTUNE_BACKEND_CHECK_H

#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>

#include "backend_trace.h"

/* One call being checked: the first bad argument is reported, the others
 * are not looked at. */
typedef struct call {
    backend_t *be;
    const char *op, *file;
    int line;
    int bad;
} call;

static inline call begin(backend_t *be, const char *op, const char *file, int line)
{
    call c = {be, op, file, line, 0};
    if (be->prof)
        be_prof_op(be, op);
    return c;
}

static inline void refuse(call *c, const char *fmt, ...) SP_PRINTF(2, 3);
static inline void refuse(call *c, const char *fmt, ...)
{
    if (c->bad)
        return;
    c->bad = 1;
    char what[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    be_fail(c->be, c->file, c->line, "%s: %s", c->op, what);
}

/* A size argument. */
static inline void size_arg(call *c, const char *name, int v)
{
    if (!c->bad && v < 0)
        refuse(c, "%s = %d is negative", name, v);
}

/* a * b, or SIZE_MAX when that overflows (no tensor holds that many) */
static inline size_t mul(size_t a, size_t b)
{
    return a && b > SIZE_MAX / a ? SIZE_MAX : a * b;
}

static inline size_t mul3(size_t a, size_t b, size_t c)
{
    return mul(mul(a, b), c);
}

static inline size_t mul4(size_t a, size_t b, size_t c, size_t d)
{
    return mul(mul(a, b), mul(c, d));
}

/* What dtypes a tensor argument takes. */
typedef enum { TAKES_FLOAT, TAKES_F32, TAKES_I32, TAKES_U8 } takes_t;

static inline int float_dtype(dtype_t dt)
{
    return dt == DT_F32 || dt == DT_BF16 || dt == DT_F16;
}

/* A tensor argument of which the op touches need elements (shape: how the
 * size arguments make need, for the message). */
static inline void tensor_arg(call *c, const char *name, tensor_t t, size_t need, const char *shape,
                       takes_t takes)
{
    if (c->bad)
        return;
    if (!t.p && need > 0) {
        refuse(c, "%s is not allocated", name);
        return;
    }
    if (t.n < need) {
        refuse(c, "%s has %zu elements, %s = %zu", name, t.n, shape, need);
        return;
    }
    switch (takes) {
    case TAKES_FLOAT:
        if (t.dt == DT_F32 || t.dt == c->be->act_dt)
            return;
        if (!float_dtype(t.dt))
            refuse(c, "%s has dtype %s, not a float dtype", name, dtype_name(t.dt));
        else if (c->be->act_dt == DT_F32)
            refuse(c, "%s has dtype %s; this backend computes in F32 only", name,
                   dtype_name(t.dt));
        else
            refuse(c, "%s has dtype %s; this backend computes in F32 and %s", name,
                   dtype_name(t.dt), dtype_name(c->be->act_dt));
        return;
    case TAKES_F32:
        if (t.dt != DT_F32)
            refuse(c, "%s has dtype %s, takes F32", name, dtype_name(t.dt));
        return;
    case TAKES_I32:
        if (t.dt != DT_I32)
            refuse(c, "%s has dtype %s, takes I32", name, dtype_name(t.dt));
        return;
    case TAKES_U8:
        if (t.dt != DT_U8)
            refuse(c, "%s has dtype %s, takes U8", name, dtype_name(t.dt));
        return;
    }
}

/* An argument that may be absent (p == NULL: the op skips it). */
static inline void optional_arg(call *c, const char *name, tensor_t t, size_t need, const char *shape,
                         takes_t takes)
{
    if (t.p)
        tensor_arg(c, name, t, need, shape, takes);
}

/* A double in device memory: F32 [2], 8-byte aligned. */
static inline void sum_arg(call *c, const char *name, tensor_t t)
{
    tensor_arg(c, name, t, 2, "2 (a double)", TAKES_F32);
    if (!c->bad && (uintptr_t)t.p % 8)
        refuse(c, "%s is not 8-byte aligned", name);
}

/* Tensors that must share one dtype (names: theirs, for the message). */
static inline void same_dtype(call *c, const char *const *names, const tensor_t *ts, int n,
                       const char *group)
{
    for (int i = 1; i < n && !c->bad; i++)
        if (ts[i].dt != ts[0].dt)
            refuse(c, "%s is %s and %s is %s: %s share one dtype", names[0],
                   dtype_name(ts[0].dt), names[i], dtype_name(ts[i].dt), group);
}

/* elements a [rows, ld] matrix's first cols columns span */
static inline size_t span2d(size_t rows, size_t cols, size_t ld)
{
    size_t head = rows && cols ? mul(rows - 1, ld) : 0;
    return !rows || !cols ? 0 : head > SIZE_MAX - cols ? SIZE_MAX : head + cols;
}

#endif
