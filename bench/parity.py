"""MLX vs PyTorch parity report: `python -m bench parity --device cpu|cuda` (or `make parity DEVICE=...`).

Compares, on the default model (or --model) and MT-bench prompts, in fp32:
  target logits and post-norm hidden states (prompt prefill and the packed tree forward) against transformers'
  LlamaForCausalLM loaded from the same GGUF; drafter beams and chosen-token log-probs against the PyTorch
  drafter holding the same weights; packed tokens / depths / mask / unpacker against a loop implementation;
  one speculative step (mlx_redrafter.step) against the same step in PyTorch; end-to-end greedy token ids of
  the library's loops (generate_ar / generate_speculative) and of the PyTorch loops; the tokenizer.
Writes bench/results/parity/<device>/parity.json and parity.md.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mlx_redrafter.errors import UserError

from .report import save_report

RESULTS_DIR = Path(__file__).resolve().parent / "results" / "parity"


def to_np(x: Any) -> np.ndarray:
    """MLX array or torch tensor -> numpy array (floats as float32)."""
    if isinstance(x, np.ndarray):
        return x
    if isinstance(x, mx.array):
        return np.array(x.astype(mx.float32) if mx.issubdtype(x.dtype, mx.floating) else x)
    return x.detach().float().cpu().numpy() if x.is_floating_point() else x.detach().cpu().numpy()


def max_abs(a: Any, b: Any) -> float:
    """Largest absolute elementwise difference."""
    return float(np.max(np.abs(to_np(a).astype(np.float64) - to_np(b).astype(np.float64))))


def rnn_allocator(model: Any, drafter: Any, width: int) -> Any:
    """Plain ReDrafter's draft sources: the recurrent drafter's W beams, nothing else, fixed width."""
    from mlx_redrafter.draft.base import Allocator, Slot
    from mlx_redrafter.draft.redrafter import RnnSource

    return Allocator([Slot(RnnSource(drafter, model.embed), width)])


def pick_drafter(target: Any, spec: str | None) -> tuple[Any, str]:
    """The shipped drafter for the target if there is one, else a seeded random drafter (or `spec`), drafting from
    its float32 weights' values (float16 copies where float16 holds them exactly, none otherwise): the reference
    drafts from those, where decoding on a CPU reads 8-bit copies that may draft otherwise in near-ties."""
    from mlx_redrafter.api import resolve_drafter, shipped_drafter_path
    from mlx_redrafter.draft.weight_copies import use_weight_copies

    if spec is None:
        spec = "default" if shipped_drafter_path(target.name) is not None else "random:0"
    drafter, name = resolve_drafter(spec, target)
    if drafter is None:
        raise UserError(f"no drafter for {spec!r}")
    use_weight_copies(drafter, "float16")
    return drafter, name


def target_parity(mlx_model: Any, hf: Any, ids: list[int], device: str) -> dict[str, Any]:
    """Prefill logits/hidden over all prompt positions."""
    import torch

    from bench.torch_ref.target import forward

    logits, hidden = mlx_model(mx.array([ids]), mlx_model.make_cache(len(ids)))
    t_logits, t_hidden = forward(hf, torch.tensor([ids], device=device), feature_layers=mlx_model.feature_layers)
    a, b = to_np(logits[0]), to_np(t_logits[0])
    return {"prefill_logits_max_abs": max_abs(a, b), "prefill_hidden_max_abs": max_abs(hidden[0], t_hidden[0]),
            "prefill_argmax_match": float(np.mean(a.argmax(-1) == b.argmax(-1))), "prompt_tokens": len(ids)}


def drafter_tree_parity(mlx_model: Any, hf: Any, drafter: Any, t_drafter: Any, ids: list[int], width: int, length: int,
                        device: str) -> dict[str, Any]:
    """From the same prefill: beam search, packing of the same beams, the packed tree forward, and one whole
    speculative step (mlx_redrafter.step.speculative_step) against the same step in PyTorch."""
    import torch

    from bench.torch_ref import drafter as tdraft
    from bench.torch_ref import target as ttarget
    from bench.torch_ref import tree as ttree
    from mlx_redrafter.draft.base import DecodeState
    from mlx_redrafter.draft.beam_search import beam_search
    from mlx_redrafter.step import prefill, speculative_step
    from mlx_redrafter.tree import pack, verify_mask

    cache = mlx_model.make_cache(len(ids) + width * length)
    g0, h = prefill(mlx_model, cache, ids)
    beams, lp = beam_search(drafter, mlx_model.embed, h, g0, width, length)
    mx.eval(beams, lp)
    t_beams, t_lp = tdraft.beam_search(t_drafter, hf.model.embed_tokens, torch.from_numpy(to_np(h)).to(device),
                                       torch.from_numpy(to_np(g0)).long().to(device), width, length)
    out: dict[str, Any] = {
        "beams_equal": bool(np.array_equal(to_np(beams), to_np(t_beams))),
        "beam_logprob_max_abs": max_abs(lp, t_lp),
    }
    tree = pack(beams[0])
    t_tree = ttree.pack(torch.from_numpy(to_np(beams[0])).long())
    out["packed_equal"] = bool(
        tree.size == t_tree.size and np.array_equal(to_np(tree.tokens), to_np(t_tree.tokens))
        and np.array_equal(to_np(tree.depth), to_np(t_tree.depth))
        and np.array_equal(to_np(tree.mask), to_np(t_tree.mask))
        and np.array_equal(to_np(tree.unpacker), to_np(t_tree.unpacker)))
    out["packed_tokens"] = tree.size
    out["candidate_tokens"] = width * length
    # The packed tree forward, as the step's verify phase runs it (scratch only: the cache stays committed).
    positions = (cache.offset + tree.depth)[None]
    v_logits, v_hidden = mlx_model(tree.tokens[None], cache, positions, verify_mask(tree.mask, cache.offset))
    t_cache = ttarget.new_cache(hf)
    taps = mlx_model.feature_layers  # the layers the drafter reads besides the last (none for most drafters)
    ttarget.forward(hf, torch.tensor([ids], device=device), t_cache, feature_layers=taps)
    ctx = len(ids)
    allowed = torch.cat([torch.ones(t_tree.size, ctx, dtype=torch.bool), t_tree.mask], dim=1)
    tv_logits, tv_hidden = ttarget.forward(hf, t_tree.tokens[None].to(device), t_cache,
                                           (ctx + t_tree.depth)[None].to(device), allowed.to(device), taps)
    out["tree_logits_max_abs"] = max_abs(v_logits[0], tv_logits[0])
    out["tree_hidden_max_abs"] = max_abs(v_hidden[0], tv_hidden[0])
    out["tree_argmax_match"] = float(np.mean(to_np(v_logits[0]).argmax(-1) == to_np(tv_logits[0]).argmax(-1)))
    # One whole speculative step of the library on the same state vs the PyTorch step's decision.
    state = DecodeState(tokens=[*ids, g0.item()], g0=g0.astype(mx.int32), h=h)
    step = speculative_step(mlx_model, cache, state, rnn_allocator(mlx_model, drafter, width).plan(), length)
    t_tokens = _torch_step_tokens(t_beams[0].tolist(), tv_logits[0].argmax(-1)[t_tree.unpacker].tolist())
    out["step_tokens"] = step.tokens
    out["step_equal"] = step.tokens == t_tokens and step.verified == t_tree.size
    return out


def _torch_step_tokens(beams: list[list[int]], target_next: list[list[int]]) -> list[int]:
    """Accepted drafts of the longest matching beam (ties: lowest index) and the target's next token."""
    best, n = 0, -1
    for i, b in enumerate(beams):
        run = 0
        while run < len(b) - 1 and b[run + 1] == target_next[i][run]:
            run += 1
        if run > n:
            best, n = i, run
    return beams[best][1 : n + 1] + [target_next[best][n]]


def first_diff(a: list[int], b: list[int]) -> int | None:
    """Index of the first difference (None when equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def ar_top2_gap(mlx_model: Any, ids: list[int], generated: list[int], at: int) -> float:
    """Top-2 logit gap of the target (MLX, full forward) at generated position `at` (tie diagnostics)."""
    seq = ids + generated[:at]
    logits, _ = mlx_model(mx.array([seq]), mlx_model.make_cache(len(seq)), last_only=True)
    top = np.sort(to_np(logits[0, -1]))[-2:]
    return float(top[1] - top[0])


def e2e_parity(mlx_model: Any, hf: Any, drafter: Any, t_drafter: Any, ids: list[int], eos: list[int],
               max_tokens: int, width: int, length: int, device: str) -> dict[str, Any]:
    """Greedy token ids: MLX ReDrafter / MLX AR (the library's loops) / PyTorch AR / PyTorch ReDrafter."""
    from bench.torch_ref.decode import greedy_ar, greedy_redrafter
    from mlx_redrafter.generate import collect, generate_ar, generate_speculative

    runs: dict[str, list[int]] = {}
    times: dict[str, float] = {}
    t = time.perf_counter()
    runs["mlx_ar"] = collect(generate_ar(mlx_model, ids, max_tokens=max_tokens, eos_ids=eos))[0]
    times["mlx_ar"] = time.perf_counter() - t
    t = time.perf_counter()
    runs["mlx_redrafter"], stats = collect(generate_speculative(mlx_model, ids, rnn_allocator(mlx_model, drafter,
                                                                                             width),
                                                                length=length, max_tokens=max_tokens, eos_ids=eos))
    times["mlx_redrafter"] = time.perf_counter() - t
    t = time.perf_counter()
    runs["torch_ar"] = greedy_ar(hf, ids, max_tokens, eos, device=device)
    times["torch_ar"] = time.perf_counter() - t
    t = time.perf_counter()
    runs["torch_redrafter"], tstats = greedy_redrafter(hf, t_drafter, ids, max_tokens, eos, width, length, device)
    times["torch_redrafter"] = time.perf_counter() - t
    ref = runs["mlx_ar"]
    out: dict[str, Any] = {"tokens": {k: len(v) for k, v in runs.items()},
                           "seconds": {k: round(v, 3) for k, v in times.items()},
                           "mlx_tokens_per_step": round(stats.tokens_per_step, 3),
                           "torch_tokens_per_step": round(len(runs["torch_redrafter"]) / max(tstats.steps, 1), 3)}
    for k in ("mlx_redrafter", "torch_ar", "torch_redrafter"):
        d = first_diff(ref, runs[k])
        out[f"{k}_equals_mlx_ar"] = d is None
        if d is not None:
            out[f"{k}_first_diff"] = d
            out[f"{k}_top2_gap_at_diff"] = ar_top2_gap(mlx_model, ids, ref, d) if d < len(ref) else None
            n = min(len(ref), len(runs[k]))
            out[f"{k}_match_rate"] = float(np.mean(np.array(ref[:n]) == np.array(runs[k][:n]))) if n else 0.0
    return out


def tokenizer_parity(target: Any, spec: str | None, texts: list[str]) -> dict[str, Any]:
    """Our tokenizer vs transformers' tokenizer from the same GGUF (raw text, no chat template)."""
    from transformers import AutoTokenizer

    from mlx_redrafter.models.loader import resolve_model

    _, path = resolve_model(spec)
    try:
        if path.is_dir():
            tok = AutoTokenizer.from_pretrained(str(path))
        else:
            tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:  # tokenizer conversion is optional for the report
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
    same = [target.tokenizer.encode(t) == tok.encode(t, add_special_tokens=False) for t in texts]
    return {"texts": len(texts), "identical": int(sum(same))}


def run(device: str, model: str | None, drafter_spec: str | None, n_prompts: int, max_tokens: int, width: int,
        length: int, out_dir: Path, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Build the report over the first `n_prompts` MT-bench first turns; writes parity.json and parity.md."""
    import torch

    from bench.torch_ref.drafter import from_mlx
    from bench.torch_ref.target import load_hf_target
    from mlx_redrafter.models.loader import load_target
    from mlx_redrafter.prompts import first_turns

    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device visible to PyTorch")
    if width < 1 or length < 2 or max_tokens < 1 or n_prompts < 1:
        raise UserError("--beam-width must be >= 1, --beam-length >= 2, --max-tokens and --prompts >= 1")
    torch.manual_seed(0)
    t0 = time.perf_counter()
    target = load_target(model, "float32")
    hf = load_hf_target(model, device=device)
    drafter, drafter_name = pick_drafter(target, drafter_spec)
    t_drafter = from_mlx(drafter, device)
    load_s = time.perf_counter() - t0
    tok = target.tokenizer
    prompts = [r["prompt"] for r in first_turns(num=n_prompts)]
    rows = []
    for i, p in enumerate(prompts):
        ids = tok.encode_chat([{"role": "user", "content": p}])
        row = {"prompt": i, **target_parity(target.model, hf, ids, device),
               **drafter_tree_parity(target.model, hf, drafter, t_drafter, ids, width, length, device),
               **e2e_parity(target.model, hf, drafter, t_drafter, ids, tok.eos_ids, max_tokens, width, length,
                            device)}
        rows.append(row)
        log(f"prompt {i}: logits {row['prefill_logits_max_abs']:.2e} tree {row['tree_logits_max_abs']:.2e} "
            f"beams {row['beams_equal']} packed {row['packed_equal']} step {row['step_equal']} e2e "
            f"{row['mlx_redrafter_equals_mlx_ar']}/{row['torch_ar_equals_mlx_ar']}/"
            f"{row['torch_redrafter_equals_mlx_ar']}")
    report = {
        "device": device, "torch_device_name": torch.cuda.get_device_name(0) if device == "cuda" else
        (platform.processor() or platform.machine()), "mlx_device": str(mx.default_device()), "model": target.name,
        "dtype": "float32", "drafter": drafter_name, "beam_width": width, "beam_length": length,
        "max_tokens": max_tokens, "prompts": len(rows), "torch_version": torch.__version__,
        "mlx_version": mx.__version__, "load_s": round(load_s, 2), "summary": summarize(rows),
        "tokenizer": tokenizer_parity(target, model, prompts), "per_prompt": rows,
        "total_s": round(time.perf_counter() - t0, 2),
    }
    save_report(out_dir, "parity", report, markdown)
    return report


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Worst differences and counts of identical results over the prompts."""
    def count(k: str) -> str:
        return f"{sum(bool(r[k]) for r in rows)}/{len(rows)}"

    out: dict[str, Any] = {k: max(r[k] for r in rows) for k in (
        "prefill_logits_max_abs", "prefill_hidden_max_abs", "tree_logits_max_abs", "tree_hidden_max_abs",
        "beam_logprob_max_abs")}
    out.update({k: float(np.mean([r[k] for r in rows])) for k in (
        "prefill_argmax_match", "tree_argmax_match", "mlx_tokens_per_step")})
    out.update({k: count(k) for k in ("beams_equal", "packed_equal", "step_equal", "mlx_redrafter_equals_mlx_ar",
                                      "torch_ar_equals_mlx_ar", "torch_redrafter_equals_mlx_ar")})
    return out


def markdown(r: dict[str, Any]) -> str:
    """Short markdown summary of a parity report."""
    s = r["summary"]
    lines = [
        f"# MLX vs PyTorch parity ({r['device']})",
        "",
        f"Model `{r['model']}` fp32, drafter `{r['drafter']}`, W={r['beam_width']} L={r['beam_length']}, "
        f"{r['prompts']} MT-bench prompts, {r['max_tokens']} new tokens; torch {r['torch_version']} on "
        f"{r['torch_device_name']}, MLX {r['mlx_version']} on {r['mlx_device']}.",
        "",
        "| check | result |",
        "|---|---|",
        f"| prefill logits max abs diff | {s['prefill_logits_max_abs']:.2e} |",
        f"| prefill features (post-norm + tapped layers) max abs diff | {s['prefill_hidden_max_abs']:.2e} |",
        f"| prefill argmax agreement | {s['prefill_argmax_match']:.4f} |",
        f"| packed tree forward logits max abs diff | {s['tree_logits_max_abs']:.2e} |",
        f"| packed tree forward features max abs diff | {s['tree_hidden_max_abs']:.2e} |",
        f"| packed tree argmax agreement | {s['tree_argmax_match']:.4f} |",
        f"| drafter beams identical | {s['beams_equal']} |",
        f"| drafter chosen log-probs max abs diff | {s['beam_logprob_max_abs']:.2e} |",
        f"| packed tokens / depth / mask / unpacker identical | {s['packed_equal']} |",
        f"| one speculative step (step.speculative_step) == PyTorch step | {s['step_equal']} |",
        f"| greedy ids: MLX ReDrafter == MLX AR | {s['mlx_redrafter_equals_mlx_ar']} |",
        f"| greedy ids: PyTorch AR == MLX AR | {s['torch_ar_equals_mlx_ar']} |",
        f"| greedy ids: PyTorch ReDrafter == MLX AR | {s['torch_redrafter_equals_mlx_ar']} |",
        f"| MLX ReDrafter tokens per target call | {s['mlx_tokens_per_step']:.3f} |",
    ]
    t = r.get("tokenizer", {})
    if "identical" in t:
        lines.append(f"| tokenizer ids identical to transformers (GGUF) | {t['identical']}/{t['texts']} |")
    lines += ["", f"Total time {r['total_s']} s. Per-prompt details in parity.json.", ""]
    return "\n".join(lines)
