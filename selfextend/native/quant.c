/* Products of activation rows with a GGUF tensor's quantized blocks, read as the file stores them.
 *
 * quant_mm: y[m, n_out] = x[m, n_in] . W^T, W the raw blocks of one GGUF tensor (n_out rows, each
 * n_in / block_values blocks; types Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K). As llama.cpp does, each
 * activation row is quantized once per call to int8 (per 32 values with the sum of the 32 for the
 * 32-value block formats, Q8_0-style; per 256 with sums per 16 for the K-quants, Q8_K-style: d =
 * max|x| / 127, q = rint(x / d)), then each block's product is an integer dot product scaled by the two
 * blocks' float scales:
 *   Q4_0  d dx (sum(nib q) - 8 sum(q))           Q4_1  d dx sum(nib q) + m dx sum(q)
 *   Q5_0  d dx (sum(q5 q) - 16 sum(q))           Q8_0  d dx sum(w q)
 *   Q4_K, Q5_K  d dx sum_j sc_j sum(q_j q) - dmin dx sum_j m_j sum_j(q)   (8 sub-blocks of 32)
 *   Q6_K  d dx (sum_k sc_k sum(q6_k q) - 32 sum_k sc_k sum_k(q))          (16 sub-blocks of 16)
 * The integer parts are exact, so only the float steps (one fused multiply-add per block and row, a fixed
 * horizontal sum) set the rounding, and they are the same for every row whatever the call's row count:
 * a row's result does not depend on the batch (activation rows are tiled by TILE and weight rows by
 * WR_TILE for reuse, and a tile's accumulators each see the same instructions as a single row's; 2 or 3
 * rows take tiles of their own, so that the weights are read once for all; the 8-row interleaved forms take 3
 * rows as a tile that repeats its last one). A decode step (fewer than TILE
 * activation rows: one sequence, or a few slots' batched step) reads its weight rows one after another,
 * DECODE_ROWS per task: several rows read side by side are as many streams from memory, which ran at half
 * the rate (Q8_0: 6 GB/s against 11.5 on one core).
 * Q4_0, Q4_1 and Q8_0 also come in an 8-row interleaved form (Q4_0X8, Q4_1X8, Q8_0X8, blocks.py's pack8)
 * whose vector lanes are 8 weight rows: the same integer sums, one float step per block and row.
 *
 * Paths: AVX2 (maddubs + madd; the 32-value formats' u8 x s8 dot as AVX-512 VNNI / AVX-VNNI dpbusd where
 * the compiler targets them: the same sums, maddubs never saturates on these ranges), AVX-512 VNNI for the
 * K-quants where the compiler targets it (rows_k4_512, rows_q6k_512), and a portable
 * scalar path (`portable`), also used where AVX2 is missing. Threads: OpenMP over output rows (torch's
 * own libgomp); a row's reduction over n_in is never split. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define HAVE_AVX512 1
#endif
#endif

#define INLINE static inline __attribute__((always_inline))

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, Q4_0X8 = 1002, Q4_1X8 = 1003, Q8_0X8 = 1008 };
#define IS_X8(type) ((type) == Q4_0X8 || (type) == Q4_1X8 || (type) == Q8_0X8)
enum { F32 = 0, BF16 = 1 };
enum { TILE = 4, WR_TILE = 2, DECODE_ROWS = 4, WEIGHT_TILE_BYTES = 65536 };

/* A product asks for the weight bytes PREFETCH_BYTES ahead of the block it reads: the hardware prefetcher
 * alone kept too few reads of one thread's stream in flight (measured on a 2-core EPYC, 8192x2048 from
 * memory, 2 threads, one activation row: Q4_K 12 -> 15.5 GB/s, Q6_K 13 -> 15.5). The AVX-512 K-quant loops
 * and the interleaved forms ask at every tile size (on a 2-core AVX-512 Xeon the server's batched step of
 * 2-4 rows ran 1.1-1.5x faster for it, 8192x2048 Q4_K x 4 rows 1.11-1.17 -> 0.97-1.00 ms, Q6_K x 2 rows
 * 1.16 -> 0.78-0.84, and 64 rows no slower: experiments/speed/row_products.py --activations 2,4,64 --against the
 * source without it);
 * the AVX2 loops below TILE rows only (their tiles of 4 ran 5-15% slower with it there). */
enum { PREFETCH_BYTES = 3072 };

typedef struct { float d, s; int32_t sum; int8_t q[32]; } xq32;      /* an activation block, 32 values; s = d sum */
/* and 256 values (K-quants), with the sums of 16 and each 32's sum times d (rows_k4_512's mins) */
typedef struct { float d; int16_t bsums[16]; float dsums[8]; int8_t q[256]; } xqk;

/* Values and bytes per block of `type`; 0 for a type not computed here. */
static long block_values(int type) {
    if (IS_X8(type)) type -= 1000;
    return type == Q4_K || type == Q5_K || type == Q6_K ? 256 : (type == Q4_0 || type == Q4_1 || type == Q5_0 || type == Q8_0) ? 32 : 0;
}

static long block_bytes(int type) {
    if (IS_X8(type)) type -= 1000;
    switch (type) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q8_0: return 34;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    default: return 0;
    }
}

/* Ask for the cache lines of `bytes` weight bytes PREFETCH_BYTES past p, into every cache level. The
 * non-temporal hint (prefetchnta) kept a Xeon's streams at 11-12 GB/s where this one reads 17-18 (2-core
 * Xeon with AVX-512, 2 threads, from memory: Q8_0x8 65536x2048 11 -> 17-18 GB/s, Q4_K 12 -> 16-18;
 * `experiments/speed/row_products.py --against`, rounds interleaved). */
INLINE void prefetch_ahead(const uint8_t *p, long bytes) {
    for (long o = 0; o < bytes; o += 64) __builtin_prefetch(p + PREFETCH_BYTES + o, 0, 3);
}

INLINE float f16(const uint8_t *p) {
    _Float16 h;
    memcpy(&h, p, 2);
    return (float)h;
}

INLINE float load_x(const void *x, int type, long i) {
    if (type == F32) return ((const float *)x)[i];
    uint32_t u = (uint32_t)((const uint16_t *)x)[i] << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* float32 -> bfloat16 rounded to nearest even, NaN kept a NaN (as torch rounds). */
INLINE uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if (f != f) return 0x7FC0;
    return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

/* `n` values from x[at...] quantized to int8 with d = max|x| / 127 into q; returns d. */
INLINE float quantize_block(const void *x, int type, long at, int n, int8_t *q) {
    float amax = 0.0f;
    for (int k = 0; k < n; k++) {
        float a = fabsf(load_x(x, type, at + k));
        amax = a > amax ? a : amax; /* fmaxf's result (a NaN skipped), without its call */
    }
    float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    for (int k = 0; k < n; k++) q[k] = (int8_t)nearbyintf(load_x(x, type, at + k) * id);
    return d;
}

static void quantize_row(const void *x, int type, long n, int k_quant, void *out) {
    if (!k_quant) {
        for (long b = 0; b < n / 32; b++) {
            xq32 *o = (xq32 *)out + b;
            o->d = quantize_block(x, type, 32 * b, 32, o->q);
            int s = 0;
            for (int k = 0; k < 32; k++) s += o->q[k];
            o->sum = s;
            o->s = o->d * (float)s;
        }
        return;
    }
    for (long b = 0; b < n / 256; b++) {
        xqk *o = (xqk *)out + b;
        o->d = quantize_block(x, type, 256 * b, 256, o->q);
        for (int g = 0; g < 16; g++) {
            int s = 0;
            for (int k = 0; k < 16; k++) s += o->q[16 * g + k];
            o->bsums[g] = (int16_t)s;
        }
        for (int j = 0; j < 8; j++) o->dsums[j] = o->d * (float)(o->bsums[2 * j] + o->bsums[2 * j + 1]);
    }
}

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

/* One weight row (nb blocks) times one quantized activation row: the portable path. */
static float dot_scalar(int type, const uint8_t *w, const void *xv, long nb) {
    float acc = 0.0f, accm = 0.0f;
    long bb = block_bytes(type);
    for (long b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * bb;
        if (block_values(type) == 32) {
            const xq32 *x = (const xq32 *)xv + b;
            int isum = 0;
            if (type == Q8_0) {
                for (int k = 0; k < 32; k++) isum += ((const int8_t *)blk + 2)[k] * x->q[k];
            } else {
                const uint8_t *qs = blk + (type == Q4_0 ? 2 : type == Q4_1 ? 4 : 6);
                uint32_t qh = 0;
                if (type == Q5_0) memcpy(&qh, blk + 2, 4);
                for (int k = 0; k < 16; k++) {
                    int lo = (qs[k] & 0xF) | (int)((qh >> k) & 1) << 4;
                    int hi = (qs[k] >> 4) | (int)((qh >> (k + 16)) & 1) << 4;
                    isum += lo * x->q[k] + hi * x->q[k + 16];
                }
                if (type != Q4_1) isum -= (type == Q4_0 ? 8 : 16) * x->sum;
            }
            acc = fmaf(f16(blk) * x->d, (float)isum, acc);
            if (type == Q4_1) accm = fmaf(f16(blk + 2), x->s, accm);
            continue;
        }
        const xqk *x = (const xqk *)xv + b;
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
            acc = fmaf(f16(blk + 208) * x->d, (float)isum, acc);
            continue;
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
        acc = fmaf(f16(blk) * x->d, (float)isum, acc);
        accm = fmaf(f16(blk + 2) * x->d, (float)mins_k(mn, x), accm);
    }
    return type == Q4_K || type == Q5_K ? acc - accm : acc + accm;
}

/* The 8-row interleaved forms (Q4_0X8, Q4_1X8, Q8_0X8: blocks.py's pack8): per group of 8 weight rows and
 * block of 32 values, the 8 rows' d (float16), Q4_1's 8 m, then 128 bytes where byte 16 s + 4 k + i holds
 * value 4 s + i of row k in its low nibble and of row 4 + k in its high one (Q8_0: 256 bytes, byte
 * 32 s + 4 k + i value 4 s + i of row k). One 32-byte load (after unpacking) then holds 4 values of each of
 * the 8 rows (lane k: row k), and a product's 8 lanes are 8 outputs. */
INLINE int x8_value(int type, const uint8_t *qs, int row, int j) {
    if (type == Q8_0X8) return (int8_t)qs[32 * (j / 4) + 4 * row + j % 4];
    uint8_t byte = qs[16 * (j / 4) + 4 * (row % 4) + j % 4];
    return row < 4 ? byte & 0xF : byte >> 4;
}

/* The 8 rows of a group (nb blocks) times one quantized activation row into out[0..8]: the portable path,
 * the same float operations per row as the vector one (whose lanes are the rows). */
static void x8_scalar(int type, const uint8_t *w, const xq32 *x, long nb, float *out) {
    long bb = 8 * block_bytes(type);
    const int head = type == Q4_1X8 ? 32 : 16;
    for (int k = 0; k < 8; k++) {
        float acc = 0.0f, accm = 0.0f;
        for (long b = 0; b < nb; b++) {
            const uint8_t *blk = w + b * bb;
            int isum = 0;
            for (int j = 0; j < 32; j++) isum += x8_value(type, blk + head, k, j) * x[b].q[j];
            if (type == Q4_0X8) isum -= 8 * x[b].sum;
            acc = fmaf(f16(blk + 2 * k) * x[b].d, (float)isum, acc);
            if (type == Q4_1X8) accm = fmaf(f16(blk + 16 + 2 * k), x[b].s, accm);
        }
        out[k] = acc + accm;
    }
}

#ifdef HAVE_AVX2
INLINE float hsum8(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    a = _mm_add_ss(a, _mm_movehdup_ps(a));
    return _mm_cvtss_f32(a);
}

/* 8 int32 sums of 4 products u8 x s8 each (bytes 4k..4k+3 into lane k). */
INLINE __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

/* Byte k of the result 0xFF where bit k of the 32 bits at p is set (llama.cpp's bytes_from_bits_32). */
INLINE __m256i bits_to_bytes(const uint8_t *p) {
    uint32_t x32;
    memcpy(&x32, p, 4);
    const __m256i shuffle = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)x32), shuffle);
    bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    return _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1));
}

/* WR weight rows (w, w + row_bytes, ...) times R activation rows x[r], the 32-value block formats, into
 * out[wr * TILE + r]; `type`, WR and R constants at every call, so each format and tile shape gets its own
 * loop with the accumulators in registers. A weight block is unpacked once for the R rows and an
 * activation block loaded once for the WR weight rows. Q4_0 and Q5_0 take their offset (8, 16) off the
 * weights and multiply |w| by x carrying w's sign (the integer sums are those of the offset taken off the
 * sums); Q4_1 adds m times the activation block's d sum. Every accumulator sees the same instructions
 * whatever WR and R are, so a product does not depend on the tile it was computed in. */
INLINE void rows32(int type, const uint8_t *w, long row_bytes, int WR, const void *const *xv, long nb, int R,
                   float *out) {
    const __m256i m4 = _mm256_set1_epi8(0xF);
    const __m256i offset = _mm256_set1_epi8(type == Q4_0 ? 8 : 16);
    const xq32 *x[TILE];
    __m256 acc[WR_TILE][TILE];
    float accm[WR_TILE][TILE];
    for (int r = 0; r < R; r++) x[r] = (const xq32 *)xv[r];
    for (int k = 0; k < WR; k++)
        for (int r = 0; r < R; r++) acc[k][r] = _mm256_setzero_ps(), accm[k][r] = 0.0f;
    const long bb = type == Q4_0 ? 18 : type == Q4_1 ? 20 : type == Q5_0 ? 22 : 34;
    for (long b = 0; b < nb; b++) {
        __m256 d[WR_TILE];
        __m256i u[WR_TILE], sw[WR_TILE]; /* the weights as unsigned bytes (|w| where signed); w, whose sign x takes */
        float m[WR_TILE];
        for (int k = 0; k < WR; k++) {
            const uint8_t *blk = w + k * row_bytes + b * bb;
            if (R < TILE) prefetch_ahead(blk, bb);
            d[k] = _mm256_set1_ps(f16(blk));
            m[k] = type == Q4_1 ? f16(blk + 2) : 0.0f;
            if (type == Q8_0) {
                sw[k] = _mm256_loadu_si256((const __m256i *)(blk + 2));
                u[k] = _mm256_sign_epi8(sw[k], sw[k]);
            } else {
                __m128i q = _mm_loadu_si128((const __m128i *)(blk + (type == Q4_0 ? 2 : type == Q4_1 ? 4 : 6)));
                u[k] = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), m4);
                if (type == Q5_0) u[k] = _mm256_or_si256(u[k], _mm256_and_si256(bits_to_bytes(blk + 2), _mm256_set1_epi8(0x10)));
                sw[k] = _mm256_sub_epi8(u[k], offset);
                if (type != Q4_1) u[k] = _mm256_sign_epi8(sw[k], sw[k]);
            }
        }
        for (int r = 0; r < R; r++) {
            const xq32 *xb = x[r] + b;
            __m256i xs = _mm256_loadu_si256((const __m256i *)xb->q);
            __m256 dx = _mm256_broadcast_ss(&xb->d);
            for (int k = 0; k < WR; k++) {
                __m256i p = dot_u8s8(u[k], type == Q4_1 ? xs : _mm256_sign_epi8(xs, sw[k]));
                acc[k][r] = _mm256_fmadd_ps(dx, _mm256_mul_ps(_mm256_cvtepi32_ps(p), d[k]), acc[k][r]);
                if (type == Q4_1) accm[k][r] = fmaf(m[k], xb->s, accm[k][r]);
            }
        }
    }
    for (int k = 0; k < WR; k++)
        for (int r = 0; r < R; r++) out[k * TILE + r] = hsum8(acc[k][r]) + accm[k][r];
}

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

/* A group of 8 interleaved weight rows times R activation rows x[r] into out[r * 8 + k]. Per block: the
 * 8 unpacked 32-byte steps (4 values of each row) times each row's 4 activation values broadcast, summed
 * as int16 (at most 8 x 2 x 15 x 127 = 30480) and once to int32, then scaled by the 8 rows' d at once.
 * Q8_0: |w| times x carrying w's sign, each step widened to int32 (a step alone reaches 2 x 128 x 127). */
INLINE void rows_x8(int type, const uint8_t *w, const void *const *xv, long nb, int R, float *out) {
    const __m256i m4 = _mm256_set1_epi8(0xF), ones = _mm256_set1_epi16(1);
    const long bb = type == Q4_0X8 ? 144 : type == Q4_1X8 ? 160 : 272;
    const int head = type == Q4_1X8 ? 32 : 16;
    __m256 acc[TILE], accm[TILE];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps(), accm[r] = _mm256_setzero_ps();
    for (long b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * bb;
        prefetch_ahead(blk, bb);
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        const __m256 m = type == Q4_1X8 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16))) : d;
        __m256i u[8];
        if (type != Q8_0X8)
            for (int s = 0; s < 8; s++) {
                __m128i q = _mm_loadu_si128((const __m128i *)(blk + head + 16 * s));
                u[s] = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), m4);
            }
        for (int r = 0; r < R; r++) {
            const xq32 *xb = (const xq32 *)xv[r] + b;
            int32_t xi[8];
            memcpy(xi, xb->q, 32);
            __m256i p = _mm256_setzero_si256();
            if (type == Q8_0X8) {
                for (int s = 0; s < 8; s++) {
                    __m256i w8 = _mm256_loadu_si256((const __m256i *)(blk + head + 32 * s));
                    __m256i prod = _mm256_maddubs_epi16(_mm256_sign_epi8(w8, w8), _mm256_sign_epi8(_mm256_set1_epi32(xi[s]), w8));
                    p = _mm256_add_epi32(p, _mm256_madd_epi16(prod, ones));
                }
            } else {
                __m256i s16 = _mm256_setzero_si256();
                for (int s = 0; s < 8; s++) s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(u[s], _mm256_set1_epi32(xi[s])));
                p = _mm256_madd_epi16(s16, ones);
            }
            if (type == Q4_0X8) p = _mm256_sub_epi32(p, _mm256_set1_epi32(8 * xb->sum));
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_broadcast_ss(&xb->d)), _mm256_cvtepi32_ps(p), acc[r]);
            if (type == Q4_1X8) accm[r] = _mm256_fmadd_ps(m, _mm256_broadcast_ss(&xb->s), accm[r]);
        }
    }
    /* acc + accm for both types (+0 for Q4_0, as the portable path's acc + 0.0f: -0 becomes +0 alike) */
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out + 8 * r, _mm256_add_ps(acc[r], accm[r]));
}

static void x8_q40_1(const uint8_t *w, const void *const *x, long nb, float *out) { rows_x8(Q4_0X8, w, x, nb, 1, out); }
static void x8_q40_t(const uint8_t *w, const void *const *x, long nb, float *out) { rows_x8(Q4_0X8, w, x, nb, TILE, out); }
static void x8_q41_1(const uint8_t *w, const void *const *x, long nb, float *out) { rows_x8(Q4_1X8, w, x, nb, 1, out); }
static void x8_q41_t(const uint8_t *w, const void *const *x, long nb, float *out) { rows_x8(Q4_1X8, w, x, nb, TILE, out); }
static void x8_q80_1(const uint8_t *w, const void *const *x, long nb, float *out) { rows_x8(Q8_0X8, w, x, nb, 1, out); }
static void x8_q80_t(const uint8_t *w, const void *const *x, long nb, float *out) { rows_x8(Q8_0X8, w, x, nb, TILE, out); }

/* Each format's tile shapes: (weight rows, activation rows) = (1, 1) for a decode step, (1, 2) and (1, 3)
 * for a batched one of a few slots (or a chunk's last rows), (1, TILE) and (WR_TILE, TILE) for a chunk; the
 * K-quants take one weight row at a time. */
#define SHAPES(name, call)                                                                                   \
    static void name##_1x1(const uint8_t *w, long rb, const void *const *x, long nb, float *out) { call(1, 1); } \
    static void name##_1x2(const uint8_t *w, long rb, const void *const *x, long nb, float *out) { call(1, 2); } \
    static void name##_1x3(const uint8_t *w, long rb, const void *const *x, long nb, float *out) { call(1, 3); } \
    static void name##_1xt(const uint8_t *w, long rb, const void *const *x, long nb, float *out) { call(1, TILE); } \
    static void name##_wxt(const uint8_t *w, long rb, const void *const *x, long nb, float *out) { call(WR_TILE, TILE); }
#define CALLQ40(WR, R) rows32(Q4_0, w, rb, WR, x, nb, R, out)
#define CALLQ41(WR, R) rows32(Q4_1, w, rb, WR, x, nb, R, out)
#define CALLQ50(WR, R) rows32(Q5_0, w, rb, WR, x, nb, R, out)
#define CALLQ80(WR, R) rows32(Q8_0, w, rb, WR, x, nb, R, out)
#define CALLK4(WR, R) for (int k = 0; k < WR; k++) ROWS_K4(Q4_K, w + k * rb, x, nb, R, out + k * TILE)
#define CALLK5(WR, R) for (int k = 0; k < WR; k++) ROWS_K4(Q5_K, w + k * rb, x, nb, R, out + k * TILE)
#define CALLQ6K(WR, R) for (int k = 0; k < WR; k++) ROWS_Q6K(w + k * rb, x, nb, R, out + k * TILE)
SHAPES(rq40, CALLQ40)
SHAPES(rq41, CALLQ41)
SHAPES(rq50, CALLQ50)
SHAPES(rq80, CALLQ80)
SHAPES(rq4k, CALLK4)
SHAPES(rq5k, CALLK5)
SHAPES(rq6k, CALLQ6K)
#endif

/* A tile shape's product: weight rows from w (row_bytes apart) times activation rows x[r] into
 * out[weight row * TILE + activation row]. */
typedef void (*tile_fn)(const uint8_t *, long, const void *const *, long, float *);

/* Results out[k * TILE + r] of weight rows j.. and activation rows i.. into y (m, n_out). */
static void store(void *y, int y_type, long n_out, long i, long j, const float *out, int wr, int R) {
    for (int k = 0; k < wr; k++)
        for (int r = 0; r < R; r++) {
            long at = (i + r) * n_out + j + k;
            if (y_type == F32) ((float *)y)[at] = out[k * TILE + r];
            else ((uint16_t *)y)[at] = to_bf16(out[k * TILE + r]);
        }
}

/* How many tasks to split `units` (weight rows or groups of `unit_bytes` each) into: one per unit for a few
 * activation rows, else units of about WEIGHT_TILE_BYTES per task, rounded up to a multiple of the threads
 * so that each thread gets an even share. */
static long tasks_of(long units, long unit_bytes, long m) {
    if (m < TILE) return units;
    long threads = omp_get_max_threads(), most = WEIGHT_TILE_BYTES / unit_bytes;
    long tasks = (units + (most > 1 ? most : 1) - 1) / (most > 1 ? most : 1);
    tasks = (tasks + threads - 1) / threads * threads;
    return tasks < units ? tasks : units;
}

/* quant_mm for the 8-row interleaved forms: groups of 8 weight rows per task, quantized rows xq. */
static void mm_x8(int type, const uint8_t *w, long n_out, long nb, const char *xq, long m, void *y, int y_type,
                  int portable) {
    long groups = n_out / 8, group_bytes = nb * block_bytes(type) * 8, xrow = nb * (long)sizeof(xq32);
    long tasks = tasks_of(groups, group_bytes, m), per = (groups + tasks - 1) / tasks;
    void (*one)(const uint8_t *, const void *const *, long, float *) = NULL, (*tile)(const uint8_t *, const void *const *, long, float *) = NULL;
#ifdef HAVE_AVX2
    if (!portable) {
        one = type == Q4_0X8 ? x8_q40_1 : type == Q4_1X8 ? x8_q41_1 : x8_q80_1;
        tile = type == Q4_0X8 ? x8_q40_t : type == Q4_1X8 ? x8_q41_t : x8_q80_t;
    }
#endif
#pragma omp parallel for schedule(static)
    for (long t = 0; t < tasks; t++) {
        long g_end = (t + 1) * per < groups ? (t + 1) * per : groups;
        for (long i = 0; i < m; i += TILE) {
            int R = m - i < TILE ? (int)(m - i) : TILE;
            const void *xs[TILE];
            for (int r = 0; r < TILE; r++) xs[r] = xq + (i + (r < R ? r : R - 1)) * xrow; /* a short tile: its last row again */
            for (long g = t * per; g < g_end; g++) {
                const uint8_t *wg = w + g * group_bytes;
                float out[8 * TILE];
                if (one == NULL)
                    for (int r = 0; r < R; r++) x8_scalar(type, wg, (const xq32 *)xs[r], nb, out + 8 * r);
                else if (R > 2) tile(wg, xs, nb, out); /* 3 rows: cheaper as a tile; 2: one pass each (measured) */
                else
                    for (int r = 0; r < R; r++) one(wg, &xs[r], nb, out + 8 * r);
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

/* y (m, n_out; float32 or bfloat16 by y_type) = x (m, n_in; float32 or bfloat16 by x_type) . W^T, W of
 * `type` as rows of raw GGUF blocks. Returns 0, 1 where scratch memory could not be had, 2 for a type or
 * size it does not take. */
int quant_mm(int type, const uint8_t *w, long n_out, long n_in, const void *x, int x_type, long m, void *y,
             int y_type, int portable) {
    long bv = block_values(type), bb = block_bytes(type);
    if (bv == 0 || n_in % bv != 0 || m < 0 || n_out < 0) return 2;
    if (IS_X8(type) && n_out % 8 != 0) return 2;
    int k_quant = bv == 256;
    long nb = n_in / bv, row_bytes = nb * bb;
    long xrow = k_quant ? nb * (long)sizeof(xqk) : nb * (long)sizeof(xq32);
    char *xq = malloc(m * xrow + 1);
    if (xq == NULL) return 1;
    long x_size = x_type == F32 ? 4 : 2;
#pragma omp parallel for schedule(static) if (m > 1)
    for (long i = 0; i < m; i++) quantize_row((const char *)x + i * n_in * x_size, x_type, n_in, k_quant, xq + i * xrow);
    if (IS_X8(type)) {
        mm_x8(type, w, n_out, nb, xq, m, y, y_type, portable);
        free(xq);
        return 0;
    }
    tile_fn f1t = NULL, fwt = NULL, few[TILE] = {NULL}; /* few[R]: R < TILE activation rows */
#ifdef HAVE_AVX2
#define PICK(name) few[1] = name##_1x1, few[2] = name##_1x2, few[3] = name##_1x3, f1t = name##_1xt, fwt = name##_wxt
    if (!portable) {
        switch (type) {
        case Q4_0: PICK(rq40); break;
        case Q4_1: PICK(rq41); break;
        case Q5_0: PICK(rq50); break;
        case Q8_0: PICK(rq80); break;
        case Q4_K: PICK(rq4k); break;
        case Q5_K: PICK(rq5k); break;
        default: PICK(rq6k);
        }
    }
#undef PICK
#endif
    /* weight rows per task: DECODE_ROWS for a few activation rows, else at most about 64 KiB of them (read from
     * the cache for every tile of activation rows), as many tasks as a multiple of the threads */
    long jb = DECODE_ROWS;
    if (m >= TILE) {
        long share = tasks_of(n_out, row_bytes, m);
        jb = ((n_out + share - 1) / share + WR_TILE - 1) / WR_TILE * WR_TILE;
    }
    long tasks = (n_out + jb - 1) / jb;
#pragma omp parallel for schedule(static)
    for (long t = 0; t < tasks; t++) {
        long j0 = t * jb, j_end = j0 + jb < n_out ? j0 + jb : n_out;
        for (long i = 0; i < m; i += TILE) {
            int R = m - i < TILE ? (int)(m - i) : TILE;
            const void *xs[TILE];
            for (int r = 0; r < R; r++) xs[r] = xq + (i + r) * xrow;
            float out[WR_TILE * TILE];
            if (few[1] == NULL) {
                for (long j = j0; j < j_end; j++) {
                    for (int r = 0; r < R; r++) out[r] = dot_scalar(type, w + j * row_bytes, xs[r], nb);
                    store(y, y_type, n_out, i, j, out, 1, R);
                }
            } else if (R == TILE) {
                long j = j0;
                for (; j + WR_TILE <= j_end; j += WR_TILE) {
                    fwt(w + j * row_bytes, row_bytes, xs, nb, out);
                    store(y, y_type, n_out, i, j, out, WR_TILE, TILE);
                }
                for (; j < j_end; j++) {
                    f1t(w + j * row_bytes, row_bytes, xs, nb, out);
                    store(y, y_type, n_out, i, j, out, 1, TILE);
                }
            } else { /* one row, or a few read together: the weights read once for all of them */
                for (long j = j0; j < j_end; j++) {
                    few[R](w + j * row_bytes, row_bytes, xs, nb, out);
                    store(y, y_type, n_out, i, j, out, 1, R);
                }
            }
        }
    }
    free(xq);
    return 0;
}

/* One stored row of nb blocks of `type` (not an interleaved form) as float values: gguf's dequantize. */
static void dequant_row(int type, const uint8_t *w, long nb, float *out) {
    long bb = block_bytes(type);
    for (long b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * bb;
        if (block_values(type) == 32) {
            float *o = out + 32 * b, d = f16(blk);
            if (type == Q8_0) {
                for (int k = 0; k < 32; k++) o[k] = d * (float)((const int8_t *)blk + 2)[k];
                continue;
            }
            const uint8_t *qs = blk + (type == Q4_0 ? 2 : type == Q4_1 ? 4 : 6);
            uint32_t qh = 0;
            if (type == Q5_0) memcpy(&qh, blk + 2, 4);
            int shift = type == Q4_0 ? 8 : type == Q5_0 ? 16 : 0;
            float m = type == Q4_1 ? f16(blk + 2) : 0.0f;
            for (int k = 0; k < 16; k++) {
                int lo = (qs[k] & 0xF) | (int)((qh >> k) & 1) << 4;
                int hi = (qs[k] >> 4) | (int)((qh >> (k + 16)) & 1) << 4;
                o[k] = d * (float)(lo - shift) + m;
                o[k + 16] = d * (float)(hi - shift) + m;
            }
            continue;
        }
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

/* The 8 rows of an interleaved group (nb blocks) as float values into out[k * 32 nb ...]. */
static void dequant_x8(int type, const uint8_t *w, long nb, float *out) {
    long bb = 8 * block_bytes(type), n_in = 32 * nb;
    const int head = type == Q4_1X8 ? 32 : 16, shift = type == Q4_0X8 ? 8 : 0;
    for (long b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * bb, *qs = blk + head;
        float d[8], m[8];
        for (int k = 0; k < 8; k++) {
            d[k] = f16(blk + 2 * k);
            m[k] = type == Q4_1X8 ? f16(blk + 16 + 2 * k) : 0.0f;
        }
        for (int s = 0; s < 8; s++) /* the bytes in stored order (x8_value's layout) */
            for (int k = 0; k < (type == Q8_0X8 ? 8 : 4); k++)
                for (int i = 0; i < 4; i++) {
                    long at = 32 * b + 4 * s + i;
                    if (type == Q8_0X8) {
                        out[k * n_in + at] = d[k] * (float)(int8_t)qs[32 * s + 4 * k + i];
                        continue;
                    }
                    uint8_t byte = qs[16 * s + 4 * k + i];
                    out[k * n_in + at] = d[k] * (float)((byte & 0xF) - shift) + m[k];
                    out[(k + 4) * n_in + at] = d[k + 4] * (float)((byte >> 4) - shift) + m[k + 4];
                }
    }
}

/* y (n_out, n_in) bfloat16 = the weight rows W of `type` (stored or interleaved) dequantized, for a prefill
 * chunk's product through a bf16 matrix engine (AMX by oneDNN). Returns 0, 1 where scratch memory could not
 * be had, 2 for a type or size it does not take. */
int quant_dequant_bf16(int type, const uint8_t *w, long n_out, long n_in, uint16_t *y) {
    long bv = block_values(type), bb = block_bytes(type);
    if (bv == 0 || n_in % bv != 0 || n_out < 0) return 2;
    if (IS_X8(type) && n_out % 8 != 0) return 2;
    long nb = n_in / bv, rows = IS_X8(type) ? 8 : 1, units = n_out / rows, unit_bytes = nb * bb * rows;
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        float *f = malloc(rows * n_in * sizeof(float));
        if (f == NULL) failed = 1;
#pragma omp for schedule(static)
        for (long u = 0; u < units; u++) {
            if (f == NULL) continue; /* every thread meets the loop; the call fails as a whole */
            if (rows == 8) dequant_x8(type, w + u * unit_bytes, nb, f);
            else dequant_row(type, w + u * unit_bytes, nb, f);
            uint16_t *o = y + u * rows * n_in;
            for (long k = 0; k < rows * n_in; k++) o[k] = to_bf16(f[k]);
        }
        free(f);
    }
    return failed;
}

/* y (n, n_in) float32 = rows ids[0..n) of the stored rows W of `type` (row_bytes apart), gguf's dequantized
 * values: an embedding table held as its blocks, looked up a few rows a token. Returns 2 for a type or size
 * it does not take (an interleaved form among them: its rows are not stored one after another). */
int quant_rows_f32(int type, const uint8_t *w, long row_bytes, const int64_t *ids, long n, long n_in, float *y) {
    long bv = block_values(type);
    if (bv == 0 || IS_X8(type) || n_in % bv != 0 || n < 0 || row_bytes != n_in / bv * block_bytes(type)) return 2;
#pragma omp parallel for schedule(static) if (n > 64)
    for (long i = 0; i < n; i++) dequant_row(type, w + ids[i] * row_bytes, n_in / bv, y + i * n_in);
    return 0;
}
