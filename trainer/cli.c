/* Subcommand dispatch, options and help. */
#define _POSIX_C_SOURCE 200809L
#include "cli.h"

#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../comm/comm.h"
#include "bench.h"
#include "cmd_ckpt.h"
#include "config.h"
#include "doctor.h"
#include "model.h"
#include "model_io.h"
#include "plan.h"
#include "prepare_text.h"
#include "signals.h"
#include "train.h"

/* SPOTUNE_VERSION: project(spotune VERSION ...) of CMakeLists.txt, the one
 * place the version is written. */
#ifndef SPOTUNE_VERSION
#error "SPOTUNE_VERSION is defined by the build (trainer/CMakeLists.txt)"
#endif

static void usage(FILE *f)
{
    fprintf(f,
            "spotune %s: fine-tune Llama-family models with LoRA or full parameters,\n"
            "data-parallel over MPI ranks, on CPUs or CUDA GPUs.\n\n"
            "usage: spotune COMMAND [options]     (spotune COMMAND --help for details)\n\n"
            "commands:\n"
            "  train CONFIG.yaml [--set section.key=value ...]\n"
            "                      train as the config says (run it under mpirun for several ranks)\n"
            "  init-model --preset NAME --seed S [--dtype f32|bf16] OUT_DIR\n"
            "                      write a randomly initialised model directory (tiny, small,\n"
            "                      llama-7b, llama-13b)\n"
            "  prepare-text IN.txt OUT_PREFIX [--val-fraction F] [--seed S]\n"
            "                      byte-level tokenization of a text into OUT_PREFIX.train.h5/.val.h5\n"
            "  ckpt list|verify|pull ...\n"
            "                      list and verify checkpoints, local or in an object store\n"
            "  export CHECKPOINT --peft OUT_DIR | --merged OUT_DIR [--dtype bf16|f16|f32]\n"
            "         [--model BASE_DIR]\n"
            "                      the adapter (PEFT layout) or the merged model of a checkpoint\n"
            "                      (--model: the base, default: the run's model.path)\n"
            "  bench [--preset NAME] [--mode lora|full|both] ...\n"
            "                      time training steps of a preset with random weights\n"
            "  plan MODEL|PRESET|RUN.yaml --gpu NAME [--mode lora|qlora|full] ...\n"
            "                      before renting: memory per GPU, fit, speed, cost, checkpoint\n"
            "  doctor [CONFIG.yaml] [--json]\n"
            "                      check this machine before a run: host, disk, object store,\n"
            "                      preemption notice, the config's inputs, GPUs\n"
            "  config-reference    print the reference of every config key (Markdown)\n"
            "  --version           print the version\n\n"
            "exit codes: 0 done, 1 other failure, 2 usage or config error, 3 bad model, data\n"
            "or checkpoint input, 75 stopped by a signal after a complete checkpoint.\n",
            SPOTUNE_VERSION);
}

/* ---- train ------------------------------------------------------------------ */

static void train_usage(FILE *f)
{
    fprintf(f, "usage: spotune train CONFIG.yaml [--set section.key=value ...] [--resume WHAT]\n"
               "                    [--takeover]\n"
               "Trains as CONFIG.yaml says; --set overrides one key (repeatable), e.g.\n"
               "  --set train.steps=500 --set lora.targets=[q_proj,v_proj]\n"
               "Every key is documented in configs/README.md (spotune config-reference).\n"
               "Under mpirun each rank takes its share of every global batch.\n"
               "--resume auto (default): continue from the newest valid checkpoint of run.dir\n"
               "  (or of checkpoint.remote when that is newer); none: start afresh; PATH: a\n"
               "  checkpoint directory or s3://bucket/prefix/step-NNNNNNNN.\n"
               "--takeover: take checkpoint.remote over from another job's live lease (that\n"
               "  job stops pushing); same as --set checkpoint.take_over=true.\n"
               "One job per run.dir (a lock) and per checkpoint.remote (a lease): see\n"
               "  run.lock_wait_s and checkpoint.lease_s.\n"
               "SIGTERM, SIGINT or SIGUSR1: stop at the next micro-batch, checkpoint the last\n"
               "  step done, exit 75.\n");
}

/* Before MPI starts, the launcher's environment says which rank this is:
 * a config error is then printed once, by rank 0, not by every rank. */
static int launcher_rank(void)
{
    const char *vars[] = {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID"};
    for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) {
        const char *v = getenv(vars[i]);
        if (v && *v)
            return atoi(v);
    }
    return 0;
}

static int finish_error(comm_t *comm, sp_err *err)
{
    if (comm && comm_size(comm) > 1)
        comm_abort(comm, err->code, err->msg); /* ends every rank, never returns */
    fprintf(stderr, "spotune: error: %s\n", err->msg);
    return err->code;
}

/* The exit code of a rank that stopped with a complete checkpoint. Under
 * scripts/launch.sh, which names a status file (SPOTUNE_EXIT_STATUS_FILE,
 * starting with SPOTUNE_EXIT_STATUS_NONCE): rank 0 writes 75 into it and
 * every rank exits 0, since Open MPI's mpirun takes a non-zero exit for a
 * failed job and then waits 2 x odls_base_sigkill_timeout before it exits;
 * launch.sh exits 75. Where rank 0 cannot open that file with that nonce (a
 * machine that does not see it), it exits 75 itself. */
static int stopped_exit_code(int rank)
{
    const char *path = getenv("SPOTUNE_EXIT_STATUS_FILE");
    const char *nonce = getenv("SPOTUNE_EXIT_STATUS_NONCE");
    if (!path || !*path || !nonce || !*nonce)
        return SP_EXIT_PREEMPTED;
    if (rank != 0)
        return 0;
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0)
        return SP_EXIT_PREEMPTED;
    char line[128] = {0};
    ssize_t n = pread(fd, line, sizeof line - 1, 0);
    size_t len = strlen(nonce);
    int ours = n > (ssize_t)len && !strncmp(line, nonce, len) && line[len] == '\n';
    int ok = ours && lseek(fd, 0, SEEK_END) >= 0 && write(fd, "75\n", 3) == 3;
    ok = close(fd) == 0 && ok;
    return ok ? 0 : SP_EXIT_PREEMPTED;
}

static int cmd_train(int argc, char **argv)
{
    static const struct option longopts[] = {
        {"set", 1, 0, 's'},      {"resume", 1, 0, 'r'}, {"help", 0, 0, 'h'},
        {"takeover", 0, 0, 't'}, {0, 0, 0, 0}};
    /* first of all: a stop signal from here on is a request, never the
     * default action (train_run reports one that comes before training) */
    signals_install();
    const char *resume = "auto";
    config_t cfg;
    sp_err err = {0};
    config_defaults(&cfg);
    const char *sets[256];
    int nsets = 0, ch;
    optind = 1;
    while ((ch = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
        if (ch == 'h') {
            train_usage(stdout);
            config_free(&cfg);
            return 0;
        }
        if (ch == 'r') {
            resume = optarg;
            continue;
        }
        if (ch == 't' && nsets < 256) {
            sets[nsets++] = "checkpoint.take_over=true";
            continue;
        }
        if (ch != 's' || nsets == 256) {
            train_usage(stderr);
            config_free(&cfg);
            return SP_EXIT_USAGE;
        }
        sets[nsets++] = optarg;
    }
    if (optind != argc - 1) {
        train_usage(stderr);
        config_free(&cfg);
        return SP_EXIT_USAGE;
    }
    int rc = config_load(&cfg, argv[optind], &err);
    for (int i = 0; i < nsets && !rc; i++)
        rc = config_set(&cfg, sets[i], &err);
    if (!rc)
        rc = config_validate(&cfg, &err);
    if (rc) {
        if (launcher_rank() == 0)
            fprintf(stderr, "spotune: error: %s\n", err.msg);
        config_free(&cfg);
        return rc;
    }
    comm_t *comm = NULL;
    comm_opts co = {.timeout_s = cfg.comm_timeout_s};
    if (comm_init(&comm, &argc, &argv, &co, &err)) {
        fprintf(stderr, "spotune: error: %s\n", err.msg);
        config_free(&cfg);
        return err.code;
    }
    rc = train_run(&cfg, comm, resume, &err);
    int rank = comm_rank(comm);
    if (rc == SP_EXIT_PREEMPTED) {
        if (rank == 0)
            fprintf(stderr, "spotune: %s\n", err.msg);
    } else if (rc) {
        finish_error(comm, &err);
    }
    comm_finalize(comm);
    config_free(&cfg);
    return rc == SP_EXIT_PREEMPTED ? stopped_exit_code(rank) : rc;
}

/* ---- init-model ----------------------------------------------------------------- */

/* An option's value as a whole integer in [lo, hi] or a finite number in
 * [lo, hi) (hi_open): 0, or an error naming the command, the option and the
 * value (exit 2). */
static int opt_int(const char *cmd, const char *opt, const char *s, long long lo, long long hi,
                   long long *out)
{
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (end == s || *end || errno || v < lo || v > hi) {
        fprintf(stderr, "spotune: error: %s: %s '%s' is not a whole number in [%lld, %lld]\n", cmd,
                opt, s, lo, hi);
        return SP_EXIT_USAGE;
    }
    *out = v;
    return 0;
}

static int opt_frac(const char *cmd, const char *opt, const char *s, double *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (end == s || *end || errno || !isfinite(v) || v < 0 || v >= 1) {
        fprintf(stderr, "spotune: error: %s: %s '%s' is not a number in [0, 1)\n", cmd, opt, s);
        return SP_EXIT_USAGE;
    }
    *out = v;
    return 0;
}

static void init_usage(FILE *f)
{
    fprintf(f, "usage: spotune init-model --preset NAME --seed S [--dtype f32|bf16] OUT_DIR\n"
               "Writes a randomly initialised model (weights N(0, 0.02), norms 1) as a Hugging\n"
               "Face directory: config.json + model.safetensors.\n"
               "presets: tiny (byte-level vocabulary 260, ~1M parameters), small (vocabulary\n"
               "32000, hidden 768, 12 layers, 12 heads / 4 KV heads, ~110M), llama-7b, llama-13b.\n");
}

static int cmd_init_model(int argc, char **argv)
{
    static const struct option longopts[] = {{"preset", 1, 0, 'p'}, {"seed", 1, 0, 's'},
                                             {"dtype", 1, 0, 'd'},  {"help", 0, 0, 'h'},
                                             {0, 0, 0, 0}};
    const char *preset = NULL, *dtype = "f32";
    long long seed = -1;
    int ch;
    optind = 1;
    while ((ch = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
        switch (ch) {
        case 'p': preset = optarg; break;
        case 's':
            if (opt_int("init-model", "--seed", optarg, 0, LLONG_MAX, &seed))
                return SP_EXIT_USAGE;
            break;
        case 'd': dtype = optarg; break;
        case 'h': init_usage(stdout); return 0;
        default: init_usage(stderr); return SP_EXIT_USAGE;
        }
    }
    if (!preset || seed < 0 || optind != argc - 1 ||
        (strcmp(dtype, "f32") != 0 && strcmp(dtype, "bf16") != 0)) {
        init_usage(stderr);
        return SP_EXIT_USAGE;
    }
    sp_err err = {0};
    model_config_t mc;
    if (model_config_preset(&mc, preset)) {
        fprintf(stderr, "spotune: error: unknown preset '%s' (tiny, small, llama-7b, llama-13b)\n",
                preset);
        return SP_EXIT_USAGE;
    }
    backend_t *be;
    model_t *m = NULL;
    /* LoRA mode with no targets: every base weight, no optimizer state */
    model_opts o = {.mode = MODE_LORA, .lora_r = 1, .lora_alpha = 1, .max_batch = 1,
                    .seq_len = 2, .seed = (uint64_t)seed};
    int rc = backend_create(&be, "cpu", 0, 0, &err);
    if (!rc)
        rc = model_create(&m, be, &mc, &o, &err);
    if (!rc) {
        model_init_base_random(m, (uint64_t)seed);
        rc = model_io_save(m, argv[optind], strcmp(dtype, "bf16") == 0 ? DT_BF16 : DT_F32, 0,
                           MODEL_IO_SHARD_BYTES, &err);
    }
    if (!rc)
        printf("wrote %s: %s preset, %.2fM parameters, %s\n", argv[optind], preset,
               (double)model_config_params(&mc) / 1e6, dtype);
    model_destroy(m);
    if (!rc || be)
        backend_destroy(be);
    if (rc)
        fprintf(stderr, "spotune: error: %s\n", err.msg);
    return rc;
}

/* ---- prepare-text --------------------------------------------------------------- */

static void prep_usage(FILE *f)
{
    fprintf(f, "usage: spotune prepare-text IN.txt OUT_PREFIX [--val-fraction F] [--seed S]\n"
               "Byte-level tokenization (bytes 0-255, bos 256, eos 257) of a text: each\n"
               "paragraph a document; writes OUT_PREFIX.train.h5 and, with F > 0 (default\n"
               "0.05), OUT_PREFIX.val.h5. Real tokenizers: scripts/prepare_data.py.\n");
}

static int cmd_prepare_text(int argc, char **argv)
{
    static const struct option longopts[] = {{"val-fraction", 1, 0, 'v'}, {"seed", 1, 0, 's'},
                                             {"help", 0, 0, 'h'}, {0, 0, 0, 0}};
    double frac = 0.05;
    long long seed = 1234;
    int ch;
    optind = 1;
    while ((ch = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
        switch (ch) {
        case 'v':
            if (opt_frac("prepare-text", "--val-fraction", optarg, &frac))
                return SP_EXIT_USAGE;
            break;
        case 's':
            if (opt_int("prepare-text", "--seed", optarg, 0, LLONG_MAX, &seed))
                return SP_EXIT_USAGE;
            break;
        case 'h': prep_usage(stdout); return 0;
        default: prep_usage(stderr); return SP_EXIT_USAGE;
        }
    }
    if (optind != argc - 2 || frac < 0 || frac >= 1) {
        prep_usage(stderr);
        return SP_EXIT_USAGE;
    }
    sp_err err = {0};
    prepare_text_stats st;
    if (prepare_text(argv[optind], argv[optind + 1], frac, (uint64_t)seed, &st, &err)) {
        fprintf(stderr, "spotune: error: %s\n", err.msg);
        return err.code;
    }
    printf("train: %llu documents, %llu tokens -> %s.train.h5\n", (unsigned long long)st.train_docs,
           (unsigned long long)st.train_tokens, argv[optind + 1]);
    if (st.val_docs)
        printf("val:   %llu documents, %llu tokens -> %s.val.h5\n", (unsigned long long)st.val_docs,
               (unsigned long long)st.val_tokens, argv[optind + 1]);
    return 0;
}

/* ---- bench ---------------------------------------------------------------------- */

static int cmd_bench(int argc, char **argv)
{
    sp_err err = {0};
    comm_t *comm = NULL;
    comm_opts co = {.timeout_s = 600};
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h"))
            return bench_main(argc, argv, NULL, &err);
    if (comm_init(&comm, &argc, &argv, &co, &err)) {
        fprintf(stderr, "spotune: error: %s\n", err.msg);
        return err.code;
    }
    int rc = bench_main(argc, argv, comm, &err);
    if (rc)
        finish_error(comm, &err);
    comm_finalize(comm);
    return rc;
}

int cli_main(int argc, char **argv)
{
    if (argc < 2) {
        signals_default();
        usage(stderr);
        return SP_EXIT_USAGE;
    }
    const char *cmd = argv[1];
    if (strcmp(cmd, "train") != 0)
        signals_default(); /* only a training run turns stop signals into requests */
    if (!strcmp(cmd, "--help") || !strcmp(cmd, "-h") || !strcmp(cmd, "help")) {
        usage(stdout);
        return 0;
    }
    if (!strcmp(cmd, "--version")) {
        printf("spotune %s\n", SPOTUNE_VERSION);
        return 0;
    }
    static const struct {
        const char *name;
        int (*run)(int argc, char **argv);
    } commands[] = {{"train", cmd_train}, {"init-model", cmd_init_model},
                    {"prepare-text", cmd_prepare_text}, {"bench", cmd_bench},
                    {"ckpt", cmd_ckpt}, {"export", cmd_export},
                    {"plan", plan_main},
                    {"doctor", cmd_doctor}};
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
        if (!strcmp(cmd, commands[i].name))
            return commands[i].run(argc - 1, argv + 1);
    if (!strcmp(cmd, "config-reference")) {
        if (argc > 2) {
            int help = !strcmp(argv[2], "--help") || !strcmp(argv[2], "-h");
            fprintf(help ? stdout : stderr,
                    "usage: spotune config-reference\n"
                    "Prints the table of every config key (type, default, range, whether it may\n"
                    "change on resume, meaning) in Markdown, as configs/README.md carries it.\n");
            return help ? 0 : SP_EXIT_USAGE;
        }
        config_write_reference(stdout);
        return 0;
    }
    fprintf(stderr, "spotune: unknown command '%s'\n\n", cmd);
    usage(stderr);
    return SP_EXIT_USAGE;
}
