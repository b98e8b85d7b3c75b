"""Export a redrafter-mlx drafter in Apple's PyTorch ReDrafter format (config.json + model.safetensors).

    python -m convert.to_torch DRAFTER_DIR --out DIR [--dtype D] [--approximate-draft-vocab] [--dequantize] [--force]

The output loads with `safetensors.torch.load_file` into Apple's `Drafter` (ml-recurrent-drafter) and is what
TensorRT-LLM's ReDrafter converter reads. Keys and layouts are already Apple's (nn.Linear (out, in)).

Draft-vocab heads (our extension: `draft_vocab_size` K and a `draft_vocab` tensor; the head scores only K
tokens) have no exact equivalent in Apple's format: its vocab projection is a bias-free (V, E) matrix, so a
token outside the subset always gets some finite logit w·x (and a zero row gives exactly 0, which can beat
the subset's logits whenever they are negative). We therefore refuse by default. With
`--approximate-draft-vocab` the head is materialised as a (V, E) matrix whose subset rows are the trained
rows and all other rows are zero; the exported drafter then differs from ours (documented in config.json as
`approximate_from_draft_vocab`).

Quantized drafters (our extension: `quantization` in config.json) have no equivalent in Apple's format either:
refused by default. With `--dequantize` every linear is written as its dequantized float weights
(scales · q + biases, in the scales' dtype unless --dtype says otherwise): the same function the quantized
drafter computes, up to float rounding, but not the weights it was quantized from.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import typer

from mlx_redrafter.cmd.common import one_line_errors, run_app
from mlx_redrafter.draft.redrafter import Drafter, DrafterArgs, dequantize_drafter, load_drafter, save_drafter
from mlx_redrafter.errors import UserError
from mlx_redrafter.models.loader import DTYPES


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
           dequantize: bool = False, force: bool = False) -> dict[str, Any]:
    """Write the drafter at `path` in Apple's format to `out` (atomically); returns a summary.

    `dtype`: auto (the vocab projection's stored float dtype; for a quantized drafter, its scales') or a name in
    DTYPES. A quantized drafter needs `dequantize=True`; a draft-vocab head needs `approximate=True`."""
    src = Path(path).expanduser()
    out_dir = Path(out).expanduser()
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())) and not force:
        raise UserError(f"output {out_dir} already exists: pass --force to replace it, or choose --out")
    if out_dir.exists() and src.exists() and out_dir.resolve() == (src if src.is_dir() else src.parent).resolve():
        raise UserError(f"output {out_dir} is the input drafter's own directory: choose another --out")
    if dtype not in ("auto", *DTYPES):
        raise UserError(f"unknown --dtype {dtype!r}; choose auto, {', '.join(DTYPES)}")
    d = load_drafter(src, dtype=None)  # stored dtypes; one-line UserErrors for missing/corrupt input
    if d.args.feature_layers:
        raise UserError(f"{src} fuses target layers {d.args.feature_layers} into its context (feature_layers), "
                        f"which Apple's format cannot express: it has no export")
    q = d.args.quantization
    if q:
        if not dequantize:
            raise UserError(f"{src} is quantized ({q['bits']} bits, group size {q['group_size']}) and Apple's format "
                            f"has no quantization: pass --dequantize to export its dequantized float weights")
        d = dequantize_drafter(d)
    head = d.lm_head[-1].weight.dtype
    dt = (head if head in DTYPES.values() else mx.float32) if dtype == "auto" else DTYPES[dtype]
    d = full_vocab_drafter(d, approximate, str(src))
    d.apply(lambda x: x.astype(dt) if mx.issubdtype(x.dtype, mx.floating) else x)
    mx.eval(d.parameters())
    save_drafter(d, out_dir)
    flat = _flat(d)
    return {"source": str(src), "out": str(out_dir), "dtype": str(dt).replace("mlx.core.", ""),
            "shapes": {k: list(v.shape) for k, v in flat.items()}, "num_params": d.num_params(),
            "approximate": approximate and "approximate_from_draft_vocab" in d.args.extra, "dequantized_from": q}


def format_summary(s: dict[str, Any]) -> str:
    """Human-readable summary of an export."""
    lines = [f"exported {s['source']} -> {s['out']} (Apple ReDrafter format, {s['dtype']}, {s['num_params']:,} params)"]
    lines += [f"    {k:28s} {tuple(shape)}" for k, shape in sorted(s["shapes"].items())]
    if s["approximate"]:
        lines.append("  note: draft-vocab head materialised with zero rows for the other tokens: NOT exact")
    if s["dequantized_from"]:
        lines.append(f"  note: dequantized from {s['dequantized_from']['bits']} bits (the quantized drafter's weights, "
                     f"not the original float ones)")
    return "\n".join(lines)


app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
PROG = "python -m convert.to_torch"


@app.command()
@one_line_errors
def command(
    drafter: str = typer.Argument(..., help="redrafter-mlx drafter directory (config.json + model.safetensors)."),
    out: str = typer.Option(..., "--out", help="Output directory (Apple's format)."),
    dtype: str = typer.Option("auto", "--dtype", help=f"Weight dtype: auto (as stored), {', '.join(DTYPES)}."),
    approximate_draft_vocab: bool = typer.Option(False, "--approximate-draft-vocab", help="Export a draft-vocab "
                                                 "head as a full (V, E) head with zero rows (not exact)."),
    dequantize: bool = typer.Option(False, "--dequantize", help="Export a quantized drafter as its dequantized "
                                    "float weights (Apple's format has no quantization)."),
    force: bool = typer.Option(False, "--force", help="Replace an existing output directory."),
) -> None:
    """Export a redrafter-mlx drafter in Apple's PyTorch ReDrafter format."""
    typer.echo(format_summary(export(drafter, out, dtype, approximate_draft_vocab, dequantize, force)))


def main(argv: list[str] | None = None) -> int:
    """Command line (`python -m convert.to_torch`); returns the exit status (2 = bad input, one error line)."""
    return run_app(app, argv, PROG)


if __name__ == "__main__":
    sys.exit(main())
