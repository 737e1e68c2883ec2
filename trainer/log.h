/* trainer/log.h — what a run tells its user: the progress line (step, loss,
 * lr, grad norm, tokens/s, elapsed, ETA) and the metrics JSONL file a user
 * plots (one JSON object per line, "event" says which kind). Owns the
 * metrics file handle. Only rank 0 logs. */
#ifndef SPOTUNE_LOG_H
#define SPOTUNE_LOG_H

#include <stdint.h>
#include <stdio.h>

#include "../base/base.h"

typedef struct metrics {
    FILE *f;
    int fresh; /* metrics.jsonl was absent or empty when opened (a new run
                  directory: a resume then starts from the checkpoint's copy) */
} metrics_t;

int metrics_open(metrics_t *m, const char *run_dir, sp_err *err);
void metrics_close(metrics_t *m);

typedef struct step_report {
    int64_t step, total_steps;
    double loss, lr, grad_norm, tokens_per_s, elapsed_s, eta_s, step_s;
    int64_t tokens;    /* trained (masked-in) tokens of this step, all ranks */
    int remote_behind; /* checkpoints not yet in the remote store; -1: no remote */
} step_report;

void log_step(FILE *out, metrics_t *m, const step_report *r, int print);
void log_val(FILE *out, metrics_t *m, int64_t step, double val_loss, int64_t tokens);
/* Whether RUN_DIR/metrics.jsonl holds a validation record of step (a
 * resumed run whose stop gave up that validation runs it first). Flushes
 * m's own records first; an unreadable file holds none. */
int metrics_has_val(metrics_t *m, const char *run_dir, int64_t step);
/* An event with a free-form message (info, warning) to both outputs. */
void log_event(FILE *out, metrics_t *m, const char *event, const char *fmt, ...) SP_PRINTF(4, 5);
/* The same with fields of its own merged into the metrics record: fields
 * is a jansson object whose reference is taken (NULL: none). */
struct json_t;
void log_event_with(FILE *out, metrics_t *m, const char *event, struct json_t *fields,
                    const char *fmt, ...) SP_PRINTF(5, 6);
/* h:mm:ss */
void log_duration(char *buf, size_t n, double seconds);

#endif
