/* The w8a8 products (projection.Int8Projection) in C: the per-row activation quantization, the
 * epilogue around oneDNN's integer sums, and the whole product after the quantization (below).
 * The quantization and the epilogue give bitwise the torch expressions they replace
 * (projection.quantize_rows_torch and projection.epilogue_torch):
 *
 * quantize, per row of x (float32 or bfloat16, widened exactly to float32):
 *   amax    = max_i |x_i|                                  (exact: a maximum rounds nothing)
 *   scale   = max(amax, 1e-30f) / 127.0f                   (one float32 division)
 *   code_i  = round_half_even(x_i / scale) + 128           (one float32 division; uint8)
 * a NaN anywhere in a row makes its scale NaN, as torch's maximum does (its results are NaN then,
 * whatever its codes).
 *
 * epilogue, per element of the float32 sums [n, m] (oneDNN's, each already times its column's
 * weight scale):
 *   y = sums[r][c] * row_scale[r]                           (one float32 product)
 *   float32:  out = y (+ bias[c])                           (one float32 sum)
 *   bfloat16: out = bf16(y), then bf16(float(out) + float(bias[c]))   (to nearest even, each)
 *
 * The same packed weights also multiply 16-bit activations (w8a16, at the end of this file).
 *
 * One source, four builds (native.py compiles each into a library of its own; cpu.kernel_isa
 * chooses one at run time), each section below one instruction set's inner loops:
 *   AMX          (AVX512-VNNI's, with AMX-INT8): products of many rows as tile multiplies (tdpbusd)
 *   AVX512-VNNI  (-march=native on a CPU with it): vpdpbusd on the uint8 codes, 64 bytes an instruction
 *   AVX2         (-march=x86-64-v3): vpmaddubsw then vpmaddwd (w8a8), vpmaddwd on int16 codes (w8a16)
 *   portable     (-DSD_PORTABLE, or any other CPU): plain C, vectorized as the compiler can
 * Every build computes the same exact integer sums (integers add exactly in any order and any
 * lane width) and then the same float32 operations in the same order (w8a8_scalar.h states them
 * for one element), so every build writes the same bits: tests/kernels/test_w8a8.py compares
 * them on one CPU that runs all three.
 *
 * Compiled with -ffp-contract=off and without -ffast-math (native.py): no multiply is fused
 * into an add, nothing is reassociated, denormals stay. Elements are independent, so lanes,
 * blocks and threads change no bit.
 */

#if defined(SD_PORTABLE)
#define SD_ISA "portable"
#elif defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define SD_AVX512_VNNI 1
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && !defined(SD_NO_AMX)
#define SD_AMX 1
#define SD_ISA "amx"
#else
#define SD_ISA "avx512-vnni"
#endif
#elif defined(__AVX2__)
#define SD_AVX2 1
#define SD_ISA "avx2"
#else
#define SD_ISA "portable"
#endif

#if defined(SD_AVX512_VNNI) || defined(SD_AVX2)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif
#include "w8a8_scalar.h"

int sd_abi_version(void) { return 5; }

/* the instruction set this library's inner loops were compiled for (int8_kernel.py checks it) */
const char *sd_kernel_isa(void) { return SD_ISA; }

/* ---- the products' operands ----
 *
 * The weight codes are packed once (int8_kernel.Int8Kernel.pack) in groups of GROUP output
 * columns: group g, input quad q (inputs 4q .. 4q+3) holds GROUP x 4 bytes, column g*GROUP + c's
 * four codes at bytes 4c .. 4c+3. Columns past the weight's hold zero codes; k is a multiple of 4.
 *
 *   sum_c  = sum_i (code_i - 128) * w_ci            (exact in int32: |sum| < 2^31 for k < 2^16)
 *   sums_c = float32(sum_c) * weight_scale_c        (to nearest even, then one float32 product)
 * then the epilogue above, element by element. oneDNN's kernel writes the same sums_c bit for bit
 * (its integer sums are exact too, and it scales them the same way; tests/kernels/test_w8a8.py
 * compares), so the kernels' products are the same bits.
 *
 * The AVX512-VNNI section sums code_i * w_ci and takes off compensation_c = 128 * sum_i w_ci
 * (int8_kernel's, given with the weights, which is what every section's sum assumes); the AVX2
 * and portable sections multiply the signed codes code_i - 128.
 */

typedef struct {
    int dtype;
    int64_t n, k4, m;
    const uint8_t *codes; /* [n, 4 * k4]: w8a8's codes; w8a16's high bytes + 128 */
    const uint8_t *lo;    /* w8a16: the codes' low bytes [n, 4 * k4]; NULL for w8a8 */
    const float *row_scales;
    int64_t row_scale_stride;
    const int8_t *packed;        /* [groups, k4, GROUP, 4] */
    const int32_t *compensation; /* [m] */
    const float *weight_scales;  /* [m] */
    const void *bias;            /* [m] or NULL */
    void *out;                   /* [n, m] */
    int16_t *wide;               /* AVX2's w8a16: the codes as int16 [n, 4 * k4] (prepare_row's) */
} Product;

/* Each section below defines, for its instruction set:
 *   quantize_row    (x row -> uint8 codes, returns the scale)
 *   quantize_row16  (x row -> w8a16's high and low bytes, returns the scale)
 *   epilogue_block  (float32 sums of one row, columns c0 .. c1 -> out)
 *   row_tile(p)     (rows of one work item) and product_item(p, g, r0) (its GROUP columns of them)
 * and the AVX2 section prepare_row (w8a16's codes widened to int16 before its products).
 */

/* ======================= AVX512-VNNI: 16 lanes, vpdpbusd ======================= */
#if defined(SD_AVX512_VNNI)

#define ROW_TILE 6   /* rows a group's weights are loaded once for: 6 x 4 sums + 4 weights in registers */
#define ROW_TILE16 3 /* w8a16: 3 rows x 4 x 2 sums + 4 weights in registers */

static inline __m512 load16(const void *row, int dtype, int64_t i, __mmask16 mask) {
    if (dtype == DTYPE_F32) return _mm512_maskz_loadu_ps(mask, (const float *)row + i);
    __m256i h = _mm256_maskz_loadu_epi16(mask, (const uint16_t *)row + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline __mmask16 tail_mask(int64_t left) { return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u); }

static float row_amax(const void *row, int dtype, int64_t k, int *nan) {
    __m512 amax = _mm512_setzero_ps();
    __mmask16 unordered = 0;
    for (int64_t i = 0; i < k; i += 16) {
        __m512 v = load16(row, dtype, i, tail_mask(k - i)); /* masked lanes load 0: no effect */
        unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        amax = _mm512_max_ps(amax, _mm512_abs_ps(v));
    }
    *nan = unordered != 0;
    return _mm512_reduce_max_ps(amax);
}

static float quantize_row(const void *row, int dtype, int64_t k, uint8_t *codes) {
    int nan;
    float amax = row_amax(row, dtype, k, &nan); /* sets nan */
    float scale = row_scale(amax, nan, 127.0f);
    __m512 s = _mm512_set1_ps(scale);
    __m512i zero_point = _mm512_set1_epi32(ZERO_POINT);
    for (int64_t i = 0; i < k; i += 16) {
        __mmask16 mask = tail_mask(k - i);
        __m512 q = _mm512_div_ps(load16(row, dtype, i, mask), s);
        __m512i r = _mm512_cvt_roundps_epi32(q, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm_mask_storeu_epi8(codes + i, mask, _mm512_cvtusepi32_epi8(_mm512_add_epi32(r, zero_point)));
    }
    return scale;
}

static float quantize_row16(const void *row, int dtype, int64_t k, int32_t limit, uint8_t *hi, uint8_t *lo) {
    int nan;
    float amax = row_amax(row, dtype, k, &nan); /* sets nan */
    float scale = row_scale(amax, nan, (float)limit);
    __m512 s = _mm512_set1_ps(scale);
    __m512i top = _mm512_set1_epi32(limit), bottom = _mm512_set1_epi32(-limit);
    __m512i zero_point = _mm512_set1_epi32(ZERO_POINT), low_byte = _mm512_set1_epi32(255);
    for (int64_t i = 0; i < k; i += 16) {
        __mmask16 mask = tail_mask(k - i);
        __m512 q = _mm512_div_ps(load16(row, dtype, i, mask), s);
        __m512i c = _mm512_cvt_roundps_epi32(q, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        c = _mm512_min_epi32(_mm512_max_epi32(c, bottom), top); /* changes only a NaN row's codes */
        __m512i h = _mm512_add_epi32(_mm512_srai_epi32(c, 8), zero_point);
        _mm_mask_storeu_epi8(hi + i, mask, _mm512_cvtepi32_epi8(h));
        _mm_mask_storeu_epi8(lo + i, mask, _mm512_cvtepi32_epi8(_mm512_and_si512(c, low_byte)));
    }
    return scale;
}

static inline __m256i bf16_lanes(__m512 y) { /* to nearest even; NaN -> 0xffff */
    __m512i bits = _mm512_castps_si512(y);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    __mmask16 ordered = _mm512_cmp_ps_mask(y, y, _CMP_ORD_Q);
    return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(ordered, _mm512_set1_epi32(0xffff), rounded));
}

static inline __m512 bf16_widen(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

/* y (sums times the row's scale), plus the bias, rounded to the dtype, into out + c */
static inline void finish16(int dtype, __m512 y, __m512 bias, int has_bias, char *out, __mmask16 mask) {
    if (dtype == DTYPE_F32) {
        if (has_bias) y = _mm512_add_ps(y, bias);
        _mm512_mask_storeu_ps((float *)out, mask, y);
    } else {
        __m256i h = bf16_lanes(y);
        if (has_bias) h = bf16_lanes(_mm512_add_ps(bf16_widen(h), bias));
        _mm256_mask_storeu_epi16((uint16_t *)out, mask, h);
    }
}

static __m512 load_bias(int dtype, const void *bias, int64_t c, __mmask16 mask) {
    if (!bias) return _mm512_setzero_ps();
    if (dtype == DTYPE_F32) return _mm512_maskz_loadu_ps(mask, (const float *)bias + c);
    return bf16_widen(_mm256_maskz_loadu_epi16(mask, (const uint16_t *)bias + c));
}

static void epilogue_block(int dtype, const float *sums, float scale, const void *bias, void *out, int64_t c0,
                           int64_t c1) {
    __m512 s = _mm512_set1_ps(scale);
    for (int64_t c = c0; c < c1; c += 16) {
        __mmask16 mask = tail_mask(c1 - c);
        __m512 y = _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, sums + c), s);
        finish16(dtype, y, load_bias(dtype, bias, c, mask), bias != NULL, (char *)out + c * elem_size(dtype), mask);
    }
}

/* a tile's integer sums: rows x GROUP, in named registers (an array of 24 vectors would live on
 * the stack), written to sums once; rows is a constant where it is inlined */
#define SD_ACC(r) __m512i a##r##0 = zero, a##r##1 = zero, a##r##2 = zero, a##r##3 = zero
#define SD_STEP(r)                                                                                 \
    if (rows > r) {                                                                                \
        int32_t quad;                                                                              \
        memcpy(&quad, codes + (r * p->k4 + q) * 4, sizeof quad);                                   \
        __m512i a = _mm512_set1_epi32(quad);                                                       \
        a##r##0 = _mm512_dpbusd_epi32(a##r##0, a, w0), a##r##1 = _mm512_dpbusd_epi32(a##r##1, a, w1); \
        a##r##2 = _mm512_dpbusd_epi32(a##r##2, a, w2), a##r##3 = _mm512_dpbusd_epi32(a##r##3, a, w3); \
    }
#define SD_KEEP(r)                                                                                 \
    if (rows > r) sums[r][0] = a##r##0, sums[r][1] = a##r##1, sums[r][2] = a##r##2, sums[r][3] = a##r##3

static inline __attribute__((always_inline)) void tile_sums(const Product *p, int64_t g, int64_t r0, int rows,
                                                            __m512i sums[ROW_TILE][4]) {
    const __m512i zero = _mm512_setzero_si512();
    SD_ACC(0); SD_ACC(1); SD_ACC(2); SD_ACC(3); SD_ACC(4); SD_ACC(5);
    const int8_t *w = p->packed + g * p->k4 * GROUP * 4;
    const uint8_t *codes = p->codes + r0 * p->k4 * 4;
    for (int64_t q = 0; q < p->k4; q++, w += GROUP * 4) {
        __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(w + 64);
        __m512i w2 = _mm512_loadu_si512(w + 128), w3 = _mm512_loadu_si512(w + 192);
        SD_STEP(0) SD_STEP(1) SD_STEP(2) SD_STEP(3) SD_STEP(4) SD_STEP(5)
    }
    SD_KEEP(0); SD_KEEP(1); SD_KEEP(2); SD_KEEP(3); SD_KEEP(4); SD_KEEP(5);
}

/* w8a16: each code split into bytes, code = 256 * hi + lo with lo = code & 255 (0 .. 255) and hi =
 * code >> 8 (arithmetic: -64 .. 63); vpdpbusd sums both as its unsigned operand, hi + 128 and lo,
 * against the same packed codes w8a8 multiplies:
 *   S_hi = sum_i (hi_i + 128) * w_ci,   S_lo = sum_i lo_i * w_ci
 *   sum_c = 256 * (S_hi - compensation_c) + S_lo
 * in int32 arithmetic, which wraps: the result is the exact sum modulo 2^32, and that sum lies
 * in (-2^31, 2^31), so it is the exact sum. */
#define SD_ACC16(r)                                                                                \
    __m512i h##r##0 = zero, h##r##1 = zero, h##r##2 = zero, h##r##3 = zero;                        \
    __m512i l##r##0 = zero, l##r##1 = zero, l##r##2 = zero, l##r##3 = zero
#define SD_STEP16(r)                                                                               \
    if (rows > r) {                                                                                \
        int32_t quad_hi, quad_lo;                                                                  \
        memcpy(&quad_hi, hi + (r * p->k4 + q) * 4, sizeof quad_hi);                                \
        memcpy(&quad_lo, lo + (r * p->k4 + q) * 4, sizeof quad_lo);                                \
        __m512i ah = _mm512_set1_epi32(quad_hi), al = _mm512_set1_epi32(quad_lo);                  \
        h##r##0 = _mm512_dpbusd_epi32(h##r##0, ah, w0), h##r##1 = _mm512_dpbusd_epi32(h##r##1, ah, w1); \
        h##r##2 = _mm512_dpbusd_epi32(h##r##2, ah, w2), h##r##3 = _mm512_dpbusd_epi32(h##r##3, ah, w3); \
        l##r##0 = _mm512_dpbusd_epi32(l##r##0, al, w0), l##r##1 = _mm512_dpbusd_epi32(l##r##1, al, w1); \
        l##r##2 = _mm512_dpbusd_epi32(l##r##2, al, w2), l##r##3 = _mm512_dpbusd_epi32(l##r##3, al, w3); \
    }
#define SD_KEEP16(r)                                                                               \
    if (rows > r) {                                                                                \
        high[r][0] = h##r##0, high[r][1] = h##r##1, high[r][2] = h##r##2, high[r][3] = h##r##3;    \
        low[r][0] = l##r##0, low[r][1] = l##r##1, low[r][2] = l##r##2, low[r][3] = l##r##3;        \
    }

static inline __attribute__((always_inline)) void tile_sums16(const Product *p, int64_t g, int64_t r0, int rows,
                                                              __m512i high[ROW_TILE16][4], __m512i low[ROW_TILE16][4]) {
    const __m512i zero = _mm512_setzero_si512();
    SD_ACC16(0); SD_ACC16(1); SD_ACC16(2);
    const int8_t *w = p->packed + g * p->k4 * GROUP * 4;
    const uint8_t *hi = p->codes + r0 * p->k4 * 4, *lo = p->lo + r0 * p->k4 * 4;
    for (int64_t q = 0; q < p->k4; q++, w += GROUP * 4) {
        __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(w + 64);
        __m512i w2 = _mm512_loadu_si512(w + 128), w3 = _mm512_loadu_si512(w + 192);
        SD_STEP16(0) SD_STEP16(1) SD_STEP16(2)
    }
    SD_KEEP16(0); SD_KEEP16(1); SD_KEEP16(2);
}

/* the epilogue of a tile's exact integer sums (acc: rows x GROUP, compensation already taken off) */
static void product_tile(const Product *p, int64_t g, int64_t r0, int rows, __m512i acc[][4]) {
    for (int b = 0; b < 4; b++) {
        int64_t c = g * GROUP + b * 16;
        if (c >= p->m) break;
        __mmask16 mask = tail_mask(p->m - c);
        __m512 scale = _mm512_maskz_loadu_ps(mask, p->weight_scales + c);
        __m512 bias = load_bias(p->dtype, p->bias, c, mask);
        for (int r = 0; r < rows; r++) {
            __m512 exact = _mm512_cvt_roundepi32_ps(acc[r][b], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            __m512 y = _mm512_mul_ps(_mm512_mul_ps(exact, scale), _mm512_set1_ps(p->row_scales[(r0 + r) * p->row_scale_stride]));
            finish16(p->dtype, y, bias, p->bias != NULL, (char *)p->out + ((r0 + r) * p->m + c) * elem_size(p->dtype), mask);
        }
    }
}

/* a tile's exact sums, in sums: less the compensation (w8a8), or the w8a16 sum of both byte
 * halves, 256 * (S_hi - compensation) + S_lo, in int32 that wraps: exact (sums holds S_hi) */
static void take_compensation(const Product *p, int64_t g, int rows, __m512i sums[][4], __m512i low[][4]) {
    for (int b = 0; b < 4 && g * GROUP + b * 16 < p->m; b++) {
        int64_t c = g * GROUP + b * 16;
        __m512i compensation = _mm512_maskz_loadu_epi32(tail_mask(p->m - c), p->compensation + c);
        for (int r = 0; r < rows; r++) {
            __m512i s = _mm512_sub_epi32(sums[r][b], compensation);
            sums[r][b] = low ? _mm512_add_epi32(_mm512_slli_epi32(s, 8), low[r][b]) : s;
        }
    }
}

static void product_item8(const Product *p, int64_t g, int64_t r0) {
    __m512i sums[ROW_TILE][4];
    int rows = (int)min64(p->n - r0, ROW_TILE);
    switch (rows) { /* a constant row count per case: the sums stay in registers */
    case 6: tile_sums(p, g, r0, 6, sums); break;
    case 5: tile_sums(p, g, r0, 5, sums); break;
    case 4: tile_sums(p, g, r0, 4, sums); break;
    case 3: tile_sums(p, g, r0, 3, sums); break;
    case 2: tile_sums(p, g, r0, 2, sums); break;
    default: tile_sums(p, g, r0, 1, sums); break;
    }
    take_compensation(p, g, rows, sums, NULL);
    product_tile(p, g, r0, rows, sums);
}

static void product_item16(const Product *p, int64_t g, int64_t r0) {
    __m512i high[ROW_TILE16][4], low[ROW_TILE16][4];
    int rows = (int)min64(p->n - r0, ROW_TILE16);
    switch (rows) { /* a constant row count per case: the sums stay in registers */
    case 3: tile_sums16(p, g, r0, 3, high, low); break;
    case 2: tile_sums16(p, g, r0, 2, high, low); break;
    default: tile_sums16(p, g, r0, 1, high, low); break;
    }
    take_compensation(p, g, rows, high, low);
    product_tile(p, g, r0, rows, high);
}

#if defined(SD_AMX)
#include "w8a8_amx.h"
#else
static int row_tile(const Product *p) { return p->lo ? ROW_TILE16 : ROW_TILE; }

static void product_item(const Product *p, int64_t g, int64_t r0) {
    if (p->lo)
        product_item16(p, g, r0);
    else
        product_item8(p, g, r0);
}

static void begin_items(const Product *p) { (void)p; }
static void end_items(void) {}
#endif

/* ======================= AVX2: 8 lanes, vpmaddubsw and vpmaddwd =======================
 *
 * AVX2 has no vpdpbusd; two exact ways give the same int32 sums:
 *
 * w8a8 (llama.cpp's q8 dot product): vpmaddubsw multiplies u8 by s8 and adds pairs into
 * saturating int16. On m = |s| and sign(w, s), where s = code - 128 (the code as int8: |s| <= 128)
 * and w a weight code (|w| <= 127: weights are quantized to at most 127, int8_kernel.WEIGHT_LIMIT),
 * each product is s * w and each pair sum at most 2 * 128 * 127 = 32512: nothing saturates.
 * vpmaddwd by ones adds the pairs into int32. sum_c = sum_i s_i * w_ci, which is the AVX512-VNNI
 * section's sum_i code_i * w_ci - compensation_c (compensation_c = 128 * sum_i w_ci).
 *
 * w8a16: the codes (|code| <= 16383) widened to int16 once per row (prepare_row), the weights as
 * they are loaded (vpmovsxbw), and vpmaddwd adds pairs of products into int32 without saturating
 * (|pair| <= 2 * 16383 * 127). A vector of weights holds 4 columns x 4 inputs, so each column's
 * sum sits in two int32 lanes (inputs 0+1 and 2+3 of every quad) until the row ends (vphaddd):
 * both are partial sums of the exact sum, so int32 holds them exactly. (vpmaddubsw cannot take
 * these codes: their low bytes run 0 .. 255, and the sign trick needs a signed byte.)
 *
 * A work item is ROWS_AVX2 rows of one group, one row at a time with 8 accumulators (64 columns of
 * w8a8, 32 of w8a16): on the CPU measured the multiplies bound it, not the weights' loads, and
 * larger tiles (2 to 4 rows sharing a weight load) ran slower for want of registers (16 here).
 */
#elif defined(SD_AVX2)

#define ROWS_AVX2 4
#define SD_WIDE_CODES 1 /* w8a16 reads Product.wide */

static inline __m256 load8(const void *row, int dtype, int64_t i) { /* 8 lanes widened exactly */
    if (dtype == DTYPE_F32) return _mm256_loadu_ps((const float *)row + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)row + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* the largest magnitude, 8 lanes then the tail one at a time: a maximum rounds nothing, so any
 * order gives AVX-512's */
static float row_amax(const void *row, int dtype, int64_t k, int *nan) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 amax = _mm256_setzero_ps(), unordered = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= k; i += 8) {
        __m256 v = load8(row, dtype, i);
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        amax = _mm256_max_ps(amax, _mm256_and_ps(v, magnitude));
    }
    float lanes[8], a = 0.0f;
    _mm256_storeu_ps(lanes, amax);
    for (int l = 0; l < 8; l++) a = lanes[l] > a ? lanes[l] : a;
    *nan = _mm256_movemask_ps(unordered) != 0;
    for (; i < k; i++) {
        float x = fabsf(load_one(row, dtype, i));
        *nan |= x != x;
        a = x > a ? x : a;
    }
    return a;
}

/* round_half_even(x / scale) as int32: vcvtps2dq rounds by MXCSR, to nearest even unless a
 * program changes it (AVX-512's conversion names that rounding); NaN -> INT32_MIN as there */
static inline __m256i codes8(const void *row, int dtype, int64_t i, __m256 scale) {
    return _mm256_cvtps_epi32(_mm256_div_ps(load8(row, dtype, i), scale));
}

static inline void store_bytes(uint8_t *dst, __m256i v) { /* 8 int32 lanes, each 0 .. 255 */
    __m256i w = _mm256_packus_epi32(v, v); /* 16 bits: lanes 0-3 0-3 | 4-7 4-7 */
    __m256i b = _mm256_packus_epi16(w, w); /* bytes: 0-3 four times | 4-7 four times */
    uint32_t low = (uint32_t)_mm256_extract_epi32(b, 0), high = (uint32_t)_mm256_extract_epi32(b, 4);
    memcpy(dst, &low, 4), memcpy(dst + 4, &high, 4);
}

static float quantize_row(const void *row, int dtype, int64_t k, uint8_t *codes) {
    int nan;
    float amax = row_amax(row, dtype, k, &nan); /* sets nan */
    float scale = row_scale(amax, nan, 127.0f);
    __m256 s = _mm256_set1_ps(scale);
    const __m256i zero_point = _mm256_set1_epi32(ZERO_POINT), top = _mm256_set1_epi32(255);
    int64_t i = 0;
    for (; i + 8 <= k; i += 8) /* + 128, saturated as unsigned: vpmovusdb's */
        store_bytes(codes + i, _mm256_min_epu32(_mm256_add_epi32(codes8(row, dtype, i, s), zero_point), top));
    for (; i < k; i++) codes[i] = code_u8(to_int32(load_one(row, dtype, i) / scale));
    return scale;
}

static float quantize_row16(const void *row, int dtype, int64_t k, int32_t limit, uint8_t *hi, uint8_t *lo) {
    int nan;
    float amax = row_amax(row, dtype, k, &nan); /* sets nan */
    float scale = row_scale(amax, nan, (float)limit);
    __m256 s = _mm256_set1_ps(scale);
    const __m256i top = _mm256_set1_epi32(limit), bottom = _mm256_set1_epi32(-limit);
    const __m256i zero_point = _mm256_set1_epi32(ZERO_POINT), low = _mm256_set1_epi32(255);
    int64_t i = 0;
    for (; i + 8 <= k; i += 8) {
        __m256i c = _mm256_min_epi32(_mm256_max_epi32(codes8(row, dtype, i, s), bottom), top);
        store_bytes(hi + i, _mm256_add_epi32(_mm256_srai_epi32(c, 8), zero_point));
        store_bytes(lo + i, _mm256_and_si256(c, low));
    }
    for (; i < k; i++) {
        int32_t c = code_wide(to_int32(load_one(row, dtype, i) / scale), limit);
        hi[i] = high_byte(c), lo[i] = low_byte(c);
    }
    return scale;
}

static inline __m256i bf16_lanes(__m256 y) { /* to nearest even, in each lane's low 16 bits; NaN -> 0xffff */
    __m256i bits = _mm256_castps_si256(y);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    __m256i ordered = _mm256_castps_si256(_mm256_cmp_ps(y, y, _CMP_ORD_Q));
    return _mm256_blendv_epi8(_mm256_set1_epi32(0xffff), rounded, ordered);
}

static inline __m256 bf16_widen(__m256i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16)); }

/* 8 elements out[i ..] from y (sums times the row's scale), bias columns c .. */
static inline void finish8(int dtype, __m256 y, const void *bias, int64_t c, void *out, int64_t i) {
    if (dtype == DTYPE_F32) {
        if (bias) y = _mm256_add_ps(y, _mm256_loadu_ps((const float *)bias + c));
        _mm256_storeu_ps((float *)out + i, y);
        return;
    }
    __m256i h = bf16_lanes(y);
    if (bias) h = bf16_lanes(_mm256_add_ps(bf16_widen(h), load8(bias, DTYPE_BF16, c)));
    __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(h, h), _MM_SHUFFLE(3, 1, 2, 0));
    _mm_storeu_si128((__m128i *)((uint16_t *)out + i), _mm256_castsi256_si128(packed));
}

static void epilogue_block(int dtype, const float *sums, float scale, const void *bias, void *out, int64_t c0,
                           int64_t c1) {
    __m256 s = _mm256_set1_ps(scale);
    int64_t c = c0;
    for (; c + 8 <= c1; c += 8) finish8(dtype, _mm256_mul_ps(_mm256_loadu_ps(sums + c), s), bias, c, out, c);
    for (; c < c1; c++) finish(dtype, sums[c], scale, bias, c, out, c);
}

/* the epilogue of 8 columns' exact sums of row r, from column c (some past m in the last group) */
static void finish_columns(const Product *p, int64_t r, int64_t c, __m256i exact) {
    float row = p->row_scales[r * p->row_scale_stride];
    char *out = (char *)p->out + r * p->m * elem_size(p->dtype);
    if (c + 8 <= p->m) {
        __m256 sums = _mm256_mul_ps(_mm256_cvtepi32_ps(exact), _mm256_loadu_ps(p->weight_scales + c));
        finish8(p->dtype, _mm256_mul_ps(sums, _mm256_set1_ps(row)), p->bias, c, out, c);
        return;
    }
    int32_t lanes[8];
    memcpy(lanes, &exact, sizeof lanes);
    for (int64_t l = 0; c + l < p->m; l++) finish(p->dtype, (float)lanes[l] * p->weight_scales[c + l], row, p->bias, c + l, out, c + l);
}

/* vpaddd into the accumulator's own register: gcc 12 adds into the product's register and copies
 * the result back, a move per accumulator per quad */
static inline __m256i add_to(__m256i acc, __m256i t) {
    __asm__("vpaddd %1, %0, %0" : "+x"(acc) : "x"(t));
    return acc;
}

/* w8a8: 8 columns j of the quad's 32 bytes of weights, times the row's 4 codes (m, s above) */
#define SD_DOT8(j)                                                                                 \
    acc##j = add_to(acc##j, _mm256_madd_epi16(_mm256_maddubs_epi16(m, _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(w + 32 * j)), s)), ones))

/* row r's exact sums of group g's 64 columns, 8 a vector, in column order */
static void row_sums8(const Product *p, int64_t g, int64_t r, __m256i sums[8]) {
    const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);
    __m256i acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7;
    acc0 = acc1 = acc2 = acc3 = acc4 = acc5 = acc6 = acc7 = _mm256_setzero_si256();
    const int8_t *w = p->packed + g * p->k4 * GROUP * 4;
    const uint8_t *codes = p->codes + r * p->k4 * 4;
    for (int64_t q = 0; q < p->k4; q++, w += GROUP * 4) {
        int32_t quad;
        memcpy(&quad, codes + 4 * q, sizeof quad);
        __m256i s = _mm256_xor_si256(_mm256_set1_epi32(quad), flip); /* code - 128, as int8 */
        __m256i m = _mm256_abs_epi8(s);                                 /* 0 .. 128, as uint8 */
        SD_DOT8(0); SD_DOT8(1); SD_DOT8(2); SD_DOT8(3); SD_DOT8(4); SD_DOT8(5); SD_DOT8(6); SD_DOT8(7);
    }
    sums[0] = acc0, sums[1] = acc1, sums[2] = acc2, sums[3] = acc3;
    sums[4] = acc4, sums[5] = acc5, sums[6] = acc6, sums[7] = acc7;
}

/* w8a16: the pair sums of 4 columns j, times the row's 4 int16 codes (a) */
#define SD_DOT16(j)                                                                                \
    acc##j = add_to(acc##j, _mm256_madd_epi16(a, _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + 16 * j)))))

/* pair sums -> columns 0 1 4 5 | 2 3 6 7 -> 0 .. 7 */
static inline __m256i columns8(__m256i low, __m256i high) {
    return _mm256_permute4x64_epi64(_mm256_hadd_epi32(low, high), _MM_SHUFFLE(3, 1, 2, 0));
}

/* row r's exact sums of 32 columns of group g from column 32 * half, 8 a vector */
static void row_sums16(const Product *p, int64_t g, int half, int64_t r, __m256i sums[4]) {
    __m256i acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7;
    acc0 = acc1 = acc2 = acc3 = acc4 = acc5 = acc6 = acc7 = _mm256_setzero_si256();
    const int8_t *w = p->packed + g * p->k4 * GROUP * 4 + half * 32 * 4;
    const int16_t *codes = p->wide + r * p->k4 * 4;
    for (int64_t q = 0; q < p->k4; q++, w += GROUP * 4) {
        int64_t quad;
        memcpy(&quad, codes + 4 * q, sizeof quad);
        __m256i a = _mm256_set1_epi64x(quad);
        SD_DOT16(0); SD_DOT16(1); SD_DOT16(2); SD_DOT16(3); SD_DOT16(4); SD_DOT16(5); SD_DOT16(6); SD_DOT16(7);
    }
    sums[0] = columns8(acc0, acc1), sums[1] = columns8(acc2, acc3);
    sums[2] = columns8(acc4, acc5), sums[3] = columns8(acc6, acc7);
}

/* the codes of w8a16's row r as int16, code = 256 * (hi - 128) + lo */
static void prepare_row(const Product *p, int64_t r) {
    const int64_t k = p->k4 * 4;
    const uint8_t *hi = p->codes + r * k, *lo = p->lo + r * k;
    for (int64_t i = 0; i < k; i++) p->wide[r * k + i] = (int16_t)((hi[i] - ZERO_POINT) * 256 + lo[i]);
}

static int row_tile(const Product *p) { return (void)p, ROWS_AVX2; }
static void begin_items(const Product *p) { (void)p; }
static void end_items(void) {}

static void product_item(const Product *p, int64_t g, int64_t r0) {
    __m256i sums[8];
    for (int64_t r = r0; r < min64(r0 + ROWS_AVX2, p->n); r++) {
        if (p->lo) {
            row_sums16(p, g, 0, r, sums);
            row_sums16(p, g, 1, r, sums + 4);
        } else {
            row_sums8(p, g, r, sums);
        }
        for (int j = 0; j < 8 && g * GROUP + 8 * j < p->m; j++) finish_columns(p, r, g * GROUP + 8 * j, sums[j]);
    }
}

/* ======================= portable: plain C, one element at a time =======================
 * The scalar functions of w8a8_scalar.h, and each row's exact sums in int32, sum_i code_i * w_ci
 * with the signed codes (w8a8: code - 128; w8a16: 256 * (hi - 128) + lo), as loops the compiler
 * may vectorize: what a CPU without the sections above runs (an ARM one included). */
#else

static float row_amax(const void *row, int dtype, int64_t k, int *nan) {
    float amax = 0.0f;
    *nan = 0;
    for (int64_t i = 0; i < k; i++) {
        float a = fabsf(load_one(row, dtype, i));
        *nan |= a != a;
        amax = a > amax ? a : amax;
    }
    return amax;
}

static float quantize_row(const void *row, int dtype, int64_t k, uint8_t *codes) {
    int nan;
    float amax = row_amax(row, dtype, k, &nan); /* sets nan */
    float scale = row_scale(amax, nan, 127.0f);
    for (int64_t i = 0; i < k; i++) codes[i] = code_u8(to_int32(load_one(row, dtype, i) / scale));
    return scale;
}

static float quantize_row16(const void *row, int dtype, int64_t k, int32_t limit, uint8_t *hi, uint8_t *lo) {
    int nan;
    float amax = row_amax(row, dtype, k, &nan); /* sets nan */
    float scale = row_scale(amax, nan, (float)limit);
    for (int64_t i = 0; i < k; i++) {
        int32_t c = code_wide(to_int32(load_one(row, dtype, i) / scale), limit);
        hi[i] = high_byte(c), lo[i] = low_byte(c);
    }
    return scale;
}

static void epilogue_block(int dtype, const float *sums, float scale, const void *bias, void *out, int64_t c0,
                           int64_t c1) {
    for (int64_t c = c0; c < c1; c++) finish(dtype, sums[c], scale, bias, c, out, c);
}

static int row_tile(const Product *p) { return (void)p, 1; }
static void begin_items(const Product *p) { (void)p; }
static void end_items(void) {}

static inline int32_t signed_code(const Product *p, int64_t i) { /* i: element of the codes [n, k] */
    return p->lo ? (p->codes[i] - ZERO_POINT) * 256 + p->lo[i] : p->codes[i] - ZERO_POINT;
}

/* one row, GROUP columns: each weight byte's products summed in a lane of its own (a loop the
 * compiler vectorizes: the same 4 codes against every column's quad), a column's 4 lanes added
 * at the end; every lane is a partial sum of the exact sum, so int32 holds it exactly */
static void product_item(const Product *p, int64_t g, int64_t r) {
    int32_t lanes[GROUP * 4] = {0};
    const int8_t *w = p->packed + g * p->k4 * GROUP * 4;
    for (int64_t q = 0; q < p->k4; q++, w += GROUP * 4) {
        int64_t i = (r * p->k4 + q) * 4;
        int32_t a0 = signed_code(p, i), a1 = signed_code(p, i + 1), a2 = signed_code(p, i + 2), a3 = signed_code(p, i + 3);
        for (int j = 0; j < GROUP * 4; j += 4) {
            lanes[j] += a0 * w[j], lanes[j + 1] += a1 * w[j + 1];
            lanes[j + 2] += a2 * w[j + 2], lanes[j + 3] += a3 * w[j + 3];
        }
    }
    float row = p->row_scales[r * p->row_scale_stride];
    char *out = (char *)p->out + r * p->m * elem_size(p->dtype);
    for (int64_t c = g * GROUP; c < (g + 1) * GROUP && c < p->m; c++) {
        const int32_t *l = lanes + 4 * (c - g * GROUP);
        finish(p->dtype, (float)(l[0] + l[1] + l[2] + l[3]) * p->weight_scales[c], row, p->bias, c, out, c);
    }
}

#endif

/* ======================= the entry points, for every build ======================= */

#ifndef SD_WIDE_CODES /* only the AVX2 section's w8a16 reads int16 codes */
#define SD_WIDE_CODES 0
static void prepare_row(const Product *p, int64_t r) { (void)p, (void)r; }
#endif

/* x [n, k] with rows row_stride elements apart (k contiguous) -> codes [n, k] uint8, scales [n] */
int sd_quantize_rows(int dtype, int64_t n, int64_t k, const void *x, int64_t row_stride, uint8_t *codes,
                     float *scales, int threads) {
    if ((dtype != DTYPE_F32 && dtype != DTYPE_BF16) || n < 0 || k <= 0) return 1;
    int parallel = threads > 1 && n > 1 && n * k >= PARALLEL_ELEMENTS;
#pragma omp parallel for num_threads(threads) if (parallel) schedule(static)
    for (int64_t r = 0; r < n; r++)
        scales[r] = quantize_row((const char *)x + (size_t)(r * row_stride) * elem_size(dtype), dtype, k, codes + r * k);
    return 0;
}

/* sums [n, m] float32, row_scales [n] (rows row_scale_stride apart), bias [m] of dtype or NULL
 * -> out [n, m] of dtype, all contiguous */
int sd_epilogue(int dtype, int64_t n, int64_t m, const float *sums, const float *row_scales,
                int64_t row_scale_stride, const void *bias, void *out, int threads) {
    if ((dtype != DTYPE_F32 && dtype != DTYPE_BF16) || n < 0 || m <= 0) return 1;
    int64_t blocks = (m + BLOCK - 1) / BLOCK;
    int parallel = threads > 1 && n * blocks > 1 && n * m >= PARALLEL_ELEMENTS;
#pragma omp parallel for num_threads(threads) if (parallel) schedule(static)
    for (int64_t w = 0; w < n * blocks; w++) {
        int64_t r = w / blocks, c0 = (w % blocks) * BLOCK, c1 = c0 + BLOCK < m ? c0 + BLOCK : m;
        epilogue_block(dtype, sums + r * m, row_scales[r * row_scale_stride], bias,
                       (char *)out + (size_t)(r * m) * elem_size(dtype), c0, c1);
    }
    return 0;
}

static int check(int dtype, int64_t n, int64_t k, int64_t m) {
    return (dtype != DTYPE_F32 && dtype != DTYPE_BF16) || n < 0 || k <= 0 || k % 4 || k >= MAX_INPUTS || m <= 0;
}

/* the largest code for k inputs: at most 16383, and limit * 127 * k < 2^31 (int8_kernel.py's twin) */
static int check_limit(int64_t k, int32_t limit) { return limit < 1 || limit > 16383 || (int64_t)limit * 127 * k >= 2147483648LL; }

static int64_t tiles(const Product *p) { return (p->n + row_tile(p) - 1) / row_tile(p); }

static int parallel_product(const Product *p, int threads) {
    int64_t groups = (p->m + GROUP - 1) / GROUP;
    return threads > 1 && groups * tiles(p) > 1 && p->n * p->k4 * 4 * p->m >= PARALLEL_ELEMENTS;
}

/* group-major work items: a thread's consecutive items share a group's weights (in a parallel region) */
static void product_items(const Product *p) {
    int64_t groups = (p->m + GROUP - 1) / GROUP, t = tiles(p);
    begin_items(p); /* this thread's tiles (AMX) */
#pragma omp for schedule(static)
    for (int64_t w = 0; w < groups * t; w++) product_item(p, w / t, (w % t) * row_tile(p));
    end_items();
}

/* what a fused call quantizes: x [n, k] of dtype, rows row_stride elements apart, into codes (and
 * lo for w8a16, with codes up to limit) and scales */
typedef struct {
    const void *x;
    int64_t row_stride;
    int32_t limit;
    uint8_t *codes, *lo;
    float *scales;
} Quantization;

static void quantize_source_row(const Quantization *q, int dtype, int64_t k, int64_t r) {
    const void *row = (const char *)q->x + (size_t)(r * q->row_stride) * elem_size(dtype);
    if (q->lo)
        q->scales[r] = quantize_row16(row, dtype, k, q->limit, q->codes + r * k, q->lo + r * k);
    else
        q->scales[r] = quantize_row(row, dtype, k, q->codes + r * k);
}

/* the product of p's codes (quantized first where q is given): every row quantized and prepared,
 * then, after that loop's barrier, every work item */
static int run_product(Product *p, const Quantization *q, int threads) {
    int wide = SD_WIDE_CODES && p->lo;
    p->wide = wide ? malloc(sizeof(int16_t) * (size_t)(p->n * p->k4 * 4) + 2) : NULL;
    if (wide && !p->wide) return 3;
#pragma omp parallel num_threads(threads) if (parallel_product(p, threads))
    {
        if (q || wide) {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < p->n; r++) {
                if (q) quantize_source_row(q, p->dtype, p->k4 * 4, r);
                if (wide) prepare_row(p, r);
            }
        }
        product_items(p);
    }
    free(p->wide);
    return 0;
}

/* codes [n, k] uint8 (sd_quantize_rows') and row_scales (rows row_scale_stride apart) times the
 * packed weight [m, k] -> out [n, m] of dtype, contiguous */
int sd_w8a8_product(int dtype, int64_t n, int64_t k, int64_t m, const uint8_t *codes, const float *row_scales,
                    int64_t row_scale_stride, const int8_t *packed, const int32_t *compensation,
                    const float *weight_scales, const void *bias, void *out, int threads) {
    if (check(dtype, n, k, m)) return 1;
    Product p = {dtype, n, k / 4, m, codes, NULL, row_scales, row_scale_stride, packed, compensation, weight_scales,
                 bias, out, NULL};
    return run_product(&p, NULL, threads);
}

/* sd_quantize_rows then sd_w8a8_product in one call: x [n, k] of dtype, rows x_row_stride
 * elements apart (k contiguous) -> out [n, m] of dtype */
int sd_w8a8_quantized_product(int dtype, int64_t n, int64_t k, int64_t m, const void *x, int64_t x_row_stride,
                              const int8_t *packed, const int32_t *compensation, const float *weight_scales,
                              const void *bias, void *out, int threads) {
    if (check(dtype, n, k, m)) return 1;
    uint8_t *codes = malloc((size_t)(n * k) + 1);
    float *scales = malloc(sizeof(float) * (size_t)(n + 1));
    int status = codes && scales ? 0 : 3;
    if (!status) {
        Quantization q = {x, x_row_stride, 127, codes, NULL, scales};
        Product p = {dtype, n, k / 4, m, codes, NULL, scales, 1, packed, compensation, weight_scales, bias, out, NULL};
        status = run_product(&p, &q, threads);
    }
    free(codes), free(scales);
    return status;
}

/* ---- w8a16: the same packed int8 weights, activations in ~15-bit integers ----
 *
 * quantize, per row of x (as above, with another largest code):
 *   scale  = max(amax, 1e-30f) / (float)limit                (one float32 division)
 *   code_i = round_half_even(x_i / scale), in [-limit, limit] (one float32 division)
 * limit (int8_kernel.wide_activation_limit) is at most 16383 and keeps |sum_i code_i * w_ci|
 * <= limit * 127 * k below 2^31: the int32 sum is exact. A NaN row's scale is NaN (its results
 * NaN), its codes clamped into range. The codes travel as two bytes, code = 256 * (hi - 128) + lo
 * (hi = (code >> 8) + 128, lo = code & 255), which the AVX512-VNNI section sums apart and the
 * others widen back to int16. Then the w8a8 epilogue: float32(sum) times the weight scale, times
 * the row's scale, rounded to the dtype, plus the bias. A row's result is a function of that row
 * alone, whatever the tiles and threads.
 */

/* x [n, k] of dtype, rows row_stride elements apart -> hi, lo [n, k] uint8 (code = 256 * (hi - 128) + lo), scales [n] */
int sd_w8a16_quantize_rows(int dtype, int64_t n, int64_t k, const void *x, int64_t row_stride, int32_t limit,
                           uint8_t *hi, uint8_t *lo, float *scales, int threads) {
    if ((dtype != DTYPE_F32 && dtype != DTYPE_BF16) || n < 0 || k <= 0 || check_limit(k, limit)) return 1;
    int parallel = threads > 1 && n > 1 && n * k >= PARALLEL_ELEMENTS;
#pragma omp parallel for num_threads(threads) if (parallel) schedule(static)
    for (int64_t r = 0; r < n; r++)
        scales[r] = quantize_row16((const char *)x + (size_t)(r * row_stride) * elem_size(dtype), dtype, k, limit,
                                   hi + r * k, lo + r * k);
    return 0;
}

/* hi, lo [n, k] uint8 (sd_w8a16_quantize_rows') and row_scales (rows row_scale_stride apart) times
 * the packed weight [m, k] -> out [n, m] of dtype, contiguous */
int sd_w8a16_product(int dtype, int64_t n, int64_t k, int64_t m, const uint8_t *hi, const uint8_t *lo,
                     const float *row_scales, int64_t row_scale_stride, const int8_t *packed,
                     const int32_t *compensation, const float *weight_scales, const void *bias, void *out,
                     int threads) {
    if (check(dtype, n, k, m)) return 1;
    Product p = {dtype, n, k / 4, m, hi, lo, row_scales, row_scale_stride, packed, compensation, weight_scales, bias,
                 out, NULL};
    return run_product(&p, NULL, threads);
}

/* sd_w8a16_quantize_rows then sd_w8a16_product in one call: x [n, k] of dtype, rows x_row_stride
 * elements apart (k contiguous) -> out [n, m] of dtype */
int sd_w8a16_quantized_product(int dtype, int64_t n, int64_t k, int64_t m, const void *x, int64_t x_row_stride,
                               int32_t limit, const int8_t *packed, const int32_t *compensation,
                               const float *weight_scales, const void *bias, void *out, int threads) {
    if (check(dtype, n, k, m) || check_limit(k, limit)) return 1;
    uint8_t *hi = malloc((size_t)(2 * n * k) + 1);
    float *scales = malloc(sizeof(float) * (size_t)(n + 1));
    int status = hi && scales ? 0 : 3;
    if (!status) {
        uint8_t *lo = hi + n * k;
        Quantization q = {x, x_row_stride, limit, hi, lo, scales};
        Product p = {dtype, n, k / 4, m, hi, lo, scales, 1, packed, compensation, weight_scales, bias, out, NULL};
        status = run_product(&p, &q, threads);
    }
    free(hi), free(scales);
    return status;
}
