/* Preemption and resume end to end, through the spotune binary (and mpirun
 * for several ranks): a run stopped by SIGTERM, SIGINT or SIGUSR1 (on the
 * launcher or on one rank only), or killed with SIGKILL just after a
 * checkpoint, continues to the bit-identical result of an uninterrupted run
 * (CPU); signals during the stop checkpoint's save corrupt nothing; 2 ranks
 * resume on 1 with the same global batch and every sample trained exactly
 * once; SIGKILL at random moments never leaves a checkpoint that is chosen
 * and fails; checkpoint.every_minutes fires at the agreed step boundary;
 * every checkpoint reports its training stall; a LoRA checkpoint holds only
 * the adapters; changed math is refused and a changed step count is allowed. */
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

static char *dir;

/* run.yaml's seed and seq_len (the sample audit re-derives the data order) */
enum { SEED = 21, SEQ_LEN = 32 };

static void setup(void)
{
    dir = tu_tempdir("resume");
    cr_assert(dir);
    char *out = NULL;
    int rc = tu_tiny_inputs(dir, 3, 5, &out);
    cr_assert_eq(rc, 0, "%s", out);
    free(out);
    rc = tu_spotune(&out, "init-model --preset tiny --seed 6 %s/other", dir);
    cr_assert_eq(rc, 0, "%s", out);
    free(out);
    char path[4096], cfg[4096];
    snprintf(path, sizeof path, "%s/run.yaml", dir);
    snprintf(cfg, sizeof cfg,
             "run:\n  seed: %d\nmodel:\n  path: %s/model\n"
             "train:\n  mode: lora\n  steps: 40\n  seq_len: %d\n  micro_batch: 2\n"
             "  grad_accum: 2\n  lr: 3e-3\n  warmup_steps: 4\n"
             "lora:\n  r: 4\n  alpha: 8\n  dropout: 0.1\n  targets: [q_proj, v_proj, down_proj]\n"
             "data:\n  train: %s/data.train.h5\n"
             "log:\n  every: 1\nruntime:\n  backend: cpu\n  threads: 1\n"
             "checkpoint:\n  every_minutes: 0\n  keep: 2\n",
             SEED, dir, SEQ_LEN, dir);
    cr_assert_eq(tu_write_file(path, cfg), 0);
}

static void teardown(void)
{
    tu_rmtree(dir);
    free(dir);
}

TestSuite(resume, .init = setup, .fini = teardown, .timeout = 900);

/* "spotune train run.yaml --set run.dir=DIR/name EXTRA", with a launcher prefix */
static const char *train_cmd(const char *prefix, const char *name, const char *extra)
{
    static char cmd[8192];
    snprintf(cmd, sizeof cmd, "%s %s/spotune train %s/run.yaml --set run.dir=%s/%s %s",
             prefix ? prefix : "", SPOTUNE_BINARY_DIR, dir, dir, name, extra ? extra : "");
    return cmd;
}

static int run(const char *prefix, const char *name, const char *extra, char **out)
{
    return tu_sh(out, "%s", train_cmd(prefix, name, extra));
}

static int read_losses(const char *name, double *v, int max)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s/metrics.jsonl", dir, name);
    char *text = tu_read_file(path, NULL);
    cr_assert(text, "no %s", path);
    int n = 0;
    for (char *p = strstr(text, "\"event\":\"train\""); p && n < max;
         p = strstr(p + 1, "\"event\":\"train\"")) {
        char *l = strstr(p, "\"loss\":");
        cr_assert(l);
        v[n++] = strtod(l + 7, NULL);
    }
    free(text);
    return n;
}

static int last_step(const char *name)
{
    double v[256];
    return read_losses(name, v, 256);
}

/* The first cap-1 bytes of a file whose size stat does not know (/proc). */
static size_t read_proc(const char *path, char *buf, size_t cap)
{
    FILE *f = fopen(path, "rb");
    size_t n = f ? fread(buf, 1, cap - 1, f) : 0;
    if (f)
        fclose(f);
    buf[n] = 0;
    return n;
}

/* The process exists and has not exited (is not a zombie waiting to be reaped). */
static int proc_running(int pid)
{
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    char *rp = read_proc(path, buf, sizeof buf) ? strrchr(buf, ')') : NULL;
    return rp && rp[1] == ' ' && rp[2] != 'Z' && rp[2] != 'X';
}

/* Waits until the run has logged `step` (or the process ended); polls for up
 * to 5 minutes, since a loaded machine under ASan can be very slow. */
static void wait_step(const char *name, int step, int pid)
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

static void expect_same_run(const char *a, const char *b, int bitwise)
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
static char *read_log(const char *name)
{
    char log[4096];
    snprintf(log, sizeof log, "%s/%s.log", dir, name);
    char *text = tu_read_file(log, NULL);
    cr_assert(text, "no %s", log);
    return text;
}

/* Every checkpoint of the run verifies (MANIFEST, sizes, SHA-256) and none is
 * left half-written; returns how many there are. */
static int expect_checkpoints_verify(const char *name)
{
    char root[4096];
    snprintf(root, sizeof root, "%s/%s/checkpoints", dir, name);
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
static int stopped_at(const char *name, const char *text)
{
    const char *p = strstr(text, "after committing checkpoint step ");
    cr_assert(p, "%s: no stop message: %s", name, text);
    int step = atoi(p + strlen("after committing checkpoint step "));
    char ck[4096];
    snprintf(ck, sizeof ck, "%s/%s/checkpoints/step-%08d", dir, name, step);
    ckpt_manifest m;
    memset(&m, 0, sizeof m);
    sp_err err = {0};
    if (ckpt_verify(ck, &m, &err) == 0)
        cr_expect_eq(m.step, step, "%s: MANIFEST says step %lld", ck, (long long)m.step);
    else
        cr_expect_fail("the stop checkpoint %s: %s", ck, err.msg);
    return step;
}

static void stop_with(const char *prefix, const char *name, const char *extra, int sig,
                      int at_step)
{
    char log[4096];
    snprintf(log, sizeof log, "%s/%s.log", dir, name);
    int pid = tu_spawn(log, "%s", train_cmd(prefix, name, extra));
    wait_step(name, at_step, pid);
    kill(pid, sig);
    int rc = tu_wait(pid, 300);
    char *text = read_log(name);
    cr_assert_eq(rc, 75, "exit %d after signal %d: %s", rc, sig, text);
    stopped_at(name, text);
    free(text);
}

/* What a barrage of signals met: how many were sent, how many found the
 * process still running, and how many of those came after the stop
 * checkpoint had been handed to the writer (its metrics record is out) and
 * before it was committed. */
typedef struct barrage {
    int sent, running, in_save;
} barrage;

/* Sends sig to pid every every_s seconds until it exits (5 minutes at most);
 * returns its exit status (128+signal if a signal ended it, -1: it would
 * not end). The run must not checkpoint for any other reason. */
static int signal_until_exit(int pid, int sig, double every_s, const char *name, barrage *b)
{
    char metrics[4096];
    snprintf(metrics, sizeof metrics, "%s/%s/metrics.jsonl", dir, name);
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
static int rank_pid(int launcher, int rank)
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
        char path[64];
        snprintf(path, sizeof path, "/proc/%ld/environ", pid);
        size_t n = read_proc(path, env, cap);
        for (size_t k = 0; k < n; k += strlen(env + k) + 1)
            if (strcmp(env + k, want) == 0)
                found = (int)pid;
    }
    free(env);
    free(list);
    return found;
}

/* One record {"event":"checkpoint",...} of metrics.jsonl */
typedef struct ck_record {
    long long step;
    char reason[32];
    double stall_s, waited_s, bytes, time;
} ck_record;

static double field(const char *rec, const char *key)
{
    char pat[64];
    snprintf(pat, sizeof pat, "\"%s\":", key);
    const char *p = strstr(rec, pat);
    return p ? strtod(p + strlen(pat), NULL) : NAN;
}

static int checkpoint_records(const char *name, ck_record *r, int max)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s/metrics.jsonl", dir, name);
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
static void expect_stall_reported(const ck_record *r, int n, const char *log)
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
        char pat[128];
        snprintf(pat, sizeof pat, "checkpoint step %lld (%s): training held ", r[i].step,
                 r[i].reason);
        const char *p = strstr(log, pat);
        cr_expect(p, "no line '%s...' in %s", pat, log);
        if (p)
            cr_expect_leq(fabs(strtod(p + strlen(pat), NULL) - r[i].stall_s), 0.0005 + 1e-9,
                          "step %lld: the log's stall differs from stall_s %.6f", r[i].step,
                          r[i].stall_s);
    }
}

/* A signal to a single process: at the next step boundary it commits a
 * checkpoint and exits 75 (the log names the signal), having trained no step
 * past that checkpoint; resumed, the run ends bit-identical to an
 * uninterrupted one. */
static void signal_then_resume(int sig, const char *sig_name)
{
    char *out = NULL;
    cr_assert_eq(run(NULL, "whole", NULL, &out), 0, "%s", out);
    free(out);
    stop_with(NULL, "cut", NULL, sig, 12);
    char *text = read_log("cut"), want[64];
    snprintf(want, sizeof want, "stop requested (%s)", sig_name);
    cr_expect(tu_contains(text, want), "no '%s': %s", want, text);
    int at = stopped_at("cut", text);
    free(text);
    int done = last_step("cut");
    cr_assert(done >= 12 && done < 40, "stopped after %d steps", done);
    cr_expect_eq(done, at, "the run logged %d steps but its stop checkpoint is step %d", done, at);
    cr_assert_eq(run(NULL, "cut", NULL, &out), 0, "%s", out);
    cr_expect(tu_contains(out, "resumed from"), "%s", out);
    free(out);
    expect_same_run("whole", "cut", 1);
}

Test(resume, sigterm_then_resume_is_bit_identical)
{
    signal_then_resume(SIGTERM, "SIGTERM");
}

Test(resume, sigint_then_resume_is_bit_identical)
{
    signal_then_resume(SIGINT, "SIGINT");
}

/* SIGTERM every 2 ms from the first one until the process has exited, so
 * later ones land while the stop checkpoint is written and committed and
 * while the process shuts down: the same exit, checkpoints that verify, the
 * same end. The save takes some 10-30 ms here, so a few signals land in it;
 * should none (a loaded machine), the stop is tried again in a new run. */
Test(resume, repeated_signals_during_the_save_corrupt_nothing)
{
    char *out = NULL;
    cr_assert_eq(run(NULL, "whole", NULL, &out), 0, "%s", out);
    free(out);
    char name[64] = "";
    barrage b = {0};
    for (int attempt = 0; attempt < 5 && b.in_save == 0; attempt++) {
        char log[4096];
        snprintf(name, sizeof name, "twice%d", attempt);
        snprintf(log, sizeof log, "%s/%s.log", dir, name);
        int pid = tu_spawn(log, "%s", train_cmd(NULL, name, NULL));
        wait_step(name, 10, pid);
        int rc = signal_until_exit(pid, SIGTERM, 0.002, name, &b);
        char *text = read_log(name);
        cr_assert_eq(rc, 75, "exit %d after %d SIGTERMs: %s", rc, b.sent, text);
        int at = stopped_at(name, text);
        free(text);
        cr_log_info("%s: %d SIGTERMs sent: %d found the process running, %d of them while the "
                    "stop checkpoint was being written",
                    name, b.sent, b.running, b.in_save);
        cr_expect_gt(b.running, 1, "only %d of %d SIGTERMs reached the running process",
                     b.running, b.sent);
        cr_expect_eq(last_step(name), at);
        cr_assert_geq(expect_checkpoints_verify(name), 1);
    }
    cr_expect_gt(b.in_save, 0, "in 5 runs no SIGTERM landed while the checkpoint was written");
    cr_assert_eq(run(NULL, name, NULL, &out), 0, "%s", out);
    free(out);
    expect_same_run("whole", name, 1);
}

Test(resume, sigkill_just_after_a_checkpoint_then_resume_is_bit_identical)
{
    char *out = NULL;
    cr_assert_eq(run(NULL, "whole", NULL, &out), 0, "%s", out);
    free(out);
    char log[4096], ck[4096];
    snprintf(log, sizeof log, "%s/killed.log", dir);
    snprintf(ck, sizeof ck, "%s/killed/checkpoints/step-00000010/MANIFEST.json", dir);
    int pid = tu_spawn(log, "%s", train_cmd(NULL, "killed", "--set checkpoint.every_steps=10"));
    /* polled every 1 ms, so the kill lands just after the commit; up to 5
     * minutes, or until the run has ended */
    for (int i = 0; i < 300000 && access(ck, R_OK) != 0; i++) {
        if (i % 1000 == 999 && !proc_running(pid))
            break;
        tu_sleep(0.001);
    }
    kill(pid, SIGKILL);
    tu_wait(pid, 60);
    cr_assert_eq(access(ck, R_OK), 0, "checkpoint 10 was never committed");
    cr_assert_eq(run(NULL, "killed", "--set checkpoint.every_steps=10", &out), 0, "%s", out);
    cr_expect(tu_contains(out, "resumed from"), "%s", out);
    free(out);
    expect_same_run("whole", "killed", 1);
}

/* SIGTERM to one rank of a 2-rank job, not to mpirun: every rank stops at the
 * same step boundary, rank 0 commits the checkpoint (saying whether the
 * signal was its own or another rank's), and the job exits 75. */
static void stop_one_rank(const char *prefix, const char *name, const char *extra, int rank)
{
    char log[4096];
    snprintf(log, sizeof log, "%s/%s.log", dir, name);
    int pid = tu_spawn(log, "%s", train_cmd(prefix, name, extra));
    wait_step(name, 12, pid);
    int victim = rank_pid(pid, rank);
    if (victim <= 0) {
        kill(-pid, SIGKILL);
        tu_wait(pid, 60);
        cr_assert_fail("rank %d not found among the children of mpirun %d", rank, pid);
    }
    kill(victim, SIGTERM);
    int rc = tu_wait(pid, 300);
    char *text = read_log(name);
    cr_assert_eq(rc, 75, "exit %d after SIGTERM to rank %d: %s", rc, rank, text);
    const char *want = rank == 0 ? "stop requested (SIGTERM)" : "stop requested (another rank)";
    cr_expect(tu_contains(text, want), "no '%s': %s", want, text);
    int at = stopped_at(name, text);
    free(text);
    cr_expect_eq(last_step(name), at, "steps were trained after the stop checkpoint %d", at);
}

Test(resume, sigterm_to_one_rank_stops_the_job_and_resumes_bit_identical)
{
    const char *extra = "--set train.grad_accum=1";
    char *out = NULL;
    char prefix[2048];
    snprintf(prefix, sizeof prefix, "%s", tu_mpirun(2));
    cr_assert_eq(run(prefix, "whole2", extra, &out), 0, "%s", out);
    free(out);
    const char *names[2] = {"rank0", "rank1"};
    for (int rank = 1; rank >= 0; rank--) {
        stop_one_rank(prefix, names[rank], extra, rank);
        cr_assert_eq(run(prefix, names[rank], extra, &out), 0, "%s", out);
        cr_expect(tu_contains(out, "resumed from"), "%s", out);
        free(out);
        expect_same_run("whole2", names[rank], 1);
    }
}

Test(resume, two_ranks_stopped_by_sigusr1_resume_bit_identical)
{
    char *out = NULL;
    char prefix[2048];
    snprintf(prefix, sizeof prefix, "%s", tu_mpirun(2));
    cr_assert_eq(run(prefix, "whole2", "--set train.grad_accum=1", &out), 0, "%s", out);
    free(out);
    /* mpirun forwards SIGUSR1 to every rank; they agree, checkpoint, exit 75 */
    stop_with(prefix, "cut2", "--set train.grad_accum=1", SIGUSR1, 12);
    cr_assert_eq(run(prefix, "cut2", "--set train.grad_accum=1", &out), 0, "%s", out);
    free(out);
    expect_same_run("whole2", "cut2", 1);
}

Test(resume, two_ranks_resume_on_one_with_the_same_global_batch)
{
    char *out = NULL;
    char prefix[2048];
    snprintf(prefix, sizeof prefix, "%s", tu_mpirun(2));
    cr_assert_eq(run(prefix, "two", "--set train.grad_accum=1", &out), 0, "%s", out);
    free(out);
    stop_with(prefix, "shrink", "--set train.grad_accum=1", SIGUSR1, 12);
    /* the new machine has one GPU: grad_accum 1 -> 2 keeps 2 x 2 x 1 = 4 windows */
    cr_assert_eq(run(NULL, "shrink", "--set train.grad_accum=1", &out), 0, "%s", out);
    cr_expect(tu_contains(out, "train.grad_accum is now 2"), "%s", out);
    free(out);
    /* the same windows in the same steps: equal up to the order of the sums */
    expect_same_run("two", "shrink", 0);
    /* a global batch the new rank count cannot split is refused, clearly */
    stop_with(prefix, "odd", "--set train.grad_accum=1", SIGUSR1, 5);
    int rc = run(NULL, "odd", "--set train.grad_accum=1 --set train.micro_batch=3", &out);
    cr_expect_eq(rc, 2, "%s", out);
    cr_expect(tu_contains(out, "cannot split evenly"), "%s", out);
    free(out);
}

/* One row of RUN_DIR/samples/rank-R.tsv (log.samples) */
typedef struct sample_row {
    long long step;
    unsigned long long sample, epoch, window;
} sample_row;

/* Reads up to max rows of rank R's sample log; returns how many. */
static int read_samples(const char *name, int rank, sample_row *rows, int max)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s/samples/rank-%d.tsv", dir, name, rank);
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

/* An integer member of the model's config.json. */
static long model_config_int(const char *key)
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

/* 2 ranks stopped by SIGUSR1, resumed on 1 to the end: the global sample
 * order continues exactly. Over the whole run every global sample index
 * 0 .. steps x global_batch - 1 is trained exactly once, in its own step, as
 * the window the (seed, epoch) permutation assigns it; the stopped ranks
 * trained nothing past the checkpoint and the resumed rank nothing before. */
Test(resume, two_ranks_resume_on_one_trains_every_sample_once)
{
    const char *extra = "--set train.grad_accum=1 --set log.samples=true";
    char prefix[2048], *out = NULL;
    snprintf(prefix, sizeof prefix, "%s", tu_mpirun(2));
    stop_with(prefix, "audit", extra, SIGUSR1, 12);
    char *text = read_log("audit");
    int at = stopped_at("audit", text);
    const char *gb = strstr(text, "global batch ");
    cr_assert(gb, "%s", text);
    long long G = atoll(gb + strlen("global batch "));
    free(text);
    cr_assert_gt(G, 0);

    enum { MAX_ROWS = 4096 };
    sample_row *first = calloc(MAX_ROWS, sizeof *first), *r0 = calloc(MAX_ROWS, sizeof *r0);
    cr_assert(first && r0);
    int n0 = read_samples("audit", 0, first, MAX_ROWS);
    int nfirst = n0 + read_samples("audit", 1, first + n0, MAX_ROWS - n0);
    for (int i = 0; i < nfirst; i++)
        cr_expect(first[i].step >= 1 && first[i].step <= at,
                  "rank %d trained step %lld after agreeing to stop at step %d", i < n0 ? 0 : 1,
                  first[i].step, at);
    cr_expect_eq(nfirst, at * G, "the stopped ranks logged %d windows for %d steps of %lld",
                 nfirst, at, G);

    cr_assert_eq(run(NULL, "audit", extra, &out), 0, "%s", out);
    cr_expect(tu_contains(out, "train.grad_accum is now 2"), "%s", out);
    const char *rs = strstr(out, "resumed from");
    cr_assert(rs, "%s", out);
    long long rstep = -1, rsample = -1;
    const char *sp = strstr(rs, ": step ");
    cr_assert(sp && sscanf(sp, ": step %lld, sample %lld", &rstep, &rsample) == 2, "%s", rs);
    free(out);
    cr_expect_eq(rstep, at, "resumed from step %lld, but the stop checkpoint is %d", rstep, at);
    cr_expect_eq(rsample, at * G, "resumed at sample %lld after %d steps of %lld", rsample, at, G);
    int steps = last_step("audit");
    cr_assert_eq(steps, 40, "the run logged %d steps", steps);

    /* rank 0's file: the stopped run's rows, then the resumed run's */
    int n0all = read_samples("audit", 0, r0, MAX_ROWS);
    cr_assert_geq(n0all, n0);
    const sample_row *resumed = r0 + n0;
    int nres = n0all - n0;
    for (int i = 0; i < nres; i++)
        cr_expect(resumed[i].step > at && resumed[i].step <= steps,
                  "the resumed run trained step %lld (checkpoint %d)", resumed[i].step, at);
    cr_expect_eq(nres, (steps - at) * G, "the resumed run logged %d windows for %d steps", nres,
                 steps - at);

    dataset_t d;
    sp_err err = {0};
    char path[4096];
    snprintf(path, sizeof path, "%s/data.train.h5", dir);
    cr_assert_eq(dataset_open(&d, path, SEQ_LEN, model_config_int("vocab_size"), SEED, &err), 0,
                 "%s", err.msg);
    uint64_t total = (uint64_t)steps * (uint64_t)G;
    int *count = calloc(total, sizeof *count);
    cr_assert(count);
    for (int k = 0; k < nfirst + nres; k++) {
        const sample_row *r = k < nfirst ? &first[k] : &resumed[k - nfirst];
        if (k < nfirst && r->step > at)
            continue; /* would be retrained after the checkpoint (reported above) */
        cr_assert_lt(r->sample, total, "sample %llu beyond %llu", r->sample,
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
    for (uint64_t s = 0; s < total; s++)
        cr_expect_eq(count[s], 1, "global sample %llu trained %d times (stop at step %d)",
                     (unsigned long long)s, count[s], at);
    free(count);
    free(first);
    free(r0);
}

/* checkpoint.every_minutes alone (every_steps 0), here 0.18 s: checkpoints
 * come at step boundaries once that long has passed since the previous one
 * (never sooner, to 5 ms), each reporting its stall. Full fine-tuning with
 * the optimizer sharded over 2 ranks: every checkpoint gathers from both
 * ranks, so ranks that did not agree on the boundary would hang. */
Test(resume, every_minutes_checkpoints_at_an_agreed_step_boundary)
{
    const double minutes = 0.003;
    char prefix[2048], extra[512], metrics[4096], log[4096];
    snprintf(prefix, sizeof prefix, "%s", tu_mpirun(2));
    snprintf(extra, sizeof extra,
             "--set train.mode=full --set train.grad_accum=1 --set train.steps=100000 "
             "--set checkpoint.every_steps=0 --set checkpoint.every_minutes=%g",
             minutes);
    snprintf(metrics, sizeof metrics, "%s/minutes/metrics.jsonl", dir);
    snprintf(log, sizeof log, "%s/minutes.log", dir);
    int pid = tu_spawn(log, "%s", train_cmd(prefix, "minutes", extra));
    /* however fast the machine: two timed checkpoints, then stop (5 minutes at most) */
    int timed = 0;
    for (int i = 0; i < 30000 && timed < 2 && proc_running(pid); i++) {
        char *text = tu_read_file(metrics, NULL);
        timed = 0;
        for (const char *p = text ? strstr(text, "\"reason\":\"every_minutes\"") : NULL; p;
             p = strstr(p + 1, "\"reason\":\"every_minutes\""))
            timed++;
        free(text);
        tu_sleep(0.01);
    }
    kill(pid, SIGUSR1);
    int rc = tu_wait(pid, 300);
    char *text = read_log("minutes");
    cr_assert_eq(rc, 75, "exit %d: %s", rc, text);
    stopped_at("minutes", text);
    ck_record r[256];
    int n = checkpoint_records("minutes", r, 256);
    timed = 0;
    for (int i = 0; i < n; i++) {
        int is_timed = strcmp(r[i].reason, "every_minutes") == 0;
        timed += is_timed;
        cr_expect(is_timed || (i == n - 1 && strcmp(r[i].reason, "signal") == 0),
                  "checkpoint %d of %d at step %lld: reason %s", i + 1, n, r[i].step,
                  r[i].reason);
        if (is_timed && i > 0)
            cr_expect_geq(r[i].time - r[i - 1].time, minutes * 60 - 0.005,
                          "step %lld came %.3f s after the previous checkpoint (every %.2f s)",
                          r[i].step, r[i].time - r[i - 1].time, minutes * 60);
    }
    cr_expect_geq(timed, 1, "no every_minutes checkpoint: %s", text);
    expect_stall_reported(r, n, text);
    free(text);
    cr_expect_geq(expect_checkpoints_verify("minutes"), 1);
}

/* Every checkpoint (every_steps 10, and the end) says in metrics.jsonl and in
 * the log how long it held training and how big it was. */
Test(resume, every_checkpoint_reports_its_training_stall)
{
    char *out = NULL;
    cr_assert_eq(run(NULL, "stall", "--set checkpoint.every_steps=10", &out), 0, "%s", out);
    ck_record r[64];
    int n = checkpoint_records("stall", r, 64);
    cr_expect_eq(n, 4, "%d checkpoints in 40 steps, every 10", n);
    for (int i = 0; i < n; i++) {
        cr_expect_eq(r[i].step, 10 * (i + 1));
        cr_expect_str_eq(r[i].reason, i == 3 ? "end" : "every_steps", "step %lld", r[i].step);
    }
    expect_stall_reported(r, n, out);
    /* and each was committed */
    char path[4096];
    snprintf(path, sizeof path, "%s/stall/metrics.jsonl", dir);
    char *metrics = tu_read_file(path, NULL);
    for (int i = 0; i < n; i++) {
        char pat[128];
        snprintf(pat, sizeof pat, "\"event\":\"checkpoint_committed\",\"message\":\"step %lld ",
                 r[i].step);
        cr_expect(tu_contains(metrics, pat), "step %lld was not committed", r[i].step);
    }
    free(metrics);
    free(out);
    expect_checkpoints_verify("stall");
}

/* A LoRA checkpoint holds the adapters and their AdamW moments — for each
 * layer of config.json and each lora.targets entry, lora_A and lora_B in
 * params/, adam_m/ and adam_v/ — and of the frozen base only its identity. */
Test(resume, lora_checkpoint_holds_only_the_adapters)
{
    char *out = NULL;
    cr_assert_eq(run(NULL, "adapters", "--set train.steps=4", &out), 0, "%s", out);
    free(out);
    char root[4096], path[4096];
    snprintf(root, sizeof root, "%s/adapters/checkpoints", dir);
    int found = 0;
    sp_err err = {0};
    cr_assert_eq(ckpt_find_latest(root, path, sizeof path, &found, NULL, NULL, &err), 0, "%s",
                 err.msg);
    cr_assert(found, "no checkpoint in %s", root);
    ckpt_snapshot s;
    cr_assert_eq(ckpt_read(path, &s, &err), 0, "%s", err.msg);

    /* what LoRA trains: the run's targets (its resolved config) x the layers */
    const ckpt_attr *conf = ckpt_get(&s, "config");
    cr_assert(conf && conf->type == CKPT_ATTR_STR, "no config attribute");
    const char *tl = strstr(conf->s, "targets: [");
    cr_assert(tl, "no lora targets in %s", conf->s);
    tl += strlen("targets: [");
    char targets[16][64];
    int nt = 0;
    while (*tl && *tl != ']' && nt < 16) {
        size_t skip = strspn(tl, " ,'\""), len;
        tl += skip;
        len = strcspn(tl, " ,'\"]");
        if (len > 0 && len < 64)
            snprintf(targets[nt++], 64, "%.*s", (int)len, tl);
        tl += len;
    }
    long layers = model_config_int("num_hidden_layers");
    cr_assert(nt > 0 && layers > 0, "%d targets, %ld layers", nt, layers);
    const char *groups[3] = {"params/", "adam_m/", "adam_v/"};
    int expected = 3 * (int)layers * nt * 2;
    cr_expect_eq(s.narrays, expected, "%d arrays, not 3 x %ld layers x %d targets x (A, B)",
                 s.narrays, layers, nt);
    int *seen = calloc((size_t)expected, sizeof *seen);
    cr_assert(seen);
    for (int i = 0; i < s.narrays; i++) {
        const char *name = s.arrays[i].name + (s.arrays[i].name[0] == '/');
        int g = -1, t = -1;
        for (int k = 0; k < 3; k++)
            if (strncmp(name, groups[k], strlen(groups[k])) == 0)
                g = k;
        int ab = strstr(name, ".lora_A.") ? 0 : strstr(name, ".lora_B.") ? 1 : -1;
        const char *lp = strstr(name, ".layers.");
        long layer = lp ? strtol(lp + strlen(".layers."), NULL, 10) : -1;
        for (int k = 0; k < nt; k++) {
            char pat[96];
            snprintf(pat, sizeof pat, ".%s.lora_", targets[k]);
            if (strstr(name, pat))
                t = k;
        }
        cr_expect(g >= 0 && ab >= 0 && layer >= 0 && layer < layers && t >= 0,
                  "%s is not a LoRA tensor of a target layer", name);
        if (g >= 0 && ab >= 0 && layer >= 0 && layer < layers && t >= 0)
            seen[((g * layers + layer) * nt + t) * 2 + ab]++;
    }
    for (int k = 0; k < expected; k++)
        cr_expect_eq(seen[k], 1, "%s layer %ld %s lora_%c: %d arrays",
                     groups[k / (2 * nt * layers)], (k / (2 * nt)) % layers,
                     targets[(k / 2) % nt], k % 2 ? 'B' : 'A', seen[k]);
    free(seen);

    /* none of the base model's tensors */
    char model[4096];
    snprintf(model, sizeof model, "%s/model/model.safetensors", dir);
    st_file f;
    cr_assert_eq(st_open(&f, model, &err), 0, "%s", err.msg);
    cr_expect_gt(f.n, 0);
    int embed = 0;
    for (size_t i = 0; i < f.n; i++) {
        embed += strcmp(f.tensors[i].name, "model.embed_tokens.weight") == 0;
        for (int g = 0; g < 3; g++) {
            char name[512];
            snprintf(name, sizeof name, "%s%s", groups[g], f.tensors[i].name);
            cr_expect(!ckpt_find_array(&s, name), "the checkpoint holds the base's %s", name);
        }
    }
    st_close(&f);
    cr_expect_eq(embed, 1, "the base model has no model.embed_tokens.weight");
    cr_expect(!ckpt_find_array(&s, "params/model.embed_tokens.weight"));

    /* the base's identity: 16 hex digits, the same in state.h5 and MANIFEST */
    const ckpt_attr *id = ckpt_get(&s, "base_model"), *mode = ckpt_get(&s, "mode");
    cr_assert(id && id->type == CKPT_ATTR_STR, "no base_model attribute");
    cr_expect(strlen(id->s) == 16 && strspn(id->s, "0123456789abcdef") == 16, "base_model %s",
              id->s);
    cr_expect_str_eq(id->s, s.base_model, "state.h5 and MANIFEST name different bases");
    cr_expect(mode && mode->type == CKPT_ATTR_STR && strcmp(mode->s, "lora") == 0);
    ckpt_snapshot_free(&s);

    struct stat st_state, st_model;
    char state[4200];
    snprintf(state, sizeof state, "%s/%s", path, CKPT_STATE_FILE);
    cr_assert_eq(stat(state, &st_state), 0);
    cr_assert_eq(stat(model, &st_model), 0);
    cr_expect_lt(st_state.st_size, st_model.st_size,
                 "state.h5 (%lld bytes) is not smaller than the base (%lld bytes)",
                 (long long)st_state.st_size, (long long)st_model.st_size);
}

/* SIGKILL at random moments, checkpoints every 2 steps: whatever the moment,
 * the checkpoint a restart picks verifies, and the run ends where an
 * uninterrupted one does. A kill lands a random 1-8 steps after the restart
 * has logged its first step, plus a random 0-30 ms: within a step, often
 * while a checkpoint is being written, whatever the speed of the machine. */
Test(resume, sigkill_at_random_moments)
{
    const char *extra = "--set checkpoint.every_steps=2 --set train.steps=400";
    char *out = NULL;
    cr_assert_eq(run(NULL, "whole", extra, &out), 0, "%s", out);
    free(out);
    char log[4096], root[4096];
    snprintf(log, sizeof log, "%s/chaos.log", dir);
    snprintf(root, sizeof root, "%s/chaos/checkpoints", dir);
    int trials = 0, finished = 0;
    for (int t = 0; t < 20 && !finished; t++) {
        int before = 0;
        char mpath[4096];
        snprintf(mpath, sizeof mpath, "%s/chaos/metrics.jsonl", dir);
        if (access(mpath, R_OK) == 0)
            before = last_step("chaos");
        int pid = tu_spawn(log, "%s", train_cmd(NULL, "chaos", extra));
        int target = before + 1 + (int)(8 * sp_rng_uniform(99, (uint64_t)t));
        wait_step("chaos", target, pid);
        tu_sleep(0.03 * sp_rng_uniform(98, (uint64_t)t));
        if (kill(pid, SIGKILL) == 0)
            trials++;
        int rc = tu_wait(pid, 120);
        finished = rc == 0;
        /* every committed checkpoint verifies; none is chosen that does not */
        ckpt_info *l;
        int n;
        sp_err err = {0};
        cr_assert_eq(ckpt_list(root, 1, &l, &n, &err), 0);
        for (int i = 0; i < n; i++)
            if (strncmp(l[i].name, ".tmp-", 5) != 0)
                cr_expect(l[i].ok, "trial %d: %s fails: %s", t, l[i].name, l[i].problem);
        free(l);
    }
    cr_expect_geq(trials, 20, "only %d kills landed", trials);
    if (!finished) {
        cr_assert_eq(run(NULL, "chaos", extra, &out), 0, "%s", out);
        free(out);
    }
    cr_expect_eq(tu_sh(NULL, "cmp %s/whole/adapter/adapter_model.safetensors "
                             "%s/chaos/adapter/adapter_model.safetensors",
                       dir, dir),
                 0, "the run killed %d times ended with other weights", trials);
}

Test(resume, damaged_newest_checkpoint_is_skipped_with_a_message)
{
    char *out = NULL;
    cr_assert_eq(run(NULL, "dmg", "--set checkpoint.every_steps=5 --set train.steps=10", &out), 0,
                 "%s", out);
    free(out);
    tu_sh(NULL, "printf 'Z' | dd of=%s/dmg/checkpoints/step-00000010/state.h5 bs=1 seek=4000 "
                "conv=notrunc 2>/dev/null",
          dir);
    cr_assert_eq(run(NULL, "dmg", "--set checkpoint.every_steps=5 --set train.steps=12", &out), 0,
                 "%s", out);
    cr_expect(tu_contains(out, "skipping checkpoint step-00000010") &&
                  tu_contains(out, "fails its SHA-256 checksum"),
              "%s", out);
    cr_expect(tu_contains(out, "resumed from") && tu_contains(out, "step-00000005"), "%s", out);
    free(out);
}

Test(resume, changed_math_refused_changed_steps_allowed)
{
    char *out = NULL;
    cr_assert_eq(run(NULL, "chg", "--set train.steps=6", &out), 0, "%s", out);
    free(out);
    int rc = run(NULL, "chg", "--set train.steps=8 --set lora.r=8", &out);
    cr_expect_eq(rc, 2, "%s", out);
    cr_expect(tu_contains(out, "lora.r (4, now 8)"), "%s", out);
    free(out);
    char sets[4096];
    snprintf(sets, sizeof sets, "--set train.steps=8 --set model.path=%s/other", dir);
    rc = run(NULL, "chg", sets, &out);
    cr_expect_eq(rc, 2, "%s", out);
    cr_expect(tu_contains(out, "another base model"), "%s", out);
    free(out);
    rc = run(NULL, "chg", "--set train.steps=8 --set log.every=2", &out);
    cr_expect_eq(rc, 0, "%s", out);
    cr_expect(tu_contains(out, "resumed from") && tu_contains(out, "step 6"), "%s", out);
    free(out);
    cr_expect_eq(last_step("chg"), 8);
    /* --resume none starts afresh */
    rc = run(NULL, "chg", "--set train.steps=3 --resume none", &out);
    cr_expect_eq(rc, 0, "%s", out);
    cr_expect(!tu_contains(out, "resumed from"), "%s", out);
    free(out);
}
