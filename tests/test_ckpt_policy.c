/* What the checkpoint policy promises, through the spotune binary: after 2
 * ranks resume on 1 every sample is trained exactly once;
 * checkpoint.every_minutes fires at a step boundary the ranks agree on; every
 * checkpoint reports its training stall in the log and the metrics; a LoRA
 * checkpoint holds only the adapters, never the frozen base. */
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

TestSuite(ckpt_policy, .init = resume_setup, .fini = resume_teardown, .timeout = 900);

/* 2 ranks stopped by SIGUSR1, resumed on 1 to the end: the global sample
 * order continues exactly. Over the whole run every global sample index
 * 0 .. steps x global_batch - 1 is trained exactly once, in its own step, as
 * the window the (seed, epoch) permutation assigns it; the stopped ranks
 * trained nothing past the checkpoint and the resumed rank nothing before. */
Test(ckpt_policy, two_ranks_resume_on_one_trains_every_sample_once)
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

    /* the stopped ranks' rows past the checkpoint were reported above */
    int kept = 0;
    for (int k = 0; k < nfirst; k++)
        if (first[k].step <= at)
            first[kept++] = first[k];
    for (int k = 0; k < nres && kept < MAX_ROWS; k++)
        first[kept++] = resumed[k];
    expect_every_sample_once(first, kept, steps, G);
    free(first);
    free(r0);
}

/* checkpoint.every_minutes alone (every_steps 0), here 0.18 s: checkpoints
 * come at step boundaries once that long has passed since the previous one
 * (never sooner, to 5 ms), each reporting its stall. Full fine-tuning with
 * the optimizer sharded over 2 ranks: every checkpoint gathers from both
 * ranks, so ranks that did not agree on the boundary would hang. */
Test(ckpt_policy, every_minutes_checkpoints_at_an_agreed_step_boundary)
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
Test(ckpt_policy, every_checkpoint_reports_its_training_stall)
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
Test(ckpt_policy, lora_checkpoint_holds_only_the_adapters)
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
        for (int k = 0; k < nt; k++)
            if (strstr(name, tu_fmt(".%s.lora_", targets[k])))
                t = k;
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

/* The run directory on a small tmpfs that is full: each checkpoint that does
 * not fit is skipped with a warning naming the free space while training
 * goes on; once space returns, the next boundary writes one and the run ends
 * 0 with every checkpoint verifying. Still full at the end, the run ends 1
 * saying that its last checkpoint was not written (never a crash). */
Test(ckpt_policy, a_full_disk_skips_checkpoints_while_training_goes_on)
{
    char tfs[4096], log[4096];
    snprintf(tfs, sizeof tfs, "%s/tfs", dir);
    cr_assert_eq(tu_mount_tmpfs(tfs, 8192), 0, "cannot mount a tmpfs at %s (needs root)", tfs);
    long avail = tu_free_kib(tfs);
    cr_assert_gt(avail, 1000);
    /* 400 KiB stay free: the run's config and metrics fit, a checkpoint does not */
    cr_assert_eq(tu_sh(NULL, "fallocate -l %ldk %s/filler", avail - 400, tfs), 0);
    const char *extra = "--set train.steps=300 --set checkpoint.every_steps=5 --set log.every=1";
    snprintf(log, sizeof log, "%s/tfs-full.log", dir);
    int pid = tu_spawn(log, "%s", train_cmd(NULL, "tfs/full", extra));
    char *text = NULL;
    for (int i = 0; i < 30000 && proc_running(pid); i++) {
        free(text);
        text = tu_read_file(log, NULL);
        if (tu_contains(text, "checkpoint step 10 was not written"))
            break;
        tu_sleep(0.01);
    }
    cr_assert(tu_contains(text, "checkpoint step 10 was not written"), "%s", text);
    free(text);
    cr_assert_eq(tu_sh(NULL, "rm %s/filler", tfs), 0);
    int rc = tu_wait(pid, 600);
    text = tu_read_file(log, NULL);
    cr_assert_eq(rc, 0, "exit %d: %s", rc, text);
    cr_expect(tu_contains(text, "checkpoint step 5 was not written") &&
                  tu_contains(text, "no space for checkpoint step 5") &&
                  tu_contains(text, "MiB free; training goes on"),
              "%s", text);
    cr_expect(tu_contains(text, "step    300/300"), "%s", text);
    const char *last_fail = text, *p;
    while ((p = strstr(last_fail + 1, " was not written")))
        last_fail = p;
    cr_expect(strstr(last_fail, "checkpoint_committed: step "),
              "no checkpoint was committed after the last failed one: %s", text);
    free(text);
    cr_expect_geq(expect_checkpoints_verify("tfs/full"), 1);
    const char *final = tu_fmt("%s/full/checkpoints/step-00000300", tfs);
    cr_expect_eq(tu_sh(NULL, "test -f %s/MANIFEST.json", final), 0, "no %s", final);

    /* full to the end */
    avail = tu_free_kib(tfs);
    cr_assert_eq(tu_sh(NULL, "fallocate -l %ldk %s/filler", avail - 400, tfs), 0);
    char *out = NULL;
    rc = run(NULL, "tfs/full2", "--set train.steps=12 --set checkpoint.every_steps=5", &out);
    cr_expect_eq(rc, 1, "exit %d: %s", rc, out);
    cr_expect(tu_contains(out, "training finished, but its last checkpoint was not written") &&
                  tu_contains(out, "no space for checkpoint step 12"),
              "%s", out);
    free(out);
}

/* One job per run directory: a second job on the directory of a running one
 * waits run.lock_wait_s, then exits 2 naming the holder and having written
 * nothing there; the first runs on to a normal end. A lock file left by a job
 * that has ended (no process holds it) is taken over, with a message. */
Test(ckpt_policy, one_job_per_run_directory)
{
    char log[4096];
    snprintf(log, sizeof log, "%s/shared.log", dir);
    int pid = tu_spawn(log, "%s", train_cmd(NULL, "shared", "--set train.steps=400"));
    wait_step("shared", 2, pid);
    cr_assert(proc_running(pid), "the first job ended early");
    char *out = NULL;
    double t0 = sp_now();
    int rc = run(NULL, "shared", "--set run.lock_wait_s=1 --set train.steps=5", &out);
    double waited = sp_now() - t0;
    char want[128];
    snprintf(want, sizeof want, "is in use by another job (pid %d on host ", pid);
    cr_expect_eq(rc, 2, "exit %d: %s", rc, out);
    cr_expect(tu_contains(out, want), "'%s' lacks '%s'", out, want);
    cr_expect(tu_contains(out, "waiting up to 1 s"), "%s", out);
    cr_expect_geq(waited, 1.0, "refused after %.2f s, before run.lock_wait_s", waited);
    free(out);
    rc = tu_wait(pid, 600);
    char *text = read_log("shared");
    cr_expect_eq(rc, 0, "the first job: exit %d: %s", rc, text);
    free(text);
    char mpath[4096];
    snprintf(mpath, sizeof mpath, "%s/shared/metrics.jsonl", dir);
    text = tu_read_file(mpath, NULL);
    int records = 0;
    for (const char *p = text; p && (p = strstr(p, "\"event\":\"train\"")); p++)
        records++;
    cr_expect(records == 400 && tu_contains(text, "\"step\":400,"),
              "the first job's metrics were disturbed (%d train records)", records);
    free(text);
    char cfgpath[4096];
    snprintf(cfgpath, sizeof cfgpath, "%s/shared/config.yaml", dir);
    text = tu_read_file(cfgpath, NULL);
    cr_expect(tu_contains(text, "steps: 400"), "the second job rewrote config.yaml: %s", text);
    free(text);

    /* a lock file whose holder has ended */
    char lock[4096];
    snprintf(lock, sizeof lock, "%s/stale/.lock", dir);
    cr_assert_eq(tu_sh(NULL, "mkdir -p %s/stale", dir), 0);
    cr_assert_eq(tu_write_file(lock, "pid 999999 on host elsewhere (job 0123456789abcdef, "
                                     "started 2026-01-01T00:00:00Z)\n"),
                 0);
    rc = run(NULL, "stale", "--set train.steps=3", &out);
    cr_expect_eq(rc, 0, "%s", out);
    cr_expect(tu_contains(out, "was held by pid 999999 on host elsewhere") &&
                  tu_contains(out, "which has ended; this job takes it over"),
              "%s", out);
    free(out);
    text = tu_read_file(lock, NULL);
    cr_expect(text && text[0] == 0, "the lock file still names a holder after the end: %s", text);
    free(text);
}

/* Sharded checkpoints pushed by every rank: rank 1 cannot put its shard of
 * step 4 (a directory stands at that key of the file:// store), so step 4
 * never gets a MANIFEST.json there, while steps 2 and 6 do, each with both
 * shards; the run goes on, says which shard was not put and that the store
 * is behind, and ends 0 with its final checkpoint complete in the store. */
Test(ckpt_policy, sharded_upload_failure_of_one_rank_leaves_no_remote_manifest)
{
    char store[4096];
    snprintf(store, sizeof store, "%s/shstore", dir);
    cr_assert_eq(tu_sh(NULL, "mkdir -p %s/step-00000004/shard-00001-of-00002.h5/blocker", store),
                 0);
    char extra[6000], *out = NULL;
    snprintf(extra, sizeof extra,
             "--set train.mode=full --set train.steps=6 --set checkpoint.every_steps=2 "
             "--set checkpoint.remote=file://%s --set checkpoint.upload_deadline_s=2 "
             "--set checkpoint.keep=5",
             store);
    int rc = run(tu_mpirun(2), "shup", extra, &out);
    cr_assert_eq(rc, 0, "exit %d: %s", rc, out);
    cr_expect(tu_contains(out, "step-00000004/shard-00001-of-00002.h5 was not put"), "%s", out);
    cr_expect(tu_contains(out, "step-00000004 will not be complete in the store") &&
                  tu_contains(out, "has not put it"),
              "rank 0 does not say it waited and gave step 4 up:\n%s", out);
    for (int step = 2; step <= 6; step += 2) {
        const char *m = tu_fmt("%s/step-%08d/MANIFEST.json", store, step);
        cr_expect_eq(access(m, R_OK) == 0, step != 4, "%s %s", m,
                     step == 4 ? "exists without its shard" : "is missing");
        for (int r = 0; r < 2 && step != 4; r++)
            cr_expect_eq(access(tu_fmt("%s/step-%08d/shard-%05d-of-00002.h5", store, step, r),
                                R_OK),
                         0, "step %d lacks rank %d's shard in the store", step, r);
    }
    free(out);
}

/* Sharded checkpoints pushed by every rank, with a store that cannot take
 * the job's lease at start (a directory stands where LEASE.json goes: it can
 * be neither read nor written, while every other key can): the job trains,
 * and no rank puts a shard into the prefix, which may be another live job's,
 * each saying why; once the lease can be written, the checkpoints reach the
 * store and the run ends 0 with its final checkpoint whole there and its
 * lease gone. */
Test(ckpt_policy, sharded_puts_wait_until_the_job_holds_the_prefix)
{
    char store[4096], log[4096];
    snprintf(store, sizeof store, "%s/lease-store", dir);
    cr_assert_eq(tu_sh(NULL, "mkdir -p %s/LEASE.json", store), 0);
    char extra[6000];
    snprintf(extra, sizeof extra,
             "--set train.mode=full --set train.steps=40 --set checkpoint.every_steps=2 "
             "--set checkpoint.remote=file://%s --set checkpoint.upload_deadline_s=1 "
             "--set checkpoint.keep=3 --set log.every=1",
             store);
    snprintf(log, sizeof log, "%s/lease-late.log", dir);
    int pid = tu_spawn(log, "%s", train_cmd(tu_mpirun(2), "lease-late", extra));
    wait_step("lease-late", 8, pid);
    char *text = tu_read_file(log, NULL), *ls = NULL;
    cr_expect(tu_contains(text, "does not answer now; training starts") &&
                  tu_contains(text, "this job's lease on the prefix is written"),
              "%s", text);
    cr_expect(tu_contains(text, "shard-00001-of-00002.h5 was not put") &&
                  tu_contains(text, "LEASE.json cannot be read"),
              "rank 1 does not say why its shard waits: %s", text);
    cr_expect(tu_contains(text, "shard-00000-of-00002.h5 was not put") &&
                  tu_contains(text, "this job's lease on file://"),
              "rank 0 does not say why its shard waits: %s", text);
    free(text);
    tu_sh(&ls, "ls -A %s", store);
    cr_expect_str_eq(ls, "LEASE.json\n", "the store took objects before the job held it");
    free(ls);
    cr_assert_eq(tu_sh(NULL, "rmdir %s/LEASE.json", store), 0);
    int rc = tu_wait(pid, 600);
    text = tu_read_file(log, NULL);
    cr_assert_eq(rc, 0, "exit %d: %s", rc, text);
    free(text);
    char *out = NULL;
    cr_expect_eq(tu_spotune(&out, "ckpt verify file://%s/step-00000040", store), 0, "%s", out);
    free(out);
    for (int r = 0; r < 2; r++)
        cr_expect_eq(access(tu_fmt("%s/step-00000040/shard-%05d-of-00002.h5", store, r), R_OK), 0,
                     "rank %d's final shard is not in the store", r);
    cr_expect_neq(access(tu_fmt("%s/LEASE.json", store), F_OK), 0, "the lease outlived the job");
}

/* Sharded checkpoints (full fine-tuning on 2 ranks, 11 MB a checkpoint,
 * three at once while retention keeps two) on a full tmpfs: the
 * ranks' shard writes fail (no space), each such checkpoint is reported not
 * complete and never gets a MANIFEST, while training goes on; once space
 * returns the next one is committed and the run ends 0 with every
 * checkpoint verifying. Still full at the end, the run ends 1 saying that
 * its last checkpoint is not complete. */
Test(ckpt_policy, a_full_disk_skips_sharded_checkpoints_while_training_goes_on)
{
    char tfs[4096], log[4096], prefix[2048];
    snprintf(prefix, sizeof prefix, "%s", tu_mpirun(2));
    snprintf(tfs, sizeof tfs, "%s/tfs", dir);
    cr_assert_eq(tu_mount_tmpfs(tfs, 49152), 0, "cannot mount a tmpfs at %s (needs root)", tfs);
    long avail = tu_free_kib(tfs);
    cr_assert_gt(avail, 1000);
    cr_assert_eq(tu_sh(NULL, "fallocate -l %ldk %s/filler", avail - 400, tfs), 0);
    const char *extra = "--set train.mode=full --set train.steps=120 "
                        "--set checkpoint.every_steps=5 --set log.every=1";
    snprintf(log, sizeof log, "%s/tfs-sfull.log", dir);
    int pid = tu_spawn(log, "%s", train_cmd(prefix, "tfs/sfull", extra));
    char *text = NULL;
    for (int i = 0; i < 30000 && proc_running(pid); i++) {
        free(text);
        text = tu_read_file(log, NULL);
        if (tu_contains(text, "checkpoint step 10 is not complete"))
            break;
        tu_sleep(0.01);
    }
    cr_assert(tu_contains(text, "checkpoint step 10 is not complete"), "%s", text);
    free(text);
    cr_assert_eq(tu_sh(NULL, "rm %s/filler", tfs), 0);
    int rc = tu_wait(pid, 600);
    text = tu_read_file(log, NULL);
    cr_assert_eq(rc, 0, "exit %d: %s", rc, text);
    cr_expect(tu_contains(text, "cannot write the shard") &&
                  tu_contains(text, "No space left on device"),
              "no rank says why its shard failed: %s", text);
    cr_expect(tu_contains(text, "step    120/120"), "%s", text);
    const char *last_fail = text, *p;
    while ((p = strstr(last_fail + 1, " is not complete")))
        last_fail = p;
    cr_expect(strstr(last_fail, "checkpoint_committed: step "),
              "no checkpoint was committed after the last failed one: %s", text);
    free(text);
    cr_expect_geq(expect_checkpoints_verify("tfs/sfull"), 1);
    cr_expect_eq(tu_sh(NULL, "test -f %s/sfull/checkpoints/step-00000120/MANIFEST.json", tfs), 0);
    cr_expect_neq(tu_sh(NULL, "test -f %s/sfull/checkpoints/step-00000010/MANIFEST.json", tfs), 0,
                  "step 10 was committed without its shards");

    /* full to the end: 6.5 MB free hold the final model (4 MB) once the failed
     * checkpoint's files are gone, not the checkpoint (11 MB) */
    avail = tu_free_kib(tfs);
    cr_assert_eq(tu_sh(NULL, "fallocate -l %ldk %s/filler", avail - 6500, tfs), 0);
    char *out = NULL;
    rc = run(prefix, "tfs/sfull2",
             "--set train.mode=full --set train.steps=12 --set checkpoint.every_steps=5", &out);
    cr_expect_eq(rc, 1, "exit %d: %s", rc, out);
    cr_expect(tu_contains(out, "training finished, but its last checkpoint was not written") &&
                  tu_contains(out, "checkpoint step 12 is not complete"),
              "%s", out);
    free(out);
}
