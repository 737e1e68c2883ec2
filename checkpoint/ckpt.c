/* Checkpoint directories: the snapshot, HDF5 files, writing state.h5 and
 * MANIFEST.json, committing; verifying and reading are in ckpt_read.c, the
 * listing and retention in ckpt_list.c, sharded state in ckpt_shard.c. */
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

/* The shards' data offsets and block checksums into the layout's entries of
 * the same files, for readers that fetch byte ranges from a store. */
static void add_block_sums(json_t *lay, const ckpt_snapshot *s)
{
    size_t i;
    json_t *e;
    json_array_foreach(json_object_get(lay, "shards"), i, e)
    {
        const char *file = json_string_value(json_object_get(e, "file"));
        const ckpt_shard_info *in = NULL;
        for (int r = 0; file && r < s->nshards && !in; r++)
            if (strcmp(s->shards[r].name, file) == 0 && s->shards[r].nblocks)
                in = &s->shards[r];
        if (!in)
            continue;
        json_t *offs = json_array(), *sums = json_array();
        for (int g = 0; g < CKPT_SHARD_GROUPS; g++)
            json_array_append_new(offs, json_integer((json_int_t)in->data_offset[g]));
        for (uint32_t k = 0; k < in->nblocks; k++) {
            char hex[65];
            for (int b = 0; b < 32; b++)
                snprintf(hex + 2 * b, 3, "%02x", in->block_sha256[k][b]);
            json_array_append_new(sums, json_string(hex));
        }
        json_object_set_new(e, "data_offsets", offs);
        json_object_set_new(e, "block_bytes", json_integer((json_int_t)in->block_bytes));
        json_object_set_new(e, "block_sha256", sums);
    }
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
        if (!lay) {
            rc = sp_fail(err, SP_EXIT_OTHER, "checkpoint layout is not JSON: %s", je.text);
        } else {
            add_block_sums(lay, s);
            json_object_set_new(m, "layout", lay);
        }
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
