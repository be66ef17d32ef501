"""Reasoning and two tool calls through the real server (issue 5 "Must show", chat-and-parsers.md §3).

The server process is tests/serve/replay_server.py (TEST-ONLY): the real ``m2serve serve`` whose model
replays REPLAY below after the generation prompt. Checked streamed and non-streamed with the openai
client: reasoning_content deltas, per index one first delta with id + name, arguments that parse to
the expected objects, finish_reason "tool_calls", and the same message both ways.
"""

from __future__ import annotations

import json
import re
import sys

import openai
import pytest
from serve_helpers import FAST_ENGINE_FLAGS, HERE, metric, start_server

REASONING = "The user wants the weather and the local time in Paris."
REPLAY = (
    REASONING + "\n</think>\n\n<minimax:tool_call>\n"
    '<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
    '<parameter name="days">3</parameter>\n</invoke>\n'
    '<invoke name="get_time">\n<parameter name="timezone">Europe/Paris</parameter>\n</invoke>\n'
    "</minimax:tool_call>"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather forecast",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Local time",
            "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}},
        },
    },
]
EXPECTED = [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"timezone": "Europe/Paris"})]
MESSAGES = [{"role": "user", "content": "What's the weather and the time in Paris?"}]


@pytest.fixture(scope="module")
def server(tiny_random_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("replay")
    replay_file = tmp / "replay.txt"
    replay_file.write_text(REPLAY, encoding="utf-8")
    s = start_server(
        [
            "--model",
            str(tiny_random_dir),
            "--served-model-name",
            "replay",
            *FAST_ENGINE_FLAGS,
            "--kv-cache-format",
            "float32",
        ],
        tmp,
        entry=[sys.executable, str(HERE / "replay_server.py"), str(replay_file)],
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_nonstream_reasoning_and_two_tool_calls(client, server):
    before = server.metrics()
    r = client.chat.completions.create(model="replay", messages=MESSAGES, tools=TOOLS, max_tokens=400)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls"  # P19
    assert c.message.reasoning_content == REASONING  # P6: newline before </think> dropped
    assert not c.message.content  # only whitespace between </think> and the block (P4, P12)
    calls = c.message.tool_calls
    assert [(t.function.name, json.loads(t.function.arguments)) for t in calls] == EXPECTED  # P16 typing
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", t.id) and t.type == "function" for t in calls)  # P17
    assert r.usage.completion_tokens_details.reasoning_tokens > 0
    assert r.usage.completion_tokens_details.reasoning_tokens < r.usage.completion_tokens
    after = server.metrics()
    assert metric(after, "m2serve_parser_errors_total") == metric(before, "m2serve_parser_errors_total")


def test_stream_matches_nonstream(client):
    ns = client.chat.completions.create(model="replay", messages=MESSAGES, tools=TOOLS, max_tokens=400)
    reasoning, content, finish = [], [], None
    first: dict[int, list] = {}
    args: dict[int, list[str]] = {}
    for chunk in client.chat.completions.create(
        model="replay", messages=MESSAGES, tools=TOOLS, max_tokens=400, stream=True
    ):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        r_delta = getattr(d, "reasoning_content", None)
        assert not (r_delta and d.content), "P25: a chunk mixes reasoning and content"
        reasoning.append(r_delta or "")
        content.append(d.content or "")
        for tc in d.tool_calls or []:
            if tc.id is not None:  # P23: exactly one first delta per index, with id, type and name
                assert tc.index not in first
                assert tc.type == "function" and tc.function.name and tc.function.arguments == ""
                first[tc.index] = [tc.id, tc.function.name]
            else:
                assert tc.index in first and tc.function.name is None
            args.setdefault(tc.index, []).append(tc.function.arguments or "")
        finish = chunk.choices[0].finish_reason or finish
    assert len([x for x in reasoning if x]) >= 2  # reasoning arrived as several deltas
    assert "".join(reasoning) == ns.choices[0].message.reasoning_content
    assert ("".join(content) or None) == (ns.choices[0].message.content or None)
    assert finish == "tool_calls"
    streamed = [(first[i][1], "".join(args[i])) for i in sorted(first)]
    assert streamed == [
        (t.function.name, t.function.arguments) for t in ns.choices[0].message.tool_calls
    ]  # P24
    assert [(n, json.loads(a)) for n, a in streamed] == EXPECTED


def test_undeclared_tool_rejected_and_counted(client, server):
    # P13: with only get_time declared, get_weather is not returned and is counted
    before = server.metrics()
    r = client.chat.completions.create(model="replay", messages=MESSAGES, tools=TOOLS[1:], max_tokens=400)
    calls = r.choices[0].message.tool_calls
    assert [(t.function.name, json.loads(t.function.arguments)) for t in calls] == EXPECTED[1:]
    after = server.metrics()
    key = "m2serve_tool_calls_rejected_total"
    assert metric(after, key, reason="undeclared") - metric(before, key, reason="undeclared") == 1


def test_tool_choice_none_and_passthrough(client):
    # §3: tool_choice "none" disables tool parsing, and (issue 20) the tool-call tag can never be
    # generated: the replayed tag token is masked, so no block opens; reasoning_split=false = P7 passthrough
    r = client.chat.completions.create(
        model="replay", messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=400
    )
    m = r.choices[0].message
    assert not m.tool_calls and r.choices[0].finish_reason == "stop"
    assert m.reasoning_content == REASONING and "<minimax:tool_call>" not in (m.content or "")
    r = client.chat.completions.create(
        model="replay", messages=MESSAGES, max_tokens=400, extra_body={"reasoning_split": False}
    )
    m = r.choices[0].message
    assert getattr(m, "reasoning_content", None) is None
    assert m.content == "<think>" + REPLAY


def test_parallel_tool_calls_false_returns_first_call_only(client):
    kw = dict(model="replay", messages=MESSAGES, tools=TOOLS, max_tokens=400, parallel_tool_calls=False)
    r = client.chat.completions.create(**kw)
    calls = r.choices[0].message.tool_calls
    assert [(t.function.name, json.loads(t.function.arguments)) for t in calls] == EXPECTED[:1]
    streamed = {
        tc.index
        for ch in client.chat.completions.create(**kw, stream=True)
        if ch.choices
        for tc in ch.choices[0].delta.tool_calls or []
    }
    assert streamed == {0}
