/* trainer/prepare_text.h — byte-level tokenization of a text file into the
 * dataset format: each paragraph (text between blank lines) a document of
 * [bos] + bytes + [eos]; bos 256, eos 257, vocabulary 258. Documents are
 * split between train and validation by a seeded hash. */
#ifndef SPOTUNE_PREPARE_TEXT_H
#define SPOTUNE_PREPARE_TEXT_H

#include <stdint.h>

#include "../base/base.h"

#define BYTE_BOS 256
#define BYTE_EOS 257
#define BYTE_VOCAB 258

typedef struct prepare_text_stats {
    uint64_t train_docs, val_docs, train_tokens, val_tokens;
} prepare_text_stats;

int prepare_text(const char *in_path, const char *out_prefix, double val_fraction, uint64_t seed,
                 prepare_text_stats *stats, sp_err *err);

#endif
