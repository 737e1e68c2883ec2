/* trainer/data.h — the token dataset (one HDF5 file: /tokens uint32,
 * /loss_mask uint8, /doc_offsets uint64; attributes vocab_size, eos_id,
 * tokenizer), cut into windows of seq_len predictions, visited in a
 * permutation fixed by (seed, epoch). A position in the stream of samples is
 * one integer (the global sample index): sample s is window
 * perm_{s / W}[s % W]. Owns the open file and the current epoch's
 * permutation. */
#ifndef SPOTUNE_DATA_H
#define SPOTUNE_DATA_H

#include <stdint.h>

#include "../base/base.h"

/* How windows are made of the documents (data.packing, config.h):
 * DATA_PACK_STREAM: window w is tokens [w*T, w*T + T] of the one stream;
 * attention and the predictions cross document boundaries.
 * DATA_PACK_DOCUMENTS: whole documents, in file order, filled into windows
 * of T predictions; a document that does not fit the rest of a window
 * starts the next one (the rest is padding), one longer than T is split
 * into pieces of T (and a last shorter piece). Each piece attends only to
 * itself, its positions start at 0, and its last token predicts nothing.
 * DATA_PACK_PAD: one document (or piece of T) per window, padded.
 * Padding: input eos_id, target -1 (no loss), attending only to padding. */
enum { DATA_PACK_STREAM = 0, DATA_PACK_DOCUMENTS = 1, DATA_PACK_PAD = 2 };
extern const char *const dataset_packing_names[]; /* "stream", "documents", "pad" */

typedef struct dataset {
    char *path;
    int64_t file, tokens, mask; /* HDF5 handles */
    uint64_t n_tokens, n_docs, n_windows;
    int64_t vocab_size, eos_id;
    char tokenizer[256];
    int64_t seq_len;
    uint64_t seed;
    uint64_t perm_epoch; /* epoch whose permutation is in perm (UINT64_MAX: none) */
    uint64_t *perm;
    int packing;          /* DATA_PACK_* */
    uint64_t *doc_off;    /* packed: the n_docs + 1 document offsets */
    uint64_t *win;        /* packed: window w predicts from token win[2w] up to win[2w+1] */
    uint64_t predictions; /* packed: trained-or-masked predictions in all windows (no padding) */
} dataset_t;

/* Opens and checks path: the three datasets, their lengths, doc_offsets
 * monotone and ending at n, every token < model_vocab (scanned), at least
 * one window of seq_len. Errors are SP_EXIT_INPUT and name the file. */
int dataset_open(dataset_t *d, const char *path, int64_t seq_len, int64_t model_vocab,
                 uint64_t seed, sp_err *err);
/* The same with windows laid out by `packing` (DATA_PACK_*; dataset_open:
 * stream), and of the token scan only part `part` of `parts` (a contiguous
 * slice): the ranks of a job each scan their slice, and an error on any of
 * them ends the job, so the file is checked whole while each rank reads 1/N.
 * Packed, a dataset with no document of two tokens is refused
 * (SP_EXIT_INPUT, naming the file); one shorter than a window is not. */
int dataset_open_part(dataset_t *d, const char *path, int64_t seq_len, int64_t model_vocab,
                      uint64_t seed, int packing, int part, int parts, sp_err *err);
void dataset_close(dataset_t *d);
/* 16 hex digits identifying the dataset file path by its content: its
 * length, document count, vocab_size and eos_id, and 64 evenly spaced runs
 * of 64 tokens with their loss_mask and 64 document offsets, read as
 * stored. A checkpoint records it, and a resume whose data.train holds
 * other contents than the checkpoint's run read is refused (the windows and
 * their order would be others). Errors name the file (SP_EXIT_INPUT). */
int dataset_identity(const char *path, char out[17], sp_err *err);
/* Window index of global sample s (and its epoch). */
int dataset_window_of(dataset_t *d, uint64_t sample, uint64_t *window, uint64_t *epoch,
                      sp_err *err);
/* Reads window w: inputs[t] = tokens[w*T + t], targets[t] = tokens[w*T + t + 1]
 * or -1 where that token's loss_mask is 0 (stream; packed windows as the
 * layout above says). pos[t] is the token's position in its document (its
 * RoPE position) and seg[t] the index in the window of its document's first
 * token (attention reaches back to it and no further): t and 0 in a
 * stream. pos and seg may be NULL (not wanted), only in a stream. Returns
 * the trained targets. A loss_mask value other than 0 or 1 is an error
 * (SP_EXIT_INPUT). */
int dataset_read_window(dataset_t *d, uint64_t w, int32_t *inputs, int32_t *targets,
                        int32_t *pos, int32_t *seg, int64_t *trained, sp_err *err);

/* Writes a dataset file (used by prepare-text and the tests). */
int dataset_write(const char *path, const uint32_t *tokens, const uint8_t *mask, uint64_t n,
                  const uint64_t *doc_offsets, uint64_t n_docs, int64_t vocab_size,
                  int64_t eos_id, const char *tokenizer, sp_err *err);

#endif
