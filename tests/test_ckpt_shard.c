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
#include <unistd.h>

#include "checkpoint/ckpt.h"
#include "checkpoint/store.h"
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

/* Every rank's shard (ranks of len elements of an arena of n, laid out as
 * layout_text says), then rank 0's commit: ROOT/step-N. blocks: the block
 * count each file must have (0: not checked). */
static char *write_layout(int64_t step, int ranks, uint64_t n, uint64_t len,
                          const char *layout_text, uint32_t blocks)
{
    char *tmp = ckpt_tmp_dir(dir, step, 4242);
    cr_assert(tmp);
    cr_assert_eq(mkdir(tmp, 0755), 0);
    ckpt_snapshot s;
    ckpt_snapshot_init(&s);
    s.step = step;
    s.world_size = ranks;
    strcpy(s.config_hash, "0123456789abcdef");
    strcpy(s.base_model, "fedcba9876543210");
    cr_assert_eq(ckpt_set_int(&s, "step", step), 0);
    s.shards = calloc((size_t)ranks, sizeof *s.shards);
    s.nshards = ranks;
    s.shard_dir = strdup(tmp);
    s.layout = strdup(layout_text);
    for (int r = 0; r < ranks; r++) {
        ckpt_shard sh = {.step = step, .rank = r, .count = ranks, .lo = (uint64_t)r * len};
        sh.hi = sh.lo + len < n ? sh.lo + len : n;
        for (int g = 0; g < CKPT_SHARD_GROUPS; g++) {
            sh.data[g] = malloc(sizeof(float) * len);
            for (uint64_t e = sh.lo; e < sh.hi; e++)
                sh.data[g][e - sh.lo] = value(g, e, step);
        }
        sp_err err = {0};
        cr_assert_eq(ckpt_shard_write(tmp, &sh, &s.shards[r], &err), 0, "%s", err.msg);
        if (blocks)
            cr_expect_eq(s.shards[r].nblocks, blocks, "shard %d: %u blocks of %llu bytes in %llu",
                         r, s.shards[r].nblocks, (unsigned long long)s.shards[r].block_bytes,
                         (unsigned long long)s.shards[r].size);
        ckpt_shard_free(&sh);
    }
    char *out = NULL;
    sp_err err = {0};
    cr_assert_eq(ckpt_write(dir, &s, &out, &err), 0, "%s", err.msg);
    ckpt_snapshot_free(&s);
    free(tmp);
    return out;
}

static char *write_sharded(int64_t step)
{
    return write_layout(step, RANKS, N, LEN, layout(), 0);
}

/* Ranges of every tensor of checkpoint step `step` read through r, every
 * start and ranges crossing shards, equal what was written. */
static void expect_reads(ckpt_sharded *r, int64_t step, const char *from)
{
    sp_err err = {0};
    for (int t = 0; t < 3; t++) {
        uint64_t n = ckpt_sharded_tensor(r, names[t], NULL, NULL);
        cr_assert_eq(n, t == 0 ? 15u : t == 1 ? 7u : 8u, "%s has %llu elements in %s", names[t],
                     (unsigned long long)n, from);
        for (int g = 0; g < CKPT_SHARD_GROUPS; g++)
            for (uint64_t a = 0; a < n; a++)
                for (uint64_t b = a + 1; b <= n; b += 3) {
                    float got[16];
                    cr_assert_eq(ckpt_sharded_read(r, g, names[t], a, b - a, got, &err), 0,
                                 "%s", err.msg);
                    for (uint64_t e = a; e < b; e++)
                        cr_assert_eq(got[e - a], value(g, (uint64_t)offsets[t] + e, step),
                                     "%s group %d element %llu from %s: %g", names[t], g,
                                     (unsigned long long)e, from, (double)got[e - a]);
                }
    }
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
    expect_reads(r, 3, "a directory");
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

/* ---- ranged reads from a store ------------------------------------------------------ */

static char *read_manifest_text(const char *ckpt)
{
    char *text = tu_read_file(tu_fmt("%s/MANIFEST.json", ckpt), NULL);
    cr_assert(text, "%s has no MANIFEST.json", ckpt);
    return text;
}

static store_t *dir_store(void)
{
    store_t *st = NULL;
    sp_err err = {0};
    cr_assert_eq(store_open(&st, tu_fmt("file://%s", dir), NULL, &err), 0, "%s", err.msg);
    return st;
}

/* The byte offset of group g's data in shard file `file`, from MANIFEST text. */
static long long data_offset(const char *text, const char *file, int g)
{
    const char *at = strstr(text, file);
    const char *o = at ? strstr(at, "\"data_offsets\"") : NULL;
    long long v[3] = {-1, -1, -1};
    cr_assert(o && sscanf(strchr(o, '[') + 1, " %lld , %lld , %lld", &v[0], &v[1], &v[2]) == 3,
              "no data_offsets for %s", file);
    return v[g];
}

/* Read from the store in ranges, every block checked, a sharded checkpoint
 * gives exactly what the directory reader gives; a byte changed in a shard's
 * data in the store is found by its block's SHA-256, the message naming the
 * file and the block. */
Test(ckpt_shard, ranged_reads_from_a_store_match_and_a_damaged_block_is_named)
{
    ckpt_shard_min_block = 16; /* many blocks in each small file */
    char *p = write_sharded(3);
    char *text = read_manifest_text(p);
    cr_expect(ckpt_sharded_ranged(text), "the MANIFEST lacks the block checksums");
    store_t *st = dir_store();
    ckpt_sharded *r = NULL;
    sp_err err = {0};
    cr_assert_eq(ckpt_sharded_open_store(&r, text, st, "step-00000003", &err), 0, "%s", err.msg);
    expect_reads(r, 3, "a store");
    cr_expect_eq(ckpt_sharded_damaged(r), 0);
    ckpt_sharded_close(r);

    /* element 9 (shard 1's second) of adam_m: one float's bytes changed */
    long long at = data_offset(text, "shard-00001-of-00004.h5", 1) + 4;
    tu_sh(NULL, "printf '\\177\\177\\177\\177' | dd of=%s/shard-00001-of-00004.h5 bs=1 seek=%lld "
                "conv=notrunc 2>/dev/null", p, at);
    cr_assert_eq(ckpt_sharded_open_store(&r, text, st, "step-00000003", &err), 0, "%s", err.msg);
    float got[15];
    cr_expect_eq(ckpt_sharded_read(r, 1, names[0], 0, 8, got, &err), 0,
                 "shard 0 is intact, yet: %s", err.msg);
    cr_expect_eq(ckpt_sharded_damaged(r), 0);
    sp_err e2 = {0};
    cr_expect_eq(ckpt_sharded_read(r, 1, names[0], 0, 15, got, &e2), SP_EXIT_INPUT,
                 "read a damaged block");
    cr_expect(tu_contains(e2.msg, "shard-00001-of-00004.h5") &&
                  tu_contains(e2.msg, tu_fmt("(block %lld)", at / 16)) &&
                  tu_contains(e2.msg, "SHA-256"),
              "%s", e2.msg);
    cr_expect_eq(ckpt_sharded_damaged(r), 1);
    ckpt_sharded_close(r);
    store_close(st);
    free(text);
    free(p);
}

/* Two shards of 1.5M elements: 18 MB files, in blocks of 1 MiB. */
enum { BIG_N = 3000001, BIG_LEN = 1500001 };

static char *write_big(int64_t step)
{
    ckpt_shard_min_block = (uint64_t)1 << 20; /* 18 blocks a file: most read whole */
    return write_layout(
        step, 2, BIG_N, BIG_LEN,
        tu_fmt("{\"kind\":\"flat-shards\",\"elements\":%d,\"tensors\":["
               "{\"name\":\"a\",\"offset\":0,\"shape\":[1000,1500]},"
               "{\"name\":\"b\",\"offset\":1500000,\"shape\":[%d]}],\"shards\":["
               "{\"file\":\"shard-00000-of-00002.h5\",\"lo\":0,\"hi\":%d},"
               "{\"file\":\"shard-00001-of-00002.h5\",\"lo\":%d,\"hi\":%d}]}",
               BIG_N, BIG_N - 1500000, BIG_LEN, BIG_LEN, BIG_N),
        18);
}

/* Ranges within a block, across a block boundary, across the two files and
 * whole tensors read from the store equal what was written. */
Test(ckpt_shard, ranged_reads_across_blocks_and_files, .timeout = 120)
{
    char *p = write_big(7);
    char *text = read_manifest_text(p);
    store_t *st = dir_store();
    ckpt_sharded *r = NULL;
    sp_err err = {0};
    cr_assert_eq(ckpt_sharded_open_store(&r, text, st, "step-00000007", &err), 0, "%s", err.msg);
    /* adam_v of shard 0 starts at data_offsets[2]; a block starts at 16 MiB */
    long long v0 = data_offset(text, "shard-00000-of-00002.h5", 2);
    uint64_t cross = (uint64_t)(((16LL << 20) - v0) / 4); /* the element at the boundary */
    cr_assert(cross > 10 && cross < 1500000 - 10, "boundary element %llu",
              (unsigned long long)cross);
    struct {
        const char *t;
        uint64_t off, a, n;
    } cases[] = {{"a", 0, 0, 1500000},         {"a", 0, cross - 3, 7},
                 {"b", 1500000, 0, 1},          {"b", 1500000, 0, 5},
                 {"b", 1500000, 0, 1500001},    {"b", 1500000, 1499990, 11}};
    float *got = malloc(sizeof(float) * 1500001);
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++)
        for (int g = 2; g >= 0; g--) {
            cr_assert_eq(ckpt_sharded_read(r, g, cases[c].t, cases[c].a, cases[c].n, got, &err),
                         0, "%s", err.msg);
            for (uint64_t e = 0; e < cases[c].n; e++)
                cr_assert_eq(got[e], value(g, cases[c].off + cases[c].a + e, 7),
                             "%s group %d element %llu", cases[c].t, g,
                             (unsigned long long)(cases[c].a + e));
        }
    free(got);
    ckpt_sharded_close(r);
    store_close(st);
    free(text);
    free(p);
}

/* A sharded checkpoint pulled without its shards: state.h5 and MANIFEST
 * come, checked; the shards stay, each checked to be in the store with its
 * size; the copy verifies once its shards are not looked for. A shard missing
 * from the store, or of another size, is named and marks the checkpoint
 * corrupt. */
Test(ckpt_shard, pull_without_shards_checks_what_stays_in_the_store)
{
    char *p = write_sharded(6);
    char *text = read_manifest_text(p);
    store_t *st = dir_store();
    char *local = strdup(tu_fmt("%s/pulled", dir));
    int corrupt = -1;
    sp_err err = {0};
    cr_assert_eq(ckpt_pull_unsharded(st, "step-00000006", text, local, &corrupt, &err), 0, "%s",
                 err.msg);
    cr_expect_eq(corrupt, 0);
    cr_expect(access(tu_fmt("%s/state.h5", local), R_OK) == 0, "no state.h5 pulled");
    cr_expect(access(tu_fmt("%s/shard-00000-of-00004.h5", local), F_OK) != 0,
              "a shard was pulled");
    ckpt_manifest m;
    cr_expect_eq(ckpt_verify_ex(local, &m, 1, &err), 0, "%s", err.msg);
    ckpt_manifest_free(&m);
    sp_err e2 = {0};
    cr_expect_eq(ckpt_verify(local, &m, &e2), SP_EXIT_INPUT, "verified without its shards");
    ckpt_manifest_free(&m);

    tu_sh(NULL, "truncate -s 100 %s/shard-00003-of-00004.h5", p);
    sp_err e3 = {0};
    cr_expect_eq(ckpt_pull_unsharded(st, "step-00000006", text, local, &corrupt, &e3),
                 SP_EXIT_INPUT);
    cr_expect(corrupt == 1 && tu_contains(e3.msg, "shard-00003-of-00004.h5") &&
                  tu_contains(e3.msg, "100 bytes"),
              "%d %s", corrupt, e3.msg);
    cr_expect(access(local, F_OK) != 0, "a failed pull leaves %s", local);
    tu_sh(NULL, "rm %s/shard-00002-of-00004.h5", p);
    sp_err e4 = {0};
    cr_expect_eq(ckpt_pull_unsharded(st, "step-00000006", text, local, &corrupt, &e4),
                 SP_EXIT_INPUT);
    cr_expect(corrupt == 1 && tu_contains(e4.msg, "shard-00002-of-00004.h5") &&
                  tu_contains(e4.msg, "missing"),
              "%d %s", corrupt, e4.msg);
    store_close(st);
    free(local);
    free(text);
    free(p);
}

/* Machines that do not share run.dir: rank 0's machine keeps some shard
 * files, the store all of them. A reader over both takes each file from the
 * local copy when it is there with its size, else from the store; a block
 * of the local copy that does not match its SHA-256 is read again from the
 * store (the store's copy is not "damaged"); a file that is nowhere is
 * named. */
Test(ckpt_shard, mixed_reads_take_the_local_copy_and_the_store_for_the_rest)
{
    ckpt_shard_min_block = 16;
    char *p = write_sharded(4);
    char *text = read_manifest_text(p);
    char *local = tu_tempdir("ckpt-shard-local");
    /* node-a's copy: MANIFEST, shards 0 and 1 (one byte of shard 1's adam_m changed) */
    tu_sh(NULL, "cp %s/MANIFEST.json %s/shard-00000-of-00004.h5 %s/shard-00001-of-00004.h5 %s/",
          p, p, p, local);
    long long at = data_offset(text, "shard-00001-of-00004.h5", 1) + 4;
    tu_sh(NULL, "printf '\\177\\177\\177\\177' | dd of=%s/shard-00001-of-00004.h5 bs=1 seek=%lld "
                "conv=notrunc 2>/dev/null", local, at);
    store_t *st = dir_store();
    ckpt_sharded *r = NULL;
    sp_err err = {0};
    cr_assert_eq(ckpt_sharded_open_mixed(&r, text, local, st, "step-00000004", &err), 0, "%s",
                 err.msg);
    expect_reads(r, 4, "the local copy and the store");
    cr_expect_eq(ckpt_sharded_damaged(r), 0, "a damaged local copy is not a damaged store");
    int here = -1, there = -1;
    ckpt_sharded_files_read(r, &here, &there);
    cr_expect(here == 2 && there == 2, "read %d files locally and %d from the store", here, there);
    ckpt_sharded_close(r);

    /* no store: the shards written elsewhere are named */
    cr_expect_eq(ckpt_sharded_open_mixed(&r, text, local, NULL, "step-00000004", &err),
                 SP_EXIT_INPUT);
    cr_expect(tu_contains(err.msg, "shard-00002-of-00004.h5") &&
                  tu_contains(err.msg, "another machine"),
              "%s", err.msg);
    /* no store and a damaged local block: an error naming the local copy, not the store */
    tu_sh(NULL, "cp %s/shard-00002-of-00004.h5 %s/shard-00003-of-00004.h5 %s/", p, p, local);
    sp_err_clear(&err);
    cr_assert_eq(ckpt_sharded_open_mixed(&r, text, local, NULL, "step-00000004", &err), 0, "%s",
                 err.msg);
    float got[15];
    cr_expect_eq(ckpt_sharded_read(r, 1, names[0], 0, 15, got, &err), SP_EXIT_INPUT);
    cr_expect(tu_contains(err.msg, "local copy") && tu_contains(err.msg, "shard-00001"), "%s",
              err.msg);
    cr_expect_eq(ckpt_sharded_damaged(r), 0);
    ckpt_sharded_close(r);
    store_close(st);
    tu_rmtree(local);
    free(local);
    free(text);
    free(p);
}

/* A layout's store-only shards (written on another machine) are listed by
 * ckpt_layout_store_only and not looked for by verify; any other missing
 * shard still makes the checkpoint fail. */
Test(ckpt_shard, store_only_shards_are_not_looked_for_locally)
{
    const char *lay =
        "{\"kind\":\"flat-shards\",\"elements\":30,\"tensors\":["
        "{\"name\":\"model.layers.0.self_attn.q_proj.weight\",\"offset\":0,\"shape\":[3,5]},"
        "{\"name\":\"model.norm.weight\",\"offset\":15,\"shape\":[7]},"
        "{\"name\":\"lm_head.weight\",\"offset\":22,\"shape\":[4,2]}],\"shards\":["
        "{\"file\":\"shard-00000-of-00004.h5\",\"lo\":0,\"hi\":8},"
        "{\"file\":\"shard-00001-of-00004.h5\",\"lo\":8,\"hi\":16},"
        "{\"file\":\"shard-00002-of-00004.h5\",\"lo\":16,\"hi\":24,\"store_only\":true},"
        "{\"file\":\"shard-00003-of-00004.h5\",\"lo\":24,\"hi\":30,\"store_only\":true}]}";
    char *p = write_layout(6, RANKS, N, LEN, lay, 0);
    ckpt_manifest m;
    sp_err err = {0};
    char names2[4][64];
    cr_expect_eq(ckpt_layout_store_only(lay, names2, 4), 2);
    cr_expect_str_eq(names2[0], "shard-00002-of-00004.h5");
    cr_expect_str_eq(names2[1], "shard-00003-of-00004.h5");
    cr_expect_eq(ckpt_layout_store_only(layout(), NULL, 0), 0);
    tu_sh(NULL, "rm %s/shard-00002-of-00004.h5 %s/shard-00003-of-00004.h5", p, p);
    cr_expect_eq(ckpt_verify(p, &m, &err), 0, "%s", err.msg);
    cr_expect_eq(ckpt_layout_store_only(m.layout, NULL, 0), 2, "the MANIFEST keeps the flags");
    ckpt_manifest_free(&m);
    tu_sh(NULL, "rm %s/shard-00001-of-00004.h5", p);
    cr_expect_eq(ckpt_verify(p, &m, &err), SP_EXIT_INPUT);
    cr_expect(tu_contains(err.msg, "shard-00001-of-00004.h5"), "%s", err.msg);
    ckpt_manifest_free(&m);
    free(p);
}

/* MANIFEST.json without the entry of one shard file its layout names (nor,
 * then, its checksum) is refused by verify naming that file, also when the
 * shard is store-only; without state.h5's, naming state.h5. */
Test(ckpt_shard, manifest_that_does_not_list_every_shard_is_refused)
{
    const char *files[3] = {"shard-00002-of-00004.h5", "shard-00000-of-00004.h5", "state.h5"};
    for (int i = 0; i < 3; i++) {
        char *p = write_sharded(20 + i);
        ckpt_manifest m;
        sp_err err = {0};
        cr_assert_eq(ckpt_verify(p, &m, &err), 0, "%s", err.msg);
        ckpt_manifest_free(&m);
        cr_assert_eq(tu_sh(NULL,
                           "cd %s && %s/.venv/bin/python -c \"import json; "
                           "m = json.load(open('MANIFEST.json')); del m['files']['%s']; "
                           "json.dump(m, open('MANIFEST.json', 'w'))\"",
                           p, SPOTUNE_SOURCE_DIR, files[i]),
                     0);
        cr_expect_eq(ckpt_verify(p, &m, &err), SP_EXIT_INPUT, "%s: %s", files[i], err.msg);
        cr_expect(tu_contains(err.msg, p) && tu_contains(err.msg, files[i]) &&
                      tu_contains(err.msg, "its checksum cannot be checked"),
                  "%s", err.msg);
        ckpt_manifest_free(&m);
        free(p);
    }
}
