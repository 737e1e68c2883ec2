/* Schedules and clipping. */
#include "optim.h"

#include <math.h>

#include "../kernels/backend.h"

double optim_lr(const config_t *c, int64_t step)
{
    if (c->warmup_steps > 0 && step < c->warmup_steps)
        return c->lr * (double)(step + 1) / (double)c->warmup_steps;
    if (c->schedule == SCHED_CONSTANT)
        return c->lr;
    int64_t span = c->steps - c->warmup_steps;
    double progress = span > 1 ? (double)(step - c->warmup_steps) / (double)(span - 1) : 1.0;
    if (progress > 1.0)
        progress = 1.0;
    double f = c->schedule == SCHED_COSINE ? 0.5 * (1.0 + cos(3.14159265358979323846 * progress))
                                           : 1.0 - progress;
    return c->min_lr + (c->lr - c->min_lr) * f;
}

double optim_clip_scale(double grad_norm, double max_norm)
{
    return adamw_clip_scale(grad_norm, max_norm); /* as the kernels clip */
}
