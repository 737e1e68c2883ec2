/* Config loading: defaults, every type, --set overrides, the resolved YAML
 * round trip, and each bad input with the message naming file:line and key
 * and exit code 2. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"
#include "trainer/config.h"

static char *dir;

static void setup(void)
{
    dir = tu_tempdir("config");
    cr_assert(dir);
}

static void teardown(void)
{
    tu_rmtree(dir);
    free(dir);
}

TestSuite(config, .init = setup, .fini = teardown);

static const char *write_cfg(const char *name, const char *text)
{
    static char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    cr_assert_eq(tu_write_file(path, text), 0);
    return path;
}

static const char *good =
    "run:\n  dir: runs/x\n  seed: 7\n"
    "model:\n  path: m\n"
    "train:\n  mode: full\n  steps: 30\n  lr: 3e-4\n  schedule: linear\n  micro_batch: 2\n"
    "lora:\n  targets: [q_proj, down_proj]\n  rslora: true\n"
    "data:\n  train: d.h5\n";

Test(config, loads_every_type_over_the_defaults)
{
    config_t c;
    sp_err err = {0};
    config_defaults(&c);
    const char *p = write_cfg("good.yaml", good);
    cr_assert_eq(config_load(&c, p, &err), 0, "%s", err.msg);
    cr_assert_eq(config_validate(&c, &err), 0, "%s", err.msg);
    cr_expect_str_eq(c.run_dir, "runs/x");
    cr_expect_eq(c.seed, 7);
    cr_expect_eq(c.mode, MODE_FULL);
    cr_expect_eq(c.steps, 30);
    cr_expect_float_eq(c.lr, 3e-4, 1e-15);
    cr_expect_eq(c.schedule, SCHED_LINEAR);
    cr_expect_eq(c.lora_targets, TARGET_Q | TARGET_DOWN);
    cr_expect_eq(c.lora_rslora, 1);
    cr_expect_eq(c.grad_accum, 1, "default kept");
    cr_expect_eq(c.lora_r, 16, "default kept");
    config_free(&c);
}

Test(config, set_overrides_and_resolved_yaml_round_trips)
{
    config_t c, d;
    sp_err err = {0};
    config_defaults(&c);
    cr_assert_eq(config_load(&c, write_cfg("good.yaml", good), &err), 0);
    cr_assert_eq(config_set(&c, "train.steps=99", &err), 0, "%s", err.msg);
    cr_assert_eq(config_set(&c, "lora.targets=[v_proj,up_proj]", &err), 0, "%s", err.msg);
    cr_assert_eq(config_set(&c, "lora.targets=k_proj,o_proj", &err), 0, "%s", err.msg);
    cr_assert_eq(config_set(&c, "run.dir=with space: and colon", &err), 0, "%s", err.msg);
    cr_expect_eq(c.steps, 99);
    cr_expect_eq(c.lora_targets, TARGET_K | TARGET_O);
    char path[4096];
    snprintf(path, sizeof path, "%s/resolved.yaml", dir);
    FILE *f = fopen(path, "w");
    cr_assert_eq(config_write_yaml(&c, f, &err), 0);
    fclose(f);
    config_defaults(&d);
    cr_assert_eq(config_load(&d, path, &err), 0, "%s", err.msg);
    cr_expect_eq(config_math_hash(&c), config_math_hash(&d));
    cr_expect_str_eq(d.run_dir, "with space: and colon");
    cr_expect_eq(d.steps, 99);
    cr_expect_eq(d.lora_targets, TARGET_K | TARGET_O);
    cr_expect_float_eq(d.lr, c.lr, 0.0);
    /* harmless keys leave the math hash alone; math keys change it */
    cr_assert_eq(config_set(&d, "train.steps=5", &err), 0);
    cr_assert_eq(config_set(&d, "log.every=3", &err), 0);
    cr_expect_eq(config_math_hash(&c), config_math_hash(&d));
    cr_assert_eq(config_set(&d, "lora.r=8", &err), 0);
    cr_expect_neq(config_math_hash(&c), config_math_hash(&d));
    config_free(&c);
    config_free(&d);
}

/* text written to file name, loaded and validated: the exit code (0: valid) */
static int load_and_validate(const char *name, const char *text, sp_err *err)
{
    config_t c;
    config_defaults(&c);
    int rc = config_load(&c, write_cfg(name, text), err);
    if (!rc)
        rc = config_validate(&c, err);
    config_free(&c);
    return rc;
}

static void expect_valid(const char *text)
{
    sp_err err = {0};
    int rc = load_and_validate("good.yaml", text, &err);
    cr_expect_eq(rc, 0, "rc %d (%s) for: %s", rc, err.msg, text);
}

static void expect_error(const char *text, const char *want1, const char *want2)
{
    sp_err err = {0};
    int rc = load_and_validate("bad.yaml", text, &err);
    cr_expect_eq(rc, SP_EXIT_USAGE, "rc %d for: %s", rc, text);
    cr_expect(tu_contains(err.msg, want1), "message '%s' lacks '%s'", err.msg, want1);
    cr_expect(tu_contains(err.msg, want2), "message '%s' lacks '%s'", err.msg, want2);
}

Test(config, unknown_key_names_file_line_and_key)
{
    expect_error("run:\n  dir: x\ntrain:\n  stepz: 3\n", "bad.yaml:4", "train.stepz");
}

/* A config is one YAML document: a second one (after ---) would have its
 * keys ignored (the first document's train.steps trained, not the second's),
 * so it is refused naming the file and its line. A document that opens
 * with --- and closes with ... is one document. */
Test(config, a_second_yaml_document_is_refused)
{
    const char *base = "run:\n  dir: x\nmodel:\n  path: m\ndata:\n  train: d\n";
    char text[512];
    snprintf(text, sizeof text, "%s---\ntrain:\n  steps: 1\n", base);
    expect_error(text, "bad.yaml:7", "a second YAML document");
    snprintf(text, sizeof text, "---\n%s...\n", base);
    expect_valid(text);
}

/* YAML keys are unique: a repeated key or section is refused with the
 * file:line of both, never resolved silently (last value wins). */
Test(config, duplicate_key_or_section_names_both_lines)
{
    expect_error("run:\n  dir: x\ntrain:\n  lr: 1e-4\n  steps: 3\n  lr: 3e-4\n",
                 "bad.yaml:6: key 'train.lr' appears again", "first at " );
    expect_error("run:\n  dir: x\ntrain:\n  lr: 1e-4\n  steps: 3\n  lr: 3e-4\n",
                 "bad.yaml:6", "bad.yaml:4");
    expect_error("train:\n  steps: 3\nrun:\n  dir: x\ntrain:\n  lr: 3e-4\n",
                 "bad.yaml:5: section 'train' appears again", "(first at ");
    expect_error("train:\n  steps: 3\nrun:\n  dir: x\ntrain:\n  lr: 3e-4\n", "bad.yaml:5",
                 "bad.yaml:1");
    expect_error("lora: {r: 8, alpha: 16, r: 4}\n", "key 'lora.r' appears again", "bad.yaml:1");
}

Test(config, unknown_section)
{
    expect_error("run:\n  dir: x\ntraining:\n  steps: 3\n", "bad.yaml:3", "training");
}

Test(config, wrong_type)
{
    expect_error("train:\n  steps: many\n", "bad.yaml:2", "train.steps: expected an integer");
    expect_error("train:\n  lr: \"0.1\"\n", "bad.yaml:2", "train.lr: expected a number");
    expect_error("lora:\n  rslora: maybe\n", "bad.yaml:2", "lora.rslora");
    expect_error("lora:\n  targets: {a: 1}\n", "bad.yaml:2", "lora.targets");
}

Test(config, negative_lr_is_out_of_range)
{
    expect_error("train:\n  lr: -0.001\n", "bad.yaml:2", "train.lr: -0.001 is out of range");
}

Test(config, bad_choice_and_bad_target)
{
    expect_error("train:\n  schedule: cosin\n", "bad.yaml:2", "not one of: cosine, linear, constant");
    expect_error("lora:\n  targets: [q_proj, qkv_proj]\n", "bad.yaml:2", "unknown target 'qkv_proj'");
}

Test(config, yaml_syntax_error_has_a_position)
{
    expect_error("train:\n  steps: [1, 2\n", "bad.yaml:", "YAML error");
}

Test(config, missing_required_keys_and_cross_checks)
{
    expect_error("run:\n  dir: x\nmodel:\n  path: m\n", "bad.yaml", "data.train is required");
    expect_error("run:\n  dir: x\nmodel:\n  path: m\ndata:\n  train: d\ntrain:\n  lr: 1e-4\n  "
                 "min_lr: 1e-3\n",
                 "train.min_lr", "larger than train.lr");
}

/* lora.dora: a math key (a resume that changes it is refused by name), off
 * leaves the hash of the configs that predate it; refused with full
 * fine-tuning, valid on the CUDA backend. */
Test(config, dora_is_a_math_key_and_its_refusals_name_it)
{
    config_t c, d;
    sp_err err = {0};
    config_defaults(&c);
    config_defaults(&d);
    cr_expect_eq(c.lora_dora, 0);
    uint64_t off = config_math_hash(&c);
    cr_assert_eq(config_set(&d, "lora.dora=false", &err), 0, "%s", err.msg);
    cr_expect_eq(config_math_hash(&d), off);
    cr_assert_eq(config_set(&d, "lora.dora=true", &err), 0, "%s", err.msg);
    cr_expect_eq(d.lora_dora, 1);
    cr_expect_neq(config_math_hash(&d), off);
    char diff[512];
    cr_expect_eq(config_diff_math(&c, &d, NULL, diff, sizeof diff), 1);
    cr_expect(tu_contains(diff, "lora.dora (false, now true)"), "%s", diff);
    /* a key skipped is not listed (a moved data.train is checked by contents) */
    cr_expect_eq(config_diff_math(&c, &d, "lora.dora", diff, sizeof diff), 0, "%s", diff);
    cr_expect_eq(diff[0], 0, "%s", diff);
    config_free(&c);
    config_free(&d);
    const char *base = "run:\n  dir: x\nmodel:\n  path: m\ndata:\n  train: d\n";
    char text[512];
    snprintf(text, sizeof text, "%strain:\n  mode: full\nlora:\n  dora: true\n", base);
    expect_error(text, "lora.dora", "needs train.mode lora");
    expect_error("lora:\n  dora: sometimes\n", "bad.yaml:2", "lora.dora");
    snprintf(text, sizeof text, "%slora:\n  dora: true\nruntime:\n  backend: cuda\n", base);
    expect_valid(text); /* DoRA on CUDA (tests/test_cuda_model.c) */
}

/* model.quantize: a math key (a resume that changes it is refused by name),
 * none leaves the hash of the configs that predate it; nf4 refused with full
 * fine-tuning, an unknown value named; valid with DoRA (QDoRA) and on the CUDA
 * backend. */
Test(config, quantize_is_a_math_key_and_its_refusals_name_it)
{
    config_t c, d;
    sp_err err = {0};
    config_defaults(&c);
    config_defaults(&d);
    cr_expect_eq(c.model_quantize, QUANT_NONE);
    uint64_t none = config_math_hash(&c);
    cr_assert_eq(config_set(&d, "model.quantize=none", &err), 0, "%s", err.msg);
    cr_expect_eq(config_math_hash(&d), none);
    cr_assert_eq(config_set(&d, "model.quantize=nf4", &err), 0, "%s", err.msg);
    cr_expect_eq(d.model_quantize, QUANT_NF4);
    cr_expect_neq(config_math_hash(&d), none);
    char diff[512];
    cr_expect_eq(config_diff_math(&c, &d, NULL, diff, sizeof diff), 1);
    cr_expect(tu_contains(diff, "model.quantize (none, now nf4)"), "%s", diff);
    config_free(&c);
    config_free(&d);
    const char *base = "run:\n  dir: x\nmodel:\n  path: m\n  quantize: nf4\ndata:\n  train: d\n";
    char text[512];
    snprintf(text, sizeof text, "%strain:\n  mode: full\n", base);
    expect_error(text, "model.quantize nf4", "needs train.mode lora");
    snprintf(text, sizeof text, "%slora:\n  dora: true\n", base);
    expect_valid(text); /* QDoRA: DoRA on the NF4 base (tests/test_nf4.c) */
    snprintf(text, sizeof text, "%sruntime:\n  backend: cuda\n", base);
    expect_valid(text); /* QLoRA on CUDA (tests/test_cuda_model.c) */
    expect_error("model:\n  quantize: int8\n", "bad.yaml:2", "model.quantize");
}

Test(config, missing_file)
{
    config_t c;
    sp_err err = {0};
    config_defaults(&c);
    cr_expect_eq(config_load(&c, "/nonexistent/x.yaml", &err), SP_EXIT_USAGE);
    cr_expect(tu_contains(err.msg, "/nonexistent/x.yaml"));
    config_free(&c);
}

Test(config, bad_set_assignments)
{
    config_t c;
    sp_err err = {0};
    config_defaults(&c);
    cr_expect_eq(config_set(&c, "train.nope=1", &err), SP_EXIT_USAGE);
    cr_expect(tu_contains(err.msg, "train.nope"));
    sp_err_clear(&err);
    cr_expect_eq(config_set(&c, "train.lr", &err), SP_EXIT_USAGE);
    sp_err_clear(&err);
    cr_expect_eq(config_set(&c, "train.lr=-1", &err), SP_EXIT_USAGE);
    cr_expect(tu_contains(err.msg, "--set"), "%s", err.msg);
    config_free(&c);
}

/* configs/README.md carries the reference table that the schema prints. */
Test(config, reference_in_configs_readme_is_current)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/reference.md", dir);
    FILE *f = fopen(path, "w");
    config_write_reference(f);
    fclose(f);
    char *want = tu_read_file(path, NULL), *readme = tu_read_file(SPOTUNE_SOURCE_DIR "/configs/README.md", NULL);
    cr_assert(want && readme);
    cr_expect(tu_contains(readme, want),
              "configs/README.md is out of date: regenerate its table with spotune config-reference");
    free(want);
    free(readme);
}

/* Every shipped config parses and validates. */
Test(config, shipped_configs_are_valid)
{
    const char *names[] = {"tiny-cpu", "llama-7b-lora", "llama-13b-lora", "llama-7b-lora-multinode",
                           "tinyllama-1b-full", "llama-7b-full"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        char path[4096];
        config_t c;
        sp_err err = {0};
        snprintf(path, sizeof path, "%s/configs/%s.yaml", SPOTUNE_SOURCE_DIR, names[i]);
        config_defaults(&c);
        cr_expect_eq(config_load(&c, path, &err), 0, "%s", err.msg);
        cr_expect_eq(config_validate(&c, &err), 0, "%s", err.msg);
        config_free(&c);
    }
}
