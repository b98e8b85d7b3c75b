"""Tokenizers and templates: a SentencePiece model trained here (byte fallback), its GGUF form, streaming
detokenization of multi-byte characters, the Vicuna template, and a Vicuna-layout directory that chats."""

import io
import json

import mlx.core as mx
import pytest
import sentencepiece as spm
from mlx.utils import tree_flatten

from mlx_redrafter.model import Model, ModelArgs
from mlx_redrafter.models.gguf_header import read_header
from mlx_redrafter.models.templates import VICUNA_SYSTEM
from mlx_redrafter.models.tokenizer import StreamingDetokenizer, TextTokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A chat between a curious user and an artificial intelligence assistant.",
    "The assistant gives helpful, detailed, and polite answers to the user's questions.",
    "USER: Hello! ASSISTANT: Hello! How can I help you today?",
    "Speculative decoding drafts several tokens and the target verifies them in one call.",
    "Recurrent drafters predict the next tokens from the last hidden state of the model.",
    "Naïve café owners serve crème brûlée in Zürich.",
] * 20
TEXT = "Hello world! Naïve café in Zürich: 日本語 😀 and ∑ done."


@pytest.fixture(scope="module")
def sp_model() -> bytes:
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS), model_writer=buf, vocab_size=400, model_type="bpe", byte_fallback=True,
        character_coverage=0.99, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, normalization_rule_name="identity",
        add_dummy_prefix=True, remove_extra_whitespaces=False, split_digits=True, hard_vocab_limit=False,
        minloglevel=2,
    )
    return buf.getvalue()


@pytest.fixture(scope="module")
def sp_dir(tmp_path_factory, sp_model):
    d = tmp_path_factory.mktemp("sp")
    (d / "tokenizer.model").write_bytes(sp_model)
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return d


@pytest.fixture(scope="module")
def sp_tok(sp_dir) -> TextTokenizer:
    return TextTokenizer.from_dir(sp_dir, {"eos_token_id": 2})


def stream(tok: TextTokenizer, ids: list[int]) -> list[str]:
    detok = StreamingDetokenizer(tok)
    pieces = [detok.add([i]) for i in ids]
    return [p for p in [*pieces, detok.flush()] if p]


def test_sentencepiece_round_trip_and_same_ids_as_sentencepiece(sp_tok, sp_model):
    sp = spm.SentencePieceProcessor(model_proto=sp_model)
    ids = sp_tok.encode(TEXT)
    assert sp_tok.kind == "sentencepiece"
    assert ids == sp.encode(TEXT)
    assert any(sp.is_byte(i) for i in ids)  # the emoji and CJK go through byte fallback
    assert sp_tok.decode(ids) == TEXT == sp.decode(ids)
    assert sp_tok.eos_ids == [2] and sp_tok.bos_token == "<s>" and sp_tok.eos_token == "</s>"


def test_special_tokens_in_text_become_their_ids(sp_tok, sp_model):
    sp = spm.SentencePieceProcessor(model_proto=sp_model)
    ids = sp_tok.encode("<s>Hello</s>USER: hi")
    assert ids == [1, *sp.encode("Hello"), 2, *sp.encode("USER: hi")]  # legacy: each segment gets "▁"
    assert sp_tok.decode(ids) == "<s> Hello</s> USER: hi"  # only the first piece loses its "▁"


def test_streaming_never_breaks_a_character(sp_tok, target):
    for tok in (sp_tok, target.tokenizer):  # SentencePiece byte fallback, byte-level BPE
        ids = tok.encode(TEXT)
        pieces = stream(tok, ids)
        assert "".join(pieces) == TEXT
        assert not any("\ufffd" in p for p in pieces)
        assert any("😀" in p for p in pieces)
    emoji = sp_tok.encode("😀")
    assert len(emoji) >= 4  # 4 byte tokens: nothing is shown until the last one
    detok = StreamingDetokenizer(sp_tok)
    assert [detok.add([i]) for i in emoji][:-1] == [""] * (len(emoji) - 1)


def test_gguf_llama_tokenizer_matches_tokenizer_model(tmp_path, sp_model, sp_tok):
    sp = spm.SentencePieceProcessor(model_proto=sp_model)
    n = sp.get_piece_size()
    types = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1 for i in range(n)]
    meta = {
        "general.architecture": "llama", "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(n)],
        "tokenizer.ggml.scores": mx.array([sp.get_score(i) for i in range(n)], dtype=mx.float32),
        "tokenizer.ggml.token_type": mx.array(types, dtype=mx.int32),
        "tokenizer.ggml.bos_token_id": mx.array(1, dtype=mx.uint32),
        "tokenizer.ggml.eos_token_id": mx.array(2, dtype=mx.uint32),
        "tokenizer.ggml.unknown_token_id": mx.array(0, dtype=mx.uint32),
    }
    mx.save_gguf(str(tmp_path / "t.gguf"), {"x": mx.zeros((1,))}, meta)
    loaded = read_header(tmp_path / "t.gguf").metadata  # what the loader reads: checked Python values
    tok = TextTokenizer.from_gguf_metadata(loaded)
    for text in (TEXT, "<s>USER: Hello</s>", "  two  spaces\nand a newline"):
        assert tok.encode(text) == sp_tok.encode(text)
        assert tok.decode(tok.encode(text)) == sp_tok.decode(sp_tok.encode(text))
    assert tok.eos_ids == [2] and tok.bos_token == "<s>"


def test_vicuna_template(sp_tok):
    from mlx_redrafter.models.templates import VICUNA

    sp_tok.set_template(VICUNA, "built-in vicuna")
    msgs = [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hi."},
            {"role": "user", "content": "How are you?"}]
    assert sp_tok.chat_prompt(msgs) == (f"<s>{VICUNA_SYSTEM} USER: Hello! ASSISTANT: Hi.</s>USER: How are you? "
                                        f"ASSISTANT:")
    own = sp_tok.chat_prompt([{"role": "system", "content": "Be brief."}, msgs[0]])
    assert own == "<s>Be brief. USER: Hello! ASSISTANT:"
    assert sp_tok.encode_chat(msgs[:1])[0] == 1


def write_tiny_llama(path, vocab_size: int, seed: int = 0) -> None:
    """A tiny random Llama in mlx-lm layout: config.json + model.safetensors."""
    cfg = {"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 2, "intermediate_size": 64,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": vocab_size, "rms_norm_eps": 1e-5,
           "max_position_embeddings": 512, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}
    mx.random.seed(seed)
    model = Model(ModelArgs.from_dict(cfg))
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (path / "config.json").write_text(json.dumps(cfg))


def test_vicuna_layout_directory_loads_and_chats(tmp_path, sp_model):
    from mlx_redrafter import api
    from mlx_redrafter.chat import ChatSession

    d = tmp_path / "vicuna-tiny"
    write_tiny_llama(d, spm.SentencePieceProcessor(model_proto=sp_model).get_piece_size())
    (d / "tokenizer.model").write_bytes(sp_model)  # no tokenizer.json, no chat template
    lm = api.load(str(d), drafter="none", dtype="float32")
    tok = lm.tokenizer
    assert tok.kind == "sentencepiece" and tok.template_source == "built-in vicuna" and tok.eos_ids == [2]
    session = ChatSession(lm, api.decode_options(max_tokens=6))
    first = "".join(session.send("Hello!"))
    assert session.last.prefill_tokens == session.last.prompt_tokens  # the first turn prefills everything
    assert session.tokens[: session.last.prompt_tokens] == tok.encode(f"<s>{VICUNA_SYSTEM} USER: Hello! ASSISTANT:")
    assert session.messages[-1] == {"role": "assistant", "content": first}
    "".join(session.send("How are you?"))
    prompt = tok.encode_chat(session.messages[:3])
    assert session.tokens[: len(prompt)] == prompt  # what the cache holds is the rendered conversation
    assert 2 in prompt  # the first answer was closed with </s>
    assert session.last.prefill_tokens < session.last.prompt_tokens


def test_each_tokens_bytes_add_up_to_the_text(sp_tok, target):
    for tok, text in ((sp_tok, " " + TEXT), (target.tokenizer, TEXT)):  # SentencePiece's dummy prefix: a space
        ids = tok.encode(TEXT)
        assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8")
        parts = [tok.token_text(i) for i in ids]
        assert any("\ufffd" in t for t in parts)  # a token holding part of a character shows U+FFFD on its own
    assert [target.tokenizer.token_bytes(i) for i in target.tokenizer.eos_ids] == [b"<|endoftext|>", b"<|im_end|>"]
