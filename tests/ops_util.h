/* tests/ops_util.h — what test_ops.c and test_ops_attention.c share
 * (tests/ops_util.c): the suite's backend (be: "cpu", two threads; a test
 * may replace it) with every tensor a test allocates freed by the fini, the
 * random inputs (a fixed stream: each test process starts from seed 42), and
 * the comparisons against a double-precision reference.
 * Tolerances: forward 1e-5 relative to the largest output (f32 storage
 * with double accumulation); backward 1e-4 relative to the largest gradient
 * (the difference quotient in double has error ~1e-9). */
#ifndef SPOTUNE_TEST_OPS_UTIL_H
#define SPOTUNE_TEST_OPS_UTIL_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/backend.h"

#define FWD_TOL 1e-5
#define BWD_TOL 1e-4

extern backend_t *be;
extern uint64_t g_seed; /* the seed of the next rnd() */

/* The suite's init and fini. */
void ops_setup(void);
void ops_teardown(void);
/* A tensor of n elements on be, freed by the fini; none: the absent tensor. */
tensor_t talloc(dtype_t dt, size_t n);
tensor_t no_tensor(void);
/* n floats uniform in [-scale, scale] (malloc'd), the next seed each call. */
float *rnd(size_t n, float scale);
/* An F32 tensor holding host (NULL: zeros), and a tensor's values (malloc'd). */
tensor_t dev(const float *host, size_t n);
float *host(tensor_t t);
/* max |got - want| / max |want| */
double rel_err(const float *got, const double *want, size_t n);
/* A double copy (malloc'd); <a, R> in double, for finite differences. */
double *to_d(const float *f, size_t n);
double dot_d(const double *a, const float *R, size_t n);

#endif
