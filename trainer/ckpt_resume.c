/* Resuming: which checkpoint (local, remote when newer, or the one named),
 * whether it fits this run (its state, its math, its base model, the global
 * batch over this rank count), restoring it on every rank, and the metrics
 * trimmed to it. */
#define _GNU_SOURCE
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "checkpointing_internal.h"
#include "state_check.h"

typedef struct resume_header {
    int32_t code, found;
    int32_t sharded; /* a sharded checkpoint at path: every rank reads its part */
    char path[PATH_MAX];
    char remote[PATH_MAX]; /* sharded, its shards read from this store (else "") */
    char name[64];         /* ... under this prefix (step-N) */
    int32_t local_copy;    /* ... except those that path holds on a rank's machine */
    int32_t refused;       /* --resume auto: its contents refused, it was set aside
                            * (found: after part of it was restored) */
    int64_t step, grad_accum;
    uint64_t cursor;
    double elapsed_s;
    char msg[1536];
} resume_header;

static void report_bad(void *ctx, const ckpt_info *bad)
{
    ckpt_ctl *c = ctx;
    c->skipped_local++;
    log_event(c->log, c->metrics, "warning", "skipping checkpoint %s: %s", bad->name,
              bad->problem);
}

/* --resume s3://.../step-N or file://.../step-N: pulled into the local root. */
static int choose_url(ckpt_ctl *c, const char *resume, char **path, sp_err *err)
{
    char *url = strdup(resume);
    if (!url)
        return sp_fail(err, SP_EXIT_OTHER, "out of memory");
    char *slash = strrchr(url, '/');
    int rc = 0;
    if (!slash || !sp_after(slash + 1, "step-")) {
        rc = sp_fail(err, SP_EXIT_USAGE, "--resume %s: expected .../step-NNNNNNNN", resume);
    } else {
        *slash = 0;
        store_opts so = {0};
        so.endpoint = *c->cfg->ckpt_endpoint ? c->cfg->ckpt_endpoint : NULL;
        so.region = *c->cfg->ckpt_region ? c->cfg->ckpt_region : NULL;
        store_t *st;
        if (store_open(&st, url, &so, err)) {
            rc = err->code ? err->code : SP_EXIT_USAGE;
        } else {
            rc = ckpt_remote_pull(c, st, slash + 1, path, NULL, err);
            store_close(st);
        }
    }
    free(url);
    return rc;
}

/* A local checkpoint written across machines that do not share run.dir
 * holds rank 0's machine's shards only; the others are in the store. It is
 * taken when each of those is there with its size (and the store's copy
 * was not found damaged). */
static int accept_local(void *ctx, const char *dir, char *problem, size_t n)
{
    ckpt_ctl *c = ctx;
    ckpt_manifest m;
    sp_err e = {0};
    if (ckpt_manifest_load(dir, &m, &e)) { /* verified a moment ago: let the read say */
        ckpt_manifest_free(&m);
        return 0;
    }
    int k = ckpt_layout_store_only(m.layout, NULL, 0), bad = 0;
    char(*names)[64] = k ? calloc((size_t)k, sizeof *names) : NULL;
    if (k && !names) {
        snprintf(problem, n, "out of memory");
        bad = 1;
    } else if (k && !c->store) {
        ckpt_layout_store_only(m.layout, names, 1);
        snprintf(problem, n,
                 "%d of its shard files (%s, ...) were written on other machines and are kept "
                 "only in a remote store, and checkpoint.remote is not set",
                 k, names[0]);
        c->store_needed = 1;
        bad = 1;
    } else if (k && m.step >= c->remote_skip_from) {
        snprintf(problem, n, "its shards in %s are damaged", store_url(c->store));
        bad = 1;
    }
    if (k && !bad)
        ckpt_layout_store_only(m.layout, names, k);
    for (int i = 0; i < k && !bad; i++) {
        uint64_t want = 0, size = 0;
        int there = 0;
        for (int f = 0; f < m.nfiles; f++)
            if (strcmp(m.files[f].name, names[i]) == 0)
                want = m.files[f].size;
        char step[32], *key;
        ckpt_dir_name(step, sizeof step, m.step);
        key = sp_strf("%s/%s", step, names[i]);
        if (!key || store_exists(c->store, key, &there, &size, &e) || !there || size != want) {
            snprintf(problem, n,
                     "its shard %s, written on another machine, is not in %s with its %llu "
                     "bytes%s%s",
                     names[i], store_url(c->store), (unsigned long long)want,
                     e.code ? ": " : "", e.code ? e.msg : "");
            bad = 1;
        }
        free(key);
    }
    free(names);
    ckpt_manifest_free(&m);
    return bad;
}

/* --resume auto: the newest local checkpoint that verifies, or a newer remote one. */
static int choose_auto(ckpt_ctl *c, char **path, sp_err *err)
{
    char local[PATH_MAX]; /* a path the system can open fits */
    int found = 0;
    c->store_needed = 0;
    c->skipped_local = 0;
    if (ckpt_find_latest_if(c->root, local, sizeof local, &found, accept_local, report_bad, c,
                            err))
        return err->code;
    int64_t local_step = -1;
    if (found) {
        local_step = strtoll(strrchr(local, '/') + SP_LEN("/step-"), NULL, 10);
        if (!(*path = strdup(local)))
            return sp_fail(err, SP_EXIT_OTHER, "out of memory");
    }
    char *remote = NULL;
    if (c->store && ckpt_remote_find(c, local_step, &remote, err))
        return err->code;
    c->chosen_remote = remote != NULL;
    if (remote) {
        free(*path);
        *path = remote;
    }
    if (!*path && c->store_needed) /* never start afresh over a checkpoint it cannot read */
        return sp_fail(err, SP_EXIT_USAGE,
                       "%s holds checkpoints written across machines that do not share run.dir, "
                       "whose other shards are only in the remote store they were pushed to: "
                       "set checkpoint.remote to it, or start afresh with --resume none",
                       c->root);
    if (!*path && (c->skipped_local || c->refused)) { /* said once, beside each one's warning */
        char note[2 * PATH_MAX] = "";
        if (c->skipped_local &&
            ckpt_move_unusable_aside(c->cfg, c->root, NULL, note, sizeof note, err))
            return err->code;
        int n = c->skipped_local + c->refused;
        log_event(c->log, c->metrics, "warning",
                  "none of the %d checkpoint%s in %s%s%s can be resumed (each named above)%s%s%s",
                  n, n == 1 ? "" : "s", c->root, c->store ? " and " : "",
                  c->store ? store_url(c->store) : "",
                  c->refused_partly ? "" : ": the run starts again from step 0",
                  note[0] ? "; " : "", note);
    }
    return 0;
}

/* Rank 0: which checkpoint to restore (*path, a heap string; NULL: none). */
static int choose(ckpt_ctl *c, const char *resume, char **path, sp_err *err)
{
    *path = NULL;
    if (strcmp(resume, "none") == 0)
        return 0;
    if (sp_after(resume, "s3://") || sp_after(resume, "file://"))
        return choose_url(c, resume, path, err);
    if (strcmp(resume, "auto") == 0)
        return choose_auto(c, path, err);
    ckpt_manifest mf;
    int rc = ckpt_verify(resume, &mf, err);
    ckpt_manifest_free(&mf);
    if (rc)
        return rc;
    if (!(*path = strdup(resume)))
        return sp_fail(err, SP_EXIT_OTHER, "out of memory");
    return 0;
}

/* Whether checkpoint s (its config was, checked by state_check_contents)
 * fits this run. */
static int check_compatible(ckpt_ctl *c, const ckpt_snapshot *s, const config_t *was,
                            const char *path, int64_t micro_batch, int64_t *ga, sp_err *err)
{
    const config_t *cfg = c->cfg;
    const ckpt_attr *gb = ckpt_get(s, "global_batch");
    /* checkpoints written before the data identity have none */
    const ckpt_attr *di = ckpt_get(s, "data_identity");
    int has_identity = di && di->type == CKPT_ATTR_STR;
    /* data.train at another path (the dataset where the new machine mounts
     * it) is the same data when its contents are: the identity decides */
    int moved = strcmp(was->data_train, cfg->data_train) != 0;
    if (strcmp(s->config_hash, c->config_hash) != 0) {
        char diff[1200] = "";
        int others = config_diff_math(was, cfg, "data.train", diff, sizeof diff);
        if (others || !moved || !has_identity) {
            config_diff_math(was, cfg, NULL, diff, sizeof diff);
            return sp_fail(err, SP_EXIT_USAGE,
                           "%s was trained with different settings: %s. Resuming would change "
                           "the math of the run; restore them, or start afresh with --resume "
                           "none or a new run.dir%s",
                           path, diff[0] ? diff : "(the config hash differs)",
                           moved && !others
                               ? " (this checkpoint records no identity of its data, so "
                                 "data.train cannot be recognised at another path: it was "
                                 "written before spotune recorded one)"
                               : "");
        }
    }
    /* data.train holding other contents: other windows in another order */
    if (has_identity && strcmp(di->s, c->data_identity) != 0)
        return sp_fail(err, SP_EXIT_USAGE,
                       "%s was trained on other data: data.train %s %sholds other contents "
                       "(identity %s; the checkpoint's run read %s%s%s), so resuming would "
                       "train on other windows in another order; restore the file, or start "
                       "afresh with --resume none or a new run.dir",
                       path, cfg->data_train, moved ? "" : "now ", c->data_identity, di->s,
                       moved ? " at " : "", moved ? was->data_train : "");
    if (cfg->mode == MODE_LORA && strcmp(s->base_model, c->base_identity) != 0)
        return sp_fail(err, SP_EXIT_USAGE,
                       "%s was trained on another base model (identity %s; %s is %s): a LoRA "
                       "checkpoint only fits the model it was trained on",
                       path, s->base_model, cfg->model_path, c->base_identity);
    if (moved)
        log_event(c->log, c->metrics, "info",
                  "data.train is now %s (the checkpoint's run read %s): the same contents "
                  "(identity %s), so the run resumes on the same windows in the same order",
                  cfg->data_train, was->data_train, c->data_identity);
    int64_t G = gb->i, per = (int64_t)c->world * micro_batch;
    if (per * *ga == G)
        return 0;
    if (G % per != 0)
        return sp_fail(err, SP_EXIT_USAGE,
                       "%s has a global batch of %lld windows, which %d ranks x micro_batch %lld "
                       "cannot split evenly; choose train.micro_batch so that %d x micro_batch "
                       "divides %lld",
                       path, (long long)G, c->world, (long long)micro_batch, c->world,
                       (long long)G);
    log_event(c->log, c->metrics, "info",
              "the checkpoint ran with %d rank(s); train.grad_accum is now %lld to keep the "
              "global batch of %lld windows",
              s->world_size, (long long)(G / per), (long long)G);
    *ga = G / per;
    return 0;
}

/* trim_metrics with its paths: metrics.jsonl (path), the file written in
 * its place (tmp) and the checkpoint's copy (saved). */
static void copy_metrics(ckpt_ctl *c, const char *path, const char *tmp, const char *saved,
                         int64_t step)
{
    fflush(c->metrics->f);
    FILE *in = fopen(c->fresh_metrics ? saved : path, "r"), *out = fopen(tmp, "w");
    char *line = NULL;
    size_t cap = 0;
    while (in && out && getline(&line, &cap, in) > 0) {
        const char *sp = strstr(line, "\"step\":");
        if (!sp || strtoll(sp + 7, NULL, 10) <= step)
            fputs(line, out);
    }
    if (c->fresh_metrics && out) { /* this process's own records so far */
        FILE *mine = fopen(path, "r");
        while (mine && getline(&line, &cap, mine) > 0)
            fputs(line, out);
        if (mine)
            fclose(mine);
    }
    free(line);
    if (in)
        fclose(in);
    if (out && fclose(out) == 0 && rename(tmp, path) == 0) {
        fclose(c->metrics->f);
        c->metrics->f = fopen(path, "a");
    }
}

/* A resumed run rewrites metrics.jsonl without the records of steps after
 * the checkpoint, so the curve a user plots has no repeated steps; on a new
 * machine (no metrics yet) it starts from the checkpoint's copy. A start that
 * restores nothing (ckpt_dir NULL, step 0) drops the records of every step an
 * earlier attempt trained without committing a checkpoint. */
static void trim_metrics(ckpt_ctl *c, const char *ckpt_dir, int64_t step)
{
    if (!c->metrics || !c->metrics->f || (!ckpt_dir && c->fresh_metrics))
        return;
    char *path = sp_strf("%s/metrics.jsonl", c->cfg->run_dir);
    char *tmp = path ? sp_strf("%s.tmp", path) : NULL;
    char *saved = ckpt_dir ? sp_strf("%s/metrics.jsonl", ckpt_dir) : NULL;
    if (path && tmp && (saved || !ckpt_dir))
        copy_metrics(c, path, tmp, saved, step);
    free(path);
    free(tmp);
    free(saved);
}

/* Every rank: rank 0's header h (and snapshot s) restored into the model and
 * the progress; why: the error when h->code is set (rank 0 has it whole). */
static int restore(ckpt_ctl *c, model_t *m, const resume_header *h, const char *why,
                   ckpt_snapshot *s, int64_t micro_batch, int64_t *grad_accum, train_progress *p,
                   int *resumed, int *damaged, sp_err *err)
{
    /* checkpoint.every_minutes counts from here, not from before a download */
    c->last_time = sp_now();
    if (h->code) {
        ckpt_snapshot_free(s);
        return sp_fail(err, h->code, "%s", why);
    }
    if (!h->found)
        return 0;
    int rc = h->remote[0] ? ckpt_shards_restore_store(c, m, h->remote, h->name, h->path,
                                                      h->local_copy, damaged, err)
             : h->sharded ? ckpt_shards_restore(c, m, h->path, err)
                          : ckpt_state_restore(c, m, c->rank == 0 ? s : NULL, err);
    ckpt_snapshot_free(s);
    if (rc)
        return rc;
    p->step = h->step;
    p->cursor = h->cursor;
    p->elapsed_s = h->elapsed_s;
    *grad_accum = h->grad_accum;
    /* the checkpoint's global batch, re-split over this rank count, is what
     * every later checkpoint of this run records */
    c->global_batch = (int64_t)c->world * micro_batch * h->grad_accum;
    *resumed = 1;
    c->last_step = h->step;
    c->last_only_in_store = h->remote[0] && !h->local_copy;
    return 0;
}

/* --resume auto, rank 0: checkpoint path (step), whose contents were refused
 * (why), is set aside, so that no later start chooses it and retention does
 * not keep it over this run's new checkpoints: a local one is moved into
 * run.dir/previous-<UTC>/checkpoints/ (kept for inspection); one taken from
 * the store loses its MANIFEST there, as one with a damaged block does (its
 * files stay), so that this run can push that step again, and the copy
 * pulled from it is removed. */
static int set_aside(ckpt_ctl *c, const char *path, int64_t step, const char *why, sp_err *err)
{
    char name[64], note[2 * PATH_MAX] = "", retired[PATH_MAX + 160] = "";
    ckpt_dir_name(name, sizeof name, step);
    sp_err merr = {0};
    if (c->chosen_remote) /* a copy pulled a moment ago (the store keeps its files) */
        ckpt_remove_tree(path);
    else if (ckpt_move_unusable_aside(c->cfg, c->root, name, note, sizeof note, &merr))
        return sp_fail(err, merr.code, "%s: its contents are refused (%s), and %s", path, why,
                       merr.msg);
    if (c->chosen_remote && c->store) {
        if (step < c->remote_refused_from)
            c->remote_refused_from = step;
        sp_err derr = {0};
        if (ckpt_remote_retire(c, name, &derr) == 0)
            sp_cutf(retired, sizeof retired,
                    "; its MANIFEST was removed from %s (its files are kept there)",
                    store_url(c->store));
        else
            sp_cutf(retired, sizeof retired, "; its MANIFEST in %s could not be removed (%s)",
                    store_url(c->store), derr.msg);
    }
    c->refused++;
    log_event(c->log, c->metrics, "warning",
              "skipping checkpoint %s: %s%s%s%s; the newest older checkpoint is taken instead",
              name, why, note[0] ? "; " : "", note, retired);
    return 0;
}

/* The step of checkpoint directory path (.../step-N or .../.remote-step-N). */
static int64_t dir_step(const char *path)
{
    const char *b = strrchr(path, '/');
    b = b ? b + 1 : path;
    if (sp_after(b, ".remote-"))
        b += SP_LEN(".remote-");
    return sp_after(b, "step-") ? strtoll(b + SP_LEN("step-"), NULL, 10) : -1;
}

/* --resume auto, every rank: the restore of h's checkpoint (rank 0's path)
 * failed with err after part of it was restored: a value of a sharded
 * checkpoint's shard file, checked as each rank reads its ranges, refused.
 * When every rank failed so (SP_EXIT_INPUT), the first rank whose own
 * finding it was says what it found, rank 0 sets the checkpoint aside, and
 * 1 is returned: choose again (the older checkpoint restored then overwrites
 * every value this attempt wrote). */
static int refused_late(ckpt_ctl *c, const resume_header *h, const char *path, sp_err *err)
{
    sp_err e2 = {0};
    int32_t all = 1, who = sp_after(err->msg, "another rank") || sp_after(err->msg, "rank 0 cannot")
                               ? c->world
                               : c->rank;
    if (comm_allreduce(c->comm, &all, 1, COMM_I32, COMM_MIN, &e2) || !all ||
        comm_allreduce(c->comm, &who, 1, COMM_I32, COMM_MIN, &e2))
        return 0;
    char msg[SP_ERR_MSG_MAX];
    snprintf(msg, sizeof msg, "%s", err->msg);
    if (who < c->world && comm_bcast(c->comm, msg, sizeof msg, who, &e2))
        return 0;
    int32_t aside = c->rank == 0 && set_aside(c, path, h->step, msg, &e2) == 0;
    if (c->rank == 0 && !aside)
        *err = e2;
    if (comm_bcast(c->comm, &aside, sizeof aside, 0, &e2))
        return 0;
    c->refused_partly |= aside;
    return aside;
}

/* One attempt: rank 0 chooses, every rank restores. *damaged: the chosen
 * checkpoint's shards, read from the store, did not match their checksums. */
static int resume_once(ckpt_ctl *c, model_t *m, const char *resume, int64_t micro_batch,
                       int64_t *grad_accum, train_progress *p, int *resumed, int *damaged,
                       resume_header *h, sp_err *err)
{
    memset(h, 0, sizeof *h);
    ckpt_snapshot s;
    ckpt_snapshot_init(&s);
    char *path = NULL;
    sp_err e = {0};
    *resumed = 0;
    *damaged = 0;
    if (c->rank == 0) {
        int64_t ga = *grad_accum;
        free(c->ranged_url); /* set again if this choice is read from a store */
        c->ranged_url = NULL;
        int rc = choose(c, resume, &path, &e);
        if (!rc && path) {
            /* the checks of ckpt verify: attributes, config, tensors, the
             * values state.h5 holds (a sharded checkpoint's: as every rank
             * reads them, src_read in ckpt_state.c) */
            config_t was;
            rc = state_read_checked(path, c->ranged_url != NULL, &s, &e);
            if (!rc) {
                rc = state_check_contents(path, &s, 0, &was, &e);
                /* damaged before its checksum was taken: under auto it is
                 * passed over like one that fails its checksums (a content
                 * refusal, unlike a config mismatch, is this checkpoint's own) */
                h->refused = rc == SP_EXIT_INPUT;
                if (!rc)
                    rc = check_compatible(c, &s, &was, path, micro_batch, &ga, &e);
                config_free(&was);
            } else {
                h->refused = rc == SP_EXIT_INPUT;
            }
            h->refused = h->refused && strcmp(resume, "auto") == 0;
            if (h->refused) {
                sp_err aside = {0};
                h->step = dir_step(path);
                if (set_aside(c, path, h->step, e.msg, &aside)) {
                    h->refused = 0;
                    e = aside;
                    rc = aside.code;
                }
            }
        }
        h->code = rc;
        h->found = !rc && path;
        sp_cutf(h->msg, sizeof h->msg, "%s", e.msg); /* for the other ranks */
        if (h->found) {
            const ckpt_attr *cur = ckpt_get(&s, "cursor"), *el = ckpt_get(&s, "elapsed_s");
            h->step = s.step;
            h->cursor = cur ? (uint64_t)cur->i : 0;
            h->elapsed_s = el ? el->d : 0;
            h->grad_accum = ga;
            h->sharded = s.layout != NULL;
            /* written across machines: its other shards are read from the store */
            h->local_copy = h->sharded && !c->ranged_url &&
                            ckpt_layout_store_only(s.layout, NULL, 0) > 0;
            if (h->local_copy && !c->store) {
                h->code = sp_fail(&e, SP_EXIT_USAGE,
                                  "%s: some of its shard files were written on other machines "
                                  "and are kept only in a remote store; set checkpoint.remote "
                                  "to it",
                                  path);
                h->found = 0;
                sp_cutf(h->msg, sizeof h->msg, "%s", e.msg);
            }
            if (h->sharded && (c->ranged_url || h->local_copy))
                ckpt_dir_name(h->name, sizeof h->name, s.step);
            if (h->sharded &&
                (sp_fitf(h->path, sizeof h->path, "%s", path) ||
                 (c->ranged_url && sp_fitf(h->remote, sizeof h->remote, "%s", c->ranged_url)) ||
                 (h->local_copy && h->found &&
                  sp_fitf(h->remote, sizeof h->remote, "%s", store_url(c->store))))) {
                h->code = sp_fail(&e, SP_EXIT_INPUT, "%s: path too long", path);
                h->found = 0;
                sp_cutf(h->msg, sizeof h->msg, "%s", e.msg);
            }
        }
    }
    int rc = comm_bcast(c->comm, h, sizeof *h, 0, err);
    if (!rc)
        rc = restore(c, m, h, c->rank == 0 ? e.msg : h->msg, &s, micro_batch, grad_accum, p,
                     resumed, damaged, err);
    else
        ckpt_snapshot_free(&s);
    if (rc == SP_EXIT_INPUT && h->found && !*damaged && strcmp(resume, "auto") == 0)
        h->refused = refused_late(c, h, path, err);
    /* restored: a local checkpoint the store lacks is pushed (one pulled
     * without its shards stays where it is) */
    if (!rc && *resumed && c->rank == 0 && !c->ranged_url)
        ckpt_remote_push_if_missing(c, path, h->step);
    if (!rc && !*resumed && c->rank == 0)
        trim_metrics(c, NULL, 0);
    if (!rc && *resumed && c->rank == 0) {
        trim_metrics(c, path, h->step);
        if (h->local_copy)
            log_event(c->log, c->metrics, "resume",
                      "resumed from %s (the shards of other machines from %s/%s): step %lld, "
                      "sample %llu",
                      path, h->remote, h->name, (long long)h->step,
                      (unsigned long long)h->cursor);
        else if (h->remote[0])
            log_event(c->log, c->metrics, "resume", "resumed from %s/%s: step %lld, sample %llu",
                      h->remote, h->name, (long long)h->step, (unsigned long long)h->cursor);
        else
            log_event(c->log, c->metrics, "resume", "resumed from %s: step %lld, sample %llu",
                      path, (long long)h->step, (unsigned long long)h->cursor);
    }
    if (c->rank == 0 && c->ranged_url && path) /* MANIFEST and state: read, not kept */
        ckpt_remove_tree(path);
    free(path);
    return rc;
}

int ckpt_ctl_resume(ckpt_ctl *c, model_t *m, const char *resume, int64_t micro_batch,
                    int64_t *grad_accum, train_progress *p, int *resumed, sp_err *err)
{
    resume_header h;
    int damaged = 0, rc, refusals = 0;
    int64_t partial_from = INT64_MAX; /* a refused checkpoint was partly restored */
    for (int attempt = 0;; attempt++) {
        rc = resume_once(c, m, resume, micro_batch, grad_accum, p, resumed, &damaged, &h, err);
        if (h.refused && ++refusals <= 64) { /* set aside on rank 0 */
            if (h.found && h.step < partial_from)
                partial_from = h.step;
            sp_err_clear(err);
            attempt--;
            continue;
        }
        if (!damaged)
            break;
        /* A checkpoint whose stored shards do not match their checksums does
         * not exist by the protocol: its MANIFEST is retired (so no later
         * start takes it either) and the newest older one is restored, which
         * overwrites all the trainable state this attempt wrote. Only --resume
         * auto chooses again, and only while there is one to choose. */
        if (c->rank == 0) {
            sp_err derr = {0};
            int gone = c->store && strcmp(store_url(c->store), h.remote) == 0 &&
                       ckpt_remote_retire(c, h.name, &derr) == 0;
            log_event(c->log, c->metrics, "warning",
                      "skipping remote checkpoint %s: %s%s", h.name, err->msg,
                      gone ? "; its MANIFEST was removed from the store" : "");
        }
        int32_t again = strcmp(resume, "auto") == 0 && attempt < 4;
        if (!again)
            break;
        c->remote_skip_from = h.step;
        pthread_mutex_lock(&c->remote_mu); /* learned again from the next listing */
        c->remote_step = -1;
        pthread_mutex_unlock(&c->remote_mu);
        sp_err_clear(err);
    }
    if (!rc && damaged == 0 && *resumed == 0 && h.code == 0 && c->remote_skip_from != INT64_MAX)
        rc = sp_fail(err, SP_EXIT_INPUT,
                     "every remote checkpoint from step %lld on is damaged and no older one "
                     "exists: the model holds part of a damaged restore, so this run stops "
                     "rather than train from it; run it again to start from the beginning",
                     (long long)c->remote_skip_from);
    if (!rc && *resumed == 0 && partial_from != INT64_MAX)
        rc = sp_fail(err, SP_EXIT_INPUT,
                     "the checkpoint of step %lld was refused (named above) after part of it had "
                     "been restored, and no older one exists: the model holds part of a refused "
                     "restore, so this run stops rather than train from it; run it again to start "
                     "from the beginning",
                     (long long)partial_from);
    if (!rc) /* the trainable arrays and their two AdamW moments, fp32 */
        ckpt_remote_budget_check(c, (uint64_t)m->n_trainable * 12u);
    return rc;
}
