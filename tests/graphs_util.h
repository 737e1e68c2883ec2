/* tests/graphs_util.h — training with captured micro-batches
 * (model_opts.graphs, runtime.cuda_graphs) against the same training
 * without, on one backend: a 2-layer tiny model, 5 steps of 2 micro-batches
 * of 2 x 24 tokens, a trained-token count (the loss gradient's scale) that
 * changes every step, dropout seeds that change every micro-batch, and
 * each step's update (model_update) with a learning rate that changes
 * every step and a clip bound below the norm.
 * Asserts every step's loss and gradient norm and the trained parameters
 * the same, bit for bit (every backend is deterministic), graphs
 * never turned off, one capture of the micro-batch and every micro-batch
 * of the usual shape after the second a replay (the odd one, eager), and
 * one capture of the update, every update after the first a replay. */
#ifndef SPOTUNE_TESTS_GRAPHS_UTIL_H
#define SPOTUNE_TESTS_GRAPHS_UTIL_H

typedef struct graphs_case {
    int mode;      /* MODE_LORA or MODE_FULL */
    double dropout; /* LoRA dropout */
    int recompute; /* RECOMPUTE_* */
    int packed;    /* packed documents whose boundaries move every step */
    int odd_last;  /* the last micro-batch of step 4 has one window */
    int dora;      /* DoRA (LoRA mode) */
    int nf4;       /* QLoRA: the projections NF4 (LoRA mode) */
    int nan_step;  /* this step's gradient gets a NaN before its update, which
                      must change nothing (1-based; 0: none) */
    int eval_between; /* an evaluation of another batch and a download of the
                         last layer's NF4 down projection after each update
                         (what a run's validation and export do between
                         steps: other weights in the NF4 workspace) */
} graphs_case;

void graphs_same_as_eager(const char *backend, const graphs_case *gc, const char *what);

/* The same training, with every capture refused by the backend (as a
 * device may refuse one): graphs turned off for the run, saying why, after
 * the second micro-batch, which runs eagerly; the run the same bits as
 * eager. */
void graphs_refused_run_eagerly(const char *backend, const graphs_case *gc, const char *what);

/* The same training twice, without graphs: the same bits (a deterministic
 * backend; full fine-tuning's embedding gradient sums repeated tokens). */
void graphs_run_twice_the_same(const char *backend, const graphs_case *gc, const char *what);

#endif
