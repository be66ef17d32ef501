"""Parser throughput: a 200k-character MiniMax-M2 output with 50 tool calls, streamed.

Prints characters/s fed per character and per 8 characters, and as ratios against two peers
measured in the same run: the one-shot parse of the same text (the same machine without chunking
overhead) and the same streaming at half the length (a linear-time parser keeps chars/s constant).

    /work/venv/bin/python benchmarks/parser.py [--chars 200000] [--calls 50]
"""

from __future__ import annotations

import argparse
import random
import time

from m2serve.text.parser import StreamingParser, parse_output

PROPS = {"path": {"type": "string"}, "content": {"type": "string"}, "mode": {"type": "integer"},
         "options": {"type": "object"}}
TOOLS = [{"type": "function",
          "function": {"name": "write_file", "parameters": {"type": "object", "properties": PROPS}}}]
WORDS = "the model reads 模型 思考 🙂 code <div> value </p> and then answers quickly".split()


def make_output(chars: int, calls: int, seed: int = 0) -> str:
    """Reasoning, then content interleaved with ``calls`` tool blocks, about ``chars`` long."""
    first = _make(chars // (calls + 2), calls, seed)
    return _make(int(chars // (calls + 2) * chars / len(first)), calls, seed)


def _make(per_call: int, calls: int, seed: int) -> str:
    rng = random.Random(seed)

    def prose(n: int) -> str:
        out: list[str] = []
        size = 0
        while size < n:
            w = rng.choice(WORDS) + ("\n" if rng.random() < 0.1 else " ")
            out.append(w)
            size += len(w)
        return "".join(out)

    def code(n: int) -> str:
        lines = [f"    x_{i} = compute({i}) + '</parameter>'  # 注释" for i in range(n // 44 + 1)]
        return "def f():\n" + "\n".join(lines) + "\n"

    parts = [prose(per_call), "</think>\n\n"]
    for i in range(calls):
        parts.append(prose(per_call // 3))
        parts.append('\n<minimax:tool_call>\n<invoke name="write_file">\n'
                     f'<parameter name="path">src/f{i}.py</parameter>\n'
                     f'<parameter name="content">{code(per_call * 2 // 3)}</parameter>\n'
                     f'<parameter name="mode">{420 + i}</parameter>\n'
                     f'<parameter name="options">{{"overwrite": true, "n": {i}}}</parameter>\n'
                     "</invoke>\n</minimax:tool_call>")
    return "".join(parts)


def stream_time(text: str, step: int) -> tuple[float, int]:
    parser = StreamingParser(TOOLS, "split", "<think>\n")
    t0 = time.perf_counter()
    for i in range(0, len(text), step):
        parser.feed(text[i:i + step])
    parser.finish()
    return time.perf_counter() - t0, len(parser.tool_calls)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chars", type=int, default=200_000)
    ap.add_argument("--calls", type=int, default=50)
    args = ap.parse_args()
    text = make_output(args.chars, args.calls)
    half = make_output(args.chars // 2, args.calls // 2)
    t0 = time.perf_counter()
    one_shot = parse_output(text, TOOLS, "split", "<think>\n")
    t_one = time.perf_counter() - t0
    assert len(one_shot.tool_calls) == args.calls, len(one_shot.tool_calls)
    print(f"output: {len(text):,} chars, {args.calls} tool calls")
    print(f"one-shot            {len(text) / t_one:14,.0f} chars/s  ({t_one * 1e3:8.1f} ms)")
    for step in (8, 1):
        t, n = stream_time(text, step)
        t_half, _ = stream_time(half, step)
        assert n == args.calls
        label = f"streamed per {step} char{'s' if step > 1 else ' '}"
        print(f"{label} {len(text) / t:14,.0f} chars/s  ({t * 1e3:8.1f} ms)"
              f"  {t / t_one:6.1f}x one-shot time;  chars/s at full / half length: "
              f"{(len(text) / t) / (len(half) / t_half):.2f} (1.00 = linear)")


if __name__ == "__main__":
    main()
