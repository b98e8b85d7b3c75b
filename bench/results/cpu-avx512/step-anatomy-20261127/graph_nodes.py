import mlx_redrafter
mlx_redrafter.install_blas()
import mlx.core as mx, collections, re
from mlx_redrafter import api
lm = api.load()
m = lm.target.model
cache = m.make_cache(400)
m(mx.zeros((1, 200), dtype=mx.int32), cache); cache.advance(200); mx.eval(cache.state())
logits, hidden = m(mx.array([[5, 6, 7]]), cache)
import io
f = io.StringIO()
mx.export_to_dot(f, logits, hidden)
s = f.getvalue()
ops = re.findall(r'label ="([A-Za-z]+)', s) or re.findall(r'label="([^"]+)"', s)
c = collections.Counter(o.split()[0] for o in ops)
print(sum(c.values()), c.most_common(30))
