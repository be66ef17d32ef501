"""End-to-end tests of the real ``m2serve serve`` process with the official ``openai`` client.

docs/serving.md §10 (routes, fields, errors), issue 5 "Must show". One server per module (tiny-random,
fp32, an API key); each test checks its own requests.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from serve_helpers import FAST_ENGINE_FLAGS, metric, start_server

import m2serve

pytestmark = pytest.mark.slow  # starts server processes

API_KEY = "test-key-123"
MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "Tell me about the weather in Paris."}]


@pytest.fixture(scope="module")
def server(tiny_random_dir, tmp_path_factory):
    s = start_server(
        [
            "--model",
            str(tiny_random_dir),
            "--served-model-name",
            MODEL,
            "--api-key",
            API_KEY,
            "--max-batch-size",
            "128",
            *FAST_ENGINE_FLAGS,
        ],
        tmp_path_factory.mktemp("server"),
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


def _assert_error_shape(resp: httpx.Response, status: int) -> dict:
    """OpenAI error body: {"error": {"message", "type", "param", "code"}} (docs/serving.md §10)."""
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


def test_models_list(client):
    # docs/serving.md §10: GET /v1/models has one entry, id = served model name
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]


def test_key_rejected_401(server):
    # issue 5 item 2: 401 for a missing or wrong key when --api-key is set
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.models.list()
    assert e.value.status_code == 401
    resp = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES})
    err = _assert_error_shape(resp, 401)
    assert err["type"] == "authentication_error"
    assert httpx.get(server.url + "/health").status_code == 200  # health needs no key


def test_chat_stream_concatenates_to_nonstream(client):
    # docs/serving.md §10 + docs/parsers.md P21/P25: greedy streamed deltas == the non-streamed message
    kw = dict(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=24)
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 24 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    reasoning = getattr(msg, "reasoning_content", None)
    assert (msg.content or "") + (reasoning or "")  # the model said something

    content, reasoning_parts, finish, roles = [], [], None, 0
    for chunk in client.chat.completions.create(**kw, stream=True):
        d = chunk.choices[0].delta
        r_delta = getattr(d, "reasoning_content", None)
        assert not (d.content and r_delta), "a chunk mixes reasoning and content (P25)"
        roles += d.role == "assistant"
        content.append(d.content or "")
        reasoning_parts.append(r_delta or "")
        finish = chunk.choices[0].finish_reason or finish
    assert roles == 1
    assert "".join(content) == (msg.content or "")
    assert "".join(reasoning_parts) == (reasoning or "")
    assert finish == r.choices[0].finish_reason


def test_completions_echo_and_logprobs(client, tokenizer):
    # issue 5 item 1: /v1/completions with echo and logprobs (OpenAI legacy logprobs shape)
    prompt = "Hello world, this is"
    n_prompt = len(tokenizer.encode(prompt))
    r = client.completions.create(
        model=MODEL,
        prompt=prompt,
        echo=True,
        logprobs=2,
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    c = r.choices[0]
    assert c.text.startswith(prompt)
    assert r.usage.prompt_tokens == n_prompt and r.usage.completion_tokens == 5
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n_prompt + 5
    assert "".join(lp.tokens[:n_prompt]) == prompt
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # first prompt token: no logprob
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for i in range(n_prompt, n_prompt + 5):  # greedy: the chosen token is the most likely one
        top = lp.top_logprobs[i]
        assert 1 <= len(top) <= 2
        assert lp.token_logprobs[i] == pytest.approx(max(top.values()), abs=1e-4)
    # the non-echo text is what follows the prompt
    r2 = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    assert c.text == prompt + r2.choices[0].text


def test_completions_token_ids_and_list_prompts(client, tokenizer):
    ids = tokenizer.encode("Once upon a time")
    kw = dict(model=MODEL, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    r = client.completions.create(prompt=[ids, ids[:2]], **kw)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.prompt_tokens == len(ids) + 2
    r2 = client.completions.create(prompt=["Once upon a time", "Once"], **kw)
    assert r2.choices[0].text == r.choices[0].text  # same ids, greedy


def test_stop_reason_as_vllm_returns_it(client):
    # vLLM's choice field: the stop string (or stop_token_ids id) that ended the choice, None at the limit;
    # streamed, on the finishing chunk
    kw = dict(model=MODEL, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    free = client.completions.create(prompt="Once upon a time", **kw).choices[0]
    assert free.finish_reason == "length" and free.model_extra.get("stop_reason") is None
    stop = free.text.strip()[:3]
    r = client.completions.create(prompt="Once upon a time", stop=["never said", stop], **kw).choices[0]
    assert (r.finish_reason, r.model_extra["stop_reason"]) == ("stop", stop)
    chunks = list(client.completions.create(prompt="Once upon a time", stop=[stop], stream=True, **kw))
    assert chunks[-1].choices[0].model_extra["stop_reason"] == stop


def test_bad_fields_400(server, client):
    # issue 5 item 2: 400 in the OpenAI error shape, naming the field
    url = server.url + "/v1/chat/completions"
    err = _assert_error_shape(
        httpx.post(url, headers=_headers(), json={"model": MODEL, "messages": MESSAGES, "temperature": 5}),
        400,
    )
    assert "temperature" in err["message"] and err["param"] == "temperature"
    err = _assert_error_shape(
        httpx.post(url, headers=_headers(),
                   json={"model": MODEL, "messages": MESSAGES, "max_tokens": "many"}),
        400,
    )  # a field m2serve uses keeps its type (unknown fields are ignored: test_sdk_fields.py)
    assert "max_tokens" in err["message"]
    # constrained decoding (issue 20): a named tool that is not declared, a schema that does not compile
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    named = {"type": "function", "function": {"name": "g"}}
    err = _assert_error_shape(
        httpx.post(
            url,
            headers=_headers(),
            json={"model": MODEL, "messages": MESSAGES, "tools": tools, "tool_choice": named},
        ),
        400,
    )
    assert "'g'" in err["message"] and err["param"] == "tool_choice"
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "("}}}
    err = _assert_error_shape(
        httpx.post(url, headers=_headers(),
                   json={"model": MODEL, "messages": MESSAGES, "response_format": bad}),
        400,
    )
    assert "does not compile" in err["message"] and err["param"] == "response_format"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, logit_bias={"999999999": 5})
    assert e.value.status_code == 400


def test_prompt_longer_than_context_400(server):
    # issue 5 item 2: the message states the numbers
    models = httpx.get(server.url + "/v1/models", headers=_headers()).json()["data"]
    max_len = models[0]["max_model_len"]
    resp = httpx.post(
        server.url + "/v1/completions",
        headers=_headers(),
        json={"model": MODEL, "prompt": [5] * (max_len + 10), "max_tokens": 2},
    )
    err = _assert_error_shape(resp, 400)
    assert str(max_len + 10) in err["message"] and str(max_len) in err["message"]


def test_unknown_model_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES, max_tokens=2)
    assert e.value.status_code == 404
    assert "no-such-model" in str(e.value)


def test_tokenize_detokenize(server, tokenizer, tiny_random_dir):
    from transformers import AutoTokenizer

    text = "Hello <think> world"
    r = httpx.post(server.url + "/tokenize", headers=_headers(), json={"model": MODEL, "prompt": text}).json()
    assert r["tokens"] == tokenizer.encode(text) and r["count"] == len(r["tokens"])
    # vLLM's fields: add_special_tokens accepted (the tokenizer adds none), token strings as transformers
    # spells them; an unknown field is ignored as on the other routes
    hf = AutoTokenizer.from_pretrained(str(tiny_random_dir))
    strs = httpx.post(server.url + "/tokenize", headers=_headers(), json={
        "prompt": text, "add_special_tokens": True, "return_token_strs": True, "some_new_field": 1}).json()
    assert strs["tokens"] == r["tokens"] == hf.encode(text, add_special_tokens=True)
    assert strs["token_strs"] == hf.convert_ids_to_tokens(r["tokens"])
    back = httpx.post(server.url + "/detokenize", headers=_headers(), json={"tokens": r["tokens"]}).json()
    assert back["prompt"] == text
    chat = httpx.post(server.url + "/tokenize", headers=_headers(), json={"messages": MESSAGES}).json()
    assert tokenizer.decode(chat["tokens"], skip_special_tokens=False).endswith("]~b]ai\n<think>\n")


def test_metrics_counters(server, client):
    # issue 5 item 1: /metrics counters move by the expected amounts after known requests
    before = server.metrics()
    usage = []
    for _ in range(2):
        r = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
        )
        usage.append(r.usage)
        assert r.usage.completion_tokens == 6
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=9)
    after = server.metrics()

    def delta(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("m2serve_requests_total", endpoint="chat", status="200") == 2
    assert delta("m2serve_requests_total", endpoint="chat", status="400") == 1
    assert delta("m2serve_generation_tokens_total") == 12
    assert delta("m2serve_prompt_tokens_total") == sum(u.prompt_tokens for u in usage)
    assert delta("m2serve_time_to_first_token_seconds_count") == 2
    assert delta("m2serve_inter_token_latency_seconds_count") == 10  # 6 tokens -> 5 gaps, per request
    # vLLM's names, by the served model name, move by the same amounts (its dashboards read these)
    name = {"model_name": MODEL}
    assert delta("vllm:generation_tokens_total", **name) == 12
    assert delta("vllm:prompt_tokens_total", **name) == sum(u.prompt_tokens for u in usage)
    assert delta("vllm:time_to_first_token_seconds_count", **name) == 2
    assert delta("vllm:inter_token_latency_seconds_count", **name) == 10
    assert delta("vllm:e2e_request_latency_seconds_count", **name) == 2
    # max_tokens 6; the labels in sorted order, as prometheus_client prints them
    assert delta("vllm:request_success_total", finished_reason="length", **name) == 2
    assert metric(after, "vllm:num_requests_running", **name) == 0
    assert metric(after, "m2serve_num_requests_running") == 0
    assert metric(after, "m2serve_kv_pages_used") == 0
    assert metric(after, "m2serve_kv_pages_free") > 0


def test_100_concurrent_streams(server):
    # issue 5 "Must show": 100 concurrent streams share the batch and complete with the right lengths
    aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)
    lengths = [3 + i % 8 for i in range(100)]

    async def one(n: int) -> tuple[int, int, str | None]:
        stream = await aclient.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Count to {n}."}],
            max_tokens=n,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        usage, finish = None, None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
            for ch in chunk.choices:
                finish = ch.finish_reason or finish
        return n, usage, finish

    async def run_all():
        try:
            return await asyncio.gather(*(one(n) for n in lengths))
        finally:
            await aclient.close()

    results = asyncio.run(run_all())
    assert all(usage == n and finish == "length" for n, usage, finish in results), results
    m = server.metrics()
    assert metric(m, "m2serve_num_requests_running") == 0 and metric(m, "m2serve_kv_pages_used") == 0


def test_client_disconnect_frees_pages(server, client):
    # issue 5 item 3: a client that disconnects mid-stream aborts its request and frees its KV pages
    before = server.metrics()
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2000, "stream": True, "ignore_eos": True}
    with (
        httpx.Client(timeout=60) as h,
        h.stream("POST", server.url + "/v1/chat/completions", headers=_headers(), json=body) as resp,
    ):
        assert resp.status_code == 200
        seen, pages_while_streaming = 0, 0.0
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                delta = (json.loads(line[6:])["choices"] or [{}])[0].get("delta", {})
                seen += bool(delta.get("content") or delta.get("reasoning_content"))
            if seen >= 3:  # still reading: the request holds its pages
                pages_while_streaming = metric(server.metrics(), "m2serve_kv_pages_used")
                break  # leaving iter_lines closes the response: the client is gone
    assert pages_while_streaming > 0
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = server.metrics()
        if metric(m, "m2serve_num_requests_running") == 0 and metric(m, "m2serve_kv_pages_used") == 0:
            break
        time.sleep(0.2)
    assert metric(m, "m2serve_num_requests_running") == 0
    assert metric(m, "m2serve_kv_pages_used") == 0
    assert metric(m, "m2serve_requests_aborted_total") - metric(before, "m2serve_requests_aborted_total") == 1
    assert (
        metric(m, "m2serve_generation_tokens_total") - metric(before, "m2serve_generation_tokens_total")
        < 2000
    )
    # the server stays healthy and serves the next request
    assert httpx.get(server.url + "/health").status_code == 200
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, temperature=0)
    assert r.usage.completion_tokens <= 3


def test_banner_and_version(server):
    # issue 5 item 5: the start banner prints model, encoding, parallel mode, KV pages, max context and URL
    first = server.log().splitlines()[0]
    for part in (
        f"m2serve {MODEL}",
        "encoding dense",
        "devices cpu (one rank) |",   # no parallel mode named for one rank
        "pages x 16 tokens",
        "max context",
        server.url + "/v1",
    ):
        assert part in first, first
    assert httpx.get(server.url + "/version").json() == {"version": m2serve.__version__}


def test_nonstream_client_gone_is_aborted(server):
    # issue 5 item 3 for non-streaming requests: a client that gives up frees the request's pages
    before = server.metrics()
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/chat/completions", headers=_headers(), json=body, timeout=2.0)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = server.metrics()
        if metric(m, "m2serve_requests_aborted_total") > metric(before, "m2serve_requests_aborted_total"):
            break
        time.sleep(0.2)
    assert metric(m, "m2serve_requests_aborted_total") - metric(before, "m2serve_requests_aborted_total") == 1
    assert _wait_pages_free(server)
    assert metric(server.metrics(), "m2serve_requests_total", endpoint="chat", status="499") >= 1


def _wait_pages_free(server, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = server.metrics()
        if metric(m, "m2serve_num_requests_running") == 0 and metric(m, "m2serve_kv_pages_used") == 0:
            return True
        time.sleep(0.2)
    return False
