/* `spotune bench`'s checks of step 1, on the CPU:
 *  - the loss random weights give, ln(vocab) + 0.0002 x hidden, and the
 *    band of +-1 around it (non-finite losses refused), for every preset
 *    (7B and 13B by the function itself: they do not fit this machine);
 *  - the comparison with the CPU backend's step 1 and its tolerances;
 *  - end to end through the binary: the JSON line records step 1's loss and
 *    gradient norm, both MFU conventions and the check; the CPU check runs
 *    on another backend (cpu-ref here, cuda on a GPU) and fails the run when
 *    the difference is beyond the tolerance;
 *  - --probe-cuda: exit 0 with the device count, or 77 naming the CUDA
 *    error (or the build without CUDA). */
#define _POSIX_C_SOURCE 200809L
#include <criterion/criterion.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"
#include "kernels/backend.h"
#include "trainer/bench.h"

static model_config_t preset(const char *name)
{
    model_config_t mc;
    cr_assert_eq(model_config_preset(&mc, name), 0, "%s", name);
    return mc;
}

Test(bench, expected_loss_of_random_weights)
{
    model_config_t m7 = preset("llama-7b"), m13 = preset("llama-13b"), tiny = preset("tiny");
    cr_expect_float_eq(bench_expected_loss(&m7), log(32000.0) + 0.0004 * 4096 / 2, 1e-12);
    cr_expect_float_eq(bench_expected_loss(&m13), log(32000.0) + 0.0004 * 5120 / 2, 1e-12);
    cr_expect_float_eq(bench_expected_loss(&tiny), log(260.0) + 0.0004 * 128 / 2, 1e-12);
    /* 13B's logits spread moves the loss more than 1 above ln(vocab) */
    cr_expect_gt(bench_expected_loss(&m13) - log(32000.0), 1.0);
}

Test(bench, loss_check_band_and_non_finite)
{
    char why[400];
    const char *names[] = {"tiny", "small", "llama-7b", "llama-13b"};
    for (int i = 0; i < 4; i++) {
        model_config_t mc = preset(names[i]);
        double want = bench_expected_loss(&mc);
        cr_expect_eq(bench_check_loss(want, &mc, why, sizeof why), 0, "%s: %s", names[i], why);
        cr_expect_eq(bench_check_loss(want + 0.99, &mc, why, sizeof why), 0, "%s", why);
        cr_expect_eq(bench_check_loss(want - 0.99, &mc, why, sizeof why), 0, "%s", why);
        cr_expect_neq(bench_check_loss(want + 1.01, &mc, why, sizeof why), 0, "%s", names[i]);
        cr_expect(tu_contains(why, "outside"), "%s", why);
        cr_expect_neq(bench_check_loss(want - 1.01, &mc, why, sizeof why), 0, "%s", names[i]);
        cr_expect_neq(bench_check_loss(NAN, &mc, why, sizeof why), 0, "%s: NaN", names[i]);
        cr_expect(tu_contains(why, "not a finite number"), "%s", why);
        cr_expect_neq(bench_check_loss(INFINITY, &mc, why, sizeof why), 0, "%s: inf", names[i]);
        cr_expect_neq(bench_check_loss(0.0, &mc, why, sizeof why), 0, "%s: 0", names[i]);
    }
}

Test(bench, cpu_comparison_tolerances)
{
    char why[400];
    cr_expect_eq(bench_check_against_cpu(10.40, 2.00, 10.41, 2.03, BENCH_LOSS_TOL,
                                         BENCH_GNORM_TOL, why, sizeof why), 0, "%s", why);
    cr_expect(tu_contains(why, "10.400000 vs 10.410000"), "%s", why);
    /* the loss off by 1% */
    cr_expect_neq(bench_check_against_cpu(10.50, 2.00, 10.40, 2.00, BENCH_LOSS_TOL,
                                          BENCH_GNORM_TOL, why, sizeof why), 0, "%s", why);
    /* the gradient norm off by 5% */
    cr_expect_neq(bench_check_against_cpu(10.40, 2.10, 10.40, 2.00, BENCH_LOSS_TOL,
                                          BENCH_GNORM_TOL, why, sizeof why), 0, "%s", why);
    cr_expect_neq(bench_check_against_cpu(NAN, 2.00, 10.40, 2.00, BENCH_LOSS_TOL,
                                          BENCH_GNORM_TOL, why, sizeof why), 0, "NaN loss");
    cr_expect_neq(bench_check_against_cpu(10.40, INFINITY, 10.40, 2.00, BENCH_LOSS_TOL,
                                          BENCH_GNORM_TOL, why, sizeof why), 0, "inf norm");
    cr_expect_eq(bench_check_against_cpu(1.0, 1.0, 1.0, 1.0, 0.0, 0.0, why, sizeof why), 0,
                 "equal numbers pass a zero tolerance");
}

Test(bench, flops_conventions)
{
    model_config_t m7 = preset("llama-7b");
    cr_expect_float_eq(bench_flops_6n(&m7), 6.0 * (double)model_config_params(&m7), 1.0);
    cr_expect_gt(model_config_params(&m7), 6700000000LL);
    cr_expect_lt(model_config_params(&m7), 6800000000LL);
}

/* ---- through the binary ---------------------------------------------------------- */

static json_t *last_json(const char *out)
{
    const char *line = NULL;
    for (const char *p = out; p && *p; p = strchr(p, '\n') ? strchr(p, '\n') + 1 : NULL)
        if (*p == '{')
            line = p;
    cr_assert(line, "no JSON line in: %s", out);
    json_error_t je;
    json_t *j = json_loadb(line, strcspn(line, "\n"), 0, &je);
    cr_assert(j, "%s in: %s", je.text, line);
    return j;
}

static double num(json_t *j, const char *key)
{
    json_t *v = json_object_get(j, key);
    cr_assert(json_is_number(v), "no number %s", key);
    return json_number_value(v);
}

Test(bench, cpu_run_records_step1_loss_gradient_norm_and_both_mfus, .timeout = 300)
{
    char *out = NULL;
    int rc = tu_spotune(&out, "bench --backend cpu --threads 2 --preset small --mode lora "
                              "--seq-len 64 --steps 1 --warmup 0 --peak-tflops 1 --json 2>&1");
    cr_assert_eq(rc, 0, "%s", out);
    json_t *j = last_json(out);
    model_config_t mc = preset("small");
    double loss = num(j, "step1_loss"), gnorm = num(j, "step1_grad_norm");
    cr_expect(isfinite(loss) && fabs(loss - bench_expected_loss(&mc)) < 1.0, "loss %g", loss);
    cr_expect(isfinite(gnorm) && gnorm > 0, "gradient norm %g", gnorm);
    cr_expect_float_eq(num(j, "expected_loss"), bench_expected_loss(&mc), 1e-9);
    cr_expect_str_eq(json_string_value(json_object_get(j, "check")), "ok");
    double tps = num(j, "tokens_per_s");
    /* MFU = FLOPs per token x tokens/s / peak (1 TFLOP/s here) */
    cr_expect_float_eq(num(j, "mfu"), num(j, "flops_per_token") * tps / 1e12, 1e-9);
    cr_expect_float_eq(num(j, "mfu_6n"), 6.0 * (double)model_config_params(&mc) * tps / 1e12,
                       1e-9);
    /* LoRA: 4N for frozen weights, so the honest count is below 6N */
    cr_expect_lt(num(j, "flops_per_token"), num(j, "flops_per_token_6n"));
    cr_expect_null(json_object_get(j, "cpu_step1_loss"), "no CPU check on the cpu backend");
    /* the products' kernels, which move a CPU figure by up to 2x */
    const char *blas = json_string_value(json_object_get(j, "blas"));
    cr_expect(blas && strncmp(blas, "OpenBLAS ", 9) == 0, "blas: %s", blas ? blas : "(none)");
    cr_expect(json_object_get(j, "blas_better"), "no blas_better");
    json_decref(j);
    free(out);
}

/* OPENBLAS_CORETYPE set to the generic kernels on a CPU with AVX2 and FMA:
 * spotune keeps the user's value, and its bench says what it costs (the
 * figures of a CPU step are not comparable across kernel sets) */
Test(bench, cpu_run_names_kernels_held_below_the_cpu, .timeout = 300)
{
    __builtin_cpu_init();
    int avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                 __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                 __builtin_cpu_supports("avx512cd");
    int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    const char *want = avx512 ? "SkylakeX" : avx2 ? "Haswell" : NULL;
    cr_assert_eq(setenv("OPENBLAS_CORETYPE", "Prescott", 1), 0); /* this test's process only */
    char *out = NULL;
    int rc = tu_spotune(&out, "bench --backend cpu --threads 2 --preset tiny --mode lora "
                              "--seq-len 32 --steps 1 --warmup 0 --json 2>&1");
    cr_assert_eq(rc, 0, "%s", out);
    json_t *j = last_json(out);
    const char *blas = json_string_value(json_object_get(j, "blas"));
    cr_expect(blas && strstr(blas, "OpenBLAS Prescott kernels"), "blas: %s", blas ? blas : "-");
    json_t *b = json_object_get(j, "blas_better");
    if (want)
        cr_expect_str_eq(json_string_value(b) ? json_string_value(b) : "(null)", want);
    else
        cr_expect(json_is_null(b), "a CPU without AVX2: nothing better");
    json_decref(j);
    free(out);

    rc = tu_spotune(&out, "bench --backend cpu --threads 2 --preset tiny --mode lora "
                          "--seq-len 32 --steps 1 --warmup 0 2>&1");
    cr_assert_eq(rc, 0, "%s", out);
    cr_expect(tu_contains(out, "  OpenBLAS Prescott kernels;"), "%s", out);
    if (want)
        cr_expect(tu_contains(out, "OPENBLAS_CORETYPE=Prescott keeps OpenBLAS on kernels narrower "
                                   "than this CPU's vector units: OPENBLAS_CORETYPE="),
                  "%s", out);
    free(out);
}

Test(bench, another_backend_is_checked_against_the_cpu_step, .timeout = 300)
{
    char *out = NULL;
    int rc = tu_spotune(&out, "bench --backend cpu-ref --threads 2 --preset tiny --mode both "
                              "--seq-len 32 --steps 1 --warmup 0 --json 2>&1");
    cr_assert_eq(rc, 0, "%s", out);
    json_t *j = last_json(out); /* full, the second mode */
    double loss = num(j, "step1_loss"), cpu = num(j, "cpu_step1_loss");
    cr_expect(fabs(loss - cpu) <= BENCH_LOSS_TOL * fabs(cpu), "%g vs %g", loss, cpu);
    double g = num(j, "step1_grad_norm"), cg = num(j, "cpu_step1_grad_norm");
    cr_expect(fabs(g - cg) <= BENCH_GNORM_TOL * fabs(cg), "%g vs %g", g, cg);
    cr_expect(tu_contains(json_string_value(json_object_get(j, "cpu_check")),
                          "step 1 vs the cpu backend"));
    json_decref(j);
    free(out);

    /* beyond the tolerance the run fails, saying both figures */
    rc = tu_spotune(&out, "bench --backend cpu-ref --threads 2 --preset tiny --mode lora "
                          "--seq-len 32 --steps 1 --warmup 0 --check-tol 0 2>&1");
    cr_expect_eq(rc, 1, "exit %d: %s", rc, out);
    cr_expect(tu_contains(out, "error: bench tiny lora on cpu-ref: step 1 vs the cpu backend"),
              "%s", out);
    free(out);

    /* --cpu-check off: no check, no failure */
    rc = tu_spotune(&out, "bench --backend cpu-ref --threads 2 --preset tiny --mode lora "
                          "--seq-len 32 --steps 1 --warmup 0 --check-tol 0 --cpu-check off "
                          "--json 2>&1");
    cr_expect_eq(rc, 0, "%s", out);
    j = last_json(out);
    cr_expect_null(json_object_get(j, "cpu_step1_loss"));
    json_decref(j);
    free(out);

    rc = tu_spotune(&out, "bench --check-tol x 2>&1");
    cr_expect_eq(rc, 2, "%s", out);
    free(out);
}

/* --doc-len: windows of packed documents (data.packing: documents), on
 * every backend; the step is another one (attention stays inside each
 * document), checked against the CPU's with the same documents; bad
 * lengths are refused, naming the option. */
Test(bench, packed_documents_are_benched_and_checked, .timeout = 300)
{
    char *out = NULL;
    const char *run = "bench --backend cpu-ref --threads 2 --preset tiny --mode lora --seq-len 32 "
                      "--steps 1 --warmup 0 --json";
    int rc = tu_spotune(&out, "%s --doc-len 6 2>&1", run);
    cr_assert_eq(rc, 0, "%s", out);
    json_t *j = last_json(out);
    cr_expect_eq(json_integer_value(json_object_get(j, "doc_len")), 6);
    double loss = num(j, "step1_loss"), cpu = num(j, "cpu_step1_loss");
    cr_expect(fabs(loss - cpu) <= BENCH_LOSS_TOL * fabs(cpu), "%g vs %g", loss, cpu);
    /* documents of 3 to 9 tokens: each token's attention counts over its own */
    double ctx = num(j, "attention_context"), fpt = num(j, "flops_per_token");
    cr_expect(ctx >= 3.0 && ctx <= 9.0, "attention context %g of documents of 3-9 tokens", ctx);
    json_decref(j);
    free(out);
    rc = tu_spotune(&out, "%s 2>&1", run);
    cr_assert_eq(rc, 0, "%s", out);
    j = last_json(out);
    cr_expect_eq(json_integer_value(json_object_get(j, "doc_len")), 0);
    cr_expect(num(j, "step1_loss") != loss, "packed documents left the step's loss %.9g", loss);
    /* dense rows: the row's 32 keys; the FLOPs differ by the attention's part alone */
    model_config_t mc = preset("tiny");
    cr_expect_float_eq(num(j, "attention_context"), 32.0, 1e-12);
    double attn = 12.0 * (double)mc.layers * (double)(mc.heads * mc.head_dim);
    cr_expect_float_eq(num(j, "flops_per_token") - fpt, attn * (32.0 - ctx),
                       1e-9 * num(j, "flops_per_token"));
    json_decref(j);
    free(out);
    rc = tu_spotune(&out, "bench --doc-len x 2>&1");
    cr_expect(rc == 2 && tu_contains(out, "--doc-len takes a token count, not 'x'"), "%s", out);
    free(out);
    rc = tu_spotune(&out, "bench --seq-len 32 --doc-len 33 2>&1");
    cr_expect(rc == 2 && tu_contains(out, "--doc-len must be from 0 (none) to --seq-len (32)"),
              "%s", out);
    free(out);
}

/* A token attends only within its document: the context counted is the sum
 * of the documents' squared lengths over the tokens. */
Test(bench, attention_context_of_packed_documents)
{
    /* row 0: documents of 3 and 5 tokens; row 1: one of 8 */
    const int32_t seg[16] = {0, 0, 0, 3, 3, 3, 3, 3, 0, 0, 0, 0, 0, 0, 0, 0};
    cr_expect_float_eq(bench_attention_context(seg, 2, 8), (9.0 + 25.0 + 64.0) / 16.0, 1e-12);
    cr_expect_float_eq(bench_attention_context(seg, 1, 8), (9.0 + 25.0) / 8.0, 1e-12);
    cr_expect_float_eq(bench_attention_context(NULL, 2, 8), 8.0, 1e-12);
    /* eight documents of one token: each attends to itself alone */
    const int32_t ones[8] = {0, 1, 2, 3, 4, 5, 6, 7};
    cr_expect_float_eq(bench_attention_context(ones, 1, 8), 1.0, 1e-12);
}

Test(bench, probe_cuda_names_the_reason)
{
    char *out = NULL;
    int rc = tu_spotune(&out, "bench --probe-cuda 2>&1");
    if (rc == 0) {
        cr_expect(tu_contains(out, "cuda: ") && tu_contains(out, "CUDA device"), "%s", out);
    } else {
        cr_expect_eq(rc, BENCH_EXIT_NO_DEVICE, "%s", out);
        cr_expect(tu_contains(out, "no usable CUDA device: ") &&
                      (tu_contains(out, "cudaGetDeviceCount: ") ||
                       tu_contains(out, "cudaDeviceGetAttribute: ") ||
                       tu_contains(out, "built without the CUDA backend")),
                  "%s", out);
    }
    free(out);
}

/* The CUDA backend is a module loaded on first use. A module that cannot be
 * loaded is named with the loader's reason (the CPU still works), and a run
 * that asks for the cuda backend then fails with exit 2 saying so. */
Test(bench, a_cuda_module_that_cannot_load_is_named)
{
    char *out = NULL;
    if (tu_spotune(&out, "bench --probe-cuda 2>&1 | grep -q 'built without the CUDA backend'") ==
        0) { /* no module to load: asking for cuda is refused by name instead */
        free(out);
        int rc = tu_spotune(&out, "bench --preset tiny --backend cuda --steps 1 2>&1");
        cr_expect_eq(rc, 2, "%s", out);
        cr_expect(tu_contains(out, "built without CUDA"), "%s", out);
        free(out);
        return;
    }
    free(out);
    int rc = tu_sh(&out, "SPOTUNE_CUDA_MODULE=/nonexistent/libspotune_cuda.so %s/spotune bench "
                     "--probe-cuda 2>&1",
               SPOTUNE_BINARY_DIR);
    cr_expect_eq(rc, BENCH_EXIT_NO_DEVICE, "%s", out);
    cr_expect(tu_contains(out, "the CUDA backend (libspotune_cuda.so) cannot be loaded: "
                               "SPOTUNE_CUDA_MODULE=/nonexistent/libspotune_cuda.so: "),
              "%s", out);
    free(out);
    rc = tu_sh(&out, "SPOTUNE_CUDA_MODULE=/nonexistent/libspotune_cuda.so %s/spotune bench "
                     "--preset tiny --backend cuda --steps 1 2>&1",
               SPOTUNE_BINARY_DIR);
    cr_expect_eq(rc, 2, "%s", out);
    cr_expect(tu_contains(out, "runtime.backend: cuda: the CUDA backend"), "%s", out);
    free(out);
}

/* One more step than the timed ones, split by group of ops (backend.h, "step
 * profile"): the groups add up to the profiled step; LoRA's share is there
 * in LoRA mode and absent in full fine-tuning; products, attention, the
 * elementwise ops and the optimizer each take time; one rank has no
 * communication, two ranks (full, sharded optimizer and gradients) do. */
static json_t *split_of(json_t *j, const char *what)
{
    json_t *sp = json_object_get(j, "split_ms");
    cr_assert(json_is_object(sp), "%s: no split_ms", what);
    double sum = 0;
    for (int g = 0; g < BE_PROF_GROUPS; g++) {
        json_t *v = json_object_get(sp, be_prof_names[g]);
        cr_assert(json_is_number(v), "%s: no split_ms.%s", what, be_prof_names[g]);
        cr_expect_geq(json_number_value(v), 0.0, "%s: %s", what, be_prof_names[g]);
        sum += json_number_value(v);
    }
    cr_expect_float_eq(sum, num(j, "profiled_step_ms"), 1e-6 * sum, "%s: %g vs %g", what, sum,
                       num(j, "profiled_step_ms"));
    return sp;
}

static double ms_of(json_t *sp, const char *group)
{
    return json_number_value(json_object_get(sp, group));
}

Test(bench, one_step_is_split_by_group_of_ops, .timeout = 300)
{
    char *out = NULL;
    int rc = tu_spotune(&out, "bench --backend cpu --threads 1 --preset tiny --mode lora "
                              "--seq-len 64 --micro-batch 2 --steps 1 --warmup 0 --json 2>&1");
    cr_assert_eq(rc, 0, "%s", out);
    json_t *j = last_json(out), *sp = split_of(j, "lora");
    for (int g = 0; g < BE_PROF_GROUPS; g++)
        if (g != BE_PROF_COMM)
            cr_expect_gt(ms_of(sp, be_prof_names[g]), 0.0, "lora: no time in %s",
                         be_prof_names[g]);
    cr_expect_eq(ms_of(sp, "communication"), 0.0, "one rank communicates");
    json_decref(j);
    free(out);
    rc = tu_sh(&out, "%s %s/spotune bench --backend cpu --threads 1 --preset tiny --mode full "
                     "--seq-len 64 --micro-batch 2 --steps 1 --warmup 0 --json 2>&1",
               tu_mpirun(2), tu_binary_dir());
    cr_assert_eq(rc, 0, "%s", out);
    j = last_json(out);
    sp = split_of(j, "full, 2 ranks");
    cr_expect_eq(ms_of(sp, "lora"), 0.0, "full fine-tuning has no LoRA");
    cr_expect_gt(ms_of(sp, "gemm"), 0.0);
    cr_expect_gt(ms_of(sp, "communication"), 0.0, "2 ranks: no communication");
    json_decref(j);
    free(out);
}

/* --cuda-graphs on (the CPU replays its recorded op list): the JSON says
 * how many steps' micro-batches and updates replayed a graph and their ops;
 * with 4 timed steps after 1 warm-up, the second step captures and every
 * later one replays (the profiled step after them runs eagerly). The step-1
 * loss is the eager one's. */
Test(bench, cuda_graphs_on_reports_the_replays, .timeout = 300)
{
    char *out = NULL;
    const char *cmd = "bench --backend cpu --threads 1 --preset tiny --mode lora --seq-len 32 "
                      "--micro-batch 2 --steps 4 --warmup 1 --json --cuda-graphs %s 2>&1";
    int rc = tu_spotune(&out, cmd, "on");
    cr_assert_eq(rc, 0, "%s", out);
    json_t *j = last_json(out);
    cr_expect(json_is_true(json_object_get(j, "cuda_graphs")));
    cr_expect_str_empty(json_string_value(json_object_get(j, "graph_off")));
    cr_expect_eq(num(j, "graph_replays"), 4, "%s", out);
    cr_expect_eq(num(j, "graph_update_replays"), 4, "%s", out);
    cr_expect_gt(num(j, "graph_ops"), 100);
    cr_expect_eq(num(j, "graph_update_ops"), 2, "sumsq_into and one AdamW (LoRA: one decay group)");
    double loss = num(j, "step1_loss"), gnorm = num(j, "step1_grad_norm");
    json_decref(j);
    free(out);
    rc = tu_spotune(&out, cmd, "off");
    cr_assert_eq(rc, 0, "%s", out);
    j = last_json(out);
    cr_expect_eq(num(j, "step1_loss"), loss, "graphs changed the step-1 loss");
    cr_expect_eq(num(j, "step1_grad_norm"), gnorm, "graphs changed the step-1 norm");
    cr_expect_null(json_object_get(j, "graph_replays"), "graphs off, yet replays reported");
    json_decref(j);
    free(out);
}
