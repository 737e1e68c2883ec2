/* Sharded checkpoints at the directory level: shard files written as ranks
 * write them, committed with state.h5 and a MANIFEST carrying the layout;
 * ranged reads of any tensor's elements across shard boundaries equal what
 * was written (exactly: float32 stored and read back); a missing or
 * corrupted shard, or a missing MANIFEST, makes the checkpoint not exist,
 * with a message naming the file, and the newest good one is chosen. */
#define _POSIX_C_SOURCE 200809L
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "checkpoint/ckpt.h"
#include "test_util.h"

static char *dir;

static void setup(void)
{
    dir = tu_tempdir("ckpt-shard");
}

static void teardown(void)
{
    tu_rmtree(dir);
    free(dir);
}

TestSuite(ckpt_shard, .init = setup, .fini = teardown);

/* Three tensors in a flat arena of 3x5 + 7 + 4x2 = 30 elements, split over
 * 4 ranks in shards of 8 (the last holds 6): a tensor spans two and three
 * shards. Value of element e of group g: g * 1000 + e + step / 8. */
enum { N = 30, LEN = 8, RANKS = 4 };
static const char *const names[3] = {"model.layers.0.self_attn.q_proj.weight",
                                     "model.norm.weight", "lm_head.weight"};
static const int64_t offsets[3] = {0, 15, 22};

static float value(int g, uint64_t e, int64_t step)
{
    return (float)g * 1000.0f + (float)e + (float)step / 8.0f;
}

static const char *layout(void)
{
    return "{\"kind\":\"flat-shards\",\"elements\":30,\"tensors\":["
           "{\"name\":\"model.layers.0.self_attn.q_proj.weight\",\"offset\":0,\"shape\":[3,5]},"
           "{\"name\":\"model.norm.weight\",\"offset\":15,\"shape\":[7]},"
           "{\"name\":\"lm_head.weight\",\"offset\":22,\"shape\":[4,2]}],\"shards\":["
           "{\"file\":\"shard-00000-of-00004.h5\",\"lo\":0,\"hi\":8},"
           "{\"file\":\"shard-00001-of-00004.h5\",\"lo\":8,\"hi\":16},"
           "{\"file\":\"shard-00002-of-00004.h5\",\"lo\":16,\"hi\":24},"
           "{\"file\":\"shard-00003-of-00004.h5\",\"lo\":24,\"hi\":30}]}";
}

/* Every rank's shard, then rank 0's commit: ROOT/step-N */
static char *write_sharded(int64_t step)
{
    char *tmp = ckpt_tmp_dir(dir, step, 4242);
    cr_assert(tmp);
    cr_assert_eq(mkdir(tmp, 0755), 0);
    ckpt_snapshot s;
    ckpt_snapshot_init(&s);
    s.step = step;
    s.world_size = RANKS;
    strcpy(s.config_hash, "0123456789abcdef");
    strcpy(s.base_model, "fedcba9876543210");
    cr_assert_eq(ckpt_set_int(&s, "step", step), 0);
    s.shards = calloc(RANKS, sizeof *s.shards);
    s.nshards = RANKS;
    s.shard_dir = strdup(tmp);
    s.layout = strdup(layout());
    for (int r = 0; r < RANKS; r++) {
        ckpt_shard sh = {.step = step, .rank = r, .count = RANKS, .lo = (uint64_t)r * LEN};
        sh.hi = sh.lo + LEN < N ? sh.lo + LEN : N;
        for (int g = 0; g < CKPT_SHARD_GROUPS; g++) {
            sh.data[g] = malloc(sizeof(float) * LEN);
            for (uint64_t e = sh.lo; e < sh.hi; e++)
                sh.data[g][e - sh.lo] = value(g, e, step);
        }
        sp_err err = {0};
        cr_assert_eq(ckpt_shard_write(tmp, &sh, &s.shards[r], &err), 0, "%s", err.msg);
        ckpt_shard_free(&sh);
    }
    char *out = NULL;
    sp_err err = {0};
    cr_assert_eq(ckpt_write(dir, &s, &out, &err), 0, "%s", err.msg);
    ckpt_snapshot_free(&s);
    free(tmp);
    return out;
}

Test(ckpt_shard, commit_lists_every_shard_and_ranged_reads_match)
{
    char *p = write_sharded(3);
    ckpt_manifest m;
    sp_err err = {0};
    cr_assert_eq(ckpt_verify(p, &m, &err), 0, "%s", err.msg);
    cr_expect_eq(m.nfiles, 1 + RANKS, "%d files", m.nfiles);
    cr_expect(m.layout && tu_contains(m.layout, "shard-00003-of-00004.h5"), "layout %s",
              m.layout ? m.layout : "none");
    ckpt_manifest_free(&m);

    ckpt_sharded *r;
    cr_assert_eq(ckpt_sharded_open(&r, p, &err), 0, "%s", err.msg);
    int nd = 0;
    int64_t shape[2] = {0};
    cr_expect_eq(ckpt_sharded_tensor(r, names[0], &nd, shape), 15);
    cr_expect(nd == 2 && shape[0] == 3 && shape[1] == 5, "shape %d [%lld, %lld]", nd,
              (long long)shape[0], (long long)shape[1]);
    cr_expect_eq(ckpt_sharded_tensor(r, "no.such.tensor", NULL, NULL), 0);
    for (int t = 0; t < 3; t++) {
        uint64_t n = ckpt_sharded_tensor(r, names[t], NULL, NULL);
        for (int g = 0; g < CKPT_SHARD_GROUPS; g++)
            for (uint64_t a = 0; a < n; a += 3) /* every start, ranges crossing shards */
                for (uint64_t b = a + 1; b <= n; b += 4) {
                    float got[16];
                    cr_assert_eq(ckpt_sharded_read(r, g, names[t], a, b - a, got, &err), 0,
                                 "%s", err.msg);
                    for (uint64_t e = a; e < b; e++)
                        cr_assert_eq(got[e - a], value(g, (uint64_t)offsets[t] + e, 3),
                                     "%s group %d element %llu: %g", names[t], g,
                                     (unsigned long long)e, (double)got[e - a]);
                }
    }
    float x[8];
    cr_expect_neq(ckpt_sharded_read(r, 0, names[1], 5, 3, x, &err), 0, "past the end read");
    sp_err e2 = {0};
    cr_expect_eq(ckpt_sharded_read(r, 0, "no.such.tensor", 0, 1, x, &e2), SP_EXIT_INPUT);
    cr_expect(tu_contains(e2.msg, "no.such.tensor"), "%s", e2.msg);
    ckpt_sharded_close(r);

    /* the gathered view, as export reads it */
    ckpt_snapshot s;
    ckpt_snapshot_init(&s);
    sp_err e3 = {0};
    cr_assert_eq(ckpt_sharded_load(p, &s, 2, "adam_v/", &e3), 0, "%s", e3.msg);
    const ckpt_array *a = ckpt_find_array(&s, "adam_v/lm_head.weight");
    cr_assert(a && a->n == 8 && a->ndim == 2 && a->shape[0] == 4);
    for (int i = 0; i < 8; i++)
        cr_expect_eq(a->data[i], value(2, 22 + (uint64_t)i, 3));
    ckpt_snapshot_free(&s);
    free(p);
}

static void expect_skipped(const char *damage, const char *file, const char *want)
{
    char *good = write_sharded(2), *bad = write_sharded(5);
    tu_sh(NULL, damage, bad, file);
    char found[4096];
    int ok = 0;
    sp_err err = {0};
    ckpt_manifest m;
    cr_expect_eq(ckpt_verify(bad, &m, &err), SP_EXIT_INPUT, "%s: damaged, yet verifies", file);
    ckpt_manifest_free(&m);
    cr_expect(tu_contains(err.msg, file) && tu_contains(err.msg, want),
              "'%s' does not name %s (%s)", err.msg, file, want);
    sp_err e2 = {0};
    cr_assert_eq(ckpt_find_latest(dir, found, sizeof found, &ok, NULL, NULL, &e2), 0, "%s",
                 e2.msg);
    cr_expect(ok && strcmp(found, good) == 0, "chose %s, not %s", ok ? found : "nothing", good);
    free(good);
    free(bad);
}

Test(ckpt_shard, missing_shard_skips_the_checkpoint)
{
    expect_skipped("rm %s/%s", "shard-00002-of-00004.h5", "missing");
}

Test(ckpt_shard, corrupt_shard_skips_the_checkpoint)
{
    /* four bytes inside the file changed, its size kept */
    expect_skipped("printf '\\377\\000\\377\\000' | "
                   "dd of=%s/%s bs=1 seek=200 conv=notrunc 2>/dev/null",
                   "shard-00001-of-00004.h5", "SHA-256");
}

Test(ckpt_shard, missing_manifest_skips_the_checkpoint)
{
    expect_skipped("rm %s/%s", "MANIFEST.json", "no MANIFEST");
}

/* A layout that does not cover the arena in order is refused by name. */
Test(ckpt_shard, damaged_layout_is_refused)
{
    char *p = write_sharded(4);
    tu_sh(NULL, "sed -i 's/\"lo\": 16/\"lo\": 17/' %s/MANIFEST.json", p);
    ckpt_sharded *r = NULL;
    sp_err err = {0};
    cr_expect_eq(ckpt_sharded_open(&r, p, &err), SP_EXIT_INPUT, "opened a damaged layout");
    cr_expect(tu_contains(err.msg, "layout is damaged") && tu_contains(err.msg, "MANIFEST.json"),
              "%s", err.msg);
    ckpt_sharded_close(r);
    free(p);
}
