/* spotune doctor: checks of this machine before a run (doctor.h). */
#define _GNU_SOURCE
#include "doctor.h"

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

const char *const doctor_status_names[] = {"PASS", "WARN", "FAIL", "SKIPPED"};

void doctor_add(doctor_t *d, const char *name, int status, const char *expected,
                const char *fmt, ...)
{
    if (d->n == d->cap) {
        size_t cap = d->cap ? 2 * d->cap : 32;
        dr_check *v = realloc(d->v, cap * sizeof *v);
        if (!v)
            return; /* out of memory: the line is lost, the rest goes on */
        d->v = v;
        d->cap = cap;
    }
    dr_check *c = &d->v[d->n++];
    memset(c, 0, sizeof *c);
    sp_cutf(c->name, sizeof c->name, "%s", name);
    c->status = status;
    sp_cutf(c->expected, sizeof c->expected, "%s", expected ? expected : "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->measured, sizeof c->measured, fmt, ap);
    va_end(ap);
    sp_cutf(c->host, sizeof c->host, "%s", d->host);
}

static double gib(double b)
{
    return b / (1024.0 * 1024.0 * 1024.0);
}

static double mib(double b)
{
    return b / (1024.0 * 1024.0);
}

/* ---- host ------------------------------------------------------------------------ */

static long long meminfo_kib(const char *key)
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

static void check_mpi(doctor_t *d, comm_t *comm, const char *hosts)
{
    char ver[320], mpi[200], nccl[100];
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
    if (!launcher && size == 1)
        doctor_add(d, "host.mpi", DR_WARN, "mpirun on PATH",
                   "%s; mpirun not found on PATH: several ranks cannot be launched", ver);
    else if (size > 1)
        doctor_add(d, "host.mpi", DR_PASS, "mpirun on PATH", "%s; %d ranks on %s", ver, size,
                   hosts);
    else
        doctor_add(d, "host.mpi", DR_PASS, "mpirun on PATH", "%s; 1 rank (not under mpirun)",
                   ver);
}

static void check_host(doctor_t *d)
{
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    doctor_add(d, "host.cpu", cores >= 4 ? DR_PASS : DR_WARN,
               ">= 4 cores (data, the checkpoint writer and uploads beside the ranks)",
               "%ld online cores", cores);

    long long tot = meminfo_kib("MemTotal"), avail = meminfo_kib("MemAvailable");
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
                   "/dev/shm %.2f GiB, %.2f GiB free%s", gib(size), gib(fr),
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

static void check_storage(doctor_t *d, const char *run_dir, int io_mib)
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
               what, dir, gib(fr), gib((double)sv.f_blocks * sv.f_frsize), note);
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

/* ---- object store ---------------------------------------------------------------- */

static size_t on_header(char *b, size_t size, size_t n, void *arg)
{
    size_t len = size * n;
    char *date = arg;
    if (len > 5 && !strncasecmp(b, "Date:", 5)) {
        size_t k = len - 5 < 127 ? len - 5 : 127;
        memcpy(date, b + 5, k);
        date[k] = 0;
        date[strcspn(date, "\r\n")] = 0;
    }
    return len;
}

static size_t discard(char *b, size_t size, size_t n, void *arg)
{
    (void)b;   /* the body is not wanted, */
    (void)arg; /* only its headers */
    return size * n;
}

/* The endpoint's base URL, as store_open would resolve it. */
static char *store_endpoint(const store_opts *o)
{
    if (o->endpoint && *o->endpoint)
        return strdup(o->endpoint);
    const char *e = getenv("AWS_ENDPOINT_URL_S3");
    if (!e || !*e)
        e = getenv("AWS_ENDPOINT_URL");
    if (e && *e)
        return strdup(e);
    const char *r = o->region && *o->region ? o->region : getenv("AWS_REGION");
    if (!r || !*r)
        r = getenv("AWS_DEFAULT_REGION");
    return sp_strf("https://s3.%s.amazonaws.com", r && *r ? r : "us-east-1");
}

static void check_clock(doctor_t *d, const store_opts *o, double timeout_s)
{
    char *url = store_endpoint(o);
    char date[128] = "";
    CURL *h = curl_easy_init();
    CURLcode rc = CURLE_FAILED_INIT;
    if (h && url) {
        curl_easy_setopt(h, CURLOPT_URL, url);
        curl_easy_setopt(h, CURLOPT_NOBODY, 1L);
        curl_easy_setopt(h, CURLOPT_HEADERFUNCTION, on_header);
        curl_easy_setopt(h, CURLOPT_HEADERDATA, date);
        curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, discard);
        curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
        curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS, (long)(timeout_s * 1000));
        curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, (long)(timeout_s * 1000));
        const char *ca = getenv("AWS_CA_BUNDLE");
        if (ca && *ca)
            curl_easy_setopt(h, CURLOPT_CAINFO, ca);
        rc = curl_easy_perform(h);
    }
    double now = sp_wall_time();
    if (h)
        curl_easy_cleanup(h);
    const char *expect = "|skew| <= 60 s (SigV4 fails beyond 15 min)";
    if (rc != CURLE_OK) {
        doctor_add(d, "store.clock_skew", DR_FAIL, expect, "%s did not answer: %s", url ? url : "",
                   curl_easy_strerror(rc));
    } else if (!date[0]) {
        doctor_add(d, "store.clock_skew", DR_WARN, expect, "%s sent no Date header", url);
    } else {
        time_t t = curl_getdate(date, NULL);
        if (t < 0) {
            doctor_add(d, "store.clock_skew", DR_WARN, expect, "%s: unreadable Date header '%s'",
                       url, date);
        } else {
            /* Date has whole seconds: up to 1 s of the gap is its rounding */
            double skew = now - (double)t;
            double a = skew < 0 ? -skew : skew;
            doctor_add(d, "store.clock_skew",
                       a > 900  ? DR_FAIL
                       : a > 60 ? DR_WARN
                                : DR_PASS,
                       expect, "this clock is %.0f s %s the store's (Date:%s)%s", a,
                       skew >= 0 ? "ahead of" : "behind", date,
                       a > 900 ? ": requests will be refused (RequestTimeTooSkewed); fix the "
                                 "clock (chrony, ntpdate)"
                               : "");
        }
    }
    free(url);
}

static const char *cause(int rc)
{
    switch (rc) {
    case STORE_EAUTH:
        return " [cause: the store refused the credentials or their rights (401/403)]";
    case STORE_ENOBUCKET: return " [cause: no such bucket]";
    case STORE_EFAIL: return " [cause: the store did not answer or failed]";
    default: return "";
    }
}

static void check_store(doctor_t *d, const char *url, const store_opts *so, int io_mib,
                        double deadline_s)
{
    int s3 = sp_after(url, "s3://") != NULL;
    if (s3) {
        const char *id = getenv("AWS_ACCESS_KEY_ID"), *sec = getenv("AWS_SECRET_ACCESS_KEY");
        const char *tok = getenv("AWS_SESSION_TOKEN");
        if (!id || !*id || !sec || !*sec) {
            doctor_add(d, "store.credentials", DR_FAIL,
                       "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in the environment",
                       "%s is not set (spotune reads credentials from the environment only)",
                       !id || !*id ? "AWS_ACCESS_KEY_ID" : "AWS_SECRET_ACCESS_KEY");
            doctor_add(d, "store.roundtrip", DR_SKIPPED, "", "no credentials");
            doctor_add(d, "store.upload", DR_SKIPPED, "", "no credentials");
            check_clock(d, so, 5);
            return;
        }
        doctor_add(d, "store.credentials", DR_PASS,
                   "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in the environment",
                   "found in the environment: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY%s (values "
                   "not shown)",
                   tok && *tok ? ", AWS_SESSION_TOKEN" : "");
    } else {
        doctor_add(d, "store.credentials", DR_SKIPPED, "", "%s needs none", url);
    }

    sp_err err = {0};
    store_t *st = NULL;
    const char *expect = "put, get, compare, list, delete";
    if (store_open(&st, url, so, &err)) {
        doctor_add(d, "store.roundtrip", DR_FAIL, expect, "%s", err.msg);
        doctor_add(d, "store.upload", DR_SKIPPED, "", "the store could not be opened");
        if (s3)
            check_clock(d, so, 5);
        else
            doctor_add(d, "store.clock_skew", DR_SKIPPED, "", "file:// has no clock");
        return;
    }
    char host[64];
    if (gethostname(host, sizeof host) != 0)
        strcpy(host, "host");
    host[sizeof host - 1] = 0;
    uint64_t tag = sp_rng_u64((uint64_t)getpid(), (uint64_t)(sp_wall_time() * 1e6));
    char *key = sp_strf(".spotune-doctor-%s-%ld-%08llx", host, (long)getpid(),
                        (unsigned long long)(tag & 0xffffffffu));
    char probe[4096];
    for (size_t i = 0; i < sizeof probe; i++)
        probe[i] = (char)(sp_rng_u64(tag, i) >> 56);
    double t0 = sp_now();
    void *back = NULL;
    size_t nback = 0;
    store_listing ls = {0};
    int rc, found = 0, exists = 1;
    const char *step = "PUT";
    if (!key) {
        rc = sp_fail(&err, SP_EXIT_OTHER, "out of memory");
    } else if ((rc = store_put_bytes(st, key, probe, sizeof probe, 0, &err)) == 0) {
        step = "GET";
        if ((rc = store_get_bytes(st, key, &back, &nback, &err)) == 0) {
            step = "LIST";
            if ((rc = store_list(st, ".spotune-doctor-", &ls, &err)) == 0) {
                for (size_t i = 0; i < ls.n; i++)
                    if (!strcmp(ls.items[i].key, key))
                        found = 1;
                step = "DELETE";
                if ((rc = store_delete(st, key, &err)) == 0)
                    rc = store_exists(st, key, &exists, NULL, &err);
            }
        }
    }
    double dt = sp_now() - t0;
    if (rc) {
        doctor_add(d, "store.roundtrip", DR_FAIL, expect,
                   "%s of a probe object failed after %.1f s: %s%s",
                   step, dt, err.msg, cause(rc));
        if (key && strcmp(step, "PUT") != 0) {
            sp_err e2 = {0};
            store_delete(st, key, &e2);
        }
    } else if (nback != sizeof probe || memcmp(back, probe, sizeof probe) != 0) {
        doctor_add(d, "store.roundtrip", DR_FAIL, expect,
                   "%s/%s read back differs from what was written (%zu bytes, %zu expected)",
                   url, key, nback, sizeof probe);
    } else if (!found) {
        doctor_add(d, "store.roundtrip", DR_FAIL, expect,
                   "%s/%s was written and read back but the listing does not show it", url, key);
    } else if (exists) {
        doctor_add(d, "store.roundtrip", DR_FAIL, expect, "%s/%s is still there after DELETE", url,
                   key);
    } else {
        doctor_add(d, "store.roundtrip", DR_PASS, expect,
                   "%s: 4 KiB probe put, read back equal, listed, deleted in %.2f s", url, dt);
    }
    free(back);
    store_list_free(&ls);

    if (rc) {
        doctor_add(d, "store.upload", DR_SKIPPED, "", "the probe object failed");
    } else {
        size_t n = (size_t)(io_mib < 32 ? io_mib : 32) << 20;
        char *big = malloc(n);
        char *bkey = key ? sp_strf("%s-upload", key) : NULL;
        if (!big || !bkey) {
            doctor_add(d, "store.upload", DR_FAIL, "", "out of memory");
        } else {
            for (size_t i = 0; i < n; i += 8) {
                uint64_t v = sp_rng_u64(tag + 1, i);
                memcpy(big + i, &v, n - i < 8 ? n - i : 8);
            }
            t0 = sp_now();
            int urc = store_put_bytes(st, bkey, big, n, 0, &err);
            dt = sp_now() - t0;
            sp_err e2 = {0};
            store_delete(st, bkey, &e2);
            if (urc)
                doctor_add(d, "store.upload", DR_FAIL, ">= 50 MB/s",
                           "uploading %zu MiB failed after %.1f s: %s%s", n >> 20, dt, err.msg,
                           cause(urc));
            else {
                double mbs = (double)n / 1e6 / (dt > 1e-9 ? dt : 1e-9);
                doctor_add(d, "store.upload", mbs >= 50 ? DR_PASS : DR_WARN,
                           ">= 50 MB/s (a 7B LoRA checkpoint in seconds; full fine-tuning: "
                           "tens of GB)",
                           "%.0f MB/s (%zu MiB in %.2f s, %s)", mbs, n >> 20, dt,
                           n > (so->part_bytes ? so->part_bytes : (size_t)16 << 20)
                               ? "multipart"
                               : "one PUT");
            }
        }
        free(big);
        free(bkey);
    }
    free(key);
    store_close(st);
    if (s3)
        check_clock(d, so, deadline_s < 5 ? deadline_s : 5);
    else
        doctor_add(d, "store.clock_skew", DR_SKIPPED, "", "file:// has no clock");
}

/* ---- preemption ------------------------------------------------------------------ */

typedef struct http_res {
    long code;
    char body[4096];
    size_t len;
    CURLcode rc;
} http_res;

static size_t on_body(char *b, size_t size, size_t n, void *arg)
{
    http_res *r = arg;
    size_t len = size * n, room = sizeof r->body - 1 - r->len;
    size_t k = len < room ? len : room;
    memcpy(r->body + r->len, b, k);
    r->len += k;
    r->body[r->len] = 0;
    return len;
}

/* One request of at most timeout_s; method NULL for GET. hdrs: NULL-ended. */
static void http(http_res *r, const char *method, const char *url, const char *const *hdrs,
                 double timeout_s)
{
    memset(r, 0, sizeof *r);
    CURL *h = curl_easy_init();
    if (!h) {
        r->rc = CURLE_FAILED_INIT;
        return;
    }
    struct curl_slist *hl = NULL;
    for (int i = 0; hdrs && hdrs[i]; i++)
        hl = curl_slist_append(hl, hdrs[i]);
    curl_easy_setopt(h, CURLOPT_URL, url);
    if (method)
        curl_easy_setopt(h, CURLOPT_CUSTOMREQUEST, method);
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, hl);
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, r);
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(h, CURLOPT_NOPROXY, "*"); /* link-local: never through a proxy */
    curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS, (long)(timeout_s * 1000));
    curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, (long)(timeout_s * 1000));
    r->rc = curl_easy_perform(h);
    curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &r->code);
    curl_slist_free_all(hl);
    curl_easy_cleanup(h);
}

static const char *meta_base(const char *cloud, const char *override)
{
    if (override && *override)
        return override;
    if (!strcmp(cloud, "gcp"))
        return "http://metadata.google.internal";
    if (!strcmp(cloud, "alibaba"))
        return "http://100.100.100.200";
    return "http://169.254.169.254";
}

/* Whether cloud's metadata service answers (as spot-run.sh's detect_cloud). */
static int meta_answers(const char *cloud, const char *base)
{
    http_res r;
    char *u = NULL;
    int ok = 0;
    if (!strcmp(cloud, "aws")) {
        const char *h[] = {"X-aws-ec2-metadata-token-ttl-seconds: 60", NULL};
        u = sp_strf("%s/latest/api/token", base);
        http(&r, "PUT", u, h, 1);
        ok = r.rc == CURLE_OK && r.code == 200;
    } else if (!strcmp(cloud, "gcp")) {
        const char *h[] = {"Metadata-Flavor: Google", NULL};
        u = sp_strf("%s/computeMetadata/v1/instance/id", base);
        http(&r, NULL, u, h, 1);
        ok = r.rc == CURLE_OK && r.code == 200;
    } else if (!strcmp(cloud, "azure")) {
        const char *h[] = {"Metadata: true", NULL};
        u = sp_strf("%s/metadata/instance?api-version=2021-02-01", base);
        http(&r, NULL, u, h, 1);
        ok = r.rc == CURLE_OK && strstr(r.body, "compute") != NULL;
    } else if (!strcmp(cloud, "alibaba")) {
        u = sp_strf("%s/latest/meta-data/instance-id", base);
        http(&r, NULL, u, NULL, 1);
        ok = r.rc == CURLE_OK && r.code == 200;
    }
    free(u);
    return ok;
}

/* 1: a notice is pending, 0: none, -1: the service did not answer (why). */
static int meta_notice(const char *cloud, const char *base, char *why, size_t n)
{
    http_res r;
    char *u = NULL;
    int notice = -1;
    if (!strcmp(cloud, "aws")) {
        const char *h[] = {"X-aws-ec2-metadata-token-ttl-seconds: 300", NULL};
        u = sp_strf("%s/latest/api/token", base);
        http(&r, "PUT", u, h, 2);
        if (r.rc == CURLE_OK && r.code == 200) {
            char tok[600];
            sp_cutf(tok, sizeof tok, "X-aws-ec2-metadata-token: %s", r.body);
            const char *h2[] = {tok, NULL};
            free(u);
            u = sp_strf("%s/latest/meta-data/spot/instance-action", base);
            http(&r, NULL, u, h2, 2);
            if (r.rc == CURLE_OK)
                notice = r.code == 200;
        }
    } else if (!strcmp(cloud, "gcp")) {
        const char *h[] = {"Metadata-Flavor: Google", NULL};
        u = sp_strf("%s/computeMetadata/v1/instance/preempted", base);
        http(&r, NULL, u, h, 2);
        if (r.rc == CURLE_OK && r.code == 200)
            notice = !strncmp(r.body, "TRUE", 4);
    } else if (!strcmp(cloud, "azure")) {
        const char *h[] = {"Metadata: true", NULL};
        u = sp_strf("%s/metadata/scheduledevents?api-version=2020-07-01", base);
        http(&r, NULL, u, h, 2);
        if (r.rc == CURLE_OK && r.code == 200) {
            json_t *j = json_loadb(r.body, r.len, 0, NULL);
            json_t *ev = json_object_get(j, "Events");
            notice = 0;
            for (size_t i = 0; i < json_array_size(ev); i++) {
                json_t *e = json_array_get(ev, i);
                const char *t = json_string_value(json_object_get(e, "EventType"));
                if (t && !strcmp(t, "Preempt"))
                    notice = 1;
            }
            json_decref(j);
        }
    } else if (!strcmp(cloud, "alibaba")) {
        u = sp_strf("%s/latest/meta-data/instance/spot/termination-time", base);
        http(&r, NULL, u, NULL, 2);
        if (r.rc == CURLE_OK)
            notice = r.code == 200;
    }
    if (notice < 0)
        sp_cutf(why, n, "%s: %s", u ? u : base,
                r.rc != CURLE_OK ? curl_easy_strerror(r.rc) : "unexpected answer");
    else if (notice)
        sp_cutf(why, n, "%s", r.body);
    free(u);
    return notice;
}

static void check_preemption(doctor_t *d, const char *cloud_opt, const char *meta_url)
{
    static const char *const clouds[] = {"aws", "gcp", "azure", "alibaba"};
    const char *cloud = NULL;
    const char *expect = "a cloud's spot metadata service answers (spot-run.sh watches it)";
    if (!strcmp(cloud_opt, "none")) {
        doctor_add(d, "preemption.cloud", DR_SKIPPED, expect, "--cloud none");
        doctor_add(d, "preemption.notice", DR_SKIPPED, "no notice pending", "--cloud none");
        return;
    }
    if (!strcmp(cloud_opt, "auto")) {
        for (size_t i = 0; !cloud && i < sizeof clouds / sizeof clouds[0]; i++)
            if (meta_answers(clouds[i], meta_base(clouds[i], meta_url)))
                cloud = clouds[i];
        if (!cloud) {
            doctor_add(d, "preemption.cloud", DR_SKIPPED, expect,
                       "no cloud metadata service answered%s%s (not a cloud machine, or it is "
                       "blocked): spot-run.sh's notice watcher would be off",
                       meta_url ? " at " : "", meta_url ? meta_url : "");
            doctor_add(d, "preemption.notice", DR_SKIPPED, "no notice pending",
                       "no metadata service");
            return;
        }
        doctor_add(d, "preemption.cloud", DR_PASS, expect, "%s (%s)", cloud,
                   meta_base(cloud, meta_url));
    } else {
        cloud = cloud_opt;
        doctor_add(d, "preemption.cloud", DR_PASS, expect, "%s (--cloud, %s)", cloud,
                   meta_base(cloud, meta_url));
    }
    char why[600] = "";
    int n = meta_notice(cloud, meta_base(cloud, meta_url), why, sizeof why);
    if (n < 0)
        doctor_add(d, "preemption.notice", DR_WARN, "no notice pending",
                   "%s's notice endpoint did not answer: %s", cloud, why);
    else if (n)
        doctor_add(d, "preemption.notice", DR_FAIL, "no notice pending",
                   "a %s termination notice is pending (%.200s): this machine is going away", cloud,
                   why);
    else
        doctor_add(d, "preemption.notice", DR_PASS, "no notice pending", "none from %s", cloud);
}

/* ---- the run's inputs ------------------------------------------------------------ */

static void check_inputs(doctor_t *d, const config_t *c, int world, const dr_gpus *g)
{
    sp_err err = {0};
    model_config_t mc;
    memset(&mc, 0, sizeof mc);
    int have_model = 0;
    if (model_config_load(&mc, c->model_path, &err)) {
        doctor_add(d, "config.model", DR_FAIL, "a readable, supported model directory", "%s",
                   err.msg);
    } else {
        char id[17];
        if (model_io_identity(c->model_path, id, &err)) {
            doctor_add(d, "config.model", DR_FAIL, "a readable, supported model directory", "%s",
                       err.msg);
        } else {
            have_model = 1;
            doctor_add(d, "config.model", DR_PASS, "a readable, supported model directory",
                       "%s: %s, %lld layers, hidden %lld, %.1fM parameters (identity %s)",
                       c->model_path, mc.architecture, (long long)mc.layers,
                       (long long)mc.hidden, (double)model_config_params(&mc) / 1e6, id);
        }
    }
    const char *names[2] = {"config.data_train", "config.data_val"};
    const char *paths[2] = {c->data_train, c->data_val};
    for (int i = 0; i < 2; i++) {
        if (!paths[i] || !*paths[i]) {
            doctor_add(d, names[i], DR_SKIPPED, "", "not set");
            continue;
        }
        if (!have_model) {
            doctor_add(d, names[i], DR_SKIPPED, "a valid dataset",
                       "the model could not be read (its vocabulary bounds the tokens)");
            continue;
        }
        dataset_t ds;
        memset(&ds, 0, sizeof ds);
        sp_err_clear(&err);
        if (dataset_open(&ds, paths[i], c->seq_len, mc.vocab, (uint64_t)c->seed, &err))
            doctor_add(d, names[i], DR_FAIL, "a valid dataset", "%s", err.msg);
        else
            doctor_add(d, names[i], DR_PASS, "a valid dataset",
                       "%s: %llu tokens, %llu documents, %llu windows of %lld", paths[i],
                       (unsigned long long)ds.n_tokens, (unsigned long long)ds.n_docs,
                       (unsigned long long)ds.n_windows, (long long)c->seq_len);
        dataset_close(&ds);
    }

    const char *backend = config_backend_names[c->backend];
    int cpu = !strcmp(backend, "cpu") || !strcmp(backend, "cpu-ref") ||
              (!strcmp(backend, "auto") && g->count == 0);
    if (!have_model) {
        doctor_add(d, "config.memory_plan", DR_SKIPPED, "", "the model could not be read");
        return;
    }
    if (!cpu && g->count == 0) {
        doctor_add(d, "config.memory_plan", DR_SKIPPED, "fits the GPU's memory",
                   "runtime.backend %s, but no GPU: %s", backend, g->why);
        return;
    }
    /* the plan of spotune plan (trainer/plan.h) against what this machine has */
    plan_input in;
    plan_input_defaults(&in);
    plan_input_from_config(&in, c);
    in.mc = mc;
    sp_cutf(in.model_name, sizeof in.model_name, "%s", c->model_path);
    in.gpus_per_node = world;
    in.nodes = 1;
    int local = g->local_ranks > 0 ? g->local_ranks : 1;
    if (cpu) {
        in.cpu = 1;
        in.gpu_mem_bytes = (double)meminfo_kib("MemAvailable") * 1024.0 / local;
        in.gpu_tflops = 1;
        sp_cutf(in.gpu_label, sizeof in.gpu_label, "host memory");
    } else {
        const plan_gpu *pg = plan_gpu_for_device(g->name);
        in.gpu_mem_bytes = (double)g->min_total;
        in.gpu_tflops = pg ? pg->bf16_tflops : 100;
        sp_cutf(in.gpu_label, sizeof in.gpu_label, "%s", g->name);
    }
    plan_result *r = calloc(1, sizeof *r);
    sp_err_clear(&err);
    if (!r) {
        doctor_add(d, "config.memory_plan", DR_FAIL, "", "out of memory");
        return;
    }
    if (plan_compute(&in, r, &err)) {
        doctor_add(d, "config.memory_plan", DR_FAIL, "", "%s", err.msg);
        free(r);
        return;
    }
    const plan_mem *m = &r->mem;
    char fix[300] = "";
    if (!r->fits)
        sp_cutf(fix, sizeof fix, ": it does not fit; %s",
                r->nfixes ? r->fixes[0].what : "nothing this plan knows makes it fit");
    doctor_add(d, "config.memory_plan", r->fits ? DR_PASS : DR_FAIL,
               cpu ? "fits the host memory per rank (CPU backend)"
                   : "fits the smallest GPU (after the plan's headroom)",
               "%.1f MiB per %s (MiB: weights %.1f, trainable %.1f, gradients %.1f, optimizer "
               "%.1f, activations %.1f, workspace %.1f) of %.1f MiB usable on %s%s",
               mib(m->total), cpu ? "rank" : "GPU", mib(m->weights), mib(m->trainable),
               mib(m->gradients), mib(m->optimizer), mib(m->activations), mib(m->workspace),
               mib(r->usable_bytes), cpu ? "this host" : g->name, fix);
    free(r);
}

/* ---- output ---------------------------------------------------------------------- */

static json_t *checks_json(const dr_check *v, size_t n)
{
    json_t *a = json_array();
    for (size_t i = 0; i < n; i++)
        json_array_append_new(a, json_pack("{s:s, s:s, s:s, s:s, s:s}", "check", v[i].name,
                                           "status", doctor_status_names[v[i].status], "measured",
                                           v[i].measured, "expected", v[i].expected, "host",
                                           v[i].host));
    return a;
}

static int checks_from_json(doctor_t *d, const char *text)
{
    json_t *a = json_loads(text, 0, NULL);
    if (!json_is_array(a)) {
        json_decref(a);
        return -1;
    }
    for (size_t i = 0; i < json_array_size(a); i++) {
        json_t *o = json_array_get(a, i);
        const char *st = json_string_value(json_object_get(o, "status"));
        int s = DR_FAIL;
        for (int k = 0; k < 4; k++)
            if (st && !strcmp(st, doctor_status_names[k]))
                s = k;
        char saved[64];
        memcpy(saved, d->host, sizeof saved);
        const char *h = json_string_value(json_object_get(o, "host"));
        sp_cutf(d->host, sizeof d->host, "%s", h ? h : "?");
        const char *m = json_string_value(json_object_get(o, "measured"));
        doctor_add(d, json_string_value(json_object_get(o, "check")), s,
                   json_string_value(json_object_get(o, "expected")), "%s", m ? m : "");
        memcpy(d->host, saved, sizeof saved);
    }
    json_decref(a);
    return 0;
}

static void print_text(const doctor_t *d, int several_hosts)
{
    for (size_t i = 0; i < d->n; i++) {
        const dr_check *c = &d->v[i];
        if (several_hosts)
            printf("%-7s [%s] %-20s %s", doctor_status_names[c->status], c->host, c->name,
                   c->measured);
        else
            printf("%-7s %-20s %s", doctor_status_names[c->status], c->name, c->measured);
        if (c->expected[0])
            printf("  (expected: %s)", c->expected);
        putchar('\n');
    }
}

/* ---- the command ----------------------------------------------------------------- */

static void usage(FILE *f)
{
    fprintf(f,
            "usage: spotune doctor [CONFIG.yaml] [--json] [options]\n"
            "Checks this machine before a run, one line per check: PASS, WARN, FAIL or\n"
            "SKIPPED, the measured figure and the expected one. Exit 0, or 1 when a check\n"
            "FAILs (2: a usage or config error). Under mpirun, rank 0 prints every host's.\n"
            "  host       cores, memory, open-file limit, /dev/shm, MPI, NCCL's interfaces\n"
            "  storage    free space and write throughput of run.dir's file system (without\n"
            "             a config: the current directory)\n"
            "  store      with checkpoint.remote or --remote: credentials found (never shown),\n"
            "             a probe object put, read back, listed, deleted; upload throughput;\n"
            "             clock skew against the store's Date header\n"
            "  preemption which cloud's spot metadata service answers; a pending notice FAILs\n"
            "  config     the model, the dataset, the memory plan against the GPUs found\n"
            "  gpu        devices, bf16 GEMM and memory copy speed, P2P, NCCL all-reduce\n"
            "             (SKIPPED with the reason without a usable GPU)\n"
            "options:\n"
            "  --json              one JSON document, an object per check\n"
            "  --remote URL        the object store to check (s3://bucket/prefix or file://)\n"
            "                      instead of the config's checkpoint.remote\n"
            "  --endpoint URL --region R --path-style   for --remote s3:// (else the\n"
            "                      config's checkpoint.endpoint/region/addressing)\n"
            "  --timeout S         longest one store request may take, retries included (10)\n"
            "  --io-mib N          size of the disk write test (64; the upload test: up to 32)\n"
            "  --cloud NAME        auto (probe each, default), aws, gcp, azure, alibaba, none\n"
            "  --metadata-url URL  base URL of the metadata service (as spot-run.sh's)\n"
            "credentials: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY [, AWS_SESSION_TOKEN]\n");
}

typedef struct dr_args {
    const char *config, *remote, *endpoint, *region, *cloud, *meta_url;
    int json, path_style, io_mib;
    double timeout_s;
} dr_args;

static int parse(int argc, char **argv, dr_args *a)
{
    static const struct option lo[] = {
        {"json", 0, 0, 'j'},    {"remote", 1, 0, 'R'},       {"endpoint", 1, 0, 'e'},
        {"region", 1, 0, 'r'},  {"path-style", 0, 0, 'p'},   {"timeout", 1, 0, 't'},
        {"io-mib", 1, 0, 'i'},  {"cloud", 1, 0, 'c'},        {"metadata-url", 1, 0, 'm'},
        {"help", 0, 0, 'h'},    {0, 0, 0, 0}};
    memset(a, 0, sizeof *a);
    a->cloud = "auto";
    a->io_mib = 64;
    a->timeout_s = 10;
    int ch;
    char *end;
    optind = 1;
    opterr = 0;
    while ((ch = getopt_long(argc, argv, "h", lo, NULL)) != -1) {
        switch (ch) {
        case 'j': a->json = 1; break;
        case 'R': a->remote = optarg; break;
        case 'e': a->endpoint = optarg; break;
        case 'r': a->region = optarg; break;
        case 'p': a->path_style = 1; break;
        case 't':
            a->timeout_s = strtod(optarg, &end);
            if (*end || !(a->timeout_s > 0) || a->timeout_s > 3600) {
                fprintf(stderr, "spotune doctor: --timeout takes seconds in (0, 3600], got '%s'\n",
                        optarg);
                return SP_EXIT_USAGE;
            }
            break;
        case 'i': {
            long v = strtol(optarg, &end, 10);
            if (*end || v < 1 || v > 4096) {
                fprintf(stderr, "spotune doctor: --io-mib takes 1 to 4096, got '%s'\n", optarg);
                return SP_EXIT_USAGE;
            }
            a->io_mib = (int)v;
            break;
        }
        case 'c':
            if (strcmp(optarg, "auto") && strcmp(optarg, "aws") && strcmp(optarg, "gcp") &&
                strcmp(optarg, "azure") && strcmp(optarg, "alibaba") && strcmp(optarg, "none")) {
                fprintf(stderr,
                        "spotune doctor: --cloud takes auto, aws, gcp, azure, alibaba or none, "
                        "got '%s'\n",
                        optarg);
                return SP_EXIT_USAGE;
            }
            a->cloud = optarg;
            break;
        case 'm':
            if (!sp_after(optarg, "http://") && !sp_after(optarg, "https://")) {
                fprintf(stderr,
                        "spotune doctor: --metadata-url takes an http(s):// URL, got '%s'\n",
                        optarg);
                return SP_EXIT_USAGE;
            }
            a->meta_url = optarg;
            break;
        case 'h': usage(stdout); return -1;
        default:
            fprintf(stderr, "spotune doctor: unknown option '%s' (see spotune doctor --help)\n",
                    argv[optind - 1]);
            return SP_EXIT_USAGE;
        }
    }
    if (optind < argc)
        a->config = argv[optind++];
    if (optind < argc) {
        fprintf(stderr, "spotune doctor: one config at most, got also '%s'\n", argv[optind]);
        return SP_EXIT_USAGE;
    }
    if ((a->endpoint || a->region || a->path_style) && !a->remote && !a->config) {
        fprintf(stderr, "spotune doctor: --endpoint, --region and --path-style are for a store: "
                        "give --remote URL or a config with checkpoint.remote\n");
        return SP_EXIT_USAGE;
    }
    if (a->remote && !sp_after(a->remote, "s3://") && !sp_after(a->remote, "file://")) {
        fprintf(stderr,
                "spotune doctor: --remote takes s3://bucket[/prefix] or file:///path, got '%s'\n",
                a->remote);
        return SP_EXIT_USAGE;
    }
    return 0;
}

/* Every rank's checks to rank 0 (a fixed slot each), added to d there. */
#define SLOT_BYTES ((size_t)256 << 10)

static int gather_checks(comm_t *comm, doctor_t *d, sp_err *err)
{
    int size = comm_size(comm), rank = comm_rank(comm);
    char *mine = calloc(1, SLOT_BYTES);
    char *all = rank == 0 ? calloc((size_t)size, SLOT_BYTES) : NULL;
    if (!mine || (rank == 0 && !all)) {
        free(mine);
        free(all);
        return sp_fail(err, SP_EXIT_OTHER, "out of memory");
    }
    if (rank != 0) {
        json_t *a = checks_json(d->v, d->n);
        char *s = json_dumps(a, JSON_COMPACT);
        if (s && strlen(s) < SLOT_BYTES) {
            memcpy(mine, s, strlen(s) + 1);
        } else { /* too many lines: one line saying so instead */
            dr_check one;
            memset(&one, 0, sizeof one);
            snprintf(one.name, sizeof one.name, "host.report");
            one.status = DR_FAIL;
            snprintf(one.measured, sizeof one.measured,
                     "rank %d's %zu check lines (%zu bytes of JSON) exceed the %zu KiB each rank "
                     "may send to rank 0; run spotune doctor on this host alone",
                     rank, d->n, s ? strlen(s) : (size_t)0, SLOT_BYTES >> 10);
            memcpy(one.host, d->host, sizeof one.host);
            json_t *b = checks_json(&one, 1);
            char *t = json_dumps(b, JSON_COMPACT);
            snprintf(mine, SLOT_BYTES, "%s", t ? t : "[]");
            free(t);
            json_decref(b);
        }
        free(s);
        json_decref(a);
    }
    int rc = comm_gather(comm, mine, all, SLOT_BYTES, COMM_U8, 0, err);
    if (!rc && rank == 0)
        for (int r = 1; r < size; r++) {
            char *slot = all + (size_t)r * SLOT_BYTES;
            slot[SLOT_BYTES - 1] = 0;
            if (slot[0] && checks_from_json(d, slot) != 0)
                doctor_add(d, "mpi.gather", DR_FAIL, "", "rank %d sent unreadable results", r);
        }
    free(mine);
    free(all);
    return rc;
}

int cmd_doctor(int argc, char **argv)
{
    dr_args a;
    int prc = parse(argc, argv, &a);
    if (prc)
        return prc < 0 ? 0 : prc;

    config_t cfg;
    int have_cfg = 0;
    sp_err err = {0};
    if (a.config) {
        config_defaults(&cfg);
        if (config_load(&cfg, a.config, &err) || config_validate(&cfg, &err)) {
            fprintf(stderr, "spotune: error: %s\n", err.msg);
            config_free(&cfg);
            return err.code ? err.code : SP_EXIT_USAGE;
        }
        have_cfg = 1;
    }

    comm_t *comm = NULL;
    comm_opts co = {.timeout_s = 600};
    if (comm_init(&comm, &argc, &argv, &co, &err)) {
        fprintf(stderr, "spotune: error: %s\n", err.msg);
        if (have_cfg)
            config_free(&cfg);
        return err.code ? err.code : SP_EXIT_OTHER;
    }
    curl_global_init(CURL_GLOBAL_DEFAULT);
    int rank = comm_rank(comm), size = comm_size(comm);
    doctor_t d = {0};
    sp_cutf(d.host, sizeof d.host, "%s", comm_host(comm));

    /* the hosts of the job: every rank's name, to rank 0 */
    char hosts[400] = "1 host";
    int nhosts = 1;
    {
        char name[64];
        sp_cutf(name, sizeof name, "%s", comm_host(comm));
        char *all = calloc((size_t)size, sizeof name);
        if (all && comm_allgather(comm, name, all, sizeof name, COMM_U8, &err) == 0) {
            nhosts = 0;
            size_t len = 0;
            char list[300] = "";
            for (int r = 0; r < size; r++) {
                int dup = 0;
                for (int q = 0; q < r; q++)
                    if (!strcmp(all + (size_t)q * sizeof name, all + (size_t)r * sizeof name))
                        dup = 1;
                if (dup)
                    continue;
                nhosts++;
                if (len < sizeof list - 1) {
                    int w = snprintf(list + len, sizeof list - len, "%s%s", len ? ", " : "",
                                     all + (size_t)r * sizeof name);
                    len += w > 0 ? (size_t)w : 0;
                }
            }
            sp_cutf(hosts, sizeof hosts, "%d host%s (%s)", nhosts, nhosts > 1 ? "s" : "", list);
        }
        free(all);
    }

    /* host and storage: the first rank of each host; the rest: rank 0 */
    dr_gpus gpus;
    doctor_gpu_probe(&gpus, comm_local_rank(comm) == 0);
    gpus.local_ranks = comm_local_size(comm);
    if (comm_local_rank(comm) == 0) {
        check_host(&d);
        if (rank == 0)
            check_mpi(&d, comm, hosts);
        check_storage(&d, have_cfg ? cfg.run_dir : NULL, a.io_mib);
    }
    if (rank == 0) {
        const char *remote = a.remote ? a.remote : have_cfg ? cfg.ckpt_remote : NULL;
        if (remote && *remote) {
            store_opts so = {0};
            if (have_cfg && !a.remote) {
                so.endpoint = cfg.ckpt_endpoint && *cfg.ckpt_endpoint ? cfg.ckpt_endpoint : NULL;
                so.region = cfg.ckpt_region && *cfg.ckpt_region ? cfg.ckpt_region : NULL;
                so.addressing = cfg.ckpt_addressing == ADDR_PATH      ? STORE_ADDR_PATH
                                : cfg.ckpt_addressing == ADDR_VIRTUAL ? STORE_ADDR_VHOST
                                                                      : STORE_ADDR_AUTO;
                so.part_bytes = (size_t)cfg.ckpt_part_mb << 20;
            }
            if (a.endpoint)
                so.endpoint = a.endpoint;
            if (a.region)
                so.region = a.region;
            if (a.path_style)
                so.addressing = STORE_ADDR_PATH;
            so.max_retries = 1;
            so.timeout_s = a.timeout_s < 5 ? a.timeout_s : 5;
            so.request_deadline_s = a.timeout_s;
            check_store(&d, remote, &so, a.io_mib, a.timeout_s);
        } else {
            doctor_add(&d, "store", DR_SKIPPED, "",
                       "no object store: %s",
                       have_cfg ? "the config has no checkpoint.remote (checkpoints would stay "
                                  "on this machine's disk)"
                                : "give a config with checkpoint.remote, or --remote URL");
        }
        check_preemption(&d, a.cloud, a.meta_url);
        if (have_cfg)
            check_inputs(&d, &cfg, size, &gpus);
    }
    doctor_gpu_checks(&d, &gpus, comm); /* every rank: the NCCL test is collective */

    int rc = gather_checks(comm, &d, &err);
    int code = 0;
    if (rc) {
        fprintf(stderr, "spotune: error: rank %d: %s\n", rank, err.msg);
        code = SP_EXIT_OTHER;
    } else if (rank == 0) {
        int count[4] = {0};
        for (size_t i = 0; i < d.n; i++)
            count[d.v[i].status]++;
        code = count[DR_FAIL] ? 1 : 0;
        if (a.json) {
            json_t *doc = json_pack("{s:s, s:s, s:i, s:i, s:o, s:{s:i, s:i, s:i, s:i}, s:i}",
                                    "spotune", SPOTUNE_VERSION, "host", d.host, "ranks", size,
                                    "hosts", nhosts, "checks", checks_json(d.v, d.n), "summary",
                                    "pass", count[DR_PASS], "warn", count[DR_WARN], "fail",
                                    count[DR_FAIL], "skipped", count[DR_SKIPPED], "exit", code);
            char *s = json_dumps(doc, JSON_INDENT(2));
            if (s)
                puts(s);
            free(s);
            json_decref(doc);
        } else {
            printf("spotune doctor %s on %s: %d rank%s on %s%s%s\n", SPOTUNE_VERSION, d.host, size,
                   size > 1 ? "s" : "", hosts, have_cfg ? ", config " : "",
                   have_cfg ? a.config : "");
            print_text(&d, nhosts > 1);
            printf("%d PASS, %d WARN, %d FAIL, %d SKIPPED: %s\n", count[DR_PASS], count[DR_WARN],
                   count[DR_FAIL], count[DR_SKIPPED],
                   count[DR_FAIL] ? "this machine is not ready (exit 1)" : "ready");
        }
        fflush(stdout);
    }
    /* every rank returns rank 0's verdict */
    int32_t verdict = code;
    if (!rc && comm_bcast(comm, &verdict, sizeof verdict, 0, &err) == 0)
        code = verdict;
    free(d.v);
    curl_global_cleanup();
    comm_finalize(comm);
    if (have_cfg)
        config_free(&cfg);
    return code;
}
