/* Config schema, YAML loading (libyaml document API), overrides, validation
 * and the resolved-config writer (libyaml emitter). */
#define _POSIX_C_SOURCE 200809L
#include "config.h"
#include "config_keys.h"

#include <errno.h>
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <yaml.h>

const char *const config_target_names[TARGET_COUNT] = {
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};


static const key_def *find_key(const char *name)
{
    for (size_t i = 0; i < config_nkeys; i++)
        if (strcmp(config_keys[i].name, name) == 0)
            return &config_keys[i];
    return NULL;
}

static int section_exists(const char *sec, size_t len)
{
    for (size_t i = 0; i < config_nkeys; i++)
        if (strncmp(config_keys[i].name, sec, len) == 0 && config_keys[i].name[len] == '.')
            return 1;
    return 0;
}

/* ---- scalar parsing ------------------------------------------------------ */

static int parse_int(const char *s, int64_t *out)
{
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || end == s || *end)
        return -1;
    *out = v;
    return 0;
}

static int parse_float(const char *s, double *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !isfinite(v))
        return -1;
    *out = v;
    return 0;
}

static int parse_bool(const char *s, int *out)
{
    if (!strcasecmp(s, "true") || !strcasecmp(s, "yes") || !strcasecmp(s, "on")) {
        *out = 1;
        return 0;
    }
    if (!strcasecmp(s, "false") || !strcasecmp(s, "no") || !strcasecmp(s, "off")) {
        *out = 0;
        return 0;
    }
    return -1;
}

static int target_bit(const char *s)
{
    for (int i = 0; i < TARGET_COUNT; i++)
        if (strcmp(s, config_target_names[i]) == 0)
            return 1 << i;
    return 0;
}

/* Where a value came from, for messages: "file.yaml:12" or "--set". */
typedef struct origin {
    const char *file;
    long line;
} origin;

static int bad(sp_err *err, origin o, const key_def *k, const char *fmt, const char *what)
{
    char detail[512];
    snprintf(detail, sizeof detail, fmt, what);
    if (o.line > 0)
        return sp_fail(err, SP_EXIT_USAGE, "%s:%ld: %s: %s", o.file, o.line, k->name, detail);
    return sp_fail(err, SP_EXIT_USAGE, "%s: %s: %s", o.file, k->name, detail);
}

/* A K_INT or K_FLOAT value: s parsed, checked against k's range, stored at base. */
static int set_number(char *base, const key_def *k, const char *s, int quoted, origin o,
                      sp_err *err)
{
    int is_int = k->type == K_INT;
    int64_t i = 0;
    double v = 0;
    if (quoted || (is_int ? parse_int(s, &i) : parse_float(s, &v)))
        return bad(err, o, k,
                   is_int ? "expected an integer, got '%s'" : "expected a number, got '%s'", s);
    if (is_int)
        v = (double)i;
    if (v < k->min || v > k->max) {
        char r[128];
        snprintf(r, sizeof r,
                 is_int ? "%%s is out of range [%.0f, %.0f]" : "%%s is out of range [%g, %g]",
                 k->min, k->max);
        return bad(err, o, k, r, s);
    }
    if (is_int)
        *(int64_t *)base = i;
    else
        *(double *)base = v;
    return 0;
}

static int set_scalar(config_t *cfg, const key_def *k, const char *s, int quoted, origin o,
                      sp_err *err)
{
    char *base = (char *)cfg + k->offset;
    switch (k->type) {
    case K_INT:
    case K_FLOAT: return set_number(base, k, s, quoted, o, err);
    case K_BOOL: {
        int v;
        if (quoted || parse_bool(s, &v))
            return bad(err, o, k, "expected true or false, got '%s'", s);
        *(int *)base = v;
        return 0;
    }
    case K_STRING: {
        char *dup = strdup(s);
        if (!dup)
            return sp_fail(err, SP_EXIT_OTHER, "out of memory");
        free(*(char **)base);
        *(char **)base = dup;
        return 0;
    }
    case K_ENUM:
        for (int i = 0; k->enums[i]; i++)
            if (strcmp(s, k->enums[i]) == 0) {
                *(int *)base = i;
                return 0;
            }
        {
            char choices[256] = "";
            for (int i = 0; k->enums[i]; i++) {
                strncat(choices, i ? ", " : "", sizeof choices - strlen(choices) - 1);
                strncat(choices, k->enums[i], sizeof choices - strlen(choices) - 1);
            }
            char r[400];
            snprintf(r, sizeof r, "'%%s' is not one of: %s", choices);
            return bad(err, o, k, r, s);
        }
    case K_TARGETS: {
        /* a scalar is a comma-separated list */
        int64_t bits = 0;
        char *copy = strdup(s), *save = NULL;
        if (!copy)
            return sp_fail(err, SP_EXIT_OTHER, "out of memory");
        for (char *t = strtok_r(copy, ", ", &save); t; t = strtok_r(NULL, ", ", &save)) {
            int b = target_bit(t);
            if (!b) {
                int rc = bad(err, o, k,
                             "unknown target '%s' (expected q_proj k_proj v_proj o_proj "
                             "gate_proj up_proj down_proj)",
                             t);
                free(copy);
                return rc;
            }
            bits |= b;
        }
        free(copy);
        if (!bits)
            return bad(err, o, k, "%sthe list of targets is empty", "");
        *(int64_t *)base = bits;
        return 0;
    }
    }
    return 0;
}

/* Applies a YAML node (scalar or, for lists, a sequence of scalars). */
static int set_node(config_t *cfg, const key_def *k, yaml_document_t *doc, yaml_node_t *n,
                    origin o, sp_err *err)
{
    if (n->type == YAML_SCALAR_NODE) {
        int quoted = n->data.scalar.style == YAML_SINGLE_QUOTED_SCALAR_STYLE ||
                     n->data.scalar.style == YAML_DOUBLE_QUOTED_SCALAR_STYLE;
        return set_scalar(cfg, k, (const char *)n->data.scalar.value, quoted, o, err);
    }
    if (n->type == YAML_SEQUENCE_NODE && k->type == K_TARGETS) {
        char joined[512] = "";
        for (yaml_node_item_t *it = n->data.sequence.items.start; it < n->data.sequence.items.top;
             it++) {
            yaml_node_t *e = yaml_document_get_node(doc, *it);
            if (!e || e->type != YAML_SCALAR_NODE)
                return bad(err, o, k, "%sexpected a list of projection names", "");
            if (strlen(joined) + strlen((char *)e->data.scalar.value) + 2 >= sizeof joined)
                return bad(err, o, k, "%stoo many targets", "");
            strcat(joined, joined[0] ? "," : "");
            strcat(joined, (const char *)e->data.scalar.value);
        }
        return set_scalar(cfg, k, joined, 0, o, err);
    }
    return bad(err, o, k, "expected %s", k->type == K_TARGETS ? "a list" : "a single value");
}

void config_defaults(config_t *cfg)
{
    memset(cfg, 0, sizeof *cfg);
    sp_err e = {0};
    origin o = {"defaults", 0};
    for (size_t i = 0; i < config_nkeys; i++) {
        const key_def *k = &config_keys[i];
        const char *d = k->def;
        if (!d)
            continue;
        if (k->type == K_TARGETS) {
            char list[256];
            size_t n = strlen(d);
            snprintf(list, sizeof list, "%.*s", (int)(n - 2), d + 1); /* strip [ ] */
            set_scalar(cfg, k, list, 0, o, &e);
        } else {
            set_scalar(cfg, k, d, 0, o, &e);
        }
    }
}

/* The line of an earlier key of mapping m, before pair `at`, with the same
 * text as key node k (0: none): YAML says keys are unique, and a repeated
 * one would silently override the first. */
static long earlier_key_line(yaml_document_t *doc, yaml_node_t *m, yaml_node_pair_t *at,
                             yaml_node_t *k)
{
    for (yaml_node_pair_t *p = m->data.mapping.pairs.start; p < at; p++) {
        yaml_node_t *e = yaml_document_get_node(doc, p->key);
        if (e && e->type == YAML_SCALAR_NODE && e->data.scalar.length == k->data.scalar.length &&
            memcmp(e->data.scalar.value, k->data.scalar.value, k->data.scalar.length) == 0)
            return (long)e->start_mark.line + 1;
    }
    return 0;
}

static int load_mapping(config_t *cfg, yaml_document_t *doc, const char *path, sp_err *err)
{
    yaml_node_t *root = yaml_document_get_root_node(doc);
    if (!root)
        return 0; /* an empty file is all defaults */
    if (root->type != YAML_MAPPING_NODE)
        return sp_fail(err, SP_EXIT_USAGE, "%s:%lu: expected a mapping of sections", path,
                       (unsigned long)root->start_mark.line + 1);
    for (yaml_node_pair_t *p = root->data.mapping.pairs.start; p < root->data.mapping.pairs.top;
         p++) {
        yaml_node_t *kn = yaml_document_get_node(doc, p->key);
        yaml_node_t *vn = yaml_document_get_node(doc, p->value);
        long line = (long)kn->start_mark.line + 1;
        if (kn->type != YAML_SCALAR_NODE)
            return sp_fail(err, SP_EXIT_USAGE, "%s:%ld: section names must be plain words", path,
                           line);
        const char *sec = (const char *)kn->data.scalar.value;
        long first = earlier_key_line(doc, root, p, kn);
        if (first)
            return sp_fail(err, SP_EXIT_USAGE,
                           "%s:%ld: section '%s' appears again (first at %s:%ld); give each "
                           "section once",
                           path, line, sec, path, first);
        if (!section_exists(sec, strlen(sec)))
            return sp_fail(err, SP_EXIT_USAGE,
                           "%s:%ld: unknown section '%s' (expected run, model, train, lora, data, "
                           "log, runtime, comm, checkpoint; see configs/README.md)",
                           path, line, sec);
        if (vn->type == YAML_SCALAR_NODE && vn->data.scalar.length == 0)
            continue; /* "section:" with nothing under it */
        if (vn->type != YAML_MAPPING_NODE)
            return sp_fail(err, SP_EXIT_USAGE, "%s:%ld: section '%s' must be a mapping", path,
                           line, sec);
        for (yaml_node_pair_t *q = vn->data.mapping.pairs.start; q < vn->data.mapping.pairs.top;
             q++) {
            yaml_node_t *k2 = yaml_document_get_node(doc, q->key);
            yaml_node_t *v2 = yaml_document_get_node(doc, q->value);
            long l2 = (long)k2->start_mark.line + 1;
            char name[256];
            if (k2->type != YAML_SCALAR_NODE)
                return sp_fail(err, SP_EXIT_USAGE, "%s:%ld: keys must be plain words", path, l2);
            if (sp_fitf(name, sizeof name, "%s.%s", sec, (const char *)k2->data.scalar.value))
                return sp_fail(err, SP_EXIT_USAGE, "%s:%ld: unknown key '%s.%s' (see "
                               "configs/README.md)", path, l2, sec,
                               (const char *)k2->data.scalar.value);
            long first2 = earlier_key_line(doc, vn, q, k2);
            if (first2)
                return sp_fail(err, SP_EXIT_USAGE,
                               "%s:%ld: key '%s' appears again (first at %s:%ld); give each key "
                               "once",
                               path, l2, name, path, first2);
            const key_def *k = find_key(name);
            if (!k)
                return sp_fail(err, SP_EXIT_USAGE,
                               "%s:%ld: unknown key '%s' (see configs/README.md)", path, l2, name);
            origin o = {path, (long)v2->start_mark.line + 1};
            if (set_node(cfg, k, doc, v2, o, err))
                return err->code;
        }
    }
    return 0;
}

static int load_parser(config_t *cfg, yaml_parser_t *parser, const char *name, sp_err *err)
{
    yaml_document_t doc;
    int rc;
    if (!yaml_parser_load(parser, &doc)) {
        rc = sp_fail(err, SP_EXIT_USAGE, "%s:%lu:%lu: YAML error: %s", name,
                     (unsigned long)parser->problem_mark.line + 1,
                     (unsigned long)parser->problem_mark.column + 1,
                     parser->problem ? parser->problem : "unknown");
    } else {
        rc = load_mapping(cfg, &doc, name, err);
        yaml_document_delete(&doc);
    }
    /* one document: the keys of a second (after ---) would be ignored */
    if (!rc && !yaml_parser_load(parser, &doc)) {
        rc = sp_fail(err, SP_EXIT_USAGE, "%s:%lu:%lu: YAML error: %s", name,
                     (unsigned long)parser->problem_mark.line + 1,
                     (unsigned long)parser->problem_mark.column + 1,
                     parser->problem ? parser->problem : "unknown");
    } else if (!rc) {
        if (yaml_document_get_root_node(&doc))
            rc = sp_fail(err, SP_EXIT_USAGE,
                         "%s:%lu: a second YAML document: a config is one document (its keys "
                         "would be ignored); merge it into the first or remove the '---'",
                         name, (unsigned long)doc.start_mark.line + 1);
        yaml_document_delete(&doc);
    }
    if (!rc) {
        free(cfg->source);
        cfg->source = strdup(name);
    }
    return rc;
}

int config_load(config_t *cfg, const char *path, sp_err *err)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return sp_fail(err, SP_EXIT_USAGE, "%s: cannot open config: %s", path, strerror(errno));
    yaml_parser_t parser;
    yaml_parser_initialize(&parser);
    yaml_parser_set_input_file(&parser, f);
    int rc = load_parser(cfg, &parser, path, err);
    yaml_parser_delete(&parser);
    fclose(f);
    return rc;
}

int config_load_text(config_t *cfg, const char *text, const char *name, sp_err *err)
{
    yaml_parser_t parser;
    yaml_parser_initialize(&parser);
    yaml_parser_set_input_string(&parser, (const unsigned char *)text, strlen(text));
    int rc = load_parser(cfg, &parser, name, err);
    yaml_parser_delete(&parser);
    return rc;
}

int config_set(config_t *cfg, const char *assignment, sp_err *err)
{
    const char *eq = strchr(assignment, '=');
    if (!eq)
        return sp_fail(err, SP_EXIT_USAGE, "--set %s: expected section.key=value", assignment);
    char name[256];
    const key_def *k = NULL;
    if (sp_fitf(name, sizeof name, "%.*s", (int)(eq - assignment), assignment) == 0)
        k = find_key(name);
    if (!k)
        return sp_fail(err, SP_EXIT_USAGE, "--set: unknown key '%.*s' (see configs/README.md)",
                       (int)(eq - assignment), assignment);
    const char *val = eq + 1;
    origin so = {"--set", 0};
    if (k->type == K_STRING) /* taken literally: paths may hold ': ' */
        return set_scalar(cfg, k, val, 0, so, err);
    yaml_parser_t parser;
    yaml_document_t doc;
    int rc;
    yaml_parser_initialize(&parser);
    yaml_parser_set_input_string(&parser, (const unsigned char *)val, strlen(val));
    origin o = {"--set", 0};
    if (!yaml_parser_load(&parser, &doc)) {
        rc = sp_fail(err, SP_EXIT_USAGE, "--set %s: cannot parse value: %s", name,
                     parser.problem ? parser.problem : "unknown");
    } else {
        yaml_node_t *n = yaml_document_get_root_node(&doc);
        if (!n)
            rc = set_scalar(cfg, k, "", 0, o, err);
        else
            rc = set_node(cfg, k, &doc, n, o, err);
        yaml_document_delete(&doc);
    }
    yaml_parser_delete(&parser);
    return rc;
}

int config_validate(const config_t *c, sp_err *err)
{
    const char *src = c->source ? c->source : "config";
    if (!c->run_dir || !*c->run_dir)
        return sp_fail(err, SP_EXIT_USAGE, "%s: run.dir is required", src);
    if (!c->model_path || !*c->model_path)
        return sp_fail(err, SP_EXIT_USAGE, "%s: model.path is required", src);
    if (!c->data_train || !*c->data_train)
        return sp_fail(err, SP_EXIT_USAGE, "%s: data.train is required", src);
    if (c->min_lr > c->lr)
        return sp_fail(err, SP_EXIT_USAGE, "%s: train.min_lr (%g) is larger than train.lr (%g)",
                       src, c->min_lr, c->lr);
    if (c->mode == MODE_LORA && !c->lora_targets)
        return sp_fail(err, SP_EXIT_USAGE, "%s: lora.targets is empty", src);
    if (c->lora_dora && c->mode != MODE_LORA)
        return sp_fail(err, SP_EXIT_USAGE, "%s: lora.dora needs train.mode lora, not full", src);
    if (c->model_quantize == QUANT_NF4 && c->mode != MODE_LORA)
        return sp_fail(err, SP_EXIT_USAGE, "%s: model.quantize nf4 needs train.mode lora, not full",
                       src);
    if (c->mode != MODE_LORA && c->lora_init_from && *c->lora_init_from)
        return sp_fail(err, SP_EXIT_USAGE,
                       "%s: lora.init_from (%s) needs train.mode lora, not full", src,
                       c->lora_init_from);
    return 0;
}

/* ---- writing -------------------------------------------------------------- */

/* The value of key k as text: a string key's own string (whole, however
 * long), or the value written into buf[VALUE_TEXT_MAX] (a number, a word, the
 * list of targets: they fit). */
#define VALUE_TEXT_MAX 256
static const char *value_text(const config_t *cfg, const key_def *k, char *buf)
{
    const char *base = (const char *)cfg + k->offset;
    size_t n = VALUE_TEXT_MAX;
    switch (k->type) {
    case K_INT: snprintf(buf, n, "%lld", (long long)*(const int64_t *)base); break;
    case K_FLOAT: snprintf(buf, n, "%.17g", *(const double *)base); break;
    case K_BOOL: snprintf(buf, n, "%s", *(const int *)base ? "true" : "false"); break;
    case K_STRING: return *(char *const *)base ? *(char *const *)base : "";
    case K_ENUM: snprintf(buf, n, "%s", k->enums[*(const int *)base]); break;
    case K_TARGETS: {
        int64_t bits = *(const int64_t *)base;
        buf[0] = 0;
        for (int i = 0; i < TARGET_COUNT; i++)
            if (bits & (1 << i)) {
                strncat(buf, buf[0] ? "," : "", n - strlen(buf) - 1);
                strncat(buf, config_target_names[i], n - strlen(buf) - 1);
            }
        break;
    }
    }
    return buf;
}

static int emit(yaml_emitter_t *em, yaml_event_t *ev)
{
    return yaml_emitter_emit(em, ev) ? 0 : -1;
}

static int emit_scalar(yaml_emitter_t *em, const char *s, int plain_only)
{
    yaml_event_t ev;
    yaml_scalar_event_initialize(&ev, NULL, NULL, (yaml_char_t *)s, (int)strlen(s), 1,
                                 !plain_only, plain_only ? YAML_PLAIN_SCALAR_STYLE
                                                         : YAML_ANY_SCALAR_STYLE);
    return emit(em, &ev);
}

static int write_file_handler(void *data, unsigned char *buffer, size_t size)
{
    return fwrite(buffer, 1, size, (FILE *)data) == size;
}

int config_write_yaml(const config_t *cfg, FILE *f, sp_err *err)
{
    yaml_emitter_t em;
    yaml_event_t ev;
    int bad_ = 0;
    yaml_emitter_initialize(&em);
    yaml_emitter_set_output(&em, write_file_handler, f);
    yaml_stream_start_event_initialize(&ev, YAML_UTF8_ENCODING);
    bad_ |= emit(&em, &ev);
    yaml_document_start_event_initialize(&ev, NULL, NULL, NULL, 1);
    bad_ |= emit(&em, &ev);
    yaml_mapping_start_event_initialize(&ev, NULL, NULL, 1, YAML_BLOCK_MAPPING_STYLE);
    bad_ |= emit(&em, &ev);
    char section[64] = "";
    for (size_t i = 0; i < config_nkeys && !bad_; i++) {
        const key_def *k = &config_keys[i];
        const char *dot = strchr(k->name, '.');
        size_t sl = (size_t)(dot - k->name);
        if (strlen(section) != sl || strncmp(section, k->name, sl) != 0) {
            if (section[0]) {
                yaml_mapping_end_event_initialize(&ev);
                bad_ |= emit(&em, &ev);
            }
            snprintf(section, sizeof section, "%.*s", (int)sl, k->name);
            bad_ |= emit_scalar(&em, section, 1);
            yaml_mapping_start_event_initialize(&ev, NULL, NULL, 1, YAML_BLOCK_MAPPING_STYLE);
            bad_ |= emit(&em, &ev);
        }
        char buf[VALUE_TEXT_MAX];
        const char *val = value_text(cfg, k, buf);
        bad_ |= emit_scalar(&em, dot + 1, 1);
        if (k->type == K_TARGETS) { /* val is buf */
            yaml_sequence_start_event_initialize(&ev, NULL, NULL, 1, YAML_FLOW_SEQUENCE_STYLE);
            bad_ |= emit(&em, &ev);
            char *save = NULL;
            for (char *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save))
                bad_ |= emit_scalar(&em, t, 1);
            yaml_sequence_end_event_initialize(&ev);
            bad_ |= emit(&em, &ev);
        } else {
            /* strings may need quoting; numbers and words are plain */
            bad_ |= emit_scalar(&em, val, k->type != K_STRING);
        }
    }
    if (section[0]) {
        yaml_mapping_end_event_initialize(&ev);
        bad_ |= emit(&em, &ev);
    }
    yaml_mapping_end_event_initialize(&ev);
    bad_ |= emit(&em, &ev);
    yaml_document_end_event_initialize(&ev, 1);
    bad_ |= emit(&em, &ev);
    yaml_stream_end_event_initialize(&ev);
    bad_ |= emit(&em, &ev);
    int flushed = yaml_emitter_flush(&em);
    yaml_emitter_delete(&em);
    if (bad_ || !flushed)
        return sp_fail(err, SP_EXIT_OTHER, "cannot write the resolved config");
    return 0;
}

uint64_t config_math_hash(const config_t *cfg)
{
    uint64_t h = SP_FNV_INIT;
    for (size_t i = 0; i < config_nkeys; i++) {
        const key_def *k = &config_keys[i];
        if (!k->math || strcmp(k->name, "model.path") == 0)
            continue; /* the model is identified by its content, not its path */
        char buf[VALUE_TEXT_MAX];
        const char *val = value_text(cfg, k, buf);
        if (k->math == MATH_SINCE && k->def && strcmp(val, k->def) == 0)
            continue;
        h = sp_fnv1a(h, k->name, strlen(k->name) + 1);
        h = sp_fnv1a(h, val, strlen(val) + 1);
    }
    return h;
}

int config_diff_math(const config_t *a, const config_t *b, const char *skip, char *buf,
                     size_t n)
{
    int count = 0;
    buf[0] = 0;
    for (size_t i = 0; i < config_nkeys; i++) {
        const key_def *k = &config_keys[i];
        if (!k->math || strcmp(k->name, "model.path") == 0 || (skip && strcmp(k->name, skip) == 0))
            continue;
        char abuf[VALUE_TEXT_MAX], bbuf[VALUE_TEXT_MAX];
        const char *va = value_text(a, k, abuf), *vb = value_text(b, k, bbuf);
        if (strcmp(va, vb) == 0)
            continue;
        size_t len = strlen(buf); /* a message: cut to the caller's buffer */
        sp_cutf(buf + len, n - len, "%s%s (%s, now %s)", count ? ", " : "", k->name, va, vb);
        count++;
    }
    return count;
}

void config_write_reference(FILE *f)
{
    const char *types[] = {"integer", "number", "boolean", "string", "choice", "list"};
    fprintf(f, "| key | type | default | range / choices | on resume | meaning |\n");
    fprintf(f, "| --- | --- | --- | --- | --- | --- |\n");
    for (size_t i = 0; i < config_nkeys; i++) {
        const key_def *k = &config_keys[i];
        char range[256] = "";
        if (k->type == K_INT)
            snprintf(range, sizeof range, "%.0f .. %s", k->min,
                     k->max >= BIG ? "any" : "max");
        if (k->type == K_INT && k->max < BIG)
            snprintf(range, sizeof range, "%.0f .. %.0f", k->min, k->max);
        if (k->type == K_FLOAT)
            snprintf(range, sizeof range, "%g .. %g", k->min, k->max);
        if (k->type == K_ENUM)
            for (int j = 0; k->enums[j]; j++) {
                strncat(range, j ? ", " : "", sizeof range - strlen(range) - 1);
                strncat(range, k->enums[j], sizeof range - strlen(range) - 1);
            }
        fprintf(f, "| `%s` | %s | %s | %s | %s | %s |\n", k->name, types[k->type],
                k->def ? (*k->def ? k->def : "(empty)") : "**required**", range,
                k->math == MATH_CONTENT ? "same contents"
                : k->math           ? "must match"
                                    : "may change",
                k->doc);
    }
}

void config_free(config_t *cfg)
{
    for (size_t i = 0; i < config_nkeys; i++)
        if (config_keys[i].type == K_STRING) {
            char **p = (char **)((char *)cfg + config_keys[i].offset);
            free(*p);
            *p = NULL;
        }
    free(cfg->source);
    cfg->source = NULL;
}
