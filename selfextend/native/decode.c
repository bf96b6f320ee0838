/* The decode step's native kernels: one token's pass through a layer without torch's per-op dispatch.
 *
 * decode_attention: one query token's attention over a layer's KV cells, read once per KV head.
 * rope_write: the token's query rotated, its key rotated and value rounded into the cache's cells.
 * rms_norm_bf16, gated_bf16: the norm and the gated activation (SwiGLU, GeGLU) before a quantized
 * product, in its bfloat16 input type; rms_norm_add: a norm added to the residual stream (Gemma's norms
 * after attention and MLP).
 *
 * decode_attention's arguments: q, qg: (Hkv, R, D) float32, scaled here by `scale` (R query heads share a KV head; qg is the query at
 * its Self-Extend grouped position). k, v: Hkv rows of `n` cells of D elements in the cache's type
 * (float32, bfloat16 or float16), `k_stride`/`v_stride` elements apart per KV head. kg: the first `ng`
 * keys at grouped positions, in the same type, `kg_stride` apart. Scores are qg . kg[j] for j < ng and q . k[j]
 * after, one softmax over all n. out: (Hkv, R, D) float32. D a multiple of 16, at most 256.
 *
 * Work is split into (KV head, chunk of cells) tasks over the OpenMP threads torch already runs (the
 * same libgomp), each a pass over its keys then its values with a local softmax; the chunks are merged
 * with their maxima, as flash-decoding does. Attention's vectors are gcc/clang vector extensions of 8
 * floats (one AVX2 register, kept in registers; int8_gemv's are 16: one AVX-512 register, two AVX2 ones),
 * which -march=native lowers to the machine's registers. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

enum { F32 = 0, BF16 = 1, F16 = 2 };
enum { MAX_R = 16, MAX_V8 = 32, TILE = 2, HEADS = 6 }; /* query rows, 8-float vectors per row; a value tile */
enum { VALUES = 4096 }; /* values of a block of cells, as float32 16 KiB: in L1 for every tile and head */

#define INLINE static inline __attribute__((always_inline))
typedef float v16 __attribute__((vector_size(64), aligned(4), may_alias)); /* int8_gemv's vectors */
typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4), may_alias)); /* v8 at any float's address */
typedef float v4 __attribute__((vector_size(16)));
typedef uint16_t u16x8 __attribute__((vector_size(16), aligned(2), may_alias));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef _Float16 h8 __attribute__((vector_size(16), aligned(2), may_alias));

INLINE float hsum8(v8 a) {
    v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

INLINE float hsum(v16 x) {
    return hsum8(__builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) +
                 __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15));
}

/* Eight elements of a cell row, from `base` at element `i`, as float32 in one vector (bfloat16 widened by a
 * shift, float16 by the F16C conversion): what the score and value loops read. */
INLINE v8 load8(const void *base, long i, int type) {
    if (type == F32) return *(const v8u *)((const float *)base + i);
    if (type == BF16) {
        u32x8 bits = __builtin_convertvector(*(const u16x8 *)((const uint16_t *)base + i), u32x8) << 16;
        v8 x;
        memcpy(&x, &bits, sizeof x);
        return x;
    }
#if defined(__F16C__) /* gcc turns the vector conversion below into 8 scalar ones where AVX512-FP16 is on */
    return (v8)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + i)));
#else
    return __builtin_convertvector(*(const h8 *)((const _Float16 *)base + i), v8);
#endif
}

/* The cache line of a cell row's element `i` on its way in (ahead of its use: the pass over a block of cells
 * computes long enough for a line asked for a block or two ahead to arrive from memory). */
INLINE void prefetch_cells(const void *base, long i, int type) {
    __builtin_prefetch((const char *)base + i * (type == F32 ? 4 : 2), 0, 3);
}

/* e^x for x <= 0 (scores minus their maximum): Cody-Waite reduction to x = n ln2 + f, |f| <= ln2 / 2,
 * then a degree-6 polynomial for e^f (relative error ~1e-7), scaled by 2^n, zero below e^-87; written
 * without calls so the compiler vectorizes it (libm's expf is scalar). */
INLINE float exp_neg(float x) {
    float tiny = x < -87.0f ? 0.0f : 1.0f; /* flushed to zero where e^x would be subnormal */
    x = x < -87.0f ? -87.0f : x;
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float f = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * f + 1.3981999507e-3f;
    p = p * f + 8.3334519073e-3f;
    p = p * f + 4.1665795894e-2f;
    p = p * f + 1.6666665459e-1f;
    p = p * f + 5.0000001201e-1f;
    p = p * f * f + f + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale * tiny;
}

/* e^(x - max) in place over x[0 .. n), its maximum into *m and the sum into *l. */
INLINE void exp_row(float *x, long n, float *m, float *l) {
    float lanes[16], mx = -INFINITY, sum = 0.0f;
    long i = 0;
    for (int k = 0; k < 16; k++) lanes[k] = -INFINITY;
    for (; i + 16 <= n; i += 16)
        for (int k = 0; k < 16; k++) lanes[k] = x[i + k] > lanes[k] ? x[i + k] : lanes[k];
    for (; i < n; i++) mx = x[i] > mx ? x[i] : mx;
    for (int k = 0; k < 16; k++) mx = lanes[k] > mx ? lanes[k] : mx;
    for (long j = 0; j < n; j++) x[j] = exp_neg(x[j] - mx);
    for (int k = 0; k < 16; k++) lanes[k] = 0.0f;
    for (i = 0; i + 16 <= n; i += 16)
        for (int k = 0; k < 16; k++) lanes[k] += x[i + k];
    for (; i < n; i++) sum += x[i];
    for (int k = 0; k < 16; k++) sum += lanes[k];
    *m = mx;
    *l = sum;
}

/* The sums of eight vectors, t[i]'s into lane i: three rounds of pairwise adds between shuffled pairs. */
INLINE v8 sums8(const v8 *t) {
    v8 a[4], b[2];
    for (int i = 0; i < 4; i++)
        a[i] = __builtin_shufflevector(t[2 * i], t[2 * i + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
               __builtin_shufflevector(t[2 * i], t[2 * i + 1], 1, 9, 3, 11, 5, 13, 7, 15);
    for (int i = 0; i < 2; i++)
        b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
               __builtin_shufflevector(a[2 * i], a[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    return __builtin_shufflevector(b[0], b[1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(b[0], b[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

/* One query head's scores against the eight float32 rows of `kb` (n8 vectors each) into s[0 .. 8): four cells
 * at a time, each with two accumulators (even and odd vectors, eight independent sums in flight), then the
 * eight reduced together. */
INLINE void scores8(const v8 *qh, const float *kb, long n8, float *s) {
    v8 t[8];
    for (int i0 = 0; i0 < 8; i0 += 4) {
        v8 a[4], b[4];
        for (int i = 0; i < 4; i++) a[i] = qh[0] * *(const v8u *)(kb + (i0 + i) * n8 * 8), b[i] = (v8){0};
        for (long c = 1; c + 1 < n8; c += 2)
            for (int i = 0; i < 4; i++) {
                b[i] += qh[c] * *(const v8u *)(kb + ((i0 + i) * n8 + c) * 8);
                a[i] += qh[c + 1] * *(const v8u *)(kb + ((i0 + i) * n8 + c + 1) * 8);
            }
        for (int i = 0; i < 4; i++) {
            b[i] += qh[n8 - 1] * *(const v8u *)(kb + ((i0 + i) * n8 + n8 - 1) * 8); /* n8 is even */
            t[i0 + i] = a[i] + b[i];
        }
    }
    *(v8u *)s = sums8(t);
}

/* Two query heads' scores (q0, q1) against the eight float32 rows of `kb` (n8 vectors each) into s0[0 .. 8),
 * s1[0 .. 8): four cells at a time, each key vector loaded once for both heads (six loads for eight multiply-
 * adds, where one head's loop takes five for four). */
INLINE void scores8x2(const v8 *q0, const v8 *q1, const float *kb, long n8, float *s0, float *s1) {
    v8 t0[8], t1[8];
    for (int i0 = 0; i0 < 8; i0 += 4) {
        v8 a[4], b[4];
        for (int i = 0; i < 4; i++) {
            v8 k = *(const v8u *)(kb + (i0 + i) * n8 * 8);
            a[i] = q0[0] * k, b[i] = q1[0] * k;
        }
        for (long c = 1; c < n8; c++)
            for (int i = 0; i < 4; i++) {
                v8 k = *(const v8u *)(kb + ((i0 + i) * n8 + c) * 8);
                a[i] += q0[c] * k, b[i] += q1[c] * k;
            }
        for (int i = 0; i < 4; i++) t0[i0 + i] = a[i], t1[i0 + i] = b[i];
    }
    *(v8u *)s0 = sums8(t0);
    *(v8u *)s1 = sums8(t1);
}

/* One tile of TILE value vectors for `hn` heads over `cells` cells of float32 values `vs`:
 * a[h][i] += p[h * len + j] * vs[j * d + 8 i],
 * the sums carried in from `a` (a block of cells after the first: the same sums, in the same order) or from
 * zero, stored back to `a` (h * d + 8 i). */
INLINE void value_tile(const float *vs, long cells, long d, const float *p, long len, long hn, int carry,
                       float *a) {
    v8 t[HEADS][TILE];
    for (long h = 0; h < hn; h++)
        for (long i = 0; i < TILE; i++) t[h][i] = carry ? (v8) * (v8u *)(a + h * d + i * 8) : (v8){0};
    for (long j = 0; j < cells; j++) {
        v8 x[TILE];
        for (long i = 0; i < TILE; i++) x[i] = *(const v8u *)(vs + j * d + i * 8);
        for (long h = 0; h < hn; h++)
            for (long i = 0; i < TILE; i++) t[h][i] += p[h * len + j] * x[i];
    }
    for (long h = 0; h < hn; h++)
        for (long i = 0; i < TILE; i++) *(v8u *)(a + h * d + i * 8) = t[h][i];
}

/* Cells [c0, c1) of one KV head: the chunk's maximum score m[h], sum of e^(s - m) l[h] and
 * e^(s - m)-weighted value sum acc[h * d ...] for each of its r query heads; s: r * (c1 - c0) scratch.
 * n8 = d / 8 eight-float vectors per row; every loop runs over those, so a constant n8 unrolls into registers.
 * Scores go eight cells at a time, their keys converted to float32 once for all r heads and read for two heads
 * at a time; values in blocks of vb cells converted once, then a tile of TILE vectors for up to HEADS heads at
 * a time (r <= 6, every grouped-query ratio of the models we serve but 7 and 8, in one pass), the sums kept in
 * registers. Each block's lines are asked for a block or two ahead. Converting once instead of per head (and
 * keeping the value sums out of the stack) took Qwen2.5-1.5B's 28 layers over 4,096 bf16 cells from 16 to 11
 * ms a token on two Zen 4 cores (AVX2 build); reading bf16 values in place, their even and odd halves split by
 * a shift and a mask, was tried and ran 1.12-1.23x slower than converting a block once. */
INLINE void chunk(const float *q0, const float *qg0, float scale, const void *k, const void *kg, const void *v,
                  long c0, long c1, long ng, long r, long n8, int type, float *m, float *l, float *acc, float *s) {
    v8 q[MAX_R * MAX_V8], qg[MAX_R * MAX_V8], kf[8 * MAX_V8], vf[VALUES / 8];
    long len = c1 - c0, d = n8 * 8, vb = VALUES / d; /* the values read in blocks of vb cells */
    for (long i = 0; i < r * n8; i++) {
        q[i] = *(const v8u *)(q0 + i * 8) * scale;
        qg[i] = q[i];
        if (c0 < ng) qg[i] = *(const v8u *)(qg0 + i * 8) * scale;
    }
    for (long j = c0; j < c1;) {
        int grouped = j < ng;
        long end = grouped && ng < c1 ? ng : c1; /* a run of cells read with the same query and keys */
        const v8 *qj = grouped ? qg : q;
        const void *base = grouped ? kg : k;
        for (; j + 8 <= end; j += 8) {
            const float *kr = (const float *)base + j * d; /* the eight cells' keys as float32, for every head */
            if (type != F32) {
                for (long i = 0; i < 8 * n8; i++) {
                    if (i % 4 == 0) prefetch_cells(base, (j + 32) * d + i * 8, type);
                    kf[i] = load8(base, j * d + i * 8, type);
                }
                kr = (const float *)kf;
            }
            float *sj = s + j - c0;
            long h = 0;
            for (; h + 2 <= r; h += 2)
                scores8x2(qj + h * n8, qj + (h + 1) * n8, kr, n8, sj + h * len, sj + (h + 1) * len);
            if (h < r) scores8(qj + h * n8, kr, n8, sj + h * len);
        }
        for (; j < end; j++)
            for (long h = 0; h < r; h++) {
                v8 t = qj[h * n8] * load8(base, j * d, type);
                for (long c = 1; c < n8; c++) t += qj[h * n8 + c] * load8(base, j * d + c * 8, type);
                s[h * len + j - c0] = hsum8(t);
            }
    }
    for (long h = 0; h < r; h++) exp_row(s + h * len, len, m + h, l + h);
    for (long b0 = c0; b0 < c1; b0 += vb) {
        long b1 = b0 + vb < c1 ? b0 + vb : c1;
        const float *vs = (const float *)v + b0 * d; /* cells [b0, b1)'s values as float32 */
        if (type != F32) {
            for (long i = 0; i < (b1 - b0) * n8; i++) {
                if (i % 4 == 0) prefetch_cells(v, (b0 + 2 * vb) * d + i * 8, type);
                vf[i] = load8(v, b0 * d + i * 8, type);
            }
            vs = (const float *)vf;
        }
        for (long h0 = 0; h0 < r; h0 += HEADS) {
            long hn = r - h0 < HEADS ? r - h0 : HEADS;
            const float *p = s + h0 * len + b0 - c0;
            for (long c = 0; c < n8; c += TILE) {
                float *a = acc + h0 * d + c * 8;
#define TILE_OF(HN) value_tile(vs + c * 8, b1 - b0, d, p, len, HN, b0 > c0, a)
                switch (hn) { /* a constant count of heads: their sums stay in registers */
                case 1: TILE_OF(1); break;
                case 2: TILE_OF(2); break;
                case 3: TILE_OF(3); break;
                case 4: TILE_OF(4); break;
                case 5: TILE_OF(5); break;
                default: TILE_OF(HEADS); break;
                }
#undef TILE_OF
            }
        }
    }
}

/* One row's attention: its query (and grouped query), cells, sizes and output, and the scratch its tasks
 * (one per KV head and chunk of cells) write their partial softmax results to before the merge. */
typedef struct {
    const float *q, *qg;
    const void *k, *kg, *v;
    long n, ng, k_stride, kg_stride, v_stride, n_chunks, len;
    float *out, *m, *l, *s, *acc;
} att_row;

/* Scratch for a row's tasks; 0, or 2 where there is none. */
static int att_alloc(att_row *a, long hkv, long r, long d) {
    long tasks = hkv * a->n_chunks;
    a->len = (a->n + a->n_chunks - 1) / a->n_chunks;
    a->m = malloc(sizeof(float) * tasks * r * 2), a->s = malloc(sizeof(float) * tasks * r * a->len);
    a->acc = malloc(sizeof(float) * tasks * r * d);
    a->l = a->m == NULL ? NULL : a->m + tasks * r;
    return a->m == NULL || a->s == NULL || a->acc == NULL ? 2 : 0;
}

static void att_free(att_row *a) {
    free(a->m);
    free(a->s);
    free(a->acc);
    a->m = a->s = a->acc = NULL;
}

/* Task t of a row: KV head t / n_chunks over its chunk t % n_chunks of cells. */
static void att_task(const att_row *a, long t, long r, long d, int type, float scale) {
    long n8 = d / 8, width = type == F32 ? 4 : 2, len = a->len, n = a->n, ng = a->ng;
    long g = t / a->n_chunks, c0 = (t % a->n_chunks) * len, c1 = c0 + len < n ? c0 + len : n;
    float *m = a->m, *l = a->l;
    if (c0 >= c1) {
        for (long h = 0; h < r; h++) m[t * r + h] = -INFINITY, l[t * r + h] = 0.0f;
        return;
    }
    const float *qt = a->q + g * r * d, *qgt = ng > 0 ? a->qg + g * r * d : NULL;
    const char *kt = (const char *)a->k + g * a->k_stride * width, *vt = (const char *)a->v + g * a->v_stride * width;
    const char *kgt = (const char *)a->kg + g * a->kg_stride * width;
    float *mt = m + t * r, *lt = l + t * r, *st = a->s + t * r * len, *at = a->acc + t * r * d;
#define CHUNK(N8, TYPE) chunk(qt, qgt, scale, kt, kgt, vt, c0, c1, ng, r, N8, TYPE, mt, lt, at, st)
    if (n8 == 8 && type == F32) CHUNK(8, F32);
    else if (n8 == 8 && type == BF16) CHUNK(8, BF16);
    else if (n8 == 8 && type == F16) CHUNK(8, F16);
    else if (n8 == 16 && type == F32) CHUNK(16, F32);
    else if (n8 == 16 && type == BF16) CHUNK(16, BF16);
    else if (n8 == 16 && type == F16) CHUNK(16, F16);
    else if (n8 == 32 && type == BF16) CHUNK(32, BF16);
    else CHUNK(n8, type);
#undef CHUNK
}

/* A row's chunks merged into its output, in chunk order. */
static void att_merge(const att_row *a, long hkv, long r, long d) {
    const float *m = a->m, *l = a->l, *acc = a->acc;
    long n_chunks = a->n_chunks;
    for (long g = 0; g < hkv; g++) {
        for (long h = 0; h < r; h++) {
            float mx = -INFINITY, sum = 0.0f, *o = a->out + (g * r + h) * d;
            for (long c = 0; c < n_chunks; c++) {
                float mc = m[(g * n_chunks + c) * r + h];
                mx = mc > mx ? mc : mx;
            }
            memset(o, 0, d * sizeof(float));
            for (long c = 0; c < n_chunks; c++) {
                long at = (g * n_chunks + c) * r + h;
                if (l[at] == 0.0f) continue;
                float w = expf(m[at] - mx);
                const float *p = acc + at * d;
                sum += w * l[at];
                for (long i = 0; i < d; i++) o[i] += w * p[i];
            }
            for (long i = 0; i < d; i++) o[i] /= sum;
        }
    }
}

/* The attention of `rows` rows at once: every row's tasks in one parallel loop (a speculative check's or a
 * batched step's rows, each over its own cells), each task and each row's merge as a lone row computes them,
 * so a row's output does not depend on the rows beside it. Returns 0, 1 when a size is out of range or 2
 * when there is no scratch space (nothing written then). */
static int attention_rows(att_row *a, long rows, long hkv, long r, long d, int type, float scale) {
    if (r < 1 || r > MAX_R || d % 16 != 0 || d > 8 * MAX_V8) return 1;
    long total = 0, failed = 0;
    for (long j = 0; j < rows; j++) {
        if (a[j].n < 1 || a[j].n_chunks < 1) return 1;
        total += hkv * a[j].n_chunks;
    }
    long *first = malloc(sizeof(long) * (rows + 1));
    for (long j = 0; j < rows; j++) a[j].m = a[j].s = a[j].acc = NULL;
    for (long j = 0; j < rows && first != NULL && !failed; j++) failed = att_alloc(a + j, hkv, r, d);
    if (first == NULL || failed) {
        for (long j = 0; j < rows; j++) att_free(a + j);
        free(first);
        return 2;
    }
    first[0] = 0;
    for (long j = 0; j < rows; j++) first[j + 1] = first[j] + hkv * a[j].n_chunks;
#pragma omp parallel for schedule(static)
    for (long t = 0; t < total; t++) {
        long j = 0;
        while (first[j + 1] <= t) j++;
        att_task(a + j, t - first[j], r, d, type, scale);
    }
    for (long j = 0; j < rows; j++) {
        att_merge(a + j, hkv, r, d);
        att_free(a + j);
    }
    free(first);
    return 0;
}

/* Returns 0, 1 when a size is out of range or 2 when there is no scratch space (nothing written then). */
int decode_attention(const float *q, const float *qg, const void *k, const void *kg, const void *v, long n,
                     long ng, long hkv, long r, long d, long k_stride, long kg_stride, long v_stride, int type,
                     float scale, long n_chunks, float *out) {
    att_row a = {q, qg, k, kg, v, n, ng, k_stride, kg_stride, v_stride, n_chunks, 0, out, NULL, NULL, NULL, NULL};
    return attention_rows(&a, 1, hkv, r, d, type, scale);
}

static inline float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* float32 -> bfloat16 rounded to nearest even, NaN kept a (quiet) NaN: as torch rounds. */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if (f != f) return 0x7FC0;
    return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

/* x * cos + swap_halves(x) * sin over the first `rot` of d elements (`sin` with its first half negated),
 * the rest passed through: the RoPE of selfextend.core.rope.Rotation.apply. */
INLINE void rope(const float *x, const float *cos, const float *sin, long rot, long d, float *out) {
    long half = rot / 2;
    for (long i = 0; i < rot; i++) out[i] = x[i] * cos[i] + x[i < half ? i + half : i - half] * sin[i];
    for (long i = rot; i < d; i++) out[i] = x[i];
}

/* x / sqrt(mean(x^2) + eps) over n float32 values: the factor an RMSNorm multiplies x by (then by its weight). */
INLINE float inv_rms(const float *x, long n, float eps) {
    float lanes[16] = {0.0f}, sum = 0.0f;
    long i = 0;
    for (; i + 16 <= n; i += 16)
        for (int k = 0; k < 16; k++) lanes[k] += x[i + k] * x[i + k];
    for (; i < n; i++) sum += x[i] * x[i];
    for (int k = 0; k < 16; k++) sum += lanes[k];
    return 1.0f / sqrtf(sum / (float)n + eps);
}

/* A token's rows (H + 2 Hkv, D) float32 from its query/key/value product: the query heads (each first
 * normed by qn, where given: Qwen3's and Gemma 3's q_norm) rotated into q_out (H, D), and where qg_out is
 * given, rotated on by (gcos, gsin) into qg_out (Self-Extend's query at its grouped position); the key
 * heads (normed by kn where given) rotated and the value heads as they are, rounded to the cache's type,
 * into slot `slot` of each KV head's cells (`k_stride`/`v_stride` elements apart). */
void rope_write(const float *qkv, long h, long hkv, long d, long rot, const float *cos, const float *sin,
                void *keys, void *values, long k_stride, long v_stride, long slot, int type, float *q_out,
                const float *gcos, const float *gsin, long grot, float *qg_out, const float *qn,
                const float *kn, float eps) {
    float row[d], normed[d];
    for (long r = 0; r < h + 2 * hkv; r++) {
        const float *x = qkv + r * d, *w = r < h ? qn : kn;
        if (r < h + hkv && w != NULL) {
            float f = inv_rms(x, d, eps);
            for (long i = 0; i < d; i++) normed[i] = w[i] * (x[i] * f);
            x = normed;
        }
        if (r < h + hkv) {
            rope(x, cos, sin, rot, d, row);
        } else {
            memcpy(row, x, d * sizeof(float));
        }
        if (r < h) {
            memcpy(q_out + r * d, row, d * sizeof(float));
            if (qg_out != NULL) rope(row, gcos, gsin, grot, d, qg_out + r * d);
            continue;
        }
        long g = r < h + hkv ? r - h : r - h - hkv;
        void *base = r < h + hkv ? keys : values;
        long at = g * (r < h + hkv ? k_stride : v_stride) + slot * d;
        if (type == F32) {
            memcpy((float *)base + at, row, d * sizeof(float));
        } else if (type == BF16) {
            for (long i = 0; i < d; i++) ((uint16_t *)base)[at + i] = to_bf16(row[i]);
        } else {
            for (long i = 0; i < d; i++) ((_Float16 *)base)[at + i] = (_Float16)row[i];
        }
    }
}

/* out = bf16(w * (x / sqrt(mean(x^2) + eps))) over n elements of float32 x and weight w: an RMSNorm (w is
 * the weight it scales by: Gemma's 1 + weight) and the rounding the quantized product after it takes. */
void rms_norm_bf16(const float *x, const float *w, long n, float eps, uint16_t *out) {
    float f = inv_rms(x, n, eps);
    for (long i = 0; i < n; i++) out[i] = to_bf16(w[i] * (x[i] * f));
}

/* x += w * (y / sqrt(mean(y^2) + eps)) over n elements, y float32 (type F32) or bfloat16 (BF16, a quantized
 * product's output): the norm Gemma applies to an attention or MLP output before the residual add. */
void rms_norm_add(const void *y, int type, const float *w, long n, float eps, float *x) {
    float yf[n];
    for (long i = 0; i < n; i++)
        yf[i] = type == F32 ? ((const float *)y)[i] : from_bf16(((const uint16_t *)y)[i]);
    float f = inv_rms(yf, n, eps);
    for (long i = 0; i < n; i++) x[i] += w[i] * (yf[i] * f);
}

enum { SILU = 0, GELU_TANH = 1 };

/* out = bf16(act(g) * u) for gu = [g, u], each n bfloat16 values: a gated MLP's activation between its two
 * quantized products, in float32. SILU: g * sigmoid(g). GELU_TANH (gelu_pytorch_tanh): g / 2 * (1 +
 * tanh(y)), y = sqrt(2 / pi) * (g + 0.044715 g^3), written g * sigmoid(2 y) (1 + tanh(y) cancels where y
 * is very negative). sigmoid(s) from e^-|s|, so nothing overflows. */
void gated_bf16(const uint16_t *gu, long n, int act, uint16_t *out) {
    for (long i = 0; i < n; i++) {
        float g = from_bf16(gu[i]), u = from_bf16(gu[n + i]);
        float s = act == SILU ? g : 1.5957691216057308f * (g + 0.044715f * g * g * g);
        float e = exp_neg(s > 0.0f ? -s : s);
        out[i] = to_bf16(g * (s > 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e)) * u);
    }
}

typedef int8_t i8x16 __attribute__((vector_size(16), aligned(1), may_alias));

/* 16 int8 -> 16 float32: one widening and one conversion (gcc 12 builds vector extensions' int8 -> float
 * element by element, so the instructions are named where the machine has them). */
#if defined(__AVX512F__)
#include <immintrin.h>
INLINE v16 widen(const int8_t *p) {
    __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    v16 out;
    memcpy(&out, &f, sizeof(out));
    return out;
}
#elif defined(__AVX2__)
#include <immintrin.h>
INLINE v16 widen(const int8_t *p) {
    __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
    __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8))));
    v16 out;
    memcpy(&out, &lo, 32);
    memcpy((char *)&out + 32, &hi, 32);
    return out;
}
#else
INLINE v16 widen(const int8_t *p) {
    v16 out;
    for (int l = 0; l < 16; l++) out[l] = (float)p[l];
    return out;
}
#endif

/* out (m, n): out[j][r] = bf16((x[j] . w[r]) * scale[r]) for m bfloat16 rows x (m, k) and int8 weight rows
 * w (n, k) with bfloat16 row scales: torch's _weight_int8pack_mm (float32 sums), the weight rows split over
 * the OpenMP threads and each read once for all m rows (a row's sums in the same order whatever m is, so a
 * row's output does not depend on the batch). Returns 1 (nothing written) when there is no scratch space. */
int int8_gemv(const uint16_t *x, const int8_t *w, const uint16_t *scale, long m, long n, long k,
              uint16_t *out) {
    float *xf = malloc(sizeof(float) * (m * k + 16));
    if (xf == NULL) return 1;
    for (long i = 0; i < m * k; i++) xf[i] = from_bf16(x[i]);
#pragma omp parallel for schedule(static)
    for (long r = 0; r < n; r++) {
        const int8_t *row = w + r * k;
        for (long j0 = 0; j0 < m; j0 += 4) { /* up to 4 rows share each widened weight vector */
            long mj = m - j0 < 4 ? m - j0 : 4;
            v16 a[4], b[4];
            for (long j = 0; j < mj; j++) a[j] = b[j] = (v16){0};
            long i = 0;
            for (; i + 32 <= k; i += 32) {
                v16 w0 = widen(row + i), w1 = widen(row + i + 16);
                for (long j = 0; j < mj; j++) {
                    const float *xj = xf + (j0 + j) * k;
                    a[j] += *(const v16 *)(xj + i) * w0;
                    b[j] += *(const v16 *)(xj + i + 16) * w1;
                }
            }
            for (long j = 0; j < mj; j++) {
                const float *xj = xf + (j0 + j) * k;
                float s = hsum(a[j] + b[j]);
                for (long t = i; t < k; t++) s += xj[t] * (float)row[t];
                out[(j0 + j) * n + r] = to_bf16(s * from_bf16(scale[r]));
            }
        }
    }
    free(xf);
    return 0;
}

/* decode_layers: every decoder layer of one token for m sequences in one call, the same kernels in the
 * same order as the decode step's Python loop (so the same numbers, bit for bit): per layer the norm, the
 * q/k/v products (GGUF blocks through quant.c's quant_mm, handed in as `mm`), each row's rotation, cell
 * write and attention over its own cells, the output product added to the residual, the MLP likewise.
 * What it saves is the dozen Python calls and tensor allocations per layer around the kernels. */
typedef int (*quant_mm_fn)(int type, const uint8_t *w, long n_out, long n_in, const void *x, int x_type, long m,
                           void *y, int y_type, int portable);

enum { MAX_PARTS = 3 };

typedef struct { /* a GGUF block weight: n_out rows of blocks of `type` (quant.c's numbering) */
    const uint8_t *w;
    long n_out;
    long type;
} blocks;

typedef struct { /* one layer: RMSNorm factors (attn_norm, mlp_norm: Gemma's norms of the attention and MLP
                  * outputs, NULL for a plain add; qn, kn: head norms or NULL), the q/k/v bias ((H + 2 Hkv) D
                  * float32 in the fused order, NULL for none: Qwen2's), the norms' epsilons, the attention
                  * scale, and the weights (q/k/v and gate/up as runs of one type each) */
    const float *norm, *post_norm, *attn_norm, *mlp_norm, *qn, *kn, *qkv_bias;
    float norm_eps, post_eps, attn_eps, mlp_eps, head_eps, scale;
    long n_qkv, n_gu;
    blocks qkv[MAX_PARTS], gu[MAX_PARTS], o, down;
} layer_plan;

typedef struct { /* the model's sizes: hidden, query and KV heads, head size, intermediate size */
    long hidden, h, hkv, d, inter, act, cell_type, threads, portable;
} layer_dims;

/* A row's cells at a layer for this token, int64 each: the cells' addresses, KV-head strides (elements), the
 * slot claimed for the token, the first slot it attends, its rotation's (cos, sin) and their size; with
 * Self-Extend, the n_g grouped keys it scores (address, KV-head stride; n_g 0: none) and the rotation taking
 * the query to its grouped position. */
enum { R_KEYS, R_VALUES, R_K_STRIDE, R_V_STRIDE, R_SLOT, R_FIRST, R_COS, R_SIN, R_ROT };
enum { R_KG = R_ROT + 1, R_NG, R_KG_STRIDE, R_GCOS, R_GSIN, R_GROT, R_FIELDS };

/* Pieces per KV head for decode_attention (decode.py's _chunks). */
static long chunks_of(long hkv, long n, long threads) {
    long c = 1;
    while ((hkv * c) % threads && c < threads) c++;
    c = c < n / 64 ? c : n / 64;
    return c > 1 ? c : 1;
}

/* y (m, sum of n_out) bfloat16 = x . W^T for the parts side by side (tmp: m rows of the widest part). */
static int products(quant_mm_fn mm, const blocks *parts, long n_parts, long n_in, const void *x, int x_type,
                    long m, uint16_t *y, uint16_t *tmp, int portable) {
    long total = 0, at = 0;
    for (long p = 0; p < n_parts; p++) total += parts[p].n_out;
    for (long p = 0; p < n_parts; p++) {
        long n = parts[p].n_out;
        uint16_t *out = n_parts == 1 || m == 1 ? y + at : tmp;
        if (mm((int)parts[p].type, parts[p].w, n, n_in, x, x_type, m, out, BF16, portable)) return 1;
        if (out == tmp)
            for (long r = 0; r < m; r++) memcpy(y + r * total + at, tmp + r * n, n * sizeof(uint16_t));
        at += n;
    }
    return 0;
}

/* x (m, hidden) float32 += each layer's attention and MLP, in place. Returns 0, 1 where a product or the
 * attention found no scratch space, 2 for sizes the attention does not take. */
int decode_layers(const layer_plan *plans, long n_layers, const layer_dims *dm, const int64_t *rows, long m,
                  float *x, quant_mm_fn mm) {
    long hd = dm->hidden, h = dm->h, hkv = dm->hkv, d = dm->d, inter = dm->inter, nq = (h + 2 * hkv) * d;
    long wide = nq > 2 * inter ? nq : 2 * inter, width = dm->cell_type == F32 ? 4 : 2;
    int portable = (int)dm->portable, rc = 0;
    wide = wide > hd ? wide : hd;
    uint16_t *xn = malloc(sizeof(uint16_t) * m * hd), *big = malloc(sizeof(uint16_t) * m * wide);
    uint16_t *tmp = malloc(sizeof(uint16_t) * m * wide), *act = malloc(sizeof(uint16_t) * m * inter);
    float *qkvf = malloc(sizeof(float) * nq), *q = malloc(sizeof(float) * m * h * d);
    float *qg = malloc(sizeof(float) * m * h * d), *att = malloc(sizeof(float) * m * h * d);
    att_row *rows_att = malloc(sizeof(att_row) * m); /* each row's attention, all run in one parallel loop */
    if (!xn || !big || !tmp || !act || !qkvf || !q || !qg || !att || !rows_att) rc = 1;
    for (long l = 0; l < n_layers && rc == 0; l++) {
        const layer_plan *p = plans + l;
        for (long r = 0; r < m; r++) rms_norm_bf16(x + r * hd, p->norm, hd, p->norm_eps, xn + r * hd);
        if (products(mm, p->qkv, p->n_qkv, hd, xn, BF16, m, big, tmp, portable)) {
            rc = 1;
            break;
        }
        /* each row's query and cell first (a row's cell is written before the later rows of its cache read
         * it; its attention reads the cells up to its own only), then every row's attention at once */
        for (long r = 0; r < m; r++) {
            const int64_t *c = rows + (l * m + r) * R_FIELDS;
            const float *cos = (const float *)(intptr_t)c[R_COS], *sin = (const float *)(intptr_t)c[R_SIN];
            char *keys = (char *)(intptr_t)c[R_KEYS], *values = (char *)(intptr_t)c[R_VALUES];
            const float *gcos = (const float *)(intptr_t)c[R_GCOS], *gsin = (const float *)(intptr_t)c[R_GSIN];
            long first = c[R_FIRST], n = c[R_SLOT] + 1 - first, ng = c[R_NG];
            float *qr = q + r * h * d, *qgr = qg + r * h * d;
            for (long i = 0; i < nq; i++) qkvf[i] = from_bf16(big[r * nq + i]);
            if (p->qkv_bias != NULL) /* float32(bf16 product) + bias: products.py's blocks_product */
                for (long i = 0; i < nq; i++) qkvf[i] += p->qkv_bias[i];
            rope_write(qkvf, h, hkv, d, c[R_ROT], cos, sin, keys, values, c[R_K_STRIDE], c[R_V_STRIDE], c[R_SLOT],
                       (int)dm->cell_type, qr, ng > 0 ? gcos : cos, ng > 0 ? gsin : sin, ng > 0 ? c[R_GROT] : c[R_ROT],
                       ng > 0 ? qgr : NULL, p->qn, p->kn, p->head_eps);
            rows_att[r] = (att_row){qr, ng > 0 ? qgr : qr, keys + first * d * width, ng > 0 ? (const void *)(intptr_t)c[R_KG] : qr,
                                    values + first * d * width, n, ng, c[R_K_STRIDE], ng > 0 ? c[R_KG_STRIDE] : 0,
                                    c[R_V_STRIDE], chunks_of(hkv, n, dm->threads), 0, att + r * h * d,
                                    NULL, NULL, NULL, NULL};
        }
        int failed = attention_rows(rows_att, m, hkv, h / hkv, d, (int)dm->cell_type, p->scale);
        rc = failed == 2 ? 1 : failed ? 2 : 0;
        if (rc || mm((int)p->o.type, p->o.w, hd, h * d, att, F32, m, big, BF16, portable)) {
            rc = rc ? rc : 1;
            break;
        }
        for (long r = 0; r < m; r++) {
            if (p->attn_norm != NULL) rms_norm_add(big + r * hd, BF16, p->attn_norm, hd, p->attn_eps, x + r * hd);
            else
                for (long i = 0; i < hd; i++) x[r * hd + i] += from_bf16(big[r * hd + i]);
            rms_norm_bf16(x + r * hd, p->post_norm, hd, p->post_eps, xn + r * hd);
        }
        if (products(mm, p->gu, p->n_gu, hd, xn, BF16, m, big, tmp, portable)) {
            rc = 1;
            break;
        }
        for (long r = 0; r < m; r++) gated_bf16(big + r * 2 * inter, inter, (int)dm->act, act + r * inter);
        if (mm((int)p->down.type, p->down.w, hd, inter, act, BF16, m, big, BF16, portable)) {
            rc = 1;
            break;
        }
        for (long r = 0; r < m; r++) {
            if (p->mlp_norm != NULL) rms_norm_add(big + r * hd, BF16, p->mlp_norm, hd, p->mlp_eps, x + r * hd);
            else
                for (long i = 0; i < hd; i++) x[r * hd + i] += from_bf16(big[r * hd + i]);
        }
    }
    free(xn);
    free(big);
    free(tmp);
    free(act);
    free(qkvf);
    free(q);
    free(qg);
    free(rows_att);
    free(att);
    return rc;
}
