"""Agent clients against tiny-chat in process (issue 26 items 2, 5, 6, 8): the official ``anthropic`` and
``openai`` SDKs over FastAPI's TestClient (an ``httpx.Client``), so the real wire shapes are checked
without a server process.

- Anthropic ``max_tokens`` is a cap clamped to the room left in the 4,096-token context (stop reason
  ``max_tokens`` when reached); the OpenAI routes keep vLLM's 400.
- ``tool_choice`` none: no tool-call syntax as text on any API (the model writes ``<invoke name=...``
  as text when only the tag is forbidden), and ``--exclude-tools-when-tool-choice-none``.
"""

from __future__ import annotations

import logging
import time

import anthropic
import openai
import pytest
from fastapi.testclient import TestClient

from m2serve.serve.api import ServerSettings, build_app
from m2serve.serve.async_engine import AsyncEngine
from m2serve.serve.cli import _make_llm, build_parser, resolve_options
from m2serve.serve.context import ResponseStore

MODEL = "tiny-chat"
QUESTION = "What's the weather in Paris?"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
DESCRIPTION = "Get the weather for a city"
CHAT_TOOL = {"type": "function",
             "function": {"name": "get_weather", "description": DESCRIPTION, "parameters": SCHEMA}}
ANTHROPIC_TOOL = {"name": "get_weather", "description": DESCRIPTION, "input_schema": SCHEMA}
RESPONSES_TOOL = {"type": "function", "name": "get_weather", "description": DESCRIPTION, "parameters": SCHEMA}


@pytest.fixture(scope="module")
def llm():
    parser = build_parser()
    argv = ["serve", "--dtype", "float32", "--kv-cache-page-size", "16", "--num-kv-pages", "512"]
    return _make_llm(resolve_options(parser.parse_args(argv), parser, {}))


@pytest.fixture(scope="module")
def http(llm):
    with TestClient(build_app(AsyncEngine(llm), ServerSettings(served_model_name=MODEL))) as client:
        yield client


@pytest.fixture(scope="module")
def claude(http):
    return anthropic.Anthropic(base_url=str(http.base_url), api_key="-", http_client=http, max_retries=0,
                               timeout=120)


@pytest.fixture(scope="module")
def oai(http):
    return openai.OpenAI(base_url=str(http.base_url) + "/v1", api_key="-", http_client=http, max_retries=0,
                               timeout=120)


# --------------------------------------------------------------------------- item 2: max_tokens


def _prompt_leaving(claude, max_length: int, room: int) -> tuple[str, int]:
    """A user prompt whose chat prompt leaves about ``room`` tokens of the context, and its token count."""
    def count(k: int) -> int:
        content = "Repeat after me: " + "sky " * k
        messages = [{"role": "user", "content": content}]
        return claude.messages.count_tokens(model=MODEL, messages=messages).input_tokens

    base, per = count(0), count(1) - count(0)
    k = (max_length - room - base) // per
    return "Repeat after me: " + "sky " * k, count(k)


@pytest.mark.parametrize("max_tokens", [16384, 128000])  # pydantic-ai's and LiteLLM's defaults
def test_anthropic_max_tokens_is_a_cap(claude, llm, caplog, max_tokens):
    prompt, n_prompt = _prompt_leaving(claude, llm.max_length, 6)
    room = llm.max_length - n_prompt
    assert 0 < room <= 8  # tiny-chat's reasoning alone is longer
    with caplog.at_level(logging.DEBUG, logger="m2serve.serve.chat_pipeline"):
        msg = claude.messages.create(model=MODEL, max_tokens=max_tokens, extra_body={"temperature": 0},
                                     messages=[{"role": "user", "content": prompt}])
    assert msg.stop_reason == "max_tokens"
    assert msg.usage.output_tokens == room
    assert [r.message for r in caplog.records if "clamped" in r.message] == [
        f"max_tokens {max_tokens} clamped to {room}: the prompt has {n_prompt} tokens of the "
        f"{llm.max_length}-token context"]
    # streamed: the same cap, and the SDK's accumulator ends with the same stop reason
    with claude.messages.stream(model=MODEL, max_tokens=max_tokens, extra_body={"temperature": 0},
                                messages=[{"role": "user", "content": prompt}]) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == room


def test_anthropic_short_answer_under_a_large_cap(claude):
    msg = claude.messages.create(model=MODEL, max_tokens=128000, extra_body={"temperature": 0},
                                 messages=[{"role": "user", "content": "Hello!"}])
    assert msg.stop_reason == "end_turn" and msg.content[-1].type == "text" and msg.content[-1].text


def test_openai_routes_keep_the_400(oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, max_tokens=16384,
                                    messages=[{"role": "user", "content": "Hi"}])
    assert e.value.body["param"] == "max_tokens" and "4096" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model=MODEL, max_output_tokens=128000, input="Hi")
    assert e.value.body["param"] == "max_output_tokens"


# --------------------------------------------------------------------------- item 5: tool_choice none


# MiniMax's tool-call syntax (docs/parsers.md §3), written out here rather than imported
TOOL_SYNTAX = ("minimax:tool_call", "<invoke", "</invoke>", "<parameter", "</parameter>")


def _no_tool_syntax(text: str | None) -> None:
    assert not any(t in (text or "") for t in TOOL_SYNTAX), text


def test_tool_choice_none_chat(oai):
    r = oai.chat.completions.create(model=MODEL, temperature=0, max_tokens=64, tools=[CHAT_TOOL],
                                    tool_choice="none", messages=[{"role": "user", "content": QUESTION}])
    m = r.choices[0].message
    assert not m.tool_calls
    _no_tool_syntax(m.content)
    # streamed: the same text, still without the syntax
    chunks = oai.chat.completions.create(model=MODEL, temperature=0, max_tokens=64, tools=[CHAT_TOOL],
                                         tool_choice="none", stream=True,
                                         messages=[{"role": "user", "content": QUESTION}])
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == (m.content or "")


def test_tool_choice_none_anthropic(claude):
    msg = claude.messages.create(model=MODEL, max_tokens=64, extra_body={"temperature": 0},
                                 tools=[ANTHROPIC_TOOL], tool_choice={"type": "none"},
                                 messages=[{"role": "user", "content": QUESTION}])
    assert [b.type for b in msg.content if b.type == "tool_use"] == []
    for b in msg.content:
        if b.type == "text":
            _no_tool_syntax(b.text)


def test_tool_choice_none_responses(oai):
    r = oai.responses.create(model=MODEL, input=QUESTION, tools=[RESPONSES_TOOL], tool_choice="none",
                             temperature=0, max_output_tokens=64)
    assert [o.type for o in r.output if o.type == "function_call"] == []
    _no_tool_syntax(r.output_text)


def test_exclude_tools_when_tool_choice_none(http):
    body = {"model": MODEL, "max_tokens": 1, "temperature": 0, "tools": [CHAT_TOOL], "tool_choice": "none",
            "messages": [{"role": "user", "content": QUESTION}]}
    bare = {k: v for k, v in body.items() if k not in ("tools", "tool_choice")}
    settings = http.app.state.ctx.settings  # the flag's setting (m2serve serve sets it from the CLI)
    usage = {}
    try:
        for exclude in (False, True):
            settings.exclude_tools_when_tool_choice_none = exclude
            usage[exclude] = http.post("/v1/chat/completions", json=body).json()["usage"]["prompt_tokens"]
    finally:
        settings.exclude_tools_when_tool_choice_none = False
    usage["bare"] = http.post("/v1/chat/completions", json=bare).json()["usage"]["prompt_tokens"]
    assert usage[True] == usage["bare"] < usage[False]  # the tools' text left the prompt


# --------------------------------------------------------------------------- item 8: routes


def test_retrieve_model(oai, llm):
    card = oai.models.retrieve(MODEL)
    assert (card.id, card.object) == (MODEL, "model")
    assert card.model_extra["max_model_len"] == llm.max_length
    with pytest.raises(openai.NotFoundError) as e:
        oai.models.retrieve("no-such-model")
    assert e.value.body["code"] == "model_not_found" and MODEL in e.value.body["message"]


def test_response_input_items(oai):
    first = oai.responses.create(model=MODEL, input="Hello!", temperature=0, max_output_tokens=4)
    page = oai.responses.input_items.list(first.id)
    listed = [(i.type, i.role, [c.text for c in i.content]) for i in page.data]
    assert listed == [("message", "user", ["Hello!"])]
    items = [{"type": "message", "role": "user", "content": "Hi"},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Bye"}]}]
    r = oai.responses.create(model=MODEL, input=items, previous_response_id=first.id, temperature=0,
                             max_output_tokens=4)
    newest_first = oai.responses.input_items.list(r.id).data
    texts = [i.content[0].text for i in newest_first]
    assert texts == ["Bye", "Hello.", "Hi"]  # this request's items only, OpenAI's default order desc
    asc = oai.responses.input_items.list(r.id, order="asc", limit=2)
    assert [i.content[0].text for i in asc.data] == ["Hi", "Hello."] and asc.has_more
    rest = oai.responses.input_items.list(r.id, order="asc", after=asc.data[-1].id)
    assert [i.content[0].text for i in rest.data] == ["Bye"] and not rest.has_more
    assert len({i.id for i in newest_first}) == 3
    with pytest.raises(openai.NotFoundError):
        oai.responses.input_items.list("resp_unknown")
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.input_items.list(r.id, limit=0)
    assert e.value.body["param"] == "limit"


# --------------------------------------------------------------------------- item 6: grammar cost


def test_oversized_grammar_inputs_are_a_fast_400(oai, claude):
    t0 = time.monotonic()
    with pytest.raises(openai.BadRequestError) as e:
        choices = [str(i) for i in range(100_000)]
        oai.chat.completions.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "Pick"}],
                                    extra_body={"structured_outputs": {"choice": choices}})
    assert e.value.body["param"] == "structured_outputs.choice"
    assert e.value.body["message"] == "structured_outputs.choice: 100000 choices, more than the limit of 1024"
    schema = {"type": "object", "properties": {"city": {"enum": [f"city {i}" for i in range(5000)]}}}
    with pytest.raises(anthropic.BadRequestError) as e:
        fmt = {"type": "json_schema", "schema": schema}
        claude.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "Pick"}],
                               extra_body={"output_config": {"format": fmt}})
    assert e.value.body["error"]["message"] == ("output_config.format: an enum of 5000 values, more than the "
                                                "limit of 1024")
    big = "start: " + " | ".join(f'"w{i:06d}"' for i in range(40_000))
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=MODEL, prompt="Pick", max_tokens=4,
                               extra_body={"structured_outputs": {"grammar": big}})
    assert e.value.body["param"] == "structured_outputs.grammar"
    assert "more than the limit of 262144 bytes" in e.value.body["message"]
    assert time.monotonic() - t0 < 20


def test_response_store_is_bounded_in_bytes():
    store = ResponseStore(size=100, max_bytes=1000)
    for i in range(10):
        store.put(f"r{i}", {"text": "x" * 200})  # 212 bytes of JSON each: {"text": "x..."}
    assert list(store.items) == ["r6", "r7", "r8", "r9"] and store.num_bytes == 4 * 212
    assert store.pop("r9") == {"text": "x" * 200} and store.num_bytes == 3 * 212
    store.put("big", {"text": "y" * 5000})  # alone larger than the budget: kept, the rest evicted
    assert list(store.items) == ["big"] and store.get("big") is not None
    by_count = ResponseStore(size=2, max_bytes=10**6)
    for i in range(3):
        by_count.put(f"r{i}", {"i": i})
    assert list(by_count.items) == ["r1", "r2"]


# --------------------------------------------------------------------------- item 8: reasoning cap


def test_tiny_chat_reasoning_cap_ends_an_open_ended_reasoning(oai, claude, llm, caplog):
    # "Is it sunny in Paris?" with no tools: tiny-chat's greedy reasoning never closes (it writes spaces);
    # its generation_config.json caps reasoning at 128 tokens, so the request ends there with length
    import json

    from m2serve.serve.resolve import resolve_model

    gen = json.loads((resolve_model(None) / "generation_config.json").read_text())
    assert gen["max_reasoning_tokens"] == llm.config.generation.max_reasoning_tokens == 128
    with caplog.at_level(logging.INFO, logger="m2serve.engine.scheduler"):
        r = oai.chat.completions.create(model=MODEL, temperature=0, max_tokens=1000,
                                        messages=[{"role": "user", "content": "Is it sunny in Paris?"}])
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == r.usage.completion_tokens_details.reasoning_tokens == 128
    assert any("max_reasoning_tokens=128" in rec.message for rec in caplog.records)
    # an explicit budget replaces the cap: the reasoning runs past 128 tokens to the budget
    msg = claude.messages.create(model=MODEL, max_tokens=160, extra_body={"temperature": 0},
                                 thinking={"type": "enabled", "budget_tokens": 150},
                                 messages=[{"role": "user", "content": "Is it sunny in Paris?"}])
    assert (msg.stop_reason, msg.usage.output_tokens) == ("max_tokens", 160)
    assert [b.type for b in msg.content][0] == "thinking"


def test_claude_codes_thinking_budget_beyond_the_context_is_a_cap(claude):
    # Claude Code asks max_tokens 32000 with thinking.budget_tokens 31999; on a shorter context both are
    # caps clamped to it (the budget was a 400 naming it while max_tokens was clamped)
    msg = claude.messages.create(model=MODEL, max_tokens=32000,
                                 thinking={"type": "enabled", "budget_tokens": 31999},
                                 messages=[{"role": "user", "content": "What's the weather in Paris?"}],
                                 tools=[{"name": "get_weather", "description": "Get the weather for a city",
                                         "input_schema": {"type": "object", "required": ["city"],
                                                          "properties": {"city": {"type": "string"}}}}])
    assert msg.stop_reason == "tool_use" and [b.type for b in msg.content] == ["thinking", "tool_use"]
    with pytest.raises(anthropic.BadRequestError):   # the field's own bound stays a 400
        claude.messages.create(model=MODEL, max_tokens=8, thinking={"type": "enabled", "budget_tokens": 0},
                               messages=[{"role": "user", "content": "hi"}])


def test_readme_structured_outputs_example(oai):
    # the README's example, as written there (issue 26 item 8: an example tiny-chat can do)
    from typing import Literal

    from pydantic import BaseModel

    class Route(BaseModel):
        tool: Literal["get_weather", "get_time", "send_email"]

    got = []
    questions = ["What's the weather in Paris?", "What time is it in Tokyo?",
                 "Send an email to Bob saying hi."]
    for question in questions:
        r = oai.chat.completions.parse(model=MODEL, response_format=Route, temperature=0, max_tokens=128,
                                       messages=[{"role": "user", "content": question}])
        got.append(str(r.choices[0].message.parsed))
    assert got == ["tool='get_weather'", "tool='get_time'", "tool='send_email'"]
