/* Byte-level text to HDF5 datasets. */
#define _POSIX_C_SOURCE 200809L
#include "prepare_text.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "data.h"

#define MAX_DOC_BYTES 4096 /* a long paragraph-less text is cut at lines past this */

typedef struct doc_list {
    size_t *start, *len;
    size_t n, cap;
} doc_list;

static int push_doc(doc_list *d, size_t start, size_t len)
{
    if (len == 0)
        return 0;
    if (d->n == d->cap) {
        size_t cap = d->cap ? 2 * d->cap : 256;
        size_t *s = realloc(d->start, cap * sizeof *s), *l = s ? realloc(d->len, cap * sizeof *l) : NULL;
        if (!s || !l) {
            if (s)
                d->start = s;
            return -1;
        }
        d->start = s;
        d->len = l;
        d->cap = cap;
    }
    d->start[d->n] = start;
    d->len[d->n++] = len;
    return 0;
}

/* Paragraphs: runs of non-blank lines; a paragraph longer than
 * MAX_DOC_BYTES is cut at the first line end past it. */
static int split_docs(const char *text, size_t n, doc_list *d)
{
    size_t start = 0, i = 0;
    while (i < n) {
        size_t eol = i;
        while (eol < n && text[eol] != '\n')
            eol++;
        int blank = 1;
        for (size_t k = i; k < eol; k++)
            if (text[k] != ' ' && text[k] != '\t' && text[k] != '\r')
                blank = 0;
        if (blank) {
            if (push_doc(d, start, i > start ? i - start : 0))
                return -1;
            start = eol + 1;
        } else if (eol + 1 - start > MAX_DOC_BYTES) {
            if (push_doc(d, start, eol + 1 - start))
                return -1;
            start = eol + 1;
        }
        i = eol + 1;
    }
    return start < n ? push_doc(d, start, n - start) : 0;
}

static int write_split(const char *path, const char *text, const doc_list *d, const char *in_val,
                       int want_val, uint64_t *docs_out, uint64_t *tokens_out, sp_err *err)
{
    uint64_t ndoc = 0, ntok = 0;
    for (size_t i = 0; i < d->n; i++)
        if (in_val[i] == want_val) {
            ndoc++;
            ntok += d->len[i] + 2;
        }
    *docs_out = ndoc;
    *tokens_out = ntok;
    uint32_t *tok = malloc(sizeof(uint32_t) * (ntok ? ntok : 1));
    uint8_t *mask = malloc(ntok ? ntok : 1);
    uint64_t *off = malloc(sizeof(uint64_t) * (ndoc + 1));
    if (!tok || !mask || !off) {
        free(tok), free(mask), free(off);
        return sp_fail(err, SP_EXIT_OTHER, "out of memory");
    }
    uint64_t p = 0, k = 0;
    for (size_t i = 0; i < d->n; i++) {
        if (in_val[i] != want_val)
            continue;
        off[k++] = p;
        tok[p] = BYTE_BOS;
        mask[p++] = 0; /* nothing predicts the first token of a document */
        for (size_t b = 0; b < d->len[i]; b++) {
            tok[p] = (unsigned char)text[d->start[i] + b];
            mask[p++] = 1;
        }
        tok[p] = BYTE_EOS;
        mask[p++] = 1;
    }
    off[k] = p;
    int rc = dataset_write(path, tok, mask, ntok, off, ndoc, BYTE_VOCAB, BYTE_EOS,
                           "byte-level: bytes 0-255, bos 256, eos 257", err);
    free(tok), free(mask), free(off);
    return rc;
}

int prepare_text(const char *in_path, const char *out_prefix, double val_fraction, uint64_t seed,
                 prepare_text_stats *st, sp_err *err)
{
    FILE *f = fopen(in_path, "rb");
    if (!f)
        return sp_fail(err, SP_EXIT_INPUT, "%s: cannot open: %s", in_path, strerror(errno));
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *text = malloc(size > 0 ? (size_t)size : 1);
    size_t n = text ? fread(text, 1, (size_t)(size > 0 ? size : 0), f) : 0;
    fclose(f);
    if (!text)
        return sp_fail(err, SP_EXIT_OTHER, "out of memory");
    doc_list d = {0};
    int rc = split_docs(text, n, &d) ? sp_fail(err, SP_EXIT_OTHER, "out of memory") : 0;
    if (!rc && d.n == 0)
        rc = sp_fail(err, SP_EXIT_INPUT, "%s: the text is empty", in_path);
    char *in_val = calloc(d.n ? d.n : 1, 1);
    if (!rc && !in_val)
        rc = sp_fail(err, SP_EXIT_OTHER, "out of memory");
    size_t nval = 0;
    for (size_t i = 0; !rc && i < d.n; i++)
        if (val_fraction > 0 && sp_rng_uniform(seed, i) < val_fraction) {
            in_val[i] = 1;
            nval++;
        }
    /* both sides non-empty whenever a split was asked for */
    if (!rc && val_fraction > 0 && d.n >= 2 && nval == 0)
        in_val[d.n - 1] = 1, nval = 1;
    if (!rc && nval == d.n)
        rc = sp_fail(err, SP_EXIT_INPUT,
                     "%s: %zu document(s): too few to split off a validation set", in_path, d.n);
    memset(st, 0, sizeof *st);
    char *train_path = sp_strf("%s.train.h5", out_prefix);
    char *val_path = sp_strf("%s.val.h5", out_prefix);
    if (!rc && (!train_path || !val_path))
        rc = sp_fail(err, SP_EXIT_OTHER, "out of memory");
    if (!rc)
        rc = write_split(train_path, text, &d, in_val, 0, &st->train_docs, &st->train_tokens,
                         err);
    if (!rc && nval)
        rc = write_split(val_path, text, &d, in_val, 1, &st->val_docs, &st->val_tokens, err);
    free(train_path);
    free(val_path);
    free(in_val);
    free(d.start);
    free(d.len);
    free(text);
    return rc;
}
