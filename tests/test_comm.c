/* tests/test_comm.c — the comm suite.
 *
 * A world of one is tested in-process (no launcher in the environment, so
 * comm_init makes no MPI call). Everything that needs several ranks runs
 * `mpirun --oversubscribe --mca pml ob1 --mca btl tcp,self -np N spotune-comm-prog CASE`
 * as a child process and checks its exit code, output and duration:
 * collectives against a locally computed reference, bit-identical results
 * from run to run, and the three ways a job must end (a rank killed, a rank
 * calling comm_abort, a rank that never joins a collective). */
#define _POSIX_C_SOURCE 200809L
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "comm/comm.h"
#include "comm/comm_internal.h"

#ifndef SPOTUNE_COMM_PROG
#error "SPOTUNE_COMM_PROG must name the spotune-comm-prog executable"
#endif

/* ---- running a job ------------------------------------------------------ */

#define JOB_LIMIT_S 90.0 /* a job still running after this is killed: a test bug */

typedef struct job {
    int status; /* exit code, or 128 + signal */
    double secs;
    char out[16384], err[16384];
} job;

static void slurp(const char *path, char *buf, size_t cap)
{
    FILE *f = fopen(path, "r");
    size_t n = f ? fread(buf, 1, cap - 1, f) : 0;
    buf[n] = 0;
    if (f)
        fclose(f);
    unlink(path);
}

/* Appends to a sanitizer's option list, keeping what the caller set. */
static void add_option(const char *var, const char *opts)
{
    char buf[1024];
    const char *old = getenv(var);
    snprintf(buf, sizeof buf, "%s%s%s", old ? old : "", old && old[0] ? ":" : "", opts);
    setenv(var, buf, 1);
}

/* The child: own process group (so a runaway job can be killed whole),
 * output to files, a clean comm environment plus `env` ("NAME=VALUE"...). */
static void job_child(char *const argv[], const char *const env[], const char *out,
                      const char *err)
{
    setpgid(0, 0);
    int fo = open(out, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    int fe = open(err, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (fo < 0 || fe < 0 || dup2(fo, 1) < 0 || dup2(fe, 2) < 0)
        _exit(126);
    const char *drop[] = {"SPOTUNE_COMM_CHUNK_BYTES", "SPOTUNE_COMM_SMALL_BYTES",
                          "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID"};
    for (size_t i = 0; i < sizeof drop / sizeof drop[0]; i++)
        unsetenv(drop[i]);
    setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
    setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
    /* In a sanitizer build the ranks are instrumented and Open MPI is not:
     * its own allocations that live until exit are not our leaks. */
    /* Open MPI has no frame pointers; dynamic TLS: see tu_mpirun */
    add_option("ASAN_OPTIONS", "fast_unwind_on_malloc=0:intercept_tls_get_addr=0");
    add_option("LSAN_OPTIONS",
               "suppressions=" SPOTUNE_SOURCE_DIR "/tests/lsan.supp:print_suppressions=0");
    add_option("UBSAN_OPTIONS", "print_stacktrace=1");
    for (int i = 0; env && env[i]; i++) {
        char name[128];
        const char *eq = strchr(env[i], '=');
        snprintf(name, sizeof name, "%.*s", (int)(eq - env[i]), env[i]);
        setenv(name, eq + 1, 1);
    }
    execv(argv[0], argv);
    _exit(127);
}

static int wait_job(pid_t pid, job *j, double t0)
{
    int st = 0;
    int killed = 0;
    for (;;) {
        pid_t r = waitpid(pid, &st, WNOHANG);
        if (r == pid)
            break;
        if (r < 0 && errno != EINTR)
            return -1;
        if (!killed && sp_now() - t0 > JOB_LIMIT_S) {
            kill(-pid, SIGTERM);
            killed = 1;
        } else if (killed && sp_now() - t0 > JOB_LIMIT_S + 5) {
            kill(-pid, SIGKILL);
        }
        struct timespec ts = {0, 20 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    j->status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    return killed ? -2 : 0;
}

/* Runs spotune-comm-prog CASE [arg] under mpirun with np ranks, or directly
 * when np is 0. */
static void run_job(job *j, int np, const char *test_case, const char *arg,
                    const char *const env[])
{
    char out[] = "/tmp/spotune-comm-out-XXXXXX", err[] = "/tmp/spotune-comm-err-XXXXXX";
    char nps[16];
    char *argv[16];
    int a = 0, fo = mkstemp(out), fe = mkstemp(err);
    cr_assert(fo >= 0 && fe >= 0, "mkstemp: %s", strerror(errno));
    close(fo);
    close(fe);
    snprintf(nps, sizeof nps, "%d", np);
    if (np > 0) {
        /* pml ob1: the transport that the btl list configures (and no UCX start-up) */
        char *launch[] = {SPOTUNE_MPIEXEC, "--oversubscribe", "--mca", "pml", "ob1", "--mca",
                          "btl", "tcp,self", "-np", nps};
        for (size_t i = 0; i < sizeof launch / sizeof launch[0]; i++)
            argv[a++] = launch[i];
    }
    argv[a++] = SPOTUNE_COMM_PROG;
    argv[a++] = (char *)test_case;
    if (arg)
        argv[a++] = (char *)arg;
    argv[a] = NULL;
    double t0 = sp_now();
    fflush(NULL);
    pid_t pid = fork();
    cr_assert(pid >= 0, "fork: %s", strerror(errno));
    if (pid == 0)
        job_child(argv, env, out, err);
    int rc = wait_job(pid, j, t0);
    j->secs = sp_now() - t0;
    slurp(out, j->out, sizeof j->out);
    slurp(err, j->err, sizeof j->err);
    cr_assert(rc != -2, "%s -np %d: still running after %.0f s; stderr:\n%s", test_case, np,
              JOB_LIMIT_S, j->err);
    cr_assert(rc == 0, "waitpid: %s", strerror(errno));
}

/* The job must succeed and rank 0 must say so. */
static void expect_ok(int np, const char *test_case, const char *const env[])
{
    job j;
    run_job(&j, np, test_case, NULL, env);
    cr_assert_eq(j.status, 0, "%s on %d rank(s) exited %d after %.1f s; stderr:\n%s", test_case,
                 np, j.status, j.secs, j.err);
    cr_assert(strstr(j.out, "ok ") != NULL, "%s: no 'ok' line; stdout:\n%s", test_case, j.out);
}

/* ---- world of one, in-process ------------------------------------------- */

static void no_launcher(void)
{
    const char *vars[] = {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID"};
    for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++)
        unsetenv(vars[i]);
}

Test(comm_single, world_of_one)
{
    comm_t *c = NULL;
    sp_err err = {0};
    no_launcher();
    cr_assert_eq(comm_init(&c, NULL, NULL, NULL, &err), 0, "%s", err.msg);
    cr_assert_eq(comm_rank(c), 0);
    cr_assert_eq(comm_size(c), 1);
    cr_assert_eq(comm_local_rank(c), 0);
    cr_assert_eq(comm_local_size(c), 1);
    cr_assert(comm_host(c)[0] != 0);
    cr_assert_eq(comm_device_for_rank(c, 4), 0);
    cr_assert_eq(comm_timeout(c), 60.0);
    comm_set_timeout(c, 5);
    cr_assert_eq(comm_timeout(c), 5.0);
    comm_set_timeout(c, 0);
    cr_assert_eq(comm_timeout(c), 60.0);
    comm_finalize(c);
}

Test(comm_single, a_world_of_one_has_its_gpu_to_itself)
{
    comm_t *c = NULL;
    sp_err err = {0};
    unsigned char id[16] = {0xa1, 1};
    no_launcher();
    cr_assert_eq(comm_init(&c, NULL, NULL, NULL, &err), 0, "%s", err.msg);
    cr_expect_eq(comm_check_devices_distinct(c, id, 0, 1, &err), 0, "%s", err.msg);
    comm_finalize(c);
}

Test(comm_single, collectives_are_copies)
{
    comm_t *c = NULL;
    sp_err err = {0};
    float x[3] = {1.5f, -2, 3}, y[3] = {0};
    int64_t big[2] = {INT64_MAX, -7};
    int any = -1;
    no_launcher();
    cr_assert_eq(comm_init(&c, NULL, NULL, NULL, &err), 0, "%s", err.msg);
    cr_assert_eq(comm_allreduce(c, x, 3, COMM_F32, COMM_AVG, &err), 0, "%s", err.msg);
    cr_assert(x[0] == 1.5f && x[1] == -2 && x[2] == 3);
    cr_assert_eq(comm_allreduce(c, big, 2, COMM_I64, COMM_SUM, &err), 0, "%s", err.msg);
    cr_assert(big[0] == INT64_MAX && big[1] == -7);
    cr_assert_eq(comm_allgather(c, x, y, 3, COMM_F32, &err), 0, "%s", err.msg);
    cr_assert(memcmp(x, y, sizeof x) == 0);
    memset(y, 0, sizeof y);
    cr_assert_eq(comm_reduce_scatter(c, x, y, 3, COMM_F32, COMM_SUM, &err), 0, "%s", err.msg);
    cr_assert(memcmp(x, y, sizeof x) == 0);
    cr_assert_eq(comm_bcast(c, x, sizeof x, 0, &err), 0, "%s", err.msg);
    cr_assert_eq(comm_any(c, 0, &any, &err), 0);
    cr_assert_eq(any, 0);
    cr_assert_eq(comm_any(c, 42, &any, &err), 0);
    cr_assert_eq(any, 1);
    cr_assert_eq(comm_barrier(c, &err), 0);
    comm_finalize(c);
}

/* An MPI below MPI_THREAD_MULTIPLE is refused at start, naming the level it
 * gives and what to use (the watchdog thread calls MPI beside the training
 * thread); Open MPI here gives MULTIPLE (the jobs of this suite run). */
Test(comm_single, an_mpi_without_thread_multiple_is_refused_by_name)
{
    char why[512] = "";
    cr_expect_eq(comm_mpi_thread_level_ok(MPI_THREAD_MULTIPLE, why, sizeof why), 1);
    const int levels[] = {MPI_THREAD_SINGLE, MPI_THREAD_FUNNELED, MPI_THREAD_SERIALIZED};
    const char *names[] = {"MPI_THREAD_SINGLE", "MPI_THREAD_FUNNELED", "MPI_THREAD_SERIALIZED"};
    for (int i = 0; i < 3; i++) {
        why[0] = 0;
        cr_expect_eq(comm_mpi_thread_level_ok(levels[i], why, sizeof why), 0, "%s", names[i]);
        cr_expect(strstr(why, names[i]) && strstr(why, "needs MPI_THREAD_MULTIPLE"), "%s", why);
    }
}

Test(comm_single, bad_arguments_are_errors)
{
    comm_t *c = NULL;
    sp_err err = {0};
    float x = 0;
    no_launcher();
    cr_assert_eq(comm_init(&c, NULL, NULL, NULL, &err), 0, "%s", err.msg);
    cr_assert_neq(comm_allreduce(c, &x, 1, (comm_dtype)99, COMM_SUM, &err), 0);
    cr_assert(strstr(err.msg, "dtype") != NULL, "%s", err.msg);
    sp_err_clear(&err);
    cr_assert_neq(comm_allreduce(c, NULL, 4, COMM_F32, COMM_SUM, &err), 0);
    sp_err_clear(&err);
    cr_assert_neq(comm_bcast(c, &x, 4, 1, &err), 0);
    cr_assert(strstr(err.msg, "root 1") != NULL, "%s", err.msg);
    comm_finalize(c);
}

Test(comm_single, bad_chunk_setting_is_a_usage_error)
{
    comm_t *c = NULL;
    sp_err err = {0};
    no_launcher();
    setenv("SPOTUNE_COMM_CHUNK_BYTES", "lots", 1);
    cr_assert_eq(comm_init(&c, NULL, NULL, NULL, &err), SP_EXIT_USAGE);
    cr_assert_null(c);
    cr_assert(strstr(err.msg, "SPOTUNE_COMM_CHUNK_BYTES") != NULL, "%s", err.msg);
    unsetenv("SPOTUNE_COMM_CHUNK_BYTES");
}

Test(comm_single, device_without_gpu_is_an_error)
{
    comm_t *c = NULL;
    sp_err err = {0};
    no_launcher();
    cr_assert_eq(comm_init(&c, NULL, NULL, NULL, &err), 0, "%s", err.msg);
    int rc = comm_device_init(c, 0, &err);
#ifndef SPOTUNE_COMM_NCCL
    cr_assert(!comm_device_available(), "a build without CUDA has no device collectives");
#endif
    if (!comm_device_available()) {
        cr_assert_neq(rc, 0);
        cr_assert(strstr(err.msg, "built without CUDA") != NULL ||
                      strstr(err.msg, "could not be loaded") != NULL,
                  "%s", err.msg);
        sp_err_clear(&err);
        cr_assert_neq(comm_device_wait(c, NULL, &err), 0);
    } else if (rc != 0) {
        /* a CUDA build on a machine without a GPU: the CUDA error, located */
        cr_assert(strstr(err.msg, "cudaSetDevice") != NULL, "%s", err.msg);
    }
    if (rc != 0) { /* no device bound: nothing to group */
        sp_err_clear(&err);
        cr_expect_neq(comm_device_group_begin(c, &err), 0);
        cr_expect_neq(comm_device_group_end(c, &err), 0);
        cr_expect(err.msg[0], "no reason given");
    }
    comm_finalize(c);
}

#ifdef SPOTUNE_COMM_NCCL
/* The CUDA build opens NCCL and the CUDA runtime on first use: the binary
 * links neither (it starts, and trains on the CPU or one GPU, without
 * them), and here, where the toolkit is installed, both load. */
Test(comm_single, nccl_and_the_cuda_runtime_are_opened_not_linked)
{
    char cmd[4096], line[1024];
    snprintf(cmd, sizeof cmd, "ldd %s/spotune 2>&1", SPOTUNE_BINARY_DIR);
    FILE *p = popen(cmd, "r");
    cr_assert(p, "%s", cmd);
    int lines = 0;
    while (fgets(line, sizeof line, p)) {
        lines++;
        cr_expect(!strstr(line, "libnccl") && !strstr(line, "libcudart"), "spotune links %s",
                  line);
    }
    cr_expect_eq(pclose(p), 0, "%s", cmd);
    cr_expect_gt(lines, 3, "ldd listed %d libraries", lines);
    cr_assert(comm_device_available(), "NCCL or the CUDA runtime did not load");
    char ver[256];
    comm_nccl_version(ver, sizeof ver);
    int major = 0, minor = -1;
    cr_expect_eq(sscanf(ver, "NCCL %d.%d.", &major, &minor), 2, "%s", ver);
    cr_expect_geq(major, 2, "%s", ver);
}

/* An NCCL that cannot be opened is named, before the device is touched,
 * when ranks share gradients (here a one-rank communicator asked for); a
 * world of one does not need it (here it fails at cudaSetDevice: no GPU). */
Test(comm_single, a_missing_nccl_is_named_and_one_gpu_does_not_need_it)
{
    comm_t *c = NULL;
    sp_err err = {0};
    no_launcher();
    setenv("SPOTUNE_NCCL_LIBRARY", "/nonexistent/libnccl.so.2", 1);
    cr_expect(!comm_device_available());
    char ver[512];
    comm_nccl_version(ver, sizeof ver);
    cr_expect(strstr(ver, "not loadable") && strstr(ver, "/nonexistent/libnccl.so.2"), "%s",
              ver);
    comm_opts co = {.timeout_s = 10, .nccl_world_of_one = 1};
    cr_assert_eq(comm_init(&c, NULL, NULL, &co, &err), 0, "%s", err.msg);
    cr_expect_neq(comm_device_init(c, 0, &err), 0);
    cr_expect(strstr(err.msg, "need") && strstr(err.msg, "NCCL, which could not be loaded") &&
                  strstr(err.msg, "/nonexistent/libnccl.so.2") &&
                  strstr(err.msg, "SPOTUNE_NCCL_LIBRARY") && !strstr(err.msg, "cudaSetDevice"),
              "%s", err.msg);
    comm_finalize(c);
    sp_err_clear(&err);
    cr_assert_eq(comm_init(&c, NULL, NULL, NULL, &err), 0, "%s", err.msg);
    int rc = comm_device_init(c, 0, &err);
    cr_expect(rc == 0 || !strstr(err.msg, "NCCL"), "a world of one asked for NCCL: %s", err.msg);
    comm_finalize(c);
}
#endif

Test(comm_single, prog_runs_without_a_launcher)
{
    expect_ok(0, "allreduce", NULL);
    expect_ok(0, "reduce_scatter", NULL);
    expect_ok(0, "reduce", NULL);
}

Test(comm_single, abort_in_world_of_one_exits_with_code)
{
    job j;
    run_job(&j, 0, "abort", NULL, NULL);
    cr_assert_eq(j.status, SP_EXIT_INPUT, "stderr:\n%s", j.err);
    cr_assert(strstr(j.err, "spotune: rank 0 on ") != NULL, "stderr:\n%s", j.err);
}

/* ---- collectives under mpirun ------------------------------------------- */

Test(comm_mpi, allreduce_1_rank) { expect_ok(1, "allreduce", NULL); }
Test(comm_mpi, allreduce_2_ranks) { expect_ok(2, "allreduce", NULL); }
Test(comm_mpi, allreduce_4_ranks) { expect_ok(4, "allreduce", NULL); }

/* Tiny chunks force many MPI calls per collective (the path a buffer of
 * more than 2^31 elements takes); each setting forces one algorithm. */
static const char *const small_chunks_large_path[] = {"SPOTUNE_COMM_CHUNK_BYTES=1000",
                                                      "SPOTUNE_COMM_SMALL_BYTES=0", NULL};
static const char *const small_chunks_small_path[] = {"SPOTUNE_COMM_CHUNK_BYTES=4096",
                                                      "SPOTUNE_COMM_SMALL_BYTES=1000000", NULL};

Test(comm_mpi, allreduce_chunked_3_ranks) { expect_ok(3, "allreduce", small_chunks_large_path); }
Test(comm_mpi, allreduce_chunked_gathered_2_ranks)
{
    expect_ok(2, "allreduce", small_chunks_small_path);
}

static void hash_of(int np, const char *const env[], char *hash, size_t cap)
{
    job j;
    run_job(&j, np, "determinism", NULL, env);
    cr_assert_eq(j.status, 0, "determinism exited %d; stderr:\n%s", j.status, j.err);
    const char *h = strstr(j.out, "hash ");
    cr_assert(h != NULL, "no hash in:\n%s", j.out);
    snprintf(hash, cap, "%.21s", h);
}

/* The same sums, bit for bit, from run to run and whatever the chunking. */
Test(comm_mpi, allreduce_is_bit_identical_run_to_run)
{
    static const char *const chunks[] = {"SPOTUNE_COMM_CHUNK_BYTES=40000",
                                         "SPOTUNE_COMM_SMALL_BYTES=0", NULL};
    char a[32], b[32], chunked[32];
    hash_of(4, NULL, a, sizeof a);
    hash_of(4, NULL, b, sizeof b);
    hash_of(4, chunks, chunked, sizeof chunked);
    cr_assert_str_eq(a, b);
    cr_assert_str_eq(a, chunked);
}

Test(comm_mpi, bcast) { expect_ok(3, "bcast", small_chunks_large_path); }
Test(comm_mpi, allgather) { expect_ok(3, "allgather", small_chunks_large_path); }
Test(comm_mpi, allgather_4_ranks) { expect_ok(4, "allgather", NULL); }
/* local rank -> GPU under mpirun: distinct local ranks on the host, and
 * rank r takes GPU local_rank mod the visible devices */
Test(comm_mpi, local_ranks_and_device_binding_4_ranks) { expect_ok(4, "local", NULL); }
/* one GPU per rank: distinct (or absent) GPUs pass; two ranks on one GPU
 * are a usage error on every rank naming both ranks, the host, the GPU and
 * how many ranks to start */
Test(comm_mpi, ranks_on_distinct_gpus_pass) { expect_ok(4, "distinct_gpus", NULL); }
Test(comm_mpi, two_ranks_on_one_gpu_are_refused_by_name)
{
    char host[256] = {0}, want[400];
    gethostname(host, sizeof host - 1);
    job j;
    run_job(&j, 4, "shared_gpu", NULL, NULL);
    cr_assert_eq(j.status, 0, "exited %d; stderr:\n%s", j.status, j.err);
    snprintf(want, sizeof want,
             "ranks 0 and 2 on %.63s both use GPU 0 (GPU-a1000000-0000-0000-0000-000000000001)",
             host);
    cr_assert(strstr(j.out, want) != NULL, "no '%s' in stdout:\n%s", want, j.out);
    cr_assert(strstr(j.out, "runs 4 ranks and each sees 2 GPUs; start at most 2 ranks per host "
                            "(mpirun -np 2 on one machine, --map-by ppr:2:node on several)"),
              "stdout:\n%s", j.out);
}
Test(comm_mpi, gather) { expect_ok(3, "gather", small_chunks_large_path); }
Test(comm_mpi, gather_2_ranks) { expect_ok(2, "gather", NULL); }
Test(comm_mpi, reduce_scatter) { expect_ok(3, "reduce_scatter", small_chunks_large_path); }
Test(comm_mpi, reduce_scatter_2_ranks) { expect_ok(2, "reduce_scatter", NULL); }
/* to one rank (sharded gradients): every root, uneven chunks, bit-identical */
Test(comm_mpi, reduce) { expect_ok(3, "reduce", small_chunks_large_path); }
Test(comm_mpi, reduce_4_ranks) { expect_ok(4, "reduce", NULL); }
Test(comm_mpi, any) { expect_ok(3, "any", NULL); }

/* ---- device collectives (NCCL): only where there are GPUs ---------------- */

/* The prog exits 77 when the build has no CUDA or a node has fewer GPUs
 * than ranks: then there is nothing to test here. */
static int device_job(int np)
{
    job j;
    run_job(&j, np, "device", NULL, NULL);
    if (j.status == 77)
        return 0;
    cr_assert_eq(j.status, 0, "device on %d rank(s) exited %d; stdout:\n%s\nstderr:\n%s", np,
                 j.status, j.out, j.err);
    return 1;
}

Test(comm_device, nccl_collectives)
{
    if (!device_job(0)) /* a world of one: local copies, no NCCL */
        cr_skip_test("no GPU or built without CUDA");
    device_job(1); /* NCCL, one rank */
    device_job(2); /* NCCL, two ranks: needs two GPUs */
}

/* ---- failures end the whole job ----------------------------------------- */

Test(comm_fail, killed_rank_ends_the_job)
{
    job j;
    run_job(&j, 2, "kill", "10", NULL);
    cr_assert_neq(j.status, 0, "stdout:\n%s", j.out);
    /* the survivor would wait 10 s for its watchdog; the launcher ends it
     * sooner. The bound includes starting 2 ranks on a loaded machine. */
    cr_assert_lt(j.secs, 10.0 + 20.0, "took %.1f s; stderr:\n%s", j.secs, j.err);
}

Test(comm_fail, abort_exits_with_its_code_and_names_rank_and_host)
{
    job j;
    char host[256] = {0}, want[320];
    gethostname(host, sizeof host - 1);
    run_job(&j, 2, "abort", "10", NULL);
    cr_assert_eq(j.status, SP_EXIT_INPUT, "exit %d; stderr:\n%s", j.status, j.err);
    snprintf(want, sizeof want, "spotune: rank 1 on %s: bad input", host);
    cr_assert(strstr(j.err, want) != NULL, "no '%s' in stderr:\n%s", want, j.err);
    /* well before the 10 s watchdog plus start-up on a loaded machine */
    cr_assert_lt(j.secs, 10.0 + 20.0, "took %.1f s", j.secs);
}

Test(comm_fail, watchdog_ends_a_hang)
{
    job j;
    run_job(&j, 2, "hang", "3", NULL);
    cr_assert_neq(j.status, 0, "stdout:\n%s", j.out);
    cr_assert(strstr(j.err, "spotune: rank 0 on ") != NULL, "stderr:\n%s", j.err);
    cr_assert(strstr(j.err, "collective allreduce timed out after 3 s (a peer may have died)"),
              "stderr:\n%s", j.err);
    cr_assert_geq(j.secs, 3.0);
    /* the 3 s timeout plus start-up and teardown of 2 ranks on a loaded machine */
    cr_assert_lt(j.secs, 3.0 + 27.0, "took %.1f s; stderr:\n%s", j.secs, j.err);
}
