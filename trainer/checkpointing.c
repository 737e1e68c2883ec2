/* The checkpoint controller: opening and closing it, and the step boundary
 * (when to checkpoint, the snapshot handed to the background writer, the
 * stop on a signal). Its other parts: ckpt_state.c, ckpt_remote.c,
 * ckpt_resume.c (checkpointing_internal.h). */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <limits.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <jansson.h>

#include "checkpointing_internal.h"
#include "signals.h"

/* ---- logging from any thread (stdio locks each call) ------------------------- */

/* ---- logging from any thread (stdio locks each call) ------------------------- */

static void on_written(void *ctx, const char *dir, const ckpt_snapshot *s, double write_s,
                       const sp_err *err)
{
    ckpt_ctl *c = ctx;
    if (!dir) { /* the end or a stop waits for this write and fails with it */
        log_event(c->log, c->metrics, "warning",
                  "checkpoint step %lld was not written: %s; training goes on and the next "
                  "checkpoint tries again",
                  (long long)s->step, err->msg);
        return;
    }
    log_event(c->log, c->metrics, "checkpoint_committed",
              "step %lld committed to %s (%.1f MiB, written in %.2f s)", (long long)s->step, dir,
              (double)s->bytes / 1048576.0, write_s);
    sp_err perr = {0};
    if (ckpt_prune(c->root, (int)c->cfg->ckpt_keep, c->cfg->ckpt_keep_every, NULL, NULL, &perr))
        log_event(c->log, c->metrics, "warning", "retention: %s", perr.msg);
    pthread_mutex_lock(&c->remote_mu);
    int refused = c->remote_refused;
    pthread_mutex_unlock(&c->remote_mu);
    if (c->up && !refused && !lease_lost(c->lease, NULL)) {
        sp_err uerr = {0};
        const char *name = strrchr(dir, '/') + 1;
        /* sharded: each rank puts its own shard; MANIFEST.json waits for them */
        double wait = c->cfg->ckpt_upload_deadline_s > 1 ? c->cfg->ckpt_upload_deadline_s : 1;
        int dropped = s->nshards ? uploader_submit_sharded(c->up, dir, name, wait, &uerr)
                                 : uploader_submit(c->up, dir, name, &uerr);
        if (dropped < 0)
            log_event(c->log, c->metrics, "warning", "upload of %s not queued: %s", name,
                      uerr.msg);
        else if (dropped > 0)
            log_event(c->log, c->metrics, "warning",
                      "the remote store is behind: %d older checkpoint(s) will not be pushed "
                      "(superseded by %s)",
                      dropped, name);
    }
}

/* ---- open / close ------------------------------------------------------------------ */

/* The newest step of checkpoint.remote with a MANIFEST (-1: none); a store
 * that cannot be listed is an error. */
static int remote_newest(const config_t *cfg, int64_t *newest, sp_err *err)
{
    store_opts quick;
    ckpt_remote_opts(cfg, 1, &quick);
    store_t *st = NULL;
    store_listing l = {0};
    *newest = -1;
    if (store_open(&st, cfg->ckpt_remote, &quick, err) || store_list(st, "step-", &l, err)) {
        store_close(st);
        return err->code;
    }
    for (size_t i = 0; i < l.n; i++) {
        long long step;
        if (sscanf(l.items[i].key, "step-%lld/", &step) == 1 &&
            strstr(l.items[i].key, "/" CKPT_MANIFEST) && step > *newest)
            *newest = step;
    }
    store_list_free(&l);
    store_close(st);
    return 0;
}

/* Makes run_dir/previous-YYYYmmddTHHMMSSZ (the time now) and returns its
 * path (heap), or NULL with err set. */
static char *previous_dir(const char *run_dir, sp_err *err)
{
    char stamp[32];
    time_t now = time(NULL);
    struct tm tm;
    gmtime_r(&now, &tm);
    strftime(stamp, sizeof stamp, "%Y%m%dT%H%M%SZ", &tm);
    char *prev = sp_strf("%s/previous-%s", run_dir, stamp);
    if (!prev) {
        sp_fail(err, SP_EXIT_OTHER, "out of memory");
        return NULL;
    }
    if (mkdir(prev, 0755) != 0 && errno != EEXIST) {
        sp_fail(err, SP_EXIT_OTHER, "%s: cannot create: %s", prev, strerror(errno));
        free(prev);
        return NULL;
    }
    return prev;
}

int ckpt_move_unusable_aside(const config_t *cfg, const char *root, const char *only,
                             char *note, size_t n, sp_err *err)
{
    note[0] = 0;
    char *prev = previous_dir(cfg->run_dir, err);
    char *to_root = prev ? sp_strf("%s/checkpoints", prev) : NULL;
    int rc = err->code;
    if (!rc && (!to_root || (mkdir(to_root, 0755) != 0 && errno != EEXIST)))
        rc = sp_fail(err, SP_EXIT_OTHER, "%s: cannot create", to_root ? to_root : prev);
    int moved = 0;
    DIR *d = rc ? NULL : opendir(root);
    for (struct dirent *e; d && !rc && (e = readdir(d));) {
        if (strncmp(e->d_name, "step-", 5) != 0 || (only && strcmp(e->d_name, only) != 0))
            continue;
        char *from = sp_strf("%s/%s", root, e->d_name), *to = sp_strf("%s/%s", to_root, e->d_name);
        if (!from || !to)
            rc = sp_fail(err, SP_EXIT_OTHER, "out of memory");
        else if (rename(from, to) != 0)
            rc = sp_fail(err, SP_EXIT_OTHER, "cannot move %s to %s: %s", from, to,
                         strerror(errno));
        else
            moved++;
        free(from);
        free(to);
    }
    if (d)
        closedir(d);
    if (!rc && only)
        snprintf(note, n, "moved to %s/%s (kept for inspection)", to_root, only);
    else if (!rc)
        snprintf(note, n,
                 "the %d unusable checkpoint%s moved to %s (kept for inspection; left in place, "
                 "retention would delete this run's new checkpoints in their favour)",
                 moved, moved == 1 ? "" : "s", to_root);
    free(to_root);
    free(prev);
    return rc;
}

int ckpt_start_afresh(const config_t *cfg, char *note, size_t n, sp_err *err)
{
    note[0] = 0;
    if (cfg->ckpt_remote && *cfg->ckpt_remote) {
        int64_t newest;
        if (remote_newest(cfg, &newest, err))
            return sp_fail(err, err->code,
                           "--resume none: cannot tell whether checkpoint.remote holds an earlier "
                           "run's checkpoints: %s",
                           err->msg);
        if (newest >= 0)
            return sp_fail(err, SP_EXIT_USAGE,
                           "--resume none: checkpoint.remote %s holds checkpoints of an earlier "
                           "run (newest step %lld); a fresh start there would be mixed with "
                           "them (retention and the next resume would take theirs). Set "
                           "checkpoint.remote (and run.dir) to a new prefix, or delete those "
                           "checkpoints first",
                           cfg->ckpt_remote, (long long)newest);
    }
    char *root = sp_strf("%s/checkpoints", cfg->run_dir);
    if (!root)
        return sp_fail(err, SP_EXIT_OTHER, "out of memory");
    int found = 0;
    char newest[PATH_MAX] = "";
    DIR *d = opendir(root);
    for (struct dirent *e; d && (e = readdir(d));)
        if (strncmp(e->d_name, "step-", 5) == 0) {
            found++;
            if (strcmp(e->d_name, newest) > 0) /* fixed-width step numbers sort as text */
                snprintf(newest, sizeof newest, "%s", e->d_name);
        }
    if (d)
        closedir(d);
    if (!found) {
        free(root);
        return 0;
    }
    char *prev = previous_dir(cfg->run_dir, err);
    int rc = err->code;
    static const char *const moved[] = {"checkpoints", "metrics.jsonl", "samples"};
    for (int i = 0; i < 3 && !rc; i++) {
        char *from = sp_strf("%s/%s", cfg->run_dir, moved[i]);
        char *to = sp_strf("%s/%s", prev, moved[i]);
        if (!from || !to)
            rc = sp_fail(err, SP_EXIT_OTHER, "out of memory");
        else if (rename(from, to) != 0 && errno != ENOENT)
            rc = sp_fail(err, SP_EXIT_OTHER, "--resume none: cannot move %s to %s: %s", from, to,
                         strerror(errno));
        free(from);
        free(to);
    }
    if (!rc)
        snprintf(note, n,
                 "--resume none: run.dir held an earlier run's %d checkpoint%s (newest %s); "
                 "they, its metrics.jsonl and samples are kept in %s, and this run starts "
                 "afresh",
                 found, found == 1 ? "" : "s", newest, prev);
    free(prev);
    free(root);
    return rc;
}

int ckpt_ctl_open(ckpt_ctl **out, const config_t *cfg, comm_t *comm, const char *base_identity,
                  const char *data_identity, FILE *log, metrics_t *metrics, sp_err *err)
{
    ckpt_ctl *c = calloc(1, sizeof *c);
    if (!c)
        return sp_fail(err, SP_EXIT_OTHER, "out of memory");
    c->cfg = cfg;
    c->comm = comm;
    c->rank = comm_rank(comm);
    c->world = comm_size(comm);
    c->log = log;
    c->metrics = metrics;
    c->last_time = sp_now();
    c->last_step = -1;
    c->remote_step = -1;
    c->remote_skip_from = INT64_MAX;
    c->remote_refused_from = INT64_MAX;
    c->newer_in_store = -1;
    c->pending_step = -1;
    c->pid0 = (int)getpid();
    pthread_mutex_init(&c->remote_mu, NULL);
    c->global_batch = (int64_t)c->world * cfg->micro_batch * cfg->grad_accum;
    c->root = sp_strf("%s/checkpoints", cfg->run_dir);
    char *mpath = sp_strf("%s/metrics.jsonl", cfg->run_dir);
    if (!c->root || !mpath) {
        free(mpath);
        free(c->root);
        pthread_mutex_destroy(&c->remote_mu);
        free(c);
        return sp_fail(err, SP_EXIT_OTHER, "out of memory");
    }
    struct stat msb; /* as the file was before this process wrote to it */
    c->fresh_metrics = metrics && metrics->f ? metrics->fresh
                                             : stat(mpath, &msb) != 0 || msb.st_size == 0;
    free(mpath);
    snprintf(c->base_identity, sizeof c->base_identity, "%s", base_identity);
    snprintf(c->data_identity, sizeof c->data_identity, "%s", data_identity);
    snprintf(c->config_hash, sizeof c->config_hash, "%016llx",
             (unsigned long long)config_math_hash(cfg));
    *out = c;
    int rc = 0;
    if (ckpt_shards_setup(c, err))
        return err->code;
    if (c->sharded && comm_bcast(comm, &c->pid0, sizeof c->pid0, 0, err))
        return err->code;
    if (c->rank == 0 && cfg->mode == MODE_FULL && cfg->shard_optimizer && c->world > 1 &&
        cfg->ckpt_layout != CKPT_LAYOUT_GATHERED && comm_local_size(comm) != c->world)
        log_event(log, metrics, "info", "%s",
                  c->spread ? "checkpoints are sharded across machines that do not share "
                              "run.dir: every rank writes its shard on its own machine and "
                              "puts it in checkpoint.remote, which holds each checkpoint "
                              "whole; rank 0's machine keeps its own ranks' shards"
                  : c->sharded ? "checkpoints are sharded: every rank, on every machine, sees "
                                 "run.dir (a shared file system)"
                               : "checkpoints are gathered to rank 0: some machine does not see "
                                 "run.dir (no shared file system) and there is no "
                                 "checkpoint.remote to hold the shards of the other machines");
    ckpt_shards_clean_away(c);
    if (c->rank == 0) {
        if (mkdir(c->root, 0755) != 0 && errno != EEXIST)
            rc = sp_fail(err, SP_EXIT_OTHER, "%s: cannot create: %s", c->root, strerror(errno));
        if (!rc)
            rc = ckpt_writer_start(&c->writer, c->root, on_written, c, err);
        if (!rc && cfg->ckpt_remote && *cfg->ckpt_remote)
            rc = ckpt_remote_open(c, err);
    } else if (c->sharded) { /* every rank writes its own shard */
        rc = ckpt_writer_start(&c->writer, c->root, NULL, NULL, err);
    }
    /* ... and puts it in the remote store itself, in parallel with the others */
    if (!rc && c->sharded && cfg->ckpt_remote && *cfg->ckpt_remote) {
        store_opts so;
        store_t *st = NULL;
        ckpt_remote_opts(cfg, 0, &so);
        if (store_open(&st, cfg->ckpt_remote, &so, err) == 0) {
            ckpt_writer_set_store(c->writer, st,
                                  cfg->ckpt_upload_deadline_s > 1 ? cfg->ckpt_upload_deadline_s
                                                                  : 1);
            ckpt_writer_drop_shards(c->writer, c->spread && c->fs_first != 0);
        }
        else
            rc = err->code ? err->code : SP_EXIT_USAGE;
        if (!rc && c->rank != 0 && cfg->ckpt_lease_s > 0) {
            ckpt_remote_opts(cfg, 1, &so);
            if (store_open(&c->gate_store, cfg->ckpt_remote, &so, err))
                rc = err->code ? err->code : SP_EXIT_USAGE;
        }
    }
    /* every rank learns whether rank 0 could open its side */
    int32_t code = rc;
    if (comm_allreduce(comm, &code, 1, COMM_I32, COMM_MAX, err))
        return err->code;
    if (code && !rc)
        return sp_fail(err, code, "rank 0 could not set up checkpointing");
    if (rc)
        return rc;
    /* a rank's shard goes only into a prefix this job holds (a store that did
     * not answer at start may hold another live job's checkpoints there):
     * rank 0 gives out the job's id, the others find it in the store's lease */
    if (c->sharded && cfg->ckpt_remote && *cfg->ckpt_remote && cfg->ckpt_lease_s > 0) {
        if (c->rank == 0)
            snprintf(c->lease_job, sizeof c->lease_job, "%s", lease_job(c->lease));
        if (comm_bcast(comm, c->lease_job, sizeof c->lease_job, 0, err))
            return err->code;
        ckpt_writer_set_gate(c->writer, ckpt_remote_may_put, c);
    }
    return 0;
}

int ckpt_ctl_remote_behind(ckpt_ctl *c)
{
    return c && c->up ? uploader_pending(c->up) : -1;
}

/* Sharded: the last checkpoint exists only if every rank wrote its shard
 * (rank 0's writer alone does not know). One this job only resumed from,
 * read from the store in ranges (a restart after the final step, on a new
 * machine), is complete there and was never written here. */
static int last_committed(ckpt_ctl *c, sp_err *err)
{
    if (c->last_only_in_store)
        return 0;
    char name[32];
    ckpt_dir_name(name, sizeof name, c->last_step);
    char *m = sp_strf("%s/%s/%s", c->root, name, CKPT_MANIFEST);
    struct stat sb;
    int ok = m && stat(m, &sb) == 0;
    free(m);
    if (ok)
        return 0;
    return sp_fail(err, SP_EXIT_OTHER,
                   "checkpoint step %lld is not complete (a rank could not write its shard; the "
                   "log says why)",
                   (long long)c->last_step);
}

int ckpt_ctl_close(ckpt_ctl *c, int wait_uploads, sp_err *err)
{
    if (!c)
        return 0;
    int rc = 0;
    if (c->writer) {
        rc = ckpt_writer_wait(c->writer, err);
        /* a rank's last shard whose put failed: tried again while rank 0's
         * push waits for it (a machine that drops its shards holds the only
         * copy, and rank 0 cannot put it) */
        if (!rc && wait_uploads && c->sharded && c->rank != 0 && c->last_step >= 0) {
            sp_err perr = {0};
            ckpt_writer_put_kept(c->writer, c->last_step, c->cfg->ckpt_final_upload_timeout_s,
                                 &perr);
        }
        ckpt_writer_stop(c->writer);
        if (!rc && wait_uploads && c->sharded && c->rank == 0 && c->last_step >= 0)
            rc = last_committed(c, err);
        /* a sharded checkpoint never completed (an error ended the run) stays
         * a .tmp- directory without MANIFEST, removed at the next start */
        free(c->pending_dir);
        ckpt_snapshot_free(&c->pending);
        if (c->rank != 0)
            rc = 0; /* rank 0 reports what matters: whether the checkpoint is committed */
        if (rc && wait_uploads)
            sp_err_prefix(err, "training finished, but its last checkpoint was not written: ");
    }
    if (c->up) {
        if (wait_uploads && uploader_pending(c->up) > 0) {
            log_event(c->log, c->metrics, "info", "waiting up to %.0f s for %d upload(s) to %s",
                      c->cfg->ckpt_final_upload_timeout_s, uploader_pending(c->up),
                      store_url(c->store));
            if (!uploader_wait(c->up, c->cfg->ckpt_final_upload_timeout_s))
                log_event(c->log, c->metrics, "warning",
                          "the remote store is %d checkpoint(s) behind; the local checkpoints in "
                          "%s are complete",
                          uploader_pending(c->up), c->root);
        }
        if (!rc && wait_uploads)
            rc = ckpt_remote_final_pushed(c, err);
        uploader_stop(c->up);
    }
    /* the other ranks wait while rank 0 pushes the last checkpoint (minutes
     * for a large state): their collectives' timeout must not end the job */
    if (wait_uploads && c->world > 1) {
        double saved = comm_timeout(c->comm);
        sp_err berr = {0};
        comm_set_timeout(c->comm, saved + c->cfg->ckpt_final_upload_timeout_s + 600.0);
        if (comm_barrier(c->comm, &berr) && !rc)
            rc = sp_fail(err, berr.code, "%s", berr.msg);
        comm_set_timeout(c->comm, saved);
    }
    lease_release(c->lease);
    if (c->store)
        store_close(c->store);
    if (c->lease_store)
        store_close(c->lease_store);
    if (c->gate_store)
        store_close(c->gate_store);
    pthread_mutex_destroy(&c->remote_mu);
    free(c->ranged_url);
    free(c->store_only);
    free(c->root);
    free(c);
    return rc;
}

/* ---- the step boundary ----------------------------------------------------------------- */

static int write_now(ckpt_ctl *c, model_t *m, const train_progress *p, const char *reason,
                     sp_err *err)
{
    int sharded = m->shard_count > 1;
    if (c->rank != 0 && !sharded)
        return 0;
    double t0 = sp_now(), waited = 0, stall = 0, bytes = 0;
    ckpt_snapshot s;
    if (sharded && c->sharded && m->shard_count == c->world) {
        if (ckpt_shards_write(c, m, p, &stall, &bytes, err))
            return err->code;
        if (c->rank != 0 || bytes < 0) /* bytes < 0: skipped (rank 0 said why) */
            return 0;
    } else {
        if (c->rank != 0) /* send this rank's shard of the optimizer state to rank 0 */
            return ckpt_state_gather(c, m, NULL, 0, err);
        int32_t code = ckpt_state_snapshot(c, m, p, &s, err);
        if (sharded && ckpt_state_gather(c, m, code ? NULL : &s, code, err)) {
            if (!code)
                ckpt_snapshot_free(&s);
            return err->code;
        }
        if (code)
            return code;
        bytes = (double)s.bytes;
        if (ckpt_writer_submit(c->writer, &s, &waited, err))
            return err->code;
        stall = sp_now() - t0;
    }
    if (c->metrics && c->metrics->f) {
        /* the stall is what a user tunes cadence by: its own record */
        fprintf(c->metrics->f,
                "{\"event\":\"checkpoint\",\"step\":%lld,\"reason\":\"%s\",\"stall_s\":%.6f,"
                "\"waited_for_previous_s\":%.6f,\"bytes\":%.0f,\"sharded\":%s,\"time\":%.3f}\n",
                (long long)p->step, reason, stall, waited, bytes,
                sharded && c->sharded ? "true" : "false", sp_wall_time());
        fflush(c->metrics->f);
    }
    if (c->log)
        fprintf(c->log,
                "checkpoint step %lld (%s): training held %.3f s (snapshot %.1f MiB%s%s); "
                "writing in the background\n",
                (long long)p->step, reason, stall, bytes / 1048576.0,
                sharded && c->sharded ? ", every rank its shard" : "",
                waited > 0.001 ? ", including a wait for the previous write" : "");
    if (c->log)
        fflush(c->log);
    return 0;
}

/* The times of a stop (sp_now()'s clock; -1: did not happen). */
typedef struct stop_budget {
    double t_signal, t_commit, t_remote;
} stop_budget;

/* After a stop's checkpoint (collective): how long from the signal to the
 * checkpoint committed and to it being in the store, and the bytes each
 * rank wrote, to the log and as a "preemption" record of metrics.jsonl —
 * what a cloud's notice (AWS 120 s, GCP and Azure about 30 s) must cover. */
static int log_stop_budget(ckpt_ctl *c, const train_progress *p, const stop_budget *b,
                           sp_err *err)
{
    char name[32];
    ckpt_dir_name(name, sizeof name, p->step);
    int64_t mine = 0, tree = 0;
    if (c->rank == 0) {
        char *dir = sp_strf("%s/%s", c->root, name);
        tree = dir ? (int64_t)ckpt_tree_bytes(dir) : 0;
        free(dir);
    }
    if (c->sharded) { /* each rank wrote (and put) its shard */
        int busy;
        ckpt_shard_info info;
        ckpt_writer_shard_result(c->writer, &busy, &info, &(sp_err){0});
        mine = (int64_t)info.size;
    } else {
        mine = tree;
    }
    int64_t *all = calloc((size_t)c->world, sizeof *all);
    if (!all)
        return sp_fail(err, SP_EXIT_OTHER, "out of memory");
    if (comm_allgather(c->comm, &mine, all, 1, COMM_I64, err)) {
        free(all);
        return err->code;
    }
    if (c->sharded && c->rank == 0) { /* rank 0 also wrote state.h5 and the metrics */
        int64_t others = 0;
        for (int r = 1; r < c->world; r++)
            others += all[r];
        all[0] = tree - others > all[0] ? tree - others : all[0];
    }
    if (c->rank == 0) {
        json_t *per = json_array();
        char list[256] = "";
        size_t used = 0;
        int64_t total = 0;
        for (int r = 0; r < c->world; r++) {
            json_array_append_new(per, json_integer(all[r]));
            total += all[r];
            if (used >= sizeof list || r > 8)
                continue; /* the first 8 ranks, then an ellipsis */
            if (r == 8)
                used += (size_t)snprintf(list + used, sizeof list - used, ", ...");
            else
                used += (size_t)snprintf(list + used, sizeof list - used, "%s%.1f",
                                         r ? ", " : "", (double)all[r] / 1048576.0);
        }
        double to_commit = b->t_commit - b->t_signal;
        double to_remote = b->t_remote >= 0 ? b->t_remote - b->t_signal : -1;
        char remote[160] = "";
        if (c->up && to_remote >= 0)
            snprintf(remote, sizeof remote, ", in the store %.2f s after", to_remote);
        else if (c->up)
            snprintf(remote, sizeof remote, ", not in the store within the deadline");
        json_t *f = json_pack("{s:s, s:I, s:f, s:o, s:o, s:I, s:f}", "signal",
                              signals_received() ? signals_first_name() : "another rank",
                              "step", (json_int_t)p->step, "to_commit_s", to_commit,
                              "to_remote_s", to_remote >= 0 ? json_real(to_remote) : json_null(),
                              "bytes_per_rank", per, "bytes", (json_int_t)total,
                              "upload_deadline_s", c->cfg->ckpt_upload_deadline_s);
        log_event_with(c->log, c->metrics, "preemption", f,
                       "checkpoint step %lld committed %.2f s after the signal%s; %.1f MiB "
                       "written (MiB per rank: %s)",
                       (long long)p->step, to_commit, remote, (double)total / 1048576.0, list);
    }
    free(all);
    return 0;
}

int64_t ckpt_ctl_newer_in_store(const ckpt_ctl *c)
{
    return c->newer_in_store;
}

int ckpt_ctl_boundary(ckpt_ctl *c, model_t *m, const train_progress *p, int final, int *stop,
                      sp_err *err)
{
    const config_t *cfg = c->cfg;
    *stop = 0;
    int32_t flags[4] = {signals_received() > 0, 0, 0, 0};
    double t_flags = sp_now();
    sp_err lost = {0};
    if (c->rank == 0 && cfg->ckpt_every_minutes > 0 &&
        sp_now() - c->last_time >= cfg->ckpt_every_minutes * 60.0)
        flags[1] = 1;
    if (c->rank == 0)
        flags[2] = lease_lost(c->lease, &lost);
    if (c->rank == 0 && !flags[2] && c->newer_in_store < 0 &&
        (c->newer_in_store = ckpt_remote_newer(c, p->step)) >= 0)
        flags[3] = 1;
    if (comm_allreduce(c->comm, flags, 4, COMM_I32, COMM_MAX, err))
        return err->code;
    /* the shards of a sharded checkpoint are all written: rank 0 commits it */
    if (ckpt_shards_complete(c, 0, err))
        return err->code;
    if (flags[2]) /* another job took the remote prefix over: this one ends */
        return c->rank == 0 ? sp_fail(err, SP_EXIT_USAGE, "%s; this job stops", lost.msg)
                            : sp_fail(err, SP_EXIT_USAGE, "rank 0 lost the remote prefix");
    int every = cfg->ckpt_every_steps > 0 && p->step % cfg->ckpt_every_steps == 0;
    /* flags[3]: the store, which the start could not list, holds a newer
     * checkpoint of this run: stop as on a signal, so that a restart resumes
     * it rather than this job train on from an older start */
    const char *reason = flags[0] ? "signal" : flags[3] ? "newer_in_store" : final ? "end"
                         : every ? "every_steps" : flags[1] ? "every_minutes" : NULL;
    if (!reason)
        return 0;
    if (p->step != c->last_step) {
        if (write_now(c, m, p, reason, err))
            return err->code;
        c->last_step = p->step;
        c->last_only_in_store = 0;
        c->last_time = sp_now();
    }
    /* at the end and on a stop the checkpoint is committed before anything else */
    if ((final || flags[0] || flags[3]) && ckpt_shards_complete(c, 1, err))
        return err->code;
    if (!flags[0] && !flags[3])
        return 0;
    /* stop: commit, push up to the deadline, and only then let every rank go */
    int32_t code = 0;
    stop_budget b = {.t_signal = signals_first_time(), .t_commit = -1, .t_remote = -1};
    if (b.t_signal < 0) /* the signal reached another rank: from when this one learnt it */
        b.t_signal = t_flags;
    if (c->rank == 0) {
        if (c->log && flags[0]) {
            fprintf(c->log, "stop requested (%s): committing checkpoint step %lld\n",
                    signals_received() ? signals_first_name() : "another rank",
                    (long long)p->step);
            fflush(c->log);
        } else if (c->log) {
            fprintf(c->log,
                    "stop: %s holds checkpoint step %lld, newer than this job's step %lld (it "
                    "could not be listed when the job started): committing checkpoint step "
                    "%lld\n",
                    store_url(c->store), (long long)c->newer_in_store, (long long)p->step,
                    (long long)p->step);
            fflush(c->log);
        }
        code = ckpt_writer_wait(c->writer, err);
        if (!code && c->sharded)
            code = last_committed(c, err);
        b.t_commit = sp_now();
        if (!code && c->up) {
            /* seconds count (a spot notice): the newest checkpoint first */
            int passed = uploader_hurry(c->up);
            if (passed > 0)
                log_event(c->log, c->metrics, "warning",
                          "checkpoint step %lld is pushed first: %d older checkpoint(s) will "
                          "not be pushed",
                          (long long)p->step, passed);
            int pushed = uploader_wait(c->up, cfg->ckpt_upload_deadline_s);
            b.t_remote = pushed && ckpt_ctl_remote_behind(c) == 0 ? sp_now() : -1;
            log_event(c->log, c->metrics, pushed ? "info" : "warning",
                      pushed ? "checkpoint step %lld is in %s"
                             : "checkpoint step %lld is not yet in %s after %.0f s; it is "
                               "complete locally",
                      (long long)p->step, store_url(c->store), cfg->ckpt_upload_deadline_s);
        }
    }
    double saved = comm_timeout(c->comm);
    comm_set_timeout(c->comm, saved + cfg->ckpt_upload_deadline_s + 600.0);
    int rc = comm_allreduce(c->comm, &code, 1, COMM_I32, COMM_MAX, err);
    comm_set_timeout(c->comm, saved);
    if (rc)
        return rc;
    if (code)
        return c->rank == 0 ? code : sp_fail(err, code, "rank 0 could not commit the checkpoint");
    if (flags[0] && log_stop_budget(c, p, &b, err))
        return err->code;
    *stop = flags[0] ? 1 : 2;
    return 0;
}
