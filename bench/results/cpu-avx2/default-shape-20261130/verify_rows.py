import sys, os
sys.path.insert(0, ".")
from mlx_redrafter import install_blas; install_blas()
from mlx_redrafter import api
from bench.profile_verify import profile
lm = api.load(None, dtype="float32")
for ctx in (100, 300):
    r = profile(lm.target.model, [1, 2, 3, 4, 5, 6, 8], context=ctx, repeats=9)
    print(os.environ["MKL_NUM_THREADS"], ctx, [(x["N"], x["full_ms"], x["vs_N1"]) for x in r["rows"]])
