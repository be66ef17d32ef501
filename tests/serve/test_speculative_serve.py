"""Speculative decoding at the serving layer (issue 34 items 1 and 4, docs/serving.md §13): the
``--speculative-config`` flag, the recipe key, the ``LLM(...)`` argument, the banner, the
``/metrics`` counters under vLLM's names, and stop strings over several tokens per step.

References: the counters are compared with the engine's own counts and with each other (accepted =
sum over positions); the stop-string output with plain decoding of the same request.
"""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from m2serve.config.engine_args import EngineArgs, SpeculativeConfig
from m2serve.engine.sampling import SamplingParams
from m2serve.serve.api import ServerSettings, build_app
from m2serve.serve.async_engine import AsyncEngine
from m2serve.serve.cli import banner, build_parser, engine_args_from, resolve_options
from m2serve.serve.llm import LLM
from m2serve.serve.metrics import ServerMetrics
from m2serve.serve.recipe import RecipeError, load_recipe, recipe_overrides

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}


def _opts(argv: list[str], environ: dict[str, str] | None = None) -> dict:
    parser = build_parser()
    return resolve_options(parser.parse_args(argv), parser, environ or {})


def test_flag_env_and_recipe_reach_engine_args(tmp_path):
    text = json.dumps(SPEC)
    args = EngineArgs(**engine_args_from(_opts(["serve", "--speculative-config", text])))
    assert args.speculative_config == text
    env = _opts(["generate"], {"M2SERVE_SPECULATIVE_CONFIG": text})
    assert env["speculative_config"] == text
    assert _opts(["serve"])["speculative_config"] is None   # off by default
    p = tmp_path / "r.yaml"
    p.write_text("runtime:\n  speculative_config:\n    method: ngram\n    num_speculative_tokens: 2\n")
    assert recipe_overrides(load_recipe(p))["speculative_config"] == {"method": "ngram",
                                                                      "num_speculative_tokens": 2}
    assert _opts(["serve", "--config-file", str(p)])["speculative_config"]["num_speculative_tokens"] == 2
    bad = tmp_path / "bad.yaml"
    bad.write_text("runtime:\n  speculative_config:\n    method: medusa\n    num_speculative_tokens: 2\n")
    with pytest.raises(RecipeError, match=r"runtime\.speculative_config\.method"):
        load_recipe(bad)


def test_llm_argument_and_banner(tiny_random_dir):
    llm = LLM(str(tiny_random_dir), dtype="float32", num_kv_pages=8, kv_cache_page_size=16,
              speculative_config=SPEC)
    assert llm.engine.speculative == SpeculativeConfig("ngram", 3, 1, 2)
    assert "| speculative ngram k=3 lookup 1..2 |" in banner(llm, {})
    off = LLM(str(tiny_random_dir), dtype="float32", num_kv_pages=8, kv_cache_page_size=16)
    assert off.engine.speculative is None and "| speculative off |" in banner(off, {})
    with pytest.raises(ValueError, match=r"speculative_config\.num_speculative_tokens"):
        LLM(str(tiny_random_dir), speculative_config={"method": "ngram"})


M = (("model_name", "m"),)   # the served model name, vLLM's label


def _metrics(client) -> dict[tuple, float]:
    text = client.get("/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_spec_decode_counters_on_metrics_with_vllm_names(tiny_random_dir):
    llm = LLM(str(tiny_random_dir), dtype="float32", num_kv_pages=16, kv_cache_page_size=16,
              speculative_config=SPEC)
    engine = AsyncEngine(llm, ServerMetrics())
    with TestClient(build_app(engine, ServerSettings(served_model_name="m"))) as client:
        m = _metrics(client)
        assert m[("vllm:spec_decode_num_draft_tokens_total", M)] == 0   # vLLM's model_name label
        body = {"prompt": [7, 8, 9] * 8, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
        assert client.post("/v1/completions", json=body).status_code == 200
        m = _metrics(client)
    st = llm.engine.stats
    assert st.spec_draft_tokens > 0   # the prompt's repeats always give a draft at the first decode
    assert m[("vllm:spec_decode_num_drafts_total", M)] == st.spec_drafts
    assert m[("vllm:spec_decode_num_draft_tokens_total", M)] == st.spec_draft_tokens
    assert m[("vllm:spec_decode_num_accepted_tokens_total", M)] == st.spec_accepted_tokens
    per_pos = [m.get(("vllm:spec_decode_num_accepted_tokens_per_pos_total", (*M, ("position", str(i)))), 0)
               for i in range(3)]
    assert per_pos == st.spec_accepted_per_pos + [0] * (3 - len(st.spec_accepted_per_pos))
    assert sum(per_pos) == st.spec_accepted_tokens
    assert per_pos == sorted(per_pos, reverse=True)   # position i+1 is accepted only after position i


def test_stop_string_ends_at_the_token_that_completed_it(tiny_random_dir):
    # several tokens per step: the output (tokens, text, usage) equals plain decoding's, which stopped
    # at the token that completed the stop string
    out = {}
    for name, spec in (("plain", None), ("spec", SPEC)):
        llm = LLM(str(tiny_random_dir), dtype="float32", num_kv_pages=16, kv_cache_page_size=16,
                  speculative_config=spec)
        free = llm.generate([[7, 8, 9] * 8], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0]
        stop = llm.decode(free.token_ids[14:17])   # a piece of text in the middle of the output
        r = llm.generate([[7, 8, 9] * 8], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                                         stop=[stop]), use_tqdm=False)[0].outputs[0]
        accepted = llm.engine.stats.spec_accepted_tokens
        out[name] = (free.token_ids, r.token_ids, r.text, r.finish_reason, accepted)
    assert out["spec"][:4] == out["plain"][:4]
    assert out["plain"][3] == "stop" and len(out["plain"][1]) < 40
    assert out["spec"][4] > 0   # steps emitted several tokens


def test_output_processor_takes_several_tokens_as_one_at_a_time(tiny_random_dir):
    # the reference is the same processor fed one token per step (plain decoding): a step of several
    # tokens whose second completes the stop string keeps the first two tokens only
    llm = LLM(str(tiny_random_dir), dtype="float32", num_kv_pages=8, kv_cache_page_size=16)
    ids = [345, 509, 465, 702, 586, 503, 65, 531]
    stop = llm.decode(ids[3:5])
    params = SamplingParams(temperature=0, stop=[stop], logprobs=0)
    one = llm.new_processor("a", params)
    deltas = [one.process([t]) for t in ids]
    kept = [t for d in deltas for t in d.token_ids]
    assert kept == ids[:5] and deltas[4].stop_hit
    many = llm.new_processor("b", params)
    d1 = many.process(ids[:3])
    d2 = many.process(ids[3:], logprobs=[None] * 5)
    assert d1.token_ids + d2.token_ids == kept and d2.stop_hit and d2.finish_reason == "stop"
    assert d1.text + d2.text == "".join(d.text for d in deltas)
    assert d2.num_output_tokens == 5 and len(d2.logprobs) == 2
