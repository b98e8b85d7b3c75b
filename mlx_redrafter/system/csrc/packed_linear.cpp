// y = x W^T (+ b) in float32 from packed W: float16, or MLX's 4- or 8-bit affine quantization, as one MLX primitive
// on the CPU (built and loaded by mlx_redrafter/system/packed_linear.py, which also says when it is used).
//
// A decoding step multiplies a few rows (a token, a tree of drafts, a batch) by every weight matrix, so it costs
// what reading the weights costs. MLX's CPU backend multiplies float16 and quantized weights several times slower
// than float32 ones, so this project ran float32 copies: 538 MB a target call for the embedded 4-bit model, ~35 MB
// a drafted token for the shipped drafter (more than a 32 MB L3). Here each weight row is read packed, widened to
// float32 in vector registers (exactly: a float16 is a float32; a quantized weight is scale * q + bias with scale
// and bias from float16 and q < 256, so the product is exact and one rounding remains, as in mx.dequantize) and
// multiplied into every row of x with float32 fused multiply-adds, summed in the order of the small-GEMM kernel's
// float32 products: the same bits as the float32 copies, at a quarter to half of the bytes.
//
// Rows whose entries are contiguous are read in place whatever their stride (e.g. the first rows of a larger
// matrix); any other layout is copied first.
//
// The same products serve two more primitives, a decoder layer's work on either side of the cache write
// (`LayerBefore`, `LayerAfter`), which also run the attention and vector-math kernels' code (handed over by address,
// kernel_tables.h): each layer of a decoding step is two graph nodes instead of ~21, each node costing a dispatch.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include <dlfcn.h>
#include <omp.h>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"
#include "compact.h"
#include "kernel_tables.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace nb = nanobind;
namespace mx = mlx::core;

namespace {

constexpr int64_t PARALLEL_WORK = 1 << 18;  // weight entries below which one thread does it all
int threads_ = 1;                           // set_threads

// float16 -> float32, exactly (subnormals, infinities and NaNs included): the base variant and K's tail.
static inline float widen(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000 | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else {  // subnormal: normalise
        int e = -1;
        uint32_t m = man;
        do {
            ++e;
            m <<= 1;
        } while ((m & 0x400) == 0);
        bits = sign | ((uint32_t)(112 - e) << 23) | ((m & 0x3ff) << 13);
    }
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

// Weights as stored: float16 (2 bytes each), or MLX's affine 4- or 8-bit quantization (a row's values packed low
// bits first, `group` consecutive values sharing a float32 scale and bias: w = scale * q + bias, exact in float32
// since scale and bias come from float16 and q < 256, so one rounding, as in mx.dequantize).
enum Kind { F16 = 0, Q4 = 4, Q8 = 8 };

struct Args {
    const float* x;
    int64_t ldx;
    const uint8_t* w;
    int64_t ldw;  // bytes from one weight row to the next
    const float* s;
    const float* b;
    int64_t lds;  // scales (and biases) from one weight row to the next
    float* y;
    int64_t ldy;
    int M, K, kind, group;
};

// Weight (row n, column k) as a float: the base variant and K's tail.
static inline float weight_at(const Args& a, int n, int k) {
    const uint8_t* row = a.w + (int64_t)n * a.ldw;
    if (a.kind == F16) {
        uint16_t h;
        std::memcpy(&h, row + 2 * (int64_t)k, 2);
        return widen(h);
    }
    const int q = a.kind == Q8 ? row[k] : (row[k / 2] >> (4 * (k & 1))) & 15;
    const int64_t g = (int64_t)n * a.lds + k / a.group;
    return a.s[g] * (float)q + a.b[g];
}

// Weight rows [n0, n1) times every row of x. A vector variant reads a pair of weight rows once per block of up to
// MAXM rows of x and keeps MM x 2 sums in registers (sums over k in vector lanes, then across them: the order of
// the small-GEMM kernel's float32 products, so a product from packed weights has their bits); K's tail (past the
// last whole vector: float16 only) is summed in scalars.
using RowsFn = void (*)(const Args&, int, int);

static void rows_base(const Args& a, int n0, int n1) {
    for (int n = n0; n < n1; ++n)
        for (int m = 0; m < a.M; ++m) {
            const float* x = a.x + (int64_t)m * a.ldx;
            float s = 0.f;
            for (int k = 0; k < a.K; ++k) s += weight_at(a, n, k) * x[k];
            a.y[(int64_t)m * a.ldy + n] = s;
        }
}

#if defined(__x86_64__)
// LANES weights of row n from column k, widened to floats (k a multiple of LANES; groups hold whole vectors).
#define WIDEN_VARIANT(NAME, TARGET, V, LANES, HALF, NIBBLES, BYTES, SET1, MUL, ADD)                                 \
    TARGET static inline V NAME(const Args& a, int n, int k) {                                                     \
        const uint8_t* row = a.w + (int64_t)n * a.ldw;                                                             \
        if (a.kind == F16) return HALF(row + 2 * (int64_t)k);                                                      \
        const int64_t g = (int64_t)n * a.lds + k / a.group;                                                        \
        const V q = a.kind == Q4 ? NIBBLES(row + k / 2) : BYTES(row + k);                                          \
        return ADD(MUL(q, SET1(a.s[g])), SET1(a.b[g]));                                                            \
    }

__attribute__((target("avx512f"))) static inline __m512 nibbles16(const uint8_t* p) {
    const __m128i w16 = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)p));  // 8 bytes -> 8 x int16
    const __m128i lo = _mm_and_si128(w16, _mm_set1_epi16(15)), hi = _mm_srli_epi16(w16, 4);
    const __m256i v = _mm256_set_m128i(_mm_unpackhi_epi16(lo, hi), _mm_unpacklo_epi16(lo, hi));
    return _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(v));
}
__attribute__((target("avx512f"))) static inline __m512 bytes16(const uint8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
__attribute__((target("avx512f"))) static inline __m512 halves16(const uint8_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
}
WIDEN_VARIANT(widen512, __attribute__((target("avx512f"))), __m512, 16, halves16, nibbles16, bytes16,
              _mm512_set1_ps, _mm512_mul_ps, _mm512_add_ps)

#define ROWS_VARIANT(NAME, TARGET, V, LANES, WIDEN, LOADX, FMA, ZERO, SUM, MAXM)                                     \
    template <int MM>                                                                                              \
    TARGET static inline void NAME##_block(const Args& a, int m0, int n0, int n1) {                                \
        const float* x = a.x + (int64_t)m0 * a.ldx;                                                                \
        const int Kv = a.K / LANES * LANES;                                                                        \
        for (int n = n0; n < n1; n += 2) {                                                                         \
            const bool two = n + 1 < n1;                                                                           \
            const int n2 = two ? n + 1 : n;                                                                        \
            const uint8_t* next = a.w + (int64_t)(n2 + 1) * a.ldw;                                                 \
            V acc0[MM], acc1[MM];                                                                                  \
            for (int m = 0; m < MM; ++m) acc0[m] = acc1[m] = ZERO;                                                 \
            for (int k = 0; k < Kv; k += LANES) {                                                                  \
                const int64_t at = (int64_t)k * (a.kind == F16 ? 2 : a.kind) / 8; /* bytes into a row */           \
                _mm_prefetch((const char*)(next + at), _MM_HINT_T0); /* the next pair */                           \
                _mm_prefetch((const char*)(next + a.ldw + at), _MM_HINT_T0);                                       \
                const V u = WIDEN(a, n, k), v = WIDEN(a, n2, k);                                                   \
                for (int m = 0; m < MM; ++m) {                                                                     \
                    const V xv = LOADX(x + (int64_t)m * a.ldx + k);                                                \
                    acc0[m] = FMA(u, xv, acc0[m]);                                                                 \
                    acc1[m] = FMA(v, xv, acc1[m]);                                                                 \
                }                                                                                                  \
            }                                                                                                      \
            for (int m = 0; m < MM; ++m) {                                                                         \
                const float* xm = x + (int64_t)m * a.ldx;                                                          \
                float s0 = SUM(acc0[m]), s1 = SUM(acc1[m]);                                                        \
                for (int k = Kv; k < a.K; ++k) {                                                                   \
                    s0 += weight_at(a, n, k) * xm[k];                                                              \
                    s1 += weight_at(a, n2, k) * xm[k];                                                             \
                }                                                                                                  \
                float* ym = a.y + (int64_t)(m0 + m) * a.ldy;                                                       \
                ym[n] = s0;                                                                                        \
                if (two) ym[n + 1] = s1;                                                                           \
            }                                                                                                      \
        }                                                                                                          \
    }                                                                                                              \
    TARGET static void NAME(const Args& a, int n0, int n1) {                                                       \
        for (int m0 = 0; m0 < a.M; m0 += MAXM) {                                                                   \
            switch (std::min(MAXM, a.M - m0)) {                                                                    \
                case 1: NAME##_block<1>(a, m0, n0, n1); break;                                                     \
                case 2: NAME##_block<2>(a, m0, n0, n1); break;                                                     \
                case 3: NAME##_block<3>(a, m0, n0, n1); break;                                                     \
                case 4: NAME##_block<4>(a, m0, n0, n1); break;                                                     \
                case 5: NAME##_block<5>(a, m0, n0, n1); break;                                                     \
                case 6: NAME##_block<6>(a, m0, n0, n1); break;                                                     \
                case 7: NAME##_block<7>(a, m0, n0, n1); break;                                                     \
                default: NAME##_block<MAXM>(a, m0, n0, n1); break;                                                 \
            }                                                                                                      \
        }                                                                                                          \
    }

__attribute__((target("avx2,fma,f16c"))) static inline float sum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
ROWS_VARIANT(rows_avx512, __attribute__((target("avx512f"))), __m512, 16, widen512, _mm512_loadu_ps,
             _mm512_fmadd_ps, _mm512_setzero_ps(), _mm512_reduce_add_ps, 8)

// Where the R weight rows of a block from row n start (and their scales and biases, unless s is null); past n1 the
// last row again: computed, not stored.
template <int R>
static inline void block_rows(const Args& a, int n, int n1, const uint8_t** w, const float** s, const float** b) {
    for (int r = 0; r < R; ++r) {
        const int64_t row = std::min(n + r, n1 - 1);
        w[r] = a.w + row * a.ldw;
        if (s != nullptr) {
            s[r] = a.s + row * a.lds;
            b[r] = a.b + row * a.lds;
        }
    }
}

// Quantized rows on AVX-512 (the target's 4-bit layers and 8-bit vocabulary): R weight rows at a time times MM rows
// of x (each x vector feeds R fused multiply-adds). 4-bit: each group's 16 possible values scale x q + bias are
// computed once (the same multiply and add as widen512, so the same floats) into a register, and every 16 weights
// are one permute of it by their nibbles (the permute reads only an index's low 4 bits): the 8 bytes of 16 nibbles
// are spread so that lane i holds nibble i in its low bits (a dword permute and a variable shift). 8-bit: 16 bytes
// widened and scaled as widen512 does. Sums per output as in the small-GEMM kernel: 16 lanes over k in order, then
// across the lanes.
template <int BITS, int MM, int R>
__attribute__((target("avx512f"))) static inline void quant_block512(const Args& a, int m0, int n0, int n1) {
    const float* x = a.x + (int64_t)m0 * a.ldx;
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i pick = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);  // bytes 0-3, 4-7
    const __m512i shifts = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
    for (int n = n0; n < n1; n += R) {
        const uint8_t* w[R];
        const float *s[R], *b[R];
        block_rows<R>(a, n, n1, w, s, b);
        __m512 acc[MM][R], t[R];
        for (int m = 0; m < MM; ++m)
            for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
        for (int k = 0; k < a.K; k += 16) {
            if ((k * BITS / 8 & 63) == 0)  // the next block's rows, a cache line at a time
                for (int r = 0; r < R; ++r)
                    _mm_prefetch((const char*)(w[r] + R * a.ldw + k * BITS / 8), _MM_HINT_T0);
            const int g = k / a.group;
            if (BITS == 4 && k % a.group == 0)
                for (int r = 0; r < R; ++r)
                    t[r] = _mm512_add_ps(_mm512_mul_ps(iota, _mm512_set1_ps(s[r][g])), _mm512_set1_ps(b[r][g]));
            __m512 u[R];
            for (int r = 0; r < R; ++r) {
                if (BITS == 4) {
                    const __m512i d = _mm512_castsi128_si512(_mm_loadl_epi64((const __m128i*)(w[r] + k / 2)));
                    u[r] = _mm512_permutexvar_ps(_mm512_srlv_epi32(_mm512_permutexvar_epi32(pick, d), shifts), t[r]);
                } else {
                    const __m128i d = _mm_loadu_si128((const __m128i*)(w[r] + k));
                    const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(d));
                    u[r] = _mm512_add_ps(_mm512_mul_ps(q, _mm512_set1_ps(s[r][g])), _mm512_set1_ps(b[r][g]));
                }
            }
            for (int m = 0; m < MM; ++m) {
                const __m512 xv = _mm512_loadu_ps(x + (int64_t)m * a.ldx + k);
                for (int r = 0; r < R; ++r) acc[m][r] = _mm512_fmadd_ps(u[r], xv, acc[m][r]);
            }
        }
        for (int m = 0; m < MM; ++m) {
            float* ym = a.y + (int64_t)(m0 + m) * a.ldy;
            for (int r = 0; r < R && n + r < n1; ++r) ym[n + r] = _mm512_reduce_add_ps(acc[m][r]);
        }
    }
}

// The AVX2 blocks' shared steps: MM rows of x (from column k) times R widened weight vectors into MM x R sums; the
// sums, each across its lanes and then over K's tail from column kv in scalars (float16 only), stored for the
// block's rows [n, n1); and the passes over the rows of x.
template <int MM, int R>
__attribute__((target("avx2,fma,f16c"))) static inline void multiply_add256(const float* x, int64_t ldx,
                                                                           const __m256* u, __m256 (*acc)[R]) {
    for (int m = 0; m < MM; ++m) {
        const __m256 xv = _mm256_loadu_ps(x + (int64_t)m * ldx);
        for (int r = 0; r < R; ++r) acc[m][r] = _mm256_fmadd_ps(u[r], xv, acc[m][r]);
    }
}

template <int MM, int R>
__attribute__((target("avx2,fma,f16c"))) static inline void store_sums256(const Args& a, int m0, int n, int n1,
                                                                         __m256 (*acc)[R], int kv) {
    for (int m = 0; m < MM; ++m) {
        const float* xm = a.x + (int64_t)(m0 + m) * a.ldx;
        float* ym = a.y + (int64_t)(m0 + m) * a.ldy;
        for (int r = 0; r < R && n + r < n1; ++r) {
            float sum = sum256(acc[m][r]);
            for (int k = kv; k < a.K; ++k) sum += weight_at(a, n + r, k) * xm[k];
            ym[n + r] = sum;
        }
    }
}

using PassFn = void (*)(const Args&, int m0, int mm, int n0, int n1);  // rows [m0, m0 + mm) of x times [n0, n1)

// Up to `most` rows of x in one pass over the weight rows; more: blocks of 64 weight rows, each times every pass of
// up to `most` rows of x while it is in cache.
__attribute__((target("avx2,fma,f16c"))) static void in_passes256(const Args& a, int n0, int n1, int most,
                                                                  PassFn pass) {
    constexpr int BLOCK = 64;
    if (a.M <= most) return pass(a, 0, a.M, n0, n1);
    for (int nb = n0; nb < n1; nb += BLOCK) {
        const int ne = std::min(nb + BLOCK, n1);
        for (int m0 = 0; m0 < a.M; m0 += most) pass(a, m0, std::min(most, a.M - m0), nb, ne);
    }
}

// Quantized rows on AVX2 (the target's 4-bit layers and 8-bit vocabulary): R weight rows at a time times MM rows of
// x. Each 8 weights are widened as scale * q + bias by one fused multiply-add: scale * q is exact (a float16 or
// bfloat16 scale times q < 256, the only scales a target keeps packed), so it rounds once, as mx.dequantize's
// multiply and add do. 4-bit: the 32-bit word of 8 nibbles is broadcast, shifted by lane (0, 4, ..., 28) and masked. Sums
// per output as in the small-GEMM kernel's AVX2 path: 8 lanes over k in order, then across the lanes.
template <int BITS, int MM, int R>
__attribute__((target("avx2,fma,f16c"))) static inline void quant_block256(const Args& a, int m0, int n0, int n1) {
    const float* x = a.x + (int64_t)m0 * a.ldx;
    const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28), low4 = _mm256_set1_epi32(15);
    for (int n = n0; n < n1; n += R) {
        const uint8_t* w[R];
        const float *s[R], *b[R];
        block_rows<R>(a, n, n1, w, s, b);
        __m256 acc[MM][R];
        for (int m = 0; m < MM; ++m)
            for (int r = 0; r < R; ++r) acc[m][r] = _mm256_setzero_ps();
        for (int k0 = 0, g = 0; k0 < a.K; k0 += a.group, ++g)  // a group at a time: no division per vector
        for (int k = k0; k < k0 + a.group; k += 8) {
            if ((k * BITS / 8 & 63) == 0)  // the next block's rows, a cache line at a time
                for (int r = 0; r < R; ++r)
                    _mm_prefetch((const char*)(w[r] + R * a.ldw + k * BITS / 8), _MM_HINT_T0);
            __m256 u[R];
            for (int r = 0; r < R; ++r) {
                __m256i q;
                if (BITS == 4) {
                    int32_t word;
                    std::memcpy(&word, w[r] + k / 2, 4);
                    q = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(word), shifts), low4);
                } else {
                    q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(w[r] + k)));
                }
                u[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), _mm256_broadcast_ss(s[r] + g),
                                       _mm256_broadcast_ss(b[r] + g));
            }
            multiply_add256<MM, R>(x + k, a.ldx, u, acc);
        }
        store_sums256<MM, R>(a, m0, n, n1, acc, a.K);
    }
}

template <int BITS>
__attribute__((target("avx2,fma,f16c"))) static void quant_pass256(const Args& a, int m0, int mm, int n0, int n1) {
    switch (mm) {
        case 1: return quant_block256<BITS, 1, 4>(a, m0, n0, n1);
        case 2: return quant_block256<BITS, 2, 4>(a, m0, n0, n1);
        case 3: return quant_block256<BITS, 3, 3>(a, m0, n0, n1);
        case 4: return quant_block256<BITS, 4, 2>(a, m0, n0, n1);
        case 5: return quant_block256<BITS, 5, 2>(a, m0, n0, n1);
        default: return quant_block256<BITS, 6, 2>(a, m0, n0, n1);
    }
}

// Float16 rows on AVX2 (a drafter's weights): R weight rows at a time times MM rows of x, as quant_block256 (R
// independent sums per row of x, so that a single row of x is not bound by the latency of one chain of fused
// multiply-adds), each 8 weights widened by one conversion; K's tail past the last whole vector in scalars.
template <int MM, int R>
__attribute__((target("avx2,fma,f16c"))) static inline void half_block256(const Args& a, int m0, int n0, int n1) {
    const float* x = a.x + (int64_t)m0 * a.ldx;
    for (int n = n0; n < n1; n += R) {
        const uint8_t* w[R];
        block_rows<R>(a, n, n1, w, nullptr, nullptr);
        __m256 acc[MM][R];
        for (int m = 0; m < MM; ++m)
            for (int r = 0; r < R; ++r) acc[m][r] = _mm256_setzero_ps();
        const int kv = a.K / 8 * 8;
        for (int k = 0; k < kv; k += 8) {
            if ((k & 31) == 0)  // the next block's rows, a cache line at a time
                for (int r = 0; r < R; ++r) _mm_prefetch((const char*)(w[r] + R * a.ldw + 2 * k), _MM_HINT_T0);
            __m256 u[R];
            for (int r = 0; r < R; ++r) u[r] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(w[r] + 2 * k)));
            multiply_add256<MM, R>(x + k, a.ldx, u, acc);
        }
        store_sums256<MM, R>(a, m0, n, n1, acc, kv);
    }
}

__attribute__((target("avx2,fma,f16c"))) static void half_pass256(const Args& a, int m0, int mm, int n0, int n1) {
    switch (mm) {
        case 1: return half_block256<1, 4>(a, m0, n0, n1);
        case 2: return half_block256<2, 4>(a, m0, n0, n1);
        case 3: return half_block256<3, 3>(a, m0, n0, n1);
        default: return half_block256<4, 2>(a, m0, n0, n1);
    }
}

// AVX2: quantized rows in passes of up to 6 rows of x, float16 ones of up to 4.
__attribute__((target("avx2,fma,f16c"))) static void rows_avx2(const Args& a, int n0, int n1) {
    if (a.kind == Q4) return in_passes256(a, n0, n1, 6, quant_pass256<4>);
    if (a.kind == Q8) return in_passes256(a, n0, n1, 6, quant_pass256<8>);
    return in_passes256(a, n0, n1, 4, half_pass256);
}

using WidenFn = void (*)(const Args&, int, float*);  // a weight row's whole vectors, widened into a buffer

// A float16 or 8-bit row widened into dst as widen512 does (the wide path's widening).
__attribute__((target("avx512f"))) static void widen_row512(const Args& a, int n, float* dst) {
    for (int k = 0; k + 16 <= a.K; k += 16) _mm512_storeu_ps(dst + k, widen512(a, n, k));
}

// A 4-bit row widened into dst by the same table and permutes (the wide path's widening).
__attribute__((target("avx512f"))) static void q4_widen512(const Args& a, int n, float* dst) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i shifts = _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4);
    const uint8_t* w = a.w + (int64_t)n * a.ldw;
    const float *s = a.s + (int64_t)n * a.lds, *b = a.b + (int64_t)n * a.lds;
    __m512 t = iota;
    for (int k = 0; k < a.K; k += 16) {
        if (k % a.group == 0)
            t = _mm512_add_ps(_mm512_mul_ps(iota, _mm512_set1_ps(s[k / a.group])), _mm512_set1_ps(b[k / a.group]));
        const __m128i d = _mm_loadl_epi64((const __m128i*)(w + k / 2));
        const __m512i i = _mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(d, d)), shifts);
        _mm512_storeu_ps(dst + k, _mm512_permutexvar_ps(i, t));
    }
}

// More than 8 rows of x on AVX-512 (quantized: more than 32): blocks of 4 weight rows widened once into a buffer,
// then multiplied into chunks of at most 6 rows of x with 4 x 6 accumulators, as the small-GEMM kernel does from
// float32 weights (the same order of sums, so the same bits).
template <int MM>
__attribute__((target("avx512f"))) static inline void wide4_512(const Args& a, int m0, const float* wb, int64_t ldb,
                                                                int n, int valid) {
    const float* x = a.x + (int64_t)m0 * a.ldx;
    const int Kv = a.K / 16 * 16;
    __m512 acc[MM][4];
    for (int m = 0; m < MM; ++m)
        for (int r = 0; r < 4; ++r) acc[m][r] = _mm512_setzero_ps();
    for (int k = 0; k < Kv; k += 16) {
        const __m512 w0 = _mm512_loadu_ps(wb + k), w1 = _mm512_loadu_ps(wb + ldb + k);
        const __m512 w2 = _mm512_loadu_ps(wb + 2 * ldb + k), w3 = _mm512_loadu_ps(wb + 3 * ldb + k);
        for (int m = 0; m < MM; ++m) {
            const __m512 xv = _mm512_loadu_ps(x + (int64_t)m * a.ldx + k);
            acc[m][0] = _mm512_fmadd_ps(w0, xv, acc[m][0]);
            acc[m][1] = _mm512_fmadd_ps(w1, xv, acc[m][1]);
            acc[m][2] = _mm512_fmadd_ps(w2, xv, acc[m][2]);
            acc[m][3] = _mm512_fmadd_ps(w3, xv, acc[m][3]);
        }
    }
    for (int m = 0; m < MM; ++m) {
        const float* xm = x + (int64_t)m * a.ldx;
        float* ym = a.y + (int64_t)(m0 + m) * a.ldy;
        for (int r = 0; r < valid; ++r) {
            float s = _mm512_reduce_add_ps(acc[m][r]);
            for (int k = Kv; k < a.K; ++k) s += weight_at(a, n + r, k) * xm[k];
            ym[n + r] = s;
        }
    }
}

__attribute__((target("avx512f"))) static void wide512(const Args& a, int n0, int n1, WidenFn widen_into) {
    const int64_t ldb = (a.K + 15) / 16 * 16;
    std::vector<float> buf(4 * ldb);
    const int chunks = (a.M + 5) / 6, small = a.M / chunks, big = a.M % chunks;  // chunk sizes differ by <= 1
    for (int n = n0; n < n1; n += 4) {
        const int valid = std::min(4, n1 - n);
        for (int r = 0; r < 4; ++r) widen_into(a, n + std::min(r, valid - 1), buf.data() + r * ldb);
        for (int c = 0, m0 = 0; c < chunks; ++c) {
            const int mm = small + (c < big);
            switch (mm) {
                case 1: wide4_512<1>(a, m0, buf.data(), ldb, n, valid); break;
                case 2: wide4_512<2>(a, m0, buf.data(), ldb, n, valid); break;
                case 3: wide4_512<3>(a, m0, buf.data(), ldb, n, valid); break;
                case 4: wide4_512<4>(a, m0, buf.data(), ldb, n, valid); break;
                case 5: wide4_512<5>(a, m0, buf.data(), ldb, n, valid); break;
                default: wide4_512<6>(a, m0, buf.data(), ldb, n, valid); break;
            }
            m0 += mm;
        }
    }
}

// Quantized rows of more than 6 rows of x: blocks of weight rows, each times every pass of 4 rows of x while it is
// in cache (the weights come from memory once; each pass widens them again, which costs less than reading them).
template <int BITS>
__attribute__((target("avx512f"))) static void quant_passes512(const Args& a, int n0, int n1) {
    constexpr int BLOCK = 64;
    for (int nb = n0; nb < n1; nb += BLOCK) {
        const int ne = std::min(nb + BLOCK, n1);
        for (int m0 = 0; m0 < a.M; m0 += 4) {
            switch (std::min(4, a.M - m0)) {
                case 1: quant_block512<BITS, 1, 4>(a, m0, nb, ne); break;
                case 2: quant_block512<BITS, 2, 4>(a, m0, nb, ne); break;
                case 3: quant_block512<BITS, 3, 4>(a, m0, nb, ne); break;
                default: quant_block512<BITS, 4, 4>(a, m0, nb, ne); break;
            }
        }
    }
}

// Rows of x per pass and weight rows per block, by measurement (EPYC, the embedded model's forwards after a
// 200-token context, the block sizes switched in one process, medians of 30 interleaved repeats, 2026-11-30): 4-bit,
// 2 rows of x: 4 weight rows 10.2-10.8 ms a forward against 10.8-11.3 with 8; 3 rows: 4 weight rows 11.5-12.3
// against 11.9-12.6 with 6 (3 x 6 sums and 6 group tables held 30 of the 32 vector registers); 1 row: 8 and 6 alike,
// 10 slower; 4-6 rows: 4 best (3 and 5 slower). The block shape does not change a sum's order, so not its bits.
template <int BITS>
__attribute__((target("avx512f"))) static void quant_rows512(const Args& a, int n0, int n1) {
    switch (a.M) {
        case 1: return quant_block512<BITS, 1, 8>(a, 0, n0, n1);
        case 2: return quant_block512<BITS, 2, BITS == 4 ? 4 : 8>(a, 0, n0, n1);
        case 3: return quant_block512<BITS, 3, 4>(a, 0, n0, n1);
        case 4: return quant_block512<BITS, 4, 4>(a, 0, n0, n1);
        case 5: return quant_block512<BITS, 5, 4>(a, 0, n0, n1);
        case 6: return quant_block512<BITS, 6, 4>(a, 0, n0, n1);
        default: return quant_passes512<BITS>(a, n0, n1);
    }
}

__attribute__((target("avx512f"))) static void rows_avx512_any(const Args& a, int n0, int n1) {
    if (a.kind == Q4 && a.M <= 32) return quant_rows512<4>(a, n0, n1);
    if (a.kind == Q8 && a.M <= 32) return quant_rows512<8>(a, n0, n1);
    if (a.M > 8) return wide512(a, n0, n1, a.kind == Q4 ? q4_widen512 : widen_row512);
    return rows_avx512(a, n0, n1);
}
#endif

const char* isa_ = nullptr;
RowsFn rows_fn_ = nullptr;

// "avx512", "avx2" or "base": the best this CPU runs, or the one asked for where it runs it. Returns the choice.
const char* set_isa(const std::string& want) {
    isa_ = "base";
    rows_fn_ = rows_base;
#if defined(__x86_64__)
    __builtin_cpu_init();
    const bool avx512 = __builtin_cpu_supports("avx512f");
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                      __builtin_cpu_supports("f16c");
    if (avx512 && (want == "best" || want == "avx512")) {
        isa_ = "avx512";
        rows_fn_ = rows_avx512_any;
    } else if (avx2 && (want == "best" || want == "avx2" || want == "avx512")) {
        isa_ = "avx2";
        rows_fn_ = rows_avx2;
    }
#endif
    return isa_;
}

// A 2-D array's rows with contiguous entries: in place (whatever the row stride, returned in ld), or copied into
// `keep` when its entries are strided (layouts are known only once the inputs are evaluated).
template <typename T>
static const T* rows_of(const T* p, const mx::array& a, std::vector<T>& keep, int64_t& ld) {
    const int R = a.shape(0), C = a.shape(1);
    const int64_t s0 = a.strides()[0], s1 = a.strides()[1];
    ld = s0;
    if (s1 == 1 || C == 1) return p;
    keep.resize((size_t)R * C);
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) keep[(size_t)r * C + c] = p[r * s0 + c * s1];
    ld = C;
    return keep.data();
}

// run(n0, n1) over rows [0, N) of N x K entries: in one call, or split in equal shares among up to `threads` threads
// (two rows each at least) once there is enough work to share.
template <typename Run>
static void in_row_shares(int threads, int N, int64_t K, Run& run) {
    const int T = std::min<int>(threads, std::max(1, N / 2));
    if (T <= 1 || (int64_t)N * K < PARALLEL_WORK) {
        run(0, N);
        return;
    }
#pragma omp parallel num_threads(T)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        run((int)((int64_t)N * t / nt), (int)((int64_t)N * (t + 1) / nt));
    }
}

// A quantized weight's rows, scales and biases as the kernel reads them: in place where their entries are
// contiguous, else copied (owned here).
struct Quantized {
    const uint8_t* w;
    const float *s, *b;
    int64_t ldw, lds;  // bytes from one weight row to the next; scales (and biases) likewise
    std::vector<uint32_t> qc;
    std::vector<float> sc, bc;

    Quantized(const mx::array& weight, const mx::array& scales, const mx::array& biases) {
        int64_t unused;
        w = reinterpret_cast<const uint8_t*>(rows_of(weight.data<uint32_t>(), weight, qc, ldw));
        ldw *= 4;
        s = rows_of(scales.data<float>(), scales, sc, lds);
        b = rows_of(biases.data<float>(), biases, bc, unused);
    }
    Quantized(const Quantized&) = delete;
};

// y (M, N) = x (M, K, rows ldx apart) times the quantized weight's rows (N, K), shared among `threads` threads.
static void product(const Quantized& q, int N, int kind, int group, const float* x, int64_t ldx, int M, int K,
                    float* y, int threads, RowsFn rows) {
    Args a{x, ldx, q.w, q.ldw, q.s, q.b, q.lds, y, (int64_t)N, M, K, kind, group};
    auto run = [&](int n0, int n1) { rows(a, n0, n1); };
    in_row_shares(threads, N, K, run);
}

// A CPU primitive's outputs allocated and its arrays registered with its stream's encoder, which is returned for
// the dispatch (every primitive of this file).
static mx::cpu::CommandEncoder& encoder_for(mx::Stream s, const std::vector<mx::array>& inputs,
                                            std::vector<mx::array>& outputs) {
    for (auto& o : outputs) o.set_data(mx::allocator::malloc(o.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(s);
    for (auto& a : inputs) enc.set_input_array(a);
    for (auto& o : outputs) enc.set_output_array(o);
    return enc;
}

class PackedLinear : public mx::Primitive {
   public:
    PackedLinear(mx::Stream s, int kind, int group, bool bias)
        : mx::Primitive(s), kind_(kind), group_(group), bias_(bias) {}

    void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
    void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
        throw std::runtime_error("packed_linear runs on the CPU only");
    }
    const char* name() const override { return "PackedLinear"; }
    bool is_equivalent(const mx::Primitive& other) const override {
        auto& o = static_cast<const PackedLinear&>(other);
        return kind_ == o.kind_ && group_ == o.group_ && bias_ == o.bias_;
    }

   private:
    int kind_, group_;
    bool bias_;
};

void PackedLinear::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
    auto& out = outputs[0];
    auto& enc = encoder_for(stream(), inputs, outputs);
    enc.dispatch([ins = inputs, out = mx::array::unsafe_weak_copy(out), kind = kind_, group = group_, bias = bias_,
                  threads = threads_, rows = rows_fn_]() mutable {
        const auto& x = ins[0];
        const auto& w = ins[1];
        const int M = x.shape(0), K = x.shape(1), N = w.shape(0);
        std::vector<float> xc, sc, bc;
        std::vector<uint16_t> hc;
        std::vector<uint32_t> qc;
        int64_t ldx, ldw, lds = 0;
        const float* xp = rows_of(x.data<float>(), x, xc, ldx);
        const uint8_t* wp;
        const float *sp = nullptr, *bp = nullptr;
        if (kind == F16) {
            wp = reinterpret_cast<const uint8_t*>(rows_of(w.data<uint16_t>(), w, hc, ldw));
            ldw *= 2;
        } else {
            Quantized q(w, ins[2], ins[3]);
            wp = q.w, ldw = q.ldw, sp = q.s, bp = q.b, lds = q.lds;
            qc = std::move(q.qc), sc = std::move(q.sc), bc = std::move(q.bc);
        }
        Args a{xp, ldx, wp, ldw, sp, bp, lds, out.data<float>(), (int64_t)N, M, K, kind, group};
        const float* b = bias ? ins.back().data<float>() : nullptr;
        auto run = [&](int n0, int n1) {
            rows(a, n0, n1);
            if (b)
                for (int m = 0; m < M; ++m)
                    for (int n = n0; n < n1; ++n) a.y[(int64_t)m * N + n] += b[n];
        };
        in_row_shares(threads, N, K, run);
    });
}

static mx::array packed_linear(const mx::array& x, std::vector<mx::array> ins, int n, int kind, int group,
                               std::optional<mx::array> bias) {
    auto s = mx::default_stream(mx::Device::cpu);
    if (bias) {
        if (bias->ndim() != 1 || bias->shape(0) != n) throw std::invalid_argument("packed_linear: bias (N,)");
        ins.push_back(mx::astype(*bias, mx::float32, s));
    }
    ins.insert(ins.begin(), x);
    return mx::array({x.shape(0), n}, mx::float32, std::make_shared<PackedLinear>(s, kind, group, bias.has_value()),
                     std::move(ins));
}

// x float32 (M, K) @ w float16 (N, K).T (+ bias (N,)) -> float32 (M, N).
mx::array half_linear(const mx::array& x, const mx::array& w, std::optional<mx::array> bias) {
    if (x.dtype() != mx::float32 || w.dtype() != mx::float16 || x.ndim() != 2 || w.ndim() != 2 ||
        x.shape(1) != w.shape(1) || x.shape(0) < 1 || w.shape(0) < 1)
        throw std::invalid_argument("half_linear: float32 x (M, K) and float16 weights (N, K)");
    return packed_linear(x, {mx::view(w, mx::uint16)}, w.shape(0), F16, 1, bias);
}

// x float32 (M, K) @ dequantize(w, scales, biases).T (+ bias) -> float32 (M, N): MLX's affine quantization, w
// uint32 (N, K * bits / 32), scales and biases float32 (N, K / group_size); bits 4 or 8, groups of 16k values.
mx::array quantized_linear(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
                           int bits, int group_size, std::optional<mx::array> bias) {
    if ((bits != 4 && bits != 8) || group_size < 16 || group_size % 16 != 0)
        throw std::invalid_argument("quantized_linear: bits 4 or 8, group_size a multiple of 16");
    if (x.dtype() != mx::float32 || w.dtype() != mx::uint32 || scales.dtype() != mx::float32 ||
        biases.dtype() != mx::float32 || x.ndim() != 2 || w.ndim() != 2 || x.shape(0) < 1 || w.shape(0) < 1 ||
        (int64_t)w.shape(1) * 32 / bits != x.shape(1) || x.shape(1) % group_size != 0 ||
        scales.shape() != mx::Shape{w.shape(0), x.shape(1) / group_size} || biases.shape() != scales.shape())
        throw std::invalid_argument("quantized_linear: float32 x (M, K), uint32 w (N, K * bits / 32), float32 scales "
                                    "and biases (N, K / group_size)");
    return packed_linear(x, {w, scales, biases}, w.shape(0), bits, group_size, bias);
}

// The kernels LayerAfter runs beside ours, handed over by the other extensions (kernel_tables.h), and the
// cblas_sgemm MLX's matrix products call (the small-GEMM kernel's where it is loaded).
using SgemmFn = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int, float, float*, int);
const AttentionKernels* attention_ = nullptr;
const VectorMathKernels* vector_math_ = nullptr;
SgemmFn sgemm_ = nullptr;

// A decoder layer's work after its queries, keys and values are laid out and the cache holds this step's keys and
// values: attention over the cache's first `visible` positions, the output product, the residual, the MLP's norm,
// gate/up product, gate and down product, and the residual again, in one graph node where MLX's graph took ~15 (a
// slice of the keys and of the values, their transpose, the scores' product, the softmax, reshapes, the products
// and element-wise nodes, each a dispatch of its own on MLX's CPU backend), from weights quantized as
// `quantized_linear` takes them. Each step calls what the separate nodes call, in their order: cblas_sgemm as MLX's
// matmul calls it for the scores (row-major, the keys transposed), the attention kernel's softmax_values, this
// kernel's products, the vector-math kernel's norm and gate; so the same bits.
class LayerAfter : public mx::Primitive {
   public:
    LayerAfter(mx::Stream s, int hkv, int visible, float scale, float eps, int bits, int group, bool masked)
        : mx::Primitive(s), hkv_(hkv), visible_(visible), scale_(scale), eps_(eps), bits_(bits), group_(group),
          masked_(masked) {}

    void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
    void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
        throw std::runtime_error("layer_after runs on the CPU only");
    }
    const char* name() const override { return "LayerAfter"; }
    bool is_equivalent(const mx::Primitive& other) const override {
        auto& o = static_cast<const LayerAfter&>(other);
        return hkv_ == o.hkv_ && visible_ == o.visible_ && scale_ == o.scale_ && eps_ == o.eps_ &&
               bits_ == o.bits_ && group_ == o.group_ && masked_ == o.masked_;
    }

   private:
    int hkv_, visible_;
    float scale_, eps_;
    int bits_, group_;
    bool masked_;
};

// An evaluated float32 vector's entries one after another: its own memory, or a copy in `keep`.
static const float* entries_of(const mx::array& a, std::vector<float>& keep) {
    const float* p = a.data<float>();
    const int64_t step = a.strides()[0];
    if (step == 1) return p;
    keep.resize(a.size());
    for (size_t i = 0; i < a.size(); ++i) keep[i] = p[i * step];
    return keep.data();
}

// An evaluated float32 array of 4 dims as (pointer, strides of dims 0-2): its own memory where its last dim is
// contiguous and dim 2's rows lie a row apart (with `whole`, dim 1's too), else a compact copy in `keep`.
static const float* rows4(const mx::array& a, bool whole, std::vector<float>& keep, int64_t* st) {
    auto& s = a.strides();
    if (s[3] == 1 && s[2] == a.shape(3) && (!whole || s[1] == (int64_t)a.shape(2) * a.shape(3))) {
        st[0] = s[0], st[1] = s[1], st[2] = s[2];
        return a.data<float>();
    }
    return compact4(a, keep, st);
}

void LayerAfter::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
    auto& out = outputs[0];
    auto& enc = encoder_for(stream(), inputs, outputs);
    enc.dispatch([ins = inputs, out = mx::array::unsafe_weak_copy(out), hkv = hkv_, S = visible_, scale = scale_,
                  eps = eps_, kind = bits_, group = group_, masked = masked_, threads = threads_, rows = rows_fn_,
                  att = attention_, vm = vector_math_, sgemm = sgemm_]() mutable {
        const auto &x = ins[0], &q = ins[1], &keys = ins[2], &values = ins[3];
        const int T = x.shape(0), H = x.shape(1);
        const int B = q.shape(0), h = q.shape(1), N = q.shape(2), D = q.shape(3), G = h / hkv, R = G * N;
        const int I = ins[11].shape(1) * 32 / kind;  // the down product's inputs
        std::vector<float> xc, qc, kc, vc, nc, scores((size_t)B * hkv * R * S), att_out((size_t)B * h * N * D),
            rows_in, y((size_t)T * H), h1((size_t)T * H), n2((size_t)T * H), gu((size_t)T * 2 * I),
            gate((size_t)T * I);
        int64_t ldx, qs[3], ks[3], vs[3];
        const float* xp = rows_of(x.data<float>(), x, xc, ldx);
        const float* qp = rows4(q, true, qc, qs);  // a KV head's G * N rows of D, one after another
        const float* kp = rows4(keys, false, kc, ks);
        const float* vp = rows4(values, false, vc, vs);
        const float* norm = entries_of(ins[7], nc);
        // scores (B, h_kv, G * N, S) = q.k per KV head, as MLX's matmul calls cblas_sgemm for q @ k^T
        for (int b = 0; b < B; ++b)
            for (int g = 0; g < hkv; ++g)
                sgemm(101, 111, 112, R, S, D, 1.0f, qp + b * qs[0] + (int64_t)g * G * qs[1], D,
                      kp + b * ks[0] + g * ks[1], D, 0.0f, scores.data() + ((int64_t)b * hkv + g) * R * S, S);
        const int64_t ss[3] = {(int64_t)hkv * R * S, (int64_t)R * S, S};
        const bool* mp = nullptr;
        int64_t ms[3] = {0, 0, 0};
        bool grouped = false;
        if (masked) {
            const auto& m = ins[14];
            auto& st = m.strides();
            mp = m.data<bool>();
            ms[0] = m.shape(0) == 1 ? 0 : st[0], ms[1] = m.shape(2) == 1 ? 0 : st[2], ms[2] = st[3];
            grouped = m.shape(2) == R && R != N;
        }
        att->softmax_values(scores.data(), ss, vp, vs, mp, ms, grouped, att_out.data(), B, hkv, R, S, D, N, scale);
        // (B, h, N, D) -> rows (B * N, h * D)
        const float* rp = att_out.data();
        if (N > 1) {
            rows_in.resize((size_t)T * h * D);
            for (int b = 0; b < B; ++b)
                for (int j = 0; j < h; ++j)
                    for (int n = 0; n < N; ++n)
                        std::memcpy(rows_in.data() + ((int64_t)(b * N + n) * h + j) * D,
                                    att_out.data() + (((int64_t)b * h + j) * N + n) * D, sizeof(float) * D);
            rp = rows_in.data();
        }
        {
            Quantized o(ins[4], ins[5], ins[6]);
            product(o, H, kind, group, rp, (int64_t)h * D, T, h * D, y.data(), threads, rows);
        }
        for (int t = 0; t < T; ++t)
            for (int i = 0; i < H; ++i) h1[(size_t)t * H + i] = xp[t * ldx + i] + y[(size_t)t * H + i];
        vm->rms_rows(h1.data(), norm, 0, T, H, (float)(1.0 / (double)H), eps, n2.data());
        {
            Quantized gate_up(ins[8], ins[9], ins[10]);
            product(gate_up, 2 * I, kind, group, n2.data(), H, T, H, gu.data(), threads, rows);
        }
        vm->silu_mul_halves_rows(gu.data(), T, I, gate.data());
        {
            Quantized down(ins[11], ins[12], ins[13]);
            product(down, H, kind, group, gate.data(), I, T, I, y.data(), threads, rows);
        }
        float* o = out.data<float>();
        for (size_t i = 0; i < (size_t)T * H; ++i) o[i] = h1[i] + y[i];
    });
}

// Whether LayerBefore and LayerAfter can run: the other extensions' kernels handed over and a cblas_sgemm found.
static bool fused_ready() { return attention_ && vector_math_ && sgemm_; }

// Take the attention and vector-math kernels' tables (their `kernels()` capsules); returns whether LayerBefore and
// LayerAfter can now run.
static bool set_kernels(nb::capsule attention, nb::capsule vector_math) {
    if (std::string(attention.name()) != ATTENTION_KERNELS || std::string(vector_math.name()) != VECTOR_MATH_KERNELS)
        throw std::invalid_argument("set_kernels: the attention and vector-math kernels' capsules");
    auto a = static_cast<const AttentionKernels*>(attention.data());
    auto v = static_cast<const VectorMathKernels*>(vector_math.data());
    attention_ = a->version == 2 ? a : nullptr;
    vector_math_ = v->version == 1 ? v : nullptr;
    sgemm_ = reinterpret_cast<SgemmFn>(dlsym(RTLD_DEFAULT, "cblas_sgemm"));
    return fused_ready();
}

// A decoder layer's work before the cache write: the input norm, the q/k/v product, and q, k and v laid out and
// rotated (the attention kernel's `heads_rope`), in one graph node where MLX's graph took three; the same calls in
// the same order as those nodes, so the same bits.
class LayerBefore : public mx::Primitive {
   public:
    LayerBefore(mx::Stream s, int h, int hkv, float eps, int bits, int group)
        : mx::Primitive(s), h_(h), hkv_(hkv), eps_(eps), bits_(bits), group_(group) {}

    void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
    void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
        throw std::runtime_error("layer_before runs on the CPU only");
    }
    const char* name() const override { return "LayerBefore"; }
    bool is_equivalent(const mx::Primitive& other) const override {
        auto& o = static_cast<const LayerBefore&>(other);
        return h_ == o.h_ && hkv_ == o.hkv_ && eps_ == o.eps_ && bits_ == o.bits_ && group_ == o.group_;
    }

   private:
    int h_, hkv_;
    float eps_;
    int bits_, group_;
};

void LayerBefore::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
    auto& enc = encoder_for(stream(), inputs, outputs);
    enc.dispatch([ins = inputs, q = mx::array::unsafe_weak_copy(outputs[0]),
                  k = mx::array::unsafe_weak_copy(outputs[1]), v = mx::array::unsafe_weak_copy(outputs[2]), h = h_,
                  hkv = hkv_, eps = eps_, kind = bits_, group = group_, threads = threads_, rows = rows_fn_,
                  att = attention_, vm = vector_math_]() mutable {
        const auto &x = ins[0], &c = ins[5], &sn = ins[6];
        const int T = x.shape(0), H = x.shape(1), B = c.shape(0), N = c.shape(1), half = c.shape(3);
        const int width = (h + 2 * hkv) * 2 * half;
        std::vector<float> xc, nc, normed((size_t)T * H), qkv((size_t)T * width);
        int64_t ldx;
        const float* xp = rows_of(x.data<float>(), x, xc, ldx);
        if (ldx != H) {  // the norm reads rows one after another
            xc.resize((size_t)T * H);
            for (int t = 0; t < T; ++t) std::memmove(xc.data() + (size_t)t * H, xp + t * ldx, sizeof(float) * H);
            xp = xc.data();
        }
        const float* norm = entries_of(ins[1], nc);
        vm->rms_rows(xp, norm, 0, T, H, (float)(1.0 / (double)H), eps, normed.data());
        const Quantized w(ins[2], ins[3], ins[4]);
        product(w, width, kind, group, normed.data(), H, T, H, qkv.data(), threads, rows);
        const int64_t xs[2] = {width, 1}, cs[3] = {c.strides()[0], c.strides()[1], c.strides()[3]},
                      ss[3] = {sn.strides()[0], sn.strides()[1], sn.strides()[3]}, ps[2] = {0, 0};
        att->heads_rope(qkv.data(), xs, c.data<float>(), cs, sn.data<float>(), ss, nullptr, ps, q.data<float>(),
                        k.data<float>(), v.data<float>(), B, N, half, h, hkv);
    });
}

// x (B * N, H) float32, the input norm's weight (H), the q/k/v product's weights as `quantized_linear` takes them,
// cos and sin (B, N, 1, D / 2) -> q (B, h, N, D), k and v (B, h_kv, N, D), as `heads_rope` lays them out.
std::vector<mx::array> layer_before(const mx::array& x, const mx::array& norm, const mx::array& w,
                                    const mx::array& scales, const mx::array& biases, const mx::array& cos,
                                    const mx::array& sin, int h, int hkv, int bits, int group_size, float eps) {
    if (!fused_ready()) throw std::runtime_error("layer_before: set_kernels has not handed over the kernels");
    if ((bits != 4 && bits != 8) || group_size < 16 || group_size % 16 != 0)
        throw std::invalid_argument("layer_before: bits 4 or 8, group_size a multiple of 16");
    for (auto* a : {&x, &norm, &scales, &biases, &cos, &sin})
        if (a->dtype() != mx::float32) throw std::invalid_argument("layer_before: float32 activations, scales and biases");
    if (x.ndim() != 2 || cos.ndim() != 4 || cos.shape() != sin.shape() || cos.shape(2) != 1 || h < 1 || hkv < 1 ||
        x.shape(0) != cos.shape(0) * cos.shape(1) || norm.shape() != mx::Shape{x.shape(1)} ||
        w.dtype() != mx::uint32 || w.ndim() != 2 || w.shape(0) != (h + 2 * hkv) * 2 * cos.shape(3) ||
        (int64_t)w.shape(1) * 32 / bits != x.shape(1) || x.shape(1) % group_size != 0 ||
        scales.shape() != mx::Shape{w.shape(0), x.shape(1) / group_size} || biases.shape() != scales.shape())
        throw std::invalid_argument("layer_before: x (B * N, H), norm (H), q/k/v weights ((h + 2 h_kv) * D, H * "
                                    "bits / 32), cos and sin (B, N, 1, D / 2)");
    const int B = cos.shape(0), N = cos.shape(1), D = 2 * cos.shape(3);
    auto s = mx::default_stream(mx::Device::cpu);
    return mx::array::make_arrays({{B, h, N, D}, {B, hkv, N, D}, {B, hkv, N, D}},
                                  {mx::float32, mx::float32, mx::float32},
                                  std::make_shared<LayerBefore>(s, h, hkv, eps, bits, group_size),
                                  {x, norm, w, scales, biases, cos, sin});
}

// x (T, H) float32, q (B, h, N, D) as `heads_rope` lays it out (T = B * N), the cache's keys and values (B, h_kv,
// C, D) holding this step's entries, of which the first `visible` are attended, mask (B or 1, 1, N or G * N,
// visible) bool or None; the output product (o), the MLP's norm weight (H) and its gate/up and down products as
// `quantized_linear` takes weights -> the layer's output (T, H).
mx::array layer_after(const mx::array& x, const mx::array& q, const mx::array& keys, const mx::array& values,
                      int visible, std::optional<mx::array> mask, const mx::array& o_w, const mx::array& o_s,
                      const mx::array& o_b, const mx::array& norm, const mx::array& gu_w, const mx::array& gu_s,
                      const mx::array& gu_b, const mx::array& down_w, const mx::array& down_s,
                      const mx::array& down_b, int bits, int group_size, float scale, float eps) {
    if (!fused_ready()) throw std::runtime_error("layer_after: set_kernels has not handed over the kernels");
    if ((bits != 4 && bits != 8) || group_size < 16 || group_size % 16 != 0)
        throw std::invalid_argument("layer_after: bits 4 or 8, group_size a multiple of 16");
    for (auto* a : {&x, &q, &keys, &values, &o_s, &o_b, &norm, &gu_s, &gu_b, &down_s, &down_b})
        if (a->dtype() != mx::float32) throw std::invalid_argument("layer_after: float32 activations, scales and biases");
    for (auto* a : {&o_w, &gu_w, &down_w})
        if (a->dtype() != mx::uint32 || a->ndim() != 2) throw std::invalid_argument("layer_after: uint32 weights (N, K * bits / 32)");
    if (x.ndim() != 2 || q.ndim() != 4 || keys.ndim() != 4 || values.shape() != keys.shape())
        throw std::invalid_argument("layer_after: x (T, H), q (B, h, N, D), keys and values (B, h_kv, C, D)");
    const int T = x.shape(0), H = x.shape(1), B = q.shape(0), h = q.shape(1), N = q.shape(2), D = q.shape(3);
    const int hkv = keys.shape(1), per = 32 / bits;
    const int I = down_w.shape(1) * per;
    if (T != B * N || keys.shape(0) != B || keys.shape(3) != D || hkv < 1 || h % hkv != 0 || visible < 1 ||
        visible > keys.shape(2) || norm.shape() != mx::Shape{H} || o_w.shape(0) != H || o_w.shape(1) * per != h * D ||
        gu_w.shape(0) != 2 * I || gu_w.shape(1) * per != H || down_w.shape(0) != H || H % group_size != 0 ||
        I % group_size != 0 || (h * D) % group_size != 0 || o_s.shape() != mx::Shape{H, h * D / group_size} ||
        gu_s.shape() != mx::Shape{2 * I, H / group_size} || down_s.shape() != mx::Shape{H, I / group_size} ||
        o_b.shape() != o_s.shape() || gu_b.shape() != gu_s.shape() || down_b.shape() != down_s.shape())
        throw std::invalid_argument("layer_after: shapes of one decoder layer");
    std::vector<mx::array> ins = {x, q, keys, values, o_w, o_s, o_b, norm, gu_w, gu_s, gu_b, down_w, down_s, down_b};
    if (mask) {
        if (mask->ndim() != 4 || mask->shape(1) != 1 ||
            (mask->shape(0) != 1 && mask->shape(0) != B) ||
            (mask->shape(2) != 1 && mask->shape(2) != N && mask->shape(2) != h / hkv * N) || mask->shape(3) != visible)
            throw std::invalid_argument("layer_after: mask (B or 1, 1, N, visible)");
        ins.push_back(mask->dtype() == mx::bool_ ? *mask : mx::astype(*mask, mx::bool_));
    }
    auto s = mx::default_stream(mx::Device::cpu);
    return mx::array({T, H}, mx::float32,
                     std::make_shared<LayerAfter>(s, hkv, visible, scale, eps, bits, group_size, mask.has_value()),
                     std::move(ins));
}

// dequantize(w, scales, biases) in float32 with mx.dequantize's bits (a model's float32 copies at load time): each
// value is scale * q + bias with one rounding, the add's (scale * q is exact for a checkpoint's float16 scales, so
// a fused multiply-add, where the compiler makes one, gives the same float). MLX's CPU dequantize runs on one thread at ~80 M values/s, a
// second for the embedded model; this loop runs on every thread at memory speed.
template <int BITS>
static void dequantize_rows(const uint8_t* w, int64_t ldw, const float* s, const float* b, int64_t lds, float* y,
                            int K, int group, int n0, int n1) {
    for (int n = n0; n < n1; ++n) {
        const uint8_t* row = w + (int64_t)n * ldw;
        float* out = y + (int64_t)n * K;
        for (int k0 = 0, g = 0; k0 < K; k0 += group, ++g) {
            const float sc = s[(int64_t)n * lds + g], bi = b[(int64_t)n * lds + g];
            for (int k = k0; k < k0 + group; ++k) {
                const int q = BITS == 8 ? row[k] : (row[k >> 1] >> ((k & 1) << 2)) & 15;
                out[k] = sc * (float)q + bi;
            }
        }
    }
}

#if defined(__x86_64__)
// The same on AVX2, 8 values at a time: the 32-bit word of 8 nibbles broadcast, shifted by lane and masked (or 8
// bytes widened), converted, scaled and biased by one fused multiply-add (exact product: the same float).
template <int BITS>
__attribute__((target("avx2,fma"))) static void dequantize_rows256(const uint8_t* w, int64_t ldw, const float* s,
                                                                 const float* b, int64_t lds, float* y, int K,
                                                                 int group, int n0, int n1) {
    const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28), low4 = _mm256_set1_epi32(15);
    for (int n = n0; n < n1; ++n) {
        const uint8_t* row = w + (int64_t)n * ldw;
        float* out = y + (int64_t)n * K;
        for (int k0 = 0, g = 0; k0 < K; k0 += group, ++g) {
            const __m256 sc = _mm256_set1_ps(s[(int64_t)n * lds + g]), bi = _mm256_set1_ps(b[(int64_t)n * lds + g]);
            for (int k = k0; k < k0 + group; k += 8) {
                __m256i q;
                if (BITS == 4) {
                    uint32_t word;
                    std::memcpy(&word, row + k / 2, 4);
                    q = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)word), shifts), low4);
                } else {
                    q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(row + k)));
                }
                _mm256_storeu_ps(out + k, _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), sc, bi));
            }
        }
    }
}
#endif

class Dequantize : public mx::Primitive {
   public:
    Dequantize(mx::Stream s, int bits, int group) : mx::Primitive(s), bits_(bits), group_(group) {}

    void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
    void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
        throw std::runtime_error("dequantize runs on the CPU only");
    }
    const char* name() const override { return "RedrafterDequantize"; }
    bool is_equivalent(const mx::Primitive& other) const override {
        auto& o = static_cast<const Dequantize&>(other);
        return bits_ == o.bits_ && group_ == o.group_;
    }

   private:
    int bits_, group_;
};

void Dequantize::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
    auto& out = outputs[0];
    auto& enc = encoder_for(stream(), inputs, outputs);
    enc.dispatch([ins = inputs, out = mx::array::unsafe_weak_copy(out), bits = bits_, group = group_,
                  threads = threads_, isa = isa_]() mutable {
        const auto& w = ins[0];
        const int N = out.shape(0), K = out.shape(1);
        std::vector<float> sc, bc;
        std::vector<uint32_t> qc;
        int64_t ldw, lds, unused;
        const uint8_t* wp = reinterpret_cast<const uint8_t*>(rows_of(w.data<uint32_t>(), w, qc, ldw));
        ldw *= 4;
        const float* sp = rows_of(ins[1].data<float>(), ins[1], sc, lds);
        const float* bp = rows_of(ins[2].data<float>(), ins[2], bc, unused);
        float* y = out.data<float>();
        const bool vector = std::strcmp(isa, "base") != 0;
        auto run = [&](int n0, int n1) {
#if defined(__x86_64__)
            if (vector)
                return bits == 8 ? dequantize_rows256<8>(wp, ldw, sp, bp, lds, y, K, group, n0, n1)
                                 : dequantize_rows256<4>(wp, ldw, sp, bp, lds, y, K, group, n0, n1);
#endif
            if (bits == 8)
                dequantize_rows<8>(wp, ldw, sp, bp, lds, y, K, group, n0, n1);
            else
                dequantize_rows<4>(wp, ldw, sp, bp, lds, y, K, group, n0, n1);
        };
        in_row_shares(threads, N, K, run);
    });
}

// MLX's affine dequantization to float32: w uint32 (N, K * bits / 32), scales and biases float32 (N, K / group_size);
// bits 4 or 8, groups of 8k values.
mx::array dequantize(const mx::array& w, const mx::array& scales, const mx::array& biases, int bits, int group_size) {
    if ((bits != 4 && bits != 8) || group_size < 8 || group_size % 8 != 0)
        throw std::invalid_argument("dequantize: bits 4 or 8, group_size a multiple of 8");
    const int64_t K = w.ndim() == 2 ? (int64_t)w.shape(1) * 32 / bits : 0;
    if (w.dtype() != mx::uint32 || scales.dtype() != mx::float32 || biases.dtype() != mx::float32 ||
        w.ndim() != 2 || w.shape(0) < 1 || K < 1 || K % group_size != 0 ||
        scales.shape() != mx::Shape{w.shape(0), (int)(K / group_size)} || biases.shape() != scales.shape())
        throw std::invalid_argument("dequantize: uint32 w (N, K * bits / 32), float32 scales and biases "
                                    "(N, K / group_size)");
    auto s = mx::default_stream(mx::Device::cpu);
    return mx::array({w.shape(0), (int)K}, mx::float32, std::make_shared<Dequantize>(s, bits, group_size),
                     {w, scales, biases});
}

}  // namespace

NB_MODULE(_packed_linear, m) {
    m.doc() = "x @ W.T from float16 or 4- and 8-bit quantized W as one MLX CPU primitive (see packed_linear.cpp).";
    m.def("half_linear", &half_linear, nb::arg("x"), nb::arg("w"), nb::arg("bias") = nb::none());
    m.def("quantized_linear", &quantized_linear, nb::arg("x"), nb::arg("w"), nb::arg("scales"), nb::arg("biases"),
          nb::arg("bits"), nb::arg("group_size"), nb::arg("bias") = nb::none());
    m.def("dequantize", &dequantize, nb::arg("w"), nb::arg("scales"), nb::arg("biases"), nb::arg("bits"),
          nb::arg("group_size"));
    m.def("layer_after", &layer_after, nb::arg("x"), nb::arg("q"), nb::arg("keys"), nb::arg("values"),
          nb::arg("visible"), nb::arg("mask").none(), nb::arg("o_w"), nb::arg("o_s"), nb::arg("o_b"), nb::arg("norm"),
          nb::arg("gu_w"), nb::arg("gu_s"), nb::arg("gu_b"), nb::arg("down_w"), nb::arg("down_s"), nb::arg("down_b"),
          nb::arg("bits"), nb::arg("group_size"), nb::arg("scale"), nb::arg("eps"));
    m.def("layer_before", &layer_before, nb::arg("x"), nb::arg("norm"), nb::arg("w"), nb::arg("scales"),
          nb::arg("biases"), nb::arg("cos"), nb::arg("sin"), nb::arg("h"), nb::arg("hkv"), nb::arg("bits"),
          nb::arg("group_size"), nb::arg("eps"));
    m.def("set_kernels", &set_kernels, nb::arg("attention"), nb::arg("vector_math"));
    m.def("fused_ready", &fused_ready);
    m.def("set_threads", [](int n) { threads_ = std::max(1, n); }, nb::arg("n"));
    m.def("set_isa", &set_isa, nb::arg("want") = "best");
    m.def("version", []() { return 1; });
    set_isa("best");
}
