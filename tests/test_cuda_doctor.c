/* spotune doctor's GPU measurements (kernels/cuda/cuda_doctor.cu and
 * trainer/doctor_gpu.c) on a CUDA device:
 *   - the module's entry points called directly at small sizes: the device's
 *     properties, a bf16 GEMM whose every result is checked, a device copy
 *     and (two devices) a peer copy whose bytes are checked, each with a
 *     positive, finite figure; an invalid device is -1 naming the CUDA error;
 *   - `spotune doctor --gemm-n 256 --gpu-mib 16` (sizes a GPU does in
 *     milliseconds): every gpu line PASS or SKIPPED with its reason (NVML),
 *     the sizes named, exit 0, and under `mpirun -np 2` (two devices) the
 *     NCCL all-reduce line PASS with its bus bandwidths;
 *   - on the emulated device only (tests/cuda_emu, which can be made to
 *     fail so): a GEMM with one wrong result FAILs naming it (exit 1), so
 *     do copies with a wrong byte (device and peer); a driver older than
 *     the runtime FAILs the device line.
 * Without a usable CUDA device it skips (77, cuda_test_main.h). On the
 * emulated device (tests/cuda.cmake: emu_test_cuda_doctor) with two devices
 * and the emulated NCCL preloaded. */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_test_main.h"
#include "kernels/backend.h"
#include "kernels/cuda/cuda_doctor.h"
#include "test_util.h"

static void *entry(const char *name)
{
    char why[1024] = "";
    void *f = backend_cuda_symbol(name, why, sizeof why);
    cr_assert(f, "%s: %s", name, why);
    return f;
}

static int devices(void)
{
    char why[512];
    return backend_cuda_probe(why, sizeof why);
}

/* The emulated device says so in its name (tests/cuda_emu/emu_runtime.cc). */
static int emulated(void)
{
    cuda_doctor_info_fn info = (cuda_doctor_info_fn)entry("cuda_doctor_info");
    cuda_doctor_dev dv;
    char why[600];
    cr_assert_eq(info(0, &dv, why, sizeof why), 0, "%s", why);
    return strstr(dv.name, "emulated") != NULL;
}

Test(cuda_doctor, entry_points_measure_and_check_what_they_computed)
{
    char why[600] = "";
    cuda_doctor_info_fn info = (cuda_doctor_info_fn)entry("cuda_doctor_info");
    cuda_doctor_dev dv;
    cr_assert_eq(info(0, &dv, why, sizeof why), 0, "%s", why);
    cr_expect(dv.name[0] && dv.mem_total > 0 && dv.mem_free > 0 && dv.mem_free <= dv.mem_total,
              "%s: %zu of %zu free", dv.name, dv.mem_free, dv.mem_total);
    cr_expect(dv.cc_major >= 7 && dv.sm_count >= 1, "sm_%d%d, %d SMs", dv.cc_major, dv.cc_minor,
              dv.sm_count);
    cr_expect(dv.driver_version >= 1000 && dv.runtime_version >= 1000, "driver %d runtime %d",
              dv.driver_version, dv.runtime_version);
    /* an invalid device: -1 naming the CUDA call and error */
    cr_expect_eq(info(devices(), &dv, why, sizeof why), -1);
    cr_expect(tu_contains(why, "cudaGetDeviceProperties") &&
                  tu_contains(why, "cudaErrorInvalidDevice"),
              "%s", why);

    double tf = -1;
    cuda_doctor_gemm_fn gemm = (cuda_doctor_gemm_fn)entry("cuda_doctor_gemm");
    cr_assert_eq(gemm(0, 192, 3, &tf, why, sizeof why), 0, "%s", why);
    cr_expect(tf > 0 && isfinite(tf), "%g TFLOP/s", tf);

    double gb = -1;
    cuda_doctor_copy_fn copy = (cuda_doctor_copy_fn)entry("cuda_doctor_copy");
    cr_assert_eq(copy(0, (size_t)3 << 20, 3, &gb, why, sizeof why), 0, "%s", why);
    cr_expect(gb > 0 && isfinite(gb), "%g GB/s", gb);
    /* smaller than the MiB checked at each end */
    cr_assert_eq(copy(0, 1000, 2, &gb, why, sizeof why), 0, "%s", why);

    if (devices() >= 2) {
        cuda_doctor_p2p_fn p2p = (cuda_doctor_p2p_fn)entry("cuda_doctor_p2p");
        int can = -1;
        gb = -1;
        cr_assert_eq(p2p(0, 1, (size_t)5 << 20, &can, &gb, why, sizeof why), 0, "%s", why);
        cr_expect((can == 0 || can == 1) && gb > 0 && isfinite(gb), "can %d, %g GB/s", can, gb);
        /* again: peer access already enabled is not an error */
        cr_assert_eq(p2p(0, 1, (size_t)1 << 20, &can, &gb, why, sizeof why), 0, "%s", why);
    }
}

/* The --json report's check named name: its status (NULL: no such check)
 * and its measured text into *measured (borrowed from doc). */
static const char *status_of(json_t *doc, const char *name, const char **measured)
{
    size_t i;
    json_t *c;
    json_array_foreach(json_object_get(doc, "checks"), i, c)
    {
        if (!strcmp(json_string_value(json_object_get(c, "check")), name)) {
            if (measured)
                *measured = json_string_value(json_object_get(c, "measured"));
            return json_string_value(json_object_get(c, "status"));
        }
    }
    return NULL;
}

/* The report's line name has status want and says each of the texts
 * (NULL-terminated). */
static void expect_line(json_t *doc, const char *name, const char *want, ...)
{
    const char *m = NULL, *st = status_of(doc, name, &m);
    cr_assert(st, "no %s", name);
    cr_expect_str_eq(st, want, "%s: %s", name, m);
    va_list ap;
    va_start(ap, want);
    for (const char *says; (says = va_arg(ap, const char *));)
        cr_expect(tu_contains(m, says), "%s does not say '%s': %s", name, says, m);
    va_end(ap);
}

static json_t *doctor_json(int ranks, const char *env, const char *sizes, int want_rc)
{
    char *out = NULL;
    int rc = tu_sh(&out, "%s %s %s/spotune doctor --cloud none --io-mib 1 %s --json 2>/dev/null",
                   env, ranks > 1 ? tu_mpirun(ranks) : "", tu_binary_dir(), sizes);
    cr_assert_eq(rc, want_rc, "doctor (%d ranks) exit %d:\n%s", ranks, rc, out);
    json_error_t je;
    json_t *doc = json_loads(out, 0, &je);
    cr_assert(doc, "not JSON (%s): %s", je.text, out);
    free(out);
    return doc;
}

/* Every device's lines: PASS, or SKIPPED naming NVML (ECC, clocks). */
static void every_gpu_line_passes(json_t *doc, int n, int gemm_n, int mib)
{
    for (int i = 0; i < n; i++) {
        static const char *const lines[] = {"device", "gemm_bf16", "memcopy", "ecc", "clocks"};
        for (size_t k = 0; k < sizeof lines / sizeof lines[0]; k++) {
            char name[48];
            snprintf(name, sizeof name, "gpu%d.%s", i, lines[k]);
            const char *m = NULL, *st = status_of(doc, name, &m);
            cr_assert(st, "no %s", name);
            int nvml = k >= 3 && !strcmp(st, "SKIPPED") && tu_contains(m, "NVML");
            cr_expect(!strcmp(st, "PASS") || nvml, "%s %s: %s", name, st, m);
            if (k == 1) {
                char says[64];
                snprintf(says, sizeof says, "(%d^3, fp32 accumulation), results right", gemm_n);
                cr_expect(tu_contains(m, says), "%s: %s", name, m);
            }
            if (k == 2) {
                char says[64];
                snprintf(says, sizeof says, "(%d MiB device to device", mib);
                cr_expect(tu_contains(m, says), "%s: %s", name, m);
            }
        }
    }
    for (int a = 0; a < n; a++)
        for (int b = 0; b < n; b++) {
            char name[48];
            snprintf(name, sizeof name, "gpu.p2p.%d-%d", a, b);
            const char *m = NULL, *st = status_of(doc, name, &m);
            if (a == b) {
                cr_expect(!st, "%s reported", name);
                continue;
            }
            /* PASS with peer access, WARN without: both measured */
            cr_assert(st, "no %s", name);
            cr_expect(strcmp(st, "FAIL") && tu_contains(m, "GB/s (16 MiB copies)"), "%s %s: %s",
                      name, st, m);
        }
}

Test(cuda_doctor, quick_sizes_one_rank)
{
    int n = devices();
    json_t *doc = doctor_json(1, "", "--gemm-n 256 --gpu-mib 16", 0);
    every_gpu_line_passes(doc, n, 256, 16);
    expect_line(doc, "gpu.nccl_allreduce", "SKIPPED", "one rank", NULL);
    json_decref(doc);
}

Test(cuda_doctor, two_ranks_measure_nccl)
{
    if (devices() < 2)
        cr_skip_test("one CUDA device: the NCCL line needs two ranks on two devices");
    json_t *doc = doctor_json(2, "", "--gemm-n 256 --gpu-mib 16", 0);
    every_gpu_line_passes(doc, devices(), 256, 16);
    expect_line(doc, "gpu.nccl_allreduce", "PASS", "2 ranks", "1 MiB ", "16 MiB ", NULL);
    const char *m = NULL;
    status_of(doc, "gpu.nccl_allreduce", &m);
    cr_expect(!tu_contains(m, "256 MiB"), "above --gpu-mib: %s", m);
    json_decref(doc);
}

/* What a failing GPU looks like, made so on the emulated device. */
Test(cuda_doctor, wrong_results_wrong_copies_and_an_old_driver_fail)
{
    if (!emulated())
        cr_skip_test("only the emulated device can be made to compute wrong results");
    const char *sizes = "--gemm-n 128 --gpu-mib 2";
    json_t *doc = doctor_json(1, "SPOTUNE_CUDA_EMU_CUBLAS=corrupt", sizes, 1);
    expect_line(doc, "gpu0.gemm_bf16", "FAIL", "1 of 16384 results wrong (C[127,127] = ",
                "ask for another machine", NULL);
    expect_line(doc, "gpu0.memcopy", "PASS", NULL);
    json_decref(doc);

    /* copies whose last byte comes out wrong: the device copy and the peer
     * copies FAIL naming the byte */
    doc = doctor_json(1, "SPOTUNE_CUDA_EMU_COPY=corrupt", sizes, 1);
    expect_line(doc, "gpu0.memcopy", "FAIL",
                "cudaMemcpy device to device: byte 2097151 of the destination is 0xfe, "
                "expected 0x01",
                NULL);
    if (devices() >= 2)
        expect_line(doc, "gpu.p2p.0-1", "FAIL",
                    "cudaMemcpyPeer: byte 2097151 of the destination is 0xfd, expected 0x02",
                    NULL);
    expect_line(doc, "gpu0.gemm_bf16", "PASS", NULL);
    json_decref(doc);

    doc = doctor_json(1, "SPOTUNE_CUDA_EMU_DRIVER_VERSION=12040", sizes, 1);
    expect_line(doc, "gpu0.device", "FAIL", "driver CUDA 12.4", "runtime 13.0", NULL);
    expect_line(doc, "gpu0.gemm_bf16", "PASS", NULL);
    json_decref(doc);
}

int main(int argc, char *argv[])
{
    return cuda_test_main(argc, argv); /* no usable device: skips naming the CUDA error */
}
