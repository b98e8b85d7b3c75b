"""Llama-family target model in MLX (mlx-lm style), with per-token positions and explicit masks.

One forward serves prefill, one-token steps and the packed tree verification block: callers give the
token ids, the KV cache, each token's RoPE position and (for more than one token) a boolean attention mask
over the cache's visible keys. It returns logits and the post-norm hidden states. Rows of a batch with different
numbers of new tokens can run `Ragged`: the per-token products see only the real tokens.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_redrafter.cache import KVCache
from mlx_redrafter.system import attention_kernel, packed_linear, vector_math


@dataclass
class ModelArgs:
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    rms_norm_eps: float = 1e-5
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    mlp_bias: bool = False
    model_type: str = "llama"
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelArgs:
        known = {f for f in cls.__dataclass_fields__ if f != "extra"}
        args = {k: v for k, v in cfg.items() if k in known and v is not None}  # null in config.json: the default
        return cls(**args, extra={k: v for k, v in cfg.items() if k not in known})


def inverse_frequencies(args: ModelArgs) -> tuple[mx.array, float]:
    """RoPE inverse frequencies (head_dim / 2,) float32 and the position scale, honouring linear and llama3
    rope scaling (as transformers / mlx-lm define them)."""
    dims = args.head_dim
    base = args.rope_theta ** (np.arange(0, dims, 2, dtype=np.float64) / dims)  # wavelength / 2pi per pair
    scaling = args.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in ("default", None):
        return mx.array((1.0 / base).astype(np.float32)), 1.0
    if kind == "linear":
        return mx.array((1.0 / base).astype(np.float32)), 1.0 / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
        wavelens = 2 * math.pi * base
        freqs = np.where(wavelens > old_ctx / low, base * factor, base)
        is_medium = (wavelens > old_ctx / high) & (wavelens < old_ctx / low)
        smooth = (old_ctx / wavelens - low) / (high - low)
        freqs = np.where(is_medium, freqs / ((1 - smooth) / factor + smooth), freqs)
        return mx.array((1.0 / freqs).astype(np.float32)), 1.0
    raise ValueError(f"unsupported rope_scaling type {kind!r}")


@mx.compile
def apply_rope(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """Rotate x (B, N, heads, D) by per-token angles: cos/sin (B, N, 1, D/2) (half-split layout)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return mx.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


LOG2E = 1.4426950408889634


@partial(mx.compile, shapeless=True)
def _silu_mul_cpu(g: mx.array, u: mx.array) -> mx.array:
    return g / (1.0 + mx.power(2.0, -LOG2E * g)) * u  # MLX's CPU exp is slow; 2**x is not


@partial(mx.compile, shapeless=True)
def _softmax_cpu_compiled(x: mx.array) -> mx.array:
    e = mx.power(2.0, LOG2E * (x - mx.max(x, axis=-1, keepdims=True)))
    return e / e.sum(axis=-1, keepdims=True)


def _softmax_cpu(x: mx.array) -> mx.array:
    """Softmax over the last axis with exp as a power of two (see silu_mul). A size-1 axis (one visible key)
    gives 1: MLX's shapeless compile crashes on it."""
    return _softmax_cpu_compiled(x) if x.shape[-1] > 1 else mx.ones_like(x)


@partial(mx.compile, shapeless=True)
def _rms_norm_compiled(x: mx.array, weight: mx.array, eps: float, inv_dim: float) -> mx.array:
    n = x.astype(mx.float32)
    n = n * mx.rsqrt(mx.sum(mx.square(n), axis=-1, keepdims=True) * inv_dim + eps)
    return n.astype(x.dtype) * weight


@partial(mx.compile, shapeless=True)
def _over_rms_compiled(x: mx.array, eps: float, inv_dim: float) -> mx.array:
    return x * mx.rsqrt(mx.sum(mx.square(x), axis=-1, keepdims=True) * inv_dim + eps)


def rms_norm(x: mx.array, weight: mx.array | None, eps: float) -> mx.array:
    """x over its RMS along the last axis, times `weight` where given (`mx.fast.rms_norm`; a tapped layer's state
    takes none). MLX's CPU backend has no fused kernel for it: its fallback is ~10-15 graph nodes, each with its
    own dispatch cost. On a CPU in float32 our kernel takes it in one node (`vector_math.rms_norm`), elsewhere on a
    CPU one compiled graph of 3 nodes; both compute the fallback's arithmetic step for step (the mean of squares as
    a sum times 1 / dim): the same bits."""
    fast = vector_math.rms_norm(x, weight, eps)
    if fast is not None:
        return fast
    if mx.default_device() != mx.cpu:
        return mx.fast.rms_norm(x, weight, eps)
    inv_dim = 1.0 / x.shape[-1]
    return _over_rms_compiled(x, eps, inv_dim) if weight is None else _rms_norm_compiled(x, weight, eps, inv_dim)


class RMSNorm(nn.RMSNorm):
    """`nn.RMSNorm` through `rms_norm` (one node on a CPU, the same bits)."""

    def __call__(self, x: mx.array) -> mx.array:
        return rms_norm(x, self["weight"], self.eps)


def silu_mul(g: mx.array, u: mx.array) -> mx.array:
    """SiLU(g) * u (the Llama MLP's gate). On a CPU in float32 our vector-math kernel (`system/vector_math.py`: one
    pass in vector registers); elsewhere on a CPU exp as a power of two in one fused kernel (~3x faster than MLX's
    exp there); the same function to float rounding."""
    fast = vector_math.silu_mul(g, u)
    if fast is not None:
        return fast
    if mx.default_device() == mx.cpu:
        return _silu_mul_cpu(g, u)
    return nn.silu(g) * u


def silu_mul_halves(gu: mx.array) -> mx.array:
    """`silu_mul` of the two halves of gu's last axis (an MLP's fused gate and up products side by side). On a CPU
    in float32 one node of our kernel reads them in place (a split and two copies otherwise)."""
    fast = vector_math.silu_mul_halves(gu)
    if fast is not None:
        return fast
    return silu_mul(*mx.split(gu, 2, axis=-1))


def attention(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: mx.array | None,
              windows: tuple[tuple[int, int, int], ...] | None = None) -> mx.array:
    """Softmax attention with grouped KV heads: q (B, h, N, D), k/v (B, h_kv, S, D), mask (B|1, 1, N, S) bool
    (on a CPU also as `grouped_mask` made it, once for every layer). `windows` (the cache's `key_windows`): blocks
    of rows (first, end, first key) whose mask hides every key before the block's first; where our kernel takes
    attention, each block attends from there on (the same bits, less work where rows start late in a batch's
    cache); elsewhere they are ignored.

    On a GPU MLX's fused kernel is used. MLX's CPU backend has no fused kernel (its fallback repeats the KV
    heads and is ~1.5x slower), so there the query heads that share a KV head are folded into one matrix
    product per KV head: the same arithmetic per head, in two BLAS calls instead of many small ones. In float32
    our kernel takes the softmax and the value product in one dispatch (`system/attention_kernel.py`; 2-3x
    faster than MLX's element-wise passes).
    """
    if mx.default_device() != mx.cpu:
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    B, h, N, D = q.shape
    h_kv = k.shape[1]
    if windows is not None and attention_kernel.usable(q.dtype):
        rows = mask is not None and mask.shape[0] > 1
        return mx.concatenate([attention(q[a:b], k[a:b, :, lo:], v[a:b, :, lo:], scale,
                                         None if mask is None else mask[a:b, ..., lo:] if rows else mask[..., lo:])
                               for a, b, lo in windows])
    if attention_kernel.usable(q.dtype):
        scores = q.reshape(B, h_kv, h // h_kv * N, D) @ k.swapaxes(-1, -2)
        return attention_kernel.softmax_values(scores, v, scale, N, mask).reshape(B, h, N, D)
    scores = (q * scale).reshape(B, h_kv, h // h_kv * N, D) @ k.swapaxes(-1, -2)  # (B, h_kv, r*N, S): rows (head, n)
    if mask is not None:
        scores = mx.where(grouped_mask(mask, h // h_kv, N), scores, -mx.inf)
    return (_softmax_cpu(scores) @ v).reshape(B, h, N, D)


def grouped_mask(mask: mx.array, group: int, n: int) -> mx.array:
    """On a CPU, the mask (B|1, 1, n, S) repeated for the `group` query heads that share a KV head (rows (head, n),
    as `attention` orders the scores); one already repeated, or any mask on a GPU, is returned as it is."""
    if mx.default_device() != mx.cpu or group == 1 or mask.shape[-2] == group * n:
        return mask
    return mx.tile(mask, (1, 1, group, 1))


def held(pairs: list[tuple[nn.Module, mx.array]]) -> bool:
    """Whether every module still holds the weight it held when paired with it (not replaced since)."""
    return all(module["weight"] is w for module, w in pairs)


class PackedWeights:
    """A float32 layer's weight as the quantized weight it was dequantized from (MLX's affine quantization: packed
    values, float32 scales and biases), for `packed_linear`'s products: the bits of the float32 product at a quarter
    (4-bit) or half (8-bit) of the bytes. Serves while the kernel takes the call (`takes`)."""

    def __init__(self, weight: mx.array, scales: mx.array, biases: mx.array, bits: int, group_size: int,
                 source: mx.array | None = None):
        self.weight, self.scales, self.biases = weight, scales.astype(mx.float32), biases.astype(mx.float32)
        self.bits, self.group_size = bits, group_size
        self.source = source  # the float32 weight it stands for (a layer that holds another no longer uses it)
        mx.eval(self.weight, self.scales, self.biases)

    @classmethod
    def attach(cls, layer: nn.Module, weight: mx.array, scales: mx.array, biases: mx.array, bits: int,
               group_size: int) -> None:
        """Give a float32 `nn.Linear` or `nn.Embedding` (its vocabulary projection) the quantized weight its
        float32 weight was dequantized from."""
        layer.packed = cls(weight, scales, biases, bits, group_size, layer.weight)

    def current(self, layer: nn.Module) -> bool:
        """`layer` still holds the float32 weight this stands for."""
        return held([(layer, self.source)])

    @staticmethod
    def supported(bits: int, group_size: int) -> bool:
        """4- or 8-bit, groups of a multiple of 16 values, and a kernel whose sums have the float32 products' order
        (the small-GEMM kernel's, AVX-512 or AVX2, up to `packed_linear.max_rows()` rows)."""
        return bits in (4, 8) and group_size % 16 == 0 and packed_linear.max_rows() > 0

    @staticmethod
    def takes(x: mx.array, kept_quantized: bool = False) -> bool:
        """Whether a product of x (..., K) reads the packed weight: few rows (a prefill's arithmetic dominates);
        `kept_quantized`: for a layer without float32 weights, whose alternative is dequantizing them."""
        return math.prod(x.shape[:-1]) <= packed_linear.max_rows(kept_quantized)

    def __call__(self, x: mx.array) -> mx.array:
        return packed_linear.quantized_product(x, self.weight, self.scales, self.biases, self.bits, self.group_size)

    def dequantized(self) -> mx.array:
        """The float32 weight these stand for (lazy; made anew at each call)."""
        return packed_linear.dequantize(self.weight, self.scales, self.biases, self.bits, self.group_size)

    @classmethod
    def stacked(cls, parts: list[PackedWeights]) -> PackedWeights | None:
        """The rows of several packed weights as one (a fused product's), or None if their formats differ."""
        if len({(p.bits, p.group_size) for p in parts}) != 1:
            return None
        return cls(*(mx.concatenate([getattr(p, k) for p in parts]) for k in ("weight", "scales", "biases")),
                   parts[0].bits, parts[0].group_size)


class StackedProduct:
    """Several linears over the same input computed as one product (`product`), their outputs split apart again; used
    while the layers still hold the weights they held when it was built (`held`)."""

    splits: list[int]
    held: list[tuple[nn.Module, mx.array]]

    def product(self, x: mx.array) -> mx.array:
        raise NotImplementedError

    def current(self) -> bool:
        return held(self.held)

    def __call__(self, x: mx.array) -> list[mx.array]:
        y = self.product(x)
        return mx.split(y, self.splits, axis=-1) if self.splits else [y]


class FusedLinear(StackedProduct):
    """One or several bias-free or all-biased `nn.Linear`s over the same input as one matrix product with a
    pre-transposed weight: fewer, larger products (one pass over the weights instead of several) and fewer graph
    nodes per call (no transpose, no split when one layer). Built at load time: the layers' weights become views
    into the fused matrix, so parameters, checkpoints and memory are unchanged. If a layer's weight is replaced
    later (new weights loaded, a dtype change), `current()` turns False and callers use the layers."""

    def __init__(self, layers: list[nn.Linear], stacked: mx.array | None = None):
        """`stacked`: the layers' weights already stacked in one array (as the loader dequantizes them), taken as
        it is instead of copied together."""
        self.layers = layers
        parts = [layer.packed if getattr(layer, "packed", None) is not None and layer.packed.current(layer)
                 else None for layer in layers]
        self.packed = (PackedWeights.stacked(parts) if "bias" not in layers[0] and None not in parts
                       else None)  # the quantized source of the float32 weight, where the model has one
        if self.packed is not None:
            for layer in layers:  # their rows live on in the stacked copy; the layers' own views replace them below
                layer.packed = None
        if stacked is None:  # (sum of outputs, in)
            stacked = layers[0].weight if len(layers) == 1 else mx.concatenate([layer.weight for layer in layers])
        self.weight = stacked
        self.bias = mx.concatenate([layer.bias for layer in layers]) if "bias" in layers[0] else None
        self.weight_t = self.weight.T  # a view: the product reads the weight as it is stored
        mx.eval(self.weight, self.weight_t, *([] if self.bias is None else [self.bias]))
        sizes = [layer.weight.shape[0] for layer in layers]
        self.splits = list(np.cumsum(sizes)[:-1])
        start = 0
        for layer, n in zip(layers, sizes):
            layer.weight = self.weight[start : start + n]
            if self.bias is not None:
                layer.bias = self.bias[start : start + n]
            start += n
        mx.eval([layer.parameters() for layer in layers])
        self.held = [(layer, layer.weight) for layer in layers]  # each layer with the view it must still hold

    @staticmethod
    def supported(layers: list[nn.Module]) -> bool:
        """Plain (not quantized) linears of one dtype, all with or all without bias."""
        return (all(type(layer) is nn.Linear for layer in layers)
                and len({layer.weight.dtype for layer in layers}) == 1
                and len({"bias" in layer for layer in layers}) == 1)

    def product(self, x: mx.array) -> mx.array:
        """x @ (the layers' weights, stacked)^T (+ bias): every layer's outputs side by side."""
        if self.packed is not None and PackedWeights.takes(x):
            return self.packed(x)
        return x @ self.weight_t if self.bias is None else mx.addmm(self.bias, x, self.weight_t)


class QuantizedFusedLinear(StackedProduct):
    """One or several bias-free `nn.QuantizedLinear`s over the same input, on a CPU backend with float32
    activations, as one product from their quantized weights alone: up to `packed_linear.max_rows(kept_quantized=True)`
    rows (decoding, verification and batched steps) through the packed-weight kernel, more (prefills) from the
    weights dequantized for that product into the BLAS.
    MLX's own CPU quantized products cost ~30-50 ms per row for a 49152 x 576 matrix, ours what reading the weights
    costs. The float32 bits of the dequantized weights' products, as the float32 model has them. Built at load time:
    the layers' packed arrays become views into the stacked ones; `current()` as for `FusedLinear`."""

    def __init__(self, layers: list[nn.Module]):
        self.layers = layers
        self.packed = PackedWeights.stacked([PackedWeights(layer.weight, layer.scales, layer.biases, layer.bits,
                                                           layer.group_size) for layer in layers])
        self.bias, self.weight_t = None, None
        sizes = [layer.weight.shape[0] for layer in layers]
        self.splits = list(np.cumsum(sizes)[:-1])
        start = 0
        for layer, n in zip(layers, sizes):
            for name in ("weight", "scales", "biases"):
                setattr(layer, name, getattr(self.packed, name)[start : start + n])
            start += n
        mx.eval([layer.parameters() for layer in layers])
        self.held = [(layer, layer.weight) for layer in layers]

    @staticmethod
    def supported(layers: list[nn.Module]) -> bool:
        """Quantized linears of one format, each `packed_on_cpu`."""
        return (all(type(layer) is nn.QuantizedLinear and packed_on_cpu(layer) for layer in layers)
                and len({(layer.bits, layer.group_size) for layer in layers}) == 1)

    def product(self, x: mx.array) -> mx.array:
        """x @ (the layers' dequantized weights, stacked)^T: every layer's outputs side by side."""
        return self.packed(x) if PackedWeights.takes(x, kept_quantized=True) else x @ self.packed.dequantized().T


def packed_on_cpu(layer: nn.Module) -> bool:
    """A quantized linear or embedding whose products the packed-weight kernel serves: float32 scales and biases (a
    model computing in float32), no bias, a format the kernel reads, a CPU backend."""
    return (mx.default_device() == mx.cpu and hasattr(layer, "scales") and layer.scales.dtype == mx.float32
            and "biases" in layer and "bias" not in layer and PackedWeights.supported(layer.bits, layer.group_size))


def project(x: mx.array, fused: StackedProduct | None, layers: list[nn.Module]) -> list[mx.array]:
    """The outputs of `layers` on x: one fused product when it is current, else one product per layer."""
    if fused is not None and fused.current():
        return fused(x)
    return [layer(x) for layer in layers]


# The products `Model.fuse_projections` fuses, as (the layer's part, the attribute that holds the fused product,
# the linears it stacks).
FUSED_PROJECTIONS = (("self_attn", "qkv", ("q_proj", "k_proj", "v_proj")), ("mlp", "gate_up", ("gate_proj", "up_proj")),
                     ("self_attn", "o", ("o_proj",)), ("mlp", "down", ("down_proj",)))


def _linear_path(layer: int, part: str, name: str) -> str:
    """A layer's linear by its path among the model's parameters (as a checkpoint names it)."""
    return f"model.layers.{layer}.{part}.{name}"


class Ragged:
    """B rows of different numbers of new tokens (`sizes`) in one forward, without padding in the products.

    The caller still gives tokens, positions and the mask padded to the longest row (B, N); the model runs every
    per-token product (projections, MLP, vocabulary) on the T = sum(sizes) real tokens only, and only attention,
    which reads each row's own keys, sees the padded (B, N) layout. A padding slot carries a copy of its row's
    first token: its key is written to a scratch slot the row never commits and its query's output is dropped, so
    the mask must let it see at least one key (its own slot). Each real token's arithmetic is what the padded
    forward gives it. Outputs (logits, hidden) are flat (T, ...), row after row (`starts`)."""

    def __init__(self, sizes: list[int]):
        if not sizes or min(sizes) < 1:
            raise ValueError(f"every row needs at least one token (sizes {sizes})")
        self.sizes = list(sizes)
        self.width = max(sizes)
        self.starts = [int(x) for x in np.cumsum([0, *sizes[:-1]])]
        self.total = int(sum(sizes))
        spread = np.array([[s + (i if i < n else 0) for i in range(self.width)] for s, n in zip(self.starts, sizes)],
                          dtype=np.int32)
        self.spread = mx.array(spread)  # (B, N): the flat token each padded slot holds
        self.gather = mx.array(np.concatenate([np.arange(n) + b * self.width for b, n in enumerate(sizes)])
                               .astype(np.int32))  # (T,): each real token's padded slot

    def flat(self, x: mx.array) -> mx.array:
        """(B, N, ...) -> (T, ...): the real tokens only, row after row."""
        return x.reshape(-1, *x.shape[2:])[self.gather]


def rows_of(x: mx.array, shape: tuple[int, int], heads: int, spread: mx.array | None = None) -> mx.array:
    """Per-token head vectors (tokens, heads * D) -> (B, N, heads, D): B rows of N tokens, or ragged rows padded
    (`Ragged.spread`)."""
    x = x.reshape(x.shape[0], heads, -1)
    return x.reshape(*shape, heads, x.shape[-1]) if spread is None else x[spread]


def tokens_of(out: mx.array, gather: mx.array | None = None) -> mx.array:
    """Attention output (B, heads, N, D) -> (tokens, heads * D): every slot, or only ragged rows' real tokens
    (`Ragged.gather`)."""
    B, h, N, D = out.shape
    out = out.reshape(B, h * D) if N == 1 else out.transpose(0, 2, 1, 3).reshape(B * N, h * D)
    return out if gather is None else out[gather]


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        dim, self.n_heads, self.n_kv_heads = args.hidden_size, args.num_attention_heads, args.num_key_value_heads
        self.head_dim = args.head_dim
        self.scale = self.head_dim**-0.5
        self.q_proj = nn.Linear(dim, self.n_heads * self.head_dim, bias=args.attention_bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=args.attention_bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=args.attention_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, dim, bias=args.attention_bias)
        self.qkv: FusedLinear | None = None  # see Model.fuse_projections
        self.o: FusedLinear | None = None

    def __call__(self, x: mx.array, shape: tuple[int, int], rope: tuple[mx.array, mx.array], mask: mx.array | None,
                 cache: KVCache, layer: int, ragged: Ragged | None = None) -> mx.array:
        """x (B * N, dim) -> (B * N, dim) for B rows of N new tokens; with `ragged`, x (T, dim) -> (T, dim)."""
        cos, sin = rope
        h, h_kv = self.n_heads, self.n_kv_heads
        spread, gather = (None, None) if ragged is None else (ragged.spread, ragged.gather)
        if self.qkv is not None and self.qkv.current():  # q and k rotated as one array
            qk, v = mx.split(self.qkv.product(x), [(h + h_kv) * self.head_dim], axis=-1)
            q, k = mx.split(apply_rope(rows_of(qk, shape, h + h_kv, spread), cos, sin), [h], axis=2)
        else:
            q, k, v = (proj(x) for proj in (self.q_proj, self.k_proj, self.v_proj))
            q = apply_rope(rows_of(q, shape, h, spread), cos, sin)
            k = apply_rope(rows_of(k, shape, h_kv, spread), cos, sin)
        v = rows_of(v, shape, h_kv, spread)
        keys, values = cache.write(layer, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3))
        out = attention(q.transpose(0, 2, 1, 3), keys, values, self.scale, mask, cache.key_windows())  # (B, h, N, D)
        return project(tokens_of(out, gather), self.o, [self.o_proj])[0]


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        dim, hidden = args.hidden_size, args.intermediate_size
        self.gate_proj = nn.Linear(dim, hidden, bias=args.mlp_bias)
        self.down_proj = nn.Linear(hidden, dim, bias=args.mlp_bias)
        self.up_proj = nn.Linear(dim, hidden, bias=args.mlp_bias)
        self.gate_up: FusedLinear | None = None  # see Model.fuse_projections
        self.down: FusedLinear | None = None

    def __call__(self, x: mx.array) -> mx.array:
        if self.gate_up is not None and self.gate_up.current():
            gated = silu_mul_halves(self.gate_up.product(x))
        else:
            gated = silu_mul(self.gate_proj(x), self.up_proj(x))
        return project(gated, self.down, [self.down_proj])[0]


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x, shape, rope, mask, cache, layer, ragged=None):
        h = x + self.self_attn(self.input_layernorm(x), shape, rope, mask, cache, layer, ragged)
        return h + self.mlp(self.post_attention_layernorm(h))


class CompiledLayer:
    """On a CPU, every layer's work before attention (norm, q/k/v, rotation) and after it (output product, residual,
    norm, MLP, residual) as two compiled functions, traced once per input shape (a forward of N tokens has the same
    shapes at every step; the attention between them reads the cache, whose length changes, and stays as it is).
    Python then builds ~3 graph nodes for each where it built ~30, and the compiled graph fuses the elementwise
    work; the arithmetic and its order are those of the modules' own path (same bits). Used for calls of up to
    `MAX_TOKENS` tokens per row (decoding, verification, drafting data; prefills of every length would each trace
    anew, for a building cost they do not notice), on the CPU, while every layer's products are the bias-free fused
    ones (`Model.fuse_projections`) and no weight it reads has been replaced since it was built. A model kept
    quantized (`QuantizedFusedLinear`) runs through them while its products read the packed weights (up to
    `packed_linear.max_rows(kept_quantized=True)` rows), larger calls through the modules."""

    MAX_TOKENS = 64

    def __init__(self, args: ModelArgs, blocks: list[TransformerBlock]):
        h, h_kv, D = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        eps = args.rms_norm_eps
        self.scale, self.eps, self.heads, self.kv_heads = args.head_dim**-0.5, eps, h, h_kv
        # a packed call that is not ragged runs each layer as two nodes around the cache write
        # (`packed_linear.layer_before`, `layer_after`: the same bits) where the kernels are connected
        self.fuse = True

        def functions(mm):  # mm(x, w): a product with a weight as the functions take it
            def before(x, norm_w, qkv, cos, sin, spread=None):
                y = mm(rms_norm(x, norm_w, eps), qkv)
                laid = attention_kernel.heads_rope(y, cos, sin, h, h_kv, spread)
                if laid is not None:  # one node of our kernel: the same bits as the graph below
                    return laid
                shape = cos.shape[:2]
                qk, v = mx.split(y, [(h + h_kv) * D], axis=-1)
                q, k = mx.split(apply_rope(rows_of(qk, shape, h + h_kv, spread), cos, sin), [h], axis=2)
                v = rows_of(v, shape, h_kv, spread)
                return q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)

            def after(x, out, o, norm_w, gate_up, down, gather=None):
                h1 = x + mm(tokens_of(out, gather), o)
                return h1 + mm(silu_mul_halves(mm(rms_norm(h1, norm_w, eps), gate_up)), down)

            # plain and ragged (with the layout's index) traced apart
            return mx.compile(before), mx.compile(after), mx.compile(before), mx.compile(after)

        self.functions = functions(lambda x, w_t: x @ w_t)
        # per layer, what its two functions read: the float weights (transposed) and, where the products have
        # them, the quantized weights (PackedWeights: the same bits for few rows)
        self.weights: list[tuple] | None = []
        self.packed_weights: list[tuple] | None = []
        self.packed_functions = None
        self.held: list[tuple[nn.Module, mx.array]] = []  # (module, its weight when built): checked every call
        formats: set[tuple[int, int]] = set()
        for b in blocks:
            a, p = b.self_attn, b.mlp
            fused = (a.qkv, a.o, p.gate_up, p.down)
            if (any(not isinstance(f, (FusedLinear, QuantizedFusedLinear)) or f.bias is not None for f in fused)
                    or len(p.gate_up.splits) != 1):
                self.weights = self.packed_weights = None
                break
            norms = (b.input_layernorm.weight, b.post_attention_layernorm.weight)
            if self.weights is not None and all(f.weight_t is not None for f in fused):
                self.weights.append((norms[0], a.qkv.weight_t, a.o.weight_t, norms[1], p.gate_up.weight_t,
                                     p.down.weight_t))
            else:  # kept quantized: no float weight to multiply by
                self.weights = None
            if self.packed_weights is not None and all(f.packed is not None for f in fused):
                q = [(f.packed.weight, f.packed.scales, f.packed.biases) for f in fused]
                self.packed_weights.append((norms[0], q[0], q[1], norms[1], q[2], q[3]))
                formats |= {(f.packed.bits, f.packed.group_size) for f in fused}
            else:
                self.packed_weights = None
            self.held += [pair for f in fused for pair in f.held]
            self.held += [(b.input_layernorm, b.input_layernorm.weight),
                          (b.post_attention_layernorm, b.post_attention_layernorm.weight)]
        if self.packed_weights and len(formats) == 1:
            bits, group = formats.pop()
            self.packed_format = (bits, group)
            self.packed_functions = functions(
                lambda x, w: packed_linear.quantized_product(x, *w, bits, group))
        else:
            self.packed_weights = None

    def usable(self, tokens: int, rows: int = 1) -> bool:
        """Whether a call of `tokens` tokens per batch row, whose products have `rows` rows, runs through the
        compiled functions now (a model kept quantized: while its products read the packed weights)."""
        if tokens > self.MAX_TOKENS or mx.default_device() != mx.cpu:
            return False
        if self.weights is None and not (self.packed_weights is not None
                                         and rows <= packed_linear.max_rows(kept_quantized=True)):
            return False
        return held(self.held)

    def route(self, x: mx.array, cache: KVCache, ragged: Ragged | None = None) -> tuple[bool, bool]:
        """How a call whose layers take x (rows, dim) runs, the same for every layer: (read the packed weights,
        run each layer as two nodes around the cache write: `packed_linear.layer_before` and `layer_after`)."""
        packed = self.packed_weights is not None and (self.weights is None or PackedWeights.takes(x))
        fused = (packed and ragged is None and self.fuse and packed_linear.fused_layers_ready()
                 and cache.key_windows() is None)
        return packed, fused

    def __call__(self, layer: int, x: mx.array, rope: tuple[mx.array, mx.array], mask: mx.array | None,
                 cache: KVCache, ragged: Ragged | None = None, route: tuple[bool, bool] | None = None) -> mx.array:
        """Layer `layer` on x (B * N, dim) -> (B * N, dim) (ragged rows: (T, dim) -> (T, dim)), as
        `TransformerBlock` computes it; `route`: the call's `route`, where the caller computed it once."""
        packed, fused = route or self.route(x, cache, ragged)
        before, after, before_ragged, after_ragged = self.packed_functions if packed else self.functions
        norm1, qkv, o, norm2, gate_up, down = (self.packed_weights if packed else self.weights)[layer]
        if fused:
            q, k, v = packed_linear.layer_before(x, norm1, qkv, *rope, self.heads, self.kv_heads,
                                                 *self.packed_format, self.eps)
            visible = cache.store(layer, k, v)
            return packed_linear.layer_after(x, q, cache.keys[layer], cache.values[layer], visible, mask, o, norm2,
                                             gate_up, down, *self.packed_format, self.scale, self.eps)
        if ragged is None:
            q, k, v = before(x, norm1, qkv, *rope)
        else:
            q, k, v = before_ragged(x, norm1, qkv, *rope, ragged.spread)
        keys, values = cache.write(layer, k, v)
        out = attention(q, keys, values, self.scale, mask, cache.key_windows())
        if ragged is None:
            return after(x, out, o, norm2, gate_up, down)
        return after_ragged(x, out, o, norm2, gate_up, down, ragged.gather)


class LlamaModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [TransformerBlock(args) for _ in range(args.num_hidden_layers)]
        self.norm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


TAP_EPS = 1e-5  # a tapped layer's output is divided by its RMS (this epsilon, no weight) before a drafter fuses it


def post_norm_state(hidden: mx.array, hidden_size: int) -> mx.array:
    """The post-norm states (..., H) within a forward's `hidden`, without the tapped layers that follow them where
    the model's `feature_layers` names some: what the vocabulary projection and a drafter that reads the last layer
    alone take."""
    return hidden if hidden.shape[-1] == hidden_size else hidden[..., :hidden_size]


class Model(nn.Module):
    """Llama causal LM: `model(tokens, cache, positions, mask) -> (logits, hidden)`.

    `hidden` is the post-norm state (..., H), followed, when `feature_layers` names layers, by each named layer's
    output divided by its RMS: (..., H * (1 + len(feature_layers))). Those are the features a drafter that fuses
    several layers reads (EAGLE-3's low, middle and high states); `draft.redrafter.read_features` sets them."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = LlamaModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self._inv_freq, self._position_scale = inverse_frequencies(args)  # underscore: not parameters
        self.compiled: CompiledLayer | None = None  # see compile_layers
        self.feature_layers: tuple[int, ...] = ()  # layers whose outputs follow the post-norm state in `hidden`

    @contextmanager
    def tapping(self, layers: tuple[int, ...]) -> Iterator[None]:
        """Within the block, `hidden` carries the states of `layers` after the post-norm state (as `feature_layers`
        names them); the model's own setting is restored after."""
        kept, self.feature_layers = self.feature_layers, tuple(layers)
        try:
            yield
        finally:
            self.feature_layers = kept

    def make_cache(self, capacity: int) -> KVCache:
        """An empty KV cache for this model, pre-sized for `capacity` positions (it grows if needed)."""
        return KVCache(self.args.num_hidden_layers, capacity)

    def projection_groups(self) -> list[list[str]]:
        """The linears `fuse_projections` computes as one product each, by path (q/k/v, gate/up, o and down of
        every layer)."""
        return [[_linear_path(i, part, name) for name in names]
                for i in range(len(self.model.layers)) for part, _, names in FUSED_PROJECTIONS]

    def fuse_projections(self, stacked: dict[str, mx.array] | None = None) -> None:
        """Compute q/k/v and gate/up as one product each, and every product of a layer from a pre-transposed weight
        (plain float weights) or, for quantized weights with float32 activations on a CPU backend, from the packed
        weights (`QuantizedFusedLinear`; the vocabulary projection too). Same results: every output is the same dot
        product; parameters and checkpoints are unchanged. `stacked`: a group's weights already stacked, by its first
        linear's path (`projection_groups`)."""
        stacked = stacked or {}
        for i, layer in enumerate(self.model.layers):
            for part, fused, names in FUSED_PROJECTIONS:
                module = getattr(layer, part)
                linears = [getattr(module, name) for name in names]
                if FusedLinear.supported(linears):
                    setattr(module, fused, FusedLinear(linears, stacked.get(_linear_path(i, part, names[0]))))
                elif QuantizedFusedLinear.supported(linears):
                    setattr(module, fused, QuantizedFusedLinear(linears))
        head = self.model.embed_tokens if self.args.tie_word_embeddings else self.lm_head
        if packed_on_cpu(head):
            PackedWeights.attach(head, head.weight, head.scales, head.biases, head.bits, head.group_size)
        self.compile_layers(True)

    def compile_layers(self, on: bool) -> None:
        """Run each layer's work around attention as compiled functions where it can (`CompiledLayer`; on by
        default after `fuse_projections`), or, with `on` False, through the modules one operation at a time. Both
        give the same bits."""
        self.compiled = CompiledLayer(self.args, self.model.layers) if on else None

    @property
    def dtype(self) -> mx.Dtype:
        """Activation dtype (also the KV-cache dtype); never the packed dtype of quantized weights."""
        return self.model.norm.weight.dtype

    def embed(self, tokens: mx.array) -> mx.array:
        """Input embeddings of token ids, in the activation dtype."""
        return self.model.embed_tokens(tokens).astype(self.dtype)

    def output_weight(self) -> mx.array:
        """The vocabulary projection (V, H) in the activation dtype (the tied embedding table if tied)."""
        layer = self.model.embed_tokens if self.args.tie_word_embeddings else self.lm_head
        if hasattr(layer, "scales"):  # quantized
            return mx.dequantize(layer.weight, layer.scales, layer.biases, layer.group_size, layer.bits).astype(
                self.dtype)
        return layer.weight

    def last_state(self, hidden: mx.array) -> mx.array:
        """The post-norm states within this model's `hidden` (`post_norm_state`)."""
        return post_norm_state(hidden, self.args.hidden_size)

    def logits(self, hidden: mx.array) -> mx.array:
        """Vocabulary logits from post-norm hidden states."""
        layer = self.model.embed_tokens if self.args.tie_word_embeddings else self.lm_head
        packed = getattr(layer, "packed", None)
        if packed is not None and packed.current(layer):
            kept = hasattr(layer, "scales")  # kept quantized (on a CPU backend): no float32 weight to fall back on
            if PackedWeights.takes(hidden, kept):
                return packed(hidden)
            if kept:
                return hidden @ packed.dequantized().T
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(hidden)
        return self.lm_head(hidden)

    def rope(self, positions: mx.array, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
        """(cos, sin) of the rotary angles at token positions (B, N), each (B, N, 1, D/2): every layer rotates by
        the same per-token angles (position scaling and frequency scaling included)."""
        theta = (positions.astype(mx.float32) * self._position_scale)[..., None] * self._inv_freq  # (B, N, D/2)
        return mx.cos(theta)[:, :, None, :].astype(dtype), mx.sin(theta)[:, :, None, :].astype(dtype)

    def __call__(
        self,
        tokens: mx.array,  # (B, N) int
        cache: KVCache,
        positions: mx.array | None = None,  # (B, N) int; default cache.offset + arange(N)
        mask: mx.array | None = None,  # (B|1, 1, N, cache.offset + N) bool; default causal
        last_only: bool = False,  # logits of the last position only (hidden states are always all)
        ragged: Ragged | None = None,  # rows of different lengths: outputs (T, ...) of the real tokens
    ) -> tuple[mx.array, mx.array]:
        B, N = tokens.shape
        if positions is None:
            positions = mx.broadcast_to(mx.arange(cache.offset, cache.offset + N), (B, N))
        if mask is None and N > 1:
            mask = causal_mask(N, cache.offset)
        if mask is not None and not attention_kernel.usable(self.dtype):
            mask = grouped_mask(mask, self.args.num_attention_heads // self.args.num_key_value_heads, N)
        # (B * N, H) or, ragged, (T, H): two-dimensional products, fewer graph nodes
        x = self.embed(tokens).reshape(B * N, -1) if ragged is None else self.embed(ragged.flat(tokens))
        rope = self.rope(positions, x.dtype)  # (B, N, ...): applied once the tokens are laid out in rows
        compiled = self.compiled if self.compiled is not None and self.compiled.usable(N, x.shape[0]) else None
        route = compiled.route(x, cache, ragged) if compiled is not None else None
        taps = []
        for i, layer in enumerate(self.model.layers):
            x = (layer(x, (B, N), rope, mask, cache, i, ragged) if compiled is None
                 else compiled(i, x, rope, mask, cache, ragged, route))
            if i in self.feature_layers:
                taps.append(rms_norm(x, None, TAP_EPS))
        post = self.model.norm(x)  # post-norm: what the vocabulary projection and a drafter read
        if ragged is None:  # (B, N, ...); ragged: (T, ...)
            post, taps = post.reshape(B, N, -1), [t.reshape(B, N, -1) for t in taps]
        hidden = mx.concatenate([post, *taps], axis=-1) if taps else post
        return self.logits(post[:, -1:] if last_only and ragged is None else post), hidden


PREFILL_CHUNK_TOKENS = 2048  # tokens (rows x positions) a chunk of a long prefill feeds at once


def prefill_chunk(rows: int) -> int:
    """Positions per forward when `forward_chunked` feeds a long input of `rows` rows: about 2,048 tokens a
    forward, 32 to 128 positions. One forward over N positions scores every query against every key, masked ones
    included, in (rows, heads, N, N) tensors that the mask, the softmax and the value product each pass over; in
    chunks, a chunk's queries skip the keys after it and those tensors stay in cache. Measured on the 2-core AVX-512
    EPYC: one row of 1,024 tokens 2.3 s in chunks of 128 against 4.5 s in one forward (512: 0.91 against 1.02 s);
    64 left-padded rows of 344 tokens on one thread 52 s in chunks of 32, 56 s of 64, 62 s of 128, 85 s whole."""
    return max(32, min(128, PREFILL_CHUNK_TOKENS // max(rows, 1)))


def forward_chunked(model: Model, cache: KVCache, tokens: mx.array, positions: mx.array | None = None,
                    mask: mx.array | None = None, all_hidden: bool = False) -> tuple[mx.array, mx.array]:
    """Feed tokens (B, N) through `cache` `prefill_chunk(B)` positions at a time and advance it by N: the function
    of one forward (to float rounding), with less attention work on long inputs. `positions` (B, N) and `mask`
    (B, 1, N, cache.offset + N) as for `Model.__call__` (default: from the cache's offset, causal). Returns the
    logits at the last position (B, 1, V) and the post-norm hidden states: every position's (B, N, H) with
    `all_hidden`, else the last position's (B, 1, H) (lazy)."""
    B, N = tokens.shape
    if N < 1:
        raise ValueError("forward_chunked needs at least one position")
    start, chunk = cache.offset, prefill_chunk(B)
    parts = []
    for a in range(0, N, chunk):
        b = min(a + chunk, N)
        logits, hidden = model(tokens[:, a:b], cache, None if positions is None else positions[:, a:b],
                               None if mask is None else mask[:, :, a:b, : start + b], last_only=True)
        cache.advance(b - a)
        parts.append(hidden if all_hidden else hidden[:, -1:])
    if not all_hidden:
        return logits, parts[-1]
    return logits, parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=1)


def causal_mask(n: int, offset: int) -> mx.array:
    """Boolean (1, 1, n, offset + n) mask: token i sees the cache and new tokens 0..i."""
    rows = mx.arange(n)[:, None] + offset
    cols = mx.arange(offset + n)[None, :]
    return (cols <= rows)[None, None]
