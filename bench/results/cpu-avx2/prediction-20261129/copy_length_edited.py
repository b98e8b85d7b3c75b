from mlx_redrafter import install_blas; install_blas()
import time
from mlx_redrafter import api
from mlx_redrafter.prompts import first_turns
lm = api.load()
turns = first_turns(); N=6
prompts = [turns[(k * len(turns)) // N]["prompt"] for k in range(N)]
ar = [api.generate(lm, p, max_tokens=128, draft="none") for p in prompts]
tok=lm.tokenizer
edit=tok.encode(' (here the text was changed by an edit of a few words)')
pred=[tok.decode(a.tokens[:len(a.tokens)//2]+edit+a.tokens[len(a.tokens)//2+12:]) for a in ar]
pred2=[tok.decode(a.tokens[:30]+edit+a.tokens[42:80]+edit+a.tokens[92:]) for a in ar]
res = {}
for r in range(2):
    for i,p in enumerate(prompts):
        for L, pr in ((9,pred),(33,pred),(9,pred2),(33,pred2)):
            t=time.perf_counter(); g=api.generate(lm, p, max_tokens=128, prediction=pr[i], lookup_max_length=L); dt=time.perf_counter()-t
            assert g.tokens==ar[i].tokens
            a=res.setdefault((L,pr is pred),[0,0]); a[0]+=dt; a[1]+=g.stats.steps
for L,(t,s) in res.items(): print(L, round(t,2), s)
