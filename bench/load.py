"""Load test of `redrafter-mlx serve`: K concurrent clients x M requests each, against the same requests one at a
time, on a server this tool starts on 127.0.0.1 (or one you point it at). The one-client level sends every prompt
the other levels use at least once: it is their reference.

Per concurrency level: requests per second and tokens per second over the level's wall time, latency and time
to first token (p50 / p95), and every greedy answer checked token-identical (as text) to the one-at-a-time
answer of the same prompt. Bounded: at most `max_requests` per level and `max_seconds` in all.
"""

from __future__ import annotations

import concurrent.futures
import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from mlx_redrafter.errors import UserError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(extra: list[str]) -> tuple[subprocess.Popen, str]:
    """A server process on a free localhost port, ready (health answered)."""
    import httpx

    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "mlx_redrafter.cmd.main", "serve", "--port", str(port), *extra],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.terminate()
    raise RuntimeError("the server did not come up in 5 minutes")


def one_request(url: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """One streamed greedy chat completion: its text, tokens, latency and time to first token."""
    import httpx

    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    t0, first, text, use = time.perf_counter(), None, [], {}
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                if obj.get("usage"):
                    use = obj["usage"]
                elif obj["choices"] and obj["choices"][0]["delta"].get("content"):
                    first = first or time.perf_counter()
                    text.append(obj["choices"][0]["delta"]["content"])
    except httpx.HTTPError as e:
        raise UserError(f"server {url}: {type(e).__name__}: {e}: is it running, and OpenAI-compatible?") from None
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        raise UserError(f"server {url} streamed something that is not OpenAI's chat-completion chunks") from None
    end = time.perf_counter()
    return {"text": "".join(text), "tokens": use.get("completion_tokens", 0), "latency_s": end - t0,
            "ttft_s": (first or end) - t0, "tokens_per_call": use.get("redrafter", {}).get("tokens_per_call")}


def _pct(vals: list[float], q: float) -> float:
    vals = sorted(vals)
    return vals[min(len(vals) - 1, int(round(q * (len(vals) - 1))))] if vals else float("nan")


def run_load(url: str, prompts: list[str], clients: list[int], requests_per_client: int, max_tokens: int,
             max_seconds: float, log=print) -> dict[str, Any]:
    """The reference (one at a time), then each concurrency level; see the module docstring."""
    started = time.perf_counter()
    reference = {}
    levels = []
    used = min(len(prompts), max(clients) * requests_per_client)  # every prompt a level sends has a reference
    for k in [1, *[c for c in clients if c != 1]]:
        n = max(k * requests_per_client, used) if k == 1 else k * requests_per_client
        work = [prompts[i % len(prompts)] for i in range(n)]
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(k) as pool:
            done = list(pool.map(lambda p: (p, one_request(url, p, max_tokens)), work))
        wall = time.perf_counter() - t0
        if k == 1:
            reference = {p: r["text"] for p, r in done}
        same = sum(r["text"] == reference.get(p) for p, r in done)
        lat, ttft = [r["latency_s"] for _, r in done], [r["ttft_s"] for _, r in done]
        levels.append({"clients": k, "requests": n, "wall_s": round(wall, 2),
                       "requests_per_s": round(n / wall, 3),
                       "tokens_per_s": round(sum(r["tokens"] for _, r in done) / wall, 2),
                       "latency_p50_s": round(_pct(lat, 0.5), 2), "latency_p95_s": round(_pct(lat, 0.95), 2),
                       "ttft_p50_s": round(_pct(ttft, 0.5), 2), "ttft_p95_s": round(_pct(ttft, 0.95), 2),
                       "identical_to_one_at_a_time": f"{same}/{n}",
                       "tokens_per_call": round(statistics.mean(r["tokens_per_call"] or 0 for _, r in done), 3)})
        log(f"{k} client(s): {levels[-1]}")
        if time.perf_counter() - started > max_seconds:
            log(f"stopping: the {max_seconds:.0f} s budget is spent")
            break
    return {"levels": levels, "max_tokens": max_tokens, "prompts": len(prompts)}


def markdown(res: dict[str, Any], title: str) -> str:
    lines = [f"# {title}", "", f"{res['prompts']} MT-bench first turns, greedy, at most {res['max_tokens']} new "
             "tokens per request, streamed; the 1-client level is the one-at-a-time reference.", "",
             "| clients | requests | wall s | req/s | tokens/s | latency p50 / p95 s | first token p50 / p95 s "
             "| tokens per call | = one at a time |", "|---|---|---|---|---|---|---|---|---|"]
    for lv in res["levels"]:
        lines.append(f"| {lv['clients']} | {lv['requests']} | {lv['wall_s']} | {lv['requests_per_s']} | "
                     f"{lv['tokens_per_s']} | {lv['latency_p50_s']} / {lv['latency_p95_s']} | {lv['ttft_p50_s']} / "
                     f"{lv['ttft_p95_s']} | {lv['tokens_per_call']} | {lv['identical_to_one_at_a_time']} |")
    return "\n".join(lines) + "\n"


def write(res: dict[str, Any], out: Path, title: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "server-load.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / "server-load.md").write_text(markdown(res, title))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    ks = [lv["clients"] for lv in res["levels"]]
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.5))
    ax[0].plot(ks, [lv["tokens_per_s"] for lv in res["levels"]], "o-")
    ax[0].set(xlabel="concurrent clients", ylabel="tokens/s (all clients)", title="throughput")
    ax[1].plot(ks, [lv["latency_p50_s"] for lv in res["levels"]], "o-", label="latency p50")
    ax[1].plot(ks, [lv["ttft_p50_s"] for lv in res["levels"]], "s-", label="first token p50")
    ax[1].set(xlabel="concurrent clients", ylabel="seconds", title="per request")
    ax[1].legend()
    fig.tight_layout()
    fig.savefig(out / "server-load.png", dpi=110)
