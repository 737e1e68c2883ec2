/* Model directories and parameters: sharded safetensors round trips, BF16
 * and F16 weights, PEFT's LoRA initialisation, the frozen base kept out of
 * the optimizer, weight decay skipping norms and biases, the learning-rate
 * schedules and gradient clipping. */
#define _POSIX_C_SOURCE 200809L
#include <criterion/criterion.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "test_util.h"
#include "trainer/model.h"
#include "trainer/model_io.h"
#include "trainer/optim.h"

static char *dir;
static backend_t *be;

static void setup(void)
{
    dir = tu_tempdir("modelio");
    sp_err err = {0};
    cr_assert_eq(backend_create(&be, "cpu", 0, 2, &err), 0);
}

static void teardown(void)
{
    backend_destroy(be);
    tu_rmtree(dir);
    free(dir);
}

TestSuite(model_io, .init = setup, .fini = teardown);

static model_t *tiny(int mode, int64_t targets)
{
    model_config_t mc;
    cr_assert_eq(model_config_preset(&mc, "tiny"), 0);
    mc.bias[PROJ_Q] = mc.bias[PROJ_K] = mc.bias[PROJ_V] = 1; /* as Qwen2 */
    model_opts o = {.mode = mode, .lora_r = 4, .lora_alpha = 8, .lora_targets = targets,
                    .max_batch = 1, .seq_len = 4, .seed = 3};
    model_t *m;
    sp_err err = {0};
    cr_assert_eq(model_create(&m, be, &mc, &o, &err), 0, "%s", err.msg);
    return m;
}

static float *values(model_t *m, const param_t *p)
{
    float *v = malloc(sizeof(float) * p->n);
    model_param_download(m, p, v);
    return v;
}

Test(model_io, sharded_round_trip_in_f32_and_bf16)
{
    model_t *a = tiny(MODE_LORA, 0);
    model_init_base_random(a, 11);
    sp_err err = {0};
    char sharded[4096], bf[4096];
    snprintf(sharded, sizeof sharded, "%s/sharded", dir);
    snprintf(bf, sizeof bf, "%s/bf16", dir);
    /* 300 kB shards: the ~4 MB model spreads over many files and an index */
    cr_assert_eq(model_io_save(a, sharded, DT_F32, 0, 300000, &err), 0, "%s", err.msg);
    cr_assert_eq(model_io_save(a, bf, DT_BF16, 0, (size_t)1 << 30, &err), 0, "%s", err.msg);
    char **files;
    int nf;
    cr_assert_eq(model_io_weight_files(sharded, &files, &nf, &err), 0, "%s", err.msg);
    cr_expect_gt(nf, 5, "%d shards", nf);
    for (int i = 0; i < nf; i++)
        free(files[i]);
    free(files);
    dtype_t dt;
    cr_assert_eq(model_io_weights_dtype(bf, &dt, &err), 0);
    cr_expect_eq(dt, DT_BF16);
    model_t *b = tiny(MODE_LORA, 0), *c = tiny(MODE_LORA, 0);
    cr_assert_eq(model_io_load_base(b, sharded, &err), 0, "%s", err.msg);
    cr_assert_eq(model_io_load_base(c, bf, &err), 0, "%s", err.msg);
    for (int i = 0; i < a->nparams; i++) {
        float *va = values(a, &a->params[i]), *vb = values(b, &b->params[i]),
              *vc = values(c, &c->params[i]);
        cr_expect_eq(memcmp(va, vb, sizeof(float) * a->params[i].n), 0, "%s differs after shards",
                     a->params[i].name);
        for (size_t j = 0; j < a->params[i].n; j++)
            cr_assert_eq(vc[j], sp_bf16_to_f32(sp_f32_to_bf16(va[j])), "%s[%zu] bf16",
                         a->params[i].name, j);
        free(va), free(vb), free(vc);
    }
    /* the identity of a model changes with its bytes */
    char id1[17], id2[17];
    cr_assert_eq(model_io_identity(sharded, id1, &err), 0);
    cr_assert_eq(model_io_identity(bf, id2, &err), 0);
    cr_expect_str_neq(id1, id2);
    model_destroy(a), model_destroy(b), model_destroy(c);
}

Test(model_io, f16_weights_load)
{
    model_t *a = tiny(MODE_LORA, 0);
    model_init_base_random(a, 12);
    sp_err err = {0};
    char d[4096];
    snprintf(d, sizeof d, "%s/f16", dir);
    cr_assert_eq(model_io_save(a, d, DT_F32, 0, (size_t)1 << 30, &err), 0);
    /* rewrite the weights as F16 */
    char path[4200];
    snprintf(path, sizeof path, "%s/model.safetensors", d);
    st_file f;
    cr_assert_eq(st_open(&f, path, &err), 0);
    size_t nt = f.n;
    st_entry *e = calloc(nt, sizeof *e);
    uint16_t **bufs = calloc(nt, sizeof *bufs);
    for (size_t i = 0; i < f.n; i++) {
        bufs[i] = malloc(2 * f.tensors[i].numel);
        dtype_convert(bufs[i], DT_F16, f.tensors[i].data, DT_F32, f.tensors[i].numel);
        e[i] = (st_entry){f.tensors[i].name, DT_F16, f.tensors[i].ndim,
                          {f.tensors[i].shape[0], f.tensors[i].shape[1]}, bufs[i]};
    }
    char out[4300];
    snprintf(out, sizeof out, "%s.new", path);
    cr_assert_eq(st_write(out, e, f.n, NULL, 0, &err), 0);
    st_close(&f);
    rename(out, path);
    model_t *b = tiny(MODE_LORA, 0);
    cr_assert_eq(model_io_load_base(b, d, &err), 0, "%s", err.msg);
    float *va = values(a, b->embed), *vb = values(b, b->embed);
    for (size_t j = 0; j < b->embed->n; j++)
        cr_assert_lt(fabsf(va[j] - vb[j]), 1e-3f * fabsf(va[j]) + 1e-7f);
    free(va), free(vb);
    /* an F16 model is written back in F16 (the input layout and dtype) */
    dtype_t dt;
    cr_assert_eq(model_io_weights_dtype(d, &dt, &err), 0, "%s", err.msg);
    cr_expect_eq(dt, DT_F16);
    const char *d2 = tu_fmt("%s/f16-out", dir);
    cr_assert_eq(model_io_save(b, d2, dt, 0, (size_t)1 << 30, &err), 0, "%s", err.msg);
    cr_assert_eq(st_open(&f, tu_fmt("%s/model.safetensors", d2), &err), 0, "%s", err.msg);
    for (size_t i = 0; i < f.n; i++)
        cr_expect_eq(f.tensors[i].dt, DT_F16, "%s", f.tensors[i].name);
    st_close(&f);
    char *cfg = tu_read_file(tu_fmt("%s/config.json", d2), NULL);
    cr_expect(tu_contains(cfg, "\"float16\""), "%s", cfg);
    free(cfg);
    for (size_t i = 0; i < nt; i++)
        free(bufs[i]);
    free(bufs), free(e);
    model_destroy(a), model_destroy(b);
}

Test(model_io, lora_initialisation_follows_peft)
{
    model_t *m = tiny(MODE_LORA, (1 << PROJ_COUNT) - 1);
    model_init_lora(m, 5);
    size_t lora = 0;
    for (int i = 0; i < m->nparams; i++) {
        param_t *p = &m->params[i];
        if (p->kind == PK_LORA_B) {
            float *v = values(m, p);
            for (size_t j = 0; j < p->n; j++)
                cr_assert_eq(v[j], 0.0f, "%s is not zero", p->name);
            free(v);
        }
        if (p->kind == PK_LORA_A) {
            /* Kaiming-uniform with a = sqrt(5): U(-1/sqrt(in), 1/sqrt(in)) */
            float bound = 1.0f / sqrtf((float)p->shape[1]), *v = values(m, p);
            double s = 0, ss = 0;
            for (size_t j = 0; j < p->n; j++) {
                cr_assert(fabsf(v[j]) <= bound, "%s[%zu] = %g outside +-%g", p->name, j, v[j], bound);
                s += v[j];
                ss += (double)v[j] * v[j];
            }
            double var = ss / p->n, want = (double)bound * bound / 3.0;
            cr_expect_lt(fabs(var - want), 0.25 * want, "%s variance %g vs %g", p->name, var, want);
            free(v);
        }
        if (p->kind == PK_LORA_A || p->kind == PK_LORA_B)
            lora += p->n;
        else
            cr_expect(!p->trainable, "%s is frozen base and must not be trainable", p->name);
    }
    /* the optimizer state covers the adapters only */
    cr_expect_eq(m->n_trainable, lora);
    cr_expect_float_eq(m->lora_scale, 2.0f, 0.0f, "alpha / r");
    model_destroy(m);
}

Test(model_io, weight_decay_skips_norms_and_biases)
{
    model_t *m = tiny(MODE_FULL, 0);
    model_init_base_random(m, 6);
    for (int i = 0; i < m->nparams; i++) /* biases and norms non-zero so decay would show */
        if (m->params[i].kind == PK_BIAS || m->params[i].kind == PK_NORM) {
            float *v = calloc(m->params[i].n, sizeof(float));
            for (size_t j = 0; j < m->params[i].n; j++)
                v[j] = 0.5f;
            model_param_upload(m, &m->params[i], v, DT_F32);
            free(v);
        }
    model_zero_grads(m);
    float *before = malloc(sizeof(float) * m->n_trainable), *after = malloc(sizeof(float) * m->n_trainable);
    be_download(be, before, DT_F32, m->master);
    adamw_args a = {.lr = 0.1f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .weight_decay = 0.5f,
                    .grad_scale = 1.0f, .step = 1};
    model_adamw(m, &a);
    be_download(be, after, DT_F32, m->master);
    for (int i = 0; i < m->nparams; i++) {
        param_t *p = &m->params[i];
        float b0 = before[p->offset], a0 = after[p->offset];
        if (p->kind == PK_NORM || p->kind == PK_BIAS)
            cr_expect_eq(a0, b0, "%s decayed", p->name);
        else
            cr_expect_float_eq(a0, b0 * (1.0f - 0.05f), 1e-7f, "%s not decayed", p->name);
    }
    free(before), free(after);
    model_destroy(m);
}

Test(model_io, schedules_and_clipping)
{
    config_t c;
    config_defaults(&c);
    c.lr = 1e-3;
    c.min_lr = 1e-4;
    c.steps = 110;
    c.warmup_steps = 10;
    c.schedule = SCHED_COSINE;
    cr_expect_float_eq(optim_lr(&c, 0), 1e-4, 1e-12, "warmup starts at lr / warmup");
    cr_expect_float_eq(optim_lr(&c, 9), 1e-3, 1e-12, "warmup ends at lr");
    cr_expect_float_eq(optim_lr(&c, 10), 1e-3, 1e-12, "decay starts at lr");
    cr_expect_float_eq(optim_lr(&c, 109), 1e-4, 1e-12, "ends at min_lr");
    double mid = optim_lr(&c, 59); /* progress 49/99: cos(0.495 pi) ~ 0.016 */
    cr_expect_lt(fabs(mid - (1e-3 + 1e-4) / 2), 2e-5, "cosine halfway %g", mid);
    c.schedule = SCHED_LINEAR;
    cr_expect_float_eq(optim_lr(&c, 109), 1e-4, 1e-12);
    cr_expect_float_eq(optim_lr(&c, 10 + 99 / 3), 1e-3 - (1e-3 - 1e-4) * 33.0 / 99.0, 1e-12);
    c.schedule = SCHED_CONSTANT;
    cr_expect_float_eq(optim_lr(&c, 80), 1e-3, 1e-12);
    cr_expect_float_eq(optim_clip_scale(0.5, 1.0), 1.0, 0.0);
    cr_expect_float_eq(optim_clip_scale(4.0, 1.0), 1.0 / (4.0 + 1e-6), 1e-12);
    cr_expect_float_eq(optim_clip_scale(4.0, 0.0), 1.0, 0.0, "0 disables clipping");
    config_free(&c);
}

/* The memory plan of full fine-tuning a 7B model at seq_len 2048 with layer
 * recomputation: every rank holding the optimizer needs more than an 80 GB
 * card; sharded over 8 ranks the trainable state is 6 + 16/8 bytes per
 * weight and the run fits. */
/* The sharded optimizer is full fine-tuning's (the trainer shards only
 * there); a LoRA model asked to shard is refused by name, not built half
 * right (its compute copy would be a dtype the LoRA init cannot write). */
Test(model_io, a_sharded_lora_model_is_refused)
{
    sp_err err = {0};
    model_config_t mc;
    cr_assert_eq(model_config_preset(&mc, "tiny"), 0);
    model_opts o = {.mode = MODE_LORA, .lora_r = 4, .lora_alpha = 8, .lora_targets = 127,
                    .max_batch = 1, .seq_len = 8, .seed = 1, .shard_count = 2, .shard_rank = 0};
    model_t *m = (model_t *)1;
    cr_expect_eq(model_create(&m, be, &mc, &o, &err), SP_EXIT_USAGE);
    cr_expect_null(m);
    cr_expect(strstr(err.msg, "sharded optimizer") && strstr(err.msg, "train.mode full"), "%s",
              err.msg);
}

/* Random initialisation with the optimizer sharded: each rank's F32
 * masters are the unsharded model's values over its range, bit for bit
 * (drawn again at the shard's counters, never copied from the compute copy,
 * which on a GPU holds them rounded to bf16); and its compute copy is the
 * whole model's. 3 ranks: shards that start and end inside tensors. */
Test(model_io, a_sharded_random_init_draws_the_same_masters)
{
    sp_err err = {0};
    model_config_t mc;
    cr_assert_eq(model_config_preset(&mc, "tiny"), 0);
    model_opts o = {.mode = MODE_FULL, .max_batch = 1, .seq_len = 8, .seed = 1};
    model_t *whole, *part;
    cr_assert_eq(model_create(&whole, be, &mc, &o, &err), 0, "%s", err.msg);
    model_init_base_random(whole, 11);
    float *want = tu_download(be, whole->master); /* in F32 the weights are the masters */
    for (int r = 0; r < 3; r++) {
        o.shard_count = 3;
        o.shard_rank = r;
        cr_assert_eq(model_create(&part, be, &mc, &o, &err), 0, "%s", err.msg);
        model_init_base_random(part, 11);
        size_t n = part->shard_lo + part->shard_len > whole->n_trainable
                       ? whole->n_trainable - part->shard_lo
                       : part->shard_len;
        float *got = tu_download(be, part->master), *copy = tu_download(be, part->copy);
        cr_expect_eq(memcmp(got, want + part->shard_lo, n * sizeof(float)), 0,
                     "rank %d: masters differ from the whole model's", r);
        cr_expect_eq(memcmp(copy, want, whole->n_trainable * sizeof(float)), 0,
                     "rank %d: the compute copy differs", r);
        free(got), free(copy);
        model_destroy(part);
    }
    free(want);
    model_destroy(whole);
}

Test(model_io, sharded_optimizer_plan_fits_7b_full_in_80_gb)
{
    model_config_t mc;
    cr_assert_eq(model_config_preset(&mc, "llama-7b"), 0);
    model_opts o = {.mode = MODE_FULL, .max_batch = 1, .seq_len = 2048,
                    .recompute = RECOMPUTE_LAYER};
    model_plan whole, shard;
    model_plan_bytes(&mc, &o, DT_BF16, &whole);
    o.shard_count = 8;
    model_plan_bytes(&mc, &o, DT_BF16, &shard);
    double N = (double)model_config_params(&mc);
    cr_expect_lt(fabs((double)whole.trainable / N - 18.0), 1e-6, "%.4f B/weight",
                 (double)whole.trainable / N);
    cr_expect_lt(fabs((double)shard.trainable / N - 8.0), 1e-3, "%.4f B/weight",
                 (double)shard.trainable / N);
    double gib80 = 80e9, tw = (double)(whole.weights + whole.trainable + whole.activations +
                                       whole.scratch),
           ts = (double)(shard.weights + shard.trainable + shard.activations + shard.scratch);
    cr_expect_gt(tw, gib80, "unsharded: %.1f GB", tw / 1e9);
    cr_expect_lt(ts, 0.9 * gib80, "sharded: %.1f GB", ts / 1e9);
    cr_expect_eq(model_shard_len(10, 4), 3);
    cr_expect_eq(model_shard_len(12, 4), 3);
    cr_expect_eq(model_shard_len(7, 1), 7);
}

/* A tensor missing from a sharded model: the error names the tensor and the
 * shard model.safetensors.index.json places it in (or says the index does
 * not list it). */
Test(model_io, missing_tensor_names_its_shard)
{
    model_t *a = tiny(MODE_FULL, 0);
    model_init_base_random(a, 12);
    sp_err err = {0};
    const char *d = tu_fmt("%s/sharded-missing", dir);
    cr_assert_eq(model_io_save(a, d, DT_F32, 0, 300000, &err), 0, "%s", err.msg);
    const char *name = "model.layers.2.mlp.up_proj.weight";
    char *index = sp_strf("%s/model.safetensors.index.json", d);
    json_t *root = json_load_file(index, 0, NULL);
    cr_assert(root, "%s", index);
    json_t *map = json_object_get(root, "weight_map");
    const char *shard = json_string_value(json_object_get(map, name));
    cr_assert(shard, "%s lacks %s", index, name);
    char *shard_name = strdup(shard);
    /* the shard rewritten without the tensor */
    char *path = sp_strf("%s/%s", d, shard_name), *tmp = sp_strf("%s.new", path);
    st_file f;
    cr_assert_eq(st_open(&f, path, &err), 0, "%s", err.msg);
    st_entry *e = calloc(f.n, sizeof *e);
    size_t n = 0;
    for (size_t i = 0; i < f.n; i++) {
        const st_tensor *t = &f.tensors[i];
        if (strcmp(t->name, name) == 0)
            continue;
        e[n] = (st_entry){t->name, t->dt, t->ndim, {0}, t->data};
        memcpy(e[n].shape, t->shape, sizeof t->shape);
        n++;
    }
    cr_assert_eq(n + 1, f.n, "%s held %s", path, name);
    cr_assert_eq(st_write(tmp, e, n, NULL, 0, &err), 0, "%s", err.msg);
    st_close(&f);
    free(e);
    cr_assert_eq(rename(tmp, path), 0);
    model_t *b = tiny(MODE_FULL, 0);
    err = (sp_err){0};
    cr_expect_eq(model_io_load_base(b, d, &err), SP_EXIT_INPUT);
    cr_expect(tu_contains(err.msg, name) && tu_contains(err.msg, shard_name) &&
                  tu_contains(err.msg, "model.safetensors.index.json"),
              "%s", err.msg);
    /* and once the index does not list it either */
    json_object_del(map, name);
    cr_assert_eq(json_dump_file(root, index, JSON_INDENT(2)), 0);
    err = (sp_err){0};
    cr_expect_eq(model_io_load_base(b, d, &err), SP_EXIT_INPUT);
    cr_expect(tu_contains(err.msg, name) && tu_contains(err.msg, "does not list it"), "%s",
              err.msg);
    json_decref(root);
    free(shard_name);
    free(path);
    free(tmp);
    free(index);
    model_destroy(a), model_destroy(b);
}

/* Saving into a directory that holds the other layout: the files a loader
 * would read are the new ones (a stale index or single file is removed). */
Test(model_io, a_save_replaces_the_other_layout)
{
    model_t *a = tiny(MODE_FULL, 0);
    model_init_base_random(a, 13);
    sp_err err = {0};
    const char *d = tu_fmt("%s/relayout", dir);
    char **files;
    int nf;
    cr_assert_eq(model_io_save(a, d, DT_F32, 0, 300000, &err), 0, "%s", err.msg);
    cr_assert_eq(model_io_save(a, d, DT_F32, 0, (size_t)1 << 30, &err), 0, "%s", err.msg);
    cr_expect(access(tu_fmt("%s/model.safetensors.index.json", d), F_OK) != 0,
              "the sharded save's index is still there");
    cr_assert_eq(model_io_weight_files(d, &files, &nf, &err), 0, "%s", err.msg);
    cr_expect(nf == 1 && strcmp(files[0], "model.safetensors") == 0, "%d files", nf);
    for (int i = 0; i < nf; i++)
        free(files[i]);
    free(files);
    cr_assert_eq(model_io_save(a, d, DT_F32, 0, 300000, &err), 0, "%s", err.msg);
    cr_expect(access(tu_fmt("%s/model.safetensors", d), F_OK) != 0,
              "the single-file save's model.safetensors is still there");
    cr_assert_eq(model_io_weight_files(d, &files, &nf, &err), 0, "%s", err.msg);
    cr_expect_gt(nf, 5, "%d shards", nf);
    for (int i = 0; i < nf; i++)
        free(files[i]);
    free(files);
    model_t *b = tiny(MODE_FULL, 0);
    cr_assert_eq(model_io_load_base(b, d, &err), 0, "%s", err.msg);
    model_destroy(a), model_destroy(b);
}
