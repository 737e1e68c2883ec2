/* A sharded checkpoint pulled from a store without its shard files
 * (ckpt.h, ckpt_pull_unsharded): what a resume needs on one machine
 * (MANIFEST.json, state.h5, metrics), while every rank reads its own ranges
 * of the shards from the store. */
#define _GNU_SOURCE
#include "ckpt.h"
#include "ckpt_internal.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "store.h"

static int is_shard(json_t *shards, const char *name)
{
    size_t i;
    json_t *s;
    json_array_foreach(shards, i, s)
    {
        const char *f = json_string_value(json_object_get(s, "file"));
        if (f && strcmp(f, name) == 0)
            return 1;
    }
    return 0;
}

/* A file name from a MANIFEST that stays inside the directory. */
static int safe_name(const char *name)
{
    return name[0] && name[0] != '/' && !strstr(name, "..") && strcmp(name, CKPT_MANIFEST) != 0;
}

/* One file of the MANIFEST: a shard checked in the store, any other pulled
 * into dir and checked. */
static int pull_one(store_t *st, const char *prefix, const char *dir, const char *name,
                    json_t *want, int shard, int *corrupt, sp_err *err)
{
    json_int_t size = json_integer_value(json_object_get(want, "size"));
    const char *sha = json_string_value(json_object_get(want, "sha256"));
    char *key = sp_strf("%s/%s", prefix, name), *path = sp_strf("%s/%s", dir, name);
    int rc = 0;
    if (!key || !path) {
        rc = sp_fail(err, SP_EXIT_OTHER, "out of memory");
    } else if (!safe_name(name) || !sha || size < 0) {
        *corrupt = 1;
        rc = sp_fail(err, SP_EXIT_INPUT, "%s/%s/%s: MANIFEST.json lists '%s' without a size "
                     "and SHA-256, or outside the checkpoint", store_url(st), prefix, CKPT_MANIFEST,
                     name);
    } else if (shard) {
        int exists = 0;
        uint64_t have = 0;
        if (store_exists(st, key, &exists, &have, err))
            rc = err->code ? err->code : SP_EXIT_OTHER;
        else if (!exists || have != (uint64_t)size) {
            *corrupt = 1;
            rc = exists ? sp_fail(err, SP_EXIT_INPUT,
                                  "%s/%s: the store has %llu bytes, MANIFEST.json says %lld",
                                  store_url(st), key, (unsigned long long)have, (long long)size)
                        : sp_fail(err, SP_EXIT_INPUT, "%s/%s: missing from the store",
                                  store_url(st), key);
        }
    } else if (store_get_file(st, key, path, err)) {
        if (err->code == SP_EXIT_INPUT)
            *corrupt = 1; /* missing */
        rc = err->code ? err->code : SP_EXIT_OTHER;
    } else {
        char hex[65];
        uint64_t got = 0;
        if (ckpt_file_sha256(path, hex, &got, err))
            rc = err->code;
        else if (got != (uint64_t)size || strcmp(hex, sha) != 0) {
            *corrupt = 1;
            rc = sp_fail(err, SP_EXIT_INPUT,
                         "%s/%s: does not match its size and SHA-256 in MANIFEST.json",
                         store_url(st), key);
        }
    }
    free(key);
    free(path);
    return rc;
}

int ckpt_pull_unsharded(store_t *st, const char *prefix, const char *manifest,
                        const char *local_dir, int *corrupt, sp_err *err)
{
    int dummy = 0;
    if (!corrupt)
        corrupt = &dummy;
    *corrupt = 0;
    json_error_t je;
    json_t *j = json_loads(manifest, 0, &je);
    json_t *files = json_object_get(j, "files");
    json_t *shards = json_object_get(json_object_get(j, "layout"), "shards");
    if (!json_is_object(files) || !json_is_array(shards)) {
        json_decref(j);
        *corrupt = 1;
        return sp_fail(err, SP_EXIT_INPUT, "%s/%s/%s: not a sharded checkpoint's MANIFEST",
                       store_url(st), prefix, CKPT_MANIFEST);
    }
    ckpt_remove_tree(local_dir);
    int rc = 0;
    if (mkdir(local_dir, 0755) != 0)
        rc = sp_fail(err, SP_EXIT_OTHER, "%s: cannot create: %m", local_dir);
    const char *name;
    json_t *want;
    json_object_foreach(files, name, want)
    {
        if (rc)
            break;
        rc = pull_one(st, prefix, local_dir, name, want, is_shard(shards, name), corrupt, err);
    }
    char *path = rc ? NULL : sp_strf("%s/%s", local_dir, CKPT_MANIFEST);
    FILE *f = path ? fopen(path, "w") : NULL;
    if (!rc && (!f || fputs(manifest, f) == EOF)) {
        rc = sp_fail(err, SP_EXIT_OTHER, "%s: cannot write: %m", path ? path : local_dir);
    }
    if (f && fclose(f) != 0 && !rc)
        rc = sp_fail(err, SP_EXIT_OTHER, "%s: cannot write: %m", path);
    if (!rc && ckpt_fsync_path(path, 0) != 0)
        rc = sp_fail(err, SP_EXIT_OTHER, "%s: cannot sync: %m", path);
    free(path);
    json_decref(j);
    if (rc)
        ckpt_remove_tree(local_dir);
    return rc;
}
