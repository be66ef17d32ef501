"""A failed engine step ends its batch, not the server (serve/async_engine.py ``_run``).

The model runner is wrapped to raise whenever a chosen "poison" prompt token is in the batch (a
stand-in for any unexpected step failure: a kernel error, a bug reached by one request's shape).
The request of that batch gets a 500 naming the failure, its KV pages are freed, /health stays 200
and later requests are served; only repeated failures with no good step between them declare the
engine dead (503 everywhere).
"""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from m2serve.serve.api import ServerSettings, build_app
from m2serve.serve.async_engine import MAX_CONSECUTIVE_STEP_FAILURES, AsyncEngine
from m2serve.serve.cli import _make_llm, build_parser, resolve_options

POISON = 7  # a prompt token id that makes the wrapped runner raise


class PoisonedRunner:
    """Forwards to the real ModelRunner; raises RuntimeError if a scheduled prompt contains POISON
    (or always, with ``always``)."""

    def __init__(self, runner):
        self._runner, self.always, self.failures = runner, False, 0

    def run(self, scheduled, kv):
        if self.always or any(POISON in s.request.prompt_token_ids for s in scheduled):
            self.failures += 1
            raise RuntimeError("simulated kernel failure")
        return self._runner.run(scheduled, kv)

    def __getattr__(self, name):
        return getattr(self._runner, name)


def _llm(model_dir):
    parser = build_parser()
    argv = ["serve", "--model", str(model_dir), "--dtype", "float32", "--num-kv-pages", "64",
            "--kv-cache-page-size", "16"]
    return _make_llm(resolve_options(parser.parse_args(argv), parser, {}))


@pytest.fixture()
def served(tiny_random_dir):
    llm = _llm(tiny_random_dir)
    runner = PoisonedRunner(llm.engine.runner)
    llm.engine.runner = runner
    with TestClient(build_app(AsyncEngine(llm), ServerSettings(served_model_name="m"))) as client:
        yield client, llm, runner


def _complete(client, prompt, stream=False):
    return client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4, "stream": stream,
                                                "temperature": 0})


def test_failed_step_ends_its_request_and_the_server_goes_on(served):
    client, llm, runner = served
    good = _complete(client, [1, 2, 3])
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 4

    bad = _complete(client, [1, POISON, 3])
    assert bad.status_code == 500, bad.text
    msg = bad.json()["error"]["message"]
    assert "engine step failed" in msg and "simulated kernel failure" in msg
    assert runner.failures == 1

    # streamed: the error arrives as an SSE error event, the stream ends
    with client.stream("POST", "/v1/completions", json={"prompt": [POISON], "max_tokens": 4,
                                                        "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert any("error" in e and "engine step failed" in e["error"]["message"] for e in events)

    # nothing leaked, nothing dead: pages freed, health 200, the next request is served
    assert llm.engine.stats.kv_pages_used == 0
    assert llm.engine.stats.running == 0 and llm.engine.stats.waiting == 0
    assert client.get("/health").status_code == 200
    again = _complete(client, [1, 2, 3])
    assert again.status_code == 200
    assert again.json()["choices"][0]["text"] == good.json()["choices"][0]["text"]  # same greedy output


def test_a_failed_step_frees_the_pages_of_its_batch(served):
    client, llm, runner = served
    kv = llm.engine.scheduler.kv
    assert kv.num_used_pages == 0
    assert _complete(client, [POISON] * 40).status_code == 500  # 3 pages of prompt (page size 16)
    assert kv.num_used_pages == 0 and kv.num_free_pages == kv.num_pages


def test_repeated_failures_declare_the_engine_dead(served):
    client, llm, runner = served
    runner.always = True
    codes = [_complete(client, [1, 2, 3]).status_code for _ in range(MAX_CONSECUTIVE_STEP_FAILURES)]
    assert codes[:-1] == [500] * (MAX_CONSECUTIVE_STEP_FAILURES - 1)
    assert codes[-1] == 503  # the last failure kills the engine: its request gets EngineDeadError
    assert client.get("/health").status_code == 503
    assert _complete(client, [1, 2, 3]).status_code == 503


def test_a_multi_rank_model_is_not_stepped_again_after_a_failure(served):
    # parallel/worker.py DistributedModel: after a failure its ranks may be out of step, so the engine
    # gives up at once instead of ending the batch and stepping on
    from m2serve.parallel.worker import DistributedModel

    client, llm, runner = served
    assert DistributedModel.recovers_from_step_failure is False
    assert llm.engine.recovers_from_step_failure is True

    class MultiRank:
        recovers_from_step_failure = DistributedModel.recovers_from_step_failure

        def __init__(self, model):
            self.model = model

        def __call__(self, batch, kv):
            return self.model(batch, kv)

    runner._runner.model = MultiRank(runner._runner.model)
    assert llm.engine.recovers_from_step_failure is False
    assert _complete(client, [1, POISON]).status_code == 503
    assert client.get("/health").status_code == 503


def test_a_request_finished_inside_the_failed_step_is_ended_too(tiny_random_dir):
    # the step failed after the engine had finished a request (e.g. in the text layer): its output was
    # lost with the step, so LLM.abort_running ends it as well instead of leaving it waiting forever
    # (no server here: the test drives the engine itself)
    from m2serve.engine.sampling import SamplingParams

    llm = _llm(tiny_random_dir)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    llm.add_request("done-in-step", [1, 2, 3], params, llm.new_processor("done-in-step", params))
    finished = [o for o in llm.engine.step() if o.finished]  # the engine's step alone: the LLM never sees it
    assert [o.request_id for o in finished] == ["done-in-step"]
    assert llm.has_unfinished_requests()  # its text state still waits for an output
    assert llm.abort_running() == ["done-in-step"]
    assert not llm.has_unfinished_requests()
