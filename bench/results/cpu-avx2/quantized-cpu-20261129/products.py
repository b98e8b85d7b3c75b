"""MLX's CPU quantized_matmul of the 49152 x 576 vocabulary projection (group 64) with float16 and float32 inputs,
and float32 inputs at several row counts against the dense float32 product: seconds per call (mean of 3)."""
import time

from mlx_redrafter import install_blas

install_blas()
import mlx.core as mx  # noqa: E402


def timed(f) -> float:
    mx.eval(f())
    t = time.perf_counter()
    for _ in range(3):
        mx.eval(f())
    return (time.perf_counter() - t) / 3


w = mx.random.normal((49152, 576), key=mx.random.key(0))
for bits in (4, 8):
    wq, s, b = mx.quantize(w, group_size=64, bits=bits)
    for dt in (mx.float16, mx.float32):
        x, sd, bd = mx.random.normal((1, 576), key=mx.random.key(1)).astype(dt), s.astype(dt), b.astype(dt)
        print(f"{bits}-bit, {dt} inputs, 1 row: {timed(lambda: mx.quantized_matmul(x, wq, sd, bd, True, 64, bits)):.4f} s")
wq, s, b = mx.quantize(w, group_size=64, bits=8)
wd = mx.dequantize(wq, s, b, 64, 8)
for rows in (1, 4, 16, 48):
    x = mx.random.normal((rows, 576), key=mx.random.key(2))
    q = timed(lambda: mx.quantized_matmul(x, wq, s, b, True, 64, 8))
    d = timed(lambda: x @ wd.T)
    print(f"8-bit, float32 inputs, {rows} rows: {q:.4f} s (dense float32 {d:.4f} s)")
