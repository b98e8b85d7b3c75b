// softmax(scores) @ values as one MLX primitive on the CPU (decode, verification and batched steps, prefills;
// built by mlx_redrafter/system/attention_kernel.py, which also says when it is used), and attention's inputs
// (q, k, v laid out and rotated, `HeadsRope` below) as another.
//
// MLX's CPU backend computes attention's softmax as 4-5 element-wise and reduction kernels, each its own dispatch
// over the (rows, KV heads, query rows, keys) scores, and on a CPU those passes cost about as much as the two
// matrix products (B = 4 rows x 3 tokens at 400 keys: ~0.3 of ~0.45 ms a layer). The scores' product stays MLX's
// (it reaches the small-GEMM kernel); here, for each score row, the mask, the softmax (2^x by a polynomial, in
// vector registers) and the weighted sum of values run in one pass: one dispatch a layer.
//
// A row's output depends only on its own scores and the keys it may see: a masked key weighs exactly 0 and the
// max and sum run in vector lanes by key index, so masked keys beside it (other candidates of a tree, padding of
// other rows) change no partial sum.
//
// float32 only: scores (B, h_kv, G * N, S) (rows: query head in the group, then token), values (B, h_kv, S, D <=
// 256), mask (B or 1, 1, N or G * N or 1, S) bool; any strides (a copy is made where the last axis is strided).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <vector>

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
#include "vector_exp.h"

namespace nb = nanobind;
namespace mx = mlx::core;

namespace {

constexpr int MAX_D = 256;
constexpr int64_t PARALLEL_WORK = 1 << 18;  // multiply-adds below which one thread does it all
int threads_ = 1;             // set_threads

struct View {  // a float32 array of 4 dims
    const float* data;
    int64_t s0, s1, s2;  // strides of dims 0-2 (elements); dim 3 is contiguous
};

struct MaskView {
    const bool* data;
    int64_t s0, s2, s3;  // strides of the batch, mask row and key dims (0 where broadcast)
    bool grouped;        // one mask row per score row (G * N rows) rather than per token (N)
};

// One KV head of one batch row: its R = G * N score rows (the G query heads that share the KV head x the N
// tokens, q.k unscaled) -> R output rows of D. Sums run in LN lanes by key index, so a masked key (weight exactly
// 0) changes no partial sum: a row's output does not depend on the keys it may not see.
template <int LN, int D_>
__attribute__((always_inline)) static inline void unit(const float* scores, int64_t rs, const View& v,
                                                       const MaskView* m, float* out, int b, int g, int N, int r0,
                                                       int r1, int S, int D, float scale, float* w) {
    typedef typename Vec<LN>::F F;
    typedef typename Vec<LN>::I I;
    constexpr int L = LN;
    const int Dd = D_ > 0 ? D_ : D;
    const float c = scale * 1.4426950408889634f;  // exp(x) = 2^(x log2 e)
    const float ninf = -std::numeric_limits<float>::infinity();
    const int Sp = (S + L - 1) / L * L;
    const float* vb = v.data + b * v.s0 + g * v.s1;
    for (int r = r0; r < r1; ++r) {
        const float* __restrict sr = scores + (int64_t)r * rs;
        float* __restrict wr = w;
        const int n = r % N;
        if (!m) {
            for (int j = 0; j < S; ++j) wr[j] = sr[j];
        } else {
            const bool* mr = m->data + b * m->s0 + (m->grouped ? r : n) * m->s2;
            if (m->s3 == 1)
                for (int j = 0; j < S; ++j) wr[j] = mr[j] ? sr[j] : ninf;
            else
                for (int j = 0; j < S; ++j) wr[j] = mr[j * m->s3] ? sr[j] : ninf;
        }
        for (int j = S; j < Sp; ++j) wr[j] = ninf;
        F top = ninf - F{};
        for (int j0 = 0; j0 < Sp; j0 += L) {
            const F x = load<F>(wr + j0);
            top = x > top ? x : top;
        }
        float t = ninf;
        for (int l = 0; l < L; ++l) t = top[l] > t ? top[l] : t;
        float* __restrict o = out + (int64_t)r * Dd;
        if (t == ninf) {  // sees no key
            for (int d = 0; d < Dd; ++d) o[d] = 0.0f;
            continue;
        }
        F sum = {};
        for (int j0 = 0; j0 < Sp; j0 += L) {
            const F x = load<F>(wr + j0);
            const F p = exp2_neg<F, I>(c * (x - t));
            const F w = x == ninf ? F{} : p;  // a masked key weighs exactly 0
            store(wr + j0, w);
            sum += w;
        }
        float total = 0.0f;
        for (int l = 0; l < L; ++l) total += sum[l];
        if (Dd == 64) {  // 64 / LN accumulators per key, two keys per iteration: they stay in registers
            constexpr int K = 64 / LN;
            F a[K] = {}, bb[K] = {};
            int j = 0;
            for (; j + 1 < S; j += 2) {
                const float* x = vb + (int64_t)j * v.s2;
                const float* y = x + v.s2;
                const float p = wr[j], q = wr[j + 1];
                for (int k = 0; k < K; ++k) a[k] += p * load<F>(x + k * LN);
                for (int k = 0; k < K; ++k) bb[k] += q * load<F>(y + k * LN);
            }
            for (int k = 0; k < K; ++k) a[k] += bb[k];
            if (j < S) {
                const float* x = vb + (int64_t)j * v.s2;
                const float p = wr[j];
                for (int k = 0; k < K; ++k) a[k] += p * load<F>(x + k * LN);
            }
            const float inv = 1.0f / total;
            for (int k = 0; k < K; ++k) store<F>(o + k * LN, a[k] * inv);
            continue;
        }
        alignas(64) float acc[MAX_D] = {};
        for (int j = 0; j < S; ++j) {
            const float p = wr[j];
            const float* __restrict vr = vb + (int64_t)j * v.s2;
            for (int d = 0; d < Dd; ++d) acc[d] += p * vr[d];
        }
        const float inv = 1.0f / total;
        for (int d = 0; d < Dd; ++d) o[d] = acc[d] * inv;
    }
}

// The unit compiled for AVX-512, AVX2 + FMA and the build's baseline; `isa_` picks the best the CPU runs (or one
// asked for by set_isa, for tests).
using UnitFn = void (*)(const float*, int64_t, const View&, const MaskView*, float*, int, int, int, int, int, int,
                        int, float, float*);
#define UNIT_VARIANT(NAME, TARGET, LN)                                                                               \
    TARGET static void NAME(const float* scores, int64_t rs, const View& v, const MaskView* m, float* out, int b,  \
                            int g, int N, int r0, int r1, int S, int D, float scale, float* w) {                   \
        if (D == 64)                                                                                               \
            unit<LN, 64>(scores, rs, v, m, out, b, g, N, r0, r1, S, D, scale, w);                                  \
        else                                                                                                       \
            unit<LN, 0>(scores, rs, v, m, out, b, g, N, r0, r1, S, D, scale, w);                                   \
    }
UNIT_VARIANT(unit_base, , 8)
#if defined(__x86_64__)
UNIT_VARIANT(unit_avx2, __attribute__((target("avx2,fma"))), 8)
UNIT_VARIANT(unit_avx512, __attribute__((target("avx512f"))), 16)
#endif

const char* isa_ = nullptr;
UnitFn unit_fn_ = nullptr;

// "avx512", "avx2" or "base": the best this CPU runs, or the one asked for where it runs it. Returns the choice.
const char* set_isa(const std::string& want) {
    isa_ = pick_isa(want);
    const std::string isa = isa_;
    unit_fn_ = unit_base;
#if defined(__x86_64__)
    if (isa == "avx512")
        unit_fn_ = unit_avx512;
    else if (isa == "avx2")
        unit_fn_ = unit_avx2;
#endif
    return isa_;
}

class SoftmaxValues : public mx::Primitive {
   public:
    SoftmaxValues(mx::Stream s, float scale, int n, bool masked)
        : mx::Primitive(s), scale_(scale), n_(n), masked_(masked) {}

    void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
    void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
        throw std::runtime_error("softmax_values runs on the CPU only");
    }
    const char* name() const override { return "SoftmaxValues"; }
    bool is_equivalent(const mx::Primitive& other) const override {
        auto& o = static_cast<const SoftmaxValues&>(other);
        return scale_ == o.scale_ && n_ == o.n_ && masked_ == o.masked_;
    }

   private:
    float scale_;
    int n_;
    bool masked_;
};

// A view with a contiguous last dim: the array's own memory, or a contiguous copy of it in `keep`.
static View view_of(const mx::array& a, std::vector<float>& keep) {
    auto& st = a.strides();
    if (st[3] == 1 || a.shape(3) == 1) return View{a.data<float>(), (int64_t)st[0], (int64_t)st[1], (int64_t)st[2]};
    int64_t cs[3];
    const float* p = compact4(a, keep, cs);
    return View{p, cs[0], cs[1], cs[2]};
}

// softmax(scores * scale, masked) @ values for every (batch row, KV head): score rows numbered u * R + r, shared
// out in contiguous ranges among up to `threads` threads once there is enough work.
static void attend(const View& sv, const View& vv, const MaskView* mp, float* o, int B, int hkv, int R, int S, int D,
                   int N, float scale, int threads, UnitFn unit) {
    const int64_t total = (int64_t)B * hkv * R;
    const int T = (int)std::min<int64_t>(threads, total);
    const size_t wn = (size_t)(S + 15) / 16 * 16 + 16;  // scores padded to whole vectors
    auto run = [&](int64_t lo, int64_t hi) {
        std::vector<float> w(wn);
        while (lo < hi) {
            const int u = (int)(lo / R), r0 = (int)(lo % R), r1 = (int)std::min<int64_t>(R, r0 + hi - lo);
            const int b = u / hkv, g = u % hkv;
            const float* s0 = sv.data + b * sv.s0 + g * sv.s1;
            float* ob = o + (int64_t)u * R * D;
            unit(s0, sv.s2, vv, mp, ob, b, g, N, r0, r1, S, D, scale, w.data());
            lo += r1 - r0;
        }
    };
    if (T <= 1 || total * S * D < PARALLEL_WORK) {
        run(0, total);
        return;
    }
#pragma omp parallel num_threads(T)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        run(total * t / nt, total * (t + 1) / nt);
    }
}

void SoftmaxValues::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
    auto& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (auto& a : inputs) enc.set_input_array(a);
    enc.set_output_array(out);
    enc.dispatch([ins = inputs, out = mx::array::unsafe_weak_copy(out), scale = scale_, N = n_, masked = masked_,
                  threads = threads_, unit = unit_fn_]() mutable {
        const auto& sc = ins[0];
        const auto& v = ins[1];
        const int B = sc.shape(0), hkv = sc.shape(1), R = sc.shape(2), S = sc.shape(3), D = v.shape(3);
        std::vector<float> ks, kv;
        View sv = view_of(sc, ks), vv = view_of(v, kv);
        std::optional<MaskView> mv;
        if (masked) {
            const auto& m = ins[2];
            auto& st = m.strides();
            mv = MaskView{m.data<bool>(), m.shape(0) == 1 ? 0 : (int64_t)st[0], m.shape(2) == 1 ? 0 : (int64_t)st[2],
                          (int64_t)st[3], m.shape(2) == R && R != N};
        }
        attend(sv, vv, mv ? &*mv : nullptr, out.data<float>(), B, hkv, R, S, D, N, scale, threads, unit);
    });
}

// The same through pointers and strides (kernel_tables.h): what a fused primitive of another extension runs.
static void softmax_values_at(const float* scores, const int64_t* ss, const float* values, const int64_t* vs,
                              const bool* mask, const int64_t* ms, bool grouped, float* out, int B, int hkv, int R,
                              int S, int D, int N, float scale) {
    const View sv{scores, ss[0], ss[1], ss[2]}, vv{values, vs[0], vs[1], vs[2]};
    const MaskView mv{mask, mask ? ms[0] : 0, mask ? ms[1] : 0, mask ? ms[2] : 0, grouped};
    attend(sv, vv, mask ? &mv : nullptr, out, B, hkv, R, S, D, N, scale, threads_, unit_fn_);
}


// scores (B, h_kv, G * N, S) = q.k per KV head (rows: query head in the group, then token), v (B, h_kv, S, D),
// mask (B or 1, 1, N, S) -> softmax(scores * scale, masked) @ v, (B, h_kv, G * N, D).
mx::array softmax_values(const mx::array& scores, const mx::array& v, float scale, int n,
                         std::optional<mx::array> mask) {
    auto s = mx::default_stream(mx::Device::cpu);
    if (scores.dtype() != mx::float32 || v.dtype() != mx::float32 || scores.ndim() != 4 || v.ndim() != 4 ||
        v.shape(3) > MAX_D || n < 1 || scores.shape(2) % n != 0 || scores.shape(3) != v.shape(2) ||
        scores.shape(0) != v.shape(0) || scores.shape(1) != v.shape(1))
        throw std::invalid_argument("softmax_values: float32 scores (B, h_kv, G * n, S) and values (B, h_kv, S, D <= 256)");
    std::vector<mx::array> ins = {scores, v};
    if (mask) {
        if (mask->ndim() != 4 || mask->shape(1) != 1 || (mask->shape(0) != 1 && mask->shape(0) != scores.shape(0)) ||
            (mask->shape(2) != 1 && mask->shape(2) != n && mask->shape(2) != scores.shape(2)) ||
            mask->shape(3) != scores.shape(3))
            throw std::invalid_argument("softmax_values: mask (B or 1, 1, n, G * n or 1, S)");
        ins.push_back(mx::astype(*mask, mx::bool_, s));
    }
    mx::Shape shape = {scores.shape(0), scores.shape(1), scores.shape(2), v.shape(3)};
    return mx::array(shape, mx::float32, std::make_shared<SoftmaxValues>(s, scale, n, mask.has_value()),
                     std::move(ins));
}

// The layout and rotation below through pointers and strides (elements): x (B * N or T, (h + 2 h_kv) * D) with
// strides xs, cos and sin (B, N, 1, D / 2) with strides of dims 0, 1 and 3, spread (B, N) or null -> q (B, h, N, D),
// k and v (B, h_kv, N, D), contiguous. Also what a fused primitive of another extension runs (kernel_tables.h).
static void heads_rope_at(const float* xp, const int64_t* xs, const float* cp, const int64_t* cs, const float* sp,
                          const int64_t* ss, const int32_t* spread, const int64_t* ps, float* q, float* k, float* v,
                          int B, int N, int half, int h, int hkv) {
    const int D = 2 * half;
    const int64_t xs0 = xs[0], xs1 = xs[1], cs0 = cs[0], cs1 = cs[1], cs3 = cs[2], ss0 = ss[0], ss1 = ss[1],
                  ss3 = ss[2], ps0 = ps[0], ps1 = ps[1];
    for (int b = 0; b < B; ++b)
        for (int n = 0; n < N; ++n) {
            const int64_t t = spread ? (int64_t)spread[b * ps0 + n * ps1] : (int64_t)b * N + n;
            const float* row = xp + t * xs0;
            const float* cr = cp + b * cs0 + n * cs1;
            const float* sr = sp + b * ss0 + n * ss1;
            for (int j = 0; j < h + 2 * hkv; ++j) {
                const float* src = row + (int64_t)j * D * xs1;
                float* dst = j < h ? q + (((int64_t)b * h + j) * N + n) * D
                             : j < h + hkv ? k + (((int64_t)b * hkv + j - h) * N + n) * D
                                           : v + (((int64_t)b * hkv + j - h - hkv) * N + n) * D;
                if (j >= h + hkv) {
                    for (int i = 0; i < D; ++i) dst[i] = src[i * xs1];
                    continue;
                }
                for (int i = 0; i < half; ++i) {
                    const float x1 = src[i * xs1], x2 = src[(i + half) * xs1];
                    const float ci = cr[i * cs3], si = sr[i * ss3];
                    const float a = x1 * ci, bb = x2 * si, e = x2 * ci, f = x1 * si;
                    dst[i] = a - bb;
                    dst[i + half] = e + f;
                }
            }
        }
}

// One layer's q, k and v from its fused product, laid out for attention: qkv (B * N, (h + 2 h_kv) * D) -> q
// (B, h, N, D) and k (B, h_kv, N, D) rotated by the per-token angles cos, sin (B, N, 1, D / 2) (half-split rope:
// x1 cos - x2 sin, x2 cos + x1 sin, each product rounded apart, as MLX's compiled element-wise graph computes it:
// no fused multiply-add, this function has no vector ISA of its own), and v (B, h_kv, N, D). One graph node where
// a split, reshapes, slices, two element-wise kernels, a concatenation and transposes took ~13. Ragged rows (a
// batch whose rows verify different numbers of tokens): qkv holds the T real tokens and spread (B, N) int32 names
// the token each padded slot takes (`model.Ragged.spread`).
class HeadsRope : public mx::Primitive {
   public:
    HeadsRope(mx::Stream s, int h, int hkv) : mx::Primitive(s), h_(h), hkv_(hkv) {}

    void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
        for (auto& o : outputs) o.set_data(mx::allocator::malloc(o.nbytes()));
        auto& enc = mx::cpu::get_command_encoder(stream());
        for (auto& a : inputs) enc.set_input_array(a);
        for (auto& o : outputs) enc.set_output_array(o);
        enc.dispatch([ins = inputs, q = mx::array::unsafe_weak_copy(outputs[0]),
                      k = mx::array::unsafe_weak_copy(outputs[1]), v = mx::array::unsafe_weak_copy(outputs[2]),
                      h = h_, hkv = hkv_]() mutable { run(ins, q.data<float>(), k.data<float>(), v.data<float>(), h, hkv); });
    }
    void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
        throw std::runtime_error("heads_rope runs on the CPU only");
    }
    const char* name() const override { return "HeadsRope"; }
    bool is_equivalent(const mx::Primitive& other) const override {
        auto& o = static_cast<const HeadsRope&>(other);
        return h_ == o.h_ && hkv_ == o.hkv_;
    }

   private:
    int h_, hkv_;

    static void run(const std::vector<mx::array>& ins, float* q, float* k, float* v, int h, int hkv) {
        const auto &x = ins[0], &c = ins[1], &sn = ins[2];
        const int32_t* spread = ins.size() > 3 ? ins[3].data<int32_t>() : nullptr;
        const int64_t xs[2] = {x.strides()[0], x.strides()[1]};
        const int64_t cs[3] = {c.strides()[0], c.strides()[1], c.strides()[3]};
        const int64_t ss[3] = {sn.strides()[0], sn.strides()[1], sn.strides()[3]};
        const int64_t ps[2] = {spread ? ins[3].strides()[0] : 0, spread ? ins[3].strides()[1] : 0};
        heads_rope_at(x.data<float>(), xs, c.data<float>(), cs, sn.data<float>(), ss, spread, ps, q, k, v,
                      c.shape(0), c.shape(1), c.shape(3), h, hkv);
    }
};

std::vector<mx::array> heads_rope(const mx::array& qkv, const mx::array& cos, const mx::array& sin, int h, int hkv,
                                  std::optional<mx::array> spread) {
    auto s = mx::default_stream(mx::Device::cpu);
    if (qkv.dtype() != mx::float32 || cos.dtype() != mx::float32 || sin.dtype() != mx::float32 || qkv.ndim() != 2 ||
        cos.ndim() != 4 || cos.shape() != sin.shape() || cos.shape(2) != 1 || h < 1 || hkv < 1 ||
        (!spread && qkv.shape(0) != cos.shape(0) * cos.shape(1)) ||
        qkv.shape(1) != (h + 2 * hkv) * 2 * cos.shape(3))
        throw std::invalid_argument("heads_rope: float32 qkv (B * N, (h + 2 h_kv) * D) and cos, sin (B, N, 1, D / 2)");
    if (spread && (spread->ndim() != 2 || spread->shape(0) != cos.shape(0) || spread->shape(1) != cos.shape(1)))
        throw std::invalid_argument("heads_rope: spread (B, N), the token of qkv each slot takes");
    const int B = cos.shape(0), N = cos.shape(1), D = 2 * cos.shape(3);
    std::vector<mx::array> ins = {qkv, cos, sin};
    if (spread) ins.push_back(mx::astype(*spread, mx::int32, s));
    return mx::array::make_arrays({{B, h, N, D}, {B, hkv, N, D}, {B, hkv, N, D}},
                                  {mx::float32, mx::float32, mx::float32}, std::make_shared<HeadsRope>(s, h, hkv),
                                  std::move(ins));
}

const AttentionKernels kernels_ = {2, softmax_values_at, heads_rope_at};

}  // namespace

NB_MODULE(_attention, m) {
    m.doc() = "Few-query softmax attention as one MLX CPU primitive (see attention.cpp).";
    m.def("softmax_values", &softmax_values, nb::arg("scores"), nb::arg("v"), nb::arg("scale"), nb::arg("n"),
          nb::arg("mask") = nb::none());
    m.def("heads_rope", &heads_rope, nb::arg("qkv"), nb::arg("cos"), nb::arg("sin"), nb::arg("h"), nb::arg("hkv"),
          nb::arg("spread") = nb::none());
    m.def("set_threads", [](int n) { threads_ = std::max(1, n); }, nb::arg("n"));
    m.def("set_isa", &set_isa, nb::arg("want") = "best");
    m.def("kernels", []() { return nb::capsule(&kernels_, ATTENTION_KERNELS); });
    m.def("version", []() { return 2; });
    set_isa("best");
}
