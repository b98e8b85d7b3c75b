"""llama.cpp's own autoregressive generation (through llama-cpp-python) on the same GGUF file: the baseline a user
of a CPU is most likely to pick instead of this project.

llama.cpp computes with the file's quantized weights and 8-bit quantized activations (its own kernels, its own
threads), so its greedy answers are close to ours but not the same ids; the benchmark reports how close. It runs in
a process of its own (`python -m bench.llama_cpp_ref GGUF CONTEXT THREADS`, a JSON line in and out per prompt):
loaded into the benchmark's process, its threads and ours slowed each other down (2026-11-30, 2-core Zen 3: our AR
46 -> 32 tokens/s, llama.cpp 85 -> 31). It is an optional extra (`make .venv/.llama-cpp`: llama-cpp-python builds
llama.cpp from source, ~15 minutes on 2 cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the worker process imports nothing of MLX
    from mlx_redrafter.generate import Stats
    from mlx_redrafter.sweep import Config

INSTALL_HINT = "make .venv/.llama-cpp (builds llama-cpp-python, ~15 minutes on 2 cores)"


def available() -> bool:
    """llama-cpp-python is installed."""
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def gguf_of(path: Path) -> Path | None:
    """The GGUF file a target was loaded from, if it was loaded from one."""
    if path.is_file() and path.suffix == ".gguf":
        return path
    found = sorted(path.glob("*.gguf")) if path.is_dir() else []
    return found[0] if len(found) == 1 else None


class LlamaCppDecoder:
    """A sweep decoder: llama.cpp's greedy generation on `gguf` with `threads` (default: every core), in a worker
    process started here and ended with this object (or the benchmark's process)."""

    def __init__(self, gguf: Path, eos_ids: list[int], context: int, threads: int | None = None):
        n = threads or os.cpu_count() or 1
        root = Path(__file__).resolve().parents[1]
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.llama_cpp_ref", str(gguf), str(context), str(n),
                                      ",".join(str(i) for i in eos_ids)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=root)

    def __call__(self, prompt: list[int], options) -> tuple[list[int], Stats]:
        """New token ids (eos ends the generation and is not emitted) and Stats with our conventions (greedy only)."""
        from mlx_redrafter.errors import UserError
        from mlx_redrafter.generate import Stats

        if not options.sampling.greedy:
            raise UserError("the llama.cpp baseline decodes greedily only: pass --no-llama-cpp with --temperatures > 0")
        self.proc.stdin.write(json.dumps({"prompt": prompt, "max_tokens": options.max_tokens}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise UserError(f"the llama.cpp worker ended (exit status {self.proc.wait()}, its error above): "
                            "reinstall it with make .venv/.llama-cpp, or pass --no-llama-cpp")
        got = json.loads(line)
        stats = Stats(prompt_tokens=len(prompt), prefill_s=got["prefill_s"], decode_s=got["decode_s"],
                      stop_reason=got["stop"], generated_tokens=len(got["tokens"]))
        stats.steps = max(len(got["tokens"]) - 1 + (got["stop"] == "eos"), 0)
        return got["tokens"], stats

    def __del__(self):
        proc = getattr(self, "proc", None)
        if proc is not None and proc.poll() is None:
            proc.stdin.close()
            proc.wait(timeout=30)


def llama_cpp_configs(decoder: LlamaCppDecoder, ar_configs: list[Config]) -> list[Config]:
    """One llama.cpp configuration per greedy AR configuration (same length)."""
    from mlx_redrafter.sweep import Config

    return [Config(c.name.replace("ar", "llama_cpp", 1), c.options, decoder, "llama_cpp") for c in ar_configs
            if c.options.sampling.greedy]


def serve(gguf: str, context: int, threads: int, eos_ids: set[int]) -> None:
    """The worker: for each JSON line {prompt, max_tokens} on stdin, one line {tokens, prefill_s, decode_s, stop}."""
    from llama_cpp import Llama

    llm = Llama(model_path=gguf, n_ctx=context, n_threads=threads, n_threads_batch=threads, n_batch=512,
                verbose=False, seed=0)
    for line in sys.stdin:
        ask = json.loads(line)
        tokens, t_first, stop = [], None, "max_tokens"
        t0 = time.perf_counter()
        for tok in llm.generate(ask["prompt"], top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0,
                                reset=True):
            if t_first is None:
                t_first = time.perf_counter()
            if tok in eos_ids:
                stop = "eos"
                break
            tokens.append(int(tok))
            if len(tokens) >= ask["max_tokens"]:
                break
        t1 = time.perf_counter()
        print(json.dumps({"tokens": tokens, "prefill_s": (t_first or t0) - t0, "decode_s": t1 - (t_first or t0),
                          "stop": stop}), flush=True)


if __name__ == "__main__":
    try:
        serve(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), {int(i) for i in sys.argv[4].split(",") if i})
    except Exception as e:  # one line for the benchmark's own error to follow
        print(f"error: llama.cpp: {e}", file=sys.stderr)
        sys.exit(2)
