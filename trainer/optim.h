/* trainer/optim.h — the learning-rate schedule (linear warmup, then cosine,
 * linear or constant down to min_lr at the last step) and gradient clipping
 * by global norm. Pure functions of the config and the step. */
#ifndef SPOTUNE_OPTIM_H
#define SPOTUNE_OPTIM_H

#include <stdint.h>

#include "config.h"

/* Learning rate of optimizer step `step` (0-based). */
double optim_lr(const config_t *cfg, int64_t step);
/* Factor that scales gradients so their global norm is at most max_norm
 * (1 when max_norm <= 0 or the norm is within it). */
double optim_clip_scale(double grad_norm, double max_norm);

#endif
