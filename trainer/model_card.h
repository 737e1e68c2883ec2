/* trainer/model_card.h — the README.md model card of an adapter directory,
 * as PEFT's save_pretrained writes one (YAML front matter with base_model
 * and library_name: peft), telling what was trained: the base model, the
 * LoRA shape and targets, the steps, the final train and validation losses
 * and the datasets. Owns nothing beyond the call. */
#ifndef SPOTUNE_MODEL_CARD_H
#define SPOTUNE_MODEL_CARD_H

#include <stdint.h>

#include "model.h"

typedef struct model_card {
    const char *base_model;      /* as adapter_config.json's base_model_name_or_path */
    int64_t steps;               /* steps trained */
    double train_loss, val_loss; /* the last recorded ones; NAN: none */
    int64_t train_loss_step, val_loss_step;
    const char *train_data, *val_data; /* dataset paths; NULL or "": none */
} model_card;

/* Fills card's losses from a metrics.jsonl (the last "train" and "val"
 * records); a missing file leaves them NAN, and a line that is not JSON (one
 * cut short by a process killed while writing it) is skipped rather than
 * failing a finished run. A file that exists but cannot be read is an error
 * naming it. */
int model_card_read_metrics(model_card *card, const char *metrics_path, sp_err *err);
/* Writes dir/README.md for the LoRA options o. */
int model_card_write(const char *dir, const model_opts *o, const model_card *card, sp_err *err);

#endif
