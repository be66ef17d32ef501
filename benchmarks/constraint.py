"""Constrained-decoding overhead: per-step bitmask time for 32 constrained requests vs a decode step.

For each tokenizer (tiny-random's, tiny-chat's) and each request kind (response_format json_schema,
tool_choice required with two tools, tool_choice none), 32 ``GrammarConstraint`` s are driven by random
logits (temperature 1.0, reasoning budget 8) for --steps steps; the time spent in ``fill_bitmask`` for
the 32 rows plus ``accept_token`` is the mask cost of one engine step (single-threaded, as the engine
would call it; llguidance's ``LLExecutor`` could fill rows in parallel). Next to it: the time of one
tiny-random decode step at batch 32 through ``LLMEngine`` (greedy, EOS ignored, --context tokens of
prompt), measured in the same run. Printed: mean mask ms per step, decode ms per step, the ratio.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/constraint.py [--steps 64] [--context 128]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "text"))
from constraint_helpers import TOKENIZERS, make_compiler, unpack_bitmask  # noqa: E402
from test_constraint_sampling import SCHEMAS, TOOLS  # noqa: E402

from m2serve.text.constraint import json_spec, no_tool_call_spec, tool_calls_spec  # noqa: E402

BATCH = 32


def mask_step_seconds(compiler, spec, steps: int) -> float:
    """Mean seconds per step spent in fill_bitmask (32 rows) + accept_token (32 tokens)."""
    gen = torch.Generator().manual_seed(0)
    constraints = [compiler.constraint(spec, "inside", 8) for _ in range(BATCH)]
    bitmask = torch.zeros(BATCH, compiler.words, dtype=torch.int32)
    spent, counted = 0.0, 0
    for _ in range(steps):
        live = [c for c in constraints if not c.is_terminated()]
        if not live:  # restart finished rows so every step has 32 live requests
            constraints = [compiler.constraint(spec, "inside", 8) for _ in range(BATCH)]
            live = constraints
        t0 = time.perf_counter()
        for row, c in enumerate(live):
            c.fill_bitmask(bitmask, row)
        spent += time.perf_counter() - t0
        allowed = unpack_bitmask(bitmask[: len(live)], compiler.vocab_size)
        logits = torch.randn(len(live), compiler.vocab_size, generator=gen).masked_fill(~allowed, -torch.inf)
        tokens = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen).flatten().tolist()
        t0 = time.perf_counter()
        for c, t in zip(live, tokens):
            c.accept_token(t)
        spent += (time.perf_counter() - t0) * BATCH / len(live)
        counted += 1
    return spent / counted


def decode_step_seconds(context: int, steps: int) -> float:
    """Mean seconds per decode step of tiny-random at batch 32 (float32, greedy)."""
    from m2serve.checkpoints.tiny_random import build_tiny_random
    from m2serve.config.engine_args import EngineArgs
    from m2serve.engine.core import LLMEngine
    from m2serve.engine.sampling import SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_random(Path(tmp) / "tiny-random")
        eng = LLMEngine.from_args(EngineArgs(model=str(path), dtype="float32", kv_cache_format="float32",
                                             max_batch_size=BATCH, num_kv_pages=BATCH * 4 + 1))
        vocab = eng.config.vocab_size
        params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
        for i in range(BATCH):
            eng.add_request(f"r{i}", [(i * 7 + j) % vocab for j in range(context)], params)
        eng.step()  # prefill (and the first token)
        while eng.has_unfinished_requests() and len(eng.step()) < BATCH:
            pass  # until every request is decoding
        t0, n = time.perf_counter(), 0
        while eng.has_unfinished_requests():
            eng.step()
            n += 1
        return (time.perf_counter() - t0) / max(n, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--context", type=int, default=128)
    args = ap.parse_args()
    torch.set_num_threads(1)
    decode = decode_step_seconds(args.context, args.steps)
    print(f"tiny-random decode step, batch {BATCH}: {decode * 1e3:.2f} ms")
    kinds = {"json_schema": json_spec(SCHEMAS["array_of_objects"]), "required": tool_calls_spec(TOOLS),
             "none": no_tool_call_spec()}
    for name in TOKENIZERS:
        compiler = make_compiler(name)
        for kind, spec in kinds.items():
            t0 = time.perf_counter()
            compiler.compile(spec, "inside")
            compile_ms = (time.perf_counter() - t0) * 1e3
            mask = mask_step_seconds(compiler, spec, args.steps)
            print(f"{name:11s} V={compiler.vocab_size:5d} {kind:11s} compile {compile_ms:6.1f} ms  "
                  f"mask+accept x{BATCH}: {mask * 1e3:6.2f} ms/step = {mask / decode:5.2f}x decode step")


if __name__ == "__main__":
    main()
