/* The training loop. Every rank runs the same sequence of collectives; only
 * rank 0 prints and writes files. */
#define _POSIX_C_SOURCE 200809L
#include "train.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../checkpoint/lease.h"
#include "adapter.h"
#include "checkpointing.h"
#include "data.h"
#include "grad_sync.h"
#include "log.h"
#include "model.h"
#include "model_card.h"
#include "model_io.h"
#include "optim.h"
#include "signals.h"
#include "train_internal.h"

static int mkdir_p(const char *dir, sp_err *err)
{
    if (sp_mkdir_p(dir) != 0)
        return sp_fail(err, SP_EXIT_OTHER, "%s: cannot create: %s", dir, strerror(errno));
    return 0;
}

/* Rank 0: one job per run directory, taken before anything is written into
 * it; a job still holding it (the ranks of a killed launch take a moment to
 * exit) is waited for up to run.lock_wait_s. */
static int lock_run_dir(trainer_t *t, sp_err *err)
{
    char note[SP_ERR_MSG_MAX];
    if (run_lock_take(&t->lock, t->cfg->run_dir, 0, note, sizeof note, err) == 0 ||
        err->code != SP_EXIT_USAGE || t->cfg->run_lock_wait_s <= 0) {
        if (!err->code && note[0])
            log_event(t->out, NULL, "warning", "%s", note);
        return err->code;
    }
    log_event(t->out, NULL, "info", "%s; waiting up to %.0f s for it to end", err->msg,
              t->cfg->run_lock_wait_s);
    sp_err_clear(err);
    if (run_lock_take(&t->lock, t->cfg->run_dir, t->cfg->run_lock_wait_s, note, sizeof note,
                      err))
        return err->code;
    if (note[0])
        log_event(t->out, NULL, "warning", "%s", note);
    return 0;
}

static int write_resolved_config(trainer_t *t, sp_err *err)
{
    char *path = sp_strf("%s/config.yaml", t->cfg->run_dir);
    char *tmp = path ? sp_strf("%s.tmp", path) : NULL;
    FILE *f = tmp ? fopen(tmp, "w") : NULL;
    int rc = 0;
    if (!tmp)
        rc = sp_fail(err, SP_EXIT_OTHER, "out of memory");
    else if (!f)
        rc = sp_fail(err, SP_EXIT_OTHER, "%s: cannot write: %s", tmp, strerror(errno));
    if (f) {
        fprintf(f, "# resolved configuration of this run (every key, defaults included)\n");
        rc = config_write_yaml(t->cfg, f, err);
        if (fclose(f) != 0 && !rc)
            rc = sp_fail(err, SP_EXIT_OTHER, "%s: cannot write", tmp);
        if (!rc && rename(tmp, path) != 0)
            rc = sp_fail(err, SP_EXIT_OTHER, "%s: cannot write: %s", path, strerror(errno));
    }
    free(path);
    free(tmp);
    return rc;
}

static size_t mem_available(void)
{
    FILE *f = fopen("/proc/meminfo", "r");
    char line[256];
    size_t kb = 0;
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "MemAvailable: %zu kB", &kb) == 1)
            break;
    if (f)
        fclose(f);
    return kb * 1024;
}

static double mib(size_t b)
{
    return (double)b / (1024.0 * 1024.0);
}

/* Prints the memory plan and refuses a run that cannot fit. */
static int check_memory(trainer_t *t, const model_opts *o, sp_err *err)
{
    model_plan p;
    model_plan_bytes(&t->mc, o, t->be->act_dt, &p);
    p.scratch += t->be->workspace_bytes;
    size_t total = p.weights + p.trainable + p.activations + p.scratch;
    size_t avail = t->be->mem_total ? t->be->mem_total : mem_available();
    if (strcmp(t->be->name, "cuda") != 0) {
        size_t a = mem_available();
        int per_node = comm_local_size(t->comm);
        avail = a / (size_t)(per_node > 0 ? per_node : 1);
    }
    if (t->out)
        fprintf(t->out,
                "memory plan (%s): weights %.1f MiB, trainable state %.1f MiB, activations %.1f "
                "MiB, workspace %.1f MiB; total %.1f MiB of %.1f MiB available%s\n",
                t->be->device_name, mib(p.weights), mib(p.trainable), mib(p.activations),
                mib(p.scratch), mib(total), mib(avail),
                model_shards_grads(o)  ? " (optimizer state and gradients sharded over the ranks)"
                : o->shard_count > 1 ? " (optimizer state sharded over the ranks)"
                                     : "");
    if (avail && total > avail)
        return sp_fail(err, SP_EXIT_USAGE,
                       "the run needs %.1f MiB but %s has %.1f MiB available: reduce "
                       "train.micro_batch (%lld) or train.seq_len (%lld), or set "
                       "runtime.recompute: layer",
                       mib(total), t->be->device_name, mib(avail), (long long)t->mb,
                       (long long)t->T);
    return 0;
}

/* lora.init_from on a fresh start: every rank reads the same adapter into its
 * LoRA weights (after ckpt_ctl_resume, which restored nothing); a resumed run
 * keeps the checkpoint's weights. */
static int init_from(trainer_t *t, const char *identity, sp_err *err)
{
    const char *dir = t->cfg->lora_init_from;
    if (t->cfg->mode != MODE_LORA || !dir || !*dir)
        return 0;
    if (t->resumed) {
        log_event(t->out, &t->metrics, "info",
                  "lora.init_from (%s) is not read: the run resumes from a checkpoint, "
                  "whose LoRA weights it carries on from",
                  dir);
        return 0;
    }
    char note[SP_ERR_MSG_MAX];
    if (adapter_init_from(t->m, dir, identity, note, sizeof note, err)) {
        sp_err_prefix(err, "lora.init_from: ");
        return err->code;
    }
    log_event(t->out, &t->metrics, "info", "LoRA weights initialised from %s (%s)", dir, note);
    return 0;
}

static int setup_model(trainer_t *t, sp_err *err)
{
    const config_t *c = t->cfg;
    if (model_config_load(&t->mc, c->model_path, err))
        return err->code;
    if (t->mc.sliding_window > 0 && t->mc.sliding_window < c->seq_len)
        return sp_fail(err, SP_EXIT_USAGE,
                       "%s/config.json: sliding_window %lld is shorter than train.seq_len %lld; "
                       "sliding-window attention is not supported, so use seq_len <= %lld",
                       c->model_path, (long long)t->mc.sliding_window, (long long)c->seq_len,
                       (long long)t->mc.sliding_window);
    if (t->out && c->seq_len > t->mc.max_pos)
        log_event(t->out, NULL, "warning",
                  "train.seq_len %lld exceeds the model's max_position_embeddings %lld",
                  (long long)c->seq_len, (long long)t->mc.max_pos);
    model_opts o = {.mode = c->mode,
                    .nf4 = c->model_quantize == QUANT_NF4,
                    .lora_r = c->lora_r,
                    .lora_alpha = c->lora_alpha,
                    .lora_dropout = c->lora_dropout,
                    .lora_targets = c->lora_targets,
                    .rslora = c->lora_rslora,
                    .dora = c->lora_dora,
                    .max_batch = c->micro_batch,
                    .seq_len = c->seq_len,
                    .recompute = c->recompute,
                    .graphs = c->cuda_graphs,
                    .seed = (uint64_t)c->seed};
    if (c->mode == MODE_FULL && c->shard_optimizer && t->world > 1) {
        o.shard_count = t->world;
        o.shard_rank = t->rank;
        o.shard_grads = c->shard_gradients;
    }
    if (check_memory(t, &o, err) || model_create(&t->m, t->be, &t->mc, &o, err) ||
        train_stop_before_training(t, "before loading the model", err) ||
        model_io_load_base(t->m, c->model_path, err) ||
        train_stop_before_training(t, "after loading the model", err))
        return err->code;
    if (t->out) { /* what the model's files hold that this model does not read */
        char names[1024];
        size_t unused;
        if (model_io_unused(t->m, c->model_path, names, sizeof names, &unused, err))
            return err->code;
        if (unused)
            log_event(t->out, &t->metrics, "warning",
                      "%s: %zu tensor%s of the weight files %s not part of this model as its "
                      "config.json describes it, and %s ignored (as Hugging Face ignores them): "
                      "%s%s; if the model should have them, config.json does not match the "
                      "weights",
                      c->model_path, unused, unused == 1 ? "" : "s", unused == 1 ? "is" : "are",
                      unused == 1 ? "is" : "are", names, unused > 8 ? ", ..." : "");
    }
    if (c->mode == MODE_LORA)
        model_init_lora(t->m, (uint64_t)c->seed);
    char identity[17], data_identity[17];
    if (model_io_identity(c->model_path, identity, err) ||
        dataset_identity(c->data_train, data_identity, err) ||
        ckpt_ctl_open(&t->ck, c, t->comm, identity, data_identity, t->out, &t->metrics, err) ||
        ckpt_ctl_resume(t->ck, t->m, t->resume, t->mb, &t->ga, &t->p, &t->resumed, err) ||
        init_from(t, identity, err))
        return err->code;
    t->global_batch = (int64_t)t->world * t->mb * t->ga;
    if (t->out) {
        int64_t total = model_config_params(&t->mc);
        fprintf(t->out,
                "model: %s, %lld layers, hidden %lld, %.1fM parameters; %s: %.3fM trainable "
                "(%.3f%%)\n",
                t->mc.architecture, (long long)t->mc.layers, (long long)t->mc.hidden,
                (double)total / 1e6,
                c->mode != MODE_LORA                ? "full fine-tuning"
                : c->model_quantize == QUANT_NF4
                    ? (c->lora_dora ? "QDoRA (DoRA on the NF4 base)" : "QLoRA (LoRA on the NF4 base)")
                : c->lora_dora ? "LoRA with DoRA"
                               : "LoRA",
                (double)t->m->n_trainable / 1e6, 100.0 * (double)t->m->n_trainable / (double)total);
    }
    return be_check(t->be, err);
}

static int setup_data(trainer_t *t, sp_err *err)
{
    const config_t *c = t->cfg;
    /* each rank checks its slice of the tokens; any failure ends the whole job */
    if (dataset_open_part(&t->train, c->data_train, c->seq_len, t->mc.vocab, (uint64_t)c->seed,
                          c->data_packing, t->rank, t->world, err))
        return err->code;
    t->has_val = c->data_val && *c->data_val;
    if (t->has_val && dataset_open_part(&t->val, c->data_val, c->seq_len, t->mc.vocab,
                                        (uint64_t)c->seed, c->data_packing, t->rank, t->world,
                                        err))
        return err->code;
    size_t n = (size_t)(t->ga * t->mb * t->T);
    t->inputs = malloc(sizeof(int32_t) * n);
    t->targets = malloc(sizeof(int32_t) * n);
    t->sample_ids = malloc(sizeof(uint64_t) * (size_t)(t->ga * t->mb));
    if (t->samples)
        t->sample_at = malloc(2 * sizeof(uint64_t) * (size_t)(t->ga * t->mb));
    if (!t->inputs || !t->targets || !t->sample_ids || (t->samples && !t->sample_at))
        return sp_fail(err, SP_EXIT_OTHER, "out of memory");
    if (c->data_packing != DATA_PACK_STREAM) {
        t->pos = malloc(sizeof(int32_t) * n);
        t->seg = malloc(sizeof(int32_t) * n);
        if (!t->pos || !t->seg)
            return sp_fail(err, SP_EXIT_OTHER, "out of memory");
    }
    if (t->out)
        fprintf(t->out,
                "data: %s: %llu tokens, %llu documents, %llu windows of %lld; global batch %lld "
                "windows (%d rank%s x %lld x %lld) = %lld tokens; %.2f epochs in %lld steps\n",
                c->data_train, (unsigned long long)t->train.n_tokens,
                (unsigned long long)t->train.n_docs, (unsigned long long)t->train.n_windows,
                (long long)t->T, (long long)t->global_batch, t->world, t->world > 1 ? "s" : "",
                (long long)t->mb,
                (long long)t->ga, (long long)(t->global_batch * t->T),
                (double)(t->global_batch * c->steps) / (double)t->train.n_windows,
                (long long)c->steps);
    if (c->data_packing != DATA_PACK_STREAM && t->out)
        fprintf(t->out,
                "data: packing %s: %llu documents into %llu windows of %lld, %.1f%% of the "
                "positions predict (the rest is padding); no token attends across documents\n",
                dataset_packing_names[c->data_packing], (unsigned long long)t->train.n_docs,
                (unsigned long long)t->train.n_windows, (long long)t->T,
                100.0 * (double)t->train.predictions /
                    ((double)t->train.n_windows * (double)t->T));
    return 0;
}

/* Reads this rank's windows of the next step; returns the global count of
 * trained tokens in *trained. */
static int load_step(trainer_t *t, int64_t *trained, sp_err *err)
{
    int64_t local = 0;
    for (int64_t k = 0; k < t->ga; k++)
        for (int64_t j = 0; j < t->mb; j++) {
            int64_t slot = k * t->mb + j;
            uint64_t sample = t->p.cursor + (uint64_t)((k * t->world + t->rank) * t->mb + j), w, e;
            int64_t n = 0;
            t->sample_ids[slot] = sample;
            if (dataset_window_of(&t->train, sample, &w, &e, err) ||
                dataset_read_window(&t->train, w, t->inputs + slot * t->T,
                                    t->targets + slot * t->T, t->pos ? t->pos + slot * t->T : NULL,
                                    t->seg ? t->seg + slot * t->T : NULL, &n, err))
                return err->code;
            if (t->sample_at) {
                t->sample_at[2 * slot] = e;
                t->sample_at[2 * slot + 1] = w;
            }
            local += n;
        }
    if (comm_allreduce(t->comm, &local, 1, COMM_I64, COMM_SUM, err))
        return err->code;
    *trained = local;
    return 0;
}

/* log.samples: the windows of the step just trained (a step given up on a
 * stop is trained again after the resume, and only then written). */
static void write_samples(trainer_t *t)
{
    if (!t->samples)
        return;
    for (int64_t slot = 0; slot < t->ga * t->mb; slot++)
        fprintf(t->samples, "%lld\t%llu\t%llu\t%llu\n", (long long)t->p.step,
                (unsigned long long)t->sample_ids[slot],
                (unsigned long long)t->sample_at[2 * slot],
                (unsigned long long)t->sample_at[2 * slot + 1]);
    fflush(t->samples);
}

/* A stop agreed between two micro-batches: the step is given up. Nothing of
 * it has touched the weights or the optimizer (the update comes after the
 * last micro-batch), so the state is still the previous step's: the
 * reductions in flight are waited for, the gradients and the loss dropped,
 * and the step (the same windows: the cursor has not moved) is trained
 * again after the resume. */
static int give_up_step(trainer_t *t, grad_sync_t *gs, sp_err *err)
{
    double dropped = 0.0;
    if (grad_sync_abandon(gs, err) || model_loss_take(t->m, &dropped, err))
        return err->code;
    model_zero_grads(t->m);
    return be_check(t->be, err);
}

/* One optimizer step. *given_up: 0 when it was done, else the micro-batches
 * it had run when a stop signal was agreed and it was given up (nothing
 * changed: see give_up_step). */
static int run_step(trainer_t *t, step_report *rep, int64_t *given_up, sp_err *err)
{
    const config_t *c = t->cfg;
    double t0 = sp_now();
    int64_t trained = 0;
    *given_up = 0;
    if (load_step(t, &trained, err))
        return err->code;
    double loss_sum = 0.0, gnorm = 0.0, lr = optim_lr(c, t->p.step);
    if (trained > 0) {
        grad_sync_t gs;
        model_zero_grads(t->m);
        grad_sync_begin(&gs, t->m, t->comm, c->comm_bucket_mb);
        for (int64_t k = 0; k < t->ga; k++) {
            int64_t at = k * t->mb * t->T;
            model_batch b = {.inputs = t->inputs + at,
                             .targets = t->targets + at,
                             .sample_ids = t->sample_ids + k * t->mb,
                             .B = (int)t->mb,
                             .T = (int)t->T,
                             .grad_scale = (float)(1.0 / (double)trained),
                             .last = k == t->ga - 1,
                             .pos = t->pos ? t->pos + at : NULL,
                             .seg = t->seg ? t->seg + at : NULL};
            /* nothing waits for the device until the loss is taken */
            if (model_forward_backward(t->m, &b, NULL, err)) {
                t->m->grads_ready = NULL;
                return err->code;
            }
            int stop = 0;
            if (k < t->ga - 1 && train_stop_agreed(t, &stop, err)) {
                t->m->grads_ready = NULL;
                return err->code;
            }
            if (stop) {
                *given_up = k + 1;
                return give_up_step(t, &gs, err);
            }
        }
        if (grad_sync_finish(&gs, err) || model_loss_take(t->m, &loss_sum, err) ||
            comm_allreduce(t->comm, &loss_sum, 1, COMM_F64, COMM_SUM, err))
            return err->code;
        if (!isfinite(loss_sum))
            return sp_fail(err, SP_EXIT_OTHER,
                           "step %lld: the loss is not finite (%g); nothing was updated; lower "
                           "train.lr or check the data and the model's weights",
                           (long long)t->p.step + 1, loss_sum / (double)trained);
        adamw_args a = {.lr = (float)lr,
                        .beta1 = (float)c->beta1,
                        .beta2 = (float)c->beta2,
                        .eps = (float)c->adam_eps,
                        .weight_decay = (float)c->weight_decay,
                        .step = t->p.step + 1};
        if (grad_sync_update(t->m, t->comm, &a, c->clip_grad_norm, &gnorm, err))
            return err->code;
        if (!isfinite(gnorm))
            return sp_fail(err, SP_EXIT_OTHER,
                           "step %lld: the gradient is not finite (grad norm %g, loss %g); "
                           "nothing was updated; lower train.lr or check the data",
                           (long long)t->p.step + 1, gnorm, loss_sum / (double)trained);
    } else if (t->out) {
        log_event(t->out, &t->metrics, "warning",
                  "step %lld has no trained tokens (loss_mask is 0 everywhere); no update",
                  (long long)t->p.step + 1);
    }
    t->p.step++;
    t->p.cursor += (uint64_t)t->global_batch;
    write_samples(t);
    double dt = sp_now() - t0;
    t->p.elapsed_s += dt;
    if (t->steps_run++ > 0) { /* the first step of a process pays one-time costs */
        t->steps_time_s += dt;
        t->steps_timed++;
    }
    double per_step = t->steps_timed ? t->steps_time_s / (double)t->steps_timed : dt;
    *rep = (step_report){.step = t->p.step,
                         .total_steps = c->steps,
                         .loss = trained > 0 ? loss_sum / (double)trained : NAN,
                         .lr = lr,
                         .grad_norm = gnorm,
                         .tokens_per_s = (double)(t->global_batch * t->T) / dt,
                         .elapsed_s = t->p.elapsed_s,
                         .eta_s = per_step * (double)(c->steps - t->p.step),
                         .step_s = dt,
                         .tokens = trained,
                         .remote_behind = ckpt_ctl_remote_behind(t->ck)};
    return 0;
}

static int save_adapter(trainer_t *t, const char *dir, sp_err *err)
{
    if (adapter_save(t->m, dir, t->cfg->model_path, err))
        return err->code;
    model_card card = {.base_model = t->cfg->model_path, .steps = t->p.step,
                       .train_data = t->cfg->data_train, .val_data = t->cfg->data_val};
    char *metrics = sp_strf("%s/metrics.jsonl", t->cfg->run_dir);
    int rc = metrics ? model_card_read_metrics(&card, metrics, err)
                     : sp_fail(err, SP_EXIT_OTHER, "out of memory");
    free(metrics);
    if (rc || model_card_write(dir, &t->m->o, &card, err))
        return err->code;
    fprintf(t->out, "adapter (PEFT layout): %s/adapter_model.safetensors\n", dir);
    return 0;
}

static int save_model(trainer_t *t, const char *dir, sp_err *err)
{
    dtype_t dt;
    if (model_io_weights_dtype(t->cfg->model_path, &dt, err))
        return err->code;
    if (model_io_save_derived(t->m, t->cfg->model_path, dir, dt, 0, MODEL_IO_SHARD_BYTES, err))
        return err->code;
    if (t->m->shard_count > 1 && t->be->act_dt != DT_F32 && t->be->act_dt != dt)
        log_event(t->out, &t->metrics, "info",
                  "the optimizer is sharded, so %s holds the %s compute weights; the exact "
                  "fp32 weights are in the last checkpoint (spotune export CKPT --merged DIR)",
                  dir, dtype_name(t->be->act_dt));
    fprintf(t->out, "model (Hugging Face layout, %s): %s\n", dtype_name(dt), dir);
    return 0;
}

static int finish(trainer_t *t, sp_err *err)
{
    const config_t *c = t->cfg;
    if (t->rank != 0)
        return 0;
    char *dir = sp_strf("%s/%s", c->run_dir, c->mode == MODE_LORA ? "adapter" : "model");
    if (!dir)
        return sp_fail(err, SP_EXIT_OTHER, "out of memory");
    int rc = c->mode == MODE_LORA ? save_adapter(t, dir, err) : save_model(t, dir, err);
    free(dir);
    return rc;
}

static void trainer_free(trainer_t *t)
{
    model_destroy(t->m);
    backend_destroy(t->be);
    dataset_close(&t->train);
    if (t->has_val)
        dataset_close(&t->val);
    metrics_close(&t->metrics);
    if (t->samples)
        fclose(t->samples);
    free(t->inputs);
    free(t->targets);
    free(t->sample_ids);
    free(t->sample_at);
    free(t->pos);
    free(t->seg);
    run_lock_release(t->lock);
}

/* train.log_samples: RUN_DIR/samples/rank-R.tsv */
static int open_samples(trainer_t *t, sp_err *err)
{
    char *dir = sp_strf("%s/samples", t->cfg->run_dir);
    char *path = dir ? sp_strf("%s/rank-%d.tsv", dir, t->rank) : NULL;
    if (!path)
        sp_fail(err, SP_EXIT_OTHER, "out of memory");
    comm_barrier(t->comm, err); /* rank 0 made run.dir */
    if (!err->code && !mkdir_p(dir, err) && !(t->samples = fopen(path, "a")))
        sp_fail(err, SP_EXIT_OTHER, "%s: cannot open: %s", path, strerror(errno));
    free(dir);
    free(path);
    return err->code;
}

static int setup(trainer_t *t, sp_err *err)
{
    const config_t *c = t->cfg;
    char afresh[8192] = "";
    if (t->rank == 0 &&
        (mkdir_p(c->run_dir, err) || lock_run_dir(t, err) ||
         (strcmp(t->resume, "none") == 0 && ckpt_start_afresh(c, afresh, sizeof afresh, err)) ||
         write_resolved_config(t, err) || metrics_open(&t->metrics, c->run_dir, err)))
        return err->code;
    if (afresh[0])
        log_event(t->out, &t->metrics, "warning", "%s", afresh);
    int threads = (int)c->threads;
    const char *backend = config_backend_names[c->backend];
    if (threads == 0 && strcmp(backend, "cuda") != 0)
        threads = comm_cores_per_rank(t->comm);
    if (backend_create(&t->be, backend, comm_local_rank(t->comm), threads, err))
        return err->code;
    if (c->log_samples && open_samples(t, err))
        return err->code;
    /* device gradients travel over NCCL, bootstrapped over MPI */
    if (grad_sync_device_init(t->be, t->comm, err))
        return err->code;
    if (t->out) {
        char blas[256] = "";
        if (strcmp(t->be->name, "cuda") != 0) {
            memcpy(blas, ", ", 3);
            backend_cpu_blas_describe(blas + 2, sizeof blas - 2);
        }
        fprintf(t->out, "spotune: %d rank%s, backend %s (%s, %d thread%s per rank%s)\n", t->world,
                t->world > 1 ? "s" : "", t->be->name, t->be->device_name, t->be->threads,
                t->be->threads == 1 ? "" : "s", blas);
        const char *better = strcmp(t->be->name, "cuda") != 0 ? backend_cpu_blas_better() : NULL;
        if (better) /* only where the user's OPENBLAS_CORETYPE keeps it (trainer/main.c) */
            log_event(t->out, &t->metrics, "warning",
                      "OPENBLAS_CORETYPE=%s keeps OpenBLAS on kernels narrower than this CPU's "
                      "vector units (spotune doctor, host.blas): OPENBLAS_CORETYPE=%s is faster",
                      getenv("OPENBLAS_CORETYPE") ? getenv("OPENBLAS_CORETYPE") : "(unset)",
                      better);
    }
    return setup_model(t, err) || setup_data(t, err) ? err->code : 0;
}

/* Returns 0 when the last step is done, SP_EXIT_PREEMPTED after a stop
 * signal and its checkpoint, or an error. */
static int train_loop(trainer_t *t, sp_err *err)
{
    const config_t *c = t->cfg;
    int stop = 0;
    if (t->p.step >= c->steps) { /* a resumed run that had already finished */
        if (t->p.step > c->steps && t->rank == 0)
            log_event(t->out, &t->metrics, "warning",
                      "train.steps is %lld but the checkpoint resumed is at step %lld: nothing "
                      "to train (a checkpoint is never rolled back; raise train.steps to go on, "
                      "or start afresh with --resume none)",
                      (long long)c->steps, (long long)t->p.step);
        return ckpt_ctl_boundary(t->ck, t->m, &t->p, 1, &stop, err);
    }
    if (c->cuda_graphs && t->world > 1 && t->rank == 0 && strcmp(t->be->name, "cuda") == 0)
        log_event(t->out, &t->metrics, "info", "%s",
                  t->m->shard_grads
                      ? "runtime.cuda_graphs: the gradients are sharded and reduced during "
                        "the backward, so the micro-batches run without graphs"
                      : "runtime.cuda_graphs: the gradients are all-reduced after each "
                        "backward instead of during it, so every micro-batch can replay a "
                        "graph");
    while (t->p.step < c->steps) {
        step_report rep;
        int64_t given_up = 0;
        if (run_step(t, &rep, &given_up, err))
            return err->code;
        if (given_up)
            return train_stop_within_step(t, given_up, err);
        if (t->steps_run == 1)
            comm_set_timeout(t->comm, c->comm_timeout_s);
        if (c->cuda_graphs && t->m->graph_off[0] && !t->graphs_noted && t->rank == 0) {
            log_event(t->out, &t->metrics, "warning",
                      "runtime.cuda_graphs: %s; the run goes on without graphs",
                      t->m->graph_off);
            t->graphs_noted = 1;
        }
        int print = t->p.step % c->log_every == 0 || t->p.step == c->steps || t->steps_run == 1;
        if (t->rank == 0)
            log_step(t->out, &t->metrics, &rep, print);
        int val_due = t->has_val && ((c->val_every > 0 && t->p.step % c->val_every == 0) ||
                                     t->p.step == c->steps);
        int val_given_up = 0; /* a stop: the boundary sees it and checkpoints */
        if (val_due && train_run_validation(t, &val_given_up, err))
            return err->code;
        if (ckpt_ctl_boundary(t->ck, t->m, &t->p, t->p.step == c->steps, &stop, err))
            return err->code;
        if (stop)
            return train_stopped(t, stop, err);
    }
    if (c->cuda_graphs && t->rank == 0) {
        const model_graph_count *mb = &t->m->graph_mb, *up = &t->m->graph_upd;
        char upd[160];
        if (t->m->shard_count > 1)
            snprintf(upd, sizeof upd, "the updates ran without (the optimizer is sharded)");
        else
            snprintf(upd, sizeof upd, "%zu updates replayed one, %zu were captured, %zu ran eagerly",
                     up->replays, up->captures, up->eager);
        log_event(t->out, &t->metrics, "info",
                  "runtime.cuda_graphs: %zu micro-batches replayed a graph, %zu were captured, "
                  "%zu ran eagerly; %s",
                  mb->replays, mb->captures, mb->eager, upd);
    }
    return 0;
}

/* The watchdog's deadline for the validation before the first step and
 * for the first step. On CUDA these pay one-time costs that the host waits
 * for, unevenly over the ranks: NCCL connects its channels on the first
 * collective that uses them, cuDNN and cuBLASLt plan on first use. They get
 * at least FIRST_STEP_TIMEOUT_S; every later step comm.timeout_s. */
enum { FIRST_STEP_TIMEOUT_S = 300 };

static double first_step_timeout(const trainer_t *t)
{
    double timeout = t->cfg->comm_timeout_s;
    if (t->be && strcmp(t->be->name, "cuda") == 0 && timeout < FIRST_STEP_TIMEOUT_S)
        return FIRST_STEP_TIMEOUT_S;
    return timeout;
}

int train_run(const config_t *cfg, comm_t *comm, const char *resume, sp_err *err)
{
    trainer_t t;
    memset(&t, 0, sizeof t);
    t.train.file = t.train.tokens = t.train.mask = -1;
    t.cfg = cfg;
    t.comm = comm;
    t.resume = resume ? resume : "auto";
    t.rank = comm_rank(comm);
    t.world = comm_size(comm);
    t.out = t.rank == 0 ? stdout : NULL;
    t.T = cfg->seq_len;
    t.mb = cfg->micro_batch;
    t.ga = cfg->grad_accum;
    t.global_batch = (int64_t)t.world * t.mb * t.ga;
    /* loading a model, or pulling a checkpoint from a bucket, can take some
     * ranks much longer than others: the watchdog waits longer meanwhile */
    double timeout = cfg->comm_timeout_s;
    comm_set_timeout(comm, timeout > 3600.0 ? timeout : 3600.0);
    int rc = train_stop_before_training(&t, "at start-up", err);
    if (!rc)
        rc = setup(&t, err);
    if (!rc)
        rc = train_stop_before_training(&t, "before the first step", err);
    comm_set_timeout(comm, first_step_timeout(&t));
    if (!rc)
        rc = train_validate_first(&t, err);
    if (!rc)
        rc = train_loop(&t, err);
    if (!rc)
        rc = finish(&t, err);
    sp_err cerr = {0};
    int crc = ckpt_ctl_close(t.ck, rc == 0, &cerr);
    if (!rc && crc)
        rc = sp_fail(err, crc, "%s", cerr.msg);
    if (!rc && t.out)
        fprintf(t.out, "done: %lld steps in %.1f s; metrics: %s/metrics.jsonl\n",
                (long long)t.p.step, t.p.elapsed_s, cfg->run_dir);
    trainer_free(&t);
    return rc;
}
