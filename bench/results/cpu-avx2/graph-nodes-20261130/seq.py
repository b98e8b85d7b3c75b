import sys, io, re
sys.path.insert(0, ".")
from mlx_redrafter import install_blas; install_blas()
import mlx.core as mx
from mlx_redrafter import api
lm = api.load(None, dtype="float32"); m = lm.target.model
c = m.make_cache(400); lg, h = m(mx.array([list(range(100, 400))]), c); mx.eval(lg, h, *c.state())
N = int(sys.argv[1]) if len(sys.argv) > 1 else 1
lg, h = m(mx.array([[5] * N]), c); f = io.StringIO(); mx.export_to_dot(f, lg, h)
seq = [l for _, l in re.findall(r'\{ (\d+) \[label ="([A-Za-z]+)"', f.getvalue())]
idx = [i for i, l in enumerate(seq) if l in ("Square", "RmsNorm")]
print(len(seq)); print(seq[:idx[0]]); print(seq[idx[2]:idx[4]]); print(seq[idx[-1]:])
