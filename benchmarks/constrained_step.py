"""Engine step time with 32 constrained requests vs 32 unconstrained ones (issue 20 "Must show").

For ``tiny-random`` and the bench config (vocab 32,000, hidden 3072, 48 heads, 8 KV heads, head_dim
128, 32 experts top-8, 2 layers; built on the fly in a temp dir), one ``LLMEngine`` (float32) runs
two phases in the same process, in alternating order for --rounds rounds:

* unconstrained: 32 requests (temperature 1.0, EOS ignored);
* constrained: 32 requests, a third each response_format json_schema, tool_choice required (two tools)
  and tool_choice none, reasoning budget 8 (``GrammarConstraint`` on the checkpoint's tokenizer).

Every request has a --context-token prompt; a request that finishes is replaced at once, so the timed
steps always decode 32 rows (a step that admits a replacement runs its prefill and is not timed).
Printed per config: mean decode step ms of each phase (best round), the overhead ratio, the share
of the constrained step spent in ``fill_bitmask`` + ``accept_token`` (grammar ms per step), the time
of the sampler's ``apply_allowed_bitmask`` on a [32, V] batch (apply ms, timed alone), and the
constraint work (grammar + apply) as a share of the unconstrained step: on a shared, loaded box the
step-time ratio is noisy, while the work the constraint adds is measured directly.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/constrained_step.py [--configs tiny,bench]
        [--steps 48] [--context 64] [--rounds 2]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "text"))
from test_constraint_sampling import SCHEMAS, TOOLS  # noqa: E402

from m2serve.checkpoints.tiny_random import build_tiny_random  # noqa: E402
from m2serve.config.engine_args import EngineArgs  # noqa: E402
from m2serve.engine.core import LLMEngine  # noqa: E402
from m2serve.engine.sampling import SamplingParams, apply_allowed_bitmask  # noqa: E402
from m2serve.text.constraint import GrammarCompiler, json_spec, no_tool_call_spec, tool_calls_spec  # noqa: E402

BENCH_DIMS = dict(hidden_size=3072, num_attention_heads=48, num_key_value_heads=8, head_dim=128,
                  rotary_dim=64, intermediate_size=1536, num_local_experts=32, num_experts_per_tok=8,
                  num_hidden_layers=2, vocab_size=32000)
BATCH = 32


class Timed:
    """Wraps a constraint; adds the seconds spent in its calls to ``clock[0]``."""

    def __init__(self, inner, clock: list[float]):
        self.inner, self.clock = inner, clock

    def _time(self, fn, *args):
        t = time.perf_counter()
        out = fn(*args)
        self.clock[0] += time.perf_counter() - t
        return out

    def fill_bitmask(self, bitmask, row):
        return self._time(self.inner.fill_bitmask, bitmask, row)

    def accept_token(self, token_id):
        return self._time(self.inner.accept_token, token_id)

    def is_terminated(self):
        return self._time(self.inner.is_terminated)

    def only_end_of_turn(self):
        return self._time(self.inner.only_end_of_turn)


def phase(eng: LLMEngine, compiler: GrammarCompiler | None, prompt: list[int], steps: int, tag: str
          ) -> tuple[float, float]:
    """Mean seconds per timed decode step, and the mean constraint seconds per timed step."""
    specs = [json_spec(SCHEMAS["array_of_objects"]), tool_calls_spec(TOOLS), no_tool_call_spec()]
    count = [0]
    clock = [0.0]

    def add(i: int) -> None:
        count[0] += 1
        c = None
        if compiler is not None:
            c = Timed(compiler.constraint(specs[i % 3], "inside", 8), clock)
        eng.add_request(f"{tag}-{count[0]}", prompt, SamplingParams(temperature=1.0, top_k=0, top_p=1.0,
                                                                    max_tokens=10_000, ignore_eos=True,
                                                                    seed=count[0]), constraint=c)

    for i in range(BATCH):
        add(i)
    eng.step()  # the prefills
    spent, mask, timed = 0.0, 0.0, 0
    added = False
    while timed < steps:
        clock[0] = 0.0
        t = time.perf_counter()
        outs = eng.step()
        dt = time.perf_counter() - t
        if not added:
            spent, mask, timed = spent + dt, mask + clock[0], timed + 1
        added = False
        for o in outs:
            if o.finished:
                add(count[0])
                added = True
    for rid in list(eng.requests):
        eng.abort_request(rid)
    eng.step()
    return spent / timed, mask / timed


def apply_ms(vocab_size: int, repeats: int = 20) -> float:
    """Best-of-3 mean ms of ``apply_allowed_bitmask`` on float32 [BATCH, V] logits, random words."""
    gen = torch.Generator().manual_seed(0)
    words = -(-vocab_size // 32)
    allowed = torch.randint(-2**31, 2**31 - 1, (BATCH, words), dtype=torch.int32, generator=gen)
    logits = torch.randn(BATCH, vocab_size, generator=gen)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(repeats):
            apply_allowed_bitmask(logits, allowed)
        best = min(best, (time.perf_counter() - t) / repeats)
    return best * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default="tiny,bench")
    p.add_argument("--steps", type=int, default=48, help="timed decode steps per phase")
    p.add_argument("--context", type=int, default=64, help="prompt tokens per request")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(1)
    print(f"{'config':8} {'unconstrained ms':>17} {'constrained ms':>15} {'overhead':>9} {'mask share':>11} "
          f"{'grammar ms':>11} {'apply ms':>9} {'work/step':>10}")
    with tempfile.TemporaryDirectory(prefix="m2serve-bench-") as tmp:
        for name in args.configs.split(","):
            path = build_tiny_random(Path(tmp) / name, **(BENCH_DIMS if name == "bench" else {}))
            compiler = GrammarCompiler.from_pretrained(path)
            pages = BATCH * (args.context + 2 * args.steps) // 16 + 64
            eng = LLMEngine.from_args(EngineArgs(model=str(path), dtype="float32", kv_cache_format="float32",
                                                 num_kv_pages=pages, max_batch_size=BATCH))
            prompt = compiler.tokenizer.encode("]~b]user\n" + "hi " * args.context)[: args.context - 3]
            prompt += compiler.tokenizer.encode("]~b]ai\n<think>\n")
            best = {"free": float("inf"), "constrained": float("inf")}
            share = 0.0
            for r in range(args.rounds):
                for kind in ("free", "constrained") if r % 2 == 0 else ("constrained", "free"):
                    step, mask = phase(eng, compiler if kind == "constrained" else None, prompt, args.steps,
                                       f"{kind}{r}")
                    if step < best[kind]:
                        best[kind] = step
                        if kind == "constrained":
                            share = mask / step
            a, b = best["free"], best["constrained"]
            grammar, apply = share * b * 1e3, apply_ms(compiler.vocab_size)
            print(f"{name:8} {a * 1e3:17.1f} {b * 1e3:15.1f} {b / a - 1:+8.1%} {share:10.1%} "
                  f"{grammar:11.1f} {apply:9.1f} {(grammar + apply) / (a * 1e3):9.1%}")


if __name__ == "__main__":
    main()
