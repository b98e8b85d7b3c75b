"""Import a PyTorch ReDrafter drafter checkpoint (Apple's ml-recurrent-drafter format) as an MLX drafter.

    python -m convert.from_torch PATH [--out DIR] [--model M] [--dtype D] [--quantize 4|8] [--group-size G] [--force]

PATH is a `model.safetensors`, a torch state dict (`pytorch_model.bin` / `model.pt`, read with
`torch.load(weights_only=True)`, so no pickled code ever runs), or a directory holding one of them and
usually `config.json`. Key spellings seen in the wild are accepted (`input_projs`, `lm_heads.{i}`, `0.{i}`,
ResBlocks with or without the `.linear` level). A missing config is inferred from the tensor shapes. This project's
extensions are read too: a `draft_vocab` head and, with `feature_layers` in config.json, the `fuse` projection of a
drafter that reads several target layers (what `bench/torch_ref/cuda_job.py` trains).
The output is a drafter directory (config.json + model.safetensors) for `mlx_redrafter.draft.redrafter.load_drafter`,
written atomically. `--quantize` stores every linear quantized (mlx-lm style, see `quantize_drafter`).
Medusa heads in the FasterDecoding/Medusa layout (`medusa_lm_head.safetensors` / `.pt`, config.json with
`medusa_num_heads`) are detected and converted to an MLX Medusa drafter instead (convert/medusa.py).
Any problem is reported as one `error: ...` line and exit status 2, with no output dir.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import typer

from convert.checkpoint import (
    check_dtype,
    check_out_dir,
    default_out,
    find_checkpoint,
    pick_dtype,
    read_config,
    read_tensors,
)
from convert.medusa import convert_medusa, format_medusa_summary, is_medusa
from mlx_redrafter.cmd.common import one_line_errors, run_app
from mlx_redrafter.draft.redrafter import (
    MODEL_TYPE,
    Drafter,
    DrafterArgs,
    check_compatible,
    check_quantization,
    quantize_drafter,
    save_drafter,
)
from mlx_redrafter.errors import UserError
from mlx_redrafter.models.loader import DTYPES, load_target
from mlx_redrafter.token_ids import check_id_array

# config.json keys of a Hugging Face PretrainedConfig that describe the source file, not the drafter.
_DROP_CONFIG_KEYS = {"torch_dtype", "dtype", "_name_or_path", "transformers_version", "architectures", "auto_map"}
_KEY_PREFIXES = ("module.", "drafter.")


@dataclass
class Checkpoint:
    """Tensors of a PyTorch drafter checkpoint, under canonical (Apple) key names."""

    weights_file: Path
    config: dict[str, Any] | None
    tensors: dict[str, mx.array]
    renamed: dict[str, str] = field(default_factory=dict)  # original key -> canonical key (only changed ones)


_RULES = [
    (re.compile(r"^input_projs?(?:\.0)?\.(weight|bias)$"), r"input_proj.\1"),
    (re.compile(r"^(?:lm_heads?|0)\.(\d+)\.(?:linear\.)?(weight|bias)$"), r"lm_head.\1.\2"),  # .linear re-added later
    (re.compile(r"^(rnn_u\.(?:weight|bias)|rnn_w\.weight|emb_norm\.weight|draft_vocab|fuse\.weight)$"), r"\1"),
]


def canonical_keys(tensors: dict[str, mx.array], file: Path) -> tuple[dict[str, mx.array], dict[str, str]]:
    """Rename every key to Apple's spelling; one-line error naming the first key that is not a drafter weight."""
    staged: dict[str, tuple[str, mx.array]] = {}
    for key, value in tensors.items():
        k = key
        for prefix in _KEY_PREFIXES:
            if k.startswith(prefix):
                k = k[len(prefix):]
        for pattern, repl in _RULES:
            if pattern.match(k):
                new = pattern.sub(repl, k)
                break
        else:
            raise UserError(f"unknown key {key!r} in {file} (a ReDrafter drafter has input_proj, lm_head.{{i}}, "
                            f"rnn_u, rnn_w, emb_norm, and in this project's extensions draft_vocab and fuse)")
        if new in staged:
            raise UserError(f"{file} has two tensors for {new!r}: {staged[new][0]!r} and {key!r}")
        staged[new] = (key, value)
    heads = sorted({int(k.split(".")[1]) for k in staged if k.startswith("lm_head.")})
    if not heads:
        raise UserError(f"{file} has no lm_head.{{i}} weights: not a ReDrafter drafter checkpoint")
    last = heads[-1]
    out: dict[str, mx.array] = {}
    renamed: dict[str, str] = {}
    for new, (orig, value) in staged.items():
        if new.startswith("lm_head."):
            i, leaf = int(new.split(".")[1]), new.split(".")[2]
            if i == last and leaf == "bias":
                raise UserError(f"unexpected key {orig!r} in {file}: the vocabulary projection lm_head.{i} has no bias")
            new = f"lm_head.{i}.{leaf}" if i == last else f"lm_head.{i}.linear.{leaf}"
        out[new] = value
        if new != orig:
            renamed[orig] = new
    return out, renamed


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Read a checkpoint file or directory (and its config.json, if any) with canonical key names."""
    weights, cfg_file = find_checkpoint(Path(path).expanduser())
    cfg = None
    if cfg_file is not None:
        cfg = read_config(cfg_file)
        if cfg.get("model_type", MODEL_TYPE) != MODEL_TYPE:
            raise UserError(f"{cfg_file} describes a {cfg.get('model_type')!r} model, not a ReDrafter drafter")
        if cfg.get("quantization") is not None:
            raise UserError(f"{cfg_file.parent} is a quantized MLX drafter, not a PyTorch checkpoint: load it as it "
                            f"is (or export it with `python -m convert.to_torch --dequantize`)")
    tensors, renamed = canonical_keys(read_tensors(weights), weights)
    return Checkpoint(weights_file=weights, config=cfg, tensors=tensors, renamed=renamed)


def _shape(t: dict[str, mx.array], key: str) -> tuple[int, ...] | None:
    return tuple(t[key].shape) if key in t else None


def infer_args(ckpt: Checkpoint, target_vocab: int | None = None) -> tuple[DrafterArgs, list[str]]:
    """Drafter config from config.json where present, else from the tensor shapes; also the inferred keys."""
    t, f = ckpt.tensors, ckpt.weights_file
    heads = sorted({int(k.split(".")[1]) for k in t if k.startswith("lm_head.")})
    n = heads[-1]
    proj = _shape(t, f"lm_head.{n}.weight")
    if proj is None or len(proj) != 2:
        raise UserError(f"{f}: missing key lm_head.{n}.weight (the vocabulary projection)")
    rows, exit_dim = proj
    if (s := _shape(t, "input_proj.weight")) is not None:
        if len(s) != 2 or s[1] % 2:
            raise UserError(f"{f}: input_proj.weight has shape {s}, expected (exit_dim, 2 * hidden_size)")
        hidden = s[1] // 2
    elif (s := _shape(t, "rnn_u.weight")) is not None:
        hidden = s[0]
    else:
        if exit_dim % 2:
            raise UserError(f"{f}: no input_proj, so exit_dim must be 2 * hidden_size, but it is {exit_dim}")
        hidden = exit_dim // 2
    inferred_vals: dict[str, Any] = {
        "hidden_size": hidden, "exit_dim": exit_dim, "num_draft_layers": n,
        "rnn": "rnn_u.weight" in t or "rnn_w.weight" in t, "emb_norm": "emb_norm.weight" in t,
    }
    if "draft_vocab" in t:
        inferred_vals["draft_vocab_size"] = t["draft_vocab"].shape[0]
        if target_vocab is not None:
            inferred_vals["vocab_size"] = target_vocab
    else:
        inferred_vals["vocab_size"] = rows
    cfg = {k: v for k, v in (ckpt.config or {}).items() if k not in _DROP_CONFIG_KEYS}
    inferred = []
    for key, value in inferred_vals.items():
        if cfg.get(key) is None:
            cfg[key] = value
            inferred.append(key)
    if "vocab_size" not in cfg:
        raise UserError(f"{f} has a draft_vocab head: give config.json with vocab_size, or --model to take it from")
    if "fuse.weight" in t and not cfg.get("feature_layers"):
        raise UserError(f"{f} has fuse.weight (its context fuses target layers besides the last) but no config.json "
                        f"naming them: give the config.json with its feature_layers beside the weights")
    cfg["model_type"] = MODEL_TYPE
    where = (f"checkpoint config {f.parent / 'config.json'}" if ckpt.config is not None
             else f"the config inferred from {f}")
    return DrafterArgs.from_dict(cfg, where), inferred


def expected_shapes(args: DrafterArgs) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes of a drafter with these args (Apple's names, our format)."""
    from mlx.utils import tree_flatten

    return {k: tuple(v.shape) for k, v in tree_flatten(Drafter(args).parameters())}


def check_tensors(args: DrafterArgs, tensors: dict[str, mx.array], file: Path, renamed: dict[str, str]) -> None:
    """One-line errors for unknown keys, missing keys, shape mismatches and non-finite weights."""
    orig = {v: k for k, v in renamed.items()}
    want = expected_shapes(args)
    for key in tensors:
        if key not in want:
            raise UserError(f"unexpected key {orig.get(key, key)!r} in {file} for a drafter with num_draft_layers="
                            f"{args.num_draft_layers}, rnn={args.rnn}, exit_dim={args.exit_dim}, "
                            f"hidden_size={args.hidden_size}")
    for key, shape in want.items():
        if key not in tensors:
            raise UserError(f"missing key {key!r} in {file} (config: hidden_size={args.hidden_size}, "
                            f"exit_dim={args.exit_dim}, num_draft_layers={args.num_draft_layers}, rnn={args.rnn})")
        if tuple(tensors[key].shape) != shape:
            raise UserError(f"{file}: {orig.get(key, key)!r} has shape {tuple(tensors[key].shape)}, expected {shape} "
                            f"from the config (hidden_size={args.hidden_size}, exit_dim={args.exit_dim}, "
                            f"vocab_size={args.draft_vocab_size or args.vocab_size})")
    for key, value in tensors.items():
        if mx.issubdtype(value.dtype, mx.floating):
            if not mx.all(mx.isfinite(value)).item():
                raise UserError(f"{file}: tensor {orig.get(key, key)!r} contains NaN or Inf values")
        elif key != "draft_vocab":
            raise UserError(f"{file}: tensor {orig.get(key, key)!r} has non-float dtype {value.dtype}")
    if "draft_vocab" in tensors:
        check_id_array(tensors["draft_vocab"], args.vocab_size, f"{file}: draft_vocab")


def build_drafter(args: DrafterArgs, tensors: dict[str, mx.array], dtype: mx.Dtype, file: Path) -> Drafter:
    """A Drafter holding `tensors` (floats cast to dtype); checks the cast stays finite."""
    cast = {}
    for k, v in tensors.items():
        if k == "draft_vocab":
            cast[k] = v.astype(mx.int32)
        else:
            cast[k] = v.astype(dtype)
            if not mx.all(mx.isfinite(cast[k])).item():
                raise UserError(f"{file}: tensor {k!r} overflows {dtype} (use --dtype float32)")
    drafter = Drafter(args)
    drafter.load_weights(list(cast.items()), strict=True)
    mx.eval(drafter.parameters())
    return drafter


def convert(path: str | Path, out: str | Path | None = None, model: str | None = None, dtype: str = "auto",
            quantize: int | None = None, group_size: int = 64, force: bool = False) -> dict[str, Any]:
    """Convert a PyTorch drafter checkpoint to an MLX drafter directory; returns a summary dict.

    `dtype`: auto (the vocab projection's stored dtype) or a name in DTYPES; `quantize`: None, 4 or 8 bits
    (scales and biases then have that dtype)."""
    check_dtype(dtype)
    if quantize is not None:
        check_quantization(quantize, group_size)
    if out is not None and not str(out).strip():
        raise UserError("--out is empty: give the output directory, or leave --out out for ./<name>-mlx")
    given = Path(path).expanduser()
    if is_medusa(given):  # FasterDecoding/Medusa heads: their own layout and output kind
        if quantize is not None:
            raise UserError("--quantize is not supported for Medusa heads")
        return convert_medusa(given, out, model, dtype, force)
    ckpt = load_checkpoint(given)
    out_dir = Path(out).expanduser() if out else default_out(ckpt.weights_file, given)
    check_out_dir(out_dir, ckpt.weights_file, force)
    target = load_target(model, "float32") if model is not None else None
    target_vocab = target.model.args.vocab_size if target is not None else None
    args, inferred = infer_args(ckpt, target_vocab)
    check_tensors(args, ckpt.tensors, ckpt.weights_file, ckpt.renamed)
    if target is not None:
        check_compatible(args, target.model.args.hidden_size, target.model.args.vocab_size, str(ckpt.weights_file),
                         target.model.args.num_hidden_layers)
    if quantize is not None:
        args.check_quantization(quantize, group_size)
    head = f"lm_head.{args.num_draft_layers}.weight"
    dt = pick_dtype(ckpt.tensors, head, dtype)
    drafter = build_drafter(args, ckpt.tensors, dt, ckpt.weights_file)
    if quantize is not None:
        quantize_drafter(drafter, quantize, group_size)
    save_drafter(drafter, out_dir)
    return {
        "source": str(ckpt.weights_file),
        "config": str(ckpt.weights_file.parent / "config.json") if ckpt.config is not None else None,
        "out": str(out_dir),
        "args": args.to_dict(),
        "inferred": inferred,
        "renamed": ckpt.renamed,
        "source_dtypes": sorted({str(v.dtype).replace("mlx.core.", "") for v in ckpt.tensors.values()}),
        "dtype": str(dt).replace("mlx.core.", ""),
        "quantization": drafter.args.quantization,
        "shapes": {k: list(v.shape) for k, v in ckpt.tensors.items()},
        "num_params": drafter.num_params(),
        "target": None if target is None else {"name": target.name, "hidden_size": target.model.args.hidden_size,
                                               "vocab_size": target.model.args.vocab_size},
    }


def format_summary(s: dict[str, Any]) -> str:
    """Human-readable summary of a conversion."""
    if s.get("kind") == "medusa":
        return format_medusa_summary(s)
    a = s["args"]
    lines = [
        f"converted {s['source']} -> {s['out']}",
        f"  config: {s['config'] or 'none (inferred from tensor shapes)'}"
        + (f"; inferred: {', '.join(s['inferred'])}" if s["inferred"] else ""),
        f"  hidden_size {a['hidden_size']}, exit_dim {a['exit_dim']}, num_draft_layers {a['num_draft_layers']}, "
        f"vocab_size {a['vocab_size']}" + (f", draft_vocab_size {a['draft_vocab_size']}" if a.get("draft_vocab_size")
                                            else "") + f", rnn {a['rnn']}, emb_norm {a['emb_norm']}",
    ]
    if s["renamed"]:
        pairs = list(s["renamed"].items())
        more = f" (+{len(pairs) - 4} more)" if len(pairs) > 4 else ""
        shown = ", ".join(f"{k} -> {v}" for k, v in pairs[:4]) + more
        lines.append(f"  renamed keys: {shown}")
    for k, shape in sorted(s["shapes"].items()):
        lines.append(f"    {k:28s} {tuple(shape)}")
    q = s["quantization"]
    written = s["dtype"] + (f", quantized to {q['bits']} bits (group size {q['group_size']})" if q else "")
    lines.append(f"  parameters: {s['num_params']:,} (source {'/'.join(s['source_dtypes'])}, written as {written})")
    t = s["target"]
    lines.append(f"  target check: ok for {t['name']} (hidden {t['hidden_size']}, vocab {t['vocab_size']})" if t
                 else "  target check: skipped (pass --model to check hidden size and vocabulary)")
    return "\n".join(lines)


app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
PROG = "python -m convert.from_torch"


@app.command()
@one_line_errors
def command(
    path: str = typer.Argument(..., help="model.safetensors, pytorch_model.bin / model.pt, or a directory with one "
                                         "of them (and usually config.json); or Medusa heads "
                                         "(medusa_lm_head.safetensors / .pt)."),
    out: str | None = typer.Option(None, "--out", help="Output drafter directory (default: ./<name>-mlx)."),
    model: str | None = typer.Option(None, "--model", help="Target model to check hidden size and vocabulary "
                                     "against ('default' = the embedded SmolLM2-135M, a .gguf, an mlx-lm directory "
                                     "or a hub repo)."),
    dtype: str = typer.Option("auto", "--dtype", help=f"Weight dtype: auto (keep the source's), "
                                                     f"{', '.join(DTYPES)}."),
    quantize: int | None = typer.Option(None, "--quantize", help="Quantize every linear to 4 or 8 bits (mlx-lm "
                                        "style; smaller files, fast on Metal, slow on a CPU backend)."),
    group_size: int = typer.Option(64, "--group-size", help="Quantization group size: 32, 64 or 128."),
    force: bool = typer.Option(False, "--force", help="Replace an existing output directory."),
) -> None:
    """Import a PyTorch ReDrafter drafter checkpoint (Apple's format) as an MLX drafter directory; Medusa heads in
    the FasterDecoding/Medusa layout (medusa_lm_head.safetensors / .pt) are detected and converted too."""
    typer.echo(format_summary(convert(path, out, model, dtype, quantize, group_size, force)))


def main(argv: list[str] | None = None) -> int:
    """Command line (`python -m convert.from_torch`); returns the exit status (2 = bad input, one error line)."""
    return run_app(app, argv, PROG)


if __name__ == "__main__":
    sys.exit(main())
