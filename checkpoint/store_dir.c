/* checkpoint/store_dir.c — checkpoint directories over any store: push
 * (every file, then MANIFEST.json last and never over a different one), pull
 * (into a temporary sibling directory, then one rename) and retention over
 * "step-<digits>/" (MANIFEST.json deleted first, so a half-deleted checkpoint
 * is never complete). Works only through the backend table. */
#define _GNU_SOURCE
#include "checkpoint/store_impl.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define MANIFEST "MANIFEST.json"

static store_cancel xcancel(const store_xfer_opts *x)
{
    return x ? x->cancel : NULL;
}

static void notify(const store_xfer_opts *x, const char *key)
{
    if (x && x->on_key)
        x->on_key(x->arg, key);
}

/* "step-1/" or "step-1" -> "step-1", checked. */
static int norm_prefix(store_t *s, const char *prefix, char **out, sp_err *err)
{
    char *p = strdup(prefix ? prefix : "");
    *out = NULL;
    if (!p)
        return store_fail(s, err, STORE_EFAIL, NULL, "out of memory");
    size_t n = strlen(p);
    while (n > 0 && p[n - 1] == '/')
        p[--n] = 0;
    int rc = store_check_key(s, p, 0, err);
    if (rc)
        free(p);
    else
        *out = p;
    return rc;
}

/* ---- push ------------------------------------------------------------------- */

typedef struct name_list {
    char **v;
    size_t n, cap;
} name_list;

static int names_add(name_list *l, char *name)
{
    if (!name)
        return ENOMEM;
    if (l->n == l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 16;
        char **v = realloc(l->v, cap * sizeof *v);
        if (!v) {
            free(name);
            return ENOMEM;
        }
        l->v = v;
        l->cap = cap;
    }
    l->v[l->n++] = name;
    return 0;
}

static void names_free(name_list *l)
{
    for (size_t i = 0; i < l->n; i++)
        free(l->v[i]);
    free(l->v);
}

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static int add_name(void *ctx, const char *rel, uint64_t size)
{
    (void)size;
    return names_add(ctx, strdup(rel)); /* (it takes the copy, and says ENOMEM for NULL) */
}

/* Regular files below dir, as paths relative to the top ("a/b.h5"). */
static int local_files(const char *dir, name_list *out)
{
    store_walk w = {add_name, NULL, out, NULL, 0};
    return store_local_walk(dir, "", &w);
}

/* 0: no remote MANIFEST; 1: identical to data; < 0: error (STORE_EEXIST: different). */
static int remote_manifest(store_t *s, const char *mkey, const void *data, size_t n,
                           store_cancel c, sp_err *err)
{
    void *remote = NULL;
    size_t rn = 0;
    sp_err e1 = {0};
    int rc = s->ops->get_bytes(s, mkey, &remote, &rn, NULL, c, &e1);
    if (rc == STORE_ENOENT)
        return 0;
    if (rc) {
        if (!err->code)
            *err = e1;
        return rc;
    }
    int same = rn == n && !memcmp(remote, data, n);
    free(remote);
    if (!same)
        return store_fail(s, err, STORE_EEXIST, mkey,
                          "a different checkpoint is already there (its MANIFEST.json differs); "
                          "not overwritten");
    return 1;
}

/* A sharded checkpoint's shard file, which its rank puts itself. */
static int rank_shard(const char *name, const store_xfer_opts *x)
{
    size_t n = strlen(name);
    return x && x->shards_put_by_ranks && !strchr(name, '/') && !strncmp(name, "shard-", 6) &&
           n > 3 && !strcmp(name + n - 3, ".h5");
}

/* Waits until every shard file MANIFEST (man, mn bytes) lists is in the
 * store with the size MANIFEST gives (x->shards_wait_s at most): the ranks
 * put them, some from machines whose files this one never sees. A shard
 * still missing then that local_dir holds with its size (run.dir shared by
 * the ranks: the rank's own put failed for good) is put from here. */
static int await_rank_shards(store_t *s, const char *local_dir, const void *man, size_t mn,
                             const char *pfx, const store_xfer_opts *x, sp_err *err)
{
    double until = sp_now() + x->shards_wait_s;
    json_t *j = json_loadb(man, mn, 0, NULL), *files = json_object_get(j, "files");
    if (!json_is_object(files)) {
        json_decref(j);
        return store_fail(s, err, STORE_ELOCAL, pfx, "push: MANIFEST.json lists no files");
    }
    const char *name;
    json_t *f;
    int rc = 0;
    json_object_foreach(files, name, f)
    {
        json_t *sz = json_object_get(f, "size");
        if (!rank_shard(name, x))
            continue;
        char *key = sp_strf("%s/%s", pfx, name);
        rc = !key ? store_fail(s, err, STORE_EFAIL, pfx, "out of memory")
             : !json_is_integer(sz)
                 ? store_fail(s, err, STORE_ELOCAL, pfx, "push: MANIFEST.json: %s has no size", name)
                 : 0;
        for (;;) {
            int there = 0;
            uint64_t size = 0;
            sp_err e1 = {0};
            if (rc || (s->ops->exists(s, key, &there, &size, xcancel(x), &e1) == 0 && there &&
                       size == (uint64_t)json_integer_value(sz)))
                break;
            if (x->cancel && atomic_load(x->cancel)) {
                rc = store_fail(s, err, STORE_ECANCELED, key, "canceled");
                break;
            }
            if (sp_now() >= until) {
                char *path = sp_strf("%s/%s", local_dir, name);
                struct stat sb;
                sp_err pe = {0};
                int local = path && stat(path, &sb) == 0 && S_ISREG(sb.st_mode) &&
                            (uint64_t)sb.st_size == (uint64_t)json_integer_value(sz);
                int prc = local ? s->ops->put_file(s, key, path, 0, xcancel(x), &pe) : -1;
                free(path);
                if (prc == 0) {
                    notify(x, key);
                    break;
                }
                /* still the peer's shard missing: a newer checkpoint waiting
                 * is worth more than trying this one again (uploader.c) */
                if (local) {
                    rc = store_fail(s, err, STORE_EPEER, key,
                                    "its rank has not put it in %.0f s, and putting it from "
                                    "here failed too (%s); MANIFEST.json not pushed",
                                    x->shards_wait_s, pe.msg);
                    break;
                }
                rc = store_fail(s, err, STORE_EPEER, key,
                                "its rank has not put it in %.0f s; MANIFEST.json not pushed",
                                x->shards_wait_s);
                break;
            }
            struct timespec ts = {0, 100 * 1000 * 1000};
            nanosleep(&ts, NULL);
        }
        free(key);
        if (rc)
            break;
    }
    json_decref(j);
    return rc;
}

static int push_files(store_t *s, const char *local_dir, const char *pfx, const name_list *files,
                      const store_xfer_opts *x, sp_err *err)
{
    int rc = 0;
    for (size_t i = 0; i < files->n && !rc; i++) {
        if (!strcmp(files->v[i], MANIFEST) || rank_shard(files->v[i], x))
            continue;
        char *key = sp_strf("%s/%s", pfx, files->v[i]);
        char *path = sp_strf("%s/%s", local_dir, files->v[i]);
        if (!key || !path)
            rc = store_fail(s, err, STORE_EFAIL, pfx, "out of memory");
        else if (!(rc = store_check_key(s, key, 0, err)))
            rc = s->ops->put_file(s, key, path, 0, xcancel(x), err);
        if (!rc)
            notify(x, key);
        free(key);
        free(path);
    }
    return rc;
}

static int push_manifest(store_t *s, const char *mkey, const void *data, size_t n,
                         const store_xfer_opts *x, sp_err *err)
{
    sp_err e1 = {0};
    int rc = s->ops->put_bytes(s, mkey, data, n, 1, xcancel(x), &e1);
    if (rc == STORE_EEXIST) /* e.g. our own earlier attempt whose answer was lost */
        rc = remote_manifest(s, mkey, data, n, xcancel(x), err) == 1 ? 0 : STORE_EEXIST;
    else if (rc && !err->code)
        *err = e1;
    if (!rc)
        notify(x, mkey);
    return rc;
}

int store_push_dir(store_t *s, const char *local_dir, const char *prefix,
                   const store_xfer_opts *x, sp_err *err)
{
    char *pfx;
    int prc = norm_prefix(s, prefix, &pfx, err);
    if (prc)
        return prc;
    char *mpath = sp_strf("%s/" MANIFEST, local_dir);
    char *mkey = sp_strf("%s/" MANIFEST, pfx);
    void *man = NULL;
    size_t mn = 0;
    name_list files = {0};
    int rc = !mpath || !mkey ? store_fail(s, err, STORE_EFAIL, pfx, "out of memory") : 0;
    int e = rc ? 0 : store_local_read(mpath, &man, &mn);
    if (e)
        rc = store_fail(s, err, STORE_ELOCAL, pfx, "push of %s: %s: %s", local_dir,
                        e == ENOENT ? "no MANIFEST.json (not a complete checkpoint)" : mpath,
                        strerror(e));
    if (!rc)
        rc = remote_manifest(s, mkey, man, mn, xcancel(x), err);
    if (rc == 0) {
        if ((e = local_files(local_dir, &files)) != 0)
            rc = store_fail(s, err, STORE_ELOCAL, pfx, "push: %s: %s", local_dir, strerror(e));
        else
            qsort(files.v, files.n, sizeof *files.v, cmp_str);
        if (!rc)
            rc = push_files(s, local_dir, pfx, &files, x, err);
        if (!rc && x && x->shards_put_by_ranks)
            rc = await_rank_shards(s, local_dir, man, mn, pfx, x, err);
        if (!rc)
            rc = push_manifest(s, mkey, man, mn, x, err);
    }
    names_free(&files);
    free(man);
    free(mpath);
    free(mkey);
    free(pfx);
    return rc < 0 ? rc : 0; /* 1: already pushed */
}

/* ---- pull ------------------------------------------------------------------- */

static int fsync_dir(const char *dir)
{
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0)
        return errno;
    int rc = fsync(fd) == 0 || errno == EINVAL ? 0 : errno;
    close(fd);
    return rc;
}

static int pull_into(store_t *s, const store_listing *l, size_t strip, const char *tmp,
                     const store_xfer_opts *x, sp_err *err)
{
    int rc = 0;
    for (size_t i = 0; i < l->n && !rc; i++) {
        const char *rel = l->items[i].key + strip;
        if ((rc = store_check_key(s, rel, 0, err)) != 0) /* no "../" from a hostile listing */
            break;
        char *dst = sp_strf("%s/%s", tmp, rel);
        rc = dst ? s->ops->get_file(s, l->items[i].key, dst, xcancel(x), err)
                 : store_fail(s, err, STORE_EFAIL, NULL, "out of memory");
        if (!rc)
            notify(x, l->items[i].key);
        free(dst);
    }
    return rc;
}

static int make_tmp_dir(store_t *s, const char *local_dir, char **tmp, sp_err *err)
{
    struct stat st;
    if (lstat(local_dir, &st) == 0)
        return store_fail(s, err, STORE_ELOCAL, NULL, "pull: %s already exists", local_dir);
    int e = store_local_mkparents(local_dir);
    *tmp = e ? NULL : sp_strf("%s" STORE_TMP_MARK "pull.XXXXXX", local_dir);
    if (!e && (!*tmp || !mkdtemp(*tmp)))
        e = *tmp ? errno : ENOMEM;
    /* mkdtemp makes it 0700; a published checkpoint gets the mode of the
     * ones the writer makes under the usual umask (umask itself is process
     * wide, so it is not read here while other threads may create files) */
    if (!e && chmod(*tmp, 0755) != 0)
        e = errno;
    if (e) {
        free(*tmp);
        *tmp = NULL;
        return store_fail(s, err, STORE_ELOCAL, NULL, "pull: %s: %s", local_dir, strerror(e));
    }
    return 0;
}

static int publish_dir(store_t *s, const char *tmp, const char *local_dir, sp_err *err)
{
    int e = fsync_dir(tmp);
    if (!e && rename(tmp, local_dir) != 0)
        e = errno;
    if (!e) {
        char *parent = sp_strf("%s/..", local_dir);
        e = parent ? fsync_dir(parent) : 0;
        free(parent);
    }
    return e ? store_fail(s, err, STORE_ELOCAL, NULL, "pull: %s: %s", local_dir, strerror(e)) : 0;
}

int store_pull_dir(store_t *s, const char *prefix, const char *local_dir,
                   const store_xfer_opts *x, sp_err *err)
{
    char *pfx;
    int prc = norm_prefix(s, prefix, &pfx, err);
    if (prc)
        return prc;
    char *lp = sp_strf("%s/", pfx), *tmp = NULL;
    store_listing l = {0};
    int rc = lp ? s->ops->list(s, lp, &l, xcancel(x), err)
                : store_fail(s, err, STORE_EFAIL, pfx, "out of memory");
    if (!rc && l.n == 0)
        rc = store_fail(s, err, STORE_ENOENT, lp, "pull: no objects under this prefix");
    if (!rc)
        rc = make_tmp_dir(s, local_dir, &tmp, err);
    if (!rc)
        rc = pull_into(s, &l, strlen(lp), tmp, x, err);
    if (!rc)
        rc = publish_dir(s, tmp, local_dir, err);
    if (rc && tmp)
        store_local_rmtree(tmp);
    store_list_free(&l);
    free(tmp);
    free(lp);
    free(pfx);
    return rc;
}

/* ---- retention -------------------------------------------------------------- */

typedef struct step_dir {
    uint64_t step;
    size_t first, count; /* range in the sorted listing */
    size_t name_len;     /* "step-00000100/" */
    int complete;
    int keep;
} step_dir;

/* Length of "step-<digits>/" at the start of key, or 0. */
static size_t step_name(const char *key, uint64_t *step)
{
    const char *d = sp_after(key, "step-");
    char *end;
    if (!d || *d < '0' || *d > '9')
        return 0;
    errno = 0;
    unsigned long long v = strtoull(d, &end, 10);
    if (*end != '/' || errno)
        return 0;
    *step = v;
    return (size_t)(end - key) + 1;
}

static int cmp_step(const void *a, const void *b)
{
    uint64_t x = ((const step_dir *)a)->step, y = ((const step_dir *)b)->step;
    return x < y ? -1 : x > y;
}

/* Groups a sorted listing into checkpoint directories (sorted by step). */
static step_dir *group_steps(const store_listing *l, size_t *n)
{
    step_dir *v = calloc(l->n ? l->n : 1, sizeof *v);
    *n = 0;
    for (size_t i = 0; v && i < l->n; i++) {
        uint64_t step;
        size_t len = step_name(l->items[i].key, &step);
        if (!len)
            continue;
        step_dir *last = *n ? &v[*n - 1] : NULL;
        if (!last || last->name_len != len || strncmp(l->items[last->first].key, l->items[i].key, len))
            v[(*n)++] = (step_dir){step, i, 0, len, 0, 0};
        step_dir *cur = &v[*n - 1];
        cur->count++;
        if (!strcmp(l->items[i].key + len, MANIFEST))
            cur->complete = 1;
    }
    if (v)
        qsort(v, *n, sizeof *v, cmp_step);
    return v;
}

static void mark_kept(step_dir *v, size_t n, int keep, int keep_every)
{
    int left = keep;
    for (size_t i = n; i-- > 0;) {
        if (!v[i].complete)
            continue;
        if (left > 0) {
            v[i].keep = 1;
            left--;
        }
        if (keep_every > 0 && v[i].step % (uint64_t)keep_every == 0)
            v[i].keep = 1;
    }
}

static int delete_step(store_t *s, const store_listing *l, const step_dir *d,
                       const store_xfer_opts *x, sp_err *err)
{
    int rc = 0;
    for (size_t i = d->first; i < d->first + d->count && !rc; i++) /* MANIFEST first */
        if (!strcmp(l->items[i].key + d->name_len, MANIFEST)) {
            rc = s->ops->del(s, l->items[i].key, xcancel(x), err);
            if (!rc)
                notify(x, l->items[i].key);
        }
    for (size_t i = d->first; i < d->first + d->count && !rc; i++)
        if (strcmp(l->items[i].key + d->name_len, MANIFEST)) {
            rc = s->ops->del(s, l->items[i].key, xcancel(x), err);
            if (!rc)
                notify(x, l->items[i].key);
        }
    return rc;
}

int store_prune_steps(store_t *s, int keep, int keep_every, const store_xfer_opts *x,
                      int *n_pruned, sp_err *err)
{
    if (n_pruned)
        *n_pruned = 0;
    if (keep < 1)
        return store_fail(s, err, STORE_EUSAGE, NULL, "prune: keep must be >= 1 (got %d)", keep);
    store_listing l = {0};
    int rc = store_list(s, "step-", &l, err); /* sorted */
    size_t n = 0;
    step_dir *v = rc ? NULL : group_steps(&l, &n);
    if (!rc && !v)
        rc = store_fail(s, err, STORE_EFAIL, NULL, "out of memory");
    uint64_t newest = 0;
    int any_complete = 0;
    for (size_t i = 0; !rc && i < n; i++)
        if (v[i].complete) {
            newest = v[i].step;
            any_complete = 1;
        }
    if (!rc)
        mark_kept(v, n, keep, keep_every);
    for (size_t i = 0; !rc && i < n; i++) {
        if (v[i].keep || (!v[i].complete && (!any_complete || v[i].step >= newest)))
            continue; /* kept, or possibly an upload in flight */
        rc = delete_step(s, &l, &v[i], x, err);
        if (!rc && n_pruned)
            (*n_pruned)++;
    }
    free(v);
    store_list_free(&l);
    return rc;
}
