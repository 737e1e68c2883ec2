/* checkpoint/store_file.c — the file:///path backend (local disk, NFS, FUSE)
 * and the local-file routines every backend uses: objects are files under the
 * root; a put writes a temporary file beside the target, fsyncs it, then
 * renames it into place (or links it, so that if_none_match never replaces an
 * existing object) and fsyncs the directory; a compare-and-swap put does so
 * under a flock of the directory. Listing walks the tree and skips
 * temporary files. Holds no state but the root path, so it is thread-safe. */
#define _GNU_SOURCE
#include "checkpoint/store_impl.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#define COPY_CHUNK ((size_t)8 << 20)

typedef struct fstore {
    char *root;
} fstore;

/* ---- local files (shared by all backends) ----------------------------------- */

static int local_read_tag(const char *path, void **data, size_t *n, char *tag);

int store_local_mkdirs(const char *dir)
{
    char *p = strdup(dir);
    if (!p)
        return ENOMEM;
    int rc = 0;
    for (char *q = p + 1;; q++) {
        if (*q != '/' && *q != 0)
            continue;
        char saved = *q;
        *q = 0;
        if (mkdir(p, 0777) != 0 && errno != EEXIST) {
            rc = errno;
            break;
        }
        *q = saved;
        if (!saved)
            break;
    }
    free(p);
    return rc;
}

int store_local_mkparents(const char *path)
{
    char *p = strdup(path);
    if (!p)
        return ENOMEM;
    int rc = store_local_mkdirs(dirname(p));
    free(p);
    return rc;
}

/* Like mkstemp, but mode 0666 & ~umask, as a plain create would give. */
int store_local_tmp(const char *path, char **tmp_path, int *fd)
{
    char *copy = strdup(path);
    if (!copy)
        return ENOMEM;
    const char *dir = dirname(copy);
    uint64_t rng = store_rng_seed();
    int e = EEXIST;
    for (int i = 0; i < 100 && e == EEXIST; i++) {
        rng = sp_mix64(rng + (uint64_t)i);
        char *t = sp_strf("%s/" STORE_TMP_MARK "%016llx", dir, (unsigned long long)rng);
        if (!t) {
            e = ENOMEM;
            break;
        }
        int f = open(t, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
        if (f >= 0) {
            *tmp_path = t;
            *fd = f;
            e = 0;
            break;
        }
        e = errno;
        free(t);
    }
    free(copy);
    return e;
}

static int fsync_parent(const char *path)
{
    char *p = strdup(path);
    if (!p)
        return ENOMEM;
    int d = open(dirname(p), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    free(p);
    if (d < 0)
        return errno;
    /* some network file systems refuse fsync on a directory: not an error */
    if (fsync(d) != 0 && errno != EINVAL && errno != EROFS && errno != EBADF) {
        int e = errno;
        close(d);
        return e;
    }
    close(d);
    return 0;
}

static int link_noreplace(const char *tmp, const char *path)
{
    if (link(tmp, path) == 0) {
        unlink(tmp);
        return 0;
    }
    int e = errno;
    if (e != EPERM && e != ENOTSUP && e != ENOSYS && e != EMLINK)
        return e;
    /* no hard links (some FUSE mounts): atomic no-replace rename, else check first */
    if (renameat2(AT_FDCWD, tmp, AT_FDCWD, path, RENAME_NOREPLACE) == 0)
        return 0;
    e = errno;
    if (e != EINVAL && e != ENOSYS && e != ENOTSUP)
        return e;
    if (access(path, F_OK) == 0)
        return EEXIST;
    return rename(tmp, path) == 0 ? 0 : errno;
}

int store_local_publish(int fd, const char *tmp_path, const char *path, int noreplace)
{
    int rc = fsync(fd) == 0 ? 0 : errno;
    if (close(fd) != 0 && !rc)
        rc = errno;
    if (!rc)
        rc = noreplace ? link_noreplace(tmp_path, path)
                       : (rename(tmp_path, path) == 0 ? 0 : errno);
    if (rc) {
        unlink(tmp_path);
        return rc;
    }
    return fsync_parent(path);
}

/* A file's version tag (STORE_TAG_MAX bytes): a put renames a new file into
 * place, so its inode and time change with each (not its ctime, which the
 * unlink after a link changes). */
static int local_tag(int fd, char *tag)
{
    struct stat st;
    if (fstat(fd, &st) != 0)
        return errno;
    snprintf(tag, STORE_TAG_MAX, "%llx-%llx-%llx-%lld.%09ld", (unsigned long long)st.st_dev,
             (unsigned long long)st.st_ino, (unsigned long long)st.st_size,
             (long long)st.st_mtim.tv_sec, st.st_mtim.tv_nsec);
    return 0;
}

int store_local_read(const char *path, void **data, size_t *n)
{
    return local_read_tag(path, data, n, NULL);
}

static int local_read_tag(const char *path, void **data, size_t *n, char *tag)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return errno;
    if (tag) {
        int e = local_tag(fd, tag);
        if (e) {
            close(fd);
            return e;
        }
    }
    membuf b = {0};
    char buf[65536];
    int rc = 0;
    for (;;) {
        ssize_t r = read(fd, buf, sizeof buf);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0) {
            rc = errno;
            break;
        }
        if (r == 0)
            break;
        if (membuf_append(&b, buf, (size_t)r)) {
            rc = ENOMEM;
            break;
        }
    }
    close(fd);
    if (!rc && !b.p && membuf_append(&b, "", 0))
        rc = ENOMEM;
    if (rc) {
        membuf_free(&b);
        return rc;
    }
    *data = b.p;
    *n = b.n;
    return 0;
}

void store_local_rmtree(const char *dir)
{
    DIR *d = opendir(dir);
    if (d) {
        struct dirent *e;
        while ((e = readdir(d))) {
            if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
                continue;
            char *p = sp_strf("%s/%s", dir, e->d_name);
            struct stat st;
            if (p && lstat(p, &st) == 0 && S_ISDIR(st.st_mode))
                store_local_rmtree(p);
            else if (p)
                unlink(p);
            free(p);
        }
        closedir(d);
    }
    rmdir(dir);
}

/* Copies in to out (both at offset 0), checking cancel between chunks. */
static int copy_fd(int in, int out, store_cancel c)
{
    int use_cfr = 1;
    char *buf = NULL;
    int rc = 0;
    for (;;) {
        if (store_canceled(c)) {
            rc = ECANCELED;
            break;
        }
        ssize_t n;
        if (use_cfr) {
            n = copy_file_range(in, NULL, out, NULL, COPY_CHUNK, 0);
            if (n < 0 && (errno == EXDEV || errno == ENOSYS || errno == EINVAL ||
                          errno == EOPNOTSUPP)) {
                use_cfr = 0;
                continue;
            }
        } else {
            if (!buf && !(buf = malloc(1 << 20))) {
                rc = ENOMEM;
                break;
            }
            n = read(in, buf, 1 << 20);
            for (ssize_t w = 0, k; n > 0 && w < n; w += k)
                if ((k = write(out, buf + w, (size_t)(n - w))) < 0) {
                    n = -1;
                    break;
                }
        }
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0) {
            rc = errno;
            break;
        }
        if (n == 0)
            break;
    }
    free(buf);
    return rc;
}

/* ---- the backend ------------------------------------------------------------ */

static char *fpath(const store_t *s, const char *key)
{
    const fstore *f = s->impl;
    return sp_strf("%s/%s", strcmp(f->root, "/") ? f->root : "", key);
}

static int io_fail(const store_t *s, sp_err *err, int rc, const char *key, const char *what,
                   int e)
{
    if (e == ECANCELED)
        return store_fail(s, err, STORE_ECANCELED, key, "%s canceled", what);
    return store_fail(s, err, rc, key, "%s failed: %s", what, strerror(e));
}

/* Copies src_fd into a temporary beside dst and publishes it. */
static int copy_publish(int src_fd, const char *dst, int noreplace, store_cancel c)
{
    int e = store_local_mkparents(dst);
    char *tmp = NULL;
    int fd = -1;
    if (!e)
        e = store_local_tmp(dst, &tmp, &fd);
    if (!e) {
        e = copy_fd(src_fd, fd, c);
        if (e) {
            close(fd);
            unlink(tmp);
        } else {
            e = store_local_publish(fd, tmp, dst, noreplace);
        }
    }
    free(tmp);
    return e;
}

static int f_put_file(store_t *s, const char *key, const char *path, int inm, store_cancel c,
                      sp_err *err)
{
    int src = open(path, O_RDONLY | O_CLOEXEC);
    if (src < 0)
        return store_fail(s, err, STORE_ELOCAL, key, "put failed: %s: %s", path, strerror(errno));
    char *dst = fpath(s, key);
    int e = dst ? copy_publish(src, dst, inm, c) : ENOMEM;
    close(src);
    free(dst);
    if (e == EEXIST && inm)
        return store_fail(s, err, STORE_EEXIST, key, "put failed: the object already exists");
    return e ? io_fail(s, err, STORE_EFAIL, key, "put", e) : 0;
}

static int write_all(int fd, const void *data, size_t n)
{
    const char *p = data;
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w < 0)
            return errno;
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

static int f_put_bytes(store_t *s, const char *key, const void *data, size_t n, int inm,
                       store_cancel c, sp_err *err)
{
    char *dst = fpath(s, key), *tmp = NULL;
    int fd = -1, e = dst ? store_local_mkparents(dst) : ENOMEM;
    if (!e)
        e = store_local_tmp(dst, &tmp, &fd);
    if (!e) {
        e = store_canceled(c) ? ECANCELED : write_all(fd, data, n);
        if (e) {
            close(fd);
            unlink(tmp);
        } else {
            e = store_local_publish(fd, tmp, dst, inm);
        }
    }
    free(tmp);
    free(dst);
    if (e == EEXIST && inm)
        return store_fail(s, err, STORE_EEXIST, key, "put failed: the object already exists");
    return e ? io_fail(s, err, STORE_EFAIL, key, "put", e) : 0;
}

/* Compare-and-swap: tag "" links into place (never replaces); else, under an
 * exclusive flock of the object's directory, the file's tag is compared and
 * the new one renamed over it. Where the directory cannot be locked (some
 * network file systems), compared without the lock (not atomic). */
static int f_put_bytes_if(store_t *s, const char *key, const void *data, size_t n,
                          const char *tag, store_cancel c, sp_err *err)
{
    if (!tag[0])
        return f_put_bytes(s, key, data, n, 1, c, err);
    char *dst = fpath(s, key), *dir = dst ? strdup(dst) : NULL;
    if (!dir) {
        free(dst);
        return store_fail(s, err, STORE_EFAIL, key, "put failed: out of memory");
    }
    int d = open(dirname(dir), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    free(dir);
    while (d >= 0 && flock(d, LOCK_EX) != 0 && errno == EINTR)
        ;
    char now[STORE_TAG_MAX];
    int fd = open(dst, O_RDONLY | O_CLOEXEC), e = fd < 0 ? errno : local_tag(fd, now), rc;
    if (fd >= 0)
        close(fd);
    if (e == ENOENT || e == ENOTDIR || (!e && strcmp(now, tag)))
        rc = store_fail(s, err, STORE_EEXIST, key, "put failed: the object is no longer as read");
    else if (e)
        rc = io_fail(s, err, STORE_EFAIL, key, "put", e);
    else
        rc = f_put_bytes(s, key, data, n, 0, c, err);
    if (d >= 0)
        close(d); /* the lock goes with it */
    free(dst);
    return rc;
}

static int f_get_file(store_t *s, const char *key, const char *path, store_cancel c,
                      sp_err *err)
{
    char *src_path = fpath(s, key);
    int src = src_path ? open(src_path, O_RDONLY | O_CLOEXEC) : -1;
    int e = src_path ? errno : ENOMEM;
    free(src_path);
    if (src < 0 && (e == ENOENT || e == ENOTDIR))
        return store_fail(s, err, STORE_ENOENT, key, "get failed: no such object");
    if (src < 0)
        return io_fail(s, err, STORE_EFAIL, key, "get", e);
    e = copy_publish(src, path, 0, c);
    close(src);
    if (e)
        return e == ECANCELED ? io_fail(s, err, STORE_ECANCELED, key, "get", e)
                              : store_fail(s, err, STORE_ELOCAL, key, "get failed: %s: %s", path,
                                           strerror(e));
    return 0;
}

static int f_get_bytes(store_t *s, const char *key, void **data, size_t *n, char *tag,
                       store_cancel c, sp_err *err)
{
    (void)c; /* one local call: nothing to cancel part-way */
    char *p = fpath(s, key);
    int e = p ? local_read_tag(p, data, n, tag) : ENOMEM;
    free(p);
    if (e == ENOENT || e == ENOTDIR)
        return store_fail(s, err, STORE_ENOENT, key, "get failed: no such object");
    return e ? io_fail(s, err, STORE_EFAIL, key, "get", e) : 0;
}

static int f_get_range(store_t *s, const char *key, uint64_t off, size_t n, void *dst,
                       store_cancel c, sp_err *err)
{
    char *p = fpath(s, key);
    int fd = p ? open(p, O_RDONLY | O_CLOEXEC) : -1;
    int e = p ? errno : ENOMEM;
    free(p);
    if (fd < 0 && (e == ENOENT || e == ENOTDIR))
        return store_fail(s, err, STORE_ENOENT, key, "get failed: no such object");
    if (fd < 0)
        return io_fail(s, err, STORE_EFAIL, key, "get", e);
    char *w = dst;
    size_t got = 0;
    e = 0;
    while (got < n && !e) {
        if (store_canceled(c)) {
            e = ECANCELED;
            break;
        }
        size_t want = n - got < COPY_CHUNK ? n - got : COPY_CHUNK;
        ssize_t k = pread(fd, w + got, want, (off_t)(off + got));
        if (k < 0 && errno == EINTR)
            continue;
        if (k < 0)
            e = errno;
        else if (k == 0)
            break; /* end of file */
        else
            got += (size_t)k;
    }
    struct stat st;
    int have_size = !e && got < n && fstat(fd, &st) == 0;
    close(fd);
    if (e)
        return io_fail(s, err, STORE_EFAIL, key, "get", e);
    if (got < n) {
        char size[48] = "";
        if (have_size)
            snprintf(size, sizeof size, "the object has %llu bytes, ",
                     (unsigned long long)st.st_size);
        return store_fail(s, err, STORE_EFAIL, key,
                          "get failed: %sthe range [%llu, %llu) is past its end", size,
                          (unsigned long long)off, (unsigned long long)(off + n));
    }
    return 0;
}

int store_local_walk(const char *dir, const char *rel, const store_walk *w)
{
    DIR *d = opendir(dir);
    if (!d) /* none, or removed meanwhile: nothing below it (when w->tolerant) */
        return w->tolerant && (errno == ENOENT || errno == ENOTDIR) ? 0 : errno;
    int rc = 0;
    struct dirent *e;
    while (!rc && (e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..") ||
            !strncmp(e->d_name, STORE_TMP_MARK, strlen(STORE_TMP_MARK)))
            continue;
        struct stat st;
        char *child_rel = sp_strf("%s%s", rel, e->d_name);
        char *child = sp_strf("%s/%s", dir, e->d_name);
        if (!child_rel || !child)
            rc = ENOMEM;
        else if (store_canceled(w->cancel))
            rc = ECANCELED;
        else if (fstatat(dirfd(d), e->d_name, &st, w->tolerant ? AT_SYMLINK_NOFOLLOW : 0) != 0)
            rc = w->tolerant && errno == ENOENT ? 0 : errno; /* deleted meanwhile */
        else if (S_ISREG(st.st_mode))
            rc = w->file(w->ctx, child_rel, (uint64_t)st.st_size);
        else if (S_ISDIR(st.st_mode)) {
            char *sub = sp_strf("%s/", child_rel);
            rc = !sub ? ENOMEM
                 : !w->enter || w->enter(w->ctx, sub) ? store_local_walk(child, sub, w)
                                                      : 0;
            free(sub);
        }
        free(child_rel);
        free(child);
    }
    closedir(d);
    return rc;
}

typedef struct walk_out {
    store_listing *l;
    size_t cap;
    const char *prefix;
    size_t plen;
} walk_out;

static int list_file(void *ctx, const char *key, uint64_t size)
{
    walk_out *w = ctx;
    if (strncmp(key, w->prefix, w->plen) != 0)
        return 0;
    return store_list_add(w->l, &w->cap, key, size) ? ENOMEM : 0;
}

/* Can a key below directory rel ("a/b/") start with the prefix? */
static int list_enter(void *ctx, const char *rel)
{
    const walk_out *w = ctx;
    size_t n = strlen(rel);
    return strncmp(rel, w->prefix, n < w->plen ? n : w->plen) == 0;
}

static int f_list(store_t *s, const char *prefix, store_listing *out, store_cancel c, sp_err *err)
{
    walk_out w = {out, 0, prefix, strlen(prefix)};
    const fstore *f = s->impl;
    store_walk sw = {list_file, list_enter, &w, c, 1};
    int e = store_local_walk(f->root, "", &sw);
    return e ? io_fail(s, err, STORE_EFAIL, prefix, "list", e) : 0;
}

/* Removes now-empty directories from dirname(path) up to (not including) the root. */
static void prune_empty_parents(const store_t *s, char *path)
{
    const fstore *f = s->impl;
    size_t rootlen = strlen(f->root);
    for (;;) {
        char *slash = strrchr(path, '/');
        if (!slash || (size_t)(slash - path) <= rootlen)
            return;
        *slash = 0;
        if (rmdir(path) != 0)
            return;
    }
}

static int f_del(store_t *s, const char *key, store_cancel c, sp_err *err)
{
    (void)c; /* one local call: nothing to cancel part-way */
    char *p = fpath(s, key);
    if (!p)
        return io_fail(s, err, STORE_EFAIL, key, "delete", ENOMEM);
    int e = unlink(p) == 0 || errno == ENOENT || errno == ENOTDIR ? 0 : errno;
    if (!e)
        prune_empty_parents(s, p);
    free(p);
    return e ? io_fail(s, err, STORE_EFAIL, key, "delete", e) : 0;
}

static int f_exists(store_t *s, const char *key, int *exists, uint64_t *size, store_cancel c,
                    sp_err *err)
{
    (void)c; /* one local call: nothing to cancel part-way */
    char *p = fpath(s, key);
    struct stat st;
    int e = !p ? ENOMEM : stat(p, &st) == 0 ? 0 : errno;
    free(p);
    *exists = !e && S_ISREG(st.st_mode);
    *size = *exists ? (uint64_t)st.st_size : 0;
    if (e == ENOENT || e == ENOTDIR)
        e = 0;
    return e ? io_fail(s, err, STORE_EFAIL, key, "stat", e) : 0;
}

static int f_create_bucket(store_t *s, sp_err *err)
{
    const fstore *f = s->impl;
    int e = store_local_mkdirs(f->root);
    return e ? io_fail(s, err, STORE_EFAIL, NULL, "mkdir", e) : 0;
}

static void f_close(store_t *s)
{
    fstore *f = s->impl;
    if (f)
        free(f->root);
    free(f);
}

static const store_ops file_ops = {
    .put_file = f_put_file,
    .put_bytes = f_put_bytes,
    .get_file = f_get_file,
    .get_bytes = f_get_bytes,
    .put_bytes_if = f_put_bytes_if,
    .get_range = f_get_range,
    .list = f_list,
    .del = f_del,
    .exists = f_exists,
    .create_bucket = f_create_bucket,
    .close = f_close,
};

int store_file_open(store_t *s, const char *root, sp_err *err)
{
    struct stat st;
    if (stat(root, &st) == 0 && !S_ISDIR(st.st_mode))
        return store_fail(s, err, STORE_EUSAGE, NULL, "not a directory");
    fstore *f = calloc(1, sizeof *f);
    if (!f || !(f->root = strdup(root))) {
        free(f);
        return store_fail(s, err, STORE_EFAIL, NULL, "out of memory");
    }
    s->impl = f;
    s->ops = &file_ops;
    return 0;
}
