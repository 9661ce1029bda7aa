/* Causal multi-head self-attention, forward and backward (attention.h). */
#include "attention.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

void attention_forward(int64_t S, int64_t T, int64_t H, int64_t nh, const float *qkv, float *probs,
                       float *o)
{
    int64_t d = H / nh, W = 3 * H;
    float scale = 1.0f / sqrtf((float)d);
    for (int64_t s = 0; s < S; s++)
        for (int64_t h = 0; h < nh; h++) {
            float *P = probs + (s * nh + h) * T * T;
            for (int64_t t = 0; t < T; t++) {
                const float *q = qkv + (s * T + t) * W + h * d;
                float *p = P + t * T, mx = -INFINITY;
                for (int64_t u = 0; u <= t; u++) {
                    const float *k = qkv + (s * T + u) * W + H + h * d;
                    float dot = 0;
                    for (int64_t i = 0; i < d; i++) dot += q[i] * k[i];
                    p[u] = dot * scale;
                    if (p[u] > mx) mx = p[u];
                }
                double sum = 0;
                for (int64_t u = 0; u <= t; u++) {
                    p[u] = expf(p[u] - mx);
                    sum += p[u];
                }
                float inv = (float)(1.0 / sum);
                float *out = o + (s * T + t) * H + h * d;
                memset(out, 0, sizeof(float) * (size_t)d);
                for (int64_t u = 0; u <= t; u++) {
                    p[u] *= inv;
                    const float *v = qkv + (s * T + u) * W + 2 * H + h * d;
                    for (int64_t i = 0; i < d; i++) out[i] += p[u] * v[i];
                }
            }
        }
}

void attention_backward(int64_t S, int64_t T, int64_t H, int64_t nh, const float *qkv,
                        const float *probs, const float *d_o, float *d_qkv)
{
    int64_t d = H / nh, W = 3 * H;
    float scale = 1.0f / sqrtf((float)d);
    memset(d_qkv, 0, sizeof(float) * (size_t)(S * T * W));
    float *dp = malloc(sizeof(float) * (size_t)T);
    for (int64_t s = 0; s < S; s++)
        for (int64_t h = 0; h < nh; h++) {
            const float *P = probs + (s * nh + h) * T * T;
            for (int64_t t = 0; t < T; t++) {
                const float *p = P + t * T, *g = d_o + (s * T + t) * H + h * d;
                /* dP[u] = dO[t] . v[u];  dv[u] += P[u] dO[t] */
                double dot_pdp = 0;
                for (int64_t u = 0; u <= t; u++) {
                    const float *v = qkv + (s * T + u) * W + 2 * H + h * d;
                    float *dv = d_qkv + (s * T + u) * W + 2 * H + h * d;
                    float acc = 0;
                    for (int64_t i = 0; i < d; i++) {
                        acc += g[i] * v[i];
                        dv[i] += p[u] * g[i];
                    }
                    dp[u] = acc;
                    dot_pdp += (double)p[u] * acc;
                }
                /* softmax backward, then the scores' q and k */
                const float *q = qkv + (s * T + t) * W + h * d;
                float *dq = d_qkv + (s * T + t) * W + h * d;
                for (int64_t u = 0; u <= t; u++) {
                    float ds = p[u] * (dp[u] - (float)dot_pdp) * scale;
                    const float *k = qkv + (s * T + u) * W + H + h * d;
                    float *dk = d_qkv + (s * T + u) * W + H + h * d;
                    for (int64_t i = 0; i < d; i++) {
                        dq[i] += ds * k[i];
                        dk[i] += ds * q[i];
                    }
                }
            }
        }
    free(dp);
}
