/* y = x W^T for a few rows x, with W in row blocks: the projections of a decode step on a CPU.

   Built and loaded by minillm/model/cpu_gemm.py (kernel_support/c_library.py); tests/model/test_cpu_gemm.py
   holds it to the exact sum.

   A step of 1-8 new tokens (decode rows, a speculative verification) is bound by reading the weights: each
   weight is used once per row, so a library GEMM, blocked and packed for reuse across many rows, gains nothing
   from its machinery, and a matrix-vector product per row reads W once per row. Here each block of R weight rows (transforms.gemv_blocks:
   block b holds rows bR .. bR+R-1 column by column, one cache line of weights per column) is read once, front
   to back, and every column of it is multiplied into up to 8 rows' running sums at once: 8 x R fp32 sums stay
   in vector registers (16 of the 32 AVX-512 ones in bf16), so the weights stream from memory once for the whole
   step. More than 8 rows go through the block again, 8 at a time, while it is still in the L2 cache.

   Layouts (contiguous): w (B, in, R) with R = 16 fp32 or 32 bf16; x (N, in) and y (N, B * R) in w's dtype.
   Sums in fp32 (with fewer than 8 vectors of sums, even and odd columns apart, then added); bf16 results
   rounded to nearest even. */
#include <stdlib.h>
#include "vec16.h"
#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

#define MAX_ROWS 8            /* rows whose sums are held in registers at once */

/* Rows [0, NR) of one block: acc[n][v] is the sum of output row n, lanes 16 v .. 16 v + 15 of the block.
   Always inlined with NR and V constant, so that the sums live in registers. With few rows there are too few
   sums to hide an FMA's latency (4 cycles, 2 per cycle): then even and odd columns go to two sets of sums,
   added at the end. */
static inline __attribute__((always_inline)) void block_rows(const char *wb, const float *x, char *y, int dtype,
                                                             int64_t in, int64_t ldy, int NR, int V) {
    const int S = NR * V < 8 ? 2 : 1;                           /* sets of sums: 2 when fewer than 8 chains */
    vf acc[2][MAX_ROWS][2];
    for (int s = 0; s < S; s++)
        for (int n = 0; n < NR; n++)
            for (int v = 0; v < V; v++) acc[s][n][v] = (vf){0};
    int64_t i = 0;
    for (; i + S <= in; i += S)                                 /* columns i .. i+S-1: one cache line each */
        for (int s = 0; s < S; s++) {
            vf w[2];
            for (int v = 0; v < V; v++) w[v] = load16(wb + (i + s) * 64 + v * (64 / V), dtype);
            for (int n = 0; n < NR; n++) {
                float xs = x[n * in + i + s];
                for (int v = 0; v < V; v++) acc[s][n][v] += w[v] * xs;
            }
        }
    for (; i < in; i++) {                                       /* an odd last column */
        vf w[2];
        for (int v = 0; v < V; v++) w[v] = load16(wb + i * 64 + v * (64 / V), dtype);
        for (int n = 0; n < NR; n++)
            for (int v = 0; v < V; v++) acc[0][n][v] += w[v] * x[n * in + i];
    }
    for (int n = 0; n < NR; n++)
        for (int v = 0; v < V; v++) {
            vf sum = S == 2 ? acc[0][n][v] + acc[1][n][v] : acc[0][n][v];
            if (dtype == BF16)
                for (int k = 0; k < 16; k++) ((uint16_t *)y)[n * ldy + v * 16 + k] = float_to_bf16(sum[k]);
            else
                memcpy((float *)y + n * ldy + v * 16, &sum, sizeof(vf));
        }
}

#ifdef __AVX512BF16__
/* bf16 on a CPU with AVX512_BF16 (AMD Zen 4, Intel Sapphire Rapids): vdpbf16ps multiplies 16 pairs of bf16 and adds
   both products to 16 fp32 sums in one instruction, so two columns of 32 weights cost each row 2 instructions instead
   of 4 FMAs, and the weights are never widened to fp32. The pairs it wants (the same weight row in columns i and
   i+1) come from interleaving the two columns (unpacklo/unpackhi, within each 128-bit lane): sums lo[n] hold rows
   8L .. 8L+3 of lane L, hi[n] rows 8L+4 .. 8L+7 (put back in order when stored). x arrives as bf16 pairs. */
static inline __attribute__((always_inline)) void block_rows_dp(const uint16_t *wb, const uint16_t *x, uint16_t *y,
                                                                int64_t in, int64_t ldy, int NR) {
    const int S = NR < 4 ? 2 : 1;                               /* sets of sums: 2 when fewer than 8 chains */
    __m512 lo[2][MAX_ROWS], hi[2][MAX_ROWS];
    for (int s = 0; s < S; s++)
        for (int n = 0; n < NR; n++) lo[s][n] = hi[s][n] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 2 * S <= in; i += 2 * S)
        for (int s = 0; s < S; s++) {
            __m512i c0 = _mm512_loadu_si512(wb + (i + 2 * s) * 32), c1 = _mm512_loadu_si512(wb + (i + 2 * s + 1) * 32);
            __m512bh a = (__m512bh)_mm512_unpacklo_epi16(c0, c1), b = (__m512bh)_mm512_unpackhi_epi16(c0, c1);
            for (int n = 0; n < NR; n++) {
                uint32_t pair;
                memcpy(&pair, x + n * in + i + 2 * s, sizeof pair);
                __m512bh xs = (__m512bh)_mm512_set1_epi32((int)pair);
                lo[s][n] = _mm512_dpbf16_ps(lo[s][n], a, xs);
                hi[s][n] = _mm512_dpbf16_ps(hi[s][n], b, xs);
            }
        }
    for (; i < in; i++) {                                       /* the columns left: paired with a zero column */
        __m512i c0 = _mm512_loadu_si512(wb + i * 32), zero = _mm512_setzero_si512();
        __m512bh a = (__m512bh)_mm512_unpacklo_epi16(c0, zero), b = (__m512bh)_mm512_unpackhi_epi16(c0, zero);
        for (int n = 0; n < NR; n++) {
            __m512bh xs = (__m512bh)_mm512_set1_epi32((int)x[n * in + i]);
            lo[0][n] = _mm512_dpbf16_ps(lo[0][n], a, xs);
            hi[0][n] = _mm512_dpbf16_ps(hi[0][n], b, xs);
        }
    }
    for (int n = 0; n < NR; n++) {
        float l[16], h[16];
        _mm512_storeu_ps(l, S == 2 ? _mm512_add_ps(lo[0][n], lo[1][n]) : lo[0][n]);
        _mm512_storeu_ps(h, S == 2 ? _mm512_add_ps(hi[0][n], hi[1][n]) : hi[0][n]);
        for (int lane = 0; lane < 4; lane++)
            for (int k = 0; k < 4; k++) {
                y[n * ldy + 8 * lane + k] = float_to_bf16(l[4 * lane + k]);
                y[n * ldy + 8 * lane + 4 + k] = float_to_bf16(h[4 * lane + k]);
            }
    }
}

#define DP_CASE(NR) case NR: block_rows_dp((const uint16_t *)wb, (const uint16_t *)x + n0 * in, (uint16_t *)yr, in, ldy, NR); break;
#endif

#define CASES(V) switch (nr) { CASE(1, V) CASE(2, V) CASE(3, V) CASE(4, V) CASE(5, V) CASE(6, V) CASE(7, V) CASE(8, V) }
#define CASE(NR, V) case NR: block_rows(wb, xr, yr, dtype, in, ldy, NR, V); break;

/* x: the rows as given (bf16 pairs for vdpbf16ps); xf: the same in fp32 (NULL where vdpbf16ps reads x). */
static void one_block(const char *wb, const void *x, const float *xf, char *y, int dtype, int64_t N, int64_t in,
                      int64_t ldy) {
    const int64_t size = dtype == BF16 ? 2 : 4;
    for (int64_t n0 = 0; n0 < N; n0 += MAX_ROWS) {
        char *yr = y + n0 * ldy * size;
        int64_t nr = N - n0 < MAX_ROWS ? N - n0 : MAX_ROWS;
#ifdef __AVX512BF16__
        if (dtype == BF16) {
            switch (nr) { DP_CASE(1) DP_CASE(2) DP_CASE(3) DP_CASE(4) DP_CASE(5) DP_CASE(6) DP_CASE(7) DP_CASE(8) }
            continue;
        }
#endif
        const float *xr = xf + n0 * in;
        if (dtype == BF16) CASES(2)                              /* vectors of 16 per block column */
        else CASES(1)
    }
}

/* w (B, in, R), x (N, in), y (N, B * R) as above; dtype F32 or BF16. -> 0; 1 for an unknown dtype; 3 when the
   fp32 copy of x could not be allocated. */
int blocked_gemm(const void *w, const void *x, void *y, int dtype, int64_t N, int64_t B, int64_t in,
                 int num_threads) {
    if (dtype != F32 && dtype != BF16) return 1;
    float *xf = NULL;
#ifdef __AVX512BF16__
    if (dtype == F32)
#endif
    {
        xf = malloc((size_t)(N * in) * sizeof(float));          /* x in fp32 once, not once per block */
        if (!xf) return 3;
        for (int64_t j = 0; j < N * in; j++) {
            if (dtype == BF16) {
                uint32_t bits = (uint32_t)((const uint16_t *)x)[j] << 16;
                memcpy(&xf[j], &bits, sizeof bits);
            } else
                xf[j] = ((const float *)x)[j];
        }
    }
    const int64_t R = dtype == BF16 ? 32 : 16, size = dtype == BF16 ? 2 : 4;
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t b = 0; b < B; b++)
        one_block((const char *)w + b * in * R * size, x, xf, (char *)y + b * R * size, dtype, N, in, B * R);
    free(xf);
    return 0;
}
