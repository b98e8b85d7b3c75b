"""From corpus to shipped drafter: pick the shards, make sure their features exist, train, save."""

from __future__ import annotations

import platform
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx

from mlx_redrafter.draft.redrafter import Drafter, save_drafter
from mlx_redrafter.errors import UserError
from mlx_redrafter.models.loader import Target
from mlx_redrafter.train.config import TrainConfig
from mlx_redrafter.train.corpus import Corpus, shard_index
from mlx_redrafter.train.data import Examples, load_examples
from mlx_redrafter.train.features import ensure
from mlx_redrafter.train.kinds import KIND_TITLES


def pick_shards(corpus: Corpus, max_tokens: int | None = None, only: list[int] | None = None) -> list[str]:
    """The corpus' train shards in plan order (with `only`, those with these plan indices); with max_tokens, until
    that many response tokens (learning curves use the corpus as it grew)."""
    train, total = [], 0
    for p in corpus.shards("train"):
        if only is not None and shard_index(p.name) not in only:
            continue
        if max_tokens is not None and total >= max_tokens:
            break
        train.append(p.name)
        total += corpus.entries[p.name]["response_tokens"]
    return train


def open_corpus(root: str | Path, vocab_size: int | None = None) -> Corpus:
    """The corpus at `root` (its shards checked against the target's `vocab_size` when given); a one-line error
    when there is none."""
    corpus = Corpus(root, vocab_size)
    if not corpus.entries:
        raise UserError(f"no corpus at {corpus.root}: run `make distill` (redrafter-mlx distill) first, or pass "
                        f"--corpus DIR")
    return corpus


def prepare(target: Target, corpora: list[str | Path], features_root: str | Path, max_tokens: int | None = None,
            heldout: str | Path | None = None, log: Callable[[str], None] = print, shards: list[int] | None = None,
            layers: tuple[int, ...] = ()) -> tuple[Examples, Examples, dict]:
    """Training examples from the train shards of `corpora` (only the plan indices `shards` when given; at most
    `max_tokens` response tokens of each) and held-out examples from the held-out shard of `heldout` (default: the
    first corpus); features (with the states of target `layers` for a drafter that fuses them) are built on demand.
    Returns both and what was used."""
    features_root = Path(features_root)
    parts, used_shards = [], {}
    for root in corpora:
        corpus = open_corpus(root, target.model.args.vocab_size)
        names = pick_shards(corpus, max_tokens, shards)
        paths = ensure(corpus, target.model, target.tokenizer.eos_ids[0], features_root / corpus.name, names, log=log,
                       layers=layers)
        parts.append((corpus, paths, names))
        used_shards[corpus.name] = len(names)
    if not any(names for _, _, names in parts):
        if shards is not None:
            raise UserError(f"{', '.join(map(str, corpora))}: no training shard has a plan index in --shards: "
                            f"list the shard numbers of data/corpus/<model>/shard-NNNNN.npz (e.g. --shards 1-9)")
        raise UserError(f"{', '.join(map(str, corpora))}: no training shards: run `make distill` first")
    ho, ho_what = heldout_examples(target, heldout if heldout is not None else corpora[0], features_root, log, layers)
    tr = load_examples(parts)
    used = {"corpora": {name: {"train_shards": n, "response_tokens": tr.by_corpus.get(name, 0)}
                        for name, n in used_shards.items()},
            "heldout": ho_what, "train_response_tokens": tr.response_tokens, "train_sequences": tr.sequences}
    return tr, ho, used


def heldout_examples(target: Target, root: str | Path, features_root: str | Path,
                     log: Callable[[str], None] = print, layers: tuple[int, ...] = ()) -> tuple[Examples, str]:
    """Examples of a corpus' held-out shard (features, with target `layers`, built on demand) and a line saying
    which they are."""
    corpus = open_corpus(root, target.model.args.vocab_size)
    names = [p.name for p in corpus.shards("heldout")]
    if not names:
        raise UserError(f"corpus {corpus.root} has no held-out shard (shard-00000): run `make distill`")
    paths = ensure(corpus, target.model, target.tokenizer.eos_ids[0], Path(features_root) / corpus.name, names,
                   log=log, layers=layers)
    return load_examples([(corpus, paths, names)]), f"{corpus.root}: {', '.join(names)}"


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
    head = "frozen" if cfg.freeze_head else "trained alone (the rest frozen)" if cfg.head_only else "trained"
    tlm = "rnn" if cfg.kind == "redrafter" else cfg.kind
    shape = {"exit_dim": cfg.exit_dim, "num_draft_layers": cfg.num_draft_layers,
             "draft_vocab_size": cfg.draft_vocab_size, **summary.get("shape", {})}
    layers = shape.get("feature_layers")
    fused = f", context fusing target layers {', '.join(map(str, layers))} with the last" if layers else ""
    start = f", starting from the weights of `{cfg.init_from}`" if cfg.init_from else ""
    corpora = "; ".join(f"`{name}` {u['response_tokens']:,} response tokens in {u['train_shards']} shards"
                        for name, u in used["corpora"].items())
    return f"""# {KIND_TITLES[cfg.kind]} drafter for {model_name}

Trained here by self-distillation with `redrafter-mlx train` (`make train`).

- Shape: exit_dim {shape['exit_dim']}, {shape['num_draft_layers']} ResBlocks, {tlm}, head over
  {shape['draft_vocab_size']} frequent tokens (covering {summary.get('head_coverage')} of the target's decisions in
  the training data, {summary.get('head_coverage_heldout')} in the held-out shard){fused};
  {summary.get('params')} parameters{start}.
- Data: {used['train_sequences']} training sequences ({used['train_response_tokens']} response tokens):
  {corpora}; held out: {used['heldout']}.
- Training: {cfg.steps} steps x {cfg.batch_size} context positions x {cfg.draft_len} draft steps, {cfg.labels} labels,
  AdamW lr {cfg.lr} (warmup {cfg.warmup}, cosine to {cfg.min_lr_ratio}), weight decay {cfg.weight_decay}, dropout
  {cfg.input_dropout}, feature noise {cfg.feature_noise}, head {head};
  {summary.get('train_time_s')} s on {platform.machine()} ({platform.processor() or 'cpu'}).
- Time per stage: features {timings.get('features_s')} s, training {timings.get('train_s')} s.
- Held-out (teacher-forced) top-1 accuracy per draft step: {final.get('acc')}; loss {final.get('val_loss')}.
{extra}
Reproduce: `make train`; measure: `redrafter-mlx eval-drafter`.
"""
