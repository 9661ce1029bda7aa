/*
 * Host reference router. N tokens, H hidden, E experts, K top-k.
 *
 * Forward: logits = x·wg (fp64 accumulation), scores s = softmax(logits) or sigmoid(logits),
 * selection on s + bias (bias only chooses; weights come from s), weights renormalised over
 * the k chosen when asked. The normalised score q (softmax: s; sigmoid: s / sum_e s) feeds
 * the aux loss P_e = mean_t q[t,e] and the routing entropy.
 *
 * Backward, per token (g = d loss / d something):
 *   renorm     w_k = r_k / S, S = sum_j r_j        => g_r_j = (g_w_j - sum_k g_w_k w_k) / S
 *   selection  g_s[e_k] += g_r_k (the chosen raw scores)
 *   aux        aux = E sum_e f_e P_e               => g_q[t,e] += aux_coef * E f_e / N
 *   q -> s     softmax: q = s; sigmoid: q = s / Q  => g_s[e] += (g_q[e] - sum_j g_q[j] q_j) / Q
 *   s -> logit softmax: p (g - <g,p>); sigmoid: g s (1 - s)
 *   z          z = mean_t lse_t^2                  => g_logit += z_coef * 2 lse_t softmax / N
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "host_ops.h"

static double sigmoid(double v) { return 1.0 / (1.0 + exp(-v)); }

/* Scores of one token's logits row into s[E]; returns the row's logsumexp. */
static double token_scores(const float *logit, int32_t e, moe_score_fn_t fn, double *s)
{
    double mx = -INFINITY;
    for (int32_t j = 0; j < e; j++) mx = logit[j] > mx ? logit[j] : mx;
    double sum = 0;
    for (int32_t j = 0; j < e; j++) sum += exp(logit[j] - mx);
    double lse = mx + log(sum);
    for (int32_t j = 0; j < e; j++)
        s[j] = fn == MOE_SCORE_SOFTMAX ? exp(logit[j] - lse) : sigmoid(logit[j]);
    return lse;
}

/* Normalised scores q (sum to 1) from s; returns the normaliser Q. */
static double normalised_scores(const double *s, int32_t e, moe_score_fn_t fn, double *q)
{
    double total = 0;
    for (int32_t j = 0; j < e; j++) total += s[j];
    double norm = fn == MOE_SCORE_SOFTMAX ? 1.0 : total;
    for (int32_t j = 0; j < e; j++) q[j] = s[j] / norm;
    return norm;
}

/* Top-k of key[] by descending value, ties to the lower index (stable selection). */
static void top_k(const double *key, int32_t e, int32_t k, int32_t *idx)
{
    for (int32_t i = 0; i < k; i++) {
        int32_t best = -1;
        for (int32_t j = 0; j < e; j++) {
            bool taken = false;
            for (int32_t p = 0; p < i; p++) taken |= idx[p] == j;
            if (!taken && (best < 0 || key[j] > key[best])) best = j;
        }
        idx[i] = best;
    }
}

moe_status_t moe_host_router_forward(void *ctx, const moe_router_fwd_t *a)
{
    (void)ctx;
    const float *x = a->x, *wg = a->wg;
    int32_t e = a->e, k = a->k;
    double *s = malloc(sizeof(double) * (size_t)e * 3);
    double *pmean = calloc((size_t)e, sizeof(double));
    if (!s || !pmean) {
        free(s);
        free(pmean);
        return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "router scratch for E=%d", e);
    }
    double *q = s + e, *key = s + 2 * e;
    double z_sum = 0, entropy_sum = 0;
    memset(a->counts, 0, sizeof(int32_t) * (size_t)e);
    for (int64_t t = 0; t < a->n; t++) {
        float *logit = a->logits + t * e;
        for (int32_t j = 0; j < e; j++) {
            double acc = 0;
            for (int64_t c = 0; c < a->h; c++) acc += (double)x[t * a->h + c] * wg[c * e + j];
            logit[j] = (float)acc;
        }
        double lse = token_scores(logit, e, a->score_fn, s);
        normalised_scores(s, e, a->score_fn, q);
        z_sum += lse * lse;
        for (int32_t j = 0; j < e; j++) {
            pmean[j] += q[j];
            if (q[j] != 0) entropy_sum -= q[j] * log(q[j]); /* 0 log 0 = 0; NaN stays NaN */
            key[j] = s[j] + (a->bias ? a->bias[j] : 0.0);
        }
        int32_t *idx = a->topk_idx + t * k;
        float *w = a->topk_w + t * k;
        top_k(key, e, k, idx);
        double wsum = 0;
        for (int32_t i = 0; i < k; i++) wsum += s[idx[i]];
        for (int32_t i = 0; i < k; i++) {
            w[i] = (float)(a->renormalize ? s[idx[i]] / wsum : s[idx[i]]);
            a->counts[idx[i]]++;
        }
    }
    double inv_n = a->n > 0 ? 1.0 / (double)a->n : 0.0;
    for (int32_t j = 0; j < e; j++) a->score_mean[j] = (float)(pmean[j] * inv_n);
    a->stats[0] = (float)(z_sum * inv_n);
    a->stats[1] = (float)(entropy_sum * inv_n);
    free(s);
    free(pmean);
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_host_router_backward(void *ctx, const moe_router_bwd_t *a)
{
    (void)ctx;
    int32_t e = a->e, k = a->k;
    double *s = malloc(sizeof(double) * (size_t)e * 3);
    if (!s) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "router scratch for E=%d", e);
    double *q = s + e, *gs = s + 2 * e;
    double inv_n = a->n > 0 ? 1.0 / (double)a->n : 0.0;
    double inv_slots = a->n > 0 ? 1.0 / ((double)a->n * k) : 0.0;
    for (int64_t t = 0; t < a->n; t++) {
        const float *logit = a->logits + t * e;
        const int32_t *idx = a->topk_idx + t * k;
        const float *w = a->topk_w + t * k, *gw = a->d_topk_w + t * k;
        double lse = token_scores(logit, e, a->score_fn, s);
        double qnorm = normalised_scores(s, e, a->score_fn, q);
        for (int32_t j = 0; j < e; j++) gs[j] = 0;
        /* through the renormalisation to the chosen raw scores */
        double wsum = 0, gw_dot_w = 0;
        for (int32_t i = 0; i < k; i++) {
            wsum += s[idx[i]];
            gw_dot_w += (double)gw[i] * w[i];
        }
        for (int32_t i = 0; i < k; i++)
            gs[idx[i]] += a->renormalize ? ((double)gw[i] - gw_dot_w) / wsum : gw[i];
        /* aux: gradient on the normalised scores q, then to s */
        if (a->aux_coef != 0) {
            double gq_dot_q = 0;
            for (int32_t j = 0; j < e; j++)
                gq_dot_q += a->aux_coef * e * (a->counts[j] * inv_slots) * inv_n * q[j];
            for (int32_t j = 0; j < e; j++) {
                double g = a->aux_coef * e * (a->counts[j] * inv_slots) * inv_n;
                gs[j] += a->score_fn == MOE_SCORE_SOFTMAX ? g : (g - gq_dot_q) / qnorm;
            }
        }
        /* scores to logits */
        float *dl = a->dlogits + t * e;
        double gs_dot_s = 0;
        for (int32_t j = 0; j < e; j++) gs_dot_s += gs[j] * s[j];
        for (int32_t j = 0; j < e; j++) {
            double g = a->score_fn == MOE_SCORE_SOFTMAX ? s[j] * (gs[j] - gs_dot_s)
                                                        : gs[j] * s[j] * (1.0 - s[j]);
            if (a->z_coef != 0) g += a->z_coef * 2.0 * lse * exp(logit[j] - lse) * inv_n;
            dl[j] = (float)g;
        }
    }
    free(s);
    /* dx += dlogits · wg^T (= when overwrite_dx) ; dwg += x^T · dlogits (fp64 accumulation) */
    const float *x = a->x, *wg = a->wg;
    float *dx = a->dx, *dwg = a->dwg;
    for (int64_t t = 0; t < a->n; t++)
        for (int64_t c = 0; c < a->h; c++) {
            double acc = 0;
            for (int32_t j = 0; j < e; j++) acc += (double)a->dlogits[t * e + j] * wg[c * e + j];
            dx[t * a->h + c] = (float)acc + (a->overwrite_dx ? 0.0f : dx[t * a->h + c]);
        }
    for (int64_t c = 0; c < a->h; c++)
        for (int32_t j = 0; j < e; j++) {
            double acc = 0;
            for (int64_t t = 0; t < a->n; t++)
                acc += (double)x[t * a->h + c] * a->dlogits[t * e + j];
            dwg[c * e + j] += (float)acc;
        }
    return MOE_STATUS_SUCCESS;
}

/* counts[j] against mean = slots / E compared exactly, as counts[j] * E against slots */
moe_status_t moe_host_expert_bias_step(void *ctx, float *bias, const int32_t *counts, int32_t e,
                                       int64_t slots, float rate)
{
    (void)ctx;
    for (int32_t j = 0; j < e; j++) {
        int64_t scaled = (int64_t)counts[j] * e;
        bias[j] += rate * (float)((scaled < slots) - (scaled > slots));
    }
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_host_accumulate_counts(void *ctx, int32_t *acc, const int32_t *counts,
                                        int32_t *out, int32_t e)
{
    (void)ctx;
    for (int32_t j = 0; j < e; j++) out[j] = acc[j] += counts[j];
    return MOE_STATUS_SUCCESS;
}
