/* The CPU fast path's products with a side of at most 64 (LoRA's rank-r
 * ones, kernels/cpu/cpu_skinny.c), in the ops suite, by each instruction
 * set's tiles the CPU has (AVX-512, AVX2): every way in (a small
 * N with op(A) as A or A^T, a small M with op(B) as B or B^T, a small K
 * with a wide output), each tile height and its remainders, column tails
 * of 1 to 15, row strides wider than the matrices, alpha and beta 0, 1 and
 * -0.25, against double loops (within FWD_TOL of the largest value); beta
 * 0 never reads C (it holds NaN); columns of C outside the product are
 * left as they were; the same bits on 1 and 2 threads; the backend's
 * matmul takes this path unless SPOTUNE_CPU_SKINNY=0 (counted), and the
 * answer is within FWD_TOL of double loops either way; SPOTUNE_CPU_SKINNY
 * naming no choice, or tiles the CPU has not got, is refused by name. */
#define _POSIX_C_SOURCE 200809L
#include <criterion/criterion.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/cpu_backend.h"
#include "ops_util.h"

typedef struct {
    int M, N, K, ta, tb;
} shape;

/* C (M x ldc, ldc = N + 3) holds fill; the product goes in its first N
 * columns. Returns what cpu_skinny_matmul returned; *err the relative
 * error against double loops, *kept whether columns N..ldc kept fill. */
static int run_one(int isa, shape s, float alpha, float beta, float *C, float fill, double *err,
                   int *kept)
{
    int ar = s.ta ? s.K : s.M, ac = s.ta ? s.M : s.K, br = s.tb ? s.N : s.K,
        bc = s.tb ? s.K : s.N;
    int lda = ac + 2, ldb = bc + 5, ldc = s.N + 3;
    float *A = rnd((size_t)ar * lda, 1), *B = rnd((size_t)br * ldb, 1);
    float *C0 = rnd((size_t)s.M * ldc, 1);
    if (beta == 0.0f)
        for (size_t i = 0; i < (size_t)s.M * ldc; i++)
            C0[i] = fill;
    memcpy(C, C0, sizeof(float) * (size_t)s.M * ldc);
    int done =
        cpu_skinny_matmul(isa, C, A, B, s.M, s.N, s.K, s.ta, s.tb, alpha, beta, lda, ldb, ldc);
    double *want = malloc(sizeof(double) * (size_t)s.M * s.N);
    float *got = malloc(sizeof(float) * (size_t)s.M * s.N);
    for (int i = 0; i < s.M; i++)
        for (int j = 0; j < s.N; j++) {
            double acc = 0;
            for (int k = 0; k < s.K; k++)
                acc += (double)(s.ta ? A[(size_t)k * lda + i] : A[(size_t)i * lda + k]) *
                       (s.tb ? B[(size_t)j * ldb + k] : B[(size_t)k * ldb + j]);
            want[(size_t)i * s.N + j] =
                alpha * acc + (beta == 0.0f ? 0.0 : beta * (double)C0[(size_t)i * ldc + j]);
            got[(size_t)i * s.N + j] = C[(size_t)i * ldc + j];
        }
    *err = rel_err(got, want, (size_t)s.M * s.N);
    *kept = 1;
    for (int i = 0; i < s.M; i++)
        for (int j = s.N; j < ldc; j++)
            if (memcmp(&C[(size_t)i * ldc + j], &C0[(size_t)i * ldc + j], sizeof(float)) != 0)
                *kept = 0;
    free(A), free(B), free(C0), free(want), free(got);
    return done;
}

static const shape shapes[] = {
    /* N small, op(A) = A: AVX-512's tiles of 8 x 16, 6 x 32, 4 x 48 and 4 x 64, remainders */
    {61, 16, 300, 0, 0},  {61, 16, 300, 0, 1}, {45, 17, 77, 0, 0},  {23, 32, 40, 0, 1},
    {26, 33, 9, 0, 0},    {13, 48, 100, 0, 0}, {9, 64, 70, 0, 1},   {7, 1, 200, 0, 0},
    {1, 5, 1, 0, 1},      {130, 16, 1, 0, 0},
    /* AVX2's tiles: 8 x 8 and its remainder; 3 x 24 at the end of a row of chunks; a few
     * rows of a wide output over a short reduction (AVX2 leaves longer ones to sgemm) */
    {17, 7, 50, 0, 1},    {25, 50, 33, 0, 0},  {20, 150, 30, 0, 0}, {40, 100, 50, 1, 0},
    /* N small, op(A) = A^T: the transposed product through a scratch */
    {150, 16, 200, 1, 0}, {97, 48, 65, 1, 1},  {70, 3, 129, 1, 0},  {5, 64, 66, 1, 0},
    /* M small, op(B) = B: a few rows of a wide output, by column chunks */
    {16, 150, 200, 1, 0}, {48, 97, 130, 1, 0}, {3, 200, 70, 0, 0},  {64, 65, 65, 0, 0},
    /* M small, op(B) = B^T */
    {16, 150, 200, 1, 1}, {33, 129, 80, 0, 1},
    /* K small, a wide output */
    {100, 150, 16, 0, 1}, {77, 300, 48, 0, 0}, {90, 65, 1, 1, 0},   {66, 200, 64, 1, 1},
};

/* AVX2's tiles leave a few rows of a wide output over a reduction longer
 * than 64 to sgemm (op(B) = B with a small M; op(A) = A^T with a small N,
 * computed as its transpose): cpu_skinny_matmul declines them */
static int avx2_leaves(shape s)
{
    return s.K > CPU_SKINNY_MAX &&
           ((s.M <= CPU_SKINNY_MAX && s.N > CPU_SKINNY_MAX && !s.tb) ||
            (s.N <= CPU_SKINNY_MAX && s.ta && s.M > CPU_SKINNY_MAX));
}

static const char *isa_name(int isa)
{
    return isa == CPU_SKINNY_AVX512 ? "avx512" : "avx2";
}

/* Each instruction set's tiles this CPU has, from the best; how many */
static int isas(int *out)
{
    int n = 0;
    for (int isa = cpu_skinny_isa(); isa > CPU_SKINNY_NONE; isa--)
        out[n++] = isa;
    if (n == 0)
        cr_log_info("no AVX2 with FMA on this CPU: cpu_skinny_matmul declines every product");
    return n;
}

Test(ops, skinny_products_against_double_loops)
{
    int is[2], nis = isas(is);
    if (nis < 2)
        cr_log_info("this CPU has not got %s: not tested here",
                    nis == 1 ? "AVX-512" : "AVX-512 or AVX2");
    const float ab[][2] = {{1.0f, 0.0f}, {0.5f, 1.0f}, {-1.5f, -0.25f}};
    size_t n = sizeof(shapes) / sizeof(shapes[0]);
    int taken[2] = {0, 0};
    for (int j = 0; j < nis; j++)
        for (size_t i = 0; i < n; i++)
            for (int v = 0; v < 3; v++) {
                shape s = shapes[i];
                float *C = malloc(sizeof(float) * (size_t)s.M * (s.N + 3));
                double err;
                int kept;
                int done = run_one(is[j], s, ab[v][0], ab[v][1], C, NAN, &err, &kept);
                int want = !(is[j] == CPU_SKINNY_AVX2 && avx2_leaves(s));
                cr_expect_eq(done, want, "%s %dx%dx%d ta=%d tb=%d: %s", isa_name(is[j]), s.M,
                             s.N, s.K, s.ta, s.tb, want ? "not taken" : "taken");
                if (!done) { /* declined: C as it was */
                    free(C);
                    continue;
                }
                taken[j]++;
                cr_expect_lt(err, FWD_TOL, "%s %dx%dx%d ta=%d tb=%d alpha %g beta %g: rel err %g",
                             isa_name(is[j]), s.M, s.N, s.K, s.ta, s.tb, ab[v][0], ab[v][1], err);
                cr_expect(kept, "%s %dx%dx%d ta=%d tb=%d: columns outside C's block changed",
                          isa_name(is[j]), s.M, s.N, s.K, s.ta, s.tb);
                free(C);
            }
    for (int j = 0; j < nis; j++)
        cr_log_info("%s: %d of %zu products taken", isa_name(is[j]), taken[j], 3 * n);
    /* no side of 64 or less, or tiles the CPU has not got, or none: declined, C untouched */
    for (int isa = CPU_SKINNY_NONE; isa <= CPU_SKINNY_AVX512 + 1; isa++) {
        float *C = malloc(sizeof(float) * 65 * 68);
        double err;
        int kept;
        int skinny = isa > CPU_SKINNY_NONE && isa <= cpu_skinny_isa();
        cr_expect_eq(run_one(isa, (shape){65, 65, 65, 0, 0}, 1.0f, 1.0f, C, 0.0f, &err, &kept), 0,
                     "isa %d: a product with no side of 64 or less taken", isa);
        cr_expect_eq(run_one(isa, (shape){65, 16, 65, 0, 0}, 1.0f, 1.0f, C, 0.0f, &err, &kept),
                     skinny, "isa %d (the CPU's best: %d)", isa, cpu_skinny_isa());
        free(C);
    }
}

Test(ops, skinny_products_do_not_depend_on_the_thread_count)
{
    int is[2], nis = isas(is);
    const shape big[] = {{1024, 16, 768, 0, 1}, {768, 16, 1024, 1, 0}, {16, 768, 1024, 1, 0},
                         {1024, 768, 16, 0, 1}, {48, 200, 300, 0, 1}, {48, 768, 64, 1, 0}};
    int saved = omp_get_max_threads();
    for (int j = 0; j < nis; j++)
        for (size_t i = 0; i < sizeof(big) / sizeof(big[0]); i++) {
            shape s = big[i];
            if (is[j] == CPU_SKINNY_AVX2 && avx2_leaves(s))
                continue; /* declined: the first test */
            size_t nc = (size_t)s.M * (s.N + 3);
            float *C1 = malloc(sizeof(float) * nc), *C2 = malloc(sizeof(float) * nc);
            double e1, e2;
            int k1, k2;
            uint64_t seed = g_seed;
            omp_set_num_threads(1);
            cr_assert_eq(run_one(is[j], s, 1.0f, 1.0f, C1, 0.0f, &e1, &k1), 1);
            g_seed = seed;
            omp_set_num_threads(2);
            cr_assert_eq(run_one(is[j], s, 1.0f, 1.0f, C2, 0.0f, &e2, &k2), 1);
            cr_expect_eq(memcmp(C1, C2, sizeof(float) * nc), 0,
                         "%s %dx%dx%d: different bits on 1 and 2 threads", isa_name(is[j]), s.M,
                         s.N, s.K);
            cr_expect_lt(e1, FWD_TOL);
            free(C1), free(C2);
        }
    omp_set_num_threads(saved);
}

/* The cpu backend's matmul under each SPOTUNE_CPU_SKINNY at creation:
 * unset, 1, avx2, avx512 (where the CPU has them) and 0 (sgemm): each
 * within FWD_TOL of double loops; the path's count of products grows by one
 * but under 0 (or on a CPU without AVX2). A value that names no choice, or
 * tiles this CPU has not got, fails the backend's creation (exit code 2),
 * naming the variable and the value. */
Test(ops, skinny_path_is_the_cpu_backends_unless_switched_off)
{
    const int M = 200, N = 16, K = 300;
    float *A = rnd((size_t)M * K, 1), *B = rnd((size_t)K * N, 1);
    double *want = malloc(sizeof(double) * M * N);
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            double acc = 0;
            for (int k = 0; k < K; k++)
                acc += (double)A[i * K + k] * B[k * N + j];
            want[i * N + j] = acc;
        }
    float *got = malloc(sizeof(float) * M * N);
    const struct {
        const char *v;
        int isa; /* what it asks for; -1 unset */
    } cases[] = {{NULL, -1},
                 {"1", -1},
                 {"0", CPU_SKINNY_NONE},
                 {"avx2", CPU_SKINNY_AVX2},
                 {"avx512", CPU_SKINNY_AVX512}};
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        const char *v = cases[c].v;
        if (v)
            setenv("SPOTUNE_CPU_SKINNY", v, 1);
        else
            unsetenv("SPOTUNE_CPU_SKINNY");
        backend_t *b2;
        sp_err err = {0};
        int rc = backend_create(&b2, "cpu", 0, 2, &err);
        if (cases[c].isa > cpu_skinny_isa()) {
            cr_expect_neq(rc, 0, "SPOTUNE_CPU_SKINNY=%s on a CPU without it: created", v);
            cr_expect_eq(err.code, SP_EXIT_USAGE);
            cr_expect(strstr(err.msg, "SPOTUNE_CPU_SKINNY") && strstr(err.msg, v), "%s", err.msg);
            continue;
        }
        cr_assert_eq(rc, 0, "SPOTUNE_CPU_SKINNY=%s: %s", v ? v : "(unset)", err.msg);
        tensor_t tA = be_alloc(b2, DT_F32, (size_t)M * K), tB = be_alloc(b2, DT_F32, (size_t)K * N),
                 tC = be_alloc(b2, DT_F32, (size_t)M * N);
        be_upload(b2, tA, A, DT_F32);
        be_upload(b2, tB, B, DT_F32);
        unsigned long before = cpu_skinny_count();
        be_matmul(b2, tC, tA, tB, M, N, K, 0, 0, 1.0f, 0.0f);
        unsigned long ran = cpu_skinny_count() - before;
        int on = cases[c].isa != CPU_SKINNY_NONE && cpu_skinny_isa() != CPU_SKINNY_NONE;
        cr_expect_eq(ran, on ? 1ul : 0ul, "SPOTUNE_CPU_SKINNY=%s: %lu products on the path",
                     v ? v : "(unset)", ran);
        be_download(b2, got, DT_F32, tC);
        cr_expect_lt(rel_err(got, want, (size_t)M * N), FWD_TOL, "SPOTUNE_CPU_SKINNY=%s",
                     v ? v : "(unset)");
        be_free(b2, &tA), be_free(b2, &tB), be_free(b2, &tC);
        backend_destroy(b2);
    }
    const char *bad[] = {"yes", "AVX2", "avx-512", "2"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        setenv("SPOTUNE_CPU_SKINNY", bad[i], 1);
        backend_t *b2 = NULL;
        sp_err err = {0};
        cr_expect_neq(backend_create(&b2, "cpu", 0, 2, &err), 0, "SPOTUNE_CPU_SKINNY=%s: created",
                      bad[i]);
        cr_expect_eq(err.code, SP_EXIT_USAGE, "SPOTUNE_CPU_SKINNY=%s", bad[i]);
        cr_expect(strstr(err.msg, "SPOTUNE_CPU_SKINNY") && strstr(err.msg, bad[i]) &&
                      strstr(err.msg, "expected 0, 1, avx2 or avx512"),
                  "%s", err.msg);
    }
    /* the reference backend never takes the path, whatever the variable */
    backend_t *ref;
    sp_err err = {0};
    cr_expect_eq(backend_create(&ref, "cpu-ref", 0, 1, &err), 0, "%s", err.msg);
    if (ref)
        backend_destroy(ref);
    unsetenv("SPOTUNE_CPU_SKINNY");
    free(A), free(B), free(want), free(got);
}

#if defined(__SANITIZE_ADDRESS__)
#include <sys/wait.h>
#include <unistd.h>

/* A product whose operand `which` (0 A, 1 B, 2 C) ends cut floats short
 * of what the product reads or writes, run in a child with
 * SPOTUNE_ASAN_SKINNY = mode: its exit status, AddressSanitizer's report in
 * out. A: the rows broadcast as they lie (N small); B: the wide rows read as
 * they lie (M small, dA = dxr^T x); C: the output's last row. */
static int short_operand(const char *mode, int which, size_t cut, char *out, size_t n)
{
    const int M = which == 1 ? 8 : 40, N = which == 1 ? 100 : 16, K = 24;
    size_t na = (size_t)M * K, nb = (size_t)K * N, nc = (size_t)M * N;
    int fd[2];
    cr_assert_eq(pipe(fd), 0);
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        dup2(fd[1], 2);
        close(fd[0]);
        setenv("SPOTUNE_ASAN_SKINNY", mode, 1);
        float *A = calloc(na - (which == 0 ? cut : 0), sizeof(float));
        float *B = calloc(nb - (which == 1 ? cut : 0), sizeof(float));
        float *C = calloc(nc - (which == 2 ? cut : 0), sizeof(float));
        int isa = cpu_skinny_isa();
        cpu_skinny_matmul(isa, C, A, B, M, N, K, 0, 0, 1.0f, 0.0f, K, N, N);
        _exit(0); /* nothing was reported */
    }
    close(fd[1]);
    size_t got = 0;
    ssize_t r;
    while (got < n - 1 && (r = read(fd[0], out + got, n - 1 - got)) > 0)
        got += (size_t)r;
    out[got] = '\0';
    close(fd[0]);
    int st = 0;
    waitpid(pid, &st, 0);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

/* Under AddressSanitizer the tiles run unchecked after one check of each
 * operand's whole span (kernels/cpu/cpu_skinny.c), or with every load and
 * store checked (SPOTUNE_ASAN_SKINNY=loads, this suite's setting). The span
 * check reports an operand one float short, with a line naming it, as
 * AddressSanitizer's heap-buffer-overflow. The loads' check reports an
 * operand short by a vector the tiles load whole; it does not see the
 * masked loads and stores of a row's last vector (the sanitizer does not
 * check those), which is why the spans are checked in every mode that
 * skips it. */
Test(ops, skinny_operands_past_their_memory_are_reported_under_asan, .timeout = 120)
{
    if (cpu_skinny_isa() == CPU_SKINNY_NONE)
        cr_skip_test("this CPU has neither AVX-512 nor AVX2: no tiles to check");
    static char out[65536];
    const char *names[] = {"broadcast operand", "vector operand", "output"};
    for (int which = 0; which < 3; which++) {
        int rc = short_operand("spans", which, 1, out, sizeof out);
        cr_expect_neq(rc, 0, "%s short, spans checked: exit 0, nothing reported", names[which]);
        cr_expect(strstr(out, "heap-buffer-overflow") && strstr(out, names[which]) &&
                      strstr(out, which == 2 ? "WRITE of size" : "READ of size"),
                  "%s short, spans checked: %s", names[which], out);
        if (which == 2)
            continue;
        rc = short_operand("loads", which, which == 1 ? 40 : 1, out, sizeof out);
        cr_expect_neq(rc, 0, "%s short, loads checked: exit 0, nothing reported", names[which]);
        cr_expect(strstr(out, "heap-buffer-overflow") && !strstr(out, "skinny product's"),
                  "%s short, loads checked: %s", names[which], out);
    }
}
#endif
