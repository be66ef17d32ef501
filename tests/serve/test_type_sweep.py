"""Type sweep (issue 26 item 4): no mistyped field may cost a 5xx, on any API.

A valid multi-turn request per API (chat with tools, tool calls and tool results; Anthropic Messages
with thinking, tool_use and tool_result blocks; Responses with reasoning, function_call and
function_call_output items; completions) has each of its field paths (every key of every object and
every item of every list, at any depth) replaced in turn by each of ``5, 1.5, true, null, [], {}, "s",
[1], {"a": 1}`` (``stream: true`` among them, so the streamed path runs too). Every answer must be
below 500, a stream must carry no error event, and every 4xx must be in the error shape of the API
called (OpenAI's ``{"error": {...}}``, Anthropic's ``{"type": "error", "error": {...}}``). In-process
(FastAPI's TestClient) on the tiny random model, max_tokens 1, so the requests that are valid run for
real in a few milliseconds each.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from m2serve.serve.api import ServerSettings, build_app
from m2serve.serve.async_engine import AsyncEngine
from m2serve.serve.cli import _make_llm, build_parser, resolve_options

pytestmark = pytest.mark.slow  # 2,052 requests: 30 to 90 s on the shared 2-core box

VALUES: list[Any] = [5, 1.5, True, None, [], {}, "s", [1], {"a": 1}]

WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}

CHAT = {
    "model": "m",
    "max_tokens": 1,
    "stream": False,
    "temperature": 0.5,
    "top_p": 0.9,
    "stop": ["\n\n"],
    "logit_bias": {"5": 1.0},
    "seed": 1,
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
        {"role": "assistant", "content": None, "reasoning_content": "Call the tool.",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "user", "content": "Thanks"},
    ],
    "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                                "parameters": WEATHER_SCHEMA}}],
    "tool_choice": "auto",
}

MESSAGES = {
    "model": "m",
    "max_tokens": 1,
    "stream": False,
    "system": [{"type": "text", "text": "Be brief."}],
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Call the tool.", "signature": "sig"},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}],
             "is_error": False},
            {"type": "text", "text": "Thanks"},
        ]},
    ],
    "tools": [{"name": "get_weather", "description": "Weather of a city.", "input_schema": WEATHER_SCHEMA}],
    "tool_choice": {"type": "auto"},
    "thinking": {"type": "enabled", "budget_tokens": 64},
    "stop_sequences": ["\n\n"],
    "temperature": 0.5,
}

RESPONSES = {
    "model": "m",
    "max_output_tokens": 1,
    "stream": False,
    "instructions": "Be brief.",
    "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "Call it."}],
         "content": [{"type": "reasoning_text", "text": "Call the tool."}], "encrypted_content": "x"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": "{\"city\": \"P\"}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "message", "role": "user", "content": "Thanks"},
    ],
    "tools": [{"type": "function", "name": "get_weather", "description": "Weather of a city.",
               "parameters": WEATHER_SCHEMA}],
    "tool_choice": "auto",
    "temperature": 0.5,
    "store": False,
}

COMPLETIONS = {"model": "m", "prompt": ["Hello", "Hi"], "max_tokens": 1, "stop": ["\n"],
               "logit_bias": {"5": 1}, "temperature": 0.5}

CASES = [
    ("/v1/chat/completions", CHAT),
    ("/v1/messages", MESSAGES),
    ("/v1/messages/count_tokens", {k: v for k, v in MESSAGES.items()
                                   if k not in ("max_tokens", "stop_sequences", "temperature", "stream")}),
    ("/v1/responses", RESPONSES),
    ("/v1/completions", COMPLETIONS),
]


def paths(node: Any, prefix: tuple = ()) -> Iterator[tuple]:
    """Every key / index path below ``node`` (a JSON value), parents before children."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for k, v in items:
        yield (*prefix, k)
        yield from paths(v, (*prefix, k))


def replaced(body: dict, path: tuple, value: Any) -> dict:
    out = copy.deepcopy(body)
    node = out
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = copy.deepcopy(value)
    return out


@pytest.fixture(scope="module")
def client(tiny_random_dir):
    parser = build_parser()
    argv = ["serve", "--model", str(tiny_random_dir), "--dtype", "float32", "--num-kv-pages", "128",
            "--kv-cache-page-size", "16", "--log-level", "error"]
    llm = _make_llm(resolve_options(parser.parse_args(argv), parser, {}))
    app = build_app(AsyncEngine(llm), ServerSettings(served_model_name="m"))
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def _in_shape(route: str, body: Any) -> bool:
    if route.startswith("/v1/messages"):
        err = body.get("error") if isinstance(body, dict) else None
        return (body.get("type") == "error" and isinstance(err, dict) and isinstance(err.get("message"), str)
                and isinstance(err.get("type"), str))
    err = body.get("error") if isinstance(body, dict) else None
    return isinstance(err, dict) and isinstance(err.get("message"), str) and "param" in err


@pytest.mark.parametrize("route, body", CASES, ids=[r for r, _ in CASES])
def test_no_5xx_for_any_mistyped_field(client, route, body):
    ok = client.post(route, json=body)
    assert ok.status_code == 200, ok.text  # the unmodified request is valid
    failures = []
    for path in paths(body):
        for value in VALUES:
            r = client.post(route, json=replaced(body, path, value))
            where = ".".join(map(str, path)) + " = " + json.dumps(value)
            if r.status_code >= 500:
                failures.append(f"{where}: {r.status_code} {r.text[:200]}")
            elif r.headers.get("content-type", "").startswith("text/event-stream") and (
                    "event: error" in r.text or '"error": {' in r.text):
                failures.append(f"{where}: the stream carries an error: {r.text[-300:]}")
            elif r.status_code >= 400 and not _in_shape(route, r.json()):
                failures.append(f"{where}: {r.status_code} not in the API's error shape: {r.text[:200]}")
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures)
