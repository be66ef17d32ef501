"""Cost of the load-time NaN/inf check (issue 16 item 7) on the bench config of formats.py.

Every (encoding, --weight-dequant) pair of formats.py's runs (``--encodings`` to pick; building the
FP4 copies holds the whole BF16 model in fp32, ~9 GB) is loaded ``--repeats`` times with the check
and as many times without it, in one process, in pairs whose order alternates (check first, then
none first: a drift of the box favours neither side; hence an even ``--repeats``), after one untimed
warm-up load. With the check, each tensor is copied out of the file by formats/finite.py
``copy_finite`` (the copy and the test in one pass: the C++ op, or chunked PyTorch ops with
``M2SERVE_CPU_ISA=none``); without it, that copy is a plain ``clone``.
Each load is timed twice: wall-clock seconds and the process's CPU seconds (user + system,
``time.process_time``; with ``--threads 1`` the load runs on one core, so on an idle machine the two
agree, while on a shared one the CPU time leaves out the time the process waited for a core). The
figures, per clock:

    min     = min(load with check) / min(load without check) - 1   (the least disturbed loads)
    median  = median over pairs of (load with check / load without check) - 1

The seconds spent inside the file reads (copy + test, or the plain copy; wall-clock, timed around
each call; medians) are printed too, and from them the check's own cost,

    reads   = (median reads with check - median reads without) / median load without check

the only part of the load the two sides run differently. The rest of a load (allocating and
page-faulting the model, dequantising, stacking) is the same code with the same page faults on both
sides (the ``faults`` column: minor page faults per load, median with / without the check), yet on a
shared VM the same load's time moves by up to a third from one load to the next (``--each`` prints
every load): min/min compares the two luckiest loads and moves by many points between runs, so the
figures of record are the median of pairs and ``reads``.

    python benchmarks/load_check.py [--threads 1] [--repeats 10] [--encodings ...] [--cache DIR] [--each]
"""

from __future__ import annotations

import argparse
import resource
import shutil
import statistics
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
    p.add_argument("--threads", type=int, default=1, help="intra-op threads (1: CPU time = one core's)")
    p.add_argument("--repeats", type=int, default=10,
                   help="pairs of loads per (encoding, mode); even, so that each side goes first as often")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--encodings", nargs="+", default=["bf16", "fp8", "nvfp4", "mxfp4"])
    p.add_argument("--cache", type=Path, help="keep the built checkpoints here and reuse them")
    p.add_argument("--each", action="store_true", help="print every load (check, wall s, reads s, faults)")
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
        print(f"{'encoding':<8} {'mode':<8} {'clock':<5} {'load s (check)':>14} {'load s (none)':>13} "
              f"{'min':>6} {'median':>6} {'reads s (check)':>15} {'reads s (none)':>14} {'reads':>6} "
              f"{'faults (check / none)':>21}")
        worst = {"min": 0.0, "median": 0.0, "reads": 0.0}
        pairs = dict.fromkeys(tuple(r.split(":")[:2]) for r in RUNS)  # formats.py's encoding:mode:backend
        for enc, mode in (p for p in pairs if p[0] in args.encodings):
            load = {(c, k): [] for c in (True, False) for k in ("wall", "cpu")}
            reads = {True: [], False: []}
            faults = {True: [], False: []}
            load_model(paths[enc], dtype=dtype, progress=False, weight_dequant=mode)  # warm-up, untimed
            for rep in range(args.repeats):
                for check in ((True, False) if rep % 2 == 0 else (False, True)):
                    safetensors_io.copy_finite = timed(real if check else plain)
                    spent[0] = 0.0
                    f = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                    t, c = time.perf_counter(), time.process_time()
                    model = load_model(paths[enc], dtype=dtype, progress=False, weight_dequant=mode)
                    load[check, "wall"].append(time.perf_counter() - t)
                    load[check, "cpu"].append(time.process_time() - c)
                    faults[check].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f)
                    reads[check].append(spent[0])
                    del model
                    if args.each:
                        side = "check" if check else "none "
                        print(f"  {enc} {mode} {side} {load[check, 'wall'][-1]:.3f} s, "
                              f"reads {spent[0]:.3f} s, {faults[check][-1]} faults", flush=True)
            safetensors_io.copy_finite = real
            med = statistics.median
            by_reads = (med(reads[True]) - med(reads[False])) / med(load[False, "wall"])
            worst["reads"] = max(worst["reads"], by_reads)
            for clock in ("wall", "cpu"):
                yes, no = load[True, clock], load[False, clock]
                by_min = min(yes) / min(no) - 1
                by_pair = med(a / b for a, b in zip(yes, no)) - 1
                worst["min"], worst["median"] = max(worst["min"], by_min), max(worst["median"], by_pair)
                print(f"{enc:<8} {mode:<8} {clock:<5} {min(yes):>14.3f} {min(no):>13.3f} {by_min:>6.1%} "
                      f"{by_pair:>6.1%} {med(reads[True]):>15.3f} {med(reads[False]):>14.3f} "
                      f"{by_reads:>6.1%} {int(med(faults[True])):>10} / {int(med(faults[False])):<8}",
                      flush=True)
        print(f"largest extra load time (wall or CPU): median of pairs {worst['median']:.1%}, reads "
              f"{worst['reads']:.1%} (limit 5%); min/min {worst['min']:.1%}")
    finally:
        safetensors_io.copy_finite = real
        if args.cache is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
