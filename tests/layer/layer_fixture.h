/* A host-backend layer whose parameters the test sets, plus fp64 copies for the oracle. */
#ifndef MOE_TEST_LAYER_FIXTURE_H
#define MOE_TEST_LAYER_FIXTURE_H

#include "ref_moe.h"
#include "test_support.h"

typedef struct fixture {
    moe_runtime_t *rt;
    moe_layer_t *layer;
    ref_cfg_t ref;
    int64_t n;
    double *x, *wg, *w1, *w2; /* fp64 copies of what the layer holds (fp32 values) */
    float *xf;                /* x as fp32 */
    moe_param_info_t p[3];    /* router.weight, experts.w1, experts.w2 */
} fixture_t;

/* Make a layer from cfg with random parameters (std `scale`) and random x [n,H]. */
void fixture_init(fixture_t *fx, const moe_layer_config_t *cfg, int64_t n, test_rng_t *rng,
                  double scale);
void fixture_free(fixture_t *fx);
/* Copy the fp64 parameter arrays (rounded to fp32) into the layer. */
void fixture_push_params(fixture_t *fx);
/* Run the library forward into y (fp32 [n,H]) using slot 0. */
void fixture_forward(fixture_t *fx, float *y);

#endif
