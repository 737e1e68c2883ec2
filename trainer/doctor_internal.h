/* trainer/doctor_internal.h — shared by doctor.c (the command, the report
 * and the config checks), doctor_host.c (host and disk), doctor_remote.c (the
 * object store and preemption notices) and doctor_gpu.c (the GPU checks). */
#ifndef SPOTUNE_DOCTOR_INTERNAL_H
#define SPOTUNE_DOCTOR_INTERNAL_H

#include <stddef.h>

#include "../base/base.h"
#include "../checkpoint/store.h"
#include "../comm/comm.h"

enum { DR_PASS = 0, DR_WARN, DR_FAIL, DR_SKIPPED };
extern const char *const doctor_status_names[]; /* "PASS", "WARN", "FAIL", "SKIPPED" */

typedef struct dr_check {
    char name[64];
    int status;
    char measured[1024];
    char expected[200];
    char host[64];
} dr_check;

typedef struct doctor {
    dr_check *v;
    size_t n, cap;
    char host[64]; /* given to each check added */
} doctor_t;

/* Appends one check: its name ("host.cpu"), status, the expected figure and
 * the measured one (printf). */
void doctor_add(doctor_t *d, const char *name, int status, const char *expected,
                const char *fmt, ...) SP_PRINTF(5, 6);

static inline double dr_gib(double b)
{
    return b / (1024.0 * 1024.0 * 1024.0);
}

static inline double dr_mib(double b)
{
    return b / (1024.0 * 1024.0);
}

/* A /proc/meminfo figure in KiB ("MemAvailable"), or -1 */
long long dr_meminfo_kib(const char *key);
/* host.* lines: cores, memory, open files, /dev/shm, NCCL's interfaces */
void dr_check_host(doctor_t *d);
/* host.mpi: the MPI and NCCL versions, the ranks and their hosts */
void dr_check_mpi(doctor_t *d, comm_t *comm, const char *hosts);
/* storage.* lines for run_dir (NULL: the current directory): free space,
 * write + fsync throughput of io_mib MiB */
void dr_check_storage(doctor_t *d, const char *run_dir, int io_mib);
/* store.* lines for url with options so: credentials, probe object, upload
 * speed (io_mib), clock skew; each request bounded by deadline_s */
void dr_check_store(doctor_t *d, const char *url, const store_opts *so, int io_mib,
                    double deadline_s);
/* preempt.* lines: which cloud's metadata service answers, a pending notice */
void dr_check_preemption(doctor_t *d, const char *cloud_opt, const char *meta_url);

/* The GPUs this process sees: count 0 with why when none is usable. */
typedef struct dr_gpus {
    int count;
    char why[600];
    size_t min_free;  /* the smallest free memory of a GPU, bytes */
    size_t min_total; /* the smallest memory of a GPU, bytes */
    char name[128];   /* the first GPU's name */
    int local_ranks;  /* ranks on this host (they share its memory on the CPU backend) */
} dr_gpus;

/* The count (no CUDA context); with detail also the memory and the name,
 * which create a context on each device (the first rank of a host only). */
void doctor_gpu_probe(dr_gpus *g, int detail);
/* The sizes of the GPU measurements (spotune doctor --gemm-n, --gpu-mib). */
typedef struct dr_gpu_sizes {
    int gemm_n; /* the bf16 GEMM is gemm_n^3 */
    int mib;    /* the memory copy's MiB; P2P and NCCL up to min(mib, 256) */
} dr_gpu_sizes;
enum { DR_GEMM_N = 8192, DR_GPU_MIB = 1024 };

/* The gpu.* lines (SKIPPED with g->why when there is no GPU). */
void doctor_gpu_checks(doctor_t *d, const dr_gpus *g, const dr_gpu_sizes *sz, comm_t *comm);

#endif
