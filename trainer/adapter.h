/* trainer/adapter.h — LoRA adapters in the PEFT layout:
 * adapter_model.safetensors (keys base_model.model.<module>.lora_A.weight
 * [r, in] and .lora_B.weight [out, r]) and adapter_config.json with the
 * fields PEFT, vLLM and SGLang read. Owns nothing beyond the call. */
#ifndef SPOTUNE_ADAPTER_H
#define SPOTUNE_ADAPTER_H

#include "model.h"

typedef struct adapter_tensor {
    const char *name; /* PEFT key */
    int64_t shape[2]; /* shape[1] == 0: a vector (DoRA's lora_magnitude_vector) */
    const float *data;
} adapter_tensor;

/* Writes LoRA tensors and the adapter_config.json of options o to dir. The
 * base model's identity recorded in the weights' metadata is base_identity
 * when given (a checkpoint's own record), else that of the directory
 * base_model_path when it is at hand, else none. */
int adapter_write(const char *dir, const model_opts *o, const char *base_model_path,
                  const char *base_identity, const adapter_tensor *t, size_t n, sp_err *err);
/* Writes the model's LoRA weights (F32 masters) and config to dir. */
int adapter_save(model_t *m, const char *dir, const char *base_model_path, sp_err *err);
/* The safetensors metadata key of the base model's identity
 * (model_io_identity), written when the base directory is at hand. */
#define ADAPTER_META_BASE "spotune_base_model"

/* trainer/adapter_load.c: the adapter in dir (as PEFT or spotune writes it)
 * into the model's LoRA weights (A and B, masters and compute copies), after
 * checking everything first: adapter_config.json readable, peft_type LORA,
 * no DoRA or other unsupported option, r, lora_alpha, use_rslora and
 * target_modules equal to the model's; the base identity the adapter
 * records (if any) equal to base_identity (unless NULL); every LoRA weight
 * present with its shape and a float dtype, and no other tensor. Errors name
 * the directory or file, the field or tensor, and both values: exit 2 for a
 * mismatch with the run's config or base model, 3 for a bad adapter. note
 * (may be NULL) receives a line for the log. */
int adapter_init_from(model_t *m, const char *dir, const char *base_identity, char *note,
                      size_t note_n, sp_err *err);
/* adapter_init_from without a base identity or note. */
int adapter_load(model_t *m, const char *dir, sp_err *err);

#endif
