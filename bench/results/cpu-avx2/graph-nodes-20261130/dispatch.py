import time, mlx.core as mx
x = mx.ones((1, 576)); mx.eval(x)
def chain(n, kind):
    y = x
    for i in range(n):
        if kind == "reshape":
            y = y.reshape(576, 1) if i % 2 == 0 else y.reshape(1, 576)
        elif kind == "add":
            y = y + 1.0
        elif kind == "sum":
            y = mx.sum(y * y, axis=-1, keepdims=True) + x
    return y
for kind in ("reshape", "add", "sum"):
    for n in (100, 1400):
        ts = []
        for r in range(20):
            t = time.perf_counter(); y = chain(n, kind); t1 = time.perf_counter(); mx.eval(y); t2 = time.perf_counter()
            ts.append((t1 - t, t2 - t1))
        ts.sort(key=lambda a: a[1])
        b, e = ts[10]
        print(kind, n, "build %.2f ms eval %.2f ms per-op eval %.2f us" % (b * 1e3, e * 1e3, e / n * 1e6))
print(mx.__version__)
