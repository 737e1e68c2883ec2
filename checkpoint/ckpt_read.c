/* Checkpoint directories: MANIFEST.json parsed and checked against the
 * files it names, and state.h5 read (trusting nothing beyond what spotune
 * writes); writing is in ckpt.c. */
#define _GNU_SOURCE
#include "ckpt.h"
#include "ckpt_internal.h"

#include <errno.h>
#include <hdf5.h>
#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

/* ---- MANIFEST and verification --------------------------------------------------- */

void ckpt_manifest_free(ckpt_manifest *m)
{
    free(m->files);
    free(m->layout);
    m->files = NULL;
    m->layout = NULL;
    m->nfiles = 0;
}

int ckpt_manifest_parse(const char *text, size_t len, ckpt_manifest *m, sp_err *err)
{
    memset(m, 0, sizeof *m);
    json_error_t je;
    json_t *j = json_loadb(text, len, 0, &je);
    if (!j)
        return sp_fail(err, SP_EXIT_INPUT, "MANIFEST.json is not valid JSON: %s", je.text);
    int rc = 0;
    json_t *fv = json_object_get(j, "format_version"), *st = json_object_get(j, "step"),
           *ws = json_object_get(j, "world_size"), *fl = json_object_get(j, "files");
    if (!json_is_integer(fv) || !json_is_integer(st) || !json_is_integer(ws) ||
        !json_is_object(fl)) {
        rc = sp_fail(err, SP_EXIT_INPUT,
                     "MANIFEST.json lacks format_version, step, world_size or files");
    } else if (json_integer_value(fv) > CKPT_FORMAT_VERSION) {
        rc = sp_fail(err, SP_EXIT_INPUT,
                     "MANIFEST.json: format version %lld is newer than this spotune reads (%d)",
                     (long long)json_integer_value(fv), CKPT_FORMAT_VERSION);
    } else {
        m->format_version = (int)json_integer_value(fv);
        m->step = json_integer_value(st);
        m->world_size = (int)json_integer_value(ws);
        const char *ch = json_string_value(json_object_get(j, "config_hash"));
        const char *bm = json_string_value(json_object_get(j, "base_model"));
        snprintf(m->config_hash, sizeof m->config_hash, "%s", ch ? ch : "");
        snprintf(m->base_model, sizeof m->base_model, "%s", bm ? bm : "");
        m->created = json_number_value(json_object_get(j, "created"));
        const char *k;
        json_t *v, *lay = json_object_get(j, "layout");
        m->files = calloc(json_object_size(fl) + 1, sizeof *m->files);
        if (lay && json_is_object(lay))
            m->layout = json_dumps(lay, JSON_COMPACT);
        if (!m->files || (lay && !m->layout))
            rc = sp_fail(err, SP_EXIT_OTHER, "out of memory");
        else if (lay && !json_is_object(lay))
            rc = sp_fail(err, SP_EXIT_INPUT, "MANIFEST.json: layout is not an object");
        json_object_foreach(fl, k, v)
        {
            json_t *sz = json_object_get(v, "size"), *sh = json_object_get(v, "sha256");
            if (rc)
                break;
            if (!json_is_integer(sz) || !json_is_string(sh) ||
                strlen(json_string_value(sh)) != 64 || strchr(k, '/') || strlen(k) >= 128) {
                rc = sp_fail(err, SP_EXIT_INPUT, "MANIFEST.json: bad entry for file '%s'", k);
                break;
            }
            snprintf(m->files[m->nfiles].name, 128, "%s", k);
            m->files[m->nfiles].size = (uint64_t)json_integer_value(sz);
            snprintf(m->files[m->nfiles].sha256, 65, "%s", json_string_value(sh));
            m->nfiles++;
        }
        if (!rc && m->nfiles == 0)
            rc = sp_fail(err, SP_EXIT_INPUT, "MANIFEST.json names no files");
    }
    json_decref(j);
    return rc;
}

/* MANIFEST.json's text (NUL-terminated), or NULL when there is none. */
static char *read_manifest(const char *dir, size_t *len, sp_err *err)
{
    char *path = sp_strf("%s/%s", dir, CKPT_MANIFEST);
    FILE *f = path ? fopen(path, "rb") : NULL;
    free(path);
    if (!f) {
        sp_fail(err, SP_EXIT_INPUT, "%s: no MANIFEST.json (an incomplete checkpoint)", dir);
        return NULL;
    }
    char *text = NULL;
    size_t cap = 0, got;
    char buf[4096];
    *len = 0;
    while ((got = fread(buf, 1, sizeof buf, f)) > 0) {
        if (*len + got + 1 > cap) {
            cap = 2 * (*len + got + 1);
            char *t = realloc(text, cap);
            if (!t) {
                free(text);
                fclose(f);
                sp_fail(err, SP_EXIT_OTHER, "out of memory");
                return NULL;
            }
            text = t;
        }
        memcpy(text + *len, buf, got);
        *len += got;
    }
    fclose(f);
    if (!text && !(text = malloc(1))) {
        sp_fail(err, SP_EXIT_OTHER, "out of memory");
        return NULL;
    }
    text[*len] = 0;
    return text;
}

/* Checks file i of the MANIFEST m of dir: present, its size, its SHA-256. */
static int verify_file(const char *dir, const ckpt_manifest *m, int i, sp_err *err)
{
    char hex[65];
    uint64_t size;
    struct stat sb;
    char *path = sp_strf("%s/%s", dir, m->files[i].name);
    int rc = 0;
    if (!path)
        rc = sp_fail(err, SP_EXIT_OTHER, "out of memory");
    else if (stat(path, &sb) != 0)
        rc = sp_fail(err, SP_EXIT_INPUT, "%s: MANIFEST.json names %s, which is missing", dir,
                     m->files[i].name);
    else if ((uint64_t)sb.st_size != m->files[i].size)
        rc = sp_fail(err, SP_EXIT_INPUT,
                     "%s: %s has %llu bytes, MANIFEST.json says %llu (truncated?)", dir,
                     m->files[i].name, (unsigned long long)sb.st_size,
                     (unsigned long long)m->files[i].size);
    else if (ckpt_file_sha256(path, hex, &size, err))
        rc = err->code;
    else if (strcmp(hex, m->files[i].sha256) != 0)
        rc = sp_fail(err, SP_EXIT_INPUT,
                     "%s: %s fails its SHA-256 checksum (the file is corrupted)", dir,
                     m->files[i].name);
    free(path);
    return rc;
}

int ckpt_layout_store_only(const char *layout, char (*names)[64], int max)
{
    json_t *lay = layout ? json_loads(layout, 0, NULL) : NULL;
    int n = 0;
    size_t i;
    json_t *e;
    json_array_foreach(json_object_get(lay, "shards"), i, e)
    {
        const char *file = json_string_value(json_object_get(e, "file"));
        if (!file || !json_is_true(json_object_get(e, "store_only")))
            continue;
        if (names && n < max)
            snprintf(names[n], 64, "%s", file);
        n++;
    }
    json_decref(lay);
    return n;
}

int ckpt_manifest_load(const char *dir, ckpt_manifest *m, sp_err *err)
{
    size_t len;
    memset(m, 0, sizeof *m);
    char *text = read_manifest(dir, &len, err);
    if (!text)
        return err->code;
    int rc = ckpt_manifest_parse(text, len, m, err);
    free(text);
    if (rc)
        sp_err_prefix(err, "%s: ", dir);
    return rc;
}

/* Whether file is one of the layout's store-only shards. */
static int store_only(const char *layout, const char *file)
{
    if (!layout || !sp_after(file, "shard-"))
        return 0;
    json_t *lay = json_loads(layout, 0, NULL);
    int yes = 0;
    size_t i;
    json_t *e;
    json_array_foreach(json_object_get(lay, "shards"), i, e)
    {
        const char *f = json_string_value(json_object_get(e, "file"));
        if (f && strcmp(f, file) == 0)
            yes = json_is_true(json_object_get(e, "store_only"));
    }
    json_decref(lay);
    return yes;
}

static int manifest_lists(const ckpt_manifest *m, const char *file)
{
    for (int i = 0; i < m->nfiles; i++)
        if (strcmp(m->files[i].name, file) == 0)
            return 1;
    return 0;
}

/* Every file the checkpoint is read from must be in MANIFEST with its
 * checksum: state.h5, and each shard file of a sharded checkpoint's layout.
 * A file that is there but unlisted would be read without ever being
 * checked. */
static int manifest_complete(const char *dir, const ckpt_manifest *m, sp_err *err)
{
    if (!manifest_lists(m, CKPT_STATE_FILE))
        return sp_fail(err, SP_EXIT_INPUT,
                       "%s: MANIFEST.json does not list %s, so its checksum cannot be checked "
                       "(a damaged or hand-edited MANIFEST)",
                       dir, CKPT_STATE_FILE);
    if (!m->layout)
        return 0;
    json_t *lay = json_loads(m->layout, 0, NULL), *shards = json_object_get(lay, "shards"), *e;
    size_t i;
    int rc = 0;
    if (!json_is_array(shards) || json_array_size(shards) == 0)
        rc = sp_fail(err, SP_EXIT_INPUT, "%s: MANIFEST.json's layout lists no shard files", dir);
    json_array_foreach(shards, i, e)
    {
        const char *file = json_string_value(json_object_get(e, "file"));
        if (rc)
            break;
        if (!file)
            rc = sp_fail(err, SP_EXIT_INPUT,
                         "%s: MANIFEST.json's layout has a shard (%zu) without a file name", dir,
                         i);
        else if (!manifest_lists(m, file))
            rc = sp_fail(err, SP_EXIT_INPUT,
                         "%s: MANIFEST.json's layout names the shard file %s, which its files "
                         "do not list, so its checksum cannot be checked",
                         dir, file);
    }
    json_decref(lay);
    return rc;
}

int ckpt_verify_ex(const char *dir, ckpt_manifest *m, int shards_in_store, sp_err *err)
{
    struct stat dsb;
    memset(m, 0, sizeof *m);
    if (stat(dir, &dsb) != 0)
        return sp_fail(err, SP_EXIT_INPUT, "%s: no such checkpoint directory (%s)", dir,
                       strerror(errno));
    if (!S_ISDIR(dsb.st_mode))
        return sp_fail(err, SP_EXIT_INPUT,
                       "%s: not a checkpoint directory (a checkpoint is a directory holding "
                       "MANIFEST.json)",
                       dir);
    size_t len;
    char *text = read_manifest(dir, &len, err);
    if (!text)
        return err->code;
    int rc = ckpt_manifest_parse(text, len, m, err);
    free(text);
    if (rc) {
        sp_err_prefix(err, "%s: ", dir);
        return rc;
    }
    rc = manifest_complete(dir, m, err);
    for (int i = 0; i < m->nfiles && !rc; i++)
        if (!(shards_in_store && m->layout && sp_after(m->files[i].name, "shard-")) &&
            !store_only(m->layout, m->files[i].name)) /* written on another machine */
            rc = verify_file(dir, m, i, err);
    return rc;
}

int ckpt_verify(const char *dir, ckpt_manifest *m, sp_err *err)
{
    return ckpt_verify_ex(dir, m, 0, err);
}

/* ---- reading --------------------------------------------------------------------- */

/* Reading trusts nothing in state.h5 beyond what spotune writes: scalar
 * attributes (an integer or a float of at most 8 bytes, or one variable-length
 * string), and float32 datasets of 1 to 4 dimensions whose data fits in the
 * file. Anything else is refused, with what and where, before a value is
 * read: a file can match its MANIFEST and still be damaged (damaged before
 * its checksum was taken), and HDF5 writes as many elements as the file
 * claims into the buffer it is given. */
#define READ_MAX_ATTRS 256

typedef struct read_ctx {
    ckpt_snapshot *s;
    int read_data; /* 0: check the datasets' types and shapes only */
    uint64_t file_bytes;
    char problem[256];
} read_ctx;

/* Records why the file is refused; returns -1 (HDF5's "stop iterating"). */
static herr_t refuse(read_ctx *c, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->problem, sizeof c->problem, fmt, ap);
    va_end(ap);
    return -1;
}

static int attr_is_scalar(hid_t a)
{
    hid_t sp = H5Aget_space(a);
    int ok = sp >= 0 && H5Sget_simple_extent_type(sp) == H5S_SCALAR &&
             H5Sget_simple_extent_npoints(sp) == 1;
    if (sp >= 0)
        H5Sclose(sp);
    return ok;
}

static herr_t read_attr_value(hid_t a, hid_t ty, const char *name, read_ctx *c)
{
    H5T_class_t cls = H5Tget_class(ty);
    size_t size = H5Tget_size(ty);
    if (!attr_is_scalar(a))
        return refuse(c, "attribute '%s' is not a single value", name);
    if ((cls == H5T_INTEGER || cls == H5T_FLOAT) && (size == 0 || size > 8))
        return refuse(c, "attribute '%s' has %zu-byte numbers", name, size);
    if (cls == H5T_INTEGER) {
        int64_t v;
        return H5Aread(a, H5T_NATIVE_INT64, &v) < 0 || ckpt_set_int(c->s, name, v) ? -1 : 0;
    }
    if (cls == H5T_FLOAT) {
        double v;
        return H5Aread(a, H5T_NATIVE_DOUBLE, &v) < 0 || ckpt_set_real(c->s, name, v) ? -1 : 0;
    }
    if (cls != H5T_STRING || H5Tis_variable_str(ty) <= 0)
        return refuse(c, "attribute '%s' is neither a number nor a string", name);
    char *v = NULL;
    hid_t mem = H5Tcopy(H5T_C_S1);
    H5Tset_size(mem, H5T_VARIABLE);
    H5Tset_cset(mem, H5Tget_cset(ty));
    errno = 0;
    herr_t rc = H5Aread(a, mem, &v);
    if (rc < 0 && errno == ENOMEM) { /* e.g. the checker's memory limit (cmd_ckpt.c) */
        H5Tclose(mem);
        return refuse(c, "attribute '%s': reading it asks for more memory than there is to "
                         "give (its datatype or length claims gigabytes)",
                      name);
    }
    if (rc >= 0 && (!v || ckpt_set_str(c->s, name, v)))
        rc = -1;
    if (v)
        H5free_memory(v);
    H5Tclose(mem);
    return rc;
}

static herr_t read_attr(hid_t loc, const char *name, const H5A_info_t *info, void *vc)
{
    (void)info;
    read_ctx *c = vc;
    if (c->s->nattrs >= READ_MAX_ATTRS || strlen(name) >= sizeof c->s->attrs[0].name)
        return refuse(c, "too many or too long attributes");
    hid_t a = H5Aopen(loc, name, H5P_DEFAULT);
    hid_t ty = a >= 0 ? H5Aget_type(a) : -1;
    herr_t rc = ty >= 0 ? read_attr_value(a, ty, name, c) : -1;
    if (ty >= 0)
        H5Tclose(ty);
    if (a >= 0)
        H5Aclose(a);
    return rc < 0 ? -1 : 0;
}

#if H5_VERSION_GE(1, 12, 0)
typedef H5O_info2_t obj_info_t;
#define OBJ_VISIT(f, cb, ctx) H5Ovisit3(f, H5_INDEX_NAME, H5_ITER_INC, cb, ctx, H5O_INFO_BASIC)
#else
typedef H5O_info_t obj_info_t;
#define OBJ_VISIT(f, cb, ctx) H5Ovisit2(f, H5_INDEX_NAME, H5_ITER_INC, cb, ctx, H5O_INFO_BASIC)
#endif

/* The shape of dataset ds when it is float32, 1 to 4 dimensions, and fits
 * in the file (0), else -1 with the problem. */
static int dataset_shape(hid_t ds, const char *name, read_ctx *c, int *nd, int64_t shape[4])
{
    hid_t sp = H5Dget_space(ds), ty = H5Dget_type(ds);
    int ok = sp >= 0 && ty >= 0 && H5Tget_class(ty) == H5T_FLOAT && H5Tget_size(ty) == 4;
    int n = ok ? H5Sget_simple_extent_ndims(sp) : -1;
    hsize_t dims[4] = {0};
    uint64_t bytes = 4;
    if (ok && n >= 1 && n <= 4 && H5Sget_simple_extent_dims(sp, dims, NULL) == n) {
        for (int d = 0; d < n && bytes <= c->file_bytes; d++) {
            shape[d] = (int64_t)dims[d];
            bytes = dims[d] && bytes > UINT64_MAX / dims[d] ? UINT64_MAX : bytes * dims[d];
        }
    } else {
        ok = 0;
    }
    if (sp >= 0)
        H5Sclose(sp);
    if (ty >= 0)
        H5Tclose(ty);
    *nd = n;
    if (!ok)
        return refuse(c, "dataset '%s' is not an array of float32 with 1 to 4 dimensions", name);
    if (bytes > c->file_bytes)
        return refuse(c, "dataset '%s' claims more data than the file holds", name);
    return 0;
}

static herr_t read_object(hid_t root, const char *name, const obj_info_t *info, void *vc)
{
    if (info->type != H5O_TYPE_DATASET)
        return 0;
    read_ctx *c = vc;
    hid_t ds = H5Dopen2(root, name, H5P_DEFAULT);
    if (ds < 0)
        return refuse(c, "cannot open dataset '%s'", name);
    int nd = 0;
    int64_t shape[4];
    herr_t rc = dataset_shape(ds, name, c, &nd, shape);
    if (rc == 0 && c->read_data) {
        float *buf = ckpt_add_array(c->s, name, nd, shape);
        rc = buf ? H5Dread(ds, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, buf)
                 : refuse(c, "no memory for dataset '%s'", name);
    }
    H5Dclose(ds);
    return rc < 0 ? -1 : 0;
}

/* m: the checkpoint's verified MANIFEST, or NULL to read the structure only */
static int read_state(const char *dir, const ckpt_manifest *m, ckpt_snapshot *s, sp_err *err)
{
    ckpt_snapshot_init(s);
    char *path = sp_strf("%s/%s", dir, CKPT_STATE_FILE);
    if (!path)
        return sp_fail(err, SP_EXIT_OTHER, "out of memory");
    struct stat sb;
    read_ctx c = {.s = s, .read_data = m != NULL};
    if (stat(path, &sb) == 0)
        c.file_bytes = (uint64_t)sb.st_size;
    H5Eset_auto2(H5E_DEFAULT, NULL, NULL);
    hid_t f = H5Fopen(path, H5F_ACC_RDONLY, H5P_DEFAULT);
    int rc = 0;
    if (f < 0) {
        rc = sp_fail(err, SP_EXIT_INPUT, "%s: cannot open as HDF5", path);
    } else {
        hsize_t idx = 0;
        int bad = H5Aiterate2(f, H5_INDEX_NAME, H5_ITER_INC, &idx, read_attr, &c) < 0 ||
                  OBJ_VISIT(f, read_object, &c) < 0;
        H5Fclose(f);
        if (bad) {
            ckpt_snapshot_free(s);
            rc = sp_fail(err, SP_EXIT_INPUT, "%s: cannot read the checkpoint state%s%s", path,
                         c.problem[0] ? ": " : "", c.problem);
        }
    }
    free(path);
    if (rc)
        return rc;
    if (m) {
        s->step = m->step;
        s->world_size = m->world_size;
        memcpy(s->config_hash, m->config_hash, sizeof s->config_hash);
        memcpy(s->base_model, m->base_model, sizeof s->base_model);
        if (m->layout && !(s->layout = strdup(m->layout))) {
            ckpt_snapshot_free(s);
            return sp_fail(err, SP_EXIT_OTHER, "out of memory");
        }
    }
    return 0;
}

int ckpt_read_verified(const char *dir, const ckpt_manifest *m, ckpt_snapshot *s, sp_err *err)
{
    return read_state(dir, m, s, err);
}

int ckpt_read(const char *dir, ckpt_snapshot *s, sp_err *err)
{
    ckpt_manifest m;
    int rc = ckpt_verify(dir, &m, err);
    if (!rc)
        rc = read_state(dir, &m, s, err);
    ckpt_manifest_free(&m);
    return rc;
}

int ckpt_check_state(const char *dir, sp_err *err)
{
    ckpt_snapshot s;
    int rc = read_state(dir, NULL, &s, err);
    if (!rc)
        ckpt_snapshot_free(&s);
    return rc;
}
