#define _POSIX_C_SOURCE 200809L
#include "test_util.h"

#include <criterion/criterion.h>

#include <jansson.h>

#include "checkpoint/ckpt.h"
#include "trainer/adapter.h"
#include "trainer/config.h"
#include "trainer/model_io.h"

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

const char *tu_source_dir(void)
{
    const char *e = getenv("SPOTUNE_TEST_SOURCE_DIR");
    return e && *e ? e : SPOTUNE_SOURCE_DIR;
}

const char *tu_binary_dir(void)
{
    const char *e = getenv("SPOTUNE_TEST_BINARY_DIR");
    return e && *e ? e : SPOTUNE_BINARY_DIR;
}

const char *tu_fmt(const char *fmt, ...)
{
    static char *buf[8]; /* a few live at once in one expression */
    static int next;
    char **b = &buf[next++ % 8];
    free(*b);
    va_list ap;
    va_start(ap, fmt);
    *b = sp_vstrf(fmt, ap);
    va_end(ap);
    if (!*b)
        abort(); /* out of memory in a test */
    return *b;
}

const char *fixture(const char *rel)
{
    return tu_fmt("%s/tests/fixtures/%s", tu_source_dir(), rel);
}

char *tu_tempdir(const char *tag)
{
    char *top = sp_strf("%s/tmp", tu_binary_dir());
    char *tmpl = top ? sp_strf("%s/%s-XXXXXX", top, tag) : NULL;
    if (top)
        mkdir(top, 0755);
    free(top);
    if (tmpl && !mkdtemp(tmpl)) {
        free(tmpl);
        return NULL;
    }
    return tmpl;
}

void tu_rmtree(const char *dir)
{
    if (!dir || strstr(dir, "/tmp/") == NULL)
        return;
    /* a test's small file systems (tu_mount_tmpfs) go first */
    char *cmd = sp_strf("awk -v d='%s/' 'index($2, d) == 1 {print $2}' /proc/mounts | "
                        "while read -r m; do umount -l \"$m\"; done; rm -rf '%s'",
                        dir, dir);
    if (!cmd || system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", dir);
    free(cmd);
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
    if (output)
        *output = NULL;
    char *full = cmd ? sp_strf("(%s) 2>&1", cmd) : NULL;
    FILE *p = full ? popen(full, "r") : NULL;
    free(full);
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
    va_list ap;
    va_start(ap, fmt);
    char *cmd = sp_vstrf(fmt, ap);
    va_end(ap);
    int rc = run_capture(output, cmd);
    free(cmd);
    return rc;
}

int tu_spotune(char **output, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    char *args = sp_vstrf(fmt, ap);
    va_end(ap);
    char *cmd = args ? sp_strf("%s/spotune %s", tu_binary_dir(), args) : NULL;
    int rc = run_capture(output, cmd);
    free(args);
    free(cmd);
    return rc;
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

float *tu_download(backend_t *be, tensor_t t)
{
    sp_err err = {0};
    float *h = malloc(sizeof(float) * (t.n ? t.n : 1));
    cr_assert(h, "out of host memory");
    be_download(be, h, DT_F32, t);
    cr_assert_eq(be_check(be, &err), 0, "%s", err.msg);
    return h;
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
        double d = fabs((double)a[i] - b[i]);
        if (fabs((double)b[i]) > m)
            m = fabs((double)b[i]);
        if (d > e || d != d)
            e = d != d ? INFINITY : d;
    }
    return m > 0 ? e / m : e;
}

int tu_contains(const char *h, const char *n)
{
    return h && n && strstr(h, n) != NULL;
}

int tu_spawn(const char *log, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    char *cmd = sp_vstrf(fmt, ap);
    va_end(ap);
    char *full = cmd ? sp_strf("exec %s", cmd) : NULL;
    free(cmd);
    if (!full)
        return -1;
    pid_t pid = fork();
    if (pid == 0) {
        setpgid(0, 0);
        int fd = open(log, O_WRONLY | O_CREAT | O_APPEND, 0644);
        if (fd < 0 || dup2(fd, 1) < 0 || dup2(fd, 2) < 0)
            _exit(126);
        execl("/bin/sh", "sh", "-c", full, (char *)NULL);
        _exit(127);
    }
    free(full);
    return (int)pid;
}

int tu_fake_metadata(const char *log, const char *args, char *url, size_t n)
{
    return tu_fake_server("fake_metadata.py", log, args, url, n);
}

int tu_fake_server(const char *script, const char *log, const char *args, char *url, size_t n)
{
    unlink(log);
    int pid = tu_spawn(log, "python3 %s/tests/tools/%s %s", tu_source_dir(), script, args);
    cr_assert(pid > 0);
    char *port = NULL;
    for (int i = 0; i < 200 && !(port && atoi(port) > 0); i++) {
        free(port);
        tu_sleep(0.05);
        port = tu_read_file(log, NULL);
    }
    cr_assert(port && atoi(port) > 0, "%s did not start: %s", script,
              port ? port : "(no output)");
    snprintf(url, n, "http://127.0.0.1:%d", atoi(port));
    free(port);
    return pid;
}

int tu_dead_pid(void)
{
    char *out = NULL;
    cr_assert_eq(tu_sh(&out, "echo $$"), 0);
    int pid = atoi(out);
    free(out);
    cr_assert_gt(pid, 0);
    return pid;
}

int tu_zombie_pid(void)
{
    pid_t pid = fork();
    cr_assert_geq(pid, 0, "fork");
    if (pid == 0)
        _exit(0);
    /* a zombie still answers kill(pid, 0) but is not running */
    for (int i = 0; i < 5000; i++) { /* up to 50 s on a loaded machine */
        if (kill(pid, 0) == 0 && !sp_pid_running(pid))
            return (int)pid;
        tu_sleep(0.01);
    }
    cr_assert_fail("child %d never became a zombie", (int)pid);
    return -1;
}

void tu_reap(int pid)
{
    waitpid((pid_t)pid, NULL, 0);
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
     * sanitizer build its leaks are suppressed, not ours. intercept_tls_get_addr=0:
     * the runtime's record of dynamic-TLS blocks (__tls_get_addr) can hold a
     * garbage range for a module Open MPI or NSS loaded (seen: "DTLS 12 at
     * 0x3b5d-0x400004c5f"), and the leak check at exit dies scanning it
     * ("Tracer caught signal 11", exit 1) — now and then on one host, at every
     * exit on a second (namespaced) node. Without the interception those
     * blocks are ordinary heap blocks reached from the thread's DTV, so the
     * leak check still covers them. */
    const char *asan = getenv("ASAN_OPTIONS"), *lsan = getenv("LSAN_OPTIONS");
    snprintf(buf, sizeof buf,
             "env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 "
             "ASAN_OPTIONS=%s%sfast_unwind_on_malloc=0:intercept_tls_get_addr=0 "
             "LSAN_OPTIONS=%s%ssuppressions=%s/tests/lsan.supp:print_suppressions=0 "
             "mpirun --oversubscribe --mca pml ob1 --mca btl tcp,self -np %d",
             asan ? asan : "", asan && *asan ? ":" : "", lsan ? lsan : "",
             lsan && *lsan ? ":" : "", tu_source_dir(), ranks);
    return buf;
}

int tu_tiny_inputs(const char *dir, int text_seed, int model_seed, char **out)
{
    return tu_sh(out,
                 "%s/scripts/make_demo_text.sh %s/text.txt %d && %s/spotune prepare-text "
                 "%s/text.txt %s/data --val-fraction 0 && %s/spotune init-model --preset tiny "
                 "--seed %d %s/model",
                 tu_source_dir(), dir, text_seed, tu_binary_dir(), dir, dir, tu_binary_dir(),
                 model_seed, dir);
}

char *tu_tiny_dir(const char *tag, int text_seed, int model_seed)
{
    char *dir = tu_tempdir(tag), *out = NULL;
    cr_assert(dir, "cannot make a directory under %s/tmp", tu_binary_dir());
    int rc = tu_tiny_inputs(dir, text_seed, model_seed, &out);
    cr_assert_eq(rc, 0, "%s", out ? out : "");
    free(out);
    return dir;
}

void tu_run_yaml(const char *dir, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    char *rest = sp_vstrf(fmt, ap);
    va_end(ap);
    cr_assert(rest);
    const char *yaml =
        tu_fmt("model:\n  path: %s/model\ndata:\n  train: %s/data.train.h5\n%s", dir, dir, rest);
    free(rest);
    cr_assert_eq(tu_write_file(tu_fmt("%s/run.yaml", dir), yaml), 0, "cannot write %s/run.yaml",
                 dir);
}

int tu_animals_task(const char *dir, char **out)
{
    char *path = sp_strf("%s/text.txt", dir);
    FILE *f = path ? fopen(path, "w") : NULL;
    free(path);
    if (out)
        *out = NULL;
    if (!f)
        return -1;
    const char *col[] = {"red", "green", "blue", "black"}, *ani[] = {"cat", "dog", "fox", "bird"};
    for (int p = 0; p < 400; p++) {
        for (int l = 0; l < 4; l++) {
            unsigned a = (unsigned)(p * 7 + l * 13) % 50, b = (unsigned)(p * 11 + l * 3) % 50;
            fprintf(f, "the %s %s has %u legs and %u eyes, %u in all.\n", col[(p + l) % 4],
                    ani[(p * 3 + l) % 4], a, b, a + b);
        }
        fprintf(f, "\n");
    }
    if (fclose(f) != 0)
        return -1;
    return tu_spotune(out, "init-model --preset tiny --seed 3 %s/model && %s/spotune "
                           "prepare-text %s/text.txt %s/data --val-fraction 0.1 --seed 2",
                      dir, tu_binary_dir(), dir, dir);
}

char *tu_tiny_train_dir(const char *tag)
{
    char *dir = tu_tempdir(tag);
    cr_assert(dir);
    char *out = NULL;
    int rc = tu_animals_task(dir, &out);
    cr_assert_eq(rc, 0, "%s", out);
    free(out);
    const char *cfg = tu_fmt(
        "run:\n  dir: %s/run\n  seed: 11\nmodel:\n  path: %s/model\n"
        "train:\n  mode: lora\n  steps: 8\n  seq_len: 32\n  micro_batch: 4\n  lr: 3e-3\n"
        "  warmup_steps: 2\n"
        "lora:\n  r: 4\n  alpha: 8\n  targets: [q_proj, v_proj, down_proj]\n"
        "data:\n  train: %s/data.train.h5\n  val: %s/data.val.h5\n  val_windows: 16\n"
        "log:\n  every: 1\nruntime:\n  backend: cpu\n  threads: 2\n",
        dir, dir, dir, dir);
    cr_assert_eq(tu_write_file(tu_fmt("%s/base.yaml", dir), cfg), 0, "cannot write %s/base.yaml",
                 dir);
    return dir;
}

int tu_remanifest(const char *ck)
{
    char hex[65];
    char *path = sp_strf("%s/%s", ck, CKPT_MANIFEST), *state = sp_strf("%s/%s", ck, CKPT_STATE_FILE);
    uint64_t size = 0;
    sp_err err = {0};
    json_error_t je;
    json_t *m = NULL, *e = NULL;
    int rc = -1;
    if (path && state && ckpt_file_sha256(state, hex, &size, &err) == 0 &&
        (m = json_load_file(path, 0, &je)) &&
        (e = json_object_get(json_object_get(m, "files"), CKPT_STATE_FILE))) {
        json_object_set_new(e, "size", json_integer((json_int_t)size));
        json_object_set_new(e, "sha256", json_string(hex));
        rc = json_dump_file(m, path, JSON_INDENT(2));
    }
    json_decref(m);
    free(path);
    free(state);
    return rc;
}

int tu_lora_opts(const char *dir, model_opts *o, sp_err *err)
{
    char *path = sp_strf("%s/adapter_config.json", dir);
    json_error_t je;
    json_t *c = path ? json_load_file(path, 0, &je) : NULL;
    if (!c) {
        sp_fail(err, 1, "%s: %s", path ? path : dir, path ? je.text : "out of memory");
        free(path);
        return err->code;
    }
    free(path);
    o->mode = MODE_LORA;
    o->lora_r = json_integer_value(json_object_get(c, "r"));
    o->lora_alpha = json_number_value(json_object_get(c, "lora_alpha"));
    o->rslora = json_is_true(json_object_get(c, "use_rslora"));
    o->dora = json_is_true(json_object_get(c, "use_dora"));
    o->lora_targets = 0;
    size_t i;
    json_t *v;
    json_array_foreach(json_object_get(c, "target_modules"), i, v)
    {
        for (int p = 0; p < PROJ_COUNT; p++)
            if (strcmp(json_string_value(v), config_target_names[p]) == 0)
                o->lora_targets |= 1 << p;
    }
    json_decref(c);
    return 0;
}

/* The fixture's batch.safetensors into c: inputs, targets, count. */
static int read_batch(tu_hf_case *c, const char *path, sp_err *err)
{
    st_file bf;
    if (st_open(&bf, path, err))
        return err->code;
    const st_tensor *tok = st_find(&bf, "tokens"), *mask = st_find(&bf, "loss_mask");
    if (!tok || !mask || tok->dt != DT_I32 || mask->dt != DT_U8) {
        st_close(&bf);
        return sp_fail(err, 1, "%s: no I32 tokens and U8 loss_mask", path);
    }
    c->B = (int)tok->shape[0];
    c->T = (int)tok->shape[1] - 1;
    c->inputs = malloc(sizeof(int32_t) * c->B * c->T);
    c->targets = malloc(sizeof(int32_t) * c->B * c->T);
    const int32_t *tk = tok->data;
    const uint8_t *mk = mask->data;
    for (int b = 0; b < c->B; b++)
        for (int t = 0; t < c->T; t++) {
            c->inputs[b * c->T + t] = tk[b * (c->T + 1) + t];
            int on = mk[b * (c->T + 1) + t + 1];
            c->targets[b * c->T + t] = on ? tk[b * (c->T + 1) + t + 1] : -1;
            c->count += on;
        }
    st_close(&bf);
    return 0;
}

static int hf_open(tu_hf_case *c, const char *dir, int lora, double dropout, const char *backend,
                   int recompute, uint64_t first_id, int nf4, sp_err *err)
{
    memset(c, 0, sizeof *c);
    char *model = sp_strf("%s/model", dir), *adapter = sp_strf("%s/lora", dir);
    char *batch = sp_strf("%s/batch.safetensors", dir);
    int rc = model && adapter && batch ? 0 : sp_fail(err, 1, "out of memory");
    if (!rc)
        rc = model_config_load(&c->mc, model, err);
    if (!rc)
        rc = read_batch(c, batch, err);
    for (int b = 0; b < 8; b++)
        c->ids[b] = first_id + (uint64_t)b;
    model_opts o = {.mode = MODE_FULL, .max_batch = c->B, .seq_len = c->T, .seed = 1,
                    .recompute = recompute};
    if (!rc && lora && !(rc = tu_lora_opts(adapter, &o, err)))
        o.lora_dropout = dropout;
    o.nf4 = nf4;
    if (!rc && !(rc = backend_create(&c->be, backend, 0, 2, err)) &&
        !(rc = model_create(&c->m, c->be, &c->mc, &o, err)))
        rc = model_io_load_base(c->m, model, err);
    if (!rc && lora)
        rc = adapter_load(c->m, adapter, err);
    free(model);
    free(adapter);
    free(batch);
    return rc;
}

int tu_hf_open(tu_hf_case *c, const char *dir, int lora, double dropout, const char *backend,
               int recompute, uint64_t first_id, sp_err *err)
{
    return hf_open(c, dir, lora, dropout, backend, recompute, first_id, 0, err);
}

int tu_hf_open_nf4(tu_hf_case *c, const char *dir, const char *backend, sp_err *err)
{
    return hf_open(c, dir, 1, 0.0, backend, RECOMPUTE_NONE, 0, 1, err);
}

int tu_hf_open_nf4_recompute(tu_hf_case *c, const char *dir, const char *backend, int recompute,
                             sp_err *err)
{
    return hf_open(c, dir, 1, 0.0, backend, recompute, 0, 1, err);
}

float *tu_hf_step(tu_hf_case *c, double *loss)
{
    sp_err err = {0};
    model_batch b = {.inputs = c->inputs, .targets = c->targets, .sample_ids = c->ids,
                     .B = c->B, .T = c->T, .grad_scale = (float)(1.0 / c->count), .last = 1};
    double sum = 0;
    model_zero_grads(c->m);
    cr_assert_eq(model_forward_backward(c->m, &b, &sum, &err), 0, "%s", err.msg);
    *loss = sum / c->count;
    float *g = malloc(sizeof(float) * (c->m->n_trainable ? c->m->n_trainable : 1));
    cr_assert(g);
    be_download(c->be, g, DT_F32, c->m->grad);
    cr_assert_eq(be_check(c->be, &err), 0, "%s", err.msg);
    return g;
}

void tu_hf_close(tu_hf_case *c)
{
    if (c->m)
        model_destroy(c->m);
    if (c->be)
        backend_destroy(c->be);
    free(c->inputs);
    free(c->targets);
}

/* ---- the local S3 test server ------------------------------------------------ */

const char *tu_s3_endpoint(void)
{
    const char *ep = getenv("SPOTUNE_TEST_S3_ENDPOINT");
    cr_assert(ep && *ep && getenv("AWS_ACCESS_KEY_ID") && getenv("AWS_SECRET_ACCESS_KEY"),
              "S3 test environment missing: SPOTUNE_TEST_S3_ENDPOINT, AWS_ACCESS_KEY_ID and "
              "AWS_SECRET_ACCESS_KEY must be set (ctest sets them and starts the server)");
    return ep;
}

/* ---- the proxy ---------------------------------------------------------------- */

static const char *swift_base(void)
{
    const char *base = getenv("SWIFT_S3_BASE");
    cr_assert(base && *base, "SWIFT_S3_BASE missing (ctest sets it)");
    return base;
}

int tu_proxy_pid(void)
{
    char *path = sp_strf("%s/run/proxy.pid", swift_base());
    FILE *f = path ? fopen(path, "r") : NULL;
    cr_assert_not_null(f, "%s", path);
    int pid = 0;
    int n = fscanf(f, "%d", &pid);
    fclose(f);
    cr_assert(n == 1 && pid > 1, "%s holds no pid", path);
    free(path);
    return pid;
}

static pid_t frozen_proxy, freeze_guard;

void tu_proxy_freeze(double max_s)
{
    cr_assert_eq(frozen_proxy, 0, "the proxy is already stopped");
    pid_t proxy = (pid_t)tu_proxy_pid(), parent = getpid();
    pid_t g = fork();
    cr_assert_geq(g, 0, "fork");
    if (g == 0) { /* async-signal-safe calls only: the parent may have threads */
        struct timespec tick = {0, 20 * 1000 * 1000};
        for (long i = 0; i < (long)(max_s * 50) && getppid() == parent; i++)
            nanosleep(&tick, NULL);
        kill(proxy, SIGCONT);
        _exit(0);
    }
    frozen_proxy = proxy;
    freeze_guard = g;
    cr_assert_eq(kill(proxy, SIGSTOP), 0, "SIGSTOP %d", (int)proxy);
}

void tu_proxy_thaw(void)
{
    if (frozen_proxy > 0)
        kill(frozen_proxy, SIGCONT);
    if (freeze_guard > 0) {
        kill(freeze_guard, SIGKILL);
        waitpid(freeze_guard, NULL, 0);
    }
    frozen_proxy = freeze_guard = 0;
}

char *tu_proxy_log(size_t *len)
{
    char *path = sp_strf("%s/log/proxy.log", swift_base()); /* not tu_fmt: callers poll */
    FILE *f = path ? fopen(path, "rb") : NULL;
    cr_assert_not_null(f, "the proxy log %s is missing", path);
    free(path);
    size_t cap = 1 << 20, n = 0, got;
    char *text = malloc(cap);
    cr_assert_not_null(text);
    while ((got = fread(text + n, 1, cap - n - 1, f)) > 0) {
        n += got;
        if (cap - n < 4096) {
            text = realloc(text, cap *= 2);
            cr_assert_not_null(text);
        }
    }
    fclose(f);
    text[n] = 0;
    if (len)
        *len = n;
    return text;
}

int tu_proxy_log_wait(size_t from, const char *needle, double timeout_s)
{
    double t0 = sp_now();
    for (;;) {
        size_t n = 0;
        char *text = tu_proxy_log(&n);
        int found = n > from && strstr(text + from, needle) != NULL;
        free(text);
        if (found)
            return 1;
        if (sp_now() - t0 > timeout_s)
            return 0;
        tu_sleep(0.02);
    }
}

void tu_st_poke(const char *path, const char *tensor, size_t at, const float *vals, size_t n)
{
    st_file f;
    sp_err err = {0};
    cr_assert_eq(st_open(&f, path, &err), 0, "%s", err.msg);
    const st_tensor *t = st_find(&f, tensor);
    cr_assert(t && at + n <= t->numel, "%s: %s", path, tensor);
    size_t esz = dtype_size(t->dt);
    long off = (long)((const char *)t->data - (const char *)f.map) + (long)(at * esz);
    unsigned char *bytes = malloc(esz * n);
    cr_assert(bytes && dtype_convert(bytes, t->dt, vals, DT_F32, n) == 0);
    st_close(&f);
    FILE *fp = fopen(path, "r+b");
    cr_assert(fp && fseek(fp, off, SEEK_SET) == 0, "%s", path);
    cr_assert_eq(fwrite(bytes, esz, n, fp), n);
    fclose(fp);
    free(bytes);
}

/* 1 when the CPU has AVX-512 (F, BW, VL, DQ, CD: OpenBLAS's SkylakeX
 * kernels); *avx2: AVX2 and FMA (Haswell's) */
int tu_cpu_vector_units(int *avx2)
{
    __builtin_cpu_init();
    *avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512cd");
}
