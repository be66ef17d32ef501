"""Greedy evaluation of the `tiny-chat` checkpoint on its held-out split (issue 6 "must show").

    python benchmarks/tiny_chat_eval.py                         # m2serve engine + parser (fp32), 100 per kind
    python benchmarks/tiny_chat_eval.py --backend transformers  # transformers fp32 + m2serve's parser
    python benchmarks/tiny_chat_eval.py --model DIR --per-kind 20
    python benchmarks/tiny_chat_eval.py --kinds natural_result  # one kind

The held-out split (tools/tiny_chat/data.py) uses argument and result values that never occur in
training. Prints the rates of tools/tiny_chat/evaluate.py against the issue's targets: tool calls
>= 95%, tool-result answers >= 90%, natural-shape tool results (objects, nested values, lists, plain
strings) >= 90%, no call when no tool fits >= 90%, reasoning always closed.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.tiny_chat import evaluate as ev  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=ev.DEFAULT_MODEL)
    ap.add_argument("--backend", choices=("m2serve", "transformers"), default="m2serve")
    ap.add_argument("--per-kind", type=int, default=100)
    ap.add_argument("--kinds", default=",".join(ev.data.KINDS),
                    help="comma-separated example kinds to evaluate (default: all)")
    ap.add_argument("--show-failures", type=int, default=3, help="print this many failures per kind")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--dtype", default="float32",
                    help="m2serve compute and KV-cache dtype (float32 or bfloat16)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    examples = ev.held_out(args.per_kind, tuple(args.kinds.split(",")))
    t0 = time.time()
    if args.backend == "m2serve":
        gens = ev.generate_m2serve(args.model, examples, dtype=args.dtype, kv_cache_format=args.dtype,
                                   threads=args.threads)  # else LLM's rule replaces --threads
    else:
        gens = ev.generate_transformers(args.model, examples)
    dt = time.time() - t0
    targets = {"tool_call": 0.95, "tool_result": 0.90, "no_tool": 0.90, "reasoning_closed": 1.0,
               "natural_result": 0.90, "plain": None, "repeat": None, "tool_names": None}
    labels = {"tool_call": "tool-fitting requests: right calls, exact typed arguments",
              "tool_result": "tool-result turns: answer contains the tool's value",
              "natural_result": "natural results (objects, nested, lists, text): all values",
              "no_tool": "no-tool requests (tools offered): no call",
              "reasoning_closed": "reasoning closed before content or a call",
              "plain": "plain turns: no call (+ exact copy for repeat-after-me)",
              "repeat": "repeat made-up words: exact copy",
              "tool_names": "tool-fitting requests: right tool names (values ignored)"}
    backend = f"m2serve ({args.dtype})" if args.backend == "m2serve" else "transformers (float32)"
    print(f"tiny-chat held-out eval, backend {backend}, model {args.model}, greedy, "
          f"{len(examples)} prompts in {dt:.0f} s, threads {torch.get_num_threads()}")
    for k, (a, b) in ev.rates(examples, gens).items():
        tgt = targets[k]
        print(f"  {labels[k]:<58} {a:>4}/{b:<4} {100 * a / max(b, 1):6.1f}%"
              + (f"   (target >= {100 * tgt:.0f}%)" if tgt else ""))
    shown: dict[str, int] = {}
    for ex, g in zip(examples, gens):
        if not ev.score(ex, g) and shown.get(ex.kind, 0) < args.show_failures:
            shown[ex.kind] = shown.get(ex.kind, 0) + 1
            print(f"--- failure ({ex.kind}): user {ex.messages[0]['content']!r}\n    expected calls "
                  f"{ex.calls} values {ex.result_values}\n    got {g.text!r}")


if __name__ == "__main__":
    main()
