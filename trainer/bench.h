/* trainer/bench.h — `spotune bench`: a model of a preset built with random
 * weights directly on the backend (no files), timed training steps (LoRA
 * and/or full), tokens/s, peak memory and MFU, and step 1's loss and
 * gradient norm, checked (a loss random weights can have; on the small
 * presets, the same step on the CPU backend). Under mpirun the gradients
 * are all-reduced as in training and tokens/s counts every rank. */
#ifndef SPOTUNE_BENCH_H
#define SPOTUNE_BENCH_H

#include "../comm/comm.h"
#include "model_config.h"

int bench_main(int argc, char **argv, comm_t *comm, sp_err *err);

/* The checks of step 1 (before any update), exposed for their tests.
 * Random weights (N(0, 0.02), norms 1) give each logit a N(0, 0.0004 x
 * hidden) spread, so the expected mean token loss is ln(vocab) + 0.0002 x
 * hidden: 7B +0.82, 13B +1.02 over ln(vocab). */
#define BENCH_LOSS_BAND 1.0 /* |step-1 loss - expected| allowed */
/* Step 1 on the backend against the same step on the CPU backend (relative).
 * The loss of random weights hardly depends on what the layers compute, and
 * bf16 moves it by about 1e-4 relative (a few 1e-3 of each logit, averaged
 * over the tokens): 5e-3 still catches a wrong head or loss. The gradient
 * norm depends on every op of the backward; bf16 noise in its elements
 * (about 1% each, random) moves the norm far less than 2e-2. */
#define BENCH_LOSS_TOL 5e-3
#define BENCH_GNORM_TOL 2e-2
#define BENCH_EXIT_NO_DEVICE 77 /* --probe-cuda: none usable */
double bench_expected_loss(const model_config_t *mc);
/* 0 when loss is finite and within BENCH_LOSS_BAND of the expected loss;
 * why (n bytes) says what was found either way. */
int bench_check_loss(double loss, const model_config_t *mc, char *why, size_t n);
/* 0 when both relative differences are within their tolerance (and every
 * number is finite); why says the figures either way. */
int bench_check_against_cpu(double loss, double gnorm, double cpu_loss, double cpu_gnorm,
                            double loss_tol, double gnorm_tol, char *why, size_t n);
/* 6 x every parameter of the model: the common convention's FLOPs per token. */
double bench_flops_6n(const model_config_t *mc);
/* Model FLOPs per trained token, the honest count (PaLM's convention:
 * matmuls forward 2N, backward 2N for activations plus 2N for weights when
 * they train, so 4N for the frozen weights of LoRA and 6N for the trainable
 * ones, LoRA adapters (lora_params) included, lm_head counted, the
 * embedding gather not; attention 12 x layers x heads x head_dim x ctx;
 * recomputation not counted). mode: MODE_LORA or MODE_FULL. ctx: the
 * keys a token's attention is counted over, T for dense rows of T tokens,
 * bench_attention_context for packed documents. */
double bench_flops_per_token(const model_config_t *mc, int mode, double lora_params, double ctx);
/* The attention's context per token of B rows of T tokens whose documents
 * start where seg says (seg[b T + t]: the position in row b where t's
 * document starts; NULL: each row one document): sum of l^2 over the
 * documents, l their lengths, over B T. A token of a document of l tokens
 * attends only within it, so its attention counts as a row of l; dense rows
 * give T. */
double bench_attention_context(const int32_t *seg, int B, int T);

#endif
