"""The server on two CPU ranks (issue 5 item 3: rank 0 hosts the HTTP server and the scheduler).

``m2serve serve --devices cpu:2 --ep-size 2`` (TP_EP, spec/serving.md §1) must answer with the same
greedy tokens as the single-process offline engine on the same checkpoint (fp32).
"""

from __future__ import annotations

import openai
import pytest
from serve_helpers import FAST_ENGINE_FLAGS, start_server

from m2serve.engine.sampling import SamplingParams
from m2serve.serve.llm import LLM

PROMPTS = ["Hello world", "The capital of France is"]


@pytest.fixture(scope="module")
def server(tiny_random_dir, tmp_path_factory):
    s = start_server(
        ["--model", str(tiny_random_dir), "--devices", "cpu:2", "--ep-size", "2", *FAST_ENGINE_FLAGS],
        tmp_path_factory.mktemp("multirank"),
    )
    yield s
    s.stop()


def test_two_ranks_match_single_process(server, tiny_random_dir):
    assert "mode TP_EP" in server.log().splitlines()[0]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    got = [
        client.completions.create(
            model=model, prompt=p, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
        for p in PROMPTS
    ]
    single = LLM(str(tiny_random_dir), dtype="float32", num_kv_pages=64, kv_cache_page_size=16)
    ref = single.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert got == [r.outputs[0].text for r in ref]
