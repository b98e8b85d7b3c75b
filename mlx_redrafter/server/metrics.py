"""What `redrafter-mlx serve` has done, for Prometheus (GET /metrics, text exposition format 0.0.4): completions and
their tokens, latency, and what speculation does — target calls, tokens verified, drafts accepted by the source
that drafted them — so tokens per target call and acceptance can be watched live (vLLM's spec-decode counters, by
our draft sources).

A completion is one choice of a request (a request with `n` 4 is four). Counters only grow while the server runs;
the scheduler's thread updates them, the HTTP side reads them.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field

from mlx_redrafter.generate import Record

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)  # seconds


@dataclass
class Histogram:
    """Cumulative buckets of observed values, their sum and count."""

    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(init=False)  # per bucket, of values up to its bound
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
        self.total += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out = [f'{name}_bucket{{le="{bound:g}"}} {n}' for bound, n in zip(self.buckets, self.counts)]
        return out + [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.total:.6f}",
                      f"{name}_count {self.count}"]


# name -> (type, help); the order of /metrics
FAMILIES = {
    "redrafter_completions_running": ("gauge", "Completions in the batch now."),
    "redrafter_completions_waiting": ("gauge", "Completions queued for a place in the batch."),
    "redrafter_completions_total": ("counter", "Completions ended, by finish reason (stop, length, abort: the "
                                               "client left, error)."),
    "redrafter_prompt_tokens_total": ("counter", "Prompt tokens of the completions started."),
    "redrafter_prompt_tokens_cached_total": ("counter", "Of those, tokens continued from a cached conversation "
                                                        "instead of prefilled."),
    "redrafter_generation_tokens_total": ("counter", "Tokens generated."),
    "redrafter_target_calls_total": ("counter", "Decoding calls of the target (one serves every completion in the "
                                                "batch; prefills not counted)."),
    "redrafter_completion_steps_total": ("counter", "Decoding calls summed over the completions each served: "
                                                    "generated tokens over this is tokens per call."),
    "redrafter_verified_tokens_total": ("counter", "Tokens the target verified in those calls (drafts packed as "
                                                   "a tree, plus each completion's own next token)."),
    "redrafter_accepted_draft_tokens_total": ("counter", "Drafted tokens the target accepted, by the source that "
                                                         "drafted them (rnn, medusa, semi_ar, lookup, answers, "
                                                         "grammar, prediction)."),
    "redrafter_time_to_first_token_seconds": ("histogram", "From a completion's arrival to its first token."),
    "redrafter_completion_seconds": ("histogram", "From a completion's arrival to its end."),
}


class Metrics:
    """The server's counters (thread-safe)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.finished: Counter[str] = Counter()
        self.accepted: Counter[str] = Counter()
        self.first_token = Histogram()
        self.latency = Histogram()

    def started(self, prompt_tokens: int, cached: int) -> None:
        """A completion joined the batch, `cached` of its prompt tokens continued from a cache."""
        with self.lock:
            self.counts["redrafter_prompt_tokens_total"] += prompt_tokens
            self.counts["redrafter_prompt_tokens_cached_total"] += cached

    def target_call(self) -> None:
        with self.lock:
            self.counts["redrafter_target_calls_total"] += 1

    def record(self, record: Record, waited_s: float | None = None) -> None:
        """What one call did for one completion; `waited_s` with its first record (the prefill's): the seconds
        since it came."""
        with self.lock:
            self.counts["redrafter_generation_tokens_total"] += len(record.tokens)
            if waited_s is not None:
                self.first_token.observe(waited_s)
                return
            self.counts["redrafter_completion_steps_total"] += 1
            self.counts["redrafter_verified_tokens_total"] += record.verified
            if record.accepted:
                self.accepted[record.source or "unknown"] += record.accepted

    def ended(self, reason: str, seconds: float) -> None:
        with self.lock:
            self.finished[reason] += 1
            self.latency.observe(seconds)

    def render(self, running: int, waiting: int) -> str:
        """The exposition text."""
        with self.lock:
            values: dict[str, list[str]] = {
                "redrafter_completions_running": [f"redrafter_completions_running {running}"],
                "redrafter_completions_waiting": [f"redrafter_completions_waiting {waiting}"],
                "redrafter_completions_total": [f'redrafter_completions_total{{finish_reason="{r}"}} {n}'
                                                for r, n in sorted(self.finished.items())],
                "redrafter_accepted_draft_tokens_total": [
                    f'redrafter_accepted_draft_tokens_total{{source="{s}"}} {n}'
                    for s, n in sorted(self.accepted.items())],
                "redrafter_time_to_first_token_seconds": self.first_token.lines(
                    "redrafter_time_to_first_token_seconds"),
                "redrafter_completion_seconds": self.latency.lines("redrafter_completion_seconds"),
            }
            out = []
            for name, (kind, text) in FAMILIES.items():
                out += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
                out += values.get(name, [f"{name} {self.counts[name]}"])
            return "\n".join(out) + "\n"
