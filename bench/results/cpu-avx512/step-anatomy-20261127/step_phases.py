import mlx_redrafter
mlx_redrafter.install_blas()
import time, json
import mlx.core as mx
from mlx_redrafter import api
import mlx_redrafter.step as S
from mlx_redrafter.step import prefill
from mlx_redrafter.draft.base import DecodeState, propose
from mlx_redrafter.tree import verify_mask
from mlx_redrafter.accept import accept
from mlx_redrafter.sampling import GREEDY
lm = api.load()
qs = [json.loads(l)["turns"][0] for l in open("/work/main/mlx_redrafter/data/mt_bench.jsonl")]
qs = qs[::10][:8]
o = api.decode_options(max_tokens=128)
model = lm.target.model
T = {}
def lap(k, t0):
    t = time.perf_counter(); T[k] = T.get(k, 0) + t - t0; return t
def step(cache, state, plan, length):
    t = time.perf_counter()
    proposal = propose(plan, state, length); cands = proposal.candidates
    t = lap("propose-build", t)
    if proposal.chain: mx.async_eval(cands)
    t = lap("async", t)
    tree = proposal.pack()
    t = lap("pack", t)
    positions = (cache.offset + tree.depth)[None]
    logits, hidden = model(tree.tokens[None], cache, positions, verify_mask(tree.mask, cache.offset))
    t = lap("fwd-build", t)
    acc = accept(cands, tree, logits[0], GREEDY, None)
    h = hidden[0, acc.stop][None]; drafted = tree.tokens[acc.path]
    lens = mx.cumprod(cands >= 0, axis=1).sum(axis=1)
    t = lap("acc-build", t)
    mx.eval(acc.n, acc.path, acc.next_token, h, drafted, acc.matched, lens)
    t = lap("eval", t)
    n = acc.n.item(); cache.commit(acc.path, n + 1)
    tokens = drafted[1 : n + 1].tolist() + acc.next_token.tolist()
    sizes = lens.tolist(); matched = acc.matched.tolist(); runs = proposal.by_source(matched)
    t = lap("after", t)
    return tokens, acc.next_token.astype(mx.int32), h, runs, tree.size
def run():
    steps = 0; kinds = {}
    for q in qs:
        ids = api.encode_prompt(lm, q)
        alloc = api.make_allocator(lm, o)
        cache = model.make_cache(len(ids) + 200)
        g0, h = prefill(model, cache, ids)
        state = DecodeState(tokens=[*ids, g0.item()], g0=g0.astype(mx.int32), h=h)
        for src in alloc.sources: src.start(state.tokens)
        n = 0
        while n < 128:
            plan = alloc.plan()
            toks, state.g0, state.h, runs, size = step(cache, state, plan, 3)
            state.tokens.extend(toks)
            for src in alloc.sources: src.extend(toks)
            alloc.update(runs)
            n += len(toks); steps += 1
    return steps
run(); T.clear()
s = run()
print({k: round(1000*v/s, 3) for k, v in T.items()}, s, round(1000*sum(T.values())/s, 2))
