// Transcendental vector math as MLX primitives on the CPU (built by mlx_redrafter/system/vector_math.py, which also
// says when they are used): log(sum(exp(x))) over the last axis and its gradient; SiLU and its gradient.
//
// MLX's CPU wheel computes exp, sigmoid and tanh one element at a time (~10-14 ns an element here, where an addition
// takes 0.2 ns), so in a drafter's training step the normalisation of the head's 42M logits took ~1.3 s of 2.7 s
// and the SiLUs of its ResBlocks and recurrent update more than their matrix products. Here 2^x is a polynomial in
// vector registers (vector_exp.h): the log-sum-exp of a row is two passes (the max, then the sum), its gradient
// (softmax(x) times the row's cotangent) one, SiLU and its gradient one each.
//
// float32 only: x (rows, n), contiguous rows; lse (rows,); cotangent (rows,); SiLU of any contiguous shape.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include <omp.h>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include "mlx/backend/common/utils.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"
#include "kernel_tables.h"
#include "vector_exp.h"

namespace nb = nanobind;
namespace mx = mlx::core;

namespace {

constexpr int64_t PARALLEL_WORK = 1 << 16;  // elements below which one thread does it all
constexpr float LOG2E = 1.4426950408889634f;
int threads_ = 1;  // set_threads

// log(sum(exp(x[0..n)))): +inf where x holds +inf, NaN where it holds a NaN (and no +inf), -inf for a row of -inf.
template <int LN>
__attribute__((always_inline)) static inline float lse_row(const float* __restrict x, int64_t n) {
    typedef typename Vec<LN>::F F;
    typedef typename Vec<LN>::I I;
    const float ninf = -std::numeric_limits<float>::infinity();
    const int64_t nv = n / LN * LN;
    F top = ninf - F{};
    F bad = {};  // x * 0: NaN where x is a NaN or an infinity
    for (int64_t j = 0; j < nv; j += LN) {
        const F v = load<F>(x + j);
        top = v > top ? v : top;
        bad += v * 0.0f;
    }
    float t = ninf, b = 0.0f;
    for (int l = 0; l < LN; ++l) {
        t = top[l] > t ? top[l] : t;
        b += bad[l];
    }
    for (int64_t j = nv; j < n; ++j) {
        t = x[j] > t ? x[j] : t;
        b += x[j] * 0.0f;
    }
    if (b != b) {  // a NaN or an infinity somewhere
        for (int64_t j = 0; j < n; ++j)
            if (x[j] == std::numeric_limits<float>::infinity()) return x[j];
        bool any_nan = false;
        for (int64_t j = 0; j < n; ++j) any_nan |= x[j] != x[j];
        if (any_nan) return std::numeric_limits<float>::quiet_NaN();
        if (t == ninf) return ninf;  // only -inf (and finite values, handled below)
    }
    F sum = {};
    for (int64_t j = 0; j < nv; j += LN) {
        const F v = load<F>(x + j);
        const F p = exp2_neg<F, I>((v - t) * LOG2E);
        sum += v == ninf ? F{} : p;  // exp(-inf) is exactly 0 (2^x stops at 2^-126)
    }
    float s = 0.0f;
    for (int l = 0; l < LN; ++l) s += sum[l];
    for (int64_t j = nv; j < n; ++j) s += std::exp(x[j] - t);
    return t + std::log(s);
}

// out[0..n) = exp(x - lse) * g: the gradient of lse (softmax) scaled by the row's cotangent g.
template <int LN>
__attribute__((always_inline)) static inline void softmax_row(const float* __restrict x, int64_t n, float lse,
                                                              float g, float* __restrict out) {
    typedef typename Vec<LN>::F F;
    typedef typename Vec<LN>::I I;
    if (!std::isfinite(lse)) {  // -inf: every x is -inf (weight 0); +inf or NaN: undefined
        const float fill = lse == -std::numeric_limits<float>::infinity() ? 0.0f
                                                                           : std::numeric_limits<float>::quiet_NaN();
        std::fill(out, out + n, fill);
        return;
    }
    const int64_t nv = n / LN * LN;
    const float ninf = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < nv; j += LN) {
        const F v = load<F>(x + j);
        const F p = exp2_neg<F, I>((v - lse) * LOG2E) * g;
        store<F>(out + j, v == ninf ? F{} : p);
    }
    for (int64_t j = nv; j < n; ++j) out[j] = std::exp(x[j] - lse) * g;
}

// sigmoid(x) of a vector: 1 / (1 + e^-x) from e = 2^(-|x| log2 e) <= 1 (no overflow for any x).
template <typename F, typename I>
__attribute__((always_inline)) static inline F sigmoid(F x) {
    const F e = exp2_neg<F, I>((x > 0.0f ? -x : x) * LOG2E);
    const F r = 1.0f / (1.0f + e);
    return x > 0.0f ? r : e * r;
}

// out[i] = x[i] sigmoid(x[i]), times u[i] where u is given (a Llama MLP's gate), i in [i0, i1)
template <int LN>
__attribute__((always_inline)) static inline void silu_span(const float* __restrict x, const float* __restrict u,
                                                            int64_t i0, int64_t i1, float* __restrict out) {
    typedef typename Vec<LN>::F F;
    typedef typename Vec<LN>::I I;
    int64_t i = i0;
    if (u) {
        for (; i + LN <= i1; i += LN) {
            const F v = load<F>(x + i);
            store<F>(out + i, v * sigmoid<F, I>(v) * load<F>(u + i));
        }
        for (; i < i1; ++i) out[i] = x[i] / (1.0f + std::exp(-x[i])) * u[i];
        return;
    }
    for (; i + LN <= i1; i += LN) {
        const F v = load<F>(x + i);
        store<F>(out + i, v * sigmoid<F, I>(v));
    }
    for (; i < i1; ++i) out[i] = x[i] / (1.0f + std::exp(-x[i]));
}

// out[i] = g[i] d silu / dx at x[i] = g[i] s (1 + x (1 - s)), s = sigmoid(x[i])
template <int LN>
__attribute__((always_inline)) static inline void silu_grad_span(const float* __restrict x, const float* __restrict g,
                                                                 int64_t i0, int64_t i1, float* __restrict out) {
    typedef typename Vec<LN>::F F;
    typedef typename Vec<LN>::I I;
    int64_t i = i0;
    for (; i + LN <= i1; i += LN) {
        const F v = load<F>(x + i);
        const F sg = sigmoid<F, I>(v);
        store<F>(out + i, load<F>(g + i) * sg * (1.0f + v * (1.0f - sg)));
    }
    for (; i < i1; ++i) {
        const float sg = 1.0f / (1.0f + std::exp(-x[i]));
        out[i] = g[i] * sg * (1.0f + x[i] * (1.0f - sg));
    }
}

// The indices of the k largest of x[0..n) (k <= n), largest first, equal values in index order (as a stable sort
// of -x would give them): one pass against the k-th largest so far, which few elements beat.
template <int LN>
__attribute__((always_inline)) static inline void top_k_row(const float* __restrict x, int64_t n, int k,
                                                            int32_t* __restrict out) {
    typedef typename Vec<LN>::F F;
    float best[64];
    int32_t at[64];
    int m = 0;  // entries held, best[0] >= best[1] >= ...
    auto offer = [&](float v, int32_t i) {
        if (m == k && !(v > best[k - 1])) return;  // not above the k-th (a NaN never is)
        int j = m < k ? m++ : k - 1;
        while (j > 0 && v > best[j - 1]) {
            best[j] = best[j - 1];
            at[j] = at[j - 1];
            --j;
        }
        best[j] = v;
        at[j] = i;
    };
    int64_t j = 0;
    for (; j < n && m < k; ++j) offer(x[j], (int32_t)j);
    for (; j < n && j % LN; ++j) offer(x[j], (int32_t)j);
    for (; j + LN <= n; j += LN) {
        const F v = load<F>(x + j);
        const auto above = v > best[k - 1];
        bool any = false;
        for (int l = 0; l < LN; ++l) any |= above[l] != 0;
        if (!any) continue;
        for (int l = 0; l < LN; ++l) offer(x[j + l], (int32_t)(j + l));
    }
    for (; j < n; ++j) offer(x[j], (int32_t)j);
    for (int i = 0; i < k; ++i) out[i] = at[i];
}

using LseFn = void (*)(const float*, int64_t, int64_t, int64_t, float*);
using GradFn = void (*)(const float*, int64_t, int64_t, int64_t, const float*, const float*, float*);
using SiluFn = void (*)(const float*, const float*, int64_t, int64_t, float*);
using SiluGradFn = void (*)(const float*, const float*, int64_t, int64_t, float*);
using TopKFn = void (*)(const float*, int64_t, int, int64_t, int64_t, int32_t*);
#define VARIANTS(SUFFIX, TARGET, LN)                                                                         \
    TARGET static void lse_##SUFFIX(const float* x, int64_t n, int64_t r0, int64_t r1, float* out) {         \
        for (int64_t r = r0; r < r1; ++r) out[r] = lse_row<LN>(x + r * n, n);                                \
    }                                                                                                        \
    TARGET static void grad_##SUFFIX(const float* x, int64_t n, int64_t r0, int64_t r1, const float* lse,   \
                                     const float* g, float* out) {                                           \
        for (int64_t r = r0; r < r1; ++r) softmax_row<LN>(x + r * n, n, lse[r], g[r], out + r * n);          \
    }                                                                                                        \
    TARGET static void silu_##SUFFIX(const float* x, const float* u, int64_t i0, int64_t i1, float* out) {   \
        silu_span<LN>(x, u, i0, i1, out);                                                                    \
    }                                                                                                        \
    TARGET static void silu_grad_##SUFFIX(const float* x, const float* g, int64_t i0, int64_t i1, float* out) { \
        silu_grad_span<LN>(x, g, i0, i1, out);                                                               \
    }                                                                                                        \
    TARGET static void top_k_##SUFFIX(const float* x, int64_t n, int k, int64_t r0, int64_t r1, int32_t* out) { \
        for (int64_t r = r0; r < r1; ++r) top_k_row<LN>(x + r * n, n, k, out + r * k);                        \
    }
VARIANTS(base, , 8)
#if defined(__x86_64__)
VARIANTS(avx2, __attribute__((target("avx2,fma"))), 8)
VARIANTS(avx512, __attribute__((target("avx512f"))), 16)
#endif

const char* isa_ = nullptr;
LseFn lse_fn_ = nullptr;
GradFn grad_fn_ = nullptr;
SiluFn silu_fn_ = nullptr;
SiluGradFn silu_grad_fn_ = nullptr;
TopKFn top_k_fn_ = nullptr;

// "avx512", "avx2" or "base": the best this CPU runs, or the one asked for where it runs it. Returns the choice.
const char* set_isa(const std::string& want) {
    isa_ = pick_isa(want);
    const std::string isa = isa_;
    lse_fn_ = lse_base;
    grad_fn_ = grad_base;
    silu_fn_ = silu_base;
    silu_grad_fn_ = silu_grad_base;
    top_k_fn_ = top_k_base;
#if defined(__x86_64__)
    if (isa == "avx512") {
        lse_fn_ = lse_avx512;
        grad_fn_ = grad_avx512;
        silu_fn_ = silu_avx512;
        silu_grad_fn_ = silu_grad_avx512;
        top_k_fn_ = top_k_avx512;
    } else if (isa == "avx2") {
        lse_fn_ = lse_avx2;
        grad_fn_ = grad_avx2;
        silu_fn_ = silu_avx2;
        silu_grad_fn_ = silu_grad_avx2;
        top_k_fn_ = top_k_avx2;
    }
#endif
    return isa_;
}

// Rows [0, rows) shared out in contiguous ranges over the threads (one thread for small work).
template <typename Fn>
static void over_rows(int64_t rows, int64_t n, int threads, Fn fn) {
    const int T = (int)std::min<int64_t>(threads, rows);
    if (T <= 1 || rows * n < PARALLEL_WORK) {
        fn(0, rows);
        return;
    }
#pragma omp parallel num_threads(T)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        fn(rows * t / nt, rows * (t + 1) / nt);
    }
}

// Elements [0, n) shared out in contiguous ranges of whole cache lines over the threads.
template <typename Fn>
static void over_elements(int64_t n, int threads, Fn fn) {
    const int64_t lines = (n + 15) / 16;
    const int T = (int)std::min<int64_t>(threads, lines);
    if (T <= 1 || n < PARALLEL_WORK) {
        fn(0, n);
        return;
    }
#pragma omp parallel num_threads(T)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        fn(std::min(n, lines * t / nt * 16), std::min(n, lines * (t + 1) / nt * 16));
    }
}

// One primitive of this file: `run(inputs, output)` on the CPU stream's thread, into a newly allocated output. The
// variant and the threads are those set when the array was built.
class CpuPrimitive : public mx::Primitive {
   public:
    using Run = std::function<void(const std::vector<mx::array>&, mx::array&)>;
    CpuPrimitive(mx::Stream s, const char* name, Run run) : mx::Primitive(s), name_(name), run_(std::move(run)) {}
    void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
        auto& out = outputs[0];
        out.set_data(mx::allocator::malloc(out.nbytes()));
        auto& enc = mx::cpu::get_command_encoder(stream());
        for (auto& a : inputs) enc.set_input_array(a);
        enc.set_output_array(out);
        enc.dispatch([ins = inputs, out = mx::array::unsafe_weak_copy(out), run = run_]() mutable { run(ins, out); });
    }
    void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
        throw std::runtime_error(std::string(name_) + " runs on the CPU only");
    }
    const char* name() const override { return name_; }
    bool is_equivalent(const mx::Primitive& other) const override {
        return std::string(name_) == static_cast<const CpuPrimitive&>(other).name_;
    }

   private:
    const char* name_;
    Run run_;
};

// x -> x sigmoid(x), times u where given (the same shape: a Llama MLP's gate, in one pass); float32.
static mx::array silu_times(const mx::array& x, const mx::array* u, const char* name) {
    if (x.dtype() != mx::float32 || (u && (u->dtype() != mx::float32 || u->shape() != x.shape())))
        throw std::invalid_argument(std::string(name) + ": float32 inputs of one shape");
    auto s = mx::default_stream(mx::Device::cpu);
    auto run = [threads = threads_, fn = silu_fn_](const std::vector<mx::array>& ins, mx::array& out) {
        const float* xp = ins[0].data<float>();
        const float* up = ins.size() > 1 ? ins[1].data<float>() : nullptr;
        float* o = out.data<float>();
        over_elements(out.size(), threads, [&](int64_t i0, int64_t i1) { fn(xp, up, i0, i1, o); });
    };
    std::vector<mx::array> ins = {mx::contiguous(x, false, s)};
    if (u) ins.push_back(mx::contiguous(*u, false, s));
    return mx::array(x.shape(), mx::float32, std::make_shared<CpuPrimitive>(s, name, run), std::move(ins));
}

mx::array silu(const mx::array& x) { return silu_times(x, nullptr, "Silu"); }

mx::array silu_mul(const mx::array& g, const mx::array& u) { return silu_times(g, &u, "SiluMul"); }

// An evaluated float32 array's data in row-major order: its own memory where it lies so, else a copy in `keep`.
static const float* row_major(const mx::array& a, std::vector<float>& keep) {
    const float* p = a.data<float>();
    if (a.flags().row_contiguous) return p;
    keep.resize(a.size());
    for (size_t i = 0; i < a.size(); ++i) keep[i] = p[mx::elem_to_loc((int)i, a)];
    return keep.data();
}

// gu (..., 2h): a Llama MLP's fused gate and up products side by side -> silu(gate) * up (..., h): one graph node
// where a split and two copies made the halves contiguous; float32. A product's output is read in place; another
// layout is gathered first.
mx::array silu_mul_halves(const mx::array& gu) {
    if (gu.dtype() != mx::float32 || gu.ndim() < 1 || gu.shape(-1) % 2 != 0)
        throw std::invalid_argument("SiluMulHalves: a float32 input whose last axis has an even size");
    auto s = mx::default_stream(mx::Device::cpu);
    auto shape = gu.shape();
    const int64_t h = shape.back() / 2;
    shape.back() = (int)h;
    auto run = [threads = threads_, fn = silu_fn_, h](const std::vector<mx::array>& ins, mx::array& out) {
        std::vector<float> gathered;
        const float* x = row_major(ins[0], gathered);
        float* o = out.data<float>();
        const int64_t rows = h ? (int64_t)out.size() / h : 0;
        over_rows(rows, 2 * h, threads, [&](int64_t r0, int64_t r1) {
            for (int64_t r = r0; r < r1; ++r) fn(x + 2 * h * r, x + 2 * h * r + h, 0, h, o + h * r);
        });
    };
    return mx::array(shape, mx::float32, std::make_shared<CpuPrimitive>(s, "SiluMulHalves", run), {gu});
}

// x (..., n) over its RMS along the last axis, times w (n) where given: x * (1 / sqrt(sum(x * x) * inv_n + eps)) * w,
// the arithmetic of MLX's own graph for it step for step (a sequential sum of the rounded squares, as MLX's CPU
// reduction takes it, each product and sum rounded apart: this function has no vector ISA of its own, so no fused
// multiply-add), so the same bits in one node where that graph is three (square, sum, the element-wise rest).
static void rms_rows(const float* x, const float* w, int64_t r0, int64_t r1, int64_t n, float inv_n, float eps,
                     float* out) {
    for (int64_t r = r0; r < r1; ++r) {
        const float* xr = x + r * n;
        float* o = out + r * n;
        float acc = 0.0f;
        for (int64_t i = 0; i < n; ++i) {
            const float sq = xr[i] * xr[i];
            acc = acc + sq;
        }
        const float scaled = acc * inv_n;
        const float inv = 1.0f / std::sqrt(scaled + eps);
        if (w) {
            for (int64_t i = 0; i < n; ++i) {
                const float v = xr[i] * inv;
                o[i] = v * w[i];
            }
        } else {
            for (int64_t i = 0; i < n; ++i) o[i] = xr[i] * inv;
        }
    }
}

mx::array rms_norm(const mx::array& x, std::optional<mx::array> w, float eps) {
    if (x.dtype() != mx::float32 || x.ndim() < 1 || x.shape(-1) < 1 ||
        (w && (w->dtype() != mx::float32 || w->ndim() != 1 || w->shape(0) != x.shape(-1))))
        throw std::invalid_argument("RmsNorm: float32 x (..., n) and weight (n)");
    auto s = mx::default_stream(mx::Device::cpu);
    const int64_t n = x.shape(-1);
    const float inv_n = (float)(1.0 / (double)n);
    auto run = [threads = threads_, n, inv_n, eps](const std::vector<mx::array>& ins, mx::array& out) {
        std::vector<float> gx, gw;
        const float* xp = row_major(ins[0], gx);
        const float* wp = ins.size() > 1 ? row_major(ins[1], gw) : nullptr;
        float* o = out.data<float>();
        over_rows((int64_t)out.size() / n, n, threads,
                  [&](int64_t r0, int64_t r1) { rms_rows(xp, wp, r0, r1, n, inv_n, eps, o); });
    };
    std::vector<mx::array> ins = {x};  // read in place where row-major (no Contiguous node: each costs a dispatch)
    if (w) ins.push_back(*w);
    return mx::array(x.shape(), mx::float32, std::make_shared<CpuPrimitive>(s, "RmsNorm", run), std::move(ins));
}

// x, g (the same shape) -> g times the derivative of silu at x.
mx::array silu_grad(const mx::array& x, const mx::array& g) {
    if (x.dtype() != mx::float32 || g.shape() != x.shape()) throw std::invalid_argument("silu_grad: float32 x and g of one shape");
    auto s = mx::default_stream(mx::Device::cpu);
    auto run = [threads = threads_, fn = silu_grad_fn_](const std::vector<mx::array>& ins, mx::array& out) {
        const float* xp = ins[0].data<float>();
        const float* gp = ins[1].data<float>();
        float* o = out.data<float>();
        over_elements(out.size(), threads, [&](int64_t i0, int64_t i1) { fn(xp, gp, i0, i1, o); });
    };
    return mx::array(x.shape(), mx::float32, std::make_shared<CpuPrimitive>(s, "SiluGrad", run),
                     {mx::contiguous(x, false, s), mx::contiguous(mx::astype(g, mx::float32, s), false, s)});
}

// x (rows, n) float32 -> the indices (rows, k) int32 of each row's k largest, largest first (1 <= k <= min(n, 64)).
mx::array top_k_rows(const mx::array& x, int k) {
    if (x.dtype() != mx::float32 || x.ndim() != 2 || k < 1 || k > 64 || k > x.shape(1))
        throw std::invalid_argument("top_k_rows: float32 x of shape (rows, n) and 1 <= k <= min(n, 64)");
    auto s = mx::default_stream(mx::Device::cpu);
    auto run = [threads = threads_, fn = top_k_fn_, k](const std::vector<mx::array>& ins, mx::array& out) {
        const int64_t rows = ins[0].shape(0), n = ins[0].shape(1);
        const float* xp = ins[0].data<float>();
        int32_t* o = out.data<int32_t>();
        over_rows(rows, n, threads, [&](int64_t r0, int64_t r1) { fn(xp, n, k, r0, r1, o); });
    };
    return mx::array({x.shape(0), k}, mx::int32, std::make_shared<CpuPrimitive>(s, "TopKRows", run),
                     {mx::contiguous(x, false, s)});
}

static void check_rows(const mx::array& x, const char* what) {
    if (x.dtype() != mx::float32 || x.ndim() != 2 || x.shape(1) < 1)
        throw std::invalid_argument(std::string(what) + ": float32 x of shape (rows, n >= 1)");
}

// x (rows, n) -> log(sum(exp(x), axis=1)), (rows,).
mx::array logsumexp_rows(const mx::array& x) {
    check_rows(x, "logsumexp_rows");
    auto s = mx::default_stream(mx::Device::cpu);
    auto run = [threads = threads_, fn = lse_fn_](const std::vector<mx::array>& ins, mx::array& out) {
        const int64_t rows = ins[0].shape(0), n = ins[0].shape(1);
        const float* xp = ins[0].data<float>();
        float* o = out.data<float>();
        over_rows(rows, n, threads, [&](int64_t r0, int64_t r1) { fn(xp, n, r0, r1, o); });
    };
    return mx::array({x.shape(0)}, mx::float32, std::make_shared<CpuPrimitive>(s, "LogSumExpRows", run),
                     {mx::contiguous(x, false, s)});
}

// x (rows, n), lse (rows,) = logsumexp_rows(x), g (rows,) -> exp(x - lse[:, None]) * g[:, None], (rows, n).
mx::array softmax_scaled_rows(const mx::array& x, const mx::array& lse, const mx::array& g) {
    check_rows(x, "softmax_scaled_rows");
    if (lse.ndim() != 1 || g.ndim() != 1 || lse.shape(0) != x.shape(0) || g.shape(0) != x.shape(0))
        throw std::invalid_argument("softmax_scaled_rows: lse and g of shape (rows,)");
    auto s = mx::default_stream(mx::Device::cpu);
    std::vector<mx::array> ins = {mx::contiguous(x, false, s), mx::contiguous(mx::astype(lse, mx::float32, s), false, s),
                                  mx::contiguous(mx::astype(g, mx::float32, s), false, s)};
    auto run = [threads = threads_, fn = grad_fn_](const std::vector<mx::array>& ins, mx::array& out) {
        const int64_t rows = ins[0].shape(0), n = ins[0].shape(1);
        const float* xp = ins[0].data<float>();
        const float* lse = ins[1].data<float>();
        const float* g = ins[2].data<float>();
        float* o = out.data<float>();
        over_rows(rows, n, threads, [&](int64_t r0, int64_t r1) { fn(xp, n, r0, r1, lse, g, o); });
    };
    return mx::array(x.shape(), mx::float32, std::make_shared<CpuPrimitive>(s, "SoftmaxScaledRows", run),
                     std::move(ins));
}

// What a fused primitive of another extension runs (kernel_tables.h): the rows of `rms_norm` and of
// `silu_mul_halves` as those primitives compute each row, with the variant `set_isa` chose.
static void silu_mul_halves_rows(const float* gu, int64_t rows, int64_t h, float* out) {
    for (int64_t r = 0; r < rows; ++r) silu_fn_(gu + 2 * h * r, gu + 2 * h * r + h, 0, h, out + h * r);
}

const VectorMathKernels kernels_ = {1, rms_rows, silu_mul_halves_rows};

}  // namespace

NB_MODULE(_vector_math, m) {
    m.doc() = "log-sum-exp over rows and its gradient as MLX CPU primitives (see vector_math.cpp).";
    m.def("logsumexp_rows", &logsumexp_rows, nb::arg("x"));
    m.def("softmax_scaled_rows", &softmax_scaled_rows, nb::arg("x"), nb::arg("lse"), nb::arg("g"));
    m.def("silu", &silu, nb::arg("x"));
    m.def("silu_grad", &silu_grad, nb::arg("x"), nb::arg("g"));
    m.def("silu_mul", &silu_mul, nb::arg("g"), nb::arg("u"));
    m.def("silu_mul_halves", &silu_mul_halves, nb::arg("gu"));
    m.def("rms_norm", &rms_norm, nb::arg("x"), nb::arg("w").none(), nb::arg("eps"));
    m.def("top_k_rows", &top_k_rows, nb::arg("x"), nb::arg("k"));
    m.def("set_threads", [](int n) { threads_ = std::max(1, n); }, nb::arg("n"));
    m.def("set_isa", &set_isa, nb::arg("want") = "best");
    m.def("kernels", []() { return nb::capsule(&kernels_, VECTOR_MATH_KERNELS); });
    m.def("version", []() { return 2; });
    set_isa("best");
}
