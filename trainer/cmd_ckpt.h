/* trainer/cmd_ckpt.h — the checkpoint commands: `spotune ckpt list|verify|pull`
 * on local run directories and on object stores, and `spotune export`
 * (a checkpoint's adapter in the PEFT layout, or base + adapter merged in the
 * input layout). */
#ifndef SPOTUNE_CMD_CKPT_H
#define SPOTUNE_CMD_CKPT_H

int cmd_ckpt(int argc, char **argv);
int cmd_export(int argc, char **argv);

#endif
