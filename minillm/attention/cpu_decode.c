/* Decode attention over the paged KV cache, for CPUs: one query per row, every decode row in one call.

   Built and loaded by minillm/attention/cpu_decode.py (cc -O3 -march=native -fopenmp, no torch headers);
   its contract is attention.paged.decode_attention_fused's, and tests/attention/test_cpu_decode.py holds
   it to that.

   Work item: one (row, KV head), spread over the threads. Its G = Hq / Hkv query heads share the K and V
   of that head (GQA), so each key and value row is read from the cache once and used G times, and only
   the row's own seq_len keys are read: nothing past them, no padding to a longer row. The keys are
   walked one cache block at a time with an online softmax (FlashAttention's running max m, sum l and
   output acc, rescaled once per block). Arithmetic on vectors of 16 fp32 (GCC's vector extensions: one
   AVX-512 register, two AVX2 ones), so the head size D is a multiple of 16; 64, the common one, is
   compiled as a constant, which keeps a row's vectors in registers.

   Layouts (contiguous): q (B, Hq, D); k_cache, v_cache (num_blocks, block_size, Hkv, D) in fp32 or
   bf16 (dtype); block_tables (B, n) int32; seq_lens (B,) int32, each >= 1; out (B, Hq, D).
   window > 0: each row sees only its last `window` keys (the blocks before them are not read). */
#include "vec16.h"

#define MAX_G 16            /* query heads per KV head */
#define MAX_V 16            /* head size: up to 16 vectors of 16 */
#define MAX_BLOCK 256       /* keys per cache block */

typedef float vf8 __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));

static inline float hsum(vf x) {                 /* a tree of adds: 4 steps, not 15 in a chain */
    vf8 a = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
    vf4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

/* e^x in fp32 within 2 ulp, written so that it vectorises (libm's expf is one call per number): x = n ln2 + r
   with |r| <= ln2 / 2 (n rounded by adding and subtracting 1.5 * 2^23), e^r by its Taylor polynomial to r^7,
   times 2^n put into the exponent bits. Below -87, where e^x underflows, 0: so the first block's rescale of
   the empty running max (-1e30) is 0. */
static inline float exp_approx(float x) {
    float under = x < -87.f ? 0.f : 1.f;
    x = x < -87.f ? -87.f : x;
    float n = (x * 1.44269504f + 12582912.f) - 12582912.f;
    float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;      /* ln2 in two parts */
    float p = 1.f + r * (1.f + r * (0.5f + r * (1.6666667e-1f + r * (4.1666668e-2f + r * (8.3333338e-3f
              + r * (1.3888889e-3f + r * 1.9841270e-4f))))));
    int32_t bits = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n * under;
}

typedef int32_t vi __attribute__((vector_size(64)));

static inline vf vselect(vi mask, vf a, vf b) {     /* a where mask is all ones, else b */
    vi ai, bi;
    memcpy(&ai, &a, sizeof ai);
    memcpy(&bi, &b, sizeof bi);
    vi r = (mask & ai) | (~mask & bi);
    vf out;
    memcpy(&out, &r, sizeof out);
    return out;
}

/* exp_approx on 16 numbers at once (the softmax of a block). */
static inline vf vexp(vf x) {
    vi keep = x >= -87.f;                                  /* all ones where e^x does not underflow */
    x = vselect(keep, x, (vf){0} - 87.f);
    vf n = (x * 1.44269504f + 12582912.f) - 12582912.f;
    vf r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
    vf p = 1.f + r * (1.f + r * (0.5f + r * (1.6666667e-1f + r * (4.1666668e-2f + r * (8.3333338e-3f
           + r * (1.3888889e-3f + r * 1.9841270e-4f))))));
    vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
    vf two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return vselect(keep, p * two_n, (vf){0});
}

/* One (row, KV head h): the outputs of its G query heads. Inlined into both of decode_attention's calls, so
   that the one with D = 64 is compiled for that constant. */
static inline __attribute__((always_inline)) void attend_one(
        const char *q, const char *k_cache, const char *v_cache, const int32_t *table, int64_t seq_len, char *out,
        int dtype, int64_t Hkv, int64_t h, int64_t G, int64_t D, int64_t block_size, float scale, int64_t window) {
    const int64_t size = dtype == BF16 ? 2 : 4, V = D / 16, row_bytes = D * size;
    vf qv[MAX_G][MAX_V], acc[MAX_G][MAX_V], kv[MAX_V];
    float m[MAX_G], l[MAX_G], s[MAX_G][MAX_BLOCK];
    for (int64_t g = 0; g < G; g++) {
        for (int64_t i = 0; i < V; i++) {
            qv[g][i] = load16(q + (h * G + g) * row_bytes + i * 16 * size, dtype) * scale;
            acc[g][i] = (vf){0};
        }
        m[g] = -1e30f; l[g] = 0.f;
    }
    int64_t first = window > 0 && seq_len > window ? seq_len - window : 0;
    for (int64_t t0 = first - first % block_size; t0 < seq_len; t0 += block_size) {
        int64_t lo = t0 < first ? first - t0 : 0;
        int64_t hi = seq_len - t0 < block_size ? seq_len - t0 : block_size;       /* keys lo .. hi-1 */
        const char *kb = k_cache + (((int64_t)table[t0 / block_size] * block_size) * Hkv + h) * row_bytes;
        const char *vb = v_cache + (kb - k_cache);
        const int64_t step = Hkv * row_bytes;                             /* next key of the same head */
        for (int64_t j = lo; j < hi; j++) {                                      /* scores: K row once, G dots */
            for (int64_t i = 0; i < V; i++) kv[i] = load16(kb + j * step + i * 16 * size, dtype);
            for (int64_t g = 0; g < G; g++) {
                vf t = qv[g][0] * kv[0];
                for (int64_t i = 1; i < V; i++) t += qv[g][i] * kv[i];
                s[g][j] = hsum(t);
            }
        }
        int64_t padded = (hi + 15) / 16 * 16;                          /* whole vectors; the rest masked */
        for (int64_t g = 0; g < G; g++) {                                        /* the online softmax */
            for (int64_t j = 0; j < lo; j++) s[g][j] = -1e30f;
            for (int64_t j = hi; j < padded; j++) s[g][j] = -1e30f;
            vf most = (vf){0} - 1e30f;
            for (int64_t j = 0; j < padded; j += 16) {
                vf x;
                memcpy(&x, &s[g][j], sizeof x);
                most = vselect(most > x, most, x);
            }
            float block_max = m[g];
            for (int k = 0; k < 16; k++) block_max = most[k] > block_max ? most[k] : block_max;
            float rescale = exp_approx(m[g] - block_max);
            vf total = (vf){0};
            for (int64_t j = 0; j < padded; j += 16) {
                vf x;
                memcpy(&x, &s[g][j], sizeof x);
                x = vexp(x - block_max);
                memcpy(&s[g][j], &x, sizeof x);
                total += x;
            }
            l[g] = l[g] * rescale + hsum(total);
            m[g] = block_max;
            for (int64_t i = 0; i < V; i++) acc[g][i] *= rescale;
        }
        for (int64_t j = lo; j < hi; j++) {                                      /* p V: V row once, G updates */
            for (int64_t i = 0; i < V; i++) kv[i] = load16(vb + j * step + i * 16 * size, dtype);
            for (int64_t g = 0; g < G; g++) {
                float p = s[g][j];
                for (int64_t i = 0; i < V; i++) acc[g][i] += p * kv[i];
            }
        }
    }
    for (int64_t g = 0; g < G; g++) {
        float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
        char *o = out + (h * G + g) * row_bytes;
        for (int64_t i = 0; i < V; i++) {
            vf x = acc[g][i] * inv;
            for (int k = 0; k < 16; k++) {
                if (dtype == BF16) ((uint16_t *)o)[i * 16 + k] = float_to_bf16(x[k]);
                else ((float *)o)[i * 16 + k] = x[k];
            }
        }
    }
}

/* Every (row, KV head) of the batch over num_threads threads. -> 0; 1 for a layout past the limits; 2 for a
   seq_len outside 1 .. n * block_size or a block number its keys use outside 0 .. num_blocks - 1 (nothing
   is read then). */
int decode_attention(const void *q, const void *k_cache, const void *v_cache, const int32_t *block_tables,
                     const int32_t *seq_lens, void *out, int dtype, int64_t B, int64_t n, int64_t Hq, int64_t Hkv,
                     int64_t D, int64_t block_size, int64_t num_blocks, float scale, int64_t window,
                     int num_threads) {
    int64_t G = Hq / Hkv, size = dtype == BF16 ? 2 : 4;
    if (G > MAX_G || D % 16 || D / 16 > MAX_V || block_size > MAX_BLOCK || G * Hkv != Hq) return 1;
    for (int64_t b = 0; b < B; b++) {
        int64_t len = seq_lens[b], first = window > 0 && len > window ? len - window : 0;
        if (len < 1 || len > n * block_size) return 2;
        for (int64_t i = first / block_size; i < (len + block_size - 1) / block_size; i++)
            if (block_tables[b * n + i] < 0 || block_tables[b * n + i] >= num_blocks) return 2;
    }
    #pragma omp parallel for collapse(2) schedule(dynamic, 4) num_threads(num_threads)
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < Hkv; h++) {
            const char *qb = (const char *)q + b * Hq * D * size;
            char *ob = (char *)out + b * Hq * D * size;
            if (D == 64)            /* the common head size as a constant: a row's vectors stay in registers */
                attend_one(qb, k_cache, v_cache, block_tables + b * n, seq_lens[b], ob, dtype, Hkv, h, G, 64,
                           block_size, scale, window);
            else
                attend_one(qb, k_cache, v_cache, block_tables + b * n, seq_lens[b], ob, dtype, Hkv, h, G, D,
                           block_size, scale, window);
        }
    return 0;
}
