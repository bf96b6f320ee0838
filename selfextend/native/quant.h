/* What the block families' sources (legacy.c, kquant.c, ...) and the driver (quant.c) share: the activation
 * blocks each row is quantized to, the threading's task split, small loads and conversions, the AVX2
 * helpers, and `loops`, the functions a family gives the driver for one of its types. The types themselves
 * (codes, block shapes, which family) come from blocktypes.h, generated at build from blocktypes.py. */
#ifndef SELFEXTEND_QUANT_H
#define SELFEXTEND_QUANT_H
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

/* How a type's product takes the activation rows (blocktypes.py's ACTIVATIONS): int8 blocks of 32 with
 * their sum (xq32: llama.cpp's Q8_0 and Q8_1 blocks, d and s = d sum float16 values) or of 256 with the sums
 * of 16 (xqk: its Q8_K blocks, d = max / -127 for the signed max), quant.c's quantize_row; or the row as
 * float32 (F16 and BF16 weights, float.c). */
enum { ACT_Q8_32 = 0, ACT_Q8_K = 1, ACT_F32 = 2 };
typedef struct { float d, s; int32_t sum; int8_t q[32]; } xq32;      /* an activation block, 32 values; s = d sum */
/* and 256 values (K-quants), with the sums of 16 and each 32's sum times d (rows_k4_512's mins) */
typedef struct { float d; int16_t bsums[16]; float dsums[8]; int8_t q[256]; } xqk;

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


/* How many tasks to split `units` (weight rows or groups of `unit_bytes` each) into: one per unit for a few
 * activation rows, else units of about WEIGHT_TILE_BYTES per task, rounded up to a multiple of the threads
 * so that each thread gets an even share. */
INLINE long tasks_of(long units, long unit_bytes, long m) {
    if (m < TILE) return units;
    long threads = omp_get_max_threads(), most = WEIGHT_TILE_BYTES / unit_bytes;
    long tasks = (units + (most > 1 ? most : 1) - 1) / (most > 1 ? most : 1);
    tasks = (tasks + threads - 1) / threads * threads;
    return tasks < units ? tasks : units;
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
#endif

/* A tile shape's product: weight rows from w (row_bytes apart) times activation rows x[r] into
 * out[weight row * TILE + activation row]. */
typedef void (*tile_fn)(const uint8_t *, long, const void *const *, long, float *);

/* A family's loops for one type (find_loops fills them; NULL where it has none):
 * dot      the portable path: one weight row (nb blocks) times one quantized activation row;
 * few[R]   the vector path for R < TILE activation rows (one weight row), f1t and fwt for a tile of TILE
 *          (one and WR_TILE weight rows): tile_fn, out[weight row * TILE + activation row];
 * mm       a form with a driver of its own (the 8-row interleaved ones: groups of 8 weight rows);
 * dequant  one stored row (an interleaved form: a group of 8 rows) as float values, gguf's dequantize;
 * row      an interleaved form's row `lane` of a group as dequant gives it, alone (rows.c's lookups; where
 *          NULL, they dequantize the whole group);
 * stored_faster  1 where a type with an interleaved form runs faster as stored on this build and CPU. */
typedef struct {
    float (*dot)(int type, const uint8_t *w, const void *x, long nb);
    tile_fn few[TILE], f1t, fwt;
    void (*mm)(int type, const uint8_t *w, long n_out, long nb, const char *xq, long m, void *y, int y_type,
               int portable);
    void (*dequant)(int type, const uint8_t *w, long nb, float *out);
    void (*row)(int type, const uint8_t *w, long nb, int lane, float *out);
    int stored_faster;
} loops;

/* Each format's tile shapes: (weight rows, activation rows) = (1, 1) for a decode step, (1, 2) and (1, 3)
 * for a batched one of a few slots (or a chunk's last rows), (1, TILE) and (WR_TILE, TILE) for a chunk; the
 * K-quants take one weight row at a time. */
#define SHAPES(name, call)                                                                                   \
    static void name##_1x1(const uint8_t *w, long rb, const void *const *x, long nb, float *out) { call(1, 1); } \
    static void name##_1x2(const uint8_t *w, long rb, const void *const *x, long nb, float *out) { call(1, 2); } \
    static void name##_1x3(const uint8_t *w, long rb, const void *const *x, long nb, float *out) { call(1, 3); } \
    static void name##_1xt(const uint8_t *w, long rb, const void *const *x, long nb, float *out) { call(1, TILE); } \
    static void name##_wxt(const uint8_t *w, long rb, const void *const *x, long nb, float *out) { call(WR_TILE, TILE); }
#define SET_SHAPES(L, name) \
    (L)->few[1] = name##_1x1, (L)->few[2] = name##_1x2, (L)->few[3] = name##_1x3, (L)->f1t = name##_1xt, (L)->fwt = name##_wxt

/* amx.c: from AMX_ROWS activation rows on, the 32-value interleaved forms' groups two at a time through the
 * AMX int8 tiles where this build and the OS allow them (amx_x8 returns 1 where not, nothing written). */
enum { AMX_ROWS = 4 };
int amx_ready(void);
int amx_x8(int type, const uint8_t *w, long pairs, long group_bytes, long nb, const char *xq, long xrow, long m,
           void *y, int y_type, long n_out);

#include "blocktypes.h"
#endif
