/* Bad inputs to `spotune train`, each through the binary on the tiny model:
 * weights (not finite, truncated or damaged safetensors, a data section that
 * is not the tensors back to back, unused, missing or misshapen tensors, an
 * unknown dtype), config.json (no file, unsupported architecture, rope
 * settings, a sliding window), datasets (a token beyond the vocabulary, no
 * tokens, a loss mask of another length), the run config and
 * SPOTUNE_CPU_SKINNY. Each ends with
 * a message naming the file, key or tensor and the problem, the documented
 * exit code, and no sanitizer report. */
#define _POSIX_C_SOURCE 200809L
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <hdf5.h>

#include "test_util.h"
#include "trainer/data.h"
#include "trainer/safetensors.h"

static char *dir;

static void setup(void)
{
    dir = tu_tiny_train_dir("train-inputs");
}

static void teardown(void)
{
    tu_rmtree(dir);
    free(dir);
}

TestSuite(train_inputs, .init = setup, .fini = teardown, .timeout = 600);

/* Runs training with extra --set arguments; returns the exit code. */
static int train(char **out, const char *sets)
{
    return tu_spotune(out, "train %s/base.yaml %s", dir, sets ? sets : "");
}

/* Expects train(sets) to exit with code, both strings in its output, and no
 * sanitizer report. */
static void expect_fail(const char *sets, int code, const char *want1, const char *want2)
{
    char *out = NULL;
    int rc = train(&out, sets);
    cr_expect_eq(rc, code, "exit %d (want %d): %s", rc, code, out);
    cr_expect(tu_contains(out, want1), "'%s' lacks '%s'", out, want1);
    cr_expect(tu_contains(out, want2), "'%s' lacks '%s'", out, want2);
    cr_expect(!tu_contains(out, "AddressSanitizer") && !tu_contains(out, "runtime error"), "%s", out);
    free(out);
}

/* expect_fail with model.path DIR/name */
static void expect_model_fail(const char *name, int code, const char *want1, const char *want2)
{
    expect_fail(tu_fmt("--set model.path=%s/%s", dir, name), code, want1, want2);
}

/* DIR/name: the tiny model's weights with its config.json edited by the sed
 * expression expr */
static void config_variant(const char *name, const char *expr)
{
    cr_assert_eq(tu_sh(NULL, "mkdir -p %s/%s && cp %s/model/model.safetensors %s/%s/ && sed '%s' "
                             "%s/model/config.json > %s/%s/config.json",
                       dir, name, dir, dir, name, expr, dir, dir, name),
                 0, "cannot make %s/%s", dir, name);
}

/* A copy of the tiny model whose model.safetensors is replaced by bytes. */
static void bad_model(const char *name, const void *bytes, size_t n)
{
    tu_sh(NULL, "mkdir -p %s/%s && cp %s/model/config.json %s/%s/", dir, name, dir, dir, name);
    char path[4096];
    snprintf(path, sizeof path, "%s/%s/model.safetensors", dir, name);
    FILE *f = fopen(path, "wb");
    fwrite(bytes, 1, n, f);
    fclose(f);
}

static void st_bytes(const char *header, unsigned char *buf, size_t *n, size_t data)
{
    uint64_t h = strlen(header);
    for (int i = 0; i < 8; i++)
        buf[i] = (unsigned char)(h >> (8 * i));
    memcpy(buf + 8, header, h);
    memset(buf + 8 + h, 0, data);
    *n = 8 + h + data;
}

/* A copy of the tiny model named name whose final norm's elements from
 * `at` are vals (n of them), in the file's dtype. */
static void poke_final_norm(const char *name, int at, const float *vals, int n)
{
    tu_sh(NULL, "mkdir -p %s/%s && cp %s/model/* %s/%s/", dir, name, dir, dir, name);
    char path[4096];
    snprintf(path, sizeof path, "%s/%s/model.safetensors", dir, name);
    tu_st_poke(path, "model.norm.weight", (size_t)at, vals, (size_t)n);
}

/* A weight that is not finite (a damaged file, or one saved from a run that
 * diverged) is refused at load, naming the file, the tensor, the first such
 * value and its element, and how many: exit 3, before any step. */
Test(train_inputs, a_weight_that_is_not_finite_is_refused_at_load)
{
    float vals[5] = {1.0f, 1.0f, NAN, 1.0f, INFINITY};
    poke_final_norm("nanw", 1, vals, 5);
    char sets[4096];
    snprintf(sets, sizeof sets, "--set model.path=%s/nanw --set run.dir=%s/nanrun", dir, dir);
    expect_fail(sets, 3, "nanw/model.safetensors: tensor 'model.norm.weight' holds 2 value(s) "
                         "that are not finite, the first nan at element 3 of",
                "damaged");
}

/* Weights that are finite but huge (the final norm at 3e38) overflow the
 * logits: step 1's loss is not finite, and the run stops there before any
 * update, exit 1, naming the step; no adapter is written. With and without
 * CUDA graphs. */
Test(train_inputs, a_loss_that_is_not_finite_stops_the_run_before_any_update)
{
    float huge[16];
    for (int i = 0; i < 16; i++)
        huge[i] = 3e38f;
    poke_final_norm("hugew", 0, huge, 16);
    for (int graphs = 0; graphs < 2; graphs++) {
        char sets[4096], path[4096];
        snprintf(sets, sizeof sets,
                 "--set model.path=%s/hugew --set run.dir=%s/hugerun%d "
                 "--set runtime.cuda_graphs=%s",
                 dir, dir, graphs, graphs ? "true" : "false");
        expect_fail(sets, 1, "step 1: the loss is not finite", "nothing was updated");
        snprintf(path, sizeof path, "%s/hugerun%d/adapter", dir, graphs);
        cr_expect_neq(access(path, F_OK), 0, "%s was written", path);
    }
}

/* SPOTUNE_CPU_SKINNY naming no choice: the CPU backend refuses it at the
 * start (exit 2), naming the variable, the value and the choices */
Test(train_inputs, a_cpu_skinny_value_that_names_no_choice_is_refused)
{
    setenv("SPOTUNE_CPU_SKINNY", "fast", 1);
    expect_fail(NULL, 2, "SPOTUNE_CPU_SKINNY=fast", "expected 0, 1, avx2 or avx512");
    unsetenv("SPOTUNE_CPU_SKINNY");
}

Test(train_inputs, model_dir_without_config_json)
{
    tu_sh(NULL, "mkdir -p %s/empty", dir);
    expect_model_fail("empty", 3, "empty/config.json", "missing");
}

Test(train_inputs, safetensors_truncated)
{
    tu_sh(NULL, "mkdir -p %s/trunc && cp %s/model/config.json %s/trunc/ && head -c 100000 "
                "%s/model/model.safetensors > %s/trunc/model.safetensors",
          dir, dir, dir, dir, dir);
    expect_model_fail("trunc", 3, "trunc/model.safetensors", "past the end of the file");
}

Test(train_inputs, safetensors_header_length_past_end)
{
    unsigned char buf[64] = {0xff, 0xff, 0xff, 0x0f, 0, 0, 0, 0, '{', '}'};
    bad_model("hlen", buf, 10);
    expect_model_fail("hlen", 3, "hlen/model.safetensors", "header length");
}

Test(train_inputs, safetensors_header_not_json)
{
    unsigned char buf[256];
    size_t n;
    st_bytes("{\"a\": [1, 2", buf, &n, 0);
    bad_model("notjson", buf, n);
    expect_model_fail("notjson", 3, "notjson/model.safetensors", "not valid JSON");
}

/* The data section as the format defines it: the tensors' byte ranges
 * follow one another with no overlap (one tensor read as another's bytes,
 * which the probe's lm_head pointed at the embeddings showed training on
 * silently), no gap and no trailing bytes; each refused naming the file and
 * the tensor. A zero-size tensor anywhere, and keys in any order, are fine. */
static int st_layout(const char *name, const char *header, size_t data, sp_err *err)
{
    unsigned char buf[512];
    size_t n;
    st_bytes(header, buf, &n, data);
    char path[4096];
    snprintf(path, sizeof path, "%s/%s.safetensors", dir, name);
    FILE *f = fopen(path, "wb");
    cr_assert(f && fwrite(buf, 1, n, f) == n);
    fclose(f);
    st_file st;
    int rc = st_open(&st, path, err);
    st_close(&st);
    return rc;
}

Test(train_inputs, safetensors_data_overlap_gap_or_trailing_bytes)
{
    static const struct {
        const char *name, *header;
        size_t data;
        const char *want;
    } bad[] = {
        {"overlap", "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                    "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}",
         12, "tensor 'b': data [4, 12) overlaps tensor 'a' (which ends at 8)"},
        {"same", "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                 "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}",
         8, "overlaps tensor"},
        {"gap", "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[12,20]}}",
         20, "tensor 'b': data [12, 20) leaves bytes [8, 12) that no tensor holds"},
        {"trailing", "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 16,
         "data ends at byte 8 of the 16 after the header"},
        {"nothing", "{\"__metadata__\":{\"format\":\"pt\"}}", 4, "4 bytes of data but no tensors"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        sp_err err = {0};
        cr_expect_eq(st_layout(bad[i].name, bad[i].header, bad[i].data, &err), SP_EXIT_INPUT,
                     "%s: %s", bad[i].name, err.msg);
        cr_expect(tu_contains(err.msg, tu_fmt("%s.safetensors", bad[i].name)) &&
                      tu_contains(err.msg, bad[i].want),
                  "%s: '%s' lacks '%s'", bad[i].name, err.msg, bad[i].want);
    }
    sp_err err = {0};
    cr_expect_eq(st_layout("fine",
                           "{\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,16]},"
                           "\"z\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[8,8]},"
                           "\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}",
                           16, &err),
                 0, "%s", err.msg);
    cr_expect_eq(st_layout("empty", "{}", 0, &err), 0, "%s", err.msg);
}

/* A model directory whose weights hold tensors the model (as config.json
 * describes it) does not read: a layer past num_hidden_layers and a q_proj
 * bias on an architecture without biases train as Hugging Face would, the
 * tensors ignored, and the start-up log and metrics.jsonl warn naming them
 * and their count; rotary_emb.inv_freq buffers (older checkpoints) are not
 * counted. The plain model gets no such warning. */
Test(train_inputs, unused_tensors_in_the_weights_are_named)
{
    char src[4096], dst[4096];
    snprintf(src, sizeof src, "%s/model/model.safetensors", dir);
    tu_sh(NULL, "mkdir -p %s/extra && cp %s/model/config.json %s/extra/", dir, dir, dir);
    snprintf(dst, sizeof dst, "%s/extra/model.safetensors", dir);
    st_file f;
    sp_err err = {0};
    cr_assert_eq(st_open(&f, src, &err), 0, "%s", err.msg);
    st_entry *e = calloc(f.n + 3, sizeof *e);
    for (size_t i = 0; i < f.n; i++) {
        e[i] = (st_entry){f.tensors[i].name, f.tensors[i].dt, f.tensors[i].ndim, {0}, f.tensors[i].data};
        memcpy(e[i].shape, f.tensors[i].shape, sizeof e[i].shape);
    }
    static const float extra[4] = {1, 2, 3, 4};
    const char *names[3] = {"model.layers.9.mlp.up_proj.weight", "model.layers.0.self_attn.q_proj.bias",
                            "model.layers.0.self_attn.rotary_emb.inv_freq"};
    for (int k = 0; k < 3; k++)
        e[f.n + k] = (st_entry){names[k], DT_F32, 1, {4}, extra};
    cr_assert_eq(st_write(dst, e, f.n + 3, NULL, 0, &err), 0, "%s", err.msg);
    free(e);
    st_close(&f);
    char *out = NULL;
    int rc = train(&out, tu_fmt("--set model.path=%s/extra --set train.steps=1 --set run.dir=%s/r-extra",
                                dir, dir));
    cr_expect_eq(rc, 0, "%s", out);
    cr_expect(tu_contains(out, "2 tensors of the weight files are not part of this model") &&
                  tu_contains(out, "model.layers.0.self_attn.q_proj.bias") &&
                  tu_contains(out, "model.layers.9.mlp.up_proj.weight") &&
                  !tu_contains(out, "inv_freq"),
              "%s", out);
    free(out);
    char *metrics = tu_read_file(tu_fmt("%s/r-extra/metrics.jsonl", dir), NULL);
    cr_expect(metrics && tu_contains(metrics, "\"event\":\"warning\"") &&
                  tu_contains(metrics, "model.layers.9.mlp.up_proj.weight"),
              "%s", metrics ? metrics : "no metrics.jsonl");
    free(metrics);
    rc = train(&out, tu_fmt("--set train.steps=1 --set run.dir=%s/r-plain", dir));
    cr_expect_eq(rc, 0, "%s", out);
    cr_expect(!tu_contains(out, "not part of this model"), "%s", out);
    free(out);
}

Test(train_inputs, safetensors_unknown_dtype)
{
    unsigned char buf[256];
    size_t n;
    st_bytes("{\"model.norm.weight\":{\"dtype\":\"Q7\",\"shape\":[2],\"data_offsets\":[0,8]}}", buf,
             &n, 8);
    bad_model("dtype", buf, n);
    expect_model_fail("dtype", 3, "dtype/model.safetensors", "unknown dtype 'Q7'");
}

Test(train_inputs, safetensors_tensor_missing)
{
    unsigned char buf[256];
    size_t n;
    st_bytes("{\"model.norm.weight\":{\"dtype\":\"F32\",\"shape\":[128],\"data_offsets\":[0,512]}}",
             buf, &n, 0);
    unsigned char *big = calloc(1, n + 512);
    memcpy(big, buf, n);
    bad_model("missing", big, n + 512);
    free(big);
    expect_model_fail("missing", 3, "model.embed_tokens.weight", "is missing");
}

Test(train_inputs, safetensors_wrong_shape)
{
    /* the real tiny model with config.json claiming a larger hidden size */
    config_variant("shape", "s/\"intermediate_size\": 448/\"intermediate_size\": 512/");
    expect_model_fail("shape", 3, "has shape [448, 128]", "config.json implies [512, 128]");
}

Test(train_inputs, unsupported_architecture_and_rope_refused_by_name)
{
    config_variant("arch", "s/LlamaForCausalLM/GPT2LMHeadModel/");
    expect_model_fail("arch", 3, "GPT2LMHeadModel", "not supported");
    config_variant("rope", "s/\"rope_scaling\": null/"
                           "\"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4}/");
    expect_model_fail("rope", 3, "rope type 'yarn'", "not supported");
}

/* config.json's rotary settings are checked at load, naming the key: a
 * rope_theta of 0 or below (every angle NaN: the run failed at step 1 on a
 * non-finite loss naming nothing) and a llama3 rope_scaling that lacks one of
 * the four numbers transformers requires (spotune took Llama 3.1's values
 * silently) or has them out of order; train and plan both refuse (exit 3).
 * A complete llama3 rope_scaling loads. */
Test(train_inputs, rope_settings_checked_by_key)
{
    static const struct {
        const char *name, *sed, *want;
    } bad[] = {
        {"theta0", "s/\"rope_theta\": 10000.0/\"rope_theta\": 0/",
         "rope_theta must be a positive number, not 0"},
        {"thetaneg", "s/\"rope_theta\": 10000.0/\"rope_theta\": -10000/",
         "rope_theta must be a positive number, not -10000"},
        {"l3bare", "s/\"rope_scaling\": null/\"rope_scaling\": {\"rope_type\": \"llama3\"}/",
         "rope_scaling (rope_type llama3) lacks factor"},
        {"l3nomax",
         "s/\"rope_scaling\": null/\"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 8, "
         "\"low_freq_factor\": 1, \"high_freq_factor\": 4}/",
         "lacks original_max_position_embeddings"},
        {"l3order",
         "s/\"rope_scaling\": null/\"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 8, "
         "\"low_freq_factor\": 4, \"high_freq_factor\": 1, \"original_max_position_embeddings\": 16}/",
         "rope_scaling (llama3) is out of range: factor 8, low_freq_factor 4, high_freq_factor 1"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        config_variant(bad[i].name, bad[i].sed);
        expect_model_fail(bad[i].name, 3, tu_fmt("%s/config.json", bad[i].name), bad[i].want);
        char *out = NULL;
        int rc = tu_spotune(&out, "plan %s/%s --gpu H100", dir, bad[i].name);
        cr_expect_eq(rc, 3, "plan %s: exit %d: %s", bad[i].name, rc, out);
        cr_expect(tu_contains(out, bad[i].want), "plan %s: %s", bad[i].name, out);
        free(out);
    }
    config_variant("l3", "s/\"rope_scaling\": null/\"rope_scaling\": {\"rope_type\": \"llama3\", "
                         "\"factor\": 8, \"low_freq_factor\": 1, \"high_freq_factor\": 4, "
                         "\"original_max_position_embeddings\": 16}/");
    char *out = NULL;
    int rc = train(&out, tu_fmt("--set model.path=%s/l3 --set train.steps=1 --set run.dir=%s/r-l3",
                                dir, dir));
    cr_expect_eq(rc, 0, "%s", out);
    free(out);
}

Test(train_inputs, sliding_window_shorter_than_seq_len_refused)
{
    config_variant("sw", "s/\"LlamaForCausalLM\"/\"MistralForCausalLM\"/; s/\"model_type\": "
                         "\"llama\"/\"model_type\": \"mistral\", \"sliding_window\": 16/");
    expect_model_fail("sw", 2, "sliding_window 16", "train.seq_len 32");
}

static void bad_dataset(const char *name, uint64_t n, uint32_t bad_token, uint64_t mask_n)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    uint32_t *tok = calloc(n + 1, sizeof *tok);
    uint8_t *msk = calloc(n + 1, 1);
    for (uint64_t i = 0; i < n; i++) {
        tok[i] = (uint32_t)(i % 200);
        msk[i] = 1;
    }
    if (n > 100)
        tok[100] = bad_token;
    uint64_t off[2] = {0, n};
    sp_err err = {0};
    cr_assert_eq(dataset_write(path, tok, msk, n, off, 1, 258, 257, "test", &err), 0, "%s", err.msg);
    if (mask_n != n) { /* rewrite /loss_mask with another length */
        hid_t f = H5Fopen(path, H5F_ACC_RDWR, H5P_DEFAULT);
        H5Ldelete(f, "/loss_mask", H5P_DEFAULT);
        hsize_t d = mask_n;
        hid_t s = H5Screate_simple(1, &d, NULL);
        hid_t ds = H5Dcreate2(f, "/loss_mask", H5T_STD_U8LE, s, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
        H5Dwrite(ds, H5T_NATIVE_UINT8, H5S_ALL, H5S_ALL, H5P_DEFAULT, msk);
        H5Dclose(ds);
        H5Sclose(s);
        H5Fclose(f);
    }
    free(tok);
    free(msk);
}

Test(train_inputs, dataset_token_not_below_vocab)
{
    bad_dataset("tok.h5", 1000, 300, 1000);
    expect_fail(tu_fmt("--set data.train=%s/tok.h5", dir), 3, "tok.h5", "token 300 at position 100 is not a token id of the model (0 to vocab_size - 1 = 259)");
}

Test(train_inputs, dataset_empty)
{
    bad_dataset("empty.h5", 0, 0, 0);
    expect_fail(tu_fmt("--set data.train=%s/empty.h5", dir), 3, "empty.h5", "empty");
}

Test(train_inputs, dataset_loss_mask_length_differs)
{
    bad_dataset("mask.h5", 1000, 5, 999);
    expect_fail(tu_fmt("--set data.val=%s/mask.h5", dir), 3, "mask.h5", "/loss_mask has 999 entries but /tokens has 1000");
}

Test(train_inputs, config_errors_exit_2)
{
    char path[4096], *base, text[8192];
    snprintf(path, sizeof path, "%s/base.yaml", dir);
    base = tu_read_file(path, NULL);
    snprintf(path, sizeof path, "%s/unknown.yaml", dir);
    snprintf(text, sizeof text, "%strain2:\n  x: 1\n", base);
    tu_write_file(path, text);
    char *out = NULL;
    cr_expect_eq(tu_spotune(&out, "train %s", path), 2);
    cr_expect(tu_contains(out, "unknown.yaml:") && tu_contains(out, "unknown section 'train2'"), "%s", out);
    free(out);
    expect_fail("--set train.stepz=3", 2, "--set", "unknown key 'train.stepz'");
    expect_fail("--set train.steps=ten", 2, "train.steps", "expected an integer");
    expect_fail("--set train.lr=-3e-4", 2, "train.lr", "out of range");
    expect_fail("--set runtime.backend=gpu", 2, "runtime.backend",
                "'gpu' is not one of: auto, cpu, cpu-ref, cuda");
    free(base);
}