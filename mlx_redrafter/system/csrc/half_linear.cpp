// y = x W^T (+ b) with W stored in float16 and x, b, y in float32, as one MLX primitive on the CPU (built and
// loaded by mlx_redrafter/system/half_linear.py, which also says when it is used).
//
// A drafter's step multiplies a few rows (batch rows x beams) by each of its weight matrices, so it is bound by
// reading the weights: in float32 the shipped drafter is ~35 MB a drafted token, more than this CPU's 32 MB L3,
// so every drafted token reads it from memory again. MLX's CPU backend multiplies float16 weights several times
// slower than float32 ones. Here each weight row is read once as float16, widened to float32 in vector registers
// (exactly: every float16 is a float32) and multiplied into every row of x with float32 fused multiply-adds.
//
// x float32 (M, K), W float16 (N, K), b float32 (N,) -> float32 (M, N). Rows whose entries are contiguous are read
// in place whatever their stride (e.g. the first rows of a larger matrix); any other layout is copied first.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include <omp.h>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"

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

struct Args {
    const float* x;
    int64_t ldx;
    const uint16_t* w;
    int64_t ldw;
    float* y;
    int64_t ldy;
    int M, K;
};

// Weight rows [n0, n1) times every row of x. A vector variant reads a pair of weight rows once per block of up to
// MAXM rows of x and keeps MM x 2 sums in registers; K's tail (past the last whole vector) is summed in scalars.
using RowsFn = void (*)(const Args&, int, int);

static void rows_base(const Args& a, int n0, int n1) {
    for (int n = n0; n < n1; ++n) {
        const uint16_t* w = a.w + (int64_t)n * a.ldw;
        for (int m = 0; m < a.M; ++m) {
            const float* x = a.x + (int64_t)m * a.ldx;
            float s = 0.f;
            for (int k = 0; k < a.K; ++k) s += widen(w[k]) * x[k];
            a.y[(int64_t)m * a.ldy + n] = s;
        }
    }
}

#if defined(__x86_64__)
#define ROWS_VARIANT(NAME, TARGET, V, LANES, WIDEN, LOADX, FMA, ZERO, SUM, MAXM)                                     \
    template <int MM>                                                                                              \
    TARGET static inline void NAME##_block(const Args& a, int m0, int n0, int n1) {                                \
        const float* x = a.x + (int64_t)m0 * a.ldx;                                                                \
        const int Kv = a.K / LANES * LANES;                                                                        \
        for (int n = n0; n < n1; n += 2) {                                                                         \
            const bool two = n + 1 < n1;                                                                           \
            const uint16_t* w0 = a.w + (int64_t)n * a.ldw;                                                         \
            const uint16_t* w1 = two ? w0 + a.ldw : w0;                                                            \
            V acc0[MM], acc1[MM];                                                                                  \
            for (int m = 0; m < MM; ++m) acc0[m] = acc1[m] = ZERO;                                                 \
            for (int k = 0; k < Kv; k += LANES) {                                                                  \
                _mm_prefetch((const char*)(w1 + a.ldw + k), _MM_HINT_T0); /* the next pair */                      \
                _mm_prefetch((const char*)(w1 + 2 * a.ldw + k), _MM_HINT_T0);                                      \
                const V u = WIDEN(w0 + k), v = WIDEN(w1 + k);                                                      \
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
                    s0 += widen(w0[k]) * xm[k];                                                                    \
                    s1 += widen(w1[k]) * xm[k];                                                                    \
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

#define W512(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(p)))
#define W256(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p)))
__attribute__((target("avx2,fma,f16c"))) static inline float sum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
ROWS_VARIANT(rows_avx512, __attribute__((target("avx512f"))), __m512, 16, W512, _mm512_loadu_ps, _mm512_fmadd_ps,
             _mm512_setzero_ps(), _mm512_reduce_add_ps, 8)
ROWS_VARIANT(rows_avx2, __attribute__((target("avx2,fma,f16c"))), __m256, 8, W256, _mm256_loadu_ps,
             _mm256_fmadd_ps, _mm256_setzero_ps(), sum256, 4)
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
        rows_fn_ = rows_avx512;
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

class HalfLinear : public mx::Primitive {
   public:
    HalfLinear(mx::Stream s, bool bias) : mx::Primitive(s), bias_(bias) {}

    void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
    void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
        throw std::runtime_error("half_linear runs on the CPU only");
    }
    const char* name() const override { return "HalfLinear"; }
    bool is_equivalent(const mx::Primitive& other) const override {
        return bias_ == static_cast<const HalfLinear&>(other).bias_;
    }

   private:
    bool bias_;
};

void HalfLinear::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
    auto& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (auto& a : inputs) enc.set_input_array(a);
    enc.set_output_array(out);
    enc.dispatch([ins = inputs, out = mx::array::unsafe_weak_copy(out), bias = bias_, threads = threads_,
                  rows = rows_fn_]() mutable {
        const auto& x = ins[0];
        const auto& w = ins[1];
        const int M = x.shape(0), K = x.shape(1), N = w.shape(0);
        std::vector<float> xc;
        std::vector<uint16_t> wc;
        int64_t ldx, ldw;
        const float* xp = rows_of(x.data<float>(), x, xc, ldx);
        const uint16_t* wp = rows_of(reinterpret_cast<const uint16_t*>(w.data<mx::float16_t>()), w, wc, ldw);
        Args a{xp, ldx, wp, ldw, out.data<float>(), (int64_t)N, M, K};
        const float* b = bias ? ins[2].data<float>() : nullptr;
        auto run = [&](int n0, int n1) {
            rows(a, n0, n1);
            if (b)
                for (int m = 0; m < M; ++m)
                    for (int n = n0; n < n1; ++n) a.y[(int64_t)m * N + n] += b[n];
        };
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
    });
}

mx::array half_linear(const mx::array& x, const mx::array& w, std::optional<mx::array> bias) {
    auto s = mx::default_stream(mx::Device::cpu);
    if (x.dtype() != mx::float32 || w.dtype() != mx::float16 || x.ndim() != 2 || w.ndim() != 2 ||
        x.shape(1) != w.shape(1) || x.shape(0) < 1 || w.shape(0) < 1)
        throw std::invalid_argument("half_linear: float32 x (M, K) and float16 weights (N, K)");
    std::vector<mx::array> ins = {x, w};  // layouts are known once evaluated: eval_cpu reads them
    if (bias) {
        if (bias->ndim() != 1 || bias->shape(0) != w.shape(0))
            throw std::invalid_argument("half_linear: bias (N,)");
        ins.push_back(mx::contiguous(mx::astype(*bias, mx::float32, s), false, s));
    }
    return mx::array({x.shape(0), w.shape(0)}, mx::float32, std::make_shared<HalfLinear>(s, bias.has_value()),
                     std::move(ins));
}

}  // namespace

NB_MODULE(_half_linear, m) {
    m.doc() = "x @ W.T (+ b) with float16 weights as one MLX CPU primitive (see half_linear.cpp).";
    m.def("half_linear", &half_linear, nb::arg("x"), nb::arg("w"), nb::arg("bias") = nb::none());
    m.def("set_threads", [](int n) { threads_ = std::max(1, n); }, nb::arg("n"));
    m.def("set_isa", &set_isa, nb::arg("want") = "best");
    m.def("version", []() { return 1; });
    set_isa("best");
}
