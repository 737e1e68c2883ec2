/* The fixture of the checkpoint command suites (cmd_ckpt_util.h). */
#define _POSIX_C_SOURCE 200809L
#include "cmd_ckpt_util.h"

#include <criterion/criterion.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>

#include "test_util.h"

char *dir;

void cmd_ckpt_setup(void)
{
    dir = tu_tiny_dir("cmdckpt", 3, 5);
    /* LoRA r=4, alpha=8 (scale 2) on three projections; a checkpoint every
     * 4 steps, so 12 steps leave step-4, -8 and -12 */
    tu_run_yaml(dir, "run:\n  seed: 21\n"
                     "train:\n  mode: lora\n  steps: 12\n  seq_len: 32\n  micro_batch: 2\n"
                     "  grad_accum: 1\n  lr: 1e-2\n  warmup_steps: 2\n"
                     "lora:\n  r: 4\n  alpha: 8\n  targets: [q_proj, v_proj, down_proj]\n"
                     "log:\n  every: 1\nruntime:\n  backend: cpu\n  threads: 1\n"
                     "checkpoint:\n  every_minutes: 0\n  every_steps: 4\n  keep: 10\n");
}

void cmd_ckpt_teardown(void)
{
    tu_rmtree(dir);
    free(dir);
}

void train(const char *name, const char *extra)
{
    char *out = NULL;
    int rc = tu_spotune(&out, "train %s/run.yaml --set run.dir=%s/%s %s", dir, dir, name,
                        extra ? extra : "");
    cr_assert_eq(rc, 0, "training %s failed (%d): %s", name, rc, out);
    free(out);
}

const char *at(const char *fmt, ...)
{
    static char buf[6][4096];
    static int next;
    char rel[2048], *b = buf[next++ % 6];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(rel, sizeof rel, fmt, ap);
    va_end(ap);
    snprintf(b, 4096, "%s/%s", dir, rel);
    return b;
}

int exists(const char *path)
{
    struct stat sb;
    return stat(path, &sb) == 0;
}
