"""The offline ``LLM.chat`` is a facade over the server's chat pipeline (docs/architecture.md, serve/).

Embedded tiny-chat, fp32, greedy. Assertions are on structure (a get_weather call whose city is Paris,
JSON that the ``jsonschema`` package validates), so retraining the model cannot break them; the
comparisons with the server go through its real HTTP app (FastAPI TestClient): the same greedy request
gives the same tokens, and an over-long prompt the same error, since both run the same pipeline
functions. The length limit is checked against engine/request.py's rule, written out by hand here.
"""

from __future__ import annotations

import inspect
import io
import json
import tokenize

import jsonschema
import pytest
from fastapi.testclient import TestClient
from serve_helpers import WEATHER_SCHEMA

from m2serve.engine.sampling import SamplingParams
from m2serve.serve import chat_pipeline as cp
from m2serve.serve import llm as llm_module
from m2serve.serve.api import ServerSettings, build_app
from m2serve.serve.async_engine import AsyncEngine
from m2serve.serve.llm import LLM

MAX_LENGTH = 1024
QUESTION = [{"role": "user", "content": "What's the weather in Paris?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
SCHEMA = WEATHER_SCHEMA
GREEDY = SamplingParams(temperature=0.0, max_tokens=256)


@pytest.fixture(scope="module")
def llm():
    return LLM(None, dtype="float32", num_kv_pages=256, kv_cache_page_size=16, max_batch_input_tokens=2048,
               max_length=MAX_LENGTH)


def _calls(output) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in output.tool_calls]


def test_chat_with_tools_returns_a_parsed_get_weather_call(llm):
    o = llm.chat(QUESTION, GREEDY, tools=[WEATHER]).outputs[0]
    assert o.finish_reason == "tool_calls"
    assert _calls(o) == [("get_weather", {"city": "Paris"})]
    assert o.tool_calls[0].id.startswith("call_") and o.reasoning
    # tool_choice none: the tool is rendered but a call can never be generated
    none = llm.chat(QUESTION, GREEDY, tools=[WEATHER], tool_choice="none").outputs[0]
    assert none.tool_calls == [] and "<minimax:tool_call>" not in none.text


def test_chat_named_tool_choice_n_choices_one_call_each(llm):
    # tiny-chat calls get_weather for this question; a named choice of another tool forces that one
    get_time = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}}, "required": ["zone"]}}}
    named = {"type": "function", "function": {"name": "get_time"}}
    params = SamplingParams(temperature=0.0, max_tokens=256, n=2)
    r = llm.chat(QUESTION, params, tools=[WEATHER, get_time], tool_choice=named, parallel_tool_calls=False)
    assert [o.index for o in r.outputs] == [0, 1]
    for o in r.outputs:  # each choice its own matcher: one get_time call with valid arguments
        [(name, args)] = _calls(o)
        assert name == "get_time" and o.finish_reason == "tool_calls"
        jsonschema.validate(args, get_time["function"]["parameters"])
    with pytest.raises(ValueError, match="tool_choice="):
        llm.chat(QUESTION, GREEDY, tools=[WEATHER], tool_choice="any")


def test_chat_json_schema_response_format_validates(llm):
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}
    o = llm.chat(QUESTION, GREEDY, response_format=fmt).outputs[0]
    assert o.finish_reason == "stop"
    jsonschema.validate(json.loads(o.content), SCHEMA)
    bad = {"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {
        "code": {"type": "string", "pattern": "(unclosed"}}}}}
    with pytest.raises(ValueError, match="response_format"):  # does not compile: the server's 400, named
        llm.chat(QUESTION, GREEDY, response_format=bad)
    assert not llm.has_unfinished_requests()


def test_a_grammar_that_fails_while_decoding_raises_like_the_servers_400(llm):
    """``a{100000}`` compiles, then llguidance's lexer gives up at the first step: the engine ends the
    choice with "stop" and no text, which the offline API returned as an empty success. It raises the
    server's 400 message, naming the field, with the other request of the batch aborted; the LLM goes on."""
    fail = {"regex": "a{100000}"}
    with pytest.raises(ValueError, match=r"^structured_outputs\.regex: the grammar failed during decoding"):
        llm.chat([QUESTION, QUESTION], GREEDY, structured_outputs=fail)
    assert not llm.has_unfinished_requests()
    ok = llm.chat(QUESTION, GREEDY, structured_outputs={"choice": ["yes", "no"]}).outputs[0]
    assert ok.content in ("yes", "no") and ok.finish_reason == "stop"


def test_chat_goes_through_the_pipeline(llm, monkeypatch):
    # LLM.chat builds the ChatJob and prepares it with the pipeline's prepare_blocking, whose
    # render_template is the one renderer: a marked rendering shows up in the offline result
    jobs, real_render = [], cp.render_template
    real_prepare = cp.prepare_blocking

    def prepare_spy(ctx, job):
        jobs.append(job)
        return real_prepare(ctx, job)

    monkeypatch.setattr(cp, "prepare_blocking", prepare_spy)
    monkeypatch.setattr(cp, "render_template", lambda *a, **k: real_render(*a, **k) + "Sure.")
    params = SamplingParams(temperature=0.0, max_tokens=4)
    r = llm.chat(QUESTION, params, tools=[WEATHER], reasoning_split=False, reasoning_budget=8)
    [job] = jobs
    assert (job.messages, job.tools, job.params, job.reasoning_split, job.reasoning_budget) == (
        QUESTION, [WEATHER], params, False, 8)
    assert r.prompt.endswith("<think>\nSure.") and r.prompt_token_ids == llm.encode(r.prompt)
    # and llm.py's code (docstrings and comments aside) renders, parses and checks lengths nowhere itself
    tokens = tokenize.generate_tokens(io.StringIO(inspect.getsource(llm_module)).readline)
    code = " ".join(t.string for t in tokens if t.type not in (tokenize.STRING, tokenize.COMMENT))
    for name in ("render (", "StreamingParser", "starts_in_reasoning", "prompt_length_error"):
        assert name not in code, name
    assert "cp . render_template (" in code and "cp . prepare_blocking (" in code


def _long_conversation(llm) -> tuple[list[dict], int]:
    """A conversation whose rendered prompt has more than MAX_LENGTH - 1 tokens."""
    content = "Paris " * MAX_LENGTH
    messages = [{"role": "user", "content": content}]
    n = len(llm.encode(llm.render_chat(messages)))
    assert MAX_LENGTH <= n and len(llm.render_chat(messages)) <= MAX_LENGTH * llm.tokenizer.max_token_chars
    return messages, n


def test_same_greedy_tokens_and_length_error_as_the_server(llm):
    params = SamplingParams(temperature=0.0, max_tokens=256, logprobs=0)
    offline = llm.chat(QUESTION, params, tools=[WEATHER]).outputs[0]
    messages, n = _long_conversation(llm)
    with pytest.raises(ValueError) as offline_err:
        llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=1))
    app = build_app(AsyncEngine(llm), ServerSettings(served_model_name="tiny-chat"))
    with TestClient(app) as client:
        body = {"messages": QUESTION, "tools": [WEATHER], "temperature": 0, "max_tokens": 256,
                "logprobs": True}
        resp = client.post("/v1/chat/completions", json=body)
        too_long = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
    assert resp.status_code == 200, resp.text
    [choice] = resp.json()["choices"]
    served = [(t["token"], t["logprob"]) for t in choice["logprobs"]["content"]]
    assert served == [(llm.token_text(lp.token_id), lp.logprob) for lp in offline.logprobs]
    assert len(served) == len(offline.token_ids) == resp.json()["usage"]["completion_tokens"]
    msg = choice["message"]
    assert (msg["reasoning_content"], msg["content"], choice["finish_reason"]) == (
        offline.reasoning, offline.content, offline.finish_reason)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == [
        (c.name, c.arguments) for c in offline.tool_calls]
    # the same prompt-length rule (prompt + 1 <= max_length) and message on both paths
    assert too_long.status_code == 400
    err = too_long.json()["error"]
    assert err["param"] == "messages" and err["code"] == "context_length_exceeded"
    assert f"the prompt has {n} tokens but the max context of {MAX_LENGTH} tokens" in err["message"]
    assert str(offline_err.value) == f"messages: {err['message']}"


@pytest.mark.parametrize("cut", ["</invoke", '<parameter name="city">Par', '<invoke name="get_w'])
def test_collected_result_returns_only_closed_calls(cut):
    """Generation stopped inside the second invoke: streamed per character, the collected choice keeps
    the closed call only (docs/parsers.md P18: the unclosed invoke is content, P26: only streaming
    cannot take its header back), with the hand-derived arguments, and the cut text as content."""
    from m2serve.serve.chat_pipeline import ChoiceAccumulator
    from m2serve.serve.output import OutputDelta
    from m2serve.text.parser import StreamingParser

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    closed = '<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n</invoke>\n'
    second = '<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n</invoke'
    text = "<minimax:tool_call>\n" + closed + second[:second.index(cut) + len(cut)]
    parser = StreamingParser(tools)
    acc = ChoiceAccumulator(0)
    for ch in text:
        d = parser.feed(ch)
        acc.add(OutputDelta("r", text=ch, reasoning=d.reasoning, content=d.content,
                            tool_calls=list(d.tool_calls)))
    d = parser.finish()
    acc.add(OutputDelta("r", reasoning=d.reasoning, content=d.content, tool_calls=list(d.tool_calls),
                        finished=True, finish_reason="length"))
    out = acc.result()
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("get_weather", {"city": "Paris"})]
    assert out.content is not None and out.content.startswith('<invoke name="get_w')
    assert out.finish_reason == "length"
    # the finished choice's parts in stream order (docs/serving.md §10.1): the cut call is there only
    # when its header was sent (a complete name), and only a stream's final state keeps it
    header_sent = cut != '<invoke name="get_w'
    assert [(p.kind, p.call and p.call.complete) for p in out.parts] == \
        [("tool_call", True)] + [("tool_call", False)] * header_sent + [("content", None)]
    assert [(p.kind, p.call and p.call.complete) for p in out.returned_parts(streamed=False)] == \
        [("tool_call", True), ("content", None)]
    assert out.returned_parts(streamed=True) == out.parts
    assert out.history_message()["tool_calls"] == [
        {"id": out.tool_calls[0].id, "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]


def test_a_prefill_of_reasoning_goes_on_as_reasoning(llm):
    """docs/parsers.md P1 for a continued message: a prefill that opens <think> without closing it
    continues the reasoning (the parser starts in REASONING, the sampler counts reasoning tokens), so
    the model's </think> ends it and the answer is content; a prefill of answer text stays content."""
    repeat = {"role": "user", "content": "Repeat after me: the sky is blue"}
    thinking = llm.chat([repeat, {"role": "assistant", "content": "<think>\nThe user wants"}], GREEDY,
                        continue_final_message=True).outputs[0]
    assert thinking.reasoning and thinking.num_reasoning_tokens > 0
    assert "</think>" not in (thinking.content or "") and "<think>" not in thinking.reasoning
    answer = llm.chat([repeat, {"role": "assistant", "content": "the sky"}], GREEDY,
                      continue_final_message=True).outputs[0]
    assert answer.reasoning is None and answer.num_reasoning_tokens == 0 and answer.content


def test_a_continued_message_refuses_a_structured_output_or_forced_call(llm):
    # the grammar would start a new JSON value after the continued text: a 400 naming the field
    conv = [{"role": "user", "content": "Pick a city."}, {"role": "assistant", "content": '{"city": "'}]
    fmt = {"type": "json_schema", "json_schema": {"schema": SCHEMA}}
    with pytest.raises(ValueError, match=r"^response_format cannot be combined with continuing"):
        llm.chat(conv, GREEDY, response_format=fmt, continue_final_message=True)
    with pytest.raises(ValueError, match=r"^tool_choice cannot be combined with continuing"):
        llm.chat(conv, GREEDY, tools=[WEATHER], tool_choice="required", continue_final_message=True)
    assert llm.chat(conv, GREEDY, response_format=fmt).outputs[0].content is not None   # a new turn: fine


def test_a_continued_message_cannot_end_inside_a_tool_call(llm):
    # the parser never starts inside a call: it would drop the stray </minimax:tool_call> and return the
    # call's rest as content; a 400 naming the message instead
    inside = '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">'
    conv = [{"role": "user", "content": "What's the weather in Paris?"},
            {"role": "assistant", "content": inside}]
    with pytest.raises(ValueError, match=r"^messages\[1\]: a continued assistant message cannot end inside"):
        llm.chat(conv, GREEDY, tools=[WEATHER], continue_final_message=True)

