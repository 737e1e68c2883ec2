/* trainer/checkpointing.h — when the trainer checkpoints and what: at the
 * step boundary, every checkpoint.every_steps, every checkpoint.every_minutes
 * (rank 0's clock), at the end, and on a stop signal seen by any rank (all
 * agree); the model's trainable state and the loop's position copied to host
 * memory (the only stall) and handed to the background writer; retention;
 * pushing committed checkpoints to checkpoint.remote; and resuming: the
 * newest valid checkpoint (local, or remote when newer), refusing a changed
 * model or math, re-splitting the global batch over a new rank count.
 * Rank 0 reads and writes the files (the state is replicated); the other
 * ranks receive it by broadcast. */
#ifndef SPOTUNE_CHECKPOINTING_H
#define SPOTUNE_CHECKPOINTING_H

#include <stdio.h>

#include "../comm/comm.h"
#include "config.h"
#include "log.h"
#include "model.h"

typedef struct train_progress {
    int64_t step;     /* optimizer steps done */
    uint64_t cursor;  /* global samples consumed */
    double elapsed_s; /* training time so far, across resumes */
} train_progress;

typedef struct ckpt_ctl ckpt_ctl;

/* Rank 0, for --resume none, before the run writes anything in run.dir (the
 * metrics file included): a run.dir that holds an earlier run's checkpoints
 * keeps them, but moved aside with its metrics.jsonl and samples/ into
 * run.dir/previous-YYYYmmddTHHMMSSZ/ (renames: nothing is deleted or
 * copied). Left in place, retention would prune this run's checkpoints in
 * favour of their higher steps, and the next start would resume theirs. A
 * checkpoint.remote that holds checkpoints is refused (exit 2): it would mix
 * the two runs the same way, and a store has no rename. *note: what was done,
 * for the log ("" when nothing). */
int ckpt_start_afresh(const config_t *cfg, char *note, size_t n, sp_err *err);
/* base_identity: the base model's (model_io_identity); data_identity:
 * data.train's (dataset_identity), which checkpoints record and a resume
 * compares. */
int ckpt_ctl_open(ckpt_ctl **out, const config_t *cfg, comm_t *comm, const char *base_identity,
                  const char *data_identity, FILE *log, metrics_t *metrics, sp_err *err);
/* Collective. resume: "auto" (newest valid checkpoint, if any), "none", or a
 * checkpoint directory or s3://.../step-N. On success *resumed says whether
 * state was restored into m and p, and *grad_accum may have been adjusted to
 * keep the checkpoint's global batch over this rank count. */
int ckpt_ctl_resume(ckpt_ctl *c, model_t *m, const char *resume, int64_t micro_batch,
                    int64_t *grad_accum, train_progress *p, int *resumed, sp_err *err);
/* Collective, after every optimizer step. final: the last step. Sets *stop
 * when a stop signal was agreed and the checkpoint is committed (1), or, the
 * same way, when the remote store, which the start could not list, holds a
 * checkpoint newer than this job's step (2; ckpt_ctl_newer_in_store says
 * which, on rank 0): a restart resumes that one. */
int ckpt_ctl_boundary(ckpt_ctl *c, model_t *m, const train_progress *p, int final, int *stop,
                      sp_err *err);
int64_t ckpt_ctl_newer_in_store(const ckpt_ctl *c);
/* Checkpoints the remote store has not received yet (-1: no remote). */
int ckpt_ctl_remote_behind(ckpt_ctl *c);
/* Waits for the writer and, up to checkpoint.final_upload_timeout_s, the
 * uploads (wait_uploads), then frees everything. NULL is a no-op. */
int ckpt_ctl_close(ckpt_ctl *c, int wait_uploads, sp_err *err);

#endif
