"""Tokenizer: byte-level BPE from GGUF metadata or an HF `tokenizer.json`, chat template, eos ids."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import jinja2.sandbox
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from .errors import UserError

_EOS_NAMES = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "</s>", "<|end|>")

# llama.cpp pre-tokenizer regexes by `tokenizer.ggml.pre`
_LLAMA3_RE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class TextTokenizer:
    """Encode/decode text, render chat prompts, and know which ids end a generation."""

    def __init__(self, tok: Tokenizer, chat_template: str | None, eos_ids: Iterable[int],
                 bos_token: str = "", eos_token: str = ""):
        self.tok = tok
        self.chat_template = chat_template
        self.eos_ids = sorted(set(int(i) for i in eos_ids))
        self.bos_token, self.eos_token = bos_token, eos_token
        self.vocab_size = tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def chat_prompt(self, messages: list[dict[str, str]]) -> str:
        """Render messages with the model's chat template, ready for the assistant's reply."""
        if not self.chat_template:
            return "".join(m["content"] for m in messages)
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(msg: str) -> None:
            raise UserError(f"chat template: {msg}")

        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=True,
            bos_token=self.bos_token, eos_token=self.eos_token,
        )

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of messages rendered with the chat template, ready for the assistant's reply."""
        return self.encode(self.chat_prompt(messages))

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any]) -> TextTokenizer:
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise UserError(
                f"GGUF tokenizer type {kind!r} is not supported; use an mlx-lm model directory instead"
            )
        tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
        tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False))
        pre = meta.get("tokenizer.ggml.pre", "default")
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if pre in ("llama-bpe", "llama3", "smaug-bpe"):
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(_LLAMA3_RE), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ])
        elif pre == "smollm":
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), byte_level]
            )
        else:
            tok.pre_tokenizer = byte_level
        tok.decoder = decoders.ByteLevel()
        types = meta.get("tokenizer.ggml.token_type")
        types = [int(t) for t in types.tolist()] if types is not None else [1] * len(tokens)
        tok.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty in (3, 4)]
        )
        eos = meta.get("tokenizer.ggml.eos_token_id")
        eos_ids = {int(eos.item())} if eos is not None else set()
        eos_ids |= {tokens.index(n) for n in _EOS_NAMES if n in tokens}
        bos = meta.get("tokenizer.ggml.bos_token_id")
        return cls(
            tok, meta.get("tokenizer.chat_template"), eos_ids,
            bos_token=tokens[int(bos.item())] if bos is not None else "",
            eos_token=tokens[int(eos.item())] if eos is not None else "",
        )

    @classmethod
    def from_dir(cls, path: Path, config: dict[str, Any]) -> TextTokenizer:
        file = path / "tokenizer.json"
        if not file.exists():
            raise UserError(f"{path} has no tokenizer.json; add the model's HF tokenizer files")
        tok = Tokenizer.from_file(str(file))
        tcfg = _read_json(path / "tokenizer_config.json")
        gcfg = _read_json(path / "generation_config.json")
        template = tcfg.get("chat_template")
        if template is None and (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text()
        eos_ids: set[int] = set()
        for src in (config.get("eos_token_id"), gcfg.get("eos_token_id")):
            eos_ids |= set(src if isinstance(src, list) else [src] if src is not None else [])
        vocab = tok.get_vocab()
        eos_tok = _token_text(tcfg.get("eos_token"))
        eos_ids |= {vocab[n] for n in (*_EOS_NAMES, eos_tok) if n and n in vocab}
        return cls(tok, template, eos_ids, bos_token=_token_text(tcfg.get("bos_token")) or "",
                   eos_token=eos_tok or "")


def _token_text(t: Any) -> str | None:
    return t.get("content") if isinstance(t, dict) else t


def _read_json(p: Path) -> dict[str, Any]:
    return json.loads(p.read_text()) if p.exists() else {}


class StreamingDetokenizer:
    """Turns a growing list of token ids into text pieces, holding back incomplete UTF-8 sequences."""

    def __init__(self, tokenizer: TextTokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.emitted = 0

    def add(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        piece, self.emitted = text[self.emitted :], len(text)
        return piece

    def flush(self) -> str:
        text = self.tokenizer.decode(self.ids)
        piece, self.emitted = text[self.emitted :], len(text)
        return piece
