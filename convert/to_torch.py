"""Export a redrafter-mlx drafter in Apple's PyTorch ReDrafter format (config.json + model.safetensors).

    python -m convert.to_torch DRAFTER_DIR --out DIR [--dtype D] [--approximate-draft-vocab] [--force]

The output loads with `safetensors.torch.load_file` into Apple's `Drafter` (ml-recurrent-drafter) and is what
TensorRT-LLM's ReDrafter converter reads. Keys and layouts are already Apple's (nn.Linear (out, in)).

Draft-vocab heads (our extension: `draft_vocab_size` K and a `draft_vocab` tensor; the head scores only K
tokens) have no exact equivalent in Apple's format: its vocab projection is a bias-free (V, E) matrix, so a
token outside the subset always gets some finite logit w·x (and a zero row gives exactly 0, which can beat
the subset's logits whenever they are negative). We therefore refuse by default. With
`--approximate-draft-vocab` the head is materialised as a (V, E) matrix whose subset rows are the trained
rows and all other rows are zero; the exported drafter then differs from ours (documented in config.json as
`approximate_from_draft_vocab`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import mlx_redrafter  # noqa: F401, I001  (loads the optimized BLAS before mlx.core)

# isort: split
import mlx.core as mx

from mlx_redrafter.drafter import Drafter, DrafterArgs, load_drafter, save_drafter
from mlx_redrafter.errors import UserError

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def _stored_dtype(path: Path, key: str) -> mx.Dtype:
    files = [path / "model.safetensors"] if path.is_dir() else [path]
    try:
        dt = mx.load(str(files[0]))[key].dtype
    except Exception:
        return mx.float32
    return dt if dt in DTYPES.values() else mx.float32


def full_vocab_drafter(d: Drafter, approximate: bool, where: str) -> Drafter:
    """The same drafter with a (V, E) vocabulary projection (identity for full-vocab drafters)."""
    a = d.args
    if not a.draft_vocab_size:
        return d
    if not approximate:
        raise UserError(
            f"{where} has a draft-vocab head ({a.draft_vocab_size} of {a.vocab_size} tokens), which Apple's format "
            f"cannot express exactly (no bias on the vocab projection, so other tokens cannot be masked out); pass "
            f"--approximate-draft-vocab to export it with zero rows for the other tokens (not exact)"
        )
    args = DrafterArgs.from_dict({**a.to_dict(), "draft_vocab_size": None,
                                  "approximate_from_draft_vocab": a.draft_vocab_size})
    args.draft_vocab_size = None
    out = Drafter(args)
    head = d.lm_head[-1].weight
    full = mx.zeros((a.vocab_size, a.exit_dim), dtype=head.dtype)
    full[d.draft_vocab] = head
    head_key = f"lm_head.{a.num_draft_layers}.weight"
    weights = [(k, v) for k, v in _flat(d).items() if k not in ("draft_vocab", head_key)]
    out.load_weights(weights + [(head_key, full)], strict=True)
    mx.eval(out.parameters())
    return out


def _flat(d: Drafter) -> dict[str, mx.array]:
    from mlx.utils import tree_flatten

    return dict(tree_flatten(d.parameters()))


def export(path: str | Path, out: str | Path, dtype: str = "auto", approximate: bool = False,
           force: bool = False) -> dict[str, Any]:
    """Write the drafter at `path` in Apple's format to `out` (atomically); returns a summary."""
    src = Path(path).expanduser()
    out_dir = Path(out).expanduser()
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())) and not force:
        raise UserError(f"output {out_dir} already exists: pass --force to replace it, or choose --out")
    if out_dir.exists() and src.exists() and out_dir.resolve() == (src if src.is_dir() else src.parent).resolve():
        raise UserError(f"output {out_dir} is the input drafter's own directory: choose another --out")
    if dtype not in ("auto", *DTYPES):
        raise UserError(f"unknown --dtype {dtype!r}; choose auto, {', '.join(DTYPES)}")
    d = load_drafter(src)  # one-line UserErrors for missing/corrupt input
    head = f"lm_head.{d.args.num_draft_layers}.weight"
    dt = _stored_dtype(src, head) if dtype == "auto" else DTYPES[dtype]
    d = full_vocab_drafter(d, approximate, str(src))
    d.apply(lambda x: x.astype(dt) if mx.issubdtype(x.dtype, mx.floating) else x)
    mx.eval(d.parameters())
    save_drafter(d, out_dir)
    flat = _flat(d)
    return {"source": str(src), "out": str(out_dir), "dtype": str(dt).replace("mlx.core.", ""),
            "shapes": {k: list(v.shape) for k, v in flat.items()}, "num_params": d.num_params(),
            "approximate": bool(approximate and "approximate_from_draft_vocab" in d.args.extra)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m convert.to_torch", description=__doc__.splitlines()[0])
    p.add_argument("drafter", help="redrafter-mlx drafter directory (config.json + model.safetensors)")
    p.add_argument("--out", required=True, help="output directory (Apple format)")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES], help="weight dtype (auto: as stored)")
    p.add_argument("--approximate-draft-vocab", action="store_true",
                   help="export a draft-vocab head as a full (V, E) head with zero rows (not exact)")
    p.add_argument("--force", action="store_true", help="replace an existing output directory")
    a = p.parse_args(argv)
    try:
        s = export(a.drafter, a.out, a.dtype, a.approximate_draft_vocab, a.force)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported {s['source']} -> {s['out']} (Apple ReDrafter format, {s['dtype']}, {s['num_params']:,} params)")
    for k, shape in sorted(s["shapes"].items()):
        print(f"    {k:28s} {tuple(shape)}")
    if s["approximate"]:
        print("  note: draft-vocab head materialised with zero rows for the other tokens: NOT exact")
    return 0


if __name__ == "__main__":
    sys.exit(main())
