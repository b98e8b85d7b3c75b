"""Pooled times of the A/B runs (ab-<tag>-<n>.json in the folder given): per tag and mode, and whether every run's
tokens are the same."""
import glob, json, sys, os
d = sys.argv[1] if len(sys.argv) > 1 else "."
runs = {}
for f in sorted(glob.glob(os.path.join(d, "ab-*.json"))):
    tag = os.path.basename(f).split("-")[1]
    runs.setdefault(tag, []).append(json.load(open(f)))
ref = next(iter(runs.values()))[0]
same = all(r[m][3] == ref[m][3] for rs in runs.values() for r in rs for m in ("none", "auto", "rnn"))
print("tokens identical across every run and mode:", same)
tot = {}
for tag, rs in runs.items():
    for m in ("none", "auto", "rnn"):
        t = sum(r[m][0] for r in rs); tot[tag, m] = t
        toks = sum(r[m][2] for r in rs); calls = sum(r[m][1] for r in rs)
        print(f"{tag:7s} {m:5s} runs {len(rs)} total {t:7.2f} s  {toks / t:6.2f} tok/s  {toks / calls:.3f} tokens/call  "
              f"per run {[round(r[m][0], 2) for r in rs]}")
for tag in runs:
    print(f"{tag}: default {tot[tag, 'none'] / tot[tag, 'auto']:.3f}x its AR, drafter alone {tot[tag, 'none'] / tot[tag, 'rnn']:.3f}x")
if "before" in runs and "after" in runs:
    for m in ("none", "auto", "rnn"):
        print(f"{m}: after {tot['before', m] / tot['after', m]:.3f}x faster than before (pooled)")
