"""Import Medusa-1 heads in the FasterDecoding/Medusa layout as an MLX Medusa drafter (`mlx_redrafter.draft.medusa`).

Layout: `medusa_lm_head.safetensors` or a weights-only `medusa_lm_head.pt` (the state dict of the repository's
`medusa_head` ModuleList) with `config.json` {"medusa_num_heads", "medusa_num_layers", ...} beside it. Keys:
`{k}.{i}.linear.weight` (H, H) / `.bias` (H) for ResBlock i < L of head k and `{k}.{L}.weight` (V, H), the vocabulary
projection (no bias); a `medusa_head.` or `module.` prefix is accepted. The target's hidden size and vocabulary
come from the shapes (checked against --model when given). Called by `python -m convert.from_torch`, which detects
the layout (the file name, `medusa_num_heads` in config.json, or keys of more than one head).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import mlx.core as mx

from convert.checkpoint import check_out_dir, default_out, find_checkpoint, pick_dtype, read_config, read_tensors
from mlx_redrafter.draft.medusa import MedusaArgs, MedusaHeads
from mlx_redrafter.draft.redrafter import check_compatible, save_drafter
from mlx_redrafter.errors import UserError
from mlx_redrafter.models import safetensors_header
from mlx_redrafter.models.loader import load_target

WEIGHT_NAMES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt", "medusa_lm_head.bin")
_KEY = re.compile(r"^(\d+)\.(\d+)\.(?:linear\.)?(weight|bias)$")
_PREFIXES = ("module.", "medusa_head.")


def _config(folder: Path) -> dict[str, Any] | None:
    f = folder / "config.json"
    return read_config(f) if f.is_file() else None


def _safetensors_keys(file: Path) -> list[str]:
    """Tensor names in a safetensors header (empty if the file is not a readable safetensors file)."""
    try:
        return list(safetensors_header.read_header(file))
    except UserError:
        return []


def _weights_file(path: Path) -> Path | None:
    if path.is_dir():
        return next((path / n for n in WEIGHT_NAMES if (path / n).is_file()), None)
    return path if path.is_file() else None


def is_medusa(path: Path) -> bool:
    """Whether `path` (file or directory) holds Medusa heads in the FasterDecoding layout."""
    if not path.exists():
        return False
    folder = path if path.is_dir() else path.parent
    if path.is_dir() and _weights_file(path) is not None:
        return True
    if path.is_file() and path.name.startswith("medusa_lm_head"):
        return True
    try:
        cfg = _config(folder)
    except UserError:
        return False
    if cfg is not None and "medusa_num_heads" in cfg:
        return True
    if path.is_file() and path.suffix == ".safetensors":  # keys of a second head: not a ReDrafter spelling
        return any((m := _KEY.match(_strip(k))) and int(m.group(1)) > 0 for k in _safetensors_keys(path))
    return False


def _strip(key: str) -> str:
    for prefix in _PREFIXES:
        if key.startswith(prefix):
            key = key[len(prefix):]
    return key


def medusa_tensors(tensors: dict[str, mx.array], file: Path) -> tuple[dict[str, mx.array], int, int]:
    """Tensors under our key names (`medusa_head.{k}.{i}.linear.*`, `medusa_head.{k}.{L}.weight`), the number of
    heads and of ResBlocks per head; one-line errors for keys or shapes that are not Medusa heads."""
    parsed: dict[tuple[int, int, str], tuple[str, mx.array]] = {}
    for key, value in tensors.items():
        m = _KEY.match(_strip(key))
        if m is None:
            raise UserError(f"unknown key {key!r} in {file} (Medusa heads have {{head}}.{{layer}}.linear.weight/bias "
                            f"and {{head}}.{{layers}}.weight)")
        parsed[(int(m.group(1)), int(m.group(2)), m.group(3))] = (key, value)
    heads = sorted({k for k, _, _ in parsed})
    if not heads or heads != list(range(len(heads))):
        raise UserError(f"{file}: Medusa heads must be numbered 0..K-1 (found {heads})")
    layers = {k: max(i for h, i, _ in parsed if h == k) for k in heads}  # the projection's index = ResBlocks
    L = layers[0]
    if any(v != L for v in layers.values()):
        raise UserError(f"{file}: the heads have different numbers of layers ({sorted(set(layers.values()))})")
    out: dict[str, mx.array] = {}
    for k in heads:
        for i in range(L + 1):
            leaves = ("weight",) if i == L else ("weight", "bias")
            for leaf in leaves:
                if (k, i, leaf) not in parsed:
                    raise UserError(f"{file}: missing key {k}.{i}.{'' if i == L else 'linear.'}{leaf}")
                name = f"medusa_head.{k}.{i}.{leaf}" if i == L else f"medusa_head.{k}.{i}.linear.{leaf}"
                out[name] = parsed[(k, i, leaf)][1]
        if (k, L, "bias") in parsed:
            raise UserError(f"{file}: unexpected key {parsed[(k, L, 'bias')][0]!r}: the vocabulary projection has "
                            f"no bias")
    return out, len(heads), L


def _check_shapes(args: MedusaArgs, tensors: dict[str, mx.array], file: Path) -> None:
    from mlx.utils import tree_flatten

    want = {k: tuple(v.shape) for k, v in tree_flatten(MedusaHeads(args).parameters())}
    for key, shape in want.items():
        if tuple(tensors[key].shape) != shape:
            raise UserError(f"{file}: {key.removeprefix('medusa_head.')} has shape {tuple(tensors[key].shape)}, "
                            f"expected {shape} (hidden_size {args.hidden_size}, vocab_size {args.vocab_size})")
        if not mx.issubdtype(tensors[key].dtype, mx.floating):
            raise UserError(f"{file}: {key.removeprefix('medusa_head.')} has non-float dtype {tensors[key].dtype}")


def convert_medusa(given: Path, out: str | Path | None, model: str | None, dtype: str, force: bool) -> dict[str, Any]:
    """Convert FasterDecoding Medusa heads to an MLX Medusa drafter directory; returns a summary dict."""
    weights = _weights_file(given) or find_checkpoint(given)[0]
    folder = weights.parent
    cfg = _config(folder) or {}
    out_dir = Path(out).expanduser() if out else default_out(weights, folder)
    check_out_dir(out_dir, weights, force)
    tensors, n_heads, n_layers = medusa_tensors(read_tensors(weights), weights)
    for key, found in (("medusa_num_heads", n_heads), ("medusa_num_layers", n_layers)):
        if key in cfg and cfg[key] != found:
            raise UserError(f"{folder / 'config.json'} says {key} = {cfg[key]!r} but {weights.name} holds {found}")
    vocab, hidden = tensors[f"medusa_head.0.{n_layers}.weight"].shape
    args = MedusaArgs(vocab_size=vocab, hidden_size=hidden, medusa_num_heads=n_heads, medusa_num_layers=n_layers,
                      extra={k: cfg[k] for k in ("base_model_name_or_path",) if k in cfg})
    _check_shapes(args, tensors, weights)
    target = load_target(model, "float32") if model is not None else None
    if target is not None:
        check_compatible(args, target.model.args.hidden_size, target.model.args.vocab_size, str(weights))
    dt = pick_dtype(tensors, f"medusa_head.0.{n_layers}.weight", dtype)
    heads = MedusaHeads(args)
    cast = {k: v.astype(dt) for k, v in tensors.items()}
    for k, v in cast.items():
        if not mx.all(mx.isfinite(v)).item():
            raise UserError(f"{weights}: tensor {k.removeprefix('medusa_head.')!r} has NaN/Inf values (or overflows "
                            f"{dt}: use --dtype float32)")
    heads.load_weights(list(cast.items()), strict=True)
    mx.eval(heads.parameters())
    save_drafter(heads, out_dir)
    return {
        "kind": "medusa", "source": str(weights), "config": str(folder / "config.json") if cfg else None,
        "out": str(out_dir), "args": args.to_dict(), "dtype": str(dt).replace("mlx.core.", ""),
        "source_dtypes": sorted({str(v.dtype).replace("mlx.core.", "") for v in tensors.values()}),
        "num_params": heads.num_params(),
        "target": None if target is None else {"name": target.name, "hidden_size": target.model.args.hidden_size,
                                               "vocab_size": target.model.args.vocab_size},
    }


def format_medusa_summary(s: dict[str, Any]) -> str:
    """Human-readable summary of a Medusa conversion."""
    a, t = s["args"], s["target"]
    return "\n".join([
        f"converted Medusa heads {s['source']} -> {s['out']}",
        f"  config: {s['config'] or 'none (inferred from tensor shapes)'}",
        f"  {a['medusa_num_heads']} heads x {a['medusa_num_layers']} ResBlocks, hidden_size {a['hidden_size']}, "
        f"vocab_size {a['vocab_size']}",
        f"  parameters: {s['num_params']:,} (source {'/'.join(s['source_dtypes'])}, written as {s['dtype']})",
        f"  target check: ok for {t['name']} (hidden {t['hidden_size']}, vocab {t['vocab_size']})" if t
        else "  target check: skipped (pass --model to check hidden size and vocabulary)",
        "  decode with: redrafter-mlx generate --draft medusa --drafter " + s["out"],
    ])
