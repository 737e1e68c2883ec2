/* Resuming on another number of ranks, again and again: the checkpoint's
 * global batch (windows per optimizer step) is the run's, whatever rank count
 * wrote it, so every later resume re-splits the same batch. Chains of
 * LoRA runs that end at a step and resume on a new rank count (2 -> 1 -> 1,
 * 2 -> 1 -> 2, 4 -> 2 -> 3 -> 4) must record that batch in every checkpoint,
 * train every global sample exactly once, and follow the uninterrupted run's
 * losses and final adapter within 1e-5 (relative; the summation order over
 * ranks differs, so bit-identity is not expected). A sharded checkpoint
 * refused as its shards are read falls back to the previous one. */
#define _POSIX_C_SOURCE 200809L
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "checkpoint/ckpt.h"
#include "resume_util.h"
#include "test_util.h"
#include "trainer/data.h"
#include "trainer/safetensors.h"

TestSuite(rank_change, .init = resume_setup, .fini = resume_teardown, .timeout = 1500);

typedef struct leg {
    int ranks, to_step;
    const char *more; /* this leg's own settings (NULL: none) */
} leg;

/* What every run of a chain adds (data.packing, train.mode), "" by default */
static const char *chain_more = "";
/* The run's final weights, compared with the uninterrupted run's */
static const char *final_file = "adapter/adapter_model.safetensors";

/* Every run of a chain: the same math (a constant schedule after warmup, so
 * the learning rate does not depend on train.steps, which the legs change). */
static const char *chain_extra(int steps, int mb, int ga, char *buf, size_t n)
{
    snprintf(buf, n,
             "--set train.steps=%d --set train.micro_batch=%d --set train.grad_accum=%d "
             "--set train.schedule=constant --set log.samples=true "
             "--set checkpoint.keep=20 %s",
             steps, mb, ga, chain_more);
    return buf;
}

/* The global_batch attribute of RUN/checkpoints/step-N/state.h5 */
static long long ckpt_global_batch(const char *name, int step)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s/checkpoints/step-%08d", dir, name, step);
    ckpt_snapshot s;
    sp_err err = {0};
    ckpt_snapshot_init(&s);
    cr_assert_eq(ckpt_read(path, &s, &err), 0, "%s", err.msg);
    const ckpt_attr *gb = ckpt_get(&s, "global_batch");
    cr_assert(gb && gb->type == CKPT_ATTR_INT, "%s has no global_batch", path);
    long long v = gb->i;
    ckpt_snapshot_free(&s);
    return v;
}

/* Every tensor of two runs' final weights (final_file) agrees within tol
 * relative to the tensor's largest value. */
static void expect_adapters_close(const char *a, const char *b, double tol)
{
    char pa[4096], pb[4096];
    snprintf(pa, sizeof pa, "%s/%s/%s", dir, a, final_file);
    snprintf(pb, sizeof pb, "%s/%s/%s", dir, b, final_file);
    st_file fa, fb;
    sp_err err = {0};
    cr_assert_eq(st_open(&fa, pa, &err), 0, "%s", err.msg);
    cr_assert_eq(st_open(&fb, pb, &err), 0, "%s", err.msg);
    cr_assert_eq(fa.n, fb.n, "%zu vs %zu tensors", fa.n, fb.n);
    cr_assert_gt(fa.n, 0);
    for (size_t i = 0; i < fa.n; i++) {
        const char *name = fa.tensors[i].name;
        size_t na = 0, nb = 0;
        float *va = tu_load_f32(pa, name, &na), *vb = tu_load_f32(pb, name, &nb);
        cr_assert(va && vb && na == nb && na > 0, "%s: missing in %s or of another size", name,
                  b);
        double e = tu_rel_err(va, vb, na);
        cr_expect_lt(e, tol, "%s: %s vs %s differ by %.3g (relative)", name, a, b, e);
        free(va);
        free(vb);
    }
    st_close(&fa);
    st_close(&fb);
}

/* Checkpoint step of run name: in the sharded layout with one shard file
 * per rank of the run that wrote it (ranks), MANIFEST listing each with its
 * layout, or (ranks 0) a gathered one, state.h5 alone. */
static void expect_layout(const char *name, int step, int ranks)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s/checkpoints/step-%08d", dir, name, step);
    ckpt_manifest m;
    sp_err err = {0};
    cr_assert_eq(ckpt_verify(path, &m, &err), 0, "%s", err.msg);
    cr_expect_eq(m.layout != NULL, ranks > 0, "%s: layout %s", path, m.layout ? m.layout : "none");
    cr_expect_eq(m.nfiles, 2 + ranks, "%s: %d files", path, m.nfiles); /* + state.h5, metrics */
    for (int r = 0; r < ranks; r++) {
        char shard[64];
        ckpt_shard_name(shard, sizeof shard, r, ranks);
        cr_expect(access(tu_fmt("%s/%s", path, shard), R_OK) == 0, "%s lacks %s", path, shard);
        cr_expect(m.layout && tu_contains(m.layout, shard), "the layout lacks %s", shard);
    }
    ckpt_manifest_free(&m);
}

/* Runs the chain; leg 0 starts afresh with grad_accum G / (ranks x mb), the
 * others resume with the same command line on their rank count. Then checks
 * every checkpoint's global batch, the data audit, and the trajectory against
 * `ref`, an uninterrupted run of the whole chain on legs[0].ranks. */
static void run_chain(const char *name, const leg *legs, int nlegs, int mb, int G)
{
    char extra[512], *out = NULL;
    int steps = legs[nlegs - 1].to_step, ga0 = G / (legs[0].ranks * mb);
    char ref[64];
    snprintf(ref, sizeof ref, "%s-ref", name);
    cr_assert_eq(run(tu_mpirun(legs[0].ranks), ref, chain_extra(steps, mb, ga0, extra, sizeof extra),
                     &out),
                 0, "%s", out);
    free(out);
    for (int i = 0; i < nlegs; i++) {
        chain_extra(legs[i].to_step, mb, ga0, extra, sizeof extra);
        if (legs[i].more)
            snprintf(extra + strlen(extra), sizeof extra - strlen(extra), " %s", legs[i].more);
        int rc = run(tu_mpirun(legs[i].ranks), name, extra, &out);
        cr_assert_eq(rc, 0, "leg %d (%d ranks, to step %d): exit %d\n%s", i, legs[i].ranks,
                     legs[i].to_step, rc, out);
        if (i > 0)
            cr_expect(tu_contains(out, "resumed from"), "leg %d did not resume:\n%s", i, out);
        char want[128];
        snprintf(want, sizeof want, "global batch %d windows (%d rank%s x %d x %d)", G,
                 legs[i].ranks, legs[i].ranks > 1 ? "s" : "", mb, G / (legs[i].ranks * mb));
        cr_expect(tu_contains(out, want), "leg %d: expected '%s' in\n%s", i, want, out);
        if (resume_packing != DATA_PACK_STREAM) {
            snprintf(want, sizeof want, "data: packing %s:", dataset_packing_names[resume_packing]);
            cr_expect(tu_contains(out, want), "leg %d: expected '%s' in\n%s", i, want, out);
        }
        free(out);
        cr_expect_eq(ckpt_global_batch(name, legs[i].to_step), G,
                     "leg %d on %d rank(s): checkpoint step %d records a global batch of %lld, "
                     "not %d",
                     i, legs[i].ranks, legs[i].to_step,
                     ckpt_global_batch(name, legs[i].to_step), G);
    }

    enum { MAX_ROWS = 8192 };
    sample_row *rows = calloc(MAX_ROWS, sizeof *rows);
    cr_assert(rows);
    int n = 0, max_ranks = 0;
    for (int i = 0; i < nlegs; i++)
        max_ranks = legs[i].ranks > max_ranks ? legs[i].ranks : max_ranks;
    for (int r = 0; r < max_ranks; r++)
        n += read_samples(name, r, rows + n, MAX_ROWS - n);
    cr_expect_eq(n, steps * G, "%d windows logged for %d steps of %d", n, steps, G);
    expect_every_sample_once(rows, n, steps, G);
    free(rows);

    double la[256], lb[256];
    int na = read_losses(name, la, 256), nb = read_losses(ref, lb, 256);
    cr_assert_eq(na, steps, "%s logged %d steps", name, na);
    cr_assert_eq(nb, steps, "%s logged %d steps", ref, nb);
    for (int i = 0; i < na; i++)
        cr_expect_lt(fabs(la[i] - lb[i]), 1e-5 * fabs(lb[i]), "step %d: %.9g vs %.9g", i + 1,
                     la[i], lb[i]);
    expect_adapters_close(name, ref, 1e-5);
}

Test(rank_change, two_one_one)
{
    const leg legs[] = {{2, 3, NULL}, {1, 6, NULL}, {1, 9, NULL}};
    run_chain("c211", legs, 3, 2, 8);
}

Test(rank_change, two_one_two)
{
    const leg legs[] = {{2, 3, NULL}, {1, 6, NULL}, {2, 9, NULL}};
    run_chain("c212", legs, 3, 2, 8);
}

/* micro_batch 1 and a global batch of 12, which 4, 2 and 3 ranks all divide */
Test(rank_change, four_two_three_four)
{
    const leg legs[] = {{4, 2, NULL}, {2, 4, NULL}, {3, 6, NULL}, {4, 8, NULL}};
    run_chain("c4234", legs, 4, 1, 12);
}

/* Packed documents (data.packing documents): a window is a set of whole
 * documents; resuming on 1 then 2 ranks trains each packed window exactly
 * once and follows the uninterrupted 2-rank run. */
Test(rank_change, two_one_two_packed_documents)
{
    chain_more = "--set data.packing=documents";
    resume_packing = DATA_PACK_DOCUMENTS;
    const leg legs[] = {{2, 3, NULL}, {1, 6, NULL}, {2, 9, NULL}};
    run_chain("c212p", legs, 3, 2, 8);
}

/* Full fine-tuning, the optimizer sharded: checkpoints of 4, 3 and 2 ranks
 * are sharded (a shard file per rank, checked), of 1 rank gathered; each
 * resumes on the next rank count (4 -> 3 -> 1 -> 2), every rank reading only
 * the ranges it keeps, and the chain follows the uninterrupted 4-rank run
 * within 1e-5 with every sample trained once. */
Test(rank_change, full_sharded_four_three_one_two)
{
    chain_more = "--set train.mode=full";
    final_file = "model/model.safetensors";
    const leg legs[] = {{4, 2, NULL}, {3, 4, NULL}, {1, 6, NULL}, {2, 8, NULL}};
    run_chain("f4312", legs, 4, 1, 12);
    expect_layout("f4312", 2, 4);
    expect_layout("f4312", 4, 3);
    expect_layout("f4312", 6, 0);
    expect_layout("f4312", 8, 2);
}

/* A checkpoint in the gathered layout (checkpoint.layout gathered, as every
 * sharded run wrote before sharded checkpoints) resumes under the default
 * layout on another rank count, whose next checkpoint is sharded; and a
 * sharded one resumes on more ranks (2 -> 4). */
Test(rank_change, full_gathered_then_sharded)
{
    chain_more = "--set train.mode=full";
    final_file = "model/model.safetensors";
    const leg legs[] = {{2, 2, "--set checkpoint.layout=gathered"}, {3, 4, NULL},
                        {2, 6, NULL}, {4, 8, NULL}};
    run_chain("fg", legs, 4, 1, 12);
    expect_layout("fg", 2, 0);
    expect_layout("fg", 4, 3);
    expect_layout("fg", 6, 2);
    expect_layout("fg", 8, 4);
}

/* Overwrites the first master weight of `shard` in checkpoint DIR/ck with a
 * NaN and rewrites the MANIFEST to match (the file's size and SHA-256, its
 * blocks' SHA-256): damage from before the checksums, which only the check
 * of each value as a rank reads it sees. */
static void nan_in_shard(const char *ck, const char *shard)
{
    const char *script = tu_fmt("%s/nan_in_shard.py", dir);
    cr_assert_eq(
        tu_write_file(script,
                      "import hashlib, json, struct, sys\n"
                      "ck, name = sys.argv[1], sys.argv[2]\n"
                      "m = json.load(open(ck + '/MANIFEST.json'))\n"
                      "x = [s for s in m['layout']['shards'] if s['file'] == name][0]\n"
                      "b = bytearray(open(ck + '/' + name, 'rb').read())\n"
                      "at = x['data_offsets'][0]\n"
                      "b[at:at + 4] = struct.pack('<f', float('nan'))\n"
                      "open(ck + '/' + name, 'wb').write(b)\n"
                      "m['files'][name] = {'size': len(b), 'sha256': hashlib.sha256(b).hexdigest()}\n"
                      "B = x['block_bytes']\n"
                      "x['block_sha256'] = [hashlib.sha256(b[i:i + B]).hexdigest()\n"
                      "                     for i in range(0, len(b), B)]\n"
                      "json.dump(m, open(ck + '/MANIFEST.json', 'w'), indent=2)\n"),
        0);
    char *out = NULL;
    cr_assert_eq(tu_sh(&out, "python3 %s %s/%s %s", script, dir, ck, shard), 0, "%s", out);
    free(out);
}

/* A sharded checkpoint whose shard holds a value that is not finite (damaged
 * before its checksums: they match) is refused as the ranks read it, after
 * part of it was restored. Under --resume auto it is set aside and the
 * previous checkpoint restored over everything the refused one wrote: the
 * run ends as the uninterrupted one (1e-5). When no older checkpoint is
 * left, the run stops (exit 3) rather than train from a model that holds
 * part of a refused restore, and the next start begins afresh. */
Test(rank_change, a_shard_refused_as_it_is_read_falls_back_under_auto)
{
    const char *extra = "--set train.mode=full --set train.steps=6 --set train.micro_batch=1 "
                        "--set train.grad_accum=2 --set checkpoint.every_steps=2 "
                        "--set checkpoint.keep=3";
    char *out = NULL;
    cr_assert_eq(run(tu_mpirun(2), "sv", extra, &out), 0, "%s", out);
    free(out);
    cr_assert_eq(tu_sh(NULL, "cp -r %s/sv %s/sv-ref", dir, dir), 0);
    expect_layout("sv", 6, 2);
    nan_in_shard("sv/checkpoints/step-00000006", "shard-00001-of-00002.h5");
    /* the message names the shard file that holds the value, offline too */
    const char *named = "step-00000006/shard-00001-of-00002.h5: params/";
    cr_expect_eq(tu_spotune(&out, "ckpt verify %s/sv/checkpoints/step-00000006", dir), 3, "%s",
                 out);
    cr_expect(tu_contains(out, named) && tu_contains(out, "holds a value that is not finite"),
              "%s", out);
    free(out);
    cr_assert_eq(run(tu_mpirun(2), "sv", extra, &out), 0, "%s", out);
    cr_expect(tu_contains(out, "skipping checkpoint step-00000006") && tu_contains(out, named) &&
                  tu_contains(out, "holds a value that is not finite") &&
                  tu_contains(out, "(kept for inspection)"),
              "%s", out);
    cr_expect(tu_contains(out, "resumed from") && tu_contains(out, "step-00000004"), "%s", out);
    free(out);
    double la[16], lb[16];
    int na = read_losses("sv", la, 16), nb = read_losses("sv-ref", lb, 16);
    cr_assert(na == 6 && nb == 6, "%d and %d steps logged", na, nb);
    for (int i = 0; i < na; i++)
        cr_expect_lt(fabs(la[i] - lb[i]), 1e-5 * fabs(lb[i]), "step %d: %.9g vs %.9g", i + 1,
                     la[i], lb[i]);
    final_file = "model/model.safetensors";
    expect_adapters_close("sv", "sv-ref", 1e-5);
    expect_layout("sv", 6, 2); /* written again */

    /* the only checkpoint left is refused as it is read */
    cr_assert_eq(tu_sh(NULL, "rm -rf %s/sv/checkpoints/step-00000002 %s/sv/checkpoints/step-00000006",
                       dir, dir),
                 0);
    nan_in_shard("sv/checkpoints/step-00000004", "shard-00000-of-00002.h5");
    int rc = run(tu_mpirun(2), "sv", extra, &out);
    cr_expect_eq(rc, 3, "%s", out);
    cr_expect(tu_contains(out, "skipping checkpoint step-00000004") &&
                  tu_contains(out, "holds part of a refused restore") &&
                  !tu_contains(out, "starts again from step 0"),
              "%s", out);
    free(out);
    cr_assert_eq(run(tu_mpirun(2), "sv", extra, &out), 0, "%s", out);
    cr_expect(!tu_contains(out, "resumed from"), "%s", out);
    free(out);
}
