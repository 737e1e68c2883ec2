/* tests/op_checks.h — malformed op calls, made the same way on any backend
 * (tests/op_checks.c): tests/test_ops.c runs them on cpu and cpu-ref,
 * tests/test_cuda_ops.c on cuda. Each refused call must leave the sticky
 * error "<backend> backend: OP: WHAT (.../op_checks.c:LINE)" with the same
 * OP: WHAT on every backend, and change no memory. */
#ifndef SPOTUNE_TEST_OP_CHECKS_H
#define SPOTUNE_TEST_OP_CHECKS_H

#include "kernels/backend.h"

/* Every op, every tensor argument one element short of what the sizes need,
 * unallocated, of a dtype the op does not take; every size argument
 * negative; the rules of single ops (attention shapes, rope's even hd,
 * dropout's p, copy's sizes and dtypes, ...). The valid call of each op
 * first: it must succeed and write nothing outside its tensors. Criterion
 * expectations inside; returns the number of malformed calls checked. */
int op_checks_run(backend_t *be);

/* The sticky error of be is "<backend> backend: <want> (<file>:LINE)", file
 * the source that made the call; clears it. what names the case. */
void op_checks_expect_refused(backend_t *be, const char *want, const char *file,
                              const char *what);

/* Every op's valid call captured as a graph (be_graph, kernels/backend.h)
 * and launched gives what the same call gives eagerly, its optional tensors
 * present: bit for bit; each tensor filled with values of its
 * own first, so operands passed in the wrong order show; the capture itself
 * changes no memory; and sumsq, a barrier, fails its capture by name. Also
 * zero, copy, copy2d and matmul_into. Returns the number of ops checked. */
int op_checks_replay(backend_t *be);

/* Ids outside the table and targets outside [0, V): a zero row, no
 * gradient, an ignored row, on every backend. */
void op_checks_ids_outside(backend_t *be);

#endif
