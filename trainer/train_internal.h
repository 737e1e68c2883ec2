/* trainer/train_internal.h — what train.c (setup, the step, the loop) and
 * train_stop.c (stops between batches, the validation) share: the trainer's
 * state. Not part of the trainer's API (train.h). */
#ifndef SPOTUNE_TRAIN_INTERNAL_H
#define SPOTUNE_TRAIN_INTERNAL_H

#include <stdint.h>
#include <stdio.h>

#include "../checkpoint/lease.h"
#include "checkpointing.h"
#include "data.h"
#include "log.h"
#include "model.h"
#include "train.h"

typedef struct trainer {
    const config_t *cfg;
    comm_t *comm;
    int rank, world;
    FILE *out; /* stdout on rank 0, NULL elsewhere */
    backend_t *be;
    model_config_t mc;
    model_t *m;
    dataset_t train, val;
    int has_val;
    metrics_t metrics;
    int64_t T, mb, ga, global_batch;
    int32_t *inputs, *targets;
    int32_t *pos, *seg; /* packed documents (data.packing), else NULL */
    uint64_t *sample_ids;
    uint64_t *sample_at; /* log.samples: each slot's epoch and window, written once trained */
    ckpt_ctl *ck;
    run_lock *lock; /* rank 0: this job holds run.dir */
    FILE *samples; /* log.samples audit, or NULL */
    const char *resume;
    int resumed;
    train_progress p;
    double steps_time_s;
    int64_t steps_timed, steps_run;
    int graphs_noted; /* runtime.cuda_graphs turned off: said once */
} trainer_t;

/* train_stop.c. Collective: whether any rank has received a stop signal. */
int train_stop_agreed(trainer_t *t, int *stop, sp_err *err);
/* Collective: a stop before any step of this process ends the run (exit 75). */
int train_stop_before_training(trainer_t *t, const char *before, sp_err *err);
/* The validation loss, logged by rank 0; *given_up when a stop came. */
int train_run_validation(trainer_t *t, int *given_up, sp_err *err);
/* The end of a run that ckpt_ctl_boundary told to stop (exit 75). */
int train_stopped(trainer_t *t, int stop, sp_err *err);
/* A stop agreed within a step given up after `done` micro-batches. */
int train_stop_within_step(trainer_t *t, int64_t done, sp_err *err);
/* The validation owed before the first step (fresh, or given up). */
int train_validate_first(trainer_t *t, sp_err *err);

#endif
