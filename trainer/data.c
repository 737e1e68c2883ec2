/* HDF5 token datasets: reading windows, the per-epoch permutation, writing. */
#define _POSIX_C_SOURCE 200809L
#include "data.h"

#include "../checkpoint/ckpt.h"

#include <errno.h>
#include <hdf5.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define RNG_TAG_SHUFFLE 0x3001
#define SCAN_CHUNK (1u << 20)

static int bad(sp_err *err, const char *path, const char *what)
{
    return sp_fail(err, SP_EXIT_INPUT, "%s: %s", path, what);
}

/* Length of a 1-D integer dataset, or -1 (message in err). */
static int64_t dataset_len(hid_t file, const char *name, const char *path, hid_t *out,
                           sp_err *err)
{
    if (H5Lexists(file, name, H5P_DEFAULT) <= 0) {
        sp_fail(err, SP_EXIT_INPUT, "%s: dataset %s is missing", path, name);
        return -1;
    }
    hid_t ds = H5Dopen2(file, name, H5P_DEFAULT);
    if (ds < 0) {
        sp_fail(err, SP_EXIT_INPUT, "%s: cannot open dataset %s", path, name);
        return -1;
    }
    hid_t sp = H5Dget_space(ds), ty = H5Dget_type(ds);
    int nd = H5Sget_simple_extent_ndims(sp);
    hsize_t dim = 0;
    if (nd == 1)
        H5Sget_simple_extent_dims(sp, &dim, NULL);
    int is_int = H5Tget_class(ty) == H5T_INTEGER;
    H5Sclose(sp);
    H5Tclose(ty);
    if (nd != 1 || !is_int) {
        H5Dclose(ds);
        sp_fail(err, SP_EXIT_INPUT, "%s: dataset %s must be a 1-D integer array", path, name);
        return -1;
    }
    *out = ds;
    return (int64_t)dim;
}

static int read_range(hid_t ds, hid_t mem_type, uint64_t off, uint64_t n, void *buf)
{
    hsize_t start = off, count = n;
    hid_t fs = H5Dget_space(ds);
    hid_t ms = H5Screate_simple(1, &count, NULL);
    herr_t rc = H5Sselect_hyperslab(fs, H5S_SELECT_SET, &start, NULL, &count, NULL);
    if (rc >= 0)
        rc = H5Dread(ds, mem_type, ms, fs, H5P_DEFAULT, buf);
    H5Sclose(ms);
    H5Sclose(fs);
    return rc < 0 ? -1 : 0;
}

static int read_attr_int(hid_t file, const char *name, int64_t *out)
{
    if (H5Aexists(file, name) <= 0)
        return -1;
    hid_t a = H5Aopen(file, name, H5P_DEFAULT);
    long long v = 0;
    herr_t rc = H5Aread(a, H5T_NATIVE_LLONG, &v);
    H5Aclose(a);
    *out = v;
    return rc < 0 ? -1 : 0;
}

/* A string attribute, cut to out[n]: a label (the tokenizer's name). */
static void read_attr_str(hid_t file, const char *name, char *out, size_t n)
{
    out[0] = 0;
    if (H5Aexists(file, name) <= 0)
        return;
    hid_t a = H5Aopen(file, name, H5P_DEFAULT), ty = H5Aget_type(a);
    if (H5Tget_class(ty) == H5T_STRING) {
        hid_t mt = H5Tcopy(H5T_C_S1);
        if (H5Tis_variable_str(ty) > 0) {
            char *s = NULL;
            H5Tset_size(mt, H5T_VARIABLE);
            if (H5Aread(a, mt, &s) >= 0 && s) {
                sp_cutf(out, n, "%s", s);
                H5free_memory(s);
            }
        } else {
            size_t len = H5Tget_size(ty);
            char *s = calloc(len + 1, 1);
            H5Tset_size(mt, len + 1);
            if (s && H5Aread(a, mt, s) >= 0)
                sp_cutf(out, n, "%s", s);
            free(s);
        }
        H5Tclose(mt);
    }
    H5Tclose(ty);
    H5Aclose(a);
}

static int check_offsets(dataset_t *d, hid_t off_ds, int64_t n_off, sp_err *err)
{
    if (n_off < 2)
        return bad(err, d->path, "doc_offsets needs at least 2 entries (one document)");
    uint64_t *off = malloc(sizeof(uint64_t) * (size_t)n_off);
    if (!off)
        return sp_fail(err, SP_EXIT_OTHER, "out of memory");
    int rc = 0;
    if (read_range(off_ds, H5T_NATIVE_UINT64, 0, (uint64_t)n_off, off))
        rc = bad(err, d->path, "cannot read doc_offsets");
    for (int64_t i = 1; i < n_off && !rc; i++)
        if (off[i] < off[i - 1])
            rc = sp_fail(err, SP_EXIT_INPUT, "%s: doc_offsets decreases at entry %lld", d->path,
                         (long long)i);
    if (!rc && (off[0] != 0 || off[n_off - 1] != d->n_tokens))
        rc = sp_fail(err, SP_EXIT_INPUT,
                     "%s: doc_offsets must start at 0 and end at the token count %llu (ends at "
                     "%llu)",
                     d->path, (unsigned long long)d->n_tokens,
                     (unsigned long long)off[n_off - 1]);
    free(off);
    d->n_docs = (uint64_t)n_off - 1;
    return rc;
}

/* Every token must be a valid id of the model: found here, not mid-run.
 * Read as signed 64-bit, so that a negative id of a signed /tokens (which
 * the run's unsigned read would clamp to 0) or one beyond 32 bits is seen
 * as what it is. Part `part` of `parts` scans its own contiguous slice, so
 * ranks that open the same file together read it once between them. */
static int scan_tokens(dataset_t *d, int64_t model_vocab, int part, int parts, sp_err *err)
{
    int64_t *buf = malloc(sizeof(int64_t) * SCAN_CHUNK);
    if (!buf)
        return sp_fail(err, SP_EXIT_OTHER, "out of memory");
    int rc = 0;
    uint64_t lo = d->n_tokens / (uint64_t)parts * (uint64_t)part;
    uint64_t hi = part == parts - 1 ? d->n_tokens : d->n_tokens / (uint64_t)parts * (uint64_t)(part + 1);
    for (uint64_t off = lo; off < hi && !rc; off += SCAN_CHUNK) {
        uint64_t n = hi - off < SCAN_CHUNK ? hi - off : SCAN_CHUNK;
        if (read_range((hid_t)d->tokens, H5T_NATIVE_INT64, off, n, buf)) {
            rc = bad(err, d->path, "cannot read /tokens");
            break;
        }
        for (uint64_t i = 0; i < n; i++)
            if (buf[i] < 0 || buf[i] >= model_vocab) {
                rc = sp_fail(err, SP_EXIT_INPUT,
                             "%s: token %lld at position %llu is not a token id of the model "
                             "(0 to vocab_size - 1 = %lld)",
                             d->path, (long long)buf[i], (unsigned long long)(off + i),
                             (long long)model_vocab - 1);
                break;
            }
    }
    free(buf);
    return rc;
}

static int dataset_set_packing(dataset_t *d, int packing, sp_err *err);

int dataset_open(dataset_t *d, const char *path, int64_t seq_len, int64_t model_vocab,
                 uint64_t seed, sp_err *err)
{
    return dataset_open_part(d, path, seq_len, model_vocab, seed, DATA_PACK_STREAM, 0, 1, err);
}

int dataset_open_part(dataset_t *d, const char *path, int64_t seq_len, int64_t model_vocab,
                      uint64_t seed, int packing, int part, int parts, sp_err *err)
{
    memset(d, 0, sizeof *d);
    d->file = d->tokens = d->mask = -1;
    d->perm_epoch = UINT64_MAX;
    d->seq_len = seq_len;
    d->seed = seed;
    d->path = strdup(path);
    if (access(path, R_OK) != 0)
        return sp_fail(err, SP_EXIT_INPUT, "%s: cannot read the dataset file: %s", path,
                       strerror(errno));
    H5Eset_auto2(H5E_DEFAULT, NULL, NULL); /* errors are reported by us, once */
    if (H5Fis_hdf5(path) <= 0)
        return bad(err, path, "not an HDF5 file");
    hid_t f = H5Fopen(path, H5F_ACC_RDONLY, H5P_DEFAULT);
    if (f < 0)
        return bad(err, path, "cannot open as HDF5");
    d->file = f;
    hid_t tok, mask, off;
    int64_t nt = dataset_len(f, "/tokens", path, &tok, err);
    if (nt < 0)
        return err->code;
    d->tokens = tok;
    int64_t nm = dataset_len(f, "/loss_mask", path, &mask, err);
    if (nm < 0)
        return err->code;
    d->mask = mask;
    if (nt == 0)
        return bad(err, path, "the dataset is empty (no tokens)");
    if (nm != nt)
        return sp_fail(err, SP_EXIT_INPUT, "%s: /loss_mask has %lld entries but /tokens has %lld",
                       path, (long long)nm, (long long)nt);
    d->n_tokens = (uint64_t)nt;
    int64_t no = dataset_len(f, "/doc_offsets", path, &off, err);
    if (no < 0)
        return err->code;
    int rc = check_offsets(d, off, no, err);
    H5Dclose(off);
    if (rc)
        return rc;
    if (read_attr_int(f, "vocab_size", &d->vocab_size) || read_attr_int(f, "eos_id", &d->eos_id))
        return bad(err, path, "attributes vocab_size and eos_id are required");
    read_attr_str(f, "tokenizer", d->tokenizer, sizeof d->tokenizer);
    if (d->vocab_size > model_vocab)
        return sp_fail(err, SP_EXIT_INPUT,
                       "%s: the dataset's vocab_size %lld exceeds the model's %lld (tokenized "
                       "for another model?)",
                       path, (long long)d->vocab_size, (long long)model_vocab);
    if (packing == DATA_PACK_STREAM && d->n_tokens < (uint64_t)seq_len + 1)
        return sp_fail(err, SP_EXIT_INPUT,
                       "%s: %llu tokens is too few for one window of seq_len %lld", path,
                       (unsigned long long)d->n_tokens, (long long)seq_len);
    d->n_windows = (d->n_tokens - 1) / (uint64_t)seq_len;
    if (parts < 1 || part < 0 || part >= parts)
        return sp_fail(err, SP_EXIT_OTHER, "dataset part %d of %d does not exist", part, parts);
    if (scan_tokens(d, model_vocab, part, parts, err))
        return err->code;
    return dataset_set_packing(d, packing, err);
}

const char *const dataset_packing_names[] = {"stream", "documents", "pad", NULL};

/* Appends window (x, y) to the layout (grown by doubling). */
static int add_window(dataset_t *d, uint64_t *cap, uint64_t x, uint64_t y)
{
    if (d->n_windows == *cap) {
        uint64_t n = *cap ? 2 * *cap : 1024;
        uint64_t *w = realloc(d->win, sizeof(uint64_t) * 2 * n);
        if (!w)
            return -1;
        d->win = w;
        *cap = n;
    }
    d->win[2 * d->n_windows] = x;
    d->win[2 * d->n_windows + 1] = y;
    d->n_windows++;
    return 0;
}

static int dataset_set_packing(dataset_t *d, int packing, sp_err *err)
{
    if (packing == DATA_PACK_STREAM)
        return 0;
    if (packing != DATA_PACK_DOCUMENTS && packing != DATA_PACK_PAD)
        return sp_fail(err, SP_EXIT_OTHER, "%s: packing %d does not exist", d->path, packing);
    d->doc_off = malloc(sizeof(uint64_t) * (size_t)(d->n_docs + 1));
    if (!d->doc_off)
        return sp_fail(err, SP_EXIT_OTHER, "out of memory for the document offsets");
    hid_t off = H5Dopen2((hid_t)d->file, "/doc_offsets", H5P_DEFAULT);
    int bad_ = off < 0 || read_range(off, H5T_NATIVE_UINT64, 0, d->n_docs + 1, d->doc_off);
    if (off >= 0)
        H5Dclose(off);
    if (bad_)
        return bad(err, d->path, "cannot read doc_offsets");
    uint64_t T = (uint64_t)d->seq_len, cap = 0, fill = 0, wx = 0, wy = 0;
    d->n_windows = 0;
    d->predictions = 0;
    for (uint64_t k = 0; k < d->n_docs; k++) {
        uint64_t x = d->doc_off[k], e = d->doc_off[k + 1];
        /* a document of n tokens makes n - 1 predictions */
        uint64_t p = e - x > 1 ? e - x - 1 : 0;
        while (p > 0) {
            if (packing == DATA_PACK_DOCUMENTS && fill > 0 && p > T - fill) {
                if (add_window(d, &cap, wx, wy)) /* it does not fit: pad this window */
                    return sp_fail(err, SP_EXIT_OTHER, "out of memory for the windows");
                fill = 0;
            }
            if (fill == 0)
                wx = x;
            uint64_t take = p < T - fill ? p : T - fill;
            x += take;
            p -= take;
            fill += take;
            d->predictions += take;
            wy = x;
            if (packing == DATA_PACK_PAD || fill == T) {
                if (add_window(d, &cap, wx, wy))
                    return sp_fail(err, SP_EXIT_OTHER, "out of memory for the windows");
                fill = 0;
            }
        }
    }
    if (fill > 0 && add_window(d, &cap, wx, wy))
        return sp_fail(err, SP_EXIT_OTHER, "out of memory for the windows");
    if (d->n_windows == 0)
        return bad(err, d->path,
                   "no document has two tokens: nothing to predict with data.packing "
                   "documents or pad");
    d->packing = packing;
    free(d->perm); /* the permutation covers the new windows */
    d->perm = NULL;
    d->perm_epoch = UINT64_MAX;
    return 0;
}

#define ID_RUNS 64
#define ID_RUN 64

/* FNV-1a over runs of dataset name (n elements of mem_type, size bytes
 * each): ID_RUNS runs of up to ID_RUN elements, evenly spaced. */
static int hash_runs(hid_t file, const char *name, hid_t mem_type, size_t size, uint64_t n,
                     uint64_t *h)
{
    hid_t ds = H5Dopen2(file, name, H5P_DEFAULT);
    if (ds < 0)
        return -1;
    unsigned char buf[ID_RUN * 8];
    int rc = 0;
    for (uint64_t r = 0; r < ID_RUNS && n && !rc; r++) {
        uint64_t at = n <= ID_RUN ? 0 : (n - ID_RUN) / (ID_RUNS - 1) * r;
        uint64_t len = n - at < ID_RUN ? n - at : ID_RUN;
        rc = read_range(ds, mem_type, at, len, buf);
        *h = sp_fnv1a(*h, &at, sizeof at);
        *h = sp_fnv1a(*h, buf, (size_t)len * size);
    }
    H5Dclose(ds);
    return rc;
}

int dataset_identity(const char *path, char out[17], sp_err *err)
{
    out[0] = 0;
    H5Eset_auto2(H5E_DEFAULT, NULL, NULL);
    hid_t f = H5Fopen(path, H5F_ACC_RDONLY, H5P_DEFAULT);
    if (f < 0)
        return bad(err, path, "cannot open as HDF5 to identify it");
    hid_t t = -1, m = -1, o = -1;
    int64_t n = dataset_len(f, "/tokens", path, &t, err), nm = -1, no = -1;
    if (n >= 0)
        nm = dataset_len(f, "/loss_mask", path, &m, err);
    if (nm >= 0)
        no = dataset_len(f, "/doc_offsets", path, &o, err);
    int64_t vocab = -1, eos = -1;
    read_attr_int(f, "vocab_size", &vocab);
    read_attr_int(f, "eos_id", &eos);
    int rc = err->code;
    uint64_t h = SP_FNV_INIT;
    int64_t head[5] = {n, nm, no, vocab, eos};
    h = sp_fnv1a(h, head, sizeof head);
    if (!rc && (hash_runs(f, "/tokens", H5T_NATIVE_UINT32, 4, (uint64_t)n, &h) ||
                hash_runs(f, "/loss_mask", H5T_NATIVE_UINT8, 1, (uint64_t)nm, &h) ||
                hash_runs(f, "/doc_offsets", H5T_NATIVE_UINT64, 8, (uint64_t)no, &h)))
        rc = bad(err, path, "cannot read it to identify it");
    if (t >= 0)
        H5Dclose(t);
    if (m >= 0)
        H5Dclose(m);
    if (o >= 0)
        H5Dclose(o);
    H5Fclose(f);
    if (!rc)
        snprintf(out, 17, "%016llx", (unsigned long long)h);
    return rc;
}

void dataset_close(dataset_t *d)
{
    if (d->mask >= 0)
        H5Dclose((hid_t)d->mask);
    if (d->tokens >= 0)
        H5Dclose((hid_t)d->tokens);
    if (d->file >= 0)
        H5Fclose((hid_t)d->file);
    free(d->perm);
    free(d->doc_off);
    free(d->win);
    free(d->path);
    memset(d, 0, sizeof *d);
    d->file = d->tokens = d->mask = -1;
}

/* Fisher-Yates driven by the counter RNG of (seed, epoch). */
static int build_perm(dataset_t *d, uint64_t epoch, sp_err *err)
{
    if (!d->perm) {
        d->perm = malloc(sizeof(uint64_t) * d->n_windows);
        if (!d->perm)
            return sp_fail(err, SP_EXIT_OTHER, "out of memory for the data order");
    }
    uint64_t s = sp_rng_stream(sp_rng_stream(d->seed, RNG_TAG_SHUFFLE), epoch);
    for (uint64_t i = 0; i < d->n_windows; i++)
        d->perm[i] = i;
    for (uint64_t i = d->n_windows - 1; i > 0; i--) {
        /* the modulo bias of a 64-bit draw is below 2^-40 for any real dataset */
        uint64_t j = sp_rng_u64(s, i) % (i + 1);
        uint64_t t = d->perm[i];
        d->perm[i] = d->perm[j];
        d->perm[j] = t;
    }
    d->perm_epoch = epoch;
    return 0;
}

int dataset_window_of(dataset_t *d, uint64_t sample, uint64_t *window, uint64_t *epoch,
                      sp_err *err)
{
    uint64_t e = sample / d->n_windows;
    if (e != d->perm_epoch && build_perm(d, e, err))
        return err->code;
    *window = d->perm[sample % d->n_windows];
    if (epoch)
        *epoch = e;
    return 0;
}

/* Reads tokens [off, off + n) and their loss_mask values, checked. */
static int read_tokens(dataset_t *d, uint64_t off, uint64_t n, uint32_t **tok, uint8_t **msk,
                       sp_err *err)
{
    *tok = malloc(sizeof(uint32_t) * n);
    *msk = malloc(n);
    if (!*tok || !*msk)
        return sp_fail(err, SP_EXIT_OTHER, "out of memory");
    if (read_range((hid_t)d->tokens, H5T_NATIVE_UINT32, off, n, *tok) ||
        read_range((hid_t)d->mask, H5T_NATIVE_UINT8, off, n, *msk))
        return sp_fail(err, SP_EXIT_INPUT, "%s: cannot read tokens %llu..%llu", d->path,
                       (unsigned long long)off, (unsigned long long)(off + n - 1));
    for (uint64_t t = 0; t < n; t++)
        if ((*msk)[t] > 1)
            return sp_fail(err, SP_EXIT_INPUT,
                           "%s: loss_mask value %u at position %llu (expected 0 or 1)", d->path,
                           (*msk)[t], (unsigned long long)(off + t));
    return 0;
}

/* The document holding token x: the last k with doc_off[k] <= x. */
static uint64_t doc_of(const dataset_t *d, uint64_t x)
{
    uint64_t lo = 0, hi = d->n_docs; /* doc_off[lo] <= x < doc_off[hi] */
    while (hi - lo > 1) {
        uint64_t mid = lo + (hi - lo) / 2;
        if (d->doc_off[mid] <= x)
            lo = mid;
        else
            hi = mid;
    }
    return lo;
}

/* A packed window: its pieces from token x0, each up to its document's
 * last token or the window's end y, then padding. */
static int read_packed(dataset_t *d, uint64_t w, int32_t *inputs, int32_t *targets, int32_t *pos,
                       int32_t *seg, int64_t *trained, sp_err *err)
{
    uint64_t x0 = d->win[2 * w], y = d->win[2 * w + 1], T = (uint64_t)d->seq_len;
    uint32_t *tok = NULL;
    uint8_t *msk = NULL;
    int rc = read_tokens(d, x0, y - x0 + 1, &tok, &msk, err);
    uint64_t slot = 0;
    int64_t n = 0;
    for (uint64_t x = x0, k = rc ? 0 : doc_of(d, x0); !rc && x < y;) {
        while (d->doc_off[k + 1] <= x)
            k++;
        uint64_t e = d->doc_off[k + 1], end = e - 1 < y ? e - 1 : y, first = slot;
        for (uint64_t i = x; i < end && slot < T; i++, slot++) {
            inputs[slot] = (int32_t)tok[i - x0];
            targets[slot] = msk[i + 1 - x0] ? (int32_t)tok[i + 1 - x0] : -1;
            pos[slot] = (int32_t)(slot - first);
            seg[slot] = (int32_t)first;
            n += targets[slot] >= 0;
        }
        x = end < e - 1 ? end : e; /* a split piece ends the window */
    }
    int32_t pad = d->eos_id >= 0 && d->eos_id < d->vocab_size ? (int32_t)d->eos_id : 0;
    for (uint64_t t = slot; t < T && !rc; t++) {
        inputs[t] = pad;
        targets[t] = -1;
        pos[t] = (int32_t)(t - slot);
        seg[t] = (int32_t)slot;
    }
    free(tok);
    free(msk);
    if (trained)
        *trained = n;
    return rc;
}

int dataset_read_window(dataset_t *d, uint64_t w, int32_t *inputs, int32_t *targets,
                        int32_t *pos, int32_t *seg, int64_t *trained, sp_err *err)
{
    uint64_t T = (uint64_t)d->seq_len, off = w * T;
    if (w >= d->n_windows)
        return sp_fail(err, SP_EXIT_OTHER, "%s: window %llu out of range", d->path,
                       (unsigned long long)w);
    if (d->packing != DATA_PACK_STREAM) {
        if (!pos || !seg)
            return sp_fail(err, SP_EXIT_OTHER, "%s: a packed window needs positions and segments",
                           d->path);
        return read_packed(d, w, inputs, targets, pos, seg, trained, err);
    }
    uint32_t *tok = NULL;
    uint8_t *msk = NULL;
    int rc = read_tokens(d, off, T + 1, &tok, &msk, err);
    int64_t n = 0;
    for (uint64_t t = 0; t < T && !rc; t++) {
        inputs[t] = (int32_t)tok[t];
        targets[t] = msk[t + 1] ? (int32_t)tok[t + 1] : -1;
        n += msk[t + 1] != 0;
        if (pos)
            pos[t] = (int32_t)t;
        if (seg)
            seg[t] = 0;
    }
    free(tok);
    free(msk);
    if (trained)
        *trained = n;
    return rc;
}

static int write_1d(hid_t f, const char *name, hid_t file_type, hid_t mem_type, const void *data,
                    uint64_t n)
{
    hsize_t dim = n, chunk = n < 65536 ? (n ? n : 1) : 65536;
    hid_t sp = H5Screate_simple(1, &dim, NULL);
    hid_t pl = H5Pcreate(H5P_DATASET_CREATE);
    H5Pset_chunk(pl, 1, &chunk);
    hid_t ds = H5Dcreate2(f, name, file_type, sp, H5P_DEFAULT, pl, H5P_DEFAULT);
    herr_t rc = ds < 0 ? -1 : H5Dwrite(ds, mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, data);
    if (ds >= 0)
        H5Dclose(ds);
    H5Pclose(pl);
    H5Sclose(sp);
    return rc < 0 ? -1 : 0;
}

static int write_attr_int(hid_t f, const char *name, int64_t v)
{
    hid_t sp = H5Screate(H5S_SCALAR);
    hid_t a = H5Acreate2(f, name, H5T_STD_I64LE, sp, H5P_DEFAULT, H5P_DEFAULT);
    long long x = v;
    herr_t rc = a < 0 ? -1 : H5Awrite(a, H5T_NATIVE_LLONG, &x);
    if (a >= 0)
        H5Aclose(a);
    H5Sclose(sp);
    return rc < 0 ? -1 : 0;
}

static int write_attr_str(hid_t f, const char *name, const char *v)
{
    hid_t sp = H5Screate(H5S_SCALAR), ty = H5Tcopy(H5T_C_S1);
    H5Tset_size(ty, H5T_VARIABLE);
    hid_t a = H5Acreate2(f, name, ty, sp, H5P_DEFAULT, H5P_DEFAULT);
    herr_t rc = a < 0 ? -1 : H5Awrite(a, ty, &v);
    if (a >= 0)
        H5Aclose(a);
    H5Tclose(ty);
    H5Sclose(sp);
    return rc < 0 ? -1 : 0;
}

int dataset_write(const char *path, const uint32_t *tokens, const uint8_t *mask, uint64_t n,
                  const uint64_t *doc_offsets, uint64_t n_docs, int64_t vocab_size,
                  int64_t eos_id, const char *tokenizer, sp_err *err)
{
    char *tmp = sp_strf("%s.tmp-%d", path, (int)getpid());
    if (!tmp)
        return sp_fail(err, SP_EXIT_OTHER, "out of memory");
    int fd;
    errno = 0;
    hid_t f = (hid_t)ckpt_hdf5_create(tmp, &fd);
    if (f < 0) {
        sp_fail(err, SP_EXIT_OTHER, "%s: cannot create%s%s", tmp, errno ? ": " : "",
                errno ? strerror(errno) : "");
        free(tmp);
        return err->code;
    }
    int bad_ = write_1d(f, "/tokens", H5T_STD_U32LE, H5T_NATIVE_UINT32, tokens, n) ||
               write_1d(f, "/loss_mask", H5T_STD_U8LE, H5T_NATIVE_UINT8, mask, n) ||
               write_1d(f, "/doc_offsets", H5T_STD_U64LE, H5T_NATIVE_UINT64, doc_offsets,
                        n_docs + 1) ||
               write_attr_int(f, "vocab_size", vocab_size) ||
               write_attr_int(f, "eos_id", eos_id) ||
               write_attr_str(f, "tokenizer", tokenizer);
    errno = 0;
    if (ckpt_hdf5_close(f, fd, bad_) != 0)
        bad_ = 1;
    int rc = 0;
    if (bad_ || rename(tmp, path) != 0) {
        int e = errno;
        unlink(tmp);
        rc = sp_fail(err, SP_EXIT_OTHER, "%s: cannot write the dataset%s%s", path, e ? ": " : "",
                     e ? strerror(e) : "");
    }
    free(tmp);
    return rc;
}
