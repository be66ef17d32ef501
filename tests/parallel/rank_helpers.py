"""What the multi-rank weight tests share: two prompts decoded greedily through a small engine, the
tokens compared with one process's (the reference the rank tests hold every mode to)."""
from __future__ import annotations

import multiprocessing as mp
from dataclasses import replace

from m2serve.config.engine_args import EngineArgs
from m2serve.config.model_config import MiniMaxM2Config
from m2serve.engine.core import LLMEngine
from m2serve.engine.sampling import SamplingParams

PROMPTS = [[5, 17, 33, 2, 8, 90, 1], [99, 3, 7, 7]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def greedy_tokens(model, args: EngineArgs) -> list[list[int]]:
    """8 greedy tokens per prompt of ``PROMPTS`` from ``model`` (one process or a DistributedModel)
    in an engine with a small fp32 KV pool (16 pages of 16 tokens)."""
    small = replace(args, num_kv_pages=16, kv_cache_page_size=16, kv_cache_format="float32")
    engine = LLMEngine.from_model(model, MiniMaxM2Config.from_pretrained(args.model), small)
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, GREEDY)
    out: dict[str, list[int]] = {str(i): [] for i in range(len(PROMPTS))}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
    return [out[str(i)] for i in range(len(PROMPTS))]


def spawn_scenario(target, args: tuple, timeout: float) -> dict:
    """Run ``target(*args, results)`` in a spawned process (its ranks spawn their own children) and
    return the dict it puts on ``results``; fails the test with the child's traceback when it put
    ``{"crash": traceback}``. Raises queue.Empty after ``timeout`` seconds without a result."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    p = ctx.Process(target=target, args=(*args, results))
    p.start()
    try:
        res = results.get(timeout=timeout)
    finally:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    assert "crash" not in res, res.get("crash")
    return res
