/* Training-step benchmark on random weights. */
#define _POSIX_C_SOURCE 200809L
#include "bench.h"

#include <getopt.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "grad_sync.h"
#include "model.h"
#include "optim.h"
#include "plan.h"

typedef struct bench_opts {
    const char *preset, *backend;
    int mode; /* 0 lora, 1 full, 2 both */
    int micro_batch, seq_len, steps, warmup, lora_r, recompute, threads, json;
    double peak_tflops;
    int plan_ranks; /* > 0: print the memory plan for this many ranks, run nothing */
    double loss_tol, gnorm_tol; /* the step-1 check against the CPU backend */
    int cpu_check;              /* -1 auto (tiny and small), 0 off, 1 on */
    int shard_grads;            /* full mode on several ranks: gradients sharded too */
    int nf4;                    /* --quantize nf4: QLoRA, the projections NF4 (model.quantize) */
    int graphs;                 /* --cuda-graphs on: runtime.cuda_graphs */
    int doc_len;                /* --doc-len N: windows of packed documents of about N tokens */
} bench_opts;

/* Windows of packed documents (data.packing: documents), as the data
 * layer gives them: lengths drawn from [N/2, 3N/2] (at least 1, one fixed
 * draw), each window cut where it ends; positions restart at each
 * document, seg its first position. */
static void bench_documents(int B, int T, int N, int32_t *pos, int32_t *seg)
{
    uint64_t draw = 0;
    int lo = N / 2 > 0 ? N / 2 : 1, span = N + N / 2 - lo + 1;
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T;) {
            int len = lo + (int)(sp_rng_u64(9, draw++) % (uint64_t)span);
            for (int i = t; i < t + len && i < T; i++)
                seg[(size_t)b * T + i] = t, pos[(size_t)b * T + i] = i - t;
            t += len;
        }
}

/* Dense bf16 tensor-core peaks (TFLOP/s) by device name: the cards of
 * spotune plan's table (trainer/plan.c, with their datasheets), then others. */
static double gpu_peak_tflops(const char *name)
{
    const plan_gpu *g = plan_gpu_for_device(name);
    if (g)
        return g->bf16_tflops;
    static const struct { const char *key; double tflops; } peaks[] = {
        {"H100 PCIe", 756.0}, {"H100", 989.0}, {"H800", 989.0}, {"A100", 312.0},
        {"A800", 312.0},      {"L40", 181.0},  {"A10G", 70.0},  {"A6000", 155.0},
    };
    for (size_t i = 0; i < sizeof peaks / sizeof peaks[0]; i++)
        if (strstr(name, peaks[i].key))
            return peaks[i].tflops;
    return 0.0;
}

/* Model FLOPs per trained token, the honest count (PaLM's convention:
 * matmuls forward 2N, backward 2N for activations plus 2N for weights when
 * they train, so 4N for the frozen weights of LoRA and 6N for the trainable
 * ones, LoRA adapters included; attention 12 * layers * heads * head_dim *
 * ctx, ctx = T for dense rows; the embedding gather and recomputation are
 * not counted). The common convention is 6 x (every parameter) per token:
 * bench_flops_6n. */
double bench_flops_per_token(const model_config_t *mc, int mode, double lora_params, double ctx)
{
    double nmm = (double)mc->vocab * (double)mc->hidden;
    for (int p = 0; p < PROJ_COUNT; p++) {
        int64_t in, out;
        model_config_proj_dims(mc, p, &in, &out);
        nmm += (double)mc->layers * (double)(in * out);
    }
    double mm = mode == MODE_FULL ? 6.0 * nmm : 4.0 * nmm + 6.0 * lora_params;
    return mm + 12.0 * (double)mc->layers * (double)(mc->heads * mc->head_dim) * ctx;
}

double bench_attention_context(const int32_t *seg, int B, int T)
{
    if (!seg || B <= 0 || T <= 0)
        return (double)T;
    double sq = 0;
    for (int b = 0; b < B; b++) {
        const int32_t *r = seg + (size_t)b * (size_t)T;
        for (int t = 0, l = 1; t < T; t++, l++)
            if (t + 1 == T || r[t + 1] != r[t]) { /* t ends a document of l tokens */
                sq += (double)l * (double)l;
                l = 0;
            }
    }
    return sq / ((double)B * (double)T);
}

static double flops_per_token(const model_t *m, double ctx)
{
    return bench_flops_per_token(&m->mc, m->o.mode,
                                 m->o.mode == MODE_LORA ? (double)m->n_trainable : 0.0, ctx);
}

static const char *modes_name(const bench_opts *bo, int mode)
{
    return mode == MODE_FULL ? "full" : bo->nf4 ? "qlora" : "lora";
}

double bench_flops_6n(const model_config_t *mc)
{
    return 6.0 * (double)model_config_params(mc);
}

/* ---- the step-1 checks ---------------------------------------------------------- */

double bench_expected_loss(const model_config_t *mc)
{
    /* logits = hf W^T with hf of unit RMS (final norm, weight 1) and W ~
     * N(0, 0.02^2): each logit ~ N(0, s^2), s^2 = 0.02^2 hidden, so
     * E[logsumexp] = ln(vocab) + s^2 / 2 (vocab >> 1) and the target's logit
     * averages 0 */
    return log((double)mc->vocab) + 0.5 * 0.02 * 0.02 * (double)mc->hidden;
}

int bench_check_loss(double loss, const model_config_t *mc, char *why, size_t n)
{
    double want = bench_expected_loss(mc);
    if (!isfinite(loss)) {
        snprintf(why, n, "step-1 loss is %g, not a finite number", loss);
        return -1;
    }
    if (fabs(loss - want) > BENCH_LOSS_BAND) {
        snprintf(why, n,
                 "step-1 loss %.4f is outside %.4f +- %.1f, the loss of random weights "
                 "(ln(vocab %lld) = %.4f, plus the logits' variance / 2)",
                 loss, want, BENCH_LOSS_BAND, (long long)mc->vocab, log((double)mc->vocab));
        return -1;
    }
    snprintf(why, n, "step-1 loss %.4f within %.4f +- %.1f", loss, want, BENCH_LOSS_BAND);
    return 0;
}

int bench_check_against_cpu(double loss, double gnorm, double cpu_loss, double cpu_gnorm,
                            double loss_tol, double gnorm_tol, char *why, size_t n)
{
    double dl = fabs(loss - cpu_loss) / fmax(fabs(cpu_loss), 1e-30);
    double dg = fabs(gnorm - cpu_gnorm) / fmax(fabs(cpu_gnorm), 1e-30);
    int ok = isfinite(loss) && isfinite(gnorm) && isfinite(cpu_loss) && isfinite(cpu_gnorm) &&
             dl <= loss_tol && dg <= gnorm_tol;
    snprintf(why, n,
             "step 1 vs the cpu backend: loss %.6f vs %.6f (relative difference %.2e, tolerance "
             "%.1e), gradient norm %.6g vs %.6g (%.2e, tolerance %.1e)",
             loss, cpu_loss, dl, loss_tol, gnorm, cpu_gnorm, dg, gnorm_tol);
    return ok ? 0 : -1;
}

/* Model, random weights and batch of a bench run (shared by the timed
 * backend and the CPU reference). */
static int build(const bench_opts *bo, int mode, backend_t *be, comm_t *comm,
                 const model_config_t *mc, model_t **out, sp_err *err)
{
    model_opts o = {.mode = mode, .lora_r = bo->lora_r, .lora_alpha = 2.0 * bo->lora_r,
                    .lora_targets = (1 << PROJ_COUNT) - 1, .max_batch = bo->micro_batch,
                    .seq_len = bo->seq_len, .recompute = bo->recompute, .seed = 1,
                    .nf4 = bo->nf4, .graphs = bo->graphs};
    if (mode == MODE_FULL && comm && comm_size(comm) > 1) { /* as train.shard_optimizer does */
        o.shard_count = comm_size(comm);
        o.shard_rank = comm_rank(comm);
        o.shard_grads = bo->shard_grads; /* train.shard_gradients */
    }
    if (model_create(out, be, mc, &o, err))
        return err->code;
    model_init_base_random(*out, 1);
    if (mode == MODE_LORA)
        model_init_lora(*out, 1);
    return be_check(be, err);
}

/* Step 1 of the same model, seed and batch on the CPU backend: its mean
 * token loss and gradient norm (one rank, no collective). */
static int cpu_step1(const bench_opts *bo, int mode, const model_config_t *mc,
                     const model_batch *batch, double *loss, double *gnorm, sp_err *err)
{
    backend_t *be;
    model_t *m;
    if (backend_create(&be, "cpu", 0, bo->threads, err))
        return err->code;
    if (build(bo, mode, be, NULL, mc, &m, err)) {
        model_destroy(m);
        backend_destroy(be);
        return err->code;
    }
    double sum = 0;
    model_zero_grads(m);
    int rc = model_forward_backward(m, batch, &sum, err);
    if (!rc) {
        *loss = sum / ((double)batch->B * batch->T);
        *gnorm = sqrt(model_grad_sumsq(m));
        rc = be_check(be, err);
    }
    model_destroy(m);
    backend_destroy(be);
    return rc;
}

/* Whether the step-1 check against the CPU backend runs: for the presets
 * the CPU does in seconds, on another backend, on one rank. */
static int wants_cpu_check(const bench_opts *bo, const backend_t *be, const comm_t *comm)
{
    if (bo->cpu_check == 0 || strcmp(be->name, "cpu") == 0 || comm_size(comm) > 1)
        return 0;
    return bo->cpu_check == 1 || !strcmp(bo->preset, "tiny") || !strcmp(bo->preset, "small");
}


/* One training step of the bench: forward and backward, the gradients
 * synchronised, their norm, AdamW (step s + 1), the weights gathered. */
static int bench_step(model_t *m, comm_t *comm, const model_batch *batch, adamw_args *a, int s,
                      double *loss, double *gnorm, sp_err *err)
{
    grad_sync_t gs;
    model_zero_grads(m);
    grad_sync_begin(&gs, m, comm, 25.0);
    if (model_forward_backward(m, batch, NULL, err) || grad_sync_finish(&gs, err) ||
        model_loss_take(m, loss, err))
        return err->code;
    a->step = s + 1;
    return grad_sync_update(m, comm, a, 1.0, gnorm, err);
}

static int bench_one(const bench_opts *bo, int mode, comm_t *comm, sp_err *err)
{
    model_config_t mc;
    if (model_config_preset(&mc, bo->preset))
        return sp_fail(err, SP_EXIT_USAGE,
                       "bench: unknown preset '%s' (tiny, small, llama-7b, llama-13b)", bo->preset);
    backend_t *be;
    int threads = bo->threads;
    if (threads == 0)
        threads = comm_cores_per_rank(comm);
    if (backend_create(&be, bo->backend, comm_local_rank(comm), threads, err))
        return err->code;
    if (grad_sync_device_init(be, comm, err)) {
        backend_destroy(be);
        return err->code;
    }
    model_t *m;
    int talk = comm_rank(comm) == 0; /* progress on stderr: a 13B build takes a while */
    double tb = sp_now();
    if (talk)
        fprintf(stderr, "bench: building %s (%s, random weights)...\n", bo->preset,
                modes_name(bo, mode));
    if (build(bo, mode, be, comm, &mc, &m, err)) {
        model_destroy(m);
        backend_destroy(be);
        return err->code;
    }
    be_sync(be);
    double build_s = sp_now() - tb;
    if (talk)
        fprintf(stderr, "bench: built in %.1f s\n", build_s);
    size_t n = (size_t)bo->micro_batch * (size_t)bo->seq_len;
    int32_t *in = malloc(sizeof(int32_t) * n), *tg = malloc(sizeof(int32_t) * n);
    int32_t *pos = bo->doc_len ? malloc(sizeof(int32_t) * n) : NULL;
    int32_t *seg = bo->doc_len ? malloc(sizeof(int32_t) * n) : NULL;
    if (!in || !tg || (bo->doc_len && (!pos || !seg))) {
        free(in);
        free(tg);
        free(pos);
        free(seg);
        model_destroy(m);
        backend_destroy(be);
        return sp_fail(err, SP_EXIT_OTHER, "bench: out of host memory for %zu tokens", n);
    }
    uint64_t ids[4096];
    for (size_t i = 0; i < n; i++) {
        in[i] = (int32_t)(sp_rng_u64(7, i) % (uint64_t)mc.vocab);
        tg[i] = (int32_t)(sp_rng_u64(8, i) % (uint64_t)mc.vocab);
    }
    for (int b = 0; b < bo->micro_batch && b < 4096; b++)
        ids[b] = (uint64_t)b;
    if (bo->doc_len)
        bench_documents(bo->micro_batch, bo->seq_len, bo->doc_len, pos, seg);
    model_batch batch = {.inputs = in,
                         .targets = tg,
                         .sample_ids = ids,
                         .B = bo->micro_batch,
                         .T = bo->seq_len,
                         .grad_scale = (float)(1.0 / (double)n),
                         .last = 1,
                         .pos = pos,
                         .seg = seg};
    adamw_args a = {.lr = 1e-5f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f,
                    .weight_decay = 0.0f, .grad_scale = 1.0f};
    double t0 = 0, step1_loss = NAN, step1_gnorm = NAN;
    int rc = 0;
    for (int s = 0; s < bo->warmup + bo->steps && !rc; s++) {
        if (s == bo->warmup) {
            be_sync(be);
            rc = comm_barrier(comm, err);
            t0 = sp_now();
        }
        double loss = 0, gnorm = 0, ts = sp_now();
        rc = rc || bench_step(m, comm, &batch, &a, s, &loss, &gnorm, err);
        if (talk && !rc)
            fprintf(stderr, "bench: step %d/%d%s: %.3f s\n", s + 1, bo->warmup + bo->steps,
                    s < bo->warmup ? " (warm-up)" : "", sp_now() - ts);
        if (!rc && s == 0) { /* before any update: what the checks compare */
            step1_loss = loss / (double)n;
            step1_gnorm = gnorm / comm_size(comm); /* every rank ran the same batch */
        }
    }
    be_sync(be);
    rc = rc || be_check(be, err) || comm_barrier(comm, err);
    double dt = (sp_now() - t0) / (bo->steps > 0 ? bo->steps : 1);
    /* one more step, not timed above, split by group of ops */
    double split[BE_PROF_GROUPS] = {0}, split_total = 0;
    if (!rc && bo->steps > 0) {
        double loss = 0, gnorm = 0;
        if (be_prof_start(be) == 0) {
            rc = bench_step(m, comm, &batch, &a, bo->warmup + bo->steps, &loss, &gnorm, err);
            if (be_prof_stop(be, split) != 0 && !rc)
                rc = be_check(be, err);
        }
        for (int g = 0; g < BE_PROF_GROUPS; g++)
            split_total += split[g];
    }
    /* timing done: free the device before the checks */
    int world = comm_size(comm);
    /* packed documents: each token's attention counts over its document */
    double ctx = bench_attention_context(seg, bo->micro_batch, bo->seq_len);
    double fpt = flops_per_token(m, ctx), fpt6 = bench_flops_6n(&mc);
    size_t n_trainable = m->n_trainable;
    size_t replays = m->graph_mb.replays, graph_ops = m->graph_mb.ops;
    size_t upd_replays = m->graph_upd.replays, upd_ops = m->graph_upd.ops;
    char graph_off[sizeof m->graph_off];
    snprintf(graph_off, sizeof graph_off, "%s", m->graph_off);
    double peak_mem = (double)be->bytes_peak;
    int on_gpu = strcmp(be->name, "cuda") == 0;
    if (!on_gpu) {
        struct rusage ru;
        getrusage(RUSAGE_SELF, &ru);
        peak_mem = (double)ru.ru_maxrss * 1024.0;
    }
    double peak = on_gpu ? gpu_peak_tflops(be->device_name) : bo->peak_tflops;
    int be_threads = be->threads;
    char be_name[16], dev_name[sizeof be->device_name];
    snprintf(be_name, sizeof be_name, "%s", be->name);
    snprintf(dev_name, sizeof dev_name, "%s", be->device_name);
    int cpu_check = !rc && wants_cpu_check(bo, be, comm);
    char blas[256] = "";
    const char *better = NULL;
    if (!on_gpu) {
        backend_cpu_blas_describe(blas, sizeof blas);
        better = backend_cpu_blas_better(); /* only where OPENBLAS_CORETYPE holds it back */
    }
    model_destroy(m);
    backend_destroy(be);

    /* the checks of step 1: a loss random weights can have, and (small
     * presets) the same step on the CPU backend */
    char loss_why[320] = "", cpu_why[400] = "";
    double cpu_loss = NAN, cpu_gnorm = NAN;
    int loss_bad = 0, cpu_bad = 0;
    if (!rc) {
        loss_bad = bench_check_loss(step1_loss, &mc, loss_why, sizeof loss_why) != 0;
        if (cpu_check) {
            rc = cpu_step1(bo, mode, &mc, &batch, &cpu_loss, &cpu_gnorm, err);
            if (!rc)
                cpu_bad = bench_check_against_cpu(step1_loss, step1_gnorm, cpu_loss, cpu_gnorm,
                                                  bo->loss_tol, bo->gnorm_tol, cpu_why,
                                                  sizeof cpu_why) != 0;
        }
    }
    if (!rc && comm_rank(comm) == 0) {
        double tps = (double)n * world / dt;
        double mfu = peak > 0 ? fpt * tps / world / (peak * 1e12) : -1;
        double mfu6 = peak > 0 ? fpt6 * tps / world / (peak * 1e12) : -1;
        const char *check = loss_bad || cpu_bad ? "fail" : "ok";
        if (bo->json) {
            json_t *j = json_pack(
                "{s:s, s:s, s:s, s:s, s:i, s:i, s:i, s:i, s:f, s:f, s:f, s:f, s:f, s:f, s:f, s:I, "
                "s:I, s:f, s:f, s:f, s:s, s:s}",
                "preset", bo->preset, "mode", modes_name(bo, mode), "backend", be_name, "device",
                dev_name,
                "ranks", world, "micro_batch", bo->micro_batch, "seq_len", bo->seq_len, "threads",
                be_threads, "step_s", dt, "tokens_per_s", tps, "mfu", mfu, "mfu_6n", mfu6,
                "flops_per_token", fpt, "flops_per_token_6n", fpt6, "peak_mem_bytes", peak_mem,
                "trainable_params", (json_int_t)n_trainable, "params",
                (json_int_t)model_config_params(&mc), "step1_loss", step1_loss,
                "step1_grad_norm", step1_gnorm, "expected_loss", bench_expected_loss(&mc),
                "check", check, "loss_check", loss_why);
            if (split_total > 0) { /* the profiled step, ms by group */
                json_t *sp = json_object();
                for (int g = 0; g < BE_PROF_GROUPS; g++)
                    json_object_set_new(sp, be_prof_names[g], json_real(split[g]));
                json_object_set_new(j, "split_ms", sp);
                json_object_set_new(j, "profiled_step_ms", json_real(split_total));
            }
            json_object_set_new(j, "build_s", json_real(build_s));
            json_object_set_new(j, "cuda_graphs", json_boolean(bo->graphs));
            json_object_set_new(j, "doc_len", json_integer(bo->doc_len));
            json_object_set_new(j, "attention_context", json_real(ctx));
            if (bo->graphs) {
                json_object_set_new(j, "graph_replays", json_integer((json_int_t)replays));
                json_object_set_new(j, "graph_ops", json_integer((json_int_t)graph_ops));
                json_object_set_new(j, "graph_update_replays",
                                    json_integer((json_int_t)upd_replays));
                json_object_set_new(j, "graph_update_ops", json_integer((json_int_t)upd_ops));
                json_object_set_new(j, "graph_off", json_string(graph_off));
            }
            if (!on_gpu) { /* the products' kernels, which move a CPU step by 2x */
                json_object_set_new(j, "blas", json_string(blas));
                json_object_set_new(j, "blas_better", better ? json_string(better) : json_null());
            }
            if (cpu_check) {
                json_object_set_new(j, "cpu_step1_loss", json_real(cpu_loss));
                json_object_set_new(j, "cpu_step1_grad_norm", json_real(cpu_gnorm));
                json_object_set_new(j, "cpu_check", json_string(cpu_why));
            }
            char *s = json_dumps(j, JSON_COMPACT | JSON_PRESERVE_ORDER);
            printf("%s\n", s);
            free(s);
            json_decref(j);
        } else {
            printf("%-9s %-4s %-5s %-20s ranks %d  mb %d  seq %d  step %.3f s  %10.1f tok/s  "
                   "peak %.2f GiB",
                   bo->preset, modes_name(bo, mode), be_name, dev_name, world, bo->micro_batch,
                   bo->seq_len, dt, tps, peak_mem / (1 << 30));
            if (mfu >= 0)
                printf("  MFU %.1f%% (6N: %.1f%%)", 100.0 * mfu, 100.0 * mfu6);
            if (bo->doc_len)
                printf("  packed documents of ~%d tokens (attention over %.0f keys a token)",
                       bo->doc_len, ctx);
            printf("\n  step 1: loss %.6f, gradient norm %.6g; %s\n", step1_loss, step1_gnorm,
                   loss_why);
            if (split_total > 0) {
                printf("  one profiled step, %.1f ms:", split_total);
                for (int g = 0; g < BE_PROF_GROUPS; g++)
                    printf(" %s %.1f%%%s", be_prof_names[g], 100.0 * split[g] / split_total,
                           g + 1 < BE_PROF_GROUPS ? "," : "\n");
            }
            if (bo->graphs && graph_off[0])
                printf("  graphs: off, %s\n", graph_off);
            else if (bo->graphs)
                printf("  graphs: %zu of the steps' micro-batches replayed one (%zu ops "
                       "each), %zu of their updates (%zu ops)\n",
                       replays, graph_ops, upd_replays, upd_ops);
            if (cpu_check)
                printf("  %s\n", cpu_why);
            if (!on_gpu)
                printf("  %s\n", blas);
            if (better)
                printf("  OPENBLAS_CORETYPE=%s keeps OpenBLAS on kernels narrower than this "
                       "CPU's vector units: OPENBLAS_CORETYPE=%s is faster\n",
                       getenv("OPENBLAS_CORETYPE") ? getenv("OPENBLAS_CORETYPE") : "(unset)",
                       better);
        }
        fflush(stdout);
    }
    if (!rc && loss_bad)
        rc = sp_fail(err, SP_EXIT_OTHER, "bench %s %s on %s: %s", bo->preset, modes_name(bo, mode),
                     be_name, loss_why);
    else if (!rc && cpu_bad)
        rc = sp_fail(err, SP_EXIT_OTHER, "bench %s %s on %s: %s", bo->preset, modes_name(bo, mode),
                     be_name, cpu_why);
    free(in);
    free(tg);
    free(pos);
    free(seg);
    return rc;
}

/* What each rank would allocate, from the model's plan: bf16 activations
 * and weights as on a GPU (f32 with --backend cpu or cpu-ref). */
static int print_plan(const bench_opts *bo, int mode, sp_err *err)
{
    model_config_t mc;
    if (model_config_preset(&mc, bo->preset))
        return sp_fail(err, SP_EXIT_USAGE,
                       "bench: unknown preset '%s' (tiny, small, llama-7b, llama-13b)", bo->preset);
    dtype_t act = sp_after(bo->backend, "cpu") ? DT_F32 : DT_BF16; /* cpu and cpu-ref */
    model_opts o = {.mode = mode, .lora_r = bo->lora_r, .lora_alpha = 2.0 * bo->lora_r,
                    .lora_targets = (1 << PROJ_COUNT) - 1, .max_batch = bo->micro_batch,
                    .seq_len = bo->seq_len, .recompute = bo->recompute, .seed = 1,
                    .nf4 = bo->nf4};
    if (mode == MODE_FULL && bo->plan_ranks > 1) {
        o.shard_count = bo->plan_ranks;
        o.shard_grads = bo->shard_grads;
    }
    model_plan p;
    model_plan_bytes(&mc, &o, act, &p);
    const double G = 1024.0 * 1024.0 * 1024.0;
    static const char *recs[] = {"none", "attention", "layer"};
    printf("%-9s %-5s %-4s ranks %-3d mb %d  seq %-5d recompute %-9s weights %7.2f GiB  trainable "
           "%7.2f GiB  activations %6.2f GiB  scratch %5.2f GiB  total %7.2f GiB per rank%s\n",
           bo->preset, mode == MODE_FULL ? "full" : bo->nf4 ? "qlora" : "lora", dtype_name(act),
           bo->plan_ranks,
           bo->micro_batch, bo->seq_len, recs[bo->recompute], (double)p.weights / G,
           (double)p.trainable / G, (double)p.activations / G, (double)p.scratch / G,
           (double)(p.weights + p.trainable + p.activations + p.scratch) / G,
           model_shards_grads(&o)  ? " (optimizer and gradients sharded)"
           : o.shard_count > 1 ? " (optimizer sharded)"
                               : "");
    return 0;
}

static void bench_usage(FILE *f)
{
    fprintf(f,
            "usage: spotune bench [options]\n"
            "Times training steps of a preset model with random weights (no files).\n"
            "  --preset NAME        tiny, small, llama-7b, llama-13b (default small)\n"
            "  --mode MODE          lora, full or both (default both)\n"
            "  --micro-batch N      windows per step (default 1)\n"
            "  --seq-len N          tokens per window (default 2048)\n"
            "  --steps N            timed steps (default 5)\n"
            "  --warmup N           untimed steps first (default 1)\n"
            "  --lora-r N           LoRA rank on all 7 projections (default 16)\n"
            "  --recompute WHAT     none, attention or layer (default none)\n"
            "  --backend NAME       auto, cpu, cpu-ref or cuda (default auto)\n"
            "  --threads N          CPU threads (default: all cores)\n"
            "  --peak-tflops X      peak of the device, for MFU on a CPU\n"
            "  --json               one JSON object per mode\n"
            "  --plan RANKS         print each rank's memory plan for a run on RANKS ranks\n"
            "                       (full mode: optimizer sharded) and run nothing\n"
            "  --quantize Q         none or nf4 (QLoRA, as model.quantize: the projections in\n"
            "                       NF4; LoRA mode only)\n"
            "  --shard-gradients ON full mode on several ranks: shard the gradients as well\n"
            "                       (on or off, default on, as train.shard_gradients)\n"
            "  --cpu-check WHEN     auto, on or off (default auto: presets tiny and small on a\n"
            "                       backend other than cpu, one rank): run step 1 again on\n"
            "                       the cpu backend and fail when its loss or gradient norm\n"
            "                       differs by more than the tolerance\n"
            "  --check-tol L,G      relative tolerances of that check: loss, gradient norm\n"
            "                       (default 5e-3,2e-2)\n"
            "  --cuda-graphs ON     on or off (default off): each step's forward and backward,\n"
            "                       and its update, replayed as captured graphs\n"
            "                       (runtime.cuda_graphs)\n"
            "  --doc-len N          windows of packed documents of about N tokens (lengths\n"
            "                       drawn from N/2 to 3N/2), as data.packing: documents gives\n"
            "                       them: attention stays inside each (default 0: one stream)\n"
            "  --probe-cuda         say whether a CUDA device is usable (exit 0) or why not\n"
            "                       (exit 77), and run nothing\n"
            "Every run records step 1's loss and gradient norm (before any update) and fails\n"
            "when the loss is not finite or is more than 1 from the loss of random weights,\n"
            "ln(vocab) + 0.0002 x hidden (the logits' variance / 2). With --json the line also\n"
            "has MFU in two conventions: mfu (4N per token for frozen weights, 6N for trainable\n"
            "ones, plus attention) and mfu_6n (6 x every parameter per token).\n");
}

int bench_main(int argc, char **argv, comm_t *comm, sp_err *err)
{
    bench_opts bo = {"small", "auto", 2, 1, 2048, 5, 1, 16, RECOMPUTE_NONE, 0, 0, 0.0, 0,
                     BENCH_LOSS_TOL, BENCH_GNORM_TOL, -1, 1, 0, 0, 0};
    int probe = 0;
    static const struct option longopts[] = {
        {"preset", 1, 0, 'p'},      {"mode", 1, 0, 'm'},     {"micro-batch", 1, 0, 'b'},
        {"seq-len", 1, 0, 's'},     {"steps", 1, 0, 'n'},    {"warmup", 1, 0, 'w'},
        {"lora-r", 1, 0, 'r'},      {"recompute", 1, 0, 'c'}, {"backend", 1, 0, 'k'},
        {"threads", 1, 0, 't'},     {"json", 0, 0, 'j'},     {"peak-tflops", 1, 0, 'f'},
        {"plan", 1, 0, 'P'},        {"help", 0, 0, 'h'},     {"cpu-check", 1, 0, 'C'},
        {"check-tol", 1, 0, 'T'},   {"probe-cuda", 0, 0, 'U'}, {"shard-gradients", 1, 0, 'G'},
        {"quantize", 1, 0, 'Q'},    {"cuda-graphs", 1, 0, 'R'}, {"doc-len", 1, 0, 'D'},
        {0, 0, 0, 0}};
    int ch;
    optind = 1;
    while ((ch = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
        switch (ch) {
        case 'p': bo.preset = optarg; break;
        case 'm':
            bo.mode = !strcmp(optarg, "lora") ? 0 : !strcmp(optarg, "full") ? 1
                      : !strcmp(optarg, "both") ? 2 : -1;
            if (bo.mode < 0)
                return sp_fail(err, SP_EXIT_USAGE, "bench: --mode must be lora, full or both");
            break;
        case 'b': bo.micro_batch = atoi(optarg); break;
        case 's': bo.seq_len = atoi(optarg); break;
        case 'n': bo.steps = atoi(optarg); break;
        case 'w': bo.warmup = atoi(optarg); break;
        case 'r': bo.lora_r = atoi(optarg); break;
        case 'c':
            bo.recompute = !strcmp(optarg, "none") ? RECOMPUTE_NONE
                           : !strcmp(optarg, "attention") ? RECOMPUTE_ATTENTION
                           : !strcmp(optarg, "layer") ? RECOMPUTE_LAYER : -1;
            if (bo.recompute < 0)
                return sp_fail(err, SP_EXIT_USAGE,
                               "bench: --recompute must be none, attention or layer");
            break;
        case 'k': bo.backend = optarg; break;
        case 't': bo.threads = atoi(optarg); break;
        case 'j': bo.json = 1; break;
        case 'f': bo.peak_tflops = atof(optarg); break;
        case 'P':
            bo.plan_ranks = atoi(optarg);
            if (bo.plan_ranks < 1 || bo.plan_ranks > 65536)
                return sp_fail(err, SP_EXIT_USAGE, "bench: --plan takes a rank count (1..65536)");
            break;
        case 'C':
            bo.cpu_check = !strcmp(optarg, "auto") ? -1 : !strcmp(optarg, "on") ? 1
                           : !strcmp(optarg, "off") ? 0 : -2;
            if (bo.cpu_check == -2)
                return sp_fail(err, SP_EXIT_USAGE, "bench: --cpu-check must be auto, on or off");
            break;
        case 'T': {
            char *end;
            bo.loss_tol = strtod(optarg, &end);
            if (*end == ',')
                bo.gnorm_tol = strtod(end + 1, &end);
            else
                bo.gnorm_tol = bo.loss_tol;
            if (*end || !(bo.loss_tol >= 0) || !(bo.gnorm_tol >= 0))
                return sp_fail(err, SP_EXIT_USAGE,
                               "bench: --check-tol takes LOSS[,GNORM], relative, >= 0");
            break;
        }
        case 'U': probe = 1; break;
        case 'G':
            bo.shard_grads = !strcmp(optarg, "on") ? 1 : !strcmp(optarg, "off") ? 0 : -1;
            if (bo.shard_grads < 0)
                return sp_fail(err, SP_EXIT_USAGE, "bench: --shard-gradients must be on or off");
            break;
        case 'Q':
            bo.nf4 = !strcmp(optarg, "nf4") ? 1 : !strcmp(optarg, "none") ? 0 : -1;
            if (bo.nf4 < 0)
                return sp_fail(err, SP_EXIT_USAGE, "bench: --quantize must be none or nf4");
            break;
        case 'R':
            bo.graphs = !strcmp(optarg, "on") ? 1 : !strcmp(optarg, "off") ? 0 : -1;
            if (bo.graphs < 0)
                return sp_fail(err, SP_EXIT_USAGE, "bench: --cuda-graphs must be on or off");
            break;
        case 'D': {
            char *end;
            long v = strtol(optarg, &end, 10);
            if (end == optarg || *end || v < 0 || v > 1 << 24)
                return sp_fail(err, SP_EXIT_USAGE, "bench: --doc-len takes a token count, not "
                                                   "'%s'", optarg);
            bo.doc_len = (int)v;
            break;
        }
        case 'h': bench_usage(stdout); return 0;
        default: bench_usage(stderr); return sp_fail(err, SP_EXIT_USAGE, "bench: bad option");
        }
    }
    if (probe) {
        char why[320];
        int n = backend_cuda_probe(why, sizeof why);
        if (n <= 0)
            return sp_fail(err, BENCH_EXIT_NO_DEVICE, "no usable CUDA device: %s", why);
        printf("cuda: %s\n", why);
        return 0;
    }
    if (bo.micro_batch < 1 || bo.micro_batch > 4096 || bo.seq_len < 2 || bo.steps < 1 ||
        bo.warmup < 0 || bo.lora_r < 1)
        return sp_fail(err, SP_EXIT_USAGE, "bench: sizes must be positive");
    if (bo.doc_len < 0 || bo.doc_len > bo.seq_len)
        return sp_fail(err, SP_EXIT_USAGE, "bench: --doc-len must be from 0 (none) to --seq-len "
                                           "(%d), not %d", bo.seq_len, bo.doc_len);
    if (bo.nf4 && bo.mode == 1)
        return sp_fail(err, SP_EXIT_USAGE,
                       "bench: --quantize nf4 needs --mode lora (QLoRA trains LoRA on frozen NF4 "
                       "weights)");
    if (bo.nf4)
        bo.mode = 0; /* both: LoRA only */
    for (int mode = 0; mode < 2; mode++) {
        if (bo.mode != 2 && bo.mode != mode)
            continue;
        if (bo.plan_ranks ? print_plan(&bo, mode, err) : bench_one(&bo, mode, comm, err))
            return err->code;
    }
    return 0;
}
