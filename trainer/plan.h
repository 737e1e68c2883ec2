/* trainer/plan.h — the plan of a run before any GPU is rented: per-GPU
 * memory by part (from model_plan_bytes, the figures the trainer allocates)
 * and whether it fits a card, the changes that make it fit, expected
 * throughput at a stated MFU, wall time and cost of a job, checkpoint size
 * and its upload time against each cloud's preemption notice. Also the table
 * of rentable GPUs (memory, dense bf16 peak). `spotune plan` prints it;
 * anything else that needs the memory plan (a config check on a rented
 * machine) calls plan_compute. Owns nothing beyond its structs. */
#ifndef SPOTUNE_PLAN_H
#define SPOTUNE_PLAN_H

#include <stdint.h>

#include "../base/base.h"
#include "config.h"
#include "model_config.h"

/* Modes: PLAN_LORA and PLAN_FULL equal MODE_LORA and MODE_FULL (config.h). */
enum { PLAN_LORA = 0, PLAN_FULL = 1, PLAN_QLORA = 2 };

/* A card of the built-in table. */
typedef struct plan_gpu {
    const char *name;       /* as --gpu takes it (case-insensitive): "H100" */
    const char *label;      /* "H100 80GB SXM" */
    double mem_gib;         /* the datasheet's memory (GB there; the device's GiB) */
    double bf16_tflops;     /* dense bf16 tensor-core peak, TFLOP/s */
    const char *device_key; /* a substring of the CUDA device name ("H100 80GB HBM3") */
} plan_gpu;

int plan_gpu_count(void);
const plan_gpu *plan_gpu_at(int i);
/* By --gpu name (or label), case-insensitive, spaces and dashes ignored;
 * NULL when not in the table. */
const plan_gpu *plan_gpu_find(const char *name);
/* By the name the CUDA driver reports (cudaDeviceProp.name); NULL if unknown. */
const plan_gpu *plan_gpu_for_device(const char *device_name);
/* "RTX3090, RTX4090, ..." for messages. */
const char *plan_gpu_names(void);

/* Clouds' spot/preemptible termination notices. */
typedef struct plan_cloud {
    const char *name;
    double notice_s;
} plan_cloud;
int plan_cloud_count(void);
const plan_cloud *plan_cloud_at(int i);

typedef struct plan_input {
    model_config_t mc;
    char model_name[256];   /* for output: a preset, a directory, a config.json */
    int mode;               /* PLAN_LORA, PLAN_QLORA, PLAN_FULL */
    int64_t lora_r, lora_targets; /* TARGET_* bits (config.h) */
    double lora_dropout;
    int lora_dora;          /* DoRA: a magnitude per output feature of each target */
    int64_t seq_len, micro_batch, grad_accum;
    int packing;            /* data.packing (DATA_PACK_*): how a dataset makes windows */
    int recompute;          /* RECOMPUTE_* (config.h) */
    int shard_optimizer;    /* full mode on several GPUs: ZeRO stage 1 (train.shard_optimizer) */
    int shard_gradients;    /* with it, ZeRO stage 2 (train.shard_gradients) */
    int gpus_per_node, nodes;
    char gpu_label[64];     /* for output */
    double gpu_mem_bytes;   /* per GPU */
    double gpu_tflops;      /* dense bf16 peak per GPU */
    int cpu;                /* plan the CPU backend: f32 weights and activations, no backend
                               workspace, no headroom (tests compare it with the allocator) */
    double headroom_bytes;  /* < 0: the default, PLAN_HEADROOM_FIXED + PLAN_HEADROOM_FRACTION */
    double mfu;             /* <= 0: measured (docs/perf.md) or the default of the mode */
    double price_per_hour;  /* per GPU-hour; 0: none */
    double tokens;          /* tokens of one epoch; 0: unknown */
    double epochs;
    double upload_mbps;     /* megabits per second to the object store; 0: unknown */
} plan_input;

/* The default headroom: the CUDA context, cuBLAS/cuBLASLt and NCCL
 * (PLAN_HEADROOM_FIXED) and what the driver and ECC reserve plus allocator
 * rounding (PLAN_HEADROOM_FRACTION of the card). */
#define PLAN_HEADROOM_FIXED (1024.0 * 1024.0 * 1024.0)
#define PLAN_HEADROOM_FRACTION 0.05
/* CUDA backend's own workspace (kernels/cuda/cuda_backend.cu: matmul
 * workspace 32 MiB, attention score blocks 256 MiB, dK/dV accumulators 64 MiB;
 * the fused attention's backward takes at most 256 MiB of it, FA_DS_BUDGET:
 * its grouped-query shares and a chunk of stored dS). */
#define PLAN_CUDA_WORKSPACE (352.0 * 1024.0 * 1024.0)
/* NF4 as bitsandbytes stores it: 4 bits a weight, an 8-bit absmax per block
 * of 64 and an fp32 constant per 256 absmax (double quantization). */
#define PLAN_NF4_BITS (4.0 + 8.0 / 64.0 + 32.0 / (64.0 * 256.0))

/* Bytes per GPU by part. */
typedef struct plan_mem {
    double weights;     /* frozen weights (LoRA: bf16; QLoRA: NF4 projections; full: 0) */
    double trainable;   /* fp32 masters and the bf16 compute copy of the trainable weights */
    double gradients;   /* fp32 gradients (optimizer sharded: the whole arena and this rank's
                           reduced shard; gradients sharded too: the shard and the bucket
                           buffers the backward writes into, model_grad_buckets_len) */
    double optimizer;   /* AdamW m and v, fp32 (sharded: this rank's shard) */
    double activations; /* kept for the backward, at the recompute setting */
    double workspace;   /* the model's scratch and the backend's workspace */
    double total;
} plan_mem;

#define PLAN_MAX_FIXES 8
typedef struct plan_fix {
    char what[240];     /* "train.micro_batch 1, train.grad_accum 8 (the same global batch)" */
    int mode;
    int64_t micro_batch, grad_accum;
    int recompute;
    int gpus_per_node, nodes;
    plan_mem mem;
    double tokens_per_s; /* of the whole job */
} plan_fix;

/* Copy speeds the checkpoint stall is planned with: device to pageable host
 * memory over PCIe 4/5 (conservative; pinned memory is faster), and host
 * memory to host memory. */
#define PLAN_D2H_BYTES_S 12e9
#define PLAN_HOST_COPY_BYTES_S 5e9

typedef struct plan_result {
    plan_mem mem;
    double headroom_bytes, usable_bytes; /* usable = card - headroom */
    int fits;
    int64_t params, trainable_params, shard_params; /* shard: this rank's optimizer share */
    int sharded;
    int grads_sharded; /* the gradients too (ZeRO stage 2) */
    /* speed: FLOPs per trained token in the honest convention of bench and
     * docs/perf.md (matmuls: 6N for trainable weights, 4N for frozen ones,
     * lm_head included, the embedding gather not; attention 12 L heads
     * head_dim T), and 6 x every parameter */
    double flops_per_token, flops_6n, recompute_flops;
    double mfu;
    int mfu_measured;
    char mfu_source[200];
    double tokens_per_s_gpu, tokens_per_s;
    double job_tokens, wall_s, cost;
    double ckpt_bytes, upload_s;
    /* checkpoint.layout auto: sharded when the optimizer is and the job is on
     * one machine; then each rank writes ckpt_rank_bytes itself, else rank 0
     * holds the whole state (ckpt_rank_bytes = ckpt_bytes). The stall is
     * that copy to host memory, at
     * PLAN_D2H_BYTES_S on a GPU (host memory at PLAN_HOST_COPY_BYTES_S on
     * the CPU) */
    int ckpt_sharded;
    double ckpt_rank_bytes, ckpt_stall_s;
    int nfixes;
    plan_fix fixes[PLAN_MAX_FIXES];
} plan_result;

/* Sets every field to the defaults of `spotune plan` (LoRA r 16 on all 7
 * projections, seq_len 2048, micro_batch 1, recompute none, 1 GPU, 1 epoch);
 * mc, model_name and the GPU are left empty. */
void plan_input_defaults(plan_input *in);
/* Takes a training config's settings over in's: train.mode, seq_len,
 * micro_batch, grad_accum, shard_optimizer, lora.r, targets and dropout,
 * runtime.recompute. The model is not read: plan_load_model(in,
 * c->model_path, err) does. */
void plan_input_from_config(plan_input *in, const config_t *c);
/* A card of the table: its label, memory and peak into in. */
void plan_input_set_gpu(plan_input *in, const plan_gpu *g);
/* Fills in->mc from a preset name, a model directory or a config.json path
 * (model_config_load: an unsupported architecture is SP_EXIT_INPUT). */
int plan_load_model(plan_input *in, const char *what, sp_err *err);
/* The plan. Inputs out of range are SP_EXIT_USAGE naming the option; a plan
 * that does not fit is not an error (out->fits 0, out->fixes lists what
 * fits, none when nothing this plan knows does). */
int plan_compute(const plan_input *in, plan_result *out, sp_err *err);

/* `spotune plan ...` */
int plan_main(int argc, char **argv);

#endif
