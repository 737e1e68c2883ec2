/* The checkpoint directory protocol: a round trip of every field, atomic
 * commit, verification catching each kind of damage with a clear message,
 * listing, the fallback to an older checkpoint (reporting, and removing,
 * the .tmp- leftovers of interrupted writes), and retention that removes
 * MANIFEST first. */
#define _POSIX_C_SOURCE 200809L
#include <criterion/criterion.h>
#include <jansson.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "checkpoint/ckpt.h"
#include "checkpoint/ckpt_writer.h"
#include "checkpoint/store.h"
#include <hdf5.h>
#include "test_util.h"

static char *dir;

static void setup(void)
{
    dir = tu_tempdir("ckpt");
}

static void teardown(void)
{
    tu_rmtree(dir);
    free(dir);
}

TestSuite(ckpt, .init = setup, .fini = teardown);

static void make_snapshot(ckpt_snapshot *s, int64_t step)
{
    ckpt_snapshot_init(s);
    s->step = step;
    s->world_size = 4;
    strcpy(s->config_hash, "0123456789abcdef");
    strcpy(s->base_model, "fedcba9876543210");
    cr_assert_eq(ckpt_set_int(s, "step", step), 0);
    cr_assert_eq(ckpt_set_int(s, "cursor", 123456789012LL), 0);
    cr_assert_eq(ckpt_set_real(s, "elapsed_s", 3.25), 0);
    cr_assert_eq(ckpt_set_str(s, "config", "run:\n  dir: x\n# ünïcode\n"), 0);
    int64_t shape2[2] = {3, 5}, shape1[1] = {7};
    float *a = ckpt_add_array(s, "params/base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", 2, shape2);
    float *b = ckpt_add_array(s, "adam_m/model.norm.weight", 1, shape1);
    cr_assert(a && b);
    for (int i = 0; i < 15; i++)
        a[i] = (float)i * 0.5f - 3.0f + (float)step;
    for (int i = 0; i < 7; i++)
        b[i] = -(float)i / 3.0f;
}

static char *write_step(int64_t step)
{
    ckpt_snapshot s;
    sp_err err = {0};
    char *out;
    make_snapshot(&s, step);
    cr_assert_eq(ckpt_write(dir, &s, &out, &err), 0, "%s", err.msg);
    ckpt_snapshot_free(&s);
    return out;
}

Test(ckpt, round_trip_of_every_field)
{
    char *path = write_step(1200);
    cr_expect(tu_contains(path, "step-00001200"));
    ckpt_snapshot s, w;
    sp_err err = {0};
    cr_assert_eq(ckpt_read(path, &s, &err), 0, "%s", err.msg);
    make_snapshot(&w, 1200);
    cr_expect_eq(s.step, 1200);
    cr_expect_eq(s.world_size, 4);
    cr_expect_str_eq(s.config_hash, w.config_hash);
    cr_expect_str_eq(s.base_model, w.base_model);
    cr_expect_eq(ckpt_get(&s, "cursor")->i, 123456789012LL);
    cr_expect_eq(ckpt_get(&s, "elapsed_s")->d, 3.25);
    cr_expect_str_eq(ckpt_get(&s, "config")->s, w.attrs[3].s);
    cr_assert_eq(s.narrays, 2);
    for (int i = 0; i < w.narrays; i++) {
        const ckpt_array *a = ckpt_find_array(&s, w.arrays[i].name);
        cr_assert(a, "missing %s", w.arrays[i].name);
        cr_expect_eq(a->ndim, w.arrays[i].ndim);
        cr_expect_eq(a->shape[0], w.arrays[i].shape[0]);
        cr_expect_eq(memcmp(a->data, w.arrays[i].data, sizeof(float) * a->n), 0);
    }
    ckpt_snapshot_free(&s);
    ckpt_snapshot_free(&w);
    /* nothing is left of the temporary directory */
    cr_expect_eq(tu_sh(NULL, "ls -a %s | grep -q '^\\.tmp-'", dir), 1);
    free(path);
}

static void expect_bad(const char *path, const char *want)
{
    ckpt_manifest m;
    sp_err err = {0};
    int rc = ckpt_verify(path, &m, &err);
    ckpt_manifest_free(&m);
    cr_expect_eq(rc, SP_EXIT_INPUT, "rc %d", rc);
    cr_expect(tu_contains(err.msg, want), "'%s' lacks '%s'", err.msg, want);
    cr_expect(tu_contains(err.msg, "step-0000"), "'%s' does not name the checkpoint", err.msg);
}

Test(ckpt, truncated_file_is_detected)
{
    char *p = write_step(10);
    tu_sh(NULL, "truncate -s -100 %s/state.h5", p);
    expect_bad(p, "state.h5 has");
    expect_bad(p, "truncated");
    free(p);
}

Test(ckpt, flipped_byte_is_detected)
{
    char *p = write_step(11);
    tu_sh(NULL, "printf '\\377' | dd of=%s/state.h5 bs=1 seek=3000 conv=notrunc 2>/dev/null", p);
    expect_bad(p, "fails its SHA-256 checksum");
    free(p);
}

Test(ckpt, missing_manifest_is_incomplete)
{
    char *p = write_step(12);
    tu_sh(NULL, "rm %s/MANIFEST.json", p);
    expect_bad(p, "no MANIFEST.json");
    free(p);
}

Test(ckpt, manifest_naming_a_missing_file)
{
    char *p = write_step(13);
    tu_sh(NULL, "mv %s/state.h5 %s/elsewhere.h5", p, p);
    expect_bad(p, "names state.h5, which is missing");
    free(p);
}

Test(ckpt, manifest_not_json_or_from_the_future)
{
    char *p = write_step(14);
    char path[4200];
    snprintf(path, sizeof path, "%s/MANIFEST.json", p);
    tu_write_file(path, "{\"format_version\": 1, \"step\": ");
    expect_bad(p, "not valid JSON");
    tu_write_file(path, "{\"format_version\": 99, \"step\": 1, \"world_size\": 1, \"files\": {}}");
    expect_bad(p, "format version 99 is newer");
    free(p);
}

/* what ckpt_find_latest reported, in order */
static int bad_reports;
static char reported[8][64], reasons[8][SP_ERR_MSG_MAX];
static void count_bad(void *ctx, const ckpt_info *bad)
{
    (void)ctx;
    cr_expect(bad->problem[0], "a reason is given for %s", bad->name);
    if (bad_reports < 8) {
        snprintf(reported[bad_reports], sizeof reported[0], "%s", bad->name);
        snprintf(reasons[bad_reports], sizeof reasons[0], "%s", bad->problem);
    }
    bad_reports++;
}

/* ROOT/.tmp-step-<step>-<pid>/ holding a partial state.h5, as a writer
 * that died before its rename leaves it; returns its name */
static const char *leftover(int64_t step, int pid)
{
    static char name[128];
    snprintf(name, sizeof name, ".tmp-step-%08lld-%d", (long long)step, pid);
    cr_assert_eq(tu_sh(NULL, "mkdir -p %s/%s && echo partial > %s/%s/state.h5", dir, name, dir,
                       name),
                 0);
    return name;
}

static int exists(const char *name)
{
    char p[4200];
    struct stat sb;
    snprintf(p, sizeof p, "%s/%s", dir, name);
    return stat(p, &sb) == 0;
}

static void find_latest(const char *want)
{
    char found_path[4096];
    int found = 0;
    sp_err err = {0};
    bad_reports = 0;
    cr_assert_eq(ckpt_find_latest(dir, found_path, sizeof found_path, &found, count_bad, NULL,
                                  &err),
                 0, "%s", err.msg);
    cr_assert(found);
    cr_expect(tu_contains(found_path, want), "chose %s, not %s", found_path, want);
}

Test(ckpt, newest_damaged_falls_back_to_the_previous)
{
    free(write_step(20));
    free(write_step(30));
    char *p = write_step(40);
    tu_sh(NULL, "printf 'X' | dd of=%s/state.h5 bs=1 seek=100 conv=notrunc 2>/dev/null", p);
    /* a writer killed (-9) before its rename leaves a .tmp- directory */
    char tmp[128];
    snprintf(tmp, sizeof tmp, "%s", leftover(50, tu_dead_pid()));
    sp_err err = {0};
    ckpt_info *l;
    int n;
    /* listing shows it as incomplete and changes nothing */
    cr_assert_eq(ckpt_list(dir, 1, &l, &n, &err), 0);
    cr_assert_eq(n, 4);
    cr_expect_eq(l[0].step, 50);
    cr_expect_str_eq(l[0].name, tmp);
    cr_expect(!l[0].ok && l[0].incomplete == CKPT_INTERRUPTED);
    cr_expect(tu_contains(l[0].problem, "incomplete: its write never finished"), "%s",
              l[0].problem);
    cr_expect(!l[1].ok && l[2].ok && l[3].ok);
    cr_expect(l[2].created > 0 && l[1].created > 0, "the time of a damaged one is still shown");
    free(l);
    cr_expect(exists(tmp), "ckpt_list removed %s", tmp);

    /* resuming: both newer ones reported (newest first), 30 chosen, the
     * leftover removed */
    find_latest("step-00000030");
    cr_assert_eq(bad_reports, 2, "the .tmp step 50 and the damaged step 40 are reported");
    cr_expect_str_eq(reported[0], tmp);
    cr_expect(tu_contains(reasons[0], "its write never finished") &&
                  tu_contains(reasons[0], "removed"),
              "%s", reasons[0]);
    cr_expect_str_eq(reported[1], "step-00000040");
    cr_expect(tu_contains(reasons[1], "state.h5 fails its SHA-256 checksum"), "%s", reasons[1]);
    cr_expect(!exists(tmp), "%s was not removed", tmp);
    cr_assert_eq(ckpt_list(dir, 1, &l, &n, &err), 0);
    cr_expect_eq(n, 3, "40 (damaged: kept for a human to look at), 30, 20");
    free(l);
    free(p);
}

/* A .tmp- directory whose PID is a live process other than us is reported
 * as being written and left alone, by resume and by retention; one named by
 * our own PID is a previous incarnation's and goes. */
Test(ckpt, leftover_of_a_live_writer_is_left_alone)
{
    free(write_step(10));
    int other = (int)getppid(); /* alive: it waits for this test */
    char live[128], mine[128], gone[128];
    snprintf(live, sizeof live, "%s", leftover(30, other));
    snprintf(mine, sizeof mine, "%s", leftover(20, (int)getpid()));
    snprintf(gone, sizeof gone, "%s", leftover(5, tu_dead_pid()));
    ckpt_info *l;
    int n;
    sp_err err = {0};
    cr_assert_eq(ckpt_list(dir, 1, &l, &n, &err), 0);
    cr_assert_eq(n, 4);
    cr_expect_eq(l[0].incomplete, CKPT_BEING_WRITTEN);
    cr_expect_eq(l[0].writer_pid, other);
    char want[128];
    snprintf(want, sizeof want, "being written by process %d", other);
    cr_expect(tu_contains(l[0].problem, want), "%s", l[0].problem);
    cr_expect_eq(l[1].incomplete, CKPT_INTERRUPTED, "%s", l[1].problem);
    cr_expect(l[2].ok && l[2].step == 10 && l[2].incomplete == 0);
    cr_expect_eq(l[3].incomplete, CKPT_INTERRUPTED, "%s", l[3].problem);
    free(l);

    find_latest("step-00000010");
    cr_assert_eq(bad_reports, 3, "every leftover is reported, the older one too");
    cr_expect_str_eq(reported[0], live);
    cr_expect(tu_contains(reasons[0], want) && tu_contains(reasons[0], "left alone"), "%s",
              reasons[0]);
    cr_expect_str_eq(reported[1], mine);
    cr_expect(tu_contains(reasons[1], "removed"), "%s", reasons[1]);
    cr_expect_str_eq(reported[2], gone);
    cr_expect(tu_contains(reasons[2], "removed"), "%s", reasons[2]);
    cr_expect(exists(live), "the live writer's %s was removed", live);
    cr_expect(!exists(mine) && !exists(gone));

    cr_assert_eq(ckpt_prune(dir, 1, 0, NULL, NULL, &err), 0, "%s", err.msg);
    cr_expect(exists(live), "retention removed the live writer's %s", live);
}

/* A writer that has exited but is not yet reaped (a zombie: killed ranks
 * re-parented to a PID 1 that does not reap) is gone: its leftover is
 * removed at once, not left alone as being written. */
Test(ckpt, leftover_of_a_zombie_writer_is_removed)
{
    free(write_step(10));
    int zombie = tu_zombie_pid();
    cr_assert_eq(kill(zombie, 0), 0, "a zombie still answers kill(pid, 0)");
    cr_expect(!sp_pid_running(zombie), "zombie %d counted as running", zombie);
    cr_expect(sp_pid_running((long)getpid()) && !sp_pid_running(tu_dead_pid()));
    char z[128];
    snprintf(z, sizeof z, "%s", leftover(30, zombie));
    find_latest("step-00000010");
    cr_assert_eq(bad_reports, 1);
    cr_expect_str_eq(reported[0], z);
    cr_expect(tu_contains(reasons[0], "removed") && !tu_contains(reasons[0], "left alone"), "%s",
              reasons[0]);
    cr_expect(!exists(z), "the zombie writer's %s is still there", z);
    tu_reap(zombie);
}

Test(ckpt, verify_of_a_missing_or_plain_path)
{
    char p[4200];
    ckpt_manifest m;
    sp_err err = {0};
    snprintf(p, sizeof p, "%s/step-00000099", dir);
    cr_expect_eq(ckpt_verify(p, &m, &err), SP_EXIT_INPUT);
    ckpt_manifest_free(&m);
    cr_expect(tu_contains(err.msg, p) && tu_contains(err.msg, "no such checkpoint directory"),
              "%s", err.msg);
    cr_assert_eq(tu_write_file(p, "not a directory\n"), 0);
    sp_err err2 = {0};
    cr_expect_eq(ckpt_verify(p, &m, &err2), SP_EXIT_INPUT);
    ckpt_manifest_free(&m);
    cr_expect(tu_contains(err2.msg, p) && tu_contains(err2.msg, "not a checkpoint directory"),
              "%s", err2.msg);
}

static int deleted;
static void count_deleted(void *ctx, const char *name)
{
    (void)ctx;
    (void)name;
    deleted++;
}

Test(ckpt, retention_keeps_newest_and_multiples)
{
    for (int s = 10; s <= 70; s += 10)
        free(write_step(s));
    leftover(80, tu_dead_pid());
    sp_err err = {0};
    deleted = 0;
    cr_assert_eq(ckpt_prune(dir, 2, 40, count_deleted, NULL, &err), 0);
    ckpt_info *l;
    int n;
    cr_assert_eq(ckpt_list(dir, 1, &l, &n, &err), 0);
    cr_assert_eq(n, 3, "70, 60 newest; 40 a multiple of 40; the dead .tmp removed");
    cr_expect_eq(l[0].step, 70);
    cr_expect_eq(l[1].step, 60);
    cr_expect_eq(l[2].step, 40);
    cr_expect_eq(deleted, 4);
    free(l);
}

Test(ckpt, rewriting_a_step_replaces_it)
{
    free(write_step(5));
    char *p = write_step(5);
    ckpt_manifest m;
    sp_err err = {0};
    cr_expect_eq(ckpt_verify(p, &m, &err), 0, "%s", err.msg);
    ckpt_manifest_free(&m);
    free(p);
}

static int written_ok;
static void on_written(void *ctx, const char *d, const ckpt_snapshot *s, double t, const sp_err *e)
{
    (void)ctx, (void)t, (void)e;
    if (d && s->step > 0)
        written_ok++;
}

Test(ckpt, background_writer_commits_each_snapshot)
{
    ckpt_writer *w;
    sp_err err = {0};
    cr_assert_eq(ckpt_writer_start(&w, dir, on_written, NULL, &err), 0);
    written_ok = 0;
    for (int s = 1; s <= 3; s++) {
        ckpt_snapshot snap;
        double waited;
        make_snapshot(&snap, s);
        cr_assert_eq(ckpt_writer_submit(w, &snap, &waited, &err), 0);
        cr_expect_eq(snap.narrays, 0, "the snapshot moved to the writer");
    }
    cr_expect_eq(ckpt_writer_wait(w, &err), 0);
    ckpt_writer_stop(w);
    cr_expect_eq(written_ok, 3);
    char p[4096];
    snprintf(p, sizeof p, "%s/step-00000003", dir);
    ckpt_manifest m;
    cr_expect_eq(ckpt_verify(p, &m, &err), 0, "%s", err.msg);
    ckpt_manifest_free(&m);
}

/* In a process of its own that starts as spotune's main does: a 2 MiB state
 * written to a 1 MiB tmpfs, the snapshot understating its size so that the
 * check of free space beforehand lets it through and HDF5 meets the full disk
 * itself. The write fails naming the file and the cause, leaves nothing
 * behind and no space taken; the next checkpoint, which fits, is written and
 * reads back; and the process ends normally (libhdf5 1.10 crashed at exit on
 * a file whose close had failed). Returns what went wrong (0: nothing). */
static int write_to_a_full_disk(const char *root, char *why, size_t n)
{
    ckpt_hdf5_setup();
    long free0 = tu_free_kib(root);
    ckpt_snapshot s;
    sp_err err = {0};
    make_snapshot(&s, 7);
    int64_t shape[1] = {1 << 19};
    float *big = ckpt_add_array(&s, "params/big", 1, shape);
    for (int i = 0; big && i < (1 << 19); i++)
        big[i] = (float)i;
    s.bytes = 1024;
    if (ckpt_write(root, &s, NULL, &err) == 0)
        return snprintf(why, n, "a 2 MiB state fitted in 1 MiB");
    if (!tu_contains(err.msg, "state.h5") || !tu_contains(err.msg, "No space left"))
        return snprintf(why, n, "the error does not name the file and the cause: %s", err.msg);
    ckpt_snapshot_free(&s);
    ckpt_info *l;
    int k;
    if (ckpt_list(root, 0, &l, &k, &err) || k != 0)
        return snprintf(why, n, "%d entries left in %s: %s", k, root, err.msg);
    free(l);
    long free1 = tu_free_kib(root);
    if (free1 < free0 - 8)
        return snprintf(why, n, "the failed write still holds %ld KiB", free0 - free1);
    char *out;
    make_snapshot(&s, 8);
    if (ckpt_write(root, &s, &out, &err))
        return snprintf(why, n, "the next checkpoint: %s", err.msg);
    ckpt_snapshot_free(&s);
    int bad = ckpt_read(out, &s, &err) || s.step != 8;
    free(out);
    if (bad)
        return snprintf(why, n, "the next checkpoint reads back: %s", err.msg);
    ckpt_snapshot_free(&s);
    ckpt_hdf5_shutdown();
    return 0;
}

Test(ckpt, disk_full_during_the_write_fails_cleanly)
{
    char root[4096];
    snprintf(root, sizeof root, "%s/tfs", dir);
    cr_assert_eq(tu_mount_tmpfs(root, 1024), 0, "cannot mount a tmpfs at %s (needs root)", root);
    int fds[2];
    cr_assert_eq(pipe(fds), 0);
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        char why[2048] = "";
        int bad = write_to_a_full_disk(root, why, sizeof why);
        if (write(fds[1], why, strlen(why)) < 0)
            bad = 1;
        exit(bad ? 1 : 0); /* runs the exit handlers, as spotune's exit does */
    }
    close(fds[1]);
    char why[2048] = "";
    ssize_t got = read(fds[0], why, sizeof why - 1);
    why[got > 0 ? got : 0] = 0;
    close(fds[0]);
    int st = 0;
    cr_assert_eq(waitpid(pid, &st, 0), pid);
    cr_expect(WIFEXITED(st), "the process died of signal %d at its end", WTERMSIG(st));
    cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 0, "%s", why);
}

/* The check of free space beforehand: a state that cannot fit is refused
 * before HDF5 writes anything, with the sizes in the message. */
Test(ckpt, a_state_larger_than_the_free_space_is_refused_beforehand)
{
    char root[4096];
    snprintf(root, sizeof root, "%s/tfs", dir);
    cr_assert_eq(tu_mount_tmpfs(root, 512), 0, "cannot mount a tmpfs at %s (needs root)", root);
    ckpt_snapshot s;
    sp_err err = {0};
    make_snapshot(&s, 3);
    int64_t shape[1] = {1 << 18}; /* 1 MiB */
    cr_assert(ckpt_add_array(&s, "params/big", 1, shape));
    cr_assert_neq(ckpt_write(root, &s, NULL, &err), 0);
    cr_expect(tu_contains(err.msg, "no space for checkpoint step 3") &&
                  tu_contains(err.msg, "MiB free"),
              "%s", err.msg);
    ckpt_snapshot_free(&s);
    cr_expect_neq(tu_sh(NULL, "ls -A %s | grep -q .", root), 0, "%s is not empty", root);
}

/* ---- state.h5 damaged before its checksum was taken ------------------------------ */

/* A checkpoint whose state.h5 is replaced by one made by `make`. */
static char *crafted_checkpoint(int64_t step, void (*make)(hid_t f))
{
    char *ck = write_step(step);
    char state[4096];
    snprintf(state, sizeof state, "%s/%s", ck, CKPT_STATE_FILE);
    hid_t f = H5Fcreate(state, H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
    cr_assert_geq(f, 0);
    make(f);
    cr_assert_geq(H5Fclose(f), 0);
    cr_assert_eq(tu_remanifest(ck), 0);
    return ck;
}

static void expect_refused(const char *ck, const char *why)
{
    ckpt_snapshot s;
    sp_err err = {0};
    int rc = ckpt_read(ck, &s, &err);
    cr_expect_eq(rc, SP_EXIT_INPUT, "rc %d: %s", rc, err.msg);
    cr_expect(tu_contains(err.msg, ck) && tu_contains(err.msg, "state.h5") &&
                  tu_contains(err.msg, why),
              "'%s' lacks the file or '%s'", err.msg, why);
}

static void make_array_attr(hid_t f)
{
    hsize_t n = 64;
    int64_t v[64] = {0};
    hid_t sp = H5Screate_simple(1, &n, NULL);
    hid_t a = H5Acreate2(f, "cursor", H5T_STD_I64LE, sp, H5P_DEFAULT, H5P_DEFAULT);
    cr_assert_geq(H5Awrite(a, H5T_NATIVE_INT64, v), 0);
    H5Aclose(a);
    H5Sclose(sp);
}

static void make_fixed_string_attr(hid_t f)
{
    hid_t sp = H5Screate(H5S_SCALAR), ty = H5Tcopy(H5T_C_S1);
    H5Tset_size(ty, 8);
    hid_t a = H5Acreate2(f, "config", ty, sp, H5P_DEFAULT, H5P_DEFAULT);
    cr_assert_geq(H5Awrite(a, ty, "abcdefgh"), 0);
    H5Aclose(a);
    H5Tclose(ty);
    H5Sclose(sp);
}

static void make_int_dataset(hid_t f)
{
    hsize_t n = 4;
    int32_t v[4] = {1, 2, 3, 4};
    hid_t sp = H5Screate_simple(1, &n, NULL);
    hid_t d = H5Dcreate2(f, "params.x", H5T_STD_I32LE, sp, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    cr_assert_geq(H5Dwrite(d, H5T_NATIVE_INT32, H5S_ALL, H5S_ALL, H5P_DEFAULT, v), 0);
    H5Dclose(d);
    H5Sclose(sp);
}

static void make_huge_dataset(hid_t f)
{
    hsize_t n[2] = {(hsize_t)1 << 20, (hsize_t)1 << 20}; /* 4 TiB, never written */
    hid_t sp = H5Screate_simple(2, n, NULL);
    hid_t d = H5Dcreate2(f, "params.x", H5T_IEEE_F32LE, sp, H5P_DEFAULT, H5P_DEFAULT,
                         H5P_DEFAULT);
    cr_assert_geq(d, 0);
    H5Dclose(d);
    H5Sclose(sp);
}

/* A state.h5 that matches its MANIFEST but holds what spotune never writes is
 * refused by name before any value is read into memory sized for it. */
Test(ckpt, damaged_state_matching_its_manifest_is_refused)
{
    H5Eset_auto2(H5E_DEFAULT, NULL, NULL);
    char *ck = crafted_checkpoint(11, make_array_attr);
    expect_refused(ck, "attribute 'cursor' is not a single value");
    free(ck);
    ck = crafted_checkpoint(12, make_fixed_string_attr);
    expect_refused(ck, "attribute 'config' is neither a number nor a string");
    free(ck);
    ck = crafted_checkpoint(13, make_int_dataset);
    expect_refused(ck, "dataset 'params.x' is not an array of float32");
    free(ck);
    ck = crafted_checkpoint(14, make_huge_dataset);
    expect_refused(ck, "dataset 'params.x' claims more data than the file holds");
    free(ck);
}

/* A MANIFEST that does not list state.h5 would leave it unchecked: such a
 * checkpoint is refused, naming the file, even though state.h5 is there. */
Test(ckpt, manifest_that_does_not_list_state_is_refused)
{
    char *p = write_step(15);
    char path[4200];
    snprintf(path, sizeof path, "%s/MANIFEST.json", p);
    json_error_t je;
    json_t *m = json_load_file(path, 0, &je);
    cr_assert(m, "%s", je.text);
    cr_assert_eq(json_object_del(json_object_get(m, "files"), "state.h5"), 0);
    /* (another file listed, so that MANIFEST still names some: an empty one) */
    const char *empty_sha = "e3b0c44298fc1c149afbf4c8996fb924"
                            "27ae41e4649b934ca495991b7852b855";
    cr_assert_eq(json_object_set_new(json_object_get(m, "files"), "metrics.jsonl",
                                     json_pack("{s:i, s:s}", "size", 0, "sha256", empty_sha)),
                 0);
    cr_assert_eq(json_dump_file(m, path, JSON_INDENT(2)), 0);
    json_decref(m);
    cr_assert_eq(tu_write_file(tu_fmt("%s/metrics.jsonl", p), ""), 0);
    expect_bad(p, "MANIFEST.json does not list state.h5");
    free(p);
}
