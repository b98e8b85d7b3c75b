"""Reading PyTorch-side drafter checkpoints for the converters (`convert.from_torch`, `convert.medusa`): where the
weights and config.json are, their tensors (safetensors, or a torch state dict read with
`torch.load(weights_only=True)`, so no pickled code ever runs), the output dtype and the output directory rules.
Every problem is a one-line UserError."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlx_redrafter.draft.redrafter import check_replaceable
from mlx_redrafter.errors import UserError
from mlx_redrafter.files import check_writable_dir, read_json
from mlx_redrafter.models import safetensors_header
from mlx_redrafter.models.loader import DTYPES

WEIGHT_NAMES = ("model.safetensors", "drafter.safetensors", "pytorch_model.bin", "model.pt", "model.pth")


def read_config(file: Path) -> dict[str, Any]:
    """A checkpoint's config.json: a UTF-8 JSON object, else a one-line UserError."""
    return read_json(file, "checkpoint config")


def find_checkpoint(path: Path) -> tuple[Path, Path | None]:
    """(weights file, config.json or None) for a checkpoint file or directory."""
    if not path.exists():
        raise UserError(f"{path} does not exist (give a model.safetensors, pytorch_model.bin, model.pt or a directory)")
    if path.is_dir():
        found = [path / n for n in WEIGHT_NAMES if (path / n).is_file()]
        if not found:
            found = sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin")) + sorted(path.glob("*.pt"))
        if not found:
            raise UserError(f"{path} holds no model.safetensors, pytorch_model.bin or model.pt")
        weights = found[0]
    else:
        weights = path
    cfg = weights.parent / "config.json"
    return weights, (cfg if cfg.is_file() else None)


def _read_safetensors(file: Path) -> dict[str, mx.array]:
    safetensors_header.read_header(file)  # MLX reads only a file whose layout is checked
    try:
        return dict(mx.load(str(file), format="safetensors"))
    except Exception as e:
        raise UserError(f"cannot read {file}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def _torch_to_mx(key: str, value: Any, file: Path) -> mx.array:
    import torch

    if not isinstance(value, torch.Tensor):
        raise UserError(f"{file}: entry {key!r} is a {type(value).__name__}, not a tensor")
    if value.layout != torch.strided:
        raise UserError(f"{file}: tensor {key!r} has layout {value.layout} (a sparse tensor); save it dense "
                        f"(tensor.to_dense()) and convert again")
    if value.is_quantized:
        raise UserError(f"{file}: tensor {key!r} is quantized ({value.dtype}); save it dequantized "
                        f"(tensor.dequantize()) and convert again")
    if value.device.type == "meta":
        raise UserError(f"{file}: tensor {key!r} is on the meta device (a shape without data); save the real "
                        f"weights and convert again")
    supported = (torch.float16, torch.float32, torch.float64, torch.bfloat16, torch.bool, torch.uint8, torch.int8,
                 torch.int16, torch.int32, torch.int64)
    if value.dtype not in supported:
        raise UserError(f"{file}: tensor {key!r} has unsupported dtype {value.dtype}")
    t = value.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return mx.array(t.float().numpy()).astype(mx.bfloat16)
    arr = mx.array(t.numpy())
    return arr.astype(mx.float32) if arr.dtype == mx.float64 else arr


def _read_torch(file: Path) -> dict[str, mx.array]:
    try:
        import torch
    except ImportError:
        raise UserError(f"reading {file.name} needs PyTorch: pip install 'mlx-redrafter[torch]' (or convert the "
                        f"checkpoint to safetensors)") from None
    try:
        with warnings.catch_warnings():  # torch's deprecation notes on old storages / quantized tensors
            warnings.simplefilter("ignore")
            obj = torch.load(str(file), map_location="cpu", weights_only=True)
    except Exception as e:
        msg = str(e)
        if "weights_only" in msg or "Unsupported global" in msg or "Unpickl" in type(e).__name__:
            raise UserError(f"refusing to load {file}: it holds pickled objects other than tensors (possibly code); "
                            f"only plain state dicts are read (torch.load weights_only=True)") from None
        first = msg.splitlines()[0] if msg else type(e).__name__
        raise UserError(f"cannot read {file} (corrupt or truncated torch file?): {first}") from None
    if isinstance(obj, dict) and len(obj) == 1 and next(iter(obj)) in ("state_dict", "model", "module"):
        obj = next(iter(obj.values()))
    elif isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict):
        raise UserError(f"{file} holds a {type(obj).__name__}, not a state dict of tensors")
    return {str(k): _torch_to_mx(str(k), v, file) for k, v in obj.items()}


def read_tensors(file: Path) -> dict[str, mx.array]:
    """All tensors of a checkpoint file as MLX arrays (safetensors or a torch state dict)."""
    if file.stat().st_size == 0:
        raise UserError(f"{file} is empty")
    with file.open("rb") as f:
        magic = f.read(4)
    if file.suffix == ".safetensors" or (not magic.startswith(b"PK") and magic[:1] != b"\x80"
                                         and file.suffix not in (".bin", ".pt", ".pth")):
        return _read_safetensors(file)
    return _read_torch(file)


def check_dtype(dtype: str) -> None:
    """One-line error unless `dtype` is auto or a name in `mlx_redrafter.models.loader.DTYPES`."""
    if dtype != "auto" and dtype not in DTYPES:
        raise UserError(f"unknown --dtype {dtype!r}; choose auto, {', '.join(DTYPES)}")


def pick_dtype(tensors: dict[str, mx.array], key: str, dtype: str) -> mx.Dtype:
    if dtype == "auto":
        src = tensors[key].dtype
        return src if src in DTYPES.values() else mx.float32
    return DTYPES[dtype]


def default_out(weights_file: Path, given: Path) -> Path:
    """`<name>-mlx` in the current directory, name = the checkpoint directory (or file stem)."""
    name = given.name if given.is_dir() else (
        weights_file.parent.name if weights_file.name in WEIGHT_NAMES else weights_file.stem)
    return Path.cwd() / f"{name or 'drafter'}-mlx"


def check_out_dir(out_dir: Path, weights_file: Path, force: bool) -> None:
    """One-line error if `out_dir` holds something (without --force; with it, files a drafter save would not
    write), cannot be a directory (a file, or under one), or is the checkpoint's own directory."""
    check_writable_dir(out_dir, "output")
    if out_dir.exists() and any(out_dir.iterdir()) and not force:
        raise UserError(f"output {out_dir} already exists: pass --force to replace it, or choose --out")
    check_replaceable(out_dir, "output")
    if out_dir.resolve() == weights_file.parent.resolve():
        raise UserError(f"output {out_dir} is the checkpoint's own directory: choose another --out")
