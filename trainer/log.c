/* Progress lines and the metrics JSONL (written with jansson). */
#define _POSIX_C_SOURCE 200809L
#include "log.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int metrics_open(metrics_t *m, const char *run_dir, sp_err *err)
{
    char *path = sp_strf("%s/metrics.jsonl", run_dir);
    if (!path)
        return sp_fail(err, SP_EXIT_OTHER, "out of memory");
    struct stat sb; /* before anything of this process is written to it */
    m->fresh = stat(path, &sb) != 0 || sb.st_size == 0;
    m->f = fopen(path, "a"); /* a resumed run appends */
    int rc = m->f ? 0 : sp_fail(err, SP_EXIT_OTHER, "%s: cannot open: %s", path, strerror(errno));
    free(path);
    return rc;
}

void metrics_close(metrics_t *m)
{
    if (m->f)
        fclose(m->f);
    m->f = NULL;
}

/* Writes record o (the reference is taken; NULL: out of memory, nothing
 * written) with its time as a line of metrics.jsonl. */
static void emit(metrics_t *m, json_t *o)
{
    if (!o)
        return;
    json_object_set_new(o, "time", json_real(sp_wall_time()));
    if (m && m->f) {
        char *s = json_dumps(o, JSON_COMPACT | JSON_PRESERVE_ORDER);
        if (s) {
            fprintf(m->f, "%s\n", s);
            fflush(m->f);
            free(s);
        }
    }
    json_decref(o);
}

static json_t *num(double v)
{
    return isfinite(v) ? json_real(v) : json_null();
}

void log_duration(char *buf, size_t n, double s)
{
    if (!isfinite(s) || s < 0)
        s = 0;
    long t = (long)(s + 0.5);
    snprintf(buf, n, "%ld:%02ld:%02ld", t / 3600, (t / 60) % 60, t % 60);
}

void log_step(FILE *out, metrics_t *m, const step_report *r, int print)
{
    json_t *o = json_pack("{s:s, s:I, s:o, s:o, s:o, s:o, s:o, s:o, s:I}", "event", "train", "step",
                          (json_int_t)r->step, "loss", num(r->loss), "lr", num(r->lr), "grad_norm",
                          num(r->grad_norm), "tokens_per_s", num(r->tokens_per_s), "step_s",
                          num(r->step_s), "elapsed_s", num(r->elapsed_s), "trained_tokens",
                          (json_int_t)r->tokens);
    if (r->remote_behind >= 0)
        json_object_set_new(o, "remote_behind", json_integer(r->remote_behind));
    emit(m, o);
    if (!print || !out)
        return;
    char el[32], eta[32];
    log_duration(el, sizeof el, r->elapsed_s);
    log_duration(eta, sizeof eta, r->eta_s);
    char remote[48] = "";
    if (r->remote_behind >= 0)
        snprintf(remote, sizeof remote, " | remote behind %d", r->remote_behind);
    fprintf(out, "step %6lld/%lld | loss %.4f | lr %.3e | gnorm %.3f | %8.0f tok/s | %s elapsed | "
                 "ETA %s%s\n",
            (long long)r->step, (long long)r->total_steps, r->loss, r->lr, r->grad_norm,
            r->tokens_per_s, el, eta, remote);
    fflush(out);
}

void log_val(FILE *out, metrics_t *m, int64_t step, double val_loss, int64_t tokens)
{
    emit(m, json_pack("{s:s, s:I, s:o, s:I}", "event", "val", "step", (json_int_t)step, "val_loss",
                      num(val_loss), "val_tokens", (json_int_t)tokens));
    if (out) {
        fprintf(out, "step %6lld | val_loss %.4f (%lld tokens)\n", (long long)step, val_loss,
                (long long)tokens);
        fflush(out);
    }
}

int metrics_has_val(metrics_t *m, const char *run_dir, int64_t step)
{
    if (m && m->f)
        fflush(m->f);
    char *path = sp_strf("%s/metrics.jsonl", run_dir);
    FILE *f = path ? fopen(path, "r") : NULL;
    char *line = NULL;
    size_t cap = 0;
    int found = 0;
    while (f && !found && getline(&line, &cap, f) > 0) {
        if (!strstr(line, "\"val\"")) /* a long run's file: most lines are steps */
            continue;
        json_t *o = json_loads(line, 0, NULL);
        const char *ev = json_string_value(json_object_get(o, "event"));
        json_t *st = json_object_get(o, "step");
        found = ev && strcmp(ev, "val") == 0 && json_is_integer(st) &&
                json_integer_value(st) == (json_int_t)step;
        json_decref(o);
    }
    free(line);
    if (f)
        fclose(f);
    free(path);
    return found;
}

static void event_v(FILE *out, metrics_t *m, const char *event, json_t *fields, const char *fmt,
                    va_list ap)
{
    char *msg = sp_vstrf(fmt, ap);
    json_t *o = json_pack("{s:s, s:s}", "event", event, "message", msg ? msg : "(out of memory)");
    if (o && fields)
        json_object_update(o, fields);
    json_decref(fields);
    emit(m, o);
    if (out) {
        fprintf(out, "%s: %s\n", event, msg ? msg : "(out of memory)");
        fflush(out);
    }
    free(msg);
}

void log_event(FILE *out, metrics_t *m, const char *event, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    event_v(out, m, event, NULL, fmt, ap);
    va_end(ap);
}

void log_event_with(FILE *out, metrics_t *m, const char *event, json_t *fields, const char *fmt,
                    ...)
{
    va_list ap;
    va_start(ap, fmt);
    event_v(out, m, event, fields, fmt, ap);
    va_end(ap);
}
