/* The non-linear 4-bit formats IQ4_NL and IQ4_XS: each 4-bit index picks one of 16 int8 values (KVALUES,
 * denser near 0), times a scale.
 *   IQ4_NL  blocks of 32 (18 bytes: d, 16 bytes of indices), against activation blocks of 32 (xq32):
 *           d dx sum(kv q)
 *   IQ4_XS  super-blocks of 256 (136 bytes: d, the 8 sub-blocks' 6-bit scales as 2 high bits in a uint16
 *           and 4 low bits in 4 bytes, 128 bytes of indices), against activation blocks of 256 (xqk):
 *           d dx sum_j (ls_j - 32) sum_j(kv q), the integer sums exact in int32
 * In a block of 32 values the low nibble of byte j indexes value j, the high one value j + 16 (as Q4_0).
 * Paths: AVX2 (a byte shuffle looks the 16 values up for 32 indices at once; |kv| times x carrying kv's
 * sign, maddubs never saturating: 2 x 127 x 127 < 32768) and the portable scalar one. IQ4_XS sums a
 * super-block's integers whole before its one float step, on both paths alike: they agree bit for bit. */
#include "quant.h"

static const int8_t KVALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

/* Sub-block j's scale of an IQ4_XS super-block, ls - 32 (-32..31). */
INLINE int xs_scale(const uint8_t *blk, int j) {
    uint16_t h;
    memcpy(&h, blk + 2, 2);
    return (((blk[4 + j / 2] >> (4 * (j % 2))) & 0xF) | ((h >> (2 * j)) & 3) << 4) - 32;
}

/* sum(kv q) of 32 values: 16 index bytes qs against 32 activations q. */
INLINE int dot_nl32(const uint8_t *qs, const int8_t *q) {
    int s = 0;
    for (int k = 0; k < 16; k++) s += KVALUES[qs[k] & 0xF] * q[k] + KVALUES[qs[k] >> 4] * q[k + 16];
    return s;
}

/* The integer sum of one IQ4_XS super-block with its activation block. */
INLINE int xs_isum(const uint8_t *blk, const xqk *x) {
    int isum = 0;
    for (int j = 0; j < 8; j++) isum += xs_scale(blk, j) * dot_nl32(blk + 8 + 16 * j, x->q + 32 * j);
    return isum;
}

/* One weight row (nb blocks) times one quantized activation row: the portable path. */
static float dot_iq(int type, const uint8_t *w, const void *xv, long nb) {
    float acc = 0.0f;
    for (long b = 0; b < nb; b++) {
        if (type == IQ4_NL) {
            const uint8_t *blk = w + 18 * b;
            const xq32 *x = (const xq32 *)xv + b;
            acc = fmaf(f16(blk) * x->d, (float)dot_nl32(blk + 2, x->q), acc);
        } else {
            const uint8_t *blk = w + 136 * b;
            const xqk *x = (const xqk *)xv + b;
            acc = fmaf(f16(blk) * x->d, (float)xs_isum(blk, x), acc);
        }
    }
    return acc;
}

#ifdef HAVE_AVX2
/* 32 values' kv from 16 index bytes at p (value j: low nibble of byte j, value j + 16: its high one). */
INLINE __m256i lookup32(const uint8_t *p) {
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)KVALUES));
    __m128i q = _mm_loadu_si128((const __m128i *)p);
    __m256i idx = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), _mm256_set1_epi8(0xF));
    return _mm256_shuffle_epi8(table, idx);
}

/* 8 int32 sums of kv x q (|kv| times q carrying kv's sign). */
INLINE __m256i dot_kv(__m256i kv, __m256i q) { return dot_u8s8(_mm256_sign_epi8(kv, kv), _mm256_sign_epi8(q, kv)); }

/* WR weight rows (row_bytes apart) times R activation rows x[r] into out[wr * TILE + r]; `type`, WR and R
 * constants at every call. IQ4_NL: 8 float lanes a block (as legacy.c's rows32); IQ4_XS: a super-block's
 * int32 lanes, then their sum, then the portable path's float step. */
INLINE void rows_iq(int type, const uint8_t *w, long row_bytes, int WR, const void *const *xv, long nb, int R,
                    float *out) {
    __m256 acc[WR_TILE][TILE];
    float accs[WR_TILE][TILE];
    for (int k = 0; k < WR; k++)
        for (int r = 0; r < R; r++) acc[k][r] = _mm256_setzero_ps(), accs[k][r] = 0.0f;
    for (long b = 0; b < nb; b++) {
        if (type == IQ4_NL) {
            __m256i kv[WR_TILE];
            __m256 d[WR_TILE];
            for (int k = 0; k < WR; k++) {
                const uint8_t *blk = w + k * row_bytes + 18 * b;
                if (R < TILE) prefetch_ahead(blk, 18);
                d[k] = _mm256_set1_ps(f16(blk));
                kv[k] = lookup32(blk + 2);
            }
            for (int r = 0; r < R; r++) {
                const xq32 *xb = (const xq32 *)xv[r] + b;
                __m256i xs = _mm256_loadu_si256((const __m256i *)xb->q);
                __m256 dx = _mm256_broadcast_ss(&xb->d);
                for (int k = 0; k < WR; k++)
                    acc[k][r] = _mm256_fmadd_ps(dx, _mm256_mul_ps(_mm256_cvtepi32_ps(dot_kv(kv[k], xs)), d[k]), acc[k][r]);
            }
            continue;
        }
        for (int k = 0; k < WR; k++) {
            const uint8_t *blk = w + k * row_bytes + 136 * b;
            if (R < TILE) prefetch_ahead(blk, 136);
            __m256i kv[8], sc[8];
            for (int j = 0; j < 8; j++) kv[j] = lookup32(blk + 8 + 16 * j), sc[j] = _mm256_set1_epi32(xs_scale(blk, j));
            for (int r = 0; r < R; r++) {
                const xqk *xb = (const xqk *)xv[r] + b;
                __m256i sum = _mm256_setzero_si256();
                for (int j = 0; j < 8; j++) {
                    __m256i p = dot_kv(kv[j], _mm256_loadu_si256((const __m256i *)(xb->q + 32 * j)));
                    sum = _mm256_add_epi32(sum, _mm256_mullo_epi32(p, sc[j]));
                }
                __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
                s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
                s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
                accs[k][r] = fmaf(f16(blk) * xb->d, (float)_mm_cvtsi128_si32(s4), accs[k][r]);
            }
        }
    }
    for (int k = 0; k < WR; k++)
        for (int r = 0; r < R; r++) out[k * TILE + r] = type == IQ4_NL ? hsum8(acc[k][r]) : accs[k][r];
}

#define CALLNL(WR, R) rows_iq(IQ4_NL, w, rb, WR, x, nb, R, out)
#define CALLXS(WR, R) rows_iq(IQ4_XS, w, rb, WR, x, nb, R, out)
SHAPES(rnl, CALLNL)
SHAPES(rxs, CALLXS)
#endif

/* One stored row of nb blocks as float values: gguf's dequantize (d times the scale, then times kv). */
static void dequant_iq(int type, const uint8_t *w, long nb, float *out) {
    for (long b = 0; b < nb; b++) {
        if (type == IQ4_NL) {
            const uint8_t *blk = w + 18 * b;
            float d = f16(blk), *o = out + 32 * b;
            for (int k = 0; k < 16; k++) o[k] = d * KVALUES[blk[2 + k] & 0xF], o[k + 16] = d * KVALUES[blk[2 + k] >> 4];
            continue;
        }
        const uint8_t *blk = w + 136 * b;
        for (int j = 0; j < 8; j++) {
            float dl = f16(blk) * (float)xs_scale(blk, j), *o = out + 256 * b + 32 * j;
            const uint8_t *qs = blk + 8 + 16 * j;
            for (int k = 0; k < 16; k++) o[k] = dl * KVALUES[qs[k] & 0xF], o[k + 16] = dl * KVALUES[qs[k] >> 4];
        }
    }
}

/* The loops of `type`, one of this family's (blocktypes.py): find_loops's case for it. */
int iq_loops(int type, int portable, loops *L) {
    switch (type) {
    case IQ4_NL: case IQ4_XS: L->dot = dot_iq, L->dequant = dequant_iq; break;
    default: return 0;
    }
#ifdef HAVE_AVX2
    if (!portable) {
        if (type == IQ4_NL) SET_SHAPES(L, rnl);
        else SET_SHAPES(L, rxs);
    }
#endif
    return 1;
}
