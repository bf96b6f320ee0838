/* F16 and BF16 weight rows held as stored (F16_W, BF16_W: gguf's F16 and BF16, a "block" of one value),
 * against float32 activation rows (ACT_F32): the product is the float product of the file's own values,
 * with no int8 rounding of the activations, so an F16 or BF16 file keeps its precision (int8 activation
 * blocks would add their half-step error on top of weights stored to 11 or 8 bits).
 * Each row's product sums in 8 float32 lanes (values k = l mod 8 in lane l, one fused multiply-add each),
 * then adds the lanes in a fixed order (quant.h's hsum8) and the tail of n mod 8 values one after another:
 * the same float operations on the vector path (AVX2 with F16C) and the portable one, so the two agree bit
 * for bit, and every tile shape repeats them, so a row's result does not depend on the batch. */
#include "quant.h"

/* Value k of a weight row of `type` as float32 (exact: both widen without rounding). */
INLINE float value_f(int type, const uint8_t *w, long k) {
    if (type == F16_W) return f16(w + 2 * k);
    uint32_t u = (uint32_t)((const uint16_t *)w)[k] << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* hsum8's order: lanes l and l + 4, then those pairs 0 + 2 and 1 + 3, then the two. */
INLINE float sum8(const float *lane) {
    float a0 = lane[0] + lane[4], a1 = lane[1] + lane[5], a2 = lane[2] + lane[6], a3 = lane[3] + lane[7];
    return (a0 + a2) + (a1 + a3);
}

/* One weight row of n values times one float32 activation row: the portable path. */
static float dot_f(int type, const uint8_t *w, const void *xv, long n) {
    const float *x = (const float *)xv;
    float lane[8] = {0}, tail = 0.0f;
    long k = 0;
    for (; k + 8 <= n; k += 8)
        for (int l = 0; l < 8; l++) lane[l] = fmaf(value_f(type, w, k + l), x[k + l], lane[l]);
    for (; k < n; k++) tail = fmaf(value_f(type, w, k), x[k], tail);
    return sum8(lane) + tail;
}

#ifdef HAVE_AVX2
/* 8 values of a weight row from p (F16: cvtph; BF16: the 16 bits moved to a float32's top). */
INLINE __m256 load8(int type, const uint8_t *p) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (type == F16_W) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* WR weight rows (row_bytes apart) times R activation rows x[r] into out[wr * TILE + r], `type`, WR and R
 * constants at every call: each 8 weight values loaded once for the R rows, each 8 activations once for
 * the WR weight rows. */
INLINE void rows_f(int type, const uint8_t *w, long row_bytes, int WR, const void *const *xv, long n, int R,
                   float *out) {
    __m256 acc[WR_TILE][TILE];
    for (int k = 0; k < WR; k++)
        for (int r = 0; r < R; r++) acc[k][r] = _mm256_setzero_ps();
    long j = 0;
    for (; j + 8 <= n; j += 8) {
        __m256 wv[WR_TILE];
        for (int k = 0; k < WR; k++) {
            const uint8_t *p = w + k * row_bytes + 2 * j;
            if (R < TILE && (j & 31) == 0) prefetch_ahead(p, 64);
            wv[k] = load8(type, p);
        }
        for (int r = 0; r < R; r++) {
            __m256 xs = _mm256_loadu_ps((const float *)xv[r] + j);
            for (int k = 0; k < WR; k++) acc[k][r] = _mm256_fmadd_ps(wv[k], xs, acc[k][r]);
        }
    }
    for (int k = 0; k < WR; k++)
        for (int r = 0; r < R; r++) {
            const float *x = (const float *)xv[r];
            float tail = 0.0f;
            for (long t = j; t < n; t++) tail = fmaf(value_f(type, w + k * row_bytes, t), x[t], tail);
            out[k * TILE + r] = hsum8(acc[k][r]) + tail;
        }
}

#define CALLF16(WR, R) rows_f(F16_W, w, rb, WR, x, nb, R, out)
#define CALLBF16(WR, R) rows_f(BF16_W, w, rb, WR, x, nb, R, out)
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
