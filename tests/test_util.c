#define _POSIX_C_SOURCE 200809L
#include "test_util.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

const char *fixture(const char *rel)
{
    static char buf[8][4096]; /* a few live at once in one expression */
    static int next;
    char *b = buf[next++ % 8];
    snprintf(b, 4096, "%s/tests/fixtures/%s", SPOTUNE_SOURCE_DIR, rel);
    return b;
}

char *tu_tempdir(const char *tag)
{
    char tmpl[4096];
    mkdir(SPOTUNE_BINARY_DIR "/tmp", 0755);
    snprintf(tmpl, sizeof tmpl, "%s/tmp/%s-XXXXXX", SPOTUNE_BINARY_DIR, tag);
    char *d = mkdtemp(tmpl);
    return d ? strdup(d) : NULL;
}

void tu_rmtree(const char *dir)
{
    char cmd[8192];
    if (!dir || strstr(dir, "/tmp/") == NULL)
        return;
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", dir);
}

static int run_capture(char **output, const char *cmd)
{
    char full[16384];
    snprintf(full, sizeof full, "(%s) 2>&1", cmd);
    FILE *p = popen(full, "r");
    if (!p)
        return -1;
    size_t cap = 4096, len = 0;
    char *buf = malloc(cap);
    size_t got;
    while ((got = fread(buf + len, 1, cap - len - 1, p)) > 0) {
        len += got;
        if (cap - len < 1024) {
            cap *= 2;
            buf = realloc(buf, cap);
        }
    }
    buf[len] = 0;
    int st = pclose(p);
    if (output)
        *output = buf;
    else
        free(buf);
    if (WIFEXITED(st))
        return WEXITSTATUS(st);
    if (WIFSIGNALED(st))
        return 128 + WTERMSIG(st);
    return -1;
}

int tu_sh(char **output, const char *fmt, ...)
{
    char cmd[12288];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    return run_capture(output, cmd);
}

int tu_spotune(char **output, const char *fmt, ...)
{
    char args[12000], cmd[12288];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(args, sizeof args, fmt, ap);
    va_end(ap);
    snprintf(cmd, sizeof cmd, "%s/spotune %s", SPOTUNE_BINARY_DIR, args);
    return run_capture(output, cmd);
}

char *tu_read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)n + 1);
    size_t got = fread(b, 1, (size_t)n, f);
    b[got] = 0;
    fclose(f);
    if (len)
        *len = got;
    return b;
}

int tu_write_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "wb");
    if (!f)
        return -1;
    fputs(text, f);
    return fclose(f);
}

float *tu_load_f32(const char *path, const char *name, size_t *n)
{
    st_file f;
    sp_err err = {0};
    if (st_open(&f, path, &err)) {
        fprintf(stderr, "%s\n", err.msg);
        return NULL;
    }
    const st_tensor *t = st_find(&f, name);
    float *out = NULL;
    if (t && t->dt == DT_F32) {
        out = malloc(sizeof(float) * (t->numel ? t->numel : 1));
        memcpy(out, t->data, sizeof(float) * t->numel);
        if (n)
            *n = t->numel;
    }
    st_close(&f);
    return out;
}

double tu_rel_err(const float *a, const float *b, size_t n)
{
    double m = 0, e = 0;
    for (size_t i = 0; i < n; i++) {
        if (fabs(b[i]) > m)
            m = fabs(b[i]);
        if (fabs((double)a[i] - b[i]) > e)
            e = fabs((double)a[i] - b[i]);
    }
    return m > 0 ? e / m : e;
}

int tu_contains(const char *h, const char *n)
{
    return h && n && strstr(h, n) != NULL;
}
