/* tests/test_store_util.c — shared code of the store suites (see the header). */
#define _GNU_SOURCE
#include "test_store_util.h"

#include <criterion/criterion.h>
#include <fcntl.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/time.h>
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

char *tu_tmpdir(const char *tag)
{
    char *base = NULL, *dir = NULL;
    cr_assert(asprintf(&base, "%s/test-store-tmp", SPOTUNE_BINARY_DIR) > 0);
    mkdir(base, 0777);
    cr_assert(asprintf(&dir, "%s/%s-XXXXXX", base, tag) > 0);
    cr_assert_not_null(mkdtemp(dir), "mkdtemp %s", dir);
    free(base);
    return dir;
}

void tu_rmtree(const char *dir)
{
    char *argv[] = {"rm", "-rf", (char *)dir, NULL};
    tu_run(argv, NULL);
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

void tu_write_file(const char *path, const void *data, size_t n)
{
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f, "fopen %s", path);
    cr_assert_eq(fwrite(data, 1, n, f), n);
    cr_assert_eq(fclose(f), 0);
}

void tu_random_file(const char *path, size_t n, uint64_t seed)
{
    void *p = tu_random_bytes(n, seed);
    tu_write_file(path, p, n);
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

const char *tu_s3_endpoint(void)
{
    const char *ep = getenv("SPOTUNE_TEST_S3_ENDPOINT");
    cr_assert(ep && *ep && getenv("AWS_ACCESS_KEY_ID") && getenv("AWS_SECRET_ACCESS_KEY"),
              "S3 test environment missing: SPOTUNE_TEST_S3_ENDPOINT, AWS_ACCESS_KEY_ID and "
              "AWS_SECRET_ACCESS_KEY must be set (ctest sets them and starts the server)");
    return ep;
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
