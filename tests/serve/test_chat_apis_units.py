"""Each API's request -> chat job and pipeline delta -> events conversion, without a server (issue 19
"Must show"). Expected chat messages are hand-derived from the API documents; Anthropic stream events are
assembled by the ``anthropic`` SDK's own accumulator and compared with the builder's message."""

from __future__ import annotations

import json
from types import SimpleNamespace

import openai
import pydantic
import pytest
from anthropic.lib.streaming._messages import accumulate_event

from m2serve.engine.sampling import TokenLogprobs
from m2serve.serve.anthropic.messages import MessageStream, message, messages_job
from m2serve.serve.anthropic.protocol import MessagesRequest
from m2serve.serve.chat_pipeline import ChoiceCollector, ChoiceDelta, TokenUsage, constraint_spec
from m2serve.serve.context import ModelCapabilities, ResponseStore
from m2serve.serve.errors import APIError
from m2serve.serve.openai.responses import ResponseBuilder, ResponsesRequest, responses_job
from m2serve.serve.output import OutputDelta
from m2serve.serve.sealing import Sealer
from m2serve.text.constraint import tool_calls_spec
from m2serve.text.parser import ToolCallDelta

SEALER = Sealer("unit-key")
CTX = SimpleNamespace(
    caps=ModelCapabilities(4096, 1000, 16, True, True), sealer=SEALER, responses=ResponseStore(2)
)
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}
EVENTS = pydantic.TypeAdapter(openai.types.responses.ResponseStreamEvent)  # the openai SDK's event types
CALL_ID = "call_" + "ab" * 12


def _delta(reasoning="", content="", calls=(), finished=False, finish_reason=None, logprobs=None, tail=""):
    d = OutputDelta(
        "r-0-0",
        text=reasoning + content,
        reasoning=reasoning,
        content=content,
        tool_calls=list(calls),
        token_ids=[1],
        logprobs=logprobs,
        finished=finished,
        finish_reason=finish_reason,
        tail=tail,
    )
    return ChoiceDelta(0, 0, d)


def _stream(deltas):
    """``deltas`` as the pipeline's stream yields them: collected, the last one carrying the finished
    choice (chat_pipeline.stream)."""
    collector, out = ChoiceCollector({"r-0-0": (0, 0)}), []
    for d in deltas:
        d = ChoiceDelta(d.index, d.prompt_index, d.delta)
        collector.add(d)
        if d.delta.finished:
            d.choice = collector.choice("r-0-0")
        out.append(d)
    return out


# a choice that reasons in two pieces then calls get_weather({"city": "Paris"}) in two argument pieces
DELTAS = [
    _delta(reasoning="Need the "),
    _delta(reasoning="weather."),
    _delta(calls=[ToolCallDelta(0, "", CALL_ID, "function", "get_weather")]),
    _delta(calls=[ToolCallDelta(0, '{"city": ')]),
    _delta(calls=[ToolCallDelta(0, '"Paris"}')], finished=True, finish_reason="tool_calls"),
]
# the same call cut by the token limit inside its value: the last delta carries the last argument
# fragment and the parser's finish step adds the call's raw text as content (P18), after it
RAW = '<invoke name="get_weather">\n<parameter name="city">Par'
CUT = [
    *DELTAS[:3],
    _delta(calls=[ToolCallDelta(0, '{"city": "Pa')]),
    _delta(content=RAW, tail=RAW, calls=[ToolCallDelta(0, "r")], finished=True, finish_reason="length"),
]


def test_pieces_split_order_and_logprobs_on_first_piece():
    lps = [TokenLogprobs(5, -0.1, 1, [])]
    d = _delta(
        reasoning="r", content="c", calls=[ToolCallDelta(0, "{}", CALL_ID, "function", "f")], logprobs=lps
    )
    pieces = d.pieces()
    assert [p.kind for p in pieces] == ["reasoning", "content", "tool_calls"]
    assert pieces[0].logprobs == lps and pieces[1].logprobs is None and pieces[2].logprobs is None
    only_lps = _delta(logprobs=lps).pieces()  # a token whose text went nowhere (a parser tag)
    assert [(p.kind, p.logprobs) for p in only_lps] == [("logprobs", lps)]
    # the content the parser's finish step added (a cut call's raw text) follows the call's fragments
    last = _delta(content="x" + RAW, tail=RAW, calls=[ToolCallDelta(0, "r")]).pieces()
    assert [(p.kind, p.text) for p in last] == [("content", "x"), ("tool_calls", ""), ("content", RAW)]
    assert [p.kind for p in _delta(content=RAW, tail=RAW).pieces()] == ["content"]


# --------------------------------------------------------------------------- Anthropic


def test_messages_request_to_chat_job():
    signature = SEALER.sign("I need the weather.")
    req = MessagesRequest(
        model="m",
        max_tokens=50,
        stop_sequences=["END"],
        temperature=0.5,
        top_k=3,
        system=[{"type": "text", "text": "Be brief."}],
        tools=[
            {"name": "get_weather", "description": "Weather", "input_schema": SCHEMA, "cache_control": {}}
        ],
        tool_choice={"type": "auto", "disable_parallel_tool_use": True},
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "I need the weather.", "signature": signature},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": [{"type": "text", "text": "sunny"}],
                    },
                    {"type": "text", "text": "Thanks"},
                ],
            },
        ],
        container="ignored",
        speed="fast",  # SDK fields the server has no use for
    )
    job, thinking = messages_job(CTX, req)
    assert thinking is True and job.one_call is True and job.tool_choice == "auto"
    assert job.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "I need the weather.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "user", "content": "Thanks"},
    ]
    assert job.tools == [
        {
            "type": "function",
            "function": {"name": "get_weather", "description": "Weather", "parameters": SCHEMA},
        }
    ]
    p = job.params
    assert (p.max_tokens, p.stop, p.temperature, p.top_k, p.top_p) == (50, ("END",), 0.5, 3, None)
    disabled = MessagesRequest(
        model="m",
        max_tokens=5,
        messages=[{"role": "user", "content": "x"}],
        thinking={"type": "disabled"},
        tool_choice={"type": "none"},
    )
    job, thinking = messages_job(CTX, disabled)
    assert thinking is False and job.tool_choice == "none"


@pytest.mark.parametrize(
    "extra, param",
    [
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "messages.0.content.0.type",
        ),
        ({"tool_choice": {"type": "tool"}}, "tool_choice.name"),
        ({"tools": [{"name": "web_search", "type": "web_search_20250305"}]}, "tools.0.type"),
        (
            {"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t"}]}]},
            "messages.0.content.0.name",
        ),
        ({"output_config": {"format": {"type": "json_schema"}}}, "output_config.format"),
    ],
)
def test_messages_request_errors_name_the_field(extra, param):
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}], **extra}
    with pytest.raises(APIError) as e:
        messages_job(CTX, MessagesRequest(**body))
    assert e.value.status == 400 and e.value.param == param


def _accumulate(events):
    """The anthropic SDK's own accumulation of a stream's events."""
    snapshot, bufs = None, {}
    for _, data in events:
        if data["type"] != "ping":
            snapshot = accumulate_event(event=data, current_snapshot=snapshot, json_bufs=bufs)
    return snapshot


def test_message_stream_events_assemble_to_the_message():
    b = MessageStream("msg_1", "m", SEALER, thinking=True)
    usage = TokenUsage(prompt=10, output=5, reasoning=2, cached=4)
    events = b.start(usage)
    deltas = _stream(DELTAS)
    for d in deltas:
        events += b.feed(d)
    events += b.finish(deltas[-1].choice, usage)
    assert [name for name, _ in events] == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_delta",  # + signature
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert [data["delta"]["type"] for name, data in events if name == "content_block_delta"] == [
        "thinking_delta",
        "thinking_delta",
        "signature_delta",
        "input_json_delta",
        "input_json_delta",
    ]
    snapshot = _accumulate(events)
    msg = message("msg_1", "m", deltas[-1].choice, usage, True, SEALER)
    assert snapshot.model_dump(exclude_none=True)["content"] == msg["content"]
    assert msg["content"] == [
        {"type": "thinking", "thinking": "Need the weather.", "signature": SEALER.sign("Need the weather.")},
        {"type": "tool_use", "id": "toolu_" + "ab" * 12, "name": "get_weather", "input": {"city": "Paris"}},
    ]
    assert (msg["stop_reason"], snapshot.stop_reason) == ("tool_use", "tool_use")
    assert msg["usage"]["input_tokens"] == 6 and msg["usage"]["cache_read_input_tokens"] == 4
    # thinking disabled: the same deltas give only the tool_use block, streamed and not
    quiet = MessageStream("msg_2", "m", SEALER, thinking=False)
    events = quiet.start(usage) + [e for d in deltas for e in quiet.feed(d)]
    events += quiet.finish(deltas[-1].choice, usage)
    assert [blk.type for blk in _accumulate(events).content] == ["tool_use"]
    assert [blk["type"] for blk in message("m", "m", deltas[-1].choice, usage, False, SEALER)["content"]] == \
        ["tool_use"]


def test_message_with_a_cut_call_streamed_and_not():
    # docs/serving.md §10.1: not streamed, the cut call is its raw text (P18), never a tool_use with
    # input {}; streamed, its block already started: it stops as it stands, the raw text follows as a
    # text block, and both end with stop_reason max_tokens
    usage = TokenUsage(prompt=10, output=5)
    deltas = _stream(CUT)
    msg = message("msg_1", "m", deltas[-1].choice, usage, True, SEALER)
    assert msg["content"] == [
        {"type": "thinking", "thinking": "Need the weather.", "signature": SEALER.sign("Need the weather.")},
        {"type": "text", "text": RAW},
    ]
    assert msg["stop_reason"] == "max_tokens"
    b = MessageStream("msg_1", "m", SEALER, thinking=True)
    events = b.start(usage) + [e for d in deltas for e in b.feed(d)] + b.finish(deltas[-1].choice, usage)
    snapshot = _accumulate(events)
    assert [blk.type for blk in snapshot.content] == ["thinking", "tool_use", "text"]
    assert snapshot.content[2].text == RAW and snapshot.stop_reason == "max_tokens"
    json_deltas = [data["delta"]["partial_json"] for _, data in events
                   if data["type"] == "content_block_delta" and data["delta"]["type"] == "input_json_delta"]
    assert "".join(json_deltas) == '{"city": "Par'  # the prefix sent before the cut, then nothing more
    starts = [(name, data.get("index")) for name, data in events if name.startswith("content_block_s")]
    assert starts == [("content_block_start", 0), ("content_block_stop", 0), ("content_block_start", 1),
                      ("content_block_stop", 1), ("content_block_start", 2), ("content_block_stop", 2)]


# --------------------------------------------------------------------------- Responses


def test_responses_request_to_chat_job():
    sealed = SEALER.seal("Need the weather.")
    req = ResponsesRequest(
        model="m",
        instructions="Be brief.",
        max_output_tokens=40,
        temperature=0.2,
        parallel_tool_calls=False,
        tools=[{"type": "function", "name": "get_weather", "parameters": SCHEMA, "strict": True}],
        input=[
            {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": sealed},
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "get_weather",
                "arguments": '{"city":"Paris"}',
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
            {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "Answer."}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]},
            {"role": "user", "content": "Thanks"},
        ],
        reasoning={"effort": "low"},
        truncation="auto",
        prompt_cache_key="k",
        max_tool_calls=3,
    )
    job, history = responses_job(CTX, req)
    assert job.messages[0] == {"role": "system", "content": "Be brief."} and history == job.messages[1:]
    assert history == [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Need the weather.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "assistant", "content": "Sunny.", "reasoning_content": "Answer."},
        {"role": "user", "content": "Thanks"},
    ]
    assert job.tools == [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]
    assert job.one_call and (job.params.max_tokens, job.params.temperature) == (40, 0.2)
    assert job.max_tool_calls == 3
    assert responses_job(CTX, ResponsesRequest(input="Hi"))[1] == [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"input": "x", "tool_choice": {"type": "function"}}, 400, "tool_choice"),
        ({"input": "x", "text": {"format": {"type": "json_schema"}}}, 400, "text.format"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
            400,
            "input.0.content.0.type",
        ),
        ({"input": [{"type": "item_reference", "id": "x"}]}, 400, "input.0.type"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools.0.type"),
        ({"input": "x", "previous_response_id": "resp_gone"}, 404, "previous_response_id"),
        ({"input": "x", "max_output_tokens": None, "temperature": None}, None, None),
    ],
)
def test_responses_request_errors_name_the_field(body, status, param):
    if status is None:
        responses_job(CTX, ResponsesRequest(**body))
        return
    with pytest.raises(APIError) as e:
        responses_job(CTX, ResponsesRequest(**body))
    assert (e.value.status, e.value.param) == (status, param)


def test_responses_max_tool_calls_caps_a_forced_turn():
    """``max_tool_calls`` reaches the grammar of a required turn (1 to K invokes); without it the
    default cap (one per declared tool, here 1) applies."""
    tools = [{"type": "function", "name": "get_weather", "parameters": SCHEMA}]
    job, _ = responses_job(CTX, ResponsesRequest(input="x", tools=tools, tool_choice="required",
                                                 max_tool_calls=3))
    assert job.max_tool_calls == 3
    assert "invoke{1,3}" in constraint_spec(job).body
    assert constraint_spec(job).key == tool_calls_spec(job.tools, max_calls=3).key
    job, _ = responses_job(CTX, ResponsesRequest(input="x", tools=tools, tool_choice="required"))
    assert "invoke{1,1}" in constraint_spec(job).body


def test_response_builder_events_and_output():
    req = ResponsesRequest(input="x", include=["reasoning.encrypted_content"])
    b = ResponseBuilder(req, "m", SEALER)
    deltas = _stream(DELTAS)
    events = b.start()
    for d in deltas:
        events += b.feed(d)
    events += b.finish(deltas[-1].choice, TokenUsage(10, 5, 2, 0))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    out = events[-1]["response"]["output"]
    assert [o["type"] for o in out] == ["reasoning", "function_call"]
    assert SEALER.open(out[0]["encrypted_content"]) == "Need the weather." == out[0]["content"][0]["text"]
    assert (out[1]["call_id"], out[1]["name"], json.loads(out[1]["arguments"])) == (
        CALL_ID,
        "get_weather",
        {"city": "Paris"},
    )
    # the final state is the items the stream sent, by id, as each output_item.done had it
    assert out == [e["item"] for e in events if e["type"] == "response.output_item.done"]
    # the deltas assemble to the items' texts
    args = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert args == out[1]["arguments"]
    assert events[-1]["response"]["usage"]["output_tokens_details"]["reasoning_tokens"] == 2
    # the non-streamed response of the same finished choice: the same items but their random ids
    ns = ResponseBuilder(req, "m", SEALER)
    ns.complete(deltas[-1].choice, TokenUsage(10, 5, 2, 0))
    def blank(o):
        return {**o, "id": None, "encrypted_content": None}

    assert [blank(o) for o in ns.response()["output"]] == [blank(o) for o in out]
    assert deltas[-1].choice.output.history_message() == {
        "role": "assistant",
        "content": "",
        "reasoning_content": "Need the weather.",
        "tool_calls": [
            {
                "id": CALL_ID,
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    }
    cut = ResponseBuilder(req, "m", SEALER)
    last = _stream([_delta(content="Hel"), _delta(content="lo", finished=True, finish_reason="length")])
    cut.feed(last[0])
    events = cut.finish(last[1].choice, TokenUsage())
    assert events[-1]["type"] == "response.incomplete"
    # the message the limit cut ends "incomplete", in its output_item.done and in the final response
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [(o["type"], o["status"]) for o in done] == [("message", "incomplete")]
    assert events[-1]["response"]["output"][-1]["status"] == "incomplete"
    whole = ResponseBuilder(req, "m", SEALER)
    whole.complete(last[1].choice, TokenUsage())
    assert [(o["type"], o["status"]) for o in whole.response()["output"]] == [("message", "incomplete")]


def test_response_with_a_cut_call_streamed_and_not():
    # docs/serving.md §10.1: not streamed, the cut call is a message with its raw text (P18), never a
    # function_call with truncated arguments; streamed, its item already went out: it ends with status
    # incomplete (no function_call_arguments.done), the raw text follows as a message item, and the
    # response.incomplete object lists exactly the items the stream sent
    req = ResponsesRequest(input="x")
    deltas = _stream(CUT)
    ns = ResponseBuilder(req, "m", SEALER)
    ns.complete(deltas[-1].choice, TokenUsage(10, 5))
    r = openai.types.responses.Response.model_validate(ns.response())
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert [o.type for o in r.output] == ["reasoning", "message"] and r.output_text == RAW
    # the item the limit cut says so, as OpenAI's does (vLLM reports it "completed")
    assert [o.status for o in r.output] == ["completed", "incomplete"]
    b = ResponseBuilder(req, "m", SEALER)
    events = b.start() + [e for d in deltas for e in b.feed(d)]
    events += b.finish(deltas[-1].choice, TokenUsage(10, 5))
    events = [EVENTS.validate_python(e) for e in events]
    assert "response.function_call_arguments.done" not in [e.type for e in events]
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(o.type, o.status) for o in done] == [("reasoning", "completed"), ("function_call", "incomplete"),
                                                  ("message", "incomplete")]
    assert done[1].arguments == '{"city": "Par' and done[2].content[0].text == RAW
    final = events[-1]
    assert final.type == "response.incomplete" and final.response.output == done
    assert deltas[-1].choice.output.history_message() == {"role": "assistant", "content": RAW,
                                                          "reasoning_content": "Need the weather."}


def test_response_store_is_bounded():
    store = ResponseStore(2)
    for k in "abc":
        store.put(k, k)
    assert (store.get("a"), store.get("b"), store.get("c")) == (None, "b", "c")


def test_sealer_round_trip_and_tamper():
    sealed = SEALER.seal("secret reasoning é")
    assert "secret" not in sealed and SEALER.open(sealed) == "secret reasoning é"
    assert Sealer("other-key").open(sealed) is None
    raw = bytearray(sealed.encode())
    raw[30] = ord("A") if raw[30] != ord("A") else ord("B")
    assert SEALER.open(raw.decode()) is None
    assert SEALER.verify("t", SEALER.sign("t")) and not SEALER.verify("t", Sealer("other").sign("t"))
    assert Sealer("unit-key").sign("t") == SEALER.sign(
        "t"
    )  # the same key signs the same (replicas, restarts)
