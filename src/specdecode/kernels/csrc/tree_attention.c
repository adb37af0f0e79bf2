/* Attention whose result for a query depends only on the logical sequence of keys and values
 * it sees (their values and their order), never on where they sit in the cache, how many other
 * queries share the call, how many keys the call holds in all, or how many threads run it.
 *
 * That makes one call per layer serve every query of a sequence (one-token decoding, chain and
 * tree verification) with each query's output bitwise what it gets alone: a tree node sees the
 * cached prefix, then its ancestors and itself at other cache slots, and gets the bits that
 * decoding its path alone (the same keys, contiguous) gives it.
 *
 * The arithmetic of one query row (one query head of one query), in float32:
 *   score_j = (fma chain over t = 0 .. d-1, in that order: acc = fma(q[t], k_j[t], acc)) * scale
 *   m       = max_j score_j
 *   p_j     = exp(score_j - m)                  (exp_lanes: one polynomial, mul and add only)
 *   sum     = 16 lanes, lane l adding p_j for j = l mod 16 in increasing j, then folded 8, 4, 2, 1
 *   out[t]  = (fma chain over j, in increasing j: acc = fma(p_j, v_j[t], acc)) / sum, rounded
 *             to the model's dtype (to nearest even)
 * where j is the LOGICAL index of a key: 0 .. contiguous-first-1 are cache positions first ..
 * contiguous-1 (first: 0, or a sliding window's first position), then cache position extra[e].
 * With a soft cap, score_j = tanhf(score_j / cap) * cap before the maximum. Every other expression is written out in C and
 * compiled with -ffp-contract=off and without -ffast-math: the compiler may vectorize it (lanes
 * are independent elements) but neither fuse a multiply into an add nor reassociate a sum. The
 * fused multiply-adds are explicit (fma_lanes, or _mm256_fmadd_ps on AVX2: one rounding, IEEE's,
 * on every instruction set).
 * So an element gets the same bits in any lane, block, work item or thread.
 *
 * Grouped-query attention: query head h reads key/value head h / (heads / kv_heads); the rows of
 * a group's query heads share each key and value loaded.
 */

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
/* AVX2 builds (int8_layer.c's for AVX2 CPUs): gcc keeps 16-lane vectors in memory there and runs
 * fma_lanes a lane at a time, so the two fma loops below (scores, weighted values) run on the two
 * 8-lane halves in registers: the same fused multiply-adds, element by element, in the same order */
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define SD_AVX2_HALVES 1
#endif
#ifdef _OPENMP
#include <omp.h>
#endif
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16
#define MAX_DIM 256

typedef float vf __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(LANES * sizeof(int32_t))));

enum { DTYPE_F32 = 0, DTYPE_BF16 = 1, DTYPE_F16 = 2 };

int sd_abi_version(void) { return 4; }

/* ---- dtype conversions (exact to float32; float32 to bfloat16/float16 round to nearest even) ---- */

static inline float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u); /* quiet NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

static void to_float(float *restrict dst, const void *restrict src, long count, int dtype) {
    if (dtype == DTYPE_F32) {
        memcpy(dst, src, (size_t)count * sizeof(float));
    } else if (dtype == DTYPE_BF16) {
        const uint16_t *s = (const uint16_t *)src;
        for (long i = 0; i < count; i++) dst[i] = bf16_to_float(s[i]);
    } else {
        const _Float16 *s = (const _Float16 *)src;
        for (long i = 0; i < count; i++) dst[i] = (float)s[i];
    }
}

static void from_float(void *restrict dst, const float *restrict src, long count, int dtype) {
    if (dtype == DTYPE_F32) {
        memcpy(dst, src, (size_t)count * sizeof(float));
    } else if (dtype == DTYPE_BF16) {
        uint16_t *d = (uint16_t *)dst;
        for (long i = 0; i < count; i++) d[i] = float_to_bf16(src[i]);
    } else {
        _Float16 *d = (_Float16 *)dst;
        for (long i = 0; i < count; i++) d[i] = (_Float16)src[i];
    }
}

static inline size_t elem_size(int dtype) { return dtype == DTYPE_F32 ? 4 : 2; }

/* ---- exp, on 16 lanes: Cephes' expf polynomial, mul and add only (no libm: its bits may vary) ---- */

static inline vf splat(float x) { return (vf){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

static inline vf select_lanes(vi mask, vf yes, vf no) { return (vf)(((vi)yes & mask) | ((vi)no & ~mask)); }

static inline vf exp_lanes(vf x) { /* for x <= 0; below -87 (under float32's normal range): 0 */
    const vf magic = splat(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
    vi underflow = x < splat(-87.0f);
    x = select_lanes(underflow, splat(-87.0f), x);
    vf n = (x * splat(1.44269504088896341f) + magic) - magic; /* round(x / ln 2) */
    vf r = (x - n * splat(0.693359375f)) - n * splat(-2.12194440e-4f);
    vf z = r * r;
    vf y = splat(1.9875691500e-4f);
    y = y * r + splat(1.3981999507e-3f);
    y = y * r + splat(8.3334519073e-3f);
    y = y * r + splat(4.1665795894e-2f);
    y = y * r + splat(1.6666665459e-1f);
    y = y * r + splat(5.0000001201e-1f);
    y = (y * z + r) + splat(1.0f);
    vi exponent = (__builtin_convertvector(n, vi) + 127) << 23;
    y = y * (vf)exponent;
    return select_lanes(underflow, splat(0.0f), y);
}


/* a * b + c, rounded once: the same bits in every lane and on every instruction set */
static inline vf fma_lanes(vf a, vf b, vf c) {
#if defined(__AVX512F__)
    return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#else
    vf r;
    for (int l = 0; l < LANES; l++) r[l] = fmaf(a[l], b[l], c[l]);
    return r;
#endif
}

static inline vf load_lanes(const float *p) {
    vf x;
    memcpy(&x, p, sizeof x);
    return x;
}

static inline void store_lanes(float *p, vf x) { memcpy(p, &x, sizeof x); }

/* ---- keys, 16 at a time, transposed so that lanes run over keys: kt[t * 16 + l] = key l, element t ---- */

static inline void transpose16(vf *r) { /* 16 x 16 in registers: four rounds of interleaving rows i and i + 8 */
    const vi lo = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23};
    const vi hi = {8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    for (int round = 0; round < 4; round++) {
        vf next[LANES];
        for (int i = 0; i < LANES / 2; i++) {
            next[2 * i] = __builtin_shuffle(r[i], r[i + LANES / 2], lo);
            next[2 * i + 1] = __builtin_shuffle(r[i], r[i + LANES / 2], hi);
        }
        for (int i = 0; i < LANES; i++) r[i] = next[i];
    }
}

/* rows[l] (count of them, the rest zeros): d elements each, in the model's dtype; kt holds dp >= d
 * elements per key (a multiple of 16), zeros past d */
static void transpose_keys(float *restrict kt, const char *const *rows, int count, int d, int dp, int dtype) {
    float block[LANES * MAX_DIM];
    for (int l = 0; l < LANES; l++) {
        if (l < count) {
            to_float(block + l * dp, rows[l], d, dtype);
            memset(block + l * dp + d, 0, (size_t)(dp - d) * sizeof(float));
        } else {
            memset(block + l * dp, 0, (size_t)dp * sizeof(float));
        }
    }
#if defined(__AVX512F__)
    for (int c = 0; c < dp; c += LANES) {
        vf r[LANES];
        for (int l = 0; l < LANES; l++) r[l] = load_lanes(block + l * dp + c);
        transpose16(r);
        for (int t = 0; t < LANES; t++) store_lanes(kt + (long)(c + t) * LANES, r[t]);
    }
#else /* without 16-lane registers gcc runs transpose16's shuffles through memory, a lane at a time:
       * the plain loop is faster there (int8_layer.c's AVX2 build), and moves the same bits */
    for (int t = 0; t < dp; t++)
        for (int l = 0; l < LANES; l++) kt[(long)t * LANES + l] = block[l * dp + t];
#endif
}

/* ---- scores: score = (sum over t in order of q[t] * k[t], each step one fma) * scale ---- */

#define QK_ROWS 4

/* QK_ROWS query rows against `blocks` (1 or 2) transposed key blocks; out[r] gets 16 * blocks scores */
#ifdef SD_AVX2_HALVES
static inline __attribute__((always_inline)) void scores_rows(const float *const *q, const float *kt, long kt_stride,
                                                              int blocks, int d, float scale, float *const *out) {
    for (int b = 0; b < blocks; b++) { /* a block at a time: 4 rows x 2 halves in registers */
        __m256 acc[QK_ROWS][2];
        for (int r = 0; r < QK_ROWS; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        for (int t = 0; t < d; t++) {
            const float *k = kt + b * kt_stride + (long)t * LANES;
            __m256 k0 = _mm256_loadu_ps(k), k1 = _mm256_loadu_ps(k + LANES / 2);
            for (int r = 0; r < QK_ROWS; r++) {
                __m256 qt = _mm256_set1_ps(q[r][t]);
                acc[r][0] = _mm256_fmadd_ps(qt, k0, acc[r][0]), acc[r][1] = _mm256_fmadd_ps(qt, k1, acc[r][1]);
            }
        }
        for (int r = 0; r < QK_ROWS; r++) {
            _mm256_storeu_ps(out[r] + b * LANES, _mm256_mul_ps(acc[r][0], _mm256_set1_ps(scale)));
            _mm256_storeu_ps(out[r] + b * LANES + LANES / 2, _mm256_mul_ps(acc[r][1], _mm256_set1_ps(scale)));
        }
    }
}
#else
static inline __attribute__((always_inline)) void scores_rows(const float *const *q, const float *kt, long kt_stride,
                                                              int blocks, int d, float scale, float *const *out) {
    vf acc[QK_ROWS][2];
    for (int r = 0; r < QK_ROWS; r++) acc[r][0] = acc[r][1] = splat(0.0f);
    for (int t = 0; t < d; t++) {
        for (int b = 0; b < blocks; b++) {
            vf k = load_lanes(kt + b * kt_stride + (long)t * LANES);
            for (int r = 0; r < QK_ROWS; r++) acc[r][b] = fma_lanes(splat(q[r][t]), k, acc[r][b]);
        }
    }
    for (int r = 0; r < QK_ROWS; r++)
        for (int b = 0; b < blocks; b++) store_lanes(out[r] + b * LANES, acc[r][b] * splat(scale));
}
#endif

/* ---- weights: p_j in place over s[0 .. length), zeros up to the next multiple of 16; returns their sum ---- */

static float softmax_weights(float *restrict s, long length) {
    long padded = (length + LANES - 1) / LANES * LANES;
    const vi iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    vf high = splat(-INFINITY); /* the maximum is exact: any order finds it */
    for (long j0 = 0; j0 < padded; j0 += LANES) {
        vf x = select_lanes(iota < (vi){0} + (int)(length - j0), load_lanes(s + j0), splat(-INFINITY));
        high = select_lanes(x > high, x, high);
    }
    float m = -INFINITY;
    for (int l = 0; l < LANES; l++) m = high[l] > m ? high[l] : m;
    vf lanes = splat(0.0f);
    for (long j0 = 0; j0 < padded; j0 += LANES) {
        vi inside = iota < (vi){0} + (int)(length - j0);
        vf x = select_lanes(inside, load_lanes(s + j0) - splat(m), splat(0.0f));
        vf p = select_lanes(inside, exp_lanes(x), splat(0.0f));
        store_lanes(s + j0, p);
        lanes = lanes + p;
    }
    float fold[LANES];
    memcpy(fold, &lanes, sizeof fold);
    for (int width = LANES / 2; width >= 1; width /= 2)
        for (int l = 0; l < width; l++) fold[l] = fold[l] + fold[l + width];
    return fold[0];
}

/* ---- weighted values: acc[t] = fma(p_j, v_j[t], acc[t]) for j in logical order ---- */

#define PV_ROWS 4
#define MAX_BLOCKS (MAX_DIM / LANES)

/* rows r < count (of PV_ROWS), weights p[r][j], over value rows values + j * stride for j in [0, m),
 * for the 16-lane blocks b0 .. b0 + nb - 1 of d (an output element's sum is the same in any chunk) */
#ifdef SD_AVX2_HALVES
static inline __attribute__((always_inline)) void weigh_values(vf (*acc)[MAX_BLOCKS], const float *const *p,
                                                               int count, const float *values, long stride, long m,
                                                               int b0, const int nb) {
    for (int b = 0; b < nb; b++) { /* a block at a time: 4 rows x 2 halves in registers */
        __m256 a[PV_ROWS][2];
        for (int r = 0; r < PV_ROWS; r++)
            for (int h = 0; h < 2; h++) a[r][h] = _mm256_loadu_ps((const float *)&acc[r][b] + h * LANES / 2);
        for (long j = 0; j < m; j++) {
            const float *v = values + j * stride + (b0 + b) * LANES;
            __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + LANES / 2);
            for (int r = 0; r < PV_ROWS; r++) {
                if (r >= count) break;
                __m256 pj = _mm256_set1_ps(p[r][j]);
                a[r][0] = _mm256_fmadd_ps(pj, v0, a[r][0]), a[r][1] = _mm256_fmadd_ps(pj, v1, a[r][1]);
            }
        }
        for (int r = 0; r < PV_ROWS; r++)
            for (int h = 0; h < 2; h++) _mm256_storeu_ps((float *)&acc[r][b] + h * LANES / 2, a[r][h]);
    }
}
#else
static inline __attribute__((always_inline)) void weigh_values(vf (*acc)[MAX_BLOCKS], const float *const *p,
                                                               int count, const float *values, long stride, long m,
                                                               int b0, const int nb) {
    vf a[PV_ROWS][MAX_BLOCKS];
    for (int r = 0; r < PV_ROWS; r++)
        for (int b = 0; b < nb; b++) a[r][b] = acc[r][b];
    for (long j = 0; j < m; j++) {
        const float *v = values + j * stride + b0 * LANES;
        for (int b = 0; b < nb; b++) {
            vf vb = load_lanes(v + b * LANES);
            for (int r = 0; r < PV_ROWS; r++)
                if (r < count) a[r][b] = fma_lanes(splat(p[r][j]), vb, a[r][b]);
        }
    }
    for (int r = 0; r < PV_ROWS; r++)
        for (int b = 0; b < nb; b++) acc[r][b] = a[r][b];
}
#endif

static void weigh_values_any(vf (*acc)[MAX_BLOCKS], const float *const *p, int count, const float *values,
                             long stride, long m, int b0, int nb) {
    switch (nb) { /* the usual chunks unrolled, their accumulators in registers */
    case 2: weigh_values(acc, p, count, values, stride, m, b0, 2); break;
    case 4: weigh_values(acc, p, count, values, stride, m, b0, 4); break;
    default:
        for (int b = 0; b < nb; b++) {
            vf one[PV_ROWS][MAX_BLOCKS];
            for (int r = 0; r < PV_ROWS; r++) one[r][0] = acc[r][b];
            weigh_values(one, p, count, values, stride, m, b0 + b, 1);
            for (int r = 0; r < PV_ROWS; r++) acc[r][b] = one[r][0];
        }
    }
}

/* ---- one call: every query head of every query of one sequence, one layer ---- */

typedef struct {
    int dtype, heads, kv_heads, n, d, max_extra, group, rows, dp, nb; /* dp: d rounded up to 16 lanes */
    const char *q;
    long q_head_stride, q_row_stride; /* elements */
    const char *keys, *values;
    long kv_head_stride; /* elements; a position's d elements are contiguous */
    const int32_t *contiguous, *extra, *first; /* first: NULL, or each query's first contiguous position */
    float scale, softcap;
    char *out;
    long out_head_stride, out_row_stride;
    size_t esize;
    /* scratch, per key/value head g */
    long cmax, blocks, extra_blocks, row_len, key_chunks, dchunks, hblocks;
    float *kt;     /* [g][blocks][dp][16] keys 0 .. cmax-1, transposed */
    float *vrows;  /* [g][cmax][dp] */
    float *scores; /* [g][rows][row_len]: contiguous scores from 0; extras' from contig_end */
    float *xv;     /* [g][n][max_extra][dp] each query's extra values */
    float *p;      /* [threads][PV_ROWS][row_len] weights */
    long contig_end;
    int streamed; /* few query rows (a decoding query, or two): keys and values converted as they
                   * are used, once a row block or query, kt and vrows left out; the same
                   * arithmetic, so the same bits. More rows convert more often than a copy costs */
} Call;

static inline int extras_of(const Call *c, int query) { /* count of extra[query, :] before the first -1 */
    int e = 0;
    while (e < c->max_extra && c->extra[(long)query * c->max_extra + e] >= 0) e++;
    return e;
}

static inline float *scores_of(const Call *c, int g, int row) {
    return c->scores + ((long)g * c->rows + row) * c->row_len;
}

static void load_q(const Call *c, int g, int row, float *dst) { /* row = query * group + head % group */
    int query = row / c->group, head = g * c->group + row % c->group;
    to_float(dst, c->q + ((long)head * c->q_head_stride + (long)query * c->q_row_stride) * c->esize, c->d, c->dtype);
}

/* a value row in float32, zeros from d to dp */
static void value_row(const Call *c, float *dst, const char *src) {
    to_float(dst, src, c->d, c->dtype);
    memset(dst + c->d, 0, (size_t)(c->dp - c->d) * sizeof(float));
}

/* key block b of head g (keys b * 16 .. below cmax) transposed into kt */
static void transpose_block(const Call *c, int g, long b, float *kt) {
    const char *keys = c->keys + (long)g * c->kv_head_stride * c->esize;
    const char *rows[LANES];
    int count = c->cmax - b * LANES < LANES ? (int)(c->cmax - b * LANES) : LANES;
    for (int l = 0; l < count; l++) rows[l] = keys + (b * LANES + l) * c->d * c->esize;
    transpose_keys(kt, rows, count, c->d, c->dp, c->dtype);
}

/* phase 1: key block b of head g transposed, its value rows in float32 */
static void prepare_block(const Call *c, int g, long b) {
    const char *values = c->values + (long)g * c->kv_head_stride * c->esize;
    int count = c->cmax - b * LANES < LANES ? (int)(c->cmax - b * LANES) : LANES;
    transpose_block(c, g, b, c->kt + ((long)g * c->blocks + b) * c->dp * LANES);
    for (int l = 0; l < count; l++)
        value_row(c, c->vrows + ((long)g * c->cmax + b * LANES + l) * c->dp, values + (b * LANES + l) * c->d * c->esize);
}

/* phase 2a: scores of QK_ROWS rows from r0 over key blocks [b_from, b_to) that one of them needs */
static void contiguous_scores(const Call *c, int g, int r0, long b_from, long b_to) {
    const int d = c->d;
    float qf[QK_ROWS][MAX_DIM];
    const float *q[QK_ROWS];
    long need = 0;
    for (int r = 0; r < QK_ROWS; r++) {
        int rr = r0 + r < c->rows ? r0 + r : c->rows - 1; /* a short last group repeats its last row */
        load_q(c, g, rr, qf[r]);
        q[r] = qf[r];
        long c_r = c->contiguous[rr / c->group];
        need = c_r > need ? c_r : need;
    }
    long need_blocks = (need + LANES - 1) / LANES;
    b_to = b_to < need_blocks ? b_to : need_blocks;
    float streamed[2 * MAX_DIM * LANES];
    for (long b = b_from; b < b_to; b += 2) {
        float *out[QK_ROWS];
        for (int r = 0; r < QK_ROWS; r++) out[r] = scores_of(c, g, r0 + r < c->rows ? r0 + r : c->rows - 1) + b * LANES;
        const float *kt = c->kt + ((long)g * c->blocks + b) * c->dp * LANES;
        if (c->streamed) { /* read by this item, and by the other row block's if there is one */
            for (long bb = b; bb < b + 2 && bb < b_to; bb++) transpose_block(c, g, bb, streamed + (bb - b) * c->dp * LANES);
            kt = streamed;
        }
        if (b + 1 < b_to)
            scores_rows(q, kt, c->dp * LANES, 2, d, c->scale, out);
        else
            scores_rows(q, kt, c->dp * LANES, 1, d, c->scale, out);
    }
}

/* phase 2b: a query's extra keys, for its group's rows of head g, into the scores' extras region;
 * its extra values gathered in float32 */
static void extra_scores(const Call *c, int g, int query) {
    const int d = c->d, extras = extras_of(c, query);
    if (extras == 0) return;
    const char *keys = c->keys + (long)g * c->kv_head_stride * c->esize;
    const char *values = c->values + (long)g * c->kv_head_stride * c->esize;
    const int32_t *slots = c->extra + (long)query * c->max_extra;
    float kt[LANES * MAX_DIM];
    float qf[QK_ROWS][MAX_DIM];
    for (int b = 0; b * LANES < extras; b++) {
        const char *rows[LANES];
        int count = extras - b * LANES < LANES ? extras - b * LANES : LANES;
        for (int l = 0; l < count; l++) rows[l] = keys + (long)slots[b * LANES + l] * d * c->esize;
        transpose_keys(kt, rows, count, d, c->dp, c->dtype);
        for (int h0 = 0; h0 < c->group; h0 += QK_ROWS) {
            const float *q[QK_ROWS];
            float *out[QK_ROWS];
            for (int r = 0; r < QK_ROWS; r++) {
                int rr = query * c->group + (h0 + r < c->group ? h0 + r : c->group - 1);
                load_q(c, g, rr, qf[r]);
                q[r] = qf[r];
                out[r] = scores_of(c, g, rr) + c->contig_end + b * LANES;
            }
            scores_rows(q, kt, 0, 1, d, c->scale, out);
        }
    }
    float *xv = c->xv + ((long)g * c->n + query) * c->max_extra * c->dp;
    for (int e = 0; e < extras; e++) value_row(c, xv + (long)e * c->dp, values + (long)slots[e] * d * c->esize);
}

/* weigh_values_any over the values of positions f .. f + seen - 1 of head g read from the cache,
 * 16 rows at a time converted to float32: each output element still adds its terms in logical order */
static void weigh_streamed(const Call *c, int g, long f, long seen, vf (*acc)[MAX_BLOCKS], const float *const *p,
                           int count, int b0, int chunk) {
    const char *values = c->values + (long)g * c->kv_head_stride * c->esize;
    float rows[LANES * MAX_DIM];
    for (long j0 = 0; j0 < seen; j0 += LANES) {
        long m = seen - j0 < LANES ? seen - j0 : LANES;
        for (long j = 0; j < m; j++) value_row(c, rows + j * c->dp, values + (f + j0 + j) * c->d * c->esize);
        const float *pj[PV_ROWS];
        for (int r = 0; r < PV_ROWS; r++) pj[r] = p[r] + j0;
        weigh_values_any(acc, pj, count, rows, c->dp, m, b0, chunk);
    }
}

/* phase 3: weights of a query's rows h0 .. h0+PV_ROWS-1 of head g (their logical order: the
 * contiguous scores, then the extras'), and their weighted values over one chunk of d */
static void weigh(const Call *c, int g, int query, int h0, int dchunk, float *p_scratch) {
    const int d = c->d, extras = extras_of(c, query);
    const long c_q = c->contiguous[query];
    int count = c->group - h0 < PV_ROWS ? c->group - h0 : PV_ROWS;
    const float *p[PV_ROWS];
    float sums[PV_ROWS];
    vf acc[PV_ROWS][MAX_BLOCKS];
    const long f = c->first != NULL ? c->first[query] : 0, seen = c_q - f; /* contiguous keys seen */
    for (int r = 0; r < PV_ROWS; r++) {
        int rr = query * c->group + h0 + (r < count ? r : 0);
        float *w = p_scratch + (long)r * c->row_len;
        if (r < count) {
            const float *s = scores_of(c, g, rr);
            memcpy(w, s + f, (size_t)seen * sizeof(float));
            memcpy(w + seen, s + c->contig_end, (size_t)extras * sizeof(float));
            if (c->softcap > 0.0f)
                for (long j = 0; j < seen + extras; j++) w[j] = tanhf(w[j] / c->softcap) * c->softcap;
            sums[r] = softmax_weights(w, seen + extras);
        }
        p[r] = p_scratch + (long)(r < count ? r : 0) * c->row_len;
    }
    int chunk = c->nb / c->dchunks, b0 = dchunk * chunk;
    for (int r = 0; r < PV_ROWS; r++)
        for (int b = 0; b < chunk; b++) acc[r][b] = splat(0.0f);
    if (c->streamed)
        weigh_streamed(c, g, f, seen, acc, p, count, b0, chunk);
    else
        weigh_values_any(acc, p, count, c->vrows + ((long)g * c->cmax + f) * c->dp, c->dp, seen, b0, chunk);
    if (extras > 0) {
        const float *px[PV_ROWS];
        for (int r = 0; r < PV_ROWS; r++) px[r] = p[r] + seen;
        weigh_values_any(acc, px, count, c->xv + ((long)g * c->n + query) * c->max_extra * c->dp, c->dp, extras, b0,
                         chunk);
    }
    for (int r = 0; r < count; r++) {
        float row[MAX_DIM];
        for (int b = 0; b < chunk; b++) store_lanes(row + b * LANES, acc[r][b] / splat(sums[r]));
        int head = g * c->group + h0 + r;
        char *dst = c->out + ((long)head * c->out_head_stride + (long)query * c->out_row_stride + b0 * LANES) * c->esize;
        long width = (b0 + chunk) * LANES <= d ? chunk * LANES : d - b0 * LANES; /* not the padding */
        from_float(dst, row, width, c->dtype);
    }
}

#define KEY_CHUNK 4 /* key blocks (of 16) per work item of phase 2a */
#define STREAMED_ROWS (2 * QK_ROWS) /* calls of at most this many query rows read the cache as they go (Call.streamed) */

static void run(Call *c, int threads) {
    const long prepare_items = c->streamed ? 0 : (long)c->kv_heads * c->blocks;
    const long row_blocks = (c->rows + QK_ROWS - 1) / QK_ROWS;
    const long score_items = (long)c->kv_heads * row_blocks * c->key_chunks;
    const long extra_items = c->max_extra > 0 ? (long)c->kv_heads * c->n : 0;
    const long weigh_items = (long)c->kv_heads * c->n * c->hblocks * c->dchunks;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
#ifdef _OPENMP
        int thread = omp_get_thread_num();
#else
        int thread = 0;
#endif
        float *p_scratch = c->p + (long)thread * PV_ROWS * c->row_len;
#pragma omp for schedule(static)
        for (long i = 0; i < prepare_items; i++) prepare_block(c, (int)(i / c->blocks), i % c->blocks);
#pragma omp for schedule(dynamic, 1)
        for (long i = 0; i < score_items + extra_items; i++) {
            if (i < score_items) {
                long g = i / (row_blocks * c->key_chunks), rest = i % (row_blocks * c->key_chunks);
                long rb = rest / c->key_chunks, chunk = rest % c->key_chunks;
                contiguous_scores(c, (int)g, (int)(rb * QK_ROWS), chunk * KEY_CHUNK, (chunk + 1) * KEY_CHUNK);
            } else {
                long j = i - score_items;
                extra_scores(c, (int)(j / c->n), (int)(j % c->n));
            }
        }
#pragma omp for schedule(dynamic, 1)
        for (long i = 0; i < weigh_items; i++) {
            long per_g = (long)c->n * c->hblocks * c->dchunks, g = i / per_g, rest = i % per_g;
            int query = (int)(rest / (c->hblocks * c->dchunks));
            int hb = (int)(rest / c->dchunks % c->hblocks), dchunk = (int)(rest % c->dchunks);
            weigh(c, (int)g, query, hb * PV_ROWS, dchunk, p_scratch);
        }
    }
}

/* multiply-adds of a call below which it runs on one thread: a parallel region's start and
 * barriers cost more than they save on small calls (the result is the same either way) */
#define PARALLEL_MIN_WORK (1L << 17)

/* whether a call of n queries, the farthest seeing `keys` keys (extras included), runs on one thread */
static inline int one_thread_call(int heads, long n, long keys, int d) { return (long)heads * n * keys * d < PARALLEL_MIN_WORK; }

/* What a layer's call needs besides its four tensors: fixed for one forward of one sequence.
 *   q:      [heads, n, d] with strides q_head_stride, q_row_stride (elements; d contiguous)
 *   keys, values: [kv_heads, capacity, d], kv_head_stride = capacity * d
 *   contiguous: [n] int32; extra: [n, max_extra] int32, -1 after a query's last extra position
 *   out:    [heads, n, d] with strides out_head_stride, out_row_stride
 *   threads: how many threads may share the work (the result is the same for any number)
 *   first:  NULL, or [n] int32: query i sees cache positions first[i] .. contiguous[i] - 1 (a
 *           sliding window), then its extras
 *   softcap: 0, or the cap of tanh soft-capping on the scaled scores (Gemma 2) */
typedef struct {
    int32_t dtype, heads, kv_heads, n, d, max_extra, threads;
    float scale;
    int64_t q_head_stride, q_row_stride, kv_head_stride, out_head_stride, out_row_stride;
    const int32_t *contiguous, *extra, *first;
    float softcap;
} Args;

/* One layer of one sequence: every query head of every query. Returns 0, or a negative number
 * for arguments it does not take. */
int sd_tree_attention(const Args *a, const void *q, const void *keys, const void *values, void *out) {
    const int dtype = a->dtype, heads = a->heads, kv_heads = a->kv_heads, n = a->n, d = a->d;
    const int max_extra = a->max_extra;
    const int32_t *contiguous = a->contiguous, *extra = a->extra;
    if (d <= 0 || d > MAX_DIM || kv_heads <= 0 || heads % kv_heads != 0 || n <= 0 || dtype < 0 ||
        dtype > 2 || max_extra < 0)
        return -1;
    for (int i = 0; i < n; i++) {
        int from = a->first != NULL ? a->first[i] : 0;
        if (contiguous[i] < 0 || from < 0 || from > contiguous[i] || a->softcap < 0.0f ||
            (contiguous[i] == from && (max_extra == 0 || extra[(long)i * max_extra] < 0)))
            return -2; /* a query that sees no key */
    }
    Call c = {0};
    c.dtype = dtype, c.heads = heads, c.kv_heads = kv_heads, c.n = n, c.d = d, c.max_extra = max_extra;
    c.group = heads / kv_heads, c.rows = c.group * n;
    c.dp = (d + LANES - 1) / LANES * LANES, c.nb = c.dp / LANES;
    c.q = (const char *)q, c.q_head_stride = a->q_head_stride, c.q_row_stride = a->q_row_stride;
    c.keys = (const char *)keys, c.values = (const char *)values, c.kv_head_stride = a->kv_head_stride;
    c.contiguous = contiguous, c.extra = extra, c.scale = a->scale, c.out = (char *)out;
    c.first = a->first, c.softcap = a->softcap;
    c.out_head_stride = a->out_head_stride, c.out_row_stride = a->out_row_stride, c.esize = elem_size(dtype);
    for (int i = 0; i < n; i++) c.cmax = contiguous[i] > c.cmax ? contiguous[i] : c.cmax;
    int threads = a->threads < 1 ? 1 : a->threads;
    if (one_thread_call(heads, n, c.cmax + max_extra, d)) threads = 1;
    c.blocks = (c.cmax + LANES - 1) / LANES;
    c.extra_blocks = (max_extra + LANES - 1) / LANES;
    c.contig_end = c.blocks * LANES;
    c.row_len = c.contig_end + (c.extra_blocks + 1) * LANES;
    c.key_chunks = (c.blocks + KEY_CHUNK - 1) / KEY_CHUNK;
    c.hblocks = (c.group + PV_ROWS - 1) / PV_ROWS;
    /* phase 3 splits d in two where it has too few items to keep the threads busy */
    c.dchunks = threads > 1 && (long)kv_heads * n * c.hblocks < 4L * threads && c.nb % 2 == 0 ? 2 : 1;
    c.streamed = c.rows <= STREAMED_ROWS;
    size_t kt = c.streamed ? 0 : (size_t)kv_heads * c.blocks * c.dp * LANES;
    size_t vr = c.streamed ? 0 : (size_t)kv_heads * c.cmax * c.dp;
    size_t sc = (size_t)kv_heads * c.rows * c.row_len, xv = (size_t)kv_heads * n * max_extra * c.dp;
    size_t pw = (size_t)threads * PV_ROWS * c.row_len;
    float *scratch = (float *)aligned_alloc(64, ((kt + vr + sc + xv + pw) * sizeof(float) + 63) / 64 * 64);
    if (scratch == NULL) return -3;
    c.kt = scratch, c.vrows = c.kt + kt, c.scores = c.vrows + vr, c.xv = c.scores + sc, c.p = c.xv + xv;
    run(&c, threads);
    free(scratch);
    return 0;
}
