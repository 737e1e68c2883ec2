/* The config schema: every key of a run's YAML, its type, default, range,
 * whether it changes the math of a run, and the documentation that
 * `spotune config-reference` prints. */
#include "config_keys.h"

static const char *const modes[] = {"lora", "full", NULL};
static const char *const schedules[] = {"cosine", "linear", "constant", NULL};
static const char *const recomputes[] = {"none", "attention", "layer", NULL};
const char *const config_backend_names[] = {"auto", "cpu", "cpu-ref", "cuda", NULL};
static const char *const addressings[] = {"auto", "path", "virtual", NULL};
static const char *const packings[] = {"stream", "documents", "pad", NULL}; /* DATA_PACK_* */
static const char *const quantizes[] = {"none", "nf4", NULL};                /* QUANT_* */
static const char *const layouts[] = {"auto", "sharded", "gathered", NULL}; /* CKPT_LAYOUT_* */

#define O(f) offsetof(config_t, f)
const key_def config_keys[] = {
    {"run.dir", K_STRING, O(run_dir), NULL, 0, 0, NULL, 0,
     "Run directory: resolved config, metrics.jsonl, checkpoints and the exported adapter or "
     "model. Created if missing. Relative paths are relative to the working directory."},
    {"run.seed", K_INT, O(seed), "1234", 0, BIG, NULL, 1,
     "Seed of every random stream: LoRA init, data order, dropout."},
    {"run.lock_wait_s", K_FLOAT, O(run_lock_wait_s), "30", 0, 86400, NULL, 0,
     "One job per run directory (a lock on RUN_DIR/.lock, held by rank 0): wait at most this "
     "long for another job holding it to end (e.g. ranks of a killed launch still exiting), "
     "then refuse to start (exit 2)."},
    {"model.path", K_STRING, O(model_path), NULL, 0, 0, NULL, MATH_CONTENT,
     "Hugging Face model directory: config.json and model.safetensors (or shards listed in "
     "model.safetensors.index.json). A resume may find it at another path: a LoRA checkpoint "
     "records the base model's identity (a hash of config.json and of the tensors' headers and "
     "sampled bytes), which must match."},
    {"model.quantize", K_ENUM, O(model_quantize), "none", 0, 0, quantizes, MATH_SINCE,
     "none: the frozen base weights are kept as loaded (in the compute dtype). nf4: QLoRA: the "
     "seven projection weights of each layer (q, k, v, o, gate, up, down) are quantized at load "
     "to 4-bit NormalFloat with double quantization, in bitsandbytes' layout and values "
     "(blocks of 64, the block maxima quantized to 8 bits in blocks of 256; about 0.5 bytes "
     "per weight), and each product dequantizes its weights into a workspace (q, k, v "
     "together, and gate, up, as their products are one each); embeddings, lm_head, norms "
     "and biases stay dense. The LoRA gradients are "
     "those of the dequantized base (on CUDA dequantized to bf16, the compute dtype). Needs "
     "train.mode lora. With lora.dora: QDoRA, each DoRA weight norm taken from the "
     "dequantized weight, as PEFT's DoRA on a bitsandbytes 4-bit layer. A run cannot resume "
     "under another value."},
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
     "norm taken per output row and treated as a constant in the backward, as PEFT does. With "
     "lora.dropout, as PEFT: the base product sees x and the DoRA term the dropped input. With "
     "model.quantize nf4 (QDoRA) W is the dequantized weight. Needs train.mode lora."},
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
    {"data.train", K_STRING, O(data_train), NULL, 0, 0, NULL, MATH_CONTENT,
     "Training dataset (HDF5, the format of docs/formats.md). A resume may find it at another "
     "path (where a new machine mounts it): the checkpoint records the file's identity (its "
     "lengths and sampled contents), and the same contents at a new path resume; other "
     "contents, at any path, are refused."},
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
    {"runtime.cuda_graphs", K_BOOL, O(cuda_graphs), "false", 0, 0, NULL, 0,
     "Capture a micro-batch's forward and backward as one CUDA graph the second time the same "
     "launches come, and replay it for every later micro-batch that launches the same (a launch "
     "trace decides; what changes between micro-batches is read from device memory). On "
     "several GPUs the gradients are then all-reduced after the backward instead of during "
     "it; with sharded gradients (train.shard_gradients) the micro-batches run without "
     "graphs. A micro-batch of another shape runs eagerly until it repeats. The step's update "
     "(gradient norm and AdamW) is one graph too, unless the optimizer is sharded. On the CPU "
     "backends the recorded op list replays instead (the same rules, no speed-up; for "
     "checking)."},
    {"comm.bucket_mb", K_FLOAT, O(comm_bucket_mb), "25", 0.0625, 4096, NULL, 0,
     "Gradients are all-reduced in buckets of this many MiB (on GPUs, overlapping the backward "
     "pass). Sharded gradients (train.shard_gradients) go a layer at a time instead."},
    {"comm.timeout_s", K_FLOAT, O(comm_timeout_s), "60", 1, 86400, NULL, 0,
     "A collective that does not finish in this many seconds ends the whole job (a rank died "
     "or hangs). While the ranks load the model and the checkpoint it is at least an hour; "
     "on CUDA the first step (and the validation before it) gets at least 300 s."},
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
     "writes MANIFEST.json, with the layout, once every rank has written its shard. On machines "
     "that do not share run.dir (checked at start) this needs checkpoint.remote: every rank puts "
     "its shard there, rank 0's machine keeps its ranks' shards and the others none, and the "
     "store holds each checkpoint whole. gathered: rank 0 gathers the whole state and writes it "
     "alone (state.h5). auto: sharded on one machine, on machines that share run.dir, and on "
     "machines that do not when checkpoint.remote is set; else gathered. Other runs always "
     "write state.h5 alone. Either kind resumes on any rank count and under either setting."},
    {"checkpoint.keep", K_INT, O(ckpt_keep), "3", 1, 1000000, NULL, 0,
     "Keep the newest N complete checkpoints (locally and in checkpoint.remote)."},
    {"checkpoint.keep_every", K_INT, O(ckpt_keep_every), "0", 0, BIG, NULL, 0,
     "Also keep every checkpoint whose step is a multiple of N (0: none)."},
    {"checkpoint.remote", K_STRING, O(ckpt_remote), "", 0, 0, NULL, 0,
     "Object store the checkpoints are pushed to in the background: s3://bucket/prefix or "
     "file:///path (a mounted share). Empty: local only. Credentials come from "
     "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and AWS_SESSION_TOKEN, or without them from "
     "a role's (web identity, container or EC2 instance; renewed before they expire), never "
     "from this file."},
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

const size_t config_nkeys = sizeof config_keys / sizeof config_keys[0];
