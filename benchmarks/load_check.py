"""Cost of the load-time NaN/inf check (issue 16 item 7) on the bench config of formats.py.

Every (encoding, --weight-dequant) pair of formats.py's runs (``--encodings`` to pick; building the
FP4 copies holds the whole BF16 model in fp32, ~9 GB) is loaded ``--repeats`` times with the check
and as many times without it, alternating, in one process. With the check, each tensor is copied
out of the file by formats/finite.py ``copy_finite`` (the copy and the test in one pass: the C++
op, or chunked PyTorch ops with ``M2SERVE_CPU_ISA=none``); without it, that copy is a plain
``clone``. The figure is the extra load time, min over repeats (the least disturbed load) of each
side:

    overhead = min(load with check) / min(load without check) - 1

The seconds spent inside the file reads (copy + test, or the plain copy; timed around each call)
are printed too, a second, less noisy view of the same cost.

    python benchmarks/load_check.py [--threads 2] [--repeats 3] [--encodings bf16 fp8] [--cache DIR]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from formats import BENCH_DIMS, RUNS, build_fp4  # noqa: E402  (benchmarks/ is not a package)


def main() -> None:
    import torch

    from m2serve.formats import safetensors_io
    from m2serve.model.load import load_model

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--encodings", nargs="+", default=["bf16", "fp8", "nvfp4", "mxfp4"])
    p.add_argument("--cache", type=Path, help="keep the built checkpoints here and reuse them")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    root = args.cache or Path(tempfile.mkdtemp(prefix="m2serve-loadcheck-"))
    real = safetensors_io.copy_finite
    spent = [0.0]

    def plain(src, *a, **kw):
        return src.clone(memory_format=torch.contiguous_format)

    def timed(fn):
        def run(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[0] += time.perf_counter() - t
        return run

    try:
        from m2serve.checkpoints.tiny_random import build_tiny_random

        paths = {v: build_tiny_random(root / v, variant=v, **BENCH_DIMS) for v in ("bf16", "fp8")}
        paths.update({e: build_fp4(paths["bf16"], root / e, e) for e in ("nvfp4", "mxfp4")
                      if e in args.encodings})
        print(f"{'encoding':<8} {'mode':<8} {'load s (check)':>14} {'load s (none)':>13} "
              f"{'overhead':>9} {'reads s (check)':>15} {'reads s (none)':>14}")
        worst = 0.0
        pairs = dict.fromkeys(tuple(r.split(":")[:2]) for r in RUNS)  # formats.py's encoding:mode:backend
        for enc, mode in (p for p in pairs if p[0] in args.encodings):
            load = {True: [], False: []}
            reads = {True: [], False: []}
            for _ in range(args.repeats):
                for check in (True, False):
                    safetensors_io.copy_finite = timed(real if check else plain)
                    spent[0] = 0.0
                    t = time.perf_counter()
                    model = load_model(paths[enc], dtype=dtype, progress=False, weight_dequant=mode)
                    load[check].append(time.perf_counter() - t)
                    reads[check].append(spent[0])
                    del model
            safetensors_io.copy_finite = real
            ratio = min(load[True]) / min(load[False]) - 1
            worst = max(worst, ratio)
            print(f"{enc:<8} {mode:<8} {min(load[True]):>14.3f} {min(load[False]):>13.3f} {ratio:>8.1%} "
                  f"{min(reads[True]):>15.3f} {min(reads[False]):>14.3f}", flush=True)
        print(f"largest overhead: {worst:.1%} (limit 5%)")
    finally:
        safetensors_io.copy_finite = real
        if args.cache is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
