/* tests/remote_util.c — shared by test_remote.c and test_remote_ranks.c: a
 * bucket prefix and a tiny LoRA run per test in the local S3 server, the
 * spotune command of a run, and waiting on a run in the background. */
#define _POSIX_C_SOURCE 200809L
#include <criterion/criterion.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "checkpoint/ckpt.h"
#include "checkpoint/store.h"
#include "remote_util.h"
#include "test_util.h"

char *dir;
char url[512];

void remote_setup(void)
{
    dir = tu_tiny_dir("remote", 9, 4);
    /* a bucket per test run; the prefix is unique to this test */
    snprintf(url, sizeof url, "s3://spotune-remote-test/run-%d-%ld", (int)getpid(),
             (long)(sp_wall_time() * 1000) % 100000000);
    store_opts o = {0};
    o.endpoint = tu_s3_endpoint();
    o.addressing = STORE_ADDR_PATH;
    store_t *st;
    sp_err err = {0};
    cr_assert_eq(store_open(&st, url, &o, &err), 0, "%s", err.msg);
    cr_assert_eq(store_create_bucket(st, &err), 0, "%s", err.msg);
    store_close(st);
    tu_run_yaml(dir,
                "run:\n  seed: 8\n"
                "train:\n  mode: lora\n  steps: 40\n  seq_len: 32\n  micro_batch: 4\n"
                "  lr: 3e-3\n"
                "lora:\n  r: 4\n  alpha: 8\n  targets: [q_proj, v_proj]\n"
                "log:\n  every: 1\nruntime:\n  backend: cpu\n  threads: 1\n"
                "checkpoint:\n  every_minutes: 0\n  every_steps: 5\n  keep: 2\n"
                "  remote: %s\n  endpoint: %s\n  region: us-east-1\n  addressing: path\n"
                "  upload_deadline_s: 60\n",
                url, tu_s3_endpoint());
}

void remote_teardown(void)
{
    tu_proxy_thaw(); /* whatever a test did, the proxy runs on */
    tu_rmtree(dir);
    free(dir);
}


const char *cmd(const char *name, const char *extra)
{
    return tu_fmt("%s/spotune train %s/run.yaml --set run.dir=%s/%s %s", tu_binary_dir(), dir,
                  dir, name, extra ? extra : "");
}

int run(const char *name, const char *extra, char **out)
{
    return tu_sh(out, "%s", cmd(name, extra));
}

store_t *open_store(void)
{
    store_opts o = {0};
    o.endpoint = tu_s3_endpoint();
    o.addressing = STORE_ADDR_PATH;
    store_t *st = NULL;
    sp_err err = {0};
    cr_assert_eq(store_open(&st, url, &o, &err), 0, "%s", err.msg);
    return st;
}

/* 1 when the bucket holds key (under this test's prefix) */
int remote_has(const char *key)
{
    store_t *st = open_store();
    int exists = 0;
    sp_err err = {0};
    cr_assert_eq(store_exists(st, key, &exists, NULL, &err), 0, "%s", err.msg);
    store_close(st);
    return exists;
}

/* ---- a run in the background --------------------------------------------------- */

/* The process exists and has not exited (a zombie is not running; it is left
 * for tu_wait to reap). */
int running(int pid)
{
    char path[64], buf[512] = "";
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    FILE *f = fopen(path, "r");
    size_t n = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
    if (f)
        fclose(f);
    buf[n] = 0;
    char *rp = strrchr(buf, ')');
    return rp && rp[1] == ' ' && rp[2] != 'Z' && rp[2] != 'X';
}

/* The step of the last train record in DIR/name/metrics.jsonl (0: none). */
int last_step(const char *name)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s/metrics.jsonl", dir, name);
    char *m = tu_read_file(path, NULL);
    int step = 0;
    for (char *p = m ? strstr(m, "\"event\":\"train\",\"step\":") : NULL; p;
         p = strstr(p + 1, "\"event\":\"train\",\"step\":"))
        step = atoi(p + strlen("\"event\":\"train\",\"step\":"));
    free(m);
    return step;
}

/* Waits (polling, up to limit_s) until the run's metrics reach `step` or
 * the process ends; returns 1 if the step was reached. */
int wait_step(const char *name, int step, int pid, double limit_s)
{
    double t0 = sp_now();
    while (last_step(name) < step) {
        if (!running(pid) || sp_now() - t0 > limit_s)
            return last_step(name) >= step;
        tu_sleep(0.01);
    }
    return 1;
}

/* Waits (polling, up to limit_s) until the log file holds `needle` or the
 * process ends; returns 1 if it does. */
int wait_log(const char *log, const char *needle, int pid, double limit_s)
{
    double t0 = sp_now();
    for (;;) {
        char *t = tu_read_file(log, NULL);
        int found = tu_contains(t, needle);
        free(t);
        if (found)
            return 1;
        if (!running(pid) || sp_now() - t0 > limit_s) {
            t = tu_read_file(log, NULL);
            found = tu_contains(t, needle);
            free(t);
            return found;
        }
        tu_sleep(0.02);
    }
}
