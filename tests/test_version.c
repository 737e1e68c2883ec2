/* One version string: project(spotune VERSION ...) in CMakeLists.txt
 * (SPOTUNE_CMAKE_VERSION here) is what spotune --version and --help print and
 * what a checkpoint records as its writer, and no source carries a copy. */
#include <criterion/criterion.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "checkpoint/ckpt.h"
#include "test_util.h"

#define WANT "spotune " SPOTUNE_CMAKE_VERSION


Test(version, spotune_version_and_help_print_the_cmake_version)
{
    char *out = NULL;
    int rc = tu_spotune(&out, "--version");
    cr_assert_eq(rc, 0, "%s", out ? out : "");
    cr_expect_str_eq(out, WANT "\n");
    free(out);
    out = NULL;
    rc = tu_spotune(&out, "--help");
    cr_assert_eq(rc, 0, "%s", out ? out : "");
    cr_expect(strncmp(out, WANT ":", strlen(WANT ":")) == 0, "--help begins: %.80s", out);
    free(out);
}

Test(version, a_checkpoint_names_the_cmake_version_as_its_writer, .timeout = 240)
{
    char *dir = tu_tiny_dir("version", 3, 5);
    tu_run_yaml(dir, "run:\n  dir: %s/run\n  seed: 1\n"
                     "train:\n  mode: lora\n  steps: 2\n  seq_len: 16\n  micro_batch: 2\n"
                     "  warmup_steps: 1\n"
                     "lora:\n  r: 2\n  alpha: 4\n  targets: [q_proj]\n"
                     "runtime:\n  backend: cpu\n  threads: 1\n"
                     "checkpoint:\n  every_minutes: 0\n",
                dir);
    char *cfg_path = sp_strf("%s/run.yaml", dir), *out = NULL;
    int rc = tu_spotune(&out, "train %s", cfg_path);
    cr_assert_eq(rc, 0, "%s", out ? out : "");
    free(out);

    /* the final checkpoint, read as resuming reads it */
    char *ck = sp_strf("%s/run/checkpoints/step-00000002", dir);
    ckpt_snapshot s;
    ckpt_snapshot_init(&s);
    sp_err err = {0};
    cr_assert_eq(ckpt_read(ck, &s, &err), 0, "%s", err.msg);
    const ckpt_attr *w = ckpt_get(&s, "writer");
    cr_assert(w && w->s, "%s has no writer attribute", ck);
    cr_expect_str_eq(w->s, WANT);
    ckpt_snapshot_free(&s);
    free(ck);
    free(cfg_path);
    tu_rmtree(dir);
    free(dir);
}

/* The version is written once, in CMakeLists.txt: no source, header or
 * script of the modules carries it. */
Test(version, no_source_carries_a_copy_of_the_version)
{
    char *out = NULL;
    int rc = tu_sh(&out,
                   "cd '%s' && grep -rnF --include='*.c' --include='*.h' --include='*.cu' "
                   "--include='*.sh' --include='*.py' '%s' base kernels comm checkpoint trainer "
                   "scripts tests",
                   SPOTUNE_SOURCE_DIR, SPOTUNE_CMAKE_VERSION);
    /* grep exits 1 when nothing matches; this file names the version only
     * through SPOTUNE_CMAKE_VERSION */
    cr_expect_eq(rc, 1, "copies of the version %s: %s", SPOTUNE_CMAKE_VERSION, out ? out : "");
    free(out);
}
