/* The w8a8 products (projection.Int8Projection) in C: the per-row activation quantization, the
 * epilogue around oneDNN's integer sums, and on AVX512-VNNI the whole product after the
 * quantization (below). The quantization and the epilogue give bitwise the torch expressions
 * they replace (projection.quantize_rows_torch and projection.epilogue_torch):
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
 * The same packed weights also multiply 16-bit activations (w8a16, at the end of this file): the
 * codes split into two bytes, two vpdpbusd a weight quad, the sums recombined exactly.
 *
 * Compiled with -ffp-contract=off and without -ffast-math (native.py): no multiply is fused
 * into an add, nothing is reassociated, denormals stay. Elements are independent, so lanes,
 * blocks and threads change no bit.
 */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define SD_AVX512 1
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { DTYPE_F32 = 0, DTYPE_BF16 = 1 };

#define ZERO_POINT 128
#define MIN_SCALE 1e-30f /* torch's clamp_min(1e-30) on float32: the double 1e-30 rounded to float */
#define PARALLEL_ELEMENTS 65536 /* fewer elements than this run on one thread: threads cost more */
#define BLOCK 1024              /* columns of one epilogue work item */

int sd_abi_version(void) { return 4; }

/* ---- scalar conversions: exact to float32; to bfloat16 to nearest even, as torch's ---- */

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

static inline float row_scale(float amax, int nan) {
    if (nan) return NAN;
    return (amax < MIN_SCALE ? MIN_SCALE : amax) / 127.0f;
}

/* ---- quantize ---- */

#ifdef SD_AVX512
static inline __m512 load16(const void *row, int dtype, int64_t i, __mmask16 mask) {
    if (dtype == DTYPE_F32) return _mm512_maskz_loadu_ps(mask, (const float *)row + i);
    __m256i h = _mm256_maskz_loadu_epi16(mask, (const uint16_t *)row + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline __mmask16 tail_mask(int64_t left) { return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u); }

static float quantize_row(const void *row, int dtype, int64_t k, uint8_t *codes) {
    __m512 amax = _mm512_setzero_ps();
    __mmask16 nan = 0;
    for (int64_t i = 0; i < k; i += 16) {
        __m512 v = load16(row, dtype, i, tail_mask(k - i)); /* masked lanes load 0: no effect */
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        amax = _mm512_max_ps(amax, _mm512_abs_ps(v));
    }
    float scale = row_scale(_mm512_reduce_max_ps(amax), nan != 0);
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
#else
static float quantize_row(const void *row, int dtype, int64_t k, uint8_t *codes) {
    float amax = 0.0f;
    int nan = 0;
    for (int64_t i = 0; i < k; i++) {
        float a = fabsf(load_one(row, dtype, i));
        nan |= a != a;
        amax = a > amax ? a : amax;
    }
    float scale = row_scale(amax, nan);
    for (int64_t i = 0; i < k; i++) {
        float q = nearbyintf(load_one(row, dtype, i) / scale) + (float)ZERO_POINT; /* to nearest even */
        codes[i] = q >= 0.0f && q <= 255.0f ? (uint8_t)q : 0; /* out of range only for NaN rows */
    }
    return scale;
}
#endif

/* x [n, k] with rows row_stride elements apart (k contiguous) -> codes [n, k] uint8, scales [n] */
int sd_quantize_rows(int dtype, int64_t n, int64_t k, const void *x, int64_t row_stride, uint8_t *codes,
                     float *scales, int threads) {
    if ((dtype != DTYPE_F32 && dtype != DTYPE_BF16) || n < 0 || k <= 0) return 1;
    size_t item = dtype == DTYPE_F32 ? 4 : 2;
    int parallel = threads > 1 && n > 1 && n * k >= PARALLEL_ELEMENTS;
#pragma omp parallel for num_threads(threads) if (parallel) schedule(static)
    for (int64_t r = 0; r < n; r++)
        scales[r] = quantize_row((const char *)x + (size_t)(r * row_stride) * item, dtype, k, codes + r * k);
    return 0;
}

/* ---- epilogue ---- */

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

#ifdef SD_AVX512
static inline __m256i bf16_lanes(__m512 y) { /* to nearest even; NaN -> 0xffff */
    __m512i bits = _mm512_castps_si512(y);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    __mmask16 ordered = _mm512_cmp_ps_mask(y, y, _CMP_ORD_Q);
    return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(ordered, _mm512_set1_epi32(0xffff), rounded));
}

static inline __m512 bf16_widen(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

static void epilogue_block(int dtype, const float *sums, float scale, const void *bias, void *out, int64_t c0,
                           int64_t c1) {
    __m512 s = _mm512_set1_ps(scale);
    for (int64_t c = c0; c < c1; c += 16) {
        __mmask16 mask = tail_mask(c1 - c);
        __m512 y = _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, sums + c), s);
        if (dtype == DTYPE_F32) {
            if (bias) y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(mask, (const float *)bias + c));
            _mm512_mask_storeu_ps((float *)out + c, mask, y);
        } else {
            __m256i h = bf16_lanes(y);
            if (bias) {
                __m512 b = bf16_widen(_mm256_maskz_loadu_epi16(mask, (const uint16_t *)bias + c));
                h = bf16_lanes(_mm512_add_ps(bf16_widen(h), b));
            }
            _mm256_mask_storeu_epi16((uint16_t *)out + c, mask, h);
        }
    }
}
#else
static void epilogue_block(int dtype, const float *sums, float scale, const void *bias, void *out, int64_t c0,
                           int64_t c1) {
    for (int64_t c = c0; c < c1; c++) {
        float y = sums[c] * scale;
        if (dtype == DTYPE_F32) {
            ((float *)out)[c] = bias ? y + ((const float *)bias)[c] : y;
        } else {
            uint16_t h = float_to_bf16(y);
            if (bias) h = float_to_bf16(bf16_to_float(h) + bf16_to_float(((const uint16_t *)bias)[c]));
            ((uint16_t *)out)[c] = h;
        }
    }
}
#endif

/* sums [n, m] float32, row_scales [n] (rows row_scale_stride apart), bias [m] of dtype or NULL
 * -> out [n, m] of dtype, all contiguous */
int sd_epilogue(int dtype, int64_t n, int64_t m, const float *sums, const float *row_scales,
                int64_t row_scale_stride, const void *bias, void *out, int threads) {
    if ((dtype != DTYPE_F32 && dtype != DTYPE_BF16) || n < 0 || m <= 0) return 1;
    size_t item = dtype == DTYPE_F32 ? 4 : 2;
    int64_t blocks = (m + BLOCK - 1) / BLOCK;
    int parallel = threads > 1 && n * blocks > 1 && n * m >= PARALLEL_ELEMENTS;
#pragma omp parallel for num_threads(threads) if (parallel) schedule(static)
    for (int64_t w = 0; w < n * blocks; w++) {
        int64_t r = w / blocks, c0 = (w % blocks) * BLOCK, c1 = c0 + BLOCK < m ? c0 + BLOCK : m;
        epilogue_block(dtype, sums + r * m, row_scales[r * row_scale_stride], bias, (char *)out + (size_t)(r * m) * item,
                       c0, c1);
    }
    return 0;
}

/* ---- the product on AVX512-VNNI: integer sums and the epilogue in one call (and the quantization before) ----
 *
 * The weight codes are packed once (int8_kernel.Int8Kernel.pack) in groups of GROUP output
 * columns: group g, input quad q (inputs 4q .. 4q+3) holds GROUP x 4 bytes, column g*GROUP + c's
 * four codes at bytes 4c .. 4c+3, so that one vpdpbusd adds four u8 x s8 products into each of
 * 16 columns' int32 sums. Columns past the weight's hold zero codes; k is a multiple of 4.
 *
 *   sum_c  = sum_i code_i * w_ci - compensation_c   (exact in int32: |sum| < 2^31 for k < 2^16;
 *                                                    compensation_c = 128 * sum_i w_ci)
 *   sums_c = float32(sum_c) * weight_scale_c        (to nearest even, then one float32 product)
 * then the epilogue above, element by element. oneDNN's kernel writes the same sums_c bit for bit
 * (its integer sums are exact too, and it scales them the same way; tests/runners/test_w8a8.py
 * compares), so the two kernels' products are the same bits.
 */

#if defined(SD_AVX512) && defined(__AVX512VNNI__)
#define SD_VNNI 1
#endif

#define GROUP 64   /* output columns of a packed group: 4 vectors of 16 int32 sums */
#define ROW_TILE 6 /* rows a group's weights are loaded once for: 6 x 4 sums + 4 weights in registers */

int sd_w8a8_vnni(void) {
#ifdef SD_VNNI
    return 1;
#else
    return 0;
#endif
}

#ifdef SD_VNNI
typedef struct {
    int dtype;
    int64_t n, k4, m;
    const uint8_t *codes; /* [n, 4 * k4] */
    const float *row_scales;
    int64_t row_scale_stride;
    const int8_t *packed;        /* [groups, k4, GROUP, 4] */
    const int32_t *compensation; /* [m] */
    const float *weight_scales;  /* [m] */
    const void *bias;            /* [m] or NULL */
    void *out;                   /* [n, m] */
    const uint8_t *lo;           /* w8a16 only: the codes' low bytes [n, 4 * k4] (codes: their high bytes + 128) */
} Product;

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

/* the epilogue of a tile's exact integer sums (acc: rows x GROUP, compensation already taken off) */
static void product_tile(const Product *p, int64_t g, int64_t r0, int rows, __m512i acc[ROW_TILE][4]) {
    size_t item = p->dtype == DTYPE_F32 ? 4 : 2;
    for (int b = 0; b < 4; b++) {
        int64_t c = g * GROUP + b * 16;
        if (c >= p->m) break;
        __mmask16 mask = tail_mask(p->m - c);
        __m512 scale = _mm512_maskz_loadu_ps(mask, p->weight_scales + c);
        __m512 bias = _mm512_setzero_ps();
        if (p->bias && p->dtype == DTYPE_F32) bias = _mm512_maskz_loadu_ps(mask, (const float *)p->bias + c);
        if (p->bias && p->dtype == DTYPE_BF16)
            bias = bf16_widen(_mm256_maskz_loadu_epi16(mask, (const uint16_t *)p->bias + c));
        for (int r = 0; r < rows; r++) {
            __m512i exact = acc[r][b];
            __m512 sums = _mm512_mul_ps(_mm512_cvt_roundepi32_ps(exact, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), scale);
            __m512 y = _mm512_mul_ps(sums, _mm512_set1_ps(p->row_scales[(r0 + r) * p->row_scale_stride]));
            char *out = (char *)p->out + (size_t)((r0 + r) * p->m + c) * item;
            if (p->dtype == DTYPE_F32) {
                if (p->bias) y = _mm512_add_ps(y, bias);
                _mm512_mask_storeu_ps((float *)out, mask, y);
            } else {
                __m256i h = bf16_lanes(y);
                if (p->bias) h = bf16_lanes(_mm512_add_ps(bf16_widen(h), bias));
                _mm256_mask_storeu_epi16((uint16_t *)out, mask, h);
            }
        }
    }
}

static void product_item(const Product *p, int64_t g, int64_t r0) {
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
    for (int b = 0; b < 4 && g * GROUP + b * 16 < p->m; b++) {
        int64_t c = g * GROUP + b * 16;
        __m512i compensation = _mm512_maskz_loadu_epi32(tail_mask(p->m - c), p->compensation + c);
        for (int r = 0; r < rows; r++) sums[r][b] = _mm512_sub_epi32(sums[r][b], compensation);
    }
    product_tile(p, g, r0, rows, sums);
}
#endif

#ifdef SD_VNNI
static int check(int dtype, int64_t n, int64_t k, int64_t m) {
    return (dtype != DTYPE_F32 && dtype != DTYPE_BF16) || n < 0 || k <= 0 || k % 4 || m <= 0;
}

static int parallel_product(const Product *p, int threads) {
    int64_t groups = (p->m + GROUP - 1) / GROUP, tiles = (p->n + ROW_TILE - 1) / ROW_TILE;
    return threads > 1 && groups * tiles > 1 && p->n * p->k4 * 4 * p->m >= PARALLEL_ELEMENTS;
}

/* group-major work items: a thread's consecutive items share a group's weights (in a parallel region) */
static void product_items(const Product *p) {
    int64_t groups = (p->m + GROUP - 1) / GROUP, tiles = (p->n + ROW_TILE - 1) / ROW_TILE;
#pragma omp for schedule(static)
    for (int64_t w = 0; w < groups * tiles; w++) product_item(p, w / tiles, (w % tiles) * ROW_TILE);
}
#endif

/* codes [n, k] uint8 (sd_quantize_rows') and row_scales (rows row_scale_stride apart) times the
 * packed weight [m, k] -> out [n, m] of dtype, contiguous */
int sd_w8a8_product(int dtype, int64_t n, int64_t k, int64_t m, const uint8_t *codes, const float *row_scales,
                    int64_t row_scale_stride, const int8_t *packed, const int32_t *compensation,
                    const float *weight_scales, const void *bias, void *out, int threads) {
#ifdef SD_VNNI
    if (check(dtype, n, k, m)) return 1;
    Product p = {dtype, n, k / 4, m, codes, row_scales, row_scale_stride, packed, compensation, weight_scales, bias, out};
#pragma omp parallel num_threads(threads) if (parallel_product(&p, threads))
    product_items(&p);
    return 0;
#else
    (void)dtype, (void)n, (void)k, (void)m, (void)codes, (void)row_scales, (void)row_scale_stride, (void)packed;
    (void)compensation, (void)weight_scales, (void)bias, (void)out, (void)threads;
    return 2;
#endif
}

/* sd_quantize_rows then sd_w8a8_product in one call: x [n, k] of dtype, rows x_row_stride
 * elements apart (k contiguous) -> out [n, m] of dtype */
int sd_w8a8_quantized_product(int dtype, int64_t n, int64_t k, int64_t m, const void *x, int64_t x_row_stride,
                              const int8_t *packed, const int32_t *compensation, const float *weight_scales,
                              const void *bias, void *out, int threads) {
#ifdef SD_VNNI
    if (check(dtype, n, k, m)) return 1;
    uint8_t *codes = malloc((size_t)(n * k) + 1);
    float *scales = malloc(sizeof(float) * (size_t)(n + 1));
    if (!codes || !scales) {
        free(codes), free(scales);
        return 3;
    }
    size_t item = dtype == DTYPE_F32 ? 4 : 2;
    Product p = {dtype, n, k / 4, m, codes, scales, 1, packed, compensation, weight_scales, bias, out};
#pragma omp parallel num_threads(threads) if (parallel_product(&p, threads))
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < n; r++)
            scales[r] = quantize_row((const char *)x + (size_t)(r * x_row_stride) * item, dtype, k, codes + r * k);
        product_items(&p); /* after the loop's barrier: every row quantized */
    }
    free(codes), free(scales);
    return 0;
#else
    (void)dtype, (void)n, (void)k, (void)m, (void)x, (void)x_row_stride, (void)packed, (void)compensation;
    (void)weight_scales, (void)bias, (void)out, (void)threads;
    return 2;
#endif
}

/* ---- w8a16 on AVX512-VNNI: the same packed int8 weights, activations in ~15-bit integers ----
 *
 * quantize, per row of x (as above, with another largest code):
 *   scale  = max(amax, 1e-30f) / (float)limit                (one float32 division)
 *   code_i = round_half_even(x_i / scale), in [-limit, limit] (one float32 division)
 * limit (int8_kernel.wide_activation_limit) is at most 16383 and keeps |sum_i code_i * w_ci|
 * <= limit * 127 * k below 2^31: the int32 sum is exact. A NaN row's scale is NaN (its results
 * NaN), its codes clamped into range.
 *
 * Each code is split into bytes, code = 256 * hi + lo with lo = code & 255 (0 .. 255) and hi =
 * code >> 8 (arithmetic: -64 .. 63), and the kernel sums both as vpdpbusd's unsigned operand,
 * hi + 128 (64 .. 191) and lo, against the same packed codes w8a8 multiplies:
 *   S_hi = sum_i (hi_i + 128) * w_ci,   S_lo = sum_i lo_i * w_ci
 *   sum_c = 256 * (S_hi - compensation_c) + S_lo      (compensation_c = 128 * sum_i w_ci)
 * in int32 arithmetic, which wraps: the result is the exact sum modulo 2^32, and that sum lies
 * in (-2^31, 2^31), so it is the exact sum. Then the w8a8 epilogue (product_tile): float32(sum)
 * times the weight scale, times the row's scale, rounded to the dtype, plus the bias. A row's
 * result is a function of that row alone, whatever the tiles and threads.
 */

#define ROW_TILE16 3 /* 3 rows x 4 x 2 sums + 4 weights in registers */

int sd_w8a16_quantize_rows(int dtype, int64_t n, int64_t k, const void *x, int64_t row_stride, int32_t limit,
                           uint8_t *hi, uint8_t *lo, float *scales, int threads);

#ifdef SD_VNNI
static float quantize_row16(const void *row, int dtype, int64_t k, int32_t limit, uint8_t *hi, uint8_t *lo) {
    __m512 amax = _mm512_setzero_ps();
    __mmask16 nan = 0;
    for (int64_t i = 0; i < k; i += 16) {
        __m512 v = load16(row, dtype, i, tail_mask(k - i));
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        amax = _mm512_max_ps(amax, _mm512_abs_ps(v));
    }
    float a = _mm512_reduce_max_ps(amax);
    float scale = nan ? NAN : (a < MIN_SCALE ? MIN_SCALE : a) / (float)limit;
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

static void product_item16(const Product *p, int64_t g, int64_t r0) {
    __m512i high[ROW_TILE16][4], low[ROW_TILE16][4], sums[ROW_TILE][4];
    int rows = (int)min64(p->n - r0, ROW_TILE16);
    switch (rows) { /* a constant row count per case: the sums stay in registers */
    case 3: tile_sums16(p, g, r0, 3, high, low); break;
    case 2: tile_sums16(p, g, r0, 2, high, low); break;
    default: tile_sums16(p, g, r0, 1, high, low); break;
    }
    for (int b = 0; b < 4 && g * GROUP + b * 16 < p->m; b++) {
        int64_t c = g * GROUP + b * 16;
        __m512i compensation = _mm512_maskz_loadu_epi32(tail_mask(p->m - c), p->compensation + c);
        for (int r = 0; r < rows; r++) /* 256 * (S_hi - compensation) + S_lo, wrapping: exact */
            sums[r][b] = _mm512_add_epi32(_mm512_slli_epi32(_mm512_sub_epi32(high[r][b], compensation), 8), low[r][b]);
    }
    product_tile(p, g, r0, rows, sums);
}

static int parallel_product16(const Product *p, int threads) {
    int64_t groups = (p->m + GROUP - 1) / GROUP, tiles = (p->n + ROW_TILE16 - 1) / ROW_TILE16;
    return threads > 1 && groups * tiles > 1 && p->n * p->k4 * 4 * p->m >= PARALLEL_ELEMENTS;
}

static void product_items16(const Product *p) {
    int64_t groups = (p->m + GROUP - 1) / GROUP, tiles = (p->n + ROW_TILE16 - 1) / ROW_TILE16;
#pragma omp for schedule(static)
    for (int64_t w = 0; w < groups * tiles; w++) product_item16(p, w / tiles, (w % tiles) * ROW_TILE16);
}

/* the largest code for k inputs: at most 16383, and limit * 127 * k < 2^31 (int8_kernel.py's twin) */
static int check_limit(int64_t k, int32_t limit) { return limit < 1 || limit > 16383 || (int64_t)limit * 127 * k >= 2147483648LL; }
#endif

/* x [n, k] of dtype, rows row_stride elements apart -> hi, lo [n, k] uint8 (code = 256 * (hi - 128) + lo), scales [n] */
int sd_w8a16_quantize_rows(int dtype, int64_t n, int64_t k, const void *x, int64_t row_stride, int32_t limit,
                           uint8_t *hi, uint8_t *lo, float *scales, int threads) {
#ifdef SD_VNNI
    if ((dtype != DTYPE_F32 && dtype != DTYPE_BF16) || n < 0 || k <= 0 || check_limit(k, limit)) return 1;
    size_t item = dtype == DTYPE_F32 ? 4 : 2;
    int parallel = threads > 1 && n > 1 && n * k >= PARALLEL_ELEMENTS;
#pragma omp parallel for num_threads(threads) if (parallel) schedule(static)
    for (int64_t r = 0; r < n; r++)
        scales[r] = quantize_row16((const char *)x + (size_t)(r * row_stride) * item, dtype, k, limit, hi + r * k,
                                   lo + r * k);
    return 0;
#else
    (void)dtype, (void)n, (void)k, (void)x, (void)row_stride, (void)limit, (void)hi, (void)lo, (void)scales;
    (void)threads;
    return 2;
#endif
}

/* hi, lo [n, k] uint8 (sd_w8a16_quantize_rows') and row_scales (rows row_scale_stride apart) times
 * the packed weight [m, k] -> out [n, m] of dtype, contiguous */
int sd_w8a16_product(int dtype, int64_t n, int64_t k, int64_t m, const uint8_t *hi, const uint8_t *lo,
                     const float *row_scales, int64_t row_scale_stride, const int8_t *packed,
                     const int32_t *compensation, const float *weight_scales, const void *bias, void *out,
                     int threads) {
#ifdef SD_VNNI
    if (check(dtype, n, k, m)) return 1;
    Product p = {dtype, n, k / 4, m, hi, row_scales, row_scale_stride, packed, compensation, weight_scales, bias,
                 out, lo};
#pragma omp parallel num_threads(threads) if (parallel_product16(&p, threads))
    product_items16(&p);
    return 0;
#else
    (void)dtype, (void)n, (void)k, (void)m, (void)hi, (void)lo, (void)row_scales, (void)row_scale_stride;
    (void)packed, (void)compensation, (void)weight_scales, (void)bias, (void)out, (void)threads;
    return 2;
#endif
}

/* sd_w8a16_quantize_rows then sd_w8a16_product in one call: x [n, k] of dtype, rows x_row_stride
 * elements apart (k contiguous) -> out [n, m] of dtype */
int sd_w8a16_quantized_product(int dtype, int64_t n, int64_t k, int64_t m, const void *x, int64_t x_row_stride,
                               int32_t limit, const int8_t *packed, const int32_t *compensation,
                               const float *weight_scales, const void *bias, void *out, int threads) {
#ifdef SD_VNNI
    if (check(dtype, n, k, m) || check_limit(k, limit)) return 1;
    uint8_t *hi = malloc((size_t)(2 * n * k) + 1);
    float *scales = malloc(sizeof(float) * (size_t)(n + 1));
    if (!hi || !scales) {
        free(hi), free(scales);
        return 3;
    }
    uint8_t *lo = hi + n * k;
    size_t item = dtype == DTYPE_F32 ? 4 : 2;
    Product p = {dtype, n, k / 4, m, hi, scales, 1, packed, compensation, weight_scales, bias, out, lo};
#pragma omp parallel num_threads(threads) if (parallel_product16(&p, threads))
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < n; r++)
            scales[r] = quantize_row16((const char *)x + (size_t)(r * x_row_stride) * item, dtype, k, limit,
                                       hi + r * k, lo + r * k);
        product_items16(&p); /* after the loop's barrier: every row quantized */
    }
    free(hi), free(scales);
    return 0;
#else
    (void)dtype, (void)n, (void)k, (void)m, (void)x, (void)x_row_stride, (void)limit, (void)packed;
    (void)compensation, (void)weight_scales, (void)bias, (void)out, (void)threads;
    return 2;
#endif
}
