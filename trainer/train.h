/* trainer/train.h — the training loop: data-parallel steps over the ranks
 * of comm (each rank its share of every global batch), gradient all-reduce,
 * clipping, AdamW and the schedule, validation, progress and metrics, and
 * the final adapter or model in the run directory. */
#ifndef SPOTUNE_TRAIN_H
#define SPOTUNE_TRAIN_H

#include "../comm/comm.h"
#include "config.h"

/* Runs the whole training described by cfg; returns an exit code (0 done,
 * 2 config, 3 input, 1 other) with the reason in err. */
int train_run(const config_t *cfg, comm_t *comm, sp_err *err);

#endif
