/* config.json reading (jansson), presets and RoPE tables. */
#define _POSIX_C_SOURCE 200809L
#include "model_config.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *const arch_names[][2] = {
    {"LlamaForCausalLM", "llama"},
    {"MistralForCausalLM", "mistral"},
    {"Qwen2ForCausalLM", "qwen2"},
};

static int get_int(json_t *o, const char *k, int64_t def, int64_t *out)
{
    json_t *v = json_object_get(o, k);
    if (!v || json_is_null(v)) {
        *out = def;
        return 0;
    }
    if (json_is_array(v) && json_array_size(v) > 0)
        v = json_array_get(v, 0); /* eos_token_id may be a list */
    if (!json_is_integer(v))
        return -1;
    *out = json_integer_value(v);
    return 0;
}

static int get_num(json_t *o, const char *k, double def, double *out)
{
    json_t *v = json_object_get(o, k);
    if (!v || json_is_null(v)) {
        *out = def;
        return 0;
    }
    if (!json_is_number(v))
        return -1;
    *out = json_number_value(v);
    return 0;
}

static int get_bool(json_t *o, const char *k, int def)
{
    json_t *v = json_object_get(o, k);
    if (!v || json_is_null(v))
        return def;
    return json_is_true(v);
}

static int read_rope(model_config_t *mc, json_t *root, const char *path, sp_err *err)
{
    /* transformers >= 5 writes rope_parameters (with rope_theta inside);
     * older versions rope_theta at the top and rope_scaling (or null). */
    const char *rp_name = "rope_parameters";
    json_t *rp = json_object_get(root, rp_name);
    if (!rp || json_is_null(rp))
        rp = json_object_get(root, rp_name = "rope_scaling");
    if (get_num(root, "rope_theta", 10000.0, &mc->rope_theta))
        return sp_fail(err, SP_EXIT_INPUT, "%s: rope_theta is not a number", path);
    mc->rope_type = ROPE_DEFAULT;
    if (rp && !json_is_null(rp) && !json_is_object(rp))
        return sp_fail(err, SP_EXIT_INPUT, "%s: %s is not an object", path, rp_name);
    if (rp && json_object_get(rp, "rope_theta") &&
        get_num(rp, "rope_theta", mc->rope_theta, &mc->rope_theta))
        return sp_fail(err, SP_EXIT_INPUT, "%s: %s.rope_theta is not a number", path, rp_name);
    /* the base of the rotary frequencies theta^(-2i/d): 0, a negative or a
     * non-finite one makes every position's angle NaN or infinite */
    if (!(isfinite(mc->rope_theta) && mc->rope_theta > 0))
        return sp_fail(err, SP_EXIT_INPUT, "%s: rope_theta must be a positive number, not %g",
                       path, mc->rope_theta);
    if (!rp || json_is_null(rp))
        return 0;
    json_t *t = json_object_get(rp, "rope_type");
    if (!t)
        t = json_object_get(rp, "type");
    const char *type = json_is_string(t) ? json_string_value(t) : "default";
    if (strcmp(type, "default") == 0)
        return 0;
    if (strcmp(type, "llama3") != 0)
        return sp_fail(err, SP_EXIT_INPUT,
                       "%s: rope type '%s' is not supported (supported: default, llama3)", path,
                       type);
    mc->rope_type = ROPE_LLAMA3;
    /* transformers requires all four (its llama3 rope validation): a
     * default here would silently be Llama 3.1's numbers */
    static const char *const need[] = {"factor", "low_freq_factor", "high_freq_factor",
                                       "original_max_position_embeddings"};
    for (int i = 0; i < 4; i++)
        if (!json_object_get(rp, need[i]) || json_is_null(json_object_get(rp, need[i])))
            return sp_fail(err, SP_EXIT_INPUT,
                           "%s: %s (rope_type llama3) lacks %s (llama3 rope needs factor, "
                           "low_freq_factor, high_freq_factor and "
                           "original_max_position_embeddings)",
                           path, rp_name, need[i]);
    if (get_num(rp, "factor", 8.0, &mc->rope_factor) ||
        get_num(rp, "low_freq_factor", 1.0, &mc->rope_low_freq) ||
        get_num(rp, "high_freq_factor", 4.0, &mc->rope_high_freq) ||
        get_int(rp, "original_max_position_embeddings", 8192, &mc->rope_original_max_pos))
        return sp_fail(err, SP_EXIT_INPUT, "%s: llama3 rope parameters are not numbers", path);
    if (!(mc->rope_factor > 0) || !(mc->rope_low_freq > 0) || !isfinite(mc->rope_high_freq) ||
        !(mc->rope_high_freq > mc->rope_low_freq) || mc->rope_original_max_pos <= 0)
        return sp_fail(err, SP_EXIT_INPUT,
                       "%s: %s (llama3) is out of range: factor %g, low_freq_factor %g, "
                       "high_freq_factor %g, original_max_position_embeddings %lld (need factor "
                       "> 0, 0 < low_freq_factor < high_freq_factor, a positive length)",
                       path, rp_name, mc->rope_factor, mc->rope_low_freq, mc->rope_high_freq,
                       (long long)mc->rope_original_max_pos);
    return 0;
}

/* A JSON value as text, for messages. */
static void json_text(json_t *v, char *buf, size_t n)
{
    char *s = v ? json_dumps(v, JSON_ENCODE_ANY | JSON_COMPACT) : NULL;
    snprintf(buf, n, "%s", s ? s : "(missing)");
    free(s);
}

/* quantization_config: only bitsandbytes' 4-bit NF4 with double
 * quantization, as transformers writes BitsAndBytesConfig (the blocksize,
 * 64, is checked per tensor where it is recorded: quant_state). */
static int check_quantization(model_config_t *mc, json_t *q, const char *path, sp_err *err)
{
    char v[128];
    if (!json_is_object(q))
        return sp_fail(err, SP_EXIT_INPUT, "%s: quantization_config is not an object", path);
    json_t *method = json_object_get(q, "quant_method");
    if (!json_is_string(method) || strcmp(json_string_value(method), "bitsandbytes") != 0) {
        json_text(method, v, sizeof v);
        return sp_fail(err, SP_EXIT_INPUT,
                       "%s: quantization_config.quant_method %s is not supported (only "
                       "bitsandbytes 4-bit NF4 with double quantization)",
                       path, v);
    }
    static const struct {
        const char *key, *want; /* want: a JSON literal */
    } need[] = {{"load_in_8bit", "false"},          {"load_in_4bit", "true"},
                {"bnb_4bit_quant_type", "\"nf4\""}, {"bnb_4bit_use_double_quant", "true"}};
    for (size_t i = 0; i < sizeof need / sizeof need[0]; i++) {
        json_t *got = json_object_get(q, need[i].key);
        json_text(got, v, sizeof v);
        if (strcmp(v, need[i].want) != 0 && !(i == 0 && !got))
            return sp_fail(err, SP_EXIT_INPUT,
                           "%s: quantization_config.%s %s is not supported (only bitsandbytes "
                           "4-bit NF4 with double quantization: %s %s)",
                           path, need[i].key, v, need[i].key, need[i].want);
    }
    json_t *storage = json_object_get(q, "bnb_4bit_quant_storage");
    if (storage && !json_is_null(storage) &&
        (!json_is_string(storage) || strcmp(json_string_value(storage), "uint8") != 0)) {
        json_text(storage, v, sizeof v);
        return sp_fail(err, SP_EXIT_INPUT,
                       "%s: quantization_config.bnb_4bit_quant_storage %s is not supported (uint8)",
                       path, v);
    }
    mc->bnb_nf4 = 1;
    return 0;
}

static int refuse_unsupported(model_config_t *mc, json_t *root, const char *path, sp_err *err)
{
    json_t *act = json_object_get(root, "hidden_act");
    if (act && (!json_is_string(act) || strcmp(json_string_value(act), "silu") != 0))
        return sp_fail(err, SP_EXIT_INPUT,
                       "%s: hidden_act '%s' is not supported (the SwiGLU MLP needs silu)", path,
                       json_is_string(act) ? json_string_value(act) : "?");
    double v = 0.0;
    if (get_num(root, "attention_dropout", 0.0, &v) || v != 0.0)
        return sp_fail(err, SP_EXIT_INPUT, "%s: attention_dropout %g is not supported", path, v);
    if (get_num(root, "partial_rotary_factor", 1.0, &v) || v != 1.0)
        return sp_fail(err, SP_EXIT_INPUT, "%s: partial_rotary_factor %g is not supported", path,
                       v);
    json_t *q = json_object_get(root, "quantization_config");
    if (q && !json_is_null(q) && check_quantization(mc, q, path, err))
        return err->code;
    /* a sliding window is recorded; the trainer refuses one shorter than seq_len */
    int uses_window = strcmp(mc->model_type, "qwen2") == 0
                          ? get_bool(root, "use_sliding_window", 0)
                          : 1;
    json_t *lt = json_object_get(root, "layer_types");
    if (json_is_array(lt)) {
        size_t i;
        json_t *e;
        json_array_foreach(lt, i, e) if (json_is_string(e) &&
                                         strcmp(json_string_value(e), "sliding_attention") == 0)
            uses_window = 1;
    }
    int64_t w = 0;
    if (get_int(root, "sliding_window", 0, &w))
        return sp_fail(err, SP_EXIT_INPUT, "%s: sliding_window is not an integer", path);
    mc->sliding_window = uses_window ? w : 0;
    return 0;
}

static int read_sizes(model_config_t *mc, json_t *root, const char *path, sp_err *err)
{
    struct { const char *key; int64_t *dst; int64_t def; } req[] = {
        {"vocab_size", &mc->vocab, -1},
        {"hidden_size", &mc->hidden, -1},
        {"intermediate_size", &mc->intermediate, -1},
        {"num_hidden_layers", &mc->layers, -1},
        {"num_attention_heads", &mc->heads, -1},
    };
    for (size_t i = 0; i < sizeof req / sizeof req[0]; i++) {
        if (get_int(root, req[i].key, req[i].def, req[i].dst) || *req[i].dst <= 0)
            return sp_fail(err, SP_EXIT_INPUT, "%s: %s is missing or not a positive integer",
                           path, req[i].key);
    }
    if (get_int(root, "num_key_value_heads", mc->heads, &mc->kv_heads) || mc->kv_heads <= 0 ||
        mc->heads % mc->kv_heads != 0)
        return sp_fail(err, SP_EXIT_INPUT,
                       "%s: num_key_value_heads must be a positive divisor of "
                       "num_attention_heads (%lld)",
                       path, (long long)mc->heads);
    if (get_int(root, "head_dim", mc->hidden / mc->heads, &mc->head_dim) || mc->head_dim <= 0 ||
        mc->head_dim % 2 != 0)
        return sp_fail(err, SP_EXIT_INPUT, "%s: head_dim must be a positive even integer", path);
    if (!json_object_get(root, "head_dim") && mc->hidden % mc->heads != 0)
        return sp_fail(err, SP_EXIT_INPUT,
                       "%s: hidden_size is not a multiple of num_attention_heads", path);
    if (get_num(root, "rms_norm_eps", 1e-6, &mc->rms_eps) || mc->rms_eps <= 0)
        return sp_fail(err, SP_EXIT_INPUT, "%s: rms_norm_eps must be a positive number", path);
    if (get_int(root, "max_position_embeddings", 4096, &mc->max_pos) ||
        get_int(root, "bos_token_id", -1, &mc->bos_id) ||
        get_int(root, "eos_token_id", -1, &mc->eos_id))
        return sp_fail(err, SP_EXIT_INPUT,
                       "%s: max_position_embeddings, bos_token_id or eos_token_id is malformed",
                       path);
    if (mc->vocab > INT32_MAX || mc->hidden > (1 << 20) || mc->intermediate > (1 << 22))
        return sp_fail(err, SP_EXIT_INPUT, "%s: sizes are implausibly large", path);
    return 0;
}

/* model_config_load of the file path */
static int load_file(model_config_t *mc, const char *path, sp_err *err)
{
    json_error_t je;
    json_t *root = json_load_file(path, 0, &je);
    if (!root)
        return sp_fail(err, SP_EXIT_INPUT, "%s: %s", path,
                       strstr(je.text, "unable to open") ? "missing (not a model directory?)"
                                                         : je.text);
    int rc = 0;
    json_t *archs = json_object_get(root, "architectures");
    json_t *mt = json_object_get(root, "model_type");
    const char *arch = json_is_array(archs) && json_is_string(json_array_get(archs, 0))
                           ? json_string_value(json_array_get(archs, 0))
                           : NULL;
    const char *type = json_is_string(mt) ? json_string_value(mt) : NULL;
    int found = -1;
    for (int i = 0; i < 3; i++)
        if ((arch && strcmp(arch, arch_names[i][0]) == 0) ||
            (!arch && type && strcmp(type, arch_names[i][1]) == 0))
            found = i;
    if (found < 0) {
        rc = sp_fail(err, SP_EXIT_INPUT,
                     "%s: architecture '%s' is not supported (supported: LlamaForCausalLM, "
                     "MistralForCausalLM, Qwen2ForCausalLM)",
                     path, arch ? arch : type ? type : "(none)");
        goto out;
    }
    snprintf(mc->architecture, sizeof mc->architecture, "%s", arch_names[found][0]);
    snprintf(mc->model_type, sizeof mc->model_type, "%s", arch_names[found][1]);
    if ((rc = read_sizes(mc, root, path, err)) || (rc = read_rope(mc, root, path, err)) ||
        (rc = refuse_unsupported(mc, root, path, err)))
        goto out;
    mc->tie_embeddings = get_bool(root, "tie_word_embeddings", 0);
    int attn_bias = get_bool(root, "attention_bias", 0), mlp_bias = get_bool(root, "mlp_bias", 0);
    if (found == 2) /* Qwen2: q, k, v always carry a bias, o never */
        mc->bias[PROJ_Q] = mc->bias[PROJ_K] = mc->bias[PROJ_V] = 1;
    else if (found == 0)
        mc->bias[PROJ_Q] = mc->bias[PROJ_K] = mc->bias[PROJ_V] = mc->bias[PROJ_O] = attn_bias;
    if (found == 0)
        mc->bias[PROJ_GATE] = mc->bias[PROJ_UP] = mc->bias[PROJ_DOWN] = mlp_bias;
out:
    json_decref(root);
    return rc;
}

int model_config_load(model_config_t *mc, const char *dir, sp_err *err)
{
    memset(mc, 0, sizeof *mc);
    char *path = sp_strf("%s/config.json", dir);
    if (!path)
        return sp_fail(err, SP_EXIT_OTHER, "out of memory");
    int rc = load_file(mc, path, err);
    free(path);
    return rc;
}

int model_config_write(const model_config_t *mc, const char *path, const char *torch_dtype,
                       sp_err *err)
{
    json_t *o = json_pack(
        "{s:[s], s:s, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:s, s:I, s:f, s:f}", "architectures",
        mc->architecture, "model_type", mc->model_type, "vocab_size", (json_int_t)mc->vocab,
        "hidden_size", (json_int_t)mc->hidden, "intermediate_size", (json_int_t)mc->intermediate,
        "num_hidden_layers", (json_int_t)mc->layers, "num_attention_heads", (json_int_t)mc->heads,
        "num_key_value_heads", (json_int_t)mc->kv_heads, "head_dim", (json_int_t)mc->head_dim,
        "hidden_act", "silu", "max_position_embeddings", (json_int_t)mc->max_pos, "rms_norm_eps",
        mc->rms_eps, "rope_theta", mc->rope_theta);
    if (!o)
        return sp_fail(err, SP_EXIT_OTHER, "out of memory");
    if (mc->rope_type == ROPE_LLAMA3)
        json_object_set_new(
            o, "rope_scaling",
            json_pack("{s:s, s:f, s:f, s:f, s:I}", "rope_type", "llama3", "factor",
                      mc->rope_factor, "low_freq_factor", mc->rope_low_freq, "high_freq_factor",
                      mc->rope_high_freq, "original_max_position_embeddings",
                      (json_int_t)mc->rope_original_max_pos));
    else
        json_object_set_new(o, "rope_scaling", json_null());
    json_object_set_new(o, "tie_word_embeddings", json_boolean(mc->tie_embeddings));
    if (strcmp(mc->model_type, "llama") == 0) {
        json_object_set_new(o, "attention_bias", json_boolean(mc->bias[PROJ_Q]));
        json_object_set_new(o, "mlp_bias", json_boolean(mc->bias[PROJ_GATE]));
    }
    json_object_set_new(o, "attention_dropout", json_real(0.0));
    json_object_set_new(o, "initializer_range", json_real(0.02));
    if (mc->bos_id >= 0)
        json_object_set_new(o, "bos_token_id", json_integer(mc->bos_id));
    if (mc->eos_id >= 0)
        json_object_set_new(o, "eos_token_id", json_integer(mc->eos_id));
    json_object_set_new(o, "torch_dtype", json_string(torch_dtype));
    json_object_set_new(o, "use_cache", json_true());
    int rc = json_dump_file(o, path, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
    json_decref(o);
    if (rc)
        return sp_fail(err, SP_EXIT_OTHER, "%s: cannot write", path);
    return 0;
}

void model_config_proj_dims(const model_config_t *mc, int p, int64_t *in, int64_t *out)
{
    int64_t q = mc->heads * mc->head_dim, kv = mc->kv_heads * mc->head_dim;
    switch (p) {
    case PROJ_Q: *in = mc->hidden; *out = q; break;
    case PROJ_K: *in = mc->hidden; *out = kv; break;
    case PROJ_V: *in = mc->hidden; *out = kv; break;
    case PROJ_O: *in = q; *out = mc->hidden; break;
    case PROJ_GATE: *in = mc->hidden; *out = mc->intermediate; break;
    case PROJ_UP: *in = mc->hidden; *out = mc->intermediate; break;
    default: *in = mc->intermediate; *out = mc->hidden; break;
    }
}

int64_t model_config_params(const model_config_t *mc)
{
    int64_t per_layer = 2 * mc->hidden;
    for (int p = 0; p < PROJ_COUNT; p++) {
        int64_t in, out;
        model_config_proj_dims(mc, p, &in, &out);
        per_layer += in * out + (mc->bias[p] ? out : 0);
    }
    int64_t emb = mc->vocab * mc->hidden;
    return emb * (mc->tie_embeddings ? 1 : 2) + mc->hidden + mc->layers * per_layer;
}

int model_config_preset(model_config_t *mc, const char *name)
{
    static const struct {
        const char *name;
        int64_t vocab, hidden, inter, layers, heads, kv, max_pos, bos, eos;
    } presets[] = {
        {"tiny", 260, 128, 448, 4, 4, 2, 2048, 256, 257},
        {"small", 32000, 768, 1536, 12, 12, 4, 4096, 1, 2},
        {"llama-7b", 32000, 4096, 11008, 32, 32, 32, 4096, 1, 2},
        {"llama-13b", 32000, 5120, 13824, 40, 40, 40, 4096, 1, 2},
    };
    for (size_t i = 0; i < sizeof presets / sizeof presets[0]; i++) {
        if (strcmp(name, presets[i].name) != 0)
            continue;
        memset(mc, 0, sizeof *mc);
        strcpy(mc->architecture, "LlamaForCausalLM");
        strcpy(mc->model_type, "llama");
        mc->vocab = presets[i].vocab;
        mc->hidden = presets[i].hidden;
        mc->intermediate = presets[i].inter;
        mc->layers = presets[i].layers;
        mc->heads = presets[i].heads;
        mc->kv_heads = presets[i].kv;
        mc->head_dim = presets[i].hidden / presets[i].heads;
        mc->rms_eps = 1e-5;
        mc->rope_theta = 10000.0;
        mc->max_pos = presets[i].max_pos;
        mc->bos_id = presets[i].bos;
        mc->eos_id = presets[i].eos;
        return 0;
    }
    return -1;
}

void model_config_rope_tables(const model_config_t *mc, int64_t T, float *cos_t, float *sin_t)
{
    int64_t half = mc->head_dim / 2;
    for (int64_t i = 0; i < half; i++) {
        double inv = 1.0 / pow(mc->rope_theta, (double)(2 * i) / (double)mc->head_dim);
        if (mc->rope_type == ROPE_LLAMA3) {
            double old = (double)mc->rope_original_max_pos;
            double low_wavelen = old / mc->rope_low_freq, high_wavelen = old / mc->rope_high_freq;
            double wavelen = 2.0 * 3.14159265358979323846 / inv;
            if (wavelen > low_wavelen) {
                inv = inv / mc->rope_factor;
            } else if (wavelen >= high_wavelen) {
                double smooth = (old / wavelen - mc->rope_low_freq) /
                                (mc->rope_high_freq - mc->rope_low_freq);
                inv = (1.0 - smooth) * inv / mc->rope_factor + smooth * inv;
            }
        }
        for (int64_t t = 0; t < T; t++) {
            double a = (double)t * inv;
            cos_t[t * half + i] = (float)cos(a);
            sin_t[t * half + i] = (float)sin(a);
        }
    }
}
