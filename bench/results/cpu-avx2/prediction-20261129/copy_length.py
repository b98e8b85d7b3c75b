from mlx_redrafter import install_blas; install_blas()
import time
from mlx_redrafter import api
from mlx_redrafter.prompts import first_turns
lm = api.load()
turns = first_turns(); N=6
prompts = [turns[(k * len(turns)) // N]["prompt"] for k in range(N)]
ar = [api.generate(lm, p, max_tokens=128, draft="none") for p in prompts]
res = {}
for r in range(2):
    for i,p in enumerate(prompts):
        for L in (9, 17, 33):
            t=time.perf_counter(); g=api.generate(lm, p, max_tokens=128, prediction=ar[i].text, lookup_max_length=L); dt=time.perf_counter()-t
            assert g.tokens==ar[i].tokens
            a=res.setdefault(L,[0,0]); a[0]+=dt; a[1]+=g.stats.steps
for L,(t,s) in res.items(): print(L, round(t,2), s)
