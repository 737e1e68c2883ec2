/* trainer/adapter.h — LoRA adapters in the PEFT layout:
 * adapter_model.safetensors (keys base_model.model.<module>.lora_A.weight
 * [r, in] and .lora_B.weight [out, r]) and adapter_config.json with the
 * fields PEFT, vLLM and SGLang read. Owns nothing beyond the call. */
#ifndef SPOTUNE_ADAPTER_H
#define SPOTUNE_ADAPTER_H

#include "model.h"

typedef struct adapter_tensor {
    const char *name; /* PEFT key */
    int64_t shape[2];
    const float *data;
} adapter_tensor;

/* Writes LoRA tensors and the adapter_config.json of options o to dir. */
int adapter_write(const char *dir, const model_opts *o, const char *base_model_path,
                  const adapter_tensor *t, size_t n, sp_err *err);
/* Writes the model's LoRA weights (F32 masters) and config to dir. */
int adapter_save(model_t *m, const char *dir, const char *base_model_path, sp_err *err);
/* Loads every LoRA weight of the model from dir/adapter_model.safetensors;
 * checks r, alpha, targets and rslora in adapter_config.json against the
 * model. */
int adapter_load(model_t *m, const char *dir, sp_err *err);

#endif
