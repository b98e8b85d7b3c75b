"""From corpus to shipped drafter: pick the shards, make sure their features exist, train, save."""

from __future__ import annotations

import platform
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx

from mlx_redrafter.draft.redrafter import Drafter, save_drafter
from mlx_redrafter.errors import UserError
from mlx_redrafter.models.loader import Target
from mlx_redrafter.train.corpus import Corpus
from mlx_redrafter.train.data import Examples, load_examples
from mlx_redrafter.train.features import ensure
from mlx_redrafter.train.kinds import KIND_TITLES
from mlx_redrafter.train.loop import TrainConfig


def pick_shards(corpus: Corpus, max_tokens: int | None = None) -> tuple[list[str], list[str]]:
    """(train shards, held-out shards); with max_tokens, the train shards in plan order until that many
    response tokens (corpus-size ablations use the corpus as it grew)."""
    names = [p.name for p in corpus.shards()]
    heldout = [n for n in names if corpus.entries[n]["split"] == "heldout"]
    train, total = [], 0
    for n in names:
        if corpus.entries[n]["split"] != "train":
            continue
        if max_tokens is not None and total >= max_tokens:
            break
        train.append(n)
        total += corpus.entries[n]["response_tokens"]
    if not train:
        raise UserError(f"corpus {corpus.root} has no training shards: run `make distill` first")
    if not heldout:
        raise UserError(f"corpus {corpus.root} has no held-out shard (shard-00000): run `make distill`")
    return train, heldout


def prepare(target: Target, corpus_root: str | Path, features_root: str | Path, max_tokens: int | None = None,
            log: Callable[[str], None] = print) -> tuple[Examples, Examples, dict]:
    """Training and held-out examples (features built on demand) and what was used."""
    corpus = Corpus(corpus_root)
    if not corpus.entries:
        raise UserError(f"no corpus at {corpus.root}: run `make distill` (redrafter-mlx distill) first, or pass "
                        f"--corpus DIR")
    train, heldout = pick_shards(corpus, max_tokens)
    paths = ensure(corpus, target.model, target.tokenizer.eos_ids[0], features_root, train + heldout, log=log)
    tr = load_examples(corpus, paths, train)
    ho = load_examples(corpus, paths, heldout)
    used = {"corpus": str(corpus.root), "train_shards": len(train), "heldout_shards": len(heldout),
            "train_response_tokens": tr.response_tokens, "train_sequences": tr.sequences}
    return tr, ho, used


def save_shipped(drafter: Drafter, out_dir: str | Path, model_card: str, float16: bool = True) -> Path:
    """Save the final drafter (float16 weights by default; loading casts to the target's dtype)."""
    if float16:
        drafter.apply(lambda x: x.astype(mx.float16) if mx.issubdtype(x.dtype, mx.floating) else x)
    try:
        return save_drafter(drafter, out_dir, extra_files={"MODEL_CARD.md": model_card})
    finally:
        if float16:
            drafter.apply(lambda x: x.astype(mx.float32) if mx.issubdtype(x.dtype, mx.floating) else x)


def model_card(model_name: str, cfg: TrainConfig, summary: dict, used: dict, timings: dict, extra: str = "") -> str:
    """MODEL_CARD.md from what this run actually did (evaluation sections are appended by the caller)."""
    final = summary.get("final", {})
    tlm = "rnn" if cfg.kind == "redrafter" else cfg.kind
    return f"""# {KIND_TITLES[cfg.kind]} drafter for {model_name}

Trained here by self-distillation with `redrafter-mlx train` (`make train`).

- Shape: exit_dim {cfg.exit_dim}, {cfg.num_draft_layers} ResBlocks, {tlm}, head over the {cfg.draft_vocab_size} most
  frequent tokens of the training data (covers {summary.get('head_coverage')} of them); {summary.get('params')}
  parameters.
- Data: {used['train_sequences']} training sequences ({used['train_response_tokens']} response tokens) from
  {used['train_shards']} shards of `{used['corpus']}` (the target's own greedy answers), held out: shard-00000.
- Training: {cfg.steps} steps x {cfg.batch_size} context positions x {cfg.draft_len} draft steps, {cfg.labels} labels,
  AdamW lr {cfg.lr} (warmup {cfg.warmup}, cosine to {cfg.min_lr_ratio}), weight decay {cfg.weight_decay}, dropout
  {cfg.input_dropout}; {summary.get('train_time_s')} s on {platform.machine()} ({platform.processor() or 'cpu'}).
- Time per stage: features {timings.get('features_s')} s, training {timings.get('train_s')} s.
- Held-out (teacher-forced) top-1 accuracy per draft step: {final.get('acc')}; loss {final.get('val_loss')}.
{extra}
Reproduce: `make train`; measure: `redrafter-mlx eval-drafter`.
"""
