import mlx_redrafter
mlx_redrafter.install_blas()
import time
import mlx.core as mx
a = mx.random.normal((1, 1024)); w = mx.random.normal((1024, 1024)); mx.eval(a, w)
def g(n):
    x = a
    for _ in range(n): x = mx.tanh(x @ w)
    return x
for n in [5, 20, 50, 100, 200]:
  for _ in range(2):
    x = g(n); t = time.perf_counter(); mx.async_eval(x); t1 = time.perf_counter(); mx.eval(x); t2 = time.perf_counter()
  print(n, "async returns", round(1000*(t1-t),3), "then eval", round(1000*(t2-t1),3))
