"""The target model through Hugging Face transformers' LlamaForCausalLM, with explicit positions and masks."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from bench.torch_ref.compat import cache_kwarg
from mlx_redrafter.errors import UserError


def load_hf_target(spec: str | None = None, device: str = "cpu", dtype: torch.dtype = torch.float32) -> Any:
    """LlamaForCausalLM from the same GGUF (dequantized by transformers) or an unquantized mlx-lm / HF directory."""
    import transformers
    from transformers import AutoModelForCausalLM

    from mlx_redrafter.models.loader import resolve_model

    transformers.logging.set_verbosity_error()
    _, path = resolve_model(spec)
    dtype_kw = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    if path.is_dir():
        import json

        cfg = json.loads((path / "config.json").read_text())
        if cfg.get("quantization") or cfg.get("quantization_config"):
            raise UserError(f"{path} holds MLX-quantized weights, which transformers cannot load: use the GGUF or an "
                            f"unquantized directory for the PyTorch reference")
        model = AutoModelForCausalLM.from_pretrained(str(path), **{dtype_kw: dtype})
    else:
        model = AutoModelForCausalLM.from_pretrained(str(Path(path).parent), gguf_file=Path(path).name,
                                                     **{dtype_kw: dtype})
    return model.to(device).eval()


def save_hf_target(model: Any, folder: Path) -> None:
    """Save a model from `load_hf_target` as an unquantized transformers directory (config.json +
    model.safetensors, tied weights once) that `load_hf_target(str(folder))` reads back with the same values in a
    few seconds, without reading the GGUF again. Written beside `folder` and renamed into place."""
    import copy

    from safetensors.torch import save_file

    part = folder.with_name(folder.name + ".partial")
    part.mkdir(parents=True, exist_ok=True)
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the values are dequantized: the directory holds plain floats
    config.save_pretrained(part)
    tied = bool(config.tie_word_embeddings)
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()
               if not (tied and k == "lm_head.weight")}, str(part / "model.safetensors"))
    part.rename(folder)


def new_cache(model: Any) -> Any:
    """An empty transformers DynamicCache for this model."""
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:
        return DynamicCache()


def cache_len(cache: Any) -> int:
    """Entries in a transformers cache."""
    return int(cache.get_seq_length())


def commit_path(cache: Any, context_len: int, path: list[int]) -> None:
    """Keep the committed context plus the scratch entries `path` (indices after the context), in that order."""
    if hasattr(cache, "layers"):
        for layer in cache.layers:
            idx = torch.tensor(path, device=layer.keys.device) + context_len
            layer.keys = torch.cat([layer.keys[:, :, :context_len], layer.keys[:, :, idx]], dim=2)
            layer.values = torch.cat([layer.values[:, :, :context_len], layer.values[:, :, idx]], dim=2)
    else:
        for i in range(len(cache.key_cache)):
            k, v = cache.key_cache[i], cache.value_cache[i]
            idx = torch.tensor(path, device=k.device) + context_len
            cache.key_cache[i] = torch.cat([k[:, :, :context_len], k[:, :, idx]], dim=2)
            cache.value_cache[i] = torch.cat([v[:, :, :context_len], v[:, :, idx]], dim=2)
        if hasattr(cache, "_seen_tokens"):
            cache._seen_tokens = context_len + len(path)


TAP_EPS = 1e-5  # the runtime's model.TAP_EPS (this module imports no MLX)


def rms_normalized(x: torch.Tensor, eps: float = TAP_EPS) -> torch.Tensor:
    """x / RMS(x) over the last axis, in float32: a tapped layer's output, as a drafter that fuses layers reads it
    (the runtime's `Model` does the same with `model.rms_norm`)."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@contextmanager
def layer_outputs(model: Any, layers: tuple[int, ...]) -> Iterator[dict[int, torch.Tensor]]:
    """The outputs of the named decoder layers of every forward run inside the block, by layer index (the last
    forward's)."""
    caught: dict[int, torch.Tensor] = {}

    def hook(i: int) -> Any:
        def keep(_module: Any, _args: Any, output: Any) -> None:
            caught[i] = output[0] if isinstance(output, tuple) else output
        return keep

    handles = [model.model.layers[i].register_forward_hook(hook(i)) for i in layers]
    try:
        yield caught
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def forward(model: Any, tokens: torch.Tensor, cache: Any = None, positions: torch.Tensor | None = None,
            allowed: torch.Tensor | None = None,
            feature_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, features) for tokens (1, N); `allowed` (N, ctx + N) bool = which keys each token sees. The features
    are the post-norm hidden state, followed by each of `feature_layers`' outputs over its RMS, as the runtime's
    `Model` returns them once a drafter that fuses layers is paired with it.

    Without `allowed` transformers builds its own causal mask.
    """
    mask = None
    if allowed is not None:
        dtype = model.model.embed_tokens.weight.dtype
        mask = torch.zeros(allowed.shape, dtype=dtype, device=tokens.device)
        mask = mask.masked_fill(~allowed.to(tokens.device), torch.finfo(dtype).min)[None, None]
    with layer_outputs(model, tuple(feature_layers)) as caught:
        out = model.model(input_ids=tokens, position_ids=positions, attention_mask=mask, use_cache=cache is not None,
                          **{cache_kwarg(model.model): cache})
    hidden = out.last_hidden_state  # after the final RMSNorm
    taps = [rms_normalized(caught[i]).to(hidden.dtype) for i in feature_layers]
    return model.lm_head(hidden), torch.cat([hidden, *taps], dim=-1) if taps else hidden
