/* What kquant.c's driver of the K-quants' 8-row interleaved forms (mm_kx8) takes from their vector loops
 * (kquant_x8.c). */
#ifndef SELFEXTEND_KQUANT_X8_H
#define SELFEXTEND_KQUANT_X8_H
#include "quant.h"

/* A group of 8 interleaved weight rows (nb super-blocks) times R activation rows x[r] (xqk blocks) into
 * out[r * 8 + k]: the function at index R of a type's tiles. */
typedef void (*group_fn)(const uint8_t *w, const void *const *x, long nb, float *out);

enum { KX8_TILE = 8 }; /* the most activation rows any type's tile takes */

/* The vector tiles of `type` (Q4_KX8, Q5_KX8 or Q6_KX8), [R] for R = 1..*most, *most set to the rows its
 * largest tile takes; NULL (and *most left) where AVX2 is not compiled for. */
const group_fn *kquant_x8_tiles(int type, int *most);
#endif
