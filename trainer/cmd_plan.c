/* `spotune plan`: options, a run YAML or a model, the table or JSON. */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <getopt.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "data.h"
#include "plan.h"

#define GIB (1024.0 * 1024.0 * 1024.0)

static void plan_usage(FILE *f)
{
    fprintf(f,
            "usage: spotune plan MODEL|PRESET|RUN.yaml [options]\n"
            "Plans a run before renting a GPU: per-GPU memory by part and whether it fits,\n"
            "the changes that make it fit, expected tokens/s, wall time and cost, checkpoint\n"
            "size and upload time against each cloud's preemption notice. No GPU, no weights:\n"
            "MODEL is a model directory or its config.json alone; PRESET is tiny, small,\n"
            "llama-7b or llama-13b; RUN.yaml a training config (its model.path, train.*,\n"
            "model.quantize (nf4: qlora), lora.* and runtime.recompute; options given here\n"
            "win).\n"
            "  --model DIR|config.json|PRESET  the model, instead of RUN.yaml's model.path\n"
            "  --mode lora|qlora|full   (default lora; qlora: LoRA on NF4 weights,\n"
            "                           model.quantize nf4)\n"
            "  --lora-r N               LoRA rank (default 16, all 7 projections)\n"
            "  --seq-len N              tokens per window (default 2048)\n"
            "  --micro-batch N          windows per GPU per micro-step (default 1)\n"
            "  --recompute none|attention|layer   (default none)\n"
            "  --gpu NAME               a card of the table (--list-gpus): %s\n"
            "  --gpu-mem GiB            memory per GPU (instead of, or over, --gpu's)\n"
            "  --gpu-tflops T           dense bf16 peak per GPU (instead of, or over, --gpu's)\n"
            "  --gpus N                 GPUs per node (default 1)\n"
            "  --nodes M                nodes (default 1)\n"
            "  --headroom GiB           memory kept free per GPU (default 1 GiB + 5%% of the card)\n"
            "  --mfu F                  model FLOPs utilisation to assume, 0-1 (default:\n"
            "                           measured in docs/perf.md, else 0.40; QLoRA 0.30)\n"
            "  --price-per-hour USD     price of one GPU-hour\n"
            "  --tokens N               tokens of one epoch (or --dataset FILE.h5: its windows)\n"
            "  --dataset FILE.h5        a dataset made by prepare-text or prepare_data.py\n"
            "  --epochs E               epochs (default 1; with RUN.yaml and neither --tokens\n"
            "                           nor --dataset the job is train.steps global batches)\n"
            "  --upload-mbps M          upload bandwidth to the object store, Mbit/s\n"
            "  --json                   one JSON object instead of the table\n"
            "  --list-gpus              print the table of cards and exit\n"
            "Exit codes: 0 planned (fitting or not: see \"fits\"), 2 bad option, or nothing\n"
            "fits the GPU, 3 bad model config.json or dataset.\n",
            plan_gpu_names());
}

static int num_opt(const char *opt, const char *s, double lo, double *out, sp_err *err)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (end == s || *end || errno || !isfinite(v) || v < lo)
        return sp_fail(err, SP_EXIT_USAGE, "plan: %s '%s' is not a number of at least %g", opt,
                       s, lo);
    *out = v;
    return 0;
}

static int int_opt(const char *opt, const char *s, long long lo, long long hi, int64_t *out,
                   sp_err *err)
{
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (end == s || *end || errno || v < lo || v > hi)
        return sp_fail(err, SP_EXIT_USAGE, "plan: %s '%s' is not an integer in [%lld, %lld]",
                       opt, s, lo, hi);
    *out = v;
    return 0;
}

static int ends_with(const char *s, const char *tail)
{
    size_t n = strlen(s), k = strlen(tail);
    return n >= k && !strcmp(s + n - k, tail);
}

static const char *mode_name(int m)
{
    return m == PLAN_QLORA ? "qlora" : m == PLAN_FULL ? "full" : "lora";
}

static const char *recompute_name(int r)
{
    static const char *names[] = {"none", "attention", "layer"};
    return names[r];
}

static void targets_text(int64_t bits, char *buf, size_t n)
{
    buf[0] = 0;
    for (int i = 0; i < TARGET_COUNT; i++)
        if (bits & (1 << i)) {
            strncat(buf, buf[0] ? "," : "", n - strlen(buf) - 1);
            strncat(buf, config_target_names[i], n - strlen(buf) - 1);
        }
}

static void print_human(const plan_input *in, const plan_result *r, const char *tokens_from)
{
    const model_config_t *mc = &in->mc;
    int world = in->gpus_per_node * in->nodes;
    char tg[160];
    targets_text(in->lora_targets, tg, sizeof tg);
    printf("spotune plan: %s (%s, %.2fB parameters)\n", in->model_name, mc->architecture,
           (double)r->params / 1e9);
    if (in->mode == PLAN_FULL)
        printf("  mode full: every weight trains (%.2fB)%s\n", (double)r->trainable_params / 1e9,
               r->grads_sharded ? ", optimizer and gradients sharded over the GPUs "
                                  "(train.shard_optimizer, train.shard_gradients)"
               : r->sharded     ? ", optimizer sharded over the GPUs (train.shard_optimizer)"
                                : "");
    else
        printf("  mode %s%s: r %lld on %s (%.1fM trainable parameters%s)\n", mode_name(in->mode),
               in->lora_dora ? " with DoRA" : "", (long long)in->lora_r, tg,
               (double)r->trainable_params / 1e6,
               in->lora_dora ? ", a magnitude per output feature included" : "");
    printf("  seq_len %lld, micro_batch %lld, grad_accum %lld, recompute %s\n",
           (long long)in->seq_len, (long long)in->micro_batch, (long long)in->grad_accum,
           recompute_name(in->recompute));
    printf("  %d x %s (%.0f GiB, %.0f dense bf16 TFLOP/s): %d GPU%s per node x %d node%s\n\n",
           world, in->gpu_label, in->gpu_mem_bytes / GIB, in->gpu_tflops, in->gpus_per_node,
           in->gpus_per_node == 1 ? "" : "s", in->nodes, in->nodes == 1 ? "" : "s");

    const plan_mem *m = &r->mem;
    printf("memory per GPU                                                    GiB\n");
    printf("  weights          %-44s %8.2f\n",
           in->mode == PLAN_FULL    ? "none frozen (all in the trainable state)"
           : in->mode == PLAN_QLORA ? "frozen: projections NF4, the rest bf16"
                                    : "frozen, bf16",
           m->weights / GIB);
    printf("  trainable state  %-44s %8.2f\n",
           r->sharded ? "bf16 copy whole, fp32 masters of the shard" : "fp32 masters + bf16 copy",
           m->trainable / GIB);
    printf("  gradients        %-44s %8.2f\n",
           r->grads_sharded ? "fp32, the shard + 2 layer-sized buckets"
           : r->sharded     ? "fp32, whole + the reduced shard"
                            : "fp32",
           m->gradients / GIB);
    printf("  optimizer        %-44s %8.2f\n",
           r->sharded ? "AdamW m, v fp32, this GPU's shard" : "AdamW m, v fp32", m->optimizer / GIB);
    char act[64];
    snprintf(act, sizeof act, "bf16, recompute %s", recompute_name(in->recompute));
    printf("  activations      %-44s %8.2f\n", act, m->activations / GIB);
    printf("  workspace        %-44s %8.2f\n",
           in->mode == PLAN_QLORA ? "scratch, CUDA backend, dequantized NF4 weights"
                                  : "model scratch + CUDA backend",
           m->workspace / GIB);
    printf("  total                                                         %8.2f\n",
           m->total / GIB);
    printf("  usable: %.2f GiB of %.2f (headroom %.2f GiB: CUDA context, cuBLAS, NCCL, and what\n"
           "          the driver, ECC and allocation rounding keep)\n",
           r->usable_bytes / GIB, in->gpu_mem_bytes / GIB, r->headroom_bytes / GIB);
    double over = m->total - r->usable_bytes; /* below 0.01 GiB: in MiB, never "0.00" */
    if (r->fits)
        printf("  fits: yes (%.0f%% of usable)\n", 100.0 * m->total / r->usable_bytes);
    else if (over >= 0.01 * GIB)
        printf("  fits: NO, %.2f GiB more than usable\n", over / GIB);
    else
        printf("  fits: NO, %.1f MiB more than usable\n", over / (1024.0 * 1024.0));
    if (!r->fits && r->nfixes) {
        printf("\nchanges that make it fit, cheapest first (each re-planned):\n");
        for (int i = 0; i < r->nfixes; i++)
            printf("  %d. %s\n     -> %.2f GiB per GPU, %.0f tokens/s\n", i + 1, r->fixes[i].what,
                   r->fixes[i].mem.total / GIB, r->fixes[i].tokens_per_s);
    } else if (!r->fits) {
        printf("\nnothing this plan knows makes it fit (recompute, micro-batch, QLoRA, more GPUs)\n");
    }

    printf("\nspeed (an estimate)\n");
    printf("  FLOPs per token  %.2f GFLOP: matmuls 6N trainable + 4N frozen (lm_head in, the\n"
           "                   embedding gather out) + attention 12 x layers x heads x head_dim x\n"
           "                   seq_len; 6N of every parameter: %.2f GFLOP\n",
           r->flops_per_token / 1e9, r->flops_6n / 1e9);
    if (r->recompute_flops > 0)
        printf("  recompute        +%.2f GFLOP per token, not counted in MFU\n",
               r->recompute_flops / 1e9);
    printf("  MFU              %.0f%% (%s)\n", 100.0 * r->mfu, r->mfu_source);
    printf("  tokens/s         %.0f per GPU, %.0f for the job (data parallel, scaling assumed "
           "linear)\n",
           r->tokens_per_s_gpu, r->tokens_per_s);

    printf("\njob\n");
    if (r->job_tokens > 0) {
        if (r->job_tokens >= 1e9)
            printf("  tokens           %.2fB (%s)\n", r->job_tokens / 1e9, tokens_from);
        else
            printf("  tokens           %.2fM (%s)\n", r->job_tokens / 1e6, tokens_from);
        printf("  wall time        %.2f h\n", r->wall_s / 3600.0);
        if (in->price_per_hour > 0)
            printf("  cost             %.2f at %.2f per GPU-hour x %d GPU%s\n", r->cost,
                   in->price_per_hour, world, world == 1 ? "" : "s");
        else
            printf("  cost             give --price-per-hour\n");
    } else {
        printf("  give --tokens, --dataset FILE.h5 or a run YAML (train.steps) for wall time and "
               "cost\n");
    }

    printf("\ncheckpoint\n");
    printf("  size             %.*f %s (params, adam_m, adam_v: 12 bytes per trainable weight,%s)\n",
           r->ckpt_bytes >= 1e9 ? 2 : 1, r->ckpt_bytes / (r->ckpt_bytes >= 1e9 ? 1e9 : 1e6),
           r->ckpt_bytes >= 1e9 ? "GB" : "MB",
           in->mode != PLAN_FULL ? " the adapter only, never the base"
           : r->ckpt_sharded     ? " sharded: every rank writes and uploads its own file"
           : r->sharded          ? " gathered to rank 0 (several machines; sharded if they share run.dir)"
                                 : " written by rank 0");
    printf("  stall            %s%.2f s (%s %.2f GB to host memory at %.0f GB/s; writing and "
           "uploading run in the background)\n",
           r->sharded && !r->ckpt_sharded ? "at least " : "", r->ckpt_stall_s,
           r->ckpt_sharded ? "each rank copies its" : r->sharded ? "rank 0 gathers" : "rank 0 copies",
           r->ckpt_rank_bytes / 1e9, (in->cpu ? PLAN_HOST_COPY_BYTES_S : PLAN_D2H_BYTES_S) / 1e9);
    if (in->upload_mbps > 0) {
        printf("  upload           %.1f s at %.0f Mbit/s; against the preemption notice:",
               r->upload_s, in->upload_mbps);
        for (int i = 0; i < plan_cloud_count(); i++) {
            const plan_cloud *c = plan_cloud_at(i);
            printf("%s %s %.0f s %s", i ? "," : "", c->name, c->notice_s,
                   r->upload_s <= c->notice_s ? "ok" : "TOO SLOW");
        }
        printf("\n");
        if (r->upload_s > 30)
            printf("                   (a notice shorter than the upload loses the steps since "
                   "the previous checkpoint: set checkpoint.every_minutes)\n");
    } else {
        printf("  upload           give --upload-mbps for the time against each cloud's notice\n");
    }
    if (in->mode == PLAN_QLORA)
        printf("\nnote: QLoRA is LoRA on the projections stored as NF4 (model.quantize nf4), as "
               "spotune and bitsandbytes store them (%.3f bits per weight)\n",
               PLAN_NF4_BITS);
}

static json_t *mem_json(const plan_mem *m)
{
    return json_pack("{s:f, s:f, s:f, s:f, s:f, s:f, s:f}", "weights", m->weights / GIB,
                     "trainable", m->trainable / GIB, "gradients", m->gradients / GIB,
                     "optimizer", m->optimizer / GIB, "activations", m->activations / GIB,
                     "workspace", m->workspace / GIB, "total", m->total / GIB);
}

static void print_json(const plan_input *in, const plan_result *r, const char *tokens_from)
{
    json_t *j = json_object();
    json_object_set_new(j, "model", json_string(in->model_name));
    json_object_set_new(j, "architecture", json_string(in->mc.architecture));
    json_object_set_new(j, "params", json_integer(r->params));
    json_object_set_new(j, "trainable_params", json_integer(r->trainable_params));
    json_object_set_new(j, "mode", json_string(mode_name(in->mode)));
    json_object_set_new(j, "dora", json_boolean(in->mode != PLAN_FULL && in->lora_dora));
    json_object_set_new(j, "lora_r", in->mode == PLAN_FULL ? json_null() : json_integer(in->lora_r));
    json_object_set_new(j, "seq_len", json_integer(in->seq_len));
    json_object_set_new(j, "micro_batch", json_integer(in->micro_batch));
    json_object_set_new(j, "grad_accum", json_integer(in->grad_accum));
    json_object_set_new(j, "recompute", json_string(recompute_name(in->recompute)));
    json_object_set_new(j, "optimizer_sharded", json_boolean(r->sharded));
    json_object_set_new(j, "gradients_sharded", json_boolean(r->grads_sharded));
    json_object_set_new(j, "gpu", json_pack("{s:s, s:f, s:f, s:i, s:i, s:i}", "name", in->gpu_label,
                                            "mem_gib", in->gpu_mem_bytes / GIB, "bf16_tflops",
                                            in->gpu_tflops, "gpus_per_node", in->gpus_per_node,
                                            "nodes", in->nodes, "gpus",
                                            in->gpus_per_node * in->nodes));
    json_t *mem = mem_json(&r->mem);
    json_object_set_new(mem, "headroom", json_real(r->headroom_bytes / GIB));
    json_object_set_new(mem, "usable", json_real(r->usable_bytes / GIB));
    json_object_set_new(j, "memory_gib", mem);
    json_object_set_new(j, "fits", json_boolean(r->fits));
    json_t *fx = json_array();
    for (int i = 0; i < r->nfixes; i++) {
        const plan_fix *f = &r->fixes[i];
        json_array_append_new(
            fx, json_pack("{s:s, s:s, s:I, s:I, s:s, s:i, s:i, s:f, s:f}", "change", f->what,
                          "mode", mode_name(f->mode), "micro_batch",
                          (json_int_t)f->micro_batch, "grad_accum", (json_int_t)f->grad_accum,
                          "recompute", recompute_name(f->recompute), "gpus_per_node",
                          f->gpus_per_node, "nodes", f->nodes, "total_gib", f->mem.total / GIB,
                          "tokens_per_s", f->tokens_per_s));
    }
    json_object_set_new(j, "fixes", fx);
    json_object_set_new(
        j, "speed",
        json_pack("{s:f, s:f, s:f, s:s, s:f, s:b, s:s, s:f, s:f}", "flops_per_token",
                  r->flops_per_token, "flops_per_token_6n", r->flops_6n,
                  "recompute_flops_per_token", r->recompute_flops, "flops_convention",
                  "6N trainable + 4N frozen matmul weights (lm_head in, embedding out) + "
                  "attention 12*layers*heads*head_dim*seq_len",
                  "mfu", r->mfu, "mfu_measured", r->mfu_measured, "mfu_source", r->mfu_source,
                  "tokens_per_s_gpu", r->tokens_per_s_gpu, "tokens_per_s", r->tokens_per_s));
    json_t *job = json_object();
    json_object_set_new(job, "tokens", r->job_tokens > 0 ? json_real(r->job_tokens) : json_null());
    json_object_set_new(job, "tokens_from", json_string(tokens_from));
    json_object_set_new(job, "epochs", json_real(in->epochs));
    json_object_set_new(job, "wall_s", r->job_tokens > 0 ? json_real(r->wall_s) : json_null());
    json_object_set_new(job, "price_per_gpu_hour",
                        in->price_per_hour > 0 ? json_real(in->price_per_hour) : json_null());
    json_object_set_new(job, "cost",
                        in->price_per_hour > 0 && r->job_tokens > 0 ? json_real(r->cost)
                                                                    : json_null());
    json_object_set_new(j, "job", job);
    json_t *ck = json_object();
    json_object_set_new(ck, "bytes", json_real(r->ckpt_bytes));
    json_object_set_new(ck, "layout", json_string(r->ckpt_sharded ? "sharded" : "gathered"));
    json_object_set_new(ck, "bytes_per_rank", json_real(r->ckpt_rank_bytes));
    json_object_set_new(ck, "stall_s", json_real(r->ckpt_stall_s));
    json_object_set_new(ck, "upload_mbps",
                        in->upload_mbps > 0 ? json_real(in->upload_mbps) : json_null());
    json_object_set_new(ck, "upload_s", in->upload_mbps > 0 ? json_real(r->upload_s) : json_null());
    json_t *cl = json_array();
    for (int i = 0; i < plan_cloud_count(); i++) {
        const plan_cloud *c = plan_cloud_at(i);
        json_t *o = json_pack("{s:s, s:f}", "cloud", c->name, "notice_s", c->notice_s);
        json_object_set_new(o, "upload_in_time",
                            in->upload_mbps > 0 ? json_boolean(r->upload_s <= c->notice_s)
                                                : json_null());
        json_array_append_new(cl, o);
    }
    json_object_set_new(ck, "preemption", cl);
    json_object_set_new(j, "checkpoint", ck);
    char *s = json_dumps(j, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
    printf("%s\n", s);
    free(s);
    json_decref(j);
}

static void list_gpus(void)
{
    printf("| --gpu | card | memory GiB | dense bf16 TFLOP/s |\n| --- | --- | ---: | ---: |\n");
    for (int i = 0; i < plan_gpu_count(); i++) {
        const plan_gpu *g = plan_gpu_at(i);
        printf("| %s | %s | %.0f | %.1f |\n", g->name, g->label, g->mem_gib, g->bf16_tflops);
    }
}

/* Takes the run's settings from a training config. */
static int from_yaml(plan_input *in, const char *path, char **model_path, int64_t *steps,
                     sp_err *err)
{
    config_t c;
    config_defaults(&c);
    int rc = config_load(&c, path, err);
    if (!rc) {
        plan_input_from_config(in, &c);
        *steps = c.steps;
        *model_path = c.model_path ? strdup(c.model_path) : NULL;
        if (in->mode != PLAN_FULL && !in->lora_targets)
            rc = sp_fail(err, SP_EXIT_USAGE, "%s: lora.targets is empty", path);
    }
    config_free(&c);
    return rc;
}

static int dataset_tokens(const char *path, const plan_input *in, double *tokens, sp_err *err)
{
    dataset_t d;
    memset(&d, 0, sizeof d);
    if (dataset_open_part(&d, path, in->seq_len, in->mc.vocab, 0, in->packing, 0, 1, err)) {
        dataset_close(&d); /* what it opened before the failure */
        return err->code;
    }
    *tokens = (double)d.n_windows * (double)in->seq_len; /* what an epoch trains */
    dataset_close(&d);
    return 0;
}

static int run(int argc, char **argv, sp_err *err)
{
    static const struct option longopts[] = {
        {"model", 1, 0, 'M'},       {"mode", 1, 0, 'm'},      {"lora-r", 1, 0, 'r'},
        {"seq-len", 1, 0, 's'},     {"micro-batch", 1, 0, 'b'}, {"recompute", 1, 0, 'c'},
        {"gpu", 1, 0, 'g'},         {"gpu-mem", 1, 0, 'G'},   {"gpu-tflops", 1, 0, 'T'},
        {"gpus", 1, 0, 'n'},        {"nodes", 1, 0, 'N'},     {"headroom", 1, 0, 'H'},
        {"mfu", 1, 0, 'u'},         {"price-per-hour", 1, 0, 'p'}, {"tokens", 1, 0, 't'},
        {"dataset", 1, 0, 'd'},     {"epochs", 1, 0, 'e'},    {"upload-mbps", 1, 0, 'U'},
        {"json", 0, 0, 'j'},        {"list-gpus", 0, 0, 'L'}, {"help", 0, 0, 'h'},
        {0, 0, 0, 0}};
    const char *model = NULL, *mode = NULL, *rec = NULL, *gpu = NULL, *dataset = NULL;
    int64_t lora_r = 0, seq = 0, mb = 0, gpn = 0, nodes = 0;
    double gmem = 0, gtf = 0, headroom = -1, mfu = 0, price = 0, tokens = -1, epochs = 0,
           up = 0;
    int json = 0, ch, rc = 0;
    opterr = 0;
    optind = 1;
    while (!rc && (ch = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
        switch (ch) {
        case 'M': model = optarg; break;
        case 'm': mode = optarg; break;
        case 'r': rc = int_opt("--lora-r", optarg, 1, 65536, &lora_r, err); break;
        case 's': rc = int_opt("--seq-len", optarg, 2, 1 << 20, &seq, err); break;
        case 'b': rc = int_opt("--micro-batch", optarg, 1, 4096, &mb, err); break;
        case 'c': rec = optarg; break;
        case 'g': gpu = optarg; break;
        case 'G': rc = num_opt("--gpu-mem", optarg, 1.0 / 1024, &gmem, err); break;
        case 'T': rc = num_opt("--gpu-tflops", optarg, 1e-3, &gtf, err); break;
        case 'n': rc = int_opt("--gpus", optarg, 1, 1024, &gpn, err); break;
        case 'N': rc = int_opt("--nodes", optarg, 1, 4096, &nodes, err); break;
        case 'H': rc = num_opt("--headroom", optarg, 0, &headroom, err); break;
        case 'u':
            rc = num_opt("--mfu", optarg, 1e-6, &mfu, err);
            if (!rc && mfu > 1)
                rc = sp_fail(err, SP_EXIT_USAGE, "plan: --mfu %s must be a fraction in (0, 1]",
                             optarg);
            break;
        case 'p': rc = num_opt("--price-per-hour", optarg, 0, &price, err); break;
        case 't': rc = num_opt("--tokens", optarg, 1, &tokens, err); break;
        case 'd': dataset = optarg; break;
        case 'e': rc = num_opt("--epochs", optarg, 1e-9, &epochs, err); break;
        case 'U': rc = num_opt("--upload-mbps", optarg, 1e-9, &up, err); break;
        case 'j': json = 1; break;
        case 'L': list_gpus(); return 0;
        case 'h': plan_usage(stdout); return 0;
        default:
            return sp_fail(err, SP_EXIT_USAGE, "plan: unknown or incomplete option '%s' (spotune "
                                               "plan --help)",
                           argv[optind - 1]);
        }
    }
    if (rc)
        return rc;
    if (optind > argc - 1 && !model)
        return sp_fail(err, SP_EXIT_USAGE,
                       "plan: give a model (a directory, its config.json or a preset) or a run "
                       "YAML (spotune plan --help)");
    if (optind < argc - 1)
        return sp_fail(err, SP_EXIT_USAGE, "plan: one MODEL or RUN.yaml, not '%s' too",
                       argv[optind + 1]);
    if (tokens > 0 && dataset)
        return sp_fail(err, SP_EXIT_USAGE, "plan: --tokens or --dataset, not both");

    plan_input in;
    plan_input_defaults(&in);
    const char *arg = optind < argc ? argv[optind] : NULL;
    char *yaml_model = NULL;
    int64_t steps = 0;
    int yaml = arg && (ends_with(arg, ".yaml") || ends_with(arg, ".yml"));
    if (yaml && (rc = from_yaml(&in, arg, &yaml_model, &steps, err)))
        return rc;
    if (!yaml && arg && model) {
        free(yaml_model);
        return sp_fail(err, SP_EXIT_USAGE, "plan: --model replaces a run YAML's model.path; '%s' "
                                           "is not a .yaml",
                       arg);
    }
    const char *what = model ? model : yaml ? yaml_model : arg;
    if (!what)
        rc = sp_fail(err, SP_EXIT_USAGE, "%s: model.path is not set (or give --model)", arg);
    if (!rc && (rc = plan_load_model(&in, what, err)) && yaml && !model) {
        sp_err_prefix(err, "%s: model.path: ", arg);
        size_t l = strlen(err->msg);
        snprintf(err->msg + l, sizeof err->msg - l,
                 " (--model config.json|DIR|PRESET plans without the model's files)");
    }
    free(yaml_model);
    if (rc)
        return rc;

    if (mode) {
        if (!strcmp(mode, "lora"))
            in.mode = PLAN_LORA;
        else if (!strcmp(mode, "qlora"))
            in.mode = PLAN_QLORA;
        else if (!strcmp(mode, "full"))
            in.mode = PLAN_FULL;
        else
            return sp_fail(err, SP_EXIT_USAGE, "plan: --mode '%s': lora, qlora or full", mode);
    }
    if (rec) {
        if (!strcmp(rec, "none"))
            in.recompute = RECOMPUTE_NONE;
        else if (!strcmp(rec, "attention"))
            in.recompute = RECOMPUTE_ATTENTION;
        else if (!strcmp(rec, "layer"))
            in.recompute = RECOMPUTE_LAYER;
        else
            return sp_fail(err, SP_EXIT_USAGE,
                           "plan: --recompute '%s': none, attention or layer", rec);
    }
    if (lora_r)
        in.lora_r = lora_r;
    if (seq)
        in.seq_len = seq;
    if (mb)
        in.micro_batch = mb;
    if (gpn)
        in.gpus_per_node = (int)gpn;
    if (nodes)
        in.nodes = (int)nodes;
    if (gpu) {
        const plan_gpu *g = plan_gpu_find(gpu);
        if (!g)
            return sp_fail(err, SP_EXIT_USAGE,
                           "plan: --gpu '%s' is not in the table (%s); give --gpu-mem GiB and "
                           "--gpu-tflops T for another card",
                           gpu, plan_gpu_names());
        plan_input_set_gpu(&in, g);
    } else if (!gmem || !gtf) {
        return sp_fail(err, SP_EXIT_USAGE,
                       "plan: which GPU? --gpu NAME (%s), or --gpu-mem GiB and --gpu-tflops T",
                       plan_gpu_names());
    } else {
        snprintf(in.gpu_label, sizeof in.gpu_label, "GPU");
    }
    if (gmem > 0) {
        in.gpu_mem_bytes = gmem * GIB;
        if (gpu)
            snprintf(in.gpu_label + strlen(in.gpu_label),
                     sizeof in.gpu_label - strlen(in.gpu_label), " (%.0f GiB given)", gmem);
    }
    if (gtf > 0)
        in.gpu_tflops = gtf;
    if (headroom >= 0)
        in.headroom_bytes = headroom * GIB;
    in.mfu = mfu;
    in.price_per_hour = price;
    in.upload_mbps = up;
    if (epochs > 0)
        in.epochs = epochs;

    const char *tokens_from = "none given";
    char from[4200];
    if (tokens > 0) {
        in.tokens = tokens;
        tokens_from = "--tokens";
    } else if (dataset) {
        if ((rc = dataset_tokens(dataset, &in, &in.tokens, err)))
            return rc;
        snprintf(from, sizeof from, "%s: its windows of %lld tokens, x %g epochs", dataset,
                 (long long)in.seq_len, in.epochs);
        tokens_from = from;
    } else if (yaml && steps > 0 && epochs <= 0) {
        in.tokens = (double)steps * (double)in.gpus_per_node * in.nodes * (double)in.micro_batch *
                    (double)in.grad_accum * (double)in.seq_len;
        snprintf(from, sizeof from,
                 "train.steps %lld x global batch %lld windows x seq_len %lld",
                 (long long)steps,
                 (long long)(in.gpus_per_node * in.nodes * in.micro_batch * in.grad_accum),
                 (long long)in.seq_len);
        tokens_from = from;
    } else if (epochs > 0) {
        return sp_fail(err, SP_EXIT_USAGE, "plan: --epochs needs --tokens or --dataset");
    }
    if (in.tokens > 0 && tokens > 0) {
        snprintf(from, sizeof from, "--tokens x %g epochs", in.epochs);
        tokens_from = from;
    }

    plan_result r;
    if ((rc = plan_compute(&in, &r, err)))
        return rc;
    if (json)
        print_json(&in, &r, tokens_from);
    else
        print_human(&in, &r, tokens_from);
    fflush(stdout);
    if (!r.fits && r.nfixes == 0) {
        /* the least this model can take: LoRA on NF4 weights, layer recompute, micro-batch 1 */
        plan_input least = in;
        plan_result lr;
        least.mode = PLAN_QLORA;
        least.recompute = RECOMPUTE_LAYER;
        least.micro_batch = 1;
        if (plan_compute(&least, &lr, err))
            return err->code;
        if (r.usable_bytes <= 0)
            return sp_fail(err, SP_EXIT_USAGE,
                           "plan: the %.2f GiB card is no larger than the headroom kept free "
                           "(%.2f GiB: CUDA context, libraries, what the driver reserves): "
                           "nothing fits; --headroom GiB plans with less",
                           in.gpu_mem_bytes / GIB, r.headroom_bytes / GIB);
        return sp_fail(err, SP_EXIT_USAGE,
                       "plan: %s needs %.2f GiB per GPU in %s mode and %.2f GiB are usable of "
                       "the %.2f GiB card: nothing fits (the least, QLoRA with layer recompute "
                       "and micro-batch 1, needs %.2f GiB; more GPUs do not help); take a "
                       "larger card",
                       in.model_name, r.mem.total / GIB, mode_name(in.mode), r.usable_bytes / GIB,
                       in.gpu_mem_bytes / GIB, lr.mem.total / GIB);
    }
    return 0;
}

int plan_main(int argc, char **argv)
{
    sp_err err = {0};
    int rc = run(argc, argv, &err);
    if (rc)
        fprintf(stderr, "spotune: error: %s\n", err.msg);
    return rc;
}
