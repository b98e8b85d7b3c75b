"""Drafter recipe ablations at equal CPU time: each variant trains for the same CPU budget on its data and is
measured on prompts it never saw.

A variant is a set of `TrainConfig` overrides plus its data (which corpora, how many response tokens of each,
and optionally a first stage on other data). Before training, a short probe measures the variant's CPU seconds
per optimizer step, so every variant gets `--cpu-minutes` of training whatever its cost per step. Each variant
is measured three ways: teacher-forced loss and top-1 per draft step on the greedy corpus' held-out shard;
tokens per target call replayed on that shard's sequences (exact for greedy decoding, drafting cost only); and
tokens per target call of real decoding on MT-bench first turns (`--draft rnn`). Results go to
OUT/drafter-ablation.{json,md}, updated after every variant; finished variants are skipped.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from mlx_redrafter.files import write_atomic


@dataclass(frozen=True)
class Variant:
    overrides: dict[str, Any] = field(default_factory=dict)  # TrainConfig fields
    data: tuple[tuple[str, int | None], ...] = (("greedy", None),)  # (source, response tokens or None = all)
    first: tuple[tuple[str, int | None], ...] = ()  # a first stage on this data (half the budget), then `data`


# The round-3 recipe candidates. "base" is the round-2 recipe; the others change one thing.
CHEAP = {"draft_vocab_size": 4096, "draft_len": 4}
VARIANTS: dict[str, Variant] = {
    "base": Variant(),
    "cheap-head": Variant(CHEAP),
    "soft": Variant({**CHEAP, "labels": "soft"}),
    "noise": Variant({**CHEAP, "feature_noise": 0.1}),
    "frozen-head": Variant({**CHEAP, "freeze_head": True}),
    "soft-noise": Variant({**CHEAP, "labels": "soft", "feature_noise": 0.1}),
    "exit-1152": Variant({**CHEAP, "exit_dim": 1152}),
    "layers-1": Variant({**CHEAP, "num_draft_layers": 1}),
    "layers-4": Variant({**CHEAP, "num_draft_layers": 4}),
    "T-3": Variant({**CHEAP, "draft_len": 3}),
    "T-6": Variant({**CHEAP, "draft_len": 6}),
    "data-text": Variant(CHEAP, (("text", None),)),
    "data-mix": Variant(CHEAP, (("greedy", None), ("text", None))),
    "data-text-then-greedy": Variant(CHEAP, (("greedy", None),), first=(("text", None),)),
    "greedy-0.25M": Variant(CHEAP, (("greedy", 250_000),)),
    "greedy-0.5M": Variant(CHEAP, (("greedy", 500_000),)),
    "greedy-1M": Variant(CHEAP, (("greedy", 1_000_000),)),
    "greedy-2M": Variant(CHEAP, (("greedy", 2_000_000),)),
    "text-0.5M": Variant(CHEAP, (("text", 500_000),)),
    "text-1M": Variant(CHEAP, (("text", 1_000_000),)),
}


def _corpora(data: tuple[tuple[str, int | None], ...], corpus_root: Path, model: str) -> list[tuple[Path, int | None]]:
    from mlx_redrafter.cmd.train import corpus_dir

    return [(corpus_dir(corpus_root, model, src), cap) for src, cap in data]


def _examples(target, parts: list[tuple[Path, int | None]], features_root: Path, heldout: Path, log):
    """Training examples from several (corpus, cap) parts (caps may differ), held-out examples, what was used."""
    from mlx_redrafter.train.data import load_examples
    from mlx_redrafter.train.features import ensure
    from mlx_redrafter.train.pipeline import heldout_examples, open_corpus, pick_shards

    ho, _ = heldout_examples(target, heldout, features_root, log)
    chosen, used = [], {}
    for root, cap in parts:
        corpus = open_corpus(root)
        names = pick_shards(corpus, cap)
        paths = ensure(corpus, target.model, target.tokenizer.eos_ids[0], features_root / corpus.name, names, log=log)
        chosen.append((corpus, paths, names))
        used[corpus.name] = sum(corpus.entries[n]["response_tokens"] for n in names)
    return load_examples(chosen), ho, used


def data_cpu_hours(parts: list[tuple[Path, int | None]]) -> float:
    """CPU hours the generation of the used shards took (one BLAS thread per worker; the manifest's seconds)."""
    from mlx_redrafter.train.pipeline import open_corpus, pick_shards

    total = 0.0
    for root, cap in parts:
        corpus = open_corpus(root)
        total += sum(corpus.entries[n].get("seconds", 0.0) for n in pick_shards(corpus, cap))
    return round(total / 3600, 2)


def probe_step_seconds(target, train, heldout, cfg, run: Path, log) -> float:
    """CPU seconds per optimizer step of this recipe (a few steps after compilation, in a throwaway run)."""
    from mlx_redrafter.train.loop import train_drafter

    probe = run / "probe"
    shutil.rmtree(probe, ignore_errors=True)
    warm = replace(cfg, steps=4, eval_every=10**9, checkpoint_every=10**9)
    train_drafter(target, train, heldout, probe, warm, resume=False, progress=False, log=lambda m: None)
    c0 = time.process_time()
    timed = replace(cfg, steps=16, eval_every=10**9, checkpoint_every=10**9)
    train_drafter(target, train, heldout, probe, timed, resume=False, progress=False, log=lambda m: None)
    per = (time.process_time() - c0) / 16
    shutil.rmtree(probe, ignore_errors=True)
    log(f"probe: {per:.3f} CPU s per step")
    return per


def replay_heldout(drafter_dir: Path, target, heldout_root: Path, features_root: Path, sequences: int,
                   max_tokens: int, width: int = 1, length: int = 4) -> dict[str, Any]:
    """Tokens per target call of the drafter alone (rnn, W x L), replayed on held-out greedy sequences."""
    from mlx_redrafter.api import resolve_drafter
    from mlx_redrafter.draft.base import Allocator, Slot
    from mlx_redrafter.draft.redrafter import RnnSource
    from mlx_redrafter.train.corpus import load_shard
    from mlx_redrafter.train.features import ensure, load_features
    from mlx_redrafter.train.pipeline import open_corpus
    from mlx_redrafter.train.replay import replay

    corpus = open_corpus(heldout_root)
    name = [p.name for p in corpus.shards("heldout")][0]
    paths = ensure(corpus, target.model, target.tokenizer.eos_ids[0], features_root / corpus.name, [name])
    shard = load_shard(corpus.root / name)
    hidden = load_features(paths[name], shard).hidden
    drafter, _ = resolve_drafter(str(drafter_dir), target)
    rows = drafter.args.draft_vocab_size or 0

    def allocator():
        return Allocator([Slot(RnnSource(drafter, target.model.embed, min(rows, 4096)), width)])

    turn1 = [i for i in range(shard.num_sequences) if shard.turn[i] == 1][:sequences]
    stats = replay(shard, np.asarray(hidden), allocator, length, max_tokens, sequences=turn1)
    return {"sequences": len(turn1), **stats.as_dict()}


def run_ablation(names: list[str], corpus_root: Path, features_root: Path, runs_root: Path, out_dir: Path,
                 cpu_minutes: float, replay_sequences: int, eval_prompts: int, eval_tokens: int,
                 log=print) -> dict[str, Any]:
    """Train and measure the named variants; returns (and writes) all results so far."""
    from mlx_redrafter.cmd.train import corpus_dir
    from mlx_redrafter.models.loader import load_target
    from mlx_redrafter.prompts import first_turns
    from mlx_redrafter.system.machine import machine_info
    from mlx_redrafter.system.machine_state import loadavg
    from mlx_redrafter.train.evaluate import run_eval
    from mlx_redrafter.train.loop import TrainConfig, train_drafter
    from mlx_redrafter.train.pipeline import save_shipped

    out_json = out_dir / "drafter-ablation.json"
    results: dict[str, Any] = json.loads(out_json.read_text()) if out_json.exists() else {"variants": {}}
    target = load_target(None, "float32")
    heldout = corpus_dir(corpus_root, target.name, "greedy")
    prompts = [r["prompt"] for r in first_turns(None, eval_prompts, spread=True)] if eval_prompts else []
    for name in names:
        v = VARIANTS[name]
        cfg = replace(TrainConfig(), **v.overrides)
        key = json.dumps({"cfg": asdict(cfg), "data": v.data, "first": v.first, "cpu_minutes": cpu_minutes},
                         sort_keys=True)
        if results["variants"].get(name, {}).get("key") == key:
            log(f"{name}: done already")
            continue
        log(f"{name}: {v}")
        run = runs_root / name
        if (run / "variant.json").exists() and (run / "variant.json").read_text() != key:
            shutil.rmtree(run)  # another recipe under this name: start over (same key: resume)
        write_atomic(run / "variant.json", key)
        t0, c0 = time.perf_counter(), time.process_time()
        stages = ([v.first] if v.first else []) + [v.data]
        budget = cpu_minutes * 60 / len(stages)
        drafter, summary, used, steps = None, {}, {}, 0
        for k, data in enumerate(stages):
            parts = _corpora(data, corpus_root, target.name)
            train, ho, stage_used = _examples(target, parts, features_root, heldout, log)
            used.update({f"{c}" + (" (first stage)" if k < len(stages) - 1 else ""): n for c, n in stage_used.items()})
            stage_cfg = replace(cfg, init_from=str(run / "stage0" / "final") if k else None)
            per = probe_step_seconds(target, train, ho, stage_cfg, run, log)
            stage_cfg = replace(stage_cfg, steps=max(int(budget / per), 10), eval_every=10**9,
                                warmup=min(cfg.warmup, max(int(budget / per) // 10, 1)))
            stage_dir = run / f"stage{k}" if len(stages) > 1 else run
            drafter, summary = train_drafter(target, train, ho, stage_dir, stage_cfg, log=log)
            save_shipped(drafter, stage_dir / "final", "")
            steps += stage_cfg.steps
        final = run / "stage1" / "final" if len(stages) > 1 else run / "final"
        replayed = replay_heldout(final, target, heldout, features_root, replay_sequences, eval_tokens)
        decoded = None
        if prompts:
            ev = run_eval(str(final), None, [1], [4], prompts, eval_tokens, "MT-bench first turns", draft="rnn",
                          log=None)
            decoded = ev["results"][0]["tokens_per_step_pooled"]
        results["variants"][name] = {
            "key": key, "overrides": v.overrides, "data": [list(d) for d in v.data],
            "first": [list(d) for d in v.first], "corpus_tokens": used, "params": summary["params"],
            "steps": steps, "positions_seen": steps * cfg.batch_size,
            "train_cpu_s": round(time.process_time() - c0), "wall_s": round(time.perf_counter() - t0),
            "data_cpu_h": data_cpu_hours([p for d in stages for p in _corpora(d, corpus_root, target.name)]),
            "heldout_loss": summary["final"]["val_loss"], "heldout_top1": summary["final"]["acc"],
            "replay_tokens_per_call": replayed["tokens_per_step"], "replay_sequences": replayed["sequences"],
            "mtbench_tokens_per_call": decoded, "loadavg": loadavg(),
        }
        log(json.dumps({k_: results["variants"][name][k_] for k_ in ("heldout_top1", "replay_tokens_per_call",
                                                                      "mtbench_tokens_per_call")}))
        del drafter
        done = results["variants"][name]
        if out_json.exists():  # another ablation process may have written variants meanwhile: keep them
            results = json.loads(out_json.read_text())
            results.setdefault("variants", {})[name] = done
        results["machine"] = machine_info()
        results["settings"] = {"cpu_minutes": cpu_minutes, "replay_sequences": replay_sequences,
                               "eval_prompts": eval_prompts, "eval_tokens": eval_tokens, "shape": "W1 L4"}
        write_atomic(out_json, json.dumps(results, indent=1) + "\n")
        write_atomic(out_dir / "drafter-ablation.md", markdown(results))
        plot_learning_curve(results, out_dir / "drafter-learning-curve.png")
    return results


def markdown(results: dict[str, Any]) -> str:
    """The ablation table and the learning curve."""
    s = results.get("settings", {})
    lines = ["# Drafter recipe ablation (equal CPU time)", "",
             f"Every variant trains for {s.get('cpu_minutes')} CPU minutes (one BLAS thread; steps from a probe of "
             f"its cost per step). Measured at {s.get('shape')} with the drafter alone (`--draft rnn`): tokens per "
             f"target call replayed on {s.get('replay_sequences')} sequences of the greedy corpus' held-out shard, "
             f"and decoded on {s.get('eval_prompts')} MT-bench first turns ({s.get('eval_tokens')} new tokens, "
             "greedy, float32; pooled over prompts); teacher-forced top-1 per draft step on the held-out shard. "
             "Neither prompt set was trained or tuned on.", "",
             "| variant | data (response tokens) | params | steps | held-out loss | top-1 step 1..3 | "
             "tokens/call held-out | tokens/call MT-bench |", "|---" * 8 + "|"]
    for name, r in results["variants"].items():
        top = ", ".join(f"{a:.3f}" for a in r["heldout_top1"][:3])
        data = "; ".join(f"{k} {v:,}" for k, v in r["corpus_tokens"].items())
        mt = r["mtbench_tokens_per_call"]
        lines.append(f"| {name} | {data} | {r['params'] / 1e6:.2f}M | {r['steps']} | {r['heldout_loss']:.3f} | "
                     f"{top} | {r['replay_tokens_per_call']:.3f} | {'' if mt is None else f'{mt:.3f}'} |")
    for src in ("greedy", "text"):
        curve = learning_curve(results, src)
        if len(curve) > 1:
            lines += ["", f"Learning curve, {src} data (the same recipe and CPU budget at growing corpus sizes; "
                          "[plot](drafter-learning-curve.png)):", "",
                      "| response tokens | data CPU h | held-out top-1 step 1 | tokens/call held-out | "
                      "tokens/call MT-bench |", "|---" * 5 + "|"]
            for r in curve:
                mt = r["mtbench_tokens_per_call"]
                lines.append(f"| {sum(r['corpus_tokens'].values()):,} | {r['data_cpu_h']} | {r['heldout_top1'][0]:.3f} "
                             f"| {r['replay_tokens_per_call']:.3f} | {'' if mt is None else f'{mt:.3f}'} |")
    return "\n".join(lines) + "\n"


def learning_curve(results: dict[str, Any], source: str) -> list[dict[str, Any]]:
    """The variants that differ only in how much data of one source they train on, by corpus size."""
    rows = [r for n, r in results["variants"].items() if n.startswith(f"{source}-") and not r["first"]]
    return sorted(rows, key=lambda r: sum(r["corpus_tokens"].values()))


def plot_learning_curve(results: dict[str, Any], path: Path) -> str | None:
    """Tokens per target call vs training tokens (log x), per data source; None with fewer than 2 points."""
    curves = {src: learning_curve(results, src) for src in ("greedy", "text")}
    if max(len(c) for c in curves.values()) < 2:
        return None
    from .plots import _save, plt

    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for src, curve in curves.items():
        xs = [sum(r["corpus_tokens"].values()) for r in curve]
        ax.plot(xs, [r["replay_tokens_per_call"] for r in curve], "o-", label=f"{src}: held-out shard")
        if any(r["mtbench_tokens_per_call"] for r in curve):
            ax.plot(xs, [r["mtbench_tokens_per_call"] for r in curve], "s--", label=f"{src}: MT-bench")
    ax.set_xscale("log")
    ax.set(xlabel="training response tokens", ylabel="tokens per target call (W1 L4, drafter alone)",
           title="ReDrafter learning curve (equal CPU time)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)
