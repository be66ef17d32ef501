"""Helper run under torchrun by test_torchrun.py: every rank joins the env:// rendezvous; rank 0
runs the engine over the DistributedModel and writes the greedy tokens as JSON.

usage: torchrun ... torchrun_greedy.py CHECKPOINT EP_SIZE OUT.json
"""

from __future__ import annotations

import json
import sys

from m2serve.config.engine_args import EngineArgs
from m2serve.engine.core import LLMEngine
from m2serve.engine.sampling import SamplingParams
from m2serve.parallel.deploy import join_torchrun

PROMPTS = [[5, 17, 33, 2, 8, 90, 1], list(range(40, 75)), [99, 3]]


def engine_args(ckpt: str, ep_size: int = 1) -> EngineArgs:
    return EngineArgs(model=ckpt, dtype="float32", kv_cache_format="float32", num_kv_pages=32,
                      kv_cache_page_size=16, ep_size=ep_size, max_batch_input_tokens=24)


def greedy(engine: LLMEngine, steps: int = 32) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, params)
    out: list[list[int]] = [[] for _ in PROMPTS]
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[int(o.request_id)].extend(o.new_token_ids)
    return out


def main() -> None:
    ckpt, ep, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    args = engine_args(ckpt, ep)
    model = join_torchrun(args, timeout_s=60)
    if model is None:  # ranks 1..P-1 return once rank 0 stops them
        return
    try:
        tokens = greedy(LLMEngine.from_model(model, model.config, args))
    finally:
        model.shutdown()
    with open(path, "w") as f:
        json.dump({"tokens": tokens, "world": model.state.world_size, "mode": model.state.mode.value}, f)


if __name__ == "__main__":
    main()
