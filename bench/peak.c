/* Peak float32 FMA throughput of this CPU: every thread runs independent chains of vector FMAs that stay in
 * registers, so nothing but the FMA units limits it: enough chains to cover two FMA units' latency, few enough
 * that they and the two operands fit the ISA's registers (16 chains + 2 operands spilled AVX2's 16 ymm registers
 * to the stack and read 40% below the real peak). Built and run by bench/roofline.py with -march=native
 * (or -mavx2 -mfma, `--isa avx2`: the AVX2 peak on any CPU).
 * Usage: peak THREADS [cpu] -> prints GFLOP/s (best of 5 runs); with `cpu`, per second of process CPU time rather
 * than of wall time (on a shared host the wall clock measures the share of a core this process got). */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(__AVX512F__)
typedef __m512 vec;
#define LANES 16
#define SET1 _mm512_set1_ps
#define STOREU _mm512_storeu_ps
#define FMA _mm512_fmadd_ps
#define CHAINS 16 /* of 32 zmm registers */
#elif defined(__AVX2__) && defined(__FMA__)
typedef __m256 vec;
#define LANES 8
#define SET1 _mm256_set1_ps
#define STOREU _mm256_storeu_ps
#define FMA _mm256_fmadd_ps
#define CHAINS 12 /* of 16 ymm registers */
#else
#error "needs AVX2+FMA or AVX-512"
#endif

static int cpu_clock;
static double now(void) { return cpu_clock ? (double)clock() / CLOCKS_PER_SEC : omp_get_wtime(); }

int main(int argc, char **argv) {
    int threads = argc > 1 ? atoi(argv[1]) : 1;
    cpu_clock = argc > 2 && strcmp(argv[2], "cpu") == 0;
    long iters = 50000000;
    double best = 0;
    float sink = 0;
    omp_set_num_threads(threads);
    for (int run = 0; run < 5; run++) {
        double start = now();
#pragma omp parallel reduction(+ : sink)
        {
            vec acc[CHAINS], b = SET1(0.999999f), c = SET1(1e-7f);
            for (int i = 0; i < CHAINS; i++) acc[i] = SET1((float)i);
            for (long it = 0; it < iters; it++) {
#pragma GCC unroll 16
                for (int i = 0; i < CHAINS; i++) acc[i] = FMA(acc[i], b, c);
            }
            float lanes[LANES];
            for (int i = 0; i < CHAINS; i++) {
                STOREU(lanes, acc[i]);
                for (int l = 0; l < LANES; l++) sink += lanes[l];
            }
        }
        double gflops = (double)iters * threads * CHAINS * LANES * 2 / (now() - start) / 1e9;
        if (gflops > best) best = gflops;
    }
    printf("%.1f\n", best + 0 * sink);
    return 0;
}
