/* Stops between batches and the validation: the ranks agree after every
 * micro-batch and before every validation batch whether a stop signal came
 * (stop_agreed), so that a stop gives up the step or the validation in
 * progress instead of waiting for its end; the stop before training and
 * within a step; the validation, and the one a resumed run owes. */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "checkpointing.h"
#include "log.h"
#include "signals.h"
#include "train_internal.h"

/* Collective: whether any rank has received a stop signal (*stop). Between
 * micro-batches and validation batches too, so that a 30-second notice is
 * not spent finishing a long step or a validation; one rank alone needs no
 * collective. */
int train_stop_agreed(trainer_t *t, int *stop, sp_err *err)
{
    int32_t seen = signals_received() > 0;
    if (t->world > 1 && comm_allreduce(t->comm, &seen, 1, COMM_I32, COMM_MAX, err))
        return err->code;
    *stop = seen != 0;
    return 0;
}

/* Collective: a stop signal on any rank before the first step ends the run
 * here, before the (possibly long) work that comes next. Nothing has been
 * trained since the newest checkpoint, which is complete: exit 75, and the
 * same command resumes. */
int train_stop_before_training(trainer_t *t, const char *before, sp_err *err)
{
    int seen = 0;
    if (train_stop_agreed(t, &seen, err))
        return err->code;
    if (!seen)
        return 0;
    return sp_fail(err, SP_EXIT_PREEMPTED,
                   "stopped by %s before training started (%s); nothing was trained, so "
                   "the newest checkpoint is complete: run the same command to resume",
                   signals_received() ? signals_first_name() : "a signal to another rank",
                   before);
}

/* The validation loss over the first data.val_windows windows of data.val
 * (rank r the windows r, r + world, ...), logged by rank 0. Every rank runs
 * the same number of batches (the last ones may be partial or empty) and
 * after each the ranks agree whether a stop signal came: if one did, the
 * validation is given up (*given_up = 1, nothing logged) so that the stop's
 * checkpoint is not kept waiting; the resumed run validates that step
 * first. */
int train_run_validation(trainer_t *t, int *given_up, sp_err *err)
{
    uint64_t nwin = t->val.n_windows < (uint64_t)t->cfg->val_windows
                        ? t->val.n_windows
                        : (uint64_t)t->cfg->val_windows;
    uint64_t world = (uint64_t)t->world, mb = (uint64_t)t->mb;
    uint64_t per_rank = (nwin + world - 1) / world, batches = (per_rank + mb - 1) / mb;
    double sums[2] = {0.0, 0.0}; /* loss, tokens */
    *given_up = 0;
    for (uint64_t i = 0; i < batches; i++) {
        if (train_stop_agreed(t, given_up, err))
            return err->code;
        if (*given_up) {
            if (t->out)
                log_event(t->out, &t->metrics, "info",
                          "stop requested: the validation of step %lld is given up after %llu "
                          "of %llu batches (the resumed run validates this step first)",
                          (long long)t->p.step, (unsigned long long)i,
                          (unsigned long long)batches);
            return 0;
        }
        int64_t filled = 0;
        for (uint64_t j = 0; j < mb; j++) {
            uint64_t w = (uint64_t)t->rank + world * (i * mb + j);
            if (w >= nwin)
                break;
            int64_t n = 0;
            t->sample_ids[filled] = w;
            if (dataset_read_window(&t->val, w, t->inputs + filled * t->T,
                                    t->targets + filled * t->T,
                                    t->pos ? t->pos + filled * t->T : NULL,
                                    t->seg ? t->seg + filled * t->T : NULL, &n, err))
                return err->code;
            sums[1] += (double)n;
            filled++;
        }
        if (filled > 0) {
            model_batch b = {.inputs = t->inputs,
                             .targets = t->targets,
                             .sample_ids = t->sample_ids,
                             .B = (int)filled,
                             .T = (int)t->T,
                             .pos = t->pos,
                             .seg = t->seg};
            if (model_evaluate(t->m, &b, &sums[0], err))
                return err->code;
        }
    }
    if (comm_allreduce(t->comm, sums, 2, COMM_F64, COMM_SUM, err))
        return err->code;
    if (t->out)
        log_val(t->out, &t->metrics, t->p.step, sums[1] > 0 ? sums[0] / sums[1] : NAN,
                (int64_t)sums[1]);
    return 0;
}

/* The end of a run that ckpt_ctl_boundary told to stop (stop 1: a signal,
 * 2: a newer checkpoint in the store), its checkpoint committed: exit 75. */
int train_stopped(trainer_t *t, int stop, sp_err *err)
{
    if (stop == 2)
        return sp_fail(err, SP_EXIT_PREEMPTED,
                       "stopped after committing checkpoint step %lld: checkpoint.remote "
                       "holds a newer checkpoint of this run (step %lld), which the start "
                       "could not see; run the same command to resume from it",
                       (long long)t->p.step, (long long)ckpt_ctl_newer_in_store(t->ck));
    return sp_fail(err, SP_EXIT_PREEMPTED,
                   "stopped by a signal after committing checkpoint step %lld; run the same "
                   "command to resume",
                   (long long)t->p.step);
}

/* A stop agreed within step p.step + 1 after `done` of its micro-batches:
 * the step was given up (run_step), so the stop's checkpoint is step
 * p.step's, written now unless this run resumed it or has written it. A
 * fresh run stopped in its first step has nothing to keep. */
int train_stop_within_step(trainer_t *t, int64_t done, sp_err *err)
{
    if (t->out)
        log_event(t->out, &t->metrics, "info",
                  "stop requested (%s): step %lld is given up after %lld of its %lld "
                  "micro-batches; nothing of it was applied, and the resumed run trains it "
                  "again",
                  signals_received() ? signals_first_name() : "another rank",
                  (long long)t->p.step + 1, (long long)done, (long long)t->ga);
    if (t->p.step == 0 && !t->resumed)
        return train_stop_before_training(t, "in the first step", err);
    int stop = 0;
    if (ckpt_ctl_boundary(t->ck, t->m, &t->p, 0, &stop, err))
        return err->code;
    if (!stop) /* the signal is still received: the boundary cannot miss it */
        return sp_fail(err, SP_EXIT_OTHER, "step %lld was given up for a stop that did not come",
                       (long long)t->p.step + 1);
    return train_stopped(t, stop, err);
}

/* Collective, before the first step: whether a validation is owed at the
 * start. A fresh run's is the starting point of the curve; a resumed one
 * owes the validation of its checkpoint's step when it was due there and
 * metrics.jsonl lacks it (a stop gave it up). Rank 0 decides. */
static int validation_owed(trainer_t *t, int *owed, sp_err *err)
{
    const config_t *c = t->cfg;
    int32_t v = 0;
    if (t->rank == 0 && t->has_val) {
        int due = (c->val_every > 0 && t->p.step % c->val_every == 0) || t->p.step == c->steps;
        v = !t->resumed || (t->p.step > 0 && due &&
                            !metrics_has_val(&t->metrics, c->run_dir, t->p.step));
    }
    if (comm_allreduce(t->comm, &v, 1, COMM_I32, COMM_MAX, err))
        return err->code;
    *owed = v != 0;
    return 0;
}

/* The validation owed before the first step; a stop that gives it up ends
 * the run as a stop before training (nothing was trained since the
 * newest checkpoint). */
int train_validate_first(trainer_t *t, sp_err *err)
{
    int owed = 0, given_up = 0;
    if (validation_owed(t, &owed, err) || !owed || train_run_validation(t, &given_up, err))
        return err->code;
    return given_up ? train_stop_before_training(t, "during the first validation", err) : 0;
}
