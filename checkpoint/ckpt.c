/* Checkpoint directories: snapshot, HDF5 state, MANIFEST, verify, read; the
 * listing and retention are in ckpt_list.c. */
#define _GNU_SOURCE
#include "ckpt.h"
#include "ckpt_internal.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <hdf5.h>
#include <jansson.h>
#include <openssl/evp.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>

/* ---- snapshot ----------------------------------------------------------------- */

void ckpt_snapshot_init(ckpt_snapshot *s)
{
    memset(s, 0, sizeof *s);
}

void ckpt_snapshot_free(ckpt_snapshot *s)
{
    for (int i = 0; i < s->nattrs; i++)
        free(s->attrs[i].s);
    for (int i = 0; i < s->narrays; i++) {
        free(s->arrays[i].name);
        free(s->arrays[i].data);
    }
    for (int i = 0; i < s->nfiles; i++)
        free(s->files[i].data);
    free(s->attrs);
    free(s->arrays);
    free(s->shard_dir);
    free(s->shards);
    free(s->layout);
    memset(s, 0, sizeof *s);
}

/* arr (n elements of elem bytes, capacity *cap) with room for one more: arr
 * or a grown copy (the capacity doubled, first at first), NULL when out of
 * memory (arr is then left as it was). */
static void *reserve(void *arr, int n, int *cap, size_t elem, int first)
{
    if (n < *cap)
        return arr;
    int c = *cap ? 2 * *cap : first;
    void *grown = realloc(arr, elem * (size_t)c);
    if (grown)
        *cap = c;
    return grown;
}

/* The attribute called name, emptied, or a new one; NULL when out of memory
 * or the name is longer than an attribute's name holds. */
static ckpt_attr *new_attr(ckpt_snapshot *s, const char *name)
{
    size_t len = strlen(name);
    if (len >= sizeof s->attrs[0].name)
        return NULL;
    for (int i = 0; i < s->nattrs; i++)
        if (strcmp(s->attrs[i].name, name) == 0) {
            free(s->attrs[i].s);
            s->attrs[i].s = NULL;
            return &s->attrs[i];
        }
    ckpt_attr *attrs = reserve(s->attrs, s->nattrs, &s->cap_attrs, sizeof *attrs, 16);
    if (!attrs)
        return NULL;
    s->attrs = attrs;
    ckpt_attr *a = &s->attrs[s->nattrs++];
    memset(a, 0, sizeof *a);
    memcpy(a->name, name, len + 1);
    return a;
}

static int set_number(ckpt_snapshot *s, const char *name, int type, int64_t i, double d)
{
    ckpt_attr *a = new_attr(s, name);
    if (!a)
        return -1;
    a->type = type;
    a->i = i;
    a->d = d;
    return 0;
}

int ckpt_set_int(ckpt_snapshot *s, const char *name, int64_t v)
{
    return set_number(s, name, CKPT_ATTR_INT, v, 0.0);
}

int ckpt_set_real(ckpt_snapshot *s, const char *name, double v)
{
    return set_number(s, name, CKPT_ATTR_REAL, 0, v);
}

int ckpt_set_str(ckpt_snapshot *s, const char *name, const char *v)
{
    ckpt_attr *a = new_attr(s, name);
    if (!a)
        return -1;
    a->type = CKPT_ATTR_STR;
    a->s = strdup(v);
    return a->s ? 0 : -1;
}

float *ckpt_add_array(ckpt_snapshot *s, const char *name, int ndim, const int64_t *shape)
{
    ckpt_array *arrays = reserve(s->arrays, s->narrays, &s->cap_arrays, sizeof *arrays, 64);
    if (!arrays)
        return NULL;
    s->arrays = arrays;
    ckpt_array *a = &s->arrays[s->narrays];
    memset(a, 0, sizeof *a);
    a->ndim = ndim;
    a->n = 1;
    for (int d = 0; d < ndim; d++) {
        a->shape[d] = shape[d];
        a->n *= (size_t)shape[d];
    }
    a->name = strdup(name);
    a->data = malloc(sizeof(float) * (a->n ? a->n : 1));
    if (!a->name || !a->data) {
        free(a->name);
        free(a->data);
        return NULL;
    }
    s->narrays++;
    s->bytes += a->n * sizeof(float);
    return a->data;
}

int ckpt_add_file(ckpt_snapshot *s, const char *name, const void *data, size_t n)
{
    if (s->nfiles == 4 || strlen(name) >= sizeof s->files[0].name || strchr(name, '/') ||
        !strcmp(name, CKPT_MANIFEST) || !strcmp(name, CKPT_STATE_FILE))
        return -1;
    ckpt_file *f = &s->files[s->nfiles];
    f->data = malloc(n ? n : 1);
    if (!f->data)
        return -1;
    memcpy(f->data, data, n);
    f->n = n;
    memcpy(f->name, name, strlen(name) + 1); /* its length was checked above */
    s->nfiles++;
    s->bytes += n;
    return 0;
}

const ckpt_attr *ckpt_get(const ckpt_snapshot *s, const char *name)
{
    for (int i = 0; i < s->nattrs; i++)
        if (strcmp(s->attrs[i].name, name) == 0)
            return &s->attrs[i];
    return NULL;
}

const ckpt_array *ckpt_find_array(const ckpt_snapshot *s, const char *name)
{
    for (int i = 0; i < s->narrays; i++)
        if (strcmp(s->arrays[i].name, name) == 0)
            return &s->arrays[i];
    return NULL;
}

void ckpt_dir_name(char *buf, size_t n, int64_t step)
{
    snprintf(buf, n, "step-%08lld", (long long)step);
}

/* ---- files -------------------------------------------------------------------- */

int ckpt_fsync_path(const char *path, int dir)
{
    int fd = open(path, (dir ? O_RDONLY | O_DIRECTORY : O_RDONLY) | O_CLOEXEC);
    if (fd < 0)
        return -1;
    int rc = fsync(fd);
    close(fd);
    return rc;
}

int ckpt_file_sha256(const char *path, char hex[65], uint64_t *size, sp_err *err)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return sp_fail(err, SP_EXIT_INPUT, "%s: cannot open: %s", path, strerror(errno));
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    unsigned char buf[1 << 16], md[EVP_MAX_MD_SIZE];
    unsigned int len = 0;
    uint64_t total = 0;
    size_t got;
    int ok = ctx && EVP_DigestInit_ex(ctx, EVP_sha256(), NULL) == 1;
    while (ok && (got = fread(buf, 1, sizeof buf, f)) > 0) {
        ok = EVP_DigestUpdate(ctx, buf, got) == 1;
        total += got;
    }
    ok = ok && !ferror(f) && EVP_DigestFinal_ex(ctx, md, &len) == 1 && len == 32;
    fclose(f);
    EVP_MD_CTX_free(ctx);
    if (!ok)
        return sp_fail(err, SP_EXIT_INPUT, "%s: cannot read for its checksum", path);
    for (unsigned i = 0; i < 32; i++)
        snprintf(hex + 2 * i, 3, "%02x", md[i]);
    if (size)
        *size = total;
    return 0;
}

/* ---- HDF5 files this process writes ----------------------------------------------- */

/* libhdf5 1.10 frees a file whose close fails (its last flush met a full
 * disk) but keeps the file's id, and the library's exit handler then crashes
 * on that id. So the process keeps HDF5 from installing the handler and ends
 * the library itself, unless such a close happened; this flag, set from the
 * writer thread, is the one fact about the library the whole process shares. */
static int h5_close_failed;

void ckpt_hdf5_setup(void)
{
    H5dont_atexit();
}

void ckpt_hdf5_shutdown(void)
{
    if (!__atomic_load_n(&h5_close_failed, __ATOMIC_SEQ_CST))
        H5close();
}

int64_t ckpt_hdf5_create(const char *path, int *fd)
{
    H5Eset_auto2(H5E_DEFAULT, NULL, NULL);
    hid_t f = H5Fcreate(path, H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
    *fd = -1;
    if (f < 0)
        return -1;
    hid_t fapl = H5Fget_access_plist(f);
    int *handle = NULL;
    if (fapl >= 0 && H5Fget_vfd_handle(f, fapl, (void **)&handle) >= 0 && handle)
        *fd = *handle;
    if (fapl >= 0)
        H5Pclose(fapl);
    return (int64_t)f;
}

int ckpt_hdf5_close(int64_t file, int fd, int failed)
{
    hid_t f = (hid_t)file;
    if (!failed && H5Fflush(f, H5F_SCOPE_LOCAL) < 0)
        failed = 1;
    /* The file is discarded: its blocks go back first, so the few the close
     * still writes fit even on a full disk. */
    if (failed && fd >= 0 && ftruncate(fd, 0) != 0)
        failed = 1;
    if (H5Fclose(f) < 0) {
        __atomic_store_n(&h5_close_failed, 1, __ATOMIC_SEQ_CST);
        return -1;
    }
    return failed ? -1 : 0;
}

static int write_attrs(hid_t f, const ckpt_snapshot *s, int *errnum)
{
    for (int i = 0; i < s->nattrs; i++) {
        const ckpt_attr *a = &s->attrs[i];
        hid_t sp = H5Screate(H5S_SCALAR), ty, mem;
        const void *buf;
        const char *str = a->s;
        if (a->type == CKPT_ATTR_INT) {
            ty = H5Tcopy(H5T_STD_I64LE);
            mem = H5Tcopy(H5T_NATIVE_INT64);
            buf = &a->i;
        } else if (a->type == CKPT_ATTR_REAL) {
            ty = H5Tcopy(H5T_IEEE_F64LE);
            mem = H5Tcopy(H5T_NATIVE_DOUBLE);
            buf = &a->d;
        } else {
            ty = H5Tcopy(H5T_C_S1);
            H5Tset_size(ty, H5T_VARIABLE);
            H5Tset_cset(ty, H5T_CSET_UTF8);
            mem = H5Tcopy(ty);
            buf = &str;
        }
        errno = 0;
        hid_t at = H5Acreate2(f, a->name, ty, sp, H5P_DEFAULT, H5P_DEFAULT);
        herr_t rc = at < 0 ? -1 : H5Awrite(at, mem, buf);
        *errnum = errno;
        if (at >= 0)
            H5Aclose(at);
        H5Tclose(ty);
        H5Tclose(mem);
        H5Sclose(sp);
        if (rc < 0)
            return -1;
    }
    return 0;
}

static int write_arrays(hid_t f, const ckpt_snapshot *s, int *errnum)
{
    hid_t lcpl = H5Pcreate(H5P_LINK_CREATE);
    H5Pset_create_intermediate_group(lcpl, 1);
    int rc = 0;
    for (int i = 0; i < s->narrays && !rc; i++) {
        const ckpt_array *a = &s->arrays[i];
        hsize_t dims[4];
        for (int d = 0; d < a->ndim; d++)
            dims[d] = (hsize_t)a->shape[d];
        hid_t sp = H5Screate_simple(a->ndim, dims, NULL);
        errno = 0;
        hid_t ds = H5Dcreate2(f, a->name, H5T_IEEE_F32LE, sp, lcpl, H5P_DEFAULT, H5P_DEFAULT);
        if (ds < 0 || H5Dwrite(ds, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, a->data) < 0)
            rc = -1;
        *errnum = errno;
        if (ds >= 0 && H5Dclose(ds) < 0)
            rc = -1;
        H5Sclose(sp);
    }
    H5Pclose(lcpl);
    return rc;
}

static int write_state(const char *path, const ckpt_snapshot *s, sp_err *err)
{
    int fd, errnum = 0;
    hid_t f = (hid_t)ckpt_hdf5_create(path, &fd);
    if (f < 0)
        return sp_fail(err, SP_EXIT_OTHER, "%s: cannot create", path);
    int bad = write_attrs(f, s, &errnum) || write_arrays(f, s, &errnum);
    errno = 0;
    if (ckpt_hdf5_close(f, fd, bad) != 0 || ckpt_fsync_path(path, 0) != 0) {
        if (!errnum)
            errnum = errno;
        return sp_fail(err, SP_EXIT_OTHER, "%s: cannot write the checkpoint state%s%s", path,
                       errnum ? ": " : "", errnum ? strerror(errnum) : "");
    }
    return 0;
}

/* Refuses a write that cannot fit: HDF5 is never left to meet a full disk
 * when the file system says beforehand that it would. */
static int check_space(const char *root, const ckpt_snapshot *s, sp_err *err)
{
    struct statvfs v;
    if (statvfs(root, &v) != 0)
        return 0; /* unknown: the write itself will tell */
    /* the data, and generously the HDF5 metadata (about 1 KiB an object),
     * MANIFEST and the directory */
    double need = (double)s->bytes * (1.0 + 1.0 / 256.0) + 262144.0 +
                  4096.0 * (s->narrays + s->nattrs + s->nfiles);
    double avail = (double)v.f_bavail * (double)v.f_frsize;
    if (avail >= need)
        return 0;
    return sp_fail(err, SP_EXIT_OTHER,
                   "%s: no space for checkpoint step %lld: it needs about %.1f MiB and the file "
                   "system has %.1f MiB free",
                   root, (long long)s->step, need / 1048576.0, avail / 1048576.0);
}

/* MANIFEST.json of dir: the files written here (hashed now) and, sharded,
 * the shards as their ranks reported them and the layout. */
static int write_manifest(const char *dir, const ckpt_snapshot *s, const char *const *files,
                          int nfiles, sp_err *err)
{
    json_t *m = json_object(), *fl = json_object();
    json_object_set_new(m, "format", json_string("spotune-checkpoint"));
    json_object_set_new(m, "format_version", json_integer(CKPT_FORMAT_VERSION));
    json_object_set_new(m, "step", json_integer(s->step));
    json_object_set_new(m, "world_size", json_integer(s->world_size));
    json_object_set_new(m, "config_hash", json_string(s->config_hash));
    json_object_set_new(m, "base_model", json_string(s->base_model));
    json_object_set_new(m, "created", json_real(sp_wall_time()));
    int rc = 0;
    for (int i = 0; i < nfiles && !rc; i++) {
        char hex[65], *path = sp_strf("%s/%s", dir, files[i]);
        uint64_t size;
        rc = path ? ckpt_file_sha256(path, hex, &size, err)
                  : sp_fail(err, SP_EXIT_OTHER, "out of memory");
        if (!rc)
            json_object_set_new(fl, files[i],
                                json_pack("{s:I, s:s}", "size", (json_int_t)size, "sha256", hex));
        free(path);
    }
    for (int i = 0; i < s->nshards && !rc; i++)
        json_object_set_new(fl, s->shards[i].name,
                            json_pack("{s:I, s:s}", "size", (json_int_t)s->shards[i].size,
                                      "sha256", s->shards[i].sha256));
    json_object_set_new(m, "files", fl);
    if (!rc && s->layout) {
        json_error_t je;
        json_t *lay = json_loads(s->layout, 0, &je);
        if (!lay)
            rc = sp_fail(err, SP_EXIT_OTHER, "checkpoint layout is not JSON: %s", je.text);
        else
            json_object_set_new(m, "layout", lay);
    }
    char *path = rc ? NULL : sp_strf("%s/%s", dir, CKPT_MANIFEST);
    if (!rc && !path)
        rc = sp_fail(err, SP_EXIT_OTHER, "out of memory");
    if (!rc && (json_dump_file(m, path, JSON_INDENT(2)) != 0 || ckpt_fsync_path(path, 0) != 0))
        rc = sp_fail(err, SP_EXIT_OTHER, "%s: cannot write", path);
    free(path);
    json_decref(m);
    return rc;
}

uint64_t ckpt_tree_bytes(const char *dir)
{
    DIR *d = opendir(dir);
    uint64_t total = 0;
    struct dirent *de;
    while (d && (de = readdir(d))) {
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, ".."))
            continue;
        char *path = sp_strf("%s/%s", dir, de->d_name);
        struct stat st;
        if (path && lstat(path, &st) == 0)
            total += S_ISDIR(st.st_mode) ? ckpt_tree_bytes(path)
                     : S_ISREG(st.st_mode) ? (uint64_t)st.st_size : 0;
        free(path);
    }
    if (d)
        closedir(d);
    return total;
}

int ckpt_remove_tree(const char *dir)
{
    DIR *d = opendir(dir);
    if (!d)
        return errno == ENOENT ? 0 : -1;
    struct dirent *e;
    int rc = 0;
    while ((e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
            continue;
        char *p = sp_strf("%s/%s", dir, e->d_name);
        struct stat sb;
        if (!p)
            rc = -1;
        else if (lstat(p, &sb) == 0 && S_ISDIR(sb.st_mode))
            rc |= ckpt_remove_tree(p);
        else
            rc |= unlink(p);
        free(p);
    }
    closedir(d);
    return rc | rmdir(dir);
}

/* The files of snapshot s written into the new directory tmp, MANIFEST last. */
static int write_files(const char *tmp, const ckpt_snapshot *s, sp_err *err)
{
    const char *files[5] = {CKPT_STATE_FILE};
    int nfiles = 1;
    char *path = sp_strf("%s/%s", tmp, CKPT_STATE_FILE);
    int rc = path ? write_state(path, s, err) : sp_fail(err, SP_EXIT_OTHER, "out of memory");
    for (int i = 0; i < s->nfiles && !rc; i++) {
        free(path);
        path = sp_strf("%s/%s", tmp, s->files[i].name);
        if (!path) {
            rc = sp_fail(err, SP_EXIT_OTHER, "out of memory");
            break;
        }
        FILE *f = fopen(path, "wb");
        int bad = !f || fwrite(s->files[i].data, 1, s->files[i].n, f) != s->files[i].n;
        if (f && fclose(f) != 0)
            bad = 1;
        if (bad || ckpt_fsync_path(path, 0) != 0)
            rc = sp_fail(err, SP_EXIT_OTHER, "%s: cannot write: %s", path, strerror(errno));
        files[nfiles++] = s->files[i].name;
    }
    free(path);
    if (!rc)
        rc = write_manifest(tmp, s, files, nfiles, err);
    if (!rc && ckpt_fsync_path(tmp, 1) != 0)
        rc = sp_fail(err, SP_EXIT_OTHER, "%s: fsync failed: %s", tmp, strerror(errno));
    return rc;
}

/* Moves the written directory tmp to fin, replacing an older copy of this
 * step (an incomplete one, or a resumed run writing it again). */
static int commit_dir(const char *root, const char *name, const char *tmp, const char *fin,
                      sp_err *err)
{
    struct stat sb;
    if (stat(fin, &sb) == 0) {
        char *old = sp_strf("%s/.old-%s-%d", root, name, (int)getpid());
        if (!old)
            return sp_fail(err, SP_EXIT_OTHER, "out of memory");
        if (rename(fin, old) == 0)
            ckpt_remove_tree(old);
        free(old);
    }
    if (rename(tmp, fin) != 0)
        return sp_fail(err, SP_EXIT_OTHER, "%s: cannot rename to %s: %s", tmp, fin,
                       strerror(errno));
    ckpt_fsync_path(root, 1);
    return 0;
}

int ckpt_write(const char *root, const ckpt_snapshot *s, char **out_dir, sp_err *err)
{
    char name[64];
    if (out_dir)
        *out_dir = NULL;
    if (mkdir(root, 0755) != 0 && errno != EEXIST)
        return sp_fail(err, SP_EXIT_OTHER, "%s: cannot create: %s", root, strerror(errno));
    ckpt_dir_name(name, sizeof name, s->step);
    char *tmp = s->shard_dir ? strdup(s->shard_dir) : ckpt_tmp_dir(root, s->step, (int)getpid());
    char *fin = sp_strf("%s/%s", root, name);
    int rc = 0;
    if (!tmp || !fin) {
        rc = sp_fail(err, SP_EXIT_OTHER, "out of memory");
    } else if (s->shard_dir) { /* the ranks wrote their shards into it */
        if ((rc = write_files(tmp, s, err)) == 0)
            rc = commit_dir(root, name, tmp, fin, err);
        if (rc)
            ckpt_remove_tree(tmp);
    } else {
        ckpt_remove_tree(tmp);
        if (check_space(root, s, err))
            rc = err->code;
        else if (mkdir(tmp, 0755) != 0)
            rc = sp_fail(err, SP_EXIT_OTHER, "%s: cannot create: %s", tmp, strerror(errno));
        else if ((rc = write_files(tmp, s, err)) == 0)
            rc = commit_dir(root, name, tmp, fin, err);
        if (rc)
            ckpt_remove_tree(tmp);
    }
    if (!rc && out_dir) {
        *out_dir = fin;
        fin = NULL;
    }
    free(tmp);
    free(fin);
    return rc;
}

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

int ckpt_verify(const char *dir, ckpt_manifest *m, sp_err *err)
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
    for (int i = 0; i < m->nfiles && !rc; i++)
        rc = verify_file(dir, m, i, err);
    return rc;
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
    herr_t rc = H5Aread(a, mem, &v);
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
