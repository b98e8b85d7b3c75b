"""The ReDrafter draft head (Apple's checkpoint format) and its loading/saving.

Forward for one beam-search step, with h = the target's post-norm hidden state (H) and s = RNN state (H):
    s' = SiLU(rnn_w · E(token) + rnn_u · s + b)        (rnn = false: s' = s + E(token))
    logits = lm_head[N](ResBlock^N(input_proj([h ; s'])))

Format extension `feature_layers` = [l1, l2, ...] (increasing target layer indices) with a `fuse.weight` tensor
(H, H * (1 + n)): the context is then h = fuse([h_last ; r(x_l1) ; r(x_l2) ; ...]), where x_l is the output of
target layer l and r(x) = x / RMS(x) (EAGLE-3's fusion of low, middle and high layer states). The target provides
those states once `read_features(model, drafter)` has set its `feature_layers`.

Format extension (a superset of Apple's; documented in README): `draft_vocab_size` = K in config.json and a
`draft_vocab` int32 tensor (K,) of token ids; the vocab projection `lm_head.{N}.weight` is then (K, E) and
predicts only those tokens (a frequent-token head, as in FR-Spec). Apple-format checkpoints load unchanged.

Quantized drafters (mlx-lm style): `quantization: {"bits": b, "group_size": g}` in config.json, every nn.Linear
(input_proj, the ResBlocks, the vocab projection, rnn_u / rnn_w) stored as `.weight` (uint32, packed) +
`.scales` + `.biases` (affine `mx.quantize`), other tensors unchanged. Apple's format has no equivalent.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlx_redrafter.draft.beam_search import BeamSource
from mlx_redrafter.draft.weight_copies import current_copy, linear
from mlx_redrafter.errors import UserError
from mlx_redrafter.files import fsync_tree, read_json
from mlx_redrafter.model import post_norm_state
from mlx_redrafter.models import safetensors_header
from mlx_redrafter.schema import MAX_DRAFT_LAYERS, MAX_VOCAB, MAX_WIDTH, Field, check_fields, shown
from mlx_redrafter.system.vector_math import silu
from mlx_redrafter.token_ids import check_id_array

MODEL_TYPE = "recurrent_drafting_drafter"
QUANT_BITS = (4, 8)
QUANT_GROUP_SIZES = (32, 64, 128)
# config.json keys with their types and ranges (absurd sizes are refused before any module is built).
FIELDS = (
    Field("vocab_size", int, 1, MAX_VOCAB, required=True),
    Field("hidden_size", int, 1, MAX_WIDTH, required=True),
    Field("exit_dim", int, 1, MAX_WIDTH, required=True),
    Field("num_draft_layers", int, 0, MAX_DRAFT_LAYERS, required=True),
    Field("rnn", bool),
    Field("emb_norm", bool),
    Field("num_lookback_tokens", int, 1, 64),
    Field("model_type", str),
    Field("draft_vocab_size", int, 1, MAX_VOCAB),
)
MAX_FEATURE_LAYERS = 8


@dataclass
class DrafterArgs:
    """A drafter's config.json: Apple's keys, plus our `draft_vocab_size` and `quantization` extensions."""

    vocab_size: int
    hidden_size: int
    exit_dim: int
    num_draft_layers: int
    rnn: bool = True
    emb_norm: bool = False
    num_lookback_tokens: int = 1
    model_type: str = MODEL_TYPE
    draft_vocab_size: int | None = None  # extension: head over a token subset
    feature_layers: list[int] | None = None  # extension: target layers fused into the context (`fuse`)
    quantization: dict[str, int] | None = None  # extension: {"bits": b, "group_size": g} (mlx-lm style)
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], where: str = "drafter config.json") -> DrafterArgs:
        """Args from a config dict checked against `FIELDS` (types, ranges; `where` names it in messages);
        unknown keys are kept in `extra`; a one-line UserError for a bad config."""
        check_fields(cfg, FIELDS, where)
        check_draft_vocab_size(cfg, where)
        check_feature_layers(cfg.get("feature_layers"), where)
        known = {f for f in cls.__dataclass_fields__ if f != "extra"}
        args = cls(**{k: v for k, v in cfg.items() if k in known and v is not None},
                   extra={k: v for k, v in cfg.items() if k not in known})
        if args.quantization is not None:
            q = args.quantization
            affine = isinstance(q, dict) and q.get("mode", "affine") == "affine"
            if not affine or set(q) - {"bits", "group_size", "mode"}:
                raise UserError(f"{where}: quantization = {shown(q)}: expected {{\"bits\": B, \"group_size\": G}}")
            args.check_quantization(q.get("bits"), q.get("group_size"))
            args.quantization = {"bits": q["bits"], "group_size": q["group_size"]}
        return args

    def to_dict(self) -> dict[str, Any]:
        """The config.json contents (optional extensions only when set)."""
        d = {k: v for k, v in asdict(self).items() if k != "extra"}
        for key in ("draft_vocab_size", "feature_layers", "quantization"):
            if d[key] is None:
                del d[key]
        return {**self.extra, **d}

    def check_quantization(self, bits: Any, group_size: Any) -> None:
        """One-line error unless every linear of this drafter can be quantized to `bits` with `group_size`."""
        check_quantization(bits, group_size)
        for name, dim in {"exit_dim": self.exit_dim, "hidden_size": self.hidden_size}.items():  # all input dims
            if dim % group_size:
                raise UserError(f"{name} {dim} is not a multiple of the quantization group size {group_size}: "
                                f"choose a group size that divides it")


def check_draft_vocab_size(cfg: dict[str, Any], where: str) -> None:
    """One-line error unless a (type-checked) drafter config's draft vocabulary fits in its vocabulary."""
    if (cfg.get("draft_vocab_size") or 0) > cfg["vocab_size"]:
        raise UserError(f"{where}: draft_vocab_size {cfg['draft_vocab_size']} is larger than vocab_size "
                        f"{cfg['vocab_size']}")


def check_feature_layers(layers: Any, where: str) -> None:
    """One-line error unless `feature_layers` is absent or a list of 1..MAX_FEATURE_LAYERS increasing layer indices
    (whether the target has them is `check_compatible`'s)."""
    if layers is None:
        return
    ok = (isinstance(layers, list) and 1 <= len(layers) <= MAX_FEATURE_LAYERS
          and all(type(i) is int and i >= 0 for i in layers) and all(a < b for a, b in zip(layers, layers[1:])))
    if not ok:
        raise UserError(f"{where}: feature_layers = {shown(layers)}: expected a list of 1 to {MAX_FEATURE_LAYERS} "
                        f"increasing target layer indices (integers >= 0), or no such key")


def check_quantization(bits: Any, group_size: Any) -> None:
    """One-line error unless `bits` and `group_size` are a supported quantization (QUANT_BITS, QUANT_GROUP_SIZES)."""
    if type(bits) is not int or bits not in QUANT_BITS:
        raise UserError(f"quantization bits = {bits!r} is not supported: choose {' or '.join(map(str, QUANT_BITS))}")
    if type(group_size) is not int or group_size not in QUANT_GROUP_SIZES:
        raise UserError(f"quantization group size = {group_size!r} is not supported: choose "
                        f"{', '.join(map(str, QUANT_GROUP_SIZES))}")


class ResBlock(nn.Module):
    """x + SiLU(W x + b)."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, dim, bias=True)

    def __call__(self, x: mx.array) -> mx.array:
        return x + silu(linear(self.linear, x))


class Drafter(nn.Module):
    """The ReDrafter head; its module structure (incl. quantized linears) is a function of `args` alone."""

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
        if args.feature_layers:
            self.fuse = nn.Linear(H * (1 + len(args.feature_layers)), H, bias=False)
        if args.quantization:  # lazy: the random weights quantized here are never computed once weights load
            _quantize_linears(self, args.quantization["bits"], args.quantization["group_size"])

    def context(self, hidden: mx.array) -> mx.array:
        """The context the head conditions on, from the target's `hidden` at the last accepted position: the
        post-norm state (..., H), or with `feature_layers` the fusion of it and the tapped layers'."""
        H = self.args.hidden_size
        if not self.args.feature_layers:
            return post_norm_state(hidden, H)
        if hidden.shape[-1] != H * (1 + len(self.args.feature_layers)):
            raise UserError(f"this drafter reads target layers {self.args.feature_layers} besides the last, but the "
                            f"hidden states it was given hold {hidden.shape[-1] // H - 1} tapped layer(s): call "
                            f"read_features(model, drafter) before decoding (resolve_drafter does)")
        return linear(self.fuse, hidden)

    def next_state(self, state: mx.array, token_emb: mx.array) -> mx.array:
        """RNN update with the embedding of the last drafted token: (..., H) -> (..., H)."""
        if self.args.rnn:
            return silu(linear(self.rnn_w, token_emb) + linear(self.rnn_u, state))
        return state + token_emb

    def features(self, context: mx.array, state: mx.array) -> mx.array:
        """The vocabulary projection's input from [context ; state]: (..., 2H) -> (..., E)."""
        x = mx.concatenate([context, state], axis=-1)
        if "input_proj" in self:
            x = linear(self.input_proj, x)
        for layer in self.lm_head[:-1]:
            x = layer(x)
        return x

    def logits(self, context: mx.array, state: mx.array) -> mx.array:
        """Head logits from [context ; state]: (..., 2H) -> (..., K) (K = vocab or draft vocab)."""
        return linear(self.lm_head[-1], self.features(context, state))

    def token_ids(self, head_index: mx.array) -> mx.array:
        """Map head output indices to target token ids (identity for a full-vocab head)."""
        return self.draft_vocab[head_index] if self.args.draft_vocab_size else head_index

    def num_params(self) -> int:
        """Number of weights (a quantized matrix counts its unpacked entries; scales and biases not counted)."""
        from mlx.utils import tree_flatten

        bits = self.args.quantization["bits"] if self.args.quantization else 32
        n = 0
        for k, v in tree_flatten(self.parameters()):
            if k == "draft_vocab" or k.endswith((".scales", ".biases")):
                continue
            n += v.size * 32 // bits if v.dtype == mx.uint32 else v.size
        return n


class FrequentHead:
    """A drafter whose vocabulary head keeps only its first `rows` rows: the `rows` most frequent tokens of its
    draft vocabulary, which is ordered by training frequency. A cheaper head (drafting reads the head once per
    drafted token); its drafts differ from the full head's only where that one's choice lies beyond them."""

    def __init__(self, drafter: Drafter, rows: int):
        size = drafter.args.draft_vocab_size
        if not size:
            raise UserError("--drafter-vocab needs a drafter with a frequency-ordered draft vocabulary "
                            "(draft_vocab_size in its config); this one predicts the whole vocabulary: leave it at 0")
        if not 1 <= rows <= size:
            raise UserError(f"--drafter-vocab must be between 1 and the drafter's {size} head rows (0 = all; "
                            f"got {rows})")
        self.drafter, self.rows = drafter, rows
        head = drafter.lm_head[-1]
        self.parts = [getattr(head, k)[:rows] for k in ("weight", "scales", "biases") if k in head]
        self.vocab = drafter.draft_vocab[:rows]

    def context(self, hidden: mx.array) -> mx.array:
        return self.drafter.context(hidden)

    def next_state(self, state: mx.array, token_emb: mx.array) -> mx.array:
        return self.drafter.next_state(state, token_emb)

    def logits(self, context: mx.array, state: mx.array) -> mx.array:
        """(..., 2H) -> (..., rows)."""
        x, head = self.drafter.features(context, state), self.drafter.lm_head[-1]
        copy = current_copy(head)
        if copy is not None:
            return copy(x, self.rows)
        if len(self.parts) == 3:  # quantized: rows are independent, so the first rows of each part
            return mx.quantized_matmul(x, *self.parts, transpose=True, group_size=head.group_size, bits=head.bits)
        return x @ self.parts[0].T

    def token_ids(self, head_index: mx.array) -> mx.array:
        return self.vocab[head_index]


class RnnSource(BeamSource):
    """ReDrafter: W beams of the recurrent draft head, conditioned on the target's hidden state."""

    name = "rnn"

    def __init__(self, drafter: Drafter, embed: Callable[[mx.array], mx.array], vocab_rows: int = 0,
                 min_confidence: float = 0.0):
        """`vocab_rows` > 0: draft with only that many of the head's most frequent tokens (`FrequentHead`);
        `min_confidence` > 0: greedy drafts end where the drafter's confidence falls below it (`BeamSource`)."""
        super().__init__(FrequentHead(drafter, vocab_rows) if vocab_rows else drafter, embed,
                         key=(id(drafter), vocab_rows), min_confidence=min_confidence)


def _quantize_linears(drafter: Drafter, bits: int, group_size: int) -> None:
    nn.quantize(drafter, group_size=group_size, bits=bits, class_predicate=lambda _, m: isinstance(m, nn.Linear))


def quantize_drafter(drafter: Drafter, bits: int = 4, group_size: int = 64) -> Drafter:
    """Quantize every nn.Linear of `drafter` in place (affine `mx.quantize`); returns it.

    Scales and biases keep the weights' float dtype. `save_drafter` then writes the `quantization` config."""
    if drafter.args.quantization:
        raise UserError(f"the drafter is already quantized ({drafter.args.quantization['bits']}-bit)")
    drafter.args.check_quantization(bits, group_size)
    _quantize_linears(drafter, bits, group_size)
    drafter.args.quantization = {"bits": bits, "group_size": group_size}
    mx.eval(drafter.parameters())
    return drafter


def dequantize_drafter(drafter: Drafter) -> Drafter:
    """Replace every quantized linear by a float nn.Linear holding its dequantized weights, in place; returns it.

    The float dtype is that of the scales. A drafter that is not quantized is returned unchanged."""
    from mlx.utils import tree_map_with_path

    if not drafter.args.quantization:
        return drafter

    def dequantize(_: str, m: nn.Module) -> nn.Module:
        if not isinstance(m, nn.QuantizedLinear):
            return m
        w = mx.dequantize(m.weight, m.scales, m.biases, group_size=m.group_size, bits=m.bits)
        linear = nn.Linear(w.shape[1], w.shape[0], bias="bias" in m)
        linear.weight = w
        if "bias" in m:
            linear.bias = m.bias
        return linear

    drafter.update_modules(tree_map_with_path(dequantize, drafter.leaf_modules(), is_leaf=nn.Module.is_module))
    drafter.args.quantization = None
    mx.eval(drafter.parameters())
    return drafter


def read_features(model: Any, drafter: Any) -> None:
    """Make the target's forward provide what `drafter` conditions on: the layers its `feature_layers` names (none
    for any other drafter, or none at all)."""
    args = getattr(drafter, "args", None)
    model.feature_layers = tuple(getattr(args, "feature_layers", None) or ())


def check_compatible(args: DrafterArgs, hidden_size: int, vocab_size: int, where: str,
                     num_layers: int | None = None) -> None:
    """One-line error if a drafter does not fit the target's hidden size, vocabulary and (given) layer count."""
    layers = getattr(args, "feature_layers", None) or []
    if num_layers is not None and layers and max(layers) >= num_layers:
        raise UserError(f"drafter {where} reads target layer {max(layers)} but the target model has {num_layers} "
                        f"layers (0-{num_layers - 1}): use a drafter trained for this model")
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
                   dtype: mx.Dtype = mx.float32, feature_layers: list[int] | None = None) -> Drafter:
    """A randomly initialised drafter of the given shape (for exactness tests and smoke runs).

    With `draft_vocab_size` = K the head drafts over K random distinct token ids (cheaper drafting). `exit_dim`
    (default 2 x the hidden size) must lie in 1..8 x the hidden size: a random drafter is for tests and smoke
    runs, and a wider one only spends memory (100000 x 49152 weights would not fit)."""
    if exit_dim is not None and (type(exit_dim) is not int or not 1 <= exit_dim <= 8 * hidden_size):
        raise UserError(f"random drafter: exit_dim = {shown(exit_dim)} is not an integer from 1 to "
                        f"{8 * hidden_size:,} (8 x the model's hidden size {hidden_size}): use random:SEED or "
                        f"random:SEED:EXIT_DIM with EXIT_DIM in that range")
    mx.random.seed(seed)
    args = DrafterArgs.from_dict({"vocab_size": vocab_size, "hidden_size": hidden_size,
                                  "exit_dim": 2 * hidden_size if exit_dim is None else exit_dim,
                                  "num_draft_layers": num_draft_layers,
                                  "rnn": rnn, "draft_vocab_size": draft_vocab_size,
                                  "feature_layers": feature_layers}, "random drafter")
    d = Drafter(args)
    if draft_vocab_size:
        d.draft_vocab = mx.sort(mx.random.permutation(vocab_size)[:draft_vocab_size]).astype(mx.int32)
    cast_floats(d, dtype)
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


def read_checkpoint(path: str | Path) -> tuple[dict[str, Any], Path]:
    """(config dict, weights file) of a drafter directory (config.json + model.safetensors) or of a .safetensors
    with config.json beside it, for any drafter kind; one-line errors for what is missing or unreadable."""
    p = Path(path).expanduser()
    if not p.exists():
        raise UserError(f"drafter {path} does not exist (give a directory with config.json + model.safetensors)")
    folder = p if p.is_dir() else p.parent
    weights_file = _find_weights(p) if p.is_dir() else p
    cfg_file = folder / "config.json"
    if not cfg_file.exists():
        raise UserError(f"drafter {path}: config.json is missing next to the weights")
    return read_json(cfg_file, "drafter config"), weights_file


def load_weights_into(module: nn.Module, weights_file: Path, dtype: mx.Dtype | None) -> None:
    """Load `weights_file` into a drafter module built from its config (strict), keep `draft_vocab` int32 and
    cast float tensors to `dtype` (None: keep the stored dtypes). The file's layout is checked before MLX reads it,
    and a draft vocabulary must hold token ids inside the drafter's vocabulary."""
    safetensors_header.read_header(weights_file, "drafter weights")
    try:
        weights = mx.load(str(weights_file), format="safetensors")
    except Exception as e:
        raise UserError(f"cannot read drafter weights {weights_file}: {str(e).splitlines()[0]}") from None
    try:
        module.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        detail = " ".join(str(e).split())  # MLX lists the names on the lines after the first
        if len(detail) > 300:
            detail = detail[:300] + " ..."
        raise UserError(f"drafter weights {weights_file} do not match its config.json: {detail}") from None
    if "draft_vocab" in module:
        check_id_array(module.draft_vocab, module.args.vocab_size, f"drafter weights {weights_file}: draft_vocab")
        module.draft_vocab = module.draft_vocab.astype(mx.int32)
    if dtype is not None:
        cast_floats(module, dtype)
    mx.eval(module.parameters())


def load_drafter(path: str | Path, dtype: mx.Dtype | None = mx.float32) -> Drafter:
    """Load a drafter directory (config.json + model.safetensors) or a .safetensors with config.json beside it.

    Float tensors are cast to `dtype` (None: keep the stored dtypes). A quantized drafter (`quantization` in
    config.json) is built quantized and stays quantized; `dtype` then applies to its scales and biases."""
    cfg, weights_file = read_checkpoint(path)
    if cfg.get("model_type", MODEL_TYPE) != MODEL_TYPE:
        raise UserError(f"{weights_file.parent / 'config.json'} is a {cfg.get('model_type')!r} config, not a "
                        f"ReDrafter drafter")
    drafter = Drafter(DrafterArgs.from_dict(cfg, f"drafter config {weights_file.parent / 'config.json'}"))
    load_weights_into(drafter, weights_file, dtype)
    return drafter


def cast_floats(module: nn.Module, dtype: mx.Dtype) -> None:
    """Cast every floating-point array of `module` to `dtype`, in place."""
    module.apply(lambda x: x.astype(dtype) if mx.issubdtype(x.dtype, mx.floating) else x)


# What a drafter save writes into its folder (config and weights, the model card, a training checkpoint's state),
# and the companion files it carries over when it replaces a drafter (the lookup answer table beside a shipped
# drafter). A folder holding anything else is not a drafter folder: a save never replaces it.
DRAFTER_FILES = frozenset({"config.json", "model.safetensors", "MODEL_CARD.md", "trainer_state.json",
                           "optimizer.safetensors"})
KEPT_FILES = frozenset({"answers.npz"})


def foreign_files(folder: Path) -> list[str]:
    """Names in `folder` that a drafter save neither writes nor keeps (sorted; a folder's entries only)."""
    return sorted(p.name for p in folder.iterdir() if p.name not in DRAFTER_FILES | KEPT_FILES)


def check_replaceable(out: Path, what: str) -> None:
    """One-line UserError unless `out` is absent or a folder holding only files a drafter save writes or keeps
    (so replacing it loses nothing else)."""
    if not out.exists() and not out.is_symlink():
        return
    if not out.is_dir():
        raise UserError(f"{what} {out} is a file: give a directory")
    foreign = foreign_files(out)
    if foreign:
        names = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise UserError(f"{what} {out} holds files a drafter save does not write ({names}), which replacing it "
                        f"would delete: choose another directory, or move them out")


def save_drafter(drafter: Drafter, out_dir: str | Path, extra_files: dict[str, str] | None = None) -> Path:
    """Write config.json + model.safetensors (+ extra text files) as a directory, atomically (temp dir, then
    rename); an existing `out_dir` is replaced (its `KEPT_FILES` carried over), but only when it holds nothing
    else (`check_replaceable`). Returns `out_dir`."""
    from mlx.utils import tree_flatten

    out = Path(out_dir)
    check_replaceable(out, "drafter folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(drafter.args.to_dict(), indent=2) + "\n")
        mx.save_safetensors(str(tmp / "model.safetensors"), dict(tree_flatten(drafter.parameters())),
                            metadata={"format": "mlx"})
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
        for name in KEPT_FILES - set(extra_files or {}):
            if (out / name).is_file():
                shutil.copy2(out / name, tmp / name)
        tmp.chmod(0o755)  # mkdtemp creates 0700
        fsync_tree(tmp)
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
