/* The machine's read bandwidth as STREAM measures it: every thread sums its own contiguous part of a buffer
 * well past the last-level cache, with 8 independent accumulators of 16 lanes (wide vector loads, no
 * dependency chain through one register), so the loop is not what limits it; the best of several passes.
 * A decode step that reads its weights at this rate is at the memory's limit. */
#include <omp.h>

#define ACC 8
#define LANES 16

/* Seconds of the fastest of `passes` reads of x[0..n) (float32) by the current OpenMP threads; *sink gets
 * the last pass's sum (so the reads are not optimised away). Returns -1 for n < 1 or passes < 1. */
double stream_read_seconds(const float *x, long n, int passes, float *sink) {
    if (n < 1 || passes < 1) return -1.0;
    double best = -1.0;
    for (int p = 0; p < passes; p++) {
        float total = 0.0f;
        double t0 = omp_get_wtime();
#pragma omp parallel reduction(+ : total)
        {
            long t = omp_get_thread_num(), nt = omp_get_num_threads();
            long lo = n * t / nt, hi = n * (t + 1) / nt;
            float acc[ACC][LANES] = {{0}};
            long i = lo;
            for (; i + ACC * LANES <= hi; i += ACC * LANES)
                for (int a = 0; a < ACC; a++)
                    for (int l = 0; l < LANES; l++) acc[a][l] += x[i + a * LANES + l];
            float s = 0.0f;
            for (; i < hi; i++) s += x[i];
            for (int a = 0; a < ACC; a++)
                for (int l = 0; l < LANES; l++) s += acc[a][l];
            total += s;
        }
        double dt = omp_get_wtime() - t0;
        if (best < 0 || dt < best) best = dt;
        *sink = total;
    }
    return best;
}
