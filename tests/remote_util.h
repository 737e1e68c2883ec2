/* tests/remote_util.h — what test_remote.c and test_remote_ranks.c share
 * (tests/remote_util.c): each test's directory (dir: the tiny model, its
 * data and run.yaml, a LoRA run checkpointing every 5 steps into url, a
 * prefix of its own in the local S3 server's bucket). */
#ifndef SPOTUNE_TEST_REMOTE_UTIL_H
#define SPOTUNE_TEST_REMOTE_UTIL_H

#include "checkpoint/store.h"

extern char *dir;
extern char url[512];

/* The suite's init and fini. */
void remote_setup(void);
void remote_teardown(void);
/* The spotune train command of run `name` (DIR/name), extra --set options
 * appended; run() runs it, its output in *out. */
const char *cmd(const char *name, const char *extra);
int run(const char *name, const char *extra, char **out);
/* The test's store; 1 when it holds key. */
store_t *open_store(void);
int remote_has(const char *key);
/* A background run: whether pid runs; the step of the last train record of
 * run name; waiting (up to limit_s) for a step or for a line of its log. */
int running(int pid);
int last_step(const char *name);
int wait_step(const char *name, int step, int pid, double limit_s);
int wait_log(const char *log, const char *needle, int pid, double limit_s);

#endif
