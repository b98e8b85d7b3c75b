// A float32 array of 4 dims copied into row-major order, for kernels that read a layout the array does not have
// (shared by the extensions that include it).
#pragma once

#include <cstdint>
#include <vector>

#include "mlx/mlx.h"

// The entries of `a` (evaluated, 4 dims, float32) in row-major order in `keep`; its strides (dims 0-2) in `st`.
inline const float* compact4(const mlx::core::array& a, std::vector<float>& keep, int64_t* st) {
    auto& s = a.strides();
    const int n0 = a.shape(0), n1 = a.shape(1), n2 = a.shape(2), n3 = a.shape(3);
    keep.resize((size_t)n0 * n1 * n2 * n3);
    const float* src = a.data<float>();
    size_t i = 0;
    for (int x0 = 0; x0 < n0; ++x0)
        for (int x1 = 0; x1 < n1; ++x1)
            for (int x2 = 0; x2 < n2; ++x2)
                for (int x3 = 0; x3 < n3; ++x3) keep[i++] = src[x0 * s[0] + x1 * s[1] + x2 * s[2] + x3 * s[3]];
    st[0] = (int64_t)n1 * n2 * n3, st[1] = (int64_t)n2 * n3, st[2] = n3;
    return keep.data();
}
