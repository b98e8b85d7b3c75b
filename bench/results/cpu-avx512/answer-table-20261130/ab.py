"""Answer tables of different sizes (the corpus' first N train response tokens) in the default mode and 'lookup'
mode: tokens per call and speed, one process, interleaved per prompt."""
import sys, time
sys.path.insert(0, ".")
from mlx_redrafter import install_blas; install_blas()
import numpy as np
from mlx_redrafter import api, sources
from mlx_redrafter.draft.lookup import AnswerTable
from mlx_redrafter.options import DecodeOptions
from mlx_redrafter.prompts import first_turns
from mlx_redrafter.sweep import decode
from mlx_redrafter.train.corpus import Corpus
from mlx_redrafter.train.evaluate import heldout_prompt_ids

sizes = [int(float(s) * 1e6) for s in sys.argv[1].split(",")]
per = int(sys.argv[2]) if len(sys.argv) > 2 else 8
modes = sys.argv[3].split(",") if len(sys.argv) > 3 else ["auto"]
lm = api.load(None, dtype="float32")
corpus = Corpus("data/corpus/smollm2-135m")
parts, n = [], 0
for path in corpus.shards("train"):
    shard = corpus.shard(path.name)
    for i in range(shard.num_sequences):
        r = shard.sequence(i)[int(shard.prompt_len[i]):]
        parts += [r, np.array([-1])]
        n += len(r)
    if n >= max(sizes):
        break
allt = np.concatenate(parts).astype(np.int32)
ends = np.flatnonzero(allt < 0)
tables = {"shipped": api.answer_table(lm.target)}
for s in sizes:
    t0 = time.perf_counter()
    cut = ends[np.searchsorted(np.cumsum(allt >= 0)[ends], s)] if s < n else len(allt) - 1
    tables[f"{s/1e6:g}M"] = AnswerTable(allt[: cut + 1])
    print(f"table {s/1e6:g}M: {int((allt[:cut+1] >= 0).sum())} tokens, built in {time.perf_counter() - t0:.1f} s", flush=True)
tables["none"] = None
from functools import partial
from mlx_redrafter.draft.base import Slot
from mlx_redrafter.draft.lookup import AnswerIndex, LookupSource
EXCL = [int(e) for e in sys.argv[4].split(",")] if len(sys.argv) > 4 else [0]
big = list(tables)[-2]
base_tables = tables
tables = {"none": None}
for e in EXCL:
    tables[f"{big}-x{e}"] = (base_tables[big], e)
excl = [0]
def _answers(target, drafter, options):
    if current[0] is None:
        return None
    t, e = current[0]
    return Slot(LookupSource(partial(AnswerIndex, t), "answers", exclusive_match=e), options.lookup.answers_width)
old = sources.SOURCE_KINDS["answers"]
sources.SOURCE_KINDS["answers"] = sources.SourceKind("answers", _answers, old.settings)
current = [None]
sources.answer_table = lambda target: current[0]
rows = first_turns()
ids = [api.encode_prompt(lm, rows[i]["prompt"]) for i in range(0, 80, 80 // per)][:per]
ids += heldout_prompt_ids("data/corpus/smollm2-135m", per)
names = list(tables)
T, N, S, src = {}, {}, {}, {}
for i, x in enumerate(ids):
    out, st = decode(lm, x, DecodeOptions(draft="none", max_tokens=128))
    T["ar"] = T.get("ar", 0) + st.decode_s; N["ar"] = N.get("ar", 0) + len(out) - 1; S["ar"] = S.get("ar", 0) + st.steps
    ar = out
    for name in names[i % len(names):] + names[: i % len(names)]:
        current[0] = tables[name]
        for mode in modes:
            out, st = decode(lm, x, DecodeOptions(draft=mode, max_tokens=128).updated(
                answers_width=0 if tables[name] is None else 1))
            assert out == ar
            k = (name, mode, "mt" if i < per else "held")
            T[k] = T.get(k, 0) + st.decode_s; N[k] = N.get(k, 0) + len(out) - 1; S[k] = S.get(k, 0) + st.steps
    print(i, end=" ", flush=True)
print()
for k in T:
    if k == "ar": continue
    print(k, f"{N[k]/S[k]:.3f} tok/call, {N[k]/T[k]:.1f} tok/s")
for name in names:
    for mode in modes:
        t = sum(T[(name, mode, s)] for s in ("mt", "held"))
        nn = sum(N[(name, mode, s)] for s in ("mt", "held")); ss = sum(S[(name, mode, s)] for s in ("mt", "held"))
        print(name, mode, f"all: {nn/ss:.3f} tok/call, {T['ar']/t:.3f}x AR")
