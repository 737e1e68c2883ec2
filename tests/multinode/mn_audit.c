/* tests/multinode/mn_audit.c — the exactly-once audit of a run that was
 * interrupted and resumed (log.samples): every global sample index
 * 0 .. steps x global_batch - 1 is trained exactly once, in its own step, as
 * the window that the (seed, epoch) permutation assigns it. Rows of the
 * first run after the step it was resumed from are work lost with the
 * crash (retrained by the second run) and are not counted; the second run
 * must train nothing at or before that step.
 *
 * usage: spotune-mn-audit DATA.h5 SEQ_LEN VOCAB SEED STEPS GLOBAL_BATCH
 *                         RESUMED_STEP FIRST_RUN_TSV... -- SECOND_RUN_TSV...
 * Prints what it checked; exits 0 when all holds, 1 otherwise (each problem
 * named, the first 20 of each kind), 2 on bad arguments or files. */
#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/base.h"
#include "trainer/data.h"

typedef struct row {
    long long step;
    unsigned long long sample, epoch, window;
} row;

static row *rows;
static size_t nrows, caprows;

/* Appends the rows of one samples file; second: 0 or 1. Returns the count. */
static long read_rows(const char *path, int second, unsigned char **from_second)
{
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "mn-audit: cannot open %s\n", path);
        exit(2);
    }
    long n = 0;
    row r;
    /* a killed rank may leave a torn last line: the scan stops there */
    while (fscanf(f, "%lld %llu %llu %llu", &r.step, &r.sample, &r.epoch, &r.window) == 4) {
        if (nrows == caprows) {
            caprows = caprows ? 2 * caprows : 4096;
            rows = realloc(rows, caprows * sizeof *rows);
            *from_second = realloc(*from_second, caprows);
            if (!rows || !*from_second) {
                fprintf(stderr, "mn-audit: out of memory\n");
                exit(2);
            }
        }
        (*from_second)[nrows] = (unsigned char)second;
        rows[nrows++] = r;
        n++;
    }
    fclose(f);
    return n;
}

int main(int argc, char **argv)
{
    if (argc < 10) {
        fprintf(stderr, "usage: spotune-mn-audit DATA.h5 SEQ_LEN VOCAB SEED STEPS GLOBAL_BATCH "
                        "RESUMED_STEP FIRST.tsv... -- SECOND.tsv...\n");
        return 2;
    }
    const char *data = argv[1];
    long long seq_len = atoll(argv[2]), vocab = atoll(argv[3]);
    unsigned long long seed = strtoull(argv[4], NULL, 10);
    long long steps = atoll(argv[5]), G = atoll(argv[6]), at = atoll(argv[7]);
    if (seq_len < 1 || vocab < 1 || steps < 1 || G < 1 || at < 0 || at > steps) {
        fprintf(stderr, "mn-audit: bad numbers\n");
        return 2;
    }
    unsigned char *second = NULL;
    int phase = 0, files[2] = {0, 0};
    long per[2] = {0, 0};
    for (int i = 8; i < argc; i++) {
        if (!strcmp(argv[i], "--")) {
            phase = 1;
            continue;
        }
        per[phase] += read_rows(argv[i], phase, &second);
        files[phase]++;
    }
    if (!files[0] || !files[1]) {
        fprintf(stderr, "mn-audit: sample files of both runs are needed\n");
        return 2;
    }

    dataset_t d;
    sp_err err = {0};
    if (dataset_open(&d, data, seq_len, vocab, seed, &err)) {
        fprintf(stderr, "mn-audit: %s\n", err.msg);
        return 2;
    }
    uint64_t total = (uint64_t)steps * (uint64_t)G;
    int *count = calloc(total, sizeof *count);
    if (!count) {
        fprintf(stderr, "mn-audit: out of memory\n");
        return 2;
    }
    long bad_step = 0, bad_window = 0, late = 0, early = 0, lost = 0;
    for (size_t k = 0; k < nrows; k++) {
        const row *r = &rows[k];
        if (!second[k] && r->step > at) {
            lost++; /* trained after the checkpoint the restart resumed from */
            continue;
        }
        if (second[k] && r->step <= at) {
            if (early++ < 20)
                printf("FAIL the resumed run trained step %lld (it resumed from step %lld)\n",
                       r->step, at);
            continue;
        }
        if (r->step < 1 || r->step > steps || r->sample >= total) {
            if (late++ < 20)
                printf("FAIL step %lld sample %llu outside the run (%lld steps of %lld)\n",
                       r->step, r->sample, steps, G);
            continue;
        }
        count[r->sample]++;
        if (r->sample / (uint64_t)G + 1 != (uint64_t)r->step && bad_step++ < 20)
            printf("FAIL sample %llu trained in step %lld\n", r->sample, r->step);
        uint64_t w = 0, e = 0;
        if (dataset_window_of(&d, r->sample, &w, &e, &err)) {
            fprintf(stderr, "mn-audit: %s\n", err.msg);
            return 2;
        }
        if ((w != r->window || e != r->epoch) && bad_window++ < 20)
            printf("FAIL sample %llu is epoch %llu window %llu, but epoch %llu window %llu was "
                   "trained\n",
                   r->sample, (unsigned long long)e, (unsigned long long)w, r->epoch, r->window);
    }
    dataset_close(&d);
    long missing = 0, repeated = 0;
    for (uint64_t s = 0; s < total; s++) {
        if (count[s] == 0 && missing++ < 20)
            printf("FAIL global sample %llu never trained\n", (unsigned long long)s);
        if (count[s] > 1 && repeated++ < 20)
            printf("FAIL global sample %llu trained %d times\n", (unsigned long long)s, count[s]);
    }
    free(count);
    free(rows);
    free(second);
    printf("audit: %ld rows of the first run (%d files, %ld after step %lld not counted), %ld of "
           "the resumed run (%d files); %llu samples: %ld missing, %ld repeated, %ld in the wrong "
           "step, %ld with the wrong window, %ld out of range, %ld trained again before the "
           "resume point\n",
           per[0], files[0], lost, at, per[1], files[1], (unsigned long long)total, missing,
           repeated, bad_step, bad_window, late, early);
    return missing || repeated || bad_step || bad_window || late || early ? 1 : 0;
}
