import json, sys, numpy as np
sys.path.insert(0, '/tmp/kb'); from ngmodel import build, predict
z = np.load('/tmp/kb/answers_full.npz'); M = build(z['tokens'], min_total=2)
D = json.load(open('/tmp/kb/rnnsteps.json'))
def acc(d, truth):
    a = 0
    for x, y in zip(d, truth):
        if x != y: break
        a += 1
    return a
for name, res in D.items():
    recs = []
    for r in res:
        full = r['prompt'] + r['answer']
        for pos, c in r['steps']:
            truth = full[pos:pos+3]
            ra = acc(c[0][1:], truth) if c else 0
            ctx = list(full[:pos]); d = []; sh = []
            for _ in range(3):
                pr = predict(M, ctx)
                if pr is None: break
                d.append(pr[0]); sh.append(pr[1]); ctx.append(pr[0])
            recs.append((ra, acc(d, truth), sh[0] if sh else -1, sh))
    n = len(recs); base = sum(r[0] for r in recs)/n
    print(f"{name}: steps {n}, rnn acc {base:.3f}")
    for th in (0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.01):
        sel = [r for r in recs if r[2] >= th]
        mix = sum((r[1] if r[2] >= th else r[0]) for r in recs)/n
        if sel: print(f"  th {th}: frac {len(sel)/n:.3f} rnn there {sum(r[0] for r in sel)/len(sel):.3f} table there {sum(r[1] for r in sel)/len(sel):.3f}  -> mixed {mix:.3f}")
    # oracle-ish: per-token cut by cumulative share
