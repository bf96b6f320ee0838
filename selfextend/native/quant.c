/* Products of activation rows with a GGUF tensor's quantized blocks, read as the file stores them: the
 * driver. Each block family's loops are in a source of its own (legacy.c: the 32-value formats and their
 * interleaved forms; kquant.c: the K-quants, kquant_x8.c their interleaved forms' vector loops), each type's
 * facts in blocktypes.h, generated from
 * blocktypes.py at build; quant.h is what they share.
 *
 * quant_mm: y[m, n_out] = x[m, n_in] . W^T, W the raw blocks of one GGUF tensor (n_out rows, each
 * n_in / block_values blocks). As llama.cpp does, each activation row is quantized once per call to int8
 * (per 32 values with the sum of the 32 for the 32-value block formats, as llama.cpp's Q8_0 and Q8_1 blocks:
 * float16 d = max|x| / 127 and s = d sum; per 256 with sums per 16 for the K-quants, as its Q8_K blocks:
 * d = max / -127 for the signed max: the integers and scales llama.cpp multiplies), then each block's
 * product is an integer dot product scaled by the two blocks' float scales (each family's source gives its
 * formulas). The integer parts are exact, so only the float steps (one fused multiply-add per block and row, a fixed
 * horizontal sum) set the rounding, and they are the same for every row whatever the call's row count:
 * a row's result does not depend on the batch (activation rows are tiled by TILE and weight rows by
 * WR_TILE for reuse, and a tile's accumulators each see the same instructions as a single row's; 2 or 3
 * rows take tiles of their own, so that the weights are read once for all; Q4_0X8, Q4_1X8 and Q8_0X8 take 3
 * rows as a tile that repeats its last one, the K-quants' interleaved forms tiles of 1-4 rows, Q6_K's of 1-8,
 * kquant_x8.c). A decode step (fewer than TILE
 * activation rows: one sequence, or a few slots' batched step) reads its weight rows one after another,
 * DECODE_ROWS per task: several rows read side by side are as many streams from memory, which ran at half
 * the rate (Q8_0: 6 GB/s against 11.5 on one core).
 * Q4_0, Q4_1 and Q8_0 also come in an 8-row interleaved form (Q4_0X8, Q4_1X8, Q8_0X8, blocks.py's pack8)
 * whose vector lanes are 8 weight rows: the same integer sums, one float step per block and row.
 *
 * Paths: AVX2, AVX-512 VNNI where the compiler targets it (the K-quants), and a portable scalar path
 * (`portable`), also used where AVX2 is missing. Threads: OpenMP over output rows (torch's own libgomp); a
 * row's reduction over n_in is never split. */
#include "quant.h"

/* The 32 values from x[at...] as llama.cpp's x86 build quantizes an activation block of 32 (quantize_row_q8_0
 * and _q8_1): amax = max|x|, q = x * (127 / amax) rounded half to even; returns amax / 127 (float32), whose
 * float16 rounding is the block's scale. Where llama.cpp's fmaxf skips a NaN (a NaN row then multiplies as
 * zeros: a model with a NaN scale in its weights gave uniform logits, a perplexity of its vocabulary's size),
 * here the scale is NaN: the product is NaN, as the float forms' and torch's are. */
INLINE float quantize_block32(const void *x, int type, long at, int8_t *q) {
    float amax = 0.0f;
    for (int k = 0; k < 32; k++) {
        float a = fabsf(load_x(x, type, at + k));
        amax = a > amax || a != a ? a : amax; /* fmaxf's, but a NaN sticks: a broken row's product is NaN */
    }
    float id = amax != 0.0f ? 127.0f / amax : 0.0f;
    for (int k = 0; k < 32; k++) q[k] = (int8_t)nearbyintf(load_x(x, type, at + k) * id);
    return amax / 127.0f;
}

/* The 256 values from x[at...] as llama.cpp quantizes an activation block of 256 (quantize_row_q8_K): max the
 * first value of the largest |x|, with its sign; iscale = -127 / max, q = min(127, iscale x rounded half to
 * even); returns the scale d = 1 / iscale (negative where max is positive), 0 where every value is 0. */
INLINE float quantize_block256(const void *x, int type, long at, int8_t *q) {
    float amax = 0.0f, max = 0.0f;
    for (int k = 0; k < 256; k++) {
        float v = load_x(x, type, at + k), a = fabsf(v);
        if (a > amax || a != a) amax = a, max = v; /* a NaN sticks (no a > NaN), as in quantize_block32 */
    }
    if (amax == 0.0f) {
        memset(q, 0, 256);
        return 0.0f;
    }
    float iscale = -127.0f / max;
    for (int k = 0; k < 256; k++) {
        float v = nearbyintf(iscale * load_x(x, type, at + k));
        q[k] = (int8_t)(v < 127.0f ? v : 127.0f);
    }
    return 1.0f / iscale;
}

/* Activation row x (n values of x type `type`) as the activation blocks `act` takes (quant.h), each block's
 * numbers those of llama.cpp's (its Q8_0 / Q8_1 and Q8_K blocks), so that a product's integer sums and
 * scales are the ones llama.cpp multiplies. */
static void quantize_row(const void *x, int type, long n, int act, void *out) {
    if (act == ACT_F32) {
        for (long k = 0; k < n; k++) ((float *)out)[k] = load_x(x, type, k);
        return;
    }
    if (act == ACT_Q8_32) {
        for (long b = 0; b < n / 32; b++) {
            xq32 *o = (xq32 *)out + b;
            float d = quantize_block32(x, type, 32 * b, o->q);
            int s = 0;
            for (int k = 0; k < 32; k++) s += o->q[k];
            o->sum = s;
            o->d = (float)(_Float16)d;            /* Q8_0's and Q8_1's d: float16 */
            o->s = (float)(_Float16)(d * (float)s); /* Q8_1's s: float16 of the unrounded d times the sum */
        }
        return;
    }
    for (long b = 0; b < n / 256; b++) {
        xqk *o = (xqk *)out + b;
        o->d = quantize_block256(x, type, 256 * b, o->q);
        for (int g = 0; g < 16; g++) {
            int s = 0;
            for (int k = 0; k < 16; k++) s += o->q[16 * g + k];
            o->bsums[g] = (int16_t)s;
        }
        for (int j = 0; j < 8; j++) o->dsums[j] = o->d * (float)(o->bsums[2 * j] + o->bsums[2 * j + 1]);
    }
}

/* Results out[k * TILE + r] of weight rows j.. and activation rows i.. into y (m, n_out). */
static void store(void *y, int y_type, long n_out, long i, long j, const float *out, int wr, int R) {
    for (int k = 0; k < wr; k++)
        for (int r = 0; r < R; r++) {
            long at = (i + r) * n_out + j + k;
            if (y_type == F32) ((float *)y)[at] = out[k * TILE + r];
            else ((uint16_t *)y)[at] = to_bf16(out[k * TILE + r]);
        }
}


/* The bytes of one activation row of n values as `act` takes it. */
static long act_row_bytes(int act, long n) {
    if (act == ACT_F32) return n * (long)sizeof(float);
    return act == ACT_Q8_32 ? n / 32 * (long)sizeof(xq32) : n / 256 * (long)sizeof(xqk);
}

/* y (m, n_out; float32 or bfloat16 by y_type) = x (m, n_in; float32 or bfloat16 by x_type) . W^T, W of
 * `type` as rows of raw GGUF blocks. Returns 0, 1 where scratch memory could not be had, 2 for a type or
 * size it does not take. */
int quant_mm(int type, const uint8_t *w, long n_out, long n_in, const void *x, int x_type, long m, void *y,
             int y_type, int portable) {
    long bv = block_values(type), bb = block_bytes(type);
    loops L;
    if (bv == 0 || n_in < bv || n_in % bv != 0 || m < 0 || n_out < 1 || !find_loops(type, portable, &L)) return 2;
    if (IS_X8(type) && n_out % 8 != 0) return 2;
    int act = block_act(type);
    long nb = n_in / bv, row_bytes = nb * bb, xrow = act_row_bytes(act, n_in);
    char *xq = malloc(m * xrow + 1);
    if (xq == NULL) return 1;
    long x_size = x_type == F32 ? 4 : 2;
#pragma omp parallel for schedule(static) if (m > 1)
    for (long i = 0; i < m; i++) quantize_row((const char *)x + i * n_in * x_size, x_type, n_in, act, xq + i * xrow);
    if (L.mm != NULL) {
        L.mm(type, w, n_out, nb, xq, m, y, y_type, portable);
        free(xq);
        return 0;
    }
    tile_fn f1t = L.f1t, fwt = L.fwt, *few = L.few; /* few[R]: R < TILE activation rows */
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
                    for (int r = 0; r < R; r++) out[r] = L.dot(type, w + j * row_bytes, xs[r], nb);
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

/* y (n_out, n_in) bfloat16 = the weight rows W of `type` (stored or interleaved) dequantized, for a prefill
 * chunk's product through a bf16 matrix engine (AMX by oneDNN). Returns 0, 1 where scratch memory could not
 * be had, 2 for a type or size it does not take. */
int quant_dequant_bf16(int type, const uint8_t *w, long n_out, long n_in, uint16_t *y) {
    long bv = block_values(type), bb = block_bytes(type);
    loops L;
    if (bv == 0 || n_in < bv || n_in % bv != 0 || n_out < 0 || !find_loops(type, 1, &L)) return 2;
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
            L.dequant(type, w + u * unit_bytes, nb, f); /* an interleaved form: its group of 8 rows */
            uint16_t *o = y + u * rows * n_in;
            for (long k = 0; k < rows * n_in; k++) o[k] = to_bf16(f[k]);
        }
        free(f);
    }
    return failed;
}

/* y (n, n_in) float32 = rows ids[0..n) of the n_rows stored rows W of `type` (row_bytes apart), gguf's
 * dequantized values: an embedding table held as its blocks, looked up a few rows a token. Returns 2 for a type
 * or size it does not take (an interleaved form among them: its rows are not stored one after another), 3 for
 * an id outside [0, n_rows) (nothing read: a token id past the table never reads past its end). */
int quant_rows_f32(int type, const uint8_t *w, long row_bytes, long n_rows, const int64_t *ids, long n, long n_in,
                   float *y) {
    long bv = block_values(type);
    loops L;
    if (bv == 0 || IS_X8(type) || n_in % bv != 0 || n < 0 || row_bytes != n_in / bv * block_bytes(type)) return 2;
    if (!find_loops(type, 1, &L)) return 2;
    for (long i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= n_rows) return 3;
#pragma omp parallel for schedule(static) if (n > 64)
    for (long i = 0; i < n; i++) L.dequant(type, w + ids[i] * row_bytes, n_in / bv, y + i * n_in);
    return 0;
}

/* 1 where the layers should hold `type` in its 8-row interleaved form (blocks.py's pack8): it has one and
 * its family does not find the stored rows faster on this build and CPU (loops' stored_faster); else 0. */
int quant_interleaves(int type) {
    static const int x8[] = X8_CODES;
    loops L;
    for (unsigned i = 0; i < sizeof x8 / sizeof *x8; i++)
        if (x8[i] == type + (Q8_0X8 - Q8_0)) return find_loops(type, 0, &L) && !L.stored_faster;
    return 0;
}

/* 0 where every type of the table (blocktypes.h) has its loops: a dequantisation, a portable product (or a
 * driver of its own) and, where the table says so and AVX2 is compiled for, vector tiles; else the first
 * code that lacks them. The binding calls it at load, so a type described without its C is never used. */
int quant_check(void) {
    static const int codes[] = BLOCK_CODES, x8[] = X8_CODES;
    for (unsigned i = 0; i < sizeof codes / sizeof *codes + sizeof x8 / sizeof *x8; i++) {
        int type = i < sizeof codes / sizeof *codes ? codes[i] : x8[i - sizeof codes / sizeof *codes];
        loops L, V;
        if (!find_loops(type, 1, &L) || !find_loops(type, 0, &V) || L.dequant == NULL) return type;
        if (L.mm == NULL && (L.dot == NULL || V.dot == NULL)) return type;
#ifdef HAVE_AVX2
        if (block_avx2(type) && V.mm == NULL && (V.few[1] == NULL || V.f1t == NULL || V.fwt == NULL)) return type;
#endif
    }
    return 0;
}

