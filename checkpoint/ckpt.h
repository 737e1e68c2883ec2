/* checkpoint/ckpt.h — the checkpoint directory protocol. A checkpoint is a
 * directory ROOT/step-NNNNNNNN/ holding HDF5 files (state.h5: the replicated
 * state; shard-RRRRR-of-NNNNN.h5: each rank's shard of a sharded state, see
 * "Sharded state" below) and MANIFEST.json, written last: format version, step, world size,
 * config hash, base-model identity, and every file's size and SHA-256. It is
 * written as ROOT/.tmp-step-NNNNNNNN-PID/, every file and the directory
 * fsynced, then renamed; a checkpoint without a valid MANIFEST, or whose files
 * fail their checksums, does not exist. Owns: the snapshot (host copies of
 * named arrays and scalar attributes), HDF5 writing and reading, MANIFEST,
 * verification, listing, retention, and a background writer thread. Does not
 * decide when to checkpoint, and knows nothing of models. */
#ifndef SPOTUNE_CKPT_H
#define SPOTUNE_CKPT_H

#include <stddef.h>
#include <stdint.h>

#include "base/base.h"

#define CKPT_FORMAT_VERSION 1
#define CKPT_MANIFEST "MANIFEST.json"
#define CKPT_STATE_FILE "state.h5"

enum { CKPT_ATTR_INT, CKPT_ATTR_REAL, CKPT_ATTR_STR };

typedef struct ckpt_attr {
    char name[64];
    int type;
    int64_t i;
    double d;
    char *s;
} ckpt_attr;

/* A named float32 array in host memory (owned by the snapshot). The name is
 * a path inside the HDF5 file ("params/<tensor name>"). */
typedef struct ckpt_array {
    char *name;
    float *data;
    int ndim;
    int64_t shape[4];
    size_t n;
} ckpt_array;

/* A shard file of a sharded checkpoint, written by its rank: its name in
 * the checkpoint directory, size and SHA-256 (what MANIFEST lists). */
/* A shard file as its rank wrote it: name, size, SHA-256 of the whole file,
 * where each group's values start in it (byte offsets of the contiguous
 * datasets), and the SHA-256 of each block_bytes-long block, so that a
 * reader fetching byte ranges from an object store checks what it got. */
#define CKPT_SHARD_MAX_BLOCKS 1024
/* The smallest block, 16 MiB (a multiple of it, so that a file has at most
 * CKPT_SHARD_MAX_BLOCKS); tests set smaller ones, the reader takes any. */
extern uint64_t ckpt_shard_min_block;
typedef struct ckpt_shard_info {
    char name[64];
    uint64_t size;
    char sha256[65];
    uint64_t data_offset[3]; /* params, adam_m, adam_v */
    uint64_t block_bytes;
    uint32_t nblocks;
    unsigned char block_sha256[CKPT_SHARD_MAX_BLOCKS][32];
} ckpt_shard_info;

/* A file stored beside state.h5 as it is (e.g. the run's metrics so far). */
typedef struct ckpt_file {
    char name[64];
    void *data;
    size_t n;
} ckpt_file;

typedef struct ckpt_snapshot {
    int64_t step;
    int world_size;
    char config_hash[17];
    char base_model[17];
    ckpt_attr *attrs;
    int nattrs, cap_attrs;
    ckpt_array *arrays;
    int narrays, cap_arrays;
    ckpt_file files[4];
    int nfiles;
    size_t bytes;
    /* A sharded checkpoint (see "Sharded state" below): ckpt_write commits
     * shard_dir, which already holds the ranks' shard files (shards, as they
     * reported them), adding state.h5 and a MANIFEST that lists the shards
     * and carries layout (JSON text of an object). When read, layout is the
     * MANIFEST's (NULL: a gathered checkpoint, everything in state.h5). */
    char *shard_dir;
    ckpt_shard_info *shards;
    int nshards;
    char *layout;
} ckpt_snapshot;

void ckpt_snapshot_init(ckpt_snapshot *s);
void ckpt_snapshot_free(ckpt_snapshot *s);
int ckpt_set_int(ckpt_snapshot *s, const char *name, int64_t v);
int ckpt_set_real(ckpt_snapshot *s, const char *name, double v);
int ckpt_set_str(ckpt_snapshot *s, const char *name, const char *v);
/* Adds an array of n floats; returns its buffer to fill (NULL: out of memory). */
float *ckpt_add_array(ckpt_snapshot *s, const char *name, int ndim, const int64_t *shape);
/* Adds a copy of n bytes to be written as file `name` of the checkpoint
 * (listed in MANIFEST like state.h5); at most 4. */
int ckpt_add_file(ckpt_snapshot *s, const char *name, const void *data, size_t n);
const ckpt_attr *ckpt_get(const ckpt_snapshot *s, const char *name);
const ckpt_array *ckpt_find_array(const ckpt_snapshot *s, const char *name);

/* Writes the snapshot as ROOT/step-NNNNNNNN (atomically), replacing an older
 * directory of that step. *out_dir (out_dir may be NULL) receives the final
 * path, a heap string the caller frees (NULL on failure). */
int ckpt_write(const char *root, const ckpt_snapshot *s, char **out_dir, sp_err *err);

typedef struct ckpt_manifest_file {
    char name[128];
    uint64_t size;
    char sha256[65];
} ckpt_manifest_file;

/* What MANIFEST.json says; files and layout are heap memory that
 * ckpt_manifest_free releases (after every ckpt_verify or
 * ckpt_manifest_parse, whatever it returned). */
typedef struct ckpt_manifest {
    int format_version;
    int64_t step;
    int world_size;
    char config_hash[17];
    char base_model[17];
    double created;
    int nfiles;
    ckpt_manifest_file *files;
    char *layout; /* a sharded checkpoint's layout (JSON text), or NULL */
} ckpt_manifest;
void ckpt_manifest_free(ckpt_manifest *m);

/* Checks MANIFEST.json and every file it names (size, SHA-256), and that it
 * names every file the checkpoint is read from (state.h5, and each shard
 * file of its layout). Errors are SP_EXIT_INPUT and say what is wrong (no
 * such directory, missing MANIFEST, a file MANIFEST does not list, missing
 * file, truncated file, checksum mismatch). m is filled as far as
 * MANIFEST.json could be read. */
int ckpt_verify(const char *dir, ckpt_manifest *m, sp_err *err);
/* The same, but with shards_in_store the shard files of a sharded
 * checkpoint are not looked for (ckpt_pull_unsharded left them in the store,
 * where every read of them is checked block by block). */
int ckpt_verify_ex(const char *dir, ckpt_manifest *m, int shards_in_store, sp_err *err);
int ckpt_manifest_parse(const char *json_text, size_t len, ckpt_manifest *m, sp_err *err);
/* SHA-256 of a file as 64 hex digits (and its size). */
int ckpt_file_sha256(const char *path, char hex[65], uint64_t *size, sp_err *err);
/* Verifies MANIFEST and every file's size and checksum; reads the state.
 * What spotune never writes is refused by name (SP_EXIT_INPUT): attributes
 * that are not one number or string, datasets that are not float32 arrays
 * of 1 to 4 dimensions or claim more data than the file holds. A file that
 * matches its MANIFEST can still be damaged (before its checksum was taken),
 * and libhdf5 itself can crash on some damage: callers that must survive
 * that run ckpt_check_state in a process of their own first. */
int ckpt_read(const char *dir, ckpt_snapshot *s, sp_err *err);
/* ckpt_read after the caller's own ckpt_verify (m: what it returned). */
int ckpt_read_verified(const char *dir, const ckpt_manifest *m, ckpt_snapshot *s, sp_err *err);
/* All of ckpt_read but the checksums and the arrays' values: the structure
 * of DIR/state.h5, read and checked as ckpt_read does. */
int ckpt_check_state(const char *dir, sp_err *err);

/* ckpt_info.incomplete: what a .tmp-step-NNNNNNNN-PID directory is */
enum {
    CKPT_INTERRUPTED = 1,  /* its writer is gone (or is this process): never finished */
    CKPT_BEING_WRITTEN = 2 /* process PID, another live one, may still be writing it */
};

typedef struct ckpt_info {
    char name[64]; /* step-NNNNNNNN, or .tmp-step-NNNNNNNN-PID */
    int64_t step;
    int ok;            /* verified */
    char problem[SP_ERR_MSG_MAX]; /* why not, when !ok */
    double created;    /* from MANIFEST.json when it reads (0: unknown) */
    uint64_t bytes;    /* the files directly in the directory */
    int incomplete;    /* 0, or for a .tmp- directory CKPT_INTERRUPTED / CKPT_BEING_WRITTEN */
    int writer_pid;    /* the PID of a .tmp- directory's name (0: none) */
} ckpt_info;

/* Lists ROOT's checkpoints and leftover .tmp- directories (not ok, with
 * `incomplete` set and the problem saying whether the write never finished
 * or another live process is writing it), newest first, verifying each
 * checkpoint when verify is set. Changes nothing. */
int ckpt_list(const char *root, int verify, ckpt_info **out, int *n, sp_err *err);
/* For resuming: finds the newest checkpoint that verifies and reports
 * through report (may be NULL) every newer one that does not, and every
 * .tmp- directory. A .tmp- directory whose writer is gone (or has this
 * process's id: a previous incarnation) is removed ("; removed" ends its
 * problem); one that another live process is writing is left ("; left
 * alone"). Call it only before this process writes checkpoints into root.
 * Returns 0 with found = 0 if none verifies; a checkpoint's path that does
 * not fit in path[n] is an error naming it. */
int ckpt_find_latest(const char *root, char *path, size_t n, int *found,
                     void (*report)(void *ctx, const ckpt_info *bad), void *ctx, sp_err *err);
/* The same, taking a checkpoint that verifies only when accept (may be
 * NULL) returns 0 for its directory; else accept wrote why into problem
 * (n bytes) and it is reported and passed over. */
int ckpt_find_latest_if(const char *root, char *path, size_t n, int *found,
                        int (*accept)(void *ctx, const char *dir, char *problem, size_t n),
                        void (*report)(void *ctx, const ckpt_info *bad), void *ctx,
                        sp_err *err);
/* Deletes all but the newest keep complete checkpoints (and every one whose
 * step is a multiple of keep_every, when > 0), and .tmp- directories whose
 * writing process is gone.
 * A checkpoint is first renamed out of sight (.del-...), then deleted, so a
 * crash never leaves a half-deleted step-... directory. deleted (may be
 * NULL) is called with each name removed. */
int ckpt_prune(const char *root, int keep, int64_t keep_every,
               void (*deleted)(void *ctx, const char *name), void *ctx, sp_err *err);
/* HDF5 files this process writes. libhdf5 1.10 frees a file whose close
 * fails (its last flush met a full disk) but keeps its id, and the library's
 * exit handler then crashes on it. A program calls ckpt_hdf5_setup() before
 * any other HDF5 call (it keeps HDF5 from installing that handler) and
 * ckpt_hdf5_shutdown() at its end (it ends the library, unless a close
 * failed). Files are created with ckpt_hdf5_create (an hid_t, or -1; *fd is
 * the file's descriptor, or -1) and closed with ckpt_hdf5_close, which
 * flushes and, when the writing failed (failed != 0) or the flush does,
 * first gives the file's blocks back so the close itself fits on a full
 * disk; it returns 0 only when the file is complete. */
void ckpt_hdf5_setup(void);
void ckpt_hdf5_shutdown(void);
int64_t ckpt_hdf5_create(const char *path, int *fd);
int ckpt_hdf5_close(int64_t file, int fd, int failed);
/* ---- Sharded state ----------------------------------------------------------------
 * With a sharded optimizer each rank owns the fp32 masters and AdamW moments
 * of one contiguous range [lo, hi) of the flat trainable arena (the
 * trainable tensors one after another). A sharded checkpoint keeps them so:
 * rank r writes shard-RRRRR-of-NNNNN.h5 (datasets "params", "adam_m",
 * "adam_v", each the hi - lo values of its range; attributes step, rank,
 * count, lo, hi) into the checkpoint's .tmp- directory in parallel with the
 * others; rank 0 adds state.h5 (attributes, no arrays) and, once every rank
 * reported its shard written, MANIFEST.json, whose "layout" says which
 * elements of which tensor are in which file:
 *   {"kind": "flat-shards", "elements": N,
 *    "tensors": [{"name", "offset", "shape"}, ...],   (offsets in the arena)
 *    "shards": [{"file", "lo", "hi",                   (covering [0, N) in order)
 *                "data_offsets": [3 byte offsets], "block_bytes": B,
 *                "block_sha256": [hex, ...]}, ...]}
 * A reader on any rank count reads only the ranges it needs: through HDF5
 * from a directory, or as byte ranges of whole blocks from an object store,
 * each block checked against its SHA-256 (the datasets are contiguous
 * little-endian float32, so element i of group g is at data_offsets[g] + 4i). */
#define CKPT_SHARD_GROUPS 3
extern const char *const ckpt_shard_groups[CKPT_SHARD_GROUPS]; /* params, adam_m, adam_v */

typedef struct ckpt_shard {
    int64_t step;
    int rank, count;
    uint64_t lo, hi;
    float *data[CKPT_SHARD_GROUPS]; /* hi - lo values each (heap; freed with the shard) */
} ckpt_shard;
void ckpt_shard_free(ckpt_shard *sh);
/* "shard-%05d-of-%05d.h5" */
void ckpt_shard_name(char *buf, size_t n, int rank, int count);
/* ROOT/.tmp-step-NNNNNNNN-PID: where a checkpoint is written before its commit
 * (heap string; NULL when out of memory). */
char *ckpt_tmp_dir(const char *root, int64_t step, int pid);
/* Writes sh into dir (which exists) as its shard file, fsynced; info receives
 * the name, size, SHA-256, data offsets and block checksums. */
int ckpt_shard_write(const char *dir, const ckpt_shard *sh, ckpt_shard_info *info, sp_err *err);

typedef struct ckpt_sharded ckpt_sharded;
/* Opens the sharded checkpoint dir for ranged reads (its MANIFEST's layout;
 * the caller verified the files). Not a sharded checkpoint: SP_EXIT_INPUT. */
int ckpt_sharded_open(ckpt_sharded **out, const char *dir, sp_err *err);
/* The same over the objects PREFIX/<shard file> of store st (ranged reads,
 * every block checked), from the text of the checkpoint's MANIFEST.json; its
 * layout must carry the block checksums (else SP_EXIT_INPUT). st stays the
 * caller's and must outlive r. */
struct store;
int ckpt_sharded_open_store(ckpt_sharded **out, const char *manifest, struct store *st,
                            const char *prefix, sp_err *err);
/* The same, each shard file read from local_dir when that holds it with
 * the size MANIFEST gives (every block still checked; one that does not
 * match is read again from st), else from st. local_dir may be missing or
 * NULL (st only); st may be NULL when local_dir holds every shard (else
 * SP_EXIT_INPUT naming the first file that is nowhere). */
int ckpt_sharded_open_mixed(ckpt_sharded **out, const char *manifest, const char *local_dir,
                            struct store *st, const char *prefix, sp_err *err);
/* How many of r's shard files were read so far from the local copy and
 * how many from elsewhere (the store, or dir). */
void ckpt_sharded_files_read(const ckpt_sharded *r, int *local, int *remote);
/* Whether MANIFEST text describes a sharded checkpoint whose every shard has
 * block checksums (so that ckpt_sharded_open_store can read it). */
int ckpt_sharded_ranged(const char *manifest);
/* Whether a read from the store found a block that does not match its
 * checksum (the stored checkpoint is damaged, not merely unreachable). */
int ckpt_sharded_damaged(const ckpt_sharded *r);
/* Pulls the checkpoint PREFIX of st, whose MANIFEST.json text is manifest
 * (ckpt_sharded_ranged), into local_dir without its shard files, which stay
 * in the store for ranged reads: every other file it lists, each checked
 * against its size and SHA-256, then MANIFEST.json; each shard is checked to
 * be in the store with its size. A file missing or not matching:
 * SP_EXIT_INPUT naming it, and *corrupt (may be NULL) set. */
int ckpt_pull_unsharded(struct store *st, const char *prefix, const char *manifest,
                        const char *local_dir, int *corrupt, sp_err *err);
/* The tensor's elements (0: not in the checkpoint), and its shape. */
uint64_t ckpt_sharded_tensor(const ckpt_sharded *r, const char *name, int *ndim,
                             int64_t shape[2]);
/* The name of r's i-th tensor and its elements (*n, may be NULL); NULL when
 * i is past the last. */
const char *ckpt_sharded_tensor_at(const ckpt_sharded *r, int i, uint64_t *n);
/* The shard file (its name in the checkpoint) that holds the given element of
 * tensor name; NULL when there is no such element. */
const char *ckpt_sharded_file_of(const ckpt_sharded *r, const char *name, uint64_t element);
/* Where r reads from: its directory, or the store's URL/PREFIX (messages). */
const char *ckpt_sharded_where(const ckpt_sharded *r);
/* Elements [start, start + count) of tensor name's values in group g (0
 * params, 1 adam_m, 2 adam_v) into dst, from whichever files hold them. */
int ckpt_sharded_read(ckpt_sharded *r, int g, const char *name, uint64_t start, uint64_t count,
                      float *dst, sp_err *err);
void ckpt_sharded_close(ckpt_sharded *r);
/* Adds every tensor of group g whole to s as the array PREFIX<name> (for the
 * tools that want a gathered snapshot, e.g. export). */
int ckpt_sharded_load(const char *dir, ckpt_snapshot *s, int g, const char *prefix,
                      sp_err *err);

/* The shard files of a layout (JSON text) that were written on machines
 * other than rank 0's (no shared run.dir: "store_only" in the layout): they
 * are in the remote store only, never in the local checkpoint directory.
 * Returns how many; names (may be NULL) receives up to max of them. */
int ckpt_layout_store_only(const char *layout, char (*names)[64], int max);
/* Reads and parses dir's MANIFEST.json without checking its files. */
int ckpt_manifest_load(const char *dir, ckpt_manifest *m, sp_err *err);

/* Deletes a directory and everything under it (no error if missing). */
int ckpt_remove_tree(const char *dir);
/* Bytes of the regular files under dir (0 if missing). */
uint64_t ckpt_tree_bytes(const char *dir);
/* "step-%08lld" */
void ckpt_dir_name(char *buf, size_t n, int64_t step);

#endif
