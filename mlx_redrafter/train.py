"""Train a ReDrafter drafter on self-distillation shards (see distill.py), in MLX.

For a context position p with the frozen target's post-norm hidden state h_p and T draft steps:
    s_0 = 0;  s_j = rnn(E(x_{p+j}), s_{j-1});  logits_j = head([h_p ; s_j])  ->  cross-entropy vs x_{p+1+j}
which is exactly what beam_search.py runs at inference (h at the last accepted position, g0 = x_{p+1} from the
target, draft step j consumes the previous token and predicts the next). Context positions are the last prompt
position and every response position; windows that run past the end of a sequence are masked.

The head may predict over a subset of K frequent token ids (`draft_vocab`); targets outside the subset are left
out of the loss and always count as wrong in the accuracy.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from .distill import Shard, load_shard
from .drafter import Drafter, DrafterArgs, check_compatible, load_drafter, save_drafter
from .errors import UserError
from .loader import Target


@dataclass
class TrainConfig:
    """Drafter shape and optimisation settings (the defaults reproduce the shipped drafter)."""

    exit_dim: int = 576
    num_draft_layers: int = 2
    draft_vocab_size: int = 8192
    draft_len: int = 5  # T: drafted tokens trained per context position
    steps: int = 1200
    batch_size: int = 256  # context positions per step (x T predictions)
    lr: float = 1e-3
    min_lr_ratio: float = 0.05
    warmup: int = 50
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    val_fraction: float = 0.03
    eval_every: int = 200
    checkpoint_every: int = 200
    seed: int = 0
    init_from_target: bool = True  # head = target's (tied) unembedding rows, input_proj = [I 0]
    input_dropout: float = 0.0  # training-only dropout on h and the token embeddings (fights memorisation)


@dataclass
class Dataset:
    """All shards in memory: token stream, hidden states and the context positions to train on."""

    tokens: np.ndarray  # (N,) int32 all sequences concatenated
    hidden: np.ndarray  # (M, H) float16
    tok_index: np.ndarray  # (P,) index into tokens of context position p
    hid_index: np.ndarray  # (P,) index into hidden of h_p
    seq_end: np.ndarray  # (P,) index into tokens one past the end of p's sequence
    response_tokens: int
    num_sequences: int


def _positions(shards: list[Shard]) -> Dataset:
    toks, hids, ti, hi, ends = [], [], [], [], []
    t_base = h_base = 0
    n_resp = n_seq = 0
    for sh in shards:
        toks.append(sh.tokens)
        hids.append(sh.hidden)
        for i in range(sh.num_sequences):
            start, end = int(sh.offsets[i]), int(sh.offsets[i + 1])
            n, pl = end - start, int(sh.prompt_len[i])
            h_start = start - i  # each sequence stores n-1 hidden states
            p = np.arange(pl - 1, n - 2)  # context positions with at least one draft target
            ti.append(t_base + start + p)
            hi.append(h_base + h_start + p)
            ends.append(np.full(len(p), t_base + end))
            n_resp += n - pl
        n_seq += sh.num_sequences
        t_base += len(sh.tokens)
        h_base += len(sh.hidden)

    def cat(xs: list, dt: type) -> np.ndarray:
        return np.concatenate(xs).astype(dt) if xs else np.zeros(0, dt)

    return Dataset(tokens=np.concatenate(toks).astype(np.int32), hidden=np.concatenate(hids, axis=0),
                   tok_index=cat(ti, np.int64), hid_index=cat(hi, np.int64), seq_end=cat(ends, np.int64),
                   response_tokens=n_resp, num_sequences=n_seq)


def load_dataset(paths: list[Path], val_fraction: float = 0.03) -> tuple[Dataset, Dataset]:
    """(train, held-out) datasets from shard files; the held-out part is the last sequences of the last shard."""
    if not paths:
        raise UserError("no distillation shards to train on: generate data first")
    shards = [load_shard(p) for p in paths]
    sh = shards[-1]
    total = sum(s.num_sequences for s in shards)
    n_val = min(max(1, round(total * val_fraction)), sh.num_sequences - 1 if len(shards) == 1 else sh.num_sequences)
    if n_val <= 0:  # a single one-sequence shard: evaluate on the training data
        return _positions(shards), _positions(shards)
    k = sh.num_sequences - n_val
    cut_t, cut_h = int(sh.offsets[k]), int(sh.offsets[k]) - k
    a = Shard(sh.tokens[:cut_t], sh.offsets[: k + 1], sh.prompt_len[:k], sh.hidden[:cut_h])
    b = Shard(sh.tokens[cut_t:], sh.offsets[k:] - cut_t, sh.prompt_len[k:], sh.hidden[cut_h:])
    return _positions(shards[:-1] + ([a] if k > 0 else [])), _positions([b])


def draft_vocabulary(ds: Dataset, k: int, vocab_size: int, always: list[int]) -> np.ndarray:
    """The k most frequent token ids in the training token stream (`always` ids included), int32."""
    counts = np.bincount(ds.tokens, minlength=vocab_size).astype(np.float64)
    counts[np.asarray(always, dtype=np.int64)] = np.inf
    k = min(k, vocab_size)
    return np.argsort(-counts, kind="stable")[:k].astype(np.int32)


def make_batch(ds: Dataset, idx: np.ndarray, T: int, lut: np.ndarray) -> tuple[mx.array, ...]:
    """Gather (h (B,H) f32, input ids (B,T), head targets (B,T), weights (B,T)) for context samples `idx`."""
    t0 = ds.tok_index[idx]
    ks = np.arange(1, T + 2)
    where = t0[:, None] + ks[None, :]  # x_{p+1} .. x_{p+T+1}
    valid = where < ds.seq_end[idx][:, None]
    x = ds.tokens[np.minimum(where, len(ds.tokens) - 1)]
    tgt_ids = x[:, 1:]
    head = lut[tgt_ids]
    w = valid[:, 1:] & (head >= 0)
    h = ds.hidden[ds.hid_index[idx]]
    return (mx.array(h.astype(np.float32)), mx.array(x[:, :-1]), mx.array(np.maximum(head, 0)),
            mx.array(w.astype(np.float32)), mx.array(valid[:, 1:].astype(np.float32)))


def drafter_logits(drafter: Drafter, h: mx.array, emb_in: mx.array) -> mx.array:
    """Head logits (B, T, K) for contexts h (B, H) and input embeddings (B, T, H), unrolling the RNN."""
    B, T, H = emb_in.shape
    s = mx.zeros((B, H), dtype=h.dtype)
    states = []
    for j in range(T):
        s = drafter.next_state(s, emb_in[:, j])
        states.append(s)
    S = mx.stack(states, axis=1)
    return drafter.logits(mx.broadcast_to(h[:, None, :], S.shape), S)


def loss_fn(drafter: Drafter, h: mx.array, emb_in: mx.array, tgt: mx.array, w: mx.array) -> mx.array:
    """Mean cross-entropy over the weighted draft targets."""
    logits = drafter_logits(drafter, h, emb_in)
    ce = nn.losses.cross_entropy(logits, tgt, reduction="none")
    return (ce * w).sum() / mx.maximum(w.sum(), 1.0)


def new_drafter(target: Target, cfg: TrainConfig, draft_vocab: np.ndarray) -> Drafter:
    """A fresh drafter for `target`; with init_from_target the head starts as the target's own unembedding."""
    margs = target.model.args
    H, V = margs.hidden_size, margs.vocab_size
    mx.random.seed(cfg.seed)
    args = DrafterArgs(vocab_size=V, hidden_size=H, exit_dim=cfg.exit_dim, num_draft_layers=cfg.num_draft_layers,
                       rnn=True, draft_vocab_size=len(draft_vocab))
    d = Drafter(args)
    d.draft_vocab = mx.array(draft_vocab, dtype=mx.int32)
    if cfg.init_from_target and cfg.exit_dim == H and margs.tie_word_embeddings:
        emb = target.model.model.embed_tokens
        if "weight" in emb and emb.weight.dtype in (mx.float32, mx.float16, mx.bfloat16):
            d.input_proj.weight = mx.concatenate([mx.eye(H), mx.zeros((H, H))], axis=1)
            d.input_proj.bias = mx.zeros((H,))
            for blk in d.lm_head[:-1]:
                blk.linear.weight = mx.zeros_like(blk.linear.weight)
                blk.linear.bias = mx.zeros_like(blk.linear.bias)
            d.lm_head[-1].weight = emb.weight[d.draft_vocab].astype(mx.float32)
    d.set_dtype(mx.float32)
    d.draft_vocab = d.draft_vocab.astype(mx.int32)
    mx.eval(d.parameters())
    return d


def evaluate(drafter: Drafter, embed: Callable, ds: Dataset, lut: np.ndarray, T: int,
             n: int = 2048, batch: int = 512, seed: int = 1) -> dict:
    """Held-out loss and per-position top-1 accuracy (teacher forced; tokens outside the head count wrong)."""
    rng = np.random.default_rng(seed)
    idx = rng.choice(len(ds.tok_index), size=min(n, len(ds.tok_index)), replace=False)
    correct = np.zeros(T)
    count = np.zeros(T)
    loss_sum = wsum = 0.0
    for b in range(0, len(idx), batch):
        h, x_in, tgt, w, valid = make_batch(ds, idx[b : b + batch], T, lut)
        logits = drafter_logits(drafter, h, embed(x_in))
        ce = nn.losses.cross_entropy(logits, tgt, reduction="none")
        hit = (mx.argmax(logits, axis=-1) == tgt).astype(mx.float32) * w
        mx.eval(ce, hit)
        loss_sum += float((ce * w).sum())
        wsum += float(w.sum())
        correct += np.array(hit.sum(axis=0))
        count += np.array(valid.sum(axis=0))
    acc = correct / np.maximum(count, 1)
    return {"val_loss": loss_sum / max(wsum, 1.0), "acc": [round(float(a), 4) for a in acc]}


def lr_schedule(cfg: TrainConfig) -> Callable:
    """Linear warmup then cosine decay to min_lr_ratio * lr."""
    warm = optim.linear_schedule(cfg.lr * 0.01, cfg.lr, max(cfg.warmup, 1))
    cos = optim.cosine_decay(cfg.lr, max(cfg.steps - cfg.warmup, 1), end=cfg.lr * cfg.min_lr_ratio)
    return optim.join_schedules([warm, cos], [max(cfg.warmup, 1)])


def _save_checkpoint(ckpt: Path, drafter: Drafter, opt: optim.Optimizer, step: int, cfg: TrainConfig,
                     history: list) -> None:
    save_drafter(drafter, ckpt, extra_files={
        "trainer_state.json": json.dumps({"step": step, "config": asdict(cfg), "history": history}, indent=1),
    })
    tmp = ckpt.parent / (ckpt.name + ".optimizer.tmp.safetensors")
    mx.save_safetensors(str(tmp), dict(tree_flatten(opt.state)))
    tmp.replace(ckpt.parent / (ckpt.name + ".optimizer.safetensors"))


def train_drafter(
    target: Target,
    shard_paths: list[Path],
    run_dir: str | Path,
    cfg: TrainConfig | None = None,
    *,
    resume: bool = True,
    log: Callable[[str], None] = print,
) -> tuple[Drafter, dict]:
    """Train (or resume) a drafter; checkpoints go to run_dir/checkpoint. Returns the drafter and a summary."""
    cfg = cfg or TrainConfig()
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt = run_dir / "checkpoint"
    t_load = time.perf_counter()
    train_ds, val_ds = load_dataset(shard_paths, cfg.val_fraction)
    if len(train_ds.tok_index) == 0:
        raise UserError("the distillation data has no response positions to train on")
    margs = target.model.args
    T = cfg.draft_len
    opt = optim.AdamW(learning_rate=lr_schedule(cfg), weight_decay=cfg.weight_decay)
    start, history = 0, []
    if resume and (ckpt / "config.json").exists():
        drafter = load_drafter(ckpt)
        check_compatible(drafter.args, margs.hidden_size, margs.vocab_size, str(ckpt))
        st = json.loads((ckpt / "trainer_state.json").read_text())
        start, history = int(st["step"]), st.get("history", [])
        opt_file = run_dir / "checkpoint.optimizer.safetensors"
        if opt_file.exists():
            opt.init(drafter.trainable_parameters())
            opt.state = tree_unflatten(list(mx.load(str(opt_file)).items()))
        log(f"resumed from {ckpt} at step {start}")
    else:
        eos = target.tokenizer.eos_ids
        vocab = draft_vocabulary(train_ds, cfg.draft_vocab_size, margs.vocab_size, eos)
        drafter = new_drafter(target, cfg, vocab)
    drafter.freeze(keys=["draft_vocab"]) if drafter.args.draft_vocab_size else None
    K = drafter.args.draft_vocab_size or margs.vocab_size
    lut = np.full(margs.vocab_size, -1, dtype=np.int32)
    ids = np.array(drafter.draft_vocab) if drafter.args.draft_vocab_size else np.arange(margs.vocab_size)
    lut[ids] = np.arange(len(ids), dtype=np.int32)
    resp = train_ds.tokens  # coverage of the head over the training token stream
    coverage = float((lut[resp] >= 0).mean())
    log(f"data: {train_ds.num_sequences} train / {val_ds.num_sequences} held-out sequences, "
        f"{train_ds.response_tokens} response tokens, {len(train_ds.tok_index)} context positions "
        f"(loaded in {time.perf_counter() - t_load:.0f}s); head K={K} covers {coverage:.1%} of tokens; "
        f"drafter {drafter.num_params() / 1e6:.2f}M params")

    emb_table = target.model.model.embed_tokens

    def embed(x: mx.array) -> mx.array:
        return emb_table(x).astype(mx.float32)

    loss_and_grad = nn.value_and_grad(drafter, loss_fn)
    state = [drafter.state, opt.state, mx.random.state]
    keep = 1.0 - cfg.input_dropout

    def dropout(x: mx.array) -> mx.array:
        return x * mx.random.bernoulli(keep, x.shape) / keep if cfg.input_dropout > 0 else x

    @partial(mx.compile, inputs=state, outputs=state)
    def step_fn(h, x_in, tgt, w):
        loss, grads = loss_and_grad(drafter, dropout(h), dropout(embed(x_in)), tgt, w)
        grads, norm = optim.clip_grad_norm(grads, cfg.grad_clip)
        opt.update(drafter, grads)
        return loss, norm

    rng = np.random.default_rng(cfg.seed + start)
    t0 = time.perf_counter()
    losses: list[mx.array] = []
    from tqdm import tqdm

    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, desc="train", dynamic_ncols=True)
    step = start
    for step in bar:
        idx = rng.integers(0, len(train_ds.tok_index), size=cfg.batch_size)
        h, x_in, tgt, w, _ = make_batch(train_ds, idx, T, lut)
        loss, norm = step_fn(h, x_in, tgt, w)
        mx.eval(loss, norm, state)
        losses.append(loss)
        done = step + 1
        if done % 10 == 0:
            bar.set_postfix(loss=f"{float(mx.mean(mx.stack(losses[-10:]))):.3f}")
        if done % cfg.eval_every == 0 or done == cfg.steps:
            ev = evaluate(drafter, embed, val_ds, lut, T)
            rec = {"step": done, "train_loss": round(float(mx.mean(mx.stack(losses[-cfg.eval_every:]))), 4),
                   "positions_seen": done * cfg.batch_size, "elapsed_s": round(time.perf_counter() - t0, 1), **ev}
            history.append(rec)
            log(json.dumps(rec))
            with (run_dir / "history.jsonl").open("a") as f:
                f.write(json.dumps(rec) + "\n")
        if done % cfg.checkpoint_every == 0 or done == cfg.steps:
            _save_checkpoint(ckpt, drafter, opt, done, cfg, history)
    bar.close()
    summary = {
        "steps": cfg.steps, "train_time_s": round(time.perf_counter() - t0, 1),
        "train_sequences": train_ds.num_sequences, "train_response_tokens": train_ds.response_tokens,
        "val_sequences": val_ds.num_sequences, "head_coverage": round(coverage, 4),
        "params": drafter.num_params(), "history": history,
        "final": history[-1] if history else evaluate(drafter, embed, val_ds, lut, T),
    }
    return drafter, summary


def save_shipped(drafter: Drafter, out_dir: str | Path, model_card: str, float16: bool = True) -> Path:
    """Save the final drafter (float16 weights by default; loading casts to the target's dtype)."""
    if float16:
        drafter.apply(lambda x: x.astype(mx.float16) if mx.issubdtype(x.dtype, mx.floating) else x)
    try:
        return save_drafter(drafter, out_dir, extra_files={"MODEL_CARD.md": model_card})
    finally:
        if float16:
            drafter.apply(lambda x: x.astype(mx.float32) if mx.issubdtype(x.dtype, mx.floating) else x)


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Learning rate at a step (for logs)."""
    if step < cfg.warmup:
        return cfg.lr * (0.01 + 0.99 * step / max(cfg.warmup, 1))
    t = (step - cfg.warmup) / max(cfg.steps - cfg.warmup, 1)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))
