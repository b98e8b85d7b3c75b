// Microbenchmark: 4-bit affine weights (group 32, MLX nibble order) times M rows of x:
// (a) float path: widen 8 weights by fma(q, s, b), then fma into acc per row (as packed_linear's AVX2 path, R=4)
// (b) int8 path: x quantized per group of 32 to int8; maddubs of u4 weights with s8 x; scale after.
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <time.h>

typedef struct { int N, K; uint8_t *w; float *s, *b; } Mat;
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static float hsum(__m256 v) { __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s)); return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1))); }

static void float_rows(const Mat *m, const float *x, int M, float *y, int n0, int n1) {
  const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28), low4 = _mm256_set1_epi32(15);
  int K = m->K, G = K / 32;
  for (int n = n0; n < n1; n += 4) {
    __m256 acc[6][4];
    for (int r = 0; r < M; r++) for (int j = 0; j < 4; j++) acc[r][j] = _mm256_setzero_ps();
    for (int g = 0; g < G; g++) for (int k = g * 32; k < g * 32 + 32; k += 8) {
      __m256 u[4];
      for (int j = 0; j < 4; j++) {
        int32_t word; memcpy(&word, m->w + (size_t)(n + j) * K / 2 + k / 2, 4);
        __m256i q = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(word), shifts), low4);
        u[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), _mm256_broadcast_ss(m->s + (size_t)(n + j) * G + g),
                               _mm256_broadcast_ss(m->b + (size_t)(n + j) * G + g));
      }
      for (int r = 0; r < M; r++) { __m256 xv = _mm256_loadu_ps(x + r * K + k);
        for (int j = 0; j < 4; j++) acc[r][j] = _mm256_fmadd_ps(u[j], xv, acc[r][j]); }
    }
    for (int r = 0; r < M; r++) for (int j = 0; j < 4; j++) y[r * m->N + n + j] = hsum(acc[r][j]);
  }
}

// x quantized: per row, per group: 32 int8 in nibble order (even elements then odd), d (scale), xsum*d
static void quant_x(const float *x, int M, int K, int8_t *xq, float *d, float *ds) {
  int G = K / 32;
  for (int r = 0; r < M; r++) for (int g = 0; g < G; g++) {
    const float *v = x + r * K + g * 32; float amax = 0;
    for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(v[i]));
    float dd = amax / 127.f, id = dd > 0 ? 1.f / dd : 0; int sum = 0;
    int8_t *o = xq + (size_t)(r * G + g) * 32;
    for (int i = 0; i < 16; i++) { int a = (int)lrintf(v[2 * i] * id), b = (int)lrintf(v[2 * i + 1] * id);
      o[i] = a; o[16 + i] = b; sum += a + b; }
    d[r * G + g] = dd; ds[r * G + g] = dd * sum;
  }
}

/* Every row of x (up to 6) per pass over 2 weight rows, each group's weights unpacked once for all of them. */
static void int8_rows(const Mat *m, const int8_t *xq, const float *d, const float *ds, int M, float *y, int n0, int n1) {
  int K = m->K, G = K / 32;
  const __m128i lo4 = _mm_set1_epi8(15); const __m256i ones = _mm256_set1_epi16(1);
  for (int n = n0; n < n1; n += 2) {
    __m256 acc[6][2]; float bias[6][2] = {{0}};
    for (int r = 0; r < M; r++) for (int j = 0; j < 2; j++) acc[r][j] = _mm256_setzero_ps();
    for (int g = 0; g < G; g++) {
      __m256i q[2]; float sc[2], bi[2];
      for (int j = 0; j < 2; j++) {
        __m128i v = _mm_loadu_si128((const __m128i *)(m->w + (size_t)(n + j) * K / 2 + g * 16));
        q[j] = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), lo4), _mm_and_si128(v, lo4));
        sc[j] = m->s[(size_t)(n + j) * G + g]; bi[j] = m->b[(size_t)(n + j) * G + g];
      }
      for (int r = 0; r < M; r++) {
        __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + (size_t)(r * G + g) * 32));
        float dd = d[r * G + g], dsum = ds[r * G + g];
        for (int j = 0; j < 2; j++) {
          __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(q[j], xv), ones);
          acc[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(sc[j] * dd), acc[r][j]);
          bias[r][j] += bi[j] * dsum;
        }
      }
    }
    for (int r = 0; r < M; r++) for (int j = 0; j < 2; j++) y[r * m->N + n + j] = hsum(acc[r][j]) + bias[r][j];
  }
}


static void int8_rows_opt(const Mat *m, const int8_t *xq, const float *d, const float *ds, int M, float *y, int n0, int n1) {
  int K = m->K, G = K / 32;
  const __m128i lo4 = _mm_set1_epi8(15); const __m256i ones = _mm256_set1_epi16(1);
  float sd[4][64];
  for (int n = n0; n < n1; n += 4) {
    for (int r = 0; r < M; r++) {
      const float *dr = d + r * G, *dsr = ds + r * G;
      __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
      float bias[4];
      for (int j = 0; j < 4; j++) {
        const float *sr = m->s + (size_t)(n + j) * G, *br = m->b + (size_t)(n + j) * G; float bb = 0;
        for (int g = 0; g < G; g++) { sd[j][g] = sr[g] * dr[g]; bb += br[g] * dsr[g]; }
        bias[j] = bb;
      }
      const int8_t *xr = xq + (size_t)r * G * 32;
      for (int g = 0; g < G; g++) {
        __m256i xv = _mm256_loadu_si256((const __m256i *)(xr + g * 32));
        for (int j = 0; j < 4; j++) {
          __m128i v = _mm_loadu_si128((const __m128i *)(m->w + (size_t)(n + j) * K / 2 + g * 16));
          __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), lo4), _mm_and_si128(v, lo4));
          __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(q, xv), ones);
          acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcast_ss(&sd[j][g]), acc[j]);
        }
      }
      for (int j = 0; j < 4; j++) y[r * m->N + n + j] = hsum(acc[j]) + bias[j];
    }
  }
}


/* Tuned several-row pass: 2 weight rows a pass; per pass and row of x, the scale products (weight scale x
   activation scale) of every group computed once, and the bias term as one dot product; per group the weights
   unpacked once and each row of x costs maddubs + madd + convert + multiply-add per 32 weights. */
static void int8_rows_multi2(const Mat *m, const int8_t *xq, const float *d, const float *ds, int M, float *y, int n0, int n1) {
  int K = m->K, G = K / 32;
  const __m128i lo4 = _mm_set1_epi8(15); const __m256i ones = _mm256_set1_epi16(1);
  float sd[6][2][64] __attribute__((aligned(32)));
  for (int n = n0; n < n1; n += 2) {
    __m256 acc[6][2]; float bias[6][2];
    for (int r = 0; r < M; r++) for (int j = 0; j < 2; j++) {
      const float *sr = m->s + (size_t)(n + j) * G, *br = m->b + (size_t)(n + j) * G, *dr = d + r * G, *dsr = ds + r * G;
      float bb = 0;
      for (int g = 0; g < G; g++) { sd[r][j][g] = sr[g] * dr[g]; bb += br[g] * dsr[g]; }
      bias[r][j] = bb; acc[r][j] = _mm256_setzero_ps();
    }
    const uint8_t *w0 = m->w + (size_t)n * K / 2, *w1 = w0 + K / 2;
    for (int g = 0; g < G; g++) {
      __m128i v0 = _mm_loadu_si128((const __m128i *)(w0 + g * 16)), v1 = _mm_loadu_si128((const __m128i *)(w1 + g * 16));
      __m256i q0 = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v0, 4), lo4), _mm_and_si128(v0, lo4));
      __m256i q1 = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v1, 4), lo4), _mm_and_si128(v1, lo4));
      for (int r = 0; r < M; r++) {
        __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + (size_t)(r * G + g) * 32));
        __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(q0, xv), ones);
        __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(q1, xv), ones);
        acc[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_broadcast_ss(&sd[r][0][g]), acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_broadcast_ss(&sd[r][1][g]), acc[r][1]);
      }
    }
    for (int r = 0; r < M; r++) for (int j = 0; j < 2; j++) y[r * m->N + n + j] = hsum(acc[r][j]) + bias[r][j];
  }
}

int main(int argc, char **argv) {
  int M = argc > 1 ? atoi(argv[1]) : 1;
  int shapes[4][2] = {{960, 576}, {576, 576}, {3072, 576}, {576, 1536}};
  int L = 30; Mat mats[120];
  srand(1);
  for (int l = 0; l < L; l++) for (int i = 0; i < 4; i++) {
    Mat *m = &mats[l * 4 + i]; m->N = shapes[i][0]; m->K = shapes[i][1];
    size_t nw = (size_t)m->N * m->K; m->w = aligned_alloc(64, nw / 2);
    for (size_t j = 0; j < nw / 2; j++) m->w[j] = rand();
    m->s = malloc(nw / 32 * 4); m->b = malloc(nw / 32 * 4);
    for (size_t j = 0; j < nw / 32; j++) { m->s[j] = 0.01f * (1 + rand() % 7); m->b[j] = -0.05f * (rand() % 3); }
  }
  float *x = malloc(6 * 1536 * 4), *y = malloc(6 * 3072 * 4), *y2 = malloc(6 * 3072 * 4);
  for (int i = 0; i < 6 * 1536; i++) x[i] = (rand() / (float)RAND_MAX - 0.5f) * 2;
  int8_t *xq = malloc(6 * 1536); float *d = malloc(6 * 48 * 4), *ds = malloc(6 * 48 * 4);
  for (int mode = 0; mode < 4; mode++) {
    double best = 1e9;
    for (int rep = 0; rep < 30; rep++) {
      double t0 = now();
      for (int i = 0; i < 120; i++) {
        Mat *m = &mats[i];
        if (mode >= 1) quant_x(x, M, m->K, xq, d, ds);
        #pragma omp parallel num_threads(2)
        { int t = omp_get_thread_num(); int chunk = (m->N / 2 + 15) & ~15; int n0 = t * chunk, n1 = n0 + chunk < m->N ? n0 + chunk : m->N;
          if (mode == 0) float_rows(m, x, M, y, n0, n1); else if (mode == 1) int8_rows(m, xq, d, ds, M, y2, n0, n1); else if (mode == 2) int8_rows_opt(m, xq, d, ds, M, y2, n0, n1); else int8_rows_multi2(m, xq, d, ds, M, y2, n0, n1); }
      }
      double dt = now() - t0; if (dt < best) best = dt;
    }
    printf("M %d %s: %.2f ms for the 120 products\n", M, mode == 3 ? "int8-multi2" : mode == 2 ? "int8-opt" : mode ? "int8" : "float", best * 1e3);
  }
  // accuracy on the last matrix
  Mat *m = &mats[119]; quant_x(x, M, m->K, xq, d, ds); float_rows(m, x, M, y, 0, m->N); int8_rows(m, xq, d, ds, M, y2, 0, m->N);
  double e = 0, r = 0; for (int i = 0; i < m->N; i++) { e += fabs(y[i] - y2[i]); r += fabs(y[i]); }
  printf("mean |diff| / mean |y| = %.4f\n", e / r);
  float *y3 = malloc(6 * 3072 * 4); int8_rows_opt(m, xq, d, ds, M, y3, 0, m->N);
  double e3 = 0; for (int i = 0; i < m->N; i++) e3 += fabs(y3[i] - y2[i]);
  printf("opt vs int8: mean |diff| %.2e\n", e3 / m->N);
}
