/* spotune doctor: the host checks (cores, memory, open files, /dev/shm, MPI,
 * the interfaces NCCL would pick) and the run directory's disk. */
#define _GNU_SOURCE

#include <curl/curl.h>
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <ifaddrs.h>
#include <jansson.h>
#include <net/if.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>

#include "../checkpoint/store.h"
#include "../comm/comm.h"
#include "../kernels/backend.h"
#include "config.h"
#include "data.h"
#include "doctor_internal.h"
#include "model.h"
#include "model_config.h"
#include "model_io.h"
#include "plan.h"

/* ---- host ------------------------------------------------------------------------ */

long long dr_meminfo_kib(const char *key)
{
    FILE *f = fopen("/proc/meminfo", "r");
    char line[256];
    long long kb = -1;
    size_t kl = strlen(key);
    while (f && fgets(line, sizeof line, f))
        if (!strncmp(line, key, kl) && line[kl] == ':') {
            kb = strtoll(line + kl + 1, NULL, 10);
            break;
        }
    if (f)
        fclose(f);
    return kb;
}

/* NCCL_SOCKET_IFNAME: comma-separated prefixes; a leading '^' excludes them,
 * a leading '=' makes them exact names. */
static int ifname_matches(const char *spec, const char *name)
{
    int exclude = 0, exact = 0;
    if (*spec == '^') {
        exclude = 1;
        spec++;
    }
    if (*spec == '=') {
        exact = 1;
        spec++;
    }
    int hit = 0;
    char *copy = strdup(spec);
    for (char *save = NULL, *tok = copy ? strtok_r(copy, ",", &save) : NULL; tok;
         tok = strtok_r(NULL, ",", &save))
        if (exact ? !strcmp(name, tok) : !strncmp(name, tok, strlen(tok)))
            hit = 1;
    free(copy);
    return exclude ? !hit : hit;
}

static void check_network(doctor_t *d)
{
    struct ifaddrs *ifs = NULL;
    if (getifaddrs(&ifs) != 0) {
        doctor_add(d, "host.network", DR_WARN, "up interfaces NCCL can use",
                   "getifaddrs failed: %s", strerror(errno));
        return;
    }
    const char *spec = getenv("NCCL_SOCKET_IFNAME");
    char list[600] = "";
    size_t len = 0;
    int n = 0;
    for (struct ifaddrs *a = ifs; a; a = a->ifa_next) {
        if (!a->ifa_addr || !(a->ifa_flags & IFF_UP) ||
            (a->ifa_addr->sa_family != AF_INET && a->ifa_addr->sa_family != AF_INET6))
            continue;
        if (spec && *spec) {
            if (!ifname_matches(spec, a->ifa_name))
                continue;
        } else if ((a->ifa_flags & IFF_LOOPBACK) || !strncmp(a->ifa_name, "docker", 6)) {
            continue; /* NCCL's own default leaves these out */
        }
        /* each name once (an interface has an address per family) */
        int seen = 0;
        for (struct ifaddrs *b = ifs; b != a; b = b->ifa_next)
            if (b->ifa_addr && !strcmp(b->ifa_name, a->ifa_name) && (b->ifa_flags & IFF_UP) &&
                (b->ifa_addr->sa_family == AF_INET || b->ifa_addr->sa_family == AF_INET6))
                seen = 1;
        if (seen)
            continue;
        if (len < sizeof list - 1) {
            int w = snprintf(list + len, sizeof list - len, "%s%s", n ? ", " : "", a->ifa_name);
            len += w > 0 ? (size_t)w : 0;
        }
        n++;
    }
    freeifaddrs(ifs);
    if (len >= sizeof list)
        len = sizeof list - 1;
    if (spec && *spec) {
        if (n == 0)
            doctor_add(d, "host.network", DR_FAIL, "NCCL_SOCKET_IFNAME matches an up interface",
                       "NCCL_SOCKET_IFNAME=%s matches no up interface: NCCL would fail to "
                       "bootstrap",
                       spec);
        else
            doctor_add(d, "host.network", DR_PASS, "NCCL_SOCKET_IFNAME matches an up interface",
                       "NCCL_SOCKET_IFNAME=%s: %s", spec, list);
    } else if (n == 0) {
        doctor_add(d, "host.network", DR_WARN, "a non-loopback up interface",
                   "only loopback is up: NCCL and MPI cannot reach another node");
    } else {
        doctor_add(d, "host.network", DR_PASS, "a non-loopback up interface",
                   "NCCL would pick from: %s (NCCL_SOCKET_IFNAME unset)", list);
    }
}

void dr_check_mpi(doctor_t *d, comm_t *comm, const char *hosts)
{
    char ver[1024], mpi[200], nccl[700];
    comm_mpi_version(mpi, sizeof mpi);
    comm_nccl_version(nccl, sizeof nccl);
    snprintf(ver, sizeof ver, "%s, %s", mpi, nccl);
    const char *path = getenv("PATH");
    int launcher = 0;
    char *copy = path ? strdup(path) : NULL, *save = NULL;
    for (char *p = copy ? strtok_r(copy, ":", &save) : NULL; p && !launcher;
         p = strtok_r(NULL, ":", &save)) {
        char *f = sp_strf("%s/mpirun", p);
        launcher = f && access(f, X_OK) == 0;
        free(f);
    }
    free(copy);
    int size = comm_size(comm);
    if (!strncmp(nccl, "not loadable", 12)) /* a CUDA build: GPUs cannot share gradients */
        doctor_add(d, "host.mpi", DR_WARN, "mpirun on PATH; NCCL loadable",
                   "%s: ranks on GPUs cannot share gradients (one GPU trains without it); "
                   "install NCCL, put its folder on LD_LIBRARY_PATH or name it in "
                   "SPOTUNE_NCCL_LIBRARY",
                   ver);
    else if (!launcher && size == 1)
        doctor_add(d, "host.mpi", DR_WARN, "mpirun on PATH",
                   "%s; mpirun not found on PATH: several ranks cannot be launched", ver);
    else if (size > 1)
        doctor_add(d, "host.mpi", DR_PASS, "mpirun on PATH", "%s; %d ranks on %s", ver, size,
                   hosts);
    else
        doctor_add(d, "host.mpi", DR_PASS, "mpirun on PATH", "%s; 1 rank (not under mpirun)",
                   ver);
}

void dr_check_host(doctor_t *d)
{
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    doctor_add(d, "host.cpu", cores >= 4 ? DR_PASS : DR_WARN,
               ">= 4 cores (data, the checkpoint writer and uploads beside the ranks)",
               "%ld online cores", cores);

    /* OpenBLAS falls back to generic kernels on a CPU model it does not know:
     * the CPU backend's products then run several times slower */
    const char *core = backend_cpu_blas_core(), *better = backend_cpu_blas_better();
    const char *set = getenv("OPENBLAS_CORETYPE"), *kind = backend_cpu_blas_kind();
    int avx2 = kind && strcmp(kind, "AVX2") == 0, isa;
    sp_err serr = {0};
    if (backend_cpu_skinny_choice(&isa, &serr) != 0)
        doctor_add(d, "host.blas", DR_FAIL, "OpenBLAS uses kernels for this CPU's vector units",
                   "%s: the CPU backend refuses to start", serr.msg);
    else if (better)
        doctor_add(d, "host.blas", DR_WARN, "OpenBLAS uses kernels for this CPU's vector units",
                   "OpenBLAS %s its %s %s kernels on a CPU with %s%s%s%s: the CPU "
                   "backend's matrix products run %s; run with OPENBLAS_CORETYPE=%s%s",
                   set ? "runs" : "chose", avx2 ? "AVX2" : "generic", core ? core : "(unknown)",
                   strcmp(better, "SkylakeX") == 0 ? "AVX-512" : "AVX2 and FMA",
                   set ? " (OPENBLAS_CORETYPE=" : "", set ? set : "", set ? " is set)" : "",
                   avx2 ? "about half as fast" : "several times slower", better,
                   set ? ", or unset it and spotune chooses" : "");
    else {
        char what[256];
        backend_cpu_blas_describe(what, sizeof what);
        doctor_add(d, "host.blas", DR_PASS, "OpenBLAS uses kernels for this CPU's vector units",
                   "%s", what);
    }

    long long tot = dr_meminfo_kib("MemTotal"), avail = dr_meminfo_kib("MemAvailable");
    if (tot < 0 || avail < 0)
        doctor_add(d, "host.memory", DR_WARN, "MemAvailable >= 8 GiB",
                   "/proc/meminfo has no MemTotal/MemAvailable");
    else
        doctor_add(d, "host.memory", avail >= 8LL << 20 ? DR_PASS : DR_WARN,
                   "MemAvailable >= 8 GiB (checkpoints are staged in host memory)",
                   "%.1f GiB total, %.1f GiB available", (double)tot / (1 << 20),
                   (double)avail / (1 << 20));

    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0)
        doctor_add(d, "host.open_files", DR_WARN, ">= 4096", "getrlimit: %s", strerror(errno));
    else if (rl.rlim_cur != RLIM_INFINITY && rl.rlim_cur < 4096)
        doctor_add(d, "host.open_files", DR_WARN, ">= 4096",
                   "soft limit %llu (hard %llu): NCCL, HDF5 and parallel uploads open many "
                   "files and sockets; raise it with ulimit -n 65536",
                   (unsigned long long)rl.rlim_cur, (unsigned long long)rl.rlim_max);
    else
        doctor_add(d, "host.open_files", DR_PASS, ">= 4096", "soft limit %llu",
                   (unsigned long long)rl.rlim_cur);

    struct statvfs sv;
    if (statvfs("/dev/shm", &sv) != 0) {
        doctor_add(d, "host.shm", DR_WARN, ">= 1 GiB",
                   "/dev/shm: %s: NCCL's shared-memory transport needs it", strerror(errno));
    } else {
        double size = (double)sv.f_blocks * sv.f_frsize, fr = (double)sv.f_bavail * sv.f_frsize;
        doctor_add(d, "host.shm", size >= (1 << 30) ? DR_PASS : DR_WARN,
                   ">= 1 GiB (NCCL's shared-memory transport)",
                   "/dev/shm %.2f GiB, %.2f GiB free%s", dr_gib(size), dr_gib(fr),
                   size >= (1 << 30) ? ""
                                     : ": too small for NCCL between local GPUs (containers: "
                                       "--shm-size=8g or --ipc=host)");
    }
    check_network(d);
}

/* ---- storage --------------------------------------------------------------------- */

/* The nearest existing directory at or above path (malloc'ed). */
static char *existing_dir(const char *path)
{
    char *p = strdup(path);
    while (p && access(p, F_OK) != 0) {
        char *slash = strrchr(p, '/');
        if (!slash) {
            free(p);
            return strdup(".");
        }
        if (slash == p) {
            p[1] = 0;
            break;
        }
        *slash = 0;
    }
    return p;
}

void dr_check_storage(doctor_t *d, const char *run_dir, int io_mib)
{
    const char *what = run_dir ? "run.dir" : "the current directory";
    const char *target = run_dir ? run_dir : ".";
    char *dir = existing_dir(target);
    if (!dir) {
        doctor_add(d, "storage.free", DR_FAIL, "", "out of memory");
        return;
    }
    char *abs = realpath(dir, NULL); /* "." is named by its path */
    if (abs) {
        free(dir);
        dir = abs;
    }
    char note[300] = "";
    if (run_dir && access(target, F_OK) != 0)
        sp_cutf(note, sizeof note, " (%s does not exist yet: checked %s, where it would be made)",
                target, dir);
    struct statvfs sv;
    if (statvfs(dir, &sv) != 0) {
        doctor_add(d, "storage.free", DR_FAIL, ">= 20 GiB free", "%s %s: %s%s", what, dir,
                   strerror(errno), note);
        free(dir);
        return;
    }
    double fr = (double)sv.f_bavail * sv.f_frsize;
    doctor_add(d, "storage.free", fr >= 20.0 * (1 << 30) ? DR_PASS
                                  : fr >= 1.0 * (1 << 30) ? DR_WARN
                                                          : DR_FAIL,
               ">= 20 GiB free (checkpoints; FAIL under 1 GiB)",
               "%s %s: %.1f GiB free of %.1f GiB%s",
               what, dir, dr_gib(fr), dr_gib((double)sv.f_blocks * sv.f_frsize), note);
    if (sv.f_flag & ST_RDONLY) {
        doctor_add(d, "storage.write", DR_FAIL, "writable, >= 100 MB/s",
                   "%s %s is on a read-only file system: checkpoints cannot be written", what,
                   dir);
        free(dir);
        return;
    }
    char *file = sp_strf("%s/.spotune-doctor-%ld", dir, (long)getpid());
    int fd = file ? open(file, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600) : -1;
    if (fd < 0) {
        doctor_add(d, "storage.write", DR_FAIL, "writable, >= 100 MB/s",
                   "%s %s is not writable: cannot create %s: %s", what, dir,
                   file ? file : "a file", strerror(errno));
        free(file);
        free(dir);
        return;
    }
    size_t chunk = 4u << 20;
    char *buf = malloc(chunk);
    int ok = buf != NULL, saved = 0;
    if (buf)
        for (size_t i = 0; i < chunk; i++)
            buf[i] = (char)(sp_rng_u64(7, i) >> 56); /* incompressible */
    double t0 = sp_now();
    size_t total = (size_t)io_mib << 20;
    for (size_t done = 0; ok && done < total;) {
        size_t n = total - done < chunk ? total - done : chunk;
        ssize_t w = write(fd, buf, n);
        if (w <= 0) {
            saved = errno;
            ok = 0;
            break;
        }
        done += (size_t)w;
    }
    if (ok && fsync(fd) != 0) {
        saved = errno;
        ok = 0;
    }
    double dt = sp_now() - t0;
    if (close(fd) != 0 && ok) {
        saved = errno;
        ok = 0;
    }
    unlink(file);
    free(buf);
    if (!ok) {
        doctor_add(d, "storage.write", DR_FAIL, "writable, >= 100 MB/s",
                   "%s %s: writing %d MiB to %s failed: %s", what, dir, io_mib, file,
                   saved ? strerror(saved) : "out of memory");
    } else {
        double mbs = (double)total / 1e6 / (dt > 1e-9 ? dt : 1e-9);
        doctor_add(d, "storage.write", mbs >= 100 ? DR_PASS : DR_WARN, ">= 100 MB/s",
                   "%s %s: %.0f MB/s (%d MiB written and fsync'ed in %.2f s)", what, dir, mbs,
                   io_mib, dt);
    }
    free(file);
    free(dir);
}

