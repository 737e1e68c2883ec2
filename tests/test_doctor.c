/* spotune doctor (trainer/doctor.c), run as a program:
 *   - without a config: host and storage lines, every GPU line SKIPPED with
 *     the CUDA error (no GPU here), exit 0; --json is one valid JSON
 *     document with an object per check and counts that add up;
 *   - bad options and a bad config: a clear error and exit 2;
 *   - the object store, against the local S3 test server: good credentials
 *     PASS (probe put, read back, listed, deleted; upload; clock skew), the
 *     config's model, data and memory plan PASS; a wrong secret FAILs naming
 *     the 403 and never shows the secret; a missing bucket FAILs naming it;
 *     missing credentials FAIL naming the variable; an endpoint that
 *     refuses connections FAILs within seconds (measured), one that accepts
 *     and never answers within --timeout per request; exit 1 on each FAIL;
 *   - a read-only run directory (a read-only tmpfs): FAIL naming it; a
 *     damaged model or dataset, and a memory plan that does not fit (with
 *     the change that makes it fit): FAIL;
 *   - the preemption notice against the fake metadata service that
 *     tests/test_spot_run.sh uses: the cloud found, no notice PASS, a notice
 *     FAIL (exit 1), for each cloud;
 *   - under mpirun -np 2: one report from rank 0 (2 ranks), both ranks exit 0;
 *   - the CUDA module exports the entry points the GPU lines look up;
 *   - the store's clock against a Date header 5 and 20 minutes off
 *     (tests/tools/skewed_date.py): WARN, FAIL;
 *   - NCCL_SOCKET_IFNAME honoured; an open-file limit of 1024 WARNs.
 * host.blas: test_doctor_blas.c. The S3 server comes from tests/store.cmake's fixture (tu_s3_endpoint). */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <jansson.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "base/base.h"
#include "checkpoint/store.h"
#include "doctor_report.h"
#include "test_util.h"

static char *dir;
static char url[512];

static void setup(void)
{
    dir = tu_tiny_dir("doctor", 3, 5);
    snprintf(url, sizeof url, "s3://spotune-doctor-test/run-%d-%ld", (int)getpid(),
             (long)(sp_wall_time() * 1000) % 100000000);
}

static void teardown(void)
{
    tu_rmtree(dir);
    free(dir);
}

TestSuite(doctor, .init = setup, .fini = teardown, .timeout = 300);

static void make_bucket(void)
{
    store_opts o = {0};
    o.endpoint = tu_s3_endpoint();
    o.addressing = STORE_ADDR_PATH;
    store_t *st;
    sp_err err = {0};
    cr_assert_eq(store_open(&st, url, &o, &err), 0, "%s", err.msg);
    cr_assert_eq(store_create_bucket(st, &err), 0, "%s", err.msg);
    store_close(st);
}

/* storage.write wrote and fsync'ed its file and measured the rate. PASS or
 * WARN is the disk's speed against 100 MB/s, which a shared test machine's
 * disk straddles: a test asserts that the check ran, not how fast. */
#define EXPECT_WRITE_MEASURED(out)                                                             \
    cr_expect((has_status(out, "storage.write", "PASS") ||                                     \
               has_status(out, "storage.write", "WARN")) &&                                    \
                  tu_contains(line_of(out, "storage.write"), " MB/s (") &&                     \
                  tu_contains(line_of(out, "storage.write"), "written and fsync'ed"),          \
              "storage.write: '%s'\n%s", line_of(out, "storage.write"), out)

Test(doctor, no_config_host_storage_and_gpu_skipped)
{
    char *out = NULL;
    int rc = tu_spotune(&out, "doctor --cloud none");
    cr_expect_eq(rc, 0, "exit %d\n%s", rc, out);
    const char *host[] = {"host.cpu", "host.memory", "host.open_files", "host.shm",
                          "host.network", "host.mpi", "storage.free", "storage.write"};
    for (size_t i = 0; i < sizeof host / sizeof host[0]; i++)
        cr_expect(line_of(out, host[i])[0], "no %s line:\n%s", host[i], out);
    EXPECT_WRITE_MEASURED(out);
    const char *gpu[] = {"gpu.devices", "gpu.gemm_bf16", "gpu.memcopy", "gpu.p2p",
                         "gpu.nccl_allreduce"};
    for (size_t i = 0; i < sizeof gpu / sizeof gpu[0]; i++) {
        EXPECT_STATUS(out, gpu[i], "SKIPPED");
        const char *l = line_of(out, gpu[i]);
        cr_expect(tu_contains(l, "cudaGetDeviceCount") ||
                      tu_contains(l, "built without the CUDA backend") ||
                      tu_contains(l, "cannot be loaded"),
                  "%s does not say why: %s", gpu[i], l);
    }
    EXPECT_STATUS(out, "store", "SKIPPED");
    cr_expect(tu_contains(out, "0 FAIL"), "%s", out);
    free(out);
}

Test(doctor, json_one_object_per_check)
{
    char *out = NULL;
    int rc = tu_sh(&out, "cd %s && %s/spotune doctor --cloud none --json 2>/dev/null", dir,
                   tu_binary_dir());
    cr_assert_eq(rc, 0, "exit %d\n%s", rc, out);
    json_error_t je;
    json_t *doc = json_loads(out, 0, &je);
    cr_assert(doc, "not JSON (%s, line %d):\n%s", je.text, je.line, out);
    json_t *checks = json_object_get(doc, "checks");
    cr_assert(json_is_array(checks) && json_array_size(checks) >= 10, "%s", out);
    int counts[4] = {0};
    const char *names[4] = {"PASS", "WARN", "FAIL", "SKIPPED"};
    for (size_t i = 0; i < json_array_size(checks); i++) {
        json_t *c = json_array_get(checks, i);
        const char *st = json_string_value(json_object_get(c, "status"));
        cr_assert(json_is_string(json_object_get(c, "check")), "check %zu has no name", i);
        cr_assert(json_is_string(json_object_get(c, "measured")), "check %zu", i);
        cr_assert(json_is_string(json_object_get(c, "expected")), "check %zu", i);
        int k = -1;
        for (int j = 0; j < 4; j++)
            if (st && !strcmp(st, names[j]))
                k = j;
        cr_assert(k >= 0, "check %zu has status %s", i, st ? st : "(none)");
        counts[k]++;
    }
    json_t *sum = json_object_get(doc, "summary");
    cr_expect_eq(json_integer_value(json_object_get(sum, "pass")), counts[0]);
    cr_expect_eq(json_integer_value(json_object_get(sum, "warn")), counts[1]);
    cr_expect_eq(json_integer_value(json_object_get(sum, "fail")), counts[2]);
    cr_expect_eq(json_integer_value(json_object_get(sum, "skipped")), counts[3]);
    cr_expect_eq(json_integer_value(json_object_get(doc, "exit")), 0);
    cr_expect_eq(json_integer_value(json_object_get(doc, "ranks")), 1);
    json_decref(doc);
    free(out);
}

Test(doctor, bad_options_and_configs_exit_2)
{
    static const struct {
        const char *args, *says;
    } cases[] = {
        {"--cloud mars", "--cloud takes auto, aws, gcp, azure, alibaba or none, got 'mars'"},
        {"--io-mib 0", "--io-mib takes 1 to 4096, got '0'"},
        {"--io-mib 12x", "--io-mib takes 1 to 4096, got '12x'"},
        {"--gemm-n 32", "--gemm-n takes 64 to 16384, got '32'"},
        {"--gemm-n ''", "--gemm-n takes 64 to 16384, got ''"},
        {"--gpu-mib 5000", "--gpu-mib takes 1 to 4096, got '5000'"},
        {"--gpu-mib 1.5", "--gpu-mib takes 1 to 4096, got '1.5'"},
        {"--timeout -3", "--timeout takes seconds in (0, 3600], got '-3'"},
        {"--metadata-url ftp://x", "--metadata-url takes an http(s):// URL"},
        {"--remote ftp://bucket", "--remote takes s3://bucket[/prefix] or file:///path"},
        {"--frobnicate", "unknown option '--frobnicate'"},
        {"a.yaml b.yaml", "one config at most, got also 'b.yaml'"},
        {"--endpoint http://127.0.0.1:9", "give --remote URL or a config with checkpoint.remote"},
        {"/nonexistent/run.yaml", "/nonexistent/run.yaml"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *out = NULL;
        int rc = tu_spotune(&out, "doctor %s", cases[i].args);
        cr_expect_eq(rc, 2, "doctor %s: exit %d\n%s", cases[i].args, rc, out);
        cr_expect(tu_contains(out, cases[i].says), "doctor %s does not say '%s':\n%s",
                  cases[i].args, cases[i].says, out);
        free(out);
    }
    /* a config with a bad value: the config's own message, exit 2 */
    tu_run_yaml(dir, "train:\n  lr: -1\n");
    char *out = NULL;
    int rc = tu_spotune(&out, "doctor %s/run.yaml --cloud none", dir);
    cr_expect_eq(rc, 2, "exit %d\n%s", rc, out);
    cr_expect(tu_contains(out, "train.lr"), "%s", out);
    free(out);
    /* --help: exit 0 */
    rc = tu_spotune(&out, "doctor --help");
    cr_expect_eq(rc, 0, "%s", out);
    cr_expect(tu_contains(out, "usage: spotune doctor"), "%s", out);
    free(out);
}

/* A config of the tiny model with the remote store (rest from extra). */
static void remote_yaml(const char *extra)
{
    tu_run_yaml(dir,
                "run:\n  dir: %s/run\n  seed: 3\n"
                "train:\n  mode: lora\n  steps: 10\n  seq_len: 32\n  micro_batch: 2\n"
                "lora:\n  r: 2\n  alpha: 4\n  targets: [q_proj]\n"
                "runtime:\n  backend: cpu\n  threads: 1\n"
                "checkpoint:\n  remote: %s\n  endpoint: %s\n  region: us-east-1\n"
                "  addressing: path\n%s",
                dir, url, tu_s3_endpoint(), extra ? extra : "");
}

Test(doctor, store_good_credentials_pass)
{
    make_bucket();
    remote_yaml(NULL);
    char *out = NULL;
    int rc = tu_spotune(&out, "doctor %s/run.yaml --cloud none --io-mib 16", dir);
    cr_expect_eq(rc, 0, "exit %d\n%s", rc, out);
    EXPECT_STATUS(out, "store.credentials", "PASS");
    EXPECT_STATUS(out, "store.roundtrip", "PASS");
    cr_expect(has_status(out, "store.upload", "PASS") || has_status(out, "store.upload", "WARN"),
              "%s", out);
    EXPECT_STATUS(out, "store.clock_skew", "PASS");
    EXPECT_STATUS(out, "config.model", "PASS");
    EXPECT_STATUS(out, "config.data_train", "PASS");
    EXPECT_STATUS(out, "config.memory_plan", "PASS");
    EXPECT_WRITE_MEASURED(out);
    cr_expect(tu_contains(line_of(out, "storage.free"), "does not exist yet"), "%s", out);
    cr_expect(!tu_contains(out, getenv("AWS_SECRET_ACCESS_KEY")), "the secret is shown:\n%s",
              out);
    free(out);
    /* the probe objects are gone */
    store_opts o = {0};
    o.endpoint = tu_s3_endpoint();
    o.addressing = STORE_ADDR_PATH;
    store_t *st;
    sp_err err = {0};
    store_listing ls = {0};
    cr_assert_eq(store_open(&st, url, &o, &err), 0, "%s", err.msg);
    cr_assert_eq(store_list(st, "", &ls, &err), 0, "%s", err.msg);
    cr_expect_eq(ls.n, 0, "%zu objects left, the first %s", ls.n, ls.n ? ls.items[0].key : "");
    store_list_free(&ls);
    store_close(st);
}

Test(doctor, store_bad_credentials_fail_naming_the_cause)
{
    make_bucket();
    remote_yaml(NULL);
    char *out = NULL;
    int rc = tu_sh(&out, "AWS_SECRET_ACCESS_KEY=not-the-secret-9d1c %s/spotune doctor %s/run.yaml "
                         "--cloud none --io-mib 4",
                   tu_binary_dir(), dir);
    cr_expect_eq(rc, 1, "exit %d\n%s", rc, out);
    EXPECT_STATUS(out, "store.credentials", "PASS"); /* found: the store refuses them */
    EXPECT_STATUS(out, "store.roundtrip", "FAIL");
    const char *l = line_of(out, "store.roundtrip");
    cr_expect(tu_contains(l, "403"), "no 403: %s", l);
    cr_expect(tu_contains(l, "refused the credentials"), "no cause: %s", l);
    EXPECT_STATUS(out, "store.upload", "SKIPPED");
    cr_expect(!tu_contains(out, "not-the-secret-9d1c"), "the secret is shown:\n%s", out);
    cr_expect(tu_contains(out, "this machine is not ready (exit 1)"), "%s", out);
    free(out);

    rc = tu_sh(&out, "env -u AWS_ACCESS_KEY_ID %s/spotune doctor %s/run.yaml --cloud none",
               tu_binary_dir(), dir);
    cr_expect_eq(rc, 1, "exit %d\n%s", rc, out);
    EXPECT_STATUS(out, "store.credentials", "FAIL");
    cr_expect(tu_contains(line_of(out, "store.credentials"),
                          "AWS_SECRET_ACCESS_KEY is set but AWS_ACCESS_KEY_ID is not"),
              "%s", out);
    free(out);
}

/* No credentials in the environment: the EC2 instance role's, from the
 * metadata service (a fake that hands out the test server's key): PASS
 * naming the role and until when they hold, and the store takes the
 * probes; with the service gone, FAIL naming it. */
Test(doctor, store_credentials_of_an_instance_role)
{
    make_bucket();
    remote_yaml(NULL);
    char *creds = sp_strf("%s/creds.json", dir), *log = sp_strf("%s/meta.log", dir);
    char *json = sp_strf("{\"role\": \"spotune-doctor-role\", \"AccessKeyId\": \"%s\", "
                         "\"SecretAccessKey\": \"%s\", \"Token\": \"tok\"}",
                         getenv("AWS_ACCESS_KEY_ID"), getenv("AWS_SECRET_ACCESS_KEY"));
    cr_assert_eq(tu_write_file(creds, json), 0);
    char meta[64], *args = sp_strf("--creds %s", creds);
    int pid = tu_fake_metadata(log, args, meta, sizeof meta);
    char *out = NULL;
    const char *no_env = "env -u AWS_ACCESS_KEY_ID -u AWS_SECRET_ACCESS_KEY -u AWS_SESSION_TOKEN "
                         "-u AWS_EC2_METADATA_DISABLED";
    int rc = tu_sh(&out, "%s AWS_EC2_METADATA_SERVICE_ENDPOINT=%s %s/spotune doctor %s/run.yaml "
                         "--cloud none --io-mib 1",
                   no_env, meta, tu_binary_dir(), dir);
    EXPECT_STATUS(out, "store.credentials", "PASS");
    cr_expect(tu_contains(line_of(out, "store.credentials"),
                          "the EC2 instance role 'spotune-doctor-role' (metadata service http"),
              "%s", out);
    cr_expect(tu_contains(line_of(out, "store.credentials"), "valid until 20"), "%s", out);
    EXPECT_STATUS(out, "store.roundtrip", "PASS");
    cr_expect(!tu_contains(out, getenv("AWS_SECRET_ACCESS_KEY")), "the secret is shown:\n%s",
              out);
    (void)rc;
    free(out);
    kill(pid, SIGTERM);
    tu_wait(pid, 10);
    rc = tu_sh(&out, "%s AWS_EC2_METADATA_SERVICE_ENDPOINT=%s %s/spotune doctor %s/run.yaml "
                     "--cloud none --io-mib 1",
               no_env, meta, tu_binary_dir(), dir);
    cr_expect_eq(rc, 1, "exit %d\n%s", rc, out);
    EXPECT_STATUS(out, "store.credentials", "FAIL");
    cr_expect(tu_contains(line_of(out, "store.credentials"), "no EC2 instance role's could be had "
                                                             "from the metadata service at http"),
              "%s", out);
    free(out);
    free(creds), free(log), free(json), free(args);
}

/* A bucket that does not exist: FAIL naming it (404 NoSuchBucket). */
Test(doctor, store_no_such_bucket_fails_naming_it)
{
    char *out = NULL;
    int rc = tu_spotune(&out,
                        "doctor --remote s3://spotune-doctor-no-such-bucket/p --endpoint %s "
                        "--path-style --cloud none --io-mib 1",
                        tu_s3_endpoint());
    cr_expect_eq(rc, 1, "exit %d\n%s", rc, out);
    EXPECT_STATUS(out, "store.roundtrip", "FAIL");
    const char *l = line_of(out, "store.roundtrip");
    cr_expect(tu_contains(l, "NoSuchBucket") && tu_contains(l, "[cause: no such bucket]"), "%s",
              l);
    EXPECT_STATUS(out, "store.clock_skew", "PASS"); /* the store answers */
    free(out);
}

Test(doctor, store_endpoint_down_fails_in_seconds)
{
    remote_yaml(NULL);
    char *out = NULL;
    double t0 = sp_now();
    /* port 9 (discard): nothing listens, the connection is refused */
    int rc = tu_spotune(&out, "doctor %s/run.yaml --cloud none --endpoint http://127.0.0.1:9",
                        dir);
    double dt = sp_now() - t0;
    cr_expect_eq(rc, 1, "exit %d\n%s", rc, out);
    EXPECT_STATUS(out, "store.roundtrip", "FAIL");
    EXPECT_STATUS(out, "store.clock_skew", "FAIL");
    cr_expect(dt < 10, "took %.1f s:\n%s", dt, out);
    cr_log_info("endpoint down: doctor ended in %.2f s", dt);
    free(out);
}

/* A store that accepts connections and never answers (the proxy stopped):
 * FAIL within --timeout per request, not after the uploader's patience. */
Test(doctor, store_that_never_answers_fails_within_the_timeout)
{
    make_bucket();
    remote_yaml(NULL);
    tu_proxy_freeze(60);
    char *out = NULL;
    double t0 = sp_now();
    int rc = tu_spotune(&out, "doctor %s/run.yaml --cloud none --io-mib 1 --timeout 3", dir);
    double dt = sp_now() - t0;
    tu_proxy_thaw();
    cr_expect_eq(rc, 1, "exit %d\n%s", rc, out);
    EXPECT_STATUS(out, "store.roundtrip", "FAIL");
    EXPECT_STATUS(out, "store.clock_skew", "FAIL");
    /* two requests of 3 s at most (the probe PUT, the HEAD for the Date) */
    cr_expect(dt < 12, "took %.1f s:\n%s", dt, out);
    cr_log_info("store frozen: doctor ended in %.2f s", dt);
    free(out);
}

Test(doctor, read_only_run_dir_fails_naming_it)
{
    char *ro = sp_strf("%s/ro", dir);
    if (tu_mount_tmpfs(ro, 1024) != 0 || tu_sh(NULL, "mount -o remount,ro '%s'", ro) != 0)
        cr_skip_test("cannot mount a read-only tmpfs here (needs root)");
    tu_run_yaml(dir, "run:\n  dir: %s\nruntime:\n  backend: cpu\n", ro);
    char *out = NULL;
    int rc = tu_spotune(&out, "doctor %s/run.yaml --cloud none", dir);
    cr_expect_eq(rc, 1, "exit %d\n%s", rc, out);
    EXPECT_STATUS(out, "storage.write", "FAIL");
    const char *l = line_of(out, "storage.write");
    cr_expect(tu_contains(l, ro) && tu_contains(l, "read-only"), "%s", l);
    free(out);
    /* a run directory still to be made under it: the same */
    tu_run_yaml(dir, "run:\n  dir: %s/sub/run\nruntime:\n  backend: cpu\n", ro);
    rc = tu_spotune(&out, "doctor %s/run.yaml --cloud none", dir);
    cr_expect_eq(rc, 1, "exit %d\n%s", rc, out);
    EXPECT_STATUS(out, "storage.write", "FAIL");
    free(out);
    free(ro);
}

Test(doctor, bad_model_and_data_fail)
{
    tu_run_yaml(dir, "run:\n  dir: %s/run\nruntime:\n  backend: cpu\n", dir);
    /* the model's config.json damaged, then the data file */
    cr_assert_eq(tu_write_file(tu_fmt("%s/model/config.json", dir), "{\"model_type\": 7"), 0);
    char *out = NULL;
    int rc = tu_spotune(&out, "doctor %s/run.yaml --cloud none", dir);
    cr_expect_eq(rc, 1, "exit %d\n%s", rc, out);
    EXPECT_STATUS(out, "config.model", "FAIL");
    cr_expect(tu_contains(line_of(out, "config.model"), "config.json"), "%s", out);
    EXPECT_STATUS(out, "config.data_train", "SKIPPED");
    free(out);
}

Test(doctor, bad_data_fails)
{
    tu_run_yaml(dir, "run:\n  dir: %s/run\nruntime:\n  backend: cpu\n", dir);
    cr_assert_eq(tu_write_file(tu_fmt("%s/data.train.h5", dir), "not hdf5"), 0);
    char *out = NULL;
    int rc = tu_spotune(&out, "doctor %s/run.yaml --cloud none", dir);
    cr_expect_eq(rc, 1, "exit %d\n%s", rc, out);
    EXPECT_STATUS(out, "config.model", "PASS");
    EXPECT_STATUS(out, "config.data_train", "FAIL");
    cr_expect(tu_contains(line_of(out, "config.data_train"), "data.train.h5"), "%s", out);
    free(out);
}

Test(doctor, preemption_notice_from_fake_metadata)
{
    char *log = sp_strf("%s/meta.port", dir), *trigger = sp_strf("%s/notice", dir);
    char meta[64], *args = sp_strf("--trigger %s", trigger);
    int pid = tu_fake_metadata(log, args, meta, sizeof meta);
    free(args);
    char *out = NULL;
    /* auto: the first cloud that answers (the fake answers AWS's token) */
    int rc = tu_spotune(&out, "doctor --metadata-url %s", meta);
    cr_expect_eq(rc, 0, "exit %d\n%s", rc, out);
    EXPECT_STATUS(out, "preemption.cloud", "PASS");
    cr_expect(tu_contains(line_of(out, "preemption.cloud"), "aws"), "%s", out);
    EXPECT_STATUS(out, "preemption.notice", "PASS");
    free(out);
    cr_assert_eq(tu_write_file(trigger, ""), 0);
    const char *clouds[] = {"aws", "gcp", "azure", "alibaba"};
    for (int i = 0; i < 4; i++) {
        rc = tu_spotune(&out, "doctor --cloud %s --metadata-url %s --io-mib 1", clouds[i], meta);
        cr_expect_eq(rc, 1, "%s: exit %d\n%s", clouds[i], rc, out);
        EXPECT_STATUS(out, "preemption.notice", "FAIL");
        cr_expect(tu_contains(line_of(out, "preemption.notice"), "termination notice is pending"),
                  "%s", out);
        free(out);
    }
    unlink(trigger);
    rc = tu_spotune(&out, "doctor --cloud gcp --metadata-url %s --io-mib 1", meta);
    cr_expect_eq(rc, 0, "exit %d\n%s", rc, out);
    EXPECT_STATUS(out, "preemption.notice", "PASS");
    free(out);
    kill(pid, SIGTERM);
    tu_wait(pid, 10);
    /* nothing listening: no cloud, SKIPPED with the reason, quickly */
    double t0 = sp_now();
    rc = tu_spotune(&out, "doctor --metadata-url %s --io-mib 1", meta);
    cr_expect_eq(rc, 0, "exit %d\n%s", rc, out);
    EXPECT_STATUS(out, "preemption.cloud", "SKIPPED");
    cr_expect(tu_contains(line_of(out, "preemption.cloud"), "no cloud metadata service answered"),
              "%s", out);
    cr_expect(sp_now() - t0 < 10, "%.1f s", sp_now() - t0);
    free(out);
    free(log);
    free(trigger);
}

Test(doctor, mpirun_two_ranks_one_report)
{
    char *out = NULL;
    int rc = tu_sh(&out, "cd %s && %s %s/spotune doctor --cloud none --io-mib 4 --json", dir,
                   tu_mpirun(2), tu_binary_dir());
    cr_assert_eq(rc, 0, "exit %d\n%s", rc, out);
    /* (a sanitizer build: the ranks' own reports reach this output only) */
    cr_expect(!tu_contains(out, "LeakSanitizer") && !tu_contains(out, "AddressSanitizer") &&
                  !tu_contains(out, "runtime error:"),
              "a sanitizer report:\n%s", out);
    /* one JSON document: rank 0 prints, the other rank does not */
    const char *start = strchr(out, '{');
    cr_assert(start, "%s", out);
    json_error_t je;
    json_t *doc = json_loadb(start, strlen(start), JSON_DISABLE_EOF_CHECK, &je);
    cr_assert(doc, "not JSON (%s):\n%s", je.text, out);
    cr_expect_eq(json_integer_value(json_object_get(doc, "ranks")), 2, "%s", out);
    cr_expect_eq(json_integer_value(json_object_get(doc, "hosts")), 1, "%s", out);
    cr_expect_eq(json_integer_value(json_object_get(doc, "exit")), 0, "%s", out);
    json_t *checks = json_object_get(doc, "checks");
    int mpi = 0, writes = 0;
    for (size_t i = 0; i < json_array_size(checks); i++) {
        const char *n = json_string_value(json_object_get(json_array_get(checks, i), "check"));
        const char *m = json_string_value(json_object_get(json_array_get(checks, i), "measured"));
        if (n && !strcmp(n, "host.mpi")) {
            mpi++;
            cr_expect(m && tu_contains(m, "2 ranks on 1 host"), "%s", m ? m : "");
        }
        if (n && !strcmp(n, "storage.write"))
            writes++;
    }
    cr_expect_eq(mpi, 1, "%s", out);
    cr_expect_eq(writes, 1, "the host's checks ran once per host:\n%s", out);
    int docs = 0;
    for (const char *p = out; (p = strstr(p, "\"spotune\":")); p++)
        docs++;
    cr_expect_eq(docs, 1, "%d reports:\n%s", docs, out);
    json_decref(doc);
    free(out);

    /* a FAIL on rank 0 (a store that refuses connections) makes every rank exit 1 */
    rc = tu_sh(&out, "cd %s && %s %s/spotune doctor --cloud none --io-mib 1 --remote "
                     "s3://b/p --endpoint http://127.0.0.1:9",
               dir, tu_mpirun(2), tu_binary_dir());
    cr_expect_eq(rc, 1, "exit %d\n%s", rc, out);
    free(out);
}

Test(doctor, memory_plan_that_does_not_fit_fails_with_a_fix)
{
    tu_run_yaml(dir,
                "run:\n  dir: %s/run\ntrain:\n  mode: full\n  seq_len: 4096\n"
                "  micro_batch: 4096\nruntime:\n  backend: cpu\n",
                dir);
    char *out = NULL;
    int rc = tu_spotune(&out, "doctor %s/run.yaml --cloud none --io-mib 1", dir);
    cr_expect_eq(rc, 1, "exit %d\n%s", rc, out);
    EXPECT_STATUS(out, "config.memory_plan", "FAIL");
    const char *l = line_of(out, "config.memory_plan");
    cr_expect(tu_contains(l, "it does not fit; train.micro_batch"), "%s", l);
    free(out);
    /* the tiny model at its ordinary size fits */
    tu_run_yaml(dir, "run:\n  dir: %s/run\ntrain:\n  seq_len: 32\n  micro_batch: 2\n"
                     "runtime:\n  backend: cpu\n",
                dir);
    rc = tu_spotune(&out, "doctor %s/run.yaml --cloud none --io-mib 1", dir);
    cr_expect_eq(rc, 0, "exit %d\n%s", rc, out);
    EXPECT_STATUS(out, "config.memory_plan", "PASS");
    free(out);
}

/* The GPU lines' entry points are in the CUDA module under the names the
 * doctor looks up (a check that needs no GPU: the module loads here, only
 * cudaGetDeviceCount fails). */
Test(doctor, cuda_module_has_the_doctor_entry_points)
{
    static const char *const names[] = {"cuda_doctor_info",  "cuda_doctor_gemm",
                                        "cuda_doctor_copy",  "cuda_doctor_p2p",
                                        "cuda_doctor_alloc", "cuda_doctor_free",
                                        "cuda_doctor_sync"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        char why[1024] = "";
        void *sym = backend_cuda_symbol(names[i], why, sizeof why);
#ifdef SPOTUNE_WITH_CUDA
        if (!sym && tu_contains(why, "cannot be loaded"))
            cr_skip_test("the CUDA module cannot be loaded here: %s", why);
        cr_expect(sym != NULL, "%s: %s", names[i], why);
#else
        cr_expect(sym == NULL && tu_contains(why, "built without the CUDA backend"), "%s: %s",
                  names[i], why);
#endif
    }
    char why[1024] = "";
    cr_expect(backend_cuda_symbol("cuda_doctor_no_such_thing", why, sizeof why) == NULL);
#ifdef SPOTUNE_WITH_CUDA
    cr_expect(tu_contains(why, "lacks cuda_doctor_no_such_thing") ||
                  tu_contains(why, "cannot be loaded"),
              "%s", why);
#endif
}

/* In a CUDA build, an NCCL that cannot be opened is a warning naming it
 * (ranks on GPUs could not share gradients); the CPU-only build has none
 * and says so without a warning. */
Test(doctor, an_nccl_that_cannot_be_loaded_warns)
{
    char *out = NULL;
    tu_spotune(&out, "doctor --cloud none");
    char *before = sp_strf("%s", line_of(out, "host.mpi"));
    free(out);
    setenv("SPOTUNE_NCCL_LIBRARY", "/nonexistent/libnccl.so.2", 1);
    tu_spotune(&out, "doctor --cloud none");
    unsetenv("SPOTUNE_NCCL_LIBRARY");
#ifdef SPOTUNE_WITH_CUDA
    cr_expect(tu_contains(before, "NCCL 2."), "%s", before);
    EXPECT_STATUS(out, "host.mpi", "WARN");
    cr_expect(tu_contains(line_of(out, "host.mpi"), "/nonexistent/libnccl.so.2") &&
                  tu_contains(line_of(out, "host.mpi"), "cannot share gradients"),
              "%s", line_of(out, "host.mpi"));
#else
    cr_expect(tu_contains(before, "built without CUDA"), "%s", before);
    cr_expect(!tu_contains(line_of(out, "host.mpi"), "not loadable"), "%s", out);
#endif
    free(before);
    free(out);
}

/* NCCL is opened where the loader finds it, else where the build found it
 * (as a linked library's RUNPATH did): with the loader's cache hidden (a
 * private mount namespace, /etc/ld.so.cache bound to an empty file), a
 * build against a NCCL outside the default folders still opens it. (A
 * build without CUDA opens no NCCL: an_nccl_that_cannot_be_loaded_warns
 * covers what it says.) */
#ifdef SPOTUNE_WITH_CUDA
Test(doctor, nccl_is_opened_where_the_build_found_it)
{
    char *out = NULL;
    if (tu_sh(&out, "unshare -m sh -c 'mount --bind /dev/null /etc/ld.so.cache'") != 0) {
        cr_skip_test("no private mount namespace here (needs root): %s", out);
    }
    free(out);
    int rc = tu_sh(&out,
                   "unshare -m sh -c 'mount --bind /dev/null /etc/ld.so.cache && "
                   "if ldconfig -p | grep -q libnccl; then echo CACHE-STILL-THERE; fi; "
                   "exec %s/spotune doctor --cloud none'",
                   tu_binary_dir());
    cr_expect(!tu_contains(out, "CACHE-STILL-THERE"), "the cache was not hidden: %s", out);
    cr_expect(tu_contains(line_of(out, "host.mpi"), "NCCL 2.") &&
                  !tu_contains(line_of(out, "host.mpi"), "not loadable"),
              "rc %d: %s", rc, line_of(out, "host.mpi"));
    free(out);
}
#endif

/* Starts tests/tools/skewed_date.py (a Date header skew_s off); its pid, the
 * URL in url. */
static int skewed_server(double skew_s, char *url_out, size_t n)
{
    char *log = sp_strf("%s/skew-%.0f.port", dir, skew_s);
    int pid = tu_spawn(log, "python3 %s/tests/tools/skewed_date.py --skew %.0f", tu_source_dir(),
                       skew_s);
    char *port = NULL;
    for (int i = 0; i < 100 && !(port && atoi(port) > 0); i++) {
        free(port);
        tu_sleep(0.05);
        port = tu_read_file(log, NULL);
    }
    cr_assert(pid > 0 && port && atoi(port) > 0, "the skewed Date server did not start");
    snprintf(url_out, n, "http://127.0.0.1:%d", atoi(port));
    free(port);
    free(log);
    return pid;
}

/* The store's clock: within 60 s PASS, beyond WARN, beyond 15 minutes FAIL
 * (SigV4 requests are refused); the endpoint answers 403 to everything, so
 * the probe FAILs too, naming the 403. */
Test(doctor, clock_skew_against_the_date_header)
{
    static const struct {
        double skew;
        const char *status, *says;
    } cases[] = {{0, "PASS", "this clock is "},
                 {-300, "WARN", "s ahead of the store's"},
                 {1200, "FAIL", "s behind the store's"},
                 {-1200, "FAIL", "RequestTimeTooSkewed"}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char ep[64];
        int pid = skewed_server(cases[i].skew, ep, sizeof ep);
        char *out = NULL;
        int rc = tu_sh(&out,
                       "AWS_ACCESS_KEY_ID=id AWS_SECRET_ACCESS_KEY=secret %s/spotune doctor "
                       "--remote s3://b/p --endpoint %s --cloud none --io-mib 1",
                       tu_binary_dir(), ep);
        cr_expect_eq(rc, 1, "skew %.0f: exit %d\n%s", cases[i].skew, rc, out);
        EXPECT_STATUS(out, "store.clock_skew", cases[i].status);
        const char *l = line_of(out, "store.clock_skew");
        cr_expect(tu_contains(l, cases[i].says), "skew %.0f: %s", cases[i].skew, l);
        cr_expect(tu_contains(line_of(out, "store.roundtrip"), "403"), "%s", out);
        free(out);
        kill(pid, SIGTERM);
        tu_wait(pid, 10);
    }
}

/* NCCL_SOCKET_IFNAME is honoured (NCCL's syntax), and a low open-file limit
 * WARNs with the reason. */
Test(doctor, nccl_interfaces_and_open_file_limit)
{
    char *out = NULL;
    int rc = tu_sh(&out, "NCCL_SOCKET_IFNAME=nosuchif0 %s/spotune doctor --cloud none --io-mib 1",
                   tu_binary_dir());
    cr_expect_eq(rc, 1, "exit %d\n%s", rc, out);
    EXPECT_STATUS(out, "host.network", "FAIL");
    cr_expect(
        tu_contains(line_of(out, "host.network"), "NCCL_SOCKET_IFNAME=nosuchif0 matches no up"),
        "%s", out);
    free(out);
    rc = tu_sh(&out, "NCCL_SOCKET_IFNAME==lo %s/spotune doctor --cloud none --io-mib 1",
               tu_binary_dir());
    cr_expect_eq(rc, 0, "exit %d\n%s", rc, out);
    EXPECT_STATUS(out, "host.network", "PASS");
    cr_expect(tu_contains(line_of(out, "host.network"), "NCCL_SOCKET_IFNAME==lo: lo"), "%s", out);
    free(out);
    rc = tu_sh(&out, "NCCL_SOCKET_IFNAME=^lo %s/spotune doctor --cloud none --io-mib 1",
               tu_binary_dir());
    cr_expect(!tu_contains(line_of(out, "host.network"), ": lo"), "%s", out);
    free(out);

    rc = tu_sh(&out, "ulimit -n 1024 && %s/spotune doctor --cloud none --io-mib 1",
               tu_binary_dir());
    cr_expect_eq(rc, 0, "exit %d\n%s", rc, out);
    EXPECT_STATUS(out, "host.open_files", "WARN");
    cr_expect(tu_contains(line_of(out, "host.open_files"), "soft limit 1024") &&
                  tu_contains(line_of(out, "host.open_files"), "ulimit -n 65536"),
              "%s", out);
    free(out);
}
