/* Token datasets: windows and targets, the per-epoch permutation, the
 * integer cursor, prepare-text, and each bad input (exit code 3 with the
 * file named). */
#include <criterion/criterion.h>
#include <hdf5.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"
#include "trainer/data.h"
#include "trainer/prepare_text.h"

static char *dir;

static void setup(void)
{
    dir = tu_tempdir("data");
}

static void teardown(void)
{
    tu_rmtree(dir);
    free(dir);
}

TestSuite(data, .init = setup, .fini = teardown);

static const char *path_of(const char *name)
{
    static char p[4096];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    return p;
}

/* n tokens i mod modulo, mask 1 except every 5th; attribute vocab_size */
static void make_mod(const char *name, uint64_t n, int64_t vocab, int64_t modulo)
{
    uint32_t *t = malloc(sizeof(uint32_t) * (n ? n : 1));
    uint8_t *m = malloc(n ? n : 1);
    for (uint64_t i = 0; i < n; i++) {
        t[i] = (uint32_t)(i % (uint64_t)modulo);
        m[i] = i % 5 != 0;
    }
    uint64_t off[2] = {0, n};
    sp_err err = {0};
    cr_assert_eq(dataset_write(path_of(name), t, m, n, off, 1, vocab, 0, "test", &err), 0, "%s",
                 err.msg);
    free(t);
    free(m);
}

static void make(const char *name, uint64_t n, int64_t vocab)
{
    make_mod(name, n, vocab, vocab);
}

Test(data, windows_targets_and_masks)
{
    make("a.h5", 101, 1000);
    dataset_t d;
    sp_err err = {0};
    cr_assert_eq(dataset_open(&d, path_of("a.h5"), 10, 1000, 1, &err), 0, "%s", err.msg);
    cr_expect_eq(d.n_windows, 10, "(101 - 1) / 10");
    int32_t in[10], tg[10];
    int64_t trained;
    cr_assert_eq(dataset_read_window(&d, 3, in, tg, NULL, NULL, &trained, &err), 0);
    int64_t want_trained = 0;
    for (int t = 0; t < 10; t++) {
        cr_expect_eq(in[t], 30 + t);
        int on = (31 + t) % 5 != 0;
        cr_expect_eq(tg[t], on ? 31 + t : -1);
        want_trained += on;
    }
    cr_expect_eq(trained, want_trained);
    cr_expect_str_eq(d.tokenizer, "test");
    dataset_close(&d);
}

Test(data, each_epoch_is_a_seeded_permutation)
{
    make("p.h5", 1001, 1000);
    dataset_t d, e;
    sp_err err = {0};
    cr_assert_eq(dataset_open(&d, path_of("p.h5"), 10, 1000, 5, &err), 0);
    cr_assert_eq(dataset_open(&e, path_of("p.h5"), 10, 1000, 5, &err), 0);
    uint64_t W = d.n_windows, w, ep, first[100], same = 0;
    int seen[100];
    for (uint64_t epoch = 0; epoch < 3; epoch++) {
        memset(seen, 0, sizeof seen);
        for (uint64_t i = 0; i < W; i++) {
            cr_assert_eq(dataset_window_of(&d, epoch * W + i, &w, &ep, &err), 0);
            cr_assert_eq(ep, epoch);
            cr_assert_lt(w, W);
            seen[w]++;
            if (epoch == 0)
                first[i] = w;
            else if (epoch == 1)
                same += first[i] == w;
        }
        for (uint64_t i = 0; i < W; i++)
            cr_expect_eq(seen[i], 1, "epoch %llu window %llu seen %d times",
                         (unsigned long long)epoch, (unsigned long long)i, seen[i]);
    }
    cr_expect_lt(same, 20, "epochs 0 and 1 should differ (%llu equal)", (unsigned long long)same);
    /* an integer cursor lands anywhere directly: same window from a fresh reader */
    for (uint64_t s = 0; s < 3 * W; s += 7) {
        uint64_t a, b;
        cr_assert_eq(dataset_window_of(&d, s, &a, NULL, &err), 0);
        cr_assert_eq(dataset_window_of(&e, s, &b, NULL, &err), 0);
        cr_expect_eq(a, b);
    }
    dataset_close(&d);
    dataset_close(&e);
}

static void expect_open_error(const char *name, int64_t seq, int64_t vocab, const char *want)
{
    dataset_t d;
    sp_err err = {0};
    int rc = dataset_open(&d, path_of(name), seq, vocab, 1, &err);
    cr_expect_eq(rc, SP_EXIT_INPUT, "rc %d: %s", rc, err.msg);
    cr_expect(tu_contains(err.msg, name), "'%s' does not name the file", err.msg);
    cr_expect(tu_contains(err.msg, want), "'%s' lacks '%s'", err.msg, want);
    dataset_close(&d);
}

Test(data, token_not_below_vocab)
{
    make_mod("v.h5", 300, 250, 300); /* claims 250 ids, holds 300 */
    expect_open_error("v.h5", 10, 250, "token 250 at position 250 is not a token id of the model (0 to vocab_size - 1 = 249)");
}

/* Each part scans only its slice: with the tokens at positions 250..299 of
 * 300 out of the vocabulary, parts 0-2 of 4 (positions 0..224) pass, part 3
 * (225..299) finds position 250, and every part still knows the whole
 * dataset's windows. */
Test(data, token_scan_split_between_parts)
{
    make_mod("p4.h5", 300, 250, 300);
    for (int part = 0; part < 4; part++) {
        dataset_t d;
        sp_err err = {0};
        int rc =
            dataset_open_part(&d, path_of("p4.h5"), 10, 250, 1, DATA_PACK_STREAM, part, 4, &err);
        if (part < 3) {
            cr_expect_eq(rc, 0, "part %d: %s", part, err.msg);
            cr_expect_eq(d.n_windows, 29, "part %d", part);
        } else {
            cr_expect_eq(rc, SP_EXIT_INPUT, "part %d: rc %d", part, rc);
            cr_expect(tu_contains(err.msg, "token 250 at position 250 is not a token id of the model (0 to vocab_size - 1 = 249)"), "%s",
                      err.msg);
        }
        dataset_close(&d);
    }
    dataset_t d;
    sp_err err = {0};
    cr_expect_neq(dataset_open_part(&d, path_of("p4.h5"), 10, 250, 1, DATA_PACK_STREAM, 4, 4, &err), 0);
    cr_expect(tu_contains(err.msg, "part 4 of 4"), "%s", err.msg);
    dataset_close(&d);
}

Test(data, dataset_vocab_larger_than_model)
{
    make("vv.h5", 200, 300);
    expect_open_error("vv.h5", 10, 299, "vocab_size 300 exceeds the model's 299");
}

Test(data, empty_dataset)
{
    make("e.h5", 0, 100);
    expect_open_error("e.h5", 10, 100, "empty");
}

Test(data, too_short_for_one_window)
{
    make("s.h5", 10, 100);
    expect_open_error("s.h5", 10, 100, "too few for one window");
}

Test(data, loss_mask_length_differs)
{
    hid_t f = H5Fcreate(path_of("m.h5"), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
    hsize_t n1 = 50, n2 = 49, n3 = 2;
    uint32_t tok[50] = {0};
    uint8_t msk[49] = {0};
    uint64_t off[2] = {0, 50};
    hid_t s1 = H5Screate_simple(1, &n1, NULL), s2 = H5Screate_simple(1, &n2, NULL),
          s3 = H5Screate_simple(1, &n3, NULL);
    hid_t d1 = H5Dcreate2(f, "tokens", H5T_STD_U32LE, s1, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    hid_t d2 = H5Dcreate2(f, "loss_mask", H5T_STD_U8LE, s2, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    hid_t d3 = H5Dcreate2(f, "doc_offsets", H5T_STD_U64LE, s3, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    H5Dwrite(d1, H5T_NATIVE_UINT32, H5S_ALL, H5S_ALL, H5P_DEFAULT, tok);
    H5Dwrite(d2, H5T_NATIVE_UINT8, H5S_ALL, H5S_ALL, H5P_DEFAULT, msk);
    H5Dwrite(d3, H5T_NATIVE_UINT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, off);
    H5Dclose(d1), H5Dclose(d2), H5Dclose(d3), H5Sclose(s1), H5Sclose(s2), H5Sclose(s3);
    H5Fclose(f);
    expect_open_error("m.h5", 10, 100, "/loss_mask has 49 entries but /tokens has 50");
}

/* 200 tokens (i mod 90) stored as file type ftype, value v at position at;
 * all in the loss */
static void make_typed(const char *name, hid_t ftype, int64_t v, int at)
{
    hid_t f = H5Fcreate(path_of(name), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
    hsize_t n1 = 200, n3 = 2;
    int64_t tok[200];
    uint8_t msk[200];
    uint64_t off[2] = {0, 200};
    for (int i = 0; i < 200; i++)
        tok[i] = i % 90, msk[i] = 1;
    tok[at] = v;
    hid_t s1 = H5Screate_simple(1, &n1, NULL), s3 = H5Screate_simple(1, &n3, NULL);
    hid_t d1 = H5Dcreate2(f, "tokens", ftype, s1, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    hid_t d2 = H5Dcreate2(f, "loss_mask", H5T_STD_U8LE, s1, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    hid_t d3 = H5Dcreate2(f, "doc_offsets", H5T_STD_U64LE, s3, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    cr_assert_geq(H5Dwrite(d1, H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, tok), 0);
    H5Dwrite(d2, H5T_NATIVE_UINT8, H5S_ALL, H5S_ALL, H5P_DEFAULT, msk);
    H5Dwrite(d3, H5T_NATIVE_UINT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, off);
    H5Dclose(d1), H5Dclose(d2), H5Dclose(d3), H5Sclose(s1), H5Sclose(s3);
    hid_t sa = H5Screate(H5S_SCALAR);
    long long attrs[2] = {100, 0}; /* vocab_size, eos_id */
    const char *names[2] = {"vocab_size", "eos_id"};
    for (int i = 0; i < 2; i++) {
        hid_t a = H5Acreate2(f, names[i], H5T_STD_I64LE, sa, H5P_DEFAULT, H5P_DEFAULT);
        H5Awrite(a, H5T_NATIVE_LLONG, &attrs[i]);
        H5Aclose(a);
    }
    H5Sclose(sa);
    H5Fclose(f);
}

/* A signed /tokens (int32, as numpy writes a plain int array) with a
 * negative id, or an int64 one beyond 32 bits, is refused by value and
 * position: the run reads tokens unsigned, which would make -7 a 0 and
 * 2^32 + 5 a 5 and train on them silently. The same files with valid ids
 * open. */
Test(data, negative_or_wide_token_ids_are_refused)
{
    make_typed("neg.h5", H5T_STD_I32LE, -7, 3);
    expect_open_error("neg.h5", 10, 100, "token -7 at position 3 is not a token id of the model "
                                         "(0 to vocab_size - 1 = 99)");
    make_typed("wide.h5", H5T_STD_I64LE, (int64_t)1 << 32 | 5, 150);
    expect_open_error("wide.h5", 10, 100, "token 4294967301 at position 150 is not a token id");
    make_typed("ok.h5", H5T_STD_I32LE, 89, 3);
    dataset_t d;
    sp_err err = {0};
    cr_expect_eq(dataset_open(&d, path_of("ok.h5"), 10, 100, 1, &err), 0, "%s", err.msg);
    dataset_close(&d);
}

Test(data, missing_dataset_and_not_hdf5)
{
    hid_t f = H5Fcreate(path_of("x.h5"), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
    H5Fclose(f);
    expect_open_error("x.h5", 10, 100, "dataset /tokens is missing");
    tu_write_file(path_of("t.h5"), "this is text, not HDF5\n");
    expect_open_error("t.h5", 10, 100, "not an HDF5 file");
    expect_open_error("absent.h5", 10, 100, "cannot read the dataset file: No such file or directory");
}

Test(data, prepare_text_paragraphs_and_split)
{
    const char *txt = path_of("in.txt");
    FILE *f = fopen(txt, "w");
    for (int i = 0; i < 40; i++)
        fprintf(f, "paragraph %d line one\nline two\n\n", i);
    fclose(f);
    char prefix[4096];
    snprintf(prefix, sizeof prefix, "%s/out", dir);
    prepare_text_stats st;
    sp_err err = {0};
    cr_assert_eq(prepare_text(txt, prefix, 0.25, 3, &st, &err), 0, "%s", err.msg);
    cr_expect_eq(st.train_docs + st.val_docs, 40);
    cr_expect_gt(st.val_docs, 3);
    cr_expect_gt(st.train_docs, 20);
    dataset_t d;
    char p[4200];
    snprintf(p, sizeof p, "%s.train.h5", prefix);
    cr_assert_eq(dataset_open(&d, p, 8, BYTE_VOCAB, 1, &err), 0, "%s", err.msg);
    cr_expect_eq(d.n_docs, st.train_docs);
    cr_expect_eq(d.n_tokens, st.train_tokens);
    cr_expect_eq(d.eos_id, BYTE_EOS);
    int32_t in[8], tg[8];
    cr_assert_eq(dataset_read_window(&d, 0, in, tg, NULL, NULL, NULL, &err), 0);
    cr_expect_eq(in[0], BYTE_BOS, "documents start with bos");
    cr_expect_eq(in[1], 'p');
    cr_expect_eq(tg[0], 'p', "bytes are trained");
    dataset_close(&d);
    /* empty text is an error */
    tu_write_file(txt, "\n\n  \n");
    sp_err_clear(&err);
    cr_expect_eq(prepare_text(txt, prefix, 0.1, 3, &st, &err), SP_EXIT_INPUT);
    cr_expect(tu_contains(err.msg, "empty"));
    /* an output directory that does not exist: the reason is named */
    tu_write_file(txt, "some text\n");
    sp_err_clear(&err);
    cr_expect_neq(prepare_text(txt, path_of("no-such-dir/out"), 0.0, 3, &st, &err), 0);
    cr_expect(tu_contains(err.msg, "no-such-dir/out") &&
                  tu_contains(err.msg, "No such file or directory"),
              "%s", err.msg);
}

/* ---- data.packing ---------------------------------------------------------------- */

/* Documents of the given token counts; token i is i + 1 (so a slot names
 * the stream position it holds; padding is eos 0), loss_mask 0 at every
 * 7th position. */
static void make_docs(const char *name, const uint64_t *lens, int nd)
{
    uint64_t n = 0, *off = malloc(sizeof(uint64_t) * (size_t)(nd + 1));
    off[0] = 0;
    for (int k = 0; k < nd; k++)
        off[k + 1] = off[k] + lens[k];
    n = off[nd];
    uint32_t *t = malloc(sizeof(uint32_t) * n);
    uint8_t *m = malloc(n);
    for (uint64_t i = 0; i < n; i++) {
        t[i] = (uint32_t)(i + 1);
        m[i] = i % 7 != 3;
    }
    sp_err err = {0};
    cr_assert_eq(dataset_write(path_of(name), t, m, n, off, (uint64_t)nd, (int64_t)n + 1, 0,
                               "test", &err),
                 0, "%s", err.msg);
    free(off), free(t), free(m);
}

/* Reads every window of a packed layout and checks what data.packing
 * promises, from the tokens alone: every prediction inside a document
 * (position i predicts i + 1, both in one document) is in exactly one
 * slot, none crosses documents; each piece's slots hold consecutive
 * positions, its positions start at 0 and its seg is its first slot; a
 * piece starts at a document's start unless its document is longer than T
 * (then at a multiple of T into it); a document of at most T predictions
 * is never split; padding is input 0, target -1, after the pieces;
 * targets follow loss_mask. Returns the windows. */
static uint64_t check_layout(const char *name, const uint64_t *lens, int nd, int64_t T,
                             int packing)
{
    dataset_t d;
    sp_err err = {0};
    uint64_t n = 0;
    for (int k = 0; k < nd; k++)
        n += lens[k];
    cr_assert_eq(dataset_open_part(&d, path_of(name), T, (int64_t)n + 1, 1, packing, 0, 1, &err), 0,
                 "%s", err.msg);
    uint64_t *doc = malloc(sizeof(uint64_t) * n), *start = malloc(sizeof(uint64_t) * (size_t)nd);
    for (int k = 0, i = 0; k < nd; k++) {
        start[k] = (uint64_t)i;
        for (uint64_t j = 0; j < lens[k]; j++)
            doc[i++] = (uint64_t)k;
    }
    int *seen = calloc(n, sizeof(int));
    uint64_t *win_of = calloc(n, sizeof(uint64_t));
    int32_t *in = malloc(sizeof(int32_t) * (size_t)T), *tg = malloc(sizeof(int32_t) * (size_t)T);
    int32_t *pos = malloc(sizeof(int32_t) * (size_t)T), *seg = malloc(sizeof(int32_t) * (size_t)T);
    uint64_t predictions = 0;
    for (uint64_t w = 0; w < d.n_windows; w++) {
        int64_t trained = -1, count = 0;
        cr_assert_eq(dataset_read_window(&d, w, in, tg, pos, seg, &trained, &err), 0, "%s",
                     err.msg);
        int pieces = 0, padding = 0;
        for (int64_t t = 0; t < T; t++) {
            cr_assert(seg[t] >= 0 && seg[t] <= t && pos[t] == t - seg[t],
                      "%s window %llu slot %lld: seg %d pos %d", name, (unsigned long long)w,
                      (long long)t, seg[t], pos[t]);
            if (in[t] == 0) { /* padding: the rest of the window */
                padding = 1;
                cr_expect_eq(tg[t], -1, "padding trains");
                continue;
            }
            cr_assert(!padding, "%s window %llu: a token after padding", name,
                      (unsigned long long)w);
            uint64_t i = (uint64_t)in[t] - 1, k = doc[i];
            cr_assert(i + 1 < n && doc[i + 1] == k, "%s: position %llu predicts across documents",
                      name, (unsigned long long)i);
            cr_expect_eq(tg[t], i % 7 != 2 ? (int32_t)(i + 2) : -1, "target of position %llu",
                         (unsigned long long)i);
            count += tg[t] >= 0;
            seen[i]++;
            win_of[i] = w;
            predictions++;
            if (seg[t] == t) { /* a piece starts */
                pieces++;
                uint64_t into = i - start[k];
                cr_expect(into == 0 || (lens[k] - 1 > (uint64_t)T && into % (uint64_t)T == 0),
                          "%s: a piece starts %llu tokens into document %llu of %llu", name,
                          (unsigned long long)into, (unsigned long long)k,
                          (unsigned long long)lens[k]);
            } else {
                cr_expect_eq((uint64_t)in[t - 1], i, "slots of a piece are consecutive");
            }
        }
        cr_expect_eq(trained, count, "trained count of window %llu", (unsigned long long)w);
        if (packing == DATA_PACK_PAD)
            cr_expect_eq(pieces, 1, "pad: window %llu holds %d pieces", (unsigned long long)w,
                         pieces);
    }
    for (uint64_t i = 0; i + 1 < n; i++)
        cr_expect_eq(seen[i], doc[i + 1] == doc[i] ? 1 : 0, "%s: position %llu seen %d times",
                     name, (unsigned long long)i, seen[i]);
    for (int k = 0; k < nd; k++) /* short documents whole, in one window */
        for (uint64_t i = start[k]; lens[k] >= 2 && lens[k] - 1 <= (uint64_t)T &&
                                    i + 1 < start[k] + lens[k];
             i++)
            cr_expect_eq(win_of[i], win_of[start[k]], "document %d split", k);
    cr_expect_eq(predictions, d.predictions);
    free(doc), free(start), free(seen), free(win_of), free(in), free(tg), free(pos), free(seg);
    uint64_t W = d.n_windows;
    dataset_close(&d);
    return W;
}

static const uint64_t doc_lens[] = {4, 1, 6, 12, 3, 2, 1, 5, 16, 6, 7, 2};
#define N_DOCS (int)(sizeof doc_lens / sizeof doc_lens[0])

Test(data, packing_documents_whole_attending_to_themselves)
{
    make_docs("docs.h5", doc_lens, N_DOCS);
    uint64_t W = check_layout("docs.h5", doc_lens, N_DOCS, 5, DATA_PACK_DOCUMENTS);
    /* fewer windows than one document each: short documents share windows */
    cr_expect_lt(W, check_layout("docs.h5", doc_lens, N_DOCS, 5, DATA_PACK_PAD));
    check_layout("docs.h5", doc_lens, N_DOCS, 8, DATA_PACK_DOCUMENTS);
    check_layout("docs.h5", doc_lens, N_DOCS, 15, DATA_PACK_DOCUMENTS); /* one split: 16 */
    check_layout("docs.h5", doc_lens, N_DOCS, 64, DATA_PACK_DOCUMENTS);
}

Test(data, packing_pad_one_document_per_window)
{
    make_docs("pad.h5", doc_lens, N_DOCS);
    /* T = 5: every document of more than 1 token, in ceil((len - 1) / 5) windows */
    uint64_t want = 0;
    for (int k = 0; k < N_DOCS; k++)
        want += doc_lens[k] > 1 ? (doc_lens[k] - 1 + 4) / 5 : 0;
    cr_expect_eq(check_layout("pad.h5", doc_lens, N_DOCS, 5, DATA_PACK_PAD), want);
    check_layout("pad.h5", doc_lens, N_DOCS, 11, DATA_PACK_PAD);
}

/* A stream window read with positions and segments: t and 0. */
Test(data, stream_windows_have_plain_positions)
{
    make("s.h5", 101, 1000);
    dataset_t d;
    sp_err err = {0};
    cr_assert_eq(dataset_open(&d, path_of("s.h5"), 10, 1000, 1, &err), 0, "%s", err.msg);
    int32_t in[10], tg[10], pos[10], seg[10];
    cr_assert_eq(dataset_read_window(&d, 2, in, tg, pos, seg, NULL, &err), 0, "%s", err.msg);
    for (int t = 0; t < 10; t++) {
        cr_expect_eq(pos[t], t);
        cr_expect_eq(seg[t], 0);
        cr_expect_eq(in[t], 20 + t);
    }
    dataset_close(&d);
}

Test(data, packing_needs_a_document_of_two_tokens)
{
    uint64_t lens[] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
    make_docs("ones.h5", lens, 12);
    dataset_t d;
    sp_err err = {0};
    int rc = dataset_open_part(&d, path_of("ones.h5"), 4, 100, 1, DATA_PACK_DOCUMENTS, 0, 1, &err);
    cr_expect_eq(rc, SP_EXIT_INPUT, "rc %d: %s", rc, err.msg);
    cr_expect(tu_contains(err.msg, "ones.h5") && tu_contains(err.msg, "no document has two tokens"),
              "%s", err.msg);
    dataset_close(&d);
}
