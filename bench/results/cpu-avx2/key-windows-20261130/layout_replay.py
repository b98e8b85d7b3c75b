"""Replays make_group's continuous batching on the valid-slot layout only (a RowsCache of 0 layers), with a finished
group's real prompt and answer lengths: rows x keys of attention with and without key windows."""
import sys
from collections import deque
import numpy as np
from pathlib import Path
from mlx_redrafter.models.loader import load_target
from mlx_redrafter.train.greedy import GreedySource, JOIN_ROWS, ROOM
from mlx_redrafter.train.batch import left_padded
from mlx_redrafter.train.pipeline import open_corpus
from mlx_redrafter.batch.cache import RowsCache, plan_windows
from mlx_redrafter.cache import KVCache

first = int(sys.argv[1])  # usage: layout_replay.py FIRST_SHARD OUT.npz (from the repository root)
t = load_target(None, "float32")
src = GreedySource(t, Path("../shared/data/train_prompts.jsonl"), capture=False)
corpus = open_corpus("data/corpus/smollm2-135m", t.model.args.vocab_size)
jobs = src.jobs()
job = next(j for j in jobs if j.name == f"shard-{first:05d}.npz")
group = [job] + src.companions(job, [j for j in jobs if j.index >= job.index])
s = src.settings
eos = set(t.tokenizer.eos_ids)
parts = [src.turn2_parts(corpus, j, eos) for j in group]
keep = [[i for i, x in enumerate(p) if x is not None and 0 < len(x[0]) + len(x[1]) <= s.max_prompt_tokens] for p in parts]
slot = [{i: k for k, i in enumerate(kept)} for kept in keep]
answer = {}
for g, j in enumerate(group):
    sh = corpus.shard(j.name)
    for k, i in enumerate(keep[g]):
        answer[(g, i)] = int(sh.offsets[k + 1] - sh.offsets[k] - sh.prompt_len[k])
prefix = {i: parts[g][i][0] for g in range(len(group)) for i in keep[g]}
units, cur, width = [], [], 0
for i in sorted(prefix, key=lambda i: (len(prefix[i]), i)):
    n = sum(i in sl for sl in slot)
    if cur and width + n > min(JOIN_ROWS, s.batch_size):
        units.append(cur); cur, width = [], 0
    cur.append(i); width += n
if cur: units.append(cur)
pending = deque((rows, [(g, i) for i in rows for g in range(len(group)) if i in slot[g]]) for rows in units)

cache = RowsCache(0, 0)
cache.relayout = lambda fn, other=None: None
keys, left, running = [], {}, {}
full = win = valid = steps = 0
blocks = []
snaps = {}
lives = []
def compact():
    global keys
    keepr = [r for r, k in enumerate(keys) if running[k]]
    if len(keepr) == len(keys): return
    cache.select(keepr, share=0.0); keys = [keys[r] for r in keepr]
while pending or any(running[k] for k in keys):
    while pending and (not sum(running[k] for k in keys) or sum(running[k] for k in keys) + len(pending[0][1]) <= s.batch_size):
        rows, branches = pending.popleft()
        compact()
        prompts = [prefix[i] for i in rows]
        tok, positions, mask, pad = left_padded(prompts, 0)
        n_pad = tok.shape[1]
        br = [(rows.index(i), parts[g][i][1]) for g, i in branches]
        S = max(len(x) for _, x in br)
        of = np.array([a for a, _ in br]); lens = np.array([len(prompts[a]) + len(x) for a, x in br])
        pad = pad[of]; hole = np.array([S - len(x) for _, x in br])
        cols = np.arange(n_pad + S)
        in_hole = (cols[None, :] >= n_pad) & (cols[None, :] < n_pad + hole[:, None])
        key_ok = (cols[None, :] >= pad[:, None]) & ~in_hole
        other = KVCache(0, n_pad + S); other.offset = n_pad + S
        cache.join_rows(other, key_ok, lens.tolist(), ROOM)
        for b in branches:
            keys.append(b); left[b] = answer[b]; running[b] = True
        for b in branches:  # the first token comes from the prefill
            left[b] -= 1; running[b] = left[b] > 0
    live = sum(running[k] for k in keys)
    if not live: continue
    if live < 0.75 * len(keys): compact()
    B, S = cache.rows, cache.offset + 1
    lives.append(live / B)
    v = cache.valid[:, :cache.offset]
    firsts = [int(f) for f in np.where(v.any(1), v.argmax(1), cache.offset)]
    w = plan_windows(firsts, S)
    full += B * S; valid += int(v.sum()) + B
    win += B * S if w is None else sum((b - a) * (S - lo) for a, b, lo in w)
    blocks.append(1 if w is None else len(w))
    if steps in (600, 1200, 1800, 2400, 3000, 3600):
        snaps[f'v{steps}'] = cache.valid[:, :cache.offset].copy(); snaps[f'l{steps}'] = np.array(cache.lengths)
    cache.commit_rows(None, [1] * B)
    for k in keys:
        if running[k]:
            left[k] -= 1; running[k] = left[k] > 0
    steps += 1
print("live share", np.mean(lives)); print(f"group {first}: {steps} steps, rows x keys: valid {valid / full:.3f} of the full width, windows {win / full:.3f}, blocks {np.mean(blocks):.2f}")
np.savez_compressed(sys.argv[2], **snaps)
