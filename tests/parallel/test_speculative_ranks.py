"""Speculative decoding on ``--devices cpu:2`` in every multi-rank mode (issue 34 "must show",
docs/serving.md §13): TP_TP, TP_EP and DP_EP give, with n-gram speculation on, the tokens the same
mode gives with it off (greedy and seeded temperature 1, fp32, tiny-chat tool-result prompts whose
answers copy from the prompt, so drafts are accepted; the run checks they were).

The scenario runs in a child process: the engine process joins the process group as rank 0, which the
pytest process should not do.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

import pytest
from rank_helpers import spawn_scenario

from m2serve.config.engine_args import EngineArgs
from m2serve.engine.core import LLMEngine
from m2serve.engine.sampling import SamplingParams

pytestmark = pytest.mark.slow  # starts six rank groups

REPO = Path(__file__).resolve().parents[2]
CKPT = REPO / "src/m2serve/checkpoints/tiny-chat"
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
MODES = {"TP_TP": {}, "TP_EP": {"ep_size": 2}, "DP_EP": {"ep_size": 2, "data_parallel_degree": 2}}


def _prompts() -> list[list[int]]:
    sys.path.insert(0, str(REPO))
    from tools.tiny_chat import data

    from m2serve.serve import chat_pipeline as cp
    from m2serve.serve.llm import LLM

    ctx = cp.TextContext.of(LLM(str(CKPT), dtype="float32", kv_cache_format="float32", num_kv_pages=8))
    return [cp.prepare_blocking(ctx, cp.ChatJob(list(ex.prompt_messages), ex.tools or None)).ids
            for ex in data.eval_subset("tool_result", 2, seed=34)]


def _generate(engine: LLMEngine, prompts: list[list[int]]) -> dict[str, list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(f"g{i}", p, SamplingParams(temperature=0.0, max_tokens=40))
        engine.add_request(f"t{i}", p, SamplingParams(temperature=1.0, max_tokens=40, seed=i))
    out: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


def _scenario(prompts: list[list[int]], results) -> None:
    try:
        res = {}
        for mode, kw in MODES.items():
            for name, spec in (("plain", None), ("spec", SPEC)):
                engine = LLMEngine.from_args(EngineArgs(
                    model=str(CKPT), dtype="float32", kv_cache_format="float32", num_kv_pages=32,
                    kv_cache_page_size=64, devices="cpu:2", speculative_config=spec, **kw))
                try:
                    res[mode, name] = (_generate(engine, prompts), engine.stats.spec_accepted_tokens)
                finally:
                    engine.runner.model.shutdown()
        results.put(res)
    except BaseException:
        results.put({"crash": traceback.format_exc()})


def test_multi_rank_modes_give_the_same_tokens_with_speculation():
    prompts = _prompts()
    res = spawn_scenario(_scenario, (prompts,), 600)
    for mode in MODES:
        plain, _ = res[mode, "plain"]
        spec, accepted = res[mode, "spec"]
        assert spec == plain, mode
        assert accepted > 0, f"{mode}: no draft accepted"
