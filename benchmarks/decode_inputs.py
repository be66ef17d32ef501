"""Host work of one decode step's inputs: the eager path vs the CUDA-graph path (docs/serving.md §6.3).

Per decode step the engine builds its inputs on the host before the forward (eager) or the graph
replay. Eager: ``ragged_batch`` into the runner's persistent ``StepBuffers`` (the lists, the
``StepHost``, one copy of the step's prefix, the int32 section's cast), as engine/runner.py does.
Graph path: ``StaticDecodeBuffers.load`` (rows and padding rows written into the fixed buffer, one
copy of the bucket's prefix, the block table at its full width W = ceil(max_length / S)). Both
copies go to the CPU here (a memcpy); on CUDA they are queued host-to-device copies, so this
measures the host part only, not a GPU figure. Timed side by side in one process, alternating, best
of --rounds, at batch 1, 32 and 128 (a bucket each, no padding rows) with --context tokens per
request over pages of 128, for max_length 32,768 and 196,608 (MiniMax-M2's context).

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/decode_inputs.py [--context 4096] [--rounds 5]
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from formats import machine_line  # noqa: E402
from m2serve.model.batch import StepBuffers, ragged_batch  # noqa: E402
from m2serve.model.cuda_graphs import StaticDecodeBuffers  # noqa: E402

PAGE = 128
STEPS = 200  # steps per timing


def best_ms(fn, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(STEPS):
            fn()
        best = min(best, (time.perf_counter() - t) / STEPS)
    return best * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=4096, help="tokens per request")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    print(machine_line())
    L = args.context
    pages = -(-L // PAGE)
    print(f"context {L} tokens, pages of {PAGE}, {STEPS} steps per round, best of {args.rounds}")
    print(f"{'max_length':>10} {'batch':>5} {'eager ms':>9} {'graph ms':>9} {'graph/eager':>11}")
    for max_length in (32768, 196608):
        for b in (1, 32, 128):
            tables = [list(range(i * pages, (i + 1) * pages)) for i in range(b)]
            static = StaticDecodeBuffers([b], -(-max_length // PAGE), PAGE, b * pages, "cpu")
            eager = partial(ragged_batch, [[7]] * b, [L] * b, tables, [1] * b, PAGE,
                            buffers=StepBuffers(torch.device("cpu")))
            graph = partial(static.load, b, [7] * b, [L] * b, tables)
            e = g = float("inf")
            for _ in range(2):  # alternate, so load drifts hit both
                e = min(e, best_ms(eager, args.rounds))
                g = min(g, best_ms(graph, args.rounds))
            print(f"{max_length:>10} {b:>5} {e:>9.3f} {g:>9.3f} {g / e:>11.2f}")
    print(machine_line())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
