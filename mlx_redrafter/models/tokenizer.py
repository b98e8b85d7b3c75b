"""Tokenizers: byte-level BPE (GGUF metadata, HF `tokenizer.json`) and SentencePiece (`tokenizer.model`, GGUF
`llama`), the chat template, eos ids, and streaming detokenization that never splits a UTF-8 character."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from mlx_redrafter.errors import UserError
from mlx_redrafter.files import read_bytes, read_json, read_text
from mlx_redrafter.models import spm, templates
from mlx_redrafter.models.gguf import TOKENIZER_KINDS
from mlx_redrafter.schema import shown
from mlx_redrafter.token_ids import check_token_ids

_EOS_NAMES = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "</s>", "<|end|>")

# llama.cpp pre-tokenizer regexes by `tokenizer.ggml.pre`
_LLAMA3_RE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class Backend(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def token_to_id(self, text: str) -> int | None: ...

    def id_to_token(self, i: int) -> str | None: ...


class HFBackend:
    """A Hugging Face `tokenizers.Tokenizer` (byte-level BPE or any tokenizer.json)."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self.vocab_size = tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def token_to_id(self, text: str) -> int | None:
        return self.tok.token_to_id(text)

    def id_to_token(self, i: int) -> str | None:
        return self.tok.id_to_token(i)


def check_text(text: Any) -> str:
    """`text`, or a one-line UserError unless it is a str that UTF-8 can encode: a lone surrogate (e.g. '\\udce9',
    how Python's surrogateescape keeps a command-line byte that is not UTF-8) has no token."""
    if not isinstance(text, str):
        raise UserError(f"the prompt must be text (a str), not a {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        c = text[e.start]
        what = f"the byte 0x{ord(c) - 0xDC00:02x}" if 0xDC80 <= ord(c) <= 0xDCFF else f"a lone surrogate {c!r}"
        raise UserError(f"the prompt is not valid UTF-8 text: it holds {what}, which is not UTF-8: "
                        f"give UTF-8 text (check the terminal's or the file's encoding)") from None
    return text


class TextTokenizer:
    """Encode/decode text, render chat prompts, and know which ids end a generation."""

    def __init__(self, tok: Tokenizer | Backend, chat_template: str | None, eos_ids: Iterable[int],
                 bos_token: str = "", eos_token: str = ""):
        self.backend: Backend = HFBackend(tok) if isinstance(tok, Tokenizer) else tok
        self.tok = self.backend.tok if isinstance(self.backend, HFBackend) else self.backend
        self.chat_template = chat_template
        self.template_source = "the model's own" if chat_template else "none"
        self.eos_ids = sorted(set(int(i) for i in eos_ids))
        self.bos_token, self.eos_token = bos_token, eos_token
        self.vocab_size = self.backend.vocab_size
        self.id_limit: int | None = None  # set by the loader: the model's vocabulary (rows of its embedding)
        self.views: dict[Any, Any] = {}  # what other libraries make of this tokenizer, built once (constraint.py)

    @property
    def kind(self) -> str:
        """'sentencepiece' or 'bpe' (any `tokenizers` model)."""
        return "sentencepiece" if isinstance(self.backend, spm.SentencePieceBackend) else "bpe"

    def encode(self, text: str) -> list[int]:
        """Token ids of text (no BOS added; special tokens written in the text map to their ids). With an
        `id_limit`, an id the model has no embedding row for is a one-line UserError, and so is text that is not
        valid Unicode (`check_text`)."""
        ids = self.backend.encode(check_text(text))
        if self.id_limit is not None and ids and max(ids) >= self.id_limit:
            raise UserError(f"the tokenizer gave token id {max(ids)} but the model's vocabulary has {self.id_limit} "
                            f"tokens: the tokenizer files do not belong to this model")
        return ids

    def check_ids(self, ids: Any, what: str) -> list[int]:
        """Token ids given by a caller (e.g. a prompt as ids), as ints; a one-line UserError unless each is inside
        the model's vocabulary (`id_limit`, else the tokenizer's)."""
        return check_token_ids(ids, self.id_limit or self.vocab_size, what)

    def decode(self, ids: list[int]) -> str:
        """Text of token ids, special tokens included."""
        return self.backend.decode(list(ids))

    def token_bytes(self, i: int) -> bytes:
        """The bytes token `i` adds to text (a piece of a multi-byte character where the token holds part of one;
        the piece as the vocabulary writes it, e.g. SentencePiece's leading space, where decoding a token alone
        would drop it)."""
        piece = self.backend.id_to_token(i)
        if piece is None:
            return self.decode([i]).encode("utf-8")
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # a byte token (byte fallback)
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        if self.kind == "bpe" and type(self.tok.decoder).__name__ == "ByteLevel":
            table = _byte_values()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
        return piece.replace("\u2581", " ").encode("utf-8")

    def token_text(self, i: int) -> str:
        """Token `i` as text on its own (`token_bytes` decoded; a partial character shows as U+FFFD)."""
        return self.token_bytes(i).decode("utf-8", errors="replace")

    def set_template(self, template: str | None, source: str) -> None:
        """Use this chat template (None: none; prompts are then the messages' plain text)."""
        self.chat_template, self.template_source = template, source

    def chat_prompt(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Render messages with the chat template, ready for the assistant's reply."""
        if not self.chat_template:
            return "".join(m["content"] for m in messages)
        return templates.render(self.chat_template, messages, bos_token=self.bos_token, eos_token=self.eos_token,
                                add_generation_prompt=add_generation_prompt,
                                name=f"the chat template ({self.template_source})")

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of messages rendered with the chat template, ready for the assistant's reply."""
        return self.encode(self.chat_prompt(messages))

    def save(self, out: Path) -> list[str]:
        """Write HF tokenizer files (tokenizer.json or tokenizer.model + tokenizer_config.json) into `out`."""
        files = []
        if isinstance(self.backend, HFBackend):
            self.backend.tok.save(str(out / "tokenizer.json"))
            files.append("tokenizer.json")
            cls = "PreTrainedTokenizerFast"
        else:
            (out / "tokenizer.model").write_bytes(self.backend.proto)
            files.append("tokenizer.model")
            cls = "LlamaTokenizer"
        cfg: dict[str, Any] = {"tokenizer_class": cls, "bos_token": self.bos_token or None,
                               "eos_token": self.eos_token or None, "add_bos_token": cls == "LlamaTokenizer",
                               "add_eos_token": False, "clean_up_tokenization_spaces": False}
        if self.chat_template:
            cfg["chat_template"] = self.chat_template
        (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
        return [*files, "tokenizer_config.json"]

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], where: str = "the GGUF file") -> TextTokenizer:
        """The tokenizer stored in a GGUF file: `gpt2` (byte-level BPE) or `llama` (SentencePiece). `meta` holds
        Python values checked by `gguf.check_metadata` (ids inside the vocabulary, merges present)."""
        kind = meta.get("tokenizer.ggml.model")
        tokens: list[str] = list(meta.get("tokenizer.ggml.tokens", []))
        if kind not in TOKENIZER_KINDS:
            raise UserError(f"GGUF tokenizer type {kind!r} is not supported (gpt2 and llama are); use an mlx-lm "
                            f"model directory instead")
        try:
            if kind == "llama":
                backend: Any = spm.SentencePieceBackend(spm.proto_from_gguf(meta))
            else:
                backend = HFBackend(_bpe_from_gguf(meta, tokens))
        except Exception as e:  # sentencepiece / tokenizers reject a malformed vocabulary with long messages
            raise UserError(f"the tokenizer in {where} cannot be built: {templates.first_line(e)}") from None
        eos = meta.get("tokenizer.ggml.eos_token_id")
        eos_ids = {eos} if eos is not None else set()
        eos_ids |= {tokens.index(n) for n in _EOS_NAMES if n in tokens}
        bos = meta.get("tokenizer.ggml.bos_token_id")
        return cls(
            backend, meta.get("tokenizer.chat_template"), eos_ids,
            bos_token=tokens[bos] if bos is not None else "",
            eos_token=tokens[eos] if eos is not None else "",
        )

    @classmethod
    def from_dir(cls, path: Path, config: dict[str, Any]) -> TextTokenizer:
        """The tokenizer of an HF / mlx-lm directory: tokenizer.json, else a SentencePiece tokenizer.model. Every
        file is checked as it is read (JSON objects, ids that are integers, token texts that are strings)."""
        tcfg = _read_json(path / "tokenizer_config.json")
        gcfg = _read_json(path / "generation_config.json")
        smap = _read_json(path / "special_tokens_map.json")
        if (path / "tokenizer.json").exists():
            read_bytes(path / "tokenizer.json", "tokenizer file")  # a directory or unreadable: one line
            try:
                backend: Any = HFBackend(Tokenizer.from_file(str(path / "tokenizer.json")))
            except Exception as e:  # tokenizers raises a bare Exception with a long message
                raise UserError(f"cannot read {path / 'tokenizer.json'}: {templates.first_line(e)}") from None
        elif (path / "tokenizer.model").exists():
            added = {**_id_map(_read_json(path / "added_tokens.json"), path / "added_tokens.json"),
                     **_added_tokens_decoder(tcfg, path / "tokenizer_config.json")}
            backend = spm.from_file(path / "tokenizer.model", added, legacy=tcfg.get("legacy", True) is not False)
        else:
            raise UserError(f"{path} has no tokenizer (tokenizer.json or tokenizer.model): add the model's "
                            f"Hugging Face tokenizer files")
        template = _chat_template(path, tcfg)
        eos_ids: set[int] = set()
        for src, file in ((config.get("eos_token_id"), "config.json"), (gcfg.get("eos_token_id"),
                                                                         "generation_config.json")):
            ids = src if isinstance(src, list) else [src] if src is not None else []
            if not all(type(i) is int and i >= 0 for i in ids):
                raise UserError(f"{path / file}: eos_token_id = {shown(src)} is not a token id or a list of them")
            eos_ids |= set(ids)
        where = path / "tokenizer_config.json"
        eos_tok = _token_text(tcfg.get("eos_token"), where) or _token_text(smap.get("eos_token"), where) or _id_text(
            backend, config.get("eos_token_id"))
        bos_tok = _token_text(tcfg.get("bos_token"), where) or _token_text(smap.get("bos_token"), where) or _id_text(
            backend, config.get("bos_token_id"))
        eos_ids |= {i for n in (*_EOS_NAMES, eos_tok) if n and (i := backend.token_to_id(n)) is not None}
        return cls(backend, template, eos_ids, bos_token=bos_tok or "", eos_token=eos_tok or "")


def _chat_template(path: Path, tcfg: dict[str, Any]) -> str | None:
    """The directory's chat template: tokenizer_config.json's (a string, or a list of named ones: "default"),
    else chat_template.jinja, else chat_template.json's."""
    where = path / "tokenizer_config.json"
    template = tcfg.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        if not all(isinstance(t, dict) for t in template):
            raise UserError(f"{where}: chat_template is a list whose entries are not {{\"name\", \"template\"}} "
                            f"objects")
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if template is None and (path / "chat_template.jinja").exists():
        return read_text(path / "chat_template.jinja", "chat template")
    if template is None and (path / "chat_template.json").exists():
        where = path / "chat_template.json"
        template = _read_json(where).get("chat_template")
    if template is not None and not isinstance(template, str):
        raise UserError(f"{where}: chat_template = {shown(template)} is not a string (a Jinja template)")
    return template


def _id_map(m: dict[str, Any], where: Path) -> dict[str, int]:
    """{token text: id} of added_tokens.json, checked."""
    if not all(type(i) is int and i >= 0 for i in m.values()):
        raise UserError(f"{where} must map token texts to token ids (integers >= 0)")
    return m


def _added_tokens_decoder(tcfg: dict[str, Any], where: Path) -> dict[str, int]:
    """{token text: id} of tokenizer_config.json's added_tokens_decoder ({"id": {"content": text, ...}}), checked."""
    dec = tcfg.get("added_tokens_decoder", {})
    out: dict[str, int] = {}
    for k, v in (dec.items() if isinstance(dec, dict) else [(None, None)]):
        text = v.get("content") if isinstance(v, dict) else v
        if not (isinstance(k, str) and k.isdigit() and isinstance(text, str)):
            raise UserError(f"{where}: added_tokens_decoder must map ids to {{\"content\": text}} objects (entry "
                            f"{shown(k)}: {shown(v)})")
        out[text] = int(k)
    return out


@functools.cache
def _byte_values() -> dict[str, int]:
    """Byte-level BPE's alphabet: the printable character that stands for each byte value (GPT-2's mapping)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _bpe_from_gguf(meta: dict[str, Any], tokens: list[str]) -> Tokenizer:
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
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty in (3, 4)]
    )
    return tok


def _id_text(backend: Backend, i: Any) -> str | None:
    """The text of token id `i` from a config (an int, a list: its first, or None)."""
    i = i[0] if isinstance(i, list) and i else i
    return backend.id_to_token(i) if type(i) is int and i >= 0 else None


def _token_text(t: Any, where: Path) -> str | None:
    """A special token's text from a tokenizer config: a string, or an AddedToken object {"content": text}."""
    text = t.get("content") if isinstance(t, dict) else t
    if text is not None and not isinstance(text, str):
        raise UserError(f"{where}: a special token is {shown(t)}, not a string or {{\"content\": text}}")
    return text


def _read_json(p: Path) -> dict[str, Any]:
    """A tokenizer JSON file's object ({} when the file is absent)."""
    return read_json(p, "tokenizer file") if p.exists() else {}


class StreamingDetokenizer:
    """Turns a growing list of token ids into text pieces, never emitting an incomplete UTF-8 character.

    Decodes only a window (the last emitted piece's tokens, as context for e.g. SentencePiece's leading
    spaces, plus the new ones), so a long answer costs O(n), not O(n^2)."""

    def __init__(self, tokenizer: TextTokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # window start
        self.read = 0  # ids[:read] are emitted

    def add(self, ids: list[int]) -> str:
        """Text newly completed by these ids ('' while a multi-byte character is still incomplete)."""
        self.ids.extend(ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """Whatever is left (an incomplete character becomes U+FFFD)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self.read == len(self.ids):
            return ""
        before = self.tokenizer.decode(self.ids[self.prefix:self.read])
        text = self.tokenizer.decode(self.ids[self.prefix:])
        if not final and (len(text) <= len(before) or text.endswith("\ufffd")):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before):]
