"""How well the drafter's own probabilities predict what the target accepts (its calibration).

For each prompt the target's greedy answer is decoded, then, from every position of it (teacher forced: the
target's features there and its next token as g0), the drafter drafts L - 1 tokens greedily
(`draft.beam_search.greedy_steps`). A draft is accepted where the target's greedy answer goes on with it. Per draft
step k: how often the k-th draft is accepted once the ones before it were, binned by the drafter's probability of
it; and how often the first k drafts are all accepted, binned by the product of their probabilities (what
`--draft-confidence` cuts on). A calibrated drafter is accepted about as often as its probability says.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from mlx_redrafter import api
from mlx_redrafter.draft.beam_search import greedy_steps, top_log_probability
from mlx_redrafter.draft.redrafter import RnnSource
from mlx_redrafter.generate import collect, generate_ar
from mlx_redrafter.model import forward_chunked
from mlx_redrafter.sources import vocab_rows

BINS = np.linspace(0.0, 1.0, 11)


def _drafts(lm: api.LoadedModel, head, ids: list[int], answer: list[int], length: int):
    """(accepted (T, L-1) bool, probabilities (T, L-1)) for the T answer positions that have L - 1 tokens after
    their g0."""
    model = lm.target.model
    seq = ids + answer
    _, hidden = forward_chunked(model, model.make_cache(len(seq)), mx.array([seq]), all_hidden=True)
    start, stop = len(ids) - 1, len(seq) - length  # g0 = seq[p + 1]; its drafts are checked against seq[p + 2 ...]
    if stop <= start:
        return np.zeros((0, length - 1), bool), np.zeros((0, length - 1))
    steps = list(greedy_steps(head, model.embed, hidden[0, start:stop], mx.array(seq[start + 1 : stop + 1]), length))
    toks = np.array(mx.concatenate([t for t, _ in steps], axis=1))
    probs = np.exp(np.array(mx.concatenate([top_log_probability(lg) for _, lg in steps], axis=1)))
    truth = np.stack([np.array(seq[p + 2 : p + length + 1]) for p in range(start, stop)])
    return toks == truth, probs


def _binned(ok: np.ndarray, p: np.ndarray) -> list[dict[str, Any]]:
    idx = np.clip(np.digitize(p, BINS) - 1, 0, len(BINS) - 2)
    return [{"lo": round(float(BINS[b]), 1), "hi": round(float(BINS[b + 1]), 1), "n": int((idx == b).sum()),
             "accepted": round(float(ok[idx == b].mean()), 3) if (idx == b).any() else None}
            for b in range(len(BINS) - 1)]


def measure(lm: api.LoadedModel, prompts: list[list[int]], max_tokens: int, length: int, log=print) -> dict:
    """The calibration of `lm`'s drafter on `prompts` (chat-formatted ids), drafts of L - 1 = `length` - 1 tokens."""
    rows = vocab_rows(lm.drafter, api.decode_options())
    head = RnnSource(lm.drafter, lm.target.model.embed, rows).drafter  # the head decoding drafts with
    oks, ps = [], []
    for i, ids in enumerate(prompts):
        answer, _ = collect(generate_ar(lm.target.model, ids, max_tokens=max_tokens, eos_ids=lm.tokenizer.eos_ids))
        ok, p = _drafts(lm, head, ids, answer, length)
        oks.append(ok)
        ps.append(p)
        if log:
            log(f"calibration: prompt {i + 1}/{len(prompts)}, {len(ok)} positions")
    ok, p = np.concatenate(oks), np.concatenate(ps)
    steps, joint = [], []
    for k in range(length - 1):
        reached = ok[:, :k].all(axis=1)  # the drafts before the k-th were accepted
        steps.append({"step": k + 1, "positions": int(reached.sum()),
                      "accepted": round(float(ok[reached, k].mean()), 3),
                      "mean_probability": round(float(p[reached, k].mean()), 3),
                      "bins": _binned(ok[reached, k], p[reached, k])})
        all_ok, product = ok[:, : k + 1].all(axis=1), p[:, : k + 1].prod(axis=1)
        joint.append({"drafts": k + 1, "accepted": round(float(all_ok.mean()), 3),
                      "mean_probability": round(float(product.mean()), 3), "bins": _binned(all_ok, product)})
    return {"model": lm.target.name, "drafter": lm.drafter_name, "head_rows": rows, "prompts": len(prompts),
            "max_tokens": max_tokens, "length": length, "positions": int(len(ok)), "steps": steps, "joint": joint}


def markdown(res: dict, title: str) -> str:
    heads = " | ".join(f"{b['lo']:.1f}-{b['hi']:.1f}" for b in res["steps"][0]["bins"])
    lines = [f"# {title}", "",
             f"Drafter `{res['drafter']}` ({res['head_rows'] or 'all'} head rows) on `{res['model']}`, "
             f"{res['prompts']} prompts, {res['max_tokens']} greedy tokens each, drafts of {res['length'] - 1} tokens "
             f"from each of {res['positions']} answer positions. Share accepted, by the drafter's probability "
             "(cells: accepted share / positions).", "",
             "| | accepted | mean probability | " + heads + " |", "|---|---|---|" + "---|" * len(BINS[:-1])]

    def row(name: str, r: dict) -> str:
        cells = " | ".join("-" if b["accepted"] is None else f"{b['accepted']:.2f} / {b['n']}" for b in r["bins"])
        return f"| {name} | {r['accepted']:.3f} | {r['mean_probability']:.3f} | {cells} |"

    lines += [row(f"draft {s['step']} (given the earlier accepted)", s) for s in res["steps"]]
    lines += [row(f"first {j['drafts']} drafts all accepted, by their product", j) for j in res["joint"]]
    return "\n".join(lines) + "\n"
