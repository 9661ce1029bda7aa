/* Learning-rate schedules: linear warm-up, then constant, linear or cosine decay to a floor
 * (the formula is in moe/optim.h). */
#include <math.h>

#include <moe/optim.h>

float moe_lr_schedule_rate(const moe_lr_schedule_t *s, float lr, int64_t step)
{
    if (!s || !(lr > 0) || step < 1 || s->warmup_steps < 0 || !(s->min_lr_ratio >= 0) ||
        s->min_lr_ratio > 1)
        return -1.0f;
    if (s->decay != MOE_LR_CONSTANT && s->decay != MOE_LR_LINEAR && s->decay != MOE_LR_COSINE)
        return -1.0f;
    if (s->decay != MOE_LR_CONSTANT && s->decay_steps <= s->warmup_steps) return -1.0f;
    if (step <= s->warmup_steps) return lr * (float)((double)step / (double)s->warmup_steps);
    if (s->decay == MOE_LR_CONSTANT) return lr;
    double p = (double)(step - s->warmup_steps) / (double)(s->decay_steps - s->warmup_steps);
    if (p > 1) p = 1;
    double lo = (double)s->min_lr_ratio * lr, hi = lr;
    double rate = s->decay == MOE_LR_LINEAR ? hi - (hi - lo) * p
                                            : lo + (hi - lo) * 0.5 * (1.0 + cos(M_PI * p));
    return (float)rate;
}
