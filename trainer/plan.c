/* The plan of a run: memory by part, fit, fixes, speed, cost, checkpoint. */
#define _POSIX_C_SOURCE 200809L
#include "plan.h"

#include <ctype.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>

#include "bench.h"
#include "config.h"
#include "model.h"

/* Rentable cards. Memory and dense (no sparsity) bf16 tensor-core peak with
 * fp32 accumulation, from the vendor's documents:
 *   RTX 3090: NVIDIA Ampere GA102 GPU Architecture whitepaper, appendix table
 *     (GeForce RTX 3090: 24 GB GDDR6X; peak BF16 tensor TFLOPS with FP32
 *     accumulate 71 dense / 142 sparse)
 *   RTX 4090: NVIDIA Ada GPU Architecture whitepaper, appendix table
 *     (24 GB GDDR6X; BF16 tensor with FP32 accumulate 165.2 / 330.4)
 *   A10: NVIDIA A10 Tensor Core GPU datasheet (24 GB GDDR6; BF16 125 / 250)
 *   L4: NVIDIA L4 Tensor Core GPU datasheet (24 GB; BF16 242 with sparsity: 121)
 *   L40S: NVIDIA L40S GPU datasheet (48 GB GDDR6; BF16 362.05 / 733)
 *   A100 40GB, 80GB: NVIDIA A100 Tensor Core GPU datasheet (40 GB HBM2,
 *     80 GB HBM2e; BF16 312 / 624)
 *   H100 SXM: NVIDIA H100 Tensor Core GPU datasheet (80 GB; BF16 1,979 with
 *     sparsity: 989)
 *   H200: NVIDIA H200 Tensor Core GPU datasheet (141 GB HBM3e; BF16 1,979
 *     with sparsity: 989)
 * A card's "GB" is taken as GiB of device memory (A100 80GB: 81920 MiB); what
 * the driver and ECC keep of it is part of the headroom. device_key matches
 * the name the CUDA driver reports. */
static const plan_gpu gpus[] = {
    {"RTX3090", "RTX 3090 24GB", 24, 71.0, "RTX 3090"},
    {"RTX4090", "RTX 4090 24GB", 24, 165.2, "RTX 4090"},
    {"A10", "A10 24GB", 24, 125.0, "A10"},
    {"L4", "L4 24GB", 24, 121.0, "L4"},
    {"L40S", "L40S 48GB", 48, 362.0, "L40S"},
    {"A100-40GB", "A100 40GB", 40, 312.0, "A100"},
    {"A100-80GB", "A100 80GB", 80, 312.0, "A100"},
    {"H100", "H100 80GB SXM", 80, 989.0, "H100 80GB HBM3"},
    {"H200", "H200 141GB", 141, 989.0, "H200"},
};
#define NGPUS ((int)(sizeof gpus / sizeof gpus[0]))

/* Preemption notices: AWS's two-minute spot interruption notice; GCP's and
 * Azure's 30 seconds (preemptible/spot VMs, scheduled events); Alibaba Cloud
 * releases a preemptible instance about 5 minutes after it is marked for
 * release ("What are preemptible instances", ECS documentation). */
static const plan_cloud clouds[] = {
    {"AWS", 120.0}, {"GCP", 30.0}, {"Azure", 30.0}, {"Alibaba Cloud", 300.0}};
#define NCLOUDS ((int)(sizeof clouds / sizeof clouds[0]))

/* MFU measured by scripts/gpu_check.sh (docs/perf.md's GPU table), in the
 * honest convention, without recomputation (the plan adds its FLOPs): a row
 * per card and mode; add rows as they come. QLoRA's 13B row ran with
 * recompute layer, so its MFU is not one the plan can use as it is. */
static const struct {
    const char *device_key;
    int mode;
    double mfu;
    const char *source;
} measured[] = {{"H200", PLAN_LORA, 0.482,
                 "docs/perf.md, 7B LoRA r16 micro-batch 1, seq 2048, H200, 2026-12-04 (b95b2a9)"},
                {"H100 80GB SXM", PLAN_LORA, 0.495,
                 "docs/perf.md, 7B LoRA r16 micro-batch 1, seq 2048, H100 80GB HBM3, 2026-12-05 "
                 "(edd6fbe)"},
                {NULL, 0, 0.0, NULL}};

/* Assumed when nothing is measured (a stated default, not a measurement). */
static double default_mfu(int mode)
{
    return mode == PLAN_QLORA ? 0.30 : 0.40;
}

int plan_gpu_count(void)
{
    return NGPUS;
}

const plan_gpu *plan_gpu_at(int i)
{
    return i >= 0 && i < NGPUS ? &gpus[i] : NULL;
}

/* lower case without spaces, dashes and underscores */
static void squash(char *dst, size_t n, const char *src)
{
    size_t k = 0;
    for (; *src && k + 1 < n; src++)
        if (*src != ' ' && *src != '-' && *src != '_')
            dst[k++] = (char)tolower((unsigned char)*src);
    dst[k] = 0;
}

const plan_gpu *plan_gpu_find(const char *name)
{
    char want[96], a[96], b[96];
    squash(want, sizeof want, name);
    if (!want[0])
        return NULL;
    for (int i = 0; i < NGPUS; i++) {
        squash(a, sizeof a, gpus[i].name);
        squash(b, sizeof b, gpus[i].label);
        if (!strcmp(want, a) || !strcmp(want, b))
            return &gpus[i];
    }
    /* short forms of the H100 SXM ("A100" alone is ambiguous: not found) */
    if (!strcmp(want, "h10080gb") || !strcmp(want, "h100sxm"))
        return plan_gpu_find("H100");
    return NULL;
}

const plan_gpu *plan_gpu_for_device(const char *device_name)
{
    /* device_key as a whole word of the name ("A10" is not "A10G" or "A100");
     * the two A100s by their memory */
    for (int i = 0; i < NGPUS; i++) {
        size_t k = strlen(gpus[i].device_key);
        for (const char *s = strstr(device_name, gpus[i].device_key); s;
             s = strstr(s + 1, gpus[i].device_key)) {
            char after = s[k];
            if (after && after != ' ' && after != '-')
                continue;
            if (!strcmp(gpus[i].device_key, "A100") &&
                (strstr(device_name, "80GB") != NULL) != (gpus[i].mem_gib == 80))
                continue;
            return &gpus[i];
        }
    }
    return NULL;
}

const char *plan_gpu_names(void)
{
    static char buf[256];
    if (!buf[0])
        for (int i = 0; i < NGPUS; i++) {
            strncat(buf, i ? ", " : "", sizeof buf - strlen(buf) - 1);
            strncat(buf, gpus[i].name, sizeof buf - strlen(buf) - 1);
        }
    return buf;
}

int plan_cloud_count(void)
{
    return NCLOUDS;
}

const plan_cloud *plan_cloud_at(int i)
{
    return i >= 0 && i < NCLOUDS ? &clouds[i] : NULL;
}

void plan_input_defaults(plan_input *in)
{
    memset(in, 0, sizeof *in);
    in->mode = PLAN_LORA;
    in->lora_r = 16;
    in->lora_targets = (1 << TARGET_COUNT) - 1;
    in->seq_len = 2048;
    in->micro_batch = 1;
    in->grad_accum = 1;
    in->recompute = RECOMPUTE_NONE;
    in->shard_optimizer = 1;
    in->shard_gradients = 1;
    in->gpus_per_node = 1;
    in->nodes = 1;
    in->headroom_bytes = -1;
    in->epochs = 1;
}

void plan_input_from_config(plan_input *in, const config_t *c)
{
    in->mode = c->mode == MODE_FULL                 ? PLAN_FULL
               : c->model_quantize == QUANT_NF4 ? PLAN_QLORA
                                                : PLAN_LORA;
    in->lora_r = c->lora_r;
    in->lora_targets = c->lora_targets;
    in->lora_dropout = c->lora_dropout;
    in->lora_dora = c->lora_dora;
    in->seq_len = c->seq_len;
    in->micro_batch = c->micro_batch;
    in->grad_accum = c->grad_accum;
    in->packing = c->data_packing;
    in->recompute = c->recompute;
    in->shard_optimizer = c->shard_optimizer;
    in->shard_gradients = c->shard_gradients;
}

void plan_input_set_gpu(plan_input *in, const plan_gpu *g)
{
    snprintf(in->gpu_label, sizeof in->gpu_label, "%s", g->label);
    in->gpu_mem_bytes = g->mem_gib * 1024.0 * 1024.0 * 1024.0;
    in->gpu_tflops = g->bf16_tflops;
}

int plan_load_model(plan_input *in, const char *what, sp_err *err)
{
    snprintf(in->model_name, sizeof in->model_name, "%s", what);
    if (model_config_preset(&in->mc, what) == 0)
        return 0;
    size_t n = strlen(what);
    if (n >= 11 && !strcmp(what + n - 11, "config.json")) {
        /* a config.json path: model_config_load takes its directory */
        char dir[4096];
        if (n - 11 >= sizeof dir)
            return sp_fail(err, SP_EXIT_USAGE, "%s: path too long", what);
        if (n > 11 && what[n - 12] != '/')
            return model_config_load(&in->mc, what, err); /* "xconfig.json": a directory */
        size_t k = n > 12 ? n - 12 : 0; /* without the slash */
        memcpy(dir, what, k);
        dir[k] = 0;
        if (n == 11)
            strcpy(dir, ".");
        else if (k == 0)
            strcpy(dir, "/");
        return model_config_load(&in->mc, dir, err);
    }
    return model_config_load(&in->mc, what, err);
}

static int check_input(const plan_input *in, sp_err *err)
{
    const model_config_t *mc = &in->mc;
    if (mc->layers <= 0 || mc->hidden <= 0 || mc->vocab <= 0)
        return sp_fail(err, SP_EXIT_USAGE, "plan: no model (a preset, a config.json or a "
                                            "model directory)");
    if (in->mode < PLAN_LORA || in->mode > PLAN_QLORA)
        return sp_fail(err, SP_EXIT_USAGE, "plan: --mode must be lora, qlora or full");
    if (in->seq_len < 2 || in->seq_len > (1 << 20))
        return sp_fail(err, SP_EXIT_USAGE,
                       "plan: --seq-len (train.seq_len) %lld is out of range [2, 1048576]",
                       (long long)in->seq_len);
    if (in->micro_batch < 1 || in->micro_batch > 4096)
        return sp_fail(err, SP_EXIT_USAGE,
                       "plan: --micro-batch (train.micro_batch) %lld is out of range [1, 4096]",
                       (long long)in->micro_batch);
    if (in->grad_accum < 1)
        return sp_fail(err, SP_EXIT_USAGE, "plan: train.grad_accum %lld must be at least 1",
                       (long long)in->grad_accum);
    if (in->mode != PLAN_FULL && (in->lora_r < 1 || in->lora_r > 65536))
        return sp_fail(err, SP_EXIT_USAGE,
                       "plan: --lora-r (lora.r) %lld is out of range [1, 65536]",
                       (long long)in->lora_r);
    if (in->mode != PLAN_FULL && !(in->lora_targets & ((1 << TARGET_COUNT) - 1)))
        return sp_fail(err, SP_EXIT_USAGE, "plan: lora.targets is empty");
    if (in->recompute < RECOMPUTE_NONE || in->recompute > RECOMPUTE_LAYER)
        return sp_fail(err, SP_EXIT_USAGE,
                       "plan: --recompute must be none, attention or layer");
    if (in->gpus_per_node < 1 || in->gpus_per_node > 1024)
        return sp_fail(err, SP_EXIT_USAGE, "plan: --gpus %d is out of range [1, 1024]",
                       in->gpus_per_node);
    if (in->nodes < 1 || in->nodes > 4096)
        return sp_fail(err, SP_EXIT_USAGE, "plan: --nodes %d is out of range [1, 4096]",
                       in->nodes);
    if (!(in->gpu_mem_bytes > 0) || !isfinite(in->gpu_mem_bytes))
        return sp_fail(err, SP_EXIT_USAGE,
                       "plan: no GPU memory: give --gpu NAME (%s) or --gpu-mem GiB",
                       plan_gpu_names());
    if (!in->cpu && (!(in->gpu_tflops > 0) || !isfinite(in->gpu_tflops)))
        return sp_fail(err, SP_EXIT_USAGE,
                       "plan: no GPU peak: give --gpu NAME or --gpu-tflops T (dense bf16 "
                       "TFLOP/s)");
    if (in->headroom_bytes >= in->gpu_mem_bytes)
        return sp_fail(err, SP_EXIT_USAGE,
                       "plan: --headroom %.2f GiB leaves nothing of the %.2f GiB card",
                       in->headroom_bytes / (1 << 30), in->gpu_mem_bytes / (1 << 30));
    if (in->mfu > 1 || !isfinite(in->mfu))
        return sp_fail(err, SP_EXIT_USAGE, "plan: --mfu %g must be a fraction in (0, 1]",
                       in->mfu);
    if (in->price_per_hour < 0 || !isfinite(in->price_per_hour))
        return sp_fail(err, SP_EXIT_USAGE, "plan: --price-per-hour %g must be 0 or more",
                       in->price_per_hour);
    if (in->tokens < 0 || !isfinite(in->tokens))
        return sp_fail(err, SP_EXIT_USAGE, "plan: --tokens %g must be 0 or more", in->tokens);
    if (!(in->epochs > 0) || !isfinite(in->epochs))
        return sp_fail(err, SP_EXIT_USAGE, "plan: --epochs %g must be more than 0", in->epochs);
    if (in->upload_mbps < 0 || !isfinite(in->upload_mbps))
        return sp_fail(err, SP_EXIT_USAGE, "plan: --upload-mbps %g must be 0 or more",
                       in->upload_mbps);
    if (mc->sliding_window > 0 && mc->sliding_window < in->seq_len)
        return sp_fail(err, SP_EXIT_USAGE,
                       "plan: %s: sliding_window %lld is shorter than --seq-len %lld; spotune "
                       "supports only full attention within a window",
                       in->model_name, (long long)mc->sliding_window, (long long)in->seq_len);
    return 0;
}

/* Parameters of the projections' weight matrices (what QLoRA quantizes). */
static double proj_weight_params(const model_config_t *mc)
{
    double n = 0;
    for (int p = 0; p < PROJ_COUNT; p++) {
        int64_t i, o;
        model_config_proj_dims(mc, p, &i, &o);
        n += (double)mc->layers * (double)i * (double)o;
    }
    return n;
}

static double lora_params(const model_config_t *mc, int64_t r, int64_t targets, int dora)
{
    double n = 0;
    for (int p = 0; p < PROJ_COUNT; p++)
        if (targets & (1 << p)) {
            int64_t i, o;
            model_config_proj_dims(mc, p, &i, &o);
            n += (double)mc->layers * ((double)r * (double)(i + o) + (dora ? (double)o : 0.0));
        }
    return n;
}

/* Everything but the fixes. */
static void plan_one(const plan_input *in, plan_result *r)
{
    const model_config_t *mc = &in->mc;
    int world = in->gpus_per_node * in->nodes;
    int full = in->mode == PLAN_FULL;
    dtype_t act = in->cpu ? DT_F32 : DT_BF16;
    model_opts o = {.mode = full ? MODE_FULL : MODE_LORA, .lora_r = in->lora_r,
                    .lora_alpha = 2.0 * (double)in->lora_r, .lora_dropout = in->lora_dropout,
                    .lora_targets = in->lora_targets, .dora = !full && in->lora_dora,
                    .nf4 = in->mode == PLAN_QLORA, .max_batch = in->micro_batch,
                    .seq_len = in->seq_len, .recompute = in->recompute, .seed = 1};
    r->params = model_config_params(mc);
    double trainable = full ? (double)r->params
                            : lora_params(mc, in->lora_r, in->lora_targets, in->lora_dora);
    r->trainable_params = (int64_t)trainable;
    r->sharded = full && in->shard_optimizer && world > 1 && trainable > 0;
    if (r->sharded) {
        o.shard_count = world;
        o.shard_grads = in->shard_gradients;
    }
    r->grads_sharded = model_shards_grads(&o);
    model_plan p;
    model_plan_bytes(mc, &o, act, &p);

    plan_mem *m = &r->mem;
    memset(m, 0, sizeof *m);
    /* QLoRA: model_plan_bytes counts the seven projections as model.quantize
     * nf4 stores them (nf4_bytes: PLAN_NF4_BITS per weight, rounded up per
     * matrix, and its offset), the rest (embeddings, lm_head, norms, biases)
     * as they are, and the one dequantized projection in its scratch */
    m->weights = (double)p.weights;
    /* model_plan_bytes' trainable arenas, split: gradients fp32, AdamW m and
     * v fp32, the rest (fp32 masters and the compute copy) trainable state */
    if (r->sharded) {
        size_t shard = model_shard_len((size_t)trainable, world);
        size_t padded = shard * (size_t)world;
        r->shard_params = (int64_t)shard;
        /* whole + reduced shard, or with sharded gradients shard + buckets */
        m->gradients = 4.0 * (double)(r->grads_sharded ? model_grad_buckets_len(mc, &o) : padded) +
                       4.0 * (double)shard;
        m->optimizer = 8.0 * (double)shard;
    } else {
        r->shard_params = (int64_t)trainable;
        m->gradients = 4.0 * trainable;
        m->optimizer = 8.0 * trainable;
    }
    m->trainable = (double)p.trainable - m->gradients - m->optimizer;
    m->activations = (double)p.activations;
    m->workspace = (double)p.scratch;
    if (!in->cpu)
        m->workspace += PLAN_CUDA_WORKSPACE;
    m->total = m->weights + m->trainable + m->gradients + m->optimizer + m->activations +
               m->workspace;
    if (in->cpu)
        r->headroom_bytes = in->headroom_bytes > 0 ? in->headroom_bytes : 0;
    else
        r->headroom_bytes = in->headroom_bytes >= 0
                                ? in->headroom_bytes
                                : PLAN_HEADROOM_FIXED + PLAN_HEADROOM_FRACTION * in->gpu_mem_bytes;
    r->usable_bytes = in->gpu_mem_bytes - r->headroom_bytes;
    r->fits = m->total <= r->usable_bytes;

    /* speed */
    r->flops_per_token = bench_flops_per_token(mc, full ? MODE_FULL : MODE_LORA,
                                               full ? 0.0 : trainable, in->seq_len);
    r->flops_6n = bench_flops_6n(mc);
    double attn_fwd = 4.0 * (double)mc->layers * (double)(mc->heads * mc->head_dim) *
                      (double)in->seq_len;
    r->recompute_flops = 0;
    if (in->recompute == RECOMPUTE_ATTENTION)
        r->recompute_flops = attn_fwd;
    else if (in->recompute == RECOMPUTE_LAYER) /* the layers' forward again */
        r->recompute_flops = 2.0 * (proj_weight_params(mc) + (full ? 0.0 : trainable)) + attn_fwd;
    r->mfu_measured = 0;
    r->mfu = in->mfu > 0 ? in->mfu : default_mfu(in->mode);
    if (in->mfu > 0)
        snprintf(r->mfu_source, sizeof r->mfu_source, "given (--mfu)");
    else
        snprintf(r->mfu_source, sizeof r->mfu_source,
                 "assumed: the default for %s (%.0f%%); no measurement of this card and mode in "
                 "docs/perf.md",
                 in->mode == PLAN_QLORA ? "QLoRA" : full ? "full fine-tuning" : "LoRA",
                 100.0 * r->mfu);
    for (size_t i = 0; in->mfu <= 0 && measured[i].device_key; i++)
        if (strstr(in->gpu_label, measured[i].device_key) && measured[i].mode == in->mode) {
            r->mfu = measured[i].mfu;
            r->mfu_measured = 1;
            snprintf(r->mfu_source, sizeof r->mfu_source, "measured: %s",
                     measured[i].source ? measured[i].source : "docs/perf.md");
        }
    /* MFU counts the model's FLOPs; recomputation is extra work at that rate */
    r->tokens_per_s_gpu = in->gpu_tflops > 0 ? r->mfu * in->gpu_tflops * 1e12 /
                                                   (r->flops_per_token + r->recompute_flops)
                                             : 0;
    r->tokens_per_s = r->tokens_per_s_gpu * world;
    r->job_tokens = in->tokens * in->epochs;
    r->wall_s = r->job_tokens > 0 && r->tokens_per_s > 0 ? r->job_tokens / r->tokens_per_s : 0;
    r->cost = r->wall_s / 3600.0 * in->price_per_hour * world;

    /* checkpoint: params/, adam_m/, adam_v/ in float32, one value each per
     * trainable weight (gathered whole when sharded); the attributes and
     * metrics.jsonl are small beside them */
    r->ckpt_bytes = 12.0 * trainable;
    r->ckpt_sharded = r->sharded && in->nodes <= 1;
    r->ckpt_rank_bytes = r->ckpt_sharded ? 12.0 * (double)r->shard_params : r->ckpt_bytes;
    r->ckpt_stall_s = r->ckpt_rank_bytes / (in->cpu ? PLAN_HOST_COPY_BYTES_S : PLAN_D2H_BYTES_S);
    r->upload_s = in->upload_mbps > 0 ? r->ckpt_bytes * 8.0 / (in->upload_mbps * 1e6) : 0;
}

static const char *recompute_name(int r)
{
    static const char *names[] = {"none", "attention", "layer"};
    return r >= 0 && r <= 2 ? names[r] : "?";
}

static void add_fix(plan_result *r, const plan_input *v, const plan_result *vr,
                    const char *what)
{
    if (r->nfixes >= PLAN_MAX_FIXES)
        return;
    plan_fix *f = &r->fixes[r->nfixes++];
    snprintf(f->what, sizeof f->what, "%s", what);
    f->mode = v->mode;
    f->micro_batch = v->micro_batch;
    f->grad_accum = v->grad_accum;
    f->recompute = v->recompute;
    f->gpus_per_node = v->gpus_per_node;
    f->nodes = v->nodes;
    f->mem = vr->mem;
    f->tokens_per_s = vr->tokens_per_s;
}

static int fits(const plan_input *v, plan_result *vr)
{
    plan_one(v, vr);
    return vr->fits;
}

/* The largest micro-batch below v's that divides it (the global batch stays
 * the same with grad_accum scaled) and fits; 0 when none. */
static int64_t fitting_micro_batch(plan_input *v, plan_result *vr)
{
    int64_t mb = v->micro_batch, acc = v->grad_accum;
    for (int64_t d = mb - 1; d >= 1; d--) {
        if (mb % d)
            continue;
        v->micro_batch = d;
        v->grad_accum = acc * (mb / d);
        if (fits(v, vr))
            return d;
    }
    v->micro_batch = mb;
    v->grad_accum = acc;
    return 0;
}

static void describe(char *buf, size_t n, const plan_input *base, const plan_input *v)
{
    buf[0] = 0;
    size_t k = 0;
#define PUT(...)                                                                  \
    do {                                                                          \
        if (k < n)                                                                \
            k += (size_t)snprintf(buf + k, n - k, __VA_ARGS__);                   \
    } while (0)
    if (v->mode != base->mode && v->mode == PLAN_QLORA)
        PUT("mode qlora (model.quantize nf4: %s r %lld on NF4 weights)",
            v->lora_dora ? "DoRA" : "LoRA", (long long)v->lora_r);
    else if (v->mode != base->mode)
        PUT("mode lora (r %lld) instead of full fine-tuning", (long long)v->lora_r);
    if (v->recompute != base->recompute)
        PUT("%sruntime.recompute: %s", k ? ", " : "", recompute_name(v->recompute));
    if (v->micro_batch != base->micro_batch)
        PUT("%strain.micro_batch: %lld, train.grad_accum: %lld (the same global batch)",
            k ? ", " : "", (long long)v->micro_batch, (long long)v->grad_accum);
    if (v->gpus_per_node != base->gpus_per_node || v->nodes != base->nodes)
        PUT("%s%d GPUs (%d node%s x %d), optimizer%s sharded", k ? ", " : "",
            v->gpus_per_node * v->nodes, v->nodes, v->nodes == 1 ? "" : "s", v->gpus_per_node,
            v->shard_gradients ? " and gradients" : "");
#undef PUT
}

/* The cheapest variant of mode `mode` that fits: recompute from the given
 * setting up to layer, then smaller micro-batches (a DoRA run stays DoRA on
 * the NF4 base). */
static int cheapest_in_mode(const plan_input *in, int mode, plan_input *v, plan_result *vr)
{
    for (int rec = in->recompute; rec <= RECOMPUTE_LAYER; rec++) {
        *v = *in;
        v->mode = mode;
        v->recompute = rec;
        if (fits(v, vr) || fitting_micro_batch(v, vr))
            return 1;
    }
    return 0;
}

static void find_fixes(const plan_input *in, plan_result *r)
{
    plan_input v;
    plan_result vr;
    char what[240];
    /* 1. recompute (compute for memory, same math) */
    for (int rec = in->recompute + 1; rec <= RECOMPUTE_LAYER; rec++) {
        v = *in;
        v.recompute = rec;
        if (fits(&v, &vr)) {
            describe(what, sizeof what, in, &v);
            add_fix(r, &v, &vr, what);
            break;
        }
    }
    /* 2. smaller micro-batches, at the given recompute, then with layer recompute */
    v = *in;
    if (fitting_micro_batch(&v, &vr)) {
        describe(what, sizeof what, in, &v);
        add_fix(r, &v, &vr, what);
    } else if (in->recompute < RECOMPUTE_LAYER) {
        v = *in;
        v.recompute = RECOMPUTE_LAYER;
        if (fitting_micro_batch(&v, &vr)) {
            describe(what, sizeof what, in, &v);
            add_fix(r, &v, &vr, what);
        }
    }
    /* 3. full fine-tuning: more GPUs, the optimizer (and with
     * train.shard_gradients the fp32 gradient) sharded over them; the bf16
     * copy stays whole on every GPU */
    if (in->mode == PLAN_FULL && in->shard_optimizer) {
        int found = 0;
        for (int rec = in->recompute; rec <= RECOMPUTE_LAYER && !found; rec++) {
            int gpn = in->gpus_per_node, nodes = in->nodes;
            /* at most 64 GPUs (8 nodes of 8), or the run's own count */
            for (int step = 0; step < 80 && !found; step++) {
                if (in->nodes == 1 && in->gpus_per_node < 8 && gpn < 8)
                    gpn *= 2; /* fill one machine first: 2, 4, 8 GPUs */
                else {
                    if (gpn < 8 && in->gpus_per_node == 1)
                        gpn = 8;
                    nodes++;
                }
                if (gpn * nodes <= in->gpus_per_node * in->nodes)
                    continue;
                if (gpn * nodes > 64)
                    break;
                v = *in;
                v.recompute = rec;
                v.gpus_per_node = gpn;
                v.nodes = nodes;
                if (fits(&v, &vr)) {
                    found = 1;
                    describe(what, sizeof what, in, &v);
                    add_fix(r, &v, &vr, what);
                }
            }
        }
    }
    /* 4. full fine-tuning: LoRA instead */
    if (in->mode == PLAN_FULL && cheapest_in_mode(in, PLAN_LORA, &v, &vr)) {
        describe(what, sizeof what, in, &v);
        add_fix(r, &v, &vr, what);
    }
    /* 5. QLoRA (LoRA on 4-bit frozen weights) */
    if (in->mode != PLAN_QLORA && cheapest_in_mode(in, PLAN_QLORA, &v, &vr)) {
        describe(what, sizeof what, in, &v);
        add_fix(r, &v, &vr, what);
    }
}

int plan_compute(const plan_input *in, plan_result *out, sp_err *err)
{
    memset(out, 0, sizeof *out);
    if (check_input(in, err))
        return err->code;
    plan_one(in, out);
    if (!out->fits)
        find_fixes(in, out);
    return 0;
}
