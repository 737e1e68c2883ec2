/* Helpers shared by the trainer suites: fixture paths, temporary
 * directories, running the spotune binary, reading files. */
#ifndef SPOTUNE_TEST_UTIL_H
#define SPOTUNE_TEST_UTIL_H

#include <stddef.h>

#include "kernels/backend.h"
#include "trainer/model.h"
#include "trainer/safetensors.h"

/* The source tree and the build tree (the spotune binary): those this test
 * was built from, or $SPOTUNE_TEST_SOURCE_DIR and $SPOTUNE_TEST_BINARY_DIR
 * when set (the GPU bundle sets them). */
const char *tu_source_dir(void);
const char *tu_binary_dir(void);
/* printf into a string that lives until 8 more calls of tu_fmt (and
 * fixture) have been made: for paths and commands built in a test. */
const char *tu_fmt(const char *fmt, ...) SP_PRINTF(1, 2);
/* tu_fmt("%s/tests/fixtures/%s", tu_source_dir(), rel) */
const char *fixture(const char *rel);
/* A fresh directory under the build tree's tmp/, removed by tu_rmtree. */
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
/* Tensor t as F32 in malloc'd host memory; fails the test on the backend's
 * sticky error. */
float *tu_download(backend_t *be, tensor_t t);
/* Loads one F32 tensor of a safetensors file into malloc'd memory. */
float *tu_load_f32(const char *path, const char *name, size_t *n);
/* max |a-b| / max |b| (infinite when a difference is NaN) */
double tu_rel_err(const float *a, const float *b, size_t n);
int tu_contains(const char *haystack, const char *needle);
/* 1 when the CPU has AVX-512 (F, BW, VL, DQ, CD: OpenBLAS's SkylakeX
 * kernels); *avx2: AVX2 and FMA (Haswell's) */
int tu_cpu_vector_units(int *avx2);
/* Starts `sh -c "exec CMD"` in its own process group with stdout and stderr
 * into log; returns the pid (the process itself, thanks to exec). */
int tu_spawn(const char *log, const char *fmt, ...);
/* Starts tests/tools/fake_metadata.py ARGS on a free loopback port (its
 * output in log) and waits until it listens: its pid, and its URL
 * ("http://127.0.0.1:PORT") in url. Stop it with kill and tu_wait. */
int tu_fake_metadata(const char *log, const char *args, char *url, size_t n);
/* The same for tests/tools/SCRIPT (fake_s3.py, fake_metadata.py). */
int tu_fake_server(const char *script, const char *log, const char *args, char *url, size_t n);
/* Waits for pid up to timeout_s (then SIGKILLs its group); returns the exit
 * status, 128+signal, or -1 on timeout. */
int tu_wait(int pid, double timeout_s);
/* The id of a process that has just exited and been reaped (as a writer
 * killed with -9 leaves in a name). */
int tu_dead_pid(void);
/* A child of this process that has exited and is not reaped (a zombie, as
 * ranks re-parented to a PID 1 that does not reap stay); reap it with
 * tu_reap. */
int tu_zombie_pid(void);
void tu_reap(int pid);
/* Sleeps s seconds. */
void tu_sleep(double s);
/* In dir: the demo's synthetic text (seed text_seed) tokenized to
 * data.train.h5 (no validation split) and a tiny model in model/ (seed
 * model_seed). Returns the exit status; *out receives the tools' output. */
int tu_tiny_inputs(const char *dir, int text_seed, int model_seed, char **out);
/* A fresh directory (tu_tempdir(tag)) with tu_tiny_inputs made in it; fails
 * the test when they cannot be made. */
char *tu_tiny_dir(const char *tag, int text_seed, int model_seed);
/* Writes dir/run.yaml: model.path and data.train set to what tu_tiny_inputs
 * made in dir, then the rest of the config, printf'd from fmt (without model:
 * and data: sections). */
void tu_run_yaml(const char *dir, const char *fmt, ...) SP_PRINTF(2, 3);
/* In dir: a small text of sentences about coloured animals and sums
 * (text.txt), tokenized with a tenth for validation (data.train.h5,
 * data.val.h5), and the tiny model (model/, seed 3). Returns the exit
 * status; *out receives the tools' output. */
int tu_animals_task(const char *dir, char **out);
/* A fresh temporary directory (named after tag) holding tu_animals_task's
 * task and base.yaml: LoRA r 4 on q/v/down, 8 steps of 4 x 32 tokens, seed
 * 11, validation on 16 windows, the CPU backend with 2 threads, run.dir
 * DIR/run. Asserts each part was made; the caller frees and tu_rmtree's it. */
char *tu_tiny_train_dir(const char *tag);
/* The mpirun prefix for N ranks over TCP (environment for root and for
 * sanitizer builds included). */
const char *tu_mpirun(int ranks);

/* The LoRA options (mode, r, alpha, rslora, targets) of the PEFT adapter
 * directory dir, read from its adapter_config.json. */
int tu_lora_opts(const char *dir, model_opts *o, sp_err *err);

/* A Hugging Face fixture (a directory of tests/fixtures/hf, made by
 * scripts/make_fixtures.py: model/, lora/, batch.safetensors) on a backend:
 * the batch (inputs; targets -1 where the loss mask is off; count: the
 * targets counted), sample ids first_id, first_id + 1, ..., and the model
 * with the base weights and, with lora, the adapter (dropout as given). */
typedef struct tu_hf_case {
    model_config_t mc;
    backend_t *be;
    model_t *m;
    int32_t *inputs, *targets;
    uint64_t ids[8];
    int B, T;
    double count;
} tu_hf_case;
int tu_hf_open(tu_hf_case *c, const char *dir, int lora, double dropout, const char *backend,
               int recompute, uint64_t first_id, sp_err *err);
/* The same with the adapter, no dropout, and the projection weights stored
 * as NF4 (model.quantize nf4). */
int tu_hf_open_nf4(tu_hf_case *c, const char *dir, const char *backend, sp_err *err);
/* The same with another recompute mode (RECOMPUTE_*). */
int tu_hf_open_nf4_recompute(tu_hf_case *c, const char *dir, const char *backend, int recompute,
                             sp_err *err);
void tu_hf_close(tu_hf_case *c);
/* One forward/backward of the case's whole batch (gradients zeroed first,
 * scaled by 1 / trained tokens): the loss summed over the batch's tokens
 * (times 1 / trained tokens: the mean) into *loss, and the whole gradient
 * vector (malloc'd, m->n_trainable floats). Asserts that it ran. */
float *tu_hf_step(tu_hf_case *c, double *loss);

/* ---- the local S3 test server (tests/store.cmake starts it) ------------------ */

/* Its endpoint; fails the test when the environment is missing (an S3 test
 * must never pass without a server). */
const char *tu_s3_endpoint(void);

/* Its proxy (fault injection): the pid of the running Swift proxy ($SWIFT_S3_BASE/run/proxy.pid). */
int tu_proxy_pid(void);
/* SIGSTOPs the proxy (the store hangs: connections are accepted, nothing is
 * answered). A guard process sends SIGCONT if this process ends first (a
 * failed assertion, a crash, a timeout) or after max_s seconds, so a stopped
 * proxy never outlives the test. tu_proxy_thaw sends SIGCONT at once. */
void tu_proxy_freeze(double max_s);
void tu_proxy_thaw(void);
/* The proxy's log: one line per request, which ends "... bytes_recvd
 * bytes_sent etag txn headers request_time source info start_time end_time
 * policy". The whole text (malloc'ed), and its current size. */
char *tu_proxy_log(size_t *len);
/* Polls the proxy log (after byte offset `from`) until it holds `needle`,
 * up to timeout_s; returns 1 if it does. */
int tu_proxy_log_wait(size_t from, const char *needle, double timeout_s);

/* Overwrites, in place, n values of tensor `tensor` of the safetensors file
 * at path from element `at` with vals, converted to the tensor's dtype (a
 * damaged or diverged weight file, made from a good one). */
void tu_st_poke(const char *path, const char *tensor, size_t at, const float *vals, size_t n);

#endif
