/*
 * An independent fp64 model of the MoE layer, written from the math in include/moe/layer.h
 * and sharing no code with the library: the oracle for the property and gradient tests.
 * Shapes: N tokens, H hidden, E experts, K top-k, F expert width.
 */
#ifndef MOE_TEST_REF_MOE_H
#define MOE_TEST_REF_MOE_H

#include <stdint.h>

#include <moe/layer.h>

typedef struct ref_cfg {
    int64_t n, h, f;
    int32_t e, k;
    moe_score_fn_t score_fn;
    int renormalize;
    double capacity_factor; /* <= 0 dropless */
    double aux_coef, z_coef;
    const double *bias; /* [E] selection bias or NULL */
} ref_cfg_t;

typedef struct ref_result {
    int32_t *idx;      /* [N,K] chosen experts (caller-allocated, or NULL) */
    double *w;         /* [N,K] combine weights (or NULL) */
    int8_t *kept;      /* [N,K] 1 if the slot passed capacity (or NULL) */
    int64_t *counts;   /* [E] selected slots per expert (or NULL) */
    int64_t *accepted; /* [E] kept slots per expert (or NULL) */
    double aux, z;     /* unscaled loss terms */
    double entropy;    /* mean over tokens of the entropy of the normalised scores */
    double min_gap;    /* smallest gap between the K-th and (K+1)-th selection key */
} ref_result_t;

/* y [N,H] = layer(x). Parameters: wg [H,E], w1 [E,H,2,F], w2 [E,F,H]. */
void ref_forward(const ref_cfg_t *c, const double *x, const double *wg, const double *w1,
                 const double *w2, double *y, ref_result_t *r);

/* sum(y * g) + aux_coef * aux + z_coef * z */
double ref_loss(const ref_cfg_t *c, const double *x, const double *wg, const double *w1,
                const double *w2, const double *g);

#endif
