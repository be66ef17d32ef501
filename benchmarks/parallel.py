"""Parallel modes on CPU ranks: prefill and decode tokens/s for 1, 2 and 4 processes per mode.

Each configuration runs as its own group of spawned gloo ranks (one torch thread per rank), one
after the other; rank 0 drives the DistributedModel (the engine's model contract) with a
SimpleKVCache, so the figures are model + collectives without the scheduler. The 1-process row is
measured in the same run with one thread (one rank's share of the machine) and every row prints
its ratio to it. The bench config (vocab 32,000, hidden 3072, 48 heads, 8 KV heads, head_dim 128,
rotary_dim 64, intermediate 1536, 2 layers, 32 experts top-8, bf16; ~2.4 GB) is built on the fly in
a temp dir; 4 ranks hold about a quarter of the sharded tensors each, so it fits 24 GB.

On a 2-core CPU box these figures show the overhead of the collectives and of P processes
sharing 2 cores, not speedups. The last two columns are the bytes of the step message rank 0
sent the other ranks (parallel/message.py, pickled) for the last prefill and the last decode step.
DP_EP puts sequence b on replica b % P, each replica with its own pages.

Issue 27's DP_EP row (2 replicas vs 1 process at concurrency 32, same run):

    python benchmarks/parallel.py --worlds 2 --modes DP_EP --batch 32 --prefill 512

    python benchmarks/parallel.py [--config bench|tiny] [--worlds 2,4] [--modes TP_TP,TP_EP,...]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

BENCH_DIMS = dict(hidden_size=3072, num_attention_heads=48, num_key_value_heads=8, head_dim=128,
                  rotary_dim=64, intermediate_size=1536, num_local_experts=32, num_experts_per_tok=8,
                  num_hidden_layers=2, vocab_size=32000)
# name -> (data_parallel_degree, ep_size, ep_use_allreduce); "P" = world size
MODES = {"TP_TP": (1, 1, False), "TP_EP": (1, "P", False), "TP_EP_AR": (1, "P", True),
         "DP_EP": ("P", "P", False)}


def _prompt(n: int, vocab: int, seed: int) -> list[int]:
    return [(7919 * i + 131 * seed + 13) % vocab for i in range(n)]


def _bench(rank: int, world: int, path: str, mode: str, dtype_name: str, prefill: int, batch: int,
           decode: int, repeats: int) -> dict | None:
    import torch

    from m2serve.config.model_config import MiniMaxM2Config
    from m2serve.config.parallel import validate_deployment
    from m2serve.model.simple_cache import SimpleKVCache
    from m2serve.parallel.worker import DistributedModel, load_rank_model, worker_loop

    dtype = getattr(torch, dtype_name)
    cfg = MiniMaxM2Config.from_pretrained(path)
    dp, ep, ar = MODES.get(mode, (1, 1, False))
    dp, ep = (world if v == "P" else v for v in (dp, ep))
    state = validate_deployment(cfg, world, dp, ep, ep_use_allreduce=ar).state(rank)
    model = load_rank_model(path, state, dtype)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if rank != 0:
        worker_loop(model, state)
        return None
    dm = DistributedModel(model, state) if world > 1 else model
    V, S = cfg.vocab_size, 16
    pages = batch * (-(-(prefill // batch + decode + 1) // S)) + prefill // S + 8
    cache = SimpleKVCache.create(cfg, pages, S, dtype=dtype,
                                 num_kv_heads=model.dims.num_kv_heads)
    best = {"prefill": 0.0, "decode": 0.0}
    msg = {"prefill": 0, "decode": 0}   # bytes of the last step message (parallel/message.py)
    dp = getattr(dm, "data_parallel_degree", 1)
    sizes = [len(range(r, batch, dp)) for r in range(dp)] if dp > 1 else None
    try:
        dm(cache.batch([("warm", _prompt(16, V, 0))], replica_sizes=[1] + [0] * (dp - 1) if dp > 1 else None),
           cache.storage)
        cache.free("warm")
        for r in range(repeats):
            # DP_EP: sequence b on replica b % dp, the batch ordered replica by replica
            seqs = sorted(((f"{r}-{b}", _prompt(prefill // batch, V, b)) for b in range(batch)),
                          key=lambda s: int(s[0].split("-")[1]) % dp)
            t = time.perf_counter()
            logits = dm(cache.batch(seqs, replica_sizes=sizes), cache.storage)   # [batch, V]
            best["prefill"] = max(best["prefill"], prefill / (time.perf_counter() - t))
            msg["prefill"] = getattr(dm, "message_bytes", 0)
            toks = logits.argmax(-1).tolist()
            t = time.perf_counter()
            for _ in range(decode):
                logits = dm(cache.batch([(s, [tok]) for (s, _), tok in zip(seqs, toks)], replica_sizes=sizes),
                            cache.storage)
                toks = logits.argmax(-1).tolist()
            best["decode"] = max(best["decode"], batch * decode / (time.perf_counter() - t))
            msg["decode"] = getattr(dm, "message_bytes", 0)
            for s, _ in seqs:
                cache.free(s)
    finally:
        if world > 1:
            dm.stop()
    return {**best, "weight_bytes": weight_bytes, "msg_prefill": msg["prefill"], "msg_decode": msg["decode"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", choices=("bench", "tiny"), default="bench")
    ap.add_argument("--checkpoint", help="use this directory instead of building one")
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--prefill", type=int, default=512, help="prefill tokens per step (split over --batch)")
    ap.add_argument("--batch", type=int, default=4, help="sequences per step")
    ap.add_argument("--decode", type=int, default=16, help="decode steps")
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()

    import torch

    from m2serve.checkpoints.tiny_random import build_tiny_random
    from m2serve.parallel.launch import run_ranks

    with tempfile.TemporaryDirectory(prefix="m2serve-bench-") as tmp:
        if a.checkpoint:
            path = a.checkpoint
        else:
            dims = BENCH_DIMS if a.config == "bench" else {}
            print(f"building the {a.config} checkpoint in {tmp} ...", flush=True)
            path = str(build_tiny_random(Path(tmp) / a.config, variant="bf16", **dims))
        args = (path, a.dtype, a.prefill, a.batch, a.decode, a.repeats)
        torch.set_num_threads(1)
        rows = [("1 process", 1, _bench(0, 1, path, "single", *args[1:]))]
        for world in (int(w) for w in a.worlds.split(",")):
            for mode in a.modes.split(","):
                res = run_ranks(_bench, world, path, mode, *args[1:], timeout_s=120, wall_s=1800)[0]
                rows.append((mode, world, res))
                print(f"  done {mode} x{world}", flush=True)
    base = rows[0][2]
    print(f"\n{a.config}: prefill {a.prefill} tokens in {a.batch} sequences, decode {a.batch} sequences x "
          f"{a.decode} steps, {a.dtype}, 1 torch thread per rank, gloo")
    print(f"{'mode':10} {'P':>2} {'weights/rank':>13} {'prefill tok/s':>14} {'ratio':>6} "
          f"{'decode tok/s':>13} {'ratio':>6} {'msg B prefill':>14} {'msg B decode':>13}")
    for mode, world, r in rows:
        pre, dec = r["prefill"] / base["prefill"], r["decode"] / base["decode"]
        print(f"{mode:10} {world:>2} {r['weight_bytes'] / 2**30:>9.2f} GiB {r['prefill']:>14.1f} "
              f"{pre:>6.2f} {r['decode']:>13.1f} {dec:>6.2f} {r['msg_prefill']:>14,} {r['msg_decode']:>13,}")


if __name__ == "__main__":
    main()
