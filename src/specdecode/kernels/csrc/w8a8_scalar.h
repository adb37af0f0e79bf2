/* The w8a8 kernels' shared scalar code (w8a8.c), whatever instruction set a build is for: the
 * dtypes, the constants, and the arithmetic of one element, written as the vector sections
 * compute it lane by lane. The vector sections (AVX512-VNNI, AVX2) take it for their tails and
 * the portable section for everything, so that every build writes the same bits:
 *
 *   to_int32:  a float32 to int32 as cvtps2dq does (to nearest even under the default rounding;
 *              NaN and out of range: INT32_MIN, the "integer indefinite")
 *   code_u8:   w8a8's code, int32 + 128 saturated as an unsigned number to a byte (vpmovusdb)
 *   code_wide: w8a16's code, clamped to [-limit, limit]
 *   finish:    sum * row_scale (+ bias in float32; in bfloat16 rounded, + bias, rounded again)
 *
 * Compiled with -ffp-contract=off and without -ffast-math (native.py): nothing here is fused or
 * reassociated, and denormals stay.
 */

#ifndef SD_W8A8_SCALAR_H
#define SD_W8A8_SCALAR_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { DTYPE_F32 = 0, DTYPE_BF16 = 1 };

#define ZERO_POINT 128
#define MIN_SCALE 1e-30f /* torch's clamp_min(1e-30) on float32: the double 1e-30 rounded to float */
#define PARALLEL_ELEMENTS 65536 /* fewer elements than this run on one thread: threads cost more */
#define BLOCK 1024              /* columns of one epilogue work item */
#define GROUP 64                /* output columns of a packed weight group (int8_kernel.GROUP) */
#define MAX_INPUTS 65536        /* the products' int32 sums stay exact below this many inputs */

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

static inline size_t elem_size(int dtype) { return dtype == DTYPE_F32 ? 4 : 2; }

/* ---- conversions: exact to float32; to bfloat16 to nearest even, as torch's ---- */

static inline float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if (f != f) return 0xffffu; /* NaN: torch's vectorised conversion writes 0xffff */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

static inline float load_one(const void *row, int dtype, int64_t i) {
    return dtype == DTYPE_F32 ? ((const float *)row)[i] : bf16_to_float(((const uint16_t *)row)[i]);
}

/* ---- the row quantization ---- */

/* max(amax, 1e-30) / largest in one float32 division; NaN for a row holding a NaN, as torch's maximum */
static inline float row_scale(float amax, int nan, float largest) {
    if (nan) return NAN;
    return (amax < MIN_SCALE ? MIN_SCALE : amax) / largest;
}

static inline int32_t to_int32(float q) {
    if (!(q >= -2147483648.0f && q < 2147483648.0f)) return INT32_MIN;
    return (int32_t)nearbyintf(q); /* an integer-valued float in range: the cast is exact */
}

static inline uint8_t code_u8(int32_t r) { /* 1 .. 255 for a finite row's codes; 255 for INT32_MIN */
    uint32_t u = (uint32_t)r + ZERO_POINT;   /* wraps as vpaddd does */
    return u > 255u ? 255u : (uint8_t)u;
}

static inline int32_t code_wide(int32_t c, int32_t limit) { /* changes only a NaN row's codes */
    return c < -limit ? -limit : c > limit ? limit : c;
}

/* w8a16's code as the products read it: code = 256 * (hi - 128) + lo */
static inline uint8_t high_byte(int32_t c) { return (uint8_t)((c >> 8) + ZERO_POINT); }
static inline uint8_t low_byte(int32_t c) { return (uint8_t)(c & 255); }

/* ---- the epilogue of one element: out[i] from its float32 sum (column c of the bias) ---- */

static inline void finish(int dtype, float sum, float row_scale, const void *bias, int64_t c, void *out, int64_t i) {
    float y = sum * row_scale;
    if (dtype == DTYPE_F32) {
        ((float *)out)[i] = bias ? y + ((const float *)bias)[c] : y;
        return;
    }
    uint16_t h = float_to_bf16(y);
    if (bias) h = float_to_bf16(bf16_to_float(h) + bf16_to_float(((const uint16_t *)bias)[c]));
    ((uint16_t *)out)[i] = h;
}

#endif
