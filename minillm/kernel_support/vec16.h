/* What the CPU kernels (attention/cpu_decode.c, model/cpu_gemm.c) share: a vector of 16 fp32 (GCC's vector
   extensions: one AVX-512 register, two AVX2 ones), loading 16 fp32 or bf16 numbers into one, and rounding fp32
   to bf16 as torch does. */
#ifndef MINILLM_VEC16_H
#define MINILLM_VEC16_H
#include <stdint.h>
#include <string.h>

typedef float vf __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));
typedef uint16_t vh __attribute__((vector_size(32)));

enum { F32 = 0, BF16 = 1 };

static inline vf load16(const char *p, int dtype) {       /* 16 numbers at p -> fp32 (bf16: the top half) */
    if (dtype == BF16) {
        vh h;
        memcpy(&h, p, sizeof h);
        vu u = __builtin_convertvector(h, vu) << 16;
        vf f;
        memcpy(&f, &u, sizeof f);
        return f;
    }
    vf f;
    memcpy(&f, p, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) {       /* round to nearest even, as torch does */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);   /* NaN stays NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}
#endif
