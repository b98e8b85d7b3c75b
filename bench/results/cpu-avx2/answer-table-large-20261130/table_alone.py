"""Answer-table acceptance vs table size: replay of the table alone over held-out shard 0 answers."""
import sys, json, time, collections
sys.path.insert(0, ".")
import numpy as np
from pathlib import Path
from mlx_redrafter.train.corpus import load_shard
from mlx_redrafter.draft.lookup import AnswerTable
root = Path("data/corpus/smollm2-135m")
man = json.load(open(root / "manifest.json"))["shards"]
train = sorted(n for n, e in man.items() if e["split"] == "train")
def answers(names, limit):
    out, tot = [], 0
    for n in names:
        sh = load_shard(root / n)
        for i in range(sh.num_sequences):
            s = sh.sequence(i); r = s[sh.prompt_len[i]:]
            out.append(r); out.append(np.array([-1], np.int32)); tot += len(r)
            if tot >= limit: return np.concatenate(out)[:-1], tot
    return np.concatenate(out)[:-1], tot
held = load_shard(root / "shard-00000.npz")
seqs = [(held.sequence(i), int(held.prompt_len[i])) for i in range(held.num_sequences) if held.turn[i] == 1][:128]
rng = np.random.default_rng(0); order = rng.permutation(len(train))
L = int(sys.argv[2]) if len(sys.argv) > 2 else 3
for size in [float(v) for v in sys.argv[1].split(",")]:
    t = time.time()
    toks, n = answers([train[i] for i in order], int(size * 1e6))
    table = AnswerTable(toks.astype(np.int32))
    tb = time.time() - t
    steps = decided = 0; bucket = collections.defaultdict(lambda: [0, 0])
    t = time.time()
    for s, P in seqs:
        x = s.tolist(); end = min(len(x), P + 128); p = P  # x[p] is the next token to decide (g0 = x[P])
        p = P + 1  # g0 decided by prefill
        while p < end:
            cands = table.candidates(x[:p], L, 1)
            a = 0
            if cands:
                c = cands[0]
                while a < len(c) and p + a < end and c[a] == x[p + a]: a += 1
            steps += 1; decided += a + 1; p += a + 1
    print(f"table {n/1e6:.2f}M tokens (built {tb:.0f}s): answers alone W1 L{L+1}: {decided/steps:.3f} tokens/step over {steps} steps ({time.time()-t:.0f}s)", flush=True)
