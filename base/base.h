/* base/base.h — what every module shares: the error record and exit codes,
 * bf16/f16 conversion, a counter-based RNG (identical on CPU and GPU), and
 * a monotonic clock. Owns no state: every function is pure or reads the clock. */
#ifndef SPOTUNE_BASE_H
#define SPOTUNE_BASE_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

/* Exit codes (docs/formats.md lists which case ends with which). */
enum {
    SP_OK = 0,
    SP_EXIT_OTHER = 1,     /* anything else */
    SP_EXIT_USAGE = 2,     /* usage or config error */
    SP_EXIT_INPUT = 3,     /* bad model, data or checkpoint input */
    SP_EXIT_PREEMPTED = 75 /* stopped on a signal after a complete checkpoint */
};

/* An error travels up as a return code plus this record; the first failure
 * wins so the message names the root cause, not a later symptom. A message
 * holds two paths of PATH_MAX bytes and what happened to them whole. */
#define SP_ERR_MSG_MAX 9216
typedef struct sp_err {
    int code;
    char msg[SP_ERR_MSG_MAX];
} sp_err;

#if defined(__GNUC__)
#define SP_PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#define SP_PRINTF(a, b)
#endif

/* Records the error (if none is recorded yet) and returns code. A message
 * longer than the record (a path of many KB) loses its middle, marked
 * " [... message cut ...] ", and keeps its beginning and its end, the cause. */
int sp_fail(sp_err *e, int code, const char *fmt, ...) SP_PRINTF(3, 4);
/* Prefixes context to an already recorded message ("file.h5: " + msg). */
void sp_err_prefix(sp_err *e, const char *fmt, ...) SP_PRINTF(2, 3);
void sp_err_clear(sp_err *e);

/* float <-> bfloat16 (round to nearest even, NaN kept NaN), f16 -> float. */
uint16_t sp_f32_to_bf16(float f);
float sp_bf16_to_f32(uint16_t h);
float sp_f16_to_f32(uint16_t h);
uint16_t sp_f32_to_f16(float f);

/* Counter-based RNG: value i of stream (seed, offset) is a pure function, so
 * a GPU kernel, a CPU loop and a resumed run all draw the same numbers with no
 * state to save. sp_rng_u64 is SplitMix64's finaliser over a mixed key. */
static inline uint64_t sp_mix64(uint64_t z)
{
    z += 0x9e3779b97f4a7c15ULL;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}
static inline uint64_t sp_rng_u64(uint64_t seed, uint64_t ctr)
{
    return sp_mix64(sp_mix64(seed) ^ ctr);
}
/* Uniform in [0, 1) with 24 random bits (exact in float). */
static inline float sp_rng_uniform(uint64_t seed, uint64_t ctr)
{
    return (float)(sp_rng_u64(seed, ctr) >> 40) * (1.0f / 16777216.0f);
}
/* Derives an independent stream seed from a parent seed and a tag. */
static inline uint64_t sp_rng_stream(uint64_t seed, uint64_t tag)
{
    return sp_mix64(seed ^ sp_mix64(tag + 0x632be59bd9b4e019ULL));
}
/* Standard normal via Box-Muller from two draws (ctr*2, ctr*2+1). */
float sp_rng_normal(uint64_t seed, uint64_t ctr);

/* Seconds on a monotonic clock; wall-clock seconds since the epoch. */
double sp_now(void);
double sp_wall_time(void);

/* Names the calling thread (at most 15 characters shown: top -H, ps -L,
 * gdb, /proc/self/task/N/comm); spotune's own threads call it first. */
void sp_name_thread(const char *name);

/* Strings. Paths and messages whose length depends on the input are built
 * with sp_strf, a printf into a new heap string: no fixed buffer, nothing
 * cut. Where an interface keeps a caller's buffer, sp_fitf fills it only
 * when the whole text fits, and sp_cutf is for text whose truncation is
 * harmless (a message, a label) and says so at the call. */
/* A new heap string (the caller frees it); NULL when out of memory. */
char *sp_strf(const char *fmt, ...) SP_PRINTF(1, 2);
char *sp_vstrf(const char *fmt, va_list ap) SP_PRINTF(1, 0);
/* printf into buf[n]: 0 when the whole text fits; otherwise buf is left
 * empty and -1 is returned with errno = ENAMETOOLONG (never a cut path). */
int sp_fitf(char *buf, size_t n, const char *fmt, ...) SP_PRINTF(3, 4);
/* printf into buf[n], cut to fit; returns 1 when it was cut, else 0. */
int sp_cutf(char *buf, size_t n, const char *fmt, ...) SP_PRINTF(3, 4);

/* s past its leading prefix, or NULL when s does not begin with prefix. */
const char *sp_after(const char *s, const char *prefix);
/* The length of a string literal (without its NUL), counted by the compiler. */
#define SP_LEN(lit) (sizeof("" lit) - 1)

/* mkdir -p: creates path and its missing parents (mode 0755); 0 or -1 with
 * errno. A path of PATH_MAX bytes or more is refused (ENAMETOOLONG) before
 * anything is created. */
int sp_mkdir_p(const char *path);

/* Whether process pid of this host is running: it exists (EPERM counts:
 * it exists, not ours) and has not exited. A process that has exited but is
 * not yet reaped (a zombie, state Z or X in /proc/PID/stat) is not running:
 * where PID 1 does not reap at once, killed ranks stay zombies for minutes. */
int sp_pid_running(long pid);

/* FNV-1a 64-bit over bytes, chainable (pass the previous hash as h). */
#define SP_FNV_INIT 0xcbf29ce484222325ULL
uint64_t sp_fnv1a(uint64_t h, const void *data, size_t n);

#endif
