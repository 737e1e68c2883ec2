/* Sharded checkpoints (checkpoint.layout, ckpt.h "Sharded state"): every
 * rank copies the part of the optimizer state it owns to host memory and its
 * own writer thread writes it as a shard file into the checkpoint's .tmp-
 * directory, all ranks in parallel; at a later step boundary (at once on a
 * stop or at the end) the ranks learn that every shard is written, and rank
 * 0's writer adds state.h5 and MANIFEST.json (the shards' sizes and SHA-256
 * as their ranks computed them, and the layout) and renames the directory:
 * the checkpoint exists from that moment. A rank that dies while writing
 * leaves a .tmp- directory without MANIFEST, which is never used. */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <jansson.h>

#include "checkpointing_internal.h"

/* Every rank: *first, the lowest rank whose run.dir is this rank's (the
 * same file system): every rank writes a file of its own into run.dir, then
 * looks for the files of the ranks below it. A rank that cannot write there
 * is its own. */
static int probe_run_dir(const config_t *cfg, comm_t *comm, int *first, sp_err *err)
{
    char token[64] = "";
    int rank = comm_rank(comm);
    *first = rank;
    if (rank == 0)
        snprintf(token, sizeof token, "%d-%.6f", (int)getpid(), sp_wall_time());
    if (comm_bcast(comm, token, sizeof token, 0, err))
        return err->code;
    char *mine = sp_strf("%s/.shared-probe-%s-%d", cfg->run_dir, token, rank);
    int wrote = 0;
    if (mine && sp_mkdir_p(cfg->run_dir) == 0) {
        FILE *f = fopen(mine, "w");
        wrote = f && fprintf(f, "%s %d", token, rank) > 0;
        if (f && fclose(f) != 0)
            wrote = 0;
    }
    if (comm_barrier(comm, err)) /* every file is written */
        goto out;
    for (int q = 0; q < rank && wrote; q++) {
        char *path = sp_strf("%s/.shared-probe-%s-%d", cfg->run_dir, token, q), want[96], got[96] = "";
        FILE *f = path ? fopen(path, "r") : NULL;
        snprintf(want, sizeof want, "%s %d", token, q);
        int same = f && fgets(got, sizeof got, f) && strcmp(got, want) == 0;
        if (f)
            fclose(f);
        free(path);
        if (same) {
            *first = q;
            break;
        }
    }
    comm_barrier(comm, err); /* every rank has looked */
out:
    if (wrote)
        unlink(mine);
    free(mine);
    return err->code;
}

int ckpt_shards_setup(ckpt_ctl *c, sp_err *err)
{
    const config_t *cfg = c->cfg;
    c->sharded = c->spread = 0;
    c->fs_first = 0;
    if (cfg->mode != MODE_FULL || !cfg->shard_optimizer || c->world < 2 ||
        cfg->ckpt_layout == CKPT_LAYOUT_GATHERED)
        return 0;
    if (comm_local_size(c->comm) == c->world) { /* one machine */
        c->sharded = 1;
        return 0;
    }
    int first = 0;
    if (probe_run_dir(cfg, c->comm, &first, err))
        return err->code;
    int32_t apart = first != 0;
    if (comm_allreduce(c->comm, &apart, 1, COMM_I32, COMM_MAX, err))
        return err->code;
    int remote = cfg->ckpt_remote && *cfg->ckpt_remote;
    if (!apart) { /* machines that share run.dir (NFS, Lustre, ...) */
        c->sharded = 1;
        return 0;
    }
    if (!remote) {
        if (cfg->ckpt_layout == CKPT_LAYOUT_SHARDED)
            return sp_fail(err, SP_EXIT_USAGE,
                           "checkpoint.layout is sharded, but the machines do not share run.dir "
                           "(%s: some rank does not see rank 0's files there): each machine would "
                           "hold only its ranks' shards, so the whole checkpoint would be "
                           "nowhere. Set checkpoint.remote (every rank puts its shard there), "
                           "put run.dir on a shared file system, or set checkpoint.layout: "
                           "gathered",
                           cfg->run_dir);
        return 0; /* auto: gathered */
    }
    c->sharded = c->spread = 1;
    c->fs_first = first;
    /* rank 0: which ranks' shards stay off its machine (store only) */
    int32_t mine = first != 0, *all = NULL;
    if (c->rank == 0 && !(all = calloc((size_t)c->world, sizeof *all)))
        return sp_fail(err, SP_EXIT_OTHER, "out of memory");
    if (comm_gather(c->comm, &mine, all, 1, COMM_I32, 0, err)) {
        free(all);
        return err->code;
    }
    c->store_only = all;
    return 0;
}

/* Rank r's part [lo, hi) of the arena of n elements in shards of len. */
static void shard_range(size_t n, size_t len, int r, uint64_t *lo, uint64_t *hi)
{
    size_t a = (size_t)r * len, b = a + len;
    *lo = a < n ? a : n;
    *hi = b < n ? b : n;
}

/* MANIFEST's layout: every trainable tensor's place in the arena, and which
 * rank's file holds which range. */
static char *layout_json(const model_t *m, const int32_t *store_only)
{
    json_t *lay = json_object(), *ts = json_array(), *sh = json_array();
    json_object_set_new(lay, "kind", json_string("flat-shards"));
    json_object_set_new(lay, "elements", json_integer((json_int_t)m->n_trainable));
    for (int i = 0; i < m->nparams; i++) {
        const param_t *p = &m->params[i];
        if (!p->trainable)
            continue;
        json_t *shape = json_array();
        for (int d = 0; d < p->ndim; d++)
            json_array_append_new(shape, json_integer(p->shape[d]));
        json_array_append_new(ts, json_pack("{s:s, s:I, s:o}", "name", p->name, "offset",
                                            (json_int_t)p->offset, "shape", shape));
    }
    for (int r = 0; r < m->shard_count; r++) {
        char name[64];
        uint64_t lo, hi;
        ckpt_shard_name(name, sizeof name, r, m->shard_count);
        shard_range(m->n_trainable, m->shard_len, r, &lo, &hi);
        json_t *e = json_pack("{s:s, s:I, s:I}", "file", name, "lo", (json_int_t)lo, "hi",
                              (json_int_t)hi);
        if (store_only && store_only[r]) /* written on another machine: in the store only */
            json_object_set_new(e, "store_only", json_true());
        json_array_append_new(sh, e);
    }
    json_object_set_new(lay, "tensors", ts);
    json_object_set_new(lay, "shards", sh);
    char *text = json_dumps(lay, JSON_COMPACT);
    json_decref(lay);
    return text;
}

/* Rank 0: the state part of the checkpoint and its empty .tmp- directory
 * (an older one of this step and process removed). */
static int prepare(ckpt_ctl *c, model_t *m, const train_progress *p, const char *tmp,
                   sp_err *err)
{
    if (ckpt_state_snapshot(c, m, p, &c->pending, err))
        return err->code;
    if (!(c->pending.layout = layout_json(m, c->store_only)))
        return sp_fail(err, SP_EXIT_OTHER, "out of memory");
    ckpt_remove_tree(tmp);
    if (mkdir(tmp, 0755) != 0)
        return sp_fail(err, SP_EXIT_OTHER, "%s: cannot create: %s", tmp, strerror(errno));
    return 0;
}

/* This rank's shard, copied from the device: the only stall. */
static int copy_shard(model_t *m, int64_t step, ckpt_shard *sh, sp_err *err)
{
    memset(sh, 0, sizeof *sh);
    sh->step = step;
    sh->rank = m->shard_rank;
    sh->count = m->shard_count;
    shard_range(m->n_trainable, m->shard_len, m->shard_rank, &sh->lo, &sh->hi);
    size_t n = (size_t)(sh->hi - sh->lo);
    tensor_t src[CKPT_SHARD_GROUPS] = {m->master, m->adam_m, m->adam_v};
    for (int g = 0; g < CKPT_SHARD_GROUPS; g++) {
        if (!(sh->data[g] = malloc(sizeof(float) * (n ? n : 1)))) {
            ckpt_shard_free(sh);
            return sp_fail(err, SP_EXIT_OTHER, "out of host memory for a checkpoint shard");
        }
        if (n)
            be_download(m->be, sh->data[g], DT_F32, tensor_view(src[g], 0, n));
    }
    if (be_check(m->be, err))
        ckpt_shard_free(sh);
    return err->code;
}

void ckpt_shards_clean_away(ckpt_ctl *c)
{
    if (!c->spread || c->rank == 0 || c->fs_first != c->rank)
        return;
    sp_mkdir_p(c->root);
    DIR *d = opendir(c->root);
    struct dirent *e;
    while (d && (e = readdir(d))) {
        if (!sp_after(e->d_name, ".tmp-step-"))
            continue;
        char *path = sp_strf("%s/%s", c->root, e->d_name);
        if (path)
            ckpt_remove_tree(path);
        free(path);
    }
    if (d)
        closedir(d);
}

int ckpt_shards_write(ckpt_ctl *c, model_t *m, const train_progress *p, double *stall_s,
                      double *bytes, sp_err *err)
{
    double t0 = sp_now();
    if (ckpt_shards_complete(c, 1, err)) /* the previous one first */
        return err->code;
    *stall_s = 0;
    *bytes = -1; /* not written */
    char *tmp = ckpt_tmp_dir(c->root, p->step, c->pid0);
    /* st[0]: a failure that ends the run; st[1]: rank 0 could not make the
     * directory or the state (a full disk): this checkpoint is skipped, as a
     * failed write of a gathered one is, and training goes on */
    int32_t st[2] = {tmp ? 0 : sp_fail(err, SP_EXIT_OTHER, "out of memory"), 0};
    sp_err perr = {0};
    if (c->rank == 0 && !st[0] && prepare(c, m, p, tmp, &perr)) {
        log_event(c->log, c->metrics, "warning",
                  "checkpoint step %lld was not written: %s; training goes on and the next "
                  "checkpoint tries again",
                  (long long)p->step, perr.msg);
        st[1] = 1;
    } else if (c->spread && c->rank != 0 && c->fs_first == c->rank && !st[0]) {
        /* the first rank of another machine makes the directory there */
        ckpt_remove_tree(tmp);
        if (mkdir(tmp, 0755) != 0) {
            fprintf(stderr, "rank %d on %s: checkpoint step %lld: %s: cannot create: %s\n",
                    c->rank, comm_host(c->comm), (long long)p->step, tmp, strerror(errno));
            st[1] = 2;
        }
    }
    if (comm_allreduce(c->comm, st, 2, COMM_I32, COMM_MAX, err))
        goto fail;
    if (st[1] == 2 && c->rank == 0)
        log_event(c->log, c->metrics, "warning",
                  "checkpoint step %lld was not written: another machine could not create its "
                  "directory (its ranks' output says why); training goes on and the next "
                  "checkpoint tries again",
                  (long long)p->step);
    if (st[0]) {
        if (!err->code)
            sp_fail(err, st[0], "rank 0 could not prepare checkpoint step %lld",
                    (long long)p->step);
        goto fail;
    }
    if (st[1]) {
        if (c->rank == 0)
            ckpt_remove_tree(tmp);
        goto fail; /* err is clear: skipped */
    }
    int32_t code = 0;
    struct stat sb;
    if (stat(tmp, &sb) != 0 || !S_ISDIR(sb.st_mode))
        code = sp_fail(err, SP_EXIT_USAGE,
                       "rank %d on %s does not see the checkpoint directory %s that rank 0 "
                       "created: sharded checkpoints need run.dir on a file system every rank "
                       "shares; set checkpoint.layout: gathered",
                       c->rank, comm_host(c->comm), tmp);
    ckpt_shard sh;
    double mine_bytes = 0;
    if (!code)
        code = copy_shard(m, p->step, &sh, err);
    if (!code) {
        mine_bytes = 4.0 * CKPT_SHARD_GROUPS * (double)(sh.hi - sh.lo);
        code = ckpt_writer_submit_shard(c->writer, tmp, &sh, NULL, err);
    }
    double all[2] = {sp_now() - t0, mine_bytes};
    int32_t any = code;
    if (comm_allreduce(c->comm, &any, 1, COMM_I32, COMM_MAX, err))
        goto fail;
    if (any) { /* nothing was committed: rank 0 clears what was made */
        if (c->rank == 0) {
            ckpt_writer_wait(c->writer, &(sp_err){0});
            ckpt_remove_tree(tmp);
            ckpt_snapshot_free(&c->pending);
        }
        if (!code)
            sp_fail(err, any, "another rank could not write its checkpoint shard");
        goto fail;
    }
    if (comm_allreduce(c->comm, all, 1, COMM_F64, COMM_MAX, err) ||
        comm_allreduce(c->comm, all + 1, 1, COMM_F64, COMM_SUM, err))
        goto fail;
    *stall_s = all[0];
    *bytes = all[1];
    c->pending_step = p->step;
    c->pending_dir = tmp;
    return 0;
fail:
    free(tmp);
    if (c->rank == 0)
        ckpt_snapshot_free(&c->pending);
    return err->code;
}

/* A shard's result as int64: failed, size, the SHA-256's 64 hex digits (8),
 * the three data offsets, block_bytes, nblocks, then the block checksums (4
 * each). */
enum { REC_HEAD = 15, SHARD_REC = REC_HEAD + 4 * CKPT_SHARD_MAX_BLOCKS };

static void pack_result(int failed, const ckpt_shard_info *info, int64_t *rec)
{
    memset(rec, 0, sizeof(int64_t) * SHARD_REC);
    rec[0] = failed;
    if (failed)
        return;
    rec[1] = (int64_t)info->size;
    memcpy(&rec[2], info->sha256, 64);
    for (int g = 0; g < CKPT_SHARD_GROUPS; g++)
        rec[10 + g] = (int64_t)info->data_offset[g];
    rec[13] = (int64_t)info->block_bytes;
    rec[14] = info->nblocks;
    memcpy(&rec[REC_HEAD], info->block_sha256, 32 * (size_t)info->nblocks);
}

static void unpack_result(const int64_t *rec, ckpt_shard_info *info)
{
    info->size = (uint64_t)rec[1];
    memcpy(info->sha256, &rec[2], 64);
    info->sha256[64] = 0;
    for (int g = 0; g < CKPT_SHARD_GROUPS; g++)
        info->data_offset[g] = (uint64_t)rec[10 + g];
    info->block_bytes = (uint64_t)rec[13];
    info->nblocks = rec[14] > 0 && rec[14] <= CKPT_SHARD_MAX_BLOCKS ? (uint32_t)rec[14] : 0;
    memcpy(info->block_sha256, &rec[REC_HEAD], 32 * (size_t)info->nblocks);
}

/* Rank 0, every shard reported: commit on the writer, or drop the checkpoint. */
static int commit(ckpt_ctl *c, const int64_t *recs, sp_err *err)
{
    int bad = -1;
    for (int r = 0; r < c->world && bad < 0; r++)
        if (recs[(size_t)r * SHARD_REC])
            bad = r;
    if (bad >= 0) {
        log_event(c->log, c->metrics, "warning",
                  "checkpoint step %lld is not complete: rank %d could not write its shard (its "
                  "log says why); training goes on and the next checkpoint tries again",
                  (long long)c->pending_step, bad);
        ckpt_remove_tree(c->pending_dir);
        ckpt_snapshot_free(&c->pending);
        return 0;
    }
    ckpt_snapshot *s = &c->pending;
    s->shards = calloc((size_t)c->world, sizeof *s->shards);
    if (!s->shards || !(s->shard_dir = strdup(c->pending_dir)))
        return sp_fail(err, SP_EXIT_OTHER, "out of memory");
    s->nshards = c->world;
    for (int r = 0; r < c->world; r++) {
        ckpt_shard_name(s->shards[r].name, sizeof s->shards[r].name, r, c->world);
        unpack_result(recs + (size_t)r * SHARD_REC, &s->shards[r]);
        s->bytes += (size_t)s->shards[r].size;
    }
    return ckpt_writer_submit(c->writer, s, NULL, err);
}

int ckpt_shards_complete(ckpt_ctl *c, int wait, sp_err *err)
{
    if (c->pending_step < 0)
        return 0;
    sp_err mine = {0};
    ckpt_shard_info info;
    int busy = 0;
    if (wait) /* written; its upload goes on */
        ckpt_writer_wait_written(c->writer);
    int failed = ckpt_writer_shard_result(c->writer, &busy, &info, &mine) != 0;
    int32_t running = busy;
    if (comm_allreduce(c->comm, &running, 1, COMM_I32, COMM_MAX, err))
        return err->code;
    if (running)
        return 0; /* asked again at the next step boundary */
    if (failed)
        fprintf(stderr, "rank %d: checkpoint step %lld: %s\n", c->rank,
                (long long)c->pending_step, mine.msg);
    int64_t *rec = malloc(sizeof(int64_t) * SHARD_REC), *recs = NULL;
    if (!rec || (c->rank == 0 && !(recs = malloc(sizeof(int64_t) * SHARD_REC * (size_t)c->world)))) {
        free(rec);
        return sp_fail(err, SP_EXIT_OTHER, "out of memory");
    }
    pack_result(failed, &info, rec);
    int rc = comm_gather(c->comm, rec, recs, SHARD_REC, COMM_I64, 0, err);
    free(rec);
    if (!rc && c->rank == 0)
        rc = commit(c, recs, err);
    free(recs);
    c->pending_step = -1;
    free(c->pending_dir);
    c->pending_dir = NULL;
    return rc;
}
