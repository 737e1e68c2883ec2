/* ckpt list / verify / pull, and export. */
#define _GNU_SOURCE
#include "cmd_ckpt.h"

#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "../checkpoint/ckpt.h"
#include "../checkpoint/store.h"
#include "adapter.h"
#include "config.h"
#include "model.h"
#include "model_card.h"
#include "model_io.h"
#include "state_check.h"

static int is_url(const char *s)
{
    return sp_after(s, "s3://") || sp_after(s, "file://");
}

static int fail(sp_err *err)
{
    fprintf(stderr, "spotune: error: %s\n", err->msg);
    return err->code ? err->code : 1;
}

typedef struct store_args {
    store_opts o;
} store_args;

/* Splits ".../step-NNNNNNNN" into the store URL (*base, a heap string the
 * caller frees) and the step name (*name, inside *base). */
static int split_step_url(const char *url, char **base, const char **name, sp_err *err)
{
    char *b = strdup(url);
    if (!b)
        return sp_fail(err, SP_EXIT_OTHER, "out of memory");
    size_t len = strlen(b);
    while (len > 0 && b[len - 1] == '/')
        b[--len] = 0;
    char *slash = strrchr(b, '/');
    if (!slash || !sp_after(slash + 1, "step-")) {
        free(b);
        return sp_fail(err, SP_EXIT_USAGE, "%s: expected a checkpoint URL ending in /step-NNNNNNNN",
                       url);
    }
    *slash = 0;
    *base = b;
    *name = slash + 1;
    return 0;
}

/* Pulls a remote checkpoint into dest (which must not exist) and verifies it. */
static int pull(const char *url, const char *dest, const store_opts *o, sp_err *err)
{
    char *base = NULL;
    const char *name = NULL;
    if (split_step_url(url, &base, &name, err))
        return err->code;
    store_t *st;
    int rc = store_open(&st, base, o, err);
    if (rc) {
        free(base);
        return err->code ? err->code : SP_EXIT_USAGE;
    }
    rc = store_pull_dir(st, name, dest, NULL, err);
    store_close(st);
    free(base);
    if (rc)
        return err->code ? err->code : SP_EXIT_OTHER;
    ckpt_manifest m;
    rc = ckpt_verify(dest, &m, err);
    ckpt_manifest_free(&m);
    if (rc)
        ckpt_remove_tree(dest); /* what does not verify is not a checkpoint: leave nothing */
    return rc;
}

static char *temp_dir(void)
{
    const char *t = getenv("TMPDIR");
    char *tmpl = sp_strf("%s/spotune-ckpt-XXXXXX", t && *t ? t : "/tmp");
    if (tmpl && !mkdtemp(tmpl)) {
        free(tmpl);
        return NULL;
    }
    return tmpl;
}

static void remove_tree(const char *dir)
{
    if (ckpt_remove_tree(dir) != 0)
        fprintf(stderr, "spotune: could not remove %s\n", dir);
}

/* The checkpoint directory of what (*dir, a heap string): a URL is pulled
 * into a temporary directory (*tmp, removed by the caller). */
static int local_checkpoint(const char *what, const store_opts *o, char **dir, char **tmp,
                            sp_err *err)
{
    *tmp = NULL;
    *dir = is_url(what) ? NULL : strdup(what);
    if (!is_url(what))
        return *dir ? 0 : sp_fail(err, SP_EXIT_OTHER, "out of memory");
    *tmp = temp_dir();
    if (!*tmp)
        return sp_fail(err, SP_EXIT_OTHER, "cannot create a temporary directory");
    if (!(*dir = sp_strf("%s/ckpt", *tmp)))
        return sp_fail(err, SP_EXIT_OTHER, "out of memory");
    return pull(what, *dir, o, err);
}

/* What local_checkpoint made goes. */
static void local_checkpoint_done(char *dir, char *tmp)
{
    free(dir);
    if (tmp) {
        remove_tree(tmp);
        free(tmp);
    }
}

/* ---- ckpt list ---------------------------------------------------------------- */

static void fmt_time(char *buf, size_t n, double t)
{
    if (t <= 0) {
        snprintf(buf, n, "-");
        return;
    }
    time_t s = (time_t)t;
    struct tm tm;
    gmtime_r(&s, &tm);
    strftime(buf, n, "%Y-%m-%d %H:%M:%SZ", &tm);
}

/* ckpt list of the checkpoints directory root (arg: as the user named it) */
static int list_dir(const char *root, const char *arg, sp_err *err)
{
    struct stat sb;
    if (stat(root, &sb) != 0)
        return sp_fail(err, SP_EXIT_INPUT, "%s: no such run or checkpoint directory", arg);
    ckpt_info *l;
    int n;
    if (ckpt_list(root, 1, &l, &n, err))
        return err->code;
    printf("%-22s %10s  %-21s %10s  %s\n", "checkpoint", "step", "time", "size", "status");
    for (int i = 0; i < n; i++) {
        char t[64];
        fmt_time(t, sizeof t, l[i].created);
        printf("%-22s %10lld  %-21s %8.1f MiB  %s\n", l[i].name, (long long)l[i].step, t,
               (double)l[i].bytes / 1048576.0, l[i].ok ? "ok" : l[i].problem);
    }
    if (n == 0)
        printf("(no checkpoints in %s)\n", root);
    free(l);
    return 0;
}

static int list_local(const char *arg, sp_err *err)
{
    struct stat sb;
    char *run = sp_strf("%s/checkpoints", arg);
    if (!run)
        return sp_fail(err, SP_EXIT_OTHER, "out of memory");
    int rc = list_dir(stat(run, &sb) == 0 && S_ISDIR(sb.st_mode) ? run : arg, arg, err);
    free(run);
    return rc;
}

static int list_remote(const char *url, const store_opts *o, sp_err *err)
{
    store_t *st;
    if (store_open(&st, url, o, err))
        return err->code ? err->code : SP_EXIT_USAGE;
    store_listing l;
    int rc = store_list(st, "step-", &l, err);
    if (rc) {
        store_close(st);
        return err->code ? err->code : SP_EXIT_OTHER;
    }
    printf("%-22s %10s  %-21s %10s  %s\n", "checkpoint", "step", "time", "size", "status");
    size_t i = 0;
    int shown = 0;
    while (i < l.n) {
        const char *k = l.items[i].key, *slash = strchr(k, '/');
        size_t plen = slash ? (size_t)(slash - k) : strlen(k);
        uint64_t bytes = 0;
        int has_manifest = 0;
        size_t j = i;
        for (; j < l.n && strncmp(l.items[j].key, k, plen) == 0 && l.items[j].key[plen] == '/'; j++) {
            bytes += l.items[j].size;
            has_manifest |= strcmp(l.items[j].key + plen + 1, CKPT_MANIFEST) == 0;
        }
        if (j == i)
            j = i + 1;
        char t[64] = "-";
        char *name = sp_strf("%.*s", (int)plen, k);
        char *key = name ? sp_strf("%s/%s", name, CKPT_MANIFEST) : NULL;
        if (!key) {
            free(name);
            rc = sp_fail(err, SP_EXIT_OTHER, "out of memory");
            break;
        }
        long long step = strtoll(name + SP_LEN("step-"), NULL, 10);
        if (has_manifest) {
            void *data = NULL;
            size_t n = 0;
            ckpt_manifest m;
            sp_err e = {0};
            if (store_get_bytes(st, key, &data, &n, &e) == 0 &&
                ckpt_manifest_parse(data, n, &m, &e) == 0)
                fmt_time(t, sizeof t, m.created);
            if (data)
                ckpt_manifest_free(&m);
            free(data);
        }
        printf("%-22s %10lld  %-21s %8.1f MiB  %s\n", name, step, t, (double)bytes / 1048576.0,
               has_manifest ? "complete (MANIFEST present; `spotune ckpt verify` checks the data)"
                            : "incomplete (no MANIFEST)");
        free(name);
        free(key);
        shown++;
        i = j;
    }
    if (!shown && !rc)
        printf("(no checkpoints in %s)\n", url);
    store_list_free(&l);
    store_close(st);
    return rc;
}

static void ckpt_usage(FILE *f)
{
    fprintf(f, "usage: spotune ckpt list RUN_DIR | CHECKPOINTS_DIR | s3://bucket/prefix\n"
               "       spotune ckpt verify CHECKPOINT_DIR | s3://bucket/prefix/step-NNNNNNNN\n"
               "       spotune ckpt pull s3://bucket/prefix/step-NNNNNNNN DIR\n"
               "       spotune ckpt check CHECKPOINT_DIR\n"
               "verify: MANIFEST (which must list every file), every file's size and\n"
               "  SHA-256, the structure of state.h5 (read by `ckpt check` in a separate\n"
               "  process, so that a damaged file cannot crash the command that reads it),\n"
               "  then what it holds as train --resume and export check it: attributes,\n"
               "  config, tensors against the config, every value finite.\n"
               "check: the structure of CHECKPOINT_DIR/state.h5 only (no checksums).\n"
               "options for s3://: --endpoint URL --region R --path-style --timeout S\n"
               "  (--timeout: the longest one request may take, retries included; default 30)\n"
               "credentials: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY [, AWS_SESSION_TOKEN];\n"
               "  or, without them, a role's: web identity, container or EC2 instance\n");
}

/* A person waits for these commands: a store that does not answer fails
 * each request within CLI_DEADLINE_S (--timeout), not after the background
 * uploader's patient retries. */
#define CLI_DEADLINE_S 30.0

static int parse_store_opts(int argc, char **argv, store_opts *o, const char *extra,
                            const char **out_a, const char **out_b, const char **out_c,
                            const char **out_d)
{
    static const struct option lo[] = {
        {"endpoint", 1, 0, 'e'}, {"region", 1, 0, 'r'}, {"path-style", 0, 0, 'p'},
        {"peft", 1, 0, 'P'},     {"merged", 1, 0, 'M'}, {"model", 1, 0, 'm'},
        {"dtype", 1, 0, 'd'},    {"timeout", 1, 0, 't'}, {"help", 0, 0, 'h'},
        {0, 0, 0, 0}};
    int ch;
    char *end;
    optind = 1;
    o->request_deadline_s = CLI_DEADLINE_S;
    o->timeout_s = 10;
    o->max_retries = 3;
    while ((ch = getopt_long(argc, argv, "h", lo, NULL)) != -1) {
        switch (ch) {
        case 'e': o->endpoint = optarg; break;
        case 'r': o->region = optarg; break;
        case 'p': o->addressing = STORE_ADDR_PATH; break;
        case 't':
            o->request_deadline_s = strtod(optarg, &end);
            if (*end || !(o->request_deadline_s > 0) || o->request_deadline_s > 86400)
                return -1;
            o->timeout_s = o->request_deadline_s < 10 ? o->request_deadline_s : 10;
            break;
        case 'P':
        case 'M':
        case 'm':
        case 'd':
            if (!extra || !strchr(extra, ch))
                return -1;
            if (ch == 'P')
                *out_a = optarg;
            else if (ch == 'M')
                *out_b = optarg;
            else if (ch == 'm')
                *out_c = optarg;
            else
                *out_d = optarg;
            break;
        case 'h': return 1;
        default: return -1;
        }
    }
    return 0;
}

/* `ckpt check` reads the structure of a file that may be damaged in ways its
 * checksum cannot show (damaged before it was taken), in a process of its own
 * (state_check_isolated). A damaged datatype can make libhdf5 allocate
 * gigabytes (a string attribute whose characters claim 3.5 GB each asked for
 * 14 GB): so that process may map at most 1 GiB of data beyond what it holds
 * at this point, and such damage ends in an allocation failure, reported as
 * a damaged file, instead of exhausting the machine. Not under
 * AddressSanitizer, whose shadow memory counts as data. */
static void checker_memory_limit(void)
{
#ifndef __SANITIZE_ADDRESS__
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    unsigned long long data_kb = 0;
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "VmData: %llu kB", &data_kb) == 1)
            break;
    if (f)
        fclose(f);
    struct rlimit rl;
    if (data_kb && getrlimit(RLIMIT_DATA, &rl) == 0) {
        rlim_t want = (rlim_t)(data_kb * 1024ull + (1ull << 30));
        if (rl.rlim_max == RLIM_INFINITY || want < rl.rlim_max) {
            rl.rlim_cur = want;
            setrlimit(RLIMIT_DATA, &rl);
        }
    }
#endif
}

int cmd_ckpt(int argc, char **argv)
{
    store_opts o = {0};
    const char *unused = NULL;
    if (argc < 2) {
        ckpt_usage(stderr);
        return SP_EXIT_USAGE;
    }
    const char *sub = argv[1];
    if (!strcmp(sub, "--help") || !strcmp(sub, "-h")) {
        ckpt_usage(stdout);
        return 0;
    }
    int prc = parse_store_opts(argc - 1, argv + 1, &o, NULL, &unused, &unused, &unused, &unused);
    if (prc) {
        ckpt_usage(prc > 0 ? stdout : stderr);
        return prc > 0 ? 0 : SP_EXIT_USAGE;
    }
    int nargs = argc - 1 - optind;
    char **args = argv + 1 + optind;
    sp_err err = {0};
    if (!strcmp(sub, "list") && nargs == 1) {
        int rc = is_url(args[0]) ? list_remote(args[0], &o, &err) : list_local(args[0], &err);
        return rc ? fail(&err) : 0;
    }
    if (!strcmp(sub, "verify") && nargs == 1) {
        char *dir, *tmp;
        ckpt_manifest m = {0};
        ckpt_snapshot s;
        config_t c;
        ckpt_snapshot_init(&s);
        config_defaults(&c);
        int rc = local_checkpoint(args[0], &o, &dir, &tmp, &err);
        if (!rc)
            rc = ckpt_verify(dir, &m, &err);
        if (!rc)
            rc = state_check_isolated(dir, &err);
        if (!rc)
            rc = ckpt_read_verified(dir, &m, &s, &err);
        int away = rc ? 0 : ckpt_layout_store_only(m.layout, NULL, 0);
        /* what resume and export check, verify checks: the attributes, the
         * config, the tensors and every value (of the shards at hand) */
        if (!rc) {
            config_free(&c);
            rc = state_check_contents(dir, &s, !away, &c, &err);
        }
        ckpt_snapshot_free(&s);
        config_free(&c);
        local_checkpoint_done(dir, tmp);
        if (!rc)
            printf("%s: ok (step %lld, %d file(s) verified, state readable and consistent, "
                   "values finite, world size %d%s)\n",
                   args[0], (long long)m.step, m.nfiles - away, m.world_size,
                   m.layout ? ", sharded: a shard file per rank" : "");
        if (!rc && away)
            printf("%s: %d shard file(s) were written on other machines (no shared run.dir) "
                   "and are only in the remote store: verify its copy with spotune ckpt "
                   "verify URL/step-%08lld\n",
                   args[0], away, (long long)m.step);
        ckpt_manifest_free(&m);
        if (rc)
            return fail(&err);
        return 0;
    }
    if (!strcmp(sub, "check") && nargs == 1) {
        checker_memory_limit();
        if (ckpt_check_state(args[0], &err))
            return fail(&err);
        printf("%s/%s: readable\n", args[0], CKPT_STATE_FILE);
        return 0;
    }
    if (!strcmp(sub, "pull") && nargs == 2) {
        if (!is_url(args[0])) {
            sp_fail(&err, SP_EXIT_USAGE, "ckpt pull: %s is not a URL", args[0]);
            return fail(&err);
        }
        if (pull(args[0], args[1], &o, &err))
            return fail(&err);
        printf("%s -> %s: verified\n", args[0], args[1]);
        return 0;
    }
    ckpt_usage(stderr);
    return SP_EXIT_USAGE;
}

/* ---- export ---------------------------------------------------------------------- */

static void opts_from_config(const config_t *c, model_opts *o)
{
    memset(o, 0, sizeof *o);
    o->mode = c->mode;
    o->lora_r = c->lora_r;
    o->lora_alpha = c->lora_alpha;
    o->lora_dropout = c->lora_dropout;
    o->lora_targets = c->lora_targets;
    o->rslora = c->lora_rslora;
    o->dora = c->lora_dora;
    o->nf4 = c->model_quantize == QUANT_NF4;
    o->max_batch = 1;
    o->seq_len = 2;
    o->seed = (uint64_t)c->seed;
}

/* --dtype's value */
static int dtype_of_option(const char *v, dtype_t *dt, sp_err *err)
{
    if (strcmp(v, "bf16") == 0)
        *dt = DT_BF16;
    else if (strcmp(v, "f16") == 0)
        *dt = DT_F16;
    else if (strcmp(v, "f32") == 0)
        *dt = DT_F32;
    else
        return sp_fail(err, SP_EXIT_USAGE, "export: --dtype '%s' is not one of bf16, f16, f32", v);
    return 0;
}

static int export_peft(const ckpt_snapshot *s, const config_t *c, const char *base,
                       const char *model, const char *ckpt_dir, const char *out, sp_err *err)
{
    if (c->mode != MODE_LORA)
        return sp_fail(err, SP_EXIT_USAGE,
                       "--peft: this checkpoint is a full fine-tune; use --merged");
    /* --model names the base the adapter is for: when it is a model directory
     * at hand, the adapter must fit it (else it is a name, as a hub id, that
     * base_model_name_or_path records as it is) */
    model_config_t mc;
    char *cfg_json = model ? sp_strf("%s/config.json", model) : NULL;
    struct stat sb;
    int at_hand = cfg_json && stat(cfg_json, &sb) == 0;
    free(cfg_json);
    if (at_hand && (model_config_load(&mc, model, err) ||
                    state_check_tensors(ckpt_dir, s, c, &mc, model, err)))
        return err->code;
    adapter_tensor *t = calloc((size_t)s->narrays + 1, sizeof *t);
    size_t n = 0;
    if (!t)
        return sp_fail(err, SP_EXIT_OTHER, "out of memory");
    for (int i = 0; i < s->narrays; i++) {
        const ckpt_array *a = &s->arrays[i];
        const char *name = sp_after(a->name, "params/");
        int magnitude = name && a->ndim == 1 && strstr(name, ".lora_magnitude_vector");
        if (!name || (a->ndim != 2 && !magnitude))
            continue;
        t[n++] = (adapter_tensor){name, {a->shape[0], magnitude ? 0 : a->shape[1]}, a->data};
    }
    model_opts o;
    opts_from_config(c, &o);
    /* the identity of the base it was trained on, recorded by the checkpoint:
     * the base directory need not be at hand */
    int rc = n ? adapter_write(out, &o, base, s->base_model, t, n, err)
               : sp_fail(err, SP_EXIT_INPUT, "the checkpoint holds no LoRA weights");
    free(t);
    /* the model card: what was trained, from the checkpoint's own metrics */
    const ckpt_attr *step = ckpt_get(s, "step");
    model_card card = {.base_model = base,
                       .steps = step && step->type == CKPT_ATTR_INT ? step->i : 0,
                       .train_data = c->data_train,
                       .val_data = c->data_val};
    char *metrics = rc ? NULL : sp_strf("%s/metrics.jsonl", ckpt_dir);
    if (!rc && !metrics)
        rc = sp_fail(err, SP_EXIT_OTHER, "out of memory");
    if (!rc && model_card_read_metrics(&card, metrics, err))
        rc = err->code;
    if (!rc)
        rc = model_card_write(out, &o, &card, err);
    free(metrics);
    return rc;
}

static int export_merged(const ckpt_snapshot *s, const config_t *c, const char *base,
                         const char *ckpt_dir, const char *out, const char *dtype_opt,
                         sp_err *err)
{
    struct stat sb, so;
    if (stat(base, &sb) == 0 && stat(out, &so) == 0 && sb.st_dev == so.st_dev &&
        sb.st_ino == so.st_ino)
        return sp_fail(err, SP_EXIT_USAGE,
                       "--merged %s is the base model directory: the export would overwrite the "
                       "base; choose another directory",
                       out);
    model_config_t mc;
    if (model_config_load(&mc, base, err))
        return err->code;
    char identity[17];
    if (c->mode == MODE_LORA) {
        if (model_io_identity(base, identity, err))
            return err->code;
        if (strcmp(identity, s->base_model) != 0)
            return sp_fail(err, SP_EXIT_USAGE,
                           "%s is not the base model this checkpoint was trained on (identity %s, "
                           "expected %s)",
                           base, identity, s->base_model);
        if (state_check_tensors(ckpt_dir, s, c, &mc, base, err))
            return err->code;
    }
    backend_t *be;
    model_t *m = NULL;
    model_opts o;
    opts_from_config(c, &o);
    dtype_t dt;
    int rc = dtype_opt ? dtype_of_option(dtype_opt, &dt, err)
                       : model_io_weights_dtype(base, &dt, err);
    if (!rc && o.nf4) {
        if (!dtype_opt)
            dt = DT_BF16;
        printf("note: model.quantize nf4: the adapter is merged into the base as it was trained, "
               "dequantized from NF4, so the merged weights differ from the unquantized base "
               "plus the adapter by the quantization error; written as %s\n",
               dtype_name(dt));
    }
    if (!rc)
        rc = backend_create(&be, "cpu", 0, 0, err);
    if (!rc && (rc = model_create(&m, be, &mc, &o, err)) == 0)
        rc = model_io_load_base(m, base, err);
    for (int i = 0; m && !rc && i < m->nparams; i++) {
        param_t *p = &m->params[i];
        if (!p->trainable)
            continue;
        char name[256];
        snprintf(name, sizeof name, "params/%s", p->name);
        const ckpt_array *a = ckpt_find_array(s, name);
        if (!a)
            rc = sp_fail(err, SP_EXIT_INPUT, "%s: the checkpoint lacks %s", ckpt_dir, name);
        else if (a->n != p->n)
            rc = sp_fail(err, SP_EXIT_INPUT,
                         "%s: %s has %zu values, but the model %s's %s has %zu (another model?)",
                         ckpt_dir, name, a->n, base, p->name, p->n);
        else
            model_param_upload(m, p, a->data, DT_F32);
    }
    if (!rc)
        rc = model_io_save_derived(m, base, out, dt, c->mode == MODE_LORA, MODEL_IO_SHARD_BYTES,
                                   err);
    if (m)
        model_destroy(m);
    if (m || rc == 0)
        backend_destroy(be);
    return rc;
}

static void export_usage(FILE *f)
{
    fprintf(f, "usage: spotune export CHECKPOINT [--peft OUT_DIR] [--merged OUT_DIR [--dtype D]]\n"
               "                      [--model DIR]\n"
               "CHECKPOINT: a checkpoint directory or s3://bucket/prefix/step-NNNNNNNN.\n"
               "--peft: the LoRA adapter in the PEFT layout (adapter_model.safetensors +\n"
               "  adapter_config.json, and a README.md model card), for Hugging Face PEFT,\n"
               "  vLLM and SGLang.\n"
               "--merged: base + adapter (or the fully fine-tuned weights) as a Hugging Face\n"
               "  model directory that loads without the base: the base's config.json with\n"
               "  only the dtype changed, its tokenizer files and generation_config.json.\n"
               "--dtype bf16|f16|f32: the merged weights' dtype (default: the base's; bf16 for\n"
               "  a model.quantize nf4 run, whose base is merged dequantized).\n"
               "--model: the base model directory (default: model.path of the run); with\n"
               "  --peft, a directory at hand is checked against the adapter, and another\n"
               "  name (a hub id) is recorded as base_model_name_or_path as it is.\n"
               "options for s3://: --endpoint URL --region R --path-style --timeout S\n");
}

int cmd_export(int argc, char **argv)
{
    store_opts o = {0};
    const char *peft = NULL, *merged = NULL, *model = NULL, *dtype = NULL;
    int prc = parse_store_opts(argc, argv, &o, "PMmd", &peft, &merged, &model, &dtype);
    if (prc || optind != argc - 1 || (!peft && !merged)) {
        export_usage(prc > 0 ? stdout : stderr);
        return prc > 0 ? 0 : SP_EXIT_USAGE;
    }
    sp_err err = {0};
    dtype_t dt;
    if (dtype && !merged)
        sp_fail(&err, SP_EXIT_USAGE, "export: --dtype applies to --merged only");
    else if (dtype)
        dtype_of_option(dtype, &dt, &err);
    if (err.code)
        return fail(&err);
    char *dir, *tmp;
    ckpt_snapshot s;
    config_t c;
    config_defaults(&c);
    ckpt_snapshot_init(&s);
    int rc = local_checkpoint(argv[optind], &o, &dir, &tmp, &err);
    if (!rc)
        rc = state_read_checked(dir, 0, &s, &err);
    /* a sharded checkpoint's weights are in its shard files */
    if (!rc && s.layout && ckpt_layout_store_only(s.layout, NULL, 0))
        rc = sp_fail(&err, SP_EXIT_INPUT,
                     "%s: %d of its shard files were written on other machines and are only in "
                     "the remote store: export from the store's copy (URL/step-%08lld)",
                     argv[optind], ckpt_layout_store_only(s.layout, NULL, 0), (long long)s.step);
    if (!rc && s.layout)
        rc = ckpt_sharded_load(dir, &s, 0, "params/", &err);
    /* the checks of ckpt verify and resume: attributes, config (every key
     * export needs), tensors against it, values (the weights it writes) */
    if (!rc) {
        config_free(&c);
        rc = state_check_contents(dir, &s, 0, &c, &err);
    }
    const char *base = model ? model : c.model_path;
    if (!rc && peft && (rc = export_peft(&s, &c, base, model, dir, peft, &err)) == 0)
        printf("adapter (PEFT layout): %s\n", peft);
    if (!rc && merged && (rc = export_merged(&s, &c, base, dir, merged, dtype, &err)) == 0)
        printf("merged model (Hugging Face layout): %s\n", merged);
    ckpt_snapshot_free(&s);
    config_free(&c);
    local_checkpoint_done(dir, tmp);
    return rc ? fail(&err) : 0;
}
