/* fp64 oracle of the MoE layer (see ref_moe.h). Deliberately naive. */
#include "ref_moe.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

void ref_forward(const ref_cfg_t *c, const double *x, const double *wg, const double *w1,
                 const double *w2, double *y, ref_result_t *r)
{
    int64_t n = c->n, h = c->h, f = c->f;
    int32_t e = c->e, k = c->k;
    double *logit = malloc(sizeof(double) * (size_t)e), *s = malloc(sizeof(double) * (size_t)e);
    double *pmean = calloc((size_t)e, sizeof(double));
    int64_t *count = calloc((size_t)e, sizeof(int64_t)),
            *accepted = calloc((size_t)e, sizeof(int64_t));
    int32_t *idx = malloc(sizeof(int32_t) * (size_t)(n * k + 1));
    double *w = malloc(sizeof(double) * (size_t)(n * k + 1));
    double *act = malloc(sizeof(double) * (size_t)f);
    double z = 0, min_gap = INFINITY, entropy = 0;

    for (int64_t t = 0; t < n; t++) {
        double mx = -INFINITY, sum = 0;
        for (int32_t j = 0; j < e; j++) {
            logit[j] = 0;
            for (int64_t i = 0; i < h; i++) logit[j] += x[t * h + i] * wg[i * e + j];
            mx = fmax(mx, logit[j]);
        }
        for (int32_t j = 0; j < e; j++) sum += exp(logit[j] - mx);
        double lse = mx + log(sum), total = 0;
        z += lse * lse;
        for (int32_t j = 0; j < e; j++) {
            s[j] = c->score_fn == MOE_SCORE_SOFTMAX ? exp(logit[j] - lse)
                                                    : 1 / (1 + exp(-logit[j]));
            total += s[j];
        }
        for (int32_t j = 0; j < e; j++) {
            double q = s[j] / total;
            pmean[j] += q / (double)n;
            if (q != 0) entropy -= q * log(q) / (double)n;
        }
        /* selection: repeatedly take the largest key, lower index on ties */
        char *taken = calloc((size_t)e, 1);
        double wsum = 0;
        for (int32_t i = 0; i <= k && i < e; i++) {
            int32_t best = -1;
            for (int32_t j = 0; j < e; j++) {
                double key = s[j] + (c->bias ? c->bias[j] : 0);
                double bkey = best < 0 ? 0 : s[best] + (c->bias ? c->bias[best] : 0);
                if (!taken[j] && (best < 0 || key > bkey)) best = j;
            }
            double bkey = s[best] + (c->bias ? c->bias[best] : 0);
            if (i == k) { /* the runner-up: how close was the decision */
                double kth = s[idx[t * k + k - 1]] + (c->bias ? c->bias[idx[t * k + k - 1]] : 0);
                min_gap = fmin(min_gap, kth - bkey);
                break;
            }
            taken[best] = 1;
            idx[t * k + i] = best;
            wsum += s[best];
            count[best]++;
        }
        free(taken);
        for (int32_t i = 0; i < k; i++)
            w[t * k + i] = c->renormalize ? s[idx[t * k + i]] / wsum : s[idx[t * k + i]];
    }
    double aux = 0;
    for (int32_t j = 0; j < e; j++) aux += (double)count[j] / (double)(n * k) * pmean[j];
    /* C = min(ceil(cf N K / E), N K), -1 dropless (docs/moe-layer.md, forward step 5) */
    double cf_cap = ceil(c->capacity_factor * (double)n * k / e);
    int64_t cap = c->capacity_factor <= 0 ? -1 : cf_cap < (double)(n * k) ? (int64_t)cf_cap : n * k;

    memset(y, 0, sizeof(double) * (size_t)(n * h));
    for (int64_t t = 0; t < n; t++)
        for (int32_t i = 0; i < k; i++) {
            int32_t ex = idx[t * k + i];
            int keep = cap < 0 || accepted[ex] < cap;
            if (r && r->kept) r->kept[t * k + i] = (int8_t)keep;
            if (!keep) continue;
            accepted[ex]++;
            const double *a1 = w1 + (int64_t)ex * h * 2 * f, *a2 = w2 + (int64_t)ex * f * h;
            for (int64_t j = 0; j < f; j++) {
                double g = 0, u = 0;
                for (int64_t q = 0; q < h; q++) {
                    g += x[t * h + q] * a1[q * 2 * f + j];
                    u += x[t * h + q] * a1[q * 2 * f + f + j];
                }
                act[j] = g / (1 + exp(-g)) * u;
            }
            for (int64_t q = 0; q < h; q++) {
                double o = 0;
                for (int64_t j = 0; j < f; j++) o += act[j] * a2[j * h + q];
                y[t * h + q] += w[t * k + i] * o;
            }
        }
    if (r) {
        if (r->idx) memcpy(r->idx, idx, sizeof(int32_t) * (size_t)(n * k));
        if (r->w) memcpy(r->w, w, sizeof(double) * (size_t)(n * k));
        if (r->counts) memcpy(r->counts, count, sizeof(int64_t) * (size_t)e);
        if (r->accepted) memcpy(r->accepted, accepted, sizeof(int64_t) * (size_t)e);
        r->aux = e * aux;
        r->z = n ? z / (double)n : 0;
        r->min_gap = min_gap;
        r->entropy = entropy;
    }
    free(logit);
    free(s);
    free(pmean);
    free(count);
    free(accepted);
    free(idx);
    free(w);
    free(act);
}

double ref_loss(const ref_cfg_t *c, const double *x, const double *wg, const double *w1,
                const double *w2, const double *g)
{
    double *y = malloc(sizeof(double) * (size_t)(c->n * c->h));
    ref_result_t r = {0};
    ref_forward(c, x, wg, w1, w2, y, &r);
    double l = c->aux_coef * r.aux + c->z_coef * r.z;
    for (int64_t i = 0; i < c->n * c->h; i++) l += y[i] * g[i];
    free(y);
    return l;
}
