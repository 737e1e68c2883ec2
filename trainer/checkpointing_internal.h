/* trainer/checkpointing_internal.h — what the files of the checkpoint
 * controller share (checkpointing.c: open, close and the step boundary;
 * ckpt_state.c: the model's trainable state to and from a snapshot;
 * ckpt_remote.c: the object store, its lease and uploads; ckpt_resume.c:
 * choosing and restoring a checkpoint). Not for other modules. */
#ifndef SPOTUNE_CHECKPOINTING_INTERNAL_H
#define SPOTUNE_CHECKPOINTING_INTERNAL_H

#include <pthread.h>

#include "../checkpoint/ckpt.h"
#include "../checkpoint/ckpt_writer.h"
#include "../checkpoint/lease.h"
#include "../checkpoint/store.h"
#include "../checkpoint/uploader.h"
#include "checkpointing.h"

struct ckpt_ctl {
    const config_t *cfg;
    comm_t *comm;
    int rank, world;
    FILE *log;
    metrics_t *metrics;
    char *root; /* RUN_DIR/checkpoints */
    char base_identity[17], config_hash[17];
    ckpt_writer *writer;
    store_t *store;
    uploader_t *up;
    store_t *lease_store; /* the lease's own handle, with short retries */
    lease_t *lease;
    pthread_mutex_t remote_mu; /* the fields below, set on the uploader thread */
    int64_t remote_step;       /* newest step known complete remotely (-1: none) */
    int remote_refused;        /* the store refused a push for good (see on_upload) */
    double upload_s, upload_mb_s; /* the last push: seconds, MB/s (0: none yet) */
    int upload_slow_said;      /* a push took longer than checkpoint.upload_deadline_s */
    double last_time;
    int64_t last_step;
    int64_t global_batch; /* windows per step: this run's, after any resume re-split */
    int fresh_metrics; /* the run directory had no metrics yet (a new machine) */
};

/* ckpt_state.c. Rank 0: the snapshot of the run's state (its attributes,
 * the metrics so far and, unsharded, the trainable arrays). Every rank, with
 * the optimizer sharded: rank 0 gathers the shards into s (NULL elsewhere);
 * code is rank 0's result so far. Every rank: the trainable state from rank
 * 0's snapshot s (NULL elsewhere). */
int ckpt_state_snapshot(ckpt_ctl *c, model_t *m, const train_progress *p, ckpt_snapshot *s,
                        sp_err *err);
int ckpt_state_gather(ckpt_ctl *c, model_t *m, ckpt_snapshot *s, int32_t code, sp_err *err);
int ckpt_state_restore(ckpt_ctl *c, model_t *m, const ckpt_snapshot *s, sp_err *err);

/* ckpt_remote.c, rank 0. quick: the store options for what decides whether
 * and where the job starts. */
void ckpt_remote_opts(const config_t *cfg, int quick, store_opts *so);
/* The store, the job's lease (the probe that it takes writes) and the uploader. */
int ckpt_remote_open(ckpt_ctl *c, sp_err *err);
/* A finished run: its final checkpoint is in the store, or an error says why not. */
int ckpt_remote_final_pushed(ckpt_ctl *c, sp_err *err);
/* The newest remote checkpoint newer than local_step that verifies, pulled
 * into the local root (*path, a heap string; NULL when none). A store that
 * cannot be listed is a warning: the local checkpoints are used. */
int ckpt_remote_find(ckpt_ctl *c, int64_t local_step, char **path, sp_err *err);
/* Downloads st's step `name` into the local root and verifies it (*path: a
 * heap string; NULL on failure); *corrupt (may be NULL): it downloaded but
 * does not match its MANIFEST. */
int ckpt_remote_pull(ckpt_ctl *c, store_t *st, const char *name, char **path, int *corrupt,
                     sp_err *err);
/* Queues a push of a local checkpoint newer than the store's newest. */
void ckpt_remote_push_if_missing(ckpt_ctl *c, const char *path, int64_t step);
/* At start: warns when, at the upload rate the run last measured (its
 * metrics.jsonl), a checkpoint of state_bytes cannot reach the store within
 * checkpoint.upload_deadline_s. */
void ckpt_remote_budget_check(ckpt_ctl *c, uint64_t state_bytes);

#endif
