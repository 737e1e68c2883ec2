/* The model card (README.md) of an adapter directory. */
#define _POSIX_C_SOURCE 200809L
#include "model_card.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "config.h"

#ifndef SPOTUNE_VERSION
#error "SPOTUNE_VERSION is defined by the build (trainer/CMakeLists.txt)"
#endif

int model_card_read_metrics(model_card *card, const char *metrics_path, sp_err *err)
{
    card->train_loss = card->val_loss = NAN;
    card->train_loss_step = card->val_loss_step = -1;
    FILE *f = fopen(metrics_path, "r");
    if (!f)
        return errno == ENOENT ? 0
                               : sp_fail(err, SP_EXIT_INPUT, "%s: cannot open: %s", metrics_path,
                                         strerror(errno));
    char *line = NULL;
    size_t cap = 0;
    while (getline(&line, &cap, f) > 0) {
        json_t *o = json_loads(line, 0, NULL);
        if (!o) /* a line cut short by a process killed while writing it */
            continue;
        const char *ev = json_string_value(json_object_get(o, "event"));
        json_t *step = json_object_get(o, "step");
        json_t *loss = json_object_get(o, ev && strcmp(ev, "val") == 0 ? "val_loss" : "loss");
        if (ev && json_is_integer(step) && json_is_number(loss)) {
            if (strcmp(ev, "train") == 0) {
                card->train_loss = json_number_value(loss);
                card->train_loss_step = json_integer_value(step);
            } else if (strcmp(ev, "val") == 0) {
                card->val_loss = json_number_value(loss);
                card->val_loss_step = json_integer_value(step);
            }
        }
        json_decref(o);
    }
    int rc = ferror(f) ? sp_fail(err, SP_EXIT_INPUT, "%s: cannot read", metrics_path) : 0;
    free(line);
    fclose(f);
    return rc;
}

/* s as a double-quoted YAML scalar (JSON's string syntax is YAML's) */
static void yaml_str(FILE *f, const char *s)
{
    json_t *j = json_string(s);
    char *q = j ? json_dumps(j, JSON_ENCODE_ANY) : NULL;
    fputs(q ? q : "\"\"", f);
    free(q);
    json_decref(j);
}

static void loss_line(FILE *f, const char *what, double loss, int64_t step)
{
    if (isfinite(loss))
        fprintf(f, "- **%s:** %.4f (step %lld)\n", what, loss, (long long)step);
    else
        fprintf(f, "- **%s:** none recorded\n", what);
}

int model_card_write(const char *dir, const model_opts *o, const model_card *card, sp_err *err)
{
    char *path = sp_strf("%s/README.md", dir), *tmp = sp_strf("%s/README.md.tmp", dir);
    FILE *f = tmp ? fopen(tmp, "w") : NULL;
    if (!f) {
        int rc = path && tmp ? sp_fail(err, SP_EXIT_OTHER, "%s: cannot write: %s", tmp,
                                       strerror(errno))
                             : sp_fail(err, SP_EXIT_OTHER, "out of memory");
        free(path);
        free(tmp);
        return rc;
    }
    const char *base = card->base_model && *card->base_model ? card->base_model : "unknown";
    fputs("---\nbase_model: ", f);
    yaml_str(f, base);
    fputs("\nlibrary_name: peft\npipeline_tag: text-generation\ntags:\n- ", f);
    char *tag = sp_strf("base_model:adapter:%s", base);
    yaml_str(f, tag ? tag : base);
    free(tag);
    fputs("\n- lora\n- transformers\n- spotune\n---\n\n", f);
    fprintf(f, "# LoRA adapter for %s\n\n", base);
    fprintf(f, "A LoRA adapter in the PEFT layout (`adapter_model.safetensors`, "
               "`adapter_config.json`), trained with spotune %s.\n\n",
            SPOTUNE_VERSION);
    fputs("## Training\n\n", f);
    fprintf(f, "- **Base model:** `%s`\n", base);
    double scale = o->rslora ? o->lora_alpha / sqrt((double)o->lora_r)
                             : o->lora_alpha / (double)o->lora_r;
    fprintf(f, "- **Adapter:** %s, r = %lld, lora_alpha = %g (scale %g, alpha / %s), "
               "lora_dropout = %g, use_rslora = %s%s\n",
            o->dora ? "DoRA (LoRA with a trained magnitude per output feature)" : "LoRA",
            (long long)o->lora_r, o->lora_alpha, scale, o->rslora ? "sqrt(r)" : "r",
            o->lora_dropout, o->rslora ? "true" : "false", o->dora ? ", use_dora = true" : "");
    fputs("- **Target modules:**", f);
    for (int p = 0, first = 1; p < TARGET_COUNT; p++)
        if (o->lora_targets & (1 << p)) {
            fprintf(f, "%s %s", first ? "" : ",", config_target_names[p]);
            first = 0;
        }
    fprintf(f, "\n- **Steps:** %lld\n", (long long)card->steps);
    loss_line(f, "Final train loss", card->train_loss, card->train_loss_step);
    loss_line(f, "Final validation loss", card->val_loss, card->val_loss_step);
    fprintf(f, "- **Training data:** %s%s%s\n", card->train_data && *card->train_data ? "`" : "",
            card->train_data && *card->train_data ? card->train_data : "none",
            card->train_data && *card->train_data ? "`" : "");
    fprintf(f, "- **Validation data:** %s%s%s\n", card->val_data && *card->val_data ? "`" : "",
            card->val_data && *card->val_data ? card->val_data : "none",
            card->val_data && *card->val_data ? "`" : "");
    fputs("\n## How to use\n\n```python\nfrom peft import AutoPeftModelForCausalLM\n\n"
          "model = AutoPeftModelForCausalLM.from_pretrained(\"path/to/this/directory\")\n"
          "```\n\n### Framework versions\n\n",
          f);
    fprintf(f, "- PEFT (adapter layout of peft 0.21)\n- spotune %s\n", SPOTUNE_VERSION);
    int rc = 0, bad = ferror(f);
    if (fclose(f) != 0)
        bad = 1;
    if (bad || rename(tmp, path) != 0) {
        rc = sp_fail(err, SP_EXIT_OTHER, "%s: cannot write: %s", path, strerror(errno));
        unlink(tmp);
    }
    free(path);
    free(tmp);
    return rc;
}
