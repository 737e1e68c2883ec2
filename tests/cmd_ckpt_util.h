/* tests/cmd_ckpt_util.h — the fixture of the checkpoint command suites
 * (test_cmd_ckpt.c, test_ckpt_contents.c): each test's setup makes DIR with
 * the tiny model and data and DIR/run.yaml, LoRA r 4 (alpha 8) on q/v/down,
 * 12 steps with a checkpoint every 4 (step-4, -8 and -12 kept); runs go to
 * DIR/NAME. */
#ifndef SPOTUNE_TESTS_CMD_CKPT_UTIL_H
#define SPOTUNE_TESTS_CMD_CKPT_UTIL_H

extern char *dir;

void cmd_ckpt_setup(void);
void cmd_ckpt_teardown(void);
/* spotune train run.yaml into DIR/name; extra: more options; asserts exit 0 */
void train(const char *name, const char *extra);
/* DIR/rel, in one of 6 static buffers used in turn: copy a path kept
 * across more calls */
const char *at(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
int exists(const char *path);

#endif
