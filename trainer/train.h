/* trainer/train.h — the training loop: data-parallel steps over the ranks
 * of comm (each rank its share of every global batch), gradient all-reduce,
 * clipping, AdamW and the schedule, validation, progress and metrics,
 * checkpoints and resume (through checkpointing.h), and the final adapter or
 * model in the run directory. */
#ifndef SPOTUNE_TRAIN_H
#define SPOTUNE_TRAIN_H

#include "../comm/comm.h"
#include "config.h"

/* Runs the whole training described by cfg, resuming as resume says
 * ("auto", "none" or a checkpoint path); returns an exit code (0 done, 2
 * config, 3 input, 75 stopped by a signal after a checkpoint, 1 other) with
 * the reason in err. */
int train_run(const config_t *cfg, comm_t *comm, const char *resume, sp_err *err);

#endif
