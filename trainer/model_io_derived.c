/* A model directory derived from a base one (the merged export, a full
 * fine-tune's model/): the base's config.json with only the dtype changed,
 * and its tokenizer and generation files copied beside the weights. */
#define _GNU_SOURCE
#include "model_io_internal.h"

#include <dirent.h>
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* Writes text to path through path.tmp and a rename. */
static int write_atomic(const char *path, const char *text, size_t len, sp_err *err)
{
    char *tmp = sp_strf("%s.tmp", path);
    if (!tmp)
        return sp_fail(err, SP_EXIT_OTHER, "out of memory");
    FILE *f = fopen(tmp, "wb");
    int ok = f && fwrite(text, 1, len, f) == len;
    if (f && fclose(f) != 0)
        ok = 0;
    int rc = ok && rename(tmp, path) == 0
                 ? 0
                 : sp_fail(err, SP_EXIT_OTHER, "%s: cannot write: %s", path, strerror(errno));
    if (rc)
        unlink(tmp);
    free(tmp);
    return rc;
}

/* A real as Python's repr writes it (json.dumps does): the fewest digits
 * that read back as the same double, fixed notation for exponents -4 to 15
 * (with ".0" when integral), else d.ddde-XX. */
static void put_real(FILE *f, double x)
{
    char e_form[40];
    int p = 1;
    for (; p < 17; p++) {
        snprintf(e_form, sizeof e_form, "%.*e", p - 1, x);
        if (strtod(e_form, NULL) == x)
            break;
    }
    snprintf(e_form, sizeof e_form, "%.*e", p - 1, x);
    int e = atoi(strchr(e_form, 'e') + 1);
    if (e < -4 || e >= 16) {
        fputs(e_form, f);
        return;
    }
    char fixed[400];
    snprintf(fixed, sizeof fixed, "%.*f", p - 1 - e > 0 ? p - 1 - e : 0, x);
    fprintf(f, "%s%s", fixed, strchr(fixed, '.') ? "" : ".0");
}

/* A string as Python's json.dumps writes it (ensure_ascii): printable ASCII
 * as is but for " and backslash, the short escapes, everything else as a
 * backslash-u escape of 4 lower-case hex digits (UTF-8 decoded, surrogate
 * pairs above U+FFFF). s is valid UTF-8:
 * jansson checked it when it read the file. */
static void put_str(FILE *f, const char *s, size_t n)
{
    fputc('"', f);
    for (size_t i = 0; i < n;) {
        unsigned char c = (unsigned char)s[i];
        const char *esc = c == '"' ? "\\\"" : c == '\\' ? "\\\\" : c == '\n' ? "\\n"
                        : c == '\r' ? "\\r" : c == '\t' ? "\\t" : c == '\b' ? "\\b"
                        : c == '\f' ? "\\f" : NULL;
        if (esc) {
            fputs(esc, f);
            i++;
            continue;
        }
        if (c >= 0x20 && c < 0x7f) {
            fputc(c, f);
            i++;
            continue;
        }
        uint32_t cp = c;
        int len = c < 0x80 ? 1 : c < 0xe0 ? 2 : c < 0xf0 ? 3 : 4;
        if (len > 1)
            cp = c & (0x3f >> (len - 1));
        for (int k = 1; k < len && i + (size_t)k < n; k++)
            cp = (cp << 6) | ((unsigned char)s[i + (size_t)k] & 0x3f);
        i += (size_t)len;
        if (cp > 0xffff) {
            cp -= 0x10000;
            fprintf(f, "\\u%04x\\u%04x", 0xd800 + (unsigned)(cp >> 10),
                    0xdc00 + (unsigned)(cp & 0x3ff));
        } else {
            fprintf(f, "\\u%04x", (unsigned)cp);
        }
    }
    fputc('"', f);
}

/* j as transformers writes config.json (json.dumps(indent=2), ASCII only)
 * but in j's own key order. */
static void put_json(FILE *f, json_t *j, int depth)
{
    if (json_is_object(j) || json_is_array(j)) {
        int obj = json_is_object(j);
        size_t n = obj ? json_object_size(j) : json_array_size(j), i = 0;
        if (n == 0) {
            fputs(obj ? "{}" : "[]", f);
            return;
        }
        fputc(obj ? '{' : '[', f);
        if (obj) {
            const char *k;
            json_t *v;
            json_object_foreach(j, k, v)
            {
                fprintf(f, "%s\n%*s", i++ ? "," : "", 2 * (depth + 1), "");
                put_str(f, k, strlen(k));
                fputs(": ", f);
                put_json(f, v, depth + 1);
            }
        } else {
            for (; i < n; i++) {
                fprintf(f, "%s\n%*s", i ? "," : "", 2 * (depth + 1), "");
                put_json(f, json_array_get(j, i), depth + 1);
            }
        }
        fprintf(f, "\n%*s%c", 2 * depth, "", obj ? '}' : ']');
    } else if (json_is_real(j)) {
        put_real(f, json_real_value(j));
    } else if (json_is_string(j)) {
        put_str(f, json_string_value(j), json_string_length(j));
    } else {
        char *s = json_dumps(j, JSON_ENCODE_ANY | JSON_ENSURE_ASCII);
        fputs(s ? s : "null", f);
        free(s);
    }
}

/* dir/config.json: base_dir's config.json with every key kept, in its order,
 * and only the dtype changed: "torch_dtype" and "dtype", whichever the base
 * has (transformers < 5 writes the first, >= 5 the second); "torch_dtype"
 * when it has neither. A base's quantization_config (bitsandbytes NF4) is
 * dropped: the weights written are dense. */
static int write_config_like(const char *base_dir, const char *dir, dtype_t dtype, sp_err *err)
{
    char *src = sp_strf("%s/config.json", base_dir), *dst = sp_strf("%s/config.json", dir);
    json_error_t je;
    json_t *root = src && dst ? json_load_file(src, 0, &je) : NULL;
    char *text = NULL;
    int rc = 0;
    if (!src || !dst)
        rc = sp_fail(err, SP_EXIT_OTHER, "out of memory");
    else if (!root)
        rc = sp_fail(err, SP_EXIT_INPUT, "%s: %s", src, je.text);
    else if (!json_is_object(root))
        rc = sp_fail(err, SP_EXIT_INPUT, "%s: not a JSON object", src);
    if (!rc) {
        json_t *name = json_string(model_io_torch_dtype(dtype));
        int has_torch = json_object_get(root, "torch_dtype") != NULL;
        int has_dtype = json_object_get(root, "dtype") != NULL;
        if (has_torch || !has_dtype)
            json_object_set(root, "torch_dtype", name);
        if (has_dtype)
            json_object_set(root, "dtype", name);
        json_decref(name);
        json_object_del(root, "quantization_config");
        /* as transformers writes it, so that a diff against the base shows the
         * dtype alone: json.dumps(indent=2) and a newline at the end */
        size_t len = 0;
        FILE *f = open_memstream(&text, &len);
        if (f) {
            put_json(f, root, 0);
            fputc('\n', f);
        }
        if (!f || fclose(f) != 0 || !text)
            rc = sp_fail(err, SP_EXIT_OTHER, "out of memory");
        else
            rc = write_atomic(dst, text, len, err);
    }
    free(text);
    json_decref(root);
    free(src);
    free(dst);
    return rc;
}

/* The files of a model directory that are not weights or config.json but
 * that a loader needs beside them: the tokenizer (every format transformers
 * reads) and the generation defaults. */
int model_io_is_side_file(const char *name)
{
    static const char *const exact[] = {
        "generation_config.json", "special_tokens_map.json", "added_tokens.json",
        "chat_template.jinja",    "chat_template.json",      "vocab.json",
        "vocab.txt",              "merges.txt",              "spiece.model",
        "sentencepiece.bpe.model"};
    for (size_t i = 0; i < sizeof exact / sizeof exact[0]; i++)
        if (strcmp(name, exact[i]) == 0)
            return 1;
    size_t n = strlen(name);
    /* tokenizer.json, tokenizer_config.json, tokenizer.model, tokenizer.tiktoken, ... */
    return strncmp(name, "tokenizer", 9) == 0 ||
           (n > 9 && strcmp(name + n - 9, ".tiktoken") == 0);
}

static int copy_file(const char *src, const char *dst, sp_err *err)
{
    FILE *in = fopen(src, "rb");
    if (!in)
        return sp_fail(err, SP_EXIT_INPUT, "%s: cannot open: %s", src, strerror(errno));
    char *tmp = sp_strf("%s.tmp", dst);
    FILE *out = tmp ? fopen(tmp, "wb") : NULL;
    int rc = 0;
    if (!out) {
        rc = sp_fail(err, SP_EXIT_OTHER, "%s: cannot write: %s", tmp ? tmp : dst,
                     strerror(errno));
    } else {
        char buf[1 << 16];
        size_t got;
        while (!rc && (got = fread(buf, 1, sizeof buf, in)) > 0)
            if (fwrite(buf, 1, got, out) != got)
                rc = sp_fail(err, SP_EXIT_OTHER, "%s: cannot write: %s", tmp, strerror(errno));
        if (!rc && ferror(in))
            rc = sp_fail(err, SP_EXIT_INPUT, "%s: cannot read", src);
        if (fclose(out) != 0 && !rc)
            rc = sp_fail(err, SP_EXIT_OTHER, "%s: cannot write: %s", tmp, strerror(errno));
        if (!rc && rename(tmp, dst) != 0)
            rc = sp_fail(err, SP_EXIT_OTHER, "%s: cannot write: %s", dst, strerror(errno));
        if (rc)
            unlink(tmp);
    }
    fclose(in);
    free(tmp);
    return rc;
}

/* Copies the side files of base_dir (model_io_is_side_file) into dir. */
static int copy_side_files(const char *base_dir, const char *dir, sp_err *err)
{
    DIR *d = opendir(base_dir);
    if (!d)
        return sp_fail(err, SP_EXIT_INPUT, "%s: cannot list: %s", base_dir, strerror(errno));
    int rc = 0;
    struct dirent *de;
    while (!rc && (de = readdir(d)) != NULL) {
        if (!model_io_is_side_file(de->d_name))
            continue;
        char *src = sp_strf("%s/%s", base_dir, de->d_name);
        char *dst = sp_strf("%s/%s", dir, de->d_name);
        struct stat sb;
        if (!src || !dst)
            rc = sp_fail(err, SP_EXIT_OTHER, "out of memory");
        else if (stat(src, &sb) == 0 && S_ISREG(sb.st_mode))
            rc = copy_file(src, dst, err);
        free(src);
        free(dst);
    }
    closedir(d);
    return rc;
}

int model_io_save_derived(model_t *m, const char *base_dir, const char *dir, dtype_t dtype,
                          int merge_lora, size_t shard_bytes, sp_err *err)
{
    /* dir may be base_dir itself (a run whose model.path is its own model/):
     * the base's config.json and side files are read whole before each is
     * replaced by a rename, and its weights were copied at load */
    if (sp_mkdir_p(dir) != 0)
        return sp_fail(err, SP_EXIT_OTHER, "%s: cannot create: %s", dir, strerror(errno));
    /* config.json last: a directory with one holds a whole model */
    int rc = model_io_save_weights(m, dir, dtype, merge_lora, shard_bytes, err);
    if (!rc)
        rc = copy_side_files(base_dir, dir, err);
    return rc ? rc : write_config_like(base_dir, dir, dtype, err);
}
