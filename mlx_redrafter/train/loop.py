"""The drafter training loop: AdamW, warmup + cosine, resumable checkpoints, held-out evaluation."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from mlx_redrafter.draft.head_rows import grow_head
from mlx_redrafter.draft.kinds import load_any_drafter
from mlx_redrafter.draft.redrafter import (
    MODEL_TYPE,
    Drafter,
    DrafterArgs,
    check_compatible,
    save_drafter,
)
from mlx_redrafter.errors import UserError
from mlx_redrafter.files import read_json
from mlx_redrafter.models.loader import Target
from mlx_redrafter.models.safetensors_header import read_header
from mlx_redrafter.train.config import TrainConfig
from mlx_redrafter.train.data import Batch, Examples, draft_vocabulary, make_batch
from mlx_redrafter.train.kinds import kind_of, new_head_drafter
from mlx_redrafter.train.loss import cross_entropy, hard_loss, soft_loss, teacher_forced_logits


def lr_schedule(cfg: TrainConfig) -> Callable:
    """Linear warmup then cosine decay to min_lr_ratio * lr."""
    warm = optim.linear_schedule(cfg.lr * 0.01, cfg.lr, max(cfg.warmup, 1))
    cos = optim.cosine_decay(cfg.lr, max(cfg.steps - cfg.warmup, 1), end=cfg.lr * cfg.min_lr_ratio)
    return optim.join_schedules([warm, cos], [max(cfg.warmup, 1)])


def new_drafter(target: Target, cfg: TrainConfig, draft_vocab: np.ndarray) -> Drafter:
    """A fresh drafter of `cfg.kind` for `target`; with init_from_target its head starts as the target's own output
    rows."""
    if cfg.kind != "redrafter":
        return new_head_drafter(target, cfg, draft_vocab)
    margs = target.model.args
    H, V = margs.hidden_size, margs.vocab_size
    mx.random.seed(cfg.seed)
    args = DrafterArgs(vocab_size=V, hidden_size=H, exit_dim=cfg.exit_dim, num_draft_layers=cfg.num_draft_layers,
                       rnn=True, draft_vocab_size=len(draft_vocab))
    d = with_feature_layers(Drafter(args), cfg.feature_layers)
    d.draft_vocab = mx.array(draft_vocab, dtype=mx.int32)
    if cfg.init_from_target and cfg.exit_dim == H:
        d.input_proj.weight = mx.concatenate([mx.eye(H), mx.zeros((H, H))], axis=1)
        d.input_proj.bias = mx.zeros((H,))
        for blk in d.lm_head[:-1]:
            blk.linear.weight = mx.zeros_like(blk.linear.weight)
            blk.linear.bias = mx.zeros_like(blk.linear.bias)
        d.lm_head[-1].weight = target.model.output_weight()[d.draft_vocab].astype(mx.float32)
    d.set_dtype(mx.float32)
    d.draft_vocab = d.draft_vocab.astype(mx.int32)
    mx.eval(d.parameters())
    return d


def with_feature_layers(drafter: Drafter, layers: tuple[int, ...]) -> Drafter:
    """`drafter`, reading target `layers` besides the last where it read the last alone: a `fuse` projection of
    [last state ; tapped states] to its context that starts as [I, 0, ..., 0], so that it drafts what it did until
    training moves it. A drafter that already fuses layers must fuse these (UserError otherwise)."""
    have = tuple(drafter.args.feature_layers or ())
    if not layers or have == tuple(layers):
        return drafter
    if have:
        raise UserError(f"the drafter reads target layers {list(have)}, not {list(layers)}: leave --feature-layers "
                        f"out to train it on its own, or start from a drafter that reads the last layer alone")
    H = drafter.args.hidden_size
    drafter.args.feature_layers = list(layers)
    drafter.fuse = nn.Linear(H * (1 + len(layers)), H, bias=False)
    drafter.fuse.weight = mx.concatenate([mx.eye(H), mx.zeros((H, H * len(layers)))], axis=1)
    return drafter


def check_head_rows(rows: int, have: int | None, vocab_size: int) -> None:
    """One-line UserError unless a head of `have` draft-vocabulary rows (None: the whole vocabulary) of a
    `vocab_size`-token vocabulary can grow to `rows`."""
    if not have:
        raise UserError("--head-rows needs a drafter whose head has a draft vocabulary (draft_vocab_size)")
    if not have <= rows <= vocab_size:
        raise UserError(f"--head-rows must be from the {have} rows the drafter's head has (a head only grows) to its "
                        f"vocabulary's {vocab_size} (got {rows})")


def with_head_rows(drafter: Drafter, rows: int, train: Examples, target: Target) -> Drafter:
    """`drafter` with its head grown to `rows` rows by the target decisions of `train` it lacks, most frequent first
    (`draft.head_rows.grow_head`); one-line UserError for a head without a draft vocabulary or with more rows."""
    check_head_rows(rows, drafter.args.draft_vocab_size, drafter.args.vocab_size)
    head = drafter.lm_head[-1]
    if "scales" in head:
        raise UserError("--head-rows grows a float head, and this drafter's is quantized: start from a float one")
    counts = np.bincount(train.top_ids[:, 0], minlength=drafter.args.vocab_size)
    w, vocab = grow_head(np.array(head.weight.astype(mx.float32)), np.array(drafter.draft_vocab), np.array(
        target.model.output_weight().astype(mx.float32)), counts, rows)
    head.weight = mx.array(w).astype(head.weight.dtype)
    drafter.draft_vocab = mx.array(vocab, dtype=mx.int32)
    drafter.args.draft_vocab_size = rows
    mx.eval(head.weight, drafter.draft_vocab)
    return drafter


def planned_layers(cfg: TrainConfig, run_dir: str | Path, resume: bool) -> tuple[int, ...]:
    """The target layers the drafter `train_drafter` trains will fuse (the features must hold them): those of the
    checkpoint it resumes, else `cfg.feature_layers`, else those of the `init_from` drafter."""
    asked = tuple(cfg.feature_layers)
    ckpt = Path(run_dir) / "checkpoint" / "config.json"
    if resume and ckpt.with_name("trainer_state.json").exists() and ckpt.exists():
        has = tuple(read_json(ckpt, "drafter config").get("feature_layers") or ())
        if asked and asked != has:
            raise UserError(f"{ckpt.parent} holds a drafter that reads target layers {list(has) or 'none'} besides "
                            f"the last, not {list(asked)}: leave --feature-layers out to resume it, or use another "
                            f"--run-dir (or --restart)")
        return has
    if not cfg.init_from:
        return asked
    start = read_json(Path(cfg.init_from) / "config.json", "drafter config")
    if asked and start.get("model_type", MODEL_TYPE) != MODEL_TYPE:
        raise UserError(f"--feature-layers is for recurrent drafters, and --init-from {cfg.init_from} holds a "
                        f"{start.get('model_type')} drafter: leave --feature-layers out")
    has = tuple(start.get("feature_layers") or ())
    if asked and has and asked != has:
        raise UserError(f"--init-from {cfg.init_from} reads target layers {list(has)}, not {list(asked)}: leave "
                        f"--feature-layers out to train it on its own, or start from a drafter that reads the last "
                        f"layer alone")
    return asked or has


def head_lut(drafter: Drafter, vocab_size: int) -> np.ndarray:
    """token id -> head index (-1 for tokens the head cannot draft)."""
    lut = np.full(vocab_size, -1, dtype=np.int32)
    ids = np.array(drafter.draft_vocab) if drafter.args.draft_vocab_size else np.arange(vocab_size)
    lut[ids] = np.arange(len(ids), dtype=np.int32)
    return lut


def evaluate(drafter: Drafter, embed: Callable, ex: Examples, lut: np.ndarray, T: int, n: int = 4096,
             batch: int = 512, seed: int = 1) -> dict:
    """Held-out loss and per-step top-1 accuracy (teacher forced; tokens outside the head count wrong)."""
    rng = np.random.default_rng(seed)
    idx = rng.choice(len(ex), size=min(n, len(ex)), replace=False)
    correct, count = np.zeros(T), np.zeros(T)
    loss_sum = wsum = 0.0
    for b0 in range(0, len(idx), batch):
        b = make_batch(ex, np.sort(idx[b0 : b0 + batch]), T, lut)
        logits = teacher_forced_logits(drafter, b.h, embed(b.x_in))
        ce = cross_entropy(logits, b.target)
        hit = (mx.argmax(logits, axis=-1) == b.target).astype(mx.float32) * b.weight
        mx.eval(ce, hit)
        loss_sum += float((ce * b.weight).sum())
        wsum += float(b.weight.sum())
        correct += np.array(hit.sum(axis=0))
        count += np.array(b.valid.sum(axis=0))
    acc = correct / np.maximum(count, 1)
    return {"val_loss": round(loss_sum / max(wsum, 1.0), 4), "acc": [round(float(a), 4) for a in acc]}


def _save_checkpoint(run_dir: Path, drafter: Drafter, opt: optim.Optimizer, step: int, cfg: TrainConfig,
                     history: list) -> None:
    """Weights, optimizer state and step as one unit: a complete new directory, then `run_dir/checkpoint` (a
    symlink) swapped to it atomically; an interruption at any point leaves the previous checkpoint intact."""
    import os
    import shutil

    from mlx_redrafter.files import fsync_tree

    folder = run_dir / f"ckpt-{step:07d}"
    save_drafter(drafter, folder, extra_files={
        "trainer_state.json": json.dumps({"step": step, "config": asdict(cfg), "history": history}, indent=1),
    })
    mx.save_safetensors(str(folder / "optimizer.safetensors"), dict(tree_flatten(opt.state)))
    fsync_tree(folder)
    link, tmp = run_dir / "checkpoint", run_dir / ".checkpoint.new"
    if link.is_dir() and not link.is_symlink():  # a checkpoint directory written by an older version
        os.replace(link, run_dir / "ckpt-legacy")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(folder.name)
    os.replace(tmp, link)
    fsync_tree(run_dir, files=False)
    for old in run_dir.glob("ckpt-*"):
        if old.name != folder.name:
            shutil.rmtree(old, ignore_errors=True)


def train_drafter(target: Target, train: Examples, heldout: Examples, run_dir: str | Path,
                  cfg: TrainConfig | None = None, *, resume: bool = True, progress: bool = True,
                  log: Callable[[str], None] = print) -> tuple[Drafter, dict]:
    """Train (or resume) a drafter; checkpoints in run_dir/checkpoint. Returns the drafter and a summary."""
    cfg = (cfg or TrainConfig()).check()
    if len(train) == 0:
        raise UserError("the corpus has no context positions to train on")
    run_dir = Path(run_dir)
    ckpt = run_dir / "checkpoint"
    margs = target.model.args
    layers = planned_layers(cfg, run_dir, resume)
    if layers != train.layers or layers != heldout.layers:
        raise UserError(f"the drafter reads target layers {list(layers) or 'none'} besides the last, but the features "
                        f"hold {list(train.layers) or 'none'}: prepare them for its layers (planned_layers)")
    T = cfg.draft_len
    opt = optim.AdamW(learning_rate=lr_schedule(cfg), weight_decay=cfg.weight_decay)
    start, history = 0, []
    if resume and (ckpt / "trainer_state.json").exists():
        drafter = load_any_drafter(ckpt)
        check_compatible(drafter.args, margs.hidden_size, margs.vocab_size, str(ckpt))
        if kind_of(drafter) != cfg.kind:
            raise UserError(f"{ckpt} holds a {kind_of(drafter)} drafter, not {cfg.kind}: use another --run-dir, or "
                            f"--restart to start over there")
        st = read_json(ckpt / "trainer_state.json", "training state")
        if type(st.get("step")) is not int or not 0 <= st["step"] or not isinstance(st.get("history", []), list):
            raise UserError(f"{ckpt / 'trainer_state.json'} has no valid step: delete the checkpoint, or --restart")
        start, history = st["step"], st.get("history", [])
        if not (ckpt / "optimizer.safetensors").exists():
            raise UserError(f"{ckpt} is incomplete (no optimizer.safetensors): delete it, or pass --restart")
        opt.init(drafter.trainable_parameters())
        read_header(ckpt / "optimizer.safetensors", "optimizer state")
        opt.state = tree_unflatten(list(mx.load(str(ckpt / "optimizer.safetensors")).items()))
        log(f"resumed from {ckpt} at step {start}")
    elif cfg.init_from:
        drafter = load_any_drafter(cfg.init_from)
        check_compatible(drafter.args, margs.hidden_size, margs.vocab_size, cfg.init_from)
        if kind_of(drafter) == "redrafter":  # (planned_layers refused feature layers for the other kinds)
            drafter = with_feature_layers(drafter, cfg.feature_layers)
            if cfg.head_rows is not None:
                drafter = with_head_rows(drafter, cfg.head_rows, train, target)
                log(f"head grown to {drafter.args.draft_vocab_size} rows")
        log(f"starting from the weights of {cfg.init_from}")
    else:
        vocab = draft_vocabulary(train, cfg.draft_vocab_size, margs.vocab_size, target.tokenizer.eos_ids)
        drafter = new_drafter(target, cfg, vocab)
    check_compatible(drafter.args, margs.hidden_size, margs.vocab_size, "being trained", margs.num_hidden_layers)
    if drafter.args.draft_vocab_size:
        drafter.freeze(keys=["draft_vocab"])
    if cfg.freeze_head:
        drafter.lm_head[-1].freeze()
    if cfg.head_only:
        drafter.freeze()
        drafter.lm_head[-1].unfreeze()
    lut = head_lut(drafter, margs.vocab_size)
    coverage, heldout_coverage = (float((lut[ex.top_ids[:, 0]] >= 0).mean()) if len(ex) else 0.0
                                  for ex in (train, heldout))  # shares of the target's decisions the head can draft
    log(f"data: {train.sequences} train / {heldout.sequences} held-out sequences, {len(train)} context positions; "
        f"head K={drafter.args.draft_vocab_size or margs.vocab_size} covers {coverage:.1%} of the target's decisions "
        f"({heldout_coverage:.1%} held out); drafter {drafter.num_params() / 1e6:.2f}M params")
    def embed(x: mx.array) -> mx.array:
        return target.model.embed(x).astype(mx.float32)

    soft = cfg.labels == "soft"

    def loss_fn(model: Drafter, h, emb_in, target_ids, weight, valid, soft_index, soft_prob) -> mx.array:
        logits = teacher_forced_logits(model, h, emb_in)
        b = Batch(h, emb_in, target_ids, weight, valid, soft_index, soft_prob)
        return soft_loss(logits, b) if soft else hard_loss(logits, b)

    loss_and_grad = nn.value_and_grad(drafter, loss_fn)
    state = [drafter.state, opt.state, mx.random.state]
    keep = 1.0 - cfg.input_dropout

    def dropout(x: mx.array) -> mx.array:
        return x * mx.random.bernoulli(keep, x.shape) / keep if cfg.input_dropout > 0 else x

    def noise(h: mx.array) -> mx.array:
        a = cfg.feature_noise
        return h + mx.random.uniform(-a, a, h.shape) if a > 0 else h

    @partial(mx.compile, inputs=state, outputs=state)
    def step_fn(h, x_in, target_ids, weight, valid, soft_index, soft_prob):
        loss, grads = loss_and_grad(drafter, dropout(noise(h)), dropout(embed(x_in)), target_ids, weight, valid,
                                    soft_index, soft_prob)
        grads, norm = optim.clip_grad_norm(grads, cfg.grad_clip)
        opt.update(drafter, grads)
        return loss, norm

    rng = np.random.default_rng(cfg.seed + start)
    t0 = time.perf_counter()
    losses: list[float] = []
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, initial=start, desc="train", dynamic_ncols=True)
    if start == 0 and cfg.steps > 0:  # where the drafter starts from (a warm start's own held-out measure)
        history.append({"step": 0, "positions_seen": 0, "elapsed_s": 0.0, **evaluate(drafter, embed, heldout, lut, T)})
        log(json.dumps(history[-1]))
    for step in range(start, cfg.steps):
        idx = np.sort(rng.integers(0, len(train), size=cfg.batch_size))  # sorted: fewer page-ins per shard
        b = make_batch(train, idx, T, lut, soft=soft)
        none = mx.zeros((1,))
        loss, _ = step_fn(b.h, b.x_in, b.target, b.weight, b.valid, b.soft_index if soft else none,
                          b.soft_prob if soft else none)
        mx.eval(loss, state)
        losses.append(loss.item())
        done = step + 1
        if bar is not None:
            bar.update(1)
            if done % 10 == 0:
                bar.set_postfix(loss=f"{np.mean(losses[-10:]):.3f}")
        if done % cfg.eval_every == 0 or done == cfg.steps:
            rec = {"step": done, "train_loss": round(float(np.mean(losses[-cfg.eval_every:])), 4),
                   "positions_seen": done * cfg.batch_size, "elapsed_s": round(time.perf_counter() - t0, 1),
                   **evaluate(drafter, embed, heldout, lut, T)}
            history.append(rec)
            log(json.dumps(rec))
        if done % cfg.checkpoint_every == 0 or done == cfg.steps:
            _save_checkpoint(run_dir, drafter, opt, done, cfg, history)
    if bar is not None:
        bar.close()
    summary = {"config": asdict(cfg), "train_time_s": round(time.perf_counter() - t0, 1),
               "train_sequences": train.sequences, "train_contexts": len(train),
               "heldout_sequences": heldout.sequences, "head_coverage": round(coverage, 4),
               "head_coverage_heldout": round(heldout_coverage, 4),
               "params": drafter.num_params(), "history": history,
               "shape": {k: getattr(drafter.args, k, None) for k in ("exit_dim", "num_draft_layers",
                                                                     "draft_vocab_size", "feature_layers")},
               "final": history[-1] if history else evaluate(drafter, embed, heldout, lut, T)}
    return drafter, summary
