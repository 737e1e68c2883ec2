/* Checkpoint directories: listing (complete, damaged, being written or
 * interrupted), choosing the newest that verifies, and retention. */
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

/* ---- listing and retention ------------------------------------------------------- */

static uint64_t dir_bytes(const char *dir)
{
    DIR *d = opendir(dir);
    uint64_t total = 0;
    struct dirent *e;
    while (d && (e = readdir(d))) {
        struct stat sb;
        char *p = e->d_name[0] != '.' ? sp_strf("%s/%s", dir, e->d_name) : NULL;
        if (p && stat(p, &sb) == 0 && S_ISREG(sb.st_mode))
            total += (uint64_t)sb.st_size;
        free(p);
    }
    if (d)
        closedir(d);
    return total;
}

/* The process id at the end of a ".tmp-step-NNNNNNNN-PID" or ".del-...-PID"
 * name (0 if none), and whether that process is alive and not this one: a
 * writer (or deleter) that may still be at work (a zombie is not). */
static int other_writer_alive(const char *name, int *pid_out)
{
    const char *dash = strrchr(name, '-');
    char *end = NULL;
    long pid = dash ? strtol(dash + 1, &end, 10) : 0;
    if (!dash || end == dash + 1 || *end || pid <= 0 || pid > 0x7fffffffL)
        pid = 0;
    if (pid_out)
        *pid_out = (int)pid;
    if (pid <= 0 || pid == (long)getpid())
        return 0;
    return sp_pid_running(pid);
}

static int cmp_info(const void *a, const void *b)
{
    const ckpt_info *x = a, *y = b;
    if (x->step != y->step)
        return x->step > y->step ? -1 : 1;
    return strcmp(x->name, y->name);
}

int ckpt_list(const char *root, int verify, ckpt_info **out, int *n, sp_err *err)
{
    *out = NULL;
    *n = 0;
    DIR *d = opendir(root);
    if (!d)
        return errno == ENOENT ? 0 : sp_fail(err, SP_EXIT_INPUT, "%s: %s", root, strerror(errno));
    struct dirent *e;
    int cap = 0, rc = 0;
    while ((e = readdir(d))) {
        long long step;
        char tail[8];
        const char *num = sp_after(e->d_name, ".tmp-step-");
        int tmp = num != NULL;
        if (!tmp && (!(num = sp_after(e->d_name, "step-")) ||
                     sscanf(num, "%lld%7s", &step, tail) != 1))
            continue;
        if (tmp && sscanf(num, "%lld", &step) != 1)
            continue;
        if (strlen(e->d_name) >= sizeof (*out)->name)
            continue; /* not a name spotune writes; never acted on by a cut name */
        if (*n == cap) {
            cap = cap ? 2 * cap : 16;
            ckpt_info *g = realloc(*out, sizeof *g * (size_t)cap);
            if (!g) {
                rc = sp_fail(err, SP_EXIT_OTHER, "out of memory");
                break;
            }
            *out = g;
        }
        ckpt_info *ci = &(*out)[(*n)++];
        memset(ci, 0, sizeof *ci);
        memcpy(ci->name, e->d_name, strlen(e->d_name) + 1); /* it fits: checked above */
        ci->step = step;
        char *path = sp_strf("%s/%s", root, e->d_name);
        if (!path) {
            rc = sp_fail(err, SP_EXIT_OTHER, "out of memory");
            break;
        }
        ci->bytes = dir_bytes(path);
        if (tmp) {
            int pid;
            if (other_writer_alive(e->d_name, &pid)) {
                ci->incomplete = CKPT_BEING_WRITTEN;
                snprintf(ci->problem, sizeof ci->problem,
                         "incomplete: being written by process %d (still running)", pid);
            } else {
                ci->incomplete = CKPT_INTERRUPTED;
                if (pid > 0)
                    snprintf(ci->problem, sizeof ci->problem,
                             "incomplete: its write never finished (the writing process %d "
                             "is gone)", pid);
                else
                    snprintf(ci->problem, sizeof ci->problem,
                             "incomplete: its write never finished");
            }
            ci->writer_pid = pid;
        } else if (!verify) {
            ci->ok = 1;
        } else {
            sp_err ve = {0};
            ckpt_manifest m;
            memset(&m, 0, sizeof m);
            if (ckpt_verify(path, &m, &ve) == 0)
                ci->ok = 1;
            else /* a report: a long message is cut */
                sp_cutf(ci->problem, sizeof ci->problem, "%s", ve.msg);
            ci->created = m.created; /* also of a damaged one whose MANIFEST reads */
            ckpt_manifest_free(&m);
        }
        free(path);
    }
    closedir(d);
    if (*n)
        qsort(*out, (size_t)*n, sizeof **out, cmp_info);
    return rc;
}

int ckpt_find_latest(const char *root, char *path, size_t n, int *found,
                     void (*report)(void *ctx, const ckpt_info *bad), void *ctx, sp_err *err)
{
    return ckpt_find_latest_if(root, path, n, found, NULL, report, ctx, err);
}

int ckpt_find_latest_if(const char *root, char *path, size_t n, int *found,
                        int (*accept)(void *ctx, const char *dir, char *problem, size_t n),
                        void (*report)(void *ctx, const ckpt_info *bad), void *ctx,
                        sp_err *err)
{
    ckpt_info *list;
    int count, rc = 0;
    *found = 0;
    if (ckpt_list(root, 1, &list, &count, err))
        return err->code;
    for (int i = 0; i < count; i++) {
        ckpt_info *ci = &list[i];
        if (ci->incomplete) {
            /* a write that never finished: never a candidate; reported, and
             * removed unless another live process is still writing it */
            size_t len = strlen(ci->problem);
            if (ci->incomplete == CKPT_INTERRUPTED) {
                char *dead = sp_strf("%s/%s", root, ci->name);
                if (dead && ckpt_remove_tree(dead) == 0)
                    sp_cutf(ci->problem + len, sizeof ci->problem - len, "; removed");
                else
                    sp_cutf(ci->problem + len, sizeof ci->problem - len,
                            "; could not remove it: %s", strerror(errno));
                free(dead);
            } else {
                sp_cutf(ci->problem + len, sizeof ci->problem - len, "; left alone");
            }
            if (report)
                report(ctx, ci);
            continue;
        }
        if (*found)
            continue;
        if (ci->ok) {
            if (sp_fitf(path, n, "%s/%s", root, ci->name) != 0) {
                rc = sp_fail(err, SP_EXIT_OTHER, "%s/%s: %s", root, ci->name, strerror(errno));
                break;
            }
            if (accept && accept(ctx, path, ci->problem, sizeof ci->problem)) {
                if (report)
                    report(ctx, ci);
                continue;
            }
            *found = 1;
        } else if (report) {
            report(ctx, ci);
        }
    }
    free(list);
    return rc;
}

/* .del- directories whose deleting process died */
static void remove_leftovers(const char *root)
{
    DIR *d = opendir(root);
    struct dirent *e;
    while (d && (e = readdir(d))) {
        if (!sp_after(e->d_name, ".del-"))
            continue;
        if (other_writer_alive(e->d_name, NULL))
            continue;
        char *p = sp_strf("%s/%s", root, e->d_name);
        if (p)
            ckpt_remove_tree(p);
        free(p);
    }
    if (d)
        closedir(d);
}

/* Deletes checkpoint root/name: out of sight first (an atomic rename), then
 * deleted, so a crash in between leaves a .del- directory, never a
 * half-deleted step- one. 0 when it is gone. */
static int delete_checkpoint(const char *root, const char *name)
{
    char *path = sp_strf("%s/%s", root, name);
    char *gone = sp_strf("%s/.del-%s-%d", root, name, (int)getpid());
    int rc = -1;
    if (path && gone && rename(path, gone) == 0) {
        ckpt_fsync_path(root, 1);
        rc = ckpt_remove_tree(gone);
    }
    free(path);
    free(gone);
    return rc;
}

int ckpt_prune(const char *root, int keep, int64_t keep_every,
               void (*deleted)(void *ctx, const char *name), void *ctx, sp_err *err)
{
    ckpt_info *list;
    int count, kept = 0;
    remove_leftovers(root);
    if (ckpt_list(root, 0, &list, &count, err))
        return err->code;
    for (int i = 0; i < count; i++) {
        ckpt_info *ci = &list[i];
        if (ci->incomplete) {
            /* a leftover of a crashed writer; one of another live process is
             * left to it (this process's own write is not under way: the
             * writer prunes after committing) */
            char *path = sp_strf("%s/%s", root, ci->name);
            if (path && ci->incomplete == CKPT_INTERRUPTED && ci->writer_pid > 0 &&
                ci->writer_pid != (int)getpid())
                ckpt_remove_tree(path);
            free(path);
            continue;
        }
        int keep_this = kept < keep || (keep_every > 0 && ci->step % keep_every == 0);
        if (kept < keep)
            kept++;
        if (!keep_this && delete_checkpoint(root, ci->name) == 0 && deleted)
            deleted(ctx, ci->name);
    }
    free(list);
    return 0;
}
