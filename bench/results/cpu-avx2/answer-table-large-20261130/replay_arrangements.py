"""Exact replay (greedy) of draft arrangements over the target's own greedy answers to MT-bench (16) and held-out
corpus prompts (16): baseline lookup-else-rnn vs a large answer table in several arrangements."""
import sys, json, time, collections, os, pickle
sys.path.insert(0, ".")
# run from the repository root
from mlx_redrafter import install_blas; install_blas()
import numpy as np, mlx.core as mx
from pathlib import Path
from mlx_redrafter import api, sources
from mlx_redrafter.options import DecodeOptions
from mlx_redrafter.sweep import decode
from mlx_redrafter.prompts import first_turns
from mlx_redrafter.train.evaluate import heldout_prompt_ids
from mlx_redrafter.train.replay import replay_sequence, ReplayStats
from mlx_redrafter.draft import lookup as LK
from mlx_redrafter.draft.modes import Mode, MODES
from mlx_redrafter.model import forward_chunked
from mlx_redrafter.train.corpus import load_shard

lm = api.load(None, dtype="float32"); model = lm.target.model
cache_f = Path("/tmp/answer-table-seqs.pkl")
if cache_f.exists():
    data = pickle.load(open(cache_f, "rb"))
else:
    rows = first_turns()
    sets = {"mtbench": [api.encode_prompt(lm, rows[i]["prompt"]) for i in range(0, 80, 5)],
            "heldout": heldout_prompt_ids("data/corpus/smollm2-135m", 16)}
    data = {}
    for s, idss in sets.items():
        data[s] = []
        for ids in idss:
            out, st = decode(lm, ids, DecodeOptions(draft="auto", max_tokens=128))
            seq = ids + out
            c = model.make_cache(len(seq) + 8)
            _, hidden = forward_chunked(model, c, mx.array([seq]), all_hidden=True)
            h = np.array(hidden[0, len(ids) - 1 : len(seq) - 1].astype(mx.float32))
            data[s].append((np.array(seq), len(ids), h))
    pickle.dump(data, open(cache_f, "wb"))
print("hidden width", data["mtbench"][0][2].shape, flush=True)

root = Path("data/corpus/smollm2-135m")
man = json.load(open(root / "manifest.json"))["shards"]
train = sorted(n for n, e in man.items() if e["split"] == "train")
def table_tokens(limit):
    out, tot = [], 0
    for i in np.random.default_rng(0).permutation(len(train)):
        sh = load_shard(root / train[i])
        for j in range(sh.num_sequences):
            r = sh.sequence(j)[sh.prompt_len[j]:]
            out += [r, np.array([-1], np.int32)]; tot += len(r)
            if tot >= limit: return np.concatenate(out)[:-1]
    return np.concatenate(out)[:-1]

class Gated(LK.AnswerTable):
    """Candidates only at a match of >= min_n tokens seen >= min_hits times whose first next token has >= share."""
    def __init__(self, tokens, min_n=3, min_hits=2, share=0.5, cut=0.0):
        super().__init__(tokens)
        self.g = (min_n, min_hits, share, cut)
    def candidates(self, context, max_len, width):
        min_n, min_hits, share, cut = self.g
        for n in range(min(self.max_n, len(context)), self.min_n - 1, -1):
            keys, ends = self.tables[n]
            k = LK._ngram_keys(np.asarray(context[-n:]), n)[0]
            lo, hi = int(np.searchsorted(keys, k, "left")), int(np.searchsorted(keys, k, "right"))
            if hi == lo: continue
            if n < min_n or hi - lo < min_hits: return []
            hits = ends[lo: min(hi, lo + self.max_hits)]
            at = np.minimum(hits[:, None] + 1 + np.arange(max_len)[None, :], len(self.tokens) - 1)
            follow = self.tokens[at]
            vals, cnt = np.unique(follow[:, 0], return_counts=True)
            b = np.argmax(cnt)
            if cnt[b] / len(follow) < share or vals[b] < 0: return []
            rows = follow[follow[:, 0] == vals[b]]; cand = [int(vals[b])]
            for d in range(1, max_len):
                rows = rows[rows[:, d] >= 0]
                if not len(rows): break
                v, c = np.unique(rows[:, d], return_counts=True)
                j = np.argmax(c)
                if c[j] / len(rows) < cut: break
                cand.append(int(v[j])); rows = rows[rows[:, d] == v[j]]
            return [cand]
        return []

class Composite:
    """Context n-gram index first; the table where the context has nothing to copy."""
    def __init__(self, table):
        self.ctx = LK.NgramIndex(4, 2); self.tab = LK.AnswerIndex(table); self.matched = 0
    def extend(self, tokens):
        self.ctx.extend(tokens); self.tab.extend(tokens)
    def candidates(self, max_len, width):
        c = self.ctx.candidates(max_len, width); self.matched = self.ctx.matched
        if c: return c
        c = self.tab.candidates(max_len, width); self.matched = 3 if c else 0
        return c

def run(name, mode, opts_kw, table=None, composite=False, L=3):
    orig_table, orig_idx = sources.answer_table, LK.INDEXES["ngram2"]
    if table is not None: sources.answer_table = lambda t: table
    if composite: LK.INDEXES["ngram2"] = lambda: Composite(table)
    try:
        res = {}
        for s, items in data.items():
            st = ReplayStats()
            opts = DecodeOptions(draft=mode, max_tokens=128).updated(beam_length=L, **opts_kw)
            for seq, P, h in items:
                replay_sequence(seq, P, h, lambda: sources.make_allocator(MODES[mode] if isinstance(mode, str) else mode, lm.target, lm.drafter, opts), L, 128, st)
            d = st.as_dict(); res[s] = (d["tokens_per_step"], d["candidate_slots_per_step"], d["source_tokens_per_step"])
        print(name, "L%d" % L, json.dumps(res), flush=True)
    finally:
        sources.answer_table, LK.INDEXES["ngram2"] = orig_table, orig_idx

size = float(sys.argv[1]) if len(sys.argv) > 1 else 32
for L in (3, 4):
    run("baseline lookup-else-rnn", "lookup-else-rnn", {}, L=L)
    run("rnn alone", "rnn", {}, L=L)
t = time.time(); toks = table_tokens(int(size * 1e6)); print(f"table {len(toks)/1e6:.1f}M", flush=True)
big = LK.AnswerTable(toks); print("built", round(time.time() - t), "s", flush=True)
shipped = sources.answer_table(lm.target)
for L in (3, 4):
    run("answers alone (big)", "lookup", {"lookup_width": 1, "answers_width": 1}, table=big, L=L)
    run("stacked shipped table (lookup-else-(answers+rnn))", "lookup-else-rnn", {"answers_width": 1}, L=L)
    run("stacked big table (lookup-else-(answers+rnn))", "lookup-else-rnn", {"answers_width": 1}, table=big, L=L)
    run("composite big ungated (lookup|table else rnn)", "lookup-else-rnn", {}, table=big, composite=True, L=L)
    for g in [(3, 2, 0.5, 0.0), (3, 3, 0.7, 0.0), (4, 3, 0.7, 0.0), (3, 4, 0.8, 0.5), (2, 8, 0.8, 0.5)]:
        gt = Gated(toks, *g)
        run(f"composite gated {g}", "lookup-else-rnn", {}, table=gt, composite=True, L=L)
