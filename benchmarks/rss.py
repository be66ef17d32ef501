"""Resident memory of the default server under a long run (issue 16 item 10).

Starts ``m2serve serve`` (the embedded default model and every default flag, so the CPU KV pool is
sized by its default rule), then:

1. warm-up: ``--warmup`` short chat requests (``max_tokens`` 8); RSS is read (VmRSS of the server
   process, /proc) -> the baseline;
2. ``--short`` more short chat requests, ``--concurrency`` at a time, then ``--long`` unique
   ``--long-tokens``-token prompts (random token ids through /v1/completions, ``max_tokens`` 1), each
   new to the prefix cache; RSS is read again.

Prints both figures and the growth (the issue's target: <= 10%); RSS is also sampled every
``--every`` requests, so a still-rising curve shows. Nothing is asserted (not a test).

    python benchmarks/rss.py [--warmup 500] [--short 8000] [--long 400] [--long-tokens 1089]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import time

import httpx


def rss_mib(pid: int) -> float:
    """VmRSS of ``pid`` in MiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def start(port: int, extra: list[str]) -> subprocess.Popen:
    """Start the server and wait for /health; prints the seconds it took (the KV pool is zero-filled
    during start-up, engine/runner.py)."""
    cmd = [sys.executable, "-m", "m2serve.serve.cli", "serve", "--port", str(port), "--log-level", "warning",
           *extra]
    t = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = t + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                print(f"server healthy after {time.monotonic() - t:.1f} s", flush=True)
                return proc
        except httpx.HTTPError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError("the server did not become healthy in 300 s")


async def run(client: httpx.AsyncClient, bodies: list[tuple[str, dict]], concurrency: int, pid: int,
              every: int, label: str) -> None:
    sem = asyncio.Semaphore(concurrency)
    done = [0]

    async def one(route: str, body: dict) -> None:
        async with sem:
            r = await client.post(route, json=body)
            r.raise_for_status()
            done[0] += 1
            if done[0] % every == 0:
                print(f"  {label} {done[0]:>5}/{len(bodies)}  RSS {rss_mib(pid):8.1f} MiB", flush=True)

    await asyncio.gather(*(one(route, body) for route, body in bodies))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--warmup", type=int, default=500)
    p.add_argument("--short", type=int, default=8000)
    p.add_argument("--long", type=int, default=400)
    p.add_argument("--long-tokens", type=int, default=1089)
    p.add_argument("--vocab", type=int, default=1536, help="token ids of the long prompts are below this "
                   "(the embedded default model's vocabulary)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--every", type=int, default=1000)
    p.add_argument("--server-args", default="", help="extra `m2serve serve` flags, one string")
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = start(port, args.server_args.split())
    rng = random.Random(0)

    def short(i: int) -> tuple[str, dict]:
        msg = [{"role": "user", "content": f"Say something short, number {i}."}]
        return "/v1/chat/completions", {"messages": msg, "max_tokens": 8}

    try:
        async def go() -> tuple[float, float, float]:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
                start_rss = rss_mib(proc.pid)
                t = time.perf_counter()
                await run(client, [short(i) for i in range(args.warmup)], args.concurrency, proc.pid,
                          args.every, "warm-up")
                base = rss_mib(proc.pid)
                print(f"after {args.warmup} warm-up requests: RSS {base:.1f} MiB "
                      f"(at start {start_rss:.1f}; {time.perf_counter() - t:.0f} s)", flush=True)
                await run(client, [short(args.warmup + i) for i in range(args.short)], args.concurrency,
                          proc.pid, args.every, "short")
                mid = rss_mib(proc.pid)
                print(f"after {args.short} short requests: RSS {mid:.1f} MiB", flush=True)
                longs = [("/v1/completions", {"prompt": [rng.randrange(args.vocab)
                                                         for _ in range(args.long_tokens)], "max_tokens": 1})
                         for _ in range(args.long)]
                await run(client, longs, args.concurrency, proc.pid, max(args.every // 10, 1), "long")
                return base, mid, rss_mib(proc.pid)

        base, mid, end = asyncio.run(go())
        print(f"RSS after warm-up {base:.1f} MiB; after the short requests {mid:.1f} MiB; after "
              f"{args.long} unique {args.long_tokens}-token prompts {end:.1f} MiB: growth "
              f"{end / base - 1:+.1%} (target <= +10%)")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
