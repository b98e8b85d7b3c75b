"""Our Llama against mlx-lm's implementation on the same weights, and the packed tree forward."""

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import llama as mlx_lm_llama

from mlx_redrafter.tree import pack, verify_mask


def mlx_lm_model(target):
    a = target.model.args
    args = mlx_lm_llama.ModelArgs(
        model_type="llama", hidden_size=a.hidden_size, num_hidden_layers=a.num_hidden_layers,
        intermediate_size=a.intermediate_size, num_attention_heads=a.num_attention_heads,
        rms_norm_eps=a.rms_norm_eps, vocab_size=a.vocab_size, head_dim=a.head_dim,
        num_key_value_heads=a.num_key_value_heads, rope_theta=a.rope_theta,
        max_position_embeddings=a.max_position_embeddings, tie_word_embeddings=a.tie_word_embeddings,
    )
    m = mlx_lm_llama.Model(args)
    m.load_weights(tree_flatten(target.model.parameters()), strict=True)
    return m


def test_logits_match_mlx_lm(target, chat_ids):
    ids = mx.array([chat_ids[0]])
    ref = mlx_lm_model(target)(ids)
    ours, hidden = target.model(ids, target.model.make_cache(256))
    assert ours.shape == ref.shape == (1, len(chat_ids[0]), 49152)
    assert hidden.shape == (1, len(chat_ids[0]), 576)
    assert mx.abs(ours - ref).max().item() <= 1e-4


def test_the_embedded_model_answers_sensibly(target):
    tok = target.tokenizer
    ids = tok.encode(tok.chat_prompt([{"role": "user", "content": "What is the capital of France?"}]))
    cache = target.model.make_cache(256)
    logits, _ = target.model(mx.array([ids]), cache, last_only=True)
    cache.advance(len(ids))
    out = [mx.argmax(logits[0, -1]).item()]
    for _ in range(6):
        logits, _ = target.model(mx.array([[out[-1]]]), cache)
        cache.advance(1)
        out.append(mx.argmax(logits[0, -1]).item())
    assert "Paris" in tok.decode(out)


def test_packed_tree_forward_matches_each_beam_alone(target, chat_ids):
    prompt = chat_ids[1]
    cache = target.model.make_cache(512)
    target.model(mx.array([prompt]), cache)
    cache.advance(len(prompt))
    beams = mx.array([[504, 314, 260, 1171], [504, 314, 3226, 28], [504, 4012, 260, 9]])
    tree = pack(beams)
    assert tree.size == 9
    logits, hidden = target.model(
        tree.tokens[None], cache, (cache.offset + tree.depth)[None], verify_mask(tree.mask, cache.offset)
    )
    for i in range(beams.shape[0]):
        ref_logits, ref_hidden = target.model(beams[i][None], cache)  # causal, positions offset..offset+L-1
        got = tree.unpacker[i]
        assert mx.abs(logits[0, got] - ref_logits[0]).max().item() <= 1e-4
        assert mx.abs(hidden[0, got] - ref_hidden[0]).max().item() <= 1e-4


def test_fused_projections_change_neither_results_nor_parameters(target, chat_ids):
    """q/k/v and gate/up run as one product each (built at load); outputs and parameters are those of the
    separate layers, and a weight replaced afterwards is used (the fused product is then skipped)."""
    from mlx_redrafter.model import Model

    m = target.model
    assert all(layer.self_attn.qkv.current() and layer.mlp.gate_up.current() for layer in m.model.layers)
    plain = Model(m.args)  # the same weights, never fused
    plain.load_weights(tree_flatten(m.parameters()), strict=True)
    assert plain.model.layers[0].self_attn.qkv is None
    assert [k for k, _ in tree_flatten(plain.parameters())] == [k for k, _ in tree_flatten(m.parameters())]
    ids = mx.array([chat_ids[1][:40]])
    for n in (1, 4, 40):  # one token, a verify block, a prefill
        a, _ = m(ids[:, :n], m.make_cache(64))
        b, _ = plain(ids[:, :n], plain.make_cache(64))
        assert mx.abs(a - b).max().item() <= 1e-5

    layer = plain.model.layers[0].self_attn
    plain.fuse_projections()
    before, _ = plain(ids[:, :4], plain.make_cache(64))
    layer.k_proj.weight = layer.k_proj.weight * 0  # replaced after fusing
    assert not layer.qkv.current()
    after, _ = plain(ids[:, :4], plain.make_cache(64))
    assert mx.abs(after - before).max().item() > 1e-2


def test_a_one_token_prompt_runs_and_matches_mlx_lm(target):
    """A forward over one token with an empty cache (one visible key) used to crash MLX's compiled softmax."""
    ids = mx.array([[1]])
    ours, _ = target.model(ids, target.model.make_cache(8))
    assert mx.abs(ours - mlx_lm_model(target)(ids)).max().item() <= 1e-4


def test_compiled_layers_give_the_same_bits_as_the_modules(target, chat_ids):
    """On a CPU each layer's work around attention runs as two compiled functions (`CompiledLayer`): logits and
    hidden states equal the modules' own path bit for bit, for one row and for rows of a batch cache, at a step's
    sizes and past the compiled sizes (a prefill)."""
    from mlx_redrafter.batch.cache import RowsCache
    from mlx_redrafter.model import CompiledLayer

    m = target.model
    assert m.compiled is not None and m.compiled.usable(1)
    ids = mx.array([chat_ids[1][:80]])

    def forward(on: bool, n: int, rows: int) -> list:
        m.compile_layers(on)
        try:
            one = m.make_cache(160)
            mx.eval(m(ids[:, :20], one))
            one.advance(20)
            if rows == 1:
                return [*m(ids[:, 20 : 20 + n], one)]
            batch = RowsCache(m.args.num_hidden_layers, 160)
            for _ in range(rows):
                batch.join(one)
            tokens = mx.broadcast_to(ids[:, 20 : 20 + n], (rows, n))
            positions = mx.broadcast_to(mx.arange(20, 20 + n), (rows, n))
            mask = mx.concatenate([mx.broadcast_to(batch.context_mask()[:, None, :], (rows, n, 20)),
                                   mx.broadcast_to(mx.tril(mx.ones((n, n), dtype=mx.bool_)), (rows, n, n))],
                                  axis=2)[:, None]
            return [*m(tokens, batch, positions, mask)]
        finally:
            m.compile_layers(True)

    for n, rows in [(1, 1), (3, 1), (9, 1), (1, 3), (4, 3), (60, 1)]:
        for a, b in zip(forward(False, n, rows), forward(True, n, rows)):
            assert mx.array_equal(a, b).item(), (n, rows)

    norm = m.model.layers[0].input_layernorm
    kept = norm.weight
    norm.weight = kept * 1  # the same values, another array: the compiled layers would read the old one
    try:
        assert not m.compiled.usable(1)
    finally:
        norm.weight = kept
    assert m.compiled.usable(1) and not m.compiled.usable(CompiledLayer.MAX_TOKENS + 1)


def test_ragged_rows_give_the_bits_of_the_padded_forward(target, chat_ids):
    """Rows of different lengths in one forward (`Ragged`: the products see only the real tokens): each real
    token's logits and hidden state equal the padded forward's bit for bit, compiled layers or modules; the
    padding slots' keys land in scratch slots only."""
    from mlx_redrafter.batch.cache import RowsCache
    from mlx_redrafter.model import Ragged

    m = target.model
    sizes, N = [3, 1, 6, 2], 6
    ids = chat_ids[1]
    tril = mx.tril(mx.ones((N, N), dtype=mx.bool_))
    own = mx.eye(N, dtype=mx.bool_)
    tree = mx.stack([tril & (mx.arange(N) < n)[None, :] | (own & (mx.arange(N) >= n)[:, None]) for n in sizes])

    def forward(on: bool, ragged: Ragged | None) -> tuple[mx.array, mx.array]:
        m.compile_layers(on)
        try:
            batch = RowsCache(m.args.num_hidden_layers, 64)
            for n in (12, 7, 20, 9):
                one = m.make_cache(n)
                m(mx.array([ids[:n]]), one)
                one.advance(n)
                batch.join(one)
            tokens = mx.array([ids[30 + 7 * b : 30 + 7 * b + N] for b in range(len(sizes))])
            positions = mx.array(batch.lengths)[:, None] + mx.arange(N)[None]
            context = mx.broadcast_to(batch.context_mask()[:, None, :], (len(sizes), N, batch.offset))
            mask = mx.concatenate([context, tree], axis=2)[:, None]
            return m(tokens, batch, positions, mask, ragged=ragged)
        finally:
            m.compile_layers(True)

    ragged = Ragged(sizes)
    assert ragged.total == sum(sizes) and ragged.starts == [0, 3, 4, 10]
    for on in (True, False):
        logits, hidden = forward(on, None)
        flat_logits, flat_hidden = forward(on, ragged)
        assert flat_logits.shape[0] == flat_hidden.shape[0] == sum(sizes)
        for b, (s, n) in enumerate(zip(ragged.starts, sizes)):
            assert mx.array_equal(logits[b, :n], flat_logits[s : s + n]).item(), (on, b)
            assert mx.array_equal(hidden[b, :n], flat_hidden[s : s + n]).item(), (on, b)


def test_rms_norm_has_the_bits_of_mlx_fast_rms_norm():
    """`model.rms_norm` (our kernel's one node on this CPU, else one compiled graph) against `mx.fast.rms_norm`,
    with a weight (the layers' norms) and without (a tapped layer's state), over magnitudes a layer's outputs take,
    at a step's rows and a batch's, at this model's width and a 7B model's."""
    from mlx_redrafter.model import TAP_EPS, rms_norm

    for i in range(40):
        rows, n = [(1, 576), (3, 576), (64, 576), (2, 4096)][i % 4]
        x = mx.random.normal((rows, n), key=mx.random.key(i)) * (10.0 ** (i % 5 - 2))
        w = mx.random.normal((n,), key=mx.random.key(100 + i))
        for weight, eps in ((w, 1e-5), (None, TAP_EPS)):
            assert mx.array_equal(rms_norm(x, weight, eps), mx.fast.rms_norm(x, weight, eps)).item(), (rows, n)


def test_a_decoding_step_runs_through_our_kernel_nodes(target):
    """Where our kernels are active, a one-token forward of the compiled layers is a few nodes a layer (each graph
    node costs a dispatch on MLX's CPU backend): q, k and v laid out and rotated, each norm and the MLP gate in one
    node, no element-wise norm or rope graph left."""
    import io
    import re

    from kernels import require

    from mlx_redrafter.system import attention_kernel, vector_math

    require(attention_kernel.KERNEL)
    require(vector_math.KERNEL)
    m = target.model
    layers = m.args.num_hidden_layers
    cache = m.make_cache(64)
    mx.eval(m(mx.array([list(range(100, 120))]), cache))
    cache.advance(20)
    logits, hidden = m(mx.array([[5]]), cache)
    dot = io.StringIO()
    mx.export_to_dot(dot, logits, hidden)
    nodes = re.findall(r'label ="([A-Za-z]+)"', dot.getvalue())
    fused = nodes.count("LayerAfter")  # a layer as two nodes around the cache write (test_packed_linear.py)
    assert nodes.count("HeadsRope") + fused == layers and nodes.count("SiluMulHalves") + fused == layers
    assert nodes.count("RmsNorm") + 2 * fused >= 2 * layers + 1
    assert "Square" not in nodes and "Contiguous" not in nodes and nodes.count("Concatenate") <= 1  # (the taps)
    assert len(nodes) <= 21 * layers + 12, len(nodes)
