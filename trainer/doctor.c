/* spotune doctor: the command (arguments, ranks, the report as text or JSON)
 * and the checks of the run's own inputs (doctor.h); host and disk checks are
 * in doctor_host.c, the object store and preemption in doctor_remote.c, the
 * GPUs in doctor_gpu.c. */
#define _GNU_SOURCE
#include "doctor.h"

#include <curl/curl.h>
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <ifaddrs.h>
#include <jansson.h>
#include <net/if.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>

#include "../checkpoint/store.h"
#include "../comm/comm.h"
#include "../kernels/backend.h"
#include "config.h"
#include "data.h"
#include "doctor_internal.h"
#include "model.h"
#include "model_config.h"
#include "model_io.h"
#include "plan.h"

const char *const doctor_status_names[] = {"PASS", "WARN", "FAIL", "SKIPPED"};

void doctor_add(doctor_t *d, const char *name, int status, const char *expected,
                const char *fmt, ...)
{
    if (d->n == d->cap) {
        size_t cap = d->cap ? 2 * d->cap : 32;
        dr_check *v = realloc(d->v, cap * sizeof *v);
        if (!v)
            return; /* out of memory: the line is lost, the rest goes on */
        d->v = v;
        d->cap = cap;
    }
    dr_check *c = &d->v[d->n++];
    memset(c, 0, sizeof *c);
    sp_cutf(c->name, sizeof c->name, "%s", name);
    c->status = status;
    sp_cutf(c->expected, sizeof c->expected, "%s", expected ? expected : "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->measured, sizeof c->measured, fmt, ap);
    va_end(ap);
    sp_cutf(c->host, sizeof c->host, "%s", d->host);
}

/* ---- the run's inputs ------------------------------------------------------------ */

static void check_inputs(doctor_t *d, const config_t *c, int world, const dr_gpus *g)
{
    sp_err err = {0};
    model_config_t mc;
    memset(&mc, 0, sizeof mc);
    int have_model = 0;
    if (model_config_load(&mc, c->model_path, &err)) {
        doctor_add(d, "config.model", DR_FAIL, "a readable, supported model directory", "%s",
                   err.msg);
    } else {
        char id[17];
        if (model_io_identity(c->model_path, id, &err)) {
            doctor_add(d, "config.model", DR_FAIL, "a readable, supported model directory", "%s",
                       err.msg);
        } else {
            have_model = 1;
            doctor_add(d, "config.model", DR_PASS, "a readable, supported model directory",
                       "%s: %s, %lld layers, hidden %lld, %.1fM parameters (identity %s)",
                       c->model_path, mc.architecture, (long long)mc.layers,
                       (long long)mc.hidden, (double)model_config_params(&mc) / 1e6, id);
        }
    }
    const char *names[2] = {"config.data_train", "config.data_val"};
    const char *paths[2] = {c->data_train, c->data_val};
    for (int i = 0; i < 2; i++) {
        if (!paths[i] || !*paths[i]) {
            doctor_add(d, names[i], DR_SKIPPED, "", "not set");
            continue;
        }
        if (!have_model) {
            doctor_add(d, names[i], DR_SKIPPED, "a valid dataset",
                       "the model could not be read (its vocabulary bounds the tokens)");
            continue;
        }
        dataset_t ds;
        memset(&ds, 0, sizeof ds);
        sp_err_clear(&err);
        if (dataset_open_part(&ds, paths[i], c->seq_len, mc.vocab, (uint64_t)c->seed,
                              c->data_packing, 0, 1, &err))
            doctor_add(d, names[i], DR_FAIL, "a valid dataset", "%s", err.msg);
        else
            doctor_add(d, names[i], DR_PASS, "a valid dataset",
                       "%s: %llu tokens, %llu documents, %llu windows of %lld (packing %s)",
                       paths[i], (unsigned long long)ds.n_tokens, (unsigned long long)ds.n_docs,
                       (unsigned long long)ds.n_windows, (long long)c->seq_len,
                       dataset_packing_names[c->data_packing]);
        dataset_close(&ds);
    }

    const char *backend = config_backend_names[c->backend];
    int cpu = !strcmp(backend, "cpu") || !strcmp(backend, "cpu-ref") ||
              (!strcmp(backend, "auto") && g->count == 0);
    if (!have_model) {
        doctor_add(d, "config.memory_plan", DR_SKIPPED, "", "the model could not be read");
        return;
    }
    if (!cpu && g->count == 0) {
        doctor_add(d, "config.memory_plan", DR_SKIPPED, "fits the GPU's memory",
                   "runtime.backend %s, but no GPU: %s", backend, g->why);
        return;
    }
    /* the plan of spotune plan (trainer/plan.h) against what this machine has */
    plan_input in;
    plan_input_defaults(&in);
    plan_input_from_config(&in, c);
    in.mc = mc;
    sp_cutf(in.model_name, sizeof in.model_name, "%s", c->model_path);
    in.gpus_per_node = world;
    in.nodes = 1;
    int local = g->local_ranks > 0 ? g->local_ranks : 1;
    if (cpu) {
        in.cpu = 1;
        in.gpu_mem_bytes = (double)dr_meminfo_kib("MemAvailable") * 1024.0 / local;
        in.gpu_tflops = 1;
        sp_cutf(in.gpu_label, sizeof in.gpu_label, "host memory");
    } else {
        const plan_gpu *pg = plan_gpu_for_device(g->name);
        in.gpu_mem_bytes = (double)g->min_total;
        in.gpu_tflops = pg ? pg->bf16_tflops : 100;
        sp_cutf(in.gpu_label, sizeof in.gpu_label, "%s", g->name);
    }
    plan_result *r = calloc(1, sizeof *r);
    sp_err_clear(&err);
    if (!r) {
        doctor_add(d, "config.memory_plan", DR_FAIL, "", "out of memory");
        return;
    }
    if (plan_compute(&in, r, &err)) {
        doctor_add(d, "config.memory_plan", DR_FAIL, "", "%s", err.msg);
        free(r);
        return;
    }
    const plan_mem *m = &r->mem;
    char fix[300] = "";
    if (!r->fits)
        sp_cutf(fix, sizeof fix, ": it does not fit; %s",
                r->nfixes ? r->fixes[0].what : "nothing this plan knows makes it fit");
    doctor_add(d, "config.memory_plan", r->fits ? DR_PASS : DR_FAIL,
               cpu ? "fits the host memory per rank (CPU backend)"
                   : "fits the smallest GPU (after the plan's headroom)",
               "%.1f MiB per %s (MiB: weights %.1f, trainable %.1f, gradients %.1f, optimizer "
               "%.1f, activations %.1f, workspace %.1f) of %.1f MiB usable on %s%s",
               dr_mib(m->total), cpu ? "rank" : "GPU", dr_mib(m->weights),
               dr_mib(m->trainable), dr_mib(m->gradients), dr_mib(m->optimizer),
               dr_mib(m->activations), dr_mib(m->workspace), dr_mib(r->usable_bytes),
               cpu ? "this host" : g->name, fix);
    free(r);
}

/* ---- output ---------------------------------------------------------------------- */

static json_t *checks_json(const dr_check *v, size_t n)
{
    json_t *a = json_array();
    for (size_t i = 0; i < n; i++)
        json_array_append_new(a, json_pack("{s:s, s:s, s:s, s:s, s:s}", "check", v[i].name,
                                           "status", doctor_status_names[v[i].status], "measured",
                                           v[i].measured, "expected", v[i].expected, "host",
                                           v[i].host));
    return a;
}

static int checks_from_json(doctor_t *d, const char *text)
{
    json_t *a = json_loads(text, 0, NULL);
    if (!json_is_array(a)) {
        json_decref(a);
        return -1;
    }
    for (size_t i = 0; i < json_array_size(a); i++) {
        json_t *o = json_array_get(a, i);
        const char *st = json_string_value(json_object_get(o, "status"));
        int s = DR_FAIL;
        for (int k = 0; k < 4; k++)
            if (st && !strcmp(st, doctor_status_names[k]))
                s = k;
        char saved[64];
        memcpy(saved, d->host, sizeof saved);
        const char *h = json_string_value(json_object_get(o, "host"));
        sp_cutf(d->host, sizeof d->host, "%s", h ? h : "?");
        const char *m = json_string_value(json_object_get(o, "measured"));
        doctor_add(d, json_string_value(json_object_get(o, "check")), s,
                   json_string_value(json_object_get(o, "expected")), "%s", m ? m : "");
        memcpy(d->host, saved, sizeof saved);
    }
    json_decref(a);
    return 0;
}

static void print_text(const doctor_t *d, int several_hosts)
{
    for (size_t i = 0; i < d->n; i++) {
        const dr_check *c = &d->v[i];
        if (several_hosts)
            printf("%-7s [%s] %-20s %s", doctor_status_names[c->status], c->host, c->name,
                   c->measured);
        else
            printf("%-7s %-20s %s", doctor_status_names[c->status], c->name, c->measured);
        if (c->expected[0])
            printf("  (expected: %s)", c->expected);
        putchar('\n');
    }
}

/* ---- the command ----------------------------------------------------------------- */

static void usage(FILE *f)
{
    fprintf(f,
            "usage: spotune doctor [CONFIG.yaml] [--json] [options]\n"
            "Checks this machine before a run, one line per check: PASS, WARN, FAIL or\n"
            "SKIPPED, the measured figure and the expected one. Exit 0, or 1 when a check\n"
            "FAILs (2: a usage or config error). Under mpirun, rank 0 prints every host's.\n"
            "  host       cores, memory, open-file limit, /dev/shm, MPI, NCCL's interfaces\n"
            "  storage    free space and write throughput of run.dir's file system (without\n"
            "             a config: the current directory)\n"
            "  store      with checkpoint.remote or --remote: credentials found (never shown),\n"
            "             a probe object put, read back, listed, deleted; upload throughput;\n"
            "             clock skew against the store's Date header\n"
            "  preemption which cloud's spot metadata service answers; a pending notice FAILs\n"
            "  config     the model, the dataset, the memory plan against the GPUs found\n"
            "  gpu        devices, bf16 GEMM and memory copy speed, P2P, NCCL all-reduce\n"
            "             (SKIPPED with the reason without a usable GPU)\n"
            "options:\n"
            "  --json              one JSON document, an object per check\n"
            "  --remote URL        the object store to check (s3://bucket/prefix or file://)\n"
            "                      instead of the config's checkpoint.remote\n"
            "  --endpoint URL --region R --path-style   for --remote s3:// (else the\n"
            "                      config's checkpoint.endpoint/region/addressing)\n"
            "  --timeout S         longest one store request may take, retries included (10)\n"
            "  --io-mib N          size of the disk write test (64; the upload test: up to 32)\n"
            "  --gemm-n N          the bf16 GEMM's size, N x N x N (8192; below 4096 it is not\n"
            "                      compared with the card's peak)\n"
            "  --gpu-mib N         the memory copy's size (1024; below 256 not compared with the\n"
            "                      card's bandwidth); P2P copies and NCCL all-reduces up to\n"
            "                      min(N, 256) MiB. Small values make a quick check\n"
            "  --cloud NAME        auto (probe each, default), aws, gcp, azure, alibaba, none\n"
            "  --metadata-url URL  base URL of the metadata service (as spot-run.sh's)\n"
            "credentials: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY [, AWS_SESSION_TOKEN];\n"
            "  or, without them, a role's: web identity, container or EC2 instance\n");
}

typedef struct dr_args {
    const char *config, *remote, *endpoint, *region, *cloud, *meta_url;
    int json, path_style, io_mib;
    dr_gpu_sizes gpu;
    double timeout_s;
} dr_args;

/* An integer option in [lo, hi] into *v, or a usage error naming it. */
static int int_opt(const char *name, const char *arg, long lo, long hi, int *v)
{
    char *end;
    long x = strtol(arg, &end, 10);
    if (*end || end == arg || x < lo || x > hi) {
        fprintf(stderr, "spotune doctor: --%s takes %ld to %ld, got '%s'\n", name, lo, hi, arg);
        return SP_EXIT_USAGE;
    }
    *v = (int)x;
    return 0;
}

static int parse(int argc, char **argv, dr_args *a)
{
    static const struct option lo[] = {
        {"json", 0, 0, 'j'},    {"remote", 1, 0, 'R'},       {"endpoint", 1, 0, 'e'},
        {"region", 1, 0, 'r'},  {"path-style", 0, 0, 'p'},   {"timeout", 1, 0, 't'},
        {"io-mib", 1, 0, 'i'},  {"cloud", 1, 0, 'c'},        {"metadata-url", 1, 0, 'm'},
        {"gemm-n", 1, 0, 'g'},  {"gpu-mib", 1, 0, 'G'},      {"help", 0, 0, 'h'},
        {0, 0, 0, 0}};
    memset(a, 0, sizeof *a);
    a->cloud = "auto";
    a->io_mib = 64;
    a->gpu.gemm_n = DR_GEMM_N;
    a->gpu.mib = DR_GPU_MIB;
    a->timeout_s = 10;
    int ch;
    char *end;
    optind = 1;
    opterr = 0;
    while ((ch = getopt_long(argc, argv, "h", lo, NULL)) != -1) {
        switch (ch) {
        case 'j': a->json = 1; break;
        case 'R': a->remote = optarg; break;
        case 'e': a->endpoint = optarg; break;
        case 'r': a->region = optarg; break;
        case 'p': a->path_style = 1; break;
        case 't':
            a->timeout_s = strtod(optarg, &end);
            if (*end || !(a->timeout_s > 0) || a->timeout_s > 3600) {
                fprintf(stderr, "spotune doctor: --timeout takes seconds in (0, 3600], got '%s'\n",
                        optarg);
                return SP_EXIT_USAGE;
            }
            break;
        case 'i':
            if (int_opt("io-mib", optarg, 1, 4096, &a->io_mib))
                return SP_EXIT_USAGE;
            break;
        case 'g':
            if (int_opt("gemm-n", optarg, 64, 16384, &a->gpu.gemm_n))
                return SP_EXIT_USAGE;
            break;
        case 'G':
            if (int_opt("gpu-mib", optarg, 1, 4096, &a->gpu.mib))
                return SP_EXIT_USAGE;
            break;
        case 'c':
            if (strcmp(optarg, "auto") && strcmp(optarg, "aws") && strcmp(optarg, "gcp") &&
                strcmp(optarg, "azure") && strcmp(optarg, "alibaba") && strcmp(optarg, "none")) {
                fprintf(stderr,
                        "spotune doctor: --cloud takes auto, aws, gcp, azure, alibaba or none, "
                        "got '%s'\n",
                        optarg);
                return SP_EXIT_USAGE;
            }
            a->cloud = optarg;
            break;
        case 'm':
            if (!sp_after(optarg, "http://") && !sp_after(optarg, "https://")) {
                fprintf(stderr,
                        "spotune doctor: --metadata-url takes an http(s):// URL, got '%s'\n",
                        optarg);
                return SP_EXIT_USAGE;
            }
            a->meta_url = optarg;
            break;
        case 'h': usage(stdout); return -1;
        default:
            fprintf(stderr, "spotune doctor: unknown option '%s' (see spotune doctor --help)\n",
                    argv[optind - 1]);
            return SP_EXIT_USAGE;
        }
    }
    if (optind < argc)
        a->config = argv[optind++];
    if (optind < argc) {
        fprintf(stderr, "spotune doctor: one config at most, got also '%s'\n", argv[optind]);
        return SP_EXIT_USAGE;
    }
    if ((a->endpoint || a->region || a->path_style) && !a->remote && !a->config) {
        fprintf(stderr, "spotune doctor: --endpoint, --region and --path-style are for a store: "
                        "give --remote URL or a config with checkpoint.remote\n");
        return SP_EXIT_USAGE;
    }
    if (a->remote && !sp_after(a->remote, "s3://") && !sp_after(a->remote, "file://")) {
        fprintf(stderr,
                "spotune doctor: --remote takes s3://bucket[/prefix] or file:///path, got '%s'\n",
                a->remote);
        return SP_EXIT_USAGE;
    }
    return 0;
}

/* Every rank's checks to rank 0 (a fixed slot each), added to d there. */
#define SLOT_BYTES ((size_t)256 << 10)

static int gather_checks(comm_t *comm, doctor_t *d, sp_err *err)
{
    int size = comm_size(comm), rank = comm_rank(comm);
    char *mine = calloc(1, SLOT_BYTES);
    char *all = rank == 0 ? calloc((size_t)size, SLOT_BYTES) : NULL;
    if (!mine || (rank == 0 && !all)) {
        free(mine);
        free(all);
        return sp_fail(err, SP_EXIT_OTHER, "out of memory");
    }
    if (rank != 0) {
        json_t *a = checks_json(d->v, d->n);
        char *s = json_dumps(a, JSON_COMPACT);
        if (s && strlen(s) < SLOT_BYTES) {
            memcpy(mine, s, strlen(s) + 1);
        } else { /* too many lines: one line saying so instead */
            dr_check one;
            memset(&one, 0, sizeof one);
            snprintf(one.name, sizeof one.name, "host.report");
            one.status = DR_FAIL;
            snprintf(one.measured, sizeof one.measured,
                     "rank %d's %zu check lines (%zu bytes of JSON) exceed the %zu KiB each rank "
                     "may send to rank 0; run spotune doctor on this host alone",
                     rank, d->n, s ? strlen(s) : (size_t)0, SLOT_BYTES >> 10);
            memcpy(one.host, d->host, sizeof one.host);
            json_t *b = checks_json(&one, 1);
            char *t = json_dumps(b, JSON_COMPACT);
            snprintf(mine, SLOT_BYTES, "%s", t ? t : "[]");
            free(t);
            json_decref(b);
        }
        free(s);
        json_decref(a);
    }
    int rc = comm_gather(comm, mine, all, SLOT_BYTES, COMM_U8, 0, err);
    if (!rc && rank == 0)
        for (int r = 1; r < size; r++) {
            char *slot = all + (size_t)r * SLOT_BYTES;
            slot[SLOT_BYTES - 1] = 0;
            if (slot[0] && checks_from_json(d, slot) != 0)
                doctor_add(d, "mpi.gather", DR_FAIL, "", "rank %d sent unreadable results", r);
        }
    free(mine);
    free(all);
    return rc;
}

int cmd_doctor(int argc, char **argv)
{
    dr_args a;
    int prc = parse(argc, argv, &a);
    if (prc)
        return prc < 0 ? 0 : prc;

    config_t cfg;
    int have_cfg = 0;
    sp_err err = {0};
    if (a.config) {
        config_defaults(&cfg);
        if (config_load(&cfg, a.config, &err) || config_validate(&cfg, &err)) {
            fprintf(stderr, "spotune: error: %s\n", err.msg);
            config_free(&cfg);
            return err.code ? err.code : SP_EXIT_USAGE;
        }
        have_cfg = 1;
    }

    comm_t *comm = NULL;
    comm_opts co = {.timeout_s = 600};
    if (comm_init(&comm, &argc, &argv, &co, &err)) {
        fprintf(stderr, "spotune: error: %s\n", err.msg);
        if (have_cfg)
            config_free(&cfg);
        return err.code ? err.code : SP_EXIT_OTHER;
    }
    curl_global_init(CURL_GLOBAL_DEFAULT);
    int rank = comm_rank(comm), size = comm_size(comm);
    doctor_t d = {0};
    sp_cutf(d.host, sizeof d.host, "%s", comm_host(comm));

    /* the hosts of the job: every rank's name, to rank 0 */
    char hosts[400] = "1 host";
    int nhosts = 1;
    {
        char name[64];
        sp_cutf(name, sizeof name, "%s", comm_host(comm));
        char *all = calloc((size_t)size, sizeof name);
        if (all && comm_allgather(comm, name, all, sizeof name, COMM_U8, &err) == 0) {
            nhosts = 0;
            size_t len = 0;
            char list[300] = "";
            for (int r = 0; r < size; r++) {
                int dup = 0;
                for (int q = 0; q < r; q++)
                    if (!strcmp(all + (size_t)q * sizeof name, all + (size_t)r * sizeof name))
                        dup = 1;
                if (dup)
                    continue;
                nhosts++;
                if (len < sizeof list - 1) {
                    int w = snprintf(list + len, sizeof list - len, "%s%s", len ? ", " : "",
                                     all + (size_t)r * sizeof name);
                    len += w > 0 ? (size_t)w : 0;
                }
            }
            sp_cutf(hosts, sizeof hosts, "%d host%s (%s)", nhosts, nhosts > 1 ? "s" : "", list);
        }
        free(all);
    }

    /* host and storage: the first rank of each host; the rest: rank 0 */
    dr_gpus gpus;
    doctor_gpu_probe(&gpus, comm_local_rank(comm) == 0);
    gpus.local_ranks = comm_local_size(comm);
    if (comm_local_rank(comm) == 0) {
        dr_check_host(&d);
        if (rank == 0)
            dr_check_mpi(&d, comm, hosts);
        dr_check_storage(&d, have_cfg ? cfg.run_dir : NULL, a.io_mib);
    }
    if (rank == 0) {
        const char *remote = a.remote ? a.remote : have_cfg ? cfg.ckpt_remote : NULL;
        if (remote && *remote) {
            store_opts so = {0};
            if (have_cfg && !a.remote) {
                so.endpoint = cfg.ckpt_endpoint && *cfg.ckpt_endpoint ? cfg.ckpt_endpoint : NULL;
                so.region = cfg.ckpt_region && *cfg.ckpt_region ? cfg.ckpt_region : NULL;
                so.addressing = cfg.ckpt_addressing == ADDR_PATH      ? STORE_ADDR_PATH
                                : cfg.ckpt_addressing == ADDR_VIRTUAL ? STORE_ADDR_VHOST
                                                                      : STORE_ADDR_AUTO;
                so.part_bytes = (size_t)cfg.ckpt_part_mb << 20;
            }
            if (a.endpoint)
                so.endpoint = a.endpoint;
            if (a.region)
                so.region = a.region;
            if (a.path_style)
                so.addressing = STORE_ADDR_PATH;
            so.max_retries = 1;
            so.timeout_s = a.timeout_s < 5 ? a.timeout_s : 5;
            so.request_deadline_s = a.timeout_s;
            dr_check_store(&d, remote, &so, a.io_mib, a.timeout_s);
        } else {
            doctor_add(&d, "store", DR_SKIPPED, "",
                       "no object store: %s",
                       have_cfg ? "the config has no checkpoint.remote (checkpoints would stay "
                                  "on this machine's disk)"
                                : "give a config with checkpoint.remote, or --remote URL");
        }
        dr_check_preemption(&d, a.cloud, a.meta_url);
        if (have_cfg)
            check_inputs(&d, &cfg, size, &gpus);
    }
    doctor_gpu_checks(&d, &gpus, &a.gpu, comm); /* every rank: the NCCL test is collective */

    int rc = gather_checks(comm, &d, &err);
    int code = 0;
    if (rc) {
        fprintf(stderr, "spotune: error: rank %d: %s\n", rank, err.msg);
        code = SP_EXIT_OTHER;
    } else if (rank == 0) {
        int count[4] = {0};
        for (size_t i = 0; i < d.n; i++)
            count[d.v[i].status]++;
        code = count[DR_FAIL] ? 1 : 0;
        if (a.json) {
            json_t *doc = json_pack("{s:s, s:s, s:i, s:i, s:o, s:{s:i, s:i, s:i, s:i}, s:i}",
                                    "spotune", SPOTUNE_VERSION, "host", d.host, "ranks", size,
                                    "hosts", nhosts, "checks", checks_json(d.v, d.n), "summary",
                                    "pass", count[DR_PASS], "warn", count[DR_WARN], "fail",
                                    count[DR_FAIL], "skipped", count[DR_SKIPPED], "exit", code);
            char *s = json_dumps(doc, JSON_INDENT(2));
            if (s)
                puts(s);
            free(s);
            json_decref(doc);
        } else {
            printf("spotune doctor %s on %s: %d rank%s on %s%s%s\n", SPOTUNE_VERSION, d.host, size,
                   size > 1 ? "s" : "", hosts, have_cfg ? ", config " : "",
                   have_cfg ? a.config : "");
            print_text(&d, nhosts > 1);
            printf("%d PASS, %d WARN, %d FAIL, %d SKIPPED: %s\n", count[DR_PASS], count[DR_WARN],
                   count[DR_FAIL], count[DR_SKIPPED],
                   count[DR_FAIL] ? "this machine is not ready (exit 1)" : "ready");
        }
        fflush(stdout);
    }
    /* every rank returns rank 0's verdict */
    int32_t verdict = code;
    if (!rc && comm_bcast(comm, &verdict, sizeof verdict, 0, &err) == 0)
        code = verdict;
    free(d.v);
    curl_global_cleanup();
    comm_finalize(comm);
    if (have_cfg)
        config_free(&cfg);
    return code;
}
