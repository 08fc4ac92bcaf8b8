/* One decoding step of a Llama-family decoder for a single row, on every core.
 *
 * A query decoded alone multiplies one row by every weight each step, so the step is bound by
 * how fast the weights are read. PyTorch runs those matrix-vector products on one thread (MKL)
 * or reads its blocked layout slowly (oneDNN), and dispatches ~400 small operations a step around
 * them (docs/latency.md). Here the whole step (the decoder layers, the final norm and the LM
 * head) is one call: the rows of every product are split between the threads, each row's dot
 * product is summed in the same order whichever thread computes it (so the result does not
 * depend on the thread count), and the threads meet at a spinning barrier after each product
 * whose output the next one reads.
 *
 * Layout of everything passed in, float32, contiguous:
 *   weights as nn.Linear stores them (out_features x in_features);
 *   key and value caches as grace_st.decoding.PreallocatedLayer holds them for one row:
 *   kv_heads x capacity x head_dim; the token's keys and values are written at column `length`
 *   (after rotary embedding, as transformers stores them);
 *   cos and sin: the rotary tables of the token's position (head_dim), computed by the model's
 *   own rotary module, so any rope scaling it applies is applied here too.
 * Built and loaded by grace_st/one_row_step.py; the formulas are transformers' LlamaDecoderLayer.
 */
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
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

typedef struct {
    const Layer *layers;
    int n_layers;
    const float *final_norm;
    Matrix lm_head;
    int int8; /* every product on int8 weights (the LM head's tells): inputs and outputs rounded to bfloat16 as grace_st.quantization does */
    int vocab, hidden, intermediate, heads, kv_heads, head_dim;
    float eps, scale;
    int capacity, length;
    const unsigned char *mask; /* length + 1 entries, 0: masked column */
    const float *embedding, *cos, *sin;
    float *states_out, *logits_out;
    int threads;
    /* shared scratch */
    float *x, *q, *k, *v, *attention, *mlp, *scores;
    /* barrier */
    atomic_int arrived;
    atomic_int phase;
    atomic_int go; /* 0: wait, 1: run, -1: a thread failed to start, return */
} Step;

/* Dot product of one weight row with x: LANES partial sums, then a fixed-order reduction.
 * The same arithmetic for every row, whichever thread and block computes it. */
static inline float dot(const float *restrict w, const float *restrict x, int n) {
    float acc[LANES] = {0};
    int j = 0;
    for (; j + LANES <= n; j += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += w[j + l] * x[j + l];
    for (int l = 0; j + l < n; l++) acc[l] += w[j + l] * x[j + l];
    for (int width = LANES / 2; width > 0; width /= 2)
        for (int l = 0; l < width; l++) acc[l] += acc[l + width];
    return acc[0];
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
    for (int width = LANES / 2; width > 0; width /= 2)
        for (int l = 0; l < width; l++) acc[0][l] += acc[0][l + width];
    return acc[0][0];
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

/* This thread's share [*begin, *end) of `rows` rows, in blocks of four. */
static inline void share(int rows, int thread, int threads, int *begin, int *end) {
    int blocks = (rows + 3) / 4;
    *begin = 4 * (int)((long)blocks * thread / threads);
    *end = 4 * (int)((long)blocks * (thread + 1) / threads);
    if (*end > rows) *end = rows;
    if (*begin > rows) *begin = rows;
}

/* out[r] (+)= W[r] . x for rows [begin, end) of an `n`-wide matrix, one row at a time, so the
 * matrix streams in order (blocks of four rows sharing each load of x were no faster). An int8
 * matrix scales each row's sum and rounds it to bfloat16 (grace_st.quantization.Int8WeightOnlyLinear's output). */
static void rows_product(Matrix m, const float *x, float *out, int begin, int end, int n, int add) {
    for (int r = begin; r < end; r++) {
        float value = m.scale ? bfloat16(dot_int8((const signed char *)m.weight + (size_t)r * n, x, n) * m.scale[r])
                              : dot((const float *)m.weight + (size_t)r * n, x, n);
        out[r] = add ? out[r] + value : value;
    }
}

/* The same for this thread's share of the rows. */
static void matvec(Matrix m, const float *x, float *out, int rows, int n, int thread, int threads, int add) {
    int begin, end;
    share(rows, thread, threads, &begin, &end);
    rows_product(m, x, out, begin, end, n, add);
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

/* transformers' LlamaRMSNorm: x * rsqrt(mean(x^2) + eps) * weight, the mean summed in the order of dot(). */
static void rms_norm(const float *x, const float *weight, float *out, int n, float eps) {
    float mean = dot(x, x, n) / (float)n;
    float inverse = 1.0f / sqrtf(mean + eps);
    for (int i = 0; i < n; i++) out[i] = weight[i] * (x[i] * inverse);
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

/* Rotary embedding, the cache write and attention for every head: small next to the products,
 * so one thread does it while the others wait at the barrier. */
static void attend(Step *s, const Layer *layer) {
    int hd = s->head_dim, columns = s->length + 1, group = s->heads / s->kv_heads;
    for (int h = 0; h < s->heads; h++) rotary(s->q + h * hd, s->cos, s->sin, hd);
    for (int h = 0; h < s->kv_heads; h++) {
        rotary(s->k + h * hd, s->cos, s->sin, hd);
        memcpy(layer->key_cache + ((size_t)h * s->capacity + s->length) * hd, s->k + h * hd, hd * sizeof(float));
        memcpy(layer->value_cache + ((size_t)h * s->capacity + s->length) * hd, s->v + h * hd, hd * sizeof(float));
    }
    for (int h = 0; h < s->heads; h++) {
        const float *query = s->q + h * hd;
        const float *keys = layer->key_cache + (size_t)(h / group) * s->capacity * hd;
        const float *values = layer->value_cache + (size_t)(h / group) * s->capacity * hd;
        float *scores = s->scores, top = -INFINITY;
        for (int j = 0; j < columns; j++) {
            scores[j] = s->mask[j] ? dot(query, keys + (size_t)j * hd, hd) * s->scale : -INFINITY;
            if (scores[j] > top) top = scores[j];
        }
        float total = 0.0f;
        for (int j = 0; j < columns; j++) {
            scores[j] = s->mask[j] ? expf(scores[j] - top) : 0.0f;
            total += scores[j];
        }
        float *out = s->attention + h * hd;
        for (int d = 0; d < hd; d++) out[d] = 0.0f;
        for (int j = 0; j < columns; j++) {
            if (!s->mask[j]) continue;
            float p = total > 0.0f ? scores[j] / total : 0.0f; /* no column to attend: zeros, not NaN */
            const float *value = values + (size_t)j * hd;
            for (int d = 0; d < hd; d++) out[d] += p * value[d];
        }
    }
    if (s->int8) round_bfloat16(s->attention, s->heads * hd);
}

typedef struct {
    Step *step;
    int thread;
    float *normed;   /* this thread's copy of the normed hidden state */
    float *gate_row; /* this thread's gate outputs */
} Worker;

static void *run(void *argument) {
    Worker *worker = argument;
    Step *s = worker->step;
    int t = worker->thread, T = s->threads, H = s->hidden, I = s->intermediate, hd = s->head_dim;
    float *normed = worker->normed, *gate = worker->gate_row;
    for (int index = 0; index < s->n_layers; index++) {
        const Layer *layer = &s->layers[index];
        rms_norm(s->x, layer->input_norm, normed, H, s->eps);
        if (s->int8) round_bfloat16(normed, H);
        matvec(layer->q, normed, s->q, s->heads * hd, H, t, T, 0);
        matvec(layer->k, normed, s->k, s->kv_heads * hd, H, t, T, 0);
        matvec(layer->v, normed, s->v, s->kv_heads * hd, H, t, T, 0);
        barrier(s);
        if (t == 0) attend(s, layer);
        barrier(s);
        matvec(layer->o, s->attention, s->x, H, s->heads * hd, t, T, 1);
        barrier(s);
        rms_norm(s->x, layer->post_norm, normed, H, s->eps);
        if (s->int8) round_bfloat16(normed, H);
        int begin, end;
        share(I, t, T, &begin, &end);
        /* gate and up over the same rows: silu(gate) * up needs no barrier between them */
        rows_product(layer->gate, normed, gate, begin, end, H, 0);
        rows_product(layer->up, normed, s->mlp, begin, end, H, 0);
        for (int r = begin; r < end; r++) {
            float g = gate[r];
            s->mlp[r] *= g / (1.0f + expf(-g));
            if (s->int8) s->mlp[r] = bfloat16(s->mlp[r]);
        }
        barrier(s);
        matvec(layer->down, s->mlp, s->x, H, I, t, T, 1);
        barrier(s);
    }
    rms_norm(s->x, s->final_norm, normed, H, s->eps);
    if (t == 0) memcpy(s->states_out, normed, H * sizeof(float));
    if (s->int8) round_bfloat16(normed, H);
    if (s->logits_out) matvec(s->lm_head, normed, s->logits_out, s->vocab, H, t, T, 0);
    return NULL;
}

static void *start(void *argument) {
    Step *s = ((Worker *)argument)->step;
    int go;
    while ((go = atomic_load_explicit(&s->go, memory_order_acquire)) == 0) sched_yield();
    return go > 0 ? run(argument) : NULL;
}

/* Returns 0, or -1 when memory or a thread could not be had (the caller falls back). */
int grace_one_row_step(
    const Layer *layers, int n_layers, const float *final_norm, Matrix lm_head, int vocab, int hidden,
    int intermediate, int heads, int kv_heads, int head_dim, float eps, float scale, int capacity, int length,
    const unsigned char *mask, const float *embedding, const float *cos, const float *sin, float *states_out,
    float *logits_out, int threads) {
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    int attention_width = heads * head_dim;
    size_t shared = (size_t)hidden + 2 * attention_width + 2 * kv_heads * head_dim + intermediate + length + 1;
    size_t private = (size_t)hidden + intermediate; /* normed, gate (indexed by row, as s->mlp) */
    float *memory = malloc((shared + threads * private) * sizeof(float));
    if (!memory) return -1;
    Step s = {
        .layers = layers, .n_layers = n_layers, .final_norm = final_norm, .lm_head = lm_head, .int8 = lm_head.scale != NULL,
        .vocab = vocab,
        .hidden = hidden, .intermediate = intermediate, .heads = heads, .kv_heads = kv_heads,
        .head_dim = head_dim, .eps = eps, .scale = scale, .capacity = capacity, .length = length, .mask = mask,
        .embedding = embedding, .cos = cos, .sin = sin, .states_out = states_out, .logits_out = logits_out,
        .threads = threads,
    };
    s.x = memory;
    s.q = s.x + hidden;
    s.attention = s.q + attention_width;
    s.k = s.attention + attention_width;
    s.v = s.k + kv_heads * head_dim;
    s.mlp = s.v + kv_heads * head_dim;
    s.scores = s.mlp + intermediate;
    atomic_init(&s.arrived, 0);
    atomic_init(&s.phase, 0);
    memcpy(s.x, embedding, hidden * sizeof(float));
    Worker workers[MAX_THREADS];
    pthread_t handles[MAX_THREADS];
    for (int t = 0; t < threads; t++) {
        workers[t].step = &s;
        workers[t].thread = t;
        workers[t].normed = memory + shared + t * private;
        workers[t].gate_row = workers[t].normed + hidden;
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
        return -1;
    }
    run(&workers[0]);
    for (int t = 1; t < threads; t++) pthread_join(handles[t], NULL);
    free(memory);
    return 0;
}
