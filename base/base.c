#define _POSIX_C_SOURCE 200809L
#include "base.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <time.h>

/* Copies the message s into msg[n]. One that does not fit loses its middle,
 * marked, and keeps its beginning (what was being done, the start of a path)
 * and its end (the cause, e.g. "File name too long"); neither cut falls
 * inside a UTF-8 character. */
static void err_fit(char *msg, size_t n, const char *s)
{
    static const char mark[] = " [... message cut ...] ";
    size_t len = strlen(s), ml = sizeof mark - 1;
    if (len < n) {
        memcpy(msg, s, len + 1);
        return;
    }
    size_t room = n - 1 - ml, head = room / 2, tail = len - (room - head);
    while (head > 0 && ((unsigned char)s[head] & 0xc0) == 0x80)
        head--;
    while (tail < len && ((unsigned char)s[tail] & 0xc0) == 0x80)
        tail++;
    memcpy(msg, s, head);
    memcpy(msg + head, mark, ml);
    memcpy(msg + head + ml, s + tail, len - tail + 1);
}

int sp_fail(sp_err *e, int code, const char *fmt, ...)
{
    if (e && e->code == 0) {
        int saved = errno; /* callers may still read it */
        va_list ap;
        va_start(ap, fmt);
        char *s = sp_vstrf(fmt, ap);
        va_end(ap);
        if (s)
            err_fit(e->msg, sizeof e->msg, s);
        else
            sp_cutf(e->msg, sizeof e->msg, "out of memory (while recording an error)");
        free(s);
        e->code = code;
        errno = saved;
    }
    return code;
}

void sp_err_prefix(sp_err *e, const char *fmt, ...)
{
    va_list ap;
    if (!e || e->code == 0)
        return;
    va_start(ap, fmt);
    char *pre = sp_vstrf(fmt, ap);
    va_end(ap);
    char *s = pre ? sp_strf("%s%s", pre, e->msg) : NULL;
    if (s)
        err_fit(e->msg, sizeof e->msg, s);
    free(s);
    free(pre);
}

void sp_err_clear(sp_err *e)
{
    e->code = 0;
    e->msg[0] = 0;
}

char *sp_vstrf(const char *fmt, va_list ap)
{
    va_list ap2;
    va_copy(ap2, ap);
    int n = vsnprintf(NULL, 0, fmt, ap2);
    va_end(ap2);
    char *s = n < 0 ? NULL : malloc((size_t)n + 1);
    if (s)
        vsnprintf(s, (size_t)n + 1, fmt, ap);
    return s;
}

char *sp_strf(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    char *s = sp_vstrf(fmt, ap);
    va_end(ap);
    return s;
}

int sp_fitf(char *buf, size_t n, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int len = vsnprintf(buf, n, fmt, ap);
    va_end(ap);
    if (len >= 0 && (size_t)len < n)
        return 0;
    if (n)
        buf[0] = 0;
    errno = ENAMETOOLONG;
    return -1;
}

int sp_cutf(char *buf, size_t n, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int len = vsnprintf(buf, n, fmt, ap);
    va_end(ap);
    return len >= 0 && (size_t)len >= n;
}

uint16_t sp_f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

float sp_bf16_to_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

float sp_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
    float f;
    if (exp == 0) {
        f = ldexpf((float)man, -24); /* zero or subnormal */
        memcpy(&u, &f, 4);
        u |= sign;
    } else if (exp == 31) {
        u = sign | 0x7f800000u | (man << 13);
    } else {
        u = sign | ((exp + 112u) << 23) | (man << 13);
    }
    memcpy(&f, &u, 4);
    return f;
}

uint16_t sp_f32_to_f16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t sign = (u >> 16) & 0x8000u;
    float a = fabsf(f);
    if (a != a)
        return (uint16_t)(sign | 0x7e00u);
    if (a >= 65520.0f)
        return (uint16_t)(sign | 0x7c00u);
    if (a < 6.103515625e-05f) /* subnormal: round a * 2^24 to nearest even */
        return (uint16_t)(sign | (uint32_t)nearbyintf(a * 16777216.0f));
    memcpy(&u, &a, 4);
    uint32_t exp = (u >> 23) - 112u, man = u & 0x7fffffu;
    uint32_t h = (exp << 10) | (man >> 13);
    uint32_t rest = man & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u)))
        h++;
    return (uint16_t)(sign | h);
}

float sp_rng_normal(uint64_t seed, uint64_t ctr)
{
    /* u1 in (0, 1] so the log is finite */
    double u1 = ((double)(sp_rng_u64(seed, 2 * ctr) >> 11) + 1.0) * (1.0 / 9007199254740992.0);
    double u2 = (double)(sp_rng_u64(seed, 2 * ctr + 1) >> 11) * (1.0 / 9007199254740992.0);
    return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

double sp_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

void sp_name_thread(const char *name)
{
    prctl(PR_SET_NAME, (unsigned long)name, 0UL, 0UL, 0UL);
}

double sp_wall_time(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

uint64_t sp_fnv1a(uint64_t h, const void *data, size_t n)
{
    const unsigned char *p = data;
    for (size_t i = 0; i < n; i++) {
        h ^= p[i];
        h *= 0x100000001b3ULL;
    }
    return h;
}

const char *sp_after(const char *s, const char *prefix)
{
    size_t n = strlen(prefix);
    return strncmp(s, prefix, n) == 0 ? s + n : NULL;
}

int sp_mkdir_p(const char *path)
{
    if (strlen(path) >= PATH_MAX) {
        errno = ENAMETOOLONG;
        return -1;
    }
    char *buf = sp_strf("%s", path);
    if (!buf)
        return -1; /* errno: ENOMEM */
    int rc = 0;
    for (char *p = buf + 1; *p && !rc; p++) {
        if (*p != '/')
            continue;
        *p = 0;
        if (mkdir(buf, 0755) != 0 && errno != EEXIST)
            rc = -1;
        *p = '/';
    }
    if (!rc && mkdir(buf, 0755) != 0 && errno != EEXIST)
        rc = -1;
    int saved = errno;
    free(buf);
    errno = saved;
    return rc;
}

int sp_pid_running(long pid)
{
    if (pid <= 0 || pid > 0x7fffffffL)
        return 0;
    if (kill((pid_t)pid, 0) != 0 && errno != EPERM)
        return 0;
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%ld/stat", pid);
    FILE *f = fopen(path, "r");
    if (!f)
        return 1; /* no /proc: kill's answer is all there is */
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    /* "PID (comm) S ...": the state follows the last ')' (comm may hold one) */
    const char *rp = strrchr(buf, ')');
    return !(rp && rp[1] == ' ' && (rp[2] == 'Z' || rp[2] == 'X'));
}
