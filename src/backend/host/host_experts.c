/*
 * Host reference SwiGLU experts and AdamW. Per expert e with rows [o_e, o_{e+1}):
 *   hpre = xp · w1[e]  ([R,2,F]: gate, up)   act = silu(gate) * up   out = act · w2[e]
 * Backward:
 *   d_act = d_out · w2[e]^T        dw2[e] += act^T · d_out
 *   d_gate = d_act * up * silu'(gate), d_up = d_act * silu(gate)
 *   d_xp = d_hpre · w1[e]^T        dw1[e] += xp^T · d_hpre
 * with silu(g) = g σ(g), silu'(g) = σ(g) (1 + g (1 - σ(g))).
 */
#include <math.h>
#include <string.h>

#include "core/error.h"
#include "host_ops.h"

/* C[m,n] (+)= A[m,p] · B[p,n] with optional transposes given as strides; fp64 accumulation.
 * a(i,l) = A[i*as0 + l*as1], b(l,j) = B[l*bs0 + j*bs1]. */
static void matmul(float *c, int64_t m, int64_t n, int64_t p, const float *a, int64_t as0,
                   int64_t as1, const float *b, int64_t bs0, int64_t bs1, bool accumulate)
{
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < n; j++) {
            double acc = 0;
            for (int64_t l = 0; l < p; l++)
                acc += (double)a[i * as0 + l * as1] * b[l * bs0 + j * bs1];
            c[i * n + j] = (float)(accumulate ? c[i * n + j] + acc : acc);
        }
}

static double sigm(double v) { return 1.0 / (1.0 + exp(-v)); }

moe_status_t moe_host_experts_forward(void *ctx, const moe_experts_t *a)
{
    (void)ctx;
    int64_t h = a->h, f = a->f;
    const float *xp = a->xp, *w1 = a->w1, *w2 = a->w2;
    float *hpre = a->hpre, *act = a->act, *out = a->out;
    for (int32_t e = 0; e < a->el; e++) {
        int64_t r0 = a->host_offsets[e], rows = a->host_offsets[e + 1] - r0;
        if (rows == 0) continue;
        matmul(hpre + r0 * 2 * f, rows, 2 * f, h, xp + r0 * h, h, 1, w1 + e * h * 2 * f, 2 * f, 1,
               false);
        for (int64_t r = r0; r < r0 + rows; r++)
            for (int64_t i = 0; i < f; i++) {
                double g = hpre[r * 2 * f + i], u = hpre[r * 2 * f + f + i];
                act[r * f + i] = (float)(g * sigm(g) * u);
            }
        matmul(out + r0 * h, rows, h, f, act + r0 * f, f, 1, w2 + e * f * h, h, 1, false);
    }
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_host_experts_backward(void *ctx, const moe_experts_t *a)
{
    (void)ctx;
    int64_t h = a->h, f = a->f;
    const float *xp = a->xp, *w1 = a->w1, *w2 = a->w2, *hpre = a->hpre, *act = a->act;
    const float *d_out = a->d_out;
    float *d_xp = a->d_xp, *dw1 = a->dw1, *dw2 = a->dw2;
    float *d_act = a->scratch; /* [R,F] then d_hpre [R,2,F] after it */
    int64_t total = a->host_offsets[a->el];
    float *d_hpre = d_act + total * f;
    bool add = !a->overwrite_grads;
    for (int32_t e = 0; e < a->el; e++) {
        int64_t r0 = a->host_offsets[e], rows = a->host_offsets[e + 1] - r0;
        if (rows == 0) {
            if (add) continue;
            memset(dw1 + e * h * 2 * f, 0, sizeof(float) * (size_t)(h * 2 * f));
            memset(dw2 + e * f * h, 0, sizeof(float) * (size_t)(f * h));
            continue;
        }
        /* d_act = d_out · w2^T ; dw2 (+)= act^T · d_out */
        matmul(d_act + r0 * f, rows, f, h, d_out + r0 * h, h, 1, w2 + e * f * h, 1, h, false);
        matmul(dw2 + e * f * h, f, h, rows, act + r0 * f, 1, f, d_out + r0 * h, h, 1, add);
        for (int64_t r = r0; r < r0 + rows; r++)
            for (int64_t i = 0; i < f; i++) {
                double g = hpre[r * 2 * f + i], u = hpre[r * 2 * f + f + i], s = sigm(g);
                double da = d_act[r * f + i];
                d_hpre[r * 2 * f + i] = (float)(da * u * s * (1.0 + g * (1.0 - s)));
                d_hpre[r * 2 * f + f + i] = (float)(da * g * s);
            }
        /* d_xp = d_hpre · w1^T ; dw1 (+)= xp^T · d_hpre */
        matmul(d_xp + r0 * h, rows, h, 2 * f, d_hpre + r0 * 2 * f, 2 * f, 1, w1 + e * h * 2 * f, 1,
               2 * f, false);
        matmul(dw1 + e * h * 2 * f, h, 2 * f, rows, xp + r0 * h, 1, h, d_hpre + r0 * 2 * f, 2 * f,
               1, add);
    }
    return MOE_STATUS_SUCCESS;
}

/* The reference arithmetic the CUDA pass repeats operation for operation (kernels/adamw.cu):
 * the moments in fp32, the bias corrections, the step and the decay in fp64. */
static void adamw_tensor(const moe_adamw_update_t *a, const moe_adamw_tensor_t *t, double bc1,
                         double bc2)
{
    const float *grad = t->grad;
    float *param = t->param;
    for (int64_t i = 0; i < t->n; i++) {
        float g = grad[i] * a->grad_scale;
        t->m[i] = a->beta1 * t->m[i] + (1.0f - a->beta1) * g;
        t->v[i] = a->beta2 * t->v[i] + (1.0f - a->beta2) * g * g;
        double mhat = t->m[i] / bc1, vhat = t->v[i] / bc2;
        double p = t->master[i];
        p -= a->lr * (mhat / (sqrt(vhat) + a->eps) + a->weight_decay * p);
        t->master[i] = (float)p;
        param[i] = (float)p;
    }
}

moe_status_t moe_host_adamw_update(void *ctx, const moe_adamw_update_t *a)
{
    (void)ctx;
    double bc1 = 1.0 - pow(a->beta1, (double)a->step);
    double bc2 = 1.0 - pow(a->beta2, (double)a->step);
    for (int32_t i = 0; i < a->count; i++) adamw_tensor(a, &a->tensors[i], bc1, bc2);
    return MOE_STATUS_SUCCESS;
}
