"""A chat conversation: messages, the KV cache that holds them, and what each new turn must prefill.

    session = ChatSession(lm, decode_options(max_tokens=256), system="Be brief.")
    for piece in session.send("Hello!"): print(piece, end="")
    session.last.prefill_tokens          # only the new turn's tokens after the first turn

Each turn renders the whole conversation with the chat template. When the rendered text extends what the
cache already holds (the usual case), only the extension is encoded and prefilled; otherwise (a template
that rewrites earlier turns, dropped turns) the longest common token prefix with the cache is kept and the
rest re-prefilled. An answer stopped early (Ctrl-C, a `stop` callback) stays in the history exactly as far
as it was shown. The cache always holds exactly `tokens` (the decoding loops leave it holding what they
emitted, however they end). When the conversation outgrows
the context, the oldest turns are dropped (`Turn.dropped_turns`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from mlx_redrafter import api
from mlx_redrafter.errors import UserError
from mlx_redrafter.generate import Stats

MIN_ANSWER_ROOM = 16  # tokens an answer may at least use before older turns are dropped


@dataclass
class Turn:
    """What one answer did."""

    text: str
    tokens: list[int]
    stats: Stats
    prefill_tokens: int  # tokens fed before answering: the new turn (+ whatever had to be re-prefilled)
    prompt_tokens: int  # the whole rendered conversation: what a fresh prefill (no KV reuse) would feed
    stop: str  # eos | max_tokens | interrupted
    dropped_turns: int = 0


@dataclass
class Totals:
    """Counters over a session (since the last reset)."""

    turns: int = 0
    generated: int = 0
    prefilled: int = 0
    without_reuse: int = 0  # what prefilling every turn's whole conversation would have cost
    dropped_turns: int = 0


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class ChatSession:
    """A multi-turn conversation with KV-cache reuse over a loaded model."""

    def __init__(self, lm: api.LoadedModel, options: api.DecodeOptions | None = None, system: str | None = None,
                 max_context: int | None = None):
        self.lm = lm
        self.options = options or api.DecodeOptions()
        self.options.check()
        self.mode = api.draft_mode(lm, self.options)  # a mode the loaded drafter cannot serve fails here
        self.system = system
        ctx = lm.target.model.args.max_position_embeddings
        self.max_context = min(max_context, ctx) if max_context is not None else ctx
        if self.max_context < 2 * MIN_ANSWER_ROOM:
            raise UserError(f"--max-context must be at least {2 * MIN_ANSWER_ROOM} tokens (got {self.max_context})")
        self.last: Turn | None = None
        self.reset()

    def set_options(self, **flat: Any) -> None:
        """Change decoding options by flat name for the next answers (`DecodeOptions.updated`); a bad value, or a
        draft mode the loaded drafter cannot serve, is a one-line UserError that changes nothing."""
        options = self.options.updated(**flat)
        options.check()
        mode = api.draft_mode(self.lm, options)
        self.options, self.mode = options, mode

    def set_json_schema(self, schema: Any) -> None:
        """Make the next answers follow this JSON schema (an object, its JSON text or a file; None: free text)."""
        if schema is None:
            options = replace(self.options, json_schema=None)
            self.options, self.mode = options, api.draft_mode(self.lm, options)
        else:
            self.set_options(json_schema=schema)

    def set_system(self, system: str | None) -> None:
        """Use this system prompt (None: the template's own) and start a new conversation."""
        self.system = system
        self.reset()

    def reset(self) -> None:
        """Forget the conversation (the system message stays) and the cache."""
        self.messages: list[dict[str, str]] = [{"role": "system", "content": self.system}] if self.system else []
        self.cache = None
        self.tokens: list[int] = []  # exactly the ids whose K/V the cache holds (cache.offset == len(tokens))
        self.text: str | None = ""  # the text that tokens encode (None: not known, re-encode the conversation)
        self.totals = Totals()

    @property
    def context_tokens(self) -> int:
        """Tokens of the conversation so far (all in the cache)."""
        return len(self.tokens)

    def send(self, message: str, stop: Callable[[], bool] | None = None) -> Iterator[str]:
        """Ask `message`; yields the answer's text pieces as tokens are accepted. `stop()` (checked after each
        piece) or closing the iterator ends the answer early; either way the history stays consistent."""
        if not message.strip():
            raise UserError("the message is empty")
        saved = list(self.messages)
        self.messages.append({"role": "user", "content": message})
        try:
            ids, dropped = self._plan()
        except BaseException:
            self.messages = saved  # a rejected message (too long) leaves no trace, dropped turns included
            raise
        stats, out, reason, new = Stats(), [], "interrupted", ids[len(self.tokens):]
        gen = None
        try:
            max_tokens = max(1, min(self.options.max_tokens, self.max_context - len(ids)))
            if self.cache is None:
                self.cache = self.lm.target.model.make_cache(len(ids) + max_tokens + 64)
            gen = api.stream_generate(self.lm, new, self.options, cache=self.cache, history=self.tokens,
                                      max_tokens=max_tokens)
            for r in gen:
                out.extend(r.tokens)
                if r.record is not None:
                    stats.add(r.record)
                if r.text:
                    yield r.text
                if stop is not None and stop():
                    break
            else:
                reason = stats.stop_reason or "max_tokens"
        finally:
            if gen is not None:
                gen.close()  # the cache now holds ids + out (see generate.py)
            self._commit(ids, len(new), out, stats, reason, dropped)

    def _plan(self) -> tuple[list[int], int]:
        """Token ids of the whole conversation, ready for the answer; trims the cache to the reusable prefix."""
        tok, dropped = self.lm.tokenizer, 0
        room = min(self.options.max_tokens, self.max_context // 2)
        while True:
            text = tok.chat_prompt(self.messages)
            if self.tokens and self.text is not None and text.startswith(self.text):
                ids = self.tokens + tok.encode(text[len(self.text):])  # only the new turn is encoded
            else:
                ids = tok.encode(text)
            if len(ids) + max(room, MIN_ANSWER_ROOM) <= self.max_context or not self._drop_oldest_turn():
                break
            dropped += 1
        if len(ids) + MIN_ANSWER_ROOM > self.max_context:
            raise UserError(f"the message is too long: the conversation needs {len(ids)} tokens, the context holds "
                            f"{self.max_context} (an answer needs {MIN_ANSWER_ROOM} more)")
        keep = min(common_prefix(self.tokens, ids), len(ids) - 1)  # at least one token to prefill
        if keep < len(self.tokens):
            self.cache.offset = keep  # entries past the offset are scratch: overwritten by the next prefill
            self.tokens = self.tokens[:keep]
        self.text = text
        self.totals.dropped_turns += dropped
        return ids, dropped

    def _drop_oldest_turn(self) -> bool:
        """Remove the oldest user turn and its answer (never the system message or the current question)."""
        first = 1 if self.messages and self.messages[0]["role"] == "system" else 0
        users = [i for i, m in enumerate(self.messages) if m["role"] == "user" and i >= first]
        if len(users) < 2:
            return False
        del self.messages[first:users[1]]
        return True

    def _commit(self, ids: list[int], prefill: int, out: list[int], stats: Stats, reason: str, dropped: int) -> None:
        tok = self.lm.tokenizer
        if reason == "interrupted":  # keep whole characters only: the history must match what was shown
            for _ in range(4):
                if not out or not tok.decode(out).endswith("\ufffd"):
                    break
                out.pop()
        known = ids + out
        if self.cache is not None:  # interrupted during the prefill: the cache holds the old tokens only
            self.cache.offset = min(self.cache.offset, len(known))
        self.tokens = known[: self.cache.offset] if self.cache is not None else []
        answer = tok.decode(out)
        self.messages.append({"role": "assistant", "content": answer})
        # Interrupted during the prefill, the cache holds less than the conversation: the next turn encodes the
        # whole conversation and reuses the common prefix.
        self.text = self.text + answer if len(self.tokens) == len(known) else None
        self.last = Turn(text=answer, tokens=out, stats=stats, prefill_tokens=prefill, prompt_tokens=len(ids),
                         stop=reason, dropped_turns=dropped)
        t = self.totals
        t.turns, t.generated, t.prefilled, t.without_reuse = (t.turns + 1, t.generated + len(out),
                                                             t.prefilled + prefill, t.without_reuse + len(ids))

    def stats_text(self) -> str:
        """A few lines on the last answer and the session (the chat command's /stats)."""
        if self.last is None:
            return "no answer yet"
        t, s = self.last, self.last.stats
        settings = api.settings(self.lm, self.options)
        srcs = ", ".join(f"{k} {v:.2f}" for k, v in sorted(s.source_tokens_per_step().items())) or "none"
        hist = " ".join(f"{k}x{v}" for k, v in sorted(s.accepted_hist.items())) or "-"
        mode = settings["draft"]
        shape = (f"W={settings['beam_width']}, " if settings["beam_width"] else "") + f"L={settings['beam_length']}"
        lines = [
            f"last answer: {len(t.tokens)} tokens, {s.decode_tokens_per_s:.1f} tok/s, {s.tokens_per_step:.2f} tokens "
            f"per target call ({s.steps} calls), stop: {t.stop}",
            f"prefill: {t.prefill_tokens} new tokens in {s.prefill_s:.2f} s; conversation {t.prompt_tokens} tokens "
            f"(context {self.max_context}){f'; dropped {t.dropped_turns} oldest turn(s)' if t.dropped_turns else ''}",
            f"drafting: {mode}" + (f" ({shape}); tokens per call by source: {srcs}; accepted drafts per call: {hist}"
                                   if self.mode.drafts else " (plain autoregressive)"),
            f"session: {self.totals.turns} answers, {self.totals.generated} tokens generated; prefilled "
            f"{self.totals.prefilled} tokens ({self.totals.without_reuse} without KV-cache reuse)",
        ]
        return "\n".join(lines)
