/* tests/resume_util.h — helpers of the preemption and resume suites
 * (test_resume.c, test_ckpt_policy.c): each suite's setup makes DIR with the
 * tiny model (DIR/model), another one (DIR/other), the data and a LoRA
 * DIR/run.yaml; runs go to DIR/NAME. */
#ifndef SPOTUNE_TESTS_RESUME_UTIL_H
#define SPOTUNE_TESTS_RESUME_UTIL_H

#include <stddef.h>

extern char *dir;

/* run.yaml's seed and seq_len (the sample audit re-derives the data order) */
enum { SEED = 21, SEQ_LEN = 32 };

/* What a barrage of signals met: how many were sent, how many found the
 * process still running, and how many of those came after the stop
 * checkpoint had been handed to the writer (its metrics record is out) and
 * before it was committed. */
typedef struct barrage {
    int sent, running, in_save;
} barrage;

/* One record {"event":"checkpoint",...} of metrics.jsonl */
typedef struct ck_record {
    long long step;
    char reason[32];
    double stall_s, waited_s, bytes, time;
} ck_record;

/* One row of RUN_DIR/samples/rank-R.tsv (log.samples) */
typedef struct sample_row {
    long long step;
    unsigned long long sample, epoch, window;
} sample_row;

void resume_setup(void);
void resume_teardown(void);
const char *train_cmd(const char *prefix, const char *name, const char *extra);
int run(const char *prefix, const char *name, const char *extra, char **out);
int read_losses(const char *name, double *v, int max);
int last_step(const char *name);
size_t read_proc(const char *path, char *buf, size_t cap);
int proc_running(int pid);
void wait_step(const char *name, int step, int pid);
void expect_same_run(const char *a, const char *b, int bitwise);
char *read_log(const char *name);
int expect_checkpoints_verify(const char *name);
int stopped_at(const char *name, const char *text);
void stop_with(const char *prefix, const char *name, const char *extra, int sig, int at_step);
int signal_until_exit(int pid, int sig, double every_s, const char *name, barrage *b);
int rank_pid(int launcher, int rank);
double field(const char *rec, const char *key);
int checkpoint_records(const char *name, ck_record *r, int max);
void expect_stall_reported(const ck_record *r, int n, const char *log);
/* An integer member of DIR/model/config.json. */
long model_config_int(const char *key);
/* Reads up to max rows of rank R's sample log; returns how many. */
int read_samples(const char *name, int rank, sample_row *rows, int max);
/* data.packing the runs use (DATA_PACK_*; default stream): which windows
 * the global samples map to. */
extern int resume_packing;
/* Over steps steps of G windows, the rows hold every global sample
 * 0 .. steps x G - 1 exactly once, each in its own step, as the window the
 * (seed, epoch) permutation of DIR/data.train.h5 assigns it. */
void expect_every_sample_once(const sample_row *rows, int n, int steps, long long G);

#endif
