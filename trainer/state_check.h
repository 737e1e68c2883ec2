/* trainer/state_check.h — reading a checkpoint's state.h5 safely. A file
 * can match its MANIFEST and still be damaged (damaged before its checksum
 * was taken), and libhdf5 can crash on some damage instead of returning an
 * error. So its structure is first read by `spotune ckpt check` in a process
 * of its own (this program, /proc/self/exe): a crash or hang there is a
 * damaged checkpoint (SP_EXIT_INPUT, naming the file), never a crashed run.
 * Only then is the state read here. */
#ifndef SPOTUNE_STATE_CHECK_H
#define SPOTUNE_STATE_CHECK_H

#include "../checkpoint/ckpt.h"
#include "config.h"
#include "model_config.h"

/* Runs `spotune ckpt check DIR` and reports what it found. */
int state_check_isolated(const char *dir, sp_err *err);
/* ckpt_verify, state_check_isolated, then ckpt_read (shards_in_store: see
 * ckpt_verify_ex). */
int state_read_checked(const char *dir, int shards_in_store, ckpt_snapshot *s, sp_err *err);

/* ---- what a checkpoint holds --------------------------------------------------------
 * The same checks for every reader (ckpt verify, export, train --resume), so
 * that what verify calls ok is what the others take. Errors are
 * SP_EXIT_INPUT and name the checkpoint (dir) and the attribute, key or
 * tensor. */

/* The attributes a resume reads, each of the type and range this writer
 * gives it: step (equal to MANIFEST's), cursor, global_batch, world_size
 * (equal to MANIFEST's), elapsed_s, config, mode (lora or full). */
int state_check_attrs(const char *dir, const ckpt_snapshot *s, sp_err *err);
/* The checkpoint's resolved config (its attribute 'config') into c (always
 * initialised: config_free it): every key a reader needs present
 * (model.path, train.mode; with LoRA lora.r, lora.alpha, lora.targets) and
 * its mode the attribute's. */
int state_load_config(const char *dir, const ckpt_snapshot *s, config_t *c, sp_err *err);
/* The tensors of s against its config c: every params/ tensor has its
 * adam_m/ and adam_v/ of the same shape and nothing else is there; with
 * LoRA, exactly the weights of c's targets in every layer, lora_A [r, in],
 * lora_B [out, r] and with DoRA the magnitude [out], in and out features the
 * same for a projection in every layer and consistent between projections
 * (q, k, v, gate and up read the hidden size that o and down write, ...)
 * and, when mc is given (the model at model_dir), the model's: its layers
 * and each projection's dims. */
int state_check_tensors(const char *dir, const ckpt_snapshot *s, const config_t *c,
                        const model_config_t *mc, const char *model_dir, sp_err *err);
/* n values of array `array` (group/name) from element `first` on: finite,
 * and for adam_v/ (second moments) not negative. where names the file. */
int state_check_values(const char *where, const char *array, const float *v, size_t n,
                       size_t first, sp_err *err);
/* The same for n values of tensor name in group g (0 params, 1 adam_m, 2
 * adam_v) of a sharded checkpoint read by r, from element `first` on; the
 * message names the shard file that holds the refused value. */
int state_check_shard_values(const ckpt_sharded *r, int g, const char *name, const float *v,
                             size_t n, size_t first, sp_err *err);
/* All of the above for a checkpoint read by state_read_checked (c: as
 * state_load_config): the values of every array s holds and, with
 * shard_values, of a sharded checkpoint's shard files in dir (a resume
 * checks those as it reads them). */
int state_check_contents(const char *dir, const ckpt_snapshot *s, int shard_values, config_t *c,
                         sp_err *err);

#endif
