/* Rows looked up in the 8-row interleaved forms (Q4_0X8, Q4_1X8, Q8_0X8 and the K-quants', blocks.py's pack8):
 * an embedding table tied to an output head held interleaved reads its token rows from the head's bytes,
 * so that the file's table is held once, not once as stored and once interleaved (SmolLM2's Q8_0 table
 * 28.7 MiB, Gemma 3's 170 MiB). Row r is lane r % 8 of group r / 8, dequantized by its family's loops:
 * the row alone (loops' row: legacy.c's forms), else its whole group (loops' dequant: the K-quants' forms),
 * the row kept; gguf's values either way. */
#include "quant.h"

/* y (n, n_in) float32 = rows ids[0..n) of the n_rows rows (a multiple of 8) of W of the interleaved `type`,
 * held as groups of 8 rows of row_bytes each: gguf's dequantized values of the stored rows, bit for bit. A
 * decode step looks up a row and a prompt a row a token, in one call: small beside the products of the
 * token, even where a row costs its group's dequantisation (8 rows of n_in values). Returns 0, 1 where
 * scratch memory could not be had, 2 for a type or size it does not take (a stored type among them:
 * quant_rows_f32 takes those), 3 for an id outside [0, n_rows) (nothing read). */
int quant_rows_x8_f32(int type, const uint8_t *w, long row_bytes, long n_rows, const int64_t *ids, long n,
                      long n_in, float *y) {
    long bv = block_values(type);
    loops L;
    if (bv == 0 || !IS_X8(type) || n_in % bv != 0 || n < 0 || row_bytes != n_in / bv * block_bytes(type)) return 2;
    if (n_rows % 8 != 0 || !find_loops(type, 1, &L) || L.dequant == NULL) return 2;
    for (long i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= n_rows) return 3;
    int failed = 0;
#pragma omp parallel if (n > 64) reduction(| : failed)
    {
        float *group = L.row != NULL ? NULL : malloc(8 * n_in * sizeof(float)); /* a whole group's values */
        if (L.row == NULL && group == NULL) failed = 1;
#pragma omp for schedule(static)
        for (long i = 0; i < n; i++) {
            const uint8_t *at = w + ids[i] / 8 * 8 * row_bytes;
            if (L.row != NULL) {
                L.row(type, at, n_in / bv, (int)(ids[i] % 8), y + i * n_in);
                continue;
            }
            if (group == NULL) continue; /* every thread meets the loop; the call fails as a whole */
            L.dequant(type, at, n_in / bv, group);
            memcpy(y + i * n_in, group + ids[i] % 8 * n_in, n_in * sizeof(float));
        }
        free(group);
    }
    return failed;
}
