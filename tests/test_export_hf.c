/* Exports that serve unchanged, on every Hugging Face fixture architecture
 * (tests/fixtures/hf: llama_gqa, llama_tied_llama3, qwen2_bias, mistral).
 * A base whose config.json carries keys spotune has never heard of
 * ("sliding_window": null, an unknown object, eos_token_id as a list,
 * transformers 4's torch_dtype + rope_scaling, ...) and tokenizer files is
 * fine-tuned a few steps with LoRA by spotune, then exported:
 *   - the merged config.json equals the base's but for the dtype key(s), in
 *     the same key order;
 *   - the base's tokenizer and generation files are copied byte for byte,
 *     other files are not;
 *   - the merged model loaded back by spotune gives the logits of base +
 *     adapter in spotune (the fixture's batch; 1e-5 relative to the largest
 *     logit, float32 rounding of W + s B A), and the adapter moved them;
 *   - --dtype bf16|f16 writes every tensor and the config in that dtype;
 *     a bad --dtype, --dtype without --merged and an export into the base
 *     directory are refused by name, writing nothing;
 *   - the adapter directory has a README.md model card (PEFT's front matter,
 *     base model, targets, r/alpha, steps, final losses, datasets), whose
 *     losses are the last train and val records of metrics.jsonl;
 *   - a config.json as transformers writes it comes out byte for byte;
 *   - a full fine-tune's RUN_DIR/model/ keeps the config and files the same
 *     way, even over its own base;
 *   - spotune --help lists export --model and --dtype. */
#define _POSIX_C_SOURCE 200809L
#include <criterion/criterion.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kernels/nf4.h"
#include "test_util.h"
#include "trainer/data.h"
#include "trainer/model_card.h"
#include "trainer/model_io.h"

/* merged f32 weights against base + adapter: float32 rounding of the sum */
#define LOGITS_TOL 1e-5
/* the adapter must move the logits by more than this (else the test is weak) */
#define MOVED_MIN 1e-3

static char *dir;

static void setup(void)
{
    dir = tu_tempdir("exporthf");
    cr_assert(dir);
}

static void teardown(void)
{
    tu_rmtree(dir);
    free(dir);
}

TestSuite(export_hf, .init = setup, .fini = teardown, .timeout = 600);

/* DIR/rel in one of 8 static buffers used in turn */
static const char *at(const char *rel)
{
    static char buf[8][4096];
    static int next;
    char *b = buf[next++ % 8];
    snprintf(b, 4096, "%s/%s", dir, rel);
    return b;
}

static int exists(const char *path)
{
    struct stat sb;
    return stat(path, &sb) == 0;
}

static json_t *load_json(const char *path)
{
    json_error_t je;
    json_t *j = json_load_file(path, 0, &je);
    cr_assert(j, "%s: %s", path, je.text);
    return j;
}

/* The files the test puts beside the base's weights: name, content, and
 * whether a merged export must copy it. */
static const struct {
    const char *name, *text;
    int copied;
} side_files[] = {
    {"tokenizer.json", "{\"version\": \"1.0\", \"model\": {\"type\": \"BPE\"}}\n", 1},
    {"tokenizer_config.json", "{\"model_max_length\": 4160, \"chat_template\": null}\n", 1},
    {"special_tokens_map.json", "{\"bos_token\": \"<s>\", \"eos_token\": \"</s>\"}\n", 1},
    {"tokenizer.model", "\x0a\x05\x3c\x75\x6e\x6b\x3e binary sentencepiece bytes\n", 1},
    {"chat_template.jinja", "{% for m in messages %}{{ m['content'] }}{% endfor %}\n", 1},
    {"added_tokens.json", "{\"<extra_0>\": 63}\n", 1},
    {"vocab.json", "{\"a\": 0, \"b\": 1}\n", 1},
    {"merges.txt", "#version: 0.2\na b\n", 1},
    {"notes.txt", "not a tokenizer file\n", 0},
    {"training_args.bin", "not a tokenizer file either\n", 0},
};

/* Makes DIR/base: the fixture's model/ with config.json edited (keys spotune
 * has never heard of, per architecture variants) and the side files. */
static void make_base(const char *name)
{
    const char *fx = fixture(tu_fmt("hf/%s/model", name));
    cr_assert_eq(tu_sh(NULL, "mkdir -p %s && cp %s/model.safetensors %s/generation_config.json %s/",
                       at("base"), fx, fx, at("base")),
                 0);
    json_t *c = load_json(tu_fmt("%s/config.json", fx));
    json_object_set_new(c, "sliding_window", json_null());
    json_object_set_new(c, "spotune_never_heard_of",
                        json_pack("{s:[i, f, n, s], s:b, s:{s:s}}", "list", 1, 2.5, "x", "flag", 1,
                                  "nested", "deeper", "value"));
    if (strcmp(name, "llama_gqa") == 0) {
        /* a list of end ids, a pad id, and both dtype keys */
        json_object_set_new(c, "eos_token_id", json_pack("[i, i]", 2, 5));
        json_object_set_new(c, "pad_token_id", json_integer(0));
        json_object_set_new(c, "torch_dtype", json_string("float32"));
    } else if (strcmp(name, "llama_tied_llama3") == 0) {
        /* as transformers 4 writes it: torch_dtype, rope_theta at the top,
         * rope_scaling for the llama3 parameters */
        json_t *rp = json_deep_copy(json_object_get(c, "rope_parameters"));
        json_object_set_new(c, "rope_theta", json_real(500000.0));
        json_object_del(rp, "rope_theta");
        json_object_set_new(c, "rope_scaling", rp);
        json_object_del(c, "rope_parameters");
        json_object_del(c, "dtype");
        json_object_set_new(c, "torch_dtype", json_string("float32"));
    } else if (strcmp(name, "mistral") == 0) {
        /* no window at all (the key transformers must not fill in with 4096) */
        json_object_set_new(c, "max_window_layers", json_integer(1));
    }
    cr_assert_eq(json_dump_file(c, at("base/config.json"), JSON_INDENT(2)), 0);
    json_decref(c);
    for (size_t i = 0; i < sizeof side_files / sizeof side_files[0]; i++)
        cr_assert_eq(tu_write_file(at(tu_fmt("base/%s", side_files[i].name)), side_files[i].text),
                     0);
}

/* DIR/train.h5 and DIR/val.h5: random tokens below vocab, documents of 50 */
static void make_data(int64_t vocab)
{
    sp_err err = {0};
    for (int part = 0; part < 2; part++) {
        uint64_t n = part ? 400 : 2000, ndocs = n / 50;
        uint32_t *tok = malloc(sizeof *tok * n);
        uint8_t *msk = malloc(n);
        uint64_t *off = malloc(sizeof *off * (ndocs + 1));
        uint64_t s = 0x9e3779b97f4a7c15ull + (uint64_t)part;
        for (uint64_t i = 0; i < n; i++) {
            s = s * 6364136223846793005ull + 1442695040888963407ull;
            tok[i] = (uint32_t)((s >> 33) % (uint64_t)vocab);
            msk[i] = i % 50 != 0;
        }
        for (uint64_t d = 0; d <= ndocs; d++)
            off[d] = d * 50;
        cr_assert_eq(dataset_write(at(part ? "val.h5" : "train.h5"), tok, msk, n, off, ndocs, vocab,
                                   2, "test", &err),
                     0, "%s", err.msg);
        free(tok), free(msk), free(off);
    }
}

/* Trains DIR/run (mode lora or full) for 6 steps on DIR/base; the final
 * checkpoint is DIR/run/checkpoints/step-00000006. The command's output
 * (the caller frees it). */
static char *train_q(const char *mode, const char *targets, int dora, const char *quantize)
{
    char *yaml = sp_strf("run:\n  dir: %s\n  seed: 7\nmodel:\n  path: %s\n  quantize: %s\n"
                         "data:\n  train: %s\n  val: %s\n  val_every: 3\n  val_windows: 4\n"
                         "train:\n  mode: %s\n  steps: 6\n  seq_len: 16\n  micro_batch: 2\n"
                         "  grad_accum: 1\n  lr: 5e-2\n  warmup_steps: 1\n"
                         "lora:\n  r: 4\n  alpha: 8\n  targets: %s\n  dora: %s\n"
                         "log:\n  every: 1\nruntime:\n  backend: cpu\n  threads: 1\n"
                         "checkpoint:\n  every_minutes: 0\n  every_steps: 6\n",
                         at("run"), at("base"), quantize, at("train.h5"), at("val.h5"), mode,
                         targets, dora ? "true" : "false");
    cr_assert_eq(tu_write_file(at("run.yaml"), yaml), 0);
    free(yaml);
    char *out = NULL;
    int rc = tu_spotune(&out, "train %s", at("run.yaml"));
    cr_assert_eq(rc, 0, "training failed (%d): %s", rc, out);
    /* every tensor of the fixture's files is one the model reads */
    cr_expect(!tu_contains(out, "not part of this model"), "%s", out);
    return out;
}

static void train(const char *mode, const char *targets, int dora)
{
    free(train_q(mode, targets, dora, "none"));
}

/* The merged config.json (path) is the base's with every dtype key the base
 * has (torch_dtype and/or dtype; torch_dtype when none) set to want, every
 * other key equal and in the same order. */
static void check_config(const char *path_at, const char *want)
{
    char path[4096];
    snprintf(path, sizeof path, "%s", path_at);
    json_t *base = load_json(at("base/config.json")), *got = load_json(path);
    int had = 0;
    const char *keys[] = {"torch_dtype", "dtype"};
    for (int i = 0; i < 2; i++)
        if (json_object_get(base, keys[i])) {
            json_object_set_new(base, keys[i], json_string(want));
            had = 1;
        }
    if (!had)
        json_object_set_new(base, "torch_dtype", json_string(want));
    char *b = json_dumps(base, JSON_INDENT(2)), *g = json_dumps(got, JSON_INDENT(2));
    cr_expect(json_equal(base, got), "%s differs from the base's config.json but for the "
                                     "dtype:\n%s\nexpected:\n%s",
              path, g, b);
    /* same keys in the same order (jansson keeps insertion order) */
    cr_expect_str_eq(g, b, "%s: key order or formatting differs", path);
    json_t *sw = json_object_get(got, "sliding_window");
    cr_expect(sw && json_is_null(sw), "%s: sliding_window must stay null", path);
    free(b), free(g);
    json_decref(base), json_decref(got);
}

/* The side files of DIR/base are in out byte for byte; the others are not
 * (unless out is the base itself: in_place). */
static void check_side_files_in(const char *out_at, int in_place)
{
    char out[4096]; /* out_at may be one of at()'s buffers, which the loop reuses */
    snprintf(out, sizeof out, "%s", out_at);
    for (size_t i = 0; i < sizeof side_files / sizeof side_files[0]; i++) {
        const char *p = tu_fmt("%s/%s", out, side_files[i].name);
        if (!side_files[i].copied) {
            cr_expect(in_place || !exists(p), "%s was copied", p);
            continue;
        }
        char *o = NULL;
        cr_expect_eq(tu_sh(&o, "cmp %s %s", at(tu_fmt("base/%s", side_files[i].name)), p), 0,
                     "%s: %s", p, o);
        free(o);
    }
    char *o = NULL;
    cr_expect_eq(tu_sh(&o, "cmp %s %s", at("base/generation_config.json"),
                       tu_fmt("%s/generation_config.json", out)),
                 0, "generation_config.json: %s", o);
    free(o);
}

static void check_side_files(const char *out_at)
{
    check_side_files_in(out_at, 0);
}

/* logits of the fixture's batch for the model in case_dir/model (+ lora/) */
static float *logits_of(const char *case_dir, int lora, size_t *n)
{
    tu_hf_case hc;
    sp_err err = {0};
    cr_assert_eq(tu_hf_open(&hc, case_dir, lora, 0.0, "cpu", RECOMPUTE_NONE, 0, &err), 0, "%s: %s",
                 case_dir, err.msg);
    *n = (size_t)hc.B * hc.T * hc.mc.vocab;
    float *l = malloc(sizeof(float) * *n);
    model_batch b = {.inputs = hc.inputs,
                     .targets = hc.targets,
                     .sample_ids = hc.ids,
                     .B = hc.B,
                     .T = hc.T,
                     .grad_scale = 1.0f,
                     .last = 1};
    cr_assert_eq(model_forward_logits(hc.m, &b, l, &err), 0, "%s", err.msg);
    tu_hf_close(&hc);
    return l;
}

/* DIR/<tag>: model -> model_dir, lora -> adapter_dir, the fixture's batch */
static const char *case_dir(const char *tag, const char *name, const char *model_dir,
                            const char *adapter_dir)
{
    static char buf[2][4096];
    static int next;
    char *d = buf[next++ % 2];
    snprintf(d, sizeof buf[0], "%s/%s", dir, tag);
    cr_assert_eq(tu_sh(NULL, "mkdir -p %s && ln -sfn %s %s/model && ln -sf %s %s/batch.safetensors",
                       d, model_dir, d, fixture(tu_fmt("hf/%s/batch.safetensors", name)), d),
                 0);
    if (adapter_dir)
        cr_assert_eq(tu_sh(NULL, "ln -sfn %s %s/lora", adapter_dir, d), 0);
    return d;
}

/* Every tensor of the merged model's safetensors file(s) has dtype want. */
static void check_weights_dtype(const char *model_dir, dtype_t want)
{
    char **files;
    int nf;
    sp_err err = {0};
    cr_assert_eq(model_io_weight_files(model_dir, &files, &nf, &err), 0, "%s", err.msg);
    size_t seen = 0;
    for (int i = 0; i < nf; i++) {
        st_file f;
        cr_assert_eq(st_open(&f, tu_fmt("%s/%s", model_dir, files[i]), &err), 0, "%s", err.msg);
        for (size_t k = 0; k < f.n; k++, seen++)
            cr_expect_eq(f.tensors[k].dt, want, "%s: %s is %s, not %s", files[i],
                         f.tensors[k].name, dtype_name(f.tensors[k].dt), dtype_name(want));
        st_close(&f);
        free(files[i]);
    }
    free(files);
    cr_expect_gt(seen, 0);
}

static void check_card(const char *adapter_at, const char *targets_line, int dora)
{
    char adapter[4096];
    snprintf(adapter, sizeof adapter, "%s", adapter_at);
    char *card = tu_read_file(tu_fmt("%s/README.md", adapter), NULL);
    cr_assert(card, "%s/README.md is missing", adapter);
    char *front = sp_strf("---\nbase_model: \"%s\"\nlibrary_name: peft\n", at("base"));
    cr_expect(strncmp(card, front, strlen(front)) == 0, "front matter:\n%s", card);
    free(front);
    const char *want[] = {
        tu_fmt("- **Base model:** `%s`\n", at("base")),
        dora ? "- **Adapter:** DoRA (LoRA with a trained magnitude per output feature), r = 4, "
               "lora_alpha = 8 (scale 2, alpha / r), lora_dropout = 0, use_rslora = false, "
               "use_dora = true\n"
             : "- **Adapter:** LoRA, r = 4, lora_alpha = 8 (scale 2, alpha / r), "
               "lora_dropout = 0, use_rslora = false\n",
        targets_line,
        "- **Steps:** 6\n",
        tu_fmt("- **Training data:** `%s`\n", at("train.h5")),
        tu_fmt("- **Validation data:** `%s`\n", at("val.h5")),
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++)
        cr_expect(tu_contains(card, want[i]), "README.md lacks \"%s\":\n%s", want[i], card);
    /* the final losses are the last train and val records of the run */
    json_t *last_train = NULL, *last_val = NULL;
    char *metrics = tu_read_file(at("run/metrics.jsonl"), NULL);
    cr_assert(metrics);
    for (char *line = strtok(metrics, "\n"); line; line = strtok(NULL, "\n")) {
        json_t *o = json_loads(line, 0, NULL);
        const char *ev = json_string_value(json_object_get(o, "event"));
        json_t **slot = ev && !strcmp(ev, "train") ? &last_train : ev && !strcmp(ev, "val") ? &last_val : NULL;
        if (slot) {
            json_decref(*slot);
            *slot = o;
        } else {
            json_decref(o);
        }
    }
    cr_assert(last_train && last_val, "the run recorded no train or no val loss");
    char line[256];
    snprintf(line, sizeof line, "- **Final train loss:** %.4f (step %lld)\n",
             json_number_value(json_object_get(last_train, "loss")),
             (long long)json_integer_value(json_object_get(last_train, "step")));
    cr_expect(tu_contains(card, line), "README.md lacks \"%s\":\n%s", line, card);
    snprintf(line, sizeof line, "- **Final validation loss:** %.4f (step %lld)\n",
             json_number_value(json_object_get(last_val, "val_loss")),
             (long long)json_integer_value(json_object_get(last_val, "step")));
    cr_expect(tu_contains(card, line), "README.md lacks \"%s\":\n%s", line, card);
    json_decref(last_train), json_decref(last_val);
    free(metrics);
    free(card);
}

/* The whole check for one architecture (dora: the run trains DoRA, its
 * adapter holds use_dora and the magnitudes, the merge applies m / n). */
static void check_arch_dora(const char *name, int dora)
{
    model_config_t mc;
    sp_err err = {0};
    make_base(name);
    cr_assert_eq(model_config_load(&mc, at("base"), &err), 0, "%s", err.msg);
    make_data(mc.vocab);
    train("lora", "[q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]", dora);
    char ck[4096]; /* kept: at() reuses its buffers */
    snprintf(ck, sizeof ck, "%s", at("run/checkpoints/step-00000006"));
    char *out = NULL;
    int rc = tu_spotune(&out, "export %s --merged %s --peft %s", ck, at("merged"), at("peft"));
    cr_assert_eq(rc, 0, "%s", out);
    free(out);

    check_config(at("merged/config.json"), "float32");
    check_side_files(at("merged"));
    check_weights_dtype(at("merged"), DT_F32);
    check_card(at("peft"), "- **Target modules:** q_proj, k_proj, v_proj, o_proj, gate_proj, "
                           "up_proj, down_proj\n", dora);
    /* the run's own adapter/ has the same card */
    check_card(at("run/adapter"), "- **Target modules:** q_proj, k_proj, v_proj, o_proj, "
                                  "gate_proj, up_proj, down_proj\n", dora);
    json_t *acfg = load_json(at("peft/adapter_config.json"));
    cr_expect(json_is_boolean(json_object_get(acfg, "use_dora")) &&
                  json_is_true(json_object_get(acfg, "use_dora")) == !!dora,
              "%s: adapter_config.json use_dora is not %s", name, dora ? "true" : "false");
    json_decref(acfg);

    /* merged == base + adapter, in spotune, on the fixture's batch */
    size_t n, n2, n3;
    float *with = logits_of(case_dir("with-adapter", name, at("base"), at("peft")), 1, &n);
    float *merged = logits_of(case_dir("merged-case", name, at("merged"), NULL), 0, &n2);
    cr_assert_eq(n, n2);
    double e = tu_rel_err(merged, with, n);
    cr_expect_lt(e, LOGITS_TOL, "%s: merged logits differ from base + adapter: rel %g", name, e);
    float *plain = logits_of(case_dir("base-only", name, at("base"), NULL), 0, &n3);
    double moved = tu_rel_err(plain, with, n);
    cr_expect_gt(moved, MOVED_MIN, "%s: the adapter barely changed the logits (rel %g)", name,
                 moved);
    printf("%s: merged vs base + adapter logits rel %.3g (adapter moved them by %.3g)\n", name, e,
           moved);
    free(with), free(merged), free(plain);
}

static void check_arch(const char *name)
{
    check_arch_dora(name, 0);
}

Test(export_hf, llama_gqa) { check_arch("llama_gqa"); }
Test(export_hf, llama_gqa_dora) { check_arch_dora("llama_gqa", 1); }
Test(export_hf, qwen2_bias_dora) { check_arch_dora("qwen2_bias", 1); }
Test(export_hf, llama_tied_llama3) { check_arch("llama_tied_llama3"); }
Test(export_hf, qwen2_bias) { check_arch("qwen2_bias"); }
Test(export_hf, mistral_sliding_window_null) { check_arch("mistral"); }

/* A config.json as transformers writes it (the fixture's, untouched) comes
 * out byte for byte the same in the base's dtype, and with --dtype bf16 the
 * only line that differs is the dtype's. */
Test(export_hf, config_json_keeps_the_bases_bytes)
{
    const char *names[] = {"llama_gqa", "llama_tied_llama3", "qwen2_bias", "mistral"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        model_config_t mc;
        sp_err err = {0};
        const char *fx = fixture(tu_fmt("hf/%s/model", names[i]));
        cr_assert_eq(tu_sh(NULL, "rm -rf %s %s %s && cp -r %s %s", at("base"), at("run"),
                           at("m"), fx, at("base")),
                     0);
        cr_assert_eq(model_config_load(&mc, at("base"), &err), 0, "%s", err.msg);
        make_data(mc.vocab);
        train("lora", "[q_proj, v_proj]", 0);
        char *out = NULL;
        int rc = tu_spotune(&out, "export %s --merged %s", at("run/checkpoints/step-00000006"),
                            at("m"));
        cr_assert_eq(rc, 0, "%s", out);
        free(out);
        cr_expect_eq(tu_sh(&out, "cmp %s/config.json %s/config.json", fx, at("m")), 0,
                     "%s: config.json changed: %s", names[i], out);
        free(out);
        rc = tu_spotune(&out, "export %s --merged %s --dtype bf16",
                        at("run/checkpoints/step-00000006"), at("m"));
        cr_assert_eq(rc, 0, "%s", out);
        free(out);
        cr_assert_eq(tu_sh(&out, "diff %s/config.json %s/config.json | grep '^[<>]'", fx,
                           at("m")),
                     0);
        cr_expect_str_eq(out, "<   \"dtype\": \"float32\",\n>   \"dtype\": \"bfloat16\",\n",
                         "%s: the diff is more than the dtype", names[i]);
        free(out);
    }
}

/* Every tensor of model_dir (in dt) is the f32 merged model's (ref_dir)
 * rounded once to dt (round to nearest even, as dtype_convert does): the
 * bytes are equal. */
static void check_rounded(const char *model_dir, const char *ref_dir, dtype_t dt)
{
    st_file f, r;
    sp_err err = {0};
    cr_assert_eq(st_open(&f, tu_fmt("%s/model.safetensors", model_dir), &err), 0, "%s", err.msg);
    cr_assert_eq(st_open(&r, tu_fmt("%s/model.safetensors", ref_dir), &err), 0, "%s", err.msg);
    cr_expect_eq(f.n, r.n);
    for (size_t i = 0; i < r.n; i++) {
        const st_tensor *rt = &r.tensors[i], *t = st_find(&f, rt->name);
        cr_assert(t, "%s lacks %s", model_dir, rt->name);
        cr_assert_eq(rt->dt, DT_F32);
        cr_assert_eq(t->numel, rt->numel, "%s", rt->name);
        float *src = malloc(sizeof(float) * rt->numel);
        uint16_t *want = malloc(2 * rt->numel);
        memcpy(src, rt->data, sizeof(float) * rt->numel);
        cr_assert_eq(dtype_convert(want, dt, src, DT_F32, rt->numel), 0);
        cr_expect_eq(memcmp(want, t->data, 2 * rt->numel), 0,
                     "%s: not the f32 merged weights rounded to %s", rt->name, dtype_name(dt));
        free(src), free(want);
    }
    st_close(&f), st_close(&r);
}

/* Strings and numbers as Python's json.dumps writes them (python3 writes the
 * base's config.json here): non-ASCII, DEL and control characters escaped,
 * astral characters as surrogate pairs, reals in repr's shortest form; the
 * merged config.json is the same file byte for byte. */
Test(export_hf, config_json_strings_and_numbers_as_python_writes_them)
{
    const char *fx = fixture("hf/llama_gqa/model");
    cr_assert_eq(tu_sh(NULL, "cp -r %s %s", fx, at("base")), 0);
    char *out = NULL;
    int rc = tu_sh(&out,
                   "python3 -c 'import json, sys\n"
                   "p = sys.argv[1]\n"
                   "c = json.load(open(p))\n"
                   "c[\"_name_or_path\"] = \"mod\\u00e8le \\u6a21 \\x7f \\x01 \\U0001f600 \\\"q\\\" \\\\ / \\t\"\n"
                   "c[\"reals\"] = [1e-05, 1e16, 0.1, 123.456, -0.0, 5e-324, 1.7976931348623157e308, "
                   "100.0, 0.0001, 2.5e-07, 12345678901234567.0, 3.0e15]\n"
                   "c[\"nested\"] = {\"empty_list\": [], \"empty_obj\": {}, \"big\": 9007199254740993}\n"
                   "open(p, \"w\").write(json.dumps(c, indent=2, sort_keys=True) + \"\\n\")' %s",
                   at("base/config.json"));
    cr_assert_eq(rc, 0, "%s", out);
    free(out);
    model_config_t mc;
    sp_err err = {0};
    cr_assert_eq(model_config_load(&mc, at("base"), &err), 0, "%s", err.msg);
    make_data(mc.vocab);
    train("lora", "[q_proj]", 0);
    rc = tu_spotune(&out, "export %s --merged %s", at("run/checkpoints/step-00000006"), at("m"));
    cr_assert_eq(rc, 0, "%s", out);
    free(out);
    rc = tu_sh(&out, "diff %s %s", at("base/config.json"), at("m/config.json"));
    cr_expect_eq(rc, 0, "config.json changed:\n%s", out);
    free(out);
}

/* --dtype: every tensor and the config follow, each weight the f32 merged
 * weight rounded once; the logits stay near base + adapter's (a sanity
 * bound: bf16 keeps 8 significant bits, f16 11; measured 7.7e-3 and 2.1e-3
 * relative to the largest logit). */
static void check_dtype(const char *name, const char *opt, dtype_t dt, const char *torch_name,
                        double tol)
{
    model_config_t mc;
    sp_err err = {0};
    make_base(name);
    cr_assert_eq(model_config_load(&mc, at("base"), &err), 0, "%s", err.msg);
    make_data(mc.vocab);
    train("lora", "[q_proj, v_proj, down_proj]", 0);
    char ck[4096]; /* kept: at() reuses its buffers */
    snprintf(ck, sizeof ck, "%s", at("run/checkpoints/step-00000006"));
    char *out = NULL;
    int rc = tu_spotune(&out, "export %s --merged %s --peft %s --dtype %s", ck, at("m"), at("p"),
                        opt);
    cr_assert_eq(rc, 0, "%s", out);
    free(out);
    check_config(at("m/config.json"), torch_name);
    check_weights_dtype(at("m"), dt);
    check_side_files(at("m"));
    if (dt != DT_F32) {
        rc = tu_spotune(&out, "export %s --merged %s", ck, at("m32"));
        cr_assert_eq(rc, 0, "%s", out);
        free(out);
        check_weights_dtype(at("m32"), DT_F32); /* the default: the base's dtype */
        check_rounded(at("m"), at("m32"), dt);
    }
    size_t n, n2;
    float *with = logits_of(case_dir("with-adapter", name, at("base"), at("p")), 1, &n);
    float *merged = logits_of(case_dir("merged-case", name, at("m"), NULL), 0, &n2);
    double e = tu_rel_err(merged, with, n);
    cr_expect_lt(e, tol, "%s --dtype %s: rel %g", name, opt, e);
    printf("%s --dtype %s: merged vs base + adapter logits rel %.3g\n", name, opt, e);
    free(with), free(merged);
}

Test(export_hf, dtype_bf16) { check_dtype("llama_gqa", "bf16", DT_BF16, "bfloat16", 3e-2); }
Test(export_hf, dtype_f16) { check_dtype("qwen2_bias", "f16", DT_F16, "float16", 1e-2); }
Test(export_hf, dtype_f32) { check_dtype("llama_tied_llama3", "f32", DT_F32, "float32", LOGITS_TOL); }

/* Bad requests are refused by name and write nothing. */
Test(export_hf, bad_requests_are_refused)
{
    model_config_t mc;
    sp_err err = {0};
    make_base("llama_gqa");
    cr_assert_eq(model_config_load(&mc, at("base"), &err), 0, "%s", err.msg);
    make_data(mc.vocab);
    train("lora", "[q_proj, v_proj]", 0);
    char ck[4096]; /* kept: at() reuses its buffers */
    snprintf(ck, sizeof ck, "%s", at("run/checkpoints/step-00000006"));
    char *out = NULL;
    int rc = tu_spotune(&out, "export %s --merged %s --dtype f8", ck, at("bad"));
    cr_expect_eq(rc, 2, "%s", out);
    cr_expect(tu_contains(out, "--dtype") && tu_contains(out, "'f8'") && tu_contains(out, "bf16"),
              "%s", out);
    cr_expect(!exists(at("bad")), "a bad --dtype wrote %s", at("bad"));
    free(out);
    rc = tu_spotune(&out, "export %s --peft %s --dtype bf16", ck, at("bad"));
    cr_expect_eq(rc, 2, "%s", out);
    cr_expect(tu_contains(out, "--dtype") && tu_contains(out, "--merged"), "%s", out);
    cr_expect(!exists(at("bad")), "--dtype without --merged wrote %s", at("bad"));
    free(out);
    /* into the base directory itself: refused, the base untouched */
    char *before = NULL, *after = NULL;
    cr_assert_eq(tu_sh(&before, "cd %s && sha256sum *", at("base")), 0);
    rc = tu_spotune(&out, "export %s --merged %s", ck, at("base"));
    cr_expect_eq(rc, 2, "%s", out);
    cr_expect(tu_contains(out, at("base")) && tu_contains(out, "base model directory"), "%s", out);
    free(out);
    cr_assert_eq(tu_sh(&after, "cd %s && sha256sum *", at("base")), 0);
    cr_expect_str_eq(after, before, "the base changed");
    free(before), free(after);
}

/* A full fine-tune's RUN_DIR/model/ and its merged export: the base's
 * config.json but for the dtype, the tokenizer and generation files. */
Test(export_hf, full_fine_tune_model_dir)
{
    model_config_t mc;
    sp_err err = {0};
    make_base("mistral");
    cr_assert_eq(model_config_load(&mc, at("base"), &err), 0, "%s", err.msg);
    make_data(mc.vocab);
    train("full", "[q_proj]", 0);
    check_config(at("run/model/config.json"), "float32");
    check_side_files(at("run/model"));
    char *out = NULL;
    int rc = tu_spotune(&out, "export %s --merged %s --dtype bf16",
                        at("run/checkpoints/step-00000006"), at("full-bf16"));
    cr_assert_eq(rc, 0, "%s", out);
    free(out);
    check_config(at("full-bf16/config.json"), "bfloat16");
    check_weights_dtype(at("full-bf16"), DT_BF16);
    check_side_files(at("full-bf16"));
}

/* A full fine-tune whose model.path is its own RUN_DIR/model/ (a second
 * stage in the same directory) replaces the base in place at the end: the
 * config and tokenizer files survive, the weights are the trained ones. */
Test(export_hf, full_fine_tune_over_its_own_base)
{
    model_config_t mc;
    sp_err err = {0};
    make_base("qwen2_bias");
    cr_assert_eq(tu_sh(NULL, "mkdir -p %s && cp -r %s %s && cp -r %s %s", at("run"), at("base"),
                       at("run/model"), at("base"), at("orig")),
                 0);
    cr_assert_eq(model_config_load(&mc, at("base"), &err), 0, "%s", err.msg);
    make_data(mc.vocab);
    /* train() points model.path at DIR/base: point it at DIR/run/model instead */
    cr_assert_eq(tu_sh(NULL, "rm -rf %s && ln -s %s %s", at("base"), at("run/model"), at("base")),
                 0);
    train("full", "[q_proj]", 0);
    cr_assert_eq(tu_sh(NULL, "rm %s && cp -r %s %s", at("base"), at("orig"), at("base")), 0);
    check_config(at("run/model/config.json"), "float32");
    check_side_files_in(at("run/model"), 1);
    char *out = NULL;
    cr_expect_neq(tu_sh(&out, "cmp %s %s", at("orig/model.safetensors"),
                        at("run/model/model.safetensors")),
                  0, "the weights were not replaced by the trained ones");
    free(out);
}

/* spotune --help lists export's --model (and --dtype). */
Test(export_hf, help_lists_export_options)
{
    char *out = NULL;
    cr_assert_eq(tu_spotune(&out, "--help"), 0, "%s", out);
    const char *line = strstr(out, "export CHECKPOINT");
    cr_assert(line, "%s", out);
    const char *end = strstr(line, "bench");
    cr_assert(end);
    char *part = strndup(line, (size_t)(end - line));
    cr_expect(tu_contains(part, "--model") && tu_contains(part, "--dtype") &&
                  tu_contains(part, "--peft") && tu_contains(part, "--merged"),
              "%s", part);
    free(part);
    free(out);
}

/* The card's losses are the last numeric train and val records; a line cut
 * short (a killed writer) and a NaN loss (written as null) are skipped; no
 * val record or no metrics file says "none recorded". */
Test(export_hf, model_card_from_metrics)
{
    sp_err err = {0};
    const char *metrics = at("metrics.jsonl");
    cr_assert_eq(tu_write_file(metrics,
                               "{\"event\": \"train\", \"step\": 1, \"loss\": 4.5}\n"
                               "{\"event\": \"val\", \"step\": 1, \"val_loss\": 4.25}\n"
                               "{\"event\": \"train\", \"step\": 2, \"loss\": 3.125}\n"
                               "{\"event\": \"train\", \"step\": 3, \"loss\": null}\n"
                               "{\"event\": \"checkpoint\", \"step\": 3}\n"
                               "{\"event\": \"train\", \"step\": 4, \"lo"),
                 0);
    model_card card = {.base_model = "org/base-7b", .steps = 4, .train_data = "d/train.h5"};
    cr_assert_eq(model_card_read_metrics(&card, metrics, &err), 0, "%s", err.msg);
    cr_expect_eq(card.train_loss, 3.125);
    cr_expect_eq(card.train_loss_step, 2);
    cr_expect_eq(card.val_loss, 4.25);
    cr_expect_eq(card.val_loss_step, 1);
    model_opts o = {.mode = MODE_LORA, .lora_r = 16, .lora_alpha = 16, .lora_dropout = 0.05,
                    .rslora = 1, .lora_targets = TARGET_Q | TARGET_V};
    cr_assert_eq(model_card_write(dir, &o, &card, &err), 0, "%s", err.msg);
    char *text = tu_read_file(at("README.md"), NULL);
    const char *want[] = {"---\nbase_model: \"org/base-7b\"\nlibrary_name: peft\n",
                          "- \"base_model:adapter:org/base-7b\"\n",
                          "- **Adapter:** LoRA, r = 16, lora_alpha = 16 (scale 4, alpha / sqrt(r)), "
                          "lora_dropout = 0.05, use_rslora = true\n",
                          "- **Target modules:** q_proj, v_proj\n",
                          "- **Steps:** 4\n",
                          "- **Final train loss:** 3.1250 (step 2)\n",
                          "- **Final validation loss:** 4.2500 (step 1)\n",
                          "- **Training data:** `d/train.h5`\n",
                          "- **Validation data:** none\n"};
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++)
        cr_expect(tu_contains(text, want[i]), "README.md lacks \"%s\":\n%s", want[i], text);
    free(text);
    /* no metrics at all */
    cr_assert_eq(model_card_read_metrics(&card, at("no-such-metrics.jsonl"), &err), 0, "%s",
                 err.msg);
    cr_assert_eq(model_card_write(dir, &o, &card, &err), 0, "%s", err.msg);
    text = tu_read_file(at("README.md"), NULL);
    cr_expect(tu_contains(text, "- **Final train loss:** none recorded\n") &&
                  tu_contains(text, "- **Final validation loss:** none recorded\n"),
              "%s", text);
    free(text);
    cr_expect(!exists(at("README.md.tmp")));
}

/* spotune's NF4 round trip of w [n] (kernels/nf4.h): what a QLoRA run
 * computes with in place of w. */
static float *nf4_round_trip(const float *w, size_t n)
{
    size_t nb = nf4_blocks(n);
    uint8_t *codes = malloc(nf4_code_bytes(n)), *q = malloc(nb);
    float *absmax = malloc(sizeof(float) * nb), *nested = malloc(sizeof(float) * nf4_nested_blocks(n));
    float *deq = malloc(sizeof(float) * n);
    cr_assert(codes && q && absmax && nested && deq);
    nf4_quantize_codes(w, n, codes, absmax);
    float offset = nf4_absmax_offset(absmax, nb);
    nf4_quantize_absmax(absmax, nb, offset, nf4_dynamic_map, q, nested);
    nf4_dequantize_absmax(q, nested, nf4_dynamic_map, offset, nb, absmax);
    nf4_dequantize_codes(codes, absmax, nf4_quant_map, n, deq);
    free(codes), free(q), free(absmax), free(nested);
    return deq;
}

/* QLoRA (model.quantize nf4): --merged notes that the base is merged
 * dequantized and writes bf16 by default; in f32 a projection without an
 * adapter is exactly spotune's NF4 round trip of the base weight
 * (kernels/nf4.h), and one with an adapter that plus s B A of the --peft
 * export (float32 rounding of the sum: 1e-6 relative). --peft is as ever. */
Test(export_hf, qlora_merged_is_the_dequantized_base_plus_adapter)
{
    model_config_t mc;
    sp_err err = {0};
    cr_assert_eq(tu_sh(NULL, "cp -r %s %s", fixture("hf/llama_gqa/model"), at("base")), 0);
    cr_assert_eq(model_config_load(&mc, at("base"), &err), 0, "%s", err.msg);
    make_data(mc.vocab);
    free(train_q("lora", "[q_proj, v_proj]", 0, "nf4"));
    char *out = NULL;
    const char *ck = at("run/checkpoints/step-00000006");
    int rc = tu_spotune(&out, "export %s --merged %s --peft %s", ck, at("m"), at("peft"));
    cr_assert_eq(rc, 0, "%s", out);
    cr_expect(tu_contains(out, "differ from the unquantized base") && tu_contains(out, "BF16"),
              "%s", out);
    free(out);
    check_weights_dtype(at("m"), DT_BF16);
    rc = tu_spotune(&out, "export %s --merged %s --dtype f32", ck, at("m32"));
    cr_assert_eq(rc, 0, "%s", out);
    free(out);
    const char *names[] = {"model.layers.0.self_attn.k_proj.weight",
                           "model.layers.1.self_attn.q_proj.weight"};
    for (int t = 0; t < 2; t++) {
        size_t n, nm;
        float *w = tu_load_f32(at("base/model.safetensors"), names[t], &n);
        float *merged = tu_load_f32(at("m32/model.safetensors"), names[t], &nm);
        cr_assert(w && merged && n == nm, "%s", names[t]);
        float *deq = nf4_round_trip(w, n);
        if (t == 0) {
            cr_expect(memcmp(deq, merged, sizeof(float) * n) == 0,
                      "%s: not the NF4 round trip of the base", names[t]);
        } else {
            size_t na, nbm;
            float *A = tu_load_f32(at("peft/adapter_model.safetensors"),
                                   "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight", &na);
            float *B = tu_load_f32(at("peft/adapter_model.safetensors"),
                                   "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight", &nbm);
            cr_assert(A && B);
            size_t r = 4, in = na / r, outd = nbm / r;
            cr_assert_eq(in * outd, n);
            float *want = malloc(sizeof(float) * n);
            for (size_t o = 0; o < outd; o++)
                for (size_t i = 0; i < in; i++) {
                    double s = 0;
                    for (size_t k = 0; k < r; k++)
                        s += (double)B[o * r + k] * A[k * in + i];
                    want[o * in + i] = (float)(deq[o * in + i] + 2.0 * s); /* alpha 8 / r 4 */
                }
            double e = tu_rel_err(merged, want, n), moved = tu_rel_err(deq, want, n);
            cr_expect_lt(e, 1e-6, "%s: merged vs dequantized base + s B A: rel %g", names[t], e);
            cr_expect_gt(moved, 1e-4, "%s: the adapter barely moved the weight", names[t]);
            free(A), free(B), free(want);
        }
        free(w), free(merged), free(deq);
    }
}

/* QDoRA (model.quantize nf4 with lora.dora): trains through the binary
 * (the start-up log says so); --peft writes a DoRA adapter (use_dora, a
 * magnitude vector per target) and --merged in f32 has, for a target, each
 * row of W' + s B A (W' the NF4 round trip of the base) scaled to its
 * magnitude m[o] / ||row o|| as PEFT merges DoRA (1e-6 relative), and for
 * a projection without an adapter W' exactly. */
Test(export_hf, qdora_merged_is_the_dequantized_base_with_dora)
{
    model_config_t mc;
    sp_err err = {0};
    cr_assert_eq(tu_sh(NULL, "cp -r %s %s", fixture("hf/llama_gqa/model"), at("base")), 0);
    cr_assert_eq(model_config_load(&mc, at("base"), &err), 0, "%s", err.msg);
    make_data(mc.vocab);
    char *out = train_q("lora", "[q_proj, v_proj]", 1, "nf4");
    cr_expect(tu_contains(out, "QDoRA (DoRA on the NF4 base)"), "%s", out);
    free(out);
    const char *ck = at("run/checkpoints/step-00000006");
    int rc = tu_spotune(&out, "export %s --merged %s --dtype f32 --peft %s", ck, at("m32"),
                        at("peft"));
    cr_assert_eq(rc, 0, "%s", out);
    cr_expect(tu_contains(out, "differ from the unquantized base"), "%s", out);
    free(out);
    json_t *cfg = load_json(at("peft/adapter_config.json"));
    cr_expect(json_is_true(json_object_get(cfg, "use_dora")));
    json_decref(cfg);
    const char *pre = "base_model.model.model.layers.1.self_attn.q_proj.";
    size_t n, nm, na, nbm, nmag;
    float *w = tu_load_f32(at("base/model.safetensors"), "model.layers.1.self_attn.q_proj.weight", &n);
    float *merged = tu_load_f32(at("m32/model.safetensors"), "model.layers.1.self_attn.q_proj.weight",
                                &nm);
    float *A = tu_load_f32(at("peft/adapter_model.safetensors"), tu_fmt("%slora_A.weight", pre), &na);
    float *B = tu_load_f32(at("peft/adapter_model.safetensors"), tu_fmt("%slora_B.weight", pre), &nbm);
    float *mag = tu_load_f32(at("peft/adapter_model.safetensors"),
                             tu_fmt("%slora_magnitude_vector", pre), &nmag);
    cr_assert(w && merged && A && B && mag && n == nm);
    size_t r = 4, in = na / r, outd = nbm / r;
    cr_assert_eq(in * outd, n);
    cr_assert_eq(nmag, outd);
    float *deq = nf4_round_trip(w, n), *want = malloc(sizeof(float) * n);
    double *row = malloc(sizeof(double) * in);
    for (size_t o = 0; o < outd; o++) {
        double ss = 0;
        for (size_t i = 0; i < in; i++) {
            double s = 0;
            for (size_t k = 0; k < r; k++)
                s += (double)B[o * r + k] * A[k * in + i];
            row[i] = deq[o * in + i] + 2.0 * s; /* alpha 8 / r 4 */
            ss += row[i] * row[i];
        }
        for (size_t i = 0; i < in; i++)
            want[o * in + i] = (float)(row[i] * mag[o] / sqrt(ss));
    }
    double e = tu_rel_err(merged, want, n), moved = tu_rel_err(deq, want, n);
    cr_expect_lt(e, 1e-6, "merged vs m / ||W' + s B A|| (W' + s B A): rel %g", e);
    cr_expect_gt(moved, 1e-4, "the adapter barely moved the weight");
    free(w), free(merged), free(A), free(B), free(mag), free(deq), free(want), free(row);
    /* k_proj carries no adapter: the NF4 round trip of the base, exactly */
    w = tu_load_f32(at("base/model.safetensors"), "model.layers.0.self_attn.k_proj.weight", &n);
    merged = tu_load_f32(at("m32/model.safetensors"), "model.layers.0.self_attn.k_proj.weight", &nm);
    cr_assert(w && merged && n == nm);
    deq = nf4_round_trip(w, n);
    cr_expect(memcmp(deq, merged, sizeof(float) * n) == 0, "k_proj: not the NF4 round trip");
    free(w), free(merged), free(deq);
}

/* A QLoRA run on a pre-quantized bitsandbytes directory: --merged writes a
 * dense model (no quantization_config) whose non-target projections are
 * bitsandbytes' dequantized values exactly (f32). */
Test(export_hf, qlora_on_a_bitsandbytes_directory_merges_dense)
{
    model_config_t mc;
    sp_err err = {0};
    cr_assert_eq(tu_sh(NULL, "cp -r %s %s", fixture("nf4/llama_gqa_bnb"), at("base")), 0);
    cr_assert_eq(model_config_load(&mc, at("base"), &err), 0, "%s", err.msg);
    cr_assert(mc.bnb_nf4);
    make_data(mc.vocab);
    free(train_q("lora", "[q_proj, v_proj]", 0, "nf4"));
    char *out = NULL;
    int rc = tu_spotune(&out, "export %s --merged %s --dtype f32",
                        at("run/checkpoints/step-00000006"), at("m"));
    cr_assert_eq(rc, 0, "%s", out);
    free(out);
    json_t *cfg = load_json(at("m/config.json"));
    cr_expect_null(json_object_get(cfg, "quantization_config"));
    json_decref(cfg);
    cr_assert_eq(model_config_load(&mc, at("m"), &err), 0, "%s", err.msg);
    cr_expect(!mc.bnb_nf4);
    const char *name = "model.layers.0.self_attn.k_proj.weight";
    size_t n, nw;
    float *want = tu_load_f32(fixture("nf4/llama_gqa_qlora.safetensors"), tu_fmt("dequant.%s", name),
                              &n);
    float *got = tu_load_f32(at("m/model.safetensors"), name, &nw);
    cr_assert(want && got && n == nw);
    cr_expect(memcmp(want, got, sizeof(float) * n) == 0, "%s: not bnb's dequantized values", name);
    free(want);
    free(got);
}
