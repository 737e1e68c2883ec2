/* tests/test_cudnn_graphs.c — the graphs the attention by cuDNN builds
 * (kernels/cuda/cuda_cudnn.cu, SPOTUNE_CUDA_ATTENTION=cudnn), checked by
 * the cuDNN frontend's own validation (dims, strides, data types, what its
 * attention nodes take) with no GPU: the forward and backward of the
 * shapes spotune trains, in the layouts the trainer hands over (q, k, v as
 * the column blocks of the fused q/k/v product, dq, dk, dv as those of its
 * gradient). What only a GPU can say (whether an engine of this cuDNN runs
 * the graph, and its results) is tests/test_cuda_attention.c's
 * attention_by_cudnn_matches_the_cpu, run by scripts/gpu_check.sh.
 *
 * Skipped (77) in a build without the CUDA backend; where the backend was
 * built without the cuDNN frontend (scripts/requirements-build.txt) or
 * libcudnn.so.9 is not installed, skipped too (77), unless
 * SPOTUNE_REQUIRE_CUDNN_FRONTEND=1 (scripts/test.sh, which installs the
 * frontend; libcudnn.so.9 comes with the CUDA toolkit) makes that a
 * failure; skipped where the toolkit has no cudnn.h at all, and under the
 * emulated device's module (no cuDNN). */
#define _POSIX_C_SOURCE 200809L /* setenv */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_test_main.h"
#include "kernels/backend.h"

typedef int (*validate_fn)(int, int, int, int, int, int, int, int, int, int, int, int, char *,
                           size_t);

static validate_fn validate;

static void setup(void)
{
    char why[320];
    void *sym = backend_cuda_symbol("cuda_cudnn_validate", why, sizeof why);
    cr_assert(sym, "%s", why); /* main checked it */
    memcpy(&validate, &sym, sizeof validate);
}

TestSuite(cudnn_graphs, .init = setup);

/* One model's attention on a GPU of compute capability sm: forward and
 * backward, q/k/v strided as the fused product leaves them (row stride qd
 * + 2 kvd) and contiguous; C > 0: packed documents, a document table of
 * capacity C (the graph's batch of ragged sequences). */
static void expect_valid_docs(int sm, const char *model, int B, int T, int nh, int nkv, int hd,
                              int C)
{
    char why[320];
    int qd = nh * hd, kvd = nkv * hd, N = qd + 2 * kvd;
    const int lds[2][4] = {{N, N, N, N}, {qd, kvd, qd, kvd}};
    for (int l = 0; l < 2; l++)
        for (int bwd = 0; bwd < 2; bwd++) {
            const int *ld = lds[l];
            int ok = validate(sm, bwd, B, T, nh, nkv, hd, ld[0], ld[1], ld[2], ld[3], C, why,
                              sizeof why);
            cr_expect(ok, "sm_%d %s%s %s, %s: the frontend rejects the graph: %s", sm, model,
                      C ? ", packed documents" : "", bwd ? "backward" : "forward",
                      l ? "contiguous" : "strided q/k/v", why);
        }
}

static void expect_valid(int sm, const char *model, int B, int T, int nh, int nkv, int hd)
{
    expect_valid_docs(sm, model, B, T, nh, nkv, hd, 0);
}

/* H100 and H200 (sm_90) and A100 (sm_80). */
Test(cudnn_graphs, the_shapes_spotune_trains)
{
    static const int sms[] = {90, 80};
    for (int i = 0; i < 2; i++) {
        int sm = sms[i];
        expect_valid(sm, "Llama-2-7B, T 2048", 1, 2048, 32, 32, 128);
        expect_valid(sm, "Llama-2-7B, micro-batch 4", 4, 2048, 32, 32, 128);
        expect_valid(sm, "Llama-2-13B", 1, 2048, 40, 40, 128);
        expect_valid(sm, "Llama-3-8B (GQA, 4 query heads a kv head)", 1, 2048, 32, 8, 128);
        expect_valid(sm, "T 8192", 1, 8192, 32, 32, 128);
        expect_valid(sm, "head dim 64, 8 query heads a kv head", 1, 4096, 32, 4, 64);
        expect_valid(sm, "odd T", 2, 37, 4, 1, 64);
    }
}

/* Packed documents (data.packing: documents, the shipped configs'), as
 * the ragged sequences of a document table: the capacities a run meets
 * (8 at least, powers of two; a micro-batch of 4 rows of short documents
 * up to 256), on sm_90. (Ragged graphs on sm_80 need cuDNN 9.18.1; the
 * fused kernels run them where cuDNN is older.) */
Test(cudnn_graphs, packed_documents_as_ragged_sequences)
{
    expect_valid_docs(90, "Llama-2-7B, T 2048, 8 documents", 1, 2048, 32, 32, 128, 8);
    expect_valid_docs(90, "Llama-2-7B, T 2048, 64 documents", 1, 2048, 32, 32, 128, 64);
    expect_valid_docs(90, "Llama-2-7B, micro-batch 4, 256 documents", 4, 2048, 32, 32, 128, 256);
    expect_valid_docs(90, "Llama-2-13B, 32 documents", 1, 2048, 40, 40, 128, 32);
    expect_valid_docs(90, "Llama-3-8B (GQA), 16 documents", 1, 2048, 32, 8, 128, 16);
    expect_valid_docs(90, "head dim 64, 8 query heads a kv head", 2, 1024, 32, 4, 64, 16);
    expect_valid_docs(90, "odd T", 2, 37, 4, 1, 64, 8);
}

/* The validation is real, and what it refuses the fused kernels run
 * instead (cuda_cudnn.cu): a single-token backward, and a graph whose kv
 * heads do not divide the query heads (which kernels/backend_ops.c refuses
 * before any backend sees it). */
Test(cudnn_graphs, a_graph_it_cannot_take_is_refused)
{
    char why[320];
    int ok = validate(90, 1, 1, 1, 2, 2, 64, 128, 128, 128, 128, 0, why, sizeof why);
    cr_expect(!ok, "a backward of one token passed the frontend's validation");
    cr_log_info("T 1 backward refused: %s", why);
    ok = validate(90, 0, 1, 64, 6, 4, 64, 6 * 64, 4 * 64, 6 * 64, 4 * 64, 0, why, sizeof why);
    cr_expect(!ok, "6 query heads over 4 kv heads passed the frontend's validation");
    cr_log_info("6 over 4 heads refused: %s", why);
}

/* A symbol of the CUDA module (main checked that it loads). */
static void *module_symbol(const char *name)
{
    char why[320];
    void *sym = backend_cuda_symbol(name, why, sizeof why);
    cr_assert(sym, "%s: %s", name, why);
    return sym;
}

#define MIB (1LL << 20)
#define DP_LIMIT "CUDNN_FRONTEND_ATTN_DP_WORKSPACE_LIMIT"

/* The workspace a graph may take (cuda_cudnn.cu): 512 MiB unless
 * SPOTUNE_CUDNN_WORKSPACE_BUDGET (bytes) says otherwise. A graph asking for
 * more is refused, so the fused kernels run its shape, rather than the
 * scratch growing past what the memory plan counted (the deterministic
 * backward's dP at the 7B shape's seq 8192 is 4 GiB where cuDNN cannot
 * accumulate dQ in order); a malformed budget is refused with its value. */
Test(cudnn_graphs, a_workspace_over_the_budget_is_refused)
{
    int (*allowed)(long long, char *, size_t);
    void *sym = module_symbol("cuda_cudnn_workspace_allowed");
    memcpy(&allowed, &sym, sizeof allowed);
    char why[384];
    long long dp8k = 32LL * 8192 * 8192 * 2; /* 7B, seq 8192: B x heads x T^2 x 2 bytes */
    unsetenv("SPOTUNE_CUDNN_WORKSPACE_BUDGET");
    cr_expect_eq(allowed(512 * MIB, why, sizeof why), 1, "512 MiB refused: %s", why);
    cr_expect_eq(allowed(0, why, sizeof why), 1, "no workspace refused: %s", why);
    cr_expect_eq(allowed(512 * MIB + 1, why, sizeof why), 0, "512 MiB + 1 byte allowed");
    cr_expect(strstr(why, "0.50 GiB budget") && strstr(why, "SPOTUNE_CUDNN_WORKSPACE_BUDGET"),
              "the refusal does not name the budget: %s", why);
    cr_expect_eq(allowed(dp8k, why, sizeof why), 0, "seq 8192's dP allowed");
    cr_expect(strstr(why, "would be 4.00 GiB"), "the refusal does not give the size: %s", why);
    setenv("SPOTUNE_CUDNN_WORKSPACE_BUDGET", "8589934592", 1);
    cr_expect_eq(allowed(dp8k, why, sizeof why), 1, "4 GiB refused under an 8 GiB budget: %s",
                 why);
    cr_expect_eq(allowed(dp8k * 2 + 1, why, sizeof why), 0, "8 GiB + 1 byte allowed");
    static const char *const bad[] = {"abc", "0", "-1", "12MB", "1e9", " ", "99999999999999999999"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        setenv("SPOTUNE_CUDNN_WORKSPACE_BUDGET", bad[i], 1);
        why[0] = 0;
        cr_expect_eq(allowed(MIB, why, sizeof why), -1, "budget '%s' taken", bad[i]);
        char want[96];
        snprintf(want, sizeof want, "SPOTUNE_CUDNN_WORKSPACE_BUDGET=%s is not", bad[i]);
        cr_expect(strstr(why, want), "budget '%s': the refusal does not name it: %s", bad[i],
                  why);
    }
}

/* The frontend plans the deterministic backward's dP only within 7/8 of
 * the budget (CUDNN_FRONTEND_ATTN_DP_WORKSPACE_LIMIT, which it reads as it
 * builds a graph; past it cuDNN 9.25 and later accumulate dQ in order, in
 * a workspace linear in T); a value the user set is theirs, and a
 * malformed budget sets nothing. */
Test(cudnn_graphs, the_frontend_is_told_the_dp_workspace_it_may_plan)
{
    void (*setup_env)(void);
    void *sym = module_symbol("cuda_cudnn_setup_env");
    memcpy(&setup_env, &sym, sizeof setup_env);
    unsetenv("SPOTUNE_CUDNN_WORKSPACE_BUDGET");
    unsetenv(DP_LIMIT);
    setup_env();
    const char *v = getenv(DP_LIMIT);
    cr_expect(v && strcmp(v, "469762048") == 0, "default budget: %s is %s, not 448 MiB",
              DP_LIMIT, v ? v : "unset");
    unsetenv(DP_LIMIT);
    setenv("SPOTUNE_CUDNN_WORKSPACE_BUDGET", "1073741824", 1);
    setup_env();
    v = getenv(DP_LIMIT);
    cr_expect(v && strcmp(v, "939524096") == 0, "1 GiB budget: %s is %s, not 896 MiB", DP_LIMIT,
              v ? v : "unset");
    setenv(DP_LIMIT, "0", 1);
    setup_env();
    v = getenv(DP_LIMIT);
    cr_expect(v && strcmp(v, "0") == 0, "the user's %s=0 became %s", DP_LIMIT, v ? v : "unset");
    unsetenv(DP_LIMIT);
    setenv("SPOTUNE_CUDNN_WORKSPACE_BUDGET", "lots", 1);
    setup_env();
    v = getenv(DP_LIMIT);
    cr_expect(!v, "a malformed budget set %s=%s", DP_LIMIT, v);
}

/* 77 (ctest: skipped, with the reason) where nothing can be checked: no
 * CUDA backend, or one built without the frontend (or no libcudnn.so.9)
 * unless SPOTUNE_REQUIRE_CUDNN_FRONTEND=1 asks for it; a toolkit without
 * cudnn.h is never asked for. */
int main(int argc, char *argv[])
{
    char why[320];
    void *sym = backend_cuda_symbol("cuda_cudnn_validate", why, sizeof why);
    if (!sym) {
        printf("skipped: no CUDA backend to check: %s\n", why);
        return CUDA_TEST_SKIPPED;
    }
    validate_fn v;
    memcpy(&v, &sym, sizeof v);
    int ok = v(90, 0, 1, 64, 2, 2, 64, 128, 128, 128, 128, 0, why, sizeof why);
    const char *req = getenv("SPOTUNE_REQUIRE_CUDNN_FRONTEND");
    /* what the project's scripts install (the frontend; cuDNN with the toolkit) */
    int ours = strstr(why, "no cuDNN frontend") || strstr(why, "libcudnn.so.9 not found");
    int required = ours && req && strcmp(req, "1") == 0;
    if (!ok && (ours || strstr(why, "has no cudnn.h") || strstr(why, "has no cuDNN"))) {
        printf("%s: the attention by cuDNN cannot be checked: %s\n",
               required ? "FAILED (SPOTUNE_REQUIRE_CUDNN_FRONTEND=1)" : "skipped", why);
        return required ? 1 : CUDA_TEST_SKIPPED;
    } /* any other refusal of this probe is for the tests below to show */
    return cuda_test_run_criterion(argc, argv);
}
