"""Validation gaps and cost bounds on every API (issue 16 items 8 and 9), in-process.

Each bad request below was answered 200 before (or could cost unbounded work); each must now be a 400
naming the field or the limit, in the shape of the API called, without reaching the engine. The
published OpenAPI document must list the statuses the server really answers (400, not FastAPI's 422).
"""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from m2serve.serve.api import ServerSettings, build_app
from m2serve.serve.async_engine import AsyncEngine
from m2serve.serve.cli import _make_llm, build_parser, resolve_options
from m2serve.serve.protocol import MAX_SEQUENCES

MESSAGES = [{"role": "user", "content": "Hi there"}]
TOOL_LOOP = [
    {"role": "user", "content": "weather?"},
    {"role": "assistant", "content": None,
     "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "w", "arguments": "{}"}}]},
    {"role": "tool", "content": "sunny"},  # no tool_call_id
]
BIG = 10**6  # larger than any test context


class CountingEngine:
    """Forwards to the real engine, counting add_request calls (a bad request must add none)."""

    def __init__(self, engine):
        self._engine, self.added = engine, 0

    def add_request(self, *args, **kwargs):
        self.added += 1
        return self._engine.add_request(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._engine, name)


@pytest.fixture(scope="module")
def served(tiny_random_dir):
    parser = build_parser()
    argv = ["serve", "--model", str(tiny_random_dir), "--dtype", "float32", "--num-kv-pages", "128",
            "--kv-cache-page-size", "16"]
    llm = _make_llm(resolve_options(parser.parse_args(argv), parser, {}))
    llm.engine = CountingEngine(llm.engine)
    app = build_app(AsyncEngine(llm), ServerSettings(served_model_name="m"))
    with TestClient(app) as client:
        yield client, llm


def _chat(**kw):
    return ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, **kw})


def _cmpl(**kw):
    return ("/v1/completions", {"prompt": "Hi", "max_tokens": 2, **kw})


def _msgs(**kw):
    return ("/v1/messages", {"model": "m", "messages": MESSAGES, "max_tokens": 2, **kw})


def _resp(**kw):
    return ("/v1/responses", {"input": "Hi", "max_output_tokens": 2, **kw})


BAD = [  # (route, body, the field the error names)
    ("/v1/chat/completions", {"messages": TOOL_LOOP, "max_tokens": 2}, "tool_call_id"),
    ("/tokenize", {"messages": TOOL_LOOP}, "tool_call_id"),
    (*_chat(max_tokens="10"), "max_tokens"),
    (*_chat(max_completion_tokens=True), "max_completion_tokens"),
    (*_chat(stream="yes"), "stream"),
    (*_chat(n=True), "n"),
    (*_chat(stop_token_ids=[True]), "stop_token_ids"),
    (*_chat(logprobs=True, top_logprobs=True), "top_logprobs"),
    (*_chat(min_tokens=False), "min_tokens"),
    (*_chat(top_k=-5), "top_k"),
    (*_cmpl(prompt=[True, 3]), "prompt"),
    (*_cmpl(max_tokens="10"), "max_tokens"),
    (*_cmpl(stream="yes"), "stream"),
    (*_cmpl(logprobs=True), "logprobs"),
    (*_cmpl(top_k=-2), "top_k"),
    ("/detokenize", {"tokens": [True]}, "tokens"),
    (*_msgs(max_tokens="10"), "max_tokens"),
    (*_msgs(max_tokens=True), "max_tokens"),
    (*_msgs(stream="yes"), "stream"),
    (*_msgs(top_k=-3), "top_k"),
    (*_resp(max_output_tokens="10"), "max_output_tokens"),
    (*_resp(max_output_tokens=True), "max_output_tokens"),
    (*_resp(stream="yes"), "stream"),
]


def _error(route: str, r) -> tuple[str, str | None]:
    """(message, param) of an error body in the route's shape (Anthropic's has no param)."""
    body = r.json()
    if route.startswith("/v1/messages"):
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
        return body["error"]["message"], None
    return body["error"]["message"], body["error"]["param"]


@pytest.mark.parametrize("route, body, field", BAD)
def test_bad_types_and_values_are_400_naming_the_field(served, route, body, field):
    client, llm = served
    before = llm.engine.added
    r = client.post(route, json=body)
    assert r.status_code == 400, r.text
    message, param = _error(route, r)
    assert field in message, message
    if param is not None and field != "tool_call_id":
        assert param.split(".")[0] == field, param
    assert llm.engine.added == before  # refused before the engine


@pytest.mark.parametrize("top_k", [-1, 0, 1])
def test_documented_top_k_values_accepted(served, top_k):
    client, _ = served
    for route, body in (_chat(top_k=top_k), _cmpl(top_k=top_k)):
        assert client.post(route, json=body).status_code == 200


def test_tool_message_with_call_id_accepted(served):
    client, _ = served
    loop = [*TOOL_LOOP[:2], {**TOOL_LOOP[2], "tool_call_id": "call_1"}]
    assert client.post("/v1/chat/completions", json={"messages": loop, "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("route, body, field", [
    (*_chat(max_tokens=BIG), "max_tokens"),
    (*_chat(max_completion_tokens=BIG), "max_completion_tokens"),
    (*_cmpl(max_tokens=BIG), "max_tokens"),
    (*_msgs(max_tokens=BIG), "max_tokens"),
    (*_resp(max_output_tokens=BIG), "max_output_tokens"),
])
def test_max_tokens_beyond_the_context_is_400_with_the_numbers(served, route, body, field):
    # vLLM: "'max_tokens' ... is too large: M. This model's maximum context length is C tokens and your
    # request has P input tokens (M > C - P)"; it was silently cut to the context
    client, llm = served
    before = llm.engine.added
    r = client.post(route, json=body)
    assert r.status_code == 400, r.text
    message, param = _error(route, r)
    n = len(llm.tokenizer.encode("Hi")) if route == "/v1/completions" else None
    if route == "/v1/chat/completions":
        n = client.post("/tokenize", json={"messages": MESSAGES}).json()["count"]
    assert f"{field} is too large: {BIG}" in message
    assert f"maximum context length is {llm.max_length} tokens" in message
    if n is not None:
        assert f"has {n} input tokens ({BIG} > {llm.max_length} - {n})" in message
    assert param in (None, field)
    assert llm.engine.added == before
    # the largest limit that fits is accepted
    if n is not None:
        key = field
        fits = {**body, key: llm.max_length - n, "stream": False}
        assert client.post(route, json=fits).status_code == 200, fits


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.mark.parametrize("route, body, field", [
    ("/tokenize", lambda t: {"prompt": t}, "prompt"),
    ("/tokenize", lambda t: {"messages": _user(t)}, "messages"),
    ("/v1/messages/count_tokens", lambda t: {"model": "m", "messages": _user(t)}, "messages"),
])
def test_tokenize_bounded_by_the_chat_character_limit(served, monkeypatch, route, body, field):
    # a 20 MB /tokenize took 16 s and delayed a concurrent chat by 14 s: the same limit as chat now
    # refuses, before tokenising, a text longer than the context can hold
    client, llm = served
    text = "a" * (llm.max_length * llm.tokenizer.max_token_chars + 1)
    monkeypatch.setattr(llm, "encode", lambda t: pytest.fail("tokenised"))
    r = client.post(route, json=body(text))
    assert r.status_code == 400, r.text
    message, param = _error(route, r)
    assert "characters" in message and f"max context of {llm.max_length} tokens" in message
    assert param in (None, field)


def test_completions_prompts_times_n_capped(served):
    # one request expanded to 1,024 prompts x n=64 = 65,536 sequences
    client, llm = served
    before = llm.engine.added
    n = 64
    prompts = ["a"] * (MAX_SEQUENCES // n + 1)
    r = client.post("/v1/completions", json={"prompt": prompts, "n": n, "max_tokens": 1})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "n" and str(MAX_SEQUENCES) in err["message"]
    assert f"{len(prompts)} prompts x n={n}" in err["message"]
    assert llm.engine.added == before
    ok = client.post("/v1/completions", json={"prompt": ["a"] * 2, "n": 2, "max_tokens": 1})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 4


def test_openapi_lists_the_statuses_really_returned(served):
    client, _ = served
    doc = client.get("/openapi.json").json()
    assert '"422"' not in str(doc).replace("'", '"')
    statuses = {(path, method): set(op["responses"]) for path, ops in doc["paths"].items()
                for method, op in ops.items()}
    observed = set()
    for route, body, _ in BAD:
        observed.add((route, str(client.post(route, json=body).status_code)))
    route, body = _chat(model="nope")
    observed.add((route, str(client.post(route, json=body).status_code)))
    observed.add(("/v1/responses/{response_id}", str(client.get("/v1/responses/resp_x").status_code)))
    for route, body in (_chat(), _cmpl(), _msgs(), _resp()):
        observed.add((route, str(client.post(route, json=body).status_code)))
    assert {s for _, s in observed} >= {"200", "400", "404"}
    for route, status in observed:
        method = "get" if "{" in route else "post"
        assert status in statuses[(route, method)], (route, status, statuses[(route, method)])
    for (path, method), codes in statuses.items():
        if method == "post":
            assert {"400", "413"} <= codes, (path, codes)
    schema = doc["paths"]["/v1/messages"]["post"]["responses"]["400"]["content"]["application/json"]["schema"]
    assert schema["$ref"].endswith("/AnthropicError")
