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

/* Runs `spotune ckpt check DIR` and reports what it found. */
int state_check_isolated(const char *dir, sp_err *err);
/* ckpt_verify, state_check_isolated, then ckpt_read (shards_in_store: see
 * ckpt_verify_ex). */
int state_read_checked(const char *dir, int shards_in_store, ckpt_snapshot *s, sp_err *err);

#endif
