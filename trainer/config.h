/* trainer/config.h — the run configuration: a schema of every key (name,
 * type, range, default, doc), YAML loading with libyaml, --set overrides,
 * validation with file:line:key errors, the resolved config written back as
 * YAML, and a hash of the keys that change the math (checked on resume).
 * Owns the config_t struct and its strings. */
#ifndef SPOTUNE_CONFIG_H
#define SPOTUNE_CONFIG_H

#include <stdint.h>
#include <stdio.h>

#include "../base/base.h"

enum { MODE_LORA = 0, MODE_FULL = 1 };
enum { SCHED_COSINE = 0, SCHED_LINEAR = 1, SCHED_CONSTANT = 2 };
enum { RECOMPUTE_NONE = 0, RECOMPUTE_ATTENTION = 1, RECOMPUTE_LAYER = 2 };

/* LoRA target bits, in the order Hugging Face lists a layer's projections. */
enum {
    TARGET_Q = 1 << 0, TARGET_K = 1 << 1, TARGET_V = 1 << 2, TARGET_O = 1 << 3,
    TARGET_GATE = 1 << 4, TARGET_UP = 1 << 5, TARGET_DOWN = 1 << 6,
    TARGET_COUNT = 7
};
extern const char *const config_target_names[TARGET_COUNT];
/* runtime.backend choices, indexed by config_t.backend (names backend_create takes) */
extern const char *const config_backend_names[];

/* model.quantize */
enum { QUANT_NONE = 0, QUANT_NF4 = 1 };

typedef struct config {
    char *source;          /* the YAML file this came from */
    /* run */
    char *run_dir;
    int64_t seed;
    /* model */
    char *model_path;
    int model_quantize; /* QUANT_NONE or QUANT_NF4 (QLoRA: NF4 frozen projections) */
    /* train */
    int mode;
    int64_t steps;
    int64_t seq_len, micro_batch, grad_accum;
    double lr, min_lr, weight_decay, clip_grad_norm, beta1, beta2, adam_eps;
    int shard_optimizer; /* full mode on several ranks: ZeRO stage 1 */
    int shard_gradients; /* with shard_optimizer: ZeRO stage 2 */
    int schedule;
    int64_t warmup_steps;
    /* lora */
    int64_t lora_r;
    double lora_alpha, lora_dropout;
    int64_t lora_targets; /* TARGET_* bits */
    int lora_rslora;
    int lora_dora; /* DoRA: a trained magnitude per output row of each target */
    char *lora_init_from; /* PEFT adapter directory a fresh start begins from, or "" */
    /* data */
    char *data_train, *data_val;
    int data_packing; /* DATA_PACK_* (data.h): stream, documents, pad */
    int64_t val_every, val_windows;
    /* log */
    int64_t log_every;
    int log_samples;
    /* runtime */
    int backend; /* index into config_backend_names */
    int64_t threads;
    int recompute;
    int cuda_graphs;
    /* comm */
    double comm_bucket_mb, comm_timeout_s;
    /* checkpoint */
    int64_t ckpt_every_steps;
    double ckpt_every_minutes;
    int64_t ckpt_keep, ckpt_keep_every;
    char *ckpt_remote, *ckpt_endpoint, *ckpt_region;
    int ckpt_addressing;
    int ckpt_layout; /* CKPT_LAYOUT_* */
    int64_t ckpt_part_mb;
    double ckpt_upload_deadline_s, ckpt_final_upload_timeout_s;
    double ckpt_lease_s;
    int ckpt_take_over;
    double run_lock_wait_s;
} config_t;

enum { ADDR_AUTO = 0, ADDR_PATH = 1, ADDR_VIRTUAL = 2 };
enum { CKPT_LAYOUT_AUTO = 0, CKPT_LAYOUT_SHARDED = 1, CKPT_LAYOUT_GATHERED = 2 };

/* Fills cfg with every key's default. */
void config_defaults(config_t *cfg);
/* Loads a YAML file over the defaults. Errors name file:line and key. */
int config_load(config_t *cfg, const char *path, sp_err *err);
/* Loads YAML text (a saved resolved config); name is used in messages. */
int config_load_text(config_t *cfg, const char *text, const char *name, sp_err *err);
/* Lists the math keys whose values differ ("lora.r (8, now 16), ..."), returns
 * how many; skip: a key left out (NULL: none). */
int config_diff_math(const config_t *was, const config_t *now, const char *skip, char *buf,
                     size_t n);
/* Applies "section.key=value" (value parsed as YAML). */
int config_set(config_t *cfg, const char *assignment, sp_err *err);
/* Cross-key checks once everything is loaded (required keys, ranges that
 * involve two keys). */
int config_validate(const config_t *cfg, sp_err *err);
/* Writes every key, resolved, as YAML. */
int config_write_yaml(const config_t *cfg, FILE *f, sp_err *err);
/* Hash of the keys that change the math of a run (model, LoRA shape, seq_len,
 * global batch per step before rank splitting, seed, ...). */
uint64_t config_math_hash(const config_t *cfg);
/* Writes the documentation of every key as Markdown (configs/README.md). */
void config_write_reference(FILE *f);
void config_free(config_t *cfg);

#endif
