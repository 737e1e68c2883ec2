/* trainer/model_io_internal.h — shared by model_io.c (weights in and out)
 * and model_io_derived.c (a directory derived from a base one). Not for
 * other modules. */
#ifndef SPOTUNE_MODEL_IO_INTERNAL_H
#define SPOTUNE_MODEL_IO_INTERNAL_H

#include "model_io.h"

/* Hugging Face's torch_dtype of dtype ("bfloat16", "float16", "float32"). */
const char *model_io_torch_dtype(dtype_t dtype);
/* The model's weights (LoRA merged when merge_lora) as safetensors files of
 * at most shard_bytes each in dir, with an index when there are several. */
int model_io_save_weights(model_t *m, const char *dir, dtype_t dtype, int merge_lora,
                          size_t shard_bytes, sp_err *err);

#endif
