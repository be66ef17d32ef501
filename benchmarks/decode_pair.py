"""Batch-1 decode of the same weights in two encodings, steps interleaved in one process.

formats.py runs one subprocess per row, one after the other: on a shared machine the load drifts
between rows and their tok/s are not comparable. Here the bench-config checkpoints of two
encodings (default: ``fp8`` and ``bf16``, built by formats.py's ``build_all``; ``--cache`` reuses
its directory) are loaded with default flags (``--weight-dequant auto``: FP8 stays packed where the
CPU kernels run, bf16 uses the bf16 kernel) and decode greedily one token each, alternately,
``--steps`` times, so both see the same load. Printed per encoding: median wall ms per token and
tok/s, median process CPU ms per token (all threads: what the step computed, less sensitive to
other processes),
MB read per token; then the ratio of the first encoding's tok/s to the second's, from the medians
and as the median of the per-pair ratios. An encoding written ``ENC+fp8`` (e.g. ``mxfp4+fp8``) loads
ENC with ``quantize_unquantized="fp8"`` (its bf16 attention and lm_head quantised to FP8 blocks at
load, docs/checkpoints.md §6). The first line names the CPU model, its ISA flags and the load
average (formats.py ``machine_line``), printed again after the run.

    python benchmarks/decode_pair.py [--encodings fp8 bf16] [--threads 1] [--steps 32] [--cache DIR]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from formats import PROMPT, build_all, bytes_per_decode_token, machine_line
from m2serve.kernels.build import kernel_backend
from m2serve.model.load import load_model
from m2serve.model.simple_cache import SimpleKVCache


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--encodings", nargs=2, default=["fp8", "bf16"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--cache", type=Path, help="formats.py's checkpoint directory (built if missing)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    root = args.cache or Path(tempfile.mkdtemp(prefix="m2serve-pair-"))
    try:
        paths = build_all(root)
        print(machine_line())
        print(kernel_backend().banner())
        runs = {}
        for enc in args.encodings:
            base, _, extra = enc.partition("+")
            model = load_model(paths[base], dtype=torch.bfloat16, progress=False,  # default flags
                               quantize_unquantized=extra or "none")
            pages = (PROMPT + args.steps) // 16 + 8
            cache = SimpleKVCache.create(model.config, num_pages=pages, page_size=16, dtype=torch.bfloat16)
            runs[enc] = (model, cache)
        V = runs[args.encodings[0]][0].config.vocab_size
        prompt = [(7919 * i + 13) % V for i in range(PROMPT)]
        wall = {e: [] for e in args.encodings}
        cpu = {e: [] for e in args.encodings}
        with torch.inference_mode():
            toks = {e: m(c.batch([(0, prompt)]), c.storage).argmax(-1).tolist() for e, (m, c) in runs.items()}
            for step in range(args.steps + 1):  # step 0: warm-up
                for enc, (model, cache) in runs.items():
                    t, ct = time.perf_counter(), time.process_time()
                    toks[enc] = model(cache.batch([(0, toks[enc])]), cache.storage).argmax(-1).tolist()
                    if step:
                        wall[enc].append(time.perf_counter() - t)
                        cpu[enc].append(time.process_time() - ct)
        print(f"{args.threads} thread(s), {args.steps} interleaved decode steps")
        print(f"{'encoding':9}{'MB/token':>9}{'wall ms':>9}{'tok/s':>7}{'CPU ms':>8}{'tok/CPU-s':>10}")
        for enc, (model, _) in runs.items():
            w, c = statistics.median(wall[enc]), statistics.median(cpu[enc])
            print(f"{enc:9}{bytes_per_decode_token(model) / 1e6:9.1f}{w * 1e3:9.1f}{1 / w:7.2f}{c * 1e3:8.1f}"
                  f"{1 / c:10.2f}")
        a, b = args.encodings
        pair = statistics.median(y / x for x, y in zip(wall[a], wall[b]))
        medians = statistics.median(wall[b]) / statistics.median(wall[a])
        cpu_ratio = statistics.median(cpu[b]) / statistics.median(cpu[a])
        print(f"{a} / {b} decode speed: {medians:.2f}x (medians), {pair:.2f}x (median of pairs), "
              f"{cpu_ratio:.2f}x (CPU time)")
        print(machine_line())
    finally:
        if not args.cache:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
