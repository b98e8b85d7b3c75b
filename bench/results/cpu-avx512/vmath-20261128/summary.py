"""Pooled totals of the runs in this folder: python summary.py (prints the table of README.md)."""
import json
from pathlib import Path

here = Path(__file__).parent
tot: dict = {}
ids: dict = {}
for f in sorted(here.glob("run-*.json")):
    sw = f.stem.split("-")[1]
    d = json.loads(f.read_text())
    for m in ("none", "auto", "rnn"):
        t = tot.setdefault((sw, m), [0.0, 0, 0])
        t[0] += d[m][0]
        t[1] += d[m][1]
        t[2] += d[m][2]
        ids.setdefault(m, []).append(d[m][3])
for m in ("none", "auto", "rnn"):
    on, off = tot[("auto", m)], tot[("off", m)]
    same = all(x == ids[m][0] for x in ids[m]) and ids[m][0] == ids["none"][0]
    print(f"{m}: kernels on {on[0]:.2f} s, off {off[0]:.2f} s, off/on {off[0] / on[0]:.3f}x; "
          f"{on[2]} tokens in {on[1]} calls; ids equal to AR in every run: {same}")
for sw in ("auto", "off"):
    ar = tot[(sw, "none")][0]
    print(f"switch {sw}: default {ar / tot[(sw, 'auto')][0]:.3f}x our AR, drafter alone {ar / tot[(sw, 'rnn')][0]:.3f}x")
