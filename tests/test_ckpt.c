/* The checkpoint directory protocol: a round trip of every field, atomic
 * commit, verification catching each kind of damage with a clear message,
 * listing, the fallback to an older checkpoint, and retention that removes
 * MANIFEST first. */
#define _POSIX_C_SOURCE 200809L
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "checkpoint/ckpt.h"
#include "checkpoint/ckpt_writer.h"
#include "test_util.h"

static char *dir;

static void setup(void)
{
    dir = tu_tempdir("ckpt");
}

static void teardown(void)
{
    tu_rmtree(dir);
    free(dir);
}

TestSuite(ckpt, .init = setup, .fini = teardown);

static void make_snapshot(ckpt_snapshot *s, int64_t step)
{
    ckpt_snapshot_init(s);
    s->step = step;
    s->world_size = 4;
    strcpy(s->config_hash, "0123456789abcdef");
    strcpy(s->base_model, "fedcba9876543210");
    cr_assert_eq(ckpt_set_int(s, "step", step), 0);
    cr_assert_eq(ckpt_set_int(s, "cursor", 123456789012LL), 0);
    cr_assert_eq(ckpt_set_real(s, "elapsed_s", 3.25), 0);
    cr_assert_eq(ckpt_set_str(s, "config", "run:\n  dir: x\n# ünïcode\n"), 0);
    int64_t shape2[2] = {3, 5}, shape1[1] = {7};
    float *a = ckpt_add_array(s, "params/base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", 2, shape2);
    float *b = ckpt_add_array(s, "adam_m/model.norm.weight", 1, shape1);
    cr_assert(a && b);
    for (int i = 0; i < 15; i++)
        a[i] = (float)i * 0.5f - 3.0f + (float)step;
    for (int i = 0; i < 7; i++)
        b[i] = -(float)i / 3.0f;
}

static char *write_step(int64_t step)
{
    ckpt_snapshot s;
    sp_err err = {0};
    char out[4096];
    make_snapshot(&s, step);
    cr_assert_eq(ckpt_write(dir, &s, out, sizeof out, &err), 0, "%s", err.msg);
    ckpt_snapshot_free(&s);
    return strdup(out);
}

Test(ckpt, round_trip_of_every_field)
{
    char *path = write_step(1200);
    cr_expect(tu_contains(path, "step-00001200"));
    ckpt_snapshot s, w;
    sp_err err = {0};
    cr_assert_eq(ckpt_read(path, &s, &err), 0, "%s", err.msg);
    make_snapshot(&w, 1200);
    cr_expect_eq(s.step, 1200);
    cr_expect_eq(s.world_size, 4);
    cr_expect_str_eq(s.config_hash, w.config_hash);
    cr_expect_str_eq(s.base_model, w.base_model);
    cr_expect_eq(ckpt_get(&s, "cursor")->i, 123456789012LL);
    cr_expect_eq(ckpt_get(&s, "elapsed_s")->d, 3.25);
    cr_expect_str_eq(ckpt_get(&s, "config")->s, w.attrs[3].s);
    cr_assert_eq(s.narrays, 2);
    for (int i = 0; i < w.narrays; i++) {
        const ckpt_array *a = ckpt_find_array(&s, w.arrays[i].name);
        cr_assert(a, "missing %s", w.arrays[i].name);
        cr_expect_eq(a->ndim, w.arrays[i].ndim);
        cr_expect_eq(a->shape[0], w.arrays[i].shape[0]);
        cr_expect_eq(memcmp(a->data, w.arrays[i].data, sizeof(float) * a->n), 0);
    }
    ckpt_snapshot_free(&s);
    ckpt_snapshot_free(&w);
    /* nothing is left of the temporary directory */
    cr_expect_eq(tu_sh(NULL, "ls -a %s | grep -q '^\\.tmp-'", dir), 1);
    free(path);
}

static void expect_bad(const char *path, const char *want)
{
    ckpt_manifest m;
    sp_err err = {0};
    int rc = ckpt_verify(path, &m, &err);
    cr_expect_eq(rc, SP_EXIT_INPUT, "rc %d", rc);
    cr_expect(tu_contains(err.msg, want), "'%s' lacks '%s'", err.msg, want);
    cr_expect(tu_contains(err.msg, "step-0000"), "'%s' does not name the checkpoint", err.msg);
}

Test(ckpt, truncated_file_is_detected)
{
    char *p = write_step(10);
    tu_sh(NULL, "truncate -s -100 %s/state.h5", p);
    expect_bad(p, "state.h5 has");
    expect_bad(p, "truncated");
    free(p);
}

Test(ckpt, flipped_byte_is_detected)
{
    char *p = write_step(11);
    tu_sh(NULL, "printf '\\377' | dd of=%s/state.h5 bs=1 seek=3000 conv=notrunc 2>/dev/null", p);
    expect_bad(p, "fails its SHA-256 checksum");
    free(p);
}

Test(ckpt, missing_manifest_is_incomplete)
{
    char *p = write_step(12);
    tu_sh(NULL, "rm %s/MANIFEST.json", p);
    expect_bad(p, "no MANIFEST.json");
    free(p);
}

Test(ckpt, manifest_naming_a_missing_file)
{
    char *p = write_step(13);
    tu_sh(NULL, "mv %s/state.h5 %s/elsewhere.h5", p, p);
    expect_bad(p, "names state.h5, which is missing");
    free(p);
}

Test(ckpt, manifest_not_json_or_from_the_future)
{
    char *p = write_step(14);
    char path[4200];
    snprintf(path, sizeof path, "%s/MANIFEST.json", p);
    tu_write_file(path, "{\"format_version\": 1, \"step\": ");
    expect_bad(p, "not valid JSON");
    tu_write_file(path, "{\"format_version\": 99, \"step\": 1, \"world_size\": 1, \"files\": {}}");
    expect_bad(p, "format version 99 is newer");
    free(p);
}

static int bad_reports;
static void count_bad(void *ctx, const ckpt_info *bad)
{
    (void)ctx;
    bad_reports++;
    cr_expect(bad->problem[0], "a reason is given");
}

Test(ckpt, newest_damaged_falls_back_to_the_previous)
{
    free(write_step(20));
    free(write_step(30));
    char *p = write_step(40);
    tu_sh(NULL, "printf 'X' | dd of=%s/state.h5 bs=1 seek=100 conv=notrunc 2>/dev/null", p);
    /* a writer that died before its rename leaves a .tmp- directory */
    tu_sh(NULL, "mkdir -p %s/.tmp-step-00000050-999999 && echo partial > "
                "%s/.tmp-step-00000050-999999/state.h5",
          dir, dir);
    char found_path[4096];
    int found = 0;
    sp_err err = {0};
    bad_reports = 0;
    cr_assert_eq(ckpt_find_latest(dir, found_path, sizeof found_path, &found, count_bad, NULL, &err), 0);
    cr_expect(found);
    cr_expect(tu_contains(found_path, "step-00000030"), "%s", found_path);
    cr_expect_eq(bad_reports, 1, "the damaged step 40 is reported (the .tmp one is not)");
    ckpt_info *l;
    int n;
    cr_assert_eq(ckpt_list(dir, 1, &l, &n, &err), 0);
    cr_assert_eq(n, 4);
    cr_expect_eq(l[0].step, 50);
    cr_expect(!l[0].ok && tu_contains(l[0].problem, "incomplete"));
    cr_expect(!l[1].ok && l[2].ok && l[3].ok);
    free(l);
    free(p);
}

static int deleted;
static void count_deleted(void *ctx, const char *name)
{
    (void)ctx;
    (void)name;
    deleted++;
}

Test(ckpt, retention_keeps_newest_and_multiples)
{
    for (int s = 10; s <= 70; s += 10)
        free(write_step(s));
    tu_sh(NULL, "mkdir -p %s/.tmp-step-00000080-999999", dir);
    sp_err err = {0};
    deleted = 0;
    cr_assert_eq(ckpt_prune(dir, 2, 40, count_deleted, NULL, &err), 0);
    ckpt_info *l;
    int n;
    cr_assert_eq(ckpt_list(dir, 1, &l, &n, &err), 0);
    cr_assert_eq(n, 3, "70, 60 newest; 40 a multiple of 40; the dead .tmp removed");
    cr_expect_eq(l[0].step, 70);
    cr_expect_eq(l[1].step, 60);
    cr_expect_eq(l[2].step, 40);
    cr_expect_eq(deleted, 4);
    free(l);
}

Test(ckpt, rewriting_a_step_replaces_it)
{
    free(write_step(5));
    char *p = write_step(5);
    ckpt_manifest m;
    sp_err err = {0};
    cr_expect_eq(ckpt_verify(p, &m, &err), 0, "%s", err.msg);
    free(p);
}

static int written_ok;
static void on_written(void *ctx, const char *d, const ckpt_snapshot *s, double t, const sp_err *e)
{
    (void)ctx, (void)t, (void)e;
    if (d && s->step > 0)
        written_ok++;
}

Test(ckpt, background_writer_commits_each_snapshot)
{
    ckpt_writer *w;
    sp_err err = {0};
    cr_assert_eq(ckpt_writer_start(&w, dir, on_written, NULL, &err), 0);
    written_ok = 0;
    for (int s = 1; s <= 3; s++) {
        ckpt_snapshot snap;
        double waited;
        make_snapshot(&snap, s);
        cr_assert_eq(ckpt_writer_submit(w, &snap, &waited, &err), 0);
        cr_expect_eq(snap.narrays, 0, "the snapshot moved to the writer");
    }
    cr_expect_eq(ckpt_writer_wait(w, &err), 0);
    ckpt_writer_stop(w);
    cr_expect_eq(written_ok, 3);
    char p[4096];
    snprintf(p, sizeof p, "%s/step-00000003", dir);
    ckpt_manifest m;
    cr_expect_eq(ckpt_verify(p, &m, &err), 0, "%s", err.msg);
}
