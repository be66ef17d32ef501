"""Forward-pass throughput: m2serve vs transformers on the same checkpoint, dtype and threads.

Prefill (one request of --prefill tokens) and single-token decode tokens/s for ``tiny-random``
and the bench config (vocab 32,000, hidden 3072, 48 heads, 8 KV heads, head_dim 128, rotary_dim
64, intermediate 1536, 2 layers, 32 experts top-8, bf16 weights; built on the fly in a temp
dir). Each peer runs in its own subprocess, one after the other (the 24 GB box cannot hold two
copies at once), for --rounds rounds in alternating order; inside a worker each phase is timed
--repeats times. The best figure of each peer is kept (the machine is shared, so slow outliers
are interference) and the ratio m2serve / transformers is printed per row.

    python benchmarks/forward.py [--configs tiny,bench] [--threads 2] [--dtype bfloat16] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH_DIMS = dict(hidden_size=3072, num_attention_heads=48, num_key_value_heads=8, head_dim=128,
                  rotary_dim=64, intermediate_size=1536, num_local_experts=32, num_experts_per_tok=8,
                  num_hidden_layers=2, vocab_size=32000)
PEERS = ("m2serve", "transformers")


def _prompt(n: int, vocab: int) -> list[int]:
    return [(7919 * i + 13) % vocab for i in range(n)]


def _worker_m2serve(path: str, dtype, prefill: int, decode: int, repeats: int) -> dict:
    from m2serve.model.load import load_model
    from m2serve.model.simple_cache import SimpleKVCache

    model = load_model(path, dtype=dtype, progress=False)
    V = model.config.vocab_size
    cache = SimpleKVCache.create(model.config, num_pages=(prefill + decode) // 16 + 8, page_size=16,
                                 dtype=dtype)
    model(cache.batch([("warm", _prompt(16, V))]), cache.storage)
    cache.free("warm")
    best = {"prefill_tok_s": 0.0, "decode_tok_s": 0.0}
    for r in range(repeats):
        t = time.perf_counter()
        logits = model(cache.batch([(r, _prompt(prefill, V))]), cache.storage)
        t_prefill = time.perf_counter() - t
        tok = int(logits.argmax(-1))
        t = time.perf_counter()
        for _ in range(decode):
            tok = int(model(cache.batch([(r, [tok])]), cache.storage).argmax(-1))
        t_decode = time.perf_counter() - t
        cache.free(r)
        best = _best(best, prefill / t_prefill, decode / t_decode)
    return best


def _worker_transformers(path: str, dtype, prefill: int, decode: int, repeats: int) -> dict:
    import torch
    import transformers

    model = transformers.MiniMaxM2ForCausalLM.from_pretrained(path, dtype=dtype).eval()
    V = model.config.vocab_size
    best = {"prefill_tok_s": 0.0, "decode_tok_s": 0.0}
    with torch.inference_mode():
        model(torch.tensor([_prompt(16, V)]))
        for _ in range(repeats):
            t = time.perf_counter()
            out = model(torch.tensor([_prompt(prefill, V)]), use_cache=True, logits_to_keep=1)
            t_prefill = time.perf_counter() - t
            past, tok = out.past_key_values, int(out.logits[0, -1].argmax())
            t = time.perf_counter()
            for _ in range(decode):
                out = model(torch.tensor([[tok]]), past_key_values=past, use_cache=True)
                past, tok = out.past_key_values, int(out.logits[0, -1].argmax())
            t_decode = time.perf_counter() - t
            best = _best(best, prefill / t_prefill, decode / t_decode)
    return best


def _best(best: dict, prefill_tok_s: float, decode_tok_s: float) -> dict:
    return {"prefill_tok_s": max(best["prefill_tok_s"], prefill_tok_s),
            "decode_tok_s": max(best["decode_tok_s"], decode_tok_s)}


def worker(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    fn = _worker_m2serve if args.worker == "m2serve" else _worker_transformers
    print(json.dumps(fn(args.path, dtype, args.prefill, args.decode, args.repeats)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", default="tiny,bench")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--prefill", type=int, default=512)
    p.add_argument("--decode", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2, help="subprocess rounds per peer, alternating order")
    p.add_argument("--repeats", type=int, default=2, help="timed prefill+decode runs per subprocess")
    p.add_argument("--worker", choices=PEERS)
    p.add_argument("--path")
    args = p.parse_args()
    if args.worker:
        return worker(args)

    from m2serve.checkpoints.tiny_random import build_tiny_random

    rows = []
    with tempfile.TemporaryDirectory(prefix="m2serve-bench-") as tmp:
        for name in args.configs.split(","):
            dims = BENCH_DIMS if name == "bench" else {}
            path = build_tiny_random(Path(tmp) / name, **dims)
            res = {peer: {"prefill_tok_s": 0.0, "decode_tok_s": 0.0} for peer in PEERS}
            for r in range(args.rounds):
                for peer in PEERS if r % 2 == 0 else PEERS[::-1]:
                    cmd = [sys.executable, __file__, "--worker", peer, "--path", str(path), "--threads",
                           str(args.threads), "--dtype", args.dtype, "--prefill", str(args.prefill),
                           "--decode", str(args.decode), "--repeats", str(args.repeats)]
                    out = subprocess.run(cmd, capture_output=True, text=True)
                    if out.returncode:
                        sys.exit(f"{peer} on {name} failed:\n{out.stderr[-3000:]}")
                    got = json.loads(out.stdout.strip().splitlines()[-1])
                    res[peer] = _best(res[peer], got["prefill_tok_s"], got["decode_tok_s"])
            rows.append((name, res))
    print(f"dtype {args.dtype}, {args.threads} threads, prefill {args.prefill} tokens, "
          f"{args.decode} decode steps (batch 1), best of {args.rounds} x {args.repeats}")
    print(f"{'config':8} {'phase':8} {'m2serve tok/s':>14} {'transformers tok/s':>19} {'ratio':>7}")
    for name, res in rows:
        for phase in ("prefill", "decode"):
            a, b = res["m2serve"][f"{phase}_tok_s"], res["transformers"][f"{phase}_tok_s"]
            print(f"{name:8} {phase:8} {a:14.1f} {b:19.1f} {a / b:6.2f}x")


if __name__ == "__main__":
    main()
