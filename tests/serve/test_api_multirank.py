"""The server on two CPU ranks (issue 5 item 3: rank 0 hosts the HTTP server and the scheduler).

``m2serve serve --devices cpu:2 --ep-size 2`` (spawned workers) and the same under torchrun
(env:// rendezvous, 1 node x 2 processes) run TP_EP (docs/parallelism.md §1) and must answer with the
same greedy tokens as the single-process offline engine on the same checkpoint (fp32).
"""

from __future__ import annotations

import sys

import openai
import pytest
from serve_helpers import FAST_ENGINE_FLAGS, free_port, start_server

from m2serve.engine.sampling import SamplingParams
from m2serve.serve.llm import LLM

pytestmark = pytest.mark.slow  # starts several rank processes

PROMPTS = ["Hello world", "The capital of France is"]


@pytest.fixture(scope="module")
def reference(tiny_random_dir):
    single = LLM(str(tiny_random_dir), dtype="float32", num_kv_pages=64, kv_cache_page_size=16)
    ref = single.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    return [r.outputs[0].text for r in ref]


def _greedy(server) -> list[str]:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    return [
        client.completions.create(
            model=model, prompt=p, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
        for p in PROMPTS
    ]


@pytest.fixture(scope="module")
def server(tiny_random_dir, tmp_path_factory):
    s = start_server(
        ["--model", str(tiny_random_dir), "--devices", "cpu:2", "--ep-size", "2", *FAST_ENGINE_FLAGS],
        tmp_path_factory.mktemp("multirank"),
    )
    yield s
    s.stop()


def test_two_ranks_match_single_process(server, reference):
    assert "mode TP_EP" in server.log().splitlines()[0]
    assert _greedy(server) == reference


def test_torchrun_rank0_serves(tiny_random_dir, tmp_path, reference):
    entry = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        "-m",
        "m2serve.serve.cli",
    ]
    s = start_server(
        ["--model", str(tiny_random_dir), "--devices", "cpu", "--ep-size", "2", *FAST_ENGINE_FLAGS],
        tmp_path,
        entry=entry,
    )
    try:
        assert s.log().count("mode TP_EP |") == 1  # one banner: only rank 0 hosts HTTP
        assert _greedy(s) == reference
    finally:
        s.stop()
    assert s.log().count("could not send stop") == 0  # workers waited for rank 0 to stop them
