#define _POSIX_C_SOURCE 200809L
#include "test_util.h"

#include <jansson.h>

#include "checkpoint/ckpt.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <fcntl.h>
#include <signal.h>
#include <time.h>
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
    /* a test's small file systems (tu_mount_tmpfs) go first */
    snprintf(cmd, sizeof cmd,
             "awk -v d='%s/' 'index($2, d) == 1 {print $2}' /proc/mounts | "
             "while read -r m; do umount -l \"$m\"; done; rm -rf '%s'",
             dir, dir);
    if (system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", dir);
}

int tu_mount_tmpfs(const char *path, long kib)
{
    return tu_sh(NULL, "mkdir -p '%s' && mount -t tmpfs -o size=%ldk spotune-test '%s'", path,
                 kib, path);
}

long tu_free_kib(const char *path)
{
    char *out = NULL;
    tu_sh(&out, "df -k --output=avail '%s' | tail -1", path);
    long v = out ? strtol(out, NULL, 10) : -1;
    free(out);
    return v;
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

int tu_spawn(const char *log, const char *fmt, ...)
{
    char cmd[12288], full[12400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    snprintf(full, sizeof full, "exec %s", cmd);
    pid_t pid = fork();
    if (pid == 0) {
        setpgid(0, 0);
        int fd = open(log, O_WRONLY | O_CREAT | O_APPEND, 0644);
        if (fd < 0 || dup2(fd, 1) < 0 || dup2(fd, 2) < 0)
            _exit(126);
        execl("/bin/sh", "sh", "-c", full, (char *)NULL);
        _exit(127);
    }
    return (int)pid;
}

void tu_sleep(double s)
{
    struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
    while (nanosleep(&ts, &ts) != 0)
        ;
}

int tu_wait(int pid, double timeout_s)
{
    double t0 = sp_now();
    int st = 0;
    for (;;) {
        pid_t r = waitpid(pid, &st, WNOHANG);
        if (r == pid)
            break;
        if (r < 0)
            return -1;
        if (sp_now() - t0 > timeout_s) {
            kill(-pid, SIGKILL);
            waitpid(pid, &st, 0);
            return -1;
        }
        tu_sleep(0.02);
    }
    if (WIFEXITED(st))
        return WEXITSTATUS(st);
    return WIFSIGNALED(st) ? 128 + WTERMSIG(st) : -1;
}

const char *tu_mpirun(int ranks)
{
    static char buf[2048];
    /* Open MPI keeps allocations until exit and has no frame pointers: in a
     * sanitizer build its leaks are suppressed, not ours */
    const char *asan = getenv("ASAN_OPTIONS"), *lsan = getenv("LSAN_OPTIONS");
    snprintf(buf, sizeof buf,
             "env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 "
             "ASAN_OPTIONS=%s%sfast_unwind_on_malloc=0 "
             "LSAN_OPTIONS=%s%ssuppressions=%s/tests/lsan.supp:print_suppressions=0 "
             "mpirun --oversubscribe --mca pml ob1 --mca btl tcp,self -np %d",
             asan ? asan : "", asan && *asan ? ":" : "", lsan ? lsan : "",
             lsan && *lsan ? ":" : "", SPOTUNE_SOURCE_DIR, ranks);
    return buf;
}

int tu_tiny_inputs(const char *dir, int text_seed, int model_seed, char **out)
{
    return tu_sh(out,
                 "%s/scripts/make_demo_text.sh %s/text.txt %d && %s/spotune prepare-text "
                 "%s/text.txt %s/data --val-fraction 0 && %s/spotune init-model --preset tiny "
                 "--seed %d %s/model",
                 SPOTUNE_SOURCE_DIR, dir, text_seed, SPOTUNE_BINARY_DIR, dir, dir,
                 SPOTUNE_BINARY_DIR, model_seed, dir);
}

int tu_remanifest(const char *ck)
{
    char path[4096], state[4096], hex[65];
    uint64_t size = 0;
    sp_err err = {0};
    snprintf(path, sizeof path, "%s/%s", ck, CKPT_MANIFEST);
    snprintf(state, sizeof state, "%s/%s", ck, CKPT_STATE_FILE);
    json_error_t je;
    json_t *m = NULL, *e = NULL;
    int rc = -1;
    if (ckpt_file_sha256(state, hex, &size, &err) == 0 && (m = json_load_file(path, 0, &je)) &&
        (e = json_object_get(json_object_get(m, "files"), CKPT_STATE_FILE))) {
        json_object_set_new(e, "size", json_integer((json_int_t)size));
        json_object_set_new(e, "sha256", json_string(hex));
        rc = json_dump_file(m, path, JSON_INDENT(2));
    }
    json_decref(m);
    return rc;
}
