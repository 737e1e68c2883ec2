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
    char data_identity[17]; /* data.train's (dataset_identity) */
    int skipped_local;      /* --resume auto: local checkpoints found unusable */
    int refused;            /* ... and checkpoints set aside, their contents refused */
    int refused_partly;     /* ... one of them after part of it was restored */
    ckpt_writer *writer;
    store_t *store;
    uploader_t *up;
    store_t *lease_store; /* the lease's own handle, with short retries */
    lease_t *lease;
    /* sharded, with a lease: the job's id (rank 0's lease), and the other
     * ranks' handle (short retries) for reading the lease before each put */
    char lease_job[17];
    store_t *gate_store;
    pthread_mutex_t remote_mu; /* the fields below, set on the uploader thread */
    int64_t remote_step;       /* newest step known complete remotely (-1: none) */
    int remote_refused;        /* the store refused a push for good (see on_upload) */
    double upload_s, upload_mb_s; /* the last push: seconds, MB/s (0: none yet) */
    int upload_slow_said;      /* a push took longer than checkpoint.upload_deadline_s */
    double last_time;
    int64_t last_step;
    /* last_step is the checkpoint this job resumed from, read from the store
     * in ranges and not kept here: it is complete there, not in root */
    int last_only_in_store;
    int64_t global_batch; /* windows per step: this run's, after any resume re-split */
    int fresh_metrics; /* the run directory had no metrics yet (a new machine) */
    /* rank 0, resuming: the store whose shards the checkpoint just pulled
     * left there for every rank's ranged reads (NULL: pulled whole); remote
     * checkpoints from remote_skip_from on are not chosen (found damaged),
     * nor from remote_refused_from on (their contents refused: nothing of
     * them was restored); chosen_remote: --resume auto took one from the store */
    char *ranged_url;
    int64_t remote_skip_from, remote_refused_from;
    int chosen_remote;
    /* the start could not list the store: rank 0 lists it once it answers
     * (ckpt_remote_newer); newer_in_store: the step found there, newer than
     * this job's, that stopped it (-1: none) */
    int list_pending;
    double list_next, list_wait;
    int64_t newer_in_store;
    int store_needed; /* a local checkpoint was passed over for want of the store */
    /* sharded checkpoints (checkpoint.layout; ckpt_shards.c): every rank has
     * a writer for its shard; a checkpoint's shards are pending until every
     * rank's is written, then rank 0 commits it (state.h5, MANIFEST) */
    int sharded;
    /* spread: the machines do not share run.dir (ckpt_shards_setup); each
     * rank writes its shard on its own machine and puts it in the store,
     * rank 0's machine keeps its ranks' shards with MANIFEST, the others
     * keep nothing once their shards are in the store. fs_first: the lowest
     * rank that shares this rank's run.dir; store_only (rank 0): per rank,
     * whether its shard is written off rank 0's machine */
    int spread, fs_first;
    int32_t *store_only;
    int pid0;             /* rank 0's process id: names the .tmp- directory */
    int64_t pending_step; /* -1: none */
    char *pending_dir;
    ckpt_snapshot pending; /* rank 0: the attributes and metrics of the pending one */
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

/* ckpt_shards.c, every rank. Whether this run writes sharded checkpoints
 * (its optimizer is sharded and checkpoint.layout allows it: c->sharded),
 * and where (c->spread: machines that do not share run.dir, with a remote
 * store; without one, auto means gathered and sharded is refused). */
int ckpt_shards_setup(ckpt_ctl *c, sp_err *err);
/* Spread, the first rank of a machine other than rank 0's: removes the
 * .tmp- directories an earlier run left there (nothing is pending at start). */
void ckpt_shards_clean_away(ckpt_ctl *c);
/* A sharded checkpoint of step p->step: rank 0 prepares its directory and
 * state, every rank copies its shard to host memory (*stall_s: the longest
 * copy of any rank; *bytes: all shards) and hands it to its writer. When
 * rank 0 cannot prepare it (a full disk) it says so and *bytes is -1: the
 * checkpoint is skipped and training goes on. */
int ckpt_shards_write(ckpt_ctl *c, model_t *m, const train_progress *p, double *stall_s,
                      double *bytes, sp_err *err);
/* Whether every rank's shard of the pending checkpoint is written (wait:
 * until it is); when so, rank 0 commits it on its writer (or, when a shard
 * failed, says so and removes it). Nothing pending: 0. */
int ckpt_shards_complete(ckpt_ctl *c, int wait, sp_err *err);
/* Every rank: the trainable state from the sharded checkpoint dir, each rank
 * reading only the ranges it keeps (or, when some rank cannot see dir,
 * rank 0 reading and broadcasting). */
int ckpt_shards_restore(ckpt_ctl *c, model_t *m, const char *dir, sp_err *err);
/* Every rank: the same from checkpoint `name` of the store at url, read in
 * ranges (each block checked) by every rank; local_dir is rank 0's copy of
 * its MANIFEST and state (ckpt_pull_unsharded). With local_copy, a rank
 * reads the shard files local_dir holds on its machine from there (a
 * checkpoint written across machines: rank 0's machine keeps its ranks'
 * shards). *damaged: a block in the store did not match its checksum on
 * some rank (every rank learns it). */
int ckpt_shards_restore_store(ckpt_ctl *c, model_t *m, const char *url, const char *name,
                              const char *local_dir, int local_copy, int *damaged, sp_err *err);

/* ckpt_remote.c, rank 0. quick: the store options for what decides whether
 * and where the job starts. */
/* Rank 0: moves every step-* directory of root (the checkpoints --resume
 * auto found unusable), or only the one named `only`, into
 * run.dir/previous-<UTC>/checkpoints/; *note says what moved where. */
int ckpt_move_unusable_aside(const config_t *cfg, const char *root, const char *only,
                             char *note, size_t n, sp_err *err);
void ckpt_remote_opts(const config_t *cfg, int quick, store_opts *so);
/* The store, the job's lease (the probe that it takes writes) and the uploader. */
int ckpt_remote_open(ckpt_ctl *c, sp_err *err);
/* Every rank's shard puts (ckpt_writer_set_gate, arg c): only into a prefix
 * this job holds. Rank 0 asks its lease; the others read the store's. */
int ckpt_remote_may_put(void *arg, sp_err *why);
/* A finished run: its final checkpoint is in the store, or an error says why not. */
int ckpt_remote_final_pushed(ckpt_ctl *c, sp_err *err);
/* The newest remote checkpoint newer than local_step that verifies, pulled
 * into the local root (*path, a heap string; NULL when none). A store that
 * cannot be listed is a warning: the local checkpoints are used. */
int ckpt_remote_find(ckpt_ctl *c, int64_t local_step, char **path, sp_err *err);
/* Retires checkpoint name (step-N) in the store: its MANIFEST deleted, its
 * files kept. It no longer exists by the protocol, so no reader takes it,
 * and this run may push that step again. */
int ckpt_remote_retire(ckpt_ctl *c, const char *name, sp_err *err);
/* Rank 0, at a step boundary of a job whose start could not list the store
 * (list_pending): once the store answers (this job's lease written, or
 * without a lease a push done), lists it once (after a failed try again
 * 10 s later, then 20, ... up to 320); the step of its newest checkpoint
 * when that is newer than step, else -1. */
int64_t ckpt_remote_newer(ckpt_ctl *c, int64_t step);
/* Downloads st's step `name` into the local root and verifies it (*path: a
 * heap string; NULL on failure); *corrupt (may be NULL): it downloaded but
 * does not match its MANIFEST. A sharded checkpoint with block checksums is
 * pulled without its shards into ROOT/.remote-step-N, and c->ranged_url
 * names the store that keeps them. */
int ckpt_remote_pull(ckpt_ctl *c, store_t *st, const char *name, char **path, int *corrupt,
                     sp_err *err);
/* Queues a push of a local checkpoint newer than the store's newest. */
void ckpt_remote_push_if_missing(ckpt_ctl *c, const char *path, int64_t step);
/* At start: warns when, at the upload rate the run last measured (its
 * metrics.jsonl), a checkpoint of state_bytes cannot reach the store within
 * checkpoint.upload_deadline_s. */
void ckpt_remote_budget_check(ckpt_ctl *c, uint64_t state_bytes);

#endif
