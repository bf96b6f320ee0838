/* The low-bit K-quants Q2_K and Q3_K: super-blocks of 256 values in 16 sub-blocks of 16, against activation
 * blocks of 256 with the sums of 16 (xqk). Value v of a super-block has its 2 low bits at bits 2 (v % 128 / 32)
 * of byte 32 (v / 128) + v % 32 of qs, and sub-block s = v / 16. Each super-block's product is an integer
 * dot product scaled by the two blocks' scales:
 *   Q2_K (84 bytes: 16 scale bytes, qs, d, dmin)  value d sc_s q - dmin m_s, sc_s and m_s the low and high
 *        nibbles of scale byte s:            d dx sum_s sc_s sum_s(q x) - dmin dx sum_s m_s sum_s(x)
 *   Q3_K (110 bytes: hmask, qs, 12 scale bytes, d)  value d (sc_s - 32) (q + 4 h - 4), h bit v / 32 of
 *        hmask byte v % 32, sc_s 6 bits (low 4 in the first 8 bytes, high 2 in the last 4):
 *                                            d dx sum_s (sc_s - 32) (sum_s((q + 4 h) x) - 4 sum_s(x))
 * The sums of x per 16 are the activation block's bsums. Paths: AVX2 (maddubs of the unsigned 2 or 3 bits
 * with x, madd with the sub-blocks' scales: int32, never saturating) and the portable one; both sum a
 * super-block's integers whole before its float steps, so they agree bit for bit. */
#include "quant.h"

/* The 16 sub-block scales (Q3_K: sc - 32; Q2_K: the low nibbles) and mins (Q2_K's high nibbles). */
INLINE void scales_low(int type, const uint8_t *blk, int *sc, int *mn) {
    if (type == Q2_K) {
        for (int s = 0; s < 16; s++) sc[s] = blk[s] & 0xF, mn[s] = blk[s] >> 4;
        return;
    }
    const uint8_t *b = blk + 96;
    for (int s = 0; s < 16; s++) {
        int lo = s < 8 ? b[s] & 0xF : b[s - 8] >> 4;
        sc[s] = (lo | ((b[8 + s % 4] >> (2 * (s / 4))) & 3) << 4) - 32;
        mn[s] = 0;
    }
}

/* The super-block's integer sums: the scaled one (Q3_K: its offset taken off) into *isum, Q2_K's mins'
 * into *msum. */
INLINE void klow_isum(int type, const uint8_t *blk, const xqk *x, int *isum, int *msum) {
    int sc[16], mn[16], s16[16] = {0};
    scales_low(type, blk, sc, mn);
    const uint8_t *qs = blk + (type == Q2_K ? 16 : 32);
    for (int v = 0; v < 256; v++) {
        int u = qs[32 * (v / 128) + v % 32] >> (2 * (v % 128 / 32)) & 3;
        if (type == Q3_K) u += 4 * ((blk[v % 32] >> (v / 32)) & 1);
        s16[v / 16] += u * x->q[v];
    }
    int is = 0, ms = 0;
    for (int s = 0; s < 16; s++) {
        is += sc[s] * (type == Q3_K ? s16[s] - 4 * x->bsums[s] : s16[s]);
        ms += mn[s] * x->bsums[s];
    }
    *isum = is, *msum = ms;
}

/* The float steps of one super-block, the same on both paths. */
INLINE void klow_step(int type, const uint8_t *blk, const xqk *x, int isum, int msum, float *acc, float *accm) {
    if (type == Q2_K) {
        *acc = fmaf(f16(blk + 80) * x->d, (float)isum, *acc);
        *accm = fmaf(f16(blk + 82) * x->d, (float)msum, *accm);
    } else {
        *acc = fmaf(f16(blk + 108) * x->d, (float)isum, *acc);
    }
}

/* One weight row (nb super-blocks) times one quantized activation row: the portable path. */
static float dot_klow(int type, const uint8_t *w, const void *xv, long nb) {
    float acc = 0.0f, accm = 0.0f;
    long bb = block_bytes(type);
    for (long b = 0; b < nb; b++) {
        int isum, msum;
        klow_isum(type, w + b * bb, (const xqk *)xv + b, &isum, &msum);
        klow_step(type, w + b * bb, (const xqk *)xv + b, isum, msum, &acc, &accm);
    }
    return acc - accm;
}

#ifdef HAVE_AVX2
/* WR weight rows (row_bytes apart) times R activation rows x[r] into out[wr * TILE + r]; `type`, WR and R
 * constants at every call. A super-block's 8 steps of 32 values (2 sub-blocks each) are unpacked once
 * for the R rows: the unsigned 2 or 3 bits, and the two sub-blocks' scales as 16-bit lanes. */
INLINE void rows_klow(int type, const uint8_t *w, long row_bytes, int WR, const void *const *xv, long nb, int R,
                      float *out) {
    const long bb = type == Q2_K ? 84 : 110;
    const __m256i m3 = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
    float acc[WR_TILE][TILE], accm[WR_TILE][TILE];
    for (int k = 0; k < WR; k++)
        for (int r = 0; r < R; r++) acc[k][r] = accm[k][r] = 0.0f;
    for (long b = 0; b < nb; b++)
        for (int k = 0; k < WR; k++) {
            const uint8_t *blk = w + k * row_bytes + b * bb;
            if (R < TILE) prefetch_ahead(blk, bb);
            int sc[16], mn[16];
            scales_low(type, blk, sc, mn);
            const uint8_t *qs = blk + (type == Q2_K ? 16 : 32);
            const __m256i hm = _mm256_loadu_si256((const __m256i *)blk);
            __m256i u[8], sv[8];
            for (int c = 0; c < 2; c++) {
                const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
                for (int j = 0; j < 4; j++) {
                    const int t = 4 * c + j;
                    u[t] = _mm256_and_si256(_mm256_srli_epi16(q, 2 * j), m3);
                    if (type == Q3_K)
                        u[t] = _mm256_or_si256(u[t], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hm, t), one), 2));
                    sv[t] = _mm256_set_m128i(_mm_set1_epi16((short)sc[2 * t + 1]), _mm_set1_epi16((short)sc[2 * t]));
                }
            }
            for (int r = 0; r < R; r++) {
                const xqk *xb = (const xqk *)xv[r] + b;
                __m256i sum = _mm256_setzero_si256();
                for (int t = 0; t < 8; t++) {
                    __m256i p = _mm256_maddubs_epi16(u[t], _mm256_loadu_si256((const __m256i *)(xb->q + 32 * t)));
                    sum = _mm256_add_epi32(sum, _mm256_madd_epi16(p, sv[t]));
                }
                __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
                s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
                s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
                int isum = _mm_cvtsi128_si32(s4), msum = 0;
                for (int s = 0; s < 16; s++) {
                    if (type == Q3_K) isum -= 4 * sc[s] * xb->bsums[s];
                    else msum += mn[s] * xb->bsums[s];
                }
                klow_step(type, blk, xb, isum, msum, &acc[k][r], &accm[k][r]);
            }
        }
    for (int k = 0; k < WR; k++)
        for (int r = 0; r < R; r++) out[k * TILE + r] = acc[k][r] - accm[k][r];
}

#define CALLQ2K(WR, R) rows_klow(Q2_K, w, rb, WR, x, nb, R, out)
#define CALLQ3K(WR, R) rows_klow(Q3_K, w, rb, WR, x, nb, R, out)
SHAPES(rq2k, CALLQ2K)
SHAPES(rq3k, CALLQ3K)
#endif

/* One stored row of nb super-blocks as float values: gguf's dequantize (d times the scale, then times q,
 * Q2_K's min taken off). */
static void dequant_klow(int type, const uint8_t *w, long nb, float *out) {
    long bb = block_bytes(type);
    for (long b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * bb, *qs = blk + (type == Q2_K ? 16 : 32);
        int sc[16], mn[16];
        scales_low(type, blk, sc, mn);
        float d = f16(blk + (type == Q2_K ? 80 : 108)), dmin = type == Q2_K ? f16(blk + 82) : 0.0f;
        for (int v = 0; v < 256; v++) {
            int q = qs[32 * (v / 128) + v % 32] >> (2 * (v % 128 / 32)) & 3;
            if (type == Q3_K) q -= 4 * (1 - ((blk[v % 32] >> (v / 32)) & 1));
            float dl = d * (float)sc[v / 16], product = dl * (float)q;
            out[256 * b + v] = type == Q2_K ? product - dmin * (float)mn[v / 16] : product;
        }
    }
}

/* The loops of `type`, one of this family's (blocktypes.py): find_loops's case for it. */
int klow_loops(int type, int portable, loops *L) {
    switch (type) {
    case Q2_K: case Q3_K: L->dot = dot_klow, L->dequant = dequant_klow; break;
    default: return 0;
    }
#ifdef HAVE_AVX2
    if (!portable) {
        if (type == Q2_K) SET_SHAPES(L, rq2k);
        else SET_SHAPES(L, rq3k);
    }
#endif
    return 1;
}
