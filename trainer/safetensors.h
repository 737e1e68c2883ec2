/* trainer/safetensors.h — the safetensors format: reading a file through
 * mmap with every header field checked (the header parsed with jansson), and
 * writing one atomically (temporary file, fsync, rename).
 * Owns the mapping and the parsed tensor table of an open file. */
#ifndef SPOTUNE_SAFETENSORS_H
#define SPOTUNE_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "../base/base.h"
#include "../kernels/backend.h"

#define ST_MAX_DIMS 8

typedef struct st_tensor {
    char *name;
    dtype_t dt;
    int ndim;
    int64_t shape[ST_MAX_DIMS];
    size_t numel;
    const void *data; /* inside the mapping */
} st_tensor;

typedef struct st_file {
    char *path;
    void *map;
    size_t size;
    st_tensor *tensors;
    size_t n;
    char *metadata_json; /* "__metadata__" object as JSON text, or NULL */
} st_file;

/* Maps and validates path. Errors (SP_EXIT_INPUT) name the file and the
 * problem: too short, header length past the end, header not JSON, unknown
 * or unsupported dtype, bad shape or offsets. */
int st_open(st_file *f, const char *path, sp_err *err);
void st_close(st_file *f);
const st_tensor *st_find(const st_file *f, const char *name);
/* A float tensor's values are all finite: 0; else an error (SP_EXIT_INPUT)
 * naming the file, the tensor, the first value that is not (NaN or
 * infinite) and its element, and how many there are. Other dtypes: 0. */
int st_check_finite(const st_file *f, const st_tensor *t, sp_err *err);

typedef struct st_entry {
    const char *name;
    dtype_t dt;
    int ndim;
    int64_t shape[ST_MAX_DIMS];
    const void *data; /* host memory, numel * dtype_size(dt) bytes; NULL: ask fetch */
} st_entry;

/* Fills buf with entry i's bytes (for entries whose data is NULL), so a large
 * model is written one tensor at a time. Returns 0 or an error code. */
typedef int (*st_fetch_fn)(void *ctx, size_t i, void *buf, sp_err *err);

/* Writes entries (and optional string metadata pairs, n_meta of them, as
 * meta[2i] = key, meta[2i+1] = value) to path atomically. */
int st_write(const char *path, const st_entry *entries, size_t n, const char *const *meta,
             size_t n_meta, sp_err *err);
int st_write_fetch(const char *path, const st_entry *entries, size_t n, const char *const *meta,
                   size_t n_meta, st_fetch_fn fetch, void *ctx, sp_err *err);
size_t st_entry_bytes(const st_entry *e);

#endif
