/* trainer/model_io.h — Hugging Face model directories in and out: loading
 * the base weights from model.safetensors or the shards named by
 * model.safetensors.index.json (memory-mapped; every tensor's presence,
 * dtype and shape checked against the config), writing a model directory in
 * the same layout (init-model, full fine-tuning, merged export), and the
 * base model's identity (a hash that a resumed LoRA run must match). */
#ifndef SPOTUNE_MODEL_IO_H
#define SPOTUNE_MODEL_IO_H

#include "model.h"

/* The largest safetensors file model_io_save writes for spotune's model
 * directories (init-model, full fine-tuning, merged export): 5 GiB, as
 * Hugging Face's save_pretrained shards by default. */
#define MODEL_IO_SHARD_BYTES ((size_t)5 << 30)

/* Loads every base (non-LoRA) parameter from dir. */
int model_io_load_base(model_t *m, const char *dir, sp_err *err);
/* Writes dir/config.json and model.safetensors (sharded above shard_bytes,
 * with model.safetensors.index.json) holding the base parameters in dtype
 * (F32, BF16 or F16). With merge_lora, LoRA updates are folded into the weights. */
int model_io_save(model_t *m, const char *dir, dtype_t dtype, int merge_lora, size_t shard_bytes,
                  sp_err *err);
/* Writes dir as a model derived from the base directory base_dir (full
 * fine-tuning, merged export), loadable without base_dir at hand: the
 * weights as model_io_save writes them (in dtype: F32, BF16 or F16), every
 * tokenizer and generation file of base_dir (model_io_is_side_file) copied,
 * and config.json last: base_dir's with every key kept and only the dtype
 * key(s) changed ("torch_dtype" and/or "dtype", as the base has them).
 * Every file is replaced by a rename, so dir may even be base_dir. */
int model_io_save_derived(model_t *m, const char *base_dir, const char *dir, dtype_t dtype,
                          int merge_lora, size_t shard_bytes, sp_err *err);
/* 1 for the file names of a model directory that model_io_save_derived
 * copies: tokenizer* (tokenizer.json, tokenizer_config.json,
 * tokenizer.model, ...), *.tiktoken, special_tokens_map.json,
 * added_tokens.json, chat_template.jinja/.json, vocab.json, vocab.txt,
 * merges.txt, spiece.model, sentencepiece.bpe.model, generation_config.json. */
int model_io_is_side_file(const char *name);
/* 16 hex digits identifying the base model: its config.json and the names,
 * shapes, dtypes and sampled bytes of its tensors. */
int model_io_identity(const char *dir, char out[17], sp_err *err);
/* The dtype a model directory stores its weights in (F32, BF16 or F16),
 * read from its first tensor; an exported model keeps it unless told. */
int model_io_weights_dtype(const char *dir, dtype_t *dt, sp_err *err);
/* The tensors of model directory dir that model m does not use (as its
 * config.json describes it: a layer past num_hidden_layers, a bias the
 * architecture has not, a stray name), which loading ignores as Hugging
 * Face does: how many, and the first of them, comma-separated, into buf
 * (buf[0] = 0 when none). Not counted: rotary_emb.inv_freq buffers, a tied
 * model's lm_head.weight, and a bitsandbytes weight's quant-state tensors. */
int model_io_unused(const model_t *m, const char *dir, char *buf, size_t n, size_t *count,
                    sp_err *err);
/* Lists the safetensors files of a model directory (index shards or the
 * single file). Caller frees each string and the array. */
int model_io_weight_files(const char *dir, char ***files, int *n, sp_err *err);

#endif
