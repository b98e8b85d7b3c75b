import json, sys
import mlx_redrafter; st = mlx_redrafter.install_blas()
from mlx_redrafter import api
from bench.profile_verify import profile
lm = api.load()
res = profile(lm.target.model, [1, 2, 5, 8], context=300, repeats=40)
print(st.describe()[-6:], [(r["N"], r["full_ms"]) for r in res["rows"]])
