"""The ReDrafter draft head (Apple's checkpoint format) and its loading/saving.

Forward for one beam-search step, with h = the target's post-norm hidden state (H) and s = RNN state (H):
    s' = SiLU(rnn_w · E(token) + rnn_u · s + b)        (rnn = false: s' = s + E(token))
    logits = lm_head[N](ResBlock^N(input_proj([h ; s'])))

Format extension (a superset of Apple's; documented in README): `draft_vocab_size` = K in config.json and a
`draft_vocab` int32 tensor (K,) of token ids; the vocab projection `lm_head.{N}.weight` is then (K, E) and
predicts only those tokens (a frequent-token head, as in FR-Spec). Apple-format checkpoints load unchanged.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .errors import UserError

MODEL_TYPE = "recurrent_drafting_drafter"


@dataclass
class DrafterArgs:
    vocab_size: int
    hidden_size: int
    exit_dim: int
    num_draft_layers: int
    rnn: bool = True
    emb_norm: bool = False
    num_lookback_tokens: int = 1
    model_type: str = MODEL_TYPE
    draft_vocab_size: int | None = None  # extension: head over a token subset
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> DrafterArgs:
        known = {f for f in cls.__dataclass_fields__ if f != "extra"}
        missing = [k for k in ("vocab_size", "hidden_size", "exit_dim", "num_draft_layers") if k not in cfg]
        if missing:
            raise UserError(f"drafter config.json lacks {', '.join(missing)}")
        return cls(**{k: v for k, v in cfg.items() if k in known},
                   extra={k: v for k, v in cfg.items() if k not in known})

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k != "extra"}
        if d["draft_vocab_size"] is None:
            del d["draft_vocab_size"]
        return {**self.extra, **d}


class ResBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, dim, bias=True)

    def __call__(self, x: mx.array) -> mx.array:
        return x + nn.silu(self.linear(x))


class Drafter(nn.Module):
    def __init__(self, args: DrafterArgs):
        super().__init__()
        self.args = args
        H, E = args.hidden_size, args.exit_dim
        if E != 2 * H:
            self.input_proj = nn.Linear(2 * H, E, bias=True)
        head_rows = args.draft_vocab_size or args.vocab_size
        self.lm_head = [ResBlock(E) for _ in range(args.num_draft_layers)] + [nn.Linear(E, head_rows, bias=False)]
        if args.rnn:
            self.rnn_u = nn.Linear(H, H, bias=True)
            self.rnn_w = nn.Linear(H, H, bias=False)
        if args.emb_norm:
            self.emb_norm = nn.RMSNorm(H)  # part of the format; unused in the forward, as in the reference
        if args.draft_vocab_size:
            self.draft_vocab = mx.arange(args.draft_vocab_size, dtype=mx.int32)

    def next_state(self, state: mx.array, token_emb: mx.array) -> mx.array:
        """RNN update with the embedding of the last drafted token: (..., H) -> (..., H)."""
        if self.args.rnn:
            return nn.silu(self.rnn_w(token_emb) + self.rnn_u(state))
        return state + token_emb

    def logits(self, context: mx.array, state: mx.array) -> mx.array:
        """Head logits from [context ; state]: (..., 2H) -> (..., K) (K = vocab or draft vocab)."""
        x = mx.concatenate([context, state], axis=-1)
        if "input_proj" in self:
            x = self.input_proj(x)
        for layer in self.lm_head:
            x = layer(x)
        return x

    def token_ids(self, head_index: mx.array) -> mx.array:
        """Map head output indices to target token ids (identity for a full-vocab head)."""
        return self.draft_vocab[head_index] if self.args.draft_vocab_size else head_index

    def num_params(self) -> int:
        from mlx.utils import tree_flatten

        return sum(v.size for k, v in tree_flatten(self.parameters()) if k != "draft_vocab")


def check_compatible(args: DrafterArgs, hidden_size: int, vocab_size: int, where: str) -> None:
    """One-line error if a drafter does not fit the target's hidden size and vocabulary."""
    if args.hidden_size != hidden_size:
        raise UserError(
            f"drafter {where} has hidden_size {args.hidden_size} but the target model has {hidden_size}: "
            f"use a drafter trained for this model"
        )
    if args.vocab_size != vocab_size:
        raise UserError(
            f"drafter {where} has vocab_size {args.vocab_size} but the target model has {vocab_size}: "
            f"use a drafter trained for this model"
        )


def random_drafter(hidden_size: int, vocab_size: int, seed: int, exit_dim: int | None = None,
                   num_draft_layers: int = 2, rnn: bool = True, draft_vocab_size: int | None = None,
                   dtype: mx.Dtype = mx.float32) -> Drafter:
    """A randomly initialised drafter of the given shape (for exactness tests and smoke runs).

    With `draft_vocab_size` = K the head drafts over K random distinct token ids (cheaper drafting)."""
    mx.random.seed(seed)
    args = DrafterArgs(vocab_size=vocab_size, hidden_size=hidden_size, exit_dim=exit_dim or 2 * hidden_size,
                       num_draft_layers=num_draft_layers, rnn=rnn, draft_vocab_size=draft_vocab_size)
    d = Drafter(args)
    if draft_vocab_size:
        d.draft_vocab = mx.sort(mx.random.permutation(vocab_size)[:draft_vocab_size]).astype(mx.int32)
    _cast_floats(d, dtype)
    mx.eval(d.parameters())
    return d


def _find_weights(path: Path) -> Path:
    for name in ("model.safetensors", "drafter.safetensors"):
        if (path / name).exists():
            return path / name
    files = sorted(path.glob("*.safetensors"))
    if not files:
        if any(path.glob("*.bin")) or any(path.glob("*.pt")):
            raise UserError(f"{path} holds PyTorch weights: convert them with `python -m convert.from_torch {path}`")
        raise UserError(f"drafter directory {path} has no model.safetensors")
    return files[0]


def load_drafter(path: str | Path, dtype: mx.Dtype = mx.float32) -> Drafter:
    """Load a drafter directory (config.json + model.safetensors) or a .safetensors with config.json beside it."""
    p = Path(path).expanduser()
    if not p.exists():
        raise UserError(f"drafter {path} does not exist (give a directory with config.json + model.safetensors)")
    folder = p if p.is_dir() else p.parent
    weights_file = _find_weights(p) if p.is_dir() else p
    cfg_file = folder / "config.json"
    if not cfg_file.exists():
        raise UserError(f"drafter {path}: config.json is missing next to the weights")
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"drafter config {cfg_file} is not valid JSON ({e.msg} at line {e.lineno})") from None
    if cfg.get("model_type", MODEL_TYPE) != MODEL_TYPE:
        raise UserError(f"{cfg_file} is a {cfg.get('model_type')!r} config, not a ReDrafter drafter")
    args = DrafterArgs.from_dict(cfg)
    try:
        weights = mx.load(str(weights_file))
    except Exception as e:
        raise UserError(f"cannot read drafter weights {weights_file}: {str(e).splitlines()[0]}") from None
    drafter = Drafter(args)
    try:
        drafter.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        detail = str(e).splitlines()[0]
        raise UserError(f"drafter weights {weights_file} do not match its config.json: {detail}") from None
    if args.draft_vocab_size:
        drafter.draft_vocab = drafter.draft_vocab.astype(mx.int32)
    _cast_floats(drafter, dtype)
    mx.eval(drafter.parameters())
    return drafter


def _cast_floats(drafter: Drafter, dtype: mx.Dtype) -> None:
    drafter.apply(lambda x: x.astype(dtype) if mx.issubdtype(x.dtype, mx.floating) else x)


def save_drafter(drafter: Drafter, out_dir: str | Path, extra_files: dict[str, str] | None = None) -> Path:
    """Write config.json + model.safetensors atomically (temp dir, then rename)."""
    from mlx.utils import tree_flatten

    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(drafter.args.to_dict(), indent=2) + "\n")
        mx.save_safetensors(str(tmp / "model.safetensors"), dict(tree_flatten(drafter.parameters())),
                            metadata={"format": "mlx"})
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
        tmp.chmod(0o755)  # mkdtemp creates 0700
        if out.exists():
            backup = out.with_name(f".{out.name}.old")
            shutil.rmtree(backup, ignore_errors=True)
            os.replace(out, backup)
            os.replace(tmp, out)
            shutil.rmtree(backup, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
