/* comm/comm_host.c — collectives over host buffers, on MPI.
 *
 * MPI only moves bytes here; every reduction is done by comm_reduce_blocks
 * in rank order, so a sum is bit-identical on all ranks and from run to run
 * (MPI_Allreduce promises neither). An all-reduce chunk is either
 * all-gathered whole and reduced on every rank (small chunks: one
 * collective) or exchanged with MPI_Alltoallv so that rank r reduces block r,
 * then all-gathered (large chunks: 2(n-1)/n of the buffer moved, as a ring
 * would). Buffers of any size go through in chunks of c->chunk_bytes, which
 * keeps every MPI count below INT_MAX and bounds the scratch memory. Each
 * chunk is watched: the watchdog aborts the job when one overruns. */
#include <stdlib.h>
#include <string.h>

#include "comm_internal.h"

static MPI_Datatype mpi_type(comm_dtype dt)
{
    switch (dt) {
    case COMM_F32: return MPI_FLOAT;
    case COMM_F64: return MPI_DOUBLE;
    case COMM_I32: return MPI_INT32_T;
    case COMM_I64: return MPI_INT64_T;
    case COMM_U8: return MPI_UINT8_T;
    case COMM_BF16: return MPI_UINT16_T; /* moved as bits, reduced in comm_reduce.c */
    default: return MPI_DATATYPE_NULL;
    }
}

static const char *dtype_name(comm_dtype dt)
{
    static const char *names[] = {"f32", "f64", "i32", "i64", "u8", "bf16"};
    return (unsigned)dt < sizeof names / sizeof names[0] ? names[dt] : "unknown";
}

static int check_args(comm_t *c, const char *fn, const void *buf, size_t n, comm_dtype dt,
                      comm_op op, sp_err *err)
{
    if (comm_dtype_size(dt) == 0)
        return sp_fail(err, SP_EXIT_OTHER, "%s: unknown dtype %d", fn, (int)dt);
    if ((unsigned)op > COMM_AVG)
        return sp_fail(err, SP_EXIT_OTHER, "%s: unknown op %d", fn, (int)op);
    if (n > 0 && !buf)
        return sp_fail(err, SP_EXIT_OTHER, "%s: NULL buffer for %zu %s elements", fn, n,
                       dtype_name(dt));
    if (n > SIZE_MAX / comm_dtype_size(dt) / (size_t)c->size)
        return sp_fail(err, SP_EXIT_OTHER, "%s: %zu elements overflow size_t", fn, n);
    return 0;
}

/* check_args of a collective's send and recv (n elements each). */
static int check_both(comm_t *c, const char *fn, const void *send, const void *recv, size_t n,
                      comm_dtype dt, comm_op op, sp_err *err)
{
    return check_args(c, fn, send, n, dt, op, err) || check_args(c, fn, recv, n, dt, op, err)
               ? err->code
               : 0;
}

/* On one rank a collective's result is its own send, copied to recv: 1
 * when that is so (the collective is done). */
static int one_rank(const comm_t *c, const void *send, void *recv, size_t n, comm_dtype dt)
{
    if (c->size != 1)
        return 0;
    if (n > 0 && send != recv)
        memmove(recv, send, n * comm_dtype_size(dt));
    return 1;
}

static size_t chunk_elems(const comm_t *c, comm_dtype dt)
{
    size_t m = c->chunk_bytes / comm_dtype_size(dt);
    return m ? m : 1;
}

/* One collective over buffers of n elements, run a chunk at a time, each
 * chunk watched by the watchdog under `what`: fn gets the chunk's part of
 * send (MPI_IN_PLACE when send is NULL) and of recv (NULL when recv is). */
typedef struct chunk_call {
    const char *what;
    const char *send;
    char *recv;
    size_t n;
    comm_dtype dt;
    comm_op op;
    int root;
    int (*fn)(comm_t *c, const struct chunk_call *k, const void *send, void *recv, int m,
              sp_err *err);
} chunk_call;

static int run_chunks(comm_t *c, const chunk_call *k, sp_err *err)
{
    size_t es = comm_dtype_size(k->dt), step = chunk_elems(c, k->dt);
    for (size_t off = 0; off < k->n; off += step) {
        int m = (int)(k->n - off < step ? k->n - off : step);
        comm_watch_begin(c, k->what);
        int rc = k->fn(c, k, k->send ? k->send + off * es : MPI_IN_PLACE,
                       k->recv ? k->recv + off * es : NULL, m, err);
        comm_watch_end(c);
        if (rc)
            return rc;
    }
    return 0;
}

static int scratch_reserve(comm_t *c, size_t bytes, sp_err *err)
{
    void *p;
    if (bytes <= c->scratch_cap)
        return 0;
    p = realloc(c->scratch, bytes);
    if (!p)
        return sp_fail(err, SP_EXIT_OTHER, "comm: out of memory for %zu bytes of scratch", bytes);
    c->scratch = p;
    c->scratch_cap = bytes;
    return 0;
}

/* ---- all-reduce --------------------------------------------------------- */

/* Points c->blocks at the size blocks of m elements laid out in rank order
 * from base, for the fold. */
static const void *const *blocks_at(comm_t *c, const void *base, size_t m, comm_dtype dt)
{
    for (int r = 0; r < c->size; r++)
        c->blocks[r] = (const char *)base + (size_t)r * m * comm_dtype_size(dt);
    return c->blocks;
}

/* Every rank gathers all m-element contributions and folds them itself. */
static int allreduce_small(comm_t *c, void *buf, int m, comm_dtype dt, comm_op op, sp_err *err)
{
    size_t es = comm_dtype_size(dt);
    if (scratch_reserve(c, (size_t)m * es * (size_t)c->size, err))
        return err->code;
    COMM_MPI(c, err, MPI_Allgather, (buf, m, mpi_type(dt), c->scratch, m, mpi_type(dt), c->world));
    comm_reduce_blocks(buf, blocks_at(c, c->scratch, (size_t)m, dt), (size_t)m, c->size, dt, op);
    return 0;
}

/* Splits m elements into size near-equal blocks: counts/displs for the
 * all-gather, and the all-to-all plan in which every rank sends block r to
 * rank r and receives its own block from each peer (nothing to itself: its
 * own contribution is folded straight from buf). */
static void plan_blocks(comm_t *c, int m)
{
    int n = c->size, mine;
    for (int r = 0, off = 0; r < n; r++) {
        c->counts[r] = m / n + (r < m % n);
        c->displs[r] = off;
        off += c->counts[r];
    }
    mine = c->counts[c->rank];
    for (int r = 0; r < n; r++) {
        c->scounts[r] = r == c->rank ? 0 : c->counts[r];
        c->rcounts[r] = r == c->rank ? 0 : mine;
        c->rdispls[r] = r * mine;
    }
}

/* Rank r owns block r of the chunk: it receives that block from every peer
 * (all-to-all), folds the copies in rank order, then all ranks gather the
 * folded blocks. */
static int allreduce_large(comm_t *c, void *buf, int m, comm_dtype dt, comm_op op, sp_err *err)
{
    size_t es = comm_dtype_size(dt);
    int mine;
    char *own;
    plan_blocks(c, m);
    mine = c->counts[c->rank];
    own = (char *)buf + (size_t)c->displs[c->rank] * es;
    if (scratch_reserve(c, (size_t)mine * es * (size_t)c->size, err))
        return err->code;
    COMM_MPI(c, err, MPI_Alltoallv, (buf, c->scounts, c->displs, mpi_type(dt), c->scratch,
                                     c->rcounts, c->rdispls, mpi_type(dt), c->world));
    blocks_at(c, c->scratch, (size_t)mine, dt);
    c->blocks[c->rank] = own;
    comm_reduce_blocks(own, c->blocks, (size_t)mine, c->size, dt, op);
    COMM_MPI(c, err, MPI_Allgatherv,
             (MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buf, c->counts, c->displs, mpi_type(dt),
              c->world));
    return 0;
}

static int allreduce_chunk(comm_t *c, const chunk_call *k, const void *send, void *recv, int m,
                           sp_err *err)
{
    (void)send; /* in place: recv */
    if ((size_t)m * comm_dtype_size(k->dt) <= c->small_bytes || m < c->size)
        return allreduce_small(c, recv, m, k->dt, k->op, err);
    return allreduce_large(c, recv, m, k->dt, k->op, err);
}

int comm_allreduce(comm_t *c, void *buf, size_t n, comm_dtype dt, comm_op op, sp_err *err)
{
    if (check_args(c, "comm_allreduce", buf, n, dt, op, err))
        return err->code;
    if (c->size == 1)
        return 0; /* the fold of one block is the block itself, AVG included */
    chunk_call k = {"allreduce", NULL, buf, n, dt, op, 0, allreduce_chunk};
    return run_chunks(c, &k, err);
}

/* ---- broadcast, any, barrier -------------------------------------------- */

static int bcast_chunk(comm_t *c, const chunk_call *k, const void *send, void *recv, int m,
                       sp_err *err)
{
    (void)send;
    COMM_MPI(c, err, MPI_Bcast, (recv, m, MPI_BYTE, k->root, c->world));
    return 0;
}

int comm_bcast(comm_t *c, void *buf, size_t bytes, int root, sp_err *err)
{
    if (root < 0 || root >= c->size)
        return sp_fail(err, SP_EXIT_OTHER, "comm_bcast: root %d outside world of %d", root,
                       c->size);
    if (bytes > 0 && !buf)
        return sp_fail(err, SP_EXIT_OTHER, "comm_bcast: NULL buffer for %zu bytes", bytes);
    if (c->size == 1)
        return 0;
    chunk_call k = {"bcast", NULL, buf, bytes, COMM_U8, COMM_SUM, root, bcast_chunk};
    return run_chunks(c, &k, err);
}

/* Integer max: exact in any order, so MPI's own reduction is fine here. */
int comm_any(comm_t *c, int flag, int *any, sp_err *err)
{
    int mine = flag != 0, all = mine, rc = MPI_SUCCESS;
    if (c->size > 1) {
        comm_watch_begin(c, "any");
        rc = MPI_Allreduce(&mine, &all, 1, MPI_INT, MPI_MAX, c->world);
        comm_watch_end(c);
    }
    if (rc != MPI_SUCCESS)
        return comm_mpi_fail(c, err, rc, "MPI_Allreduce", __FILE__, __LINE__);
    *any = all;
    return 0;
}

int comm_barrier(comm_t *c, sp_err *err)
{
    int rc = MPI_SUCCESS;
    if (c->size == 1)
        return 0;
    comm_watch_begin(c, "barrier");
    rc = MPI_Barrier(c->world);
    comm_watch_end(c);
    if (rc != MPI_SUCCESS)
        return comm_mpi_fail(c, err, rc, "MPI_Barrier", __FILE__, __LINE__);
    return 0;
}

/* ---- all-gather and reduce-scatter -------------------------------------- */

/* m elements of dt spaced n elements apart from one rank's slot to the next:
 * the rank-strided view of one chunk of a [size][n] buffer. */
static int strided_type(comm_t *c, int m, size_t n, comm_dtype dt, MPI_Datatype *out, sp_err *err)
{
    MPI_Datatype block;
    COMM_MPI(c, err, MPI_Type_contiguous, (m, mpi_type(dt), &block));
    int rc = MPI_Type_create_resized(block, 0, (MPI_Aint)(n * comm_dtype_size(dt)), out);
    MPI_Type_free(&block);
    if (rc != MPI_SUCCESS)
        return comm_mpi_fail(c, err, rc, "MPI_Type_create_resized", __FILE__, __LINE__);
    COMM_MPI(c, err, MPI_Type_commit, (out));
    return 0;
}

static int allgather_chunk(comm_t *c, const chunk_call *k, const void *send, void *recv, int m,
                           sp_err *err)
{
    MPI_Datatype slot;
    int rc;
    if ((size_t)m == k->n) {
        COMM_MPI(c, err, MPI_Allgather,
                 (send, m, mpi_type(k->dt), recv, m, mpi_type(k->dt), c->world));
        return 0;
    }
    if (strided_type(c, m, k->n, k->dt, &slot, err))
        return err->code;
    rc = MPI_Allgather(send, m, mpi_type(k->dt), recv, 1, slot, c->world);
    MPI_Type_free(&slot);
    if (rc != MPI_SUCCESS)
        return comm_mpi_fail(c, err, rc, "MPI_Allgather", __FILE__, __LINE__);
    return 0;
}

int comm_allgather(comm_t *c, const void *send, void *recv, size_t n, comm_dtype dt, sp_err *err)
{
    size_t es = comm_dtype_size(dt);
    if (check_both(c, "comm_allgather", send, recv, n, dt, COMM_SUM, err))
        return err->code;
    if (one_rank(c, send, recv, n, dt))
        return 0;
    /* send may already sit in its slot of recv (MPI forbids the alias) */
    int in_place = send == (const char *)recv + (size_t)c->rank * n * es;
    chunk_call k = {"allgather", in_place ? NULL : send, recv, n, dt, COMM_SUM, 0,
                    allgather_chunk};
    return run_chunks(c, &k, err);
}

static int gather_chunk(comm_t *c, const chunk_call *k, const void *send, void *recv, int m,
                        sp_err *err)
{
    size_t n = k->n;
    comm_dtype dt = k->dt;
    int root = k->root;
    MPI_Datatype slot = mpi_type(dt);
    int strided = (size_t)m != n && c->rank == root, rc;
    if (strided && strided_type(c, m, n, dt, &slot, err))
        return err->code;
    rc = MPI_Gather(send, m, mpi_type(dt), recv, strided ? 1 : m, slot, root, c->world);
    if (strided)
        MPI_Type_free(&slot);
    if (rc != MPI_SUCCESS)
        return comm_mpi_fail(c, err, rc, "MPI_Gather", __FILE__, __LINE__);
    return 0;
}

int comm_gather(comm_t *c, const void *send, void *recv, size_t n, comm_dtype dt, int root,
                sp_err *err)
{
    if (check_args(c, "comm_gather", send, n, dt, COMM_SUM, err) ||
        (c->rank == root && check_args(c, "comm_gather", recv, n, dt, COMM_SUM, err)))
        return err->code;
    if (root < 0 || root >= c->size)
        return sp_fail(err, SP_EXIT_OTHER, "comm_gather: root %d is not a rank (world of %d)",
                       root, c->size);
    if (one_rank(c, send, recv, n, dt))
        return 0;
    chunk_call k = {"gather", send, c->rank == root ? recv : NULL, n, dt, COMM_SUM, root,
                    gather_chunk};
    return run_chunks(c, &k, err);
}

/* Rank r receives chunk [off, off+m) of block r from every rank, in rank
 * order, and folds them into recv. */
static int reduce_scatter_chunk(comm_t *c, const chunk_call *k, const void *send, void *recv,
                                int m, sp_err *err)
{
    size_t n = k->n;
    comm_dtype dt = k->dt;
    comm_op op = k->op;
    size_t es = comm_dtype_size(dt);
    MPI_Datatype slot = mpi_type(dt);
    int strided = (size_t)m != n, rc;
    if (scratch_reserve(c, (size_t)m * es * (size_t)c->size, err))
        return err->code;
    if (strided && strided_type(c, m, n, dt, &slot, err))
        return err->code;
    rc = MPI_Alltoall(send, strided ? 1 : m, slot, c->scratch, m, mpi_type(dt), c->world);
    if (strided)
        MPI_Type_free(&slot);
    if (rc != MPI_SUCCESS)
        return comm_mpi_fail(c, err, rc, "MPI_Alltoall", __FILE__, __LINE__);
    comm_reduce_blocks(recv, blocks_at(c, c->scratch, (size_t)m, dt), (size_t)m, c->size, dt, op);
    return 0;
}

int comm_reduce_scatter(comm_t *c, const void *send, void *recv, size_t n, comm_dtype dt,
                        comm_op op, sp_err *err)
{
    if (check_both(c, "comm_reduce_scatter", send, recv, n, dt, op, err))
        return err->code;
    if (one_rank(c, send, recv, n, dt))
        return 0;
    chunk_call k = {"reduce_scatter", send, recv, n, dt, op, 0, reduce_scatter_chunk};
    return run_chunks(c, &k, err);
}

/* ---- reduce to one rank -------------------------------------------------- */

/* The root gathers every rank's chunk and folds them, in rank order, into
 * its own buffer. */
static int reduce_chunk(comm_t *c, const chunk_call *k, const void *send, void *recv, int m,
                        sp_err *err)
{
    int root = c->rank == k->root;
    size_t es = comm_dtype_size(k->dt);
    if (root && scratch_reserve(c, (size_t)m * es * (size_t)c->size, err))
        return err->code;
    COMM_MPI(c, err, MPI_Gather, (send, m, mpi_type(k->dt), root ? c->scratch : NULL, m,
                                  mpi_type(k->dt), k->root, c->world));
    if (root)
        comm_reduce_blocks(recv, blocks_at(c, c->scratch, (size_t)m, k->dt), (size_t)m, c->size,
                           k->dt, k->op);
    return 0;
}

int comm_reduce(comm_t *c, void *buf, size_t n, comm_dtype dt, comm_op op, int root,
                sp_err *err)
{
    if (check_args(c, "comm_reduce", buf, n, dt, op, err))
        return err->code;
    if (root < 0 || root >= c->size)
        return sp_fail(err, SP_EXIT_OTHER, "comm_reduce: root %d is not a rank (world of %d)",
                       root, c->size);
    if (c->size == 1)
        return 0;
    chunk_call k = {"reduce", buf, c->rank == root ? buf : NULL, n, dt, op, root, reduce_chunk};
    return run_chunks(c, &k, err);
}
