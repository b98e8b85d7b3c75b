import numpy as np, json
from mlx_redrafter.draft.lookup import _ngram_keys
def build(tok, ns=(2,3,4,5), min_total=2):
    tok = np.concatenate([tok.astype(np.int32), [-1]]); gap = tok < 0
    M = {}
    for n in ns:
        keys = _ngram_keys(tok, n)[:-1]; nxt = tok[n:]
        bad = np.zeros(len(keys), bool)
        for j in range(n + 1): bad |= gap[j:j + len(keys)]
        k, x = keys[~bad], nxt[~bad]
        o = np.lexsort((x, k)); k, x = k[o], x[o]
        newk = np.r_[True, k[1:] != k[:-1]]; newp = newk | np.r_[True, x[1:] != x[:-1]]
        ps = np.flatnonzero(newp); pc = np.diff(np.r_[ps, len(k)]); kid = np.cumsum(newk)[ps] - 1
        nk = newk.sum(); total = np.bincount(kid, weights=pc, minlength=nk)
        # top per key: sort pairs by (kid, -count) and take first
        oo = np.lexsort((-pc, kid)); first = np.r_[True, kid[oo][1:] != kid[oo][:-1]]
        sel = oo[first]
        keep = total >= min_total
        M[n] = (k[ps][sel][keep], x[ps][sel][keep], total[keep].astype(np.int32), (pc[sel]/total)[keep].astype(np.float32))
    return M
def predict(M, ctx, ns=(5,4,3,2)):
    for n in ns:
        if len(ctx) < n or n not in M: continue
        keys, top, tot, sh = M[n]
        k = _ngram_keys(np.asarray(ctx[-n:]), n)[0]
        i = np.searchsorted(keys, k)
        if i < len(keys) and keys[i] == k:
            return int(top[i]), float(sh[i]), int(tot[i]), n
    return None
