/* Several activation rows times the 32-value interleaved forms (Q4_0X8, Q4_1X8, Q8_0X8) through the int8
 * matrix tiles of AMX (Sapphire Rapids and later Xeons), where the compiler targets them and the OS lets
 * the process use them: a speculative check's rows, a server's batched step, a prompt chunk.
 *
 * Why: past 4 rows the AVX2 loops cost about a row's worth of integer work per row (on a 2-core Xeon the
 * 17 rows of a check ran 3-4x one row), and one tile instruction computes the 32-value block sums of 16
 * activation rows by 16 weight rows at once. The tiles' integer sums are exact, the very sums the vector
 * and portable loops form (legacy.c's rows_x8, x8_scalar), and each (activation row, weight row) pair then
 * takes the same float steps in the same order: acc = fma(d_w * d_x, sum, acc), accm = fma(m_w, s_x, accm)
 * (Q4_1), acc + accm at the end. So a row's result is the one-row loop's bit for bit, whatever the batch.
 *
 * Layout: the activation blocks are the tile A as they lie (each row's 32 int8 values, rows xrow apart);
 * the weights are tile B in the VNNI layout the instruction reads (row s: 4 values of each weight row),
 * which is the interleaved group's own order: row s of B is step s of two groups side by side (16 rows). */
#include "quant.h"

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(HAVE_AVX512)
#include <stddef.h>
#include <sys/syscall.h>
#include <unistd.h>

enum { ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18, AMX_M = 16 };

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* 1 where the OS grants this process the tiles' state (asked once: Linux 5.16 and later), else 0. */
int amx_ready(void) {
    static int ready = -1;
    if (ready < 0) ready = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return ready;
}

/* Tiles for M activation rows, two blocks in flight (tiles 0-2 one block's, 3-5 the next's): 0/3 the sums
 * (M x 16 int32), 1/4 the activations (M x 32 int8), 2/5 the weights (8 x 64 bytes). */
static void configure(int M) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 6; t += 3) {
        c.rows[t] = (uint8_t)M, c.colsb[t] = 64;
        c.rows[t + 1] = (uint8_t)M, c.colsb[t + 1] = 32;
        c.rows[t + 2] = 8, c.colsb[t + 2] = 64;
    }
    _tile_loadconfig(&c);
}

/* Block b's two groups (g0, g1) as tile B in the VNNI layout: 8 rows of 64 bytes. */
static inline void unpack(int type, const uint8_t *g0, const uint8_t *g1, uint8_t *b_tile) {
    const int head = type == Q4_1X8 ? 32 : 16;
    const __m256i m4 = _mm256_set1_epi8(0xF);
    const uint8_t *g[2] = {g0, g1};
    for (int h = 0; h < 2; h++) {
        for (int s = 0; s < 8; s++) {
            __m256i u;
            if (type == Q8_0X8) u = _mm256_loadu_si256((const __m256i *)(g[h] + head + 32 * s));
            else {
                __m128i q = _mm_loadu_si128((const __m128i *)(g[h] + head + 16 * s));
                u = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), m4);
            }
            _mm256_store_si256((__m256i *)(b_tile + 64 * s + 32 * h), u);
        }
    }
}

/* Block b's sums (in `sums`, M x 16) into the rows' accumulators: the one-row loop's float steps. */
static inline void steps(int type, const uint8_t *g0, const uint8_t *g1, const int32_t *sums, const char *xq,
                         long xrow, long b, int M, __m512 *acc, __m512 *accm) {
    const __m512 d = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g0))),
                                        _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g1)), 1);
    __m512 m = d;
    if (type == Q4_1X8)
        m = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g0 + 16)))),
                               _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g1 + 16))), 1);
    for (int r = 0; r < M; r++) {
        const xq32 *xb = (const xq32 *)(xq + r * xrow) + b;
        __m512i p = _mm512_load_si512((const void *)(sums + 16 * r));
        if (type == Q4_0X8) p = _mm512_sub_epi32(p, _mm512_set1_epi32(8 * xb->sum));
        acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(xb->d)), _mm512_cvtepi32_ps(p), acc[r]);
        if (type == Q4_1X8) accm[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xb->s), accm[r]);
    }
}

/* Two groups of 8 rows (w0, w1) times M activation rows (xq, xrow apart) into out[r * 16 + k]. Two blocks
 * at a time, each with tiles of its own: a block's tile B is written to memory and read back by the tile
 * load, and its sums go the same way, so one block alone waits on both; two overlap. The float steps still
 * run block by block, in order. */
static void pair(int type, const uint8_t *w0, const uint8_t *w1, long nb, const char *xq, long xrow, int M,
                 float *out) {
    const long bb = type == Q4_0X8 ? 144 : type == Q4_1X8 ? 160 : 272;
    __m512 acc[AMX_M], accm[AMX_M];
    uint8_t b_tile[2][8 * 64] __attribute__((aligned(64)));
    int32_t sums[2][AMX_M * 16] __attribute__((aligned(64)));
    const long xstep = (long)sizeof(xq32), xq_at = offsetof(xq32, q);
    for (int r = 0; r < M; r++) acc[r] = accm[r] = _mm512_setzero_ps();
    long b = 0;
    for (; b + 1 < nb; b += 2) {
        const uint8_t *a0 = w0 + b * bb, *a1 = w1 + b * bb, *c0 = a0 + bb, *c1 = a1 + bb;
        prefetch_ahead(a0, 2 * bb);
        prefetch_ahead(a1, 2 * bb);
        unpack(type, a0, a1, b_tile[0]);
        unpack(type, c0, c1, b_tile[1]);
        _tile_zero(0);
        _tile_zero(3);
        _tile_loadd(1, xq + b * xstep + xq_at, xrow);
        _tile_loadd(4, xq + (b + 1) * xstep + xq_at, xrow);
        _tile_loadd(2, b_tile[0], 64);
        _tile_loadd(5, b_tile[1], 64);
        if (type == Q8_0X8) {
            _tile_dpbssd(0, 1, 2);
            _tile_dpbssd(3, 4, 5);
        } else { /* signed activations, unsigned 4-bit weights */
            _tile_dpbsud(0, 1, 2);
            _tile_dpbsud(3, 4, 5);
        }
        _tile_stored(0, sums[0], 64);
        _tile_stored(3, sums[1], 64);
        steps(type, a0, a1, sums[0], xq, xrow, b, M, acc, accm);
        steps(type, c0, c1, sums[1], xq, xrow, b + 1, M, acc, accm);
    }
    if (b < nb) {
        const uint8_t *a0 = w0 + b * bb, *a1 = w1 + b * bb;
        unpack(type, a0, a1, b_tile[0]);
        _tile_zero(0);
        _tile_loadd(1, xq + b * xstep + xq_at, xrow);
        _tile_loadd(2, b_tile[0], 64);
        if (type == Q8_0X8) _tile_dpbssd(0, 1, 2);
        else _tile_dpbsud(0, 1, 2);
        _tile_stored(0, sums[0], 64);
        steps(type, a0, a1, sums[0], xq, xrow, b, M, acc, accm);
    }
    for (int r = 0; r < M; r++) _mm512_storeu_ps(out + 16 * r, _mm512_add_ps(acc[r], accm[r]));
}

/* y rows [0, m) of output columns [0, 16 * pairs) = the activation rows xq (xrow apart) times the groups of
 * w (group_bytes apart) two at a time; the caller's loops take any group left. Returns 0, 1 where the
 * tiles cannot be used here (nothing written). */
int amx_x8(int type, const uint8_t *w, long pairs, long group_bytes, long nb, const char *xq, long xrow, long m,
           void *y, int y_type, long n_out) {
    if (!amx_ready() || (type != Q4_0X8 && type != Q4_1X8 && type != Q8_0X8)) return 1;
#pragma omp parallel
    {
        int configured = 0;
        float out[AMX_M * 16];
#pragma omp for schedule(static)
        for (long p = 0; p < pairs; p++) {
            const uint8_t *w0 = w + 2 * p * group_bytes;
            for (long i = 0; i < m; i += AMX_M) {
                int M = m - i < AMX_M ? (int)(m - i) : AMX_M;
                if (M != configured) configure(M), configured = M;
                pair(type, w0, w0 + group_bytes, nb, xq + i * xrow, xrow, M, out);
                for (int r = 0; r < M; r++)
                    for (int k = 0; k < 16; k++) {
                        long at = (i + r) * n_out + 16 * p + k;
                        if (y_type == F32) ((float *)y)[at] = out[16 * r + k];
                        else ((uint16_t *)y)[at] = to_bf16(out[16 * r + k]);
                    }
            }
        }
        if (configured) _tile_release();
    }
    return 0;
}
#else
int amx_ready(void) { return 0; }

int amx_x8(int type, const uint8_t *w, long pairs, long group_bytes, long nb, const char *xq, long xrow, long m,
           void *y, int y_type, long n_out) {
    (void)type, (void)w, (void)pairs, (void)group_bytes, (void)nb, (void)xq, (void)xrow, (void)m, (void)y;
    (void)y_type, (void)n_out;
    return 1;
}
#endif
