/* The w8a8 decoder layers (int8_layer.py): every layer of a forward in one call, for all rows of
 * all its sequences, for the Llama runner (fast_llama.py) and for the architectures of the generic
 * runner whose layers follow one of the recipes below (fast_transformers.py). Per layer:
 *
 *   h    = norm(x, attn_norm)               qkv = product(h)            (w8a8, sd_w8a8_quantized_product)
 *   q, k = norm(q, q_norm), norm(k, k_norm)  (per head, where the layer has q/k norms: Qwen3, Gemma 3)
 *   q, k = rope(q, k)                       cache[length + i] = k, v     (per sequence; the layer's table)
 *   a    = attention(q, cache)              (sd_tree_attention: this file includes tree_attention.c;
 *                                            the layer's sliding window, the model's soft-capping)
 *   y    = product_o(a);  y = norm(y, attn_out_norm) where the layer has one (Gemma);  x = x + y
 *   h    = norm(x, mlp_norm)                gate, up = product_gate_up(h)
 *   y    = product_down(act(gate) * up);  y = norm(y, mlp_out_norm) where it has one;  x = x + y
 *
 * The products are the w8a8 kernel's own function (its pointer is given: one copy of that code,
 * in w8a8.c), the attention is the tree attention kernel's (included below). What this file adds
 * is the float work between them, each element (or each row's sum) on its own, in float32,
 * rounded to the model's dtype (to nearest even) where the torch path rounds:
 *
 *   norm:     ss = sum of x_i^2 in 16 lanes (lane l adds i = l mod 16 in increasing i; zeros pad
 *             the last block), folded 8, 4, 2, 1;  r = 1 / sqrtf(ss / size + eps)
 *             NORM_ROUNDED (Llama, Qwen):  y_i = dt(x_i * r);  out_i = dt(w_i * y_i)
 *             NORM_PLUS_ONE (Gemma):       out_i = dt((x_i * r) * (1 + w_i))
 *   rope:     out_t = dt(dt(x_t * cos_t) + dt(rot_t * sin_t)), rot = (-x[d/2:], x[:d/2])
 *   silu*mul: e = exp(-|g|) (tree_attention.c's exp_lanes), s = g >= 0 ? 1 / (1 + e) : e / (1 + e)
 *             out = dt(dt(g * s) * up)
 *   gelu*mul: u = c (g + 0.044715 g^3), c = sqrt(2 / pi);  e = exp(-2 |u|),
 *             t = sign(u) (1 - e) / (1 + e) (tanh u);  out = dt(dt(0.5 g (1 + t)) * up)
 *   residual: x = dt(x + y)
 * (dt: the rounding to the model's dtype; nothing in float32). Compiled with -ffp-contract=off
 * and without -ffast-math (native.py). None of it reads another row, so a row's result is a
 * function of that row and of the keys its attention sees: the same alone, in a chain, in a
 * tree or among other sequences' rows, on any number of threads. The norm's sum and the
 * activations' exp are not torch's (its reduction order and its exp are its own), so the bits
 * are this file's, not the torch path's: a runner runs every forward of such a model here
 * (prefills too) and the response cache's fingerprint names this source.
 */

#define sd_abi_version sd_tree_attention_abi_version
#include "tree_attention.c"
#undef sd_abi_version

int sd_abi_version(void) { return 2; }

enum { NORM_ROUNDED = 0, NORM_PLUS_ONE = 1 };
enum { ACT_SILU = 0, ACT_GELU_TANH = 1 };

#define ATTENTION_CHUNK 64 /* queries per attention call: a long prefill's scores stay small */
#define PARALLEL_ROWS 4    /* row loops of fewer rows run on one thread */

typedef int (*QuantizedProduct)(int dtype, int64_t n, int64_t k, int64_t m, const void *x, int64_t x_row_stride,
                                const int8_t *packed, const int32_t *compensation, const float *weight_scales,
                                const void *bias, void *out, int threads);

typedef struct {
    const int8_t *packed;        /* int8_kernel.Int8Kernel.pack's layout */
    const int32_t *compensation; /* [out] */
    const float *scales;         /* [out] */
    const void *bias;            /* [out] of the model's dtype, or NULL */
    int64_t out, in;
} LayerProduct;

typedef struct {
    const void *attn_norm, *mlp_norm;         /* [hidden] of the model's dtype */
    const void *attn_out_norm, *mlp_out_norm; /* [hidden], or NULL: each branch's output normalized */
    const void *q_norm, *k_norm;              /* [d], or NULL: each q and k head normalized before rope */
    int32_t window;                           /* 0, or a sliding window: position p sees p - window + 1 .. p */
    int32_t rope;                             /* the index of this layer's cos and sin tables */
    LayerProduct qkv, o, gate_up, down;
} LayerWeights;

typedef struct {
    int32_t dtype, layers, heads, kv_heads, d, hidden, intermediate, threads, sequences;
    int32_t norm, activation; /* NORM_*, ACT_* */
    float eps, scale, softcap; /* softcap: 0, or attention scores soft-capped at it */
    int64_t rows;
    QuantizedProduct product;
    const LayerWeights *weights;          /* [layers] */
    const void *const *cos, *const *sin; /* [tables] -> [rows, d] of the model's dtype: each row's rotation */
    const int64_t *starts, *counts, *lengths, *capacities; /* [sequences]: rows start .. start + count */
    const int32_t *const *contiguous;                       /* [sequences] -> [count] (the attention plan) */
    const int32_t *const *extra;                            /* [sequences] -> [count, max_extra[s]] */
    const int32_t *max_extra;                               /* [sequences] */
    const int32_t *const *positions;                        /* [sequences] -> [count]: logical positions */
    void *const *keys, *const *values; /* [sequences * layers]: [kv_heads, capacity, d] of sequence s, layer l */
    void *kept;                        /* [slots, rows, hidden], or NULL */
    const int32_t *keep_slot;          /* [layers + 1]: where layer l's input goes in kept (-1: nowhere) */
} Forward;

/* ---- 16 elements of a row at a time: widened exactly to float32, rounded back to nearest even ---- */

typedef uint32_t vu __attribute__((vector_size(LANES * sizeof(uint32_t))));

static inline vf dt_round(vf y, int dtype) { /* to the model's dtype and back (float32: unchanged) */
    if (dtype != DTYPE_BF16) return y;
    vu bits = (vu)y;
    vu rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u; /* the high 16 bits, to nearest even */
    vu nan = (vu)((bits & 0x7fffffffu) > 0x7f800000u);
    return (vf)((rounded & ~nan) | ((bits | 0x400000u) & 0xffff0000u & nan)); /* NaN: quiet, as float_to_bf16 */
}

/* Built for the w8a8 kernel's instruction set (int8_layer.py): AVX-512's masked loads and stores
 * where the build has them (not the portable one, which runs the plain C below on every CPU), else
 * one element at a time. Loads are exact and both stores round to nearest even (NaN: quiet, as
 * float_to_bf16), so every build writes the same bits. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && !defined(SD_PORTABLE)
static inline __mmask16 first(int count) { return count >= LANES ? (__mmask16)0xffff : (__mmask16)((1u << count) - 1u); }

static inline vf load_row(const void *p, int dtype, int64_t i, int count) { /* zeros past count */
    if (dtype == DTYPE_F32) return (vf)_mm512_maskz_loadu_ps(first(count), (const float *)p + i);
    __m256i h = _mm256_maskz_loadu_epi16(first(count), (const uint16_t *)p + i);
    return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
}

static inline void store_row(void *p, int dtype, int64_t i, vf v, int count) { /* rounded to the dtype */
    if (dtype == DTYPE_F32) {
        _mm512_mask_storeu_ps((float *)p + i, first(count), (__m512)v);
    } else {
        __m512i bits = _mm512_srli_epi32((__m512i)dt_round(v, dtype), 16);
        _mm256_mask_storeu_epi16((uint16_t *)p + i, first(count), _mm512_cvtepi32_epi16(bits));
    }
}
#else
static inline vf load_row(const void *p, int dtype, int64_t i, int count) {
    vf v = splat(0.0f);
    for (int l = 0; l < count; l++)
        v[l] = dtype == DTYPE_BF16 ? bf16_to_float(((const uint16_t *)p)[i + l]) : ((const float *)p)[i + l];
    return v;
}

static inline void store_row(void *p, int dtype, int64_t i, vf v, int count) {
    for (int l = 0; l < count; l++) {
        if (dtype == DTYPE_BF16)
            ((uint16_t *)p)[i + l] = float_to_bf16(v[l]);
        else
            ((float *)p)[i + l] = v[l];
    }
}
#endif

static inline int block(int64_t size, int64_t i) { return size - i < LANES ? (int)(size - i) : LANES; }

static void norm_row(const Forward *f, int size, const void *x, const void *weight, void *out) {
    const int dtype = f->dtype;
    vf lanes = splat(0.0f);
    for (int i = 0; i < size; i += LANES) {
        vf v = load_row(x, dtype, i, block(size, i)); /* zeros past the end add nothing */
        lanes = lanes + v * v;
    }
    float fold[LANES];
    memcpy(fold, &lanes, sizeof fold);
    for (int width = LANES / 2; width >= 1; width /= 2)
        for (int l = 0; l < width; l++) fold[l] = fold[l] + fold[l + width];
    vf r = splat(1.0f / sqrtf(fold[0] / (float)size + f->eps));
    for (int i = 0; i < size; i += LANES) {
        int count = block(size, i);
        vf w = load_row(weight, dtype, i, count), normed = load_row(x, dtype, i, count) * r;
        if (f->norm == NORM_PLUS_ONE)
            store_row(out, dtype, i, normed * (splat(1.0f) + w), count);
        else
            store_row(out, dtype, i, w * dt_round(normed, dtype), count);
    }
}

static void norm_rows(const Forward *f, const void *x, const void *weight, void *out) { /* in place is fine */
    const size_t row = (size_t)f->hidden * elem_size(f->dtype);
#pragma omp parallel for num_threads(f->threads) if (f->threads > 1 && f->rows >= PARALLEL_ROWS) schedule(static)
    for (int64_t r = 0; r < f->rows; r++) norm_row(f, f->hidden, (const char *)x + r * row, weight, (char *)out + r * row);
}

/* the q and k heads of every row of qkv [rows, heads + 2 kv_heads, d], each normalized in place */
static void head_norm_rows(const Forward *f, const LayerWeights *w, void *qkv) {
    const int d = f->d, heads = f->heads, kv_heads = f->kv_heads;
    const size_t item = elem_size(f->dtype), width = (size_t)(heads + 2 * kv_heads) * d;
#pragma omp parallel for num_threads(f->threads) if (f->threads > 1 && f->rows >= PARALLEL_ROWS) schedule(static)
    for (int64_t r = 0; r < f->rows; r++) {
        for (int h = 0; h < heads + kv_heads; h++) {
            char *head = (char *)qkv + ((size_t)r * width + (size_t)h * d) * item;
            norm_row(f, d, head, h < heads ? w->q_norm : w->k_norm, head);
        }
    }
}

/* q and k heads of every row of qkv [rows, heads + 2 kv_heads, d], rotated in place */
static void rope_rows(const Forward *f, int table, void *qkv) {
    const int dtype = f->dtype, d = f->d, half = d / 2, rotated = f->heads + f->kv_heads;
    const int64_t width = (int64_t)(f->heads + 2 * f->kv_heads) * d;
#pragma omp parallel for num_threads(f->threads) if (f->threads > 1 && f->rows >= PARALLEL_ROWS) schedule(static)
    for (int64_t r = 0; r < f->rows; r++) {
        float x[MAX_DIM + LANES], rot[MAX_DIM + LANES];
        const void *cos = (const char *)f->cos[table] + (size_t)(r * d) * elem_size(dtype);
        const void *sin = (const char *)f->sin[table] + (size_t)(r * d) * elem_size(dtype);
        for (int h = 0; h < rotated; h++) {
            void *head = (char *)qkv + (size_t)(r * width + (int64_t)h * d) * elem_size(dtype);
            for (int t = 0; t < d; t += LANES) store_lanes(x + t, load_row(head, dtype, t, block(d, t)));
            for (int t = 0; t < d; t++) rot[t] = t < half ? -x[t + half] : x[t - half];
            for (int t = 0; t < d; t += LANES) {
                int count = block(d, t);
                vf a = dt_round(load_lanes(x + t) * load_row(cos, dtype, t, count), dtype);
                vf b = dt_round(load_lanes(rot + t) * load_row(sin, dtype, t, count), dtype);
                store_row(head, dtype, t, a + b, count);
            }
        }
    }
}

/* each sequence's new keys and values at cache positions length .. length + count - 1 */
static void write_cache(const Forward *f, int layer, const void *qkv) {
    const int d = f->d, heads = f->heads, kv_heads = f->kv_heads;
    const size_t item = elem_size(f->dtype), width = (size_t)(heads + 2 * kv_heads) * d;
    for (int s = 0; s < f->sequences; s++) {
        char *keys = f->keys[(int64_t)s * f->layers + layer], *values = f->values[(int64_t)s * f->layers + layer];
        for (int64_t i = 0; i < f->counts[s]; i++) {
            const char *row = (const char *)qkv + (size_t)(f->starts[s] + i) * width * item;
            for (int g = 0; g < kv_heads; g++) {
                size_t at = ((size_t)g * f->capacities[s] + (size_t)(f->lengths[s] + i)) * d * item;
                memcpy(keys + at, row + (size_t)(heads + g) * d * item, (size_t)d * item);
                memcpy(values + at, row + (size_t)(heads + kv_heads + g) * d * item, (size_t)d * item);
            }
        }
    }
}

/* each query's first visible cache position under a sliding window (the earlier ones slid out) */
static void window_starts(const Forward *f, int s, int64_t c0, int64_t n, int window, int32_t *first) {
    for (int64_t i = 0; i < n; i++) {
        int32_t start = f->positions[s][c0 + i] - window + 1, contiguous = f->contiguous[s][c0 + i];
        first[i] = start < 0 ? 0 : start > contiguous ? contiguous : start;
    }
}

/* one attention call: queries c0 .. c0 + n - 1 of sequence s, on threads threads */
static int attend_chunk(const Forward *f, int layer, int s, int64_t c0, int threads, const void *qkv, void *out) {
    const int d = f->d, heads = f->heads, kv_heads = f->kv_heads, window = f->weights[layer].window;
    const size_t item = elem_size(f->dtype);
    const int64_t width = (int64_t)(heads + 2 * kv_heads) * d;
    const int64_t n = f->counts[s] - c0 < ATTENTION_CHUNK ? f->counts[s] - c0 : ATTENTION_CHUNK;
    const int64_t row = f->starts[s] + c0;
    int32_t first[ATTENTION_CHUNK];
    if (window > 0) window_starts(f, s, c0, n, window, first);
    Args a = {f->dtype, heads, kv_heads, (int32_t)n, d, f->max_extra[s], threads, f->scale,
              d, width, f->capacities[s] * d, d, (int64_t)heads * d,
              f->contiguous[s] + c0, f->extra[s] + c0 * f->max_extra[s], window > 0 ? first : NULL,
              f->softcap};
    int status = sd_tree_attention(&a, (const char *)qkv + (size_t)(row * width) * item,
                                   f->keys[(int64_t)s * f->layers + layer], f->values[(int64_t)s * f->layers + layer],
                                   (char *)out + (size_t)(row * heads * d) * item);
    return status ? 10 - status : 0;
}

/* whether a call runs on one thread whatever it is given (sd_tree_attention's own test) */
static int one_thread_chunk(const Forward *f, int s, int64_t c0) {
    const int64_t n = f->counts[s] - c0 < ATTENTION_CHUNK ? f->counts[s] - c0 : ATTENTION_CHUNK;
    int64_t keys = 0;
    for (int64_t i = 0; i < n; i++) keys = f->contiguous[s][c0 + i] > keys ? f->contiguous[s][c0 + i] : keys;
    return one_thread_call(f->heads, n, keys + f->max_extra[s], f->d);
}

/* Every sequence's attention. A call too small to share among threads (a decoding sequence's
 * one query) runs on one thread, so such calls run side by side, one per thread; the larger
 * ones (prefills, long drafts) after them, one at a time on every thread. A call's result does
 * not depend on its threads, so neither does the order. */
static int attend_rows(const Forward *f, int layer, const void *qkv, void *out) {
    const int window = f->weights[layer].window;
    for (int s = 0; s < f->sequences; s++)
        if (window > 0 && f->max_extra[s] >= window) return 4; /* a tree deeper than the window */
    int failed = 0;
#pragma omp parallel for num_threads(f->threads) if (f->threads > 1 && f->sequences > 1) schedule(dynamic, 1)
    for (int s = 0; s < f->sequences; s++)
        for (int64_t c0 = 0; c0 < f->counts[s]; c0 += ATTENTION_CHUNK) {
            int status = one_thread_chunk(f, s, c0) ? attend_chunk(f, layer, s, c0, 1, qkv, out) : 0;
            if (status) {
#pragma omp atomic write
                failed = status;
            }
        }
    for (int s = 0; s < f->sequences && !failed; s++)
        for (int64_t c0 = 0; c0 < f->counts[s] && !failed; c0 += ATTENTION_CHUNK)
            if (!one_thread_chunk(f, s, c0)) failed = attend_chunk(f, layer, s, c0, f->threads, qkv, out);
    return failed;
}

static void add_rows(const Forward *f, void *x, const void *y) {
    const int64_t count = f->rows * f->hidden;
    for (int64_t i = 0; i < count; i += LANES) {
        int c = block(count, i);
        store_row(x, f->dtype, i, load_row(x, f->dtype, i, c) + load_row(y, f->dtype, i, c), c);
    }
}

static inline vf silu_lanes(vf g) {
    vi positive = g >= splat(0.0f);
    vf e = exp_lanes(select_lanes(positive, -g, g)); /* exp(-|g|) */
    return g * select_lanes(positive, splat(1.0f) / (splat(1.0f) + e), e / (splat(1.0f) + e));
}

static inline vf gelu_tanh_lanes(vf g) {
    vf u = splat(0.7978845608028654f) * (g + splat(0.044715f) * g * g * g);
    vi positive = u >= splat(0.0f);
    vf e = exp_lanes(splat(-2.0f) * select_lanes(positive, u, -u)); /* exp(-2 |u|) */
    vf t = (splat(1.0f) - e) / (splat(1.0f) + e);                      /* tanh |u| */
    return splat(0.5f) * g * (splat(1.0f) + select_lanes(positive, t, -t));
}

/* gate_up [rows, 2 * intermediate] -> out [rows, intermediate] */
static void act_mul_rows(const Forward *f, const void *gate_up, void *out) {
    const int dtype = f->dtype, m = f->intermediate, gelu = f->activation == ACT_GELU_TANH;
#pragma omp parallel for num_threads(f->threads) if (f->threads > 1 && f->rows >= PARALLEL_ROWS) schedule(static)
    for (int64_t r = 0; r < f->rows; r++) {
        const char *gate = (const char *)gate_up + (size_t)(r * 2 * m) * elem_size(dtype);
        const char *up = gate + (size_t)m * elem_size(dtype);
        char *o = (char *)out + (size_t)(r * m) * elem_size(dtype);
        for (int i = 0; i < m; i += LANES) {
            int count = block(m, i);
            vf g = load_row(gate, dtype, i, count);
            vf act = dt_round(gelu ? gelu_tanh_lanes(g) : silu_lanes(g), dtype);
            store_row(o, dtype, i, act * load_row(up, dtype, i, count), count);
        }
    }
}

static int product(const Forward *f, const LayerProduct *p, const void *x, void *out) {
    return f->product(f->dtype, f->rows, p->in, p->out, x, p->in, p->packed, p->compensation, p->scales, p->bias, out,
                      f->threads);
}

static void keep(const Forward *f, int slot_of, const void *x) {
    int slot = f->keep_slot ? f->keep_slot[slot_of] : -1;
    if (slot < 0 || !f->kept) return;
    size_t bytes = (size_t)(f->rows * f->hidden) * elem_size(f->dtype);
    memcpy((char *)f->kept + (size_t)slot * bytes, x, bytes);
}

/* x [rows, hidden] of the model's dtype: the embeddings in, the last layer's output out.
 * 0, or a positive number for arguments it does not take or memory it could not have */
int sd_int8_decoder(const Forward *f, void *x) {
    if ((f->dtype != DTYPE_F32 && f->dtype != DTYPE_BF16) || f->rows <= 0 || f->d > MAX_DIM || f->d % 2 ||
        f->heads % f->kv_heads || (f->norm != NORM_ROUNDED && f->norm != NORM_PLUS_ONE) ||
        (f->activation != ACT_SILU && f->activation != ACT_GELU_TANH))
        return 1;
    int64_t total = 0;
    for (int s = 0; s < f->sequences; s++) total += f->counts[s];
    if (total != f->rows) return 2;
    const size_t item = elem_size(f->dtype), rows = (size_t)f->rows;
    const size_t width = (size_t)(f->heads + 2 * f->kv_heads) * f->d, attention = (size_t)f->heads * f->d;
    char *h = malloc(rows * f->hidden * item), *qkv = malloc(rows * width * item);
    char *a = malloc(rows * attention * item), *y = malloc(rows * f->hidden * item);
    char *gu = malloc(rows * 2 * f->intermediate * item), *act = malloc(rows * f->intermediate * item);
    int status = h && qkv && a && y && gu && act ? 0 : 3;
    for (int l = 0; l < f->layers && !status; l++) {
        const LayerWeights *w = f->weights + l;
        keep(f, l, x);
        norm_rows(f, x, w->attn_norm, h);
        if ((status = product(f, &w->qkv, h, qkv))) break;
        if (w->q_norm) head_norm_rows(f, w, qkv);
        rope_rows(f, w->rope, qkv);
        write_cache(f, l, qkv);
        if ((status = attend_rows(f, l, qkv, a))) break;
        if ((status = product(f, &w->o, a, y))) break;
        if (w->attn_out_norm) norm_rows(f, y, w->attn_out_norm, y);
        add_rows(f, x, y);
        norm_rows(f, x, w->mlp_norm, h);
        if ((status = product(f, &w->gate_up, h, gu))) break;
        act_mul_rows(f, gu, act);
        if ((status = product(f, &w->down, act, y))) break;
        if (w->mlp_out_norm) norm_rows(f, y, w->mlp_out_norm, y);
        add_rows(f, x, y);
    }
    if (!status) keep(f, f->layers, x);
    free(h), free(qkv), free(a), free(y), free(gu), free(act);
    return status;
}
