/* Decoding steps and prompt passes of a Llama-family decoder, one native call each, on every core.
 *
 * A query decoded alone multiplies one row by every weight each step, so the step is bound by
 * how fast the weights are read; PyTorch runs those matrix-vector products on one thread (MKL)
 * or reads its blocked layout slowly (oneDNN), and dispatches ~400 small operations a step around
 * them (decisions/D021, D025). Many rows (`encode` over many texts, 64 rows a step) make the same
 * products matrix-matrix ones, which PyTorch runs near the matmul peak, but the ~400 operations
 * around them, each on a 64 x 576 tensor, cost about as much again. Here a whole step (the decoder
 * layers, the final norm and the LM head), or the pass over a batch of prompts' tokens, is one
 * call: the products' work is handed out to the threads unit by unit, the threads meet at a
 * spinning barrier after each product whose output the next one reads, and the norms, rotary
 * embedding, cache writes, attention and SiLU run in C in between.
 *
 * A call feeds `tokens` tokens, each to a cache row at a column (grace_native_step): a decoding
 * step feeds one a row at the cache's next column, a prompt pass a row's prompt tokens at
 * consecutive columns (they attend to each other's, causally). Every output of a float32 product
 * is one chain of fused multiply-adds over the inputs in order (panel_block), so a token's result
 * depends neither on the thread count nor on the other tokens of the call.
 *
 * Layout of everything passed in, float32 unless said, contiguous:
 *   float32 weights as panels (see PANEL), int8 weights as nn.Linear stores them (out_features x
 *   in_features) with a float32 scale a row;
 *   key and value caches as grace_st.decoding.PreallocatedLayer holds them:
 *   rows x kv_heads x capacity x head_dim, after rotary embedding, as transformers stores them;
 *   embedding, cos and sin: a row each a token (hidden, head_dim, head_dim): the tokens'
 *   embeddings and the rotary tables of their positions, computed by the model's own rotary
 *   module, so any rope scaling it applies is applied here too;
 *   cache_rows, columns: int32, a token's cache row and column; mask: rows x mask_width bytes,
 *   0: a column the row does not attend to.
 * Built and loaded by grace_st/native_step.py; the formulas are transformers' LlamaDecoderLayer.
 */
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16
#define MAX_THREADS 64
#define SPINS_BEFORE_YIELD 20000

/* A product's weight: float32 rows (scale NULL), or int8 rows with a float32 scale a row. */
typedef struct {
    const void *weight;
    const float *scale;
} Matrix;

typedef struct {
    const float *input_norm, *post_norm;
    Matrix q, k, v, o, gate, up, down;
    float *key_cache, *value_cache;
} Layer;

/* The contract with grace_st/native_step.py, which mirrors Matrix and Layer and grace_native_step's
 * parameters by hand in ctypes: a mirror that drifted would pass pointers into the wrong fields, and
 * nothing would fail loudly. The Python side reads these at load and refuses a library that disagrees.
 * Sizes and offsets come from sizeof and offsetof, so they are the compiler's own layout; each table
 * lists its struct's fields in declaration order, the order of the ctypes Structure's _fields_. */
static const size_t matrix_offsets[] = {offsetof(Matrix, weight), offsetof(Matrix, scale)};
static const size_t layer_offsets[] = {
    offsetof(Layer, input_norm), offsetof(Layer, post_norm), offsetof(Layer, q),         offsetof(Layer, k),
    offsetof(Layer, v),          offsetof(Layer, o),         offsetof(Layer, gate),      offsetof(Layer, up),
    offsetof(Layer, down),       offsetof(Layer, key_cache), offsetof(Layer, value_cache),
};
#define COUNT_OF(table) ((int)(sizeof(table) / sizeof((table)[0])))

size_t grace_matrix_size(void) { return sizeof(Matrix); }
int grace_matrix_field_count(void) { return COUNT_OF(matrix_offsets); }
size_t grace_matrix_offset(int field) {
    return field >= 0 && field < COUNT_OF(matrix_offsets) ? matrix_offsets[field] : (size_t)-1;
}
size_t grace_layer_size(void) { return sizeof(Layer); }
int grace_layer_field_count(void) { return COUNT_OF(layer_offsets); }
size_t grace_layer_offset(int field) {
    return field >= 0 && field < COUNT_OF(layer_offsets) ? layer_offsets[field] : (size_t)-1;
}

/* The number of comma-separated items in the arguments (up to 40; more fail to compile):
 * grace_step_arg_count counts the very parameter list grace_native_step is declared with, so the two
 * cannot disagree. */
#define COUNT_ITEMS(...)                                                                                               \
    COUNT_ITEMS_(__VA_ARGS__, 40, 39, 38, 37, 36, 35, 34, 33, 32, 31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19,  \
                 18, 17, 16, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0)
#define COUNT_ITEMS_(_1, _2, _3, _4, _5, _6, _7, _8, _9, _10, _11, _12, _13, _14, _15, _16, _17, _18, _19, _20, _21,  \
                     _22, _23, _24, _25, _26, _27, _28, _29, _30, _31, _32, _33, _34, _35, _36, _37, _38, _39, _40,   \
                     count, ...)                                                                                       \
    count

typedef struct {
    const Layer *layers;
    int n_layers;
    const float *final_norm;
    Matrix lm_head;
    int int8; /* every product on int8 weights (the LM head's tells): inputs and outputs rounded to bfloat16 as grace_st.quantization does; one row only */
    int tokens, vocab, hidden, intermediate, heads, kv_heads, head_dim;
    float eps, scale;
    int capacity;
    const int *cache_rows, *columns; /* each token's cache row and the column its keys and values go to */
    const unsigned char *mask;       /* a row of mask_width bytes a cache row, 0: a column not attended to */
    int mask_width;
    const float *embedding, *cos, *sin; /* a row each a token */
    int logit_tokens;                   /* how many tokens get logits: those in `logit_index`, or all if NULL */
    const int *logit_index;
    float *states_out, *logits_out;
    int threads;
    /* shared scratch, a row of each a token */
    float *x, *q, *k, *v, *attention, *gate, *mlp;
    atomic_int *counters; /* the units claimed so far, a counter a product (see product) */
    /* barrier */
    atomic_int arrived;
    atomic_int phase;
    atomic_int go; /* 0: wait, 1: run, -1: a thread failed to start, return */
} Step;

/* The fixed-order reduction of LANES partial sums: halves added pairwise until one is left. */
static inline float reduce(float *acc) {
    for (int width = LANES / 2; width > 0; width /= 2)
        for (int l = 0; l < width; l++) acc[l] += acc[l + width];
    return acc[0];
}

/* Dot product (the norms' sums of squares; attention without AVX-512): LANES partial sums, each a
 * chain of fused multiply-adds along the vectors, then reduce(). Explicit fmaf: the sums do not
 * depend on whether the compiler contracts. */
static inline float dot(const float *restrict w, const float *restrict x, int n) {
    float acc[LANES] = {0};
    int j = 0;
    for (; j + LANES <= n; j += LANES)
        for (int l = 0; l < LANES; l++) acc[l] = fmaf(w[j + l], x[j + l], acc[l]);
    for (int l = 0; j + l < n; l++) acc[l] = fmaf(w[j + l], x[j + l], acc[l]);
    return reduce(acc);
}

/* One int8 weight row with x: each weight converted to float, summed in CHAINS independent sets
 * of LANES partial sums (consecutive LANES-wide chunks go to consecutive sets), then a fixed-order
 * reduction. One row at a time, so the matrix streams in order, and several sets, so the sums do
 * not wait on each other's latency: the int8 product is conversion-heavy, and with four rows a
 * block and one set a row it read a third of the bandwidth. Written with AVX-512 or AVX2
 * intrinsics where the CPU has them (the same sums in the same order), plain C elsewhere. */
#define CHAINS 4
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

static inline float dot_int8(const signed char *restrict w, const float *restrict x, int n) {
    float acc[CHAINS][LANES];
    int j = 0;
#if defined(__AVX512F__)
    __m512 sums[CHAINS];
    for (int c = 0; c < CHAINS; c++) sums[c] = _mm512_setzero_ps();
    for (; j + CHAINS * LANES <= n; j += CHAINS * LANES)
        for (int c = 0; c < CHAINS; c++) {
            __m128i bytes = _mm_loadu_si128((const __m128i *)(w + j + c * LANES));
            __m512 weights = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
            sums[c] = _mm512_fmadd_ps(weights, _mm512_loadu_ps(x + j + c * LANES), sums[c]);
        }
    for (int c = 0; c < CHAINS; c++) _mm512_storeu_ps(acc[c], sums[c]);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 low[CHAINS], high[CHAINS];
    for (int c = 0; c < CHAINS; c++) low[c] = high[c] = _mm256_setzero_ps();
    for (; j + CHAINS * LANES <= n; j += CHAINS * LANES)
        for (int c = 0; c < CHAINS; c++) {
            const signed char *chunk = w + j + c * LANES;
            __m256 first = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)chunk)));
            __m256 second = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(chunk + 8))));
            low[c] = _mm256_fmadd_ps(first, _mm256_loadu_ps(x + j + c * LANES), low[c]);
            high[c] = _mm256_fmadd_ps(second, _mm256_loadu_ps(x + j + c * LANES + 8), high[c]);
        }
    for (int c = 0; c < CHAINS; c++) {
        _mm256_storeu_ps(acc[c], low[c]);
        _mm256_storeu_ps(acc[c] + 8, high[c]);
    }
#else
    for (int c = 0; c < CHAINS; c++)
        for (int l = 0; l < LANES; l++) acc[c][l] = 0.0f;
    for (; j + CHAINS * LANES <= n; j += CHAINS * LANES)
        for (int c = 0; c < CHAINS; c++)
            for (int l = 0; l < LANES; l++)
                acc[c][l] = fmaf((float)w[j + c * LANES + l], x[j + c * LANES + l], acc[c][l]);
#endif
    /* what is left: whole chunks into the first set, then single weights */
    for (; j + LANES <= n; j += LANES)
        for (int l = 0; l < LANES; l++) acc[0][l] = fmaf((float)w[j + l], x[j + l], acc[0][l]);
    for (int l = 0; j + l < n; l++) acc[0][l] = fmaf((float)w[j + l], x[j + l], acc[0][l]);
    for (int c = 1; c < CHAINS; c++)
        for (int l = 0; l < LANES; l++) acc[0][l] += acc[c][l];
    return reduce(acc[0]);
}

/* float32 -> bfloat16 -> float32, round to nearest even (PyTorch's conversion). */
static inline float bfloat16(float value) {
    unsigned int bits;
    memcpy(&bits, &value, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return value; /* NaN stays NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    bits &= 0xffff0000u;
    memcpy(&value, &bits, sizeof bits);
    return value;
}

static void round_bfloat16(float *values, int n) {
    for (int i = 0; i < n; i++) values[i] = bfloat16(values[i]);
}

static inline void put(float *out, float value, int add) { *out = add ? *out + value : value; }

/* out[o] (+)= W[o] . x for the int8 weight rows [begin, end) of an `n`-wide matrix, one weight row
 * at a time, so the matrix streams in order; each row's sum is scaled and rounded to bfloat16
 * (grace_st.quantization.Int8WeightOnlyLinear's output). */
static void int8_product(Matrix m, const float *x, float *out, int begin, int end, int n, int add) {
    for (int r = begin; r < end; r++)
        put(out + r, bfloat16(dot_int8((const signed char *)m.weight + (size_t)r * n, x, n) * m.scale[r]), add);
}

/* A float32 weight (outputs x n, as nn.Linear stores it) is passed as panels of PANEL outputs,
 * each laid out input-major (panel[k * PANEL + c] = W[p * PANEL + c][k], the last panel padded
 * with zero rows; grace_st/native_step.py packs them): one vector load then serves PANEL / 16
 * outputs of every row of a block. Every output is one chain of fused multiply-adds over k in
 * order, whichever block, thread or number of rows computes it. */
#define PANEL 48
#define BLOCK_ROWS 8

int grace_native_step_panel(void) { return PANEL; }

/* out[i * ldo + c] (+)= sum_k x[i * n + k] * panel[k * PANEL + c] for i < R rows and the first
 * `valid` outputs c of the panel. Prefetches `prefetch_lines` cache lines from `prefetch` along the
 * way (the next panel: streamed from memory while this one is computed, it arrives in time;
 * without it a step waited on memory a fifth of its time). */
static inline __attribute__((always_inline)) void panel_block(const int R, const float *x, int n, const float *panel,
                                                               float *out, int ldo, int valid, int add,
                                                               const char *prefetch, int prefetch_lines) {
#if defined(__AVX512F__)
    __m512 acc[BLOCK_ROWS][3];
    for (int i = 0; i < R; i++) acc[i][0] = acc[i][1] = acc[i][2] = _mm512_setzero_ps();
    int every = prefetch_lines ? (n + prefetch_lines - 1) / prefetch_lines : n + 1, due = 0;
    for (int k = 0; k < n; k++) {
        if (prefetch && k == due && prefetch_lines > 0) {
            _mm_prefetch(prefetch, _MM_HINT_T0);
            prefetch += 64;
            prefetch_lines--;
            due += every;
        }
        const float *weights = panel + (size_t)k * PANEL;
        __m512 w0 = _mm512_loadu_ps(weights), w1 = _mm512_loadu_ps(weights + 16), w2 = _mm512_loadu_ps(weights + 32);
        for (int i = 0; i < R; i++) {
            __m512 input = _mm512_set1_ps(x[(size_t)i * n + k]);
            acc[i][0] = _mm512_fmadd_ps(w0, input, acc[i][0]);
            acc[i][1] = _mm512_fmadd_ps(w1, input, acc[i][1]);
            acc[i][2] = _mm512_fmadd_ps(w2, input, acc[i][2]);
        }
    }
    for (int i = 0; i < R; i++) {
        float sums[PANEL];
        _mm512_storeu_ps(sums, acc[i][0]);
        _mm512_storeu_ps(sums + 16, acc[i][1]);
        _mm512_storeu_ps(sums + 32, acc[i][2]);
        for (int c = 0; c < valid; c++) put(out + (size_t)i * ldo + c, sums[c], add);
    }
#else
    (void)prefetch, (void)prefetch_lines;
    for (int i = 0; i < R; i++) {
        float sums[PANEL] = {0};
        for (int k = 0; k < n; k++) {
            float input = x[(size_t)i * n + k];
            for (int c = 0; c < PANEL; c++) sums[c] = fmaf(panel[(size_t)k * PANEL + c], input, sums[c]);
        }
        for (int c = 0; c < valid; c++) put(out + (size_t)i * ldo + c, sums[c], add);
    }
#endif
}

/* The work of a product is handed out in units: PANEL outputs for a tile of rows (tiles whose
 * inputs fit half of a 2 MB L2 cache: a prompt pass feeds a thousand rows, whose inputs would
 * otherwise come from memory again for every panel). A thread takes the next unit when it is done
 * with one (an atomic counter a product), so a core the machine slows down (another tenant on the
 * host) does less of the work instead of holding the other at the next barrier. Which thread
 * computes an output does not change its value. */
#define TILE_BYTES (1 << 20)

typedef struct {
    int panels, tile, units;
} Units;

static inline Units units_of(int rows, int outputs, int n) {
    Units u;
    u.panels = (outputs + PANEL - 1) / PANEL;
    u.tile = (int)(TILE_BYTES / ((size_t)n * sizeof(float))) / BLOCK_ROWS * BLOCK_ROWS;
    if (u.tile < BLOCK_ROWS) u.tile = BLOCK_ROWS;
    u.units = u.panels * ((rows + u.tile - 1) / u.tile);
    return u;
}

static inline int claim(atomic_int *counter) { return atomic_fetch_add_explicit(counter, 1, memory_order_relaxed); }

/* The panel a unit multiplies by (float32), as a prefetch address; NULL past the last unit. */
static inline const char *unit_panel(Matrix m, Units u, int unit, int n) {
    if (unit >= u.units || m.scale) return NULL;
    return (const char *)((const float *)m.weight + (size_t)(unit % u.panels) * n * PANEL);
}

/* One unit of out (rows x outputs) (+)= x (rows x n) W^T, its panel held in cache while every block
 * of the tile's rows passes it; `prefetch`: the panel this thread computes next. int8 weights: one
 * row, the unit's weight rows one at a time (int8_product). */
static void unit_product(Matrix m, Units u, int unit, const float *x, float *out, int rows, int outputs, int n, int add,
                         const char *prefetch) {
    int p = unit % u.panels, tile_start = unit / u.panels * u.tile;
    int valid = outputs - p * PANEL < PANEL ? outputs - p * PANEL : PANEL;
    if (m.scale) {
        int8_product(m, x, out, p * PANEL, p * PANEL + valid, n, add);
        return;
    }
    const float *panel = (const float *)m.weight + (size_t)p * n * PANEL;
    int tile_rows = rows - tile_start < u.tile ? rows - tile_start : u.tile;
    int blocks = (tile_rows + BLOCK_ROWS - 1) / BLOCK_ROWS, lines = (int)(((size_t)n * PANEL * sizeof(float) + 63) / 64);
    for (int b = 0; b < blocks; b++) {
        int first = tile_start + BLOCK_ROWS * b, R = rows - first < BLOCK_ROWS ? rows - first : BLOCK_ROWS;
        int from = (int)((long)lines * b / blocks), to = (int)((long)lines * (b + 1) / blocks);
        const char *ahead = prefetch ? prefetch + (size_t)from * 64 : NULL;
        const float *xb = x + (size_t)first * n;
        float *target = out + (size_t)first * outputs + p * PANEL;
        switch (R) { /* a block of each size compiled on its own, its loops unrolled */
        case 8: panel_block(8, xb, n, panel, target, outputs, valid, add, ahead, to - from); break;
        case 7: panel_block(7, xb, n, panel, target, outputs, valid, add, ahead, to - from); break;
        case 6: panel_block(6, xb, n, panel, target, outputs, valid, add, ahead, to - from); break;
        case 5: panel_block(5, xb, n, panel, target, outputs, valid, add, ahead, to - from); break;
        case 4: panel_block(4, xb, n, panel, target, outputs, valid, add, ahead, to - from); break;
        case 3: panel_block(3, xb, n, panel, target, outputs, valid, add, ahead, to - from); break;
        case 2: panel_block(2, xb, n, panel, target, outputs, valid, add, ahead, to - from); break;
        default: panel_block(1, xb, n, panel, target, outputs, valid, add, ahead, to - from); break;
        }
    }
}

/* out (rows x outputs) (+)= x (rows x n) W^T, unit by unit as they are claimed from `counter`; each
 * thread claims its next unit before computing the one it holds, so its panel can be prefetched. */
static void product(Matrix m, const float *x, float *out, int rows, int outputs, int n, int add, atomic_int *counter) {
    Units u = units_of(rows, outputs, n);
    for (int unit = claim(counter), next; unit < u.units; unit = next) {
        next = claim(counter);
        unit_product(m, u, unit, x, out, rows, outputs, n, add, unit_panel(m, u, next, n));
    }
}

static void barrier(Step *s) {
    if (s->threads == 1) return;
    int phase = atomic_load_explicit(&s->phase, memory_order_acquire);
    if (atomic_fetch_add_explicit(&s->arrived, 1, memory_order_acq_rel) == s->threads - 1) {
        atomic_store_explicit(&s->arrived, 0, memory_order_relaxed);
        atomic_store_explicit(&s->phase, phase + 1, memory_order_release);
    } else {
        /* spin while the others are a few microseconds away; yield the core past that, so an
         * oversubscribed machine (more threads than free cores) is slowed, not stalled */
        for (long spins = 0; atomic_load_explicit(&s->phase, memory_order_acquire) == phase; spins++) {
            if (spins < SPINS_BEFORE_YIELD) {
#if defined(__x86_64__) || defined(__i386__)
                __builtin_ia32_pause();
#endif
            } else {
                sched_yield();
            }
        }
    }
}

/* transformers' LlamaRMSNorm of every row: x * rsqrt(mean(x^2) + eps) * weight, the mean summed in
 * the order of dot(). Each thread norms every row into its own copy: cheaper than a barrier. */
static void rms_norm(const Step *s, const float *x, const float *weight, float *out) {
    int n = s->hidden;
    for (int i = 0; i < s->tokens; i++, x += n, out += n) {
        float mean = dot(x, x, n) / (float)n;
        float inverse = 1.0f / sqrtf(mean + s->eps);
        for (int d = 0; d < n; d++) out[d] = weight[d] * (x[d] * inverse);
    }
}

/* q * cos + rotate_half(q) * sin, rotate_half(q) = (-q[half:], q[:half]). */
static void rotary(float *vector, const float *cos, const float *sin, int head_dim) {
    int half = head_dim / 2;
    for (int i = 0; i < half; i++) {
        float first = vector[i], second = vector[i + half];
        vector[i] = first * cos[i] - second * sin[i];
        vector[i + half] = second * cos[i + half] + first * sin[i + half];
    }
}

/* e^x for the softmax and silu, 16 lanes at a time where AVX-512 is: x = n ln 2 + r, |r| <= ln 2 / 2,
 * e^r by Cephes' degree-6 polynomial (within 2 ulp of expf), times 2^n by vscalefps, which also
 * gives 0 and inf past float's range. NaN stays NaN. Elsewhere expf(). */
#if defined(__AVX512F__)
static inline __m512 exp_vector(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-104.0f), _mm512_min_ps(_mm512_set1_ps(89.0f), x)); /* NaN passes through */
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    __m512 y = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(y, n);
}
#endif

/* out[i] *= silu(gate[i]) = gate[i] / (1 + e^-gate[i]). */
static void silu_times(const float *gate, float *out, int n) {
    int i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) {
        __m512 g = _mm512_loadu_ps(gate + i);
        __m512 e = exp_vector(_mm512_sub_ps(_mm512_setzero_ps(), g));
        __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
        _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_loadu_ps(out + i), silu));
    }
#endif
    for (; i < n; i++) out[i] *= gate[i] / (1.0f + expf(-gate[i]));
}

/* scores[j] = e^(scores[j] - top) where mask[j], else 0; returns their sum, added one column at a time
 * in column order: a masked column adds an exact 0, so the sum of a row's own columns is the same bits
 * whatever padding or stale columns surround them (a text alone, among others, or served). */
static float exp_shifted(float *scores, const unsigned char *mask, int columns, float top) {
    int j = 0;
#if defined(__AVX512F__)
    __m512 shift = _mm512_set1_ps(top);
    for (; j + 16 <= columns; j += 16) {
        __mmask16 kept = _mm512_cmpneq_epi32_mask(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(mask + j))),
                                                  _mm512_setzero_si512());
        _mm512_storeu_ps(scores + j, _mm512_maskz_mov_ps(kept, exp_vector(_mm512_sub_ps(_mm512_loadu_ps(scores + j), shift))));
    }
    if (j < columns) { /* the last columns through the same exp_vector: which columns are last depends on padding */
        float tail[16] = {0};
        unsigned char tail_mask[16] = {0};
        int n = columns - j;
        memcpy(tail, scores + j, n * sizeof(float));
        memcpy(tail_mask, mask + j, n);
        __mmask16 kept = _mm512_cmpneq_epi32_mask(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)tail_mask)),
                                                  _mm512_setzero_si512());
        _mm512_storeu_ps(tail, _mm512_maskz_mov_ps(kept, exp_vector(_mm512_sub_ps(_mm512_loadu_ps(tail), shift))));
        memcpy(scores + j, tail, n * sizeof(float));
        j = columns;
    }
#endif
    for (; j < columns; j++) scores[j] = mask[j] ? expf(scores[j] - top) : 0.0f;
    float total = 0.0f;
    for (j = 0; j < columns; j++) total += scores[j];
    return total;
}

/* One query head's scores against every column of its keys (scaled; -inf where masked) and its
 * output, the columns' values weighted by their probabilities. A head's vector is held in
 * registers while the columns pass (head_dim up to 128 in AVX-512 registers; elsewhere plain C). */
#define MAX_HEAD_VECTORS 8
static void head_scores(const float *query, const float *keys, const unsigned char *mask, int columns, int hd,
                        float scale, float *scores) {
#if defined(__AVX512F__)
    if (hd % 16 == 0 && hd / 16 <= MAX_HEAD_VECTORS) {
        __m512 q[MAX_HEAD_VECTORS];
        int chunks = hd / 16;
        for (int c = 0; c < chunks; c++) q[c] = _mm512_loadu_ps(query + 16 * c);
        for (int j = 0; j < columns; j++) {
            if (!mask[j]) { /* not read at all: a slot's stale columns, in continuous batching, are many */
                scores[j] = -INFINITY;
                continue;
            }
            const float *key = keys + (size_t)j * hd;
            __m512 sum = _mm512_mul_ps(q[0], _mm512_loadu_ps(key));
            for (int c = 1; c < chunks; c++) sum = _mm512_fmadd_ps(q[c], _mm512_loadu_ps(key + 16 * c), sum);
            scores[j] = _mm512_reduce_add_ps(sum) * scale;
        }
        return;
    }
#endif
    for (int j = 0; j < columns; j++) scores[j] = mask[j] ? dot(query, keys + (size_t)j * hd, hd) * scale : -INFINITY;
}

static void head_values(const float *probabilities, const float *values, const unsigned char *mask, int columns,
                        int hd, float *out) {
#if defined(__AVX512F__)
    if (hd % 16 == 0 && hd / 16 <= MAX_HEAD_VECTORS) {
        __m512 sum[MAX_HEAD_VECTORS];
        int chunks = hd / 16;
        for (int c = 0; c < chunks; c++) sum[c] = _mm512_setzero_ps();
        for (int j = 0; j < columns; j++) {
            if (!mask[j]) continue;
            __m512 p = _mm512_set1_ps(probabilities[j]);
            for (int c = 0; c < chunks; c++) sum[c] = _mm512_fmadd_ps(p, _mm512_loadu_ps(values + (size_t)j * hd + 16 * c), sum[c]);
        }
        for (int c = 0; c < chunks; c++) _mm512_storeu_ps(out + 16 * c, sum[c]);
        return;
    }
#endif
    for (int d = 0; d < hd; d++) out[d] = 0.0f;
    for (int j = 0; j < columns; j++) {
        if (!mask[j]) continue;
        for (int d = 0; d < hd; d++) out[d] = fmaf(probabilities[j], values[(size_t)j * hd + d], out[d]);
    }
}

/* Token i's keys and values, after rotary embedding of them and of its queries, into its cache row
 * at its column. Every token's are written before any token attends: a prompt's tokens attend to
 * each other's. */
static inline float *cache_at(const Step *s, float *cache, int i, int head) {
    return cache + (((size_t)s->cache_rows[i] * s->kv_heads + head) * s->capacity + s->columns[i]) * s->head_dim;
}

static void write_keys(Step *s, const Layer *layer, int i) {
    int hd = s->head_dim;
    float *q = s->q + (size_t)i * s->heads * hd, *k = s->k + (size_t)i * s->kv_heads * hd;
    const float *v = s->v + (size_t)i * s->kv_heads * hd, *cos = s->cos + (size_t)i * hd, *sin = s->sin + (size_t)i * hd;
    for (int h = 0; h < s->heads; h++) rotary(q + h * hd, cos, sin, hd);
    for (int h = 0; h < s->kv_heads; h++) {
        rotary(k + h * hd, cos, sin, hd);
        memcpy(cache_at(s, layer->key_cache, i, h), k + h * hd, hd * sizeof(float));
        memcpy(cache_at(s, layer->value_cache, i, h), v + h * hd, hd * sizeof(float));
    }
}

/* Token i's attention, every head: over its cache row's columns up to its own, where the row's
 * mask lets it. Small next to the products, so the tokens are shared between the threads. */
static void attend(Step *s, const Layer *layer, int i, float *scores) {
    int hd = s->head_dim, columns = s->columns[i] + 1, group = s->heads / s->kv_heads, width = s->heads * hd;
    const unsigned char *mask = s->mask + (size_t)s->cache_rows[i] * s->mask_width;
    for (int h = 0; h < s->heads; h++) {
        const float *keys = cache_at(s, layer->key_cache, i, h / group) - (size_t)s->columns[i] * hd;
        const float *values = cache_at(s, layer->value_cache, i, h / group) - (size_t)s->columns[i] * hd;
        head_scores(s->q + (size_t)i * width + h * hd, keys, mask, columns, hd, s->scale, scores);
        float top = -INFINITY;
        for (int j = 0; j < columns; j++)
            if (scores[j] > top) top = scores[j];
        float total = exp_shifted(scores, mask, columns, top);
        for (int j = 0; j < columns; j++) scores[j] = total > 0.0f ? scores[j] / total : 0.0f; /* no column: zeros, not NaN */
        head_values(scores, values, mask, columns, hd, s->attention + (size_t)i * width + h * hd);
    }
    if (s->int8) round_bfloat16(s->attention + (size_t)i * width, width);
}

typedef struct {
    Step *step;
    int thread;
    float *normed; /* this thread's copy of every token's normed hidden state */
    float *picked; /* the normed states of the tokens that get logits, when not all do */
    float *scores; /* this thread's attention scores, a column each */
} Worker;

/* Denormal inputs and results cost a microcode assist each on x86, hundreds of cycles: silu of a
 * very negative gate and far-off attention weights make them, and a step ran 1.4x slower with
 * them. Both threads' steps run with them flushed to zero (a difference below 1e-38 a term), the
 * caller's setting restored after. */
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#define FLUSH_DENORMALS 0x8040u /* MXCSR's flush-to-zero and denormals-are-zero */
static inline unsigned int flush_denormals(void) {
    unsigned int saved = _mm_getcsr();
    _mm_setcsr(saved | FLUSH_DENORMALS);
    return saved;
}
static inline void restore_denormals(unsigned int saved) { _mm_setcsr(saved); }
#else
static inline unsigned int flush_denormals(void) { return 0; }
static inline void restore_denormals(unsigned int saved) { (void)saved; }
#endif

/* The MLP's gate and up products and silu(gate) * up, unit by unit: a thread computes both products
 * of a unit and its silu while those outputs are in its cache. */
static void gated_product(Step *s, const Layer *layer, const float *x, atomic_int *counter) {
    int N = s->tokens, I = s->intermediate, H = s->hidden;
    Units u = units_of(N, I, H);
    for (int unit = claim(counter), next; unit < u.units; unit = next) {
        next = claim(counter);
        unit_product(layer->gate, u, unit, x, s->gate, N, I, H, 0, unit_panel(layer->up, u, unit, H));
        unit_product(layer->up, u, unit, x, s->mlp, N, I, H, 0, unit_panel(layer->gate, u, next, H));
        int p = unit % u.panels, first = unit / u.panels * u.tile, columns = I - p * PANEL < PANEL ? I - p * PANEL : PANEL;
        int last = N - first < u.tile ? N : first + u.tile;
        for (int i = first; i < last; i++) {
            size_t at = (size_t)i * I + p * PANEL;
            silu_times(s->gate + at, s->mlp + at, columns);
            if (s->int8) round_bfloat16(s->mlp + at, columns);
        }
    }
}

/* Tokens are claimed for attention a few at a time, as units are for products. */
#define ATTENTION_TOKENS 4
#define COUNTERS_A_LAYER 7 /* q, k, v, attention, o, gate and up, down */

static void *run(void *argument) {
    unsigned int saved = flush_denormals();
    Worker *worker = argument;
    Step *s = worker->step;
    int t = worker->thread, T = s->threads, H = s->hidden, I = s->intermediate, hd = s->head_dim, N = s->tokens;
    int width = s->heads * hd, kv_width = s->kv_heads * hd;
    float *normed = worker->normed;
    atomic_int *counter = s->counters;
    for (int index = 0; index < s->n_layers; index++) {
        const Layer *layer = &s->layers[index];
        rms_norm(s, s->x, layer->input_norm, normed);
        if (s->int8) round_bfloat16(normed, H);
        product(layer->q, normed, s->q, N, width, H, 0, counter++);
        product(layer->k, normed, s->k, N, kv_width, H, 0, counter++);
        product(layer->v, normed, s->v, N, kv_width, H, 0, counter++);
        barrier(s);
        for (int i = N * t / T; i < N * (t + 1) / T; i++) write_keys(s, layer, i);
        barrier(s);
        for (int first = claim(counter) * ATTENTION_TOKENS; first < N; first = claim(counter) * ATTENTION_TOKENS)
            for (int i = first; i < first + ATTENTION_TOKENS && i < N; i++) attend(s, layer, i, worker->scores);
        counter++;
        barrier(s);
        product(layer->o, s->attention, s->x, N, H, width, 1, counter++);
        barrier(s);
        rms_norm(s, s->x, layer->post_norm, normed);
        if (s->int8) round_bfloat16(normed, H);
        gated_product(s, layer, normed, counter++);
        barrier(s);
        product(layer->down, s->mlp, s->x, N, H, I, 1, counter++);
        barrier(s);
    }
    rms_norm(s, s->x, s->final_norm, normed);
    if (t == 0) memcpy(s->states_out, normed, (size_t)N * H * sizeof(float));
    if (s->logits_out) {
        const float *heads = normed;
        if (s->logit_index) {
            for (int i = 0; i < s->logit_tokens; i++)
                memcpy(worker->picked + (size_t)i * H, normed + (size_t)s->logit_index[i] * H, H * sizeof(float));
            heads = worker->picked;
        }
        if (s->int8) round_bfloat16((float *)heads, s->logit_tokens * H);
        product(s->lm_head, heads, s->logits_out, s->logit_tokens, s->vocab, H, 0, counter);
    }
    restore_denormals(saved);
    return NULL;
}

static void *start(void *argument) {
    Step *s = ((Worker *)argument)->step;
    int go;
    while ((go = atomic_load_explicit(&s->go, memory_order_acquire)) == 0) sched_yield();
    return go > 0 ? run(argument) : NULL;
}

/* Feeds `tokens` tokens: token i at cache row cache_rows[i], column columns[i] (a decoding step: a
 * token a row, every one at the cache's next column; a prompt: its tokens at consecutive columns),
 * attending to its row's columns up to its own where `mask` (a row of mask_width bytes a cache
 * row) lets it. Writes every token's final normed state, and the logits of the tokens in
 * logit_index (all tokens if NULL; none if logits_out is NULL). Returns 0, or -1 when memory or a
 * thread could not be had, or int8 weights meet more than one token (the caller falls back). */
#define STEP_PARAMETERS                                                                                                \
    const Layer *layers, int n_layers, const float *final_norm, Matrix lm_head, int tokens, int vocab, int hidden,     \
        int intermediate, int heads, int kv_heads, int head_dim, float eps, float scale, int capacity,                 \
        const int *cache_rows, const int *columns, const unsigned char *mask, int mask_width, const float *embedding,  \
        const float *cos, const float *sin, int logit_tokens, const int *logit_index, float *states_out,               \
        float *logits_out, int threads

int grace_step_arg_count(void) { return COUNT_ITEMS(STEP_PARAMETERS); }

int grace_native_step(STEP_PARAMETERS) {
    if (tokens < 1 || (tokens > 1 && lm_head.scale != NULL)) return -1;
    if (!logit_index) logit_tokens = tokens;
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    int width = heads * head_dim, kv_width = kv_heads * head_dim, longest = 0;
    for (int i = 0; i < tokens; i++)
        if (columns[i] + 1 > longest) longest = columns[i] + 1;
    size_t shared = (size_t)tokens * (hidden + 2 * width + 2 * kv_width + 2 * intermediate);
    /* normed states, those picked for logits, a score a column */
    size_t private = (size_t)tokens * hidden + (logit_index ? (size_t)logit_tokens * hidden : 0) + longest;
    float *memory = malloc((shared + threads * private) * sizeof(float));
    int n_counters = COUNTERS_A_LAYER * n_layers + 1;
    atomic_int *counters = malloc(n_counters * sizeof(atomic_int));
    if (!memory || !counters) {
        free(memory);
        free(counters);
        return -1;
    }
    for (int c = 0; c < n_counters; c++) atomic_init(&counters[c], 0);
    Step s = {
        .layers = layers, .n_layers = n_layers, .final_norm = final_norm, .lm_head = lm_head, .int8 = lm_head.scale != NULL,
        .tokens = tokens, .vocab = vocab, .hidden = hidden, .intermediate = intermediate, .heads = heads,
        .kv_heads = kv_heads, .head_dim = head_dim, .eps = eps, .scale = scale, .capacity = capacity,
        .cache_rows = cache_rows, .columns = columns, .mask = mask, .mask_width = mask_width,
        .embedding = embedding, .cos = cos, .sin = sin, .logit_tokens = logit_tokens, .logit_index = logit_index,
        .states_out = states_out, .logits_out = logits_out, .threads = threads, .counters = counters,
    };
    s.x = memory;
    s.q = s.x + (size_t)tokens * hidden;
    s.attention = s.q + (size_t)tokens * width;
    s.k = s.attention + (size_t)tokens * width;
    s.v = s.k + (size_t)tokens * kv_width;
    s.gate = s.v + (size_t)tokens * kv_width;
    s.mlp = s.gate + (size_t)tokens * intermediate;
    atomic_init(&s.arrived, 0);
    atomic_init(&s.phase, 0);
    memcpy(s.x, embedding, (size_t)tokens * hidden * sizeof(float));
    Worker workers[MAX_THREADS];
    pthread_t handles[MAX_THREADS];
    for (int t = 0; t < threads; t++) {
        workers[t].step = &s;
        workers[t].thread = t;
        workers[t].normed = memory + shared + t * private;
        workers[t].picked = workers[t].normed + (size_t)tokens * hidden;
        workers[t].scores = workers[t].picked + (logit_index ? (size_t)logit_tokens * hidden : 0);
    }
    atomic_init(&s.go, 0);
    int started = 1;
    for (int t = 1; t < threads; t++) {
        if (pthread_create(&handles[t], NULL, start, &workers[t]) != 0) break;
        started++;
    }
    /* a thread that did not start would leave the others waiting at the first barrier: those
     * that did start return before touching anything, and the caller falls back */
    atomic_store_explicit(&s.go, started == threads ? 1 : -1, memory_order_release);
    if (started < threads) {
        for (int t = 1; t < started; t++) pthread_join(handles[t], NULL);
        free(memory);
        free(counters);
        return -1;
    }
    run(&workers[0]);
    for (int t = 1; t < threads; t++) pthread_join(handles[t], NULL);
    free(memory);
    free(counters);
    return 0;
}
