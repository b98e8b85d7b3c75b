"""`redrafter-mlx quantize`: a Llama checkpoint -> an mlx-lm compatible quantized directory."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from mlx_redrafter.cmd import common as c


@c.one_line_errors
def quantize(
    src: str = typer.Argument(..., help="Source model: mlx-lm/HF directory, .gguf file, registry name or hub repo."),
    dst: Path = typer.Argument(..., help="Output directory (must not exist unless --overwrite)."),
    bits: int = typer.Option(4, "--bits", "-b", help="Bits per weight: 2, 3, 4, 5, 6 or 8."),
    group_size: int = typer.Option(64, "--group-size", "-g", help="Weights sharing one scale and bias: 32, 64, 128."),
    dtype: str = typer.Option("float16", help="dtype of scales, biases and unquantized tensors: float16, bfloat16, "
                                              "float32."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace DST if it exists (atomically)."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """Quantize a model like `mlx_lm.convert -q`; the result loads in mlx-lm and in redrafter-mlx."""
    from mlx_redrafter.models.quantize import quantize as run

    summary = run(src, dst, bits, group_size, dtype, overwrite)
    if as_json:
        typer.echo(json.dumps(summary))
    else:
        typer.echo(f"wrote {summary['dst']}: {summary['quantized_modules']} modules at {bits} bits (group "
                   f"{group_size}), {summary['bits_per_weight']} bits/weight, {summary['size_mb']} MB")
