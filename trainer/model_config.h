/* trainer/model_config.h — a Llama-family architecture as read from a Hugging
 * Face config.json (Llama, Mistral, Qwen2): sizes, RoPE (default and llama3
 * scaling), biases, tying. Fields that would change the math and are not
 * supported are refused by name. Owns nothing beyond the struct. */
#ifndef SPOTUNE_MODEL_CONFIG_H
#define SPOTUNE_MODEL_CONFIG_H

#include <stdint.h>
#include <stdio.h>

#include "../base/base.h"

enum { ROPE_DEFAULT = 0, ROPE_LLAMA3 = 1 };

/* The seven projections of a layer, in the order of config_target_names. */
enum { PROJ_Q = 0, PROJ_K, PROJ_V, PROJ_O, PROJ_GATE, PROJ_UP, PROJ_DOWN, PROJ_COUNT };

typedef struct model_config {
    char architecture[64]; /* LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM */
    char model_type[32];
    int64_t vocab, hidden, intermediate, layers, heads, kv_heads, head_dim;
    double rms_eps, rope_theta;
    int rope_type;
    double rope_factor, rope_low_freq, rope_high_freq;
    int64_t rope_original_max_pos;
    int64_t max_pos;
    int64_t sliding_window; /* 0: none */
    int tie_embeddings;
    int bias[PROJ_COUNT]; /* which projections carry a bias */
    int64_t bos_id, eos_id;
    /* quantization_config: bitsandbytes 4-bit NF4 with double quantization
     * (load_in_4bit, bnb_4bit_quant_type nf4, bnb_4bit_use_double_quant):
     * the projection weights are stored pre-quantized; 0: dense weights */
    int bnb_nf4;
} model_config_t;

/* Reads and checks MODEL_DIR/config.json (SP_EXIT_INPUT on problems). */
int model_config_load(model_config_t *mc, const char *dir, sp_err *err);
/* Writes mc as a Hugging Face config.json (torch_dtype given). */
int model_config_write(const model_config_t *mc, const char *path, const char *torch_dtype,
                       sp_err *err);
/* Parameter count of the whole model. */
int64_t model_config_params(const model_config_t *mc);
/* in/out features of projection p. */
void model_config_proj_dims(const model_config_t *mc, int p, int64_t *in, int64_t *out);
/* Built-in architectures for init-model and bench: tiny, small, llama-7b,
 * llama-13b. Returns -1 for an unknown name. */
int model_config_preset(model_config_t *mc, const char *name);
/* RoPE tables: cos, sin [T, head_dim/2] in float, as HF computes them. */
void model_config_rope_tables(const model_config_t *mc, int64_t T, float *cos_t, float *sin_t);

#endif
