// The kernels one extension hands another by address (a PyCapsule of one of these tables), so that a fused
// primitive (packed_linear.cpp's LayerBefore and LayerAfter) runs the very code the separate primitives run: the
// same bits, without building the same sources twice. A table's `version` changes whenever a signature does.
#pragma once

#include <cstdint>

// vector_math.cpp: rows of x over their RMS times w (`rms_norm`), and silu(gate) * up of rows holding a fused
// gate/up product side by side (`silu_mul_halves`).
struct VectorMathKernels {
    int version;  // 1
    void (*rms_rows)(const float* x, const float* w, int64_t r0, int64_t r1, int64_t n, float inv_n, float eps,
                     float* out);
    void (*silu_mul_halves_rows)(const float* gu, int64_t rows, int64_t h, float* out);
};

// attention.cpp: softmax(scores * scale, masked) @ values (`softmax_values`) over arrays given by pointer and
// strides (elements; the last axis contiguous): scores (B, h_kv, R, S), values (B, h_kv, S, D), mask (B or 1, 1,
// N or R, S) or null, out (B, h_kv, R, D) contiguous; and a layer's q, k and v laid out and rotated from its fused
// product (`heads_rope`): x (B * N or T, (h + 2 h_kv) * D; strides of dims 0, 1), cos and sin (B, N, 1, D / 2;
// strides of dims 0, 1, 3), spread (B, N; strides) or null -> q (B, h, N, D), k and v (B, h_kv, N, D) contiguous.
struct AttentionKernels {
    int version;  // 2
    void (*softmax_values)(const float* scores, const int64_t* score_strides, const float* values,
                           const int64_t* value_strides, const bool* mask, const int64_t* mask_strides,
                           bool mask_grouped, float* out, int B, int hkv, int R, int S, int D, int N, float scale);
    void (*heads_rope)(const float* x, const int64_t* x_strides, const float* cos, const int64_t* cos_strides,
                       const float* sin, const int64_t* sin_strides, const int32_t* spread,
                       const int64_t* spread_strides, float* q, float* k, float* v, int B, int N, int half, int h,
                       int hkv);
};

#define VECTOR_MATH_KERNELS "redrafter.vector_math.kernels"
#define ATTENTION_KERNELS "redrafter.attention.kernels"
