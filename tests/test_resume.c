/* Preemption and resume end to end, through the spotune binary (and mpirun
 * for several ranks): a run stopped by SIGTERM, SIGINT or SIGUSR1 (on the
 * launcher or on one rank only), or killed with SIGKILL just after a
 * checkpoint, continues to the bit-identical result of an uninterrupted run
 * (CPU); signals during the stop checkpoint's save corrupt nothing; 2 ranks
 * resume on 1 with the same global batch; SIGKILL at random moments never
 * leaves a checkpoint that is chosen and fails; signals during start-up; the
 * preemption budget. Which checkpoint a restart takes, and what it refuses:
 * test_resume_choice.c. */
#define _POSIX_C_SOURCE 200809L
#include <criterion/criterion.h>
#include <dirent.h>
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

TestSuite(resume, .init = resume_setup, .fini = resume_teardown, .timeout = 900);

/* A signal to a single process: at the next step boundary it commits a
 * checkpoint and exits 75 (the log names the signal), having trained no step
 * past that checkpoint; resumed, the run ends bit-identical to an
 * uninterrupted one. extra: more options for every run. */
static void signal_then_resume_with(int sig, const char *sig_name, const char *extra)
{
    char *out = NULL;
    cr_assert_eq(run(NULL, "whole", extra, &out), 0, "%s", out);
    free(out);
    stop_with(NULL, "cut", extra, sig, 12);
    char *text = read_log("cut"), want[64];
    snprintf(want, sizeof want, "stop requested (%s)", sig_name);
    cr_expect(tu_contains(text, want), "no '%s': %s", want, text);
    int at = stopped_at("cut", text);
    free(text);
    int done = last_step("cut");
    cr_assert(done >= 12 && done < 40, "stopped after %d steps", done);
    cr_expect_eq(done, at, "the run logged %d steps but its stop checkpoint is step %d", done, at);
    cr_assert_eq(run(NULL, "cut", extra, &out), 0, "%s", out);
    cr_expect(tu_contains(out, "resumed from"), "%s", out);
    free(out);
    expect_same_run("whole", "cut", 1);
}

static void signal_then_resume(int sig, const char *sig_name)
{
    signal_then_resume_with(sig, sig_name, NULL);
}

/* DoRA: the magnitudes are trainable parameters like A and B (masters and
 * AdamW moments in the checkpoint), so a resumed DoRA run is bit-identical
 * too. */
Test(resume, dora_sigterm_then_resume_is_bit_identical)
{
    signal_then_resume_with(SIGTERM, "SIGTERM", "--set lora.dropout=0 --set lora.dora=true");
}

/* QLoRA: the NF4 base is quantized again from model.path on resume, the same
 * way, so a resumed run is bit-identical too. */
Test(resume, nf4_sigterm_then_resume_is_bit_identical)
{
    signal_then_resume_with(SIGTERM, "SIGTERM", "--set model.quantize=nf4");
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

/* SIGKILL before the first checkpoint: the next start has nothing to resume
 * from and starts afresh, and metrics.jsonl then holds each step once (the
 * killed attempt's records are dropped), so the curve is the whole run's. */
Test(resume, a_start_after_a_kill_before_any_checkpoint_logs_each_step_once)
{
    char *out = NULL;
    cr_assert_eq(run(NULL, "whole", NULL, &out), 0, "%s", out);
    free(out);
    char log[4096];
    snprintf(log, sizeof log, "%s/killed.log", dir);
    int pid = tu_spawn(log, "%s", train_cmd(NULL, "killed", NULL));
    wait_step("killed", 3, pid);
    kill(pid, SIGKILL);
    tu_wait(pid, 60);
    int before = last_step("killed");
    cr_assert(before >= 3 && before < 40, "the killed attempt logged %d steps", before);
    cr_assert_eq(run(NULL, "killed", NULL, &out), 0, "%s", out);
    cr_expect(!tu_contains(out, "resumed from"), "%s", out);
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

/* A resume on a new machine (an empty run directory, --resume naming the
 * checkpoint) starts its metrics from the checkpoint's copy: every step is
 * in the curve once, even when the run logged something before it resumed
 * (here: OpenBLAS's generic kernels, forced on a CPU with wider ones, warn
 * at the start; the freshness of metrics.jsonl is how it was before this
 * process wrote to it). */
Test(resume, a_new_machine_keeps_the_curve_after_an_early_warning)
{
    char *out = NULL, ck[4096];
    const char *extra = "--set train.steps=6 --set checkpoint.every_steps=3";
    cr_assert_eq(run(NULL, "first", extra, &out), 0, "%s", out);
    free(out);
    snprintf(ck, sizeof ck, "%s --resume %s/first/checkpoints/step-00000003", extra, dir);
    int wider;
    tu_cpu_vector_units(&wider);
    cr_assert_eq(run("OPENBLAS_CORETYPE=Prescott", "moved", ck, &out), 0, "%s", out);
    cr_expect(tu_contains(out, "resumed from"), "%s", out);
    if (wider)
        cr_expect(tu_contains(out, "keeps OpenBLAS on kernels narrower"), "%s", out);
    free(out);
    double a[16], b[16];
    int na = read_losses("first", a, 16), nb = read_losses("moved", b, 16);
    cr_assert_eq(na, 6);
    cr_assert_eq(nb, 6, "the moved run's curve has %d steps, not the 6 of the checkpoint's 3 "
                        "and its own 3", nb);
    for (int i = 0; i < 3; i++)
        cr_expect_eq(a[i], b[i], "step %d: %.17g, the checkpoint's copy %.17g", i + 1, b[i], a[i]);
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

/* Whether process pid has a handler for SIGTERM yet (/proc/PID/status,
 * SigCgt): the earliest moment a signal can meet something but the default
 * action. */
static int catches_sigterm(int pid)
{
    char path[64], buf[4096];
    snprintf(path, sizeof path, "/proc/%d/status", pid);
    read_proc(path, buf, sizeof buf);
    const char *p = strstr(buf, "SigCgt:");
    unsigned long long mask = p ? strtoull(p + SP_LEN("SigCgt:"), NULL, 16) : 0;
    return (mask >> (SIGTERM - 1)) & 1;
}

/* Waits (up to 60 s) until pid catches SIGTERM; 0 if it ended first. */
static int wait_catching(int pid)
{
    for (int i = 0; i < 120000; i++) {
        if (!proc_running(pid))
            return 0;
        if (catches_sigterm(pid))
            return 1;
        tu_sleep(0.0005);
    }
    return 0;
}

/* SIGTERM as soon as spotune can catch it, then a little later (config,
 * MPI, model and data set-up): never the default action (exit 143). Before
 * the first step the run stops at once, says "stopped before training
 * started" and exits 75 with nothing trained and no checkpoint; later, it is
 * the usual stop at a step boundary with a committed checkpoint. */
Test(resume, a_signal_during_start_up_stops_cleanly)
{
    const double delays[] = {0, 0.002, 0.01, 0.03, 0.1};
    int before = 0;
    for (size_t i = 0; i < sizeof delays / sizeof delays[0]; i++) {
        char name[64], log[4096];
        snprintf(name, sizeof name, "early-%zu", i);
        snprintf(log, sizeof log, "%s/%s.log", dir, name);
        int pid = tu_spawn(log, "%s", train_cmd(NULL, name, ""));
        cr_assert(wait_catching(pid), "%s: spotune never caught SIGTERM", name);
        tu_sleep(delays[i]);
        kill(pid, SIGTERM);
        int rc = tu_wait(pid, 300);
        char *text = read_log(name);
        cr_assert_eq(rc, 75, "SIGTERM %.3f s after the handler: exit %d: %s", delays[i], rc,
                     text);
        if (tu_contains(text, "stopped by SIGTERM before training started")) {
            before++;
            cr_expect(!tu_contains(text, "step      1/"), "a step was trained: %s", text);
            cr_expect_eq(expect_checkpoints_verify(name), 0, "a checkpoint was written: %s",
                         text);
        } else {
            stopped_at(name, text);
        }
        if (i == 0)
            cr_expect(tu_contains(text, "before training started"),
                      "the first moment it can be caught is before training: %s", text);
        free(text);
    }
    cr_expect_geq(before, 1);
}

/* The same under mpirun, to one rank as soon as it catches SIGTERM: both
 * ranks stop before training, and the job exits 75. */
Test(resume, a_signal_to_one_rank_during_start_up_stops_the_job)
{
    char log[4096];
    snprintf(log, sizeof log, "%s/early2.log", dir);
    int pid = tu_spawn(log, "%s", train_cmd(tu_mpirun(2), "early2", ""));
    int victim = 0;
    for (int i = 0; i < 60000 && !victim && proc_running(pid); i++) {
        victim = rank_pid(pid, 1);
        if (!victim)
            tu_sleep(0.001);
    }
    cr_assert(victim > 0 && wait_catching(victim), "rank 1 never caught SIGTERM");
    kill(victim, SIGTERM);
    int rc = tu_wait(pid, 300);
    char *text = read_log("early2");
    cr_assert_eq(rc, 75, "exit %d: %s", rc, text);
    cr_expect(tu_contains(text, "before training started"), "%s", text);
    cr_expect(!tu_contains(text, "step      1/"), "a step was trained: %s", text);
    free(text);
}

/* The last line of RUN/metrics.jsonl holding needle (malloc'ed), or NULL. */
static char *last_record(const char *name, const char *needle)
{
    char *text = tu_read_file(tu_fmt("%s/%s/metrics.jsonl", dir, name), NULL);
    cr_assert(text);
    char *found = NULL;
    for (char *line = strtok(text, "\n"); line; line = strtok(NULL, "\n"))
        if (strstr(line, needle)) {
            free(found);
            found = strdup(line);
        }
    free(text);
    return found;
}

/* A stop on 2 ranks pushing to a bucket: the "preemption" record gives the
 * seconds from the signal to the checkpoint committed and to it being in the
 * store, and the bytes each rank wrote (rank 0 all of the checkpoint, the
 * gathered format); each push's record its bytes and rate. A resume whose
 * checkpoint.upload_deadline_s the measured rate cannot meet is warned at
 * start, naming the key, and the first push that overruns it once. */
Test(resume, preemption_budget_and_upload_rate)
{
    char extra[4200];
    snprintf(extra, sizeof extra,
             "--set train.steps=400 --set checkpoint.every_steps=4 "
             "--set checkpoint.remote=file://%s/pb-bucket",
             dir);
    stop_with(tu_mpirun(2), "pb", extra, SIGUSR1, 9);
    char *rec = last_record("pb", "\"event\":\"preemption\"");
    cr_assert(rec, "no preemption record");
    double to_commit = field(rec, "to_commit_s"), to_remote = field(rec, "to_remote_s");
    long long step = (long long)field(rec, "step");
    cr_expect(to_commit >= 0 && to_commit < 60, "to_commit_s %g", to_commit);
    cr_expect(to_remote >= to_commit && to_remote < 60, "to_remote_s %g (commit %g)", to_remote,
              to_commit);
    cr_expect(tu_contains(rec, "\"signal\":\"SIGUSR1\""), "%s", rec);
    char name[32];
    ckpt_dir_name(name, sizeof name, step);
    uint64_t bytes = ckpt_tree_bytes(tu_fmt("%s/pb/checkpoints/%s", dir, name));
    cr_assert_gt(bytes, 0, "no checkpoint %s", name);
    cr_expect(tu_contains(rec, tu_fmt("\"bytes_per_rank\":[%llu,0]", (unsigned long long)bytes)),
              "bytes per rank of %llu expected: %s", (unsigned long long)bytes, rec);
    free(rec);
    /* the push of that checkpoint: its bytes (those of the bucket's copy) and a rate */
    rec = last_record("pb", tu_fmt("/%s (", name));
    cr_assert(rec, "no upload record of %s", name);
    cr_expect_eq((uint64_t)field(rec, "bytes"),
                 ckpt_tree_bytes(tu_fmt("%s/pb-bucket/%s", dir, name)), "%s", rec);
    cr_expect_gt(field(rec, "mb_per_s"), 0, "%s", rec);
    free(rec);
    /* the resume cannot meet a deadline of 1 microsecond at that rate */
    char *out = NULL;
    char more[4300];
    snprintf(more, sizeof more,
             "%s --set train.steps=%lld --set checkpoint.upload_deadline_s=0.000001", extra,
             step + 8);
    int rc = run(NULL, "pb", more, &out);
    cr_assert_eq(rc, 0, "%s", out);
    cr_expect(tu_contains(out, "at the upload rate this run last measured") &&
                  tu_contains(out, "longer than checkpoint.upload_deadline_s (0 s)"),
              "%s", out);
    const char *slow = "took", *p = out;
    int overruns = 0;
    while ((p = strstr(p, "pushing step-")) != NULL) {
        overruns += strstr(p, slow) != NULL && strstr(p, slow) < strchr(p, '\n');
        p++;
    }
    cr_expect_eq(overruns, 1, "the overrun is said once, said %d times:\n%s", overruns, out);
    free(out);
}

/* The newest .tmp-step-N-PID directory in run name's checkpoints (its step
 * N, or -1 when there is none). */
static long pending_tmp_step(const char *name)
{
    DIR *d = opendir(tu_fmt("%s/%s/checkpoints", dir, name));
    long best = -1;
    struct dirent *e;
    while (d && (e = readdir(d)))
        if (strncmp(e->d_name, ".tmp-step-", 10) == 0) {
            long s = strtol(e->d_name + 10, NULL, 10);
            best = s > best ? s : best;
        }
    if (d)
        closedir(d);
    return best;
}

/* Sharded checkpoints (full fine-tuning on 2 ranks, a shard file per rank):
 * SIGKILL of rank 1 while a checkpoint is pending (its .tmp- directory is
 * there, written or being written, MANIFEST not yet) ends the job with that
 * step never complete; the next start skips the leftover, naming it,
 * resumes from the newest complete checkpoint, before it, and finishes. */
Test(resume, sigkill_of_one_rank_during_sharded_writes_resumes_from_the_previous_checkpoint)
{
    const char *extra = "--set train.mode=full --set checkpoint.every_steps=3 --set train.steps=40";
    char prefix[2048], log[4096], first[4096];
    snprintf(prefix, sizeof prefix, "%s", tu_mpirun(2));
    snprintf(log, sizeof log, "%s/shk.log", dir);
    snprintf(first, sizeof first, "%s/shk/checkpoints/step-00000003/MANIFEST.json", dir);
    int pid = tu_spawn(log, "%s", train_cmd(prefix, "shk", extra));
    long pending = -1;
    for (int i = 0; i < 200000 && proc_running(pid); i++) { /* 100 s at most */
        if (access(first, R_OK) == 0 && (pending = pending_tmp_step("shk")) > 3)
            break;
        tu_sleep(0.0005);
    }
    int victim = rank_pid(pid, 1);
    if (pending <= 3 || victim <= 0) {
        kill(-pid, SIGKILL);
        tu_wait(pid, 60);
        cr_assert_fail("no pending checkpoint after step 3 (%ld) or no rank 1 (%d)", pending,
                       victim);
    }
    kill(victim, SIGKILL);
    int rc = tu_wait(pid, 120);
    cr_assert_neq(rc, 0, "the job survived the loss of a rank");
    const char *m = tu_fmt("%s/shk/checkpoints/step-%08ld/MANIFEST.json", dir, pending);
    cr_expect_neq(access(m, R_OK), 0, "%s exists: a checkpoint completed without rank 1", m);
    char *out = NULL;
    rc = run(prefix, "shk", extra, &out);
    cr_assert_eq(rc, 0, "%s", out);
    char want[128];
    snprintf(want, sizeof want, "skipping checkpoint .tmp-step-%08ld-", pending);
    cr_expect(tu_contains(out, want), "no '%s' in\n%s", want, out);
    long resumed = -1;
    const char *at = strstr(out, "resumed from ");
    if (at && (at = strstr(at, "step-")))
        resumed = strtol(at + 5, NULL, 10);
    cr_expect(resumed >= 3 && resumed < pending && resumed % 3 == 0,
              "resumed from step %ld, the pending one was %ld:\n%s", resumed, pending, out);
    cr_expect_eq(last_step("shk"), 40);
    free(out);
}
