import sys, time, resource, hashlib
co = sys.argv[1]; sys.path.insert(0, co)
import mlx_redrafter; assert mlx_redrafter.__file__.startswith(co)
from mlx_redrafter import install_blas; install_blas()
import mlx.core as mx, numpy as np
from mlx.utils import tree_flatten
from mlx_redrafter.models import loader
t = time.perf_counter(); tg = loader.load_target(None, "float32"); t1 = time.perf_counter()
h = hashlib.sha256()
for k, v in sorted(tree_flatten(tg.model.parameters())):
    h.update(k.encode()); h.update(np.array(v).tobytes())
ids = tg.tokenizer.encode_chat([{"role": "user", "content": "Write a haiku about the sea."}])
logits, _ = tg.model(mx.array([ids]), tg.model.make_cache(len(ids) + 4))
lh = hashlib.sha256(np.array(logits).tobytes()).hexdigest()[:16]
print(f"{co}: load {t1-t:.2f} s peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss/1024:.0f} MB params {h.hexdigest()[:16]} logits {lh}")
