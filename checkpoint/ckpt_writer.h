/* checkpoint/ckpt_writer.h — the background checkpoint writer: one thread
 * that takes a host snapshot and writes and commits it (ckpt_write), so the
 * step loop only pays for copying its state to host memory. One write at a
 * time: a submit while the previous write is still running waits for it
 * (and says how long). Owns the thread and the snapshot being written. */
#ifndef SPOTUNE_CKPT_WRITER_H
#define SPOTUNE_CKPT_WRITER_H

#include "checkpoint/ckpt.h"
#include "checkpoint/store.h"

typedef struct ckpt_writer ckpt_writer;

/* Called on the writer thread after each write: dir is the committed
 * checkpoint (NULL on failure, with err set). */
typedef void (*ckpt_written_fn)(void *ctx, const char *dir, const ckpt_snapshot *s,
                                double write_s, const sp_err *err);

int ckpt_writer_start(ckpt_writer **out, const char *root, ckpt_written_fn done, void *ctx,
                      sp_err *err);
/* Moves *s to the thread (*s is left empty). Waits first while a previous
 * write runs; *waited_s (may be NULL) receives the wait. */
int ckpt_writer_submit(ckpt_writer *w, ckpt_snapshot *s, double *waited_s, sp_err *err);
/* Sharded checkpoints: moves *sh to the thread, which writes it into dir
 * (the checkpoint's .tmp- directory, which exists) as this rank's shard file
 * (ckpt_shard_write); no callback. Waits first while a previous write runs. */
int ckpt_writer_submit_shard(ckpt_writer *w, const char *dir, ckpt_shard *sh, double *waited_s,
                             sp_err *err);
/* With a remote store: after writing its shard the writer puts it at
 * step-NNNNNNNN/<shard file> in st, which it owns from here (closed with the
 * writer), unless that step's MANIFEST.json is there already (a complete
 * checkpoint is never overwritten). A failed put is tried again, with
 * pauses, for put_deadline_s (rank 0 waits that long for the shard before
 * pushing MANIFEST.json); the last failure is printed on stderr. */
void ckpt_writer_set_store(ckpt_writer *w, store_t *st, double put_deadline_s);
/* Asked (from the writer's thread) before each try of a shard's put: 1 go;
 * 0 not yet, why saying what is waited for: the try counts as failed (tried
 * again, with pauses, until put_deadline_s, then kept); -1 never: the put
 * fails for good at once, naming why. The job's lease: only into a prefix
 * this job holds. NULL: every put may go. */
typedef int (*ckpt_may_put_fn)(void *arg, sp_err *why);
void ckpt_writer_set_gate(ckpt_writer *w, ckpt_may_put_fn may_put, void *arg);
/* drop: once its upload is done (or the write failed) the shard file is
 * removed, and the directory with it once empty; a shard whose upload
 * failed for good stays (the store does not hold it) until a newer shard of
 * this rank is written, put or kept in its turn: one kept shard at most, so
 * a long store outage does not fill the disk. For the ranks of a
 * machine other than rank 0's that does not share run.dir: there the store
 * is the only copy a resume reads, and the disk keeps nothing. */
void ckpt_writer_drop_shards(ckpt_writer *w, int drop);
/* The run's end: when this rank's shard of step is the last whose put failed
 * for good (kept on disk), its put is tried again, with pauses, for up to
 * deadline_s (rank 0 waits for it as long: checkpoint.final_upload_timeout_s),
 * and with drop set the file is removed once the store holds it. 0 when the
 * store holds it now or nothing of step was kept; else err names the shard. */
int ckpt_writer_put_kept(ckpt_writer *w, int64_t step, double deadline_s, sp_err *err);
/* Waits until no shard write is queued or being written (its upload may
 * still run). */
int ckpt_writer_wait_written(ckpt_writer *w);
/* Without waiting: *busy while a write runs (a shard being uploaded counts
 * as written); else the last write's result
 * (its error, or 0 and, for a shard, *info). */
int ckpt_writer_shard_result(ckpt_writer *w, int *busy, ckpt_shard_info *info, sp_err *err);
/* Waits until idle; returns the error of the last write (0 if it succeeded). */
int ckpt_writer_wait(ckpt_writer *w, sp_err *err);
/* Waits for the write in progress, then stops the thread. NULL is a no-op. */
void ckpt_writer_stop(ckpt_writer *w);

#endif
