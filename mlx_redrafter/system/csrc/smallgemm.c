/* Small-M matrix products for MLX's CPU backend on x86-64 (AVX-512, else AVX2 + FMA).
 *
 * MLX computes every float32 matrix product through cblas_sgemm. Loaded with RTLD_GLOBAL before the optimized
 * BLAS (see blas.py), this library's cblas_sgemm is the one MLX calls: it handles y = x W^T with few rows of x
 * (decode steps and the verification of draft tokens, batched too) by streaming each weight row once and computing
 * all M dot products from it, and hands every other product to the real BLAS. On AVX-512 it takes every M: more
 * than 32 rows of x (prefills, large batches) run as blocks of 64 weight rows, each times every 32-row chunk of x
 * while it sits in cache; measured on an AMD EPYC, 1.4-2.2x faster than MKL (whose AMD code path is AVX2) from 33 to
 * 512 rows. On AVX2 + FMA it takes M <= 128 (past 8 rows: tiles of 3 weight rows times chunks of 3-4 rows of x),
 * where it is faster than MKL on Zen 3 (past 128 rows MKL is). Each output element is computed in the same order
 * whatever M is, so a token's logits do not depend on how many tokens were verified or prefilled with it (on AVX2,
 * up to 128).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>
#include <stdlib.h>

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *, int, float,
                         float *, int);
static sgemm_fn fallback = 0;
static int n_threads = 1;
static long fast_calls = 0, slow_calls = 0;
static int enabled = 1;

void redrafter_gemm_init(void *real_sgemm, int threads) {
    fallback = (sgemm_fn)real_sgemm;
    n_threads = threads > 0 ? threads : 1;
}
void redrafter_gemm_set_threads(int threads) { n_threads = threads > 0 ? threads : 1; }
void redrafter_gemm_enable(int on) { enabled = on; }
long redrafter_gemm_calls(int fast) { return fast ? fast_calls : slow_calls; }
/* Bumped whenever the kernels' speed changes, so costs measured with an older build are measured again. */
int redrafter_gemm_version(void) { return 9; }

#if defined(__x86_64__)
#include <immintrin.h>
#include <omp.h>

/* One tile: R weight rows [n, n + R) times MM rows of x, MM * R accumulators, each one chain of LANES-wide
 * multiply-adds over k and one horizontal sum, in the same order in every kernel of an instruction set. With pf,
 * the next tile's weight rows are prefetched (one line per row each 16 values of k) while this one computes: without
 * it the hardware prefetcher falls behind once the arithmetic per weight row grows (AVX-512: a product over 8 rows
 * took twice the time of one). */
#define TILE(P, TARGET, VEC, LANES, ZERO, LOAD, FMA, REDUCE, HINT, MM, R)                                    \
    __attribute__((target(TARGET))) static inline void P##_##MM##_##R(const float *x, const float *w,       \
                                                                     float *y, int K, int ldy, int n,       \
                                                                     int pf) {                              \
        VEC acc[MM][R];                                                                                      \
        for (int m = 0; m < MM; m++)                                                                         \
            for (int r = 0; r < R; r++) acc[m][r] = ZERO;                                                    \
        for (int k = 0; k < K; k += LANES) {                                                                 \
            VEC wv[R];                                                                                       \
            if (pf && (k & 15) == 0)                                                                         \
                for (int r = 0; r < R; r++) _mm_prefetch((const char *)(w + (size_t)(n + R + r) * K + k), HINT); \
            for (int r = 0; r < R; r++) wv[r] = LOAD(w + (size_t)(n + r) * K + k);                           \
            for (int m = 0; m < MM; m++) {                                                                   \
                VEC xv = LOAD(x + (size_t)m * K + k);                                                        \
                for (int r = 0; r < R; r++) acc[m][r] = FMA(wv[r], xv, acc[m][r]);                           \
            }                                                                                                \
        }                                                                                                    \
        for (int m = 0; m < MM; m++)                                                                         \
            for (int r = 0; r < R; r++) y[(size_t)m * ldy + n + r] = REDUCE(acc[m][r]);                      \
    }
#define BLOCK(MM, R)                                                                                         \
    TILE(b, "avx512f", __m512, 16, _mm512_setzero_ps(), _mm512_loadu_ps, _mm512_fmadd_ps, _mm512_reduce_add_ps, \
         _MM_HINT_T2, MM, R)
BLOCK(1, 12) BLOCK(2, 10) BLOCK(3, 8) BLOCK(3, 6) BLOCK(4, 6) BLOCK(4, 5) BLOCK(5, 5) BLOCK(5, 4) BLOCK(6, 4)
BLOCK(1, 1) BLOCK(2, 1) BLOCK(3, 1) BLOCK(4, 1) BLOCK(5, 1) BLOCK(6, 1)

/* M <= 6 rows of x: one chunk, blocks of R weight rows (M * R accumulators). */
#define ROWS1(M, R)                                                                                          \
    __attribute__((target("avx512f"))) static void k_##M(const float *x, const float *w, float *y, int K,   \
                                                         int ldy, int n0, int n1) {                         \
        int n = n0;                                                                                          \
        for (; n + R <= n1; n += R) b_##M##_##R(x, w, y, K, ldy, n, 1);                                      \
        for (; n < n1; n++) b_##M##_1(x, w, y, K, ldy, n, 0);                                                \
    }
ROWS1(1, 12) ROWS1(2, 10) ROWS1(3, 8) ROWS1(4, 6) ROWS1(5, 5) ROWS1(6, 4)

/* More rows: `chunks` chunks, the first `big` of S rows and the rest of S - 1, that share every block of R weight
 * rows: the weights come from memory once whatever M is, the later chunks read the block from L1. Chunks of 7 or
 * 8 rows (R = 3) measured up to 1.8x slower per row in a model's forward than chunks of 4-6, so there are none. */
#define CHUNKS(S, T, R)                                                                                      \
    __attribute__((target("avx512f"))) static void c_##S(const float *x, const float *w, float *y, int K,   \
                                                         int ldy, int n0, int n1, int chunks, int big) {    \
        int n = n0;                                                                                          \
        for (; n + R <= n1; n += R)                                                                          \
            for (int c = 0, m = 0; c < chunks; c++) {                                                        \
                if (c < big)                                                                                 \
                    b_##S##_##R(x + (size_t)m * K, w, y + (size_t)m * ldy, K, ldy, n, c == 0), m += S;       \
                else                                                                                         \
                    b_##T##_##R(x + (size_t)m * K, w, y + (size_t)m * ldy, K, ldy, n, c == 0), m += T;       \
            }                                                                                                \
        for (; n < n1; n++)                                                                                  \
            for (int c = 0, m = 0; c < chunks; c++) {                                                        \
                if (c < big)                                                                                 \
                    b_##S##_1(x + (size_t)m * K, w, y + (size_t)m * ldy, K, ldy, n, 0), m += S;              \
                else                                                                                         \
                    b_##T##_1(x + (size_t)m * K, w, y + (size_t)m * ldy, K, ldy, n, 0), m += T;              \
            }                                                                                                \
    }
CHUNKS(4, 3, 6) CHUNKS(5, 4, 5) CHUNKS(6, 5, 4)

enum { CHUNK_ROWS = 6, MAX_ROWS_AVX512 = 32, BLOCK_N = 64, MAX_ROWS_AVX2 = 128 };
typedef void (*kernel_fn)(const float *, const float *, float *, int, int, int, int);
static const kernel_fn avx512_kernels[CHUNK_ROWS + 1] = {0, k_1, k_2, k_3, k_4, k_5, k_6};

/* y (M, ldy) [n0, n1) = x (M, K) w[n0:n1]^T for M <= MAX_ROWS_AVX512: ceil(M / 6) chunks of nearly equal size. */
__attribute__((target("avx512f"))) static void rows512(const float *x, const float *w, float *y, int M, int K,
                                                       int ldy, int n0, int n1) {
    if (M <= CHUNK_ROWS) {
        avx512_kernels[M](x, w, y, K, ldy, n0, n1);
        return;
    }
    int chunks = (M + CHUNK_ROWS - 1) / CHUNK_ROWS, small = M / chunks, extra = M % chunks;
    int S = small + (extra > 0), big = extra > 0 ? extra : chunks;
    if (S == 4) c_4(x, w, y, K, ldy, n0, n1, chunks, big);
    else if (S == 5) c_5(x, w, y, K, ldy, n0, n1, chunks, big);
    else c_6(x, w, y, K, ldy, n0, n1, chunks, big);
}

/* The same kernels on 8-lane AVX2 + FMA registers (16 of them: at most 8 accumulators). */
__attribute__((target("avx2,fma"))) static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}

#define KERNEL2(MM, R)                                                                                       \
    __attribute__((target("avx2,fma"))) static void a_##MM##_##R(const float *x, const float *w, float *y,  \
                                                                 int K, int ldy, int n0, int n1) {          \
        int n = n0;                                                                                          \
        for (; n + R <= n1; n += R) {                                                                        \
            __m256 acc[MM][R];                                                                               \
            for (int m = 0; m < MM; m++)                                                                     \
                for (int r = 0; r < R; r++) acc[m][r] = _mm256_setzero_ps();                                 \
            for (int k = 0; k < K; k += 8) {                                                                 \
                __m256 wv[R];                                                                                \
                if ((k & 15) == 0) /* the next block's rows: keeps enough loads in flight when MM is large */ \
                    for (int r = 0; r < R; r++) _mm_prefetch((const char *)(w + (size_t)(n + R + r) * K + k), _MM_HINT_T2); \
                for (int r = 0; r < R; r++) wv[r] = _mm256_loadu_ps(w + (size_t)(n + r) * K + k);            \
                for (int m = 0; m < MM; m++) {                                                               \
                    __m256 xv = _mm256_loadu_ps(x + (size_t)m * K + k);                                      \
                    for (int r = 0; r < R; r++) acc[m][r] = _mm256_fmadd_ps(wv[r], xv, acc[m][r]);           \
                }                                                                                            \
            }                                                                                                \
            for (int m = 0; m < MM; m++)                                                                     \
                for (int r = 0; r < R; r++) y[(size_t)m * ldy + n + r] = hsum256(acc[m][r]);                 \
        }                                                                                                    \
        for (; n < n1; n++) {                                                                                \
            __m256 acc[MM];                                                                                  \
            for (int m = 0; m < MM; m++) acc[m] = _mm256_setzero_ps();                                       \
            for (int k = 0; k < K; k += 8) {                                                                 \
                __m256 wv = _mm256_loadu_ps(w + (size_t)n * K + k);                                          \
                for (int m = 0; m < MM; m++)                                                                 \
                    acc[m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + (size_t)m * K + k), acc[m]);             \
            }                                                                                                \
            for (int m = 0; m < MM; m++) y[(size_t)m * ldy + n] = hsum256(acc[m]);                           \
        }                                                                                                    \
    }
/* AVX2 tiles for many rows of x: R = 3 weight rows (read from L1 by every chunk of x once the first has loaded
 * them, which prefetches the next tile into L2) times MM <= 4 rows of x: 12 accumulators, 3 weight vectors and one
 * row of x fill the 16 registers (tiles of 4 weight rows x 3 rows of x need 17, and gcc kept an accumulator on the
 * stack: a store and a reload in its chain every 8 values of k; the data engine's 64-row step ran 1.05-1.08x slower).
 * Past 8 rows, chunks of up to 8 rows against one weight row at a time (the kernels above) ran at 35-60% of the
 * speed of tiles on Zen 3. */
#define TILE2(MM, R)                                                                                         \
    TILE(t, "avx2,fma", __m256, 8, _mm256_setzero_ps(), _mm256_loadu_ps, _mm256_fmadd_ps, hsum256, _MM_HINT_T1, \
         MM, R)
TILE2(4, 3) TILE2(3, 3) TILE2(4, 1) TILE2(3, 1)

KERNEL2(1, 8)
KERNEL2(2, 4)
KERNEL2(3, 2)
KERNEL2(4, 2)
KERNEL2(5, 1)
KERNEL2(6, 1)
KERNEL2(7, 1)
KERNEL2(8, 1)
static const kernel_fn avx2_kernels[9] = {0, a_1_8, a_2_4, a_3_2, a_4_2, a_5_1, a_6_1, a_7_1, a_8_1};

static int avx512_off = 0; /* set by redrafter_gemm_use_avx512(0): the AVX2 kernels on an AVX-512 machine */
static int has_avx512(void) {
    static int ok = -1;
    if (ok < 0) ok = __builtin_cpu_supports("avx512f") ? 1 : 0;
    return ok && !avx512_off;
}

/* y (M, ldy) [n0, n1) = x (M, K) w[n0:n1]^T; every element summed in the same order whatever M is. */
static void rows(const float *x, const float *w, float *y, int M, int K, int ldy, int n0, int n1) {
    if (has_avx512()) {
        if (M <= MAX_ROWS_AVX512) {
            rows512(x, w, y, M, K, ldy, n0, n1);
            return;
        }
        for (int nb = n0; nb < n1; nb += BLOCK_N) { /* a block of weight rows from memory once, then from cache */
            int ne = nb + BLOCK_N < n1 ? nb + BLOCK_N : n1;
            for (int m = 0; m < M; m += MAX_ROWS_AVX512)
                rows512(x + (size_t)m * K, w, y + (size_t)m * ldy, M - m < MAX_ROWS_AVX512 ? M - m : MAX_ROWS_AVX512,
                        K, ldy, nb, ne);
        }
        return;
    }
    if (M <= 8) {
        avx2_kernels[M](x, w, y, K, ldy, n0, n1);
        return;
    }
    /* More rows: each tile of 3 weight rows times every chunk of x (4 rows, some of 3: M >= 9 never leaves fewer)
       while it sits in L1; the first chunk prefetches the next tile into L2 (+5-10% where the weights come from
       memory; it cost as much where a tile is past 16 KB, the MLP's down weight). */
    int chunks = (M + 3) / 4, small = M / chunks, big = M % chunks, pf = K <= 1024;
    int n = n0;
    for (; n + 3 <= n1; n += 3)
        for (int c = 0, m = 0; c < chunks; m += small + (c < big), c++) {
            int ahead = pf && c == 0 && n + 6 <= n1;
            if (small + (c < big) == 4) t_4_3(x + (size_t)m * K, w, y + (size_t)m * ldy, K, ldy, n, ahead);
            else t_3_3(x + (size_t)m * K, w, y + (size_t)m * ldy, K, ldy, n, ahead);
        }
    for (; n < n1; n++)
        for (int c = 0, m = 0; c < chunks; m += small + (c < big), c++) {
            if (small + (c < big) == 4) t_4_1(x + (size_t)m * K, w, y + (size_t)m * ldy, K, ldy, n, 0);
            else t_3_1(x + (size_t)m * K, w, y + (size_t)m * ldy, K, ldy, n, 0);
        }
}

/* y (M, ldy) = x (M, lda) w (K, ldb): products with a small stored (not transposed) right side, such as attention's
 * weights times values (N = the head dimension, K = the keys). Every element is one chain of fused multiply-adds over
 * k in order, whatever M, N or the instruction set: a key whose weight is exactly 0 (masked) leaves it unchanged. */
#define XW(NAME, TARGET, VEC, LANES, ZERO, LOAD, BCAST, FMA, STORE)                                           \
    __attribute__((target(TARGET))) static void NAME(const float *x, const float *w, float *y, int M, int N,  \
                                                     int K, int lda, int ldb, int ldy) {                      \
        for (int n = 0; n < N; n += 4 * LANES) {                                                              \
            int v = (N - n) / LANES < 4 ? (N - n) / LANES : 4;                                                \
            for (int m = 0; m < M; m += 2) {                                                                  \
                int two = m + 1 < M;                                                                          \
                VEC a0[4] = {ZERO, ZERO, ZERO, ZERO}, a1[4] = {ZERO, ZERO, ZERO, ZERO};                       \
                const float *x0 = x + (size_t)m * lda, *x1 = x0 + (two ? lda : 0);                            \
                for (int k = 0; k < K; k++) {                                                                 \
                    const float *wk = w + (size_t)k * ldb + n;                                                \
                    VEC b0 = BCAST(x0[k]), b1 = BCAST(x1[k]);                                                 \
                    for (int j = 0; j < v; j++) {                                                             \
                        VEC wv = LOAD(wk + j * LANES);                                                        \
                        a0[j] = FMA(b0, wv, a0[j]);                                                           \
                        a1[j] = FMA(b1, wv, a1[j]);                                                           \
                    }                                                                                         \
                }                                                                                             \
                for (int j = 0; j < v; j++) {                                                                 \
                    STORE(y + (size_t)m * ldy + n + j * LANES, a0[j]);                                        \
                    if (two) STORE(y + (size_t)(m + 1) * ldy + n + j * LANES, a1[j]);                         \
                }                                                                                             \
            }                                                                                                 \
        }                                                                                                     \
    }
XW(xw512, "avx512f", __m512, 16, _mm512_setzero_ps(), _mm512_loadu_ps, _mm512_set1_ps, _mm512_fmadd_ps,
   _mm512_storeu_ps)
XW(xw256, "avx2,fma", __m256, 8, _mm256_setzero_ps(), _mm256_loadu_ps, _mm256_set1_ps, _mm256_fmadd_ps,
   _mm256_storeu_ps)

static int usable(void) {
    static int ok = -1;
    if (ok < 0) ok = has_avx512() || (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) ? 1 : 0;
    return ok;
}
#endif

/* Whether the AVX-512 kernels may run where the CPU has them (tests exercise both paths); returns the previous
   setting. */
int redrafter_gemm_use_avx512(int on) {
    int was = !avx512_off;
    avx512_off = !on;
    return was;
}

enum { RowMajor = 101, NoTrans = 111, Trans = 112, TINY_PRODUCT = 1 << 20 };

void cblas_sgemm(int layout, int ta, int tb, int M, int N, int K, float alpha, const float *A, int lda,
                 const float *B, int ldb, float beta, float *C, int ldc) {
#if defined(__x86_64__)
    if (layout == RowMajor && ta == Trans && M == 1 && lda == 1) { /* one row passed as a column: the same memory */
        ta = NoTrans;
        lda = K;
    }
    /* Products too small for a BLAS call to pay its own overhead (attention's, per batch row and KV head: a few
       microseconds each in the BLAS for under one of arithmetic) run here on one thread. */
    int tiny = (long)M * N * K <= TINY_PRODUCT;
    int plain = enabled && layout == RowMajor && ta == NoTrans && alpha == 1.0f && beta == 0.0f && M >= 1 && usable();
    if (plain && tb == NoTrans && tiny && K >= 1 && N % 16 == 0 && N <= 256) {
        fast_calls++;
        (has_avx512() ? xw512 : xw256)(A, B, C, M, N, K, lda, ldb, ldc);
        return;
    }
    if (plain && tb == Trans && (has_avx512() || M <= MAX_ROWS_AVX2) && K % 16 == 0 && lda == K && ldb == K &&
        ((long)N * K >= 65536 || tiny)) {
        fast_calls++;
        int T = n_threads;
        if (T <= 1 || (long)N * K < 262144) {
            rows(A, B, C, M, K, ldc, 0, N);
            return;
        }
#pragma omp parallel num_threads(T)
        {
            int t = omp_get_thread_num(), nt = omp_get_num_threads();
            int chunk = ((N + nt - 1) / nt + 15) & ~15;
            int n0 = t * chunk, n1 = n0 + chunk < N ? n0 + chunk : N;
            if (n0 < N) rows(A, B, C, M, K, ldc, n0, n1);
        }
        return;
    }
#endif
    slow_calls++;
    if (!fallback) fallback = (sgemm_fn)dlsym(RTLD_NEXT, "cblas_sgemm");  /* whatever BLAS comes after us */
    if (fallback) {
        fallback(layout, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
        return;
    }
    /* No BLAS reachable (blas.py normally hands us one): a plain loop, slow but right. Column-major
       C = op(A) op(B) is row-major C^T = op(B)^T op(A)^T. */
    if (layout != RowMajor) {
        const float *t = A; A = B; B = t;
        int ti = ta; ta = tb; tb = ti;
        ti = lda; lda = ldb; ldb = ti;
        ti = M; M = N; N = ti;
    }
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            float acc = 0.0f;
            for (int k = 0; k < K; k++)
                acc += (ta == NoTrans ? A[(size_t)i * lda + k] : A[(size_t)k * lda + i]) *
                       (tb == NoTrans ? B[(size_t)k * ldb + j] : B[(size_t)j * ldb + k]);
            C[(size_t)i * ldc + j] = alpha * acc + (beta == 0.0f ? 0.0f : beta * C[(size_t)i * ldc + j]);
        }
}
