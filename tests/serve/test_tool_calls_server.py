"""Reasoning and two tool calls through the real server (issue 5 "Must show", docs/parsers.md §3).

The server process is tests/serve/replay_server.py (TEST-ONLY): the real ``m2serve serve`` whose model
replays REPLAY below after the generation prompt. Checked streamed and non-streamed with the openai
client: reasoning_content deltas, per index one first delta with id + name, arguments that parse to
the expected objects, finish_reason "tool_calls", and the same message both ways. The second call cut
by the token limit goes through Chat Completions, Anthropic Messages and Responses, streamed and not,
with the openai and anthropic SDK clients (issue 26 item 3, docs/serving.md §10.1).
"""

from __future__ import annotations

import json
import re
import sys

import anthropic
import openai
import pytest
from serve_helpers import FAST_ENGINE_FLAGS, HERE, metric, start_server

pytestmark = pytest.mark.slow  # starts server processes

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


# --------------------------------------------------------------------------- a call cut by the limit

ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]
RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


@pytest.fixture(scope="module")
def cut(tokenizer):
    """(max_tokens, raw): a limit that stops the replay one token into the value of the second call
    (get_time: its name, so its header, is complete), and that call's raw text from its ``<invoke``
    (P18), hand-derived from the replayed tokens."""
    ids = tokenizer.encode(REPLAY)
    k = next(k for k in range(len(ids)) if 'name="timezone">' in tokenizer.decode(ids[:k])) + 1
    text = tokenizer.decode(ids[:k])
    raw = text[text.index('<invoke name="get_time">'):]
    assert "</invoke>" not in raw and raw in REPLAY and raw.index('"timezone">') < len(raw) - 11
    return k, raw


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def test_cut_call_chat_completions(client, cut):
    # not streamed: the cut call is content (P18), only the closed call is a call, finish_reason length
    limit, raw = cut
    kw = dict(model="replay", messages=MESSAGES, tools=TOOLS, max_tokens=limit)
    c = client.chat.completions.create(**kw).choices[0]
    assert c.finish_reason == "length" and c.message.content == raw
    assert [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls] == EXPECTED[:1]
    # streamed: the cut call's header went out (P23) and stays; its raw text follows as content (P26)
    content, names, args, finish = [], {}, {}, None
    for chunk in client.chat.completions.create(**kw, stream=True):
        d = chunk.choices[0].delta
        content.append(d.content or "")
        for tc in d.tool_calls or []:
            names.setdefault(tc.index, tc.function.name)
            args[tc.index] = args.get(tc.index, "") + (tc.function.arguments or "")
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "length" and "".join(content) == raw
    assert names == {0: "get_weather", 1: "get_time"} and json.loads(args[0]) == EXPECTED[0][1]
    assert args[1].startswith('{"timezone": "') and not args[1].endswith("}")


def test_cut_call_anthropic_messages(claude, cut):
    # not streamed: a text block with the raw text, never a tool_use with input {}; stop_reason max_tokens
    limit, raw = cut
    kw = dict(model="replay", max_tokens=limit, messages=MESSAGES, tools=ANTHROPIC_TOOLS)
    msg = claude.messages.create(**kw)
    assert msg.stop_reason == "max_tokens"
    assert [b.type for b in msg.content] == ["thinking", "tool_use", "text"]
    assert (msg.content[1].name, msg.content[1].input) == EXPECTED[0] and msg.content[2].text == raw
    # streamed: the cut call's tool_use block had started; it stops as it stands and the raw text
    # follows as a text block (the SDK's own accumulator), with the same stop reason
    with claude.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "max_tokens"
    assert [b.type for b in final.content] == ["thinking", "tool_use", "tool_use", "text"]
    assert final.content[0].thinking == msg.content[0].thinking == REASONING
    assert (final.content[1].name, final.content[1].input) == EXPECTED[0]
    assert final.content[2].name == "get_time" and final.content[3].text == raw


def test_cut_call_responses(client, cut):
    # not streamed: a message item with the raw text, never a function_call with truncated arguments
    limit, raw = cut
    kw = dict(model="replay", input=MESSAGES, tools=RESPONSES_TOOLS, max_output_tokens=limit)
    r = client.responses.create(**kw)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert [(o.type, o.status) for o in r.output] == [
        ("reasoning", "completed"), ("function_call", "completed"), ("message", "incomplete")]
    assert (r.output[1].name, json.loads(r.output[1].arguments)) == EXPECTED[0] and r.output_text == raw
    # streamed: the cut call's item had been added; it ends with status incomplete (no
    # function_call_arguments.done), the raw text follows as a message, and response.incomplete lists
    # exactly the items the stream finished
    events = list(client.responses.create(**kw, stream=True))
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(o.type, o.status) for o in done] == [
        ("reasoning", "completed"), ("function_call", "completed"), ("function_call", "incomplete"),
        ("message", "incomplete")]
    assert done[2].name == "get_time" and done[3].content[0].text == raw
    assert [e.type for e in events].count("response.function_call_arguments.done") == 1
    final = events[-1]
    assert final.type == "response.incomplete" and final.response.output == done
    # the stored history keeps the closed call only: the conversation continues from it
    result = {"type": "function_call_output", "call_id": done[1].call_id, "output": "sunny"}
    follow = client.responses.create(model="replay", previous_response_id=final.response.id, input=[result],
                                  tools=RESPONSES_TOOLS, max_output_tokens=limit)
    assert follow.status == "incomplete" and follow.previous_response_id == final.response.id
