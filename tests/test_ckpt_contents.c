/* What a checkpoint holds, checked the same way by `ckpt verify`, `export`
 * and `train --resume`, through the spotune binary: state.h5 damaged before
 * its checksum was taken (the MANIFEST matching) never crashes a command; a
 * datatype claiming gigabytes is refused, not allocated; attributes, LoRA
 * tensors that do not fit the checkpoint's config or the model, values that
 * are not finite, negative second moments and a MANIFEST that does not list
 * state.h5 are refused with exit 3 naming the checkpoint and what is wrong,
 * and nothing is written. */
#define _POSIX_C_SOURCE 200809L
#include <criterion/criterion.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "base/base.h"
#include "cmd_ckpt_util.h"
#include "test_util.h"

TestSuite(ckpt_contents, .init = cmd_ckpt_setup, .fini = cmd_ckpt_teardown, .timeout = 600);

/* ---- state.h5 damaged before its checksum was taken ------------------------------ */

/* DIR/name: a copy of checkpoint src with 4 bytes of state.h5 at off
 * overwritten and MANIFEST.json rewritten to match. */
static const char *damaged_copy(const char *src, const char *name, size_t off)
{
    const char *ck = at("%s", name);
    cr_assert_eq(tu_sh(NULL, "rm -rf %s && cp -r %s %s", ck, src, ck), 0);
    char state[4200];
    snprintf(state, sizeof state, "%s/state.h5", ck);
    size_t n = 0;
    unsigned char *b = (unsigned char *)tu_read_file(state, &n);
    cr_assert(b && off < n);
    for (size_t k = off; k < off + 4 && k < n; k++)
        b[k] ^= (unsigned char)(0xa5 + 31 * k);
    FILE *f = fopen(state, "wb");
    cr_assert(f && fwrite(b, 1, n, f) == n);
    fclose(f);
    free(b);
    cr_assert_eq(tu_remanifest(ck), 0);
    return ck;
}

/* Damage anywhere in state.h5 (four bytes at a time, at 80 places spread over
 * the file and dense over its metadata), the MANIFEST rewritten to match:
 * `ckpt verify` never crashes; it says ok or exits 3 naming the file, also
 * where libhdf5 itself crashes on the damage (in the separate process that
 * reads the structure). train --resume and export refuse such a checkpoint
 * with exit 3 too. */
Test(ckpt_contents, damaged_state_matching_its_manifest_never_crashes_a_command)
{
    train("run", NULL);
    char src[4200], state[4300];
    snprintf(src, sizeof src, "%s", at("run/checkpoints/step-00000012"));
    snprintf(state, sizeof state, "%s/state.h5", src);
    struct stat sb;
    cr_assert_eq(stat(state, &sb), 0);
    size_t size = (size_t)sb.st_size;
    int refused = 0, crashed = 0;
    char refused_ck[4200] = "";
    for (int i = 0; i < 80; i++) {
        size_t off = i < 48 ? (size_t)i * 4096 / 48 : (size_t)(i - 48) * (size / 32);
        if (off >= size)
            continue;
        const char *ck = damaged_copy(src, "damaged", off);
        char *out = NULL;
        int rc = tu_spotune(&out, "ckpt verify %s", ck);
        cr_expect(rc == 0 || rc == 3, "bytes %zu..%zu: ckpt verify exited %d: %s", off, off + 3,
                  rc, out);
        if (rc == 3) {
            cr_expect(tu_contains(out, ck) && tu_contains(out, "state.h5"),
                      "bytes %zu..: the error does not name the file: %s", off, out);
            refused++;
            crashed += tu_contains(out, "crashed the HDF5 library");
            if (!refused_ck[0]) {
                snprintf(refused_ck, sizeof refused_ck, "%s", at("refused"));
                cr_assert_eq(tu_sh(NULL, "rm -rf %s && cp -r %s %s", refused_ck, ck, refused_ck),
                             0);
            }
        }
        free(out);
    }
    cr_expect_gt(refused, 0, "no damage was noticed");
    cr_log_info("%d of 80 damaged files refused, %d of them crashing libhdf5", refused, crashed);
    cr_assert(refused_ck[0]);

    char *out = NULL;
    int rc = tu_spotune(&out, "train %s/run.yaml --set run.dir=%s --resume %s", dir,
                        at("resumed"), refused_ck);
    cr_expect_eq(rc, 3, "%s", out);
    cr_expect(tu_contains(out, refused_ck), "%s", out);
    free(out);
    rc = tu_spotune(&out, "export %s --peft %s", refused_ck, at("out-damaged"));
    cr_expect_eq(rc, 3, "%s", out);
    cr_expect(!exists(at("out-damaged")), "export of a damaged checkpoint wrote something");
    free(out);
}

/* A string attribute whose datatype claims characters of 3.5 GB each (the
 * "mode" attribute's base type size overwritten, MANIFEST rewritten to
 * match): libhdf5 asked for 14 GB to read "lora" and the checker took 40 s
 * to say the file was readable. The checker process may map 1 GiB more
 * than it holds at start (checker_memory_limit), so the read fails and
 * verify and resume refuse the file (exit 3, naming it and the attribute)
 * at once. */
Test(ckpt_contents, a_datatype_claiming_gigabytes_is_refused_not_allocated)
{
#ifdef __SANITIZE_ADDRESS__
    /* the limit is off under AddressSanitizer (its shadow memory counts as
     * data), where libhdf5 would really take the 14 GB */
    cr_skip_test("the checker's memory limit is not applied in a sanitizer build");
#endif
    train("run", NULL);
    const char *src = at("run/checkpoints/step-00000012");
    char state[4300];
    snprintf(state, sizeof state, "%s/state.h5", src);
    size_t n = 0;
    char *b = tu_read_file(state, &n);
    cr_assert(b);
    char *mode = NULL;
    for (size_t k = 0; k + 8 <= n && !mode; k++)
        if (!memcmp(b + k, "mode\0\0\0\0", 8))
            mode = b + k;
    cr_assert(mode, "no 'mode' attribute in %s", state);
    size_t at_size = (size_t)(mode - b) + 20; /* the string type's base: its size in bytes */
    cr_assert(at_size + 4 < n && !memcmp(b + at_size, "\x01\0\0\0", 4),
              "the 'mode' attribute's layout is not the one this test knows");
    free(b);
    const char *ck = at("huge");
    cr_assert_eq(tu_sh(NULL, "rm -rf %s && cp -r %s %s", ck, src, ck), 0);
    FILE *f = fopen(tu_fmt("%s/state.h5", ck), "r+b");
    static const unsigned char claim[5] = {0x01, 0x5c, 0xb5, 0xd4, 0x2f}; /* 0xd4b55c01 bytes */
    cr_assert(f && fseek(f, (long)at_size, SEEK_SET) == 0 && fwrite(claim, 1, 5, f) == 5);
    fclose(f);
    cr_assert_eq(tu_remanifest(ck), 0);
    char *out = NULL;
    int rc = tu_spotune(&out, "ckpt verify %s", ck);
    cr_expect_eq(rc, 3, "%s", out);
    cr_expect(tu_contains(out, tu_fmt("%s/state.h5", ck)) &&
                  tu_contains(out, "attribute 'mode': reading it asks for more memory than there "
                                   "is to give"),
              "%s", out);
    free(out);
    rc = tu_spotune(&out, "train %s/run.yaml --set run.dir=%s --resume %s", dir, at("resumed-huge"),
                    ck);
    cr_expect_eq(rc, 3, "%s", out);
    free(out);
}

/* A state.h5 whose attributes hold what this writer never writes (here the
 * global batch as a string), MANIFEST matching: resuming from it exits 3
 * naming the file and the attribute. */
Test(ckpt_contents, resume_refuses_a_state_with_a_wrong_attribute)
{
    train("run", NULL);
    const char *ck = at("wrongattr");
    cr_assert_eq(tu_sh(NULL, "cp -r %s %s", at("run/checkpoints/step-00000012"), ck), 0);
    char *out = NULL;
    int rc = tu_sh(&out,
                   "%s/.venv/bin/python -c \"import h5py; f = h5py.File('%s/state.h5', 'r+'); "
                   "del f.attrs['global_batch']; f.attrs['global_batch'] = 'eight'; f.close()\"",
                   SPOTUNE_SOURCE_DIR, ck);
    cr_assert_eq(rc, 0, "%s", out);
    free(out);
    cr_assert_eq(tu_remanifest(ck), 0);
    rc = tu_spotune(&out, "train %s/run.yaml --set run.dir=%s --resume %s", dir, at("resumed2"),
                    ck);
    cr_expect_eq(rc, 3, "%s", out);
    cr_expect(tu_contains(out, ck) && tu_contains(out, "'global_batch' is not an integer"), "%s",
              out);
    free(out);
}

/* ---- what a checkpoint holds: the same checks for verify, export and resume ------- */

#define LORA_A0 "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"

/* DIR/name: a copy of checkpoint src whose state.h5 the Python code `body`
 * changed through h5py (h: the open file, K: layer 0's q_proj lora_A), with
 * MANIFEST.json rewritten to match (damage from before the checksum). */
static const char *h5_damaged(const char *src, const char *name, const char *body)
{
    const char *ck = at("%s", name);
    char script[4200];
    snprintf(script, sizeof script, "%s.py", ck);
    char *code = sp_strf("import h5py, sys, numpy as np\n"
                         "h = h5py.File(sys.argv[1] + '/state.h5', 'r+')\n"
                         "K = '" LORA_A0 "'\n%s\nh.close()\n",
                         body);
    cr_assert(code && tu_write_file(script, code) == 0);
    free(code);
    char *out = NULL;
    int rc = tu_sh(&out, "rm -rf %s && cp -r %s %s && %s/.venv/bin/python %s %s", ck, src, ck,
                   SPOTUNE_SOURCE_DIR, script, ck);
    cr_assert_eq(rc, 0, "%s: %s", name, out);
    free(out);
    cr_assert_eq(tu_remanifest(ck), 0);
    return ck;
}

/* Runs `spotune cmd` (a printf format taking the checkpoint then the out
 * dir DIR/name-out) and expects exit 3, an error naming ck and holding each
 * of the NULL-terminated wants, and, for export, nothing written. */
static void expect_input_error(const char *cmd, const char *ck, const char *name, ...)
{
    char out_dir[4200];
    snprintf(out_dir, sizeof out_dir, "%s", at("%s-out", name));
    char *out = NULL;
    char line[9000];
    snprintf(line, sizeof line, cmd, ck, out_dir);
    int rc = tu_spotune(&out, "%s", line);
    cr_expect_eq(rc, 3, "%s: spotune %s exited %d: %s", name, line, rc, out);
    cr_expect(tu_contains(out, ck), "%s: the error does not name %s: %s", name, ck, out);
    va_list ap;
    va_start(ap, name);
    for (const char *w; (w = va_arg(ap, const char *)) != NULL;)
        cr_expect(tu_contains(out, w), "%s: spotune %s: '%s' lacks '%s'", name, line, out, w);
    va_end(ap);
    if (sp_after(cmd, "export")) /* (train makes its run.dir before it reads a checkpoint) */
        cr_expect(!exists(out_dir), "%s: spotune %s wrote %s", name, line, out_dir);
    free(out);
}

/* LoRA tensors that do not fit the checkpoint's own config, or values that
 * are not finite, are refused by export (--peft and --merged) and by ckpt
 * verify with exit 3 naming the checkpoint and the tensor, and nothing is
 * written; an empty config is refused naming the keys it lacks. */
Test(ckpt_contents, export_and_verify_refuse_lora_tensors_that_do_not_fit)
{
    train("run", NULL);
    char src[4200];
    snprintf(src, sizeof src, "%s", at("run/checkpoints/step-00000012"));
    static const struct {
        const char *name, *body, *want1, *want2;
    } cases[] = {
        {"nan", "a = h['params'][K]; x = a[:]; x[1, 2] = np.nan; a[...] = x",
         "params/" LORA_A0, "not finite (element 130: nan)"},
        {"missing", "del h['params'][K]; del h['adam_m'][K]; del h['adam_v'][K]",
         "lacks params/" LORA_A0, "q_proj"},
        {"rank2",
         "for g in ('params', 'adam_m', 'adam_v'):\n"
         "    a = h[g][K][:]; del h[g][K]; h[g].create_dataset(K, data=a.reshape(-1)[:256].reshape(2, 128))",
         "params/" LORA_A0 " has the shape [2, 128]", "lora.r is 4"},
        {"o_proj",
         "for g in ('params', 'adam_m', 'adam_v'):\n"
         "    h[g].create_dataset(K.replace('q_proj', 'o_proj'), data=np.zeros((4, 128), 'f4'))",
         "params/base_model.model.model.layers.0.self_attn.o_proj.lora_A.weight is not a LoRA "
         "weight of this run", "q_proj, v_proj, down_proj"},
        {"r8", "h.attrs['config'] = h.attrs['config'].replace('  r: 4\\n', '  r: 8\\n')",
         "params/" LORA_A0 " has the shape [4, 128]", "lora.r is 8"},
        {"noconfig", "h.attrs['config'] = ''", "config lacks model.path",
         "lora.r, lora.alpha, lora.targets"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char ck[4200];
        snprintf(ck, sizeof ck, "%s", h5_damaged(src, cases[i].name, cases[i].body));
        char tag[64];
        snprintf(tag, sizeof tag, "%s-peft", cases[i].name);
        expect_input_error("export %s --peft %s", ck, tag, cases[i].want1, cases[i].want2, NULL);
        snprintf(tag, sizeof tag, "%s-merged", cases[i].name);
        expect_input_error("export %s --merged %s", ck, tag, cases[i].want1, cases[i].want2,
                           NULL);
        snprintf(tag, sizeof tag, "%s-verify", cases[i].name);
        expect_input_error("ckpt verify %s", ck, tag, cases[i].want1, cases[i].want2, NULL);
    }
    /* the undamaged checkpoint verifies and exports */
    char *out = NULL;
    int rc = tu_spotune(&out, "ckpt verify %s", src);
    cr_expect_eq(rc, 0, "%s", out);
    cr_expect(tu_contains(out, "values finite"), "%s", out);
    free(out);
    rc = tu_spotune(&out, "export %s --peft %s", src, at("good-peft"));
    cr_expect_eq(rc, 0, "%s", out);
    free(out);
}

/* export --peft --model DIR: the adapter must fit that model. A copy of the
 * base that says it has 3 layers (the adapter has 4) is refused naming the
 * layer; the base itself is taken. */
Test(ckpt_contents, export_peft_with_a_model_checks_the_adapter_against_it)
{
    train("run", NULL);
    char ck[4200];
    snprintf(ck, sizeof ck, "%s", at("run/checkpoints/step-00000012"));
    cr_assert_eq(tu_sh(NULL, "cp -r %s %s && sed -i 's/\"num_hidden_layers\": 4/"
                             "\"num_hidden_layers\": 3/' %s/config.json && "
                             "grep -q '\"num_hidden_layers\": 3' %s/config.json",
                       at("model"), at("model3"), at("model3"), at("model3")),
                 0);
    char cmd[4300];
    snprintf(cmd, sizeof cmd, "export %%s --peft %%s --model %s", at("model3"));
    expect_input_error(cmd, ck, "l3",
                       "params/base_model.model.model.layers.3.", "is of layer 3",
                       tu_fmt("the model %s has 3 layers", at("model3")), NULL);
    char *out = NULL;
    int rc = tu_spotune(&out, "export %s --peft %s --model %s", ck, at("l4-out"), at("model"));
    cr_expect_eq(rc, 0, "%s", out);
    free(out);
}

/* ckpt verify runs the checks a resume runs: what resume refuses, verify
 * refuses with the same message (exit 3 both); values that are not finite
 * and negative second moments are refused when the checkpoint is read,
 * naming the file and the tensor; and a MANIFEST that does not list state.h5
 * (which then goes unchecked: here its weights are scaled by 1000 after the
 * checksum) is refused by verify, resume and export. */
Test(ckpt_contents, verify_refuses_what_resume_refuses)
{
    train("run", NULL);
    char src[4200];
    snprintf(src, sizeof src, "%s", at("run/checkpoints/step-00000012"));
    static const struct {
        const char *name, *body, *want1, *want2;
    } cases[] = {
        {"step_str", "h.attrs['step'] = 'three'", "the attribute 'step' is not an integer",
         "state.h5"},
        {"ws_zero", "h.attrs['world_size'] = 0", "the attribute 'world_size' is not an integer",
         "state.h5"},
        {"step_other", "h.attrs['step'] = 7", "says step 7, its MANIFEST step 12", "state.h5"},
        {"param_nan", "a = h['params'][K]; x = a[:]; x[0, 0] = np.nan; a[...] = x",
         "state.h5: params/" LORA_A0, "not finite"},
        {"v_negative", "a = h['adam_v'][K]; x = a[:]; x[3, 5] = -1.0; a[...] = x",
         "state.h5: adam_v/" LORA_A0, "negative second moment (element 389: -1)"},
        {"m_inf", "a = h['adam_m'][K]; x = a[:]; x[0, 1] = np.inf; a[...] = x",
         "state.h5: adam_m/" LORA_A0, "not finite (element 1: inf)"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char ck[4200];
        snprintf(ck, sizeof ck, "%s", h5_damaged(src, cases[i].name, cases[i].body));
        char tag[64], cmd[4300];
        snprintf(tag, sizeof tag, "%s-verify", cases[i].name);
        expect_input_error("ckpt verify %s", ck, tag, cases[i].want1, cases[i].want2, NULL);
        snprintf(tag, sizeof tag, "%s-resume", cases[i].name);
        snprintf(cmd, sizeof cmd, "train %s/run.yaml --resume %%s --set run.dir=%%s", dir);
        expect_input_error(cmd, ck, tag, cases[i].want1, cases[i].want2, NULL);
    }

    /* MANIFEST.json without state.h5 */
    char ck[4200];
    snprintf(ck, sizeof ck, "%s", at("unlisted"));
    char *out = NULL;
    int rc = tu_sh(&out,
                   "cp -r %s %s && %s/.venv/bin/python -c \"import json, h5py; "
                   "p = '%s/MANIFEST.json'; m = json.load(open(p)); del m['files']['state.h5']; "
                   "json.dump(m, open(p, 'w')); h = h5py.File('%s/state.h5', 'r+'); "
                   "a = h['params']['" LORA_A0 "']; a[...] = a[:] * 1000; h.close()\"",
                   src, ck, SPOTUNE_SOURCE_DIR, ck, ck);
    cr_assert_eq(rc, 0, "%s", out);
    free(out);
    const char *want = "MANIFEST.json does not list state.h5";
    expect_input_error("ckpt verify %s", ck, "unlisted-verify", want, NULL);
    expect_input_error("export %s --peft %s", ck, "unlisted-export", want, NULL);
    char cmd[4300];
    snprintf(cmd, sizeof cmd, "train %s/run.yaml --resume %%s --set run.dir=%%s", dir);
    expect_input_error(cmd, ck, "unlisted-resume", want, NULL);
}
