"""Continuous-batching greedy generation in PyTorch for the CUDA job: a fixed set of KV-cache slots, each holding one
sequence; finished sequences leave their slot and queued prompts take it at once, so the batch stays full until the
queue runs dry. Sequences that share a prefix (the turn-2 passes over one turn-1 sequence, which differ only in the
follow-up request) prefill it once and copy its cache to each branch.

The layers are the target's own `LlamaForCausalLM` modules (norms, projections, MLPs, rotary frequencies); only
attention is written here, over the slot cache. Float32 throughout; greedy answers equal transformers' own loop up
to float rounding (the CUDA job's parity step measures them against the runtime here). Torch only: no MLX."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Unit:
    """Prompts that share a prefix: `prefix` then one follow-up per branch; `keys` name the branches' answers."""

    prefix: list[int]
    follows: list[list[int]]
    keys: list[Any]


@dataclass
class _Running:
    key: Any
    response: list[int] = field(default_factory=list)


class SlotCache:
    """Keys and values of `slots` sequences of up to `max_len` tokens, per layer: [slots, kv heads, max_len, head]."""

    def __init__(self, model: Any, slots: int, max_len: int, device: str):
        cfg = model.config
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        shape = (cfg.num_hidden_layers, slots, self.kv_heads, max_len, self.head_dim)
        self.k = torch.zeros(shape, dtype=torch.float32, device=device)
        self.v = torch.zeros(shape, dtype=torch.float32, device=device)
        self.slots, self.max_len = slots, max_len

    def copy(self, src: torch.Tensor, dst: torch.Tensor, length: int) -> None:
        """Slots `dst` get the first `length` entries of slots `src` (one source per destination)."""
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]


class SlotModel:
    """The target's forward over a SlotCache: tokens at explicit positions of explicit slots."""

    def __init__(self, model: Any, slots: int, max_len: int, device: str):
        self.model, self.device = model, device
        self.layers = model.model.layers
        cfg = model.config
        self.heads = cfg.num_attention_heads
        self.cache = SlotCache(model, slots, max_len, device)
        self.rep = self.heads // self.cache.kv_heads
        self.scale = self.cache.head_dim ** -0.5
        rot = model.model.rotary_emb
        pos = torch.arange(max_len, device=device, dtype=torch.float32)
        freqs = pos[:, None] * rot.inv_freq.to(device).float()[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        scaling = float(getattr(rot, "attention_scaling", 1.0))
        self.cos, self.sin = emb.cos() * scaling, emb.sin() * scaling  # [max_len, head]
        self.all_slots = torch.arange(slots, device=device)

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        a, b = x.chunk(2, dim=-1)
        return torch.cat([-b, a], dim=-1)

    def forward(self, slots: torch.Tensor, tokens: torch.Tensor, start: torch.Tensor, span: int,
                last: torch.Tensor | None = None) -> torch.Tensor:
        """Write `tokens` [n, T] (right-padded) at positions start[i] + 0..T-1 of `slots` [n] (`all_slots` itself:
        every slot, read in place) and return the final hidden state of each row's position `last[i]` (default
        T-1), [n, hidden]. Queries attend to their slot's entries up to their own position; `span` bounds the
        entries read (> every position written)."""
        n, T = tokens.shape
        pos = start[:, None] + torch.arange(T, device=self.device)[None, :]  # [n, T]
        cos, sin = self.cos[pos][:, :, None, :], self.sin[pos][:, :, None, :]  # [n, T, 1, head]
        whole = slots is self.all_slots  # every slot in order: read the cache in place
        keys = torch.arange(span, device=self.device)
        q_pos = pos.repeat(1, self.rep)  # query rows grouped (repeat, T) per kv head
        mask = keys[None, None, :] > q_pos[:, :, None]  # [n, rep * T, span]: True where a query may not look
        mask = mask[:, None]
        kvh, hd = self.cache.kv_heads, self.cache.head_dim
        x = self.model.model.embed_tokens(tokens)
        for li, layer in enumerate(self.layers):
            att = layer.self_attn
            h = layer.input_layernorm(x)
            q = att.q_proj(h).view(n, T, self.heads, hd)
            k = att.k_proj(h).view(n, T, kvh, hd)
            v = att.v_proj(h).view(n, T, kvh, hd)
            q = q * cos + self._rotate_half(q) * sin
            k = k * cos + self._rotate_half(k) * sin
            ck, cv = self.cache.k[li], self.cache.v[li]
            ck[slots[:, None], :, pos] = k
            cv[slots[:, None], :, pos] = v
            if whole:
                kk, vv = ck[:, :, :span], cv[:, :, :span]
            else:
                kk, vv = ck[slots, :, :span], cv[slots, :, :span]
            # [n, T, heads, hd] -> [n, kv, rep * T, hd]: head h reads kv head h // rep (transformers' repeat_kv)
            qg = q.view(n, T, kvh, self.rep, hd).permute(0, 2, 3, 1, 4).reshape(n, kvh, self.rep * T, hd)
            scores = torch.matmul(qg, kk.transpose(-1, -2)) * self.scale
            scores = scores.masked_fill(mask, float("-inf"))
            o = torch.matmul(torch.softmax(scores, dim=-1), vv)  # [n, kv, rep * T, hd]
            o = o.view(n, kvh, self.rep, T, hd).permute(0, 3, 1, 2, 4).reshape(n, T, self.heads * hd)
            x = x + att.o_proj(o)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        if last is None:
            x = x[:, -1]
        else:
            x = x[torch.arange(n, device=self.device), last]
        return self.model.model.norm(x)

    def next_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """The greedy token after each final hidden state."""
        return self.model.lm_head(hidden).argmax(-1)


def _padded(seqs: list[list[int]], device: str, fill: int = 0) -> torch.Tensor:
    T = max(len(s) for s in seqs)
    out = torch.full((len(seqs), T), fill, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, :len(s)] = torch.tensor(s, dtype=torch.long)
    return out.to(device)


def generate(model: Any, units: list[Unit], max_new: int, eos_ids: list[int], device: str, slots: int = 512,
             max_len: int = 1280, deadline: float | None = None, drain_s: float = 30.0,
             on_answer: Callable[[Any, list[int]], None] | None = None,
             admit_tokens: int = 65536) -> dict[Any, list[int]]:
    """Greedy answers (each ending with an eos id where the model stopped by itself, else `max_new` tokens) keyed by
    the units' keys, in the order units were given as far as the deadline allows: no unit starts within `drain_s`
    of `deadline`, and whatever is still running at the deadline is dropped. `on_answer(key, answer)` is called as
    each answer finishes. Prefills take at most `admit_tokens` padded tokens at a time."""
    if any(len(u.follows) > slots for u in units):
        raise ValueError(f"a unit has more follow-ups than the {slots} slots: give more slots")
    sm = SlotModel(model, slots, max_len, device)
    eos = set(eos_ids)
    queue = deque(units)
    free = list(range(slots))
    running: dict[int, _Running] = {}
    length = [0] * slots  # cache entries of each slot
    cur = torch.zeros(slots, dtype=torch.long, device=device)  # each slot's last token (not yet in its cache)
    answers: dict[Any, list[int]] = {}

    def finish(slot: int) -> None:
        r = running.pop(slot)
        answers[r.key] = r.response
        if on_answer:
            on_answer(r.key, r.response)
        length[slot] = 0
        free.append(slot)

    def admit() -> None:
        """Start queued units while their branches fit the free slots: prefixes once, then each follow-up."""
        take: list[Unit] = []
        width = tokens = 0
        while queue and width + len(queue[0].follows) <= len(free):
            u = queue[0]
            if take and (len(take) + 1) * max(tokens, len(u.prefix)) > admit_tokens:
                break
            take.append(queue.popleft())
            width += len(u.follows)
            tokens = max(tokens, len(u.prefix))
        if not take:
            return
        firsts, branch_slots, follows, prefix_len = [], [], [], []
        for u in take:
            mine = [free.pop() for _ in u.follows]
            firsts.append(mine[0])
            for s, f, key in zip(mine, u.follows, u.keys):
                branch_slots.append(s)
                follows.append(f)
                prefix_len.append(len(u.prefix))
                running[s] = _Running(key)
        first_t = torch.tensor(firsts, device=device)
        sm.forward(first_t, _padded([u.prefix for u in take], device), torch.zeros(len(take), dtype=torch.long,
                   device=device), max(len(u.prefix) for u in take))
        src = [firsts[i] for i, u in enumerate(take) for _ in u.follows]
        pairs = [(s, d) for s, d in zip(src, branch_slots) if s != d]
        if pairs:
            sm.cache.copy(torch.tensor([p[0] for p in pairs], device=device),
                          torch.tensor([p[1] for p in pairs], device=device), max(len(u.prefix) for u in take))
        bs = torch.tensor(branch_slots, device=device)
        start = torch.tensor(prefix_len, device=device)
        span = max(p + len(f) for p, f in zip(prefix_len, follows))
        last = torch.tensor([len(f) - 1 for f in follows], device=device)
        nxt = sm.next_tokens(sm.forward(bs, _padded(follows, device), start, span, last))
        cur[bs] = nxt
        for s, p, f, t in zip(branch_slots, prefix_len, follows, nxt.tolist()):
            length[s] = p + len(f)
            running[s].response.append(t)
            if t in eos or max_new == 1:
                finish(s)

    with torch.no_grad():
        while queue or running:
            now = time.perf_counter()
            if deadline is not None and now > deadline:
                break
            may_admit = bool(queue) and (deadline is None or now < deadline - drain_s)
            if may_admit and (len(free) >= max(1, slots // 8) or not running):
                admit()
            if not running:
                if may_admit:
                    continue  # every unit admitted answered at once
                break  # draining before the deadline: the rest of the queue waits for another run
            span = max(length[s] for s in running) + 1
            start = torch.tensor(length, device=device)
            nxt = sm.next_tokens(sm.forward(sm.all_slots, cur[:, None], start, span))
            cur = nxt
            got = nxt.tolist()  # the step's one host sync
            for s in list(running):
                length[s] += 1
                r = running[s]
                r.response.append(got[s])
                if got[s] in eos or len(r.response) >= max_new:
                    finish(s)
    return answers
