"""Our packed-weight products (x86-64 Linux with AVX-512, or AVX2 + FMA + F16C): MLX's float32 product of the same
weights from float16 and 4- and 8-bit quantized weights; the embedded target reading its 4-bit weights with the
bits of its float32 copies; the shipped drafter drafting from 8-bit copies nearly and from float16 copies exactly
what its float32 weights draft; and packed weights that step aside when they no longer apply (the weights were
replaced, the kernel is off)."""

import os

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from kernels import require, without

from mlx_redrafter import api
from mlx_redrafter.draft.beam_search import greedy_steps
from mlx_redrafter.draft.redrafter import FrequentHead, load_drafter, random_drafter
from mlx_redrafter.draft.weight_copies import linear, use_weight_copies
from mlx_redrafter.models.loader import load_target
from mlx_redrafter.shipped import shipped_drafter_path
from mlx_redrafter.system import packed_linear
from mlx_redrafter.system.blas import small_gemm_avx2, status

# conftest installed the BLAS (and, with the switch on, loaded the kernel) before this module imported mlx.core.
KERNEL = packed_linear.KERNEL
EXPECTED = KERNEL.expected
# Rows up to which the small-GEMM kernel computes float32 products, by variant (csrc/smallgemm.c): up to them a
# product from packed weights has the float32 product's bits.
SAME_BITS_ROWS = {"avx512": 1 << 30, "avx2": 128}
# The best variant this CPU runs and the AVX2 one; one entry where they are the same variant (a CPU without AVX-512),
# since the two would run the very same kernel on the very same path.
BEST_AND_AVX2 = ["best", "avx2"] if KERNEL.isa not in ("", "avx2") else ["avx2"]


@pytest.fixture
def kernel():
    require(KERNEL)
    return packed_linear


@pytest.fixture(scope="module")
def shipped(target):
    """The shipped drafter as decoding loads it (float32, with 8-bit copies where the kernel is active)."""
    drafter, _ = api.resolve_drafter("default", target)
    yield drafter
    api.resolve_drafter("none", target)


def test_the_kernel_is_active_where_it_is_expected():
    assert KERNEL.active() or not EXPECTED
    if KERNEL.active():
        assert f"+packed{packed_linear.VERSION}" in status().describe()


@pytest.mark.parametrize("isa", ["best", "avx2", "base"])
@pytest.mark.parametrize("M,N,K", [(1, 1, 1), (1, 8192, 576), (4, 576, 1152), (8, 33, 17), (9, 577, 1000),
                                   (17, 64, 2304), (3, 2, 15)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_the_float32_product(kernel, isa, M, N, K, bias):
    rng = np.random.default_rng(M * 7919 + N * 31 + K)
    x = mx.array(rng.standard_normal((M, K), dtype=np.float32))
    w = mx.array(rng.standard_normal((N, K), dtype=np.float32) * 0.05).astype(mx.float16)
    b = mx.array(rng.standard_normal(N, dtype=np.float32)) if bias else None
    want = np.array(x, dtype=np.float64) @ np.array(w.astype(mx.float32), dtype=np.float64).T
    if bias:
        want += np.array(b, dtype=np.float64)
    with KERNEL.use_isa(isa) as used:
        y = kernel.half_product(x, w, b)
    got = np.array(y)
    assert got.shape == (M, N) and np.allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(K))
    if K % 16 == 0 and M <= SAME_BITS_ROWS.get(used, 0):  # the small-GEMM kernel's order: the same bits
        with _small_gemm_like(used):
            f32 = x @ w.astype(mx.float32).T
        assert mx.array_equal(y, f32 + b if bias else f32).item()


def test_leading_axes_row_slices_and_strided_inputs(kernel):
    rng = np.random.default_rng(3)
    w = mx.array(rng.standard_normal((300, 64), dtype=np.float32) * 0.1).astype(mx.float16)
    w32 = w.astype(mx.float32)
    x = mx.array(rng.standard_normal((2, 3, 64), dtype=np.float32))
    assert np.allclose(np.array(kernel.half_product(x, w[:100])), np.array(x @ w32[:100].T), atol=1e-5)
    xt = mx.array(rng.standard_normal((64, 5), dtype=np.float32)).T  # columns: a strided x
    assert np.allclose(np.array(kernel.half_product(xt, w[::2])), np.array(xt @ w32[::2].T), atol=1e-5)


def test_threads_share_the_rows_without_changing_a_bit(kernel):
    rng = np.random.default_rng(4)
    x = mx.array(rng.standard_normal((4, 576), dtype=np.float32))
    w = mx.array(rng.standard_normal((8192, 576), dtype=np.float32) * 0.05).astype(mx.float16)
    try:
        KERNEL.set_threads(1)
        one = np.array(kernel.half_product(x, w))
        KERNEL.set_threads(2)
        two = np.array(kernel.half_product(x, w))
    finally:
        KERNEL.set_threads(int(os.environ.get("REDRAFTER_THREADS", os.cpu_count() or 1)))
    assert np.array_equal(one, two)


def _drafts(shipped, target, cases=((1, 5), (4, 4), (8, 3))):
    """Greedy drafts of the shipped drafter from random states, with its copies and without them (the kernel off):
    per case, [((tokens, logits) with, (tokens, logits) without) per drafted position]."""
    head, embed = FrequentHead(shipped, 8192), target.model.embed
    rng = np.random.default_rng(5)
    out = []
    for B, L in cases:
        h = mx.array(rng.standard_normal((B, 576 * (1 + len(shipped.args.feature_layers))), dtype=np.float32))
        g0 = mx.array(rng.integers(0, 49152, B))
        fast = list(greedy_steps(head, embed, h, g0, L))
        with without(KERNEL):
            slow = list(greedy_steps(head, embed, h, g0, L))
        out.append(list(zip(fast, slow)))
    return out


def test_float16_copies_draft_what_the_float32_weights_draft(kernel, shipped, target):
    """Every linear layer of the shipped drafter (stored in float16) gets a float16 copy; drafts with and without
    them are the same tokens, from logits equal to float rounding."""
    layers = [m for _, m in shipped.named_modules() if type(m) is nn.Linear]
    try:
        assert use_weight_copies(shipped, "float16") == len(layers)
        assert all(m.draft_copy.current() and m.draft_copy.bits == 16 for m in layers)
        for (t1, l1), (t2, l2) in (pair for case in _drafts(shipped, target) for pair in case):
            assert mx.array_equal(t1, t2) and mx.abs(l1 - l2).max().item() < 1e-4
    finally:
        use_weight_copies(shipped)


def test_8_bit_copies_draft_nearly_what_the_float32_weights_draft(kernel, shipped, target):
    """As decoding loads it, every linear layer of the shipped drafter has an 8-bit copy (a quarter of float32's
    bytes); its products are those of the dequantized copy (bias included), and the drafts differ from the
    float32 weights' only where tokens nearly tie (what is decoded never depends on them: the exactness tests). From
    random states, whose top tokens tie more often than a real context's, 69 of these 80 drafts agree (real
    decoding: the same tokens per call as float16 copies, bench/results/cpu-avx512/draft-weights-20261130/)."""
    layers = [m for _, m in shipped.named_modules() if type(m) is nn.Linear]
    assert all(m.draft_copy.current() and m.draft_copy.bits == 8 for m in layers)
    layer, x = shipped.rnn_u, mx.array(np.random.default_rng(3).standard_normal((3, 576), dtype=np.float32))
    c = layer.draft_copy
    want = x @ mx.dequantize(c.weight, c.scales, c.biases, group_size=c.group_size, bits=8).T + layer.bias
    assert mx.allclose(linear(layer, x), want, rtol=1e-5, atol=1e-5).item()
    cases = _drafts(shipped, target, ((1, 5), (4, 4), (8, 3), (16, 4)))
    pairs = [pair for case in cases for pair in case]
    same = sum(mx.sum(t1 == t2).item() for (t1, _), (t2, _) in pairs)
    assert same >= 0.8 * sum(t.size for (t, _), _ in pairs)
    firsts = [case[0] for case in cases]  # from the same inputs: logits of magnitude ~40 within 1
    assert all(mx.abs(l1 - l2).max().item() < 1.0 for (_, l1), (_, l2) in firsts)


def test_a_head_cut_to_its_frequent_rows_drafts_from_its_copy(kernel, shipped):
    """`--drafter-vocab N` (FrequentHead): the first N rows of the head's 8-bit copy, not its float32 weight."""
    rng = np.random.default_rng(11)
    h = mx.array(rng.standard_normal((1, 576 * (1 + len(shipped.args.feature_layers))), dtype=np.float32))
    ctx, state = shipped.context(h)[:, None, :], mx.array(rng.standard_normal((1, 1, 576), dtype=np.float32))
    copy = shipped.lm_head[-1].draft_copy
    x = shipped.features(ctx, state)
    got = FrequentHead(shipped, 4096).logits(ctx, state)
    assert got.shape[-1] == 4096 and mx.array_equal(got, copy(x, 4096)).item()
    assert not mx.array_equal(got, x @ shipped.lm_head[-1].weight[:4096].T).item()


def test_the_switch_names_every_kind_of_copy():
    from mlx_redrafter.draft.weight_copies import COPIES, SWITCH
    from mlx_redrafter.environment import NAMED

    assert set(NAMED[SWITCH]) == {"auto", *COPIES}


def test_no_copies_with_the_switch_at_float32_and_the_record_says_what_drafting_reads(kernel, shipped, target,
                                                                                       monkeypatch):
    lm = api.LoadedModel(target, shipped, "shipped")
    record = lambda: api.settings(lm, api.decode_options(draft="rnn"))["draft_weights"]  # noqa: E731
    assert record() == "int8" and api.settings(lm, api.decode_options(draft="none"))["draft_weights"] == "none"
    monkeypatch.setenv("REDRAFTER_DRAFT_WEIGHTS", "float32")
    try:
        assert use_weight_copies(shipped) == 0
        assert all(m.draft_copy is None for _, m in shipped.named_modules() if type(m) is nn.Linear)
        assert record() == "float32"
        use_weight_copies(shipped, "float16")
        assert record() == "float16"
    finally:
        use_weight_copies(shipped, "int8")


def test_a_copy_steps_aside_once_its_layer_holds_another_weight(kernel, shipped):
    layer = shipped.rnn_u
    x = mx.ones((2, 576))
    kept = layer.weight
    try:
        layer.weight = kept * 2  # what an optimizer's update does: a new array
        assert not layer.draft_copy.current()
        assert mx.allclose(linear(layer, x), layer(x)).item()
        loss = lambda w: linear(layer, x).sum() + (w * 0).sum()  # noqa: E731
        mx.eval(mx.grad(lambda w: (x @ w.T).sum() + loss(w))(layer.weight))  # differentiable again
    finally:
        layer.weight = kept
    assert layer.draft_copy.current()


def test_weights_float16_does_not_hold_get_no_copy(kernel):
    d = random_drafter(576, 49152, seed=9, exit_dim=128, draft_vocab_size=4096)  # float32 random weights
    assert use_weight_copies(d, "float16") == 0
    exact = load_drafter(shipped_drafter_path("smollm2-135m"))
    exact.rnn_w.weight = exact.rnn_w.weight + 1e-6  # no longer a float16 value
    assert use_weight_copies(exact, "float16") == len([m for _, m in exact.named_modules() if type(m) is nn.Linear]) - 1


@pytest.mark.parametrize("isa", ["best", "avx2", "base"])
@pytest.mark.parametrize("bits,group", [(4, 32), (4, 64), (8, 32), (8, 128)])
@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 6, 7, 8, 9, 20, 24, 32, 33])
def test_quantized_products_are_the_float32_products_of_the_dequantized_weights(kernel, isa, bits, group, M):
    rng = np.random.default_rng(bits * 100 + group + M)
    w = mx.array(rng.standard_normal((70, 256), dtype=np.float32) * 0.1).astype(mx.float16)
    q, scales, biases = mx.quantize(w, group_size=group, bits=bits)  # float16 scales and biases, as in a GGUF
    scales, biases = scales.astype(mx.float32), biases.astype(mx.float32)
    x = mx.array(rng.standard_normal((M, 256), dtype=np.float32))
    with KERNEL.use_isa(isa) as used, _small_gemm_like(used):
        want = x @ mx.dequantize(q, scales, biases, group_size=group, bits=bits).T
        got = kernel.quantized_product(x, q, scales, biases, bits, group)
        if M <= SAME_BITS_ROWS.get(used, 0):  # sums in the small-GEMM kernel's order: the same bits
            assert mx.array_equal(got, want).item()
        assert mx.allclose(got, want, rtol=1e-5, atol=1e-5).item()


@pytest.mark.parametrize("isa", ["best", "avx2", "base"])
@pytest.mark.parametrize("bits,group", [(4, 8), (4, 32), (4, 64), (8, 16), (8, 32), (8, 128)])
def test_dequantize_has_the_bits_of_scale_times_q_plus_bias(kernel, isa, bits, group):
    """scale * q + bias in float32 (one rounding), as mx.dequantize computes it, on every variant, whole, from
    strided rows and on two threads."""
    rng = np.random.default_rng(bits * 1000 + group)
    n, k = 67, 512
    q = rng.integers(0, 2**32, size=(n, k * bits // 32), dtype=np.uint32)
    scales = rng.standard_normal((n, k // group)).astype(np.float16).astype(np.float32)  # a checkpoint's scales
    biases = rng.standard_normal((n, k // group)).astype(np.float16).astype(np.float32)
    values = (q[:, :, None] >> np.arange(0, 32, bits, dtype=np.uint32)) & np.uint32(2**bits - 1)
    want = values.reshape(n, k // group, group).astype(np.float32) * scales[..., None] + biases[..., None]
    want = want.reshape(n, k)
    qm, sm, bm = mx.array(q), mx.array(scales), mx.array(biases)
    with KERNEL.use_isa(isa):
        assert np.array_equal(np.array(kernel.dequantize(qm, sm, bm, bits, group)), want)
        assert np.array_equal(np.array(kernel.dequantize(qm[::2], sm[::2], bm[::2], bits, group)), want[::2])
        try:
            KERNEL.set_threads(2)
            assert np.array_equal(np.array(kernel.dequantize(qm, sm, bm, bits, group)), want)
        finally:
            KERNEL.set_threads(int(os.environ.get("REDRAFTER_THREADS", os.cpu_count() or 1)))
    if group >= 32:
        assert np.array_equal(np.array(mx.dequantize(qm, sm, bm, group_size=group, bits=bits)), want)


def test_the_loaded_target_holds_mx_dequantizes_weights_stacked_without_copies(target):
    """The loader dequantizes each fused product's layers at once (our kernel where it is active): every weight
    has mx.dequantize's bits, and a layer's weight lives in its fused product's array."""
    from mlx_redrafter.models.loader import read_checkpoint

    _, weights, quant, _ = read_checkpoint(target.path)
    layer = target.model.model.layers[3]
    for path, module in (("model.layers.3.self_attn.k_proj", layer.self_attn.k_proj),
                         ("model.layers.3.mlp.up_proj", layer.mlp.up_proj),
                         ("model.layers.3.mlp.down_proj", layer.mlp.down_proj)):
        q = quant[path]
        want = mx.dequantize(weights[path + ".weight"], weights[path + ".scales"].astype(mx.float32),
                             weights[path + ".biases"].astype(mx.float32), group_size=q["group_size"], bits=q["bits"])
        assert mx.array_equal(module.weight, want).item(), path
    qkv = layer.self_attn.qkv
    assert qkv.current() and qkv.weight.shape[0] == sum(m.weight.shape[0] for m in qkv.layers)


def _small_gemm_like(isa: str):
    """The small-GEMM kernel's path of the packed kernel's variant `isa` (its AVX2 one for "avx2")."""
    return small_gemm_avx2() if isa == "avx2" else _nothing()


@pytest.fixture(scope="module")
def packed_target(target):
    """The session's target: with the kernel's AVX-512 or AVX2 variant, its 4-bit layers and 8-bit embedding kept
    packed."""
    if not (KERNEL.active() and packed_linear.max_rows() > 0):
        pytest.skip("the target keeps packed weights only with the kernel's AVX-512 or AVX2 variant")
    return target


def test_the_embedded_target_keeps_its_quantized_weights_beside_the_float32_ones(packed_target):
    model = packed_target.model
    for layer in model.model.layers:
        for fused in (layer.self_attn.qkv, layer.self_attn.o, layer.mlp.gate_up, layer.mlp.down):
            assert fused.packed is not None and fused.packed.bits == 4 and fused.current()
    assert model.model.embed_tokens.packed.bits == 8 and model.compiled.packed_weights is not None


@pytest.mark.parametrize("isa", BEST_AND_AVX2)
@pytest.mark.parametrize("rows,tokens", [(1, 1), (1, 4), (1, 8), (1, 9), (1, 40), (2, 3), (4, 2), (8, 1), (8, 3),
                                         (4, 8), (3, 11), (5, 5), (2, 8), (17, 1)])
def test_forwards_from_packed_weights_have_the_bits_of_the_float32_forwards(packed_target, chat_ids, isa, rows,
                                                                             tokens):
    """Logits and hidden states of steps of every size, after a prefill, equal bit for bit with the kernel and
    without it (prefills and steps of more than `MAX_ROWS` rows of the variant read the float32 weights either way),
    with the best variant and the AVX2 one (beside the small-GEMM kernel's AVX2 path)."""
    model = packed_target.model
    prompts = [chat_ids[r % len(chat_ids)][:30] for r in range(rows)]
    outs = []
    for use in (True, False):
        cache = model.make_cache(64)
        with (KERNEL.use_isa(isa) as used, _small_gemm_like(used),
              (without(KERNEL) if not use else _nothing())):
            model(mx.array(prompts), cache)
            cache.advance(30)
            step = mx.array([p[:tokens] for p in prompts])
            outs.append(model(step, cache))
            mx.eval(outs[-1])
    (l1, h1), (l2, h2) = outs
    assert mx.array_equal(l1, l2).item() and mx.array_equal(h1, h2).item()


def test_packed_weights_step_aside_once_a_layer_holds_another_weight(packed_target):
    embed = packed_target.model.model.embed_tokens
    kept = embed.weight
    h = mx.ones((1, 576)) * 0.01
    try:
        embed.weight = kept * 1.0  # a new array: the packed copy no longer stands for it
        assert not embed.packed.current(embed)
        assert mx.array_equal(packed_target.model.logits(h), h @ embed.weight.T).item()
    finally:
        embed.weight = kept
    assert embed.packed.current(embed)


def test_the_base_variant_gives_a_target_no_packed_weights(kernel):
    with KERNEL.use_isa("base"):
        t = load_target(None, "float32")
    assert getattr(t.model.model.embed_tokens, "packed", None) is None
    assert all(layer.self_attn.qkv.packed is None for layer in t.model.model.layers)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False



@pytest.mark.parametrize("rows,tokens", [(1, 1), (1, 3), (1, 6), (2, 3), (3, 2), (6, 1)])
def test_a_layer_is_two_nodes_around_the_cache_write_with_the_bits_of_the_separate_ones(packed_target, chat_ids,
                                                                                       rows, tokens):
    """Where the kernels are connected, a packed step runs each layer as two nodes around the cache write
    (`layer_before`: norm, q/k/v product, layout and rope; `layer_after`: attention, output product, MLP): logits and
    hidden states equal the separate nodes' bit for bit, one row or a batch, one token or a verification's several
    (masked), over two steps of a cache."""
    import io
    import re

    if not packed_linear.fused_layers_ready():
        pytest.skip("layer_after needs the attention and vector-math kernels beside this one")
    model = packed_target.model
    prompts = [chat_ids[r % len(chat_ids)][:30] for r in range(rows)]
    outs = {}
    for fuse in (True, False):
        model.compiled.fuse = fuse
        try:
            cache = model.make_cache(64)
            mx.eval(model(mx.array(prompts), cache))
            cache.advance(30)
            got = []
            for start in (0, tokens):
                step = mx.array([p[start : start + tokens] for p in prompts])
                got += [*model(step, cache)]
                mx.eval(got)
                cache.advance(tokens)
            outs[fuse] = got
        finally:
            model.compiled.fuse = True
    assert all(mx.array_equal(a, b).item() for a, b in zip(outs[True], outs[False]))
    if rows == 1 and tokens == 1:
        dot = io.StringIO()
        mx.export_to_dot(dot, *model(mx.array([prompts[0][:1]]), cache))
        nodes = re.findall(r'label ="([A-Za-z]+)"', dot.getvalue())
        layers = model.args.num_hidden_layers
        assert nodes.count("LayerBefore") == nodes.count("LayerAfter") == layers
        assert "SoftmaxValues" not in nodes and "HeadsRope" not in nodes and "PackedLinear" in nodes  # (logits)
        assert len(nodes) <= 5 * layers + 12, len(nodes)


def test_the_fused_layer_nodes_stand_aside_without_the_kernels_they_run_beside(packed_target, chat_ids):
    """`layer_before` and `layer_after` run the attention and vector-math kernels' code: without either (switched
    off, not built, or built before they handed their kernels over) `connect` says why and a step runs the separate
    nodes, with the same bits."""
    from mlx_redrafter.system import attention_kernel, vector_math

    if not packed_linear.fused_layers_ready():
        pytest.skip("layer_before and layer_after need the attention and vector-math kernels beside this one")
    model = packed_target.model
    step = mx.array([chat_ids[0][:3]])

    def forward() -> list:
        cache = model.make_cache(16)
        return [*model(step, cache)]

    fused = forward()
    try:
        assert "not active" in packed_linear.connect(None, vector_math.KERNEL.module)
        assert not packed_linear.fused_layers_ready()
        assert all(mx.array_equal(a, b).item() for a, b in zip(forward(), fused))
    finally:
        assert packed_linear.connect(attention_kernel.KERNEL.module, vector_math.KERNEL.module) == ""
    assert packed_linear.fused_layers_ready()
    with without(attention_kernel.KERNEL):
        assert not packed_linear.fused_layers_ready()
