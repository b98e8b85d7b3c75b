"""Quantize a Llama checkpoint into an mlx-lm compatible directory (affine, per-group, like mlx_lm.convert -q).

Input: anything `--model` accepts (mlx-lm / HF directory with safetensors, GGUF file, registry name, hub repo);
quantized inputs are dequantized first. Output: `config.json` with the `quantization` key, `model.safetensors`
(sharded with an index beyond 5 GB) and the tokenizer files, written to a temp directory and renamed into place.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlx_redrafter.errors import UserError
from mlx_redrafter.files import check_writable_dir
from mlx_redrafter.models.loader import DTYPES, dequantize_weights, read_checkpoint, resolve_model

BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "generation_config.json", "chat_template.jinja", "chat_template.json")
SHARD_BYTES = 5 << 30


def check_args(bits: int, group_size: int, dtype: str) -> None:
    """One-line UserErrors for unsupported settings."""
    if bits not in BITS:
        raise UserError(f"--bits must be one of {', '.join(map(str, BITS))} (got {bits})")
    if group_size not in GROUP_SIZES:
        raise UserError(f"--group-size must be one of {', '.join(map(str, GROUP_SIZES))} (got {group_size})")
    if dtype not in DTYPES:
        raise UserError(f"--dtype must be one of {', '.join(DTYPES)} (got {dtype!r})")


def quantize_weights(weights: dict[str, mx.array], bits: int, group_size: int,
                     dtype: mx.Dtype) -> tuple[dict[str, mx.array], int]:
    """mlx-lm layout: every 2-D `.weight` whose rows split into groups becomes (weight, scales, biases); the
    rest is cast to `dtype`. Consumes `weights` (one tensor at a time, to bound memory). Returns (out, count)."""
    out: dict[str, mx.array] = {}
    count = 0
    for key in sorted(weights):
        w = weights.pop(key)
        module = key[: -len(".weight")]
        if key.endswith(".weight") and w.ndim == 2 and w.shape[-1] % group_size == 0:
            q, scales, biases = mx.quantize(w.astype(mx.float32), group_size=group_size, bits=bits)
            new = {key: q, module + ".scales": scales.astype(dtype), module + ".biases": biases.astype(dtype)}
            count += 1
        else:
            new = {key: w.astype(dtype) if mx.issubdtype(w.dtype, mx.floating) else w}
        mx.eval(list(new.values()))
        out.update(new)
    return out, count


def _config(cfg: dict[str, Any], weights: dict[str, mx.array], tokenizer: Any, bits: int, group_size: int,
            dtype: str) -> dict[str, Any]:
    cfg = {k: v for k, v in cfg.items() if k not in ("quantization", "quantization_config", "_name_or_path")}
    cfg.setdefault("model_type", "llama")
    cfg.setdefault("architectures", ["LlamaForCausalLM"])
    cfg["tie_word_embeddings"] = "lm_head.weight" not in weights
    if "eos_token_id" not in cfg and tokenizer.eos_ids:
        cfg["eos_token_id"] = tokenizer.eos_ids if len(tokenizer.eos_ids) > 1 else tokenizer.eos_ids[0]
    cfg["torch_dtype"] = dtype
    q = {"group_size": group_size, "bits": bits, "mode": "affine"}
    cfg["quantization"], cfg["quantization_config"] = q, dict(q)
    return dict(sorted(cfg.items()))


def _save_weights(out_dir: Path, weights: dict[str, mx.array]) -> int:
    shards: list[dict[str, mx.array]] = []
    size = 0
    for k, v in weights.items():
        if not shards or size + v.nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += v.nbytes
    names = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, shard in zip(names, shards):
        mx.save_safetensors(str(out_dir / name), shard, metadata={"format": "mlx"})
    total = sum(v.nbytes for v in weights.values())
    if len(shards) > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": {k: n for n, s in zip(names, shards) for k in sorted(s)}}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return total


def _replace_dir(tmp: Path, dst: Path) -> None:
    """Move the finished temp directory into place (an existing `dst` is swapped out, then removed)."""
    if not dst.exists():
        os.rename(tmp, dst)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old.", dir=dst.parent))
    os.rename(dst, old / dst.name)
    os.rename(tmp, dst)
    shutil.rmtree(old, ignore_errors=True)


def quantize(src: str, dst: str | Path, bits: int = 4, group_size: int = 64, dtype: str = "float16",
             overwrite: bool = False) -> dict[str, Any]:
    """Quantize model `src` into the mlx-lm directory `dst`; returns a summary. Never leaves a partial `dst`."""
    check_args(bits, group_size, dtype)
    dst = Path(dst).expanduser()
    here = Path.cwd().resolve()
    if not str(dst).strip() or dst.resolve() in (here, *here.parents):
        raise UserError(f"output directory {str(dst)!r} is the current directory or one above it: name a new "
                        "directory")
    if dst.exists() and not dst.is_dir():
        raise UserError(f"output directory {dst} is a file: choose a new directory")
    if dst.exists() and not overwrite:
        raise UserError(f"{dst} already exists: choose a new directory or pass --overwrite")
    if dst.exists() and any(dst.iterdir()) and not (dst / "config.json").is_file():
        raise UserError(f"{dst} holds files but no model (no config.json): --overwrite replaces only a model "
                        "directory; choose a new directory")
    check_writable_dir(dst, "output directory")
    name, path = resolve_model(src)
    cfg, weights, quant, tokenizer = read_checkpoint(path)
    full, _ = dequantize_weights(weights, quant, mx.float32)
    del weights
    out, count = quantize_weights(full, bits, group_size, DTYPES[dtype])
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp.", dir=dst.parent))
    try:
        nbytes = _save_weights(tmp, out)
        config = _config(cfg, out, tokenizer, bits, group_size, dtype)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if path.is_dir():
            files = [f for f in TOKENIZER_FILES if (path / f).exists()]
            for f in files:
                shutil.copy2(path / f, tmp / f)
        else:
            files = tokenizer.save(tmp)
        os.chmod(tmp, 0o755)
        _replace_dir(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    params = sum(v.size * 32 // bits if v.dtype == mx.uint32 else v.size for k, v in out.items()
                 if not k.endswith((".scales", ".biases")))
    return {"src": name, "dst": str(dst), "bits": bits, "group_size": group_size, "dtype": dtype,
            "quantized_modules": count, "requantized": bool(quant), "size_mb": round(nbytes / 1e6, 1),
            "bits_per_weight": round(nbytes * 8 / params, 3), "tokenizer_files": files}
