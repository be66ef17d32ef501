"""Prepared check of TP_TP decode under CUDA graphs (docs/serving.md §6.3) on 2 GPUs.

    PYTHONPATH=src python3 benchmarks/gpu_tp_decode.py              # on a machine with >= 2 GPUs
    OMP_NUM_THREADS=1 PYTHONPATH=src python3 benchmarks/gpu_tp_decode.py --cpu-smoke   # cpu:2 (gloo)

Builds the tiny-random checkpoint (checkpoints/tiny_random.py, fp32 weights and KV) in a temporary
directory and runs the same 24 greedy requests (max_tokens 4..27: the decode batch shrinks from 24
through the buckets 32, 16, 8, 4, 2, 1) through two TP_TP engines on ``gpu:0,1`` (``cpu:2`` with
--cpu-smoke), the triton attention backend, side by side in one run: ``--enforce-eager`` and the
default (every rank captures one graph per bucket at start-up; on CPU the static path runs eagerly
on both ranks, ``enable_graphs(..., capture=False)``). Prints the banner reason, the buckets, the
start-up time, the decode steps run through the graph path, each engine's generation wall time and
tokens/s with the graphs/eager ratio, and whether the greedy tokens are identical (expected: the
same kernels, split counts aside); with the machine line (CPU, load) and the GPU names. Exit code 1
when the tokens differ. Figures on tiny-random dims show the step's fixed costs (launches, host
work), not the serving-scale speed (benchmarks/gpu_check.py --part engine). Not yet run on a GPU.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from formats import machine_line  # noqa: E402
from m2serve.checkpoints.tiny_random import build_tiny_random  # noqa: E402
from m2serve.config.engine_args import EngineArgs  # noqa: E402
from m2serve.engine.core import LLMEngine  # noqa: E402
from m2serve.engine.sampling import SamplingParams  # noqa: E402

REQUESTS = 24
MAX_BATCH = 32


def run(ckpt: str, devices: str, graphs: bool, smoke: bool) -> dict:
    """One engine: start-up, the requests' greedy tokens, timings."""
    t0 = time.perf_counter()
    args = EngineArgs(model=ckpt, devices=devices, dtype="float32", kv_cache_format="float32",
                      num_kv_pages=REQUESTS * 4 + 8, kv_cache_page_size=16, max_batch_size=MAX_BATCH,
                      max_length=256, attention_backend="triton", enforce_eager=not graphs)
    engine = LLMEngine.from_args(args)
    runner = engine.runner
    if graphs and smoke:   # CPU: the static path on both ranks, run eagerly
        runner.enable_graphs(MAX_BATCH, engine.max_length, capture=False)
    start_s = time.perf_counter() - t0
    for i in range(REQUESTS):
        prompt = [(7 * i + j) % 200 + 3 for j in range(5 + i % 7)]
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=4 + i, ignore_eos=True))
    out: dict[str, list[int]] = {}
    t = time.perf_counter()
    while engine.has_unfinished_requests():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    wall = time.perf_counter() - t
    res = {"start_s": start_s, "wall_s": wall, "tok_s": sum(map(len, out.values())) / wall,
           "graph_steps": runner.graph_steps, "steps": engine.steps, "off": runner.graphs_off,
           "buckets": getattr(runner.graphs, "buckets", None),
           "tokens": [out[str(i)] for i in range(REQUESTS)]}
    runner.model.shutdown()
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="cpu:2 (gloo), the static path run eagerly")
    a = ap.parse_args(argv)
    if not a.cpu_smoke and torch.cuda.device_count() < 2:
        print(f"gpu_tp_decode: needs 2 CUDA GPUs (found {torch.cuda.device_count()}); "
              "--cpu-smoke runs on CPU")
        return 0
    devices = "cpu:2" if a.cpu_smoke else "gpu:0,1"
    gpus = [torch.cuda.get_device_name(i) for i in range(2)] if not a.cpu_smoke else []
    print(machine_line() + (f" | GPUs: {', '.join(gpus)}" if gpus else ""))
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = str(build_tiny_random(Path(tmp) / "tiny-random", variant="bf16"))
        eager = run(ckpt, devices, graphs=False, smoke=a.cpu_smoke)
        graph = run(ckpt, devices, graphs=True, smoke=a.cpu_smoke)
    same = eager["tokens"] == graph["tokens"]
    for name, r in (("eager", eager), ("graphs", graph)):
        print(f"[{name}] start-up {r['start_s']:.1f} s | CUDA graphs off: {r['off']} | "
              f"buckets {r['buckets']} | {r['graph_steps']} of {r['steps']} steps on the graph path | "
              f"{r['wall_s']:.2f} s, {r['tok_s']:.1f} tok/s")
    print(f"graphs / eager tok/s: {graph['tok_s'] / eager['tok_s']:.2f}x | greedy tokens identical: {same}")
    print(machine_line())
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
