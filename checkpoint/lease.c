/* One job per run directory (a lock file) and per remote prefix (a lease). */
#define _GNU_SOURCE
#include "lease.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* How long the end of a job waits for the lease to be deleted. */
#define RELEASE_WAIT_S 3
/* How many times the start of a job reads and writes the lease again when
 * another job wrote it in between. */
#define LEASE_RACES 8

/* ---- who this job is ----------------------------------------------------------- */

typedef struct identity {
    char host[256];
    long pid;
    char job[17];
    double started;
} identity;

static void identity_init(identity *id)
{
    memset(id, 0, sizeof *id);
    if (gethostname(id->host, sizeof id->host - 1) != 0)
        snprintf(id->host, sizeof id->host, "unknown");
    id->pid = (long)getpid();
    uint64_t r = 0;
    if (getrandom(&r, sizeof r, 0) != sizeof r)
        r = sp_mix64((uint64_t)id->pid ^ (uint64_t)(sp_wall_time() * 1e6));
    snprintf(id->job, sizeof id->job, "%016llx", (unsigned long long)r);
    id->started = sp_wall_time();
}

static void fmt_utc(char *buf, size_t n, double t)
{
    time_t s = (time_t)t;
    struct tm tm;
    gmtime_r(&s, &tm);
    strftime(buf, n, "%Y-%m-%dT%H:%M:%SZ", &tm);
}

/* ---- the run directory's lock ---------------------------------------------------- */

struct run_lock {
    int fd;
};

/* The holder line written into the lock file. */
static void holder_line(const identity *id, char *buf, size_t n)
{
    char t[32];
    fmt_utc(t, sizeof t, id->started);
    snprintf(buf, n, "pid %ld on host %s (job %s, started %s)\n", id->pid, id->host, id->job, t);
}

static void read_holder(int fd, char *buf, size_t n)
{
    ssize_t got = pread(fd, buf, n - 1, 0);
    buf[got > 0 ? got : 0] = 0;
    buf[strcspn(buf, "\n")] = 0;
}

/* run_lock_take, the lock file being path. */
static int lock_file(const char *path, const char *run_dir, double wait_s, char *note, size_t n,
                     run_lock **out, sp_err *err)
{
    char holder[512];
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0)
        return sp_fail(err, SP_EXIT_OTHER, "%s: cannot open: %s", path, strerror(errno));
    struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET};
    double t0 = sp_now();
    while (fcntl(fd, F_OFD_SETLK, &fl) != 0) {
        if (errno != EAGAIN && errno != EACCES) {
            int e = errno;
            close(fd);
            return sp_fail(err, SP_EXIT_OTHER, "%s: cannot lock: %s", path, strerror(e));
        }
        if (sp_now() - t0 >= wait_s) {
            read_holder(fd, holder, sizeof holder);
            close(fd);
            return sp_fail(err, SP_EXIT_USAGE,
                           "run.dir %s is in use by another job (%s; waited %.0f s): let it "
                           "end, or give this job another run.dir",
                           run_dir, holder[0] ? holder : "holder unknown", wait_s);
        }
        struct timespec ts = {0, 100 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    read_holder(fd, holder, sizeof holder);
    if (holder[0])
        sp_cutf(note, n, "run.dir %s was held by %s, which has ended; this job takes it over",
                run_dir, holder); /* a note: cut to the caller's buffer */
    identity me;
    identity_init(&me);
    char line[512];
    holder_line(&me, line, sizeof line);
    if (ftruncate(fd, 0) != 0 || pwrite(fd, line, strlen(line), 0) != (ssize_t)strlen(line)) {
        int e = errno;
        close(fd);
        return sp_fail(err, SP_EXIT_OTHER, "%s: cannot write: %s", path, strerror(e));
    }
    run_lock *l = malloc(sizeof *l);
    if (!l) {
        close(fd);
        return sp_fail(err, SP_EXIT_OTHER, "out of memory");
    }
    l->fd = fd;
    *out = l;
    return 0;
}

int run_lock_take(run_lock **out, const char *run_dir, double wait_s, char *note, size_t n,
                  sp_err *err)
{
    *out = NULL;
    note[0] = 0;
    char *path = sp_strf("%s/.lock", run_dir);
    if (!path)
        return sp_fail(err, SP_EXIT_OTHER, "out of memory");
    int rc = lock_file(path, run_dir, wait_s, note, n, out, err);
    free(path);
    return rc;
}

void run_lock_release(run_lock *l)
{
    if (!l)
        return;
    int rc = ftruncate(l->fd, 0); /* the holder line goes: nobody holds the directory */
    (void)rc;                     /* (a line left behind only adds a note for the next job) */
    close(l->fd);
    free(l);
}

/* ---- the remote prefix's lease --------------------------------------------------- */

typedef struct lease_info {
    identity id;
    char run_dir[PATH_MAX];
    double renewed, ttl_s;
} lease_info;

struct lease {
    store_t *st;
    lease_opts o;
    identity me;
    char *run_dir; /* recorded in the lease */
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int stop, written, lost, done;
    sp_err lost_err;
    struct lease *next_left; /* on the list of leases left to their thread */
};

/* Leases whose release outlived RELEASE_WAIT_S: their threads finish on
 * their own and the process may exit first; kept here, they stay reachable
 * (memory the process still holds on purpose, not a leak). */
static pthread_mutex_t left_mu = PTHREAD_MUTEX_INITIALIZER;
static struct lease *left_leases;

static const char *str_field(json_t *j, const char *k)
{
    const char *s = json_string_value(json_object_get(j, k));
    return s ? s : "";
}

/* 1: a lease was read into *info; 0: none (or not one this program wrote);
 * < 0: a store error (err). tag (NULL, or STORE_TAG_MAX bytes) receives the
 * object's version tag ("" when there is none), for a write that replaces
 * only what was read. */
static int lease_read(store_t *st, lease_info *info, char *tag, sp_err *err)
{
    void *data = NULL;
    size_t n = 0;
    memset(info, 0, sizeof *info);
    int rc = tag ? store_get_bytes_tag(st, LEASE_KEY, &data, &n, tag, err)
                 : store_get_bytes(st, LEASE_KEY, &data, &n, err);
    if (rc == STORE_ENOENT) {
        sp_err_clear(err);
        return 0;
    }
    if (rc)
        return rc;
    json_t *j = json_loadb(data, n, 0, NULL);
    free(data);
    if (!json_is_object(j) || !json_is_string(json_object_get(j, "job"))) {
        json_decref(j);
        return 0;
    }
    /* another job's labels, for messages (a job id is 16 hex digits) */
    sp_cutf(info->id.host, sizeof info->id.host, "%s", str_field(j, "host"));
    sp_cutf(info->id.job, sizeof info->id.job, "%s", str_field(j, "job"));
    sp_cutf(info->run_dir, sizeof info->run_dir, "%s", str_field(j, "run_dir"));
    info->id.pid = (long)json_integer_value(json_object_get(j, "pid"));
    info->id.started = json_number_value(json_object_get(j, "started"));
    info->renewed = json_number_value(json_object_get(j, "renewed"));
    info->ttl_s = json_number_value(json_object_get(j, "ttl_s"));
    json_decref(j);
    return 1;
}

/* Writes this job's lease over the one read with version tag ("": none
 * there): STORE_EEXIST when another job wrote or deleted it since. */
static int lease_write(lease_t *l, const char *tag, sp_err *err)
{
    json_t *j = json_pack("{s:s, s:I, s:s, s:s, s:f, s:f, s:f}", "host", l->me.host, "pid",
                          (json_int_t)l->me.pid, "job", l->me.job, "run_dir", l->run_dir,
                          "started", l->me.started, "renewed", sp_wall_time(), "ttl_s",
                          l->o.ttl_s);
    char *text = j ? json_dumps(j, JSON_INDENT(2)) : NULL;
    json_decref(j);
    if (!text) {
        sp_fail(err, SP_EXIT_OTHER, "out of memory");
        return STORE_EFAIL;
    }
    int rc = store_put_bytes_if(l->st, LEASE_KEY, text, strlen(text), tag, err);
    free(text);
    return rc;
}

typedef enum { HOLDER_NONE, HOLDER_ME, HOLDER_ENDED, HOLDER_EXPIRED, HOLDER_LIVE } holder_state;

static holder_state judge(const lease_t *l, const lease_info *in, double *age)
{
    *age = sp_wall_time() - in->renewed;
    if (strcmp(in->id.job, l->me.job) == 0)
        return HOLDER_ME;
    if (strcmp(in->id.host, l->me.host) == 0 && !sp_pid_running(in->id.pid))
        return HOLDER_ENDED;
    double ttl = in->ttl_s > 0 ? in->ttl_s : l->o.ttl_s;
    return *age > ttl ? HOLDER_EXPIRED : HOLDER_LIVE;
}

static void describe(const lease_info *in, double age, char *buf, size_t n)
{
    sp_cutf(buf, n, "pid %ld on host %s (job %s, run.dir %s), renewed %.0f s ago", in->id.pid,
            in->id.host, in->id.job, in->run_dir[0] ? in->run_dir : "?", age);
}

static int fatal_store_error(int rc)
{
    return rc == STORE_EAUTH || rc == STORE_ENOBUCKET || rc == STORE_EUSAGE;
}

/* A store error that retrying cannot mend, as the job's error (exit 2). */
static int refuse_store(lease_t *l, const sp_err *e, sp_err *err)
{
    *err = *e;
    sp_err_prefix(err, "%s: the store refuses to hold this job's checkpoints: ",
                  store_url(l->st));
    err->code = SP_EXIT_USAGE;
    return err->code;
}

/* The renewal thread: every ttl/3 (every 2 s while the store has not been
 * reached), reads the lease and, while it is still this job's (or free),
 * writes it again, replacing only what it read. Another job's lease found
 * there means this job lost it; one written between the read and the write
 * is read again at once. */
static void *renew_main(void *arg)
{
    lease_t *l = arg;
    sp_name_thread("lease-renew");
    int again = 0; /* the last write found the lease changed since its read */
    pthread_mutex_lock(&l->mu);
    while (!l->stop && !l->lost) {
        double every = again ? 0.0 : l->written ? l->o.ttl_s / 3.0 : 2.0;
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        double until = (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9 + every;
        ts.tv_sec = (time_t)until;
        ts.tv_nsec = (long)((until - (double)ts.tv_sec) * 1e9);
        while (!again && !l->stop && pthread_cond_timedwait(&l->cv, &l->mu, &ts) != ETIMEDOUT)
            ;
        if (l->stop)
            break;
        pthread_mutex_unlock(&l->mu);
        lease_info in;
        sp_err e = {0};
        double age = 0;
        char tag[STORE_TAG_MAX];
        int rc = lease_read(l->st, &in, tag, &e), lost = 0, wrote = 0;
        again = 0;
        holder_state h = rc == 1 ? judge(l, &in, &age) : HOLDER_NONE;
        /* another job's lease: live, or (once this job had written its own)
         * any, since it was written over this job's */
        int other = h == HOLDER_LIVE ||
                    (l->written && (h == HOLDER_ENDED || h == HOLDER_EXPIRED));
        if (rc >= 0 && other) {
            char who[SP_ERR_MSG_MAX];
            describe(&in, age, who, sizeof who);
            sp_fail(&e, SP_EXIT_USAGE, "%s/%s: another job holds this prefix now: %s",
                    store_url(l->st), LEASE_KEY, who);
            lost = 1;
        } else if (rc >= 0) {
            int w = lease_write(l, tag, &e);
            wrote = w == 0;
            again = w == STORE_EEXIST;
        }
        pthread_mutex_lock(&l->mu);
        if (lost) {
            l->lost = 1;
            l->lost_err = e;
        }
        l->written |= wrote;
    }
    int release = l->written && !l->lost;
    pthread_mutex_unlock(&l->mu);
    if (release) { /* the end of the job: the lease goes, if it is still this job's */
        lease_info in;
        sp_err e = {0};
        double age;
        if (lease_read(l->st, &in, NULL, &e) == 1 && judge(l, &in, &age) == HOLDER_ME)
            store_delete(l->st, LEASE_KEY, &e);
    }
    pthread_mutex_lock(&l->mu);
    l->done = 1;
    pthread_cond_broadcast(&l->cv);
    pthread_mutex_unlock(&l->mu);
    return NULL;
}

static void lease_free(lease_t *l)
{
    free(l->run_dir);
    store_close(l->st);
    pthread_mutex_destroy(&l->mu);
    pthread_cond_destroy(&l->cv);
    free(l);
}

/* Reads the lease until it is free, this job's, ended or expired (1: tag
 * receives the version read, "" for none), the store cannot be reached (0),
 * or it fails (< 0: err set). */
static int wait_for_lease(lease_t *l, char *tag, char *note, size_t n, sp_err *err)
{
    double t0 = sp_now();
    note[0] = 0;
    for (;;) {
        lease_info in;
        double age = 0;
        sp_err e = {0};
        int rc = lease_read(l->st, &in, tag, &e);
        if (rc < 0 && fatal_store_error(rc)) {
            refuse_store(l, &e, err);
            return -1;
        }
        if (rc < 0)
            return 0;
        holder_state h = rc == 1 ? judge(l, &in, &age) : HOLDER_NONE;
        char who[SP_ERR_MSG_MAX];
        describe(&in, age, who, sizeof who);
        if (h == HOLDER_ENDED || h == HOLDER_EXPIRED)
            sp_cutf(note, n, "%s/%s: taking over the lease of %s, which has %s",
                    store_url(l->st), LEASE_KEY, who, h == HOLDER_ENDED ? "ended" : "expired");
        if (h != HOLDER_LIVE)
            return 1;
        if (l->o.take_over) {
            sp_cutf(note, n, "%s/%s: taking over (as told) the live lease of %s",
                    store_url(l->st), LEASE_KEY, who);
            return 1;
        }
        if (sp_now() - t0 >= l->o.wait_s) {
            sp_fail(err, SP_EXIT_USAGE,
                    "%s is in use by another job: %s (waited %.0f s); stop that job, or start "
                    "this one with --takeover if it is gone",
                    store_url(l->st), who, l->o.wait_s);
            return -1;
        }
        struct timespec ts = {1, 0};
        nanosleep(&ts, NULL);
    }
}

int lease_acquire(lease_t **out, store_t *st, const lease_opts *o, int *connected, char *note,
                  size_t n, sp_err *err)
{
    *out = NULL;
    *connected = 0;
    note[0] = 0;
    lease_t *l = calloc(1, sizeof *l);
    if (!l)
        return sp_fail(err, SP_EXIT_OTHER, "out of memory");
    l->st = st;
    l->o = *o;
    identity_init(&l->me);
    l->run_dir = strdup(o->run_dir ? o->run_dir : "");
    if (!l->run_dir) {
        free(l);
        store_close(st);
        return sp_fail(err, SP_EXIT_OTHER, "out of memory");
    }
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_mutex_init(&l->mu, NULL);
    pthread_cond_init(&l->cv, &ca);
    pthread_condattr_destroy(&ca);
    /* Another job that writes the lease between this job's read and write
     * makes the write fail (where the store checks the condition): the lease
     * is read and judged again, as any other job's. */
    for (int tries = 0;; tries++) {
        char tag[STORE_TAG_MAX];
        int free_ = wait_for_lease(l, tag, note, n, err);
        if (free_ < 0) {
            lease_free(l);
            return err->code;
        }
        if (free_ == 0)
            break;
        sp_err e = {0};
        int rc = lease_write(l, tag, &e);
        if (rc == STORE_EEXIST && tries < LEASE_RACES)
            continue;
        if (rc == STORE_EEXIST) {
            sp_fail(err, SP_EXIT_USAGE,
                    "%s/%s changed each of the %d times this job wrote it: other jobs are "
                    "starting on this prefix",
                    store_url(l->st), LEASE_KEY, LEASE_RACES + 1);
            lease_free(l);
            return err->code;
        }
        if (rc && fatal_store_error(rc)) {
            refuse_store(l, &e, err);
            lease_free(l);
            return err->code;
        }
        l->written = rc == 0;
        break;
    }
    if (pthread_create(&l->thread, NULL, renew_main, l) != 0) {
        lease_free(l);
        return sp_fail(err, SP_EXIT_OTHER, "cannot start the lease thread");
    }
    *connected = l->written;
    *out = l;
    return 0;
}

int lease_lost(lease_t *l, sp_err *err)
{
    if (!l)
        return 0;
    pthread_mutex_lock(&l->mu);
    int lost = l->lost;
    if (lost && err)
        *err = l->lost_err;
    pthread_mutex_unlock(&l->mu);
    return lost;
}

int lease_held(lease_t *l)
{
    if (!l)
        return 0;
    pthread_mutex_lock(&l->mu);
    int held = l->written && !l->lost;
    pthread_mutex_unlock(&l->mu);
    return held;
}

void lease_release(lease_t *l)
{
    if (!l)
        return;
    /* The thread deletes the lease and ends; a store that hangs must not
     * hold the end of the job (a preemption notice leaves seconds), so after
     * RELEASE_WAIT_S the thread is left to finish on its own, with the lease
     * and its store, until the process exits. */
    struct timespec until;
    clock_gettime(CLOCK_MONOTONIC, &until);
    until.tv_sec += RELEASE_WAIT_S;
    pthread_mutex_lock(&l->mu);
    l->stop = 1;
    pthread_cond_broadcast(&l->cv);
    while (!l->done && pthread_cond_timedwait(&l->cv, &l->mu, &until) != ETIMEDOUT)
        ;
    int done = l->done;
    pthread_mutex_unlock(&l->mu);
    if (!done) {
        pthread_detach(l->thread);
        pthread_mutex_lock(&left_mu);
        l->next_left = left_leases;
        left_leases = l;
        pthread_mutex_unlock(&left_mu);
        return;
    }
    pthread_join(l->thread, NULL);
    lease_free(l);
}

const char *lease_job(const lease_t *l)
{
    return l ? l->me.job : "";
}

int lease_check(store_t *st, const char *job, sp_err *why)
{
    lease_info in;
    sp_err e = {0};
    int rc = lease_read(st, &in, NULL, &e);
    if (rc == 1 && strcmp(in.id.job, job) == 0)
        return 1;
    if (rc < 0)
        sp_fail(why, SP_EXIT_OTHER, "%s/%s cannot be read: %s", store_url(st), LEASE_KEY, e.msg);
    else if (rc == 0)
        sp_fail(why, SP_EXIT_OTHER, "%s/%s: this job's lease is not written yet", store_url(st),
                LEASE_KEY);
    else {
        char who[SP_ERR_MSG_MAX];
        describe(&in, sp_wall_time() - in.renewed, who, sizeof who);
        sp_fail(why, SP_EXIT_OTHER, "%s/%s is not this job's but that of %s", store_url(st),
                LEASE_KEY, who);
    }
    return 0;
}
