/* tests/test_store_util.c — shared code of the store suites (see the header). */
#define _GNU_SOURCE
#include "test_store_util.h"

#include <criterion/criterion.h>
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <time.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

char *tu_unique(const char *tag)
{
    struct timeval tv;
    gettimeofday(&tv, NULL);
    char *s = NULL;
    cr_assert(asprintf(&s, "%s-%d-%ld%06ld", tag, (int)getpid(), (long)tv.tv_sec % 100000,
                       (long)tv.tv_usec) > 0);
    return s;
}

void *tu_random_bytes(size_t n, uint64_t seed)
{
    uint8_t *p = malloc(n ? n : 1);
    cr_assert_not_null(p);
    for (size_t i = 0; i < n; i += 8) {
        uint64_t v = sp_rng_u64(seed, i / 8);
        memcpy(p + i, &v, n - i < 8 ? n - i : 8);
    }
    return p;
}

void tu_write_bytes(const char *path, const void *data, size_t n)
{
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f, "fopen %s", path);
    cr_assert_eq(fwrite(data, 1, n, f), n);
    cr_assert_eq(fclose(f), 0);
}

void tu_random_file(const char *path, size_t n, uint64_t seed)
{
    void *p = tu_random_bytes(n, seed);
    tu_write_bytes(path, p, n);
    free(p);
}

int tu_files_equal(const char *a, const char *b)
{
    FILE *fa = fopen(a, "rb"), *fb = fopen(b, "rb");
    int same = fa && fb;
    char x[65536], y[65536];
    while (same) {
        size_t na = fread(x, 1, sizeof x, fa), nb = fread(y, 1, sizeof y, fb);
        if (na != nb || memcmp(x, y, na))
            same = 0;
        if (na == 0 || !same)
            break;
    }
    if (fa)
        fclose(fa);
    if (fb)
        fclose(fb);
    return same;
}

int tu_run(char *const argv[], const char *out_path)
{
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    if (out_path)
        posix_spawn_file_actions_addopen(&fa, 1, out_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    pid_t pid;
    int rc = posix_spawnp(&pid, argv[0], &fa, NULL, argv, environ);
    posix_spawn_file_actions_destroy(&fa);
    cr_assert_eq(rc, 0, "cannot run %s", argv[0]);
    int st = 0;
    cr_assert_eq(waitpid(pid, &st, 0), pid);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

int tu_swift(const char *cmd, const char *arg)
{
    char *script = NULL;
    cr_assert(asprintf(&script, "%s/scripts/swift-s3.sh", SPOTUNE_SOURCE_DIR) > 0);
    char *argv[] = {"bash", script, (char *)cmd, (char *)arg, NULL};
    int rc = tu_run(argv, NULL);
    free(script);
    return rc;
}

store_t *tu_s3_open(const char *tag, store_opts *o, char **url)
{
    store_opts local = {0};
    if (!o)
        o = &local;
    o->endpoint = tu_s3_endpoint();
    char *prefix = tu_unique(tag), *u = NULL;
    cr_assert(asprintf(&u, "s3://" TU_BUCKET "/%s", prefix) > 0);
    free(prefix);
    store_t *s = NULL;
    sp_err err = {0};
    int rc = store_open(&s, u, o, &err);
    cr_assert_eq(rc, 0, "store_open %s: %s", u, err.msg);
    rc = store_create_bucket(s, &err);
    cr_assert_eq(rc, 0, "create bucket: %s", err.msg);
    if (url)
        *url = u;
    else
        free(u);
    return s;
}

char *tu_s3_full_key(const char *url, const char *key)
{
    const char *p = strncmp(url, "s3://", 5) ? NULL : strchr(url + 5, '/');
    cr_assert(p, "not an s3:// URL with a prefix: %s", url);
    char *k = NULL;
    cr_assert(asprintf(&k, "%s/%s", p + 1, key) > 0);
    return k;
}

int tu_aws(const char *out_path, ...)
{
    cr_assert_eq(access("/usr/bin/aws", X_OK), 0,
                 "awscli missing: scripts/install-s3-test-deps.sh");
    setenv("AWS_EC2_METADATA_DISABLED", "true", 1);
    setenv("AWS_PAGER", "", 1);
    setenv("AWS_DEFAULT_REGION", "us-east-1", 1);
    char *argv[32] = {"/usr/bin/aws", "--endpoint-url", (char *)tu_s3_endpoint()};
    int n = 3;
    va_list ap;
    va_start(ap, out_path);
    for (const char *a; (a = va_arg(ap, const char *)) != NULL;) {
        cr_assert_lt(n, 31, "too many awscli arguments");
        argv[n++] = (char *)a;
    }
    va_end(ap);
    argv[n] = NULL;
    return tu_run(argv, out_path);
}

int tu_s3_uploads_in_progress(const char *full_key)
{
    char *dir = tu_tempdir("mpu"), *out = NULL;
    cr_assert(dir);
    cr_assert(asprintf(&out, "%s/uploads.json", dir) > 0);
    /* the key itself as the prefix: its uploads, and those of longer keys */
    int rc = tu_aws(out, "s3api", "list-multipart-uploads", "--bucket", TU_BUCKET, "--prefix",
                    full_key, "--query", "Uploads[].Key", "--output", "json", NULL);
    FILE *f = fopen(out, "r");
    char text[65536] = "";
    size_t got = f ? fread(text, 1, sizeof text - 1, f) : 0;
    text[got] = 0;
    if (f)
        fclose(f);
    cr_assert_eq(rc, 0, "aws s3api list-multipart-uploads failed (%d): %s", rc, text);
    char quoted[1200];
    snprintf(quoted, sizeof quoted, "\"%s\"", full_key);
    int count = 0;
    for (const char *p = strstr(text, quoted); p; p = strstr(p + 1, quoted))
        count++;
    tu_rmtree(dir);
    free(dir);
    free(out);
    return count;
}

const char *tu_mpu_created(const char *full_key)
{
    return tu_fmt(" POST /" TU_BUCKET "/%s%%3Fuploads%%3D HTTP/1.0 200 ", full_key);
}

void tu_expect_mpu_aborted(store_t *s, const char *key, const char *full_key, size_t from,
                           double wait_s)
{
    const char *aborted = tu_fmt(" DELETE /" TU_BUCKET "/%s%%3FuploadId%%3D", full_key);
    cr_assert(tu_proxy_log_wait(from, aborted, wait_s),
              "no AbortMultipartUpload reached the store");
    cr_assert_eq(tu_s3_uploads_in_progress(full_key), 0, "an incomplete upload of %s is left",
                 full_key);
    int exists = 1;
    sp_err err = {0};
    cr_assert_eq(store_exists(s, key, &exists, NULL, &err), 0, "%s", err.msg);
    cr_assert_eq(exists, 0, "a failed upload left an object");
}

/* store_get_range(s, key, off, n) into a buffer of its own: its return value;
 * on success the bytes equal src[off .. off + n). */
static int range_matches(store_t *s, const char *key, const uint8_t *src, uint64_t off, size_t n,
                         sp_err *err)
{
    uint8_t *got = malloc(n ? n : 1);
    cr_assert_not_null(got);
    int rc = store_get_range(s, key, off, n, got, err);
    if (!rc)
        cr_expect(n == 0 || memcmp(got, src + off, n) == 0,
                  "%s: bytes [%llu, %llu) differ", key, (unsigned long long)off,
                  (unsigned long long)(off + n));
    free(got);
    return rc;
}

void tu_check_get_range(store_t *s, const char *key)
{
    const size_t size = 3 * ((size_t)1 << 20) + 4099;
    uint8_t *src = tu_random_bytes(size, 97);
    sp_err err = {0};
    cr_assert_eq(store_put_bytes(s, key, src, size, 0, &err), 0, "%s", err.msg);

    cr_expect_eq(range_matches(s, key, src, ((uint64_t)1 << 20) + 7, ((size_t)1 << 20) + 13, &err),
                 0, "%s", err.msg);
    cr_expect_eq(range_matches(s, key, src, 0, size, &err), 0, "%s", err.msg);
    cr_expect_eq(range_matches(s, key, src, size - 100001, 100001, &err), 0, "%s", err.msg);
    cr_expect_eq(range_matches(s, key, src, size - 1, 1, &err), 0, "%s", err.msg);

    /* past the end: starting inside the object, and after it */
    const uint64_t past[][2] = {{size - 10, 20}, {size, 1}, {size + 5, 100}};
    for (size_t i = 0; i < sizeof past / sizeof past[0]; i++) {
        sp_err e = {0};
        int rc = range_matches(s, key, src, past[i][0], (size_t)past[i][1], &e);
        cr_expect_eq(rc, STORE_EFAIL, "[%llu, +%llu): %d %s", (unsigned long long)past[i][0],
                     (unsigned long long)past[i][1], rc, e.msg);
        cr_expect(strstr(e.msg, key), "the key is not named: %s", e.msg);
    }

    char *missing = NULL;
    cr_assert(asprintf(&missing, "%s.missing", key) > 0);
    sp_err e = {0};
    int rc = range_matches(s, missing, src, 0, 10, &e);
    cr_expect_eq(rc, STORE_ENOENT, "%d %s", rc, e.msg);
    cr_expect(strstr(e.msg, missing), "%s", e.msg);
    cr_expect_eq(e.code, SP_EXIT_INPUT);

    /* n == 0 sends nothing: success even for a missing object */
    sp_err z = {0};
    cr_expect_eq(store_get_range(s, key, 5, 0, NULL, &z), 0, "%s", z.msg);
    cr_expect_eq(store_get_range(s, missing, 0, 0, NULL, &z), 0, "%s", z.msg);
    cr_expect_eq(store_get_range(s, "/bad", 0, 0, NULL, &z), STORE_EUSAGE);
    free(missing);
    free(src);
}

int tu_threads_named(const char *name)
{
    DIR *d = opendir("/proc/self/task");
    cr_assert_not_null(d);
    int n = 0;
    for (struct dirent *e; (e = readdir(d)) != NULL;) {
        if (e->d_name[0] == '.')
            continue;
        char path[300], comm[32] = "";
        snprintf(path, sizeof path, "/proc/self/task/%s/comm", e->d_name);
        FILE *f = fopen(path, "r");
        if (!f)
            continue; /* the thread ended */
        if (fgets(comm, sizeof comm, f))
            comm[strcspn(comm, "\n")] = 0;
        fclose(f);
        n += strcmp(comm, name) == 0;
    }
    closedir(d);
    return n;
}

/* ---- a file:// store and checkpoint directories --------------------------- */

tu_file_fx tu_file_store(const char *tag)
{
    tu_file_fx f = {0};
    f.dir = tu_tempdir(tag);
    cr_assert(f.dir, "cannot make a directory under the build tree");
    cr_assert(asprintf(&f.root, "%s/store", f.dir) > 0);
    cr_assert(asprintf(&f.url, "file://%s", f.root) > 0);
    sp_err err = {0};
    cr_assert_eq(store_open(&f.s, f.url, NULL, &err), 0, "%s", err.msg);
    return f;
}

void tu_file_store_close(tu_file_fx *f)
{
    store_close(f->s);
    tu_rmtree(f->dir);
    free(f->dir);
    free(f->root);
    free(f->url);
}

char *tu_path_in(const char *dir, const char *name)
{
    char *p = NULL;
    cr_assert(asprintf(&p, "%s/%s", dir, name) > 0);
    return p;
}

/* A checkpoint directory: state.h5, two shards, a sub/ file, MANIFEST.json. */
char *tu_make_ckpt(const char *parent, const char *name, uint64_t seed, size_t big)
{
    char *d = tu_path_in(parent, name);
    cr_assert_eq(mkdir(d, 0777), 0);
    char *p;
    const char *files[] = {"state.h5", "shard-00000-of-00002.h5", "shard-00001-of-00002.h5",
                           "sub/extra.bin"};
    for (int i = 0; i < 4; i++) {
        p = tu_path_in(d, files[i]);
        if (i == 3) {
            char *sub = tu_path_in(d, "sub");
            mkdir(sub, 0777);
            free(sub);
        }
        tu_random_file(p, i == 0 ? big : 1000 + (size_t)i, seed * 10 + (uint64_t)i);
        free(p);
    }
    p = tu_path_in(d, "MANIFEST.json");
    char man[128];
    int n = snprintf(man, sizeof man, "{\"step\": \"%s\", \"seed\": %llu}", name,
                     (unsigned long long)seed);
    tu_write_bytes(p, man, (size_t)n);
    free(p);
    return d;
}

void tu_assert_same_tree(const char *a, const char *b)
{
    const char *files[] = {"MANIFEST.json", "state.h5", "shard-00000-of-00002.h5",
                           "shard-00001-of-00002.h5", "sub/extra.bin"};
    for (int i = 0; i < 5; i++) {
        char *pa = tu_path_in(a, files[i]), *pb = tu_path_in(b, files[i]);
        cr_assert(tu_files_equal(pa, pb), "%s differs", files[i]);
        free(pa);
        free(pb);
    }
}

void tu_check_put_if(store_t *st)
{
    const char *key = "cas/LEASE.json";
    sp_err err = {0};
    char tag[STORE_TAG_MAX], tag2[STORE_TAG_MAX];
    void *data = NULL;
    size_t n = 0;
    cr_assert_eq(store_put_bytes_if(st, key, "one", 3, "", &err), 0, "%s", err.msg);
    cr_expect_eq(store_put_bytes_if(st, key, "two", 3, "", &err), STORE_EEXIST,
                 "a create replaced an object");
    cr_expect(tu_contains(err.msg, "cas/LEASE.json"), "the refusal names no key: %s", err.msg);
    sp_err_clear(&err);
    cr_assert_eq(store_get_bytes_tag(st, key, &data, &n, tag, &err), 0, "%s", err.msg);
    cr_expect(n == 3 && !memcmp(data, "one", 3), "the first put is not what is there");
    cr_expect(tag[0], "no version tag");
    free(data);
    cr_assert_eq(store_put_bytes_if(st, key, "three", 5, tag, &err), 0, "%s", err.msg);
    cr_assert_eq(store_get_bytes_tag(st, key, &data, &n, tag2, &err), 0, "%s", err.msg);
    cr_expect(n == 5 && !memcmp(data, "three", 5), "the replacement is not there");
    cr_expect_str_neq(tag, tag2, "a replaced object kept its version tag");
    free(data);
    /* the tag read before the replacement no longer holds */
    cr_expect_eq(store_put_bytes_if(st, key, "four", 4, tag, &err), STORE_EEXIST,
                 "a stale version tag replaced the object");
    sp_err_clear(&err);
    cr_assert_eq(store_get_bytes(st, key, &data, &n, &err), 0, "%s", err.msg);
    cr_expect(n == 5 && !memcmp(data, "three", 5), "a refused put changed the object");
    free(data);
    /* a deleted object is not as read either */
    cr_assert_eq(store_delete(st, key, &err), 0, "%s", err.msg);
    cr_expect_eq(store_put_bytes_if(st, key, "five", 4, tag2, &err), STORE_EEXIST,
                 "a put over a deleted object's tag went through");
    sp_err_clear(&err);
    int exists = 1;
    cr_assert_eq(store_exists(st, key, &exists, NULL, &err), 0, "%s", err.msg);
    cr_expect(!exists, "a refused put created the object");
    /* a missing object reads as "" with STORE_ENOENT */
    cr_expect_eq(store_get_bytes_tag(st, key, &data, &n, tag, &err), STORE_ENOENT);
    cr_expect_str_eq(tag, "");
    sp_err_clear(&err);
}
