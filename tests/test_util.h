/* Helpers shared by the trainer suites: fixture paths, temporary
 * directories, running the spotune binary, reading files. */
#ifndef SPOTUNE_TEST_UTIL_H
#define SPOTUNE_TEST_UTIL_H

#include <stddef.h>

#include "kernels/backend.h"
#include "trainer/safetensors.h"

/* SPOTUNE_SOURCE_DIR "/tests/fixtures/" rel */
const char *fixture(const char *rel);
/* A fresh directory under the build tree, removed by tu_rmtree. */
char *tu_tempdir(const char *tag);
void tu_rmtree(const char *dir);
/* Mounts a tmpfs of kib KiB at path (made if missing; needs root); returns
 * the exit status of mount. tu_rmtree of a directory above unmounts it. */
int tu_mount_tmpfs(const char *path, long kib);
/* Rewrites checkpoint directory ck's MANIFEST.json entry for state.h5 to the
 * file as it now is (size, SHA-256), as a writer would that damaged the file
 * before taking its checksum. Returns 0 or -1. */
int tu_remanifest(const char *ck);
/* Free KiB of the file system holding path (df), or -1. */
long tu_free_kib(const char *path);
/* Runs the spotune binary with args through /bin/sh; captures stdout+stderr
 * into *output (malloc'd, may be NULL) and returns the exit status (or 128+signal). */
int tu_spotune(char **output, const char *fmt, ...);
/* Runs a shell command the same way. */
int tu_sh(char **output, const char *fmt, ...);
char *tu_read_file(const char *path, size_t *len);
int tu_write_file(const char *path, const char *text);
/* Loads one F32 tensor of a safetensors file into malloc'd memory. */
float *tu_load_f32(const char *path, const char *name, size_t *n);
/* max |a-b| / max |b| */
double tu_rel_err(const float *a, const float *b, size_t n);
int tu_contains(const char *haystack, const char *needle);
/* Starts `sh -c "exec CMD"` in its own process group with stdout and stderr
 * into log; returns the pid (the process itself, thanks to exec). */
int tu_spawn(const char *log, const char *fmt, ...);
/* Waits for pid up to timeout_s (then SIGKILLs its group); returns the exit
 * status, 128+signal, or -1 on timeout. */
int tu_wait(int pid, double timeout_s);
/* Sleeps s seconds. */
void tu_sleep(double s);
/* In dir: the demo's synthetic text (seed text_seed) tokenized to
 * data.train.h5 (no validation split) and a tiny model in model/ (seed
 * model_seed). Returns the exit status; *out receives the tools' output. */
int tu_tiny_inputs(const char *dir, int text_seed, int model_seed, char **out);
/* The mpirun prefix for N ranks over TCP (environment for root and for
 * sanitizer builds included). */
const char *tu_mpirun(int ranks);

#endif
