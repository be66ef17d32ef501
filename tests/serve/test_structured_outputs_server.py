"""Constrained decoding through the real ``m2serve serve`` process with real clients (issue 20 "Must show").

One server for the module (the embedded tiny-chat, fp32, greedy requests with max_tokens 256). The
clients are the libraries users run: pydantic-ai ``Agent(output_type=...)`` (it forces
``tool_choice="required"``), LangChain ``with_structured_output(...)`` (``response_format``
json_schema), the openai SDK's ``chat.completions.parse(...)``, the anthropic SDK with
``tool_choice={"type": "any"}`` and the Responses API with ``text.format``. Every result is checked
with the client's own validation (pydantic models) or the ``jsonschema`` package: structure, not
exact text. A schema or pattern that does not compile is a 400 naming the field and llguidance's
reason, and does not disturb a request running at the same time.
"""

from __future__ import annotations

import json
import re
import threading
from typing import Literal

import anthropic
import httpx
import jsonschema
import openai
import pytest
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field
from pydantic_ai import Agent
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider
from serve_helpers import FAST_ENGINE_FLAGS, WEATHER_SCHEMA, start_server

from m2serve.serve.resolve import resolve_model
from m2serve.text.tokenizer import Tokenizer

pytestmark = pytest.mark.slow  # starts server processes

API_KEY = "structured-key"
MODEL = "tiny-chat"
QUESTION = [{"role": "user", "content": "What's the weather in Paris?"}]
GREEDY = dict(temperature=0, max_tokens=256)


class Weather(BaseModel):
    """Enums, booleans, bounded integers and short strings (issue 20)."""

    city: str = Field(max_length=32)
    sky: Literal["sunny", "cloudy", "rainy"]
    warm: bool
    celsius: int = Field(ge=-30, le=45)


SCHEMA = WEATHER_SCHEMA
TOOL_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 32},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": TOOL_SCHEMA,
                                              "description": "Get the weather for a city"}}
BAD_PATTERN = {"type": "object", "properties": {"code": {"type": "string", "pattern": "(unclosed"}}}
BAD_SCHEMA = {"type": "object", "properties": {"x": {"type": "integer", "not": {"const": 3}}}}  # unsupported


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start_server(["--model", str(resolve_model(None)), "--served-model-name", MODEL, "--api-key", API_KEY,
                      *FAST_ENGINE_FLAGS], tmp_path_factory.mktemp("structured"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=300)


def test_pydantic_ai_agent_output_type(server):
    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=server.url + "/v1", api_key=API_KEY))
    agent = Agent(model, output_type=Weather, model_settings={"temperature": 0, "max_tokens": 256})
    result = agent.run_sync(QUESTION[0]["content"])
    assert isinstance(result.output, Weather)  # validated by pydantic-ai against the model


def test_langchain_with_structured_output(server):
    llm = ChatOpenAI(model=MODEL, base_url=server.url + "/v1", api_key=API_KEY, temperature=0, max_tokens=256,
                     max_retries=0)
    out = llm.with_structured_output(Weather).invoke(QUESTION[0]["content"])
    assert isinstance(out, Weather)


def test_openai_chat_completions_parse(oai):
    r = oai.chat.completions.parse(model=MODEL, messages=QUESTION, response_format=Weather, **GREEDY)
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Weather)


def test_anthropic_tool_choice_any_returns_a_tool_use(claude):
    tool = {"name": "get_weather", "description": "Get the weather for a city", "input_schema": TOOL_SCHEMA}
    msg = claude.messages.create(model=MODEL, max_tokens=256, messages=QUESTION, tools=[tool],
                                 tool_choice={"type": "any"}, extra_body={"temperature": 0})
    calls = [b for b in msg.content if b.type == "tool_use"]
    assert msg.stop_reason == "tool_use" and calls and all(c.name == "get_weather" for c in calls)
    for c in calls:
        jsonschema.validate(c.input, TOOL_SCHEMA)


def test_anthropic_output_config_format_and_thinking_budget(claude):
    budget = 4
    msg = claude.messages.create(model=MODEL, max_tokens=256, messages=QUESTION,
                                 thinking={"type": "enabled", "budget_tokens": budget},
                                 extra_body={"temperature": 0, "output_config": {
                                     "format": {"type": "json_schema", "schema": SCHEMA}}})
    text = "".join(b.text for b in msg.content if b.type == "text")
    jsonschema.validate(json.loads(text), SCHEMA)
    thinking = "".join(b.thinking for b in msg.content if b.type == "thinking")
    tok = Tokenizer.from_pretrained(resolve_model(None))
    assert len(tok.encode(thinking.strip())) <= budget + 3  # </think> forced after the budget


def test_responses_text_format_json_schema(oai):
    r = oai.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=256,
                             text={"format": {"type": "json_schema", "name": "weather", "schema": SCHEMA,
                                              "strict": True}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), SCHEMA)


def test_tool_choice_required_named_and_none(oai):
    r = oai.chat.completions.create(model=MODEL, messages=QUESTION, tools=[CHAT_TOOL], tool_choice="required",
                                    parallel_tool_calls=False, **GREEDY)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    jsonschema.validate(json.loads(calls[0].function.arguments), TOOL_SCHEMA)
    other = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}}, "required": ["zone"]}}}
    named = {"type": "function", "function": {"name": "get_time"}}
    r = oai.chat.completions.create(model=MODEL, messages=QUESTION, tools=[CHAT_TOOL, other],
                                    tool_choice=named, **GREEDY)
    calls = r.choices[0].message.tool_calls
    assert calls and {c.function.name for c in calls} == {"get_time"}
    # tiny-chat calls get_weather for this question; with tool_choice none the tag cannot be generated
    r = oai.chat.completions.create(model=MODEL, messages=QUESTION, tools=[CHAT_TOOL], tool_choice="none",
                                    **GREEDY)
    m = r.choices[0].message
    assert not m.tool_calls and "<minimax:tool_call>" not in (m.content or "")


def test_n_choices_each_get_their_own_matcher(oai):
    # raw completions (no reasoning): n = 3 samples, each a full JSON document; temperature 2, as tiny-chat
    # copies "as JSON:" into the city with near certainty at temperature 1 (three equal samples)
    r = oai.completions.create(model=MODEL, prompt="Weather report as JSON:", n=3, temperature=2.0, seed=5,
                               max_tokens=256, extra_body={"structured_outputs": {"json": SCHEMA}})
    assert len(r.choices) == 3 and len({c.text for c in r.choices}) > 1
    for c in r.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), SCHEMA)


def test_vllm_structured_outputs_on_chat_and_completions(oai):
    r = oai.completions.create(model=MODEL, prompt="The answer is", max_tokens=32, temperature=1.0, seed=3,
                               extra_body={"structured_outputs": {"regex": "[a-z]{3,6}-[0-9]{2}"}})
    assert re.fullmatch(r"[a-z]{3,6}-[0-9]{2}", r.choices[0].text)
    r = oai.chat.completions.create(model=MODEL, messages=QUESTION, **GREEDY,
                                    extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}})
    assert r.choices[0].message.content in ("yes", "no", "maybe")
    # vLLM's json_object kind, with its whitespace option (accepted, no effect): the constraint of
    # response_format json_object (any JSON object; tiny-chat's greedy one outruns 256 tokens)
    r = oai.chat.completions.create(model=MODEL, messages=QUESTION, **GREEDY, extra_body={
        "structured_outputs": {"json_object": True, "disable_any_whitespace": True}})
    same = oai.chat.completions.create(model=MODEL, messages=QUESTION, **GREEDY,
                                       response_format={"type": "json_object"})
    assert r.choices[0].message.content.startswith("{")
    assert r.choices[0].message.content == same.choices[0].message.content
    # a mistyped kind is named, not "give exactly one of ..."
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=QUESTION, **GREEDY,
                                    extra_body={"structured_outputs": {"regexp": "a"}})
    assert e.value.body["param"] == "structured_outputs.regexp", e.value.body
    assert e.value.body["message"].startswith("structured_outputs.regexp: unknown or not supported")
    # vLLM's whole StructuredOutputsParams object, its unused fields null: accepted
    whole = {"choice": ["yes", "no"], "json": None, "regex": None, "structural_tag": None,
             "disable_additional_properties": False}
    r = oai.chat.completions.create(model=MODEL, messages=QUESTION, **GREEDY,
                                    extra_body={"structured_outputs": whole})
    assert r.choices[0].message.content in ("yes", "no")
    # vLLM's older guided_* names are the same kinds (they were ignored, so the output was free text)
    r = oai.chat.completions.create(model=MODEL, messages=QUESTION, **GREEDY, extra_body={
        "guided_choice": ["maybe", "never"], "guided_decoding_backend": "xgrammar"})
    assert r.choices[0].message.content in ("maybe", "never")
    r = oai.completions.create(model=MODEL, prompt="The answer is", max_tokens=32, temperature=1.0, seed=3,
                               extra_body={"guided_regex": "[0-9]{3}"})
    assert re.fullmatch(r"[0-9]{3}", r.choices[0].text)
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=QUESTION, **GREEDY, extra_body={
            "guided_json": {"type": "object"}, "structured_outputs": {"regex": "a"}})
    assert e.value.body["param"] == "structured_outputs"
    with pytest.raises(openai.BadRequestError) as e:   # an option that would change the schema: not ignored
        oai.chat.completions.create(model=MODEL, messages=QUESTION, **GREEDY, extra_body={
            "structured_outputs": {"json": {"type": "object"}, "disable_additional_properties": True}})
    assert e.value.body["param"] == "structured_outputs.disable_additional_properties"


@pytest.mark.parametrize("schema, reason", [(BAD_PATTERN, "does not compile"), (BAD_SCHEMA, "not")])
def test_uncompilable_schema_is_a_400_naming_the_field_and_others_run_on(server, oai, schema, reason):
    good: dict = {}

    def run_good() -> None:
        good["r"] = oai.chat.completions.create(model=MODEL, messages=QUESTION, tools=[CHAT_TOOL],
                                                tool_choice="required", **GREEDY)

    t = threading.Thread(target=run_good)
    t.start()
    fmt = {"type": "json_schema", "json_schema": {"name": "bad", "schema": schema}}
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=QUESTION, response_format=fmt, **GREEDY)
    assert e.value.body["param"] == "response_format"
    assert e.value.body["message"].startswith("response_format:") and reason in e.value.body["message"]
    bad_tool = {"type": "function", "function": {"name": "f", "parameters": BAD_PATTERN}}
    resp = httpx.post(server.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                      json={"model": MODEL, "messages": QUESTION, "tools": [bad_tool],
                            "tool_choice": "required"})
    assert resp.status_code == 400 and "'f'" in resp.json()["error"]["message"]
    t.join(300)
    calls = good["r"].choices[0].message.tool_calls
    assert calls and all(c.function.name == "get_weather" for c in calls)


def test_a_grammar_that_fails_while_decoding_is_a_400_not_an_empty_stop(server, oai):
    """``a{100000}`` compiles, then llguidance's lexer gives up at the first step ("too many expressions
    constructed"): answered as the engine ends it (stop, no content) it looked like an empty success.
    It is a 400 naming the field, non-streamed, and the stream's error, streamed; the server goes on."""
    body = {"structured_outputs": {"regex": "a{100000}"}}
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=QUESTION, **GREEDY, extra_body=body)
    assert e.value.body["param"] == "structured_outputs.regex"
    assert e.value.body["message"].startswith("structured_outputs.regex: the grammar failed during decoding")
    with pytest.raises(openai.APIError) as e:
        for _ in oai.chat.completions.create(model=MODEL, messages=QUESTION, **GREEDY, extra_body=body,
                                             stream=True):
            pass
    assert "the grammar failed during decoding" in str(e.value)
    ok = oai.chat.completions.create(model=MODEL, messages=QUESTION, **GREEDY,
                                     extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert ok.choices[0].message.content in ("yes", "no")
