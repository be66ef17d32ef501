"""One record per request above the engine and one inbox into it (serve/output.py ``RequestTable``), and
the engine's counters on /metrics under vLLM's names (docs/serving.md §10).

Real tiny-random engine. References: the tokenizer's decode of the ids the engine produced, the engine
stepped on its own for the same greedy request, hand-derived prefix-cache counts (page size 16: a
40-token prompt seen again hits (40 - 1) // 16 = 2 full pages = 32 tokens) and the Prometheus text
parsed by prometheus_client's own parser.
"""

from __future__ import annotations

import threading

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from m2serve.engine.sampling import SamplingParams
from m2serve.serve.api import ServerSettings, build_app
from m2serve.serve.async_engine import AsyncEngine, StepFailedError
from m2serve.serve.llm import LLM
from m2serve.serve.metrics import ServerMetrics

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_random_dir):
    return LLM(str(tiny_random_dir), dtype="float32", num_kv_pages=64, kv_cache_page_size=16)


def _run(llm: LLM) -> list:
    out = []
    while llm.has_unfinished_requests():
        out += llm.requests.step()
    return out


def test_a_request_has_one_record_and_crosses_one_inbox(llm):
    ids = llm.encode("The capital of France is")
    params = SamplingParams(max_tokens=5, **GREEDY)
    rec = llm.requests.add("one", ids, params, llm.new_processor("one", params))
    assert llm.requests.records == {"one": rec}  # the one record above the engine
    assert llm.engine.has_request("one") and [kind for kind, _ in llm.engine.inbox] == ["add"]
    assert llm.engine.num_waiting == 1 and llm.engine.stats.waiting == 1  # queued counts as waiting
    with pytest.raises(ValueError, match="already in use"):
        llm.requests.add("one", ids, params, llm.new_processor("one", params))
    assert llm.requests.records == {"one": rec}  # the refused duplicate left the record alone
    out = _run(llm)
    assert all(r is rec for r, _ in out) and out[-1][1].finished
    tokens = [t for _, d in out for t in d.token_ids]
    assert "".join(d.text for _, d in out) == llm.tokenizer.decode(tokens)
    # closed everywhere: no record, no engine entry, nothing queued
    assert llm.requests.records == {} and not llm.engine.has_request("one") and llm.engine.inbox == []
    # the engine stepped on its own gives the same greedy tokens
    llm.engine.add_request("ref", ids, params)
    ref = []
    while llm.engine.has_unfinished_requests():
        ref += [t for o in llm.engine.step() for t in o.new_token_ids]
    assert tokens == ref


def test_a_rejected_request_registers_nothing(llm):
    params = SamplingParams(max_tokens=1)
    with pytest.raises(ValueError, match=str(llm.max_length)):
        llm.requests.add("long", [5] * (llm.max_length + 1), params, llm.new_processor("long", params))
    assert llm.requests.records == {} and not llm.engine.has_request("long") and llm.engine.inbox == []
    assert not llm.has_unfinished_requests()


def test_abort_from_another_thread_while_stepping(llm):
    params = SamplingParams(max_tokens=200, **GREEDY)
    llm.requests.add("a", [1, 2, 3], params, llm.new_processor("a", params))
    llm.requests.step()
    results = []
    t = threading.Thread(target=lambda: results.append(llm.requests.abort("a")))
    t.start()
    t.join()
    assert results == [True] and llm.requests.abort("a") is False  # idempotent
    assert all(d.request_id != "a" for _, d in _run(llm))  # no delta after the abort
    assert llm.engine.stats.kv_pages_used == 0 and not llm.engine.has_request("a")


def test_abort_running_sends_the_error_to_each_record(llm):
    params = SamplingParams(max_tokens=50, **GREEDY)
    got: dict[str, list] = {"x": [], "y": []}
    for rid in got:
        llm.requests.add(rid, [4, 5, 6], params, llm.new_processor(rid, params), got[rid].append)
    llm.requests.step()
    err = StepFailedError("boom")
    assert sorted(llm.requests.abort_running(err)) == ["x", "y"]
    assert got["x"][-1] is err and got["y"][-1] is err
    assert llm.requests.records == {} and llm.engine.stats.kv_pages_used == 0


def _metrics(client) -> dict[str, float]:
    text = client.get("/metrics").text
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_engine_counters_on_metrics_with_vllm_names(tiny_random_dir):
    # 4 pages of 16 tokens: two 60-token sequences cannot both hold their pages, so one is preempted
    llm = LLM(str(tiny_random_dir), dtype="float32", num_kv_pages=4, kv_cache_page_size=16)
    engine = AsyncEngine(llm, ServerMetrics())
    with TestClient(build_app(engine, ServerSettings(served_model_name="m"))) as client:
        prompt = list(range(1, 41))
        for _ in range(2):  # the second lookup finds the first's two full pages
            r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "temperature": 0})
            assert r.status_code == 200, r.text
        m = _metrics(client)
        assert m["vllm:prefix_cache_queries_total"] == 80 and m["vllm:prefix_cache_hits_total"] == 32
        assert m["m2serve_prefix_cache_requests_total"] == 2
        assert m["m2serve_prefix_cache_requests_hit_total"] == 1
        assert m["vllm:num_preemptions_total"] == 0
        body = {"prompt": [7] * 20, "max_tokens": 40, "n": 2, "temperature": 0, "ignore_eos": True}
        assert client.post("/v1/completions", json=body).status_code == 200
        m = _metrics(client)
        stats = llm.engine.stats
        assert m["vllm:num_preemptions_total"] == stats.preemptions > 0
        assert m["vllm:prefix_cache_queries_total"] == stats.prefix_cache_queries
        assert m["vllm:prefix_cache_hits_total"] == stats.prefix_cache_hits
        assert m["m2serve_prefix_cache_requests_total"] == stats.prefix_cache_requests
        assert llm.requests.records == {} and llm.engine.requests == {}
