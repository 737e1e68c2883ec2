/* tests/op_specs.h — internal to the op suites (op_checks.c, op_replay.c):
 * every op described once — its tensor arguments (the elements its sizes
 * make them need, the dtypes it takes), its size arguments and one valid
 * call (tests/op_specs.c) — and guarded tensors: each argument a view
 * between two guard regions of its own allocation, whose bytes can be reset
 * and compared. */
#ifndef SPOTUNE_TEST_OP_SPECS_H
#define SPOTUNE_TEST_OP_SPECS_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/backend.h"

#define GUARD 16    /* elements before and after each view */
#define N_ELEM 10   /* n of the elementwise ops */
#define FILL 0.25f  /* every float element before a call (ids are 0) */

typedef enum { TAKES_FLOAT, TAKES_F32, TAKES_I32, TAKES_U8 } takes_t;

typedef struct targ {
    const char *name;
    size_t n;          /* elements the valid call passes */
    size_t need;       /* elements the sizes make the op need (<= n) */
    const char *shape; /* how, in the messages' words */
    takes_t takes;
    int optional;      /* absent (p == NULL) is a valid call */
} targ;

typedef struct op_spec {
    const char *op;
    void (*call)(backend_t *be, const tensor_t *t, const int *d);
    int nt;
    targ t[10];
    int nd;
    const char *dim[9];
    int d[9]; /* the valid call's sizes */
} op_spec;

/* a tensor argument whose need is its size; E_: the elementwise ops' n */
#define T_(name, n, shape, takes) {name, n, n, shape, takes, 0}
#define E_ N_ELEM

/* the ops of backend.h, each with its valid call (zero, copy, copy2d and
 * matmul_into are made apart: op_checks.c, op_replay.c) */
extern const op_spec op_specs[];
extern const size_t op_spec_count;
/* the source the valid calls are made in (what a refusal's file:line names) */
extern const char op_specs_file[];

/* embedding_backward's grouping of n host token ids (embedding_order),
 * allocated on be: *order I32 [n], *runs I32 [n + 2]. */
void op_embedding_order(backend_t *be, const int32_t *tok, int n, tensor_t *order,
                        tensor_t *runs);

/* The allocations of one op's arguments and what they hold before a call. */
typedef struct arena {
    backend_t *be;
    int n;
    tensor_t parent[10];
    unsigned char *image[10]; /* the bytes of each parent before any call */
    size_t bytes[10];
    size_t esz[10]; /* bytes of an element */
} arena;

/* The allocations of s's arguments, each F32 element FILL, ids and codes 0 */
void arena_make(arena *a, backend_t *be, const op_spec *s);
/* Every allocation back to its image. */
void arena_reset(arena *a);
/* The view of argument i the valid call passes. */
tensor_t arena_arg(const arena *a, const op_spec *s, int i);
/* Elements [lo, hi) of allocation i are as in its image (a Criterion
 * expectation naming what). */
int arena_same(const arena *a, int i, size_t lo, size_t hi, const char *what);
void arena_free(arena *a);

#endif
