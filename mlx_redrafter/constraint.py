"""Structured output: a grammar the answer must follow (a JSON schema, any JSON object), as masks over the vocabulary.

A `Constraint` follows one sequence's generated tokens (llguidance's matcher, the library vLLM and SGLang use). Every
choice reads the target's logits with the tokens the grammar forbids at -inf (`sampling.adjust`), so plain and
speculative decoding decide the same tokens under it: in a verified tree each node is masked by the grammar's state
after its own path (`allowed_tree`), drafts the grammar forbids are never accepted, and the answer ends (eos) only
where the grammar is complete. The masks are computed on the host, so a constrained step syncs once more (after
drafting, to read the tree's tokens) and a constrained plain loop queues its next forward but chooses only once the
mask after the previous token is known. What the grammar forces next is drafted by `draft/grammar.py`.

`response_format` takes OpenAI's forms: {"type": "text"} (no constraint), {"type": "json_object"} (any JSON
object), {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mlx_redrafter.errors import UserError
from mlx_redrafter.files import json_type, read_json
from mlx_redrafter.models.tokenizer import TextTokenizer

# JSON as Python's json.dumps writes it: ", " and ": " between items and keys, no other whitespace. Free whitespace
# lets a small model spend tokens on newlines and blank lines, and it keeps a key's separator from being forced.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
SPECIAL = b"\xff"  # llguidance's marker of a special token's bytes (never matched as text)


def response_format(value: Any) -> str | None:
    """The JSON schema (as text) an OpenAI `response_format` asks for; None for plain text. A UserError names what
    is wrong."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise UserError(f"response_format must be a JSON object ({e})") from None
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise UserError("response_format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                        "{\"type\": \"json_schema\", \"json_schema\": {\"schema\": {...}}}")
    if value["type"] == "text":
        return None
    if value["type"] == "json_object":
        return schema_text({"type": "object"})
    spec = value.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise UserError("response_format json_schema needs \"json_schema\": {\"name\": ..., \"schema\": {a JSON "
                        "schema object}}")
    return schema_text(schema)


def schema_text(schema: Any) -> str:
    """A JSON schema (an object, its JSON text, or a file holding that) as JSON text; a UserError if it
    is none of them."""
    if isinstance(schema, str) and not schema.strip():
        raise UserError("--json-schema is empty: give a JSON schema object (as JSON text) or a file holding one")
    if isinstance(schema, str) and not schema.lstrip().startswith(("{", "[")):
        schema = read_json(Path(schema), "the --json-schema file")
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError) as e:
            why = e if isinstance(e, ValueError) else "nested too deeply"
            raise UserError(f"--json-schema is not valid JSON ({why}): give a JSON schema object, or a file holding "
                            "one") from None
    if not isinstance(schema, dict):
        raise UserError(f"--json-schema must be a JSON schema object (got a JSON {json_type(schema)})")
    return json.dumps(schema)  # in its own order: properties are generated in the order the schema lists them


def check_schema(schema: str) -> None:
    """A UserError unless `schema` (JSON text) compiles to a grammar llguidance can follow."""
    _grammar(schema)


class Constraint:
    """The grammar's state after one sequence's generated tokens (see the module docstring)."""

    def __init__(self, schema: str, tokenizer: TextTokenizer, vocab_size: int):
        import llguidance

        self.vocab_size, self.eos_ids = vocab_size, list(tokenizer.eos_ids)
        self.matcher = llguidance.LLMatcher(_lltokenizer(tokenizer, vocab_size), _grammar(schema), log_level=0)

    def advance(self, tokens: Sequence[int]) -> None:
        """The sequence went on with `tokens` (an eos ends the grammar; tokens after it are ignored)."""
        for t in tokens:
            if self.matcher.is_stopped():
                return
            if not self.matcher.consume_token(int(t)):
                raise RuntimeError(f"internal error: token {t} was decided against the grammar "
                                   f"({self.matcher.get_error()})")

    def forced(self) -> list[int]:
        """The tokens the grammar forces next (may be none)."""
        return [] if self.matcher.is_stopped() else self.matcher.compute_ff_tokens()

    def allowed(self) -> mx.array:
        """(1, V) bool: the tokens the grammar allows next."""
        return mx.array(self._mask()[None])

    def allowed_tree(self, tokens: list[int], parents: list[int]) -> mx.array:
        """(P, V) bool: for each node of a packed tree (its tokens and parents, the root first: the sequence's
        last token, already advanced over), the tokens the grammar allows after the node's path. A node the
        grammar forbids is never accepted; its row allows everything."""
        rows = []
        paths: list[list[int] | None] = [[]]
        for i in range(1, len(tokens)):
            up = paths[parents[i]]
            paths.append(None if up is None else [*up, tokens[i]])
        for path in paths:
            if path is None or self.matcher.validate_tokens(path) < len(path):
                rows.append(np.ones(self.vocab_size, dtype=bool))
                continue
            self.matcher.consume_tokens(path)
            rows.append(self._mask())
            self.matcher.rollback(len(path))
        return mx.array(np.stack(rows))

    def _mask(self) -> np.ndarray:
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        mask = np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(bool)
        if not mask.any():  # the grammar is stuck (a parser limit reached): end the answer rather than sample nothing
            mask[self.eos_ids] = True
        return mask


def allowed_next(constraint: Constraint | None) -> mx.array | None:
    """(1, V) bool: what a sequence's grammar allows next; None without one."""
    return None if constraint is None else constraint.allowed()


def advance(constraint: Constraint | None, tokens: Sequence[int]) -> None:
    """A sequence with a grammar (or None) went on with `tokens`."""
    if constraint is not None:
        constraint.advance(tokens)


@lru_cache(maxsize=64)
def _grammar_text(schema: str) -> str:
    import llguidance

    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_STYLE)


def _grammar(schema: str) -> str:
    import llguidance

    try:
        grammar = _grammar_text(schema)
    except ValueError as e:
        raise UserError(f"--json-schema: the schema is not usable ({e})") from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error and not error.startswith("WARNING"):
        raise UserError(f"--json-schema: the schema is not usable ({_first_line(error)})")
    return grammar


def _first_line(error: str) -> str:
    """llguidance's error on one line: its first line, with the cause where that line only introduces it (a regex
    error: "regex parse error:", the pattern, a caret, then "error: ...")."""
    lines = [ln.strip() for ln in error.splitlines() if ln.strip()]
    if lines[0].endswith(":") and lines[-1].startswith("error:"):
        return f"{lines[0]} {lines[-1].removeprefix('error:').strip()} in {lines[1]!r}"
    return lines[0]


def _lltokenizer(tokenizer: TextTokenizer, vocab_size: int) -> Any:
    """llguidance's view of the tokenizer: every token's bytes (special tokens marked), its eos ids (built once per
    tokenizer and vocabulary size, kept on the tokenizer: ~1 s)."""
    key = ("llguidance", vocab_size)
    if key not in tokenizer.views:
        import llguidance

        special = set(tokenizer.eos_ids) | _special_ids(tokenizer)

        class _View:
            eos_token_id = tokenizer.eos_ids[0] if tokenizer.eos_ids else 0
            bos_token_id = None
            tokens = [SPECIAL + tokenizer.decode([i]).encode("utf-8") if i in special else tokenizer.token_bytes(i)
                      for i in range(vocab_size)]
            special_token_ids = sorted(special)

            def __call__(self, text: bytes) -> list[int]:
                return tokenizer.encode(text.decode("utf-8", errors="replace"))

        tokenizer.views[key] = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_View()), n_vocab=vocab_size,
                                                  eos_token=list(tokenizer.eos_ids) or None)
    return tokenizer.views[key]


def _special_ids(tokenizer: TextTokenizer) -> set[int]:
    added = getattr(tokenizer.tok, "get_added_tokens_decoder", None)
    if added is not None:
        return {i for i, t in added().items() if getattr(t, "special", False)}
    return {i for i in range(min(tokenizer.vocab_size, 512))
            if tokenizer.backend.id_to_token(i) in ("<s>", "</s>", "<unk>", "<pad>")}
