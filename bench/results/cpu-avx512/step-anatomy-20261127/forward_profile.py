import mlx_redrafter
mlx_redrafter.install_blas()
import time, statistics, sys, json
import mlx.core as mx
from mlx_redrafter import api
from bench.profile_verify import profile
lm = api.load()
m = lm.target.model
res = profile(m, [1, 2, 3, 4, 8], context=200, repeats=15)
for r in res["rows"]: print(r)
