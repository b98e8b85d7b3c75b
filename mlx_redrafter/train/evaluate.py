"""Acceptance of a drafter on prompts it never saw: tokens per target call, per-position acceptance, the
accepted-length histogram and draft / verify time per step, for every W x L (greedy, float32)."""

from __future__ import annotations

import time
from collections import Counter
from functools import partial
from pathlib import Path

from mlx_redrafter.errors import UserError


def heldout_prompt_ids(corpus_root: str | Path, num: int, seed: int = 0) -> list[list[int]]:
    """Chat-formatted prompt ids of `num` first-turn prompts of the corpus' held-out shard (never trained on)."""
    import numpy as np

    from mlx_redrafter.train.corpus import Corpus, load_shard

    corpus = Corpus(corpus_root)
    names = [n for n, e in sorted(corpus.entries.items()) if e["split"] == "heldout"]
    if not names:
        raise UserError(f"corpus {corpus.root} has no held-out shard: run `make distill` first")
    sh = load_shard(corpus.root / names[0])
    rows = [i for i in range(sh.num_sequences) if sh.turn[i] == 1]
    pick = np.random.default_rng(seed).permutation(len(rows))[:num]
    return [sh.sequence(rows[i])[: sh.prompt_len[rows[i]]].tolist() for i in sorted(pick)]


def run_eval(drafter_spec: str, model: str | None, widths: list[int], lengths: list[int],
             prompts: list[str] | list[list[int]], max_tokens: int, source: str, draft: str = "rnn",
             drafter_vocab: int | None = None, log=print, replay: bool = False,
             replay_cache: str | Path | None = None) -> dict:
    """Tokens per target call (mean over prompts, and pooled) per W x L, with per-position acceptance rates.
    `prompts` are texts (chat-formatted here) or token ids; `source` names them in the report; `drafter_vocab`
    is --drafter-vocab (None: the default rows). `replay`: each cell replays the target's greedy answers (decoded
    once; `train.replay`, kept in `replay_cache` if given) instead of decoding: the same tokens per call up to
    float rounding, no speeds."""
    from mlx_redrafter import api
    from mlx_redrafter.sweep import check_shapes
    from mlx_redrafter.train.replay import greedy_answers, replay_answers

    if draft == "none":
        raise UserError(f"--draft {draft} drafts nothing to measure: give a drafting mode, e.g. rnn")
    check_shapes(widths, lengths, draft, max_tokens)  # before the model loads and any shape runs
    lm = api.load(model, drafter_spec, "float32")
    api.draft_mode(lm, api.decode_options(draft=draft, drafter_vocab=drafter_vocab))  # bad options: one line, now
    ids = [api.encode_prompt(lm, p) for p in prompts]
    answers = greedy_answers(lm, ids, max_tokens, log, replay_cache) if replay else None
    results = []
    for w in widths:
        for length in lengths:
            opts = api.decode_options(draft=draft, beam_width=w, beam_length=length, max_tokens=max_tokens,
                                      drafter_vocab=drafter_vocab)
            per_prompt, hist, steps, decided, t0 = [], Counter(), 0, 0.0, time.perf_counter()
            phase = Counter()
            if answers is not None:  # per prompt: tokens per call, calls, decided tokens, histogram, phase times
                runs = [(st.tokens_per_step, st.steps, st.decided, st.accepted_hist, {})
                        for st in replay_answers(answers, partial(api.make_allocator, lm, opts), length, max_tokens)]
            else:
                runs = [(st.tokens_per_step, st.steps, st.tokens_per_step * st.steps, st.accepted_hist, st.phase_s)
                        for st in (api.generate(lm, p, opts).stats for p in ids)]
            for per_call, calls, made, accepted, phases in runs:
                if calls:
                    per_prompt.append(per_call)
                    steps += calls
                    decided += made
                    phase.update(phases)
                hist.update(accepted)
            total = sum(hist.values())
            # P(draft position k accepted) = share of steps that accepted >= k drafts
            pos_acc = [round(sum(v for n, v in hist.items() if n >= k) / max(total, 1), 4) for k in range(1, length)]
            rec = {"W": w, "L": length, "tokens_per_step": round(sum(per_prompt) / max(len(per_prompt), 1), 4),
                   "tokens_per_step_pooled": round(decided / max(steps, 1), 4), "steps": steps,
                   "accept_rate_by_position": pos_acc,
                   "draft_ms_per_step": None if replay else round(1000 * phase["draft"] / max(steps, 1), 1),
                   "verify_ms_per_step": None if replay else round(1000 * phase["verify"] / max(steps, 1), 1),
                   "accepted_hist": {str(k): hist[k] for k in sorted(hist)},
                   "seconds": round(time.perf_counter() - t0, 1)}
            results.append(rec)
            if log:
                log(str(rec))
    return {"model": lm.target.name, "drafter": lm.drafter_name, "draft": draft, "drafter_vocab": drafter_vocab,
            "prompts": len(ids), "prompts_source": source, "max_tokens": max_tokens,
            "method": "replay" if replay else "decode", "results": results}


def format_eval(res: dict) -> str:
    """A markdown table of tokens per target call by W x L."""
    Ls = sorted({r["L"] for r in res["results"]})
    Ws = sorted({r["W"] for r in res["results"]})
    cell = {(r["W"], r["L"]): r["tokens_per_step"] for r in res["results"]}
    rows = f", {res['drafter_vocab']} head rows" if res.get("drafter_vocab") is not None else ""
    lines = [f"tokens per target call, {res['model']} + {res['drafter']} ({res['draft']}{rows}), "
             f"{res['prompts']} prompts of {res['prompts_source']}, greedy, {res['max_tokens']} new tokens"
             + (" (replayed)" if res.get("method") == "replay" else ""), "",
             "| W \\ L | " + " | ".join(str(L) for L in Ls) + " |", "|---" * (len(Ls) + 1) + "|"]
    for w in Ws:
        lines.append(f"| {w} | " + " | ".join(f"{cell[(w, L)]:.2f}" if (w, L) in cell else "" for L in Ls) + " |")
    return "\n".join(lines)
