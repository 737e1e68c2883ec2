/* spotune doctor's GPU lines: devices, versions, ECC and clocks (NVML, loaded
 * with dlopen when present), a bf16 GEMM and a device-memory copy per GPU,
 * peer access and bandwidth between pairs (the CUDA module's cuda_doctor_*
 * entry points, kernels/cuda/cuda_doctor.h), and NCCL all-reduce bus
 * bandwidth over the job's ranks (comm's device collectives). Without a
 * usable GPU every line is SKIPPED with the reason. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

#include "../kernels/backend.h"
#include "../kernels/cuda/cuda_doctor.h"
#include "doctor_internal.h"

/* Dense bf16 peak (fp32 accumulation) and memory bandwidth of the cards
 * people rent, from the vendors' data sheets; the first name contained in
 * the device's name wins (so "A100" before "A10", "L40S" before "L4"). */
static const struct {
    const char *name;
    double tflops, gbps;
} cards[] = {
    {"H200", 989, 4800},      {"H100 PCIe", 756, 2000}, {"H100 NVL", 835, 3900},
    {"H100", 989, 3350},      {"A100-SXM4-80GB", 312, 2039}, {"A100 80GB", 312, 1935},
    {"A100", 312, 1555},      {"L40S", 362, 864},       {"L40", 181, 864},
    {"L4", 121, 300},         {"A10G", 70, 600},        {"A10", 125, 600},
    {"RTX 6000 Ada", 364, 960}, {"RTX A6000", 155, 768}, {"RTX 4090", 165, 1008},
    {"RTX 3090", 71, 936},
};

static int card_of(const char *name)
{
    for (size_t i = 0; i < sizeof cards / sizeof cards[0]; i++)
        if (strstr(name, cards[i].name))
            return (int)i;
    return -1;
}

void doctor_gpu_probe(dr_gpus *g, int detail)
{
    memset(g, 0, sizeof *g);
    g->count = backend_cuda_probe(g->why, sizeof g->why);
    if (g->count <= 0) {
        g->count = 0;
        return;
    }
    if (!detail) /* the memory of each device needs a context on each */
        return;
    cuda_doctor_info_fn info =
        (cuda_doctor_info_fn)backend_cuda_symbol("cuda_doctor_info", g->why, sizeof g->why);
    for (int i = 0; info && i < g->count; i++) {
        cuda_doctor_dev dv;
        if (info(i, &dv, g->why, sizeof g->why) != 0)
            continue;
        if (g->min_free == 0 || dv.mem_free < g->min_free)
            g->min_free = dv.mem_free;
        if (g->min_total == 0 || dv.mem_total < g->min_total)
            g->min_total = dv.mem_total;
        if (!g->name[0])
            snprintf(g->name, sizeof g->name, "%s", dv.name);
    }
}

/* ---- NVML (libnvidia-ml.so.1 from the driver), looked up at run time ----------- */

typedef struct nvml_api {
    void *h;
    int (*init)(void);
    int (*by_pci)(const char *bus, void **dev);
    int (*ecc)(void *dev, int type, int counter, unsigned long long *count);
    int (*clock)(void *dev, int type, unsigned *mhz);
    int (*max_clock)(void *dev, int type, unsigned *mhz);
    int (*driver)(char *v, unsigned n);
    char why[300];
} nvml_api;

static int nvml_open(nvml_api *n)
{
    memset(n, 0, sizeof *n);
    n->h = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!n->h) {
        snprintf(n->why, sizeof n->why, "NVML not loadable: %s", dlerror());
        return -1;
    }
    *(void **)&n->init = dlsym(n->h, "nvmlInit_v2");
    *(void **)&n->by_pci = dlsym(n->h, "nvmlDeviceGetHandleByPciBusId_v2");
    *(void **)&n->ecc = dlsym(n->h, "nvmlDeviceGetTotalEccErrors");
    *(void **)&n->clock = dlsym(n->h, "nvmlDeviceGetClockInfo");
    *(void **)&n->max_clock = dlsym(n->h, "nvmlDeviceGetMaxClockInfo");
    *(void **)&n->driver = dlsym(n->h, "nvmlSystemGetDriverVersion");
    if (!n->init || !n->by_pci || !n->ecc || !n->clock || !n->max_clock || !n->driver) {
        snprintf(n->why, sizeof n->why, "NVML lacks an entry point");
        return -1;
    }
    int rc = n->init();
    if (rc != 0) {
        snprintf(n->why, sizeof n->why, "nvmlInit_v2: error %d", rc);
        return -1;
    }
    return 0;
}

/* ---- NCCL all-reduce over the job's ranks ----------------------------------------- */

static void check_nccl(doctor_t *d, const dr_gpus *g, int most_mib, comm_t *comm)
{
    const char *name = "gpu.nccl_allreduce";
    const char *expect = "bus bandwidth at 256 MiB near the links' (NVLink: hundreds of GB/s; "
                         "PCIe 4: ~20; the network between nodes)";
    int size = comm_size(comm), rank = comm_rank(comm);
    sp_err err = {0};
    /* every rank must take the same path: all with a GPU, or none measures */
    int32_t ready = g->count > 0 && comm_device_available() && size > 1;
    if (comm_allreduce(comm, &ready, 1, COMM_I32, COMM_MIN, &err) != 0) {
        if (rank == 0)
            doctor_add(d, name, DR_FAIL, expect, "%s", err.msg);
        return;
    }
    char why[600] = "", ver[64];
    comm_nccl_version(ver, sizeof ver);
    if (!ready) {
        if (rank == 0)
            doctor_add(d, name, DR_SKIPPED, expect, "%s%s", g->count == 0 ? "" : ver,
                       g->count == 0 ? g->why
                       : !comm_device_available()
                           ? ""
                           : "; one rank: run it under mpirun -np <GPUs> (one rank per GPU) to "
                             "measure NCCL over the local GPUs, and over every node with a "
                             "hostfile");
        return;
    }
    int dev = comm_device_for_rank(comm, g->count);
    /* one GPU per rank, or NCCL refuses: said here by rank and host */
    cuda_doctor_info_fn info =
        (cuda_doctor_info_fn)backend_cuda_symbol("cuda_doctor_info", why, sizeof why);
    cuda_doctor_dev dv;
    unsigned char uuid[16] = {0};
    if (info && info(dev, &dv, why, sizeof why) == 0)
        memcpy(uuid, dv.uuid, sizeof uuid);
    if (comm_check_devices_distinct(comm, uuid, dev, g->count, &err) != 0) {
        if (rank == 0)
            doctor_add(d, name, DR_FAIL, expect, "%s: %s", ver, err.msg);
        return;
    }
    cuda_doctor_alloc_fn alloc =
        (cuda_doctor_alloc_fn)backend_cuda_symbol("cuda_doctor_alloc", why, sizeof why);
    cuda_doctor_free_fn release =
        (cuda_doctor_free_fn)backend_cuda_symbol("cuda_doctor_free", why, sizeof why);
    void *buf = NULL;
    size_t most = (size_t)most_mib << 20;
    int32_t ok = alloc && release && alloc(dev, most, &buf, why, sizeof why) == 0;
    /* every rank agrees before the communicator is made (a collective of
     * all of them), so a rank whose buffer failed does not leave the
     * others waiting in it */
    int32_t all_ok = ok;
    int agreed = comm_allreduce(comm, &all_ok, 1, COMM_I32, COMM_MIN, &err) == 0;
    if (agreed && all_ok && comm_device_init(comm, dev, &err) != 0) {
        sp_cutf(why, sizeof why, "%s", err.msg);
        ok = all_ok = 0; /* comm_device_init fails on every rank together */
    }
    sp_err_clear(&err);
    if (agreed && all_ok) {
        /* fp32 all-reduces of 1, 16 and 256 MiB (those within most_mib):
         * the bus bandwidth of each (algorithm bandwidth x 2(n-1)/n, as
         * nccl-tests gives it), the slowest rank's time */
        static const int mib_sizes[] = {1, 16, 256};
        char fig[400] = "";
        size_t len = 0;
        int rc = 0;
        for (size_t k = 0; !rc && k < sizeof mib_sizes / sizeof mib_sizes[0] &&
                           mib_sizes[k] <= most_mib;
             k++) {
            size_t bytes = (size_t)mib_sizes[k] << 20, n = bytes / 4;
            int iters = mib_sizes[k] >= 256 ? 10 : 20;
            double t0 = 0;
            for (int i = -2; !rc && i < iters; i++) { /* two warm-ups */
                if (i == 0) {
                    rc = comm_device_wait(comm, NULL, &err) || comm_barrier(comm, &err);
                    t0 = sp_now();
                }
                if (!rc)
                    rc = comm_device_allreduce(comm, buf, n, COMM_F32, COMM_SUM, NULL, &err);
            }
            if (!rc)
                rc = comm_device_wait(comm, NULL, &err);
            double slowest = sp_now() - t0;
            if (!rc)
                rc = comm_allreduce(comm, &slowest, 1, COMM_F64, COMM_MAX, &err);
            if (!rc) {
                double bus = (double)bytes * iters / slowest / 1e9 * 2.0 * (size - 1) / size;
                int w = snprintf(fig + len, sizeof fig - len, "%s%d MiB %.1f GB/s",
                                 len ? ", " : "", mib_sizes[k], bus);
                len += w > 0 && (size_t)w < sizeof fig - len ? (size_t)w : 0;
            }
        }
        if (rank == 0) {
            if (rc)
                doctor_add(d, name, DR_FAIL, expect, "%s: %s", ver, err.msg);
            else
                doctor_add(d, name, DR_PASS, expect,
                           "%s, %d ranks on %d GPU(s) each host, fp32 bus bandwidth: %s", ver,
                           size, g->count, fig);
        }
    } else if (rank == 0) {
        doctor_add(d, name, DR_FAIL, expect, "%s could not be set up%s%s", ver,
                   ok ? " on another rank" : ": ", ok ? "" : why);
    }
    if (buf && release)
        release(buf);
}

/* ---- the lines -------------------------------------------------------------------- */

void doctor_gpu_checks(doctor_t *d, const dr_gpus *g, const dr_gpu_sizes *sz, comm_t *comm)
{
    /* P2P copies and the NCCL all-reduces: up to 256 MiB */
    int pair_mib = sz->mib < 256 ? sz->mib : 256, n = sz->gemm_n;
    int first = comm_local_rank(comm) == 0;
    if (first && g->count == 0) {
        static const char *const names[] = {"gpu.devices", "gpu.gemm_bf16", "gpu.memcopy",
                                            "gpu.p2p"};
        for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
            doctor_add(d, names[i], DR_SKIPPED, "", "no usable GPU: %s", g->why);
    }
    if (first && g->count > 0) {
        char why[600] = "";
        cuda_doctor_info_fn info =
            (cuda_doctor_info_fn)backend_cuda_symbol("cuda_doctor_info", why, sizeof why);
        cuda_doctor_gemm_fn gemm =
            (cuda_doctor_gemm_fn)backend_cuda_symbol("cuda_doctor_gemm", why, sizeof why);
        cuda_doctor_copy_fn copy =
            (cuda_doctor_copy_fn)backend_cuda_symbol("cuda_doctor_copy", why, sizeof why);
        cuda_doctor_p2p_fn p2p =
            (cuda_doctor_p2p_fn)backend_cuda_symbol("cuda_doctor_p2p", why, sizeof why);
        if (!info || !gemm || !copy || !p2p) {
            doctor_add(d, "gpu.devices", DR_FAIL, "", "%d GPU(s), but %s", g->count, why);
        } else {
            nvml_api nv;
            int have_nvml = nvml_open(&nv) == 0;
            char drv[96] = "";
            if (have_nvml && nv.driver(drv, sizeof drv) != 0)
                drv[0] = 0;
            for (int i = 0; i < g->count; i++) {
                cuda_doctor_dev dv;
                char nm[48];
                if (info(i, &dv, why, sizeof why) != 0) {
                    snprintf(nm, sizeof nm, "gpu%d.device", i);
                    doctor_add(d, nm, DR_FAIL, "", "%s", why);
                    continue;
                }
                int c = card_of(dv.name);
                snprintf(nm, sizeof nm, "gpu%d.device", i);
                doctor_add(d, nm, dv.driver_version >= dv.runtime_version ? DR_PASS : DR_FAIL,
                           "driver >= the CUDA runtime spotune was built with",
                           "%s (sm_%d%d, %d SMs, PCI %s), %.1f GiB (%.1f GiB free); driver "
                           "CUDA %d.%d%s%s, runtime %d.%d",
                           dv.name, dv.cc_major, dv.cc_minor, dv.sm_count, dv.pci,
                           (double)dv.mem_total / (1 << 30), (double)dv.mem_free / (1 << 30),
                           dv.driver_version / 1000, dv.driver_version % 1000 / 10,
                           drv[0] ? " / " : "", drv, dv.runtime_version / 1000,
                           dv.runtime_version % 1000 / 10);
                /* ECC and clocks from NVML */
                void *nd = NULL;
                char bus[48];
                snprintf(bus, sizeof bus, "%s.0", dv.pci);
                snprintf(nm, sizeof nm, "gpu%d.ecc", i);
                if (!have_nvml || nv.by_pci(bus, &nd) != 0) {
                    doctor_add(d, nm, DR_SKIPPED, "0 uncorrected errors", "%s",
                               have_nvml ? "NVML does not know this PCI bus id" : nv.why);
                    snprintf(nm, sizeof nm, "gpu%d.clocks", i);
                    doctor_add(d, nm, DR_SKIPPED, "", "%s",
                               have_nvml ? "NVML does not know this PCI bus id" : nv.why);
                } else {
                    unsigned long long unc = 0, cor = 0;
                    /* NVML_MEMORY_ERROR_TYPE_{CORRECTED 0, UNCORRECTED 1}, NVML_VOLATILE_ECC 0 */
                    int e1 = nv.ecc(nd, 1, 0, &unc), e0 = nv.ecc(nd, 0, 0, &cor);
                    if (!dv.ecc_enabled || e1 != 0)
                        doctor_add(d, nm, DR_PASS, "0 uncorrected errors",
                                   "ECC %s", dv.ecc_enabled ? "on, counters not readable" : "off");
                    else
                        doctor_add(d, nm, unc ? DR_FAIL : cor ? DR_WARN : DR_PASS,
                                   "0 uncorrected errors",
                                   "%llu uncorrected, %llu corrected since the driver loaded%s",
                                   unc, e0 == 0 ? cor : 0ULL,
                                   unc ? ": this GPU's memory is failing; ask for another machine"
                                       : "");
                    unsigned sm = 0, smmax = 0, mem = 0;
                    /* NVML_CLOCK_SM 1, NVML_CLOCK_MEM 2 */
                    nv.clock(nd, 1, &sm);
                    nv.max_clock(nd, 1, &smmax);
                    nv.clock(nd, 2, &mem);
                    snprintf(nm, sizeof nm, "gpu%d.clocks", i);
                    doctor_add(d, nm, DR_PASS, "SM clock up to its maximum under load",
                               "SM %u MHz (max %u), memory %u MHz, idle", sm, smmax, mem);
                }
                /* a bf16 GEMM: 8192^3, 50 times (about 0.1 s on an H100), its
                 * every result checked; smaller ones (--gemm-n) are not
                 * compared with the peak, which they do not reach */
                double tf = 0;
                snprintf(nm, sizeof nm, "gpu%d.gemm_bf16", i);
                if (gemm(i, n, 50, &tf, why, sizeof why) != 0) {
                    doctor_add(d, nm, DR_FAIL, "right results", "%s", why);
                } else if (c < 0 || n < 4096) {
                    doctor_add(d, nm, DR_PASS,
                               c < 0 ? "the card's dense bf16 peak (not in the table)"
                                     : "right results (--gemm-n below 4096: not compared with "
                                       "the peak)",
                               "%.1f TFLOP/s (%d^3, fp32 accumulation), results right", tf, n);
                } else {
                    char ex[120];
                    snprintf(ex, sizeof ex, ">= 70%% of %s's %.0f TFLOP/s dense bf16 peak",
                             cards[c].name, cards[c].tflops);
                    doctor_add(d, nm, tf >= 0.7 * cards[c].tflops ? DR_PASS : DR_WARN, ex,
                               "%.0f TFLOP/s, %.0f%% of peak (%d^3, fp32 accumulation), results "
                               "right",
                               tf, 100 * tf / cards[c].tflops, n);
                }
                double gb = 0;
                snprintf(nm, sizeof nm, "gpu%d.memcopy", i);
                if (copy(i, (size_t)sz->mib << 20, 10, &gb, why, sizeof why) != 0) {
                    doctor_add(d, nm, DR_FAIL, "", "%s", why);
                } else if (c < 0 || sz->mib < 256) {
                    doctor_add(d, nm, DR_PASS,
                               c < 0 ? "the card's memory bandwidth (not in the table)"
                                     : "(--gpu-mib below 256: not compared with the card's)",
                               "%.0f GB/s (%d MiB device to device, read + write)", gb, sz->mib);
                } else {
                    char ex[120];
                    snprintf(ex, sizeof ex, ">= 60%% of %s's %.0f GB/s", cards[c].name,
                             cards[c].gbps);
                    doctor_add(d, nm, gb >= 0.6 * cards[c].gbps ? DR_PASS : DR_WARN, ex,
                               "%.0f GB/s, %.0f%% (%d MiB device to device, read + write)", gb,
                               100 * gb / cards[c].gbps, sz->mib);
                }
            }
            if (have_nvml)
                dlclose(nv.h);
            if (g->count < 2)
                doctor_add(d, "gpu.p2p", DR_SKIPPED, "", "one GPU: no pairs");
            for (int a = 0; a < g->count; a++)
                for (int b = 0; b < g->count; b++) {
                    if (a == b)
                        continue;
                    int can = 0;
                    double gb = 0;
                    char nm[48];
                    snprintf(nm, sizeof nm, "gpu.p2p.%d-%d", a, b);
                    if (p2p(a, b, (size_t)pair_mib << 20, &can, &gb, why, sizeof why) != 0)
                        doctor_add(d, nm, DR_FAIL, "", "%s", why);
                    else
                        doctor_add(d, nm, can ? DR_PASS : DR_WARN,
                                   "peer access (NVLink or PCIe P2P)",
                                   "%s, %.1f GB/s (%d MiB copies)%s",
                                   can ? "peer access" : "no peer access", gb, pair_mib,
                                   can ? "" : ": NCCL goes through host memory between these");
                }
        }
    }
    check_nccl(d, g, pair_mib, comm);
}
