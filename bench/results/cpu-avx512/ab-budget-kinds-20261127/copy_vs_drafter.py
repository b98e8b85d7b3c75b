import json, sys, numpy as np, collections
from mlx_redrafter.draft.lookup import NgramIndex
D = json.load(open('/tmp/kb/rnnsteps.json'))
def acc(d, truth):
    a = 0
    for x, y in zip(d, truth):
        if x != y: break
        a += 1
    return a
def cand(toks, max_len):
    last = len(toks) - 1
    for n in range(min(4, len(toks)), 0, -1):
        key = tuple(toks[last-n+1:])
        for e in range(last-1, n-2, -1):
            if tuple(toks[e-n+1:e+1]) == key:
                return n, toks[e+1:e+1+max_len]
    return 0, []
for name, res in D.items():
    by = collections.defaultdict(lambda: [0, 0, 0, 0])
    for r in res:
        full = r['prompt'] + r['answer']
        for pos, c in r['steps']:
            truth = full[pos:pos+8]
            ra = acc(c[0][1:], truth[:3]) if c else 0
            n, d = cand(full[:pos], 8)
            b = by[n]; b[0] += 1; b[1] += ra; b[2] += acc(d[:3], truth[:3]); b[3] += acc(d, truth)
    tot = sum(b[0] for b in by.values())
    print(name, 'steps', tot)
    for n in sorted(by):
        b = by[n]; print(f"  match {n}: frac {b[0]/tot:.3f} rnn {b[1]/b[0]:.3f} lookup3 {b[2]/b[0]:.3f} lookup8 {b[3]/b[0]:.3f}")
