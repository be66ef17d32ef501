"""In-process API tests (FastAPI TestClient, real tiny-random engine): request fields -> SamplingParams.

docs/serving.md §10 (extensions, thinking_temperature and the server-wide --thinking-temperature),
issue 5 item 1.
The engine's ``add_request`` is wrapped to record what the API hands it; generation itself is real.
"""

from __future__ import annotations

import inspect
import json
import sys

import pytest
from fastapi.testclient import TestClient

from m2serve.serve import chat_pipeline as cp
from m2serve.serve.api import ServerSettings, build_app
from m2serve.serve.async_engine import AsyncEngine
from m2serve.serve.cli import _make_llm, build_parser, resolve_options
from m2serve.serve.errors import APIError

MESSAGES = [{"role": "user", "content": "Hi there"}]


class RecordingEngine:
    """Forwards to the real engine, recording each add_request (request id, prompt ids, SamplingParams)."""

    def __init__(self, engine):
        self._engine, self.seen = engine, []

    def add_request(self, request_id, prompt_token_ids, params, constraint=None):
        self.seen.append((request_id, list(prompt_token_ids), params))
        return self._engine.add_request(request_id, prompt_token_ids, params, constraint=constraint)

    def __getattr__(self, name):
        return getattr(self._engine, name)


@pytest.fixture(scope="module")
def served(tiny_random_dir):
    parser = build_parser()
    argv = [
        "serve",
        "--model",
        str(tiny_random_dir),
        "--thinking-temperature",
        "0.7",
        "--dtype",
        "float32",
        "--num-kv-pages",
        "128",
        "--kv-cache-page-size",
        "16",
    ]
    llm = _make_llm(resolve_options(parser.parse_args(argv), parser, {}))
    llm.engine = RecordingEngine(llm.engine)
    seen = llm.engine.seen
    app = build_app(AsyncEngine(llm), ServerSettings(served_model_name="m"))
    with TestClient(app) as client:
        yield client, llm, seen


def test_thinking_temperature_request_and_server_default(served):
    # docs/serving.md §10: thinking_temperature per request, --thinking-temperature as the server default
    client, llm, seen = served
    seen.clear()
    assert (
        client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2}).status_code == 200
    )
    assert (
        client.post(
            "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, "thinking_temperature": 0.2}
        ).status_code
        == 200
    )
    (_, _, p_default), (_, _, p_request) = seen
    assert p_default.thinking_temperature == 0.7 and p_request.thinking_temperature == 0.2
    tok = llm.tokenizer
    for p in (p_default, p_request):  # what the sampler needs to switch on token ids (P1)
        assert p.start_in_reasoning is True
        assert set(p.reasoning_end_token_ids) == {tok.think_end_id, tok.tool_call_id}


def test_completions_do_not_switch_on_reasoning(served):
    client, _, seen = served
    seen.clear()
    assert client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2}).status_code == 200
    assert seen[0][2].start_in_reasoning is False and seen[0][2].thinking_temperature is None


def test_sampling_fields_reach_sampling_params(served):
    client, _, seen = served
    seen.clear()
    body = {
        "messages": MESSAGES,
        "max_completion_tokens": 3,
        "max_tokens": 50,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 7,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "logit_bias": {"5": 2.0},
        "seed": 11,
        "stop": ["xyz"],
        "stop_token_ids": [9],
        "ignore_eos": True,
        "min_tokens": 1,
        "n": 2,
        "logprobs": True,
        "top_logprobs": 3,
    }
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert [c["index"] for c in r.json()["choices"]] == [0, 1]
    assert all(len(c["logprobs"]["content"]) == 3 for c in r.json()["choices"])
    (_, ids0, p0), (_, ids1, p1) = seen
    assert ids0 == ids1
    assert (p0.seed, p1.seed) == (11, 12)  # n > 1 fans out with seed + index
    for p in (p0, p1):
        assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (3, 0.5, 0.9, 7, 0.05)
        assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.1, 0.5, -0.5)
        assert p.logit_bias == {5: 2.0} and p.stop == ("xyz",) and p.stop_token_ids == (9,)
        assert p.ignore_eos and p.min_tokens == 1 and p.n == 1 and p.logprobs == 3


def test_usage_and_reasoning_tokens(served):
    client, _, _ = served
    r = client.post(
        "/v1/chat/completions",
        json={"messages": MESSAGES, "max_tokens": 4, "ignore_eos": True, "temperature": 0},
    ).json()
    u = r["usage"]
    assert u["completion_tokens"] == 4 and u["total_tokens"] == u["prompt_tokens"] + 4
    # the prompt ends in <think>: tokens up to </think> count as reasoning (here: no </think> in 4 tokens
    # unless the model emits it, so reasoning_tokens <= completion_tokens)
    assert 0 < u["completion_tokens_details"]["reasoning_tokens"] <= 4


def test_stream_include_usage_last_chunk(served):
    client, _, _ = served
    with client.stream(
        "POST",
        "/v1/chat/completions",
        json={
            "messages": MESSAGES,
            "max_tokens": 3,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2][6:])
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 3


def test_bad_requests_are_400_and_do_not_reach_engine(served):
    client, _, seen = served
    seen.clear()
    for body in (
        {"messages": []},
        {"messages": MESSAGES, "n": 0},
        {"messages": MESSAGES, "top_logprobs": 2},
        {"messages": [{"role": "tool", "content": "orphan result"}]},
        {"messages": MESSAGES, "logit_bias": {"abc": 1}},
        {"messages": MESSAGES, "min_tokens": 5, "max_tokens": 2},
        {"messages": MESSAGES, "chat_template_kwargs": {"messages": []}},  # reserved template variable
    ):
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 400, (body, r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert seen == []
    r = client.post(
        "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400
    assert client.get("/health").status_code == 200


def test_prefix_cache_hits_reported_as_cached_tokens(served):
    # usage.prompt_tokens_details.cached_tokens: prompt tokens served from full cached pages (page size 16)
    client, _, _ = served
    body = {
        "messages": [{"role": "user", "content": "A prompt long enough to fill one KV page or more."}],
        "max_tokens": 1,
    }
    client.post("/v1/chat/completions", json=body)
    u = client.post("/v1/chat/completions", json=body).json()["usage"]
    cached = u["prompt_tokens_details"]["cached_tokens"]
    assert 16 <= cached < u["prompt_tokens"] and cached % 16 == 0


def test_stop_string_over_http_and_n_streams(served):
    # spec §1: a stop string ends the request and is never returned; n = 2 streams both choices
    client, _, _ = served
    base = {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    free = client.post("/v1/completions", json=base).json()["choices"][0]["text"]
    i = next(
        i for i in range(3, len(free) - 2) if "\ufffd" not in free[i : i + 2] and free[i : i + 2].strip()
    )
    stop = free[i : i + 2]
    r = client.post("/v1/completions", json={**base, "stop": [stop]}).json()["choices"][0]
    assert r["finish_reason"] == "stop" and r["text"] == free[: free.index(stop)] and stop not in r["text"]
    with client.stream(
        "POST",
        "/v1/chat/completions",
        json={"messages": MESSAGES, "max_tokens": 3, "ignore_eos": True, "stream": True, "n": 2},
    ) as s:
        chunks = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
    finishes = {
        c["choices"][0]["index"]: c["choices"][0]["finish_reason"]
        for c in chunks
        if c["choices"][0].get("finish_reason")
    }
    assert finishes == {0: "length", 1: "length"}


def test_completions_stream_matches_nonstream(served):
    # issue 5 item 1: /v1/completions streaming (with echo and logprobs) == the non-streamed result
    client, _, _ = served
    base = {
        "prompt": "Hello world",
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
        "echo": True,
        "logprobs": 1,
    }
    whole = client.post("/v1/completions", json=base).json()["choices"][0]
    with client.stream("POST", "/v1/completions", json={**base, "stream": True}) as s:
        chunks = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    tokens = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
    offsets = [o for c in chunks for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert text == whole["text"] and text.startswith("Hello world")
    assert tokens == whole["logprobs"]["tokens"] and offsets == whole["logprobs"]["text_offset"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_malformed_requests_never_500(served):
    # issue 5 item 2: a bad request gets a 4xx and never affects the server
    client, _, _ = served
    chat = [
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        {
            "messages": [
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}
                    ],
                }
            ]
        },
        {"messages": [{"role": "wizard", "content": "hi"}]},
        {"messages": MESSAGES, "tools": [{"type": "function", "function": {"parameters": {}}}]},
        {"messages": MESSAGES, "stop": [""] * 3, "max_tokens": 1},
        {"messages": MESSAGES, "seed": 2**70},
        {"messages": MESSAGES, "stop_token_ids": [-1]},
        {"messages": MESSAGES, "logit_bias": {"1": 1000}},
        {"messages": "hello"},
        [1, 2, 3],
    ]
    for body in chat:
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code < 500, (body, r.text)
    for body in (
        {"prompt": []},
        {"prompt": [[]]},
        {"prompt": [-3]},
        {"prompt": "x", "best_of": 3},
        {"prompt": "x", "suffix": "y"},
        {"prompt": "x", "logprobs": 50},
    ):
        r = client.post("/v1/completions", json=body)
        assert 400 <= r.status_code < 500, (body, r.text)
    assert client.get("/health").status_code == 200
    ok = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert ok.status_code == 200


def test_error_bodies_name_the_problem(served):
    # issue 5 item 2 / project rule: a 400 names the field. Invalid JSON says so (not "1: JSON decode
    # error" with param "1", the character offset); sampling-parameter errors carry the field as param.
    client, _, _ = served
    r = client.post(
        "/v1/chat/completions", content=b'{"messages": [}', headers={"content-type": "application/json"}
    )
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] is None
    assert err["message"].startswith("invalid request: the body is not valid JSON (")
    assert "at character" in err["message"]
    for body, field in (
        ({"messages": MESSAGES, "logit_bias": {"abc": 1}}, "logit_bias"),
        ({"messages": MESSAGES, "logit_bias": {"1": 1000}}, "logit_bias"),
        ({"messages": MESSAGES, "stop_token_ids": [10**9]}, "stop_token_ids"),
        ({"messages": MESSAGES, "seed": 2**70}, "seed"),
        ({"messages": MESSAGES, "min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        # a union's error is the field, not pydantic's branch tag (was "stop.str"); a whole-request check
        # names the field its message starts with (was null)
        ({"messages": MESSAGES, "stop": 5}, "stop"),
        ({"messages": MESSAGES, "tool_choice": 5}, "tool_choice"),
        ({"messages": MESSAGES, "top_logprobs": 3}, "top_logprobs"),
    ):
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (body, r.text)
        assert field in r.json()["error"]["message"]
    # a body that is not UTF-8 says so (was Starlette's "There was an error parsing the body"); NaN is
    # not a number in range (was "Input should be less than or equal to 2")
    hdr = {"content-type": "application/json"}
    r = client.post("/v1/chat/completions", content=b'{"messages": [{"role": "user", "content": "\xff"}]}',
                    headers=hdr)
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and "not valid UTF-8 (byte 0xff at offset 43)" in message, message
    r = client.post("/v1/chat/completions", headers=hdr,
                    content=b'{"messages": [{"role": "user", "content": "a"}], "temperature": NaN}')
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "temperature", r.text
    assert "finite number" in err["message"], r.text
    r = client.post("/v1/chat/completions", headers=hdr,  # a string field: pydantic's own message stays
                    content=b'{"messages": [{"role": "user", "content": "a"}], "model": NaN}')
    err = r.json()["error"]
    assert r.status_code == 400 and "valid string" in err["message"], r.text
    assert "finite" not in err["message"], r.text


def test_lone_surrogates_and_deep_nesting_are_400_not_500(served):
    # adversarial (issue 5 item 2: never a 500): JSON allows a lone "\ud800" escape, which is not
    # Unicode (the tokenizer raised TypeError -> 500); a tool schema nested 800 deep overflowed the
    # recursion limit while rendering (RecursionError -> 500). Both are the request's fault.
    client, llm, seen = served
    seen.clear()
    hdr = {"content-type": "application/json"}
    for path, raw, param in (
        (
            "/v1/chat/completions",
            b'{"messages":[{"role":"user","content":"a\\ud800b"}],"max_tokens":2}',
            "messages",
        ),
        ("/v1/completions", b'{"prompt":"a\\udfffb","max_tokens":2}', "prompt"),
        ("/tokenize", b'{"prompt":"a\\ud800"}', "prompt"),
        (
            "/v1/chat/completions",
            b'{"messages":[{"role":"user","content":"a"}],"max_tokens":2,'
            b'"tools":[{"type":"function","function":{"name":"\\ud800"}}]}',
            "tools",  # named where it is (was "messages": the rendered prompt holds the tools)
        ),
    ):
        r = client.post(path, content=raw, headers=hdr)
        assert r.status_code == 400, (raw, r.text)
        err = r.json()["error"]
        assert err["param"] == param and "lone UTF-16 surrogate" in err["message"]
    deep = b'{"type":"object","properties":' * 800 + b"{}" + b"}" * 800
    r = client.post(
        "/v1/chat/completions",
        content=b'{"messages":[{"role":"user","content":"a"}],"max_tokens":2,'
        b'"tools":[{"type":"function","function":{"name":"f","parameters":' + deep + b"}}]}",
        headers=hdr,
    )
    # Whether 800 levels overflow the recursion limit while rendering depends on how deep the web
    # stack already is (it changed between FastAPI / Starlette releases); if they do not, the rendered
    # prompt is longer than the context. Either way a 400 that says why, never a 500.
    err = r.json()["error"]
    assert r.status_code == 400 and ("nested too deeply" in err["message"]
                                     or err["code"] == "context_length_exceeded"), r.text
    # The render path itself, deterministically: a schema deeper than the stack room left -> the
    # RecursionError while rendering is a 400 naming the tools (the recursion limit is set relative to
    # this frame's depth, so the outcome does not depend on the caller's stack).
    nested: dict = {}
    for _ in range(400):
        nested = {"type": "object", "properties": nested}
    tools = [{"type": "function", "function": {"name": "f", "parameters": nested}}]
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(len(inspect.stack()) + 200)
    try:
        with pytest.raises(APIError) as caught:
            cp.render_prompt(cp.TextContext.of(llm), [{"role": "user", "content": "a"}], tools)
    finally:
        sys.setrecursionlimit(limit)
    assert caught.value.status == 400 and caught.value.param == "tools"
    assert "nested too deeply" in caught.value.message
    # the HTTP request's 400 names the tools when the render overflowed, the messages (the rendered
    # prompt) when it was too long for the context: which one happened depends on the stack (above)
    assert err["param"] == ("tools" if "nested too deeply" in err["message"] else "messages"), r.text
    # an error message that echoes a surrogate from the request (unknown model) must still be
    # encodable: UTF-8 encoding of the error body raised UnicodeEncodeError -> 500
    for path, body in (("/v1/chat/completions", b'"messages":[{"role":"user","content":"a"}]'),
                       ("/detokenize", b'"tokens":[1]')):
        r = client.post(path, content=b"{" + body + b',"model":"\\ud800"}', headers=hdr)
        assert r.status_code == 404 and "model '\\ud800'" in r.json()["error"]["message"], r.text
    assert seen == []
    assert client.get("/health").status_code == 200
    ok = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2})
    assert ok.status_code == 200


def test_rejected_tool_calls_counter_exported_before_first_rejection():
    # docs/parsers.md P13 / issue 5: the counter is scrapeable (at 0) from the start, so rates work
    from m2serve.serve.metrics import ServerMetrics

    text = ServerMetrics().render().decode()
    assert 'm2serve_tool_calls_rejected_total{reason="undeclared"} 0.0' in text


def test_vllm_gauge_names_carry_the_engine_snapshot():
    # vLLM dashboards read vllm:num_requests_running / _waiting and vllm:kv_cache_usage_perc (0..1),
    # by model_name:
    # 3 running, 2 waiting, 30 of 120 pages held (the rest free or cached) -> 0.25
    from m2serve.engine.core import EngineStats
    from m2serve.serve.metrics import ServerMetrics

    def stats(preemptions: int) -> EngineStats:
        return EngineStats(running=3, waiting=2, kv_pages_total=120, kv_pages_used=30, kv_pages_free=70,
                           kv_page_size=16, prefix_cache_queries=0, prefix_cache_hits=0,
                           prefix_cache_requests=0, prefix_cache_requests_hit=0, chunked_prefill_steps=0,
                           preemptions=preemptions, generated_tokens=0, steps=0)

    m = ServerMetrics()
    m.set_engine(stats(2))   # before the engine is installed: no name yet
    m.label_model("tiny", stats(5))   # install(): the served model name; the counts carried over whole
    lines = set(m.render().decode().splitlines())
    assert {'vllm:num_requests_running{model_name="tiny"} 3.0',
            'vllm:num_requests_waiting{model_name="tiny"} 2.0',
            'vllm:kv_cache_usage_perc{model_name="tiny"} 0.25',
            'vllm:num_preemptions_total{model_name="tiny"} 5.0',
            "m2serve_num_requests_running 3.0"} <= lines
    assert not any('model_name=""' in line for line in lines)


# --------------------------------------------------------------------------- request-size limits


def test_request_body_limit_413_with_and_without_content_length(served):
    # the body limit (--max-request-bytes) is enforced before parsing, for a declared Content-Length
    # and for a chunked body alike; a body under the limit still works (the engine thread is not
    # started: /tokenize needs only the tokenizer)
    _, llm, _ = served
    settings = ServerSettings(served_model_name="m", max_request_bytes=4096)
    small = TestClient(build_app(AsyncEngine(llm), settings))
    big = json.dumps({"prompt": "x" * 5000}).encode()
    for kwargs in ({"content": big}, {"content": iter([big[:3000], big[3000:]])}):
        r = small.post("/tokenize", headers={"content-type": "application/json"}, **kwargs)
        assert r.status_code == 413, r.text
        err = r.json()["error"]
        assert "4096 bytes" in err["message"] and "--max-request-bytes" in err["message"]
    ok = json.dumps({"prompt": "hello"}).encode()
    for kwargs in ({"content": ok}, {"content": iter([ok[:5], ok[5:]])}):
        r = small.post("/tokenize", headers={"content-type": "application/json"}, **kwargs)
        assert r.status_code == 200 and r.json()["count"] == len(llm.tokenizer.encode("hello")), r.text


@pytest.mark.parametrize(
    "route, body, param",
    [
        ("/v1/chat/completions", {"messages": MESSAGES, "stop": ["x"] * 65}, "stop"),
        ("/v1/chat/completions", {"messages": MESSAGES, "stop_token_ids": [1] * 1025}, "stop_token_ids"),
        ("/v1/completions", {"prompt": ["a"] * 1025, "max_tokens": 1}, "prompt"),
        ("/tokenize", {"messages": []}, "messages"),
    ],
)
def test_oversized_or_empty_lists_are_400_naming_the_field(served, route, body, param):
    client, _, seen = served
    seen.clear()
    r = client.post(route, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"].split(".")[0] == param and param in err["message"]
    assert seen == []  # nothing reached the engine


def test_developer_role_renders_as_system(served):
    # the openai SDK sends role "developer" (the system role of newer models); the MiniMax template knows
    # only system/user/assistant/tool, so it was a 400 "unknown role"
    client, _, _ = served
    ids = {}
    for role in ("developer", "system"):
        r = client.post("/tokenize", json={"messages": [{"role": role, "content": "Be brief."}, *MESSAGES]})
        assert r.status_code == 200, r.text
        ids[role] = r.json()["tokens"]
    assert ids["developer"] == ids["system"]


def test_errors_name_the_field_at_fault(served):
    # adversarial: reserved chat_template_kwargs and a too-long /v1/completions prompt were blamed on
    # "messages" (not even a field of /v1/completions)
    client, llm, _ = served
    body = {"messages": MESSAGES, "chat_template_kwargs": {"tools": []}}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text
    r = client.post("/v1/completions", json={"prompt": [5] * llm.max_length, "max_tokens": 1})
    err = r.json()["error"]
    assert r.status_code == 400 and (err["param"], err["code"]) == ("prompt", "context_length_exceeded")


@pytest.mark.parametrize("route, field", [("/v1/completions", "prompt"),
                                          ("/v1/chat/completions", "messages")])
def test_overlong_text_refused_before_tokenising(served, monkeypatch, route, field):
    # adversarial: a ~30 MB prompt was tokenised on the event loop (40 s, 4 GB) only to be refused for
    # its length; a text longer than max_length x the longest token's characters cannot fit whatever its
    # tokenisation, so it is refused without calling the tokenizer
    client, llm, _ = served
    n_chars = llm.max_length * llm.tokenizer.max_token_chars + 1
    assert llm.tokenizer.max_token_chars == max(len(t) for t in llm.tokenizer._tok.get_vocab())
    monkeypatch.setattr(llm, "encode", lambda text: pytest.fail("tokenised"))
    text = "a" * n_chars
    body = {"prompt": text} if field == "prompt" else {"messages": [{"role": "user", "content": text}]}
    r = client.post(route, json={**body, "max_tokens": 1})
    err = r.json()["error"]
    assert r.status_code == 400, r.text
    assert (err["param"], err["code"]) == (field, "context_length_exceeded")
    rendered = n_chars if field == "prompt" else len(llm.render_chat(body["messages"]))  # + the template
    assert f"{rendered} characters" in err["message"]


def test_body_without_json_content_type_says_so(served):
    # adversarial: valid JSON sent as text/plain got "body: Input should be a valid dictionary"
    client, _, _ = served
    body = json.dumps({"messages": MESSAGES, "max_tokens": 1})
    r = client.post("/v1/chat/completions", content=body, headers={"content-type": "text/plain"})
    assert r.status_code == 400 and "Content-Type: application/json" in r.json()["error"]["message"], r.text
    assert "'text/plain'" in r.json()["error"]["message"]
