/* Reading a checkpoint's state.h5 behind a check in a process of its own,
 * and checking what it holds (attributes, config, tensors, values) the same
 * way for every reader. */
#define _GNU_SOURCE
#include "state_check.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include <yaml.h>

#include "model.h"

extern char **environ;

/* Reading the structure takes well under a second; a checker that runs this
 * long is stuck in a loop of the damaged file. */
#define CHECK_TIMEOUT_S 120.0

/* Reads the child's output into buf (up to n-1 bytes, the rest discarded)
 * until it closes it or the deadline passes; returns 0, or -1 on timeout. */
static int read_output(int fd, char *buf, size_t n, double timeout_s)
{
    size_t len = 0;
    double end = sp_now() + timeout_s;
    for (;;) {
        double left = end - sp_now();
        if (left <= 0)
            return -1;
        struct pollfd p = {.fd = fd, .events = POLLIN};
        int r = poll(&p, 1, (int)(left * 1000.0) + 1);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return r == 0 ? -1 : 0;
        char tmp[4096];
        ssize_t got = read(fd, tmp, sizeof tmp);
        if (got < 0 && errno == EINTR)
            continue;
        if (got <= 0)
            break;
        size_t take = (size_t)got < n - 1 - len ? (size_t)got : n - 1 - len;
        memcpy(buf + len, tmp, take);
        len += take;
    }
    buf[len] = 0;
    return 0;
}

/* The child's error message: its "spotune: error: " line, without the prefix. */
static const char *child_message(char *out)
{
    char *e = strstr(out, "error: ");
    if (!e)
        return out;
    e += strlen("error: ");
    e[strcspn(e, "\n")] = 0;
    return e;
}

int state_check_isolated(const char *dir, sp_err *err)
{
    int fds[2];
    if (pipe2(fds, O_CLOEXEC) != 0)
        return sp_fail(err, SP_EXIT_OTHER, "cannot check %s: pipe: %s", dir, strerror(errno));
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, fds[1], STDOUT_FILENO);
    posix_spawn_file_actions_adddup2(&fa, fds[1], STDERR_FILENO);
    char *argv[] = {"spotune", "ckpt", "check", (char *)dir, NULL};
    pid_t pid;
    int rc = posix_spawn(&pid, "/proc/self/exe", &fa, NULL, argv, environ);
    posix_spawn_file_actions_destroy(&fa);
    close(fds[1]);
    if (rc != 0) {
        close(fds[0]);
        return sp_fail(err, SP_EXIT_OTHER, "cannot check %s: cannot start a checker: %s", dir,
                       strerror(rc));
    }
    char out[2048];
    int timed_out = read_output(fds[0], out, sizeof out, CHECK_TIMEOUT_S) != 0;
    close(fds[0]);
    if (timed_out)
        kill(pid, SIGKILL);
    int st = 0;
    while (waitpid(pid, &st, 0) < 0 && errno == EINTR)
        ;
    if (timed_out)
        return sp_fail(err, SP_EXIT_INPUT,
                       "%s/%s is damaged: reading its structure did not finish in %.0f s",
                       dir, CKPT_STATE_FILE, CHECK_TIMEOUT_S);
    if (WIFSIGNALED(st))
        return sp_fail(err, SP_EXIT_INPUT,
                       "%s/%s is damaged: reading its structure crashed the HDF5 library "
                       "(signal %d, %s) in the process that checks it",
                       dir, CKPT_STATE_FILE, WTERMSIG(st), strsignal(WTERMSIG(st)));
    if (WEXITSTATUS(st) == 0)
        return 0;
    if (WEXITSTATUS(st) == SP_EXIT_INPUT)
        return sp_fail(err, SP_EXIT_INPUT, "%s", child_message(out));
    return sp_fail(err, SP_EXIT_INPUT,
                   "%s/%s is damaged: the process that checks it exited %d (sanitizer or "
                   "library error)",
                   dir, CKPT_STATE_FILE, WEXITSTATUS(st));
}

int state_read_checked(const char *dir, int shards_in_store, ckpt_snapshot *s, sp_err *err)
{
    ckpt_manifest m;
    ckpt_snapshot_init(s);
    int rc = ckpt_verify_ex(dir, &m, shards_in_store, err);
    if (!rc)
        rc = state_check_isolated(dir, err);
    if (!rc)
        rc = ckpt_read_verified(dir, &m, s, err);
    ckpt_manifest_free(&m);
    return rc;
}

/* ---- what a checkpoint holds ------------------------------------------------------- */

int state_check_attrs(const char *dir, const ckpt_snapshot *s, sp_err *err)
{
    static const struct {
        const char *name;
        int type;
        double min;
    } need[] = {{"step", CKPT_ATTR_INT, 0},         {"cursor", CKPT_ATTR_INT, 0},
                {"global_batch", CKPT_ATTR_INT, 1}, {"world_size", CKPT_ATTR_INT, 1},
                {"elapsed_s", CKPT_ATTR_REAL, 0},   {"config", CKPT_ATTR_STR, 0},
                {"mode", CKPT_ATTR_STR, 0}};
    static const char *const types[] = {"an integer", "a number", "a string"};
    for (size_t i = 0; i < sizeof need / sizeof need[0]; i++) {
        const ckpt_attr *a = ckpt_get(s, need[i].name);
        if (!a)
            return sp_fail(err, SP_EXIT_INPUT, "%s/%s lacks the attribute '%s'", dir,
                           CKPT_STATE_FILE, need[i].name);
        double v = a->type == CKPT_ATTR_INT ? (double)a->i : a->d;
        if (a->type != need[i].type || (a->type != CKPT_ATTR_STR && !(v >= need[i].min)) ||
            (a->type == CKPT_ATTR_REAL && !isfinite(v)))
            return sp_fail(err, SP_EXIT_INPUT,
                           "%s/%s: the attribute '%s' is not %s of at least %g (damaged?)", dir,
                           CKPT_STATE_FILE, need[i].name, types[need[i].type], need[i].min);
    }
    if (ckpt_get(s, "step")->i != s->step)
        return sp_fail(err, SP_EXIT_INPUT, "%s/%s says step %lld, its MANIFEST step %lld", dir,
                       CKPT_STATE_FILE, (long long)ckpt_get(s, "step")->i, (long long)s->step);
    if (ckpt_get(s, "world_size")->i != s->world_size)
        return sp_fail(err, SP_EXIT_INPUT,
                       "%s/%s says world_size %lld, its MANIFEST world_size %d", dir,
                       CKPT_STATE_FILE, (long long)ckpt_get(s, "world_size")->i, s->world_size);
    const char *mode = ckpt_get(s, "mode")->s;
    if (strcmp(mode, "lora") != 0 && strcmp(mode, "full") != 0)
        return sp_fail(err, SP_EXIT_INPUT,
                       "%s/%s: the attribute 'mode' is '%s', neither 'lora' nor 'full' "
                       "(damaged?)",
                       dir, CKPT_STATE_FILE, mode);
    return 0;
}

/* Whether the YAML mapping `root` has key section.key (key NULL: section). */
static int yaml_has(yaml_document_t *doc, const char *section, const char *key)
{
    yaml_node_t *n = yaml_document_get_root_node(doc);
    const char *want[2] = {section, key};
    for (int level = 0; level < 2 && want[level]; level++) {
        if (!n || n->type != YAML_MAPPING_NODE)
            return 0;
        yaml_node_t *found = NULL;
        for (yaml_node_pair_t *p = n->data.mapping.pairs.start;
             p < n->data.mapping.pairs.top && !found; p++) {
            yaml_node_t *k = yaml_document_get_node(doc, p->key);
            if (k && k->type == YAML_SCALAR_NODE &&
                strcmp((const char *)k->data.scalar.value, want[level]) == 0)
                found = yaml_document_get_node(doc, p->value);
        }
        n = found;
    }
    return n != NULL;
}

int state_load_config(const char *dir, const ckpt_snapshot *s, config_t *c, sp_err *err)
{
    config_defaults(c);
    const ckpt_attr *conf = ckpt_get(s, "config");
    if (!conf || conf->type != CKPT_ATTR_STR)
        return sp_fail(err, SP_EXIT_INPUT, "%s/%s lacks its config (the attribute 'config')",
                       dir, CKPT_STATE_FILE);
    if (config_load_text(c, conf->s, "checkpoint config", err)) {
        sp_err_prefix(err, "%s/%s: ", dir, CKPT_STATE_FILE);
        return err->code = SP_EXIT_INPUT; /* a damaged checkpoint, not the user's config */
    }
    /* the resolved config a writer saves has every key: one that is not
     * there would be taken at its default, which is not what was trained */
    static const char *const keys[][2] = {{"model", "path"}, {"train", "mode"}, {"lora", "r"},
                                          {"lora", "alpha"}, {"lora", "targets"}};
    char missing[256] = "";
    size_t len = 0;
    yaml_parser_t parser;
    yaml_document_t doc;
    int parsed = yaml_parser_initialize(&parser);
    if (parsed) {
        yaml_parser_set_input_string(&parser, (const unsigned char *)conf->s, strlen(conf->s));
        parsed = yaml_parser_load(&parser, &doc);
    }
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) {
        if (i >= 2 && c->mode != MODE_LORA)
            break;
        int there = parsed && yaml_has(&doc, keys[i][0], keys[i][1]);
        if (i == 0)
            there = there && c->model_path && *c->model_path;
        if (!there)
            len += (size_t)snprintf(missing + len, sizeof missing - len, "%s%s.%s",
                                    len ? ", " : "", keys[i][0], keys[i][1]);
    }
    if (parsed)
        yaml_document_delete(&doc);
    yaml_parser_delete(&parser);
    if (len)
        return sp_fail(err, SP_EXIT_INPUT,
                       "%s/%s: the checkpoint's config lacks %s (its attribute 'config' is "
                       "damaged or empty)",
                       dir, CKPT_STATE_FILE, missing);
    const ckpt_attr *mode = ckpt_get(s, "mode");
    const char *cmode = c->mode == MODE_LORA ? "lora" : "full";
    if (mode && mode->type == CKPT_ATTR_STR && strcmp(mode->s, cmode) != 0)
        return sp_fail(err, SP_EXIT_INPUT,
                       "%s/%s: the attribute 'mode' is '%s', its config's train.mode %s", dir,
                       CKPT_STATE_FILE, mode->s, cmode);
    return 0;
}

static const char *const groups[3] = {"params/", "adam_m/", "adam_v/"};

/* params/X, adam_m/X and adam_v/X together, of one shape, and nothing else. */
static int check_groups(const char *dir, const ckpt_snapshot *s, sp_err *err)
{
    for (int i = 0; i < s->narrays; i++) {
        const ckpt_array *a = &s->arrays[i];
        const char *name = NULL;
        for (int g = 0; g < 3 && !name; g++)
            name = sp_after(a->name, groups[g]);
        if (!name || !*name)
            return sp_fail(err, SP_EXIT_INPUT,
                           "%s/%s holds the dataset '%s', which is in none of params/, "
                           "adam_m/, adam_v/",
                           dir, CKPT_STATE_FILE, a->name);
        for (int g = 0; g < 3; g++) {
            char other[512];
            snprintf(other, sizeof other, "%s%s", groups[g], name);
            const ckpt_array *b = ckpt_find_array(s, other);
            if (!b)
                return sp_fail(err, SP_EXIT_INPUT, "%s/%s holds %s but lacks %s", dir,
                               CKPT_STATE_FILE, a->name, other);
            int same = b->ndim == a->ndim;
            for (int d = 0; same && d < a->ndim; d++)
                same = a->shape[d] == b->shape[d];
            if (!same)
                return sp_fail(err, SP_EXIT_INPUT,
                               "%s/%s: %s and %s have different shapes", dir, CKPT_STATE_FILE,
                               a->name, other);
        }
    }
    return 0;
}

/* A LoRA projection's in and out features stand for one of the model's
 * sizes each: the hidden size, the attention's query and key/value widths,
 * the MLP's intermediate size. */
enum { DIM_HIDDEN, DIM_Q, DIM_KV, DIM_INTER, DIM_COUNT };
static const int proj_in[PROJ_COUNT] = {DIM_HIDDEN, DIM_HIDDEN, DIM_HIDDEN, DIM_Q,
                                        DIM_HIDDEN, DIM_HIDDEN, DIM_INTER};
static const int proj_out[PROJ_COUNT] = {DIM_Q, DIM_KV, DIM_KV, DIM_HIDDEN,
                                         DIM_INTER, DIM_INTER, DIM_HIDDEN};
static const char *const dim_names[DIM_COUNT] = {"hidden size", "attention width",
                                                 "key/value width", "intermediate size"};

typedef struct lora_dims {
    int64_t v[DIM_COUNT];
    char from[DIM_COUNT][8 + 256]; /* what set it: params/ and a tensor name (messages) */
} lora_dims;

/* features must be dims' k, or set it */
static int same_dim(const char *dir, lora_dims *d, int k, int64_t features, const char *tensor,
                    const char *side, sp_err *err)
{
    if (d->v[k] < 0) {
        d->v[k] = features;
        snprintf(d->from[k], sizeof d->from[k], "params/%s", tensor);
        return 0;
    }
    if (d->v[k] == features)
        return 0;
    return sp_fail(err, SP_EXIT_INPUT,
                   "%s/%s: params/%s has %lld %s features, but the %s is %lld (%s)", dir,
                   CKPT_STATE_FILE, tensor, (long long)features, side, dim_names[k],
                   (long long)d->v[k], d->from[k]);
}

static void targets_text(const config_t *c, char *buf, size_t n)
{
    size_t len = 0;
    buf[0] = 0;
    for (int p = 0; p < TARGET_COUNT; p++)
        if (c->lora_targets & (1 << p))
            len += (size_t)snprintf(buf + len, len < n ? n - len : 0, "%s%s", len ? ", " : "",
                                    config_target_names[p]);
}

/* The layer and projection of a LoRA tensor name (params/ stripped): kind 0
 * lora_A, 1 lora_B, 2 DoRA's magnitude; -1 when it is none. */
static int lora_tensor(const char *name, int *layer, int *proj)
{
    int l = -1, used = 0;
    if (sscanf(name, "base_model.model.model.layers.%d.%n", &l, &used) != 1 || !used || l < 0 ||
        l > 65535)
        return -1;
    char want[256];
    for (int p = 0; p < PROJ_COUNT; p++)
        for (int kind = 0; kind < 3; kind++) {
            if (kind < 2)
                model_lora_name(want, sizeof want, l, p, kind);
            else
                model_dora_name(want, sizeof want, l, p);
            if (strcmp(want, name) == 0) {
                *layer = l;
                *proj = p;
                return kind;
            }
        }
    return -1;
}

/* "[d0, d1, ...]" of a */
static const char *shape_text(const ckpt_array *a, char *buf, size_t n)
{
    size_t len = (size_t)snprintf(buf, n, "[");
    for (int d = 0; d < a->ndim && len < n; d++)
        len += (size_t)snprintf(buf + len, n - len, "%s%lld", d ? ", " : "",
                                (long long)a->shape[d]);
    if (len < n)
        snprintf(buf + len, n - len, "]");
    return buf;
}

static int check_lora(const char *dir, const ckpt_snapshot *s, const config_t *c,
                      const model_config_t *mc, const char *model_dir, sp_err *err)
{
    char targets[128];
    targets_text(c, targets, sizeof targets);
    lora_dims d;
    for (int k = 0; k < DIM_COUNT; k++)
        d.v[k] = -1;
    if (mc) {
        for (int p = 0; p < PROJ_COUNT; p++) {
            int64_t in, out;
            model_config_proj_dims(mc, p, &in, &out);
            d.v[proj_in[p]] = in;
            d.v[proj_out[p]] = out;
        }
        for (int k = 0; k < DIM_COUNT; k++)
            snprintf(d.from[k], sizeof d.from[k], "the model %s", model_dir);
    }
    /* which tensor is each layer's (A, B, magnitude) of each projection */
    int layers = mc ? (int)mc->layers : 0;
    for (int i = 0; i < s->narrays; i++) {
        const char *name = sp_after(s->arrays[i].name, "params/");
        int l, p;
        if (!name)
            continue;
        int kind = lora_tensor(name, &l, &p);
        if (kind < 0 || !(c->lora_targets & (1 << p)) || (kind == 2 && !c->lora_dora))
            return sp_fail(err, SP_EXIT_INPUT,
                           "%s/%s: params/%s is not a LoRA weight of this run (lora.targets: "
                           "%s; lora.dora: %s)",
                           dir, CKPT_STATE_FILE, name, targets, c->lora_dora ? "on" : "off");
        if (mc && l >= layers)
            return sp_fail(err, SP_EXIT_INPUT,
                           "%s/%s: params/%s is of layer %d, but the model %s has %d layers",
                           dir, CKPT_STATE_FILE, name, l, model_dir, layers);
        if (!mc && l + 1 > layers)
            layers = l + 1;
    }
    int rc = 0;
    for (int l = 0; l < layers && !rc; l++)
        for (int p = 0; p < PROJ_COUNT && !rc; p++) {
            if (!(c->lora_targets & (1 << p)))
                continue;
            char name[3][256];
            const ckpt_array *a[3];
            for (int kind = 0; kind < 3; kind++) {
                char full[300];
                if (kind < 2)
                    model_lora_name(name[kind], sizeof name[kind], l, p, kind);
                else
                    model_dora_name(name[kind], sizeof name[kind], l, p);
                snprintf(full, sizeof full, "params/%s", name[kind]);
                a[kind] = ckpt_find_array(s, full);
                if (!a[kind] && (kind < 2 || c->lora_dora))
                    return sp_fail(err, SP_EXIT_INPUT,
                                   "%s/%s lacks %s (lora.targets has %s, in each of the %d "
                                   "layers)",
                                   dir, CKPT_STATE_FILE, full, config_target_names[p], layers);
            }
            const ckpt_array *A = a[0], *B = a[1], *M = a[2];
            char shape[96];
            if (A->ndim != 2 || A->shape[0] != c->lora_r)
                return sp_fail(err, SP_EXIT_INPUT,
                               "%s/%s: params/%s has the shape %s, but lora.r is %lld: lora_A "
                               "is [r, in-features]",
                               dir, CKPT_STATE_FILE, name[0], shape_text(A, shape, sizeof shape),
                               (long long)c->lora_r);
            if (B->ndim != 2 || B->shape[1] != c->lora_r)
                return sp_fail(err, SP_EXIT_INPUT,
                               "%s/%s: params/%s has the shape %s, but lora.r is %lld: lora_B "
                               "is [out-features, r]",
                               dir, CKPT_STATE_FILE, name[1], shape_text(B, shape, sizeof shape),
                               (long long)c->lora_r);
            rc = same_dim(dir, &d, proj_in[p], A->shape[1], name[0], "in", err);
            if (!rc)
                rc = same_dim(dir, &d, proj_out[p], B->shape[0], name[1], "out", err);
            if (!rc && M && (M->ndim != 1 || M->shape[0] != B->shape[0]))
                rc = sp_fail(err, SP_EXIT_INPUT,
                             "%s/%s: params/%s is not a vector of the %lld out-features of "
                             "params/%s",
                             dir, CKPT_STATE_FILE, name[2], (long long)B->shape[0], name[1]);
        }
    if (!rc && layers == 0)
        rc = sp_fail(err, SP_EXIT_INPUT, "%s/%s holds no LoRA weights", dir, CKPT_STATE_FILE);
    return rc;
}

int state_check_tensors(const char *dir, const ckpt_snapshot *s, const config_t *c,
                        const model_config_t *mc, const char *model_dir, sp_err *err)
{
    if (c->mode == MODE_LORA && check_lora(dir, s, c, mc, model_dir, err))
        return err->code;
    /* a sharded checkpoint's tensors are in its layout, each in every group */
    return s->layout ? 0 : check_groups(dir, s, err);
}

/* The first of v's n values that a checkpoint may not hold (not finite; for
 * a second moment, negative), or n. */
static size_t first_refused(const char *array, const float *v, size_t n)
{
    int second = sp_after(array, "adam_v/") != NULL;
    for (size_t i = 0; i < n; i++)
        if (!isfinite(v[i]) || (second && v[i] < 0))
            return i;
    return n;
}

static int refuse_value(const char *where, const char *array, size_t at, float v, sp_err *err)
{
    if (!isfinite(v))
        return sp_fail(err, SP_EXIT_INPUT,
                       "%s: %s holds a value that is not finite (element %zu: %g)", where, array,
                       at, (double)v);
    return sp_fail(err, SP_EXIT_INPUT,
                   "%s: %s holds a negative second moment (element %zu: %g), which AdamW never "
                   "writes",
                   where, array, at, (double)v);
}

int state_check_values(const char *where, const char *array, const float *v, size_t n,
                       size_t first, sp_err *err)
{
    size_t i = first_refused(array, v, n);
    return i < n ? refuse_value(where, array, first + i, v[i], err) : 0;
}

int state_check_shard_values(const ckpt_sharded *r, int g, const char *name, const float *v,
                             size_t n, size_t first, sp_err *err)
{
    char array[512];
    snprintf(array, sizeof array, "%s%s", groups[g], name);
    size_t i = first_refused(array, v, n);
    if (i == n)
        return 0;
    const char *file = ckpt_sharded_file_of(r, name, first + i);
    char *where = sp_strf("%s/%s", ckpt_sharded_where(r), file ? file : "(a shard file)");
    int rc = refuse_value(where ? where : ckpt_sharded_where(r), array, first + i, v[i], err);
    free(where);
    return rc;
}

/* Every value of a sharded checkpoint's shard files in dir, a piece at a time. */
static int check_shard_values(const char *dir, sp_err *err)
{
    ckpt_sharded *r;
    if (ckpt_sharded_open(&r, dir, err))
        return err->code;
    size_t piece = (size_t)1 << 20;
    float *buf = malloc(sizeof(float) * piece);
    int rc = buf ? 0 : sp_fail(err, SP_EXIT_OTHER, "out of memory");
    uint64_t n;
    const char *name;
    for (int i = 0; !rc && (name = ckpt_sharded_tensor_at(r, i, &n)) != NULL; i++)
        for (int g = 0; g < CKPT_SHARD_GROUPS && !rc; g++)
            for (uint64_t at = 0; at < n && !rc; at += piece) {
                size_t k = n - at < piece ? (size_t)(n - at) : piece;
                rc = ckpt_sharded_read(r, g, name, at, k, buf, err) ||
                     state_check_shard_values(r, g, name, buf, k, at, err);
                rc = rc ? err->code : 0;
            }
    free(buf);
    ckpt_sharded_close(r);
    return rc;
}

int state_check_contents(const char *dir, const ckpt_snapshot *s, int shard_values, config_t *c,
                         sp_err *err)
{
    int rc = state_check_attrs(dir, s, err);
    if (rc) {
        config_defaults(c);
        return rc;
    }
    if (state_load_config(dir, s, c, err) || state_check_tensors(dir, s, c, NULL, NULL, err))
        return err->code;
    char *where = sp_strf("%s/%s", dir, CKPT_STATE_FILE);
    if (!where)
        return sp_fail(err, SP_EXIT_OTHER, "out of memory");
    for (int i = 0; i < s->narrays && !rc; i++)
        rc = state_check_values(where, s->arrays[i].name, s->arrays[i].data, s->arrays[i].n, 0,
                                err);
    free(where);
    if (!rc && s->layout && shard_values)
        rc = check_shard_values(dir, err);
    return rc;
}
