"""Read a Llama GGUF file: model config, weights in mlx-lm naming, and tokenizer metadata.

The file is checked in Python before MLX reads it (MLX's GGUF reader does no bounds checks): its layout
(`gguf_header`), then its metadata (`check_metadata`: the keys a Llama model and its tokenizer need, with types
and ranges) and its tensor table against that config (`check_tensors`: every weight present, with the shape and a
type the loader handles). Only then does `mx.load` read the tensors.

`mx.load` returns F32/F16 tensors as-is and Q4_0/Q4_1/Q8_0 as MLX quantized triples (weight, scales,
biases). GGUF stores the q/k projection rows permuted for llama.cpp's interleaved rotary layout; we undo
that permutation (on whole rows, so quantized rows move with their scales and biases) so the standard
half-split RoPE of `model.py` applies.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx

from mlx_redrafter.errors import UserError
from mlx_redrafter.models.config import check_model_config
from mlx_redrafter.models.gguf_header import GGUFHeader, TensorInfo, read_header
from mlx_redrafter.schema import MAX_CONTEXT, MAX_FFN, MAX_HEADS, MAX_LAYERS, MAX_VOCAB, MAX_WIDTH, Field, shown

_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_OPTIONAL = {"output"}  # tied to token_embd when absent
_MLX_QUANTIZED = {"Q4_0", "Q4_1", "Q8_0"}  # become (weight, scales, biases) triples: matrices only

P = "llama."
# The metadata a Llama model needs (GGUF key names), with types and ranges.
MODEL_KEYS = (
    Field(P + "embedding_length", int, 1, MAX_WIDTH, required=True),
    Field(P + "block_count", int, 1, MAX_LAYERS, required=True),
    Field(P + "feed_forward_length", int, 1, MAX_FFN, required=True),
    Field(P + "attention.head_count", int, 1, MAX_HEADS, required=True),
    Field(P + "attention.head_count_kv", int, 1, MAX_HEADS),
    Field(P + "attention.layer_norm_rms_epsilon", float, hi=1.0, positive=True),
    Field(P + "rope.freq_base", float, positive=True),
    Field(P + "context_length", int, 1, MAX_CONTEXT),
    Field(P + "vocab_size", int, 1, MAX_VOCAB),
    Field(P + "rope.dimension_count", int, 2, 4096),
    Field(P + "rope.scaling.type", str),
    Field(P + "rope.scaling.factor", float, hi=1e6, positive=True),
)
TOKENIZER_KINDS = ("gpt2", "llama")  # byte-level BPE, SentencePiece
TOKENIZER_KEYS = (
    Field("tokenizer.ggml.model", str, choices=TOKENIZER_KINDS, required=True),
    Field("tokenizer.ggml.pre", str),
    Field("tokenizer.ggml.add_space_prefix", bool),
    Field("tokenizer.chat_template", str),
)
TOKEN_ID_KEYS = ("bos", "eos", "unknown", "padding")  # tokenizer.ggml.{key}_token_id: ids inside the vocabulary


def _where(path: str) -> str:
    return f"GGUF file {path}"


def check_metadata(meta: dict[str, Any], path: str) -> None:
    """One-line UserError unless the metadata describes a Llama model and a tokenizer we can build: the required
    keys with their types and ranges, a vocabulary (and merges for BPE) of strings, per-token arrays as long as the
    vocabulary, and special-token ids inside it."""
    where = _where(path)
    arch = meta.get("general.architecture")
    if arch is None:
        raise UserError(f"the {where} has no model metadata (general.architecture): is the file complete?")
    if arch != "llama":
        raise UserError(f"GGUF architecture {shown(arch)} is not supported (only 'llama' family models)")
    for f in (*MODEL_KEYS, *TOKENIZER_KEYS):
        f.check(meta, where)
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise UserError(f"{where} has no vocabulary (tokenizer.ggml.tokens: a non-empty array of strings): "
                        f"re-export it with its tokenizer")
    if len(tokens) > MAX_VOCAB:
        raise UserError(f"{where}: tokenizer.ggml.tokens has {len(tokens):,} entries (at most {MAX_VOCAB:,})")
    if meta["tokenizer.ggml.model"] == "gpt2":
        merges = meta.get("tokenizer.ggml.merges")
        if not isinstance(merges, list) or not all(isinstance(m, str) and " " in m.strip(" ") for m in merges):
            raise UserError(f"{where} has a BPE tokenizer without merges (tokenizer.ggml.merges: an array of "
                            f"'left right' strings): re-export it with its tokenizer")
    for key, kind in (("tokenizer.ggml.token_type", int), ("tokenizer.ggml.scores", float)):
        values = meta.get(key)
        if values is not None and (not isinstance(values, list) or len(values) != len(tokens)
                                   or not all(type(v) in (int, kind) for v in values)):
            raise UserError(f"{where}: {key} must be an array of {len(tokens):,} numbers, one per token")
    for name in TOKEN_ID_KEYS:
        key = f"tokenizer.ggml.{name}_token_id"
        Field(key, int, 0, len(tokens) - 1).check(meta, where)


def gguf_config(meta: dict[str, Any], path: str = "") -> dict[str, Any]:
    """mlx-lm style config.json dict from (checked) GGUF metadata."""
    n_heads = meta[P + "attention.head_count"]
    hidden = meta[P + "embedding_length"]
    cfg = {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": meta[P + "block_count"],
        "intermediate_size": meta[P + "feed_forward_length"],
        "num_attention_heads": n_heads,
        "num_key_value_heads": meta.get(P + "attention.head_count_kv", n_heads),
        "rms_norm_eps": float(meta.get(P + "attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(meta.get(P + "rope.freq_base", 10000.0)),
        "max_position_embeddings": meta.get(P + "context_length", 4096),
        "vocab_size": meta.get(P + "vocab_size") or len(meta["tokenizer.ggml.tokens"]),
        "head_dim": meta.get(P + "rope.dimension_count", hidden // n_heads),
    }
    factor = meta.get(P + "rope.scaling.factor")
    if factor and meta.get(P + "rope.scaling.type") == "linear":
        cfg["rope_scaling"] = {"type": "linear", "factor": float(factor)}
    check_model_config(cfg, f"the config of {_where(path)}")
    return cfg


def module_name(tensor: str) -> tuple[str, str] | None:
    """(mlx-lm module, GGUF short name) of a GGUF tensor name such as `blk.3.attn_q.weight`; None for tensors this
    architecture does not use (e.g. rope_freqs) or names of another layout."""
    parts = tensor.split(".")
    if parts[0] == "blk":
        if len(parts) < 4 or not parts[1].isdigit() or parts[2] not in _NAMES:
            return None
        return f"model.layers.{int(parts[1])}.{_NAMES[parts[2]]}", parts[2]
    if len(parts) < 2 or parts[0] not in _NAMES:
        return None
    return _NAMES[parts[0]], parts[0]


def expected_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> shape (MLX order) of every weight of a Llama with this config (`output` optional)."""
    h, v, ff, hd = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    layer = {"attn_norm": (h,), "ffn_norm": (h,), "attn_q": (q, h), "attn_k": (kv, h), "attn_v": (kv, h),
             "attn_output": (h, q), "ffn_gate": (ff, h), "ffn_up": (ff, h), "ffn_down": (h, ff)}
    shapes = {"token_embd.weight": (v, h), "output_norm.weight": (h,), "output.weight": (v, h)}
    for i in range(cfg["num_hidden_layers"]):
        shapes.update({f"blk.{i}.{k}.weight": s for k, s in layer.items()})
    return shapes


def check_tensors(tensors: list[TensorInfo], cfg: dict[str, Any], path: str) -> None:
    """One-line UserError unless the tensor table holds every weight of this config with its shape, and nothing
    the loader would misread (a quantized vector, a weight under an unexpected name)."""
    where = _where(path)
    want = expected_shapes(cfg)
    have = {t.name: t for t in tensors}
    for name, shape in want.items():
        t = have.get(name)
        if t is None:
            if name.split(".")[0] in _OPTIONAL:
                continue
            raise UserError(f"{where} lacks tensor {name}: not a complete Llama model (block_count "
                            f"{cfg['num_hidden_layers']})")
        if t.shape != shape:
            raise UserError(f"{where}: tensor {name} has shape {t.shape}, expected {shape} from its metadata")
        if t.type.name in _MLX_QUANTIZED and len(shape) != 2:
            raise UserError(f"{where}: tensor {name} is a vector stored as {t.type.name}: only matrices can be")
    for name in have:
        if name not in want and module_name(name) is not None:
            raise UserError(f"{where}: unexpected tensor {name} for a Llama with {cfg['num_hidden_layers']} blocks")


def check_gguf(header: GGUFHeader, path: str) -> dict[str, Any]:
    """The model config of a GGUF file whose layout `gguf_header` has checked, after checking its metadata and its
    tensor table against that config; one-line UserErrors. Everything `read_gguf` checks before MLX reads."""
    check_metadata(header.metadata, path)
    cfg = gguf_config(header.metadata, path)
    check_tensors(header.tensors, cfg, path)
    return cfg


def read_gguf(path: str | Path) -> tuple[dict[str, mx.array], dict[str, Any], dict[str, Any]]:
    """(raw GGUF tensors, metadata as Python values, model config) of a checked GGUF file; one-line UserErrors
    for anything malformed, before MLX reads the file."""
    path = str(path)
    header = read_header(path)
    cfg = check_gguf(header, path)
    try:
        tensors = mx.load(path, format="gguf")
    except Exception as e:  # MLX raises RuntimeError/ValueError with long messages
        raise UserError(f"cannot read GGUF file {path}: {str(e).splitlines()[0]} (is the file complete?)") from None
    return tensors, header.metadata, cfg


def _unpermute_rows(w: mx.array, n_heads: int) -> mx.array:
    # llama.cpp: rows of head h are stored as (pairs, 2) interleaved; back to (2, pairs) halves.
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_weights(tensors: dict[str, mx.array], cfg: dict[str, Any]) -> tuple[dict[str, mx.array], dict]:
    """Weights renamed to mlx-lm keys with q/k rows un-permuted, plus per-module quantization info."""
    out: dict[str, mx.array] = {}
    quant: dict[str, dict[str, int]] = {}
    for key, value in tensors.items():
        found = module_name(key)  # MLX names a quantized tensor's parts NAME.weight / .scales / .biases
        if found is None:
            continue  # e.g. rope_freqs: not used by this architecture
        prefix, short = found
        if short == "attn_q":
            value = _unpermute_rows(value, cfg["num_attention_heads"])
        elif short == "attn_k":
            value = _unpermute_rows(value, cfg["num_key_value_heads"])
        out[f"{prefix}.{key.rsplit('.', 1)[1]}"] = value
    for name, scales in out.items():
        if name.endswith(".scales"):
            module = name[: -len(".scales")]
            in_features = _in_features(module, cfg)
            bits = out[module + ".weight"].shape[1] * 32 // in_features
            quant[module] = {"bits": bits, "group_size": in_features // scales.shape[1]}
    return out, quant


def _in_features(module: str, cfg: dict[str, Any]) -> int:
    if module.endswith("o_proj"):
        return cfg["num_attention_heads"] * cfg["head_dim"]
    if module.endswith("down_proj"):
        return cfg["intermediate_size"]
    return cfg["hidden_size"]
