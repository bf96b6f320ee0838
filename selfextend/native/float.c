/* F16 and BF16 weight rows held as stored (F16_W, BF16_W: gguf's F16 and BF16, a "block" of one value),
 * against float32 activation rows (ACT_F32): the product is the float product of the file's own values,
 * with no int8 rounding of the activations, so an F16 or BF16 file keeps its precision (int8 activation
 * blocks would add their half-step error on top of weights stored to 11 or 8 bits).
 * Each row's product sums in 16 float32 lanes (values k = l mod 16 in lane l, one fused multiply-add each;
 * a last 8 values past the sixteens into lanes 0-7), then adds lanes l and l + 8, those 8 in a fixed order
 * (quant.h's hsum8) and the tail of n mod 8 values one after another: the same float operations on the vector
 * path (AVX2 with F16C) and the portable one, so the two agree bit for bit, and every tile shape repeats
 * them, so a row's result does not depend on the batch. Two chains of additions a row, not one: a lone
 * row's loop waits on the adder's latency with one (8.3 GMAC/s, 16.6 GB/s of weights, on a 2-core Xeon with
 * 24 GB/s to read; experiments/speed/row_products.py --kinds 1), and a tile of 4 rows with 4. */
#include "quant.h"

/* Value k of a weight row of `type` as float32 (exact: both widen without rounding). */
INLINE float value_f(int type, const uint8_t *w, long k) {
    if (type == F16_W) return f16(w + 2 * k);
    uint32_t u = (uint32_t)((const uint16_t *)w)[k] << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* The 16 lanes' sum: lanes l and l + 8, then hsum8's order (l and l + 4, those pairs 0 + 2 and 1 + 3, then
 * the two). */
INLINE float sum16(const float *lane) {
    float h[8];
    for (int l = 0; l < 8; l++) h[l] = lane[l] + lane[l + 8];
    float a0 = h[0] + h[4], a1 = h[1] + h[5], a2 = h[2] + h[6], a3 = h[3] + h[7];
    return (a0 + a2) + (a1 + a3);
}

/* One weight row of n values times one float32 activation row: the portable path. */
static float dot_f(int type, const uint8_t *w, const void *xv, long n) {
    const float *x = (const float *)xv;
    float lane[16] = {0}, tail = 0.0f;
    long k = 0;
    for (; k + 16 <= n; k += 16)
        for (int l = 0; l < 16; l++) lane[l] = fmaf(value_f(type, w, k + l), x[k + l], lane[l]);
    if (k + 8 <= n) {
        for (int l = 0; l < 8; l++) lane[l] = fmaf(value_f(type, w, k + l), x[k + l], lane[l]);
        k += 8;
    }
    for (; k < n; k++) tail = fmaf(value_f(type, w, k), x[k], tail);
    return sum16(lane) + tail;
}

#ifdef HAVE_AVX2
/* 8 values of a weight row from p (F16: cvtph; BF16: the 16 bits moved to a float32's top). */
INLINE __m256 load8(int type, const uint8_t *p) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (type == F16_W) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* One weight row times R activation rows x[r] into out[r], `type` and R constants at every call: each 16
 * weight values loaded once for the R rows (lanes 0-7 in lo, 8-15 in hi). */
INLINE void rows_f(int type, const uint8_t *w, const void *const *xv, long n, int R, float *out) {
    __m256 lo[TILE], hi[TILE];
    for (int r = 0; r < R; r++) lo[r] = hi[r] = _mm256_setzero_ps();
    long j = 0;
    for (; j + 16 <= n; j += 16) {
        if ((j & 31) == 0) prefetch_ahead(w + 2 * j, 64);
        const __m256 w0 = load8(type, w + 2 * j), w1 = load8(type, w + 2 * j + 16);
        for (int r = 0; r < R; r++) {
            const float *x = (const float *)xv[r] + j;
            lo[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x), lo[r]);
            hi[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + 8), hi[r]);
        }
    }
    if (j + 8 <= n) {
        const __m256 w0 = load8(type, w + 2 * j);
        for (int r = 0; r < R; r++) lo[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps((const float *)xv[r] + j), lo[r]);
        j += 8;
    }
    for (int r = 0; r < R; r++) {
        const float *x = (const float *)xv[r];
        float tail = 0.0f;
        for (long t = j; t < n; t++) tail = fmaf(value_f(type, w, t), x[t], tail);
        out[r] = hsum8(_mm256_add_ps(lo[r], hi[r])) + tail;
    }
}

#define CALLF16(WR, R) for (int k = 0; k < WR; k++) rows_f(F16_W, w + k * rb, x, nb, R, out + k * TILE)
#define CALLBF16(WR, R) for (int k = 0; k < WR; k++) rows_f(BF16_W, w + k * rb, x, nb, R, out + k * TILE)
SHAPES(rf16, CALLF16)
SHAPES(rbf16, CALLBF16)
#endif

/* One stored row of n values as float32: gguf's dequantize (exact). */
static void dequant_f(int type, const uint8_t *w, long n, float *out) {
    for (long k = 0; k < n; k++) out[k] = value_f(type, w, k);
}

/* The loops of `type`, one of this family's (blocktypes.py): find_loops's case for it. */
int float_loops(int type, int portable, loops *L) {
    switch (type) {
    case F16_W: case BF16_W: L->dot = dot_f, L->dequant = dequant_f; break;
    default: return 0;
    }
#ifdef HAVE_AVX2
    if (!portable) {
        if (type == F16_W) SET_SHAPES(L, rf16);
        else SET_SHAPES(L, rbf16);
    }
#endif
    return 1;
}
