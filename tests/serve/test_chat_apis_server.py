"""Anthropic Messages and OpenAI Responses end to end on the real ``m2serve serve`` process with tiny-chat,
driven by the official ``anthropic``, ``openai`` and OpenAI Agents SDKs (issue 19 "Must show").

One server for the module (tiny-chat, fp32, an API key, INFO logs for the access-log test). Assertions
are on structure (a get_weather call whose city is Paris, an answer containing the tool's value), not on
exact text, so retraining the model cannot break them. The streamed events are assembled by each SDK's
own accumulator and compared with the non-streamed result.
"""

from __future__ import annotations

import asyncio
import json
import re

import agents
import anthropic
import httpx
import openai
import pytest
from serve_helpers import FAST_ENGINE_FLAGS, start_server

from m2serve.serve.resolve import resolve_model

pytestmark = pytest.mark.slow  # starts server processes

API_KEY = "chat-apis-key"
MODEL = "tiny-chat"
QUESTION = "What's the weather in Paris?"
RESULT = "cloudy, 18 C"
TOOL_RESULT = json.dumps({"result": RESULT})  # the result shape tiny-chat was trained on
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
BAD_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "pattern": "("}}}  # bad regex
DESCRIPTION = "Get the weather for a city"
CHAT_TOOL = {"type": "function",
             "function": {"name": "get_weather", "description": DESCRIPTION, "parameters": SCHEMA}}
ANTHROPIC_TOOL = {"name": "get_weather", "description": DESCRIPTION, "input_schema": SCHEMA}
RESPONSES_TOOL = {"type": "function", "name": "get_weather", "description": DESCRIPTION, "parameters": SCHEMA}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    flags = [f for f in FAST_ENGINE_FLAGS if f not in ("--log-level", "warning")]
    s = start_server(
        ["--model", str(resolve_model(None)), "--served-model-name", MODEL, "--api-key", API_KEY,
         "--thinking-signing-key", "test-signing-key", *flags, "--log-level", "info"],
        tmp_path_factory.mktemp("chat-apis"),
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _without_ids(message: dict) -> dict:
    """A message dict with its random ids (message, tool_use) blanked."""
    m = json.loads(json.dumps(message))
    m["id"] = None
    for b in m["content"]:
        if b["type"] == "tool_use":
            b["id"] = None
    return m


def _weather_call(blocks) -> anthropic.types.ToolUseBlock:
    calls = [b for b in blocks if b.type == "tool_use"]
    assert [(c.name, c.input) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert re.fullmatch(r"toolu_[0-9a-f]{24}", calls[0].id)
    return calls[0]


# --------------------------------------------------------------------------- Anthropic Messages


def test_messages_tool_use_stream_assembles_to_the_same_message(claude):
    # issue 19 item 2: thinking block (signed), tool_use with input as an object, stop_reason tool_use;
    # client.messages.stream's own accumulator assembles the events to the non-streamed message
    kwargs = dict(model=MODEL, max_tokens=160, messages=[{"role": "user", "content": QUESTION}],
                  tools=[ANTHROPIC_TOOL])
    msg = claude.messages.create(**kwargs)
    assert msg.stop_reason == "tool_use" and msg.role == "assistant" and msg.type == "message"
    thinking = [b for b in msg.content if b.type == "thinking"]
    assert len(thinking) == 1 and thinking[0].thinking.strip() and thinking[0].signature
    assert msg.content[0].type == "thinking"
    _weather_call(msg.content)
    assert msg.usage.input_tokens > 0 and msg.usage.output_tokens > 0
    with claude.messages.stream(**kwargs) as stream:
        kinds = {e.type for e in stream}
        final = stream.get_final_message()
    assert {"message_start", "content_block_start", "content_block_delta", "content_block_stop",
            "message_delta", "message_stop"} <= kinds
    # the same message; the usage differs only in how much of the prompt the cache served (the stream
    # came second, so its prompt's pages were cached)
    no_usage = {"usage"}
    assert _without_ids(final.model_dump(exclude=no_usage)) == _without_ids(msg.model_dump(exclude=no_usage))
    total = [u.input_tokens + u.cache_read_input_tokens for u in (final.usage, msg.usage)]
    assert total[0] == total[1] and final.usage.output_tokens == msg.usage.output_tokens


def test_a_streamed_message_reports_the_prefix_cache_as_the_non_streamed_one(claude):
    """A prompt whose pages are cached: the streamed message's usage (message_start, and the cumulative
    message_delta the SDK's accumulator keeps) splits it into input_tokens and cache_read_input_tokens
    as the non-streamed message does; message_start used to go out before the prefill and counted every
    prompt token as uncached input (Claude Code streams, so it saw no cache reads)."""
    system = "You answer questions about the weather. " * 40   # ~ 300 tokens: many whole 16-token pages
    kwargs = dict(model=MODEL, max_tokens=8, system=system, messages=[{"role": "user", "content": QUESTION}])
    claude.messages.create(**kwargs)   # the prompt's pages now cached
    plain = claude.messages.create(**kwargs).usage
    assert plain.cache_read_input_tokens > 0 and plain.input_tokens > 0
    with claude.messages.stream(**kwargs) as stream:
        start = next(e for e in stream if e.type == "message_start").message.usage
        final = stream.get_final_message().usage
    for usage in (start, final):
        assert (usage.input_tokens, usage.cache_read_input_tokens) == \
            (plain.input_tokens, plain.cache_read_input_tokens)
    assert final.output_tokens == plain.output_tokens


def test_messages_tool_result_loop_answers_with_the_value(claude, server):
    # tool_use -> tool_result -> answer; the thinking block goes back in the history (interleaved thinking)
    question = [{"role": "user", "content": QUESTION}]
    msg = claude.messages.create(model=MODEL, max_tokens=160, messages=question, tools=[ANTHROPIC_TOOL])
    call = _weather_call(msg.content)
    history = question + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]},
        {"role": "user",
         "content": [{"type": "tool_result", "tool_use_id": call.id, "content": TOOL_RESULT}]},
    ]
    answer = claude.messages.create(model=MODEL, max_tokens=160, messages=history, tools=[ANTHROPIC_TOOL])
    assert answer.stop_reason == "end_turn"
    text = "".join(b.text for b in answer.content if b.type == "text")
    assert RESULT in text
    assert "does not verify" not in server.log()  # our own signature verified
    # a thinking block whose signature does not verify is still used, with a warning: never a 400
    history[1]["content"][0]["signature"] = "forged"
    again = claude.messages.create(model=MODEL, max_tokens=160, messages=history, tools=[ANTHROPIC_TOOL])
    assert RESULT in "".join(b.text for b in again.content if b.type == "text")
    assert "signature does not verify" in server.log()


def test_messages_thinking_disabled_returns_no_thinking_blocks(claude):
    msg = claude.messages.create(model=MODEL, max_tokens=160, tools=[ANTHROPIC_TOOL],
                                 thinking={"type": "disabled"},
                                 messages=[{"role": "user", "content": QUESTION}])
    assert [b.type for b in msg.content] == ["tool_use"]
    _weather_call(msg.content)


def test_messages_stop_sequence_streamed_and_not(claude):
    # stop_reason stop_sequence names the string that matched (tiny-chat's reasoning names the city)
    kwargs = dict(model=MODEL, max_tokens=160, messages=[{"role": "user", "content": QUESTION}],
                  tools=[ANTHROPIC_TOOL], stop_sequences=["never-said", "Paris"])
    msg = claude.messages.create(**kwargs)
    with claude.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    for m in (msg, final):
        assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", "Paris")
        assert not any(b.type == "tool_use" for b in m.content)
        assert "Paris" not in "".join(b.thinking for b in m.content if b.type == "thinking")


def test_count_tokens_matches_tokenize(claude, server):
    # the same conversation through /tokenize in chat-completions form gives the same count
    count = claude.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                         tools=[ANTHROPIC_TOOL], system="Be brief.")
    ref = httpx.post(server.url + "/tokenize", headers={"Authorization": f"Bearer {API_KEY}"}, json={
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}],
        "tools": [CHAT_TOOL]}).json()
    assert count.input_tokens == ref["count"] > 0


def test_wrong_x_api_key_is_401_in_anthropic_shape(server):
    bad = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Hi"}])
    assert e.value.status_code == 401
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "authentication_error"
    assert "x-api-key" in e.value.body["error"]["message"]


@pytest.mark.parametrize("body, field", [
    ({"messages": [{"role": "user", "content": "Hi"}]}, "max_tokens"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]},
     "messages.0.content.0"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}], "tools": [ANTHROPIC_TOOL],
      "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}],
      "output_config": {"format": {"type": "json_schema", "schema": BAD_SCHEMA}}}, "output_config.format"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}], "temperature": 1.5}, "temperature"),
])
def test_messages_400s_name_the_field(claude, body, field):
    with pytest.raises(anthropic.BadRequestError) as e:  # raw bodies: the SDK's create() needs max_tokens
        claude.post("/v1/messages", body={"model": MODEL, **body}, cast_to=httpx.Response)
    err = e.value.body
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert field in err["error"]["message"]


def test_messages_unknown_sdk_fields_and_budget_accepted(claude):
    # fields the SDK may send that the server has no use for: accepted and ignored, never a 400
    msg = claude.messages.create(
        model=MODEL, max_tokens=16, messages=[{"role": "user", "content": "Hello!"}],
        metadata={"user_id": "u1"}, service_tier="auto", thinking={"type": "enabled", "budget_tokens": 1024},
        extra_body={"container": None, "inference_geo": "eu", "speed": "fast", "diagnostics": {},
                    "user_profile_id": "p", "workspace_id": "w", "output_config": {"effort": "low"}},
        extra_headers={"anthropic-beta": "interleaved-thinking-2025-05-14"},
    )
    assert msg.stop_reason in ("end_turn", "max_tokens")


# --------------------------------------------------------------------------- OpenAI Responses


def _call(output) -> openai.types.responses.ResponseFunctionToolCall:
    calls = [o for o in output if o.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    return calls[0]


def test_responses_create_and_stream_with_function_call_output_loop(oai):
    kwargs = dict(model=MODEL, input=QUESTION, tools=[RESPONSES_TOOL], store=False,
                  include=["reasoning.encrypted_content"])
    r = oai.responses.create(**kwargs)
    assert r.status == "completed" and [o.type for o in r.output] == ["reasoning", "function_call"]
    assert r.output[0].encrypted_content and r.output[0].content[0].text.strip()
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
    call = _call(r.output)
    with oai.responses.stream(**kwargs) as stream:
        seq = [e.sequence_number for e in stream]
        final = stream.get_final_response()
    assert seq == list(range(len(seq)))
    skip = {"id", "call_id", "encrypted_content", "parsed_arguments"}  # random ids; the stream helper's parse
    assert [o.model_dump(exclude=skip) for o in final.output] == \
        [o.model_dump(exclude=skip) for o in r.output]
    # stateless loop: the reasoning item (encrypted_content only) and the call go back with the output
    reasoning = {"type": "reasoning", "id": r.output[0].id, "summary": [],
                 "encrypted_content": r.output[0].encrypted_content}
    follow = [{"role": "user", "content": QUESTION}, reasoning, call.model_dump(exclude_none=True),
              {"type": "function_call_output", "call_id": call.call_id, "output": TOOL_RESULT}]
    with oai.responses.stream(model=MODEL, input=follow, tools=[RESPONSES_TOOL], store=False) as stream:
        answer = stream.get_final_response()
    assert answer.status == "completed" and RESULT in answer.output_text


def test_previous_response_id_continues_and_get_delete(oai):
    first = oai.responses.create(model=MODEL, input=QUESTION, tools=[RESPONSES_TOOL])
    call = _call(first.output)
    answer = oai.responses.create(model=MODEL, previous_response_id=first.id, tools=[RESPONSES_TOOL],
                                  input=[{"type": "function_call_output", "call_id": call.call_id,
                                          "output": TOOL_RESULT}])
    assert RESULT in answer.output_text and answer.previous_response_id == first.id
    assert oai.responses.retrieve(answer.id).output_text == answer.output_text
    oai.responses.delete(answer.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(answer.id)
    with pytest.raises(openai.NotFoundError) as e:
        oai.responses.create(model=MODEL, previous_response_id="resp_unknown", input="Hi")
    assert e.value.body["param"] == "previous_response_id"


@pytest.mark.parametrize("kwargs, param", [
    (dict(text={"format": {"type": "json_schema", "name": "x", "schema": BAD_SCHEMA}}), "text.format"),
    (dict(tools=[RESPONSES_TOOL], tool_choice={"type": "function", "name": "nope"}), "tool_choice"),
    (dict(max_output_tokens=0), "max_output_tokens"),
])
def test_responses_400s_name_the_field(oai, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model=MODEL, input="Hi", **kwargs)
    assert param in e.value.body["message"] or e.value.body["param"] == param


def _run_weather_agent(server, result, model_class) -> tuple[list[str], str]:
    """Run an Agents SDK agent (tracing off) whose get_weather tool returns ``result``, on ``model_class``
    (OpenAIResponsesModel or OpenAIChatCompletionsModel) -> (the cities the tool got, final output)."""
    agents.set_tracing_disabled(True)
    seen = []

    @agents.function_tool
    def get_weather(city: str):
        """Get the weather for a city"""
        seen.append(city)
        return result

    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    agent = agents.Agent(name="weather", tools=[get_weather],
                         model=model_class(model=MODEL, openai_client=client))
    return seen, asyncio.run(agents.Runner.run(agent, QUESTION)).final_output


def test_agents_sdk_function_tool_loop(server):
    seen, output = _run_weather_agent(server, TOOL_RESULT, agents.OpenAIResponsesModel)
    assert seen == ["Paris"]
    assert RESULT in output


def test_agents_sdk_chat_completions_model_with_a_dict_returning_tool(server):
    # issue 15 item 4: the Agents SDK's chat completions model sends a tool's dict back as Python's
    # str(dict), and the call turn without reasoning; tiny-chat's answer carries the dict's values
    weather = {"city": "Paris", "temperature_c": 18, "condition": "sunny"}
    seen, output = _run_weather_agent(server, weather, agents.OpenAIChatCompletionsModel)
    assert seen == ["Paris"]
    assert all(str(v) in output for v in weather.values()), output


# --------------------------------------------------------------------------- three APIs, one pipeline


def test_same_greedy_request_three_apis(oai, claude):
    # issue 19: the same greedy request through chat completions, messages and responses gives the same
    # reasoning, text and tool call (each API converts to the same chat job)
    question = [{"role": "user", "content": QUESTION}]
    c = oai.chat.completions.create(model=MODEL, messages=question, tools=[CHAT_TOOL], temperature=0,
                                    max_tokens=160).choices[0].message
    chat = ((c.model_extra or {}).get("reasoning_content"), c.content or "",
            [(t.function.name, json.loads(t.function.arguments)) for t in c.tool_calls or ()])
    m = claude.messages.create(model=MODEL, messages=question, tools=[ANTHROPIC_TOOL], max_tokens=160,
                               thinking={"type": "enabled", "budget_tokens": 1024},
                               extra_body={"temperature": 0})  # anthropic 2.15 has no sampling arguments
    messages = ("".join(b.thinking for b in m.content if b.type == "thinking"),
                "".join(b.text for b in m.content if b.type == "text"),
                [(b.name, b.input) for b in m.content if b.type == "tool_use"])
    r = oai.responses.create(model=MODEL, input=question, tools=[RESPONSES_TOOL], temperature=0,
                             max_output_tokens=160)
    responses = ("".join(p.text for o in r.output if o.type == "reasoning" for p in o.content), r.output_text,
                 [(o.name, json.loads(o.arguments)) for o in r.output if o.type == "function_call"])
    assert chat == messages == responses
    assert chat[2] == [("get_weather", {"city": "Paris"})] and chat[0].strip()


def test_access_log_one_line_per_request_and_errors_with_message(server, claude):
    # issue 15 item 3: one access-log line per request (method, path, status, latency, tokens) at the
    # default level; a 4xx is logged with its message
    tag = "access-log-probe"
    claude.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": tag}])
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": tag}],
                               tool_choice={"type": "tool", "name": "nope"}, tools=[ANTHROPIC_TOOL])
    log = server.log()
    ok = re.findall(r"POST /v1/messages 200 [\d.]+ ms prompt_tokens=(\d+) completion_tokens=(\d+)", log)
    assert ok and all(int(p) > 0 and int(c) > 0 for p, c in ok)
    assert re.search(r"WARNING m2serve.access: POST /v1/messages 400 [\d.]+ ms .*error=.*tool_choice", log)


# --------------------------------------------------------------------------- continuing the last message

REPEAT = "Repeat after me: the sky is blue"
PREFILL = [{"role": "user", "content": REPEAT}, {"role": "assistant", "content": "the sky"}]


def test_messages_prefilled_assistant_turn_is_continued(claude):
    """A last assistant message is Anthropic's prefill: the reply continues its text (no new turn, so no
    thinking block: the prompt does not end in <think>), and the content is the continuation only;
    count_tokens counts the same prompt. Before, the prefill was rendered as a finished turn and a new
    one started with its own reasoning."""
    msg = claude.messages.create(model=MODEL, max_tokens=16, messages=PREFILL, extra_body={"temperature": 0})
    assert [b.type for b in msg.content] == ["text"] and msg.stop_reason == "end_turn"
    assert "blue" in msg.content[0].text and "the sky" not in msg.content[0].text
    counted = claude.messages.count_tokens(model=MODEL, messages=PREFILL).input_tokens
    assert counted == msg.usage.input_tokens + msg.usage.cache_read_input_tokens
    # prefills the Messages API refuses, named by the client's own message index (a system prompt is
    # not a message): a tool_use block, text ending in whitespace
    call = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]}]
    for messages in (call, [PREFILL[0], {"role": "assistant", "content": "the "}]):
        kwargs = dict(model=MODEL, system="Be brief.", messages=messages, tools=[ANTHROPIC_TOOL])
        with pytest.raises(anthropic.BadRequestError) as created:
            claude.messages.create(max_tokens=8, **kwargs)
        with pytest.raises(anthropic.BadRequestError) as counted:
            claude.messages.count_tokens(**kwargs)
        for e in (created, counted):
            assert e.value.body["error"]["message"].startswith("messages.1"), e.value.body


def test_chat_continue_final_message_as_vllm(oai, server):
    """vLLM's continue_final_message (add_generation_prompt off unless sent): the same continuation, the
    same prompt as /tokenize renders; both flags true, or a last message that is not the assistant's, is
    a 400 naming the field."""
    r = oai.chat.completions.create(model=MODEL, messages=PREFILL, temperature=0, max_tokens=16,
                                    extra_body={"continue_final_message": True})
    message = r.choices[0].message
    assert "blue" in message.content and "the sky" not in message.content
    assert getattr(message, "reasoning_content", None) is None
    auth = {"Authorization": f"Bearer {API_KEY}"}
    tok = httpx.post(server.url + "/tokenize", headers=auth,
                     json={"messages": PREFILL, "continue_final_message": True,
                           "add_generation_prompt": False})
    assert tok.json()["count"] == r.usage.prompt_tokens
    both = httpx.post(server.url + "/tokenize", headers=auth,
                      json={"messages": PREFILL, "continue_final_message": True,
                            "add_generation_prompt": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=PREFILL, max_tokens=4,
                                    extra_body={"continue_final_message": True,
                                                "add_generation_prompt": True})
    assert e.value.body["param"] == "continue_final_message", e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=PREFILL[:1], max_tokens=4,
                                    extra_body={"continue_final_message": True})
    assert e.value.body["param"] == "messages" and "only an assistant message" in e.value.body["message"]
