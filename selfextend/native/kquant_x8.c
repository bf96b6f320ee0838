/* The vector loops of the K-quants' 8-row interleaved forms (Q4_KX8, Q5_KX8, Q6_KX8; kquant.c holds their
 * layout, portable path and driver, mm_kx8): AVX2, one 32-bit lane per weight row, a group of 8 rows times
 * a tile of activation rows whose weight values are unpacked once for all of them, each row's integer sums
 * and float steps the portable path's (dot_k_block's), lane by lane: the stored rows' results bit for bit,
 * whatever the tile. A prompt chunk's rows go through tiles, a batched step of a few slots through one tile
 * (the weights read once for them all). What they gained over the loops before, and what was tried and not
 * kept (vpdpbusd): docs/history.md, "Kernel measurements". */
#include "kquant_x8.h"

#ifdef HAVE_AVX2
enum { K4_TILE = 4 }; /* the most activation rows a Q4_K or Q5_K tile takes */

/* Bytes ahead of its super-block the loops ask for (0: none), chosen per CPU kind when the library loads:
 * none on AMD, where the hardware's prefetcher keeps each thread's one stream in flight (one Zen 4 thread
 * from memory, the AVX2 build, 8960 x 1536, best / median GB/s of 80 calls over 3 interleaved rounds:
 * Q4_KX8 24-26 / 21-23 without, 20-28 / 17-25 at 1536, 3072 or 6144 bytes with every hint, Q6_KX8 22-27 /
 * 20-23 against 15-25 / 13-24; the AVX2 EPYC ran the stored Q4_K slower with PREFETCH_BYTES);
 * elsewhere PREFETCH_BYTES into every cache level, as chosen for the interleaved forms on a Xeon. */
static long kx8_ahead = PREFETCH_BYTES;

__attribute__((constructor)) static void kx8_ahead_here(void) {
    __builtin_cpu_init();
    kx8_ahead = __builtin_cpu_is("amd") ? 0 : PREFETCH_BYTES;
}

/* Ask for `bytes` past p + kx8_ahead (the loop unrolled: a group's super-block is 18 to 27 cache lines). */
INLINE void prefetch_group(const uint8_t *p, long bytes) {
    if (kx8_ahead == 0) return;
#pragma GCC unroll 32
    for (long o = 0; o < bytes; o += 64) __builtin_prefetch(p + kx8_ahead + o, 0, 3);
}

/* A shuffle_epi8 control that gives each 32-bit lane's bytes i0 and i1 as two 16-bit lanes, zero-extended
 * (high = 0) or in the high bytes (high = 1, a sign extension's first step). */
INLINE __m256i lane_pairs(int i0, int i1, int high) {
    uint8_t c[32];
    for (int j = 0; j < 32; j += 4) {
        c[j + high] = (uint8_t)((j & 15) + i0), c[j + 1 - high] = 0x80;
        c[j + 2 + high] = (uint8_t)((j & 15) + i1), c[j + 3 - high] = 0x80;
    }
    return _mm256_loadu_si256((const __m256i *)c);
}

INLINE __m256i load32(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* 4 activation bytes at p in every 32-bit lane. */
INLINE __m256i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* Bit `bit` of each byte moved to bit 4 (other bits left for the caller's mask). */
INLINE __m256i bit_to_4(__m256i v, int bit) {
    return bit < 4 ? _mm256_slli_epi16(v, 4 - bit) : bit > 4 ? _mm256_srli_epi16(v, bit - 4) : v;
}

/* v held in a register here (an empty asm), so that each row's int16 sums are added step by step as written:
 * gcc otherwise reassociated them, took every product of a sub-block pair first and kept them on the stack
 * (AVX2 build: 73 stack accesses a call for one row, 562 for a tile of 4, at 1.1-1.3x the one-row rate). */
#define IN_REG(v) __asm__("" : "+x"(v))

/* A group of 8 Q4_K / Q5_K rows times R activation rows into out[r * 8 + k]. Per pair of sub-blocks of 32,
 * 8 steps of 32 bytes (4 bytes of each row: 4 low nibbles, of sub-block 2c, and 4 high, of 2c + 1), each
 * times its 4 activation values broadcast, summed as int16 (Q4_K: at most 8 x 2 x 15 x 127 = 30480; Q5_K's
 * values reach 31, so 4 steps at a time) then times the rows' scales (madd) into int32; the mins against the
 * activations' sums of 32 the same way, two sub-blocks a madd. A step's weight values are unpacked once for
 * the R rows (at most 4: two int16 sums each, in the 16 registers of AVX2); each row's sums and float steps
 * are the one-row loop's, whatever R. */
INLINE void rows_k4x8(int type, const uint8_t *w, const void *const *xv, long nb, int R, float *out) {
    const long gb = 8 * (type == Q5_KX8 ? 176 : 144);
    const int qs_at = type == Q5_KX8 ? 384 : 128, steps = type == Q5_KX8 ? 4 : 8; /* int16 sums between madds */
    const __m256i m4 = _mm256_set1_epi8(0xF), low6 = _mm256_set1_epi8(0x3F), top2 = _mm256_set1_epi8(3);
    const __m256i bit4 = _mm256_set1_epi8(0x10), ones = _mm256_set1_epi16(1);
    const __m256i pick[4] = {lane_pairs(0, 0, 0), lane_pairs(1, 1, 0), lane_pairs(2, 2, 0), lane_pairs(3, 3, 0)};
    const __m256i pairs[2] = {lane_pairs(0, 1, 0), lane_pairs(2, 3, 0)};
    __m256 acc[K4_TILE], accm[K4_TILE];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps(), accm[r] = _mm256_setzero_ps();
    for (long b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * gb;
        prefetch_group(blk, gb);
        const xqk *x[K4_TILE];
        for (int r = 0; r < R; r++) x[r] = (const xqk *)xv[r] + b;
        /* the 12 scale bytes of each row as 3 words (scales_k4_words, 8 rows at once): lane k of sc[h] holds
         * row k's scales 4h..4h+3, of mn[h] its mins */
        const __m256i u0 = load32(blk + 32), u1 = load32(blk + 64), u2 = load32(blk + 96);
        const __m256i sc[2] = {_mm256_and_si256(u0, low6),
                               _mm256_or_si256(_mm256_and_si256(u2, m4), _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(u0, 6), top2), 4))};
        const __m256i mn[2] = {_mm256_and_si256(u1, low6),
                               _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(u2, 4), m4), _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(u1, 6), top2), 4))};
        __m256i sumi[K4_TILE];
        for (int r = 0; r < R; r++) sumi[r] = _mm256_setzero_si256();
#pragma GCC unroll 1
        for (int c = 0; c < 4; c++) {
            const __m128i shift = _mm_cvtsi32_si128(2 * c); /* Q5_K: the fifth bits' at 2c and 2c + 1 of qh */
            for (int s0 = 0; s0 < 8; s0 += steps) {
                __m256i lo16[K4_TILE], hi16[K4_TILE];
#pragma GCC unroll 8
                for (int s = s0; s < s0 + steps; s++) {
                    const __m256i q = load32(blk + qs_at + 32 * (8 * c + s));
                    __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
                    if (type == Q5_KX8) {
                        const __m256i h = _mm256_srl_epi16(load32(blk + 128 + 32 * s), shift);
                        lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(h, 4), bit4));
                        hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16(h, 3), bit4));
                    }
                    for (int r = 0; r < R; r++) {
                        const int8_t *xq = x[r]->q + 64 * c + 4 * s;
                        const __m256i pl = _mm256_maddubs_epi16(lo, bcast4(xq)), ph = _mm256_maddubs_epi16(hi, bcast4(xq + 32));
                        lo16[r] = s == s0 ? pl : _mm256_add_epi16(lo16[r], pl);
                        hi16[r] = s == s0 ? ph : _mm256_add_epi16(hi16[r], ph);
                        IN_REG(lo16[r]);
                        IN_REG(hi16[r]);
                    }
                }
                const __m256i s_lo = _mm256_shuffle_epi8(sc[c / 2], pick[(2 * c) % 4]);
                const __m256i s_hi = _mm256_shuffle_epi8(sc[c / 2], pick[(2 * c + 1) % 4]);
                for (int r = 0; r < R; r++)
                    sumi[r] = _mm256_add_epi32(sumi[r], _mm256_add_epi32(_mm256_madd_epi16(lo16[r], s_lo), _mm256_madd_epi16(hi16[r], s_hi)));
            }
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16)));
        /* lane k: row k's mins (2p, 2p + 1) as int16, p = 0..3 */
        const __m256i mp[4] = {_mm256_shuffle_epi8(mn[0], pairs[0]), _mm256_shuffle_epi8(mn[0], pairs[1]),
                               _mm256_shuffle_epi8(mn[1], pairs[0]), _mm256_shuffle_epi8(mn[1], pairs[1])};
        for (int r = 0; r < R; r++) {
            /* the activations' sums of 32 as int16 (at most 32 x 127), pairs (2p, 2p + 1) in 32-bit lanes
             * 0, 1 (p = 0, 1) and 4, 5 (p = 2, 3) */
            const __m256i b32 = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)x[r]->bsums), ones);
            const __m256i b16 = _mm256_packs_epi32(b32, b32);
            __m256i mins = _mm256_setzero_si256();
            for (int p = 0; p < 4; p++)
                mins = _mm256_add_epi32(mins, _mm256_madd_epi16(mp[p], _mm256_permutevar8x32_epi32(b16, _mm256_set1_epi32(p < 2 ? p : p + 2))));
            const __m256 dx = _mm256_set1_ps(x[r]->d);
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, dx), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
            accm[r] = _mm256_fmadd_ps(_mm256_mul_ps(dmin, dx), _mm256_cvtepi32_ps(mins), accm[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out + 8 * r, _mm256_sub_ps(acc[r], accm[r]));
}

/* A group of 8 Q6_K rows times R activation rows into out[r * 8 + k]. Per 4 bytes of ql (two of them, 32
 * values apart) and of qh, 4 steps of 4 values of each row (the values q6 0..63); two steps' products summed
 * as int16 (at most 2 x 2 x 63 x 127 = 32004) then times the rows' int8 scales (madd) into int32; the
 * values' offset 32 off at the end, 32 times each sub-block's scale against the activations' sums of 16.
 * Each pair of steps is unpacked once for the R rows, from bytes read again (the sums stay in registers). */
INLINE void rows_q6kx8(const uint8_t *w, const void *const *xv, long nb, int R, float *out) {
    const __m256i m4 = _mm256_set1_epi8(0xF), m30 = _mm256_set1_epi8(0x30);
    const __m256i pick[4] = {lane_pairs(0, 0, 1), lane_pairs(1, 1, 1), lane_pairs(2, 2, 1), lane_pairs(3, 3, 1)};
    const __m256i pairs[2] = {lane_pairs(0, 1, 1), lane_pairs(2, 3, 1)};
    __m256 acc[KX8_TILE];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (long b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * 1680, *v4 = blk + 128; /* the scales, then 96 bytes per 4 values */
        prefetch_group(blk, 1680);
        const xqk *x[KX8_TILE];
        for (int r = 0; r < R; r++) x[r] = (const xqk *)xv[r] + b;
        /* lane k of scale[j]: row k's scale j as two int16; of sp[p]: its scales 2p and 2p + 1 */
        __m256i scale[16], sp[8];
        for (int j = 0; j < 4; j++) {
            const __m256i word = load32(blk + 32 * j);
            for (int i = 0; i < 4; i++) scale[4 * j + i] = _mm256_srai_epi16(_mm256_shuffle_epi8(word, pick[i]), 8);
            for (int i = 0; i < 2; i++) sp[2 * j + i] = _mm256_srai_epi16(_mm256_shuffle_epi8(word, pairs[i]), 8);
        }
        __m256i sumi[KX8_TILE];
        for (int r = 0; r < R; r++) sumi[r] = _mm256_setzero_si256();
#pragma GCC unroll 1
        for (int h = 0; h < 2; h++)
#pragma GCC unroll 1
            for (int g = 0; g < 8; g += 2) { /* values 128h + 32t + 4g.. (sub-block 8h + 2t + g / 4) and 4 on */
                const uint8_t *at = v4 + 96 * (8 * h + g); /* ql 4g.., ql 32 + 4g.., qh 4g.. of half h, then 4g + 4 */
#pragma GCC unroll 4
                for (int t = 0; t < 4; t++) {
                    __m256i v[2];
                    for (int e = 0; e < 2; e++) {
                        const __m256i l = load32(at + 96 * e + (t & 1 ? 32 : 0)), hb = load32(at + 96 * e + 64);
                        const __m256i low = t & 2 ? _mm256_srli_epi16(l, 4) : l;
                        const __m256i high = t == 0 ? _mm256_slli_epi16(hb, 4) : t == 1 ? _mm256_slli_epi16(hb, 2) : t == 2 ? hb : _mm256_srli_epi16(hb, 2);
                        v[e] = _mm256_or_si256(_mm256_and_si256(low, m4), _mm256_and_si256(high, m30));
                    }
                    const __m256i s = scale[8 * h + 2 * t + g / 4];
                    for (int r = 0; r < R; r++) {
                        const int8_t *xq = x[r]->q + 128 * h + 4 * g + 32 * t;
                        __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(v[0], bcast4(xq)), _mm256_maddubs_epi16(v[1], bcast4(xq + 4)));
                        sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(p, s));
                        IN_REG(sumi[r]);
                    }
                }
            }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 1664)));
        for (int r = 0; r < R; r++) {
            __m256i corr = _mm256_setzero_si256();
            for (int p = 0; p < 8; p++) corr = _mm256_add_epi32(corr, _mm256_madd_epi16(sp[p], bcast4((const int8_t *)(x[r]->bsums + 2 * p))));
            const __m256i isum = _mm256_sub_epi32(sumi[r], _mm256_slli_epi32(corr, 5));
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(x[r]->d)), _mm256_cvtepi32_ps(isum), acc[r]);
        }
    }
    /* + 0, as the portable path's acc + accm (a -0 becomes +0 alike) */
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out + 8 * r, _mm256_add_ps(acc[r], _mm256_setzero_ps()));
}

/* Each type's tiles, [R] for R activation rows: a batched step of a few slots, a prompt chunk's tiles and
 * their remainder. Q4_K and Q5_K take up to 4 rows (their two int16 sums a row, in AVX2's 16 registers),
 * Q6_K 8 (one int32 sum a row; its values' unpacking shared by twice the rows: a 512-row chunk of 8960 x
 * 1536 1.13-1.15x the rate of tiles of 4, one Zen 4 thread, AVX2 build, 4 interleaved rounds). */
#define GROUP_FN(name, R, call) \
    static void name##_##R(const uint8_t *w, const void *const *x, long nb, float *out) { call(R); }
#define K4_TILES(name, call) \
    GROUP_FN(name, 1, call) GROUP_FN(name, 2, call) GROUP_FN(name, 3, call) GROUP_FN(name, 4, call) \
    static const group_fn name[K4_TILE + 1] = {NULL, name##_1, name##_2, name##_3, name##_4};
#define CALLK4X8(R) rows_k4x8(Q4_KX8, w, x, nb, R, out)
#define CALLK5X8(R) rows_k4x8(Q5_KX8, w, x, nb, R, out)
#define CALLQ6KX8(R) rows_q6kx8(w, x, nb, R, out)
K4_TILES(kx8_q4, CALLK4X8)
K4_TILES(kx8_q5, CALLK5X8)
GROUP_FN(kx8_q6, 1, CALLQ6KX8) GROUP_FN(kx8_q6, 2, CALLQ6KX8) GROUP_FN(kx8_q6, 3, CALLQ6KX8) GROUP_FN(kx8_q6, 4, CALLQ6KX8)
GROUP_FN(kx8_q6, 5, CALLQ6KX8) GROUP_FN(kx8_q6, 6, CALLQ6KX8) GROUP_FN(kx8_q6, 7, CALLQ6KX8) GROUP_FN(kx8_q6, 8, CALLQ6KX8)
static const group_fn kx8_q6[KX8_TILE + 1] = {NULL, kx8_q6_1, kx8_q6_2, kx8_q6_3, kx8_q6_4,
                                              kx8_q6_5, kx8_q6_6, kx8_q6_7, kx8_q6_8};

const group_fn *kquant_x8_tiles(int type, int *most) {
    *most = type == Q6_KX8 ? KX8_TILE : K4_TILE;
    return type == Q4_KX8 ? kx8_q4 : type == Q5_KX8 ? kx8_q5 : type == Q6_KX8 ? kx8_q6 : NULL;
}
#else
const group_fn *kquant_x8_tiles(int type, int *most) {
    (void)type, (void)most;
    return NULL;
}
#endif
