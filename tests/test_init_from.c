/* lora.init_from: a fresh run starts its LoRA weights from a PEFT adapter
 * directory. The loaded weights are the exported ones bit for bit, on every
 * rank; the first loss of a run started from run A's export is A's own
 * evaluation of that adapter; training on from it beats a fresh start; an
 * adapter written by PEFT itself gives PEFT's loss; BF16 and F16 adapters
 * load as their values; a resume takes the checkpoint whatever init_from
 * says; and every bad adapter or mismatch with the run's config is refused
 * by name with the documented exit code. */
#define _POSIX_C_SOURCE 200809L
#include <criterion/criterion.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"
#include "trainer/adapter.h"
#include "trainer/data.h"
#include "trainer/model_io.h"

static char *dir;

/* The tiny model and the demo text in a fresh directory; run.yaml: LoRA r=4,
 * alpha=8 on three projections, one thread (bitwise reproducible), a constant
 * learning rate (train.steps changes nothing but where a run ends). */
static void setup(void)
{
    dir = tu_tiny_dir("initfrom", 3, 5);
    tu_run_yaml(dir, "run:\n  seed: 21\n"
                     "train:\n  mode: lora\n  steps: 6\n  seq_len: 32\n  micro_batch: 2\n"
                     "  lr: 1e-2\n  warmup_steps: 1\n  schedule: constant\n"
                     "lora:\n  r: 4\n  alpha: 8\n  targets: [q_proj, v_proj, down_proj]\n"
                     "log:\n  every: 1\nruntime:\n  backend: cpu\n  threads: 1\n"
                     "checkpoint:\n  every_minutes: 0\n");
}

static void teardown(void)
{
    tu_rmtree(dir);
    free(dir);
}

TestSuite(init_from, .init = setup, .fini = teardown, .timeout = 600);

/* spotune train DIR/run.yaml into DIR/name with more --set options; returns
 * the exit status, *out the output (may be NULL) */
static int train(char **out, const char *name, const char *sets)
{
    return tu_spotune(out, "train %s/run.yaml --set run.dir=%s/%s %s", dir, dir, name, sets);
}

static void train_ok(const char *name, const char *sets)
{
    char *out = NULL;
    int rc = train(&out, name, sets);
    cr_assert_eq(rc, 0, "training %s failed (%d): %s", name, rc, out);
    free(out);
}

/* The values of "key" in the records of event `event` of DIR/run/metrics.jsonl. */
static int metric(const char *run, const char *event, const char *key, double *v, int max)
{
    char *text = tu_read_file(tu_fmt("%s/%s/metrics.jsonl", dir, run), NULL);
    cr_assert(text, "no metrics in %s/%s", dir, run);
    int n = 0;
    char *save = NULL;
    for (char *line = strtok_r(text, "\n", &save); line && n < max;
         line = strtok_r(NULL, "\n", &save)) {
        json_t *o = json_loads(line, 0, NULL);
        const char *ev = json_string_value(json_object_get(o, "event"));
        json_t *x = json_object_get(o, key);
        if (ev && strcmp(ev, event) == 0 && json_is_number(x))
            v[n++] = json_number_value(x);
        json_decref(o);
    }
    free(text);
    return n;
}

/* A dataset of one window (seq_len T: T + 1 tokens) at path: tokens and mask
 * as given. */
static void one_window(const char *path, const uint32_t *tokens, const uint8_t *mask, uint64_t n,
                       int64_t vocab)
{
    uint64_t off[2] = {0, n};
    sp_err err = {0};
    cr_assert_eq(dataset_write(path, tokens, mask, n, off, 1, vocab, 0, "test", &err), 0, "%s",
                 err.msg);
}

/* The export of run A (6 steps) as a PEFT adapter in DIR/peft_a; A's data.val
 * is one window of the demo's own bytes (DIR/one.h5), so A's last val_loss
 * is A's adapter evaluated on that window. */
static void run_a_and_export(void)
{
    uint32_t tok[33];
    uint8_t msk[33];
    const char *text = "the quick brown fox jumps over the lazy dog";
    for (int i = 0; i < 33; i++) {
        tok[i] = (uint8_t)text[i];
        msk[i] = i > 0;
    }
    one_window(tu_fmt("%s/one.h5", dir), tok, msk, 33, 260);
    train_ok("a", tu_fmt("--set data.val=%s/one.h5", dir));
    char *out = NULL;
    int rc = tu_spotune(&out, "export %s/a/checkpoints/step-00000006 --peft %s/peft_a", dir, dir);
    cr_assert_eq(rc, 0, "export failed (%d): %s", rc, out);
    free(out);
}

/* (a) The loader puts the exported tensors into the model bit for bit (F32
 * masters compared with memcmp); end to end, a run started from the export on
 * 2 ranks, each training on the same single window, has as its first loss
 * exactly A's final evaluation of that window: rank 1 loaded the same weights
 * as rank 0 (the loss is the sum over both ranks). */
Test(init_from, loads_the_export_bit_for_bit_on_every_rank)
{
    run_a_and_export();
    sp_err err = {0};
    model_config_t mc;
    backend_t *be;
    model_t *m;
    char id[17];
    const char *model = tu_fmt("%s/model", dir);
    model_opts o = {.mode = MODE_LORA, .lora_r = 4, .lora_alpha = 8,
                    .lora_targets = TARGET_Q | TARGET_V | TARGET_DOWN, .max_batch = 1,
                    .seq_len = 2, .seed = 99};
    cr_assert_eq(model_config_load(&mc, model, &err), 0, "%s", err.msg);
    cr_assert_eq(model_io_identity(model, id, &err), 0, "%s", err.msg);
    cr_assert_eq(backend_create(&be, "cpu", 0, 1, &err), 0, "%s", err.msg);
    cr_assert_eq(model_create(&m, be, &mc, &o, &err), 0, "%s", err.msg);
    model_init_lora(m, 99);
    char note[512];
    cr_assert_eq(adapter_init_from(m, tu_fmt("%s/peft_a", dir), id, note, sizeof note, &err), 0,
                 "%s", err.msg);
    cr_expect(tu_contains(note, id), "the note does not name the identity: %s", note);
    const char *file = tu_fmt("%s/peft_a/adapter_model.safetensors", dir);
    int compared = 0;
    for (int i = 0; i < m->nparams; i++) {
        param_t *p = &m->params[i];
        if (p->kind != PK_LORA_A && p->kind != PK_LORA_B)
            continue;
        size_t n = 0;
        float *want = tu_load_f32(file, p->name, &n), *got = malloc(sizeof(float) * p->n);
        cr_assert(want && got && n == p->n, "%s", p->name);
        model_param_download(m, p, got);
        cr_expect_eq(memcmp(got, want, n * sizeof(float)), 0, "%s differs", p->name);
        free(want);
        free(got);
        compared++;
    }
    cr_expect_eq(compared, 2 * 3 * (int)mc.layers, "%d LoRA tensors", compared);
    model_destroy(m);
    backend_destroy(be);

    char *out = NULL;
    int rc = tu_sh(&out,
                   "%s %s/spotune train %s/run.yaml --set run.dir=%s/b --set train.steps=1 "
                   "--set train.micro_batch=1 --set data.train=%s/one.h5 "
                   "--set data.val=%s/one.h5 --set lora.init_from=%s/peft_a",
                   tu_mpirun(2), tu_binary_dir(), dir, dir, dir, dir, dir);
    cr_assert_eq(rc, 0, "run b failed (%d): %s", rc, out);
    cr_expect(tu_contains(out, "LoRA weights initialised from") && tu_contains(out, id),
              "no init line naming the identity: %s", out);
    free(out);
    /* a: step 0 (its random start) and step 6 (its adapter); b: step 0 (the
     * adapter loaded) and step 1 */
    double val[8], bval[8], loss[8];
    cr_assert_eq(metric("a", "val", "val_loss", val, 8), 2);
    cr_assert_eq(metric("b", "val", "val_loss", bval, 8), 2);
    cr_assert_eq(metric("b", "train", "loss", loss, 8), 1);
    /* the same fp32 forward of the same weights on the same window (batch 1
     * every time): equal to the last bit */
    cr_expect_eq(bval[0], val[1], "b's evaluation at step 0 %.17g, a's at step 6 %.17g", bval[0],
                 val[1]);
    cr_expect_eq(loss[0], val[1], "b's first loss %.17g, a's evaluation %.17g", loss[0], val[1]);
    cr_expect_neq(val[0], val[1], "a did not train");
}

/* (b) Training on: from A's export, 4 steps on the demo text end lower than
 * the same 4 steps from the random initialisation, at every step. */
Test(init_from, training_on_beats_a_fresh_start)
{
    run_a_and_export();
    train_ok("fresh", "--set train.steps=4");
    train_ok("on", tu_fmt("--set train.steps=4 --set lora.init_from=%s/peft_a", dir));
    double f[8], c[8];
    cr_assert_eq(metric("fresh", "train", "loss", f, 8), 4);
    cr_assert_eq(metric("on", "train", "loss", c, 8), 4);
    for (int i = 0; i < 4; i++)
        cr_expect_lt(c[i], f[i] - 0.05, "step %d: from the adapter %.6f, fresh %.6f", i + 1, c[i],
                     f[i]);
}

/* (c) The PEFT adapters of the Hugging Face fixtures (written by
 * PeftModel.save_pretrained, no base identity): a one-step run on each
 * sequence of the fixture's batch, as a dataset of one window, gives first
 * losses whose token-weighted mean is the fixture's PEFT loss within 1e-5
 * relative (the bound tests/fixtures/hf/README.md gives for fp32). */
static void peft_fixture(const char *name)
{
    const char *fx = fixture(tu_fmt("hf/%s", name));
    char *fxd = strdup(fx);
    model_opts o;
    sp_err err = {0};
    cr_assert_eq(tu_lora_opts(tu_fmt("%s/lora", fxd), &o, &err), 0, "%s", err.msg);
    model_config_t mc;
    cr_assert_eq(model_config_load(&mc, tu_fmt("%s/model", fxd), &err), 0, "%s", err.msg);
    char targets[160] = "";
    for (int p = 0; p < PROJ_COUNT; p++)
        if (o.lora_targets & (1 << p))
            snprintf(targets + strlen(targets), sizeof targets - strlen(targets), "%s%s",
                     targets[0] ? "," : "", config_target_names[p]);
    st_file bf;
    cr_assert_eq(st_open(&bf, tu_fmt("%s/batch.safetensors", fxd), &err), 0, "%s", err.msg);
    const st_tensor *tk = st_find(&bf, "tokens"), *mk = st_find(&bf, "loss_mask");
    cr_assert(tk && mk && tk->dt == DT_I32 && mk->dt == DT_U8);
    int B = (int)tk->shape[0], T1 = (int)tk->shape[1];
    double sum = 0, count = 0;
    for (int b = 0; b < B; b++) {
        uint32_t tok[64];
        uint8_t msk[64];
        cr_assert(T1 <= 64);
        for (int j = 0; j < T1; j++) {
            tok[j] = (uint32_t)((const int32_t *)tk->data)[b * T1 + j];
            msk[j] = ((const uint8_t *)mk->data)[b * T1 + j];
        }
        const char *data = tu_fmt("%s/%s-%d.h5", dir, name, b);
        one_window(data, tok, msk, (uint64_t)T1, mc.vocab);
        const char *run = tu_fmt("%s-%d", name, b);
        char *out = NULL;
        int rc = tu_spotune(&out,
                            "train %s/run.yaml --set run.dir=%s/%s --set model.path=%s/model "
                            "--set data.train=%s/%s-%d.h5 --set train.seq_len=%d "
                            "--set train.micro_batch=1 --set train.steps=1 --set lora.r=%lld "
                            "--set lora.alpha=%.17g --set lora.rslora=%s --set lora.targets=%s "
                            "--set lora.dora=%s --set lora.init_from=%s/lora",
                            dir, dir, run, fxd, dir, name, b, T1 - 1, (long long)o.lora_r,
                            o.lora_alpha, o.rslora ? "true" : "false", targets,
                            o.dora ? "true" : "false", fxd);
        cr_assert_eq(rc, 0, "%s failed (%d): %s", run, rc, out);
        cr_expect(tu_contains(out, "records no base model identity"), "%s", out);
        free(out);
        double loss, n;
        cr_assert_eq(metric(run, "train", "loss", &loss, 1), 1);
        cr_assert_eq(metric(run, "train", "trained_tokens", &n, 1), 1);
        sum += loss * n;
        count += n;
    }
    st_close(&bf);
    size_t n = 0;
    float *want = tu_load_f32(tu_fmt("%s/lora_expected.safetensors", fxd), "loss", &n);
    cr_assert(want && n == 1);
    double got = sum / count;
    cr_expect_lt(fabs(got - want[0]), 1e-5 * fabs(want[0]), "%s: loss %.9g, PEFT %.9g", name, got,
                 (double)want[0]);
    free(want);
    free(fxd);
}

Test(init_from, peft_adapter_llama_gqa_gives_peft_loss) { peft_fixture("llama_gqa"); }
Test(init_from, peft_adapter_llama_tied_llama3_gives_peft_loss) { peft_fixture("llama_tied_llama3"); }
/* DoRA adapters (use_dora, their lora_magnitude_vector loaded) into lora.dora runs */
Test(init_from, peft_dora_adapter_llama_gqa_gives_peft_loss) { peft_fixture("llama_gqa_dora"); }
Test(init_from, peft_dora_adapter_qwen2_bias_gives_peft_loss) { peft_fixture("qwen2_bias_dora"); }
Test(init_from, peft_adapter_qwen2_bias_gives_peft_loss) { peft_fixture("qwen2_bias"); }

/* A resume takes the checkpoint: with init_from changed to a directory that
 * does not exist, or removed, or added to a run that had none, the run
 * resumes (the key is not in the config hash) and says init_from is not
 * read; the continuation equals the uninterrupted run's adapter bit for bit.
 * --resume none starts afresh and reads it. */
Test(init_from, a_resume_takes_the_checkpoint_whatever_init_from_says)
{
    run_a_and_export();
    const char *from = tu_fmt("--set lora.init_from=%s/peft_a", dir);
    char sets[4096];
    snprintf(sets, sizeof sets, "%s --set train.steps=6", from);
    train_ok("whole", sets);
    snprintf(sets, sizeof sets, "%s --set train.steps=2 --set checkpoint.every_steps=2", from);
    train_ok("r", sets);
    const char *variants[] = {"--set lora.init_from=/nonexistent/adapter --set train.steps=4",
                              "--set train.steps=6"};
    for (int v = 0; v < 2; v++) {
        char *out = NULL;
        int rc = train(&out, "r", variants[v]);
        cr_assert_eq(rc, 0, "resume %d failed (%d): %s", v, rc, out);
        cr_expect(tu_contains(out, "resumed from"), "%s", out);
        cr_expect_eq(!!tu_contains(out, "is not read: the run resumes"), v == 0, "%s", out);
        free(out);
    }
    cr_expect_eq(tu_sh(NULL, "cmp %s/whole/adapter/adapter_model.safetensors "
                             "%s/r/adapter/adapter_model.safetensors",
                       dir, dir),
                 0, "the resumed run's adapter differs from the uninterrupted one's");
    /* a run without init_from, resumed with it */
    train_ok("plain", "--set train.steps=2");
    char *out = NULL;
    int rc = train(&out, "plain", tu_fmt("%s --set train.steps=3", from));
    cr_expect_eq(rc, 0, "%s", out);
    cr_expect(tu_contains(out, "resumed from") && tu_contains(out, "is not read"), "%s", out);
    free(out);
    /* --resume none: a fresh start, which reads it */
    rc = tu_spotune(&out, "train %s/run.yaml --set run.dir=%s/plain %s --set train.steps=1 "
                          "--resume none",
                    dir, dir, from);
    cr_expect_eq(rc, 0, "%s", out);
    cr_expect(!tu_contains(out, "resumed from") &&
                  tu_contains(out, "LoRA weights initialised from"),
              "%s", out);
    free(out);
}

/* ---- (d) bad input ------------------------------------------------------------ */

/* DIR/good: an adapter of the run's shape (random A, zero B) written by
 * spotune for DIR/model, with its identity. */
static void good_adapter(void)
{
    sp_err err = {0};
    model_config_t mc;
    backend_t *be;
    model_t *m;
    const char *model = tu_fmt("%s/model", dir);
    model_opts o = {.mode = MODE_LORA, .lora_r = 4, .lora_alpha = 8,
                    .lora_targets = TARGET_Q | TARGET_V | TARGET_DOWN, .max_batch = 1,
                    .seq_len = 2, .seed = 7};
    cr_assert_eq(model_config_load(&mc, model, &err), 0, "%s", err.msg);
    cr_assert_eq(backend_create(&be, "cpu", 0, 1, &err), 0, "%s", err.msg);
    cr_assert_eq(model_create(&m, be, &mc, &o, &err), 0, "%s", err.msg);
    model_init_lora(m, 7);
    char *model_dup = strdup(model);
    cr_assert_eq(adapter_save(m, tu_fmt("%s/good", dir), model_dup, &err), 0, "%s", err.msg);
    free(model_dup);
    model_destroy(m);
    backend_destroy(be);
}

/* DIR/NAME: a copy of DIR/good */
static const char *copy_good(const char *name)
{
    cr_assert_eq(tu_sh(NULL, "rm -rf %s/%s && cp -r %s/good %s/%s", dir, name, dir, dir, name), 0);
    return tu_fmt("%s/%s", dir, name);
}

/* DIR/NAME with one field of adapter_config.json set to the JSON text value */
static void config_field(const char *name, const char *field, const char *value)
{
    copy_good(name);
    const char *path = tu_fmt("%s/%s/adapter_config.json", dir, name);
    char *p = strdup(path);
    json_t *c = json_load_file(p, 0, NULL), *v = json_loads(value, JSON_DECODE_ANY, NULL);
    cr_assert(c && v, "%s / %s", p, value);
    json_object_set_new(c, field, v);
    cr_assert_eq(json_dump_file(c, p, JSON_INDENT(2)), 0);
    json_decref(c);
    free(p);
}

/* DIR/NAME with adapter_model.safetensors rewritten: the good tensors, the
 * one named `drop` left out, `reshape` written with its two dimensions
 * swapped, `retype` as I32, `extra` added; meta: one metadata pair (key,
 * value) or NULL for format: pt */
static void tensors(const char *name, const char *drop, const char *reshape, const char *retype,
                    const char *extra, const char *const *meta)
{
    copy_good(name);
    sp_err err = {0};
    st_file f;
    cr_assert_eq(st_open(&f, tu_fmt("%s/good/adapter_model.safetensors", dir), &err), 0, "%s",
                 err.msg);
    st_entry *e = calloc(f.n + 1, sizeof *e);
    size_t n = 0;
    for (size_t i = 0; i < f.n; i++) {
        const st_tensor *t = &f.tensors[i];
        if (drop && strcmp(t->name, drop) == 0)
            continue;
        e[n] = (st_entry){t->name, t->dt, 2, {t->shape[0], t->shape[1]}, t->data};
        if (reshape && strcmp(t->name, reshape) == 0) {
            e[n].shape[0] = t->shape[1];
            e[n].shape[1] = t->shape[0];
        }
        if (retype && strcmp(t->name, retype) == 0)
            e[n].dt = DT_I32;
        n++;
    }
    if (extra)
        e[n++] = (st_entry){extra, DT_F32, 2, {f.tensors[0].shape[0], f.tensors[0].shape[1]},
                            f.tensors[0].data};
    const char *path = tu_fmt("%s/%s/adapter_model.safetensors", dir, name);
    char *p = strdup(path);
    const char *fmt_only[] = {"format", "pt"};
    cr_assert_eq(st_write(p, e, n, meta ? meta : fmt_only, 1, &err), 0, "%s", err.msg);
    free(p);
    free(e);
    st_close(&f);
}

/* DIR/NAME: a copy of DIR/good whose tensor `name` holds NaN at element 5 */
static void nan_at_5(const char *name, const char *tensor)
{
    copy_good(name);
    float nan = NAN;
    char *path = strdup(tu_fmt("%s/%s/adapter_model.safetensors", dir, name));
    tu_st_poke(path, tensor, 5, &nan, 1);
    free(path);
}

/* training with init_from DIR/name (and more options) exits with code and
 * says want1 and want2 */
static void refused(const char *name, const char *more, int code, const char *want1,
                    const char *want2)
{
    char *out = NULL;
    char sets[4096];
    snprintf(sets, sizeof sets, "--set train.steps=1 --set lora.init_from=%s/%s %s", dir, name,
             more ? more : "");
    int rc = train(&out, tu_fmt("bad-%s", name), sets);
    cr_expect_eq(rc, code, "%s: exit %d (want %d): %s", name, rc, code, out);
    cr_expect(tu_contains(out, want1), "%s: '%s' lacks '%s'", name, out, want1);
    cr_expect(tu_contains(out, want2), "%s: '%s' lacks '%s'", name, out, want2);
    cr_expect(!tu_contains(out, "step      1/"), "%s: trained anyway: %s", name, out);
    free(out);
}

Test(init_from, config_mismatches_refused_naming_field_and_values)
{
    good_adapter();
    const char *good = tu_fmt("%s/good", dir);
    char g[4096];
    snprintf(g, sizeof g, "%s", good);
    /* the good adapter itself loads */
    char *out = NULL;
    cr_assert_eq(train(&out, "ok", tu_fmt("--set train.steps=1 --set lora.init_from=%s", g)), 0,
                 "%s", out);
    free(out);
    refused("good", "--set lora.r=8", 2, g, "r 4, the run lora.r 8");
    refused("good", "--set lora.alpha=16", 2, g, "lora_alpha 8, the run lora.alpha 16");
    refused("good", "--set lora.rslora=true", 2, g, "use_rslora false, the run lora.rslora true");
    refused("good", "--set lora.targets=[q_proj,v_proj]", 2, g,
            "target_modules [q_proj, v_proj, down_proj], the run lora.targets [q_proj, v_proj]");
    refused("good", "--set train.mode=full", 2, "lora.init_from", "needs train.mode lora");
    /* a plain LoRA adapter into a DoRA run (a DoRA one into a plain run: bad_adapters) */
    refused("good", "--set lora.dora=true", 2, g, "use_dora false, the run lora.dora true");
    config_field("alllinear", "target_modules", "\"all-linear\"");
    refused("alllinear", NULL, 2, tu_fmt("%s/alllinear", dir),
            "target_modules [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj], the "
            "run lora.targets [q_proj, v_proj, down_proj]");
    /* another base model: spotune recorded the identity of the one it was trained on */
    cr_assert_eq(tu_spotune(NULL, "init-model --preset tiny --seed 9 %s/other", dir), 0);
    char id[17];
    sp_err err = {0};
    cr_assert_eq(model_io_identity(tu_fmt("%s/model", dir), id, &err), 0, "%s", err.msg);
    refused("good", tu_fmt("--set model.path=%s/other", dir), 2, id, "trained on the base model");
    /* export --peft records the identity the checkpoint holds, even when the
     * base directory is not at hand (--model names one that does not exist) */
    char *xo = NULL;
    int rc = tu_spotune(&xo, "export %s/ok/checkpoints/step-00000001 --peft %s/nobase --model %s/gone",
                        dir, dir, dir);
    cr_assert_eq(rc, 0, "export without the base at hand (%d): %s", rc, xo);
    free(xo);
    refused("nobase", tu_fmt("--set model.path=%s/other", dir), 2, id, "trained on the base model");
}

Test(init_from, bad_adapters_refused_by_file_and_tensor)
{
    good_adapter();
    const char *a0 = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight";
    const char *b1 = "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight";
    refused("missing", NULL, 3, "missing/adapter_config.json", "cannot open");
    copy_good("nojson");
    cr_assert_eq(tu_write_file(tu_fmt("%s/nojson/adapter_config.json", dir), "{\"r\": 4,"), 0);
    refused("nojson", NULL, 3, "nojson/adapter_config.json", "not valid JSON");
    copy_good("noweights");
    cr_assert_eq(tu_sh(NULL, "rm %s/noweights/adapter_model.safetensors", dir), 0);
    refused("noweights", NULL, 3, "noweights/adapter_model.safetensors", "cannot");
    config_field("dora", "use_dora", "true");
    refused("dora", NULL, 2, "use_dora true, the run lora.dora false", "lora_magnitude_vector");
    /* use_dora with no magnitudes in the file */
    refused("dora", "--set lora.dora=true", 3,
            "'base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector' is missing",
            "dora/adapter_model.safetensors");
    config_field("doranum", "use_dora", "1");
    refused("doranum", NULL, 3, "doranum/adapter_config.json", "use_dora must be true or false");
    config_field("prefix", "peft_type", "\"PREFIX_TUNING\"");
    refused("prefix", NULL, 3, "prefix/adapter_config.json", "peft_type is PREFIX_TUNING");
    config_field("bias", "bias", "\"all\"");
    refused("bias", NULL, 3, "bias/adapter_config.json", "bias is not \"none\"");
    config_field("ranks", "rank_pattern", "{\"q_proj\": 8}");
    refused("ranks", NULL, 3, "ranks/adapter_config.json", "rank_pattern is not empty");
    config_field("lmhead", "target_modules", "[\"q_proj\", \"lm_head\"]");
    refused("lmhead", NULL, 3, "lmhead/adapter_config.json", "target_modules names lm_head");
    config_field("regex", "target_modules", "\".*proj\"");
    refused("regex", NULL, 3, "regex/adapter_config.json", "is the pattern '.*proj'");
    config_field("nor", "r", "\"four\"");
    refused("nor", NULL, 3, "nor/adapter_config.json", "r must be a positive integer");
    tensors("drop", a0, NULL, NULL, NULL, NULL);
    refused("drop", NULL, 3, "drop/adapter_model.safetensors", tu_fmt("'%s' is missing", a0));
    tensors("shape", NULL, b1, NULL, NULL, NULL);
    refused("shape", NULL, 3, "shape/adapter_model.safetensors",
            tu_fmt("'%s' has shape [4, 128], this run's LoRA needs [128, 4]", b1));
    tensors("dtype", NULL, NULL, a0, NULL, NULL);
    refused("dtype", NULL, 3, "dtype/adapter_model.safetensors",
            tu_fmt("'%s' has dtype I32", a0));
    const char *extra = "base_model.model.lm_head.lora_A.weight";
    tensors("extra", NULL, NULL, NULL, extra, NULL);
    refused("extra", NULL, 3, "extra/adapter_model.safetensors",
            tu_fmt("'%s' is not a LoRA weight of this run", extra));
    const char *bad_id[] = {ADAPTER_META_BASE, "not-an-identity"};
    tensors("badid", NULL, NULL, NULL, NULL, bad_id);
    refused("badid", NULL, 3, "badid/adapter_model.safetensors", "not a base model identity");
    nan_at_5("nan", b1);
    refused("nan", NULL, 3, "nan/adapter_model.safetensors",
            tu_fmt("'%s' holds 1 value(s) that are not finite, the first nan at element 5", b1));
}

/* A DoRA model of DIR/model's shape (r 4 on q_proj, v_proj, down_proj), its
 * base weights loaded and its LoRA initialised with seed. */
static model_t *dora_model(backend_t **be, uint64_t seed)
{
    sp_err err = {0};
    model_config_t mc;
    model_t *m;
    model_opts o = {.mode = MODE_LORA, .lora_r = 4, .lora_alpha = 8, .dora = 1,
                    .lora_targets = TARGET_Q | TARGET_V | TARGET_DOWN, .max_batch = 1,
                    .seq_len = 2, .seed = seed};
    cr_assert_eq(model_config_load(&mc, tu_fmt("%s/model", dir), &err), 0, "%s", err.msg);
    cr_assert_eq(backend_create(be, "cpu", 0, 1, &err), 0, "%s", err.msg);
    cr_assert_eq(model_create(&m, *be, &mc, &o, &err), 0, "%s", err.msg);
    cr_assert_eq(model_io_load_base(m, tu_fmt("%s/model", dir), &err), 0, "%s", err.msg);
    model_init_lora(m, seed);
    return m;
}

/* A DoRA adapter written by spotune: use_dora true, each magnitude a vector
 * [out] initialised to the row norms of the base weight (B = 0), and loaded
 * back bit for bit; a magnitude of another shape is refused naming it. */
Test(init_from, dora_adapter_magnitudes_written_loaded_and_checked)
{
    sp_err err = {0};
    backend_t *be, *be2;
    model_t *m = dora_model(&be, 7), *m2 = dora_model(&be2, 8);
    const char *adir = tu_fmt("%s/dgood", dir);
    char *adir_dup = strdup(adir);
    cr_assert_eq(adapter_save(m, adir_dup, NULL, &err), 0, "%s", err.msg);
    json_t *cfg = json_load_file(tu_fmt("%s/adapter_config.json", adir_dup), 0, NULL);
    cr_expect(json_is_true(json_object_get(cfg, "use_dora")));
    json_decref(cfg);
    const char *qm = "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector";
    param_t *q = model_find_param(m, qm), *w = model_find_param(m, "model.layers.0.self_attn.q_proj.weight");
    cr_assert(q && w && q->ndim == 1 && q->shape[0] == w->shape[0]);
    /* m = ||W||_row at initialisation (B = 0), in double here */
    float *mag = malloc(sizeof(float) * q->n), *wv = malloc(sizeof(float) * w->n);
    model_param_download(m, q, mag);
    model_param_download(m, w, wv);
    double worst = 0;
    for (int64_t o = 0; o < w->shape[0]; o++) {
        double ss = 0;
        for (int64_t i = 0; i < w->shape[1]; i++)
            ss += (double)wv[o * w->shape[1] + i] * wv[o * w->shape[1] + i];
        double e = fabs(mag[o] - sqrt(ss)) / sqrt(ss);
        worst = e > worst ? e : worst;
    }
    cr_expect_lt(worst, 1e-6, "magnitude vs row norm of W: rel %g", worst);
    /* loaded into another DoRA model: every magnitude as written */
    cr_assert_eq(adapter_init_from(m2, adir_dup, NULL, NULL, 0, &err), 0, "%s", err.msg);
    size_t checked = 0;
    for (int i = 0; i < m->nparams; i++) {
        param_t *p = &m->params[i];
        if (p->kind != PK_LORA_M)
            continue;
        float *a = malloc(sizeof(float) * p->n), *b = malloc(sizeof(float) * p->n);
        model_param_download(m, p, a);
        model_param_download(m2, model_find_param(m2, p->name), b);
        cr_expect_eq(memcmp(a, b, sizeof(float) * p->n), 0, "%s differs", p->name);
        free(a), free(b);
        checked++;
    }
    cr_expect_eq(checked, (size_t)m->mc.layers * 3, "magnitudes: one per layer and target");
    /* the q_proj magnitude written as [out, 1] */
    st_file f;
    cr_assert_eq(st_open(&f, tu_fmt("%s/adapter_model.safetensors", adir_dup), &err), 0, "%s",
                 err.msg);
    st_entry *e = calloc(f.n, sizeof *e);
    for (size_t i = 0; i < f.n; i++) {
        const st_tensor *t = &f.tensors[i];
        e[i] = (st_entry){t->name, t->dt, t->ndim, {t->shape[0], t->shape[1]}, t->data};
        if (strcmp(t->name, qm) == 0)
            e[i].ndim = 2, e[i].shape[1] = 1;
    }
    cr_assert_eq(tu_sh(NULL, "cp -r %s %s/dshape", adir_dup, dir), 0);
    char *p = strdup(tu_fmt("%s/dshape/adapter_model.safetensors", dir));
    const char *meta[] = {"format", "pt"};
    cr_assert_eq(st_write(p, e, f.n, meta, 1, &err), 0, "%s", err.msg);
    st_close(&f);
    free(e);
    sp_err bad = {0};
    int rc = adapter_init_from(m2, tu_fmt("%s/dshape", dir), NULL, NULL, 0, &bad);
    cr_expect_eq(rc, 3, "%s", bad.msg);
    char want[256];
    snprintf(want, sizeof want, "'%s' has shape [%lld, 1], this run's LoRA needs [%lld]", qm,
             (long long)q->shape[0], (long long)q->shape[0]);
    cr_expect(tu_contains(bad.msg, want), "'%s' lacks '%s'", bad.msg, want);
    free(p);
    free(mag), free(wv), free(adir_dup);
    model_destroy(m), model_destroy(m2);
    backend_destroy(be), backend_destroy(be2);
}

/* BF16 and F16 adapters (as PEFT saves a half-precision model's) load as
 * their values: each F32 master equals the half value converted, exactly. */
Test(init_from, half_precision_adapters_load_as_their_values)
{
    good_adapter();
    sp_err err = {0};
    st_file f;
    cr_assert_eq(st_open(&f, tu_fmt("%s/good/adapter_model.safetensors", dir), &err), 0, "%s",
                 err.msg);
    for (int half = 0; half < 2; half++) {
        dtype_t dt = half ? DT_F16 : DT_BF16;
        const char *name = half ? "f16" : "bf16";
        copy_good(name);
        st_entry *e = calloc(f.n, sizeof *e);
        uint16_t **h = calloc(f.n, sizeof *h);
        for (size_t i = 0; i < f.n; i++) {
            const st_tensor *t = &f.tensors[i];
            h[i] = malloc(2 * t->numel);
            for (size_t k = 0; k < t->numel; k++) {
                float x = ((const float *)t->data)[k] + (float)k * 1e-3f; /* B not all zero */
                h[i][k] = half ? sp_f32_to_f16(x) : sp_f32_to_bf16(x);
            }
            e[i] = (st_entry){t->name, dt, 2, {t->shape[0], t->shape[1]}, h[i]};
        }
        char *p = strdup(tu_fmt("%s/%s/adapter_model.safetensors", dir, name));
        const char *meta[] = {"format", "pt"};
        cr_assert_eq(st_write(p, e, f.n, meta, 1, &err), 0, "%s", err.msg);
        free(p);

        model_config_t mc;
        backend_t *be;
        model_t *m;
        model_opts o = {.mode = MODE_LORA, .lora_r = 4, .lora_alpha = 8,
                        .lora_targets = TARGET_Q | TARGET_V | TARGET_DOWN, .max_batch = 1,
                        .seq_len = 2, .seed = 99};
        cr_assert_eq(model_config_load(&mc, tu_fmt("%s/model", dir), &err), 0, "%s", err.msg);
        cr_assert_eq(backend_create(&be, "cpu", 0, 1, &err), 0, "%s", err.msg);
        cr_assert_eq(model_create(&m, be, &mc, &o, &err), 0, "%s", err.msg);
        cr_assert_eq(adapter_init_from(m, tu_fmt("%s/%s", dir, name), NULL, NULL, 0, &err), 0,
                     "%s", err.msg);
        for (size_t i = 0; i < f.n; i++) {
            param_t *q = model_find_param(m, f.tensors[i].name);
            cr_assert(q && q->n == f.tensors[i].numel, "%s", f.tensors[i].name);
            float *got = malloc(sizeof(float) * q->n);
            model_param_download(m, q, got);
            size_t bad = 0;
            for (size_t k = 0; k < q->n; k++) {
                float want = half ? sp_f16_to_f32(h[i][k]) : sp_bf16_to_f32(h[i][k]);
                bad += memcmp(&got[k], &want, sizeof want) != 0;
            }
            cr_expect_eq(bad, 0, "%s %s: %zu values differ", name, q->name, bad);
            free(got);
            free(h[i]);
        }
        free(h);
        free(e);
        model_destroy(m);
        backend_destroy(be);
    }
    st_close(&f);
}
