/* The legacy 32-value block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) and the 8-row interleaved forms of Q4_0, Q4_1
 * and Q8_0, against activation blocks of 32 (xq32). Each block's product is an integer dot product scaled by
 * the two blocks' float scales:
 *   Q4_0  d dx (sum(nib q) - 8 sum(q))           Q4_1  d dx sum(nib q) + m dx sum(q)
 *   Q5_0  d dx (sum(q5 q) - 16 sum(q))           Q5_1  d dx sum(q5 q) + m dx sum(q)
 *   Q8_0  d dx sum(w q)
 * Paths: AVX2 (maddubs + madd; the u8 x s8 dot as AVX-512 VNNI / AVX-VNNI dpbusd where the compiler targets
 * them: the same sums, maddubs never saturates on these ranges) and the portable scalar one. */
#include "quant.h"

#define HAS_MIN(type) ((type) == Q4_1 || (type) == Q5_1) /* d q + m, not d (q - offset) */
#define QS_AT(type) ((type) == Q4_0 ? 2 : (type) == Q4_1 ? 4 : (type) == Q5_0 ? 6 : 8) /* the low 4 bits */
#define QH_AT(type) ((type) == Q5_0 ? 2 : 4)                                           /* Q5's fifth bits */

/* One weight row (nb blocks) times one quantized activation row: the portable path. */
static float dot32(int type, const uint8_t *w, const void *xv, long nb) {
    float acc = 0.0f, accm = 0.0f;
    long bb = block_bytes(type);
    for (long b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * bb;
        const xq32 *x = (const xq32 *)xv + b;
        int isum = 0;
        if (type == Q8_0) {
            for (int k = 0; k < 32; k++) isum += ((const int8_t *)blk + 2)[k] * x->q[k];
        } else {
            const uint8_t *qs = blk + QS_AT(type);
            uint32_t qh = 0;
            if (type == Q5_0 || type == Q5_1) memcpy(&qh, blk + QH_AT(type), 4);
            for (int k = 0; k < 16; k++) {
                int lo = (qs[k] & 0xF) | (int)((qh >> k) & 1) << 4;
                int hi = (qs[k] >> 4) | (int)((qh >> (k + 16)) & 1) << 4;
                isum += lo * x->q[k] + hi * x->q[k + 16];
            }
            if (!HAS_MIN(type)) isum -= (type == Q4_0 ? 8 : 16) * x->sum;
        }
        acc = fmaf(f16(blk) * x->d, (float)isum, acc);
        if (HAS_MIN(type)) accm = fmaf(f16(blk + 2), x->s, accm);
    }
    return acc + accm;
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
/* WR weight rows (w, w + row_bytes, ...) times R activation rows x[r], the 32-value block formats, into
 * out[wr * TILE + r]; `type`, WR and R constants at every call, so each format and tile shape gets its own
 * loop with the accumulators in registers. A weight block is unpacked once for the R rows and an
 * activation block loaded once for the WR weight rows. Q4_0 and Q5_0 take their offset (8, 16) off the
 * weights and multiply |w| by x carrying w's sign (the integer sums are those of the offset taken off the
 * sums); Q4_1 and Q5_1 add m times the activation block's d sum. Every accumulator sees the same instructions
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
    const long bb = type == Q4_0 ? 18 : type == Q4_1 ? 20 : type == Q5_0 ? 22 : type == Q5_1 ? 24 : 34;
    for (long b = 0; b < nb; b++) {
        __m256 d[WR_TILE];
        __m256i u[WR_TILE], sw[WR_TILE]; /* the weights as unsigned bytes (|w| where signed); w, whose sign x takes */
        float m[WR_TILE];
        for (int k = 0; k < WR; k++) {
            const uint8_t *blk = w + k * row_bytes + b * bb;
            if (R < TILE) prefetch_ahead(blk, bb);
            d[k] = _mm256_set1_ps(f16(blk));
            m[k] = HAS_MIN(type) ? f16(blk + 2) : 0.0f;
            if (type == Q8_0) {
                sw[k] = _mm256_loadu_si256((const __m256i *)(blk + 2));
                u[k] = _mm256_sign_epi8(sw[k], sw[k]);
            } else {
                __m128i q = _mm_loadu_si128((const __m128i *)(blk + QS_AT(type)));
                u[k] = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), m4);
                if (type == Q5_0 || type == Q5_1)
                    u[k] = _mm256_or_si256(u[k], _mm256_and_si256(bits_to_bytes(blk + QH_AT(type)), _mm256_set1_epi8(0x10)));
                sw[k] = _mm256_sub_epi8(u[k], offset);
                if (!HAS_MIN(type)) u[k] = _mm256_sign_epi8(sw[k], sw[k]);
            }
        }
        for (int r = 0; r < R; r++) {
            const xq32 *xb = x[r] + b;
            __m256i xs = _mm256_loadu_si256((const __m256i *)xb->q);
            __m256 dx = _mm256_broadcast_ss(&xb->d);
            for (int k = 0; k < WR; k++) {
                __m256i p = dot_u8s8(u[k], HAS_MIN(type) ? xs : _mm256_sign_epi8(xs, sw[k]));
                acc[k][r] = _mm256_fmadd_ps(dx, _mm256_mul_ps(_mm256_cvtepi32_ps(p), d[k]), acc[k][r]);
                if (HAS_MIN(type)) accm[k][r] = fmaf(m[k], xb->s, accm[k][r]);
            }
        }
    }
    for (int k = 0; k < WR; k++)
        for (int r = 0; r < R; r++) out[k * TILE + r] = hsum8(acc[k][r]) + accm[k][r];
}

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

#define CALLQ40(WR, R) rows32(Q4_0, w, rb, WR, x, nb, R, out)
#define CALLQ41(WR, R) rows32(Q4_1, w, rb, WR, x, nb, R, out)
#define CALLQ50(WR, R) rows32(Q5_0, w, rb, WR, x, nb, R, out)
#define CALLQ51(WR, R) rows32(Q5_1, w, rb, WR, x, nb, R, out)
#define CALLQ80(WR, R) rows32(Q8_0, w, rb, WR, x, nb, R, out)
SHAPES(rq40, CALLQ40)
SHAPES(rq41, CALLQ41)
SHAPES(rq50, CALLQ50)
SHAPES(rq51, CALLQ51)
SHAPES(rq80, CALLQ80)
#endif

/* quant_mm for the 8-row interleaved forms: groups of 8 weight rows per task, quantized rows xq. */
static void mm_x8(int type, const uint8_t *w, long n_out, long nb, const char *xq, long m, void *y, int y_type,
                  int portable) {
    long groups = n_out / 8, group_bytes = nb * block_bytes(type) * 8, xrow = nb * (long)sizeof(xq32), first = 0;
    if (!portable && m >= AMX_ROWS && groups >= 2 && !amx_x8(type, w, groups / 2, group_bytes, nb, xq, xrow, m, y,
                                                             y_type, n_out))
        first = groups / 2 * 2; /* pairs of groups through the AMX tiles (amx.c); an odd last group below */
    if (first == groups) return;
    long tasks = tasks_of(groups - first, group_bytes, m), per = (groups - first + tasks - 1) / tasks;
    void (*one)(const uint8_t *, const void *const *, long, float *) = NULL, (*tile)(const uint8_t *, const void *const *, long, float *) = NULL;
#ifdef HAVE_AVX2
    if (!portable) {
        one = type == Q4_0X8 ? x8_q40_1 : type == Q4_1X8 ? x8_q41_1 : x8_q80_1;
        tile = type == Q4_0X8 ? x8_q40_t : type == Q4_1X8 ? x8_q41_t : x8_q80_t;
    }
#endif
#pragma omp parallel for schedule(static)
    for (long t = 0; t < tasks; t++) {
        long g_end = first + (t + 1) * per < groups ? first + (t + 1) * per : groups;
        for (long i = 0; i < m; i += TILE) {
            int R = m - i < TILE ? (int)(m - i) : TILE;
            const void *xs[TILE];
            for (int r = 0; r < TILE; r++) xs[r] = xq + (i + (r < R ? r : R - 1)) * xrow; /* a short tile: its last row again */
            for (long g = first + t * per; g < g_end; g++) {
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

/* One stored row of nb blocks of `type` as float values: gguf's dequantize. */
static void dequant32(int type, const uint8_t *w, long nb, float *out) {
    long bb = block_bytes(type);
    for (long b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * bb;
        float *o = out + 32 * b, d = f16(blk);
        if (type == Q8_0) {
            for (int k = 0; k < 32; k++) o[k] = d * (float)((const int8_t *)blk + 2)[k];
            continue;
        }
        const uint8_t *qs = blk + QS_AT(type);
        uint32_t qh = 0;
        if (type == Q5_0 || type == Q5_1) memcpy(&qh, blk + QH_AT(type), 4);
        int shift = type == Q4_0 ? 8 : type == Q5_0 ? 16 : 0;
        float m = HAS_MIN(type) ? f16(blk + 2) : 0.0f;
        for (int k = 0; k < 16; k++) {
            int lo = (qs[k] & 0xF) | (int)((qh >> k) & 1) << 4;
            int hi = (qs[k] >> 4) | (int)((qh >> (k + 16)) & 1) << 4;
            o[k] = d * (float)(lo - shift) + m;
            o[k + 16] = d * (float)(hi - shift) + m;
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

/* Row `lane` (0..7) of an interleaved group (nb blocks) as float values into out[0 .. 32 nb): dequant_x8's
 * values of that row alone (an embedding table's lookup in its tied head's bytes, rows.c). */
static void row_x8(int type, const uint8_t *w, long nb, int lane, float *out) {
    long bb = 8 * block_bytes(type);
    const int head = type == Q4_1X8 ? 32 : 16, shift = type == Q4_0X8 ? 8 : 0, k = lane & 3, high = lane >> 2;
    for (long b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * bb, *qs = blk + head;
        float d = f16(blk + 2 * lane), m = type == Q4_1X8 ? f16(blk + 16 + 2 * lane) : 0.0f, *o = out + 32 * b;
        for (int s = 0; s < 8; s++) /* the lane's bytes (Q4_0, Q4_1: nibbles, rows 4..7 the high ones) */
            for (int i = 0; i < 4; i++) {
                if (type == Q8_0X8) {
                    o[4 * s + i] = d * (float)(int8_t)qs[32 * s + 4 * lane + i];
                    continue;
                }
                uint8_t byte = qs[16 * s + 4 * k + i];
                o[4 * s + i] = d * (float)((high ? byte >> 4 : byte & 0xF) - shift) + m;
            }
    }
}

/* The loops of `type`, one of this family's (blocktypes.py): find_loops's case for it. */
int legacy_loops(int type, int portable, loops *L) {
    switch (type) {
    case Q4_0: case Q4_1: case Q5_0: case Q5_1: case Q8_0: L->dot = dot32, L->dequant = dequant32; break;
    case Q4_0X8: case Q4_1X8: case Q8_0X8: L->mm = mm_x8, L->dequant = dequant_x8, L->row = row_x8; break;
    default: return 0;
    }
#ifdef HAVE_AVX2
    if (!portable) {
        switch (type) {
        case Q4_0: SET_SHAPES(L, rq40); break;
        case Q4_1: SET_SHAPES(L, rq41); break;
        case Q5_0: SET_SHAPES(L, rq50); break;
        case Q5_1: SET_SHAPES(L, rq51); break;
        case Q8_0: SET_SHAPES(L, rq80); break;
        }
    }
#endif
    return 1;
}
