#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
int main() {
  size_t n = 200u << 20; float *a = aligned_alloc(64, n); for (size_t i = 0; i < n / 4; i++) a[i] = 1;
  for (int th = 1; th <= 2; th++) {
    double best = 1e9; float tot = 0;
    for (int rep = 0; rep < 10; rep++) {
      double t0 = now();
      #pragma omp parallel num_threads(th) reduction(+:tot)
      { __m256 s = _mm256_setzero_ps(), s2 = s; int t = omp_get_thread_num();
        size_t per = n / 4 / th; const float *p = a + t * per;
        for (size_t i = 0; i < per; i += 16) { s = _mm256_add_ps(s, _mm256_load_ps(p + i)); s2 = _mm256_add_ps(s2, _mm256_load_ps(p + i + 8)); }
        float o[8]; _mm256_storeu_ps(o, _mm256_add_ps(s, s2)); tot += o[0]; }
      double dt = now() - t0; if (dt < best) best = dt;
    }
    printf("%d threads: %.1f GB/s (%g)\n", th, n / best / 1e9, tot);
  }
}
