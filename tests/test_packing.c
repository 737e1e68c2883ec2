/* data.packing against Hugging Face: the documents of
 * tests/fixtures/hf/<case>/packed.safetensors (scripts/make_packed_fixtures.py:
 * each document run on its own through transformers + PEFT in float64) are
 * written as a dataset, packed into windows by the data layer (several
 * documents per window with `documents`, one with `pad`), and trained on as
 * one micro-batch. The summed loss of the packed windows must equal the sum
 * of Hugging Face's per-document losses within 1e-5 relative (float32), and
 * every gradient within 1e-4 of its largest value (as tests/test_model_hf.c).
 * A run that let a document attend to another, or kept counting positions
 * across documents, misses both by orders of magnitude (the stream layout is
 * checked to do so). */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"
#include "trainer/adapter.h"
#include "trainer/data.h"
#include "trainer/model.h"
#include "trainer/model_io.h"
#include "trainer/safetensors.h"

#define LOSS_TOL 1e-5
#define GRAD_TOL 1e-4

static char *dir;

static void setup(void)
{
    dir = tu_tempdir("packing");
}

static void teardown(void)
{
    tu_rmtree(dir);
    free(dir);
}

TestSuite(packing, .init = setup, .fini = teardown);

typedef struct packed_case {
    char *case_dir, *expected, *data;
    model_config_t mc;
    backend_t *be;
    model_t *m;
    dataset_t d;
    int32_t *in, *tg, *pos, *seg;
    uint64_t *ids;
    int64_t trained;
} packed_case;

/* The fixture's documents as an HDF5 dataset (eos 0). */
static void write_dataset(packed_case *pc)
{
    sp_err err = {0};
    st_file f;
    cr_assert_eq(st_open(&f, pc->expected, &err), 0, "%s", err.msg);
    const st_tensor *tok = st_find(&f, "tokens"), *mask = st_find(&f, "loss_mask"),
                    *off = st_find(&f, "doc_offsets");
    cr_assert(tok && mask && off && tok->dt == DT_I32 && mask->dt == DT_U8 && off->dt == DT_I32,
              "%s: tokens I32, loss_mask U8, doc_offsets I32", pc->expected);
    uint64_t n = (uint64_t)tok->shape[0], nd = (uint64_t)off->shape[0] - 1;
    uint32_t *t = malloc(sizeof(uint32_t) * n);
    uint64_t *o = malloc(sizeof(uint64_t) * (nd + 1));
    for (uint64_t i = 0; i < n; i++)
        t[i] = (uint32_t)((const int32_t *)tok->data)[i];
    for (uint64_t i = 0; i <= nd; i++)
        o[i] = (uint64_t)((const int32_t *)off->data)[i];
    pc->data = sp_strf("%s/docs.h5", dir);
    cr_assert_eq(dataset_write(pc->data, t, mask->data, n, o, nd, pc->mc.vocab, 0, "test", &err),
                 0, "%s", err.msg);
    free(t);
    free(o);
    st_close(&f);
}

/* Opens case `name` (its adapter when lora), packs its documents into
 * windows of T with `packing`, and reads every window as one micro-batch. */
static void open_packed(packed_case *pc, const char *name, int lora, int packing, int T)
{
    sp_err err = {0};
    memset(pc, 0, sizeof *pc);
    pc->case_dir = sp_strf("%shf/%s", fixture(""), name);
    pc->expected = sp_strf("%s/packed.safetensors", pc->case_dir);
    char *model = sp_strf("%s/model", pc->case_dir), *adapter = sp_strf("%s/lora", pc->case_dir);
    cr_assert_eq(model_config_load(&pc->mc, model, &err), 0, "%s", err.msg);
    write_dataset(pc);
    cr_assert_eq(dataset_open_part(&pc->d, pc->data, T, pc->mc.vocab, 1, packing, 0, 1, &err), 0,
                 "%s", err.msg);
    int B = (int)pc->d.n_windows;
    size_t n = (size_t)B * (size_t)T;
    pc->in = malloc(sizeof(int32_t) * n), pc->tg = malloc(sizeof(int32_t) * n);
    pc->pos = malloc(sizeof(int32_t) * n), pc->seg = malloc(sizeof(int32_t) * n);
    pc->ids = calloc((size_t)B, sizeof(uint64_t));
    for (int w = 0; w < B; w++) {
        int64_t k = 0;
        size_t at = (size_t)w * (size_t)T;
        cr_assert_eq(dataset_read_window(&pc->d, (uint64_t)w, pc->in + at, pc->tg + at,
                                         pc->pos + at, pc->seg + at, &k, &err),
                     0, "%s", err.msg);
        pc->trained += k;
    }
    model_opts o = {.mode = MODE_FULL, .max_batch = B, .seq_len = T, .seed = 1};
    if (lora)
        cr_assert_eq(tu_lora_opts(adapter, &o, &err), 0, "%s", err.msg);
    cr_assert_eq(backend_create(&pc->be, "cpu", 0, 2, &err), 0, "%s", err.msg);
    cr_assert_eq(model_create(&pc->m, pc->be, &pc->mc, &o, &err), 0, "%s", err.msg);
    cr_assert_eq(model_io_load_base(pc->m, model, &err), 0, "%s", err.msg);
    if (lora)
        cr_assert_eq(adapter_load(pc->m, adapter, &err), 0, "%s", err.msg);
    free(model);
    free(adapter);
}

static void close_packed(packed_case *pc)
{
    model_destroy(pc->m);
    backend_destroy(pc->be);
    dataset_close(&pc->d);
    free(pc->in), free(pc->tg), free(pc->pos), free(pc->seg), free(pc->ids);
    free(pc->case_dir), free(pc->expected), free(pc->data);
}

/* Forward and backward of every window at once, gradients of the summed
 * loss (grad_scale 1). seg/pos NULL: the same windows read as one stream
 * each (positions counting on, attention across documents). */
static double loss_sum_of(packed_case *pc, int packed)
{
    sp_err err = {0};
    model_batch b = {.inputs = pc->in,
                     .targets = pc->tg,
                     .sample_ids = pc->ids,
                     .B = (int)pc->d.n_windows,
                     .T = (int)pc->d.seq_len,
                     .grad_scale = 1.0f,
                     .last = 1,
                     .pos = packed ? pc->pos : NULL,
                     .seg = packed ? pc->seg : NULL};
    double sum = 0;
    model_zero_grads(pc->m);
    cr_assert_eq(model_forward_backward(pc->m, &b, &sum, &err), 0, "%s", err.msg);
    return sum;
}

static void check_packed(const char *name, int lora, int packing, int T)
{
    packed_case pc;
    open_packed(&pc, name, lora, packing, T);
    const char *what = dataset_packing_names[packing];
    float *want_sum = tu_load_f32(pc.expected, "loss_sum", NULL);
    float *want_count = tu_load_f32(pc.expected, "count", NULL);
    cr_assert(want_sum && want_count);
    cr_expect_eq(pc.trained, (int64_t)want_count[0], "%s %s: %lld trained predictions, HF %g",
                 name, what, (long long)pc.trained, (double)want_count[0]);
    double sum = loss_sum_of(&pc, 1), rel = fabs(sum - want_sum[0]) / fabs(want_sum[0]);
    cr_expect_lt(rel, LOSS_TOL, "%s %s T %d: packed loss sum %.8f, Hugging Face per document %.8f "
                                "(rel %.2e)",
                 name, what, T, sum, (double)want_sum[0], rel);
    fprintf(stderr, "%s %s T %d: %llu windows, loss sum rel err %.2e", name, what, T,
            (unsigned long long)pc.d.n_windows, rel);
    int checked = 0;
    double worst = 0;
    for (int i = 0; i < pc.m->nparams; i++) {
        param_t *p = &pc.m->params[i];
        if (!p->trainable)
            continue;
        char key[256];
        size_t n;
        snprintf(key, sizeof key, "grad.%s", p->name);
        float *wg = tu_load_f32(pc.expected, key, &n);
        cr_assert(wg, "%s: no expected gradient %s", name, key);
        cr_assert_eq(n, p->n, "%s: %s size", name, key);
        float *g = malloc(sizeof(float) * p->n);
        be_download(pc.be, g, DT_F32, p->grad);
        double ge = tu_rel_err(g, wg, n);
        worst = ge > worst ? ge : worst;
        cr_expect_lt(ge, GRAD_TOL, "%s %s: %s rel err %g", name, what, key, ge);
        free(g);
        free(wg);
        checked++;
    }
    fprintf(stderr, ", worst gradient rel err %.2e over %d tensors\n", worst, checked);
    cr_expect_gt(checked, 0);
    /* the same windows without the packing (attention across documents,
     * positions counting on) are far from Hugging Face's per-document sum */
    if (packing == DATA_PACK_DOCUMENTS) {
        double stream = loss_sum_of(&pc, 0);
        cr_expect_gt(fabs(stream - want_sum[0]) / fabs(want_sum[0]), 100 * LOSS_TOL,
                     "%s: unpacked attention should differ (%.8f vs %.8f)", name, stream,
                     (double)want_sum[0]);
    }
    free(want_sum);
    free(want_count);
    close_packed(&pc);
}

/* T 16: the 12-prediction document fills most of a window, the short ones
 * share windows (documents); one document per window (pad). */
Test(packing, llama_gqa_lora_documents) { check_packed("llama_gqa", 1, DATA_PACK_DOCUMENTS, 16); }
Test(packing, llama_gqa_lora_pad) { check_packed("llama_gqa", 1, DATA_PACK_PAD, 16); }
Test(packing, llama_gqa_lora_documents_long_windows)
{
    check_packed("llama_gqa", 1, DATA_PACK_DOCUMENTS, 40); /* everything in one window */
}
Test(packing, llama3_rope_rslora_documents)
{
    check_packed("llama_tied_llama3", 1, DATA_PACK_DOCUMENTS, 16);
}
Test(packing, qwen2_biases_lora_documents) {
    check_packed("qwen2_bias", 1, DATA_PACK_DOCUMENTS, 16);
}
Test(packing, qwen2_biases_lora_pad) { check_packed("qwen2_bias", 1, DATA_PACK_PAD, 13); }
Test(packing, mistral_full_documents) { check_packed("mistral", 0, DATA_PACK_DOCUMENTS, 16); }
Test(packing, mistral_full_pad) { check_packed("mistral", 0, DATA_PACK_PAD, 12); }
