/* The K-quants (Q4_K, Q5_K, Q6_K): super-blocks of 256 values against activation blocks of 256 with the
 * sums of 16 (xqk). Each super-block's product is an integer dot product scaled by the two blocks' scales:
 *   Q4_K, Q5_K  d dx sum_j sc_j sum(q_j q) - dmin dx sum_j m_j sum_j(q)   (8 sub-blocks of 32)
 *   Q6_K  d dx (sum_k sc_k sum(q6_k q) - 32 sum_k sc_k sum_k(q))          (16 sub-blocks of 16)
 * Paths: AVX2, AVX-512 VNNI where the compiler targets it (rows_k4_512, rows_q6k_512), the portable one.
 * Each takes one weight row at a time. */
#include "quant.h"
#include "kquant_x8.h"

/* The 8 six-bit scales and mins of a Q4_K / Q5_K super-block (llama.cpp's get_scale_min_k4). */
INLINE void scales_k4(const uint8_t *s, uint8_t *sc, uint8_t *mn) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 0xF) | ((s[j] >> 6) << 4);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
    }
}

/* The sum over sub-blocks of 32 of mn[j] times the activations' sum there. */
INLINE int mins_k(const uint8_t *mn, const xqk *x) {
    int s = 0;
    for (int j = 0; j < 8; j++) s += mn[j] * (x->bsums[2 * j] + x->bsums[2 * j + 1]);
    return s;
}

/* One super-block blk times its activation block x, added into *acc and (the mins) *accm: the portable path's
 * step, whose float operations the interleaved forms' lanes repeat. */
INLINE void dot_k_block(int type, const uint8_t *blk, const xqk *x, float *acc, float *accm) {
    int isum = 0;
    if (type == Q6_K) {
        const int8_t *sc = (const int8_t *)(blk + 192);
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = blk + 64 * h, *qh = blk + 128 + 32 * h;
            for (int t = 0; t < 4; t++) {
                for (int half = 0; half < 2; half++) {
                    int s = 0;
                    for (int l = 16 * half; l < 16 * half + 16; l++) {
                        int q = ((t & 1 ? ql[l + 32] : ql[l]) >> (t & 2 ? 4 : 0) & 0xF) | ((qh[l] >> (2 * t)) & 3) << 4;
                        s += q * x->q[128 * h + 32 * t + l];
                    }
                    isum += sc[8 * h + 2 * t + half] * s;
                }
            }
        }
        for (int k = 0; k < 16; k++) isum -= 32 * sc[k] * x->bsums[k];
        *acc = fmaf(f16(blk + 208) * x->d, (float)isum, *acc);
        return;
    }
    uint8_t sc[8], mn[8];
    scales_k4(blk + 4, sc, mn);
    const uint8_t *qh = blk + 16, *qs = blk + (type == Q5_K ? 48 : 16);
    for (int c = 0; c < 4; c++) {
        int s_lo = 0, s_hi = 0;
        for (int l = 0; l < 32; l++) {
            int lo = qs[32 * c + l] & 0xF, hi = qs[32 * c + l] >> 4;
            if (type == Q5_K) {
                lo |= ((qh[l] >> (2 * c)) & 1) << 4;
                hi |= ((qh[l] >> (2 * c + 1)) & 1) << 4;
            }
            s_lo += lo * x->q[64 * c + l];
            s_hi += hi * x->q[64 * c + 32 + l];
        }
        isum += sc[2 * c] * s_lo + sc[2 * c + 1] * s_hi;
    }
    *acc = fmaf(f16(blk) * x->d, (float)isum, *acc);
    *accm = fmaf(f16(blk + 2) * x->d, (float)mins_k(mn, x), *accm);
}

/* One weight row (nb super-blocks) times one quantized activation row: the portable path. */
static float dot_k(int type, const uint8_t *w, const void *xv, long nb) {
    float acc = 0.0f, accm = 0.0f;
    for (long b = 0; b < nb; b++) dot_k_block(type, w + b * block_bytes(type), (const xqk *)xv + b, &acc, &accm);
    return type == Q4_K || type == Q5_K ? acc - accm : acc + accm;
}

#ifdef HAVE_AVX2
/* The 8 scales (sc) and 8 mins (mn) of scales_k4, a byte each, from the 12 packed bytes s, with 32-bit
 * word operations: words 0 and 1 hold the low 6 bits of scales and mins 0-3, word 2 the low 4 bits of
 * scales and mins 4-7, whose high 2 bits are the top bits of words 0 and 1. */
INLINE void scales_k4_words(const uint8_t *s, uint64_t *sc, uint64_t *mn) {
    uint32_t u0, u1, u2;
    memcpy(&u0, s, 4);
    memcpy(&u1, s + 4, 4);
    memcpy(&u2, s + 8, 4);
    const uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, top2 = 0x03030303;
    uint32_t sc_hi = (u2 & low4) | ((u0 >> 6) & top2) << 4, mn_hi = ((u2 >> 4) & low4) | ((u1 >> 6) & top2) << 4;
    *sc = (uint64_t)(u0 & low6) | (uint64_t)sc_hi << 32;
    *mn = (uint64_t)(u1 & low6) | (uint64_t)mn_hi << 32;
}

/* The same for Q4_K and Q5_K: 8 sub-blocks of 32 per super-block, 6-bit scales and mins. */
INLINE void rows_k4(int type, const uint8_t *w, const void *const *xv, long nb, int R, float *out) {
    const __m256i m4 = _mm256_set1_epi8(0xF), one = _mm256_set1_epi8(1);
    const __m128i pairs = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    /* int16 lane 2c (bytes 4c, 4c+1) and 2c+1 of the scales, broadcast to every lane */
    const __m256i pick_lo[4] = {_mm256_set1_epi16(0x0100), _mm256_set1_epi16(0x0504), _mm256_set1_epi16(0x0908),
                                _mm256_set1_epi16(0x0d0c)};
    const __m256i pick_hi[4] = {_mm256_set1_epi16(0x0302), _mm256_set1_epi16(0x0706), _mm256_set1_epi16(0x0b0a),
                                _mm256_set1_epi16(0x0f0e)};
    __m256 acc[TILE], accm[TILE];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps(), accm[r] = _mm256_setzero_ps();
    long bb = block_bytes(type);
    for (long b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * bb, *qs = blk + (type == Q5_K ? 48 : 16);
        if (R < TILE) prefetch_ahead(blk, bb);
        uint64_t sc8, mn8;
        scales_k4_words(blk + 4, &sc8, &mn8);
        __m256i scales = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)sc8)));
        __m256i sumi[TILE];
        for (int r = 0; r < R; r++) sumi[r] = _mm256_setzero_si256();
        __m256i qh = type == Q5_K ? _mm256_loadu_si256((const __m256i *)(blk + 16)) : _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {
            __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
            __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
            if (type == Q5_K) {
                __m256i bits = _mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * c));
                lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(bits, one), 4));
                hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(bits, 1), one), 4));
            }
            __m256i s_lo = _mm256_shuffle_epi8(scales, pick_lo[c]), s_hi = _mm256_shuffle_epi8(scales, pick_hi[c]);
            for (int r = 0; r < R; r++) {
                const int8_t *xq = ((const xqk *)xv[r] + b)->q + 64 * c;
                __m256i p_lo = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)xq)), s_lo);
                __m256i p_hi = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(xq + 32))), s_hi);
                sumi[r] = _mm256_add_epi32(sumi[r], _mm256_add_epi32(p_lo, p_hi));
            }
        }
        float d = f16(blk), dmin = f16(blk + 2);
        /* each sub-block's min twice, against the activations' two sums of 16 there */
        __m256i mins = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(_mm_cvtsi64_si128((long long)mn8), pairs));
        for (int r = 0; r < R; r++) {
            const xqk *x = (const xqk *)xv[r] + b;
            __m256i m = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)x->bsums), mins);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * x->d), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
            accm[r] = _mm256_fmadd_ps(_mm256_set1_ps(dmin * x->d), _mm256_cvtepi32_ps(m), accm[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum8(acc[r]) - hsum8(accm[r]);
}

/* The same for Q6_K: 16 sub-blocks of 16 with int8 scales, values q6 - 32. */
INLINE void rows_q6k(const uint8_t *w, const void *const *xv, long nb, int R, float *out) {
    const __m256i m4 = _mm256_set1_epi8(0xF), m3 = _mm256_set1_epi8(3), m30 = _mm256_set1_epi8(0x30);
    /* for sub-block pair t of a half: int16 scale 2t in the low 128 bits' lanes, 2t + 1 in the high ones */
    __m256i pick[4];
    for (int t = 0; t < 4; t++)
        pick[t] = _mm256_set_m128i(_mm_set1_epi16((short)((4 * t + 2) | (4 * t + 3) << 8)),
                                   _mm_set1_epi16((short)((4 * t) | (4 * t + 1) << 8)));
    __m256 acc[TILE];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (long b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * 210;
        if (R < TILE) prefetch_ahead(blk, 210);
        const int8_t *sc = (const int8_t *)(blk + 192);
        __m256i scales = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc));
        __m256i halves[2] = {_mm256_permute2x128_si256(scales, scales, 0x00),
                             _mm256_permute2x128_si256(scales, scales, 0x11)};
        __m256i sumi[TILE];
        for (int r = 0; r < R; r++) sumi[r] = _mm256_setzero_si256();
        for (int h = 0; h < 2; h++) {
            __m256i q0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h));
            __m256i q1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32));
            __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
            __m256i v[4] = {
                _mm256_or_si256(_mm256_and_si256(q0, m4), _mm256_slli_epi16(_mm256_and_si256(qh, m3), 4)),
                _mm256_or_si256(_mm256_and_si256(q1, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q0, 4), m4), _mm256_and_si256(qh, m30)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q1, 4), m4), _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30)),
            };
            for (int t = 0; t < 4; t++) {
                __m256i s = _mm256_shuffle_epi8(halves[h], pick[t]); /* scales 8h + 2t and 8h + 2t + 1 */
                for (int r = 0; r < R; r++) {
                    const int8_t *xq = ((const xqk *)xv[r] + b)->q + 128 * h + 32 * t;
                    __m256i p = _mm256_maddubs_epi16(v[t], _mm256_loadu_si256((const __m256i *)xq));
                    sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(p, s));
                }
            }
        }
        float d = f16(blk + 208);
        for (int r = 0; r < R; r++) {
            const xqk *x = (const xqk *)xv[r] + b;
            __m256i corr = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)x->bsums), scales);
            __m256i s = _mm256_sub_epi32(sumi[r], _mm256_slli_epi32(corr, 5)); /* the values' offset 32 */
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * x->d), _mm256_cvtepi32_ps(s), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum8(acc[r]);
}

#ifdef HAVE_AVX512
/* rows_k4 and rows_q6k with AVX-512 VNNI, where the vector work per activation row, not the multiplies, set
 * the rate (on one 512-bit integer multiply port, 64 bytes a cycle either way): 64 weight values (two or
 * four sub-blocks) a step, each row's sums of 4 products (vpdpbusd) times their sub-block's scale added
 * into 16 int32 lanes at once (vpdpwssd on the sums' low int16 halves, the scale's high half 0: a sum of 4
 * fits int16, at most 4 x 63 x 127), and each block's float step on those 16 lanes. The same integers as
 * the AVX2 loops, summed in 16 float lanes instead of 8. */
INLINE __m512i scaled_sums(__m512i sums, __m512i v, const int8_t *x, __m512i scale) {
    __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v, _mm512_loadu_si512(x));
    return _mm512_dpwssd_epi32(sums, p, scale);
}

INLINE float hsum16(__m512 v) {
    return hsum8(_mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))));
}

INLINE void rows_k4_512(int type, const uint8_t *w, const void *const *xv, long nb, int R, float *out) {
    const __m512i m4 = _mm512_set1_epi8(0xF), one = _mm512_set1_epi8(1);
    __m512i pick[4]; /* lanes 0-7: sub-block 2c's scale (the step's low 32 values), 8-15: 2c + 1's */
    for (int c = 0; c < 4; c++) pick[c] = _mm512_inserti64x4(_mm512_set1_epi32(2 * c), _mm256_set1_epi32(2 * c + 1), 1);
    __m512 acc[TILE];
    __m256 accm[TILE];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps(), accm[r] = _mm256_setzero_ps();
    long bb = block_bytes(type);
    for (long b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * bb, *qs = blk + (type == Q5_K ? 48 : 16);
        prefetch_ahead(blk, bb);
        uint64_t sc8, mn8;
        scales_k4_words(blk + 4, &sc8, &mn8);
        const __m512i sc32 = _mm512_castsi256_si512(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)sc8)));
        __m256i qh = type == Q5_K ? _mm256_loadu_si256((const __m256i *)(blk + 16)) : _mm256_setzero_si256();
        __m512i sums[TILE];
        for (int r = 0; r < R; r++) sums[r] = _mm512_setzero_si512();
        for (int c = 0; c < 4; c++) {
            __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
            __m512i v = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(q), _mm256_srli_epi16(q, 4), 1), m4);
            if (type == Q5_K) {
                __m256i bits = _mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * c));
                __m512i hb = _mm512_inserti64x4(_mm512_castsi256_si512(bits), _mm256_srli_epi16(bits, 1), 1);
                v = _mm512_or_si512(v, _mm512_slli_epi16(_mm512_and_si512(hb, one), 4));
            }
            __m512i scale = _mm512_permutexvar_epi32(pick[c], sc32);
            for (int r = 0; r < R; r++) sums[r] = scaled_sums(sums[r], v, ((const xqk *)xv[r] + b)->q + 64 * c, scale);
        }
        const __m512 d = _mm512_set1_ps(f16(blk));
        /* the sub-blocks' mins times dmin, against each activation row's d times its sums of 32 there */
        const __m256 mins = _mm256_mul_ps(_mm256_set1_ps(f16(blk + 2)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)mn8))));
        for (int r = 0; r < R; r++) {
            const xqk *x = (const xqk *)xv[r] + b;
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(x->d)), _mm512_cvtepi32_ps(sums[r]), acc[r]);
            accm[r] = _mm256_fmadd_ps(mins, _mm256_loadu_ps(x->dsums), accm[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum16(acc[r]) - hsum8(accm[r]);
}

INLINE void rows_q6k_512(const uint8_t *w, const void *const *xv, long nb, int R, float *out) {
    const __m512i m4 = _mm512_set1_epi8(0xF), m30 = _mm512_set1_epi8(0x30);
    __m512i pick[4]; /* step s (32 h + 16 t'): lanes 4j..4j+3 take sub-block 4s + j's scale */
    for (int s = 0; s < 4; s++)
        pick[s] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_setr_epi32(4 * s, 4 * s, 4 * s, 4 * s, 4 * s + 1, 4 * s + 1, 4 * s + 1, 4 * s + 1)),
                                     _mm256_setr_epi32(4 * s + 2, 4 * s + 2, 4 * s + 2, 4 * s + 2, 4 * s + 3, 4 * s + 3, 4 * s + 3, 4 * s + 3), 1);
    __m512 acc[TILE];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (long b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * 210;
        prefetch_ahead(blk, 210);
        const __m128i sc = _mm_loadu_si128((const __m128i *)(blk + 192));
        const __m512i sc32 = _mm512_and_si512(_mm512_cvtepi8_epi32(sc), _mm512_set1_epi32(0xFFFF)); /* high half 0 */
        /* the values' offset 32 first: each sub-block's scale times -32 against its activations' sum */
        const __m256i offset = _mm256_slli_epi16(_mm256_sub_epi16(_mm256_setzero_si256(), _mm256_cvtepi8_epi16(sc)), 5);
        __m512i sums[TILE];
        for (int r = 0; r < R; r++)
            sums[r] = _mm512_zextsi256_si512(_mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)((const xqk *)xv[r] + b)->bsums), offset));
        for (int h = 0; h < 2; h++) {
            /* values 64h.. (q0, q1) and 64h + 32.. of the half; low 4 bits from q0 | q1, high 2 from qh */
            __m512i q = _mm512_loadu_si512(blk + 64 * h);
            __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
            __m512i hi01 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_slli_epi16(qh, 4)), _mm256_slli_epi16(qh, 2), 1);
            __m512i hi23 = _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 2), 1);
            __m512i v[2] = {_mm512_or_si512(_mm512_and_si512(q, m4), _mm512_and_si512(hi01, m30)),
                            _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(q, 4), m4), _mm512_and_si512(hi23, m30))};
            for (int t = 0; t < 2; t++) {
                __m512i scale = _mm512_permutexvar_epi32(pick[2 * h + t], sc32);
                for (int r = 0; r < R; r++) sums[r] = scaled_sums(sums[r], v[t], ((const xqk *)xv[r] + b)->q + 128 * h + 64 * t, scale);
            }
        }
        const __m512 d = _mm512_set1_ps(f16(blk + 208));
        for (int r = 0; r < R; r++) {
            const xqk *x = (const xqk *)xv[r] + b;
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(x->d)), _mm512_cvtepi32_ps(sums[r]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum16(acc[r]);
}
#define ROWS_K4 rows_k4_512
#define ROWS_Q6K rows_q6k_512
#else
#define ROWS_K4 rows_k4
#define ROWS_Q6K rows_q6k
#endif

#define CALLK4(WR, R) for (int k = 0; k < WR; k++) ROWS_K4(Q4_K, w + k * rb, x, nb, R, out + k * TILE)
#define CALLK5(WR, R) for (int k = 0; k < WR; k++) ROWS_K4(Q5_K, w + k * rb, x, nb, R, out + k * TILE)
#define CALLQ6K(WR, R) for (int k = 0; k < WR; k++) ROWS_Q6K(w + k * rb, x, nb, R, out + k * TILE)
SHAPES(rq4k, CALLK4)
SHAPES(rq5k, CALLK5)
SHAPES(rq6k, CALLQ6K)
#endif

/* One stored row of nb super-blocks of `type` as float values: gguf's dequantize. */
static void dequant_k(int type, const uint8_t *w, long nb, float *out) {
    long bb = block_bytes(type);
    for (long b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * bb;
        float *o = out + 256 * b;
        if (type == Q6_K) {
            const int8_t *sc = (const int8_t *)(blk + 192);
            float d = f16(blk + 208);
            for (int h = 0; h < 2; h++) {
                const uint8_t *qh = blk + 128 + 32 * h;
                for (int t = 0; t < 4; t++) {
                    const uint8_t *ql = blk + 64 * h + (t & 1 ? 32 : 0);
                    const int shift = t & 2 ? 4 : 0;
                    for (int half = 0; half < 2; half++) {
                        const float s = d * (float)sc[8 * h + 2 * t + half];
                        for (int l = 16 * half; l < 16 * half + 16; l++) {
                            int q = (ql[l] >> shift & 0xF) | ((qh[l] >> (2 * t)) & 3) << 4;
                            o[128 * h + 32 * t + l] = s * (float)(q - 32);
                        }
                    }
                }
            }
            continue;
        }
        uint8_t sc[8], mn[8];
        scales_k4(blk + 4, sc, mn);
        float d = f16(blk), dmin = f16(blk + 2);
        const uint8_t *qh = blk + 16, *qs = blk + (type == Q5_K ? 48 : 16);
        for (int c = 0; c < 4; c++) {
            float d_lo = d * sc[2 * c], d_hi = d * sc[2 * c + 1], m_lo = dmin * mn[2 * c], m_hi = dmin * mn[2 * c + 1];
            for (int l = 0; l < 32; l++) {
                int lo = qs[32 * c + l] & 0xF, hi = qs[32 * c + l] >> 4;
                if (type == Q5_K) {
                    lo |= ((qh[l] >> (2 * c)) & 1) << 4;
                    hi |= ((qh[l] >> (2 * c + 1)) & 1) << 4;
                }
                o[64 * c + l] = d_lo * (float)lo - m_lo;
                o[64 * c + 32 + l] = d_hi * (float)hi - m_hi;
            }
        }
    }
}

/* The 8-row interleaved forms (Q4_KX8, Q5_KX8, Q6_KX8: blocks.py's pack8), the same bytes rearranged: per
 * group of 8 weight rows and super-block, pieces of the stored block in turn (kx8_piece), each as the 8
 * rows' words of 4 bytes (a float16 scale's 2) side by side: word w of row k at 8 o + 8 z w + z k, o the
 * bytes of the pieces before it and z the word's size. Q4_K and Q5_K's pieces are their fields in stored
 * order; Q6_K's are in the order its loop reads them (scales, then per 4 values of each half the two ql
 * words and the qh word, then d): a group's super-block is read front to back (in the stored fields' order
 * it ran at half the rate from memory, 8 against 20 GB/s on an EPYC, as fast from the cache). One 32-byte
 * load then holds the same 4 bytes of each of the 8 rows (lane k: row k): an integer product's lanes are
 * rows, each row's integer sums end in its own lane, and a super-block's float steps are the portable
 * path's (dot_k_block's), lane by lane, so the results are dot_k's bit for bit. Why: the stored form's
 * AVX2 loops take about 1.2 (Q6_K) to 1.9 (Q4_K) times the instructions per weight byte (each sub-block's
 * scale shuffled in per row, each super-block's sums kept in the 8 lanes of one row); llama.cpp repacks the
 * K-quants for the same reason (its q4_K_8x8); the measurements: docs/history.md, "Kernel measurements". */
#define KBASE(type) ((type) - Q4_KX8 + Q4_K) /* the stored type of an interleaved form */
static const short K4_PIECES[2][6][2] = { /* (offset, bytes) of Q4_K's and Q5_K's pieces; {0, 0} ends */
    {{0, 2}, {2, 2}, {4, 12}, {16, 128}},            /* d, dmin, scales, qs */
    {{0, 2}, {2, 2}, {4, 12}, {16, 32}, {48, 128}}, /* d, dmin, scales, qh, qs */
};

/* Piece i of a stored block of `base` (blocks.py's PIECES): its offset and bytes (0 past the last). */
INLINE int kx8_piece(int base, int i, int *at) {
    if (base != Q6_K) {
        *at = K4_PIECES[base - Q4_K][i][0];
        return K4_PIECES[base - Q4_K][i][1];
    }
    if (i == 0 || i > 48) {
        *at = i == 0 ? 192 : 208;
        return i == 0 ? 16 : i == 49 ? 2 : 0;
    }
    int h = (i - 1) / 24, g = (i - 1) / 3 % 8, e = (i - 1) % 3; /* ql 4g.., ql 32 + 4g.., qh 4g.. of half h */
    *at = e < 2 ? 64 * h + 32 * e + 4 * g : 128 + 32 * h + 4 * g;
    return 4;
}

/* Row k's stored super-block (out, block_bytes(KBASE(type)) bytes) from a group's super-block blk. */
static void kx8_block(int type, const uint8_t *blk, int k, uint8_t *out) {
    int at, size;
    for (int i = 0, o = 0; (size = kx8_piece(KBASE(type), i, &at)) != 0; i++, o += size) {
        const int z = size < 4 ? size : 4;
        for (int w = 0; w < size / z; w++) memcpy(out + at + z * w, blk + 8 * o + 8 * z * w + z * k, z);
    }
}

/* A group of 8 rows (nb super-blocks) times one quantized activation row into out[0..8]: the portable path,
 * each row's super-blocks put back together for dot_k_block. */
static void kx8_scalar(int type, const uint8_t *w, const xqk *x, long nb, float *out) {
    const int base = KBASE(type);
    const long gb = 8 * block_bytes(base);
    uint8_t blk[256];
    for (int k = 0; k < 8; k++) {
        float acc = 0.0f, accm = 0.0f;
        for (long b = 0; b < nb; b++) {
            kx8_block(type, w + b * gb, k, blk);
            dot_k_block(base, blk, x + b, &acc, &accm);
        }
        out[k] = base == Q6_K ? acc + accm : acc - accm;
    }
}

/* The 8 rows of a group as float values into out[k * 256 nb ...]: gguf's dequantize. */
static void dequant_kx8(int type, const uint8_t *w, long nb, float *out) {
    const int base = KBASE(type);
    const long gb = 8 * block_bytes(base);
    uint8_t blk[256];
    for (long b = 0; b < nb; b++)
        for (int k = 0; k < 8; k++) {
            kx8_block(type, w + b * gb, k, blk);
            dequant_k(base, blk, 1, out + k * 256 * nb + 256 * b);
        }
}

/* quant_mm for the interleaved forms: groups of 8 weight rows per task, each tile of quantized rows xq at
 * once (the weights read once for all of them): up to kquant_x8.c's rows per tile on the vector path. */
static void mm_kx8(int type, const uint8_t *w, long n_out, long nb, const char *xq, long m, void *y, int y_type,
                   int portable) {
    long groups = n_out / 8, group_bytes = nb * block_bytes(type) * 8, xrow = nb * (long)sizeof(xqk);
    long tasks = tasks_of(groups, group_bytes, m), per = (groups + tasks - 1) / tasks;
    int tile = KX8_TILE;
    const group_fn *fns = portable ? NULL : kquant_x8_tiles(type, &tile);
#pragma omp parallel for schedule(static)
    for (long t = 0; t < tasks; t++) {
        long g_end = (t + 1) * per < groups ? (t + 1) * per : groups;
        for (long i = 0; i < m; i += tile) {
            int R = m - i < tile ? (int)(m - i) : tile;
            const void *xs[KX8_TILE];
            for (int r = 0; r < R; r++) xs[r] = xq + (i + r) * xrow;
            for (long g = t * per; g < g_end; g++) {
                const uint8_t *wg = w + g * group_bytes;
                float out[8 * KX8_TILE];
                if (fns == NULL)
                    for (int r = 0; r < R; r++) kx8_scalar(type, wg, (const xqk *)xs[r], nb, out + 8 * r);
                else fns[R](wg, xs, nb, out);
                for (int r = 0; r < R; r++)
                    for (int k = 0; k < 8; k++) {
                        long at = (i + r) * n_out + 8 * g + k;
                        if (y_type == F32) ((float *)y)[at] = out[8 * r + k];
                        else ((uint16_t *)y)[at] = to_bf16(out[8 * r + k]);
                    }
            }
        }
    }
}

/* Whether the stored rows' loops run faster than the interleaved form's here (quant_interleaves): the
 * AVX-512 VNNI ones on an Intel CPU (measured on a Xeon, the interleaved form not timed there: kept). On
 * the AVX2 build, and on AMD's AVX-512 (Zen 4: 512-bit steps in two 256-bit halves), the interleaved form's
 * AVX2 loops are faster: one EPYC (Zen 4) thread, 256 x 1536 rows from the cache, one activation row, GB/s
 * of weights stored -> interleaved, AVX2 build: Q4_K 16 -> 21, Q5_K 16 -> 19-21, Q6_K 16-18 -> 22;
 * AVX-512 build: 15-16 -> 18-21, 15-16 -> 23, 14-18 -> 22-23 (min of 3000 calls, rounds interleaved). */
static int stored_faster(void) {
#ifdef HAVE_AVX512
    __builtin_cpu_init();
    return !__builtin_cpu_is("amd");
#else
    return 0;
#endif
}

/* The loops of `type`, one of this family's (blocktypes.py): find_loops's case for it. */
int kquant_loops(int type, int portable, loops *L) {
    if (type == Q4_KX8 || type == Q5_KX8 || type == Q6_KX8) {
        L->mm = mm_kx8, L->dequant = dequant_kx8;
        return 1;
    }
    if (type != Q4_K && type != Q5_K && type != Q6_K) return 0;
    L->dot = dot_k;
    L->dequant = dequant_k;
    L->stored_faster = stored_faster();
#ifdef HAVE_AVX2
    if (!portable) {
        switch (type) {
        case Q4_K: SET_SHAPES(L, rq4k); break;
        case Q5_K: SET_SHAPES(L, rq5k); break;
        case Q6_K: SET_SHAPES(L, rq6k); break;
        }
    }
#endif
    return 1;
}
