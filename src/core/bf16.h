/* bf16 <-> fp32 conversion on the host (round to nearest even; NaN stays NaN). */
#ifndef MOE_CORE_BF16_H
#define MOE_CORE_BF16_H

#include <stdint.h>
#include <string.h>

static inline float moe_bf16_to_f32(uint16_t h)
{
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t moe_f32_to_bf16(float f)
{
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u); /* quiet NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

#endif /* MOE_CORE_BF16_H */
