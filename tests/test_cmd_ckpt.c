/* The `ckpt` and `export` commands on local paths, through the spotune
 * binary: `ckpt list` shows every checkpoint with its step, time, size and
 * status (a damaged one and an interrupted write with the reason); `ckpt
 * verify` accepts a good checkpoint and refuses a damaged or missing one
 * naming it; `export --peft` of the final checkpoint is the run's own
 * adapter byte for byte; `export --merged` is W + (alpha / r) B A in the base
 * model's dtype; a full fine-tune exports a model but no adapter; and a
 * resumed run reports an incomplete newer checkpoint, removes the leftover
 * of an interrupted write and takes the previous complete one; a sharded
 * checkpoint verifies, pulls and exports. What a checkpoint's contents must
 * hold (damage under a matching MANIFEST) is in test_ckpt_contents.c. */
#define _POSIX_C_SOURCE 200809L
#define _DEFAULT_SOURCE /* timegm */
#include <criterion/criterion.h>
#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "checkpoint/ckpt.h"
#include "cmd_ckpt_util.h"
#include "test_util.h"

TestSuite(cmd_ckpt, .init = cmd_ckpt_setup, .fini = cmd_ckpt_teardown, .timeout = 600);

/* changes one byte of a file (at offset), as silent corruption does */
static void flip_byte(const char *path, long offset)
{
    FILE *f = fopen(path, "r+b");
    cr_assert(f, "cannot open %s", path);
    cr_assert_eq(fseek(f, offset, SEEK_SET), 0);
    int c = fgetc(f);
    cr_assert_neq(c, EOF, "%s is shorter than %ld bytes", path, offset + 1);
    cr_assert_eq(fseek(f, offset, SEEK_SET), 0);
    cr_assert_neq(fputc(c ^ 0xff, f), EOF);
    cr_assert_eq(fclose(f), 0);
}

/* ---- ckpt list ----------------------------------------------------------------- */

/* the sum of the sizes of the regular files under path */
static double real_bytes(const char *path)
{
    char *out = NULL;
    cr_assert_eq(tu_sh(&out, "find %s -type f -printf '%%s\\n' | awk '{s += $1} END {print s + 0}'",
                       path),
                 0);
    double b = strtod(out, NULL);
    free(out);
    return b;
}

typedef struct row {
    char name[128];
    long long step;
    double time; /* -1: "-" */
    double mib;
    char status[1024];
} row;

/* Parses `ckpt list` output: a header, then NAME STEP (DATE TIME | -) SIZE MiB STATUS. */
static int parse_list(const char *text, row *rows, int max)
{
    const char *line = strchr(text, '\n');
    cr_assert(line && tu_contains(text, "checkpoint") && tu_contains(text, "step") &&
                  tu_contains(text, "time") && tu_contains(text, "size") &&
                  tu_contains(text, "status"),
              "no header: %s", text);
    int n = 0;
    for (line++; *line && n < max;) {
        const char *eol = strchr(line, '\n');
        size_t len = eol ? (size_t)(eol - line) : strlen(line);
        char buf[2048];
        snprintf(buf, sizeof buf, "%.*s", (int)len, line);
        line += len + (eol ? 1 : 0);
        row *r = &rows[n];
        char date[32], clock[32];
        int used = 0;
        cr_assert_eq(sscanf(buf, "%127s %lld %31s%n", r->name, &r->step, date, &used), 3,
                     "line '%s'", buf);
        const char *p = buf + used;
        r->time = -1;
        if (strcmp(date, "-") != 0) {
            int u2 = 0;
            cr_assert_eq(sscanf(p, " %31s%n", clock, &u2), 1, "line '%s'", buf);
            p += u2;
            struct tm tm;
            memset(&tm, 0, sizeof tm);
            char z = 0;
            cr_assert(sscanf(date, "%d-%d-%d", &tm.tm_year, &tm.tm_mon, &tm.tm_mday) == 3 &&
                          sscanf(clock, "%d:%d:%d%c", &tm.tm_hour, &tm.tm_min, &tm.tm_sec,
                                 &z) == 4 &&
                          z == 'Z',
                      "time '%s %s' in '%s'", date, clock, buf);
            tm.tm_year -= 1900;
            tm.tm_mon -= 1;
            r->time = (double)timegm(&tm);
        }
        int u3 = 0;
        cr_assert_eq(sscanf(p, " %lf MiB %n", &r->mib, &u3), 1, "size in '%s'", buf);
        snprintf(r->status, sizeof r->status, "%s", p + u3);
        n++;
    }
    return n;
}

static double manifest_created(const char *ckpt)
{
    char *path = sp_strf("%s/MANIFEST.json", ckpt);
    json_error_t je;
    json_t *j = json_load_file(path, 0, &je);
    cr_assert(j, "%s: %s", path, je.text);
    double t = json_number_value(json_object_get(j, "created"));
    json_decref(j);
    free(path);
    return t;
}

/* One listing against the directory: every row's step (from its name),
 * size (to the 0.1 MiB printed), and time (the second of MANIFEST's
 * `created`, within the run's wall time) for complete ones. */
static int check_listing(const char *text, const char *root, row *rows, int max, double t0)
{
    int n = parse_list(text, rows, max);
    double now = (double)time(NULL);
    for (int i = 0; i < n; i++) {
        row *r = &rows[i];
        const char *num = sp_after(r->name, ".tmp-step-");
        num = num ? num : sp_after(r->name, "step-");
        cr_assert(num, "%s is not a checkpoint's name", r->name);
        cr_expect_eq(r->step, strtoll(num, NULL, 10), "%s listed as step %lld", r->name, r->step);
        if (i > 0)
            cr_expect_geq(rows[i - 1].step, r->step, "not newest first: %s", text);
        char path[4200];
        snprintf(path, sizeof path, "%s/%s", root, r->name);
        double real = real_bytes(path) / 1048576.0;
        cr_expect_leq(fabs(r->mib - real), 0.05 + 1e-9, "%s: listed %.1f MiB, holds %.4f MiB",
                      r->name, r->mib, real);
        if (strcmp(r->status, "ok") == 0) {
            double c = manifest_created(path);
            cr_expect_eq(r->time, floor(c), "%s: listed %.0f, MANIFEST says %.3f", r->name,
                         r->time, c);
            cr_expect(r->time >= floor(t0) - 1 && r->time <= now + 1,
                      "%s: time %.0f outside the run (%.0f .. %.0f)", r->name, r->time, t0, now);
        }
    }
    return n;
}

Test(cmd_ckpt, list_shows_step_time_size_and_status)
{
    double t0 = (double)time(NULL);
    train("run", NULL);
    /* a full fine-tune's checkpoints weigh ~11 MiB: the size column means something */
    train("full", "--set train.mode=full --set train.steps=8");
    char *out = NULL, *out2 = NULL;
    row rows[8];

    int rc = tu_spotune(&out, "ckpt list %s", at("full"));
    cr_assert_eq(rc, 0, "%s", out);
    int n = check_listing(out, at("full/checkpoints"), rows, 8, t0);
    cr_assert_eq(n, 2, "%s", out);
    cr_expect(rows[0].step == 8 && rows[1].step == 4, "%s", out);
    cr_expect(rows[0].mib > 10.0 && rows[0].mib < 12.0, "%s", out);
    for (int i = 0; i < n; i++)
        cr_expect_str_eq(rows[i].status, "ok", "%s", out);
    free(out);

    /* damage step 8 and leave the .tmp- directory of a write killed by -9 */
    flip_byte(at("run/checkpoints/step-00000008/state.h5"), 3000);
    char tmp[128];
    snprintf(tmp, sizeof tmp, ".tmp-step-00000016-%d", tu_dead_pid());
    cr_assert_eq(tu_sh(NULL, "mkdir %s && head -c 5000 %s > %s/state.h5", at("run/checkpoints/%s", tmp),
                       at("run/checkpoints/step-00000012/state.h5"),
                       at("run/checkpoints/%s", tmp)),
                 0);
    rc = tu_spotune(&out, "ckpt list %s", at("run"));
    cr_assert_eq(rc, 0, "%s", out);
    n = check_listing(out, at("run/checkpoints"), rows, 8, t0);
    cr_assert_eq(n, 4, "%s", out);
    cr_expect_str_eq(rows[0].name, tmp);
    cr_expect(tu_contains(rows[0].status, "incomplete") &&
                  tu_contains(rows[0].status, "its write never finished"),
              "%s", out);
    cr_expect_eq(rows[0].time, -1, "an incomplete write has no time: %s", out);
    cr_expect(rows[1].step == 12 && rows[2].step == 8 && rows[3].step == 4, "%s", out);
    cr_expect_str_eq(rows[1].status, "ok");
    cr_expect_str_eq(rows[3].status, "ok");
    cr_expect(tu_contains(rows[2].status, "step-00000008") &&
                  tu_contains(rows[2].status, "state.h5 fails its SHA-256 checksum"),
              "the damaged one is listed with the reason: %s", out);
    cr_expect(exists(at("run/checkpoints/%s", tmp)), "listing must not remove anything");

    /* the checkpoints directory itself is accepted, with the same listing */
    rc = tu_spotune(&out2, "ckpt list %s", at("run/checkpoints"));
    cr_expect_eq(rc, 0, "%s", out2);
    cr_expect_str_eq(out2, out);
    free(out);
    free(out2);

    rc = tu_spotune(&out, "ckpt list %s", at("nowhere"));
    cr_expect_eq(rc, 3, "%s", out);
    cr_expect(tu_contains(out, at("nowhere")) && tu_contains(out, "no such run"), "%s", out);
    free(out);
}

/* ---- ckpt verify ------------------------------------------------------------------- */

Test(cmd_ckpt, verify_good_damaged_and_missing)
{
    train("run", NULL);
    char *out = NULL;
    char good[4200], bad[4200], none[4200];
    snprintf(good, sizeof good, "%s", at("run/checkpoints/step-00000012"));
    int rc = tu_spotune(&out, "ckpt verify %s", good);
    cr_expect_eq(rc, 0, "%s", out);
    char *want = sp_strf("%s: ok (step 12, 2 file(s) verified", good);
    cr_expect(tu_contains(out, want), "'%s' lacks '%s'", out, want);
    free(want);
    free(out);

    snprintf(bad, sizeof bad, "%s", at("run/checkpoints/step-00000008"));
    flip_byte(at("run/checkpoints/step-00000008/state.h5"), 2500);
    rc = tu_spotune(&out, "ckpt verify %s", bad);
    cr_expect_eq(rc, 3, "%s", out);
    cr_expect(tu_contains(out, bad) && tu_contains(out, "state.h5 fails its SHA-256 checksum"),
              "%s", out);
    cr_expect(!tu_contains(out, ": ok"), "%s", out);
    free(out);
    /* export refuses it the same way, and writes nothing */
    rc = tu_spotune(&out, "export %s --peft %s", bad, at("out-bad"));
    cr_expect_eq(rc, 3, "%s", out);
    cr_expect(tu_contains(out, "state.h5 fails its SHA-256 checksum"), "%s", out);
    cr_expect(!exists(at("out-bad")), "export of a damaged checkpoint wrote %s", at("out-bad"));
    free(out);

    tu_sh(NULL, "rm %s/MANIFEST.json", at("run/checkpoints/step-00000004"));
    rc = tu_spotune(&out, "ckpt verify %s", at("run/checkpoints/step-00000004"));
    cr_expect_eq(rc, 3, "%s", out);
    cr_expect(tu_contains(out, "step-00000004: no MANIFEST.json"), "%s", out);
    free(out);

    snprintf(none, sizeof none, "%s", at("run/checkpoints/step-00000099"));
    rc = tu_spotune(&out, "ckpt verify %s", none);
    cr_expect_eq(rc, 3, "%s", out);
    cr_expect(tu_contains(out, none) && tu_contains(out, "no such checkpoint directory"), "%s",
              out);
    free(out);

    rc = tu_spotune(&out, "ckpt verify");
    cr_expect_eq(rc, 2, "a missing argument is a usage error: %s", out);
    free(out);
}

/* ---- export --peft ------------------------------------------------------------------ */

Test(cmd_ckpt, export_peft_of_the_final_checkpoint_is_the_runs_adapter)
{
    train("run", NULL);
    char *out = NULL;
    int rc = tu_spotune(&out, "export %s --peft %s", at("run/checkpoints/step-00000012"),
                        at("peft12"));
    cr_assert_eq(rc, 0, "%s", out);
    free(out);
    cr_expect_eq(tu_sh(&out, "cmp %s %s", at("peft12/adapter_model.safetensors"),
                       at("run/adapter/adapter_model.safetensors")),
                 0, "%s", out);
    free(out);
    cr_expect(exists(at("peft12/adapter_config.json")));
    cr_expect_eq(tu_sh(&out, "cmp %s %s", at("peft12/adapter_config.json"),
                       at("run/adapter/adapter_config.json")),
                 0, "%s", out);
    free(out);
    /* 4 layers x 3 projections x (A, B), float32 */
    st_file f;
    sp_err err = {0};
    cr_assert_eq(st_open(&f, at("peft12/adapter_model.safetensors"), &err), 0, "%s", err.msg);
    cr_expect_eq(f.n, 24);
    for (size_t i = 0; i < f.n; i++)
        cr_expect_eq(f.tensors[i].dt, DT_F32, "%s", f.tensors[i].name);
    st_close(&f);
    /* an earlier checkpoint exports its own (other) weights */
    rc = tu_spotune(&out, "export %s --peft %s", at("run/checkpoints/step-00000004"), at("peft4"));
    cr_assert_eq(rc, 0, "%s", out);
    free(out);
    cr_expect_neq(tu_sh(NULL, "cmp -s %s %s", at("peft4/adapter_model.safetensors"),
                        at("peft12/adapter_model.safetensors")),
                  0, "step 4 and step 12 exported the same adapter");
}

/* ---- export --merged ----------------------------------------------------------------- */

/* a tensor of an open file as float (copied: the data may be unaligned) */
static float *tensor_f32(const st_file *f, const char *name, const st_tensor **tp)
{
    const st_tensor *t = st_find(f, name);
    cr_assert(t, "%s lacks %s", f->path, name);
    float *v = malloc(sizeof(float) * (t->numel ? t->numel : 1));
    cr_assert(v);
    if (t->dt == DT_F32) {
        memcpy(v, t->data, sizeof(float) * t->numel);
    } else {
        size_t bytes = dtype_size(t->dt) * t->numel;
        void *raw = malloc(bytes ? bytes : 1);
        memcpy(raw, t->data, bytes);
        cr_assert_eq(dtype_convert(v, DT_F32, raw, t->dt, t->numel), 0);
        free(raw);
    }
    if (tp)
        *tp = t;
    return v;
}

/* alpha / r from adapter_config.json */
static double adapter_scale(const char *adapter_dir)
{
    char path[4200];
    snprintf(path, sizeof path, "%s/adapter_config.json", adapter_dir);
    json_error_t je;
    json_t *j = json_load_file(path, 0, &je);
    cr_assert(j, "%s: %s", path, je.text);
    json_t *r = json_object_get(j, "r"), *a = json_object_get(j, "lora_alpha");
    cr_assert(json_is_integer(r) && json_is_number(a), "%s lacks r or lora_alpha", path);
    cr_assert(!json_is_true(json_object_get(j, "use_rslora")));
    double s = json_number_value(a) / (double)json_integer_value(r);
    json_decref(j);
    return s;
}

static int targeted(const char *name)
{
    return tu_contains(name, ".q_proj.") || tu_contains(name, ".v_proj.") ||
           tu_contains(name, ".down_proj.");
}

/* Merges run `name`'s final checkpoint into base `model` and checks every
 * targeted projection of every layer against W + scale * B A (computed in
 * double) to rel_tol * |ref| + abs_tol, and every other tensor equal to the
 * base. Returns the largest |scale * B A| seen (the test is only as strong
 * as the adapter is far from zero). */
static double check_merged(const char *name, const char *model, dtype_t want_dt, double rel_tol,
                           double abs_tol)
{
    char *out = NULL;
    int rc = tu_spotune(&out, "export %s --merged %s --peft %s",
                        at("%s/checkpoints/step-00000012", name), at("%s-merged", name),
                        at("%s-peft", name));
    cr_assert_eq(rc, 0, "%s", out);
    free(out);
    double scale = adapter_scale(at("%s-peft", name));
    cr_assert_eq(scale, 2.0, "alpha 8 / r 4 in the config written");
    st_file mf, bf, af;
    sp_err err = {0};
    cr_assert_eq(st_open(&mf, at("%s-merged/model.safetensors", name), &err), 0, "%s", err.msg);
    cr_assert_eq(st_open(&bf, at("%s/model.safetensors", model), &err), 0, "%s", err.msg);
    cr_assert_eq(st_open(&af, at("%s-peft/adapter_model.safetensors", name), &err), 0, "%s",
                 err.msg);
    cr_expect_eq(mf.n, bf.n, "the merged model has %zu tensors, the base %zu", mf.n, bf.n);
    double max_delta = 0;
    int checked = 0;
    for (size_t i = 0; i < bf.n; i++) {
        const char *tn = bf.tensors[i].name;
        const st_tensor *mt, *bt;
        float *w = tensor_f32(&bf, tn, &bt), *m = tensor_f32(&mf, tn, &mt);
        cr_expect_eq(bt->dt, want_dt, "the base's %s", tn);
        cr_expect_eq(mt->dt, bt->dt, "%s: merged in another dtype than the base's", tn);
        cr_assert_eq(mt->numel, bt->numel, "%s", tn);
        cr_assert_eq(mt->ndim, bt->ndim, "%s", tn);
        if (!targeted(tn)) {
            for (size_t k = 0; k < bt->numel; k++)
                if (!(fabsf(m[k] - w[k]) <= 1e-6f)) {
                    cr_expect_fail("%s[%zu] (untargeted): %.9g, base %.9g", tn, k, m[k], w[k]);
                    break;
                }
            free(w);
            free(m);
            continue;
        }
        /* model.layers.I.X.P.weight -> base_model.model.model.layers.I.X.P.lora_{A,B}.weight */
        char stem[256], an[320], bn[320];
        snprintf(stem, sizeof stem, "%.*s", (int)(strlen(tn) - strlen(".weight")), tn);
        snprintf(an, sizeof an, "base_model.model.%s.lora_A.weight", stem);
        snprintf(bn, sizeof bn, "base_model.model.%s.lora_B.weight", stem);
        const st_tensor *at_, *bt_;
        float *A = tensor_f32(&af, an, &at_), *B = tensor_f32(&af, bn, &bt_);
        int64_t out_n = bt->shape[0], in_n = bt->shape[1], r = at_->shape[0];
        cr_assert(at_->shape[1] == in_n && bt_->shape[0] == out_n && bt_->shape[1] == r,
                  "%s: A [%lld, %lld], B [%lld, %lld], W [%lld, %lld]", tn,
                  (long long)at_->shape[0], (long long)at_->shape[1], (long long)bt_->shape[0],
                  (long long)bt_->shape[1], (long long)out_n, (long long)in_n);
        int bad = 0;
        for (int64_t o = 0; o < out_n && !bad; o++)
            for (int64_t c = 0; c < in_n && !bad; c++) {
                double d = 0;
                for (int64_t k = 0; k < r; k++)
                    d += (double)B[o * r + k] * (double)A[k * in_n + c];
                d *= scale;
                double ref = (double)w[o * in_n + c] + d, got = m[o * in_n + c];
                if (fabs(d) > max_delta)
                    max_delta = fabs(d);
                if (!(fabs(got - ref) <= rel_tol * fabs(ref) + abs_tol)) {
                    cr_expect_fail("%s[%lld, %lld]: merged %.9g, W + scale B A = %.9g "
                                   "(W %.9g, delta %.3g)",
                                   tn, (long long)o, (long long)c, got, ref, w[o * in_n + c], d);
                    bad = 1;
                }
            }
        checked++;
        free(A);
        free(B);
        free(w);
        free(m);
    }
    cr_expect_eq(checked, 12, "4 layers x q, v, down projections");
    st_close(&mf);
    st_close(&bf);
    st_close(&af);
    return max_delta;
}

/* f32 base (init-model's default): merged in f32, so exact up to float
 * rounding of the sum: 1e-5 relative + 1e-6 absolute. */
Test(cmd_ckpt, export_merged_is_base_plus_scaled_lora)
{
    train("run", NULL);
    double delta = check_merged("run", "model", DT_F32, 1e-5, 1e-6);
    cr_expect_gt(delta, 1e-3, "the adapter barely moved (max |scale B A| %.3g): the check is "
                              "too weak",
                 delta);
}

/* A bf16 base: the merged model is written in bf16, so each weight is W + s B A
 * rounded to bf16 (8 significant bits: half an ulp is 2^-9 relative; 2^-8
 * allows a tie or a double rounding either way). */
Test(cmd_ckpt, export_merged_of_a_bf16_base_keeps_bf16)
{
    char *out = NULL;
    int rc = tu_spotune(&out, "init-model --preset tiny --seed 5 --dtype bf16 %s", at("model16"));
    cr_assert_eq(rc, 0, "%s", out);
    free(out);
    char sets[4200];
    snprintf(sets, sizeof sets, "--set model.path=%s", at("model16"));
    train("run16", sets);
    double delta = check_merged("run16", "model16", DT_BF16, 1.0 / 256, 1e-6);
    cr_expect_gt(delta, 1e-3, "max |scale B A| %.3g", delta);
    /* config.json says so too */
    char *cfg = tu_read_file(at("run16-merged/config.json"), NULL);
    cr_expect(tu_contains(cfg, "\"bfloat16\""), "%s", cfg);
    free(cfg);
}

/* ---- full fine-tuning ------------------------------------------------------------------ */

Test(cmd_ckpt, full_mode_exports_a_model_and_no_adapter)
{
    train("full", "--set train.mode=full --set train.steps=8");
    char ck[4200];
    snprintf(ck, sizeof ck, "%s", at("full/checkpoints/step-00000008"));
    char *out = NULL;
    int rc = tu_spotune(&out, "export %s --peft %s", ck, at("full-peft"));
    cr_expect_eq(rc, 2, "%s", out);
    cr_expect(tu_contains(out, "full fine-tune") && tu_contains(out, "--merged"), "%s", out);
    cr_expect(!exists(at("full-peft/adapter_model.safetensors")), "an adapter was written");
    free(out);

    rc = tu_spotune(&out, "export %s --merged %s", ck, at("full-merged"));
    cr_assert_eq(rc, 0, "%s", out);
    free(out);
    cr_expect(exists(at("full-merged/config.json")));
    /* the same file as the run's own final model/ */
    cr_expect_eq(tu_sh(&out, "cmp %s %s", at("full-merged/model.safetensors"),
                       at("full/model/model.safetensors")),
                 0, "%s", out);
    free(out);
    /* every tensor is the checkpoint's fp32 master (f32 base); training moved them */
    ckpt_snapshot s;
    sp_err err = {0};
    cr_assert_eq(ckpt_read(ck, &s, &err), 0, "%s", err.msg);
    st_file mf, bf;
    cr_assert_eq(st_open(&mf, at("full-merged/model.safetensors"), &err), 0, "%s", err.msg);
    cr_assert_eq(st_open(&bf, at("model/model.safetensors"), &err), 0, "%s", err.msg);
    cr_expect_eq(mf.n, bf.n);
    int moved = 0;
    for (size_t i = 0; i < mf.n; i++) {
        const st_tensor *t;
        float *m = tensor_f32(&mf, mf.tensors[i].name, &t), *b = tensor_f32(&bf, t->name, NULL);
        char name[300];
        snprintf(name, sizeof name, "params/%s", t->name);
        const ckpt_array *a = ckpt_find_array(&s, name);
        cr_expect(a, "the checkpoint lacks %s", name);
        if (a) {
            cr_expect_eq(a->n, t->numel, "%s", name);
            cr_expect_eq(memcmp(a->data, m, sizeof(float) * t->numel), 0,
                         "%s differs from the checkpoint's master", t->name);
        }
        moved += memcmp(m, b, sizeof(float) * t->numel) != 0;
        free(m);
        free(b);
    }
    cr_expect_gt(moved, (int)mf.n / 2, "only %d of %zu tensors differ from the base", moved, mf.n);
    st_close(&mf);
    st_close(&bf);
    ckpt_snapshot_free(&s);
}

/* ---- resume past incomplete checkpoints ------------------------------------------------- */

/* The newest two are incomplete: a write killed by -9 (.tmp-) and a step
 * directory without MANIFEST.json. Resuming reports both by name, removes
 * the leftover, and continues from the newest complete one. train.steps
 * stays 8, so the resumed run commits no checkpoint and its retention
 * (which also removes dead writers' leftovers) does not run: the removal
 * seen is resume's. */
Test(cmd_ckpt, resume_reports_incomplete_newer_checkpoints)
{
    train("run", "--set train.steps=8");
    int pid = tu_dead_pid();
    char tmp[128];
    snprintf(tmp, sizeof tmp, ".tmp-step-00000012-%d", pid);
    cr_assert_eq(tu_sh(NULL, "cd %s && mkdir %s && head -c 3000 step-00000008/state.h5 > "
                             "%s/state.h5 && cp -r step-00000008 step-00000010 && "
                             "rm step-00000010/MANIFEST.json",
                       at("run/checkpoints"), tmp, tmp),
                 0);
    char *out = NULL;
    int rc = tu_spotune(&out, "train %s/run.yaml --set run.dir=%s --set train.steps=8", dir,
                        at("run"));
    cr_assert_eq(rc, 0, "%s", out);
    char want[512];
    snprintf(want, sizeof want,
             "skipping checkpoint %s: incomplete: its write never finished (the writing process "
             "%d is gone); removed",
             tmp, pid);
    cr_expect(tu_contains(out, want), "'%s' lacks '%s'", out, want);
    cr_expect(tu_contains(out, "skipping checkpoint step-00000010") &&
                  tu_contains(out, "step-00000010: no MANIFEST.json"),
              "%s", out);
    cr_expect(tu_contains(out, "resumed from") && tu_contains(out, "step-00000008: step 8"), "%s",
              out);
    cr_expect(!tu_contains(out, "committed"), "a checkpoint was committed: %s", out);
    free(out);
    cr_expect(!exists(at("run/checkpoints/%s", tmp)), "the leftover %s is still there", tmp);
    cr_expect(exists(at("run/checkpoints/step-00000010")),
              "a step directory is reported, not deleted");
    /* the warning is in the metrics too */
    char *metrics = tu_read_file(at("run/metrics.jsonl"), NULL);
    cr_expect(tu_contains(metrics, tmp), "metrics.jsonl does not mention %s", tmp);
    free(metrics);
}

/* A full fine-tune on 2 ranks writes sharded checkpoints (a shard file per
 * rank, MANIFEST with the layout), pushed to a file:// store: `ckpt verify`
 * says sharded; `ckpt pull` brings every shard and the copy verifies; and
 * `export --merged`, from the local checkpoint, the pulled copy and the
 * store's URL, gathers the weights from the shards into the same file as the
 * run's own final model/. */
Test(cmd_ckpt, sharded_checkpoint_verifies_pulls_and_exports)
{
    char *out = NULL;
    int rc = tu_sh(&out,
                   "%s %s/spotune train %s/run.yaml --set run.dir=%s/sh --set train.mode=full "
                   "--set train.steps=6 --set checkpoint.remote=file://%s/store",
                   tu_mpirun(2), tu_binary_dir(), dir, dir, dir);
    cr_assert_eq(rc, 0, "%s", out);
    free(out);
    char ck[4200];
    snprintf(ck, sizeof ck, "%s", at("sh/checkpoints/step-00000006"));
    cr_expect(exists(tu_fmt("%s/shard-00000-of-00002.h5", ck)) &&
              exists(tu_fmt("%s/shard-00001-of-00002.h5", ck)), "%s lacks its shards", ck);
    rc = tu_spotune(&out, "ckpt verify %s", ck);
    cr_expect_eq(rc, 0, "%s", out);
    cr_expect(tu_contains(out, "ok (step 6, 4 file(s) verified") && tu_contains(out, "sharded"),
              "%s", out);
    free(out);
    rc = tu_spotune(&out, "ckpt pull file://%s/store/step-00000006 %s", dir, at("pulled"));
    cr_assert_eq(rc, 0, "%s", out);
    free(out);
    cr_expect(exists(at("pulled/shard-00001-of-00002.h5")), "the pull lacks a shard");
    char url[4200];
    snprintf(url, sizeof url, "file://%s/store/step-00000006", dir);
    const char *from[3] = {ck, at("pulled"), url};
    for (int i = 0; i < 3; i++) {
        char src[4200], dst[4200];
        snprintf(src, sizeof src, "%s", from[i]);
        snprintf(dst, sizeof dst, "%s", at("sh-merged-%d", i));
        rc = tu_spotune(&out, "export %s --merged %s", src, dst);
        cr_assert_eq(rc, 0, "%s", out);
        free(out);
        cr_expect_eq(tu_sh(&out, "cmp %s/model.safetensors %s", dst,
                           at("sh/model/model.safetensors")),
                     0, "export of %s: %s", src, out);
        free(out);
    }
}
