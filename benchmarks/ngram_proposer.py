"""The n-gram proposer's cost per decode step: the scan (engine/speculative.py ``propose_ngram``, the
oracle) against the engine's incremental index (``NgramIndex``), side by side in one process
(docs/serving.md §13, "Proposer").

For each sequence length L: L random token ids (vocabulary 200,064, MiniMax-M2's; nothing matches, the
scan's worst case) or, with ``--repeat``, a 500-token block repeated (every lookup matches). The index is
built once (its first call, timed on its own: the prompt's indexing), then ``--steps`` tokens are
appended one at a time and both proposers draft after each; both drafts are checked equal. Printed: the
median microseconds per step of each, their ratio, and the index's first call. The first and last
lines give the CPU model, ISA and load average (formats.py ``machine_line``).

    python benchmarks/ngram_proposer.py [--lengths 4096,32768,131072,196608] [--steps 50]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

from formats import machine_line

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from m2serve.engine.speculative import NgramIndex, propose_ngram  # noqa: E402

VOCAB = 200_064


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="4096,32768,131072,196608")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--lookup-min", type=int, default=2)
    ap.add_argument("--lookup-max", type=int, default=4)
    ap.add_argument("--repeat", action="store_true", help="a repeated 500-token block (every lookup matches)")
    args = ap.parse_args()
    rng = random.Random(0)
    print(machine_line())
    print(f"k {args.k} | lookup {args.lookup_min}..{args.lookup_max} | "
          f"{'repeated block' if args.repeat else 'random tokens (no match)'} | {args.steps} steps, medians")
    print(f"{'length':>8} {'scan us/step':>13} {'index us/step':>14} {'ratio':>8} "
          f"{'index first call ms':>20}")
    for L in (int(x) for x in args.lengths.split(",")):
        if args.repeat:
            block = [rng.randrange(VOCAB) for _ in range(500)]
            seq = (block * (L // 500 + 1))[:L]
        else:
            seq = [rng.randrange(VOCAB) for _ in range(L)]
        idx = NgramIndex(args.lookup_min, args.lookup_max)
        t = time.perf_counter()
        idx.propose(seq, args.k)
        first = time.perf_counter() - t
        scan, index = [], []
        for _ in range(args.steps):
            seq.append(seq[-500] if args.repeat else rng.randrange(VOCAB))
            t = time.perf_counter()
            a = propose_ngram(seq, args.k, args.lookup_min, args.lookup_max)
            scan.append(time.perf_counter() - t)
            t = time.perf_counter()
            b = idx.propose(seq, args.k)
            index.append(time.perf_counter() - t)
            if a != b:
                raise SystemExit(f"length {len(seq)}: the index drafted {b}, the scan {a}")
        s, i = statistics.median(scan) * 1e6, statistics.median(index) * 1e6
        print(f"{L:>8} {s:>13.1f} {i:>14.1f} {s / i:>7.0f}x {first * 1e3:>20.1f}", flush=True)
    print("same drafts from both at every step")
    print(machine_line())


if __name__ == "__main__":
    main()
