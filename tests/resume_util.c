/* tests/resume_util.c — what the preemption and resume suites share: the
 * tiny model and data with a LoRA run.yaml in a temporary directory, running
 * spotune on it (alone or under a launcher), signalling runs, and reading back
 * their losses, logs, checkpoint records and checkpoints. */
#define _POSIX_C_SOURCE 200809L
#include <criterion/criterion.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "checkpoint/ckpt.h"
#include "test_util.h"
#include "trainer/data.h"
#include "resume_util.h"

char *dir;


void resume_setup(void)
{
    dir = tu_tiny_dir("resume", 3, 5);
    char *out = NULL;
    int rc = tu_spotune(&out, "init-model --preset tiny --seed 6 %s/other", dir);
    cr_assert_eq(rc, 0, "%s", out);
    free(out);
    tu_run_yaml(dir,
                "run:\n  seed: %d\n"
                "train:\n  mode: lora\n  steps: 40\n  seq_len: %d\n  micro_batch: 2\n"
                "  grad_accum: 2\n  lr: 3e-3\n  warmup_steps: 4\n"
                "lora:\n  r: 4\n  alpha: 8\n  dropout: 0.1\n"
                "  targets: [q_proj, v_proj, down_proj]\n"
                "log:\n  every: 1\nruntime:\n  backend: cpu\n  threads: 1\n"
                "checkpoint:\n  every_minutes: 0\n  keep: 2\n",
                SEED, SEQ_LEN);
}

void resume_teardown(void)
{
    tu_rmtree(dir);
    free(dir);
}


/* "spotune train run.yaml --set run.dir=DIR/name EXTRA", with a launcher prefix */
const char *train_cmd(const char *prefix, const char *name, const char *extra)
{
    return tu_fmt("%s %s/spotune train %s/run.yaml --set run.dir=%s/%s %s", prefix ? prefix : "",
                  tu_binary_dir(), dir, dir, name, extra ? extra : "");
}

int run(const char *prefix, const char *name, const char *extra, char **out)
{
    return tu_sh(out, "%s", train_cmd(prefix, name, extra));
}

int read_losses(const char *name, double *v, int max)
{
    const char *path = tu_fmt("%s/%s/metrics.jsonl", dir, name);
    char *text = tu_read_file(path, NULL);
    cr_assert(text, "no %s", path);
    int n = 0;
    for (char *p = strstr(text, "\"event\":\"train\""); p && n < max;
         p = strstr(p + 1, "\"event\":\"train\"")) {
        char *l = strstr(p, "\"loss\":");
        cr_assert(l);
        v[n++] = strtod(l + SP_LEN("\"loss\":"), NULL);
    }
    free(text);
    return n;
}

int last_step(const char *name)
{
    double v[256];
    return read_losses(name, v, 256);
}

/* The first cap-1 bytes of a file whose size stat does not know (/proc). */
size_t read_proc(const char *path, char *buf, size_t cap)
{
    FILE *f = fopen(path, "rb");
    size_t n = f ? fread(buf, 1, cap - 1, f) : 0;
    if (f)
        fclose(f);
    buf[n] = 0;
    return n;
}

/* The process exists and has not exited (is not a zombie waiting to be reaped). */
int proc_running(int pid)
{
    return sp_pid_running(pid);
}

/* Waits until the run has logged `step` (or the process ended); polls for up
 * to 5 minutes, since a loaded machine under ASan can be very slow. */
void wait_step(const char *name, int step, int pid)
{
    char path[4096], pat[64];
    snprintf(path, sizeof path, "%s/%s/metrics.jsonl", dir, name);
    snprintf(pat, sizeof pat, "\"step\":%d,", step);
    for (int i = 0; i < 30000; i++) {
        char *text = tu_read_file(path, NULL);
        int seen = tu_contains(text, pat);
        free(text);
        if (seen || !proc_running(pid))
            return;
        tu_sleep(0.01);
    }
}

void expect_same_run(const char *a, const char *b, int bitwise)
{
    double la[128], lb[128];
    int na = read_losses(a, la, 128), nb = read_losses(b, lb, 128);
    cr_assert_eq(na, 40, "%s logged %d steps", a, na);
    cr_assert_eq(nb, 40, "%s logged %d steps", b, nb);
    for (int i = 0; i < na; i++) {
        if (bitwise)
            cr_expect_eq(la[i], lb[i], "step %d: %.17g vs %.17g", i + 1, la[i], lb[i]);
        else
            cr_expect_lt(fabs(la[i] - lb[i]), 1e-5 * fabs(la[i]), "step %d: %.9g vs %.9g",
                         i + 1, la[i], lb[i]);
    }
    if (bitwise)
        cr_expect_eq(tu_sh(NULL, "cmp %s/%s/adapter/adapter_model.safetensors "
                                 "%s/%s/adapter/adapter_model.safetensors",
                           dir, a, dir, b),
                     0, "final adapters of %s and %s differ", a, b);
}

/* DIR/name.log, the output of a run started by tu_spawn (malloc'd) */
char *read_log(const char *name)
{
    const char *log = tu_fmt("%s/%s.log", dir, name);
    char *text = tu_read_file(log, NULL);
    cr_assert(text, "no %s", log);
    return text;
}

/* Every checkpoint of the run verifies (MANIFEST, sizes, SHA-256) and none is
 * left half-written; returns how many there are. */
int expect_checkpoints_verify(const char *name)
{
    const char *root = tu_fmt("%s/%s/checkpoints", dir, name);
    ckpt_info *l;
    int n;
    sp_err err = {0};
    cr_assert_eq(ckpt_list(root, 1, &l, &n, &err), 0, "%s", err.msg);
    for (int i = 0; i < n; i++)
        cr_expect(l[i].ok, "%s/%s: %s", root, l[i].name, l[i].problem);
    free(l);
    return n;
}

/* The step of the checkpoint a stopped run committed, from its log
 * ("stopped by a signal after committing checkpoint step N"); checks that
 * the checkpoint is there and verifies. */
int stopped_at(const char *name, const char *text)
{
    const char *p = strstr(text, "after committing checkpoint step ");
    cr_assert(p, "%s: no stop message: %s", name, text);
    int step = atoi(p + strlen("after committing checkpoint step "));
    const char *ck = tu_fmt("%s/%s/checkpoints/step-%08d", dir, name, step);
    ckpt_manifest m;
    memset(&m, 0, sizeof m);
    sp_err err = {0};
    if (ckpt_verify(ck, &m, &err) == 0)
        cr_expect_eq(m.step, step, "%s: MANIFEST says step %lld", ck, (long long)m.step);
    else
        cr_expect_fail("the stop checkpoint %s: %s", ck, err.msg);
    ckpt_manifest_free(&m);
    return step;
}

void stop_with(const char *prefix, const char *name, const char *extra, int sig,
                      int at_step)
{
    const char *log = tu_fmt("%s/%s.log", dir, name);
    int pid = tu_spawn(log, "%s", train_cmd(prefix, name, extra));
    wait_step(name, at_step, pid);
    kill(pid, sig);
    int rc = tu_wait(pid, 300);
    char *text = read_log(name);
    cr_assert_eq(rc, 75, "exit %d after signal %d: %s", rc, sig, text);
    stopped_at(name, text);
    free(text);
}


/* Sends sig to pid every every_s seconds until it exits (5 minutes at most);
 * returns its exit status (128+signal if a signal ended it, -1: it would
 * not end). The run must not checkpoint for any other reason. */
int signal_until_exit(int pid, int sig, double every_s, const char *name, barrage *b)
{
    const char *metrics = tu_fmt("%s/%s/metrics.jsonl", dir, name);
    memset(b, 0, sizeof *b);
    double t0 = sp_now();
    for (;;) {
        int st = 0;
        pid_t r = waitpid(pid, &st, WNOHANG);
        if (r == pid)
            return WIFEXITED(st) ? WEXITSTATUS(st) : WIFSIGNALED(st) ? 128 + WTERMSIG(st) : -1;
        if (r < 0)
            return -1;
        if (sp_now() - t0 > 300) {
            kill(-pid, SIGKILL);
            waitpid(pid, &st, 0);
            return -1;
        }
        char *text = tu_read_file(metrics, NULL);
        int saving = tu_contains(text, "\"reason\":\"signal\"") &&
                     !tu_contains(text, "\"event\":\"checkpoint_committed\"");
        free(text);
        if (kill(pid, sig) == 0) {
            b->sent++;
            if (proc_running(pid)) {
                b->running++;
                b->in_save += saving;
            }
        }
        tu_sleep(every_s);
    }
}

/* The pid of MPI rank `rank` among the spotune children of the launcher
 * (its environment says which rank it is); 0 if not found. */
int rank_pid(int launcher, int rank)
{
    char *list = NULL, want[64];
    tu_sh(&list, "pgrep -P %d -x spotune", launcher);
    snprintf(want, sizeof want, "OMPI_COMM_WORLD_RANK=%d", rank);
    size_t cap = 1 << 20;
    char *env = malloc(cap);
    cr_assert(env);
    int found = 0;
    for (char *p = list, *end; p && !found; p = end) {
        long pid = strtol(p, &end, 10);
        if (end == p)
            break;
        const char *path = tu_fmt("/proc/%ld/environ", pid);
        size_t n = read_proc(path, env, cap);
        for (size_t k = 0; k < n; k += strlen(env + k) + 1)
            if (strcmp(env + k, want) == 0)
                found = (int)pid;
    }
    free(env);
    free(list);
    return found;
}


double field(const char *rec, const char *key)
{
    const char *pat = tu_fmt("\"%s\":", key);
    const char *p = strstr(rec, pat);
    return p ? strtod(p + strlen(pat), NULL) : NAN;
}

int checkpoint_records(const char *name, ck_record *r, int max)
{
    const char *path = tu_fmt("%s/%s/metrics.jsonl", dir, name);
    char *text = tu_read_file(path, NULL);
    cr_assert(text, "no %s", path);
    int n = 0;
    for (char *line = strtok(text, "\n"); line && n < max; line = strtok(NULL, "\n")) {
        if (!strstr(line, "\"event\":\"checkpoint\","))
            continue;
        ck_record *c = &r[n++];
        c->step = (long long)field(line, "step");
        const char *rs = strstr(line, "\"reason\":\"");
        cr_assert(rs, "no reason: %s", line);
        rs += strlen("\"reason\":\"");
        size_t len = strcspn(rs, "\"");
        snprintf(c->reason, sizeof c->reason, "%.*s", (int)len, rs);
        c->stall_s = field(line, "stall_s");
        c->waited_s = field(line, "waited_for_previous_s");
        c->bytes = field(line, "bytes");
        c->time = field(line, "time");
    }
    free(text);
    return n;
}

/* Every checkpoint record reports a finite, non-negative stall and wait, a
 * size, and (in `log`, rank 0's output) a "training held" line with the same
 * stall (printed to 1 ms: within 0.5 ms); one such line per record. */
void expect_stall_reported(const ck_record *r, int n, const char *log)
{
    int lines = 0;
    for (const char *p = strstr(log, "training held"); p; p = strstr(p + 1, "training held"))
        lines++;
    cr_expect_eq(lines, n, "%d checkpoint records but %d 'training held' lines: %s", n, lines,
                 log);
    for (int i = 0; i < n; i++) {
        cr_expect(isfinite(r[i].stall_s) && r[i].stall_s >= 0, "step %lld: stall_s %g",
                  r[i].step, r[i].stall_s);
        cr_expect(isfinite(r[i].waited_s) && r[i].waited_s >= 0,
                  "step %lld: waited_for_previous_s %g", r[i].step, r[i].waited_s);
        cr_expect_gt(r[i].bytes, 0, "step %lld: bytes %g", r[i].step, r[i].bytes);
        const char *pat =
            tu_fmt("checkpoint step %lld (%s): training held ", r[i].step, r[i].reason);
        const char *p = strstr(log, pat);
        cr_expect(p, "no line '%s...' in %s", pat, log);
        if (p)
            cr_expect_leq(fabs(strtod(p + strlen(pat), NULL) - r[i].stall_s), 0.0005 + 1e-9,
                          "step %lld: the log's stall differs from stall_s %.6f", r[i].step,
                          r[i].stall_s);
    }
}

int read_samples(const char *name, int rank, sample_row *rows, int max)
{
    const char *path = tu_fmt("%s/%s/samples/rank-%d.tsv", dir, name, rank);
    FILE *f = fopen(path, "r");
    cr_assert(f, "no %s", path);
    int n = 0;
    sample_row r;
    while (n < max && fscanf(f, "%lld %llu %llu %llu", &r.step, &r.sample, &r.epoch,
                             &r.window) == 4)
        rows[n++] = r;
    fclose(f);
    return n;
}

long model_config_int(const char *key)
{
    char path[4096], pat[128];
    snprintf(path, sizeof path, "%s/model/config.json", dir);
    snprintf(pat, sizeof pat, "\"%s\":", key);
    char *text = tu_read_file(path, NULL);
    cr_assert(text, "no %s", path);
    const char *p = strstr(text, pat);
    cr_assert(p, "%s has no %s", path, key);
    long v = strtol(p + strlen(pat), NULL, 10);
    free(text);
    return v;
}

int resume_packing = DATA_PACK_STREAM;

void expect_every_sample_once(const sample_row *rows, int n, int steps, long long G)
{
    dataset_t d;
    sp_err err = {0};
    const char *path = tu_fmt("%s/data.train.h5", dir);
    cr_assert_eq(dataset_open_part(&d, path, SEQ_LEN, model_config_int("vocab_size"), SEED,
                                   resume_packing, 0, 1, &err),
                 0, "%s", err.msg);
    uint64_t total = (uint64_t)steps * (uint64_t)G;
    int *count = calloc(total, sizeof *count);
    cr_assert(count);
    for (int k = 0; k < n; k++) {
        const sample_row *r = &rows[k];
        cr_assert_lt(r->sample, total, "sample %llu (step %lld) beyond %llu", r->sample, r->step,
                     (unsigned long long)total);
        count[r->sample]++;
        cr_expect(r->sample >= (uint64_t)(r->step - 1) * (uint64_t)G &&
                      r->sample < (uint64_t)r->step * (uint64_t)G,
                  "sample %llu trained in step %lld", r->sample, r->step);
        uint64_t w = 0, e = 0;
        cr_assert_eq(dataset_window_of(&d, r->sample, &w, &e, &err), 0, "%s", err.msg);
        cr_expect(w == r->window && e == r->epoch,
                  "sample %llu is epoch %llu window %llu, but epoch %llu window %llu was trained",
                  r->sample, (unsigned long long)e, (unsigned long long)w, r->epoch, r->window);
    }
    dataset_close(&d);
    int missing = 0, repeated = 0;
    for (uint64_t s = 0; s < total; s++) {
        missing += count[s] == 0;
        repeated += count[s] > 1;
    }
    cr_expect(missing == 0 && repeated == 0,
              "of %llu global samples, %d were never trained and %d more than once",
              (unsigned long long)total, missing, repeated);
    free(count);
}
