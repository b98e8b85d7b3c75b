"""n=4 in one request (one shared prefill) vs 4 concurrent n=1 requests with one prompt, long prompt, greedy.
Each request group starts with its own tag, so that no prompt-cache entry shares more than the system prompt.
OLD=1 sends the first request with n 1 (a server that serves only that)."""

import concurrent.futures
import os
import subprocess
import sys
import time

import httpx
import openai

PORT = 8931


def main() -> None:
    with open("/tmp/nbench-server.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "mlx_redrafter.cmd.main", "serve", "--port", str(PORT),
                                 "--max-active", "4"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{PORT}"
    for _ in range(240):
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", timeout=600)
    with open(os.environ.get("TEXT", "README.md")) as f:
        text = f.read()[:4000]

    def one(tag: str, n: int = 1):
        return client.chat.completions.create(
            model="smollm2-135m", messages=[{"role": "user", "content": f"[{tag}] Summarize this:\n" + text}],
            max_tokens=8, n=n)

    one("warm")
    for rep in range(3):
        t = time.perf_counter()
        r = one(f"a{rep}", 1 if os.environ.get("OLD") else 4)
        tn = time.perf_counter() - t
        t = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            rs = list(pool.map(lambda k: one(f"b{rep}"), range(4)))
        t1 = time.perf_counter() - t
        print(f"prompt {r.usage.prompt_tokens} tokens: n=4 {tn:.2f}s "
              f"(cached {r.usage.prompt_tokens_details.cached_tokens}), 4 x n=1 {t1:.2f}s "
              f"(cached {[x.usage.prompt_tokens_details.cached_tokens for x in rs]})", flush=True)
    for rep in range(2):
        t = time.perf_counter()
        one(f"c{rep}")
        print(f"n=1 alone {time.perf_counter() - t:.2f}s", flush=True)
    proc.terminate()
    proc.wait()


if __name__ == "__main__":
    main()
