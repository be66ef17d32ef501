"""Validation gaps and cost bounds on every API (issue 16 items 8 and 9, issue 26 item 4), in-process.

Each bad request below was answered 200 before (or could cost unbounded work); each must now be a 400
naming the field or the limit, in the shape of the API called, without reaching the engine. The
published OpenAPI document must list the statuses the server really answers (400, not FastAPI's 422).
"""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from m2serve.serve.api import ServerSettings, build_app
from m2serve.serve.async_engine import AsyncEngine
from m2serve.serve.cli import _make_llm, build_parser, resolve_options
from m2serve.serve.errors import MAX_ERROR_CHARS
from m2serve.serve.protocol import MAX_MESSAGES, MAX_SEQUENCES, MAX_TOOLS

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
    (*_resp(max_output_tokens=BIG), "max_output_tokens"),
])  # /v1/messages clamps its required max_tokens instead (issue 26 item 2, test_client_limits.py)
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


# --------------------------------------------------------------------------- issue 26 item 4

def _turns(thinking=None, tool_use=None, tool_result=None, first=None):
    """An Anthropic tool loop whose blocks can be overridden: user, assistant (thinking + tool_use),
    user (tool_result)."""
    return [
        {"role": "user", "content": [{"type": "text", "text": "weather?", **(first or {})}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "call it", "signature": "s", **(thinking or {})},
            {"type": "tool_use", "id": "toolu_1", "name": "w", "input": {}, **(tool_use or {})}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny", **(tool_result or {})}]},
    ]


def _items(*items):
    return ("/v1/responses", {"input": list(items), "max_output_tokens": 2})


CALL = {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"}
REASONING = {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "r"}]}
ANTHROPIC_TYPES = [  # (messages, the path the 400 names): were 500s or were accepted
    (_turns(thinking={"signature": 12345}), "messages.1.content.0.signature"),
    (_turns(thinking={"thinking": ["x"]}), "messages.1.content.0.thinking"),
    (_turns(tool_result={"content": 5}), "messages.2.content.0.content"),
    (_turns(first={"text": 5}), "messages.0.content.0.text"),
    (_turns(tool_use={"id": 5}), "messages.1.content.1.id"),
    (_turns(tool_use={"input": "{}"}), "messages.1.content.1.input"),
    (_turns(tool_result={"tool_use_id": 5}), "messages.2.content.0.tool_use_id"),
    (_turns(tool_result={"is_error": "yes"}), "messages.2.content.0.is_error"),
    (_turns(tool_result={"tool_use_id": "toolu_2"}), "messages.2.content.0.tool_use_id"),
    ([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "x"}]}],
     "messages.0.content.0.tool_use_id"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": [{"type": "redacted_thinking",
                                                                          "data": 5}]}],
     "messages.1.content.0.data"),
]
FIELD_400 = [  # (route, body, the path the 400 names)
    *[(route, {"model": "m", "messages": msgs, **({"max_tokens": 2} if route == "/v1/messages" else {})},
       path) for msgs, path in ANTHROPIC_TYPES for route in ("/v1/messages", "/v1/messages/count_tokens")],
    (*_items({"role": "user", "content": 5}), "input.0.content"),
    (*_items(CALL, {"type": "function_call_output", "call_id": "c1", "output": 5}), "input.1.output"),
    (*_items({**REASONING, "encrypted_content": 12345}, {"role": "user", "content": "x"}),
     "input.0.encrypted_content"),
    (*_items({**REASONING, "content": [{"type": "reasoning_text", "text": 5}]}), "input.0.content.0.text"),
    (*_items({**CALL, "call_id": 5}), "input.0.call_id"),
    (*_items({**CALL, "arguments": {"city": "Paris"}}), "input.0.arguments"),
    (*_items({"type": "function_call_output", "call_id": 5, "output": "x"}), "input.0.call_id"),
    (*_resp(input=[]), "input"),
    (*_resp(tools=[{"type": "function", "name": "w", "parameters": "{}"}]), "tools.0.parameters"),
    (*_resp(tools=[{"type": "function", "name": 5}]), "tools.0.name"),  # was "got type 'function'"
    (*_resp(tools=[{"type": "function", "function": {"name": "w"}}]), "tools.0.name"),  # the chat shape
    (*_chat(logit_bias={" 5": 1}), "logit_bias"),
    (*_chat(logit_bias={"1_0": 1}), "logit_bias"),
    (*_cmpl(logit_bias={"+5": 1}), "logit_bias"),
    (*_chat(top_k=10**9), "top_k"),
    (*_cmpl(top_k=10**9), "top_k"),
    (*_msgs(top_k=10**9), "top_k"),
    (*_chat(repetition_penalty=100.5), "repetition_penalty"),
    (*_cmpl(repetition_penalty=1000), "repetition_penalty"),
    (*_chat(stop="\ud800"), "stop"),
    (*_cmpl(stop=["ok", "a\udfffb"]), "stop"),
    (*_msgs(stop_sequences=["\ud800"]), "stop_sequences"),
    # count_tokens refuses a tool choice /v1/messages refuses (it counted it, 200)
    ("/v1/messages/count_tokens", {"model": "m", "messages": MESSAGES,
                                   "tool_choice": {"type": "tool", "name": "x"},
                                   "tools": [{"name": "w", "input_schema": {"type": "object"}}]},
     "tool_choice"),
    ("/v1/messages/count_tokens", {"model": "m", "messages": MESSAGES, "tool_choice": {"type": "tool"},
                                   "tools": [{"name": "w", "input_schema": {"type": "object"}}]},
     "tool_choice.name"),
    ("/v1/messages/count_tokens", {"model": "m", "messages": MESSAGES, "tool_choice": {"type": "any"},
                                   "tools": [{"name": "w", "input_schema": {"type": "object", "properties": {
                                       "s": {"type": "string", "pattern": "(("}}}}]},
     "tool 'w' parameter 's'"),
]


@pytest.mark.parametrize("route, body, path", FIELD_400)
def test_mistyped_or_inconsistent_field_is_400_naming_its_path(served, route, body, path):
    client, llm = served
    before = llm.engine.added
    # ensure_ascii: a lone surrogate travels as a \ud800 escape, as a client's JSON encoder writes it
    r = client.post(route, content=json.dumps(body), headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    message, param = _error(route, r)
    assert message.startswith(path) or f"{path}:" in message or f"{path}=" in message, (path, message)
    assert param in (None, path), (param, path)
    assert llm.engine.added == before


@pytest.mark.parametrize("route, body", [
    _chat(logit_bias={"5": 1}, repetition_penalty=100, top_k=1),
    _msgs(messages=_turns(tool_result={"is_error": True, "content": [{"type": "text", "text": "x"}]})),
    _items(REASONING, CALL, {"type": "function_call_output", "call_id": "c1", "output": "sunny"}),
])
def test_the_valid_forms_are_accepted(served, route, body):
    client, _ = served
    assert client.post(route, json=body).status_code == 200


UNPARSABLE = [  # (route, raw body, words the message must contain): bodies Python's json cannot parse
    ("/v1/chat/completions", b'{"messages": [], "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
     "nested too deeply"),
    ("/v1/messages", b'{"model": "m", "max_tokens": 2, "messages": [], "tools": [' + b'{"a": ' * 5_000
     + b"1" + b"}" * 5_000 + b"]}", "nested too deeply"),
    ("/v1/completions", b'{"prompt": "Hi", "seed": ' + b"9" * 5_000 + b"}", "4300 digits"),
    ("/v1/responses", b'{"input": "Hi", "ignored": ' + b"9" * 5_000 + b"}", "4300 digits"),
]


@pytest.mark.parametrize("route, raw, words", UNPARSABLE)
def test_body_beyond_the_json_parsers_limits_is_400_naming_the_limit(served, route, raw, words):
    """A body nested beyond the recursion limit or with an integer beyond Python's digit limit was
    answered FastAPI's bare "There was an error parsing the body"; the message must name the limit."""
    client, llm = served
    before = llm.engine.added
    r = client.post(route, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    message, _ = _error(route, r)
    assert words in message and "parser's limit" in message, message
    assert llm.engine.added == before


_MANY = [{"role": "user", "content": "Hi"}] * (MAX_MESSAGES + 1)
TOO_MANY_MESSAGES = [  # (route, body, the field)
    (*_chat(messages=_MANY), "messages"),
    (*_msgs(messages=_MANY), "messages"),
    (*_resp(input=_MANY), "input"),
    ("/tokenize", {"messages": _MANY}, "messages"),
]


@pytest.mark.parametrize("route, body, field", TOO_MANY_MESSAGES)
def test_more_messages_than_the_limit_is_400_naming_field_and_limit(served, route, body, field):
    """A conversation of more than MAX_MESSAGES messages is refused while the body is validated (before,
    it was rendered in full, seconds of work, before the context check refused it)."""
    client, llm = served
    r = client.post(route, json=body)
    assert r.status_code == 400, r.text
    message, _ = _error(route, r)
    assert field in message and f"at most {MAX_MESSAGES} items" in message, message


_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
TOO_MANY_TOOLS = [  # (route, body)
    _chat(tools=[_TOOL] * (MAX_TOOLS + 1)),
    _msgs(tools=[{"name": "f", "input_schema": {"type": "object"}}] * (MAX_TOOLS + 1)),
    _resp(tools=[{"type": "function", "name": "f", "parameters": {"type": "object"}}] * (MAX_TOOLS + 1)),
    ("/tokenize", {"messages": MESSAGES, "tools": [_TOOL] * (MAX_TOOLS + 1)}),
]


@pytest.mark.parametrize("route, body", TOO_MANY_TOOLS)
def test_more_tools_than_the_limit_is_400_naming_field_and_limit(served, route, body):
    """More than MAX_TOOLS tools is refused while the body is validated (before, every tool was
    validated and rendered, seconds of work, before the context check refused the prompt)."""
    client, llm = served
    r = client.post(route, json=body)
    assert r.status_code == 400, r.text
    message, _ = _error(route, r)
    assert "tools" in message and f"at most {MAX_TOOLS} items" in message, message


_HUGE = "x" * 1_000_000
ECHOING = [  # (route, body): errors whose message echoes a request value
    _chat(model=_HUGE),
    _msgs(model=_HUGE),
    _chat(reasoning_effort=_HUGE),
    _chat(logit_bias={_HUGE: "not a number"}),
    _resp(previous_response_id=_HUGE),
]


@pytest.mark.parametrize("route, body", ECHOING)
def test_error_echoing_a_huge_value_is_clipped(served, route, body, caplog):
    """An error message echoing a megabyte request value was a megabyte answer and a megabyte access-log
    line per request; message and param are now at most MAX_ERROR_CHARS characters (plus the note)."""
    client, llm = served
    with caplog.at_level("WARNING", logger="m2serve.access"):
        r = client.post(route, json=body)
    assert 400 <= r.status_code < 500, r.text
    err = r.json()["error"]
    message, param = err["message"], err.get("param")
    assert "characters cut" in message and len(message) < MAX_ERROR_CHARS + 100, len(message)
    assert param is None or len(param) < MAX_ERROR_CHARS + 100
    assert len(r.content) < 3 * MAX_ERROR_CHARS
    assert all(len(rec.getMessage()) < 3 * MAX_ERROR_CHARS for rec in caplog.records)
