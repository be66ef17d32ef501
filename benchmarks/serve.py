"""Serving benchmark: N concurrent streaming clients against the OpenAI-compatible server.

Measures, per request, the time to first token (TTFT: request sent -> first SSE chunk with text) and
the inter-token latencies (ITL: gaps between chunks with text; one chunk per engine step), then prints
p50/p99 of both and the output tokens/s over the whole run. As a same-run peer it also times the
offline ``LLM.generate`` on the same prompts and token counts in its own subprocess, and prints the
HTTP server's throughput as a ratio of it (the cost of HTTP + SSE + the engine thread).

    python benchmarks/serve.py                       # starts `m2serve serve` (embedded default) itself
    python benchmarks/serve.py --concurrency 64 --max-tokens 128
    python benchmarks/serve.py --url http://127.0.0.1:8000 --model NAME   # an already running server

Only the standard library, httpx and m2serve; not a test (nothing is asserted).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time

import httpx

PROMPT = "Write a short story about a robot who learns to paint. Story number {i}:"


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of a non-empty list."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))]


async def one_request(
    client: httpx.AsyncClient, url: str, model: str | None, i: int, max_tokens: int, headers: dict[str, str]
) -> tuple[float, list[float], int]:
    """Stream one completion; returns (TTFT s, ITL gaps s, completion tokens)."""
    body = {
        "prompt": PROMPT.format(i=i),
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0,
        "stream_options": {"include_usage": True},
    }
    if model:
        body["model"] = model
    t0 = time.perf_counter()
    stamps: list[float] = []
    tokens = 0
    async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk["choices"] and chunk["choices"][0].get("text"):
                stamps.append(time.perf_counter())
    ttft = stamps[0] - t0 if stamps else float("nan")
    return ttft, [b - a for a, b in zip(stamps, stamps[1:])], tokens


async def run_clients(
    url: str, model: str | None, n: int, concurrency: int, max_tokens: int, api_key: str | None
) -> tuple[list[tuple[float, list[float], int]], float]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def guarded(i: int):
            async with sem:
                return await one_request(client, url, model, i, max_tokens, headers)

        await guarded(-1)  # warm-up (first-request costs, prefix cache of the common prompt head)
        t0 = time.perf_counter()
        results = await asyncio.gather(*(guarded(i) for i in range(n)))
        return results, time.perf_counter() - t0


def offline_peer(n: int, max_tokens: int, engine_flags: list[str]) -> float:
    """Output tokens/s of LLM.generate on the same prompts, in its own subprocess."""
    code = f"""
import sys, time
from m2serve.serve.cli import build_parser, resolve_options, _make_llm
from m2serve.engine.sampling import SamplingParams
p = build_parser(); opts = resolve_options(p.parse_args(["generate", *sys.argv[1:]]), p)
llm = _make_llm(opts)
prompts = [{PROMPT!r}.format(i=i) for i in range({n})]
sp = SamplingParams(temperature=0, max_tokens={max_tokens}, ignore_eos=True)
llm.generate(prompts[:1], sp)
t = time.perf_counter(); rs = llm.generate(prompts, sp); dt = time.perf_counter() - t
print(sum(len(o.token_ids) for r in rs for o in r.outputs) / dt)
"""
    out = subprocess.run(
        [sys.executable, "-c", code, *engine_flags], capture_output=True, text=True, check=True
    )
    return float(out.stdout.strip().splitlines()[-1])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(engine_flags: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "m2serve.serve.cli",
            "serve",
            *engine_flags,
            "--port",
            str(port),
            "--log-level",
            "warning",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(1200):
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    proc.kill()
    raise RuntimeError("server did not start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="an already running server (default: start one)")
    ap.add_argument("--model", help="served model name (with --url) or --model for the started server")
    ap.add_argument("--api-key", default=os.environ.get("M2SERVE_API_KEY"))
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--no-offline-peer", action="store_true")
    ap.add_argument("engine_flags", nargs="*", help="extra flags for the started server (after --)")
    a = ap.parse_args()
    flags = ["--dtype", "float32", "--max-batch-size", str(max(a.concurrency, 1)), *a.engine_flags]
    if a.model and not a.url:
        flags = ["--model", a.model, *flags]
    proc = None
    url = a.url
    if url is None:
        proc, url = start_server(flags)
    try:
        results, wall = asyncio.run(
            run_clients(
                url, a.model if a.url else None, a.num_requests, a.concurrency, a.max_tokens, a.api_key
            )
        )
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    ttft = [r[0] for r in results]
    itl = [g for r in results for g in r[1]]
    tokens = sum(r[2] for r in results)
    tps = tokens / wall
    print(
        f"serve benchmark: {a.num_requests} streaming requests, concurrency {a.concurrency}, "
        f"{a.max_tokens} output tokens each, {url}"
    )
    print(f"  TTFT  p50 {percentile(ttft, 50) * 1e3:8.1f} ms   p99 {percentile(ttft, 99) * 1e3:8.1f} ms")
    if itl:
        print(
            f"  ITL   p50 {percentile(itl, 50) * 1e3:8.1f} ms   p99 {percentile(itl, 99) * 1e3:8.1f} ms "
            f"  (mean {statistics.fmean(itl) * 1e3:.1f} ms)"
        )
    print(f"  output {tokens} tokens in {wall:.2f} s = {tps:.1f} tok/s")
    if a.url is None and not a.no_offline_peer:
        peer = offline_peer(a.num_requests, a.max_tokens, flags)
        print(
            f"  offline LLM.generate (same prompts, same engine flags, own process): {peer:.1f} tok/s "
            f"-> server / offline = {tps / peer:.2f}x"
        )


if __name__ == "__main__":
    main()
