// Float vectors of the instruction set a function is compiled for and 2^x on them, shared by our CPU kernels
// (attention.cpp, vector_math.cpp). Header-only: each kernel compiles these into its AVX-512, AVX2 + FMA and
// baseline variants.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

// Vectors of LN floats (GCC's vector extensions: one register of the ISA a function is compiled for, or several).
template <int LN>
struct Vec {
    typedef float F __attribute__((vector_size(4 * LN)));
    typedef int32_t I __attribute__((vector_size(4 * LN)));
};

template <typename F>
__attribute__((always_inline)) static inline F load(const float* p) {
    F x;
    std::memcpy(&x, p, sizeof x);
    return x;
}
template <typename F>
__attribute__((always_inline)) static inline void store(float* p, F x) {
    std::memcpy(p, &x, sizeof x);
}

// 2^x for x <= 0, a vector at a time (x below -126 gives 2^-126: a weight of 0 to float precision beside the
// max's 1).
template <typename F, typename I>
__attribute__((always_inline)) static inline F exp2_neg(F x) {
    x = x > -126.0f ? x : -126.0f - F{};
    I xi = __builtin_convertvector(x, I);  // toward 0
    F xf = __builtin_convertvector(xi, F);
    xi = xf > x ? xi - 1 : xi;  // floor
    xf = __builtin_convertvector(xi, F);
    const F f = x - xf;  // [0, 1)
    // minimax polynomial for 2^f on [0, 1): relative error ~2e-7
    F p = 1.8775767e-3f + F{};
    p = p * f + 8.9893397e-3f;
    p = p * f + 5.5826318e-2f;
    p = p * f + 2.4015361e-1f;
    p = p * f + 6.9315308e-1f;
    p = p * f + 9.9999994e-1f;
    I bits;
    std::memcpy(&bits, &p, sizeof bits);
    bits += xi << 23;
    std::memcpy(&p, &bits, sizeof p);
    return p;
}

// The variant to run: "avx512", "avx2" or "base", the best this CPU runs, or the one asked for (`want`: "best",
// "avx512", "avx2" or "base") where it runs it (AVX2 for AVX-512 on a CPU without it).
static inline const char* pick_isa(const std::string& want) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    const bool avx512 = __builtin_cpu_supports("avx512f");
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (avx512 && (want == "best" || want == "avx512")) return "avx512";
    if (avx2 && (want == "best" || want == "avx2" || want == "avx512")) return "avx2";
#endif
    return "base";
}
