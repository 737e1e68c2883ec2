/* Config schema, YAML loading (libyaml document API), overrides, validation
 * and the resolved-config writer (libyaml emitter). */
#define _POSIX_C_SOURCE 200809L
#include "config.h"

#include <errno.h>
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <yaml.h>

const char *const config_target_names[TARGET_COUNT] = {
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};

typedef enum { K_INT, K_FLOAT, K_BOOL, K_STRING, K_ENUM, K_TARGETS } key_type;

typedef struct key_def {
    const char *name; /* section.key */
    key_type type;
    size_t offset;
    const char *def;          /* default, as YAML text (NULL: required or empty) */
    double min, max;          /* numeric range (inclusive) */
    const char *const *enums; /* K_ENUM choices, NULL-terminated */
    int math;                 /* 1: changing it changes the math (refused on resume);
                                 MATH_SINCE: the same, for a key added after checkpoints
                                 existed: hashed only when set away from its default, so the
                                 checkpoints of earlier versions (which ran at the default)
                                 keep their hash and still resume */
    const char *doc;
} key_def;

static const char *const modes[] = {"lora", "full", NULL};
static const char *const schedules[] = {"cosine", "linear", "constant", NULL};
static const char *const recomputes[] = {"none", "attention", "layer", NULL};
const char *const config_backend_names[] = {"auto", "cpu", "cpu-ref", "cuda", NULL};
static const char *const addressings[] = {"auto", "path", "virtual", NULL};
static const char *const packings[] = {"stream", "documents", "pad", NULL}; /* DATA_PACK_* */
static const char *const quantizes[] = {"none", "nf4", NULL};                /* QUANT_* */
static const char *const layouts[] = {"auto", "sharded", "gathered", NULL}; /* CKPT_LAYOUT_* */

#define MATH_SINCE 2
#define O(f) offsetof(config_t, f)
#define BIG 9.0e15
static const key_def keys[] = {
    {"run.dir", K_STRING, O(run_dir), NULL, 0, 0, NULL, 0,
     "Run directory: resolved config, metrics.jsonl, checkpoints and the exported adapter or "
     "model. Created if missing. Relative paths are relative to the working directory."},
    {"run.seed", K_INT, O(seed), "1234", 0, BIG, NULL, 1,
     "Seed of every random stream: LoRA init, data order, dropout."},
    {"run.lock_wait_s", K_FLOAT, O(run_lock_wait_s), "30", 0, 86400, NULL, 0,
     "One job per run directory (a lock on RUN_DIR/.lock, held by rank 0): wait at most this "
     "long for another job holding it to end (e.g. ranks of a killed launch still exiting), "
     "then refuse to start (exit 2)."},
    {"model.path", K_STRING, O(model_path), NULL, 0, 0, NULL, 1,
     "Hugging Face model directory: config.json and model.safetensors (or shards listed in "
     "model.safetensors.index.json)."},
    {"model.quantize", K_ENUM, O(model_quantize), "none", 0, 0, quantizes, MATH_SINCE,
     "none: the frozen base weights are kept as loaded (in the compute dtype). nf4: QLoRA: the "
     "seven projection weights of each layer (q, k, v, o, gate, up, down) are quantized at load "
     "to 4-bit NormalFloat with double quantization, in bitsandbytes' layout and values "
     "(blocks of 64, the block maxima quantized to 8 bits in blocks of 256; about 0.5 bytes "
     "per weight), and each product that needs one dequantizes that weight alone into a "
     "workspace; embeddings, lm_head, norms and biases stay dense. The LoRA gradients are "
     "those of the dequantized base. Needs train.mode lora; not with lora.dora; runs on the "
     "CPU backends (cpu, cpu-ref) only. A run cannot resume under another value."},
    {"train.mode", K_ENUM, O(mode), "lora", 0, 0, modes, 1,
     "lora: train LoRA adapters on a frozen base. full: train every weight."},
    {"train.steps", K_INT, O(steps), "100", 1, BIG, NULL, 0, "Optimizer steps in total."},
    {"train.seq_len", K_INT, O(seq_len), "256", 2, 1048576, NULL, 1,
     "Tokens per window (each window predicts seq_len next tokens)."},
    {"train.micro_batch", K_INT, O(micro_batch), "4", 1, 65536, NULL, 0,
     "Windows per forward/backward pass on each rank."},
    {"train.grad_accum", K_INT, O(grad_accum), "1", 1, 65536, NULL, 0,
     "Micro-batches accumulated per optimizer step. Global batch = ranks x micro_batch x "
     "grad_accum windows (fixed for a run)."},
    {"train.lr", K_FLOAT, O(lr), "2e-4", 1e-12, 10.0, NULL, 1, "Peak learning rate."},
    {"train.schedule", K_ENUM, O(schedule), "cosine", 0, 0, schedules, 1,
     "Learning-rate schedule after warmup: cosine, linear (both decay to train.min_lr at the "
     "last step) or constant."},
    {"train.warmup_steps", K_INT, O(warmup_steps), "0", 0, BIG, NULL, 1,
     "Linear warmup from lr/warmup_steps to lr over this many steps."},
    {"train.min_lr", K_FLOAT, O(min_lr), "0", 0, 10.0, NULL, 1,
     "Learning rate at the end of the cosine or linear decay."},
    {"train.weight_decay", K_FLOAT, O(weight_decay), "0", 0, 10.0, NULL, 1,
     "AdamW decoupled weight decay; never applied to norms and biases."},
    {"train.clip_grad_norm", K_FLOAT, O(clip_grad_norm), "1.0", 0, 1e12, NULL, 1,
     "Clip the global gradient norm to this value (0 disables clipping)."},
    {"train.beta1", K_FLOAT, O(beta1), "0.9", 0, 0.999999, NULL, 1, "AdamW beta1."},
    {"train.beta2", K_FLOAT, O(beta2), "0.999", 0, 0.9999999, NULL, 1, "AdamW beta2."},
    {"train.eps", K_FLOAT, O(adam_eps), "1e-8", 1e-30, 1.0, NULL, 1, "AdamW epsilon."},
    {"train.shard_optimizer", K_BOOL, O(shard_optimizer), "true", 0, 0, NULL, 0,
     "Full fine-tuning on several ranks: each rank keeps the fp32 master weights and AdamW "
     "moments of 1/ranks of the parameters (ZeRO stage 1; gradients reduce-scattered, weights "
     "all-gathered), which is what lets a 7B model train fully on 80 GB GPUs. Same math as "
     "false; checkpoints are the same either way. LoRA state is small and never sharded."},
    /* not in the math hash (math 0), as shard_optimizer: on or off the step
     * sums the same gradients (per micro-batch over the ranks, then over the
     * micro-batches, instead of the other way round), so results differ by
     * summation order only, and a run may resume with the other value */
    {"train.shard_gradients", K_BOOL, O(shard_gradients), "true", 0, 0, NULL, 0,
     "With train.shard_optimizer in full fine-tuning on several ranks, also shard the fp32 "
     "gradient (ZeRO stage 2): no rank holds the whole gradient; the backward writes each "
     "layer's gradient into one of two reused buffers and, as soon as the layer is done, each "
     "part of it is reduced to the rank whose shard holds it (every micro-batch), so the "
     "gradient costs a shard plus two layers' worth per rank instead of the whole model plus "
     "a shard. Same math as false up to summation order; checkpoints are the same either "
     "way. Ignored when the optimizer is not sharded."},
    {"lora.r", K_INT, O(lora_r), "16", 1, 65536, NULL, 1, "LoRA rank."},
    {"lora.alpha", K_FLOAT, O(lora_alpha), "32", 1e-9, 1e9, NULL, 1,
     "LoRA alpha: the update is scaled by alpha/r (alpha/sqrt(r) with rslora)."},
    {"lora.dropout", K_FLOAT, O(lora_dropout), "0", 0, 0.99, NULL, 1,
     "Dropout probability on the input of each LoRA branch."},
    {"lora.targets", K_TARGETS, O(lora_targets), "[q_proj, k_proj, v_proj, o_proj]", 0, 0, NULL,
     1, "Projections that get adapters: any of q_proj k_proj v_proj o_proj gate_proj up_proj "
        "down_proj."},
    {"lora.rslora", K_BOOL, O(lora_rslora), "false", 0, 0, NULL, 1,
     "Rank-stabilised LoRA: scale by alpha/sqrt(r) instead of alpha/r."},
    {"lora.dora", K_BOOL, O(lora_dora), "false", 0, 0, NULL, MATH_SINCE,
     "DoRA (weight-decomposed LoRA, PEFT's use_dora): each target projection also trains a "
     "magnitude vector m (one value per output feature, initialised to the row norms of the "
     "base weight) and computes y = m / ||W + s B A||_row * (x W^T + s (x A^T) B^T) + b, the "
     "norm taken per output row and treated as a constant in the backward, as PEFT does. Needs "
     "train.mode lora and lora.dropout 0, and runs on the CPU backends (cpu, cpu-ref) only."},
    {"lora.init_from", K_STRING, O(lora_init_from), "", 0, 0, NULL, 0,
     "PEFT adapter directory (adapter_config.json + adapter_model.safetensors, as spotune "
     "export --peft or PEFT's save_pretrained writes it) whose A and B replace the initial "
     "LoRA weights (A random, B zero) on every rank: training carries on from it with a fresh "
     "optimizer state and this run's own data order. Its r, lora_alpha, target_modules and "
     "use_rslora must equal lora.r, lora.alpha, lora.targets and lora.rslora, its use_dora "
     "lora.dora (a DoRA adapter's magnitude vectors are loaded too), and the base "
     "model identity spotune records in it must be model.path's. "
     "Only a fresh start reads it: a run that resumes takes its weights from the checkpoint "
     "(which holds what init_from gave, trained on), so the key may change or go on resume. "
     "Empty: start from the random initialisation."},
    {"data.train", K_STRING, O(data_train), NULL, 0, 0, NULL, 1,
     "Training dataset (HDF5, the format of docs/formats.md)."},
    {"data.val", K_STRING, O(data_val), "", 0, 0, NULL, 0,
     "Validation dataset (HDF5). Empty: no validation."},
    {"data.packing", K_ENUM, O(data_packing), "stream", 0, 0, packings, MATH_SINCE,
     "How windows are made of the documents. stream: seq_len-token windows cut from all "
     "documents concatenated; attention and predictions cross document boundaries "
     "(pre-training style). documents: whole documents packed into each window in file order "
     "(one that does not fit the rest of a window starts the next; one longer than seq_len is "
     "split into pieces of seq_len), each attending only to itself with positions restarting "
     "at 0, as Hugging Face computes each example on its own (SFT). pad: one document (or "
     "piece) per window, the rest padding; padding is never trained and never attended to. "
     "Changing it changes which windows exist, so a run cannot resume under another value."},
    {"data.val_every", K_INT, O(val_every), "0", 0, BIG, NULL, 0,
     "Validate every N steps and after the last step (0: only after the last step)."},
    {"data.val_windows", K_INT, O(val_windows), "64", 1, BIG, NULL, 0,
     "At most this many windows of the validation set are evaluated, from its start."},
    {"log.every", K_INT, O(log_every), "10", 1, BIG, NULL, 0, "Print a log line every N steps."},
    {"log.samples", K_BOOL, O(log_samples), "false", 0, 0, NULL, 0,
     "Audit the data order: each rank appends the windows it trains on to "
     "RUN_DIR/samples/rank-R.tsv (step, global sample index, epoch, window)."},
    {"runtime.backend", K_ENUM, O(backend), "auto", 0, 0, config_backend_names, 0,
     "auto (cuda when a GPU is visible, else cpu), cpu, cpu-ref (plain loops, slow; for "
     "checking) or cuda."},
    {"runtime.threads", K_INT, O(threads), "0", 0, 4096, NULL, 0,
     "CPU threads per rank (0: all cores)."},
    {"runtime.recompute", K_ENUM, O(recompute), "none", 0, 0, recomputes, 0,
     "Activation recomputation: none, attention (recompute attention and norms in the "
     "backward) or layer (keep only each layer's input; recompute the layer)."},
    {"comm.bucket_mb", K_FLOAT, O(comm_bucket_mb), "25", 0.0625, 4096, NULL, 0,
     "Gradients are all-reduced in buckets of this many MiB (on GPUs, overlapping the backward "
     "pass). Sharded gradients (train.shard_gradients) go a layer at a time instead."},
    {"comm.timeout_s", K_FLOAT, O(comm_timeout_s), "60", 1, 86400, NULL, 0,
     "A collective that does not finish in this many seconds ends the whole job (a rank died "
     "or hangs). While the ranks load the model and the checkpoint it is at least an hour."},
    {"checkpoint.every_steps", K_INT, O(ckpt_every_steps), "0", 0, BIG, NULL, 0,
     "Checkpoint every N optimizer steps (0: off). Checkpoints are also written every "
     "checkpoint.every_minutes, at the end, and on SIGTERM, SIGINT or SIGUSR1."},
    {"checkpoint.every_minutes", K_FLOAT, O(ckpt_every_minutes), "30", 0, 1e9, NULL, 0,
     "Checkpoint when this many minutes have passed since the last one (0: off); rank 0's "
     "clock decides for all ranks at a step boundary."},
    {"checkpoint.layout", K_ENUM, O(ckpt_layout), "auto", 0, 0, layouts, 0,
     "How a full fine-tune with a sharded optimizer (train.shard_optimizer on several ranks) "
     "stores its state. sharded: every rank writes the masters and AdamW moments it owns to a "
     "shard file of its own, in parallel (shard-RRRRR-of-NNNNN.h5 beside state.h5), and rank 0 "
     "writes MANIFEST.json, with the layout, once every rank has written its shard; every rank "
     "must see run.dir (one machine, or a shared file system). gathered: rank 0 gathers the "
     "whole state and writes it alone (state.h5). auto: sharded when every rank runs on one "
     "machine, else gathered. Other runs always write state.h5 alone. Either kind resumes on "
     "any rank count and under either setting."},
    {"checkpoint.keep", K_INT, O(ckpt_keep), "3", 1, 1000000, NULL, 0,
     "Keep the newest N complete checkpoints (locally and in checkpoint.remote)."},
    {"checkpoint.keep_every", K_INT, O(ckpt_keep_every), "0", 0, BIG, NULL, 0,
     "Also keep every checkpoint whose step is a multiple of N (0: none)."},
    {"checkpoint.remote", K_STRING, O(ckpt_remote), "", 0, 0, NULL, 0,
     "Object store the checkpoints are pushed to in the background: s3://bucket/prefix or "
     "file:///path (a mounted share). Empty: local only. Credentials come from "
     "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and AWS_SESSION_TOKEN, never from this file."},
    {"checkpoint.endpoint", K_STRING, O(ckpt_endpoint), "", 0, 0, NULL, 0,
     "S3 endpoint URL for non-AWS stores (MinIO, Ceph, R2, OSS, COS, Swift); empty: "
     "AWS_ENDPOINT_URL or AWS S3."},
    {"checkpoint.region", K_STRING, O(ckpt_region), "", 0, 0, NULL, 0,
     "Signing region; empty: AWS_REGION, AWS_DEFAULT_REGION or us-east-1."},
    {"checkpoint.addressing", K_ENUM, O(ckpt_addressing), "auto", 0, 0, addressings, 0,
     "S3 addressing: path (endpoint/bucket/key), virtual (bucket.endpoint/key) or auto."},
    {"checkpoint.part_mb", K_INT, O(ckpt_part_mb), "16", 5, 5120, NULL, 0,
     "Multipart upload part size and ranged download chunk in MiB (S3's minimum is 5)."},
    {"checkpoint.upload_deadline_s", K_FLOAT, O(ckpt_upload_deadline_s), "90", 0, 86400, NULL,
     0, "On a preemption signal, wait at most this long for the upload before exiting 75. Set "
        "it to what the cloud's notice leaves (AWS about 120 s, GCP and Azure about 30 s): a "
        "push that takes longer, or a checkpoint too big for the rate the run last measured, "
        "is warned about."},
    {"checkpoint.final_upload_timeout_s", K_FLOAT, O(ckpt_final_upload_timeout_s), "1800", 0,
     1e9, NULL, 0,
     "At the end of the run, wait at most this long for the remaining uploads. A run whose "
     "final checkpoint has not reached checkpoint.remote by then ends with exit 1 (the "
     "local checkpoint is complete; running the same command again pushes it)."},
    {"checkpoint.lease_s", K_FLOAT, O(ckpt_lease_s), "90", 0, 86400, NULL, 0,
     "One job per remote prefix: the job keeps a lease object (LEASE.json) beside the "
     "checkpoints, renewed every lease_s/3 seconds. Another job finding a lease renewed less "
     "than lease_s ago waits up to lease_s for it to expire, then refuses to start (exit 2) "
     "unless checkpoint.take_over is set. 0: no lease."},
    {"checkpoint.take_over", K_BOOL, O(ckpt_take_over), "false", 0, 0, NULL, 0,
     "Take the remote prefix over from another job's live lease without waiting (that job "
     "stops pushing and ends with exit 2). On the command line: train --takeover."},
};
#undef O
#define NKEYS (sizeof keys / sizeof keys[0])

static const key_def *find_key(const char *name)
{
    for (size_t i = 0; i < NKEYS; i++)
        if (strcmp(keys[i].name, name) == 0)
            return &keys[i];
    return NULL;
}

static int section_exists(const char *sec, size_t len)
{
    for (size_t i = 0; i < NKEYS; i++)
        if (strncmp(keys[i].name, sec, len) == 0 && keys[i].name[len] == '.')
            return 1;
    return 0;
}

/* ---- scalar parsing ------------------------------------------------------ */

static int parse_int(const char *s, int64_t *out)
{
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || end == s || *end)
        return -1;
    *out = v;
    return 0;
}

static int parse_float(const char *s, double *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !isfinite(v))
        return -1;
    *out = v;
    return 0;
}

static int parse_bool(const char *s, int *out)
{
    if (!strcasecmp(s, "true") || !strcasecmp(s, "yes") || !strcasecmp(s, "on")) {
        *out = 1;
        return 0;
    }
    if (!strcasecmp(s, "false") || !strcasecmp(s, "no") || !strcasecmp(s, "off")) {
        *out = 0;
        return 0;
    }
    return -1;
}

static int target_bit(const char *s)
{
    for (int i = 0; i < TARGET_COUNT; i++)
        if (strcmp(s, config_target_names[i]) == 0)
            return 1 << i;
    return 0;
}

/* Where a value came from, for messages: "file.yaml:12" or "--set". */
typedef struct origin {
    const char *file;
    long line;
} origin;

static int bad(sp_err *err, origin o, const key_def *k, const char *fmt, const char *what)
{
    char detail[512];
    snprintf(detail, sizeof detail, fmt, what);
    if (o.line > 0)
        return sp_fail(err, SP_EXIT_USAGE, "%s:%ld: %s: %s", o.file, o.line, k->name, detail);
    return sp_fail(err, SP_EXIT_USAGE, "%s: %s: %s", o.file, k->name, detail);
}

/* A K_INT or K_FLOAT value: s parsed, checked against k's range, stored at base. */
static int set_number(char *base, const key_def *k, const char *s, int quoted, origin o,
                      sp_err *err)
{
    int is_int = k->type == K_INT;
    int64_t i = 0;
    double v = 0;
    if (quoted || (is_int ? parse_int(s, &i) : parse_float(s, &v)))
        return bad(err, o, k,
                   is_int ? "expected an integer, got '%s'" : "expected a number, got '%s'", s);
    if (is_int)
        v = (double)i;
    if (v < k->min || v > k->max) {
        char r[128];
        snprintf(r, sizeof r,
                 is_int ? "%%s is out of range [%.0f, %.0f]" : "%%s is out of range [%g, %g]",
                 k->min, k->max);
        return bad(err, o, k, r, s);
    }
    if (is_int)
        *(int64_t *)base = i;
    else
        *(double *)base = v;
    return 0;
}

static int set_scalar(config_t *cfg, const key_def *k, const char *s, int quoted, origin o,
                      sp_err *err)
{
    char *base = (char *)cfg + k->offset;
    switch (k->type) {
    case K_INT:
    case K_FLOAT: return set_number(base, k, s, quoted, o, err);
    case K_BOOL: {
        int v;
        if (quoted || parse_bool(s, &v))
            return bad(err, o, k, "expected true or false, got '%s'", s);
        *(int *)base = v;
        return 0;
    }
    case K_STRING: {
        char *dup = strdup(s);
        if (!dup)
            return sp_fail(err, SP_EXIT_OTHER, "out of memory");
        free(*(char **)base);
        *(char **)base = dup;
        return 0;
    }
    case K_ENUM:
        for (int i = 0; k->enums[i]; i++)
            if (strcmp(s, k->enums[i]) == 0) {
                *(int *)base = i;
                return 0;
            }
        {
            char choices[256] = "";
            for (int i = 0; k->enums[i]; i++) {
                strncat(choices, i ? ", " : "", sizeof choices - strlen(choices) - 1);
                strncat(choices, k->enums[i], sizeof choices - strlen(choices) - 1);
            }
            char r[400];
            snprintf(r, sizeof r, "'%%s' is not one of: %s", choices);
            return bad(err, o, k, r, s);
        }
    case K_TARGETS: {
        /* a scalar is a comma-separated list */
        int64_t bits = 0;
        char *copy = strdup(s), *save = NULL;
        if (!copy)
            return sp_fail(err, SP_EXIT_OTHER, "out of memory");
        for (char *t = strtok_r(copy, ", ", &save); t; t = strtok_r(NULL, ", ", &save)) {
            int b = target_bit(t);
            if (!b) {
                int rc = bad(err, o, k,
                             "unknown target '%s' (expected q_proj k_proj v_proj o_proj "
                             "gate_proj up_proj down_proj)",
                             t);
                free(copy);
                return rc;
            }
            bits |= b;
        }
        free(copy);
        if (!bits)
            return bad(err, o, k, "%sthe list of targets is empty", "");
        *(int64_t *)base = bits;
        return 0;
    }
    }
    return 0;
}

/* Applies a YAML node (scalar or, for lists, a sequence of scalars). */
static int set_node(config_t *cfg, const key_def *k, yaml_document_t *doc, yaml_node_t *n,
                    origin o, sp_err *err)
{
    if (n->type == YAML_SCALAR_NODE) {
        int quoted = n->data.scalar.style == YAML_SINGLE_QUOTED_SCALAR_STYLE ||
                     n->data.scalar.style == YAML_DOUBLE_QUOTED_SCALAR_STYLE;
        return set_scalar(cfg, k, (const char *)n->data.scalar.value, quoted, o, err);
    }
    if (n->type == YAML_SEQUENCE_NODE && k->type == K_TARGETS) {
        char joined[512] = "";
        for (yaml_node_item_t *it = n->data.sequence.items.start; it < n->data.sequence.items.top;
             it++) {
            yaml_node_t *e = yaml_document_get_node(doc, *it);
            if (!e || e->type != YAML_SCALAR_NODE)
                return bad(err, o, k, "%sexpected a list of projection names", "");
            if (strlen(joined) + strlen((char *)e->data.scalar.value) + 2 >= sizeof joined)
                return bad(err, o, k, "%stoo many targets", "");
            strcat(joined, joined[0] ? "," : "");
            strcat(joined, (const char *)e->data.scalar.value);
        }
        return set_scalar(cfg, k, joined, 0, o, err);
    }
    return bad(err, o, k, "expected %s", k->type == K_TARGETS ? "a list" : "a single value");
}

void config_defaults(config_t *cfg)
{
    memset(cfg, 0, sizeof *cfg);
    sp_err e = {0};
    origin o = {"defaults", 0};
    for (size_t i = 0; i < NKEYS; i++) {
        const key_def *k = &keys[i];
        const char *d = k->def;
        if (!d)
            continue;
        if (k->type == K_TARGETS) {
            char list[256];
            size_t n = strlen(d);
            snprintf(list, sizeof list, "%.*s", (int)(n - 2), d + 1); /* strip [ ] */
            set_scalar(cfg, k, list, 0, o, &e);
        } else {
            set_scalar(cfg, k, d, 0, o, &e);
        }
    }
}

/* The line of an earlier key of mapping m, before pair `at`, with the same
 * text as key node k (0: none): YAML says keys are unique, and a repeated
 * one would silently override the first. */
static long earlier_key_line(yaml_document_t *doc, yaml_node_t *m, yaml_node_pair_t *at,
                             yaml_node_t *k)
{
    for (yaml_node_pair_t *p = m->data.mapping.pairs.start; p < at; p++) {
        yaml_node_t *e = yaml_document_get_node(doc, p->key);
        if (e && e->type == YAML_SCALAR_NODE && e->data.scalar.length == k->data.scalar.length &&
            memcmp(e->data.scalar.value, k->data.scalar.value, k->data.scalar.length) == 0)
            return (long)e->start_mark.line + 1;
    }
    return 0;
}

static int load_mapping(config_t *cfg, yaml_document_t *doc, const char *path, sp_err *err)
{
    yaml_node_t *root = yaml_document_get_root_node(doc);
    if (!root)
        return 0; /* an empty file is all defaults */
    if (root->type != YAML_MAPPING_NODE)
        return sp_fail(err, SP_EXIT_USAGE, "%s:%lu: expected a mapping of sections", path,
                       (unsigned long)root->start_mark.line + 1);
    for (yaml_node_pair_t *p = root->data.mapping.pairs.start; p < root->data.mapping.pairs.top;
         p++) {
        yaml_node_t *kn = yaml_document_get_node(doc, p->key);
        yaml_node_t *vn = yaml_document_get_node(doc, p->value);
        long line = (long)kn->start_mark.line + 1;
        if (kn->type != YAML_SCALAR_NODE)
            return sp_fail(err, SP_EXIT_USAGE, "%s:%ld: section names must be plain words", path,
                           line);
        const char *sec = (const char *)kn->data.scalar.value;
        long first = earlier_key_line(doc, root, p, kn);
        if (first)
            return sp_fail(err, SP_EXIT_USAGE,
                           "%s:%ld: section '%s' appears again (first at %s:%ld); give each "
                           "section once",
                           path, line, sec, path, first);
        if (!section_exists(sec, strlen(sec)))
            return sp_fail(err, SP_EXIT_USAGE,
                           "%s:%ld: unknown section '%s' (expected run, model, train, lora, data, "
                           "log, runtime, comm, checkpoint; see configs/README.md)",
                           path, line, sec);
        if (vn->type == YAML_SCALAR_NODE && vn->data.scalar.length == 0)
            continue; /* "section:" with nothing under it */
        if (vn->type != YAML_MAPPING_NODE)
            return sp_fail(err, SP_EXIT_USAGE, "%s:%ld: section '%s' must be a mapping", path,
                           line, sec);
        for (yaml_node_pair_t *q = vn->data.mapping.pairs.start; q < vn->data.mapping.pairs.top;
             q++) {
            yaml_node_t *k2 = yaml_document_get_node(doc, q->key);
            yaml_node_t *v2 = yaml_document_get_node(doc, q->value);
            long l2 = (long)k2->start_mark.line + 1;
            char name[256];
            if (k2->type != YAML_SCALAR_NODE)
                return sp_fail(err, SP_EXIT_USAGE, "%s:%ld: keys must be plain words", path, l2);
            if (sp_fitf(name, sizeof name, "%s.%s", sec, (const char *)k2->data.scalar.value))
                return sp_fail(err, SP_EXIT_USAGE, "%s:%ld: unknown key '%s.%s' (see "
                               "configs/README.md)", path, l2, sec,
                               (const char *)k2->data.scalar.value);
            long first2 = earlier_key_line(doc, vn, q, k2);
            if (first2)
                return sp_fail(err, SP_EXIT_USAGE,
                               "%s:%ld: key '%s' appears again (first at %s:%ld); give each key "
                               "once",
                               path, l2, name, path, first2);
            const key_def *k = find_key(name);
            if (!k)
                return sp_fail(err, SP_EXIT_USAGE,
                               "%s:%ld: unknown key '%s' (see configs/README.md)", path, l2, name);
            origin o = {path, (long)v2->start_mark.line + 1};
            if (set_node(cfg, k, doc, v2, o, err))
                return err->code;
        }
    }
    return 0;
}

static int load_parser(config_t *cfg, yaml_parser_t *parser, const char *name, sp_err *err)
{
    yaml_document_t doc;
    int rc;
    if (!yaml_parser_load(parser, &doc)) {
        rc = sp_fail(err, SP_EXIT_USAGE, "%s:%lu:%lu: YAML error: %s", name,
                     (unsigned long)parser->problem_mark.line + 1,
                     (unsigned long)parser->problem_mark.column + 1,
                     parser->problem ? parser->problem : "unknown");
    } else {
        rc = load_mapping(cfg, &doc, name, err);
        yaml_document_delete(&doc);
    }
    if (!rc) {
        free(cfg->source);
        cfg->source = strdup(name);
    }
    return rc;
}

int config_load(config_t *cfg, const char *path, sp_err *err)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return sp_fail(err, SP_EXIT_USAGE, "%s: cannot open config: %s", path, strerror(errno));
    yaml_parser_t parser;
    yaml_parser_initialize(&parser);
    yaml_parser_set_input_file(&parser, f);
    int rc = load_parser(cfg, &parser, path, err);
    yaml_parser_delete(&parser);
    fclose(f);
    return rc;
}

int config_load_text(config_t *cfg, const char *text, const char *name, sp_err *err)
{
    yaml_parser_t parser;
    yaml_parser_initialize(&parser);
    yaml_parser_set_input_string(&parser, (const unsigned char *)text, strlen(text));
    int rc = load_parser(cfg, &parser, name, err);
    yaml_parser_delete(&parser);
    return rc;
}

int config_set(config_t *cfg, const char *assignment, sp_err *err)
{
    const char *eq = strchr(assignment, '=');
    if (!eq)
        return sp_fail(err, SP_EXIT_USAGE, "--set %s: expected section.key=value", assignment);
    char name[256];
    const key_def *k = NULL;
    if (sp_fitf(name, sizeof name, "%.*s", (int)(eq - assignment), assignment) == 0)
        k = find_key(name);
    if (!k)
        return sp_fail(err, SP_EXIT_USAGE, "--set: unknown key '%.*s' (see configs/README.md)",
                       (int)(eq - assignment), assignment);
    const char *val = eq + 1;
    origin so = {"--set", 0};
    if (k->type == K_STRING) /* taken literally: paths may hold ': ' */
        return set_scalar(cfg, k, val, 0, so, err);
    yaml_parser_t parser;
    yaml_document_t doc;
    int rc;
    yaml_parser_initialize(&parser);
    yaml_parser_set_input_string(&parser, (const unsigned char *)val, strlen(val));
    origin o = {"--set", 0};
    if (!yaml_parser_load(&parser, &doc)) {
        rc = sp_fail(err, SP_EXIT_USAGE, "--set %s: cannot parse value: %s", name,
                     parser.problem ? parser.problem : "unknown");
    } else {
        yaml_node_t *n = yaml_document_get_root_node(&doc);
        if (!n)
            rc = set_scalar(cfg, k, "", 0, o, err);
        else
            rc = set_node(cfg, k, &doc, n, o, err);
        yaml_document_delete(&doc);
    }
    yaml_parser_delete(&parser);
    return rc;
}

int config_validate(const config_t *c, sp_err *err)
{
    const char *src = c->source ? c->source : "config";
    if (!c->run_dir || !*c->run_dir)
        return sp_fail(err, SP_EXIT_USAGE, "%s: run.dir is required", src);
    if (!c->model_path || !*c->model_path)
        return sp_fail(err, SP_EXIT_USAGE, "%s: model.path is required", src);
    if (!c->data_train || !*c->data_train)
        return sp_fail(err, SP_EXIT_USAGE, "%s: data.train is required", src);
    if (c->min_lr > c->lr)
        return sp_fail(err, SP_EXIT_USAGE, "%s: train.min_lr (%g) is larger than train.lr (%g)",
                       src, c->min_lr, c->lr);
    if (c->mode == MODE_LORA && !c->lora_targets)
        return sp_fail(err, SP_EXIT_USAGE, "%s: lora.targets is empty", src);
    if (c->lora_dora && c->mode != MODE_LORA)
        return sp_fail(err, SP_EXIT_USAGE, "%s: lora.dora needs train.mode lora, not full", src);
    if (c->lora_dora && c->lora_dropout > 0)
        return sp_fail(err, SP_EXIT_USAGE,
                       "%s: lora.dora with lora.dropout %g is not supported (PEFT's DoRA "
                       "recomputes the base projection on the dropped input); set lora.dropout "
                       "to 0",
                       src, c->lora_dropout);
    if (c->lora_dora && strcmp(config_backend_names[c->backend], "cuda") == 0)
        return sp_fail(err, SP_EXIT_USAGE,
                       "%s: lora.dora runs on the CPU backends only (runtime.backend cpu or "
                       "cpu-ref), not runtime.backend cuda: its CUDA path has not yet run on a "
                       "GPU (tests/test_cuda_model.c, cuda_model::*_dora)",
                       src);
    if (c->model_quantize == QUANT_NF4 && c->mode != MODE_LORA)
        return sp_fail(err, SP_EXIT_USAGE, "%s: model.quantize nf4 needs train.mode lora, not full",
                       src);
    if (c->model_quantize == QUANT_NF4 && c->lora_dora)
        return sp_fail(err, SP_EXIT_USAGE,
                       "%s: model.quantize nf4 with lora.dora is not supported (DoRA's weight "
                       "norms would need the dequantized base); set one of them off",
                       src);
    if (c->model_quantize == QUANT_NF4 && strcmp(config_backend_names[c->backend], "cuda") == 0)
        return sp_fail(err, SP_EXIT_USAGE,
                       "%s: model.quantize nf4 runs on the CPU backends only (runtime.backend cpu "
                       "or cpu-ref), not runtime.backend cuda",
                       src);
    if (c->mode != MODE_LORA && c->lora_init_from && *c->lora_init_from)
        return sp_fail(err, SP_EXIT_USAGE,
                       "%s: lora.init_from (%s) needs train.mode lora, not full", src,
                       c->lora_init_from);
    return 0;
}

/* ---- writing -------------------------------------------------------------- */

/* The value of key k as text: a string key's own string (whole, however
 * long), or the value written into buf[VALUE_TEXT_MAX] (a number, a word, the
 * list of targets: they fit). */
#define VALUE_TEXT_MAX 256
static const char *value_text(const config_t *cfg, const key_def *k, char *buf)
{
    const char *base = (const char *)cfg + k->offset;
    size_t n = VALUE_TEXT_MAX;
    switch (k->type) {
    case K_INT: snprintf(buf, n, "%lld", (long long)*(const int64_t *)base); break;
    case K_FLOAT: snprintf(buf, n, "%.17g", *(const double *)base); break;
    case K_BOOL: snprintf(buf, n, "%s", *(const int *)base ? "true" : "false"); break;
    case K_STRING: return *(char *const *)base ? *(char *const *)base : "";
    case K_ENUM: snprintf(buf, n, "%s", k->enums[*(const int *)base]); break;
    case K_TARGETS: {
        int64_t bits = *(const int64_t *)base;
        buf[0] = 0;
        for (int i = 0; i < TARGET_COUNT; i++)
            if (bits & (1 << i)) {
                strncat(buf, buf[0] ? "," : "", n - strlen(buf) - 1);
                strncat(buf, config_target_names[i], n - strlen(buf) - 1);
            }
        break;
    }
    }
    return buf;
}

static int emit(yaml_emitter_t *em, yaml_event_t *ev)
{
    return yaml_emitter_emit(em, ev) ? 0 : -1;
}

static int emit_scalar(yaml_emitter_t *em, const char *s, int plain_only)
{
    yaml_event_t ev;
    yaml_scalar_event_initialize(&ev, NULL, NULL, (yaml_char_t *)s, (int)strlen(s), 1,
                                 !plain_only, plain_only ? YAML_PLAIN_SCALAR_STYLE
                                                         : YAML_ANY_SCALAR_STYLE);
    return emit(em, &ev);
}

static int write_file_handler(void *data, unsigned char *buffer, size_t size)
{
    return fwrite(buffer, 1, size, (FILE *)data) == size;
}

int config_write_yaml(const config_t *cfg, FILE *f, sp_err *err)
{
    yaml_emitter_t em;
    yaml_event_t ev;
    int bad_ = 0;
    yaml_emitter_initialize(&em);
    yaml_emitter_set_output(&em, write_file_handler, f);
    yaml_stream_start_event_initialize(&ev, YAML_UTF8_ENCODING);
    bad_ |= emit(&em, &ev);
    yaml_document_start_event_initialize(&ev, NULL, NULL, NULL, 1);
    bad_ |= emit(&em, &ev);
    yaml_mapping_start_event_initialize(&ev, NULL, NULL, 1, YAML_BLOCK_MAPPING_STYLE);
    bad_ |= emit(&em, &ev);
    char section[64] = "";
    for (size_t i = 0; i < NKEYS && !bad_; i++) {
        const key_def *k = &keys[i];
        const char *dot = strchr(k->name, '.');
        size_t sl = (size_t)(dot - k->name);
        if (strlen(section) != sl || strncmp(section, k->name, sl) != 0) {
            if (section[0]) {
                yaml_mapping_end_event_initialize(&ev);
                bad_ |= emit(&em, &ev);
            }
            snprintf(section, sizeof section, "%.*s", (int)sl, k->name);
            bad_ |= emit_scalar(&em, section, 1);
            yaml_mapping_start_event_initialize(&ev, NULL, NULL, 1, YAML_BLOCK_MAPPING_STYLE);
            bad_ |= emit(&em, &ev);
        }
        char buf[VALUE_TEXT_MAX];
        const char *val = value_text(cfg, k, buf);
        bad_ |= emit_scalar(&em, dot + 1, 1);
        if (k->type == K_TARGETS) { /* val is buf */
            yaml_sequence_start_event_initialize(&ev, NULL, NULL, 1, YAML_FLOW_SEQUENCE_STYLE);
            bad_ |= emit(&em, &ev);
            char *save = NULL;
            for (char *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save))
                bad_ |= emit_scalar(&em, t, 1);
            yaml_sequence_end_event_initialize(&ev);
            bad_ |= emit(&em, &ev);
        } else {
            /* strings may need quoting; numbers and words are plain */
            bad_ |= emit_scalar(&em, val, k->type != K_STRING);
        }
    }
    if (section[0]) {
        yaml_mapping_end_event_initialize(&ev);
        bad_ |= emit(&em, &ev);
    }
    yaml_mapping_end_event_initialize(&ev);
    bad_ |= emit(&em, &ev);
    yaml_document_end_event_initialize(&ev, 1);
    bad_ |= emit(&em, &ev);
    yaml_stream_end_event_initialize(&ev);
    bad_ |= emit(&em, &ev);
    int flushed = yaml_emitter_flush(&em);
    yaml_emitter_delete(&em);
    if (bad_ || !flushed)
        return sp_fail(err, SP_EXIT_OTHER, "cannot write the resolved config");
    return 0;
}

uint64_t config_math_hash(const config_t *cfg)
{
    uint64_t h = SP_FNV_INIT;
    for (size_t i = 0; i < NKEYS; i++) {
        const key_def *k = &keys[i];
        if (!k->math || strcmp(k->name, "model.path") == 0)
            continue; /* the model is identified by its content, not its path */
        char buf[VALUE_TEXT_MAX];
        const char *val = value_text(cfg, k, buf);
        if (k->math == MATH_SINCE && k->def && strcmp(val, k->def) == 0)
            continue;
        h = sp_fnv1a(h, k->name, strlen(k->name) + 1);
        h = sp_fnv1a(h, val, strlen(val) + 1);
    }
    return h;
}

int config_diff_math(const config_t *a, const config_t *b, char *buf, size_t n)
{
    int count = 0;
    buf[0] = 0;
    for (size_t i = 0; i < NKEYS; i++) {
        const key_def *k = &keys[i];
        if (!k->math || strcmp(k->name, "model.path") == 0)
            continue;
        char abuf[VALUE_TEXT_MAX], bbuf[VALUE_TEXT_MAX];
        const char *va = value_text(a, k, abuf), *vb = value_text(b, k, bbuf);
        if (strcmp(va, vb) == 0)
            continue;
        size_t len = strlen(buf); /* a message: cut to the caller's buffer */
        sp_cutf(buf + len, n - len, "%s%s (%s, now %s)", count ? ", " : "", k->name, va, vb);
        count++;
    }
    return count;
}

void config_write_reference(FILE *f)
{
    const char *types[] = {"integer", "number", "boolean", "string", "choice", "list"};
    fprintf(f, "| key | type | default | range / choices | on resume | meaning |\n");
    fprintf(f, "| --- | --- | --- | --- | --- | --- |\n");
    for (size_t i = 0; i < NKEYS; i++) {
        const key_def *k = &keys[i];
        char range[256] = "";
        if (k->type == K_INT)
            snprintf(range, sizeof range, "%.0f .. %s", k->min,
                     k->max >= BIG ? "any" : "max");
        if (k->type == K_INT && k->max < BIG)
            snprintf(range, sizeof range, "%.0f .. %.0f", k->min, k->max);
        if (k->type == K_FLOAT)
            snprintf(range, sizeof range, "%g .. %g", k->min, k->max);
        if (k->type == K_ENUM)
            for (int j = 0; k->enums[j]; j++) {
                strncat(range, j ? ", " : "", sizeof range - strlen(range) - 1);
                strncat(range, k->enums[j], sizeof range - strlen(range) - 1);
            }
        fprintf(f, "| `%s` | %s | %s | %s | %s | %s |\n", k->name, types[k->type],
                k->def ? (*k->def ? k->def : "(empty)") : "**required**", range,
                k->math ? "must match" : "may change", k->doc);
    }
}

void config_free(config_t *cfg)
{
    for (size_t i = 0; i < NKEYS; i++)
        if (keys[i].type == K_STRING) {
            char **p = (char **)((char *)cfg + keys[i].offset);
            free(*p);
            *p = NULL;
        }
    free(cfg->source);
    cfg->source = NULL;
}
