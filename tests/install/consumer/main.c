/* Uses the installed headers and library: version check, a host runtime, one forward. */
#include <stdio.h>

#include <moe/moe.h>

int main(void)
{
    if (moe_version() != MOE_VERSION) {
        fprintf(stderr, "header %d but library %d\n", MOE_VERSION, moe_version());
        return 1;
    }
    moe_runtime_config_t rc = moe_runtime_config_default();
    rc.backend = MOE_BACKEND_HOST;
    moe_runtime_t *rt = NULL;
    moe_layer_t *layer = NULL;
    moe_layer_config_t lc = moe_layer_config_default();
    lc.hidden = 8;
    lc.ffn_hidden = 16;
    lc.num_experts = 4;
    lc.top_k = 2;
    float x[3 * 8] = {1, 2, 3}, y[3 * 8];
    int64_t shape[2] = {3, 8};
    moe_tensor_t xt, yt;
    if (moe_runtime_create(&rc, &rt) || moe_layer_create(rt, &lc, &layer) ||
        moe_tensor_view(x, MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, shape, &xt) ||
        moe_tensor_view(y, MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, shape, &yt) ||
        moe_layer_forward(layer, 0, &xt, &yt)) {
        fprintf(stderr, "consumer: %s\n", moe_last_error());
        return 1;
    }
    moe_layer_destroy(layer);
    moe_runtime_destroy(rt);
    printf("consumer: libmoe %s works\n", moe_version_string());
    return 0;
}
